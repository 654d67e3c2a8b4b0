"""One arm's RL step (docs/DESIGN.md §1): rollout -> rewards -> group advantages -> [log-prob recompute]
-> PPO updates (co-training steps) -> refit policy (+ draft) into the engine.

    st = make_arm(cfg, arm, policy, draft, gen_cfg)        models, engine, optimizer, sampler
    m = rl_step(st, cfg, data, tokenizer, device, mesh, hooks=...)   one step -> its metrics

The step measures nothing but itself. A comparison's measurements (the plain baseline, the frozen shadow, the
frozen arm's draft metrics: runner/measure.py) attach as `StepHooks`, called at four fixed points; a job has none.
The step leaves the seconds its hooks take out of `time/other`: what the step logs is its own cost.

Arms (same seed, same data stream), by mode:
  none       plain decoding, policy-only training
  frozen     the warm-started draft speculates; it is never trained or refit
  cotrained  the draft is trained with the policy (lambda * L_draft) and refit every step
An arm is named `<mode>` (the draft is of draft.kind) or `<mode>-<kind>` (`cotrained-dflash`); the name is
its directory, checkpoint tag and log label, the mode decides what it does (derive.arm_config).
Speculative sampling is lossless, so all arms' rollouts have the same distribution; only
speed (tau, tokens/s) may differ. This module plugs `rollout` and `train` together; neither
imports the other.

PPO (train.ppo_epochs x train.minibatches optimizer steps per rollout batch, as verl and NeMo-RL do):
with one update the step is on-policy (ratio exactly 1, no recompute); with more, the sampling
policy's log-probs are recomputed once before the first update (the trainer's numerics, not the
engine's: the gap is logged) and ratio / clip fraction are logged as means over the updates. The LR
schedule counts RL steps. train.kl_coef > 0 keeps the arm's starting policy frozen as the reference.

Parallelism (`mesh` under torchrun, parallel.dp x parallel.cp = WORLD_SIZE): every rank holds the same
weights. A step's prompts_per_step prompts are split into dp contiguous slices (whole GRPO groups, so
advantages stay local); the CP group of each slice generates it once (its cp rank 0, with the DP rank's
own sampler) and shares the rollouts over the CP group; with cp > 1 each minibatch is packed into one
THD row and zigzag-sharded over the CP group. The co-training step normalises by global counts and
sums gradients over all dp x cp ranks, so the update is the one of the whole batch (tests/test_dp.py,
tests/test_rl_cp.py). With parallel.pp > 1 (rl_pp.py) each rank trains its pipeline stage (the draft on
the last) and holds a whole copy of the policy in its rollout engine, refit from the gathered stages.
With parallel.dp_shard (FSDP, parallel/fsdp.py) the trainer's policy and its AdamW state are DTensor shards
over mesh.fsdp_mesh, the stage's dp_shard x cp ranks (the draft stays whole on every rank), cut straight from
the starting policy without a whole copy in between (parallel/load.sharded_copy); the KL reference is sharded
the same way (forward-only), the engine keeps a whole copy; the refit gathers the shards in bounded buckets
(runner/refit.py), so every rank's engine holds the same whole policy. The step is the same function: only its
gradient strategy differs (grad_sync.grad_syncs). Under PP the recipe is torchtitan's: cut the stage, then
activation checkpointing, then FSDP over the stage's ranks without resharding after forward; the refit gathers
each stage's shards, then the stages (rl_pp.gather_for_refit). bf16 (train.amp) works in every layout: autocast
over fp32 masters, under FSDP its bf16 gathers and compute (the stages then exchange bf16 activations:
PipelineArm.act_dtype). rollout.offload frees the engine's memory from after the rollout to the refit
(release_engine).
Metrics: losses summed over all ranks (each holds its share), tokens/s summed and the engine-vs-trainer
log-prob gap maxed over DP ranks, everything else the mean over DP ranks.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..config import RunConfig
from ..faults import point
from ..model.dflash import BlockDraft
from ..model.draft import Eagle3Draft
from ..model.policy import Policy
from ..parallel.fsdp import apply_fsdp, mixed_precision
from ..parallel.load import sharded_copy
from ..parallel.mesh import Mesh
from ..rollout.engine import RolloutEngine
from .refit import MB, refit_engine
from .refit_guard import MIN_TRIES, check_acceptance
from ..train.activation_checkpointing import apply_activation_checkpointing
from ..train.compile import apply_compile, apply_draft_compile, warm_shapes, warm_up, warm_up_draft
from ..train.cotrain import StepConfig, build_optimizer, build_scheduler, cotrain_step, draft_stride
from ..train.grad_sync import grad_syncs
from ..train.nonfinite import NonFiniteError, check_finite
from .derive import arm_config, engine_dtype, step_config, train_shapes
from .rl_pp import PipelineArm, gather_for_refit, pp_train_updates
from .report import TIME_PARTS
from .rollouts import Minibatch, Rollouts, collect_rollouts, engine_logprob_gap, minibatches

__all__ = ["ArmState", "make_arm", "StepHooks", "Attached", "rl_step", "rl_step_config", "train_on_rollouts",
           "run_updates", "grad_group", "settled", "distributed", "full_state", "state_copy", "release_engine"]


@dataclass
class ArmState:
    arm: str  # the arm's name (`cotrained-dflash`): directory, checkpoint tag, log label
    mode: str  # what it does: none, frozen or cotrained (config.split_arm)
    policy: Policy  # training copy
    draft: Eagle3Draft | BlockDraft | None  # training copy (cotrained) or the frozen draft
    engine: RolloutEngine  # its own copies of the weights, refit after each step
    opt: torch.optim.Optimizer
    sched: object
    gen: torch.Generator
    ref: Policy | None = None  # frozen reference policy (train.kl_coef > 0): the arm's starting policy
    pipeline: PipelineArm | None = None  # parallel.pp > 1: the stage's schedule and tap channel (rl_pp.py)
    step: int = 0
    data_offset: int = 0
    accept_history: list = field(default_factory=list)  # first-position acceptance per step (refit guard)


def make_arm(cfg: RunConfig, arm: str, policy: Policy, draft: Eagle3Draft | BlockDraft | None, gen_cfg,
             rank: int = 0, mesh: Mesh | None = None) -> ArmState:
    """An arm's models, engine, optimizer and sampler; `rank` is the data-parallel rank (its own sampler).
    `draft`: the warm draft of the arm's kind. With mesh.pp > 1 the training copy is this rank's pipeline
    stage (the engine keeps the whole policy). Under FSDP (without PP) a rank's peak host memory here is
    `policy` + the engine's whole copy + the trainer's and reference's shards (bench/shard_arm.py)."""
    _, mode = arm_config(cfg, arm)  # a ConfigError naming the choices for an unknown arm
    amp = step_config(cfg, mode).amp_dtype
    # FSDP: bf16 autocast becomes FSDP's bf16 gather and compute (fp32 masters and reductions), for the trainer
    # and the reference alike, so the reference's log-probs are computed as the trainer's are
    sharded = cfg.parallel.fsdp and distributed(mesh)
    mp = mixed_precision(amp) if sharded and amp == torch.bfloat16 else None
    ref = None
    if cfg.train.kl_coef > 0:  # forward-only; under FSDP its shards, gathered unit by unit in its forwards (on
        # every rank: the log-prob recompute runs the same micro-batches everywhere) and freed after each
        freeze = lambda m: m.requires_grad_(False)  # noqa: E731  (before fully_shard: frozen shards, no grads)
        ref = (sharded_copy(policy, mesh.fsdp_mesh, mp_policy=mp, forward_only=True, prepare=freeze) if sharded
               else freeze(copy.deepcopy(policy))).eval()
    draft = copy.deepcopy(draft) if (draft is not None and mode != "none") else None
    eng_policy, eng_draft = copy.deepcopy(policy).eval(), copy.deepcopy(draft) if draft is not None else None
    if sharded and mesh.pp == 1:  # the trainer's shards cut straight from `policy`: no whole copy in between
        # (parallel/load.sharded_copy). torchtitan's order: AC wraps the meta layers before FSDP; compile under
        # FSDP is refused (derive.check_parallel). Under PP the stage is cut from a whole copy below
        ac = apply_activation_checkpointing if cfg.train.activation_checkpointing else None
        policy = sharded_copy(policy, mesh.fsdp_mesh, mp_policy=mp, prepare=ac).train()
    else:
        policy = copy.deepcopy(policy).train()
    if (dt := engine_dtype(cfg)) is not None:  # rollout.dtype: refit casts into these (engine.py)
        eng_policy, eng_draft = eng_policy.to(dt), eng_draft.to(dt) if eng_draft is not None else None
    engine = RolloutEngine(eng_policy, eng_draft, gen_cfg,
                           cache_runners=cfg.rollout.cache_runners, cache_gib=cfg.rollout.cache_gib)
    pipeline = None
    if mesh is not None and mesh.pp > 1:
        pipeline = PipelineArm.build(mesh, policy, draft if mode == "cotrained" else None)
        policy = pipeline.stage
        if mode == "cotrained" and not pipeline.last:
            draft = None  # the co-trained draft lives on the last stage; the engine has its own copy
    cut = sharded and pipeline is None  # the trainer's copy is already sharded (and checkpointed) above
    if cfg.train.activation_checkpointing and not cut:  # the trainer's copy only: the engine's runs no backward
        apply_activation_checkpointing(policy)
    if cfg.train.compile != "none":  # the trainer's copy only (train/compile.py); compiled here, not in step 1
        secs = warm_up(apply_compile(policy, cfg.train.compile), amp)
        if secs > 1.0:
            print(f"specco: arm {arm}: the trainer's layers compiled ({cfg.train.compile}) in {secs:.0f} s", flush=True)
    if cfg.train.compile_draft and mode == "cotrained" and draft is not None:  # the trainer's draft (and the
        # frozen shadow, measure.FrozenShadow, which copies it)
        secs = warm_up_draft(apply_draft_compile(draft, cfg.train.compile), amp, cfg.draft.ttt_passes)
        if secs > 1.0:
            print(f"specco: arm {arm}: the draft's layer compiled ({cfg.train.compile}) in {secs:.0f} s", flush=True)
    if cfg.train.warm_widths:  # the trainer's copy; the plans are the process's, so a later arm finds them made
        # (already sharded under FSDP without PP: then a collective at the same shapes on every rank)
        shapes = train_shapes(cfg, gen_cfg.min_prompt_len)
        secs = warm_shapes(policy, amp, shapes)
        print(f"specco: arm {arm}: the trainer warmed at {len(shapes)} micro-batch shapes in {secs:.1f} s", flush=True)
    if sharded and pipeline is not None:  # after AC / compile (torchtitan's order), before the optimizer:
        # AdamW must hold the DTensor shards. The draft stays replicated (parallel/fsdp.py says why); the engine's
        # copy is whole (above). The unit is this rank's stage, cut above: 1F1B interleaves micro-batches'
        # forwards and backwards, so a layer's weights stay gathered from its forward to its backward
        # (torchtitan's choice under PP)
        apply_fsdp(policy, mesh.fsdp_mesh, mp, reshard_after_forward=False)
        if amp == torch.bfloat16:  # bf16 weights: the residual stream, hence the
            pipeline.act_dtype = amp  # activations and taps the stages exchange, are bf16 (cotrain_step's act_dtype)
    opt = build_optimizer(policy, draft if mode == "cotrained" else None, cfg.train.lr, cfg.train.draft_lr)
    sched = build_scheduler(opt, cfg.train.steps, cfg.train.warmup_steps, cfg.train.draft_warmup_steps,
                            cfg.train.lr_schedule)
    # On the models' device: the engine draws its uniforms there (CUDA needs a CUDA generator).
    # Each data-parallel rank samples its own stream (rank 0's is the single-process one).
    gen = torch.Generator(device=next(policy.parameters()).device).manual_seed(cfg.train.seed + 1 + 7919 * rank)
    return ArmState(arm, mode, policy, draft, engine, opt, sched, gen, ref, pipeline)


class StepHooks:
    """What the step calls at its fixed points; every method here does nothing, a hook overrides those it needs.

        before_rollout(st)                 the arm's sampler is about to draw this step's rollouts
        after_rollout(st, ro, scfg)        rollouts scored, nothing trained yet; -> metrics
        before_update(st, mbs, scfg)       minibatches built (log-probs recomputed), the updates next
        after_update(st, ro, mbs, scfg)    updates run and checked, before the LR schedule steps; -> metrics

    A hook observes: it may change the arm's state for a while (the plain baseline reruns the updates) but
    leaves its weights, optimizer state, sampler and engine as it found them, bit for bit, so the arm's
    trajectory is the one it has without hooks (tests/test_measure.py). Its metrics join the step's before the
    reduction over ranks, so every rank must return the same keys. `st` is an ArmState, `ro` this rank's
    Rollouts, `mbs` its Minibatches, `scfg` the step's StepConfig."""

    def before_rollout(self, st: ArmState) -> None:
        pass

    def after_rollout(self, st: ArmState, ro: Rollouts, scfg: StepConfig) -> dict:
        return {}

    def before_update(self, st: ArmState, mbs: list[Minibatch], scfg: StepConfig) -> None:
        pass

    def after_update(self, st: ArmState, ro: Rollouts, mbs: list[Minibatch], scfg: StepConfig) -> dict:
        return {}


@dataclass
class Attached:
    """The hooks attached to one step, called in order at each point, and the seconds they took there: the
    step's `time/other` leaves those out (measurement is not part of what an RL step costs)."""
    hooks: tuple[StepHooks, ...] = ()
    seconds: float = 0.0

    def __call__(self, point: str, *args) -> dict:
        if not self.hooks:
            return {}
        t0, m = time.perf_counter(), {}
        for h in self.hooks:
            m.update(getattr(h, point)(*args) or {})
        self.seconds += time.perf_counter() - t0
        return m


def distributed(mesh: Mesh | None) -> bool:
    return mesh is not None and mesh.pp * mesh.dp * mesh.cp > 1


def grad_group(mesh: Mesh | None):
    """The group the step's losses and gradients are summed over (DP x CP), None on one process."""
    return mesh.grad_group if distributed(mesh) else None


# checked after every update: a non-finite one stops the run (or is skipped, train.on_nonfinite)
_CHECKED = ("policy/loss", "draft/loss", "policy/grad_norm", "draft/grad_norm")
_SUM_ALL_KEYS = ("policy/loss", "draft/loss")  # each rank's share of the global mean
_SUM_DP_KEYS = ("tokens_per_s",)
_MAX_KEYS = ("logprob_gap_engine_vs_trainer",)


def settled(device) -> float:
    """The host clock once the device has finished what was queued on it. A phase's seconds end here: CUDA
    runs asynchronously, and the log-prob recompute (whose results stay on the device) could otherwise leave
    queued forwards to be paid inside the train step's timing. (On the H200 it moved nothing measurable: the
    eleventh run's log-prob phase took 0.51 s a step against the tenth's 0.59 without it.)"""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def full_state(module) -> dict:
    """`module.state_dict()` with FSDP's DTensor shards gathered into whole tensors (the refit's and the refit
    guard's view; a plain module's is its own). A collective under FSDP: every rank calls it. Layer by layer, one
    tensor at a time, each whole on every rank: whole-tensor checkpoints and tests. The refit does not hold a whole
    state dict: it streams bounded buckets straight into the engine's buffers (runner/refit.py)."""
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in module.state_dict().items()}


def state_copy(module) -> dict:
    """A detached copy of `module.state_dict()`, loadable back with load_state_dict. Not copy.deepcopy: the
    state dict of an FSDP-sharded policy holds DTensor views of FSDP's own parameter storage, which deepcopy
    cannot copy ("invalid python storage"); a clone of each tensor can (and is what deepcopy does otherwise)."""
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _reduce_metrics(m: dict, mesh: Mesh | None) -> dict:
    """Step metrics over the ranks (module docstring): one all-reduce per kind."""
    if not distributed(mesh):
        return m
    keys = sorted(k for k, v in m.items() if isinstance(v, (int, float)))
    vals = torch.tensor([float(m[k]) for k in keys], dtype=torch.float64, device=mesh.device)
    sum_all, sum_dp, max_dp = vals.clone(), vals.clone(), vals.clone()
    dist.all_reduce(sum_all, group=mesh.grad_group)
    dist.all_reduce(sum_dp, group=mesh.dp_group)
    dist.all_reduce(max_dp, op=dist.ReduceOp.MAX, group=mesh.dp_group)
    for i, k in enumerate(keys):
        m[k] = (sum_all[i].item() if k in _SUM_ALL_KEYS else sum_dp[i].item() if k in _SUM_DP_KEYS else
                max_dp[i].item() if k in _MAX_KEYS else sum_dp[i].item() / mesh.dp)
    return m


def _adaptive_stride(st: ArmState, cfg: RunConfig) -> bool:
    """Whether this arm's draft row stride is chosen per RL step (train.draft_min_tokens, co-trained arms)."""
    return bool(cfg.train.draft_min_tokens) and st.mode == "cotrained"


def rl_step_config(st: ArmState, cfg: RunConfig, ro: Rollouts, mesh: Mesh | None = None) -> StepConfig:
    """The co-training step's config for this RL step of `st`'s arm: under train.draft_min_tokens a co-trained
    arm's draft row stride comes from the rollouts' completion lengths (cotrain.draft_stride), the same on every
    data-parallel rank; otherwise train.draft_row_stride."""
    t = cfg.train
    if not _adaptive_stride(st, cfg):
        return step_config(cfg, st.mode)
    lengths = torch.tensor([len(c) for _, c in ro.pairs], dtype=torch.long)
    dp = mesh.dp_group if mesh is not None and mesh.dp > 1 else None
    n = draft_stride(lengths, ro.group_size, t.draft_row_stride, t.draft_min_tokens, dp,
                     mesh.device if dp is not None else None)
    return step_config(cfg, st.mode, draft_row_stride=n)


def run_updates(st: ArmState, train_draft, mbs: list[Minibatch], scfg: StepConfig, epochs: int, group) -> list[dict]:
    """`epochs` passes of co-training steps over the minibatches (one optimizer step each) on a whole policy;
    `train_draft` None trains the policy alone. Their metrics, update by update."""
    # per optimizer group: FSDP's reduce-scatter for a sharded policy, the all-reduce over `group` otherwise
    sync = grad_syncs(st.policy, group)
    return [cotrain_step(st.policy, train_draft, mb.batch, st.opt, None, scfg, grad_group=group, grad_sync=sync,
                         layout=mb.layout) for _ in range(epochs) for mb in mbs]


def train_on_rollouts(st: ArmState, cfg: RunConfig, ro: Rollouts, pad_id: int, device, mesh: Mesh | None = None,
                      scfg: StepConfig | None = None, hooks: Attached | None = None) -> dict:
    """The PPO updates of one RL step on this rank's rollouts `ro`; returns this rank's metrics (before
    the reduction over ranks). Importable on its own: tests feed it the rollouts a distributed run saw.
    `scfg`: the step's `rl_step_config` when the caller has it (None: made here); `hooks`: called before and
    after the updates (StepHooks)."""
    t = cfg.train
    hooks = hooks if hooks is not None else Attached()
    scfg = scfg or rl_step_config(st, cfg, ro, mesh)
    mbs = minibatches(ro, t.minibatches, scfg, pad_id, device, mesh)
    updates = t.ppo_epochs * t.minibatches
    m: dict = {}
    if _adaptive_stride(st, cfg):
        m["draft/row_stride"] = scfg.draft_row_stride
    t0 = time.perf_counter()
    # the whole policy with the trainer's weights: under PP the engine's copy (refit after every step)
    whole_policy = st.engine.policy if st.pipeline is not None else st.policy
    if updates > 1:  # the policy moves between updates: freeze the sampling policy's log-probs first
        # ... except for the first update's minibatch when it is trained once (ppo_epochs = 1): that update runs
        # on the sampling policy itself, so its own forward gives the old log-probs (logp_old None: ratio 1, the
        # value a recompute gives, tests/test_grpo.py), and recomputing them would be a wasted forward
        for mb in mbs[1:] if t.ppo_epochs == 1 else mbs:
            mb.batch.logp_old = mb.logprobs(whole_policy, scfg)
        if not mbs[0].layout.packed:  # padded rows: compare with the engine's log-probs
            m["logprob_gap_engine_vs_trainer"] = max(engine_logprob_gap(ro, mb) for mb in mbs
                                                     if mb.batch.logp_old is not None)
    if st.ref is not None:
        for mb in mbs:
            mb.batch.logp_ref = mb.logprobs(st.ref, scfg)
    m["time/logprob"] = settled(device) - t0
    train_draft = st.draft if st.mode == "cotrained" else None
    group = grad_group(mesh)
    # on_nonfinite=skip: a copy to go back to (memory: one more copy of the weights, the draft's and the AdamW
    # state). The step's own: a hook that needs the starting state (the plain baseline) keeps its own copy
    snap = (state_copy(st.policy), copy.deepcopy((train_draft and train_draft.state_dict(), st.opt.state_dict()))
            ) if t.on_nonfinite == "skip" else None
    hooks("before_update", st, mbs, scfg)
    t0 = settled(device)  # the copies above are not the train step's
    if st.pipeline is not None:  # this rank's stage; the metrics (hence the checks below) agree on every stage
        hist = pp_train_updates(st, train_draft, mbs, scfg, t.ppo_epochs, group)
    else:
        hist = run_updates(st, train_draft, mbs, scfg, t.ppo_epochs, group)
    try:
        for i, h in enumerate(hist):
            check_finite(f"RL step {st.step + 1} of arm {st.arm} (update {i + 1} of {len(hist)})", h, _CHECKED)
        check_finite(f"RL step {st.step + 1} of arm {st.arm}", modules=(st.policy, train_draft))
        m["nonfinite_skipped"] = 0
    except NonFiniteError as e:
        if t.on_nonfinite != "skip":
            raise
        # every rank sees the same reduced numbers, so every rank skips (the weights stay in sync)
        print(f"specco: skipping the update: {e}", flush=True)
        st.policy.load_state_dict(snap[0])
        if train_draft is not None:
            train_draft.load_state_dict(snap[1][0])
        st.opt.load_state_dict(snap[1][1])
        m["nonfinite_skipped"] = 1
    m["time/train"] = time.perf_counter() - t0
    point("rl_step/updated")  # mid-step: trained, not yet refit nor checkpointed (the elastic restart test's kill)
    for k in hist[0]:  # means over the updates (one update: its own values); seconds add up instead
        m[k] = sum(h[k] for h in hist) / (1 if k.startswith("time/") else len(hist))
    m["ppo/updates"] = updates
    # before the schedule's step: a hook that reruns the updates gets the learning rates they ran at
    m.update(hooks("after_update", st, ro, mbs, scfg))
    st.sched.step()  # the LR schedule counts RL steps, however many updates each has
    return m


def refit_arm(st: ArmState, cfg: RunConfig, mesh: Mesh | None, fingerprint: bool = False) -> tuple[dict, float]:
    """The engine refilled from the trainer's weights, the one home of that (every RL step; arm_checkpoint after a
    resume): under PP the stages gathered over the pipeline group (and the last stage's draft), otherwise the
    policy's state dict (under FSDP DTensor shards, gathered bucket by bucket as they stream: a collective, every
    rank), in rollout.refit_bucket_mb buckets. A released engine (rollout.offload) is restored first. Returns
    (the guard's fingerprints, refit_engine's; the seconds the PP gather took, 0 without PP). A draft that is
    not refit (frozen) is still fingerprinted for the guard's comparison with the engine's."""
    t0 = time.perf_counter()
    frozen_draft = st.draft.state_dict() if st.draft is not None and st.mode != "cotrained" else None
    gather = 0.0
    if st.pipeline is not None:
        policy_sd, draft_sd = gather_for_refit(st, mesh)
        gather = time.perf_counter() - t0
    else:
        policy_sd = st.policy.state_dict()
        draft_sd = st.draft.state_dict() if st.mode == "cotrained" else None
    st.engine.restore()  # rollout.offload: the released storages allocated again, for the refit to fill
    guard = refit_engine(st.engine, policy_sd, draft_sd, cfg.rollout.refit_bucket_mb * MB, fingerprint, frozen_draft)
    return guard, gather


def release_engine(st: ArmState, cfg: RunConfig, device) -> dict:
    """rollout.offload: give the engine's memory to the trainer until the refit (RolloutEngine.release); the
    models the refit fills whole (the policy, a co-trained draft) are dropped, a frozen draft kept on the host.
    Metrics: the GiB freed and the seconds it took (within time/other)."""
    if cfg.rollout.offload == "none":
        return {}
    t0 = time.perf_counter()
    refilled = ("policy", "draft") if st.mode == "cotrained" else ("policy",)
    freed = st.engine.release(weights=cfg.rollout.offload == "weights+cache", refilled=refilled)
    return {"mem/offload_freed_gib": freed / 2 ** 30, "time/offload": settled(device) - t0}


def rl_step(st: ArmState, cfg: RunConfig, data, tokenizer, device, mesh: Mesh | None = None,
            record: list | None = None, hooks: tuple[StepHooks, ...] | list[StepHooks] = ()) -> dict:
    """One GRPO step for one arm; returns its metrics (reduced over ranks). `mesh`: module docstring.
    `record`: a list that receives this rank's Rollouts (tests replay them on one process). `hooks`: the
    measurements attached to the step (StepHooks; measure.hooks_for), none for a job."""
    t_step = time.perf_counter()
    attached = Attached(tuple(hooks))
    cuda = torch.device(device).type == "cuda"
    if cuda:  # memory diagnostics of the step (a train step near the GPU's capacity retries cudaMalloc)
        torch.cuda.reset_peak_memory_stats(device)
        retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
    attached("before_rollout", st)
    ro = collect_rollouts(st.engine, st.gen, cfg, data.train, data.rewards, tokenizer, st.data_offset, mesh)
    if record is not None:
        record.append(ro)
    scfg = rl_step_config(st, cfg, ro, mesh)  # once: under train.draft_min_tokens it all-reduces over DP ranks
    measured = attached("after_rollout", st, ro, scfg)
    offload = release_engine(st, cfg, device)  # after the hooks that decode with the engine (plain baseline)
    m = {**ro.metrics, **measured, **offload,
         **train_on_rollouts(st, cfg, ro, tokenizer.pad_id, device, mesh, scfg, attached)}
    t0 = time.perf_counter()
    guard, gather = refit_arm(st, cfg, mesh, cfg.train.refit_guard)
    if st.pipeline is not None:
        m["time/gather"] = gather
    m["time/refit"] = settled(device) - t0
    if cuda:
        m["mem/peak_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
        m["mem/alloc_retries"] = torch.cuda.memory_stats(device).get("num_alloc_retries", 0) - retries
    st.step += 1
    st.data_offset += cfg.rollout.prompts_per_step
    m = _reduce_metrics(m, mesh)
    if cfg.train.refit_guard:  # runner/refit_guard.py; on reduced metrics, so every rank decides alike
        t0 = time.perf_counter()
        st.engine.check_fingerprints(guard["policy"], guard["draft"], step=st.step)
        proposed = int(m.get("rollout/proposed", 0))
        if st.mode != "none" and proposed:
            check_acceptance(st.accept_history, m["accept/pos1"], proposed, st.step)
            if proposed >= MIN_TRIES:
                st.accept_history.append(m["accept/pos1"])
        m["time/refit_guard"] = time.perf_counter() - t0
    # the rest of the step's wall time: scoring and decoding the completions, building the micro-batches,
    # the finiteness checks, the metric reduction, under PP the gather. It is part of what an RL step costs, so
    # the report's step time counts it; the hooks' time (measurements only: the frozen arm's draft evaluation,
    # the plain baseline's decode and train step and their state copies, the frozen shadow's evaluation) is not
    timed = sum(m.get(k, 0.0) for k, _ in TIME_PARTS if k != "time/other") + attached.seconds
    m["time/other"] = max(0.0, time.perf_counter() - t_step - timed)
    return m
