"""The rollout engine's tensor-parallel code path at tp = 1 against the whole-policy engine, in the same run (issue 37).

A tp group of one rank (NCCL on CUDA, gloo on CPU; this process alone) and `rollout/tp.tp_shard` of the policy: the
engine then runs every TP piece — the all-reduce after o_proj and down_proj (inside the captured CUDA graphs), the
vocabulary-parallel token choice (`pick_vocab_parallel`: the all-gather of 5 numbers per row) and the gathered logits
where a sampling rule reads them — on a group that changes nothing. Timed against the engine on the whole policy, the
two interleaved (A B A B ...; the mean of each), for the plain graphed step and the speculative round (bench/rollout.py's
synthetic `--draft self` pair, so τ is known), at each batch size and KV position. Also checks that both emit the same
greedy tokens.

    python bench/engine_tp1.py --device cuda --model 0.5b --batch-sizes 1,32 --prompt-lens 1024,8192 --out bench/results/engine_tp1_2026-12-04/engine_tp1_cuda.json
    python bench/engine_tp1.py --device cpu --model tiny --batch-sizes 1,4 --prompt-lens 64 --iters 5
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout import MODELS, _release, build, prompts_for, timed  # noqa: E402
from specco.rollout.generate import DecodeRunner, GenerateConfig  # noqa: E402
from specco.rollout.sampling import SamplingParams  # noqa: E402
from specco.rollout.tp import tp_shard  # noqa: E402


def _runner(policy, draft, args, batch, prompts, device):
    T = max(args.max_new, (args.iters * args.reps + 6) * (args.k + 1) + 2)  # rows stay live through every timed round
    cfg = GenerateConfig(max_new_tokens=T, sampling=SamplingParams(temperature=args.temperature),
                         num_draft_tokens=args.k, spec_control=False)
    run = DecodeRunner(policy, cfg, draft, torch.Generator(device).manual_seed(0))
    run.prefill(prompts)
    run.round()
    return run


def bench_point(whole, shard, draft, args, batch, device) -> dict:
    prompts = prompts_for(args, batch, draft.cfg.draft_vocab_size)
    res = {"batch": batch, "kv_position": args.prompt_len}
    for kind, d in (("plain", None), ("spec", draft)):
        runs = {"whole": _runner(whole, d, args, batch, prompts, device),
                "tp1": _runner(shard, d, args, batch, prompts, device)}
        times = {n: [] for n in runs}
        for _ in range(args.reps):
            for n, r in runs.items():
                times[n].append(timed(r.round, device, args.iters, warmup=1))
        for n in runs:
            res[f"{kind}_{n}_ms"] = sum(times[n]) / len(times[n]) * 1e3
        res[f"{kind}_tp1_over_whole"] = res[f"{kind}_tp1_ms"] / res[f"{kind}_whole_ms"]
        if kind == "spec":
            st = runs["whole"].st
            res["tau"] = int(st.n_emitted) / max(1, int(st.n_row_forwards))
        del runs
        _release(device)
    # greedy: the same tokens from both (a short generation)
    cfg = GenerateConfig(max_new_tokens=24, sampling=SamplingParams(temperature=0.0), num_draft_tokens=args.k,
                         spec_control=False)
    outs = []
    for p in (whole, shard):
        r = DecodeRunner(p, cfg, draft, torch.Generator(device).manual_seed(0))
        r.prefill(prompts)
        r.run()
        outs.append(r.result().tokens.cpu())
        del r
        _release(device)
    res["greedy_tokens_equal"] = bool(torch.equal(outs[0], outs[1]))
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--model", choices=sorted(MODELS), default="0.5b")
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--prompt-lens", default="1024,8192")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--reps", type=int, default=3, help="interleaved A/B repetitions")
    ap.add_argument("--max-new", type=int, default=0)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = args.device
    # the knobs of build() in bench/rollout.py for the synthetic agreeing pair (its module docstring)
    args.draft, args.draft_vocab, args.draft_noise, args.draft_scale, args.policy_layer_scale = "self", 32000, 0.0, 1.0, 0.0
    dtype = getattr(torch, args.dtype or ("bfloat16" if device == "cuda" else "float32"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    rows = []
    for plen in (int(x) for x in args.prompt_lens.split(",")):
        args.prompt_len = plen
        whole, draft = build(args, device, dtype)
        shard = tp_shard(whole, dist.group.WORLD)
        for b in (int(x) for x in args.batch_sizes.split(",")):
            r = bench_point(whole, shard, draft, args, b, device)
            print(json.dumps(r), flush=True)
            rows.append(r)
        del whole, shard, draft
        _release(device)
    out = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "model": args.model,
           "dtype": str(dtype), "k": args.k, "rows": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
