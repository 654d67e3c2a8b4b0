"""One fused pass per row for the plain decode step's token choice: `rollout.sampling.pick_tokens`
followed by the log-prob gather, for temperature sampling without top-k/top-p (and for greedy).

Why. The twin materialises several vocabulary-sized fp32 tensors per row (upcast, /T, log_softmax,
exp, cumsum, then searchsorted and gather): at 152K vocabulary and 128 rows that is ~0.8 GB of
traffic, about a third of a 0.5B model's decode step. Here one program per row reads the logits
twice (an online max/sum-exp pass, then a running-cdf pass) and writes two numbers.

Meaning (the twin's, sampling.py):
    z = logits / T,  lse = logsumexp(z),  p_i = exp(z_i - lse)
    token = min{i : Σ_{j<=i} p_j > u · Σ_j p_j}  (clamped to the last i with p_i > 0)
    logp  = z_token - lse
    greedy: token = argmax(logits) (first index on ties), logp = logits_token - logsumexp(logits)
The cdf is accumulated block by block in fp32, so it differs from torch.cumsum's rounding by ~1e-7
relative: a token sits at another side of u with probability of that order (the twin's own
documented inexactness).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

BLOCK_V = 2048


if triton is not None:
    @triton.jit
    def _sample_kernel(LOGITS, U, TOK, LOGP, V, s_row, inv_t, GREEDY: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = LOGITS + row * s_row
        offs = tl.arange(0, BLOCK)
        # pass 1: running max and Σ exp(z - max) (online), plus the first argmax for greedy
        m = tl.full((), -float("inf"), tl.float32)
        s = tl.zeros((), tl.float32)
        best = tl.zeros((), tl.int64)
        for v0 in range(0, V, BLOCK):
            idx = v0 + offs
            z = tl.load(base + idx, mask=idx < V, other=-float("inf")).to(tl.float32) * inv_t
            bm = tl.max(z, axis=0)
            if GREEDY:  # first index of the block max; strictly larger than the running max wins
                arg = tl.min(tl.where(z == bm, idx, V), axis=0).to(tl.int64)
                best = tl.where(bm > m, arg, best)
            m_new = tl.maximum(m, bm)
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
            m = m_new
        lse = m + tl.log(s)
        if GREEDY:
            tok = best
        else:
            # pass 2: the first index whose running cdf exceeds u · total, total = Σ exp(z - lse) = 1
            # (the twin's cdf[-1], equal to 1 up to the fp32 rounding the docstring allows)
            thr = tl.load(U + row)
            cdf = tl.zeros((), tl.float32)
            tok = tl.full((), -1, tl.int64)
            last_nz = tl.zeros((), tl.int64)
            for v0 in range(0, V, BLOCK):
                idx = v0 + offs
                z = tl.load(base + idx, mask=idx < V, other=-float("inf")).to(tl.float32) * inv_t
                p = tl.exp(z - lse)
                run = cdf + tl.cumsum(p, axis=0)
                hit = tl.min(tl.where(run > thr, idx, V), axis=0).to(tl.int64)
                tok = tl.where((tok < 0) & (hit < V), hit, tok)
                last_nz = tl.maximum(last_nz, tl.max(tl.where(p > 0, idx, 0), axis=0).to(tl.int64))
                cdf = cdf + tl.sum(p, axis=0)
            tok = tl.where(tok < 0, last_nz, tok)
        z_tok = tl.load(base + tok).to(tl.float32) * inv_t
        tl.store(TOK + row, tok)
        tl.store(LOGP + row, z_tok - lse)


def fused_sample(logits: torch.Tensor, temperature: float, u: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (N, V) (unit last stride), u (N,) uniforms (None when greedy, temperature 0) ->
    (tokens (N,) int64, log p(token) (N,) fp32) with the meaning in the module docstring."""
    N, V = logits.shape
    greedy = temperature == 0
    tok = torch.empty(N, dtype=torch.long, device=logits.device)
    logp = torch.empty(N, dtype=torch.float32, device=logits.device)
    _sample_kernel[(N,)](logits, u if u is not None else logp, tok, logp, V, logits.stride(0),
                         1.0 if greedy else 1.0 / temperature, GREEDY=greedy, BLOCK=BLOCK_V, num_warps=8)
    return tok, logp
