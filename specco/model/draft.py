"""EAGLE-3 draft model.

    taps_i (k*h) --fc--> g_i (h)                       pass 1 hidden input
    x = concat(input_layernorm(emb(tok)), hidden_norm(g))   (2h) -> one decoder layer -> out (h)
    logits = lm_head(norm(out))  over the draft vocabulary (draft_vocab_size <= target vocab)

The decoder output *before* the final norm is the next pass's hidden input (TTT / chained
drafting). The token embedding is the policy's (detached): the draft has no embedding table.
Draft ids map to target ids through `d2t` (target_id = draft_id + d2t[draft_id]) and `t2d` marks
which target ids the draft vocabulary contains; both are built from token frequencies.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from .config import DraftConfig
from .draft_io import load_draft_weights, read_draft_config, save_draft_dir
from .layers import Attention, KVCache, RMSNorm, SwiGLU
from .policy import StageTaps, Taps, join_taps


def build_vocab_maps(token_counts: torch.Tensor, draft_vocab_size: int):
    """Keep the `draft_vocab_size` most frequent target tokens (ties -> lower id).

    Returns d2t (draft_vocab,) int64 offsets and t2d (target_vocab,) bool, the format EAGLE-3
    serving engines read. Draft ids are assigned in ascending target-id order.
    """
    V = token_counts.numel()
    if not 1 <= draft_vocab_size <= V:
        raise ValueError(f"draft_vocab_size={draft_vocab_size} must be in [1, {V}]")
    # Stable sort on -count keeps lower ids first among equal counts.
    order = torch.sort(-token_counts.double(), stable=True).indices[:draft_vocab_size]
    target_ids = torch.sort(order).values
    d2t = target_ids - torch.arange(draft_vocab_size)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[target_ids] = True
    return d2t, t2d


class DraftLayer(nn.Module):
    """The one decoder layer: attention over concat(norm(emb), norm(hidden)), residual = hidden."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)  # on the token embedding
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)  # on the incoming hidden state
        self.self_attn = Attention(2 * h, h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = SwiGLU(h, cfg.intermediate_size)

    def attn_input(self, hidden, emb):
        return torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)  # (B,S,2h)

    def finish(self, hidden, attn_out):
        """Residual + MLP after attention. attn_out: (B, S, h) (already o_proj'ed)."""
        x = hidden + attn_out
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        h, k = cfg.hidden_size, len(cfg.aux_layer_ids)
        self.fc = nn.Linear(k * h, h, bias=False)
        self.midlayer = DraftLayer(cfg)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        # Identity maps until build_vocab_maps is applied (draft vocab = first N target ids).
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(cfg.target_vocab_size, dtype=torch.bool)
        t2d[: cfg.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)

    # -- vocabulary ------------------------------------------------------------------------
    def set_vocab_maps(self, d2t: torch.Tensor, t2d: torch.Tensor):
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(f"vocab maps have shapes {tuple(d2t.shape)}, {tuple(t2d.shape)}; "
                             f"expected {tuple(self.d2t.shape)}, {tuple(self.t2d.shape)}")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    @property
    def draft_to_target(self) -> torch.Tensor:
        """(draft_vocab,) target id of each draft id."""
        return torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t

    @torch.no_grad()
    def init_head_from_policy(self, policy_head_weight: torch.Tensor):
        """Start the draft head from the policy head's rows of the draft vocabulary."""
        self.lm_head.weight.copy_(policy_head_weight[self.draft_to_target].to(self.lm_head.weight))

    def to_target_logits(self, draft_logits: torch.Tensor, fill: float = float("-inf")):
        """Scatter draft-vocab logits (..., Vd) into target-vocab logits (..., V); absent ids get `fill`."""
        out = draft_logits.new_full((*draft_logits.shape[:-1], self.cfg.target_vocab_size), fill)
        return out.index_copy(-1, self.draft_to_target, draft_logits)

    # -- inference: the cached step is rollout/forward.py's `draft_step` over these parameters --
    def new_cache(self, batch: int, max_len: int, device=None, dtype=None) -> KVCache:
        p = self.fc.weight
        c = self.cfg
        return KVCache.empty(1, batch, c.num_kv_heads, max_len, c.head_dim,
                             device or p.device, dtype or p.dtype)

    def join_taps(self, parts: list[StageTaps]) -> Taps:
        """This draft's input from the pipeline stages' taps (ascending layer ids), checked against its
        config: layer ids exactly `cfg.aux_layer_ids`, every tensor (B, S, hidden_size), one embedding."""
        return join_taps(parts, self.cfg.aux_layer_ids, self.cfg.hidden_size)

    def project_taps(self, aux: torch.Tensor) -> torch.Tensor:
        """aux taps (B, S, k*h) -> pass-1 hidden input (B, S, h)."""
        return self.fc(aux.to(self.fc.weight.dtype))

    # -- checkpoint (the layout: draft_io.py) ----------------------------------------------
    ARCHITECTURE = "specco.Eagle3Draft"

    def save(self, path: str | os.PathLike):
        save_draft_dir(self, path, self.ARCHITECTURE, self.cfg.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike, device="cpu", dtype=torch.float32) -> "Eagle3Draft":
        cfg = DraftConfig.from_dict(read_draft_config(path, cls.ARCHITECTURE, legacy_ok=True))
        return load_draft_weights(cls(cfg), path, device, dtype)
