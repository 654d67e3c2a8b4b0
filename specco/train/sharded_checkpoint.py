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
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.optim.lr_scheduler import LRScheduler

from ..faults import point
from ..parallel.ep import as_global, expert_meshes
from .checkpoint import CheckpointError, _decode, _encode, _fsync, _step_dirs, latest_checkpoint, publish

__all__ = ["save", "load", "load_latest", "FORMAT", "PickleRefused"]

FORMAT = "specco-sharded-checkpoint-v1"
STATE, SHARDS = "state.json", "shards"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _split(state: dict) -> tuple[nn.ModuleDict, dict, dict, dict]:
    """(the models as one ModuleDict — so that FQNs are `policy.…`, `draft.…` and one optimizer may span
    several models —, the optimizers, the LR schedulers, the JSON run state)."""
    models = {k: v for k, v in state.items() if isinstance(v, nn.Module)}
    optims = {k: v for k, v in state.items() if isinstance(v, torch.optim.Optimizer)}
    scheds = {k: v for k, v in state.items() if isinstance(v, LRScheduler)}
    extra = {k: v for k, v in state.items() if k not in models and k not in optims and k not in scheds}
    for k in state:
        if "." in k:
            raise ValueError(f"checkpoint entry {k!r}: names may not contain '.' (they prefix tensor names)")
    return nn.ModuleDict(models), optims, scheds, extra


def _device() -> torch.device:
    """Where this rank's collectives take their tensors (NCCL: its GPU)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_gather_json(obj) -> list:
    """Every rank's `obj` (JSON data), in rank order; collective. Bytes through all_gather: never a pickle
    (all_gather_object pickles, and specco moves no pickles between processes either)."""
    if not dist.is_initialized():
        return [obj]
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).to(_device())
    n = torch.tensor([data.numel()], device=_device())
    sizes = [torch.zeros_like(n) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, n)
    width = max(int(s) for s in sizes)
    buf = torch.zeros(width, dtype=torch.uint8, device=_device())
    buf[:data.numel()] = data
    out = [torch.empty_like(buf) for _ in sizes]
    dist.all_gather(out, buf)
    return [json.loads(bytes(o[:int(s)].cpu().numpy()).decode()) for o, s in zip(out, sizes)]


def _group_key(g: dict, i: int):
    """How a param group is matched across ranks and layouts: its name (cotrain.build_optimizer's 'policy' /
    'draft'), else its index. A pipeline stage without the draft has only the 'policy' group."""
    return g.get("name", i)


def _merge_groups(parts: list[list[dict]]) -> list[dict]:
    """The (encoded) param groups of every rank merged by group: the parameter names united (pipeline stages
    hold different layers; FSDP ranks and replicas the same names), the hyper-parameters equal on every rank."""
    merged: dict = {}
    for groups in parts:
        for i, g in enumerate(groups):
            key = _group_key(g, i)
            m = merged.setdefault(key, {**g, "params": []})
            if {k: v for k, v in g.items() if k != "params"} != {k: v for k, v in m.items() if k != "params"}:
                raise ValueError(f"optimizer param group {key!r} has different hyper-parameters on different ranks")
            m["params"] += [p for p in g["params"] if p not in m["params"]]
    return list(merged.values())


def _sched_part(sched: LRScheduler, where: str) -> dict:
    """A scheduler's state split into per-param-group lists (by group key: pipeline stages hold different
    groups) and the values every group shares (the step count)."""
    keys = [_group_key(g, i) for i, g in enumerate(sched.optimizer.param_groups)]
    sd = _json(sched.state_dict(), where)
    per = {k: dict(zip(map(str, keys), v)) for k, v in sd.items() if isinstance(v, list) and len(v) == len(keys)}
    return {"per_group": per, "shared": {k: v for k, v in sd.items() if k not in per}}


def _merge_scheds(parts: list[dict]) -> dict:
    out = {"per_group": {}, "shared": parts[0]["shared"]}
    for part in parts:
        if part["shared"] != out["shared"]:
            raise ValueError(f"LR scheduler state differs between ranks ({part['shared']} vs {out['shared']})")
        for k, v in part["per_group"].items():
            out["per_group"].setdefault(k, {}).update(v)
    return out


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
    # expert-parallel slices (parallel/ep.py) are plain tensors of the same FQN and a local shape on every ep rank:
    # as they are, DCP would take them for replicas and keep one; saved as Shard(0) DTensors of the whole instead
    ep = expert_meshes(container)
    flat = {f"model.{k}": as_global(v, ep[k]) if k in ep else v for k, v in _model_tensors(container).items()}
    rest = {}
    for name, opt in optims.items():
        osd = get_optimizer_state_dict(container, opt)
        scalars = {}
        for fqn, st in osd["state"].items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    # AdamW's moments of a slice are slices too; its `step` counter (0-d) is replicated
                    flat[f"{name}.state.{fqn}.{k}"] = as_global(v, ep[fqn]) if fqn in ep and v.dim() else v
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
    container, optims, scheds, extra = _split(state)
    flat, rest = _flat_state(container, optims)
    # what each rank holds, merged on every rank: under pipeline parallelism a rank holds its stage's tensors
    # and param groups only (its draft group on the last stage alone); JSON through the group, no pickle
    parts = _all_gather_json({
        "tensors": {k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")} for k, v in flat.items()},
        "optimizers": {k: _json(v, k) for k, v in rest.items()},
        "schedulers": {k: _sched_part(v, k) for k, v in scheds.items()}})
    meta = {"format": FORMAT, "step": step, "world": dist.get_world_size() if dist.is_initialized() else 1,
            "tensors": {k: v for p in parts for k, v in p["tensors"].items()},
            "optimizers": {k: {"param_groups": _merge_groups([p["optimizers"][k]["param_groups"] for p in parts]),
                               "scalars": {f: v for p in parts for f, v in p["optimizers"][k]["scalars"].items()}}
                           for k in rest},
            "schedulers": {k: _merge_scheds([p["schedulers"][k] for p in parts]) for k in scheds},
            "extra": _json(extra, "extra")}
    if _rank() == 0:  # a crashed earlier write of this step may have left its temporary directory
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / SHARDS).mkdir(parents=True)
    _barrier()
    # every rank writes into the directory rank 0 just made: a rank that cannot see it has another filesystem
    # under `root` (two nodes without a shared disk). All ranks learn it here, before DCP's collectives
    blind = [r for r, seen in enumerate(_all_gather_json((tmp / SHARDS).is_dir())) if not seen]
    if blind:
        raise CheckpointError(f"checkpoint root {root} is not one directory for every rank: rank(s) {blind} do not "
                              "see what rank 0 wrote there. Sharded checkpoints need `root` on a filesystem every "
                              "rank shares (one node's disk, or a shared filesystem across nodes): set out_dir to one")
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
    meta.setdefault("schedulers", {})  # none before schedulers were stored
    kinds = {"step": int, "files": dict, "tensors": dict, "optimizers": dict, "schedulers": dict, "extra": dict}
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


def _saved_groups(meta_opt, template: dict, where: Path) -> tuple[list, dict]:
    """(param_groups, scalars) of a saved optimizer for this rank's optimizer `template`: each of its groups
    matched by name with the saved one, the hyper-parameters the checkpoint's, the parameters this rank's (a
    pipeline stage holds part of a saved group; one process resuming a pipeline checkpoint all of it)."""
    try:
        saved = _decode(meta_opt, {}, where)
        by_key = {_group_key(g, i): g for i, g in enumerate(saved["param_groups"])}
        scalars = saved["scalars"]
        for g in by_key.values():
            set(g["params"])
        dict(scalars)
    except (TypeError, KeyError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{where / STATE}: an optimizer entry has the wrong type or shape ({type(e).__name__}: "
                              f"{e}): the file was damaged or edited") from None
    groups = []
    for i, g in enumerate(template["param_groups"]):
        key = _group_key(g, i)
        if key not in by_key or not set(g["params"]) <= set(by_key[key]["params"]):
            have = sorted(by_key[key]["params"]) if key in by_key else []
            raise CheckpointError(f"{where / STATE}: the optimizer's param group {key!r} names other parameters than "
                                  f"the model's ({len(have)} saved, {len(g['params'])} here, e.g. "
                                  f"{sorted(set(g['params']) - set(have))[:2]} missing)")
        groups.append({**by_key[key], "params": g["params"]})
    mine = {fqn for g in template["param_groups"] for fqn in g["params"]}
    return groups, {fqn: st for fqn, st in scalars.items() if fqn in mine}


def _saved_sched(meta_sched, sched: LRScheduler, where: Path) -> dict:
    """The scheduler state for this rank's param groups (_sched_part's split, joined again)."""
    keys = [str(_group_key(g, i)) for i, g in enumerate(sched.optimizer.param_groups)]
    try:
        sd = {**meta_sched["shared"], **{k: [v[g] for g in keys] for k, v in meta_sched["per_group"].items()}}
        return _decode(sd, {}, where)
    except (TypeError, KeyError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{where / STATE}: an LR scheduler entry has the wrong type or names other param "
                              f"groups ({type(e).__name__}: {e}): the file was damaged or edited") from None


def _tp_mismatch(missing: set, path: Path) -> list[str]:
    """The one layout change a checkpoint cannot cross, named: tensor parallelism (parallel/tp.py) trains the
    attention and MLP projections unfused (`q_proj`, ..., each sharded on its own), one process and the other
    layouts fused (`qkv_proj`, `gate_up_proj`), and a sharded checkpoint keeps each as it was trained."""
    fused = any(k.endswith((".qkv_proj.weight", ".gate_up_proj.weight")) for k in missing)
    parts = any(k.endswith((".q_proj.weight", ".gate_proj.weight")) for k in missing)
    if fused or parts:
        saved, now = ("parallel.tp > 1", "parallel.tp = 1") if fused else ("parallel.tp = 1", "parallel.tp > 1")
        return [f"{path} was saved at {saved} (its projections {'unfused' if fused else 'fused'}) and cannot be "
                f"resumed at {now}: resume it with {saved} (a tp > 1 checkpoint reads at another tp > 1), or start "
                "over"]
    return []


def load(path: str | os.PathLike, state: dict) -> dict:
    """Load checkpoint `path` into the models, optimizers and LR schedulers of `state` (any layout: DTensor
    shards are filled from the overlapping saved chunks; a pipeline stage takes its layers) and return its JSON
    run state; collective. Build the optimizers over the (sharded) models first, as for training. Raises
    CheckpointError naming the file or tensor at fault, on every rank alike."""
    path = Path(path)
    meta = _manifest(path)
    container, optims, scheds, _ = _split(state)
    flat, _ = _flat_state(container, optims)  # the template: this layout's shards, filled in place below
    ep_fqns = set(expert_meshes(container))
    saved = meta["tensors"]
    # this rank's verdicts, exchanged before any collective read: a refusal on one rank must raise on all of
    # them (a rank left waiting in DCP's collectives would hang the job)
    problems = _tp_mismatch(set(flat) - set(saved), path)
    problems += [f"{path / STATE} has no tensor {k!r}: the checkpoint is of another model or optimizer"
                 for k in sorted(set(flat) - set(saved))]
    problems += [f"{path / STATE}: tensor {k!r} was saved as {saved[k]['dtype']}{saved[k]['shape']}, the model has "
                 f"{t.dtype}{list(t.shape)}" for k, t in flat.items() if k in saved and (
                     list(t.shape) != saved[k]["shape"] or str(t.dtype).removeprefix("torch.") != saved[k]["dtype"])]
    opt_groups, sched_states = {}, {}
    try:
        for name, opt in optims.items():
            if name not in meta["optimizers"]:
                raise CheckpointError(f"{path / STATE} has no optimizer {name!r}")
            template = get_optimizer_state_dict(container, opt)
            opt_groups[name] = (template, *_saved_groups(meta["optimizers"][name], template, path))
        for name, sched in scheds.items():
            if name not in meta["schedulers"]:
                raise CheckpointError(f"{path / STATE} has no LR scheduler {name!r}")
            sched_states[name] = _saved_sched(meta["schedulers"][name], sched, path)
    except CheckpointError as e:
        problems.append(str(e))
    parts = _all_gather_json({"keys": sorted(flat), "problems": problems})
    for part in parts:
        if part["problems"]:
            raise CheckpointError(part["problems"][0])
    held = set().union(*(part["keys"] for part in parts))  # every rank's tensors: together, the whole checkpoint
    for k in sorted(set(saved) - held):
        raise CheckpointError(f"{path / STATE} holds tensor {k!r}, which the model being loaded lacks")
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
        template, groups, scalars = opt_groups[name]  # the fqn -> tensor nesting; tensors refilled below
        osd = {fqn: dict(st) for fqn, st in template["state"].items()}
        for fqn, st in osd.items():
            for k in st:
                if f"{name}.state.{fqn}.{k}" in flat:
                    v = flat[f"{name}.state.{fqn}.{k}"]
                    if fqn in ep_fqns and isinstance(v, DTensor):  # the slice back: as the template holds it, a
                        # plain tensor, or FSDP's shard of it over the replica group (parallel/ep.as_global)
                        like = st[k]
                        v = v.to_local() if not isinstance(like, DTensor) else DTensor.from_local(
                            v.to_local(), like.device_mesh, like.placements, run_check=False, shape=like.shape,
                            stride=like.stride())
                    st[k] = v
        for fqn, st in scalars.items():
            osd.setdefault(fqn, {}).update(st)
        set_optimizer_state_dict(container, opt, {"state": osd, "param_groups": groups})
    for name, sched in scheds.items():
        sched.load_state_dict(sched_states[name])
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
