"""Mixture of experts under pipeline parallelism (issue 38 item 2): the router's load-balancing loss summed over the
stages by the 1F1B schedule (train/moe_loss.RouterBalance, parallel/pipeline.one_f_one_b's `sums`), and expert
parallelism inside each stage (parallel.ep × parallel.pp: each stage's experts over its own dp × cp ranks). fp64, gloo.

The co-training step (EAGLE-3 draft fed by the TapChannel, aux coefficient 0.05, clip active) of a tiny Qwen2-MoE
(5 layers, 8 experts top-2 with the sigmoid-gated shared expert; layers 1 and 4 dense, so at pp = 3 the last stage
(layer 4) has no router at all) against the unsplit one-process step on the whole batch:

    pp 2                     the balance loss's pieces travel with the activations and back with the gradients
    pp 3                     three stages, the last one without sparse layers (its sums are zeros)
    pp 2 × dp 2 × ep 2       each stage's experts over its two ranks (all-to-all inside the stage)
    pp 2 × dp 2 × ep 2, FSDP the dense rest sharded over the stage's pair

Compared: "policy/loss", "draft/loss", "policy/aux_loss" (summed over the data-parallel ranks: each rank's share),
the grad norms, every gradient and every parameter after AdamW the rank holds (an expert slice against its rows of
the reference's): rtol 1e-9, atol 1e-12. fp64, one micro-batch per row in both runs, so the aux loss's micro-batches
are the same; what differs is summation order (the balance sums over stages, the clip norm's per-stage squares, the
all-reduces), ~1e-15 relative, while a stage that backpropagated only its own layers' balance (the stage-local L_aux,
the mutation below) is off by O(1e-4) relative in the routers' gradients, and a dropped term by the whole aux share.

The RL loop: two steps of the co-trained EAGLE-3 arm (PPO 2 × 2, KL reference) at pp 2 × dp 2 × ep 2 against the
same run at pp 2 × dp 2, ep 1 (test_rl_pp.py ties pp 2 to one process): rollouts, rewards, losses, aux loss, grad
norms (rel 1e-9), every weight after both steps and the engine's refit copy (the stages and experts gathered); the
step-1 checkpoint resumed at the same layout (bit for bit) and at ep 1 (every expert read whole; rtol 1e-9).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from specco.model.config import DraftConfig, PolicyConfig
from specco.model.draft import Eagle3Draft, build_vocab_maps
from specco.model.policy import Policy
from specco.parallel.ep import EPExperts, apply_ep, is_ep
from specco.parallel.mesh import Mesh, spawn_local
from specco.parallel.pipeline import PipeComm, split_stage, stage_layer_ranges
from specco.parallel.taps import TapChannel, TapSpec
from specco.train.cotrain import StepConfig, build_optimizer, cotrain_step
from specco.train.grad_sync import grad_syncs
from test_pp_cotrain import _batch, _snap

pytestmark = pytest.mark.dist

V, S, B = 53, 9, 4
TOL = dict(rtol=1e-9, atol=1e-12)
CFG = StepConfig(ttt_passes=2, loss_chunk=4, policy_grad_clip=0.1, draft_grad_clip=0.02, draft_row_stride=1,
                 micro_batch_rows=1)
QWEN2_MOE = dict(vocab_size=V, hidden_size=16, intermediate_size=24, num_layers=5, num_heads=2, num_kv_heads=1,
                 model_type="qwen2_moe", attention_bias=True, num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=8, shared_expert_intermediate_size=12, decoder_sparse_step=1,
                 mlp_only_layers=(1, 4), router_aux_loss_coef=0.05)


def _models():
    torch.manual_seed(0)
    pc = PolicyConfig(**QWEN2_MOE)
    policy = Policy(pc)
    with torch.no_grad():  # decisive routing (the init's 0.02 router routes nearly uniformly)
        for name, p in policy.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    draft = Eagle3Draft(DraftConfig.for_policy(pc, 37, aux_layer_ids=(0, 2, 4)))
    draft.set_vocab_maps(*build_vocab_maps(torch.rand(V), 37))
    return policy.double(), draft.double()


class _StageLocalBalance:
    """The mutation: each stage backpropagates the balance loss of its own layers only (L_aux per stage, summed),
    not its share of the whole policy's — what a pipeline that never exchanged the sums would do."""

    def __init__(self, real):
        self.real = real
        self.numel = real.numel

    def record(self, *a):
        self.real.record(*a)

    def add(self, m, prefix):
        return self.real.add(m, None) if prefix is None else prefix + self.real.add(m, None)

    def loss(self, m, totals):
        own = self.real._own[m][0].detach().to(torch.float64)
        return self.real.loss(m, own)

    @property
    def total(self):
        return self.real.total


def _step_worker(rank, world, pp, dp, ep, dp_shard, mutate=False):
    from specco.parallel.fsdp import apply_fsdp
    mesh = Mesh.build(dp=dp, pp=pp, backend="gloo", ep=ep, dp_shard=dp_shard)
    s, last = mesh.pp_rank, mesh.pp_rank == pp - 1
    policy, draft = _models()
    batch = _batch(B)
    ref_p, ref_d = copy.deepcopy(policy), copy.deepcopy(draft)
    ref_m = cotrain_step(ref_p, ref_d, batch, build_optimizer(ref_p, ref_d, 1e-2, 1e-2), None, CFG)
    assert ref_m["policy/grad_norm"] > 2 * CFG.policy_grad_clip and ref_m["policy/aux_loss"] > 0  # clip active
    ref_g, ref_w = _snap("policy", ref_p)
    g, w = _snap("draft", ref_d)
    ref_g.update(g), ref_w.update(w)
    rows = B // dp
    mine = batch.rows(mesh.dp_rank * rows, (mesh.dp_rank + 1) * rows)
    aux = draft.cfg.aux_layer_ids
    stage = split_stage(policy, pp, s)
    if ep > 1:  # as trainer.make_arm: the stage cut, its experts placed, then FSDP of the rest
        apply_ep(stage, mesh.ep_group, mesh.ep_replica_group, strict=False)
    if dp_shard > 1:
        apply_fsdp(stage, mesh.fsdp_mesh, reshard_after_forward=False)
    d = copy.deepcopy(draft) if last else None
    opt = build_optimizer(stage, d, 1e-2, 1e-2)
    spec = TapSpec.for_stages(stage_layer_ranges(policy.cfg.num_layers, pp), aux, policy.cfg.hidden_size,
                              torch.float64, CFG.micro_batch_rows * S)
    ch = TapChannel(spec, mesh.tap_group, slots=pp + 1, timeout_s=60)
    pipe = PipeComm(mesh.pp_group)
    if mutate:
        import specco.train.cotrain as ct
        real = ct.RouterBalance
        ct.RouterBalance = lambda *a: _StageLocalBalance(real(*a))
    try:
        m = cotrain_step(stage, d, mine, opt, None, CFG, pipe=pipe, taps=ch, tap_layers=aux, step=1,
                         grad_group=mesh.grad_group,
                         grad_sync=grad_syncs(stage, mesh.grad_group, reshard_after_forward=False))
    finally:
        if mutate:
            ct.RouterBalance = real
    assert any(op.startswith("send_sums") for op, *_ in pipe.log)  # the pieces did travel
    losses = torch.tensor([m["policy/loss"], m["draft/loss"], m["policy/aux_loss"]], dtype=torch.float64)
    dist.all_reduce(losses, group=mesh.grad_group)  # each DP rank's share of the global values
    want = torch.tensor([ref_m["policy/loss"], ref_m["draft/loss"], ref_m["policy/aux_loss"]], dtype=torch.float64)
    bad = [] if torch.allclose(losses, want, **TOL) else [f"losses {losses.tolist()} vs {want.tolist()}"]
    for k in ("policy/grad_norm", "draft/grad_norm"):
        if abs(m[k] - ref_m[k]) > 1e-9 * ref_m[k]:
            bad.append(f"{k}: {m[k]} vs {ref_m[k]}")
    got_g, got_w = _snap("policy", stage)
    if last:
        gd, wd = _snap("draft", d)
        got_g.update(gd), got_w.update(wd)
    local = {f"policy.{n}": mod for n, mod in stage.named_modules() if isinstance(mod, EPExperts)}
    assert bool(local) == (ep > 1 and any(i not in QWEN2_MOE["mlp_only_layers"] for i in map(int, stage.layers.keys())))
    assert got_g.keys() == got_w.keys() and got_w
    for k in got_w:
        mod = local.get(k.rsplit(".", 1)[0])
        cut = slice(mod.first, mod.first + mod.local) if mod is not None else slice(None)
        for what, got, ref in (("grad", got_g[k], ref_g[k]), ("param", got_w[k], ref_w[k])):
            got = got.full_tensor() if hasattr(got, "full_tensor") else got
            if not torch.allclose(got, ref[cut], **TOL):
                bad.append(f"stage {s}: {what} {k}: max diff {(got - ref[cut]).abs().max().item():.3g}")
    if mutate:
        assert any("mlp.gate.weight" in b for b in bad), f"stage {s}: the stage-local balance loss passed: {bad}"
    else:
        assert not bad, bad


@pytest.mark.parametrize("pp", [2, 3])
def test_moe_balance_loss_under_pp_equals_unsplit(pp):
    spawn_local(_step_worker, pp, pp, 1, 1, 1)


def test_mutation_stage_local_balance_loss_fails():
    spawn_local(_step_worker, 2, 2, 1, 1, 1, True)


def test_ep2_inside_pp2_equals_unsplit():
    spawn_local(_step_worker, 4, 2, 2, 2, 1)


def test_ep2_inside_pp2_with_fsdp_equals_unsplit():
    spawn_local(_step_worker, 4, 2, 2, 2, 2)


# -- the RL loop ---------------------------------------------------------------------------------------------------

def _whole(st, mesh) -> dict:
    """The arm's whole trained policy by name, on every rank: the stages (and each stage's experts) gathered."""
    from specco.runner.rl_pp import gather_for_refit
    return {k: v.detach().clone() for k, v in gather_for_refit(st, mesh)[0].items()}


def _rl_worker(rank, world, tmp):
    from pathlib import Path
    from test_ep import RL_EXTRA, _rl_models
    from test_grpo import DigitTask
    from test_rl_cp import _cfg
    from specco.runner.rl import run_arm
    tmp = Path(tmp)
    tok, policy, draft = _rl_models()
    out = {}
    for ep in (1, 2):
        cfg = _cfg(tmp, "parallel.pp=2", "parallel.dp=2", f"parallel.ep={ep}", *RL_EXTRA,
                   "rollout.prompts_per_step=4")  # 2 GRPO groups per DP rank: minibatches=2
        mesh = Mesh.build(2, 1, backend="gloo", pp=2, ep=ep)
        st, rec = {}, []
        rows = run_arm(cfg, "cotrained", policy, draft, DigitTask(), tok, tmp / f"ep{ep}", progress=False, mesh=mesh,
                       state_out=st, record=rec)
        out[ep] = (rows, [ro.pairs for ro in rec], st["state"], cfg, mesh)
    (rows1, pairs1, st1, cfg1, mesh1), (rows2, pairs2, st2, cfg2, mesh2) = out[1], out[2]
    stage = st2.policy
    assert is_ep(stage)  # every stage of the 4-layer policy holds a sparse layer (layer 1 is dense)
    # the KL reference is this rank's stage too, its experts placed like the trainer's (its log-probs pipelined)
    assert list(st2.ref.layers) == list(stage.layers) and is_ep(st2.ref)
    sparse = [m for m in stage.modules() if isinstance(m, EPExperts)]
    assert sparse and all(m.gate_up_proj.shape[0] == 8 // 2 for m in sparse)
    assert pairs2 == pairs1
    for a, b in zip(rows2, rows1):
        for k in ("reward", "policy/loss", "policy/aux_loss", "policy/kl", "policy/grad_norm", "draft/loss"):
            assert abs(a[k] - b[k]) <= 1e-9 * max(1.0, abs(b[k])), (k, a[k], b[k])
    assert rows1[0]["policy/aux_loss"] > 0 and rows1[1]["policy/kl"] > 0
    w1, w2 = _whole(st1, mesh1), _whole(st2, mesh2)
    assert w1.keys() == w2.keys() == st2.engine.policy.state_dict().keys()
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], **TOL, msg=k)
    eng = st2.engine.policy.state_dict()  # the engine: refit from the gathered stages and experts
    assert all(torch.equal(v, w2[k]) for k, v in eng.items())

    def run(d, cfg, mesh, **kw):
        return run_arm(cfg, "cotrained", policy, draft, DigitTask(), tok, tmp / d, progress=False, mesh=mesh, **kw)
    # resumed at the same layout: bit for bit; the ep 2 checkpoint resumed at ep 1 (experts read whole)
    for d, then, rows, w, exact in (("same", (cfg2, mesh2), rows2, w2, True), ("to_ep1", (cfg1, mesh1), rows1, w1, False)):
        fin = {}
        again = run(d, cfg2, mesh2, stop_after=1) + run(d, *then, state_out=fin)
        assert [r["step"] for r in again] == [1, 2], (rank, d, [r["step"] for r in again])
        for k in ("reward", "policy/loss", "policy/aux_loss", "draft/loss", "policy/grad_norm"):
            ok = again[1][k] == rows[1][k] if exact else abs(again[1][k] - rows[1][k]) <= 1e-9 * max(1, abs(rows[1][k]))
            assert ok, (d, k, again[1][k], rows[1][k])
        got = _whole(fin["state"], then[1])
        for k in w:
            torch.testing.assert_close(got[k], w[k], **(dict(rtol=0, atol=0) if exact else TOL), msg=(d, k))


def test_rl_loop_ep2_inside_pp2_equals_ep1_and_resumes(tmp_path):
    spawn_local(_rl_worker, 4, str(tmp_path))


def test_ep_with_pp_passes_the_layout_checks_and_tp_is_refused(tmp_path):
    """derive.check_parallel: parallel.ep inside a pipeline is a layout `specco train` runs; with tp still refused."""
    from test_rl_cp import _cfg
    from specco.model.config import ConfigError
    from specco.runner.derive import check_parallel
    moe = ("policy.family=qwen3_moe", "policy.num_experts=4", "policy.num_experts_per_tok=2",
           "policy.moe_intermediate_size=16")
    check_parallel(_cfg(tmp_path, "parallel.pp=2", "parallel.dp=2", "parallel.ep=2", *moe), 4, "train")
    with pytest.raises(ConfigError, match=r"parallel.ep=2 with parallel.tp=2: expert parallelism under tensor"):
        check_parallel(_cfg(tmp_path, "parallel.pp=2", "parallel.dp=2", "parallel.tp=2", "parallel.ep=2", *moe), 8,
                       "train")


def _stream_worker(rank, world):
    """pipeline.stream_stages (the PP refit's view) at pp 2 × dp 2 × ep 2 with FSDP over each stage's pair: in small
    buckets (more broadcasts than stages, each at most the bound or one larger tensor) it yields exactly the whole
    policy's state dict — every name once, each tensor equal to the unsplit policy's."""
    import specco.parallel.pipeline as P
    from specco.parallel.fsdp import apply_fsdp
    mesh = Mesh.build(dp=2, pp=2, backend="gloo", ep=2, dp_shard=2)
    policy, _ = _models()
    stage = split_stage(policy, 2, mesh.pp_rank)
    apply_ep(stage, mesh.ep_group, mesh.ep_replica_group, strict=False)
    apply_fsdp(stage, mesh.fsdp_mesh, reshard_after_forward=False)
    sizes, real = [], dist.broadcast
    P.dist.broadcast = lambda t, **kw: (sizes.append(t.numel() * t.element_size()), real(t, **kw))[1]
    try:
        got = list(P.stream_stages(stage, mesh.pp_group, bucket_bytes=4096))
    finally:
        P.dist.broadcast = real
    want = policy.state_dict()
    assert [k for k, _ in got] and len({k for k, _ in got}) == len(got) and {k for k, _ in got} == set(want)
    assert all(torch.equal(v, want[k]) for k, v in got)
    biggest = max(v.numel() * v.element_size() for v in want.values())
    assert len(sizes) > 2 and max(sizes) <= max(4096, biggest)


def test_stream_stages_yields_the_whole_policy_in_bounded_buckets():
    spawn_local(_stream_worker, 4)
