"""Tokenizers: a character-level one for the from-scratch tiny policy, and one wrapper for both.

The tiny policy reads arithmetic like `4-1-7=` and writes `-4<eos>`; a character vocabulary over
printable ASCII is enough, keeps the embedding table and LM head tiny (~100 rows) and makes every
digit its own token, which is what lets a small model learn carries. It is built with the
`tokenizers` library and saved as `tokenizer.json` (+ `tokenizer_config.json`), so a policy
directory stays a loadable Hugging Face checkpoint:

    transformers.PreTrainedTokenizerFast(tokenizer_file=dir/"tokenizer.json")   # same ids
    transformers.AutoTokenizer.from_pretrained(dir)                                # same ids

`Tokenizer` is the one interface the rest of specco uses (encode / decode / bos_id / eos_id /
pad_id / chat_prompt). It wraps a `tokenizers.Tokenizer`, so the core package needs no
`transformers`; only chat templating of pretrained tokenizers (SmolLM2) imports it, lazily.
"""
from __future__ import annotations

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
                 hf_dir: str | os.PathLike | None = None):
        self.backend = backend
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
    def pad_id(self) -> int:
        return self.backend.token_to_id(self.pad_token)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if add_bos and self.bos_id is not None else []) + ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(map(int, ids)), skip_special_tokens=skip_special_tokens)

    # -- chat (pretrained policies) ---------------------------------------------------------------
    def chat_prompt(self, user: str, system: str | None = None) -> str:
        """The chat-templated prompt text (generation prompt appended), via transformers' template."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template; use the task's compact prompt mode")
        if self._hf is None:
            from transformers import AutoTokenizer  # heavy import, only for pretrained policies
            self._hf = AutoTokenizer.from_pretrained(str(self._hf_dir))
        msgs = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": user}]
        return self._hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)

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
    return Tokenizer(_HFTokenizer.from_file(str(f)), bos_token=tok("bos_token"), eos_token=eos,
                     pad_token=tok("pad_token"), chat_template=template, hf_dir=path)
