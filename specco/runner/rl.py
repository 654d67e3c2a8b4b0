"""The GRPO loop with speculative rollouts and online draft co-training (docs/DESIGN.md §1).

Each step:  rollout (speculative with the engine's draft; once per data-parallel group) -> rewards
            -> group advantages -> [log-prob recompute] -> PPO updates (co-training steps)
            -> refit policy (+ draft) into the engine.

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
Metrics: losses summed over all ranks (each holds its share), tokens/s summed and the engine-vs-trainer
log-prob gap maxed over DP ranks, everything else the mean over DP ranks. Rank 0 logs and checkpoints
(with every DP rank's sampler state); on resume rank 0 reads the checkpoint and sends it to the others
through the process group.
"""
from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from ..batch import TrainBatch
from ..config import RunConfig
from ..model.dflash import BlockDraft
from ..model.draft import Eagle3Draft
from ..model.policy import Policy
from ..model.ttt import shift_left
from ..parallel.mesh import Mesh
from ..rollout.engine import RolloutEngine
from .refit_guard import MIN_TRIES, check_acceptance
from ..train.activation_checkpointing import apply_activation_checkpointing
from ..train.compile import apply_compile, apply_draft_compile, warm_shapes, warm_up, warm_up_draft
from ..train.checkpoint import load_latest, remove_stale_temporaries, save_checkpoint, set_rng_state
from ..train.cotrain import (StepConfig, amp_context, block_loss, build_optimizer, build_scheduler, cotrain_step,
                             draft_loss, draft_rows, draft_stride, micro_batches, step_counts)
from ..train.nonfinite import NonFiniteError, check_finite
from ..train.losses import all_reduce_sums, metrics_to_floats
from .derive import arm_config, engine_dtype, generate_config, step_config, train_shapes
from .rl_pp import PipelineArm, gather_for_refit, pp_checkpoint_state, pp_restore, pp_train_updates
from .report import TIME_PARTS, MetricsLog
from .stages import seed_stage
from .rollouts import Rollouts, collect_rollouts, engine_logprob_gap, longest_prompt, minibatches


def draft_eval(policy: Policy, draft: Eagle3Draft | BlockDraft, b: TrainBatch, cfg: StepConfig, count_group=None,
               fns: dict | None = None) -> dict:
    """Draft metrics without training it (frozen arm): TTT loss per pass, top-1, simulated tau for EAGLE-3;
    per-slot acceptance / top-1, probabilistic and greedy tau, confidence error for a block drafter.
    `count_group` (DP x CP): global counts, so the metrics are global and the loss is this
    rank's share of the global mean (summed over ranks like the co-trained arm's). `fns`: the layout's
    step arguments (Minibatch.fns; None: padded rows, of which only the draft's rows are run, in
    cfg.micro_batch_rows micro-batches: a 256-row batch of 2,000-token rows in one forward was 9× its tokens)."""
    return draft_evals(policy, {"draft": draft}, b, cfg, count_group, fns)["draft"]


@torch.no_grad()
def draft_evals(policy: Policy, drafts: dict, b: TrainBatch, cfg: StepConfig, count_group=None,
                fns: dict | None = None) -> dict[str, dict]:
    """`draft_eval` of several drafts of one kind and one set of aux layers ({name: draft}) on one policy forward
    per micro-batch: {name: metrics} (config frozen_shadow scores the co-trained draft and its frozen copy)."""
    fns = fns or {}
    shift_kw = {k: fns[k] for k in ("shift", "attn") if k in fns}
    first = next(iter(drafts.values()))
    block = isinstance(first, BlockDraft)
    parts = [(None, b)]
    if not fns and b.cu_seqlens is None:  # padded rows: only the draft's, in micro-batches like the train step's
        b = b.take(torch.arange(b.tokens.shape[0], device=b.tokens.device)[draft_rows(b, cfg)])
        cfg = dataclasses.replace(cfg, draft_row_stride=1)
        parts = micro_batches(b, cfg.micro_batch_rows, width_multiple=cfg.width_multiple)
    counts = step_counts(b, cfg, fns.get("shift", shift_left), count_group, first if block else None,
                         fns.get("block") if block else None)
    loss, stats = dict.fromkeys(drafts, 0.0), dict.fromkeys(drafts)
    for rows, mb in parts:
        with amp_context(cfg, mb.tokens):
            out = policy(mb.tokens, mb.positions, tap_layers=first.cfg.aux_layer_ids, attn_core=fns.get("attn_core"))
            for name, draft in drafts.items():
                if block:  # per-slot acceptance, probabilistic tau, confidence error (train/block_losses.BlockStats)
                    l_d, s = block_loss(draft, policy, out, mb, cfg, counts.draft, rows, block=fns.get("block"))
                else:
                    l_d, s = draft_loss(draft, out, mb, cfg, counts.draft, rows=rows, **shift_kw)
                loss[name], stats[name] = loss[name] + l_d, s if stats[name] is None else stats[name] + s
    reduced = all_reduce_sums(list(stats.values()), count_group)
    return {name: metrics_to_floats({**st.metrics(), "draft/loss": loss[name]}) for name, st in zip(drafts, reduced)}


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
    shadow: Eagle3Draft | BlockDraft | None = None  # config frozen_shadow: the warm draft, never trained


def make_arm(cfg: RunConfig, arm: str, policy: Policy, draft: Eagle3Draft | BlockDraft | None, gen_cfg,
             rank: int = 0, mesh: Mesh | None = None) -> ArmState:
    """An arm's models, engine, optimizer and sampler; `rank` is the data-parallel rank (its own sampler).
    `draft`: the warm draft of the arm's kind. With mesh.pp > 1 the training copy is this rank's pipeline
    stage (the engine keeps the whole policy)."""
    _, mode = arm_config(cfg, arm)  # a ConfigError naming the choices for an unknown arm
    ref = copy.deepcopy(policy).eval().requires_grad_(False) if cfg.train.kl_coef > 0 else None
    policy = copy.deepcopy(policy).train()
    draft = copy.deepcopy(draft) if (draft is not None and mode != "none") else None
    eng_policy, eng_draft = copy.deepcopy(policy).eval(), copy.deepcopy(draft) if draft is not None else None
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
    if cfg.train.activation_checkpointing:  # the trainer's copy only: the engine's never runs a backward
        apply_activation_checkpointing(policy)
    if cfg.train.compile != "none":  # the trainer's copy only (train/compile.py); compiled here, not in step 1
        secs = warm_up(apply_compile(policy, cfg.train.compile), step_config(cfg, mode).amp_dtype)
        if secs > 1.0:
            print(f"specco: arm {arm}: the trainer's layers compiled ({cfg.train.compile}) in {secs:.0f} s", flush=True)
    if cfg.train.compile_draft and mode == "cotrained" and draft is not None:  # the trainer's draft (and shadow)
        secs = warm_up_draft(apply_draft_compile(draft, cfg.train.compile), step_config(cfg, mode).amp_dtype,
                             cfg.draft.ttt_passes)
        if secs > 1.0:
            print(f"specco: arm {arm}: the draft's layer compiled ({cfg.train.compile}) in {secs:.0f} s", flush=True)
    if cfg.train.warm_widths:  # the trainer's copy; the plans are the process's, so a later arm finds them made
        shapes = train_shapes(cfg, gen_cfg.min_prompt_len)
        secs = warm_shapes(policy, step_config(cfg, mode).amp_dtype, shapes)
        print(f"specco: arm {arm}: the trainer warmed at {len(shapes)} micro-batch shapes in {secs:.1f} s", flush=True)
    opt = build_optimizer(policy, draft if mode == "cotrained" else None, cfg.train.lr, cfg.train.draft_lr)
    sched = build_scheduler(opt, cfg.train.steps, cfg.train.warmup_steps, cfg.train.draft_warmup_steps,
                            cfg.train.lr_schedule)
    # On the models' device: the engine draws its uniforms there (CUDA needs a CUDA generator).
    # Each data-parallel rank samples its own stream (rank 0's is the single-process one).
    gen = torch.Generator(device=next(policy.parameters()).device).manual_seed(cfg.train.seed + 1 + 7919 * rank)
    st = ArmState(arm, mode, policy, draft, engine, opt, sched, gen, ref, pipeline)
    if cfg.measures_shadow(arm):  # the warm draft as it came: a resumed run loads its checkpoint into `draft` only
        st.shadow = copy.deepcopy(draft).eval().requires_grad_(False)
    return st


def _distributed(mesh: Mesh | None) -> bool:
    return mesh is not None and mesh.pp * mesh.dp * mesh.cp > 1


# checked after every update: a non-finite one stops the run (or is skipped, train.on_nonfinite)
_CHECKED = ("policy/loss", "draft/loss", "policy/grad_norm", "draft/grad_norm")
_SUM_ALL_KEYS = ("policy/loss", "draft/loss")  # each rank's share of the global mean
_SUM_DP_KEYS = ("tokens_per_s",)
_MAX_KEYS = ("logprob_gap_engine_vs_trainer",)


def _settled(device) -> float:
    """The host clock once the device has finished what was queued on it. A phase's seconds end here: CUDA
    runs asynchronously, and the log-prob recompute (whose results stay on the device) could otherwise leave
    queued forwards to be paid inside the train step's timing. (On the H200 it moved nothing measurable: the
    eleventh run's log-prob phase took 0.51 s a step against the tenth's 0.59 without it.)"""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _reduce_metrics(m: dict, mesh: Mesh | None) -> dict:
    """Step metrics over the ranks (module docstring): one all-reduce per kind."""
    if not _distributed(mesh):
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


def train_on_rollouts(st: ArmState, cfg: RunConfig, ro: Rollouts, pad_id: int, device, mesh: Mesh | None = None,
                      scfg: StepConfig | None = None) -> dict:
    """The PPO updates of one RL step on this rank's rollouts `ro`; returns this rank's metrics (before
    the reduction over ranks). Importable on its own: tests feed it the rollouts a distributed run saw.
    `scfg`: the step's `rl_step_config` when the caller has it (None: made here)."""
    t = cfg.train
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
        if not mbs[0].fns:  # padded rows: compare with the engine's log-probs
            m["logprob_gap_engine_vs_trainer"] = max(engine_logprob_gap(ro, mb) for mb in mbs
                                                     if mb.batch.logp_old is not None)
    if st.ref is not None:
        for mb in mbs:
            mb.batch.logp_ref = mb.logprobs(st.ref, scfg)
    m["time/logprob"] = _settled(device) - t0
    train_draft = st.draft if st.mode == "cotrained" else None
    group = mesh.grad_group if _distributed(mesh) else None
    # on_nonfinite=skip: a copy to go back to (memory: one more copy of the weights and AdamW state); config
    # plain_baseline: the policy's and optimizer's state the updates start from, for the plain train step. One
    # copy serves both (loading a state dict copies out of it and leaves it as it was)
    plain = train_draft is not None and st.pipeline is None and cfg.measures_plain(st.arm)
    snap = copy.deepcopy((st.policy.state_dict(), train_draft and train_draft.state_dict(), st.opt.state_dict())
                         ) if t.on_nonfinite == "skip" or plain else None
    before = (snap[0], snap[2]) if plain else None
    t0 = _settled(device)  # the copies above are not the train step's
    if st.pipeline is not None:  # this rank's stage; the metrics (hence the checks below) agree on every stage
        hist = pp_train_updates(st, train_draft, mbs, scfg, t.ppo_epochs, group)
    else:
        hist = [cotrain_step(st.policy, train_draft, mb.batch, st.opt, None, scfg, grad_group=group, **mb.fns)
                for _ in range(t.ppo_epochs) for mb in mbs]
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
            train_draft.load_state_dict(snap[1])
        st.opt.load_state_dict(snap[2])
        m["nonfinite_skipped"] = 1
    m["time/train"] = time.perf_counter() - t0
    if before is not None:  # before the schedule's step: the same learning rates as the updates just run
        m["time/train_plain"] = plain_train_seconds(st, before, mbs, scfg, t.ppo_epochs, group)
    st.sched.step()  # the LR schedule counts RL steps, however many updates each has
    for k in hist[0]:  # means over the updates (one update: its own values); seconds add up instead
        m[k] = sum(h[k] for h in hist) / (1 if k.startswith("time/") else len(hist))
    m["ppo/updates"] = updates
    if st.mode == "frozen":  # metrics only, so outside the timed train step (and left out of time/other)
        t0 = time.perf_counter()
        whole = minibatches(ro, 1, scfg, pad_id, device, mesh)[0]
        m.update(draft_eval(whole_policy, st.draft, whole.batch, scfg, group, whole.fns))
        m["time/draft_eval"] = time.perf_counter() - t0
    return m


def plain_train_seconds(st: ArmState, before: tuple, mbs: list, scfg: StepConfig, epochs: int, group) -> float:
    """Config plain_baseline's train step: the step's PPO updates run again without the draft, on the same
    minibatches from the same start (`before`: the policy's and the optimizer's state dicts when the real
    updates began), timed, then undone: the weights and optimizer state the real updates left go back, bit for
    bit (tests/test_plain_baseline.py: the arm trains as without the baseline). Its difference from time/train
    is everything the draft adds to a train step (its forward and backward, which `time/train_draft` times, its
    taps, its optimizer and clipping work) plus what a first pass over the minibatches costs more than a second.

    It runs after the real updates, both clocks starting on a settled device (`_settled`), and reads low: any
    second pass over a minibatch runs faster than the first, with or without the draft (on the H200 0.19-0.24 s
    per 64-row update, bench/cotrain_ragged.py --paired; in the tenth and eleventh runs the rerun took ~1.0 s
    less than the real updates whose draft span was 0.43 s). The report takes train − the draft's span as the
    no-draft train step and this rerun as a low bound (report.baseline_split).
    """
    after = copy.deepcopy((st.policy.state_dict(), st.opt.state_dict()))
    st.policy.load_state_dict(before[0])
    st.opt.load_state_dict(before[1])
    t0 = _settled(next(st.policy.parameters()).device)  # as the real updates' clock starts
    for _ in range(epochs):
        for mb in mbs:  # cotrain_step's metrics read its results back to the host: the updates have finished
            cotrain_step(st.policy, None, mb.batch, st.opt, None, scfg, grad_group=group, **mb.fns)
    seconds = time.perf_counter() - t0
    st.policy.load_state_dict(after[0])
    st.opt.load_state_dict(after[1])
    return seconds


def shadow_eval(st: ArmState, cfg: RunConfig, ro: Rollouts, pad_id: int, device, mesh: Mesh | None = None,
                scfg: StepConfig | None = None) -> dict:
    """Config frozen_shadow: the co-trained draft that decoded this step's rollouts and the arm's frozen copy of
    its warm draft, each scored (`draft_eval`: simulated tau, loss, per-pass or per-slot agreement) on those
    rollouts under the policy that sampled them, before the step's update. The same estimator, rows and teacher
    for both, so their ratio is co-training's gain on this arm's own trajectory. Keys `shadow/cotrained/...`
    and `shadow/frozen/...`; `time/shadow`, which the step's time leaves out."""
    t0 = time.perf_counter()
    scfg = scfg or rl_step_config(st, cfg, ro, mesh)  # the rows the step's draft trains on
    whole = minibatches(ro, 1, scfg, pad_id, device, mesh)[0]
    group = mesh.grad_group if _distributed(mesh) else None
    scores = draft_evals(st.policy, {"cotrained": st.draft, "frozen": st.shadow}, whole.batch, scfg, group, whole.fns)
    m = {f"shadow/{tag}/{k.partition('/')[2]}": v for tag, ms in scores.items() for k, v in ms.items()}
    m["time/shadow"] = time.perf_counter() - t0
    return m


def rl_step(st: ArmState, cfg: RunConfig, data, tokenizer, device, mesh: Mesh | None = None,
            record: list | None = None) -> dict:
    """One GRPO step for one arm; returns its metrics (reduced over ranks). `mesh`: module docstring.
    `record`: a list that receives this rank's Rollouts (tests replay them on one process)."""
    t_step = time.perf_counter()
    cuda = torch.device(device).type == "cuda"
    if cuda:  # memory diagnostics of the step (a train step near the GPU's capacity retries cudaMalloc)
        torch.cuda.reset_peak_memory_stats(device)
        retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
    ro = collect_rollouts(st.engine, st.gen, cfg, data.train, data.rewards, tokenizer, st.data_offset, mesh,
                          baseline=cfg.measures_plain(st.arm))
    if record is not None:
        record.append(ro)
    scfg = rl_step_config(st, cfg, ro, mesh)  # once: under train.draft_min_tokens it all-reduces over DP ranks
    shadow = shadow_eval(st, cfg, ro, tokenizer.pad_id, device, mesh, scfg) if st.shadow is not None else {}
    m = {**ro.metrics, **shadow, **train_on_rollouts(st, cfg, ro, tokenizer.pad_id, device, mesh, scfg)}
    t0 = time.perf_counter()
    if st.pipeline is not None:  # the engine needs the whole policy: gather the stages (and the last's draft)
        policy_sd, draft_sd = gather_for_refit(st, mesh)
        m["time/gather"] = time.perf_counter() - t0
        # the guard compares the engine with the whole policy gathered from every stage's trainer
        guard = (policy_sd, draft_sd if st.mode == "cotrained" else st.draft and st.draft.state_dict())
    else:
        policy_sd, draft_sd = st.policy.state_dict(), st.draft.state_dict() if st.mode == "cotrained" else None
        guard = (st.policy.state_dict(), st.draft.state_dict() if st.draft is not None else None)
    st.engine.refit(policy_sd, draft_sd)
    m["time/refit"] = _settled(device) - t0
    if cuda:
        m["mem/peak_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
        m["mem/alloc_retries"] = torch.cuda.memory_stats(device).get("num_alloc_retries", 0) - retries
    st.step += 1
    st.data_offset += cfg.rollout.prompts_per_step
    m = _reduce_metrics(m, mesh)
    if cfg.train.refit_guard:  # runner/refit_guard.py; on reduced metrics, so every rank decides alike
        t0 = time.perf_counter()
        st.engine.check_weights(*guard, step=st.step)
        proposed = int(m.get("rollout/proposed", 0))
        if st.mode != "none" and proposed:
            check_acceptance(st.accept_history, m["accept/pos1"], proposed, st.step)
            if proposed >= MIN_TRIES:
                st.accept_history.append(m["accept/pos1"])
        m["time/refit_guard"] = time.perf_counter() - t0
    # the rest of the step's wall time: scoring and decoding the completions, building the micro-batches,
    # the finiteness checks, the metric reduction. It is part of what an RL step costs, so the report's step
    # time counts it; the frozen arm's draft evaluation, the plain baseline's decode and train step and the frozen
    # shadow's evaluation (measurements only) are left out
    timed = sum(m.get(k, 0.0) for k, _ in TIME_PARTS if k != "time/other") + sum(
        m.get(k, 0.0) for k in ("time/draft_eval", "time/rollout_plain", "time/train_plain", "time/shadow"))
    m["time/other"] = max(0.0, time.perf_counter() - t_step - timed)
    return m


def _ckpt_state(st: ArmState, mesh: Mesh | None = None) -> dict:
    """What a checkpoint holds; in a distributed run also every DP rank's sampler state (the one its CP
    rank 0 generates with). A collective there: call on every rank."""
    state = {"policy": st.policy.state_dict(), "draft": st.draft.state_dict() if st.draft is not None else None,
             "opt": st.opt.state_dict(), "sched": st.sched.state_dict(), "gen": st.gen,
             "step": st.step, "data_offset": st.data_offset, "arm": st.arm}
    if st.pipeline is not None:
        state.update(pp_checkpoint_state(st, mesh))
    if _distributed(mesh):
        gens = [None] * (mesh.dp * mesh.cp)
        dist.all_gather_object(gens, st.gen.get_state().cpu(), group=mesh.grad_group)
        state["gen_ranks"] = gens[::mesh.cp]  # rank = dp_rank * cp + cp_rank: the cp rank 0 of each DP group
    return state


def _load_latest(root: Path, st: ArmState, mesh: Mesh | None) -> dict | None:
    """The newest checkpoint under `root`, or None. Distributed: rank 0 reads it and sends it to every
    rank through the process group (the other ranks need no access to rank 0's file system)."""
    if not _distributed(mesh):
        found = load_latest(root, generators={"gen": st.gen})
        return found and {**found[1], "path": str(found[0])}
    box = [None]
    if mesh.rank == 0:
        found = load_latest(root, restore_rng=False)
        box = [found and {**found[1], "path": str(found[0])}]
    dist.broadcast_object_list(box, group=dist.group.WORLD, group_src=0)  # every rank, every pipeline stage
    s = box[0]
    if s is not None:
        set_rng_state(s["__rng__"])
        st.gen.set_state(s["gen_ranks"][mesh.dp_rank] if "gen_ranks" in s else s["gen"])
    return s


def _restore(st: ArmState, s: dict, mesh: Mesh | None = None) -> None:
    path = s.get("path", "the checkpoint")
    if s["arm"] != st.arm:
        raise ValueError(f"checkpoint {path} is for arm {s['arm']!r}, not {st.arm!r}")
    dp = mesh.dp if _distributed(mesh) else 1
    if len(s.get("gen_ranks") or [None]) != dp:
        raise ValueError(f"checkpoint {path} was written with parallel.dp={len(s.get('gen_ranks') or [None])}, "
                         f"this run has {dp}: resume with the same parallel.dp")
    if st.pipeline is not None:
        pp_restore(st, s, path)
    else:
        st.policy.load_state_dict(s["policy"])
        if st.draft is not None:
            st.draft.load_state_dict(s["draft"])
        st.opt.load_state_dict(s["opt"])
        st.sched.load_state_dict(s["sched"])
    st.step, st.data_offset = s["step"], s["data_offset"]
    st.engine.refit(s["policy"], s["draft"] if st.mode == "cotrained" else None)


def full_models(st: ArmState) -> tuple[Policy, Eagle3Draft | BlockDraft | None]:
    """The arm's whole policy and draft as of its last refit, for evaluation and saving: the trainer's own
    copies, or under pipeline parallelism (a rank trains one stage) the engine's, which the refit fills from
    every stage in the trainer's dtype (config.py keeps rollout.dtype at the policy's under PP)."""
    if st.pipeline is not None:
        return st.engine.policy, st.engine.draft
    return st.policy, st.draft


def run_arm(cfg: RunConfig, arm: str, policy: Policy, draft: Eagle3Draft | BlockDraft | None, data, tokenizer,
            out_dir, device="cpu", resume: bool = True, progress: bool = True,
            stop_after: int | None = None, mesh: Mesh | None = None, state_out: dict | None = None,
            record: list | None = None, on_step=None) -> list[dict]:
    """Run (or resume) the RL loop of one arm in `out_dir`; returns the per-step metrics.

    `cfg`: the run config or the arm's own (derive.arm_config); `draft`: the warm draft of the arm's kind.
    Checkpoints go to out_dir/ckpt every train.checkpoint_every steps and at the end;
    `stop_after` stops early after that many steps of this call (tests use it to simulate a crash).
    `mesh`: data parallelism; call on every rank (rank 0 writes the log and the checkpoints).
    `state_out`: a dict that receives the arm's final ArmState under "state" (models, optimizer).
    `record`: a list that receives this rank's Rollouts of every step (tests).
    `on_step(st, metrics)`: the caller's hook (pipeline.Outputs: evaluation, saved outputs), called on every
    rank before the first step of a fresh arm (metrics None) and after every step and its checkpoint.
    `data`: the job's data (validate.JobData: training prompts and rewards).
    """
    out_dir = Path(out_dir)
    rank = mesh.rank if mesh is not None else 0
    cfg, _ = arm_config(cfg, arm)  # the arm's view (its draft kind, its k); a no-op on an arm config
    seed_stage(cfg.train.seed, f"rl/{arm}")  # a fresh arm starts from its own RNG state; a resumed one restores it
    gen_cfg = dataclasses.replace(generate_config(cfg, tokenizer.stop_ids, tokenizer.pad_id),
                                  min_prompt_len=longest_prompt(data.train, cfg))  # one runner for every step
    st = make_arm(cfg, arm, policy, draft, gen_cfg, rank=mesh.dp_rank if mesh is not None else 0, mesh=mesh)
    if rank == 0:  # crashed writes' leftovers (the run lock, runner/stages.py, excludes a live writer)
        remove_stale_temporaries(out_dir / "ckpt")
    s = _load_latest(out_dir / "ckpt", st, mesh) if resume else None
    if s is not None:
        _restore(st, s, mesh)
    log = MetricsLog(out_dir, resume_step=st.step) if rank == 0 else None
    rows = []
    done = 0
    bar = tqdm(total=cfg.train.steps, initial=st.step, desc=f"RL [{arm}]", disable=not progress or rank != 0,
               leave=False)
    if on_step is not None and st.step == 0:
        on_step(st, None)
    while st.step < cfg.train.steps and (stop_after is None or done < stop_after):
        m = rl_step(st, cfg, data, tokenizer, device, mesh, record)
        if log is not None:
            log.log(st.step, m)
        rows.append({"step": st.step, **m})
        done += 1
        bar.update(1)
        bar.set_postfix(reward=f"{m['reward']:.2f}", tau=f"{m['tau']:.2f}")
        if st.step % cfg.train.checkpoint_every == 0 or st.step == cfg.train.steps:
            state = _ckpt_state(st, mesh)  # a collective under DP: every rank
            if rank == 0:
                save_checkpoint(out_dir / "ckpt", st.step, state, keep=cfg.train.keep_checkpoints)
            if _distributed(mesh):
                dist.barrier()  # no rank (of any stage) runs ahead of a half-written checkpoint
        if on_step is not None:
            on_step(st, m)
    if on_step is not None and done == 0 and st.step > 0:  # a finished arm run again: outputs it may lack (a
        on_step(st, {})  # crash after its last checkpoint); the hook skips what is already there
    bar.close()
    if log is not None:
        log.close()
    if state_out is not None:
        state_out["state"] = st
    return rows
