"""Where a job runs: its device and, under torchrun, its mesh; and how rank 0's starting models reach the others."""
from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist

from ..config import RunConfig
from ..parallel.mesh import Mesh
from .derive import check_parallel


def pick_device(name: str) -> torch.device:
    """The config's `device` ("auto": CUDA when there is one); a bad name or CUDA without a GPU is a ConfigError
    naming the key and the fix (specco.devices)."""
    from ..devices import resolve_device
    return resolve_device(name, option="device")


def parallel_setup(cfg: RunConfig) -> Mesh | None:
    """The RL loop's mesh: None for one process; under torchrun, the pp x dp x cp mesh with
    parallel.pp x parallel.dp x parallel.cp = WORLD_SIZE, its dp axis split into dp_replicate x dp_shard
    (parallel.shard: 1 without FSDP). Anything else is refused with what to change
    (derive.check_parallel), instead of silently running one independent copy per rank."""
    pp, dp, cp = check_parallel(cfg, int(os.environ.get("WORLD_SIZE", "1")), "train")
    if pp * dp * cp == 1:
        return None
    p = cfg.parallel
    backend = p.backend if p.backend != "auto" else ("nccl" if pick_device(cfg.device).type == "cuda" else "gloo")
    return Mesh.build(dp, cp, backend, pp=pp, dp_shard=p.shard)


def from_rank0(objs: tuple, mesh: Mesh | None, device) -> tuple:
    """Rank 0's `objs` (models, tokenizer) on every rank, sent through the process group (a collective).
    Models travel on the host and land on each rank's own device."""
    if mesh is None:
        return objs
    box = [None]
    if mesh.rank == 0:
        # a host copy (Module.to moves in place; rank 0 keeps its models where they are)
        box = [tuple(copy.deepcopy(o).cpu() if isinstance(o, torch.nn.Module) else o for o in objs)]
    dist.broadcast_object_list(box, group=dist.group.WORLD, group_src=0)  # every rank of every stage
    if mesh.rank == 0:
        return objs
    return tuple(o.to(device) if isinstance(o, torch.nn.Module) else o for o in box[0])
