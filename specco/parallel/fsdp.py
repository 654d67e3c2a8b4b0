"""FSDP2 applied from outside the plain policy (STYLE §1): the recipe, the mixed-precision policy, the sums.

    mesh = Mesh.build(dp=4, dp_shard=2, cp=2)          # parallel.dp_replicate = 2, parallel.dp_shard = 2
    apply_activation_checkpointing(policy)             # (optional) torchtitan's order: AC, compile, then FSDP
    apply_fsdp(policy, mesh.fsdp_mesh, mp_policy=mixed_precision(torch.bfloat16))
    opt = build_optimizer(policy, draft, ...)          # AFTER apply_fsdp: AdamW must hold the DTensor shards
    cotrain_step(..., grad_group=mesh.grad_group, grad_sync=grad_syncs(policy, mesh.grad_group))

What each rank holds. The policy's parameters, gradients and AdamW moments as DTensor shards: 1/(dp_shard·cp)
of each tensor along dim 0 (a whole copy per replica under HSDP). Each decoder layer is one FSDP unit (its
parameters all-gathered just before its forward and freed after it; again for the backward, where its gradient
is reduce-scattered), the root (embeddings, final norm, head, tied or not) another. The draft is NOT sharded
(`grad_syncs`): every rank holds it whole and its gradient is all-reduced once per step. Why replicated:

* Traffic. The draft runs many times per micro-batch (EAGLE-3: K TTT passes, each a call of its layer; a block
  drafter: a forward over every block). Sharded, every call would all-gather the draft's weights (or keep them
  gathered for the whole step, i.e. hold them whole anyway) and every micro-batch reduce-scatter its gradient;
  replicated, the step costs one all-reduce of its fp32 gradient: 1.6 GB for the draft below, ~2 × 1.6 GB sent
  per rank by a ring, ~7 ms at NVLink's ~450 GB/s, once per step.
* Memory (parameter counts of the specco models built on the meta device at Qwen3-8B's shapes: h 4096,
  36 layers, 151,936-token vocabulary, a 32k draft vocabulary, 3 taps). The policy: 8.19 B parameters, at
  16 B/param (fp32 weight, gradient, two AdamW moments) 131 GB, 16.4 GB per rank at fsdp 8. The EAGLE-3 draft:
  0.40 B (fc 3h·h 50 M, its decoder layer 218 M, head h·32k 131 M), 6.4 GB replicated: 40% of the policy's
  shard at fsdp 8, where the traffic it saves is worth it. At fsdp 32 it would outweigh the 8B policy's own
  shard (4.1 GB); there (or for drafts of larger policies on many ranks) sharding it too — `fully_shard(draft,
  mesh=...)` with `FSDPSync` as its strategy, at the gathers counted above — is the change. A DFlash drafter of
  one layer (the policy's head and embeddings borrowed):
  0.24 B, 3.9 GB.

Gradient sums, not means. specco divides every loss by its GLOBAL count (train/losses.py: the trained tokens of
all dp × cp ranks), so the rank-local gradients must be SUMMED; FSDP2 averages by default (ReduceOp.AVG, or a
pre/post division by the data-parallel size). `apply_fsdp` sets on every FSDP unit
`set_gradient_divide_factor(1.0)` and `set_force_sum_reduction_for_comms(True)`: with both, torch 2.13's
`_get_gradient_divide_factors` returns (no pre-division, a post-division by 1 that it skips, SUM, SUM), so the
reduce-scatter and HSDP's all-reduce are plain sums. The divide factor alone would pick
`ReduceOp.PREMUL_SUM(1.0)` for fp32 / bf16 reductions, which gloo does not implement and NCCL runs as a
multiply by one; forcing SUM avoids both. For fp64 (tests) torch already uses SUM with a divide factor.

Mixed precision. `mixed_precision(torch.bfloat16)` = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32):
weights all-gathered and computed in bf16, gradients reduced in fp32 into the fp32 sharded master weights that
AdamW updates. `mixed_precision(None)` (fp32 / fp64 runs, the tests) casts nothing.

Mixture of experts. A policy whose experts expert parallelism placed (parallel/ep.py: `apply_ep` first) is sharded as
a dense policy — attention, norms, routers, shared experts, embeddings, head over the fsdp mesh — except for its
expert slices: each is a unit of its own over the ranks that hold the same slice (its replica group; Shard(0) of the
E/ep experts), or, where a rank holds its slice alone, left out (`ignored_params`: a plain tensor whose gradient
train/grad_sync.EPSync handles; under bf16 mixed precision it stays fp32 and the step's autocast casts it). Without ep
(parallel.ep = 1) the experts are sharded with their layer like every other tensor: each (E, 2I, h) / (E, h, I) tensor
cut along the expert dim over the fsdp ranks and all-gathered whole for the layer's forward and backward (torchtitan's
layout at ep 1): no all-to-all, but every rank runs every expert's GEMMs on its own rows and gathers every expert's
weights.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

__all__ = ["apply_fsdp", "mixed_precision", "fsdp_modules", "is_sharded", "layer_reshards_after_forward",
           "shard_rows"]


def mixed_precision(dtype: torch.dtype | None) -> MixedPrecisionPolicy:
    """The FSDP mixed-precision policy of a train dtype: bf16 params and compute with fp32 gradient reductions
    (master weights stay fp32), or nothing cast (None: the parameters' own dtype, e.g. fp64 in tests)."""
    if dtype is None:
        return MixedPrecisionPolicy()
    if dtype != torch.bfloat16:
        raise ValueError(f"mixed precision in {dtype}: only torch.bfloat16 (fp16 would need loss scaling)")
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    """The FSDP units inside `model` (itself included), outermost first."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def layer_reshards_after_forward(model: nn.Module, reshard_after_forward: bool) -> list[tuple[nn.Module, bool]]:
    """Each FSDP unit of `model` (its decoder layers, then the root) with whether it frees its gathered weights
    after its forward: `reshard_after_forward` for every layer but the last, whose backward comes right after;
    never the root (see apply_fsdp). The one home of that rule: apply_fsdp applies it, train.grad_sync.FSDPSync
    restores it after a step that held the weights gathered (and a layer's nested expert-slice units' True)."""
    layers = list(model.layers.values())  # ModuleDict keyed by global layer index: a stage holds a slice
    return [(layer, reshard_after_forward and i < len(layers) - 1) for i, layer in enumerate(layers)] + [(model, False)]


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy | None = None,
               reshard_after_forward: bool = True, forward_only: bool = False) -> nn.Module:
    """Shard a Policy (or a pipeline stage of one) in place with FSDP2: each decoder layer, then the root.

    mesh: `Mesh.fsdp_mesh`, 1-D (fsdp,) for FSDP or 2-D (dp_replicate, fsdp) for HSDP; the fsdp axis is the
    stage's dp_shard × cp ranks. mp_policy: `mixed_precision(...)` (None: nothing cast).
    reshard_after_forward: free each layer's gathered weights after its forward and gather them again for
    its backward (ZeRO-3; saves a layer's full weights per layer of depth). torchtitan passes False under
    pipeline parallelism, where 1F1B interleaves micro-batches' forwards and backwards and the re-gathers
    would multiply; the last layer is never resharded (its backward starts right after the forward), nor is the
    root (FSDP's own default: the head is needed again at once, and the block drafters read its live
    `lm_head.weight` and `embed_tokens` rows between the policy's forward and backward).

    forward_only: a model that never runs a backward (the KL reference, trainer.make_arm): every unit, the last
    layer and the root included, frees its gathered weights after its forward, since no backward will need them
    (FSDP2 frees a unit left gathered only in its post-backward, which never comes; it would stay whole).

    Call it after activation checkpointing / compile (torchtitan's order) and BEFORE building the optimizer:
    fully_shard replaces every parameter with a DTensor shard. Gradients are summed, never averaged (module
    docstring). Returns `model` (its class now also an FSDPModule)."""
    ignored, experts = _expert_slices(model, mesh.device_type if mesh is not None else "cpu")
    mp_policy = mp_policy or MixedPrecisionPolicy()
    *layers, (root, _) = layer_reshards_after_forward(model, reshard_after_forward)
    for mod, mesh_r in experts:  # each slice its own unit over its replica group, inside its layer's unit. Always
        # resharded after its forward: a unit nested in a layer that is not (the last one) and left gathered by a
        # no-grad forward (the log-prob recompute) trained on stale weights after the next optimizer step
        # (tests/test_ep_fsdp.py's RL loop at dp_shard 4 × ep 2 caught it); the cost is one slice's re-gather
        fully_shard(mod, mesh=mesh_r, mp_policy=mp_policy, reshard_after_forward=True)
    for layer, reshard in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard or forward_only,
                    ignored_params=ignored)
    # embeddings, norm, head: the root unit, left to FSDP's default (None: not resharded after forward)
    fully_shard(root, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=True if forward_only else None,
                ignored_params=ignored)
    for m in fsdp_modules(model):  # per unit: the setters below are not recursive
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)
    return model


def _expert_slices(model: nn.Module, device_type: str) -> tuple[set[nn.Parameter] | None,
                                                                list[tuple[nn.Module, DeviceMesh]]]:
    """(the parameters the layers' units must leave alone, the expert modules that are units of their own with
    their mesh). An expert-parallel policy's slices (parallel/ep.py), already cut over the ep group: where a
    slice is held by several ranks (its replica group), FSDP shards it over them as its own unit (torchtitan's
    dp_shard_in_ep: the experts' memory / the replicas); where each rank holds its slice alone (ep = dp × cp),
    they are ignored. Nothing apart otherwise (a dense policy, or a mixture of experts at ep 1, whose (E, ...)
    expert tensors FSDP shards along the expert dim like any other tensor)."""
    from .ep import EPExperts, expert_parameters, is_ep
    if not is_ep(model):
        return None, []
    mods = [m for m in model.modules() if isinstance(m, EPExperts)]
    if mods[0].replica_group is None:
        return set(expert_parameters(model)[0]), []
    mesh = DeviceMesh.from_group(mods[0].replica_group, device_type, mesh_dim_names=("ep_replica",))
    return None, [(m, mesh) for m in mods]


def shard_rows(param: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(local tensor, first row, end row): which rows of dim 0 of the whole `param` this rank holds, and the
    tensor that holds them (written in place: FSDP's own sharded storage). The one home of FSDP2's cut: along
    dim 0 as `torch.chunk` cuts, ceil(n / k) rows per rank of a k-rank mesh dim, the last ranks' shorter or empty
    (n = 3 rows over k = 4: 1, 1, 1, 0); a Replicate mesh dim (HSDP's dp_replicate) holds every row. A plain
    tensor is all rows. Anything else (Shard of another dim: TP) is refused: this function would misplace it.
    Checked against the local shard's own length, so a changed FSDP cut fails here, not as wrong weights."""
    if not isinstance(param, DTensor):
        return param, 0, param.shape[0]
    start, n = 0, param.shape[0]
    for dim, placement in enumerate(param.placements):
        if placement.is_replicate():
            continue
        if not (placement.is_shard() and placement.dim == 0):
            raise ValueError(f"shard_rows: placement {placement} on mesh dim {dim}; only Shard(0) and Replicate "
                             "(FSDP / HSDP) are read row-wise")
        k, r = param.device_mesh.size(dim), param.device_mesh.get_local_rank(dim)
        chunk = -(-n // k)  # ceil
        a, b = min(r * chunk, n), min((r + 1) * chunk, n)
        start, n = start + a, b - a
    with torch.no_grad():  # no autograd view: the tensor FSDP's sharded parameter is
        local = param.to_local()
    if local.shape[0] != n:
        raise AssertionError(f"shard_rows: the local shard has {local.shape[0]} rows, the chunk rule {n}")
    return local, start, start + n
