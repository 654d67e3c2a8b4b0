"""The co-training step on an RL batch of ragged rows: what the draft adds when every step brings new shapes.

`bench/cotrain_overhead.py` times one fixed shape again and again. A real RL step is not like that: rows
are long-tailed (a direct answer of 10 tokens beside a worked one of 2,000), the step cuts them into
length-sorted micro-batches (`train.micro_batch_rows`), each micro-batch is cut to its own longest row,
and every step brings new lengths. A kernel that plans per shape pays its planning on every new one.

Each timed step here draws a fresh batch of `--rows` rows with the long workload's length mix
(`configs/long.toml`: prompts of 40-66 tokens; half the completions direct answers of 5-12 tokens, half
worked ones of 300-2,083), so the shapes keep changing as in a run, and reports wall-clock seconds per
step (host clock after a device synchronize: planning is host time) for:

    policy   the `none` arm's step (no draft)
    auto     co-trained EAGLE-3 draft, the TTT trunk kernel by its default (ops/attention.ttt_trunk_impl:
             FlashAttention-2 on CUDA since 2026-12-01; the adapter's pick, cuDNN, before: the results of
             2026-12-01 in bench/results/cotrain_ragged_cuda.json are of that)
    cudnn    the trunk forced to cuDNN (plans per shape)
    flash    the trunk forced to FlashAttention-2 (no per-shape plans)
    w<N>     cuDNN, micro-batch widths rounded up to a multiple of N (`train.width_multiple`)
    policy_w<N>, auto_w<N>, ...  any of the above with widths rounded up to a multiple of N: the long
             configs' train step is auto_w128, its no-draft step policy_w128

`--reserve-gib` holds device memory for the whole run, as the rollout engine's caches do in `specco train`.

`--paired` (exactly two variants, e.g. `policy_w128,auto_w128`) runs both on the *same* fresh batch every step, the order
alternating (even steps the first variant first): what the draft adds to a train step on the very same rows,
which an RL run can only bound (docs/experiments/long_workload.md: the draft's timed span misses part of it,
and a pass run first pays the step's first-pass costs). It reports each variant's mean, its mean when run first
and when run second, the draft's timed span (`time/train_draft`), and co-trained − policy − span: the draft's
cost outside its span; on CUDA also each pass's cudaMalloc calls and allocator retries (first and second), which
say whether a first-pass cost is the caching allocator's, and the first pass's mean over steps that brought a
micro-batch shape no earlier pass ran against steps that did not (per-shape plans). `--policy-sdpa` pins the
policy attention's SDPA backend; `--fixed-lengths` gives every step the same row lengths (so no new shapes after
step 0), `--batch-multiple N` pads every batch's width to a multiple of N as the RL loop does (so with N = the
variants' width multiple no micro-batch keeps a row's exact length), and `--profile DIR` runs two more (untimed) steps with every pass profiled: each variant run first and second. `--loss-chunk N` sets train.loss_chunk (the draft loss's checkpointed sequence chunk; its per-step `draft_loss` is
reported, so two chunk sizes can be checked to train the same loss). `--compile inductor` compiles the policy's layers as
`train.compile` does, `--compile-draft` the draft's layer as `train.compile_draft`. Run it again under `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` to compare.

    python bench/cotrain_ragged.py --device cuda --steps 6
    python bench/cotrain_ragged.py --device cuda --paired --variants policy_w128,auto_w128 --stride 8 --steps 8 \
        --compile inductor --reserve-gib 40
    python bench/cotrain_ragged.py --device cpu --hidden 64 --layers 2 --rows 32 --max-len 300 --variants policy,auto
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_results  # noqa: E402
from specco.model.config import DraftConfig, PolicyConfig  # noqa: E402
from specco.model.draft import Eagle3Draft  # noqa: E402
from specco.model.policy import Policy  # noqa: E402
from specco.ops.attention import ttt_attention  # noqa: E402
from specco.parallel.layout import PaddedRows  # noqa: E402
from specco.train.compile import apply_compile, apply_draft_compile, warm_up, warm_up_draft  # noqa: E402
from specco.batch import round_up  # noqa: E402
from specco.train.cotrain import (AMP_DTYPES, StepConfig, TrainBatch, build_optimizer, cotrain_step,  # noqa: E402
                                  micro_batch_cuts)


def ragged_batch(rows: int, max_len: int, vocab: int, seed: int, device, length_seed: int | None = None,
                 multiple: int = 1) -> TrainBatch:
    """`rows` right-padded rows with the long workload's length mix (module docstring), random tokens
    (`length_seed`: the lengths from that seed instead, so batches of one length_seed have one shape); the
    width padded up to a multiple of `multiple`, as the RL loop's batches are (runner/rollouts.build_batch)."""
    g = torch.Generator().manual_seed(seed if length_seed is None else length_seed)
    prompt = torch.randint(40, 67, (rows,), generator=g)
    worked = torch.rand(rows, generator=g) < 0.5
    scale = max_len / 2150  # the workload's lengths, scaled to --max-len
    short = torch.randint(5, 13, (rows,), generator=g)
    long_ = torch.randint(int(300 * scale) + 1, int(2083 * scale) + 2, (rows,), generator=g)
    comp = torch.where(worked, long_, short)
    lengths = (prompt + comp).clamp(max=max_len)
    S = round_up(int(lengths.max()), multiple)
    if length_seed is not None:
        g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (rows, S), generator=g)
    col = torch.arange(S)
    mask = ((col[None] >= prompt[:, None]) & (col[None] < lengths[:, None])).float()
    return TrainBatch(tokens=tokens.to(device), target_mask=mask.to(device),
                      advantages=torch.randn(rows, generator=g).to(device),
                      logp_old=-torch.rand(rows, S, generator=g).to(device))


def variant_step(name: str, a, policy, draft, opts, amp):
    """The train step of one variant (module docstring) as a function of the batch."""
    base, _, wpart = name.rpartition("_w") if "_w" in name else (name, "", "")
    if base.startswith("w"):  # bare w<N>: the cuDNN trunk, as before policy_w<N> / auto_w<N> existed
        base, wpart = "cudnn", base[1:]
    if base not in ("policy", "auto", "cudnn", "flash") or not (wpart == "" or wpart.isdigit()):
        raise SystemExit(f"unknown variant {name!r}: policy, auto, cudnn, flash, w<N>, or one of the first four "
                         "with _w<N> (e.g. policy_w128, auto_w128)")
    use_draft = base != "policy"
    width = int(wpart) if wpart else 1
    cfg = StepConfig(draft_weight=1.0 if use_draft else 0.0, draft_row_stride=a.stride,
                     micro_batch_rows=a.micro_batch_rows, width_multiple=width, amp_dtype=amp, loss_chunk=a.loss_chunk)
    impl = base if base in ("flash", "cudnn") else None
    attn = functools.partial(ttt_attention, impl=impl) if impl else ttt_attention
    return functools.partial(cotrain_step, policy, draft if use_draft else None, opt=opts[use_draft], sched=None,
                             cfg=cfg, layout=PaddedRows(attn))


def profiler(dev):
    """torch.profiler over one pass (host and, on CUDA, device activity)."""
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    return torch.profiler.profile(activities=acts)


def write_profile(prof, dev, path: Path) -> None:
    """The pass's ops by self device time and by self host time (top 30 each) to `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    ka = prof.key_averages()
    keys = (["self_cuda_time_total"] if dev.type == "cuda" else []) + ["self_cpu_time_total"]
    path.write_text("\n\n".join(f"sorted by {k}\n" + ka.table(sort_by=k, row_limit=30) for k in keys))
    print(f"wrote {path}", flush=True)


def alloc_counts(dev) -> tuple[int, int]:
    """(cudaMalloc calls, allocator retries after a failed cudaMalloc) so far on `dev`; zeros off CUDA."""
    if dev.type != "cuda":
        return 0, 0
    st = torch.cuda.memory_stats(dev)
    return st.get("num_device_alloc", 0), st.get("num_alloc_retries", 0)


def paired(a, steps: dict, dev) -> dict:
    """`--paired`: both variants on one fresh batch per step, the order alternating; step 0 is a warm-up."""
    if len(steps) != 2:
        raise SystemExit(f"--paired needs exactly two variants, got {list(steps)} (e.g. --variants policy_w128,auto_w128)")
    names = list(steps)
    rec = {n: {"s": [], "first": [], "second": [], "span": [], "mallocs": ([], []), "retries": ([], []),
               "first_new": [], "first_seen": [], "loss": []} for n in names}
    seen: set = set()  # the (rows, width) micro-batch shapes any earlier pass ran
    for i in range(a.steps + 1 + (2 if a.profile else 0)):  # two more, profiled (untimed): each variant first and second
        profiled = i > a.steps
        b = ragged_batch(a.rows, a.max_len, a.vocab, seed=7000 + i, device=dev,
                         length_seed=7000 if a.fixed_lengths else None, multiple=a.batch_multiple)
        order = names if i % 2 == 0 else names[::-1]
        cuts = micro_batch_cuts(b, a.micro_batch_rows, steps[order[0]].keywords["cfg"].width_multiple)
        shapes = {(len(idx), w) for idx, w in cuts} if cuts else {tuple(b.tokens.shape)}  # None: one micro-batch
        new = bool(shapes - seen)
        seen |= shapes
        for pos, name in enumerate(order):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            a0 = alloc_counts(dev)
            prof = profiler(dev) if profiled else contextlib.nullcontext()
            t = time.perf_counter()
            with prof:
                m = steps[name](batch=b)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
            if profiled:
                write_profile(prof, dev, Path(a.profile) / f"{['first', 'second'][pos]}_{name}.txt")
            elif i:
                dt = time.perf_counter() - t
                for key, n0, n1 in zip(("mallocs", "retries"), a0, alloc_counts(dev)):
                    rec[name][key][pos].append(n1 - n0)
                rec[name]["s"].append(dt)
                rec[name]["second" if pos else "first"].append(dt)
                if not pos:
                    rec[name]["first_new" if new else "first_seen"].append(dt)
                rec[name]["span"].append(m.get("time/train_draft", 0.0))
                rec[name]["loss"].append(m.get("draft/loss", 0.0))
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    out = {n: {"step_s": r["s"], "mean_s": mean(r["s"]), "mean_first_s": mean(r["first"]),
               "mean_second_s": mean(r["second"]), "draft_span_s": mean(r["span"]),
               "mean_first_new_shapes_s": mean(r["first_new"]), "n_first_new_shapes": len(r["first_new"]),
               "mean_first_seen_shapes_s": mean(r["first_seen"]), "n_first_seen_shapes": len(r["first_seen"]),
               "mallocs_first": mean(r["mallocs"][0]), "mallocs_second": mean(r["mallocs"][1]),
               "alloc_retries_first": mean(r["retries"][0]), "alloc_retries_second": mean(r["retries"][1]),
               "draft_loss": r["loss"]}
           for n, r in rec.items()}
    plain, co = names
    out["draft_outside_span_s"] = out[co]["mean_s"] - out[plain]["mean_s"] - out[co]["draft_span_s"]
    for n in names:
        r = out[n]
        print(f"{n:>7}: mean {r['mean_s']:.3f} s  run first {r['mean_first_s']:.3f}  run second "
              f"{r['mean_second_s']:.3f}  draft span {r['draft_span_s']:.3f}  cudaMallocs first/second "
              f"{r['mallocs_first']:.1f}/{r['mallocs_second']:.1f}  retries {r['alloc_retries_first']:.1f}/"
              f"{r['alloc_retries_second']:.1f}", flush=True)
        print(f"{'':>7}  run first with a new micro-batch shape {r['mean_first_new_shapes_s']:.3f} "
              f"({r['n_first_new_shapes']} steps), with only shapes seen before {r['mean_first_seen_shapes_s']:.3f} "
              f"({r['n_first_seen_shapes']})", flush=True)
    print(f"the draft's cost outside its timed span: {out['draft_outside_span_s']:.3f} s/step", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--vocab", type=int, default=101)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=2216)
    ap.add_argument("--micro-batch-rows", type=int, default=16)
    ap.add_argument("--stride", type=int, default=4, help="train.draft_row_stride")
    ap.add_argument("--amp", default="bf16")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per variant, each on a fresh batch")
    ap.add_argument("--variants", default="policy,auto,cudnn,flash,w64,w128")
    ap.add_argument("--reserve-gib", type=float, default=0.0,
                    help="hold this much device memory for the whole run (what the rollout engine's KV caches and "
                         "CUDA graphs hold in `specco train`): the step then runs under the run's memory pressure")
    ap.add_argument("--paired", action="store_true", help="two variants on the same batch each step, order alternating")
    ap.add_argument("--compile", default="none", help="train.compile for the policy's layers (none, inductor)")
    ap.add_argument("--policy-sdpa", default="default", choices=("default", "flash", "cudnn", "efficient"),
                    help="the only SDPA backend the policy's attention may use (default: torch's choice)")
    ap.add_argument("--compile-draft", action="store_true", help="train.compile_draft: the draft's layer work too")
    ap.add_argument("--fixed-lengths", action="store_true",
                    help="every step's batch has the same row lengths (fresh tokens): no new micro-batch shapes")
    ap.add_argument("--profile", default=None, help="--paired: two more steps after the timed ones, each pass profiled into this folder")
    ap.add_argument("--loss-chunk", type=int, default=StepConfig.loss_chunk,
                    help="train.loss_chunk: the draft loss's sequence chunk (each one checkpointed; at a small "
                         "vocabulary one chunk of the whole width is the same math in fewer ops)")
    ap.add_argument("--batch-multiple", type=int, default=1,
                    help="pad each batch's width to a multiple of N, as the RL loop does since 2026-12-03 with N = "
                         "train.width_multiple (1: the batch as wide as its longest row, so the micro-batch holding "
                         "that row keeps its exact length, a new shape every step)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device(a.device)
    if dev.type == "cuda":
        torch.set_float32_matmul_precision("high")
    if a.policy_sdpa != "default":  # global flags, set before compiling: the compiled graph picks its kernel
        for name in ("flash", "cudnn", "mem_efficient", "math"):
            getattr(torch.backends.cuda, f"enable_{name}_sdp")(name == a.policy_sdpa.replace("efficient", "mem_efficient"))
    torch.manual_seed(0)
    reserve = torch.empty(int(a.reserve_gib * 2 ** 30), dtype=torch.uint8, device=dev) if a.reserve_gib else None
    pc = PolicyConfig(vocab_size=a.vocab, hidden_size=a.hidden, num_layers=a.layers, num_heads=a.heads,
                      num_kv_heads=a.kv_heads, intermediate_size=a.intermediate,
                      max_position_embeddings=a.max_len)
    policy = Policy(pc).to(dev).train()
    if a.compile != "none":
        print(f"compiled ({a.compile}) in {warm_up(apply_compile(policy, a.compile), AMP_DTYPES[a.amp]):.0f} s", flush=True)
    draft = Eagle3Draft(DraftConfig.for_policy(pc)).to(dev)
    if a.compile_draft:
        if a.compile == "none":
            raise SystemExit("--compile-draft compiles with --compile's backend: give --compile inductor")
        print(f"draft compiled in {warm_up_draft(apply_draft_compile(draft, a.compile), AMP_DTYPES[a.amp], 3):.0f} s",
              flush=True)
    opts = {False: build_optimizer(policy, None, 1e-7, 1e-7), True: build_optimizer(policy, draft, 1e-7, 1e-7)}
    amp = AMP_DTYPES[a.amp]
    results = {}
    steps = {name: variant_step(name, a, policy, draft, opts, amp) for name in a.variants.split(",")}
    if a.paired:
        results = paired(a, steps, dev)
    for vi, (name, step) in enumerate(() if a.paired else steps.items()):
        times, tokens = [], []
        for i in range(a.steps + 1):  # step 0: warm-up (kernel compiles, allocator growth); not reported
            # every variant its own fresh shapes (seeds disjoint across variants): plan caches cannot carry over
            b = ragged_batch(a.rows, a.max_len, a.vocab, seed=1000 * (vi + 1) + i, device=dev, multiple=a.batch_multiple)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            step(batch=b)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - t)
                tokens.append(int(b.target_mask.sum()))
        results[name] = {"step_s": times, "mean_s": sum(times) / len(times), "trained_tokens": tokens}
        print(f"{name:>7}: mean {results[name]['mean_s']:.3f} s/step  steps " +
              " ".join(f"{x:.3f}" for x in times), flush=True)
    base = results.get("policy", {}).get("mean_s")
    if base:
        for name, r in results.items():
            if not isinstance(r, dict):
                continue
            r["vs_policy"] = r["mean_s"] / base
        print("  vs policy-only: " + ", ".join(f"{k} {r['vs_policy']:.3f}" for k, r in results.items()
                                                 if isinstance(r, dict)), flush=True)
    if dev.type == "cuda":
        st = torch.cuda.memory_stats(dev)
        print(f"peak allocated {torch.cuda.max_memory_allocated(dev) / 2 ** 30:.1f} GiB, cudaMalloc retries "
              f"{st.get('num_alloc_retries', 0)}", flush=True)
    del reserve
    write_results({"args": vars(a), "results": results}, "cotrain_ragged", dev, a.out)


if __name__ == "__main__":
    main()
