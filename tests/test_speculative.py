"""Speculative decoding is lossless and its caches stay exact.

* greedy: speculative tokens == plain greedy tokens (random draft: ~all rejected; structured draft:
  ragged acceptance; smaller draft vocab), prompts of different lengths, k = 1..4, with EOS;
* sampling: chi-square of the first T emitted tokens (10^5 draws) against the target's exact joint
  distribution, enumerated from full forwards; the same machinery rejects a deliberately wrong
  verifier (residual replaced by p), so the test is able to fail;
* the acceptance rule alone reproduces p at one position (10^5 rows, exact enumeration of p);
* after several ragged rounds the draft (and target) KV cache at committed positions equals a fresh
  recompute from the committed sequence.
"""
import itertools

import pytest
import torch
from scipy.stats import chisquare

import specco.rollout.acceptance as acceptance
from specco.rollout.acceptance import Verdict, verify_sampling
from specco.rollout.forward import RopeTable, draft_step, policy_forward
from specco.rollout.generate import DecodeRunner, GenerateConfig, generate
from specco.rollout.sampling import SamplingParams, processed_probs, sample_from_probs
from test_rollout_helpers import one_thread, random_draft, structured_pair, tiny_policy  # noqa: F401

GREEDY = SamplingParams(temperature=0.0)


def _prompts(V, lens=(3, 7, 1, 5, 9, 2), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (L,), generator=g) for L in lens]


# -- greedy equivalence -------------------------------------------------------------------------
@pytest.mark.e2e
@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("kind", ["random", "structured", "structured_small_vocab"])
def test_greedy_speculative_equals_plain(k, kind):
    if kind == "random":
        policy = tiny_policy()
        draft = random_draft(policy, draft_vocab=24)
    else:
        policy, draft = structured_pair(layer_scale=100.0,
                                        draft_vocab=20 if kind.endswith("vocab") else None)
    prompts = _prompts(policy.cfg.vocab_size)
    T = 20
    base = generate(policy, prompts, GenerateConfig(max_new_tokens=T, sampling=GREEDY))
    # EOS: a token that plain decoding emits mid-way in row 1, so some rows stop early.
    eos = int(base.tokens[1, 6])
    cfg = GenerateConfig(max_new_tokens=T, sampling=GREEDY, num_draft_tokens=k, eos_token_id=eos,
                         pad_token_id=-1)
    plain = generate(policy, prompts, cfg)
    spec = generate(policy, prompts, cfg, draft=draft)
    assert (plain.lengths < T).any() and (plain.lengths == T).any()
    assert torch.equal(spec.tokens, plain.tokens)
    assert torch.equal(spec.lengths, plain.lengths)
    torch.testing.assert_close(spec.logprobs, plain.logprobs, atol=1e-4, rtol=0)
    assert plain.tau == 1.0 and spec.tau >= 1.0
    assert ((spec.accept_rate >= 0) & (spec.accept_rate <= 1)).all()
    assert abs(spec.tau - 1.0 - spec.accept_rate.sum().item()) < 0.5  # τ ≈ 1 + Σ rates (cut-offs)
    if kind == "structured":
        assert spec.tau > 1.3
        assert spec.num_target_forwards < plain.num_target_forwards


def test_acceptance_is_ragged_across_rows():
    """The structured pair really exercises rows accepting different lengths in one round."""
    policy, draft = structured_pair(layer_scale=100.0)
    runner = DecodeRunner(policy, GenerateConfig(max_new_tokens=30, sampling=GREEDY,
                                                 num_draft_tokens=3), draft)
    runner.prefill(_prompts(policy.cfg.vocab_size))
    distinct = []
    for _ in range(6):
        runner.round()
        distinct.append(len(set(runner.st.num_accepted.tolist())))
    assert max(distinct) >= 3


# -- sampling: chi-square against the exact joint ------------------------------------------------
def _chi_square_pvalue(tokens: torch.Tensor, joint: torch.Tensor) -> float:
    """tokens: (N, T) draws; joint: (V**T,) exact probabilities (row-major over x_1..x_T)."""
    N, T = tokens.shape
    V = round(joint.numel() ** (1 / T))
    idx = torch.zeros(N, dtype=torch.long)
    for t in range(T):
        idx = idx * V + tokens[:, t]
    obs = torch.bincount(idx, minlength=joint.numel()).double()
    exp = joint.double() * N
    small = exp < 5  # pool sparse cells so the chi-square approximation holds
    obs = torch.cat([obs[~small], obs[small].sum()[None]])
    exp = torch.cat([exp[~small], exp[small].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    assert obs[exp == 0].sum() == 0 if (exp == 0).any() else True
    return float(chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)


@torch.no_grad()
def _exact_joint(policy, prompt, T, params):
    """P(x_1..x_T | prompt) for all V**T sequences, from full (uncached) forwards."""
    V = policy.cfg.vocab_size
    prefixes = torch.tensor(list(itertools.product(range(V), repeat=T - 1)), dtype=torch.long)
    M = prefixes.shape[0]  # V**(T-1)
    ids = torch.cat([prompt.expand(M, -1), prefixes.reshape(M, T - 1)], dim=1)  # (M, L+T-1)
    L = prompt.numel()
    p = processed_probs(policy(ids).logits[:, L - 1:], params).double()  # (M, T, V)
    joint = torch.ones(M, dtype=torch.float64)
    for t in range(T - 1):
        joint = joint * p[torch.arange(M), t, prefixes[:, t]]
    return (joint[:, None] * p[:, T - 1]).reshape(-1)  # (M*V,) = (V**T,)


def _sampling_setup():
    policy = tiny_policy(V=8, h=16, layers=2, seed=3)
    draft = random_draft(policy, seed=4)
    with torch.no_grad():  # make p and q peaked and different, so a wrong rule shows
        policy.lm_head.weight.mul_(25.0)
        draft.lm_head.weight.mul_(25.0)
    return policy, draft


def _sampled_tokens(policy, draft, params, k, T, N=100_000, seed=0):
    cfg = GenerateConfig(max_new_tokens=T, sampling=params, num_draft_tokens=k)
    prompt = torch.tensor([1, 5, 2])
    out = generate(policy, [prompt], cfg, draft=draft, group_size=N,
                   generator=torch.Generator().manual_seed(seed))
    assert (out.lengths == T).all()
    return prompt, out


@pytest.mark.parametrize("params,k", [(SamplingParams(temperature=1.0), 2),
                                      (SamplingParams(temperature=0.8, top_k=5), 3)])
@pytest.mark.e2e
def test_speculative_sampling_is_lossless(params, k):
    policy, draft = _sampling_setup()
    T = 3
    prompt, out = _sampled_tokens(policy, draft, params, k, T)
    assert 0.05 < out.accept_rate[0] < 0.95  # both branches of the rule are exercised
    pvalue = _chi_square_pvalue(out.tokens, _exact_joint(policy, prompt, T, params))
    assert pvalue > 1e-3, pvalue


def _wrong_verify_sampling(p_target, q_draft, draft_tokens, u_accept, u_residual):
    """DELIBERATELY WRONG: on rejection, samples the correction from p instead of the residual
    normalize(max(0, p - q)). Everything else is the correct rule."""
    B, k1, V = p_target.shape
    k = k1 - 1
    idx = draft_tokens[..., None]
    p_x = p_target[:, :k].gather(-1, idx).squeeze(-1)
    q_x = q_draft.gather(-1, idx).squeeze(-1)
    a = (u_accept * q_x < p_x).long().cumprod(-1).sum(-1)
    p_a = p_target.gather(1, a[:, None, None].expand(B, 1, V)).squeeze(1)
    nxt = sample_from_probs(p_a, u_residual)  # BUG (on purpose): p, not the residual
    tokens = torch.cat([draft_tokens, draft_tokens[:, :1]], 1).scatter(1, a[:, None], nxt[:, None])
    return Verdict(a, tokens)


@pytest.mark.e2e
def test_chi_square_rejects_wrong_verifier(monkeypatch):
    policy, draft = _sampling_setup()
    params, T = SamplingParams(temperature=1.0), 3
    monkeypatch.setattr(acceptance, "verify_sampling", _wrong_verify_sampling)
    prompt, out = _sampled_tokens(policy, draft, params, 2, T)
    pvalue = _chi_square_pvalue(out.tokens, _exact_joint(policy, prompt, T, params))
    assert pvalue < 1e-6, pvalue


@pytest.mark.parametrize("wrong", [False, True])
def test_acceptance_rule_one_position(wrong):
    """The rule alone: emitted first token ~ p_0 exactly (k = 2, 2*10^5 rows, fixed p and q)."""
    g = torch.Generator().manual_seed(0)
    B, k, V = 200_000, 2, 6
    p = torch.softmax(3 * torch.randn(k + 1, V, generator=g), -1).expand(B, k + 1, V)
    q = torch.softmax(3 * torch.randn(k, V, generator=g), -1).expand(B, k, V)
    draft_tok = sample_from_probs(q, torch.rand(B, k, generator=g))
    rule = _wrong_verify_sampling if wrong else verify_sampling
    v = rule(p, q, draft_tok, torch.rand(B, k, generator=g), torch.rand(B, generator=g))
    pvalue = _chi_square_pvalue(v.tokens[:, :1], p[0, 0])
    assert (pvalue < 1e-6) if wrong else (pvalue > 1e-3), pvalue


# -- caches after rejection equal a fresh recompute ---------------------------------------------
@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=1.0)])
@pytest.mark.parametrize("group_size", [1, 2])
@torch.no_grad()
def test_caches_equal_fresh_recompute(params, group_size):
    policy, draft = structured_pair(layer_scale=100.0)
    with torch.no_grad():  # non-zero attention/MLP output so the draft's K/V depend on its inputs
        draft.midlayer.self_attn.o_proj.weight.normal_(0, 0.02)
    k = 3
    cfg = GenerateConfig(max_new_tokens=40, sampling=params, num_draft_tokens=k)
    runner = DecodeRunner(policy, cfg, draft, torch.Generator().manual_seed(1))
    prompts = _prompts(policy.cfg.vocab_size, lens=(3, 7, 1, 5))
    runner.prefill(prompts, group_size)
    accepted = []
    for _ in range(5):
        runner.round()
        accepted.append(runner.st.num_accepted.clone())
    accepted = torch.stack(accepted)
    assert (accepted < k).any() and (accepted > 0).any()  # rejections and acceptances both happened
    assert_round_invariant(policy, draft, runner.st, prompts, group_size)


def assert_round_invariant(policy, draft, st, prompts, group_size):
    """speculative.py's invariant between rounds, for every row of `st` (none finished): the target cache and
    the draft's pass-1 cache at positions < n, and the carried pass-1 output at anchor n-1, equal a fresh
    recompute over the row's sequence (atol 1e-5 / 1e-4 fp32: the same math in other blockings)."""
    assert not st.finished.any()
    for b in range(st.n.shape[0]):
        prompt = prompts[b // group_size]
        seq = torch.cat([prompt, st.out_tokens[b, : st.out_len[b]]])  # x_0..x_n
        n = int(st.n[b])
        assert n == seq.numel() - 1 and int(st.last_tok[b]) == int(seq[-1])
        # target: a fresh cached prefill of x_0..x_{n-1}
        t_cache = policy.new_cache(1, st.t_cache.max_len)
        rope = RopeTable.build(policy.cfg.head_dim, policy.cfg.rope_theta, st.t_cache.max_len, "cpu",
                               torch.float32, scaling=policy.cfg.rope_scaling)
        _, _, taps = policy_forward(policy, seq[None, :n], torch.arange(n)[None], t_cache, rope,
                                    tap_layers=draft.cfg.aux_layer_ids, prefill=True)
        torch.testing.assert_close(st.t_cache.k[:, b, :, :n], t_cache.k[:, 0, :, :n],
                                   atol=1e-5, rtol=0)
        torch.testing.assert_close(st.t_cache.v[:, b, :, :n], t_cache.v[:, 0, :, :n],
                                   atol=1e-5, rtol=0)
        # draft: pass 1 over anchors 0..n-1 with the full forward's taps and emb(x_1..x_n)
        d_cache = draft.new_cache(1, st.d_cache.max_len)
        logits, hidden = draft_step(draft, draft.project_taps(taps.aux),
                                    policy.embed_tokens(seq[None, 1:]),
                                    torch.arange(n)[None], d_cache, rope, prefill=True)
        torch.testing.assert_close(st.d_cache.k[0, b, :, :n], d_cache.k[0, 0, :, :n],
                                   atol=1e-5, rtol=0)
        torch.testing.assert_close(st.d_cache.v[0, b, :, :n], d_cache.v[0, 0, :, :n],
                                   atol=1e-5, rtol=0)
        # and the carried pass-1 output at anchor n-1 is the one the next round proposes from
        torch.testing.assert_close(st.d_logits0[b], logits[0, n - 1], atol=1e-4, rtol=0)
        torch.testing.assert_close(st.d_hidden0[b], hidden[0, n - 1], atol=1e-4, rtol=0)
