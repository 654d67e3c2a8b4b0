"""Tokenizers: a character-level one for the from-scratch tiny policy, and one wrapper for both.

The tiny policy reads arithmetic like `4-1-7=` and writes `-4<eos>`; a character vocabulary over
printable ASCII is enough, keeps the embedding table and LM head tiny (~100 rows) and makes every
digit its own token, which is what lets a small model learn carries. It is built with the
`tokenizers` library and saved as `tokenizer.json` (+ `tokenizer_config.json`), so a policy
directory stays a loadable Hugging Face checkpoint:

    transformers.PreTrainedTokenizerFast(tokenizer_file=dir/"tokenizer.json")   # same ids
    transformers.AutoTokenizer.from_pretrained(dir)                                # same ids

`Tokenizer` is the one interface the rest of specco uses (encode / decode / bos_id / eos_id /
pad_id / chat_prompt / prompt_ids). It wraps a `tokenizers.Tokenizer`, so the core package needs no
`transformers`.

Conventions of a pretrained checkpoint, kept as its own tokenizer keeps them:
* `encode(text, add_special_tokens=True)` is what `AutoTokenizer(dir)(text).input_ids` gives: the
  checkpoint's post-processor decides about BOS/EOS (SmolLM2 adds none; Llama-3 adds
  <|begin_of_text|>). As in transformers 5, tokenizer_config.json's `add_bos_token` /
  `add_eos_token` do not override tokenizer.json (tests/test_tokenizer_conventions.py).
* `chat_prompt` renders the checkpoint's chat template with transformers' `apply_chat_template`
  when transformers is installed, else with jinja2 (a torch dependency) set up as transformers sets
  it up (`_render_template`); chat-templated text is encoded without special tokens, as
  `apply_chat_template(tokenize=True)` does, since the template writes its own.
* `stop_token_ids(dir)`: the ids generation stops at, from generation_config.json.
"""
from __future__ import annotations

import importlib.util
import json
import os
import string
from pathlib import Path

from tokenizers import Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _HFTokenizer

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)  # ids 0..3, in this order
# Printable ASCII minus the vertical-whitespace characters other than "\n": 96 characters.
CHARS = tuple(dict.fromkeys(string.printable.replace("\r", "").replace("\x0b", "").replace("\x0c", "")))


def build_char_tokenizer() -> "Tokenizer":
    """Character-level tokenizer: specials <pad>=0 <bos>=1 <eos>=2 <unk>=3, then one id per char.

    Pipeline: pre-tokenizer isolates every character (regex `.` with DOTALL semantics via `[\\s\\S]`),
    the WordLevel model maps each to its id (unknown characters -> <unk>), the `Fuse` decoder joins
    tokens without separators (WordLevel would otherwise join them with spaces), and the
    post-processor prepends <bos> when special tokens are requested -- so HF's default
    `encode(text)` equals our `encode(text, add_bos=True)`.
    """
    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    backend = _HFTokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(list(SPECIALS))
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])])
    return Tokenizer(backend, bos_token=BOS, eos_token=EOS, pad_token=PAD)


class Tokenizer:
    """Thin wrapper around a `tokenizers.Tokenizer` plus its special tokens (and chat template).

    `encode` never adds special tokens unless asked (`add_bos`), so prompt/completion pieces can be
    concatenated without surprises; `decode` drops special tokens by default.
    """

    def __init__(self, backend: _HFTokenizer, bos_token: str | None, eos_token: str,
                 pad_token: str | None = None, chat_template: str | None = None,
                 hf_dir: str | os.PathLike | None = None, stop_ids: tuple[int, ...] | None = None):
        self.backend = backend
        self._stop_ids = tuple(int(i) for i in stop_ids) if stop_ids else None
        self.bos_token, self.eos_token = bos_token, eos_token
        self.pad_token = pad_token or eos_token  # pretrained tokenizers often have no pad
        self.chat_template = chat_template
        self._hf_dir = hf_dir  # where AutoTokenizer can load from (for chat templating)
        self._hf = None
        for name in ("eos_token", "pad_token") + (("bos_token",) if bos_token else ()):
            if backend.token_to_id(getattr(self, name)) is None:
                raise ValueError(f"{name}={getattr(self, name)!r} is not in the vocabulary")

    # -- ids ------------------------------------------------------------------------------------
    @property
    def bos_id(self) -> int | None:
        return None if self.bos_token is None else self.backend.token_to_id(self.bos_token)

    @property
    def eos_id(self) -> int:
        return self.backend.token_to_id(self.eos_token)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The ids rollouts stop at: loaded from a model directory, its stop ids (generation_config.json's eos
        list, see `stop_token_ids`) and eos_id; else (eos_id,). What the RL loop's engine ends rows at
        (GenerateConfig.eos_token_id), e.g. both <|im_end|> and <|endoftext|> for Qwen."""
        return self._stop_ids or (self.eos_id,)

    @property
    def pad_id(self) -> int:
        return self.backend.token_to_id(self.pad_token)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False, add_bos: bool = False) -> list[int]:
        """Token ids of `text`. add_special_tokens=True: as the checkpoint's tokenizer encodes by
        default (its post-processor's BOS/EOS rule) -- what a user's prompt gets. Otherwise bare ids,
        so prompt/completion pieces concatenate; add_bos prepends bos_token (the from-scratch char
        model's task prompts, where both agree)."""
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        return ([self.bos_id] if add_bos and self.bos_id is not None else []) + ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        """`encode` of each text (no add_bos), the batch encoded on every core by the HF backend."""
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def prompt_ids(self, text: str, chat: bool = False, system: str | None = None) -> list[int]:
        """A user prompt as the model should see it: chat-templated (chat=True; the template writes
        its own special tokens) or encoded with the tokenizer's default special tokens."""
        if chat:
            return self.encode(self.chat_prompt(text, system=system))
        return self.encode(text, add_special_tokens=True)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        # a tensor as one .tolist(): iterating one reads it element by element (on a GPU, one device sync
        # per token -- 2-4 s per RL step at 256 rows x ~1,000 tokens, measured, bench/host_overhead.py)
        ids = ids.tolist() if hasattr(ids, "tolist") else list(map(int, ids))
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    # -- chat (pretrained policies) ---------------------------------------------------------------
    def chat_prompt(self, user: str | list[dict], system: str | None = None, template: str | None = None) -> str:
        """The chat-templated prompt text (generation prompt appended) of a user message, or of chat messages
        [{role, content}, ...] used as given (`system` is then put first only if they have no system message).

        `template`: a Jinja chat template to use instead of the tokenizer's own (data.chat_template's file).
        Rendered by transformers' own `apply_chat_template` when transformers is installed and the tokenizer
        came from a directory, else by `_render_template` (jinja2, set up as transformers sets it up)."""
        template = template if template is not None else self.chat_template
        if template is None:
            raise ValueError("this tokenizer has no chat template (tokenizer_config.json 'chat_template' "
                             "or chat_template.jinja); use a plain prompt or the task's compact mode")
        if isinstance(user, str):
            msgs = [{"role": "user", "content": user}]
        else:
            msgs = [dict(m) for m in user]
        if system and not any(m.get("role") == "system" for m in msgs):
            msgs = [{"role": "system", "content": system}] + msgs
        if self._hf is None and self._hf_dir is not None and importlib.util.find_spec("transformers"):
            from transformers import AutoTokenizer  # heavy import, only for pretrained policies
            self._hf = AutoTokenizer.from_pretrained(str(self._hf_dir))
        if self._hf is not None:
            extra = {} if template == self.chat_template else {"chat_template": template}
            return self._hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **extra)
        specials = {"bos_token": self.bos_token, "eos_token": self.eos_token, "pad_token": self.pad_token}
        return _render_template(template, msgs, add_generation_prompt=True, **specials)

    # -- files ----------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Write tokenizer.json + tokenizer_config.json (what transformers' AutoTokenizer reads)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(path / "tokenizer.json"))
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": self.bos_token,
               "eos_token": self.eos_token, "pad_token": self.pad_token,
               "unk_token": UNK if self.backend.token_to_id(UNK) is not None else None,
               "model_max_length": 4096, "clean_up_tokenization_spaces": False}
        if self.chat_template is not None:
            cfg["chat_template"] = self.chat_template
        (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
        if self.stop_ids != (self.eos_id,):  # where transformers and the loaders read a list of stop ids
            (path / "generation_config.json").write_text(json.dumps({"eos_token_id": list(self.stop_ids)}, indent=2))


def _render_template(template: str, messages: list[dict], **context) -> str:
    """Render a chat template without transformers, in the environment transformers' chat templating
    uses (sandboxed, trim_blocks + lstrip_blocks, loop controls, `raise_exception`, `strftime_now`,
    a `tojson` that does not escape HTML). transformers-only tags ({% generation %}) are not supported."""
    import datetime
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: \
        json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
    return env.from_string(template).render(messages=messages, **context)


def stop_token_ids(path: str | os.PathLike, tokenizer: Tokenizer | None = None) -> tuple[int, ...]:
    """The token ids generation stops at, as transformers' `generate` takes them: generation_config.json's
    `eos_token_id` (an int or a list) when the file exists, else config.json's, else the tokenizer's
    eos. The first id is the primary one; specco's engine stops at any of them (GenerateConfig.eos_token_id)."""
    path = Path(path)
    for name in ("generation_config.json", "config.json"):
        f = path / name
        if f.exists():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if eos is not None:
                ids = tuple(int(i) for i in (eos if isinstance(eos, list) else [eos]))
                if ids:
                    return ids
    if tokenizer is None:
        raise ValueError(f"{path}: no eos_token_id in generation_config.json or config.json, and no tokenizer")
    return (tokenizer.eos_id,)


def truncate_at_stop(ids, stops) -> list[int]:
    """`ids` up to and including the first stop token (all of them if none occurs)."""
    ids = [int(i) for i in ids]
    stops = set(int(s) for s in stops)
    for n, t in enumerate(ids):
        if t in stops:
            return ids[:n + 1]
    return ids


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load tokenizer.json + tokenizer_config.json from a model directory (ours or a HF one).

    Special tokens come from tokenizer_config.json; entries there may be strings or
    `{"content": ...}` dicts (older transformers). A missing bos is fine (Qwen has none).
    """
    path = Path(path)
    f = path / "tokenizer.json"
    if not f.exists():
        raise FileNotFoundError(f"{f} not found: a policy directory needs tokenizer.json next to "
                                "config.json (save one with Tokenizer.save)")
    cfg_f = path / "tokenizer_config.json"
    cfg = json.loads(cfg_f.read_text()) if cfg_f.exists() else {}

    def tok(name):
        v = cfg.get(name)
        return v.get("content") if isinstance(v, dict) else v

    template = cfg.get("chat_template")
    jinja = path / "chat_template.jinja"  # newer transformers save the template separately
    if template is None and jinja.exists():
        template = jinja.read_text()
    eos = tok("eos_token")
    if eos is None:
        raise ValueError(f"{cfg_f}: no eos_token; generation could never stop")
    # tokenizer.json's post-processor alone decides the default special tokens, as in transformers 5,
    # which drops tokenizer_config.json's add_bos_token / add_eos_token whenever tokenizer.json exists.
    backend = _HFTokenizer.from_file(str(f))
    out = Tokenizer(backend, bos_token=tok("bos_token"), eos_token=eos,
                    pad_token=tok("pad_token"), chat_template=template, hf_dir=path)
    # generation_config.json's (else config.json's) stop ids, and the tokenizer's eos, which specco's SFT ends
    # completions with (so rollouts stop there even where a checkpoint's generation config lists other ids)
    out._stop_ids = tuple(dict.fromkeys((*stop_token_ids(path, out), out.eos_id)))
    return out
