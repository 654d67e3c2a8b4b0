"""Expert parallelism composed with FSDP (parallel.ep × parallel.dp_shard, issue 38): the dense parameters sharded by
FSDP over mesh.fsdp_mesh, the expert slices left out of its units (`fully_shard(ignored_params=)`) and summed over
their replica group (train/grad_sync.EPSync over FSDPSync). fp64, gloo, the tiny Qwen3-MoE of tests/test_ep.py
(8 experts, top-2, layer 1 dense, aux loss coefficient 0.05).

The co-training step, 4 ranks (dp 4, 2 rows each), at four layouts built by the production recipe
(parallel/load.sharded_copy with apply_ep as its `prepare`, as trainer.make_arm does):

    dp_shard 2 (HSDP: 2 replicas), ep 2   the ep groups are the fsdp groups, a slice's replicas the other replica
    dp_shard 4, ep 2                      two ep groups inside one fsdp group, each slice on two ranks
    dp_shard 4, ep 4                      ep = fsdp = the world, no replica group
    dp_shard 2 (HSDP), ep 4               an ep group spanning both replicas (two fsdp groups)

each against the ep 1, no-FSDP data-parallel step in the same processes (a whole policy per rank, its gradients
all-reduced: tests/test_ep.py and test_dp.py tie that step to one process):

* "policy/loss", "policy/aux_loss" (this rank's shares) and the policy's grad norm (clipping active: max 0.1, the
  norm 0.496): rel 1e-10;
* every gradient after the step's reduction and clip: a dense one as the full tensor of its DTensor shard, an expert
  one as this rank's slice (E/ep experts from ep_rank · E/ep) of the reference's; every parameter after the AdamW
  step the same way: rtol 1e-9, atol 1e-12. fp64; only summation orders differ (the reduce-scatter's and the
  replica all-reduce's against one all-reduce over 4 ranks; an expert's rows in all-to-all arrival order), ~1e-15
  relative, so 1e-9 leaves room while a gradient reduced over the wrong ranks (off by whole rows, or doubled) cannot
  pass. Seen: max |diff| ~1e-16 on gradients, ~1e-17 on parameters.

Mutations that must fail the same comparison (asserted to differ, on every rank): the expert slices handed to FSDP
(not ignored: reduce-scattered over the fsdp ranks with other experts' gradients), and the slices' gradients summed
over the ep group instead of the replica group.

The RL loop: two steps of the co-trained EAGLE-3 arm (run_arm, PPO 2 × 2 with the log-prob recompute, a KL
reference sharded and expert-placed like the trainer) at ep 2 × dp_shard 2 (world 2) against the same run at ep 1
without FSDP, a resume from its step-1 checkpoint at the same layout (bit for bit), and at ep 1 without FSDP
(another layout, fp64 summation order). Refusals by name: FSDP of a MoE policy at ep 1 (validate.check_moe_layout,
apply_fsdp), ep × FSDP with pp or tp (derive.check_parallel).
"""
import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import specco.parallel.fsdp as fsdp_mod
from specco.parallel.ep import EPExperts, apply_ep
from specco.parallel.load import sharded_copy
from specco.parallel.mesh import Mesh, spawn_local
from specco.train.grad_sync import EPSync, FSDPSync, grad_syncs
from specco.train.cotrain import StepConfig, TrainBatch, build_optimizer, cotrain_step
from test_ep import QWEN3_MOE, B, _batch, _policy

pytestmark = pytest.mark.dist

WORLD = 4
LAYOUTS = ((2, 2), (4, 2), (4, 4), (2, 4))  # (dp_shard, ep) at dp 4


# 2 micro-batches per rank; the clip active (the reference's norm is 0.496: test_ep.py's 0.5 would not clip)
CFG = StepConfig(micro_batch_rows=1, policy_grad_clip=0.1)


def _step(policy, batch, **kw):
    opt = build_optimizer(policy, None, 1e-2, 1e-2)
    m = cotrain_step(policy, None, batch, opt, None, CFG, **kw)
    return m, {n: p.grad.clone() for n, p in policy.named_parameters()}, \
        {n: p.detach().clone() for n, p in policy.named_parameters()}


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _ep_fsdp_policy(base, mesh):
    """The trainer's copy as make_arm cuts it: EP on the meta model, then FSDP of the rest, filled from `base`."""
    return sharded_copy(base, mesh.fsdp_mesh, prepare=lambda m: apply_ep(m, mesh.ep_group, mesh.ep_replica_group))


def _mismatches(rank, dp_shard, ep, mutation) -> list[str]:
    mesh = Mesh.build(dp=WORLD, backend="gloo", dp_shard=dp_shard, ep=ep)
    full, h = _batch(), B // WORLD
    local = TrainBatch(**{k: getattr(full, k)[rank * h:(rank + 1) * h]
                          for k in ("tokens", "target_mask", "advantages", "logp_old")})
    base = _policy()
    m_ref, g_ref, p_ref = _step(copy.deepcopy(base), local, grad_group=dist.group.WORLD)
    assert m_ref["policy/grad_norm"] > 2 * CFG.policy_grad_clip  # the clip is active
    policy = _ep_fsdp_policy(base, mesh)
    local_of = {n: mod for n, mod in policy.named_modules() if isinstance(mod, EPExperts)}
    assert len(local_of) == 2  # the sparse layers 0 and 2
    for n, p in policy.named_parameters():  # the dense parameters sharded, the slices plain (E/ep experts)
        slice_ = n.rsplit(".", 1)[0] in local_of
        assert isinstance(p, DTensor) != slice_ or mutation == "experts_to_fsdp", n
        if slice_:
            assert p.shape[0] == QWEN3_MOE["num_experts"] // ep, n
    sync = grad_syncs(policy, dist.group.WORLD)
    assert isinstance(sync["policy"], EPSync) and isinstance(sync["policy"].dense, FSDPSync)
    if mutation == "reduce_over_ep":
        sync["policy"].replica_group = mesh.ep_group
    m, g, p = _step(policy, local, grad_group=dist.group.WORLD, grad_sync=sync)
    bad = []
    for key in ("policy/loss", "policy/aux_loss", "policy/grad_norm"):
        if abs(m[key] - m_ref[key]) > 1e-10 * abs(m_ref[key]):
            bad.append(f"{key}: {m[key]} vs {m_ref[key]}")
    assert g.keys() == g_ref.keys()
    for n in g_ref:
        mod = local_of.get(n.rsplit(".", 1)[0])
        cut = slice(mod.first, mod.first + mod.local) if mod is not None else slice(None)
        for what, got, want in (("grad", _whole(g[n]), g_ref[n][cut]), ("param", _whole(p[n]), p_ref[n][cut])):
            if not torch.allclose(got, want, rtol=1e-9, atol=1e-12):
                bad.append(f"{what} {n}: max diff {(got - want).abs().max().item():.3g}")
    return bad


def _step_worker(rank, world, layouts, mutation):
    for dp_shard, ep in layouts:
        bad = _mismatches(rank, dp_shard, ep, mutation)
        if mutation is None:
            assert not bad, (dp_shard, ep, bad)
        else:  # every rank holds experts (or shards) the wrong gradients reached
            assert bad, f"mutation {mutation!r} at dp_shard={dp_shard}, ep={ep} went unnoticed"


def test_ep_fsdp_step_equals_ep1():
    spawn_local(_step_worker, WORLD, LAYOUTS, None)


def _experts_to_fsdp(rank, world, layouts):
    fsdp_mod._expert_slices = lambda model: None  # the forked worker's copy only: FSDP shards the slices too
    _step_worker(rank, world, layouts, "experts_to_fsdp")


def test_ep_fsdp_mutation_experts_reduce_scattered_by_fsdp_fails():
    spawn_local(_experts_to_fsdp, WORLD, ((4, 2),))


def test_ep_fsdp_mutation_expert_grads_reduced_over_ep_group_fails():
    spawn_local(_step_worker, WORLD, ((4, 2),), "reduce_over_ep")
