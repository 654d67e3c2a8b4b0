"""Model configuration: one frozen dataclass per model, validated on construction.

`PolicyConfig` mirrors the Hugging Face `config.json` fields of Llama / Qwen2 / Qwen3 models and of the
mixture-of-experts Qwen2-MoE / Qwen3-MoE (the names differ slightly between families; `from_hf_dict` is the
one place that maps them; the MoE layers themselves are model/moe.py).
`DraftConfig` describes an EAGLE-3 draft attached to a policy. `RopeScaling` is a RoPE frequency
scaling (Llama-3.x's `llama3`, `linear`, `yarn`) as a config.json states it; its formula is
`layers.rope_frequencies`.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from .moe_config import MOE_FAMILIES, moe_fields_from_hf, refuse_moe_unsupported


class ConfigError(ValueError):
    """A configuration value is missing, misspelt or impossible. The message says what to change."""


def check(cond: bool, msg: str):
    """Raise ConfigError(msg) unless `cond`: every config section's validation (specco/config.py and the sections
    owned elsewhere) says what to change in `msg`."""
    if not cond:
        raise ConfigError(msg)


def check_finite_fields(spec, prefix: str):
    """No float field of a config section may be NaN or infinite (train.lr=inf trained every weight to NaN,
    issue 16): raises ConfigError naming `prefix.field`."""
    for f in dataclasses.fields(spec):
        v = getattr(spec, f.name)
        check(not isinstance(v, float) or math.isfinite(v), f"{prefix}.{f.name}={v}: must be a finite number")


def aux_layer_ids_default(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default aux layers (0-indexed): sorted({1, L//2 - 1, max(1, L - 4)}).

    These are the layers whose *outputs* the draft consumes; ascending order matches what serving
    engines call `target_layer_ids`. For very shallow models the set collapses (L = 2 gives {0, 1}).
    """
    ids = {1, num_layers // 2 - 1, max(1, num_layers - 4)}
    ids = {min(max(i, 0), num_layers - 1) for i in ids}
    return tuple(sorted(ids))


ROPE_SCALING_TYPES = ("linear", "llama3", "yarn")

# The keys each rope_type reads (besides rope_type/type, rope_theta and partial_rotary_factor, which
# every type has); any other key is refused, since a key specco does not read may change the rotation.
_ROPE_KEYS = {
    "linear": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
             "mscale", "mscale_all_dim", "truncate"},
}


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE frequency scaling, with the defaults transformers fills in already resolved, so these are
    the numbers the frequencies are computed from (`layers.rope_frequencies`, the one home of the math).

    None in a config (`PolicyConfig.rope_scaling`) means plain RoPE (rope_type 'default'). Fields a type
    does not read stay at their defaults. `attention_factor` None means "derive it from factor / mscale"
    (yarn), which `rope_frequencies` does.
    """
    rope_type: str  # one of ROPE_SCALING_TYPES
    factor: float
    original_max_position_embeddings: int | None = None  # llama3, yarn: the pretraining context
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    attention_factor: float | None = None  # yarn: multiplies cos and sin
    beta_fast: float = 32.0  # yarn: correction range, in rotations
    beta_slow: float = 1.0
    mscale: float | None = None  # yarn: attention_factor = m(factor, mscale) / m(factor, mscale_all_dim)
    mscale_all_dim: float | None = None
    truncate: bool = True  # yarn: floor/ceil the correction range

    def __post_init__(self):
        if self.rope_type not in ROPE_SCALING_TYPES:
            raise ConfigError(f"rope_scaling.rope_type={self.rope_type!r}: expected one of {ROPE_SCALING_TYPES}")
        if self.rope_type in ("llama3", "yarn") and not self.original_max_position_embeddings:
            raise ConfigError(f"rope_scaling ({self.rope_type}) needs original_max_position_embeddings")
        if self.rope_type == "llama3" and (self.low_freq_factor is None or self.high_freq_factor is None):
            raise ConfigError("rope_scaling (llama3) needs low_freq_factor and high_freq_factor")

    @classmethod
    def from_hf(cls, name: str, rp: dict, d: dict, max_position_embeddings: int) -> "RopeScaling | None":
        """The scaling in config.json's field `name` (`rope_parameters` or `rope_scaling`, holding `rp`)
        of config `d`, read as transformers 5 reads it (`standardize_rope_params` and the rope init
        functions): `type` is the old spelling of `rope_type`; for llama3 and yarn a top-level
        `original_max_position_embeddings` wins over the dict's (transformers re-standardizes at rope
        init, where the attribute overrides), else the dict's, else max_position_embeddings; yarn's
        factor None is max_position_embeddings / original; yarn's beta_fast/beta_slow falsy are 32/1.
        None for plain RoPE. Raises ConfigError naming the field on a type or key specco does not compute."""
        rtype = rp.get("rope_type", rp.get("type", "default"))
        if rtype in (None, "default"):
            return None
        if rtype == "dynamic":
            raise _refused(f"{name}.rope_type", rtype, _DYNAMIC_REFUSAL)
        if rtype not in ROPE_SCALING_TYPES:
            raise _refused(f"{name}.rope_type", rtype, f"specco implements {', '.join(ROPE_SCALING_TYPES)} "
                           "and plain RoPE ('default'); longrope and the others are not implemented")
        unknown = sorted(set(rp) - _ROPE_KEYS[rtype] - {"rope_type", "type", "rope_theta", "partial_rotary_factor"})
        if unknown:
            raise _refused(f"{name}.{unknown[0]}", rp[unknown[0]], f"{rtype} RoPE reads only "
                           f"{sorted(_ROPE_KEYS[rtype])}; remove the key if it is inert")
        required = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
                    "yarn": ()}[rtype]
        missing = [k for k in required if rp.get(k) is None]
        if missing:
            raise ConfigError(f"config.json {name} ({rtype} RoPE) has no {missing}; transformers requires "
                              f"{list(required)}: add them (Llama-3.1 uses factor 8, low_freq_factor 1, "
                              "high_freq_factor 4)" if rtype == "llama3" else
                              f"config.json {name} ({rtype} RoPE) has no {missing}; transformers requires it")
        kw = {"rope_type": rtype, "factor": rp.get("factor")}
        if rtype in ("llama3", "yarn"):
            kw["original_max_position_embeddings"] = int(
                d.get("original_max_position_embeddings") or rp.get("original_max_position_embeddings")
                or max_position_embeddings)
        if rtype == "llama3":
            kw.update(low_freq_factor=rp.get("low_freq_factor"), high_freq_factor=rp.get("high_freq_factor"))
        if rtype == "yarn":
            if kw["factor"] is None:
                kw["factor"] = max_position_embeddings / kw["original_max_position_embeddings"]
            kw.update(attention_factor=rp.get("attention_factor"), beta_fast=rp.get("beta_fast") or 32,
                      beta_slow=rp.get("beta_slow") or 1, mscale=rp.get("mscale"),
                      mscale_all_dim=rp.get("mscale_all_dim"), truncate=bool(rp.get("truncate", True)))
        return cls(**kw)

    def to_hf(self) -> dict:
        """config.json's `rope_scaling` dict: `from_hf` reads it back to an equal RopeScaling and
        transformers to the same frequencies (every default resolved and written out)."""
        keys = _ROPE_KEYS[self.rope_type]
        return {"rope_type": self.rope_type, **{k: v for k, v in dataclasses.asdict(self).items()
                                                 if k in keys and v is not None}}


# Why `dynamic` (NTK) is refused rather than implemented: transformers recomputes its inverse
# frequencies from seq_len = max(position_ids) + 1 over the *whole batch of the current call*, keeps
# the largest seen (`max_seq_len_cached`) and resets only when a later call is short again. A row's
# logits then depend on the other rows' lengths and on the history of calls, and in a KV-cached decode
# the cached keys keep the rotation of the call that wrote them while new queries use the current one.
# RL needs the trainer's log-probs of a sequence to be a function of that sequence and to equal the
# rollout's; no fixed rotation in specco equals transformers' stateful one in both the full forward
# and the cached speculative decode (multi-token verify blocks, rows of different lengths), so loading
# it would silently compute a different model.
_DYNAMIC_REFUSAL = ("dynamic NTK RoPE recomputes its frequencies from the longest sequence of each batch "
                    "call in transformers (stateful and batch-dependent, different between a full forward "
                    "and a KV-cached decode), so no fixed rotation specco could use matches it; specco "
                    "implements default, linear, llama3 and yarn")


def rope_config_from_hf(d: dict, max_position_embeddings: int) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) of a HF config dict, refusing by name what specco does not compute
    (per-layer-type parameters, partial_rotary_factor != 1, conflicting thetas, dynamic, longrope...).
    The one reader of RoPE fields: the policy's config.json and imported drafts' go through it."""
    name, rp = _rope_params(d)
    if any(isinstance(v, dict) for v in rp.values()):
        raise _refused(name, rp, "per-layer-type RoPE parameters are not implemented (one RoPE for all layers)")
    prf = rp.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if prf not in (None, 1, 1.0):
        raise _refused("partial_rotary_factor", prf, "RoPE over the whole head (1.0) only")
    if rp.get("rope_theta") is not None and d.get("rope_theta") is not None and \
            float(rp["rope_theta"]) != float(d["rope_theta"]):
        raise _refused("rope_theta", d["rope_theta"], f"it differs from {name}.rope_theta="
                       f"{rp['rope_theta']!r}; transformers versions disagree on which wins, remove one")
    return _rope_theta(d), RopeScaling.from_hf(name, rp, d, max_position_embeddings)


def hf_rope_fields(theta: float, scaling: RopeScaling | None) -> dict:
    """The RoPE fields of a config.json specco writes, in both spellings: transformers < 5 reads
    rope_theta / rope_scaling, 5.x rope_parameters (and takes rope_scaling first when both are set)."""
    scaled = scaling.to_hf() if scaling is not None else None
    return {"rope_theta": theta, "rope_scaling": scaled,
            "rope_parameters": {**(scaled or {"rope_type": "default"}), "rope_theta": theta}}


def _scaling_from_dict(v):
    """A RopeScaling given as a dict (a draft config read back from JSON) -> RopeScaling."""
    return RopeScaling(**v) if isinstance(v, dict) else v


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
    rope_scaling: RopeScaling | None = None  # None: plain RoPE
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qk_norm: bool = False  # Qwen3 normalises q and k per head before RoPE
    attention_bias: bool = False  # Qwen2 has biases on q/k/v projections
    max_position_embeddings: int = 4096
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # Mixture of experts (qwen2_moe, qwen3_moe; model/moe.py). num_experts 0: every layer is the dense SwiGLU of
    # intermediate_size. Layer i is sparse iff num_experts > 0, i not in mlp_only_layers and (i + 1) is a
    # multiple of decoder_sparse_step (transformers' rule, `is_moe_layer`).
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0  # each routed expert's SwiGLU width
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on expert, sigmoid-gated (0: none)
    norm_topk_prob: bool = False  # renormalise the k chosen probabilities to sum to 1
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # The router's load-balancing loss weight in the policy loss (train/moe_loss.py); config.json's
    # router_aux_loss_coef, overridable by the run config's policy.router_aux_loss_coef.
    router_aux_loss_coef: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "rope_scaling", _scaling_from_dict(self.rope_scaling))
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ConfigError(f"num_experts_per_tok={self.num_experts_per_tok} must be in "
                                  f"[1, num_experts={self.num_experts}]")
            if self.moe_intermediate_size < 1:
                raise ConfigError(f"moe_intermediate_size={self.moe_intermediate_size} must be >= 1")
            if self.decoder_sparse_step < 1:
                raise ConfigError(f"decoder_sparse_step={self.decoder_sparse_step} must be >= 1")
        if self.num_experts < 0 or self.shared_expert_intermediate_size < 0:
            raise ConfigError("num_experts and shared_expert_intermediate_size must be >= 0")
        if self.router_aux_loss_coef < 0:
            raise ConfigError(f"router_aux_loss_coef={self.router_aux_loss_coef} must be >= 0")
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

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i's MLP is the sparse mixture of experts (else the dense SwiGLU), as transformers'
        Qwen2-MoE / Qwen3-MoE decoder layers decide it."""
        return self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @property
    def moe(self) -> bool:
        """Whether any layer is a mixture of experts."""
        return any(self.is_moe_layer(i) for i in range(self.num_layers))

    # -- Hugging Face config.json ------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict) -> "PolicyConfig":
        """The policy config of a HF `config.json` (Llama / Qwen2 / Qwen3), read as transformers reads it.

        Every field that changes the computation is either read here with transformers' meaning and
        defaults, or refused by `_refuse_unsupported` with its name, its value and what specco supports;
        the list is in README.md ("Hugging Face config fidelity"). Fields that do not change the
        computation (architectures, dtype, use_cache, initializer_range, pretraining_tp, ...) are ignored.
        """
        mt = d.get("model_type", "llama")
        if mt not in _FAMILY_DEFAULTS:
            raise ConfigError(f"config.json model_type={mt!r} is not supported; specco supports "
                              f"{', '.join(_FAMILY_DEFAULTS)}")
        _refuse_unsupported(d, mt)
        fam = _FAMILY_DEFAULTS[mt]

        def req(key):
            if d.get(key) is None:
                raise ConfigError(f"config.json has no {key!r}; a {mt} config needs it")
            return d[key]

        heads = req("num_attention_heads")
        kv = d.get("num_key_value_heads", fam["num_key_value_heads"])
        max_pos = d.get("max_position_embeddings") or fam["max_position_embeddings"]
        theta, scaling = rope_config_from_hf(d, max_pos)
        eos = d.get("eos_token_id")
        if isinstance(eos, list):  # stop tokens for generation come from generation_config.json
            eos = eos[0] if eos else None
        moe = moe_fields_from_hf(d, mt) if mt in MOE_FAMILIES else {}
        return cls(**moe,
            vocab_size=req("vocab_size"), hidden_size=req("hidden_size"),
            intermediate_size=req("intermediate_size"), num_layers=req("num_hidden_layers"),
            num_heads=heads, num_kv_heads=kv if kv is not None else heads,
            head_dim=d.get("head_dim") or fam["head_dim"], rope_theta=theta, rope_scaling=scaling,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qk_norm=mt in ("qwen3", "qwen3_moe"),
            # Qwen2Attention always has q/k/v biases (transformers ignores `attention_bias` there), Qwen2-MoE's
            # follow `qkv_bias` (default true); Llama and Qwen3(-MoE) with attention_bias=true are refused
            # above (their o_proj has the bias too).
            attention_bias=(mt == "qwen2") or (mt == "qwen2_moe" and bool(d.get("qkv_bias", True))),
            max_position_embeddings=max_pos, model_type=mt, bos_token_id=d.get("bos_token_id"), eos_token_id=eos)

    def to_hf_dict(self) -> dict:
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[self.model_type]
        moe = {}
        if self.model_type in MOE_FAMILIES:
            # `num_experts`, the Hub's spelling: transformers 5 reads it for both families (Qwen3-MoE's
            # attribute_map sends it to num_local_experts, the name its own save_pretrained writes)
            moe = {"num_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
                   "moe_intermediate_size": self.moe_intermediate_size, "norm_topk_prob": self.norm_topk_prob,
                   "decoder_sparse_step": self.decoder_sparse_step, "mlp_only_layers": list(self.mlp_only_layers),
                   "router_aux_loss_coef": self.router_aux_loss_coef, "output_router_logits": False}
            if self.model_type == "qwen2_moe":
                moe.update(shared_expert_intermediate_size=self.shared_expert_intermediate_size,
                           qkv_bias=self.attention_bias)
        return {**moe,
            "architectures": [arch], "model_type": self.model_type,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, **hf_rope_fields(self.rope_theta, self.rope_scaling),
            "rms_norm_eps": self.rms_norm_eps, "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias, "hidden_act": "silu", "mlp_bias": False,
            "attention_dropout": 0.0,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
            "torch_dtype": "float32",
            **({"use_sliding_window": False} if self.model_type != "llama" else {}),
        }

    @property
    def num_params(self) -> int:
        h, L, v = self.hidden_size, self.num_layers, self.vocab_size
        attn = h * self.head_dim * (self.num_heads * 2 + self.num_kv_heads * 2)
        bias = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim if self.attention_bias else 0  # Qwen2's q/k/v
        qk_norm = 2 * self.head_dim if self.qk_norm else 0  # Qwen3's per-head q and k RMSNorm weights
        dense = 3 * h * self.intermediate_size
        sparse = (self.num_experts * (3 * h * self.moe_intermediate_size + h)  # experts + router rows
                  + (3 * h * self.shared_expert_intermediate_size + h if self.shared_expert_intermediate_size else 0))
        mlp = sum(sparse if self.is_moe_layer(i) else dense for i in range(L))
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + head + L * (attn + bias + qk_norm + 2 * h) + mlp + h


# transformers' defaults (5.x config dataclasses, same in 4.51+) for fields a config.json may omit.
# head_dim None: hidden_size // num_attention_heads; num_key_value_heads None: num_attention_heads.
_FAMILY_DEFAULTS = {
    "llama": {"num_key_value_heads": None, "head_dim": 0, "max_position_embeddings": 2048},
    "qwen2": {"num_key_value_heads": 32, "head_dim": 0, "max_position_embeddings": 32768},
    "qwen3": {"num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 32768},
    # the MoE configs have no head_dim field: the attention takes config.json's or hidden // heads
    "qwen2_moe": {"num_key_value_heads": 16, "head_dim": 0, "max_position_embeddings": 32768},
    "qwen3_moe": {"num_key_value_heads": 4, "head_dim": 0, "max_position_embeddings": 32768},
}
_SILU = ("silu", "swish")  # both are nn.SiLU in transformers' ACT2FN


def _refused(field: str, value, supported: str):
    return ConfigError(f"config.json {field}={value!r} is not supported: {supported}")


def _rope_params(d: dict) -> tuple[str, dict]:
    """(field name, dict) of the RoPE parameters: transformers 5 writes `rope_parameters`, older
    versions `rope_scaling` (which held only the scaling, `rope_theta` being top-level). When both are
    non-empty transformers 5 takes `rope_scaling` (`convert_rope_params_to_dict`: rope_scaling or
    rope_parameters), so this does too."""
    for name in ("rope_scaling", "rope_parameters"):
        if d.get(name):
            return name, d[name]
    return "rope_parameters", {}


def _rope_theta(d: dict) -> float:
    """RoPE base: `rope_parameters.rope_theta`, else the top-level `rope_theta`, else 10000
    (transformers' `default_theta`). Both present and different is refused in `_refuse_unsupported`."""
    _, rp = _rope_params(d)
    return float(rp.get("rope_theta", d.get("rope_theta", 10000.0)) or 10000.0)


def qwen_layer_types(d: dict) -> list[str]:
    """Each layer's attention type as transformers' Qwen2/Qwen3 configs define it: `layer_types` when
    given, else layer i is "sliding_attention" iff use_sliding_window, sliding_window is not None and
    i >= max_window_layers (transformers sets sliding_window = None when use_sliding_window is false,
    which is why Qwen2.5 configs carrying `sliding_window` with use_sliding_window=false are full
    attention)."""
    if d.get("layer_types") is not None:
        return list(d["layer_types"])
    window = d.get("sliding_window", 4096) if d.get("use_sliding_window", False) else None
    first = d.get("max_window_layers", 28)
    return ["sliding_attention" if window is not None and i >= first else "full_attention"
            for i in range(d.get("num_hidden_layers", 0))]


def _refuse_unsupported(d: dict, mt: str):
    """Raise ConfigError on the first config field whose value specco does not compute."""
    act = d.get("hidden_act", "silu")
    if act not in _SILU:
        raise _refused("hidden_act", act, "specco's MLP is SwiGLU with SiLU (hidden_act='silu')")
    # RoPE fields are read, or refused by name, by `rope_config_from_hf`, which from_hf_dict calls.
    if mt in ("llama", "qwen3", "qwen3_moe") and d.get("attention_bias", False):
        raise _refused("attention_bias", d["attention_bias"], f"{mt} puts that bias on q/k/v *and* "
                       "o_proj; specco's o_proj has no bias (Qwen2's q/k/v-only bias is supported)")
    if mt == "llama" and d.get("mlp_bias", False):
        raise _refused("mlp_bias", d["mlp_bias"], "specco's MLP projections have no bias")
    if d.get("attention_dropout") not in (None, 0, 0.0):
        raise _refused("attention_dropout", d["attention_dropout"], "specco's attention has no dropout (0.0)")
    if d.get("quantization_config"):
        raise _refused("quantization_config", d["quantization_config"].get("quant_method", "?")
                       if isinstance(d["quantization_config"], dict) else d["quantization_config"],
                       "specco loads unquantized weights; dequantize the checkpoint first")
    if mt in ("qwen2", "qwen3"):
        types = qwen_layer_types(d)
        other = sorted({t for t in types if t != "full_attention"})
        if other:
            layers = [i for i, t in enumerate(types) if t != "full_attention"]
            raise ConfigError(
                f"config.json layer_types has {other} at layers {layers[:8]}{'...' if len(layers) > 8 else ''} "
                f"(use_sliding_window={d.get('use_sliding_window', False)!r}, "
                f"sliding_window={d.get('sliding_window')!r}, max_window_layers={d.get('max_window_layers')!r}): "
                "sliding-window attention is not implemented in specco; only full attention is supported "
                "(use_sliding_window=false, or every layer below max_window_layers)")
    if mt in MOE_FAMILIES:
        refuse_moe_unsupported(d)


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
    rope_scaling: RopeScaling | None = None  # the policy's: the draft rotates as its target does

    def __post_init__(self):
        object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))
        object.__setattr__(self, "rope_scaling", _scaling_from_dict(self.rope_scaling))
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
                   aux_layer_ids=aux, rope_theta=pc.rope_theta, rope_scaling=pc.rope_scaling,
                   rms_norm_eps=pc.rms_norm_eps, max_position_embeddings=pc.max_position_embeddings)

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
