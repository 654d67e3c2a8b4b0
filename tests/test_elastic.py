"""Elastic restart under torchrun --max-restarts.

torchrun's agent keeps one TCPStore for the whole job; a restarted worker that rendezvoused in it unprefixed read
the gloo addresses the killed attempt's workers had left there and connected to dead ports ("Connection refused"
in init_process_group, or a hang: 1 run in 4 of the test below, 3 of 4 launches of the worker test).
parallel/mesh.py gives each attempt its own namespace (TORCHELASTIC_RESTART_COUNT), which
test_each_attempt_has_its_own_store_namespace checks deterministically. Mutations checked: `_attempt_store`
returning the store without its prefix fails that test; returning no store (plain env://) made the worker launches
below fail or hang in 3 of 4 tries (rank 0 or rank 1 late, --standalone or an explicit c10d endpoint) but pass in
another try of both: the race is torch's, so those launches show the restart works, not that it cannot break.

The worker test (tests/elastic_worker.py): rank 1 exits after the group formed, the restarted attempt must form
its group again with one rank 3 s late (reading the store before its peer wrote to it), and all-reduce.

The run test: `specco train` under `torchrun --max-restarts=1` at parallel.dp=2, rank 1 killed in the middle
of an RL step (after its PPO updates, before the refit: faults.py's SPECCO_FAULT="rl_step/updated#2@1", fired
once through a marker file). torchrun stops the surviving rank, starts both again, the pipeline finds its SFT and
warm-start stages done, and each arm resumes from its last sharded checkpoint (every rank reading its own slices
from the shared out_dir). The finished run's metrics.jsonl, every arm's, equals an uninterrupted run's number
for number (losses and grad norms at full float precision: the resume is bit-exact).

The kill is real (os._exit at the point, status 43, asserted in torchrun's log) and the marker file proves the
fault fired; a resume that lost state shows in the rows of steps 2 and 3 (test_rl_reshard / test_dp check the
checkpoint's contents number by number).
"""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from specco.faults import KILLED_EXIT

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["train", str(ROOT / "configs" / "demo.toml"), "--quiet", "parallel.dp=2", "policy.hidden_size=32",
        "policy.num_layers=2", "draft.aux_layer_ids=[]", "policy.num_heads=2", "policy.num_kv_heads=1",
        "policy.intermediate_size=64", "sft.steps=4", "train.warm_start_steps=2", "train.warm_start_prompts=8",
        "train.steps=3", "train.checkpoint_every=1", "rollout.prompts_per_step=4", "rollout.group_size=2",
        "rollout.max_new_tokens=6", "data.eval_size=4"]
COMPARED = ("policy/loss", "draft/loss", "policy/grad_norm", "draft/grad_norm", "reward", "tau", "draft/tokens")
ARMS = ("none", "frozen", "cotrained")

pytestmark = pytest.mark.e2e


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(args: list, env: dict, rdzv: list, timeout: float) -> str:
    """torchrun with 2 local workers and one restart; its output (the run must succeed)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", *rdzv, "--nproc-per-node=2",
           "--max-restarts=1", "--monitor-interval=0.5", *args]
    try:
        p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired as e:  # the hang this file guards against
        raise AssertionError(f"torchrun hung past {timeout} s: {str(e.stdout)[-3000:]}") from None
    assert p.returncode == 0, p.stdout[-4000:]
    return p.stdout


STANDALONE = ["--standalone"]


def _endpoint() -> list:
    return ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}", "--rdzv-id=specco-elastic"]


def test_each_attempt_has_its_own_store_namespace(monkeypatch):
    """What the fix is, deterministically (the launches below race): through mesh._attempt_store, a key the ranks
    of attempt 0 wrote to torchrun's store is invisible to attempt 1, and visible to attempt 0's other ranks."""
    import datetime

    import torch.distributed as dist

    from specco.parallel.mesh import _attempt_store
    timeout = datetime.timedelta(seconds=30)
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timeout)  # the agent's store
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port), "WORLD_SIZE": "2",
           "TORCHELASTIC_USE_AGENT_STORE": "True"}

    def store(attempt: int, rank: int):
        for k, v in {**env, "RANK": str(rank), "TORCHELASTIC_RESTART_COUNT": str(attempt)}.items():
            monkeypatch.setenv(k, v)
        s, r, w = _attempt_store(timeout)
        assert (r, w) == (rank, 2)
        return s

    store(0, 1).set("rank_1", "attempt 0's address")
    assert store(0, 0).get("rank_1") == b"attempt 0's address"
    assert not store(1, 0).check(["rank_1"])  # attempt 1's rank 0 waits for attempt 1's rank 1
    store(1, 1).set("rank_1", "attempt 1's address")
    assert store(1, 0).get("rank_1") == b"attempt 1's address"
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    assert _attempt_store(timeout) == (None, 0, 0)  # outside torchrun: torch's own env://


@pytest.mark.parametrize("late, rdzv", [(0, STANDALONE), (1, None)], ids=["rank0-late-standalone",
                                                                          "rank1-late-endpoint"])
def test_restarted_attempt_forms_its_group_again(late, rdzv):
    out = _torchrun([str(ROOT / "tests" / "elastic_worker.py"), "60", str(late)], {}, rdzv or _endpoint(), 120)
    # attempt 0 formed its group and lost rank 1, and torchrun reported a failed worker: rank 1's own exit
    # (KILLED_EXIT) or, when the agent sees it first on a loaded machine, rank 0's broken connection to it
    assert "attempt 0 rank 1 sum 2" in out and "(exitcode: " in out, out[-3000:]
    for r in (0, 1):
        assert f"attempt 1 rank {r} sum 2" in out, out[-3000:]


def _train(out: Path, fault: dict) -> str:
    # --standalone, the command a user types for one node (README)
    return _torchrun(["-m", "specco", *ARGS, f"out_dir={out}"], fault, STANDALONE, 900)


def _rows(run: Path) -> dict:
    return {arm: [json.loads(x) for x in (run / "arms" / arm / "metrics.jsonl").read_text().splitlines()]
            for arm in ARMS}


@pytest.mark.slow
def test_rank_killed_mid_step_restarts_and_equals_uninterrupted(tmp_path):
    marker = tmp_path / "fault_fired"
    # the 2nd time rank 1 finishes its updates: step 2 of the first arm, after step 1's checkpoint
    log = _train(tmp_path / "killed", {"SPECCO_FAULT": "rl_step/updated#2@1", "SPECCO_FAULT_ONCE": str(marker)})
    assert marker.exists(), "the fault never fired"
    assert f"(exitcode: {KILLED_EXIT})" in log, log[-3000:]  # torchrun saw the kill, and restarted
    _train(tmp_path / "straight", {})
    killed, straight = _rows(tmp_path / "killed"), _rows(tmp_path / "straight")
    for arm in ARMS:
        assert [r["step"] for r in killed[arm]] == [1, 2, 3], arm
        for a, b in zip(killed[arm], straight[arm]):
            for k in COMPARED:
                if k in b:
                    assert a[k] == b[k], (arm, a["step"], k, a[k], b[k])
