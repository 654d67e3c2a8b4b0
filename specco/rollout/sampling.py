"""Sampling: the one definition of the processed distribution, and sampling from it.

Speculative sampling is lossless only with respect to the distribution that is *actually* sampled
from. If the target's tokens were drawn from softmax(logits / T) restricted to its top-k/top-p set,
the acceptance test min(1, p(x)/q(x)) must use exactly that p, and the draft's q must live on the
same vocabulary with the same processing (otherwise p/q is the ratio of two different objects).
`processed_logprobs` is therefore the single function both sides go through:

    z      = logits / T                                  (T > 0)
    top-k: z_v = -inf  where z_v < (k-th largest z)      (ties with the k-th value are kept)
    top-p: sort z descending, keep the shortest prefix whose softmax mass reaches top_p
           (the first token is always kept)
    log p  = log_softmax(z)                              (fp32)

T == 0 means greedy: p is the one-hot at argmax(logits) (first index on ties, like torch.argmax).

Sampling is inverse-CDF with *externally drawn* uniforms u ~ U[0, 1): token = min{i : cdf_i > u·cdf_V}.
Taking uniforms as inputs keeps every sampling op a deterministic, static-shape tensor function, so a
step can be captured in a CUDA graph while the random numbers come from an explicit torch.Generator
outside the graph (one `torch.rand` per round). Tokens of probability 0 are never returned (see
`sample_from_probs`). The only inexactness is fp32 rounding of the cumsum (~1e-7 relative).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 -> greedy; top_k 0 -> off; top_p 1.0 -> off. coupled: draw every token by the
    Gumbel-max rule with noise keyed by (row, position) (`keyed_gumbel`) instead of inverse-CDF uniforms, and
    verify speculation by agreement with that draw (acceptance.verify_coupled): the emitted tokens are then
    plain decoding's, whatever the draft or k (no effect when greedy)."""
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    coupled: bool = False

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def keyed(self) -> bool:
        """Tokens come from `keyed_gumbel` noise (coupled sampling at T > 0)."""
        return self.coupled and not self.greedy


def processed_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """log p of the processed distribution (fp32, -inf outside its support). logits: (..., V).

    This is THE definition of both the target's p and the draft's q (the draft's logits are first
    scattered into the target vocabulary with -inf for ids it lacks, so they get q = 0).
    """
    z = logits.float()
    if params.greedy:
        idx = z.argmax(-1, keepdim=True)
        return torch.full_like(z, float("-inf")).scatter_(-1, idx, 0.0)
    z = z / params.temperature
    V = z.shape[-1]
    if 0 < params.top_k < V:
        kth = z.topk(params.top_k, dim=-1).values[..., -1:]  # (..., 1)
        z = z.masked_fill(z < kth, float("-inf"))
    if params.top_p < 1.0:
        z_sorted, order = z.sort(-1, descending=True)
        p_sorted = z_sorted.softmax(-1)
        mass_before = p_sorted.cumsum(-1) - p_sorted  # mass strictly ahead of each sorted token
        drop_sorted = mass_before >= params.top_p  # first token: mass_before = 0 < top_p, kept
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)  # back to vocab order
        z = z.masked_fill(drop, float("-inf"))
    return z.log_softmax(-1)


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """p = exp(processed_logprobs(logits)), (..., V) fp32."""
    return processed_logprobs(logits, params).exp()


def sample_from_probs(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sample. probs: (..., V) >= 0, not necessarily normalised; u: (...) in [0, 1).

    Returns (...) int64 ids. With cdf_i = sum_{j<=i} probs_j, picks the first i with cdf_i > u·cdf_V
    (searchsorted right=True), so i is chosen with probability probs_i / cdf_V and an id whose
    probability is 0 (flat cdf) can never be picked. If rounding puts u·cdf_V at or past the last
    increment, clamp to the last id with probs > 0 (the first index where cdf reaches its total).
    """
    cdf = probs.cumsum(-1)  # (..., V)
    total = cdf[..., -1:]  # (..., 1)
    idx = torch.searchsorted(cdf, u[..., None].to(cdf.dtype) * total, right=True)  # (..., 1)
    last_nonzero = (cdf < total).sum(-1, keepdim=True)  # (..., 1)
    return torch.minimum(idx, last_nonzero).squeeze(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Convenience: draw u from `generator` and sample. probs: (..., V) -> (...) int64."""
    u = torch.rand(probs.shape[:-1], generator=generator, device=probs.device)
    return sample_from_probs(probs, u)


# -- coupled sampling: Gumbel-max with noise keyed by (row, position) -------------------------------
#
# token_t = argmax_v (log p_t(v) + G(key_row, t, v)),  G = -log(-log U), U a hash of (key, t, v) in (0, 1).
# For i.i.d. Gumbel G this is an exact sample of p_t (the Gumbel-max trick), so plain decoding with it is
# plain sampling. Speculative decoding proposes x̂ = argmax(log q + G) with the same noise and accepts a draft
# token iff it equals the target's keyed draw at its position: every emitted token is the one plain decoding
# would have drawn there, so the output is plain decoding's (up to logit rounding between a verify forward and
# a one-token step), for any draft and any k. What it costs: a draft token is accepted with probability
# P(argmax(log q + G) = argmax(log p + G)), which is at least (1 - TV)/(1 + TV) (Gumbel coupling) and at most
# the 1 - TV of rejection sampling. What it buys: arms of one run with the same seed decode the same tokens,
# so their RL trajectories stay together and their times compare like for like.
_MASK31 = (1 << 31) - 1


def _mix31(x: torch.Tensor) -> torch.Tensor:
    """A bijective 31-bit integer mixer (xor-shift / multiply rounds on int64, products < 2^62)."""
    for mult in (0x5BD1E995, 0x27D4EB2F, 0x165667B1):
        x = x ^ (x >> 15)
        x = (x * mult) & _MASK31
    return x ^ (x >> 13)


def keyed_gumbel(key: torch.Tensor, pos: torch.Tensor, vocab: int, start: int = 0) -> torch.Tensor:
    """Gumbel noise (B, W, vocab) fp32 for rows with keys `key` (B,) int64 at absolute positions `pos` (B, W):
    a pure function of (key, position, id), so any step that draws the token at that position sees the same
    noise. Static shapes, no RNG state: capturable in a CUDA graph. `start`: the noise of ids start..start+vocab-1
    (a tensor-parallel engine's vocabulary block, rollout/tp.py)."""
    v = torch.arange(start, start + vocab, device=key.device)
    x = _mix31((_mix31(key & _MASK31)[:, None] + pos) & _MASK31)  # (B, W)
    x = _mix31((x[..., None] + v * 0x3C6EF373) & _MASK31)  # (B, W, V)
    u = ((x >> 7).float() + 0.5) * (1.0 / (1 << 24))  # 24 bits, in (0, 1)
    return -torch.log(-torch.log(u))


def coupled_tokens(logp: torch.Tensor, gumbel: torch.Tensor) -> torch.Tensor:
    """argmax(log p + G): the keyed Gumbel-max draw. logp (..., V) processed log-probs (-inf outside the
    support, never chosen), gumbel the same shape."""
    return (logp + gumbel).argmax(-1)


def keyed_draw(logits: torch.Tensor, params: SamplingParams, key: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """A draft's proposals under coupled sampling: logits (B, W, V) on the target vocabulary for the tokens at
    positions `pos` (B, W) of rows with keys `key` (B,) -> (B, W) ids, drawn with the noise the target's
    verify uses at the same positions."""
    return coupled_tokens(processed_logprobs(logits, params), keyed_gumbel(key, pos, logits.shape[-1]))


def pick_tokens(logits: torch.Tensor, params: SamplingParams, u: torch.Tensor | None):
    """One token per row from raw logits (..., V): argmax if greedy, else a sample of p with the uniforms `u`
    (...), or with coupled sampling the keyed draw with `u` = its Gumbel noise (..., V).

    Returns (tokens (...), log p (..., V) of the processed distribution, or None when greedy —
    greedy callers report log_softmax(logits) instead, see generate.py).
    """
    if params.greedy:
        return logits.argmax(-1), None
    logp = processed_logprobs(logits, params)
    if params.keyed:  # u is the keyed Gumbel noise (..., V) here
        return coupled_tokens(logp, u), logp
    return sample_from_probs(logp.exp(), u), logp


def pick_tokens_logp(logits: torch.Tensor, params: SamplingParams, u: torch.Tensor | None,
                     impl: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`pick_tokens` plus the picked tokens' log-probs: logits (N, V) -> (tokens (N,), log p (N,) fp32)
    with p the processed distribution (raw log_softmax when greedy, generate.py's convention).

    On CUDA, for plain temperature sampling or greedy (no top-k/top-p), one fused Triton pass per row
    (ops/sampling_kernel.py) instead of the vocabulary-sized fp32 chain below, which is its twin.
    impl: None (fused where it applies), "triton" or "torch".
    """
    fused = not params.keyed and (impl == "triton" or (impl is None and logits.is_cuda and params.top_k == 0
                                                        and params.top_p == 1.0))
    if fused:
        from ..ops.sampling_kernel import fused_sample, triton
        if triton is not None:
            return fused_sample(logits if logits.stride(-1) == 1 else logits.contiguous(), params.temperature, u)
    tok, logp_all = pick_tokens(logits, params, u)
    if logp_all is None:
        logp_all = logits.float().log_softmax(-1)
    return tok, logp_all.gather(-1, tok[:, None]).squeeze(-1)
