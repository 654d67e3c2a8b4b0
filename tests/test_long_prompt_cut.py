"""Long prompts, short completions (the long-context case): the train step reads the policy's logits and runs
EAGLE-3's TTT passes only from the micro-batch's first trained column minus K+1 (train/drafters.first_anchor;
Policy.forward(logits_from=...), ttt_forward(q_start=...)). Exact: the step with the cut, whole-batch and
micro-batched, equals the step without it (first_anchor patched to 0 where the step and the drafters read it), in
every gradient and metric, for EAGLE-3, DFlash, DSpark and no draft (fp64; tolerances as tests/test_ttt.py's
micro-batching: 1e-9 relative, the sums' association order only).

The cut must really happen: each forward is seen asking for logits from a column > 0, and getting (B, S - cut, V)
logits."""
import dataclasses

import pytest
import torch

from specco.model.config import DraftConfig, PolicyConfig
from specco.model.dflash import BlockDraft, BlockDraftConfig
from specco.model.draft import Eagle3Draft, build_vocab_maps
from specco.model.policy import Policy
from specco.train.cotrain import StepConfig, TrainBatch, build_optimizer, cotrain_step

PC = PolicyConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=2)


def _models(kind):
    torch.manual_seed(0)
    policy = Policy(PC).double()
    if kind == "none":
        return policy, None
    if kind == "eagle3":
        draft = Eagle3Draft(DraftConfig.for_policy(PC, 40))
        d2t, t2d = build_vocab_maps(torch.rand(61), 40)
        draft.set_vocab_maps(d2t, t2d)
        return policy, draft.double()
    draft = BlockDraft(BlockDraftConfig.for_policy(PC, kind, gamma=3, mask_id=60, num_layers=1, num_anchors=4,
                                                   markov_rank=4)).double()
    if kind == "dspark":
        torch.nn.init.normal_(draft.markov_w2.weight, std=0.1)
    return policy, draft


def _batch():
    """8 rows of 40 columns: prompts of 18-27 tokens, completions of 4-12, right-padded."""
    g = torch.Generator().manual_seed(3)
    B, S = 8, 40
    tokens = torch.randint(1, 60, (B, S), generator=g)
    mask = torch.zeros(B, S)
    for b, (p, c) in enumerate([(20, 8), (27, 12), (18, 4), (25, 10), (22, 12), (19, 6), (26, 5), (24, 9)]):
        mask[b, p:p + c] = 1
        tokens[b, p + c:] = 0
    return TrainBatch(tokens=tokens, target_mask=mask, advantages=torch.randn(B, generator=g),
                      logp_old=-torch.rand(B, S, generator=g) * 3)


@pytest.mark.parametrize("kind", ["none", "eagle3", "dflash", "dspark"])
def test_long_prompt_step_cut_equals_whole(kind, monkeypatch):
    from specco.train import cotrain, drafters
    batch, real = _batch(), drafters.first_anchor
    res, cuts = [], []
    for micro, cut in ((0, False), (0, True), (3, True)):
        for home in (cotrain, drafters):
            monkeypatch.setattr(home, "first_anchor", real if cut else lambda b, k, lay: 0)
        policy, draft = _models(kind)
        seen = []

        def hook(mod, args, kwargs, out, seen=seen):
            seen.append((kwargs.get("logits_from", 0), out.logits_from, out.logits.shape[1], out.hidden.shape[1]))
        policy.register_forward_hook(hook, with_kwargs=True)
        opt = build_optimizer(policy, draft, 1e-3, 1e-2)
        cfg = StepConfig(ttt_passes=3, draft_row_stride=2, micro_batch_rows=micro, policy_grad_clip=1e9,
                         draft_grad_clip=1e9)
        m = cotrain_step(policy, draft, batch, opt, None, cfg)
        res.append((m, [p.grad.clone() for p in policy.parameters()],
                    [] if draft is None else [p.grad.clone() for p in draft.parameters() if p.grad is not None]))
        cuts.append(seen)
    assert all(asked == 0 for asked, *_ in cuts[0])  # patched: every position
    for seen in cuts[1:]:
        assert all(asked > 0 and got == asked and n == S - asked for asked, got, n, S in seen), seen
    m0, gp0, gd0 = res[0]
    assert kind == "none" or gd0
    for m1, gp1, gd1 in res[1:]:
        assert len(gd0) == len(gd1)
        for a, b in zip(gp0 + gd0, gp1 + gd1):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
        keys = [k for k in m0 if k.startswith(("policy/", "draft/")) and k != "policy/loss"]
        for k in keys:
            assert abs(m0[k] - m1[k]) <= 1e-9 * max(1.0, abs(m0[k])), (k, m0[k], m1[k])
        assert abs(m0["policy/loss"] - m1["policy/loss"]) <= 1e-6 * abs(m0["policy/loss"])  # as test_ttt's


def test_policy_logits_from_a_column():
    torch.manual_seed(1)
    policy = Policy(PC).double()
    tokens = torch.randint(0, 61, (2, 12))
    whole, cut = policy(tokens), policy(tokens, logits_from=5)
    assert whole.logits_from == 0 and cut.logits_from == 5 and cut.logits.shape == (2, 7, 61)
    torch.testing.assert_close(cut.logits, whole.logits[:, 5:], rtol=1e-12, atol=1e-14)  # matmul blocking only
    a, b = _batch(), _batch().columns_from(10)
    assert b.tokens.shape == (8, 30) and torch.equal(b.logp_old, a.logp_old[:, 10:]) and b.advantages.shape == (8,)


@pytest.mark.parametrize("micro,dtype", [(0, torch.float32), (3, torch.float32), (3, torch.float64)])
def test_long_prompt_logprob_recompute_cuts_as_the_step(micro, dtype):
    """The PPO/KL log-prob recompute (runner/rollouts.Minibatch.logprobs) cuts its logits where the train step
    does, so an unchanged policy's ratio is exactly 1 (to the bit: the same shapes), and its log-probs at every
    trained position equal an uncut forward's (fp32: 1e-5, the head's matmul over fewer rows and the attention's
    micro-batch shapes only); the positions before the cut hold 0, and no loss reads them. In the policy's own
    precision: an fp64 policy's micro-batched recompute is fp64 (stored as fp32 its ratio was 1 only to ~1e-8)."""
    from specco.parallel.layout import PADDED
    from specco.runner.rollouts import Minibatch, recompute_logprobs
    policy = _models("none")[0].to(dtype)
    batch = _batch()
    cfg = StepConfig(ttt_passes=3, micro_batch_rows=micro, policy_grad_clip=1e9)
    got = Minibatch(batch, PADDED, list(range(8))).logprobs(policy, cfg)
    assert got.dtype == dtype
    whole = recompute_logprobs(policy, batch.tokens, cfg)
    at = batch.target_mask[:, 1:] != 0  # log-prob of token j sits at position j - 1
    torch.testing.assert_close(got[:, :-1][at].double(), whole[:, :-1][at].double(), rtol=1e-5, atol=1e-5)
    assert (got[:, :14] == 0).all()  # the shortest prompt is 18 tokens: K+1 = 4 before it the cut falls
    batch.logp_old = got
    m = cotrain_step(policy, None, batch, torch.optim.SGD(policy.parameters(), lr=0.0), None, cfg)
    assert m["policy/ratio_dev"] == 0.0 and m["policy/ratio_mean"] == 1.0, m


def test_only_a_layout_whose_attention_takes_q_start_skips_prompts():
    """PaddedRows with ttt_attention (or a partial of it) skips; with another TTT attention (a CP ring on one rank,
    tests/test_amp.py) and on packed / CP layouts every column runs (first_anchor 0)."""
    import functools

    from specco.ops.attention import ttt_attention
    from specco.parallel.layout import PaddedRows
    from specco.train.drafters import first_anchor
    batch = dataclasses.replace(_batch(), trained_from=18)
    assert first_anchor(batch, 3, PaddedRows()) == 14
    assert first_anchor(batch, 3, PaddedRows(functools.partial(ttt_attention, impl="torch"))) == 14
    assert first_anchor(batch, 3, PaddedRows(lambda *a, **k: ttt_attention(*a, **k))) == 0
