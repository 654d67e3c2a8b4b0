"""Atomic checkpoints: everything needed to resume a run bit-exactly.

A checkpoint is a directory `step_000012/` holding `state.pt` (policy, draft, optimizer with its
per-group LRs, scheduler, RNG states, step, data position, metadata). It is written into a
temporary sibling directory and renamed into place, and `latest` is a one-line file replaced with
os.replace, so a crash mid-write leaves the previous checkpoint and pointer intact.
"""
from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": np.random.get_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    if s.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def save_checkpoint(root: str | os.PathLike, step: int, state: dict, keep: int = 2) -> Path:
    """Write `state` (a dict of state_dicts / tensors / python values) as checkpoint `step`.

    Generators (torch.Generator) in `state` are stored by their state. Keeps the newest `keep`.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}_{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    payload = {k: (("__generator__", v.get_state()) if isinstance(v, torch.Generator) else v)
               for k, v in state.items()}
    payload["__rng__"] = rng_state()
    torch.save(payload, tmp / "state.pt")
    with open(tmp / "state.pt", "rb") as f:
        os.fsync(f.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    ptr = root / "latest.tmp"
    ptr.write_text(final.name + "\n")
    os.replace(ptr, root / "latest")
    ckpts = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in ckpts[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    root = Path(root)
    ptr = root / "latest"
    if not ptr.exists():
        return None
    path = root / ptr.read_text().strip()
    if not (path / "state.pt").exists():
        raise FileNotFoundError(f"{ptr} points to {path}, which has no state.pt: the checkpoint "
                                "directory was modified by hand; delete `latest` to start over")
    return path


def load_checkpoint(path: str | os.PathLike, generators: dict[str, torch.Generator] | None = None,
                    restore_rng: bool = True) -> dict:
    """Load a checkpoint dict; restores global RNG states and the named generators in place."""
    payload = torch.load(Path(path) / "state.pt", map_location="cpu", weights_only=False)
    if restore_rng:
        set_rng_state(payload.pop("__rng__"))
    for k, v in list(payload.items()):
        if isinstance(v, tuple) and len(v) == 2 and v[0] == "__generator__":
            if generators and k in generators:
                generators[k].set_state(v[1])
            payload[k] = v[1]
    return payload
