"""Rollouts -> training batches: generation once per data-parallel group, rewards and advantages, and the
batch layout each co-training step sees (right-padded rows on one device, zigzag THD packs under CP).

    ro = collect_rollouts(...)          cp rank 0 of each DP group generates; its CP ranks receive a copy
    mbs = minibatches(ro, ...)          PPO minibatches (whole prompt groups), each laid out once:
                                        cp = 1 -> padded rows, default attention
                                        cp > 1 -> one packed row, zigzag-sharded, CP shift / ring attention
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..batch import TrainBatch, device_indices, pack, round_up
from ..model.policy import Policy
from ..parallel.cp import shard_batch
from ..parallel.layout import PADDED, SHARED_PROMPTS, PaddedRows, ZigzagPack
from ..parallel.mesh import Mesh
from ..parallel.zigzag import ZigzagLayout
from ..parallel.shared_prompts import shared_micro_batches
from ..rollout.control import expected_tokens
from ..train.cotrain import StepConfig, amp_context, micro_batch_plan, with_trained_from
from ..train.drafters import first_anchor
from ..train.losses import grpo_advantages, overlong_penalty, token_logprobs

__all__ = ["Rollouts", "collect_rollouts", "generates", "from_generator", "Minibatch", "minibatches",
           "recompute_logprobs", "pad_pairs", "rollout_pairs", "completions", "build_batch", "rank_slice",
           "engine_logprob_gap"]


def pad_pairs(pairs: list[tuple[list[int], list[int]]], pad_id: int, width_multiple: int = 1):
    """(prompt, completion) id lists -> right-padded tokens (B, S) and completion mask (B, S), S the longest
    row rounded up to a multiple of `width_multiple`."""
    S = round_up(max(len(p) + len(c) for p, c in pairs), width_multiple)
    tokens = torch.full((len(pairs), S), pad_id, dtype=torch.long)
    mask = torch.zeros(len(pairs), S)
    prompt_ids = {}  # a group's rows share one prompt list (rollout_pairs): each converted once (32K-token prompts)
    for b, (p, c) in enumerate(pairs):
        if id(p) not in prompt_ids:
            prompt_ids[id(p)] = torch.tensor(p, dtype=torch.long)
        tokens[b, :len(p)] = prompt_ids[id(p)]
        tokens[b, len(p):len(p) + len(c)] = torch.tensor(c, dtype=torch.long)
        mask[b, len(p):len(p) + len(c)] = 1.0
    return tokens, mask


def completions(out) -> list[list[int]]:
    """Each output row's completion ids, from one host copy of the engine's (device) tokens."""
    tokens, lengths = out.tokens.cpu(), out.lengths.cpu().tolist()
    return [tokens[r, :n].tolist() for r, n in enumerate(lengths)]


def rollout_pairs(prompts: list[list[int]], out, comps: list[list[int]] | None = None
                  ) -> list[tuple[list[int], list[int]]]:
    """(prompt, completion) per output row; row b*G+g holds sample g of prompt b. `comps`: the rows'
    completions when the caller already has them (`completions(out)`)."""
    G = out.group_size
    return [(prompts[r // G], c) for r, c in enumerate(completions(out) if comps is None else comps)]


def build_batch(pairs, pad_id: int, device, width_multiple: int = 1) -> TrainBatch:
    """Sequences prompt + completion (right-padded); target_mask marks completion tokens (EOS included).

    width_multiple (train.width_multiple): the batch's width too is a multiple of it. A micro-batch is cut to
    its longest row rounded up to that multiple but never past the batch (cotrain.micro_batch_cuts), so with
    the batch as wide as its longest row, the micro-batch holding that row kept the row's exact length: a new
    width, hence new cuDNN attention plans (an update's first pass over new widths spent 104 + 158 ms of host
    time in them on the H200, bench/results/cotrain_syncfree_2026-12-02), in nearly every minibatch of every
    step, for the train step, the log-prob recompute and the frozen shadow alike. The padding columns are
    masked, and trimming is exact (TrainBatch.trimmed), so only the shapes change."""
    tokens, mask = pad_pairs(pairs, pad_id, width_multiple)
    return TrainBatch(tokens=tokens.to(device), target_mask=mask.to(device))


def rank_slice(items: list, mesh: Mesh | None) -> list:
    """This data-parallel rank's contiguous share of a step's prompts (all of them without DP)."""
    if mesh is None or mesh.dp == 1:
        return items
    if len(items) % mesh.dp:
        raise ValueError(f"rollout.prompts_per_step={len(items)} is not divisible by parallel.dp={mesh.dp}")
    n = len(items) // mesh.dp
    return items[mesh.dp_rank * n:(mesh.dp_rank + 1) * n]


@dataclass
class Rollouts:
    """One DP group's rollouts of a step (on the host: they travel to the group's CP ranks as one object).

    pairs: (prompt ids, completion ids) per row, row b*G+g = sample g of prompt b; advantages (N,);
    engine_logprobs: per row, the engine's log-prob of each completion token; metrics: the rollout's."""
    pairs: list[tuple[list[int], list[int]]]
    group_size: int
    advantages: torch.Tensor
    engine_logprobs: list[list[float]]
    metrics: dict = field(default_factory=dict)
    valid: torch.Tensor | None = None  # (N,) bool: rows the rewards scored; the others train no token (None: all)


def longest_prompt(source, cfg, cap: int = 65536) -> int:
    """Tokens of the longest prompt the run will see (a procedural stream's first `cap` prompts, items are cheap
    to make, ~50 us each for chain_sum; a dataset's rows, up to `cap`): the engine's prompt bucket
    (GenerateConfig.min_prompt_len), so the RL steps share one decode runner. Without it, configs/long.toml's
    longest prompts of 63 and 65 tokens fell in buckets 64 and 80 by turns, and each change recaptured every
    graph (0.3-1.6 s per step on the H200)."""
    n = min(cap, cfg.train.steps * cfg.rollout.prompts_per_step)
    if source.num_rows is not None:  # a dataset: the longest of its rows (every epoch holds them all)
        n = min(cap, source.num_rows)
    return max(len(e.prompt_ids) for e in source.examples(max(1, n), seed=cfg.train.seed))


def tail_metrics(out, max_new_tokens: int, texts: list[str]) -> dict:
    """The rows that set a rollout's length: the batch decodes until its slowest row stops, so that row's own
    tokens per round (not the mean τ) decides how many target forwards a step takes. From the engine's per-row
    round counts: the slowest row's rounds and τ, and the τ of the rows cut off at max_new_tokens; from its
    phases, the rounds and seconds spent after the first compaction (the tail; the first phase holds the
    prefill's device time too, since the first round's host sync waits for it). `texts`: the rows' decoded
    completions, for what the slowest row wrote (its head and tail)."""
    if out.row_rounds is None or out.row_rounds.numel() == 0:
        return {}
    rounds = out.row_rounds.cpu()
    emitted = out.lengths.cpu() - 1  # the prefill emits each row's first token
    slow = int(rounds.argmax())
    t = texts[slow]
    m = {"rollout/slowest_row_rounds": int(rounds[slow]),
         "rollout/slowest_row_tau": float(emitted[slow]) / max(1, int(rounds[slow])),
         "rollout/slowest_row_text": t if len(t) <= 400 else f"{t[:200]} … {t[-200:]}"}
    cut = out.lengths.cpu() >= max_new_tokens
    if cut.any():
        m["rollout/tau_rows_at_max"] = float(emitted[cut].sum()) / max(1, int(rounds[cut].sum()))
    if out.phases:  # the whole batch, then each compacted size: how much of the rollout the tail takes
        m["time/rollout_phases"] = phases_text(out.phases)
        m["rollout/tail_rounds"] = sum(p.rounds for p in out.phases[1:])
        m["time/rollout_tail"] = sum(p.seconds for p in out.phases[1:])
    return m


def tau_full_k(accept_counts) -> float:
    """τ at the full k from a call's conditional acceptances ((n_accepted, n_tried) per position): the
    draft's quality apart from the k speculation control chose per level, which the logged τ mixes in.
    At one fixed k it is exactly that call's accepted tokens per row-round plus one; a position never
    tried counts 0."""
    acc, tried = (c.double() for c in accept_counts)
    return expected_tokens(torch.where(tried > 0, acc / tried.clamp(min=1), 0.0))


def measured_speedup(out) -> float | None:
    """The call's decode time against plain decoding of the same tokens, level by level: a level of R rounds
    at τ_l tokens per live row-round would take about τ_l·R plain rounds at that level's measured plain cost,
    so  Σ_l τ_l R_l t_plain(l) / Σ_l seconds_l  (wall seconds: capture included on a level's first use).
    An estimate, and a low one on long rollouts: t_plain(l) is timed once, when level l is first entered, at
    that call's context length then (the root's: the prompts), while a plain round's attention over the KV
    cache grows with the context. On the H200 long workload (bench/results/long_rl_ab_2026-12-02) it gave
    1.23-1.89x for the co-trained EAGLE-3 where plain decoding of the same tokens in the same step measured
    1.88-2.26x (config plain_baseline, which measures). None without the controller's cost measurements for
    every level (speculation control off)."""
    plain_ms = {}
    for c in out.choices:  # the first choice at each level size carries its measured costs
        plain_ms.setdefault(c.rows, c.costs_ms.get(0))
    if not out.phases or any(plain_ms.get(p.rows) is None for p in out.phases):
        return None
    spent = sum(p.seconds for p in out.phases)
    plain = sum(p.tau * p.rounds * plain_ms[p.rows] / 1e3 for p in out.phases)
    return plain / spent if spent > 0 else None


def phases_text(phases) -> str:
    """A call's levels as one line: rows x rounds, seconds and τ of each (generate.Phase)."""
    return " | ".join(f"{p.rows} rows x {p.rounds} rounds {p.seconds:.2f} s tau {p.tau:.2f}" for p in phases)


def generates(mesh: Mesh | None) -> bool:
    """Whether this rank generates its DP group's rollouts: its CP rank 0 and tp rank 0 on pipeline stage 0, with the
    rest of its engine tp group under rollout.tp (they decode together; every rank without a mesh)."""
    return mesh is None or ((mesh.pp == 1 or mesh.pp_rank == 0) and mesh.rollout_tp_index == 0)


def from_generator(obj, mesh: Mesh | None):
    """`obj` as the generating rank of this rank's DP group holds it (`generates`), on every rank of the group:
    stage 0 -> the other stages' CP rank 0 (pipeline group), then each CP group from its rank 0 (among tp rank 0s),
    then each tp group from its rank 0. Other ranks pass anything (None). A collective over those groups: every
    rank of them calls it. (Under rollout.tp the generating engine group's other ranks hold the same object, which
    the broadcasts overwrite with itself.)"""
    if mesh is not None and mesh.pp > 1 and mesh.cp_rank == 0:
        box = [obj]
        dist.broadcast_object_list(box, group=mesh.pp_group, group_src=0)
        obj = box[0]
    if mesh is not None and mesh.cp > 1 and mesh.tp_rank == 0:
        box = [obj]
        dist.broadcast_object_list(box, group=mesh.cp_group, group_src=0)
        obj = box[0]
    if mesh is not None and mesh.tp > 1:  # the tp ranks of a group train on the same tokens: the same rollouts
        box = [obj]
        dist.broadcast_object_list(box, group=mesh.tp_group, group_src=0)
        obj = box[0]
    return obj


def collect_rollouts(engine, gen, cfg, source, rewards, tokenizer, data_offset: int, mesh: Mesh | None) -> Rollouts:
    """Generate, score and compute GRPO advantages for this DP rank's prompts — once per DP group: the
    CP group's rank 0 generates (with the DP rank's sampler), the others receive the result through the
    CP group (no file system, no second generation), so every CP rank trains on the same sequences. Under
    pipeline parallelism stage 0 generates and the other stages receive (pipeline group, then CP group).
    `source`: the training prompts (data.source.PromptSource); `rewards`: the job's reward functions, called
    once per step on this rank's rows; a row they exclude (every function returned None, or reward.on_error =
    skip) has no advantage and no trained token."""
    r = cfg.rollout
    ro = None
    if generates(mesh):
        items = rank_slice(source.examples(r.prompts_per_step, seed=cfg.train.seed, offset=data_offset), mesh)
        prompts = [e.prompt_ids for e in items]
        t0 = time.perf_counter()
        out = engine.generate(prompts, group_size=r.group_size, generator=gen)
        t_roll = time.perf_counter() - t0
        N = out.tokens.shape[0]
        comps = completions(out)  # one device -> host copy; the texts, rewards and pairs all read it
        texts = [tokenizer.decode(c) for c in comps]
        rows = [items[i // r.group_size] for i in range(N)]  # row b*G+g holds sample g of prompt b
        scored = rewards([e.prompt for e in rows], texts, comps, [e.columns for e in rows])
        valid = scored.valid
        n_tok = int(out.lengths.sum())
        # (prompts,) means over each group's scored rows: the groups are the i.i.d. units
        per_prompt = (scored.rewards * valid).view(-1, r.group_size).sum(1) / valid.view(-1, r.group_size).sum(1)
        per_prompt = per_prompt[per_prompt.isfinite()]
        ok = valid.any()
        m = {**scored.metrics, "reward": scored.rewards[valid].mean().item() if ok else float("nan"),
             "accuracy": scored.full_marks[valid].float().mean().item() if ok else float("nan"),
             # the step's sampling noise in `reward`: the standard error over its prompts (0 for one prompt)
             "reward_se": (per_prompt.std() / len(per_prompt) ** 0.5).item() if len(per_prompt) > 1 else 0.0,
             "tau": out.tau, "completion_len": n_tok / N, "completion_len_max": int(out.lengths.max()),
             # rows cut off at max_new_tokens: the batch decodes until its last row stops, so these rows' own
             # acceptance sets the rollout's number of target forwards
             "rollout/rows_at_max": (out.lengths >= r.max_new_tokens).float().mean().item(),
             "tokens_per_s": n_tok / t_roll, "time/rollout": t_roll, "target_forwards": out.num_target_forwards}
        m.update(tail_metrics(out, r.max_new_tokens, texts))
        for j, a in enumerate(out.accept_rate.tolist()):
            m[f"accept/pos{j + 1}"] = a
        if out.accept_counts is not None and out.accept_counts[1].numel():
            m["rollout/proposed"] = int(out.accept_counts[1][0])  # rounds x rows that proposed a first token
            m["rollout/tau_full_k"] = tau_full_k(out.accept_counts)
        if out.choices:  # speculation control at the root level (all rows), rollout/control.py
            root = out.choices[0]
            m["rollout/k_chosen"] = root.k
            m["rollout/predicted_speedup"] = root.predicted_speedup
            speedup = measured_speedup(out)
            if speedup is not None:
                m["rollout/measured_speedup"] = speedup
            # every choice of the call: per level entered and per re-choice within one (rows:k), e.g. a tail
            # that turned plain on its own rows' acceptance
            m["rollout/k_path"] = " ".join(map(str, out.choices))  # e.g. 256:k0t 64:k7 (t: tracked plain)
        logprobs = out.logprobs.float().cpu()
        ts = cfg.train  # train.overlong_buffer: the advantages see the length penalty, `reward` stays the score
        shaped = scored.rewards + overlong_penalty(out.lengths.cpu(), r.max_new_tokens, ts.overlong_buffer,
                                                   ts.overlong_penalty)
        if ts.overlong_buffer:
            m["reward/overlong_penalty"] = (shaped - scored.rewards)[valid].mean().item() if ok else 0.0
        ro = Rollouts(rollout_pairs(prompts, out, comps), r.group_size, grpo_advantages(shaped, r.group_size, valid=valid),
                      [logprobs[i, :len(c)].tolist() for i, c in enumerate(comps)], m, valid=valid)
    return from_generator(ro, mesh)  # every pipeline stage and CP rank trains on the same rollouts


@torch.no_grad()
def recompute_logprobs(policy: Policy, tokens: torch.Tensor, cfg: StepConfig, positions=None,
                       layout=PADDED, pipe: StagePipe | None = None, logits_from: int = 0) -> torch.Tensor | None:
    """log p(token i+1) at position i by the training policy (indexed like the logits, batch.py). Under
    the train step's own precision (cfg.amp_dtype) and layout (parallel/layout.py: its shift and attention
    core, the CP ones on a zigzag shard), so the PPO ratio of an unchanged policy is exactly 1.
    `pipe`: `policy` is a pipeline stage; the forward goes through the stages (StagePipe) and only the last
    stage returns the log-probs (None elsewhere). `logits_from`: the train step's cut (Policy.forward's; the
    same cut gives the same logits to the bit): positions before it hold 0, which no loss reads."""
    with amp_context(cfg, tokens):
        if pipe is None:
            out = policy(tokens, positions, attn_core=layout.attn_core, logits_from=logits_from)
        else:
            out = pipe.forward(policy, tokens, positions, layout, logits_from)
            if out is None:
                return None
        c = out.logits_from
        lp = token_logprobs(out.logits, layout.shift(tokens, 1)[:, c:], cfg.temperature)  # (B, S - c)
        return torch.cat([lp.new_zeros(lp.shape[0], c), lp], dim=1) if c else lp


class StagePipe:
    """A forward-only pass of a pipeline stage, micro-batch after micro-batch (no overlap: the log-prob recompute
    before the updates): receive the previous stage's activation, run this stage's layers, send it on (parallel's
    PipeComm on the pipeline group); the last stage computes the logits. `wire`: the activations' dtype (the stage's
    residual stream: pipeline.PipelineArm.act_dtype or the parameters')."""

    def __init__(self, group, hidden_size: int, wire: torch.dtype):
        from ..parallel.pipeline import PipeComm
        self.comm, self.h, self.wire, self.m = PipeComm(group), hidden_size, wire, 0
        self.first, self.last = self.comm.stage == 0, self.comm.stage == self.comm.pp - 1

    def forward(self, stage: Policy, tokens: torch.Tensor, positions, layout, logits_from: int = 0):
        x = None
        if not self.first:
            x = self.comm.recv_fwd((*tokens.shape[:2], self.h), self.wire, tokens.device, self.m)
        out = stage(tokens if self.first else None, positions, hidden_in=x, compute_logits=self.last,
                    attn_core=layout.attn_core, logits_from=logits_from)
        if not self.last:
            self.comm.send_fwd(out.hidden.to(self.wire), self.m)
        self.m += 1
        return out if self.last else None

    def share(self, logp: torch.Tensor | None, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The last stage's (B, S) log-probs on every stage (one broadcast over the pipeline group): every stage
        holds the same batches, so the minibatch keeps one set of fields everywhere."""
        self.comm.wait_sends()
        buf = logp.to(dtype).contiguous() if self.last else torch.empty(like.shape, dtype=dtype, device=like.device)
        dist.broadcast(buf, group=self.comm.group, group_src=self.comm.pp - 1)
        return buf


@dataclass
class Minibatch:
    """One PPO minibatch as this rank's co-training step sees it: the (local) batch and its layout
    (parallel/layout.py: PaddedRows for single-device rows, ZigzagPack for a CP shard; `cotrain_step(layout=)`)."""
    batch: TrainBatch
    layout: PaddedRows | ZigzagPack
    rows: list[int]  # the Rollouts rows it holds, in order

    def logprobs(self, policy: Policy, cfg: StepConfig, pipe: StagePipe | None = None) -> torch.Tensor:
        """(B, S) log-probs of the minibatch's tokens under `policy`. Padded rows go through the train step's
        own micro-batches (cotrain.micro_batch_cuts: longest rows first, each cut to its longest row), not
        one forward of every row at the minibatch's longest width: the long workload's rows average ~750 of
        up to 2,150 tokens, so that forward was mostly padding (and its attention quadratic in the width).
        Same shapes as the train step's forward, so an unchanged policy's PPO ratio is exactly 1. Positions
        past a row's cut stay 0: nothing trained reads them. `pipe` (StagePipe): `policy` is this rank's pipeline
        stage; the stages forward each micro-batch in turn and the last stage's log-probs reach every stage."""
        b = self.batch
        # token_logprobs keeps fp64 logits in fp64, else fp32: the (stage's) parameters say which
        wide = torch.float64 if next(policy.parameters()).dtype == torch.float64 else torch.float32
        if self.layout.shares_prompts:  # the train step's packed prompt groups (parallel/shared_prompts.py)
            if pipe is not None:
                raise ValueError("train.share_prompts under parallel.pp > 1: not implemented (one stage only)")
            out = torch.zeros(b.tokens.shape, dtype=wide, device=b.tokens.device)
            for _, sh in shared_micro_batches(b, cfg.micro_batch_rows, 1, cfg.width_multiple):
                lp = recompute_logprobs(policy, sh.batch.tokens, cfg, sh.batch.positions, sh,
                                        logits_from=first_anchor(sh.batch, cfg.ttt_passes, sh))
                out[sh.index, :sh.rows.tokens.shape[1]] = sh.unpack(lp).to(wide)
            return out
        cuts = None if self.layout.packed else micro_batch_plan(b, cfg.micro_batch_rows, cfg.width_multiple)
        if cuts is None:  # a CP shard (its own layout) or one micro-batch: one forward
            cut = first_anchor(with_trained_from(b), cfg.ttt_passes, self.layout)  # the train step's cut
            lp = recompute_logprobs(policy, b.tokens, cfg, b.positions, self.layout, pipe, cut)
            return lp if pipe is None else pipe.share(lp, b.tokens, wide)
        out = torch.zeros(b.tokens.shape, dtype=wide, device=b.tokens.device)
        for (_, width, start), rows in zip(cuts, device_indices([idx for idx, _, _ in cuts], b.tokens.device)):
            part = dataclasses.replace(b.take(rows).trimmed(width), trained_from=start)
            lp = recompute_logprobs(policy, part.tokens, cfg, part.positions, pipe=pipe,
                                    logits_from=first_anchor(part, cfg.ttt_passes, self.layout))
            if lp is not None:
                out[rows, :width] = lp.to(wide)
        return out if pipe is None else pipe.share(out, out, wide)


def _layout(batch: TrainBatch, lengths: list[int], rows_of: list[int], cfg: StepConfig, mesh: Mesh | None
            ) -> Minibatch:
    """Padded rows (cp = 1) or this CP rank's zigzag shard of one packed row (cp > 1).

    In the pack the draft's rows (every draft_row_stride-th sequence) are marked in draft_mask, so the
    draft's loss, counts and metrics are those of the padded layout's row stride."""
    if mesh is None or mesh.cp == 1:
        return Minibatch(batch, SHARED_PROMPTS if cfg.share_prompts else PADDED, rows_of)
    rows = torch.zeros(batch.tokens.shape[0], 1, device=batch.target_mask.device, dtype=batch.target_mask.dtype)
    rows[::cfg.draft_row_stride] = 1
    packed = pack(TrainBatch(**{**vars(batch), "draft_mask": batch.target_mask * rows}), lengths)
    zig = ZigzagLayout(packed.cu_seqlens, mesh.cp, mesh.cp_rank)
    return Minibatch(shard_batch(packed, zig), ZigzagPack(mesh.cp_group, zig), rows_of)


def minibatches(ro: Rollouts, n: int, cfg: StepConfig, pad_id: int, device, mesh: Mesh | None) -> list[Minibatch]:
    """The rollouts split into `n` PPO minibatches of whole prompt groups, interleaved (minibatch j holds
    this rank's groups g with g % n == j). Interleaving makes the split independent of data parallelism:
    DP ranks hold contiguous slices of whole groups, and with (groups per rank) % n == 0 the union of the
    ranks' minibatch j is the single process's minibatch j."""
    G = ro.group_size
    n_groups = len(ro.pairs) // G
    if n_groups % n:
        raise ValueError(f"{n_groups} prompt groups per rank do not split into train.minibatches={n}")
    out = []
    for j in range(n):
        rows = [g * G + i for g in range(j, n_groups, n) for i in range(G)]
        pairs = [ro.pairs[r] for r in rows]
        batch = build_batch(pairs, pad_id, device, cfg.width_multiple)
        batch.advantages = ro.advantages[rows].to(device)
        if ro.valid is not None and not bool(ro.valid.all()):  # excluded rows: no policy or draft token
            batch.target_mask = batch.target_mask * ro.valid[rows].to(batch.target_mask)[:, None]
        out.append(_layout(batch, [len(p) + len(c) for p, c in pairs], rows, cfg, mesh))
    return out


def engine_logprob_gap(ro: Rollouts, mb: Minibatch) -> float:
    """max |engine log-prob - trainer log-prob| over the completion tokens of a padded-rows minibatch
    whose logp_old was recomputed (a check of the rollout engine's numerics against the trainer's)."""
    lp = mb.batch.logp_old
    gap = 0.0
    for b, r in enumerate(mb.rows):
        p, c = ro.pairs[r]
        if c:  # completion token j sits at p + j and is predicted at p + j - 1
            eng = torch.tensor(ro.engine_logprobs[r], dtype=lp.dtype, device=lp.device)
            gap = max(gap, (eng - lp[b, len(p) - 1:len(p) - 1 + len(c)]).abs().max().item())
    return gap
