"""bench/anchor.py's decoder, the baseline the engine's plain step is timed against, computes the engine's function:
with weights loaded from specco's own policy (`AnchorDecoder.load_hf_state` of `Policy.state_dict()`, HF names), a
prefill (the masked multi-token path) and a decode step (the single-token path) give the policy's logits, for a
Qwen2 layout (qkv bias, tied head), Qwen3 (q/k norm) and Qwen3-MoE in each expert mode (fp32 CPU, atol 1e-4: the
same math in other blockings). A baseline that skipped work (a wrong routing, a missing norm) would time faster
than an honest one; this is what rules that out. The "grouped" mode needs torch's CPU grouped-GEMM kernel."""
import sys
from pathlib import Path

import pytest
import torch

from specco.model.config import PolicyConfig
from specco.model.policy import Policy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from anchor import MOE_MODES, AnchorDecoder  # noqa: E402

BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
            max_position_embeddings=64)
CASES = {
    "qwen2": dict(model_type="qwen2", attention_bias=True, tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", qk_norm=True, tie_word_embeddings=False),
    **{f"qwen3_moe_{m}": dict(model_type="qwen3_moe", qk_norm=True, norm_topk_prob=True, num_experts=6,
                              num_experts_per_tok=2, moe_intermediate_size=16, tie_word_embeddings=False)
       for m in MOE_MODES},
}


@pytest.mark.parametrize("case", sorted(CASES))
@torch.no_grad()
def test_anchor_computes_the_policys_logits(case):
    if case.endswith("grouped"):
        from test_moe import _grouped_kernel_runs
        if not _grouped_kernel_runs("cpu"):
            pytest.skip("no grouped-GEMM kernel on cpu")
    cfg = PolicyConfig(**BASE, **CASES[case])
    torch.manual_seed(0)
    policy = Policy(cfg).eval()
    for p in policy.parameters():  # away from the init's ones / zeros, so every weight matters
        p.add_(torch.randn_like(p) * 0.1)
    anchor = AnchorDecoder(cfg).eval()
    anchor.load_hf_state(policy.state_dict())
    if cfg.num_experts:
        anchor.set_moe_mode(case.rsplit("_", 1)[1])
    B, S = 3, 9
    tok = torch.randint(0, cfg.vocab_size, (B, S + 1))
    ref = policy(tok).logits  # (B, S+1, V)
    shape = (cfg.num_layers, B, cfg.num_kv_heads, S + 8, cfg.head_dim)
    k_cache, v_cache = torch.zeros(shape), torch.zeros(shape)
    pre = anchor(tok[:, :S], 0, k_cache, v_cache)  # the masked path over S tokens
    step = anchor(tok[:, S:], S, k_cache, v_cache)  # the decode path at position S
    torch.testing.assert_close(pre, ref[:, :S], atol=1e-4, rtol=0)
    torch.testing.assert_close(step, ref[:, S:], atol=1e-4, rtol=0)


def test_moe_verify_times_each_anchor_mode_and_keeps_the_best(monkeypatch):
    """moe_verify.py's anchor_steps bookkeeping (its timings need CUDA): every MoE mode is timed, a failing one is
    reported with its error and left out of the best, the dense twin is timed once, step_over_anchor = t / best."""
    import types
    import anchor
    import moe_verify
    times = {"grouped": 2e-3, "dense": 1e-3}

    def fake(cfg, batch, pos, T, dtype, temperature, compile, timeit, moe_mode="grouped"):
        assert T == 1 and pos == 16 and not compile
        if cfg.num_experts and moe_mode == "gather":
            raise RuntimeError("out of memory")
        return times[moe_mode] if cfg.num_experts else 4e-3
    monkeypatch.setattr(anchor, "anchor_step_time", fake)
    a = types.SimpleNamespace(anchor="graphed", anchor_modes=list(MOE_MODES), kv=16)
    moe = PolicyConfig(**BASE, **CASES["qwen3_moe_dense"])
    models = {"moe": Policy(moe), "dense": Policy(PolicyConfig(**BASE, model_type="qwen3"))}
    res = {m: {"step": {"t_ms": 3.0}} for m in models}
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    moe_verify.anchor_steps(models, res, a, batch=4)
    s = res["moe"]["step"]
    assert s["anchor_ms"]["grouped"] == 2.0 and s["anchor_ms"]["dense"] == 1.0
    assert s["anchor_ms"]["gather"].startswith("failed: RuntimeError")
    assert s["anchor_best_ms"] == 1.0 and s["step_over_anchor"] == 3.0
    assert res["dense"]["step"]["anchor_ms"] == {"dense": 4.0} and res["dense"]["step"]["step_over_anchor"] == 0.75
