"""The RL loop resumed from its sharded checkpoint at ANOTHER layout (runner/arm_checkpoint.py), on gloo, fp64.

What "continues exactly" means (arm_checkpoint.py's docstring):
* pp 2 -> 1 (dp stays 1): one step at parallel.pp=2, "crash", the second step on ONE process from the sharded
  checkpoint (each stage wrote its layers and AdamW moments; the process reads them all). The continuation is
  the uninterrupted run: the same step-2 rollouts (tokens compared exactly: the same sampler state and, bit for
  bit, the same weights in the engine), and losses, grad norms and every parameter after step 2 equal to the
  uninterrupted single-process run (which test_rl_pp shows equals the uninterrupted pp 2 run).
* dp_shard 2 -> 4 (dp changes): one step at dp_shard 2, the second at dp_shard 4 (FSDP shards of 4, the two new
  DP ranks with fresh samplers, other prompt slices). The continuation equals ONE process replaying the same
  rollouts (the union of the ranks', step by step) from the same start: step 2's losses, grad norms and PPO
  statistics, and every parameter after step 2. With PPO (2 epochs x 2 minibatches) and a KL penalty, so the
  AdamW moments, the LR schedule and the log-prob recompute all ride through the checkpoint.
* (slow lane) HSDP 2x2 -> dp_shard 4 (dp stays 4): equals the uninterrupted HSDP run.

Tolerance as tests/test_rl_cp.py: rtol 1e-9, parameters atol 1e-9: the checkpoint round trip is bit-exact
(safetensors keeps the fp64 bytes), so only summation orders differ (reduce-scatter over 2 or 4 shards, pipeline
stages vs one process). The parameters' bound is AdamW's: a gradient component near zero (an embedding row of a
token the step barely saw) moves by lr·m/(√v + eps), and a summation-order difference δ in it moves the update by up
to lr·δ/eps (eps 1e-8, lr 3e-3: 3e5·δ), so δ ~ 1e-16 of the gradient's scale becomes ~1e-11 per update, 8 updates
here (2 steps x 2 epochs x 2 minibatches). Seen: 1.4e-10 on one embedding element of the dp_shard 2 -> 4 run on
one machine (2026-12-04), every other parameter within 1e-10; 1e-10 passed on another. policy/loss, ratio and KL statistics at 1e-6: fp32 log-probs by
design. The LR schedule's position (last_epoch, last LRs) after step 2 equals the reference's exactly.

Mutation checked: skipping the LR scheduler's state on load (sharded_checkpoint.load) fails the dp_shard 2 -> 4
test at that schedule check (last_epoch 1 instead of 2) and nowhere else: the losses, grad norms and parameters
of step 2 all still matched, because AdamW's param groups carry step 2's LR through the checkpoint, and before
the schedule check was added the test passed with the mutation.
"""
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from specco.parallel.mesh import Mesh, spawn_local
from test_rl_cp import _cfg, _close, _models

pytestmark = pytest.mark.dist

# PPO + KL: the moments, the schedule and the recompute go through the checkpoint; warmups of 2 steps: step 2's
# LRs (policy and draft) are twice step 1's, so a schedule that restarted at the load shows; stride 1: the draft
# trains on every row at any dp (the demo's stride picks rows by their local index)
EXTRA = ("rollout.prompts_per_step=8", "train.checkpoint_every=1", "train.ppo_epochs=2", "train.minibatches=2",
         "train.kl_coef=0.1", "train.draft_row_stride=1", "train.warmup_steps=2", "train.draft_warmup_steps=2")
CLOSE = ("draft/loss", "policy/grad_norm", "draft/grad_norm", "draft/tokens", "policy/clip_frac")
FP32 = ("policy/loss", "policy/ratio_mean", "policy/ratio_dev", "policy/kl")


def _params(st) -> dict:
    """Every trained weight by name, whole (FSDP shards gathered: a collective)."""
    from specco.runner.trainer import full_state
    out = {f"policy.{k}": v.detach().clone() for k, v in full_state(st.policy).items()}
    if st.draft is not None:
        out.update({f"draft.{k}": v.detach().clone() for k, v in st.draft.state_dict().items()})
    return out


def _sched(st) -> dict:
    """Where the LR schedule stands: the step count it computes the next LRs from, and the last LRs it set. Step 2
    alone would not show a schedule that restarted at the load (AdamW's param groups carry step 2's LR through the
    checkpoint); from step 3 on it would."""
    sd = st.sched.state_dict()
    return {"last_epoch": sd["last_epoch"], "_last_lr": sd["_last_lr"]}


def _compare_params(got: dict, want: dict):
    assert got.keys() == want.keys()
    worst = max((got[k].double() - want[k].double()).abs().max().item() for k in want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-9, msg=k)  # AdamW's eps (docstring)
    print(f"parameters: max abs deviation {worst:.1e}", flush=True)


def _compare_rows(got: dict, want: dict, keys=CLOSE, fp32=FP32):
    for k in fp32:
        if k in want:
            _close(got[k], want[k], k, 1e-6)
    for k in keys:
        _close(got[k], want[k], k)


# -- pp 2 -> 1 ---------------------------------------------------------------------------------------

PP_EXTRA = ("rollout.prompts_per_step=4", "train.checkpoint_every=1")


def _pp_worker(rank, world, tmp):
    """One step at parallel.pp=2, then the "crash"; rank 0 keeps its rollouts for the comparison."""
    from test_grpo import DigitTask
    from specco.runner.rl import run_arm
    tmp = Path(tmp)
    tok, policy, draft = _models()
    rec = []
    run_arm(_cfg(tmp, "parallel.pp=2", *PP_EXTRA), "cotrained", policy, draft, DigitTask(), tok, tmp / "run",
            progress=False, mesh=Mesh.build(pp=2, backend="gloo"), stop_after=1, record=rec)
    if rank == 0:
        torch.save(rec, tmp / "pp_rollouts.pt")


def test_pp2_checkpoint_resumes_on_one_process_as_uninterrupted(tmp_path):
    from test_grpo import DigitTask
    from specco.runner.rl import run_arm
    spawn_local(_pp_worker, 2, str(tmp_path))
    shards = sorted((next((tmp_path / "run" / "ckpt").glob("step_*")) / "shards").iterdir())
    assert len(shards) == 2  # each stage wrote its own layers
    tok, policy, draft = _models()
    cfg = _cfg(tmp_path, *PP_EXTRA)  # the resumed run: ONE process, no process group (this test's)
    ref_st, ref_rec, st, rec = {}, [], {}, []
    ref = run_arm(cfg, "cotrained", policy, draft, DigitTask(), tok, tmp_path / "ref", progress=False,
                  state_out=ref_st, record=ref_rec)
    rows = run_arm(cfg, "cotrained", policy, draft, DigitTask(), tok, tmp_path / "run", progress=False,
                   state_out=st, record=rec)
    assert [r["step"] for r in rows] == [2]
    pp_rec = torch.load(tmp_path / "pp_rollouts.pt", weights_only=False)
    assert pp_rec[0].pairs == ref_rec[0].pairs and rec[0].pairs == ref_rec[1].pairs  # same rollouts, step 2 too
    assert rows[0]["reward"] == ref[1]["reward"] and rows[0]["tau"] == ref[1]["tau"]
    _compare_rows(rows[0], ref[1], CLOSE[:-1] + ("draft/sim_accept_len",))
    _compare_params(_params(st["state"]), _params(ref_st["state"]))


# -- dp_shard 2 -> 4 ----------------------------------------------------------------------------------

def _shard_worker(rank, world, tmp, phase):
    """phase 1: one step at dp_shard 2 (then the "crash"); phase 2: resumed at dp_shard 4. Each rank keeps its
    rollouts (test data, torch.save) for the replay; phase 2's rank 0 its rows and the final weights."""
    from test_grpo import DigitTask
    from specco.runner.rl import run_arm
    tmp = Path(tmp)
    tok, policy, draft = _models()
    cfg = _cfg(tmp, f"parallel.dp_shard={world}", *EXTRA)
    st, rec = {}, []
    rows = run_arm(cfg, "cotrained", policy, draft, DigitTask(), tok, tmp / "run", progress=False,
                   mesh=Mesh.build(world, 1, dp_shard=world), stop_after=1 if phase == 1 else None, state_out=st,
                   record=rec)
    assert [r["step"] for r in rows] == [phase]
    params = _params(st["state"])  # collective
    torch.save(rec, tmp / f"rollouts{phase}_{rank}.pt")
    if rank == 0:
        torch.save({"rows": rows, "params": params, "sched": _sched(st["state"])}, tmp / f"result{phase}.pt")


def test_dp_shard2_checkpoint_resumes_at_dp_shard4_as_one_process_replay(tmp_path):
    from test_grpo import DigitTask  # noqa: F401  (the task module, imported like the workers do)
    from specco.runner.derive import generate_config
    from specco.runner.rollouts import Rollouts
    from specco.runner.trainer import make_arm, train_on_rollouts
    spawn_local(_shard_worker, 2, str(tmp_path), 1)
    spawn_local(_shard_worker, 4, str(tmp_path), 2)
    tok, policy, draft = _models()
    cfg = _cfg(tmp_path, *EXTRA)
    ref = make_arm(cfg, "cotrained", policy, draft, generate_config(cfg, tok.eos_id, tok.pad_id))
    for phase, world in ((1, 2), (2, 4)):  # the union of the DP ranks' rollouts, in DP order
        parts = [torch.load(tmp_path / f"rollouts{phase}_{r}.pt", weights_only=False)[0] for r in range(world)]
        ro = Rollouts([p for x in parts for p in x.pairs], parts[0].group_size,
                      torch.cat([x.advantages for x in parts]), [lp for x in parts for lp in x.engine_logprobs])
        q = train_on_rollouts(ref, cfg, ro, tok.pad_id, "cpu")
        got = torch.load(tmp_path / f"result{phase}.pt", weights_only=False)
        _compare_rows(got["rows"][0], q)
        assert q["policy/kl"] > 0 and q["policy/ratio_dev"] > 0
    _compare_params(got["params"], _params(ref))
    assert got["sched"] == _sched(ref) and got["sched"]["last_epoch"] == 2, (got["sched"], _sched(ref))


# -- HSDP 2x2 -> dp_shard 4 ---------------------------------------------------------------------------

def _hsdp_worker(rank, world, tmp):
    from test_grpo import DigitTask
    from specco.runner.rl import run_arm
    tmp = Path(tmp)
    tok, policy, draft = _models()
    hsdp = _cfg(tmp, "parallel.dp_replicate=2", "parallel.dp_shard=2", *EXTRA)
    run = lambda cfg, d, mesh, **kw: run_arm(cfg, "cotrained", policy, draft, DigitTask(), tok, tmp / d,  # noqa
                                             progress=False, mesh=mesh, **kw)
    mesh = Mesh.build(4, 1, dp_shard=2)
    ref_st, st = {}, {}
    ref = run(hsdp, "ref", mesh, state_out=ref_st)
    run(hsdp, "run", mesh, stop_after=1)
    rows = run(_cfg(tmp, "parallel.dp_shard=4", *EXTRA), "run", Mesh.build(4, 1, dp_shard=4), state_out=st)
    assert [r["step"] for r in rows] == [2]
    assert rows[0]["reward"] == ref[1]["reward"] and rows[0]["tau"] == ref[1]["tau"]  # the same rollouts
    _compare_rows(rows[0], ref[1])
    got, want = _params(st["state"]), _params(ref_st["state"])
    if rank == 0:
        _compare_params(got, want)
        assert _sched(st["state"]) == _sched(ref_st["state"]), (_sched(st["state"]), _sched(ref_st["state"]))


@pytest.mark.slow  # 4 processes, three runs
def test_hsdp_2x2_checkpoint_resumes_at_dp_shard4_as_uninterrupted(tmp_path):
    spawn_local(_hsdp_worker, 4, str(tmp_path))
