"""Expert parallelism (parallel/ep.py) of the co-training step on a tiny Qwen3-MoE (8 experts, top-2), fp64, gloo.

4 ranks, data parallel (dp = 4, 2 rows each), the step with the experts spread over ep = 2 (two replicas of each
slice) and ep = 4 (one), against the SAME data-parallel step at ep = 1 run in the same processes (the reference: a
whole policy per rank, its gradients all-reduced over the 4 ranks; test_dp.py shows that step equals one process):

* "policy/loss" and "policy/aux_loss" (this rank's shares; the aux loss reads the local router logits, which ep
  does not change), and the policy's grad norm (the ep group's slices' norms summed, EPSync.clip): rel 1e-10;
* every parameter's gradient after the step's reduction and clip (clipping active: max norm 0.1, the norm 0.496), the dense ones
  whole, each expert tensor as this rank's slice of the reference's (E/ep experts from ep_rank · E/ep), and every
  parameter after the AdamW step: rtol 1e-9, atol 1e-12. fp64; what differs is only the summation order (an expert's
  gradient sums the rows of its ep group's ranks in arrival order, then over its replicas; the reference sums each
  rank's rows, then over all four), ~1e-15 relative, so 1e-9 leaves room and a wrong route (gradients off by
  whole rows) cannot pass;
* the sum of "policy/loss" over the ranks equals the one-process step's on the whole batch (rel 1e-10).
* the same at ep 2 with activation checkpointing on the EP policy (the backward recomputes each layer's
  all-to-alls, in the same order on every rank);
* this rank's state dict (its experts under global HF names) loads back into a fresh EP copy; `full_expert_state`
  (the refit's view) equals the reference's trained state dict.

Mutations that must fail it (run here, asserted to differ): the combine without the reverse permutation of step 4
(outputs land on other rows), and the expert gradients all-reduced over the ep group instead of the replica group.
A rank with more micro-batches than its ep peers raises (instead of hanging in an all-to-all).

The RL loop: two steps of the co-trained EAGLE-3 arm at ep 2 over dp 2, over cp 2, and at ep 4 over dp 4 (slow),
against the same run at ep 1 (see `_rl_worker`), with resumes from the ep checkpoint at ep and at ep 1. Refusals
by name: ep with tp, compile, outside `specco train`, on a dense policy, sizes it does not divide (ep with
dp_shard: tests/test_ep_fsdp.py).
"""
import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import specco.parallel.ep as ep_mod
from specco.model.config import PolicyConfig
from specco.model.policy import Policy
from specco.parallel.ep import EPExperts, apply_ep, full_expert_state
from specco.parallel.mesh import Mesh, spawn_local
from specco.train.cotrain import StepConfig, TrainBatch, build_optimizer, cotrain_step
from specco.train.grad_sync import AllReduceSync, EPSync

pytestmark = pytest.mark.dist

V, B, S, WORLD = 53, 8, 12, 4
QWEN3_MOE = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=2,
                 model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                 norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=(1,), router_aux_loss_coef=0.05)


def _policy() -> Policy:
    torch.manual_seed(0)
    policy = Policy(PolicyConfig(**QWEN3_MOE))
    with torch.no_grad():  # decisive routing (the init's 0.02 router routes nearly uniformly)
        for name, p in policy.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    return policy.double()


def _batch() -> TrainBatch:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, V, (B, S), generator=g)
    mask = torch.zeros(B, S, dtype=torch.float64)
    for b in range(B):
        mask[b, 2:S - b % 3] = 1
    return TrainBatch(tokens=tokens, target_mask=mask, advantages=torch.randn(B, generator=g, dtype=torch.float64),
                      logp_old=-torch.rand(B, S, generator=g, dtype=torch.float64) * 3)


# 2 micro-batches per rank; the clip is active (the reference's norm is 0.496: asserted in _mismatches)
CFG = StepConfig(micro_batch_rows=1, policy_grad_clip=0.1)
LR = 1e-2


def _step(policy, batch, cfg=CFG, **kw):
    """One co-training step of `policy` (AdamW at LR): (metrics, gradients, parameters after the update)."""
    opt = build_optimizer(policy, None, LR, LR)
    m = cotrain_step(policy, None, batch, opt, None, cfg, **kw)
    return m, {n: p.grad.clone() for n, p in policy.named_parameters()}, \
        {n: p.detach().clone() for n, p in policy.named_parameters()}


def _rank_rows(full: TrainBatch, rank: int) -> TrainBatch:
    """This data-parallel rank's B / WORLD rows of `full`."""
    h = B // WORLD
    return TrainBatch(**{k: getattr(full, k)[rank * h:(rank + 1) * h]
                         for k in ("tokens", "target_mask", "advantages", "logp_old")})


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (an FSDP shard) as its whole tensor; a plain tensor as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _compare(step, ref, local_of) -> list[str]:
    """What differs between an expert-parallel step's (metrics, grads, params) and the ep 1 reference's (module
    docstring: metrics rel 1e-10; each gradient and parameter rtol 1e-9, atol 1e-12, a DTensor as its full tensor,
    an expert slice against its experts' rows of the reference's). `local_of`: {FQN: EPExperts} of the step's policy."""
    (m, g, p), (m_ref, g_ref, p_ref) = step, ref
    bad = []
    for key in ("policy/loss", "policy/aux_loss", "policy/grad_norm"):
        if abs(m[key] - m_ref[key]) > 1e-10 * abs(m_ref[key]):
            bad.append(f"{key}: {m[key]} vs {m_ref[key]}")
    assert g.keys() == g_ref.keys()
    for n in g_ref:
        mod = local_of.get(n.rsplit(".", 1)[0])
        cut = slice(mod.first, mod.first + mod.local) if mod is not None else slice(None)
        for what, got, want in (("grad", _full(g[n]), g_ref[n][cut]), ("param", _full(p[n]), p_ref[n][cut])):
            if not torch.allclose(got, want, rtol=1e-9, atol=1e-12):
                bad.append(f"{what} {n}: max diff {(got - want).abs().max().item():.3g}")
    return bad


def _mismatches(rank, ep, mutation) -> list[str]:
    mesh = Mesh.build(dp=WORLD, backend="gloo", ep=ep)
    full = _batch()
    local = _rank_rows(full, rank)
    base = _policy()
    m_ref, g_ref, p_ref = _step(copy.deepcopy(base), local, grad_group=dist.group.WORLD)
    assert m_ref["policy/grad_norm"] > 2 * CFG.policy_grad_clip  # the clip is active
    policy = apply_ep(copy.deepcopy(base), mesh.ep_group, mesh.ep_replica_group)
    if mutation == "checkpointed":  # activation checkpointing: the backward recomputes each layer's all-to-alls
        from specco.train.activation_checkpointing import apply_activation_checkpointing
        apply_activation_checkpointing(policy)
    sync = None
    if mutation == "reduce_over_ep":
        sync = {"policy": EPSync(policy, dist.group.WORLD), "draft": AllReduceSync(dist.group.WORLD)}
        sync["policy"].replica_group = mesh.ep_group
    m, g, p = _step(policy, local, grad_group=dist.group.WORLD, grad_sync=sync)
    local_of = {n: mod for n, mod in policy.named_modules() if isinstance(mod, EPExperts)}
    bad = _compare((m, g, p), (m_ref, g_ref, p_ref), local_of)
    assert len(local_of) == 2  # the sparse layers 0 and 2 (layer 1 is in mlp_only_layers)
    # this rank's state dict (its experts under global names) loads back into the slices (state copies)
    copy_sd = {k: v.clone() for k, v in policy.state_dict().items()}
    assert f"layers.0.mlp.experts.{local_of['layers.0.mlp.experts'].first}.gate_proj.weight" in copy_sd
    twin = apply_ep(copy.deepcopy(base), mesh.ep_group, mesh.ep_replica_group)
    twin.load_state_dict(copy_sd)
    assert all(torch.equal(a, b) for a, b in zip(twin.parameters(), policy.parameters()))
    if mutation is None:  # the ranks' losses add up to one process's whole-batch loss
        total = torch.tensor([m["policy/loss"]], dtype=torch.float64)
        dist.all_reduce(total)
        m_one, _, _ = _step(copy.deepcopy(base), full)
        assert abs(total.item() - m_one["policy/loss"]) <= 1e-10 * abs(m_one["policy/loss"])
        # the refit's view: the whole experts gathered equal the reference's trained weights
        whole = full_expert_state(policy)
        ref_sd = _ref_state(base, p_ref)
        assert whole.keys() == ref_sd.keys()
        for k in ref_sd:
            torch.testing.assert_close(whole[k], ref_sd[k], rtol=1e-9, atol=1e-12)
    return bad


def _ref_state(base, params):
    ref = copy.deepcopy(base)
    with torch.no_grad():
        for n, q in ref.named_parameters():
            q.copy_(params[n])
    return ref.state_dict()


def _worker(rank, world, ep, mutation):
    bad = _mismatches(rank, ep, mutation)
    if mutation in (None, "checkpointed"):  # (not a mutation: a layout that must still match)
        assert not bad, bad
    else:  # the mutation must be caught, on every rank (each holds experts the wrong rows reached)
        assert bad, f"mutation {mutation!r} at ep={ep} went unnoticed"


def _bf16_worker(rank, world, grouped=False):
    """bf16 autocast (fp32 weights): the dispatch and combine carry bf16 rows (gloo here, NCCL on GPU). The
    forward is row-wise, so the loss and aux loss equal ep 1's to fp32 rounding (rel 1e-6); the gradients are
    bf16 GEMMs whose reductions run over other row groupings (an expert's rows from both ranks at once), so the
    grad norm is compared at rel 1e-3 (measured 6e-8) and each gradient at bf16's resolution (rtol 2e-2).
    grouped: the experts take the grouped GEMM (on torch's CPU kernel; on a Hopper GPU it is what bf16 takes),
    and the EP run must have taken it too (model/moe.expert_ffn, shared by Experts and EPExperts)."""
    from specco.model import moe
    taken = []
    if grouped:
        real = moe.expert_ffn_grouped
        moe.grouped_mm_applies = lambda a, *ws: a.dtype == torch.bfloat16 and all(
            w.dtype == torch.bfloat16 for w in ws)
        moe.expert_ffn_grouped = lambda *a: taken.append(a[0].shape[0]) or real(*a)
    mesh = Mesh.build(dp=world, backend="gloo", ep=world)
    full, h = _batch(), B // world
    local = TrainBatch(tokens=full.tokens[rank * h:(rank + 1) * h],
                       **{k: getattr(full, k)[rank * h:(rank + 1) * h].float()
                          for k in ("target_mask", "advantages", "logp_old")})
    base = _policy().float()
    cfg = StepConfig(micro_batch_rows=1, policy_grad_clip=0.1, amp_dtype=torch.bfloat16)  # the clip active
    runs = []
    for ep in (False, True):
        policy = apply_ep(copy.deepcopy(base), mesh.ep_group, mesh.ep_replica_group) if ep else copy.deepcopy(base)
        before = len(taken)
        m = cotrain_step(policy, None, local, build_optimizer(policy, None, 0.0, 0.0), None, cfg,
                         grad_group=dist.group.WORLD)
        assert (len(taken) > before) == grouped, (ep, grouped, taken)
        runs.append((m, policy))
    (m1, p1), (m2, p2) = runs
    for key, rel in (("policy/loss", 1e-6), ("policy/aux_loss", 1e-6), ("policy/grad_norm", 1e-3)):
        assert abs(m2[key] - m1[key]) <= rel * abs(m1[key]), (key, m2[key], m1[key])
    local_of = {n: mod for n, mod in p2.named_modules() if isinstance(mod, EPExperts)}
    ref = dict(p1.named_parameters())
    for n, q in p2.named_parameters():
        mod = local_of.get(n.rsplit(".", 1)[0])
        want = ref[n].grad if mod is None else ref[n].grad[mod.first:mod.first + mod.local]
        torch.testing.assert_close(q.grad, want, rtol=2e-2, atol=1e-5, msg=n)


@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped_gemm"])
def test_ep_step_under_bf16_autocast_matches_ep1(grouped):
    if grouped:
        from test_moe import _grouped_kernel_runs
        if not _grouped_kernel_runs("cpu"):
            pytest.skip("no grouped-GEMM kernel on cpu")
    spawn_local(_bf16_worker, 2, grouped)


def _groups_worker(rank, world):
    """The placement (parallel/mesh.py, ep_groups): at dp 2 × cp 2, ep 2 is the cp pair (cp innermost: the ranks
    holding other tokens of the same sequences), the replicas of a slice are the same cp rank of each dp rank;
    at ep 4 the whole stage, with no replica group."""
    ranks = dist.get_process_group_ranks
    m = Mesh.build(dp=2, cp=2, backend="gloo", ep=2)
    assert ranks(m.ep_group) == ranks(m.cp_group) == [rank - rank % 2, rank - rank % 2 + 1]
    assert ranks(m.ep_replica_group) == [rank % 2, rank % 2 + 2]
    m = Mesh.build(dp=2, cp=2, backend="gloo", ep=4)
    assert ranks(m.ep_group) == [0, 1, 2, 3] and m.ep_replica_group is None
    with pytest.raises(ValueError, match=r"parallel.ep=3 must divide parallel.dp × parallel.cp = 4"):
        Mesh.build(dp=2, cp=2, backend="gloo", ep=3)


def test_ep_groups_are_placed_over_dp_x_cp():
    spawn_local(_groups_worker, 4)


def _uneven_worker(rank, world):
    mesh = Mesh.build(dp=world, backend="gloo", ep=world)
    policy = apply_ep(_policy(), mesh.ep_group, mesh.ep_replica_group)
    local = _batch()
    n = 2 + rank  # rank 1 would run one micro-batch more
    local = TrainBatch(**{k: getattr(local, k)[:n] for k in ("tokens", "target_mask", "advantages", "logp_old")})
    with pytest.raises(RuntimeError, match=r"parallel.ep: the ranks of an ep group have between 2 and 3 micro-b"):
        _step(policy, local, grad_group=dist.group.WORLD)


def test_ep_uneven_micro_batches_raise_instead_of_hanging():
    spawn_local(_uneven_worker, 2)


def _no_unpermute(rank, world, ep):
    ep_mod._unpermute = lambda ys, perm: ys  # the forked worker's copy only
    _worker(rank, world, ep, "no_unpermute")


@pytest.mark.parametrize("ep", [2, 4])
def test_ep_step_equals_ep1(ep):
    spawn_local(_worker, WORLD, ep, None)


def test_ep_step_with_activation_checkpointing_equals_ep1():
    spawn_local(_worker, WORLD, 2, "checkpointed")


def test_ep_mutation_without_reverse_permutation_fails():
    spawn_local(_no_unpermute, WORLD, 4)


def test_ep_mutation_grads_reduced_over_ep_group_fails():
    spawn_local(_worker, WORLD, 2, "reduce_over_ep")


# -- the RL loop ---------------------------------------------------------------------------------------------------

def _rl_models():
    """The demo's char tokenizer, a tiny Qwen3-MoE policy over it (8 experts, top-2, layer 1 dense) and a warm
    EAGLE-3 draft, fp64, seeded (the same on every rank)."""
    import dataclasses
    from test_rl_cp import _models as dense_models
    from specco.runner.warmstart import new_draft
    tok, dense, _ = dense_models()
    pc = dataclasses.replace(dense.cfg, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                             moe_intermediate_size=16, norm_topk_prob=True, decoder_sparse_step=1,
                             mlp_only_layers=(1,), router_aux_loss_coef=0.05)
    torch.manual_seed(0)
    policy = Policy(pc)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    policy = policy.double()
    torch.manual_seed(1)
    draft = new_draft(policy, torch.randint(0, tok.vocab_size, (4, 8))).double()
    return tok, policy, draft


RL_EXTRA = ("rollout.prompts_per_step=4", "train.checkpoint_every=1", "train.ppo_epochs=2", "train.minibatches=2",
            "train.kl_coef=0.1")


def _whole(st) -> dict:
    """The arm's trained weights whole by name: the policy's experts gathered (a collective at ep > 1), the draft."""
    sd = full_expert_state(st.policy) if any(isinstance(m, EPExperts) for m in st.policy.modules()) \
        else st.policy.state_dict()
    out = {f"policy.{k}": v.detach().clone() for k, v in sd.items()}
    out.update({f"draft.{k}": v.detach().clone() for k, v in st.draft.state_dict().items()})
    return out


def _rl_worker(rank, world, tmp, cp=1):
    """Two RL steps of the co-trained EAGLE-3 arm on dp 2 (or cp 2; dp 4) at ep = world against the same run at
    ep 1 (same processes, same seeds): the same rollouts (step 2's from each run's refit engine), losses, aux
    loss, KL, grad norms (rel 1e-9: fp64 summation order), every weight after both steps (rtol 1e-9, atol 1e-12), each rank's engine
    holding the gathered whole policy, and a resume from the ep step-1 checkpoint (experts saved as global
    Shard(0) slices) equal to the straight run bit for bit, and at ep 1 equal to it (rtol 1e-9). At ep 2 over dp 2
    also: the plain baseline and frozen shadow hooks and on_nonfinite=skip leave the trajectory bit for bit."""
    from pathlib import Path
    from test_grpo import DigitTask
    from test_rl_cp import _cfg
    from specco.runner.rl import run_arm
    tmp = Path(tmp)
    tok, policy, draft = _rl_models()
    out = {}
    dp = world // cp
    for ep in (1, world):
        cfg = _cfg(tmp, f"parallel.dp={dp}", f"parallel.cp={cp}", f"parallel.ep={ep}", *RL_EXTRA,
                   f"rollout.prompts_per_step={2 * dp}")  # 2 GRPO groups per DP rank: minibatches=2
        mesh = Mesh.build(dp, cp, backend="gloo", ep=ep)
        st, rec = {}, []
        rows = run_arm(cfg, "cotrained", policy, draft, DigitTask(), tok, tmp / f"ep{ep}", progress=False, mesh=mesh,
                       state_out=st, record=rec)
        out[ep] = (rows, [ro.pairs for ro in rec], st["state"], cfg, mesh)
    (rows1, pairs1, st1, _, _), (rows2, pairs2, st2, cfg2, mesh2) = out[1], out[world]
    sparse = [i for i, layer in st1.policy.layers.items() if hasattr(layer.mlp, "experts")]
    assert sparse and all(isinstance(st2.policy.layers[i].mlp.experts, EPExperts) for i in sparse)
    assert st2.policy.layers["0"].mlp.experts.gate_up_proj.shape[0] == 8 // world  # 8 experts / ep
    assert pairs2 == pairs1
    for a, b in zip(rows2, rows1):
        for k in ("reward", "policy/loss", "policy/aux_loss", "policy/kl", "policy/grad_norm", "draft/loss",
                  "draft/grad_norm"):
            assert abs(a[k] - b[k]) <= 1e-9 * max(1.0, abs(b[k])), (k, a[k], b[k])
    w1, w2 = _whole(st1), _whole(st2)
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-9, atol=1e-12, msg=k)
    eng = st2.engine.policy.state_dict()  # the engine: the whole policy refit from the gathered experts
    for k, v in eng.items():
        assert torch.equal(v, w2[f"policy.{k}"]), k
    import json
    from specco.train.checkpoint import latest_checkpoint
    saved = json.loads((latest_checkpoint(tmp / f"ep{world}" / "ckpt") / "state.json").read_text())["tensors"]
    E = policy.cfg.num_experts  # the checkpoint holds whole experts (global shapes), their moments too
    assert saved["model.policy.layers.0.mlp.experts.gate_up_proj"]["shape"][0] == E
    assert saved["opt.state.policy.layers.0.mlp.experts.down_proj.exp_avg"]["shape"][0] == E
    run = lambda d, **kw: run_arm(cfg2, "cotrained", policy, draft, DigitTask(), tok, tmp / d,  # noqa: E731
                                  progress=False, mesh=mesh2, **kw)
    part1 = run("resume", stop_after=1)
    fin = {}
    part2 = run("resume", state_out=fin)
    for a, b in zip(rows2, part1 + part2):
        for k in ("reward", "policy/loss", "policy/aux_loss", "draft/loss", "policy/grad_norm"):
            assert a[k] == b[k], (k, a[k], b[k])
    w3 = _whole(fin["state"])
    assert all(torch.equal(w3[k], w2[k]) for k in w2)
    if world == 2 and cp == 1:
        # the measurements (the plain baseline reruns the updates from state copies of the EP policy, loaded back
        # through EPExperts' state-dict hooks) and on_nonfinite=skip leave the trajectory as it is
        runs = {}
        for name, hooks in (("with", ("plain_baseline=[cotrained]", "frozen_shadow=[cotrained]")), ("without", ())):
            cfg_m = _cfg(tmp, f"parallel.dp={dp}", f"parallel.ep={world}", *RL_EXTRA, "rollout.sampler=coupled",
                         "rollout.spec_control=on", "train.on_nonfinite=skip", *hooks)
            runs[name] = {}
            runs[name]["rows"] = run_arm(cfg_m, "cotrained", policy, draft, DigitTask(), tok, tmp / name,
                                         progress=False, mesh=mesh2, state_out=runs[name])
        assert "time/rollout_plain" in runs["with"]["rows"][0]
        assert [r["policy/loss"] for r in runs["with"]["rows"]] == [r["policy/loss"] for r in runs["without"]["rows"]]
        wa, wb = _whole(runs["with"]["state"]), _whole(runs["without"]["state"])
        assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # the ep step-1 checkpoint resumed at ep 1 (each expert tensor read whole from its saved slices): step 2
    # and the weights after it equal the straight ep run's (fp64 summation order)
    cfg1, mesh1 = out[1][3], out[1][4]
    fin1 = {}
    again = run_arm(cfg2, "cotrained", policy, draft, DigitTask(), tok, tmp / "resume_ep1_from", progress=False,
                    mesh=mesh2, stop_after=1)
    again += run_arm(cfg1, "cotrained", policy, draft, DigitTask(), tok, tmp / "resume_ep1_from", progress=False,
                     mesh=mesh1, state_out=fin1)
    assert [r["step"] for r in again] == [1, 2]
    for k in ("reward", "policy/loss", "policy/aux_loss", "draft/loss", "policy/grad_norm"):
        assert abs(again[1][k] - rows2[1][k]) <= 1e-9 * max(1.0, abs(rows2[1][k])), (k, again[1][k], rows2[1][k])
    w4 = _whole(fin1["state"])
    assert not any(isinstance(m, EPExperts) for m in fin1["state"].policy.modules())
    for k in w2:
        torch.testing.assert_close(w4[k], w2[k], rtol=1e-9, atol=1e-12, msg=k)


def test_rl_loop_ep2_equals_ep1(tmp_path):
    spawn_local(_rl_worker, 2, str(tmp_path))


def test_rl_loop_ep2_over_cp2_equals_ep1(tmp_path):
    """ep borrowed from the cp ranks (dp 1, cp 2): they hold other tokens of the same sequences, so dispatching
    them is the same all-to-all; the ring attention is untouched."""
    spawn_local(_rl_worker, 2, str(tmp_path), 2)


@pytest.mark.slow  # 4 processes
def test_rl_loop_ep4_equals_ep1(tmp_path):
    spawn_local(_rl_worker, 4, str(tmp_path))


# -- what is refused -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra, world, command, match", [
    (("parallel.dp=2", "parallel.tp=2"), 4, "train", r"parallel.ep=2 with parallel.tp=2: expert parallelism under tens"),
    (("parallel.dp=2", "parallel.ep=4"), 2, "train", r"parallel.ep=4 does not divide parallel.dp × parallel.cp = 2"),
    (("parallel.dp=2", "train.compile=aot_eager"), 2, "train", r"train.compile='aot_eager' with parallel.ep=2"),
    (("parallel.dp=2",), 2, "cotrain-cp", r"parallel.ep=2: expert parallelism runs in `specco train` only"),
    (("parallel.dp=2",), 2, "train", r"parallel.ep=2: policy.source='tiny' with policy.family='llama' is a dense model"),
])
def test_ep_layouts_not_wired_are_refused_by_name(tmp_path, extra, world, command, match):
    from test_rl_cp import _cfg
    from specco.model.config import ConfigError
    from specco.runner.derive import check_parallel
    cfg = _cfg(tmp_path, "parallel.ep=2", *extra)
    with pytest.raises(ConfigError, match=match):
        check_parallel(cfg, world, command)


def test_ep_against_the_policy_is_checked(tmp_path):
    """validate.check_moe_layout (check_job's policy check, before out_dir): ep on a dense policy, or one whose
    num_experts it does not divide; and the size itself (ParallelSpec)."""
    from test_rl_cp import _cfg
    from specco.config import ParallelSpec
    from specco.model.config import ConfigError
    from specco.runner.validate import check_moe_layout
    moe = PolicyConfig(**QWEN3_MOE)  # 8 experts
    dense = PolicyConfig(**{k: v for k, v in QWEN3_MOE.items() if k not in (
        "model_type", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
        "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef")})
    check_moe_layout(_cfg(tmp_path, "parallel.dp=4", "parallel.ep=4"), moe, "p/config.json")  # fits
    with pytest.raises(ConfigError, match=r"parallel.ep=3 does not divide the policy's num_experts=8"):
        check_moe_layout(_cfg(tmp_path, "parallel.dp=3", "parallel.ep=3"), moe, "p/config.json")
    with pytest.raises(ConfigError, match=r"parallel.ep=2: the policy \(p/config.json, model_type 'llama'\) has no"):
        check_moe_layout(_cfg(tmp_path, "parallel.dp=2", "parallel.ep=2"), dense, "p/config.json")
    with pytest.raises(ConfigError, match="parallel.ep=0: must be >= 1"):
        ParallelSpec(ep=0)



def _nonfinite_worker(rank, world):
    from specco.train.nonfinite import first_nonfinite_weight
    mesh = Mesh.build(dp=world, backend="gloo", ep=world)
    policy = apply_ep(_policy(), mesh.ep_group, mesh.ep_replica_group)
    assert first_nonfinite_weight(policy) is None
    if rank == 1:  # a NaN in rank 1's expert slice only: rank 0's own slices are finite
        slices = [m for m in policy.modules() if isinstance(m, EPExperts)]
        with torch.no_grad():
            slices[0].down_proj[0, 0, 0] = float("nan")
    name = first_nonfinite_weight(policy)
    assert name is not None and name.endswith("experts.down_proj"), name  # on both ranks: one verdict, no hang


def test_nonfinite_expert_slice_is_named_on_every_rank_of_the_ep_group():
    spawn_local(_nonfinite_worker, 2)


def _stream_worker(rank, world):
    """`expert_stream` (the refit's view) yields full_expert_state's entries, the same tensors in the same order,
    and gathers a sparse layer's experts only when the walk reaches them: none while the dense entries pass, two
    all-gathers (gate_up, down) per sparse layer, the earlier layers' whole tensors free to go."""
    from specco.parallel.ep import expert_stream
    mesh = Mesh.build(dp=world, backend="gloo", ep=world)
    policy = apply_ep(_policy(), mesh.ep_group, mesh.ep_replica_group)
    want = full_expert_state(policy)
    calls = []
    real = dist.all_gather
    ep_mod.dist.all_gather = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    try:
        seen, gathers_at = [], []
        for k, v in expert_stream(policy):
            seen.append((k, v))
            gathers_at.append(len(calls))
    finally:
        ep_mod.dist.all_gather = real
    assert [k for k, _ in seen] == list(want) and all(torch.equal(v, want[k]) for k, v in seen)
    first_expert = next(i for i, (k, _) in enumerate(seen) if ".experts." in k)
    assert gathers_at[first_expert - 1] == 0 and gathers_at[first_expert] == 2  # lazily, a layer at a time
    assert len(calls) == 2 * 2  # the two sparse layers (layer 1 is dense)


def test_expert_stream_gathers_a_layer_at_a_time():
    spawn_local(_stream_worker, 2)
