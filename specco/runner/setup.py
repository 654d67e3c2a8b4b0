"""Where a job runs: its device and, under torchrun, its mesh; and how rank 0's starting models reach the others.

    policy = share_policy(policy, readable, mesh, device)   # rank 0's policy on every rank
    draft = share_model(draft, mesh, device)                # rank 0's warm draft (or None) on every rank
    (tok,) = from_rank0((tok,), mesh, device)               # small objects only (the tokenizer)
    tokens, mask = share_tensors((tokens, mask), mesh, device)  # rank 0's tensors (the warm-start pool)

No model is pickled (REVIEW item 6). Rank 0 loads (or builds) the starting policy and reads finished stages from
out_dir; the other ranks get them from it (then run SFT and the warm start with it, data-parallel: prepare.py), so
they need not read rank 0's paths (tests/test_multinode.py). So the weights travel as tensors: a model's recipe — its class, its config, each tensor's name, shape and dtype — goes as one small
object; every other rank builds the model on the meta device from it (no storage, no init), allocates it
(`to_empty`) and receives each tensor by one `dist.broadcast` straight into it. What a pickled
broadcast_object_list cost and this does not: rank 0's deepcopy of the model plus its pickle (two more copies on
the host), every rank's pickle bytes and unpickled copy, and unpickling (which runs code) on every rank. Peak host
memory per receiving rank: its model plus one tensor in flight (none on CPU, where it lands in place). Measured
(bench/sharded_load.py, a 508 MB fp32 policy, 2 gloo ranks, peak resident memory added by the transfer): pickled,
rank 0 +1,498 MB and rank 1 +2,037 MB; as tensors, rank 0 +1 MB and rank 1 +546 MB (the model itself).

Where every rank can read the directory the starting policy came from unchanged (policy.source when there is no
SFT stage: a shared file system, a model cache on every node), each rank reads it itself and nothing crosses the
network; a sha256 digest of every tensor's bytes (rank 0's against each rank's) proves the copies are the
same bits, and any difference (another file at that path on some node, a dtype round trip of rank 0's resume)
falls back to the broadcast, for every rank alike. Every rank holds the whole policy here: its rollout engine
needs it whole, and the trainer's FSDP shards are cut from it in trainer.make_arm; a trainer copy that is
never whole is parallel/load.py's sharded load.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import RunConfig
from ..model.hf_io import load_policy
from ..model.policy import Policy
from ..parallel.mesh import Mesh, launched_world
from .derive import check_parallel

__all__ = ["pick_device", "parallel_setup", "from_rank0", "share_tensors", "share_model", "share_policy"]


def pick_device(name: str) -> torch.device:
    """The config's `device` ("auto": CUDA when there is one); a bad name or CUDA without a GPU is a ConfigError
    naming the key and the fix (specco.devices)."""
    from ..devices import resolve_device
    return resolve_device(name, option="device")


def parallel_setup(cfg: RunConfig) -> Mesh | None:
    """The RL loop's mesh: None for one process; under torchrun, the pp x dp x cp x tp mesh with
    parallel.pp x parallel.dp x parallel.cp x parallel.tp = WORLD_SIZE, its dp axis split into dp_replicate x dp_shard
    (parallel.shard: 1 without FSDP). Anything else is refused with what to change
    (derive.check_parallel), instead of silently running one independent copy per rank."""
    pp, dp, cp = check_parallel(cfg, launched_world(), "train")
    p = cfg.parallel
    if pp * dp * cp * p.tp == 1:
        return None
    backend = p.backend if p.backend != "auto" else ("nccl" if pick_device(cfg.device).type == "cuda" else "gloo")
    return Mesh.build(dp, cp, backend, pp=pp, dp_shard=p.shard, timeout_s=p.timeout_s, tp=p.tp,
                      rollout_tp=cfg.rollout.tp, ep=p.ep)


def _broadcast_object(obj, mesh: Mesh):
    """Rank 0's small, model-free object on every rank of every stage (a collective)."""
    box = [obj if mesh.rank == 0 else None]
    dist.broadcast_object_list(box, group=dist.group.WORLD, group_src=0)
    return box[0]


def from_rank0(objs: tuple, mesh: Mesh | None, device) -> tuple:
    """Rank 0's `objs` on every rank, sent as one pickled object (a collective). Small non-model objects only
    (the tokenizer, metrics): a model goes through `share_model`, which never pickles it."""
    if mesh is None:
        return objs
    if any(isinstance(o, torch.nn.Module) for o in objs):
        raise TypeError("from_rank0 sends small objects; send models with share_model (tensor broadcasts)")
    out = _broadcast_object(objs, mesh)
    return objs if mesh.rank == 0 else out


@torch.no_grad()
def share_tensors(tensors: tuple | None, mesh: Mesh | None, device) -> tuple:
    """Rank 0's tuple of `tensors` (e.g. the warm-start pool) on every rank, on the device type rank 0's are on
    (`device` where that is not the CPU): their shapes and dtypes as one small object, then one broadcast each.
    A collective: every rank calls it; rank 0 gets its own tensors back."""
    if mesh is None:
        return tensors
    layout = _broadcast_object([(tuple(t.shape), t.dtype, t.device.type) for t in tensors]
                               if mesh.rank == 0 else None, mesh)
    out = []
    for i, (shape, dtype, where) in enumerate(layout):
        wire = tensors[i].to(mesh.device).contiguous() if mesh.rank == 0 else torch.empty(
            shape, dtype=dtype, device=mesh.device)
        dist.broadcast(wire, group=dist.group.WORLD, group_src=0)
        out.append(wire.to("cpu" if where == "cpu" else device))
    return tuple(tensors) if mesh.rank == 0 else tuple(out)


def _tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of `model` once (a tied head is its embedding), in module order: the order
    both ends of `share_model` walk."""
    return list(model.named_parameters()) + list(model.named_buffers())


def _recipe(model: torch.nn.Module | None):
    """What a rank needs to build `model` without its weights: class, config, train flag, tensor layout."""
    if model is None:
        return None
    return (type(model), model.cfg, model.training, [(k, tuple(t.shape), t.dtype) for k, t in _tensors(model)])


def _build(recipe, device) -> torch.nn.Module:
    """The model a `_recipe` describes, built on the meta device (no storage, no init) and allocated on `device`
    in its dtype; its tensors hold garbage until filled."""
    cls, cfg, training, layout = recipe
    floats = {dt for _, _, dt in layout if dt.is_floating_point}
    if len(floats) > 1:
        raise ValueError(f"share_model: {cls.__name__} mixes float dtypes {sorted(map(str, floats))}")
    with torch.device("meta"):
        model = cls(cfg)
    model = (model.to(*floats) if floats else model).to_empty(device=device).train(training)  # floats only
    if isinstance(model, Policy) and cfg.tie_word_embeddings and model.lm_head is not None:
        model.lm_head.weight = model.embed_tokens.weight  # to_empty unties
    mine = [(k, tuple(t.shape), t.dtype) for k, t in _tensors(model)]
    if mine != layout:
        raise AssertionError(f"share_model: {cls.__name__} built from its config differs from rank 0's")
    return model


@torch.no_grad()
def share_model(model: torch.nn.Module | None, mesh: Mesh | None, device) -> torch.nn.Module | None:
    """Rank 0's `model` (a Policy or a draft: any module built as `cls(cfg)`; or None) on every rank, on
    `device`, without pickling it (module docstring): its recipe as one small object, then one `dist.broadcast`
    per tensor, landing in place in the receiver's own tensor when it lives on the process group's device.
    A collective: every rank calls it; rank 0 gets its own model back."""
    if mesh is None:
        return model
    recipe = _broadcast_object(_recipe(model) if mesh.rank == 0 else None, mesh)
    if recipe is None:
        return None
    if mesh.rank != 0:
        model = _build(recipe, device)
    for _, t in _tensors(model):
        wire = t if t.device == mesh.device and t.is_contiguous() else t.detach().to(mesh.device).contiguous()
        dist.broadcast(wire, group=dist.group.WORLD, group_src=0)
        if mesh.rank != 0 and wire is not t:
            t.copy_(wire)
    return model


def _digest(model: torch.nn.Module) -> str:
    """sha256 of every tensor's name, dtype, shape and bytes, in `_tensors` order: equal digests, equal bits."""
    h = hashlib.sha256()
    for k, t in _tensors(model):
        h.update(f"{k}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _all(flag: bool, mesh: Mesh) -> bool:
    """Whether `flag` holds on every rank (a collective)."""
    t = torch.tensor([int(flag)], device=mesh.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=dist.group.WORLD)
    return bool(t.item())


def share_policy(policy: Policy | None, readable: str | os.PathLike | None, mesh: Mesh | None, device) -> Policy:
    """Rank 0's starting `policy` on every rank. `readable` (rank 0's): an HF directory whose weights, cast to
    the policy's dtype, ARE the policy (policy.source without an SFT stage), or None. When every rank can read
    it, each loads it itself and the digests prove the copies equal; otherwise (or when they differ) the
    weights are broadcast (share_model). A collective: every rank calls it."""
    if mesh is None:
        return policy
    plan = (str(readable), next(policy.parameters()).dtype) if mesh.rank == 0 and readable is not None else None
    plan = _broadcast_object(plan, mesh)
    mine = None
    if plan is not None and mesh.rank != 0 and Path(plan[0]).is_dir():
        try:
            mine = load_policy(plan[0], device=device).to(plan[1])
        except Exception:  # unreadable here: the broadcast below carries it (a bad file on rank 0 failed there)
            mine = None
    if plan is not None and _all(mesh.rank == 0 or mine is not None, mesh):  # every rank read: compare the bits
        digest = _broadcast_object(_digest(policy) if mesh.rank == 0 else None, mesh)
        if _all(mesh.rank == 0 or _digest(mine) == digest, mesh):
            return policy if mesh.rank == 0 else mine
    mine = None  # a copy that differs goes before the broadcast fills a new one
    return share_model(policy, mesh, device)
