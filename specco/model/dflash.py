"""Block drafters: DFlash and DSpark (docs/DESIGN.md §2b). One module, two kinds.

    trunk = hidden_norm(fc(taps))                       (B, S, h)   once per sequence, no decoder pass
    per draft layer l:  trunk K/V = k_norm(K_l trunk), V_l trunk, RoPE at the trunk's absolute positions
                        (the layer's input norm is bypassed: the trunk is already normed)
    block of anchor p:  W query slots at positions p .. p+W-1; slot 0 = emb(x_p), the rest = mask embedding
    layer:  x = x + o_proj(attn(q(input_norm(x)), trunk keys < p ⊕ the block's own slots)); x = x + mlp(...)
    logits = norm(x) @ policy_head.T              (the policy's live head, detached: the draft owns none)

DFlash: W = γ+1, slot 0 is condition-only (its logits are dropped), slot k = 1..γ predicts x_{p+k}.
DSpark: W = γ, slot j predicts x_{p+1+j} (the same labels), plus a low-rank Markov head
    bias_j = w2(w1(prev_j))  (prev_j = x_{p+j}: the true token in training, the previous proposal at serving),
zero-initialised so a fresh DSpark starts as a plain block drafter, and a confidence head
    conf_j = Linear(cat(norm(x_j), w1(prev_j)))  (a logit of the probability that slot j is accepted).

The mask embedding is the policy's frozen `embed_tokens[mask_id]` (a reserved token never seen in data) and
the anchor embeddings the policy's embeddings of the tokens; both arrive detached as arguments. The attention
is an argument (`attn`, default the exact `block_attention`), so context parallelism passes its own.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.block_attention import block_attention
from .config import ConfigError, PolicyConfig, RopeScaling, aux_layer_ids_default
from .draft_io import load_draft_weights, read_draft_config, save_draft_dir
from .layers import Attention, RMSNorm, SwiGLU, apply_rope, rope_cos_sin

KINDS = ("dflash", "dspark")


@dataclass(frozen=True)
class BlockDraftConfig:
    """A DFlash / DSpark drafter. `gamma` = tokens proposed per block (rollout k)."""
    kind: str
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    target_vocab_size: int
    gamma: int
    mask_id: int
    aux_layer_ids: tuple[int, ...] = field(default_factory=tuple)
    markov_rank: int = 64  # r of DSpark's low-rank Markov head (unused by DFlash)
    num_anchors: int = 16  # blocks trained per sequence (losses.sample_anchors)
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    rope_scaling: RopeScaling | None = None  # the policy's: the trunk keys are rotated as the target's

    def __post_init__(self):
        object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))
        if isinstance(self.rope_scaling, dict):  # read back from a saved config.json
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if self.kind not in KINDS:
            raise ConfigError(f"block draft kind={self.kind!r}: expected one of {KINDS}")
        if not self.aux_layer_ids or list(self.aux_layer_ids) != sorted(set(self.aux_layer_ids)):
            raise ConfigError(f"aux_layer_ids must be non-empty and strictly ascending, got {self.aux_layer_ids}")
        if self.gamma < 1 or self.num_layers < 1 or self.num_anchors < 1 or self.markov_rank < 1:
            raise ConfigError("gamma, num_layers, num_anchors and markov_rank must be >= 1")
        if not 0 <= self.mask_id < self.target_vocab_size:
            raise ConfigError(f"mask_id={self.mask_id} outside the vocabulary [0, {self.target_vocab_size})")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("num_heads must be a multiple of num_kv_heads")

    @property
    def block_size(self) -> int:
        """W: DFlash has the condition-only anchor slot in front of its γ predicting slots."""
        return self.gamma + 1 if self.kind == "dflash" else self.gamma

    @property
    def first_predicting_slot(self) -> int:
        return 1 if self.kind == "dflash" else 0

    @property
    def draft_vocab_size(self) -> int:
        """Block drafters predict over the policy's whole head (they own none), unlike EAGLE-3's reduced one."""
        return self.target_vocab_size

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self).items()}  # rope_scaling -> dict

    @classmethod
    def from_dict(cls, d: dict) -> "BlockDraftConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"unknown block draft config keys {unknown}")
        return cls(**d)

    @classmethod
    def for_policy(cls, pc: PolicyConfig, kind: str, gamma: int, mask_id: int, num_layers: int = 1,
                   aux_layer_ids: tuple[int, ...] | None = None, **kw) -> "BlockDraftConfig":
        aux = tuple(aux_layer_ids) if aux_layer_ids else aux_layer_ids_default(pc.num_layers)
        return cls(kind=kind, hidden_size=pc.hidden_size, intermediate_size=pc.intermediate_size,
                   num_heads=pc.num_heads, num_kv_heads=pc.num_kv_heads, head_dim=pc.head_dim,
                   num_layers=num_layers, target_vocab_size=pc.vocab_size, gamma=gamma, mask_id=mask_id,
                   aux_layer_ids=aux, rope_theta=pc.rope_theta, rope_scaling=pc.rope_scaling,
                   rms_norm_eps=pc.rms_norm_eps, **kw)


class BlockDraftLayer(nn.Module):
    """A Qwen3-style decoder layer (q/k norm) whose attention also reads the trunk K/V."""

    def __init__(self, cfg: BlockDraftConfig):
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(h, h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, qk_norm=True,
                                   eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = SwiGLU(h, cfg.intermediate_size)

    def trunk_kv(self, trunk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """trunk (B, S, h) -> k, v (B, Hkv, S, D) through this layer's own K/V rows: no input norm, k-norm, RoPE."""
        sa = self.self_attn
        B, S, _ = trunk.shape
        Hkv, D = sa.num_kv_heads, sa.head_dim
        q_size = sa.num_heads * D
        w = sa.qkv_proj.weight[q_size:]  # (2·Hkv·D, h): rows [k | v] of the fused projection
        b = None if sa.qkv_proj.bias is None else sa.qkv_proj.bias[q_size:]
        k, v = F.linear(trunk, w, b).split(Hkv * D, dim=-1)
        k = sa.k_norm(k.view(B, S, Hkv, D)).transpose(1, 2)  # (B, Hkv, S, D)
        v = v.view(B, S, Hkv, D).transpose(1, 2)
        return apply_rope(k, cos, sin), v


class BlockDraft(nn.Module):
    def __init__(self, cfg: BlockDraftConfig):
        super().__init__()
        self.cfg = cfg
        h, k = cfg.hidden_size, len(cfg.aux_layer_ids)
        self.fc = nn.Linear(k * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(BlockDraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        if cfg.kind == "dspark":
            r = cfg.markov_rank
            self.markov_w1 = nn.Embedding(cfg.target_vocab_size, r)
            self.markov_w2 = nn.Linear(r, cfg.target_vocab_size, bias=False)
            self.confidence = nn.Linear(h + r, 1)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
        if cfg.kind == "dspark":
            nn.init.zeros_(self.markov_w2.weight)  # bias starts at 0: a fresh DSpark = a plain block drafter
            nn.init.zeros_(self.confidence.bias)

    @property
    def kind(self) -> str:
        return self.cfg.kind

    ARCHITECTURE = "specco.BlockDraft"  # draft_config.json's "architecture": what export.load_any_draft dispatches on

    def save(self, path: str | os.PathLike) -> None:
        """The draft directory layout of draft_io.py (atomic per file), like Eagle3Draft.save."""
        save_draft_dir(self, path, self.ARCHITECTURE, self.cfg.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike, device="cpu", dtype=torch.float32) -> "BlockDraft":
        cfg = BlockDraftConfig.from_dict(read_draft_config(path, cls.ARCHITECTURE))
        return load_draft_weights(cls(cfg), path, device, dtype)

    def block_positions(self, positions: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """positions (B, S) absolute, anchors (B, N) indices -> (B, N, W) absolute slot positions p_n + w."""
        p = positions.gather(1, anchors)  # (B, N)
        return p[..., None] + torch.arange(self.cfg.block_size, device=p.device)

    def forward(self, taps: torch.Tensor, anchor_emb: torch.Tensor, mask_emb: torch.Tensor,
                trunk_pos: torch.Tensor, slot_pos: torch.Tensor, attn=block_attention) -> torch.Tensor:
        """Final-normed hidden states of every slot, (B, N, W, h).

        taps (B, S, k·h) detached target taps at trunk positions trunk_pos (B, S) (absolute; zigzag under CP);
        anchor_emb (B, N, h) detached policy embeddings of the anchor tokens; mask_emb (h,) the detached
        mask-token embedding; slot_pos (B, N, W) absolute slot positions (`block_positions`).
        `attn(q, k_trunk, v_trunk, k_block, v_block, trunk_pos, anchor_pos)` is the block attention.
        """
        c = self.cfg
        B, N, W = slot_pos.shape
        dt = self.fc.weight.dtype
        trunk = self.hidden_norm(self.fc(taps.to(dt)))  # (B, S, h)
        x = mask_emb.to(dt).expand(B, N, W, c.hidden_size).clone()
        x[:, :, 0] = anchor_emb.to(dt)  # (B, N, W, h): [emb(x_p), mask, ..., mask]
        cos_t, sin_t = rope_cos_sin(trunk_pos, c.head_dim, c.rope_theta, dt, scaling=c.rope_scaling)  # (B, S, D)
        cos_b, sin_b = rope_cos_sin(slot_pos.reshape(B, N * W), c.head_dim, c.rope_theta, dt, scaling=c.rope_scaling)
        anchor_pos = slot_pos[:, :, 0]
        x = x.reshape(B, N * W, c.hidden_size)
        for layer in self.layers:
            kt, vt = layer.trunk_kv(trunk, cos_t, sin_t)
            sa = layer.self_attn
            q, kb, vb = sa.qkv(layer.input_layernorm(x), cos_b, sin_b)  # (B, H|Hkv, N·W, D)
            split = lambda t: t.reshape(B, t.shape[1], N, W, sa.head_dim)  # noqa: E731  (B, heads, N, W, D)
            o = attn(split(q), kt, vt, split(kb), split(vb), trunk_pos, anchor_pos)  # (B, H, N, W, D)
            x = x + sa.out(o.reshape(B, sa.num_heads, N * W, sa.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x).reshape(B, N, W, c.hidden_size)

    def predicting(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, N, W, h) -> the γ predicting slots (B, N, γ, h): slot j here predicts x_{p+1+j}."""
        return hidden[:, :, self.cfg.first_predicting_slot:]

    def logits(self, hidden: torch.Tensor, head_weight: torch.Tensor,
               prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """hidden (..., h) normed -> logits (..., V) through the policy's head (detached here: the draft
        never trains it). DSpark adds its Markov bias w2(w1(prev_tokens)) (prev_tokens (...,) int)."""
        z = F.linear(hidden, head_weight.detach().to(hidden.dtype))
        if self.cfg.kind == "dspark":
            z = z + self.markov_w2(self.markov_w1(prev_tokens))
        return z

    def confidence_logit(self, hidden: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
        """DSpark: (..., h), (...,) -> (...,) logit of P(slot accepted)."""
        return self.confidence(torch.cat([hidden, self.markov_w1(prev_tokens).to(hidden.dtype)], -1)).squeeze(-1)


def slot_weight_decay(block_size: int) -> float:
    """γ_d of DFlash's slot weights w_j = exp(-j/γ_d): 4, 5, 7 for blocks of 8, 10, 16, linearly
    interpolated between (and extrapolated beyond with the end segments' slopes), at least 1."""
    pts = [(8, 4.0), (10, 5.0), (16, 7.0)]
    (x0, y0), (x1, y1) = (pts[0], pts[1]) if block_size <= 10 else (pts[1], pts[2])
    return max(1.0, y0 + (y1 - y0) * (block_size - x0) / (x1 - x0))


def slot_weights(cfg: BlockDraftConfig) -> list[float]:
    """w_j = exp(-j/γ_d), j = 0..γ-1, γ_d from the block size W (docs/DESIGN.md §2b)."""
    g = slot_weight_decay(cfg.block_size)
    return [math.exp(-j / g) for j in range(cfg.gamma)]
