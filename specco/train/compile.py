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
micro-batch widths from recompiling. A checkpointed layer (train/activation_checkpointing.py) keeps its
checkpoint around the compiled forward: the forward saves only the layer's input, and the backward's recompute
runs the same compiled graph again (grad mode, the same shapes: no new graph). Under FSDP (parallel.dp_shard) the
compiled forward runs inside the sharded layer's unshard hooks. Only the trainer's copy is compiled: the rollout
engine decodes through its own fused kernels and never calls these forwards.

`apply_draft_compile(draft, backend)` (config train.compile_draft) does the same for the co-trained EAGLE-3
draft's per-pass layer work in its TTT forwards (`_DRAFT_METHODS`): on the H200 that draft's forward and backward
took ~29 ms per micro-batch for two rows, and one call is ~3,200 aten ops (CPU count at a small shape), so most of
it is likely dispatch and elementwise traffic rather than matmuls (not yet profiled on the GPU).

Not exact: inductor reorders fp32 arithmetic (tests: outputs and gradients against eager within 1e-5 on CPU
in fp32), so the PPO ratio of an unchanged policy is 1 to rounding rather than bit-exactly.
"""
from __future__ import annotations

import contextlib
import time

import torch
from torch import nn

from .train_config import COMPILE_BACKENDS
from ..model.draft import Eagle3Draft
from ..model.ttt import ttt_forward
from .activation_checkpointing import _layers, checkpointed, unwrap_layers

__all__ = ["COMPILE_BACKENDS", "apply_compile", "remove_compile", "warm_up", "apply_draft_compile",
           "remove_draft_compile", "warm_up_draft"]

# COMPILE_BACKENDS: "inductor", the fast one (CUDA, or CPU with a C++ compiler); "aot_eager", torch's
# debugging backend (the same graph capture and autograd, no code generation: no speedup), for checking
# that a model compiles at all; "none"
_COMPILED: dict = {}  # (class, backend, method name) -> its compiled method, shared by every instance and model


def _compiled(cls: type, backend: str, name: str):
    key = (cls, backend, name)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(getattr(cls, name), backend=backend, dynamic=True)
    return _COMPILED[key]


class _CompiledMethod:
    """An instance's method `name` (a decoder layer's forward, the draft's `_DRAFT_METHODS`) through the shared
    compiled function of its class's method. Holds the instance and the names only (the compiled function is
    looked up per call), so `copy.deepcopy` of the model rebinds it."""

    def __init__(self, obj: nn.Module, name: str, backend: str):
        self.obj, self.name, self.backend = obj, name, backend

    def __call__(self, *args):
        return _compiled(type(self.obj), self.backend, self.name)(self.obj, *args)


def _warm(module: nn.Module, amp_dtype: torch.dtype | None, run) -> float:
    """`run()` (a forward + backward and a no-grad forward that compile `module`'s graphs) under the step's
    autocast, then no gradient left behind and the device settled; returns the seconds it took."""
    t0 = time.perf_counter()
    p = next(module.parameters())
    with torch.autocast(p.device.type, dtype=amp_dtype) if amp_dtype is not None else contextlib.nullcontext():
        run()
    module.zero_grad(set_to_none=True)
    if p.is_cuda:
        torch.cuda.synchronize(p.device)
    return time.perf_counter() - t0


# The EAGLE-3 draft's per-pass work around its attention (model/ttt.py ttt_forward): the norms and concat before
# the projections, q/k/v with RoPE, the output projection, the residual and MLP. The trunk+branch attention (a
# custom autograd function) and the chunked, checkpointed loss stay eager.
_DRAFT_METHODS = (("midlayer", "attn_input"), ("midlayer.self_attn", "qkv"), ("midlayer.self_attn", "out"),
                  ("midlayer", "finish"))


def apply_draft_compile(draft: nn.Module, backend: str = "inductor") -> nn.Module:
    """Compile the EAGLE-3 draft's per-pass layer work (`_DRAFT_METHODS`) for its TTT forwards (config
    train.compile_draft): the draft's span of the train step is many small kernels, as the policy's eager
    layers were. Returns the draft."""
    if not isinstance(draft, Eagle3Draft):
        raise ValueError(f"apply_draft_compile: {type(draft).__name__} is not an EAGLE-3 draft; compiling a block "
                         "drafter is not implemented")
    if backend not in COMPILE_BACKENDS or backend == "none":
        raise ValueError(f"compile backend {backend!r}: use one of {', '.join(repr(b) for b in COMPILE_BACKENDS if b != 'none')}")
    for path, name in _DRAFT_METHODS:
        obj = draft.get_submodule(path)
        setattr(obj, name, _CompiledMethod(obj, name, backend))
    return draft


def warm_up_draft(draft: nn.Module, amp_dtype: torch.dtype | None, passes: int, rows: int = 2, width: int = 64
                  ) -> float:
    """`warm_up` for a compiled draft: its TTT forward and backward and a no-grad forward on zero taps, under
    the step's autocast; no gradient left behind. Returns the seconds it took."""
    dev, c = next(draft.parameters()).device, draft.cfg
    aux = torch.zeros(rows, width, len(c.aux_layer_ids) * c.hidden_size, device=dev)
    embed = torch.zeros(rows, width, c.hidden_size, device=dev)
    positions = torch.arange(width, device=dev).expand(rows, width)

    def run():
        sum(o.float().sum() for o in ttt_forward(draft, aux, embed, positions, passes)).backward()
        with torch.no_grad():
            ttt_forward(draft, aux, embed, positions, passes)
    return _warm(draft, amp_dtype, run)


def remove_draft_compile(draft: nn.Module) -> nn.Module:
    """Undo `apply_draft_compile`."""
    for path, name in _DRAFT_METHODS:
        obj = draft.get_submodule(path)
        if isinstance(obj.__dict__.get(name), _CompiledMethod):
            del obj.__dict__[name]
    return draft


def apply_compile(model: nn.Module, backend: str = "inductor") -> nn.Module:
    """Compile every decoder layer's training forward of `model` with `backend` (COMPILE_BACKENDS;
    "none" leaves it as it is); returns the model."""
    if backend not in COMPILE_BACKENDS:
        raise ValueError(f"compile backend {backend!r}: use one of {', '.join(map(repr, COMPILE_BACKENDS))}")
    if backend == "none":
        return model
    for layer in _layers(model):
        ckpt = checkpointed(layer)
        if ckpt is not None:  # checkpointed: the checkpoint runs (and recomputes) the compiled forward
            ckpt.inner = _CompiledMethod(layer, "forward", backend)
        elif "forward" in layer.__dict__ and not isinstance(layer.__dict__["forward"], _CompiledMethod):
            raise ValueError(f"apply_compile: the layers' forward is already wrapped "
                             f"({type(layer.__dict__['forward']).__name__}); compiling it is not implemented")
        else:
            layer.forward = _CompiledMethod(layer, "forward", backend)
    return model


def warm_up(model: nn.Module, amp_dtype: torch.dtype | None, rows: int = 2, width: int = 64) -> float:
    """Compile `model`'s layers now, not inside the first timed RL step: one no-grad forward and one forward +
    backward on a dummy batch (token 0), under the step's autocast. Leaves no gradient behind and
    touches no optimizer or RNG state; returns the seconds it took. With dynamic shapes, later widths and
    row counts reuse these graphs (tests/test_compile.py counts them)."""
    tokens = torch.zeros(rows, width, dtype=torch.long, device=next(model.parameters()).device)

    def run():  # the no-grad forward first: under FSDP one leaves the root and last layer gathered (not resharded
        # after forward), and an optimizer built after would hold those gathered tensors; the backward reshards
        with torch.no_grad():
            model(tokens)
        model(tokens).logits.float().sum().backward()
    return _warm(model, amp_dtype, run)


def warm_shapes(model: nn.Module, amp_dtype: torch.dtype | None, shapes: list[tuple[int, int]]) -> float:
    """One no-grad forward and one forward + backward of `model` on a dummy batch (token 0) at each (rows, width)
    of `shapes`, under the step's autocast (config train.warm_widths): kernels that plan per shape (cuDNN
    attention) plan now, before the timed RL steps. Leaves no gradient behind and touches no optimizer or RNG
    state; returns the seconds it took."""
    dev = next(model.parameters()).device

    def run():
        for rows, width in shapes:
            tokens = torch.zeros(rows, width, dtype=torch.long, device=dev)
            with torch.no_grad():  # first, as in warm_up (FSDP: the backward after it reshards)
                model(tokens)
            model(tokens).logits.float().sum().backward()
            model.zero_grad(set_to_none=True)  # one shape's gradients at a time
    return _warm(model, amp_dtype, run)


def remove_compile(model: nn.Module) -> nn.Module:
    """Undo `apply_compile` (a checkpointed layer stays checkpointed, around its own forward again)."""
    for layer in _layers(model):
        ckpt = checkpointed(layer)
        if ckpt is not None and isinstance(ckpt.inner, _CompiledMethod):
            ckpt.inner = None
    return unwrap_layers(model, _CompiledMethod)
