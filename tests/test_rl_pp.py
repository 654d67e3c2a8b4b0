"""Pipeline parallelism inside the RL loop, on gloo, against the single-process run (issue 13).

The demo config at a small batch (tests/test_rl_cp.py's models and task), two RL steps of the co-trained
arm, fp64 models. pp = 2: pipeline stage 0 generates with the single process's sampler and shares the
rollouts with stage 1, each stage trains its layers with `cotrain_step` with a real pipe (the draft on stage 1 fed by
the TapChannel), the engines are refit from the gathered stages — so the run equals the single-process
run_arm step by step: the same rollouts (tokens compared exactly, also in step 2, which samples from the
refit engine), losses, grad norms, and every parameter of each stage and of the draft after both steps.
Second: pp = 2 with PPO (2 epochs x 2 minibatches: log-prob recompute on the engine's whole policy) and a
KL penalty, the draft trained in updates 0 and 3 of the 4 (train.draft_update_stride=3: the stages agree on
which updates carry taps), stopped after one step and resumed from its checkpoint (whole policy gathered, per-stage
optimizer states): equal to the uninterrupted single-process run.

Tolerance as in test_rl_cp.py: fp64, rtol 1e-9 (policy/loss and the KL / ratio statistics 1e-6, test_rl_cp.py says
why), parameters rtol 1e-9 / atol 1e-10.
"""
from pathlib import Path

import pytest
import torch

from specco.parallel.mesh import Mesh, spawn_local
from test_rl_cp import _cfg, _close, _models

pytestmark = pytest.mark.dist


def _params(st):
    out = {f"policy.{n}": p.detach() for n, p in st.policy.named_parameters()}
    if st.draft is not None:
        out.update({f"draft.{n}": p.detach() for n, p in st.draft.named_parameters()})
    return out


def _pp_worker(rank, world, tmp, extra, resume):
    from test_grpo import DigitTask
    from specco.runner.rl import run_arm
    tmp = Path(tmp)
    tok, policy, draft = _models()
    cfg = _cfg(tmp, "rollout.prompts_per_step=4", *extra)
    ref_state, ref_rec = {}, []
    ref = run_arm(cfg, "cotrained", policy, draft, DigitTask(), tok, tmp / f"ref{rank}", progress=False,
                  state_out=ref_state, record=ref_rec)
    mesh = Mesh.build(pp=2, backend="gloo")
    cfg_pp = _cfg(tmp, "rollout.prompts_per_step=4", "parallel.pp=2", *extra)
    st, rec = {}, []
    if resume:  # one step, "crash", then resume from the checkpoint (train.checkpoint_every=1)
        rows = run_arm(cfg_pp, "cotrained", policy, draft, DigitTask(), tok, tmp / "pp", progress=False, mesh=mesh,
                       stop_after=1, record=rec)
        rows += run_arm(cfg_pp, "cotrained", policy, draft, DigitTask(), tok, tmp / "pp", progress=False, mesh=mesh,
                        state_out=st, record=rec)
    else:
        rows = run_arm(cfg_pp, "cotrained", policy, draft, DigitTask(), tok, tmp / "pp", progress=False, mesh=mesh,
                       state_out=st, record=rec)
    assert len(rows) == len(ref) == 2
    for a, b in zip(rec, ref_rec):  # the same rollouts on both stages, step 2 from the refit engine
        assert a.pairs == b.pairs
    for r, q in zip(rows, ref):
        for k in ("policy/loss", "policy/ratio_mean", "policy/kl"):
            if k in q:
                _close(r[k], q[k], k, 1e-6)
        for k in ("draft/loss", "policy/grad_norm", "draft/grad_norm", "draft/sim_accept_len", "draft/tokens"):
            _close(r[k], q[k], k)
        assert r["reward"] == q["reward"] and r["tau"] == q["tau"] and r["time/gather"] > 0
    got, want = _params(st["state"]), _params(ref_state["state"])
    assert got and (("draft.fc.weight" in got) == (rank == 1))
    for k, v in got.items():
        torch.testing.assert_close(v, want[k], rtol=1e-9, atol=1e-10, msg=k)


@pytest.mark.slow
def test_rl_loop_pp2_equals_single_process(tmp_path):
    spawn_local(_pp_worker, 2, str(tmp_path), (), False)


@pytest.mark.slow
def test_rl_loop_pp2_ppo_kl_resume_equals_single_process(tmp_path):
    spawn_local(_pp_worker, 2, str(tmp_path), ("train.ppo_epochs=2", "train.minibatches=2", "train.kl_coef=0.1",
                                               "train.checkpoint_every=1", "train.draft_update_stride=3"), True)
