"""bench/rollout.py runs on CPU in each draft mode and writes the fields BENCHMARKS.md quotes (no timings
are asserted: they come only from the GPU). The GPU paths of the same script (anchor, floors, speculation
control) run on the device (bench/device_tests.sh does not cover them; BENCHMARKS.md has its commands)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "rollout.py"

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("draft,k", [("none", 3), ("self", 3), ("dflash", 3)])
def test_rollout_bench_modes(tmp_path, draft, k):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--model", "tiny", "--batch-sizes", "2",
                           "--draft", draft, "--k", str(k), "--iters", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.loads(out.read_text())["results"][0]
    assert row["batch"] == 2 and row["t_step_ms"] > 0
    if draft == "none":
        assert "tau" not in row
    else:  # every round emits at least the target's own token, at most k + 1
        assert 1.0 <= row["tau"] <= k + 1
        assert {"t_verify_ms", "t_propose_ms", "t_catch_up_ms"} <= row.keys()
