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

Determinism and resumption. Item `offset + i` of stream `seed` depends only on (task config, seed,
offset + i), so a resumed run that stores its data position continues the same stream exactly; streams of
different seeds are disjoint for their first 2**32 items. The stream is `procedural.RGStream`: reasoning_gym
block datasets in bounded memory (its docstring has the seeding).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from reasoning_gym.utils import SYSTEM_PROMPTS

from specco.data.procedural import (RGStream, extract_answer, rewrite_steps, shows_steps, tiny_completion,
                                    worked_steps)

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
        try:  # fails now, not mid-run, on an unknown name or a bad config key
            self._stream = RGStream(name, self.config)  # bounded memory: see data/procedural.py
        except ValueError as e:
            raise ValueError(f"task {self.name!r} rejected config {self.config}: {e}") from None

    # -- the stream ---------------------------------------------------------------------------------
    def item(self, index: int, seed: int) -> Item:
        entry = self._stream.entry(seed, index)
        q, a = entry["question"], entry["answer"]
        if self.mode in ("compact", "cot", "rewrite"):
            try:
                prompt, completion = tiny_completion(entry, self.mode, self.config.get("max_terms"),
                                                     self.shows_steps(index, seed))
            except ValueError as e:
                raise ValueError(f"task {self.name!r} {e}") from None
            return Item(index, q, a, prompt=prompt, completion=completion, entry=entry)
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
        return shows_steps(index, seed, self.cot_fraction)

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
        return extract_answer(completion_text, self.mode)

    def score(self, completion_text: str, item: Item) -> float:
        """reasoning_gym's score_answer on the extracted answer: 1.0 exact (numerically), 0.0 wrong.

        Note reasoning_gym's arithmetic scorer gives partial credit len(oracle)/len(answer) when the
        oracle is a substring of a wrong answer ("14" for oracle "4" -> 0.5); accuracy metrics
        should count `score == 1.0`.
        """
        return self._stream.score(self.extract(completion_text), item.entry)


def get_task(name: str, mode: str = "compact", tokenizer=None, cot_fraction: float = 1.0,
             **overrides) -> Task:
    """A task with its easy preset (if any) updated by `overrides` (reasoning_gym config kwargs)."""
    config = {**PRESETS.get(name, {}), **overrides}
    return Task(name, config, mode=mode, tokenizer=tokenizer, cot_fraction=cot_fraction)


def task_info(task: Task) -> dict:
    """A JSON-able description (for run metadata / checkpoints)."""
    cfg = {k: (list(v) if isinstance(v, tuple) else v) for k, v in task.config.items()}
    return {"name": task.name, "mode": task.mode, "config": cfg}


__all__ = ["Item", "Task", "get_task", "task_info", "worked_steps", "rewrite_steps", "PRESETS", "MODES"]
