"""The warm start's own engines (its pool sampling and tau checks, runner/prepare.py) decode on the policy as the RL
engine holds it (rollout.dtype, runner/derive.engine_copy: a bf16 copy of fp32 masters halves a long-context pool's
KV cache, 71 -> 36 GB at 64 rows of 34K tokens) and take at most an RL step's rollout rows per call."""
from pathlib import Path

import pytest
import torch

from specco.config_load import load_config
from specco.data.source import load_data
from specco.data.tokenizer import build_char_tokenizer
from specco.runner import prepare
from specco.runner.derive import engine_copy

from test_long_prompt_cut import _models

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "long_context.toml"
SMALL = ["device=cpu", "data.context_tokens=[150,200]", "data.options.min_terms=3", "data.options.max_terms=4",
         "train.warm_start_prompts=12"]


@pytest.mark.parametrize("dtype,cast", [("bfloat16", True), ("float32", False), ("", False)])
def test_engine_copy(dtype, cast):
    policy = _models("none")[0].float()
    before = [p.clone() for p in policy.parameters()]
    eng = engine_copy(policy, load_config(CONFIG, SMALL + [f"rollout.dtype={dtype}"]))
    assert (eng is not policy) == cast and engine_copy(None, load_config(CONFIG, SMALL)) is None
    for p, q, b in zip(eng.parameters(), policy.parameters(), before):
        assert p.dtype == (torch.bfloat16 if cast else torch.float32)
        assert torch.equal(q, b) and q.dtype == torch.float32  # the masters untouched
        assert torch.equal(p, b.to(p.dtype))


@pytest.mark.parametrize("prompts,per_call", [(8, 8), (2, 2), (64, 32)])
def test_pool_sampled_on_the_engine_copy_in_rl_sized_calls(monkeypatch, prompts, per_call):
    seen = {}

    def fake(policy, source, tok, n_prompts, group, gen_cfg, seed, batch_prompts):
        seen.update(dtype=next(policy.parameters()).dtype, n=n_prompts, per_call=batch_prompts)
        return torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1)
    monkeypatch.setattr(prepare, "sample_pool", fake)
    cfg = load_config(CONFIG, SMALL + [f"rollout.prompts_per_step={prompts}"])  # group_size 4: rows = 4 x prompts
    tok = build_char_tokenizer()
    policy = _models("none")[0].float()
    prepare.warm_pool(cfg, policy, load_data(cfg.data, tok)[0], tok)()
    assert seen == {"dtype": torch.bfloat16, "n": 12, "per_call": per_call}


def test_tau_checks_on_the_engine_copies(monkeypatch, tmp_path):
    from specco.runner.validate import JobData
    seen = []

    def fake_tau(policy, draft, source, n_prompts, gen_cfg, seed):
        seen.append((next(policy.parameters()).dtype, next(draft.parameters()).dtype))
        return {"plain": {"tau": 1.0}, "draft": {"tau": 1.0}}
    monkeypatch.setattr(prepare, "measure_tau", fake_tau)
    cfg = load_config(CONFIG, SMALL + ["train.warm_start_steps=1", "train.warm_start_batch=2", "policy.hidden_size=32",
                                       "policy.num_layers=2", "policy.num_heads=2", "policy.num_kv_heads=2",
                                       "policy.intermediate_size=64", "train.amp=none"])
    tok = build_char_tokenizer()
    policy = prepare.Policy(prepare.tiny_policy(cfg, tok)).float()  # the trainer's fp32 masters
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 60, (4, 24), generator=g)
    mask = torch.zeros(4, 24)
    mask[:, 12:] = 1
    data = JobData(train=load_data(cfg.data, tok)[0], eval=None, sft=None, rewards=None, stats={})
    draft, metrics = prepare.prepare_draft(cfg, policy, tok, data, tmp_path, progress=False,
                                           pool=lambda: (tokens, mask))
    assert seen == [(torch.bfloat16, torch.bfloat16)] * 2  # greedy and at the rollout temperature
    assert next(draft.parameters()).dtype == torch.float32 and next(policy.parameters()).dtype == torch.float32
