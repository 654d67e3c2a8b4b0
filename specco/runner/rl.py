"""The GRPO loop with speculative rollouts and online draft co-training (DESIGN §1).

Each step:  rollout (speculative with the engine's draft) -> rewards -> group advantages
            -> log-prob recompute -> co-training step -> refit policy (+ draft) into the engine.

Arms (same seed, same data stream):
  none       plain decoding, policy-only training
  frozen     the warm-started draft speculates; it is never trained or refit
  cotrained  the draft is trained with the policy (lambda * L_draft) and refit every step
Speculative sampling is lossless, so the three arms' rollouts have the same distribution; only
speed (tau, tokens/s) may differ. This module plugs `rollout` and `train` together; neither
imports the other.

Data parallelism (`mesh`, parallel.dp = N under torchrun): every rank holds the same weights and its
own engine; a step's prompts_per_step prompts are split into N contiguous slices, one per rank (whole
GRPO groups, so advantages stay local); each rank samples with its own generator; the co-training step
normalises by global token counts and sums gradients over the ranks, so the update is the one of the
whole batch (tests/test_dp.py). Metrics: losses and tokens/s summed over ranks, the engine-vs-trainer
log-prob gap their max, everything else the mean of the ranks' values. Rank 0 logs and checkpoints
(with every rank's generator state).
"""
from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from ..config import RunConfig
from ..model.draft import Eagle3Draft
from ..model.ttt import shift_left
from ..model.policy import Policy
from ..parallel.mesh import Mesh
from ..rollout.engine import RolloutEngine
from ..rollout.generate import GenerateConfig
from ..rollout.sampling import SamplingParams
from ..train.activation_checkpointing import apply_activation_checkpointing
from ..train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from ..train.cotrain import (AMP_DTYPES, StepConfig, TrainBatch, amp_context, build_optimizer, build_scheduler,
                             cotrain_step, draft_loss, step_counts)
from ..train.losses import all_reduce_sums, grpo_advantages, metrics_to_floats, token_logprobs
from .report import MetricsLog

ARMS = ("none", "frozen", "cotrained")


def generate_config(cfg: RunConfig, eos_id: int, pad_id: int) -> GenerateConfig:
    r = cfg.rollout
    return GenerateConfig(max_new_tokens=r.max_new_tokens,
                          sampling=SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p),
                          num_draft_tokens=r.k, eos_token_id=eos_id, pad_token_id=pad_id,
                          compact_below=r.compact_below)


def at_temperature(gen_cfg: GenerateConfig, temperature: float) -> GenerateConfig:
    """`gen_cfg` with only the sampling temperature changed (evaluations at T = 0 and the run's T)."""
    return dataclasses.replace(gen_cfg, sampling=dataclasses.replace(gen_cfg.sampling, temperature=temperature))


def step_config(cfg: RunConfig, arm: str) -> StepConfig:
    t, d = cfg.train, cfg.draft
    return StepConfig(draft_weight=t.draft_weight if arm == "cotrained" else 0.0,
                      ttt_passes=d.ttt_passes, pass_decay=d.pass_decay, clip_eps=t.clip_eps,
                      kl_coef=t.kl_coef, temperature=max(cfg.rollout.temperature, 1e-6),
                      policy_grad_clip=t.policy_grad_clip, draft_grad_clip=t.draft_grad_clip,
                      loss_chunk=t.loss_chunk, draft_row_stride=t.draft_row_stride,
                      micro_batch_rows=t.micro_batch_rows, amp_dtype=AMP_DTYPES[t.amp])


def pad_pairs(pairs: list[tuple[list[int], list[int]]], pad_id: int):
    """(prompt, completion) id lists -> right-padded tokens (B, S) and completion mask (B, S)."""
    S = max(len(p) + len(c) for p, c in pairs)
    tokens = torch.full((len(pairs), S), pad_id, dtype=torch.long)
    mask = torch.zeros(len(pairs), S)
    for b, (p, c) in enumerate(pairs):
        tokens[b, :len(p) + len(c)] = torch.tensor(p + c)
        mask[b, len(p):len(p) + len(c)] = 1.0
    return tokens, mask


def rollout_pairs(prompts: list[list[int]], out) -> list[tuple[list[int], list[int]]]:
    """(prompt, completion) per output row; row b*G+g holds sample g of prompt b."""
    G = out.group_size
    return [(prompts[r // G], out.tokens[r, :int(out.lengths[r])].tolist())
            for r in range(out.tokens.shape[0])]


def build_batch(prompts: list[list[int]], out, pad_id: int, device) -> TrainBatch:
    """Sequences prompt + completion (right-padded); target_mask marks completion tokens (EOS
    included); logp_old is filled by the recompute."""
    tokens, mask = pad_pairs(rollout_pairs(prompts, out), pad_id)
    return TrainBatch(tokens=tokens.to(device), target_mask=mask.to(device))


@torch.no_grad()
def recompute_logprobs(policy: Policy, tokens: torch.Tensor, cfg: StepConfig) -> torch.Tensor:
    """log p(token i+1) at position i by the training policy (indexed like the logits, batch.py; the
    last column is 0). Under the train step's own precision (cfg.amp_dtype), so the PPO ratio starts at
    exactly 1."""
    with amp_context(cfg, tokens):
        return token_logprobs(policy(tokens).logits, shift_left(tokens, 1), cfg.temperature) * \
            (torch.arange(tokens.shape[1], device=tokens.device) < tokens.shape[1] - 1)


@torch.no_grad()
def draft_eval(policy: Policy, draft: Eagle3Draft, batch: TrainBatch, cfg: StepConfig, count_group=None) -> dict:
    """Draft TTT metrics (loss per pass, top-1, simulated tau) without training it (frozen arm).
    `count_group` (data parallel): global counts, so the metrics are global and the loss is this
    rank's share of the global mean (summed over ranks like the co-trained arm's)."""
    counts = step_counts(batch, cfg, group=count_group)
    with amp_context(cfg, batch.tokens):
        loss, stats = draft_loss(draft, policy(batch.tokens, tap_layers=draft.cfg.aux_layer_ids), batch, cfg,
                                 counts.draft)
    (stats,) = all_reduce_sums([stats], count_group)
    return metrics_to_floats({**stats.metrics(), "draft/loss": loss})


@dataclass
class ArmState:
    arm: str
    policy: Policy  # training copy
    draft: Eagle3Draft | None  # training copy (cotrained) or the frozen draft
    engine: RolloutEngine  # its own copies of the weights, refit after each step
    opt: torch.optim.Optimizer
    sched: object
    gen: torch.Generator
    step: int = 0
    data_offset: int = 0


def make_arm(cfg: RunConfig, arm: str, policy: Policy, draft: Eagle3Draft | None, gen_cfg, rank: int = 0) -> ArmState:
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; choose from {ARMS}")
    policy = copy.deepcopy(policy).train()
    draft = copy.deepcopy(draft) if (draft is not None and arm != "none") else None
    eng_draft = copy.deepcopy(draft) if draft is not None else None
    engine = RolloutEngine(copy.deepcopy(policy).eval(), eng_draft, gen_cfg)
    if cfg.train.activation_checkpointing:  # the trainer's copy only: the engine's never runs a backward
        apply_activation_checkpointing(policy)
    opt = build_optimizer(policy, draft if arm == "cotrained" else None, cfg.train.lr, cfg.train.draft_lr)
    sched = build_scheduler(opt, cfg.train.steps, cfg.train.warmup_steps, cfg.train.draft_warmup_steps)
    # On the models' device: the engine draws its uniforms there (CUDA needs a CUDA generator).
    # Each data-parallel rank samples its own stream (rank 0's is the single-process one).
    gen = torch.Generator(device=next(policy.parameters()).device).manual_seed(cfg.train.seed + 1 + 7919 * rank)
    return ArmState(arm, policy, draft, engine, opt, sched, gen)


def _rank_slice(items: list, mesh: Mesh | None) -> list:
    """This data-parallel rank's contiguous share of a step's prompts (all of them without DP)."""
    if mesh is None or mesh.dp == 1:
        return items
    if len(items) % mesh.dp:
        raise ValueError(f"rollout.prompts_per_step={len(items)} is not divisible by parallel.dp={mesh.dp}")
    n = len(items) // mesh.dp
    return items[mesh.dp_rank * n:(mesh.dp_rank + 1) * n]


_SUM_KEYS = ("policy/loss", "draft/loss", "tokens_per_s")
_MAX_KEYS = ("logprob_gap_engine_vs_trainer",)


def _reduce_metrics(m: dict, mesh: Mesh | None) -> dict:
    """Step metrics over the data-parallel ranks (module docstring): one all-reduce per kind."""
    if mesh is None or mesh.dp == 1:
        return m
    keys = sorted(k for k, v in m.items() if isinstance(v, (int, float)))
    dev = mesh.device
    vals = torch.tensor([float(m[k]) for k in keys], dtype=torch.float64, device=dev)
    summed, maxed = vals.clone(), vals.clone()
    dist.all_reduce(summed, group=mesh.grad_group)
    dist.all_reduce(maxed, op=dist.ReduceOp.MAX, group=mesh.grad_group)
    for i, k in enumerate(keys):
        m[k] = summed[i].item() if k in _SUM_KEYS else maxed[i].item() if k in _MAX_KEYS else \
            summed[i].item() / mesh.dp
    return m


def rl_step(st: ArmState, cfg: RunConfig, task, tokenizer, device, mesh: Mesh | None = None) -> dict:
    """One GRPO step for one arm; returns its metrics. `mesh`: data parallelism (module docstring)."""
    r = cfg.rollout
    scfg = step_config(cfg, st.arm)
    items = _rank_slice(task.prompts(r.prompts_per_step, seed=cfg.train.seed, offset=st.data_offset), mesh)
    prompts = [task.prompt_ids(it, tokenizer) for it in items]
    # -- rollout ------------------------------------------------------------------------------
    t0 = time.perf_counter()
    out = st.engine.generate(prompts, group_size=r.group_size, generator=st.gen)
    t_roll = time.perf_counter() - t0
    texts = [tokenizer.decode(out.tokens[i, :int(out.lengths[i])]) for i in range(out.tokens.shape[0])]
    rewards = torch.tensor([task.score(t, items[i // r.group_size]) for i, t in enumerate(texts)])
    adv = grpo_advantages(rewards, r.group_size)
    batch = build_batch(prompts, out, tokenizer.pad_id, device)
    batch.advantages = adv.to(device)
    # -- log-prob recompute (the trainer's own numerics; the engine's are logged as a check) ----
    t0 = time.perf_counter()
    batch.logp_old = recompute_logprobs(st.policy, batch.tokens, scfg)
    t_lp = time.perf_counter() - t0
    eng_lp = torch.zeros_like(batch.logp_old)
    for i in range(out.tokens.shape[0]):  # token p + j (completion token j) is predicted at p + j - 1
        p, n = len(prompts[i // r.group_size]), int(out.lengths[i])
        eng_lp[i, p - 1:p - 1 + n] = out.logprobs[i, :n].to(eng_lp)
    lp_gap = ((eng_lp - batch.logp_old).abs() * shift_left(batch.target_mask, 1)).max().item()
    # -- train --------------------------------------------------------------------------------
    t0 = time.perf_counter()
    train_draft = st.draft if st.arm == "cotrained" else None
    group = mesh.grad_group if mesh is not None and mesh.dp > 1 else None
    m = cotrain_step(st.policy, train_draft, batch, st.opt, st.sched, scfg, grad_group=group)
    t_train = time.perf_counter() - t0
    if st.arm == "frozen":  # metrics only, so outside the timed train step
        m.update(draft_eval(st.policy, st.draft, batch, step_config(cfg, "cotrained"), group))
    # -- refit --------------------------------------------------------------------------------
    t0 = time.perf_counter()
    st.engine.refit(st.policy.state_dict(),
                    st.draft.state_dict() if st.arm == "cotrained" else None)
    t_refit = time.perf_counter() - t0
    n_tok = int(out.lengths.sum())
    st.step += 1
    st.data_offset += r.prompts_per_step
    m.update({"reward": rewards.mean().item(), "accuracy": (rewards == 1.0).float().mean().item(),
              "tau": out.tau, "completion_len": n_tok / len(texts),
              "tokens_per_s": n_tok / t_roll, "time/rollout": t_roll, "time/logprob": t_lp,
              "time/train": t_train, "time/refit": t_refit, "logprob_gap_engine_vs_trainer": lp_gap,
              "target_forwards": out.num_target_forwards})
    for j, a in enumerate(out.accept_rate.tolist()):
        m[f"accept/pos{j + 1}"] = a
    return _reduce_metrics(m, mesh)


def _ckpt_state(st: ArmState, mesh: Mesh | None = None) -> dict:
    """What a checkpoint holds; under DP also every rank's generator state (call on every rank)."""
    state = {"policy": st.policy.state_dict(), "draft": st.draft.state_dict() if st.draft is not None else None,
             "opt": st.opt.state_dict(), "sched": st.sched.state_dict(), "gen": st.gen,
             "step": st.step, "data_offset": st.data_offset, "arm": st.arm}
    if mesh is not None and mesh.dp > 1:
        gens = [None] * mesh.dp
        dist.all_gather_object(gens, st.gen.get_state().cpu(), group=mesh.grad_group)
        state["gen_ranks"] = gens
    return state


def _restore(st: ArmState, path, mesh: Mesh | None = None) -> None:
    s = load_checkpoint(path, generators={"gen": st.gen})
    if s["arm"] != st.arm:
        raise ValueError(f"checkpoint {path} is for arm {s['arm']!r}, not {st.arm!r}")
    dp = mesh.dp if mesh is not None else 1
    if len(s.get("gen_ranks") or [None]) != dp:
        raise ValueError(f"checkpoint {path} was written with parallel.dp={len(s.get('gen_ranks') or [None])}, "
                         f"this run has {dp}: resume with the same parallel.dp")
    if dp > 1:
        st.gen.set_state(s["gen_ranks"][mesh.dp_rank])
    st.policy.load_state_dict(s["policy"])
    if st.draft is not None:
        st.draft.load_state_dict(s["draft"])
    st.opt.load_state_dict(s["opt"])
    st.sched.load_state_dict(s["sched"])
    st.step, st.data_offset = s["step"], s["data_offset"]
    st.engine.refit(st.policy.state_dict(), st.draft.state_dict() if st.arm == "cotrained" else None)


def run_arm(cfg: RunConfig, arm: str, policy: Policy, draft: Eagle3Draft | None, task, tokenizer,
            out_dir, device="cpu", resume: bool = True, progress: bool = True,
            stop_after: int | None = None, mesh: Mesh | None = None, state_out: dict | None = None) -> list[dict]:
    """Run (or resume) the RL loop of one arm in `out_dir`; returns the per-step metrics.

    Checkpoints go to out_dir/ckpt every train.checkpoint_every steps and at the end;
    `stop_after` stops early after that many steps of this call (tests use it to simulate a crash).
    `mesh`: data parallelism; call on every rank (rank 0 writes the log and the checkpoints).
    `state_out`: a dict that receives the arm's final ArmState under "state" (models, optimizer).
    """
    out_dir = Path(out_dir)
    rank = mesh.rank if mesh is not None else 0
    st = make_arm(cfg, arm, policy, draft, generate_config(cfg, tokenizer.eos_id, tokenizer.pad_id),
                  rank=mesh.dp_rank if mesh is not None else 0)
    ck = latest_checkpoint(out_dir / "ckpt") if resume else None
    if ck is not None:
        _restore(st, ck, mesh)
    log = MetricsLog(out_dir, resume_step=st.step) if rank == 0 else None
    rows = []
    done = 0
    bar = tqdm(total=cfg.train.steps, initial=st.step, desc=f"RL [{arm}]", disable=not progress or rank != 0,
               leave=False)
    while st.step < cfg.train.steps and (stop_after is None or done < stop_after):
        m = rl_step(st, cfg, task, tokenizer, device, mesh)
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
            if mesh is not None and mesh.dp > 1:
                dist.barrier(group=mesh.grad_group)  # no rank runs ahead of a half-written checkpoint
    bar.close()
    if log is not None:
        log.close()
    if state_out is not None:
        state_out["state"] = st
    return rows
