"""Tensor parallelism (parallel/tp.py) inside the RL loop on gloo, against one process; what is refused.

Two RL steps of the co-trained EAGLE-3 arm at tp 2, tp 2 sequence-parallel, tp 2 × dp_shard 2 and tp 2 × cp 2 (the
demo's tiny policy, fp64, PPO 2 × 2 with a KL reference tensor-parallel like the trainer), every rank recording its
rollouts; rank 0 replays them on one process (`train_on_rollouts`) as tests/test_rl_fsdp.py does: losses, grad
norms, PPO statistics and every parameter after both steps (rtol 1e-9, atol 1e-10; measured 3.5e-14 at most), each
rank's engine refit with the gathered whole policy, a resume from the step-1 checkpoint bit for bit; at tp 2 also
the measurement hooks and on_nonfinite=skip leaving the trajectory as it is, and a tp 2 checkpoint refused at tp 1.
pp 2 × tp 2 as tests/test_rl_pp.py checks pp 2: against each rank's own single-process run, with a resume.

A tp 2 × dp 2 checkpoint resumed at tp 4: every policy tensor and AdamW moment equal, bit for bit.

Refused by name (derive.check_parallel, config.ParallelSpec): compile with tp, sequence parallelism under cp or pp or
without tp, sizes tp does not divide, tp outside `specco train`, a world that is not pp × dp × cp × tp.
"""
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from specco.parallel.mesh import Mesh, spawn_local
import test_fsdp as F
from test_tp import _fused

pytestmark = pytest.mark.dist


def _rl_worker(rank, world, tmp, dp_shard, cp=1, sp=False):
    """Two RL steps of the co-trained EAGLE-3 arm at tp 2 (× dp_shard 2 on 4 processes), replayed on one process
    (test_rl_fsdp._replay: losses, grad norms, PPO statistics, every parameter after both steps)."""
    from test_grpo import DigitTask
    from test_rl_cp import _cfg, _models as rl_models
    from test_rl_fsdp import EXTRA, _flat, _replay, _resumes_exactly
    from specco.runner.rl import run_arm
    tmp = Path(tmp)
    tok, policy, draft = rl_models()
    layout = ("parallel.tp=2", f"parallel.cp={cp}") + (("parallel.dp_shard=2",) if dp_shard else ()) + (
        ("parallel.tp_sequence_parallel=true",) if sp else ())
    cfg = _cfg(tmp, *layout, *EXTRA)
    mesh = Mesh.build(cfg.parallel.dp, cp, dp_shard=cfg.parallel.shard, tp=2)
    st, rec = {}, []
    rows = run_arm(cfg, "cotrained", policy, draft, DigitTask(), tok, tmp / "a", progress=False, mesh=mesh,
                   state_out=st, record=rec)
    s = st["state"]
    assert isinstance(s.policy.layers["0"].self_attn.q_proj.weight, DTensor)  # the trainer's layers are sharded
    assert isinstance(s.ref.layers["0"].mlp.down_proj.weight, DTensor)  # the KL reference too
    assert not any(isinstance(p, DTensor) for p in s.draft.parameters())
    # the tp ranks of a DP group trained on the same rollouts
    mine = [[p for p in ro.pairs] for ro in rec]
    both = [None] * 2
    dist.all_gather_object(both, mine, group=mesh.tp_group)
    assert both[0] == both[1]
    flat = _flat(s)  # the trainer's whole weights: state-dict order, HF's parts (q_proj, ...) as the fused model's
    eng = torch.cat([v.flatten() for v in s.engine.policy.state_dict().values()])
    assert torch.equal(eng, flat[:eng.numel()])  # each rank's engine: the gathered whole policy
    from specco.runner.rl import full_models
    whole, dr = full_models(s)  # evaluated and saved: gathered from the trainer's shards (a collective)
    got = torch.cat([v.flatten() for v in whole.state_dict().values()])
    assert dr is s.draft and torch.equal(got, flat[:got.numel()])
    # stopped after step 1 and resumed from its (sharded, TP) checkpoint: the same run, bit for bit
    run = lambda d, **kw: run_arm(cfg, "cotrained", policy, draft, DigitTask(), tok, tmp / d,  # noqa: E731
                                  progress=False, mesh=mesh, **kw)
    _resumes_exactly(run, rows, flat, _flat, rank)
    if dp_shard == 0 and cp == 1 and not sp:
        # a TP checkpoint resumed without TP: refused by name (its projections are unfused)
        from specco.train.checkpoint import CheckpointError
        with pytest.raises(CheckpointError, match=r"saved at parallel.tp > 1 .* cannot be resumed at parallel.tp = 1"):
            run_arm(_cfg(tmp, "parallel.dp=2", *EXTRA), "cotrained", policy, draft, DigitTask(), tok, tmp / "a",
                    progress=False, mesh=Mesh.build(2, 1))
        # the measurements (plain baseline: the updates rerun from copies of the TP state; frozen shadow) and
        # on_nonfinite=skip's copy leave the arm's trajectory as it is (test_rl_fsdp's check)
        runs = {}
        for name, hooks in (("with", ("plain_baseline=[cotrained]", "frozen_shadow=[cotrained]")), ("without", ())):
            cfg_m = _cfg(tmp, *layout, *EXTRA, "rollout.sampler=coupled", "rollout.spec_control=on",
                         "train.on_nonfinite=skip", *hooks)
            runs[name] = {}
            runs[name]["rows"] = run_arm(cfg_m, "cotrained", policy, draft, DigitTask(), tok, tmp / name,
                                         progress=False, mesh=mesh, state_out=runs[name])
        assert "time/rollout_plain" in runs["with"]["rows"][0]
        assert [r["policy/loss"] for r in runs["with"]["rows"]] == [r["policy/loss"] for r in runs["without"]["rows"]]
        assert torch.equal(_flat(runs["with"]["state"]), _flat(runs["without"]["state"]))
    _replay(rank, mesh, cfg_extra=EXTRA, arm="cotrained", policy=policy, draft=draft, tok=tok, tmp=tmp, rows=rows,
            rec=rec, flat=flat)


def _rl_pp_worker(rank, world, tmp):
    """pp 2 × tp 2 in the RL loop (test_rl_pp's check): every rank's own single-process run on the same data and
    sampler is the reference; the same rollouts, metrics, and every stage parameter (gathered, fused names) after
    two steps with PPO 2 × 2, a KL reference and a resume from the step-1 checkpoint."""
    from test_grpo import DigitTask
    from test_rl_cp import _cfg, _close, _models as rl_models
    from specco.runner.rl import run_arm
    tmp = Path(tmp)
    tok, policy, draft = rl_models()
    extra = ("rollout.prompts_per_step=4", "train.ppo_epochs=2", "train.minibatches=2", "train.kl_coef=0.1",
             "train.checkpoint_every=1")
    ref_state, ref_rec = {}, []
    ref = run_arm(_cfg(tmp, *extra), "cotrained", policy, draft, DigitTask(), tok, tmp / f"ref{rank}", progress=False,
                  state_out=ref_state, record=ref_rec)
    mesh = Mesh.build(pp=2, tp=2, backend="gloo")
    cfg = _cfg(tmp, "parallel.pp=2", "parallel.tp=2", *extra)
    st, rec = {}, []
    run = lambda **kw: run_arm(cfg, "cotrained", policy, draft, DigitTask(), tok, tmp / "pp", progress=False,  # noqa
                               mesh=mesh, record=rec, **kw)
    rows = run(stop_after=1) + run(state_out=st)  # one step, "crash", resume from its checkpoint
    assert [a.pairs for a in rec] == [b.pairs for b in ref_rec]  # the same rollouts, step 2 from the refit engine
    for r, q in zip(rows, ref):
        for k in ("policy/loss", "policy/ratio_mean", "policy/kl"):
            _close(r[k], q[k], k, 1e-6)
        for k in ("draft/loss", "policy/grad_norm", "draft/grad_norm", "draft/tokens"):
            _close(r[k], q[k], k)
    s = st["state"]
    assert isinstance(s.policy.layers[next(iter(s.policy.layers))].mlp.down_proj.weight, DTensor)
    got = _fused({f"policy.{n}": F._full(p.detach()) for n, p in s.policy.named_parameters()})
    if s.draft is not None:
        got.update({f"draft.{n}": p.detach() for n, p in s.draft.named_parameters()})
    want = {f"policy.{n}": p.detach() for n, p in ref_state["state"].policy.named_parameters()}
    want.update({f"draft.{n}": p.detach() for n, p in ref_state["state"].draft.named_parameters()})
    assert got and ("draft.fc.weight" in got) == (mesh.pp_rank == 1)
    for k, v in got.items():
        torch.testing.assert_close(v, want[k], rtol=1e-9, atol=1e-10, msg=k)


@pytest.mark.slow  # 4 processes, each with its own single-process reference run
def test_rl_loop_pp2_tp2_equals_single_process(tmp_path):
    spawn_local(_rl_pp_worker, 4, str(tmp_path))


def test_rl_loop_tp2_equals_single_process(tmp_path):
    spawn_local(_rl_worker, 2, str(tmp_path), False)


def test_rl_loop_tp2_sequence_parallel_equals_single_process(tmp_path):
    spawn_local(_rl_worker, 2, str(tmp_path), False, 1, True)


@pytest.mark.slow  # 4 processes
def test_rl_loop_tp2_dp_shard2_equals_single_process(tmp_path):
    spawn_local(_rl_worker, 4, str(tmp_path), True)


@pytest.mark.slow  # 4 processes
def test_rl_loop_tp2_cp2_equals_single_process(tmp_path):
    spawn_local(_rl_worker, 4, str(tmp_path), False, 2)


# -- what is refused -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra, world, command, match", [
    (("train.compile=aot_eager",), 2, "train", r"train.compile='aot_eager' with parallel.tp=2"),
    (("policy.num_kv_heads=1",), 2, "train", r"policy.num_kv_heads=1 is not a multiple"),
    (("parallel.tp_sequence_parallel=true", "parallel.cp=2"), 4, "train",
     r"parallel.tp_sequence_parallel=true with parallel.cp=2, parallel.pp=1: sequence parallelism under context"),
    ((), 2, "cotrain-cp", r"tensor parallelism runs in `specco train` only"),
    ((), 3, "train", r"parallel.tp = 1 x 1 x 1 x 2 = 2 but 3 process"),
])
def test_tp_layouts_not_wired_are_refused_by_name(tmp_path, extra, world, command, match):
    from test_rl_cp import _cfg
    from specco.model.config import ConfigError
    from specco.runner.derive import check_parallel
    cfg = _cfg(tmp_path, "parallel.tp=2", *extra)
    with pytest.raises(ConfigError, match=match):
        check_parallel(cfg, world, command)


def test_tp_size_is_checked():
    from specco.model.config import ConfigError
    from specco.config import ParallelSpec
    with pytest.raises(ConfigError, match="parallel.tp=0: must be >= 1"):
        ParallelSpec(tp=0)
    with pytest.raises(ConfigError, match="parallel.tp_sequence_parallel=true needs parallel.tp > 1"):
        ParallelSpec(tp_sequence_parallel=True)


def test_sequence_parallel_rounds_widths_to_tp(tmp_path):
    from test_rl_cp import _cfg
    from specco.runner.derive import step_config, train_shapes
    cfg = _cfg(tmp_path, "parallel.tp=4", "parallel.tp_sequence_parallel=true", "train.width_multiple=6")
    assert step_config(cfg).width_multiple == 12
    assert all(w % 12 == 0 for _, w in train_shapes(cfg, 10))
    assert step_config(_cfg(tmp_path, "parallel.tp=4", "train.width_multiple=6")).width_multiple == 6




def test_tp_sizes_of_a_pretrained_policy_are_checked_before_any_stage(tmp_path):
    """A Hugging Face policy whose kv heads tp does not divide: refused by check_job's policy check (its config.json),
    not at make_arm after SFT and the warm start."""
    from test_rl_cp import _cfg
    from specco.model.config import ConfigError, PolicyConfig
    from specco.model.hf_io import save_policy
    from specco.model.policy import Policy
    from specco.runner.validate import check_policy
    pc = PolicyConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=1)
    save_policy(Policy(pc), tmp_path / "hf")
    cfg = _cfg(tmp_path / "out", f"policy.source={tmp_path / 'hf'}", "parallel.tp=2", "draft.aux_layer_ids=[0, 1]")
    with pytest.raises(ConfigError, match=r"parallel.tp=2: the policy's \(.*config.json\) num_kv_heads=1 is not a"):
        check_policy(cfg, tmp_path / "out")


def _reshard_worker(rank, world, tmp):
    """A checkpoint of tp 2 × dp 2 resumed at tp 4: every policy tensor and AdamW moment lands whole-equal (DCP reads
    each rank's new slices of the saved Shard(0) / Shard(1) chunks)."""
    from test_grpo import DigitTask
    from test_rl_cp import _cfg
    from specco.data.tokenizer import build_char_tokenizer
    from specco.model.policy import Policy
    from specco.runner.arm_checkpoint import resume_arm
    from specco.runner.derive import generate_config
    from specco.runner.rl import run_arm
    from specco.runner.trainer import make_arm
    from specco.runner.warmstart import new_draft
    from specco.train.sft import tiny_policy_config
    tmp = Path(tmp)
    tok = build_char_tokenizer()
    torch.manual_seed(0)  # the demo's sizes but 4 kv heads, which tp 4 divides
    policy = Policy(tiny_policy_config(tok, 96, 4, 4, 4, 256)).double()
    torch.manual_seed(1)
    draft = new_draft(policy, torch.randint(0, tok.vocab_size, (4, 8))).double()
    extra = ("rollout.prompts_per_step=8", "train.checkpoint_every=1", "policy.num_kv_heads=4")
    cfg_a = _cfg(tmp, "parallel.tp=2", "parallel.dp=2", *extra)
    st = {}
    run_arm(cfg_a, "cotrained", policy, draft, DigitTask(), tok, tmp / "x", progress=False,
            mesh=Mesh.build(2, 1, tp=2), stop_after=1, state_out=st)

    def whole(s):  # every policy tensor and its AdamW moments, gathered, by name
        out = {}
        for n, p in s.policy.named_parameters():
            out[n] = F._full(p.detach()).clone()
            for k in ("exp_avg", "exp_avg_sq"):
                out[f"{n}.{k}"] = F._full(s.opt.state[p][k]).clone()
        return out
    saved = whole(st["state"])
    cfg_b = _cfg(tmp, "parallel.tp=4", *extra)
    mesh_b = Mesh.build(1, 1, tp=4)
    st_b = make_arm(cfg_b, "cotrained", policy, draft, generate_config(cfg_b, tok.eos_id, tok.pad_id), mesh=mesh_b)
    assert resume_arm(tmp / "x" / "ckpt", st_b, cfg_b, mesh_b) and st_b.step == 1
    assert st_b.policy.layers["0"].self_attn.k_proj.weight.to_local().shape[0] == 4 * 24 // 4  # one kv head of 24
    got = whole(st_b)
    assert got.keys() == saved.keys()
    for k, v in saved.items():
        assert torch.equal(got[k], v), k


@pytest.mark.slow  # 4 processes
def test_tp2_dp2_checkpoint_resumes_at_tp4(tmp_path):
    spawn_local(_reshard_worker, 4, str(tmp_path))
