"""Fused elementwise kernels of the decode path: residual add + RMSNorm, SiLU·mul, and q/k-norm + RoPE
+ KV-cache write. Each has a pure-torch twin that *is* the model's formula (STYLE §8).

Why fused. At decode a 0.5B model's step is launch- and latency-bound, not FLOP-bound: the
unfused fp32 RMSNorm alone is ~6 kernels (upcast, square, mean, rsqrt, mul, cast, mul), RoPE ~5
(two muls, a cat of the rotated halves, neg, add), and a cache write with expanded index tensors 4.
A layer of the decode path is instead 10 launches: add+norm, qkv GEMM, rope+write, the two
split-K attention kernels (decode_attention.py), o GEMM, add+norm, gate/up GEMM, SiLU·mul, down GEMM.

Numerics match the training forward's modules rounding for rounding where it matters: RMSNorm is
computed in fp32 and cast to the activation dtype *before* the weight multiply (transformers'
LlamaRMSNorm), RoPE rounds each product to the activation dtype before the add (as the eager
`x * cos + rotate_half(x) * sin` does in bf16), and the residual add rounds once.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import _pow2
from .decode_attention import write_kv

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

__all__ = ["add_rms_norm", "silu_mul", "rope_qkv_write", "rms_norm_reference", "rope_reference"]


def _use_triton(x: torch.Tensor, impl: str | None) -> bool:
    if impl is not None:
        if impl not in ("triton", "torch"):
            raise ValueError(f"unknown kernel impl {impl!r}; expected 'triton' or 'torch'")
        return impl == "triton"
    return triton is not None and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16, torch.float32)



# -- twins (the model's formulas, layers.py) ---------------------------------------------------------

def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = weight · (x / sqrt(mean(x²) + eps)) with the normalisation in fp32, cast before the weight."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (..., D) rotated with cos/sin (..., D) broadcastable: x·cos + rotate_half(x)·sin."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


# -- residual add + RMSNorm ---------------------------------------------------------------------------

if triton is not None:
    @triton.jit
    def _add_rms_norm_kernel(X, R, W, HS, Y, N, eps, sx, sr, shs, sy, HAS_RES: tl.constexpr,
                             BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # int64 offsets: rows x stride can pass 2^31 (long prefills)
        offs = tl.arange(0, BLOCK)
        ok = offs < N
        x = tl.load(X + row * sx + offs, mask=ok, other=0.0)
        if HAS_RES:
            x = (x.to(tl.float32) + tl.load(R + row * sr + offs, mask=ok, other=0.0).to(tl.float32))
            x = x.to(HS.dtype.element_ty)  # the residual stream rounds once, as `x + r` does
            tl.store(HS + row * shs + offs, x, mask=ok)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
        normed = (xf * rstd).to(Y.dtype.element_ty).to(tl.float32)
        w = tl.load(W + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(Y + row * sy + offs, (normed * w).to(Y.dtype.element_ty), mask=ok)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, *,
                 out: torch.Tensor | None = None, impl: str | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual (or x when residual is None); returns (h, rms_norm(h) · weight).

    x, residual (N, n) with unit last stride; `out` (N, n) may be a strided view (the draft writes its
    two normed inputs into the halves of one (N, 2h) buffer).
    """
    h = x if residual is None else None
    if not _use_triton(x, impl):
        h = x + residual if residual is not None else x
        y = rms_norm_reference(h, weight, eps)
        if out is not None:
            out.copy_(y)
            y = out
        return h, y
    N, n = x.shape
    if h is None:
        h = torch.empty_like(x)
    y = torch.empty_like(x) if out is None else out
    r = residual if residual is not None else x
    _add_rms_norm_kernel[(N,)](x, r, weight, h, y, n, float(eps), x.stride(0), r.stride(0), h.stride(0),
                               y.stride(0), HAS_RES=residual is not None, BLOCK=_pow2(n),
                               num_warps=4 if n <= 4096 else 8)
    return h, y


# -- SiLU(gate) · up ----------------------------------------------------------------------------------

if triton is not None:
    @triton.jit
    def _silu_mul_kernel(GU, OUT, I, s_gu, s_out, BLOCK: tl.constexpr):
        row, blk = tl.program_id(0).to(tl.int64), tl.program_id(1)
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        ok = offs < I
        g = tl.load(GU + row * s_gu + offs, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(GU + row * s_gu + I + offs, mask=ok, other=0.0).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(OUT.dtype.element_ty).to(tl.float32)  # F.silu rounds here
        tl.store(OUT + row * s_out + offs, (act * u).to(OUT.dtype.element_ty), mask=ok)


def silu_mul(gate_up: torch.Tensor, *, impl: str | None = None) -> torch.Tensor:
    """gate_up (N, 2I) = [gate | up] -> silu(gate) · up (N, I): SwiGLU's activation on the fused projection."""
    I = gate_up.shape[-1] // 2
    if not _use_triton(gate_up, impl):
        return F.silu(gate_up[..., :I]) * gate_up[..., I:]
    N = gate_up.shape[0]
    out = torch.empty(N, I, dtype=gate_up.dtype, device=gate_up.device)
    BLOCK = 1024
    _silu_mul_kernel[(N, triton.cdiv(I, BLOCK))](gate_up, out, I, gate_up.stride(0), out.stride(0),
                                                  BLOCK=BLOCK, num_warps=4)
    return out


# -- q/k norm + RoPE + cache write --------------------------------------------------------------------

if triton is not None:
    @triton.jit
    def _rope_qkv_write_kernel(QKV, COS, SIN, POS, QN, KN, QOUT, KC, VC, T, H, HKV, eps,
                               s_qkv, s_cos, s_pos, sq_bt, sq_h, skc_b, skc_h, skc_s, svc_b, svc_h, svc_s,
                               D: tl.constexpr, HALF: tl.constexpr, QK_NORM: tl.constexpr):
        """Program (b·T + t, head): head < H is a query head, < H + Hkv a key head, else a value head."""
        bt, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
        b = bt // T
        pos = tl.load(POS + bt * s_pos).to(tl.int64)
        offs = tl.arange(0, HALF)
        ok = offs < D // 2
        base = QKV + bt * s_qkv + head * D
        lo = tl.load(base + offs, mask=ok, other=0.0)
        hi = tl.load(base + D // 2 + offs, mask=ok, other=0.0)
        dt = lo.dtype
        if head >= H + HKV:  # value head: straight into the cache
            vh = head - H - HKV
            dst = VC + b * svc_b + vh * svc_h + pos * svc_s
            tl.store(dst + offs, lo.to(VC.dtype.element_ty), mask=ok)
            tl.store(dst + D // 2 + offs, hi.to(VC.dtype.element_ty), mask=ok)
        else:
            if QK_NORM:  # per-head RMSNorm (Qwen3) before RoPE, formula of rms_norm_reference
                lf, hf = lo.to(tl.float32), hi.to(tl.float32)
                rstd = 1.0 / tl.sqrt((tl.sum(lf * lf, axis=0) + tl.sum(hf * hf, axis=0)) / D + eps)
                WN = QN if head < H else KN
                w_lo = tl.load(WN + offs, mask=ok, other=0.0).to(tl.float32)
                w_hi = tl.load(WN + D // 2 + offs, mask=ok, other=0.0).to(tl.float32)
                lo = ((lf * rstd).to(dt).to(tl.float32) * w_lo).to(dt)
                hi = ((hf * rstd).to(dt).to(tl.float32) * w_hi).to(dt)
            c_lo = tl.load(COS + pos * s_cos + offs, mask=ok, other=0.0).to(tl.float32)
            c_hi = tl.load(COS + pos * s_cos + D // 2 + offs, mask=ok, other=0.0).to(tl.float32)
            s_lo = tl.load(SIN + pos * s_cos + offs, mask=ok, other=0.0).to(tl.float32)
            s_hi = tl.load(SIN + pos * s_cos + D // 2 + offs, mask=ok, other=0.0).to(tl.float32)
            lf, hf = lo.to(tl.float32), hi.to(tl.float32)
            # x·cos + rotate_half(x)·sin with rotate_half(x) = [-hi, lo]; each product rounded to dt
            r_lo = ((lf * c_lo).to(dt).to(tl.float32) + (-hf * s_lo).to(dt).to(tl.float32)).to(dt)
            r_hi = ((hf * c_hi).to(dt).to(tl.float32) + (lf * s_hi).to(dt).to(tl.float32)).to(dt)
            if head < H:
                dst = QOUT + bt * sq_bt + head * sq_h
                tl.store(dst + offs, r_lo, mask=ok)
                tl.store(dst + D // 2 + offs, r_hi, mask=ok)
            else:
                kh = head - H
                dst = KC + b * skc_b + kh * skc_h + pos * skc_s
                tl.store(dst + offs, r_lo.to(KC.dtype.element_ty), mask=ok)
                tl.store(dst + D // 2 + offs, r_hi.to(KC.dtype.element_ty), mask=ok)


def rope_qkv_write(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                   cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, q_norm: torch.Tensor | None = None,
                   k_norm: torch.Tensor | None = None, eps: float = 1e-6, *, impl: str | None = None
                   ) -> torch.Tensor:
    """Split the fused projection, normalise q/k per head (if q_norm/k_norm), rotate them, write k/v.

    qkv (B, T, (H + 2·Hkv)·D) = [q heads | k heads | v heads]; cos/sin tables (L, D) indexed by
    `positions` (B, T); k_cache / v_cache (B, Hkv, S_max, D), one layer's (views are fine).
    Returns the rotated queries (B, T, H, D); keys and values land in the cache at their positions.
    """
    B, T, _ = qkv.shape
    H, Hkv, D = num_heads, num_kv_heads, head_dim
    if not _use_triton(qkv, impl):
        q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
        q, k, v = q.view(B, T, H, D), k.view(B, T, Hkv, D), v.view(B, T, Hkv, D)
        if q_norm is not None:
            q, k = rms_norm_reference(q, q_norm, eps), rms_norm_reference(k, k_norm, eps)
        cos, sin = cos_table[positions][:, :, None], sin_table[positions][:, :, None]  # (B, T, 1, D)
        q, k = rope_reference(q, cos, sin), rope_reference(k, cos, sin)
        write_kv(k_cache, v_cache, positions, k, v)
        return q
    q_out = torch.empty(B, T, H, D, dtype=qkv.dtype, device=qkv.device)
    qkv2 = qkv.reshape(B * T, -1)
    pos = positions.reshape(B * T)
    qn = q_norm if q_norm is not None else cos_table
    kn = k_norm if k_norm is not None else cos_table
    _rope_qkv_write_kernel[(B * T, H + 2 * Hkv)](
        qkv2, cos_table, sin_table, pos, qn, kn, q_out, k_cache, v_cache, T, H, Hkv, float(eps),
        qkv2.stride(0), cos_table.stride(0), pos.stride(0), q_out.stride(1), q_out.stride(2),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        D=D, HALF=_pow2(D // 2), QK_NORM=q_norm is not None, num_warps=1)
    return q_out
