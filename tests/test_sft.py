"""SFT lowers the completion loss of a tiny from-scratch policy; the loss masks prompt tokens."""
import pytest
import torch

pytest.importorskip("reasoning_gym")

from specco.data.config import DataSpec  # noqa: E402
from specco.data.source import load_data, reference_ids  # noqa: E402
from specco.data.tokenizer import build_char_tokenizer  # noqa: E402
from specco.model.policy import Policy  # noqa: E402
from specco.train.sft import sft, sft_batch, sft_loss, tiny_policy_config, warmup_cosine  # noqa: E402

# chain_sum's easy preset, as configs/demo.toml's [data] options spell it
EASY = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1, "allow_negation": False}


def _source(tok, **spec):
    spec = {"format": "compact", "options": EASY, **spec}
    return load_data(DataSpec(**spec), tok, need_reference=True)[0]


def _setup():
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    pol = Policy(tiny_policy_config(tok, hidden_size=64, num_layers=2, num_heads=4,
                                    num_kv_heads=2, intermediate_size=128))
    return tok, _source(tok), pol


def test_sft_batch_masks_prompt():
    tok, source, _ = _setup()
    items = source.examples(4, seed=0)
    ids, mask = sft_batch(items, tok)
    for b, it in enumerate(items):
        p = it.prompt_ids
        c = reference_ids(it, tok)
        assert ids[b, :len(p) + len(c)].tolist() == p + c
        # targets at masked input positions are exactly the completion (answer + <eos>)
        targets = ids[b, 1:][mask[b, :-1].bool()].tolist()
        assert targets == c and c[-1] == tok.eos_id
        assert ids[b, len(p) + len(c):].eq(tok.pad_id).all()


@pytest.mark.e2e
def test_sft_lowers_loss():
    tok, source, pol = _setup()
    probe = sft_batch(source.examples(64, seed=1), tok)
    with torch.no_grad():
        before = sft_loss(pol, *probe).item()
    m = sft(pol, tok, source, steps=40, batch_size=32, lr=3e-3, seed=0, progress=False)
    with torch.no_grad():
        after = sft_loss(pol, *probe).item()
    assert m["offset"] == 40 * 32  # the data position a resumed run continues from
    assert after < 0.7 * before, (before, after)
    assert m["loss_last"] < m["loss_first"]


def test_warmup_cosine_shape():
    assert warmup_cosine(0, 100, 10) == pytest.approx(0.1)
    assert warmup_cosine(9, 100, 10) == pytest.approx(1.0)
    assert warmup_cosine(100, 100, 10) == pytest.approx(0.1)
    assert 0.1 < warmup_cosine(55, 100, 10) < 1.0


@pytest.mark.e2e
def test_sft_micro_batches_equal_the_whole_batch():
    """Rows longest first, cut to their own length, gradients accumulated: the whole batch's mean-loss
    gradient (fp64, rewrite-mode references from 4 to 16 terms, so the rows are ragged)."""
    from specco.train.sft import sft_micro_batches
    tok, _, pol = _setup()
    pol = pol.double()
    source = _source(tok, format="rewrite", cot_fraction=0.5, options={**EASY, "min_terms": 4, "max_terms": 16})
    ids, mask = sft_batch(source.examples(7, seed=3), tok)
    lengths = [int(m.nonzero().max()) + 2 for m in mask]
    assert len(set(lengths)) > 2  # ragged
    pol.zero_grad()
    whole = sft_loss(pol, ids, mask)
    whole.backward()
    ref = [p.grad.clone() for p in pol.parameters()]
    n = mask[:, :-1].sum()

    def accumulated(batches, check) -> None:
        """Each micro-batch's loss (normalised by the whole batch's count) backpropagated, check(mb) on each: their
        sum and the accumulated gradients must equal the whole batch's."""
        pol.zero_grad()
        total = 0.0
        for mb_ids, mb_mask, first in batches:
            check(mb_ids, mb_mask, first)
            part = sft_loss(pol, mb_ids, mb_mask, n, logits_from=first)
            part.backward()
            total += part.item()
        # sft_loss takes fp32 logits even from an fp64 model, so sums over other partitions differ at fp32
        # rounding (seen: 8e-8 relative); a wrong cut or a wrong normaliser is off by far more
        assert abs(total - whole.item()) < 1e-6 * whole.item()
        for a, p in zip(ref, pol.parameters()):
            torch.testing.assert_close(p.grad, a, rtol=1e-5, atol=1e-7)

    longest = lambda mb_mask: max(int(m.nonzero().max()) + 2 for m in mb_mask)  # noqa: E731
    firsts = []

    def cut(mb_ids, mb_mask, first):
        assert mb_ids.shape[1] == longest(mb_mask)  # cut to its longest row
        assert first == int(mb_mask.nonzero()[:, 1].min())  # the logits start at the first marked column
        firsts.append(first)

    accumulated(sft_micro_batches(ids, mask, 3), cut)
    assert next(sft_micro_batches(ids, mask, 0))[0] is ids
    assert max(firsts) > 0  # the prompts' logits were really skipped

    # widths rounded up to a multiple of 8 (sft.width_multiple): padding columns change no gradient
    for rows in (3, 0):
        def rounded(mb_ids, mb_mask, first):
            assert mb_ids.shape[1] % 8 == 0 and mb_mask.shape == mb_ids.shape
            assert mb_ids.shape[1] - 8 < (longest(mb_mask) if rows else ids.shape[1])
        accumulated(sft_micro_batches(ids, mask, rows, 8), rounded)
