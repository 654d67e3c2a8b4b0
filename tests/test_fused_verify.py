"""The verify's fused token choice (acceptance.verify_sampling_logits, ops/sampling_kernel.py's lse and
residual kernels) against its twin, `verify_sampling` over `processed_probs` (run here through
impl="torch"). Without CUDA the kernels run under Triton's interpreter (conftest.py).

Tolerance: the emitted tokens and the accepted counts are equal (the uniforms here are not within ~1e-6 of
an acceptance or cdf boundary, where fp32 accumulation order could decide); log-probs within 1e-5
(online vs two-pass logsumexp in fp32 over 5,000 ids of magnitude ≲ 10).
"""
import pytest
import torch

from specco.rollout.acceptance import verify_sampling_logits
from specco.rollout.sampling import SamplingParams, processed_probs

pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_verify_matches_twin(temperature):
    g = torch.Generator().manual_seed(int(temperature * 10))
    B, k, V = 6, 4, 5000  # several kernel blocks per row
    logits = 3 * torch.randn(B, k + 1, V, generator=g)
    draft_logits = logits[:, :k] + torch.randn(B, k, V, generator=g)  # a draft close to the target
    q_full = torch.zeros(B, k + 2, V)  # the engine's buffer is sized for its largest k: pass a view
    q_full[:, :k] = processed_probs(draft_logits, SamplingParams(temperature=temperature))
    draft_tok = torch.multinomial(q_full[:, :k].reshape(-1, V), 1, generator=g).view(B, k)
    u = torch.rand(B, 2 * k + 1, generator=g)
    u[0, k:2 * k] = 0.0  # row 0 accepts every draft token: the bonus draw from p_k
    u[1, k] = 1.0 - 1e-6  # row 1 rejects its first unless p >= q there: a residual draw at position 0
    args = [x.to(DEV) for x in (logits, q_full)]
    logits_d, q_d = args
    dt, ud = draft_tok.to(DEV), u.to(DEV)
    out = {impl: verify_sampling_logits(logits_d, temperature, q_d[:, :k], dt, ud[:, k:2 * k], ud[:, 2 * k],
                                        impl=impl) for impl in ("triton", "torch")}
    (v_t, lp_t), (v_r, lp_r) = out["triton"], out["torch"]
    assert torch.equal(v_t.num_accepted, v_r.num_accepted) and int(v_t.num_accepted[0]) == k
    a = v_t.num_accepted
    emitted = torch.arange(k + 1, device=a.device)[None] <= a[:, None]  # entries past a are unspecified
    assert torch.equal(v_t.tokens[emitted], v_r.tokens[emitted])
    torch.testing.assert_close(lp_t[emitted], lp_r[emitted], atol=1e-5, rtol=0)
