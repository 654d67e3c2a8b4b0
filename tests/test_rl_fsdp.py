"""FSDP (parallel.dp_shard) inside the RL loop, on gloo, against the single process on the same rollouts.

The demo config's models (fp64) at a small batch, two RL steps of the co-trained EAGLE-3 arm at dp_shard = 2 (the
policy and its AdamW state sharded over 2 ranks, the draft replicated), with PPO (2 epochs x 2 minibatches: the
log-prob recompute runs on the sharded policy) and a KL penalty (the reference sharded like the trainer, its
forwards in the recompute on every rank; trainer.make_arm cuts both from the starting policy, parallel/load.py):

* every rank records its rollouts; rank 0 replays their union with `train_on_rollouts` on one process (the
  single-process step on the same rollouts): per-step losses, grad norms, PPO statistics, and every parameter
  after both steps (the policy's shards gathered) must be equal;
* the refit: each rank's engine holds the gathered whole policy, equal to the trainer's;
* measurement hooks (plain baseline, frozen shadow) leave the sharded trajectory bit for bit;
* resume: one step, then a resume from its checkpoint (whole tensors: policy and AdamW state gathered, then
  sharded again) and a second step, equals the uninterrupted run bit for bit.

The co-trained DFlash arm (its drafter reads the sharded policy's head and embeddings) is replayed the same way,
and (slow lane, 4 processes) HSDP: dp_replicate 2 x dp_shard 2.

Tolerance as tests/test_rl_cp.py: fp64, rtol 1e-9 (parameters atol 1e-10 after two AdamW steps): only summation
orders differ (reduce-scatter vs one process's sums). policy/loss, ratio and KL statistics at 1e-6 relative, as
test_rl_cp.py (a bound from fp32 log-probs; token_logprobs keeps fp64 logits in fp64 now). Seen: grad norms and losses within
2e-16 relative, parameters within 6e-14 absolute (EAGLE-3) and 7e-16 (DFlash).
"""
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from specco.parallel.mesh import Mesh, spawn_local
from test_rl_cp import _cfg, _close, _models, union_rollouts

pytestmark = pytest.mark.dist  # ~9 s on 2 CPU cores: in the default lane

EXTRA = ("rollout.prompts_per_step=8", "train.checkpoint_every=1", "train.ppo_epochs=2", "train.minibatches=2", "train.kl_coef=0.1")


def _flat(st):
    """Every trained weight, whole (the policy's shards gathered: a collective under FSDP)."""
    from specco.runner.trainer import full_state
    return torch.cat([v.detach().flatten() for v in full_state(st.policy).values()]
                     + [p.detach().flatten() for p in st.draft.parameters()])


def _resumes_exactly(run, rows, flat, whole, rank) -> None:
    """A run stopped after its first step and resumed from the checkpoint (`run(name, stop_after=, state_out=)`)
    equals the uninterrupted one (`rows`, weights `flat`) bit for bit; `whole(st)`: the arm's weights, whole."""
    part1 = run("b", stop_after=1)
    fin = {}
    part2 = run("b", state_out=fin)
    assert [r["step"] for r in part1 + part2] == [1, 2]
    for a, b in zip(rows, part1 + part2):
        for k in ("reward", "policy/loss", "draft/loss", "tau", "policy/grad_norm", "draft/grad_norm"):
            assert a[k] == b[k], (rank, k, a[k], b[k])
    assert torch.equal(whole(fin["state"]), flat)


def _bytes(model) -> int:
    """The bytes of this rank's parameters (a DTensor's local shard)."""
    from torch.distributed.tensor import DTensor
    return sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in model.parameters())


def _replay(rank, mesh, cfg_extra, arm, policy, draft, tok, tmp, rows, rec, flat):
    """Rank 0 replays the union of the ranks' rollouts on one process and compares (module docstring)."""
    from specco.runner.derive import generate_config
    from specco.runner.trainer import make_arm, train_on_rollouts
    groups = [None] * mesh.dp
    dist.all_gather_object(groups, rec, group=mesh.dp_group)  # every DP rank's rollouts, in DP order
    if rank != 0:
        return
    cfg1 = _cfg(tmp, *cfg_extra)  # the single process on the same rollouts: the union of the ranks' rows
    ref = make_arm(cfg1, arm, policy, draft, generate_config(cfg1, tok.eos_id, tok.pad_id))
    dev = {}
    for step, r in enumerate(rows):
        ro = union_rollouts([g[step] for g in groups])
        q = train_on_rollouts(ref, cfg1, ro, tok.pad_id, "cpu")
        for k in ("policy/loss", "policy/ratio_mean", "policy/ratio_dev", "policy/kl"):  # fp32 log-probs
            _close(r[k], q[k], k, 1e-6)
        for k in ("draft/loss", "policy/grad_norm", "draft/grad_norm", "draft/tokens", "policy/clip_frac"):
            _close(r[k], q[k], k)
            dev[k] = max(dev.get(k, 0.0), abs(r[k] - q[k]) / max(1.0, abs(q[k])))
        assert r["ppo/updates"] == q["ppo/updates"] == 4 and q["policy/kl"] > 0 and q["policy/ratio_dev"] > 0
    ref_flat = _flat(ref)  # the same layout: state-dict order, the fused projections' parts
    torch.testing.assert_close(flat, ref_flat, rtol=1e-9, atol=1e-10)
    print(f"{arm}: max relative deviations {dev}, parameters {(flat - ref_flat).abs().max().item():.3e}", flush=True)


def _shard2_worker(rank, world, tmp):
    from test_grpo import DigitTask
    from torch.distributed.tensor import DTensor
    from specco.runner.rl import run_arm
    tmp = Path(tmp)
    tok, policy, draft = _models()
    cfg = _cfg(tmp, "parallel.dp_shard=2", *EXTRA)
    assert cfg.parallel.fsdp and cfg.parallel.shard == 2 and cfg.parallel.replicate == 1
    mesh = Mesh.build(2, 1, dp_shard=2)
    run = lambda d, **kw: run_arm(cfg, "cotrained", policy, draft, DigitTask(), tok, tmp / d,  # noqa: E731
                                  progress=False, mesh=mesh, **kw)
    st, rec = {}, []
    rows = run("a", state_out=st, record=rec)
    s = st["state"]
    assert all(isinstance(p, DTensor) for p in s.policy.parameters())  # the trainer holds shards
    assert not any(isinstance(p, DTensor) for p in s.draft.parameters())  # the draft is whole on every rank
    # the KL reference is sharded like the trainer (forward-only, frozen): each rank holds about half its bytes
    assert all(isinstance(p, DTensor) and not p.requires_grad for p in s.ref.parameters())
    for m in (s.ref, s.policy):
        mine, whole = _bytes(m), sum(p.nbytes for p in policy.parameters())
        assert 0.45 * whole <= mine <= 0.55 * whole, (rank, mine, whole)
    flat = _flat(s)
    # the engine's copy (refit from the gathered shards) is the trainer's whole policy, on every rank
    eng = torch.cat([v.flatten() for v in s.engine.policy.state_dict().values()])
    assert torch.equal(eng, flat[:eng.numel()])
    # resume from the step-1 checkpoint: the same run
    _resumes_exactly(run, rows, flat, _flat, rank)
    # the measurements (plain baseline: the updates rerun from copies of the sharded state; frozen shadow) leave
    # the sharded arm's trajectory as it is
    runs = {}
    for name, hooks in (("with", ("plain_baseline=[cotrained]", "frozen_shadow=[cotrained]")), ("without", ())):
        cfg_m = _cfg(tmp, "parallel.dp_shard=2", *EXTRA, "rollout.sampler=coupled", "rollout.spec_control=on",
                     "train.on_nonfinite=skip", *hooks)  # skip: the step keeps a copy of the sharded state
        runs[name] = {}
        runs[name]["rows"] = run_arm(cfg_m, "cotrained", policy, draft, DigitTask(), tok, tmp / name, progress=False,
                                     mesh=mesh, state_out=runs[name])
    assert "time/rollout_plain" in runs["with"]["rows"][0]
    assert [r["policy/loss"] for r in runs["with"]["rows"]] == [r["policy/loss"] for r in runs["without"]["rows"]]
    assert torch.equal(_flat(runs["with"]["state"]), _flat(runs["without"]["state"]))
    _replay(rank, mesh, cfg_extra=EXTRA, arm="cotrained", policy=policy, draft=draft, tok=tok, tmp=tmp, rows=rows,
            rec=rec, flat=flat)


def test_rl_loop_dp_shard2_equals_single_process_and_resumes(tmp_path):
    spawn_local(_shard2_worker, 2, str(tmp_path))


@pytest.mark.parametrize("extra, world, command, match", [
    ((), 2, "cotrain-cp", r"FSDP runs in `specco train` only"),
])
def test_fsdp_layouts_not_wired_are_refused_by_name(tmp_path, extra, world, command, match):
    from specco.model.config import ConfigError
    from specco.runner.derive import check_parallel
    cfg = _cfg(tmp_path, "parallel.dp_shard=2", *extra)
    with pytest.raises(ConfigError, match=match):
        check_parallel(cfg, world, command)


def test_fsdp_on_one_process_is_refused(tmp_path):
    from specco.model.config import ConfigError
    from specco.runner.derive import check_parallel
    with pytest.raises(ConfigError, match="on one process: nothing to shard"):
        check_parallel(_cfg(tmp_path, "parallel.dp_shard=1"), 1, "train")


def _cast_engine_worker(rank, world, tmp):
    """rollout.dtype under FSDP: the engine a cast copy (float32 of the fp64 trainer here, as bf16 of fp32 masters on
    a GPU); the whole policy the run evaluates and saves (rl.full_models, a collective) is gathered from the
    trainer's masters, in their dtype, bit for bit, not the engine's rounded copy."""
    from test_grpo import DigitTask
    from specco.runner.rl import full_models, needs_gather, run_arm
    tmp = Path(tmp)
    tok, policy, draft = _models()
    mesh = Mesh.build(2, 1, dp_shard=2)
    cfg = _cfg(tmp, "parallel.dp_shard=2", *EXTRA, "rollout.dtype=float32")
    st = {}
    rows = run_arm(cfg, "cotrained", policy, draft, DigitTask(), tok, tmp / "cast", progress=False, mesh=mesh,
                   state_out=st)
    s = st["state"]
    assert len(rows) == 2 and all(p.dtype == torch.float32 for p in s.engine.policy.parameters())
    assert needs_gather(s)
    whole, d = full_models(s)  # every rank takes part
    assert d is s.draft and all(p.dtype == torch.float64 for p in whole.parameters())
    flat = _flat(s)
    got = torch.cat([v.detach().flatten() for v in whole.state_dict().values()])
    assert torch.equal(got, flat[:got.numel()])  # the masters, not the engine's float32 copy
    eng = torch.cat([v.flatten() for v in s.engine.policy.state_dict().values()])
    assert torch.equal(eng, flat[:eng.numel()].float())  # the engine: the same weights, cast
    # what the job saves: gathered to rank 0's host only (the other rank takes part, holds nothing)
    host, d0 = full_models(s, keep=rank == 0, device="cpu")
    if rank == 0:
        assert next(host.parameters()).device.type == "cpu" and d0 is s.draft
        got = torch.cat([v.detach().flatten() for v in host.state_dict().values()])
        assert torch.equal(got, flat[:got.numel()])
    else:
        assert (host, d0) == (None, None)


def test_rl_loop_dp_shard2_with_a_cast_engine_saves_the_masters(tmp_path):
    spawn_local(_cast_engine_worker, 2, str(tmp_path))


def _dflash_worker(rank, world, tmp):
    """The co-trained DFlash arm at dp_shard 2 (its drafter reads the sharded policy's head and embeddings), with
    activation checkpointing and the trainer's layers compiled (train.compile=aot_eager: the same ops, so the fp64
    bounds hold) inside FSDP's hooks, against the eager single process."""
    from test_grpo import DigitTask
    from specco.runner.rl import run_arm
    from specco.runner.warmstart import new_block_draft
    tmp = Path(tmp)
    tok, policy, _ = _models()
    torch.manual_seed(1)
    draft = new_block_draft(policy, torch.randint(0, tok.vocab_size, (4, 8)), "dflash", gamma=2).double()
    mesh = Mesh.build(2, 1, dp_shard=2)
    st, rec = {}, []
    cfg = _cfg(tmp, "parallel.dp_shard=2", *EXTRA, "train.compile=aot_eager", "train.activation_checkpointing=true")
    rows = run_arm(cfg, "cotrained-dflash", policy, draft, DigitTask(), tok, tmp / "d", progress=False, mesh=mesh,
                   state_out=st, record=rec)
    from specco.train.activation_checkpointing import _layers, checkpointed
    from specco.train.compile import _CompiledMethod
    assert all(isinstance(checkpointed(layer).inner, _CompiledMethod) for layer in _layers(st["state"].policy))
    _replay(rank, mesh, EXTRA, "cotrained-dflash", policy, draft, tok, tmp, rows, rec, _flat(st["state"]))


def test_rl_loop_dp_shard2_dflash_equals_single_process(tmp_path):
    spawn_local(_dflash_worker, 2, str(tmp_path))


def _hsdp_worker(rank, world, tmp):
    """HSDP: 2 replicas x 2 shards (parallel.dp_replicate=2, dp_shard=2; shards reduce-scattered, then
    all-reduced over the replicas), the EAGLE-3 arm replayed on one process."""
    from test_grpo import DigitTask
    from specco.runner.rl import run_arm
    tmp = Path(tmp)
    tok, policy, draft = _models()
    mesh = Mesh.build(4, 1, dp_shard=2)
    # 4 rows per rank and minibatch: the draft trains on every row (the demo's stride 8 picks rows by local index)
    extra = (*EXTRA, "train.draft_row_stride=1")
    st, rec = {}, []
    rows = run_arm(_cfg(tmp, "parallel.dp_replicate=2", "parallel.dp_shard=2", *extra), "cotrained", policy, draft,
                   DigitTask(), tok, tmp / "h", progress=False, mesh=mesh, state_out=st, record=rec)
    _replay(rank, mesh, extra, "cotrained", policy, draft, tok, tmp, rows, rec, _flat(st["state"]))


@pytest.mark.slow  # 4 processes
def test_rl_loop_hsdp_2x2_equals_single_process(tmp_path):
    spawn_local(_hsdp_worker, 4, str(tmp_path))
