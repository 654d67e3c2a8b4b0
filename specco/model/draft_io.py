"""The on-disk layout of specco's drafts (EAGLE-3 and block drafters alike): one home for writing and
reading it. A draft directory holds

    model.safetensors    the state dict under its `state_dict()` keys (the HF layout of the fused
                         projections, layers.fuse_linears)
    draft_config.json    {"architecture": "specco.<Class>", **config}

each written atomically (a temporary file, then os.replace), so a crash never leaves half a file.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .config import ConfigError


def save_draft_dir(model: torch.nn.Module, path: str | os.PathLike, architecture: str, config: dict) -> None:
    from safetensors.torch import save_file
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # clone: the fused projections' state-dict entries are views sharing one tensor, which safetensors refuses
    sd = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    tmp = path / "model.safetensors.tmp"
    save_file(sd, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path / "model.safetensors")
    tmp = path / "draft_config.json.tmp"
    tmp.write_text(json.dumps({"architecture": architecture, **config}, indent=2))
    os.replace(tmp, path / "draft_config.json")


def read_draft_config(path: str | os.PathLike, architecture: str, legacy_ok: bool = False) -> dict:
    """draft_config.json of `path` without its "architecture", which must be `architecture` (or absent,
    for `legacy_ok`: EAGLE-3 directories written before the field existed)."""
    f = Path(path) / "draft_config.json"
    if not f.exists():
        raise FileNotFoundError(f"{f} not found: not a specco draft directory")
    d = json.loads(f.read_text())
    arch = d.pop("architecture", None)
    if arch != architecture and not (legacy_ok and arch is None):
        raise ConfigError(f"{f} holds a {arch!r} draft, not a {architecture!r} one")
    return d


def load_draft_weights(model: torch.nn.Module, path: str | os.PathLike, device, dtype) -> torch.nn.Module:
    from safetensors.torch import load_file
    model.load_state_dict(load_file(str(Path(path) / "model.safetensors")), strict=True)
    return model.to(device=device, dtype=dtype)
