"""The data protocol the runner reads prompts through: `PromptSource.examples(n, seed, offset)`.

    train, eval, stats = load_data(spec, tokenizer)           # every input checked here, before training
    batch = train.examples(64, seed=run_seed, offset=step * 64)  # deterministic; resumable by offset
    ids = [ex.prompt_ids for ex in batch]                    # what the policy sees
    reward_inputs = [(ex.prompt, ex.columns) for ex in batch]  # the row's own columns reach the reward
    sft_target = reference_ids(batch[0], tokenizer)          # ... ending with EOS

Two kinds of source:
* `FileSource`, a finite data set read by `files.read_table`. Position k of stream `seed` is row
  `order(seed, k // N)[k % N]` of the split's N rows: the stream cycles through epochs, each epoch its own
  permutation drawn from (seed, epoch) when `shuffle` (else file order). Nothing but (seed, k) picks the row,
  so a run resumed at offset k sees what it would have seen.
* `ProceduralSource`, reasoning_gym's endless stream (`procedural.RGStream`): example k of stream `seed` is
  item k of reasoning_gym stream `seed`.

Held-out evaluation. A file's eval split is an eval file (`data.eval`) or `eval_fraction` of the source's rows
chosen by `data.seed` (never the run seed: runs with different seeds evaluate on the same rows); the two
splits share no row. A procedural source's eval stream is reasoning_gym stream 2**31 + data.seed, disjoint
from every training stream seed < 2**31 for its first 2**32 items. Eval sources are finite (`num_rows` =
eval_size, or the eval split) and unshuffled: `eval.examples(eval.num_rows, seed=0)` is the eval set.

Prompt ids. A string prompt becomes [system?, user] messages, chat messages are used as given (the system
prompt put first only if they have none), then rendered by the chat template (`Tokenizer.chat_prompt`, with
the generation prompt) and encoded without special tokens (the template writes its own). Without a template
(data.chat_template = "none", or a tokenizer that has none) a string prompt's raw text is encoded with the
tokenizer's default special tokens, as the checkpoint's own tokenizer would (tokenizer.py).
"""
from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from specco.data import files
from specco.data.config import DataSpec
from specco.data.procedural import RGStream, shows_steps, tiny_completion
from specco.model.config import ConfigError

log = logging.getLogger("specco.data")

EVAL_STREAM = 2**31  # procedural eval streams start here; training stream seeds must stay below it
ANSWER_KEYS = ("answer", "reward_model.ground_truth", "solution")
COMPLETION_KEYS = ("completion", "response", "output")  # then the answer column


@dataclass(frozen=True)
class Example:
    index: int                  # position in the stream (offset + i): resumable by offset
    prompt: str | list[dict]    # the row's prompt as the user's data has it (a string or chat messages)
    prompt_ids: list[int]       # what the policy sees: templated, tokenized, truncated
    columns: dict = field(repr=False)  # every other column of the row, untouched (reaches the reward)
    reference: str | None       # the reference completion for SFT (no EOS), or None
    answer: Any = None          # the reference answer (answer_key) for exact/built-in rewards, or None
    row: int = -1               # the file row (of the whole file) or the procedural item number


@runtime_checkable
class PromptSource(Protocol):
    """What the runner reads prompts through. `num_rows` is one epoch's rows (None: an endless stream); a
    property rather than __len__, since len() cannot return None."""
    name: str

    @property
    def num_rows(self) -> int | None: ...

    def examples(self, n: int, seed: int, offset: int = 0) -> list[Example]: ...


def reference_ids(example: Example, tokenizer) -> list[int]:
    """The SFT target: the reference completion's ids (no special tokens) then EOS, so the policy learns to
    stop. Raises if the example has no reference (set data.completion_key)."""
    if example.reference is None:
        raise ConfigError(f"row {example.row} has no reference completion for SFT: set data.completion_key to "
                          "the column holding it (or data.answer_key)")
    return tokenizer.encode(example.reference) + [tokenizer.eos_id]


class PromptFormatter:
    """Prompt -> token ids, per the module docstring; `template` None = raw text."""

    def __init__(self, tokenizer, chat_template: str, system_prompt: str):
        self.tokenizer, self.system_prompt = tokenizer, system_prompt or None
        self.override = None  # a template file's text, passed to chat_prompt instead of the tokenizer's own
        if chat_template == "none":
            self.template = None
        elif chat_template == "":
            self.template = tokenizer.chat_template
        else:
            path = Path(chat_template).expanduser()
            if not path.is_file():
                raise FileNotFoundError(f"data.chat_template={chat_template!r}: no such file; give a Jinja chat "
                                        "template file, \"\" for the tokenizer's own, or \"none\" for raw text")
            self.template = self.override = path.read_text()

    def text(self, prompt: str | list[dict], where: str = "") -> tuple[str, bool]:
        """(the text to encode, whether with the tokenizer's default special tokens): the raw prompt with them
        where no template is in use, else the rendered template without them (it writes its own)."""
        if self.template is None:
            if not isinstance(prompt, str):
                raise ConfigError(f"{where}: the prompt is chat messages but no chat template is in use; set "
                                  "data.chat_template to a Jinja template file (or use a tokenizer that has one)")
            return prompt, True
        return self.tokenizer.chat_prompt(prompt, system=self.system_prompt, template=self.override), False

    def encode_batch(self, texts: list[tuple[str, bool]]) -> list[list[int]]:
        """`text` pairs -> their ids, one tokenizer batch per special-token flag: HF tokenizers encode a batch on
        every core (8 of the long-context workload's 32K-character prompts: 0.16 s one at a time on 2 cores)."""
        out: list[list[int] | None] = [None] * len(texts)
        for flag in (True, False):
            at = [i for i, (_, f) in enumerate(texts) if f == flag]
            if at:
                for i, ids in zip(at, self.tokenizer.encode_batch([texts[i][0] for i in at], add_special_tokens=flag)):
                    out[i] = ids
        return out


def _encoded(formatter: PromptFormatter, truncate, parts: list[tuple[Example, tuple[str, bool], str]]
             ) -> list[Example]:
    """(example without ids, its `PromptFormatter.text`, where) -> the examples with their truncated ids, the
    texts encoded as one batch."""
    ids = formatter.encode_batch([text for _, text, _ in parts])
    return [dataclasses.replace(ex, prompt_ids=truncate(i, where)) for (ex, _, where), i in zip(parts, ids)]


class _Truncator:
    """data.max_prompt_tokens under data.truncation = error / left (drop is applied at load)."""

    def __init__(self, limit: int, mode: str):
        self.limit, self.mode = limit, mode

    def __call__(self, ids: list[int], where: str) -> list[int]:
        if not self.limit or len(ids) <= self.limit:
            return ids
        if self.mode == "left":
            return ids[-self.limit:]
        raise ConfigError(
            f"{where} has a {len(ids)}-token prompt, over data.max_prompt_tokens={self.limit}; raise the limit, "
            f"or set data.truncation = \"left\" (keep its last {self.limit} tokens) or \"drop\" (leave such "
            "rows out)")


class FileSource:
    """Rows `rows` of a table, cycled through epochs (module docstring)."""

    def __init__(self, name: str, table, rows: np.ndarray, prompt_key: str, answer_key: str | None,
                 completion_key: str | None, formatter: PromptFormatter, truncate: _Truncator, shuffle: bool):
        self.name, self.table, self.rows = name, table, rows
        self.prompt_key, self.answer_key, self.completion_key = prompt_key, answer_key, completion_key
        self.formatter, self.truncate, self.shuffle = formatter, truncate, shuffle
        self._orders: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    def order(self, seed: int, epoch: int) -> np.ndarray:
        """Epoch `epoch`'s visiting order of the split's rows (positions into self.rows)."""
        if not self.shuffle:
            return np.arange(len(self.rows))
        key = (seed, epoch)
        if key not in self._orders:
            # a generator seeded by (seed, epoch) alone: no state carries between epochs or calls
            self._orders[key] = np.random.default_rng([seed, epoch]).permutation(len(self.rows))
            while len(self._orders) > 2:  # a batch straddles at most two epochs
                self._orders.popitem(last=False)
        return self._orders[key]

    def row_example(self, k: int, row: int) -> Example:
        """Stream position k holding file row `row`."""
        return _encoded(self.formatter, self.truncate, [self._row(k, row)])[0]

    def _row(self, k: int, row: int) -> tuple[Example, tuple[str, bool], str]:
        """_encoded's part for stream position k holding file row `row`."""
        record = self.table[row]
        prompt = record.pop(self.prompt_key)
        if isinstance(prompt, list):
            prompt = files.clean_messages(prompt)
        where = f"{self.name} row {row}"
        text = self.formatter.text(prompt, where)
        answer = files.dig(record, self.answer_key) if self.answer_key else None
        answer = str(answer) if isinstance(answer, (int, float, np.generic)) else answer
        ref = files.as_text(files.dig(record, self.completion_key)) if self.completion_key else None
        return (Example(index=k, prompt=prompt, prompt_ids=[], columns=record, reference=ref, answer=answer,
                        row=row), text, where)

    def examples(self, n: int, seed: int, offset: int = 0) -> list[Example]:
        """Positions offset .. offset+n-1 of stream `seed` (deterministic; epochs cycle)."""
        N, parts = len(self.rows), []
        for k in range(offset, offset + n):
            epoch, pos = divmod(k, N)
            parts.append(self._row(k, int(self.rows[self.order(seed, epoch)[pos]])))
        return _encoded(self.formatter, self.truncate, parts)


class ProceduralSource:
    """reasoning_gym dataset NAME as examples; `stream_base` + seed is the reasoning_gym stream; `size`
    makes it finite (an eval set: positions cycle, unshuffled)."""

    def __init__(self, spec: DataSpec, fmt: str, formatter: PromptFormatter, truncate: _Truncator,
                 stream: RGStream, stream_base: int = 0, size: int | None = None):
        self.name, self.spec, self.fmt, self.formatter = spec.source, spec, fmt, formatter
        self.truncate, self.stream, self.stream_base, self.size = truncate, stream, stream_base, size
        from reasoning_gym.utils import SYSTEM_PROMPTS
        self.system = spec.system_prompt or SYSTEM_PROMPTS["default"]

    @property
    def num_rows(self) -> int | None:
        return self.size

    def item_example(self, k: int, seed: int) -> Example:
        return _encoded(self.formatter, self.truncate, [self._item(k, seed)])[0]

    def _item(self, k: int, seed: int) -> tuple[Example, tuple[str, bool], str]:
        """_encoded's part for item k of stream `seed`."""
        idx = k % self.size if self.size else k
        stream = self.stream_base + seed
        entry = self.stream.entry(stream, idx)
        q, a = entry["question"], entry["answer"]
        where = f"{self.name} item {idx} of stream {stream}"
        if self.fmt == "chat":
            # no reference where the dataset has no single oracle answer (propositional_logic: its scorer checks)
            prompt, ref = q, None if a is None else f"<answer>{a}</answer>"
            if self.formatter.template is None:
                text = self.formatter.text(q, where)
            else:  # reasoning_gym's own system prompt, not data.system_prompt's default
                text = (self.formatter.tokenizer.chat_prompt(q, system=self.system, template=self.formatter.override),
                        False)
        else:
            try:
                prompt, ref = tiny_completion(entry, self.fmt, self.spec.options.get("max_terms"),
                                              shows_steps(idx, stream, self.spec.cot_fraction),
                                              self.spec.lookup_context, key=f"{stream}:{idx}")
            except ValueError as e:
                raise ConfigError(f"data.format={self.fmt!r}: {where} {e}") from None
            text = (prompt, True)
        columns = {"question": q, "answer": a, "metadata": entry.get("metadata", {}),
                   "data_source": self.name, "format": self.fmt}
        return (Example(index=k, prompt=prompt, prompt_ids=[], columns=columns, reference=ref, answer=a, row=idx),
                text, where)

    def examples(self, n: int, seed: int, offset: int = 0) -> list[Example]:
        """Positions offset .. offset+n-1 of stream `seed` (deterministic in (options, seed, position))."""
        if not 0 <= seed < EVAL_STREAM:
            raise ValueError(f"stream seed {seed}: must be in [0, 2**31) (higher seeds are the eval streams)")
        return _encoded(self.formatter, self.truncate, [self._item(k, seed) for k in range(offset, offset + n)])


# -- load_data --------------------------------------------------------------------------------------------
def load_data(spec: DataSpec, tokenizer, *, need_reference: bool = False
              ) -> tuple[PromptSource, PromptSource | None, dict]:
    """(train source, eval source or None, stats), every input checked before anything trains.

    `need_reference`: SFT data -- every training row must have a reference completion. `stats`: rows read,
    rows per split, rows dropped/truncated by max_prompt_tokens, the longest prompt (when measured), the
    keys resolved. Raises ConfigError / FileNotFoundError naming the key or row to fix.
    """
    formatter = PromptFormatter(tokenizer, spec.chat_template, spec.system_prompt)
    truncate = _Truncator(spec.max_prompt_tokens, spec.truncation)
    if spec.procedural:
        return _load_procedural(spec, tokenizer, formatter, truncate)
    if spec.system_prompt and formatter.template is None:
        raise ConfigError(f"data.system_prompt is set but no chat template is in use (data.chat_template="
                          f"{spec.chat_template!r}); a system message needs a template -- set data.chat_template "
                          "to a template file, or remove data.system_prompt")
    table = files.read_table(spec.source)
    name = Path(spec.source).name
    prompt_key = _check_table(table, spec, spec.source, "data.source")
    answer_key = files.resolve_key(table, spec.answer_key, ANSWER_KEYS, "data.answer_key", spec.source)
    completion_key = files.resolve_key(table, spec.completion_key, COMPLETION_KEYS, "data.completion_key",
                                       spec.source) or answer_key
    if need_reference and completion_key is None:
        raise ConfigError(f"{spec.source}: SFT needs a reference completion per row, and none of the columns "
                          f"{', '.join(table.column_names)} is one ({', '.join(COMPLETION_KEYS + ANSWER_KEYS)}); "
                          "set data.completion_key")
    stats: dict[str, Any] = {"source": spec.source, "rows": len(table), "prompt_key": prompt_key,
                             "answer_key": answer_key, "completion_key": completion_key}

    def source(src_name, tab, rows, shuffle):
        return FileSource(src_name, tab, rows, prompt_key, answer_key, completion_key, formatter, truncate,
                          shuffle)

    rows = np.arange(len(table))
    eval_src = None
    if spec.eval_fraction:
        n_eval = max(1, round(spec.eval_fraction * len(table)))
        if n_eval >= len(table):
            raise ConfigError(f"data.eval_fraction={spec.eval_fraction} of {len(table)} rows leaves no training "
                              "rows; lower it")
        perm = np.random.default_rng([spec.seed, 0xE7A1]).permutation(len(table))
        rows, eval_rows = np.sort(perm[n_eval:]), np.sort(perm[:n_eval])
        eval_src = source(f"{name} (eval)", table, eval_rows, False)
    elif spec.eval:
        eval_table = files.read_table(spec.eval, "data.eval")
        _check_table(eval_table, spec, spec.eval, "data.eval")
        for key_name, key in (("data.answer_key", answer_key), ("data.completion_key", completion_key)):
            if key and not files.has_key(eval_table, key):  # the eval file must carry what the train file does
                raise files.missing_column(eval_table, key_name, key, spec.eval)
        eval_src = source(Path(spec.eval).name, eval_table, np.arange(len(eval_table)), False)
    train = source(name, table, rows, spec.shuffle)
    train.rows = _measure(train, spec, stats, "")
    if need_reference:
        for r in train.rows:
            if files.as_text(files.dig(table[int(r)], completion_key)) is None:
                raise ConfigError(f"{spec.source} row {int(r)}: no reference completion in {completion_key!r} "
                                  "(SFT needs one in every row; fix the row or set data.completion_key)")
    if eval_src is not None:
        if spec.eval_size:
            eval_src.rows = eval_src.rows[:spec.eval_size]
        eval_src.rows = _measure(eval_src, spec, stats, "eval_")
    stats.update(train_rows=train.num_rows, eval_rows=eval_src.num_rows if eval_src else 0)
    return train, eval_src, stats


def _check_table(table, spec: DataSpec, where: str, key: str) -> str:
    """The table has rows and a prompt column of strings / messages; returns the prompt key."""
    if len(table) == 0:
        raise ConfigError(f"{key}={where!r} has no rows")
    if spec.prompt_key not in table.column_names:
        raise files.missing_column(table, "data.prompt_key", spec.prompt_key, where)
    files.check_prompts(table, spec.prompt_key, where)
    return spec.prompt_key


def _measure(src: FileSource, spec: DataSpec, stats: dict, prefix: str) -> np.ndarray:
    """Template every row once when max_prompt_tokens is set (else the first): raise / count truncations /
    drop rows before training. Returns the rows kept."""
    if not spec.max_prompt_tokens:
        src.row_example(0, int(src.rows[0]))  # the template and keys work on a real row, now
        return src.rows
    limit, keep, lengths = spec.max_prompt_tokens, [], []
    raw = _Truncator(0, "error")
    src.truncate, saved = raw, src.truncate
    for r in src.rows:
        n = len(src.row_example(0, int(r)).prompt_ids)
        lengths.append(n)
        if n > limit and spec.truncation == "error":
            saved(list(range(n)), f"{src.name} row {int(r)}")  # raises, naming row, length and the choices
        if n <= limit or spec.truncation == "left":
            keep.append(r)
    src.truncate = saved
    over = sum(n > limit for n in lengths)
    stats[prefix + "max_prompt_len"] = max(lengths)
    stats[prefix + "truncated"] = over if spec.truncation == "left" else 0
    stats[prefix + "dropped"] = over if spec.truncation == "drop" else 0
    if spec.truncation == "drop" and over:
        log.warning("data: dropped %d of %d rows of %s with prompts over data.max_prompt_tokens=%d",
                    over, len(lengths), src.name, limit)
    if not keep:
        raise ConfigError(f"{src.name}: all {len(lengths)} rows have prompts over data.max_prompt_tokens={limit} "
                          f"(the longest {max(lengths)} tokens); raise the limit or set data.truncation = \"left\"")
    return np.asarray(keep, dtype=np.int64)


def _load_procedural(spec: DataSpec, tokenizer, formatter: PromptFormatter, truncate: _Truncator):
    stream = RGStream(spec.procedural, spec.options)  # raises on a bad name (did-you-mean) or option
    fmt = spec.format
    if fmt == "auto":
        fmt = "chat" if formatter.template is not None else "cot"
    if spec.truncation == "drop" and spec.max_prompt_tokens:
        raise ConfigError("data.truncation='drop' needs a file source (an endless reasoning_gym stream has no "
                          "rows to drop); use \"left\" or \"error\"")
    train = ProceduralSource(spec, fmt, formatter, truncate, stream)
    train.examples(1, seed=0)  # the format fits the dataset (cot needs arithmetic chains), now
    eval_src = ProceduralSource(spec, fmt, formatter, truncate, stream, EVAL_STREAM + spec.seed, spec.eval_size)
    lengths = [len(ex.prompt_ids) for ex in eval_src.examples(spec.eval_size, seed=0)]  # raises under 'error'
    stats = {"source": spec.source, "rows": None, "format": fmt, "train_rows": None,
             "eval_rows": spec.eval_size, "eval_max_prompt_len": max(lengths)}
    return train, eval_src, stats


__all__ = ["Example", "PromptSource", "FileSource", "ProceduralSource", "PromptFormatter", "load_data",
           "reference_ids", "EVAL_STREAM"]
