"""`specco train` at parallel.dp=2 runs its start-up stages on every rank (runner/prepare.py): SFT and the draft
warm start data-parallel over both ranks (each called with a process group), and their outputs — rank 0's
out_dir/start_policy and out_dir/warm_draft — equal the same job's in one process. A second launch finds both
stages done (rank 0 decides, for every rank) and runs neither.

Tolerance: rtol 1e-4 on the SFT loss, rtol 1e-4 and atol 1e-5 on every weight. The two runs differ only in the
order fp32 terms are summed (two ranks' partial gradients, then the all-reduce), ~1e-7 relative; AdamW divides
each update by the root of its squared-gradient average, so a weight whose gradient is near zero can move by a
visibly different fraction of the learning rate (seen: 4e-6 on one of 1,024 draft weights): hence the atol. The
exact equality of the stages is tests/test_sft_dp.py's (fp64, 1e-9); this test is the pipeline's wiring.
"""
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specco.parallel.mesh import spawn_local

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
ARGS = [str(ROOT / "configs" / "demo.toml"), "--quiet", "policy.hidden_size=32", "policy.num_layers=2",
        "draft.aux_layer_ids=[]", "policy.num_heads=2", "policy.num_kv_heads=1", "policy.intermediate_size=64",
        "sft.steps=4", "sft.batch=8", "train.warm_start_steps=2", "train.warm_start_prompts=8",
        "train.warm_start_batch=16", "train.steps=1", "rollout.prompts_per_step=4", "rollout.group_size=2",
        "rollout.max_new_tokens=6", "data.eval_size=2", "train.eval_every=0", "arms=cotrained"]


def _job(rank, world, out, calls_file):
    os.environ["WORLD_SIZE"] = str(world)
    from specco.cli import main
    from specco.runner import prepare
    calls = []
    for name in ("sft", "warm_start"):
        real = getattr(prepare, name)

        def spy(*a, _real=real, _name=name, **kw):
            calls.append([_name, kw.get("group") is not None])
            return _real(*a, **kw)
        setattr(prepare, name, spy)
    main(["train", *ARGS, f"out_dir={out}", f"parallel.dp={world}"])
    Path(f"{calls_file}.{rank}").write_text(json.dumps(calls))


def _calls(path, world):
    return [json.loads(Path(f"{path}.{r}").read_text()) for r in range(world)]


def _weights(d: Path) -> dict:
    return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_start_stages_run_on_every_rank_and_equal_one_process(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    _job(0, 1, one, tmp_path / "calls_one")
    spawn_local(_job, 2, two, tmp_path / "calls_two")
    assert _calls(tmp_path / "calls_one", 1) == [[["sft", False], ["warm_start", False]]]
    assert _calls(tmp_path / "calls_two", 2) == [[["sft", True], ["warm_start", True]]] * 2  # both ranks, DP
    a = json.loads((one / "start_policy" / "sft_metrics.json").read_text())
    b = json.loads((two / "start_policy" / "sft_metrics.json").read_text())
    assert b["sft_final_loss"] == pytest.approx(a["sft_final_loss"], rel=1e-4)
    for stage in ("start_policy", "warm_draft"):
        wa, wb = _weights(one / stage), _weights(two / stage)
        assert wa.keys() == wb.keys() and wa
        for k in wa:
            torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-5, msg=lambda s: f"{stage} {k}: {s}")
    spawn_local(_job, 2, two, tmp_path / "again")  # both stages done: rank 0 says so, no rank runs them
    assert _calls(tmp_path / "again", 2) == [[], []]
