"""bench/rl_tables.py: the per-step tables, the reward overlay and the plain-baseline sums of a run directory,
on a synthetic run whose counts are known by hand, and on a committed run (it must read what runs write)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.e2e


def _run(*args):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "rl_tables.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def _row(step, reward, se, **extra):
    return {"step": step, "reward": reward, "reward_se": se, "completion_len": 10.0, "rollout/rows_at_max": 0.25,
            "time/rollout": 2.0, "time/logprob": 0.1, "time/train": 1.0, "time/other": 0.1, "tau": 1.0, **extra}


def test_synthetic_run(tmp_path):
    run = tmp_path / "run"
    arms = {  # step 1: a-b differ by 0.15 with combined s.e. 0.1 (> 1, < 2); a-c by 0.25 (> 2); b-c by 0.1 (= 1: not >)
        "a": [_row(1, 0.50, 0.06), _row(2, 0.5, 0.1)],
        "b": [_row(1, 0.35, 0.08), _row(2, 0.5, 0.1)],
        "c": [_row(1, 0.25, 0.08, **{"time/rollout_plain": 4.0, "rollout/plain_rows_equal": 1.0,
                                     "time/train_draft": 0.5}),
              _row(2, 0.5, 0.1, **{"time/rollout_plain": 6.0, "rollout/plain_rows_equal": 0.5,
                                   "time/train_draft": 0.2, "tau": 3.0,
                                   "time/rollout_phases": "256 rows x 10 rounds 1.00 s tau 3.00 | 8 rows x 2 rounds 0.10 s tau 2.00",
                                   "time/rollout_plain_phases": "256 rows x 30 rounds 3.00 s tau 1.00"})]}
    for arm, rows in arms.items():
        (run / "arms" / arm).mkdir(parents=True)
        (run / "arms" / arm / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "config.json").write_text(json.dumps({"arms": ["c", "a", "b"], "rollout": {"prompts_per_step": 4,
                                                                                      "group_size": 2}}))
    out = _run(run, "--phases", "2", "--out", tmp_path / "t.json")
    got = json.loads((tmp_path / "t.json").read_text())
    assert got["overlay"] == {"pairs": 6, "over_1_se": 2, "over_2_se": 1}
    c = got["plain_baseline"]["c"]  # step 2 only: step 3.2 s, no-draft step 3.2 - 2 + 6 - 0.2 = 7.0
    assert c["rollout speedup"] == pytest.approx(3.0) and c["end-to-end speedup"] == pytest.approx(7.0 / 3.2)
    # every synthetic step has 25% of its rows at the budget: only the "with" regime, holding the same sums
    by = got["plain_baseline_by_budget_rows"]
    assert list(by) == ["with rows at the budget"] and by["with rows at the budget"]["c"] == c
    lines = out.splitlines()
    assert lines[2].startswith("| c | 1 | 10 | 2 | 2.00 | 4.00 | 2.00 | 1.000 |")  # config order; 25% of 8 rows
    assert "| c | 2 | speculative | 256 rows x 10 rounds 1.00 s tau 3.00; 8 rows x 2 rounds" in out
    assert "| c | 2 | plain baseline | 256 rows x 30 rounds" in out


def test_budget_split_separates_the_steps(tmp_path):
    """Two steady steps, one with a row at the budget and one without: each regime's sums are its own step's."""
    run = tmp_path / "run"
    plain = {"time/rollout_plain": 6.0, "rollout/plain_rows_equal": 1.0, "time/train_draft": 0.2}
    rows = [_row(1, 0.5, 0.1, **plain),
            _row(2, 0.5, 0.1, **{**plain, "rollout/rows_at_max": 0.0}),  # rollout 2 s: 3x
            _row(3, 0.5, 0.1, **{**plain, "time/rollout": 4.0})]  # 25% at the budget, rollout 4 s: 1.5x
    (run / "arms" / "c").mkdir(parents=True)
    (run / "arms" / "c" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _run(run, "--out", tmp_path / "t.json")
    by = json.loads((tmp_path / "t.json").read_text())["plain_baseline_by_budget_rows"]
    without, with_ = by["without a row at the budget"]["c"], by["with rows at the budget"]["c"]
    assert without["steps"] == with_["steps"] == 1
    assert without["rollout speedup"] == pytest.approx(3.0) and with_["rollout speedup"] == pytest.approx(1.5)
    # step 3.2 s -> no-draft 3.2 - 2 + 6 - 0.2 = 7.0; step 5.2 s -> 5.2 - 4 + 6 - 0.2 = 7.0
    assert without["end-to-end speedup"] == pytest.approx(7.0 / 3.2)
    assert with_["end-to-end speedup"] == pytest.approx(7.0 / 5.2)


def test_committed_run(tmp_path):
    run = ROOT / "bench" / "results" / "long_rl_ab_2026-12-02"
    out = _run(run, "--out", tmp_path / "t.json")
    assert "Plain baseline" in out and "| cotrained | 8 |" in out
    assert json.loads((tmp_path / "t.json").read_text())["overlay"]["pairs"] == 48
