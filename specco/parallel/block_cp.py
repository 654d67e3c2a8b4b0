"""Block drafters (DFlash / DSpark) under context parallelism and on packed rows (docs/DESIGN.md §2b, §4).

    plan = BlockCP(cp_group, layout).plan(tokens, target_mask, N, γ)     # layout.ZigzagPack(...).block

Anchors. Every CP rank all-gathers the token ids and target masks of its group (integers: O(S) per rank,
never K/V) and draws, per sequence, exactly the anchors a single process draws for that sequence
(`train.block_losses.sample_anchors` seeds from the trained content only, so padding and packing do not
matter). Each block then lives on the rank holding its anchor token: the anchor embedding is local; labels
and DSpark's previous tokens come from the gathered ids; the teacher logits at p+j, which may sit on
another rank when the block straddles a zigzag chunk border, come through the CP shift (`cp_shift`).

Attention. The block part (the W slots of a block attend each other) is rank-local and initialises the
accumulator, so every row's lse is finite from the start (a block at position 0 sees no trunk key). The
trunk K/V shards then ride the ring exactly as the TTT trunk does (ring_attention.py): at every step each
sequence's local block queries attend the visiting shard's slice of that sequence with the *visiting*
shard's global positions, masked `key_pos < anchor` (ops/block_attention.py states visibility through
positions for exactly this), merged with `merge_lse`. A block whose prefix straddles chunk borders thus
sees every key before its anchor, wherever it lives: exact, nothing dropped. Backward: each part's
backward with the joint (out, lse); the visiting shard's dK/dV shares travel one hop behind it and arrive
home after a full cycle (`ring_attention.ring_bwd_schedule`, shared with the policy ring).

With cp = 1 (group None) the same code trains a packed row on one device: anchors, shifts and trunk
visibility stay inside each sequence of the pack.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist

from ..ops.attention import autocast_inputs, merge_lse
from ..ops.block_attention import block_part_bwd, block_part_fwd, trunk_prefix_bwd, trunk_prefix_fwd
from ..ops.sdpa_adapter import lse_dtype
from .cp import cp_shift
from .ring_attention import ring_bwd_schedule, ring_fwd_schedule
from .zigzag import ZigzagLayout

__all__ = ["BlockCP", "ring_block_attention"]

_KV_TAG, _DKV_TAG = 2, 3  # distinct from ring_attention's tags: the policy's ring never interleaves, but be safe


class BlockCP:
    """The block drafter's share of a `layout.ZigzagPack`: its plan (anchors, labels, teacher gather, attention)
    on `layout`'s zigzag shards over `group` (the CP group; None when layout.cp == 1)."""

    def __init__(self, group, layout: ZigzagLayout):
        self.group, self.layout = group, layout

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T_local) of every rank of the group -> the packed (B, T_global), padding dropped."""
        lay = self.layout
        parts = [x]
        if lay.cp > 1:
            parts = [torch.empty_like(x) for _ in range(lay.cp)]
            dist.all_gather(parts, x.contiguous(), group=self.group)
        return lay.unshard(parts, dim=1)

    def plan(self, tokens: torch.Tensor, target_mask: torch.Tensor, num_anchors: int, gamma: int, *, local):
        """This rank's blocks: per sequence, the single-process anchors of that sequence that fall here.

        `local` is the single-process plan (train.block_losses.local_plan, passed in by the step: parallel/
        never imports train/); the result is of its type (a BlockPlan).

        Blocks are grouped by sequence (the ring attends each group to its own sequence's keys only); rows
        of B with fewer blocks of a sequence here are padded with invalid blocks (valid = 0, anchor = a token
        of that sequence). A rank with no block at all gets one invalid block, so its shapes stay non-empty
        while it still takes part in every collective."""
        lay = self.layout
        cp, r = lay.cp, lay.rank
        toks, mask = self._gather(tokens), self._gather(target_mask)
        cu = lay.cu_seqlens
        parts, ranges, n = [], [], 0
        for (a, b), s, c in zip(zip(cu, cu[1:]), lay.local_cu_seqlens, lay.chunks):
            if b == a:
                continue
            pl = local(toks[:, a:b], mask[:, a:b], num_anchors, gamma)
            plan_cls = type(pl)
            p = pl.anchors  # (B, N) positions within the sequence
            k = p // c  # zigzag chunk of the anchor: on rank k (front) or 2cp-1-k (back)
            owner = torch.where(k < cp, k, 2 * cp - 1 - k)
            loc = s + torch.where(k < cp, 0, c) + p - k * c  # its local token index on the owner
            mine = owner == r
            m = int(mine.sum(1).max())
            if m == 0:
                continue
            order = (~mine).long().argsort(dim=1, stable=True)[:, :m]  # (B, m): this rank's blocks first, in order
            keep = mine.gather(1, order)
            g3 = order[..., None].expand(-1, -1, gamma)
            parts.append((torch.where(keep, loc.gather(1, order), torch.full_like(order, s)),
                          pl.valid.gather(1, g3) * keep[..., None], pl.labels.gather(1, g3), pl.prev.gather(1, g3)))
            ranges.append((n, n + m, s, c))
            n += m
        if n == 0:
            B, dev = tokens.shape[0], tokens.device
            s, c = lay.seq_slices()[0]
            z = torch.zeros(B, 1, gamma, dtype=torch.long, device=dev)
            parts.append((torch.full((B, 1), s, dtype=torch.long, device=dev),
                          torch.zeros(B, 1, gamma, dtype=mask.dtype if mask.is_floating_point() else torch.float32,
                                      device=dev), z, z))
            ranges.append((0, 1, s, c))
        anchors, valid, labels, prev = (torch.cat([pt[i] for pt in parts], dim=1) for i in range(4))

        def teacher(logits: torch.Tensor) -> torch.Tensor:
            """(B, T_local, V) detached -> (B, N, γ, V): logits at p+j through the CP shift (a collective)."""
            idx = anchors[..., None].expand(-1, -1, logits.shape[-1])
            return torch.stack([cp_shift(logits, j, self.group, lay).gather(1, idx) for j in range(gamma)], dim=2)

        attn = functools.partial(ring_block_attention, group=self.group, layout=lay, ranges=tuple(ranges))
        return plan_cls(anchors, valid.float() if not valid.is_floating_point() else valid, labels, prev,
                         teacher, attn)


def _trunk_blocks(ranges, W):
    """(query rows of the flattened N·W slots, key columns of the local token dim) per sequence."""
    for n0, n1, s, c in ranges:
        yield slice(n0 * W, n1 * W), slice(s, s + 2 * c)


class RingBlockAttention(torch.autograd.Function):
    """(out, lse) of block part ⊕ the ring of trunk shards; backward with the joint (out, lse)."""

    @staticmethod
    def forward(ctx, q, k_trunk, v_trunk, k_block, v_block, anchor_pos, group, layout, ranges, scale):
        B, H, N, W, D = q.shape
        md = lse_dtype(q)
        k_trunk, v_trunk = k_trunk.contiguous(), v_trunk.contiguous()  # they travel
        out_b, lse_b = block_part_fwd(q, k_block, v_block, None, scale)
        acc = out_b.reshape(B, H, N * W, D).to(md).clone()
        lse = lse_b.reshape(B, H, N * W).to(md).clone()
        limit = anchor_pos[:, :, None].expand(B, N, W).reshape(B, N * W)  # every slot of block n: keys < p_n
        qm = q.reshape(B, H, N * W, D).to(md)  # trunk outputs in the accumulator's dtype
        cp, r = layout.cp, layout.rank

        def step_fn(step, k_s, v_s):
            kp = layout.for_rank((r - step) % cp).positions(q.device)  # the visiting shard's global positions
            for rows, cols in _trunk_blocks(ranges, W):
                o, l = trunk_prefix_fwd(qm[:, :, rows], k_s[:, :, cols], v_s[:, :, cols],
                                        kp[cols].expand(B, -1), limit[:, rows], scale)
                merge_lse(acc[:, :, rows], lse[:, :, rows], o, l, inplace=True, impl="torch")

        ring_fwd_schedule(k_trunk, v_trunk, group, cp, step_fn, _KV_TAG)
        out = acc.to(q.dtype)
        ctx.save_for_backward(q, k_trunk, v_trunk, k_block, v_block, limit, out, lse)
        ctx.group, ctx.layout, ctx.ranges, ctx.scale = group, layout, ranges, scale
        lse = lse.reshape(B, H, N, W)
        ctx.mark_non_differentiable(lse)
        return out.reshape(B, H, N, W, D), lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, k_block, v_block, limit, out, lse = ctx.saved_tensors
        layout, ranges, scale = ctx.layout, ctx.ranges, ctx.scale
        B, H, N, W, D = q.shape
        md = lse_dtype(q)
        dq_b, dk_b, dv_b = block_part_bwd(dout, q, k_block, v_block, out.reshape(B, H, N, W, D),
                                          lse.reshape(B, H, N, W), None, scale)
        qm, dof = q.reshape(B, H, N * W, D).to(md), dout.reshape(B, H, N * W, D).contiguous()
        dq = torch.zeros(B, H, N * W, D, dtype=md, device=q.device)
        cp, r = layout.cp, layout.rank

        def step_shares(step, k_s, v_s):  # the trunk blocks against the shard of rank r - step
            kp = layout.for_rank((r - step) % cp).positions(q.device)
            shares = []
            for rows, cols in _trunk_blocks(ranges, W):
                dq_s, dk_s, dv_s = trunk_prefix_bwd(dof[:, :, rows], qm[:, :, rows], k_s[:, :, cols],
                                                    v_s[:, :, cols], kp[cols].expand(B, -1), limit[:, rows],
                                                    out[:, :, rows], lse[:, :, rows], scale)
                dq[:, :, rows] += dq_s
                shares.append((cols, dk_s, dv_s))
            return shares

        dk, dv = ring_bwd_schedule(k, v, ctx.group, cp, md, step_shares, tags=(_KV_TAG, _DKV_TAG))
        dq = (dq.reshape(B, H, N, W, D) + dq_b.to(md)).to(q.dtype)
        return dq, dk.to(k.dtype), dv.to(v.dtype), dk_b, dv_b, None, None, None, None, None


def ring_block_attention(q, k_trunk, v_trunk, k_block, v_block, key_pos, anchor_pos, key_valid=None, scale=None,
                         *, group=None, layout: ZigzagLayout | None = None, ranges=(), return_lse=False):
    """CP version of `ops.block_attention.block_attention` (the `attn` of BlockDraft.forward), its signature
    once group/layout/ranges are bound (`BlockCP.plan` does that).

    q (B, H, N, W, D) this rank's blocks, grouped by sequence as `ranges` = ((n0, n1, local start, c), ...)
    says; k_trunk, v_trunk (B, Hkv, T_local, D) this rank's zigzag trunk shards; key_pos (B, T_local) must be
    the layout's positions (visiting shards bring their own); anchor_pos (B, N) within-sequence positions.
    """
    if layout is None:
        raise ValueError("ring block attention needs the batch's ZigzagLayout")
    if key_valid is not None:
        raise ValueError("ring block attention trains full blocks (key_valid=None): padded slots are masked in the loss")
    if k_trunk.shape[2] != layout.num_local or key_pos.shape[-1] != layout.num_local:
        raise ValueError(f"trunk has {k_trunk.shape[2]} local tokens but the layout expects {layout.num_local}")
    if layout.cp > 1 and (dist.get_world_size(group), dist.get_rank(group)) != (layout.cp, layout.rank):
        raise ValueError(f"layout is for rank {layout.rank} of cp={layout.cp} but the group has rank "
                         f"{dist.get_rank(group)} of {dist.get_world_size(group)}: pass the CP group")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    (q, k_trunk, v_trunk, k_block, v_block), no_autocast = autocast_inputs(q, k_trunk, v_trunk, k_block, v_block)
    with no_autocast:
        out, lse = RingBlockAttention.apply(q, k_trunk, v_trunk, k_block, v_block, anchor_pos, group, layout,
                                            tuple(ranges), scale)
    return (out, lse) if return_lse else out
