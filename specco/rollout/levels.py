"""A runner's levels: one decode state per batch size, with its step sets and their graphs.

A `Level` owns, for one batch size (the root: every row; a compacted size: the live rows, see
compaction.py), its `DecodeState`, its step sets — `PlainSteps` (k = 0) and, with a draft,
`SpeculativeSteps` for every k = 1..k_max — their captured CUDA graphs, and the per-round cost of
each k measured on those graphs (control.py picks k from them). All step sets of a level share the
state: speculative rounds of any k keep the same invariant (speculative.py), so k can change
between rounds. The runner (generate.py) only allocates levels and drives rounds.
"""
from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist

from ..model.policy import Policy
from .control import Choice
from .drafters import engine_kind
from .forward import RopeTable, policy_forward
from .graphs import StepGraphs
from .sampling import SamplingParams
from .tp import tp_group_of, vocab_parallel
from .speculative import SpeculativeSteps, next_token
from .state import DecodeState, commit


class PlainSteps:
    """Plain decoding: one target forward at position n per round, sample, commit, advance."""

    def __init__(self, policy: Policy, st: DecodeState, params: SamplingParams, max_new_tokens: int,
                 stop_ids: torch.Tensor | None, rope: RopeTable):
        self.policy, self.st, self.params, self.rope = policy, st, params, rope
        self.max_new_tokens, self.stop_ids = max_new_tokens, stop_ids
        self.order = ["decode"]
        self.fns = {"decode": self.decode}

    def decode(self):
        st = self.st
        logits, _, _ = policy_forward(self.policy, st.last_tok[:, None], st.n[:, None], st.t_cache, self.rope,
                                      whole_logits=not vocab_parallel(self.policy, self.params))
        tok, logp = next_token(self.policy, st, self.params, logits[:, 0])  # the token at position n+1
        commit(st, tok[:, None], torch.ones_like(tok), logp[:, None], self.max_new_tokens, self.stop_ids)
        live = ~st.finished
        st.n.add_(live.long())
        st.last_tok.copy_(torch.where(live, tok, st.last_tok))


def new_state(policy: Policy, draft, params: SamplingParams, max_new_tokens: int,
              k_max: int, rows: int, cache_len: int, device) -> DecodeState:
    """Zeroed decode buffers for `rows` rows (cache length, k_max draft tokens, sampling or greedy); the draft's
    own buffers are its kind's (drafters.py)."""
    T, W = max_new_tokens, k_max + 1
    sampled = not params.greedy and not params.keyed  # inverse-CDF uniforms; coupled draws use row keys
    zeros = lambda *s, dt=torch.long: torch.zeros(s, dtype=dt, device=device)  # noqa: E731
    st = DecodeState(
        n=zeros(rows), last_tok=zeros(rows),
        out_tokens=zeros(rows, T + W), out_logp=zeros(rows, T + W, dt=torch.float32),
        out_len=zeros(rows), finished=torch.ones(rows, dtype=torch.bool, device=device), row_rounds=zeros(rows),
        n_emitted=zeros(), n_row_forwards=zeros(), n_accepted=zeros(k_max), n_proposed=zeros(k_max),
        n_tried=zeros(k_max), t_cache=policy.new_cache(rows, cache_len))
    n_uniforms = 1
    kind = engine_kind(draft)
    if kind is not None:
        n_aux = len(draft.cfg.aux_layer_ids)
        for name, t in kind.draft_buffers(policy, draft, rows, cache_len, device).items():
            setattr(st, name, t)
        st.draft_tok = zeros(rows, k_max)
        st.taps = zeros(rows, W, n_aux * policy.cfg.hidden_size, dt=st.t_cache.k.dtype)
        st.num_accepted, st.block = zeros(rows), zeros(rows, W)
        if sampled:
            st.q_draft = zeros(rows, k_max, policy.cfg.vocab_size, dt=torch.float32)
        n_uniforms = kind.steps.num_uniforms(k_max)
    if sampled:
        st.u = zeros(rows, n_uniforms, dt=torch.float32)
    if params.keyed:
        st.key = zeros(rows)
    return st


class Level:
    """One decode state with its step sets (k = 0 plain; k = 1..k_max speculative), graphs and costs.

    root_rows: (rows,) which root row each row holds (None for the root). `k` is the step set the
    next round runs; `choice` says why (control.py), None until chosen. tracked: the tracked plain round
    (speculative.py, k = 0 of the draft's kind), built where a smaller level may follow; `tracking` says
    whether a k = 0 round runs it instead of the plain step (control.LevelK decides).
    """

    def __init__(self, st: DecodeState, steps: dict[int, PlainSteps | SpeculativeSteps], use_graphs: bool,
                 root_rows: torch.Tensor | None, tracked: SpeculativeSteps | None = None):
        self.st, self.steps, self.root_rows, self.tracked = st, steps, root_rows, tracked
        self.graphs = {k: StepGraphs(s.fns, use_graphs) for k, s in self._sets()}
        self.k = max(steps)
        self.tracking = False
        self.costs: dict[int, float] = {}  # k -> seconds per round, measured on the graphs
        self.track_cost: float | None = None  # seconds per tracked plain round
        self.choice: Choice | None = None

    def _sets(self):
        """(key, step set) of every step set: k = 0..k_max, and "tracked" if built."""
        return [*self.steps.items(), *([("tracked", self.tracked)] if self.tracked is not None else [])]

    @property
    def rows(self) -> int:
        return self.st.n.numel()

    def capture(self, freeze: Callable[[], None], pool) -> None:
        """Capture every step set's round as CUDA graphs sharing `pool` (they never run at once and
        exchange data only through the state's static buffers, so their temporaries may overlap)."""
        for k, steps in self._sets():
            self.graphs[k].capture(self.st.small_tensors(), steps.order, freeze, pool=pool)

    def round(self) -> None:
        key = "tracked" if self.k == 0 and self.tracking else self.k
        steps = self.tracked if key == "tracked" else self.steps[key]
        for name in steps.order:
            self.graphs[key].run(name)

    @torch.no_grad()
    def measure(self, iters: int | None = None) -> dict[int, float]:
        """Seconds per round of every k, timed with the rows frozen (the work is static-shaped, so
        identical) at the state's current positions; the state is restored. On CUDA the captured
        graphs are timed with events, 5 rounds each after a warm one; on CPU the eager steps with the host
        clock, 2 rounds each (an eager CPU round costs as much as decoding: at 5 the measurements were ~40% of a
        tiny CPU run's rollout time, tests/test_plain_baseline.py's long_ab run)."""
        saved = [t.clone() for t in self.st.small_tensors()]
        self.st.finished.fill_(True)
        cuda = self.st.n.is_cuda
        iters = iters or (5 if cuda else 2)
        costs = {}
        for k, steps in self._sets():
            run = lambda: [self.graphs[k].run(name) for name in steps.order]  # noqa: E731
            run()
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            for _ in range(iters):
                run()
            if cuda:
                end.record()
                end.synchronize()
                costs[k] = start.elapsed_time(end) / 1e3 / iters
            else:
                costs[k] = (time.perf_counter() - t0) / iters
        self.track_cost = costs.pop("tracked", None)
        self.costs = costs
        for t, s in zip(self.st.small_tensors(), saved):
            t.copy_(s)
        group = tp_group_of(next(iter(self.steps.values())).policy)
        if group is not None:  # a tensor-parallel engine (rollout/tp.py): every rank must choose the same k (its
            # rounds are collectives of k-dependent shapes), so each k's cost is the slowest rank's
            ks = sorted(self.costs)
            t = torch.tensor([self.costs[k] for k in ks], dtype=torch.float64, device=self.st.n.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            self.costs = dict(zip(ks, t.tolist()))
        return self.costs
