"""SFT and the draft warm start, data-parallel over 2 gloo ranks, equal the single-process stages.

`sft(..., group=WORLD)`: each rank trains on rows rank::2 of every batch (7 rows: 4 and 3, with micro-batches of 2
rows on the ranks and none in the reference), the loss divided by the batch's global completion-token count, the
gradients summed. `warm_start(..., group=WORLD)`: every rank draws the same 7 pool rows and trains the draft on its
contiguous share of them, cut at the draft row stride 2 (rows 0-3 and 4-6: the draft's rows 0, 2 and 4, 6), with
micro-batches of 2 rows on the ranks and none in the reference. Both in fp64, compared with the stage run whole in
one process on a copy of the same model: every step's loss and gradient norm (global: the same on every rank), and
every parameter after the last step. Tolerance rtol 1e-9, atol 1e-12: the two differ only in the order the per-row
terms are summed (fp64's unit roundoff is 1e-16; AdamW over 4 steps and the clip amplify it by at most a few orders
of magnitude). The ranks' models must be the same bits (torch.equal): the all-reduce gives every rank the same
gradient, and the rest is the same arithmetic.

Mutations checked: a mean instead of the sum in grad_sync.reduce_grads fails both tests (the gradient norms halve);
each rank dividing by its own token count (n_tok not all-reduced) fails the SFT test at the first loss.
"""
import copy

import pytest
import torch
import torch.distributed as dist

from specco.parallel.mesh import spawn_local

pytest.importorskip("reasoning_gym")

pytestmark = pytest.mark.dist

RTOL, ATOL = 1e-9, 1e-12


def _close(got, want, what):
    assert abs(got - want) <= RTOL * abs(want) + ATOL, (what, got, want)


def _same_on_every_rank(model):
    """rank 0's parameters, broadcast, equal this rank's bit for bit."""
    for n, p in model.named_parameters():
        mine = p.detach().clone()
        dist.broadcast(mine, src=0)
        assert torch.equal(mine, p.detach()), f"{n} differs between ranks"


def _params_close(model, ref):
    want = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), want[n].detach(), rtol=RTOL, atol=ATOL, msg=lambda s: f"{n}: {s}")


def _sft_worker(rank, world):
    from specco.train.sft import sft
    from test_sft import _setup
    tok, source, pol = _setup()
    pol = pol.double()
    ref = copy.deepcopy(pol)
    kw = dict(steps=4, batch_size=7, lr=3e-3, seed=0, warmup=2, progress=False)
    m_ref = sft(ref, tok, source, **kw)
    m = sft(pol, tok, source, micro_batch_rows=2, group=dist.group.WORLD, **kw)
    assert m["offset"] == m_ref["offset"] == 28
    for i, (a, b) in enumerate(zip(m["losses"], m_ref["losses"])):
        _close(a, b, f"loss at step {i}")
    for i, (a, b) in enumerate(zip(m["grad_norms"], m_ref["grad_norms"])):
        _close(a, b, f"grad norm at step {i}")
    _params_close(pol, ref)
    _same_on_every_rank(pol)


def test_sft_at_world_2_equals_one_process():
    spawn_local(_sft_worker, 2)


def _pool():
    from test_cp_cotrain import V
    g = torch.Generator().manual_seed(3)
    N, S = 10, 14
    tokens = torch.randint(0, V, (N, S), generator=g)
    mask = torch.zeros(N, S)
    for b in range(N):
        mask[b, 4:S - b % 4] = 1  # completions of different lengths, then right padding
    return tokens, mask


def _warm_worker(rank, world):
    from specco.runner.warmstart import warm_start
    from specco.train.cotrain import StepConfig
    from test_cp_cotrain import _models
    policy, draft = _models()
    ref = copy.deepcopy(draft)
    tokens, mask = _pool()
    kw = dict(steps=4, lr=1e-2, batch_size=7, seed=0, progress=False)
    h_ref = warm_start(policy, ref, tokens, mask, scfg=StepConfig(ttt_passes=2, draft_row_stride=2), **kw)
    h = warm_start(policy, draft, tokens, mask, group=dist.group.WORLD,
                   scfg=StepConfig(ttt_passes=2, draft_row_stride=2, micro_batch_rows=2), **kw)
    for i, (a, b) in enumerate(zip(h, h_ref)):
        for key in ("draft/loss", "draft/grad_norm", "draft/sim_accept_len"):
            _close(float(a[key]), float(b[key]), f"{key} at step {i}")
    _params_close(draft, ref)
    _same_on_every_rank(draft)


def test_dp_rows_cut_at_the_draft_stride():
    from specco.model.config import ConfigError
    from specco.runner.warmstart import dp_rows
    assert [dp_rows(7, 2, r, 2) for r in range(2)] == [slice(0, 4), slice(4, 7)]
    assert [dp_rows(64, 8, r, 3) for r in range(3)] == [slice(0, 16), slice(16, 40), slice(40, 64)]
    with pytest.raises(ConfigError, match="train.warm_start_batch >= 16"):
        dp_rows(5, 8, 0, 2)


def test_warm_start_at_world_2_equals_one_process():
    spawn_local(_warm_worker, 2)
