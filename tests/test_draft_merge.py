"""The draft's rows of every micro-batch merged into one draft call (train/draft_rows.py): the padding is inert,
the step runs the draft once, and its update equals one draft call per micro-batch (fp64, to 1e-9 relative:
only the summation order differs)."""
import pytest
import torch

import specco.train.cotrain as cotrain
from specco.model.config import DraftConfig, PolicyConfig
from specco.model.dflash import BlockDraft, BlockDraftConfig
from specco.model.draft import Eagle3Draft
from specco.model.policy import Policy
from specco.train.cotrain import StepConfig, TrainBatch, build_optimizer, cotrain_step
from specco.train.draft_rows import DraftRows, merge_rows


def _models(kind):
    torch.manual_seed(0)
    pc = PolicyConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=5, num_heads=4, num_kv_heads=2)
    policy = Policy(pc).double()
    if kind == "eagle3":
        draft = Eagle3Draft(DraftConfig.for_policy(pc))
    else:
        draft = BlockDraft(BlockDraftConfig.for_policy(pc, kind, gamma=3, mask_id=60, num_layers=2, num_anchors=5))
    with torch.no_grad():  # away from the init so attention is far from uniform and errors would show
        for p in draft.parameters():
            if p.dim() == 2:
                p.add_(torch.randn_like(p) * 0.3)
    return policy, draft.double()


def _batch(lengths=(16, 9, 13, 7, 12, 15, 8, 11, 10, 14)):
    g = torch.Generator().manual_seed(3)
    B, S = len(lengths), max(lengths)
    tokens = torch.randint(0, 60, (B, S), generator=g)
    mask = torch.zeros(B, S)
    mask[:, 4:] = 1
    for b, L in enumerate(lengths):  # ragged rows: every micro-batch its own width
        mask[b, L:] = 0
        tokens[b, L:] = 0
    return TrainBatch(tokens=tokens, target_mask=mask, advantages=torch.randn(B, generator=g),
                      logp_old=-torch.rand(B, S, generator=g) * 3)


def test_merge_pads_with_inert_columns_and_counts_positions_on():
    a = DraftRows(torch.ones(2, 3, 6), torch.ones(2, 3, 2), torch.ones(2, 3, 5), torch.full((2, 3), 7),
                  torch.ones(2, 3), torch.arange(3).expand(2, 3) + 10)
    b = DraftRows(torch.ones(1, 5, 6) * 2, torch.ones(1, 5, 2), torch.ones(1, 5, 5), torch.full((1, 5), 8),
                  torch.ones(1, 5), torch.arange(5)[None])
    m = merge_rows([a, b])
    assert m.aux.shape == (3, 5, 6) and m.logits.shape == (3, 5, 5) and m.tokens.shape == (3, 5)
    assert torch.equal(m.aux[:2, :3], a.aux) and torch.equal(m.aux[2], b.aux[0])
    assert m.aux[:2, 3:].abs().sum() == 0 and m.logits[:2, 3:].abs().sum() == 0 and m.tokens[:2, 3:].sum() == 0
    assert torch.equal(m.mask[:2], torch.tensor([[1., 1, 1, 0, 0]] * 2))  # nothing trained in the padding
    assert torch.equal(m.positions[0], torch.tensor([10, 11, 12, 13, 14]))
    assert merge_rows([a]) is a
    c = a.detached_copy()
    assert torch.equal(c.aux, a.aux) and c.aux.data_ptr() != a.aux.data_ptr()


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
@pytest.mark.parametrize("stride,micro,width", [(2, 3, 1), (1, 4, 5), (3, 2, 1)])
def test_one_merged_draft_call_equals_one_per_micro_batch(monkeypatch, kind, stride, micro, width):
    calls = []  # the (rows, width) of every draft call
    eagle, block = cotrain.rows_draft_loss, cotrain.rows_block_loss

    def eagle_call(draft, r, *a):
        calls.append(tuple(r.tokens.shape))
        return eagle(draft, r, *a)

    def block_call(draft, policy, r, *a):
        calls.append(tuple(r.tokens.shape))
        return block(draft, policy, r, *a)

    monkeypatch.setattr(cotrain, "rows_draft_loss", eagle_call)
    monkeypatch.setattr(cotrain, "rows_block_loss", block_call)
    res = []
    for merge_bytes in (cotrain.MERGE_BYTES, 0):  # 0: every micro-batch's rows flushed at once: one call each
        monkeypatch.setattr(cotrain, "MERGE_BYTES", merge_bytes)
        calls.clear()
        policy, draft = _models(kind)
        opt = build_optimizer(policy, draft, 1e-3, 1e-2)
        cfg = StepConfig(draft_row_stride=stride, micro_batch_rows=micro, width_multiple=width, policy_grad_clip=1e9,
                         draft_grad_clip=1e9)
        m = cotrain_step(policy, draft, _batch(), opt, None, cfg)
        res.append((m, [p.grad.clone() for p in (*policy.parameters(), *draft.parameters()) if p.grad is not None],
                    list(calls)))
    (m0, g0, calls0), (m1, g1, calls1) = res
    n_micro = -(-len(_batch().tokens) // micro)
    assert len(calls0) == 1 and 1 < len(calls1) <= n_micro  # merged: one draft call; else one per micro-batch
    assert calls0[0][0] == sum(s[0] for s in calls1)  # the same rows
    assert len(g0) == len(g1)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    for k in m0:
        if k.startswith("draft/") and k != "draft/lr":
            assert abs(m0[k] - m1[k]) <= 1e-9 * max(1.0, abs(m0[k])), (k, m0[k], m1[k])
    assert m0["draft/tokens"] > 0
