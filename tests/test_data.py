"""Procedural streams, their formats and scoring, and the char-level tokenizer (specco.data).

Streams must be deterministic and resumable by offset (a resumed run continues the same data);
rewards come from reasoning_gym's own scorer; the tokenizer saved next to a model must give the
same ids through transformers as through specco.
"""
import pytest

pytest.importorskip("reasoning_gym")

from specco.data.config import DataSpec  # noqa: E402
from specco.data.procedural import reasoning_gym_score, rewrite_steps, shows_steps, worked_steps  # noqa: E402
from specco.data.source import load_data, reference_ids  # noqa: E402
from specco.data.tokenizer import build_char_tokenizer, load_tokenizer  # noqa: E402
from specco.model.config import ConfigError  # noqa: E402
from specco.rewards.extract import extract_answer  # noqa: E402

# What a ~0.3M-parameter model learns in about a minute on two CPU cores (reasoning_gym arguments)
CHAIN = dict(min_terms=2, max_terms=3, min_digits=1, max_digits=1, allow_negation=False)
ARITH = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=("+", "-", "*"),
             allow_parentheses=False, allow_negation=False, whitespace="no_space")
PRESETS = {"chain_sum": CHAIN, "basic_arithmetic": ARITH}


def stream(name="chain_sum", format="compact", cot_fraction=1.0, tok=None, **options):
    """The training source of reasoning_gym dataset `name` in a format (its preset, updated by `options`)."""
    spec = DataSpec(source=f"reasoning_gym:{name}", format=format, options={**PRESETS[name], **options},
                    cot_fraction=cot_fraction)
    return load_data(spec, tok or build_char_tokenizer())[0]


def score(text: str, ex, options=CHAIN) -> float:
    return reasoning_gym_score(text, ex.columns, options)


@pytest.mark.parametrize("name", ["chain_sum", "basic_arithmetic"])
def test_stream_deterministic_and_resumable(name):
    src = stream(name)
    full = src.examples(40, seed=3)
    again = stream(name).examples(40, seed=3)  # a fresh source: no hidden state
    resumed = src.examples(15, seed=3, offset=25)
    assert [e.prompt for e in full] == [e.prompt for e in again]
    assert [(e.index, e.prompt, e.answer) for e in full[25:]] == [(e.index, e.prompt, e.answer) for e in resumed]
    # Different seeds are different streams, not shifted copies (reasoning_gym seeds Random(seed+idx)).
    other = src.examples(41, seed=4)
    assert [e.prompt for e in other[:40]] != [e.prompt for e in full]
    assert [e.prompt for e in other[1:]] != [e.prompt for e in full]


def test_compact_prompt_format():
    for ex in stream().examples(50, seed=0):
        assert ex.prompt.endswith("=") and " " not in ex.prompt
        assert ex.reference == ex.answer
        assert eval(ex.prompt[:-1]) == int(ex.answer)  # the compact prompt is the same problem
        assert 2 <= ex.columns["metadata"]["num_terms"] <= 3  # the preset's max_terms reached the generator


def test_score_right_and_wrong():
    for ex in stream().examples(20, seed=0):
        assert score(ex.answer, ex) == 1.0
        assert score(f" {ex.answer} ", ex) == 1.0
        wrong = str(int(ex.answer) + 1)
        if ex.answer not in wrong:  # reasoning_gym gives partial credit to superstrings
            assert score(wrong, ex) == 0.0
        assert score("", ex) == 0.0
        assert score("abc", ex) == 0.0


def test_bad_stream_config_is_loud():
    with pytest.raises(ConfigError, match="rejected options"):
        stream(max_terms=1, min_terms=2)
    with pytest.raises(ConfigError, match="data.format='verbose'"):
        DataSpec(source="reasoning_gym:chain_sum", format="verbose")


def test_tokenizer_roundtrip_and_transformers_parity(tmp_path):
    tok = build_char_tokenizer()
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    texts = ["4-1-7=", "-12", "Calculate 10 + 8.\n<answer>18</answer>", "(3*4)/2 = 6"]
    for t in texts:
        ids = tok.encode(t)
        assert len(ids) == len(t)  # one id per character
        assert tok.decode(ids) == t
        assert tok.encode(t, add_bos=True) == [tok.bos_id] + ids
        assert tok.decode([tok.bos_id] + ids + [tok.eos_id]) == t  # specials dropped
    tok.save(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert [loaded.encode(t) for t in texts] == [tok.encode(t) for t in texts]
    assert (loaded.pad_id, loaded.bos_id, loaded.eos_id) == (0, 1, 2)

    transformers = pytest.importorskip("transformers")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for t in texts:
        assert fast.encode(t, add_special_tokens=False) == tok.encode(t)
        assert fast.encode(t) == tok.encode(t, add_bos=True)  # post-processor prepends <bos>
        assert auto.encode(t) == tok.encode(t, add_bos=True)
    assert (auto.pad_token_id, auto.bos_token_id, auto.eos_token_id) == (0, 1, 2)


def test_chat_format_prompt_and_answer_extraction(tmp_path):
    """The chat format (pretrained policies): reasoning_gym's question in the chat template under its default
    system prompt, the answer read from <answer> tags. The char tokenizer with a toy template (no download)."""
    pytest.importorskip("transformers")
    tok = build_char_tokenizer()
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    tok.save(tmp_path)
    tok = load_tokenizer(tmp_path)
    ex = stream(format="chat", tok=tok).examples(1, seed=0)[0]
    text = tok.decode(ex.prompt_ids)
    assert ex.columns["question"] in text and text.endswith("<assistant>")
    assert "<answer>" in text  # reasoning_gym's default system prompt asks for the tags
    assert ex.prompt_ids[0] != tok.bos_id  # the template owns the special tokens
    assert score(f"thinking... <answer>{ex.answer}</answer>", ex) == 1.0
    assert score(ex.answer, ex) == 0.0  # no tags, no answer
    assert ex.reference == f"<answer>{ex.answer}</answer>"


def test_cot_format_worked_steps_and_scoring():
    assert worked_steps("4 - 1 - 7") == "4-1=3,3-7=-4>-4"
    assert worked_steps("9 + 9") == "9+9=18>18"
    with pytest.raises(ValueError, match="cot mode"):
        worked_steps("2 * 3")
    for ex in stream(format="cot").examples(20, seed=3):
        assert score(ex.reference, ex) == 1.0
        assert score(ex.reference.split(">")[0], ex) == 0.0  # no answer after '>'
        assert ex.reference.endswith(">" + ex.answer)


def test_cot_fraction_mixes_worked_and_direct_references():
    """cot_fraction: that share of SFT references show worked steps, the rest answer directly
    ('>ans'); the choice is a pure function of (seed, index) and both forms score as correct."""
    opts = dict(min_terms=3, max_terms=4)
    exs = stream(format="cot", cot_fraction=0.25, **opts).examples(400, seed=0)
    worked = [e for e in exs if "=" in e.reference]
    direct = [e for e in exs if "=" not in e.reference]
    assert 0.18 < len(worked) / len(exs) < 0.32  # binomial(400, 0.25): sd 0.022
    for e in direct[:20]:
        assert e.reference == ">" + e.answer and score(e.reference, e) == 1.0
    for e in worked[:20]:
        assert e.reference.endswith(">" + e.answer) and score(e.reference, e) == 1.0
    again = stream(format="cot", cot_fraction=0.25, **opts)
    assert [e.reference for e in again.examples(50, seed=0, offset=100)] == [e.reference for e in exs[100:150]]
    assert all("=" in e.reference for e in stream(format="cot", **opts).examples(50, seed=0))
    with pytest.raises(ConfigError, match="cot_fraction"):
        DataSpec(source="reasoning_gym:chain_sum", format="cot", cot_fraction=1.5)


def _chain_value(line: str) -> int:
    import re
    return sum(int(t) for t in re.findall(r"[+-]?\d+", line))


def test_rewrite_format_folds_one_term_per_line():
    """'rewrite': the chain restated, then each line the one above with its first two terms replaced by
    their value, every line padded to one width; the last line is '>answer'. Checked against eval of
    every line (the value of the chain never changes) and the fixed layout (every copied character sits
    exactly width - 1 positions back)."""
    assert rewrite_steps("4 - 1 - 7 + 3", 4) == "+004-1-7+3\n+003-7+3..\n-004+3....\n>-1"
    assert rewrite_steps("4 - 1 - 7 + 3") == rewrite_steps("4 - 1 - 7 + 3", 4)  # default: its own width
    assert rewrite_steps("9 + 9") == "+009+9\n>18" and rewrite_steps("5") == ">5"
    with pytest.raises(ValueError, match="rewrite mode"):
        rewrite_steps("2 * 3")
    opts = dict(min_terms=6, max_terms=32)
    tok = build_char_tokenizer()
    width, lengths = 4 + 2 * 31, []
    for ex in stream(format="rewrite", **opts).examples(40, seed=2):
        lines = ex.reference.split("\n")
        n_terms = ex.columns["metadata"]["num_terms"]
        assert lines[-1] == ">" + ex.answer and len(lines) == n_terms
        assert int(lines[0][:4]) == int(ex.prompt[0]) and lines[0].rstrip(".")[4:] == ex.prompt[1:-1]  # restated
        for j, line in enumerate(lines[:-1]):
            assert len(line) == width
            assert _chain_value(line.rstrip(".")) == int(ex.answer)  # every line keeps the chain's value
            assert len(line.rstrip(".")) == 4 + 2 * (n_terms - 1 - j)  # and drops one term
        text = ex.reference
        for j in range(1, n_terms - 1):  # the rest of line j is line j-1's, shifted by one term
            assert text[j * (width + 1) + 4:(j + 1) * (width + 1) - 3] == text[(j - 1) * (width + 1) + 6:j * (width + 1) - 1]
        assert score(ex.reference, ex, {**CHAIN, **opts}) == 1.0
        assert score(ex.reference.rsplit(">", 1)[0], ex, {**CHAIN, **opts}) == 0.0
        lengths.append(len(reference_ids(ex, tok)))
    # the long-reasoning workload: ~(n + 1) x width tokens, hundreds to thousands per completion
    assert min(lengths) >= 300 and max(lengths) >= 1500 and sum(lengths) / len(lengths) >= 800


def test_rewrite_format_direct_references_and_extraction():
    opts = dict(min_terms=10, max_terms=20)
    exs = stream(format="rewrite", cot_fraction=0.5, **opts).examples(200, seed=0)
    direct = [e for e in exs if not shows_steps(e.index, 0, 0.5)]
    assert 60 < len(direct) < 140
    assert all(e.reference == ">" + e.answer and score(e.reference, e, {**CHAIN, **opts}) == 1.0 for e in direct)
    assert extract_answer("+003-7+3\n-004+3..\n>-1", "rewrite") == "-1"
    assert extract_answer("+003-7+3\n-004+3..", "rewrite") is None
