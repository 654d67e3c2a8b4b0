"""Batched generation: prefill + plain or speculative decode over a position-indexed KV cache.

Prompts of different lengths are left-aligned (right-padded) in one prefill; from then on every row
has its own position counter n_b (state.py), and the cache is indexed by position, so rows never
need to be re-aligned and a speculative rejection is just a smaller advance of n_b.

Log-probs returned. For temperature > 0 each emitted token's log-prob is log p(token) under the
*processed* target distribution p (temperature, top-k, top-p; sampling.processed_logprobs) — the
distribution the token was sampled from (plain) or verified against (speculative), identical in
both modes because speculative sampling is exact. For temperature == 0 that p is a one-hot (log p
= 0, useless to RL), so we report log_softmax(raw logits) instead. A trainer that recomputes
log-probs must apply the same processing to compare like with like.

Speed (docs/DESIGN.md §6): every step — the prefill (target prefill, first token, draft prompt catch-up)
and each decode step — is an in-place function over static buffers, captured as a CUDA graph on
GPU (graphs.py); the host syncs once per round to test whether all rows finished.

Shape buckets. A `DecodeRunner` allocates its buffers and captures its graphs for one shape and
keeps them across calls: `RolloutEngine` holds runners keyed by shape, so an RL loop that calls
generate once per step captures once, not per call. To make shapes recur, with graphs the batch
is padded up to a bucket (prompts: next power of two up to 32, then multiples of 32; padding rows
are finished from the start and cut from the result) and the prompt length up to a multiple of 16
(the right-padding the prefill already handles); the cache length follows from those two (shapes.py).
A runner built for longer prompts serves shorter ones, right-padded (RunnerShape.holds).

Live-row compaction (compaction.py). `run()` moves the live rows into a smaller state once they are
<= cfg.compact_below of the batch (and again from there); each compacted size gets its own buffers
and graphs, built on first use and kept by the runner's LevelStack. `result()` writes the outputs back.
Stepping a runner by hand (`round()`) never compacts.

The runner's pieces: the drafter kind (drafters.py: the draft's buffers, prefill and round steps), the levels
(levels.py: a state with its step sets and graphs) in a LevelStack (compaction.py), the per-level k choice
(control.LevelK) and the phase timing (phases.PhaseClock). What is left here is the prefill and the decode loop.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Sequence

import torch

from ..model.policy import Policy
from . import compaction
from .compaction import LevelStack
from .config import GenerateConfig  # noqa: F401 (its home; re-exported)
from .control import LevelK, SpecController
from .drafters import engine_kind
from .forward import RopeTable, policy_forward
from .tp import head_logits, pick_one, tp_group_of, vocab_parallel
from .graphs import StepGraphs
from .levels import Level, PlainSteps, new_state
from .phases import Phase, PhaseClock  # noqa: F401 (Phase re-exported: GenerateOutput.phases holds them)
from .sampling import keyed_gumbel, pick_tokens_logp
from .shapes import PromptBuffers, RunnerShape, execution_modes, pad_prompts, runner_shape, speculation_control
from .speculative import gather_rows
from .state import fill_groups, group_leaders, is_stop


@dataclass
class GenerateOutput:
    tokens: torch.Tensor  # (N, T) int64, N = num_prompts * group_size (row b*G + g), pad after length
    lengths: torch.Tensor  # (N,) int64 emitted tokens per row (EOS included)
    logprobs: torch.Tensor  # (N, T) fp32 target log-prob of each emitted token (0 after length)
    tau: float  # mean tokens emitted per target forward per live row, decode rounds (1.0 plain)
    accept_rate: torch.Tensor  # (k,) fp64: P(draft token j accepted) over live row-rounds proposing it
    num_target_forwards: int  # batched target forwards, prefill included
    group_size: int = 1
    choices: tuple = ()  # speculation control: control.Choice per level entered (root first) and per re-choice
    accept_counts: tuple | None = None  # (n_accepted, n_tried) per position (k,), int64: control.py
    # (N,) int64 decode rounds each row took part in: its own tokens per round is (lengths - 1) / row_rounds
    # (the prefill emits the first token). The batch runs as many rounds as its slowest row needs.
    row_rounds: torch.Tensor | None = None
    # a Phase per level the call decoded at: the whole (bucketed) batch first, then each compacted size
    # (DecodeRunner.run); empty when the runner was driven round by round
    phases: tuple = ()


def seeded_generator(device) -> torch.Generator:
    """A fresh generator on `device` seeded from the global torch RNG (reproducible under
    torch.manual_seed): what a generate call without an explicit generator samples with."""
    seed = int(torch.randint(0, 2**62, (1,)).item())
    return torch.Generator(device=device).manual_seed(seed)


class DecodeRunner:
    """Static buffers and (on GPU) captured step graphs for generation at one shape; one batched
    generation at a time. `generate` is prefill -> run -> result.

    A runner can be reused: `prefill` with prompts of the same shape bucket refills the buffers and
    replays the graphs captured the first time (a new bucket reallocates and recaptures). The
    graphs read the models' parameters in place, so in-place weight updates (RolloutEngine.refit)
    are seen by the next replay; replacing parameter tensors is not (the engine checks for that).

    Levels (levels.py): the root holds every row; compaction enters smaller levels (`stack`, a
    compaction.LevelStack), kept across calls. Each level has step sets for k = 0 (plain) and, with a
    draft, k = 1..k_max; `level.k` is the one its rounds run — k_max unless speculation control
    (`k_choice`, control.LevelK) chose another.

    Tests and the benchmark drive it step by step: `prefill`, `round`, `result`;
    `level.graphs[k].run(name)` replays a single captured step, `prefill_graph.run('prefill')` the
    prefill.
    """

    def __init__(self, policy: Policy, cfg: GenerateConfig, draft=None,
                 generator: torch.Generator | None = None, controller: SpecController | None = None):
        self.policy, self.cfg, self.draft = policy, cfg, draft
        self.kind = engine_kind(draft)  # drafters.py: the draft's buffers, prefill and round steps
        self.device = next(policy.parameters()).device
        self.generator = generator
        self.use_graphs, _ = execution_modes(cfg, self.device)  # (bucketing: runner_shape)
        self.k = cfg.num_draft_tokens if draft is not None else 0  # k_max
        stops = cfg.eos_token_id if isinstance(cfg.eos_token_id, tuple) else (cfg.eos_token_id,)
        # (n_stop,) int64 on the device, read by the steps (and their graphs) to end rows; None: no stop token
        self.stop_ids = None if cfg.eos_token_id is None else torch.tensor(stops, dtype=torch.long, device=self.device)
        control = speculation_control(cfg, self.device)
        self.controller = (controller or SpecController(self.k)) if control and draft is not None else None
        self.k_choice = LevelK(self.controller, self._levels_below)
        self.shape: RunnerShape | None = None
        self.io: PromptBuffers | None = None
        self.stack: LevelStack | None = None  # the root level and the compacted ones (_allocate)
        self.prefill_graph: StepGraphs | None = None
        self.ropes: tuple[RopeTable, RopeTable | None] | None = None
        self.pool = None
        self.num_rows = self.group_size = 0
        self.num_target_forwards = 0
        self.phases: tuple[Phase, ...] = ()  # this call's levels decoded at, in order (run)
        self.speculate = True  # False: this call decodes plainly (prefill_padded)

    @property
    def level(self) -> Level:
        """The level rounds run on now."""
        return self.stack.current

    @property
    def st(self):
        """The decode state rounds run on now."""
        return self.stack.current.st

    def nbytes(self) -> int:
        """Bytes of this runner's buffers: every level's state (KV caches first of all) and the prompts'."""
        levels = [self.stack.root, *self.stack.levels.values()] if self.stack is not None else []
        tensors = [t for lv in levels for t in lv.st.small_tensors()]
        tensors += [c.k for lv in levels for c in (lv.st.t_cache, lv.st.d_cache) if c is not None]
        tensors += [c.v for lv in levels for c in (lv.st.t_cache, lv.st.d_cache) if c is not None]
        if self.io is not None:
            tensors += [t for t in (self.io.ids, self.io.lens, self.io.real, self.io.u0, self.io.key0)
                        if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def shape_for(self, num_prompts: int, prompt_len: int, group_size: int) -> RunnerShape:
        return runner_shape(self.cfg, self.device, self.draft, num_prompts, prompt_len, group_size)

    # -- prefill ---------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, prompts: Sequence, group_size: int = 1,
                generator: torch.Generator | None = None):
        """Start a generation: `prompts` (token-id sequences), `group_size` samples each.
        generator: for this generation's randomness; None keeps the runner's (or seeds one)."""
        ids, lens = pad_prompts(prompts)
        self.prefill_padded(ids, lens, group_size, generator)

    @torch.no_grad()
    def prefill_padded(self, ids: torch.Tensor, lens: torch.Tensor, group_size: int = 1,
                       generator: torch.Generator | None = None, speculate: bool = True):
        """`prefill` from host-side right-padded ids (B0, S) and lengths (B0,). `speculate=False`: this call
        decodes plainly through the runner's plain step set (a baseline on the same runner) and leaves the
        speculation controller's acceptance estimate as it was."""
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        if not speculate and self.draft is not None and self.controller is None:
            raise ValueError("plain decoding through a speculative runner needs speculation control (it builds the "
                             "plain step set): set GenerateConfig.spec_control=True (rollout.spec_control=on)")
        self.speculate = speculate
        if generator is not None:
            self.generator = generator
        elif self.generator is None:
            self.generator = seeded_generator(self.device)
        B0, S = ids.shape
        shape = self.shape_for(B0, S, group_size)
        if self.shape is None or not self.shape.holds(shape):
            self._allocate(shape)
        shape = self.shape
        self.stack.unwind()  # a generation left unfinished by step-by-step driving
        self.num_rows, self.group_size = B0 * group_size, group_size
        io = self.io
        # Host -> device: the whole padded block in one copy per buffer (padding prompts: one
        # token 0, length 1, marked not real).
        host_ids = torch.zeros(shape.prompts, shape.prompt_len, dtype=torch.long)
        host_ids[:B0, :S] = ids
        host_lens = torch.ones(shape.prompts, dtype=torch.long)
        host_lens[:B0] = lens
        io.ids.copy_(host_ids)
        io.lens.copy_(host_lens)
        io.real.copy_(torch.arange(shape.prompts) < B0)
        if io.u0 is not None:  # the same draws as an unpadded batch: N uniforms, then per round
            torch.rand(self.num_rows, generator=self.generator, device=self.device,
                       out=io.u0[: self.num_rows])
        if io.key0 is not None:  # coupled: one key per row; every later draw is a function of it
            torch.randint(0, 1 << 31, (self.num_rows,), generator=self.generator, device=self.device,
                          out=io.key0[: self.num_rows])
        self.prefill_graph.run("prefill")
        self.num_target_forwards = 1
        self.phases = ()
        self.k_choice.start()
        self.k_choice.enter(self.stack.root, allow_speculation=speculate)

    def _allocate(self, shape: RunnerShape):
        """Static buffers for `shape`, the root level and the prefill step (and their graphs)."""
        dev = self.device
        self.shape = shape
        N = shape.prompts * shape.group_size
        sampled, keyed = not self.cfg.sampling.greedy, self.cfg.sampling.keyed
        self.io = PromptBuffers(ids=torch.zeros(shape.prompts, shape.prompt_len, dtype=torch.long, device=dev),
                                lens=torch.ones(shape.prompts, dtype=torch.long, device=dev),
                                real=torch.zeros(shape.prompts, dtype=torch.bool, device=dev),
                                u0=torch.zeros(N, dtype=torch.float32, device=dev) if sampled and not keyed else None,
                                key0=torch.zeros(N, dtype=torch.long, device=dev) if keyed else None)
        pc = self.policy.cfg
        if shape.cache_len > pc.max_position_embeddings:
            warnings.warn(f"generation reaches position {shape.cache_len - 1} (prompt {shape.prompt_len} + "
                          f"max_new_tokens {self.cfg.max_new_tokens} + lookahead), past the policy's "
                          f"max_position_embeddings={pc.max_position_embeddings}: RoPE extrapolates there and the "
                          "model was not trained for it", stacklevel=3)
        rope = RopeTable.build(pc.head_dim, pc.rope_theta, shape.cache_len, dev, self.policy.embed_tokens.weight.dtype,
                               scaling=pc.rope_scaling)
        d_rope = None
        if self.draft is not None:
            dc = self.draft.cfg
            d_rope = rope if (dc.head_dim, dc.rope_theta, dc.rope_scaling) == (pc.head_dim, pc.rope_theta, pc.rope_scaling) and \
                self.draft.fc.weight.dtype == rope.cos.dtype else \
                RopeTable.build(dc.head_dim, dc.rope_theta, shape.cache_len, dev, self.draft.fc.weight.dtype,
                                scaling=dc.rope_scaling)
        self.ropes = (rope, d_rope)
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.stack = LevelStack(self._new_level(N, None), self._new_level)
        self.prefill_graph = StepGraphs({"prefill": self._prefill_step}, self.use_graphs)
        if self.use_graphs:
            # Captured before any prompt is loaded: the buffers hold zeros (valid ids, lengths 1,
            # uniforms 0) and every prompt is marked padding, so the warm-up's prefill leaves all
            # rows finished.
            def freeze():
                self.io.real.fill_(False)
                self.stack.root.st.finished.fill_(True)
            self.prefill_graph.capture(self.stack.root.st.small_tensors(), ["prefill"], freeze, pool=self.pool)

    def _new_level(self, rows: int, root_rows: torch.Tensor | None) -> Level:
        """A level of `rows` rows: zeroed state, step sets for k = 0..k_max (and the tracked plain round), graphs
        captured on GPU (every row finished while capturing, so the warm-up steps advance nothing)."""
        cfg, (rope, d_rope) = self.cfg, self.ropes
        st = new_state(self.policy, self.draft, cfg.sampling, cfg.max_new_tokens, self.k, rows,
                       self.shape.cache_len, self.device)
        # Without speculation control only k_max runs (0 without a draft): no other step set is built.
        ks = range(self.k + 1) if self.controller is not None else [self.k]
        steps = {k: PlainSteps(self.policy, st, cfg.sampling, cfg.max_new_tokens, self.stop_ids, rope)
                 if k == 0 else self.kind.steps(self.policy, self.draft, st, cfg.sampling, k, cfg.max_new_tokens,
                                                self.stop_ids, rope, d_rope) for k in ks}
        # the tracked plain round (control.py, rule for levels) where a smaller level may follow this one
        below = compaction.smaller_sizes(rows, cfg.compact_below, cfg.compact_min_rows)
        tracked = self.kind.steps(self.policy, self.draft, st, cfg.sampling, 0, cfg.max_new_tokens, self.stop_ids,
                                  rope, d_rope) if self.controller is not None and below else None
        level = Level(st, steps, self.use_graphs, root_rows, tracked)
        if self.use_graphs:
            level.capture(lambda: st.finished.fill_(True), self.pool)
        return level

    def _levels_below(self, level: Level) -> list[tuple[int, dict] | None]:
        """The sizes a level compacted from `level` may take (compaction.smaller_sizes), each as (rows, measured
        costs), None where not measured yet."""
        out = []
        for rows in compaction.smaller_sizes(level.rows, self.cfg.compact_below, self.cfg.compact_min_rows):
            lv = self.stack.levels.get(rows)
            out.append((rows, lv.costs) if lv is not None and lv.costs else None)
        return out

    def _prefill_step(self):
        """Target prefill over the prompts (once per prompt: the G samples of a group share its
        cache rows), first token per sample, state reset, draft prompt catch-up. In place."""
        cfg, policy, draft, st, io = self.cfg, self.policy, self.draft, self.stack.root.st, self.io
        G, S = self.shape.group_size, self.shape.prompt_len
        rope, d_rope = self.ropes
        tap_layers = tuple(draft.cfg.aux_layer_ids) if draft is not None else None
        pos = torch.arange(S, device=self.device).expand(io.ids.shape[0], S)  # right-padded: 0..S-1
        _, hidden, taps = policy_forward(policy, io.ids, pos, group_leaders(st.t_cache, G), rope,
                                         tap_layers=tap_layers, prefill=True, compute_logits=False)
        fill_groups(st.t_cache, G, S)
        n0 = io.lens.repeat_interleave(G)  # (N,) the first token's position
        if io.key0 is not None:
            st.key.copy_(io.key0)
        last = gather_rows(hidden, io.lens - 1)  # (B0, h): the prompts' last positions
        if vocab_parallel(policy, cfg.sampling):  # a tp shard: its vocabulary block, a reduction per row
            local = policy.lm_head(last).repeat_interleave(G, dim=0)  # (N, V/tp)
            first, first_logp = pick_one(local, cfg.sampling, tp_group_of(policy), io.key0, n0, io.u0)
        else:
            logits = head_logits(policy, last).repeat_interleave(G, dim=0)  # (N, V)
            noise = io.u0
            if io.key0 is not None:
                noise = keyed_gumbel(io.key0, n0[:, None], logits.shape[-1])[:, 0]  # (N, V)
            first, first_logp = pick_tokens_logp(logits, cfg.sampling, noise)
        st.n.copy_(n0)
        st.last_tok.copy_(first)
        st.out_tokens.zero_()
        st.out_tokens[:, 0] = first
        st.out_logp.zero_()
        st.out_logp[:, 0] = first_logp
        st.out_len.fill_(1)
        st.row_rounds.zero_()
        finished = ~io.real.repeat_interleave(G)  # padding rows never run
        if cfg.max_new_tokens <= 1:
            finished.fill_(True)
        if self.stop_ids is not None:
            finished |= is_stop(first, self.stop_ids)
        st.finished.copy_(finished)
        for t in (st.n_emitted, st.n_row_forwards, st.n_accepted, st.n_proposed, st.n_tried):
            t.zero_()
        if self.kind is not None:
            self.kind.prefill(policy, draft, st, io.ids, io.lens, taps.aux, first, G, d_rope)

    # -- decode ----------------------------------------------------------------------------
    @torch.no_grad()
    def run(self):
        """Decode rounds until every row is finished: gpt-fast's decode_n_tokens, except that the batch moves to a
        smaller level when most rows are done (compaction) and a level may re-choose its k (control.LevelK).
        `phases`: one per level decoded at (phases.py)."""
        cfg = self.cfg
        clock = PhaseClock(self.st)
        # the prefill emitted token 1 and every round emits >= 1 per live row: T - 1 rounds always suffice
        for _ in range(cfg.max_new_tokens - 1):
            live = int((~self.st.finished).sum())  # the one host sync per round
            if live == 0:
                break
            size = compaction.compact_size(live, self.st.finished.numel(), cfg.compact_below, cfg.compact_min_rows)
            if size is not None:
                clock.lap(self.st, size)  # the phase ends at the level it leaves
                self._compact(size)
            else:  # a level just entered was chosen for; re-checks count its rounds from there
                self.k_choice.recheck(self.level, clock.rounds)
            self.round()
            clock.tick()
        self.phases = clock.stop(self.st)

    @torch.no_grad()
    def round(self):
        """One decode round of the current level: a plain step, or propose -> verify -> catch up."""
        self._fill_uniforms()
        self.level.round()
        self.num_target_forwards += 1

    def _fill_uniforms(self):
        # One host-side RNG launch per round, outside the graphs. Only the real rows draw (the
        # same stream as an unpadded batch); padding rows keep the valid uniform 0. After a
        # compaction the draw is still for every original row, then gathered: the same stream.
        root, level = self.stack.root.st, self.level
        if root.u is not None:
            u = root.u[: self.num_rows]
            torch.rand(u.shape, generator=self.generator, device=self.device, out=u)
            if level.root_rows is not None:
                torch.index_select(root.u, 0, level.root_rows, out=level.st.u)

    def _compact(self, size: int):
        """Move the live rows into a `size`-row level (compaction.LevelStack) and choose its k there: a level
        entered from an untracked plain one stays plain (control.py, rule for levels)."""
        draft_current = self.level.k > 0 or self.level.tracking
        self.k_choice.enter(self.stack.enter(size), allow_speculation=draft_current)

    def result(self) -> GenerateOutput:
        self.stack.unwind()
        st, T, N = self.st, self.cfg.max_new_tokens, self.num_rows
        out_len = st.out_len[:N]
        valid = torch.arange(T, device=self.device)[None, :] < out_len[:, None]  # (N, T)
        tokens = torch.where(valid, st.out_tokens[:N, :T], self.cfg.pad_token_id)
        logprobs = torch.where(valid, st.out_logp[:N, :T], 0.0)
        fwd = int(st.n_row_forwards)
        tau = int(st.n_emitted) / fwd if fwd else 1.0
        rate = st.n_accepted.double().cpu() / st.n_proposed.double().cpu().clamp(min=1)
        counts = (st.n_accepted.cpu(), st.n_tried.cpu())
        if self.controller is not None and self.speculate:  # a plain baseline call tested no draft token
            self.controller.update(*counts)
        return GenerateOutput(tokens, out_len.clone(), logprobs, tau, rate, self.num_target_forwards,
                              self.group_size, tuple(self.k_choice.choices), counts, st.row_rounds[:N].clone(),
                              self.phases)


def generate(policy: Policy, prompts: Sequence, cfg: GenerateConfig, draft=None,
             group_size: int = 1, generator: torch.Generator | None = None,
             controller: SpecController | None = None) -> GenerateOutput:
    """Generate up to cfg.max_new_tokens tokens for each prompt, `group_size` samples per prompt.

    prompts: a sequence of token-id sequences (lists or 1-D tensors), any lengths >= 1.
    With `draft`, decoding is speculative (an EAGLE-3 or a block drafter — DFlash / DSpark, block_spec.py —
    k = cfg.num_draft_tokens) and lossless: greedy
    outputs equal plain greedy decoding; sampled outputs have the target's distribution.
    Output row b*G + g is sample g of prompt b; each prompt is prefilled once and its cache shared.
    """
    runner = DecodeRunner(policy, cfg, draft, generator, controller)
    runner.prefill(prompts, group_size)
    runner.run()
    return runner.result()
