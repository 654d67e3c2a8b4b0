"""THE acceptance rule of speculative decoding (docs/DESIGN.md §6). One home; everything else calls these.

Setting. The committed sequence ends in x_n. The draft proposed x̂_1..x̂_k, x̂_j drawn from q_j
(the draft's processed distribution at depth j, on the target vocabulary). One target forward over
[x_n, x̂_1..x̂_k] gives p_0..p_k, where p_j = p(· | x_≤n, x̂_1..x̂_j) is the target's processed
distribution for the token *after* x̂_j (p_0 follows x_n). Both p and q come from
`sampling.processed_logprobs`.

Greedy (T = 0): a = the longest prefix with x̂_j == argmax p_{j-1}; emit x̂_1..x̂_a and then
argmax p_a (the correction if a < k, the bonus if a = k). The emitted tokens are exactly argmax
p_0..p_a, i.e. what plain greedy decoding would have produced.

Sampling (T > 0), Leviathan et al. 2023 / Chen et al. 2023:
    accept x̂_j  with probability  min(1, p_{j-1}(x̂_j) / q_j(x̂_j)), in order, stopping at the
                 first rejection; a = number accepted (0..k);
    if a < k:    emit a token from  r = normalize(max(0, p_a - q_{a+1}))        (residual)
    if a = k:    emit a bonus token from  p_k.
Why it is exact: for one position, P(emit y) = q(y)·min(1, p(y)/q(y)) + β·r(y) with
β = 1 - Σ_x min(q(x), p(x)) = Σ_x max(0, p(x) - q(x)), so P(emit y) = min(q, p)(y) + max(0, p - q)(y)
= p(y); by induction over positions the emitted sequence has the target's joint distribution.
The uniform test `u·q < p` (u ~ U[0,1)) is `u < min(1, p/q)` without a division: q(x̂) > 0 because x̂
was sampled from q. If a rejection happens although r ≡ 0 (only possible when p ≈ q up to rounding),
we sample from p, which is then what r would be in exact arithmetic.

Coupled (T > 0, SamplingParams.coupled; sampling.py): the draft proposed x̂_j = argmax(log q_j + G_{n+j}) and the
target's token at position n+j is t_j = argmax(log p_{j-1} + G_{n+j}), with the same noise G keyed by (row,
position). a = the longest prefix with x̂_j == t_j; emit t_1..t_{a+1}: the greedy rule on the perturbed
log-probs, so the emitted tokens are exactly plain coupled decoding's, and that is an exact sample of p
(Gumbel-max).

Everything is vectorised over the batch: rows accept different lengths a_b; shapes stay static
(B, k+1) so the rule can live inside a captured CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import sample_from_probs


@dataclass
class Verdict:
    """num_accepted: (B,) int64 in 0..k. tokens: (B, k+1); row b emits tokens[b, :a_b + 1]
    (a_b accepted draft tokens, then the correction/bonus). Entries past a_b are unspecified."""
    num_accepted: torch.Tensor
    tokens: torch.Tensor


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """(B, k) bool -> (B,) length of the all-True prefix of each row."""
    return mask.long().cumprod(-1).sum(-1)


def verify_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> Verdict:
    """target_logits: (B, k+1, V) for the positions of [x_n, x̂_1..x̂_k]; draft_tokens: (B, k)."""
    return verify_tokens(target_logits.argmax(-1), draft_tokens)


def verify_tokens(target_tokens: torch.Tensor, draft_tokens: torch.Tensor) -> Verdict:
    """The target's own choices (B, k+1) at [x_n, x̂_1..x̂_k] (argmax, or the keyed draw) against the draft's (B, k):
    draft tokens are accepted while they equal the target's, so the emitted block is the target's row."""
    a = _leading_true(draft_tokens == target_tokens[:, :-1])  # (B,)
    return Verdict(a, target_tokens)


def _accept(p_x: torch.Tensor, q_x: torch.Tensor, u_accept: torch.Tensor) -> torch.Tensor:
    """(B, k) p_{j-1}(x̂_j), q_j(x̂_j), uniforms -> a (B,): x̂_j accepted iff u·q < p, in order."""
    return _leading_true(u_accept * q_x < p_x)  # u·q < p  <=>  u < min(1, p/q)


def _emit(draft_tokens: torch.Tensor, a: torch.Tensor, next_token: torch.Tensor) -> torch.Tensor:
    """Emitted block (B, k+1): accepted draft tokens, then next_token at column a."""
    tokens = torch.cat([draft_tokens, draft_tokens[:, :1]], dim=1)  # (B, k+1), last col a filler
    return tokens.scatter(1, a[:, None], next_token[:, None])


def verify_sampling(p_target: torch.Tensor, q_draft: torch.Tensor, draft_tokens: torch.Tensor,
                    u_accept: torch.Tensor, u_residual: torch.Tensor) -> Verdict:
    """p_target: (B, k+1, V) processed target probs; q_draft: (B, k, V) processed draft probs
    (q_draft[:, j-1] is the distribution x̂_j was drawn from); draft_tokens: (B, k);
    u_accept: (B, k), u_residual: (B,) uniforms in [0, 1)."""
    B, k1, V = p_target.shape
    k = k1 - 1
    idx = draft_tokens[..., None]  # (B, k, 1)
    p_x = p_target[:, :k].gather(-1, idx).squeeze(-1)  # (B, k): p_{j-1}(x̂_j)
    q_x = q_draft.gather(-1, idx).squeeze(-1)  # (B, k): q_j(x̂_j)
    a = _accept(p_x, q_x, u_accept)  # (B,)

    # Distribution of the token after the accepted prefix: residual at a < k, p_k at a = k.
    row = a[:, None, None].expand(B, 1, V)  # (B, 1, V)
    p_a = p_target.gather(1, row).squeeze(1)  # (B, V)
    q_a = q_draft.gather(1, row.clamp(max=k - 1)).squeeze(1)  # (B, V); row a = k is masked next
    q_a = q_a * (a < k)[:, None]  # bonus position: no draft distribution to subtract
    residual = (p_a - q_a).clamp_min(0.0)
    empty = residual.sum(-1, keepdim=True) <= 0  # (B, 1): p == q up to rounding, see docstring
    residual = torch.where(empty, p_a, residual)
    next_token = sample_from_probs(residual, u_residual)  # (B,)
    return Verdict(a, _emit(draft_tokens, a, next_token))


def verify_sampling_logits(logits: torch.Tensor, temperature: float, q_draft: torch.Tensor,
                           draft_tokens: torch.Tensor, u_accept: torch.Tensor, u_residual: torch.Tensor,
                           impl: str | None = None) -> tuple[Verdict, torch.Tensor]:
    """`verify_sampling` from raw target logits (B, k+1, V) for plain temperature sampling (no top-k/top-p),
    plus the emitted tokens' log-probs (B, k+1) fp32 under p: the same rule, with p never materialised.

    p_j(x) = exp(z_j(x) - lse_j), z = logits / T, lse_j = logsumexp(z_j) (= processed_probs without top-k/p).
    On CUDA (impl None or "triton") the vocabulary-sized work is two kernels (ops/sampling_kernel.py): the
    B·(k+1) lse_j, and one residual draw per row; the rest is (B, k)-sized. impl "torch": the twin chain.
    Differs from the twin by fp32 accumulation order (~1e-7 relative in p): a uniform that close to an
    acceptance or cdf boundary may fall the other way, as with the plain step's fused draw.
    """
    from ..ops.sampling_kernel import residual_sample, row_logsumexp, triton
    from .sampling import SamplingParams, processed_logprobs
    fused = triton is not None and (impl == "triton" or (impl is None and logits.is_cuda))
    B, k1, V = logits.shape
    k = k1 - 1
    if not fused:
        logp_all = processed_logprobs(logits, SamplingParams(temperature=temperature))  # (B, k+1, V)
        verdict = verify_sampling(logp_all.exp(), q_draft, draft_tokens, u_accept, u_residual)
        return verdict, logp_all.gather(-1, verdict.tokens[..., None]).squeeze(-1)
    inv_t = 1.0 / temperature
    flat = logits.reshape(B * k1, V)
    flat = flat if flat.stride(-1) == 1 else flat.contiguous()
    lse = row_logsumexp(flat, inv_t).view(B, k1)  # (B, k+1)
    z_x = logits[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1).float() * inv_t  # (B, k)
    p_x = (z_x - lse[:, :k]).exp()  # p_{j-1}(x̂_j)
    q_x = q_draft.gather(-1, draft_tokens[..., None]).squeeze(-1)  # q_j(x̂_j)
    a = _accept(p_x, q_x, u_accept)
    row = torch.arange(B, device=a.device) * k1 + a  # the flat logits row of position a
    q = q_draft if q_draft.stride(-1) == 1 else q_draft.contiguous()
    next_token = residual_sample(flat, lse.reshape(-1), q, row, a.clamp(max=k - 1), a < k, u_residual, inv_t)
    tokens = _emit(draft_tokens, a, next_token)
    logp = logits.gather(-1, tokens[..., None]).squeeze(-1).float() * inv_t - lse  # (B, k+1)
    return Verdict(a, tokens), logp


def verify_coupled(logp_target: torch.Tensor, gumbel: torch.Tensor, draft_tokens: torch.Tensor) -> Verdict:
    """logp_target: (B, k+1, V) processed target log-probs for [x_n, x̂_1..x̂_k]; gumbel: (B, k+1, V) the keyed
    noise of positions n+1..n+k+1; draft_tokens: (B, k) drawn with the same noise."""
    return verify_greedy(logp_target + gumbel, draft_tokens)
