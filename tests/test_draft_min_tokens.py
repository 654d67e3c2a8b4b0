"""train.draft_min_tokens: the draft's row stride chosen per RL step from the rollouts' completion lengths
(train/cotrain.draft_stride, runner/trainer.rl_step_config).

* The rule on its own: the largest divisor of the group size (<= draft_row_stride) whose rows hold the floor,
  counted as the rows `draft_rows` picks in every minibatch of whole prompt groups.
* In the RL step: a step under the floor is exactly the step at the fixed stride it picked (same rollouts,
  fp64 models: losses, grad norms, draft tokens and the parameters after it equal to 1e-12), and the stride
  shrinks when the same prompts come back with shorter completions.
* Config: a stride that does not divide the group is refused by name.
"""
from pathlib import Path

import pytest
import torch

from specco.config import ConfigError
from specco.config_load import load_config
from specco.train.cotrain import draft_stride

DEMO = Path(__file__).resolve().parents[1] / "configs" / "demo.toml"


def test_the_largest_group_divisor_that_holds_the_floor():
    # 2 prompts x 8 samples; sample i of every group has length 10 * (i + 1)
    lengths = torch.tensor([10 * (i + 1) for _ in range(2) for i in range(8)])
    # rows i % n == 0 of both groups: n = 8 -> 2 x 10 = 20 tokens; 4 -> 2 x (10 + 50) = 120; 2 -> 2 x 160 = 320
    assert draft_stride(lengths, 8, 8, 20) == 8
    assert draft_stride(lengths, 8, 8, 21) == 4
    assert draft_stride(lengths, 8, 8, 120) == 4
    assert draft_stride(lengths, 8, 8, 121) == 2
    assert draft_stride(lengths, 8, 8, 10**6) == 1  # no stride holds it: every row
    assert draft_stride(lengths, 8, 2, 1) == 2  # never above draft_row_stride
    # only divisors of the group: 3 would take other samples in different groups' rows
    assert draft_stride(torch.ones(12, dtype=torch.long), 6, 5, 4) == 3  # 5, 4 skipped; 3 -> 4 rows
    assert draft_stride(torch.ones(12, dtype=torch.long), 6, 5, 5) == 2


def test_the_count_is_the_rows_the_draft_trains_on():
    """draft_stride counts sample i % n == 0 of every group; `draft_rows` of a minibatch of whole groups (the
    runner's interleaved minibatches) takes exactly those rows."""
    from specco.train.cotrain import StepConfig, draft_rows
    from specco.batch import TrainBatch
    G, groups = 8, [0, 2, 5]  # a minibatch's groups
    lengths = torch.randint(1, 50, (6 * G,), generator=torch.Generator().manual_seed(0))
    for n in (1, 2, 4, 8):
        rows = [g * G + i for g in groups for i in range(G)]
        batch = TrainBatch(tokens=torch.zeros(len(rows), 4, dtype=torch.long),
                           target_mask=torch.ones(len(rows), 4))
        picked = [rows[b] for b in range(len(rows))[draft_rows(batch, StepConfig(draft_row_stride=n))]]
        assert picked == [g * G + i for g in groups for i in range(0, G, n)]
        assert int(lengths[picked].sum()) == int(lengths.reshape(-1, G)[groups][:, ::n].sum())


def _models():
    from test_rl_cp import _models as models
    return models()


def _rollouts(tok, lengths, G=4, seed=0):
    """Rollouts of 2 prompts x G samples with the given completion lengths (random tokens, graded advantages)."""
    from specco.runner.rollouts import Rollouts
    g = torch.Generator().manual_seed(seed)
    pairs = [(torch.randint(3, tok.vocab_size, (5,), generator=g).tolist(),
              torch.randint(3, tok.vocab_size, (n,), generator=g).tolist()) for n in lengths]
    adv = torch.randn(len(lengths), generator=g, dtype=torch.float64)
    return Rollouts(pairs, G, adv, [[0.0] * n for _, n in zip(pairs, lengths)])


def _step(tmp_path, tag, extra, ro):
    from specco.runner.derive import generate_config
    from specco.runner.trainer import make_arm, train_on_rollouts
    from test_rl_cp import _cfg
    tok, policy, draft = _models()
    cfg = _cfg(tmp_path / tag, "rollout.prompts_per_step=2", *extra)
    st = make_arm(cfg, "cotrained", policy, draft, generate_config(cfg, tok.eos_id, tok.pad_id))
    m = train_on_rollouts(st, cfg, ro, tok.pad_id, "cpu")
    params = torch.cat([p.detach().flatten() for mod in (st.policy, st.draft) for p in mod.parameters()])
    return m, params


@pytest.mark.e2e
def test_the_rl_step_under_the_floor_is_the_fixed_stride_step(tmp_path):
    """Long completions keep the largest stride; short ones bring it down. Either way the step equals the one at
    the fixed stride it chose, on the same rollouts (fp64; the only difference would be the rows)."""
    tok, _, _ = _models()
    long_ro = _rollouts(tok, [6, 6, 5, 6, 6, 4, 6, 6])  # sample 0 of the 2 groups: 12 tokens
    short_ro = _rollouts(tok, [2, 3, 2, 1, 2, 2, 3, 1])  # sample 0: 4; samples 0, 2: 8; all: 16
    floor = ["train.draft_min_tokens=10", "train.draft_row_stride=4"]
    for ro, expect in ((long_ro, 4), (short_ro, 1)):
        m, p = _step(tmp_path, f"floor{expect}", floor, ro)
        m_fixed, p_fixed = _step(tmp_path, f"fixed{expect}", [f"train.draft_row_stride={expect}"], ro)
        assert m["draft/row_stride"] == expect
        assert "draft/row_stride" not in m_fixed
        for k in ("draft/loss", "draft/tokens", "draft/grad_norm", "policy/loss", "policy/grad_norm"):
            assert abs(m[k] - m_fixed[k]) <= 1e-12 * max(1.0, abs(m_fixed[k])), (k, m[k], m_fixed[k])
        torch.testing.assert_close(p, p_fixed, rtol=0, atol=1e-12)
    # the stride really changed what the draft saw: all 16 short tokens against the 12 of sample 0
    m4, _ = _step(tmp_path, "again4", floor, long_ro)
    m1, _ = _step(tmp_path, "again1", floor, short_ro)
    assert m4["draft/tokens"] < sum(len(c) for _, c in long_ro.pairs) and m1["draft/row_stride"] == 1


def test_a_stride_that_does_not_divide_the_group_is_refused():
    with pytest.raises(ConfigError, match=r"train.draft_min_tokens=100 with train.draft_row_stride=3"):
        load_config(DEMO, ["train.draft_min_tokens=100", "train.draft_row_stride=3"])
    with pytest.raises(ConfigError, match=r"train.draft_min_tokens=-1"):
        load_config(DEMO, ["train.draft_min_tokens=-1"])
    assert load_config(DEMO, ["train.draft_min_tokens=100", "train.draft_row_stride=3",
                              "rollout.group_size=6"]).train.draft_min_tokens == 100
