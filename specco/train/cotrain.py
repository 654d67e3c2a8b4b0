"""The co-training step: one backward over L_policy + lambda * L_draft.

    policy forward (records taps; its logits are the detached teacher)
        -> L_policy (GRPO clipped surrogate)  +  lambda * L_draft (K TTT passes, soft CE)
        -> one backward -> per-group all-reduce -> per-group grad-norm clip -> one optimizer step

The draft never changes the policy: taps, embeddings and teacher logits are detached, so the
policy's gradient is the same for any lambda (tested). The two parameter groups have their own
learning rates and schedules; the draft's does not decay with the policy's.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ..model.draft import Eagle3Draft
from ..model.policy import Policy
from ..model.ttt import shift_left, ttt_forward
from ..ops.attention import ttt_attention
from .losses import (clipped_surrogate, draft_loss_parts, draft_metrics, metrics_to_floats, normalize_draft_loss,
                     pass_target_masks, pass_weights, token_logprobs)


@dataclass
class TrainBatch:
    """One micro-batch of sequences (prompt + completion), right-padded.

    tokens (B, S); target_mask (B, S): 1 where token j is trained on (a completion token);
    logp_old (B, S): the rollout's log-prob of token j (ignored where target_mask is 0);
    advantages (B,) per sample, or (B, S) per token (indexed by token j, like logp_old — CP packs);
    positions (B, S) optional global positions (CP passes zigzag positions);
    logp_ref (B, S) optional reference-policy log-probs for the KL term.
    """
    tokens: torch.Tensor
    target_mask: torch.Tensor
    advantages: torch.Tensor | None = None
    logp_old: torch.Tensor | None = None
    logp_ref: torch.Tensor | None = None
    positions: torch.Tensor | None = None


@dataclass
class StepConfig:
    draft_weight: float = 1.0  # lambda
    ttt_passes: int = 3
    pass_decay: float = 0.8
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    temperature: float = 1.0
    policy_grad_clip: float = 1.0
    draft_grad_clip: float = 1.0
    loss_chunk: int = 1024
    # The draft trains on rollout rows 0, n, 2n, ... (1 = every row; at least row 0). GRPO rows are G i.i.d.
    # samples per prompt, so a stride that divides G keeps an unbiased sample of the policy's
    # outputs while cutting the draft's share of the step ~n-fold (DESIGN §6: the overhead goal).
    draft_row_stride: int = 1
    # Rows per forward/backward (0 = the whole batch at once): gradients accumulate over
    # micro-batches with the whole batch's token counts as denominators, so the update is the
    # full-batch one (tested) while activation memory scales with the micro-batch.
    micro_batch_rows: int = 0
    # Mixed precision: forwards and losses under torch.autocast in this dtype (None = off); weights,
    # gradients and optimizer state stay in their own dtype (fp32 master weights). bf16 only: fp16
    # would need loss scaling.
    amp_dtype: torch.dtype | None = None

    def __post_init__(self):
        if self.amp_dtype not in (None, torch.bfloat16):
            raise ValueError(f"amp_dtype={self.amp_dtype}: only torch.bfloat16 (or None) is supported")


AMP_DTYPES = {"none": None, "bf16": torch.bfloat16}  # config train.amp -> StepConfig.amp_dtype


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
                    draft_warmup_steps: int = 0) -> torch.optim.lr_scheduler.LambdaLR:
    """Policy: linear warmup then cosine decay to 10%. Draft: linear warmup then constant, because
    the draft must keep tracking a moving policy to the end of RL (a decayed draft LR stops it)."""
    def policy_fn(step):
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        t = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))

    def draft_fn(step):
        return min(1.0, (step + 1) / draft_warmup_steps) if draft_warmup_steps else 1.0

    fns = [policy_fn if g.get("name") == "policy" else draft_fn for g in opt.param_groups]
    return torch.optim.lr_scheduler.LambdaLR(opt, fns)


def _group_params(opt, name):
    return [p for g in opt.param_groups if g.get("name") == name for p in g["params"]]


def reduce_grads(params, group) -> None:
    """Sum gradients over `group` (DP x CP ranks). Losses are normalised by global counts, so a sum
    (not a mean) gives the global-batch gradient."""
    if group is None:
        return
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)


def draft_denominator(target_mask: torch.Tensor, cfg: StepConfig, shift: Callable = shift_left, group=None):
    """sum_d a_d N_d of L_draft over the rows the draft trains on (rows 0, n, 2n, ...), summed over the
    ranks of `group` (data parallel) when given."""
    masks = pass_target_masks(target_mask[::cfg.draft_row_stride], cfg.ttt_passes, shift)
    n = torch.stack([m.sum() for m in masks]).double()  # (K,) exact integer counts
    if group is not None:
        dist.all_reduce(n, group=group)
    w = torch.tensor(pass_weights(cfg.ttt_passes, cfg.pass_decay), dtype=n.dtype, device=n.device)
    return (w * n).sum().clamp_min(1.0)  # fp64; normalize_draft_loss casts it to the loss dtype


def draft_loss(draft: Eagle3Draft, out, batch: TrainBatch, cfg: StepConfig,
               shift: Callable = shift_left, attn: Callable = ttt_attention, count_group=None,
               row_start: int = 0, denominator: torch.Tensor | None = None, return_stats: bool = False):
    """L_draft and its metrics from a policy output with taps: K TTT passes, soft CE, normalised.

    With cfg.draft_row_stride = n > 1 only rows row_start, row_start + n, ... are used (the policy
    forward that made `out` ran on all rows anyway; only the draft's own work shrinks).
    `denominator`: the whole batch's, when `batch` is one micro-batch of it; `return_stats`: also
    the summed statistics behind the metrics (losses.draft_metrics)."""
    B, S = batch.tokens.shape
    positions = batch.positions
    if positions is None:
        positions = torch.arange(S, device=batch.tokens.device).expand(B, S)
    aux, embed, logits, mask = out.taps.aux, out.taps.embed, out.logits, batch.target_mask
    n = cfg.draft_row_stride
    if n > 1 or row_start:  # rows[::n] keeps at least row 0 (a CP rank's one packed row: all of it)
        aux, embed, logits, mask, positions = (t[row_start::n] for t in (aux, embed, logits, mask, positions))
    outs = ttt_forward(draft, aux, embed, positions, cfg.ttt_passes, shift=shift, attn=attn)
    parts = draft_loss_parts(draft, outs, logits, mask, cfg.loss_chunk, shift)
    return normalize_draft_loss(parts, pass_weights(cfg.ttt_passes, cfg.pass_decay), count_group,
                                denominator, return_stats)


def policy_loss(logits, batch: TrainBatch, cfg: StepConfig, shift: Callable = shift_left,
                num_tokens=None):
    """The GRPO clipped surrogate of `batch` from the policy's logits, divided by `num_tokens`
    (default: the batch's own trained-token count).

    Logits at i predict token i+1. The next-token alignment goes through `shift` (not
    logits[:, :-1] vs tokens[:, 1:]) so that under CP, where i+1 may live on another rank, the
    CP-aware shift fetches it; per-token fields (logp_old, logp_ref, mask, per-token advantages)
    are indexed by token like `tokens`, so they shift with it. With shift_left this is the same
    math: the last position's target is masked out by shift(mask, 1)."""
    logp_new = token_logprobs(logits, shift(batch.tokens, 1), cfg.temperature)
    mask = shift(batch.target_mask, 1)
    ref = shift(batch.logp_ref, 1) if batch.logp_ref is not None else None
    adv = batch.advantages if batch.advantages.dim() == 1 else shift(batch.advantages, 1)
    return clipped_surrogate(logp_new, shift(batch.logp_old, 1), adv, mask, cfg.clip_eps, ref,
                             cfg.kl_coef, num_tokens)


def _clip_and_step(opt, sched, cfg: StepConfig, train_policy: bool, metrics: dict, grad_group=None) -> dict:
    """Per-group gradient all-reduce and clip, the optimizer and scheduler step, LRs into
    `metrics`; returns the metrics as floats (the step's only host sync, after the update)."""
    for name, clip in (("policy", cfg.policy_grad_clip), ("draft", cfg.draft_grad_clip)):
        params = _group_params(opt, name)
        if not params or (name == "policy" and not train_policy):
            continue
        reduce_grads(params, grad_group)
        metrics[f"{name}/grad_norm"] = torch.nn.utils.clip_grad_norm_(params, clip)
    if not train_policy:
        for p in _group_params(opt, "policy"):
            p.grad = None
    opt.step()
    if sched is not None:
        sched.step()
    for g in opt.param_groups:
        metrics[f"{g.get('name', 'group')}/lr"] = g["lr"]
    return metrics_to_floats(metrics)


def cotrain_step(policy: Policy, draft: Eagle3Draft | None, batch: TrainBatch,
                 opt: torch.optim.Optimizer, sched, cfg: StepConfig, *,
                 train_policy: bool = True, grad_group=None,
                 shift: Callable = shift_left, attn: Callable = ttt_attention,
                 policy_token_count: float | None = None) -> dict:
    """One optimizer step; returns metrics. `train_policy=False` is the offline warm start: the
    policy is frozen (forward under no_grad) and only the draft learns.

    `grad_group` (DP x CP ranks) sums gradients and counts; `shift`/`attn` are the CP-aware TTT
    shift and trunk+branch attention (single-device defaults). `policy_token_count`: the global
    number of trained completion tokens (defaults to the local count).
    """
    if 0 < cfg.micro_batch_rows < batch.tokens.shape[0]:
        return _microbatched_step(policy, draft, batch, opt, sched, cfg, train_policy, shift, attn,
                                  policy_token_count, grad_group)
    use_draft = draft is not None and (cfg.draft_weight > 0 or not train_policy)
    total, l_pol, mp, l_d, stats = _forward_losses(policy, draft, batch, cfg, train_policy, use_draft, shift,
                                                   attn, policy_token_count, count_group=grad_group)
    metrics: dict = {**mp, **(draft_metrics(stats) if stats is not None else {})}
    if l_pol is not None:
        metrics["policy/loss"] = l_pol.detach()
    if l_d is not None:
        metrics["draft/loss"] = l_d.detach()
    opt.zero_grad(set_to_none=True)
    if total.requires_grad:
        total.backward()
    return _clip_and_step(opt, sched, cfg, train_policy, metrics, grad_group)


def _forward_losses(policy, draft, batch: TrainBatch, cfg: StepConfig, train_policy: bool, use_draft: bool,
                    shift, attn, policy_token_count, count_group=None, row_start: int = 0, denominator=None):
    """One (micro-)batch's forward and weighted loss, under the step's precision. Returns (total,
    L_policy or None, its metrics, L_draft or None, the draft's summed statistics or None: its
    metrics are `losses.draft_metrics` of them, after adding them up over micro-batches if any)."""
    tap_ids = draft.cfg.aux_layer_ids if draft is not None else None
    l_pol = l_d = stats = None
    mp: dict = {}
    with amp_context(cfg, batch.tokens):
        with torch.set_grad_enabled(train_policy):
            out = policy(batch.tokens, batch.positions, tap_layers=tap_ids)
        total = out.logits.new_zeros((), dtype=torch.float32)
        if train_policy:
            l_pol, mp = policy_loss(out.logits, batch, cfg, shift, policy_token_count)
            total = total + l_pol
        if use_draft:
            l_d, _, stats = draft_loss(draft, out, batch, cfg, shift, attn, count_group, row_start, denominator,
                                       return_stats=True)
            total = total + (cfg.draft_weight if train_policy else 1.0) * l_d
    return total, l_pol, mp, l_d, stats


def _rows(batch: TrainBatch, a: int, b: int) -> TrainBatch:
    """Rows a..b-1 of every per-row field."""
    take = lambda t: None if t is None else t[a:b]  # noqa: E731
    return TrainBatch(tokens=batch.tokens[a:b], target_mask=batch.target_mask[a:b],
                      advantages=take(batch.advantages), logp_old=take(batch.logp_old),
                      logp_ref=take(batch.logp_ref), positions=take(batch.positions))


def _microbatched_step(policy, draft, batch, opt, sched, cfg: StepConfig, train_policy, shift, attn,
                       policy_token_count, grad_group=None) -> dict:
    """cotrain_step over micro-batches of cfg.micro_batch_rows rows: one forward + backward each,
    the losses divided by the whole batch's counts, then one clip + optimizer step. Loss metrics
    are exact sums; per-token metrics (CE per pass, top-1, clip fraction, simulated tau) are
    means over micro-batches weighted by their trained-token counts, except the draft's, which come
    from its statistics summed over the micro-batches (exact, every pass). With `grad_group` (data
    parallel) the denominators are global: the caller passes the global policy_token_count, the
    draft's is summed here, and the gradients are summed over the group before the clip; the draft's
    metrics are then global too, the policy's describe this rank's rows."""
    B, m, n = batch.tokens.shape[0], cfg.micro_batch_rows, cfg.draft_row_stride
    use_draft = draft is not None and (cfg.draft_weight > 0 or not train_policy)
    pol_count = policy_token_count if policy_token_count is not None else \
        shift(batch.target_mask, 1).float().sum().clamp_min(1.0)
    denom = draft_denominator(batch.target_mask, cfg, shift, grad_group) if use_draft else None
    sums: dict = {}
    weights: dict = {}
    stats = None  # the draft's summed statistics (losses.draft_metrics)

    def add(key, value, weight=None):  # weight None: an exact sum; else a weighted mean
        sums[key] = sums.get(key, 0.0) + (value if weight is None else value * weight)
        if weight is not None:
            weights[key] = weights.get(key, 0.0) + weight

    opt.zero_grad(set_to_none=True)
    for a in range(0, B, m):
        sub = _rows(batch, a, min(B, a + m))
        start = (-a) % n  # the first row of this micro-batch with a global index divisible by n
        total, l_pol, mp, l_d, sub_stats = _forward_losses(policy, draft, sub, cfg, train_policy,
                                                           use_draft and start < sub.tokens.shape[0], shift, attn,
                                                           pol_count, row_start=start, denominator=denom)
        if l_pol is not None:
            add("policy/loss", l_pol.detach())
            add("policy/clip_frac", mp["policy/clip_frac"], shift(sub.target_mask, 1).float().sum())
        if l_d is not None:
            add("draft/loss", l_d.detach())
            stats = sub_stats if stats is None else stats + sub_stats
        if total.requires_grad:
            total.backward()
    metrics = {k: v / torch.as_tensor(weights[k]).clamp_min(1e-12) if k in weights else v
               for k, v in sums.items()}
    if use_draft:
        if stats is None:  # no micro-batch held a draft row (cannot happen: row 0 always trains)
            raise RuntimeError("micro-batched step: the draft trained on no row")
        if grad_group is not None:
            dist.all_reduce(stats, group=grad_group)
        metrics.update(draft_metrics(stats))
    return _clip_and_step(opt, sched, cfg, train_policy, metrics, grad_group)
