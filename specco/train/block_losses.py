"""Losses of the block drafters DFlash and DSpark (docs/DESIGN.md §2b), the twin of losses.py's TTT loss.

Per sequence, N anchors p are sampled among positions whose next token is generated; the block of anchor p
has γ predictions j = 0..γ-1, each with label x_{p+1+j} and teacher = the detached policy logits at p+j.
A prediction is valid iff its anchor is real, its label is in bounds and a trained token, and every earlier
prediction of the block is valid (prefix-contiguous, a cumprod: serving acceptance stops at the first miss).

    DFlash:  ℓ_j = CE_soft(z_j, T_j)
    DSpark:  ℓ_j = 0.1·CE(z_j, label_j) + 0.9·Σ_v |softmax(z_j) - softmax(T_j)| + BCE(c_j, a_j),
             a_j = clamp(1 - Σ_v|p - q|/2, 0, 1) detached  (= Σ_v min(p, q): the lossless acceptance probability)
    L = Σ_j w_j Σ valid·ℓ_j / Σ_j w_j N_j,   w_j = exp(-j/γ_d) (model/dflash.slot_weights), N_j global counts

The denominator is `losses.draft_denominator` (the one home of Σ w N), computed once per step over the whole
batch, so micro-batches and ranks add up. Vocabulary-sized work is chunked over anchors and checkpointed like
the TTT loss. The DSpark weights (0.1, 0.9, 1.0) and the w_j weighting apply to both kinds alike.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..model.dflash import BlockDraft, slot_weights
from ..ops.block_attention import block_attention
from .losses import _Sums, draft_denominator, soft_cross_entropy

_P = 2147483647  # 2^31 - 1: products of two residues fit in int64, so the hash below never overflows


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A few rounds of multiply-mod-prime and xor-shift on int64 residues < 2^31 (a cheap integer hash)."""
    for a in (48271, 69621, 16807):
        x = (x * a) % _P
        x = x ^ (x >> 13)
    return x


def sample_anchors(tokens: torch.Tensor, target_mask: torch.Tensor, num_anchors: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """N anchors per row among positions p whose next token is generated (target_mask[p+1] set).

    Deterministic from the row's trained content (tokens where the mask is set), with no global RNG: every rank of a group (and
    every micro-batch split) draws the same anchors. Candidates are ordered by a hash of (row content,
    position); the first N are taken (distinct); with fewer than N candidates they are reused cyclically
    (sampling with replacement). Returns anchors (B, N) int64 (sorted per row) and valid (B, N) bool
    (False only for rows with no candidate; their anchors are 0).
    """
    B, S = tokens.shape
    dev = tokens.device
    cand = torch.zeros(B, S, dtype=torch.bool, device=dev)
    cand[:, :-1] = target_mask[:, 1:].bool()
    pos = torch.arange(S, device=dev)
    content = (tokens.long() % _P + 1) * (target_mask.long() + 1)  # (B, S)
    # Only trained tokens enter the seed: a right-padded row and the same sequence inside a pack (or gathered
    # from its CP shards) get the same anchors whatever the padding holds.
    trained = target_mask.bool().long()
    row_seed = (trained * (_mix(content + pos * 7919) % 65521)).sum(1) % _P  # (B,) order-sensitive content hash
    key = _mix(row_seed[:, None] + pos[None] * 104729 + 1)  # (B, S) in [0, 2^31)
    key = torch.where(cand, key, torch.full_like(key, _P))  # non-candidates last
    order = key.argsort(dim=1, stable=True)  # (B, S)
    m = cand.sum(1)  # (B,)
    idx = torch.arange(num_anchors, device=dev)[None] % m.clamp_min(1)[:, None]  # (B, N) cyclic reuse
    anchors = order.gather(1, idx)
    valid = (m > 0)[:, None].expand(B, num_anchors)
    anchors = torch.where(valid, anchors, torch.zeros_like(anchors))
    return anchors.sort(dim=1).values, valid


def slot_validity(target_mask: torch.Tensor, anchors: torch.Tensor, anchor_valid: torch.Tensor, gamma: int
                  ) -> torch.Tensor:
    """(B, N, γ) float: prediction j of anchor p is valid iff the anchor is, p+1+j < S, target_mask[p+1+j],
    and all predictions before it are valid (cumprod: prefix-contiguous)."""
    S = target_mask.shape[1]
    lab = anchors[..., None] + 1 + torch.arange(gamma, device=anchors.device)  # (B, N, γ) label positions
    inb = lab < S
    m = target_mask.float().gather(1, lab.clamp_max(S - 1).flatten(1)).view_as(lab)
    ok = (m > 0) & inb & anchor_valid[..., None]
    return ok.float().cumprod(-1)


def block_targets(tokens, anchors, gamma):
    """Indices of prediction j of anchor p: teacher/prev position p+j and label position p+1+j, (B, N, γ),
    clamped into the row (out-of-row ones are invalid anyway)."""
    S = tokens.shape[1]
    at = anchors[..., None] + torch.arange(gamma, device=anchors.device)
    return at.clamp_max(S - 1), (at + 1).clamp_max(S - 1)


@dataclass
class BlockPlan:
    """Which blocks this rank trains and what they need, (B, N[, γ]) each: anchors = local token indices of
    the anchors; valid (float, prefix-contiguous), labels x_{p+1+j} and prev x_{p+j} per prediction;
    `teacher(logits)` gathers the teacher logits at p+j -> (B, N, γ, V); `attn` is the block attention.

    One process: `local_plan`. Context parallelism / packed rows: parallel.block_cp.BlockCP.plan (anchors
    drawn per sequence from the gathered content, each block on the rank that holds its anchor)."""
    anchors: torch.Tensor
    valid: torch.Tensor
    labels: torch.Tensor
    prev: torch.Tensor
    teacher: Callable[[torch.Tensor], torch.Tensor]
    attn: Callable = block_attention


def local_plan(tokens: torch.Tensor, target_mask: torch.Tensor, num_anchors: int, gamma: int) -> BlockPlan:
    """The plan of unpacked rows on one process: every row is one sequence, all its blocks are here."""
    anchors, av = sample_anchors(tokens, target_mask, num_anchors)  # (B, N)
    valid = slot_validity(target_mask, anchors, av, gamma)  # (B, N, γ)
    at, lab = block_targets(tokens, anchors, gamma)
    labels, prev = tokens.gather(1, lab.flatten(1)).view_as(lab), tokens.gather(1, at.flatten(1)).view_as(at)
    # teacher(logits of positions `start`..): an invalid block's (anchor 0) positions clamp into them, read as 0 weight
    return BlockPlan(anchors, valid, labels, prev,
                     lambda logits, start=0: _gather_rows(logits, (at - start).clamp_min(0)))


def block_slot_counts(draft: BlockDraft, tokens: torch.Tensor, target_mask: torch.Tensor,
                      plan: Callable = local_plan) -> torch.Tensor:
    """N_j, (γ,): valid predictions per slot of these rows (the step's global denominator sums these)."""
    return plan(tokens, target_mask, draft.cfg.num_anchors, draft.cfg.gamma).valid.sum((0, 1))


def _gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x (B, S, ...) at idx (B, N, γ) -> (B, N, γ, ...)."""
    B, N, G = idx.shape
    flat = idx.reshape(B, N * G)
    out = x.gather(1, flat.view(B, N * G, *([1] * (x.dim() - 2))).expand(B, N * G, *x.shape[2:]))
    return out.view(B, N, G, *x.shape[2:])


def _chunk_loss(draft: BlockDraft, hid, head_weight, teacher, labels, prev, valid):
    """One anchor chunk: per-slot Σ valid·ℓ (γ,) and per-prediction detached statistics (B, c, γ) each."""
    z = draft.logits(hid, head_weight, prev)  # (B, c, γ, V)
    dt = torch.promote_types(z.dtype, torch.float32)
    q = F.softmax(z.to(dt), -1)
    p = F.softmax(teacher.to(dt), -1)
    tv = (q - p).abs().sum(-1)  # Σ_v |p - q| (= 2·TV distance)
    accept = (1 - tv / 2).clamp(0, 1)  # Σ_v min(p, q)
    if draft.kind == "dflash":
        ce = soft_cross_entropy(z, teacher)
        ell = ce
        conf_err = torch.zeros_like(ce)
    else:
        ce = F.cross_entropy(z.to(dt).flatten(0, -2), labels.flatten(), reduction="none").view_as(tv)
        c = draft.confidence_logit(hid, prev).to(dt)
        bce = F.binary_cross_entropy_with_logits(c, accept.detach(), reduction="none")
        ell = 0.1 * ce + 0.9 * tv + bce
        conf_err = (torch.sigmoid(c) - accept).abs()
    loss_sum = (ell * valid).sum((0, 1))  # (γ,)
    agree = z.argmax(-1) == teacher.argmax(-1)
    return loss_sum, ce.detach(), accept.detach(), agree, conf_err.detach()


@dataclass
class BlockStats(_Sums):
    """Summed statistics per prediction slot j = 0..γ-1, each (γ,): valid predictions N_j, top-1 hits,
    greedy chain hits (slots 0..j all agree), acceptance Σ a_j, acceptance chain Σ Π_{i<=j} a_i,
    confidence error Σ |σ(c_j) - a_j| (DSpark; 0 for DFlash), CE sums."""
    count: torch.Tensor
    top1: torch.Tensor
    chain: torch.Tensor
    accept: torch.Tensor
    accept_chain: torch.Tensor
    conf_err: torch.Tensor
    ce: torch.Tensor

    @classmethod
    def of(cls, valid, agree, accept, conf_err, ce) -> "BlockStats":
        """From per-prediction tensors (B, N, γ); valid is prefix-contiguous."""
        v = valid.to(accept.dtype)
        return cls(v.sum((0, 1)), (agree * v).sum((0, 1)), ((agree * v).cumprod(-1)).sum((0, 1)),
                   (accept * v).sum((0, 1)), ((accept * v).cumprod(-1)).sum((0, 1)),
                   (conf_err * v).sum((0, 1)), (ce * v).sum((0, 1)))

    def metrics(self) -> dict:
        """Per-slot acceptance / top-1 / CE means; probabilistic τ = 1 + Σ_j E[Π_{i<=j} a_i] over the blocks
        with a valid first prediction; greedy τ from top-1 chains; mean confidence error. 0-dim tensors."""
        n = self.count.clamp_min(1.0)
        n0 = n[0]
        m = {f"draft/accept_slot{j}": self.accept[j] / n[j] for j in range(n.numel())}
        m.update({f"draft/top1_slot{j}": self.top1[j] / n[j] for j in range(n.numel())})
        m.update({f"draft/ce_slot{j}": self.ce[j] / n[j] for j in range(n.numel())})
        m["draft/tau_prob"] = 1.0 + self.accept_chain.sum() / n0
        m["draft/sim_accept_len"] = 1.0 + self.chain.sum() / n0
        m["draft/conf_err"] = self.conf_err.sum() / self.count.sum().clamp_min(1.0)
        m["draft/tokens"] = self.count.sum()
        return m


def block_draft_loss(draft: BlockDraft, aux, embed, policy_logits, tokens, target_mask, positions,
                     head_weight, mask_emb, denominator=None, chunk: int = 256, plan: Callable = local_plan,
                     logits_from: int = 0):
    """L_draft of a block drafter on these rows, and its BlockStats.

    aux (B, S, k·h), embed (B, S, h): the policy's taps (detached here); policy_logits (B, S, V) the teacher
    (detached); head_weight (V, h) the policy's live head and mask_emb (h,) its embed_tokens[mask_id], both
    read detached; positions (B, S) absolute. `denominator`: the step's Σ_j w_j N_j (None: these rows').
    `chunk`: anchors per checkpointed chunk of vocabulary-sized work. `plan(tokens, target_mask, N, γ)` ->
    BlockPlan: `local_plan` on one process, `BlockCP.plan` under context parallelism or for packed rows.
    `logits_from`: policy_logits are of positions logits_from.. (Policy.forward's; padded rows, local_plan): every
    valid block's teacher positions p+j >= p, whose next token is trained, lie in them.
    """
    c = draft.cfg
    aux, embed, teacher_all = aux.detach(), embed.detach(), policy_logits.detach()
    pl = plan(tokens, target_mask, c.num_anchors, c.gamma)
    anchors, valid, labels, prev = pl.anchors, pl.valid, pl.labels, pl.prev
    anchor_emb = embed.gather(1, anchors[..., None].expand(-1, -1, embed.shape[-1]))  # (B, N, h)
    hidden = draft(aux, anchor_emb, mask_emb.detach(), positions, draft.block_positions(positions, anchors),
                   attn=pl.attn)
    hid = draft.predicting(hidden)  # (B, N, γ, h)
    teacher = pl.teacher(teacher_all, logits_from) if logits_from else pl.teacher(teacher_all)  # (B, N, γ, V)
    N = anchors.shape[1]
    sums, per = [], []
    for a in range(0, N, chunk):
        e = min(N, a + chunk)
        args = (hid[:, a:e], head_weight, teacher[:, a:e], labels[:, a:e], prev[:, a:e], valid[:, a:e])
        if torch.is_grad_enabled() and hid.requires_grad:
            ls, *st = checkpoint(_chunk_loss, draft, *args, use_reentrant=False)
        else:
            ls, *st = _chunk_loss(draft, *args)
        sums.append(ls)
        per.append(st)
    loss_sum = torch.stack(sums).sum(0)  # (γ,)
    ce, accept, agree, conf_err = (torch.cat([p[i] for p in per], dim=1) for i in range(4))
    stats = BlockStats.of(valid, agree, accept, conf_err, ce)
    w = torch.tensor(slot_weights(c), dtype=loss_sum.dtype, device=loss_sum.device)
    if denominator is None:
        denominator = draft_denominator(valid.sum((0, 1)).to(loss_sum.dtype), slot_weights(c))
    return (w * loss_sum).sum() / denominator.to(loss_sum.dtype), stats
