"""Task streams, rewards and the char-level tokenizer (specco.data).

Streams must be deterministic and resumable by offset (a resumed run continues the same data);
rewards come from reasoning_gym's own scorer; the tokenizer saved next to a model must give the
same ids through transformers as through specco.
"""
import pytest

pytest.importorskip("reasoning_gym")

from specco.data.tasks import get_task, task_info  # noqa: E402
from specco.data.tokenizer import build_char_tokenizer, load_tokenizer  # noqa: E402


@pytest.mark.parametrize("name", ["chain_sum", "basic_arithmetic"])
def test_stream_deterministic_and_resumable(name):
    task = get_task(name)
    full = task.prompts(40, seed=3)
    again = get_task(name).prompts(40, seed=3)  # a fresh Task object: no hidden state
    resumed = task.prompts(15, seed=3, offset=25)
    assert [i.prompt for i in full] == [i.prompt for i in again]
    assert [(i.index, i.prompt, i.answer) for i in full[25:]] == \
        [(i.index, i.prompt, i.answer) for i in resumed]
    # Different seeds are different streams, not shifted copies (reasoning_gym seeds Random(seed+idx)).
    other = task.prompts(41, seed=4)
    assert [i.prompt for i in other[:40]] != [i.prompt for i in full]
    assert [i.prompt for i in other[1:]] != [i.prompt for i in full]


def test_compact_prompt_format():
    task = get_task("chain_sum")
    for it in task.prompts(50, seed=0):
        assert it.prompt.endswith("=") and " " not in it.prompt
        assert it.completion == it.answer
        assert eval(it.prompt[:-1]) == int(it.answer)  # the compact prompt is the same problem
    assert task_info(task)["config"]["max_terms"] == 3


def test_score_right_and_wrong():
    task = get_task("chain_sum")
    for it in task.prompts(20, seed=0):
        assert task.score(it.answer, it) == 1.0
        assert task.score(f" {it.answer} ", it) == 1.0
        wrong = str(int(it.answer) + 1)
        if it.answer not in wrong:  # reasoning_gym gives partial credit to superstrings
            assert task.score(wrong, it) == 0.0
        assert task.score("", it) == 0.0
        assert task.score("abc", it) == 0.0


def test_bad_task_config_is_loud():
    with pytest.raises(ValueError, match="rejected config"):
        get_task("chain_sum", max_terms=1, min_terms=2)
    with pytest.raises(ValueError, match="mode"):
        get_task("chain_sum", mode="verbose")


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


def test_chat_mode_prompt_and_answer_extraction(tmp_path):
    """Chat mode (pretrained policies): reasoning_gym's question in the chat template, the answer
    read from <answer> tags. Uses the char tokenizer with a toy template (no model download)."""
    pytest.importorskip("transformers")
    tok = build_char_tokenizer()
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    tok.save(tmp_path)
    tok = load_tokenizer(tmp_path)
    task = get_task("chain_sum", mode="chat", tokenizer=tok)
    it = task.prompts(1, seed=0)[0]
    assert it.question in it.prompt and it.prompt.endswith("<assistant>")
    assert "<answer>" in it.prompt  # reasoning_gym's default system prompt asks for the tags
    assert task.prompt_ids(it, tok)[0] != tok.bos_id  # the template owns the special tokens
    assert task.score(f"thinking... <answer>{it.answer}</answer>", it) == 1.0
    assert task.score(it.answer, it) == 0.0  # no tags, no answer
    assert it.completion == f"<answer>{it.answer}</answer>"


def test_cot_mode_worked_steps_and_scoring():
    from specco.data.tasks import worked_steps
    assert worked_steps("4 - 1 - 7") == "4-1=3,3-7=-4>-4"
    assert worked_steps("9 + 9") == "9+9=18>18"
    with pytest.raises(ValueError, match="cot mode"):
        worked_steps("2 * 3")
    task = get_task("chain_sum", mode="cot")
    for it in task.prompts(20, seed=3):
        assert task.score(it.completion, it) == 1.0
        assert task.score(it.completion.split(">")[0], it) == 0.0  # no answer after '>'
        assert it.completion.endswith(">" + it.answer)


def test_cot_fraction_mixes_worked_and_direct_references():
    """cot_fraction: that share of SFT references show worked steps, the rest answer directly
    ('>ans'); the choice is a pure function of (seed, index) and both forms score as correct."""
    task = get_task("chain_sum", mode="cot", min_terms=3, max_terms=4, cot_fraction=0.25)
    items = task.prompts(400, seed=0)
    worked = [it for it in items if "=" in it.completion]
    direct = [it for it in items if "=" not in it.completion]
    assert 0.18 < len(worked) / len(items) < 0.32  # binomial(400, 0.25): sd 0.022
    for it in direct[:20]:
        assert it.completion == ">" + it.answer and task.score(it.completion, it) == 1.0
    for it in worked[:20]:
        assert it.completion.endswith(">" + it.answer) and task.score(it.completion, it) == 1.0
    again = get_task("chain_sum", mode="cot", min_terms=3, max_terms=4, cot_fraction=0.25)
    assert [it.completion for it in again.prompts(50, seed=0, offset=100)] == \
        [it.completion for it in items[100:150]]
    full = get_task("chain_sum", mode="cot", min_terms=3, max_terms=4)
    assert all("=" in it.completion for it in full.prompts(50, seed=0))
    with pytest.raises(ValueError, match="cot_fraction"):
        get_task("chain_sum", mode="cot", cot_fraction=1.5)


def _chain_value(line: str) -> int:
    import re
    return sum(int(t) for t in re.findall(r"[+-]?\d+", line))


def test_rewrite_mode_folds_one_term_per_line():
    """'rewrite': the chain restated, then each line the one above with its first two terms replaced by
    their value, every line padded to one width; the last line is '>answer'. Checked against eval of
    every line (the value of the chain never changes) and the fixed layout (every copied character sits
    exactly width - 1 positions back)."""
    from specco.data.tasks import rewrite_steps
    assert rewrite_steps("4 - 1 - 7 + 3", 4) == "+004-1-7+3\n+003-7+3..\n-004+3....\n>-1"
    assert rewrite_steps("4 - 1 - 7 + 3") == rewrite_steps("4 - 1 - 7 + 3", 4)  # default: its own width
    assert rewrite_steps("9 + 9") == "+009+9\n>18" and rewrite_steps("5") == ">5"
    with pytest.raises(ValueError, match="rewrite mode"):
        rewrite_steps("2 * 3")
    task = get_task("chain_sum", mode="rewrite", min_terms=6, max_terms=32, cot_fraction=1.0)
    tok = build_char_tokenizer()
    width, lengths = 4 + 2 * 31, []
    for it in task.prompts(40, seed=2):
        lines = it.completion.split("\n")
        n_terms = it.entry["metadata"]["num_terms"]
        assert lines[-1] == ">" + it.answer and len(lines) == n_terms
        assert int(lines[0][:4]) == int(it.prompt[0]) and lines[0].rstrip(".")[4:] == it.prompt[1:-1]  # restated
        for j, line in enumerate(lines[:-1]):
            assert len(line) == width
            assert _chain_value(line.rstrip(".")) == int(it.answer)  # every line keeps the chain's value
            assert len(line.rstrip(".")) == 4 + 2 * (n_terms - 1 - j)  # and drops one term
        text = it.completion
        for j in range(1, n_terms - 1):  # the rest of line j is line j-1's, shifted by one term
            assert text[j * (width + 1) + 4:(j + 1) * (width + 1) - 3] == text[(j - 1) * (width + 1) + 6:j * (width + 1) - 1]
        assert task.score(it.completion, it) == 1.0
        assert task.score(it.completion.rsplit(">", 1)[0], it) == 0.0
        lengths.append(len(task.completion_ids(it, tok)))
    # the long-reasoning workload: ~(n + 1) x width tokens, hundreds to thousands per completion
    assert min(lengths) >= 300 and max(lengths) >= 1500 and sum(lengths) / len(lengths) >= 800


def test_rewrite_mode_direct_references_and_extraction():
    task = get_task("chain_sum", mode="rewrite", min_terms=10, max_terms=20, cot_fraction=0.5)
    items = task.prompts(200, seed=0)
    direct = [it for it in items if not task.shows_steps(it.index, 0)]
    assert 60 < len(direct) < 140
    assert all(it.completion == ">" + it.answer and task.score(it.completion, it) == 1.0 for it in direct)
    assert task.extract("+003-7+3\n-004+3..\n>-1") == "-1" and task.extract("+003-7+3\n-004+3..") is None
