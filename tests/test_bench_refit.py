"""bench/refit.py --smoke on CPU (the tiny shape): it runs end to end through the streamed and whole-state refits
and the offload cycle, and writes its JSON with every field the H200 run fills (memory null on CPU)."""
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


def test_refit_bench_smoke(tmp_path):
    out = tmp_path / "refit.json"
    subprocess.run([sys.executable, "bench/refit.py", "--smoke", "--out", str(out)], check=True,
                   capture_output=True, text=True)
    r = json.loads(out.read_text())
    (size,) = r["sizes"]
    assert size["size"] == "tiny" and r["world"] == 1
    assert {(x["bucket_mb"], x["guard"]) for x in size["refit"]} == {("whole", False), ("whole", True), (1, False),
                                                                       (1, True)}
    assert all(x["seconds"] > 0 and x["peak_extra_gib"] is None for x in size["refit"])
    for mode in ("cache", "weights+cache"):
        assert size["offload"][mode]["freed_reported_gib"] > 0
    assert size["offload"]["weights+cache"]["freed_reported_gib"] > size["offload"]["cache"]["freed_reported_gib"]
