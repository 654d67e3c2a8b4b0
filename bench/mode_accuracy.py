"""The SFT policy's accuracy per answer mode, before any RL (issue 36's calibration): for a from-scratch policy on
the char-model arithmetic formats (data.format cot / rewrite), how often it works the chain and how accurate each
mode is, greedy and at the rollout temperature.

Why: configs/drift.toml assumed the worked lines were the accurate mode, so that RL would move the policy to them.
They were not (H200, 2026-12-04: greedy 0.42 with 4-token guesses; RL then had no large lesson), which one call of
this script would have shown before 25 device minutes of RL. Modes, one completion per prompt each:

    free     the policy's own choice (the rollouts RL starts from); `worked_fraction` = completions that work
    direct   the completion forced to start with '>' (the direct answer's first token)
    worked   forced to start with the first character of the prompt's worked reference (data/procedural.py)

The forced prefix is appended to the prompt and counted as the completion's first token for scoring. The policy
comes from `--work`'s start_policy (made there by the config's SFT stage when missing, exactly as `specco train`
makes it; the run's own out_dir is not touched).

    python bench/mode_accuracy.py configs/drift.toml [key=value ...] [--prompts 256] [--work DIR]

JSON to --out (by default into bench/results/, named mode_accuracy_<device>.json).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specco.config_load import load_config  # noqa: E402
from specco.data.procedural import tiny_completion  # noqa: E402
from specco.rollout.engine import RolloutEngine  # noqa: E402
from specco.runner.derive import at_temperature, generate_config, on_device  # noqa: E402
from specco.runner.prepare import prepare_policy  # noqa: E402
from specco.runner.setup import pick_device  # noqa: E402
from specco.runner.validate import check_job  # noqa: E402

FORMATS = ("cot", "rewrite")


def mode_prefixes(examples, fmt: str, max_terms: int | None) -> dict[str, list[str]]:
    """{mode: the forced first character of each example's completion} (free: none)."""
    worked = [tiny_completion(e.columns, fmt, max_terms, steps=True)[1][0] for e in examples]
    return {"free": [""] * len(examples), "direct": [">"] * len(examples), "worked": worked}


@torch.no_grad()
def measure(cfg, policy, tok, data, n_prompts: int, seed: int = 0) -> dict:
    """Per mode and temperature: accuracy, mean reward, completion length (prefix included), worked fraction."""
    if cfg.data.format not in FORMATS:
        raise SystemExit(f"data.format={cfg.data.format!r}: answer modes exist only for {FORMATS}")
    examples = data.train.examples(n_prompts, seed=seed + 777)
    prefixes = mode_prefixes(examples, cfg.data.format, cfg.data.options.get("max_terms"))
    dev = next(policy.parameters()).device
    gcfg0 = generate_config(cfg, tok.stop_ids, tok.pad_id)
    out = {}
    for mode, pre in prefixes.items():
        prompts = [e.prompt_ids + tok.encode(p) for e, p in zip(examples, pre)]
        for name, temp in (("greedy", 0.0), ("sampled", cfg.rollout.temperature)):
            with RolloutEngine(policy, None, at_temperature(gcfg0, temp)) as engine:
                res = engine.generate(prompts, generator=torch.Generator(device=dev).manual_seed(seed))
            comps = [tok.encode(p) + res.tokens[i, :int(res.lengths[i])].tolist() for i, p in enumerate(pre)]
            texts = [tok.decode(c) for c in comps]
            scored = data.rewards([e.prompt for e in examples], texts, comps, [e.columns for e in examples])
            v = scored.valid
            out[f"{mode}/{name}"] = {
                "accuracy": scored.full_marks[v].float().mean().item(),
                "reward": scored.rewards[v].mean().item(),
                "completion_len": sum(map(len, comps)) / len(comps),
                "worked_fraction": sum(not t.startswith(">") for t in texts) / len(texts)}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides (as specco train takes them)")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--work", type=Path, default=Path("/tmp/mode_accuracy"), help="where the SFT policy is kept")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    cfg = load_config(args.config, [*args.overrides, f"out_dir={args.work}"])
    device = pick_device(cfg.device)
    cfg = on_device(cfg, device)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # as the run decodes (runner/pipeline.py)
    data = check_job(cfg)
    t0 = time.perf_counter()
    policy, tok, sft_m = prepare_policy(cfg, data, args.work, device, progress=True)
    sft_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    res = measure(cfg, policy, tok, data, args.prompts, seed=cfg.train.seed)
    rows = [f"| {k} | {v['accuracy']:.3f} | {v['reward']:.3f} | {v['completion_len']:.1f} | {v['worked_fraction']:.2f} |"
            for k, v in res.items()]
    print("| mode / decoding | accuracy | reward | completion len | worked fraction |\n|---|---|---|---|---|")
    print("\n".join(rows))
    dest = args.out or Path(__file__).parent / "results" / f"mode_accuracy_{device.type}.json"
    dest.write_text(json.dumps({"config": args.config, "overrides": args.overrides, "prompts": args.prompts,
                                "sft": sft_m, "sft_or_load_s": sft_s, "measure_s": time.perf_counter() - t0,
                                "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                                "modes": res}, indent=1))
    print(dest)


if __name__ == "__main__":
    main()
