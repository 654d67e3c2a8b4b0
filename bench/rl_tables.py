"""BENCHMARKS.md's tables of a finished `specco train` run, read back from its out_dir (no model, no device).

For every arm (arms/<arm>/metrics.jsonl), one row per RL step: completion length, rows at the token budget, the
time split, the plain baseline where the arm ran one (config plain_baseline: plain rollout seconds, the speedup
over it, the rows identical), τ, τ at the full k, first-position acceptance, the controller-cost estimate, the draft
loss and the reward with its s.e. over prompts. Then the reward overlay: how many same-step pairs of arms differ
by more than 1 and 2 combined s.e., and the per-level rollout phases of chosen steps. Markdown goes to stdout; the
overlay counts and the plain-baseline sums go to a JSON file (default <run>/tables.json).

    python bench/rl_tables.py bench/results/long_rl_ab_2026-12-02 --phases 2,6
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specco.runner.report import markdown_table, plain_baseline_table, read_jsonl, shadow_table  # noqa: E402


def arm_rows(run: Path, cfg: dict) -> dict[str, list[dict]]:
    """{arm: its metrics rows}, arms in the run config's (`cfg`, its config.json) order, else by name."""
    names = [a for a in cfg.get("arms", []) if (run / "arms" / a / "metrics.jsonl").exists()]
    names = names or sorted(p.name for p in (run / "arms").iterdir() if (p / "metrics.jsonl").exists())
    return {a: read_jsonl(run / "arms" / a / "metrics.jsonl") for a in names}


def _f(x, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _train(r: dict) -> str:
    """The train step's seconds, then the draft's timed share and the plain train step (config plain_baseline)."""
    parts = [_f(r[k]) for k in ("time/train_draft", "time/train_plain") if k in r]
    return _f(r.get("time/train")) + (f" ({'; '.join(parts)})" if parts else "")


def _shadow(r: dict) -> str:
    """Config frozen_shadow: the co-trained draft's simulated tau and, in brackets, its frozen warm copy's."""
    co, fr = r.get("shadow/cotrained/sim_accept_len"), r.get("shadow/frozen/sim_accept_len")
    return "–" if fr is None else f"{co:.2f} ({fr:.2f})"


def step_table(rows: dict[str, list[dict]], n_rows: int) -> str:
    """One row per arm and step; rows at the budget counted out of `n_rows` per step (0: as a fraction)."""
    header = ["arm", "step", "completion len", "rows at budget", "rollout s", "plain rollout s", "rollout speedup",
              "rows equal", "logprob s", "train s (draft; plain)", "other s", "τ", "τ at full k", "accept pos1",
              "est. speedup", "draft loss", "sim τ (shadow: frozen)", "reward ± s.e."]
    out = []
    for arm, rs in rows.items():
        for r in rs:
            plain = r.get("time/rollout_plain")
            at_max = r.get("rollout/rows_at_max")
            out.append([arm, r["step"], f"{r['completion_len']:.0f}",
                        "–" if at_max is None else str(round(at_max * n_rows)) if n_rows else f"{at_max:.1%}",
                        _f(r["time/rollout"]), _f(plain), _f(plain / r["time/rollout"]) if plain else "–",
                        _f(r.get("rollout/plain_rows_equal"), 3) if plain else "–", _f(r.get("time/logprob")),
                        _train(r),
                        _f(r.get("time/other")), _f(r.get("tau")), _f(r.get("rollout/tau_full_k")),
                        _f(r.get("accept/pos1"), 3), _f(r.get("rollout/measured_speedup")), _f(r.get("draft/loss"), 3),
                        _shadow(r), f"{r['reward']:.3f} ± {r.get('reward_se', float('nan')):.3f}"])
    return markdown_table(header, out)


def budget_split(rows: dict[str, list[dict]]) -> dict[str, tuple[str, dict]]:
    """The plain-baseline sums over the steps with no row at the token budget and over those with one or more:
    a batched rollout lasts as long as its slowest row, and a row that runs away to the budget is text no draft
    predicts well (the fourteenth H200 run: co-trained DFlash 3.6-3.7x at its steps without such a row, 1.5-1.7x
    at the others), so the mean hides two regimes. Empty when no arm ran a plain baseline; a regime without
    steps is left out."""
    out = {}
    for title, select in (("without a row at the budget", lambda r: r.get("rollout/rows_at_max", 0.0) == 0),
                          ("with rows at the budget", lambda r: r.get("rollout/rows_at_max", 0.0) > 0)):
        table = plain_baseline_table(rows, select)
        if table:
            out[title] = table
    return out


def overlay(rows: dict[str, list[dict]]) -> dict:
    """Same-step pairs of arms whose rewards differ by more than 1 and 2 combined s.e. over prompts."""
    steps = min(len(rs) for rs in rows.values())
    pairs = over1 = over2 = 0
    for s in range(steps):
        for a, b in itertools.combinations(rows, 2):
            ra, rb = rows[a][s], rows[b][s]
            se = math.hypot(ra.get("reward_se", 0.0), rb.get("reward_se", 0.0))
            d = abs(ra["reward"] - rb["reward"])
            pairs += 1
            over1 += se > 0 and d > se
            over2 += se > 0 and d > 2 * se
    return {"pairs": pairs, "over_1_se": over1, "over_2_se": over2}


def _cell(text: str) -> str:
    """A phases line as a table cell (which holds no '|')."""
    return text.replace(" | ", "; ")


def phases(rows: dict[str, list[dict]], steps: list[int]) -> str:
    out = []
    for arm, rs in rows.items():
        for r in rs:
            if r["step"] in steps and "time/rollout_phases" in r:
                out.append([arm, r["step"], "speculative" if r.get("tau", 1.0) > 1.0 else "plain",
                            _cell(r["time/rollout_phases"])])
                if "time/rollout_plain_phases" in r:
                    out.append([arm, r["step"], "plain baseline", _cell(r["time/rollout_plain_phases"])])
    return markdown_table(["arm", "step", "decode", "levels (rows x rounds, seconds, τ)"], out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="a run's out_dir (or its copy under bench/results/)")
    ap.add_argument("--phases", default="", help="steps whose per-level phases to print, e.g. 2,6")
    ap.add_argument("--out", type=Path, default=None, help="JSON file (default <run>/tables.json)")
    a = ap.parse_args(argv)
    if not (a.run / "arms").is_dir():
        ap.error(f"{a.run} has no arms/ directory: give the out_dir of a `specco train` run")
    cfg = json.loads((a.run / "config.json").read_text()) if (a.run / "config.json").exists() else {}
    rows = arm_rows(a.run, cfg)
    n_rows = cfg.get("rollout", {}).get("prompts_per_step", 0) * cfg.get("rollout", {}).get("group_size", 0)
    print(step_table(rows, n_rows))
    ab = plain_baseline_table(rows)
    if ab:
        print("\nPlain baseline, steps 2..:\n\n" + ab[0])
    by_budget = budget_split(rows)
    for title, (table, _) in by_budget.items():
        print(f"\nPlain baseline, steps 2.. {title}:\n\n" + table)
    sh = shadow_table(rows)
    if sh:
        print("\nFrozen shadow:\n\n" + sh[0])
    ov = overlay(rows)
    print(f"\nReward overlay: {ov['over_1_se']} of {ov['pairs']} same-step pairs of arms > 1 combined s.e., "
          f"{ov['over_2_se']} > 2")
    steps = [int(s) for s in a.phases.split(",") if s.strip()]
    if steps:
        print("\n" + phases(rows, steps))
    out = a.out or a.run / "tables.json"
    out.write_text(json.dumps({"run": str(a.run), "overlay": ov, "plain_baseline": ab[1] if ab else {},
                               "plain_baseline_by_budget_rows": {t: sums for t, (_, sums) in by_budget.items()},
                               "frozen_shadow": sh[1] if sh else {}}, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
