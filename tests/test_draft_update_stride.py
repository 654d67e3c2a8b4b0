"""train.draft_update_stride: the co-trained draft trains in every n-th PPO update of an RL step
(runner/derive.draft_updates; runner/trainer.run_updates, runner/rl_pp.pp_train_updates).

* The RL step at stride 2 (2 minibatches) is exactly its updates written out by hand: the co-training step on
  minibatch 0, then the policy-only step on minibatch 1 (same rollouts, fp64 models: every parameter and the
  metrics to 1e-12); the draft's metrics are its one update's, the policy's the mean over both.
* It is not the stride-1 step: there the draft moves in both updates (the check fails if the stride is ignored),
  while the policy's parameters are the same (its loss never reads the draft).
* Config: a stride below 1 is refused by name.
"""
import pytest
import torch

from specco.config import ConfigError
from specco.config_load import load_config
from test_draft_min_tokens import DEMO, _models, _rollouts


def _arm(tmp_path, tag, *extra):
    from specco.runner.derive import generate_config
    from specco.runner.trainer import make_arm
    from test_rl_cp import _cfg
    tok, policy, draft = _models()
    cfg = _cfg(tmp_path / tag, "rollout.prompts_per_step=2", "train.minibatches=2", "train.draft_row_stride=1",
               "train.draft_lr=1e-2", *extra)
    return tok, cfg, make_arm(cfg, "cotrained", policy, draft, generate_config(cfg, tok.eos_id, tok.pad_id))


def _params(mod):
    return torch.cat([p.detach().flatten() for p in mod.parameters()])


@pytest.mark.e2e
def test_the_step_at_stride_two_is_its_updates_by_hand(tmp_path):
    from specco.runner.derive import step_config
    from specco.runner.rollouts import minibatches
    from specco.runner.trainer import train_on_rollouts
    from specco.train.cotrain import cotrain_step
    tok, _, _ = _models()
    ro = _rollouts(tok, [6, 5, 4, 6, 3, 6, 5, 2])  # 2 prompts x 4 samples: one prompt group per minibatch
    _, cfg, st = _arm(tmp_path, "stride2", "train.draft_update_stride=2")
    m = train_on_rollouts(st, cfg, ro, tok.pad_id, "cpu")

    _, cfg_ref, ref = _arm(tmp_path, "by_hand", "train.draft_update_stride=2")
    scfg = step_config(cfg_ref, "cotrained")
    mbs = minibatches(ro, 2, scfg, tok.pad_id, "cpu", None)
    mbs[1].batch.logp_old = mbs[1].logprobs(ref.policy, scfg)  # as train_on_rollouts freezes them (ppo_epochs 1)
    h0 = cotrain_step(ref.policy, ref.draft, mbs[0].batch, ref.opt, None, scfg, layout=mbs[0].layout)
    h1 = cotrain_step(ref.policy, None, mbs[1].batch, ref.opt, None, scfg, layout=mbs[1].layout)
    assert "draft/loss" in h0 and "draft/loss" not in h1
    for mod in ("policy", "draft"):
        torch.testing.assert_close(_params(getattr(st, mod)), _params(getattr(ref, mod)), rtol=0, atol=1e-12)
    for k in ("draft/loss", "draft/tokens", "draft/grad_norm"):
        assert abs(m[k] - h0[k]) <= 1e-12 * max(1.0, abs(h0[k])), (k, m[k], h0[k])
    for k in ("policy/loss", "policy/grad_norm"):
        want = (h0[k] + h1[k]) / 2
        assert abs(m[k] - want) <= 1e-12 * max(1.0, abs(want)), (k, m[k], want)
    assert m["ppo/updates"] == 2

    # stride 1: the draft trains in both updates (a stride that is ignored fails here); the policy is the same
    _, cfg1, st1 = _arm(tmp_path, "stride1")
    m1 = train_on_rollouts(st1, cfg1, ro, tok.pad_id, "cpu")
    torch.testing.assert_close(_params(st1.policy), _params(st.policy), rtol=0, atol=1e-12)
    assert (_params(st1.draft) - _params(st.draft)).abs().max() > 1e-6
    assert m1["draft/tokens"] != m["draft/tokens"]


def test_a_stride_below_one_is_refused():
    with pytest.raises(ConfigError, match=r"train.draft_update_stride=0"):
        load_config(DEMO, ["train.draft_update_stride=0"])
    assert load_config(DEMO, ["train.draft_update_stride=4"]).train.draft_update_stride == 4
