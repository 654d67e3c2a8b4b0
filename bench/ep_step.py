"""The mixture-of-experts co-training step at expert parallelism N (issue 39, EP): step time and peak memory per GPU.

One bf16 co-training step (policy + EAGLE-3 draft, random weights) of a Qwen3-MoE policy, built and timed by
bench/fsdp_step.py's pieces (`_batch`, `_variant`: warm-up, CUDA-event medians, max_memory_allocated over the
timed steps), the trainer's copy cut by the production recipe (trainer.make_arm): parallel/load.sharded_policy
with expert parallelism (`apply_ep` over mesh.ep_group, slices summed over mesh.ep_replica_group) applied on the
meta model before FSDP shards the rest over mesh.fsdp_mesh, bf16 gathers and fp32 reductions, random weights drawn
straight into each rank's shards (fsdp_step.random_sharded: no whole copy anywhere, so the 30 B shape fits); the
grad syncs of train/grad_sync.py (EPSync over FSDPSync).

    world 1 (no torchrun)      plain: fp32 masters whole, bf16 autocast (a one-GPU MoE run)
    torchrun, --ep 1           dp_shard N, ep 1: FSDP shards each (E, ...) expert tensor along E with its layer and
                               gathers it for the layer (no all-to-all)
    torchrun, --ep N           dp_shard N, ep N: each rank holds E/N experts whole; two all-to-alls per sparse
                               layer each way (tokens to their experts and back)

The step's --rows are split over the ranks (rows / N each, every rank its own), so every launch steps the same
global batch. A step ends on the slowest rank: the max of the ranks' medians is reported, with each rank's, and
the planner's trainer memory (specco/plan.py rank_memory at Layout(dp_shard N, fsdp, ep), plan_moe's expert terms)
beside the largest peak. One layout per launch: a fresh CUDA context each (bench/fsdp_step.py says why).

Shapes: `1b`, configs/moe.toml's layers (28 of hidden 1024, 8 experts of 1,408, top 2) with a 32,768-token
vocabulary in place of its 101 characters (1.11 B); `a3b`, Qwen3-30B-A3B's (48 layers, 128 experts of 768, top 8,
head_dim 128: 30.5 B; 16 B a parameter of fp32 masters, grads and AdamW, so N = 8 only: 61 GB a rank before
activations); `tiny` for the CPU smoke.

    python bench/ep_step.py --device cuda --size 1b --out $OUT/ep_step_w1.json
    torchrun --nproc-per-node 4 bench/ep_step.py --device cuda --size 1b --ep 4 --out $OUT/ep_step_w4_ep4.json
    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/ep_step.py --device cpu --size tiny --ep 2 \
        --rows 4 --seq 64 --completion 32 --micro-rows 2 --draft-vocab 256 --reps 1 --warmup 1
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_results  # noqa: E402
from fsdp_step import GiB, _batch, _planned, _variant, add_step_args, random_sharded  # noqa: E402
from specco.model.config import DraftConfig, PolicyConfig  # noqa: E402
from specco.model.draft import Eagle3Draft  # noqa: E402
from specco.model.policy import Policy  # noqa: E402
from specco.parallel.mesh import Mesh  # noqa: E402
from specco.plan import PRESETS  # noqa: E402
from specco.train.cotrain import StepConfig  # noqa: E402

SIZES = {
    "1b": PolicyConfig(vocab_size=32768, hidden_size=1024, intermediate_size=2816, num_layers=28, num_heads=16,
                       num_kv_heads=4, model_type="qwen3_moe", qk_norm=True, norm_topk_prob=True, num_experts=8,
                       num_experts_per_tok=2, moe_intermediate_size=1408, router_aux_loss_coef=0.001),
    "a3b": PRESETS["qwen3-30b-a3b"],  # `specco plan`'s Qwen3-30B-A3B (its config.json)
    "tiny": PolicyConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                         num_kv_heads=2, model_type="qwen3_moe", qk_norm=True, norm_topk_prob=True, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=32, router_aux_loss_coef=0.01),
}


def prepare_ep(mesh: Mesh, ep: int):
    """What trainer.make_arm applies to the meta model before FSDP (at ep > 1): each sparse layer's experts cut to
    this rank's slice over mesh.ep_group, their gradients summed over mesh.ep_replica_group; FSDP then leaves the
    slices out of its units."""
    from specco.parallel.ep import apply_ep

    def prepare(m):
        if ep > 1:
            apply_ep(m, mesh.ep_group, mesh.ep_replica_group)
    return prepare


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--size", choices=sorted(SIZES), default="1b")
    ap.add_argument("--ep", type=int, default=0, help="expert parallelism under torchrun: 1 or the world (default)")
    add_step_args(ap)
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", 1))
    ep = args.ep or world
    if world == 1:  # one process: its own one-rank group (the draft's all-reduce runs on it)
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"))
        if "MASTER_PORT" not in os.environ:
            import socket
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    if args.rows % world:
        raise SystemExit(f"--rows {args.rows} is not a multiple of the world size {world}")
    mesh = Mesh.build(dp=world, dp_shard=world, ep=ep, backend="nccl" if args.device == "cuda" else "gloo")
    dev = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    pc = SIZES[args.size]
    dcfg = DraftConfig.for_policy(pc, draft_vocab_size=min(args.draft_vocab, pc.vocab_size))
    scfg = StepConfig(amp_dtype=torch.bfloat16, micro_batch_rows=args.micro_rows, draft_row_stride=8, ttt_passes=3)
    torch.manual_seed(0)  # the same draft on every rank
    if world > 1:  # the policy drawn straight into its shards and slices (fsdp_step.random_sharded)
        base, draft = None, Eagle3Draft(dcfg)
    else:
        with torch.device(dev):
            base, draft = Policy(pc), Eagle3Draft(dcfg)
        base, draft = base.cpu(), draft.cpu()  # the host keeps the base copies: the variant's peak is its own
    batch = _batch(pc, args.rows // world, args.seq, min(args.completion, args.seq - 1), dev, seed=mesh.rank)
    name = "plain" if world == 1 else f"fsdp{world}_ep{ep}"
    shard = random_sharded(pc, mesh.fsdp_mesh, dev, prepare_ep(mesh, ep)) if world > 1 else None
    v = _variant(name, base, draft, batch, scfg, args, None, shard=shard)
    plan = _planned(pc, dcfg, scfg, args.rows, args.seq, fsdp=world > 1, shard=world, ep=ep)
    v.update(rank=mesh.rank, planned_trainer_bytes=plan["trainer"])
    ranks = [None] * world
    dist.all_gather_object(ranks, v)  # every rank's measurement, in rank order
    if mesh.rank == 0:
        peak = max(x["peak_bytes"] for x in ranks)
        step = max(x["step_s_median"] for x in ranks)  # the slowest rank ends the step
        row = {"variant": name, "world": world, "dp_shard": world, "ep": ep, "step_s": step,
               "step_s_ranks": [x["step_s_median"] for x in ranks], "peak_bytes": peak,
               "peak_bytes_ranks": [x["peak_bytes"] for x in ranks], "planned_trainer_bytes": plan["trainer"],
               "planned": {k: plan[k] for k in ("params", "compute", "grads", "adamw", "acts", "draft")},
               "planned_over_measured": plan["trainer"] / peak if peak else None,
               "params": pc.num_params, "tokens_per_s": args.rows * args.seq / step,
               "policy_loss": v["policy_loss"], "draft_loss": v["draft_loss"]}
        print(f"{args.size:>5} {name:<12} step {step * 1e3:9.1f} ms   peak {peak / GiB:7.2f} GiB   planned "
              f"{plan['trainer'] / GiB:7.2f} GiB", flush=True)
        write_results({"size": args.size, "config": {k: getattr(pc, k) for k in (
                           "hidden_size", "num_layers", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                           "vocab_size")},
                       "rows": args.rows, "seq": args.seq, "completion": args.completion,
                       "micro_rows": args.micro_rows, "step": {"amp": "bf16", "ttt_passes": 3, "draft_row_stride": 8},
                       "result": row}, f"ep_step_w{world}_ep{ep}", dev, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    from specco.parallel.mesh import run_worker  # noqa: E402
    run_worker(main)  # under torchrun: no interpreter teardown after success (its docstring)
