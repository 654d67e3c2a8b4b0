"""`specco train` at parallel.ep = 2 under torchrun (2 CPU processes, gloo), end to end on a tiny Qwen3-MoE: with plain
data parallelism and with FSDP (parallel.dp_shard = 2: the dense parameters sharded, the expert slices left to ep)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("data_axis", ["parallel.dp=2", "parallel.dp_shard=2"])
def test_specco_train_under_torchrun_at_ep2(tmp_path, data_axis):
    """A user's job: `specco train` on a tiny random Qwen3-MoE saved by transformers, under torchrun at dp 2 (or
    dp_shard 2), ep 2 (validation, SFT-free warm start on rank 0, the policy shared, EP applied in make_arm, refits, sharded
    checkpoints, evaluation and saving from the engine's whole copy): 2 steps log the aux loss, and out/policy
    holds every expert (both ep ranks' halves, changed by training; the numerics are tests/test_ep.py's)."""
    from job_helpers import job_overrides, word_problems, write_jsonl
    from test_moe_job import tiny_qwen3_moe
    from specco.model.hf_io import load_policy
    from specco.runner.report import read_jsonl
    root = Path(__file__).resolve().parents[1]
    policy = tiny_qwen3_moe(tmp_path / "moe")
    data = write_jsonl(tmp_path / "train.jsonl", word_problems(12))
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "specco",
           "train", "--policy", str(policy), "--data", str(data), "--reward", "math", "--quiet", *job_overrides(out),
           "data.eval_fraction=0.25", "policy.router_aux_loss_coef=0.05", data_axis, "parallel.ep=2"]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=480)
    assert p.returncode == 0, p.stdout[-4000:]
    steps = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in steps] == [1, 2] and all(r["policy/aux_loss"] > 0 for r in steps)
    saved = load_policy(out / "policy").state_dict()
    assert sum(".experts." in k for k in saved) == 3 * 4 * 3  # 3 sparse layers × 4 experts × gate / up / down
    # trained (the aux loss moves the routers, hence the experts' inputs and gradients), whole on every expert
    start = load_policy(policy).state_dict()
    moved = [k for k in saved if ".experts." in k and not torch.equal(saved[k], start[k].to(saved[k].dtype))]
    assert moved and {k.split(".experts.")[1].split(".")[0] for k in moved} == {"0", "1", "2", "3"}
