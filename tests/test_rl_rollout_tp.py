"""rollout.tp: a tensor-parallel rollout engine (rollout/tp.py) inside the RL loop on gloo, against rollout.tp = 1.

Two RL steps of the co-trained EAGLE-3 arm (the demo's tiny policy with its vocabulary padded to 104 rows so that it
splits, fp64, PPO 2 x 2 with a KL reference), each layout run twice in the same processes: rollout.tp = 2 and
rollout.tp = 1. The engine's shards draw the tokens of the whole engine from the same uniforms (test_engine_tp.py), so
the two runs must record the same rollouts on every rank and end with the same metrics and weights:
  * parallel.tp = 2, rollout.tp = 2: the engine tp group is the trainer's tp group;
  * parallel.cp = 2, rollout.tp = 2: the trainer is not tensor-parallel; the two CP ranks decode together;
  * parallel.tp = 2, parallel.cp = 2, rollout.tp = 2 (slow): two engine groups per DP group, the first generates.
Losses, grad norms and simulated tau rtol 1e-9, every weight atol 1e-10 (the same tokens; the trainers then run the
same ops, measured equal to the last bit here; the bound leaves room for a different reduction order). Also the
refit guard on the shard (on by default: it fingerprints each rank's slice as the whole tensors stream past), the
whole policy the run evaluates and saves (rl.full_models, gathered from the trainer's shards: a collective), and the
plain baseline hook decoding on the shard. A guard that fingerprints the whole tensor instead of the slice
(mutation) fails. Refused by name: rollout.tp not dividing cp x tp, with a DSpark arm, a vocabulary it does not
divide.
"""
import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from specco.parallel.mesh import Mesh, spawn_local

pytestmark = pytest.mark.dist

EXTRA = ("rollout.prompts_per_step=4", "train.ppo_epochs=2", "train.minibatches=2", "train.kl_coef=0.1",
         "plain_baseline=[cotrained]", "rollout.sampler=coupled", "rollout.spec_control=on")


def _models(moe=False):
    """test_rl_cp's tiny fp64 policy and draft, the vocabulary padded from the char tokenizer's 101 to 104 rows (ids
    the tokenizer never makes: decode drops them) so that tp 2 and 4 split it. moe: the same as a Qwen3-MoE (4
    experts of width 16, top 2, layer 1 dense, aux coefficient 0.01)."""
    from test_rl_cp import DEMO
    from specco.config_load import load_config
    from specco.data.tokenizer import build_char_tokenizer
    from specco.model.policy import Policy
    from specco.runner.warmstart import new_draft
    from specco.train.sft import tiny_policy_config
    cfg = load_config(DEMO, [])
    tok = build_char_tokenizer()
    p = cfg.policy
    pc = tiny_policy_config(tok, p.hidden_size, p.num_layers, p.num_heads, p.num_kv_heads, p.intermediate_size)
    torch.manual_seed(0)
    pc = dataclasses.replace(pc, vocab_size=104)
    if moe:
        pc = dataclasses.replace(pc, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=16, norm_topk_prob=True, decoder_sparse_step=1,
                                 mlp_only_layers=(1,), router_aux_loss_coef=0.01)
    policy = Policy(pc).double()
    torch.manual_seed(1)
    draft = new_draft(policy, torch.randint(0, tok.vocab_size, (4, 8))).double()
    return tok, policy, draft


def _worker(rank, world, tmp, layout, moe=False):
    from test_grpo import DigitTask
    from test_rl_cp import _cfg, _close
    from test_rl_fsdp import _flat
    from specco.runner.rl import full_models, needs_gather, run_arm
    from specco.runner.trainer import full_state
    tmp = Path(tmp)
    tok, policy, draft = _models(moe)
    kw = dict(layout)
    runs = {}
    for rtp in (2, 1):
        cfg = _cfg(tmp, *(f"parallel.{k}={v}" for k, v in kw.items()), f"rollout.tp={rtp}", *EXTRA)
        mesh = Mesh.build(cfg.parallel.dp, cfg.parallel.cp, tp=cfg.parallel.tp, rollout_tp=rtp, pp=cfg.parallel.pp,
                          ep=cfg.parallel.ep)
        st, rec = {}, []
        rows = run_arm(cfg, "cotrained", policy, draft, DigitTask(), tok, tmp / f"r{rtp}", progress=False, mesh=mesh,
                       state_out=st, record=rec)
        runs[rtp] = (rows, st["state"], rec, mesh, cfg)
    (rows, s, rec, mesh, cfg), (rows1, s1, rec1, _, _) = runs[2], runs[1]
    eng = s.engine.policy
    assert eng.tp_size == 2 and eng.cfg.num_kv_heads == policy.cfg.num_kv_heads // 2  # the engine holds its shard
    assert eng.lm_head.weight.shape[0] == 52
    if moe:  # each expert's SwiGLU cut: [gate | up] rows 2 × 16 / 2
        assert eng.layers["0"].mlp.experts.gate_up_proj.shape[1] == 16
    assert [ro.pairs for ro in rec] == [ro.pairs for ro in rec1]  # the same rollouts, step 2 from the refit shard
    for r, q in zip(rows, rows1):
        assert r["rollout/plain_rows_equal"] == 1.0  # the plain baseline decoded on the shard: the same tokens
        for k in ("policy/loss", "draft/loss", "policy/grad_norm", "draft/grad_norm", "policy/kl",
                  "draft/sim_accept_len"):  # not tau: speculation control picks k from CPU timings
            _close(r[k], q[k], k)
    if kw.get("pp", 1) == 1:  # (under pp a stage holds part of the weights: the whole ones compared below)
        torch.testing.assert_close(_flat(s), _flat(s1), rtol=0, atol=1e-10)
    # what the run evaluates and saves: the trainer's whole policy (gathered where the trainer shards)
    pol, dr = full_models(s)
    parts = any(kw.get(k, 1) > 1 for k in ("tp", "ep", "pp"))  # the trainer holds part of the policy
    assert needs_gather(s) == parts and (dr is s.draft or kw.get("pp", 1) > 1)  # (pp: gathered from the last stage)
    for k, v in full_models(s1)[1].state_dict().items():
        assert torch.equal(dr.state_dict()[k], v), k
    want = full_state(full_models(s1)[0])  # rollout.tp 1: the trainer's (or its whole engine's) copy
    got = pol.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    # the refit guard fingerprints this rank's slice; fingerprinting the whole tensor (mutation) is caught
    from specco.rollout.engine import RefitError
    from specco.runner import refit as R
    from specco.runner.trainer import refit_arm
    real = R.local_part
    try:
        R.local_part = lambda model, name, t: t
        with pytest.raises(RefitError, match="differ from the trainer's"):
            guard, _ = refit_arm(s, cfg, mesh, fingerprint=True)
            s.engine.check_fingerprints(guard["policy"], guard["draft"], step=3)
    finally:
        R.local_part = real
    guard, _ = refit_arm(s, cfg, mesh, fingerprint=True)
    s.engine.check_fingerprints(guard["policy"], guard["draft"], step=3)
    dist.barrier()


def test_rl_rollout_tp2_of_a_moe_policy_over_cp_ranks_equals_rollout_tp1(tmp_path):
    """A mixture-of-experts policy: the engine's shard cuts every expert's width (rollout/tp.py)."""
    spawn_local(_worker, 2, str(tmp_path), {"cp": 2}, True)


def test_rl_rollout_tp2_of_an_expert_parallel_moe_over_cp_ranks_equals_rollout_tp1(tmp_path):
    """ep 2 over the same cp pair: the run's whole policy gathers the trainer's experts (rl.full_models)."""
    spawn_local(_worker, 2, str(tmp_path), {"cp": 2, "ep": 2}, True)


def test_rl_rollout_tp2_under_pp2_equals_rollout_tp1(tmp_path):
    """pp 2 × cp 2: each stage's engine a tp shard over its cp pair (stage 0's decodes), refit from the gathered
    stages; the log-prob recompute runs through the stages; the run's whole policy and draft gathered."""
    spawn_local(_worker, 4, str(tmp_path), {"pp": 2, "cp": 2})


def test_rl_rollout_tp2_with_trainer_tp2_equals_rollout_tp1(tmp_path):
    spawn_local(_worker, 2, str(tmp_path), {"tp": 2})


def test_rl_rollout_tp2_over_cp_ranks_equals_rollout_tp1(tmp_path):
    spawn_local(_worker, 2, str(tmp_path), {"cp": 2})


@pytest.mark.slow  # 4 processes, two runs each
def test_rl_rollout_tp2_two_engine_groups_equals_rollout_tp1(tmp_path):
    spawn_local(_worker, 4, str(tmp_path), {"tp": 2, "cp": 2})


# -- what is refused -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra, world, match", [
    (("rollout.tp=2", "parallel.dp=2"), 2, r"rollout.tp=2: the engine's ranks are those that share one DP group's rollouts, "
                           r"parallel.cp x parallel.tp = 1 x 1 = 1"),
    (("rollout.tp=4", "parallel.tp=2"), 2, r"parallel.cp x parallel.tp = 1 x 2 = 2 of them"),
    (("rollout.tp=2", "parallel.tp=2", "draft.kind=dspark", "arms=[cotrained]"), 2,
     r"arms \['cotrained'\] with rollout.tp=2: a DSpark draft"),
    (("rollout.tp=2", "parallel.cp=2", "policy.num_kv_heads=1"), 2, r"rollout.tp=2: policy.num_kv_heads=1 is not"),
])
def test_rollout_tp_layouts_not_wired_are_refused_by_name(tmp_path, extra, world, match):
    from test_rl_cp import _cfg
    from specco.model.config import ConfigError
    from specco.runner.derive import check_parallel
    cfg = _cfg(tmp_path, *extra)
    with pytest.raises(ConfigError, match=match):
        check_parallel(cfg, world, "train")


def test_rollout_tp_size_and_vocabulary_are_checked(tmp_path):
    from test_rl_cp import _cfg
    from specco.config import RolloutSpec
    from specco.model.config import ConfigError
    from specco.runner.validate import check_policy
    with pytest.raises(ConfigError, match=r"rollout.tp=0: must be >= 1"):
        RolloutSpec(tp=0)
    # the tiny policy's vocabulary is the char tokenizer's 101 tokens: refused before any stage
    with pytest.raises(ConfigError, match=r"rollout.tp=2: the from-scratch policy's vocabulary is its tokenizer's 101"):
        check_policy(_cfg(tmp_path, "rollout.tp=2", "parallel.cp=2"), tmp_path)
