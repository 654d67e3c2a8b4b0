"""Decode attention over a position-indexed KV cache, reading only each row's live prefix.

The rollout engine's decode, verify, propose and catch-up steps all ask the same question: T new
queries per row b at positions pos[b, t] attend every cached key j <= pos[b, t] (their own key was
written just before). Shapes must stay static for CUDA-graph capture, yet a step early in a 4K-token
completion should not pay for the whole S_max-long cache. So:

    q (B, T, H, D), k_cache / v_cache (B, Hkv, S_max, D), pos (B, T) int64
    out[b, t, h] = Σ_{j <= pos[b,t]} softmax_j(scale · q[b,t,h] · k[b,h//G,j]) v[b,h//G,j]     (G = H/Hkv)

Two implementations, one meaning (STYLE §8):
  * `decode_attention_reference` — the pure-torch twin: one SDPA call with a dense boolean mask over
    all S_max keys. It defines the semantics, runs on CPU and is what the Triton path is tested against.
  * the Triton split-K ("flash-decoding") kernels, on CUDA. The S_max keys are cut into NS static
    chunks; program (split, b·hkv) handles the G·T query rows that share kv head hkv of row b (GQA:
    the cache is read once per kv head, not once per query head) and loops only over the keys of its
    chunk that lie below max_t pos[b, t] + 1 — a chunk past the live prefix costs one early exit. Each
    program leaves a partial (out, lse); a second kernel merges the live splits with the usual
    logsumexp rule (the formula of `specco.ops.attention.merge_lse`, applied over NS parts).
    The grid is fixed by (B, Hkv, S_max), so one captured graph serves every position; the work is
    proportional to the live prefix.

The T > 1 case (verify of k+1 tokens, catch-up) is the same kernel: rows differ only in pos, so the
causal structure inside the new block is the mask j <= pos[b, t] — no dense bias is ever built.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import _pow2

try:  # Triton is optional: absent on CPU-only installs, where the twin runs.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

__all__ = ["decode_attention", "decode_attention_reference", "write_kv", "split_plan"]


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
             k_new: torch.Tensor, v_new: torch.Tensor) -> None:
    """Write new keys/values into one layer's cache at their positions, in place.

    k_cache, v_cache (B, Hkv, S_max, D) (views are fine); positions (B, T); k_new, v_new (B, T, Hkv, D)
    — the layout the projection produces, so no transpose. Advanced indexing on dims 0 and 2 with a
    slice on dim 1 is one `index_put_` per tensor: no expanded index tensor, static shapes.
    Positions within a row are distinct, so the writes never collide.
    """
    rows = torch.arange(positions.shape[0], device=positions.device)[:, None]  # (B, 1)
    k_cache[rows, :, positions] = k_new.to(k_cache.dtype)  # value (B, T, Hkv, D)
    v_cache[rows, :, positions] = v_new.to(v_cache.dtype)


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               positions: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """The twin: q (B, T, H, D) over the whole cache with the mask j <= positions[b, t]; -> (B, T, H, D).

    GQA by folding the G query heads of a kv head into the query dim, (B, T, H, D) -> (B, Hkv, G·T, D)
    with head h = hkv·G + g at row g·T + t, so it is a plain multi-head SDPA call over the cache read once.
    """
    B, T, H, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    G = H // Hkv
    q_grouped = q.permute(0, 2, 1, 3).reshape(B, Hkv, G * T, D)  # (B, Hkv, G*T, D)
    visible = torch.arange(S, device=q.device)[None, None, :] <= positions[:, :, None]  # (B, T, S)
    mask = visible.repeat(1, G, 1)[:, None]  # (B, 1, G*T, S): row g*T + t has query t's position
    o = F.scaled_dot_product_attention(q_grouped, k_cache.to(q.dtype), v_cache.to(q.dtype),
                                       attn_mask=mask, scale=scale)  # (B, Hkv, G*T, D)
    return o.reshape(B, H, T, D).transpose(1, 2)  # (B, T, H, D)



BLOCK_N = 64  # keys per inner step; a chunk is a whole number of these


def split_plan(batch: int, num_kv_heads: int, max_len: int, num_sms: int = 132) -> tuple[int, int]:
    """(chunk, num_splits) for a cache of `max_len` keys: enough programs to fill the GPU (~4 per SM)
    when the cache is full, never a chunk shorter than one key block. Static in (B, Hkv, S_max)."""
    blocks = -(-max_len // BLOCK_N)
    want = max(1, -(-4 * num_sms // (batch * num_kv_heads)))  # splits per (row, kv head)
    splits = min(blocks, want)
    chunk = BLOCK_N * -(-blocks // splits)
    return chunk, -(-max_len // chunk)


if triton is not None:
    @triton.jit
    def _split_kernel(Q, K, V, POS, OP, LP, T, HKV, S, chunk, scale,
                      sq_b, sq_t, sq_h, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sp_b,
                      sop_bh, sop_s, slp_bh, slp_s,
                      G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
        """Partial (out, lse) of the G·T query rows of (row b, kv head hkv) over one key chunk."""
        split, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)  # int64: b x batch stride can pass 2^31
        b, hkv = bh // HKV, bh % HKV
        offs_m = tl.arange(0, BLOCK_M)  # query row m = g*T + t
        g, t = offs_m // T, offs_m % T
        row_ok = offs_m < G * T
        pos = tl.load(POS + b * sp_b + t, mask=row_ok, other=-1)  # (BLOCK_M,)
        start = split * chunk
        end = tl.minimum(start + chunk, tl.max(pos, axis=0) + 1).to(tl.int32)  # keys past the live prefix: skipped
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        q = tl.load(Q + b * sq_b + t[:, None] * sq_t + (hkv * G + g)[:, None] * sq_h + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        # A finite "minus infinity" for the running max: a row with no visible key in this chunk keeps
        # m = -1e30, its exp(s - m) are exactly 0 and l stays 0 (-inf - -inf would be NaN).
        m_i = tl.full((BLOCK_M,), -1.0e30, tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < end
            k = tl.load(K + b * sk_b + hkv * sk_h + offs_n[:, None] * sk_s + offs_d[None, :],
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale
            visible = (offs_n[None, :] <= pos[:, None]) & n_ok[None, :]
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(V + b * sv_b + hkv * sv_h + offs_n[:, None] * sv_s + offs_d[None, :],
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        has = l_i > 0
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        tl.store(OP + bh * sop_bh + split * sop_s + offs_m[:, None] * BLOCK_D + offs_d[None, :], out)
        tl.store(LP + bh * slp_bh + split * slp_s + offs_m, lse)

    @triton.jit
    def _reduce_kernel(OP, LP, POS, O, T, HKV, chunk, NS, sop_bh, sop_s, slp_bh, slp_s, sp_b,
                       so_b, so_t, so_h, G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_S: tl.constexpr):
        """out = Σ_s exp(lse_s - lse) out_s with lse = logsumexp_s lse_s, over the live splits of one
        query row (program (b·hkv, m)); written in q's layout (B, T, H, D)."""
        bh, m = tl.program_id(0).to(tl.int64), tl.program_id(1)
        b, hkv = bh // HKV, bh % HKV
        g, t = m // T, m % T
        pos = tl.load(POS + b * sp_b + t)
        ns_live = tl.minimum(NS, pos // chunk + 1)  # splits past this row's position hold nothing
        offs_d = tl.arange(0, BLOCK_D)
        mx = tl.full((), -1.0e30, tl.float32)
        for s0 in range(0, ns_live, BLOCK_S):
            offs_s = s0 + tl.arange(0, BLOCK_S)
            lse = tl.load(LP + bh * slp_bh + offs_s * slp_s + m, mask=offs_s < ns_live, other=float("-inf"))
            mx = tl.maximum(mx, tl.max(lse, axis=0))
        total = tl.zeros((), tl.float32)
        acc = tl.zeros((BLOCK_D,), tl.float32)
        for s0 in range(0, ns_live, BLOCK_S):
            offs_s = s0 + tl.arange(0, BLOCK_S)
            s_ok = offs_s < ns_live
            lse = tl.load(LP + bh * slp_bh + offs_s * slp_s + m, mask=s_ok, other=float("-inf"))
            w = tl.exp(lse - mx)  # (BLOCK_S,), 0 for empty splits
            o = tl.load(OP + bh * sop_bh + offs_s[:, None] * sop_s + m * BLOCK_D + offs_d[None, :],
                        mask=s_ok[:, None], other=0.0)
            total += tl.sum(w, axis=0)
            acc += tl.sum(w[:, None] * o, axis=0)
        out = acc / total
        tl.store(O + b * so_b + t * so_t + (hkv * G + g) * so_h + offs_d, out.to(O.dtype.element_ty),
                 mask=offs_d < D)


def _use_triton(q: torch.Tensor, impl: str | None) -> bool:
    if impl is not None:
        if impl not in ("triton", "torch"):
            raise ValueError(f"unknown decode attention impl {impl!r}; expected 'triton' or 'torch'")
        return impl == "triton"
    return (triton is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and q.shape[-1] <= 256)


def _ieee(q: torch.Tensor) -> bool:
    """fp32 scores and p·v in full fp32 FMA (exact against the twin) unless torch's float32 matmul precision
    allows TF32, as the GPU runs set it ("high"): the cache is then read through tensor cores in TF32, as
    every other matmul of that forward is. On the H200 at KV position 1,536 the IEEE dot made an fp32 plain
    decode step 3.8-4.8x its read floor (bench/rollout.py, BENCHMARKS.md): with G·T = 4 query rows padded
    to 16 it is FMA-bound, not bandwidth-bound."""
    return q.dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest"


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # the interpreter: any plan is valid; use the H200's


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     positions: torch.Tensor, scale: float | None = None, *,
                     impl: str | None = None) -> torch.Tensor:
    """Attention of q (B, T, H, D) at `positions` (B, T) over the cache (B, Hkv, S_max, D) -> (B, T, H, D).

    Keys j <= positions[b, t] are visible (the new keys must already be written, `write_kv`). impl: None
    (the Triton split-K kernels on CUDA where they apply, else the twin), "triton" or "torch".
    Only static-shape work and no host syncs, so it can be captured in a CUDA graph.
    """
    D = q.shape[-1]
    scale = D ** -0.5 if scale is None else float(scale)
    if not _use_triton(q, impl):
        return decode_attention_reference(q, k_cache, v_cache, positions, scale)
    B, T, H, _ = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    G = H // Hkv
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("decode_attention reads the cache through its strides: it needs a unit last stride")
    q = q if q.stride(-1) == 1 else q.contiguous()
    positions = positions if positions.stride(-1) == 1 else positions.contiguous()
    BM, BD = max(16, _pow2(G * T)), max(16, _pow2(D))
    chunk, NS = split_plan(B, Hkv, S, _num_sms(q.device))
    part_out = torch.empty(B * Hkv, NS, BM, BD, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(B * Hkv, NS, BM, dtype=torch.float32, device=q.device)
    _split_kernel[(NS, B * Hkv)](
        q, k_cache, v_cache, positions, part_out, part_lse, T, Hkv, S, chunk, scale,
        *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3], positions.stride(0),
        part_out.stride(0), part_out.stride(1), part_lse.stride(0), part_lse.stride(1),
        G=G, D=D, BLOCK_D=BD, BLOCK_M=BM, BLOCK_N=BLOCK_N, IEEE=_ieee(q),
        num_warps=4 if BM <= 32 else 8)
    out = torch.empty(B, T, H, D, dtype=q.dtype, device=q.device)
    _reduce_kernel[(B * Hkv, G * T)](
        part_out, part_lse, positions, out, T, Hkv, chunk, NS, part_out.stride(0), part_out.stride(1),
        part_lse.stride(0), part_lse.stride(1), positions.stride(0), *out.stride()[:3],
        G=G, D=D, BLOCK_D=BD, BLOCK_S=min(64, _pow2(NS)), num_warps=2)
    return out
