"""Exact trunk + branch attention for EAGLE-3 training-time test (docs/DESIGN.md §2, §3).

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

import contextlib
import math

import torch

from specco.ops.sdpa_adapter import block_attn_bwd, block_attn_fwd, flash_applies

__all__ = [
    "merge_lse", "block_attn_fwd", "block_attn_bwd", "branch_attn_fwd", "branch_attn_bwd", "prefix_causal_fwd",
    "prefix_causal_bwd",
    "branch_merge_fwd", "branch_bwd_into", "TTTAttention", "ttt_attention", "ttt_trunk_impl",
]


def merge_lse(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor,
              *, inplace: bool = False, impl: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of two attention parts over disjoint key sets A and B (the only definition in specco).

        lse = logaddexp(lse_a, lse_b)                                  = log Σ_{j∈A∪B} exp(s_j)
        out = exp(lse_a - lse) · out_a + exp(lse_b - lse) · out_b      = Σ_{j∈A∪B} softmax(s)_j v_j

    because out_a = Σ_A exp(s_j - lse_a) v_j, so exp(lse_a - lse)·out_a = Σ_A exp(s_j - lse) v_j.
    Shapes: out (B, H, S, D), lse (B, H, S). Math in fp32 (at least); the result has the promoted dtype
    of out_a and out_b, so a ring loop that keeps an fp32 accumulator in `out_a` stays in fp32.
    A part with no visible key for a row must carry lse = -inf there (its weight is then exactly 0);
    at least one part per row must be non-empty.

    inplace=True writes the result into (out_a, lse_a) — an fp32/fp64 accumulator (a view is fine) —
    and returns them: two passes over out_a (scale, then fused multiply-add of out_b) instead of ~six
    for the out-of-place form, which matters once per ring step. On CUDA the in-place merge is one
    Triton pass (`_merge_inplace_kernel`, the same formula with the max subtracted first) instead of
    the eight small kernels below; `impl` = None (Triton where it applies), "triton" or "torch".
    """
    if inplace and _use_triton_merge(out_a, lse_a, out_b, lse_b, impl):
        return _merge_inplace_triton(out_a, lse_a, out_b, lse_b)
    md = torch.promote_types(torch.promote_types(lse_a.dtype, lse_b.dtype), torch.float32)
    lse = torch.logaddexp(lse_a.to(md), lse_b.to(md))
    w_a = torch.exp(lse_a.to(md) - lse).unsqueeze(-1)  # (B, H, S, 1)
    w_b = torch.exp(lse_b.to(md) - lse).unsqueeze(-1)
    if inplace:
        assert out_a.dtype == md and lse_a.dtype == md, "in-place merge needs an fp32/fp64 accumulator"
        out_a.mul_(w_a).addcmul_(w_b, out_b)  # addcmul promotes out_b's bf16 elementwise, no copy
        lse_a.copy_(lse)
        return out_a, lse_a
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
    """Branch share of the joint gradient (docs/DESIGN.md §3 identity), fp32/fp64 results, dk/dv (B,Hkv,S,P,D)."""
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
# Fused branch ⊕ merge (forward) and branch backward. One pass over q/dout/out per call instead of the
# closed form's ~10 (fp32 copies of q, einsum layouts, exp, merge temporaries): the branch is memory-bound
# (P·D MACs per query per pass), so passes are its cost. Two implementations, one meaning:
#   * torch twin  = `_branch_fwd` + `merge_lse` / `_branch_bwd` above (defines the math; CPU and tests);
#   * Triton      = `_branch_merge_fwd_kernel` / `_branch_bwd_kernel` below, selected only on CUDA.
# `_merge_inplace_kernel` is the same idea for the ring's per-step in-place `merge_lse`.
# tests/test_attention_ops.py compares them where Triton can run; the benches check both on the GPU.
# --------------------------------------------------------------------------------------------------

try:  # Triton is optional: absent on CPU-only installs, where the twin runs.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def _use_triton(q: torch.Tensor, k_br: torch.Tensor, impl: str | None) -> bool:
    if impl is not None:
        return impl == "triton"
    D, P = q.shape[-1], k_br.shape[3]
    return (triton is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and D >= 16 and D <= 256 and D & (D - 1) == 0 and 1 <= P <= 16)


if triton is not None:
    @triton.jit
    def _branch_merge_fwd_kernel(Q, K, V, OA, LA, OUT, LSE, S, H, scale,
                                 sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sk_p, sv_b, sv_h, sv_s, sv_p,
                                 so_b, so_h, so_s, sl_b, sl_h, sout_b, sout_h, sout_s, slse_b, slse_h,
                                 G: tl.constexpr, P: tl.constexpr, PP: tl.constexpr, D: tl.constexpr,
                                 BLOCK_S: tl.constexpr):
        """One (query block, b·h): online softmax over [trunk part (out_a, lse_a)] + P branch keys."""
        pid_s, pid_bh = tl.program_id(0), tl.program_id(1)
        b, h = pid_bh // H, pid_bh % H
        hk = h // G
        offs_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
        offs_p, offs_d = tl.arange(0, PP), tl.arange(0, D)
        m_s, m_p = offs_s < S, offs_p < P
        q = tl.load(Q + b * sq_b + h * sq_h + offs_s[:, None] * sq_s + offs_d[None, :],
                    mask=m_s[:, None], other=0.0).to(tl.float32)  # (BS, D)
        m3 = m_s[:, None, None] & m_p[None, :, None]
        k = tl.load(K + b * sk_b + hk * sk_h + offs_s[:, None, None] * sk_s + offs_p[None, :, None] * sk_p
                    + offs_d[None, None, :], mask=m3, other=0.0).to(tl.float32)  # (BS, PP, D)
        sc = tl.sum(q[:, None, :] * k, axis=2) * scale  # (BS, PP) branch scores
        sc = tl.where(m_p[None, :], sc, float("-inf"))
        lse_a = tl.load(LA + b * sl_b + h * sl_h + offs_s, mask=m_s, other=0.0).to(tl.float32)
        m = tl.maximum(lse_a, tl.max(sc, axis=1))
        w_a = tl.exp(lse_a - m)  # trunk mass exp(lse_a) relative to exp(m)
        e = tl.exp(sc - m[:, None])  # (BS, PP); 0 on padded p
        l = w_a + tl.sum(e, axis=1)
        v = tl.load(V + b * sv_b + hk * sv_h + offs_s[:, None, None] * sv_s + offs_p[None, :, None] * sv_p
                    + offs_d[None, None, :], mask=m3, other=0.0).to(tl.float32)
        o_a = tl.load(OA + b * so_b + h * so_h + offs_s[:, None] * so_s + offs_d[None, :],
                      mask=m_s[:, None], other=0.0).to(tl.float32)
        acc = o_a * w_a[:, None] + tl.sum(e[:, :, None] * v, axis=1)
        out = acc / l[:, None]
        tl.store(OUT + b * sout_b + h * sout_h + offs_s[:, None] * sout_s + offs_d[None, :],
                 out.to(OUT.dtype.element_ty), mask=m_s[:, None])
        tl.store(LSE + b * slse_b + h * slse_h + offs_s, m + tl.log(l), mask=m_s)

    @triton.jit
    def _branch_bwd_kernel(Q, K, V, DO, O, LSE, DQ, DK, DV, S, HKV, scale,
                           sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sk_p, sv_b, sv_h, sv_s, sv_p,
                           sdo_b, sdo_h, sdo_s, so_b, so_h, so_s, sl_b, sl_h, sdq_b, sdq_h, sdq_s,
                           sdk_b, sdk_h, sdk_s, sdk_p, sdv_b, sdv_h, sdv_s, sdv_p,
                           G: tl.constexpr, P: tl.constexpr, PP: tl.constexpr, D: tl.constexpr,
                           BLOCK_S: tl.constexpr, DQ_ACCUM: tl.constexpr):
        """One (query block, b·kv head): loops over the G query heads sharing the kv head, so dK/dV of
        the branch keys are reduced in registers (deterministic, no atomics)."""
        pid_s, pid_bh = tl.program_id(0), tl.program_id(1)
        b, hk = pid_bh // HKV, pid_bh % HKV
        offs_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
        offs_p, offs_d = tl.arange(0, PP), tl.arange(0, D)
        m_s, m_p = offs_s < S, offs_p < P
        m3 = m_s[:, None, None] & m_p[None, :, None]
        k = tl.load(K + b * sk_b + hk * sk_h + offs_s[:, None, None] * sk_s + offs_p[None, :, None] * sk_p
                    + offs_d[None, None, :], mask=m3, other=0.0).to(tl.float32)  # (BS, PP, D)
        v = tl.load(V + b * sv_b + hk * sv_h + offs_s[:, None, None] * sv_s + offs_p[None, :, None] * sv_p
                    + offs_d[None, None, :], mask=m3, other=0.0).to(tl.float32)
        dk = tl.zeros((BLOCK_S, PP, D), dtype=tl.float32)
        dv = tl.zeros((BLOCK_S, PP, D), dtype=tl.float32)
        for g in range(G):
            h = hk * G + g
            row = offs_s[:, None]
            q = tl.load(Q + b * sq_b + h * sq_h + row * sq_s + offs_d[None, :], mask=m_s[:, None],
                        other=0.0).to(tl.float32)
            do = tl.load(DO + b * sdo_b + h * sdo_h + row * sdo_s + offs_d[None, :], mask=m_s[:, None],
                         other=0.0).to(tl.float32)
            o = tl.load(O + b * so_b + h * so_h + row * so_s + offs_d[None, :], mask=m_s[:, None],
                        other=0.0).to(tl.float32)
            lse = tl.load(LSE + b * sl_b + h * sl_h + offs_s, mask=m_s, other=0.0).to(tl.float32)
            dj = tl.sum(do * o, axis=1)  # D = rowsum(dout ⊙ out_joint)
            sc = tl.sum(q[:, None, :] * k, axis=2) * scale
            p = tl.where(m_p[None, :], tl.exp(sc - lse[:, None]), 0.0)  # joint-normalised, (BS, PP)
            dv += p[:, :, None] * do[:, None, :]
            dp = tl.sum(do[:, None, :] * v, axis=2)
            ds = p * (dp - dj[:, None]) * scale
            dq = tl.sum(ds[:, :, None] * k, axis=1)  # (BS, D)
            dk += ds[:, :, None] * q[:, None, :]
            dq_ptr = DQ + b * sdq_b + h * sdq_h + row * sdq_s + offs_d[None, :]
            if DQ_ACCUM:
                dq += tl.load(dq_ptr, mask=m_s[:, None], other=0.0).to(tl.float32)
            tl.store(dq_ptr, dq.to(DQ.dtype.element_ty), mask=m_s[:, None])
        tl.store(DK + b * sdk_b + hk * sdk_h + offs_s[:, None, None] * sdk_s + offs_p[None, :, None] * sdk_p
                 + offs_d[None, None, :], dk.to(DK.dtype.element_ty), mask=m3)
        tl.store(DV + b * sdv_b + hk * sdv_h + offs_s[:, None, None] * sdv_s + offs_p[None, :, None] * sdv_p
                 + offs_d[None, None, :], dv.to(DV.dtype.element_ty), mask=m3)


    @triton.jit
    def _merge_inplace_kernel(OA, LA, OB, LB, S, H, so_b, so_h, so_s, sl_b, sl_h, sob_b, sob_h, sob_s,
                              slb_b, slb_h, D: tl.constexpr, BLOCK_S: tl.constexpr):
        """One (row block, b·h): (OA, LA) <- merge_lse((OA, LA), (OB, LB)), in place, one pass."""
        pid_s, pid_bh = tl.program_id(0), tl.program_id(1)
        b, h = pid_bh // H, pid_bh % H
        offs_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, D)
        m_s = offs_s < S
        la = tl.load(LA + b * sl_b + h * sl_h + offs_s, mask=m_s, other=0.0).to(tl.float32)
        lb = tl.load(LB + b * slb_b + h * slb_h + offs_s, mask=m_s, other=0.0).to(tl.float32)
        m = tl.maximum(la, lb)  # finite: at least one part per row is non-empty (merge_lse's contract)
        w_a, w_b = tl.exp(la - m), tl.exp(lb - m)
        l = w_a + w_b
        pa = OA + b * so_b + h * so_h + offs_s[:, None] * so_s + offs_d[None, :]
        oa = tl.load(pa, mask=m_s[:, None], other=0.0)
        ob = tl.load(OB + b * sob_b + h * sob_h + offs_s[:, None] * sob_s + offs_d[None, :],
                     mask=m_s[:, None], other=0.0).to(tl.float32)
        tl.store(pa, (oa * w_a[:, None] + ob * w_b[:, None]) / l[:, None], mask=m_s[:, None])
        tl.store(LA + b * sl_b + h * sl_h + offs_s, m + tl.log(l), mask=m_s)


def _use_triton_merge(out_a, lse_a, out_b, lse_b, impl: str | None) -> bool:
    if impl is not None:
        if impl not in ("triton", "torch"):
            raise ValueError(f"unknown merge impl {impl!r}; expected 'triton' or 'torch'")
        return impl == "triton"
    D = out_a.shape[-1]
    return (triton is not None and out_a.is_cuda and out_a.dtype == torch.float32
            and lse_a.dtype == torch.float32 and 16 <= D <= 256 and D & (D - 1) == 0)


def _merge_inplace_triton(out_a, lse_a, out_b, lse_b):
    B, H, S, D = out_a.shape
    assert out_a.dtype == torch.float32 and lse_a.dtype == torch.float32, "in-place merge needs an fp32 accumulator"
    if out_a.stride(-1) != 1 or lse_a.stride(-1) != 1:
        raise ValueError("the in-place merge writes out_a/lse_a through their strides: they need a unit last stride")
    out_b = out_b if out_b.stride(-1) == 1 else out_b.contiguous()
    lse_b = lse_b if lse_b.stride(-1) == 1 else lse_b.contiguous()
    BS = max(16, min(128, 8192 // D))  # an (BS, D) fp32 tile of ~8K elements per operand
    _merge_inplace_kernel[(triton.cdiv(S, BS), B * H)](
        out_a, lse_a, out_b, lse_b, S, H, *out_a.stride()[:3], *lse_a.stride()[:2], *out_b.stride()[:3],
        *lse_b.stride()[:2], D=D, BLOCK_S=BS, num_warps=4)
    return out_a, lse_a


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _block_s(P: int, D: int) -> int:
    # ~4K fp32 elements per (BS, PP, D) register tile: 4 such tiles live in the backward.
    return max(16, min(64, 4096 // (_pow2(P) * D)))


def branch_merge_fwd(q_d: torch.Tensor, k_br: torch.Tensor, v_br: torch.Tensor, out_a: torch.Tensor,
                     lse_a: torch.Tensor, scale: float, out_dtype: torch.dtype, *, impl: str | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out_a, lse_a) ⊕ branch, rounded once to `out_dtype`: exactly merge_lse(out_a, lse_a, *branch_fwd).

    out_a (B,H,S,D) any float dtype (a bf16 trunk output or the ring's fp32 accumulator), lse_a (B,H,S)
    fp32/fp64. Returns out (B,H,S,D) in out_dtype and lse (B,H,S) in lse_a's dtype. `impl`: None
    (Triton on CUDA where it applies), "triton" or "torch" (the twin) — tests force both.
    """
    if not _use_triton(q_d, k_br, impl):
        out_b, lse_b = _branch_fwd(q_d, k_br, v_br, scale)
        out, lse = merge_lse(out_a, lse_a, out_b, lse_b)
        return out.to(out_dtype), lse
    B, H, S, D = q_d.shape
    Hkv, P = k_br.shape[1], k_br.shape[3]
    q_d, k_br, v_br, out_a = (x if x.stride(-1) == 1 else x.contiguous() for x in (q_d, k_br, v_br, out_a))
    lse_a = lse_a if lse_a.stride(-1) == 1 else lse_a.contiguous()
    out = torch.empty(B, H, S, D, dtype=out_dtype, device=q_d.device)
    lse = torch.empty(B, H, S, dtype=lse_a.dtype, device=q_d.device)
    BS = _block_s(P, D)
    _branch_merge_fwd_kernel[(triton.cdiv(S, BS), B * H)](
        q_d, k_br, v_br, out_a, lse_a, out, lse, S, H, float(scale),
        *q_d.stride()[:3], *k_br.stride()[:4], *v_br.stride()[:4], *out_a.stride()[:3], *lse_a.stride()[:2],
        *out.stride()[:3], *lse.stride()[:2],
        G=H // Hkv, P=P, PP=_pow2(P), D=D, BLOCK_S=BS, num_warps=4)
    return out, lse


def branch_bwd_into(dout: torch.Tensor, q_d: torch.Tensor, k_br: torch.Tensor, v_br: torch.Tensor,
                    out_joint: torch.Tensor, lse_joint: torch.Tensor, dq_acc: torch.Tensor, scale: float,
                    *, impl: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Branch share of the joint gradient (the `branch_attn_bwd` formula), with dq ADDED into dq_acc.

    dq_acc (B,H,S,D): the trunk's dq (any float dtype; the sum is formed in fp32 and rounded once into
    dq_acc's dtype) or the ring's fp32 accumulator. Returns (dk_br, dv_br) (B,Hkv,S,P,D) in k_br's dtype.
    """
    if not _use_triton(q_d, k_br, impl):
        dq_b, dkb, dvb = _branch_bwd(dout, q_d, k_br, v_br, out_joint, lse_joint, scale)
        dq_acc.copy_(dq_acc.to(dq_b.dtype) + dq_b)
        return dkb.to(k_br.dtype), dvb.to(v_br.dtype)
    B, H, S, D = q_d.shape
    Hkv, P = k_br.shape[1], k_br.shape[3]
    q_d, k_br, v_br, dout, out_joint = (x if x.stride(-1) == 1 else x.contiguous()
                                        for x in (q_d, k_br, v_br, dout, out_joint))
    lse_joint = lse_joint if lse_joint.stride(-1) == 1 else lse_joint.contiguous()
    assert dq_acc.stride(-1) == 1, "dq_acc is written in place: it needs a unit last stride"
    dk = torch.empty(k_br.shape, dtype=k_br.dtype, device=k_br.device)
    dv = torch.empty(v_br.shape, dtype=v_br.dtype, device=v_br.device)
    BS = _block_s(P, D)
    _branch_bwd_kernel[(triton.cdiv(S, BS), B * Hkv)](
        q_d, k_br, v_br, dout, out_joint, lse_joint, dq_acc, dk, dv, S, Hkv, float(scale),
        *q_d.stride()[:3], *k_br.stride()[:4], *v_br.stride()[:4], *dout.stride()[:3], *out_joint.stride()[:3],
        *lse_joint.stride()[:2], *dq_acc.stride()[:3], *dk.stride()[:4], *dv.stride()[:4],
        G=H // Hkv, P=P, PP=_pow2(P), D=D, BLOCK_S=BS, DQ_ACCUM=True, num_warps=8)
    return dk, dv


# --------------------------------------------------------------------------------------------------
# TTT attention = causal trunk block ⊕ branch diagonal, one custom autograd node.
# --------------------------------------------------------------------------------------------------

class TTTAttention(torch.autograd.Function):
    """Forward: (out, lse) of trunk ⊕ branch. Backward: each part's backward with the joint (out, lse).

    lse is returned for callers that merge further (e.g. a ring loop) but is marked non-differentiable:
    the §3 identity means no gradient w.r.t. lse is ever needed inside specco.
    """

    @staticmethod
    def forward(ctx, q_d, k_trunk, v_trunk, k_branch, v_branch, scale, impl, q_start=0):
        out_t, lse_t = _trunk_fwd(q_d, k_trunk, v_trunk, q_start, scale, impl)
        has_branch = k_branch is not None and k_branch.shape[3] > 0
        if has_branch:
            # Branch and merge in fp32, one rounding to q's dtype at the end (fused on CUDA).
            out, lse = branch_merge_fwd(q_d, k_branch, v_branch, out_t, lse_t, scale, q_d.dtype)
        else:
            out, lse = out_t.to(q_d.dtype), lse_t
        # out in q's dtype is what every kernel backward reads for D = rowsum(dout ⊙ out).
        ctx.save_for_backward(q_d, k_trunk, v_trunk, k_branch if has_branch else None,
                              v_branch if has_branch else None, out, lse)
        ctx.scale, ctx.impl, ctx.has_branch, ctx.q_start = scale, impl, has_branch, q_start
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q_d, k_trunk, v_trunk, k_branch, v_branch, out, lse = ctx.saved_tensors
        dq, dk, dv = _trunk_bwd(dout, q_d, k_trunk, v_trunk, out, lse, ctx.q_start, ctx.scale, ctx.impl)
        dkb = dvb = None
        if ctx.has_branch:
            # dq += branch share, summed in fp32 before the one rounding to q's dtype
            dkb, dvb = branch_bwd_into(dout, q_d, k_branch, v_branch, out, lse, dq, ctx.scale)
        return dq.to(q_d.dtype), dk, dv, dkb, dvb, None, None, None


def _trunk_fwd(q, k, v, q_start: int, scale: float, impl):
    """The trunk part of queries at anchors q_start..q_start+Sq-1 over the pass-1 keys 0..q_start+Sq-1:
    one causal block when q_start = 0; else the keys before the queries as a full block ⊕ the queries' own
    causal square (prefix_causal_fwd, out kept in fp32 for the one rounding after the branch)."""
    if q_start == 0:
        return block_attn_fwd(q, k, v, True, scale, impl=impl)
    return prefix_causal_fwd(q, k[:, :, :q_start], v[:, :, :q_start], k[:, :, q_start:], v[:, :, q_start:], scale,
                             impl)


def _trunk_bwd(dout, q, k, v, out, lse, q_start: int, scale: float, impl):
    """`_trunk_fwd`'s share of the joint gradient: dq in fp32 (rounded to q's dtype by the caller, after the
    branch's share)."""
    if q_start == 0:
        return block_attn_bwd(dout, q, k, v, out, lse, True, scale, impl=impl)
    dq, dk_p, dv_p, dk_d, dv_d = prefix_causal_bwd(dout, q, k[:, :, :q_start], v[:, :, :q_start], k[:, :, q_start:],
                                                   v[:, :, q_start:], out, lse, scale, impl)
    return dq, torch.cat([dk_p, dk_d], dim=2), torch.cat([dv_p, dv_d], dim=2)


# --------------------------------------------------------------------------------------------------
# Queries against a prefix of keys they all see ⊕ their own causal square: the trunk of TTT from an anchor on
# (above) and the shared-prompt segments (parallel/shared_prompts.py).
# --------------------------------------------------------------------------------------------------

def _as_one_row(x: torch.Tensor) -> torch.Tensor:
    """(n, H, L, ...) -> (1, H, n*L, ...): the rows' queries one after another."""
    return x.transpose(0, 1).reshape(1, x.shape[1], x.shape[0] * x.shape[2], *x.shape[3:])


def _as_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """_as_one_row's inverse: (1, H, n*L, ...) -> (n, H, L, ...) (a view)."""
    return x.reshape(x.shape[1], n, x.shape[2] // n, *x.shape[3:]).transpose(0, 1)


def prefix_causal_fwd(q, k_pre, v_pre, k_own, v_own, scale: float | None, impl):
    """q (n, H, L, D) against the prefix k_pre / v_pre (n or 1, Hkv, p, D), every query seeing every prefix key,
    ⊕ its own keys k_own / v_own (n, Hkv, L, D) causally: query j sees prefix keys 0..p-1 and own keys 0..j.
    Two blocks merged by merge_lse, not one rectangular causal block: the kernels align a rectangular causal mask
    differently (sdpa_adapter). A prefix of batch 1 is every row's (n > 1): all n*L queries go against it as one
    row, so its keys are neither copied n times nor their gradients summed back over copies.
    Returns (out (n, H, L, D), lse (n, H, L)), both in lse's dtype (fp32; fp64 for fp64 inputs)."""
    n = q.shape[0]
    shared = k_pre.shape[0] != n
    out_p, lse_p = block_attn_fwd(_as_one_row(q) if shared else q, k_pre, v_pre, False, scale, impl=impl)
    if shared:
        out_p, lse_p = _as_rows(out_p, n), _as_rows(lse_p, n)  # (1, H, nL, D) -> (n, H, L, D)
    out_d, lse_d = block_attn_fwd(q, k_own, v_own, True, scale, impl=impl)
    return merge_lse(out_p.to(lse_p.dtype), lse_p, out_d, lse_d)


def prefix_causal_bwd(dout, q, k_pre, v_pre, k_own, v_own, out, lse, scale: float | None, impl):
    """prefix_causal_fwd's gradient from the joint (out, lse) (out in q's dtype, as the kernels' backward reads
    it): each block's backward, dq of the two summed in lse's dtype. Returns (dq, dk_pre, dv_pre, dk_own,
    dv_own)."""
    n = q.shape[0]
    shared = k_pre.shape[0] != n
    one = _as_one_row if shared else (lambda x: x)
    dq_p, dk_pre, dv_pre = block_attn_bwd(one(dout), one(q), k_pre, v_pre, one(out), one(lse), False, scale,
                                          impl=impl)
    if shared:
        dq_p = _as_rows(dq_p, n)
    dq_d, dk_own, dv_own = block_attn_bwd(dout, q, k_own, v_own, out, lse, True, scale, impl=impl)
    return dq_p.to(lse.dtype) + dq_d, dk_pre, dv_pre, dk_own, dv_own


def ttt_attention(q_d: torch.Tensor, k_trunk: torch.Tensor, v_trunk: torch.Tensor,
                  k_branch: torch.Tensor | None = None, v_branch: torch.Tensor | None = None,
                  scale: float | None = None, *, return_lse: bool = False, impl: str | None = None,
                  q_start: int = 0):
    """Pass-d TTT attention: trunk (pass-1 K/V, causal) ⊕ branch (own anchor's pass-2..d K/V).

    q_d (B, H, S, D); k_trunk, v_trunk (B, Hkv, q_start + S, D); k_branch, v_branch (B, Hkv, S, P, D) with
    P = d-1, or None for pass 1. The queries are the anchors q_start..q_start+S-1 (model/ttt.py: anchors before
    q_start train nothing, but their pass-1 keys are the trunk). scale defaults to 1/sqrt(D). Returns out
    (B, H, S, D) in q's dtype, plus lse (B, H, S) (fp32; fp64 for fp64 inputs) when return_lse. `impl` forces
    an adapter kernel (tests).
    """
    if q_start < 0 or k_trunk.shape[2] != q_start + q_d.shape[2]:
        raise ValueError(f"ttt_attention: {q_d.shape[2]} queries from anchor {q_start} need the "
                         f"{q_start + q_d.shape[2]} trunk keys before and at them, got {k_trunk.shape[2]}")
    scale = 1.0 / math.sqrt(q_d.shape[-1]) if scale is None else float(scale)
    (q_d, k_trunk, v_trunk, k_branch, v_branch), no_autocast = autocast_inputs(q_d, k_trunk, v_trunk, k_branch,
                                                                                v_branch)
    impl = ttt_trunk_impl(q_d) if impl is None else impl
    with no_autocast:
        out, lse = TTTAttention.apply(q_d, k_trunk, v_trunk, k_branch, v_branch, scale, impl, int(q_start))
    return (out, lse) if return_lse else out


def ttt_trunk_impl(q: torch.Tensor) -> str | None:
    """The trunk kernel of TTT training: FlashAttention-2 for half-precision CUDA inputs, else None (the
    adapter's own pick). Not cuDNN, the adapter's CUDA default: cuDNN builds an execution plan for every new
    shape, and the train step's length-sorted micro-batches bring new (rows, length) shapes every RL step. On
    the H200, co-training on ragged batches with fresh shapes cost 1.63x the policy-only step with cuDNN and
    1.10x with FlashAttention-2 (bench/cotrain_ragged.py, BENCHMARKS.md); at one repeated shape cuDNN's
    kernel is ~1.3x faster, but the draft's attention is a small share of the step."""
    return "flash" if flash_applies(q) else None


def autocast_inputs(*xs):
    """Under autocast (mixed-precision training): the floating inputs cast to its dtype, and a context
    that switches it off. The attention Functions run one kernel dtype end to end (q, k, v may arrive
    mixed: RoPE's fp32 tables promote q and k, v stays in the autocast dtype) and keep their own fp32
    statistics; autocast inside them would re-cast their fp32 math. Elsewhere: the inputs, a null context."""
    dev = next(x for x in xs if x is not None).device.type
    if not torch.is_autocast_enabled(dev):
        return xs, contextlib.nullcontext()
    dt = torch.get_autocast_dtype(dev)
    cast = tuple(x.to(dt) if x is not None and x.is_floating_point() else x for x in xs)
    return cast, torch.autocast(dev, enabled=False)
