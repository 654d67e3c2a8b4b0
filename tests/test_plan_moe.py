"""`specco plan` of mixture-of-experts policies (specco/plan_moe.py): its counts and formulas against the models.

Parameter counts against Qwen3-MoE / Qwen2-MoE policies built on the meta device (shared expert, dense layers by
mlp_only_layers and decoder_sparse_step, pipeline stages); a sparse layer's activation formula to the byte against
the storages autograd saves (fp32, bf16 autocast, bf16 weights; the router's aux loss; under expert parallelism on
two gloo ranks, where the uniform expectation is the ep group's mean); the trainer estimate against the peak of a
real co-training step; the layouts' ep axis, the expert slices' placement, the Qwen3-30B-A3B preset and the CLI.
"""
import dataclasses
import json
import math

import pytest
import torch

from specco.batch import TrainBatch
from specco.cli import main
from specco.config import RunConfig
from specco.model.config import ConfigError, DraftConfig, PolicyConfig
from specco.model.draft import Eagle3Draft
from specco.model.policy import Policy
from specco.plan import (PRESETS, Layout, format_plan, layer_activation_bytes, layouts, plan_memory, policy_params,
                         rank_memory)
from specco.plan_moe import (active_params, dispatched_row_bytes, expert_copy_bytes, expert_params,
                             moe_activation_bytes, router_aux_bytes, routed_token_bytes)
from specco.plan_params import stage_params
from specco.train.cotrain import StepConfig, build_optimizer, cotrain_step
from specco.train.moe_loss import aux_share
from test_plan import PRECISIONS, _saved_storages, _shapes, run_layer
from cp_memory import LiveTensorBytes  # bench/, on sys.path through test_plan

pytestmark = pytest.mark.e2e  # the measured step, the two-rank run and the CLI take ~15 s on two cores

V = 512


def _moe_pc(family: str, **kw) -> PolicyConfig:
    """A tiny policy of `family` whose activation shapes never equal a weight's: h = 128 and I = 112 exceed the
    N·k = 96 assignments of a (2, 24) batch at top-2 (run_layer's weight-shape filter must not drop activations)."""
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=112, model_type=family,
               qk_norm=family == "qwen3_moe", norm_topk_prob=family == "qwen3_moe",
               shared_expert_intermediate_size=80 if family == "qwen2_moe" else 0)
    return PolicyConfig(**{**dict(vocab_size=V, hidden_size=128, intermediate_size=160, num_layers=2, num_heads=4,
                                  num_kv_heads=2), **moe, **kw})


def _meta_count(module) -> int:
    return sum(p.numel() for p in module.parameters()) if module is not None else 0


def test_moe_parameter_counts_are_the_models():
    """policy_params, stage_params, expert_params and PolicyConfig.num_params against the policies (and pipeline
    stages) built on the meta device: Qwen3-MoE with dense layers by decoder_sparse_step and mlp_only_layers,
    Qwen2-MoE with its shared expert and q/k/v biases, the Qwen3-30B-A3B preset (30.53 B, 3.35 B active)."""
    qwen3 = _moe_pc("qwen3_moe", num_layers=6, decoder_sparse_step=2, mlp_only_layers=(3,))  # sparse: 1, 5
    qwen2 = _moe_pc("qwen2_moe", num_layers=5, mlp_only_layers=(0, 2), attention_bias=True)  # (pp refuses tied)
    for name, pc in (("qwen3_moe", qwen3), ("qwen2_moe", qwen2), ("qwen3-30b-a3b", PRESETS["qwen3-30b-a3b"])):
        with torch.device("meta"):
            whole = Policy(pc)
        experts = sum(_meta_count(getattr(layer.mlp, "experts", None)) for layer in whole.layers.values())
        assert policy_params(pc) == _meta_count(whole) == pc.num_params, name
        assert expert_params(pc, range(pc.num_layers)) == experts, name
        L = pc.num_layers
        for cut in ((0, 3), (3, L)):  # two pipeline stages: the first embeds, the last has the norm and head
            rng = range(*cut)
            with torch.device("meta"):
                stage = Policy(pc, layer_ids=rng, has_embed=cut[0] == 0, has_head=cut[1] == L)
            assert stage_params(pc, rng, cut[0] == 0, cut[1] == L) == _meta_count(stage), (name, cut)
    assert sum(qwen3.is_moe_layer(i) for i in range(6)) == 2 and sum(qwen2.is_moe_layer(i) for i in range(5)) == 3
    a3b = PRESETS["qwen3-30b-a3b"]
    total = policy_params(a3b)
    assert abs(total / 1e9 - 30.53) < 0.01 and abs(active_params(a3b, total) / 1e9 - 3.35) < 0.01  # Qwen's 30.5 / 3.3 B


def test_preset_matches_transformers_config():
    """The preset's shape is Qwen3-30B-A3B's config.json read by transformers' Qwen3MoeConfig (whose bare defaults
    differ: 24 layers, head_dim 64, norm_topk_prob false), through PolicyConfig.from_hf_dict."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.Qwen3MoeConfig(num_hidden_layers=48, head_dim=128, norm_topk_prob=True, tie_word_embeddings=False)
    d = {k: v for k, v in hf.to_dict().items() if v is not None}
    pc = PolicyConfig.from_hf_dict({**d, "architectures": ["Qwen3MoeForCausalLM"]})
    preset = PRESETS["qwen3-30b-a3b"]
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
              "qk_norm", "model_type", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
              "tie_word_embeddings", "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef")
    assert {f: getattr(pc, f) for f in fields} == {f: getattr(preset, f) for f in fields}
    assert policy_params(pc) == policy_params(preset)


def _aux_run(layer, run):
    """`run` followed by the router aux loss over the logits the layer kept, as cotrain_step adds it."""
    def both():
        run()
        logits = layer.mlp.router_logits
        mask = torch.ones(2, logits.shape[0] // 2)
        aux_share([logits], layer.mlp.top_k, mask, mask.sum())
    return both


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("aux", [False, True])
def test_sparse_layer_activation_formula_is_exact(family, precision, aux):
    """A sparse DecoderLayer's saved bytes equal layer_activation_bytes with plan_moe.moe_activation_bytes as its
    MLP, to the byte; the router aux loss adds router_aux_bytes per token (and a few bytes once per micro-batch).
    Routing does not matter at ep 1: the layer's experts compute all N·k assignments."""
    torch.manual_seed(0)
    pc = _moe_pc(family)
    layer = Policy(pc).layers["0"]
    B, S = 2, 24
    run, tables = run_layer(layer, pc, B, S, precision)
    run = _aux_run(layer, run) if aux else run
    c, r = PRECISIONS[precision]
    experts = layer.mlp.experts
    slices = {tuple(p.shape[1:])[::o] for p in experts.parameters() for o in (1, -1)}  # one expert's (2I, h), (h, I)
    weights = {tuple(p.shape)[::o] for p in layer.parameters() for o in (1, -1)} | slices
    measured = _saved_storages(run, [*layer.parameters(), *tables], skip_shapes=weights)
    # the aux loss's (N, 1) mask column, its (E,) assignment shares and two 0-d divisors: once per micro-batch,
    # not per layer (the planner leaves them out, plan_moe's docstring)
    once = 4 * B * S + 4 * pc.num_experts + 8 if aux else 0
    per_token = layer_activation_bytes(pc, c, r, 1, moe_activation_bytes(pc, c, r))
    per_token += router_aux_bytes(pc) if aux else 0
    assert measured == B * S * per_token + once


@pytest.mark.parametrize("amp", [False, True])
def test_expert_copies_are_the_gemms_saved_weights(amp):
    """Under bf16 autocast over fp32 experts (as under FSDP too: the slices stay fp32) each expert GEMM saves its
    own bf16 copy of the expert's weights (views are not in autocast's cache): expert_copy_bytes of one layer is
    their bytes; in fp32 the GEMMs save the parameters themselves, no copy."""
    torch.manual_seed(0)
    pc = _moe_pc("qwen3_moe")
    layer = Policy(pc).layers["0"]
    run, _ = run_layer(layer, pc, 2, 24, "amp" if amp else "fp32")
    params = {id(p.untyped_storage()) for p in layer.parameters()}
    slices = {tuple(p.shape[1:]) for p in layer.mlp.experts.parameters()}  # (2I, h), (h, I)
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if id(st) not in params and (tuple(t.shape) in slices or tuple(t.shape)[::-1] in slices):
            seen.setdefault(id(st), (st, st.nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    copies = sum(n for _, n in seen.values())
    assert copies == expert_copy_bytes(pc, range(1), Layout(1, 1, 1, 1, fsdp=False, ac=False), 2 if amp else 4, 1)
    assert copies == (2 * expert_params(pc, range(1)) if amp else 0)


def _ep_activation_worker(rank, world):
    """Each rank's saved bytes of a sparse layer under EPExperts (parallel/ep.apply_ep over the 2 ranks, each with
    its own tokens): exactly N·(the layer with routed_token_bytes as its MLP) + R·dispatched_row_bytes for the R
    assignments its experts received; the group's mean is the planner's uniform expectation (R = N·k on average)."""
    import torch.distributed as dist
    from specco.parallel.ep import apply_ep
    for family in ("qwen3_moe", "qwen2_moe"):
        for precision in ("fp32", "amp"):
            torch.manual_seed(0)
            pc = _moe_pc(family)
            layer = apply_ep(Policy(pc).layers["0"], dist.group.WORLD)
            torch.manual_seed(1 + rank)  # different tokens per rank, so the routes differ
            run, tables = run_layer(layer, pc, 2, 24, precision)
            experts, received = layer.mlp.experts, []
            loop = experts._loop
            experts._loop = lambda xs, counts: (received.append(sum(counts)), loop(xs, counts))[1]  # noqa: E731
            weights = {tuple(p.shape)[::o] for p in layer.parameters() for o in (1, -1)}
            weights |= {tuple(p.shape[1:])[::o] for p in experts.parameters() for o in (1, -1)}
            measured = _saved_storages(run, [*layer.parameters(), *tables], skip_shapes=weights)
            c, r = PRECISIONS[precision]
            N, R = 2 * 24, received[0]
            assert measured == N * layer_activation_bytes(pc, c, r, 1, routed_token_bytes(pc, c, r)) \
                + R * dispatched_row_bytes(pc, c, world), (family, precision)
            mean = torch.tensor([measured], dtype=torch.float64)
            dist.all_reduce(mean)
            assert mean.item() / world == N * layer_activation_bytes(pc, c, r, 1, moe_activation_bytes(pc, c, r, world))


def test_ep_activation_formula_is_exact():
    from specco.parallel.mesh import spawn_local
    spawn_local(_ep_activation_worker, 2)


def test_moe_trainer_estimate_matches_measured_peak():
    """One fp32 co-training step of a Qwen3-MoE policy (router aux loss on) with an EAGLE-3 draft on CPU: the
    planner's parameters and AdamW bytes exactly, the trainer's total within the dense test's 15% of the measured
    peak (test_plan.test_trainer_estimate_matches_measured_peak says what each side leaves out)."""
    torch.manual_seed(0)
    pc = _moe_pc("qwen3_moe", num_layers=6, mlp_only_layers=(2,), router_aux_loss_coef=0.01, hidden_size=64)
    B, S = 8, 128
    policy = Policy(pc)
    draft = Eagle3Draft(DraftConfig.for_policy(pc, aux_layer_ids=(1, 2, 4)))
    g = torch.Generator().manual_seed(1)
    mask = torch.zeros(B, S)
    mask[:, 16:] = 1
    batch = TrainBatch(tokens=torch.randint(0, V, (B, S), generator=g), target_mask=mask,
                       advantages=torch.randn(B, generator=g), logp_old=-torch.rand(B, S, generator=g) * 4 - 2)
    cfg = StepConfig(ttt_passes=3, draft_row_stride=2, loss_chunk=64)
    opt = build_optimizer(policy, draft, 1e-4, 1e-4)
    cotrain_step(policy, draft, batch, opt, None, cfg)  # the first step creates AdamW's moments
    mem = LiveTensorBytes()
    with mem:
        metrics = cotrain_step(policy, draft, batch, opt, None, cfg)
    assert metrics["policy/aux_loss"] > 0
    params = sum(p.numel() * 4 for m in (policy, draft) for p in m.parameters())
    moments = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values() if t.dim())
    measured = params + moments + mem.peak

    s = dataclasses.replace(_shapes(pc, B, S, stride=2), moe_aux=True)
    est = rank_memory(s, Layout(1, 1, 1, 1, fsdp=False, ac=False))
    assert est["params"] + est["draft"] * 4 // 16 == params
    assert est["adamw"] + est["draft"] * 8 // 16 == moments
    trainer = sum(est[k] for k in ("params", "compute", "grads", "adamw", "acts", "draft"))
    ratio = trainer / measured
    print(f"planner {trainer / 1e6:.2f} MB vs measured peak {measured / 1e6:.2f} MB: {ratio:.3f}")
    assert 0.85 <= ratio <= 1.15, ratio


def _a3b_shapes(**kw):
    return _shapes(PRESETS["qwen3-30b-a3b"], rows=512, seq=4608, micro=2, c=2, **kw)


def test_layouts_add_an_ep_axis_the_trainer_runs():
    """ep divides dp × cp and num_experts; no FSDP at ep 1 and no tp for a MoE policy; a dense policy keeps ep 1."""
    s = _a3b_shapes()
    lays = layouts(s, 16, ac=(False,))
    assert all(l.pp * l.dp * l.cp * l.tp == 16 for l in lays)
    assert all((l.dp * l.cp) % l.ep == 0 and 128 % l.ep == 0 for l in lays)
    assert all(l.tp == 1 and not (l.fsdp and l.ep == 1) for l in lays)
    assert {l.ep for l in lays} == {1, 2, 4, 8, 16}
    assert any(l.ep == 1 and not l.fsdp for l in lays) and any(l.pp > 1 and l.ep > 1 for l in lays)
    assert Layout(1, 1, 8, 1, True, True, ep=8).name() == "pp1 rep1 shard8 cp1 ep8 ac"
    dense = _shapes(PRESETS["qwen3-8b"], rows=512, seq=2048, c=2)
    assert {l.ep for l in layouts(dense, 16, ac=(False,))} == {1}


def test_expert_slices_are_held_whole_per_ep_rank():
    """FSDP shards the dense rest; the expert slices (1/ep) are whole on each rank in fp32 with their gradients and
    AdamW moments, the KL reference's too; the engine holds every expert."""
    s = dataclasses.replace(_a3b_shapes(), kl_reference=True)
    pc = s.policy
    every = range(pc.num_layers)
    X, P = expert_params(pc, every), policy_params(pc)
    for shard, ep in ((8, 8), (8, 4), (4, 8), (1, 8)):
        lay = Layout(1, 8 // shard, shard, 1, shard > 1, True, ep=ep)
        m = rank_memory(s, lay)
        assert m["params"] == 4 * (math.ceil((P - X) / shard) + X // ep), lay
        assert m["grads"] == m["params"] and m["adamw"] == 2 * m["params"] and m["ref"] == m["params"], lay
    one = rank_memory(s, Layout(1, 1, 8, 1, True, True, ep=8))
    assert one["engine_w"] > 2 * P  # the whole policy in bf16 (+ the draft and the verify logits)
    # bf16 autocast's copies of the slices, one per sparse layer without checkpointing: 2 B per local expert param
    ep4, ep8 = (rank_memory(s, Layout(1, 1, 8, 1, True, False, ep=ep))["compute"] for ep in (4, 8))
    assert ep4 - ep8 == 2 * (X // 4 - X // 8)


def test_activations_count_sparse_and_dense_layers():
    """A stage's activations: each dense layer's and each sparse layer's formula, plus the aux loss's softmax per
    sparse layer, which activation checkpointing keeps too."""
    from specco.plan import activation_bytes
    pc = _moe_pc("qwen2_moe", num_layers=4, mlp_only_layers=(1,))
    s = dataclasses.replace(_shapes(pc, rows=8, seq=256, draft=None), moe_aux=True)
    lay = Layout(1, 8, 1, 1, False, False)
    tokens, c = 256, 4  # 8 rows over dp 8: one row a rank
    dense = layer_activation_bytes(pc, c, c)
    sparse = layer_activation_bytes(pc, c, c, 1, moe_activation_bytes(pc, c, c))
    kept = router_aux_bytes(pc)
    extra = tokens * pc.hidden_size * 4  # the final norm's output
    assert activation_bytes(s, lay, range(4), False, 1) == tokens * (dense + 3 * (sparse + kept)) + extra
    ac = dataclasses.replace(lay, ac=True)
    assert activation_bytes(s, ac, range(4), False, 1) == tokens * (4 * pc.hidden_size * 4 + sparse + 3 * kept) + extra


def test_preset_plans_and_refuses_a_tensor_parallel_engine():
    cfg = RunConfig()
    plan = plan_memory(cfg, 64, 141, model="qwen3-30b-a3b", prompt_tokens=512, offload=True, ac=(True,))
    assert plan.rows and all(lay.ep > 1 or not lay.fsdp for lay, _ in plan.rows)
    assert plan.headroom(plan.rows[0][1]) > 0  # 64 H200s hold it
    assert "(3.35 B active)" in format_plan(plan, 3).splitlines()[0]
    with pytest.raises(ConfigError, match="mixture of experts"):
        plan_memory(cfg, 8, 141, model="qwen3-30b-a3b", engine_tp=2)


def test_cli_plans_the_moe_config(tmp_path, capsys):
    """configs/moe.toml (a from-scratch Qwen3-MoE policy): the table and the JSON show ep."""
    out = tmp_path / "plan.json"
    main(["plan", "configs/moe.toml", "--gpus", "8", "--gpu-mem", "141", "--top", "4", "--json", str(out)])
    text = capsys.readouterr().out.splitlines()
    assert "B active" in text[0] and len(text) == 6 and " ep" in text[2]
    data = json.loads(out.read_text())
    assert data["policy_active_params"] < data["policy_params"]
    assert all(row["ep"] >= 1 and (row["ep"] > 1 or not row["fsdp"]) for row in data["layouts"])
    assert any(row["ep"] == 8 for row in data["layouts"])
