"""A user's job as a new user brings it (no tests here): a tiny random Hugging Face Llama with a chat template,
math word problems as JSONL / Parquet, verl- and TRL-style data, reward functions in files."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from specco.data.tokenizer import build_char_tokenizer

# A ChatML-style template: what instruct checkpoints ship in tokenizer_config.json
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")

PROBLEMS = [("Tom has {a} apples and buys {b} more. How many apples does he have?", lambda a, b: a + b),
            ("A box holds {a} pens; {b} are taken out. How many pens are left?", lambda a, b: a - b),
            ("Sara reads {a} pages a day for {b} days. How many pages does she read?", lambda a, b: a * b)]


def word_problems(n: int, seed: int = 0) -> list[dict]:
    """n math word problems: a string prompt, the answer, and an extra column the rewards must receive."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        text, fn = PROBLEMS[i % len(PROBLEMS)]
        a, b = (int(x) for x in torch.randint(2, 9, (2,), generator=g))
        rows.append({"prompt": text.format(a=max(a, b), b=min(a, b)), "answer": str(fn(max(a, b), min(a, b))),
                     "difficulty": ["easy", "medium", "hard"][i % 3]})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import datasets
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def tiny_llama(path: Path, num_layers: int = 4, seed: int = 0) -> Path:
    """A random LlamaForCausalLM saved by transformers (safetensors), with specco's character tokenizer and a
    chat template: a checkpoint directory as users have them, small enough for a CPU test."""
    import transformers
    tok = build_char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    cfg = transformers.LlamaConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=512, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
                                   pad_token_id=tok.pad_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(str(path), safe_serialization=True)
    tok.save(path)
    return path


TRL_REWARD = '''
import json, os

def brevity(prompts, completions, completion_ids, **kwargs):
    """TRL's signature: every other column arrives as a keyword argument holding one value per row."""
    with open(os.environ["SPECCO_TEST_LOG"], "a") as f:
        f.write(json.dumps({"prompts": prompts, "completions": completions, "completion_ids": completion_ids,
                            "kwargs": kwargs}) + "\\n")
    return [1.0 / (1 + len(c if isinstance(c, str) else c[0]["content"])) for c in completions]
'''

VERL_REWARD = '''
import json, os

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's signature, called per row; a dict return logs its extra keys."""
    with open(os.environ["SPECCO_TEST_LOG"], "a") as f:
        f.write(json.dumps({"data_source": data_source, "solution_str": solution_str, "ground_truth": ground_truth,
                            "extra_info": extra_info}) + "\\n")
    return {"score": float(ground_truth in solution_str), "has_digit": float(any(ch.isdigit() for ch in solution_str))}
'''


def job_overrides(out: Path, steps: int = 2) -> list[str]:
    """A job small enough for two CPU cores: 2 prompts x 2 samples of <= 8 tokens, a 2-step warm start."""
    return [f"out_dir={out}", f"train.steps={steps}", "rollout.prompts_per_step=2", "rollout.group_size=2",
            "rollout.max_new_tokens=8", "train.warm_start_steps=2", "train.warm_start_prompts=2",
            "train.warm_start_batch=4", "device=cpu", "train.checkpoint_every=1", "train.save_every=1",
            "train.eval_every=1", "data.eval_size=3"]
