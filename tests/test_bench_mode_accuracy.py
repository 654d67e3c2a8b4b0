"""bench/mode_accuracy.py (issue 36's calibration) on CPU at a tiny size: each forced mode's completions are in that
mode (direct ones start with '>', worked ones do not), the forced prefix is scored as the completion's first token,
and the free mode reports its worked fraction. No accuracy asserted: a 30-step tiny SFT policy gets none right."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e

TINY = ["device=cpu", "policy.hidden_size=64", "policy.num_layers=2", "policy.num_heads=2", "policy.num_kv_heads=1",
        "policy.intermediate_size=128", "sft.steps=20", "train.amp=none", "train.compile=none",
        "rollout.max_new_tokens=48"]


def test_mode_accuracy_forces_each_mode(tmp_path):
    out = tmp_path / "m.json"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "mode_accuracy.py"), "configs/drift.toml", *TINY,
                        "--prompts", "6", "--work", str(tmp_path / "w"), "--out", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    modes = r["modes"]
    assert set(modes) == {f"{m}/{d}" for m in ("free", "direct", "worked") for d in ("greedy", "sampled")}
    for d in ("greedy", "sampled"):
        assert modes[f"direct/{d}"]["worked_fraction"] == 0.0 and modes[f"worked/{d}"]["worked_fraction"] == 1.0
        assert modes[f"direct/{d}"]["completion_len"] >= 1 and modes[f"worked/{d}"]["completion_len"] >= 1
        assert 0.0 <= modes[f"free/{d}"]["worked_fraction"] <= 1.0
    assert r["sft"]["sft_steps"] == 20 and (tmp_path / "w" / "start_policy").is_dir()


def test_mode_prefixes_are_the_formats_first_characters():
    sys.path.insert(0, str(ROOT / "bench"))
    from types import SimpleNamespace
    from mode_accuracy import mode_prefixes
    ex = [SimpleNamespace(columns={"metadata": {"expression": "4 - 1 - 7"}, "answer": "-4"})]
    assert mode_prefixes(ex, "rewrite", 4) == {"free": [""], "direct": [">"], "worked": ["+"]}
    assert mode_prefixes(ex, "cot", None)["worked"] == ["4"]
