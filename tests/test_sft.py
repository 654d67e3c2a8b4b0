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
