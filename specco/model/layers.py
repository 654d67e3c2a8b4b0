"""Building blocks shared by the policy and the draft: RMSNorm, RoPE, SwiGLU, attention, KV cache.

Plain single-device modules: nothing here knows about torch.distributed. The attention core of a
full-sequence forward is an argument (`core`, default `causal_sdpa`), so context parallelism passes a
ring attention in without patching modules. These are the training forwards; the rollout engine's
cached decode path (rollout/forward.py) reads the same parameters through fused kernels whose torch
twins are the formulas here.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

# The formulas live beside their fused decode kernels (ops/decode_kernels.py), one home each.
from ..ops.decode_kernels import rms_norm_reference as rms_norm
from ..ops.decode_kernels import rope_reference
from ..ops.attention import ttt_attention

if TYPE_CHECKING:
    from .config import RopeScaling


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * w, computed in fp32 like transformers' LlamaRMSNorm."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_frequencies(head_dim: int, theta: float, scaling: "RopeScaling | None",
                     device=None) -> tuple[torch.Tensor, float]:
    """(inv_freq (head_dim/2,) fp32, attention_factor): the one home of RoPE's frequencies, for every
    rope type specco implements, computed as transformers' rope init functions compute them
    (`modeling_rope_utils._compute_*_parameters`, transformers 5.x), op for op so fp32 results are equal.

    default: inv_freq_i = theta^(-2i/D), i = 0..D/2-1.
    linear:  inv_freq / factor (position interpolation; same as dividing positions by factor).
    llama3:  wavelength w_i = 2π / inv_freq_i against the pretraining context C (original_max_position_
             embeddings): w > C/low_freq_factor -> inv_freq/factor; w < C/high_freq_factor -> inv_freq;
             between, (1-s)·inv_freq/factor + s·inv_freq with s = (C/w - low) / (high - low).
    yarn:    per dim a blend of interpolation (inv_freq/factor) and extrapolation (inv_freq), with the
             extrapolated share 1 - ramp(i) where ramp rises linearly from 0 to 1 between the dims
             that turn beta_fast and beta_slow times over C (floored/ceiled when truncate); and
             attention_factor = 0.1·ln(factor)+1 (or mscale(factor, mscale)/mscale(factor, mscale_all_dim),
             or the configured attention_factor), which multiplies cos and sin (YaRN eq. 21).
    attention_factor is 1.0 for every type but yarn.
    """
    base = theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)  # (D/2,)
    inv_freq = 1.0 / base
    if scaling is None:
        return inv_freq, 1.0
    kind, factor = scaling.rope_type, scaling.factor
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        C, low, high = scaling.original_max_position_embeddings, scaling.low_freq_factor, scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > C / low, inv_freq / factor, inv_freq)
        smooth = (C / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < C / high) * ~(wavelen > C / low)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        att = scaling.attention_factor
        if att is None:
            if scaling.mscale and scaling.mscale_all_dim:
                att = float(_yarn_mscale(factor, scaling.mscale) / _yarn_mscale(factor, scaling.mscale_all_dim))
            else:
                att = _yarn_mscale(factor)
        C = scaling.original_max_position_embeddings

        def dim_of(rotations):  # the (fractional) dim index whose wavelength turns `rotations` times over C
            return head_dim * math.log(C / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        lo, hi = dim_of(scaling.beta_fast), dim_of(scaling.beta_slow)
        if scaling.truncate:
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, head_dim - 1)
        if lo == hi:
            hi += 0.001  # transformers' guard against a zero-width ramp
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1).to(device)
        extrapolated = 1 - ramp  # (D/2,): 1 for fast (high-frequency) dims, 0 for slow ones
        inv_interp = 1.0 / (factor * base)
        return inv_interp * (1 - extrapolated) + inv_freq * extrapolated, float(att)
    raise ValueError(f"rope_type {kind!r} has no formula here")  # RopeScaling refuses others on construction


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature, eq. 21: 0.1·mscale·ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype, *,
                 scaling: "RopeScaling | None") -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for integer `positions` (any shape P) -> (P..., head_dim).

    Same convention as transformers (the two halves of the head dim are rotated together,
    `rotate_half`), so HF checkpoints need no permutation. Computed in fp32, multiplied by the
    scaling's attention factor (yarn; transformers folds it into cos and sin the same way, so q·k
    scales by its square), then cast. `scaling` is keyword-only and required so no consumer can
    forget the model's scaling: pass the config's `rope_scaling` (None for plain RoPE).
    """
    inv_freq, attention_factor = rope_frequencies(head_dim, theta, scaling, positions.device)
    freqs = positions.float()[..., None] * inv_freq  # (P..., head_dim/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (P..., head_dim)
    return (emb.cos() * attention_factor).to(dtype), (emb.sin() * attention_factor).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, H, S, D); cos/sin: (B, S, D). Rotates pairs (x_j, x_{j+D/2})."""
    return rope_reference(x, cos[:, None], sin[:, None])  # cos/sin (B, 1, S, D) broadcast over heads


def fuse_linears(module: nn.Module, fused: str, parts: list[tuple[str, int]]):
    """Let `module.<fused>` (one Linear whose output rows are the `parts`, in order) load and save as
    the separate Linears `parts` name — the Hugging Face layout (`q_proj`, `k_proj`, `v_proj`;
    `gate_proj`, `up_proj`).

    Why fused: one GEMM instead of three (two) per layer, which at decode — where each GEMM is a
    latency-bound launch — is most of the saving; it is the same function (each output row is the same
    dot product). `state_dict()` returns the parts as row-slice *views* of the fused tensor, so an
    in-place `copy_` into them (the rollout engine's refit) writes the fused weight; loading a state
    dict with the parts concatenates them. A state dict holding the fused key itself also loads.
    The hooks are partials of module-level functions, so the module still deep-copies (and pickles).
    `module.fused_linears` records the parts, so a reader of HF files can fill the fused rows piecewise
    (hf_io.policy_layout: the sharded load reads only the rows a rank holds).
    """
    parts = tuple(parts)
    module.fused_linears = {**getattr(module, "fused_linears", {}), fused: parts}
    module.register_state_dict_post_hook(functools.partial(_split_fused, fused=fused, parts=parts))
    module.register_load_state_dict_pre_hook(functools.partial(_join_fused, fused=fused, parts=parts))


def _split_fused(mod, state, prefix, local_metadata, *, fused, parts):
    """state_dict post-hook of `fuse_linears`: the fused entries become the parts' row slices."""
    for suffix in ("weight", "bias"):
        key = f"{prefix}{fused}.{suffix}"
        if key in state:
            pieces = state.pop(key).split([n for _, n in parts], dim=0)
            for (name, _), piece in zip(parts, pieces):
                state[f"{prefix}{name}.{suffix}"] = piece


def _join_fused(mod, state, prefix, local_metadata, strict, missing, unexpected, errors, *, fused, parts):
    """load_state_dict pre-hook of `fuse_linears`: the parts, when all present, are concatenated — unless the
    module holds them as separate Linears again (`unfuse_linears`), which load them under their own names."""
    if fused not in mod.fused_linears:
        return
    for suffix in ("weight", "bias"):
        keys = [f"{prefix}{name}.{suffix}" for name, _ in parts]
        if all(k in state for k in keys):
            state[f"{prefix}{fused}.{suffix}"] = torch.cat([state.pop(k) for k in keys], dim=0)


def unfuse_linears(module: nn.Module, fused: str) -> None:
    """The inverse of `fuse_linears`, in place: `module.<fused>` becomes the separate Linears its parts name
    (`q_proj`, `k_proj`, `v_proj`), holding the same rows, and `module.<fused>` is None.

    Why: tensor parallelism (parallel/tp.py) shards each projection's output rows over the ranks. A fused
    [q | k | v] weight cut into contiguous row blocks gives rank 0 all of q and rank 1 k and v; every rank needs
    ITS heads of each part. As separate Linears each part is column-sharded on its own (the layout Megatron and
    torchtitan train with), and the state dict keeps HF's names (`q_proj.weight`), which the fused module's
    `state_dict` already reported: the refit, the checkpoints and the engine see the same keys and tensors.
    The price is three GEMMs instead of one in training, where each is large and compute-bound; the rollout
    engine keeps its own fused copy for decode, where the fusion pays. `module.fused_linears` loses the entry,
    so the hooks of `fuse_linears` pass the parts through as they are."""
    linear = getattr(module, fused)
    parts = module.fused_linears.pop(fused)
    start = 0
    for name, n in parts:  # each part a Linear with its own rows of the fused weight (and bias)
        part = nn.Linear(linear.in_features, n, bias=linear.bias is not None,
                         device=linear.weight.device, dtype=linear.weight.dtype)
        with torch.no_grad():
            part.weight.copy_(linear.weight[start:start + n])
            if linear.bias is not None:
                part.bias.copy_(linear.bias[start:start + n])
        part.weight.requires_grad_(linear.weight.requires_grad)
        if part.bias is not None:
            part.bias.requires_grad_(linear.bias.requires_grad)
        setattr(module, name, part)
        start += n
    setattr(module, fused, None)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up as one fused projection (`fuse_linears`)."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.inter = inter
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)  # rows [gate | up]
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        fuse_linears(self, "gate_up_proj", [("gate_proj", inter), ("up_proj", inter)])

    def forward(self, x):
        if self.gate_up_proj is None:  # unfused (unfuse_linears: tensor parallelism's local gate and up rows)
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


@dataclass
class KVCache:
    """Position-indexed KV cache for one stack of attention layers.

    k, v: (L, B, Hkv, S_max, D). Entry [l, b, :, p] holds layer l's key/value of the token at
    position p of row b. Attention of a query at position p reads keys at positions <= p only, so
    entries past a row's current length may be stale (rejected speculative tokens): rejection is a
    length change, never a copy. The rollout engine's decode path (rollout/forward.py) writes and
    reads it with static shapes, so its steps can be captured in CUDA graphs.
    """
    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def empty(cls, num_layers, batch, num_kv_heads, max_len, head_dim, device, dtype):
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        return cls(torch.zeros(shape, device=device, dtype=dtype),
                   torch.zeros(shape, device=device, dtype=dtype))

    @property
    def max_len(self) -> int:
        return self.k.shape[3]


def causal_sdpa(q, k, v, scale=None, *, expand_gqa: bool | None = None, lower_right: bool = False):
    """Default attention core for full-sequence (training) forwards: causal SDPA, GQA aware.

    q: (B, H, S, D); k, v: (B, Hkv, S, D). Context parallelism passes a ring attention instead.
    lower_right: q (B, H, L, D) are the last L of the S keys' positions (L <= S), so query j sees keys
    0 .. S - L + j (the causal mask aligned to the lower right; parallel/shared_prompts.py's segments): the keys
    before the queries as a full block merged with the queries' own causal square (ops/attention.ttt_attention's
    trunk, exact), since the SDPA kernels align a rectangular causal mask differently and torch's CausalBias (a
    tensor subclass) cannot be made under a dispatch mode (memory and op counters).
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
    if lower_right and q.shape[2] != k.shape[2]:
        return ttt_attention(q, k, v, scale=scale, q_start=k.shape[2] - q.shape[2])
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=G > 1)


class Attention(nn.Module):
    """Multi-head attention with GQA, optional q/k RMSNorm (Qwen3) and optional qkv bias (Qwen2).

    `in_dim` may differ from `num_heads*head_dim` (the EAGLE-3 draft feeds concat(emb, hidden)).
    q, k and v are one fused projection `qkv_proj` (rows [q | k | v]) that loads and saves as HF's
    `q_proj` / `k_proj` / `v_proj` (`fuse_linears`). This is the training forward; cached generation
    is rollout/forward.py over the same parameters.
    """

    def __init__(self, in_dim, out_dim, num_heads, num_kv_heads, head_dim, qk_norm=False,
                 bias=False, eps=1e-6):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = nn.Linear(in_dim, q_size + 2 * kv_size, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, out_dim, bias=False)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None
        fuse_linears(self, "qkv_proj", [("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)])

    def qkv(self, x, cos, sin):
        """x: (B, S, in_dim) -> q (B, H, S, D), k/v (B, Hkv, S, D), RoPE applied to q and k."""
        B, S, _ = x.shape
        D = self.head_dim
        if self.qkv_proj is None:  # unfused (unfuse_linears): under tensor parallelism each holds its local heads
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            H, Hkv = self.num_heads, self.num_kv_heads
            q, k, v = self.qkv_proj(x).split([H * D, Hkv * D, Hkv * D], dim=-1)
        # heads as -1, not the global counts: a tensor-parallel rank holds H/tp query and Hkv/tp kv heads
        q, k, v = q.view(B, S, -1, D), k.view(B, S, -1, D), v.view(B, S, -1, D)  # (B, S, heads, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, S, D)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def out(self, o):
        """o: (B, H, S, D) -> (B, S, out_dim)."""
        B, H, S, D = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, S, H * D))

    def forward(self, x, cos, sin, core=None):
        """`core(q, k, v) -> out`: the attention of a full-sequence forward (None: causal_sdpa)."""
        q, k, v = self.qkv(x, cos, sin)
        return self.out((core or causal_sdpa)(q, k, v))
