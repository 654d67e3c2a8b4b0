"""Trunk + branch attention vs the dense-mask reference (docs/DESIGN.md §3), outputs and gradients.

Tolerances (why):
* fp64: 1e-10 abs/rel — same math as the reference, only fp64 rounding and summation order differ.
* fp32 vs an fp64 reference: rtol 1e-4, atol 1e-5 — fp32 eps is 1.2e-7 and sums run over <= 36 keys of
  O(1) scores; 1e-4 leaves ~100x headroom yet any mask/merge bug is O(1e-1).
* bf16 vs an fp64 reference: relative error ‖a−b‖/‖b‖ <= 1e-2 — bf16 inputs are exact in fp64, so
  the error is the kernels' internal bf16 rounding (eps 7.8e-3, 3.9e-3 per rounding), averaged over
  many entries; a wrong mask gives relative errors O(0.1–1) (checked by test_reference_is_sensitive).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from specco.ops.attention import (block_attn_bwd, block_attn_fwd, branch_attn_bwd, branch_attn_fwd,
                                  merge_lse, ttt_attention)
from specco.ops.reference import dense_attention_reference, dense_ttt_reference

B, D = 2, 16
HEADS = {"mha": (4, 4), "gqa": (4, 2)}
IMPLS = ["cpu_flash", "torch"]  # the aten fast path and the pure-torch fallback, both on CPU
FP64_TOL = dict(rtol=1e-10, atol=1e-10)
FP32_TOL = dict(rtol=1e-4, atol=1e-5)
BF16_REL = 1e-2


def _randn(*shape, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def _ttt_inputs(S, P, H, Hkv, dtype, seed=0):
    """q (B,H,S,D), trunk k/v (B,Hkv,S,D), branch k/v (B,Hkv,S,P,D) or None; fixed seed per case."""
    q = _randn(B, H, S, D, seed=seed, dtype=dtype)
    kt = _randn(B, Hkv, S, D, seed=seed + 1, dtype=dtype)
    vt = _randn(B, Hkv, S, D, seed=seed + 2, dtype=dtype)
    kb = _randn(B, Hkv, S, P, D, seed=seed + 3, dtype=dtype) if P else None
    vb = _randn(B, Hkv, S, P, D, seed=seed + 4, dtype=dtype) if P else None
    return [q, kt, vt, kb, vb]


def _leaf(xs, dtype=None):
    return [None if x is None else x.detach().to(dtype or x.dtype).requires_grad_() for x in xs]


def _rel_err(a, b):
    """‖a−b‖/‖b‖ in fp64; the floor keeps an exactly-zero reference (e.g. dk with one key) finite."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-3 * math.sqrt(b.numel()))).item()


def _check(ours, ref, dtype, what):
    if dtype == torch.bfloat16:
        err = _rel_err(ours, ref)
        assert err <= BF16_REL, f"{what}: bf16 relative error {err:.3e} > {BF16_REL}"
    else:
        tol = FP64_TOL if dtype == torch.float64 else FP32_TOL
        torch.testing.assert_close(ours.double(), ref.double(), **tol, msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------------------------------------------
# Adapter contract
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_adapter_contract(impl, dtype):
    H, Hkv = HEADS["gqa"]
    q, k, v = (_randn(B, h, 7, D, seed=i, dtype=dtype) for i, h in enumerate((H, Hkv, Hkv)))
    out, lse = block_attn_fwd(q, k, v, True, None, impl=impl)
    assert out.shape == (B, H, 7, D) and out.dtype == dtype
    lse_dt = torch.float64 if dtype == torch.float64 else torch.float32  # fp64 keeps fp64 statistics
    assert lse.shape == (B, H, 7) and lse.dtype == lse_dt and lse.is_contiguous()
    dq, dk, dv = block_attn_bwd(torch.ones_like(out), q, k, v, out, lse, True, None, impl=impl)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert dq.dtype == dk.dtype == dv.dtype == dtype
    with pytest.raises(ValueError, match="Sq == Sk"):
        block_attn_fwd(q[:, :, :3], k, v, True, None, impl=impl)
    with pytest.raises(ValueError, match="unknown attention impl"):
        block_attn_fwd(q, k, v, True, None, impl="nope")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("causal,Sq,Sk", [(True, 1, 1), (True, 33, 33), (False, 7, 5), (False, 3, 12)])
def test_block_fwd_matches_reference(impl, heads, causal, Sq, Sk):
    H, Hkv = HEADS[heads]
    q, k, v = _randn(B, H, Sq, D, seed=0), _randn(B, Hkv, Sk, D, seed=1), _randn(B, Hkv, Sk, D, seed=2)
    mask = torch.ones(Sq, Sk, dtype=torch.bool).tril() if causal else None
    ref_out, ref_lse = dense_attention_reference(q, k, v, mask, 0.3)
    out, lse = block_attn_fwd(q, k, v, causal, 0.3, impl=impl)
    torch.testing.assert_close(out, ref_out, **FP64_TOL)
    torch.testing.assert_close(lse, ref_lse, **FP64_TOL)


# ---------------------------------------------------------------------------------------------------
# merge_lse and the joint-statistics backward (the identity ring attention relies on)
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_merge_lse_two_halves_equals_whole(impl, heads, dtype):
    H, Hkv = HEADS[heads]
    Sq, Sk, cut = 7, 13, 5
    q, k, v = (_randn(B, h, s, D, seed=i, dtype=dtype) for i, (h, s) in enumerate(((H, Sq), (Hkv, Sk), (Hkv, Sk))))
    out_a, lse_a = block_attn_fwd(q, k[:, :, :cut], v[:, :, :cut], False, None, impl=impl)
    out_b, lse_b = block_attn_fwd(q, k[:, :, cut:], v[:, :, cut:], False, None, impl=impl)
    out, lse = merge_lse(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = dense_attention_reference(q.double(), k.double(), v.double(), None)
    _check(out, ref_out, dtype, "merged out")
    _check(lse, ref_lse, dtype, "merged lse")
    # An empty part (lse = -inf, out = 0) must be an exact no-op: that is how a skipped ring step merges.
    out_e, lse_e = merge_lse(out, lse, torch.zeros_like(out), torch.full_like(lse, float("-inf")))
    assert torch.equal(out_e, out) and torch.equal(lse_e, lse)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("heads", HEADS)
def test_block_bwd_with_joint_stats_equals_full_autograd(impl, heads):
    """Ring-step shape: part A = an earlier key block (no mask, Sk != Sq), part B = the local causal block."""
    H, Hkv = HEADS[heads]
    S, S_prev = 7, 5
    q, k_prev, v_prev, k_loc, v_loc = _leaf([
        _randn(B, H, S, D, seed=0), _randn(B, Hkv, S_prev, D, seed=1), _randn(B, Hkv, S_prev, D, seed=2),
        _randn(B, Hkv, S, D, seed=3), _randn(B, Hkv, S, D, seed=4)])
    mask = torch.cat([torch.ones(S, S_prev, dtype=torch.bool), torch.ones(S, S, dtype=torch.bool).tril()], 1)
    ref_out, _ = dense_attention_reference(q, torch.cat([k_prev, k_loc], 2), torch.cat([v_prev, v_loc], 2), mask)
    dout = _randn(*ref_out.shape, seed=9)
    ref_out.backward(dout)

    with torch.no_grad():
        out_a, lse_a = block_attn_fwd(q, k_prev, v_prev, False, None, impl=impl)
        out_b, lse_b = block_attn_fwd(q, k_loc, v_loc, True, None, impl=impl)
        out_j, lse_j = merge_lse(out_a, lse_a, out_b, lse_b)
        dq_a, dk_a, dv_a = block_attn_bwd(dout, q, k_prev, v_prev, out_j, lse_j, False, None, impl=impl)
        dq_b, dk_b, dv_b = block_attn_bwd(dout, q, k_loc, v_loc, out_j, lse_j, True, None, impl=impl)
    torch.testing.assert_close(out_j, ref_out.detach(), **FP64_TOL)
    tol = FP64_TOL
    torch.testing.assert_close(dq_a + dq_b, q.grad, **tol)
    torch.testing.assert_close(dk_a, k_prev.grad, **tol)
    torch.testing.assert_close(dv_a, v_prev.grad, **tol)
    torch.testing.assert_close(dk_b, k_loc.grad, **tol)
    torch.testing.assert_close(dv_b, v_loc.grad, **tol)


@pytest.mark.parametrize("heads", HEADS)
def test_branch_part_alone(heads):
    """branch_attn_fwd/bwd (public, closed form) vs the dense reference restricted to branch keys."""
    H, Hkv = HEADS[heads]
    S, P = 7, 3
    q, _, _, kb, vb = _leaf(_ttt_inputs(S, P, H, Hkv, torch.float64))
    mask = torch.arange(S * P)[None, :] // P == torch.arange(S)[:, None]  # (S, S·P): own anchor only
    ref_out, ref_lse = dense_attention_reference(q, kb.reshape(B, Hkv, S * P, D), vb.reshape(B, Hkv, S * P, D), mask)
    dout = _randn(*ref_out.shape, seed=9)
    ref_out.backward(dout)
    with torch.no_grad():
        out, lse = branch_attn_fwd(q, kb, vb)
        dq, dkb, dvb = branch_attn_bwd(dout, q, kb, vb, out, lse)  # a single part is its own joint
    for ours, ref in [(out, ref_out.detach()), (lse, ref_lse.detach()), (dq, q.grad), (dkb, kb.grad), (dvb, vb.grad)]:
        torch.testing.assert_close(ours, ref, **FP64_TOL)


# ---------------------------------------------------------------------------------------------------
# TTT attention: trunk ⊕ branch vs dense mask, K = 1..4 passes
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["fp64", "fp32", "bf16"])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("P", [0, 1, 2, 3])
@pytest.mark.parametrize("S", [1, 7, 33])
def test_ttt_matches_dense_reference(impl, dtype, heads, P, S):
    H, Hkv = HEADS[heads]
    master = _ttt_inputs(S, P, H, Hkv, dtype, seed=100 * P + S)  # values exactly representable in dtype
    ours_in, ref_in = _leaf(master), _leaf(master, torch.float64)
    dout = _randn(B, H, S, D, seed=7, dtype=dtype)

    out = ttt_attention(*ours_in, impl=impl)
    out.backward(dout)
    ref_out, _ = dense_ttt_reference(*ref_in)
    ref_out.backward(dout.double())

    assert out.dtype == dtype and out.shape == (B, H, S, D)
    _check(out.detach(), ref_out.detach(), dtype, "out")
    for name, x, r in zip(["dq", "dk_trunk", "dv_trunk", "dk_branch", "dv_branch"], ours_in, ref_in):
        if x is not None:
            assert x.grad.dtype == dtype
            _check(x.grad, r.grad, dtype, name)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["fp64", "fp32", "bf16"])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("P", [0, 2])
@pytest.mark.parametrize("q_start", [1, 9, 32])
def test_ttt_from_an_anchor_equals_the_whole_rows(impl, dtype, heads, P, q_start):
    """Queries from anchor q_start on (model/ttt.py skips the anchors that train nothing) over the whole trunk:
    the output rows and every gradient equal the dense reference of all 33 anchors with the earlier anchors' output
    unused (dout 0 there): dk/dv of the trunk keys before q_start come only from the later queries. Same
    tolerances as the whole rows (the prefix block and the causal square merge exactly, in fp32)."""
    H, Hkv = HEADS[heads]
    S = 33
    master = _ttt_inputs(S, P, H, Hkv, dtype, seed=7 * P + q_start)
    ref_in = _leaf(master, torch.float64)
    cut = [master[0][:, :, q_start:], master[1], master[2]] + [None if x is None else x[:, :, q_start:]
                                                               for x in master[3:]]
    ours_in = _leaf(cut)
    dout = _randn(B, H, S, D, seed=11, dtype=dtype)
    dout[:, :, :q_start] = 0
    out = ttt_attention(*ours_in, impl=impl, q_start=q_start)
    out.backward(dout[:, :, q_start:])
    ref_out, _ = dense_ttt_reference(*ref_in)
    ref_out.backward(dout.double())
    assert out.dtype == dtype and out.shape == (B, H, S - q_start, D)
    _check(out.detach(), ref_out.detach()[:, :, q_start:], dtype, "out")
    refs = [ref_in[0].grad[:, :, q_start:], ref_in[1].grad, ref_in[2].grad] + [
        None if x is None else x.grad[:, :, q_start:] for x in ref_in[3:]]
    for name, x, r in zip(["dq", "dk_trunk", "dv_trunk", "dk_branch", "dv_branch"], ours_in, refs):
        if x is not None:
            assert x.grad.dtype == dtype and x.grad.shape == x.shape
            _check(x.grad, r, dtype, name)


def test_ttt_from_an_anchor_refuses_a_trunk_of_the_wrong_length():
    H, Hkv = HEADS["gqa"]
    q, kt, vt, _, _ = _ttt_inputs(9, 0, H, Hkv, torch.float32)
    with pytest.raises(ValueError, match="need the 9 trunk keys"):
        ttt_attention(q[:, :, 4:], kt[:, :, :8], vt[:, :, :8], q_start=4)
    # and the prefix block matters: without the keys before q_start the rows differ far beyond tolerance
    ref, _ = dense_ttt_reference(q.double(), kt.double(), vt.double(), None, None)
    alone = ttt_attention(q[:, :, 4:].contiguous(), kt[:, :, 4:].contiguous(), vt[:, :, 4:].contiguous())
    assert _rel_err(alone, ref[:, :, 4:]) > 50 * BF16_REL


def test_reference_is_sensitive():
    """The comparison above can fail: an off-by-one-anchor branch or a dropped branch is far outside tol."""
    H, Hkv = HEADS["gqa"]
    q, kt, vt, kb, vb = _ttt_inputs(7, 2, H, Hkv, torch.float32)
    ref, _ = dense_ttt_reference(*(x.double() for x in (q, kt, vt, kb, vb)))
    wrong_anchor = ttt_attention(q, kt, vt, kb.roll(1, dims=2), vb.roll(1, dims=2))
    no_branch = ttt_attention(q, kt, vt)
    assert _rel_err(wrong_anchor, ref) > 50 * BF16_REL
    assert _rel_err(no_branch, ref) > 50 * BF16_REL


def test_pass1_is_causal_sdpa():
    H, Hkv = HEADS["gqa"]
    q, kt, vt, _, _ = _ttt_inputs(33, 0, H, Hkv, torch.float32)
    out, lse = ttt_attention(q, kt, vt, return_lse=True)
    ref = F.scaled_dot_product_attention(q, kt, vt, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, ref, **FP32_TOL)
    assert lse.shape == (B, H, 33) and not lse.requires_grad


@pytest.mark.e2e
def test_ttt_gradcheck_fp64():
    """Independent of the reference: finite differences through the custom autograd node."""
    H, Hkv = HEADS["gqa"]
    xs = _leaf([x[:1, :, :, :4] if x.dim() == 4 else x[:1, :, :, :, :4] for x in _ttt_inputs(5, 2, H, Hkv, torch.float64)])
    assert torch.autograd.gradcheck(lambda *a: ttt_attention(*a, scale=0.5), xs, eps=1e-6, atol=1e-7)


# --------------------------------------------------------------------------------------------------
# Fused branch ⊕ merge / branch backward: the Triton kernels vs their pure-torch twin.
# --------------------------------------------------------------------------------------------------

def _triton_device():
    """CUDA when present; else CPU under TRITON_INTERPRET=1 (Triton's interpreter); else None (skip)."""
    from specco.ops import attention as A
    if A.triton is None:
        return None
    if torch.cuda.is_available():
        return "cuda"
    import os
    return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else None


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("P", [1, 3])
@pytest.mark.parametrize("heads", list(HEADS.values()), ids=list(HEADS))
def test_fused_branch_matches_twin_and_reference(impl, P, heads):
    """branch_merge_fwd == merge_lse(trunk, branch) and branch_bwd_into == branch_attn_bwd (+ dq add),
    fp32, S not a multiple of the kernel's row block (masking), trunk lse from a real causal block."""
    from specco.ops.attention import branch_bwd_into, branch_merge_fwd
    dev = "cpu"
    if impl == "triton":
        dev = _triton_device()
        if dev is None:
            pytest.skip("Triton needs CUDA (or TRITON_INTERPRET=1 on CPU)")
    H, Hkv = heads
    S, Dh = 37, 32
    q, kt, vt, kb, vb = (x.float().to(dev) for x in _ttt_inputs(S, P, H, Hkv, torch.float64, seed=11))
    dout = _randn(B, H, S, Dh, seed=17, dtype=torch.float32).to(dev)
    q, kb, vb = (torch.nn.functional.pad(x, (0, Dh - D)) for x in (q, kb, vb))  # D=16 -> 32: pow2, padded
    kt, vt = (torch.nn.functional.pad(x, (0, Dh - D)) for x in (kt, vt))
    scale = 0.3
    out_t, lse_t = block_attn_fwd(q, kt, vt, True, scale, impl="torch")
    out, lse = branch_merge_fwd(q, kb, vb, out_t, lse_t, scale, torch.float32, impl=impl)
    out_b, lse_b = branch_attn_fwd(q, kb, vb, scale)
    out_ref, lse_ref = merge_lse(out_t, lse_t, out_b, lse_b)
    torch.testing.assert_close(out, out_ref, **FP32_TOL)
    torch.testing.assert_close(lse, lse_ref, **FP32_TOL)
    dq_acc = torch.randn(B, H, S, Dh, device=dev)
    dq_start = dq_acc.clone()
    dkb, dvb = branch_bwd_into(dout, q, kb, vb, out, lse, dq_acc, scale, impl=impl)
    dq_r, dkb_r, dvb_r = branch_attn_bwd(dout, q, kb, vb, out, lse, scale)
    torch.testing.assert_close(dq_acc, dq_start + dq_r, **FP32_TOL)
    torch.testing.assert_close(dkb, dkb_r, **FP32_TOL)
    torch.testing.assert_close(dvb, dvb_r, **FP32_TOL)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_merge_lse_inplace_equals_out_of_place(impl):
    """In-place merge into a row view of an fp32 accumulator == the out-of-place formula, incl. rows whose
    part B is empty (lse_b = -inf) and a row count that is not a multiple of the Triton row block.
    Tolerance 1e-6: fp32 math in both, summed in a different order (Triton subtracts the max first)."""
    dev = "cpu"
    if impl == "triton":
        dev = _triton_device()
        if dev is None:
            pytest.skip("Triton needs CUDA (or TRITON_INTERPRET=1 on CPU)")
    S, Dh = 41, 32
    out_a = _randn(B, 4, S, Dh, seed=1, dtype=torch.float32).to(dev)
    lse_a = _randn(B, 4, S, seed=2, dtype=torch.float32).to(dev)
    out_b = _randn(B, 4, S, Dh, seed=3, dtype=torch.bfloat16).to(dev)
    lse_b = _randn(B, 4, S, seed=4, dtype=torch.float32).to(dev)
    lse_b[:, :, 5:9] = float("-inf")  # part B empty for these rows: the merge must leave them as part A
    ref_o, ref_l = merge_lse(out_a, lse_a, out_b, lse_b)
    acc_o, acc_l = out_a.clone(), lse_a.clone()
    o, l = merge_lse(acc_o[:, :, 2:], acc_l[:, :, 2:], out_b[:, :, 2:], lse_b[:, :, 2:], inplace=True, impl=impl)
    assert o.data_ptr() == acc_o[:, :, 2:].data_ptr() and l.data_ptr() == acc_l[:, :, 2:].data_ptr()
    torch.testing.assert_close(acc_o[:, :, 2:], ref_o[:, :, 2:], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(acc_l[:, :, 2:], ref_l[:, :, 2:], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(acc_o[:, :, 5:9], out_a[:, :, 5:9], rtol=1e-6, atol=1e-6)
    assert torch.equal(acc_o[:, :, :2], out_a[:, :, :2])  # rows outside the view untouched
    assert torch.equal(acc_l[:, :, :2], lse_a[:, :, :2])


def test_merge_lse_rejects_unknown_impl():
    x, l = torch.zeros(1, 1, 2, 16), torch.zeros(1, 1, 2)
    with pytest.raises(ValueError, match="unknown merge impl"):
        merge_lse(x, l, x, l, inplace=True, impl="cuda")

def test_causal_sdpa_expanded_gqa_equals_native_gqa():
    """The fp32-on-CUDA route of `causal_sdpa` (K/V repeated to H heads, no `enable_gqa`) computes the
    same attention and gradients as SDPA's own GQA; forced here on CPU. fp64: agreement to 1e-12."""
    from specco.model.layers import causal_sdpa
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 6, 9, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 9, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 9, 8, generator=g, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(2, 6, 9, 8, generator=g, dtype=torch.float64)
    outs = []
    for expand in (False, True):
        o = causal_sdpa(q, k, v, 0.4, expand_gqa=expand)
        outs.append((o, *torch.autograd.grad(o, (q, k, v), dout)))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
