"""The rollout engine with a mixture-of-experts target (rollout/forward.py's MoE layers).

What is compared, with which tolerance:
* the cached decode path (prefill, a verify-like block, token by token) vs the training forward, fp32,
  atol 1e-5, for Qwen3-MoE (norm_topk_prob) and Qwen2-MoE (shared expert, a dense mlp_only layer);
* greedy speculative decoding (EAGLE-3 draft, k = 1 and 3, with EOS) vs plain greedy decoding: tokens and lengths
  equal, log-probs within 1e-4;
* sampling: chi-square of the first 3 emitted tokens (10^5 draws) against the MoE target's exact joint,
  enumerated from full forwards (the pattern of tests/test_speculative.py, whose wrong-verifier test shows the
  machinery can fail), p > 1e-3;
* the engine's capturable path for weights the grouped GEMM does not take (`Experts.every`: every expert on every
  row, the unchosen weighted by zero) equals the loop, fp64, atol 1e-12 (the same products, summed with exact
  zeros; only the GEMMs' blocking differs); on a Hopper GPU (skipped elsewhere) the captured decode, plain and
  speculative, emits the eager decode's tokens, bf16 (grouped GEMM) and fp32 (`every`);
* the refit writes the 3-D expert parameters in place through the per-expert views (bit-equal, fingerprints).
"""
import pytest
import torch

from specco.model.config import PolicyConfig
from specco.model.policy import Policy
from specco.rollout.generate import GenerateConfig, generate
from specco.rollout.sampling import SamplingParams
from test_rollout_helpers import one_thread, random_draft  # noqa: F401
from test_speculative import _chi_square_pvalue, _exact_joint, _prompts

GREEDY = SamplingParams(temperature=0.0)
FAMILIES = {
    "qwen3_moe": dict(qk_norm=True, norm_topk_prob=True),
    "qwen2_moe": dict(attention_bias=True, shared_expert_intermediate_size=24, mlp_only_layers=(1,)),
}


def moe_policy(family="qwen3_moe", V=32, h=32, layers=3, seed=0, router_scale=0.5):
    torch.manual_seed(seed)
    pc = PolicyConfig(vocab_size=V, hidden_size=h, intermediate_size=2 * h, num_layers=layers, num_heads=4,
                      num_kv_heads=2, model_type=family, num_experts=6, num_experts_per_tok=2,
                      moe_intermediate_size=16, **FAMILIES[family])
    policy = Policy(pc)
    with torch.no_grad():  # decisive routing: different rows take different experts
        for name, p in policy.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, router_scale)
    return policy.eval()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_cached_decode_matches_full_forward(family):
    from test_hf_parity import cached_and_full_logits  # the dense models' check, on a MoE policy
    cached, full = cached_and_full_logits(moe_policy(family), 32)
    torch.testing.assert_close(cached, full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_speculative_equals_plain(family, k):
    policy = moe_policy(family, V=12)  # a small vocabulary: a random draft is accepted now and then
    draft = random_draft(policy, draft_vocab=10)
    prompts = _prompts(12)
    T = 16
    base = generate(policy, prompts, GenerateConfig(max_new_tokens=T, sampling=GREEDY))
    eos = int(base.tokens[1, 5])  # a token plain decoding emits mid-way: some rows stop early
    cfg = GenerateConfig(max_new_tokens=T, sampling=GREEDY, num_draft_tokens=k, eos_token_id=eos, pad_token_id=-1)
    plain = generate(policy, prompts, cfg)
    spec = generate(policy, prompts, cfg, draft=draft)
    assert (plain.lengths < T).any()
    assert torch.equal(spec.tokens, plain.tokens) and torch.equal(spec.lengths, plain.lengths)
    torch.testing.assert_close(spec.logprobs, plain.logprobs, atol=1e-4, rtol=0)
    assert spec.tau > 1.0  # some drafts were accepted: the verify's multi-token routing is exercised


@pytest.mark.e2e
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_speculative_sampling_is_lossless_on_moe_target(family):
    policy = moe_policy(family, V=8, h=16, layers=2, seed=3, router_scale=1.0)
    draft = random_draft(policy, seed=4)
    with torch.no_grad():  # p and q peaked and different, so a wrong rule would show
        policy.lm_head.weight.mul_(25.0)
        draft.lm_head.weight.mul_(25.0)
    params, T, prompt = SamplingParams(temperature=1.0), 3, torch.tensor([1, 5, 2])
    out = generate(policy, [prompt], GenerateConfig(max_new_tokens=T, sampling=params, num_draft_tokens=2),
                   draft=draft, group_size=100_000, generator=torch.Generator().manual_seed(0))
    assert (out.lengths == T).all() and 0.05 < out.accept_rate[0] < 0.95  # both branches of the rule
    pvalue = _chi_square_pvalue(out.tokens, _exact_joint(policy, prompt, T, params))
    assert pvalue > 1e-3, pvalue


@pytest.mark.parametrize("family,top_k", [("qwen3_moe", 2), ("qwen2_moe", 2), ("qwen3_moe", 3)])
def test_every_expert_path_equals_the_loop(family, top_k):
    """`SparseMoE.mix(every=True)` (the engine's CUDA-graph path where the grouped GEMM does not apply) against the
    loop: the same block output and router logits on random rows (shared expert included for Qwen2-MoE). A wrong
    weight placement (scatter by the wrong index, or a missing zero) moves outputs by O(1)."""
    policy = moe_policy(family).double()
    block = policy.layers["0"].mlp
    block.top_k = top_k
    rows = torch.randn(37, 32, dtype=torch.float64)
    (ref, ref_logits), (out, logits) = block.mix(rows), block.mix(rows, every=True)
    assert torch.equal(logits, ref_logits)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    assert (out - block.mix(rows[torch.randperm(37)], every=True)[0]).abs().max() > 1e-3  # rows matter


def test_refit_writes_the_expert_parameters_in_place():
    """The engine's refit copies the trainer's per-expert tensors (state-dict views) into its 3-D expert parameters,
    in place, and the refit guard's fingerprints agree."""
    from specco.rollout.weights import InPlaceLoad, compare_fingerprints, fingerprint_rows
    trainer, engine = moe_policy("qwen2_moe", seed=0), moe_policy("qwen2_moe", seed=1)
    w = engine.layers["0"].mlp.experts.gate_up_proj
    ptr = w.data_ptr()
    load = InPlaceLoad(engine, "policy")
    state = trainer.state_dict()
    assert "layers.0.mlp.experts.5.down_proj.weight" in state
    load.write(list(state.items()))
    assert load.finish() == len(state)
    assert w.data_ptr() == ptr and torch.equal(w, trainer.layers["0"].mlp.experts.gate_up_proj)
    compare_fingerprints("policy", fingerprint_rows(engine.state_dict()), fingerprint_rows(trainer.state_dict()), "t")


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="the captured MoE decode needs the grouped GEMM (a Hopper GPU)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_cuda_graph_decode_equals_eager(family, dtype):
    """On a Hopper GPU the decode and verify steps are captured, the experts taking the grouped GEMM (bf16) or
    `Experts.every` (fp32), and the captured greedy decode (plain and speculative) emits the eager decode's tokens
    (the same shapes: no bucketing)."""
    policy = moe_policy(family, V=64, h=64).cuda().to(dtype)
    assert all(layer.mlp.graph_safe() == (dtype == torch.bfloat16)
               for layer in policy.layers.values() if hasattr(layer.mlp, "graph_safe"))
    draft = random_draft(policy, draft_vocab=48).cuda().to(dtype)
    outs = {}
    for graphs in (False, True):
        for d in (None, draft):
            cfg = GenerateConfig(max_new_tokens=12, sampling=GREEDY, num_draft_tokens=3, use_graphs=graphs,
                                 bucket_shapes=False, spec_control=False)
            outs[graphs, d is None] = generate(policy, _prompts(64), cfg, draft=d).tokens.cpu()
    for plain in (True, False):
        assert torch.equal(outs[True, plain], outs[False, plain]), plain
