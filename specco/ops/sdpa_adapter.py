"""The one home of private aten attention entry points (STYLE §8).

Two functions, one contract, several kernels:

    block_attn_fwd(q, k, v, causal, scale)                              -> (out, lse)
    block_attn_bwd(dout, q, k, v, out_joint, lse_joint, causal, scale)  -> (dq, dk, dv)

Shapes: q/out/dout (B, H, Sq, D); k/v (B, Hkv, Sk, D) with Hkv | H (GQA); lse (B, H, Sq), natural
log, in `lse_dtype(q)`: fp32, or fp64 for fp64 inputs (the CPU kernel insists on that, and it keeps
fp64 tests at ~1e-12 instead of fp32's 1e-7).

`causal=True` means query i sees keys j <= i and requires Sq == Sk: the kernels disagree on how to
align a rectangular causal mask (the CPU kernel aligns top-left, FlashAttention-2 bottom-right), so we
refuse that case instead of silently picking one. Non-causal blocks may have Sq != Sk, which is
what a ring step needs.

Forward:  s = scale · q kᵀ (masked),  lse = logsumexp_j s,  out = softmax(s) v.
Backward (evaluated with the *joint* statistics of all parts a query attends to, docs/DESIGN.md §3):
    D = rowsum(dout ⊙ out_joint),  p = exp(s - lse_joint),
    dv = pᵀ dout,  ds = p ⊙ (dout vᵀ - D) · scale,  dq = ds k,  dk = dsᵀ q.
Every flash-style kernel's backward recomputes p from the lse it is *given* and D from the out it is
*given*, so handing it the joint (out, lse) yields exactly this block's share of the joint gradient.

Kernels (`impl`): "cpu_flash" (aten `_scaled_dot_product_flash_attention_for_cpu`, any float dtype incl.
fp64, native GQA), "flash" / "cudnn" (CUDA, fp16/bf16, written from the op schemas — not run in CI here;
bench/ttt_attention.py and bench/cp_attention.py check both against fp64 on the GPU),
"efficient" (CUDA memory-efficient SDPA, the one CUDA kernel for fp32: without it fp32 attention on
a GPU would materialise Sq x Sk scores per head; its lse comes padded to a multiple of 32 rows),
"torch" (pure-torch, fp32/fp64 math; the reference kernel for every device/dtype the others miss).
`impl=None` picks automatically: on CUDA cuDNN where it applies (fp16/bf16, D % 8 == 0, D <= 128, cuDNN
>= 9 present), else FlashAttention-2 (D <= 256); fp32 on CUDA takes "efficient" (D % 4 == 0, D <= 128);
everything else torch. cuDNN is the default because on the H200 it
ran the causal block fwd+bwd ~1.3x faster than flash (bench/results/cp_attention_cuda*.json).

GQA on CUDA: an impl in `NATIVE_GQA` is handed the Hkv-head K/V as they are (the kernel maps query
head h to kv head h // G and sums dK/dV over the G heads itself). Otherwise K/V are repeat_interleave'd
to H heads (one copy of the visiting block; a stride-0 `expand` cannot express head h -> h // G in
one dimension) and dK/dV are summed back over the G heads in fp32 (`grad_dtype` lets a caller that
accumulates in fp32 skip the rounding to k's dtype). `bench/cp_kernels.py` checks both forms against
fp64 on the GPU and times them; an impl joins NATIVE_GQA only after that check.

Strides: an impl in `STRIDED_OK` is handed row slices of (B, H, T, D) tensors (what a ring step's
blocks are) without a `.contiguous()` copy; the kernels take any strides with a unit last stride.
"""

from __future__ import annotations

import math

import torch

aten = torch.ops.aten

_IMPLS = ("cpu_flash", "flash", "cudnn", "efficient", "torch")

# CUDA impls verified (bench/cp_kernels.py, H200, torch 2.11, 2026-11-29: fwd and joint-statistics bwd
# against fp64, causal and rectangular blocks, bf16 rel. err <= 2.9e-3) to take Hkv < H K/V natively,
# and to take inputs whose only unit stride is the last one. Module-level sets so the bench can switch
# them off to measure what they save.
NATIVE_GQA: set[str] = {"cudnn", "flash"}
STRIDED_OK: set[str] = {"cudnn", "flash"}


def _pick_impl(q: torch.Tensor, impl: str | None) -> str:
    if impl is not None:
        if impl not in _IMPLS:
            raise ValueError(f"unknown attention impl {impl!r}; expected one of {_IMPLS}")
        return impl
    if q.device.type == "cpu":
        return "cpu_flash"
    if _half_cuda(q) and q.shape[-1] <= 128 and _cudnn_ok():
        return "cudnn"
    if flash_applies(q):
        return "flash"  # FlashAttention-2: the fallback where cuDNN is missing or the shape is not its
    if q.is_cuda and q.dtype == torch.float32 and q.shape[-1] % 4 == 0 and q.shape[-1] <= 128:
        return "efficient"
    return "torch"


def _half_cuda(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0


def flash_applies(q: torch.Tensor) -> bool:
    """Whether the "flash" impl (FlashAttention-2) takes q: fp16/bf16 on CUDA, head dim a multiple of 8, <= 256."""
    return _half_cuda(q) and q.shape[-1] <= 256


_CUDNN_OK: bool | None = None


def _cudnn_ok() -> bool:
    """cuDNN >= 9 is loaded and torch lets SDPA use it (the same switch `sdpa_kernel` flips)."""
    global _CUDNN_OK
    if _CUDNN_OK is None:
        ver = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        _CUDNN_OK = bool(ver and ver >= 90000)
    return _CUDNN_OK and torch.backends.cuda.cudnn_sdp_enabled()


def _check_causal(q: torch.Tensor, k: torch.Tensor, causal: bool) -> None:
    if causal and q.shape[-2] != k.shape[-2]:
        raise ValueError(
            f"causal block needs Sq == Sk (got {q.shape[-2]} vs {k.shape[-2]}); kernels differ on "
            "rectangular causal alignment, so split the block or pass causal=False")


def _dense(x: torch.Tensor, impl: str) -> torch.Tensor:
    """x as the CUDA kernel `impl` accepts it: unchanged where its strides are fine, else a contiguous copy."""
    if impl in STRIDED_OK and x.stride(-1) == 1:
        return x
    return x.contiguous()


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, Hkv, S, D) -> (B, Hkv·G, S, D): query head h uses kv head h // G (GQA convention)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _reduce_kv_grad(dx: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of _expand_kv for gradients: sum the G query heads that shared one kv head.

    The sum accumulates in fp32 (fp64 for fp64) without materialising an upcast copy, so bf16 kernel
    outputs are rounded once, after the reduction (and not at all when `dtype` is the fp32 accumulator's).
    """
    if groups == 1:
        return dx.to(dtype)
    B, H, S, D = dx.shape
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    return dx.view(B, H // groups, groups, S, D).sum(2, dtype=acc).to(dtype)  # (B, Hkv, S, D)


# --------------------------------------------------------------------------------------------------
# Pure-torch kernel (reference semantics; also the fallback).
# --------------------------------------------------------------------------------------------------

def lse_dtype(q: torch.Tensor) -> torch.dtype:
    """Accumulation / lse dtype: fp64 stays fp64 (reference-grade tests); everything else uses fp32."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


_math_dtype = lse_dtype


def _torch_scores(q, k, causal, scale):
    """s = scale · q kᵀ with the causal mask applied as -inf; q (B,H,Sq,D), k already expanded to H."""
    md = _math_dtype(q)
    s = torch.matmul(q.to(md), k.to(md).transpose(-1, -2)) * scale  # (B, H, Sq, Sk)
    if causal:
        Sq, Sk = s.shape[-2:]
        keep = torch.ones(Sq, Sk, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return s


def _torch_fwd(q, k, v, causal, scale):
    groups = q.shape[1] // k.shape[1]
    k, v = _expand_kv(k, groups), _expand_kv(v, groups)
    s = _torch_scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)  # (B, H, Sq)
    out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.to(s.dtype))
    return out.to(q.dtype), lse


def _torch_bwd(dout, q, k, v, out_joint, lse_joint, causal, scale):
    groups = q.shape[1] // k.shape[1]
    ke, ve = _expand_kv(k, groups), _expand_kv(v, groups)
    s = _torch_scores(q, ke, causal, scale)
    md = s.dtype
    p = torch.exp(s - lse_joint.to(md).unsqueeze(-1))  # joint-normalised probabilities of this block
    do = dout.to(md)
    D = (do * out_joint.to(md)).sum(-1, keepdim=True)  # (B, H, Sq, 1)
    dv = torch.matmul(p.transpose(-1, -2), do)  # (B, H, Sk, D)
    ds = p * (torch.matmul(do, ve.to(md).transpose(-1, -2)) - D) * scale
    dq = torch.matmul(ds, ke.to(md))
    dk = torch.matmul(ds.transpose(-1, -2), q.to(md))
    return dq.to(q.dtype), _reduce_kv_grad(dk, groups, k.dtype), _reduce_kv_grad(dv, groups, v.dtype)


# --------------------------------------------------------------------------------------------------
# Public interface.
# --------------------------------------------------------------------------------------------------

def block_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None = None,
                   *, impl: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One attention block: out (B,H,Sq,D) in q.dtype, lse (B,H,Sq) = logsumexp_j(scale·q kᵀ) in lse_dtype(q)."""
    _check_causal(q, k, causal)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    impl = _pick_impl(q, impl)
    if impl == "cpu_flash":
        # Native GQA (verified by tests). It returns out in (B,S,H,D) memory order and lse as a
        # (B,H,S) view of a (B,S,H) buffer; we make lse contiguous because ring code sends it around.
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu.default(
            q, k, v, 0.0, causal, attn_mask=None, scale=scale)
        return out, lse.to(lse_dtype(q)).contiguous()
    if impl == "torch":
        return _torch_fwd(q, k, v, causal, scale)
    groups = 1 if impl in NATIVE_GQA else q.shape[1] // k.shape[1]
    k, v = _expand_kv(k, groups), _expand_kv(v, groups)  # (B, H, Sk, D) unless the kernel does GQA itself
    q, k, v = _dense(q, impl), _dense(k, impl), _dense(v, impl)
    if impl == "flash":
        out, lse = aten._scaled_dot_product_flash_attention.default(q, k, v, 0.0, causal, False, scale=scale)[:2]
        return out, lse.contiguous()  # lse (B, H, Sq) fp32
    if impl == "efficient":  # lse (B, H, Sq rounded up to 32): keep the real rows
        out, lse = aten._scaled_dot_product_efficient_attention.default(q, k, v, None, True, 0.0, causal,
                                                                         scale=scale)[:2]
        return out, lse[..., :q.shape[-2]].contiguous()
    # cudnn: its logsumexp is (B, H, Sq, 1) fp32.
    out, lse = aten._scaled_dot_product_cudnn_attention.default(
        q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
    return out, lse.squeeze(-1).contiguous()


def block_attn_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out_joint: torch.Tensor, lse_joint: torch.Tensor, causal: bool, scale: float | None = None,
                   *, impl: str | None = None, grad_dtype: torch.dtype | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's share of the joint gradient (formula in the module docstring); dk/dv are (B,Hkv,Sk,D).

    dq is in q's dtype; dk/dv in `grad_dtype` (default k's dtype). A ring loop accumulating in fp32 passes
    grad_dtype=float32 so GQA's head sum is not rounded to bf16 before it is accumulated. On CUDA, where
    no head sum is left to this function (H == Hkv, or a NATIVE_GQA kernel) dk/dv come back in the
    kernel's dtype (k's): converting them would only be an extra copy, since adding a bf16 tensor into
    an fp32 accumulator promotes it elementwise.
    """
    grad_dtype = k.dtype if grad_dtype is None else grad_dtype
    _check_causal(q, k, causal)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    impl = _pick_impl(q, impl)
    # The kernels read out/dout in q's dtype and lse contiguous in lse_dtype(q) (a strided lse gives
    # wrong results on CUDA flash, per torch's own context-parallel code).
    out_joint = out_joint.to(q.dtype)
    lse_joint = lse_joint.to(lse_dtype(q)).contiguous()
    dout = dout.to(q.dtype)
    if impl == "cpu_flash":
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
            dout, q, k, v, out_joint, lse_joint, 0.0, causal, attn_mask=None, scale=scale)
        return dq, dk.to(grad_dtype), dv.to(grad_dtype)
    if impl == "torch":
        dq, dk, dv = _torch_bwd(dout, q, k, v, out_joint, lse_joint, causal, scale)
        return dq, dk.to(grad_dtype), dv.to(grad_dtype)
    groups = 1 if impl in NATIVE_GQA else q.shape[1] // k.shape[1]
    ke, ve = _dense(_expand_kv(k, groups), impl), _dense(_expand_kv(v, groups), impl)
    q, dout, out_joint = _dense(q, impl), _dense(dout, impl), _dense(out_joint, impl)
    Sq, Sk = q.shape[-2], ke.shape[-2]
    # dropout_p = 0, so the philox seed/offset are never read; pass defined placeholders anyway.
    seed = torch.empty((), dtype=torch.int64, device=q.device)
    offset = torch.empty((), dtype=torch.int64, device=q.device)
    if impl == "efficient":
        # The kernel reads lse with the padded row count its forward produced (a multiple of 32); the
        # pad rows are never used. seed/offset are unread at dropout 0 (its forward makes them on CPU).
        B, H = q.shape[:2]
        lse_pad = lse_joint.new_zeros(B, H, -(-Sq // 32) * 32)  # (B, H, ceil32(Sq))
        lse_pad[..., :Sq] = lse_joint
        cpu_seed = torch.empty((), dtype=torch.int64)
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward.default(
            dout, q, ke, ve, None, out_joint, lse_pad, cpu_seed, cpu_seed, 0.0, [True, True, True, False],
            causal, scale=scale)
    elif impl == "flash":
        # cum_seq_q/k = None selects the dense (non-varlen) kernel; max_q/max_k are then unused.
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward.default(
            dout, q, ke, ve, out_joint, lse_joint, None, None, Sq, Sk, 0.0, causal, seed, offset, scale=scale)
    else:
        # cudnn dense path *does* read max_q/max_k as s_q/s_kv, and wants lse as (B, H, Sq, 1).
        dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward.default(
            dout, q, ke, ve, out_joint, lse_joint.unsqueeze(-1), seed, offset, None, None, None,
            Sq, Sk, 0.0, causal, scale=scale)
    if groups == 1:
        return dq, dk, dv
    return dq, _reduce_kv_grad(dk, groups, grad_dtype), _reduce_kv_grad(dv, groups, grad_dtype)
