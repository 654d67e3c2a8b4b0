"""train.overlong_buffer / overlong_penalty: DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13) shapes the
GRPO advantages of completions that run into the end of the length budget; the logged reward stays the task's."""
import pytest
import torch

import specco.runner.rollouts as rollouts
from specco.model.config import ConfigError
from specco.rollout.engine import RolloutEngine
from specco.runner.derive import generate_config
from specco.train.losses import grpo_advantages, overlong_penalty
from test_grpo import DigitTask, _cfg, _setup


def test_penalty_is_zero_before_the_buffer_and_ramps_to_the_coefficient_at_the_budget():
    lengths = torch.tensor([3, 12, 13, 14, 16])
    got = overlong_penalty(lengths, max_len=16, buffer=4, coef=0.5)
    assert torch.allclose(got, torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5]))
    assert torch.equal(overlong_penalty(lengths, 16, 0), torch.zeros(5))  # off


def test_bad_settings_are_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match="train.overlong_buffer=-1"):
        _cfg(tmp_path, "train.overlong_buffer=-1")
    with pytest.raises(ConfigError, match="train.overlong_buffer=7 exceeds rollout.max_new_tokens=6"):
        _cfg(tmp_path, "train.overlong_buffer=7")


def test_advantages_see_the_penalty_and_the_reward_metric_does_not(tmp_path, monkeypatch):
    tok, policy = _setup()
    cfg = _cfg(tmp_path, "train.overlong_buffer=3", "train.overlong_penalty=0.5", "rollout.max_new_tokens=6")
    seen = {}
    real_adv, real_pen = rollouts.grpo_advantages, rollouts.overlong_penalty
    monkeypatch.setattr(rollouts, "grpo_advantages", lambda r, g, **kw: seen.setdefault("shaped", r) is None or real_adv(r, g, **kw))
    monkeypatch.setattr(rollouts, "overlong_penalty",
                        lambda lengths, *a: seen.setdefault("lengths", lengths) is None or real_pen(lengths, *a))

    class Scored(DigitTask):  # the task's own scores, in order
        def score(self, text, item):
            s = super().score(text, item)
            seen.setdefault("scores", []).append(s)
            return s

    engine = RolloutEngine(policy, None, generate_config(cfg, tok.stop_ids, tok.pad_id))
    task = Scored()
    ro = rollouts.collect_rollouts(engine, torch.Generator().manual_seed(0), cfg, task.train, task.rewards, tok, 0, None)
    scores, lengths = torch.tensor(seen["scores"]), seen["lengths"]
    assert (lengths >= 4).any(), lengths  # some rows reach the buffer (the last 3 of 6 tokens): the test bites
    want = scores + overlong_penalty(lengths, 6, 3, 0.5)
    assert torch.allclose(seen["shaped"], want)
    assert torch.allclose(ro.advantages, grpo_advantages(want, cfg.rollout.group_size))
    assert ro.metrics["reward"] == pytest.approx(scores.mean().item())
    assert ro.metrics["reward/overlong_penalty"] == pytest.approx((want - scores).mean().item())
