"""bench/cotrain_ragged.py --paired at a tiny shape on CPU: both variants on the same batches, the order
alternating, and the reported outside-span cost is the stated difference of the reported means."""
import json
import subprocess
import sys


def test_paired_mode_reports_both_orders_and_the_outside_span_cost(tmp_path):
    out = tmp_path / "r.json"
    subprocess.run([sys.executable, "bench/cotrain_ragged.py", "--device", "cpu", "--hidden", "32", "--heads", "2",
                    "--kv-heads", "1", "--intermediate", "64", "--layers", "2", "--rows", "8", "--max-len", "200",
                    "--micro-batch-rows", "4", "--stride", "2", "--amp", "none", "--steps", "4", "--paired",
                    "--variants", "policy,auto", "--out", str(out)], check=True, capture_output=True, text=True)
    res = json.loads(out.read_text())["results"]
    for name in ("policy", "auto"):
        r = res[name]
        assert len(r["step_s"]) == 4 and r["mean_first_s"] > 0 and r["mean_second_s"] > 0
    assert res["policy"]["draft_span_s"] == 0.0 and res["auto"]["draft_span_s"] > 0
    expected = res["auto"]["mean_s"] - res["policy"]["mean_s"] - res["auto"]["draft_span_s"]
    assert abs(res["draft_outside_span_s"] - expected) < 1e-12


def test_paired_mode_needs_two_variants(tmp_path):
    r = subprocess.run([sys.executable, "bench/cotrain_ragged.py", "--device", "cpu", "--hidden", "32", "--heads", "2",
                        "--kv-heads", "1", "--intermediate", "64", "--layers", "2", "--rows", "4", "--max-len", "64",
                        "--steps", "1", "--paired", "--variants", "policy,auto,flash", "--amp", "none",
                        "--out", str(tmp_path / "r.json")], capture_output=True, text=True)
    assert r.returncode != 0 and "exactly two variants" in r.stderr


def test_fixed_lengths_bring_no_new_shapes_and_profile_writes_both_orders(tmp_path):
    out, prof = tmp_path / "r.json", tmp_path / "prof"
    subprocess.run([sys.executable, "bench/cotrain_ragged.py", "--device", "cpu", "--hidden", "32", "--heads", "2",
                    "--kv-heads", "1", "--intermediate", "64", "--layers", "2", "--rows", "8", "--max-len", "200",
                    "--micro-batch-rows", "4", "--stride", "2", "--amp", "none", "--steps", "2", "--paired",
                    "--variants", "policy_w16,auto_w16", "--fixed-lengths", "--profile", str(prof), "--out", str(out)],
                   check=True, capture_output=True, text=True)
    res = json.loads(out.read_text())["results"]
    for name in ("policy_w16", "auto_w16"):  # step 0 ran every shape: no timed step brings a new one
        assert res[name]["n_first_new_shapes"] == 0 and res[name]["n_first_seen_shapes"] == 1
        assert len(res[name]["step_s"]) == 2  # the profiled steps are not timed
        for order in ("first", "second"):
            assert "aten::" in (prof / f"{order}_{name}.txt").read_text()
