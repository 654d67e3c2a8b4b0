"""EAGLE-3 TTT: the K-pass loss and its gradients equal a naive re-implementation that materialises
the full masked attention over all passes; chunked == unchunked; the draft never moves the policy.

Tolerances: fp64 runs compare at 1e-10 relative (same math, different association order);
fp32 at 2e-4 relative (reduction order of fused vs. dense softmax over <= 4*S keys).
"""
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from specco.model.config import DraftConfig, PolicyConfig
from specco.model.draft import Eagle3Draft, build_vocab_maps
from specco.model.layers import rope_cos_sin
from specco.model.policy import Policy
from specco.model.ttt import shift_left, ttt_forward
from specco.parallel.layout import PADDED
from specco.train.cotrain import StepConfig, TrainBatch, build_optimizer, cotrain_step
from specco.train.drafters import EAGLE3
from specco.train.losses import DraftStats, draft_loss_parts, normalize_draft_loss, pass_weights


def _draft_loss(draft, out, batch, cfg):
    """The EAGLE-3 step's draft loss of `batch` from a policy output (train/drafters.py)."""
    return EAGLE3.loss(draft, None, out, batch, cfg)


def _models(dtype=torch.float64, heads=(4, 2), draft_vocab=40, seed=0, gain=8.0):
    torch.manual_seed(seed)
    pc = PolicyConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=5,
                      num_heads=heads[0], num_kv_heads=heads[1])
    policy = Policy(pc).to(dtype)
    dc = DraftConfig.for_policy(pc, draft_vocab)
    draft = Eagle3Draft(dc)
    d2t, t2d = build_vocab_maps(torch.rand(61), draft_vocab)
    draft.set_vocab_maps(d2t, t2d)
    # Larger-than-init weights so attention is far from uniform and errors would show.
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() == 2:
                p.mul_(gain)
    return policy, draft.to(dtype)


def naive_ttt_loss(draft, aux, embed, logits, target_mask, K, weights):
    """Materialise every pass's keys and one dense mask over [pass1; ...; passK] keys."""
    layer, sa = draft.midlayer, draft.midlayer.self_attn
    B, S, _ = embed.shape
    pos = torch.arange(S).expand(B, S)
    hidden = draft.fc(aux)
    ks, vs, num, den = [], [], 0.0, 0.0
    teacher_all = logits[..., draft.draft_to_target]
    for d in range(1, K + 1):
        emb = torch.cat([embed[:, d:], torch.zeros_like(embed[:, :d])], 1)
        cos, sin = rope_cos_sin(pos + d - 1, sa.head_dim, draft.cfg.rope_theta, hidden.dtype,
                                scaling=draft.cfg.rope_scaling)
        q, k, v = sa.qkv(layer.attn_input(hidden, emb), cos, sin)
        ks.append(k)
        vs.append(v)
        kall = torch.cat(ks, 2).repeat_interleave(sa.num_heads // sa.num_kv_heads, 1)  # (B,H,d*S,D)
        vall = torch.cat(vs, 2).repeat_interleave(sa.num_heads // sa.num_kv_heads, 1)
        i = torch.arange(S)[:, None]
        blocks = [i >= torch.arange(S)[None]] + [i == torch.arange(S)[None]] * (d - 1)
        mask = torch.cat(blocks, 1)  # (S, d*S)
        s = (q @ kall.transpose(-1, -2)) / math.sqrt(sa.head_dim)
        o = torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ vall
        hidden = layer.finish(hidden, sa.out(o))
        z = draft.lm_head(draft.norm(hidden))
        t = torch.cat([teacher_all[:, d:], torch.zeros_like(teacher_all[:, :d])], 1)
        m = torch.cat([target_mask[:, d + 1:], torch.zeros_like(target_mask[:, :d + 1])], 1).to(z.dtype)
        ce = -(F.softmax(t, -1) * F.log_softmax(z, -1)).sum(-1)
        num = num + weights[d - 1] * (ce * m).sum()
        den = den + weights[d - 1] * m.sum()
    return num / den


@pytest.mark.e2e
@pytest.mark.parametrize("K", [1, 2, 3, 4])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-10), (torch.float32, 2e-4)])
def test_ttt_loss_and_grads_match_naive(K, heads, dtype, rtol):
    policy, draft = _models(dtype, heads)
    B, S = 2, 13
    tokens = torch.randint(0, 61, (B, S))
    mask = (torch.rand(B, S) > 0.2).to(dtype)
    with torch.no_grad():
        out = policy(tokens, tap_layers=draft.cfg.aux_layer_ids)
    w = pass_weights(K, 0.8)
    outs = ttt_forward(draft, out.taps.aux, out.taps.embed, torch.arange(S).expand(B, S), K)
    parts = draft_loss_parts(draft, outs, out.logits, mask, chunk=5)
    loss, metrics = normalize_draft_loss(parts, w), DraftStats.of(parts).metrics()
    grads = torch.autograd.grad(loss, list(draft.parameters()))
    ref = naive_ttt_loss(draft, out.taps.aux, out.taps.embed, out.logits, mask, K, w)
    ref_grads = torch.autograd.grad(ref, list(draft.parameters()))
    assert abs(loss.item() - ref.item()) <= rtol * abs(ref.item())
    for (name, _), g, r in zip(draft.named_parameters(), grads, ref_grads):
        err = (g - r).norm() / r.norm().clamp_min(1e-30)
        assert err <= rtol * 10, f"{name}: rel err {err:.2e}"
    assert 1.0 <= metrics["draft/sim_accept_len"] <= K + 1


@pytest.mark.parametrize("K", [1, 3, 4])
def test_anchors_before_the_first_trained_column_are_skipped_exactly(K):
    """Long prompts, short completions (the long-context case): with the batch's first trained column known
    (TrainBatch.trained_from) the TTT passes run only from first_anchor on, and the loss, every draft gradient
    and the statistics equal the naive all-anchor reference (fp64); first_anchor is tight: one anchor later
    drops pass K's first target."""
    from specco.train.drafters import first_anchor
    policy, draft = _models(torch.float64)
    B, S = 4, 30
    tokens = torch.randint(0, 61, (B, S))
    mask = torch.zeros(B, S, dtype=torch.float64)
    for b, (lo, hi) in enumerate([(14, 30), (17, 26), (12, 22), (20, 30)]):
        mask[b, lo:hi] = 1
    batch = TrainBatch(tokens=tokens, target_mask=mask, trained_from=12)
    cfg = StepConfig(ttt_passes=K, pass_decay=0.8, draft_row_stride=1)
    assert first_anchor(batch, K, PADDED) == 12 - K - 1
    with torch.no_grad():
        out = policy(tokens, tap_layers=draft.cfg.aux_layer_ids)
    loss, stats = _draft_loss(draft, out, batch, cfg)
    grads = torch.autograd.grad(loss, list(draft.parameters()))
    ref = naive_ttt_loss(draft, out.taps.aux, out.taps.embed, out.logits, mask, K, pass_weights(K, 0.8))
    ref_grads = torch.autograd.grad(ref, list(draft.parameters()))
    assert abs(loss.item() - ref.item()) <= 1e-10 * abs(ref.item())
    for (name, _), g, r in zip(draft.named_parameters(), grads, ref_grads):
        assert (g - r).norm() <= 1e-9 * r.norm(), name
    whole, whole_stats = _draft_loss(draft, out, dataclasses.replace(batch, trained_from=0), cfg)
    for a, b in zip(stats._tensors(), whole_stats._tensors()):
        assert torch.allclose(a, b, rtol=1e-10, atol=0)
    late, late_stats = _draft_loss(draft, out, dataclasses.replace(batch, trained_from=13), cfg)
    assert late_stats.count[-1] == whole_stats.count[-1] - 1 and abs(late.item() - whole.item()) > 1e-6


def test_micro_batches_know_their_first_trained_column():
    """Each micro-batch carries the first column any of its rows trains (one host read with the lengths)."""
    from specco.train.cotrain import micro_batches
    batch = _batch(B=6, S=12)
    starts = [3, 8, 5, 9, 2, 7]
    for b, lo in enumerate(starts):
        batch.target_mask[b] = 0
        batch.target_mask[b, lo:] = 1
    batch.tokens[:, 0] = torch.arange(6)  # row markers
    seen = 0
    for _, mb in micro_batches(batch, 2):
        ids = mb.tokens[:, 0].tolist()
        assert mb.trained_from == min(starts[r] for r in ids)
        seen += len(ids)
    assert seen == 6


def test_chunked_equals_unchunked():
    policy, draft = _models(torch.float64)
    tokens = torch.randint(0, 61, (2, 17))
    mask = torch.ones(2, 17, dtype=torch.float64)
    out = policy(tokens, tap_layers=draft.cfg.aux_layer_ids)
    outs = ttt_forward(draft, out.taps.aux, out.taps.embed, torch.arange(17).expand(2, 17), 3)
    res = []
    for chunk in (1, 4, 17, 1000):
        loss = normalize_draft_loss(draft_loss_parts(draft, outs, out.logits, mask, chunk), [1, .8, .64])
        res.append((loss.item(), torch.autograd.grad(loss, draft.fc.weight, retain_graph=True)[0]))
    for l, g in res[1:]:
        assert abs(l - res[0][0]) < 1e-12 and torch.allclose(g, res[0][1], atol=1e-12)


def _batch(B=4, S=12, V=61):
    tokens = torch.randint(0, V, (B, S))
    mask = torch.zeros(B, S)
    mask[:, 5:] = 1
    return TrainBatch(tokens=tokens, target_mask=mask, advantages=torch.randn(B),
                      logp_old=-torch.rand(B, S) * 3)


def _ragged(batch: TrainBatch, lengths: list[int]) -> None:
    """Right-pad rows to their `lengths` (pad id 0, nothing trained past the end), in place."""
    for b, L in enumerate(lengths):
        batch.tokens[b, L:] = 0
        batch.target_mask[b, L:] = 0


def test_trimmed_drops_only_untrained_trailing_columns():
    batch = _batch(B=3)
    _ragged(batch, [7, 9, 8])
    t = batch.trimmed()
    assert t.tokens.shape == (3, 9) and t.logp_old.shape == (3, 9) and t.advantages.shape == (3,)
    assert torch.equal(t.tokens, batch.tokens[:, :9]) and torch.equal(t.target_mask, batch.target_mask[:, :9])
    assert batch.rows(0, 1).trimmed().tokens.shape == (1, 7)
    assert _batch(B=2).trimmed().tokens.shape == (2, 12)  # nothing to trim


def test_policy_grads_identical_for_any_lambda():
    batch = _batch()
    grads = []
    for lam in (0.0, 1.0, 7.5):
        policy, draft = _models(torch.float64)
        opt = build_optimizer(policy, draft, 1e-3, 1e-2)
        cfg = StepConfig(draft_weight=lam, ttt_passes=3, policy_grad_clip=1e9, draft_grad_clip=1e9, draft_row_stride=1)
        # Capture the policy grads before the optimizer step by zero LR on the policy group.
        opt.param_groups[0]["lr"] = 0.0
        cotrain_step(policy, draft, batch, opt, None, cfg)
        grads.append([p.grad.clone() for p in policy.parameters()])
        if lam > 0:
            assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in draft.parameters())
    for g in grads[1:]:
        for a, b in zip(grads[0], g):
            assert torch.equal(a, b)


@pytest.mark.e2e
def test_offline_warm_start_freezes_policy_and_learns():
    policy, draft = _models(torch.float32, draft_vocab=61, gain=1.0)
    before = [p.clone() for p in policy.parameters()]
    opt = build_optimizer(None, draft, 0.0, 1e-2)
    cfg = StepConfig(ttt_passes=2, draft_row_stride=1)
    tokens = torch.randint(0, 61, (8, 16))
    batch = TrainBatch(tokens=tokens, target_mask=torch.ones(8, 16))
    # The soft CE is bounded below by the teacher's entropy H (random policy: H ~ log V), so what
    # must fall is the excess CE - H = KL(teacher || draft) (pass 1 is ~all of it at the start).
    with torch.no_grad():
        lp = torch.log_softmax(policy(tokens).logits, -1)
        H = -(lp.exp() * lp).sum(-1)[:, 1:].mean().item()
    ms = [cotrain_step(policy, draft, batch, opt, None, cfg, train_policy=False) for _ in range(40)]
    assert ms[-1]["draft/loss"] - H < 0.5 * (ms[0]["draft/loss"] - H)
    assert ms[-1]["draft/top1_pass1"] > ms[0]["draft/top1_pass1"] + 0.2
    assert all(torch.equal(a, b) for a, b in zip(before, policy.parameters()))
    assert all(p.grad is None for p in policy.parameters())


def test_shift_left():
    x = torch.arange(6.).view(1, 6, 1)
    assert shift_left(x, 2).flatten().tolist() == [2, 3, 4, 5, 0, 0]


def test_draft_row_stride_equals_loss_on_the_selected_rows():
    """stride n: L_draft and its gradients equal those of a batch holding only rows 0, n, 2n..."""
    policy, draft = _models(torch.float64)
    batch = _batch(B=8)
    out = policy(batch.tokens, tap_layers=draft.cfg.aux_layer_ids)
    sub = TrainBatch(tokens=batch.tokens[::4], target_mask=batch.target_mask[::4])
    out_sub = policy(sub.tokens, tap_layers=draft.cfg.aux_layer_ids)
    one_row = StepConfig(ttt_passes=3, draft_row_stride=1)
    l_a, m_a = _draft_loss(draft, out, batch, StepConfig(ttt_passes=3, draft_row_stride=4))
    g_a = torch.autograd.grad(l_a, list(draft.parameters()), allow_unused=True)
    l_b, m_b = _draft_loss(draft, out_sub, sub, one_row)
    g_b = torch.autograd.grad(l_b, list(draft.parameters()), allow_unused=True)
    _, m_full = _draft_loss(draft, out, batch, one_row)
    m_a, m_b, m_full = m_a.metrics(), m_b.metrics(), m_full.metrics()
    assert m_a["draft/tokens"] == m_b["draft/tokens"] == m_full["draft/tokens"] / 4
    assert abs(l_a.item() - l_b.item()) < 1e-12  # same rows, same fp64 math
    for a, b in zip(g_a, g_b):
        assert (a is None and b is None) or torch.allclose(a, b, atol=1e-12)
    # a stride beyond the batch keeps row 0
    l_c, _ = _draft_loss(draft, out_sub, sub, StepConfig(ttt_passes=3, draft_row_stride=99))
    one = TrainBatch(tokens=sub.tokens[:1], target_mask=sub.target_mask[:1])
    l_d, _ = _draft_loss(draft, policy(one.tokens, tap_layers=draft.cfg.aux_layer_ids), one, one_row)
    assert abs(l_c.item() - l_d.item()) < 1e-12


@pytest.mark.e2e
@pytest.mark.parametrize("stride,micro,width", [(1, 3, 1), (2, 3, 1), (4, 2, 1), (3, 5, 1), (2, 3, 5)])
def test_microbatched_step_equals_full_batch(stride, micro, width):
    """micro_batch_rows: the accumulated update equals the whole-batch step (fp64): every gradient,
    the loss metrics and every draft metric (all passes, from summed statistics) exactly, the policy
    clip fraction as a token-weighted mean; also with widths rounded up (width_multiple: padded columns
    past a row's end change nothing)."""
    torch.manual_seed(5)
    batch = _batch(B=8)
    _ragged(batch, [9, 7, 8, 6, 12, 9, 7, 8])  # micro-batches shorter than the batch get trimmed
    batch.target_mask[3, :] = 0  # a row with nothing to train on
    res = []
    for mb in (0, micro):
        policy, draft = _models(torch.float64)
        opt = build_optimizer(policy, draft, 1e-3, 1e-2)
        cfg = StepConfig(ttt_passes=3, draft_row_stride=stride, micro_batch_rows=mb, width_multiple=width,
                         policy_grad_clip=1e9, draft_grad_clip=1e9)
        m = cotrain_step(policy, draft, batch, opt, None, cfg)
        res.append((m, [p.grad.clone() for p in policy.parameters()],
                    [p.grad.clone() for p in draft.parameters() if p.grad is not None]))
    (m0, gp0, gd0), (m1, gp1, gd1) = res
    for a, b in zip(gp0 + gd0, gp1 + gd1):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-12)
    draft_keys = [f"draft/{m}_pass{d}" for m in ("ce", "top1") for d in (1, 2, 3)] + ["draft/sim_accept_len"]
    for k in ("draft/loss", "draft/tokens", *draft_keys, "policy/clip_frac", "policy/grad_norm", "draft/grad_norm"):
        assert abs(m0[k] - m1[k]) <= 1e-9 * max(1.0, abs(m0[k])), (k, m0[k], m1[k])
    # the policy loss summed over a different partition of the tokens differs by rounding only (a bound from when
    # token_logprobs was fp32 for fp64 models too; seen then: 1.5e-8 relative)
    assert abs(m0["policy/loss"] - m1["policy/loss"]) <= 1e-6 * abs(m0["policy/loss"])


def test_micro_batches_group_rows_by_length_and_keep_the_draft_rows():
    """Longest rows first, each micro-batch trimmed to its own length, and the draft's rows are still exactly
    the batch's rows 0 mod stride (told apart here by a per-row marker token)."""
    from specco.train.cotrain import micro_batches
    batch = _batch(B=8, S=12)
    lengths = [6, 12, 7, 11, 8, 10, 9, 7]  # trained tokens from column 5 (_batch)
    _ragged(batch, lengths)
    batch.tokens[:, 0] = torch.arange(8)  # row markers
    seen, draft = [], []
    for rows, mb in micro_batches(batch, 3, draft_stride=2):
        ids = mb.tokens[:, 0].tolist()
        seen += ids
        draft += mb.tokens[rows, 0].tolist()
        assert mb.tokens.shape[1] == max(lengths[r] for r in ids)  # trimmed to its longest row
    assert seen == sorted(range(8), key=lambda r: -lengths[r])  # longest first
    assert sorted(draft) == [0, 2, 4, 6]
    # width_multiple: each width rounded up to a multiple (at most the batch's 12 columns), rows unchanged
    for rows, mb in micro_batches(batch, 3, draft_stride=2, width_multiple=5):
        longest = max(lengths[r] for r in mb.tokens[:, 0].tolist())
        assert mb.tokens.shape[1] == min(12, -(-longest // 5) * 5)
    rows, whole = next(micro_batches(batch, 0, draft_stride=2))
    assert whole.tokens is batch.tokens and rows == slice(0, None, 2) and whole.trained_from == 5


@pytest.mark.e2e
@pytest.mark.parametrize("stride,micro", [(1, 3), (2, 3), (3, 2)])
def test_frozen_draft_eval_in_micro_batches_equals_one_forward(stride, micro):
    """measure.draft_eval runs only the draft's rows, in micro-batches: the same loss and metrics (fp64)."""
    from specco.runner.measure import draft_eval
    torch.manual_seed(3)
    policy, draft = _models(torch.float64)
    batch = _batch(B=8)
    _ragged(batch, [9, 7, 8, 6, 12, 9, 7, 8])
    ref = draft_eval(policy, draft, batch, StepConfig(ttt_passes=3, draft_row_stride=stride))
    got = draft_eval(policy, draft, batch, StepConfig(ttt_passes=3, draft_row_stride=stride, micro_batch_rows=micro))
    assert ref.keys() == got.keys()
    for k in ref:
        assert abs(ref[k] - got[k]) <= 1e-9 * max(1.0, abs(ref[k])), (k, ref[k], got[k])
    # and the loss of one forward over every row, strided
    with torch.no_grad():
        whole, _ = _draft_loss(draft, policy(batch.tokens, tap_layers=draft.cfg.aux_layer_ids), batch,
                              StepConfig(ttt_passes=3, draft_row_stride=stride))
    assert abs(whole.item() - got["draft/loss"]) <= 1e-9 * abs(whole.item())
