"""What makes an out_dir safe to re-run: whole-stage commits, one run at a time, one config per run,
stage seeds.

- A stage (the SFT policy, the warm draft) writes every file into a temporary sibling directory and
  renames it into place in one step; the stage is done exactly when its directory exists under its
  final name. A crash between any two files leaves only a `.tmp_*` directory, removed by the next run.
- An exclusive lock (`out_dir/.lock`, flock) is held for the whole run, so a second run on the same
  out_dir is refused instead of interleaving its metrics with the first one's.
- `out_dir/config.json` is the config the run was started with. A re-run with a different config is
  refused, listing the differing keys (the old stage outputs would be silently reused otherwise);
  `--force-new` deletes the old run's outputs and starts over.
- Every stage seeds the global RNGs from (run seed, stage name), so a stage that is re-run after an
  interruption starts from the same RNG state as in an uninterrupted run, whatever ran before it.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import zlib
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from ..config import DRAFT_KINDS, RunConfig
from ..config_load import config_to_dict
from ..faults import point
from ..model.config import ConfigError

TMP_PREFIX = ".tmp_"


def cold_draft_stage(kind: str) -> str:
    """The directory in out_dir of the cold arms' starting draft of `kind` (config.split_arm's `cold` mode): the
    kind's warm draft before any training (its RNG stream is warm_draft_stage's)."""
    return f"cold_draft_{kind}"


# What a run writes into its out_dir (and --force-new deletes); nothing else there is touched. The
# warm and cold drafts by name, one per kind (no glob: a user's `warm_draft_notes` stays).
RUN_OUTPUTS = ("start_policy", "warm_draft", *(f"warm_draft_{k}" for k in DRAFT_KINDS),
               *(cold_draft_stage(k) for k in DRAFT_KINDS), "arms", "config.json",
               "report.md", "summary.json", "tau_reward.png", "draft.png", "time_split.png",
               # a job's (one arm's) own outputs, in out_dir itself (runner/pipeline.py)
               "policy", "draft", "ckpt", "tb", "metrics.jsonl", "eval.jsonl", "eval.png")
# Keys that may differ between the run and its re-run: where it is and what it prints do not change
# what it computes.
_IGNORED_KEYS = ("out_dir",)
# Keys a re-run may change and continue: train.steps extends (or ends early) a run, the others only set how often
# it evaluates, saves and checkpoints. The new values are recorded. (Under train.lr_schedule = cosine the steps
# after a resume follow the new length's schedule.) parallel.timeout_s only bounds how long a rank waits for its peers.
_EXTENDING_KEYS = ("train.steps", "train.eval_every", "train.save_every", "train.checkpoint_every",
                   "train.keep_checkpoints", "parallel.timeout_s")


class StageError(RuntimeError):
    """A finished stage's output that cannot be used; the message names the directory to delete."""


def seed_stage(seed: int, stage: str) -> None:
    """Seed torch, numpy and random for `stage` from the run seed. SFT keeps the run seed itself
    (its results predate this rule); every other stage gets its own stream."""
    s = seed if stage == "sft" else (seed * 1_000_003 + zlib.crc32(stage.encode())) % 2**63
    torch.manual_seed(s)
    random.seed(s)
    np.random.seed(s % 2**32)


def warm_draft_stage(kind: str, run_kind: str) -> str:
    """The warm draft stage of draft `kind` in a run of draft.kind = `run_kind`: its directory in out_dir
    and its seed stream. The run's own kind keeps the name `warm_draft` it had before arms could name a
    kind (so such runs reproduce), every other kind an arm names gets `warm_draft_<kind>`."""
    return "warm_draft" if kind == run_kind else f"warm_draft_{kind}"


@contextmanager
def commit_dir(final: Path):
    """Yields a temporary directory to write a stage into; on success renames it to `final` (atomic
    on one file system). On any failure the temporary is removed and `final` does not exist."""
    final = Path(final)
    tmp = final.parent / f"{TMP_PREFIX}{final.name}_{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        point(f"{final.name}/written")
        if final.exists():  # an unreadable stage the caller chose to recompute
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    point(f"{final.name}/committed")


def load_stage(d: Path, loader):
    """`loader()` for the finished stage in `d`, or a StageError naming `d` to delete."""
    try:
        return loader()
    except Exception as e:
        raise StageError(f"the finished stage {d} cannot be loaded ({type(e).__name__}: {e}). Delete {d} "
                         "and re-run: that stage is recomputed, and the later stages with it") from e


def remove_stale_temporaries(out: Path) -> list[Path]:
    """The `.tmp_*` stage directories crashed runs left in `out` (call only while holding the lock)."""
    stale = sorted(p for p in Path(out).glob(f"{TMP_PREFIX}*") if p.is_dir())
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


class RunLock:
    """An exclusive, non-blocking flock on `out/.lock` for the life of the run. The OS drops it when the
    process dies, so a crashed run never leaves a lock behind."""

    def __init__(self, out: Path):
        import fcntl
        self.path = Path(out) / ".lock"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a+")
        try:
            fcntl.flock(self._f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._f.seek(0)
            holder = self._f.read().strip() or "?"
            self._f.close()
            raise RunLockedError(f"another specco run (pid {holder}) is using {self.path.parent}: wait for it "
                                 "to finish, or give this run another out_dir") from None
        self._f.seek(0)
        self._f.truncate()
        self._f.write(str(os.getpid()))
        self._f.flush()

    def release(self):
        if not self._f.closed:
            self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


class RunLockedError(RuntimeError):
    pass


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def record_config(out: Path, cfg: RunConfig, force_new: bool = False) -> None:
    """Write out/config.json on the first run; on a re-run require the same config up to the keys that extend a run
    (_EXTENDING_KEYS, then recorded anew) (module docstring)."""
    out = Path(out)
    f = out / "config.json"
    new = config_to_dict(cfg)
    if f.exists():
        try:
            old = json.loads(f.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{f} is damaged ({e}); re-run with --force-new to start {out} over") from None
        # a key the old run's config lacks was added to specco since; its default keeps the old behaviour
        a, b = {**_flat(config_to_dict(RunConfig())), **_flat(old)}, _flat(new)
        diff = sorted(k for k in a.keys() | b.keys() if k not in _IGNORED_KEYS and a.get(k) != b.get(k))
        extends = bool(diff) and all(k in _EXTENDING_KEYS for k in diff)
        if extends:
            diff = []
        if diff and not force_new:
            shown = ", ".join(f"{k}: {a.get(k, '<unset>')!r} -> {b.get(k, '<unset>')!r}" for k in diff[:12])
            more = f" and {len(diff) - 12} more" if len(diff) > 12 else ""
            raise ConfigError(f"{out} holds a run started with a different config ({f}); differing keys: "
                              f"{shown}{more}. Use the original config to resume it, another out_dir for "
                              "the new one, or --force-new to delete its outputs and start over")
        if not diff and not extends and not force_new:  # a resume; --force-new starts over whatever the config
            return
    if force_new:
        for name in RUN_OUTPUTS:
            p = out / name
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "config.json.tmp"
    tmp.write_text(json.dumps(new, indent=1))
    os.replace(tmp, f)
