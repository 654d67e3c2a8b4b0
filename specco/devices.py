"""Device names from the command line -> torch.device, refused with a one-line fix when unusable.

One function for every command that takes `--device`, so an unknown name (`gpu`) or a device this
machine lacks (`cuda` without CUDA) fails before any work, with the option's name and what to pass,
instead of a torch traceback from the first tensor moved there.
"""
from __future__ import annotations

import torch

from .model.config import ConfigError


def resolve_device(name: str, option: str = "--device") -> torch.device:
    """`name` ("auto", "cpu", "cuda", "cuda:N", "mps") -> torch.device, checked usable on this machine.

    "auto" is cuda when available, else cpu. Raises ConfigError naming `option` and the fix."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise ConfigError(f"{option} {name!r} is not a device name; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{option} {name}: CUDA is not available on this machine "
                              f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}); use {option} cpu")
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            raise ConfigError(f"{option} {name}: this machine has {n} CUDA device(s), cuda:0..cuda:{n - 1}; "
                              f"use one of them or {option} cuda")
        return dev
    if dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise ConfigError(f"{option} {name}: MPS is not available on this machine; use {option} cpu")
        return dev
    raise ConfigError(f"{option} {name!r}: specco runs on cpu, cuda or mps; use {option} cpu or {option} cuda")
