"""The one home of the grouped-GEMM entry point (`torch.nn.functional.grouped_mm`, public from torch 2.10; before
that the private `torch._grouped_mm`, STYLE §8).

    grouped_mm(a, b, ends) -> out:  out[rows of group g] = a[rows of group g] @ b[g]

a (M, K) rows grouped contiguously; b (G, K, N) one matrix per group; ends (G,) int32, one past each group's
last row (cumulative counts; an empty group has the previous end). Its pure-torch twin is a loop over the groups
(`grouped_mm_reference`; model/moe.expert_ffn_loop is the same loop fused with SwiGLU), and
tests/test_moe.py checks the two agree, outputs and gradients, where the kernel runs: on CPU in fp32 (torch >= 2.9
has a CPU kernel, which specco uses only in that test) and on a Hopper GPU in bf16.

Why the kernel: a MoE layer's experts are G small GEMMs over ragged row counts; one launch for all of them keeps
the counts on the device (no host sync, so a decode step stays CUDA-graph capturable) and fills the GPU where G
separate launches would not. Where it applies: CUDA, compute capability >= 9.0 (Hopper; the kernel is CUTLASS
sm90), bf16 operands, K and N multiples of 8 (16-byte rows). Everything else takes the loop.
"""
from __future__ import annotations

import torch


_KERNEL = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm_applies(a: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether the kernel can run on rows like `a` (M, K) against each of `weights` (G, ·, ·) (either orientation:
    both of a weight's matrix dims must be multiples of 8): see the module docstring."""
    return (a.is_cuda and _KERNEL is not None and a.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(a.device) >= (9, 0) and a.shape[-1] % 8 == 0
            and all(w.dtype == torch.bfloat16 and w.shape[-1] % 8 == 0 and w.shape[-2] % 8 == 0 for w in weights))


def grouped_mm(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """a (M, K), b (G, K, N), ends (G,) int32 -> (M, N) (module docstring). Differentiable."""
    return _KERNEL(a, b, offs=ends)


def grouped_mm_reference(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """The twin of `grouped_mm`: one matmul per group, on any device and dtype."""
    out, start = [], 0
    for g, end in enumerate(ends.tolist()):
        out.append(a[start:end] @ b[g])
        start = end
    return torch.cat(out)
