"""The dp × cp process-group mesh, built once (STYLE §3: groups are arguments, this is where they come from).

Rank layout: global rank = dp_rank · cp + cp_rank, i.e. the ranks of one CP group are contiguous —
on GPU nodes they share NVLink, which the ring's per-step K/V traffic wants; DP traffic (one gradient
all-reduce per step) tolerates the slower links.

    cp groups:  {d·cp + j : j < cp}   for each d      (ring attention, CP shift)
    dp groups:  {d·cp + j : d < dp}   for each j
    grad group: all dp·cp ranks       (gradient sums and loss counts: CP ranks hold disjoint tokens)

Also `spawn_local`: run a function on N local gloo processes (tests, CPU benches), each with the
process group initialised through a file store (no ports to collide).
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["Mesh", "init_distributed", "spawn_local"]


def init_distributed(backend: str = "auto") -> str:
    """Initialise the default process group from torchrun's environment (idempotent).

    backend 'auto' -> nccl when CUDA is available, gloo otherwise. Returns the backend used.
    """
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    return backend


@dataclass
class Mesh:
    dp: int
    cp: int
    rank: int
    backend: str
    cp_group: object
    dp_group: object
    grad_group: object

    @property
    def cp_rank(self) -> int:
        return self.rank % self.cp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.cp

    @property
    def device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @classmethod
    def build(cls, dp: int, cp: int, backend: str = "auto") -> "Mesh":
        """Create every group (all ranks must call this, in the same order — new_group is collective)."""
        backend = init_distributed(backend)
        world, rank = dist.get_world_size(), dist.get_rank()
        if dp * cp != world:
            raise ValueError(f"parallel.dp × parallel.cp = {dp} × {cp} = {dp * cp} but the job has "
                             f"{world} processes; launch with --nproc-per-node {dp * cp} (× nodes)")
        cp_group = dp_group = None
        for d in range(dp):
            g = dist.new_group([d * cp + j for j in range(cp)])
            if rank // cp == d:
                cp_group = g
        for j in range(cp):
            g = dist.new_group([d * cp + j for d in range(dp)])
            if rank % cp == j:
                dp_group = g
        return cls(dp, cp, rank, backend, cp_group, dp_group, dist.group.WORLD)


def _spawn_entry(rank, world, store_path, fn, args):
    torch.set_num_threads(1)  # N processes on a few cores: avoid oversubscription
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn_local(fn, world: int, *args) -> None:
    """Run fn(rank, world, *args) on `world` local processes with a gloo default group. `fn` must be
    importable (module level). A worker's exception is re-raised here (torch.multiprocessing.spawn)."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_spawn_entry, args=(world, os.path.join(tmp, "store"), fn, args), nprocs=world, join=True)
