"""Co-training overhead on the train step: (policy + draft) step time / policy-only step time.

The policy-only step is the GRPO step of the `none` arm (policy forward, clipped surrogate,
backward, clip, AdamW). The co-training step adds the draft's K TTT passes on the same forward's
taps, its soft CE against the detached policy logits, its backward and its optimizer update
(one AdamW, two parameter groups). `--strides` trains the draft on every n-th rollout row
(`train.draft_row_stride`); `--layers` repeats the comparison for policies of several depths,
since the draft's cost is ~fixed (one layer x K passes) while the policy's grows with depth.

Batch shapes are an RL step's: `--rows` sequences of `--seq` tokens, the last `--completion`
of them completion tokens, random token ids (timings do not depend on values).

    python bench/cotrain_overhead.py --device cuda --hidden 1024 --layers 10,20,40 --rows 256 --seq 64
    python bench/cotrain_overhead.py --device cpu --hidden 96 --layers 4,16 --rows 64 --seq 32
"""
from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_results  # noqa: E402
from _timing import device_times, timeit  # noqa: E402
from specco.model.config import DraftConfig, PolicyConfig  # noqa: E402
from specco.model.draft import Eagle3Draft  # noqa: E402
from specco.model.policy import Policy  # noqa: E402
from specco.train.cotrain import AMP_DTYPES, StepConfig, TrainBatch, build_optimizer, cotrain_step  # noqa: E402


def profile_step(policy, draft, batch, opt0, opt1, cfg, dev):
    """Where the draft's share of a co-training step goes: per op, device time of the co-trained step
    minus that of the policy-only step (top 25 by difference), plus both steps' kernel and host totals
    (a launch-bound draft shows host time well above its kernels' time)."""
    kb, host0, _ = device_times(lambda: cotrain_step(policy, None, batch, opt0, None, StepConfig(draft_weight=0.0)),
                                dev)
    kc, host1, prof = device_times(lambda: cotrain_step(policy, draft, batch, opt1, None, cfg), dev)
    print(f"kernel time per step: policy-only {sum(kb.values()) / 1e3:.2f} ms, co-trained {sum(kc.values()) / 1e3:.2f} "
          f"ms; host time per step (profiled) {host0 / 1e3:.2f} vs {host1 / 1e3:.2f} ms", flush=True)
    diff = sorted(((kc.get(k, 0.0) - kb.get(k, 0.0), k) for k in set(kb) | set(kc)), reverse=True)
    print(f"{'extra us/step':>14}  {'policy-only us':>14}  op / kernel", flush=True)
    for d, k in diff[:25]:
        print(f"{d:>14.1f}  {kb.get(k, 0.0):>14.1f}  {k[:110]}", flush=True)
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=20), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=0, help="0 -> 2.75 x hidden")
    ap.add_argument("--vocab", type=int, default=64, help="the char tokenizer's size is ~40")
    ap.add_argument("--layers", default="10", help="comma-separated policy depths")
    ap.add_argument("--K", type=int, default=3, help="TTT passes")
    ap.add_argument("--strides", default="1,2,4,8")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--completion", type=int, default=48)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--tf32", action="store_true", default=True)
    ap.add_argument("--amp", default="none", help="comma-separated train precisions to compare: none (fp32 "
                    "weights, TF32 matmuls on CUDA) and/or bf16 (autocast, train.amp)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also profile the co-trained step at draft_row_stride N (prints a table)")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/cotrain_overhead_<device>.json)")
    a = ap.parse_args()
    dev = torch.device(a.device)
    if dev.type == "cuda" and a.tf32:  # as `specco train` does for fp32 policies on CUDA
        torch.set_float32_matmul_precision("high")
    torch.manual_seed(0)
    B, S = a.rows, a.seq
    tokens = torch.randint(0, a.vocab, (B, S), device=dev)
    mask = torch.zeros(B, S, device=dev)
    mask[:, S - a.completion:] = 1
    batch = TrainBatch(tokens=tokens, target_mask=mask, advantages=torch.randn(B, device=dev),
                       logp_old=-torch.rand(B, S, device=dev))
    strides = [int(x) for x in a.strides.split(",")]
    rows = []
    print(f"{'amp':>5} {'layers':>6} {'policy M':>8} {'draft M':>7} {'policy ms':>9} " +
          " ".join(f"{'x' + str(n):>7}" for n in strides) + "   (co-trained / policy-only, by draft_row_stride)")
    for L in (int(x) for x in a.layers.split(",")):
        pc = PolicyConfig(vocab_size=a.vocab, hidden_size=a.hidden, num_layers=L, num_heads=a.heads,
                          num_kv_heads=a.kv_heads, intermediate_size=a.intermediate or int(2.75 * a.hidden))
        policy = Policy(pc).to(dev).train()
        draft = Eagle3Draft(DraftConfig.for_policy(pc)).to(dev)
        opt0 = build_optimizer(policy, None, 1e-6, 1e-6)
        opt1 = build_optimizer(policy, draft, 1e-6, 1e-6)
        n_pol = sum(p.numel() for p in policy.parameters()) / 1e6
        n_dr = sum(p.numel() for p in draft.parameters()) / 1e6
        for amp in a.amp.split(","):
            amp_dtype = AMP_DTYPES[amp]
            t_pol = timeit(functools.partial(cotrain_step, policy, None, batch, opt0, None,
                                             StepConfig(draft_weight=0.0, amp_dtype=amp_dtype)), dev, a.iters)
            ratios = {}
            for n in strides:
                cfg = StepConfig(draft_weight=1.0, ttt_passes=a.K, draft_row_stride=n, amp_dtype=amp_dtype)
                t = timeit(functools.partial(cotrain_step, policy, draft, batch, opt1, None, cfg), dev, a.iters)
                ratios[n] = t / t_pol
            if a.profile:
                profile_step(policy, draft, batch, opt0, opt1, StepConfig(draft_weight=1.0, ttt_passes=a.K,
                                                                          draft_row_stride=a.profile,
                                                                          amp_dtype=amp_dtype), dev)
            print(f"{amp:>5} {L:>6} {n_pol:>8.1f} {n_dr:>7.1f} {t_pol * 1e3:>9.2f} " +
                  " ".join(f"{ratios[n]:>7.3f}" for n in strides), flush=True)
            rows.append({"layers": L, "amp": amp, "policy_params_M": n_pol, "draft_params_M": n_dr,
                         "policy_step_ms": t_pol * 1e3, "overhead_by_stride": ratios})
        del policy, draft, opt0, opt1
    write_results({"rows": B, "seq": S, "completion": a.completion, "K": a.K, "hidden": a.hidden, "results": rows},
                  "cotrain_overhead", dev, a.out)


if __name__ == "__main__":
    main()
