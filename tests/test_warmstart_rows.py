"""The draft warm start (runner/warmstart.warm_start) runs the policy only on the draft's rows: the batch's rows
0 mod train.draft_row_stride, the only ones the draft trains on. Its draft equals the co-training step's on the
whole batch at that stride (the policy's forward over every row, as before), step by step, in fp64: rows are
independent in the policy's forward, so only the batch shape differs (tolerance 1e-9 relative as
tests/test_sft_dp.py's); and the policy sees a stride-th of the rows."""
import copy

import pytest
import torch

from specco.runner.warmstart import warm_start
from specco.train.cotrain import StepConfig, TrainBatch, build_optimizer, cotrain_step

from test_long_prompt_cut import _models


def _pool():
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(1, 60, (12, 30), generator=g)
    mask = torch.zeros(12, 30)
    for r in range(12):
        p = int(torch.randint(8, 16, (1,), generator=g))
        mask[r, p:p + int(torch.randint(4, 14, (1,), generator=g))] = 1
    return tokens, mask


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_warm_start_runs_the_policy_on_draft_rows_only(kind):
    policy, draft = _models(kind)
    ref = copy.deepcopy(draft)
    tokens, mask = _pool()
    scfg = StepConfig(ttt_passes=2, draft_row_stride=4, draft_grad_clip=1e9)
    steps, lr, batch = 3, 1e-2, 8
    rows = []
    hook = policy.register_forward_hook(lambda mod, args, out: rows.append(args[0].shape[0]))
    hist = warm_start(policy, draft, tokens, mask, steps, lr, batch_size=batch, scfg=scfg, seed=0, progress=False)
    hook.remove()
    assert rows == [2] * steps  # 8 rows at stride 4: the draft's 2

    # the step before: the policy on all 8 rows, the draft on rows 0 and 4 (the same optimizer and schedule)
    opt = build_optimizer(None, ref, lr, lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(1, steps // 10)) * max(0.1, 1 - s / max(1, steps)))
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        idx = torch.randint(0, tokens.shape[0], (batch,), generator=g)
        m = cotrain_step(policy, ref, TrainBatch(tokens=tokens[idx], target_mask=mask[idx]), opt, sched, scfg,
                         train_policy=False)
        for key in ("draft/loss", "draft/grad_norm"):
            assert hist[step][key] == pytest.approx(m[key], rel=1e-9), (step, key)
    for a, b in zip(draft.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
