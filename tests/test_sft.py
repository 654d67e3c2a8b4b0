"""SFT lowers the completion loss of a tiny from-scratch policy; the loss masks prompt tokens."""
import pytest
import torch

pytest.importorskip("reasoning_gym")

from specco.data.tasks import get_task  # noqa: E402
from specco.data.tokenizer import build_char_tokenizer  # noqa: E402
from specco.model.policy import Policy  # noqa: E402
from specco.train.sft import (evaluate, sft, sft_batch, sft_loss, tiny_policy_config,  # noqa: E402
                              warmup_cosine)


def _setup():
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    task = get_task("chain_sum")
    pol = Policy(tiny_policy_config(tok, hidden_size=64, num_layers=2, num_heads=4,
                                    num_kv_heads=2, intermediate_size=128))
    return tok, task, pol


def test_sft_batch_masks_prompt():
    tok, task, _ = _setup()
    items = task.prompts(4, seed=0)
    ids, mask = sft_batch(task, tok, items)
    for b, it in enumerate(items):
        p = task.prompt_ids(it, tok)
        c = task.completion_ids(it, tok)
        assert ids[b, :len(p) + len(c)].tolist() == p + c
        # targets at masked input positions are exactly the completion (answer + <eos>)
        targets = ids[b, 1:][mask[b, :-1].bool()].tolist()
        assert targets == c and c[-1] == tok.eos_id
        assert ids[b, len(p) + len(c):].eq(tok.pad_id).all()


def test_sft_lowers_loss():
    tok, task, pol = _setup()
    probe = sft_batch(task, tok, task.prompts(64, seed=1))
    with torch.no_grad():
        before = sft_loss(pol, *probe).item()
    m = sft(pol, tok, task, steps=40, batch_size=32, lr=3e-3, seed=0, progress=False)
    with torch.no_grad():
        after = sft_loss(pol, *probe).item()
    assert m["offset"] == 40 * 32  # the data position a resumed run continues from
    assert after < 0.7 * before, (before, after)
    assert m["loss_last"] < m["loss_first"]
    ev = evaluate(pol, tok, task, n=16, temperature=1.0)
    assert 0.0 <= ev["accuracy"] <= 1.0 and ev["n"] == 16


def test_warmup_cosine_shape():
    assert warmup_cosine(0, 100, 10) == pytest.approx(0.1)
    assert warmup_cosine(9, 100, 10) == pytest.approx(1.0)
    assert warmup_cosine(100, 100, 10) == pytest.approx(0.1)
    assert 0.1 < warmup_cosine(55, 100, 10) < 1.0


def test_sft_micro_batches_equal_the_whole_batch():
    """Rows longest first, cut to their own length, gradients accumulated: the whole batch's mean-loss
    gradient (fp64, rewrite-mode references from 4 to 16 terms, so the rows are ragged)."""
    from specco.train.sft import sft_micro_batches
    tok, _, pol = _setup()
    pol = pol.double()
    task = get_task("chain_sum", mode="rewrite", cot_fraction=0.5, min_terms=4, max_terms=16)
    ids, mask = sft_batch(task, tok, task.prompts(7, seed=3))
    lengths = [int(m.nonzero().max()) + 2 for m in mask]
    assert len(set(lengths)) > 2  # ragged
    pol.zero_grad()
    whole = sft_loss(pol, ids, mask)
    whole.backward()
    ref = [p.grad.clone() for p in pol.parameters()]
    pol.zero_grad()
    n = mask[:, :-1].sum()
    total = 0.0
    for mb_ids, mb_mask in sft_micro_batches(ids, mask, 3):
        assert mb_ids.shape[1] == max(int(m.nonzero().max()) + 2 for m in mb_mask)  # cut to its longest row
        part = sft_loss(pol, mb_ids, mb_mask, n)
        part.backward()
        total += part.item()
    # sft_loss takes fp32 logits even from an fp64 model, so sums over other partitions differ at fp32
    # rounding (seen: 8e-8 relative); a wrong cut or a wrong normaliser is off by far more
    assert abs(total - whole.item()) < 1e-6 * whole.item()
    for a, p in zip(ref, pol.parameters()):
        torch.testing.assert_close(p.grad, a, rtol=1e-5, atol=1e-7)
    assert next(sft_micro_batches(ids, mask, 0))[0] is ids
