"""train/losses.token_logprobs: log p(token) under softmax(logits / T), chunked over positions in both directions.

Against the plain reference log_softmax(logits / T).gather (autograd's), values and gradients:
* fp64: 1e-12 (the same math; logsumexp vs log_softmax's own subtraction order);
* fp32 logits: 1e-5 relative (fp32 rounding of a softmax over 97 entries);
* bf16 logits: the value 1e-5 (computed in fp32 from the same bf16 inputs), the gradient 1e-2 relative (it is stored in
  bf16, as autograd's was: one rounding, eps 3.9e-3).
Chunking changes nothing (1, 5 and all rows per chunk), and what the backward keeps is the logits themselves and an
(N,) vector: no (N, V) fp32 tensor (autograd's log_softmax kept one, 4 bytes per position per vocabulary entry)."""
import pytest
import torch
import torch.nn.functional as F

from specco.train import losses

B, S, V = 3, 11, 97


def _ref(x, t, T):
    return F.log_softmax(x.double() / T, -1).gather(-1, t[..., None]).squeeze(-1)


@pytest.mark.parametrize("dtype,tol,gtol", [(torch.float64, 1e-12, 1e-12), (torch.float32, 1e-5, 1e-5),
                                            (torch.bfloat16, 1e-5, 1e-2)])
@pytest.mark.parametrize("rows", [1, 5, B * S])
@pytest.mark.parametrize("T", [1.0, 0.6])
def test_token_logprobs_match_log_softmax(dtype, tol, gtol, rows, T, monkeypatch):
    monkeypatch.setattr(losses, "LOGPROB_CHUNK_ELEMENTS", rows * V)
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(B, S, V, generator=g, dtype=torch.float64) * 4).to(dtype).requires_grad_()
    t = torch.randint(0, V, (B, S), generator=g)
    w = torch.randn(B, S, generator=g, dtype=torch.float64)
    lp = losses.token_logprobs(x, t, T)
    assert lp.dtype == torch.promote_types(dtype, torch.float32) and lp.shape == (B, S)
    (gx,) = torch.autograd.grad((lp.double() * w).sum(), x)
    xr = x.detach().double().requires_grad_()
    ref = _ref(xr, t, T)
    (gr,) = torch.autograd.grad((ref * w).sum(), xr)
    torch.testing.assert_close(lp.double(), ref, rtol=tol, atol=tol)
    assert gx.dtype == dtype and ((gx.double() - gr).norm() / gr.norm()).item() <= gtol


def test_token_logprobs_gradcheck_fp64(monkeypatch):
    monkeypatch.setattr(losses, "LOGPROB_CHUNK_ELEMENTS", 2 * 7)
    x = torch.randn(2, 3, 7, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 7, (2, 3))
    assert torch.autograd.gradcheck(lambda a: losses.token_logprobs(a, t, 0.8), (x,))


def test_token_logprobs_keep_no_vocabulary_sized_fp32_tensor():
    x = torch.randn(B, S, V, dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, V, (B, S))
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda a: kept.append((a.dtype, a.numel())) or a, lambda a: a):
        losses.token_logprobs(x, t, 1.0).sum()
    big = [k for k in kept if k[1] >= B * S * V]
    assert big == [(torch.bfloat16, B * S * V)], kept  # the logits themselves, nothing in fp32
    with torch.autograd.graph.saved_tensors_hooks(lambda a: kept.append((a.dtype, a.numel())) or a, lambda a: a):
        kept.clear()
        _ref(x, t, 1.0)  # the reference keeps fp32/fp64 copies of that size: the check can fail
    assert any(d != torch.bfloat16 and n >= B * S * V for d, n in kept)
