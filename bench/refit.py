"""Refit and rollout.offload costs against model size: `python bench/refit.py` (GPU) or `--smoke` (CPU, tiny).

Refit (runner/refit.refit_engine, what every RL step runs): random fp32 trainer weights of Qwen2.5-0.5B / 1.5B / 3B
shapes (tied embeddings) plus an EAGLE-3 draft, streamed into a bf16 engine in buckets of --buckets MB, against
the whole-state path it replaces (`full_state` then `engine.refit`). The trainer is FSDP-sharded (apply_fsdp) over
every process of the job — one process: a 1-rank mesh, so each bucket is still gathered into new memory as it would
be at dp_shard N (`torchrun --nproc-per-node N bench/refit.py` for real gathers). Per size and bucket: seconds per
refit (median of --reps, the guard's fingerprints included as in the RL step, and without), GB/s of engine bytes
written, and the peak memory above what was allocated before the refit (torch.cuda.max_memory_allocated).

Offload (RolloutEngine.release / restore, rollout.offload): the engine generates once (its runner, KV cache and
CUDA graphs captured), then release(weights=True) -> restore -> refit -> generate, timed, against a steady generate:
memory freed (allocated before/after, and what the driver holds after empty_cache), seconds to release, to
restore, to refit after restore, and the first generate's extra cost (graphs captured afresh). Also 'cache' only.

Writes `refit_cuda.json` (or `_cpu`) under bench/results (--out to change). On CPU memory is not measured (null).
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from _results import write_results  # noqa: E402
from specco.model.config import DraftConfig, PolicyConfig  # noqa: E402
from specco.model.draft import Eagle3Draft  # noqa: E402
from specco.model.policy import Policy  # noqa: E402
from specco.rollout.engine import RolloutEngine  # noqa: E402
from specco.rollout.generate import GenerateConfig  # noqa: E402
from specco.rollout.sampling import SamplingParams  # noqa: E402

# Qwen2.5 shapes (config.json of each): vocabulary, hidden, intermediate, layers, heads, KV heads; tied embeddings
SIZES = {"0.5b": (151936, 896, 4864, 24, 14, 2), "1.5b": (151936, 1536, 8960, 28, 12, 2),
         "3b": (151936, 2048, 11008, 36, 16, 2), "tiny": (512, 64, 128, 2, 4, 2)}
GIB = 2 ** 30


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter()


def mem(dev):
    return torch.cuda.memory_allocated(dev) if dev.type == "cuda" else None


def build(size: str, dev):
    V, h, i, L, nh, kv = SIZES[size]
    pc = PolicyConfig(vocab_size=V, hidden_size=h, intermediate_size=i, num_layers=L, num_heads=nh, num_kv_heads=kv,
                      tie_word_embeddings=True, max_position_embeddings=4096)
    with torch.device(dev):  # initialised on the device: a 3B fp32 init on the host takes minutes
        torch.manual_seed(0)
        policy = Policy(pc)
        draft = Eagle3Draft(DraftConfig.for_policy(pc, draft_vocab_size=min(V, 32000)))
    return policy, draft


def refit_once(engine, trainer, draft, bucket_mb, guard, dev):
    from specco.runner.refit import MB, refit_engine
    base = mem(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = sync(dev)
    if bucket_mb == "whole":  # the path this replaces: every shard gathered first, then the whole dict copied
        from specco.runner.trainer import full_state
        sd = full_state(trainer)
        engine.refit(sd, draft.state_dict())
        if guard:
            engine.check_weights(sd, draft.state_dict())
        del sd
    else:
        rows = refit_engine(engine, trainer.state_dict(), draft.state_dict(), bucket_mb * MB, guard)
        if guard:
            engine.check_fingerprints(rows["policy"], rows["draft"])
    secs = sync(dev) - t0
    peak = torch.cuda.max_memory_allocated(dev) - base if dev.type == "cuda" else None
    return secs, peak


def bench_refit(size, buckets, reps, dev, mesh, rows, new_tokens):
    from specco.parallel.fsdp import apply_fsdp
    policy, draft = build(size, dev)
    engine = RolloutEngine(copy.deepcopy(policy).to(torch.bfloat16), copy.deepcopy(draft).to(torch.bfloat16))
    engine_bytes = sum(t.numel() * t.element_size() for m in (engine.policy, engine.draft)
                       for t in m.state_dict().values())
    trainer = apply_fsdp(policy.train(), mesh.fsdp_mesh)
    largest = max(t.numel() * 2 for t in engine.policy.state_dict().values())
    rows_, rows = rows, []
    for b in buckets:
        for guard in (False, True):
            refit_once(engine, trainer, draft, b, guard, dev)  # warm-up (allocator, kernels)
            runs = [refit_once(engine, trainer, draft, b, guard, dev) for _ in range(reps)]
            secs = statistics.median(s for s, _ in runs)
            peak = max(p for _, p in runs) if dev.type == "cuda" else None
            rows.append({"bucket_mb": b, "guard": guard, "seconds": secs, "gb_per_s": engine_bytes / 1e9 / secs,
                         "s_per_gb": secs / (engine_bytes / 1e9),
                         "peak_extra_gib": None if peak is None else peak / GIB})
            print(f"{size} bucket {b} guard {guard}: {secs * 1e3:.1f} ms, {engine_bytes / 1e9 / secs:.1f} GB/s, "
                  f"peak extra {rows[-1]['peak_extra_gib']} GiB", flush=True)
    n_params = sum(p.numel() for p in engine.policy.parameters())
    out = {"size": size, "policy_params": n_params, "engine_bytes": engine_bytes, "largest_tensor_bytes": largest,
           "refit": rows, "offload": bench_offload(engine, trainer, draft, dev, rows_, new_tokens)}
    del engine, trainer, policy, draft
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def bench_offload(engine, trainer, draft, dev, rows, new_tokens):
    """release -> restore -> refit -> generate against a steady generate, for 'cache' and 'weights+cache'."""
    from specco.runner.refit import MB, refit_engine
    engine.cfg = GenerateConfig(max_new_tokens=new_tokens, num_draft_tokens=3, sampling=SamplingParams(temperature=1.0))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, engine.policy.cfg.vocab_size, (32,), generator=g) for _ in range(rows)]

    def generate():
        t0 = sync(dev)
        toks.append(engine.generate(prompts, generator=torch.Generator(dev).manual_seed(0)).tokens.cpu())
        return sync(dev) - t0

    toks = []
    first = generate()
    steady = statistics.median(generate() for _ in range(3))
    ref = toks[-1]
    out = {"rows": rows, "new_tokens": new_tokens, "generate_first_s": first, "generate_steady_s": steady}
    for mode in ("cache", "weights+cache"):
        weights = mode == "weights+cache"
        before, reserved = mem(dev), torch.cuda.memory_reserved(dev) if dev.type == "cuda" else None
        t0 = sync(dev)
        freed = engine.release(weights=weights, refilled=("policy", "draft"))
        t_release = sync(dev) - t0
        after = mem(dev)
        reserved_after = torch.cuda.memory_reserved(dev) if dev.type == "cuda" else None
        t0 = sync(dev)
        engine.restore()
        t_restore = sync(dev) - t0
        t0 = sync(dev)
        refit_engine(engine, trainer.state_dict(), draft.state_dict(), 512 * MB, guard=False)
        t_refit = sync(dev) - t0
        t_first = generate()
        out[mode] = {"freed_reported_gib": freed / GIB,
                     "allocated_drop_gib": None if before is None else (before - after) / GIB,
                     "reserved_drop_gib": None if reserved is None else (reserved - reserved_after) / GIB,
                     "release_s": t_release, "restore_s": t_restore, "refit_after_restore_s": t_refit,
                     "first_generate_s": t_first, "recapture_extra_s": t_first - steady,
                     # the same weights and seed: equal unless speculation control, re-measuring its costs on the
                     # new graphs, picked another k (still lossless, other draws)
                     "tokens_equal": bool(torch.equal(toks[-1], ref))}
        print(f"offload {mode}: {out[mode]}", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="0.5b,1.5b,3b")
    ap.add_argument("--buckets", default="whole,64,256,512,2048", help="MB per bucket; 'whole' = full_state + refit")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rows", type=int, default=64, help="offload: rows per generate")
    ap.add_argument("--new-tokens", type=int, default=128, help="offload: tokens per row")
    ap.add_argument("--smoke", action="store_true", help="CPU, the tiny shape, 2 reps, a 4-row rollout")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.smoke:
        a.sizes, a.reps, a.device, a.buckets, a.rows, a.new_tokens = "tiny", 2, a.device or "cpu", "whole,1", 4, 8
    dev = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:  # one process without torchrun: any free port
        import socket
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    from specco.parallel.mesh import Mesh
    world = int(os.environ["WORLD_SIZE"])
    mesh = Mesh.build(dp=world, dp_shard=world, backend="nccl" if dev.type == "cuda" else "gloo")
    if dev.type == "cuda":
        dev = torch.device("cuda", torch.cuda.current_device())
    buckets = [b if b == "whole" else int(b) for b in a.buckets.split(",")]
    results = [bench_refit(s, buckets, a.reps, dev, mesh, a.rows, a.new_tokens) for s in a.sizes.split(",")]
    if mesh.rank == 0:
        write_results({"world": world, "sizes": results}, "refit", dev, a.out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    from specco.parallel.mesh import run_worker  # noqa: E402
    run_worker(main)  # under torchrun: no interpreter teardown after success (its docstring)
