"""Run outputs: metrics as JSONL + TensorBoard events, PNG plots and a markdown report."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path


class MetricsLog:
    """Append-only JSONL (one line per step) plus TensorBoard scalars under `out_dir`.

    `resume_step`: the number of steps the checkpoint being resumed holds. Rows are logged under the
    1-based number of the step they finish, so on resume the JSONL keeps rows 1..resume_step and drops
    later ones (a crash between a log write and the next checkpoint never leaves duplicate steps).
    """

    def __init__(self, out_dir: str | Path, resume_step: int = 0, tensorboard: bool = True):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
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


def plot_arms(arm_rows: dict[str, list[dict]], keys: list[tuple[str, str]], path: str | Path,
              smooth: int = 1):
    """One subplot per (metric key, title), one line per arm. Returns the path or None."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.6), squeeze=False)
    for ax, (key, title) in zip(axes[0], keys):
        for arm, rows in arm_rows.items():
            pts = [(r["step"], r[key]) for r in rows if key in r]
            if not pts:
                continue
            xs, ys = zip(*pts)
            if smooth > 1:
                ys = [sum(ys[max(0, i - smooth + 1): i + 1]) / len(ys[max(0, i - smooth + 1): i + 1])
                      for i in range(len(ys))]
            ax.plot(xs, ys, label=arm, marker="." if len(xs) < 40 else None)
        ax.set_title(title)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def markdown_table(header: list[str], rows: list[list]) -> str:
    def fmt(x):
        return f"{x:.3f}" if isinstance(x, float) else str(x)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)
