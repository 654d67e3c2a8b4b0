"""The run report: the time split per RL step, its stacked-bar plot, the speedup table, the reward band."""
import json

import pytest

from specco.config import RunConfig
from specco.runner.experiment import write_report
from specco.runner.report import plot_arms, plot_time_split, steady_rows, time_split


def _rows(rollout: float, train: float, n: int = 4) -> list[dict]:
    # step 1 captures the CUDA graphs: 10x slower, and left out of the means
    return [{"step": i + 1, "time/rollout": rollout * (10 if i == 0 else 1), "time/logprob": 0.0,
             "time/train": train, "time/refit": 0.1, "time/refit_guard": 0.02, "reward": 0.5 + 0.01 * i,
             "reward_se": 0.05, "tau": 1.0 if rollout > 3 else 3.0, "completion_len": 500.0 + i,
             "tokens_per_s": 1000.0 / rollout, "accuracy": 0.4} for i in range(n)]


def test_time_split_skips_the_first_step():
    rows = _rows(2.0, 1.0)
    assert steady_rows(rows) == rows[1:] and steady_rows(rows[:1]) == rows[:1]
    s = time_split(rows)
    assert s == pytest.approx({"rollout": 2.0, "log-prob": 0.0, "train": 1.0, "refit": 0.1, "refit guard": 0.02,
                               "other": 0.0})  # runs that predate time/other count 0 there
    for r in rows:
        r["time/other"] = 0.3
    assert time_split(rows)["other"] == pytest.approx(0.3)


def test_report_speedups_and_plots(tmp_path):
    arms = {"none": _rows(4.0, 1.0), "cotrained": _rows(2.0, 1.25)}
    arms["none"][0]["tokens_per_s"], arms["cotrained"][0]["tokens_per_s"] = 60.0, 90.0
    for i, r in enumerate(arms["cotrained"]):  # the engine's per-step same-token estimate (step 1 left out)
        r["rollout/measured_speedup"] = 9.0 if i == 0 else 1.5 + 0.1 * i
    summary = write_report(RunConfig(), tmp_path, arms, {"sft_final_loss": 0.1}, {}, 12.0)
    none, co = summary["arms"]["none"], summary["arms"]["cotrained"]
    assert abs(none["step s"] - 5.12) < 1e-9 and abs(none["rollout share"] - 4.0 / 5.12) < 1e-9
    assert abs(co["rollout speedup vs none"] - 2.0) < 1e-9
    assert abs(co["train overhead vs none"] - 1.25) < 1e-9
    assert abs(co["end-to-end speedup vs none"] - 5.12 / 3.37) < 1e-9
    assert abs(co["tokens/s vs none"] - 2.0) < 1e-9  # 500 vs 250 tokens/s over steps 2..
    # step 1, like for like: its own tokens/s (90 vs 60), not the steady steps'
    assert abs(summary["step 1"]["cotrained"]["tokens/s vs none"] - 1.5) < 1e-9
    assert summary["step 1"]["none"]["rollout s"] == 40.0
    assert co["tau (last 25%)"] == 3.0 and co["completion len (first 25%)"] == 500.0
    assert co["est. same-token rollout speedup"] == pytest.approx(1.7)  # mean of 1.6, 1.7, 1.8
    assert none["est. same-token rollout speedup"] != none["est. same-token rollout speedup"]  # nan: no controller
    # steps 2-4 of the co-trained arm: step 3.37 s, rollout 2.0 s at 1.6 / 1.7 / 1.8x -> plain 3.37 + 2.0 * 0.6 ...
    want = sum(3.37 + 2.0 * (m - 1) for m in (1.6, 1.7, 1.8)) / (3 * 3.37)
    assert co["est. same-token end-to-end speedup"] == pytest.approx(want, rel=1e-12)
    assert none["est. same-token end-to-end speedup"] != none["est. same-token end-to-end speedup"]
    for png in ("tau_reward.png", "draft.png", "time_split.png"):
        assert (tmp_path / png).stat().st_size > 1000
    text = (tmp_path / "report.md").read_text()
    assert "end-to-end speedup" in text and "T = 1.0 (rejection sampling)" in text  # the sampler is named
    assert json.loads((tmp_path / "summary.json").read_text())["arms"]["cotrained"]["step s"] == co["step s"]


def test_plots_tolerate_missing_keys(tmp_path):
    rows = {"none": [{"step": 1, "reward": 0.1}], "empty": []}
    assert plot_time_split(rows, tmp_path / "t.png").exists()
    assert plot_arms(rows, [("reward", "r"), ("tau", "t")], tmp_path / "a.png").exists()
