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

The T > 1 case (verify of k+1 tokens, catch-up, block proposals) is the same kernel: rows differ only
in pos, so the causal structure inside the new block is the mask j <= pos[b, t] — no dense bias is ever
built. All G·T query rows of a kv head share one pass over its keys, so a verify reads the cache once,
as a plain step does; its extra cost is arithmetic on a 4x taller score tile (35 or 56 rows padded to 64
against 7 padded to 16). That is kept under the load time by (i) masking only the chunk's causal edge —
keys below min_t pos[b, t] are visible to every row and run unmasked — (ii) the softmax in base 2 with
the scale folded into one FMA, and (iii) the launch shape of `kernel_config`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention import _pow2

try:  # Triton is optional: absent on CPU-only installs, where the twin runs.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

__all__ = ["decode_attention", "decode_attention_reference", "write_kv", "split_plan", "KernelConfig",
           "kernel_config"]


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



@dataclass(frozen=True)
class KernelConfig:
    """Launch shape of the split kernel: keys per inner step, warps, pipeline depth, and how many programs
    per SM the split plan aims for (more splits hide more latency but write more partials to merge)."""
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    waves: int = 4


def kernel_config(rows: int, dtype: torch.dtype) -> KernelConfig:
    """The launch shape for `rows` = G·T query rows per (row, kv head), from the H200 sweep at Qwen2.5-0.5B
    shapes (bench/decode_attention.py: KV 1K/8K/30K x B 8/32 x T 1/5/8, 54 shapes each; BENCHMARKS.md).

    Four warps always: with 8 warps the 64-row tile of a verify (G·T = 35 or 56, padded to 64) made the
    kernel 1.4-1.5x slower at KV >= 8K (two warpgroups split one small tile: more softmax and rescale
    instructions per key, and fewer programs resident per SM). A 64-row tile also wants fewer, longer
    splits (2 programs per SM): its per-key work is 4x the plain step's 16-row tile, so longer loops
    hide the loads with 3 stages, and the merge reads half the partials. With these the verify of
    k+1 = 5 reads the cache at 1.04x the plain step's attention time at KV 30K, B 32 (was 2.2x)."""
    if _pow2(rows) <= 16:
        return KernelConfig(block_n=64, num_warps=4, num_stages=2, waves=4)
    return KernelConfig(block_n=64, num_warps=4, num_stages=3, waves=2)


def split_plan(batch: int, num_kv_heads: int, max_len: int, num_sms: int = 132, block_n: int = 64,
               waves: int = 4) -> tuple[int, int]:
    """(chunk, num_splits) for a cache of `max_len` keys: enough programs to fill the GPU (`waves` per SM)
    when the cache is full, never a chunk shorter than one key block. Static in (B, Hkv, S_max)."""
    blocks = -(-max_len // block_n)
    want = max(1, -(-waves * num_sms // (batch * num_kv_heads)))  # splits per (row, kv head)
    splits = min(blocks, want)
    chunk = block_n * -(-blocks // splits)
    return chunk, -(-max_len // chunk)


if triton is not None:
    @triton.jit
    def _attend_keys(q, K, V, k_base, v_base, sk_s, sv_s, n0, end, pos, m_i, l_i, acc, qk_scale,
                     D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                     MASKED: tl.constexpr):
        """One online-softmax step over keys n0..n0+BLOCK_N-1, in base 2: m_i is the running max of
        s·scale·log2(e), so p = exp2(s·qk_scale - m) is one FMA and one exp2 per score (exp(x) would
        be a multiply more). MASKED=False is the bulk of the chunk, where every key is visible to every
        query row (n < min_t pos + 1): no compare, no select, no load masks."""
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        kv_ok = offs_d[None, :] < D
        if MASKED:
            kv_ok = kv_ok & (offs_n[:, None] < end)
        k_ptr = K + k_base + offs_n[:, None] * sk_s + offs_d[None, :]
        v_ptr = V + v_base + offs_n[:, None] * sv_s + offs_d[None, :]
        if MASKED or BLOCK_D != D:
            k = tl.load(k_ptr, mask=kv_ok, other=0.0)
        else:
            k = tl.load(k_ptr)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if MASKED:
            visible = (offs_n[None, :] <= pos[:, None]) & (offs_n[None, :] < end)
            s = tl.where(visible, s, float("-inf"))
        # qk_scale > 0, so max(s)·qk_scale = max(s·qk_scale)
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if MASKED or BLOCK_D != D:
            v = tl.load(v_ptr, mask=kv_ok, other=0.0)
        else:
            v = tl.load(v_ptr)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc

    @triton.jit
    def _split_kernel(Q, K, V, POS, OP, LP, T, HKV, chunk, qk_scale,
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
        pos = tl.load(POS + b * sp_b + t, mask=row_ok, other=-1).to(tl.int32)  # (BLOCK_M,)
        pos_hi = tl.max(pos, axis=0)
        pos_lo = tl.min(tl.where(row_ok, pos, pos_hi), axis=0)
        start = split * chunk
        end = tl.minimum(start + chunk, pos_hi + 1)  # keys past the live prefix: skipped
        # keys [start, mid) are visible to every query row (below the smallest position): unmasked steps;
        # [mid, end) holds the causal edge of the k+1 new tokens (and the chunk's ragged end): masked
        mid = start + tl.maximum(tl.minimum(end, pos_lo + 1) - start, 0) // BLOCK_N * BLOCK_N
        offs_d = tl.arange(0, BLOCK_D)
        q = tl.load(Q + b * sq_b + t[:, None] * sq_t + (hkv * G + g)[:, None] * sq_h + offs_d[None, :],
                    mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
        # A finite "minus infinity" for the running max: a row with no visible key in this chunk keeps
        # m = -1e30, its exp2(s - m) are exactly 0 and l stays 0 (-inf - -inf would be NaN). Padding rows
        # (m >= G·T) read q = 0: finite scores, never stored.
        m_i = tl.full((BLOCK_M,), -1.0e30, tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        k_base, v_base = b * sk_b + hkv * sk_h, b * sv_b + hkv * sv_h
        for n0 in range(start, mid, BLOCK_N):
            m_i, l_i, acc = _attend_keys(q, K, V, k_base, v_base, sk_s, sv_s, n0, end, pos, m_i, l_i, acc,
                                         qk_scale, D, BLOCK_D, BLOCK_N, IEEE, False)
        for n0 in range(mid, end, BLOCK_N):
            m_i, l_i, acc = _attend_keys(q, K, V, k_base, v_base, sk_s, sv_s, n0, end, pos, m_i, l_i, acc,
                                         qk_scale, D, BLOCK_D, BLOCK_N, IEEE, True)
        has = l_i > 0
        # back to natural log for the merge: lse = ln Σ exp(s·scale) = (m + log2 l)·ln 2
        lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        tl.store(OP + bh * sop_bh + split * sop_s + offs_m[:, None] * BLOCK_D + offs_d[None, :], out,
                 mask=row_ok[:, None])
        tl.store(LP + bh * slp_bh + split * slp_s + offs_m, lse, mask=row_ok)

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
                     impl: str | None = None, config: KernelConfig | None = None) -> torch.Tensor:
    """Attention of q (B, T, H, D) at `positions` (B, T) over the cache (B, Hkv, S_max, D) -> (B, T, H, D).

    Keys j <= positions[b, t] are visible (the new keys must already be written, `write_kv`). impl: None
    (the Triton split-K kernels on CUDA where they apply, else the twin), "triton" or "torch".
    config: the split kernel's launch shape (default `kernel_config`; benches and tests sweep it).
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
    cfg = config or kernel_config(G * T, q.dtype)
    chunk, NS = split_plan(B, Hkv, S, _num_sms(q.device), cfg.block_n, cfg.waves)
    part_out = torch.empty(B * Hkv, NS, BM, BD, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(B * Hkv, NS, BM, dtype=torch.float32, device=q.device)
    _split_kernel[(NS, B * Hkv)](
        q, k_cache, v_cache, positions, part_out, part_lse, T, Hkv, chunk, scale * math.log2(math.e),
        *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3], positions.stride(0),
        part_out.stride(0), part_out.stride(1), part_lse.stride(0), part_lse.stride(1),
        G=G, D=D, BLOCK_D=BD, BLOCK_M=BM, BLOCK_N=cfg.block_n, IEEE=_ieee(q),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    out = torch.empty(B, T, H, D, dtype=q.dtype, device=q.device)
    _reduce_kernel[(B * Hkv, G * T)](
        part_out, part_lse, positions, out, T, Hkv, chunk, NS, part_out.stride(0), part_out.stride(1),
        part_lse.stride(0), part_lse.stride(1), positions.stride(0), *out.stride()[:3],
        G=G, D=D, BLOCK_D=BD, BLOCK_S=min(64, _pow2(NS)), num_warps=2)
    return out
