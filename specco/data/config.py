"""`[data]`: where a job's prompts come from and how they become token ids (owned by specco.data).

One `DataSpec` describes one data set: the RL prompts (`[data]`) and, with `completion_key`, SFT pairs
(the pipeline's `[sft] data = PATH` builds a second DataSpec with that source and loads it with the same
`load_data`). The comment above each field is its entry in the config reference.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from specco.model.config import check as _check

FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
TRUNCATIONS = ("error", "left", "drop")
FORMATS = ("auto", "chat", "compact", "cot", "rewrite", "lookup")
LOOKUP_CONTEXT = (16384, 32768)  # the lookup format's default ledger lengths, tokens


@dataclass(frozen=True)
class DataSpec:
    # The prompts: a .jsonl / .json / .parquet / .csv file, a `datasets.save_to_disk` directory, or
    # "reasoning_gym:NAME" (an endless procedural stream of that reasoning_gym dataset).
    source: str = "reasoning_gym:chain_sum"
    # reasoning_gym sources only: keyword arguments of that dataset's config, passed as given and nothing
    # else (e.g. {min_terms = 2, max_terms = 3} for chain_sum); `seed` and `size` are the stream's own.
    options: dict[str, Any] = field(default_factory=dict)
    # Files: the column holding the prompt, a string or chat messages [{role, content}, ...].
    prompt_key: str = "prompt"
    # Files: the column holding the reference answer (for built-in rewards and, lacking a completion, SFT);
    # dotted paths reach into nested columns ("reward_model.ground_truth"). "" = auto: `answer`, else verl's
    # `reward_model.ground_truth`, else `solution`, else none.
    answer_key: str = ""
    # Files: the column holding a reference completion for SFT (a string, or assistant messages). "" = auto:
    # `completion`, `response`, `output`, else the answer (answer_key). Rows need one only for SFT.
    completion_key: str = ""
    # A system message put first when a row's prompt has none ("" = none; reasoning_gym's chat format then
    # uses reasoning_gym's default system prompt, which asks for <answer> tags).
    system_prompt: str = ""
    # How prompts are templated: "" = the tokenizer's own chat template when it has one (else raw text);
    # a path to a Jinja chat template file; "none" = raw prompt text, no template.
    chat_template: str = ""
    # reasoning_gym sources only: "chat" (the question, the system prompt, answer in <answer> tags), or the
    # from-scratch char model's arithmetic formats "compact" (`4-1-7=` -> `-4`), "cot" (worked partial sums,
    # then `>-4`), "rewrite" (the chain rewritten line by line, the long-reasoning workload), "lookup" (the
    # chain's terms are named facts hidden in a long ledger of distractors; the completion looks each one up, then
    # rewrites: the long-context workload). "auto" = chat when a chat template is in use, else cot.
    format: str = "auto"
    # "lookup" only: the prompt's length range in tokens [lo, hi], drawn log-uniformly per prompt
    # ([] = [16384, 32768]; [n, n] = every prompt ~n tokens).
    context_tokens: tuple[int, ...] = ()
    # "cot" / "rewrite": the fraction of SFT references that show their worked steps; the rest answer
    # directly ('>-4'), so RL has a mode to discover (procedural.shows_steps).
    cot_fraction: float = 0.25
    # The longest prompt in tokens after templating (0 = no limit); see `truncation`.
    max_prompt_tokens: int = 0
    # A prompt over max_prompt_tokens: "error" (stop before training, naming the row), "left" (keep its
    # last max_prompt_tokens tokens) or "drop" (leave the row out; the count is logged).
    truncation: str = "error"
    # A held-out eval file (same keys as `source`); "" = none, or `eval_fraction` of `source`.
    eval: str = ""
    # The fraction of a `source` file's rows held out for evaluation (chosen by `seed`; 0 = none).
    eval_fraction: float = 0.0
    # Eval prompts per evaluation: for files the first eval_size rows of the eval split (0 = all), for
    # reasoning_gym the first eval_size items of a stream disjoint from training.
    eval_size: int = 64
    # Visit a file's training rows in a new seeded order every epoch (else in file order).
    shuffle: bool = True
    # Seeds the held-out split (eval_fraction) and the reasoning_gym eval stream -- not the run's seed, so
    # runs with different train seeds evaluate on the same prompts. The training order is the run seed's.
    seed: int = 0

    def __post_init__(self):
        object.__setattr__(self, "options", dict(self.options))
        for name in ("cot_fraction", "eval_fraction"):
            v = getattr(self, name)
            _check(isinstance(v, (int, float)) and math.isfinite(v), f"data.{name}={v!r}: must be a finite number")
        _check(isinstance(self.source, str) and self.source.strip() != "",
               "data.source is empty: set it to a .jsonl/.json/.parquet/.csv file, a save_to_disk directory or "
               "'reasoning_gym:NAME'")
        procedural = self.source.startswith("reasoning_gym:")
        _check(not procedural or self.source != "reasoning_gym:",
               "data.source='reasoning_gym:' names no dataset: write e.g. 'reasoning_gym:gsm_symbolic'")
        _check(not self.options or procedural,
               f"data.options={self.options}: options are reasoning_gym dataset arguments; data.source="
               f"{self.source!r} is a file -- remove data.options")
        _check(self.format in FORMATS, f"data.format={self.format!r}: choose from {', '.join(FORMATS)}")
        object.__setattr__(self, "context_tokens", tuple(self.context_tokens))
        ct = self.context_tokens
        _check(not ct or self.format == "lookup",
               f"data.context_tokens={list(ct)}: only the 'lookup' format has a context length; remove it or set "
               f"data.format = \"lookup\"")
        _check(not ct or (len(ct) == 2 and all(isinstance(x, int) for x in ct) and 16 <= ct[0] <= ct[1]),
               f"data.context_tokens={list(ct)}: give [lo, hi] token counts with 16 <= lo <= hi (e.g. [16384, 32768])")
        _check(0.0 <= self.cot_fraction <= 1.0,
               f"data.cot_fraction={self.cot_fraction}: must be in [0, 1] (1 = every SFT reference shows its steps)")
        _check(isinstance(self.max_prompt_tokens, int) and self.max_prompt_tokens >= 0,
               f"data.max_prompt_tokens={self.max_prompt_tokens!r}: must be an integer >= 0 (0 = no limit)")
        _check(self.truncation in TRUNCATIONS,
               f"data.truncation={self.truncation!r}: choose error, left (keep the last max_prompt_tokens "
               "tokens) or drop (leave the row out)")
        _check(0.0 <= self.eval_fraction < 1.0,
               f"data.eval_fraction={self.eval_fraction}: must be in [0, 1) (0 = no held-out split)")
        _check(not (self.eval and self.eval_fraction),
               f"data.eval={self.eval!r} and data.eval_fraction={self.eval_fraction}: choose one way to hold out "
               "eval prompts (set data.eval_fraction = 0 to use the eval file)")
        _check(not (procedural and (self.eval or self.eval_fraction)),
               "data.eval / data.eval_fraction: a reasoning_gym source evaluates on its own disjoint stream; "
               "remove them (data.eval_size sets how many)")
        _check(isinstance(self.eval_size, int) and self.eval_size >= 0,
               f"data.eval_size={self.eval_size!r}: must be an integer >= 0 (0 = the whole eval split)")
        _check(not (procedural and self.eval_size == 0),
               "data.eval_size=0 means 'all eval rows', but a reasoning_gym stream is endless: set a number")
        _check(isinstance(self.seed, int) and self.seed >= 0, f"data.seed={self.seed!r}: must be an integer >= 0")
        for key in ("prompt_key",):
            _check(bool(getattr(self, key)), f"data.{key} is empty: name the prompt column")

    @property
    def lookup_context(self) -> tuple[int, int]:
        """The lookup format's prompt length range (context_tokens, or its default)."""
        return tuple(self.context_tokens) if self.context_tokens else LOOKUP_CONTEXT

    @property
    def procedural(self) -> str | None:
        """NAME of a "reasoning_gym:NAME" source, else None (a file)."""
        return self.source.split(":", 1)[1] if self.source.startswith("reasoning_gym:") else None
