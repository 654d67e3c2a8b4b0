"""FSDP composed with context and pipeline parallelism inside the RL loop, on gloo, against one process.

The demo config's models (fp64) at a small batch, two RL steps, replayed as tests/test_rl_fsdp.py does: every
rank records its rollouts, rank 0 replays their union with `train_on_rollouts` on one process, and the per-step
losses, grad norms, PPO statistics and every parameter after both steps must be equal.
"""
from pathlib import Path

import pytest
import torch

from specco.parallel.mesh import Mesh, spawn_local
from test_rl_cp import _cfg, _models
from test_rl_fsdp import EXTRA, _flat, _replay

pytestmark = pytest.mark.dist


def _fsdp_cp_worker(rank, world, tmp, arm):
    from test_grpo import DigitTask
    from torch.distributed.tensor import DTensor
    from specco.runner.rl import run_arm
    from specco.runner.warmstart import new_block_draft
    tmp = Path(tmp)
    tok, policy, draft = _models()
    if arm == "cotrained-dflash":
        torch.manual_seed(1)
        draft = new_block_draft(policy, torch.randint(0, tok.vocab_size, (4, 8)), "dflash", gamma=2).double()
    cfg = _cfg(tmp, "parallel.dp_shard=2", "parallel.cp=2", *EXTRA)
    mesh = Mesh.build(2, 2, dp_shard=2)
    st, rec = {}, []
    rows = run_arm(cfg, arm, policy, draft, DigitTask(), tok, tmp / "a", progress=False, mesh=mesh, state_out=st,
                   record=rec)
    s = st["state"]
    # the FSDP axis is the stage's dp_shard x cp ranks: each rank holds a quarter of every sharded tensor
    p = next(s.policy.parameters())
    assert isinstance(p, DTensor) and p.device_mesh.size() == 4
    _replay(rank, mesh, EXTRA, arm, policy, draft, tok, tmp, rows, rec, _flat(s))


@pytest.mark.parametrize("arm", ["cotrained", "cotrained-dflash"])
def test_rl_loop_dp_shard2_cp2_equals_single_process(tmp_path, arm):
    spawn_local(_fsdp_cp_worker, 4, str(tmp_path), arm)


def _whole(st):
    """Every trained weight of a pipeline arm, whole: its engine's copy, refit after the last step from the
    gathered stages (each stage's shards gathered first), and the draft the last stage trained."""
    return torch.cat([v.detach().flatten() for v in st.engine.policy.state_dict().values()]
                     + [p.detach().flatten() for p in st.engine.draft.parameters()])


def _pp_fsdp_worker(rank, world, tmp, cp):
    """pp 2 x dp_shard 2 (x cp): each stage sharded over its dp_shard x cp ranks; replayed on one process, and a
    run stopped after one step and resumed from its checkpoint (whole tensors: the stages' shards and AdamW moments
    gathered, sharded again on resume) equals the uninterrupted one bit for bit."""
    from test_grpo import DigitTask
    from torch.distributed.tensor import DTensor
    from specco.runner.rl import run_arm
    tmp = Path(tmp)
    tok, policy, draft = _models()
    cfg = _cfg(tmp, "parallel.pp=2", "parallel.dp_shard=2", f"parallel.cp={cp}", *EXTRA)
    mesh = Mesh.build(2, cp, pp=2, dp_shard=2)
    run = lambda d, **kw: run_arm(cfg, "cotrained", policy, draft, DigitTask(), tok, tmp / d,  # noqa: E731
                                  progress=False, mesh=mesh, **kw)
    st, rec = {}, []
    rows = run("a", state_out=st, record=rec)
    s = st["state"]
    p = next(s.policy.parameters())
    assert isinstance(p, DTensor) and p.device_mesh.size() == 2 * cp  # the stage's dp_shard x cp ranks
    assert (s.draft is not None) == (mesh.pp_rank == 1)  # the draft trains, whole, on the last stage
    flat = _whole(s)
    # the engine's whole policy is the trainer's: its stage's part equals the stage's gathered shards
    from specco.runner.trainer import full_state
    eng = s.engine.policy.state_dict()
    for k, v in full_state(s.policy).items():
        assert torch.equal(eng[k], v), k
    part1 = run("b", stop_after=1)
    fin = {}
    part2 = run("b", state_out=fin)
    assert [r["step"] for r in part1 + part2] == [1, 2]
    for a, b in zip(rows, part1 + part2):
        for k in ("reward", "policy/loss", "draft/loss", "tau", "policy/grad_norm", "draft/grad_norm"):
            assert a[k] == b[k], (rank, k, a[k], b[k])
    assert torch.equal(_whole(fin["state"]), flat)
    _replay(rank, mesh, EXTRA, "cotrained", policy, draft, tok, tmp, rows, rec, flat)


def test_rl_loop_pp2_dp_shard2_equals_single_process_and_resumes(tmp_path):
    spawn_local(_pp_fsdp_worker, 4, str(tmp_path), 1)


@pytest.mark.slow  # 8 processes on this machine's cores
def test_rl_loop_pp2_cp2_dp_shard2_equals_single_process_and_resumes(tmp_path):
    spawn_local(_pp_fsdp_worker, 8, str(tmp_path), 2)
