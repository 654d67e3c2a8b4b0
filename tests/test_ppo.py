"""PPO updates, the KL penalty and the derived configs.

* The KL term (train.kl_coef) against a hand computation from explicit log-softmaxes of the policy and
  a reference policy (1e-6: the hand computation's fp32 log-probs).
* A CPU RL run with ppo_epochs = 2, minibatches = 2: four optimizer steps per rollout batch, so the
  ratio moves off 1 and some tokens clip; resume stays bit-exact.
* The KL run keeps a frozen reference: KL is exactly 0 on the first update of step 1 (the reference
  is the starting policy) and > 0 later.
* StepConfig / GenerateConfig come from the run config through one builder each, frozen.
"""
import dataclasses
import math

import pytest
import torch

from specco.batch import TrainBatch
from specco.config_load import load_config
from specco.model.config import ConfigError
from specco.parallel.layout import PADDED
from specco.runner.derive import generate_config, step_config
from specco.runner.rl import run_arm
from specco.runner.warmstart import new_draft
from resume_helpers import assert_same_final_weights
from specco.train.cotrain import StepConfig, policy_loss
from test_grpo import DigitTask, _cfg, _setup
from cli_helpers import DEMO  # noqa: E402

pytestmark = pytest.mark.e2e


def test_kl_penalty_matches_hand_computation():
    torch.manual_seed(3)
    _, policy = _setup()
    _, ref = _setup(seed=9)
    policy, ref = policy.double(), ref.double()
    B, S, T = 3, 9, 0.7
    tokens = torch.randint(0, policy.cfg.vocab_size, (B, S))
    mask = torch.zeros(B, S, dtype=torch.float64)
    mask[:, 3:] = 1
    mask[2, 7:] = 0
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    with torch.no_grad():
        lp_ref = torch.log_softmax(ref(tokens).logits.float() / T, -1)  # fp32, as token_logprobs for fp32 models
        lp_ref = lp_ref[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]  # (B, S-1): token j+1 at j
    logp_ref = torch.cat([lp_ref, torch.zeros(B, 1)], 1)  # indexed like the logits (batch.py)
    logp_old = logp_ref + 0.1  # an off-policy old policy: ratio != 1
    batch = TrainBatch(tokens=tokens, target_mask=mask, advantages=adv, logp_old=logp_old, logp_ref=logp_ref)
    cfg = StepConfig(kl_coef=0.3, clip_eps=0.2, temperature=T)
    loss, stats = policy_loss(policy(tokens).logits, batch, cfg)
    # by hand: per trained token j (predicted at j-1), with x = log p_new(j) and r = ref, o = old
    lp = torch.log_softmax(policy(tokens).logits.detach().float() / T, -1)[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
    m, total, kl_sum = mask[:, 1:], 0.0, 0.0
    for b in range(B):
        for j in range(S - 1):
            if m[b, j]:
                x, r, o, a = lp[b, j].item(), lp_ref[b, j].item(), logp_old[b, j].item(), adv[b].item()
                ratio = math.exp(x - o)
                k3 = math.exp(r - x) - (r - x) - 1
                total += -min(ratio * a, min(max(ratio, 0.8), 1.2) * a) + 0.3 * k3
                kl_sum += k3
    n = m.sum().item()
    # 1e-6 relative: the hand computation takes fp32 log-probs (as token_logprobs does for fp32 / bf16 models; it
    # keeps these fp64 ones in fp64), so fp32 rounding differs (seen: 1e-8); a wrong sign, shift or mask gives
    # O(1e-2) or more.
    assert abs(loss.item() - total / n) <= 1e-6 * abs(total / n)
    assert abs(stats.metrics()["policy/kl"].item() - kl_sum / n) <= 1e-6 * kl_sum / n
    assert kl_sum > 0


@pytest.mark.slow
def test_ppo_epochs_and_minibatches_move_the_ratio_and_resume_bit_exactly(tmp_path):
    tok, policy = _setup()
    draft = new_draft(policy, torch.randint(0, tok.vocab_size, (4, 8)), aux_layer_ids=(0, 1))
    cfg = _cfg(tmp_path, "train.steps=4", "train.ppo_epochs=2", "train.minibatches=2", "train.lr=2e-2",
               "rollout.prompts_per_step=4")
    straight = run_arm(cfg, "cotrained", policy, draft, DigitTask(), tok, tmp_path / "a", progress=False)
    part1 = run_arm(cfg, "cotrained", policy, draft, DigitTask(), tok, tmp_path / "b", progress=False, stop_after=2)
    part2 = run_arm(cfg, "cotrained", policy, draft, DigitTask(), tok, tmp_path / "b", progress=False)
    for r in straight:
        assert r["ppo/updates"] == 4
        assert r["policy/ratio_dev"] > 1e-4, r["policy/ratio_dev"]  # 3 of the 4 updates are off-policy
        assert r["logprob_gap_engine_vs_trainer"] < 1e-4  # the recompute ran, in the engine's numerics
    assert max(r["policy/clip_frac"] for r in straight) > 0, [r["policy/clip_frac"] for r in straight]
    for a, b in zip(straight, part1 + part2):
        for k in ("reward", "policy/loss", "draft/loss", "tau", "policy/clip_frac", "policy/ratio_mean",
                  "policy/grad_norm", "draft/grad_norm"):
            assert a[k] == b[k], (k, a[k], b[k])
    assert_same_final_weights(tmp_path / "a", tmp_path / "b")


def test_one_update_is_on_policy_without_recompute(tmp_path):
    """ppo_epochs = minibatches = 1: no log-prob recompute (no gap metric, no logprob time worth a
    forward), ratio exactly 1, nothing clipped."""
    tok, policy = _setup()
    rows = run_arm(_cfg(tmp_path, "train.steps=1"), "none", policy, None, DigitTask(), tok, tmp_path / "n",
                   progress=False)
    r = rows[0]
    assert "logprob_gap_engine_vs_trainer" not in r and r["ppo/updates"] == 1
    from specco.runner.report import read_jsonl  # metrics.jsonl holds the numbers at full float precision
    logged = read_jsonl(tmp_path / "n" / "metrics.jsonl")[0]
    for k in ("policy/loss", "policy/grad_norm", "reward", "policy/clip_frac"):
        assert logged[k] == r[k], (k, logged[k], r[k])
    assert r["policy/ratio_mean"] == 1.0 and r["policy/clip_frac"] == 0.0 and r["policy/ratio_dev"] == 0.0


def test_kl_run_uses_the_frozen_starting_policy(tmp_path):
    """kl_coef > 0: the reference is the arm's starting policy, so the KL is exactly 0 in the first update
    and positive once the policy has moved; without it no reference is kept (KL metric 0)."""
    tok, policy = _setup()
    cfg = _cfg(tmp_path, "train.steps=2", "train.kl_coef=0.1", "train.ppo_epochs=2", "train.lr=1e-2")
    rows = run_arm(cfg, "none", policy, None, DigitTask(), tok, tmp_path / "kl", progress=False)
    assert 0 < rows[0]["policy/kl"] < rows[1]["policy/kl"], [r["policy/kl"] for r in rows]
    rows0 = run_arm(_cfg(tmp_path, "train.steps=1", "train.ppo_epochs=2", "train.lr=1e-2"), "none", policy, None,
                    DigitTask(), tok, tmp_path / "nokl", progress=False)
    assert rows0[0]["policy/kl"] == 0.0


def test_derived_configs_come_from_the_run_config():
    cfg = load_config(DEMO, ["train.draft_row_stride=4", "train.micro_batch_rows=16", "rollout.temperature=0.5",
                             "train.kl_coef=0.2", "train.amp=bf16", "rollout.k=2", "rollout.max_new_tokens=9",
                             "rollout.top_p=0.9", "draft.ttt_passes=2"])
    s = step_config(cfg, "cotrained")
    assert (s.draft_row_stride, s.micro_batch_rows, s.temperature, s.kl_coef, s.amp_dtype, s.ttt_passes) == \
        (4, 16, 0.5, 0.2, torch.bfloat16, 2)
    assert step_config(cfg, "frozen").draft_weight == 0.0 and s.draft_weight == cfg.train.draft_weight
    g = generate_config(cfg, eos_id=5, pad_id=0)
    assert (g.num_draft_tokens, g.max_new_tokens, g.sampling.temperature, g.sampling.top_p, g.eos_token_id) == \
        (2, 9, 0.5, 0.9, 5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.clip_eps = 1.0  # immutable
    # one set of defaults: a StepConfig built without the run config has the run config's values
    d = step_config(load_config(DEMO, []))
    assert dataclasses.replace(StepConfig(), temperature=d.temperature) == d
    with pytest.raises(ConfigError, match="unknown config key 'draft.enabled'"):
        load_config(DEMO, ["draft.enabled=false"])  # a key that did nothing is gone


def test_logprob_recompute_runs_the_train_steps_micro_batches():
    """Minibatch.logprobs on padded, long-tailed rows: through the train step's micro-batches (each cut to
    its longest row), equal to one forward of the whole minibatch at every trained position (1e-5: fp32,
    only the GEMM and attention shapes differ), and bit-equal to the train step's own forward, so the first
    update's ratio is exactly 1 (ratio_dev 0)."""
    from specco.runner.rollouts import Minibatch, recompute_logprobs
    from specco.train.cotrain import cotrain_step
    _, policy = _setup()
    torch.manual_seed(0)
    B, S = 6, 24
    tokens = torch.randint(1, policy.cfg.vocab_size, (B, S))
    mask = torch.zeros(B, S)
    for b, n in enumerate([24, 5, 13, 9, 20, 7]):  # completion from column 3 to n (rows end at n)
        mask[b, 3:n] = 1
        tokens[b, n:] = 0
    batch = TrainBatch(tokens=tokens, target_mask=mask, advantages=torch.randn(B))
    cfg = dataclasses.replace(StepConfig(), micro_batch_rows=2)
    got = Minibatch(batch, PADDED, list(range(B))).logprobs(policy, cfg)
    whole = recompute_logprobs(policy, tokens, cfg)
    at = mask[:, 1:] != 0  # log-prob of token j sits at position j - 1
    assert torch.allclose(got[:, :-1][at], whole[:, :-1][at], atol=1e-5, rtol=0)
    batch.logp_old = got
    opt = torch.optim.SGD(policy.parameters(), lr=0.0)
    m = cotrain_step(policy, None, batch, opt, None, cfg)
    assert m["policy/ratio_dev"] == 0.0 and m["policy/ratio_mean"] == 1.0, m


def test_first_update_skips_its_recompute_and_trains_the_same():
    """With ppo_epochs = 1 the first minibatch is trained once, on the sampling policy: its old log-probs are
    its own forward's (logp_old None), bit-equal to a recompute (previous test), so the update is the same to
    the bit; only the other minibatches are recomputed."""
    import copy
    from specco.runner.rollouts import Minibatch
    from specco.train.cotrain import build_optimizer, cotrain_step
    _, policy = _setup()
    torch.manual_seed(1)
    B, S = 4, 16
    tokens = torch.randint(1, policy.cfg.vocab_size, (B, S))
    mask = torch.zeros(B, S)
    mask[:, 3:] = 1
    cfg = dataclasses.replace(StepConfig(), micro_batch_rows=2)
    results = []
    for recompute in (True, False):
        p = copy.deepcopy(policy)
        batch = TrainBatch(tokens=tokens, target_mask=mask, advantages=torch.randn(B, generator=torch.Generator().manual_seed(2)))
        if recompute:
            batch.logp_old = Minibatch(batch, PADDED, list(range(B))).logprobs(p, cfg)
        m = cotrain_step(p, None, batch, build_optimizer(p, None, 1e-2, 1e-2), None, cfg)
        results.append((m, [t.detach().clone() for t in p.parameters()]))
    (m_a, w_a), (m_b, w_b) = results
    assert m_a["policy/loss"] == m_b["policy/loss"] and m_a["policy/grad_norm"] == m_b["policy/grad_norm"]
    assert all(torch.equal(a, b) for a, b in zip(w_a, w_b))


@pytest.mark.parametrize("epochs,recomputed", [(1, 1), (2, 2)])
def test_recompute_count_per_step(tmp_path, monkeypatch, epochs, recomputed):
    from specco.runner.rollouts import Minibatch
    calls = []
    real = Minibatch.logprobs
    monkeypatch.setattr(Minibatch, "logprobs", lambda self, *a: calls.append(1) or real(self, *a))
    tok, policy = _setup()
    cfg = _cfg(tmp_path, "train.steps=1", f"train.ppo_epochs={epochs}", "train.minibatches=2",
               "rollout.prompts_per_step=4")
    (row,) = run_arm(cfg, "none", policy, None, DigitTask(), tok, tmp_path / "r", progress=False)
    assert len(calls) == recomputed and row["ppo/updates"] == 2 * epochs
    assert row["logprob_gap_engine_vs_trainer"] < 1e-4  # from the recomputed minibatches
