"""The micro-batch row indices reach the device in one copy that does not wait (batch.device_indices).

On the H200 the per-micro-batch `torch.tensor(idx, device=cuda)` copies synchronized the stream 5 times per
micro-batch, so the host could never run ahead of the GPU (see batch.device_indices). The CPU tests check
that the indices and the micro-batches are exactly what they were; the CUDA test (skipped without a GPU, run
by bench/device_tests.sh) that building and using them does not synchronize.
"""
from __future__ import annotations

import pytest
import torch

from specco.batch import TrainBatch, device_indices
from specco.train.cotrain import micro_batch_cuts, micro_batches


def _batch(B=13, S=40, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, S + 1, (B,), generator=g)
    col = torch.arange(S)
    mask = ((col[None] >= 2) & (col[None] < lengths[:, None])).float()
    return TrainBatch(tokens=torch.randint(0, 50, (B, S), generator=g), target_mask=mask,
                      advantages=torch.randn(B, generator=g), logp_old=torch.randn(B, S, generator=g)).to(device)


def test_device_indices_are_the_groups_in_order_with_empty_ones():
    groups = [[4, 1, 7], [], [0], [2, 2, 9, 3]]
    got = device_indices(groups, "cpu")
    assert [t.tolist() for t in got] == groups
    assert all(t.dtype == torch.long for t in got)


def test_micro_batches_take_the_cut_rows_and_the_draft_rows_of_the_stride():
    b = _batch()
    cuts = micro_batch_cuts(b, 4, width_multiple=8)
    parts = list(micro_batches(b, 4, draft_stride=3, width_multiple=8))
    assert len(parts) == len(cuts)
    for (idx, width), (sel, mb) in zip(cuts, parts):
        # the reference: rows by a host-side index, cut to the width; draft rows those with index % 3 == 0
        ref = b.take(torch.tensor(idx)).trimmed(width)
        for name in ("tokens", "target_mask", "advantages", "logp_old"):
            assert torch.equal(getattr(mb, name), getattr(ref, name)), name
        assert sel.tolist() == [i for i, r in enumerate(idx) if r % 3 == 0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: what it checks is a device sync")
def test_device_indices_and_take_do_not_synchronize_the_device():
    b = _batch(device="cuda")
    cuts = micro_batch_cuts(b, 4, width_multiple=8)  # the one host read of the lengths, before the loop
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing call below raises
    try:
        rows = device_indices([idx for idx, _ in cuts], "cuda")
        parts = [b.take(r).trimmed(w) for r, (_, w) in zip(rows, cuts)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for (idx, width), mb in zip(cuts, parts):
        assert torch.equal(mb.tokens, b.tokens[idx, :width])
