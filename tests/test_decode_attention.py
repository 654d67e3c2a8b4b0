"""The decode-attention kernel's launch shapes (ops/decode_attention.KernelConfig) against the twin.

The kernel splits each chunk of keys into an unmasked bulk (keys below every query row's position) and a
masked edge; these tests put the edge everywhere it can fall: positions ragged across rows (one row at
the cache's first key, one at its last), the k+1 query tokens of a row straddling a key block and a chunk
boundary, all T rows at one position (the block drafter's bidirectional `visible`), T in {1, 5, 8} (the
plain step, EAGLE-3's verify of k+1 = 5, DFlash's of 8) with GQA groups of 7 and 4 (G·T rows 7, 35,
32, padded to 16, 64, 32; bf16 on CUDA also 56), and every key-block size / split count the configs may pick.

Tolerances. fp32 (under the CPU interpreter, or IEEE on CUDA): 1e-5 absolute on O(1) outputs against an
fp64 reference — accumulation order (split-K, online softmax in base 2) moves ~1e-6; a wrong mask or a
missed key moves O(0.1). bf16 (CUDA only: the interpreter does not round bf16 as the GPU does): scores
and p·v in bf16 tensor-core dots with fp32 accumulation, p rounded to bf16 (rel. 2^-9) before p·v, the
output rounded to bf16 (2^-9 rel.): 2e-2 absolute on outputs of magnitude ≲ 1 against fp64 of the same
bf16 inputs, the bound the twin's own bf16 SDPA meets (checked in the test).
"""
import pytest
import torch

from specco.ops.decode_attention import (KernelConfig, decode_attention, decode_attention_reference,
                                         kernel_config, split_plan)

triton = pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"

# the Triton kernels under the CPU interpreter: ~100 s on two cores, outside the one-minute unit tier
pytestmark = pytest.mark.e2e


def _dense_reference(q, k, v, pos):
    """fp64 softmax attention with an explicit mask j <= pos, GQA by repeating K/V. q (B,T,H,D)."""
    B, T, H, D = q.shape
    G = H // k.shape[1]
    k, v = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)  # (B, H, S, D)
    s = torch.einsum("bthd,bhsd->bths", q.double(), k) * D ** -0.5
    mask = torch.arange(k.shape[2], device=q.device)[None, None, None, :] <= pos[:, :, None, None]
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("bths,bhsd->bthd", s.softmax(-1), v)


def _positions(B, T, S, block, g, same=False):
    """(B, T): row 0 starts at key 0, row 1 ends on the cache's last key, row 2 straddles a key-block
    boundary (its tokens at block-2 .. block+T-3), the rest anywhere; `same`: every token of a row at its
    last position (the block drafter's visible)."""
    start = torch.randint(0, S - T + 1, (B, 1), generator=g)
    start[0], start[1] = 0, S - T
    if B > 2:  # the second key-block boundary where the cache is long enough, else the first
        start[2] = (2 * block if 2 * block + T <= S else block) - 2
    pos = start + torch.arange(T)
    return pos[:, -1:].expand(B, T).contiguous() if same else pos


CONFIGS = [KernelConfig(block_n=16, num_warps=4, num_stages=2, waves=64),  # many one-block chunks
           KernelConfig(block_n=32, num_warps=4, num_stages=3, waves=8),
           KernelConfig(block_n=64, num_warps=8, num_stages=2, waves=1)]  # one chunk per (row, head)


@pytest.mark.parametrize("T", [1, 5, 8])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"bn{c.block_n}x{c.waves}")
def test_kernel_configs_match_reference_fp32(T, cfg):
    g = torch.Generator().manual_seed(T * 10 + cfg.block_n)
    # GQA groups of 7 (Qwen2.5-0.5B) and 4: G·T = 7, 35 (a padded 64-row tile), 32; small S and D keep the
    # interpreter's per-program cost down while still giving 3-13 key blocks per row
    B, H, Hkv, D, S = 3, 8 if T == 8 else 14, 2, 16, 130
    q = torch.randn(B, T, H, D, generator=g)
    k, v = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    chunk, ns = split_plan(B, Hkv, S, 132, cfg.block_n, cfg.waves)
    assert chunk % cfg.block_n == 0 and (ns - 1) * chunk < S <= ns * chunk
    for same in (False, True):
        pos = _positions(B, T, S, cfg.block_n, g, same)
        q_, k_, v_, pos_ = (x.to(DEV) for x in (q, k, v, pos))
        out = decode_attention(q_, k_, v_, pos_, impl="triton", config=cfg)
        torch.testing.assert_close(out.double(), _dense_reference(q_, k_, v_, pos_), atol=1e-5, rtol=0)


def test_rows_past_the_position_and_chunk_edges():
    """A row whose T tokens start one key before a chunk boundary: the masked edge spans two chunks,
    and the chunks past every position of a row are skipped (NaN there must not leak in)."""
    g = torch.Generator().manual_seed(3)
    cfg = KernelConfig(block_n=16, num_warps=4, num_stages=2, waves=64)
    B, T, H, Hkv, D, S = 2, 5, 8, 2, 16, 160
    chunk, _ = split_plan(B, Hkv, S, 132, cfg.block_n, cfg.waves)
    q = torch.randn(B, T, H, D, generator=g)
    k, v = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    pos = torch.tensor([[chunk - 1], [3 * chunk - 2]]) + torch.arange(T)
    ref = _dense_reference(q, k, v, pos)
    for b in range(B):
        k[b, :, pos[b, -1] + 1:] = float("nan")
        v[b, :, pos[b, -1] + 1:] = float("nan")
    out = decode_attention(*(x.to(DEV) for x in (q, k, v, pos)), impl="triton", config=cfg)
    torch.testing.assert_close(out.double().cpu(), ref, atol=1e-5, rtol=0)


@pytest.mark.skipif(DEV != "cuda", reason="bf16 rounding is the GPU's; the interpreter does not reproduce it")
@pytest.mark.parametrize("T", [1, 5, 8])
def test_bf16_default_config_matches_reference(T):
    g = torch.Generator().manual_seed(T)
    B, H, Hkv, D, S = 6, 14, 2, 64, 3000
    q = torch.randn(B, T, H, D, generator=g).bfloat16().cuda()
    k = torch.randn(B, Hkv, S, D, generator=g).bfloat16().cuda()
    v = torch.randn(B, Hkv, S, D, generator=g).bfloat16().cuda()
    pos = _positions(B, T, S, kernel_config(H // Hkv * T, torch.bfloat16).block_n, g).cuda()
    ref = _dense_reference(q, k, v, pos)
    twin = decode_attention_reference(q, k, v, pos)
    assert (twin.double() - ref).abs().max() < 2e-2  # the tolerance is the twin's own bf16 error scale
    torch.testing.assert_close(decode_attention(q, k, v, pos).double(), ref, atol=2e-2, rtol=0)
