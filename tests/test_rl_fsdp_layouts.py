"""FSDP composed with context and pipeline parallelism inside the RL loop, and bf16 under PP, on gloo.

Each distributed run is compared with one process on the same rollouts (the replay of tests/test_rl_fsdp.py:
every rank records its rollouts, rank 0 trains on their union with `train_on_rollouts`): the demo config's
models, two RL steps of PPO (2 epochs x 2 minibatches: the log-prob recompute runs in the layout) with a KL
penalty, then per-step losses, grad norms and PPO statistics and every parameter after both steps.

* dp_shard 2 x cp 2 (4 processes), co-trained EAGLE-3 and DFlash: the FSDP axis is the stage's dp_shard x cp
  ranks (each holds a quarter of every policy tensor), minibatches packed and zigzag-sharded over the CP pair.
  With activation checkpointing (applied before FSDP; the layouts below too): recomputation changes no number.
* pp 2 x dp_shard 2 (4 processes; x cp 2 on 8 in the slow lane), EAGLE-3 (the pipeline co-trains EAGLE-3 only):
  each stage sharded over its ranks after the cut; the refit gathers each stage's shards, then the stages, so
  every rank's engine holds the trainer's whole policy; a run stopped after one step and resumed from its
  checkpoint (whole tensors, as before FSDP) equals the uninterrupted one bit for bit.
  Tolerance (fp64): as tests/test_rl_fsdp.py, rtol 1e-9, parameters atol 1e-10 (policy/loss and the ratio / KL
  statistics 1e-6: fp32 log-probs by design). Seen: grad norms 1.1e-16 relative, parameters 2e-14 to 6e-14.
* bf16 under PP (train.amp=bf16: autocast over fp32 masters, the runner's path at pp > 1). The step: one
  pp 2 bf16 step equals the unsplit bf16 step on the same micro-batches, losses and grad norms within 1e-6
  relative and every clipped gradient within rtol 1e-5: the stages run the same autocast ops on the same values
  (the residual stream, hence what crosses the wire, stays fp32 under autocast), so only the clip norm's
  summation order (per-stage squares summed in fp64) may differ. Seen: gradients bit for bit.
  The RL loop, pp 2 vs one process, both bf16, PPO 2 x 2 with KL: 8 AdamW updates. At one update per step the
  runs agree bit for bit (seen; grad norms 6e-8: the clip norm's order); with several, the clip coefficient's
  last-bit difference reaches the weights through AdamW's eps, and bf16 autocast turns a last-bit fp32
  difference into a whole bf16 rounding step (2^-8) wherever a value straddles a rounding boundary. Losses,
  grad norms, ratio and KL within 1e-2 relative (absolute below 0.01), about two bf16 roundings. Parameters: a
  gradient component within rounding of zero may take the other sign in AdamW's update; each update moves a
  weight by at most 1.0074 lr for β = (0.9, 0.95) within 8 steps (Cauchy-Schwarz on m̂ / √v̂), so the max
  deviation is bounded by 2.01 lr per update, a hard bound; the MEAN must stay below 0.05 lr (flips are rare).
  Seen: losses 1.6e-3, grad norms 2.7e-4 relative; parameters max 1.9 lr (policy) / 0.36 lr (draft), mean
  0.0055 / 0.0088 lr.
  pp 2 x dp_shard 2 bf16: FSDP's bf16 mixed precision, so the stages exchange bf16 activations and
  taps (make_arm sets the pipeline's act_dtype), against the single-process autocast step: other roundings
  (FSDP computes with bf16 weights, norms and head too), so one update per step and test_fsdp.py's bf16 bounds:
  2e-2 relative, parameters max 4.01 lr (bound above) and mean 0.05 lr. Seen: losses 2.8e-4, grad norms 1.5e-3;
  parameters max 3.1 / 3.9 lr, mean 0.019 lr.

Mutations that fail these tests (checked): FSDP's gradient divide factor left at its default (averaging over the
dp_shard x cp ranks instead of summing) fails the dp_shard x cp and pp x dp_shard runs; autocast switched off in
the pipeline step's forward fails the pp 2 bf16 step and run (not the FSDP one, whose weights are bf16 anyway).
"""
from pathlib import Path

import pytest
import torch

from specco.parallel.mesh import Mesh, spawn_local
from test_rl_cp import _cfg, _models, union_rollouts
from test_rl_fsdp import EXTRA, _flat, _replay, _resumes_exactly

pytestmark = pytest.mark.dist


def _fsdp_cp_worker(rank, world, tmp, arm):
    from test_grpo import DigitTask
    from torch.distributed.tensor import DTensor
    from specco.runner.rl import run_arm
    from specco.runner.warmstart import new_block_draft
    tmp = Path(tmp)
    tok, policy, draft = _models()
    if arm == "cotrained-dflash":
        torch.manual_seed(1)
        draft = new_block_draft(policy, torch.randint(0, tok.vocab_size, (4, 8)), "dflash", gamma=2).double()
    # activation checkpointing (then FSDP): the recomputation runs under FSDP's gathers, and changes no number
    cfg = _cfg(tmp, "parallel.dp_shard=2", "parallel.cp=2", "train.activation_checkpointing=true", *EXTRA)
    mesh = Mesh.build(2, 2, dp_shard=2)
    st, rec = {}, []
    rows = run_arm(cfg, arm, policy, draft, DigitTask(), tok, tmp / "a", progress=False, mesh=mesh, state_out=st,
                   record=rec)
    s = st["state"]
    # the FSDP axis is the stage's dp_shard x cp ranks: each rank holds a quarter of every sharded tensor
    p = next(s.policy.parameters())
    assert isinstance(p, DTensor) and p.device_mesh.size() == 4
    assert all("forward" in layer.__dict__ for layer in s.policy.layers.values())  # checkpointed (AC's own forward)
    _replay(rank, mesh, EXTRA, arm, policy, draft, tok, tmp, rows, rec, _flat(s))


@pytest.mark.parametrize("arm", ["cotrained", "cotrained-dflash"])
def test_rl_loop_dp_shard2_cp2_equals_single_process(tmp_path, arm):
    spawn_local(_fsdp_cp_worker, 4, str(tmp_path), arm)


def _whole(st):
    """Every trained weight of a pipeline arm, whole: its engine's copy, refit after the last step from the
    gathered stages (each stage's shards gathered first), and the draft the last stage trained."""
    return torch.cat([v.detach().flatten() for v in st.engine.policy.state_dict().values()]
                     + [p.detach().flatten() for p in st.engine.draft.parameters()])


def _pp_fsdp_worker(rank, world, tmp, cp):
    """pp 2 x dp_shard 2 (x cp): each stage sharded over its dp_shard x cp ranks; replayed on one process, and a
    run stopped after one step and resumed from its checkpoint (whole tensors: the stages' shards and AdamW moments
    gathered, sharded again on resume) equals the uninterrupted one bit for bit."""
    from test_grpo import DigitTask
    from torch.distributed.tensor import DTensor
    from specco.runner.rl import run_arm
    tmp = Path(tmp)
    tok, policy, draft = _models()
    # activation checkpointing on the stage before FSDP (torchtitan's order): recomputation changes no number
    cfg = _cfg(tmp, "parallel.pp=2", "parallel.dp_shard=2", f"parallel.cp={cp}", "train.activation_checkpointing=true",
               *EXTRA)
    mesh = Mesh.build(2, cp, pp=2, dp_shard=2)
    run = lambda d, **kw: run_arm(cfg, "cotrained", policy, draft, DigitTask(), tok, tmp / d,  # noqa: E731
                                  progress=False, mesh=mesh, **kw)
    st, rec = {}, []
    rows = run("a", state_out=st, record=rec)
    s = st["state"]
    p = next(s.policy.parameters())
    assert isinstance(p, DTensor) and p.device_mesh.size() == 2 * cp  # the stage's dp_shard x cp ranks
    assert all("forward" in layer.__dict__ for layer in s.policy.layers.values())  # checkpointed (AC's own forward)
    assert (s.draft is not None) == (mesh.pp_rank == 1)  # the draft trains, whole, on the last stage
    flat = _whole(s)
    # the engine's whole policy is the trainer's: its stage's part equals the stage's gathered shards
    from specco.runner.trainer import full_state
    eng = s.engine.policy.state_dict()
    for k, v in full_state(s.policy).items():
        assert torch.equal(eng[k], v), k
    _resumes_exactly(run, rows, flat, _whole, rank)
    _replay(rank, mesh, EXTRA, "cotrained", policy, draft, tok, tmp, rows, rec, flat)


def test_rl_loop_pp2_dp_shard2_equals_single_process_and_resumes(tmp_path):
    spawn_local(_pp_fsdp_worker, 4, str(tmp_path), 1)


@pytest.mark.slow  # 8 processes: 31-47 s on 2 busy cores
def test_rl_loop_pp2_cp2_dp_shard2_equals_single_process_and_resumes(tmp_path):
    spawn_local(_pp_fsdp_worker, 8, str(tmp_path), 2)


def _pp_bf16_worker(rank, world, tmp, shard):
    """pp 2 (x dp_shard `shard`), train.amp=bf16 over fp32 masters, two RL steps replayed on one process at
    amp=bf16 (module docstring: tolerances)."""
    import torch.distributed as dist
    from test_grpo import DigitTask
    from specco.runner.derive import generate_config
    from specco.runner.rl import run_arm
    from specco.runner.trainer import make_arm, train_on_rollouts
    tmp = Path(tmp)
    tok, policy, draft = _models()
    policy, draft = policy.float(), draft.float()
    # under FSDP one update per step: its bf16 weights make other roundings than autocast's (module docstring)
    extra = (*EXTRA, "train.amp=bf16") + (("train.ppo_epochs=1", "train.minibatches=1") if shard > 1 else ())
    fsdp = (f"parallel.dp_shard={shard}",) if shard > 1 else ()
    mesh = Mesh.build(shard, pp=2, dp_shard=shard)
    st, rec = {}, []
    rows = run_arm(_cfg(tmp, "parallel.pp=2", *fsdp, *extra), "cotrained", policy, draft, DigitTask(), tok,
                   tmp / "p", progress=False, mesh=mesh, state_out=st, record=rec)
    if shard > 1:  # bf16 weights under FSDP's mixed precision: the stages exchange bf16 activations and taps
        assert st["state"].pipeline.act_dtype == torch.bfloat16
    flat = _whole(st["state"])
    groups = [None] * mesh.dp
    dist.all_gather_object(groups, rec, group=mesh.dp_group)  # every DP rank's rollouts, in DP order
    if rank != 0:
        return
    cfg1 = _cfg(tmp, *extra)
    ref = make_arm(cfg1, "cotrained", policy, draft, generate_config(cfg1, tok.eos_id, tok.pad_id))
    dev = {}
    for step, r in enumerate(rows):
        ro = union_rollouts([g[step] for g in groups])
        q = train_on_rollouts(ref, cfg1, ro, tok.pad_id, "cpu")
        for k in ("policy/loss", "draft/loss", "policy/grad_norm", "draft/grad_norm", "policy/ratio_mean",
                  "policy/kl"):  # relative; absolute below 0.01 (a policy loss can be near zero)
            dev[k] = max(dev.get(k, 0.0), abs(r[k] - q[k]) / max(1e-2, abs(q[k])))
    print(f"pp 2 x dp_shard {shard} bf16: relative deviations {dev}", flush=True)
    rtol = 1e-2 if shard == 1 else 2e-2
    assert all(v <= rtol for v in dev.values()), dev
    n_policy = sum(v.numel() for v in ref.policy.state_dict().values())
    ref_flat = torch.cat([v.detach().flatten() for v in ref.policy.state_dict().values()]
                         + [p.detach().flatten() for p in ref.draft.parameters()])
    updates = cfg1.train.steps * cfg1.train.ppo_epochs * cfg1.train.minibatches
    for name, d, lr in (("policy", (flat - ref_flat)[:n_policy].abs(), cfg1.train.lr),
                        ("draft", (flat - ref_flat)[n_policy:].abs(), cfg1.train.draft_lr)):
        print(f"pp 2 x dp_shard {shard} bf16 {name} parameters: max {d.max().item() / lr:.3f} lr, mean "
              f"{d.mean().item() / lr:.5f} lr", flush=True)
        assert d.max() <= 2.01 * updates * lr and d.mean() <= 0.05 * lr, (name, d.max().item(), d.mean().item())


def test_rl_loop_pp2_bf16_tracks_single_process_bf16(tmp_path):
    spawn_local(_pp_bf16_worker, 2, str(tmp_path), 1)


def test_rl_loop_pp2_dp_shard2_bf16_tracks_single_process_bf16(tmp_path):
    spawn_local(_pp_bf16_worker, 4, str(tmp_path), 2)


def _pp_bf16_step_worker(rank, world):
    """One bf16-autocast step of pp 2 (fp32 masters, no FSDP) against the unsplit autocast step on the same
    micro-batches (test_pp_cotrain's models and batch)."""
    import copy
    import dataclasses
    import torch.distributed as dist
    from specco.parallel.pipeline import PipeComm, split_stage, stage_layer_ranges
    from specco.parallel.taps import TapChannel, TapSpec
    from specco.train.cotrain import build_optimizer, cotrain_step
    from test_pp_cotrain import CFG, S as PS, _batch, _models as pp_models
    cfg = dataclasses.replace(CFG, amp_dtype=torch.bfloat16)
    policy, draft = (m.float() for m in pp_models())
    b = _batch()
    batch = dataclasses.replace(b, target_mask=b.target_mask.float(), advantages=b.advantages.float(),
                                logp_old=b.logp_old.float())
    ref_p, ref_d = copy.deepcopy(policy), copy.deepcopy(draft)
    m_ref = cotrain_step(ref_p, ref_d, batch, build_optimizer(ref_p, ref_d, 1e-3, 1e-2), None, cfg)
    mesh = Mesh.build(pp=2)
    s, last = mesh.pp_rank, mesh.pp_rank == 1
    stage = split_stage(policy, 2, s)
    d = copy.deepcopy(draft) if last else None
    aux = draft.cfg.aux_layer_ids
    spec = TapSpec.for_stages(stage_layer_ranges(policy.cfg.num_layers, 2), aux, policy.cfg.hidden_size,
                              torch.float32, cfg.micro_batch_rows * PS)
    m = cotrain_step(stage, d, batch, build_optimizer(stage, d, 1e-3, 1e-2), None, cfg,
                        pipe=PipeComm(mesh.pp_group), taps=TapChannel(spec, mesh.tap_group, slots=3, timeout_s=60),
                        tap_layers=aux, step=1)
    for k in ("policy/loss", "draft/loss", "policy/grad_norm", "draft/grad_norm"):
        assert abs(m[k] - m_ref[k]) <= 1e-6 * abs(m_ref[k]), (k, m[k], m_ref[k])
    ref = dict(ref_p.named_parameters()) | {f"draft.{n}": p for n, p in ref_d.named_parameters()}
    mine = dict(stage.named_parameters()) | ({f"draft.{n}": p for n, p in d.named_parameters()} if last else {})
    worst = max((mine[n].grad - ref[n].grad).abs().max().item() / ref[n].grad.abs().max().item() for n in mine)
    print(f"pp bf16 step, stage {s}: max gradient deviation {worst:.2e} of the tensor's largest entry", flush=True)
    for n in mine:  # the clipped gradients
        torch.testing.assert_close(mine[n].grad, ref[n].grad, rtol=1e-5, atol=1e-7, msg=lambda e: f"{n}: {e}")
    dist.barrier()


def test_pp2_bf16_step_equals_unsplit_bf16_step():
    spawn_local(_pp_bf16_step_worker, 2)


def test_layouts_accepted_and_precision_chosen_per_layout(tmp_path):
    """check_parallel accepts FSDP x CP, PP x FSDP (x CP) and bf16 under PP; on_device's "auto" picks bf16
    autocast and a bf16 engine copy for a pretrained policy on a GPU in every layout (derive.on_device says why);
    compile with FSDP is accepted, with FSDP x CP refused."""
    import dataclasses
    from specco.model.config import ConfigError
    from specco.runner.derive import check_parallel, on_device
    for extra, world in ((("parallel.dp_shard=2", "parallel.cp=2"), 4), (("parallel.pp=2", "parallel.dp_shard=2"), 4),
                         (("parallel.pp=2", "parallel.dp_shard=2", "parallel.cp=2"), 8),
                         (("parallel.pp=2", "train.amp=bf16"), 2)):
        cfg = _cfg(tmp_path, *extra)
        assert check_parallel(cfg, world, "train") == (cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.cp)
    gpu = torch.device("cuda")  # only its type is read: no GPU needed
    for extra, engine in (((), "bfloat16"), (("parallel.pp=2",), "bfloat16"), (("parallel.dp_shard=2",), "bfloat16"),
                          (("parallel.dp_shard=2", "parallel.cp=2"), "bfloat16"), (("parallel.tp=2",), "bfloat16"),
                          (("parallel.pp=2", "parallel.dp_shard=2"), "bfloat16")):
        cfg = _cfg(tmp_path, "train.amp=auto", "rollout.dtype=auto", *extra)
        cfg = dataclasses.replace(cfg, policy=dataclasses.replace(cfg.policy, source="Qwen/Qwen3-8B"))
        got = on_device(cfg, gpu)
        assert (got.train.amp, got.rollout.dtype) == ("bf16", engine), extra
        assert on_device(cfg, torch.device("cpu")).train.amp == "none"
    # compile with FSDP is accepted (tests/test_rl_fsdp.py runs it); with FSDP x CP the CP refusal holds
    assert check_parallel(_cfg(tmp_path, "parallel.dp_shard=2", "train.compile=aot_eager"), 2, "train") == (1, 2, 1)
    with pytest.raises(ConfigError, match=r"train.compile='aot_eager' with parallel.pp=1, parallel.cp=2"):
        check_parallel(_cfg(tmp_path, "parallel.dp_shard=2", "parallel.cp=2", "train.compile=aot_eager"), 4, "train")
