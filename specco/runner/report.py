"""Run outputs: metrics as JSONL + TensorBoard events, PNG plots and a markdown report."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Callable


class MetricsLog:
    """Append-only JSONL (one line per step) plus TensorBoard scalars under `out_dir`.

    `resume_step`: the number of steps the checkpoint being resumed holds. Rows are logged under the
    1-based number of the step they finish, so on resume the JSONL keeps rows 1..resume_step and drops
    later ones (a crash between a log write and the next checkpoint never leaves duplicate steps).
    """

    def __init__(self, out_dir: str | Path, resume_step: int = 0, tensorboard: bool = True, name: str = "metrics.jsonl"):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / name
        rows = read_jsonl(self.path) if self.path.exists() else []
        rows = [r for r in rows if r.get("step", -1) <= resume_step]
        # rewritten whole and renamed into place: a crash here keeps the old log, never a truncated one
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.replace(tmp, self.path)
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(str(self.dir / "tb"), purge_step=resume_step + 1 if resume_step else None)
            except ImportError:  # tensorboard is a declared dependency; tolerate its absence anyway
                self.tb = None

    def log(self, step: int, metrics: dict):
        row = {"step": step, **{k: v for k, v in metrics.items() if _is_num(v) or isinstance(v, str)}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in row.items():
                if k != "step" and _is_num(v):
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()

    def close(self):
        if self.tb is not None:
            self.tb.close()


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def read_jsonl(path: str | Path) -> list[dict]:
    out = []
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a torn last line after a crash
                break
    return out


def _pyplot():
    """matplotlib's pyplot on the headless Agg backend, or None without matplotlib (plots are skipped)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_arms(arm_rows: dict[str, list[dict]], keys: list[tuple[str, str]], path: str | Path,
              smooth: int = 1):
    """One subplot per (metric key, title), one line per arm. Returns the path or None."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.6), squeeze=False)
    for ax, (key, title) in zip(axes[0], keys):
        for arm, rows in arm_rows.items():
            pts = [(r["step"], r[key]) for r in rows if key in r]
            if not pts:
                continue
            xs, ys = zip(*pts)
            if smooth > 1:
                ys = _smooth(ys, smooth)
            line, = ax.plot(xs, ys, label=arm, marker="." if len(xs) < 40 else None)
            se = [r.get(key + "_se") for r in rows if key in r]
            if all(v is not None for v in se):  # the step's sampling noise (e.g. reward_se), smoothed alike
                se = _smooth(se, smooth) if smooth > 1 else se
                ax.fill_between(xs, [y - e for y, e in zip(ys, se)], [y + e for y, e in zip(ys, se)],
                                color=line.get_color(), alpha=0.15, linewidth=0)
        ax.set_title(title)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # no arm logged this key (e.g. draft metrics of 'none' alone)
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def _smooth(ys, n: int) -> list:
    """Trailing moving average over `n` points (fewer at the start)."""
    return [sum(ys[max(0, i - n + 1): i + 1]) / len(ys[max(0, i - n + 1): i + 1]) for i in range(len(ys))]


# The RL step's phases as logged per step (runner/trainer.rl_step), in the order they run; "other" is the rest of the
# step's wall time (scoring, batch building, checks), 0 in runs that predate it.
TIME_PARTS = (("time/rollout", "rollout"), ("time/logprob", "log-prob"), ("time/train", "train"),
              ("time/refit", "refit"), ("time/refit_guard", "refit guard"), ("time/other", "other"))


def steady_rows(rows: list[dict]) -> list[dict]:
    """The steps timings are quoted over: all but the first (it captures the CUDA graphs), unless that
    leaves none."""
    return rows[1:] if len(rows) > 1 else rows


def time_split(rows: list[dict]) -> dict[str, float]:
    """Mean seconds per step of each phase (TIME_PARTS) over `steady_rows`; 0 where not logged."""
    rs = steady_rows(rows)
    return {name: sum(r.get(key, 0.0) for r in rs) / max(1, len(rs)) for key, name in TIME_PARTS}


def same_token_end_to_end(rows: list[dict]) -> float:
    """The arm's whole-step speedup over plain decoding of its own tokens, over `steady_rows`: each step's
    rollout costs `rollout/measured_speedup` times more when decoded plainly, the rest of the step as it was,
        Σ (step + rollout · (measured_speedup − 1)) / Σ step.
    Free of the work drift between arms (their policies write different lengths after step 1), but only as good
    as `measured_speedup`, which reads low on long rollouts (its docstring); `plain_baseline_table` measures
    instead. For a co-trained arm the draft's share of the train step stays on both sides. nan without the
    engine's measurement (no speculation control)."""
    rs = [r for r in steady_rows(rows) if "rollout/measured_speedup" in r]
    steps = [sum(r.get(k, 0.0) for k, _ in TIME_PARTS) for r in rs]
    if not rs or not sum(steps):
        return float("nan")
    plain = [t + r["time/rollout"] * (r["rollout/measured_speedup"] - 1) for t, r in zip(steps, rs)]
    return sum(plain) / sum(steps)


def window_mean(rows: list[dict], key: str, lo: float = 0.0, hi: float = 1.0) -> float:
    """Mean of `key` over the fraction [lo, hi) of the steps that logged it (at least one step; nan if none)."""
    vals = [r[key] for r in rows if key in r]
    if not vals:
        return float("nan")
    a, b = int(len(vals) * lo), max(int(len(vals) * lo) + 1, int(len(vals) * hi))
    return sum(vals[a:b]) / len(vals[a:b])


def shadow_table(arm_rows: dict[str, list[dict]]) -> tuple[str, dict] | None:
    """The arms that ran config `frozen_shadow`: simulated tau (`draft/sim_accept_len`, the same estimator for
    both) of the co-trained draft and of the frozen warm copy on the arm's own rollouts, over the first and the
    last 25% of the steps, and their ratio over the last 25%. None when no arm ran it."""
    key = "shadow/{}/sim_accept_len"
    out, rows = {}, []
    for arm, rs in arm_rows.items():
        if not any(key.format("frozen") in r for r in rs):
            continue
        co = [window_mean(rs, key.format("cotrained"), lo, hi) for lo, hi in ((0, .25), (.75, 1))]
        fr = [window_mean(rs, key.format("frozen"), lo, hi) for lo, hi in ((0, .25), (.75, 1))]
        vals = {"steps": sum(key.format("frozen") in r for r in rs),
                "co-trained sim tau (first 25%)": co[0], "co-trained sim tau (last 25%)": co[1],
                "frozen sim tau (first 25%)": fr[0], "frozen sim tau (last 25%)": fr[1],
                "co-trained / frozen (last 25%)": co[1] / fr[1],
                "co-trained last / first": co[1] / co[0]}
        out[arm] = vals
        rows.append([arm, *vals.values()])
    if not out:
        return None
    return markdown_table(["arm", *next(iter(out.values())).keys()], rows), out


def shadow_position_table(arm_rows: dict[str, list[dict]]) -> tuple[str, dict] | None:
    """The arms that ran config `shadow_window`: per output-position window (its first position), the co-trained
    and the frozen draft's simulated tau on the arm's own rollouts over the last 25% of the steps, their ratio, and
    the window's mean pass-1 targets per step (how much each figure rests on). None when no arm ran it."""
    out, rows = {}, []
    for arm, rs in arm_rows.items():
        starts = sorted({int(k.rpartition("@")[2]) for r in rs for k in r
                         if k.startswith("shadow/frozen/sim_accept_len@")})
        for start in starts:
            co, fr = (window_mean(rs, f"shadow/{tag}/sim_accept_len@{start}", .75, 1) for tag in ("cotrained", "frozen"))
            vals = {"co-trained sim tau (last 25%)": co, "frozen sim tau (last 25%)": fr,
                    "co-trained / frozen": co / fr,
                    "targets per step": window_mean(rs, f"shadow/frozen/tokens@{start}", .75, 1)}
            out.setdefault(arm, {})[start] = vals
            rows.append([arm, start, *vals.values()])
    if not out:
        return None
    return markdown_table(["arm", "output position from", *next(iter(next(iter(out.values())).values()))], rows), out


def plain_baseline_table(arm_rows: dict[str, list[dict]], select: Callable[[dict], bool] | None = None
                         ) -> tuple[str, dict] | None:
    """The arms that ran config `plain_baseline` (each step's prompts also decoded plainly, same tokens, same
    engine and policy): over `steady_rows`,
        rollout speedup   Σ plain rollout / Σ rollout
        end-to-end        Σ (step − rollout + plain rollout − draft) / Σ step
        no-draft share    Σ plain rollout / Σ (that no-draft step)
    where step = TIME_PARTS and draft = `time/train_draft`, the draft's timed forward and backward: the
    no-draft train step is the arm's own less the draft's span (`baseline_split`). Where the run also reran the
    step's updates without the draft (`time/train_plain`, runner/measure.PlainBaseline), that rerun and the
    end-to-end speedup with it in place of train − draft are two more columns: a low bound, since a second pass
    over a minibatch runs faster than the first (bench/cotrain_ragged.py --paired, BENCHMARKS.md).
    `select`: only the steady steps it accepts (e.g. those without a row at the token budget). None when no arm
    ran it (or no step was selected)."""
    out, rows = {}, []
    for arm, all_rows in arm_rows.items():
        no_draft = baseline_split(all_rows, select)  # the no-draft step's phases, means over the measured steps
        if no_draft is None:
            continue
        rs = baseline_rows(all_rows, select)
        mean = lambda key: sum(r.get(key, 0.0) for r in rs) / len(rs)  # noqa: E731
        step = sum(mean(k) for k, _ in TIME_PARTS)
        no_draft_step = sum(no_draft.values())
        rerun = mean("time/train_plain") if all("time/train_plain" in r for r in rs) else float("nan")
        vals = {"steps": len(rs), "rows equal": mean("rollout/plain_rows_equal"),
                "rollout s/step": mean("time/rollout"), "plain rollout s/step": no_draft["rollout"],
                "draft train s/step": mean("time/train_draft"), "no-draft train s/step": no_draft["train"],
                "step s": step, "no-draft step s": no_draft_step,
                "no-draft rollout share": no_draft["rollout"] / no_draft_step,
                "rollout speedup": no_draft["rollout"] / mean("time/rollout"),
                "end-to-end speedup": no_draft_step / step,
                "plain train rerun s/step": rerun,
                "end-to-end speedup, rerun train (low)": (no_draft_step - no_draft["train"] + rerun) / step}
        out[arm] = vals
        rows.append([arm, *vals.values()])
    if not out:
        return None
    return markdown_table(["arm", *next(iter(out.values())).keys()], rows), out


def baseline_rows(rows: list[dict], select: Callable[[dict], bool] | None = None) -> list[dict]:
    """The steady steps that measured the plain baseline (`time/rollout_plain`), those `select` accepts."""
    return [r for r in steady_rows(rows) if "time/rollout_plain" in r and (select is None or select(r))]


def baseline_split(rows: list[dict], select: Callable[[dict], bool] | None = None) -> dict[str, float] | None:
    """`time_split` of the no-draft step on the arm's own tokens (config plain_baseline): rollout the plain
    baseline's, train the arm's train step less the draft's timed forward and backward (`time/train_draft`),
    the other phases the arm's own; over the steady steps that measured it. None when none did.

    Why train − draft and not the rerun of the updates without the draft (`time/train_plain`): on the H200 the
    draft's cost outside its span measured 0.006-0.028 s per 64-row update, while any second pass over the
    same minibatch ran 0.19-0.24 s faster than the first, with or without the draft (bench/cotrain_ragged.py
    --paired, BENCHMARKS.md): cuDNN attention plans each new micro-batch shape once, so the rerun finds the
    real updates' plans made, while a no-draft arm would make them itself."""
    rs = [{**r, "time/rollout": r["time/rollout_plain"],
           "time/train": r.get("time/train", 0.0) - r.get("time/train_draft", 0.0)}
          for r in baseline_rows(rows, select)]
    if not rs:
        return None
    return {name: sum(r.get(key, 0.0) for r in rs) / len(rs) for key, name in TIME_PARTS}


def plot_time_split(arm_rows: dict[str, list[dict]], path: str | Path):
    """A stacked bar per arm: mean seconds per RL step in each phase. Returns the path or None."""
    plt = _pyplot()
    if plt is None:
        return None
    arms = [a for a, rs in arm_rows.items() if rs]
    splits = [time_split(arm_rows[a]) for a in arms]
    for a in list(arms):  # an arm's plain baseline (plain_baseline_table): the no-draft step on its own tokens
        plain = baseline_split(arm_rows[a])
        if plain is not None:
            arms.append(f"{a}\nplain, same tokens")
            splits.append(plain)
    fig, ax = plt.subplots(figsize=(1.6 * len(arms) + 2.5, 3.8))
    bottom = [0.0] * len(arms)
    for _, name in TIME_PARTS:
        vals = [s[name] for s in splits]
        ax.bar(arms, vals, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, total in enumerate(bottom):
        ax.text(i, total, f"{total:.2f} s", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("seconds per RL step")
    ax.set_title("RL step time split (mean over steps 2..)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def markdown_table(header: list[str], rows: list[list]) -> str:
    def fmt(x):  # nan: not measured
        return ("–" if math.isnan(x) else f"{x:.3f}") if isinstance(x, float) else str(x)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)
