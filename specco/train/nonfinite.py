"""Non-finite numbers stop a run where they appear, naming the step and the quantity.

A NaN or infinite loss, gradient norm or weight poisons every later step (AdamW turns one NaN gradient
into NaN weights), and metrics.jsonl drops non-finite values, so without a check a run could finish
"successfully" with every weight NaN (issue 16: train.lr=inf). The runners call these after each
step; train.on_nonfinite = "skip" makes the RL loop drop that step's update instead of stopping.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


class NonFiniteError(RuntimeError):
    """A loss, gradient norm or weight that is NaN or infinite; the message names where."""


def nonfinite_metrics(metrics: dict, keys=None) -> dict:
    """The entries of `metrics` (restricted to `keys` when given) that are non-finite numbers."""
    return {k: v for k, v in metrics.items()
            if (keys is None or k in keys) and isinstance(v, (int, float)) and not isinstance(v, bool)
            and not math.isfinite(v)}


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def first_nonfinite_weight(*modules) -> str | None:
    """The name of the first parameter holding a NaN or inf (None: all finite), the same on every rank: one host sync,
    and a collective over the FSDP shards and the ep group where the modules are sharded or expert-parallel."""
    named = [(f"{i}:{n}", p) for i, m in enumerate(modules) if m is not None for n, p in m.named_parameters()]
    if not named:
        return None
    # an FSDP shard (DTensor): its own slice, then the verdict of every shard (a collective over the shards' ranks,
    # so every rank names the same weight); a DTensor's whole-tensor reduction would need a product placement
    ok = torch.stack([_local(p).detach().isfinite().all() for _, p in named])
    # one mesh per model (parallel/fsdp.py), and a second for expert slices FSDP shards over their replica group:
    # the verdict over each mesh's shard dims, in the same order on every rank (first appearance)
    meshes = {}
    for _, p in named:
        if isinstance(p, DTensor):
            meshes.setdefault(id(p.device_mesh), (p.device_mesh, p.placements))
    for mesh, places in meshes.values():
        flags = ok.to(torch.int32)
        for d, pl in enumerate(places):
            if pl.is_shard():
                dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=mesh.get_group(d))
        ok = flags.bool()
    group = _ep_group(modules)
    if group is not None:  # expert slices (parallel/ep.py) differ across the ep group, each rank holding its own:
        # the verdict of the whole group, so every rank of it names the same weight (else one rank would raise while
        # its peers wait in the next step's all-to-all)
        flags = ok.to(torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
        ok = flags.bool()
    ok = ok.cpu()
    bad = [n for (n, _), good in zip(named, ok.tolist()) if not good]
    return bad[0].split(":", 1)[1] if bad else None


def _ep_group(modules):
    """The ep group of the expert-parallel module among `modules` (one per run: the trainer's policy), else None."""
    from ..parallel.ep import expert_parameters, is_ep
    return next((expert_parameters(m)[1] for m in modules if is_ep(m)), None)


def check_finite(where: str, metrics: dict | None = None, keys=None, modules=()) -> None:
    """Raise NonFiniteError naming `where` (e.g. "RL step 3 of arm cotrained") and the quantity."""
    bad = nonfinite_metrics(metrics or {}, keys)
    if bad:
        k, v = next(iter(bad.items()))
        raise NonFiniteError(f"{where}: {k} = {v} (non-finite). Lower the learning rate or the gradient clip, "
                             "or set train.on_nonfinite=skip to drop such steps")
    name = first_nonfinite_weight(*modules)
    if name is not None:
        raise NonFiniteError(f"{where}: weight {name} holds NaN or infinite values after the update. Lower "
                             "the learning rate or the gradient clip")
