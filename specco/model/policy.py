"""The policy (target) model: a Llama / Qwen2 / Qwen3-style decoder that can record EAGLE-3 taps.

Module names mirror transformers' (`embed_tokens`, `layers.{i}.self_attn.q_proj`, ...), so a
Hugging Face state dict maps onto ours by stripping the `model.` prefix (see `hf_io.py`).
Layers live in a ModuleDict keyed by their global index so a pipeline stage can hold a slice;
embedding, final norm and head may be absent (None) on a stage.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .config import PolicyConfig
from .layers import Attention, KVCache, RMSNorm, SwiGLU, rope_cos_sin


class DecoderLayer(nn.Module):
    def __init__(self, cfg: PolicyConfig):
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(h, h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                   qk_norm=cfg.qk_norm, bias=cfg.attention_bias, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = SwiGLU(h, cfg.intermediate_size)

    def forward(self, x, cos, sin, attn_core=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn_core)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class Taps:
    """What the draft reads from the policy, all detached.

    embed: (B, S, h) embedding output; aux: (B, S, k*h) the aux layers' outputs concatenated in
    ascending layer order (the order serving engines call `target_layer_ids`).
    """
    embed: torch.Tensor
    aux: torch.Tensor
    layer_ids: tuple[int, ...]


@dataclass
class PolicyOutput:
    logits: torch.Tensor | None  # (B, S, V) or None on a headless stage
    hidden: torch.Tensor  # (B, S, h): final-norm output if the stage has the norm, else residual
    taps: Taps | None


class Policy(nn.Module):
    def __init__(self, cfg: PolicyConfig, layer_ids: range | None = None, has_embed=True,
                 has_head=True):
        super().__init__()
        self.cfg = cfg
        layer_ids = range(cfg.num_layers) if layer_ids is None else layer_ids
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if has_embed else None
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg) for i in layer_ids})
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if has_head else None
        self.lm_head = None
        if has_head:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            if cfg.tie_word_embeddings and self.embed_tokens is not None:
                self.lm_head.weight = self.embed_tokens.weight
        self.apply(self._init)

    def _init(self, m):
        # Small normal init like HF's initializer_range=0.02; RMSNorm weights stay 1.
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def new_cache(self, batch: int, max_len: int, device=None, dtype=None) -> KVCache:
        p = next(self.parameters())
        c = self.cfg
        return KVCache.empty(c.num_layers, batch, c.num_kv_heads, max_len, c.head_dim,
                             device or p.device, dtype or p.dtype)

    def forward(self, input_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                tap_layers: tuple[int, ...] | None = None, hidden_in: torch.Tensor | None = None,
                compute_logits: bool = True, attn_core=None) -> PolicyOutput:
        """The training forward. input_ids: (B, S) token ids (or `hidden_in` (B, S, h) on a stage
        without embedding). positions: (B, S) absolute RoPE positions (default 0..S-1).
        tap_layers: aux layer ids whose outputs are recorded (detached) for the draft.
        attn_core: the attention over the S tokens, `core(q, k, v)` (None: causal SDPA per row);
        context parallelism and packed rows pass a ring / per-sequence attention here.
        Cached generation is rollout/forward.py (`policy_forward`), over the same parameters.
        """
        x = self.embed_tokens(input_ids) if self.embed_tokens is not None else hidden_in
        B, S, _ = x.shape
        if positions is None:
            positions = torch.arange(S, device=x.device).expand(B, S)
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        embed_tap = x.detach() if tap_layers is not None else None
        aux = []
        for key, layer in self.layers.items():
            i = int(key)
            x = layer(x, cos, sin, attn_core)
            if tap_layers is not None and i in tap_layers:
                aux.append(x.detach())
        taps = None
        if tap_layers is not None:
            if len(aux) != len(tap_layers):
                missing = sorted(set(tap_layers) - {int(k) for k in self.layers})
                raise ValueError(f"tap layers {missing} are not held by this model/stage")
            taps = Taps(embed_tap, torch.cat(aux, dim=-1), tuple(tap_layers))  # (B, S, k*h)
        if self.norm is not None:
            x = self.norm(x)
        logits = self.lm_head(x) if (self.lm_head is not None and compute_logits) else None
        return PolicyOutput(logits, x, taps)
