"""DFlash / DSpark models: shapes, ownership, and the block semantics seen from outside."""
import pytest
import torch

from specco.model.config import PolicyConfig
from specco.model.dflash import BlockDraft, BlockDraftConfig, slot_weight_decay, slot_weights


def _cfg(kind, gamma=3, layers=2):
    pc = PolicyConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                      num_kv_heads=2, head_dim=8)
    return BlockDraftConfig.for_policy(pc, kind, gamma=gamma, mask_id=49, num_layers=layers, markov_rank=5)


def _inputs(cfg, B=2, S=12, N=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    h, k = cfg.hidden_size, len(cfg.aux_layer_ids)
    taps = torch.randn(B, S, k * h, generator=g)
    emb = torch.randn(B, S, h, generator=g)
    anchors = torch.randint(0, S, (B, N), generator=g)
    return taps, emb, anchors


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_shapes_and_owned_parameters(kind):
    cfg = _cfg(kind)
    d = BlockDraft(cfg)
    assert cfg.block_size == (4 if kind == "dflash" else 3)
    names = {n for n, _ in d.named_parameters()}
    assert not any("lm_head" in n or "embed" in n for n in names)  # head and mask embedding are the policy's
    assert ("markov_w1.weight" in names) == (kind == "dspark")
    taps, emb, anchors = _inputs(cfg)
    pos = torch.arange(12).expand(2, 12)
    slot_pos = d.block_positions(pos, anchors)
    hid = d(taps, emb.gather(1, anchors[..., None].expand(-1, -1, 32)), emb[0, 0], pos, slot_pos)
    assert hid.shape == (2, 3, cfg.block_size, 32)
    pred = d.predicting(hid)
    assert pred.shape == (2, 3, cfg.gamma, 32)
    head = torch.randn(50, 32, requires_grad=True)
    z = d.logits(pred, head, torch.zeros(2, 3, cfg.gamma, dtype=torch.long))
    assert z.shape == (2, 3, cfg.gamma, 50)
    z.sum().backward()
    assert head.grad is None  # the live head is read detached


def test_dspark_markov_head_starts_at_zero():
    d = BlockDraft(_cfg("dspark"))
    hid = torch.randn(2, 3, 32)
    prev = torch.randint(0, 50, (2, 3))
    head = torch.randn(50, 32)
    torch.testing.assert_close(d.logits(hid, head, prev), hid @ head.T, rtol=0, atol=1e-6)
    assert d.confidence_logit(hid, prev).shape == (2, 3)


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_block_sees_only_trunk_before_anchor(kind):
    """Changing taps at positions >= anchor leaves the block unchanged; changing one before it does not;
    blocks are independent of each other (a block's output does not depend on which others are run)."""
    cfg = _cfg(kind)
    d = BlockDraft(cfg).double()
    taps, emb, _ = _inputs(cfg, B=1, S=12)
    taps, emb = taps.double(), emb.double()
    pos = torch.arange(12)[None]
    anchors = torch.tensor([[6, 2]])
    run = lambda t, a: d(t, emb[:, a[0]], emb[0, 0], pos, d.block_positions(pos, a))  # noqa: E731
    base = run(taps, anchors)
    later = taps.clone()
    later[:, 6:] += 1.0
    torch.testing.assert_close(run(later, anchors)[:, 0], base[:, 0], rtol=0, atol=1e-12)
    earlier = taps.clone()
    earlier[:, 5] += 1.0
    assert (run(earlier, anchors)[:, 0] - base[:, 0]).abs().max() > 1e-6
    torch.testing.assert_close(run(taps, anchors[:, 1:])[:, 0], base[:, 1], rtol=0, atol=1e-12)


def test_slot_weights():
    assert [slot_weight_decay(w) for w in (8, 10, 16)] == [4.0, 5.0, 7.0]
    assert slot_weight_decay(9) == 4.5 and slot_weight_decay(13) == 6.0 and slot_weight_decay(2) == 1.0
    w = slot_weights(_cfg("dflash", gamma=7))  # W = 8: γ_d = 4
    assert w[0] == 1.0 and abs(w[4] - 0.36787944117144233) < 1e-15


def test_config_validation():
    with pytest.raises(ValueError):
        _cfg("eagle3")
    with pytest.raises(ValueError):
        BlockDraftConfig.for_policy(PolicyConfig(vocab_size=50, hidden_size=32, intermediate_size=64,
                                                 num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8),
                                    "dflash", gamma=3, mask_id=50)
