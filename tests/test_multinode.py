"""`specco train` across "two nodes": two torchrun launchers of 2 processes each rendezvousing on localhost,
each in its own working directory (no shared path: out_dir is relative, so each node writes its own),
at dp = 2 x cp = 2, must equal one launcher of 4 processes: rank 0's metrics.jsonl of every arm, number by
number (losses and grad norms at full float precision), and nothing but rank 0's node writes a run.

What makes it work (runner/pipeline.py, runner/rl.py): SFT and the warm start run on rank 0 and reach the other
ranks through the process group; rollouts are shared over the CP group; only rank 0 logs and
checkpoints, and on resume it sends the checkpoint to the others.
"""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["train", str(ROOT / "configs" / "demo.toml"), "--quiet", "parallel.dp=2", "parallel.cp=2", "out_dir=run",
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


def _launch(cwd: Path, nnodes: int, node_rank: int, nproc: int, port: int):
    cwd.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node-rank={node_rank}",
           f"--nproc-per-node={nproc}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
           "--rdzv-id=specco-test", "-m", "specco", *ARGS]
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
    _wait([_launch(tmp_path / "one", 1, 0, 4, _free_port())])
    port = _free_port()
    _wait([_launch(tmp_path / f"node{r}", 2, r, 2, port) for r in (0, 1)])
    one, two = _rows(tmp_path / "one" / "run"), _rows(tmp_path / "node0" / "run")
    for arm in one:
        assert [r["step"] for r in two[arm]] == [1, 2]
        for a, b in zip(one[arm], two[arm]):
            for k in COMPARED:
                if k in a:
                    assert a[k] == b[k], (arm, k, a[k], b[k])
    assert (tmp_path / "node0" / "run" / "report.md").exists()
    assert not (tmp_path / "node1" / "run").exists()  # the second node needs (and writes) no run directory
