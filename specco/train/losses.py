"""Losses of the co-training step: the draft's TTT soft cross-entropy and the GRPO policy loss.

One home per formula: `soft_cross_entropy`, `normalize_draft_loss` (L_draft) with `draft_denominator`,
`grpo_advantages`, `clipped_surrogate` (L_policy, with the k3 KL), and the metrics of both losses from
their summed statistics (`DraftStats`, `PolicyStats`). Metrics are 0-dim tensors; `metrics_to_floats`
converts them. Process groups are arguments (None = single process).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
from torch.distributed.tensor import DTensor
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
    """Per-pass local sums of one (micro-)batch; `normalize_draft_loss` and `DraftStats.of` read them."""
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


class _Sums:
    """Summed statistics (dataclass fields: tensors) that micro-batches and ranks add up exactly: the
    metrics come from the sums, never from averaging per-part means."""

    def _tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    def __add__(self, other):
        return type(self)(*(a + b for a, b in zip(self._tensors(), other._tensors())))


def all_reduce_sums(stats: list, group) -> list:
    """Sum several `_Sums` over `group` in ONE all-reduce (None: unchanged)."""
    if group is None:
        return stats
    parts = [t.reshape(-1) for s in stats for t in s._tensors()]
    flat = torch.cat([t.to(torch.float64) for t in parts])  # (n,) counts stay exact integers
    dist.all_reduce(flat, group=group)
    out, i = [], 0
    for s in stats:
        ts = []
        for t in s._tensors():
            ts.append(flat[i:i + t.numel()].reshape(t.shape).to(t.dtype))
            i += t.numel()
        out.append(type(s)(*ts))
    return out


@dataclass
class DraftStats(_Sums):
    """The draft's summed statistics per TTT pass d = 1..K, each (K,): valid targets N_d, chain hits
    (anchors whose passes 1..d all agree with the teacher's top-1), top-1 hits, and CE sums (detached)."""
    count: torch.Tensor
    chain: torch.Tensor
    top1: torch.Tensor
    ce: torch.Tensor

    @classmethod
    def of(cls, parts: DraftLossParts) -> "DraftStats":
        counts = torch.stack([c.detach().to(parts.ce_sum[0].dtype) for c in parts.count])  # (K,)
        chain = torch.ones_like(parts.agree[0])
        chain_hits, agree_hits = [], []
        for agree, valid in zip(parts.agree, parts.valid):
            chain = chain & agree
            chain_hits.append((chain & valid).sum())
            agree_hits.append((agree & valid).sum())
        return cls(counts, torch.stack(chain_hits).to(counts), torch.stack(agree_hits).to(counts),
                   torch.stack([c.detach() for c in parts.ce_sum]))

    def metrics(self) -> dict:
        """Per-pass CE mean and top-1 agreement, the simulated greedy acceptance length
        1 + sum_d P(passes 1..d all agree), the pass-1 target count. 0-dim tensors (no host sync)."""
        n = self.count.clamp_min(1.0)
        K = n.numel()
        metrics = {f"draft/ce_pass{d + 1}": self.ce[d] / n[d] for d in range(K)}
        metrics.update({f"draft/top1_pass{d + 1}": self.top1[d] / n[d] for d in range(K)})
        metrics["draft/sim_accept_len"] = 1.0 + (self.chain / n).sum()
        metrics["draft/tokens"] = self.count[0]
        return metrics


def draft_denominator(counts: torch.Tensor, pass_weights: list[float]) -> torch.Tensor:
    """sum_d a_d N_d, the denominator of L_draft (the one home of it): counts (K,) are the valid-target
    counts N_d of the whole (global) batch. At least 1, so an empty batch gives a zero loss."""
    w = torch.tensor(pass_weights[:counts.numel()], dtype=counts.dtype, device=counts.device)
    return (w * counts).sum().clamp_min(1.0)


def normalize_draft_loss(parts: DraftLossParts, pass_weights: list[float],
                         denominator: torch.Tensor | None = None) -> torch.Tensor:
    """L_draft = sum_d a_d sum_i mask*CE / sum_d a_d N_d.

    N_d counts the valid pass-d targets of the whole global batch: `denominator` is that value
    (`draft_denominator` of the global counts, computed once per step by cotrain.step_counts; CP ranks
    hold disjoint tokens so each is counted once), so micro-batches' and ranks' losses and gradients
    *add up* to the global mean. None: this batch's own counts (a single-process, whole-batch call).
    """
    K = len(parts.ce_sum)
    if denominator is None:
        dt = parts.ce_sum[0].dtype
        denominator = draft_denominator(torch.stack([c.detach().to(dt) for c in parts.count]), pass_weights)
    w = pass_weights[:K]
    return sum(w[d] * parts.ce_sum[d] for d in range(K)) / denominator.to(parts.ce_sum[0].dtype)


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

def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, coef: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13), scaled by `coef`: per completion of
    `lengths` tokens (decoding stops at `max_len`),

        0                                     if length <= max_len - buffer
        -coef * (length - (max_len - buffer)) / buffer   in the last `buffer` tokens, down to -coef at max_len

    added to the task's reward before the advantages. `buffer` 0: zeros (off)."""
    if buffer <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    over = (lengths.float() - (max_len - buffer)) / buffer
    return -coef * over.clamp(0.0, 1.0)


def grpo_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6,
                    scale_by_std: bool = True, valid: torch.Tensor | None = None) -> torch.Tensor:
    """A_{g,j} = (r_{g,j} - mean_j r_{g,j}) / (std_j r_{g,j} + eps) over each group of G samples.

    rewards: (N*G,) with the G samples of a prompt contiguous. Groups with identical rewards get
    advantage 0 (no signal). std is the unbiased sample std (torch default), as in DeepSeekMath.
    `valid` (N*G,) bool: rows the rewards scored. Mean and std run over a group's valid rows only and an
    invalid row's advantage is 0 (a reward function returned None for it: TRL's "not applicable").
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.float().view(-1, group_size)  # (N, G)
    if valid is not None and not bool(valid.all()):
        v = valid.view(-1, group_size).to(r.dtype)  # (N, G)
        n = v.sum(dim=1, keepdim=True)
        a = (r - (r * v).sum(dim=1, keepdim=True) / n.clamp(min=1)) * v
        if scale_by_std:  # unbiased over the valid rows; a group with one valid row has a = 0 already
            a = a / (((a * a).sum(dim=1, keepdim=True) / (n - 1).clamp(min=1)).sqrt() + eps)
        return a.view(-1)
    a = r - r.mean(dim=1, keepdim=True)
    if scale_by_std:
        a = a / (r.std(dim=1, keepdim=True) + eps)
    return a.view(-1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(tokens) under softmax(logits / T) in fp32 at least (bf16 / fp32 logits: fp32; fp64 ones, in tests:
    fp64, as soft_cross_entropy). logits (B, S, V) predict tokens (B, S). Logits cut along the vocabulary over
    tensor-parallel ranks (a DTensor: parallel/tp.py's head) take the loss-parallel form there, in the same dtype."""
    if isinstance(logits, DTensor):
        from ..parallel.tp import vocab_parallel_logprobs
        return vocab_parallel_logprobs(logits, tokens, temperature, LOGPROB_CHUNK_ELEMENTS)
    V = logits.shape[-1]
    return _TokenLogprobs.apply(logits, tokens, max(temperature, 1e-6), max(1, LOGPROB_CHUNK_ELEMENTS // V))


LOGPROB_CHUNK_ELEMENTS = 1 << 26  # fp32 elements of one chunk's (rows, V) work: 256 MB, ~440 rows of a 151K vocabulary


class _TokenLogprobs(torch.autograd.Function):
    """log p(token) = z[token] − logsumexp(z) with z = logits / T in fp32 (fp64 for fp64 logits), `rows` positions at
    a time in both directions. Kept for the backward: `logits` itself (the step holds it anyway, as the draft's
    teacher) and the (N,) logsumexp, never an (N, V) fp32 log-softmax: autograd's log_softmax kept one, plus its
    gradient and the scaled logits' (12 bytes per position per vocabulary entry; a 151K vocabulary at 32K positions:
    58 GB). The gradient (onehot − softmax(z)) · g / T is formed per chunk in fp32 and stored in logits' dtype."""

    @staticmethod
    def forward(ctx, logits, tokens, temperature, rows):
        dt = torch.promote_types(logits.dtype, torch.float32)
        flat, tok = logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1, 1)  # (N, V), (N, 1)
        lp = torch.empty(flat.shape[0], dtype=dt, device=logits.device)
        lse = torch.empty_like(lp)
        for s in range(0, flat.shape[0], rows):
            z = flat[s:s + rows].to(dt) / temperature
            lse[s:s + rows] = torch.logsumexp(z, dim=-1)
            lp[s:s + rows] = z.gather(1, tok[s:s + rows]).squeeze(1) - lse[s:s + rows]
        ctx.save_for_backward(logits, tokens, lse)
        ctx.temperature, ctx.rows = temperature, rows
        return lp.view(tokens.shape)

    @staticmethod
    def backward(ctx, g):
        logits, tokens, lse = ctx.saved_tensors
        T, rows = ctx.temperature, ctx.rows
        flat, tok = logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1, 1)
        gf = g.reshape(-1, 1).to(lse.dtype)  # (N, 1)
        grad = torch.empty_like(flat)
        for s in range(0, flat.shape[0], rows):
            e = s + rows
            d = torch.exp(flat[s:e].to(lse.dtype) / T - lse[s:e, None]).mul_(-gf[s:e])  # -softmax(z) · g
            d.scatter_add_(1, tok[s:e], gf[s:e])
            grad[s:e] = d.div_(T)
        return grad.view_as(logits), None, None, None


@dataclass
class PolicyStats(_Sums):
    """The policy loss's summed statistics over trained tokens (0-dim each): token count, clipped
    tokens (|ratio - 1| > eps), sum of ratios, sum of |ratio - 1|, sum of the k3 KL to the reference."""
    tokens: torch.Tensor
    clipped: torch.Tensor
    ratio: torch.Tensor
    ratio_dev: torch.Tensor
    kl: torch.Tensor

    def metrics(self) -> dict:
        n = self.tokens.clamp_min(1.0)
        return {"policy/clip_frac": self.clipped / n, "policy/ratio_mean": self.ratio / n,
                "policy/ratio_dev": self.ratio_dev / n, "policy/kl": self.kl / n}


def clipped_surrogate(logp_new: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
                      mask: torch.Tensor, clip_eps: float, logp_ref: torch.Tensor | None = None,
                      kl_coef: float = 0.0, num_tokens: torch.Tensor | float | None = None):
    """PPO/GRPO clipped objective, token-level, as a loss to minimise.

    ratio = exp(logp_new - logp_old);  L = -min(ratio*A, clip(ratio, 1-eps, 1+eps)*A)
    plus kl_coef * KL_k3(new || ref) with k3 = exp(ref-new) - (ref-new) - 1 (unbiased, >= 0; GRPO's
    estimator, DeepSeekMath eq. 4). Summed over masked tokens and divided by `num_tokens` (the global
    masked-token count; defaults to the local count) so that micro-batches' and DP/CP ranks'
    contributions add up to a global token mean. advantages: (B,) per sample or (B, S) per token.
    Returns (loss, PolicyStats).
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logp_new)
    ratio = torch.exp(logp_new - logp_old)
    obj = torch.minimum(ratio * advantages, ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages)
    per_tok = -obj
    mask = mask.to(per_tok.dtype)
    kl = torch.zeros((), dtype=per_tok.dtype, device=per_tok.device)
    if logp_ref is not None:
        delta = logp_ref - logp_new
        k3 = torch.exp(delta) - delta - 1
        if kl_coef > 0:
            per_tok = per_tok + kl_coef * k3
        kl = (k3.detach() * mask).sum()
    n = mask.sum().clamp_min(1.0) if num_tokens is None else torch.as_tensor(num_tokens)
    num = (per_tok * mask).sum()
    loss = num / n.to(num.dtype)
    with torch.no_grad():
        r = ratio.detach()
        stats = PolicyStats(mask.sum(), (((r - 1).abs() > clip_eps).to(mask) * mask).sum(), (r * mask).sum(),
                            ((r - 1).abs() * mask).sum(), kl)
    return loss, stats  # tensors: see metrics_to_floats
