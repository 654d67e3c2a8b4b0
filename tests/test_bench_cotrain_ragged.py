"""bench/cotrain_ragged.py --paired at a tiny shape on CPU: both variants on the same batches, the order
alternating, and the reported outside-span cost is the stated difference of the reported means."""
import json
import subprocess
import sys

import torch

import pytest  # noqa: E402
pytestmark = pytest.mark.e2e


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


def test_loss_chunk_keeps_the_draft_loss(tmp_path):
    """--loss-chunk (train.loss_chunk) in the bench: small chunks and one chunk of the whole width train the same
    draft loss (fp32 on CPU: to rounding), so the bench can time the difference on the GPU."""
    losses = []
    for chunk in ("7", "4096"):
        out = tmp_path / f"r{chunk}.json"
        subprocess.run([sys.executable, "bench/cotrain_ragged.py", "--device", "cpu", "--hidden", "32", "--heads", "2",
                        "--kv-heads", "1", "--intermediate", "64", "--layers", "2", "--rows", "8", "--max-len", "120",
                        "--micro-batch-rows", "4", "--stride", "2", "--amp", "none", "--steps", "2", "--paired",
                        "--variants", "policy,auto", "--loss-chunk", chunk, "--out", str(out)],
                       check=True, capture_output=True, text=True)
        res = json.loads(out.read_text())
        assert res["args"]["loss_chunk"] == int(chunk)
        losses.append(res["results"]["auto"]["draft_loss"])
    assert len(losses[0]) == 2 and all(x > 0 for x in losses[0])
    for a, b in zip(*losses):
        assert abs(a - b) <= 1e-5 * abs(b)


def test_loss_chunk_reaches_the_step_config():
    import argparse
    import pathlib
    sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "bench"))
    from cotrain_ragged import variant_step
    a = argparse.Namespace(stride=2, micro_batch_rows=4, loss_chunk=4096)
    step = variant_step("auto_w16", a, None, None, {False: None, True: None}, None)
    assert step.keywords["cfg"].loss_chunk == 4096 and step.keywords["cfg"].width_multiple == 16


def test_batch_multiple_leaves_only_multiples_of_the_width():
    """--batch-multiple N (the RL loop's padding, runner/rollouts.build_batch): every micro-batch is cut to a
    multiple of N; with 1 the micro-batch holding the longest row keeps that row's exact length (a new shape
    whenever the longest row changes), which is what the bench measured before 2026-12-03."""
    import pathlib
    sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "bench"))
    from cotrain_ragged import micro_batch_cuts, ragged_batch
    odd = 0
    for seed in range(20):
        padded = ragged_batch(16, 300, 50, seed, "cpu", multiple=16)
        assert padded.tokens.shape[1] % 16 == 0
        assert all(w % 16 == 0 for _, w in micro_batch_cuts(padded, 4, 16))
        exact = ragged_batch(16, 300, 50, seed, "cpu")
        odd += any(w % 16 for _, w in micro_batch_cuts(exact, 4, 16))
        # the same rows and trained tokens, only wider
        w = exact.tokens.shape[1]
        assert torch.equal(padded.target_mask[:, :w], exact.target_mask) and padded.target_mask[:, w:].sum() == 0
    assert odd >= 15  # nearly every batch's longest row is not a multiple of 16
