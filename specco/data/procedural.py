"""reasoning_gym as an endless, deterministic stream in bounded memory, and the tiny model's formats.

The stream. reasoning_gym item `idx` of a dataset built with seed `s` is (for almost every dataset)
generated from `random.Random(s + idx)`, but a dataset may also hold per-item state sized by its `size`
argument: `gsm_symbolic` and `list_functions` draw `Random(s).choices(templates, k=size)` at construction.
Asking for `size=2**31` (one virtual dataset per stream, what the first stream did) therefore materialises a list of
2**31 ints -- tens of GB -- before the first item. `RGStream` instead serves item `i` of stream `seed` from a
*block* dataset of `size=BLOCK` items:

    block b = i // BLOCK,  local j = i % BLOCK,  item i = create_dataset(name, seed=(seed << 32) + b*BLOCK,
                                                                          size=BLOCK, **options)[j]

so the generator's own rng seed is `(seed << 32) + b*BLOCK + j = (seed << 32) + i`, exactly what the old
one-dataset stream used: for the `Random(s + idx)` datasets (chain_sum, basic_arithmetic, ...) the stream is
unchanged, item for item. Streams of different seeds are disjoint for their first 2**32 items, as before
(seed 1's item 0 would otherwise be seed 0's item 1). Memory is a couple of cached blocks; an item depends
only on (name, options, seed, i) -- BLOCK is part of that definition for the size-dependent datasets, so
changing it changes their streams.

The formats of the from-scratch char model's arithmetic ("compact", "cot", "rewrite", "lookup") and of a chat model
("chat") live here too; their answers are read by `specco.rewards.extract.extract_answer`.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import random
import re
from collections import OrderedDict
from typing import Any

from specco.model.config import ConfigError
from specco.rewards.extract import extract_answer  # the one home of answer extraction

BLOCK = 1024          # items per block dataset (see the module docstring: part of the stream's definition)
_CACHED_BLOCKS = 4    # block datasets kept per stream: a batch straddles at most two; eval and train interleave


def worked_steps(expression: str) -> str:
    """Left-to-right partial sums of a +/- chain: '4 - 1 - 7' -> '4-1=3,3-7=-4>-4'.

    The 'cot' format's completion: a short chain of thought the tiny policy writes before its answer
    (after '>'). It makes completions long enough (~8-16 tokens) for speculative decoding to matter,
    and much of it (copied operands, separators) is predictable for a draft.
    """
    toks = expression.split()
    if len(toks) % 2 == 0 or any(op not in "+-" for op in toks[1::2]):
        raise ValueError(f"cot mode needs a +/- chain like '4 - 1 - 7', got {expression!r}")
    acc, steps = int(toks[0]), []
    for op, x in zip(toks[1::2], toks[2::2]):
        new = acc + int(x) if op == "+" else acc - int(x)
        steps.append(f"{acc}{op}{x}={new}")
        acc = new
    return ",".join(steps) + f">{acc}"


def rewrite_steps(expression: str, max_terms: int | None = None) -> str:
    """The chain restated, then rewritten line by line, each line folding its first two terms into one
    value; every value is a 4-character signed number and every line is padded with '.' to one width,
    4 + 2 * (max_terms - 1) characters:

        '4 - 1 - 7 + 3', max_terms=4 -> '+004-1-7+3\n+003-7+3..\n-004+3....\n>-1'

    The 'rewrite' format's completion, the long-reasoning workload (issue 15): an n-term chain takes n
    lines, so 6-32 one-digit terms give completions of ~400 to ~2,100 tokens with a long tail, as
    reasoning RL's responses have. The fixed layout puts every copied character exactly one line width
    minus two back (each line drops one 2-character term), and the one new value per line is a local
    one-digit step: a from-scratch model learns it in minutes, which it did not with unpadded lines
    (there the copy offset changes every line; a 316M policy stayed at the bigram loss after 500 SFT
    steps). Most tokens are copies or padding, so the text is far more predictable than natural chains
    of thought: drafts accept more here than they would on a real reasoning model.
    """
    toks = expression.split()
    if len(toks) % 2 == 0 or any(op not in "+-" for op in toks[1::2]):
        raise ValueError(f"rewrite mode needs a +/- chain like '4 - 1 - 7', got {expression!r}")
    n = len(toks) // 2 + 1
    width = 4 + 2 * (max(n, max_terms or n) - 1)
    acc, rest = int(toks[0]), toks[1:]
    lines = [f"{acc:+04d}" + "".join(rest)]
    while rest:
        op, x, rest = rest[0], int(rest[1]), rest[2:]
        acc = acc + x if op == "+" else acc - x
        lines.append(f"{acc:+04d}" + "".join(rest))
    return "".join(line.ljust(width, ".") + "\n" for line in lines[:-1]) + f">{acc}"


def shows_steps(index: int, seed: int, cot_fraction: float) -> bool:
    """Whether reference completion `index` of stream `seed` shows its worked steps (cot / rewrite).

    A fraction `cot_fraction` of them do; the rest answer directly ('>-4'). An SFT policy trained on
    that mixture sometimes reasons and sometimes guesses, as a base model does; reasoning is far more
    accurate, so RL has a strong, learnable signal to move the policy towards it. Deterministic in
    (seed, index).
    """
    if cot_fraction >= 1.0:
        return True
    return random.Random(f"{seed}:{index}").random() < cot_fraction


# -- the long-context lookup format (issue 35) ----------------------------------------------------------------
# A chain's terms become named facts hidden in a long ledger; the question names them. Fact names are single
# uppercase letters (one char token each, so finding a fact is one induction-head match: "K=" in the question's
# restatement attends to "K=" in the ledger and copies the digit after it); the ledger's distractors are
# two-lowercase-letter names, never equal to a fact's name, so exactly one place in the prompt answers each lookup.
LOOKUP_KEYS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
_FILLER_NAMES = [a + b for a in "abcdefghijklmnopqrstuvwxyz" for b in "abcdefghijklmnopqrstuvwxyz"]
_FILLER = [f"{n}={d};" for n in _FILLER_NAMES for d in "0123456789"]  # 6,760 distractor entries of 5 chars


def lookup_context_length(lo: int, hi: int, rng: random.Random) -> int:
    """A ledger length in [lo, hi], log-uniform: an SFT curriculum over 1K-32K sees every scale of distance
    while most rows stay short (the attention's cost grows with the square of the length)."""
    return lo if lo >= hi else int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def lookup_task(expression: str, context: tuple[int, int], key: str, max_terms: int | None
                ) -> tuple[str, str, str]:
    """(prompt, worked completion, direct completion) of a +/- chain of one-digit terms as a lookup task:

        prompt      'qa=3;K=4;zz=0;...;B=1;...;Q=7;...;Z=3;...\n?K-B-Q+Z='      ~context chars, facts anywhere
        worked      'K=4,B=1,Q=7,Z=3\n' + rewrite_steps('4 - 1 - 7 + 3', max_terms)     (ends '>-1')
        direct      'K=4,B=1,Q=7,Z=3\n>-1'

    The answer is the chain's own (reasoning_gym's chain_sum scores it unchanged). The completion first resolves
    every name (the long-range part: each value sits somewhere in 16K-32K tokens of prompt), then works the sum
    locally as the 'rewrite' format does, so completions keep that format's ~0.4-2K tokens. `key`
    seeds the item's names, fact positions and distractors (deterministic in it)."""
    toks = expression.split()
    if len(toks) % 2 == 0 or any(op not in "+-" for op in toks[1::2]) or \
            any(len(t) != 1 or not t.isdigit() for t in toks[0::2]):
        raise ValueError(f"lookup mode needs a +/- chain of one-digit terms like '4 - 1 - 7', got {expression!r} "
                         "(chain_sum with min_digits = max_digits = 1, allow_negation = false)")
    terms = toks[0::2]
    if len(terms) > len(LOOKUP_KEYS):
        raise ValueError(f"lookup mode names each term with one of {len(LOOKUP_KEYS)} letters; the chain has "
                         f"{len(terms)} terms (set max_terms <= {len(LOOKUP_KEYS)})")
    rng = random.Random(f"lookup:{key}")
    names = rng.sample(LOOKUP_KEYS, len(terms))
    question = "\n?" + names[0] + "".join(op + nm for op, nm in zip(toks[1::2], names[1:])) + "="
    facts = [f"{nm}={t};" for nm, t in zip(names, terms)]
    length = lookup_context_length(context[0], context[1], rng)
    fill = max(0, length - len(question) - sum(map(len, facts))) // 5
    ledger = rng.choices(_FILLER, k=fill)
    for fact in facts:  # uniform positions through the ledger, in no particular order
        ledger.insert(rng.randrange(len(ledger) + 1), fact)
    resolved = ",".join(f"{nm}={t}" for nm, t in zip(names, terms)) + "\n"
    worked = resolved + rewrite_steps(expression, max_terms)
    return "".join(ledger)[:-1] + question, worked, resolved + ">" + worked.rsplit(">", 1)[1]


def tiny_completion(entry: dict, format: str, max_terms: int | None, steps: bool,
                    context: tuple[int, int] | None = None, key: str = "") -> tuple[str, str]:
    """(prompt, reference completion) of a reasoning_gym arithmetic item in a char-model format: the
    compact prompt `4-1-7=` and the answer ('compact'), the worked steps ('cot'), the rewritten chain
    ('rewrite'), the chain's terms looked up in a long ledger first ('lookup', `context` = its length range in
    tokens, `key` seeding the ledger); with steps=False the direct answer '>-4' instead of the steps. Needs the
    item's metadata['expression'] (chain_sum, basic_arithmetic...)."""
    expr = entry.get("metadata", {}).get("expression")
    if expr is None:
        raise ValueError("has no metadata['expression']: the compact/cot/rewrite/lookup formats exist only for "
                         "arithmetic chains (chain_sum, basic_arithmetic); use the 'chat' format")
    if format == "lookup":
        prompt, worked, direct = lookup_task(expr, context, key, max_terms)
        return prompt, worked if steps else direct
    prompt = expr.replace(" ", "") + "="
    if format == "compact":
        return prompt, entry["answer"]
    full = worked_steps(expr) if format == "cot" else rewrite_steps(expr, max_terms)
    return prompt, full if steps else ">" + full.rsplit(">", 1)[1]


# -- reasoning_gym datasets -------------------------------------------------------------------------------
def _registry() -> dict:
    import reasoning_gym  # noqa: F401  (registers every dataset)
    from reasoning_gym.factory import DATASETS
    return DATASETS


def check_dataset(name: str, options: dict[str, Any], key: str = "data.source") -> None:
    """Raise a ConfigError for an unknown reasoning_gym dataset (with a did-you-mean) or options its
    config does not take (naming the dataset, the option and the ones it has). `seed` and `size` belong to
    the stream and cannot be options."""
    reg = _registry()
    if name not in reg:
        close = difflib.get_close_matches(name, reg, n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise ConfigError(f"{key}='reasoning_gym:{name}': no such reasoning_gym dataset; {hint}"
                          f"the {len(reg)} registered ones include {', '.join(sorted(reg)[:12])}, ...")
    accepted = [f.name for f in dataclasses.fields(reg[name][1]) if f.name not in ("seed", "size")]
    for k in options:
        if k in ("seed", "size"):
            raise ConfigError(f"data.options.{k}: the stream sets reasoning_gym's {k} itself (from the run's "
                              f"seed and position); remove it")
        if k not in accepted:
            close = difflib.get_close_matches(k, accepted, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"data.options.{k}: reasoning_gym dataset {name!r} takes no option {k!r}{hint}; "
                              f"its options are {', '.join(accepted) or '(none)'}")


def create_block(name: str, options: dict[str, Any], seed: int, size: int = BLOCK):
    """reasoning_gym.create_dataset with the options, errors as ConfigError naming dataset and options."""
    import reasoning_gym
    check_dataset(name, options)
    try:
        return reasoning_gym.create_dataset(name, seed=seed, size=size, **options)
    except (TypeError, AssertionError, ValueError) as e:
        raise ConfigError(f"data.options: reasoning_gym dataset {name!r} rejected options {options}: "
                          f"{e or type(e).__name__}") from None


class RGStream:
    """Item i of stream `seed` of one reasoning_gym dataset, in bounded memory (module docstring)."""

    def __init__(self, name: str, options: dict[str, Any] | None = None):
        self.name, self.options = name, dict(options or {})
        self._blocks: OrderedDict[tuple[int, int], Any] = OrderedDict()  # LRU of (seed, block) -> dataset
        self.scorer = self._block(0, 0)  # fails now on a bad name / options; score_answer's instance

    def _block(self, seed: int, block: int):
        key = (seed, block)
        ds = self._blocks.get(key)
        if ds is None:
            ds = create_block(self.name, self.options, seed=(seed << 32) + block * BLOCK)
            self._blocks[key] = ds
            while len(self._blocks) > _CACHED_BLOCKS:
                self._blocks.popitem(last=False)
        else:
            self._blocks.move_to_end(key)
        return ds

    def entry(self, seed: int, index: int) -> dict:
        """reasoning_gym's raw item {question, answer, metadata} number `index` of stream `seed`."""
        if seed < 0 or index < 0:
            raise ValueError(f"stream seed and index must be >= 0, got seed={seed} index={index}")
        return self._block(seed, index // BLOCK)[index % BLOCK]

    def score(self, answer: str | None, entry: dict) -> float:
        """The dataset's own score_answer on an extracted answer (1.0 right; some datasets give partial
        credit -- accuracy should count score == 1.0)."""
        return float(self.scorer.score_answer(answer, entry))


_SCORERS: dict[tuple, RGStream] = {}


def reasoning_gym_score(text: str, columns: dict, options: dict[str, Any] | None = None) -> float:
    """Score a completion of a procedural example from its columns alone (what a reward receives):
    `columns["data_source"]` = "reasoning_gym:NAME", the answer extracted per `columns["format"]`, then
    NAME's score_answer(answer, {question, answer, metadata}). `options`: the data.options the stream was
    made with (a few datasets' scorers read their config)."""
    name = columns["data_source"].split(":", 1)[1]
    key = (name, repr(sorted((options or {}).items())))
    if key not in _SCORERS:
        _SCORERS[key] = RGStream(name, options)
    entry = {k: columns[k] for k in ("question", "answer", "metadata")}
    return _SCORERS[key].score(extract_answer(text, columns.get("format", "chat")), entry)


_TAG = re.compile(r"^reasoning_gym:(.+)$")


def procedural_name(source: str) -> str | None:
    """NAME of a 'reasoning_gym:NAME' source, else None."""
    m = _TAG.match(source)
    return m.group(1) if m else None
