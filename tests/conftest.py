"""Suite-wide setup.

Without CUDA, run specco's Triton kernels (the fused branch and merge kernels) under Triton's CPU
interpreter, so CI checks them against their pure-torch twins too. The variable must be set before
`specco.ops.attention` decorates its kernels, i.e. before any test module imports it; with CUDA the
compiled kernels are tested instead. Triton itself comes from the `test` extra (pyproject.toml).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _restore_float32_matmul_precision():
    """A run on CUDA sets torch's float32 matmul precision to "high" (runner.demo), which also switches the
    engine's fp32 decode attention to TF32 (ops/decode_attention._ieee): restore it after every test so a
    later test's tolerances never depend on which tests ran before it."""
    prev = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(prev)
