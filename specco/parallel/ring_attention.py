"""Zigzag ring attention: causal trunk over the CP group ⊕ rank-local TTT branch (docs/DESIGN.md §3, §4).

Each rank holds, per sequence, its front chunk F (global chunk r) and back chunk Bk (chunk 2cp−1−r)
of q, k, v (zigzag.py). The pass-1 trunk K/V shards ride the ring; at step s rank r holds the shard
of src = (r − s) mod cp, and which of its queries see which of the arriving keys follows from the
chunk order alone (chunk ids: r < 2cp−1−r, and src's are src < 2cp−1−src):

    step 0 ("local"): the local shard itself. Local order [F; Bk] is sorted by global position, so
                      this is ONE causal square block over the 2c local tokens.
    src < r ("front"): src's front chunk precedes both local chunks and its back chunk follows both:
                      ALL 2c local queries × src's FRONT chunk (c keys), no mask.
    src > r ("back"):  src's two chunks both lie strictly between chunk r and chunk 2cp−1−r:
                      only the local BACK chunk (c queries) × ALL 2c arriving keys, no mask.

Every step yields a partial (out, lse) merged into an fp32 accumulator with `merge_lse` (the one
merge definition). Per rank the work is 1 causal (2c)² block + (cp−1) blocks of 2c·c scores —
the same on every rank, which is the point of zigzag.

TTT: the branch keys of a pass-d query live at its own anchor, hence on its own rank: they are
attended locally and merged with the ring result (`branch_merge_fwd`, one fused pass) — no communication.

Backward (the §3 identity): each block's backward, evaluated with the JOINT (out, lse) and dout,
is exactly that block's share of the gradient. K/V travel the ring again; the dK/dV of a visiting
shard accumulate in an fp32 buffer that travels with it (one hop behind), each rank adding its share
in place, and arrives home after a full cycle. No rank ever holds more than its own shard plus one
visiting shard of K/V.

Packing: attention never crosses a sequence border — blocks are per sequence (a Python loop: fine
for correctness on CPU; the long single-sequence case, one block per step, is the performance case).
Padding needs no mask (zigzag.py). GQA: k/v have Hkv heads (the adapter handles GQA natively), so the
ring moves Hkv-head shards.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..ops.attention import (autocast_inputs, block_attn_bwd, block_attn_fwd, branch_bwd_into, branch_merge_fwd,
                             merge_lse)
from ..ops.sdpa_adapter import lse_dtype
from .comm import RingComm
from .zigzag import ZigzagLayout

__all__ = ["ring_causal_attention", "ring_ttt_attention", "RingTTTAttention", "step_kind",
           "fwd_step", "bwd_step", "add_shares"]

_KV_TAG, _DKV_TAG = 0, 1
# merge_lse's impl for the per-step merge: None = fused Triton on CUDA; bench/cp_kernels.py sets "torch"
# to measure what the fused kernel saves.
MERGE_IMPL: str | None = None


def step_kind(step: int, rank: int, cp: int) -> str:
    """Which blocks ring step `step` computes on rank `rank` (module docstring): local/front/back."""
    if step == 0:
        return "local"
    return "front" if (rank - step) % cp < rank else "back"


def _blocks(kind: str, layout: ZigzagLayout):
    """Per sequence: (query rows, key rows, causal) as slices of the local token dimension."""
    for s, c in layout.seq_slices():
        if kind == "local":
            yield slice(s, s + 2 * c), slice(s, s + 2 * c), True
        elif kind == "front":
            yield slice(s, s + 2 * c), slice(s, s + c), False
        else:  # "back"
            yield slice(s + c, s + 2 * c), slice(s, s + 2 * c), False


# --------------------------------------------------------------------------------------------------
# One ring step, forward and backward. Public so bench/cp_attention.py can replay one rank's steps
# on one GPU without communication.
# --------------------------------------------------------------------------------------------------

def fwd_step(kind: str, q, k_src, v_src, out_acc, lse_acc, layout: ZigzagLayout, scale: float,
             impl: str | None = None) -> None:
    """Attend q to the visiting shard (k_src, v_src) and merge into (out_acc, lse_acc) in place.

    q (B, H, T, D); k_src, v_src (B, Hkv, T, D); out_acc (B, H, T, D) and lse_acc (B, H, T) in fp32
    (fp64 for fp64). Step 0 *initialises* the accumulator: every row sees at least its own key there,
    so afterwards every lse is finite and later merges never see −inf on both sides.
    """
    for rows, cols, causal in _blocks(kind, layout):
        o, l = block_attn_fwd(q[:, :, rows], k_src[:, :, cols], v_src[:, :, cols], causal, scale, impl=impl)
        if kind == "local":
            out_acc[:, :, rows], lse_acc[:, :, rows] = o, l
        else:  # in place on the accumulator's row view: no fp32 temporaries of the whole block
            merge_lse(out_acc[:, :, rows], lse_acc[:, :, rows], o, l, inplace=True, impl=MERGE_IMPL)


def bwd_step(kind: str, dout, q, k_src, v_src, out, lse, dq_acc, layout: ZigzagLayout, scale: float,
             impl: str | None = None) -> list:
    """This step's share of the joint gradient: dq_acc += ...; returns the visiting shard's dK/dV shares.

    out/lse are the JOINT statistics (ring ⊕ branch) of the local queries; dq_acc (B, H, T, D) is the
    fp32 accumulator (fp64 for fp64). Returns [(cols, dk, dv)] per block, dk/dv (B, Hkv, len(cols), D) in
    the kernel's dtype (or fp32 where the adapter summed GQA heads): `add_shares` adds them into the
    travelling fp32 buffer, so no zero-filled per-step buffer is needed.
    """
    shares = []
    for rows, cols, causal in _blocks(kind, layout):
        # grad_dtype: a GQA head sum left to the adapter lands in fp32 without a bf16 rounding
        dq, dk, dv = block_attn_bwd(dout[:, :, rows], q[:, :, rows], k_src[:, :, cols], v_src[:, :, cols],
                                    out[:, :, rows], lse[:, :, rows], causal, scale, impl=impl,
                                    grad_dtype=dq_acc.dtype)
        dq_acc[:, :, rows] += dq
        shares.append((cols, dk, dv))
    return shares


def add_shares(dk_acc, dv_acc, shares) -> None:
    """dk_acc/dv_acc (B, Hkv, T, D) fp32 += one step's shares (bwd_step's list), in place."""
    for cols, dk, dv in shares:
        dk_acc[:, :, cols] += dk
        dv_acc[:, :, cols] += dv


# --------------------------------------------------------------------------------------------------
# Ring loops: post -> compute -> wait -> swap.
# --------------------------------------------------------------------------------------------------

def ring_fwd_schedule(k, v, group, cp: int, step_fn, tag=_KV_TAG) -> None:
    """The ring forward's schedule: at step s, post K/V to the next rank (the prefetch for s+1), run
    `step_fn(s, k_s, v_s)` on the shard held (that of rank r − s), then wait and swap. Used by the policy's
    ring (`_ring_fwd`) and the block drafter's trunk ring (parallel/block_cp.py)."""
    comm = RingComm(group, tag) if cp > 1 else None
    kv = [k, v]
    for step in range(cp):
        if step + 1 < cp:
            nxt = comm.send_recv(kv)  # prefetch the shard we attend to next
            comm.commit()
        step_fn(step, kv[0], kv[1])
        if step + 1 < cp:
            comm.wait()
            kv = nxt
    assert comm is None or comm.idle, "ring forward left a transfer in flight"


def _ring_fwd(q, k, v, group, layout, scale, impl):
    B, H, T, D = q.shape
    md = lse_dtype(q)
    out_acc = q.new_empty(B, H, T, D, dtype=md)
    lse_acc = q.new_empty(B, H, T, dtype=md)

    def step_fn(step, k_s, v_s):
        fwd_step(step_kind(step, layout.rank, layout.cp), q, k_s, v_s, out_acc, lse_acc, layout, scale, impl)

    ring_fwd_schedule(k, v, group, layout.cp, step_fn)
    return out_acc, lse_acc


def ring_bwd_schedule(k, v, group, cp: int, md: torch.dtype, step_shares, tags=(_KV_TAG, _DKV_TAG)):
    """The ring backward's schedule; returns this rank's own dK, dV (B, Hkv, T, D) in `md`. `tags`: the
    K/V and dK/dV message tags (default: the policy ring's own).

    `step_shares(step, k_s, v_s)` does step s's work on the K/V shard held then (that of rank r − s): it
    adds its dQ in place wherever its caller keeps dQ, and returns this rank's dK/dV shares for that shard,
    [(cols, dk, dv), ...]. At step s:
        post K/V(src) -> next                      (prefetch for step s+1)
        compute: shares = step_shares(s, K/V(src))
        s = 0:  start src's (= our own shard's) travelling buffer: zeros + shares
        s > 0:  wait dKV(src) from prev (posted at s−1, holding ranks src..r−1's shares); add ours in place
        post dKV(src) -> next,  dKV(src−1) <- prev (the buffer that travels one hop behind its K/V)
        wait K/V; swap
    After step cp−1 the last dKV received is for src = r − cp = r: our own shard, all cp shares.
    Shares are added straight into the arriving buffer: one add per block and step, no per-step zeros.
    Used by the policy's ring (`_ring_bwd`) and the block drafter's trunk ring (parallel/block_cp.py).
    """
    kv_comm = RingComm(group, tags[0]) if cp > 1 else None
    dkv_comm = RingComm(group, tags[1]) if cp > 1 else None
    kv, dkv = [k, v], None
    for step in range(cp):
        if step + 1 < cp:
            nxt = kv_comm.send_recv(kv)
            kv_comm.commit()
        shares = step_shares(step, kv[0], kv[1])
        if step == 0:
            dkv = [torch.zeros(k.shape, dtype=md, device=k.device),  # (B, Hkv, T, D)
                   torch.zeros(v.shape, dtype=md, device=v.device)]
        else:
            dkv_comm.wait()  # the travelling dK/dV of the shard we just used
        add_shares(dkv[0], dkv[1], shares)
        if cp == 1:
            break
        dkv = dkv_comm.send_recv(dkv)
        dkv_comm.commit()
        if step + 1 < cp:
            kv_comm.wait()
            kv = nxt
    if cp > 1:
        dkv_comm.wait()  # our own shard's dK/dV, home after a full cycle
        assert kv_comm.idle and dkv_comm.idle, "ring backward left a transfer in flight"
    return dkv[0], dkv[1]


def _ring_bwd(dout, q, k, v, out, lse, group, layout, scale, impl):
    """Returns fp32 dq (B, H, T, D) and this rank's own dk, dv (B, Hkv, T, D), fp32 (`ring_bwd_schedule`)."""
    md = lse_dtype(q)
    dq_acc = torch.zeros(q.shape, dtype=md, device=q.device)

    def step_shares(step, k_s, v_s):
        return bwd_step(step_kind(step, layout.rank, layout.cp), dout, q, k_s, v_s, out, lse, dq_acc,
                        layout, scale, impl)

    dk, dv = ring_bwd_schedule(k, v, group, layout.cp, md, step_shares)
    return dq_acc, dk, dv


class RingTTTAttention(torch.autograd.Function):
    """(out, lse) of ring trunk ⊕ local branch; backward with the joint (out, lse). lse is non-differentiable
    (no gradient w.r.t. lse is ever needed, §3)."""

    @staticmethod
    def forward(ctx, q, k, v, k_branch, v_branch, group, layout, scale, impl):
        # One copy up front instead of one per block: k/v travel (sends need contiguous buffers) and
        # the policy's q/k/v arrive as (B, S, H, D)-ordered views of (B, H, S, D).
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out_acc, lse_acc = _ring_fwd(q, k, v, group, layout, scale, impl)
        has_branch = k_branch is not None and k_branch.shape[3] > 0
        # The kernels read out in q's dtype for D = rowsum(dout ⊙ out). With a branch, branch ⊕ merge ⊕
        # that rounding are one fused pass over the fp32 accumulator (Triton on CUDA, its twin elsewhere).
        if has_branch:
            out, lse_acc = branch_merge_fwd(q, k_branch, v_branch, out_acc, lse_acc, scale, q.dtype)
        else:
            out = out_acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, k_branch if has_branch else None, v_branch if has_branch else None,
                              out, lse_acc)
        ctx.group, ctx.layout, ctx.scale, ctx.impl, ctx.has_branch = group, layout, scale, impl, has_branch
        ctx.mark_non_differentiable(lse_acc)
        return out, lse_acc

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, k_branch, v_branch, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = _ring_bwd(dout, q, k, v, out, lse, ctx.group, ctx.layout, ctx.scale, ctx.impl)
        dkb = dvb = None
        if ctx.has_branch:  # branch share added into the fp32 dq: one rounding below
            dkb, dvb = branch_bwd_into(dout, q, k_branch, v_branch, out, lse, dq, ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dkb, dvb, None, None, None, None


def ring_ttt_attention(q, k_trunk, v_trunk, k_branch=None, v_branch=None, group=None, layout=None, *,
                       scale: float | None = None, return_lse: bool = False, impl: str | None = None):
    """CP version of `ops.attention.ttt_attention` (the `attn` argument of `ttt_forward`).

    q (B, H, T_local, D); k_trunk, v_trunk (B, Hkv, T_local, D) — this rank's zigzag shards;
    k_branch, v_branch (B, Hkv, T_local, P, D) or None (pass 1). `group`: the CP process group
    (None only when layout.cp == 1); `layout`: this batch's ZigzagLayout for this rank.
    Returns out (B, H, T_local, D) in q's dtype (+ lse (B, H, T_local) fp32 when return_lse).
    """
    if layout is None:
        raise ValueError("ring attention needs the batch's ZigzagLayout")
    if q.shape[2] != layout.num_local:
        raise ValueError(f"q has {q.shape[2]} local tokens but the layout expects {layout.num_local}")
    if layout.cp > 1 and (dist.get_world_size(group), dist.get_rank(group)) != (layout.cp, layout.rank):
        raise ValueError(f"layout is for rank {layout.rank} of cp={layout.cp} but the group has rank "
                         f"{dist.get_rank(group)} of {dist.get_world_size(group)}: pass the CP group")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    (q, k_trunk, v_trunk, k_branch, v_branch), no_autocast = autocast_inputs(q, k_trunk, v_trunk, k_branch, v_branch)
    with no_autocast:
        out, lse = RingTTTAttention.apply(q, k_trunk, v_trunk, k_branch, v_branch, group, layout, scale, impl)
    return (out, lse) if return_lse else out


def ring_causal_attention(q, k, v, group=None, layout=None, scale: float | None = None):
    """CP causal attention with the signature of an attention core once group/layout are bound
    (cp.cp_core does that; `Policy.forward(attn_core=...)`): q (B, H, T_local, D), k/v (B, Hkv, T_local, D)
    -> out (B, H, T_local, D)."""
    return ring_ttt_attention(q, k, v, None, None, group, layout, scale=scale)
