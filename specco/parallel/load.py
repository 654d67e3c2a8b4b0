"""A policy whose weights only ever exist as this rank's shards: meta-init, FSDP, then fill the local rows.

    policy = load_sharded_policy(dir, mesh.fsdp_mesh, device)               # from an HF checkpoint directory
    policy = sharded_policy(cfg, mesh.fsdp_mesh, device, fill=...)          # from any row source
    trainer = sharded_copy(policy, mesh.fsdp_mesh, prepare=apply_activation_checkpointing)  # from a whole policy

The recipe (REVIEW item 6, torchtitan's order): build the plain Policy on the meta device (no storage), cast it
to the train dtype there, `apply_fsdp` (each parameter becomes a DTensor shard, still on meta), `to_empty`
(each rank allocates only its shards: 1/(dp_shard·cp) of every tensor), then fill each shard's rows
(`fill(model, rows_of)` with `rows_of = fsdp.shard_rows`). From an HF directory the fill is
`hf_io.load_policy_rows`, which reads only those rows from the safetensors files, so no rank ever holds the
whole policy on the host: peak host memory per rank is its shards plus one tensor's rows in flight. Measured
(bench/sharded_load.py, a 508 MB fp32 Qwen3-style policy, peak resident memory added by the load): whole load
1,076 MB; whole load then apply_fsdp 1,076 MB per rank at any dp_shard; sharded 405 MB per rank at dp_shard 2
(254 MB of shards), 254-267 MB at dp_shard 4 (127 MB of shards) — the rest is the largest tensor's rows in
flight (the 125 MB embedding / head over dp_shard) and freed buffers the allocator keeps. The result is the model `apply_fsdp(load_policy(dir).to(dtype), mesh)`
gives, shard for shard, bit for bit (tests/test_sharded_load.py).

`sharded_copy` is the same recipe filled from a whole policy already in memory (the arm's starting policy, which
the rollout engine needs whole anyway): `apply_fsdp(copy.deepcopy(policy), mesh)` without the deepcopy, so a
rank never holds a second whole policy for the moment the shards are cut (trainer.make_arm: the trainer's copy
and the KL reference). Measured (bench/shard_arm.py, the 508 MB policy, with a KL reference): make_arm's peak per
rank 1,582 MB at dp_shard 2 and 1,571 MB at 4 with whole deep copies; 1,054 and 799 MB (the engine's whole copy
and the two shards) this way.
"""
from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..model.config import PolicyConfig
from ..model.hf_io import load_policy_config, load_policy_rows
from ..model.policy import Policy
from .ep import expert_stream, is_ep, slice_offsets
from .fsdp import MixedPrecisionPolicy, apply_fsdp, shard_rows

__all__ = ["sharded_policy", "load_sharded_policy", "sharded_copy", "whole_items"]


def sharded_policy(cfg: PolicyConfig, mesh: DeviceMesh, device, fill, dtype: torch.dtype = torch.float32,
                   mp_policy: MixedPrecisionPolicy | None = None, reshard_after_forward: bool = True,
                   forward_only: bool = False, prepare=None) -> Policy:
    """The FSDP-sharded Policy of `cfg` on `mesh` (`Mesh.fsdp_mesh`), its shards allocated on `device` in `dtype`
    and filled by `fill(model, rows_of)` (module docstring). A collective (fully_shard): every rank of the mesh
    calls it. `prepare(model)`: what must wrap the plain model before FSDP (torchtitan's order: expert parallelism's
    `apply_ep`, whose slices FSDP then leaves alone, then activation checkpointing), run on the meta model;
    `forward_only`: apply_fsdp's (a model that never runs a backward).
    Tied embeddings: to_empty unties what the meta model tied, so the head is tied again before the fill (one
    parameter, one shard, filled once as the embedding)."""
    with torch.device("meta"):
        model = Policy(cfg).to(dtype)
    if prepare is not None:
        prepare(model)
    apply_fsdp(model, mesh, mp_policy, reshard_after_forward=reshard_after_forward, forward_only=forward_only)
    model.to_empty(device=device)
    if cfg.tie_word_embeddings and model.lm_head is not None and model.embed_tokens is not None:
        model.lm_head.weight = model.embed_tokens.weight
    fill(model, shard_rows)
    return model


def load_sharded_policy(path, mesh: DeviceMesh, device, dtype: torch.dtype = torch.float32, **fsdp) -> Policy:
    """The HF checkpoint directory `path` as an FSDP-sharded Policy: each rank reads only its rows of every
    tensor (hf_io.load_policy_rows). `fsdp`: apply_fsdp's mp_policy / reshard_after_forward."""
    return sharded_policy(load_policy_config(path), mesh, device,
                          lambda model, rows_of: load_policy_rows(path, model, rows_of), dtype, **fsdp)


def sharded_copy(policy: Policy, mesh: DeviceMesh, **kw) -> Policy:
    """An FSDP-sharded copy of the whole `policy` on `mesh`, in its dtype and on its device: each rank copies only
    its rows of every tensor out of `policy` (module docstring), which is left as it was. The same model, shard
    for shard and bit for bit, as `apply_fsdp(copy.deepcopy(policy), mesh, ...)`, without that transient whole
    copy. `kw`: sharded_policy's mp_policy / reshard_after_forward / forward_only / prepare. A collective."""
    whole = dict(policy.named_parameters())  # a tied head is the embedding, named once (as in the copy)
    dtypes = {p.dtype for p in whole.values()}
    if len(dtypes) != 1:  # the copy is built in one dtype: a mixed policy would be cast silently
        raise ValueError(f"sharded_copy: the policy mixes dtypes {sorted(map(str, dtypes))}")

    @torch.no_grad()
    def fill(model, rows_of):
        mine = dict(model.named_parameters())
        if mine.keys() != whole.keys():
            raise AssertionError(f"sharded_copy: parameters differ: {sorted(mine.keys() ^ whole.keys())}")
        first = slice_offsets(model)  # `prepare` applied expert parallelism: a slice's rows start at its first expert
        for name, p in mine.items():
            local, start, stop = rows_of(p)  # an expert slice is a plain tensor (FSDP leaves it alone): all its rows
            o = first.get(name, 0)
            local.copy_(whole[name][o + start:o + stop])
    return sharded_policy(policy.cfg, mesh, next(iter(whole.values())).device, fill, dtypes.pop(), **kw)


@torch.no_grad()
def whole_items(model: torch.nn.Module, gather: bool = True):
    """(name, whole tensor) of `model.state_dict()`, one tensor at a time: an FSDP shard gathered (`full_tensor()`, a
    collective of its mesh), an expert-parallel layer's experts gathered over the ep group when the walk reaches
    them (ep.expert_stream). The way a sharded model's weights leave it whole (the PP refit's stream, the saved
    policy): a consumer that drops what it has passed holds one tensor (or one layer's experts) at a time. Every
    rank walks it in the same order. gather=False: the same names, shapes and dtypes without a collective (meta
    placeholders for the experts; a DTensor's shape is the whole tensor's)."""
    items = expert_stream(model, gather) if is_ep(model) else model.state_dict().items()
    for k, v in items:
        yield k, (v.full_tensor() if gather and isinstance(v, DTensor) else v)
