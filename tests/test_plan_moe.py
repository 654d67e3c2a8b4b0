"""`specco plan` of mixture-of-experts policies (specco/plan_moe.py): its counts and formulas against the models.

Parameter counts against Qwen3-MoE / Qwen2-MoE policies built on the meta device (shared expert, dense layers by
mlp_only_layers and decoder_sparse_step, pipeline stages); a sparse layer's activation formula to the byte against
the storages autograd saves (fp32, bf16 autocast, bf16 weights; the router's aux loss; under expert parallelism on
two gloo ranks, where the uniform expectation is the ep group's mean); the trainer estimate against the peak of a
real co-training step; the layouts' ep axis; each rank's parameter, gradient, AdamW and KL-reference bytes against
a policy sharded the trainer's way on four gloo ranks (FSDP at ep 1, slices sharded over their replicas, one holder);
the tensor-parallel engine's shard; the Qwen3-30B-A3B preset and the CLI.
"""
import dataclasses
import json
import math

import pytest
import torch

from specco.cli import main
from specco.config import RunConfig
from specco.model.config import ConfigError, PolicyConfig
from specco.model.policy import Policy
from specco.plan import (PRESETS, Layout, format_plan, layer_activation_bytes, layouts, plan_memory, policy_params,
                         rank_memory)
from specco.plan_moe import (active_params, dispatched_row_bytes, expert_copy_bytes, expert_params,
                             held_expert_params, moe_activation_bytes, router_aux_bytes, router_aux_step_bytes,
                             routed_token_bytes)
from specco.plan_params import master_bytes, rank_params, reference_bytes, stage_params
from specco.train.moe_loss import aux_share
from test_plan import PRECISIONS, _saved_storages, _shapes, measured_trainer_step, run_layer

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
    MLP, to the byte; the router aux loss adds router_aux_bytes per token and router_aux_step_bytes once per
    micro-batch.
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
    once = router_aux_step_bytes(pc, B * S) if aux else 0  # the (N, 1) mask column, the sums' vector, ...
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
            ffn = experts._experts
            experts._experts = lambda xs, counts: (received.append(int(counts.sum())), ffn(xs, counts))[1]  # noqa: E731
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
    m = measured_trainer_step(pc, moe_aux=True)
    assert m["metrics"]["policy/aux_loss"] > 0
    assert m["est"]["params"] + m["est"]["draft"] * 4 // 16 == m["params"]
    assert m["est"]["adamw"] + m["est"]["draft"] * 8 // 16 == m["moments"]
    ratio = m["trainer"] / m["measured"]
    print(f"planner {m['trainer'] / 1e6:.2f} MB vs measured peak {m['measured'] / 1e6:.2f} MB: {ratio:.3f}")
    assert 0.85 <= ratio <= 1.15, ratio


def _a3b_shapes(**kw):
    return _shapes(PRESETS["qwen3-30b-a3b"], rows=512, seq=4608, micro=2, c=2, **kw)


def test_layouts_add_an_ep_axis_the_trainer_runs():
    """ep divides dp × cp and num_experts; FSDP at ep 1 and ep with pp are planned (the trainer runs both), tp is
    not for a MoE policy; a dense policy keeps ep 1."""
    s = _a3b_shapes()
    lays = layouts(s, 16, ac=(False,))
    assert all(l.pp * l.dp * l.cp * l.tp == 16 for l in lays)
    assert all((l.dp * l.cp) % l.ep == 0 and 128 % l.ep == 0 for l in lays)
    assert all(l.tp == 1 for l in lays)
    assert {l.ep for l in lays} == {1, 2, 4, 8, 16}
    assert any(l.ep == 1 and not l.fsdp for l in lays) and any(l.ep == 1 and l.fsdp for l in lays)
    assert any(l.pp > 1 and l.ep > 1 for l in lays)
    assert Layout(1, 1, 8, 1, True, True, ep=8).name() == "pp1 rep1 shard8 cp1 ep8 ac"
    dense = _shapes(PRESETS["qwen3-8b"], rows=512, seq=2048, c=2)
    assert {l.ep for l in layouts(dense, 16, ac=(False,))} == {1}


def test_expert_state_follows_the_trainers_layout():
    """Qwen3-30B-A3B on 8 ranks (dp 8): the fullest rank's fp32 weights (gradients, AdamW alike) are its share of
    the dense rest plus its experts: E/ep whole without FSDP or with one holder per slice (ep = dp·cp), the slice's
    E/ep over its dp·cp/ep replicas under FSDP, all E over dp_shard at ep 1 under FSDP (HSDP: the replicas hold
    copies); the KL reference the same under FSDP and whole (every expert) without; the engine every expert."""
    s = dataclasses.replace(_a3b_shapes(), kl_reference=True)
    pc = s.policy
    every = range(pc.num_layers)
    X, P = expert_params(pc, every), policy_params(pc)
    one = X // 128  # one expert of every sparse layer
    #          (dp_shard, ep, experts a rank keeps)
    for shard, ep, held in ((8, 8, 16), (8, 4, 16), (8, 2, 16), (4, 8, 16), (4, 2, 16), (2, 4, 16), (1, 8, 16),
                            (1, 2, 64), (1, 1, 128), (8, 1, 16), (4, 1, 32), (2, 1, 64)):
        lay = Layout(1, 8 // shard, shard, 1, shard > 1, True, ep=ep)
        m = rank_memory(s, lay)
        assert m["params"] == 4 * (math.ceil((P - X) / shard) + held * one), lay
        assert m["grads"] == m["params"] and m["adamw"] == 2 * m["params"], lay
        assert m["ref"] == (m["params"] if shard > 1 else 4 * P), lay
    assert rank_memory(s, Layout(1, 1, 8, 1, True, True, ep=8))["engine_w"] > 2 * P  # the whole policy in bf16
    # the compute column, bf16, no checkpointing: plain slices (ep 8 = dp: one holder) are cast by autocast per
    # layer (2 B per local expert parameter); FSDP's slices (ep 4: two holders) are gathered in bf16 with their
    # layer, two at once, plus one's unsharded fp32 gradient (2·2 + 4 B per parameter of one layer's slice), as
    # are all E experts at ep 1
    ep1, ep4, ep8 = (rank_memory(s, Layout(1, 1, 8, 1, True, False, ep=ep))["compute"] for ep in (1, 4, 8))
    layer = X // 48
    assert ep4 - ep8 == 8 * (layer // 4) - 2 * (X // 8)
    assert ep1 - ep8 == 8 * layer - 2 * (X // 8)


def _fsdp_state_worker(rank, world):
    """The trainer's policy (parallel/load.sharded_copy with apply_ep as its prepare, trainer.make_arm's recipe) and
    KL reference (forward-only, frozen) on 4 gloo ranks: each rank's local bytes of every parameter, gradient and
    AdamW moment after one backward and step, and of the reference, against the plan's master / grad / adamw /
    reference bytes for the layout. ep 1 under FSDP (the experts sharded with their layers) and HSDP; ep 2 × dp_shard
    4 (two holders per slice: FSDP-sharded over them) and ep 2 in HSDP (the replica group spans the replicas); ep 4
    × dp_shard 4 and in HSDP (one holder: whole plain slices)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from specco.parallel.ep import apply_ep
    from specco.parallel.load import sharded_copy
    from specco.parallel.mesh import Mesh

    def local(t):
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    pc = _moe_pc("qwen3_moe", num_experts=8, num_layers=3, mlp_only_layers=(1,))  # every dim 0 divisible by 4
    torch.manual_seed(0)
    base = Policy(pc)
    every = range(pc.num_layers)
    rest = rank_params(pc, every, True, True) - expert_params(pc, every)
    s = dataclasses.replace(_shapes(pc, rows=8, seq=64, draft=None), kl_reference=True)
    for dp_shard, ep in ((4, 1), (2, 1), (4, 2), (2, 2), (4, 4), (2, 4)):
        mesh = Mesh.build(dp=world, backend="gloo", dp_shard=dp_shard, ep=ep)
        place = (lambda m: apply_ep(m, mesh.ep_group, mesh.ep_replica_group)) if ep > 1 else (lambda m: None)

        def frozen(m):
            place(m)
            m.requires_grad_(False)
        policy = sharded_copy(base, mesh.fsdp_mesh, prepare=place)
        ref = sharded_copy(base, mesh.fsdp_mesh, forward_only=True, prepare=frozen)
        opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
        tokens = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(rank))
        policy(tokens).logits.float().square().mean().backward()
        opt.step()
        lay = Layout(1, world // dp_shard, dp_shard, 1, True, False, ep=ep)
        X = held_expert_params(pc, every, lay)
        have = {"params": sum(local(p) for p in policy.parameters()),
                "grads": sum(local(p.grad) for p in policy.parameters()),
                "adamw": sum(local(t) for st in opt.state.values() for t in st.values() if t.dim()),
                "ref": sum(local(p) for p in ref.parameters())}
        plan = {"params": master_bytes(rest, lay, X), "grads": master_bytes(rest, lay, X),
                "adamw": 2 * master_bytes(rest, lay, X), "ref": reference_bytes(s, lay)}
        assert have == plan, (dp_shard, ep, rank, have, plan)
        dist.barrier()


def test_fsdp_state_bytes_are_each_ranks():
    from specco.parallel.mesh import spawn_local
    spawn_local(_fsdp_state_worker, 4)


def _engine_tp_worker(rank, world):
    """Each rank's parameters of the engine's tensor-parallel MoE shard (rollout/tp.tp_shard: every expert's SwiGLU
    and the shared expert cut I/tp, router whole) against plan.engine_weight_bytes."""
    import torch.distributed as dist
    from specco.plan import engine_weight_bytes
    from specco.rollout.tp import tp_shard
    for family in ("qwen3_moe", "qwen2_moe"):
        pc = _moe_pc(family)
        shard = tp_shard(Policy(pc), dist.group.WORLD)
        s = _shapes(pc, rows=8, seq=64, draft=None)
        assert sum(p.numel() for p in shard.parameters()) * s.engine_bytes == engine_weight_bytes(s, world), family
        assert engine_weight_bytes(s, world) < engine_weight_bytes(s, 1)


def test_engine_tp_bytes_are_each_ranks():
    from specco.parallel.mesh import spawn_local
    spawn_local(_engine_tp_worker, 2)


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
    extra = tokens * pc.hidden_size * 4 + router_aux_step_bytes(pc, tokens)  # the final norm's output, the aux loss's
    assert activation_bytes(s, lay, range(4), False, 1) == tokens * (dense + 3 * (sparse + kept)) + extra
    ac = dataclasses.replace(lay, ac=True)
    assert activation_bytes(s, ac, range(4), False, 1) == tokens * (4 * pc.hidden_size * 4 + sparse + 3 * kept) + extra


def test_preset_plans_with_a_tensor_parallel_engine():
    """64 H200s hold Qwen3-30B-A3B; a tensor-parallel engine (rollout.tp) is planned for MoE too: its weights split
    (every expert's SwiGLU / tp), under PP too (each stage's engine a shard), and it must divide the expert widths."""
    from specco.plan import tp_divides
    cfg = RunConfig()
    plan = plan_memory(cfg, 64, 141, model="qwen3-30b-a3b", prompt_tokens=512, offload=True, ac=(True,))
    assert plan.rows and any(lay.ep == 1 and lay.fsdp for lay, _ in plan.rows)
    assert plan.headroom(plan.rows[0][1]) > 0
    assert "(3.35 B active)" in format_plan(plan, 3).splitlines()[0]
    # a MoE trains at tp 1, so the engine's ranks are cp ranks: rows long enough for cp 2
    tp2 = plan_memory(cfg, 8, 141, model="qwen3-30b-a3b", prompt_tokens=4096, engine_tp=2, ac=(True,))
    tp1 = plan_memory(cfg, 8, 141, model="qwen3-30b-a3b", prompt_tokens=4096, engine_tp=1, ac=(True,))
    w = lambda p: min(m["engine_w"] for _, m in p.rows)  # noqa: E731
    assert w(tp2) < 0.6 * w(tp1) and any(lay.pp > 1 for lay, _ in tp2.rows)
    a3b = PRESETS["qwen3-30b-a3b"]
    assert tp_divides(a3b, 4, engine=True)
    for field in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        odd = dataclasses.replace(a3b, **{field: 770})  # not a multiple of 4
        assert tp_divides(odd, 4) and not tp_divides(odd, 4, engine=True), field
    with pytest.raises(ConfigError, match="768 expert width"):  # the refusal names the expert width
        plan_memory(cfg, 8, 141, model="qwen3-30b-a3b", engine_tp=3)


def test_cli_plans_the_moe_config(tmp_path, capsys):
    """configs/moe.toml (a from-scratch Qwen3-MoE policy): the table and the JSON show ep."""
    out = tmp_path / "plan.json"
    main(["plan", "configs/moe.toml", "--gpus", "8", "--gpu-mem", "141", "--top", "4", "--json", str(out)])
    text = capsys.readouterr().out.splitlines()
    assert "B active" in text[0] and len(text) == 6 and " ep" in text[2]
    data = json.loads(out.read_text())
    assert data["policy_active_params"] < data["policy_params"]
    assert all(row["ep"] >= 1 and row["tp"] == 1 for row in data["layouts"])
    assert any(row["ep"] == 8 for row in data["layouts"])
