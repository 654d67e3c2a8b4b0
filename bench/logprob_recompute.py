"""The PPO log-prob recompute of one long RL step (configs/long.toml: 256 rows in 4 minibatches of 64, the
316M policy, fp32 weights under bf16 autocast), the old way against the new, and the train step beside it.

Old: one forward per minibatch of all its rows at the minibatch's longest width (the fourth long run logged
`time/logprob` 1.8 s per step). New (`Minibatch.logprobs`): the train step's own micro-batches, longest rows
first, each cut to its longest row. Rows: half short (a direct answer, 70 tokens), half worked (300-2,150
tokens, uniform), so the mean is ~690 and the tail is the budget, as in the run. The floor is the forward's
matmul FLOPs (2 x parameters x real tokens) at `--peak` TFLOP/s.

    python bench/logprob_recompute.py --device cuda [--rows 256 --minibatches 4 --micro 16] [--compile inductor]
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _results import write_results  # noqa: E402
from _timing import timeit  # noqa: E402

from specco.batch import TrainBatch  # noqa: E402
from specco.model.config import PolicyConfig  # noqa: E402
from specco.model.policy import Policy  # noqa: E402
from specco.runner.rollouts import Minibatch, recompute_logprobs  # noqa: E402
from specco.parallel.layout import PADDED  # noqa: E402
from specco.train.cotrain import StepConfig, cotrain_step  # noqa: E402

SHAPES = {"long316m": dict(vocab_size=101, hidden_size=1024, intermediate_size=2816, num_layers=28, num_heads=16,
                           num_kv_heads=4, max_position_embeddings=2240),
          "tiny": dict(vocab_size=101, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                       num_kv_heads=2, max_position_embeddings=2240)}


def rows_batch(n: int, prompt: int, max_len: int, vocab: int, g: torch.Generator, device) -> TrainBatch:
    worked = torch.randint(300, max_len + 1, (n,), generator=g)
    comp = torch.where(torch.arange(n) % 2 == 0, worked, torch.full((n,), 70))
    S = prompt + int(comp.max())
    tokens = torch.randint(1, vocab, (n, S), generator=g)
    mask = torch.zeros(n, S)
    for b, c in enumerate(comp.tolist()):
        mask[b, prompt:prompt + c] = 1
        tokens[b, prompt + c:] = 0
    return TrainBatch(tokens=tokens.to(device), target_mask=mask.to(device), advantages=torch.randn(n, generator=g).to(device))


def timed(fn, device, iters):
    """Median seconds per call after one warm-up (bench/_timing.py). The 2026-12-01 figures in BENCHMARKS.md
    were taken with this file's earlier helper, the mean of `iters` calls after one warm-up."""
    return timeit(fn, device, iters=iters, warmup=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", choices=sorted(SHAPES), default="long316m")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--minibatches", type=int, default=4)
    ap.add_argument("--micro", type=int, default=16, help="train.micro_batch_rows")
    ap.add_argument("--prompt", type=int, default=60)
    ap.add_argument("--max-len", type=int, default=2150)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--peak", type=float, default=790.0, help="bf16 matmul TFLOP/s of the device (the floor)")
    ap.add_argument("--no-train", action="store_true", help="skip timing the train step")
    ap.add_argument("--compile", default="none", help="then the same with train.compile=BACKEND (inductor): "
                    "its first call (the compiles) is timed apart")
    ap.add_argument("--profile", action="store_true", help="print the top kernels of one new recompute and train step")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device(a.device)
    torch.set_float32_matmul_precision("high")  # as the GPU runs (runner/demo.py)
    torch.manual_seed(0)
    policy = Policy(PolicyConfig(**SHAPES[a.model])).to(dev)
    g = torch.Generator().manual_seed(0)
    n = a.rows // a.minibatches
    mbs = [rows_batch(n, a.prompt, a.max_len, policy.cfg.vocab_size, g, dev) for _ in range(a.minibatches)]
    cfg = dataclasses.replace(StepConfig(), micro_batch_rows=a.micro, amp_dtype=torch.bfloat16 if dev.type == "cuda"
                              else None)
    real = sum(int(b.target_mask.sum()) + a.prompt * n for b in mbs)
    padded = sum(b.tokens.numel() for b in mbs)
    params = sum(p.numel() for p in policy.parameters())
    res = {"model": a.model, "rows": a.rows, "minibatches": a.minibatches, "micro_batch_rows": a.micro,
           "real_tokens": real, "padded_tokens_old": padded, "params": params}
    with torch.no_grad():
        res["old_s"] = timed(lambda: [recompute_logprobs(policy, b.tokens, cfg) for b in mbs], dev, a.iters)
        res["new_s"] = timed(lambda: [Minibatch(b, PADDED, list(range(n))).logprobs(policy, cfg) for b in mbs], dev,
                             a.iters)
    res["floor_s"] = 2 * params * real / (a.peak * 1e12)
    if not a.no_train:  # fwd + bwd + AdamW of the policy, no draft (lr 0: the weights stay as they are)
        opt = torch.optim.AdamW(policy.parameters(), lr=0.0)
        for b in mbs:
            b.logp_old = Minibatch(b, PADDED, list(range(n))).logprobs(policy, cfg)
        res["train_s"] = timed(lambda: [cotrain_step(policy, None, b, opt, None, cfg) for b in mbs], dev, a.iters)
        res["train_floor_s"] = 3 * res["floor_s"]
    if a.compile != "none":
        from specco.train.compile import apply_compile
        apply_compile(policy, a.compile)
        t0 = time.perf_counter()
        with torch.no_grad():
            for b in mbs:
                Minibatch(b, PADDED, list(range(n))).logprobs(policy, cfg)
        if not a.no_train:
            for b in mbs:
                cotrain_step(policy, None, b, opt, None, cfg)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        res["compile_first_calls_s"] = time.perf_counter() - t0
        with torch.no_grad():
            res["compiled_new_s"] = timed(lambda: [Minibatch(b, PADDED, list(range(n))).logprobs(policy, cfg) for b in mbs],
                                          dev, a.iters)
        if not a.no_train:
            res["compiled_train_s"] = timed(lambda: [cotrain_step(policy, None, b, opt, None, cfg) for b in mbs], dev,
                                            a.iters)
        print(f"compiled ({a.compile}): first calls {res['compile_first_calls_s']:.1f} s; recompute "
              f"{res['compiled_new_s']:.3f} s" + ("" if a.no_train else f", train step {res['compiled_train_s']:.3f} s"))
    if a.profile:
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        for name, fn in (("recompute", lambda: Minibatch(mbs[0], PADDED, list(range(n))).logprobs(policy, cfg)),
                         ("train", None if a.no_train else lambda: cotrain_step(policy, None, mbs[0], opt, None, cfg))):
            if fn is None:
                continue
            with profile(activities=acts) as prof:
                fn()
                if dev.type == "cuda":
                    torch.cuda.synchronize()
            key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
            print(f"--- {name}, one minibatch ---")
            print(prof.key_averages().table(sort_by=key, row_limit=14, max_name_column_width=60))
    print(f"{a.rows} rows, {real} real of {padded} padded tokens: recompute old {res['old_s']:.3f} s, new "
          f"{res['new_s']:.3f} s ({res['old_s'] / res['new_s']:.2f}x), matmul floor {res['floor_s']:.3f} s"
          + ("" if a.no_train else f"; train step {res['train_s']:.3f} s (floor {res['train_floor_s']:.3f} s)"))
    write_results(res, f"logprob_recompute_{a.model}", dev, a.out)


if __name__ == "__main__":
    main()
