"""train.warm_widths: the RL trainer's micro-batch shapes (runner/derive.train_shapes) warmed before the first
step (train/compile.warm_shapes), so per-shape one-time work (cuDNN attention plans on a GPU) leaves the timed
steps. On CPU nothing plans; these tests check that the shapes are the ones the trainer cuts, that warming
changes no state a run depends on (weights, gradients, RNG: bit-exact resume), and the refusals."""
import random

import pytest
import torch

from specco.config import ConfigError
from specco.config_load import load_config
from specco.runner.derive import step_config, train_shapes
from specco.runner.rollouts import Rollouts, minibatches
from specco.train.compile import warm_shapes
from specco.train.cotrain import micro_batch_cuts


def test_the_long_run_has_eighteen_widths():
    cfg = load_config("configs/long_cotrain.toml", ["train.warm_widths=true"])
    shapes = train_shapes(cfg, 66)  # the longest chain_sum prompt of configs/long.toml is 65-66 tokens
    assert shapes == [(16, w) for w in range(128, 2305, 128)]  # 66 + 2,150 = 2,216 -> 2,304


@pytest.mark.parametrize("micro,n_mb,shadow", [(5, 2, True), (5, 2, False), (0, 2, True), (7, 1, False)])
def test_the_shapes_cover_every_cut_of_the_trainer(micro, n_mb, shadow):
    """Random rollouts, cut as train_on_rollouts and measure.FrozenShadow cut them: every (rows, width) is listed."""
    extra = [f"train.micro_batch_rows={micro}", f"train.minibatches={n_mb}", "train.width_multiple=64",
             "rollout.prompts_per_step=4", "rollout.group_size=6", "rollout.max_new_tokens=150", "train.warm_widths=true"]
    cfg = load_config("configs/demo.toml", extra + (["frozen_shadow=[cotrained]"] if shadow else []))
    scfg = step_config(cfg)
    listed = set(train_shapes(cfg, 12))
    rng = random.Random(0)
    seen = set()
    for _ in range(30):
        pairs = [([1] * rng.randint(3, 12), [2] * rng.randint(1, 150)) for _ in range(24)]
        ro = Rollouts(pairs, 6, torch.zeros(24), [[0.0] * len(c) for _, c in pairs])
        for n in [n_mb] + ([1] if shadow else []):
            for mb in minibatches(ro, n, scfg, 0, "cpu", None):
                cuts = micro_batch_cuts(mb.batch, scfg.micro_batch_rows, scfg.width_multiple)
                seen |= {(len(i), w) for i, w in cuts} if cuts else {tuple(mb.batch.tokens.shape)}
    assert seen <= listed, seen - listed
    assert len(seen) >= len(listed) // 2  # the test saw a good part of them


def test_warming_changes_no_state():
    from test_rollout_helpers import tiny_policy
    policy = tiny_policy()
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    rng = torch.get_rng_state()
    secs = warm_shapes(policy, None, [(2, 8), (3, 16)])
    assert secs >= 0 and all(p.grad is None for p in policy.parameters())
    assert all(torch.equal(before[k], v) for k, v in policy.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())


@pytest.mark.e2e
def test_make_arm_warms_its_trainer(capsys):
    from test_rl_cp import _cfg, _models
    from specco.runner.derive import generate_config
    from specco.runner.trainer import make_arm
    tok, policy, draft = _models()
    cfg = _cfg("/tmp/unused", "train.warm_widths=true", "train.width_multiple=64")
    make_arm(cfg, "cotrained", policy, draft, generate_config(cfg, tok.eos_id, tok.pad_id))
    assert "the trainer warmed at 1 micro-batch shapes" in capsys.readouterr().out


def test_refusals():
    with pytest.raises(ConfigError, match=r"train.warm_widths with train.width_multiple=1"):
        load_config("configs/demo.toml", ["train.warm_widths=true"])
    with pytest.raises(ConfigError, match=r"train.warm_widths with parallel.cp=2"):
        load_config("configs/demo.toml", ["train.warm_widths=true", "train.width_multiple=64", "parallel.cp=2"])
