"""Hugging Face config fidelity: every config.json field that changes the computation is read with
transformers' meaning or refused by name (README "Hugging Face config fidelity").

The refusal tests need no transformers. The parity tests build models with transformers and compare
logits (fp32, max |diff| <= 1e-4, as tests/test_hf_parity.py), including the configs that must keep
loading: Qwen2.5's `sliding_window` with use_sliding_window=false, and use_sliding_window=true whose
max_window_layers covers every layer (transformers then uses full attention everywhere).
"""
import pytest
import torch

from specco.model.config import ConfigError, PolicyConfig, qwen_layer_types

BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            rms_norm_eps=1e-6, rope_theta=10000.0)


def _cfg(model_type, **over):
    return {"model_type": model_type, **BASE, **over}


@pytest.mark.parametrize("model_type,over,needle", [
    ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("qwen3", {"hidden_act": "relu"}, "hidden_act='relu'"),
    ("llama", {"rope_scaling": {"rope_type": "longrope", "factor": 8.0}}, "rope_scaling.rope_type='longrope'"),
    ("qwen2", {"rope_scaling": {"type": "su", "factor": 4.0}}, "rope_scaling.rope_type='su'"),
    ("qwen3", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}}, "rope_parameters.rope_type='dynamic'"),
    ("qwen2", {"rope_scaling": {"type": "yarn", "factor": 4.0, "mrope_section": [1, 2]}}, "rope_scaling.mrope_section"),
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor=0.5"),
    ("llama", {"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "per-layer-type RoPE"),
    ("llama", {"rope_theta": 5e5, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "rope_theta=500000.0"),
    ("llama", {"attention_bias": True}, "attention_bias=True"),
    ("qwen3", {"attention_bias": True}, "attention_bias=True"),
    ("llama", {"mlp_bias": True}, "mlp_bias=True"),
    ("qwen2", {"attention_dropout": 0.1}, "attention_dropout=0.1"),
    ("llama", {"quantization_config": {"quant_method": "gptq"}}, "quantization_config='gptq'"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}, "use_sliding_window=True"),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0}, "sliding_window=16"),
    ("qwen3", {"layer_types": ["full_attention", "sliding_attention", "full_attention"]}, "layer_types"),
    ("qwen2", {"layer_types": ["full_attention"] * 2 + ["linear_attention"]}, "linear_attention"),
    ("mistral", {}, "model_type='mistral'"),
])
def test_unsupported_fields_are_refused_by_name(model_type, over, needle):
    with pytest.raises(ConfigError, match="not supported|not implemented") as e:
        PolicyConfig.from_hf_dict(_cfg(model_type, **over))
    assert needle in str(e.value)


def test_missing_required_field_is_named():
    d = _cfg("llama")
    del d["hidden_size"]
    with pytest.raises(ConfigError, match="'hidden_size'"):
        PolicyConfig.from_hf_dict(d)


def test_transformers_defaults_and_inert_fields():
    # Qwen3's head_dim defaults to 128 (not hidden/heads); swish is SiLU; Qwen2's q/k/v bias is
    # unconditional; fields that change nothing are ignored.
    q3 = PolicyConfig.from_hf_dict({k: v for k, v in _cfg("qwen3").items()})
    assert q3.head_dim == 128 and q3.qk_norm
    sw = PolicyConfig.from_hf_dict(_cfg("llama", hidden_act="swish", pretraining_tp=2, use_cache=True,
                                        architectures=None, initializer_range=0.5))
    assert sw.head_dim == 16 and not sw.attention_bias
    assert PolicyConfig.from_hf_dict(_cfg("qwen2", attention_bias=False)).attention_bias
    assert PolicyConfig.from_hf_dict(_cfg("llama", eos_token_id=[5, 7])).eos_token_id == 5
    assert PolicyConfig.from_hf_dict(_cfg("llama", rope_theta=None, rope_parameters={
        "rope_type": "default", "rope_theta": 1e6})).rope_theta == 1e6


def test_qwen_layer_types_follow_transformers():
    d = _cfg("qwen2", sliding_window=32768, use_sliding_window=False, max_window_layers=1)
    assert qwen_layer_types(d) == ["full_attention"] * 3
    d = _cfg("qwen2", sliding_window=8, use_sliding_window=True, max_window_layers=2)
    assert qwen_layer_types(d) == ["full_attention"] * 2 + ["sliding_attention"]
    d = _cfg("qwen2", sliding_window=None, use_sliding_window=True, max_window_layers=0)
    assert qwen_layer_types(d) == ["full_attention"] * 3


# -- parity with transformers ------------------------------------------------------------------

def _hf_model(transformers, model_type, **over):
    torch.manual_seed(0)
    kw = {k: v for k, v in BASE.items()}
    kw.update(over)
    cls_cfg, cls_model = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[model_type]
    m = cls_model(cls_cfg(**kw))
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            elif n.endswith("bias"):
                p.normal_(0, 0.5)  # random biases, so a dropped bias would show
    return m.eval()


@pytest.mark.parametrize("model_type,over", [
    # Qwen2.5-0.5B's own settings: sliding_window present, use_sliding_window false
    ("qwen2", dict(sliding_window=32768, use_sliding_window=False, max_window_layers=21, tie_word_embeddings=True)),
    # sliding enabled but max_window_layers covers every layer: full attention in transformers too
    ("qwen2", dict(sliding_window=4, use_sliding_window=True, max_window_layers=3)),
    ("qwen3", dict(head_dim=16, sliding_window=4, use_sliding_window=False, max_window_layers=0)),
    ("llama", dict(hidden_act="swish", rope_scaling={"rope_type": "default"})),
])
def test_supported_configs_match_transformers(tmp_path, model_type, over):
    transformers = pytest.importorskip("transformers")
    from specco.model.hf_io import load_policy
    hf = _hf_model(transformers, model_type, **over)
    hf.save_pretrained(tmp_path)
    ours = load_policy(tmp_path).eval()
    ids = torch.randint(0, 97, (2, 23))  # longer than every window above
    with torch.no_grad():
        assert (ours(ids).logits - hf(ids).logits).abs().max().item() <= 1e-4


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_refused_sliding_window_really_changes_transformers_output(tmp_path, model_type):
    """The refusal is needed: with a window shorter than the sequence, transformers' logits differ
    from full attention, so loading such a config as full attention would compute something else."""
    transformers = pytest.importorskip("transformers")
    extra = dict(head_dim=16) if model_type == "qwen3" else {}
    full = _hf_model(transformers, model_type, **extra)
    sliding = _hf_model(transformers, model_type, use_sliding_window=True, sliding_window=4,
                        max_window_layers=1, **extra)
    sliding.load_state_dict(full.state_dict())
    ids = torch.randint(0, 97, (1, 16))
    with torch.no_grad():
        assert (full(ids).logits - sliding(ids).logits).abs().max().item() > 1e-2
    sliding.save_pretrained(tmp_path)
    from specco.model.hf_io import load_policy
    with pytest.raises(ConfigError, match="sliding-window attention is not implemented"):
        load_policy(tmp_path)
