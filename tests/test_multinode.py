"""`specco train` across "two nodes": two torchrun launchers of 2 processes each rendezvousing on localhost,
each in its own working directory, at dp = 2 x cp = 2, must equal one launcher of 4 processes: rank 0's
metrics.jsonl of every arm, number by number (losses and grad norms at full float precision).

The out_dir is one absolute path both "nodes" see: a shared filesystem, which sharded checkpoints need (every
rank writes its own shards into out_dir/ckpt; runner/arm_checkpoint.py). Nothing is written into a launcher's
working directory. Without a shared out_dir the first checkpoint stops with an error naming the ranks that do not
see rank 0's directory (tests/test_sharded_checkpoint.py: test_root_not_shared_is_named).

What makes it work (runner/pipeline.py, runner/rl.py): SFT and the warm start run data-parallel over every rank,
rank 0 deciding whether their outputs exist; rollouts are shared over the CP group; only rank 0 logs.
"""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["train", str(ROOT / "configs" / "demo.toml"), "--quiet", "parallel.dp=2", "parallel.cp=2",
        "policy.hidden_size=32", "policy.num_layers=2", "draft.aux_layer_ids=[]", "policy.num_heads=2", "policy.num_kv_heads=1",
        "policy.intermediate_size=64", "sft.steps=4", "train.warm_start_steps=2", "train.warm_start_prompts=8",
        "train.steps=2", "rollout.prompts_per_step=4", "rollout.group_size=2", "rollout.max_new_tokens=6",
        "data.eval_size=4"]
COMPARED = ("policy/loss", "draft/loss", "policy/grad_norm", "draft/grad_norm", "reward", "tau", "draft/tokens")

pytestmark = pytest.mark.e2e


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(cwd: Path, out: Path, nnodes: int, node_rank: int, nproc: int, port: int):
    cwd.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node-rank={node_rank}",
           f"--nproc-per-node={nproc}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
           "--rdzv-id=specco-test", "-m", "specco", *ARGS, f"out_dir={out}"]
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait(procs):
    outs = [p.communicate(timeout=900)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]


def _rows(run: Path):
    return {arm: [json.loads(x) for x in (run / "arms" / arm / "metrics.jsonl").read_text().splitlines()]
            for arm in ("none", "frozen", "cotrained")}


@pytest.mark.slow
def test_two_launchers_equal_one(tmp_path):
    shared = tmp_path / "shared"  # the filesystem both "nodes" mount
    _wait([_launch(tmp_path / "one", shared / "one", 1, 0, 4, _free_port())])
    port = _free_port()
    _wait([_launch(tmp_path / f"node{r}", shared / "two", 2, r, 2, port) for r in (0, 1)])
    one, two = _rows(shared / "one"), _rows(shared / "two")
    for arm in one:
        assert [r["step"] for r in two[arm]] == [1, 2]
        for a, b in zip(one[arm], two[arm]):
            for k in COMPARED:
                if k in a:
                    assert a[k] == b[k], (arm, k, a[k], b[k])
    assert (shared / "two" / "report.md").exists()
    assert all(not list((tmp_path / f"node{r}").iterdir()) for r in (0, 1))  # nothing written outside out_dir
