"""Model configuration: one frozen dataclass per model, validated on construction.

`PolicyConfig` mirrors the Hugging Face `config.json` fields of Llama / Qwen2 / Qwen3 models
(the names differ slightly between families; `from_hf_dict` is the one place that maps them).
`DraftConfig` describes an EAGLE-3 draft attached to a policy.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A configuration value is missing, misspelt or impossible. The message says what to change."""


def aux_layer_ids_default(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default aux layers (0-indexed): sorted({1, L//2 - 1, max(1, L - 4)}).

    These are the layers whose *outputs* the draft consumes; ascending order matches what serving
    engines call `target_layer_ids`. For very shallow models the set collapses (L = 2 gives {0, 1}).
    """
    ids = {1, num_layers // 2 - 1, max(1, num_layers - 4)}
    ids = {min(max(i, 0), num_layers - 1) for i in ids}
    return tuple(sorted(ids))


@dataclass(frozen=True)
class PolicyConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0  # 0 -> hidden_size // num_heads
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qk_norm: bool = False  # Qwen3 normalises q and k per head before RoPE
    attention_bias: bool = False  # Qwen2 has biases on q/k/v projections
    max_position_embeddings: int = 4096
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self):
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ConfigError(
                    f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}; "
                    "set head_dim explicitly")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads={self.num_heads} must be a multiple of "
                              f"num_kv_heads={self.num_kv_heads} (grouped-query attention)")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for rotary embeddings")

    # -- Hugging Face config.json ------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict) -> "PolicyConfig":
        mt = d.get("model_type", "llama")
        if mt not in ("llama", "qwen2", "qwen3"):
            raise ConfigError(f"unsupported model_type {mt!r}; specco supports llama, qwen2, qwen3")
        scaling = d.get("rope_scaling") or (d.get("rope_parameters") or {})
        rtype = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
        if rtype not in (None, "default"):
            raise ConfigError(f"rope scaling type {rtype!r} is not supported (only plain RoPE)")
        theta = d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        eos = d.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0]
        return cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_layers=d["num_hidden_layers"],
            num_heads=d["num_attention_heads"],
            num_kv_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
            head_dim=d.get("head_dim") or 0, rope_theta=float(theta),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qk_norm=(mt == "qwen3"), attention_bias=bool(d.get("attention_bias", mt == "qwen2")),
            max_position_embeddings=d.get("max_position_embeddings", 4096), model_type=mt,
            bos_token_id=d.get("bos_token_id"), eos_token_id=eos)

    def to_hf_dict(self) -> dict:
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM"}[self.model_type]
        return {
            "architectures": [arch], "model_type": self.model_type,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps, "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias, "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
            "torch_dtype": "float32",
        }

    @property
    def num_params(self) -> int:
        h, L, v = self.hidden_size, self.num_layers, self.vocab_size
        attn = h * self.head_dim * (self.num_heads * 2 + self.num_kv_heads * 2)
        mlp = 3 * h * self.intermediate_size
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + head + L * (attn + mlp + 2 * h) + h


@dataclass(frozen=True)
class DraftConfig:
    """EAGLE-3 draft: fc(k*h -> h), one decoder layer over concat(emb, hidden), norm, draft head."""
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    target_vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...] = field(default_factory=tuple)
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096

    def __post_init__(self):
        object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))
        if not self.aux_layer_ids:
            raise ConfigError("draft.aux_layer_ids is empty; use aux_layer_ids_default(num_layers)")
        if list(self.aux_layer_ids) != sorted(set(self.aux_layer_ids)):
            raise ConfigError(f"draft.aux_layer_ids must be strictly ascending, got {self.aux_layer_ids}")
        if not 1 <= self.draft_vocab_size <= self.target_vocab_size:
            raise ConfigError(f"draft_vocab_size={self.draft_vocab_size} must be in "
                              f"[1, target_vocab_size={self.target_vocab_size}]")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("draft num_heads must be a multiple of num_kv_heads")

    @classmethod
    def for_policy(cls, pc: PolicyConfig, draft_vocab_size: int | None = None,
                   aux_layer_ids: tuple[int, ...] | None = None) -> "DraftConfig":
        aux = tuple(aux_layer_ids) if aux_layer_ids else aux_layer_ids_default(pc.num_layers)
        bad = [i for i in aux if not 0 <= i < pc.num_layers]
        if bad:
            raise ConfigError(f"aux layer ids {bad} are out of range for a policy with "
                              f"{pc.num_layers} layers (valid: 0..{pc.num_layers - 1})")
        return cls(hidden_size=pc.hidden_size, intermediate_size=pc.intermediate_size,
                   num_heads=pc.num_heads, num_kv_heads=pc.num_kv_heads, head_dim=pc.head_dim,
                   target_vocab_size=pc.vocab_size,
                   draft_vocab_size=min(draft_vocab_size or pc.vocab_size, pc.vocab_size),
                   aux_layer_ids=aux, rope_theta=pc.rope_theta, rms_norm_eps=pc.rms_norm_eps,
                   max_position_embeddings=pc.max_position_embeddings)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DraftConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ConfigError(f"unknown draft config keys {sorted(unknown)}; valid keys: {sorted(names)}")
        return cls(**d)
