"""`specco plan` (specco/plan.py): its formulas against the tensors a real step keeps, and the CLI.

The activation formula is checked exactly (to the byte) against the storages autograd saves in one decoder layer,
in fp32 and under bf16 autocast, with and without Qwen3's q/k norms. The whole trainer estimate (parameters,
gradients, AdamW, activations, the draft) is checked against the peak of live tensor bytes of a real co-training
step on CPU (LiveTensorBytes of bench/cp_memory.py: what torch.cuda.max_memory_allocated would read on a GPU, less the
allocator's rounding).
"""
import dataclasses
import math
import json
import sys
from pathlib import Path

import pytest
import torch

from specco.batch import TrainBatch
from specco.cli import main
from specco.config import RunConfig
from specco.model.config import DraftConfig, PolicyConfig
from specco.model.draft import Eagle3Draft
from specco.model.layers import rope_cos_sin
from specco.model.policy import Policy
from specco.plan import (PRESETS, Layout, Shapes, activation_bytes, layer_activation_bytes, layouts, plan_memory,
                         policy_params, rank_memory, rank_params)
from specco.train.cotrain import StepConfig, build_optimizer, cotrain_step

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from cp_memory import LiveTensorBytes  # noqa: E402

pytestmark = pytest.mark.e2e  # the measured step and the CLI's meta-device builds take ~10 s on two cores

V = 512


def _pc(qk_norm=False, **kw):
    return PolicyConfig(**{**dict(vocab_size=V, hidden_size=64, intermediate_size=160, num_layers=4, num_heads=4,
                                  num_kv_heads=2, qk_norm=qk_norm), **kw})


def _shapes(pc, rows, seq, stride=1, micro=0, draft="eagle3", c=4):
    return Shapes(policy=pc, draft_kind=draft, draft_vocab=pc.vocab_size, draft_layers=1, num_taps=3, seq=seq,
                  rows_per_step=rows, minibatches=1, micro_batch_rows=micro, draft_row_stride=stride, ttt_passes=3,
                  gamma=3, num_anchors=16, loss_chunk=64, compute_bytes=c, engine_bytes=2, compact_below=0.25)


def _saved_storages(fn, exclude, skip_shapes=frozenset()):
    """Bytes of the distinct storages autograd saves while `fn` runs, leaving out `exclude`'s (parameters, cos/sin)."""
    seen = {}
    skip = {id(t.untyped_storage()) for t in exclude}

    def pack(t):
        st = t.untyped_storage()
        if id(st) not in skip and tuple(t.shape) not in skip_shapes:
            seen.setdefault(id(st), (st, st.nbytes()))  # keep the storage alive: ids stay unique
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(n for _, n in seen.values())


# (c, r) of each precision: fp32; bf16 autocast over fp32 weights; bf16 weights and residual (FSDP's bf16 params)
PRECISIONS = {"fp32": (4, 4), "amp": (2, 4), "bf16": (2, 2)}


def run_layer(layer, pc, B, S, precision):
    """(a function running `layer` forward on (B, S, h) random rows in `precision`, the tensors it reads that are
    not activations: cos, sin). Under "bf16" the layer is cast to bf16 in place."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    layer.to(dtype)
    x = torch.randn(B, S, pc.hidden_size, requires_grad=True, dtype=dtype)
    cos, sin = rope_cos_sin(torch.arange(S).expand(B, S), pc.head_dim, pc.rope_theta, dtype, scaling=None)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "fp32")

    def run():
        with ctx:
            layer(x, cos, sin)
    return run, [cos, sin]


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_layer_activation_formula_is_exact(qk_norm, precision):
    """The per-layer formula equals the bytes a DecoderLayer saves for its backward, to the byte (fp32 weights and
    residual; bf16 autocast makes the matmul outputs 2 bytes and adds the casts the formula lists; bf16 weights
    make the residual 2 bytes, which the norms keep in fp32 copies only)."""
    pc = _pc(qk_norm)
    layer = Policy(pc).layers["0"]
    B, S = 2, 48
    run, tables = run_layer(layer, pc, B, S, precision)
    # autocast's bf16 copies of the weights are the planner's "compute" column, not activations
    weights = {tuple(p.shape)[::o] for p in layer.parameters() for o in (1, -1)}  # matmuls save them transposed
    measured = _saved_storages(run, [*layer.parameters(), *tables], skip_shapes=weights)
    assert measured == B * S * layer_activation_bytes(pc, *PRECISIONS[precision])


def test_trainer_estimate_matches_measured_peak():
    """One fp32 co-training step (policy + EAGLE-3 draft, CPU): the planner's trainer memory — parameters,
    gradients, AdamW, activations and the draft's — against the measured peak of live tensor bytes.

    Tolerance 15%, the issue's figure for an H200 run of a 1-3B model. What the planner leaves out here is
    transient: the fp32 CE chunks of the draft loss (B·chunk·Vd), autograd's gradient buffers of one op at a time,
    the logits' argmax/gather indices; what it adds is the whole gradient at the same time as the whole
    activations (the measured peak frees early layers' activations as their gradients appear). At these shapes the
    two roughly cancel; the per-component checks above and below are exact."""
    torch.manual_seed(0)
    m = measured_trainer_step(_pc(num_layers=6))
    # exact parts: the planner's parameter and AdamW bytes are the models' own
    assert m["est"]["params"] + m["est"]["draft"] * 4 // 16 == m["params"]
    assert m["est"]["adamw"] + m["est"]["draft"] * 8 // 16 == m["moments"]
    ratio = m["trainer"] / m["measured"]
    print(f"planner {m['trainer'] / 1e6:.2f} MB vs measured peak {m['measured'] / 1e6:.2f} MB: {ratio:.3f} "
          f"(activations {m['est']['acts'] / 1e6:.2f} MB)")
    assert 0.85 <= ratio <= 1.15, ratio


def measured_trainer_step(pc: PolicyConfig, moe_aux: bool = False, B: int = 8, S: int = 128, prompt: int = 16,
                          group: int = 0) -> dict:
    """One fp32 co-training step of `pc` with an EAGLE-3 draft on CPU, after a first step (so AdamW's moments
    exist), beside the planner's estimate of the same step (also used by test_plan_moe): the step's metrics, the
    models' parameter and AdamW bytes, the measured peak (those + the peak of live tensors during the step), the
    planner's per-component estimate and its trainer total. `group` > 0: groups of that many rows share their
    `prompt` tokens and the step shares them (train.share_prompts), the planner told so."""
    from specco.parallel.layout import PADDED, SHARED_PROMPTS
    policy = Policy(pc)
    draft = Eagle3Draft(DraftConfig.for_policy(pc, aux_layer_ids=(1, 2, 4)))
    g = torch.Generator().manual_seed(1)
    mask = torch.zeros(B, S)
    mask[:, prompt:] = 1
    tokens = torch.randint(0, V, (B, S), generator=g)
    if group:
        tokens[:, :prompt] = tokens[::group, :prompt].repeat_interleave(group, 0)
    batch = TrainBatch(tokens=tokens, target_mask=mask,
                       advantages=torch.randn(B, generator=g), logp_old=-torch.rand(B, S, generator=g) * 4 - 2)
    cfg = StepConfig(ttt_passes=3, draft_row_stride=2, loss_chunk=64)
    layout = SHARED_PROMPTS if group else PADDED
    opt = build_optimizer(policy, draft, 1e-4, 1e-4)
    cotrain_step(policy, draft, batch, opt, None, cfg, layout=layout)  # the first step creates AdamW's moments
    mem = LiveTensorBytes()
    with mem:
        metrics = cotrain_step(policy, draft, batch, opt, None, cfg, layout=layout)
    params = sum(p.numel() * 4 for m in (policy, draft) for p in m.parameters())
    moments = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values() if t.dim())
    s = dataclasses.replace(_shapes(pc, B, S, stride=2), moe_aux=moe_aux)
    if group:
        s = dataclasses.replace(s, shared_group=group, prompt=prompt, shortest_prompt=prompt)
    est = rank_memory(s, Layout(1, 1, 1, 1, fsdp=False, ac=False))
    return dict(metrics=metrics, params=params, moments=moments, measured=params + moments + mem.peak, est=est,
                trainer=sum(est[k] for k in ("params", "compute", "grads", "adamw", "acts", "draft")))


def test_shared_prompts_estimate_matches_measured_peak():
    """train.share_prompts (groups of 4 rows sharing a 96-token prompt of 128): the planner's trainer memory with
    the packed groups' activations against the measured peak, the tolerance of the test above, and less than the
    same step on padded rows needs, as measured."""
    torch.manual_seed(0)
    shared = measured_trainer_step(_pc(num_layers=6), prompt=96, group=4)
    padded = measured_trainer_step(_pc(num_layers=6), prompt=96)
    ratio = shared["trainer"] / shared["measured"]
    print(f"shared: planner {shared['trainer'] / 1e6:.2f} MB vs measured {shared['measured'] / 1e6:.2f} MB ({ratio:.3f});"
          f" padded measured {padded['measured'] / 1e6:.2f} MB")
    assert 0.85 <= ratio <= 1.15, ratio
    assert shared["measured"] < padded["measured"] and shared["est"]["acts"] < padded["est"]["acts"]


def test_parameter_counts_are_the_models():
    """The planner's per-part counts and PolicyConfig.num_params (what specco prints) add up to the whole
    model's, built on the meta device: Qwen3's q/k norm weights, Qwen2's q/k/v biases, tied heads."""
    qwen2 = PolicyConfig(vocab_size=1000, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
                         num_kv_heads=2, attention_bias=True, tie_word_embeddings=True, model_type="qwen2")
    for name, pc in (*((n, PRESETS[n]) for n in ("qwen3-8b", "dense-120b")), ("qwen2", qwen2)):
        with torch.device("meta"):
            whole = sum(p.numel() for p in Policy(pc).parameters())
        assert policy_params(pc) == whole, name
        assert pc.num_params == whole, name
    assert abs(policy_params(PRESETS["qwen3-8b"]) / 1e9 - 8.19) < 0.01  # Qwen3-8B's published count
    assert abs(policy_params(PRESETS["dense-120b"]) / 1e9 - 122.6) < 0.1  # Mistral-Large-2407's 123 B


def test_sharding_and_stages_divide_exactly():
    pc = PRESETS["qwen3-8b"]
    s = _shapes(pc, rows=64, seq=4096, micro=2, c=2)
    one, two = (rank_memory(s, Layout(1, 1, n, 1, True, False)) for n in (4, 8))
    for k in ("params", "grads", "adamw"):  # the sharded state halves (up to the ceil of a shard)
        assert abs(one[k] - 2 * two[k]) <= 2 * 8
    assert one["draft"] == two["draft"]  # the draft is replicated
    # pp = 2 halves the layers' activations (1F1B's first stage keeps 2 micro-batches in flight: the same bytes)
    no_pp = activation_bytes(s, Layout(1, 1, 4, 1, True, False), range(36), False, 1)
    pp2 = activation_bytes(s, Layout(2, 1, 4, 1, True, False), range(18), False, 1)
    assert abs(no_pp - 2 * pp2) <= 2 * 2 * 4096 * pc.hidden_size * 2


def test_kl_reference_is_sharded_like_the_trainer():
    """train.kl_coef > 0: the whole starting policy in fp32 on every rank without FSDP, 1/(dp_shard × cp) of it
    under FSDP (trainer.make_arm shards it); under PP the rank's stage of it (the fullest stage's, sharded alike);
    counted in both phases."""
    pc = PRESETS["qwen3-8b"]
    s = dataclasses.replace(_shapes(pc, rows=64, seq=4096, micro=2, c=2), kl_reference=True)
    whole = 4 * policy_params(pc)
    assert rank_memory(dataclasses.replace(s, kl_reference=False), Layout(1, 1, 8, 1, True, False))["ref"] == 0
    assert rank_memory(s, Layout(1, 8, 1, 1, False, False))["ref"] == whole
    for lay in (Layout(1, 1, 8, 1, True, False), Layout(1, 2, 4, 2, True, False)):
        assert rank_memory(s, lay)["ref"] == 4 * math.ceil(policy_params(pc) / 8), lay
    from specco.parallel.pipeline import stage_layer_ranges
    pp2 = Layout(2, 1, 8, 1, True, False)  # the fullest rank's stage: the larger of the two stages' shares
    stages = [4 * math.ceil(rank_params(pc, r, i == 0, i == 1) / 8) for i, r in enumerate(stage_layer_ranges(36, 2))]
    assert rank_memory(s, pp2)["ref"] in stages and max(stages) < 4 * math.ceil(policy_params(pc) / 8)
    lay = Layout(1, 1, 8, 1, True, False)
    for offload in (False, True):  # the reference stays resident through the rollout and the train step
        with_ref, without = (rank_memory(dataclasses.replace(s, kl_reference=k), lay, offload)["total"]
                             for k in (True, False))
        assert with_ref - without == 4 * math.ceil(policy_params(pc) / 8)


def test_checkpointing_keeps_layer_inputs():
    pc = PRESETS["qwen3-8b"]
    s = dataclasses.replace(_shapes(pc, rows=64, seq=4096, micro=2, c=2), draft_kind=None)
    lay = Layout(1, 1, 8, 1, True, False)
    full = activation_bytes(s, lay, range(36), False, 1)
    ckpt = activation_bytes(dataclasses.replace(s), dataclasses.replace(lay, ac=True), range(36), False, 1)
    tokens, h = 2 * 4096, pc.hidden_size
    assert ckpt == tokens * (36 * h * 2 + layer_activation_bytes(pc, 2, 2) + h * 2)
    assert full == tokens * (36 * layer_activation_bytes(pc, 2, 2) + h * 2)


def test_layouts_respect_the_rules():
    pc = PRESETS["qwen3-8b"]
    s = _shapes(pc, rows=512, seq=2048, c=2)
    lays = layouts(s, 8, ac=(False,))
    assert all(l.pp * l.dp * l.cp * l.tp == 8 and 36 % l.pp == 0 for l in lays)
    assert max(l.cp for l in lays) == 2  # 2048 tokens: cp 4 would leave 512 per rank
    assert any(not l.fsdp for l in lays) and any(l.dp_replicate > 1 and l.fsdp for l in lays)
    assert {l.tp for l in lays} == {1, 2, 4, 8}  # qwen3-8b: 32 heads, 8 kv heads, 12288, 151936 all divide by 8
    # the engine's tp groups come from the cp x tp ranks of a DP group
    assert all((l.cp * l.tp) % 4 == 0 for l in layouts(s, 8, ac=(False,), engine_tp=4))


def _tp_counts_worker(rank, world):
    """Each rank's parameters of the trainer's TP policy (parallel/tp.apply_tp) and of the engine's shard
    (rollout/tp.tp_shard), against plan.rank_params / engine_weight_bytes."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from specco.parallel.mesh import Mesh
    from specco.parallel.tp import apply_tp
    from specco.plan import engine_weight_bytes, rank_params
    from specco.rollout.tp import tp_shard
    mesh = Mesh.build(tp=2, backend="gloo")
    local = lambda m: sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in m.parameters())  # noqa
    for qk_norm in (False, True):
        pc = _pc(qk_norm, model_type="qwen3" if qk_norm else "llama")
        torch.manual_seed(0)
        policy = Policy(pc)
        shard = tp_shard(policy, dist.group.WORLD)
        s = _shapes(pc, rows=8, seq=64, draft=None)
        assert local(shard) * s.engine_bytes == engine_weight_bytes(s, 2)
        apply_tp(policy, mesh.tp_mesh)
        assert local(policy) == rank_params(pc, range(pc.num_layers), True, True, 2)
    tied = _pc(tie_word_embeddings=True)  # the engine holds an untied copy of its head rows
    shard = tp_shard(Policy(tied), dist.group.WORLD)
    assert local(shard) * 2 == engine_weight_bytes(_shapes(tied, rows=8, seq=64, draft=None), 2)


def test_tp_parameter_counts_are_each_ranks():
    from specco.parallel.mesh import spawn_local
    spawn_local(_tp_counts_worker, 2)


def test_tp_divides_the_split_parts_only():
    """tp 2 halves the layers' projections, the head's rows and the split activations; norms, embedding and the
    residual stream stay whole; the engine's KV cache splits by its own tp."""
    from specco.plan import kv_cache_bytes, logits_bytes, rank_params
    pc = PRESETS["qwen3-8b"]
    one, two = rank_params(pc, range(36), True, True, 1), rank_params(pc, range(36), True, True, 2)
    embed = pc.vocab_size * pc.hidden_size
    assert one == policy_params(pc) and embed < one - two < one / 2  # not quite half: embedding and norms whole
    assert logits_bytes(pc, 2, 2) * 2 == logits_bytes(pc, 2) == pc.vocab_size * 4  # the logits and their gradient
    h = pc.hidden_size
    whole = 2 * h * 4 + 2 * (h * (4 + 2) + 4)
    assert layer_activation_bytes(pc, 2, 4, 2) - whole == (layer_activation_bytes(pc, 2, 4) - whole) // 2
    lay = Layout(1, 8, 1, 1, False, False)
    s = _shapes(pc, rows=64, seq=4096, c=2, draft=None)  # the policy's cache only
    assert abs(kv_cache_bytes(s, lay, 2) * 2 - kv_cache_bytes(s, lay)) <= 2
    s = _shapes(pc, rows=64, seq=4096, c=2)  # the draft's own cache is whole on every rank
    assert kv_cache_bytes(s, lay, 2) * 2 > kv_cache_bytes(s, lay)


def test_plan_ranks_fitting_layouts_first():
    cfg = RunConfig()
    plan = plan_memory(cfg, 8, 141, model="qwen3-8b", prompt_tokens=512)
    heads = [plan.headroom(m) for _, m in plan.rows]
    assert heads == sorted(heads, reverse=True)


def test_cli_table_and_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    main(["plan", "--gpus", "8", "--gpu-mem", "141", "--model", "qwen3-8b", "--top", "3", "--json", str(out),
          "rollout.dtype=bfloat16", "train.micro_batch_rows=4", "rollout.max_new_tokens=2048", "train.kl_coef=0.1"])
    text = capsys.readouterr().out.splitlines()
    assert text[0].startswith("policy 8.19 B params") and "fits" in text[1] and len(text) == 5
    data = json.loads(out.read_text())
    assert data["gpus"] == 8 and data["seq"] == 512 + 2048
    row = data["layouts"][0]
    assert row["pp"] * row["dp_replicate"] * row["dp_shard"] * row["cp"] * row["tp"] == 8
    assert row["ref"] > 0
    assert abs(sum(row[k] for k in ("params", "compute", "grads", "adamw", "acts", "draft", "ref", "engine_w",
                                    "kv_cache")) - row["total"]) < 1e-6


def test_cli_refuses_unknown_model(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--gpus", "8", "--gpu-mem", "141", "--model", "gpt-9"])
    assert e.value.code == 2 and "qwen3-8b" in capsys.readouterr().err


def test_plan_assumes_a_lookup_workloads_prompt_length():
    """Without --prompt-tokens the planner takes data.max_prompt_tokens, else a lookup workload's longest ledger
    (+ <bos>), else 512: configs/long_context.toml plans 32K-token rows, not 512-token ones (which under-counted its
    activations and KV cache ~16-fold)."""
    from specco.config_load import load_config
    from specco.plan import longest_prompt
    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / "configs" / "long_context.toml")
    assert longest_prompt(cfg) == cfg.data.context_tokens[-1] + 1
    assert plan_memory(cfg, 1, 141).shapes.seq == cfg.data.context_tokens[-1] + 1 + cfg.rollout.max_new_tokens
    capped = load_config(root / "configs" / "long_context.toml", ["data.max_prompt_tokens=40000"])
    assert longest_prompt(capped) == 40000
    assert longest_prompt(RunConfig()) == 512
    # the losses read the columns from the shortest ledger minus K+1 on (train/drafters.first_anchor), not all 33.9K
    from specco.plan import loss_columns
    s = plan_memory(cfg, 1, 141).shapes
    lo, K = cfg.data.context_tokens[0], cfg.draft.ttt_passes
    assert loss_columns(s, Layout(1, 1, 1, 1, fsdp=False, ac=True)) == s.seq - (lo - K - 1)
    assert loss_columns(s, Layout(1, 1, 1, 2, fsdp=False, ac=True)) == math.ceil(s.seq / 2)  # CP: every position
