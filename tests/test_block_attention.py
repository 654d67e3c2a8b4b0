"""Block-drafter attention (trunk prefix ⊕ bidirectional block) vs a dense-mask fp64 reference."""
import pytest
import torch

from specco.ops.block_attention import block_attention, trunk_prefix_fwd
import specco.ops.block_attention as ba


def dense_reference(q, kt, vt, kb, vb, key_pos, anchor, key_valid, scale):
    """The same attention written as one softmax over [trunk; all blocks' slots] with an explicit mask."""
    B, H, N, W, D = q.shape
    Hkv, S = kt.shape[1], kt.shape[2]
    G = H // Hkv
    keys = torch.cat([kt, kb.reshape(B, Hkv, N * W, D)], dim=2).repeat_interleave(G, dim=1)  # (B, H, S+NW, D)
    vals = torch.cat([vt, vb.reshape(B, Hkv, N * W, D)], dim=2).repeat_interleave(G, dim=1)
    qf = q.reshape(B, H, N * W, D)
    s = qf @ keys.transpose(-1, -2) * scale  # (B, H, NW, S+NW)
    blk = torch.arange(N).repeat_interleave(W)  # block of each query / block key
    trunk_vis = key_pos[:, None, :] < anchor.repeat_interleave(W, dim=1)[:, :, None]  # (B, NW, S)
    kv = torch.ones(B, N, W, dtype=torch.bool) if key_valid is None else key_valid
    block_vis = (blk[:, None] == blk[None, :])[None] & kv.reshape(B, 1, N * W)  # (B, NW, NW)
    mask = torch.cat([trunk_vis, block_vis], dim=-1)[:, None]
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
    return (p @ vals).reshape(B, H, N, W, D)


def _case(B, H, Hkv, S, N, W, D, dtype, seed, anchors=None, padded=False):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=dtype).requires_grad_()  # noqa: E731
    q, kb, vb = mk(B, H, N, W, D), mk(B, Hkv, N, W, D), mk(B, Hkv, N, W, D)
    kt, vt = mk(B, Hkv, S, D), mk(B, Hkv, S, D)
    if anchors is None:
        anchors = torch.randint(0, S, (B, N), generator=g)
    key_pos = torch.arange(S).expand(B, S)
    key_valid = None
    if padded:  # trailing slots absent (a block running past the sequence end); slot 0 always present
        n_valid = torch.randint(1, W + 1, (B, N), generator=g)
        key_valid = torch.arange(W)[None, None] < n_valid[..., None]
    return q, kt, vt, kb, vb, key_pos, anchors, key_valid


CASES = [  # B, H, Hkv, S, N, W, D
    (2, 4, 4, 17, 3, 5, 8),
    (1, 6, 2, 33, 4, 8, 16),  # GQA G = 3
    (3, 4, 1, 9, 5, 4, 4),  # MQA, more blocks than fit without overlap
]


@pytest.mark.parametrize("shape", CASES)
@pytest.mark.parametrize("padded", [False, True])
def test_block_attention_matches_dense_fp64(shape, padded):
    B, H, Hkv, S, N, W, D = shape
    x = _case(B, H, Hkv, S, N, W, D, torch.float64, seed=sum(shape) + padded, padded=padded)
    x[6][:, 0] = 0  # a block at the sequence start: no trunk key at all (trunk lse = -inf)
    x[6][:, -1] = S  # ... and one whose anchor is the last position + 1: the whole trunk
    scale = 0.37
    out = block_attention(*x, scale=scale)
    ref = dense_reference(*x, scale)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    dout = torch.randn_like(out)
    leaves = [x[i] for i in (0, 1, 2, 3, 4)]
    g = torch.autograd.grad(out, leaves, dout)
    g_ref = torch.autograd.grad(ref, leaves, dout)
    for name, a, b in zip(["dq", "dk_trunk", "dv_trunk", "dk_block", "dv_block"], g, g_ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11, msg=name)


def test_padded_slots_get_no_gradient_and_change_nothing():
    """An absent slot key contributes nothing: its k/v gradient is exactly 0 and its value is unread."""
    x = list(_case(2, 4, 2, 12, 3, 6, 8, torch.float64, seed=5, padded=True))
    out = block_attention(*x)
    kv = x[7]
    vb2 = x[4].detach().clone()
    vb2.masked_fill_(~kv[:, None, :, :, None], 1e3)
    out2 = block_attention(x[0], x[1], x[2], x[3], vb2, *x[5:])
    torch.testing.assert_close(out, out2, rtol=0, atol=1e-12)
    dk, dv = torch.autograd.grad(out.square().sum(), [x[3], x[4]])
    absent = ~kv[:, None, :, :, None].expand_as(dk)
    assert dk[absent].abs().max() == 0 and dv[absent].abs().max() == 0


def test_fp32_and_query_chunking(monkeypatch):
    """fp32 inputs within 1e-5 of the fp64 reference, with the trunk's query chunking forced to 7 rows."""
    monkeypatch.setattr(ba, "TRUNK_Q_CHUNK", 7)
    x = _case(2, 4, 2, 21, 4, 5, 8, torch.float64, seed=11)
    x32 = [t.detach().float().requires_grad_() if t is not None and t.is_floating_point() else t for t in x]
    out = block_attention(*x32)
    ref = dense_reference(*x, 8 ** -0.5)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)
    dout = torch.randn_like(ref)
    g = torch.autograd.grad(out, x32[:5], dout.float())
    g_ref = torch.autograd.grad(ref, x[:5], dout)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=2e-5)


def test_trunk_positions_not_indices():
    """Visibility follows key positions: a permuted trunk with permuted key_pos gives the same result
    (what a ring step with a visiting zigzag shard relies on)."""
    q, kt, vt, _, _, key_pos, anchors, _ = _case(1, 2, 2, 10, 2, 3, 4, torch.float64, seed=3)
    B, H, N, W, D = q.shape
    lim = anchors.repeat_interleave(W, dim=1)
    o1, l1 = trunk_prefix_fwd(q.reshape(B, H, N * W, D), kt, vt, key_pos, lim)
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(0))
    o2, l2 = trunk_prefix_fwd(q.reshape(B, H, N * W, D), kt[:, :, perm], vt[:, :, perm], key_pos[:, perm], lim)
    torch.testing.assert_close(o1, o2, rtol=0, atol=1e-12)
    torch.testing.assert_close(l1, l2, rtol=0, atol=1e-12)
