"""Whole-tensor checkpoints of an FSDP-sharded arm (parallel.dp_shard): gather to save, shard again to resume.

    state.update(fsdp_checkpoint_state(st))   every rank (collectives); rank 0 writes, as without FSDP
    fsdp_restore(st, s)                        every rank holds the whole checkpoint `s` (rl._load_latest)

The checkpoint is the one a single process writes: the policy's state dict with whole tensors (the Hugging Face
part names of the fused projections, layers.fuse_linears) and the optimizer's state dict keyed by parameter
index, its AdamW moments whole. So a run saved at dp_shard 2 resumes at dp_shard 2, or on one process, and a
single process's checkpoint resumes under FSDP (the parameter order is the same: apply_fsdp replaces parameters
in place). Sharded checkpoints (torch.distributed.checkpoint, each rank writing its shards) are a separate
helper; this one holds the whole policy on rank 0's host while it writes.

Why not torch.distributed.checkpoint.state_dict's get_model_state_dict(full_state_dict=True): it resolves every
state-dict key back to a parameter by attribute path, and the fused projections' keys (`q_proj`, a row slice of
the `qkv_proj` parameter, written by a state-dict hook) are no attribute: AttributeError. The gathers here go
through the module's own state_dict, hooks included; the load through load_state_dict, whose pre-hook joins the
parts, with each whole tensor given as a replicated DTensor that FSDP's parameter copy slices to its shard.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from .trainer import ArmState, full_state

__all__ = ["fsdp_checkpoint_state", "fsdp_restore", "whole_optimizer_state"]


def _opt_params(opt: torch.optim.Optimizer) -> list:
    """The optimizer's parameters in its state dict's index order (param groups in order)."""
    return [p for g in opt.param_groups for p in g["params"]]


def whole_optimizer_state(opt: torch.optim.Optimizer) -> dict:
    """`opt.state_dict()` with its DTensor moments gathered into whole host tensors (a collective per tensor over
    each one's mesh: every rank holding the parameters calls it; each returns the same)."""
    sd = opt.state_dict()
    state = {i: {k: (v.full_tensor() if isinstance(v, DTensor) else v).cpu() if torch.is_tensor(v) else v
                 for k, v in s.items()} for i, s in sd["state"].items()}
    return {**sd, "state": state}


def fsdp_checkpoint_state(st: ArmState) -> dict:
    """The policy and optimizer entries of a checkpoint with every shard gathered into whole host tensors (a
    collective per tensor: every rank calls it; each returns the same)."""
    return {"policy": {k: v.detach().cpu() for k, v in full_state(st.policy).items()},
            "opt": whole_optimizer_state(st.opt)}


def fsdp_restore(st: ArmState, s: dict) -> None:
    """Load the whole checkpoint `s` (fsdp_checkpoint_state's entries, or a single process's) into the sharded
    policy and its optimizer: each rank keeps its own slices (no communication: every rank holds `s`)."""
    template = st.policy.state_dict()
    policy = {}
    for k, v in s["policy"].items():
        t = template.get(k)
        if isinstance(t, DTensor):  # whole and replicated; FSDP's copy_ into the shard takes this rank's rows
            v = distribute_tensor(v.to(t.dtype), t.device_mesh, [Replicate()] * t.device_mesh.ndim,
                                  src_data_rank=None)
        policy[k] = v
    st.policy.load_state_dict(policy)
    params = _opt_params(st.opt)
    state = {}
    for i, entry in s["opt"]["state"].items():
        p = params[int(i)]
        state[i] = {k: distribute_tensor(v.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
                    if isinstance(p, DTensor) and torch.is_tensor(v) and v.shape == p.shape else v
                    for k, v in entry.items()}
    st.opt.load_state_dict({**s["opt"], "state": state})
