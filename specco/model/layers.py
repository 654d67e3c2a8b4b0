"""Building blocks shared by the policy and the draft: RMSNorm, RoPE, SwiGLU, attention, KV cache.

Plain single-device modules: nothing here knows about torch.distributed. The attention core of a
full-sequence forward is an argument (`core`, default `causal_sdpa`), so context parallelism passes a
ring attention in without patching modules.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * w, computed in fp32 like transformers' LlamaRMSNorm."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for integer `positions` (any shape P) -> (P..., head_dim).

    Same convention as transformers (the two halves of the head dim are rotated together,
    `rotate_half`), so HF checkpoints need no permutation. Computed in fp32 then cast.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                             dtype=torch.float32) / head_dim))
    freqs = positions.float()[..., None] * inv_freq  # (P..., head_dim/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (P..., head_dim)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, H, S, D); cos/sin: (B, S, D). Rotates pairs (x_j, x_{j+D/2})."""
    cos, sin = cos[:, None], sin[:, None]  # (B, 1, S, D) broadcast over heads
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@dataclass
class KVCache:
    """Position-indexed KV cache for one stack of attention layers.

    k, v: (L, B, Hkv, S_max, D). Entry [l, b, :, p] holds layer l's key/value of the token at
    position p of row b. Attention of a query at position p reads keys at positions <= p only, so
    entries past a row's current length may be stale (rejected speculative tokens): rejection is a
    length change, never a copy. Writes go through `index_copy_` on positions so shapes stay static
    (needed for CUDA-graph capture).
    """
    k: torch.Tensor
    v: torch.Tensor
    # Private memo of the attention bias of the forward in progress (see `visibility_bias`).
    _bias_memo: tuple | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def empty(cls, num_layers, batch, num_kv_heads, max_len, head_dim, device, dtype):
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        return cls(torch.zeros(shape, device=device, dtype=dtype),
                   torch.zeros(shape, device=device, dtype=dtype))

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """positions: (B, T); k, v: (B, Hkv, T, D). Scatter into the cache at those positions."""
        B, Hkv, T, D = k.shape
        idx = positions[:, None, :, None].expand(B, Hkv, T, D)  # (B, Hkv, T, D)
        self.k[layer].scatter_(2, idx, k.to(self.k.dtype))
        self.v[layer].scatter_(2, idx, v.to(self.v.dtype))

    def visibility_bias(self, positions: torch.Tensor, group: int, layer: int,
                        dtype: torch.dtype) -> torch.Tensor:
        """Additive attention bias (B, 1, group*T, S_max): 0 where key j <= the query's position,
        -inf elsewhere; query row g*T + t has position positions[b, t] (layout of `cached_attention`).

        Built once per forward and reused by its later layers. Every layer of one forward sees the
        same `positions` object with layers in ascending order, so the memo is reused only when
        `positions` is the same object at the same version (no in-place change since), `layer` is
        larger than the memo's, and CUDA-graph capture state, group and dtype match. A new forward
        restarts at a layer <= the last one seen and so rebuilds it; in particular a forward captured
        into a CUDA graph computes its own bias inside the graph and never reads one made outside.
        Building it per layer instead costs ~4 tiny kernels x L layers per decode step (~0.3 ms in a
        graphed 24-layer step), about the price of the whole attention.
        """
        capturing = positions.is_cuda and torch.cuda.is_current_stream_capturing()
        version = -1 if positions.is_inference() else positions._version
        key = (version, group, dtype, capturing)
        memo = self._bias_memo
        if memo is not None and memo[0] is positions and memo[1] == key and layer > memo[2]:
            self._bias_memo = (positions, key, layer, memo[3])
            return memo[3]
        B, T = positions.shape
        S = self.max_len
        key_pos = torch.arange(S, device=positions.device)
        visible = key_pos[None, None, :] <= positions[:, :, None]  # (B, T, S)
        # Allocate the key dim padded to a multiple of 16 and slice: the memory-efficient SDPA
        # kernel wants 16-byte-aligned bias rows and would otherwise pad (copy) it in every layer.
        S_pad = -(-S // 16) * 16
        bias = torch.full((B, 1, group * T, S_pad), float("-inf"), dtype=dtype,
                          device=positions.device)[..., :S]
        # row g*T + t of the grouped queries has the position of query t: tile over g
        bias.masked_fill_(visible.repeat(1, group, 1)[:, None], 0.0)  # (B, 1, G*T, S)
        self._bias_memo = (positions, key, layer, bias)
        return bias


def causal_sdpa(q, k, v, scale=None, *, expand_gqa: bool | None = None):
    """Default attention core for full-sequence (training) forwards: causal SDPA, GQA aware.

    q: (B, H, S, D); k, v: (B, Hkv, S, D). Context parallelism passes a ring attention instead.
    expand_gqa (None: only for fp32 on CUDA): repeat K/V to H heads instead of `enable_gqa`. In fp32
    on CUDA the one fused kernel, memory-efficient SDPA, has no GQA, so `enable_gqa` falls back to the
    math path, which materialises the (S, S) scores of every head (4 GiB per layer at 8K tokens and
    16 heads) and keeps them for the backward; repeated K/V cost G copies of (S, D) per kv head.
    """
    G = q.shape[1] // k.shape[1]
    if expand_gqa is None:  # under autocast SDPA runs in bf16/fp16, where flash and cuDNN do GQA
        expand_gqa = q.is_cuda and q.dtype == torch.float32 and not torch.is_autocast_enabled("cuda")
    if G > 1 and expand_gqa:
        k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)  # (B, H, S, D): head h -> h // G
        G = 1
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=G > 1)


def cached_attention(q, positions, cache: KVCache, layer: int, scale=None):
    """Attention of new queries at `positions` (B, T) over the whole position-indexed cache.

    Key j is visible to a query at position p iff j <= p. Reading the full S_max keeps shapes
    static for graph capture; stale entries past p are masked out.

    GQA without a GQA kernel: the G = H/Hkv query heads that share kv head h are folded into the
    query-length dim, q (B, H, T, D) -> (B, Hkv, G*T, D) (head h*G + g -> row g*T + t), so this is
    a plain multi-head call with an additive bias. SDPA with `enable_gqa` plus a mask has no fused
    kernel on CUDA (flash takes no mask, memory-efficient no GQA) and fell back to the math path,
    which copies the cache G times per layer; the folded call runs the memory-efficient kernel and
    reads each cached K/V once. Same function: scores, softmax and weights per (head, query) are
    unchanged, only the batching differs.
    """
    B, H, T, D = q.shape
    k, v = cache.k[layer], cache.v[layer]  # (B, Hkv, S_max, D)
    Hkv = k.shape[1]
    G = H // Hkv
    bias = cache.visibility_bias(positions, G, layer, q.dtype)  # (B, 1, G*T, S_max)
    q_grouped = q.reshape(B, Hkv, G * T, D)  # (B, Hkv, G*T, D)
    o = F.scaled_dot_product_attention(q_grouped, k.to(q.dtype), v.to(q.dtype), attn_mask=bias,
                                       scale=scale)
    return o.reshape(B, H, T, D)


class Attention(nn.Module):
    """Multi-head attention with GQA, optional q/k RMSNorm (Qwen3) and optional qkv bias (Qwen2).

    `in_dim` may differ from `num_heads*head_dim` (the EAGLE-3 draft feeds concat(emb, hidden)).
    """

    def __init__(self, in_dim, out_dim, num_heads, num_kv_heads, head_dim, qk_norm=False,
                 bias=False, eps=1e-6):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(in_dim, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(in_dim, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(in_dim, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, out_dim, bias=False)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None

    def qkv(self, x, cos, sin):
        """x: (B, S, in_dim) -> q (B, H, S, D), k/v (B, Hkv, S, D), RoPE applied to q and k."""
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, S, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, S, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, S, D)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def out(self, o):
        """o: (B, H, S, D) -> (B, S, out_dim)."""
        B, H, S, D = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, S, H * D))

    def forward(self, x, cos, sin, positions=None, cache: KVCache | None = None, layer: int = 0, core=None):
        """`core(q, k, v) -> out`: the attention of a full-sequence forward (None: causal_sdpa)."""
        q, k, v = self.qkv(x, cos, sin)
        if cache is None:
            return self.out((core or causal_sdpa)(q, k, v))
        cache.write(layer, positions, k, v)
        return self.out(cached_attention(q, positions, cache, layer))
