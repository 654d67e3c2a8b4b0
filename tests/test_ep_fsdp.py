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

(and dp_shard 4 × ep 2 with activation checkpointing: the backward recomputes each layer's all-to-alls and FSDP
gathers it again) each against the ep 1, no-FSDP data-parallel step in the same processes (a whole policy per rank,
its gradients all-reduced: tests/test_ep.py and test_dp.py tie that step to one process):

* "policy/loss", "policy/aux_loss" (this rank's shares) and the policy's grad norm (clipping active: max 0.1, the
  norm 0.496): rel 1e-10;
* every gradient after the step's reduction and clip: a dense one as the full tensor of its DTensor shard, an expert
  one as this rank's slice (E/ep experts from ep_rank · E/ep) of the reference's; every parameter after the AdamW
  step the same way: rtol 1e-9, atol 1e-12. fp64; only summation orders differ (the reduce-scatter's and the
  replica all-reduce's against one all-reduce over 4 ranks; an expert's rows in all-to-all arrival order), ~1e-15
  relative, so 1e-9 leaves room while a gradient reduced over the wrong ranks (off by whole rows, or doubled) cannot
  pass. Seen: at most 1.0e-15 absolute over every gradient and parameter of the four layouts.
* bf16 at ep 2 × dp_shard 2 (world 2), and at ep 2 × dp_shard 4 (world 4: replica-sharded slices, gathered in
  bf16): FSDP's MixedPrecisionPolicy(bf16, fp32 reduce) under the step's autocast against the ep 1 autocast step
  (fp32 master weights in both; slices with one holder stay fp32 under FSDP and autocast casts them, as it does the
  reference's). The runs round different tensors to bf16 (FSDP casts every dense weight:
  norms and head run on bf16 weights), so as tests/test_fsdp.py derives: losses, aux loss and grad norm within
  rtol 2e-2; after the one AdamW step every weight moved by lr·g/(|g| + eps) = ±lr in both runs, so a component
  whose gradient sign the rounding flips is off by at most 2·lr (a hard bound), and the mean stays below 0.05·lr.
  Seen: loss 2.6e-5, grad norm 1.6e-3 relative; parameters max 1.99 lr, mean 0.0067 lr.

Mutations that must fail the same comparison (asserted to differ, on every rank): the expert slices handed to FSDP
(not ignored: reduce-scattered over the fsdp ranks with other experts' gradients), and the slices' gradients summed
over the ep group instead of the replica group.

The RL loop: two steps of the co-trained EAGLE-3 arm (run_arm, PPO 2 × 2 with the log-prob recompute, a KL
reference sharded and expert-placed like the trainer) at ep 2 × dp_shard 2 (world 2; slow lane: ep 2 × dp_shard 4,
each slice on two ranks) against the same run at ep 1 without FSDP, a resume from its step-1 checkpoint at the same
layout (bit for bit), and at ep 1 without FSDP and back (other layouts, fp64 summation order); measurement hooks and
on_nonfinite=skip leave the trajectory bit for bit. The same at dp 1 × cp 2 with dp_shard 1 (FSDP and ep both over
the cp pair), and at dp_shard 2, ep 1 (the experts FSDP-sharded along the expert dim with their layers, gathered for
the layer: no all-to-all). The step at ep 1 under FSDP (dp_shard 4, HSDP 2 × 2) likewise against the replicated
step. Refusals by name: ep × FSDP with tp (derive.check_parallel).
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
from specco.train.cotrain import TrainBatch
from test_ep import CFG, LR, QWEN3_MOE, B, _batch, _compare, _full, _policy, _rank_rows, _step

pytestmark = pytest.mark.dist

WORLD = 4
LAYOUTS = ((2, 2), (4, 2), (4, 4), (2, 4))  # (dp_shard, ep) at dp 4


def _ep_fsdp_policy(base, mesh, checkpointed=False, replicas_are_ep=False):
    """The trainer's copy as make_arm cuts it: EP on the meta model, (activation checkpointing,) then FSDP of the
    rest, filled from `base`."""
    from specco.train.activation_checkpointing import apply_activation_checkpointing

    def prepare(m):
        if mesh.ep > 1:  # at ep 1 FSDP shards the (E, ...) expert tensors with their layer
            # (the mutation: the slices' "replicas" taken to be the ep group, which holds other experts)
            apply_ep(m, mesh.ep_group, mesh.ep_group if replicas_are_ep else mesh.ep_replica_group)
        if checkpointed:  # the backward recomputes each layer: its all-to-alls and FSDP's gathers, in order
            apply_activation_checkpointing(m)
    return sharded_copy(base, mesh.fsdp_mesh, prepare=prepare)


def _mismatches(rank, dp_shard, ep, mutation) -> list[str]:
    mesh = Mesh.build(dp=WORLD, backend="gloo", dp_shard=dp_shard, ep=ep)
    local = _rank_rows(_batch(), rank)
    base = _policy()
    m_ref, g_ref, p_ref = _step(copy.deepcopy(base), local, grad_group=dist.group.WORLD)
    assert m_ref["policy/grad_norm"] > 2 * CFG.policy_grad_clip  # the clip is active
    policy = _ep_fsdp_policy(base, mesh, checkpointed=mutation == "checkpointed",
                             replicas_are_ep=mutation == "reduce_over_ep")
    local_of = {n: mod for n, mod in policy.named_modules() if isinstance(mod, EPExperts)}
    assert len(local_of) == (2 if ep > 1 else 0)  # the sparse layers 0 and 2
    replicas = WORLD // ep  # the ranks holding one slice: FSDP shards it over them (its own unit) when > 1
    for n, p in policy.named_parameters():  # the dense parameters sharded, the slices E/ep experts each
        slice_ = n.rsplit(".", 1)[0] in local_of
        if slice_ and mutation != "experts_to_fsdp":
            assert p.shape[0] == QWEN3_MOE["num_experts"] // ep, n
            assert isinstance(p, DTensor) == (replicas > 1), n
            if replicas > 1:  # over the replica group only (not the fsdp mesh)
                assert p.device_mesh.size() == replicas and p.to_local().shape[0] == p.shape[0] // replicas, n
        else:
            assert isinstance(p, DTensor), n
    sync = grad_syncs(policy, dist.group.WORLD)
    if ep == 1:  # the experts are FSDP's like the rest: its reduce-scatter sums them
        assert isinstance(sync["policy"], FSDPSync)
        assert isinstance(policy.layers["0"].mlp.experts.gate_up_proj, DTensor)
        assert policy.layers["0"].mlp.experts.gate_up_proj.to_local().shape[0] == QWEN3_MOE["num_experts"] // dp_shard
    else:
        assert isinstance(sync["policy"], EPSync) and isinstance(sync["policy"].dense, FSDPSync)
    if mutation == "reduce_over_ep":
        sync["policy"].replica_group = mesh.ep_group
    return _compare(_step(policy, local, grad_group=dist.group.WORLD, grad_sync=sync), (m_ref, g_ref, p_ref),
                    local_of)


def _step_worker(rank, world, layouts, mutation):
    for dp_shard, ep in layouts:
        bad = _mismatches(rank, dp_shard, ep, mutation)
        if mutation in (None, "checkpointed"):  # (not a mutation: a recipe that must still match)
            assert not bad, (dp_shard, ep, bad)
        else:  # every rank holds experts (or shards) the wrong gradients reached
            assert bad, f"mutation {mutation!r} at dp_shard={dp_shard}, ep={ep} went unnoticed"


def test_ep_fsdp_step_equals_ep1():
    spawn_local(_step_worker, WORLD, LAYOUTS, None)


def test_fsdp_of_a_moe_at_ep1_equals_the_replicated_step():
    """No expert parallelism: FSDP shards each (E, ...) expert tensor along the expert dim (dp_shard 4: 2 experts
    per rank; HSDP 2 × 2: 4), gathers it for the layer and reduce-scatters its gradient like any other tensor."""
    spawn_local(_step_worker, WORLD, ((4, 1), (2, 1)), None)


def test_ep_fsdp_step_with_activation_checkpointing_equals_ep1():
    spawn_local(_step_worker, WORLD, ((4, 2),), "checkpointed")


def _experts_to_fsdp(rank, world, layouts):
    fsdp_mod._expert_slices = lambda model, dev: (None, [])  # the forked worker's copy only: the layers' units take
    # the slices as their own, sharded over the fsdp mesh with the other ep ranks' different experts
    _step_worker(rank, world, layouts, "experts_to_fsdp")


def test_ep_fsdp_mutation_experts_reduce_scattered_by_fsdp_fails():
    spawn_local(_experts_to_fsdp, WORLD, ((4, 2),))


def test_ep_fsdp_mutation_expert_grads_reduced_over_ep_group_fails():
    spawn_local(_step_worker, WORLD, ((4, 2),), "reduce_over_ep")


def _bf16_worker(rank, world, ep=None):
    """bf16 (module docstring): ep × dp_shard = world under FSDP's mixed precision and the step's autocast against the
    ep 1 autocast step without FSDP, fp32 master weights in both. ep < world: each slice has holders and FSDP
    shards it over them, gathering it in bf16 (its own mixed precision) where ep = world leaves it fp32 for autocast."""
    import dataclasses
    from specco.parallel.fsdp import mixed_precision
    ep = ep or world
    mesh = Mesh.build(dp=world, backend="gloo", dp_shard=world, ep=ep)
    full, h = _batch(), B // world
    local = TrainBatch(tokens=full.tokens[rank * h:(rank + 1) * h],
                       **{k: getattr(full, k)[rank * h:(rank + 1) * h].float()
                          for k in ("target_mask", "advantages", "logp_old")})
    base = _policy().float()
    cfg = dataclasses.replace(CFG, amp_dtype=torch.bfloat16)
    m_ref, _, p_ref = _step(copy.deepcopy(base), local, cfg, grad_group=dist.group.WORLD)
    policy = sharded_copy(base, mesh.fsdp_mesh, mp_policy=mixed_precision(torch.bfloat16),
                          prepare=lambda m: apply_ep(m, mesh.ep_group, mesh.ep_replica_group))
    m, g, p = _step(policy, local, cfg, grad_group=dist.group.WORLD, grad_sync=grad_syncs(policy, dist.group.WORLD))
    assert all(v.dtype == torch.float32 for v in list(g.values()) + list(p.values()))  # fp32 masters and grads
    for key in ("policy/loss", "policy/aux_loss", "policy/grad_norm"):
        assert abs(m[key] - m_ref[key]) <= 2e-2 * abs(m_ref[key]), (key, m[key], m_ref[key])
    local_of = {n: mod for n, mod in policy.named_modules() if isinstance(mod, EPExperts)}
    d = []
    for n, q in p.items():
        mod = local_of.get(n.rsplit(".", 1)[0])
        want = p_ref[n] if mod is None else p_ref[n][mod.first:mod.first + mod.local]
        d.append((_full(q) - want).abs().flatten())
    d = torch.cat(d)
    if rank == 0:
        print(f"bf16: loss {abs(m['policy/loss'] / m_ref['policy/loss'] - 1):.1e}, norm "
              f"{abs(m['policy/grad_norm'] / m_ref['policy/grad_norm'] - 1):.1e} relative; params max "
              f"{d.max().item() / LR:.2f} lr, mean {d.mean().item() / LR:.4f} lr", flush=True)
    assert d.max() <= 2.0001 * LR and d.mean() <= 0.05 * LR, (d.max().item(), d.mean().item())


def test_ep_fsdp_step_under_bf16_mixed_precision_tracks_ep1_autocast():
    spawn_local(_bf16_worker, 2)


def test_ep_fsdp_step_with_replica_sharded_slices_under_bf16_tracks_ep1_autocast():
    spawn_local(_bf16_worker, 4, 2)


# -- the RL loop ---------------------------------------------------------------------------------------------------

def _whole_weights(st) -> dict:
    """The arm's trained weights whole by name: the policy's FSDP shards and expert slices gathered (collectives),
    the draft."""
    from specco.parallel.ep import full_expert_state, is_ep
    sd = full_expert_state(st.policy) if is_ep(st.policy) else st.policy.state_dict()
    out = {f"policy.{k}": _full(v).detach().clone() for k, v in sd.items()}
    out.update({f"draft.{k}": v.detach().clone() for k, v in st.draft.state_dict().items()})
    return out


def _rl_worker(rank, world, tmp, dp_shard=2, ep=2, cp=1):
    """Two RL steps of the co-trained EAGLE-3 arm at dp = dp_shard = world / cp, cp and `ep` against the same run
    at ep 1 without FSDP (same processes, same seeds): the same rollouts (step 2's from each run's refit engine),
    rewards, losses, aux loss, KL, grad norms (rel 1e-9: fp64 summation orders), every weight after both steps
    (rtol 1e-9, atol 1e-12), each rank's engine holding the gathered whole policy (bit for bit the trainer's
    gathered weights). The step-1 checkpoint (dense tensors as FSDP's Shard(0) chunks, the experts as their ep
    slices, both with global shapes) resumed at the same layout equals the straight run bit for bit; at ep 1 without
    FSDP (every tensor read whole) to rtol 1e-9, and the other way (ep 1's checkpoint resumed at ep × dp_shard). The
    plain baseline and frozen shadow hooks and on_nonfinite=skip leave the trajectory bit for bit (at dp_shard 2).
    At dp_shard 4 × ep 2 each expert slice is held by two ranks: the checkpoint writes it once (DCP's deduplication
    of equal chunks) and every holder reads it back."""
    import json
    from pathlib import Path
    from test_ep import RL_EXTRA, _rl_models
    from test_grpo import DigitTask
    from test_rl_cp import _cfg
    from specco.runner.rl import full_models, run_arm
    from specco.train.checkpoint import latest_checkpoint
    tmp = Path(tmp)
    tok, policy, draft = _rl_models()
    out = {}
    dp = world // cp
    layout = (f"parallel.dp_shard={dp_shard}", f"parallel.ep={ep}", f"parallel.cp={cp}")
    for name, extra, mesh_kw in (("ep1", (f"parallel.dp={dp}", f"parallel.cp={cp}"), {}),
                                 ("ep2", layout, {"dp_shard": dp_shard, "ep": ep})):
        # 2 GRPO groups per DP rank: minibatches=2
        cfg = _cfg(tmp, *extra, *RL_EXTRA, f"rollout.prompts_per_step={2 * dp}")
        mesh = Mesh.build(dp, cp, backend="gloo", **mesh_kw)
        st, rec = {}, []
        rows = run_arm(cfg, "cotrained", policy, draft, DigitTask(), tok, tmp / name, progress=False, mesh=mesh,
                       state_out=st, record=rec)
        out[name] = (rows, [ro.pairs for ro in rec], st["state"], cfg, mesh)
    (rows1, pairs1, st1, cfg1, mesh1), (rows2, pairs2, st2, cfg2, mesh2) = out["ep1"], out["ep2"]
    assert cfg2.parallel.fsdp and cfg2.parallel.ep == ep and cfg2.parallel.shard == dp_shard
    experts = st2.policy.layers["0"].mlp.experts
    if ep > 1:
        # a slice held by several ranks (dp × cp / ep of them) is FSDP-sharded over them, else plain
        assert isinstance(experts, EPExperts) and isinstance(experts.gate_up_proj, DTensor) == (dp * cp > ep)
        assert experts.gate_up_proj.shape[0] == policy.cfg.num_experts // ep
        assert isinstance(st2.ref.layers["0"].mlp.experts, EPExperts)  # the KL reference placed and sharded alike
    else:  # FSDP shards the experts along the expert dim, the reference's too
        assert isinstance(experts.gate_up_proj, DTensor) and isinstance(st2.ref.layers["0"].mlp.experts.down_proj,
                                                                          DTensor)
    assert isinstance(st2.policy.layers["0"].self_attn.qkv_proj.weight, DTensor)  # the dense part sharded
    assert isinstance(st2.ref.embed_tokens.weight, DTensor)
    assert pairs2 == pairs1
    for a, b in zip(rows2, rows1):
        for k in ("reward", "policy/loss", "policy/aux_loss", "policy/kl", "policy/grad_norm", "draft/loss",
                  "draft/grad_norm"):
            assert abs(a[k] - b[k]) <= 1e-9 * max(1.0, abs(b[k])), (k, a[k], b[k])
    assert rows1[0]["policy/aux_loss"] > 0 and rows1[1]["policy/kl"] > 0  # both terms present
    w1, w2 = _whole_weights(st1), _whole_weights(st2)
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-9, atol=1e-12, msg=k)
    eng = st2.engine.policy.state_dict()  # the engine: the whole policy refit from the gathered shards and experts
    assert all(torch.equal(v, w2[f"policy.{k}"]) for k, v in eng.items())
    whole = full_models(st2)[0].state_dict()  # evaluation and the saved policy: gathered from the trainer (collective)
    assert all(torch.equal(v, w2[f"policy.{k}"]) for k, v in whole.items())
    saved = json.loads((latest_checkpoint(tmp / "ep2" / "ckpt") / "state.json").read_text())["tensors"]
    E = policy.cfg.num_experts  # global shapes: whole experts (and their moments), the whole embedding
    assert saved["model.policy.layers.0.mlp.experts.gate_up_proj"]["shape"][0] == E
    assert saved["opt.state.policy.layers.0.mlp.experts.down_proj.exp_avg"]["shape"][0] == E
    assert saved["model.policy.embed_tokens.weight"]["shape"][0] == policy.cfg.vocab_size
    # resumed at the same layout: bit for bit
    run = lambda d, cfg, mesh, **kw: run_arm(cfg, "cotrained", policy, draft, DigitTask(), tok,  # noqa: E731
                                             tmp / d, progress=False, mesh=mesh, **kw)
    part1 = run("resume", cfg2, mesh2, stop_after=1)
    fin = {}
    part2 = run("resume", cfg2, mesh2, state_out=fin)
    assert [r["step"] for r in part1 + part2] == [1, 2]
    for a, b in zip(rows2, part1 + part2):
        for k in ("reward", "policy/loss", "policy/aux_loss", "draft/loss", "policy/grad_norm"):
            assert a[k] == b[k], (k, a[k], b[k])
    w3 = _whole_weights(fin["state"])
    assert all(torch.equal(w3[k], w2[k]) for k in w2)
    if world == 2 and cp == 1:
        # the measurements (the plain baseline reruns the updates from state copies of the sharded EP policy, loaded
        # back through FSDP's DTensors and EPExperts' state-dict hooks; the frozen shadow) and on_nonfinite=skip's
        # snapshot leave the trajectory as it is
        runs = {}
        for name, hooks in (("with", ("plain_baseline=[cotrained]", "frozen_shadow=[cotrained]")), ("without", ())):
            cfg_m = _cfg(tmp, *layout, *RL_EXTRA, "rollout.sampler=coupled", "rollout.spec_control=on",
                         "train.on_nonfinite=skip", *hooks)
            runs[name] = {}
            runs[name]["rows"] = run(name, cfg_m, mesh2, state_out=runs[name])
        assert "time/rollout_plain" in runs["with"]["rows"][0]
        loss = {k: [r["policy/loss"] for r in v["rows"]] for k, v in runs.items()}
        assert loss["with"] == loss["without"]
        wa, wb = _whole_weights(runs["with"]["state"]), _whole_weights(runs["without"]["state"])
        assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # the ep × dp_shard step-1 checkpoint resumed at ep 1 without FSDP ("other"), and the other way: ep 1's (whole
    # experts) resumed at ep × dp_shard, each rank reading its slice and its shards ("back"): step 2 equals the
    # straight run's at the layout step 2 ran at
    for d, first, then, rows, w in (("other", (cfg2, mesh2), (cfg1, mesh1), rows2, w2),
                                    ("back", (cfg1, mesh1), (cfg2, mesh2), rows1, w1)):
        fin = {}
        again = run(d, *first, stop_after=1) + run(d, *then, state_out=fin)
        assert [r["step"] for r in again] == [1, 2]
        for k in ("reward", "policy/loss", "policy/aux_loss", "draft/loss", "policy/grad_norm"):
            assert abs(again[1][k] - rows[1][k]) <= 1e-9 * max(1.0, abs(rows[1][k])), (d, k, again[1][k], rows[1][k])
        got = _whole_weights(fin["state"])
        for k in w:
            torch.testing.assert_close(got[k], w[k], rtol=1e-9, atol=1e-12, msg=k)


def test_rl_loop_ep2_dp_shard2_equals_ep1_and_resumes(tmp_path):
    spawn_local(_rl_worker, 2, str(tmp_path))


def test_rl_loop_ep2_over_cp2_with_fsdp_equals_ep1(tmp_path):
    """dp 1, cp 2, dp_shard 1: FSDP over the cp pair (the fsdp axis is dp_shard × cp), ep over the same pair (they hold
    other tokens of the same sequences); the ring attention untouched."""
    spawn_local(_rl_worker, 2, str(tmp_path), 1, 2, 2)


def test_rl_loop_fsdp_of_a_moe_at_ep1_equals_replicated_and_resumes(tmp_path):
    """dp_shard 2 at ep 1: the experts FSDP-sharded with their layers (no all-to-all) against the replicated run."""
    spawn_local(_rl_worker, 2, str(tmp_path), 2, 1)


@pytest.mark.slow  # 4 processes
def test_rl_loop_ep2_dp_shard4_equals_ep1_and_resumes(tmp_path):
    spawn_local(_rl_worker, 4, str(tmp_path), 4, 2)


# -- what is refused -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra, world, match", [
    (("parallel.dp_shard=2", "parallel.tp=2"), 4, r"parallel.ep=2 with parallel.tp=2: expert parallelism under tens"),
    # ep × dp_shard itself passes derive's checks: what stops it here is the tiny (dense) policy
    (("parallel.dp_shard=2",), 2, r"parallel.ep=2: policy.source='tiny' with policy.family='llama' is a dense model"),
])
def test_ep_fsdp_layouts_not_wired_are_refused_by_name(tmp_path, extra, world, match):
    from test_rl_cp import _cfg
    from specco.model.config import ConfigError
    from specco.runner.derive import check_parallel
    with pytest.raises(ConfigError, match=match):
        check_parallel(_cfg(tmp_path, "parallel.ep=2", *extra), world, "train")
