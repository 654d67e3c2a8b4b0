"""The decode path: cached forwards of the policy and the EAGLE-3 draft for the rollout engine.

The models' own `forward`s are the *training* forwards (full sequences, the attention core swappable
for context parallelism). Generation needs something else: T new tokens per row at per-row
positions, K/V appended to a position-indexed cache (layers.KVCache), attention over each row's
live prefix. This file is that forward, written over the models' parameters (nothing is copied, so
an in-place refit is seen at once, also by captured CUDA graphs) and built from the fused kernels of
`specco.ops.decode_kernels` / `decode_attention`, whose torch twins are the modules' formulas:

    layer i:  h, x̂ = add_rms_norm(x, resid)          residual stream h, normed input x̂
              qkv = x̂ Wqkvᵀ (+ b)                     one GEMM (the fused q/k/v projection)
              q = rope_qkv_write(qkv, pos)             q/k-norm, RoPE; k, v land in the cache
              o = decode_attention(q, cache_i, pos)    keys j <= pos over the live prefix only
              h', x̂' = add_rms_norm(o Woᵀ, h)
              x, resid = silu_mul(x̂' Wguᵀ) Wdᵀ, h'     (the next layer adds them)

A mixture-of-experts layer (model/moe.py) replaces the last line by the block's own function on the B·T rows
(`SparseMoE.mix`: route, one GEMM pair per expert the rows touch, the shared expert): a verify of k+1 tokens per
row routes every one of them, so it touches up to B·(k+1)·top_k experts where a plain step touches B·top_k.
On a GPU where the grouped GEMM does not apply (fp32 copies) the loop would read expert counts on the host, which
a CUDA graph cannot capture: there the engine runs every expert on every row, the unchosen weighted by zero
(`Experts.every`: the same outputs, E/k times the FLOPs).

The residual add is deferred into the next layer's norm, so a layer is 10 kernel launches. Tests
compare every output with the training forward (`tests/test_decode_path.py`).

Prefill. Right-padded prompts start at position 0, so the prompt's attention is plain causal
attention over the block itself: `prefill=True` runs causal SDPA on the fresh q/k/v (written to the
cache too) instead of reading the cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.dflash import BlockDraft
from ..model.draft import Eagle3Draft
from ..model.layers import KVCache, causal_sdpa, rope_cos_sin
from ..model.moe import SparseMoE
from ..model.policy import Policy, Taps
from ..ops.decode_attention import decode_attention
from ..ops.decode_kernels import add_rms_norm, rope_qkv_write, silu_mul
from .tp import head_logits, reduce_partial, tp_group_of


@dataclass(frozen=True)
class RopeTable:
    """cos/sin (L, D) for positions 0..L-1, computed once (per runner) by the models' own formula
    (`layers.rope_cos_sin`, fp32 then cast), so indexing it equals computing them per step."""
    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def build(cls, head_dim: int, theta: float, length: int, device, dtype, *, scaling) -> "RopeTable":
        """`scaling`: the model config's rope_scaling (None: plain RoPE); its attention factor is in
        the tables, so the fused rope kernel needs nothing else."""
        pos = torch.arange(length, device=device)
        cos, sin = rope_cos_sin(pos, head_dim, theta, dtype, scaling=scaling)  # (L, D)
        return cls(cos.contiguous(), sin.contiguous())

    @property
    def length(self) -> int:
        return self.cos.shape[0]


def _attend(attn, x_normed, positions, cache_k, cache_v, rope: RopeTable, prefill: bool, eps: float,
            visible: torch.Tensor | None = None, tp=None):
    """One attention block on normed inputs (B, T, in) -> o_proj output (B, T, out).

    positions (B, T): RoPE positions and where the new K/V are written; visible (B, T): the last key
    position each query sees (default: its own — causal); the block drafter's slots all see the whole
    block (bidirectional) with visible = the block's last position."""
    B, T, _ = x_normed.shape
    H, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
    qkv = attn.qkv_proj(x_normed)  # (B, T, (H + 2 Hkv) D)
    qn = attn.q_norm.weight if attn.q_norm is not None else None
    kn = attn.k_norm.weight if attn.k_norm is not None else None
    q = rope_qkv_write(qkv, H, Hkv, D, rope.cos, rope.sin, positions, cache_k, cache_v, qn, kn, eps)
    if prefill:  # positions are 0..T-1 in every row: causal attention over the block just written
        o = causal_sdpa(q.transpose(1, 2), cache_k[:, :, :T], cache_v[:, :, :T])  # (B, H, T, D)
        o = o.transpose(1, 2)  # (B, T, H, D)
    else:
        o = decode_attention(q, cache_k, cache_v, positions if visible is None else visible)  # (B, T, H, D)
    return reduce_partial(attn.o_proj(o.reshape(B, T, H * D)), tp)  # tp: each rank's heads' share, summed


def _mlp(mlp, x_normed, tp=None):
    if isinstance(mlp, SparseMoE):  # rows (B·T, h); under tp each expert's I/tp slice: partial sums (rollout/tp.py)
        every = x_normed.is_cuda and not mlp.graph_safe()  # capturable (module docstring)
        return reduce_partial(mlp.mix(x_normed, every=every)[0], tp)
    return reduce_partial(mlp.down_proj(silu_mul(mlp.gate_up_proj(x_normed))), tp)


def _rows(x):  # (B, T, n) -> (B*T, n) for the row-wise kernels
    return x.reshape(-1, x.shape[-1])


@torch.no_grad()
def policy_forward(policy: Policy, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                   rope: RopeTable, tap_layers: tuple[int, ...] | None = None, prefill: bool = False,
                   compute_logits: bool = True, whole_logits: bool = True):
    """Cached forward of the whole policy. input_ids, positions (B, T); writes K/V at `positions`.

    Returns (logits (B, T, V) or None, final-normed hidden (B, T, h), Taps or None) — the fields of
    the training forward's PolicyOutput (taps: embedding and the aux layers' outputs, ascending ids).
    """
    B, T = input_ids.shape
    eps, tp = policy.cfg.rms_norm_eps, tp_group_of(policy)  # tp: a shard of rollout/tp.py (None: whole)
    x = policy.embed_tokens(input_ids)  # (B, T, h)
    embed = x
    resid, aux = None, []
    for key, layer in policy.layers.items():
        i = int(key)
        h, xn = add_rms_norm(_rows(x), resid, layer.input_layernorm.weight, eps)  # (B*T, h) each
        a = _attend(layer.self_attn, xn.view(B, T, -1), positions, cache.k[i], cache.v[i], rope,
                    prefill, eps, tp=tp)
        h, xn = add_rms_norm(_rows(a), h, layer.post_attention_layernorm.weight, eps)
        x, resid = _mlp(layer.mlp, xn, tp), h  # layer output = x + resid, added by the next norm
        if tap_layers is not None and i in tap_layers:
            aux.append((x + resid).view(B, T, -1))
    _, hidden = add_rms_norm(x, resid, policy.norm.weight, eps)
    hidden = hidden.view(B, T, -1)
    taps = None
    if tap_layers is not None:
        taps = Taps(embed, torch.cat(aux, dim=-1), tuple(tap_layers))  # aux (B, T, k*h)
    logits = None
    if compute_logits:  # whole_logits=False: a tp shard's own vocabulary block (rollout/tp.pick_vocab_parallel)
        logits = head_logits(policy, hidden) if whole_logits else policy.lm_head(hidden)
    return logits, hidden, taps


@torch.no_grad()
def draft_step(draft: Eagle3Draft, hidden: torch.Tensor, emb: torch.Tensor, positions: torch.Tensor,
               cache: KVCache, rope: RopeTable, prefill: bool = False):
    """One cached EAGLE-3 draft forward (model/draft.py's layer) for tokens at RoPE `positions` (B, T).

    hidden (B, T, h): fc(taps) for pass 1 or the previous pass's output; emb (B, T, h) the policy
    embedding of each slot's input token. Returns (draft logits (B, T, Vd), output before the final
    norm (B, T, h)) — what the next chained pass takes as its hidden input.
    """
    B, T, h = hidden.shape
    layer, eps = draft.midlayer, draft.cfg.rms_norm_eps
    attn_in = torch.empty(B * T, 2 * h, dtype=hidden.dtype, device=hidden.device)
    add_rms_norm(_rows(emb), None, layer.input_layernorm.weight, eps, out=attn_in[:, :h])
    add_rms_norm(_rows(hidden), None, layer.hidden_norm.weight, eps, out=attn_in[:, h:])  # (B*T, 2h)
    a = _attend(layer.self_attn, attn_in.view(B, T, 2 * h), positions, cache.k[0], cache.v[0], rope,
                prefill, eps)
    x, xn = add_rms_norm(_rows(a), _rows(hidden), layer.post_attention_layernorm.weight, eps)
    out, normed = add_rms_norm(_mlp(layer.mlp, xn), x, draft.norm.weight, eps)
    return draft.lm_head(normed).view(B, T, -1), out.view(B, T, h)


# -- block drafters (DFlash / DSpark, model/dflash.py) ---------------------------------------------------
# Serving state: per draft layer, the trunk K/V — the layer's own K/V projection of hidden_norm(fc(taps))
# — cached at the positions whose target taps exist (< n). A proposal is one forward of the block
# [emb(x_n), mask, ..., mask] at positions n..n+W-1: its K/V are written into the same cache at those
# positions (not yet trunk entries: the trunk is valid < n only, and the catch-up overwrites n..n+k with
# the accepted tokens' trunk K/V), and every slot sees keys <= n+W-1 — the trunk strictly before its
# anchor plus its whole block, bidirectionally: exactly the training attention (ops/block_attention.py).

@torch.no_grad()
def block_trunk_write(draft: BlockDraft, taps_aux: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                      rope: RopeTable) -> None:
    """Trunk K/V of target taps (B, T, k·h) at `positions` (B, T) into every draft layer's cache:
    hidden_norm(fc(taps)) through each layer's K/V rows, k-norm, RoPE (BlockDraftLayer.trunk_kv)."""
    B, T, _ = taps_aux.shape
    eps = draft.cfg.rms_norm_eps
    _, trunk = add_rms_norm(_rows(draft.fc(taps_aux.to(draft.fc.weight.dtype))), None, draft.hidden_norm.weight, eps)
    for l, layer in enumerate(draft.layers):
        sa = layer.self_attn
        q_size = sa.num_heads * sa.head_dim
        kv = torch.nn.functional.linear(trunk, sa.qkv_proj.weight[q_size:],
                                        None if sa.qkv_proj.bias is None else sa.qkv_proj.bias[q_size:])
        # no query heads: the fused kernel only normalises, rotates and writes the keys, and writes the values
        rope_qkv_write(kv.view(B, T, -1), 0, sa.num_kv_heads, sa.head_dim, rope.cos, rope.sin, positions,
                       cache.k[l], cache.v[l], sa.k_norm.weight, sa.k_norm.weight, eps)


@torch.no_grad()
def block_propose_hidden(draft: BlockDraft, anchor_emb: torch.Tensor, mask_emb: torch.Tensor,
                         n: torch.Tensor, cache: KVCache, rope: RopeTable) -> torch.Tensor:
    """Final-normed hidden states (B, W, h) of the block anchored at n (B,): slot 0 = anchor_emb (B, h),
    the others the mask embedding (h,); the same function as BlockDraft.forward for that one block."""
    c = draft.cfg
    B, W, h, eps = n.shape[0], c.block_size, c.hidden_size, c.rms_norm_eps
    dt = draft.fc.weight.dtype
    x = mask_emb.to(dt).expand(B, W, h).clone()
    x[:, 0] = anchor_emb.to(dt)
    slot_pos = n[:, None] + torch.arange(W, device=n.device)  # (B, W)
    visible = slot_pos[:, -1:].expand(B, W)  # every slot sees the trunk < n and its whole block
    x, resid = _rows(x), None
    for l, layer in enumerate(draft.layers):
        hs, xn = add_rms_norm(x, resid, layer.input_layernorm.weight, eps)
        a = _attend(layer.self_attn, xn.view(B, W, h), slot_pos, cache.k[l], cache.v[l], rope, False, eps,
                    visible=visible)
        hs, xn = add_rms_norm(_rows(a), hs, layer.post_attention_layernorm.weight, eps)
        x, resid = _mlp(layer.mlp, xn), hs
    _, hidden = add_rms_norm(x, resid, draft.norm.weight, eps)
    return hidden.view(B, W, h)
