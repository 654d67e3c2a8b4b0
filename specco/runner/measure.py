"""A comparison's measurements, attached to the RL step as hooks (trainer.StepHooks); a job has none.

    hooks = hooks_for(cfg, st, pad_id, device, mesh)      what the arm's config asks for, in this order:
        FrozenDraftEval    a frozen arm: its draft's metrics on the step's rollouts (draft/..., time/draft_eval)
        PlainBaseline      config plain_baseline: the same prompts decoded plainly (time/rollout_plain, rollout/
                           plain_*) and, in a co-trained arm, the step's updates rerun without the draft
                           (time/train_plain), both timed and discarded
        FrozenShadow       config frozen_shadow: a frozen copy of the warm draft scored beside the co-trained one
                           (shadow/..., time/shadow)

Each leaves the arm's trajectory as it is without it, bit for bit (tests/test_measure.py), and its seconds out
of the step's time/other (trainer.Attached). runner/experiment.py reports what they measured.
"""
from __future__ import annotations

import copy
import dataclasses
import time

import torch
import torch.distributed as dist

from ..batch import TrainBatch
from ..config import RunConfig
from ..model.dflash import BlockDraft
from ..model.draft import Eagle3Draft
from ..model.policy import Policy
from ..parallel.layout import PADDED
from ..parallel.mesh import Mesh
from ..train.cotrain import StepConfig, amp_context, micro_batches, step_counts
from ..train.drafters import draft_mask, draft_rows, drafter, first_anchor
from ..train.losses import all_reduce_sums, metrics_to_floats
from .rollouts import Minibatch, Rollouts, completions, from_generator, generates, minibatches, phases_text
from .trainer import ArmState, StepHooks, grad_group, run_updates, settled, state_copy

__all__ = ["draft_eval", "draft_evals", "clone_generator", "FrozenDraftEval", "PlainBaseline", "FrozenShadow",
           "hooks_for"]


def draft_eval(policy: Policy, draft: Eagle3Draft | BlockDraft, b: TrainBatch, cfg: StepConfig, count_group=None,
               layout=PADDED) -> dict:
    """Draft metrics without training it (frozen arm): TTT loss per pass, top-1, simulated tau for EAGLE-3;
    per-slot acceptance / top-1, probabilistic and greedy tau, confidence error for a block drafter.
    `count_group` (DP x CP): global counts, so the metrics are global and the loss is this
    rank's share of the global mean (summed over ranks like the co-trained arm's). `layout`: the batch's
    (parallel/layout.py, Minibatch.layout; padded rows: only the draft's rows are run, in
    cfg.micro_batch_rows micro-batches: a 256-row batch of 2,000-token rows in one forward was 9× its tokens)."""
    return draft_evals(policy, {"draft": draft}, b, cfg, count_group, layout)["draft"]


def output_windows(mb: TrainBatch, window: int) -> list[tuple[int, TrainBatch]]:
    """(start, `mb` with its targets cut to the completion tokens at output positions [start, start + window))
    for every window that holds one: a completion token's output position is its index among its row's
    completion tokens (padded rows; config refuses shadow_window under cp > 1)."""
    mask = draft_mask(mb)
    pos = mask.cumsum(-1) - 1  # (B, S): output position of each completion token (-1 before the first)
    on = mask != 0
    # each window's first column over the rows (TrainBatch.trained_from: EAGLE-3 skips the anchors before it),
    # with the windows' count, in one host read
    S = mask.shape[1]
    cols = torch.arange(S, device=mask.device).expand_as(mask)[on]
    first = torch.full((S + 1,), S, device=mask.device).scatter_reduce(0, (pos[on] // window).long(), cols, "amin")
    first = first.tolist()
    out = []
    for w in range(sum(f < S for f in first)):
        m = mask * ((pos >= w * window) & (pos < (w + 1) * window))
        out.append((w * window, dataclasses.replace(mb, target_mask=m, draft_mask=None,
                                                    trained_from=max(mb.trained_from, first[w]))))
    return out


@torch.no_grad()
def draft_evals(policy: Policy, drafts: dict, b: TrainBatch, cfg: StepConfig, count_group=None,
                layout=PADDED, window: int = 0) -> dict[str, dict]:
    """`draft_eval` of several drafts of one kind and one set of aux layers ({name: draft}) on one policy forward
    per micro-batch: {name: metrics} (config frozen_shadow scores the co-trained draft and its frozen copy).
    `window` > 0: also each draft's simulated tau on the targets of each output-position window
    (`output_windows`; the loss reads only the policy forward's taps and logits, so the drafts run again per
    window on the same forward), as `draft/sim_accept_len@<start>` — the windows' counts are summed over
    micro-batches and ranks like the whole batch's."""
    first = next(iter(drafts.values()))
    kind = drafter(first)
    parts = [(None, b)]
    if not layout.packed and b.cu_seqlens is None:  # padded rows: only the draft's, in micro-batches like the train step's
        b = b.take(torch.arange(b.tokens.shape[0], device=b.tokens.device)[draft_rows(b, cfg)])
        cfg = dataclasses.replace(cfg, draft_row_stride=1)
        parts = micro_batches(b, cfg.micro_batch_rows, width_multiple=cfg.width_multiple)
    counts = step_counts(b, cfg, layout, count_group, first)
    loss, stats = dict.fromkeys(drafts, 0.0), {}
    if window:  # every window of the whole batch, so each micro-batch and rank sums the same keys
        assert not layout.packed and b.cu_seqlens is None, "output windows need one sequence per row"
        longest = draft_mask(b).sum(-1).max().to(torch.float64)  # every rank the same windows: the global longest
        if count_group is not None:
            dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=count_group)
        starts = range(0, int(longest), window)
    for rows, mb in parts:
        with amp_context(cfg, mb.tokens):
            out = policy(mb.tokens, mb.positions, tap_layers=first.cfg.aux_layer_ids, attn_core=layout.attn_core,
                         logits_from=first_anchor(mb, cfg.ttt_passes, layout))  # as the train step's
            scored = [(None, mb)] + (output_windows(mb, window) if window else [])
            for name, draft in drafts.items():
                # EAGLE-3: TTT loss per pass, top-1, simulated tau; a block drafter: per-slot acceptance,
                # probabilistic tau, confidence error (train/block_losses.BlockStats)
                for start, wmb in scored:
                    l_d, s = kind.loss(draft, policy, out, wmb, cfg, counts.draft, rows, layout=layout)
                    if start is None:
                        loss[name] = loss[name] + l_d
                    stats[name, start] = s if (name, start) not in stats else stats[name, start] + s
    if window:  # a micro-batch of short rows has no late windows: their counts stay 0 (sim tau 1 then)
        zero = {name: type(stats[name, None])(*(torch.zeros_like(t) for t in stats[name, None]._tensors()))
                for name in drafts}
        for name in drafts:
            for start in starts:
                stats.setdefault((name, start), zero[name])
    # one order on every rank (a rank whose first micro-batch lacked a window met its key later): the sums travel
    # concatenated in this order
    keys = [(name, start) for name in drafts for start in [None, *(starts if window else ())]]
    reduced = dict(zip(keys, all_reduce_sums([stats[k] for k in keys], count_group)))
    res = {name: metrics_to_floats({**reduced[name, None].metrics(), "draft/loss": loss[name]}) for name in drafts}
    for (name, start), st in reduced.items():
        if start is not None:
            m = st.metrics()
            res[name][f"draft/sim_accept_len@{start}"] = float(m["draft/sim_accept_len"])
            res[name][f"draft/tokens@{start}"] = float(m["draft/tokens"])
    return res


def clone_generator(gen: torch.Generator) -> torch.Generator:
    """A generator in `gen`'s state on its device: the same draws, and `gen` itself is not advanced."""
    g = torch.Generator(device=gen.device)
    g.set_state(gen.get_state())
    return g


@dataclasses.dataclass
class _Where:
    """What every measurement needs to lay out the step's rows: the pad id, the device, the mesh."""
    pad_id: int
    device: object
    mesh: Mesh | None = None

    def whole(self, ro: Rollouts, scfg: StepConfig) -> Minibatch:
        """All of this rank's rollouts as one minibatch, laid out as the step lays out its minibatches."""
        return minibatches(ro, 1, scfg, self.pad_id, self.device, self.mesh)[0]


class FrozenDraftEval(StepHooks):
    """A frozen arm's draft metrics (its draft is never trained, so the step has none): `draft_eval` of the
    draft on the step's rollouts after the updates, under the policy's weights then — the trainer's copy, or
    under pipeline parallelism the engine's whole copy (in rollout.dtype: bf16 for a pretrained policy on a GPU),
    still the sampling policy's until the refit. Keys
    `draft/...` as a co-trained arm logs them; `time/draft_eval`."""

    def __init__(self, where: _Where):
        self.where = where

    def after_update(self, st: ArmState, ro: Rollouts, mbs: list[Minibatch], scfg: StepConfig) -> dict:
        t0 = time.perf_counter()
        whole = self.where.whole(ro, scfg)
        policy = st.engine.policy if st.pipeline is not None else st.policy
        m = draft_eval(policy, st.draft, whole.batch, scfg, grad_group(self.where.mesh), whole.layout)
        m["time/draft_eval"] = time.perf_counter() - t0
        return m


class PlainBaseline(StepHooks):
    """Config plain_baseline: the step without the draft, measured on the arm's own tokens and then discarded.

    Rollout: the same prompts decoded plainly on the same engine, runner and policy from the sampler state the
    speculative call started from (a clone: the arm's own sampler is never advanced), timed. Under the coupled
    sampler plain decoding draws exactly the speculative call's tokens (rollout/sampling.py), so this is the
    same work without the draft, in the same step; `rollout/plain_rows_equal` says how many rows came out
    identical (on a GPU a near-tie between a verify forward's logits and a one-token step's can flip a draw now
    and then). The generating rank of each DP group decodes; its metrics travel like the rollouts.

    Train step (`train`: a co-trained arm off pipeline parallelism): the step's PPO updates run again without
    the draft, on the same minibatches from the same start, timed, then undone: the weights and optimizer state
    the real updates left go back, bit for bit. Its difference from time/train is everything the draft adds
    to a train step (its forward and backward, which `time/train_draft` times, its taps, its optimizer and
    clipping work) plus what a first pass over the minibatches costs more than a second. It runs after the
    real updates, both clocks starting on a settled device (trainer.settled), and reads low: any second pass
    over a minibatch runs faster than the first, with or without the draft (on the H200 0.19-0.24 s per 64-row
    update, bench/cotrain_ragged.py --paired; in the tenth and eleventh runs the rerun took ~1.0 s less than
    the real updates whose draft span was 0.43 s). The report takes train − the draft's span as the no-draft
    train step and this rerun as a low bound (report.baseline_split).

    Memory: the rerun holds two copies of the policy's weights and AdamW state beside the live ones (the start,
    taken before the updates, and the end, while the rerun runs): 2 × (weights + two moments) = 6× the
    policy's fp32 parameter bytes at the peak, as before the hooks. The step's own copy under
    train.on_nonfinite=skip (trainer.train_on_rollouts, which also holds the draft's weights) used to be that
    start copy; now each keeps its own, so a run with both holds one more copy of the policy's weights and
    AdamW state (3× its parameter bytes; ~3.8 GB for a 316M fp32 policy) through the updates — a
    measurement run's cost, never a job's (no hook; the default on_nonfinite=stop takes no copy at all).
    """

    def __init__(self, where: _Where, train: bool, epochs: int = 1):
        self.where, self.train, self.epochs = where, train, epochs  # epochs: train.ppo_epochs
        self.gen: torch.Generator | None = None  # the sampler as the step's rollout found it
        self.start: tuple[dict, dict] | None = None  # the policy's and optimizer's state when the updates began

    def before_rollout(self, st: ArmState) -> None:
        self.gen = clone_generator(st.gen)  # the same keys: the plain decode's draws

    def after_rollout(self, st: ArmState, ro: Rollouts, scfg: StepConfig) -> dict:
        m = None
        if generates(self.where.mesh):
            G = ro.group_size
            prompts = [p for p, _ in ro.pairs[::G]]  # row b*G+g holds sample g of prompt b
            t0 = time.perf_counter()
            base = st.engine.generate(prompts, group_size=G, generator=self.gen, speculate=False)
            t_plain = time.perf_counter() - t0
            same = torch.tensor([c == s for c, (_, s) in zip(completions(base), ro.pairs)])  # rows: length, tokens
            m = {"time/rollout_plain": t_plain, "rollout/plain_speedup": t_plain / ro.metrics["time/rollout"],
                 "rollout/plain_rows_equal": same.float().mean().item(),
                 "time/rollout_plain_phases": phases_text(base.phases)}
        self.gen = None
        return from_generator(m, self.where.mesh)

    def before_update(self, st: ArmState, mbs: list[Minibatch], scfg: StepConfig) -> None:
        if self.train:
            self.start = (state_copy(st.policy), copy.deepcopy(st.opt.state_dict()))

    def after_update(self, st: ArmState, ro: Rollouts, mbs: list[Minibatch], scfg: StepConfig) -> dict:
        """Before the LR schedule's step (trainer.train_on_rollouts): the learning rates the updates ran at."""
        if not self.train:
            return {}
        end = (state_copy(st.policy), copy.deepcopy(st.opt.state_dict()))
        st.policy.load_state_dict(self.start[0])
        st.opt.load_state_dict(self.start[1])
        self.start = None
        t0 = settled(next(st.policy.parameters()).device)  # as the real updates' clock starts
        # cotrain_step's metrics read its results back to the host: the updates have finished
        run_updates(st, None, mbs, scfg, self.epochs, grad_group(self.where.mesh))
        seconds = time.perf_counter() - t0
        st.policy.load_state_dict(end[0])
        st.opt.load_state_dict(end[1])
        return {"time/train_plain": seconds}


class FrozenShadow(StepHooks):
    """Config frozen_shadow: the co-trained draft that decoded this step's rollouts and a frozen copy of the
    arm's warm draft, each scored (`draft_eval`: simulated tau, loss, per-pass or per-slot agreement) on those
    rollouts under the policy that sampled them, before the step's update. The same estimator, rows and teacher
    for both, so their ratio is co-training's gain on this arm's own trajectory. Keys `shadow/cotrained/...`
    and `shadow/frozen/...`; `time/shadow`. `window` (config shadow_window): also per output-position window.

    `draft`: the arm's draft as made (make_arm: compiled like the trainer's under train.compile_draft), copied
    before any checkpoint is loaded into the arm, so a resumed arm's shadow is still the warm draft."""

    def __init__(self, where: _Where, draft: Eagle3Draft | BlockDraft, window: int = 0):
        self.where, self.window = where, window
        self.frozen = copy.deepcopy(draft).eval().requires_grad_(False)

    def after_rollout(self, st: ArmState, ro: Rollouts, scfg: StepConfig) -> dict:
        t0 = time.perf_counter()
        whole = self.where.whole(ro, scfg)  # the rows the step's draft trains on (scfg: its stride)
        scores = draft_evals(st.policy, {"cotrained": st.draft, "frozen": self.frozen}, whole.batch, scfg,
                             grad_group(self.where.mesh), whole.layout, self.window)
        m = {f"shadow/{tag}/{k.partition('/')[2]}": v for tag, ms in scores.items() for k, v in ms.items()}
        m["time/shadow"] = time.perf_counter() - t0
        return m


def hooks_for(cfg: RunConfig, st: ArmState, pad_id: int, device, mesh: Mesh | None = None,
              shadow=None) -> list[StepHooks]:
    """The measurement hooks of `st`'s arm (module docstring), made right after make_arm: [] for a job's
    co-trained or no-draft arm without plain_baseline and frozen_shadow. `shadow`: the frozen shadow's draft
    (None: st.draft as made, the arm's warm draft)."""
    where = _Where(pad_id, device, mesh)
    hooks: list[StepHooks] = []
    if st.mode == "frozen":
        hooks.append(FrozenDraftEval(where))
    if cfg.measures_plain(st.arm):
        hooks.append(PlainBaseline(where, train=st.mode == "cotrained" and st.pipeline is None,
                                   epochs=cfg.train.ppo_epochs))
    if cfg.measures_shadow(st.arm):
        hooks.append(FrozenShadow(where, st.draft if shadow is None else shadow, cfg.shadow_window))
    return hooks
