"""How each parameter group's gradient becomes the global batch's: one strategy per group, and the clip.

Every loss of the step is divided by GLOBAL counts (train/losses.py), so the gradient of the global batch is
the SUM of the ranks' gradients over the stage's dp × cp ranks (`grad_group`), never their mean. Two ways:

    AllReduceSync(group)   replicated parameters (the draft; the policy without FSDP): each rank's backward
                           leaves its own whole gradient, summed over `group` by one all-reduce per tensor
                           in the optimizer step.
    FSDPSync(module)       a policy sharded by parallel.fsdp.apply_fsdp: FSDP2 reduce-scatters (HSDP: and
                           all-reduces) each layer's gradient as a SUM inside the backward, so the optimizer
                           step has nothing left to reduce; its grads are DTensor shards.

A strategy also says what happens between micro-batches (`micro_batch(last)`, called before each micro-batch's
forward): an all-reduce waits for the step's end (gradients accumulate locally, one reduction per step); FSDP
either reduce-scatters every micro-batch (the default: at rest only shards of weights and gradients, the policy
never whole on a rank; a micro-batch costs an all-gather per layer for its forward and another for its backward,
and one reduce-scatter) or, with `hold_unsharded=True`, keeps the weights gathered and the gradients unsharded
until the last micro-batch (one all-gather and one reduce-scatter per layer per step, DDP's traffic, at the
price of a whole copy of the weights and of the gradient on every rank for the step's duration). RL steps
have many micro-batches of long rows, whose compute hides the per-micro-batch traffic; models that need FSDP are
those whose whole gradient does not fit, so the default is to reshard.

`clip_grad_norm` takes the norm over all of a group's shards (DTensor grads: `full_tensor()` of the local norms,
`grad_norm`) and over its pipeline stages (`norm_group`), so the clip coefficient is the unsharded step's;
EPSync adds its slices' squared norms summed over the ep group.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

__all__ = ["AllReduceSync", "FSDPSync", "EPSync", "grad_syncs", "reduce_grads", "clip_grad_norm", "grad_norm",
           "clip_with_norm"]


def reduce_grads(params, group) -> None:
    """Sum gradients over `group` (DP x CP ranks). Losses are normalised by global counts, so a sum
    (not a mean) gives the global-batch gradient. A tensor-parallel gradient (a DTensor over the tp mesh,
    parallel/tp.py) is summed shard by shard: `group` holds ranks of one tp rank, which hold the same shard."""
    if group is None:
        return
    for p in params:
        if p.grad is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad  # its storage: summed in place
            dist.all_reduce(g, group=group)


def grad_norm(params) -> torch.Tensor | None:
    """The total L2 norm of the gradients of `params` on this rank's share of them, None when none has one: each
    kind of gradient apart (plain tensors, each DTensor mesh) since torch's foreach kernels refuse a mix, a DTensor
    kind's norm over every shard (its local norms' `full_tensor()`: FSDP's shards, a collective over its mesh). The
    one home of that norm: `clip_grad_norm` and `EPSync.clip` take it."""
    total = None
    for group in _by_kind(params).values():
        grads = [p.grad for p in group if p.grad is not None]
        if not grads:
            continue
        n = torch.nn.utils.get_total_norm(grads)
        if isinstance(n, DTensor):  # Partial over the shards: the all-reduce of the squares happens here
            n = n.full_tensor()
        total = n if total is None else torch.linalg.vector_norm(torch.stack([total, n]))
    return total


def _by_kind(params) -> dict:
    """`params` grouped by kind of gradient: plain tensors and each DTensor mesh apart (tensor parallelism without
    FSDP leaves the norms and the embedding plain beside the layers' tp shards; FSDP over tp puts them on another
    mesh than the 2-D tp ones; expert parallelism under FSDP leaves the expert slices plain beside the shards)."""
    kinds: dict = {}
    for p in params:
        kinds.setdefault(_mesh_of(p.grad), []).append(p)
    return kinds


def clip_with_norm(params, max_norm: float, total: torch.Tensor) -> None:
    """Scale every gradient of `params` by min(1, max_norm / total), kind by kind (`_by_kind`)."""
    for group in _by_kind(params).values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)


def clip_grad_norm(params, max_norm: float, norm_group=None) -> torch.Tensor:
    """Clip by the total gradient norm of a parameter group that may be split over `norm_group` (the
    ranks holding *different* parts of it, e.g. pipeline stages; None: this rank holds all of it) and sharded
    by FSDP (DTensor gradients: `grad_norm` takes the norm over every shard); the squared
    norms are summed over `norm_group`, so every part is scaled by the same coefficient."""
    params = list(params)
    total = grad_norm(params)
    if total is None:
        # a group this step did not train (the plain train step's draft) has no gradients: get_total_norm would
        # give a CPU zero, which the metrics' one device-side stack refuses beside CUDA ones; the all-reduce below
        # still runs
        total = torch.zeros((), device=params[0].device if params else None)
    if norm_group is not None:
        sq = total.double().square().reshape(1)
        dist.all_reduce(sq, group=norm_group)
        total = sq[0].sqrt().to(total.dtype)
    clip_with_norm(params, max_norm, total)
    return total


def _mesh_of(grad):
    """The DeviceMesh of a DTensor gradient, None for a plain one (or none)."""
    return grad.device_mesh if isinstance(grad, DTensor) else None


class AllReduceSync:
    """Replicated parameters: local accumulation over micro-batches, one SUM all-reduce over `group` at the end
    (None: a single process, nothing to do)."""

    def __init__(self, group=None):
        self.group = group

    def micro_batch(self, last: bool) -> None:
        pass

    def reduce(self, params) -> None:
        reduce_grads(params, self.group)


class FSDPSync:
    """Parameters of an FSDP2-sharded `module` (parallel.fsdp.apply_fsdp): the reduction is FSDP's own, inside
    the backward (a SUM: apply_fsdp sets the divide factor to 1). `hold_unsharded`: gather once and reduce once
    per step (module docstring); `reshard_after_forward` must be the value given to apply_fsdp, restored after
    the step's last micro-batch."""

    def __init__(self, module: nn.Module, hold_unsharded: bool = False, reshard_after_forward: bool = True):
        from ..parallel.fsdp import fsdp_modules, layer_reshards_after_forward
        self.module, self.hold = module, hold_unsharded
        self.reshard = layer_reshards_after_forward(module, reshard_after_forward)  # [(unit, flag)]
        # units inside a layer's (expert slices sharded over their replica group): always resharded (apply_fsdp)
        self.reshard += [(u, True) for layer, _ in self.reshard[:-1] for u in fsdp_modules(layer) if u is not layer]

    def micro_batch(self, last: bool) -> None:
        if not self.hold:
            return
        root = self.module
        root.set_requires_gradient_sync(last)  # recursive: every unit; HSDP's all-reduce too
        root.set_reshard_after_backward(last)  # the last backward frees the gathered weights
        if last:  # the weights are gathered already: restore apply_fsdp's choice for the next step
            for unit, flag in self.reshard:
                unit.set_reshard_after_forward(flag, recurse=False)
        else:
            root.set_reshard_after_forward(False)  # the next micro-batch's backward needs no gather

    def reduce(self, params) -> None:
        pass  # reduce-scattered (and HSDP-all-reduced) as SUMs inside the backward


class EPSync:
    """A policy whose experts are placed by expert parallelism (parallel/ep.py). Its dense and replicated parameters
    go through `dense`, the strategy they would have without ep: AllReduceSync(group) (the sum over grad_group), or
    FSDPSync(policy) under FSDP (parallel.dp_shard: reduce-scattered inside the backward; apply_fsdp leaves the
    expert slices out of its units). Each expert slice is summed over the ranks holding the same slice only
    (`replica_group`; None: ep covers the stage, nothing to sum) — over the ep group it would add other experts'
    gradients into it, and FSDP's reduce-scatter would cut and sum it with other slices (tests/test_ep.py and
    test_ep_fsdp.py mutate both). The clip's norm:

        |g|² = |g_dense|² (grad_norm: over every FSDP shard, once)  +  Σ_{ep group} |g_slice|² (each rank's experts)

    so every rank scales by the coefficient of the whole model's norm."""

    def __init__(self, policy: nn.Module, group=None, dense=None):
        from ..parallel.ep import expert_parameters
        experts, self.ep_group, self.replica_group = expert_parameters(policy)
        self.group, self.expert_ids = group, {id(p) for p in experts}
        self.dense = dense if dense is not None else AllReduceSync(group)

    def micro_batch(self, last: bool) -> None:
        self.dense.micro_batch(last)  # FSDP may hold its reductions; the slices accumulate until `reduce`

    def _split(self, params):
        params = list(params)
        return ([p for p in params if id(p) not in self.expert_ids], [p for p in params if id(p) in self.expert_ids])

    def reduce(self, params) -> None:
        dense, experts = self._split(params)
        self.dense.reduce(dense)
        if any(isinstance(p, DTensor) for p in experts):  # FSDP shards the slices over the replica group
            return  # (parallel/fsdp.py): its reduce-scatter summed them inside the backward
        for p in experts:  # (EPExperts gives every slice a gradient, zero without rows: kept as a backstop)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        reduce_grads(experts, self.replica_group)

    def clip(self, params, max_norm: float, norm_group=None) -> torch.Tensor:
        """clip_grad_norm's contract: `norm_group` the ranks holding the policy's other parts (pipeline stages),
        over which this stage's squared norm (dense + its whole experts) is summed."""
        params = list(params)
        dense, experts = self._split(params)
        n_dense, n_exp = grad_norm(dense), grad_norm(experts)
        like = n_dense if n_dense is not None else n_exp
        dev = like.device if like is not None else params[0].device
        sq_exp = n_exp.double().square().reshape(1) if n_exp is not None else \
            torch.zeros(1, dtype=torch.float64, device=dev)
        dist.all_reduce(sq_exp, group=self.ep_group)  # the ep group's slices make the whole experts
        sq_dense = n_dense.double().square().to(dev) if n_dense is not None else 0.0
        sq = (sq_dense + sq_exp).reshape(1)
        if norm_group is not None:  # the other stages' squares (each its dense part and whole experts)
            dist.all_reduce(sq, group=norm_group)
        total = sq[0].sqrt().to(like.dtype if like is not None else torch.float32)
        clip_with_norm(params, max_norm, total)
        return total


def grad_syncs(policy: nn.Module | None, group=None, hold_unsharded: bool = False,
               reshard_after_forward: bool = True) -> dict:
    """The strategies of the optimizer's groups ('policy', 'draft'): FSDP for a sharded policy, the all-reduce
    over `group` (the stage's dp × cp ranks) for everything replicated — the draft always (parallel/fsdp.py says
    why); for a policy with expert-parallel experts (parallel/ep.py) EPSync, with FSDP's or the all-reduce for its
    dense part."""
    from ..parallel.ep import is_ep
    from ..parallel.fsdp import is_sharded
    pol = FSDPSync(policy, hold_unsharded, reshard_after_forward) if policy is not None and is_sharded(policy) \
        else AllReduceSync(group)
    if is_ep(policy):  # the experts apart, the rest as above (FSDP's or the all-reduce)
        pol = EPSync(policy, group, dense=pol)
    return {"policy": pol, "draft": AllReduceSync(group)}
