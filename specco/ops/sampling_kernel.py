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


# -- the verify's token choice (acceptance.verify_sampling_logits) ------------------------------------
# The twin chain over (B, k+1, V) — processed log-probs in fp32, their exp, the residual max(0, p_a - q_a),
# its cdf — wrote and re-read ~6 vocabulary-sized fp32 tensors per row: 0.73 ms at B = 32 against the
# plain step's 0.13 ms fused draw (H200, bench/decode_attention.py --tail). What the rule needs from
# the vocabulary is only lse_j = logsumexp(z_j) per verified position and one draw from the residual
# at the first rejected position, so two kernels: `row_logsumexp` over all B·(k+1) rows (logits read
# once), and `residual_sample` over one row per b (logits and q read twice).

if triton is not None:
    @triton.jit
    def _lse_kernel(LOGITS, LSE, V, s_row, inv_t, BLOCK: tl.constexpr):
        """lse = logsumexp(logits[row] · inv_t) by the online max / sum-exp rule."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        m = tl.full((), -float("inf"), tl.float32)
        s = tl.zeros((), tl.float32)
        for v0 in range(0, V, BLOCK):
            idx = v0 + offs
            z = tl.load(LOGITS + row * s_row + idx, mask=idx < V, other=-float("inf")).to(tl.float32) * inv_t
            m_new = tl.maximum(m, tl.max(z, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
            m = m_new
        tl.store(LSE + row, m + tl.log(s))

    @triton.jit
    def _residual_kernel(LOGITS, LSE, Q, ROW, QJ, HAS_Q, U, TOK, V, s_row, s_qb, s_qj, inv_t, BLOCK: tl.constexpr):
        """Program b: one inverse-CDF draw from w = max(0, p - q) (or p where HAS_Q is 0, or where w sums
        to 0), p = exp(logits[ROW[b]] · inv_t - LSE[ROW[b]]), q = Q[b, QJ[b]]."""
        b = tl.program_id(0).to(tl.int64)
        r, qj, has_q = tl.load(ROW + b).to(tl.int64), tl.load(QJ + b).to(tl.int64), tl.load(HAS_Q + b)
        q_base = Q + b * s_qb + qj * s_qj
        q_len = tl.where(has_q != 0, V, 0)  # the bonus position reads no q
        lse = tl.load(LSE + r)
        offs = tl.arange(0, BLOCK)
        tot_r = tl.zeros((), tl.float32)
        tot_p = tl.zeros((), tl.float32)
        for v0 in range(0, V, BLOCK):  # pass 1: the residual's mass (and p's, ~1, for the empty case)
            idx = v0 + offs
            ok = idx < V
            p = tl.exp(tl.load(LOGITS + r * s_row + idx, mask=ok, other=-float("inf")).to(tl.float32) * inv_t - lse)
            q = tl.load(q_base + idx, mask=idx < q_len, other=0.0)
            tot_r += tl.sum(tl.maximum(p - q, 0.0), axis=0)
            tot_p += tl.sum(p, axis=0)
        use_r = tot_r > 0
        thr = tl.load(U + b) * tl.where(use_r, tot_r, tot_p)
        cdf = tl.zeros((), tl.float32)
        tok = tl.full((), -1, tl.int64)
        last_nz = tl.zeros((), tl.int64)
        for v0 in range(0, V, BLOCK):  # pass 2: first index whose running cdf exceeds u · total
            idx = v0 + offs
            ok = idx < V
            p = tl.exp(tl.load(LOGITS + r * s_row + idx, mask=ok, other=-float("inf")).to(tl.float32) * inv_t - lse)
            q = tl.load(q_base + idx, mask=idx < q_len, other=0.0)
            w = tl.where(use_r, tl.maximum(p - q, 0.0), p)
            run = cdf + tl.cumsum(w, axis=0)
            hit = tl.min(tl.where(run > thr, idx, V), axis=0).to(tl.int64)
            tok = tl.where((tok < 0) & (hit < V), hit, tok)
            last_nz = tl.maximum(last_nz, tl.max(tl.where(w > 0, idx, 0), axis=0).to(tl.int64))
            cdf = cdf + tl.sum(w, axis=0)
        tl.store(TOK + b, tl.where(tok < 0, last_nz, tok))


def row_logsumexp(logits: torch.Tensor, inv_t: float) -> torch.Tensor:
    """logits (N, V) (unit last stride) -> logsumexp(logits · inv_t) (N,) fp32."""
    N, V = logits.shape
    lse = torch.empty(N, dtype=torch.float32, device=logits.device)
    _lse_kernel[(N,)](logits, lse, V, logits.stride(0), float(inv_t), BLOCK=BLOCK_V, num_warps=8)
    return lse


def residual_sample(logits: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, row: torch.Tensor,
                    q_j: torch.Tensor, has_q: torch.Tensor, u: torch.Tensor, inv_t: float) -> torch.Tensor:
    """One draw per b from normalize(max(0, p - q)) (p where has_q[b] is False or the residual is empty):
    p = exp(logits[row[b]] · inv_t - lse[row[b]]), q = q[b, q_j[b]]; logits (N, V), q (B, k, V) fp32 (a view
    is fine), both with unit last strides; row, q_j, has_q, u (B,). Returns (B,) int64 by the twin's
    inverse-CDF rule (rollout.sampling.sample_from_probs)."""
    B, V = row.shape[0], logits.shape[1]
    tok = torch.empty(B, dtype=torch.long, device=logits.device)
    _residual_kernel[(B,)](logits, lse, q, row, q_j, has_q.to(torch.int32), u.float().contiguous(), tok, V,
                           logits.stride(0), q.stride(0), q.stride(1), float(inv_t), BLOCK=BLOCK_V, num_warps=8)
    return tok
