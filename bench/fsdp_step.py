"""FSDP's cost on one GPU, and the memory planner against measured peaks (issue 34).

One process (a world of one), one bf16 co-training step of a policy + EAGLE-3 draft with random weights, in the
two ways a run can hold the policy:

    plain   fp32 master weights whole, bf16 autocast (train.amp=bf16, what a one-GPU run does)
    fsdp1   the same policy under FSDP2 on a 1-rank mesh (parallel/fsdp.apply_fsdp with
            MixedPrecisionPolicy(bf16 params, fp32 reductions), the grad-sync strategies of train/grad_sync.py):
            what every rank of a dp_shard run executes, less the collectives' transfer time

The overhead of FSDP's machinery (its pre/post hooks, the per-unit bf16 casts of the all-gather path, the
reduce-scatter bookkeeping) is fsdp1 / plain - 1. Each variant runs in its own process (a fresh CUDA context: FSDP's
state once held ~11 GiB past its variant's end in one process and inflated the next peak), timed
over --reps steps after --warmup (median, CUDA events), and measured for peak memory (max_memory_allocated over one
step, everything the trainer holds included). The order is plain, fsdp1, plain again: the two plain medians
bound the machine's drift.

The planner (specco/plan.py rank_memory, trainer components: params, compute copy, grads, AdamW, activations,
draft) is printed beside each measured peak, for the layout the variant is (fsdp False / True at shard 1).

Under torchrun at world N (issue 39) each rank runs one variant, fsdpN: the policy FSDP-sharded over the N ranks
(dp_shard N, FSDP2 with the same mixed precision and grad syncs; built as make_arm builds a sharded copy,
parallel/load.sharded_policy, random weights drawn straight into each rank's shards: no whole copy on any GPU or
host), the step's --rows split over them (rows / N each, every rank its own rows: a global batch of --rows, so the
N-rank step is comparable with the world-1 ones above), the collectives' transfer time now inside the step.
Reported per rank (a step ends on the slowest rank: the max of the ranks' medians is the step time) with the
planner at Layout(dp_shard N, fsdp) beside the largest peak. One size per launch (a fresh CUDA context per size,
as the variants above); the 7b shape needs N >= 2 (16 B a parameter of fp32 masters, grads and AdamW: 122 GB
before activations).

    python bench/fsdp_step.py --device cuda --sizes 1.5b,3b          # the H200 run (BENCHMARKS.md)
    python bench/fsdp_step.py --device cpu --sizes tiny --reps 2     # a smoke on CPU
    torchrun --nproc-per-node 4 bench/fsdp_step.py --device cuda --sizes 3b --out $OUT/fsdp_step_w4_3b.json
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_results  # noqa: E402
from specco.model.config import DraftConfig, PolicyConfig  # noqa: E402
from specco.model.draft import Eagle3Draft  # noqa: E402
from specco.model.policy import Policy  # noqa: E402
from specco.parallel.fsdp import apply_fsdp, mixed_precision  # noqa: E402
from specco.train.compile import COMPILE_BACKENDS, apply_compile, warm_up  # noqa: E402
from specco.plan import Layout, Shapes, rank_memory  # noqa: E402
from specco.train.cotrain import StepConfig, TrainBatch, build_optimizer, cotrain_step  # noqa: E402
from specco.train.grad_sync import grad_syncs  # noqa: E402

# Published shapes (Hugging Face config.json): Qwen2.5-1.5B and -3B (1.54 B / 3.09 B parameters, tied embeddings)
SIZES = {
    "1.5b": PolicyConfig(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12,
                         num_kv_heads=2, attention_bias=True, tie_word_embeddings=True, model_type="qwen2"),
    "3b": PolicyConfig(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_layers=36, num_heads=16,
                       num_kv_heads=2, attention_bias=True, tie_word_embeddings=True, model_type="qwen2"),
    # Qwen2.5-7B (7.62 B, untied head)
    "7b": PolicyConfig(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
                       num_kv_heads=4, attention_bias=True, tie_word_embeddings=False, model_type="qwen2"),
    "tiny": PolicyConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                         num_kv_heads=2, tie_word_embeddings=True, model_type="qwen2"),
}
GiB = 2 ** 30


def _batch(pc: PolicyConfig, rows: int, seq: int, completion: int, dev, seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows, seq)
    mask[:, seq - completion:] = 1
    return TrainBatch(tokens=torch.randint(0, pc.vocab_size, (rows, seq), generator=g).to(dev),
                      target_mask=mask.to(dev), advantages=torch.randn(rows, generator=g).to(dev),
                      logp_old=(-torch.rand(rows, seq, generator=g) * 4 - 2).to(dev))


def _planned(pc: PolicyConfig, dcfg: DraftConfig, scfg: StepConfig, rows: int, seq: int, fsdp: bool,
             shard: int = 1, ep: int = 1) -> dict:
    """The planner's trainer memory of one rank; `rows` the step's rows over all `shard` ranks (plan.Shapes)."""
    s = Shapes(policy=pc, draft_kind="eagle3", draft_vocab=dcfg.draft_vocab_size, draft_layers=1,
               num_taps=len(dcfg.aux_layer_ids), seq=seq, rows_per_step=rows, minibatches=1,
               micro_batch_rows=scfg.micro_batch_rows, draft_row_stride=scfg.draft_row_stride,
               ttt_passes=scfg.ttt_passes, gamma=4, num_anchors=16, loss_chunk=scfg.loss_chunk, compute_bytes=2,
               engine_bytes=2, compact_below=0.0)
    m = rank_memory(s, Layout(1, 1, shard, 1, fsdp=fsdp, ac=False, ep=ep))
    m["trainer"] = sum(m[k] for k in ("params", "compute", "grads", "adamw", "acts", "draft"))
    return m


def random_sharded(pc: PolicyConfig, mesh, dev, prepare=None):
    """A `shard(base)` for `_variant`: the trainer's FSDP copy (bf16 gathers, fp32 reductions) of a random policy of
    `pc` built straight into each rank's shards (parallel/load.sharded_policy, as make_arm builds a sharded copy;
    `prepare` on the meta model first: ep_step's apply_ep). No whole copy exists on any rank or host, so a 7-30 B
    policy costs each rank only its shards; the weights differ from `base`'s (a timing bench: any N(0, 0.02)
    values do, norms at 1 as at init) and from rank to rank's fill (each rank draws its own rows)."""
    from specco.parallel.load import sharded_policy

    @torch.no_grad()
    def fill(model, rows_of):
        for name, p in model.named_parameters():
            local = rows_of(p)[0]
            if local.numel() == 0:
                continue
            if name.endswith("norm.weight"):
                local.fill_(1.0)
            elif name.endswith(".bias"):
                local.zero_()
            else:
                local.normal_(0.0, 0.02)
    return lambda base: sharded_policy(pc, mesh, dev, fill, torch.float32, mp_policy=mixed_precision(torch.bfloat16),
                                       prepare=prepare)


def _variant(name: str, base: Policy, draft: Eagle3Draft, batch: TrainBatch, scfg: StepConfig, args, mesh,
             shard=None) -> dict:
    """One variant's timed steps and peak. `shard(base) -> policy`: the caller's own sharded trainer copy
    (bench/ep_step.py: experts placed, then FSDP); otherwise a copy of `base`, FSDP-applied for the fsdp* ones."""
    dev = batch.tokens.device
    d = copy.deepcopy(draft).to(dev).train()
    sync = None
    if shard is not None:
        policy = shard(base).train()
        sync = grad_syncs(policy, None)
    else:
        policy = copy.deepcopy(base).to(dev).train()  # base stays on the host
    if shard is None and name.startswith("fsdp"):  # fsdp1, or fsdpN under torchrun: the mesh's ranks
        apply_fsdp(policy, mesh, mixed_precision(torch.bfloat16))
        sync = grad_syncs(policy, None)
    # --compile: the trainer's layers as train.compile compiles them (bench/ep_step.py's args have no --compile)
    backend = getattr(args, "compile", "none")
    if backend != "none":
        warm_up(apply_compile(policy, backend), torch.bfloat16)  # before the optimizer (warm_up says why)
    opt = build_optimizer(policy, d, 1e-5, 1e-5)
    cuda = dev.type == "cuda"

    def step():
        return cotrain_step(policy, d, batch, opt, None, scfg, grad_sync=sync)

    for _ in range(args.warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, m = [], {}
    for _ in range(args.reps):
        if cuda:
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            m = step()
            t1.record()
            torch.cuda.synchronize()
            times.append(t0.elapsed_time(t1) / 1e3)
        else:
            t = time.perf_counter()
            m = step()
            times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    out = {"step_s_median": statistics.median(times), "step_s": times, "peak_bytes": peak,
           "policy_loss": m.get("policy/loss"), "draft_loss": m.get("draft/loss")}
    policy = d = opt = step = None  # dropped before the collection (a `del` of names the closure reads)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def _one(args) -> dict:
    """One variant of one size in this process (a fresh CUDA context: no variant's leftovers in another's peak).
    Under torchrun (WORLD_SIZE > 1) this rank's part of the fsdpN variant: its own rows / N rows, the policy sharded
    over every rank. Returns (and, with --json, writes) this rank's measurement; the process group stays up (the
    caller destroys it)."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    dev = torch.device(args.device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(dev.index)
    if world > 1:  # torchrun's env:// rendezvous
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(dev.type, (world,), mesh_dim_names=("fsdp",))
    scfg = StepConfig(amp_dtype=torch.bfloat16, micro_batch_rows=args.micro_rows, draft_row_stride=8, ttt_passes=3)
    pc = SIZES[args.size]
    dcfg = DraftConfig.for_policy(pc, draft_vocab_size=min(args.draft_vocab, pc.vocab_size))
    torch.manual_seed(0)
    if world > 1:  # the draft whole (every rank the same), the policy straight into its shards (random_sharded)
        base, draft = None, Eagle3Draft(dcfg)
    else:
        with torch.device(dev):
            base, draft = Policy(pc), Eagle3Draft(dcfg)
        base, draft = base.cpu(), draft.cpu()  # the host keeps the base copies: the variant's peak is its own
    if args.rows % world:
        raise SystemExit(f"--rows {args.rows} is not a multiple of the world size {world}")
    batch = _batch(pc, args.rows // world, args.seq, min(args.completion, args.seq - 1), dev, seed=rank)
    v = _variant(args.variant, base, draft, batch, scfg, args, mesh,
                 shard=random_sharded(pc, mesh, dev) if world > 1 else None)
    plan = _planned(pc, dcfg, scfg, args.rows, args.seq, fsdp=args.variant.startswith("fsdp"), shard=world)
    v.update(rank=rank, world=world, params=pc.num_params,
             draft_params=sum(p.numel() for p in draft.parameters()), planned_trainer_bytes=plan["trainer"],
             planned={k: plan[k] for k in ("params", "compute", "grads", "adamw", "acts", "draft")},
             planned_over_measured=plan["trainer"] / v["peak_bytes"] if v["peak_bytes"] else None)
    if args.json:
        Path(args.json).write_text(json.dumps(v))
    return v


def _sharded(args) -> None:
    """Every rank: the fsdpN variant of the one size; rank 0 writes the ranks' measurements and the summary."""
    world = int(os.environ["WORLD_SIZE"])
    if "," in args.sizes:
        raise SystemExit("under torchrun: one size per launch (a fresh CUDA context per size; module docstring)")
    args.size, args.variant = args.sizes, f"fsdp{world}"
    v = _one(args)
    ranks = [None] * world
    dist.all_gather_object(ranks, v)  # every rank's measurement, in rank order
    dist.destroy_process_group()
    if v["rank"] != 0:
        return
    peak = max(x["peak_bytes"] for x in ranks)
    row = {"world": world, "dp_shard": world, "step_s": max(x["step_s_median"] for x in ranks),  # the slowest rank
           "step_s_ranks": [x["step_s_median"] for x in ranks], "peak_bytes": peak,
           "peak_bytes_ranks": [x["peak_bytes"] for x in ranks], "planned_trainer_bytes": v["planned_trainer_bytes"],
           "planned": v["planned"], "planned_over_measured": v["planned_trainer_bytes"] / peak if peak else None,
           "params": v["params"], "draft_params": v["draft_params"],
           "tokens_per_s": args.rows * args.seq / max(x["step_s_median"] for x in ranks),
           "policy_loss": v["policy_loss"], "draft_loss": v["draft_loss"]}
    print(f"{args.size:>5} fsdp{world:<8} step {row['step_s'] * 1e3:9.1f} ms   peak {peak / GiB:7.2f} GiB   planned "
          f"{row['planned_trainer_bytes'] / GiB:7.2f} GiB" + (f" ({row['planned_over_measured']:.3f})" if peak else ""),
          flush=True)
    write_results({"rows": args.rows, "seq": args.seq, "completion": args.completion, "micro_rows": args.micro_rows,
                   "world": world, "step": {"amp": "bf16", "ttt_passes": 3, "draft_row_stride": 8,
                                            "compile": args.compile},
                   "sizes": {args.size: {f"fsdp{world}": row}}}, f"fsdp_step_w{world}", torch.device(args.device),
                  args.out)


def add_step_args(ap: argparse.ArgumentParser) -> None:
    """The co-training step's shape, timing and output flags (shared with bench/ep_step.py)."""
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--completion", type=int, default=1536)
    ap.add_argument("--micro-rows", type=int, default=4)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--sizes", default="1.5b,3b")
    ap.add_argument("--compile", default="none", choices=COMPILE_BACKENDS,
                    help="compile the policy's layers in every variant (train.compile; inductor on the GPU)")
    add_step_args(ap)
    ap.add_argument("--variant", default=None, help=argparse.SUPPRESS)  # internal: one variant, one size
    ap.add_argument("--size", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant:
        _one(args)
        return dist.destroy_process_group()
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:  # under torchrun (module docstring)
        return _sharded(args)
    common = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
              ("device", "rows", "seq", "completion", "micro_rows", "draft_vocab", "warmup", "reps", "compile")]
    results, port = {}, 29533
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            row = {}
            for name in ("plain", "fsdp1", "plain_again"):
                f = Path(tmp) / f"{size}_{name}.json"
                port += 1
                subprocess.run([sys.executable, __file__, *common, "--variant", name.replace("_again", ""),
                                "--size", size, "--json", str(f)], check=True,
                               env={**os.environ, "MASTER_PORT": str(port)})
                v = row[name] = json.loads(f.read_text())
                print(f"{size:>5} {name:<12} step {v['step_s_median'] * 1e3:9.1f} ms   peak {v['peak_bytes'] / GiB:7.2f} "
                      f"GiB   planned {v['planned_trainer_bytes'] / GiB:7.2f} GiB"
                      + (f" ({v['planned_over_measured']:.3f})" if v["planned_over_measured"] else ""), flush=True)
            plain = min(row["plain"]["step_s_median"], row["plain_again"]["step_s_median"])
            row["fsdp_overhead"] = row["fsdp1"]["step_s_median"] / plain - 1
            row["plain_drift"] = row["plain_again"]["step_s_median"] / row["plain"]["step_s_median"] - 1
            print(f"{size:>5} FSDP at world 1: {row['fsdp_overhead'] * 100:+.1f}% step time "
                  f"(plain drift {row['plain_drift'] * 100:+.1f}%)", flush=True)
            results[size] = row
    dev = torch.device(args.device)
    write_results({"rows": args.rows, "seq": args.seq, "completion": args.completion, "micro_rows": args.micro_rows,
                   "step": {"amp": "bf16", "ttt_passes": 3, "draft_row_stride": 8, "compile": args.compile},
                   "sizes": results},
                  "fsdp_step", dev, args.out)


if __name__ == "__main__":
    from specco.parallel.mesh import run_worker  # noqa: E402
    run_worker(main)  # under torchrun: no interpreter teardown after success (its docstring)
