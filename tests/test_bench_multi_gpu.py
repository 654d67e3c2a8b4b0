"""Issue 39's multi-GPU bench scripts at world 2 on CPU (torchrun, gloo, tiny sizes): each runs end to end under
torchrun and writes the fields the H200 runs fill; bench/multi_gpu_check.py passes and fails when it must. No timing
is asserted (CPU timings of tiny models mean nothing; the figures come from bench/device_multi_gpu.sh on the GPUs).

* multi_gpu_check: dp_shard 2, rollout.tp 2 and ep 2 equal their references within the fp64 bounds (every rank's
  weights, every step's metrics; the tp-2 engine's rollouts equal the whole engine's); a perturbed rank's weights
  fail it (exit 1, `passed` false): under FSDP on every rank (the gathered shard);
* fsdp_step / ep_step: the world-2 step on each rank (fsdp_step's layers compiled), the planner at dp_shard 2 (half
  the world-1 plan's sharded parts: params, grads, AdamW), and fsdp_step's world-1 path unchanged;
* engine_tp1 at tp 2: the shard decodes the whole engine's greedy tokens, per-engine verify and speedup fields; the
  shard built without a whole policy (--no-whole) still accepts every draft token of the agreeing pair;
* moe_verify at tp 2: one rank's shard (heads and expert widths halved), experts touched within their bounds;
* refit at dp_shard 2; device_multi_gpu.sh parses and names only scripts that exist."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e
STEP = ["--rows", "4", "--seq", "64", "--completion", "32", "--micro-rows", "2", "--draft-vocab", "256",
        "--reps", "1", "--warmup", "1"]


def _torchrun(script: str, *args: str, world: int = 2, ok: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           str(ROOT / "bench" / script), *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
                       cwd=ROOT)
    if ok:
        assert p.returncode == 0, p.stdout[-4000:]
    return p


@pytest.mark.slow  # ~20 s on 2 cores: two launches
def test_multi_gpu_check_passes_and_catches_a_perturbed_rank(tmp_path):
    out = tmp_path / "check.json"
    _torchrun("multi_gpu_check.py", "--device", "cpu", "--out", str(out))
    r = json.loads(out.read_text())
    assert r["world"] == 2 and r["passed"] and set(r["layouts"]) == {"dp_shard", "rollout_tp", "ep"}
    for name, lay in r["layouts"].items():
        assert lay["passed"] and lay["metrics"]["ok"] and len(lay["metrics"]["steps"]) == 2, name
        for step in lay["metrics"]["steps"]:  # the trainer's metrics were compared, not an empty set
            assert {"policy/loss", "draft/loss", "policy/grad_norm", "draft/grad_norm", "ppo/updates"} <= step.keys()
            assert all(v["ok"] and v["rel_dev"] <= v["bound"] for v in step.values())
        assert ("policy/aux_loss" in lay["metrics"]["steps"][0]) == lay["moe"]
        assert len(lay["params_per_rank"]) == 2
        for p in lay["params_per_rank"]:
            assert p["ok"] and p["max_abs"] < 1e-10 and p["numel"] > 0
    assert r["layouts"]["rollout_tp"]["rollouts_vs_twin"]["rows_equal"] == 1.0
    assert r["layouts"]["ep"]["rollouts_vs_twin"]["rows_equal"] == 1.0
    assert "world-1 replay" in r["layouts"]["dp_shard"]["reference"]
    assert "parallel.ep=1" in r["layouts"]["ep"]["reference"]

    # the check can fail: one rank's weights off by 10x the bound after training (one launch: a shard, so the
    # gathered weights differ on every rank; a whole copy's perturbation is caught on its own rank by the same code)
    for layout, failing in (("dp_shard", [False, False]),):
        bad = tmp_path / f"bad_{layout}.json"
        p = _torchrun("multi_gpu_check.py", "--device", "cpu", "--layouts", layout, "--perturb-rank", "1",
                      "--perturb-layout", layout, "--out", str(bad), ok=False)
        assert p.returncode != 0 and f"{layout}: FAIL" in p.stdout, p.stdout[-3000:]
        b = json.loads(bad.read_text())
        assert not b["passed"] and not b["layouts"][layout]["passed"]
        assert [x["ok"] for x in b["layouts"][layout]["params_per_rank"]] == failing
        assert b["layouts"][layout]["metrics"]["ok"]  # the metrics were logged before the perturbation


def test_fsdp_step_at_world_2_and_world_1(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    out2, out1 = tmp_path / "w2.json", tmp_path / "w1.json"
    # world 2 with the layers compiled inside FSDP (aot_eager here; the GPU run's fsdp3bc step uses inductor)
    _torchrun("fsdp_step.py", "--device", "cpu", "--sizes", "tiny", *STEP, "--compile", "aot_eager", "--out", str(out2))
    r = json.loads(out2.read_text())
    assert r["world"] == 2 and r["rows"] == 4 and r["step"]["compile"] == "aot_eager"
    row = r["sizes"]["tiny"]["fsdp2"]
    assert row["dp_shard"] == 2 and len(row["step_s_ranks"]) == 2 and row["step_s"] == max(row["step_s_ranks"])
    assert row["planned_over_measured"] is None and row["peak_bytes"] == 0  # no CUDA: no peak
    # the planner at dp_shard 2: the fp32 state sharded (half of dp_shard 1's), 2 rows a rank instead of 4
    from fsdp_step import SIZES, _planned
    from specco.model.config import DraftConfig
    from specco.train.cotrain import StepConfig
    import torch
    pc = SIZES["tiny"]
    dcfg = DraftConfig.for_policy(pc, draft_vocab_size=256)
    scfg = StepConfig(amp_dtype=torch.bfloat16, micro_batch_rows=2, draft_row_stride=8, ttt_passes=3)
    one = _planned(pc, dcfg, scfg, 4, 64, fsdp=True, shard=1)
    for k in ("params", "grads", "adamw"):
        assert row["planned"][k] == pytest.approx(one[k] / 2, rel=0.01), k
    assert row["params"] == pc.num_params and row["planned_trainer_bytes"] == sum(row["planned"].values())
    # world 1 (no torchrun): the three variants in their own processes, as before
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "fsdp_step.py"), "--device", "cpu", "--sizes", "tiny",
                        *STEP, "--out", str(out1)], capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    r1 = json.loads(out1.read_text())["sizes"]["tiny"]
    assert {"plain", "fsdp1", "plain_again", "fsdp_overhead", "plain_drift"} <= r1.keys()


def test_engine_tp2(tmp_path):
    out = tmp_path / "tp2.json"
    _torchrun("engine_tp1.py", "--device", "cpu", "--model", "tiny", "--batch-sizes", "2", "--prompt-lens", "32",
              "--iters", "1", "--reps", "1", "--out", str(out))
    r = json.loads(out.read_text())
    assert r["world"] == r["tp"] == 2 and r["device"] == "cpu"
    (row,) = r["rows"]
    assert row["greedy_tokens_equal"] and row["tau"] > 1
    for n in ("whole", "tp2"):
        for k in ("plain", "spec", "verify"):
            assert row[f"{k}_{n}_ms"] > 0
        assert row[f"tau_{n}"] > 1 and row[f"speedup_{n}"] > 0 and row[f"verify_over_step_{n}"] > 0
    assert row["plain_tp2_over_whole"] > 0 and "plain_tp1_ms" not in row
    # --no-whole: the shard built without a whole policy (build_shard) still makes the agreeing pair: the draft's
    # k = 4 tokens all accepted, as the whole-cut shard's
    out = tmp_path / "tp2_shard_only.json"
    _torchrun("engine_tp1.py", "--device", "cpu", "--model", "tiny", "--batch-sizes", "2", "--prompt-lens", "32",
              "--iters", "1", "--reps", "1", "--no-whole", "--out", str(out))
    (row,) = json.loads(out.read_text())["rows"]
    assert "plain_whole_ms" not in row and "greedy_tokens_equal" not in row
    assert row["tau_tp2"] == pytest.approx(5.0) and row["plain_tp2_ms"] > 0 and row["verify_tp2_ms"] > 0


def test_ep_step_at_ep_1_and_2(tmp_path):
    rows = {}
    for ep in (1, 2):
        out = tmp_path / f"ep{ep}.json"
        _torchrun("ep_step.py", "--device", "cpu", "--size", "tiny", "--ep", str(ep), *STEP, "--out", str(out))
        rows[ep] = r = json.loads(out.read_text())["result"]
        assert r["variant"] == f"fsdp2_ep{ep}" and r["world"] == r["dp_shard"] == 2 and r["ep"] == ep
        assert len(r["step_s_ranks"]) == 2 and r["policy_loss"] is not None and r["draft_loss"] > 0
    # the planner: at ep 2 each rank holds half the experts whole, at ep 1 FSDP shards them 2 ways: the same bytes
    assert rows[2]["planned"]["params"] == pytest.approx(rows[1]["planned"]["params"], rel=0.05)


def test_moe_verify_tp2(tmp_path):
    out = tmp_path / "mv.json"
    tiny = ["--hidden", "64", "--layers", "2", "--experts", "8", "--moe-inter", "32", "--heads", "4",
            "--kv-heads", "2", "--vocab", "256", "--batches", "1,4", "--kv", "16", "--ks", "1,3", "--rounds", "1",
            "--iters", "1"]
    _torchrun("moe_verify.py", "--device", "cpu", *tiny, "--out", str(out))
    r = json.loads(out.read_text())
    assert r["tp"] == 2
    moe = r["config"]["moe"]  # one rank's shard: heads and expert widths halved, the experts all there
    assert moe["num_heads"] == 2 and moe["moe_intermediate_size"] == 16 and moe["num_experts"] == 8
    assert r["params"]["moe"]["active"] == r["params"]["dense"]["active"]  # the twin's definition holds per shard
    for row in r["rows"]:
        for name, x in row["moe"].items():
            if not isinstance(x, dict) or "experts_touched_layers" not in x:
                continue
            n = x["tokens"]
            assert all(2 <= c <= min(8, 2 * n) for c in x["experts_touched_layers"]), (name, x)


def test_refit_at_dp_shard_2(tmp_path):
    out = tmp_path / "refit.json"
    _torchrun("refit.py", "--smoke", "--out", str(out))
    r = json.loads(out.read_text())
    assert r["world"] == 2 and all(x["seconds"] > 0 for x in r["sizes"][0]["refit"])


def test_device_driver_parses_and_names_existing_scripts():
    sh = ROOT / "bench" / "device_multi_gpu.sh"
    subprocess.run(["bash", "-n", str(sh)], check=True)
    text = sh.read_text()
    for script in set(re.findall(r"bench/(\w+\.py)", text)):
        assert (ROOT / "bench" / script).exists(), script
    assert "export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1" in text
    # every step is a case writing one JSON under $OUT; the default list (one call) brings back at most 8 files
    steps = re.findall(r"^    (\w+)\)", text, re.M)
    assert set(steps) == {"check", "fsdp3b", "fsdp3bc", "fsdp7b", "refit", "engine", "e72b", "ep1", "epN", "moe",
                          "a3b"}
    assert len(re.findall(r'--out "\$OUT/', text)) == len(steps)
    default = re.search(r"STEPS=\$\{\*:-([^}]*)\}", text).group(1).split()
    assert set(default) <= set(steps) and len(default) <= 8
