"""The EAGLE-3 checkpoint layout vLLM and SGLang load, written down once (FORMATS.md has the sources).

One directory: `config.json` (a Llama config with `architectures: ["LlamaForCausalLMEagle3"]` and the
EAGLE-3 fields) + `model.safetensors` with exactly these tensors (h = hidden size, Vd = draft vocab,
V = target vocab, H/Hkv/D = heads, kv heads, head dim, I = intermediate size):

    fc.weight                                   (h, 3h)     concat of the 3 aux taps -> h
    midlayer.input_layernorm.weight             (h,)        norm of the token embedding
    midlayer.hidden_norm.weight                 (h,)        norm of the incoming hidden state
    midlayer.self_attn.{q,k,v}_proj.weight      (H*D | Hkv*D, 2h)   over concat(emb, hidden)
    midlayer.self_attn.o_proj.weight            (h, H*D)
    midlayer.post_attention_layernorm.weight    (h,)
    midlayer.mlp.{gate,up}_proj.weight          (I, h);  midlayer.mlp.down_proj.weight (h, I)
    norm.weight                                 (h,)
    lm_head.weight                              (Vd, h)
    d2t                                         (Vd,) int64  target_id = draft_id + d2t[draft_id]
    t2d                                         (V,) bool    (both engines skip it; kept for trainers)

No `embed_tokens.weight`: both engines then share the target's embedding, which is what specco's draft
uses (it owns none). Aux-layer ids: specco's `aux_layer_ids` are *output of layer i* (0-indexed). Both
engines capture the residual stream *entering* layer j, i.e. the output of layer j-1; vLLM uses the
ids in `eagle_aux_hidden_state_layer_ids` (top level) as such j's, so it gets i + 1; SGLang reads
`eagle_config.eagle_aux_hidden_state_layer_ids` and adds 1 itself, so it gets i.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..model.config import ConfigError, DraftConfig, hf_rope_fields

ARCHITECTURE = "LlamaForCausalLMEagle3"
NUM_AUX = 3  # both loaders size fc as 3 * target_hidden_size


@dataclass(frozen=True)
class Engine:
    name: str
    aux_offset: int  # engine id = specco id + aux_offset
    nested_ids: bool  # ids under eagle_config (SGLang) or at the top level (vLLM)
    source: str  # the loader file read (FORMATS.md)


ENGINES = {
    "vllm": Engine("vllm", 1, False, "vllm/model_executor/models/llama_eagle3.py; "
                   "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py"),
    "sglang": Engine("sglang", 0, True, "python/sglang/srt/models/llama_eagle3.py; "
                     "python/sglang/srt/model_executor/model_runner.py"),
}


def engine(name: str) -> Engine:
    if name not in ENGINES:
        raise ConfigError(f"export engine {name!r} is not supported; choose from {sorted(ENGINES)}")
    return ENGINES[name]


def tensor_shapes(dc: DraftConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the layout and its shape (the names are also specco's draft state_dict keys)."""
    h, I, D = dc.hidden_size, dc.intermediate_size, dc.head_dim
    m = "midlayer."
    return {
        "fc.weight": (h, len(dc.aux_layer_ids) * h),
        m + "input_layernorm.weight": (h,), m + "hidden_norm.weight": (h,),
        m + "self_attn.q_proj.weight": (dc.num_heads * D, 2 * h),
        m + "self_attn.k_proj.weight": (dc.num_kv_heads * D, 2 * h),
        m + "self_attn.v_proj.weight": (dc.num_kv_heads * D, 2 * h),
        m + "self_attn.o_proj.weight": (h, dc.num_heads * D),
        m + "post_attention_layernorm.weight": (h,),
        m + "mlp.gate_proj.weight": (I, h), m + "mlp.up_proj.weight": (I, h),
        m + "mlp.down_proj.weight": (h, I),
        "norm.weight": (h,), "lm_head.weight": (dc.draft_vocab_size, h),
        "d2t": (dc.draft_vocab_size,), "t2d": (dc.target_vocab_size,),
    }


def engine_config(dc: DraftConfig, eng: Engine, max_position_embeddings: int, dtype: str) -> dict:
    """config.json for `eng`. Fields chosen so each loader builds exactly specco's draft:
    norm_before_residual false (vLLM: the residual is the hidden state before hidden_norm),
    tie_word_embeddings false (SGLang would use embed_tokens as the head), bias false (SGLang's fc),
    attention_bias / mlp_bias false, plain RoPE."""
    if len(dc.aux_layer_ids) != NUM_AUX:
        raise ConfigError(f"draft aux_layer_ids={list(dc.aux_layer_ids)}: vLLM and SGLang EAGLE-3 drafts "
                          f"take exactly {NUM_AUX} aux layers (fc is 3 x target_hidden_size in both loaders)")
    ids = [i + eng.aux_offset for i in dc.aux_layer_ids]
    cfg = {
        "architectures": [ARCHITECTURE], "model_type": "llama",
        "hidden_size": dc.hidden_size, "intermediate_size": dc.intermediate_size,
        "num_hidden_layers": 1, "num_attention_heads": dc.num_heads,
        "num_key_value_heads": dc.num_kv_heads, "head_dim": dc.head_dim,
        "hidden_act": "silu", "rms_norm_eps": dc.rms_norm_eps,
        # The policy's RoPE, scaling included (the engines rotate the draft's q/k with these fields),
        # in both spellings: transformers < 5 reads rope_theta / rope_scaling, 5.x rope_parameters.
        **hf_rope_fields(dc.rope_theta, dc.rope_scaling),
        "max_position_embeddings": int(max_position_embeddings),
        "vocab_size": dc.target_vocab_size, "draft_vocab_size": dc.draft_vocab_size,
        "target_hidden_size": dc.hidden_size,
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "bias": False,
        "norm_before_residual": False, "torch_dtype": dtype,
    }
    if eng.nested_ids:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}
    else:
        cfg["eagle_aux_hidden_state_layer_ids"] = ids
        cfg["eagle_config"] = {"use_aux_hidden_state": True}
    return cfg


def check_export(cfg: dict, shapes: dict[str, tuple], dtypes: dict[str, str], dc: DraftConfig,
                 eng: Engine, min_positions: int):
    """Fail loudly unless (config, tensors) is exactly what `eng`'s loader expects for draft `dc`.

    `shapes`/`dtypes`: name -> shape / dtype name of the tensors as written. Checked: every config key
    of `engine_config` with its value, max_position_embeddings >= the policy's, the tensor names (no
    missing, no extra: SGLang silently skips names it does not know), shapes, and d2t/t2d dtypes.
    """
    want = engine_config(dc, eng, cfg.get("max_position_embeddings", 0), cfg.get("torch_dtype", ""))
    bad = {k: (cfg.get(k, "<missing>"), v) for k, v in want.items() if cfg.get(k, "<missing>") != v}
    if bad:
        raise ValueError(f"{eng.name} export config.json: wrong or missing keys (got, expected): {bad}")
    if cfg["max_position_embeddings"] < min_positions:
        raise ValueError(f"{eng.name} export: max_position_embeddings={cfg['max_position_embeddings']} < the "
                         f"policy's {min_positions}; the engine would clamp the draft's RoPE range")
    expected = tensor_shapes(dc)
    missing, extra = sorted(set(expected) - set(shapes)), sorted(set(shapes) - set(expected))
    if missing or extra:
        raise ValueError(f"{eng.name} export tensors: missing {missing}, unexpected {extra}")
    wrong = {k: (tuple(shapes[k]), v) for k, v in expected.items() if tuple(shapes[k]) != v}
    if wrong:
        raise ValueError(f"{eng.name} export tensors with wrong shapes (got, expected): {wrong}")
    if dtypes["d2t"] != "int64" or dtypes["t2d"] != "bool":
        raise ValueError(f"{eng.name} export: d2t must be int64 and t2d bool, got {dtypes['d2t']}, {dtypes['t2d']}")


def engine_default_aux_ids(num_layers: int) -> tuple[int, ...]:
    """Both engines' default when a draft config names no aux layers: capture entering layers
    (2, L//2, L-3), i.e. specco ids (1, L//2 - 1, L - 4)."""
    return tuple(j - 1 for j in (2, num_layers // 2, num_layers - 3))
