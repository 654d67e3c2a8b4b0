"""Reasoning tasks and their rewards, from `reasoning_gym`.

A `Task` is an endless, deterministic stream of `Item`s plus a scorer:

    task = get_task("chain_sum")                    # easy preset, compact prompts
    items = task.prompts(n=64, seed=0, offset=128)  # items 128..191 of stream 0
    reward = task.score("-4", items[0])             # reasoning_gym's own score_answer

Two prompt modes:
* "compact" (the from-scratch char-level policy): the bare expression, `4-1-7=`, and the
  completion `-4` (the caller appends <eos>). reasoning_gym's boilerplate ("State the final answer
  to the following arithmetic problem: ...") would be ~60 extra tokens a tiny model must skip.
* "cot" / "rewrite" (the from-scratch policy, with reasoning): the compact prompt, then worked steps
  before the answer (`worked_steps`: short partial sums; `rewrite_steps`: the whole chain rewritten
  line by line, the long-reasoning workload), or, for a fraction 1 - cot_fraction of the SFT
  references, the answer alone.
* "chat" (pretrained instruct policies such as SmolLM2): reasoning_gym's question text, its
  default system prompt, the tokenizer's chat template; the answer is read from
  `<answer>...</answer>` tags as reasoning_gym's own evaluation does.

Determinism and resumption. reasoning_gym item `idx` of a dataset with seed `s` is generated from
`random.Random(s + idx)`, so streams with nearby seeds would be shifted copies of one another
(seed 1 item 0 == seed 0 item 1). We therefore hand reasoning_gym the seed `seed << 32`: streams
of different seeds are disjoint for the first 2**32 items. Item `offset + i` depends only on
(task config, seed, offset + i), so a resumed run that stores its data position continues the
same stream exactly.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import reasoning_gym
from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer

# Easy presets: what a ~0.3M-parameter model learns in about a minute on two CPU cores.
# Values are reasoning_gym config kwargs; `get_task(name, **overrides)` changes them.
PRESETS: dict[str, dict[str, Any]] = {
    # a+b-c with one-digit operands: 2-3 terms; answers in [-18, 27].
    "chain_sum": dict(min_terms=2, max_terms=3, min_digits=1, max_digits=1, allow_negation=False),
    # + - * over one-digit non-negative numbers, no parentheses, no spaces.
    "basic_arithmetic": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1,
                             operators=("+", "-", "*"), allow_parentheses=False,
                             allow_negation=False, whitespace="no_space"),
}
MODES = ("compact", "cot", "rewrite", "chat")


def worked_steps(expression: str) -> str:
    """Left-to-right partial sums of a +/- chain: '4 - 1 - 7' -> '4-1=3,3-7=-4>-4'.

    The 'cot' mode's completion: a short chain of thought the tiny policy writes before its answer
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

    The 'rewrite' mode's completion, the long-reasoning workload (issue 15): an n-term chain takes n
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


_STREAM_SIZE = 2**31  # reasoning_gym's datasets are virtual; `size` only bounds iteration


@dataclass(frozen=True)
class Item:
    """One problem. `prompt` is what the policy sees; `completion` is the reference answer text
    for SFT (no <eos>); `entry` is reasoning_gym's raw dict (what `score_answer` needs)."""
    index: int  # position in the stream: offset + i
    question: str
    answer: str
    prompt: str
    completion: str
    entry: dict = field(repr=False, compare=False)


class Task:
    """A reasoning_gym dataset with a prompt format and a scorer. See the module docstring."""

    def __init__(self, name: str, config: dict[str, Any] | None = None, mode: str = "compact",
                 tokenizer=None, system_prompt: str | None = None, cot_fraction: float = 1.0):
        if mode not in MODES:
            raise ValueError(f"task mode {mode!r}: choose from {MODES}")
        if mode == "chat" and (tokenizer is None or tokenizer.chat_template is None):
            raise ValueError("chat mode needs a tokenizer with a chat template (a pretrained "
                             "instruct policy); the from-scratch policy uses mode='compact'")
        if not 0.0 <= cot_fraction <= 1.0:
            raise ValueError(f"cot_fraction={cot_fraction}: must be in [0, 1]")
        self.name, self.mode, self.tokenizer = name, mode, tokenizer
        self.cot_fraction = cot_fraction
        self.config = dict(config or {})
        self.system_prompt = SYSTEM_PROMPTS["default"] if system_prompt is None else system_prompt
        self._datasets: dict[int, Any] = {}
        self._dataset(0)  # fail now, not mid-run, on an unknown name or a bad config key

    def _dataset(self, seed: int):
        ds = self._datasets.get(seed)
        if ds is None:
            try:
                ds = reasoning_gym.create_dataset(self.name, seed=seed << 32, size=_STREAM_SIZE,
                                                  **self.config)
            except (TypeError, AssertionError) as e:
                raise ValueError(f"task {self.name!r} rejected config {self.config}: {e}") from None
            self._datasets[seed] = ds
        return ds

    # -- the stream ---------------------------------------------------------------------------------
    def item(self, index: int, seed: int) -> Item:
        entry = self._dataset(seed)[index]
        q, a = entry["question"], entry["answer"]
        if self.mode in ("compact", "cot", "rewrite"):
            expr = entry.get("metadata", {}).get("expression")
            if expr is None:
                raise ValueError(f"task {self.name!r} has no metadata['expression']; compact "
                                 "prompts exist only for arithmetic tasks (use mode='chat')")
            if self.mode == "compact":
                completion = a
            else:
                steps = (worked_steps(expr) if self.mode == "cot" else
                         rewrite_steps(expr, self.config.get("max_terms")))
                # or a direct answer: the same '>answer' ending without the worked steps
                completion = steps if self.shows_steps(index, seed) else ">" + steps.rsplit(">", 1)[1]
            return Item(index, q, a, prompt=expr.replace(" ", "") + "=", completion=completion,
                        entry=entry)
        prompt = self.tokenizer.chat_prompt(q, system=self.system_prompt or None)
        return Item(index, q, a, prompt=prompt, completion=f"<answer>{a}</answer>", entry=entry)

    def shows_steps(self, index: int, seed: int) -> bool:
        """Whether reference completion `index` of stream `seed` shows its worked steps ('cot' and
        'rewrite' modes).

        A fraction `cot_fraction` of them do; the rest answer directly. An SFT policy trained on
        that mixture sometimes reasons and sometimes guesses, as a base model does; reasoning is
        far more accurate, so RL has a strong, learnable signal to move the policy towards it
        (completions grow longer, the drift real RL shows). Deterministic in (seed, index).
        """
        if self.cot_fraction >= 1.0:
            return True
        return random.Random(f"{seed}:{index}").random() < self.cot_fraction

    def prompts(self, n: int, seed: int, offset: int = 0) -> list[Item]:
        """Items offset .. offset+n-1 of stream `seed` (deterministic; resumable by offset)."""
        return [self.item(offset + i, seed) for i in range(n)]

    # -- token ids ----------------------------------------------------------------------------------
    def prompt_ids(self, item: Item, tokenizer) -> list[int]:
        """Prompt token ids. Compact prompts get the tokenizer's default special tokens (the char
        tokenizer's post-processor prepends <bos>); chat-templated text already carries the template's
        own special tokens (added tokens are recognised inside the text), so none are added."""
        return tokenizer.encode(item.prompt, add_special_tokens=self.mode != "chat")

    def completion_ids(self, item: Item, tokenizer) -> list[int]:
        """Reference completion ids for SFT, ending with <eos> so the policy learns to stop."""
        return tokenizer.encode(item.completion) + [tokenizer.eos_id]

    # -- reward -------------------------------------------------------------------------------------
    def extract(self, completion_text: str) -> str | None:
        """The answer string inside a completion (decoded text, special tokens removed)."""
        if self.mode == "chat":
            return extract_answer(completion_text)
        if self.mode in ("cot", "rewrite"):  # the answer follows the last '>'; no '>' means no answer
            return completion_text.rsplit(">", 1)[1].strip() if ">" in completion_text else None
        return completion_text.strip()

    def score(self, completion_text: str, item: Item) -> float:
        """reasoning_gym's score_answer on the extracted answer: 1.0 exact (numerically), 0.0 wrong.

        Note reasoning_gym's arithmetic scorer gives partial credit len(oracle)/len(answer) when the
        oracle is a substring of a wrong answer ("14" for oracle "4" -> 0.5); accuracy metrics
        should count `score == 1.0`.
        """
        return float(self._dataset(0).score_answer(self.extract(completion_text), item.entry))


def get_task(name: str, mode: str = "compact", tokenizer=None, cot_fraction: float = 1.0,
             **overrides) -> Task:
    """A task with its easy preset (if any) updated by `overrides` (reasoning_gym config kwargs)."""
    config = {**PRESETS.get(name, {}), **overrides}
    return Task(name, config, mode=mode, tokenizer=tokenizer, cot_fraction=cot_fraction)


def task_info(task: Task) -> dict:
    """A JSON-able description (for run metadata / checkpoints)."""
    cfg = {k: (list(v) if isinstance(v, tuple) else v) for k, v in task.config.items()}
    return {"name": task.name, "mode": task.mode, "config": cfg}


__all__ = ["Item", "Task", "get_task", "task_info", "PRESETS", "MODES"]
