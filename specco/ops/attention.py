"""Exact trunk + branch attention for EAGLE-3 training-time test (DESIGN §2, §3).

Every attention *part* (a set of keys a query attends to) returns `(out, lse)`; parts over disjoint key
sets combine exactly with `merge_lse`, and each part's backward is its ordinary attention backward
evaluated with the *joint* (out, lse). That is the whole trick behind ring attention too, so the pieces
here — `block_attn_fwd/bwd` (re-exported from the adapter), `branch_attn_fwd/bwd`, `merge_lse` — are the
ones specco/parallel's ring loop plugs together.

TTT semantics, pass d (1-based), query at anchor i:
    trunk  = pass-1 K/V at positions j <= i              (causal block, S keys)
    branch = pass-p K/V for p = 2..d at anchor i only    (P = d-1 keys per anchor, the "diagonal")
Pass 1 has no branch: it is plain causal attention through the same path.
"""

from __future__ import annotations

import math

import torch

from specco.ops.sdpa_adapter import block_attn_bwd, block_attn_fwd

__all__ = [
    "merge_lse", "block_attn_fwd", "block_attn_bwd", "branch_attn_fwd", "branch_attn_bwd",
    "TTTAttention", "ttt_attention",
]


def merge_lse(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of two attention parts over disjoint key sets A and B (the only definition in specco).

        lse = logaddexp(lse_a, lse_b)                                  = log Σ_{j∈A∪B} exp(s_j)
        out = exp(lse_a - lse) · out_a + exp(lse_b - lse) · out_b      = Σ_{j∈A∪B} softmax(s)_j v_j

    because out_a = Σ_A exp(s_j - lse_a) v_j, so exp(lse_a - lse)·out_a = Σ_A exp(s_j - lse) v_j.
    Shapes: out (B, H, S, D), lse (B, H, S). Math in fp32 (at least); the result has the promoted dtype
    of out_a and out_b, so a ring loop that keeps an fp32 accumulator in `out_a` stays in fp32.
    A part with no visible key for a row must carry lse = -inf there (its weight is then exactly 0);
    at least one part per row must be non-empty.
    """
    md = torch.promote_types(torch.promote_types(lse_a.dtype, lse_b.dtype), torch.float32)
    lse_a, lse_b = lse_a.to(md), lse_b.to(md)
    lse = torch.logaddexp(lse_a, lse_b)
    w_a = torch.exp(lse_a - lse).unsqueeze(-1)  # (B, H, S, 1)
    w_b = torch.exp(lse_b - lse).unsqueeze(-1)
    out = w_a * out_a.to(md) + w_b * out_b.to(md)
    return out.to(torch.promote_types(out_a.dtype, out_b.dtype)), lse


# --------------------------------------------------------------------------------------------------
# Branch part: each anchor's own P = d-1 keys. Tiny (P <= K-1, typically <= 6), so closed form in fp32
# beats any kernel launch and keeps bf16 training exact where it matters (the softmax over few keys).
# --------------------------------------------------------------------------------------------------

def _branch_math_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _group_q(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """(B, H, S, D) -> (B, Hkv, G, S, D): query head h = kv_head·G + g (repeat_interleave convention)."""
    B, H, S, D = x.shape
    return x.reshape(B, hkv, H // hkv, S, D)


def _branch_fwd(q, k_br, v_br, scale):
    """Closed-form branch attention in fp32 (fp64 for fp64 q); returns (out (B,H,S,D), lse (B,H,S))."""
    md = _branch_math_dtype(q)
    B, H, S, D = q.shape
    qg = _group_q(q.to(md), k_br.shape[1])  # (B, Hkv, G, S, D)
    s = torch.einsum("bhgsd,bhspd->bhgsp", qg, k_br.to(md)) * scale  # (B, Hkv, G, S, P)
    lse = torch.logsumexp(s, dim=-1)  # (B, Hkv, G, S)
    p = torch.exp(s - lse.unsqueeze(-1))
    out = torch.einsum("bhgsp,bhspd->bhgsd", p, v_br.to(md))
    return out.reshape(B, H, S, D), lse.reshape(B, H, S)


def _branch_bwd(dout, q, k_br, v_br, out_joint, lse_joint, scale):
    """Branch share of the joint gradient (DESIGN §3 identity), fp32/fp64 results, dk/dv (B,Hkv,S,P,D)."""
    md = _branch_math_dtype(q)
    B, H, S, D = q.shape
    hkv = k_br.shape[1]
    qg = _group_q(q.to(md), hkv)  # (B, Hkv, G, S, D)
    dog = _group_q(dout.to(md), hkv)
    kb, vb = k_br.to(md), v_br.to(md)  # (B, Hkv, S, P, D)
    s = torch.einsum("bhgsd,bhspd->bhgsp", qg, kb) * scale
    p = torch.exp(s - lse_joint.to(md).reshape(B, hkv, H // hkv, S, 1))  # joint-normalised
    Dj = (dog * _group_q(out_joint.to(md), hkv)).sum(-1, keepdim=True)  # (B, Hkv, G, S, 1)
    dv = torch.einsum("bhgsp,bhgsd->bhspd", p, dog)  # summing over g = GQA reduction
    ds = p * (torch.einsum("bhgsd,bhspd->bhgsp", dog, vb) - Dj) * scale
    dq = torch.einsum("bhgsp,bhspd->bhgsd", ds, kb).reshape(B, H, S, D)
    dk = torch.einsum("bhgsp,bhgsd->bhspd", ds, qg)
    return dq, dk, dv


def branch_attn_fwd(q_d: torch.Tensor, k_br: torch.Tensor, v_br: torch.Tensor, scale: float | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Branch part of a pass-d query: anchor i attends only to its own P keys k_br[:, :, i].

    q_d (B, H, S, D); k_br, v_br (B, Hkv, S, P, D). With s_p = scale · q_i · k_{i,p}:
        lse_i = logsumexp_p s_p,   out_i = Σ_p exp(s_p - lse_i) v_{i,p}
    Computed in fp32 (fp64 for fp64 inputs); out cast to q's dtype, lse (B, H, S) stays fp32/fp64.
    """
    scale = 1.0 / math.sqrt(q_d.shape[-1]) if scale is None else float(scale)
    out, lse = _branch_fwd(q_d, k_br, v_br, scale)
    return out.to(q_d.dtype), lse


def branch_attn_bwd(dout: torch.Tensor, q_d: torch.Tensor, k_br: torch.Tensor, v_br: torch.Tensor,
                    out_joint: torch.Tensor, lse_joint: torch.Tensor, scale: float | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Branch share of the joint gradient, closed form in fp32:

        D = rowsum(dout ⊙ out_joint),  p_p = exp(s_p - lse_joint),  dv_p = p_p · dout,
        ds_p = p_p (dout · v_p - D) · scale,  dq = Σ_p ds_p k_p,  dk_p = ds_p q.
    Returns (dq (B,H,S,D), dk_br, dv_br (B,Hkv,S,P,D)) in the inputs' dtypes.
    """
    scale = 1.0 / math.sqrt(q_d.shape[-1]) if scale is None else float(scale)
    dq, dk, dv = _branch_bwd(dout, q_d, k_br, v_br, out_joint, lse_joint, scale)
    return dq.to(q_d.dtype), dk.to(k_br.dtype), dv.to(v_br.dtype)


# --------------------------------------------------------------------------------------------------
# TTT attention = causal trunk block ⊕ branch diagonal, one custom autograd node.
# --------------------------------------------------------------------------------------------------

class TTTAttention(torch.autograd.Function):
    """Forward: (out, lse) of trunk ⊕ branch. Backward: each part's backward with the joint (out, lse).

    lse is returned for callers that merge further (e.g. a ring loop) but is marked non-differentiable:
    the §3 identity means no gradient w.r.t. lse is ever needed inside specco.
    """

    @staticmethod
    def forward(ctx, q_d, k_trunk, v_trunk, k_branch, v_branch, scale, impl):
        out_t, lse_t = block_attn_fwd(q_d, k_trunk, v_trunk, True, scale, impl=impl)
        has_branch = k_branch is not None and k_branch.shape[3] > 0
        if has_branch:
            # Keep the branch output in fp32 into the merge: one rounding to q's dtype, at the end.
            out_b, lse_b = _branch_fwd(q_d, k_branch, v_branch, scale)
            out, lse = merge_lse(out_t, lse_t, out_b, lse_b)
            out = out.to(q_d.dtype)
        else:
            out, lse = out_t, lse_t
        # out in q's dtype is what every kernel backward reads for D = rowsum(dout ⊙ out).
        ctx.save_for_backward(q_d, k_trunk, v_trunk, k_branch if has_branch else None,
                              v_branch if has_branch else None, out, lse)
        ctx.scale, ctx.impl, ctx.has_branch = scale, impl, has_branch
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q_d, k_trunk, v_trunk, k_branch, v_branch, out, lse = ctx.saved_tensors
        dq, dk, dv = block_attn_bwd(dout, q_d, k_trunk, v_trunk, out, lse, True, ctx.scale, impl=ctx.impl)
        dkb = dvb = None
        if ctx.has_branch:
            dq_b, dkb, dvb = _branch_bwd(dout, q_d, k_branch, v_branch, out, lse, ctx.scale)
            dq = (dq.to(dq_b.dtype) + dq_b).to(q_d.dtype)  # sum the two shares before rounding
            dkb, dvb = dkb.to(k_branch.dtype), dvb.to(v_branch.dtype)
        return dq, dk, dv, dkb, dvb, None, None


def ttt_attention(q_d: torch.Tensor, k_trunk: torch.Tensor, v_trunk: torch.Tensor,
                  k_branch: torch.Tensor | None = None, v_branch: torch.Tensor | None = None,
                  scale: float | None = None, *, return_lse: bool = False, impl: str | None = None):
    """Pass-d TTT attention: trunk (pass-1 K/V, causal) ⊕ branch (own anchor's pass-2..d K/V).

    q_d (B, H, S, D); k_trunk, v_trunk (B, Hkv, S, D); k_branch, v_branch (B, Hkv, S, P, D) with
    P = d-1, or None for pass 1. scale defaults to 1/sqrt(D). Returns out (B, H, S, D) in q's dtype,
    plus lse (B, H, S) (fp32; fp64 for fp64 inputs) when return_lse. `impl` forces an adapter kernel (tests).
    """
    scale = 1.0 / math.sqrt(q_d.shape[-1]) if scale is None else float(scale)
    out, lse = TTTAttention.apply(q_d, k_trunk, v_trunk, k_branch, v_branch, scale, impl)
    return (out, lse) if return_lse else out
