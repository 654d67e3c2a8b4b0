"""The one home of the private grouped-GEMM entry point (`torch._grouped_mm`, STYLE §8).

    grouped_mm(a, b, ends) -> out:  out[rows of group g] = a[rows of group g] @ b[g]

a (M, K) rows grouped contiguously; b (G, K, N) one matrix per group; ends (G,) int32, one past each group's
last row (cumulative counts; an empty group has the previous end). Its pure-torch twin is a loop over the groups
(`grouped_mm_reference`; model/moe.Experts._loop is the same loop fused with SwiGLU), and
tests/test_moe.py checks the two agree where the kernel runs (skipped on CPU).

Why the kernel: a MoE layer's experts are G small GEMMs over ragged row counts; one launch for all of them keeps
the counts on the device (no host sync, so a decode step stays CUDA-graph capturable) and fills the GPU where G
separate launches would not. Where it applies: CUDA, compute capability >= 9.0 (Hopper; the kernel is CUTLASS
sm90), bf16 operands, K and N multiples of 8 (16-byte rows). Everything else takes the loop.
"""
from __future__ import annotations

import torch


def grouped_mm_applies(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `grouped_mm(a, b.transpose(1, 2), ...)` can run the kernel: see the module docstring."""
    return (a.is_cuda and hasattr(torch, "_grouped_mm") and a.dtype == b.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(a.device) >= (9, 0)
            and a.shape[-1] % 8 == 0 and b.shape[-1] % 8 == 0 and b.shape[-2] % 8 == 0)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """a (M, K), b (G, K, N), ends (G,) int32 -> (M, N) (module docstring). Differentiable."""
    return torch._grouped_mm(a, b, offs=ends)


def grouped_mm_reference(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """The twin of `grouped_mm`: one matmul per group, on any device and dtype."""
    out, start = [], 0
    for g, end in enumerate(ends.tolist()):
        out.append(a[start:end] @ b[g])
        start = end
    return torch.cat(out)
