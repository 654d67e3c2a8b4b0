"""The policy's logits equal transformers' LlamaForCausalLM / Qwen3ForCausalLM (fp32, max |Δ| <= 1e-4).

Both models are built from small random configs by transformers, saved as HF checkpoints, loaded by
specco and compared on random tokens. 1e-4 in fp32: both compute the same ops in the same order
up to kernel choice; observed differences are ~1e-6.
"""
import pytest
import torch

from specco.rollout.forward import RopeTable, policy_forward

transformers = pytest.importorskip("transformers")

from specco.model.hf_io import load_policy, save_policy  # noqa: E402


def _hf_model(kind, tie):
    torch.manual_seed(0)
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rope_theta=10000.0, tie_word_embeddings=tie, rms_norm_eps=1e-6)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common)
        m = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3Config(head_dim=16, **common)
        m = transformers.Qwen3ForCausalLM(cfg)
    # Random (not identity) norms so a misplaced norm weight would show.
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    return m.eval()


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("tie", [False, True])
def test_logits_match_transformers(tmp_path, kind, tie):
    hf = _hf_model(kind, tie)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_policy(tmp_path / "hf").eval()
    ids = torch.randint(0, 97, (2, 19))
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids).logits
    assert (got - ref).abs().max().item() <= 1e-4
    # save -> transformers load round-trip
    save_policy(ours, tmp_path / "ours")
    cls = transformers.LlamaForCausalLM if kind == "llama" else transformers.Qwen3ForCausalLM
    back = cls.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        assert (back(ids).logits - ref).abs().max().item() <= 1e-4


def test_cached_decode_matches_full_forward(tmp_path):
    hf = _hf_model("qwen3", False)
    hf.save_pretrained(tmp_path / "hf")
    m = load_policy(tmp_path / "hf").eval()
    cached, full = cached_and_full_logits(m, 97)
    assert torch.allclose(cached, full, atol=1e-5)


def cached_and_full_logits(m, vocab: int):
    """(logits of 12 tokens decoded through the engine's KV cache: a 7-token prefill, a 3-token verify-like block,
    then token by token; the same tokens' logits from one full forward), 2 rows of random ids < vocab."""
    ids = torch.randint(0, vocab, (2, 12))
    with torch.no_grad():
        full = m(ids).logits
        cache = m.new_cache(2, 32)
        rope = RopeTable.build(m.cfg.head_dim, m.cfg.rope_theta, 32, "cpu", torch.float32, scaling=None)
        pos = torch.arange(12).expand(2, 12)
        a = policy_forward(m, ids[:, :7], pos[:, :7], cache, rope, prefill=True)[0]  # the prompt
        b = policy_forward(m, ids[:, 7:10], pos[:, 7:10], cache, rope)[0]  # a verify-like block
        c = torch.cat([policy_forward(m, ids[:, t:t + 1], pos[:, t:t + 1], cache, rope)[0]
                       for t in (10, 11)], 1)  # token by token
    return torch.cat([a, b, c], 1), full


def test_taps_are_detached_and_ordered():
    from specco.model.config import PolicyConfig, aux_layer_ids_default
    from specco.model.policy import Policy
    cfg = PolicyConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=8,
                       num_heads=4, num_kv_heads=2)
    ids = aux_layer_ids_default(8)
    assert ids == (1, 3, 4)
    m = Policy(cfg)
    out = m(torch.randint(0, 50, (2, 5)), tap_layers=ids)
    assert out.taps.aux.shape == (2, 5, 3 * 32) and not out.taps.aux.requires_grad
    assert not out.taps.embed.requires_grad
    # A stage reports only what it holds: no embedding tap without the embedding (its input is the
    # previous stage's residual), only its own tap layers, and no joined taps.
    stage = Policy(cfg, layer_ids=range(2, 4), has_embed=False, has_head=False)
    o = stage(hidden_in=torch.randn(1, 3, 32), tap_layers=ids)
    assert o.taps is None and o.stage_taps.embed is None and sorted(o.stage_taps.layers) == [3]
