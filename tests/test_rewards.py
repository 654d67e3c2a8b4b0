"""specco.rewards: extraction, the built-ins (math in its process pool, exact, reasoning_gym), TRL and
verl user functions, None exclusion, weights, and every error naming function, row and value.

One math pool serves the whole file (the module fixture `math_rewards`); the timeout tests swap the row
function of that pool's scorer for `sleepy_row` below, which the spawned workers import from this module.
"""
import dataclasses
import math
import textwrap
import time

import pytest
import reasoning_gym
import torch

from reward_helpers import sleepy_row
from specco.rewards import RewardError, Rewards, RewardSpec, extract_answer, final_answer, last_boxed


def rows(n):
    """Row-aligned placeholder prompts and ids for n rows."""
    return [f"prompt {i}" for i in range(n)], [[i] for i in range(n)]


# -- extraction ------------------------------------------------------------------------------------

def test_final_answer_boxed_hashes_tags():
    assert last_boxed(r"a \boxed{1} then \boxed{\frac{1}{\sqrt{2}}} end") == r"\frac{1}{\sqrt{2}}"
    assert last_boxed(r"\boxed{3} and a cut-off \boxed{\frac{1}{2") == "3"  # unbalanced last box: the one before
    assert last_boxed(r"so $\boxed 5$") == "5"
    assert final_answer(r"x \boxed{7} #### 8 <answer>9</answer>") == "7"  # boxed first
    assert final_answer("Natalia sold 48/2 = 24 clips.\n#### 72\n") == "72"  # GSM8K
    assert final_answer("think <answer> 1 </answer> more <answer>42</answer>") == "42"  # last tag
    assert final_answer("just 42") is None


def test_extract_answer_formats():
    assert extract_answer("<think>x</think><answer>-4</answer>", "chat") == "-4"
    assert extract_answer("4-1=3,3-7=-4>-4", "cot") == "-4"
    assert extract_answer("+004-1-7\n>-4", "rewrite") == "-4"
    assert extract_answer("no answer", "cot") is None
    assert extract_answer(" -4 ", "compact") == "-4"
    with pytest.raises(ValueError, match="choose from"):
        extract_answer("x", "latex")


# -- math ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def math_rewards():
    with Rewards([RewardSpec(name="math", workers=2)]) as r:
        yield r


def test_math_verify_equivalences(math_rewards):
    completions = [r"so \boxed{\frac{1}{2}}", "#### 0.5", r"<answer>$42$</answer>", r"\boxed{41}",
                   "42 with no marker", r"\boxed{x^2+1}"]
    cols = [{"answer": "0.5"}, {"answer": r"\frac{1}{2}"}, {"answer": "42"},
            {"reward_model": {"ground_truth": "42"}}, {"answer": "42"}, {"solution": r"hence \boxed{1+x^2}"}]
    prompts, ids = rows(6)
    b = math_rewards(prompts, completions, ids, cols)
    assert b.rewards.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    assert b.rewards.dtype == torch.float32 and b.valid.all()
    assert b.metrics["reward/math"] == pytest.approx(4 / 6)
    assert b.metrics["reward/math_timeouts"] == 0 and b.metrics["time/reward"] > 0


def test_math_timeout_scores_zero_and_counts(math_rewards, monkeypatch):
    scorer = math_rewards.scorers[0]
    monkeypatch.setattr(scorer, "row_fn", sleepy_row)
    monkeypatch.setattr(scorer, "spec", dataclasses.replace(scorer.spec, timeout_s=0.3))
    prompts, ids = rows(3)
    t0 = time.perf_counter()
    b = math_rewards(prompts, [r"\boxed{slow}", r"\boxed{7}", r"\boxed{slow}"], ids, [{"answer": "7"}] * 3)
    assert time.perf_counter() - t0 < 10
    assert b.rewards.tolist() == [0.0, 1.0, 0.0] and b.valid.all()
    assert b.metrics["reward/math_timeouts"] == 2


def test_math_hang_past_the_timer_kills_the_pool(math_rewards, monkeypatch):
    scorer = math_rewards.scorers[0]
    monkeypatch.setattr(scorer, "row_fn", sleepy_row)
    monkeypatch.setattr(scorer, "spec", dataclasses.replace(scorer.spec, timeout_s=0.3))
    monkeypatch.setattr(scorer, "GRACE_S", 2.0)
    prompts, ids = rows(2)
    b = math_rewards(prompts, [r"\boxed{stuck}", r"\boxed{stuck}"], ids, [{"answer": "7"}] * 2)
    assert b.rewards.tolist() == [0.0, 0.0] and b.metrics["reward/math_timeouts"] == 2
    assert scorer._pool is None  # killed; the next call starts a new one
    monkeypatch.undo()
    b = math_rewards(prompts, [r"\boxed{7}", r"\boxed{8}"], ids, [{"answer": "7"}] * 2)
    assert b.rewards.tolist() == [1.0, 0.0]


def test_math_missing_reference_names_row():
    with Rewards([RewardSpec(name="exact")]) as r:
        prompts, ids = rows(2)
        with pytest.raises(RewardError, match=r"name='exact' row 1 \(prompt 'prompt 1'\).*no reference answer.*'question'"):
            r(prompts, ["1", "2"], ids, [{"answer": "1"}, {"question": "q"}])
    with Rewards([RewardSpec(name="exact", answer_key="extra_info.gold")]) as r:
        b = r(prompts, ["1", "2"], ids, [{"extra_info": {"gold": "1"}}, {"extra_info": {"gold": "3"}}])
        assert b.rewards.tolist() == [1.0, 0.0]


# -- exact, reasoning_gym --------------------------------------------------------------------------

def test_exact():
    with Rewards([RewardSpec(name="exact")]) as r:
        prompts, ids = rows(4)
        b = r(prompts, ["  Paris ", r"the city is \boxed{PARIS}", "London", "New  York"], ids,
              [{"answer": "paris"}] * 3 + [{"answer": "new york"}])
        assert b.rewards.tolist() == [1.0, 1.0, 0.0, 1.0]


def test_reasoning_gym_scores_real_entries():
    entries = list(reasoning_gym.create_dataset("basic_arithmetic", size=3, seed=0))
    fmts = ["chat", "cot", "compact"]
    cols = [{**e, "data_source": "reasoning_gym:basic_arithmetic", "format": f} for e, f in zip(entries, fmts)]
    right = [f"<think>easy</think><answer>{entries[0]['answer']}</answer>", f"1+1=2>{entries[1]['answer']}",
             f" {entries[2]['answer']} "]
    wrong = [entries[0]["answer"], "no steps", "999"]  # chat without tags; cot without '>'
    prompts, ids = rows(6)
    with Rewards([RewardSpec(name="reasoning_gym")]) as r:
        b = r(prompts, right + wrong, ids, cols + cols)
        assert b.rewards.tolist() == [1.0] * 3 + [0.0] * 3
        bare = [{k: v for k, v in c.items() if k != "data_source"} for c in cols]  # metadata.source_dataset
        assert r(prompts[:3], right, ids[:3], bare).rewards.tolist() == [1.0] * 3
        with pytest.raises(RewardError, match=r"row 0 .*not a reasoning_gym row: data_source='gsm8k'"):
            r(prompts[:1], right[:1], ids[:1], [{"data_source": "gsm8k", "answer": "1"}])
        with pytest.raises(RewardError, match=r"row 0 .*no dataset 'nonexistent'"):
            r(prompts[:1], right[:1], ids[:1], [{**cols[0], "data_source": "reasoning_gym:nonexistent"}])


# -- user functions --------------------------------------------------------------------------------

TRL_SRC = """
CALLS = []

def trl_reward(prompts, completions, completion_ids, **kwargs):
    CALLS.append(dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs))
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [None if t == "n/a" else float(len(t)) for t in texts]

def answer_only(completions, answer):
    return [float(c == a) for c, a in zip(completions, answer)]

def needs_column(completions, difficulty):
    return [0.0] * len(completions)

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    CALLS.append((data_source, solution_str, ground_truth, extra_info))
    if solution_str == "n/a":
        return None
    return {"score": float(solution_str == ground_truth), "acc": 1.0, "pred": solution_str}

def verl_no_extra(data_source, solution_str, ground_truth):
    return 0.5

def bad_signature(text, reference):
    return 0.0

def raises(prompts, completions, **kwargs):
    raise RuntimeError("boom")

def wrong_length(prompts, completions, **kwargs):
    return [1.0]

def returns(prompts, completions, **kwargs):
    return [RETURN.get(i, 1.0) for i in range(len(completions))]

RETURN = {}

def verl_raises(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "bad":
        raise KeyError("oops")
    return 1.0
"""


@pytest.fixture
def user_file(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent(TRL_SRC))
    monkeypatch.chdir(tmp_path)  # fn paths are relative to the working directory
    return "my_rewards.py"


def test_trl_function_gets_prompts_completions_ids_and_columns(user_file):
    cols = [{"answer": "a", "meta": {"k": 1}}, {"answer": "bb", "meta": {"k": 2}}]
    with Rewards([RewardSpec(fn=f"{user_file}:trl_reward")]) as r:
        calls = r.scorers[0].fn.__globals__["CALLS"]
        b = r(["p0", "p1"], ["xyz", "n/a"], [[1, 2], [3]], cols)
        assert calls[-1] == dict(prompts=["p0", "p1"], completions=["xyz", "n/a"], completion_ids=[[1, 2], [3]],
                                 answer=["a", "bb"], meta=[{"k": 1}, {"k": 2}])
        # row 1: the only function returned None -> excluded
        assert b.rewards.tolist() == [3.0, 0.0] and b.valid.tolist() == [True, False]
        assert b.metrics["reward/excluded_rows"] == 1 and b.metrics["reward/trl_reward"] == 3.0
        chat = [[{"role": "user", "content": "hi"}]] * 2
        r(chat, ["hello", "n/a"], [[1], [2]], cols)
        assert calls[-1]["prompts"] == chat
        assert calls[-1]["completions"] == [[{"role": "assistant", "content": "hello"}],
                                            [{"role": "assistant", "content": "n/a"}]]


def test_trl_function_without_kwargs_gets_only_its_parameters(user_file):
    with Rewards([RewardSpec(fn=f"{user_file}:answer_only")]) as r:
        b = r(["p0", "p1"], ["a", "x"], [[1], [2]], [{"answer": "a", "other": 1}, {"answer": "b", "other": 2}])
        assert b.rewards.tolist() == [1.0, 0.0]
    with Rewards([RewardSpec(fn=f"{user_file}:needs_column")]) as r:
        with pytest.raises(RewardError, match=r"needs_column.*\['difficulty'\] name no column.*'answer'"):
            r(["p"], ["a"], [[1]], [{"answer": "a"}])


def test_verl_compute_score_per_row_and_dict_extras(user_file):
    cols = [{"data_source": "gsm8k", "reward_model": {"ground_truth": "72"}, "extra_info": {"split": "train", "i": 0}},
            {"data_source": "gsm8k", "reward_model": {"ground_truth": "5"}, "extra_info": None},
            {"data_source": "math", "reward_model": {"ground_truth": "1"}}]
    with Rewards([RewardSpec(fn=f"{user_file}:compute_score"), RewardSpec(fn=f"{user_file}:verl_no_extra")]) as r:
        calls = r.scorers[0].fn.__globals__["CALLS"]
        calls.clear()
        b = r(["p0", "p1", "p2"], ["72", "6", "n/a"], [[1], [2], [3]], cols)
        assert calls == [("gsm8k", "72", "72", {"split": "train", "i": 0}), ("gsm8k", "6", "5", None),
                         ("math", "n/a", "1", None)]
        # row 2: compute_score said None, verl_no_extra 0.5 -> valid with 0.5
        assert b.rewards.tolist() == [1.5, 0.5, 0.5] and b.valid.all()
        assert b.metrics["reward/compute_score"] == 0.5 and b.metrics["reward/compute_score/acc"] == 1.0
        assert "reward/compute_score/pred" not in b.metrics  # non-numeric extras are not logged
        assert b.metrics["reward/verl_no_extra"] == 0.5


def test_weights_sum_and_none(user_file):
    specs = [RewardSpec(name="exact", weight=2.0), RewardSpec(fn=f"{user_file}:trl_reward", weight=-0.5)]
    with Rewards(specs) as r:
        b = r(["p0", "p1"], ["ab", "n/a"], [[1], [2]], [{"answer": "ab"}, {"answer": "zz"}])
        # row 0: 2*1 - 0.5*2; row 1: trl_reward None -> only exact's 2*0
        assert b.rewards.tolist() == [1.0, 0.0] and b.valid.all()
        assert b.metrics["reward/exact"] == 0.5 and b.metrics["reward/excluded_rows"] == 0


def test_duplicate_labels(user_file):
    with Rewards([RewardSpec(name="exact"), RewardSpec(name="exact", answer_key="alt")]) as r:
        assert r.labels == ["exact", "exact_2"]


# -- errors ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("ret, message", [
    (float("nan"), r"row 1 \(prompt 'p1'\): returned nan: not finite"),
    (math.inf, r"row 1 \(prompt 'p1'\): returned inf: not finite"),
    ("0.5", r"row 1 \(prompt 'p1'\): returned '0.5': not a number"),
    ([1.0], r"row 1 \(prompt 'p1'\): returned \[1.0\]: not a number"),
])
def test_bad_values_name_function_row_and_value(user_file, ret, message):
    with Rewards([RewardSpec(fn=f"{user_file}:returns")]) as r:
        r.scorers[0].fn.__globals__["RETURN"].update({1: ret})
        with pytest.raises(RewardError, match=r"fn='my_rewards.py:returns' " + message):
            r(["p0", "p1", "p2"], ["a", "b", "c"], [[1], [2], [3]], [{}] * 3)
    with Rewards([RewardSpec(fn=f"{user_file}:returns", on_error="skip")]) as r:
        r.scorers[0].fn.__globals__["RETURN"].update({1: ret})
        b = r(["p0", "p1", "p2"], ["a", "b", "c"], [[1], [2], [3]], [{}] * 3)
        assert b.valid.tolist() == [True, False, True] and b.rewards.tolist() == [1.0, 0.0, 1.0]
        assert b.metrics["reward/skipped_rows"] == 1 and b.metrics["reward/returns"] == 1.0


def test_batch_errors_raise_or_skip_the_step(user_file):
    for name, message in [("raises", r"raised RuntimeError: boom"), ("wrong_length", r"returned 1 values for 2 rows")]:
        with Rewards([RewardSpec(fn=f"{user_file}:{name}")]) as r:
            with pytest.raises(RewardError, match=rf"fn='my_rewards.py:{name}': {message}") as err:
                r(["p0", "p1"], ["a", "b"], [[1], [2]], [{}, {}])
            if name == "raises":  # the user's traceback stays attached
                assert isinstance(err.value.__cause__, RuntimeError)
        with Rewards([RewardSpec(fn=f"{user_file}:{name}", on_error="skip"), RewardSpec(name="exact")]) as r:
            b = r(["p0", "p1"], ["a", "b"], [[1], [2]], [{"answer": "a"}] * 2)
            assert not b.valid.any() and b.metrics["reward/skipped_rows"] == 2 and b.rewards.tolist() == [0.0, 0.0]


def test_verl_raise_names_row_and_skip_drops_only_it(user_file):
    cols = [{"data_source": "d", "reward_model": {"ground_truth": "1"}}] * 2
    with Rewards([RewardSpec(fn=f"{user_file}:verl_raises")]) as r:
        with pytest.raises(RewardError, match=r"verl_raises' row 1 \(prompt 'p1'\): raised KeyError: 'oops'"):
            r(["p0", "p1"], ["ok", "bad"], [[1], [2]], cols)
    with Rewards([RewardSpec(fn=f"{user_file}:verl_raises", on_error="skip")]) as r:
        b = r(["p0", "p1"], ["ok", "bad"], [[1], [2]], cols)
        assert b.valid.tolist() == [True, False] and b.metrics["reward/skipped_rows"] == 1


def test_construction_errors(user_file, tmp_path, monkeypatch):
    cases = [
        (dict(fn="missing.py:f"), r"fn='missing.py:f': no file .*missing.py"),
        (dict(fn=f"{user_file}:trl_rewrd"), r"'trl_rewrd' not found in my_rewards.py; did you mean 'trl_reward'"),
        (dict(fn=f"{user_file}:bad_signature"), r"bad_signature.*\(text, reference\) is neither accepted form: TRL: .*verl: "),
        (dict(fn="no_such_module_xyz:f"), r"cannot import module 'no_such_module_xyz'"),
        (dict(fn="os.path:joinn"), r"did you mean 'join'"),
        (dict(fn="just_a_name"), r"expected 'path/to/file.py:name'"),
        (dict(fn=f"{user_file}:answer_only", answer_key="answer"), r"answer_key is for built-ins and verl"),
        (dict(name="maths"), r"name='maths': not a built-in .*did you mean 'math'"),
        (dict(name="exact", fn="x.py:f"), r"exactly one of name"),
        (dict(), r"exactly one of name"),
        (dict(name="exact", weight=math.nan), r"weight=nan must be a finite number"),
        (dict(name="exact", on_error="ignore"), r"on_error='ignore': choose from"),
        (dict(name="math", timeout_s=0), r"timeout_s=0 must be > 0"),
    ]
    for kwargs, message in cases:
        with pytest.raises(RewardError, match=message):
            Rewards([RewardSpec(**kwargs)])
    (tmp_path / "broken.py").write_text("import no_such_module_abc\n")
    with pytest.raises(RewardError, match=r"importing .*broken.py failed: ModuleNotFoundError"):
        Rewards([RewardSpec(fn="broken.py:f")])
    with pytest.raises(RewardError, match="no rewards"):
        Rewards([])
    # an absolute path and a module on sys.path resolve too
    Rewards([RewardSpec(fn=f"{tmp_path / user_file}:trl_reward")]).close()
    monkeypatch.syspath_prepend(str(tmp_path))
    with Rewards([RewardSpec(fn="my_rewards:verl_no_extra")]) as r:
        assert r(["p"], ["x"], [[1]], [{"answer": "1"}]).rewards.tolist() == [0.5]
