"""bench/engine_tp1.py on CPU (gloo, tiny shape): the whole engine and its tp_shard on a one-rank group decode the
same greedy tokens, and the JSON has every field the H200 run fills."""
import json
import os
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


def test_engine_tp1_bench_smoke(tmp_path):
    out = tmp_path / "tp1.json"
    with socket.socket() as s:  # a free port for the one-process group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    subprocess.run([sys.executable, "bench/engine_tp1.py", "--device", "cpu", "--model", "tiny", "--batch-sizes", "2",
                    "--prompt-lens", "32", "--iters", "1", "--reps", "1", "--out", str(out)], check=True,
                   capture_output=True, text=True, env=env)
    (row,) = json.loads(out.read_text())["rows"]
    assert row["greedy_tokens_equal"] and row["tau"] > 1
    for k in ("plain", "spec"):
        assert row[f"{k}_whole_ms"] > 0 and row[f"{k}_tp1_ms"] > 0 and row[f"{k}_tp1_over_whole"] > 0
