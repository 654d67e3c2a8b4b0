"""FSDP2 / HSDP (parallel/fsdp.py) of the co-training step: sharded layouts on gloo == one process.

Reference: `cotrain_step` on one process over the whole batch, two optimizer steps (two batches), fp64.
Sharded: `Mesh.build(dp, dp_shard, cp)`, `apply_fsdp(policy, mesh.fsdp_mesh)` (each decoder layer, then the
root), AdamW built on the DTensor shards, `grad_syncs`: FSDP's reduce-scatter (+ HSDP's all-reduce) as SUMS for
the policy, the all-reduce for the replicated draft. Each data-parallel rank takes its rows (dp × cp: its
sequences, packed and zigzag-sharded over its CP group as tests/test_cp_cotrain.py does). Compared after each
step: both losses (sums of the ranks' contributions), every global metric (grad norms of both groups — over
DTensor shards for the policy — and the draft's statistics), every clipped gradient and, after the second
step, every parameter, gathered with `full_tensor()`. Co-trained EAGLE-3 and DFlash; micro-batches of 2 rows
(several per rank) with the draft on every second row, so FSDP's per-micro-batch reduce-scatter and the
held-unsharded accumulation (`hold_unsharded`) both sum across micro-batches. Then pp 2 × dp_shard 2
(`cotrain_step` with a real pipe, 1F1B, each stage sharded, the draft on the last stage fed by the TapChannel)
against the unsplit step, in fp64 and in bf16 (mixed precision under the pipeline, bf16 activations and taps on the wire).

Tolerance (fp64): rtol 1e-9, atol 1e-12, as the DP and CP tests: the sharded step does the same arithmetic in
other summation orders (reduce-scatter vs one process's autograd accumulation, per-rank partial sums, the norm
as a sum of per-shard squares); an averaged instead of summed reduction is off by the factor dp·cp, a wrong
shard or count by O(1e-2).

bf16 (dp_shard 2): FSDP's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) under the step's bf16
autocast against the single-process bf16-autocast step, fp32 master weights in both. The two runs round
different tensors to bf16 (FSDP casts every weight, so norms and the head run on bf16 weights; autocast only
casts matmul inputs), each rounding a relative 2^-9 = 2e-3, and a loss or a norm sums thousands of such
terms with random signs: losses and grad norms within rtol 2e-2 (about ten roundings' worth). Parameters after
two AdamW steps (β 0.9 / 0.95, no weight decay): the first step moves every weight by exactly ±lr (m̂/√v̂ =
sign(g)), the second by at most 1.0004·lr (Cauchy-Schwarz on m̂ = (0.09 g1 + 0.1 g2)/0.19 against
v̂ = (0.0475 g1² + 0.05 g2²)/0.0975), so a gradient component whose sign the rounding flips in both steps moves
a weight by up to 2·2.0004·lr: the max deviation is bounded by 4.01·lr per group (a hard bound, met when a
component sits within rounding of zero), and the MEAN deviation must stay below 0.05·lr (flips are rare).

Measured (pytest -s prints them), fp64: losses within 3.7e-16 relative, grad norms 1.5e-16, gradients
4.8e-17 absolute, parameters after two steps 8.8e-15 absolute (3.4e-13 relative) over every layout and
kind. bf16 at dp_shard 2: losses 2.4e-3, grad norms 1.0e-3 relative; parameters max 3.9 lr (policy) /
2.7 lr (draft), mean 0.013 lr / 0.024 lr. pp 2 × dp_shard 2 bf16: max 2.0 / 2.3 lr, mean 0.011 / 0.015 lr.
"""
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from specco.model.dflash import BlockDraft
from specco.parallel.cp import shard_batch
from specco.parallel.layout import ZigzagPack
from specco.parallel.fsdp import apply_fsdp, mixed_precision
from specco.parallel.mesh import Mesh, spawn_local
from specco.parallel.zigzag import ZigzagLayout
from specco.train.cotrain import StepConfig, TrainBatch, build_optimizer, cotrain_step
from specco.train.grad_sync import grad_syncs
from cp_reference import pack_rows

V = 61  # test_cp_cotrain's / test_block_cp's vocabulary; the last id is DFlash's mask token, never in data
B, S = 16, 14  # the DP batch: 8 / 4 rows per rank at dp 2 / 4 (even, so the draft's row stride 2 stays global)
LENS = (11, 3, 17, 8)  # the dp 2 × cp 2 batch: dp rank d packs sequences 2d, 2d+1 and zigzags them over cp
TOL = dict(rtol=1e-9, atol=1e-12)
LR, DRAFT_LR = 1e-3, 1e-2

pytestmark = pytest.mark.dist


def _models(kind, dtype=torch.float64):
    if kind == "eagle3":
        from test_cp_cotrain import _models as m
        policy, draft = m()
    else:
        from test_block_cp import _models as m
        policy, draft = m(kind)
    return policy.to(dtype), draft.to(dtype)


def _logp_old(shape, g, dtype):
    """Old log-probs near the fresh policy's (~ -log V: its logits start small), so that most PPO ratios stay
    inside the clip range and the policy's gradient is not zero (a ratio clipped everywhere trains nothing);
    the tails still clip, so both branches of the surrogate are compared."""
    return -math.log(V) + 0.15 * torch.randn(shape, generator=g, dtype=dtype)


def _dp_batch(seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, S, dtype=dtype)
    for b in range(B):
        mask[b, 3:S - b % 4] = 1  # completions of different lengths: micro-batches trim differently
    return TrainBatch(tokens=torch.randint(0, V - 1, (B, S), generator=g), target_mask=mask,
                      advantages=torch.randn(B, generator=g, dtype=dtype),
                      logp_old=_logp_old((B, S), g, dtype))


def _cp_batch(seed):
    g = torch.Generator().manual_seed(seed)
    n, width = len(LENS), max(LENS)
    mask = torch.zeros(n, width, dtype=torch.float64)
    for b, L in enumerate(LENS):
        mask[b, min(4, L - 2):L] = 1  # completion tokens; the prompt and the right padding are 0
    return TrainBatch(tokens=torch.randint(0, V - 1, (n, width), generator=g), target_mask=mask,
                      advantages=torch.randn(n, generator=g, dtype=torch.float64),
                      logp_old=_logp_old((n, width), g, torch.float64))


def _named(policy, draft):
    return [(f"{t}.{n}", p) for t, mod in (("policy", policy), ("draft", draft)) for n, p in mod.named_parameters()]


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _two_steps(policy, draft, batches, cfg, **kw):
    """Two optimizer steps; per step the metrics and every (clipped) gradient, then every parameter, all
    gathered whole."""
    opt = build_optimizer(policy, draft, LR, DRAFT_LR)  # after apply_fsdp: AdamW holds the shards
    hist = []
    for batch, extra in batches:
        m = cotrain_step(policy, draft, batch, opt, None, cfg, **kw, **extra)
        hist.append((m, {n: _full(p.grad).clone() for n, p in _named(policy, draft) if p.grad is not None}))
    return hist, {n: _full(p.detach()).clone() for n, p in _named(policy, draft)}


def _deviations(hist, params, ref_hist, ref_params, group) -> dict:
    """The largest deviations from the reference (printed by rank 0 with `pytest -s`: the figures the
    tolerances are judged by): relative for losses and grad norms, absolute and relative for tensors."""
    dev = {"loss_rel": 0.0, "norm_rel": 0.0, "grad_abs": 0.0, "param_abs": 0.0, "param_rel": 0.0}
    for (m, g), (m_ref, g_ref) in zip(hist, ref_hist):
        for key in ("policy/loss", "draft/loss"):
            total = torch.tensor([m[key]], dtype=torch.float64)
            dist.all_reduce(total, group=group)
            dev["loss_rel"] = max(dev["loss_rel"], abs(total.item() - m_ref[key]) / max(abs(m_ref[key]), 1e-300))
        for key in ("policy/grad_norm", "draft/grad_norm"):
            dev["norm_rel"] = max(dev["norm_rel"], abs(m[key] - m_ref[key]) / max(abs(m_ref[key]), 1e-300))
        dev["grad_abs"] = max([dev["grad_abs"]] + [(g[n] - g_ref[n]).abs().max().item() for n in g_ref])
    for n, ref in ref_params.items():
        d = (params[n].double() - ref.double()).abs()
        dev["param_abs"] = max(dev["param_abs"], d.max().item())
        dev["param_rel"] = max(dev["param_rel"], (d / ref.double().abs().clamp_min(1e-3)).max().item())
    return dev


def _compare(hist, params, ref_hist, ref_params, tol, group):
    if dist.get_rank() == 0:
        print("max deviations:", {k: f"{v:.2e}" for k, v in _deviations(hist, params, ref_hist, ref_params,
                                                                       group).items()})
    else:
        _deviations(hist, params, ref_hist, ref_params, group)  # its all-reduces are collective
    for (m, g), (m_ref, g_ref) in zip(hist, ref_hist):
        for key in ("policy/loss", "draft/loss"):  # each rank holds its contribution to the global mean
            total = torch.tensor([m[key]], dtype=torch.float64)
            dist.all_reduce(total, group=group)
            assert abs(total.item() - m_ref[key]) <= tol["rtol"] * abs(m_ref[key]), (key, total.item(), m_ref[key])
        for key in m_ref:  # global: grad norms over every shard, the draft's statistics, LRs
            if key.startswith(("draft/", "policy/grad_norm")) and key != "draft/loss":
                assert abs(m[key] - m_ref[key]) <= tol["rtol"] * max(1.0, abs(m_ref[key])), (key, m[key], m_ref[key])
        assert g.keys() == g_ref.keys()
        for n in g_ref:
            torch.testing.assert_close(g[n], g_ref[n], **tol, msg=lambda s: f"grad {n}: {s}")
    for n in ref_params:
        torch.testing.assert_close(params[n], ref_params[n], **tol, msg=lambda s: f"param {n}: {s}")


def _worker(rank, world, kind, dp_shard, cp, hold):
    dp = world // cp
    mesh = Mesh.build(dp=dp, cp=cp, dp_shard=dp_shard, backend="gloo")
    if cp == 1:  # rows split over dp, micro-batches of 2 rows, the draft on rows 0 mod 2
        cfg = StepConfig(ttt_passes=3, loss_chunk=5, draft_row_stride=2, micro_batch_rows=2)
        full = [_dp_batch(7), _dp_batch(8)]
        ref = _two_steps(*_models(kind), [(b, {}) for b in full], cfg)
        h = B // dp
        local = [(b.rows(mesh.dp_rank * h, (mesh.dp_rank + 1) * h), {}) for b in full]
    else:  # each dp rank packs its sequences into one row, zigzag over its cp group
        cfg = StepConfig(ttt_passes=3, loss_chunk=5, draft_row_stride=1)
        full = [_cp_batch(7), _cp_batch(8)]
        ref = _two_steps(*_models(kind), [(b, {}) for b in full], cfg)
        mine = slice(mesh.dp_rank * 2, mesh.dp_rank * 2 + 2)
        local = []
        for b in full:
            sub = TrainBatch(tokens=b.tokens[mine], target_mask=b.target_mask[mine], advantages=b.advantages[mine],
                             logp_old=b.logp_old[mine])
            packed, cu = pack_rows(sub, LENS[mine])
            lay = ZigzagLayout(cu, cp, mesh.cp_rank)
            local.append((shard_batch(packed, lay), {"layout": ZigzagPack(mesh.cp_group, lay)}))
    policy, draft = _models(kind)
    apply_fsdp(policy, mesh.fsdp_mesh)
    assert isinstance(policy.layers["0"].mlp.gate_up_proj.weight, DTensor) and not isinstance(draft.fc.weight, DTensor)
    hist, params = _two_steps(policy, draft, local, cfg, grad_group=mesh.grad_group,
                              grad_sync=grad_syncs(policy, mesh.grad_group, hold_unsharded=hold))
    _compare(hist, params, *ref, TOL, mesh.grad_group)


# name: (world, dp_shard, cp, hold_unsharded). 2 processes take ~15-18 s here (2 shared cores), 4 take ~40 s:
# those are the slow lane
_SLOW = pytest.mark.slow
LAYOUTS = [
    pytest.param(2, 2, 1, False, id="dp_shard2"),
    pytest.param(2, 2, 1, True, id="dp_shard2_hold"),
    pytest.param(4, 4, 1, False, id="dp_shard4", marks=_SLOW),
    pytest.param(4, 2, 1, False, id="hsdp2x2", marks=_SLOW),
    pytest.param(4, 2, 2, False, id="dp_shard2_cp2", marks=_SLOW),
]


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
@pytest.mark.parametrize("world,dp_shard,cp,hold", LAYOUTS)
def test_fsdp_cotrain_equals_single_process(kind, world, dp_shard, cp, hold):
    spawn_local(_worker, world, kind, dp_shard, cp, hold)


def _bf16_worker(rank, world, kind):
    """dp_shard 2, bf16: FSDP's MixedPrecisionPolicy + the step's autocast vs the single-process autocast step."""
    mesh = Mesh.build(dp=world, dp_shard=world, backend="gloo")
    cfg = StepConfig(ttt_passes=3, loss_chunk=5, draft_row_stride=2, micro_batch_rows=2, amp_dtype=torch.bfloat16)
    full = [_dp_batch(7, torch.float32), _dp_batch(8, torch.float32)]
    ref_hist, ref_params = _two_steps(*_models(kind, torch.float32), [(b, {}) for b in full], cfg)
    h = B // world
    local = [(b.rows(rank * h, (rank + 1) * h), {}) for b in full]
    policy, draft = _models(kind, torch.float32)
    apply_fsdp(policy, mesh.fsdp_mesh, mp_policy=mixed_precision(torch.bfloat16))
    hist, params = _two_steps(policy, draft, local, cfg, grad_group=mesh.grad_group,
                              grad_sync=grad_syncs(policy, mesh.grad_group))
    assert all(p.dtype == torch.float32 for p in params.values())  # fp32 master weights
    assert all(p.grad.dtype == torch.float32 for p in policy.parameters())  # reduced in fp32
    dev = _deviations(hist, params, ref_hist, ref_params, mesh.grad_group)
    if rank == 0:
        print("bf16 max deviations:", {k: f"{v:.2e}" for k, v in dev.items()})
    # tolerances derived in the module docstring
    assert dev["loss_rel"] <= 2e-2 and dev["norm_rel"] <= 2e-2, dev
    for group, lr in (("policy.", LR), ("draft.", DRAFT_LR)):
        d = torch.cat([(params[n] - ref_params[n]).abs().flatten() for n in params if n.startswith(group)])
        if rank == 0:
            print(f"bf16 {group} params: max {d.max().item() / lr:.2f} lr, mean {d.mean().item() / lr:.4f} lr")
        assert d.max() <= 4.01 * lr and d.mean() <= 0.05 * lr, (group, d.max().item(), d.mean().item())


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_fsdp_bf16_mixed_precision_tracks_single_process_autocast(kind):
    spawn_local(_bf16_worker, 2, kind)


def _pp_worker(rank, world, bf16):
    """pp 2 × dp_shard 2: each stage FSDP-sharded over its 2 data ranks (no reshard after forward, as under
    1F1B), the draft replicated on the last stage; against the unsplit single-process step (test_pp_cotrain's
    models, batch and micro-batches of one row). bf16: FSDP's mixed precision + the step's autocast, the stages
    exchanging bf16 activations and taps, against the single-process autocast step (tolerances as for
    dp_shard 2, module docstring)."""
    import copy
    import dataclasses

    from specco.parallel.pipeline import PipeComm, split_stage, stage_layer_ranges
    from specco.parallel.taps import TapChannel, TapSpec
    from test_pp_cotrain import CFG, S as PS, _batch, _models as pp_models
    pp, dp = 2, 2
    dtype = torch.float32 if bf16 else torch.float64
    cfg = dataclasses.replace(CFG, amp_dtype=torch.bfloat16) if bf16 else CFG
    mesh = Mesh.build(dp=dp, dp_shard=dp, pp=pp, backend="gloo")
    s, last = mesh.pp_rank, mesh.pp_rank == pp - 1
    policy, draft = (m.to(dtype) for m in pp_models())
    b = _batch()
    batch = TrainBatch(tokens=b.tokens, target_mask=b.target_mask.to(dtype), advantages=b.advantages.to(dtype),
                       logp_old=b.logp_old.to(dtype))
    ref_p, ref_d = copy.deepcopy(policy), copy.deepcopy(draft)
    ref_hist, ref_params = _two_steps(ref_p, ref_d, [(batch, {}), (batch, {})], cfg)
    rows = batch.tokens.shape[0] // dp
    mine = batch.rows(mesh.dp_rank * rows, (mesh.dp_rank + 1) * rows)
    aux = draft.cfg.aux_layer_ids
    stage = split_stage(policy, pp, s)
    apply_fsdp(stage, mesh.fsdp_mesh, mp_policy=mixed_precision(torch.bfloat16 if bf16 else None),
               reshard_after_forward=False)
    d = copy.deepcopy(draft) if last else None
    opt = build_optimizer(stage, d, LR, DRAFT_LR)
    wire = torch.bfloat16 if bf16 else dtype
    spec = TapSpec.for_stages(stage_layer_ranges(policy.cfg.num_layers, pp), aux, policy.cfg.hidden_size, wire,
                              cfg.micro_batch_rows * PS)
    ch = TapChannel(spec, mesh.tap_group, slots=2, timeout_s=60)
    named = [(f"policy.{n}", p) for n, p in stage.named_parameters()] + \
        ([(f"draft.{n}", p) for n, p in d.named_parameters()] if last else [])
    rtol = 2e-2 if bf16 else TOL["rtol"]
    for step, (m_ref, g_ref) in enumerate(ref_hist, start=1):
        m = cotrain_step(stage, d, mine, opt, None, cfg, pipe=PipeComm(mesh.pp_group), taps=ch, tap_layers=aux,
                            step=step, grad_group=mesh.grad_group, grad_sync=grad_syncs(stage, mesh.grad_group),
                            act_dtype=wire)
        losses = torch.tensor([m["policy/loss"], m["draft/loss"]], dtype=torch.float64)
        dist.all_reduce(losses, group=mesh.grad_group)
        ref = torch.tensor([m_ref["policy/loss"], m_ref["draft/loss"]], dtype=torch.float64)
        assert ((losses - ref).abs() <= rtol * ref.abs()).all(), (losses, ref)
        for k in ("policy/grad_norm", "draft/grad_norm"):  # the policy's over both stages' shards
            assert abs(m[k] - m_ref[k]) <= rtol * m_ref[k], (k, m[k], m_ref[k])
        for n, p in named if not bf16 else ():
            torch.testing.assert_close(_full(p.grad), g_ref[n], **TOL, msg=lambda e: f"stage {s} grad {n}: {e}")
    if not bf16:
        for n, p in named:
            torch.testing.assert_close(_full(p.detach()), ref_params[n], **TOL, msg=lambda e: f"stage {s} {n}: {e}")
        return
    assert all(p.dtype == torch.float32 for _, p in named)  # fp32 master weights
    for group, lr in (("policy.", LR), ("draft.", DRAFT_LR)):
        d = [(_full(p.detach()) - ref_params[n]).abs().flatten() for n, p in named if n.startswith(group)]
        if d:
            d = torch.cat(d)
            print(f"pp bf16 stage {s} {group} params: max {d.max().item() / lr:.2f} lr, mean "
                  f"{d.mean().item() / lr:.4f} lr")
            assert d.max() <= 4.01 * lr and d.mean() <= 0.05 * lr, (group, d.max().item(), d.mean().item())


@pytest.mark.slow
@pytest.mark.parametrize("bf16", [False, True], ids=["fp64", "bf16"])
def test_pp2_fsdp2_equals_unsplit(bf16):
    spawn_local(_pp_worker, 4, bf16)


def _mesh_worker(rank, world):
    """The split data axis keeps every old group's members (dp_rank, cp_rank as before) and builds the FSDP
    mesh over the stage's dp_shard × cp ranks, 2-D under HSDP."""
    mesh = Mesh.build(dp=2, dp_shard=2, cp=2, backend="gloo")  # dp_replicate 1: fsdp = all 4 ranks
    assert (mesh.dp_rank, mesh.cp_rank, mesh.dp_replicate) == (rank // 2, rank % 2, 1)
    assert mesh.fsdp_mesh.mesh_dim_names == ("fsdp",) and mesh.fsdp_mesh.mesh.tolist() == [0, 1, 2, 3]
    hsdp = Mesh.build(dp=4, dp_shard=2, backend="gloo")  # replicas {0, 1} and {2, 3}, shards within
    assert (hsdp.dp_rank, hsdp.dp_replicate) == (rank, 2)
    assert hsdp.fsdp_mesh.mesh_dim_names == ("dp_replicate", "fsdp")
    assert hsdp.fsdp_mesh.mesh.tolist() == [[0, 1], [2, 3]]
    x = torch.tensor([float(rank)])
    dist.all_reduce(x, group=hsdp.fsdp_mesh["fsdp"].get_group())  # my shard group: my replica's pair
    assert x.item() == (1.0 if rank < 2 else 5.0)
    with pytest.raises(ValueError, match="parallel.dp=4 is not a multiple of parallel.dp_shard=3"):
        Mesh.build(dp=4, dp_shard=3, backend="gloo")


@pytest.mark.slow  # 4 processes: ~26 s here
def test_mesh_splits_dp_into_replicate_and_shard():
    spawn_local(_mesh_worker, 4)
