"""Tensor parallelism of the trainer (parallel/tp.py) on gloo == one process.

Co-training step. Reference: `cotrain_step` on one process over the whole batch, two optimizer steps (two batches),
the policy with FUSED qkv / gate-up projections as it trains at tp = 1. Under test: `Mesh.build(tp=2)`, `apply_tp`
(each projection unfused and column / row sharded, local head counts, the head's 61 vocabulary rows cut 31 + 30 with
its logits left cut: the log-probs loss-parallel), AdamW on the DTensors, `grad_syncs` (the all-reduce over the dp
ranks of one tp rank, or FSDP's reduce-scatter); also tp 2 × dp_shard 2 (TP then FSDP2: 2-D (fsdp, tp) DTensors), tp
2 × cp 2 (the sequences packed and zigzagged over the cp group, ring attention on the local heads), pp 2 × tp 2
(each stage cut, then TP'd; 1F1B and the TapChannel per tp rank), tp 2 with activation checkpointing, and tp 2 (×
dp_shard 2) sequence-parallel (the residual stream and norms cut along the sequence, the taps gathered whole). The
policy is Qwen2/3-flavoured (q/k norm AND qkv bias, non-unit norms) so that every placement is exercised: the
sharded bias rows, the q/k norms' replicated weights whose gradient is a sum over the ranks' heads. Compared after
each step: both losses, both grad norms, the draft's statistics, every clipped gradient; after the second step every
parameter — the TP tensors gathered with `full_tensor()` and the parts concatenated back into the fused layout the
reference holds — and the draft bit for bit equal on the tp ranks. Co-trained EAGLE-3 and DFlash.

Tolerance (fp64): rtol 1e-9, atol 1e-12, the DP / CP / FSDP tests' own: the same arithmetic in other summation
orders (a row-parallel matmul's two partial sums all-reduced vs one dot product; q/k/v as three GEMMs vs one; the
log-probs as per-rank partial max / sum-exp / target logit all-reduced vs one log_softmax, both in fp64 here since
token_logprobs computes in the logits' dtype when wider than fp32; the grad norm as a sum over kinds of tensor). A
wrong placement is O(1) off and a missing all-reduce is off by the other rank's share; both are far outside.
Measured: losses and grad norms within 4.6e-16 relative, gradients 7e-17 absolute, parameters after two steps
4.4e-15 absolute (1.7e-13 relative), every layout and kind.

bf16 (autocast over fp32 masters; with FSDP its mixed precision), against the single-process autocast step, with
tests/test_fsdp.py's derived bounds (losses and norms 2e-2 relative; parameters at most 4.01 lr, mean 0.05 lr).
Measured: tp 2 losses 1.6e-3, norms 1.8e-3, policy max 3.82 lr / mean 0.021 lr, draft 2.24 / 0.011 lr; tp 2 ×
dp_shard 2 losses 2.6e-3, norms 1.6e-3, policy 3.02 / 0.013 lr, draft 2.37 / 0.024 lr.

Mutations (test_tp_mutations_fail): the same comparison must FAIL for each of five broken recipes —
  fused_cut_naively   the fused qkv / gate-up weights column-sharded as one block each (rank 0 gets q and half
                      of k, ...): the wrong heads, the forward is wrong (losses 0.22 relative off);
  o_proj_no_reduce    o_proj's output left as the rank's partial sum (RowwiseParallel with a Partial output
                      used locally): the all-reduce after attention is missing (losses 3.9e-2, gradients 0.11 off);
  qk_norm_plain       q_norm / k_norm left plain tensors: each rank's gradient is its own heads' share, never
                      summed over tp (a missing gradient all-reduce; the forward is right at step 1: gradients
                      2.9e-4, parameters 3.7e-3 off);
  logprobs_no_reduce  the policy's vocabulary-parallel log-probs without their all-reduces: each rank's
                      softmax over its own vocabulary columns (the missing reduction of the loss; losses 5.7 off);
  sp_norms_plain      under sequence parallelism, the layers' RMSNorm weights left plain: each rank's gradient is
                      its own tokens' share (the same missing sum over the sequence instead of the heads; gradients
                      4.6e-4 off).

The RL loop at these layouts, and what is refused: tests/test_rl_tp.py.
"""
import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleOutput, RowwiseParallel,
                                               parallelize_module)

from specco.model.config import DraftConfig, PolicyConfig
from specco.model.dflash import BlockDraft, BlockDraftConfig
from specco.model.draft import Eagle3Draft, build_vocab_maps
from specco.model.policy import Policy
from specco.parallel.cp import shard_batch
from specco.parallel.fsdp import apply_fsdp
from specco.parallel.layout import ZigzagPack
from specco.parallel.mesh import Mesh, spawn_local
from specco.parallel.tp import apply_tp, layer_plan
from specco.parallel.zigzag import ZigzagLayout
from specco.train.activation_checkpointing import apply_activation_checkpointing
from specco.train.cotrain import StepConfig, TrainBatch
from cp_reference import pack_rows
from specco.train.grad_sync import grad_syncs
import test_fsdp as F

pytestmark = pytest.mark.dist

V, B = F.V, F.B
TOL = F.TOL
CFG = StepConfig(ttt_passes=3, loss_chunk=5, draft_row_stride=2, micro_batch_rows=4)


def _models(kind):
    """A Qwen-flavoured tiny policy (q/k norm, qkv bias, GQA 4:2) and a co-trained draft of `kind`, fp64."""
    torch.manual_seed(0)
    pc = PolicyConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=4,
                      num_kv_heads=2, qk_norm=True, attention_bias=True)
    policy = Policy(pc).double()
    with torch.no_grad():  # non-trivial norms and biases, so a misplaced one shows
        for n, p in policy.named_parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    if kind == "eagle3":
        draft = Eagle3Draft(DraftConfig.for_policy(pc, 40, aux_layer_ids=(0, 2, 3)))
        draft.set_vocab_maps(*build_vocab_maps(torch.rand(V), 40))
    else:
        draft = BlockDraft(BlockDraftConfig.for_policy(pc, kind, gamma=3, mask_id=V - 1, num_layers=2, num_anchors=6,
                                                       aux_layer_ids=(0, 2, 3)))
    with torch.no_grad():  # far-from-uniform draft attention so that errors would show
        for p in draft.parameters():
            if p.dim() == 2:
                p.mul_(6.0)
    return policy, draft.double()


_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _fused(named: dict) -> dict:
    """A tensor-parallel model's whole tensors by name, with the unfused parts concatenated back into the fused
    names the reference (tp = 1) model holds (rows [q | k | v], [gate | up])."""
    out = dict(named)
    for n in list(named):
        for fused, parts in _PARTS.items():
            stem, _, suffix = n.rpartition(".")  # policy.layers.0.self_attn.q_proj, weight
            mod, _, leaf = stem.rpartition(".")
            if leaf == parts[0]:
                keys = [f"{mod}.{p}.{suffix}" for p in parts]
                out[f"{mod}.{fused}.{suffix}"] = torch.cat([out.pop(k) for k in keys])
    return out


def _mutate(policy, mesh, mutation):
    """A broken tensor-parallel recipe (module docstring), applied in place of apply_tp."""
    if mutation == "fused_cut_naively":
        for layer in policy.layers.values():
            layer.self_attn.num_heads, layer.self_attn.num_kv_heads = 2, 1
            layer.mlp.inter = 24
            parallelize_module(layer, mesh, {"self_attn.qkv_proj": ColwiseParallel(),
                                             "self_attn.o_proj": RowwiseParallel(),
                                             "mlp.gate_up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()})
        return
    plan = layer_plan(qk_norm=True)
    if mutation == "o_proj_no_reduce":  # the same weight shards, the output left as this rank's partial sum
        plan["self_attn.o_proj"] = RowwiseParallel(output_layouts=Partial())
    elif mutation == "qk_norm_plain":
        del plan["self_attn.q_norm"], plan["self_attn.k_norm"]
    elif mutation == "logprobs_no_reduce":  # the loss-parallel log-probs without their all-reduces (each rank's
        # softmax over its own columns only)
        import specco.parallel.tp as tp_module
        tp_module._all_reduce = lambda x, op, group: x
    elif mutation == "sp_norms_plain":  # sequence parallel, its norms' weights left plain: partial gradients
        plan = layer_plan(qk_norm=True, sequence_parallel=True)
        plan["input_layernorm"] = plan["post_attention_layernorm"] = PrepareModuleOutput(
            output_layouts=Shard(1), desired_output_layouts=Shard(1), use_local_output=True)  # a no-op in its place
    else:
        raise ValueError(mutation)
    apply_tp(policy, mesh, sequence_parallel=mutation == "sp_norms_plain", plan=plan)


def _steps(policy, draft, batches, cfg=CFG, **kw):
    """Two steps (test_fsdp._two_steps), with the whole tensors in the fused layout."""
    hist, params = F._two_steps(policy, draft, batches, cfg, **kw)
    return [(m, _fused(g)) for m, g in hist], _fused(params)


def _cotrain_worker(rank, world, kind, dp_shard, mutation, cp=1, ac=False, sp=False):
    dp = world // (2 * cp)
    mesh = Mesh.build(dp=dp, cp=cp, dp_shard=dp_shard or 1, tp=2, backend="gloo")
    assert mesh.tp_rank == rank % 2 and mesh.dp_rank == rank // (2 * cp)  # tp innermost
    x = torch.tensor([float(rank)])
    dist.all_reduce(x, group=mesh.grad_group)  # the dp × cp ranks of MY tp rank: rank % 2 + 2k
    assert x.item() == sum(r for r in range(world) if r % 2 == rank % 2), x
    # sequence parallel: every micro-batch's width a multiple of tp (derive.step_config), in the reference too
    cfg = dataclasses.replace(CFG, width_multiple=2) if sp else CFG
    if cp == 1:  # rows split over dp
        full = [F._dp_batch(7), F._dp_batch(8)]
        ref_hist, ref_params = _steps(*_models(kind), [(b, {}) for b in full], cfg)
        h = B // dp
        local = [(b.rows(mesh.dp_rank * h, (mesh.dp_rank + 1) * h), {}) for b in full]
    else:  # the dp rank's sequences packed into one row, zigzagged over its cp group (test_fsdp's cp layout)
        cfg = StepConfig(ttt_passes=3, loss_chunk=5, draft_row_stride=1)
        full = [F._cp_batch(7), F._cp_batch(8)]
        ref_hist, ref_params = _steps(*_models(kind), [(b, {}) for b in full], cfg)
        n = len(F.LENS) // dp
        mine = slice(mesh.dp_rank * n, (mesh.dp_rank + 1) * n)
        local = []
        for b in full:
            sub = TrainBatch(tokens=b.tokens[mine], target_mask=b.target_mask[mine], advantages=b.advantages[mine],
                             logp_old=b.logp_old[mine])
            packed, cu = pack_rows(sub, F.LENS[mine])
            lay = ZigzagLayout(cu, cp, mesh.cp_rank)
            local.append((shard_batch(packed, lay), {"layout": ZigzagPack(mesh.cp_group, lay)}))
    policy, draft = _models(kind)
    if mutation:
        _mutate(policy, mesh.tp_mesh, mutation)
    else:
        apply_tp(policy, mesh.tp_mesh, sequence_parallel=sp)
        attn = policy.layers["0"].self_attn
        assert attn.qkv_proj is None and (attn.num_heads, attn.num_kv_heads) == (2, 1)
        assert attn.q_proj.weight.to_local().shape == (2 * 8, 32)  # 2 local heads of 8
        assert attn.o_proj.weight.to_local().shape == (32, 2 * 8)
        assert policy.lm_head.weight.to_local().shape == ((31, 32) if mesh.tp_rank == 0 else (30, 32))  # V = 61 rows
        with torch.no_grad():
            out = policy(full[0].tokens[:2], tap_layers=(0, 2, 3))
        S = full[0].tokens.shape[1]
        (cut,) = out.logits.placements  # the logits are never gathered whole: cut along the vocabulary
        assert isinstance(out.logits, DTensor) and cut.is_shard() and cut.dim in (-1, 2), cut
        assert out.logits.shape == (2, S, V) and out.logits.to_local().shape[-1] == (31, 30)[mesh.tp_rank]
        assert out.taps.aux.shape[1] == out.taps.embed.shape[1] == S  # the taps come out whole ...
        assert out.hidden.shape[1] == (S // 2 if sp else S)  # ... the residual stream is this rank's half under SP
    if ac:  # torchtitan's order: TP, activation checkpointing, FSDP
        apply_activation_checkpointing(policy)
    if dp_shard:
        apply_fsdp(policy, mesh.fsdp_mesh)
        if not mutation:
            assert policy.layers["0"].self_attn.q_proj.weight.device_mesh.ndim == 2  # (fsdp, tp)
    hist, params = _steps(policy, draft, local, cfg, grad_group=mesh.grad_group,
                          grad_sync=grad_syncs(policy, mesh.grad_group))
    assert not any(isinstance(p, DTensor) for p in draft.parameters())  # the draft is whole on every rank ...
    # ... and the same bits on every tp rank: its inputs (taps, teacher logits, the head's rows) are replicated,
    # so it needs no all-reduce over tp (one would double its gradient)
    mine = torch.cat([p.detach().flatten() for p in draft.parameters()])
    both = [torch.empty_like(mine) for _ in range(2)]
    dist.all_gather(both, mine, group=mesh.tp_group)
    draft_same = torch.equal(both[0], both[1])  # asserted below (a broken recipe breaks it too)
    dev = F._deviations(hist, params, ref_hist, ref_params, mesh.grad_group)  # collective: before any assert
    if rank == 0:
        print(f"tp 2 dp_shard {dp_shard} cp {cp} {'ac ' if ac else ''}{'sp ' if sp else ''}{kind} {mutation or ''} "
              "max deviations:",
              {k: f"{v:.2e}" for k, v in dev.items()})
    if mutation:  # the comparison must catch it: some deviation far outside the tolerance
        assert max(dev["loss_rel"], dev["norm_rel"], dev["grad_abs"], dev["param_abs"]) > 1e3 * TOL["rtol"], dev
        return
    for (m, g), (m_ref, g_ref) in zip(hist, ref_hist):
        for key in m_ref:  # global metrics: grad norms, the draft's statistics, LRs (losses: in dev, summed)
            if key.startswith(("draft/", "policy/grad_norm")) and key != "draft/loss":
                assert abs(m[key] - m_ref[key]) <= TOL["rtol"] * max(1.0, abs(m_ref[key])), (key, m[key], m_ref[key])
        assert g.keys() == g_ref.keys()
        for n in g_ref:
            torch.testing.assert_close(g[n], g_ref[n], **TOL, msg=lambda s: f"grad {n}: {s}")
    assert params.keys() == ref_params.keys()
    for n in ref_params:
        torch.testing.assert_close(params[n], ref_params[n], **TOL, msg=lambda s: f"param {n}: {s}")
    assert dev["loss_rel"] <= TOL["rtol"], dev
    assert draft_same


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_tp2_cotrain_equals_single_process(kind):
    spawn_local(_cotrain_worker, 2, kind, 0, None)


# 4 processes: ~8 s (EAGLE-3) / ~5 s (DFlash) here on 2 shared cores; DFlash in the slow lane
@pytest.mark.parametrize("kind", ["eagle3", pytest.param("dflash", marks=pytest.mark.slow)])
def test_tp2_dp_shard2_cotrain_equals_single_process(kind):
    spawn_local(_cotrain_worker, 4, kind, 2, None)


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_tp2_sequence_parallel_cotrain_equals_single_process(kind):
    spawn_local(_cotrain_worker, 2, kind, 0, None, 1, False, True)


@pytest.mark.slow  # 4 processes
def test_tp2_sequence_parallel_dp_shard2_cotrain_equals_single_process():
    spawn_local(_cotrain_worker, 4, "eagle3", 2, None, 1, False, True)


def test_tp2_activation_checkpointing_cotrain_equals_single_process():
    spawn_local(_cotrain_worker, 2, "eagle3", 0, None, 1, True)


@pytest.mark.parametrize("kind", ["eagle3", pytest.param("dflash", marks=pytest.mark.slow)])
def test_tp2_cp2_cotrain_equals_single_process(kind):
    spawn_local(_cotrain_worker, 4, kind, 0, None, 2)


def _pp_worker(rank, world, kind):
    """pp 2 × tp 2: each stage cut, then tensor-parallel over its 2 tp ranks; 1F1B over the stages (each tp rank
    of a stage exchanging its replicated activations with the same tp rank of the next), the draft replicated on
    the last stage fed by the TapChannel (one channel per tp rank); against the unsplit single-process step."""
    from specco.parallel.pipeline import PipeComm, split_stage, stage_layer_ranges
    from specco.parallel.taps import TapChannel, TapSpec
    from specco.train.cotrain import build_optimizer, cotrain_step
    pp = 2
    mesh = Mesh.build(pp=pp, tp=2, backend="gloo")
    s, last = mesh.pp_rank, mesh.pp_rank == pp - 1
    assert (s, mesh.tp_rank) == divmod(rank, 2)
    policy, draft = _models(kind)
    full = [F._dp_batch(7), F._dp_batch(8)]
    ref_hist, ref_params = _steps(*_models(kind), [(b, {}) for b in full])
    stage = apply_tp(split_stage(policy, pp, s), mesh.tp_mesh)
    d = draft if last else None
    opt = build_optimizer(stage, d, F.LR, F.DRAFT_LR)
    aux = draft.cfg.aux_layer_ids
    spec = TapSpec.for_stages(stage_layer_ranges(policy.cfg.num_layers, pp), aux, policy.cfg.hidden_size,
                              torch.float64, CFG.micro_batch_rows * full[0].tokens.shape[1])
    ch = TapChannel(spec, mesh.tap_group, slots=pp + 1, timeout_s=60)
    named = [(f"policy.{n}", p) for n, p in stage.named_parameters()] + \
        ([(f"draft.{n}", p) for n, p in d.named_parameters()] if last else [])
    for step, (batch, (m_ref, g_ref)) in enumerate(zip(full, ref_hist), start=1):
        m = cotrain_step(stage, d, batch, opt, None, CFG, pipe=PipeComm(mesh.pp_group), taps=ch, tap_layers=aux,
                         step=step, grad_group=mesh.grad_group, grad_sync=grad_syncs(stage, mesh.grad_group))
        losses = torch.tensor([m["policy/loss"], m["draft/loss"]], dtype=torch.float64)
        dist.all_reduce(losses, group=mesh.grad_group)  # a group of one here: each stage's own share
        ref = torch.tensor([m_ref["policy/loss"], m_ref["draft/loss"]], dtype=torch.float64)
        assert ((losses - ref).abs() <= TOL["rtol"] * ref.abs()).all(), (losses, ref)
        for k in ("policy/grad_norm", "draft/grad_norm"):  # the policy's over both stages' shards
            assert abs(m[k] - m_ref[k]) <= TOL["rtol"] * m_ref[k], (k, m[k], m_ref[k])
        grads = _fused({n: F._full(p.grad) for n, p in named if p.grad is not None})
        for n, g in grads.items():
            torch.testing.assert_close(g, g_ref[n], **TOL, msg=lambda e: f"stage {s} grad {n}: {e}")
    for n, p in _fused({n: F._full(p.detach()) for n, p in named}).items():
        torch.testing.assert_close(p, ref_params[n], **TOL, msg=lambda e: f"stage {s} {n}: {e}")


def test_pp2_tp2_cotrain_equals_single_process():
    spawn_local(_pp_worker, 4, "eagle3")


def _bf16_worker(rank, world, kind, dp_shard):
    """bf16 autocast over fp32 masters (and under FSDP its bf16 gathers, fp32 reductions: trainer.make_arm's mixed
    precision) at tp 2 against the single-process autocast step; tolerances derived in tests/test_fsdp.py.

    With FSDP the models are test_fsdp's (unit norms, no biases, no q/k norm): FSDP's mixed precision casts norm
    weights and biases to bf16 too, which autocast does not, and on this file's models (non-unit norms, q/k norms,
    qkv bias) that alone — FSDP at dp_shard 2 without TP, measured — moves the losses by 1.8e-2 and the policy's
    weights by 0.10 lr on average, past test_fsdp's bound of 0.05 lr that its models meet; tp 2 × dp_shard 2 on
    these models measured the same (1.8e-2, 0.099 lr): the gap is FSDP's casting, not TP."""
    import dataclasses

    from specco.parallel.fsdp import mixed_precision
    dp = world // 2
    mesh = Mesh.build(dp=dp, dp_shard=dp_shard or 1, tp=2, backend="gloo")
    cfg = dataclasses.replace(CFG, amp_dtype=torch.bfloat16)
    full = [F._dp_batch(7, torch.float32), F._dp_batch(8, torch.float32)]
    models = (lambda: F._models(kind, torch.float32)) if dp_shard else (lambda: (m.float() for m in _models(kind)))
    ref_hist, ref_params = _steps(*models(), [(b, {}) for b in full], cfg)
    h = B // dp
    local = [(b.rows(mesh.dp_rank * h, (mesh.dp_rank + 1) * h), {}) for b in full]
    policy, draft = models()
    apply_tp(policy, mesh.tp_mesh)
    if dp_shard:
        apply_fsdp(policy, mesh.fsdp_mesh, mp_policy=mixed_precision(torch.bfloat16))
    hist, params = _steps(policy, draft, local, cfg, grad_group=mesh.grad_group,
                          grad_sync=grad_syncs(policy, mesh.grad_group))
    assert all(p.dtype == torch.float32 for p in params.values())  # fp32 master weights
    dev = F._deviations(hist, params, ref_hist, ref_params, mesh.grad_group)
    if rank == 0:
        print(f"tp 2 dp_shard {dp_shard} bf16 {kind} max deviations:", {k: f"{v:.2e}" for k, v in dev.items()})
    assert dev["loss_rel"] <= 2e-2 and dev["norm_rel"] <= 2e-2, dev
    for group, lr in (("policy.", F.LR), ("draft.", F.DRAFT_LR)):
        d = torch.cat([(params[n] - ref_params[n]).abs().flatten() for n in params if n.startswith(group)])
        if rank == 0:
            print(f"bf16 {group} params: max {d.max().item() / lr:.2f} lr, mean {d.mean().item() / lr:.4f} lr")
        assert d.max() <= 4.01 * lr and d.mean() <= 0.05 * lr, (group, d.max().item(), d.mean().item())


@pytest.mark.parametrize("dp_shard", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_tp2_bf16_tracks_single_process_autocast(dp_shard):
    spawn_local(_bf16_worker, 2 + 2 * bool(dp_shard), "eagle3", dp_shard)


@pytest.mark.parametrize("mutation", ["fused_cut_naively", "o_proj_no_reduce", "qk_norm_plain", "logprobs_no_reduce",
                                      "sp_norms_plain"])
def test_tp_mutations_fail(mutation):
    spawn_local(_cotrain_worker, 2, "eagle3", 0, mutation, 1, False, mutation == "sp_norms_plain")


def test_layer_plan_covers_every_projection():
    """The plan names every projection of an unfused layer, q/k norms only for a q/k-norm policy."""
    plan = layer_plan(qk_norm=True)
    assert {k.split(".")[-1] for k in plan} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                "down_proj", "q_norm", "k_norm"}
    assert "self_attn.q_norm" not in layer_plan(qk_norm=False)


def _tied_worker(rank, world):
    """A head tied to the embedding stays replicated with it (apply_tp); the forward equals one process's, with
    sequence parallelism too (the tied head's input gathered, the taps whole)."""
    import copy
    import dataclasses
    mesh = Mesh.build(tp=2, backend="gloo")
    torch.manual_seed(0)
    pc = dataclasses.replace(_models("eagle3")[0].cfg, tie_word_embeddings=True)
    ref = Policy(pc).double()
    policy = apply_tp(copy.deepcopy(ref), mesh.tp_mesh)
    assert policy.lm_head.weight is policy.embed_tokens.weight and not isinstance(policy.lm_head.weight, DTensor)
    ids = torch.randint(0, V, (2, 10))
    want = ref(ids, tap_layers=(0, 2))
    torch.testing.assert_close(policy(ids).logits, want.logits, rtol=1e-12, atol=1e-14)
    sp = apply_tp(copy.deepcopy(ref), mesh.tp_mesh, sequence_parallel=True)  # its input gathered along the sequence
    got = sp(ids, tap_layers=(0, 2))
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got.taps.aux, want.taps.aux, rtol=1e-12, atol=1e-14)  # gathered whole


def test_tp2_tied_head_stays_replicated():
    spawn_local(_tied_worker, 2)


def _logprobs_worker(rank, world):
    """The loss-parallel log-probs over an uneven vocabulary cut (13 ids: 7 + 6), a chunk of positions at a time or all
    at once: values and gradients equal train/losses.token_logprobs on the whole logits (fp64, 1e-12: the same math,
    reduced over ranks)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from specco.parallel.tp import vocab_parallel_logprobs
    from specco.train.losses import token_logprobs
    mesh = Mesh.build(tp=2, backend="gloo")
    g = torch.Generator().manual_seed(0)
    B, S, Vt = 3, 5, 13
    full = torch.randn(B, S, Vt, generator=g, dtype=torch.float64) * 3
    tokens = torch.randint(0, Vt, (B, S), generator=g)
    w = torch.randn(B, S, generator=g, dtype=torch.float64)
    ref_in = full.clone().requires_grad_()
    ref = token_logprobs(ref_in, tokens, 0.7)
    (ref * w).sum().backward()
    for chunk in (7, 2 * 7, 10 ** 6):  # one position per chunk, two, all
        cut = distribute_tensor(full, mesh.tp_mesh, [Shard(2)]).requires_grad_()
        lp = vocab_parallel_logprobs(cut, tokens, 0.7, chunk)
        torch.testing.assert_close(lp, ref, rtol=1e-12, atol=1e-12)
        (lp * w).sum().backward()
        torch.testing.assert_close(cut.grad.full_tensor(), ref_in.grad, rtol=1e-12, atol=1e-12)


def test_tp2_vocab_parallel_logprobs_in_chunks():
    spawn_local(_logprobs_worker, 2)


def test_unfuse_linears_is_the_same_function_and_state_dict():
    """layers.unfuse_linears (what apply_tp starts with) on one process: the same forward in fp64, the same
    state-dict keys and tensors (HF's parts), loadable both ways."""
    from specco.model.layers import unfuse_linears
    fused, _ = _models("eagle3")
    split, _ = _models("eagle3")
    for layer in split.layers.values():
        unfuse_linears(layer.self_attn, "qkv_proj")
        unfuse_linears(layer.mlp, "gate_up_proj")
    ids = torch.randint(0, V, (2, 9))
    torch.testing.assert_close(split(ids).logits, fused(ids).logits, rtol=1e-12, atol=1e-14)
    a, b = fused.state_dict(), split.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "layers.0.self_attn.q_proj.weight" in b and "layers.0.mlp.up_proj.weight" in b
    split.load_state_dict(a)  # HF parts into the unfused model (no concatenation: the hook stands aside)
    fused.load_state_dict(b)  # and back into the fused one
