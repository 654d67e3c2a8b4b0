"""Co-training under pipeline parallelism equals the unsplit step (docs/DESIGN.md §5).

Reference: `cotrain_step` on one process, the unsplit Policy and the draft, the same micro-batches.
PP: `split_stage` per rank, `cotrain_step` with a real pipe (1F1B, the draft on the last stage fed by the TapChannel
with fewer slots than micro-batches). Compared on every rank for its stage: policy loss, draft loss,
the grad norms, the gradient of every policy parameter it holds and (last stage) of every draft
parameter, and the parameters after the optimizer step. 5 layers, so neither pp = 2 (3 + 2) nor
pp = 4 (2 + 1 + 1 + 1; stage 2 holds no tap layer) divides it; pp = 2 × dp = 2 on 4 processes.
Then the same step without the draft: the schedule's recorded send/recv sequence and the policy's
gradients are identical (bitwise) — the channel and the draft leave the pipeline untouched.

Tolerance: fp64, rtol 1e-9 / atol 1e-12 — the differences are summation orders (DP sums, the clip
norm's per-stage partial sums); a wrong count, tap or micro-batch order gives O(1e-3) or worse.
"""
import copy

import pytest
import torch
import torch.distributed as dist

from specco.model.config import DraftConfig, PolicyConfig
from specco.model.draft import Eagle3Draft, build_vocab_maps
from specco.model.policy import Policy
from specco.parallel.mesh import Mesh, spawn_local
from specco.parallel.pipeline import PipeComm, split_stage, stage_layer_ranges
from specco.parallel.taps import TapChannel, TapSpec
from specco.train.cotrain import StepConfig, TrainBatch, build_optimizer, cotrain_step

V, S, B = 53, 9, 6
TOL = dict(rtol=1e-9, atol=1e-12)
CFG = StepConfig(ttt_passes=2, loss_chunk=4, policy_grad_clip=0.5, draft_grad_clip=0.5, draft_row_stride=1,
                 micro_batch_rows=1)

pytestmark = pytest.mark.dist


def _models():
    torch.manual_seed(0)
    pc = PolicyConfig(vocab_size=V, hidden_size=16, intermediate_size=24, num_layers=5, num_heads=2, num_kv_heads=1)
    policy = Policy(pc).double()
    draft = Eagle3Draft(DraftConfig.for_policy(pc, 37, aux_layer_ids=(0, 2, 4)))
    draft.set_vocab_maps(*build_vocab_maps(torch.rand(V), 37))
    return policy, draft.double()


def _batch(rows: int = B) -> TrainBatch:
    """A fixed fp64 GRPO batch of `rows` rows x S tokens over V ids, ragged target masks (also tests/test_ep_pp.py's)."""
    g = torch.Generator().manual_seed(3)
    mask = torch.zeros(rows, S, dtype=torch.float64)
    for b in range(rows):
        mask[b, 2:S - b % 3] = 1
    return TrainBatch(tokens=torch.randint(0, V, (rows, S), generator=g), target_mask=mask,
                      advantages=torch.randn(rows, generator=g, dtype=torch.float64),
                      logp_old=-torch.rand(rows, S, generator=g, dtype=torch.float64) * 3)


def _snap(tag, mod):
    """(gradients, weights) of `mod` by `tag`-prefixed name (also tests/test_ep_pp.py's)."""
    return ({f"{tag}.{n}": p.grad.clone() for n, p in mod.named_parameters() if p.grad is not None},
            {f"{tag}.{n}": p.detach().clone() for n, p in mod.named_parameters()})


def _worker(rank, world, pp, dp, slots):
    mesh = Mesh.build(dp=dp, pp=pp, backend="gloo")
    s, last = mesh.pp_rank, mesh.pp_rank == pp - 1
    policy, draft = _models()
    batch = _batch()
    # reference: the unsplit step on the whole batch
    ref_p, ref_d = copy.deepcopy(policy), copy.deepcopy(draft)
    ref_m = cotrain_step(ref_p, ref_d, batch, build_optimizer(ref_p, ref_d, 1e-2, 1e-2), None, CFG)
    ref_g, ref_w = _snap("policy", ref_p)
    g, w = _snap("draft", ref_d)
    ref_g.update(g), ref_w.update(w)
    # this rank's share: its DP rows, its stage
    rows = B // dp
    mine = batch.rows(mesh.dp_rank * rows, (mesh.dp_rank + 1) * rows)
    ranges = stage_layer_ranges(policy.cfg.num_layers, pp)
    aux = draft.cfg.aux_layer_ids

    def run(with_draft):
        stage = split_stage(policy, pp, s)
        d = copy.deepcopy(draft) if (last and with_draft) else None
        opt = build_optimizer(stage, d, 1e-2, 1e-2)
        pipe = PipeComm(mesh.pp_group)
        ch = None
        if with_draft:
            spec = TapSpec.for_stages(ranges, aux, policy.cfg.hidden_size, torch.float64, CFG.micro_batch_rows * S)
            ch = TapChannel(spec, mesh.tap_group, slots=slots, timeout_s=60)
        m = cotrain_step(stage, d, mine, opt, None, CFG, pipe=pipe, taps=ch, tap_layers=aux if with_draft else None,
                            step=1, grad_group=mesh.grad_group)
        return m, stage, d, pipe.log

    m, stage, d, log = run(True)
    losses = torch.tensor([m["policy/loss"], m["draft/loss"]], dtype=torch.float64)
    dist.all_reduce(losses, group=mesh.grad_group)  # each DP rank's share of the global means
    torch.testing.assert_close(losses, torch.tensor([ref_m["policy/loss"], ref_m["draft/loss"]],
                                                    dtype=torch.float64), **TOL)
    for k in ("policy/grad_norm", "draft/grad_norm", "draft/top1_pass1"):
        assert k in m, k
        torch.testing.assert_close(torch.tensor(m[k]), torch.tensor(ref_m[k]), **TOL, msg=k)
    got_g, got_w = _snap("policy", stage)
    if last:
        g, w = _snap("draft", d)
        got_g.update(g), got_w.update(w)
    assert len(got_g) == len(got_w) == len(list(stage.parameters())) + (len(list(d.parameters())) if last else 0)
    for k in got_w:
        torch.testing.assert_close(got_g[k], ref_g[k], **TOL, msg=f"stage {s}: gradient of {k}")
        torch.testing.assert_close(got_w[k], ref_w[k], **TOL, msg=f"stage {s}: {k} after the step")
    # without the draft: the same schedule traffic, the same policy gradients (bit for bit)
    m0, stage0, _, log0 = run(False)
    assert log0 == log, f"stage {s}: the schedule's send/recv sequence changed with the tap channel"
    assert log and all(op in ("send_fwd", "recv_fwd", "send_bwd", "recv_bwd") for op, *_ in log)
    g0, _ = _snap("policy", stage0)
    for k in g0:
        torch.testing.assert_close(g0[k], got_g[k], atol=0, rtol=0, msg=f"the draft changed the policy's {k}")


@pytest.mark.slow
@pytest.mark.parametrize("pp", [2, 4])
def test_pp_equals_unsplit(pp):
    spawn_local(_worker, pp, pp, 1, pp)


@pytest.mark.slow
def test_pp2_dp2_equals_unsplit():
    spawn_local(_worker, 4, 2, 2, 2)


def _cp_worker(rank, world):
    """pp = 2 × cp = 2: the packed, zigzag-sharded batch of tests/test_cp_cotrain.py; each stage runs the
    ring attention on its own CP group, the draft on the last stage reads its CP shard's taps."""
    import test_cp_cotrain as T
    from specco.parallel.cp import shard_batch
    from specco.parallel.layout import ZigzagPack
    from specco.parallel.zigzag import ZigzagLayout
    mesh = Mesh.build(cp=2, pp=2, backend="gloo")
    s, last = mesh.pp_rank, mesh.pp_rank == 1
    batch = T._data()
    m_ref, g_ref, p_ref = T._step(*T._models(), batch)
    packed, cu = T._pack(batch)
    lay = ZigzagLayout(cu, 2, mesh.cp_rank)
    local = shard_batch(packed, lay)
    policy, draft = T._models()
    stage = split_stage(policy, 2, s)
    d = draft if last else None
    opt = build_optimizer(stage, d, 1e-3, 1e-2)
    spec = TapSpec.for_stages(stage_layer_ranges(4, 2), draft.cfg.aux_layer_ids, 32, torch.float64, lay.num_local)
    ch = TapChannel(spec, mesh.tap_group, slots=2, timeout_s=60)
    cfg = StepConfig(ttt_passes=3, loss_chunk=5, policy_grad_clip=1.0, draft_grad_clip=1.0, draft_row_stride=1)
    m = cotrain_step(stage, d, local, opt, None, cfg, pipe=PipeComm(mesh.pp_group), taps=ch,
                        tap_layers=draft.cfg.aux_layer_ids, grad_group=mesh.grad_group,
                        layout=ZigzagPack(mesh.cp_group, lay))
    losses = torch.tensor([m["policy/loss"], m["draft/loss"]], dtype=torch.float64)
    dist.all_reduce(losses, group=mesh.grad_group)
    torch.testing.assert_close(losses, torch.tensor([m_ref["policy/loss"], m_ref["draft/loss"]],
                                                    dtype=torch.float64), **T.TOL)
    for k in ("policy/grad_norm", "draft/grad_norm"):
        torch.testing.assert_close(torch.tensor(m[k]), torch.tensor(m_ref[k]), **T.TOL, msg=k)
    mods = [("policy", stage)] + ([("draft", d)] if last else [])
    names = [f"{tag}.{n}" for tag, mod in mods for n, _ in mod.named_parameters()]
    assert names
    for tag, mod in mods:
        for n, p in mod.named_parameters():
            torch.testing.assert_close(p.grad, g_ref[f"{tag}.{n}"], **T.TOL, msg=f"stage {s} grad {tag}.{n}")
            torch.testing.assert_close(p.detach(), p_ref[f"{tag}.{n}"], **T.TOL, msg=f"stage {s} {tag}.{n}")


@pytest.mark.slow
def test_pp2_cp2_equals_unsplit():
    spawn_local(_cp_worker, 4)
