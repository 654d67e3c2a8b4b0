"""A user's job on a mixture-of-experts policy: `specco train` on a tiny random Qwen3-MoE saved by transformers
(2 RL steps, co-trained EAGLE-3, CPU): every step logs the router's aux loss, the run config's coefficient reaches
the policy (and its saved config.json), and transformers loads out_dir/policy to the trainer's logits (1e-5)."""
import json

import pytest
import torch

from specco.cli import main
from specco.data.tokenizer import build_char_tokenizer
from specco.runner.report import read_jsonl
from job_helpers import CHAT_TEMPLATE, job_overrides, word_problems, write_jsonl
from test_job import _check_policy_output

pytestmark = pytest.mark.e2e


def tiny_qwen3_moe(path):
    import transformers
    tok = build_char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=512, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, norm_topk_prob=True, mlp_only_layers=[2], bos_token_id=tok.bos_id,
        eos_token_id=tok.eos_id, pad_token_id=tok.pad_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(str(path), safe_serialization=True)
    tok.save(path)
    return path


def test_train_a_moe_policy(tmp_path):
    policy = tiny_qwen3_moe(tmp_path / "moe")
    data = write_jsonl(tmp_path / "train.jsonl", word_problems(12))
    out = tmp_path / "run"
    main(["train", "--policy", str(policy), "--data", str(data), "--reward", "math", "--quiet",
          *job_overrides(out), "data.eval_fraction=0.25", "policy.router_aux_loss_coef=0.05"])
    steps = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["policy/aux_loss"] > 0 for r in steps)
    assert json.loads((out / "policy" / "config.json").read_text())["router_aux_loss_coef"] == 0.05
    _check_policy_output(out, step=2)
