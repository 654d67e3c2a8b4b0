"""The RL loop's minibatches are padded to a multiple of train.width_multiple (runner/rollouts.build_batch), so
every micro-batch width the train step, the log-prob recompute and the frozen shadow cut is such a multiple: a
run sees a fixed set of shapes (cuDNN attention plans once per shape). Before, the micro-batch holding a
minibatch's longest row kept that row's exact length, a new shape in nearly every minibatch of every step.

The padding is exact: the columns are masked and trimmed micro-batches drop them, so the step on padded
minibatches equals the step on exact ones (fp64 models; the micro-batch widths differ, so sums run in other
orders: 1e-10 relative; seen: metrics equal, parameters 8e-15 apart).
"""
import pytest
import torch

from specco.runner.rollouts import Rollouts, build_batch, minibatches
from specco.train.cotrain import StepConfig, micro_batch_cuts


def _rollouts(vocab, lengths, G=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    pairs = [(torch.randint(3, vocab, (int(p),), generator=g).tolist(),
              torch.randint(3, vocab, (n,), generator=g).tolist())
             for p, n in zip(torch.randint(3, 7, (len(lengths),), generator=g), lengths)]
    adv = torch.randn(len(lengths), generator=g, dtype=torch.float64)
    return Rollouts(pairs, G, adv, [[0.0] * n for n in lengths])


def test_every_micro_batch_width_is_a_multiple():
    ro = _rollouts(50, [13, 2, 7, 29, 5, 31, 1, 11, 17, 3, 23, 9, 6, 19, 4, 8])  # 4 prompts x 4 samples
    for m in (1, 8, 16):
        cfg = StepConfig(micro_batch_rows=3, width_multiple=m)
        for mb in minibatches(ro, 2, cfg, 0, "cpu", None):
            assert mb.batch.tokens.shape[1] % m == 0
            assert all(w % m == 0 for _, w in micro_batch_cuts(mb.batch, 3, m)), m
    exact = build_batch(ro.pairs, 0, "cpu")
    assert exact.tokens.shape[1] == max(len(p) + len(c) for p, c in ro.pairs)  # the default keeps the exact width
    assert build_batch(ro.pairs, 0, "cpu", 16).tokens.shape[1] == 48


@pytest.mark.e2e
def test_the_step_on_padded_minibatches_equals_the_exact_one(tmp_path):
    from test_draft_min_tokens import _step
    from test_rl_cp import _models
    tok, _, _ = _models()
    ro = _rollouts(tok.vocab_size, [6, 3, 5, 1, 6, 4, 2, 6])
    extra = ["train.micro_batch_rows=3", "train.minibatches=2", "train.draft_row_stride=2"]
    m1, p1 = _step(tmp_path, "w1", [*extra, "train.width_multiple=1"], ro)
    m8, p8 = _step(tmp_path, "w8", [*extra, "train.width_multiple=8"], ro)
    for k in ("policy/loss", "draft/loss", "draft/tokens", "policy/grad_norm", "draft/grad_norm", "policy/ratio_mean"):
        assert abs(m1[k] - m8[k]) <= 1e-10 * max(1.0, abs(m1[k])), (k, m1[k], m8[k])
    torch.testing.assert_close(p1, p8, rtol=1e-10, atol=1e-12)


def test_pad_pairs_of_rows_sharing_a_prompt_list():
    """A group's rows share one prompt list (rollout_pairs), which pad_pairs converts once: the tokens and the
    completion mask equal each row written out, an empty completion and a row longer than its group's included."""
    from specco.runner.rollouts import pad_pairs
    a, b = [5, 6, 7], [8, 9]
    pairs = [(a, [1, 2]), (a, []), (a, [3]), (b, [4, 4, 4, 4, 4])]
    tokens, mask = pad_pairs(pairs, pad_id=0, width_multiple=4)
    assert tokens.tolist() == [[5, 6, 7, 1, 2, 0, 0, 0], [5, 6, 7, 0, 0, 0, 0, 0], [5, 6, 7, 3, 0, 0, 0, 0],
                               [8, 9, 4, 4, 4, 4, 4, 0]]
    assert mask.tolist() == [[0, 0, 0, 1, 1, 0, 0, 0], [0] * 8, [0, 0, 0, 1, 0, 0, 0, 0], [0, 0, 1, 1, 1, 1, 1, 0]]
