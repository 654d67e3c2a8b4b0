"""Issue 36's figures of a finished `specco train configs/drift.toml` run, read back from its out_dir (no model,
no device): what co-training buys over a frozen draft and what a cold draft costs, per arm.

Per arm, over windows of steps (first / last 10 by default): reward with its s.e. over prompts, accuracy,
completion length, the engine's tau, k chosen, and for arms with a frozen shadow the simulated tau of the arm's
draft and of its kind's frozen warm draft on the same rollouts (their ratio); for a cold arm the first step at
which its draft's simulated tau reaches 90% and 100% of the frozen warm draft's on the same rollouts. Then the
whole run's time per arm — the sum of the time split (TIME_PARTS) of steps 2.. plus the offline stage the arm needed
(its warm start's warm_time_s; a cold arm's only its cold draft's building) — against the no-draft arm's. Step 1
is left out of every arm's sum: it holds the arm's CUDA graph capture and, in the first arm only, the trainer's
one-time torch.compile (17 s in the none arm), which would charge one arm with the whole process's start-up.

    python bench/drift_tables.py bench/results/drift_2026-12-04/run2_lr1e-5 [--window 10]

Markdown to stdout, the numbers to <run>/drift_tables.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specco.config import split_arm  # noqa: E402
from specco.runner.report import TIME_PARTS, markdown_table, read_jsonl  # noqa: E402
from specco.runner.stages import cold_draft_stage, warm_draft_stage  # noqa: E402

SIM = "shadow/{}/sim_accept_len"


def mean(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if key in r]
    return statistics.fmean(vals) if vals else float("nan")


def first_step(rows: list[dict], frac: float) -> int | None:
    """The first step whose arm-draft simulated tau reaches `frac` x the frozen shadow's on the same rollouts."""
    for r in rows:
        if SIM.format("frozen") in r and r[SIM.format("cotrained")] >= frac * r[SIM.format("frozen")]:
            return r["step"]
    return None


def offline_seconds(run: Path, arm: str, run_kind: str) -> float:
    """The offline stage an arm needed before RL: its kind's warm start (warm_time_s, which for the first kind
    includes sampling the pool), or for a cold arm its cold draft's building and tau check; 0 without a draft."""
    mode, kind = split_arm(arm, run_kind)
    if kind is None:
        return 0.0
    stage = cold_draft_stage(kind) if mode == "cold" else warm_draft_stage(kind, run_kind)
    f = run / stage / "warm_metrics.json"
    return json.loads(f.read_text())["warm_time_s"] if f.exists() else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--window", type=int, default=10, help="steps in the first / last window")
    args = ap.parse_args()
    cfg = json.loads((args.run / "config.json").read_text())
    run_kind = cfg.get("draft", {}).get("kind", "eagle3")
    arms = {a: read_jsonl(args.run / "arms" / a / "metrics.jsonl") for a in cfg["arms"]
            if (args.run / "arms" / a / "metrics.jsonl").exists()}
    w = args.window
    out: dict = {"window": w, "arms": {}}
    learn = []
    for arm, rows in arms.items():
        a, b = rows[:w], rows[-w:]
        v = {"steps": len(rows)}
        for key in ("reward", "reward_se", "accuracy", "completion_len", "tau", "rollout/k_chosen"):
            v[f"{key} first"], v[f"{key} last"] = mean(a, key), mean(b, key)
        for tag in ("cotrained", "frozen"):
            v[f"sim tau {tag} first"], v[f"sim tau {tag} last"] = mean(a, SIM.format(tag)), mean(b, SIM.format(tag))
        if split_arm(arm, run_kind)[0] == "cold":
            v["step sim tau >= 0.9 frozen"], v["step sim tau >= frozen"] = first_step(rows, 0.9), first_step(rows, 1.0)
        parts = {label: sum(r.get(k, 0.0) for r in rows[1:]) for k, label in TIME_PARTS}
        v["step 1 s"] = sum(rows[0].get(k, 0.0) for k, _ in TIME_PARTS)
        v["time by part s"] = parts
        v["RL s"] = sum(parts.values())
        v["offline s"] = offline_seconds(args.run, arm, run_kind)
        v["total s"] = v["RL s"] + v["offline s"]
        out["arms"][arm] = v
        learn.append([arm, f"{v['reward first']:.3f} ± {v['reward_se first']:.3f}",
                      f"{v['reward last']:.3f} ± {v['reward_se last']:.3f}", v["accuracy first"], v["accuracy last"],
                      v["completion_len first"], v["completion_len last"], v["tau first"], v["tau last"],
                      v["rollout/k_chosen first"], v["rollout/k_chosen last"],
                      v["sim tau cotrained first"], v["sim tau cotrained last"], v["sim tau frozen first"],
                      v["sim tau frozen last"], v["sim tau cotrained last"] / v["sim tau frozen last"],
                      v.get("step sim tau >= 0.9 frozen", "–"), v.get("step sim tau >= frozen", "–")])
    print(f"Steps 1-{w} (first) and the last {w} (last):\n")
    print(markdown_table(["arm", "reward first", "reward last", "accuracy first", "accuracy last", "len first",
                          "len last", "tau first", "tau last", "k first", "k last", "sim tau (arm's draft) first",
                          "last", "sim tau (frozen warm) first", "last", "ratio last",
                          "cold: step >= 90% frozen", "cold: step >= frozen"], learn))
    none = out["arms"].get("none")
    times = []
    for arm, v in out["arms"].items():
        vs = none["total s"] / v["total s"] if none else float("nan")
        v["end to end vs none (offline included)"] = vs
        times.append([arm, *(v["time by part s"][lab] for _, lab in TIME_PARTS), v["RL s"], v["offline s"],
                      v["total s"], vs, none["RL s"] / v["RL s"] if none else float("nan"), v["step 1 s"]])
    print("\nWhole run, seconds summed over steps 2.., plus the offline stage (step 1 beside, not in the sums):\n")
    print(markdown_table(["arm", *(lab for _, lab in TIME_PARTS), "RL", "offline", "total", "total: none / arm",
                          "RL only: none / arm", "step 1"], times))
    dest = args.run / "drift_tables.json"
    dest.write_text(json.dumps(out, indent=1))
    print(f"\n{dest}")


if __name__ == "__main__":
    main()
