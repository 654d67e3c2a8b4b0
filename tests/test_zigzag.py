"""Zigzag layout (docs/DESIGN.md §4): shard/unshard round trip, positions, local borders, padding — no processes.

Also the CP shift's *index plan* for cp > 1, checked without processes by emulating the all_gather
(every rank's heads are computable here), and cp = 1 packing semantics of `cp_shift`. All exact
(integer / copy semantics): compared with torch.equal.
"""
import pytest
import torch

from specco.parallel import cp as cp_mod
from specco.parallel.zigzag import (ZigzagLayout, chunk_sizes, local_cu_seqlens, positions, shard, unshard,
                                    valid_mask)

PACKS = [(0, 10), (0, 7, 8, 21, 24), (0, 1, 3, 40), (0, 5, 5, 12)]  # incl. len 1, 2, 3 and an empty sequence


def test_worked_example():
    # L = 10, cp = 2: c = 3, padded to 12; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    x = torch.arange(10).view(1, 10)
    assert shard(x, (0, 10), 2, 0).tolist() == [[0, 1, 2, 9, 0, 0]]
    assert shard(x, (0, 10), 2, 1).tolist() == [[3, 4, 5, 6, 7, 8]]
    assert positions((0, 10), 2, 0).tolist() == [0, 1, 2, 9, 10, 11]
    assert valid_mask((0, 10), 2, 0).tolist() == [True] * 4 + [False] * 2


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("cu", PACKS)
def test_round_trip_positions_and_borders(cp, cu):
    T = cu[-1]
    x = torch.randn(2, T, 3)
    parts = [shard(x, cu, cp, r, dim=1) for r in range(cp)]
    assert torch.equal(unshard(parts, cu, dim=1), x)
    lcu = local_cu_seqlens(cu, cp)
    cs = chunk_sizes(cu, cp)
    lens = [b - a for a, b in zip(cu, cu[1:])]
    for r in range(cp):
        assert parts[r].shape == (2, lcu[-1], 3)
        pos, valid = positions(cu, cp, r), valid_mask(cu, cp, r)
        for (s, e), c, L, a in zip(zip(lcu, lcu[1:]), cs, lens, cu):
            assert e - s == 2 * c and 2 * cp * c >= L and (c == 0 or 2 * cp * (c - 1) < L)
            p = pos[s:e]
            # front chunk r, back chunk 2cp-1-r, each contiguous and increasing: local order is sorted.
            assert p.tolist() == list(range(r * c, (r + 1) * c)) + list(range((2 * cp - 1 - r) * c, (2 * cp - r) * c))
            assert torch.equal(valid[s:e], p < L)
            # real tokens hold x at their global position; pads hold zeros.
            loc = parts[r][:, s:e]
            assert torch.equal(loc[:, p < L], x[:, a + p[p < L]])
            assert not loc[:, p >= L].any()
    # every real global position is held exactly once across ranks
    held = torch.cat([positions(cu, cp, r)[valid_mask(cu, cp, r)] for r in range(cp)])
    assert held.numel() == T


def test_shard_other_dims_and_dtypes():
    cu = (0, 6, 9)
    for dtype in (torch.bool, torch.int64, torch.bfloat16):
        x = (torch.rand(4, 9, 2) > 0.5).to(dtype)  # (H, T, D): shard along dim -2
        parts = [shard(x, cu, 3, r, dim=-2) for r in range(3)]
        assert all(p.dtype == dtype for p in parts)
        assert torch.equal(unshard(parts, cu, dim=-2), x)


def test_layout_object_and_validation():
    lay = ZigzagLayout([0, 7, 8], cp=3, rank=2)
    assert lay.chunks == (2, 1) and lay.local_cu_seqlens == (0, 4, 6) and lay.num_local == 6
    assert lay.seq_slices() == [(0, 2), (4, 1)]
    with pytest.raises(ValueError):
        ZigzagLayout((0, 4), cp=2, rank=2)
    with pytest.raises(ValueError):
        ZigzagLayout((1, 4), cp=2, rank=0)
    with pytest.raises(ValueError):
        shard(torch.zeros(1, 5), (0, 4), 2, 0)


def _ref_shift(x, cu, d):
    """Single-process packed shift: y[i] = x[i+d] within each sequence, 0 past its end. x (B, T, ...)."""
    y = torch.zeros_like(x)
    for a, b in zip(cu, cu[1:]):
        if b - a > d:
            y[:, a:b - d] = x[:, a + d:b]
    return y


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("cu", PACKS)
def test_shift_plan_emulated(cp, cu):
    """The CP shift's index plan, with the all_gather emulated: unshard(shifted shards) == packed shift."""
    x = torch.randn(2, cu[-1], 3)
    lays = [ZigzagLayout(cu, cp, r) for r in range(cp)]
    xs = [lay.shard(x) for lay in lays]
    for d in (1, 2, 3, 5):
        heads = torch.cat([xs[r].index_select(1, cp_mod._shift_plan(lays[r], d)[0]) for r in range(cp)], 1)
        ys = []
        for r, lay in enumerate(lays):
            table = torch.cat([xs[r], heads, torch.zeros_like(xs[r][:, :1])], 1)
            ys.append(table.index_select(1, cp_mod._shift_plan(lay, d)[1]))
            assert not ys[-1][:, ~lay.valid()].any(), "pad tokens must shift in zeros"
        assert torch.equal(lays[0].unshard(ys), _ref_shift(x, cu, d)), (cp, cu, d)


def test_cp_shift_single_rank_packing():
    cu = (0, 4, 5, 11)
    lay = ZigzagLayout(cu, 1, 0)
    x = torch.arange(11).view(1, 11)
    for d in (0, 1, 2, 4):
        assert torch.equal(lay.unshard([cp_mod.cp_shift(lay.shard(x), d, None, lay)]), _ref_shift(x, cu, d))
    with pytest.raises(ValueError):
        cp_mod.cp_shift(torch.zeros(1, 12, requires_grad=True), 1, None, lay)
