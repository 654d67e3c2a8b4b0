"""Rewards the user chooses: `[[reward]]` tables -> one `Rewards` object, called once per step.

    rewards = Rewards([RewardSpec(name="math"), RewardSpec(fn="my_rewards.py:format_reward", weight=0.2)])
    batch = rewards(prompts, completions, completion_ids, columns)   # N = prompts x G rows
    batch.rewards, batch.valid, batch.metrics

Rows. Row r of a step is one completion; its prompt, ids and `columns` (every other column of its dataset
row: `answer`, verl's `data_source` / `reward_model` / `extra_info`, reasoning_gym's `metadata`...) are
row-aligned lists -- the caller repeats an example's prompt and columns for its G completions.

Combination (TRL's rule): reward_r = sum_i weight_i * r_i(row r) over the functions i that scored row r;
a function returns None for a row it does not apply to (TRL's "not applicable", its nansum). A row for
which every function returned None is *excluded*: valid[r] = False, reward 0, counted in
`reward/excluded_rows`. The trainer must give invalid rows no gradient (drop them from the GRPO group
statistics and mask their loss); their 0 is only a placeholder. (TRL instead warns and scores such a row
nansum([]) = 0, which would pull a GRPO group's mean towards rows no function could judge.)

Errors. Everything about a spec -- the built-in's name, the user file, the function's name and signature,
weights -- is resolved in the constructor, before any training. What a function does at run time (raises,
returns the wrong length, NaN/inf, a non-number) is a `RewardError` naming the function, the row, the
prompt and the value (on_error="stop", the default), or, with on_error="skip", that row leaves the step:
valid[r] = False, counted in `reward/skipped_rows`. Where no row can be blamed -- a TRL batch function
that raises or returns a list of the wrong length -- skip drops every row of the step: scoring those rows
without that function would silently change the objective for one step, which is worse than losing it.
"""
from __future__ import annotations

import difflib
import math
import numbers
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

BUILTINS = ("math", "exact", "reasoning_gym")
ON_ERROR = ("stop", "skip")


class RewardError(ValueError):
    """A reward spec that cannot be resolved, or a reward function that misbehaved on a row."""


@dataclass(frozen=True)
class RewardSpec:
    """One `[[reward]]` table."""
    # a built-in: "math" (math_verify equivalence of the final answer: \boxed{}, else after ####, else
    # <answer> tags), "exact" (that answer, or the stripped text, equals the reference up to whitespace
    # and case), "reasoning_gym" (the row's reasoning_gym dataset's own score_answer)
    name: str = ""
    # or a user function: "path/to/file.py:name" (relative to the working directory, or absolute) or
    # "package.module:name"; TRL's fn(prompts, completions, completion_ids, **columns) -> list[float | None]
    # or verl's compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict.
    # Exactly one of name / fn.
    fn: str = ""
    # the combined reward is sum(weight * reward) over the functions that scored the row; finite
    weight: float = 1.0
    # math / exact / verl: the column holding the reference answer, dots reaching into dicts
    # ("reward_model.ground_truth"); "" = the first present of answer, reward_model.ground_truth,
    # solution (verl functions: reward_model.ground_truth first)
    answer_key: str = ""
    # math: seconds one row's verification may take; a row past it scores 0 (reward/math_timeouts)
    timeout_s: float = 5.0
    # math: verification processes (0 = min(8, CPU count)); started at the first step, reused
    workers: int = 0
    # "stop": a failing function is an error naming function, row and value; "skip": the row is
    # dropped from the step (valid = False) and counted in reward/skipped_rows
    on_error: str = "stop"

    def __post_init__(self):
        if bool(self.name) == bool(self.fn):
            raise RewardError(f"reward {self.label_hint}: set exactly one of name (a built-in: {BUILTINS}) "
                              "or fn ('path/to/file.py:name' or 'module:name')")
        if self.name and self.name not in BUILTINS:
            close = difflib.get_close_matches(self.name, BUILTINS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise RewardError(f"reward name={self.name!r}: not a built-in {BUILTINS}{hint} "
                              "(a function of your own goes in fn)")
        if not (isinstance(self.weight, numbers.Real) and math.isfinite(self.weight)):
            raise RewardError(f"reward {self.label_hint}: weight={self.weight!r} must be a finite number")
        if not (isinstance(self.timeout_s, numbers.Real) and self.timeout_s > 0 and math.isfinite(self.timeout_s)):
            raise RewardError(f"reward {self.label_hint}: timeout_s={self.timeout_s!r} must be > 0 seconds")
        if self.workers < 0:
            raise RewardError(f"reward {self.label_hint}: workers={self.workers} must be >= 0 (0 = automatic)")
        if self.on_error not in ON_ERROR:
            raise RewardError(f"reward {self.label_hint}: on_error={self.on_error!r}: choose from {ON_ERROR}")

    @property
    def label_hint(self) -> str:
        """How messages name this spec: name='math' or fn='file.py:f'."""
        return f"name={self.name!r}" if self.name else f"fn={self.fn!r}"


@dataclass
class RewardBatch:
    """One step's rewards. rewards: (N,) float32, the weighted sum (0 where invalid); valid: (N,) bool,
    False for excluded (all None) and skipped rows; metrics: scalars for the step's log (see `Rewards`);
    full_marks: (N,) bool, every function that scored the row gave it >= 1 (the `accuracy` metrics count these:
    a built-in's 1 is a correct answer)."""
    rewards: torch.Tensor
    valid: torch.Tensor
    metrics: dict[str, float]
    full_marks: torch.Tensor | None = None


@dataclass
class Scores:
    """What one reward function produced for a step, before combination.

    values: one per row, a float or None (not applicable). errors: row -> message for rows it failed
    on. batch_error: a message when no row can be blamed (the whole step failed for it). extras: verl
    dict keys -> {row: value}. counts: summed metrics (math's timeouts). causes: the exception behind an
    error (row, or -1 for the batch), chained to the RewardError so the user's traceback is kept."""
    values: list[float | None]
    errors: dict[int, str] = field(default_factory=dict)
    batch_error: str | None = None
    extras: dict[str, dict[int, float]] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=dict)
    causes: dict[int, BaseException] = field(default_factory=dict)


def shorten(value, n: int = 80) -> str:
    """repr(value), cut to n characters for an error message."""
    r = repr(value)
    return r if len(r) <= n else r[: n - 3] + "..."


def as_reward(value) -> float | None:
    """A function's value for one row -> float, or None (not applicable). Raises ValueError with the reason
    for NaN/inf and for anything that is not a real number (bool counts as 0/1; numpy and 0-d torch
    scalars are accepted)."""
    if value is None:
        return None
    if isinstance(value, (str, bytes, complex)) or not (isinstance(value, numbers.Real) or hasattr(value, "__float__")):
        raise ValueError("not a number")
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError("not a number") from None
    if not math.isfinite(x):
        raise ValueError("not finite")
    return x


class Rewards:
    """The step's reward: every `RewardSpec` resolved once (built-ins set up, user files imported,
    signatures checked -- all errors here), then called once per step. See the module docstring for the
    combination, exclusion and error rules; `close()` (or `with Rewards(...)`) stops math's workers.

    metrics: "time/reward" (seconds for the call), "time/reward/<label>" per function, "reward/<label>"
    (the function's mean over valid rows it scored, unweighted), "reward/<label>/<key>" (a verl dict
    return's other numeric keys, mean over valid rows), "reward/excluded_rows", "reward/skipped_rows",
    "reward/math_timeouts" (with a math reward). <label> is the built-in's name or the function's name
    (suffixed _2, _3 when repeated)."""

    def __init__(self, specs: Sequence[RewardSpec]):
        from specco.rewards.builtins import make_builtin
        from specco.rewards.user import load_user_fn

        if not specs:
            raise RewardError("no rewards: give at least one [[reward]] (a built-in name or a fn)")
        self.specs = tuple(specs)
        self.scorers, self.labels, seen = [], [], {}
        try:
            for spec in self.specs:
                scorer = make_builtin(spec) if spec.name else load_user_fn(spec)
                base = scorer.label
                seen[base] = seen.get(base, 0) + 1
                self.labels.append(base if seen[base] == 1 else f"{base}_{seen[base]}")
                self.scorers.append(scorer)
        except BaseException:
            self.close()
            raise

    def __call__(self, prompts: list, completions: list[str], completion_ids: list[list[int]],
                 columns: list[dict]) -> RewardBatch:
        n = len(completions)
        if not (len(prompts) == len(completion_ids) == len(columns) == n):
            raise ValueError(f"rewards: row-aligned inputs differ in length: prompts {len(prompts)}, completions {n}, "
                             f"completion_ids {len(completion_ids)}, columns {len(columns)}")
        t0 = time.perf_counter()
        total = [0.0] * n
        scored = [False] * n  # some function returned a number for the row
        perfect = [True] * n  # every function that scored the row gave it >= 1
        skipped = [False] * n  # on_error="skip" dropped the row
        per_fn: list[tuple[str, Scores]] = []
        metrics: dict[str, float] = {}
        for spec, label, scorer in zip(self.specs, self.labels, self.scorers):
            t = time.perf_counter()
            s = scorer(prompts, completions, completion_ids, columns)
            metrics[f"time/reward/{label}"] = time.perf_counter() - t
            if s.batch_error is not None:
                if spec.on_error == "stop":
                    raise RewardError(f"reward {spec.label_hint}: {s.batch_error}") from s.causes.get(-1)
                skipped = [True] * n
            for row in sorted(s.errors):
                if spec.on_error == "stop":
                    raise RewardError(f"reward {spec.label_hint} row {row} (prompt {shorten(prompts[row])}): "
                                      f"{s.errors[row]}") from s.causes.get(row)
                skipped[row] = True
            for row, v in enumerate(s.values):
                if v is not None and row not in s.errors:
                    total[row] += spec.weight * v
                    scored[row] = True
                    perfect[row] = perfect[row] and v >= 1.0
            for k, c in s.counts.items():
                metrics[k] = metrics.get(k, 0.0) + c
            per_fn.append((label, s))
        valid = [a and not b for a, b in zip(scored, skipped)]
        for label, s in per_fn:  # means over the step's valid rows only: what the trainer learns from
            vals = [v for r, v in enumerate(s.values) if v is not None and valid[r] and r not in s.errors]
            if vals:
                metrics[f"reward/{label}"] = sum(vals) / len(vals)
            for key, by_row in s.extras.items():
                xs = [x for r, x in by_row.items() if valid[r]]
                if xs:
                    metrics[f"reward/{label}/{key}"] = sum(xs) / len(xs)
        metrics["reward/excluded_rows"] = float(sum(not a and not b for a, b in zip(scored, skipped)))
        metrics["reward/skipped_rows"] = float(sum(skipped))
        valid_t = torch.tensor(valid, dtype=torch.bool)
        rewards = torch.tensor(total, dtype=torch.float32).masked_fill(~valid_t, 0.0)
        metrics["time/reward"] = time.perf_counter() - t0
        return RewardBatch(rewards=rewards, valid=valid_t, metrics=metrics,
                           full_marks=torch.tensor(perfect, dtype=torch.bool) & valid_t)

    def close(self):
        """Stop the worker processes (math). Idempotent; the object is unusable afterwards for math."""
        for scorer in getattr(self, "scorers", ()):
            scorer.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
