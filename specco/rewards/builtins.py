"""The built-in rewards: math, exact, reasoning_gym. Each is a scorer: `label`, a batched
`__call__(prompts, completions, completion_ids, columns) -> Scores`, and `close()`."""
from __future__ import annotations

import concurrent.futures as cf
import math
import multiprocessing
import os
import weakref

from specco.rewards.core import RewardSpec, Scores, shorten
from specco.rewards.extract import FORMATS, extract_answer, final_answer

AUTO_KEYS = ("answer", "reward_model.ground_truth", "solution")  # answer_key = "": the first present


def lookup(columns: dict, key: str):
    """columns["a"]["b"] for key "a.b"; KeyError when any step is missing."""
    value = columns
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(key)
        value = value[part]
    return value


def reference(columns: dict, answer_key: str, auto: tuple[str, ...] = AUTO_KEYS) -> str:
    """The row's reference answer as text: column `answer_key`, or the first of `auto` present. Raises
    ValueError naming the keys tried and the row's columns."""
    for key in (answer_key,) if answer_key else auto:
        try:
            value = lookup(columns, key)
        except KeyError:
            continue
        if value is not None:
            return str(value)
    tried = repr(answer_key) if answer_key else f"any of {list(auto)}"
    raise ValueError(f"no reference answer: the row has no column {tried} (its columns: {sorted(columns)}; "
                     "set answer_key)")


def _references(spec: RewardSpec, columns: list[dict], scores: Scores) -> list[str | None]:
    """Every row's reference with final_answer applied (a GSM8K '... #### 72' or a MATH solution's
    \\boxed{} reads as its answer); a missing one is that row's error."""
    refs = []
    for row, cols in enumerate(columns):
        try:
            ref = reference(cols, spec.answer_key)
        except ValueError as e:
            scores.errors[row] = str(e)
            refs.append(None)
            continue
        refs.append(final_answer(ref) or ref.strip())
    return refs


def normalize(text: str) -> str:
    """exact's comparison form: whitespace runs removed, lower case ('  The Answer ' == 'theanswer')."""
    return "".join(text.split()).lower()


class ExactReward:
    """1.0 when the completion's final answer (or, with none, its stripped text) equals the reference's
    after `normalize`, else 0.0."""
    label = "exact"

    def __init__(self, spec: RewardSpec):
        self.spec = spec

    def __call__(self, prompts, completions, completion_ids, columns) -> Scores:
        scores = Scores(values=[None] * len(completions))
        for row, (text, ref) in enumerate(zip(completions, _references(self.spec, columns, scores))):
            if ref is not None:
                ans = final_answer(text)
                scores.values[row] = float(normalize(ans if ans is not None else text.strip()) == normalize(ref))
        return scores

    def close(self):
        pass


class MathReward:
    """1.0 when math_verify finds the completion's final answer equivalent to the reference, else 0.0 (no
    final answer -- no \\boxed{}, ####, or <answer> -- is 0.0 without verification).

    Verification runs in a pool of spawned processes (specco.rewards.math_worker says why), created at the
    first call and reused; each call sends its rows in chunks, a few per worker. Each row has timeout_s
    inside its worker; the call as a whole has a deadline of that per row a worker handles plus a start-up
    grace, past which the pool is killed (a hang the worker's timer could not break), the unfinished rows
    count as timeouts and the next call starts a new pool."""
    label = "math"
    GRACE_S = 60.0  # the pool's first start (spawn, imports of math_verify/sympy) and scheduling slack

    def __init__(self, spec: RewardSpec):
        from specco.rewards import math_worker  # imports math_verify: fail here if it is not installed

        self.spec, self._worker = spec, math_worker
        self.row_fn = math_worker.verify_row  # what a worker runs per row (a test swaps in a sleeper)
        self.workers = spec.workers or min(8, os.cpu_count() or 1)
        self._pool: cf.ProcessPoolExecutor | None = None
        self._finalizer = None

    def _executor(self) -> cf.ProcessPoolExecutor:
        if self._pool is None:
            # spawn: a fork of a trainer holding CUDA contexts and threads is unsafe; the worker module
            # imports only math_verify, so a spawned worker starts in about a second.
            self._pool = cf.ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"))
            self._finalizer = weakref.finalize(self, _shutdown, self._pool)
        return self._pool

    def verify(self, pairs: list[tuple[str, str]]) -> list[tuple[float, bool]]:
        """(score, timed_out) per (gold, pred) pair, verified in the pool."""
        if not pairs:
            return []
        pool = self._executor()
        size = max(1, math.ceil(len(pairs) / (4 * self.workers)))  # ~4 chunks per worker: balance vs IPC
        chunks = [pairs[i:i + size] for i in range(0, len(pairs), size)]
        futures = [pool.submit(self._worker.verify_chunk, c, float(self.spec.timeout_s), self.row_fn) for c in chunks]
        deadline = math.ceil(len(pairs) / self.workers) * self.spec.timeout_s + self.GRACE_S
        done, _ = cf.wait(futures, timeout=deadline)
        out: list[tuple[float, bool]] = []
        hung = False
        for fut, chunk in zip(futures, chunks):
            if fut in done and fut.exception() is None:
                out.extend(fut.result())
            else:  # past the deadline, or a worker died: every row of the chunk is a timeout
                hung = True
                out.extend([(0.0, True)] * len(chunk))
        if hung:
            self.close()  # kills what still runs; the next call starts a fresh pool
        return out

    def __call__(self, prompts, completions, completion_ids, columns) -> Scores:
        scores = Scores(values=[None] * len(completions))
        rows, pairs = [], []
        for row, (text, ref) in enumerate(zip(completions, _references(self.spec, columns, scores))):
            if ref is None:
                continue
            pred = final_answer(text)
            if pred is None:
                scores.values[row] = 0.0
            else:
                rows.append(row)
                pairs.append((ref, pred))
        timeouts = 0
        for row, (score, timed_out) in zip(rows, self.verify(pairs)):
            scores.values[row] = score
            timeouts += timed_out
        scores.counts["reward/math_timeouts"] = float(timeouts)
        return scores

    def close(self):
        if self._finalizer is not None:
            self._finalizer()  # runs _shutdown once
        self._pool, self._finalizer = None, None


def _shutdown(pool: cf.ProcessPoolExecutor):
    """Stop a pool without waiting on a hung worker: cancel queued chunks, kill the processes. Killing is
    the only way to stop a running task; `_processes` is the executor's private map of its workers (Python
    3.14 adds a public `terminate_workers()`), read here and nowhere else."""
    procs = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)


class ReasoningGymReward:
    """reasoning_gym's own `score_answer(answer, entry)` for the row's dataset (columns["data_source"] =
    "reasoning_gym:NAME", or the entry's metadata["source_dataset"]), on the answer read per the row's
    columns["format"] (extract.extract_answer; "chat" -- <answer> tags -- when the row has none). The
    entry is the row's question / answer / metadata columns. Scores are reasoning_gym's: 1.0 right, 0.0
    wrong, partial credit on some datasets."""
    label = "reasoning_gym"
    PREFIX = "reasoning_gym:"

    def __init__(self, spec: RewardSpec):
        import reasoning_gym  # ~1.5 s; fail at construction if it is not installed

        self.spec, self._rg, self._score_fns = spec, reasoning_gym, {}

    def _score_fn(self, name: str):
        fn = self._score_fns.get(name)
        if fn is None:
            try:
                fn = self._rg.get_score_answer_fn(name)
            except ValueError:
                raise ValueError(f"reasoning_gym has no dataset {name!r}") from None
            self._score_fns[name] = fn
        return fn

    def __call__(self, prompts, completions, completion_ids, columns) -> Scores:
        scores = Scores(values=[None] * len(completions))
        for row, (text, cols) in enumerate(zip(completions, columns)):
            try:
                source = cols.get("data_source") or ""
                name = (source[len(self.PREFIX):] if isinstance(source, str) and source.startswith(self.PREFIX)
                        else (cols.get("metadata") or {}).get("source_dataset"))
                if not name:
                    raise ValueError(f"not a reasoning_gym row: data_source={shorten(source)} (expected "
                                     f"'{self.PREFIX}NAME') and no metadata['source_dataset']")
                fmt = cols.get("format") or "chat"
                if fmt not in FORMATS:
                    raise ValueError(f"format={shorten(fmt)}: choose from {FORMATS}")
                entry = {k: cols[k] for k in ("question", "answer", "metadata") if k in cols}
                scores.values[row] = float(self._score_fn(name)(extract_answer(text, fmt), entry))
            except Exception as e:  # reasoning_gym's scorer on an unexpected entry, or the checks above
                scores.errors[row] = f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e)
                scores.causes[row] = e
        return scores

    def close(self):
        pass


def make_builtin(spec: RewardSpec):
    """The scorer of a built-in spec (its name was checked by RewardSpec)."""
    return {"math": MathReward, "exact": ExactReward, "reasoning_gym": ReasoningGymReward}[spec.name](spec)
