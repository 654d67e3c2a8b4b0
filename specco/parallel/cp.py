"""Context parallelism applied from outside (STYLE §1): the recipe, the CP-aware shift, the batch shard.

    zig = ZigzagLayout(cu_seqlens, cp, cp_rank)             # per packed batch
    batch = shard_batch(packed_batch, zig)                  # tokens, masks, logps, positions -> local
    cotrain_step(policy, draft, batch, ..., grad_group=dp×cp group,
                 layout=ZigzagPack(cp_group, zig))          # parallel/layout.py: shift, TTT attention, policy
                                                            # attention core, block drafters' plan (block_cp.py)

The model files stay distributed-free and nothing is patched onto them: the policy's forward gets an
attention core (`attn_core`), TTT gets a shift and an attention, the losses get global counts (the
step computes them over its grad_group). Gradients are summed over DP×CP by cotrain_step's
`grad_group`; losses are normalised by global counts, so the sum is the global mean.

With cp = 1 (group None) the same functions run a *packed* batch on one device: attention and shifts
then stay inside each sequence of the pack, which plain causal SDPA and `shift_left` would not.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ..batch import TrainBatch
from .ring_attention import ring_causal_attention, ring_ttt_attention
from .zigzag import ZigzagLayout

__all__ = ["cp_core", "cp_shift", "cp_attn", "global_count", "shard_batch"]


def cp_core(group, layout: ZigzagLayout):
    """The policy's attention core under CP (`Policy.forward(attn_core=...)`): zigzag ring attention."""
    return functools.partial(ring_causal_attention, group=group, layout=layout)


def cp_attn(group, layout: ZigzagLayout):
    """The TTT attention of ttt_forward under CP (ZigzagPack.attn)."""
    return functools.partial(ring_ttt_attention, group=group, layout=layout)


# --------------------------------------------------------------------------------------------------
# CP-aware shift:  y[token at global position i of sequence n] = x[token at position i+d of n], 0 past
# the sequence's true end.
#
# Where does x[i+d] live? Let chunk k (c tokens) hold i. If i+d is still inside chunk k, it is local.
# Otherwise it lies in a later chunk j at offset o = i+d − j·c, and o < min(d, c) (i <= (k+1)c − 1 and
# j >= k+1 give o <= d − 1; o < c by definition). So every rank needs only the first h = min(d, c)
# rows ("heads") of other chunks. Each rank contributes the heads of its two chunks per sequence; one
# all_gather of those border slices (2·cp·h rows per sequence, in total — never the sequence) gives
# everybody every head. That stays correct when d > c (short sequences: i+d may skip whole chunks and
# ranks), which a neighbour-only exchange would not handle.
#
# The result is one index_select over [x_local; gathered heads; one zero row].
# --------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=256)
def _shift_plan(layout: ZigzagLayout, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(send_idx (H_tot,): local rows of our heads, src_idx (T_local,): row of y's source in the table)."""
    cp, r, T = layout.cp, layout.rank, layout.num_local
    heads = [min(d, c) for c in layout.chunks]  # h_i
    h_tot = 2 * sum(heads)  # rows each rank contributes
    zero_row = T + cp * h_tot
    send, src = [], []
    head_off = 0  # offset of sequence i's heads inside one rank's contribution
    for (s, c), L, h in zip(zip(layout.local_cu_seqlens, layout.chunks), layout.seqlens, heads):
        if c == 0:
            continue
        send += [torch.arange(s, s + h), torch.arange(s + c, s + c + h)]  # front head, back head
        for slot, chunk in enumerate((r, 2 * cp - 1 - r)):
            t = torch.arange(c)  # offset inside the chunk
            p = chunk * c + t  # global position of the query token
            tgt = p + d  # global position of its source
            j = tgt // c  # chunk holding the source
            owner = torch.where(j < cp, j, 2 * cp - 1 - j)  # zigzag: chunk j lives on rank j or 2cp-1-j
            jslot = (j >= cp).long()  # 0: the owner's front chunk, 1: its back chunk
            remote = T + owner * h_tot + head_off + jslot * h + (tgt - j * c)
            local = s + slot * c + t + d
            idx = torch.where(j == chunk, local, remote)
            src.append(torch.where(tgt < L, idx, torch.full_like(idx, zero_row)))
        head_off += 2 * h
    cat = lambda xs: torch.cat(xs) if xs else torch.zeros(0, dtype=torch.long)  # noqa: E731
    return cat(send), cat(src)


def cp_shift(x: torch.Tensor, d: int, group=None, layout: ZigzagLayout | None = None, dim: int = 1
             ) -> torch.Tensor:
    """CP version of `model.ttt.shift_left`: y[i] = x[i+d] within each sequence, 0 past its end.

    x: (B, T_local, ...) zigzag-local along `dim`; any dtype (bool goes through uint8). Communicates one
    all_gather of the 2·min(d, c_i) head rows per sequence on `group` (the CP group; None when cp = 1).
    The shift carries no gradient (its inputs — embeddings, teacher logits, masks, tokens — are detached),
    so a differentiable input is refused rather than silently cut off from autograd.
    Unlike shift_left it also zeroes across sequence borders inside a pack, for any cp.
    """
    if layout is None:
        raise ValueError("cp_shift needs the batch's ZigzagLayout")
    if d == 0:
        return x
    if x.requires_grad:
        raise ValueError("cp_shift does not propagate gradients; pass a detached tensor")
    dim = dim % x.dim()
    send_idx, src_idx = _shift_plan(layout, d)
    send_idx, src_idx = send_idx.to(x.device), src_idx.to(x.device)
    is_bool = x.dtype == torch.bool
    xs = x.to(torch.uint8) if is_bool else x
    heads = xs.index_select(dim, send_idx).contiguous()  # (.., H_tot, ..) our chunks' border rows
    if layout.cp > 1:
        gathered = [torch.empty_like(heads) for _ in range(layout.cp)]
        dist.all_gather(gathered, heads, group=group)  # rank q's heads land at rows q·H_tot..
        heads = torch.cat(gathered, dim=dim)  # (.., cp·H_tot, ..)
    zero = torch.zeros_like(xs.narrow(dim, 0, 1)) if xs.shape[dim] else \
        xs.new_zeros((*xs.shape[:dim], 1, *xs.shape[dim + 1:]))
    table = torch.cat([xs, heads, zero], dim=dim)  # (.., T_local + cp·H_tot + 1, ..)
    y = table.index_select(dim, src_idx)
    return y.bool() if is_bool else y


def global_count(x: torch.Tensor, group=None) -> torch.Tensor:
    """sum(x) over all tokens of all ranks of `group` (DP×CP: CP ranks hold disjoint tokens, each
    counted once; padding holds zeros). E.g. the policy loss's global trained-token count."""
    n = x.detach().sum().to(torch.float64 if x.dtype == torch.float64 else torch.float32).reshape(1)
    if group is not None:
        dist.all_reduce(n, group=group)
    return n[0]


def shard_batch(batch: TrainBatch, layout: ZigzagLayout) -> TrainBatch:
    """A packed global TrainBatch (B rows sharing `layout`'s borders, usually B = 1) -> this rank's shard.

    Per-token fields are zigzag-sharded (padding zero, so target_mask is 0 there); per-sample
    advantages (B,) are kept; positions become the zigzag global positions (for RoPE); cu_seqlens
    stays the global borders (the layout holds the local ones).
    """
    if batch.cu_seqlens is not None and tuple(batch.cu_seqlens) != layout.cu_seqlens:
        raise ValueError(f"batch borders {batch.cu_seqlens} differ from the layout's {layout.cu_seqlens}")

    def sh(x):
        return None if x is None else layout.shard(x, dim=1)

    B = batch.tokens.shape[0]
    adv = batch.advantages
    if adv is not None and adv.dim() == 2:
        adv = sh(adv)
    return TrainBatch(tokens=sh(batch.tokens), target_mask=sh(batch.target_mask), advantages=adv,
                      logp_old=sh(batch.logp_old), logp_ref=sh(batch.logp_ref),
                      positions=layout.positions(batch.tokens.device).expand(B, -1),
                      draft_mask=sh(batch.draft_mask), cu_seqlens=layout.cu_seqlens)
