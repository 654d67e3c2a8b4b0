"""Atomic checkpoints that cannot run code: everything needed to resume a run bit-exactly.

A checkpoint is a directory `step_000012/` holding
  tensors.safetensors  every tensor of the state (weights, AdamW moments, RNG and sampler states)
  state.json           everything else, as JSON, with {"__tensor__": key} where a tensor was
Neither format can execute anything when read: safetensors is a header plus raw bytes, JSON is data.
(The old `state.pt` was a pickle, and a crafted pickle runs arbitrary code on load -- issue 16 -- so a
directory holding one is refused, never opened.) RNG states are tensors (torch, CUDA, samplers) or
lists of ints (Python's `random`, numpy's MT19937), so they round-trip exactly; floats round-trip
exactly through JSON (Python writes the shortest repr that reads back to the same double).

Writes are atomic: the directory is written under a temporary name, fsynced and renamed into place,
then `latest` (a one-line pointer) is replaced with os.replace. A crash at any point leaves the
previous checkpoints intact. Reads are confined: `latest` must name a `step_*` directory directly
inside the checkpoint root, and a newest checkpoint that is unreadable (truncated, damaged header,
missing keys, non-finite tensors) is reported and the previous intact one is used instead.
"""
from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

from ..faults import point

FORMAT = "specco-checkpoint-v2"
TENSORS, STATE = "tensors.safetensors", "state.json"
_STEP_DIR = re.compile(r"step_\d{6,}")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message names the file and what to do."""


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


# -- encoding: nested python values <-> (JSON tree, flat tensor dict) ------------------------------

def _encode(x, tensors: dict, path: str):
    """`x` as JSON data; tensors go into `tensors` under their path in the tree (unique by construction)."""
    if isinstance(x, torch.Tensor):
        # clone: state-dict entries may be views sharing storage (fused projections), which
        # safetensors refuses; also detaches from the live parameters while they keep training
        tensors[path] = x.detach().cpu().clone().contiguous()
        return {"__tensor__": path}
    if isinstance(x, torch.Generator):
        tensors[path] = x.get_state()
        return {"__generator__": path}
    if isinstance(x, np.ndarray):
        return {"__ndarray__": x.tolist(), "dtype": str(x.dtype)}
    if isinstance(x, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in x):
            return {k: _encode(v, tensors, f"{path}.{k}" if path else k) for k, v in x.items()}
        # int keys (optimizer state), or keys that would read as our markers: a list of pairs
        return {"__dict__": [[_encode(k, tensors, f"{path}.k{i}"), _encode(v, tensors, f"{path}.v{i}")]
                             for i, (k, v) in enumerate(x.items())]}
    if isinstance(x, tuple):
        return {"__tuple__": [_encode(v, tensors, f"{path}[{i}]") for i, v in enumerate(x)]}
    if isinstance(x, list):
        return [_encode(v, tensors, f"{path}[{i}]") for i, v in enumerate(x)]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    raise TypeError(f"checkpoint value at {path!r} has type {type(x).__name__}, which the checkpoint "
                    "format does not store (tensors, generators, numpy arrays and JSON values only)")


def _decode(x, tensors: dict, where: Path):
    if isinstance(x, list):
        return [_decode(v, tensors, where) for v in x]
    if not isinstance(x, dict):
        return x
    for marker in ("__tensor__", "__generator__"):
        if marker in x:
            if x[marker] not in tensors:
                raise CheckpointError(f"{where / STATE} refers to tensor {x[marker]!r}, which "
                                      f"{where / TENSORS} does not hold")
            return tensors[x[marker]]  # generators are restored from their state tensor by the caller
    if "__ndarray__" in x:
        return np.array(x["__ndarray__"], dtype=x["dtype"])
    if "__tuple__" in x:
        return tuple(_decode(v, tensors, where) for v in x["__tuple__"])
    if "__dict__" in x:
        return {_decode(k, tensors, where): _decode(v, tensors, where) for k, v in x["__dict__"]}
    return {k: _decode(v, tensors, where) for k, v in x.items()}


def _is_full_disk(e: BaseException) -> bool:
    return getattr(e, "errno", None) == errno.ENOSPC or "No space left" in str(e)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- writing --------------------------------------------------------------------------------------

def save_checkpoint(root: str | os.PathLike, step: int, state: dict, keep: int = 2) -> Path:
    """Write `state` (a dict of state_dicts / tensors / generators / JSON values) as checkpoint `step`.

    Generators are stored by their state (restored into the caller's generators by `load_checkpoint`).
    The global RNG states go in too. Keeps the newest `keep` checkpoints.
    """
    from safetensors.torch import save_file
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}_{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tensors: dict = {}
    meta = {"format": FORMAT, "state": _encode(state, tensors, ""), "rng": _encode(rng_state(), tensors, "rng")}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    try:
        tmp.mkdir()
        save_file(tensors, str(tmp / TENSORS))
        _fsync(tmp / TENSORS)
        point("checkpoint/tensors")
        (tmp / STATE).write_text(json.dumps(meta))
        _fsync(tmp / STATE)
        point("checkpoint/state")
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, Exception) and _is_full_disk(e):
            raise CheckpointError(f"no space left on the device while writing checkpoint {final} "
                                  f"({nbytes / 2**20:.1f} MiB of tensors): free space under {root}, or "
                                  "lower train.keep_checkpoints") from e
        raise
    return publish(tmp, final, keep, "checkpoint")


def publish(tmp: Path, final: Path, keep: int, tag: str, sync_rename: bool = False) -> Path:
    """Put a fully written checkpoint directory `tmp` in place as `final` (one rename), point `latest` at it and
    drop all but the newest `keep` step directories: the commit both checkpoint formats end with (this module's
    and sharded_checkpoint's). `sync_rename` fsyncs the parent after the rename; fault points `<tag>/renamed`,
    `<tag>/pointer`."""
    root = final.parent
    if final.exists():  # a re-run of a step after a crash between rename and pointer
        shutil.rmtree(final)
    os.replace(tmp, final)
    if sync_rename:
        _fsync(root)  # the rename itself durable
    point(f"{tag}/renamed")
    ptr = root / "latest.tmp"
    ptr.write_text(final.name + "\n")
    os.replace(ptr, root / "latest")
    point(f"{tag}/pointer")
    for old in _step_dirs(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def remove_stale_temporaries(root: str | os.PathLike) -> list[Path]:
    """Delete the `.tmp_step_*` directories of crashed writes (call only while holding the run lock:
    another live run's in-progress write looks the same)."""
    root = Path(root)
    stale = sorted(root.glob(".tmp_step_*")) if root.is_dir() else []
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    (root / "latest.tmp").unlink(missing_ok=True)
    return stale


# -- reading --------------------------------------------------------------------------------------

def _step_dirs(root: Path) -> list[Path]:
    """The checkpoint directories directly under `root`, oldest first."""
    return sorted(p for p in root.glob("step_*") if p.is_dir() and _STEP_DIR.fullmatch(p.name))


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The checkpoint `latest` points to, or None when there is no pointer. The pointer must name a
    `step_*` directory directly inside `root` (no paths, no links out): anything else is refused."""
    root = Path(root)
    ptr = root / "latest"
    if not ptr.exists():
        return None
    name = ptr.read_text().strip()
    path = (root / name).resolve()
    if not _STEP_DIR.fullmatch(name) or path.parent != root.resolve():
        raise CheckpointError(f"{ptr} points to {name!r}, which is not a step_* directory inside {root}: "
                              "the pointer was tampered with; delete it (the run then resumes from the "
                              "newest intact step_* directory)")
    return path


def load_checkpoint(path: str | os.PathLike, generators: dict[str, torch.Generator] | None = None,
                    restore_rng: bool = True) -> dict:
    """Load a checkpoint dict; restores global RNG states and the named generators in place.
    Raises CheckpointError naming the file and what is wrong with it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    path = Path(path)
    if (path / "state.pt").exists():
        raise CheckpointError(f"{path / 'state.pt'} is a pickle checkpoint (specco's old format); specco "
                              "does not unpickle checkpoints, because a pickle can run arbitrary code when "
                              f"loaded. Delete {path} (or the whole run directory) to start that run over")
    try:
        meta = json.loads((path / STATE).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path / STATE} is missing: {path} is not a complete checkpoint") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path / STATE} is not valid JSON ({e}): the file is damaged") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path / STATE}: format {meta.get('format') if isinstance(meta, dict) else None!r}"
                              f", expected {FORMAT!r}")
    try:
        tensors = load_file(str(path / TENSORS))
    except FileNotFoundError:
        raise CheckpointError(f"{path / TENSORS} is missing: {path} is not a complete checkpoint") from None
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path / TENSORS} cannot be read ({e}): the file is truncated or damaged") from None
    for k, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"{path / TENSORS}: tensor {k!r} holds NaN or infinite values")
    if not all(isinstance(meta.get(k), dict) for k in ("state", "rng")):
        raise CheckpointError(f"{path / STATE} lacks its 'state' or 'rng' table: not a specco checkpoint")
    # A state.json whose values have the wrong type (edited by hand, or damaged into other valid JSON: a
    # "__tuple__" that is a number, an unhashable tensor key, an RNG state of the wrong shape) fails in the
    # decoding or in torch / random / numpy's setters with a bare TypeError or ValueError that names nothing:
    # name the file instead.
    try:
        payload = {**_decode(meta["state"], tensors, path), "__rng__": _decode(meta["rng"], tensors, path)}
        if restore_rng:
            set_rng_state(payload["__rng__"])
        for k, g in (generators or {}).items():
            if k not in payload:
                raise CheckpointError(f"{path / STATE} has no sampler state {k!r}")
            g.set_state(payload[k])
    except (TypeError, ValueError, KeyError, AttributeError, RuntimeError) as e:
        raise CheckpointError(f"{path / STATE} holds a value of the wrong type ({type(e).__name__}: {e}): the file "
                              "was damaged or edited") from None
    return payload


def load_latest(root: str | os.PathLike, generators: dict[str, torch.Generator] | None = None,
                restore_rng: bool = True, say=None) -> tuple[Path, dict] | None:
    """(path, payload) of the newest intact checkpoint under `root`, or None when there is none.

    A newer one that fails to load is reported through `say` (default: stderr) and skipped, so a
    checkpoint damaged after it was written (a truncated copy, a bad disk) costs the steps since the
    previous one, not the run. Refusals for security (a pickle, a tampered pointer) are not skipped.
    """
    root = Path(root)
    say = say or (lambda m: print(m, file=sys.stderr, flush=True))
    pointed = latest_checkpoint(root)  # validates the pointer even when the directories decide
    failures = []
    for cand in reversed(_step_dirs(root)):
        if (cand / "state.pt").exists():
            load_checkpoint(cand, restore_rng=False)  # raises the refusal, naming the file
        try:
            payload = load_checkpoint(cand, generators, restore_rng)
        except CheckpointError as e:
            failures.append(str(e))
            say(f"specco: checkpoint {cand} is unusable: {e}")
            continue
        if failures:
            say(f"specco: resuming from the previous intact checkpoint {cand}")
        elif pointed is not None and pointed != cand:
            say(f"specco: {root / 'latest'} names {pointed.name}; resuming from the newer complete {cand.name}")
        return cand, payload
    if failures:
        raise CheckpointError(f"no intact checkpoint under {root}: " + "; ".join(failures)
                              + f". Delete {root} to restart this arm from its beginning")
    if pointed is not None:
        raise CheckpointError(f"{root / 'latest'} points to {pointed}, which does not exist: the checkpoint "
                              "directory was modified by hand; delete `latest` to start over")
    return None
