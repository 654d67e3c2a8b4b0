"""Exact block attention for the DFlash / DSpark block drafters (docs/DESIGN.md §2b, §3).

A block drafter trains N blocks per sequence, each of W query slots at positions p, p+1, ..., p+W-1 for
its anchor p. A query of block n sees two disjoint key sets:

    trunk  = the trunk K/V (projected target taps) at positions strictly before the anchor p_n
             (the anchor's own target feature does not exist yet at serving time)
    block  = the W slot K/V of its own block, bidirectionally (every slot sees every valid slot)

Blocks never see each other. Each part returns `(out, lse)`; `merge_lse` (ops/attention.py, the one
definition) combines them, and the backward evaluates each part's ordinary attention backward with the
*joint* (out, lse) — the contract of TTT attention and of the ring (docs/DESIGN.md §3), so under context
parallelism the trunk part below is simply one ring step's work with the visiting shard's key positions.

Trunk visibility is stated through positions, not indices: key j of the trunk is visible to query m iff
`key_pos[b, j] < limit[b, m]`. Without CP key_pos is 0..S-1 and limit the anchor; under CP a visiting
zigzag shard carries its global positions, so a block whose prefix straddles a chunk border is exact.

Kernels: both parts are written here in pure torch, fp32 math (fp64 for fp64 inputs). The block part is
tiny (W <= 16 keys per query), closed form like the TTT branch. The trunk part materialises scores of a
chunk of queries against the S trunk keys (queries chunked to bound memory); it is the twin a fused
masked kernel (flex_attention's mask_mod `key_pos < limit`, on CUDA) would be checked against.
"""

from __future__ import annotations

import math

import torch

from specco.ops.attention import autocast_inputs, merge_lse

__all__ = ["trunk_prefix_fwd", "trunk_prefix_bwd", "block_part_fwd", "block_part_bwd", "BlockAttention",
           "block_attention"]

_NEG_INF = float("-inf")
# Query rows per trunk-score chunk: (B, H, chunk, S) fp32 scores, a few of them live in the backward.
TRUNK_Q_CHUNK = 1024


def _md(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _safe(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (a row that sees no key of this part) replaced by 0, so exp(s - lse) = exp(-inf) = 0
    there instead of exp(-inf + inf) = nan. Such rows then get out = 0, which merge_lse weighs by 0."""
    return torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))


# --------------------------------------------------------------------------------------------------
# Trunk part: queries (B, H, M, D) against trunk keys (B, Hkv, S, D) with a per-query position limit.
# --------------------------------------------------------------------------------------------------

def _trunk_scores(qg, k, key_pos, limit, scale):
    """qg (B, Hkv, G, m, D), k (B, Hkv, S, D) in math dtype -> masked scores (B, Hkv, G, m, S)."""
    s = torch.einsum("bhgmd,bhsd->bhgms", qg, k) * scale
    visible = key_pos[:, None, :] < limit[:, :, None]  # (B, m, S)
    return s.masked_fill(~visible[:, None, None], _NEG_INF)


def trunk_prefix_fwd(q, k, v, key_pos, limit, scale=None):
    """Trunk part: query m sees trunk key j iff key_pos[b, j] < limit[b, m].

    q (B, H, M, D); k, v (B, Hkv, S, D); key_pos (B, S) int; limit (B, M) int.
        s = scale · q kᵀ (masked),  lse = logsumexp_j s,  out = softmax(s) v
    Rows with no visible key get out = 0 and lse = -inf (weight 0 in merge_lse).
    Returns out (B, H, M, D) in q's dtype and lse (B, H, M) in fp32 (fp64 for fp64 q).
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    md = _md(q)
    B, H, M, D = q.shape
    Hkv = k.shape[1]
    km, vm = k.to(md), v.to(md)
    outs, lses = [], []
    for a in range(0, M, TRUNK_Q_CHUNK):
        e = min(M, a + TRUNK_Q_CHUNK)
        qg = q[:, :, a:e].to(md).reshape(B, Hkv, H // Hkv, e - a, D)  # query head h = kv_head·G + g
        s = _trunk_scores(qg, km, key_pos, limit[:, a:e], scale)
        lse = torch.logsumexp(s, dim=-1)  # (B, Hkv, G, m)
        p = torch.exp(s - _safe(lse).unsqueeze(-1))
        outs.append(torch.einsum("bhgms,bhsd->bhgmd", p, vm).reshape(B, H, e - a, D))
        lses.append(lse.reshape(B, H, e - a))
    return torch.cat(outs, dim=2).to(q.dtype), torch.cat(lses, dim=2)


def trunk_prefix_bwd(dout, q, k, v, key_pos, limit, out_joint, lse_joint, scale=None):
    """Trunk share of the joint gradient (docs/DESIGN.md §3): p = exp(s - lse_joint), D = rowsum(dout ⊙ out_joint),
    dv = pᵀ dout, ds = p ⊙ (dout vᵀ - D)·scale, dq = ds k, dk = dsᵀ q (summed over the G heads of a kv head).
    Returns dq (B, H, M, D), dk, dv (B, Hkv, S, D) in the inputs' dtypes."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    md = _md(q)
    B, H, M, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    km, vm = k.to(md), v.to(md)
    dk = torch.zeros(k.shape, dtype=md, device=k.device)
    dv = torch.zeros(v.shape, dtype=md, device=v.device)
    dqs = []
    for a in range(0, M, TRUNK_Q_CHUNK):
        e = min(M, a + TRUNK_Q_CHUNK)
        grp = lambda x: x[:, :, a:e].to(md).reshape(B, Hkv, G, e - a, D)  # noqa: E731  (B, Hkv, G, m, D)
        qg, dog, og = grp(q), grp(dout), grp(out_joint)
        s = _trunk_scores(qg, km, key_pos, limit[:, a:e], scale)
        # joint lse is finite for every row (the block part always has its anchor slot)
        p = torch.exp(s - lse_joint[:, :, a:e].to(md).reshape(B, Hkv, G, e - a, 1))
        Dj = (dog * og).sum(-1, keepdim=True)  # (B, Hkv, G, m, 1)
        dv += torch.einsum("bhgms,bhgmd->bhsd", p, dog)
        ds = p * (torch.einsum("bhgmd,bhsd->bhgms", dog, vm) - Dj) * scale
        dqs.append(torch.einsum("bhgms,bhsd->bhgmd", ds, km).reshape(B, H, e - a, D))
        dk += torch.einsum("bhgms,bhgmd->bhsd", ds, qg)
    return torch.cat(dqs, dim=2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# --------------------------------------------------------------------------------------------------
# Block part: the W slots of each block attend each other (bidirectional), closed form.
# --------------------------------------------------------------------------------------------------

def _block_scores(qg, k, key_valid, scale):
    """qg (B, Hkv, G, N, W, D), k (B, Hkv, N, W, D) -> scores (B, Hkv, G, N, W_q, W_k), invalid keys -inf."""
    s = torch.einsum("bhgnwd,bhnud->bhgnwu", qg, k) * scale
    if key_valid is not None:
        s = s.masked_fill(~key_valid[:, None, None, :, None, :], _NEG_INF)
    return s


def block_part_fwd(q, k, v, key_valid=None, scale=None):
    """Block part: slot w of block n attends all valid slots u of block n.

    q (B, H, N, W, D); k, v (B, Hkv, N, W, D); key_valid (B, N, W) bool or None (all valid).
    Returns out (B, H, N, W, D) in q's dtype and lse (B, H, N, W) in fp32 (fp64 for fp64 q).
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    md = _md(q)
    B, H, N, W, D = q.shape
    Hkv = k.shape[1]
    qg = q.to(md).reshape(B, Hkv, H // Hkv, N, W, D)
    s = _block_scores(qg, k.to(md), key_valid, scale)
    lse = torch.logsumexp(s, dim=-1)  # (B, Hkv, G, N, W)
    p = torch.exp(s - _safe(lse).unsqueeze(-1))
    out = torch.einsum("bhgnwu,bhnud->bhgnwd", p, v.to(md))
    return out.reshape(B, H, N, W, D).to(q.dtype), lse.reshape(B, H, N, W)


def block_part_bwd(dout, q, k, v, out_joint, lse_joint, key_valid=None, scale=None):
    """Block share of the joint gradient (same formulas as `trunk_prefix_bwd`), closed form.
    Returns dq (B, H, N, W, D), dk, dv (B, Hkv, N, W, D) in the inputs' dtypes."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    md = _md(q)
    B, H, N, W, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    grp = lambda x: x.to(md).reshape(B, Hkv, G, N, W, D)  # noqa: E731  (B, Hkv, G, N, W, D)
    qg, dog, og = grp(q), grp(dout), grp(out_joint)
    km, vm = k.to(md), v.to(md)
    s = _block_scores(qg, km, key_valid, scale)
    p = torch.exp(s - lse_joint.to(md).reshape(B, Hkv, G, N, W, 1))
    Dj = (dog * og).sum(-1, keepdim=True)
    dv = torch.einsum("bhgnwu,bhgnwd->bhnud", p, dog)
    ds = p * (torch.einsum("bhgnwd,bhnud->bhgnwu", dog, vm) - Dj) * scale
    dq = torch.einsum("bhgnwu,bhnud->bhgnwd", ds, km).reshape(B, H, N, W, D)
    dk = torch.einsum("bhgnwu,bhgnwd->bhnud", ds, qg)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# --------------------------------------------------------------------------------------------------
# Block attention = trunk part ⊕ block part, one custom autograd node.
# --------------------------------------------------------------------------------------------------

class BlockAttention(torch.autograd.Function):
    """Forward: (out, lse) of trunk ⊕ block. Backward: each part's backward with the joint (out, lse).

    lse is returned for callers that merge further (a ring loop) and is non-differentiable (§3)."""

    @staticmethod
    def forward(ctx, q, k_trunk, v_trunk, k_block, v_block, key_pos, anchor_pos, key_valid, scale):
        B, H, N, W, D = q.shape
        limit = anchor_pos[:, :, None].expand(B, N, W).reshape(B, N * W)  # every slot of block n: keys < p_n
        out_t, lse_t = trunk_prefix_fwd(q.reshape(B, H, N * W, D), k_trunk, v_trunk, key_pos, limit, scale)
        out_b, lse_b = block_part_fwd(q, k_block, v_block, key_valid, scale)
        out, lse = merge_lse(out_t, lse_t, out_b.reshape(B, H, N * W, D), lse_b.reshape(B, H, N * W))
        out = out.to(q.dtype)  # what D = rowsum(dout ⊙ out) reads, as in TTTAttention
        ctx.save_for_backward(q, k_trunk, v_trunk, k_block, v_block, key_pos, limit, key_valid, out, lse)
        ctx.scale = scale
        lse = lse.reshape(B, H, N, W)
        ctx.mark_non_differentiable(lse)
        return out.reshape(B, H, N, W, D), lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k_trunk, v_trunk, k_block, v_block, key_pos, limit, key_valid, out, lse = ctx.saved_tensors
        B, H, N, W, D = q.shape
        dq_t, dk_t, dv_t = trunk_prefix_bwd(dout.reshape(B, H, N * W, D), q.reshape(B, H, N * W, D), k_trunk,
                                            v_trunk, key_pos, limit, out, lse, ctx.scale)
        dq_b, dk_b, dv_b = block_part_bwd(dout, q, k_block, v_block, out.reshape(B, H, N, W, D),
                                          lse.reshape(B, H, N, W), key_valid, ctx.scale)
        dq = (dq_t.reshape(B, H, N, W, D).to(torch.promote_types(dq_b.dtype, torch.float32)) + dq_b).to(q.dtype)
        return dq, dk_t, dv_t, dk_b, dv_b, None, None, None, None


def block_attention(q, k_trunk, v_trunk, k_block, v_block, key_pos, anchor_pos, key_valid=None, scale=None,
                    *, return_lse=False):
    """Exact block-drafter attention: trunk keys before each block's anchor ⊕ the block's own slots.

    q (B, H, N, W, D) block queries; k_trunk, v_trunk (B, Hkv, S, D) with key positions key_pos (B, S);
    k_block, v_block (B, Hkv, N, W, D); anchor_pos (B, N) the absolute position p_n of block n's anchor;
    key_valid (B, N, W) bool (None: all slots are keys). Slot 0 of every block must be a valid key, so every
    query has at least one key. Returns out (B, H, N, W, D) in q's dtype (+ lse (B, H, N, W) fp32/fp64).
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    (q, k_trunk, v_trunk, k_block, v_block), no_autocast = autocast_inputs(q, k_trunk, v_trunk, k_block, v_block)
    with no_autocast:
        out, lse = BlockAttention.apply(q, k_trunk, v_trunk, k_block, v_block, key_pos, anchor_pos, key_valid,
                                        scale)
    return (out, lse) if return_lse else out
