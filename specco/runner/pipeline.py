"""The job `specco train` runs: check every input -> [SFT] -> starting draft -> GRPO with co-training -> outputs.

    specco train --policy DIR --data FILE --reward math     # one co-trained policy + draft, out_dir/policy, draft
    specco compare CONFIG                                  # the same pipeline with several arms and a report

Every input (the policy directory, its tokenizer, the data and its columns, the rewards, an imported draft,
the device) is checked before out_dir is touched, so a corrected command just runs. Every stage writes into
out_dir whole and is skipped when its output exists, so an interrupted run resumes where it stopped (the RL
arms from their checkpoints); a finished run extends when train.steps grows.

A job (one arm) writes, every train.save_every steps and at the end:

    out_dir/policy/    the policy as a Hugging Face checkpoint (config.json, model.safetensors, tokenizer files,
                       generation_config.json): transformers' AutoModelForCausalLM loads it
    out_dir/draft/     the co-trained draft (specco generate --draft, specco export --draft)
    out_dir/metrics.jsonl, eval.jsonl, tb/, ckpt/   per-step metrics, evaluations (TensorBoard), resumable state

A comparison (several arms, runner/experiment.py) keeps each arm's under out_dir/arms/<arm>/.
"""
from __future__ import annotations

import gc
import json
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import RunConfig, split_arm
from ..faults import point
from ..model.hf_io import save_policy
from ..rollout.tp import tp_group_of
from .derive import arm_config, on_device
from .prepare import copy_tokenizer_files, evaluate, prepare_drafts, prepare_policy, say, source_dir
from .report import MetricsLog, plot_arms, read_jsonl
from .rl import full_models, needs_gather, run_arm
from .setup import parallel_setup, pick_device
from .stages import RunLock, commit_dir, record_config, remove_stale_temporaries, seed_stage
from .validate import JobData, check_job


def arm_dir(cfg: RunConfig, out: Path, arm: str) -> Path:
    """Where an arm writes: out_dir itself for a job (one arm), out_dir/arms/<arm> in a comparison."""
    return out if len(cfg.arms) == 1 else out / "arms" / arm


def run(cfg: RunConfig, progress: bool = True, force_new: bool = False) -> dict:
    """The whole job (or comparison). Returns the summary also written to out_dir/summary.json (rank 0; other
    ranks return {}). `force_new`: delete a previous run's outputs in out_dir even when it had another config
    (otherwise an error, runner/stages.py)."""
    device = pick_device(cfg.device)
    data = check_job(cfg, device)  # every input, before out_dir is touched
    mesh = parallel_setup(cfg)
    rank = mesh.rank if mesh is not None else 0
    lock = RunLock(Path(cfg.out_dir)) if rank == 0 else None
    try:
        with _frozen_heap():
            return _run(cfg, data, mesh, rank, progress and rank == 0, force_new)
    finally:
        if lock is not None:
            lock.release()


@contextmanager
def _frozen_heap():
    """Keep what exists once the inputs are checked (torch's and specco's modules, the loaded data: ~260K objects)
    out of the cyclic garbage collector for the run. The run collects on purpose -- an engine's runners sit in
    reference cycles (rollout/engine.py `_release_dropped`), an arm's models go before the next arm -- and every
    full collection walks every tracked object: 0.25 s each, 23 of them 5.8 s of a 14 s tiny 2-rank run on CPU (every
    evaluation, tau check and arm end; each step's with rollout.offload). Frozen objects are still freed by
    reference counting, and the heap is unfrozen when the run returns (a caller's later collections see it all).
    A process that froze its heap already (the test suite, tests/conftest.py) keeps its own arrangement."""
    if gc.get_freeze_count():
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _run(cfg: RunConfig, data: JobData, mesh, rank: int, progress: bool, force_new: bool) -> dict:
    out = Path(cfg.out_dir)
    if rank == 0:
        record_config(out, cfg, force_new)
        for p in remove_stale_temporaries(out):
            say(f"removed {p}, left by an interrupted run", progress)
    device = mesh.device if mesh is not None and mesh.device.type == "cuda" else pick_device(cfg.device)
    cfg = on_device(cfg, device)  # "auto" precisions decided once (recorded config.json keeps "auto")
    if device.type == "cuda":  # fp32 policies train and decode with TF32 matmuls (10-bit mantissa products),
        # the engine's decode attention included (ops/decode_attention._ieee)
        torch.set_float32_matmul_precision("high")
    t_start = time.perf_counter()
    # Every rank runs the start-up stages together (prepare.py): rank 0 decides whether each stage's output exists
    # in out_dir and reads it, or makes the starting weights; they reach the other ranks as tensors, never pickled
    # (setup.py); SFT and the draft warm start are data-parallel over every rank, which end with the same bits;
    # only rank 0 writes out_dir.
    policy, tok, sft_m = prepare_policy(cfg, data, out, device, progress, mesh)
    drafts, warm_m = prepare_drafts(cfg, policy, tok, data, out, progress, mesh)
    say(f"[3/4] RL: {cfg.train.steps} GRPO steps x arms {', '.join(cfg.arms)}"
        + (f" on {mesh.dp} data-parallel x {mesh.cp} context-parallel ranks" if mesh is not None else "")
        + (f" x {mesh.tp} tensor-parallel ranks" if mesh is not None and mesh.tp > 1 else ""), progress)
    arm_rows = {}
    for arm in cfg.arms:
        arm_cfg, _ = arm_config(cfg, arm)  # its draft kind's warm draft (the no-draft arm drops it)
        where = arm_dir(cfg, out, arm)
        hook = Outputs(arm_cfg, data, tok, where, source_dir(cfg, out), out / "start_policy", rank, progress)
        draft, shadow = arm_drafts(cfg, drafts, arm)
        run_arm(arm_cfg, arm, policy, draft, data, tok, where, device,
                progress=progress, mesh=mesh, on_step=hook, shadow=shadow)
        # the rank-0 log, including rows from before a resume, for the report
        arm_rows[arm] = read_jsonl(where / "metrics.jsonl") if rank == 0 else []
        gc.collect()  # the arm's models, optimizer and graph pools go before the next arm starts
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rank != 0:
        return {}
    elapsed = time.perf_counter() - t_start
    if len(cfg.arms) > 1:
        from .experiment import write_report
        say("[4/4] report", progress)
        return write_report(cfg, out, arm_rows, sft_m, warm_m.get(cfg.draft.kind, {}), elapsed, warm_by_kind=warm_m)
    rows = arm_rows[cfg.arms[0]]
    summary = {"arm": cfg.arms[0], "steps": len(rows), "elapsed_s": elapsed, "sft": sft_m, "warm_start": warm_m,
               "last_step": rows[-1] if rows else {},
               "eval": read_jsonl(out / "eval.jsonl") if (out / "eval.jsonl").exists() else [],
               "policy": str(out / "policy"), "draft": str(out / "draft") if cfg.arms[0] != "none" else None}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    say(f"[4/4] done: policy {out / 'policy'}" + (f", draft {out / 'draft'}" if summary["draft"] else ""), progress)
    return summary


def arm_drafts(cfg: RunConfig, drafts: dict, arm: str) -> tuple:
    """(The starting draft of `arm`, the draft its frozen shadow scores) from prepare_drafts' {key: draft}: its
    kind's warm draft for both, or for a cold arm its kind's cold draft and, as the shadow, the warm one (the
    offline stage it skipped: the cold draft's catching up is read on the same rollouts). None for no draft."""
    mode, kind = split_arm(arm, cfg.draft.kind)
    if kind is None:
        return None, None
    return drafts.get(f"cold-{kind}" if mode == "cold" else kind), drafts.get(kind)


@dataclass
class Outputs:
    """The job's hook on the RL loop (run_arm's `on_step`): evaluation before the first step, every
    train.eval_every steps and at the end; the HF policy and the draft every train.save_every steps and at
    the end. Rank 0 only: it holds out_dir."""
    cfg: RunConfig
    data: JobData
    tok: object
    out: Path
    src: Path | None  # the checkpoint's directory (its tokenizer files travel with the policy)
    start: Path  # out_dir/start_policy: the tokenizer the run uses
    rank: int
    progress: bool

    def __call__(self, st, m: dict | None) -> None:
        """`m`: the step's metrics, None before the first step (the starting policy's evaluation). Called on every
        rank: rank 0 decides and writes; where the whole models are gathered from the trainer's parts
        (rl.needs_gather) the other ranks take part in that gather and hold nothing. Rank 0 evaluates on its
        engine's copy when that is whole (the policy as sampled: a bf16 cast under rollout.dtype, refit after
        every step; no gather), else on the trainer's whole models or a copy gathered from its parts; it saves
        the trainer's masters, gathered to the host one tensor at a time on the device (never a second whole
        policy on a GPU). The evaluation's engines are built after the arm's engine has given its runners back
        (RolloutEngine.close): at 32K tokens the two engines' caches and graph pools together outgrew an 80 GB GPU
        (2026-12-07, docs/experiments/long_context.md). The price: the rollout after a mid-run evaluation captures
        its graphs again, as a step 1 does (0.6-1.6 s at the drift workload's shapes on an H100)."""
        todo = self.todo(st, m) if self.rank == 0 else (False, False)
        gathered = needs_gather(st)
        if gathered:
            box = [todo]
            dist.broadcast_object_list(box, group=dist.group.WORLD, group_src=0)
            todo = box[0]
        keep = self.rank == 0
        if todo[0]:
            whole_engine = tp_group_of(st.engine.policy) is None
            if whole_engine:  # refit after every step (trainer.rl_step): the engine holds the step's models
                models = (st.engine.policy, st.engine.draft) if keep else None
            else:
                models = full_models(st, keep=keep)
            if keep:
                if whole_engine:  # its runners decode with no collective: this rank alone may drop them
                    st.engine.close()
                self.evaluate(st, *models)
        if todo[1]:
            models = full_models(st, keep=keep, device="cpu" if gathered else None)
            if keep:
                self.save(st, *models)

    def todo(self, st, m: dict | None) -> tuple[bool, bool]:
        """(evaluate, save) at this point of the run (rank 0: it reads out_dir)."""
        t, last = self.cfg.train, st.step == self.cfg.train.steps
        ev = self.data.eval is not None and (m is None and st.step == 0 or m is not None and (
            last or t.eval_every and st.step % t.eval_every == 0)) and not self.evaluated(st.step)
        save = m is not None and (last or t.save_every and st.step % t.save_every == 0) and not self.saved(st.step)
        return bool(ev), bool(save)

    def evaluated(self, step: int) -> bool:
        f = self.out / "eval.jsonl"
        return f.exists() and any(r.get("step") == step for r in read_jsonl(f))

    def saved(self, step: int) -> bool:
        f = self.out / "policy" / "specco.json"
        return f.exists() and json.loads(f.read_text()).get("step") == step

    def evaluate(self, st, policy, draft) -> None:
        # resume_step: a row of this step from an interrupted earlier evaluation is replaced, not repeated
        log = MetricsLog(self.out, name="eval.jsonl", resume_step=st.step - 1, tensorboard=False)
        seed_stage(self.cfg.train.seed, f"eval/{st.step}")
        ev = evaluate(self.cfg, policy, draft, self.tok, self.data.eval, self.data.rewards, seed=self.cfg.train.seed)
        log.log(st.step, ev)
        log.close()
        say(f"      eval at step {st.step}: reward {ev['eval/reward_greedy']:.3f} greedy / "
            f"{ev['eval/reward_sampled']:.3f} sampled, accuracy {ev['eval/accuracy_greedy']:.3f} / "
            f"{ev['eval/accuracy_sampled']:.3f}", self.progress)
        rows = read_jsonl(self.out / "eval.jsonl")
        plot_arms({"eval": rows}, [("eval/reward_greedy", "eval reward, greedy"),
                                   ("eval/reward_sampled", "eval reward, sampled"),
                                   ("eval/accuracy_greedy", "eval accuracy, greedy")], self.out / "eval.png")

    def save(self, st, policy, draft) -> None:
        """out/policy (HF layout, its tokenizer files, generation_config.json) and out/draft, each replaced whole."""
        with commit_dir(self.out / "policy") as tmp:
            save_policy(policy, tmp)
            copy_tokenizer_files(None if self.src is None else self.start, self.tok, tmp)
            if not (tmp / "generation_config.json").exists():  # what generate stops at, for transformers too
                gen = {"eos_token_id": list(self.tok.stop_ids), "pad_token_id": self.tok.pad_id}
                if self.tok.bos_id is not None:
                    gen["bos_token_id"] = self.tok.bos_id
                (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
            (tmp / "specco.json").write_text(json.dumps({"step": st.step, "arm": st.arm}))
            point("policy/written")
        if draft is not None and st.mode != "none":
            with commit_dir(self.out / "draft") as tmp:
                draft.save(tmp)
                point("draft/written")
