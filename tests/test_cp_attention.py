"""Zigzag ring attention and the CP shift vs single-process references, on cp gloo processes.

Inputs are built globally (same seed on every rank), sharded with the production `ZigzagLayout`, run
through `ring_ttt_attention` / `cp_shift`, gathered and unsharded, then compared with:
* attention: `dense_ttt_reference` (pure torch, explicit mask, autograd) run per sequence of the pack —
  out, lse and the gradients of q, trunk k/v and branch k/v; TTT passes 1..3 (P = 0, 1, 2 branch keys);
  MHA and GQA; a pack of unequal lengths including sequences shorter than 2·cp; B = 2 rows;
* shift: the packed single-process shift (zero past each sequence's end), float and integer tensors.

Tolerances (why):
* fp64: 1e-10 abs/rel — same math, only the merge's summation order differs.
* fp32 vs the fp64 reference: atol 1e-5, rtol 1e-4 — fp32 eps 1.2e-7, sums over <= 40 keys of O(1)
  scores with a different merge order per cp; a wrong block/mask/merge gives O(1e-1) errors.
* shift: exact (pure data movement).
"""
import pytest
import torch
import torch.distributed as dist

from specco.ops.reference import dense_ttt_reference
from specco.parallel.cp import cp_shift
from specco.parallel.mesh import spawn_local
from specco.parallel.ring_attention import ring_ttt_attention
from specco.parallel.zigzag import ZigzagLayout

CU = (0, 13, 14, 16, 37)  # lengths 13, 1, 2, 21: two sequences shorter than 2·cp for cp >= 2
B, D = 2, 8
TOL = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-4, atol=1e-5)}

pytestmark = pytest.mark.dist


def _gather_unshard(x, lay, dim):
    parts = [torch.empty_like(x) for _ in range(lay.cp)]
    dist.all_gather(parts, x.contiguous())
    return lay.unshard(parts, dim=dim)


def _reference(q, kt, vt, kb, vb, dout):
    """Per-sequence dense reference on global fp64 tensors: (out, lse, grads of every input)."""
    leaves = [None if x is None else x.detach().clone().requires_grad_() for x in (q, kt, vt, kb, vb)]
    outs, lses = [], []
    for a, b in zip(CU, CU[1:]):
        sl = [None if x is None else x[:, :, a:b] for x in leaves]
        o, l = dense_ttt_reference(*sl)
        outs.append(o)
        lses.append(l)
    out, lse = torch.cat(outs, 2), torch.cat(lses, 2)
    grads = torch.autograd.grad(out, [x for x in leaves if x is not None], dout)
    return out.detach(), lse.detach(), grads


def _check(ours, ref, dtype, what):
    torch.testing.assert_close(ours.double(), ref.double(), **TOL[dtype], msg=lambda m: f"{what}: {m}")


def _attention_worker(rank, world):
    lay = ZigzagLayout(CU, world, rank)
    T = CU[-1]
    g = torch.Generator().manual_seed(0)
    for H, Hkv in ((4, 4), (4, 2)):
        for P in (0, 1, 2):  # TTT pass 1, 2, 3
            rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
            q, kt, vt, dout = rnd(B, H, T, D), rnd(B, Hkv, T, D), rnd(B, Hkv, T, D), rnd(B, H, T, D)
            kb, vb = (rnd(B, Hkv, T, P, D), rnd(B, Hkv, T, P, D)) if P else (None, None)
            ref_out, ref_lse, ref_grads = _reference(q, kt, vt, kb, vb, dout)
            for dtype in (torch.float64, torch.float32):
                inputs = [None if x is None else lay.shard(x, dim=2).to(dtype).requires_grad_()
                          for x in (q, kt, vt, kb, vb)]
                out, lse = ring_ttt_attention(*inputs, group=None if world == 1 else dist.group.WORLD,
                                              layout=lay, return_lse=True)
                assert out.dtype == dtype and torch.isfinite(out).all() and torch.isfinite(lse).all()
                out.backward(lay.shard(dout, dim=2).to(dtype))
                case = f"cp={world} rank={rank} H={H}/{Hkv} P={P} {dtype}"
                _check(_gather_unshard(out.detach(), lay, 2), ref_out, dtype, f"{case} out")
                _check(_gather_unshard(lse, lay, 2), ref_lse, dtype, f"{case} lse")
                names = ["dq", "dk_trunk", "dv_trunk", "dk_branch", "dv_branch"]
                got = [x.grad for x in inputs if x is not None]
                for name, gr, rg in zip(names, got, ref_grads):
                    assert gr.dtype == dtype
                    _check(_gather_unshard(gr, lay, 2), rg, dtype, f"{case} {name}")


def _ref_shift(x, d):
    y = torch.zeros_like(x)
    for a, b in zip(CU, CU[1:]):
        if b - a > d:
            y[:, a:b - d] = x[:, a + d:b]
    return y


def _shift_worker(rank, world):
    lay = ZigzagLayout(CU, world, rank)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, CU[-1], 5, generator=g)  # e.g. teacher logits (B, T, Vd)
    tok = torch.randint(0, 100, (B, CU[-1]), generator=g)  # tokens / argmax ids
    mask = torch.rand(B, CU[-1], generator=g) > 0.3
    for d in (1, 2, 3, 4):  # d > c for the short sequences: sources skip whole chunks and ranks
        for t in (x, tok, mask):
            y = cp_shift(lay.shard(t), d, dist.group.WORLD, lay)
            assert y.dtype == t.dtype
            assert not y[:, ~lay.valid()].any(), "padding must shift in zeros"
            assert torch.equal(_gather_unshard(y, lay, 1), _ref_shift(t, d)), (world, rank, d, t.dtype)


def _worker(rank, world):
    _attention_worker(rank, world)
    _shift_worker(rank, world)


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_ring_attention_and_shift_match_single_process(cp):
    spawn_local(_worker, cp)


def test_ring_attention_cp1_no_group():
    """cp = 1 degenerates to one local causal block per sequence (+ branch), no communication."""
    _attention_worker_cp1()


def _attention_worker_cp1():
    # Same checks in-process: all_gather of one part is the identity, so run without a process group.
    global _gather_unshard
    saved = _gather_unshard
    _gather_unshard = lambda x, lay, dim: lay.unshard([x], dim=dim)  # noqa: E731
    try:
        _attention_worker(0, 1)
    finally:
        _gather_unshard = saved
