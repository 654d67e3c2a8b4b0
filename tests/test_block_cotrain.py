"""DFlash / DSpark inside the one co-training step: micro-batching exact, the policy untouched by the draft."""
import pytest
import torch

from specco.model.config import PolicyConfig
from specco.model.dflash import BlockDraft, BlockDraftConfig
from specco.model.policy import Policy
from specco.train.cotrain import StepConfig, TrainBatch, build_optimizer, cotrain_step
from cli_helpers import DEMO  # noqa: E402


def _models(kind, seed=0):
    torch.manual_seed(seed)
    pc = PolicyConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=5, num_heads=4, num_kv_heads=2)
    policy = Policy(pc).double()
    draft = BlockDraft(BlockDraftConfig.for_policy(pc, kind, gamma=3, mask_id=60, num_layers=2, num_anchors=5,
                                                   markov_rank=4)).double()
    if kind == "dspark":  # away from the zero init so the Markov head's gradient path is exercised
        torch.nn.init.normal_(draft.markov_w2.weight, std=0.1)
    return policy, draft


def _batch(B=6, S=14, V=60, seed=5):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (B, S), generator=g)
    mask = torch.zeros(B, S)
    mask[:, 5:] = 1
    mask[2] = 0  # a row with nothing to train on
    for b, L in enumerate((10, 14, 9, 8, 12, 11)[:B]):  # ragged rows: micro-batches get trimmed
        mask[b, L:] = 0
        tokens[b, L:] = 0
    return TrainBatch(tokens=tokens, target_mask=mask, advantages=torch.randn(B, generator=g),
                      logp_old=-torch.rand(B, S, generator=g) * 3)


@pytest.mark.e2e
@pytest.mark.parametrize("kind", ["dflash", "dspark"])
@pytest.mark.parametrize("stride,micro,width", [(1, 4, 1), (2, 3, 1), (2, 3, 5), (1, 2, 4)])
def test_block_draft_microbatched_step_equals_full_batch(kind, stride, micro, width):
    """Also with widths rounded up (width_multiple): padded columns past a row's end change nothing."""
    batch = _batch()
    res = []
    for mb in (0, micro):
        policy, draft = _models(kind)
        opt = build_optimizer(policy, draft, 1e-3, 1e-2)
        cfg = StepConfig(draft_row_stride=stride, micro_batch_rows=mb, width_multiple=width, policy_grad_clip=1e9,
                         draft_grad_clip=1e9)
        m = cotrain_step(policy, draft, batch, opt, None, cfg)
        res.append((m, [p.grad.clone() for p in policy.parameters()],
                    [p.grad.clone() for p in draft.parameters() if p.grad is not None]))
    (m0, gp0, gd0), (m1, gp1, gd1) = res
    assert len(gd0) == len(gd1) > 0
    for a, b in zip(gp0 + gd0, gp1 + gd1):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    for k in ("draft/loss", "draft/tokens", "draft/tau_prob", "draft/accept_slot0", "draft/accept_slot2",
              "draft/conf_err", "draft/sim_accept_len", "draft/grad_norm"):
        assert abs(m0[k] - m1[k]) <= 1e-9 * max(1.0, abs(m0[k])), (k, m0[k], m1[k])
    assert m0["draft/tokens"] > 0 and 1.0 <= m0["draft/tau_prob"] <= 4.0


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_policy_grads_identical_for_any_lambda(kind):
    """The draft reads the policy's head, embeddings, taps and logits detached: the policy gradient is the same
    for any draft weight, and the draft (own group) learns."""
    batch = _batch()
    grads = []
    for lam in (0.0, 1.0, 7.5):
        policy, draft = _models(kind)
        opt = build_optimizer(policy, draft, 0.0, 1e-2)  # policy LR 0: its grads stay comparable
        before = [p.detach().clone() for p in draft.parameters()]
        cfg = StepConfig(draft_weight=lam, policy_grad_clip=1e9, draft_grad_clip=1e9, draft_row_stride=1)
        cotrain_step(policy, draft, batch, opt, None, cfg)
        grads.append([p.grad.clone() for p in policy.parameters()])
        moved = any((a - p).abs().max() > 0 for a, p in zip(before, draft.parameters()))
        assert moved == (lam > 0)
    for g in grads[1:]:
        for a, b in zip(grads[0], g):
            assert torch.equal(a, b)


def test_draft_kind_validated_and_block_draft_needs_gamma():
    """draft.kind is validated by the config; a new block drafter needs its γ (rollout.k) from the runner."""
    from specco.config import DraftSpec
    from specco.runner.warmstart import initial_draft
    with pytest.raises(ValueError):
        DraftSpec(kind="medusa")
    policy, _ = _models("dflash")
    with pytest.raises(ValueError, match="gamma"):
        initial_draft(policy, torch.zeros(2, 3, dtype=torch.long), DraftSpec(kind="dflash"))


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_frozen_block_draft_eval_in_micro_batches_equals_one_forward(kind):
    from specco.runner.measure import draft_eval
    policy, draft = _models(kind)
    batch = _batch()
    ref = draft_eval(policy, draft, batch, StepConfig(draft_row_stride=2))
    got = draft_eval(policy, draft, batch, StepConfig(draft_row_stride=2, micro_batch_rows=2))
    assert ref.keys() == got.keys() and ref["draft/tokens"] > 0
    for k in ref:
        assert abs(ref[k] - got[k]) <= 1e-9 * max(1.0, abs(ref[k])), (k, ref[k], got[k])


def test_block_layers_and_anchors_from_the_config(tmp_path):
    """draft.block_layers / draft.num_anchors reach a new block drafter (0 keeps 1 layer and 16 anchors); with
    draft.init they must be 0 or match the loaded drafter, and a mismatch is refused by name."""
    from specco.config_load import load_config
    from specco.model.config import ConfigError
    from specco.runner.warmstart import initial_draft
    policy, _ = _models("dflash")
    policy = policy.float()
    tokens = torch.randint(0, policy.cfg.vocab_size - 2, (4, 8))
    spec = load_config(DEMO, ["draft.kind=dflash", "draft.block_layers=2", "draft.num_anchors=40"]).draft
    d = initial_draft(policy, tokens, spec, gamma=3)
    assert (d.cfg.num_layers, d.cfg.num_anchors, len(d.layers)) == (2, 40, 2)
    plain = initial_draft(policy, tokens, load_config(DEMO, ["draft.kind=dflash"]).draft, gamma=3)
    assert (plain.cfg.num_layers, plain.cfg.num_anchors) == (1, 16)
    d.save(tmp_path / "d")
    same = load_config(DEMO, ["draft.kind=dflash", f"draft.init={tmp_path / 'd'}", "draft.block_layers=2"]).draft
    assert initial_draft(policy, tokens, same, gamma=3).cfg.num_layers == 2
    other = load_config(DEMO, ["draft.kind=dflash", f"draft.init={tmp_path / 'd'}", "draft.num_anchors=8"]).draft
    with pytest.raises(ConfigError, match="draft.num_anchors=8"):
        initial_draft(policy, tokens, other, gamma=3)
    with pytest.raises(ConfigError, match="block_layers"):
        load_config(DEMO, ["draft.block_layers=-1"])
