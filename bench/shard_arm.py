"""Peak host memory per rank of making an arm (trainer.make_arm) under FSDP, with a KL reference.

    python bench/shard_arm.py                            # a random 508 MB fp32 policy; one process, dp_shard 2, 4
    cd /tmp && SPECCO_REPO=/path/to/older/checkout python /path/to/bench/shard_arm.py --out before.json
                                                         # another checkout's make_arm (run it from outside any
                                                         # checkout: a spawned worker's path starts at its cwd)

make_arm makes, from the whole starting policy every rank holds: the rollout engine's whole copy, the trainer's
copy (FSDP shards under parallel.dp_shard) and, with train.kl_coef > 0, the KL reference. Before
parallel/load.sharded_copy the trainer's copy and the reference were whole deep copies (the trainer's sharded
in place afterwards, the reference whole for the run): the incoming policy + 3 whole copies at the peak. Now
both are cut as shards straight from the incoming policy: the incoming policy + the engine's copy + shards.

Each layout runs in fresh gloo worker processes (specco.parallel.mesh.spawn_local), one row per rank, for the
arm `none` (no draft: only the policy's copies are measured). Measured as bench/sharded_load.py does: the
process's peak resident set during make_arm minus its resident set just before (VmHWM reset through
/proc/self/clear_refs), `held_MB` what stays after it, `trainer_MB` / `ref_MB` the bytes of the rank's trainer
and reference parameters (local shards). `policy_MB` is the incoming policy's size: the floor of `peak_MB` is
one copy (the engine's) plus the shards.

Measured (2 CPU cores, gloo, the 508 MB fp32 policy, train.kl_coef=0.1; bench/results/shard_arm_cpu.json):

    peak MB per rank      one process   dp_shard 2   dp_shard 4
    before (2f4721e)          1,557        1,582        1,571     3 whole copies (+ shards at dp_shard 2)
    sharded_copy              1,557        1,054          799     1 whole copy (the engine's) + 2 shards

and what stays after make_arm: before 1,307 / 1,180 MB (the reference whole for the run), now 1,054 / 799 MB.
The ~40 MB above engine + shards is allocator slack (no AdamW state exists before the first step).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

# the checkout whose make_arm is measured (this one by default): first on the path, which spawned workers inherit
REPO = os.environ.get("SPECCO_REPO", str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, REPO)
sys.path.insert(1, str(Path(__file__).resolve().parent))  # _results

from specco.model.config import PolicyConfig  # noqa: E402
from specco.model.policy import Policy  # noqa: E402
from specco.parallel.mesh import spawn_local  # noqa: E402
from _hostmem import MB, measure as _measure  # noqa: E402

def _local_bytes(model) -> int:
    from torch.distributed.tensor import DTensor
    return sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in model.parameters())


DEMO = Path(__file__).resolve().parents[1] / "configs" / "demo.toml"


def _policy_cfg(layers: int) -> PolicyConfig:
    return PolicyConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_layers=layers, num_heads=16,
                        num_kv_heads=4, model_type="qwen3", qk_norm=True)


def _worker(rank, world, layers, out):
    from specco.config_load import load_config
    from specco.parallel.mesh import Mesh
    from specco.runner.derive import generate_config
    from specco.runner.trainer import make_arm
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(DEMO, ["train.kl_coef=0.1", f"out_dir={tmp}"]
                          + ([f"parallel.dp_shard={world}"] if world > 1 else []))
    mesh = Mesh.build(dp=world, dp_shard=world, backend="gloo") if world > 1 else None
    torch.manual_seed(0)
    policy = Policy(_policy_cfg(layers))  # every rank holds the whole starting policy (runner/setup.py)
    gen_cfg = generate_config(cfg, 1, 0)
    assert Path(sys.modules["specco"].__file__).is_relative_to(REPO), "the worker imports another checkout"
    peak, held, st = _measure(lambda: make_arm(cfg, "none", policy, None, gen_cfg, rank=rank, mesh=mesh))
    row = {"world": world, "rank": rank, "peak_MB": round(peak / MB, 1), "held_MB": round(held / MB, 1),
           "policy_MB": round(_local_bytes(policy) / MB, 1), "trainer_MB": round(_local_bytes(st.policy) / MB, 1),
           "ref_MB": round(_local_bytes(st.ref) / MB, 1)}
    Path(out, f"{world}_{rank}.json").write_text(json.dumps(row))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    print(f"make_arm of {Path(sys.modules['specco'].__file__).parent}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in map(int, a.worlds.split(",")):
            spawn_local(_worker, world, a.layers, tmp)
            for r in range(world):
                rows.append(json.loads(Path(tmp, f"{world}_{r}.json").read_text()))
                print(json.dumps(rows[-1]), flush=True)
    from _results import write_results
    write_results({"repo": os.environ.get("SPECCO_REPO", "."), "rows": rows,
                   "max_peak_MB": {str(w): max(r["peak_MB"] for r in rows if r["world"] == w)
                                   for w in sorted({r["world"] for r in rows})}},
                  "shard_arm", torch.device("cpu"), a.out)


if __name__ == "__main__":
    main()
