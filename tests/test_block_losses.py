"""Block-drafter losses: anchors, slot validity, DFlash / DSpark losses and metrics vs hand computation."""
import math

import pytest
import torch
import torch.nn.functional as F

from specco.model.config import PolicyConfig
from specco.model.dflash import BlockDraft, BlockDraftConfig, slot_weights
from specco.train.block_losses import (BlockStats, block_draft_loss, block_slot_counts, sample_anchors,
                                       slot_validity)


def test_anchors_deterministic_from_content_and_among_generated():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 50, (4, 30), generator=g)
    mask = torch.zeros(4, 30, dtype=torch.bool)
    mask[:, 10:25] = True  # completion tokens 10..24
    mask[3] = False  # a row with no generated token
    state = torch.random.get_rng_state()
    a1, v1 = sample_anchors(tokens, mask, 8)
    assert torch.equal(torch.random.get_rng_state(), state)  # no global RNG touched
    a2, v2 = sample_anchors(tokens.clone(), mask.clone(), 8)
    assert torch.equal(a1, a2) and torch.equal(v1, v2)
    assert v1[:3].all() and not v1[3].any()
    assert ((a1[:3] >= 9) & (a1[:3] <= 23)).all()  # next token generated
    assert all(len(set(r.tolist())) == 8 for r in a1[:3])  # distinct while enough candidates
    # the same row content gives the same anchors in any batch (micro-batches, ranks); other content differs
    a_row, _ = sample_anchors(tokens[1:2], mask[1:2], 8)
    assert torch.equal(a_row[0], a1[1])
    assert not torch.equal(a1[0], a1[1])
    # fewer candidates than anchors: sampled with replacement, all candidates used
    few = torch.zeros(1, 30, dtype=torch.bool)
    few[0, 5:8] = True
    a, v = sample_anchors(tokens[:1], few, 7)
    assert set(a[0].tolist()) == {4, 5, 6} and v.all()


def test_slot_validity_prefix_contiguous():
    mask = torch.tensor([[0, 1, 1, 0, 1, 1, 1, 1]], dtype=torch.bool)
    anchors = torch.tensor([[0, 3, 6]])
    v = slot_validity(mask, anchors, torch.ones(1, 3, dtype=torch.bool), gamma=3)
    # anchor 0: labels 1, 2, 3(off) -> 1 1 0; anchor 3: 4, 5, 6 -> 1 1 1; anchor 6: 7, 8(out) -> 1 0 0
    assert v.tolist() == [[[1, 1, 0], [1, 1, 1], [1, 0, 0]]]
    mask2 = mask.clone()
    mask2[0, 2] = False  # a gap in the middle stops the block there, later slots too
    v2 = slot_validity(mask2, anchors[:, :1], torch.ones(1, 1, dtype=torch.bool), gamma=3)
    assert v2.tolist() == [[[1, 0, 0]]]


def test_dspark_metrics_hand_computation():
    # one row, two blocks, γ = 3; acceptance a, validity v (prefix-contiguous)
    a = torch.tensor([[[0.5, 0.8, 0.25], [0.9, 0.1, 0.7]]], dtype=torch.float64)
    v = torch.tensor([[[1, 1, 1], [1, 1, 0]]], dtype=torch.float64)
    agree = torch.tensor([[[1, 0, 1], [1, 1, 1]]], dtype=torch.float64)
    conf = torch.tensor([[[0.4, 0.8, 0.5], [1.0, 0.3, 0.0]]], dtype=torch.float64)
    err = (conf - a).abs()
    ce = torch.ones_like(a)
    m = BlockStats.of(v, agree, a, err, ce).metrics()
    # τ = 1 + mean over blocks of Σ_j Π_{i<=j} a_i (valid slots only)
    tau = 1 + ((0.5 + 0.5 * 0.8 + 0.5 * 0.8 * 0.25) + (0.9 + 0.9 * 0.1)) / 2
    assert abs(float(m["draft/tau_prob"]) - tau) < 1e-12
    assert abs(float(m["draft/accept_slot0"]) - 0.7) < 1e-12
    assert abs(float(m["draft/accept_slot1"]) - 0.45) < 1e-12
    assert abs(float(m["draft/accept_slot2"]) - 0.25) < 1e-12
    assert abs(float(m["draft/conf_err"]) - (0.1 + 0.0 + 0.25 + 0.1 + 0.2) / 5) < 1e-12
    assert abs(float(m["draft/sim_accept_len"]) - (1 + (1 + 0 + 0 + 1 + 1) / 2)) < 1e-12


def _setup(kind, gamma=3, N=4, seed=0):
    torch.manual_seed(seed)
    pc = PolicyConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_layers=4, num_heads=4,
                      num_kv_heads=2, head_dim=4)
    cfg = BlockDraftConfig.for_policy(pc, kind, gamma=gamma, mask_id=39, num_layers=1, markov_rank=3,
                                      num_anchors=N)
    d = BlockDraft(cfg).double()
    if kind == "dspark":
        torch.nn.init.normal_(d.markov_w2.weight, std=0.1)
    B, S, h, k = 2, 14, 16, len(cfg.aux_layer_ids)
    g = torch.Generator().manual_seed(seed + 1)
    x = dict(aux=torch.randn(B, S, k * h, generator=g, dtype=torch.float64),
             embed=torch.randn(B, S, h, generator=g, dtype=torch.float64),
             policy_logits=torch.randn(B, S, 40, generator=g, dtype=torch.float64),
             tokens=torch.randint(0, 39, (B, S), generator=g),
             target_mask=torch.arange(S).expand(B, S) >= 4,
             positions=torch.arange(S).expand(B, S),
             head_weight=torch.randn(40, h, generator=g, dtype=torch.float64),
             mask_emb=torch.randn(h, generator=g, dtype=torch.float64))
    return d, x


def _hand_loss(d, x):
    """The loss written out per anchor and slot with explicit loops."""
    from specco.train.block_losses import block_targets
    c = d.cfg
    anchors, av = sample_anchors(x["tokens"], x["target_mask"], c.num_anchors)
    valid = slot_validity(x["target_mask"], anchors, av, c.gamma)
    at, lab = block_targets(x["tokens"], anchors, c.gamma)
    emb = x["embed"].gather(1, anchors[..., None].expand(-1, -1, 16))
    hid = d.predicting(d(x["aux"], emb, x["mask_emb"], x["positions"], d.block_positions(x["positions"], anchors)))
    w = slot_weights(c)
    num, den = 0.0, 0.0
    B, N = anchors.shape
    for b in range(B):
        for n in range(N):
            for j in range(c.gamma):
                T = x["policy_logits"][b, at[b, n, j]]
                prev = x["tokens"][b, at[b, n, j]]
                z = hid[b, n, j] @ x["head_weight"].T
                if c.kind == "dspark":
                    z = z + d.markov_w2(d.markov_w1(prev))
                p, q = T.softmax(-1), z.softmax(-1)
                if c.kind == "dflash":
                    ell = -(p * z.log_softmax(-1)).sum()
                else:
                    acc = (1 - (p - q).abs().sum() / 2).clamp(0, 1).detach()
                    conf = d.confidence(torch.cat([hid[b, n, j], d.markov_w1(prev)]))[0]
                    ell = (-0.1 * z.log_softmax(-1)[x["tokens"][b, lab[b, n, j]]] + 0.9 * (p - q).abs().sum()
                           + F.binary_cross_entropy_with_logits(conf, acc))
                num = num + w[j] * float(valid[b, n, j]) * ell
                den += w[j] * float(valid[b, n, j])
    return num / den


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_loss_and_grads_match_hand_computation(kind):
    d, x = _setup(kind)
    loss, stats = block_draft_loss(d, **x, chunk=3)  # chunk 3 of N = 4 anchors: two chunks, checkpointed
    ref = _hand_loss(d, x)
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-12)
    params = [p for p in d.parameters()]
    g = torch.autograd.grad(loss, params, allow_unused=True)
    g_ref = torch.autograd.grad(ref, params, allow_unused=True)
    for a, b in zip(g, g_ref):
        if b is None:
            assert a is None or a.abs().max() == 0
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert float(stats.count.sum()) == float(block_slot_counts(d, x["tokens"], x["target_mask"]).sum()) > 0
    m = stats.metrics()
    assert 1.0 <= float(m["draft/tau_prob"]) <= 1.0 + d.cfg.gamma
