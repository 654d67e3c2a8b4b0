"""bench/logprob_recompute.py and bench/host_overhead.py run on CPU at tiny sizes and write the fields
BENCHMARKS.md quotes (no timings asserted: those come only from the GPU). host_overhead checks itself that the
old and new ways give the same texts, pairs and log-probs."""
import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"

import pytest  # noqa: E402
pytestmark = pytest.mark.e2e


def _run(script: str, *args: str) -> None:
    proc = subprocess.run([sys.executable, str(BENCH / script), "--device", "cpu", *args], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_logprob_recompute_bench(tmp_path):
    out = tmp_path / "l.json"
    _run("logprob_recompute.py", "--model", "tiny", "--rows", "16", "--max-len", "300", "--iters", "1",
         "--compile", "aot_eager", "--out", str(out))
    r = json.loads(out.read_text())
    assert r["real_tokens"] < r["padded_tokens_old"]  # the long-tailed rows pad a whole-width forward
    assert {"old_s", "new_s", "train_s", "floor_s", "compiled_new_s", "compiled_train_s"} <= r.keys()


def test_host_overhead_bench(tmp_path):
    out = tmp_path / "h.json"
    _run("host_overhead.py", "--rows", "16", "--mean-len", "50", "--max-len", "120", "--out", str(out))
    r = json.loads(out.read_text())
    assert r["rows"] == 16 and r["tokens"] > 0 and r["old_s"] > 0 and r["new_s"] > 0
