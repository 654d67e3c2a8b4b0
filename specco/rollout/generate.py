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

Speed (DESIGN §6): every decode step is an in-place function over static buffers, captured as a
CUDA graph on GPU (graphs.py); the host syncs once per round to test whether all rows finished.
The prefill and the draft's prompt catch-up are eager (variable shapes, run once).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..model.draft import Eagle3Draft
from ..model.policy import Policy
from .graphs import StepGraphs
from .sampling import SamplingParams, pick_tokens
from .speculative import SpeculativeSteps, gather_rows, draft_prefill
from .state import DecodeState, commit


@dataclass(frozen=True)
class GenerateConfig:
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    num_draft_tokens: int = 4  # k, draft tokens proposed per round (speculative only)
    eos_token_id: int | None = None  # None: rows stop only at max_new_tokens
    pad_token_id: int = 0  # fills tokens past each row's length
    use_graphs: bool | None = None  # None: CUDA graphs on CUDA, eager on CPU

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")


@dataclass
class GenerateOutput:
    tokens: torch.Tensor  # (N, T) int64, N = num_prompts * group_size (row b*G + g), pad after length
    lengths: torch.Tensor  # (N,) int64 emitted tokens per row (EOS included)
    logprobs: torch.Tensor  # (N, T) fp32 target log-prob of each emitted token (0 after length)
    tau: float  # mean tokens emitted per target forward per live row, decode rounds (1.0 plain)
    accept_rate: torch.Tensor  # (k,) fp64: P(draft token j accepted) per live row-round; (0,) plain
    num_target_forwards: int  # batched target forwards, prefill included
    group_size: int = 1


def _pad_prompts(prompts: Sequence, device) -> tuple[torch.Tensor, torch.Tensor]:
    if len(prompts) == 0:
        raise ValueError("generate() needs at least one prompt")
    rows = [torch.as_tensor(p, dtype=torch.long).flatten() for p in prompts]
    if min(r.numel() for r in rows) < 1:
        raise ValueError("every prompt needs at least one token")
    lens = torch.tensor([r.numel() for r in rows], device=device)
    ids = torch.zeros(len(rows), int(lens.max()), dtype=torch.long)  # (B0, S) right-padded
    for b, r in enumerate(rows):
        ids[b, : r.numel()] = r
    return ids.to(device), lens


class DecodeRunner:
    """Holds the state of one batched generation. `generate` is prefill -> rounds -> result.

    Tests and the benchmark drive it step by step: `prefill`, `round`, `all_finished`, `result`;
    `graphs.run(name)` replays a single captured step ('decode'; 'propose', 'verify', 'catch_up').
    """

    def __init__(self, policy: Policy, cfg: GenerateConfig, draft: Eagle3Draft | None = None,
                 generator: torch.Generator | None = None):
        self.policy, self.cfg, self.draft = policy, cfg, draft
        self.device = next(policy.parameters()).device
        if generator is None:  # reproducible under torch.manual_seed, on the model's device
            seed = int(torch.randint(0, 2**62, (1,)).item())
            generator = torch.Generator(device=self.device).manual_seed(seed)
        self.generator = generator
        use = cfg.use_graphs
        self.use_graphs = (self.device.type == "cuda") if use is None else use
        if self.use_graphs and self.device.type != "cuda":
            raise ValueError("use_graphs=True needs the model on a CUDA device")
        self.k = cfg.num_draft_tokens if draft is not None else 0
        self.st: DecodeState | None = None
        self.num_target_forwards = 0

    # -- prefill ---------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, prompts: Sequence, group_size: int = 1):
        cfg, policy, draft, dev = self.cfg, self.policy, self.draft, self.device
        G, T, k = group_size, cfg.max_new_tokens, self.k
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.group_size = group_size
        ids, lens = _pad_prompts(prompts, dev)  # (B0, S), (B0,)
        B0, S = ids.shape
        N = B0 * G
        W = k + 1  # widest block one round can emit
        # Verify writes up to n + k with n <= L + T - 2 while a row is live; + slack.
        cache_len = S + T + W
        tap_layers = tuple(draft.cfg.aux_layer_ids) if draft is not None else None
        t_cache = policy.new_cache(B0, cache_len)
        out = policy(ids, None, t_cache, tap_layers=tap_layers, compute_logits=False)
        logits = policy.lm_head(gather_rows(out.hidden, lens - 1))  # (B0, V): only last positions
        logits = logits.repeat_interleave(G, dim=0)  # (N, V)
        if G > 1:
            t_cache = t_cache.repeat_rows(G)  # one prefill shared by the G samples of a prompt
        u0 = torch.rand(N, generator=self.generator, device=dev)
        first, logp_all = pick_tokens(logits, cfg.sampling, u0)
        if logp_all is None:
            logp_all = logits.float().log_softmax(-1)
        zeros = lambda *s, dt=torch.long: torch.zeros(s, dtype=dt, device=dev)  # noqa: E731
        st = DecodeState(
            n=lens.repeat_interleave(G), last_tok=first.clone(),
            out_tokens=zeros(N, T + W), out_logp=zeros(N, T + W, dt=torch.float32),
            out_len=torch.ones(N, dtype=torch.long, device=dev),
            finished=torch.full((N,), T <= 1, dtype=torch.bool, device=dev),
            n_emitted=zeros(), n_row_forwards=zeros(), n_accepted=zeros(k), t_cache=t_cache)
        st.out_tokens[:, 0] = first
        st.out_logp[:, 0] = logp_all.gather(-1, first[:, None]).squeeze(-1)
        if cfg.eos_token_id is not None:
            st.finished |= first == cfg.eos_token_id
        self.num_target_forwards = 1
        n_uniforms = 1
        if draft is not None:
            st.d_cache, st.d_logits0, st.d_hidden0 = draft_prefill(
                policy, draft, ids, lens, out.taps.aux, first, G, cache_len)
            st.draft_tok = zeros(N, k)
            st.taps = torch.zeros(N, W, out.taps.aux.shape[-1], dtype=out.taps.aux.dtype, device=dev)
            st.num_accepted, st.block = zeros(N), zeros(N, W)
            if not cfg.sampling.greedy:
                st.q_draft = torch.zeros(N, k, policy.cfg.vocab_size, device=dev)
            n_uniforms = SpeculativeSteps.num_uniforms(k)
        if not cfg.sampling.greedy:
            st.u = torch.zeros(N, n_uniforms, device=dev)
        self.st = st
        self._build_steps()

    def _build_steps(self):
        cfg, st = self.cfg, self.st
        if self.draft is None:
            self.order = ["decode"]
            fns = {"decode": self._decode_step}
        else:
            self.spec = SpeculativeSteps(self.policy, self.draft, st, cfg.sampling, self.k,
                                         cfg.max_new_tokens, cfg.eos_token_id)
            self.order = ["propose", "verify", "catch_up"]
            fns = {"propose": self.spec.propose, "verify": self.spec.verify,
                   "catch_up": self.spec.catch_up}
        self.graphs = StepGraphs(fns, self.use_graphs)
        if self.use_graphs:  # st.u is zeros here: valid uniforms, and the generator stays untouched
            self.graphs.capture(st.small_tensors(), self.order, lambda: st.finished.fill_(True))

    # -- decode ----------------------------------------------------------------------------
    def _decode_step(self):
        """Plain decode: one target forward at position n, sample, commit, advance live rows."""
        st, cfg = self.st, self.cfg
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
        if self.st.u is not None:  # one host-side RNG launch per round, outside the graphs
            torch.rand(self.st.u.shape, generator=self.generator, device=self.device, out=self.st.u)

    @torch.no_grad()
    def round(self):
        """One decode round: a plain step, or propose -> verify -> catch up."""
        self._fill_uniforms()
        for name in self.order:
            self.graphs.run(name)
        self.num_target_forwards += 1

    def all_finished(self) -> bool:
        return bool(self.st.finished.all())  # the one host sync per round

    @torch.no_grad()
    def run(self):
        # Each round emits >= 1 token per live row, so T - 1 rounds always suffice.
        for _ in range(self.cfg.max_new_tokens - 1):
            if self.all_finished():
                break
            self.round()

    def result(self) -> GenerateOutput:
        st, T = self.st, self.cfg.max_new_tokens
        valid = torch.arange(T, device=self.device)[None, :] < st.out_len[:, None]  # (N, T)
        tokens = torch.where(valid, st.out_tokens[:, :T], self.cfg.pad_token_id)
        logprobs = torch.where(valid, st.out_logp[:, :T], 0.0)
        fwd = int(st.n_row_forwards)
        tau = int(st.n_emitted) / fwd if fwd else 1.0
        rate = st.n_accepted.double().cpu() / max(fwd, 1)
        return GenerateOutput(tokens, st.out_len.clone(), logprobs, tau, rate,
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
