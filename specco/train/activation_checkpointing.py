"""Activation checkpointing of the policy's decoder layers, applied from outside the model.

Why: at long context the policy's saved activations dominate a training step's memory (the
316M-parameter, 28-layer policy of configs/gpu.toml peaked at 47.9 GiB for one 32K-token sequence,
BENCHMARKS.md). With `apply_activation_checkpointing(policy)` each decoder layer keeps only its
input; its internals (q/k/v, attention output, MLP intermediates) are recomputed during the
backward — one extra layer forward per layer, no change to any value or gradient (tested in fp64,
single process and under context parallelism).

It wraps each layer's `forward` (an instance attribute; the model's own code stays plain):
cached decoding and no-grad forwards (log-prob recompute, rollouts) bypass the checkpoint. Under
context parallelism the recomputed forward runs the ring again inside the backward; every rank
recomputes the same layers in the same order, so the ring's sends and receives still pair up.
The draft's taps are layer outputs, which checkpointing keeps anyway.
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["apply_activation_checkpointing", "remove_activation_checkpointing", "checkpointed"]


class _CheckpointedForward:
    """A layer's forward that recomputes its activations in the backward. A callable object holding the
    layer (not a closure), so `copy.deepcopy` of the model rebinds it to the copied layer. `inner` is the
    forward it checkpoints: None for the layer class's own, or the instance forward the layer had when it was
    wrapped or was given after (train/compile.py's compiled forward), so checkpointing and compiling compose in
    either order: the recompute runs the same compiled graph again."""

    def __init__(self, layer: nn.Module, inner=None):
        self.layer, self.inner = layer, inner

    def __call__(self, x, cos, sin, attn_core=None):  # DecoderLayer.forward's signature
        fn = self.inner or functools.partial(type(self.layer).forward, self.layer)
        if not torch.is_grad_enabled():
            return fn(x, cos, sin, attn_core)
        return checkpoint(fn, x, cos, sin, attn_core, use_reentrant=False)


def _layers(model: nn.Module):
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no `layers`: activation checkpointing wraps a "
                         "Policy's decoder layers")
    return layers.values() if isinstance(layers, nn.ModuleDict) else layers


def apply_activation_checkpointing(model: nn.Module) -> nn.Module:
    """Checkpoint every decoder layer of `model` (idempotent) around the forward it has (its class's, or an
    instance forward such as a compiled one); returns the model."""
    for layer in _layers(model):
        fwd = layer.__dict__.get("forward")
        if not isinstance(fwd, _CheckpointedForward):
            layer.forward = _CheckpointedForward(layer, fwd)
    return model


def remove_activation_checkpointing(model: nn.Module) -> nn.Module:
    """Undo `apply_activation_checkpointing`: each layer keeps the forward it checkpointed."""
    for layer in _layers(model):
        fwd = layer.__dict__.get("forward")
        if isinstance(fwd, _CheckpointedForward):
            del layer.forward
            if fwd.inner is not None:
                layer.forward = fwd.inner
    return model


def checkpointed(layer: nn.Module) -> _CheckpointedForward | None:
    """The layer's checkpointing wrapper, or None where it runs unchecked."""
    fwd = layer.__dict__.get("forward")
    return fwd if isinstance(fwd, _CheckpointedForward) else None


def unwrap_layers(model: nn.Module, wrapper: type) -> nn.Module:
    """Drop every decoder layer's instance `forward` of type `wrapper` (this one or train/compile.py's), so
    the layer's own forward runs again; returns the model."""
    for layer in _layers(model):
        if isinstance(layer.__dict__.get("forward"), wrapper):
            del layer.forward
    return model
