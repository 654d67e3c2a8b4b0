"""The RL loop of one arm: make it, resume it, step it, checkpoint it (docs/DESIGN.md §1).

    rows = run_arm(cfg, arm, policy, draft, data, tokenizer, out_dir)

Each step is trainer.rl_step (rollout -> rewards -> advantages -> updates -> refit) with the arm's measurement
hooks (measure.hooks_for: none for a job; a comparison's plain baseline, frozen shadow, frozen draft metrics).
Under a mesh every rank runs the loop; rank 0 logs. Checkpoints (arm_checkpoint.py): one process writes
whole tensors; a distributed run writes sharded checkpoints, every rank its own shards into the one shared
out_dir/ckpt, and resumes from them at the same layout or another (every rank reading its own slices).
"""
from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..config import RunConfig
from ..model.dflash import BlockDraft
from ..model.draft import Eagle3Draft
from ..model.policy import Policy
from ..parallel.ep import is_ep
from ..parallel.fsdp import is_sharded
from ..parallel.load import whole_items
from ..parallel.tp import is_tensor_parallel
from ..parallel.mesh import Mesh
from ..train.checkpoint import remove_stale_temporaries
from .arm_checkpoint import resume_arm, save_arm
from .derive import arm_config, generate_config
from .measure import hooks_for
from .report import MetricsLog
from .rl_pp import gather_for_refit
from .rollouts import longest_prompt
from .stages import seed_stage
from .trainer import ArmState, make_arm, rl_step

__all__ = ["run_arm", "full_models", "needs_gather"]


def needs_gather(st: ArmState) -> bool:
    """Whether `full_models(st)` is a collective (every rank of the trainer's mesh must call it): the trainer holds
    part of the policy (FSDP, parallel.tp, expert parallelism, a pipeline stage)."""
    return (st.pipeline is not None or is_sharded(st.policy) or is_tensor_parallel(st.policy)
            or is_ep(st.policy))


def full_models(st: ArmState, keep: bool = True, device=None) -> tuple[Policy | None, Eagle3Draft | BlockDraft | None]:
    """The arm's whole policy and draft in the trainer's precision (fp32 masters), for saving (and evaluation): the
    trainer's own copies; where the trainer holds part of the policy (FSDP shards, tensor-parallel shards, expert
    slices, a pipeline stage: `needs_gather`, a collective, every rank calls it) a new whole copy gathered from them
    one tensor (or one layer's experts) at a time (under PP the stages streamed over the pipeline group and the
    co-trained draft from the last stage), so the engine's copy is free to be a bf16 cast (rollout.dtype) or a
    tensor-parallel shard (rollout.tp). keep=False: take part in the gather only, hold nothing, return (None,
    None) (the ranks that neither save nor evaluate). device: where the gathered copy is built, each tensor moved
    there as it arrives ("cpu" for saving: never the whole policy on a GPU); None: the trainer's device."""
    if not needs_gather(st):
        return st.policy, st.draft
    dtype = next(st.policy.parameters()).dtype
    if st.pipeline is not None:
        stream, draft_state = gather_for_refit(st, st.pipeline.mesh, dtype=dtype,
                                               bucket_bytes=256 * 2**20)
    else:
        stream, draft_state = whole_items(st.policy), None
    if not keep:
        for _ in stream:  # every rank walks the same collectives
            pass
        return None, None
    dev = torch.device(device) if device is not None else next(st.policy.parameters()).device
    state = {k: v.to(dev) for k, v in stream}
    with torch.device("meta"):
        whole = Policy(st.policy.cfg)
    whole = whole.to_empty(device=dev).to(dtype)
    whole.load_state_dict(state)
    draft = st.draft
    if draft_state is not None:  # the co-trained draft lives on the last stage: a whole copy here
        draft = copy.deepcopy(st.engine.draft).to(dtype)
        draft.load_state_dict(draft_state)
    return whole.eval(), draft


def run_arm(cfg: RunConfig, arm: str, policy: Policy, draft: Eagle3Draft | BlockDraft | None, data, tokenizer,
            out_dir, device="cpu", resume: bool = True, progress: bool = True,
            stop_after: int | None = None, mesh: Mesh | None = None, state_out: dict | None = None,
            record: list | None = None, on_step=None, shadow=None) -> list[dict]:
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
    `shadow`: the draft config frozen_shadow scores beside the arm's (None: a copy of `draft`; a cold arm's is its
    kind's warm draft, pipeline.arm_drafts).
    """
    out_dir = Path(out_dir)
    rank = mesh.rank if mesh is not None else 0
    cfg, _ = arm_config(cfg, arm)  # the arm's view (its draft kind, its k); a no-op on an arm config
    seed_stage(cfg.train.seed, f"rl/{arm}")  # a fresh arm starts from its own RNG state; a resumed one restores it
    gen_cfg = dataclasses.replace(generate_config(cfg, tokenizer.stop_ids, tokenizer.pad_id),
                                  min_prompt_len=longest_prompt(data.train, cfg))  # one runner for every step
    st = make_arm(cfg, arm, policy, draft, gen_cfg, rank=mesh.dp_rank if mesh is not None else 0, mesh=mesh)
    hooks = hooks_for(cfg, st, tokenizer.pad_id, device, mesh, shadow)  # before a resume (the shadow's warm draft)
    if rank == 0:  # crashed writes' leftovers (the run lock, runner/stages.py, excludes a live writer)
        remove_stale_temporaries(out_dir / "ckpt")
    if resume:  # at this layout or another (arm_checkpoint.py)
        resume_arm(out_dir / "ckpt", st, cfg, mesh)
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
            # distributed: every rank writes its shards; the save returns once the checkpoint is in place
            save_arm(out_dir / "ckpt", st, cfg.train.keep_checkpoints, mesh)
        if on_step is not None:
            on_step(st, m)
    if on_step is not None and done == 0 and st.step > 0:  # a finished arm run again: outputs it may lack (a
        on_step(st, {})  # crash after its last checkpoint); the hook skips what is already there
    bar.close()
    if log is not None:
        log.close()
    st.engine.close()  # the arm's KV caches and graphs, now: the next arm allocates its own (engine.close says why)
    if state_out is not None:
        state_out["state"], state_out["hooks"] = st, hooks
    return rows
