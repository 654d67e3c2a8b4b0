"""torch.compile of the policy's decoder layers for its training forwards, applied from outside the model.

Why: at the long workload's shape (configs/long.toml: 316M parameters, 16-row micro-batches of ~1,300
tokens, bf16 autocast) the eager train step and log-prob recompute ran at ~1/6 of their matmul floor. The
profile (bench/logprob_recompute.py --profile) is ~3/4 elementwise kernels (the fp32 RMSNorms, RoPE,
SwiGLU, residual adds, autocast casts), each a full read and write of a (rows, S, h) tensor; inductor fuses
them into the matmuls' neighbours.

`apply_compile(policy, backend)` replaces each decoder layer's `forward` (an instance attribute, as
activation checkpointing does; the model's code stays plain) by one compiled function of the layer class's
own forward, shared by every layer: with torch's inlining of nn.Modules the layer's parameters are graph
inputs, so 28 layers compile one graph per mode (train, no-grad), and `dynamic=True` keeps the varying
micro-batch widths from recompiling. Only the trainer's copy is compiled: the rollout engine decodes
through its own fused kernels and never calls these forwards.

Not exact: inductor reorders fp32 arithmetic (tests: outputs and gradients against eager within 1e-5 on CPU
in fp32), so the PPO ratio of an unchanged policy is 1 to rounding rather than bit-exactly.
"""
from __future__ import annotations

import contextlib
import time

import torch
from torch import nn

from ..config import COMPILE_BACKENDS
from .activation_checkpointing import _layers, unwrap_layers

__all__ = ["COMPILE_BACKENDS", "apply_compile", "remove_compile", "warm_up"]

# COMPILE_BACKENDS: "inductor", the fast one (CUDA, or CPU with a C++ compiler); "aot_eager", torch's
# debugging backend (the same graph capture and autograd, no code generation: no speedup), for checking
# that a model compiles at all; "none"
_COMPILED: dict = {}  # (layer class, backend) -> its compiled forward, shared by every layer and model


def _compiled(cls: type, backend: str):
    key = (cls, backend)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(cls.forward, backend=backend, dynamic=True)
    return _COMPILED[key]


class _CompiledForward:
    """A layer's forward through the shared compiled function. Holds the layer and the backend's name
    only (the compiled function is looked up per call), so `copy.deepcopy` of the model rebinds it."""

    def __init__(self, layer: nn.Module, backend: str):
        self.layer, self.backend = layer, backend

    def __call__(self, x, cos, sin, attn_core=None):  # DecoderLayer.forward's signature
        return _compiled(type(self.layer), self.backend)(self.layer, x, cos, sin, attn_core)


def apply_compile(model: nn.Module, backend: str = "inductor") -> nn.Module:
    """Compile every decoder layer's training forward of `model` with `backend` (COMPILE_BACKENDS;
    "none" leaves it as it is); returns the model."""
    if backend not in COMPILE_BACKENDS:
        raise ValueError(f"compile backend {backend!r}: use one of {', '.join(map(repr, COMPILE_BACKENDS))}")
    if backend == "none":
        return model
    for layer in _layers(model):
        if "forward" in layer.__dict__ and not isinstance(layer.__dict__["forward"], _CompiledForward):
            raise ValueError("apply_compile: the layers' forward is already wrapped (activation checkpointing?); "
                             "compiling a checkpointed layer is not implemented")
        layer.forward = _CompiledForward(layer, backend)
    return model


def warm_up(model: nn.Module, amp_dtype: torch.dtype | None, rows: int = 2, width: int = 64) -> float:
    """Compile `model`'s layers now, not inside the first timed RL step: one forward + backward and one
    no-grad forward on a dummy batch (token 0), under the step's autocast. Leaves no gradient behind and
    touches no optimizer or RNG state; returns the seconds it took. With dynamic shapes, later widths and
    row counts reuse these graphs (tests/test_compile.py counts them)."""
    t0 = time.perf_counter()
    p = next(model.parameters())
    tokens = torch.zeros(rows, width, dtype=torch.long, device=p.device)
    amp = torch.autocast(p.device.type, dtype=amp_dtype) if amp_dtype is not None else contextlib.nullcontext()
    with amp:
        model(tokens).logits.float().sum().backward()
        with torch.no_grad():
            model(tokens)
    model.zero_grad(set_to_none=True)
    if p.is_cuda:
        torch.cuda.synchronize(p.device)
    return time.perf_counter() - t0


def remove_compile(model: nn.Module) -> nn.Module:
    """Undo `apply_compile`."""
    return unwrap_layers(model, _CompiledForward)
