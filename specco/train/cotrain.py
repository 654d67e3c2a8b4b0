"""The co-training step: one optimizer step on L_policy + lambda * L_draft, for every layout and every pp.

    counts = step_counts(batch)                 global denominators, ONE all-reduce, before any forward
    one_f_one_b over this rank's stage (parallel/pipeline.py; the whole batch is one micro-batch when
    train.micro_batch_rows = 0):
        forward(m): the stage's forward (records taps; a source stage posts them on the TapChannel);
                    on the last stage L_policy on the logits (policy_loss), plus a MoE policy's router
                    load-balancing share (train/moe_loss.py), which the schedule backpropagates
        draft_work(m): on the last stage, lambda * L_draft -> its own backward (the kind's loss,
                    train/drafters.py; the logits are its detached teacher)
    optimizer_step: per-group gradient sync (train/grad_sync.py: an all-reduce of the sums, or FSDP's
                    reduce-scatter of them inside the backward), grad-norm clip, one AdamW step

pp = 1 is the same schedule with a no-op pipe (`NoPipe`): the stage is the whole policy, warm-up 0, then
forward and backward per micro-batch, so amp, block drafters, compile and the layouts have one path. Only where
the draft's work sits differs: on a real pipe after m's backward (it overlaps the earlier stages' backwards,
off the critical path), at pp = 1 before the policy loss (nothing to overlap; see `cotrain_step`). Every loss
is divided by the *global* counts, so micro-batches', stages' and ranks' losses and gradients add up to the
whole batch's (tests: micro-batched == whole batch, DP == CP == PP == single process, fp64).

The draft never changes the policy: taps, embeddings and teacher logits are detached, so the
policy's gradient is the same for any lambda (tested), and the two backwards touch disjoint
parameters. The two parameter groups have their own learning rates and schedules; the draft's does
not decay with the policy's.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ..batch import TrainBatch, device_indices, longest_first, round_up
from ..model.dflash import BlockDraft
from ..model.draft import Eagle3Draft
from ..model.policy import Policy, Taps
from ..parallel.layout import PADDED
from ..parallel.pipeline import NoPipe, PipeComm, one_f_one_b
from ..parallel.shared_prompts import shared_micro_batches
from .drafters import EAGLE3, draft_rows, drafter, first_anchor  # noqa: F401 (draft_rows: callers import it here)
from ..parallel.ep import check_same_micro_batches, is_ep
from .grad_sync import AllReduceSync, clip_grad_norm, grad_syncs, reduce_grads  # noqa: F401 (re-exported)
from .step_config import AMP_DTYPES, LR_SCHEDULES, StepConfig  # noqa: F401 (re-exported)
from .losses import (PolicyStats, all_reduce_sums, clipped_surrogate, draft_denominator, metrics_to_floats,
                     token_logprobs)
from .moe_loss import RouterBalance

__all__ = ["StepConfig", "StepCounts", "TrainBatch", "cotrain_step", "step_counts", "policy_loss",
           "optimizer_step", "build_optimizer", "build_scheduler", "amp_context", "AMP_DTYPES"]



def amp_context(cfg: StepConfig, like: torch.Tensor):
    """The forward/loss region of a step: autocast in cfg.amp_dtype on `like`'s device, or nothing."""
    if cfg.amp_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(like.device.type, dtype=cfg.amp_dtype)


def build_optimizer(policy: Policy | None, draft: Eagle3Draft | None, lr: float, draft_lr: float,
                    weight_decay: float = 0.0, betas=(0.9, 0.95)) -> torch.optim.AdamW:
    """One AdamW with named param groups 'policy' and 'draft', each with its own LR."""
    groups = []
    if policy is not None:
        groups.append({"params": [p for p in policy.parameters() if p.requires_grad],
                       "lr": lr, "name": "policy"})
    if draft is not None:
        groups.append({"params": list(draft.parameters()), "lr": draft_lr, "name": "draft"})
    return torch.optim.AdamW(groups, betas=betas, weight_decay=weight_decay)


def build_scheduler(opt: torch.optim.Optimizer, total_steps: int, warmup_steps: int = 0,
                    draft_warmup_steps: int = 0, policy_schedule: str = "cosine") -> torch.optim.lr_scheduler.LambdaLR:
    """Policy: linear warmup, then cosine decay to 10% (`policy_schedule` "cosine") or constant ("constant").
    Draft: linear warmup then constant, because the draft must keep tracking a moving policy to the end of
    RL (a decayed draft LR stops it)."""
    if policy_schedule not in LR_SCHEDULES:
        raise ValueError(f"policy_schedule={policy_schedule!r}: expected one of {LR_SCHEDULES}")

    def policy_fn(step):
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if policy_schedule == "constant":
            return 1.0
        t = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))

    def draft_fn(step):
        return min(1.0, (step + 1) / draft_warmup_steps) if draft_warmup_steps else 1.0

    fns = [policy_fn if g.get("name") == "policy" else draft_fn for g in opt.param_groups]
    return torch.optim.lr_scheduler.LambdaLR(opt, fns)


def default_syncs(grad_group=None) -> dict:
    """Both groups replicated, their gradients summed over `grad_group` (train/grad_sync.py)."""
    return {"policy": AllReduceSync(grad_group), "draft": AllReduceSync(grad_group)}


def _group_params(opt, name):
    return [p for g in opt.param_groups if g.get("name") == name for p in g["params"]]


# -- the global counts -------------------------------------------------------------------------------

@dataclass(frozen=True)
class StepCounts:
    """The denominators of one optimizer step, over every rank that shares the batch (DP x CP).

    policy_tokens: trained next-token targets (L_policy's denominator);
    draft: sum_d a_d N_d over the rows the draft trains on (L_draft's, `losses.draft_denominator`).
    """
    policy_tokens: torch.Tensor
    draft: torch.Tensor


def draft_stride(lengths: torch.Tensor, group_size: int, max_stride: int, min_tokens: int, group=None,
                 device=None) -> int:
    """The draft's row stride for one RL step under train.draft_min_tokens: the largest n <= `max_stride` that
    divides `group_size` and whose rows hold >= `min_tokens` completion tokens, else 1.

    lengths: (N*G,) completion tokens per rollout row, the G samples of a prompt contiguous. With n | G the rows
    `draft_rows` takes from any minibatch of whole prompt groups are sample i of each group with i % n == 0, so
    the count is lengths[:, ::n] of every group, summed here over `group` (the data-parallel ranks, which then
    agree; `device`: where their all-reduce runs). A larger stride is cheaper (the draft's share of the train
    step shrinks ~n-fold), so the largest that still meets the floor wins."""
    strides = [n for n in range(max_stride, 0, -1) if group_size % n == 0]
    per_group = lengths.reshape(-1, group_size)  # (N, G)
    tokens = torch.stack([per_group[:, ::n].sum() for n in strides]).double()  # (len(strides),)
    if group is not None:
        tokens = tokens.to(device)
        dist.all_reduce(tokens, group=group)
    return next((n for n, t in zip(strides, tokens.tolist()) if t >= min_tokens), 1)


def picks_rows(rows, batch: TrainBatch) -> bool:
    """Whether a draft row selection (slice or index tensor) picks any row of `batch`."""
    return len(range(batch.tokens.shape[0])[rows]) > 0 if isinstance(rows, slice) else rows.numel() > 0


def step_counts(batch: TrainBatch, cfg: StepConfig, layout=PADDED, group=None, draft=None) -> StepCounts:
    """Both denominators of the step on the whole `batch`, summed over `group` in one all-reduce.

    CP ranks hold disjoint tokens (zero padding), so each token is counted once; the counts are exact
    integers (fp64). The draft's are its kind's (train/drafters.py: per TTT pass for EAGLE-3, the default when
    `draft` is None; per slot for a block drafter, through `layout.block.plan` under CP / for packed rows)."""
    policy_n = layout.shift(batch.target_mask, 1).sum().reshape(1)
    draft_n, weights = (EAGLE3 if draft is None else drafter(draft)).counts(draft, batch, cfg, layout)
    n = torch.cat([policy_n.double(), draft_n.double()])  # (1 + K,) or (1 + γ,)
    if group is not None:
        dist.all_reduce(n, group=group)
    return StepCounts(n[0].clamp_min(1.0), draft_denominator(n[1:], weights))


# -- the two losses ----------------------------------------------------------------------------------

def policy_loss(logits, batch: TrainBatch, cfg: StepConfig, num_tokens=None, shift: Callable = PADDED.shift
                ) -> tuple[torch.Tensor, PolicyStats]:
    """The GRPO clipped surrogate (+ k3 KL) of `batch` from the policy's logits, divided by `num_tokens`
    (StepCounts.policy_tokens; default: the batch's own trained-token count).

    Logits at i predict token i+1. The next-token alignment goes through `shift` (not
    logits[:, :-1] vs tokens[:, 1:]) so that under CP, where i+1 may live on another rank, the
    CP-aware shift fetches it; per-token fields (mask, per-token advantages) are indexed by token
    like `tokens`, so they shift with it, while log-prob fields are already indexed like the logits
    (batch.py). With shift_left this is the same math: the last position's target is masked out by
    shift(mask, 1). logp_old None = on-policy: the ratio is exp(0) = 1 with the gradient of logp_new."""
    logp_new = token_logprobs(logits, shift(batch.tokens, 1), cfg.temperature)
    logp_old = logp_new.detach() if batch.logp_old is None else batch.logp_old
    adv = batch.advantages if batch.advantages.dim() == 1 else shift(batch.advantages, 1)
    return clipped_surrogate(logp_new, logp_old, adv, shift(batch.target_mask, 1), cfg.clip_eps, batch.logp_ref,
                             cfg.kl_coef, num_tokens)


# -- the optimizer step ------------------------------------------------------------------------------

def optimizer_step(opt, sched, cfg: StepConfig, train_policy: bool = True, grad_group=None,
                   policy_norm_group=None, grad_sync: dict | None = None) -> dict:
    """Per group: its gradient made the global batch's by the group's strategy (`grad_sync`, train/grad_sync.py:
    {"policy": FSDPSync(...), "draft": AllReduceSync(grad_group)} under FSDP; default: both summed by an
    all-reduce over `grad_group`, the ranks holding replicas of the same parameters: DP x CP), the grad-norm clip
    over every shard and, for the policy, over `policy_norm_group` (the ranks holding its other parts: pipeline
    stages; the draft lives whole on one stage); then the optimizer and scheduler step. Returns the grad norms
    and LRs (0-dim tensors / floats)."""
    syncs = grad_sync or default_syncs(grad_group)
    metrics = {}
    for name, clip, norm_group in (("policy", cfg.policy_grad_clip, policy_norm_group),
                                   ("draft", cfg.draft_grad_clip, None)):
        params = _group_params(opt, name)
        if not params or (name == "policy" and not train_policy):
            continue
        syncs[name].reduce(params)
        # a strategy whose parameters are split over ranks in its own way (EPSync) takes the norm itself
        metrics[f"{name}/grad_norm"] = getattr(syncs[name], "clip", clip_grad_norm)(params, clip, norm_group)
    if not train_policy:
        for p in _group_params(opt, "policy"):
            p.grad = None
    opt.step()
    if sched is not None:
        sched.step()
    for g in opt.param_groups:
        metrics[f"{g.get('name', 'group')}/lr"] = g["lr"]
    return metrics


# -- the step ----------------------------------------------------------------------------------------

def micro_batches(batch: TrainBatch, rows: int, draft_stride: int = 1, width_multiple: int = 1):
    """(draft rows, micro-batch) pairs of `rows` rows each (0 or >= B: the whole batch, one pair).

    The draft rows are the micro-batch's rows whose index in `batch` is 0 mod `draft_stride` (draft_rows):
    a slice for the whole batch, an index tensor otherwise. Micro-batches take the rows longest trained row
    first and each is trimmed to its own longest row (TrainBatch.trimmed): GRPO rows are long-tailed (a
    direct answer of 5 tokens beside a worked one of 2,000), so rows of similar length share a micro-batch
    and padding mostly disappears. Exact: every loss is a sum over rows normalised by the step's global
    counts, so the order of rows changes nothing but rounding (tests/test_ttt.py, fp64).

    `width_multiple`: each cut width is rounded up to a multiple of it (at most the batch's width), so a run
    sees few distinct shapes: a kernel that plans per shape (cuDNN attention builds and caches an execution
    plan per (B, S)) then plans a few times instead of once per micro-batch (bench/cotrain_ragged.py).

    Every padded micro-batch, the whole batch too, carries its first trained column (TrainBatch.trained_from, from
    the one host read of the masks): the step's logits and EAGLE-3's anchors start just before it."""
    cuts = micro_batch_plan(batch, rows, width_multiple)
    if cuts is None:
        yield slice(0, None, draft_stride), with_trained_from(batch)
        return
    sels = [[i for i, r in enumerate(idx) if r % draft_stride == 0] for idx, _, _ in cuts]
    on_dev = device_indices([idx for idx, _, _ in cuts] + sels, batch.tokens.device)  # no host sync (batch.py)
    for (_, width, start), rows, sel in zip(cuts, on_dev[:len(cuts)], on_dev[len(cuts):]):
        yield sel, dataclasses.replace(batch.take(rows).trimmed(width), trained_from=start)


def step_micro_batches(batch: TrainBatch, cfg: StepConfig, layout) -> list[tuple]:
    """The step's micro-batches as (draft rows, the draft's padded rows, SharedRows or None): under a layout that
    shares prompts (parallel/layout.SharedPrompts) whole prompt groups, the policy's forward on their packed rows
    (parallel/shared_prompts.py); else `micro_batches`, the policy's forward on the draft's rows."""
    if layout.shares_prompts:
        return [(d, sh.rows, sh) for d, sh in shared_micro_batches(batch, cfg.micro_batch_rows, cfg.draft_row_stride,
                                                                    cfg.width_multiple)]
    return [(d, mb, None) for d, mb in micro_batches(batch, cfg.micro_batch_rows, cfg.draft_row_stride,
                                                     cfg.width_multiple)]


def policy_rows(micro: tuple) -> TrainBatch:
    """What the policy's forward of a `step_micro_batches` entry runs on."""
    return micro[1] if micro[2] is None else micro[2].batch


def micro_batch_cuts(batch: TrainBatch, rows: int, width_multiple: int = 1) -> list[tuple[list[int], int]] | None:
    """The micro-batches of `micro_batches` as (row indices, width), or None when `rows` keeps the batch whole
    (0, or at least its row count): the one home of that partition, so a log-prob recompute
    (runner.rollouts.Minibatch.logprobs) runs the train step's very shapes and gets its very numbers."""
    cuts = micro_batch_plan(batch, rows, width_multiple)
    return None if cuts is None else [(idx, width) for idx, width, _ in cuts]


def with_trained_from(batch: TrainBatch) -> TrainBatch:
    """The whole batch as one micro-batch, knowing its first trained column (one host read; padded rows)."""
    if batch.cu_seqlens is not None or batch.trained_from:
        return batch
    return dataclasses.replace(batch, trained_from=int(batch.trained_spans()[0].min()))


def micro_batch_plan(batch: TrainBatch, rows: int, width_multiple: int) -> list[tuple[list[int], int, int]] | None:
    """`micro_batch_cuts` with each micro-batch's first trained column (TrainBatch.trained_from), from the same
    host read of the masks."""
    B, S = batch.tokens.shape
    if rows <= 0 or rows >= B:
        return None
    first, length = batch.trained_spans()
    return [(idx, min(S, round_up(int(length[idx[0]]), width_multiple)), int(first[idx].min()))
            for idx in longest_first(length, rows)]


class SpanTimer:
    """Seconds spent between `start()` and `stop()` pairs, summed, without a host sync inside the step: on CUDA
    events on the current stream, read once by `seconds()` (after the step has synced anyway); on CPU the host
    clock, since the work there is synchronous."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []  # start, stop, start, stop, ...

    def _mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())

    start = stop = _mark

    def seconds(self) -> float:
        pairs = list(zip(self.marks[::2], self.marks[1::2]))
        if not self.cuda:
            return sum(b - a for a, b in pairs)
        if pairs:
            pairs[-1][1].synchronize()
        return sum(a.elapsed_time(b) for a, b in pairs) / 1e3


@dataclass
class _TeacherOut:
    """What a drafter kind's loss reads of a policy output, rebuilt on the last stage of a real pipe: the taps
    joined from every stage (the TapChannel's and its own) and the detached teacher logits."""
    taps: Taps
    logits: torch.Tensor
    logits_from: int = 0  # PolicyOutput.logits_from


def cotrain_step(policy: Policy, draft: Eagle3Draft | BlockDraft | None, batch: TrainBatch,
                 opt: torch.optim.Optimizer, sched, cfg: StepConfig, *,
                 train_policy: bool = True, grad_group=None, policy_norm_group=None, layout=PADDED,
                 grad_sync: dict | None = None, pipe: PipeComm | NoPipe | None = None, taps=None,
                 tap_layers: tuple[int, ...] | None = None, step: int = 0,
                 act_dtype: torch.dtype | None = None) -> dict:
    """One optimizer step on `batch` (this rank's share of the global batch); returns metrics as floats.

    The step is the 1F1B schedule over this rank's pipeline stage (parallel/pipeline.py: `one_f_one_b`). With no
    `pipe` (pp = 1) `policy` is the whole policy, the pipe a no-op and 1F1B the plain micro-batch loop; under
    parallel.pp > 1 `policy` is this rank's `split_stage` and `pipe` the schedule's PipeComm on the pp group.
    Either way, per micro-batch m on the last stage: the policy forward and L_policy (`forward(m)`), its backward
    (the schedule's), and the drafter kind's loss and own backward (`draft_work(m)`); the optimizer step once.

    `train_policy=False` is the offline warm start: the policy is frozen (forward under no_grad) and
    only the draft learns (pp = 1). `grad_group` (this stage's DP x CP ranks) sums counts, statistics and
    gradients; `layout` is how the batch's tokens lie on this rank (parallel/layout.py: PaddedRows, or ZigzagPack
    for a CP shard or a packed row): its shift, TTT attention, policy attention core and block plan. A packed
    batch (several sequences per row) needs a packed layout: causal SDPA would attend across borders.
    `grad_sync`: each optimizer group's gradient strategy (train/grad_sync.py: `grad_syncs(policy, grad_group)`
    under FSDP; a stage under PP is sharded without reshard after forward, as 1F1B wants, and may not hold
    its reduction to the last micro-batch); None: both all-reduced over `grad_group`. `policy_norm_group`:
    the ranks holding the policy's other parts for the clip norm (default: the pipeline group).

    Under a real pipe: `taps`, the TapChannel carrying the earlier stages' taps to the draft on the last stage
    (docs/DESIGN.md §5); `tap_layers`, the draft's aux layer ids (every stage needs them to know what to tap;
    default: `draft`'s); `step`, the stamp of this step's taps; `act_dtype`, the dtype of the activations the
    stages exchange, i.e. of the residual stream (None: the parameters'; under FSDP's mixed_precision(bf16)
    pass torch.bfloat16: a mismatch is an error naming both, never a garbled receive).

    A mixture-of-experts policy adds `cfg.router_aux_loss_coef` (its PolicyConfig's: config.json's or the run
    config's policy.router_aux_loss_coef) times its router load-balancing loss to L_policy (train/moe_loss.py:
    per micro-batch, weighted by its share of the trained tokens; under a pipe its pieces summed over the stages by
    the schedule: RouterBalance), logged as "policy/aux_loss" (the loss before the coefficient; logged at
    coefficient 0 too, as a balance monitor).

    Metrics: "policy/loss", "policy/aux_loss" and "draft/loss" are this rank's contributions (they sum to the
    global losses over `grad_group`); every other metric is global (from statistics summed over the group). Under a
    real pipe every stage returns the last stage's losses and statistics with the common norms.
    """
    pipe = pipe or NoPipe()
    pp, s = pipe.pp, pipe.stage
    first, last = s == 0, s == pp - 1
    if batch.packed and not layout.packed:
        raise ValueError(f"a packed batch ({len(batch.cu_seqlens) - 1} sequences in a row) needs a packed layout "
                         f"(parallel.layout.ZigzagPack(None, ZigzagLayout(cu_seqlens, 1, 0)) on one device), not "
                         f"{layout!r}: plain causal attention would cross sequence borders")
    if tap_layers is None and draft is not None:
        tap_layers = draft.cfg.aux_layer_ids
    use_draft = tap_layers is not None and (cfg.draft_weight > 0 or not train_policy)
    weight = cfg.draft_weight if train_policy else 1.0
    # an expert-parallel policy's slices are never summed over the plain grad_group (grad_sync.EPSync)
    syncs = grad_sync or (grad_syncs(policy, grad_group) if is_ep(policy) else default_syncs(grad_group))
    aux_coef = policy.cfg.router_aux_loss_coef if (policy.cfg.moe and train_policy) else None
    if pp > 1:
        _check_pipe(draft, tap_layers, use_draft, last, taps, pp, train_policy, syncs)
        if layout.shares_prompts:  # the stages' activations and taps would be the packed rows'
            raise ValueError("train.share_prompts under parallel.pp > 1: not implemented (one stage only)")
    kind = drafter(draft) if use_draft and last else None  # train/drafters.py: the draft's counts and loss
    if kind is not None:
        kind.check_layout(batch, layout)
    # (draft rows, the draft's micro-batch, the policy's: the same one, or its prompt groups packed)
    mbs = step_micro_batches(batch, cfg, layout)
    if is_ep(policy):  # the all-to-alls of every micro-batch are the ep group's collectives
        check_same_micro_batches(policy, len(mbs))
    # the draft's counts on every stage: the all-reduce over grad_group has one shape on every rank
    counts = step_counts(batch, cfg, layout, grad_group, draft if kind is not None else None)
    wire = act_dtype or next(policy.parameters()).dtype  # the receive buffers' dtype, forward and backward
    # a MoE policy's router balance: its pieces summed over the stages by the schedule (train/moe_loss.py)
    balance = RouterBalance(policy.cfg.num_experts, policy.cfg.num_experts_per_tok, aux_coef,
                            counts.policy_tokens) if aux_coef is not None else None
    losses = {"policy/loss": 0.0, "policy/aux_loss": 0.0, "draft/loss": 0.0}  # floats never added to are not logged
    stats: dict = {"policy": None, "draft": None}
    held: dict[int, tuple] = {}  # last stage of a real pipe: m -> (its own taps, teacher logits) until the draft's work
    opt.zero_grad(set_to_none=True)
    draft_time = SpanTimer(batch.tokens.device)  # the draft's forward and backward: its share of the step
    if taps is not None:
        taps.begin(step, len(mbs))

    def add(key, st, loss):
        stats[key] = st if stats[key] is None else stats[key] + st
        losses[f"{key}/loss"] += loss.detach()

    def draft_work(m, out=None):
        """lambda * L_draft of micro-batch m and its own backward: the draft's graph is disjoint from the
        policy's (taps, embeddings and teacher logits are detached), so it may run before or after the policy's."""
        d_rows, mb, shared = mbs[m]
        if out is None:  # a real pipe: the taps of m from the earlier stages, joined with this stage's
            own, logits, cut = held.pop(m)
            # every micro-batch's taps are consumed, in order, even if the row stride gives the draft none here
            parts = taps.wait(m, *mb.tokens.shape[:2]) if taps is not None else []
            out = _TeacherOut(draft.join_taps(parts + [own]), logits, cut)
        if not picks_rows(d_rows, mb):  # the draft's rows are the batch's rows 0 mod draft_row_stride
            return
        if shared is not None:  # the packed rows' taps and logits, back on the padded rows the draft trains on
            out = _TeacherOut(Taps(shared.unpack(out.taps.embed), shared.unpack(out.taps.aux), out.taps.layer_ids),
                              shared.unpack(out.logits, out.logits_from), out.logits_from)
        draft_time.start()
        with amp_context(cfg, mb.tokens):
            l_d, st = kind.loss(draft, policy, out, mb, cfg, counts.draft, d_rows, layout=layout)
        add("draft", st, l_d)
        if l_d.requires_grad:  # the backward outside autocast (as torch advises)
            (weight * l_d).backward()
        draft_time.stop()

    def forward(m, x):
        mb, shared = policy_rows(mbs[m]), mbs[m][2]
        core = layout.attn_core if shared is None else shared.attn_core
        for sync in syncs.values():  # FSDP may hold its reductions (and gathered weights) until the last
            sync.micro_batch(last=m == len(mbs) - 1)
        # The forward and losses under the step's precision; the backwards outside autocast (as torch advises).
        with amp_context(cfg, mb.tokens), torch.set_grad_enabled(train_policy):
            # logits only from the first column a loss reads (a long prompt's predict nothing trained)
            out = policy(mb.tokens if first else None, mb.positions, tap_layers=tap_layers if use_draft else None,
                         hidden_in=x, compute_logits=last, attn_core=core,
                         logits_from=first_anchor(mb, cfg.ttt_passes, layout))
            if balance is not None:
                balance.record(m, out.router_logits, mb.target_mask)
        if not last:
            if out.hidden.dtype != wire:
                raise ValueError(f"stage {s} emits {out.hidden.dtype} activations but the schedule receives {wire}: "
                                 "pass cotrain_step(act_dtype=...) = the stage's compute dtype")
            if use_draft and taps is not None and taps.is_source:
                taps.post(m, out.stage_taps)  # posts and returns: the source never waits for the draft
            return out.hidden
        if kind is not None:
            if pp == 1:
                # nothing to overlap: the draft's work now, before the policy loss's vocabulary-sized fp32 buffers
                # exist and while the weights a block drafter borrows (head, embeddings) are still gathered under
                # FSDP (the policy's backward reshards them)
                draft_work(m, out)
            else:
                # after m's backward (one_f_one_b's after_backward): it overlaps the earlier stages' backwards
                held[m] = (out.stage_taps, out.logits.detach(), out.logits_from)
        if not train_policy:
            return None
        with amp_context(cfg, mb.tokens):
            l_pol, st = policy_loss(out.logits, mb.columns_from(out.logits_from), cfg, counts.policy_tokens,
                                    layout.shift)
        add("policy", st, l_pol)
        return l_pol

    one_f_one_b(pipe, len(mbs), forward, lambda m: (*policy_rows(mbs[m]).tokens.shape[:2], policy.cfg.hidden_size),
                wire, batch.tokens.device, after_backward=draft_work if (pp > 1 and kind is not None) else None,
                sums=balance)
    if balance is not None:
        losses["policy/aux_loss"] = balance.total
    if taps is not None:
        taps.end()
    assert not held, f"last stage: the draft never ran on micro-batches {sorted(held)}"
    metrics = {k: v for k, v in losses.items() if torch.is_tensor(v)}
    if last:  # losses and statistics live where the logits are
        for st in all_reduce_sums([v for v in stats.values() if v is not None], grad_group):
            metrics.update(st.metrics())
    norm_group = policy_norm_group if policy_norm_group is not None else pipe.group
    metrics.update(optimizer_step(opt, sched, cfg, train_policy, grad_group, norm_group, syncs))
    metrics = metrics_to_floats(metrics)
    if kind is not None:
        metrics["time/train_draft"] = draft_time.seconds()
    if pp > 1:  # every stage returns the same metrics: the last stage's (losses, statistics) with the common norms
        box = [metrics]
        dist.broadcast_object_list(box, group=pipe.group, group_src=pp - 1)
        metrics = {**metrics, **box[0]}
    return metrics


def _check_pipe(draft, tap_layers, use_draft: bool, last: bool, taps, pp: int, train_policy: bool, syncs: dict):
    """What the step refuses under parallel.pp > 1, by name."""
    if not train_policy:
        raise ValueError("train_policy=False (the warm start) runs on one stage: pass no pipe")
    if any(getattr(sync, "hold", False) for sync in syncs.values()):
        # 1F1B runs later micro-batches' forwards before earlier ones' backwards: no single "last" backward to hold to
        raise ValueError("grad_syncs(hold_unsharded=True) under parallel.pp > 1: the stage's reduction cannot be "
                         "held to one micro-batch under 1F1B; use hold_unsharded=False")
    if use_draft and last and (draft is None or tuple(tap_layers) != draft.cfg.aux_layer_ids):
        raise ValueError(f"the last stage trains the draft: it needs the draft, whose aux_layer_ids must be "
                         f"tap_layers={tap_layers}")
    if use_draft and last and drafter(draft) is not EAGLE3:
        raise ValueError("a block drafter under parallel.pp > 1: its loss borrows the policy's embedding (first "
                         "stage) and head (last stage); the pipeline co-trains EAGLE-3 drafts only")
    if use_draft:
        if taps is None:
            raise ValueError("a draft under parallel.pp > 1 needs the TapChannel (parallel.taps.TapChannel)")
        if taps.R < pp:  # 1F1B's warmup runs stage 0 pp - 1 forwards ahead (parallel/taps.py: slots and 1F1B)
            raise ValueError(f"TapChannel slots={taps.R} < parallel.pp={pp}: the first stage would wait for "
                             "credits the last stage cannot give yet (deadlock); use slots >= pp + 1")
