"""bench/long_context_probe.py --train-steps on CPU at a tiny size: every variant timed on the same batches, and the
EAGLE-3 draft trains the same loss from the first trained column on as at every anchor (train/drafters.first_anchor:
the long-context saving is exact), and the shared-prompt variants train the unshared ones' losses. No timing is asserted (CPU timings of a tiny model mean nothing).

Tolerance: the two EAGLE-3 variants run the same fp32 math on the same weights (lr 0) with the trunk attention split
into a prefix block and a causal square merged in fp32 instead of one causal block: 1e-5 relative."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e


def test_long_context_probe_train_step(tmp_path):
    # completions of 300-400 random tokens use every id of the char vocabulary: DFlash's mask token must then be the
    # pad id (the runner's fallback), as at the run's shapes (its first H100 run stopped there, 2026-12-07)
    out = tmp_path / "probe.json"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "long_context_probe.py"), "--device", "cpu",
                        "--decode", "0", "--train-steps", "1", "--train-rows", "4", "--completion", "300,400", "--set",
                        "policy.hidden_size=32", "policy.num_layers=2", "policy.num_heads=2", "policy.num_kv_heads=2",
                        "policy.intermediate_size=64", "data.context_tokens=[200,300]", "train.amp=none",
                        "--profile", "policy_shared", "--out", str(out)], capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())["train"]
    assert set(r["step_s"]) == {"policy", "eagle3", "eagle3_whole", "dflash", "policy_shared", "eagle3_shared",
                                "dflash_shared", "policy_shared_copied"}
    assert all(len(v) == 1 and v[0] > 0 for v in r["steps_s"].values())
    assert set(r["first_pass_s"]) == set(r["steps_s"]) and all(len(v) == 1 and v[0] > 0
                                                                for v in r["first_pass_s"].values())
    assert set(r["draft_overhead_s"]) == {"eagle3", "eagle3_whole", "dflash", "eagle3_shared", "dflash_shared"}
    # the segments' attention with the prefix copied per segment (as before) trains the same loss (fp32: 1e-5)
    (c,), = r["policy_loss"]["policy_shared_copied"],
    assert c == pytest.approx(r["policy_loss"]["policy_shared"][0], rel=1e-5)
    # the shared prompts' step trains the same policy loss (fp32, other shapes: 1e-5) and the same draft loss
    # the profile's kernels (on CPU: its ops, nested) are what the step ran, each a positive share
    prof = r["profile"]["policy_shared"]
    assert prof["wall_s"] > 0 and prof["kernel_s"] > 0 and prof["top"]
    assert all(t["ms"] > 0 and 0 < t["share"] <= 1 for t in prof["top"])
    (p,), (q,) = r["policy_loss"]["policy"], r["policy_loss"]["policy_shared"]
    assert q == pytest.approx(p, rel=1e-5)
    for kind in ("eagle3", "dflash"):
        (a,), (b,) = r["draft_loss"][kind], r["draft_loss"][f"{kind}_shared"]
        assert b == pytest.approx(a, rel=1e-5)
    assert r["rows"] == 4 and r["width"] % 128 == 0 and r["peak_gib"] == {}  # CUDA only
    (a,), (b,) = r["draft_loss"]["eagle3"], r["draft_loss"]["eagle3_whole"]
    assert a == pytest.approx(b, rel=1e-5) and a > 0


def test_long_context_probe_settings_in_one_process(tmp_path):
    # the same variants and batches under each (compile, checkpointing) setting in one process; neither changes the
    # loss: checkpointing recomputes the same forward, aot_eager captures it without generating code (fp32: 1e-5)
    out = tmp_path / "probe.json"
    cmd = [sys.executable, str(ROOT / "bench" / "long_context_probe.py"), "--device", "cpu", "--decode", "0",
           "--train-steps", "1", "--train-rows", "4", "--completion", "30,40", "--set", "policy.hidden_size=32",
           "policy.num_layers=2", "policy.num_heads=2", "policy.num_kv_heads=2", "policy.intermediate_size=64",
           "data.context_tokens=[100,150]", "train.amp=none", "--variants", "policy_shared", "dflash_shared"]
    p = subprocess.run(cmd + ["--settings", "none:on", "aot_eager:off", "aot_eager:on", "--out", str(out)],
                       capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())["train"]["settings"]
    assert list(r) == ["none:on", "aot_eager:off", "aot_eager:on"]
    for s in r.values():
        assert set(s["step_s"]) == {"policy_shared", "dflash_shared"}
        assert set(s["draft_overhead_s"]) == {"dflash_shared"}
        for name in ("policy_shared", "dflash_shared"):
            assert s["policy_loss"][name][0] == pytest.approx(r["none:on"]["policy_loss"][name][0], rel=1e-5)
        assert s["draft_loss"]["dflash_shared"][0] == pytest.approx(r["none:on"]["draft_loss"]["dflash_shared"][0],
                                                                    rel=1e-5)
    bad = subprocess.run(cmd + ["--settings", "inductor:yes"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode != 0 and "write COMPILE:on or COMPILE:off" in bad.stderr
