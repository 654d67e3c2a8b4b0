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
