"""Losses of the co-training step: the draft's TTT soft cross-entropy and the GRPO policy loss.

One home per formula: `soft_cross_entropy`, `normalize_draft_loss` (L_draft), `grpo_advantages`,
`clipped_surrogate`, and `draft_metrics` for the draft's metrics. Metrics are 0-dim tensors;
`metrics_to_floats` converts them. Process groups are arguments (None = single process).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..model.draft import Eagle3Draft
from ..model.ttt import shift_left


def soft_cross_entropy(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """CE_i = -sum_v softmax(T_i)_v * log_softmax(z_i)_v, in fp32, per position.

    Its gradient w.r.t. z is softmax(z) - softmax(T): that of forward KL(T || z), whose
    minimiser makes the draft's distribution match the teacher's (what lossless acceptance wants).
    """
    dt = torch.promote_types(student_logits.dtype, torch.float32)  # fp32 at least (fp64 in tests)
    t = F.softmax(teacher_logits.to(dt), dim=-1)
    return -(t * F.log_softmax(student_logits.to(dt), dim=-1)).sum(-1)


def _chunk_ce(draft: Eagle3Draft, hidden: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor):
    """sum(mask * CE) and the draft argmax over one sequence chunk (vocabulary-sized work)."""
    z = draft.lm_head(draft.norm(hidden))  # (B, c, Vd)
    ce = soft_cross_entropy(z, teacher)
    return (ce * mask).sum(), z.argmax(-1)


@dataclass
class DraftLossParts:
    """Per-pass local sums; reduced across ranks by `normalize_draft_loss`."""
    ce_sum: list[torch.Tensor]  # differentiable, one scalar per pass
    count: list[torch.Tensor]  # valid targets per pass (float scalars)
    agree: list[torch.Tensor]  # (B, S) bool: draft top-1 == teacher top-1, per pass
    valid: list[torch.Tensor]  # (B, S) bool mask per pass


def pass_target_masks(target_mask: torch.Tensor, num_passes: int,
                      shift: Callable[[torch.Tensor, int], torch.Tensor] = shift_left) -> list[torch.Tensor]:
    """Pass d's valid targets: pass d at anchor i predicts token i+d+1, so its mask is target_mask
    shifted by d+1 (float, one tensor per pass)."""
    m = target_mask.float()
    return [shift(m, d + 1) for d in range(1, num_passes + 1)]


def draft_loss_parts(draft: Eagle3Draft, pass_outputs: list[torch.Tensor],
                     policy_logits: torch.Tensor, target_mask: torch.Tensor, chunk: int,
                     shift: Callable[[torch.Tensor, int], torch.Tensor] = shift_left,
                     ) -> DraftLossParts:
    """Soft CE of every TTT pass against the detached policy logits, chunked over the sequence.

    policy_logits: (B, S, V) target-vocab logits at each position (teacher for position i+1).
    target_mask: (B, S) 1 where token j is a valid training target (completion token, not pad).
    Pass d at anchor i is taught by policy logits at i+d (restricted to the draft vocabulary
    through d2t) and predicts token i+d+1, so its mask is target_mask shifted by d+1.
    Chunking + checkpointing bounds the fp32 (B, chunk, Vd) buffers; logits are recomputed in
    backward instead of stored for the whole sequence.
    """
    teacher_all = policy_logits.detach()[..., draft.draft_to_target]  # (B, S, Vd)
    teacher_top1 = policy_logits.detach().argmax(-1)  # (B, S) target ids
    d2t_ids = draft.draft_to_target
    parts = DraftLossParts([], [], [], [])
    S = pass_outputs[0].shape[1]
    masks = pass_target_masks(target_mask, len(pass_outputs), shift)
    for d, hidden in enumerate(pass_outputs, start=1):
        teacher = shift(teacher_all, d)
        top1 = shift(teacher_top1, d)
        mask = masks[d - 1]
        ce_sum = hidden.new_zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32))
        agree = []
        for s in range(0, S, chunk):
            e = min(S, s + chunk)
            args = (hidden[:, s:e], teacher[:, s:e], mask[:, s:e])
            if torch.is_grad_enabled() and hidden.requires_grad:
                cs, am = checkpoint(_chunk_ce, draft, *args, use_reentrant=False)
            else:
                cs, am = _chunk_ce(draft, *args)
            ce_sum = ce_sum + cs
            agree.append(d2t_ids[am] == top1[:, s:e])
        parts.ce_sum.append(ce_sum)
        parts.count.append(mask.sum())
        parts.agree.append(torch.cat(agree, dim=1))
        parts.valid.append(mask > 0)
    return parts


def draft_metrics(stats: torch.Tensor) -> dict:
    """The draft's metrics from its summed statistics `stats` (4K,) = [N_d, chain hits_d, top-1 hits_d,
    CE sums_d] for d = 1..K (normalize_draft_loss builds them; micro-batches and ranks add them up, so
    their metrics are exact): per-pass CE mean and top-1 agreement, the simulated greedy acceptance
    length 1 + sum_d P(passes 1..d all agree), and the pass-1 target count. 0-dim tensors (no sync)."""
    n, chain_n, agree_n, ce_n = stats.split(stats.numel() // 4)
    K = n.numel()
    metrics = {f"draft/ce_pass{d + 1}": ce_n[d] / n[d].clamp_min(1) for d in range(K)}
    metrics.update({f"draft/top1_pass{d + 1}": agree_n[d] / n[d].clamp_min(1) for d in range(K)})
    metrics["draft/sim_accept_len"] = 1.0 + (chain_n / n.clamp_min(1.0)).sum()
    metrics["draft/tokens"] = n[0]
    return metrics


def normalize_draft_loss(parts: DraftLossParts, pass_weights: list[float],
                         count_group=None, denominator: torch.Tensor | None = None,
                         return_stats: bool = False):
    """L_draft = sum_d a_d sum_i mask*CE / sum_d a_d N_d.

    N_d is the number of valid pass-d targets in the whole global batch: local counts are summed
    over `count_group` (the data-parallel x context-parallel ranks; CP ranks hold disjoint tokens
    so each is counted once). Gradients are then *summed* across those ranks.
    Returns the local loss contribution and metrics (per-pass CE means, top-1 agreement and the
    simulated greedy acceptance length they imply). `denominator` replaces sum_d a_d N_d when the
    batch is processed in micro-batches (the whole batch's value, see cotrain.draft_denominator);
    the metrics then describe this micro-batch only, and `return_stats` also returns the summed
    statistics (`draft_metrics`) so the caller can add them up over micro-batches exactly.
    """
    K = len(parts.ce_sum)
    counts = torch.stack([c.detach().to(parts.ce_sum[0].dtype) for c in parts.count])  # (K,)
    # Agreement sums: for pass d, anchors valid at d whose passes 1..d all agree (the chain).
    chain = torch.ones_like(parts.agree[0])
    chain_hits, agree_hits = [], []
    for d in range(K):
        chain = chain & parts.agree[d]
        chain_hits.append((chain & parts.valid[d]).sum())
        agree_hits.append((parts.agree[d] & parts.valid[d]).sum())
    stats = torch.stack([*counts, *torch.stack(chain_hits).to(counts), *torch.stack(agree_hits).to(counts),
                         *torch.stack([c.detach() for c in parts.ce_sum])])
    if count_group is not None:
        dist.all_reduce(stats, group=count_group)
    n = stats[:K]
    w = torch.tensor(pass_weights[:K], dtype=parts.ce_sum[0].dtype, device=n.device)
    denom = (w * n).sum().clamp_min(1.0) if denominator is None else denominator.to(w.dtype)
    loss = sum(w[d] * parts.ce_sum[d] for d in range(K)) / denom
    # Metrics stay 0-dim tensors: a .item() here would stall the host mid-step (see metrics_to_floats).
    metrics = draft_metrics(stats)
    return (loss, metrics, stats) if return_stats else (loss, metrics)


def metrics_to_floats(metrics: dict) -> dict:
    """Tensor-valued metrics -> Python floats in one device->host transfer.

    The losses return their metrics as detached 0-dim tensors so that a training step has no host
    sync before its optimizer update: on a GPU each .item() drains the queue, and the many small
    kernels launched after it (the draft's) then run at the host's launch speed instead of
    being queued behind the policy's large ones.
    """
    keys = [k for k, v in metrics.items() if torch.is_tensor(v)]
    if not keys:
        return dict(metrics)
    vals = torch.stack([metrics[k].detach().reshape(()).double() for k in keys]).tolist()
    return {**metrics, **dict(zip(keys, vals))}


def pass_weights(num_passes: int, decay: float) -> list[float]:
    """alpha_d = decay**(d-1): later passes are harder and weigh less (EAGLE-3 uses 0.8)."""
    return [decay ** d for d in range(num_passes)]


# -- GRPO -----------------------------------------------------------------------------------

def grpo_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6,
                    scale_by_std: bool = True) -> torch.Tensor:
    """A_{g,j} = (r_{g,j} - mean_j r_{g,j}) / (std_j r_{g,j} + eps) over each group of G samples.

    rewards: (N*G,) with the G samples of a prompt contiguous. Groups with identical rewards get
    advantage 0 (no signal). std is the unbiased sample std (torch default), as in DeepSeekMath.
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.float().view(-1, group_size)  # (N, G)
    a = r - r.mean(dim=1, keepdim=True)
    if scale_by_std:
        a = a / (r.std(dim=1, keepdim=True) + eps)
    return a.view(-1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(tokens) under softmax(logits / T), fp32. logits (B, S, V) predict tokens (B, S)."""
    lp = F.log_softmax(logits.float() / max(temperature, 1e-6), dim=-1)
    return lp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def clipped_surrogate(logp_new: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
                      mask: torch.Tensor, clip_eps: float, logp_ref: torch.Tensor | None = None,
                      kl_coef: float = 0.0, num_tokens: torch.Tensor | float | None = None):
    """PPO/GRPO clipped objective, token-level, as a loss to minimise.

    ratio = exp(logp_new - logp_old);  L = -min(ratio*A, clip(ratio, 1-eps, 1+eps)*A)
    plus kl_coef * KL_k3(new || ref) with k3 = exp(ref-new) - (ref-new) - 1 (unbiased, >= 0).
    Summed over masked tokens and divided by `num_tokens` (the global masked-token count; defaults
    to the local count) so that DP/CP ranks' contributions add up to a global token mean.
    advantages: (B,) per sample or (B, S) per token.
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logp_new)
    ratio = torch.exp(logp_new - logp_old)
    obj = torch.minimum(ratio * advantages, ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages)
    per_tok = -obj
    if logp_ref is not None and kl_coef > 0:
        delta = logp_ref - logp_new
        per_tok = per_tok + kl_coef * (torch.exp(delta) - delta - 1)
    mask = mask.float()
    n = mask.sum().clamp_min(1.0) if num_tokens is None else num_tokens
    loss = (per_tok * mask).sum() / n
    with torch.no_grad():
        clipped = ((ratio - 1).abs() > clip_eps).float()
        frac = (clipped * mask).sum() / mask.sum().clamp_min(1.0)
    return loss, {"policy/clip_frac": frac}  # a tensor: see metrics_to_floats
