"""The policy (target) model: a Llama / Qwen2 / Qwen3-style decoder that can record EAGLE-3 taps, whose MLPs
may be mixtures of experts (Qwen2-MoE / Qwen3-MoE, model/moe.py).

Module names mirror transformers' (`embed_tokens`, `layers.{i}.self_attn.q_proj`, ...), so a
Hugging Face state dict maps onto ours by stripping the `model.` prefix (see `hf_io.py`).
Layers live in a ModuleDict keyed by their global index so a pipeline stage can hold a slice;
embedding, final norm and head may be absent (None) on a stage.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .config import PolicyConfig
from .layers import Attention, KVCache, RMSNorm, SwiGLU, rope_cos_sin
from .moe import Experts, SparseMoE


class DecoderLayer(nn.Module):
    def __init__(self, cfg: PolicyConfig, index: int = 0):
        """`index`: the layer's global id, which decides whether its MLP is sparse (PolicyConfig.is_moe_layer)."""
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(h, h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                   qk_norm=cfg.qk_norm, bias=cfg.attention_bias, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        if cfg.is_moe_layer(index):
            self.mlp = SparseMoE(h, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                                 cfg.norm_topk_prob, cfg.shared_expert_intermediate_size)
        else:
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
class StageTaps:
    """The taps one model or pipeline stage holds, all detached (docs/DESIGN.md §5: each stage emits only its own).

    embed: (B, S, h) embedding output, only on the stage with the embedding (else None);
    layers: {layer_id: (B, S, h)} outputs of the requested tap layers this stage holds. The draft joins
    the stages' parts into one `Taps` (`model.draft.join_taps`), which checks ids and shapes.
    """
    embed: torch.Tensor | None
    layers: dict[int, torch.Tensor]


def join_taps(parts: list[StageTaps], layer_ids: tuple[int, ...], hidden_size: int) -> Taps:
    """The draft's `Taps` from the stages' parts: aux layers concatenated in ascending id order.

    The tap contract is checked here, at the boundary (STYLE §10): exactly one part has the
    embedding; the parts' layer ids are disjoint and together exactly `layer_ids` (the draft's
    config, ascending); every tensor is (B, S, hidden_size), of one dtype, detached.
    """
    if list(layer_ids) != sorted(set(layer_ids)):
        raise ValueError(f"tap layer ids {layer_ids} must be strictly ascending (the draft's fc reads them in order)")
    embeds = [p.embed for p in parts if p.embed is not None]
    if len(embeds) != 1:
        raise ValueError(f"taps: {len(embeds)} stages reported an embedding tap; exactly one (the first) must")
    layers: dict[int, torch.Tensor] = {}
    for p in parts:
        dup = sorted(set(layers) & set(p.layers))
        if dup:
            raise ValueError(f"tap layers {dup} reported by two stages")
        layers.update(p.layers)
    if sorted(layers) != list(layer_ids):
        missing, extra = sorted(set(layer_ids) - set(layers)), sorted(set(layers) - set(layer_ids))
        raise ValueError(f"taps hold layers {sorted(layers)}, the draft wants {list(layer_ids)}: "
                         f"missing {missing}, unexpected {extra}")
    ref = embeds[0]
    if ref.dim() != 3 or ref.shape[-1] != hidden_size:
        raise ValueError(f"embedding tap has shape {tuple(ref.shape)}; expected (B, S, {hidden_size})")
    for i in layer_ids:
        t = layers[i]
        if t.shape != ref.shape or t.dtype != ref.dtype:
            raise ValueError(f"tap layer {i}: {tuple(t.shape)} {t.dtype}, expected {tuple(ref.shape)} {ref.dtype}")
    if ref.requires_grad or any(t.requires_grad for t in layers.values()):
        raise ValueError("taps must be detached: no gradient may flow from the draft into the policy")
    return Taps(ref, torch.cat([layers[i] for i in layer_ids], dim=-1), tuple(layer_ids))  # aux (B, S, k*h)


@dataclass
class PolicyOutput:
    logits: torch.Tensor | None  # (B, S, V) or None on a headless stage
    hidden: torch.Tensor  # (B, S, h): final-norm output if the stage has the norm, else residual
    taps: Taps | None  # the joined taps, when this model holds the embedding and every tap layer
    stage_taps: StageTaps | None = None  # what this stage holds of them (whenever tap_layers is given)
    # MoE: the router logits (B, S, E) of each sparse layer this model holds, ascending layer id (train/moe_loss.py)
    router_logits: tuple[torch.Tensor, ...] = ()
    logits_from: int = 0  # the logits are of positions logits_from..S-1: (B, S - logits_from, V)


class Policy(nn.Module):
    def __init__(self, cfg: PolicyConfig, layer_ids: range | None = None, has_embed=True,
                 has_head=True):
        super().__init__()
        self.cfg = cfg
        layer_ids = range(cfg.num_layers) if layer_ids is None else layer_ids
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if has_embed else None
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i) for i in layer_ids})
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
        elif isinstance(m, Experts):
            nn.init.normal_(m.gate_up_proj, std=0.02)
            nn.init.normal_(m.down_proj, std=0.02)

    def new_cache(self, batch: int, max_len: int, device=None, dtype=None) -> KVCache:
        p = next(self.parameters())
        c = self.cfg
        return KVCache.empty(c.num_layers, batch, c.num_kv_heads, max_len, c.head_dim,
                             device or p.device, dtype or p.dtype)

    def forward(self, input_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                tap_layers: tuple[int, ...] | None = None, hidden_in: torch.Tensor | None = None,
                compute_logits: bool = True, attn_core=None, logits_from: int = 0) -> PolicyOutput:
        """The training forward. input_ids: (B, S) token ids (or `hidden_in` (B, S, h) on a stage
        without embedding). positions: (B, S) absolute RoPE positions (default 0..S-1).
        tap_layers: aux layer ids whose outputs are recorded (detached) for the draft. A pipeline stage
        records the ones it holds (and the embedding only if it has it) in `stage_taps`; `taps` is their
        join when this model holds all of them (the unsplit model), else None.
        attn_core: the attention over the S tokens, `core(q, k, v)` (None: causal SDPA per row);
        context parallelism and packed rows pass a ring / per-sequence attention here.
        Cached generation is rollout/forward.py (`policy_forward`), over the same parameters.
        logits_from: the logits only of positions logits_from.. (`PolicyOutput.logits_from` says which were
        computed): a long prompt's positions predict nothing a loss reads, and their vocabulary-sized logits would
        dominate the step's memory (a 151K vocabulary at 32K tokens: ~10 GB per row in bf16, 3x that in the loss's
        fp32 buffers). Not under sequence parallelism (the final hidden is cut along the sequence): all positions.
        """
        x = self.embed_tokens(input_ids) if self.embed_tokens is not None else hidden_in
        # (B, S) from the ids, not x: under sequence parallelism (parallel/tp.py) the embedding returns this rank's
        # slice of the sequence, while RoPE's tables and the attention are over all S tokens
        B, S = input_ids.shape if self.embed_tokens is not None else hidden_in.shape[:2]
        if positions is None:
            positions = torch.arange(S, device=x.device).expand(B, S)
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, x.dtype,
                                scaling=self.cfg.rope_scaling)
        # Only the stage that embeds reports an embedding tap: elsewhere x is the previous stage's residual.
        embed_tap = x.detach() if (tap_layers is not None and self.embed_tokens is not None) else None
        held, router_logits = {}, []
        for key, layer in self.layers.items():
            i = int(key)
            x = layer(x, cos, sin, attn_core)
            if tap_layers is not None and i in tap_layers:
                held[i] = x.detach()
            if isinstance(layer.mlp, SparseMoE):  # read and clear (SparseMoE.router_logits: why it is kept there)
                router_logits.append(layer.mlp.router_logits.view(B, -1, self.cfg.num_experts))  # (B, S, E)
                layer.mlp.router_logits = None
        stage_taps = taps = None
        if tap_layers is not None:
            stage_taps = StageTaps(embed_tap, held)
            if embed_tap is not None and len(held) == len(set(tap_layers)):
                taps = join_taps([stage_taps], tuple(sorted(set(tap_layers))), self.cfg.hidden_size)
        if self.norm is not None:
            x = self.norm(x)
        logits, cut = None, 0
        if self.lm_head is not None and compute_logits:
            cut = 0 if isinstance(x, DTensor) else logits_from
            logits = self.lm_head(x[:, cut:] if cut else x)  # (B, S - cut, V)
        return PolicyOutput(logits, x, taps, stage_taps, tuple(router_logits), cut)
