"""The user's reward functions: loading `fn = "file.py:name"` / `"module:name"`, telling TRL's signature
from verl's, and calling each the way its own framework does.

TRL (GRPOTrainer's convention): `fn(prompts, completions, completion_ids, **kwargs) -> list[float | None]`,
called once per step with every other dataset column as a keyword holding a row-aligned list. With
conversational prompts (lists of {"role", "content"} messages) each completion is
`[{"role": "assistant", "content": text}]`, else the text. TRL (GRPOTrainer._calculate_rewards) passes
every column of inputs[0] plus `trainer_state`, so there a function without **kwargs fails with a
TypeError; specco passes a function without **kwargs only the parameters it declares (a declared column
the data lacks, with no default, is an error naming it), so `def f(completions, answer)` works here.
`trainer_state` has no specco counterpart and is not passed.

verl (its `compute_score`): `compute_score(data_source, solution_str, ground_truth, extra_info=None,
**kwargs) -> float | dict`, called once per row with columns["data_source"], the completion text,
columns["reward_model"]["ground_truth"] (or answer_key / the auto columns) and columns.get("extra_info");
extra_info is passed only when the function accepts it. A dict return holds "score"; its other numeric
keys are logged as reward/<label>/<key>.

A None (TRL: per row; verl: the return) means "not applicable" (specco.rewards.core says how rows combine).
"""
from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys

from specco.rewards.builtins import AUTO_KEYS, reference
from specco.rewards.core import RewardError, RewardSpec, Scores, as_reward, shorten

VERL_PARAMS = ("data_source", "solution_str", "ground_truth")
TRL_PARAMS = ("prompts", "completions", "completion_ids")
SIGNATURES = ("TRL: fn(prompts, completions, completion_ids, **kwargs) -> list[float | None], once per step; "
              "verl: compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict, "
              "once per row")


def _import_file(path: str, spec: RewardSpec):
    """Import a .py file as a module of its own (named from its absolute path, so two files called
    rewards.py do not collide), registered in sys.modules so its dataclasses and pickling work."""
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise RewardError(f"reward fn={spec.fn!r}: no file {full} (a path is relative to the working "
                          f"directory {os.getcwd()}, or absolute)")
    mod_name = f"specco_reward_{os.path.splitext(os.path.basename(full))[0]}_{hashlib.sha1(full.encode()).hexdigest()[:8]}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    module_spec = importlib.util.spec_from_file_location(mod_name, full)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[mod_name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException as e:
        del sys.modules[mod_name]
        raise RewardError(f"reward fn={spec.fn!r}: importing {full} failed: {type(e).__name__}: {e}") from e
    return module


def resolve(spec: RewardSpec):
    """The callable that spec.fn names. A target containing '/' or ending '.py' is a file; otherwise a
    module on sys.path. A missing name suggests the module's nearest callables."""
    target, sep, attr = spec.fn.rpartition(":")
    if not sep or not target or not attr:
        raise RewardError(f"reward fn={spec.fn!r}: expected 'path/to/file.py:name' or 'package.module:name'")
    if target.endswith(".py") or "/" in target or os.sep in target:
        module = _import_file(target, spec)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise RewardError(f"reward fn={spec.fn!r}: cannot import module {target!r}: {e} (a file needs "
                              "its .py path)") from e
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        names = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                 and not inspect.isclass(v) and not inspect.ismodule(v)]
        close = difflib.get_close_matches(attr, names, n=3)
        hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else f"; its functions: {sorted(names)}"
        what = "not callable" if fn is not None else "not found"
        raise RewardError(f"reward fn={spec.fn!r}: {attr!r} {what} in {target}{hint}")
    return fn


def load_user_fn(spec: RewardSpec):
    """The scorer for a user function: a TrlFunction or a VerlFunction, by signature."""
    fn = resolve(spec)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError) as e:
        raise RewardError(f"reward fn={spec.fn!r}: cannot read its signature ({e}); accepted: {SIGNATURES}") from e
    names = [p.name for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if tuple(names[:3]) == VERL_PARAMS:
        return VerlFunction(fn, spec, params)
    if "prompts" in params or "completions" in params:
        if spec.answer_key:
            raise RewardError(f"reward fn={spec.fn!r}: answer_key is for built-ins and verl functions; a TRL "
                              "function reads any column by naming it as a parameter")
        return TrlFunction(fn, spec, params)
    raise RewardError(f"reward fn={spec.fn!r}: signature {inspect.signature(fn)} is neither accepted form: "
                      f"{SIGNATURES}")


def _label(fn, spec: RewardSpec) -> str:
    return getattr(fn, "__name__", None) or spec.fn.rpartition(":")[2]


class TrlFunction:
    """A TRL-style batch reward (module docstring)."""

    def __init__(self, fn, spec: RewardSpec, params):
        self.fn, self.spec, self.label = fn, spec, _label(fn, spec)
        bad = [p.name for p in params.values() if p.kind is p.POSITIONAL_ONLY]
        if bad:
            raise RewardError(f"reward fn={spec.fn!r}: positional-only parameters {bad}; TRL passes keywords")
        self.var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
        self.accepts = {p.name for p in params.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        self.required = {p.name for p in params.values()
                         if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty}

    def __call__(self, prompts, completions, completion_ids, columns) -> Scores:
        n = len(completions)
        conversational = bool(prompts) and isinstance(prompts[0], list)  # TRL: is_conversational(inputs[0])
        kwargs = {"prompts": list(prompts),
                  "completions": [[{"role": "assistant", "content": c}] for c in completions]
                  if conversational else list(completions),
                  "completion_ids": list(completion_ids)}
        keys = dict.fromkeys(k for cols in columns for k in cols)  # every row's columns, first-seen order
        for k in keys:  # a column named like a TRL argument would shadow it: the argument wins
            kwargs.setdefault(k, [cols.get(k) for cols in columns])
        if not self.var_kw:
            missing = self.required - kwargs.keys()
            if missing:  # the data, not the function, is at fault: always an error, never skipped
                raise RewardError(f"reward fn={self.spec.fn!r}: parameter(s) {sorted(missing)} name no column of "
                                  f"the data (its columns: {list(keys)})")
            kwargs = {k: v for k, v in kwargs.items() if k in self.accepts}
        scores = Scores(values=[None] * n)
        try:
            out = self.fn(**kwargs)
        except Exception as e:
            scores.batch_error = f"raised {type(e).__name__}: {e} (a batch function: no row to blame)"
            scores.causes[-1] = e
            return scores
        try:
            out = list(out)
        except TypeError:
            scores.batch_error = f"returned {shorten(out)}, not a list of {n} rewards"
            return scores
        if len(out) != n:
            scores.batch_error = f"returned {len(out)} values for {n} rows (one float or None per completion)"
            return scores
        for row, v in enumerate(out):
            try:
                scores.values[row] = as_reward(v)
            except ValueError as e:
                scores.errors[row] = f"returned {shorten(v)}: {e}"
        return scores

    def close(self):
        pass


class VerlFunction:
    """A verl-style per-row `compute_score` (module docstring)."""

    def __init__(self, fn, spec: RewardSpec, params):
        self.fn, self.spec, self.label = fn, spec, _label(fn, spec)
        self.pass_extra = "extra_info" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
        self.auto = ("reward_model.ground_truth",) + tuple(k for k in AUTO_KEYS if k != "reward_model.ground_truth")

    def __call__(self, prompts, completions, completion_ids, columns) -> Scores:
        scores = Scores(values=[None] * len(completions))
        for row, (text, cols) in enumerate(zip(completions, columns)):
            try:
                truth = reference(cols, self.spec.answer_key, self.auto)
            except ValueError as e:
                scores.errors[row] = str(e)
                continue
            kwargs = dict(data_source=cols.get("data_source"), solution_str=text, ground_truth=truth)
            if self.pass_extra:
                kwargs["extra_info"] = cols.get("extra_info")
            try:
                out = self.fn(**kwargs)
            except Exception as e:
                scores.errors[row] = f"raised {type(e).__name__}: {e}"
                scores.causes[row] = e
                continue
            try:
                if isinstance(out, dict):
                    if "score" not in out:
                        raise ValueError(f"a dict return needs a 'score' key (keys: {sorted(out)})")
                    for key, x in out.items():
                        if key != "score":
                            try:
                                extra = as_reward(x)
                            except ValueError:
                                continue  # verl logs only the numeric extras
                            if extra is not None:
                                scores.extras.setdefault(key, {})[row] = extra
                    out = out["score"]
                scores.values[row] = as_reward(out)
            except ValueError as e:
                scores.errors[row] = f"returned {shorten(out)}: {e}"
        return scores

    def close(self):
        pass
