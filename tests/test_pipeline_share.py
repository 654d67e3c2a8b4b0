"""`specco train --policy DIR` at parallel.dp=2 (two gloo processes on one machine, so both can read DIR): the
ranks other than 0 read the policy from DIR themselves (runner/setup.share_policy: no SFT stage, every rank reads,
the sha256 digests agree), and the run equals, number for number, the same run with those reads failing, where
the policy is broadcast as tensors instead (share_model) — and with rank 0's out_dir the only one written.

Tolerance: none. Both paths give rank 1 the same bits (the digest says so), so every later number is the same
arithmetic; a copy that differed in one weight would change the losses at the first update.
Mutation checked: rank 1's read copy off by 1e-3 in the final norm with the digest comparison skipped fails here
(draft/loss differs at step 1); with the comparison kept, the same perturbation is caught: rank 1 falls back to
the broadcast (which this test reports as the read path not taken).
"""
import json
import os

import pytest

from specco.parallel.mesh import spawn_local
from job_helpers import job_overrides, tiny_llama, word_problems, write_jsonl

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

COMPARED = ("policy/loss", "draft/loss", "policy/grad_norm", "draft/grad_norm", "reward", "tau")


def _job(rank, world, llama, data, out, unreadable):
    os.environ["WORLD_SIZE"] = str(world)
    from specco.cli import main
    from specco.model.policy import Policy
    from specco.runner import setup
    sent = []
    real = setup.share_model

    def share_model(model, mesh, device):  # record whether a policy crossed the wire
        got = real(model, mesh, device)
        sent.append(isinstance(got, Policy))
        return got
    setup.share_model = share_model
    if unreadable and rank != 0:
        setup.load_policy = lambda *a, **k: (_ for _ in ()).throw(OSError("not on this node"))
    main(["train", "--policy", str(llama), "--data", str(data), "--reward", "math", "--quiet",
          *job_overrides(out), "parallel.dp=2", "train.eval_every=0", "data.eval_size=0"])
    assert any(sent) == unreadable, (rank, sent)


def test_ranks_read_the_source_or_receive_it_with_the_same_result(tmp_path):
    llama = tiny_llama(tmp_path / "llama")
    data = write_jsonl(tmp_path / "train.jsonl", word_problems(12))
    runs = {}
    for unreadable in (False, True):
        out = tmp_path / f"run_{unreadable}"
        spawn_local(_job, 2, llama, data, out, unreadable)
        runs[unreadable] = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in runs[False]] == [1, 2]
    for a, b in zip(runs[False], runs[True]):
        for k in COMPARED:
            if k in a:
                assert a[k] == b[k], (k, a[k], b[k])
