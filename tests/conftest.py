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
