"""RoPE scaling (llama3, linear, yarn) equals transformers', and `dynamic` is refused by name.

1. `layers.rope_frequencies` (specco's one home of the formula) returns the same inverse frequencies
   and attention factor as transformers' rope init functions — bit-equal in fp32, since both compute
   the same ops in the same order.
2. Tiny random Llama (llama3) and Qwen3 (yarn) models saved by transformers load in specco with logits
   within 1e-5 (fp32) over sequences longer than original_max_position_embeddings (where the scaled
   and plain frequencies give different logits, which the test checks too); specco's save reloads
   in transformers with the same logits; the rollout engine's greedy decode equals transformers'
   greedy `generate` past that length.
3. The drafts carry the policy's scaling, and the EAGLE-3 export writes it.
"""
import pytest
import torch

from specco.model.config import ConfigError, DraftConfig, PolicyConfig, RopeScaling
from specco.model.layers import rope_frequencies

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from specco.model.hf_io import load_policy, save_policy  # noqa: E402
from specco.rollout.generate import GenerateConfig, generate  # noqa: E402
from specco.rollout.sampling import SamplingParams  # noqa: E402

BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=False)
# theta 500 and original context 64 put head_dim 16's 8 wavelengths (2π·500^(i/8)) in all three of
# llama3's regimes: i = 0, 1 below 64/4 (kept), i = 2 between (smoothed), i >= 3 above 64 (divided).
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": LLAMA3,
    "yarn": YARN,
    "yarn_mscale": {**YARN, "beta_fast": 16, "beta_slow": 2, "truncate": False, "mscale": 2.0, "mscale_all_dim": 1.0},
    "yarn_attention_factor": {**YARN, "attention_factor": 1.3},
    "yarn_old_spelling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
}


def _both(model_type, rope_scaling, max_pos=256, theta=500.0, **over):
    """(specco PolicyConfig, transformers config) of one config.json dict."""
    d = {"model_type": model_type, **BASE, "max_position_embeddings": max_pos, "rope_theta": theta,
         "rope_scaling": dict(rope_scaling), **over}
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "qwen3": transformers.Qwen3Config}[model_type]
    return PolicyConfig.from_hf_dict(d), cls(**{k: v for k, v in d.items() if k != "model_type"})


@pytest.mark.parametrize("name", sorted(SCALINGS))
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_frequencies_equal_transformers(name, model_type):
    pc, hc = _both(model_type, SCALINGS[name])
    rtype = SCALINGS[name].get("rope_type", SCALINGS[name].get("type"))
    ref_inv, ref_att = ROPE_INIT_FUNCTIONS[rtype](hc, "cpu")
    inv, att = rope_frequencies(pc.head_dim, pc.rope_theta, pc.rope_scaling)
    assert torch.equal(inv, ref_inv) and att == pytest.approx(ref_att, rel=1e-15)
    plain, _ = rope_frequencies(pc.head_dim, pc.rope_theta, None)
    assert not torch.equal(inv, plain)  # the scaling changed something


def test_llama3_regimes_and_top_level_original_context():
    pc, _ = _both("llama", LLAMA3)
    inv, _ = rope_frequencies(pc.head_dim, pc.rope_theta, pc.rope_scaling)
    plain, _ = rope_frequencies(pc.head_dim, pc.rope_theta, None)
    ratio = plain / inv
    assert torch.allclose(ratio[:2], torch.ones(2)) and 1 < ratio[2] < 8 and torch.allclose(ratio[3:], torch.full((5,), 8.0))
    # transformers: a top-level original_max_position_embeddings wins over the dict's (re-standardized at
    # rope init); yarn's factor None is max_position_embeddings / original.
    pc, hc = _both("llama", {"rope_type": "yarn", "factor": None}, original_max_position_embeddings=32)
    assert pc.rope_scaling.original_max_position_embeddings == 32 and pc.rope_scaling.factor == 8.0
    ref_inv, ref_att = ROPE_INIT_FUNCTIONS["yarn"](hc, "cpu")
    inv, att = rope_frequencies(pc.head_dim, pc.rope_theta, pc.rope_scaling)
    assert torch.equal(inv, ref_inv) and att == pytest.approx(ref_att)


@pytest.mark.parametrize("rope,needle", [
    ({"rope_type": "dynamic", "factor": 2.0}, "rope_scaling.rope_type='dynamic'"),
    ({"rope_type": "longrope", "factor": 2.0}, "rope_scaling.rope_type='longrope'"),
    ({"rope_type": "llama3", "factor": 8.0}, "low_freq_factor"),
    ({**LLAMA3, "short_factor": [1.0]}, "rope_scaling.short_factor"),
])
def test_refused_or_incomplete_scalings_are_named(rope, needle):
    with pytest.raises(ConfigError) as e:
        _both("llama", rope)
    assert needle in str(e.value)


def _hf_model(model_type, rope_scaling, max_pos, **over):
    torch.manual_seed(0)
    _, hc = _both(model_type, rope_scaling, max_pos=max_pos, **over)
    m = {"llama": transformers.LlamaForCausalLM, "qwen3": transformers.Qwen3ForCausalLM}[model_type](hc)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    return m.eval()


CASES = [("llama", LLAMA3, 256, {}), ("qwen3", YARN, 128, {"head_dim": 16})]


@pytest.mark.parametrize("model_type,rope,max_pos,over", CASES)
def test_logits_and_save_match_transformers(tmp_path, model_type, rope, max_pos, over):
    hf = _hf_model(model_type, rope, max_pos, **over)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    ours = load_policy(tmp_path / "hf").eval()
    assert ours.cfg.rope_scaling == RopeScaling.from_hf("rope_scaling", rope, {}, max_pos)
    S = rope["original_max_position_embeddings"] + 16  # past the pretraining context
    ids = torch.randint(0, 97, (2, S))
    with torch.no_grad():
        ref = hf(ids).logits
        assert (ours(ids).logits - ref).abs().max().item() <= 1e-5
        # the scaling matters at these lengths: plain RoPE over the same weights differs
        plain = PolicyConfig(**{**ours.cfg.__dict__, "rope_scaling": None})
        from specco.model.policy import Policy
        unscaled = Policy(plain)
        unscaled.load_state_dict(ours.state_dict())
        assert (unscaled(ids).logits - ref).abs().max().item() > 1e-3
    save_policy(ours, tmp_path / "ours")  # reloads with the same RoPE in specco and in transformers
    assert load_policy(tmp_path / "ours").cfg == ours.cfg
    back = type(hf).from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        assert (back(ids).logits - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("model_type,rope,max_pos,over", CASES)
def test_greedy_rollout_matches_transformers_generate(tmp_path, model_type, rope, max_pos, over):
    hf = _hf_model(model_type, rope, max_pos, eos_token_id=None, bos_token_id=None, **over)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    ours = load_policy(tmp_path / "hf").eval()
    torch.manual_seed(1)
    prompt = torch.randint(0, 97, (1, rope["original_max_position_embeddings"] - 3))  # decode crosses it
    T = 8
    with torch.no_grad():
        ref = hf.generate(prompt, max_new_tokens=T, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = generate(ours, [prompt[0]], GenerateConfig(max_new_tokens=T, sampling=SamplingParams(temperature=0.0)))
    assert out.tokens[0, :T].tolist() == ref[0, prompt.shape[1]:].tolist()


def test_drafts_carry_the_policy_scaling_and_export_writes_it(tmp_path):
    from specco.export import export_draft
    from specco.model.dflash import BlockDraftConfig
    from specco.model.draft import Eagle3Draft
    pc, _ = _both("llama", LLAMA3, num_hidden_layers=8)
    dc = DraftConfig.for_policy(pc, 40, (1, 3, 4))
    assert dc.rope_scaling == pc.rope_scaling and DraftConfig.from_dict(dc.to_dict()) == dc
    bc = BlockDraftConfig.for_policy(pc, "dflash", gamma=3, mask_id=5)
    assert bc.rope_scaling == pc.rope_scaling and BlockDraftConfig.from_dict(bc.to_dict()) == bc
    out = export_draft(Eagle3Draft(dc).eval(), tmp_path / "vllm", "vllm", pc)
    c = transformers.AutoConfig.from_pretrained(str(out))
    assert c.rope_parameters == {**LLAMA3, "rope_theta": 500.0}
