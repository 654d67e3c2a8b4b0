"""Peak host memory per rank of loading an HF checkpoint: the whole load vs the sharded load (parallel/load.py).

    python bench/sharded_load.py                 # a random 508 MB fp32 policy; whole, dp_shard 2 and 4
    python bench/sharded_load.py --layers 2      # quicker (~270 MB)

Each variant runs in fresh gloo worker processes (specco.parallel.mesh.spawn_local), one row per rank:

    whole          one process: hf_io.load_policy(dir), every tensor read whole (safetensors load_file)
    whole+fsdp N   what a rank did before the sharded load: load_policy(dir), then apply_fsdp over N ranks
    sharded N      load_sharded_policy(dir, mesh): meta-init, apply_fsdp, to_empty, each rank reading only its
                   rows (safe_open(...).get_slice)
    pickled 2      rank 0's whole policy to rank 1 as before: deepcopy + pickled broadcast_object_list
    tensors 2      the same by runner/setup.share_model: a recipe object, then one dist.broadcast per tensor

What is measured: the process's peak resident set during the load minus its resident set just before
(Linux: VmHWM is reset by writing 5 to /proc/self/clear_refs, then read from /proc/self/status). Resident
memory counts the file pages a rank maps and touches as well as its tensors, i.e. what the host must hold. Also
`held_MB`: resident memory after the load minus before (what stays), and `shard_MB`: the bytes of the rank's
parameters (local shards), the floor. The file's pages in the OS page cache are not any process's.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from specco.model.config import PolicyConfig  # noqa: E402
from specco.model.hf_io import load_policy, save_policy  # noqa: E402
from specco.model.policy import Policy  # noqa: E402
from specco.parallel.mesh import spawn_local  # noqa: E402
from _hostmem import MB, measure as _measure  # noqa: E402

def _local_bytes(model) -> int:
    from torch.distributed.tensor import DTensor
    return sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in model.parameters())


def _pickled(policy, rank):
    """The start-up broadcast before runner/setup.share_model: rank 0 deep-copies the model and every rank
    receives it pickled through broadcast_object_list (kept here only to measure it)."""
    import copy
    import torch.distributed as dist
    box = [copy.deepcopy(policy) if rank == 0 else None]
    dist.broadcast_object_list(box, group_src=0)
    return policy if rank == 0 else box[0]


def _worker(rank, world, d, mode, out):
    from specco.parallel.fsdp import apply_fsdp
    from specco.parallel.load import load_sharded_policy
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    if mode in ("pickled", "tensors"):  # rank 0 holds the policy; measured: getting it to every rank
        from specco.parallel.mesh import Mesh
        from specco.runner.setup import share_model
        m = Mesh.build(dp=world, backend="gloo")
        policy = load_policy(d) if rank == 0 else None
        load = (lambda: share_model(policy, m, "cpu")) if mode == "tensors" else (lambda: _pickled(policy, rank))
    elif mode == "whole":
        load = lambda: load_policy(d)  # noqa: E731
    elif mode == "whole+fsdp":
        load = lambda: apply_fsdp(load_policy(d), mesh)  # noqa: E731
    else:
        load = lambda: load_sharded_policy(d, mesh, "cpu")  # noqa: E731
    peak, held, model = _measure(load)
    row = {"mode": mode, "world": world, "rank": rank, "peak_MB": round(peak / MB, 1), "held_MB": round(held / MB, 1),
           "shard_MB": round(_local_bytes(model) / MB, 1)}
    Path(out, f"{mode}_{world}_{rank}.json").write_text(json.dumps(row))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cfg = PolicyConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_layers=a.layers, num_heads=16,
                       num_kv_heads=4, model_type="qwen3", qk_norm=True)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "policy"
        with torch.device("meta"):
            n = sum(p.numel() for p in Policy(cfg).parameters())
        torch.manual_seed(0)
        save_policy(Policy(cfg), d)
        file_mb = (d / "model.safetensors").stat().st_size / MB
        print(f"policy: {n / 1e6:.1f}M parameters, model.safetensors {file_mb:.0f} MB (fp32)", flush=True)
        rows_dir = Path(tmp) / "rows"
        rows_dir.mkdir()
        for mode, world in (("whole", 1), ("whole+fsdp", 2), ("sharded", 2), ("whole+fsdp", 4), ("sharded", 4),
                            ("pickled", 2), ("tensors", 2)):
            spawn_local(_worker, world, d, mode, rows_dir)
            for r in range(world):
                row = json.loads((rows_dir / f"{mode}_{world}_{r}.json").read_text())
                print(json.dumps(row), flush=True)
        rows = [json.loads(f.read_text()) for f in sorted(rows_dir.glob("*.json"))]
    from _results import write_results
    write_results({"params_M": round(n / 1e6, 1), "file_MB": round(file_mb, 1), "rows": rows,
                   "max_peak_MB": {f"{m}/{w}": max(r["peak_MB"] for r in rows if (r["mode"], r["world"]) == (m, w))
                                   for m, w in sorted({(r["mode"], r["world"]) for r in rows})}},
                  "sharded_load", torch.device("cpu"), a.out)


if __name__ == "__main__":
    main()
