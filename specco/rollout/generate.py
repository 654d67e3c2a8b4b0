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

Speed (DESIGN §6): every step — the prefill (target prefill, first token, draft prompt catch-up)
and each decode step — is an in-place function over static buffers, captured as a CUDA graph on
GPU (graphs.py); the host syncs once per round to test whether all rows finished.

Shape buckets. A `DecodeRunner` allocates its buffers and captures its graphs for one shape and
keeps them across calls: `RolloutEngine` holds runners keyed by shape, so an RL loop that calls
generate once per step captures once, not per call. To make shapes recur, with graphs the batch
is padded up to a bucket (prompts: next power of two up to 32, then multiples of 32; padding rows
are finished from the start and cut from the result) and the prompt length up to a multiple of 16
(the right-padding the prefill already handles); the cache length follows from those two.

Live-row compaction (compaction.py). `run()` moves the live rows into a smaller state once they are
<= cfg.compact_below of the batch (and again from there); each compacted size gets its own buffers
and graphs, built on first use and kept by the runner. `result()` writes the outputs back. Stepping a
runner by hand (`round()`) never compacts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..model.draft import Eagle3Draft
from ..model.policy import Policy
from . import compaction
from .graphs import StepGraphs
from .sampling import SamplingParams, pick_tokens
from .speculative import SpeculativeSteps, gather_rows, draft_prefill
from .state import DecodeState, commit, fill_groups, group_leaders


@dataclass(frozen=True)
class GenerateConfig:
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    num_draft_tokens: int = 4  # k, draft tokens proposed per round (speculative only)
    eos_token_id: int | None = None  # None: rows stop only at max_new_tokens
    pad_token_id: int = 0  # fills tokens past each row's length
    use_graphs: bool | None = None  # None: CUDA graphs on CUDA, eager on CPU
    bucket_shapes: bool | None = None  # pad batch / prompt length to buckets; None: iff graphs
    # Live-row compaction (compaction.py): when live rows <= this fraction of the batch, continue on a
    # smaller batch holding just them. 0 disables.
    compact_below: float = 0.25

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if not 0 <= self.compact_below < 1:
            raise ValueError(f"compact_below must be in [0, 1) (0 disables compaction), got {self.compact_below}")


@dataclass
class GenerateOutput:
    tokens: torch.Tensor  # (N, T) int64, N = num_prompts * group_size (row b*G + g), pad after length
    lengths: torch.Tensor  # (N,) int64 emitted tokens per row (EOS included)
    logprobs: torch.Tensor  # (N, T) fp32 target log-prob of each emitted token (0 after length)
    tau: float  # mean tokens emitted per target forward per live row, decode rounds (1.0 plain)
    accept_rate: torch.Tensor  # (k,) fp64: P(draft token j accepted) per live row-round; (0,) plain
    num_target_forwards: int  # batched target forwards, prefill included
    group_size: int = 1


def pad_prompts(prompts: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts -> right-padded ids (B0, S) and lengths (B0,), int64 on the host."""
    if len(prompts) == 0:
        raise ValueError("generate() needs at least one prompt")
    rows = [torch.as_tensor(p, dtype=torch.long).flatten() for p in prompts]
    if min(r.numel() for r in rows) < 1:
        raise ValueError("every prompt needs at least one token")
    lens = torch.tensor([r.numel() for r in rows])
    ids = torch.zeros(len(rows), int(lens.max()), dtype=torch.long)  # (B0, S) right-padded
    for b, r in enumerate(rows):
        ids[b, : r.numel()] = r
    return ids, lens


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclass
class _Level:
    """One decode state of a runner with its step functions: the root (all rows) or a compacted one."""
    st: DecodeState
    graphs: StepGraphs
    spec: SpeculativeSteps | None
    root_rows: torch.Tensor | None  # (N',) int64: which root row each row holds (None for the root)


@dataclass(frozen=True)
class RunnerShape:
    """The static shape a DecodeRunner's buffers and graphs are built for."""
    prompts: int  # B0 rows of the prefill (padded), each the leader of a group
    group_size: int  # G samples per prompt: B0*G decode rows
    prompt_len: int  # S, prefill length (padded)
    cache_len: int  # target and draft KV cache length

    @classmethod
    def bucket(cls, num_prompts: int, prompt_len: int, group_size: int, cfg: GenerateConfig,
               k: int, bucketed: bool) -> "RunnerShape":
        B0, S = num_prompts, prompt_len
        if bucketed:  # few distinct shapes, so graphs captured once serve many calls
            B0 = 1 << (B0 - 1).bit_length() if B0 <= 32 else _round_up(B0, 32)
            S = _round_up(S, 16)
        # Verify writes up to n + k with n <= L + T - 2 while a row is live; + slack.
        cache_len = S + cfg.max_new_tokens + k + 1
        if bucketed:  # 16-aligned rows for the attention kernels
            cache_len = _round_up(cache_len, 16)
        return cls(B0, group_size, S, cache_len)


@dataclass
class PromptBuffers:
    """Static inputs of the prefill step, refilled on the host side each call."""
    ids: torch.Tensor  # (B0, S) int64 right-padded prompt ids
    lens: torch.Tensor  # (B0,) int64 prompt lengths (1 for padding prompts)
    real: torch.Tensor  # (B0,) bool, False for padding prompts
    u0: torch.Tensor | None  # (B0*G,) uniforms for the first token (None when greedy)


def execution_modes(cfg: GenerateConfig, device: torch.device) -> tuple[bool, bool]:
    """(use CUDA graphs, pad shapes to buckets) for `cfg` on `device`."""
    use_graphs = (device.type == "cuda") if cfg.use_graphs is None else cfg.use_graphs
    if use_graphs and device.type != "cuda":
        raise ValueError("use_graphs=True needs the model on a CUDA device")
    return use_graphs, use_graphs if cfg.bucket_shapes is None else cfg.bucket_shapes


def runner_shape(cfg: GenerateConfig, device: torch.device, with_draft: bool, num_prompts: int,
                 prompt_len: int, group_size: int) -> RunnerShape:
    """The shape (bucket) a DecodeRunner uses for this call: what RolloutEngine keys its runners by."""
    _, bucketed = execution_modes(cfg, device)
    k = cfg.num_draft_tokens if with_draft else 0
    return RunnerShape.bucket(num_prompts, prompt_len, group_size, cfg, k, bucketed)


def seeded_generator(device) -> torch.Generator:
    """A fresh generator on `device` seeded from the global torch RNG (reproducible under
    torch.manual_seed): what a generate call without an explicit generator samples with."""
    seed = int(torch.randint(0, 2**62, (1,)).item())
    return torch.Generator(device=device).manual_seed(seed)


class DecodeRunner:
    """Static buffers and (on GPU) captured step graphs for generation at one shape; one batched
    generation at a time. `generate` is prefill -> rounds -> result.

    A runner can be reused: `prefill` with prompts of the same shape bucket refills the buffers and
    replays the graphs captured the first time (a new bucket reallocates and recaptures). The
    graphs read the models' parameters in place, so in-place weight updates (RolloutEngine.refit)
    are seen by the next replay; replacing parameter tensors is not (the engine checks for that).

    Tests and the benchmark drive it step by step: `prefill`, `round`, `result`;
    `graphs.run(name)` replays a single captured step ('prefill'; 'decode' or 'propose', 'verify',
    'catch_up').
    """

    def __init__(self, policy: Policy, cfg: GenerateConfig, draft: Eagle3Draft | None = None,
                 generator: torch.Generator | None = None):
        self.policy, self.cfg, self.draft = policy, cfg, draft
        self.device = next(policy.parameters()).device
        self.generator = generator
        self.use_graphs, _ = execution_modes(cfg, self.device)  # (bucketing: runner_shape)
        self.k = cfg.num_draft_tokens if draft is not None else 0
        self.shape: RunnerShape | None = None
        self.st: DecodeState | None = None
        self.io: PromptBuffers | None = None
        self.num_target_forwards = 0

    def shape_for(self, num_prompts: int, prompt_len: int, group_size: int) -> RunnerShape:
        return runner_shape(self.cfg, self.device, self.draft is not None, num_prompts, prompt_len, group_size)

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
                       generator: torch.Generator | None = None):
        """`prefill` from host-side right-padded ids (B0, S) and lengths (B0,)."""
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        if generator is not None:
            self.generator = generator
        elif self.generator is None:
            self.generator = seeded_generator(self.device)
        B0, S = ids.shape
        shape = self.shape_for(B0, S, group_size)
        if shape != self.shape:
            self._allocate(shape)
        self._uncompact()  # a generation left unfinished by step-by-step driving
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
        self.graphs.run("prefill")
        self.num_target_forwards = 1

    def _allocate(self, shape: RunnerShape):
        """Static buffers for `shape`, then the step functions (and their graphs)."""
        dev = self.device
        self.shape, self.st, self.io, self.graphs, self.spec = shape, None, None, None, None
        self._levels: dict[int, _Level] = {}  # compacted states by row count, kept across calls
        self._chain: list[tuple[_Level, torch.Tensor]] = []  # active compactions: (level, parent rows)
        N = shape.prompts * shape.group_size
        sampled = not self.cfg.sampling.greedy
        self.io = PromptBuffers(ids=torch.zeros(shape.prompts, shape.prompt_len, dtype=torch.long, device=dev),
                                lens=torch.ones(shape.prompts, dtype=torch.long, device=dev),
                                real=torch.zeros(shape.prompts, dtype=torch.bool, device=dev),
                                u0=torch.zeros(N, dtype=torch.float32, device=dev) if sampled else None)
        self.st = self._new_state(N)
        self.graphs, self.spec, self.order = self._build_steps(self.st, with_prefill=True)
        self._root = _Level(self.st, self.graphs, self.spec, None)

    def _new_state(self, N: int) -> DecodeState:
        """Zeroed decode buffers for N rows at this runner's shape (cache length, k, sampling)."""
        cfg, policy, draft, dev, k = self.cfg, self.policy, self.draft, self.device, self.k
        T, W, cache_len = cfg.max_new_tokens, k + 1, self.shape.cache_len
        sampled = not cfg.sampling.greedy
        zeros = lambda *s, dt=torch.long: torch.zeros(s, dtype=dt, device=dev)  # noqa: E731
        st = DecodeState(
            n=zeros(N), last_tok=zeros(N),
            out_tokens=zeros(N, T + W), out_logp=zeros(N, T + W, dt=torch.float32),
            out_len=zeros(N), finished=torch.ones(N, dtype=torch.bool, device=dev),
            n_emitted=zeros(), n_row_forwards=zeros(), n_accepted=zeros(k),
            t_cache=policy.new_cache(N, cache_len))
        n_uniforms = 1
        if draft is not None:
            d_dtype = draft.fc.weight.dtype
            n_aux = len(draft.cfg.aux_layer_ids)
            st.d_cache = draft.new_cache(N, cache_len)
            st.d_logits0 = zeros(N, draft.cfg.draft_vocab_size, dt=d_dtype)
            st.d_hidden0 = zeros(N, draft.cfg.hidden_size, dt=d_dtype)
            st.draft_tok = zeros(N, k)
            st.taps = zeros(N, W, n_aux * policy.cfg.hidden_size, dt=st.t_cache.k.dtype)
            st.num_accepted, st.block = zeros(N), zeros(N, W)
            if sampled:
                st.q_draft = zeros(N, k, policy.cfg.vocab_size, dt=torch.float32)
            n_uniforms = SpeculativeSteps.num_uniforms(k)
        if sampled:
            st.u = zeros(N, n_uniforms, dt=torch.float32)
        return st

    def _prefill_step(self):
        """Target prefill over the prompts (once per prompt: the G samples of a group share its
        cache rows), first token per sample, state reset, draft prompt catch-up. In place."""
        cfg, policy, draft, st, io = self.cfg, self.policy, self.draft, self.st, self.io
        G, S = self.shape.group_size, self.shape.prompt_len
        tap_layers = tuple(draft.cfg.aux_layer_ids) if draft is not None else None
        out = policy(io.ids, None, group_leaders(st.t_cache, G), tap_layers=tap_layers,
                     compute_logits=False)
        fill_groups(st.t_cache, G, S)
        logits = policy.lm_head(gather_rows(out.hidden, io.lens - 1))  # (B0, V): last positions
        logits = logits.repeat_interleave(G, dim=0)  # (N, V)
        first, logp_all = pick_tokens(logits, cfg.sampling, io.u0)
        if logp_all is None:
            logp_all = logits.float().log_softmax(-1)
        st.n.copy_(io.lens.repeat_interleave(G))
        st.last_tok.copy_(first)
        st.out_tokens.zero_()
        st.out_tokens[:, 0] = first
        st.out_logp.zero_()
        st.out_logp[:, 0] = logp_all.gather(-1, first[:, None]).squeeze(-1)
        st.out_len.fill_(1)
        finished = ~io.real.repeat_interleave(G)  # padding rows never run
        if cfg.max_new_tokens <= 1:
            finished.fill_(True)
        if cfg.eos_token_id is not None:
            finished |= first == cfg.eos_token_id
        st.finished.copy_(finished)
        for t in (st.n_emitted, st.n_row_forwards, st.n_accepted):
            t.zero_()
        if draft is not None:
            d_logits0, d_hidden0 = draft_prefill(policy, draft, io.ids, io.lens, out.taps.aux,
                                                 first, G, st.d_cache)
            st.d_logits0.copy_(d_logits0)
            st.d_hidden0.copy_(d_hidden0)

    def _build_steps(self, st: DecodeState, with_prefill: bool):
        """The round's step functions over `st` (+ the prefill for the root state), captured as
        graphs on GPU. Returns (graphs, speculative steps or None, the round's step order)."""
        cfg, spec = self.cfg, None
        if self.draft is None:
            rounds = ["decode"]
            fns = {"decode": lambda: self._decode_step(st)}
        else:
            spec = SpeculativeSteps(self.policy, self.draft, st, cfg.sampling, self.k,
                                    cfg.max_new_tokens, cfg.eos_token_id)
            rounds = ["propose", "verify", "catch_up"]
            fns = {"propose": spec.propose, "verify": spec.verify, "catch_up": spec.catch_up}
        if with_prefill:
            fns["prefill"] = self._prefill_step
        graphs = StepGraphs(fns, self.use_graphs)
        if self.use_graphs:
            # Captured before any prompt is loaded: the buffers hold zeros (valid ids, lengths 1,
            # uniforms 0) and every prompt is marked padding (a compacted state: every row finished),
            # so the warm-up's prefill leaves all rows finished and its decode steps advance nothing.
            def freeze():
                if with_prefill:
                    self.io.real.fill_(False)
                st.finished.fill_(True)
            graphs.capture(st.small_tensors(), (["prefill"] if with_prefill else []) + rounds, freeze)
        return graphs, spec, rounds

    # -- decode ----------------------------------------------------------------------------
    def _decode_step(self, st: DecodeState):
        """Plain decode: one target forward at position n, sample, commit, advance live rows."""
        cfg = self.cfg
        logits = self.policy(st.last_tok[:, None], st.n[:, None], st.t_cache).logits[:, 0]  # (N, V)
        u = st.u[:, 0] if st.u is not None else None
        tok, logp_all = pick_tokens(logits, cfg.sampling, u)
        if logp_all is None:
            logp_all = logits.float().log_softmax(-1)
        logp = logp_all.gather(-1, tok[:, None])  # (N, 1)
        commit(st, tok[:, None], torch.ones_like(tok), logp, cfg.max_new_tokens, cfg.eos_token_id)
        live = ~st.finished
        st.n.add_(live.long())
        st.last_tok.copy_(torch.where(live, tok, st.last_tok))

    def _fill_uniforms(self):
        # One host-side RNG launch per round, outside the graphs. Only the real rows draw (the
        # same stream as an unpadded batch); padding rows keep the valid uniform 0. After a
        # compaction the draw is still for every original row, then gathered: the same stream.
        root = self._root.st
        if root.u is not None:
            u = root.u[: self.num_rows]
            torch.rand(u.shape, generator=self.generator, device=self.device, out=u)
            if self._chain:
                level = self._chain[-1][0]
                torch.index_select(root.u, 0, level.root_rows, out=level.st.u)

    @torch.no_grad()
    def round(self):
        """One decode round: a plain step, or propose -> verify -> catch up."""
        self._fill_uniforms()
        for name in self.order:
            self.graphs.run(name)
        self.num_target_forwards += 1

    @torch.no_grad()
    def run(self):
        # Each round emits >= 1 token per live row, so T - 1 rounds always suffice.
        for _ in range(self.cfg.max_new_tokens - 1):
            live = int((~self.st.finished).sum())  # the one host sync per round
            if live == 0:
                break
            size = compaction.compact_size(live, self.st.finished.numel(), self.cfg.compact_below)
            if size is not None:
                self._compact(size)
            self.round()

    def _compact(self, size: int):
        """Move the live rows into a `size`-row state (compaction.py) and make it the current one."""
        level = self._levels.get(size)
        if level is None:  # built (and captured) once per size, reused by later calls
            st = self._new_state(size)
            graphs, spec, _ = self._build_steps(st, with_prefill=False)
            level = self._levels[size] = _Level(st, graphs, spec, torch.empty(size, dtype=torch.long,
                                                                                device=self.device))
        rows = compaction.pick_rows(self.st.finished, size)
        compaction.gather_state(self.st, level.st, rows)
        parent_root_rows = self._chain[-1][0].root_rows if self._chain else None
        level.root_rows.copy_(rows if parent_root_rows is None else parent_root_rows[rows])
        self._chain.append((level, rows))
        self.st, self.graphs, self.spec = level.st, level.graphs, level.spec

    def _uncompact(self):
        """Write every compacted state's outputs back, innermost first; the root is current again."""
        while self._chain:
            level, rows = self._chain.pop()
            parent = self._chain[-1][0].st if self._chain else self._root.st
            compaction.scatter_outputs(level.st, parent, rows)
        self.st, self.graphs, self.spec = self._root.st, self._root.graphs, self._root.spec

    def result(self) -> GenerateOutput:
        self._uncompact()
        st, T, N = self.st, self.cfg.max_new_tokens, self.num_rows
        out_len = st.out_len[:N]
        valid = torch.arange(T, device=self.device)[None, :] < out_len[:, None]  # (N, T)
        tokens = torch.where(valid, st.out_tokens[:N, :T], self.cfg.pad_token_id)
        logprobs = torch.where(valid, st.out_logp[:N, :T], 0.0)
        fwd = int(st.n_row_forwards)
        tau = int(st.n_emitted) / fwd if fwd else 1.0
        rate = st.n_accepted.double().cpu() / max(fwd, 1)
        return GenerateOutput(tokens, out_len.clone(), logprobs, tau, rate,
                              self.num_target_forwards, self.group_size)


def generate(policy: Policy, prompts: Sequence, cfg: GenerateConfig, draft: Eagle3Draft | None = None,
             group_size: int = 1, generator: torch.Generator | None = None) -> GenerateOutput:
    """Generate up to cfg.max_new_tokens tokens for each prompt, `group_size` samples per prompt.

    prompts: a sequence of token-id sequences (lists or 1-D tensors), any lengths >= 1.
    With `draft`, decoding is speculative (EAGLE-3, k = cfg.num_draft_tokens) and lossless: greedy
    outputs equal plain greedy decoding; sampled outputs have the target's distribution.
    Output row b*G + g is sample g of prompt b; each prompt is prefilled once and its cache shared.
    """
    runner = DecodeRunner(policy, cfg, draft, generator)
    runner.prefill(prompts, group_size)
    runner.run()
    return runner.result()
