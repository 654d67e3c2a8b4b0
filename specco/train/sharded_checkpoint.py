"""Sharded checkpoints that reshard and cannot run code: models + optimizers saved per rank with
`torch.distributed.checkpoint` (DCP), loadable at another data-parallel layout.

    save(root, step, {"policy": fsdp_policy, "draft": draft, "opt": opt, "data_offset": 7})   # collective
    extra = load(path, {"policy": policy, "draft": draft, "opt": opt})                      # collective

A value that is an `nn.Module` is a model, an `Optimizer` an optimizer over those models' parameters, anything
else JSON-able run state (returned by `load`). The models may be FSDP2-sharded (DTensor parameters and AdamW
moments) or whole (a replicated draft, a single process): `torch.distributed.checkpoint.state_dict`'s
`get_*_state_dict` name every tensor by its fully-qualified name in the unsharded model (`policy.layers.0.…`,
AdamW moments `opt.state.policy.layers.0.….exp_avg`) with its GLOBAL shape, each rank contributing the chunk it
holds; `load` asks each rank's current layout for its chunks and DCP reads exactly the overlapping slices of
the saved chunks (dp_shard 2 -> 4 or -> 1). Replicated tensors (the draft, AdamW's `step` counters) are written
once, by one rank (DCP's save-plan deduplication).

A checkpoint is a directory `step_000012/`:
  shards/shard-0000r-model-00001-of-00001.safetensors   one per rank that wrote anything: its chunks
  state.json                                            the manifest (below), optimizer hyper-parameters, run state

Why this storage (no checkpoint read can execute code, issue 34 item 4). DCP's default FileSystemWriter keeps
its global metadata — which chunk of which tensor sits at which byte offset of which file — in `.metadata`, a
PICKLE read with `pickle.load`: a crafted one runs arbitrary code on load. Its non-tensor values are `torch.save`d
byte blobs too. Instead: torch's HuggingFaceStorageWriter with `save_distributed=True` writes each rank's chunks
as one safetensors file whose JSON header carries, per tensor, the chunk's offsets in the global tensor
(`saved_offsets`); no `.metadata` is written, and HuggingFaceStorageReader rebuilds DCP's metadata from those
headers (`safe_open`: JSON header + raw bytes) and reads slices with `get_slice`. Only tensors go through DCP;
everything else (param_groups, run state) is JSON in state.json, encoded as train/checkpoint.py encodes it.
Nothing in either path calls pickle or torch.load.

The manifest closes what the HF reader leaves open: it rebuilds metadata from whatever `*.safetensors` files it
finds, so a missing rank's file would just leave those chunks unread (the model keeping its fresh values,
silently). state.json lists every shard file with its size, and every tensor with its global shape and dtype;
`load` refuses, naming the file or key, a missing or resized shard, any file it did not write (e.g. a planted
`.metadata` pickle: never opened), a tensor missing or extra or reshaped against the model being loaded.

Writes are atomic as train/checkpoint.py's: every rank writes into `root/.tmp_step_000012/`; after DCP's closing
collective (every rank's files written and fsynced) rank 0 writes state.json, renames the directory into place
and replaces the `latest` pointer; a crash anywhere before the rename leaves only a temporary directory that
readers never look at (`checkpoint.remove_stale_temporaries` deletes it). `root` must be one filesystem seen by
every rank (a shared or node-local disk for one node), as for any DCP checkpoint.

Not here: RNG states (per rank: the caller's run state), the sampler state, the LR scheduler (its state_dict is
JSON-able: pass it as run state).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from ..faults import point
from .checkpoint import CheckpointError, _decode, _encode, _fsync, _step_dirs, latest_checkpoint, publish

__all__ = ["save", "load", "load_latest", "FORMAT", "PickleRefused"]

FORMAT = "specco-sharded-checkpoint-v1"
STATE, SHARDS = "state.json", "shards"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _split(state: dict) -> tuple[nn.ModuleDict, dict, dict]:
    """(the models as one ModuleDict — so that FQNs are `policy.…`, `draft.…` and one optimizer may span
    several models —, the optimizers, the JSON run state)."""
    models = {k: v for k, v in state.items() if isinstance(v, nn.Module)}
    optims = {k: v for k, v in state.items() if isinstance(v, torch.optim.Optimizer)}
    extra = {k: v for k, v in state.items() if k not in models and k not in optims}
    for k in state:
        if "." in k:
            raise ValueError(f"checkpoint entry {k!r}: names may not contain '.' (they prefix tensor names)")
    return nn.ModuleDict(models), optims, extra


def _model_tensors(container: nn.ModuleDict) -> dict:
    """The models' parameters and persistent buffers by FQN, detached views of the live tensors (DTensor shards
    under FSDP: `load` fills them in place). Not `get_model_state_dict`: it goes through `state_dict()`, whose
    hooks (model/layers.fuse_linears) rename the fused projections to the HF parts (`q_proj`, …) — row slices of
    a dim-0-sharded DTensor, which no rank holds whole. A training checkpoint keeps the fused tensors as they are
    sharded; the HF layout is the exported policy's (model/hf_io.py)."""
    out = {n: p.detach() for n, p in container.named_parameters()}
    for mod_name, mod in container.named_modules():
        for b_name, b in mod.named_buffers(recurse=False):
            if b is not None and b_name not in mod._non_persistent_buffers_set:
                out[f"{mod_name}.{b_name}"] = b.detach()
    return out


def _flat_state(container: nn.ModuleDict, optims: dict) -> tuple[dict, dict]:
    """Every tensor of the models and optimizers as {dcp_key: tensor} (DTensors stay sharded), and what is
    not a tensor as JSON-able {opt_name: {"param_groups": …, "scalars": {fqn: {k: v}}}}.

    get_optimizer_state_dict creates AdamW's state (a step at lr 0 with zero gradients) when it is empty, so
    a freshly built optimizer yields the same keys and layouts as the one that was saved: the load template."""
    flat = {f"model.{k}": v for k, v in _model_tensors(container).items()}
    rest = {}
    for name, opt in optims.items():
        osd = get_optimizer_state_dict(container, opt)
        scalars = {}
        for fqn, st in osd["state"].items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    flat[f"{name}.state.{fqn}.{k}"] = v
                else:  # a Python number kept in state (e.g. a step counter of other optimizers)
                    scalars.setdefault(fqn, {})[k] = v
        rest[name] = {"param_groups": osd["param_groups"], "scalars": scalars}
    return flat, rest


def _json(x, where: str):
    """`x` encoded as train/checkpoint.py encodes state (tuples, int keys), refusing tensors: a tensor outside
    the DCP state dict would have no shard to go to."""
    tensors: dict = {}
    enc = _encode(x, tensors, where)
    if tensors:
        raise TypeError(f"checkpoint run state {where!r} holds tensors ({sorted(tensors)[:3]}): pass models and "
                        "optimizers as such, convert other tensors to lists")
    return enc


class PickleRefused(CheckpointError):
    """A checkpoint holding a pickle: refused, and never skipped for an older one (someone planted it)."""


# -- writing --------------------------------------------------------------------------------------

def save(root: str | os.PathLike, step: int, state: dict, keep: int = 2) -> Path:
    """Write checkpoint `step` of `state` (models, optimizers, JSON run state) under `root`; collective (every
    rank of the default group calls it with its own shards). Keeps the newest `keep` checkpoints. Returns the
    checkpoint directory."""
    root = Path(root)
    final, tmp = root / f"step_{step:06d}", root / f".tmp_step_{step:06d}"
    container, optims, extra = _split(state)
    flat, rest = _flat_state(container, optims)
    meta = {"format": FORMAT, "step": step, "world": dist.get_world_size() if dist.is_initialized() else 1,
            "tensors": {k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
                        for k, v in flat.items()},
            "optimizers": {k: _json(v, k) for k, v in rest.items()}, "extra": _json(extra, "extra")}
    if _rank() == 0:  # a crashed earlier write of this step may have left its temporary directory
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / SHARDS).mkdir(parents=True)
    _barrier()
    # every rank writes its own file (shard_index = rank + 1); fsynced (FileSystemWriter's sync_files). DCP's
    # closing collective returns only when every rank's write has finished.
    dcp.save(flat, storage_writer=HuggingFaceStorageWriter(str(tmp / SHARDS), save_distributed=True),
             no_dist=not dist.is_initialized())
    point("sharded_checkpoint/shards")
    if _rank() == 0:
        meta["files"] = {p.name: p.stat().st_size for p in sorted((tmp / SHARDS).iterdir())}
        (tmp / STATE).write_text(json.dumps(meta))
        _fsync(tmp / STATE)
        point("sharded_checkpoint/state")
        publish(tmp, final, keep, "sharded_checkpoint", sync_rename=True)
    _barrier()  # no rank starts the next write (or a read) before the rename
    return final


# -- reading --------------------------------------------------------------------------------------

def _manifest(path: Path) -> dict:
    """state.json, validated: every refusal names the file. Every rank reads it itself and reaches the same
    verdict (same bytes), so a refusal raises on all ranks and no collective is left waiting."""
    f = path / STATE
    if (path / "state.pt").exists() or (path / SHARDS / ".metadata").exists():
        bad = path / "state.pt" if (path / "state.pt").exists() else path / SHARDS / ".metadata"
        raise PickleRefused(f"{bad} is a pickle (an old specco checkpoint or DCP's default metadata); specco "
                              "never unpickles a checkpoint, because a pickle can run arbitrary code when loaded")
    try:
        meta = json.loads(f.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{f} is missing: {path} is not a complete sharded checkpoint") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{f} is not valid JSON ({e}): the file is damaged") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(f"{f}: format {got!r}, expected {FORMAT!r}")
    kinds = {"step": int, "files": dict, "tensors": dict, "optimizers": dict, "extra": dict}
    for k, t in kinds.items():
        if not isinstance(meta.get(k), t):
            raise CheckpointError(f"{f}: {k!r} is {type(meta.get(k)).__name__}, expected {t.__name__}: the file "
                                  "was damaged or edited")
    for k, v in meta["tensors"].items():
        if not (isinstance(v, dict) and isinstance(v.get("shape"), list) and isinstance(v.get("dtype"), str)
                and all(isinstance(n, int) for n in v["shape"])):
            raise CheckpointError(f"{f}: tensor entry {k!r} is {v!r}, expected {{'shape': [int…], 'dtype': str}}")
    # the shard files: exactly those listed, each of its listed size (a truncated copy fails here, not in DCP)
    listed, shards = meta["files"], path / SHARDS
    present = {p.name for p in shards.iterdir()} if shards.is_dir() else set()
    for name, size in sorted(listed.items()):
        if name not in present:
            raise CheckpointError(f"{shards / name} is missing: the checkpoint {path} lacks a rank's shard file "
                                  "(incomplete copy?)")
        if (shards / name).stat().st_size != size:
            raise CheckpointError(f"{shards / name} holds {(shards / name).stat().st_size} bytes, {f} says {size}: "
                                  "the file is truncated or damaged")
    for name in sorted(present - set(listed)):
        raise CheckpointError(f"{shards / name} is not part of the checkpoint ({f} does not list it); specco reads "
                              "only the files it wrote: remove it")
    return meta


def _restore_optimizer(meta_opt, template: dict, where: Path) -> dict:
    """The optimizer state dict for set_optimizer_state_dict: the loaded tensors of `template` (its
    'state'), the JSON scalars and param_groups of the checkpoint."""
    try:
        saved = _decode(meta_opt, {}, where)
        groups, scalars = saved["param_groups"], saved["scalars"]
        state = {fqn: dict(st) for fqn, st in template["state"].items()}
        for fqn, st in scalars.items():
            state.setdefault(fqn, {}).update(st)
        names = [sorted(g["params"]) for g in groups]
    except (TypeError, KeyError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{where / STATE}: an optimizer entry has the wrong type or shape ({type(e).__name__}: "
                              f"{e}): the file was damaged or edited") from None
    expected = [sorted(g["params"]) for g in template["param_groups"]]
    if names != expected:
        raise CheckpointError(f"{where / STATE}: the optimizer's parameter groups name other parameters than the "
                              f"model's ({[len(n) for n in names]} vs {[len(n) for n in expected]} per group)")
    return {"state": state, "param_groups": groups}


def load(path: str | os.PathLike, state: dict) -> dict:
    """Load checkpoint `path` into the models and optimizers of `state` (any layout: DTensor shards are filled
    from the overlapping saved chunks) and return its JSON run state; collective. Build the optimizers over the
    (sharded) models first, as for training. Raises CheckpointError naming the file or tensor at fault."""
    path = Path(path)
    meta = _manifest(path)
    container, optims, _ = _split(state)
    flat, _ = _flat_state(container, optims)  # the template: this layout's shards, filled in place below
    saved = meta["tensors"]
    for k in sorted(set(flat) - set(saved)):
        raise CheckpointError(f"{path / STATE} has no tensor {k!r}: the checkpoint is of another model or optimizer")
    for k in sorted(set(saved) - set(flat)):
        raise CheckpointError(f"{path / STATE} holds tensor {k!r}, which the model being loaded lacks")
    for k, t in flat.items():
        if list(t.shape) != saved[k]["shape"] or str(t.dtype).removeprefix("torch.") != saved[k]["dtype"]:
            raise CheckpointError(f"{path / STATE}: tensor {k!r} was saved as {saved[k]['dtype']}{saved[k]['shape']}, "
                                  f"the model has {t.dtype}{list(t.shape)}")
    for name, opt in optims.items():
        if name not in meta["optimizers"]:
            raise CheckpointError(f"{path / STATE} has no optimizer {name!r}")
    try:
        with warnings.catch_warnings():  # one process (no group) is a layout we mean, not an accident
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(flat, storage_reader=HuggingFaceStorageReader(str(path / SHARDS)),
                     no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as e:  # a damaged safetensors header, a short read: DCP gathers
        # every rank's failure into one CheckpointException (a BaseException), raised on all ranks
        causes = getattr(e, "failures", {}) or {None: e}
        why = "; ".join(f"{type(c).__name__}: {str(c).splitlines()[-1] if str(c) else ''}" for c in causes.values())
        raise CheckpointError(f"{path / SHARDS}: reading the shards failed ({why}): a shard file is damaged") from None
    # the model's tensors were filled in place (`_model_tensors` are views of the live parameters and buffers)
    for name, opt in optims.items():
        template = get_optimizer_state_dict(container, opt)  # the fqn -> tensor nesting; tensors refilled below
        for fqn, st in template["state"].items():
            for k in st:
                if f"{name}.state.{fqn}.{k}" in flat:
                    st[k] = flat[f"{name}.state.{fqn}.{k}"]
        set_optimizer_state_dict(container, opt, _restore_optimizer(meta["optimizers"][name], template, path))
    try:
        return _decode(meta["extra"], {}, path)
    except (TypeError, KeyError, ValueError) as e:
        raise CheckpointError(f"{path / STATE}: the run state has the wrong type ({type(e).__name__}: {e})") from None


def load_latest(root: str | os.PathLike, state: dict, say=None) -> tuple[Path, dict] | None:
    """(path, run state) of the newest loadable checkpoint under `root`, loaded into `state`; None when there is
    none. A newer one that is damaged is reported through `say` and skipped (as train/checkpoint.load_latest);
    a pickle is refused, never skipped. Every rank walks the same directories and reaches the same verdicts."""
    root = Path(root)
    say = say or (lambda m: print(m, file=sys.stderr, flush=True))
    latest_checkpoint(root)  # validates the pointer (no path out of root)
    failures = []
    for cand in reversed(_step_dirs(root)):
        try:
            return cand, load(cand, state)
        except PickleRefused:
            raise
        except CheckpointError as e:
            failures.append(str(e))
            say(f"specco: checkpoint {cand} is unusable: {e}")
    if failures:
        raise CheckpointError(f"no intact checkpoint under {root}: " + "; ".join(failures))
    return None
