"""Checkpoints of one RL arm: what they hold, and how a run resumes from them, at its own layout or another.

    save_arm(root, st, keep, mesh)     every train.checkpoint_every steps; every rank calls it
    resume_arm(root, st, cfg, mesh)    at start-up, every rank: True when a checkpoint was loaded

Two formats, one per kind of run:
* one process: train/checkpoint.py's whole-tensor directory (tensors.safetensors + state.json: the policy's
  and the draft's state dicts, AdamW's state dict, the LR schedule, the sampler, the RNG states). Kept because
  a single process has nothing to reshard and that format carries its own guarantees (every tensor checked
  finite on read, the full-disk message, the crash points the run-safety tests kill at).
* distributed (any parallel.pp x dp x cp > 1, FSDP or not): train/sharded_checkpoint.py. Every rank writes the
  tensors it holds (its FSDP shards, its pipeline stage's layers and their AdamW moments; replicated tensors,
  like the draft, once); the run state is JSON in the manifest: the step, the data offset, rank 0's RNG states
  and every DP rank's sampler state. On resume every rank reads its own slices from the shared `root`: no
  checkpoint travels through the process group, and no byte of it is unpickled.

`root` must be ONE directory seen by every rank: a node's own disk on one node, a shared filesystem across
nodes. A rank that cannot see what rank 0 created there stops the save with an error saying so.

Resuming at another layout (sharded checkpoints: tensors are named by their place in the whole model, with
their global shapes, so any layout reads its slices). What "continues exactly" means:
* at the same number of DP ranks (dp_shard 2 -> 2, HSDP 2x2 -> dp_shard 4, pp 2 -> 1 at dp 1, cp 2 -> 1): every
  DP rank restores its own sampler and gets the same prompt slice, so the continuation is the uninterrupted
  run: the same rollouts, losses and weights within fp64 summation-order tolerance;
* at another number of DP ranks (dp_shard 2 -> 4): the step's prompts are split into other slices, sampled by
  other samplers. DP rank r < the saved dp restores saved sampler r; a new rank keeps its fresh stream
  (make_arm's seed for its rank); a dropped rank's stream ends. The weights, AdamW moments, LR schedule and
  data offset continue exactly, so the continuation equals ONE process continuing from the checkpointed state
  on the same rollouts (what tests/test_rl_fsdp.py's replay checks for any layout).
A single process's whole-tensor checkpoint is not resumed by a distributed run (refused by name): resume it
on one process, or start over.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import RunConfig
from ..parallel.mesh import Mesh
from ..train import sharded_checkpoint
from ..train.checkpoint import (FORMAT as WHOLE_FORMAT, CheckpointError, _step_dirs, load_latest, rng_state,
                                save_checkpoint, set_rng_state)
from .trainer import ArmState, distributed, refit_arm

__all__ = ["save_arm", "resume_arm"]


def _format(path: Path) -> str | None:
    """The format a checkpoint directory says it has (None: unreadable; the loader then names what is wrong)."""
    try:
        meta = json.loads((path / "state.json").read_text())
        return meta.get("format") if isinstance(meta, dict) else None
    except (OSError, ValueError):
        return None


def _objects(st: ArmState) -> dict:
    """The arm's models, optimizer and schedule as sharded_checkpoint takes them (this rank's part)."""
    state = {"policy": st.policy, "opt": st.opt, "sched": st.sched}
    if st.draft is not None:  # under PP the co-trained draft lives on the last stage only
        state["draft"] = st.draft
    return state


def _rng_json() -> dict:
    """Rank 0's global RNG states (train/checkpoint.rng_state: which generators a checkpoint keeps) as JSON data,
    the torch and CUDA states as byte lists."""
    s = rng_state()
    return {**s, "torch": s["torch"].tolist(), "cuda": None if s["cuda"] is None else [c.tolist() for c in s["cuda"]]}


def _set_rng_json(s: dict) -> None:
    """`_rng_json`'s states restored (train/checkpoint.set_rng_state)."""
    set_rng_state({**s, "torch": torch.tensor(s["torch"], dtype=torch.uint8),
                   "cuda": None if s.get("cuda") is None else [torch.tensor(c, dtype=torch.uint8) for c in s["cuda"]]})


def _samplers(st: ArmState, mesh: Mesh) -> list[list[int]]:
    """Every DP rank's sampler state (the one its CP rank 0 generates with), in DP order; a collective over
    the stage's DP x CP group, tensors only (ranks are dp_rank * cp + cp_rank in it)."""
    mine = st.gen.get_state().to(mesh.device)
    every = [torch.empty_like(mine) for _ in range(mesh.dp * mesh.cp)]
    dist.all_gather(every, mine, group=mesh.grad_group)
    return [g.cpu().tolist() for g in every[::mesh.cp]]


def save_arm(root: Path, st: ArmState, keep: int, mesh: Mesh | None = None) -> None:
    """Checkpoint the arm after step `st.step` (module docstring); every rank calls it."""
    if not distributed(mesh):
        save_checkpoint(root, st.step, {
            "policy": st.policy.state_dict(), "draft": st.draft.state_dict() if st.draft is not None else None,
            "opt": st.opt.state_dict(), "sched": st.sched.state_dict(), "gen": st.gen,
            "step": st.step, "data_offset": st.data_offset, "arm": st.arm}, keep=keep)
        return
    run = {"step": st.step, "data_offset": st.data_offset, "arm": st.arm, "samplers": _samplers(st, mesh),
           "rng": _rng_json(), "layout": {"pp": mesh.pp, "dp": mesh.dp, "dp_shard": mesh.dp_shard, "cp": mesh.cp}}
    sharded_checkpoint.save(root, st.step, {**_objects(st), "run": run}, keep=keep)


def _check_arm(run: dict, st: ArmState, path) -> None:
    if run.get("arm") != st.arm:
        raise CheckpointError(f"checkpoint {path} is for arm {run.get('arm')!r}, not {st.arm!r}")


def resume_arm(root: Path, st: ArmState, cfg: RunConfig, mesh: Mesh | None = None) -> bool:
    """Load the newest intact checkpoint under `root` into the arm (any layout, module docstring) and refit its
    engine; False when there is none. Every rank calls it and reads its own part."""
    dirs = _step_dirs(root) if root.is_dir() else []
    newest = _format(dirs[-1]) if dirs else None
    if newest == WHOLE_FORMAT:
        if distributed(mesh):
            raise CheckpointError(f"{dirs[-1]} is a one-process checkpoint (whole tensors); a distributed run "
                                  "resumes from sharded checkpoints only: resume this run on one process, or "
                                  f"delete {root} to start the arm over")
        found = load_latest(root, generators={"gen": st.gen})
        if found is None:
            return False
        path, s = found
        _check_arm(s, st, path)
        st.policy.load_state_dict(s["policy"])
        if st.draft is not None:
            st.draft.load_state_dict(s["draft"])
        st.opt.load_state_dict(s["opt"])
        st.sched.load_state_dict(s["sched"])
        st.step, st.data_offset = s["step"], s["data_offset"]
    else:  # sharded (or nothing): every rank reads its own slices; one process reads all of them
        found = sharded_checkpoint.load_latest(root, _objects(st))
        if found is None:
            return False
        path, s = found
        run = s["run"]
        _check_arm(run, st, path)
        _set_rng_json(run["rng"])  # rank 0's, on every rank (as the run had before the checkpoint)
        dp_rank = mesh.dp_rank if distributed(mesh) else 0
        if dp_rank < len(run["samplers"]):  # a DP rank the saved run did not have keeps its fresh stream
            st.gen.set_state(torch.tensor(run["samplers"][dp_rank], dtype=torch.uint8))
        st.step, st.data_offset = run["step"], run["data_offset"]
    refit_arm(st, cfg, mesh)  # the engine made from the loaded weights, as after a step
    return True
