"""bench/draft_dispatch.py: counts one PPO update's aten ops, policy alone and with each draft kind, on a two-layer
drift policy. The property drift.md's argument rests on is checked, not a hard-coded count: a draft update's extra
ops do not depend on how many rows it trains on (draft_row_stride 1 vs 2), and each draft adds ops."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_counts(tmp_path):
    out = tmp_path / "dd.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "draft_dispatch.py"), "--set",
                           "rollout.prompts_per_step=4", "policy.num_layers=2", "--strides", "1,2",
                           "--completion", "20,40", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["layers"] == 2 and res["rows"] == 4 * 8 // 4  # prompts x group_size / minibatches
    assert res["policy_ops"] > 100
    extra = res["draft_extra_ops"]
    assert set(extra) == {"eagle3_stride1", "eagle3_stride2", "dflash_stride1", "dflash_stride2"}
    for kind in ("eagle3", "dflash"):
        assert extra[f"{kind}_stride1"] > 100, extra
        assert extra[f"{kind}_stride1"] == extra[f"{kind}_stride2"], extra
