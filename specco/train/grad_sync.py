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

`clip_grad_norm` takes the norm over all of a group's shards (DTensor grads: `full_tensor()` of the local norms)
and over its pipeline stages (`norm_group`), so the clip coefficient is the unsharded step's.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

__all__ = ["AllReduceSync", "FSDPSync", "EPSync", "grad_syncs", "reduce_grads", "clip_grad_norm"]


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


def clip_grad_norm(params, max_norm: float, norm_group=None) -> torch.Tensor:
    """Clip by the total gradient norm of a parameter group that may be split over `norm_group` (the
    ranks holding *different* parts of it, e.g. pipeline stages; None: this rank holds all of it) and sharded
    by FSDP (DTensor gradients: the local norms' `full_tensor()` is the norm over every shard); the squared
    norms are summed over `norm_group`, so every part is scaled by the same coefficient."""
    params = list(params)
    # by kind of gradient: plain tensors and each DTensor mesh apart (tensor parallelism without FSDP leaves the
    # norms and the embedding plain beside the layers' tp shards; FSDP over tp puts them on another mesh than the
    # 2-D tp ones), since torch's foreach kernels refuse a mix. One kind: the single norm of before
    kinds: dict = {}
    for p in params:
        kinds.setdefault(_mesh_of(p.grad), []).append(p)
    total = None
    for group in kinds.values():
        grads = [p.grad for p in group if p.grad is not None]
        if not grads:
            continue
        n = torch.nn.utils.get_total_norm(grads)
        if isinstance(n, DTensor):  # Partial over the shards: the all-reduce of the squares happens here
            n = n.full_tensor()
        total = n if total is None else torch.linalg.vector_norm(torch.stack([total, n]))
    if total is None:
        # a group this step did not train (the plain train step's draft) has no gradients: get_total_norm would
        # give a CPU zero, which the metrics' one device-side stack refuses beside CUDA ones; the all-reduce below
        # still runs
        total = torch.zeros((), device=params[0].device if params else None)
    if norm_group is not None:
        sq = total.double().square().reshape(1)
        dist.all_reduce(sq, group=norm_group)
        total = sq[0].sqrt().to(total.dtype)
    for group in kinds.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
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
        from ..parallel.fsdp import layer_reshards_after_forward
        self.module, self.hold = module, hold_unsharded
        self.reshard = layer_reshards_after_forward(module, reshard_after_forward)  # [(unit, flag)]

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
    """A policy whose experts are placed by expert parallelism (parallel/ep.py): the dense and replicated
    parameters summed over `group` (grad_group) as AllReduceSync does; each expert slice over the ranks holding
    the same slice only (`replica_group`; None: ep covers the stage, nothing to sum) — over the ep group it would
    add other experts' gradients into it. The clip's norm sums the slices' squared norms over the ep group (each
    rank holds other experts) and adds the replicated parameters' once."""

    def __init__(self, policy: nn.Module, group=None):
        from ..parallel.ep import expert_parameters
        experts, self.ep_group, self.replica_group = expert_parameters(policy)
        self.group, self.expert_ids = group, {id(p) for p in experts}

    def micro_batch(self, last: bool) -> None:
        pass

    def _split(self, params):
        params = list(params)
        return ([p for p in params if id(p) not in self.expert_ids], [p for p in params if id(p) in self.expert_ids])

    def reduce(self, params) -> None:
        dense, experts = self._split(params)
        reduce_grads(dense, self.group)
        for p in experts:  # a slice that saw no row on this rank has no gradient: its peers still all-reduce
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        reduce_grads(experts, self.replica_group)

    def clip(self, params, max_norm: float, norm_group=None) -> torch.Tensor:
        """clip_grad_norm's contract (pp is refused with ep, so `norm_group` must be None)."""
        if norm_group is not None:
            raise ValueError("parallel.ep with a pipeline's norm group is not implemented (parallel.pp > 1)")
        dense, experts = self._split(params)
        grads = [p.grad for p in dense if p.grad is not None]
        sq_dense = torch.nn.utils.get_total_norm(grads).double().square() if grads else \
            torch.zeros((), dtype=torch.float64)
        eg = [p.grad for p in experts if p.grad is not None]
        sq_exp = torch.nn.utils.get_total_norm(eg).double().square().reshape(1) if eg else \
            torch.zeros(1, dtype=torch.float64, device=sq_dense.device)
        dist.all_reduce(sq_exp, group=self.ep_group)  # the ep group's slices make the whole experts
        dtype = (grads or eg)[0].dtype if (grads or eg) else torch.float32
        total = (sq_dense.to(sq_exp.device) + sq_exp[0]).sqrt().to(dtype)
        torch.nn.utils.clip_grads_with_norm_(list(params), max_norm, total)
        return total


def grad_syncs(policy: nn.Module | None, group=None, hold_unsharded: bool = False,
               reshard_after_forward: bool = True) -> dict:
    """The strategies of the optimizer's groups ('policy', 'draft'): FSDP for a sharded policy, the all-reduce
    over `group` (the stage's dp × cp ranks) for everything replicated — the draft always (parallel/fsdp.py says
    why); EPSync for a policy with expert-parallel experts (parallel/ep.py)."""
    from ..parallel.ep import is_ep
    from ..parallel.fsdp import is_sharded
    if is_ep(policy):
        return {"policy": EPSync(policy, group), "draft": AllReduceSync(group)}
    pol = FSDPSync(policy, hold_unsharded, reshard_after_forward) if policy is not None and is_sharded(policy) \
        else AllReduceSync(group)
    return {"policy": pol, "draft": AllReduceSync(group)}
