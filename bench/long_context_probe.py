"""Where a long-context run's time goes, at configs/long_context.toml's shapes (random weights): the draft warm
start's pool sampling (engine.generate on the trainer's own fp32 policy, as runner/warmstart.sample_pool calls it)
against a bf16 engine copy, split into prefill and per-step cost, and one SFT step's forward + backward.

    python bench/long_context_probe.py [--rows 64] [--context 32000] [--new 8,136] [--out FILE]

Random weights never emit <eos>, so every row decodes `new` tokens: (t(new2) - t(new1)) / (new2 - new1) is the
decode step, t(new1) mostly the prefill."""
from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from _results import write_results
from specco.config_load import load_config
from specco.data.source import load_data
from specco.data.tokenizer import build_char_tokenizer
from specco.model.policy import Policy
from specco.rollout.engine import RolloutEngine
from specco.runner.derive import generate_config
from specco.train.sft import sft_batch, sft_loss, tiny_policy_config


def _timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/long_context.toml")
    ap.add_argument("--rows", type=int, default=64, help="prompts x 4 samples, as sample_pool")
    ap.add_argument("--context", type=int, default=32000)
    ap.add_argument("--new", default="8,136")
    ap.add_argument("--sft-rows", type=int, default=4)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_float32_matmul_precision("high")
    dev = torch.device("cuda")
    new1, new2 = (int(x) for x in a.new.split(","))
    cfg = load_config(a.config, [f"data.context_tokens=[{a.context},{a.context}]", f"rollout.max_new_tokens={new2}"])
    tok = build_char_tokenizer()
    train, _, _ = load_data(cfg.data, tok)
    pc = cfg.policy
    policy = Policy(tiny_policy_config(tok, pc.hidden_size, pc.num_layers, pc.num_heads, pc.num_kv_heads,
                                       pc.intermediate_size, pc.max_positions, pc.rope_theta)).to(dev)
    prompts = [e.prompt_ids for e in train.examples(a.rows // 4, seed=0)]
    res = {"rows": a.rows, "context": a.context, "shape": vars(pc)}
    for name, model in (("fp32", policy), ("bf16", None)):
        if model is None:
            model = Policy(policy.cfg).to(dev, torch.bfloat16)
        for n in (new1, new2):
            g = dataclasses.replace(generate_config(cfg, tok.stop_ids, tok.pad_id), max_new_tokens=n)
            eng = RolloutEngine(model, None, g)
            eng.generate(prompts, group_size=4, generator=torch.Generator(dev).manual_seed(0))  # capture, compile
            t = _timed(lambda: eng.generate(prompts, group_size=4, generator=torch.Generator(dev).manual_seed(0)))
            res[f"{name}_generate_{n}_s"] = t
            print(f"{name} generate {a.rows} rows x {n} new at {a.context}: {t:.3f} s", flush=True)
            eng = None
            torch.cuda.empty_cache()
        res[f"{name}_step_ms"] = 1e3 * (res[f"{name}_generate_{new2}_s"] - res[f"{name}_generate_{new1}_s"]) / (new2 - new1)
        print(f"{name} decode step {res[f'{name}_step_ms']:.2f} ms", flush=True)
    ex = train.examples(a.sft_rows, seed=1)
    ids, mask = sft_batch(ex, tok, device=dev)
    def step():
        with torch.autocast("cuda", torch.bfloat16):
            loss = sft_loss(policy, ids, mask)
        loss.backward()
    step()
    res["sft_micro_batch_s"] = min(_timed(step) for _ in range(3))
    res["sft_micro_batch_tokens"] = int(ids.numel())
    print(f"SFT forward+backward, {a.sft_rows} rows x {ids.shape[1]}: {res['sft_micro_batch_s']:.3f} s", flush=True)
    write_results(res, "long_context_probe", dev, a.out)


if __name__ == "__main__":
    main()
