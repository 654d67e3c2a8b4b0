"""Mixture-of-experts policies (model/moe.py): Qwen3-MoE and Qwen2-MoE against transformers.

What is compared, with which tolerance:
* logits of specco's policy loaded from transformers' `save_pretrained` vs transformers' own forward, fp32,
  max |Δ| <= 1e-4 (observed ~1e-6), on random small configs covering the shared expert, `mlp_only_layers`,
  `decoder_sparse_step` 2, norm_topk_prob true and false;
* load -> save -> load: every tensor bit-equal; transformers loads specco's save and gives the same logits
  (<= 1e-4); transformers 5's fused 3-D expert layout loads to the same model;
* gradients of a loss on the logits, every parameter (router included), fp64, vs transformers' backward
  (rtol 1e-7 / atol 1e-10);
* the parity test can fail: the same model with the router's normalisation flipped differs by > 1e-3;
* the grouped-GEMM expert path vs the loop, outputs and gradients: fp32 on CPU through torch's CPU kernel (rtol
  1e-5), bf16 on a Hopper GPU (rtol 2e-2; skipped without one).
"""
import json

import pytest
import torch
from safetensors.torch import save_file

from specco.model.config import ConfigError, PolicyConfig
from specco.model.hf_io import load_policy, save_policy
from specco.model.moe import SparseMoE

transformers = pytest.importorskip("transformers")

V = 97
CASES = {
    # name: (model_type, config overrides)
    "qwen3-norm": ("qwen3_moe", dict(norm_topk_prob=True)),
    "qwen3-step2": ("qwen3_moe", dict(norm_topk_prob=False, decoder_sparse_step=2)),
    "qwen3-mlp-only": ("qwen3_moe", dict(norm_topk_prob=True, mlp_only_layers=[0])),
    "qwen2-shared": ("qwen2_moe", dict(norm_topk_prob=False)),
    "qwen2-mixed": ("qwen2_moe", dict(norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[2])),
}


def hf_moe(model_type: str, seed: int = 0, **over):
    """A small random transformers MoE model: norms and router weights random (not the init's 1s and ~0s) so a
    misplaced norm or a wrong routing shows; the router weights large enough that top-k choices are decisive."""
    torch.manual_seed(seed)
    common = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, num_experts=6,
                  num_experts_per_tok=2, moe_intermediate_size=16, router_aux_loss_coef=0.01)
    if model_type == "qwen3_moe":
        cls_cfg, cls = transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM
        common["head_dim"] = 8
    else:
        cls_cfg, cls = transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM
        common["shared_expert_intermediate_size"] = 24
    m = cls(cls_cfg(**{**common, **over}))
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            elif n.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
            elif "bias" in n or "shared_expert_gate" in n:
                p.normal_(0, 0.3)
    return m.eval()


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers_and_round_trip(tmp_path, case):
    model_type, over = CASES[case]
    hf = hf_moe(model_type, **over)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_policy(tmp_path / "hf").eval()
    c = ours.cfg
    assert (c.model_type, c.num_experts, c.num_experts_per_tok, c.norm_topk_prob, c.router_aux_loss_coef) == \
        (model_type, 6, 2, over["norm_topk_prob"], 0.01)
    sparse = [i for i in range(3) if isinstance(ours.layers[str(i)].mlp, SparseMoE)]
    assert sparse == [i for i in range(3) if type(hf.model.layers[i].mlp).__name__.endswith("SparseMoeBlock")]
    ids = torch.randint(0, V, (2, 19))
    with torch.no_grad():
        ref = hf(ids).logits
        out = ours(ids)
    assert (out.logits - ref).abs().max().item() <= 1e-4
    assert len(out.router_logits) == len(sparse) and out.router_logits[0].shape == (2, 19, 6)

    save_policy(ours, tmp_path / "ours")  # load -> save -> load: bit-equal
    back = load_policy(tmp_path / "ours")
    assert back.cfg == ours.cfg
    a, b = ours.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    cls = type(hf)  # transformers reads specco's files to the same model
    theirs = cls.from_pretrained(tmp_path / "ours").eval()
    assert theirs.config.num_experts == 6 and theirs.config.router_aux_loss_coef == 0.01
    with torch.no_grad():
        assert (theirs(ids).logits - ref).abs().max().item() <= 1e-4


def test_fused_expert_layout_loads(tmp_path):
    """transformers 5's in-memory layout (experts.gate_up_proj (E, 2I, h), experts.down_proj (E, h, I)) saved
    as it is loads to the same model as the per-expert files."""
    hf = hf_moe("qwen3_moe", norm_topk_prob=True)
    hf.save_pretrained(tmp_path / "hf")
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert sd["model.layers.0.mlp.experts.gate_up_proj"].dim() == 3
    (tmp_path / "fused").mkdir()
    save_file(sd, str(tmp_path / "fused" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "fused" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    a, b = load_policy(tmp_path / "hf").state_dict(), load_policy(tmp_path / "fused").state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _hf_grads(hf, ours) -> dict[str, torch.Tensor]:
    """transformers' gradients under specco's parameter names (q/k/v and gate/up rows concatenated as specco
    fuses them; the 3-D expert tensors are named alike)."""
    g = {k.removeprefix("model."): p.grad for k, p in hf.named_parameters()}
    out = {}
    for name, _ in ours.named_parameters():
        pre, _, leaf = name.rpartition(".")
        if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            pre = pre.removesuffix(".qkv_proj")
            out[name] = torch.cat([g[f"{pre}.{p}.{leaf}"] for p in ("q_proj", "k_proj", "v_proj")])
        elif name.endswith("gate_up_proj.weight"):
            pre = pre.removesuffix(".gate_up_proj")
            out[name] = torch.cat([g[f"{pre}.gate_proj.weight"], g[f"{pre}.up_proj.weight"]])
        else:
            out[name] = g[name]
    return out


@pytest.mark.parametrize("case", ["qwen3-norm", "qwen2-shared", "qwen2-mixed"])
def test_gradients_match_transformers(tmp_path, case):
    """A loss on the logits backpropagates to every parameter as in transformers, the router's included (its
    gradient flows through the top-k weights), fp64."""
    model_type, over = CASES[case]
    hf = hf_moe(model_type, **over)
    hf.save_pretrained(tmp_path / "hf")
    hf.set_experts_implementation("eager")  # its default, torch._grouped_mm, has no fp64
    hf = hf.double()
    ours = load_policy(tmp_path / "hf", dtype=torch.float64)
    ids = torch.randint(0, V, (2, 11))
    probe = torch.randn(2, 11, V, dtype=torch.float64)
    (hf(ids).logits * probe).sum().backward()
    (ours(ids).logits * probe).sum().backward()
    want = _hf_grads(hf, ours)
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-7, atol=1e-10, msg=name)
    router = [p.grad for n, p in ours.named_parameters() if n.endswith("mlp.gate.weight")]
    assert router and all(g.abs().max() > 0 for g in router)


def test_wrong_router_normalisation_fails_parity(tmp_path):
    """The parity test can fail: flipping norm_topk_prob on specco's side moves the logits far past 1e-4."""
    hf = hf_moe("qwen3_moe", norm_topk_prob=True)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_policy(tmp_path / "hf").eval()
    ids = torch.randint(0, V, (2, 19))
    for layer in ours.layers.values():
        layer.mlp.norm_topk_prob = False
    with torch.no_grad():
        assert (ours(ids).logits - hf(ids).logits).abs().max().item() > 1e-3


def _grouped_kernel_runs(device: str) -> bool:
    """Whether the grouped-GEMM kernel runs on `device` (CPU: torch >= 2.9 has a CPU kernel; CUDA: Hopper)."""
    from specco.ops.grouped_mm import _KERNEL
    if _KERNEL is None:
        return False
    if device == "cuda":
        return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
    try:
        _KERNEL(torch.ones(2, 8), torch.ones(1, 8, 8), offs=torch.tensor([2], dtype=torch.int32))
        return True
    except (RuntimeError, NotImplementedError):
        return False


@pytest.mark.parametrize("device,dtype", [("cpu", torch.float32), ("cuda", torch.bfloat16)])
def test_grouped_gemm_equals_loop(device, dtype):
    """The grouped-GEMM expert path and the loop give the same outputs and gradients (an empty group included):
    fp32 on CPU where torch has the CPU kernel (rtol 1e-5), bf16 on a Hopper GPU (rtol 2e-2); skipped elsewhere.
    The public forward takes the grouped path only on CUDA bf16 (grouped_mm_applies); here both are called."""
    if not _grouped_kernel_runs(device):
        pytest.skip(f"no grouped-GEMM kernel on {device}")
    from specco.model.moe import Experts, expert_ffn_grouped, expert_ffn_loop
    torch.manual_seed(0)
    ex = Experts(8, 64, 32).to(device, dtype)
    with torch.no_grad():
        ex.gate_up_proj.normal_(0, 0.1)
        ex.down_proj.normal_(0, 0.1)
    idx = torch.randint(0, 7, (300, 2), device=device).reshape(-1)  # expert 7 untouched: an empty group
    xs = torch.randn(600, 64, device=device, dtype=dtype)[idx.argsort(stable=True)].requires_grad_()
    counts = torch.zeros(8, dtype=torch.long, device=device).index_add_(0, idx, torch.ones_like(idx))
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    outs, grads = [], []
    for path in (expert_ffn_grouped, expert_ffn_loop):
        y = path(xs, counts, ex.gate_up_proj, ex.down_proj)
        outs.append(y.float())
        grads.append(torch.autograd.grad(y.float().square().sum(), [xs, ex.gate_up_proj, ex.down_proj]))
    torch.testing.assert_close(outs[0], outs[1], **tol)
    for g, r in zip(*grads):
        torch.testing.assert_close(g.float(), r.float(), **tol)


def test_autocast_takes_the_grouped_gemm_over_fp32_masters(monkeypatch):
    """Under bf16 autocast over fp32 master weights (train.amp=bf16), `Experts.forward` casts the rows and the
    expert weights to bf16 and takes the grouped GEMM, as autocast does for a linear; its output and the fp32
    masters' gradients match the loop under the same autocast (rtol 2e-2 / atol 2e-3: bf16 operands, products
    summed in different blockings). On CPU the public forward takes the grouped path only on CUDA, so the test
    lets it run on torch's CPU kernel (skipped where there is none) and checks the path was taken."""
    if not _grouped_kernel_runs("cpu"):
        pytest.skip("no grouped-GEMM kernel on cpu")
    from specco.model import moe
    torch.manual_seed(0)
    ex = moe.Experts(8, 64, 32)
    with torch.no_grad():
        ex.gate_up_proj.normal_(0, 0.1)
        ex.down_proj.normal_(0, 0.1)
    x = torch.randn(150, 64)
    idx = torch.randint(0, 7, (150, 2))  # expert 7 untouched: an empty group
    w = torch.rand(150, 2)
    taken, real = [], moe.grouped_mm_applies
    monkeypatch.setattr(moe, "grouped_mm_applies", lambda a, *ws: taken.append(a.dtype) or (
        a.dtype == torch.bfloat16 and all(t.dtype == torch.bfloat16 for t in ws)))
    runs = []
    for grouped in (True, False):
        if not grouped:
            monkeypatch.setattr(moe, "grouped_mm_applies", real)  # CPU: the loop
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = ex(x, idx, w)
        runs.append((y.float(), torch.autograd.grad(y.float().square().sum(), [ex.gate_up_proj, ex.down_proj])))
    assert taken == [torch.bfloat16]  # the grouped path saw the cast rows
    (y_g, g_g), (y_l, g_l) = runs
    assert all(g.dtype == torch.float32 for g in g_g)  # through the casts to the masters
    torch.testing.assert_close(y_g, y_l, rtol=2e-2, atol=2e-3)
    for a, b in zip(g_g, g_l):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


def test_compiled_loop_does_not_recompile_per_routing_pattern():
    """Under torch.compile the expert loop (host-read counts, Python branches on them) is left out of the graph, so
    batches that leave different experts empty reuse the compiled frames; before, dynamo guarded on every count
    and recompiled per pattern until its recompile limit (the H200 MoE run). Counted with dynamo's CompileCounter
    backend (no inductor)."""
    from torch._dynamo.testing import CompileCounter
    from specco.model import moe
    torch._dynamo.reset()
    torch.manual_seed(0)
    ex = moe.Experts(8, 16, 8)
    with torch.no_grad():
        ex.gate_up_proj.normal_(0, 0.1)
        ex.down_proj.normal_(0, 0.1)
    counter = CompileCounter()
    fn = torch.compile(ex, backend=counter)
    x, w = torch.randn(12, 16), torch.rand(12, 2)
    for used in (8, 3, 5, 2, 7, 4):  # each call routes to the first `used` experts only: other empty groups
        idx = torch.stack([torch.arange(12) % used, (torch.arange(12) + 1) % used], 1)
        torch.testing.assert_close(fn(x, idx, w), ex(x, idx, w))
        if used == 8:
            frames = counter.frame_count
    assert counter.frame_count == frames, (frames, counter.frame_count)
    torch._dynamo.reset()


# -- config.json boundary --------------------------------------------------------------------------------------

BASE = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16)


@pytest.mark.parametrize("model_type,over,needle", [
    ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window=True"),
    ("qwen2_moe", {"use_sliding_window": True}, "use_sliding_window=True"),
    ("qwen2_moe", {"layer_types": ["full_attention", "sliding_attention", "full_attention"]}, "layer_types"),
    ("qwen3_moe", {"attention_bias": True}, "attention_bias=True"),
    ("qwen3_moe", {"num_local_experts": 4}, "num_local_experts=4"),
    ("qwen3_moe", {"num_experts_per_tok": 7}, "num_experts_per_tok=7"),
    ("qwen2_moe", {"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size=0"),
    ("qwen3_moe", {"mlp_only_layers": [5]}, "mlp_only_layers"),
    ("qwen3_moe", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
])
def test_unsupported_moe_fields_are_refused_by_name(model_type, over, needle):
    with pytest.raises(ConfigError, match=None) as e:
        PolicyConfig.from_hf_dict({"model_type": model_type, **BASE, **over})
    assert needle in str(e.value)


def test_config_reads_both_expert_count_spellings_and_defaults():
    """Qwen3-MoE's save_pretrained writes num_local_experts, the Hub num_experts; omitted fields take
    transformers' defaults (router_aux_loss_coef 0.001, Qwen2-MoE's qkv bias on)."""
    d = {k: v for k, v in BASE.items() if k != "num_experts"}
    a = PolicyConfig.from_hf_dict({"model_type": "qwen3_moe", **d, "num_local_experts": 6})
    b = PolicyConfig.from_hf_dict({"model_type": "qwen3_moe", **BASE})
    assert a == b and a.num_experts == 6 and a.router_aux_loss_coef == 0.001 and a.qk_norm and a.moe
    q2 = PolicyConfig.from_hf_dict({"model_type": "qwen2_moe", **BASE})
    assert q2.attention_bias and q2.shared_expert_intermediate_size == 5632 and not q2.qk_norm
    assert PolicyConfig.from_hf_dict(json.loads(json.dumps(q2.to_hf_dict()))) == q2
    dense = PolicyConfig.from_hf_dict({"model_type": "qwen3_moe", **BASE, "num_experts": 0})
    assert not dense.moe  # num_experts 0: every layer dense, as transformers builds it
