"""The RL loop of one arm: make it, resume it, step it, checkpoint it (docs/DESIGN.md §1).

    rows = run_arm(cfg, arm, policy, draft, data, tokenizer, out_dir)

Each step is trainer.rl_step (rollout -> rewards -> advantages -> updates -> refit) with the arm's measurement
hooks (measure.hooks_for: none for a job; a comparison's plain baseline, frozen shadow, frozen draft metrics).
Under a mesh every rank runs the loop; rank 0 logs and checkpoints (with every DP rank's sampler state); on
resume rank 0 reads the checkpoint and sends it to the others through the process group. Under FSDP
(parallel.dp_shard) a checkpoint is still whole tensors: the policy's shards and their AdamW moments gathered on
every rank, rank 0 writing the single process's format; resuming shards them again (rl_fsdp.py; sharded DCP
checkpoints that reshard are a separate helper).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch.distributed as dist
from tqdm.auto import tqdm

from ..config import RunConfig
from ..model.dflash import BlockDraft
from ..model.draft import Eagle3Draft
from ..model.policy import Policy
from ..parallel.fsdp import is_sharded
from ..parallel.mesh import Mesh
from ..train.checkpoint import load_latest, remove_stale_temporaries, save_checkpoint, set_rng_state
from .derive import arm_config, generate_config
from .measure import hooks_for
from .report import MetricsLog
from .rl_fsdp import fsdp_checkpoint_state, fsdp_restore, whole_optimizer_state
from .rl_pp import pp_checkpoint_state, pp_restore
from .rollouts import longest_prompt
from .stages import seed_stage
from .trainer import ArmState, distributed, make_arm, rl_step

__all__ = ["run_arm", "full_models"]


def _ckpt_state(st: ArmState, mesh: Mesh | None = None) -> dict:
    """What a checkpoint holds; in a distributed run also every DP rank's sampler state (the one its CP
    rank 0 generates with). A collective there: call on every rank. Under FSDP the policy and the AdamW state
    gathered whole (rl_fsdp.py)."""
    state = {"draft": st.draft.state_dict() if st.draft is not None else None, "sched": st.sched.state_dict(),
             "gen": st.gen, "step": st.step, "data_offset": st.data_offset, "arm": st.arm}
    if st.pipeline is not None:  # the stages gathered (each one's shards first, under FSDP)
        state.update(pp_checkpoint_state(st, mesh, whole_optimizer_state(st.opt) if is_sharded(st.policy) else None))
    else:
        state.update(fsdp_checkpoint_state(st) if is_sharded(st.policy) else {
            "policy": st.policy.state_dict(), "opt": st.opt.state_dict()})
    if distributed(mesh):
        gens = [None] * (mesh.dp * mesh.cp)
        dist.all_gather_object(gens, st.gen.get_state().cpu(), group=mesh.grad_group)
        state["gen_ranks"] = gens[::mesh.cp]  # rank = dp_rank * cp + cp_rank: the cp rank 0 of each DP group
    return state


def _load_latest(root: Path, st: ArmState, mesh: Mesh | None) -> dict | None:
    """The newest checkpoint under `root`, or None. Distributed: rank 0 reads it and sends it to every
    rank through the process group (the other ranks need no access to rank 0's file system)."""
    if not distributed(mesh):
        found = load_latest(root, generators={"gen": st.gen})
        return found and {**found[1], "path": str(found[0])}
    box = [None]
    if mesh.rank == 0:
        found = load_latest(root, restore_rng=False)
        box = [found and {**found[1], "path": str(found[0])}]
    dist.broadcast_object_list(box, group=dist.group.WORLD, group_src=0)  # every rank, every pipeline stage
    s = box[0]
    if s is not None:
        set_rng_state(s["__rng__"])
        st.gen.set_state(s["gen_ranks"][mesh.dp_rank] if "gen_ranks" in s else s["gen"])
    return s


def _restore(st: ArmState, s: dict, mesh: Mesh | None = None) -> None:
    path = s.get("path", "the checkpoint")
    if s["arm"] != st.arm:
        raise ValueError(f"checkpoint {path} is for arm {s['arm']!r}, not {st.arm!r}")
    dp = mesh.dp if distributed(mesh) else 1
    if len(s.get("gen_ranks") or [None]) != dp:
        raise ValueError(f"checkpoint {path} was written with parallel.dp={len(s.get('gen_ranks') or [None])}, "
                         f"this run has {dp}: resume with the same parallel.dp")
    if st.pipeline is not None:
        pp_restore(st, s, path, fsdp_restore if is_sharded(st.policy) else None)
    elif is_sharded(st.policy):  # every rank has the whole state (_load_latest): each keeps its shards of it
        fsdp_restore(st, s)
        if st.draft is not None:
            st.draft.load_state_dict(s["draft"])
        st.sched.load_state_dict(s["sched"])
    else:
        st.policy.load_state_dict(s["policy"])
        if st.draft is not None:
            st.draft.load_state_dict(s["draft"])
        st.opt.load_state_dict(s["opt"])
        st.sched.load_state_dict(s["sched"])
    st.step, st.data_offset = s["step"], s["data_offset"]
    st.engine.refit(s["policy"], s["draft"] if st.mode == "cotrained" else None)


def full_models(st: ArmState) -> tuple[Policy, Eagle3Draft | BlockDraft | None]:
    """The arm's whole policy and draft as of its last refit, for evaluation and saving: the trainer's own
    copies, or under pipeline parallelism (a rank trains one stage) the engine's, which the refit fills from
    every stage in the trainer's dtype (config.py keeps rollout.dtype at the policy's under PP), and under FSDP
    (the trainer holds shards) the engine's too, refit from the gathered shards (config.py: the same dtype rule)."""
    if st.pipeline is not None or is_sharded(st.policy):
        return st.engine.policy, st.engine.draft
    return st.policy, st.draft


def run_arm(cfg: RunConfig, arm: str, policy: Policy, draft: Eagle3Draft | BlockDraft | None, data, tokenizer,
            out_dir, device="cpu", resume: bool = True, progress: bool = True,
            stop_after: int | None = None, mesh: Mesh | None = None, state_out: dict | None = None,
            record: list | None = None, on_step=None) -> list[dict]:
    """Run (or resume) the RL loop of one arm in `out_dir`; returns the per-step metrics.

    `cfg`: the run config or the arm's own (derive.arm_config); `draft`: the warm draft of the arm's kind.
    Checkpoints go to out_dir/ckpt every train.checkpoint_every steps and at the end;
    `stop_after` stops early after that many steps of this call (tests use it to simulate a crash).
    `mesh`: data parallelism; call on every rank (rank 0 writes the log and the checkpoints).
    `state_out`: a dict that receives the arm's final ArmState under "state" (models, optimizer) and its
    measurement hooks under "hooks".
    `record`: a list that receives this rank's Rollouts of every step (tests).
    `on_step(st, metrics)`: the caller's hook (pipeline.Outputs: evaluation, saved outputs), called on every
    rank before the first step of a fresh arm (metrics None) and after every step and its checkpoint.
    `data`: the job's data (validate.JobData: training prompts and rewards).
    """
    out_dir = Path(out_dir)
    rank = mesh.rank if mesh is not None else 0
    cfg, _ = arm_config(cfg, arm)  # the arm's view (its draft kind, its k); a no-op on an arm config
    seed_stage(cfg.train.seed, f"rl/{arm}")  # a fresh arm starts from its own RNG state; a resumed one restores it
    gen_cfg = dataclasses.replace(generate_config(cfg, tokenizer.stop_ids, tokenizer.pad_id),
                                  min_prompt_len=longest_prompt(data.train, cfg))  # one runner for every step
    st = make_arm(cfg, arm, policy, draft, gen_cfg, rank=mesh.dp_rank if mesh is not None else 0, mesh=mesh)
    hooks = hooks_for(cfg, st, tokenizer.pad_id, device, mesh)  # before a resume (the shadow's warm draft)
    if rank == 0:  # crashed writes' leftovers (the run lock, runner/stages.py, excludes a live writer)
        remove_stale_temporaries(out_dir / "ckpt")
    s = _load_latest(out_dir / "ckpt", st, mesh) if resume else None
    if s is not None:
        _restore(st, s, mesh)
    log = MetricsLog(out_dir, resume_step=st.step) if rank == 0 else None
    rows = []
    done = 0
    bar = tqdm(total=cfg.train.steps, initial=st.step, desc=f"RL [{arm}]", disable=not progress or rank != 0,
               leave=False)
    if on_step is not None and st.step == 0:
        on_step(st, None)
    while st.step < cfg.train.steps and (stop_after is None or done < stop_after):
        m = rl_step(st, cfg, data, tokenizer, device, mesh, record, hooks)
        if log is not None:
            log.log(st.step, m)
        rows.append({"step": st.step, **m})
        done += 1
        bar.update(1)
        bar.set_postfix(reward=f"{m['reward']:.2f}", tau=f"{m['tau']:.2f}")
        if st.step % cfg.train.checkpoint_every == 0 or st.step == cfg.train.steps:
            state = _ckpt_state(st, mesh)  # a collective under DP: every rank
            if rank == 0:
                save_checkpoint(out_dir / "ckpt", st.step, state, keep=cfg.train.keep_checkpoints)
            if distributed(mesh):
                dist.barrier()  # no rank (of any stage) runs ahead of a half-written checkpoint
        if on_step is not None:
            on_step(st, m)
    if on_step is not None and done == 0 and st.step > 0:  # a finished arm run again: outputs it may lack (a
        on_step(st, {})  # crash after its last checkpoint); the hook skips what is already there
    bar.close()
    if log is not None:
        log.close()
    if state_out is not None:
        state_out["state"], state_out["hooks"] = st, hooks
    return rows
