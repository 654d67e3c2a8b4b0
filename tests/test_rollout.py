"""Rollout engine: sampling processing, log-probs, τ bookkeeping, EOS/padding, prompt groups, refit."""
import pytest
import torch

from specco.rollout.engine import RefitError, RolloutEngine
from specco.rollout.generate import GenerateConfig, generate
from specco.rollout.sampling import (SamplingParams, processed_logprobs, processed_probs,
                                     sample_from_probs)
from test_rollout_helpers import one_thread, random_draft, structured_pair, tiny_policy  # noqa: F401

GREEDY = SamplingParams(temperature=0.0)


def _prompts(V, lens=(3, 6, 1, 4), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (L,), generator=g) for L in lens]


# -- sampling.py ---------------------------------------------------------------------------------
def test_processed_distribution():
    torch.manual_seed(0)
    logits = torch.randn(3, 10)
    lp = processed_logprobs(logits, SamplingParams(temperature=0.5))
    torch.testing.assert_close(lp, (logits / 0.5).log_softmax(-1))
    p = processed_probs(logits, SamplingParams(temperature=1.0, top_k=3))
    assert ((p > 0).sum(-1) == 3).all()
    top3 = logits.topk(3, -1).indices
    torch.testing.assert_close(p.gather(-1, top3), logits.gather(-1, top3).softmax(-1))
    # top-p: the shortest prefix (by descending prob) whose mass reaches top_p
    full = logits.softmax(-1)
    p = processed_probs(logits, SamplingParams(top_p=0.6))
    for r in range(3):
        srt = full[r].sort(descending=True).values
        n_keep = int((srt.cumsum(0) - srt < 0.6).sum())
        assert int((p[r] > 0).sum()) == n_keep
    g = processed_probs(logits, GREEDY)
    assert torch.equal(g.argmax(-1), logits.argmax(-1)) and (g.sum(-1) == 1).all()


def test_sample_from_probs_frequencies_and_zero_mass():
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])
    N = 200_000
    s = sample_from_probs(probs.expand(N, 6), torch.rand(N, generator=g))
    freq = torch.bincount(s, minlength=6).double() / N
    assert (freq[probs == 0] == 0).all()
    assert (freq - probs.double()).abs().max() < 5e-3
    # edge uniforms never land on a zero-probability id
    edge = sample_from_probs(probs.expand(3, 6), torch.tensor([0.0, 0.5, 1.0 - 1e-7]))
    assert (probs[edge] > 0).all()


# -- log-probs, τ, EOS ---------------------------------------------------------------------------
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), GREEDY,
                                    SamplingParams(temperature=0.7, top_k=6, top_p=0.9)])
@pytest.mark.parametrize("speculative", [False, True])
@torch.no_grad()
def test_logprobs_equal_full_forward(params, speculative):
    policy, draft = structured_pair(layer_scale=100.0)
    prompts = _prompts(policy.cfg.vocab_size)
    cfg = GenerateConfig(max_new_tokens=12, sampling=params, num_draft_tokens=3)
    out = generate(policy, prompts, cfg, draft=draft if speculative else None,
                   generator=torch.Generator().manual_seed(0))
    for b, prompt in enumerate(prompts):
        n = int(out.lengths[b])
        seq = torch.cat([prompt, out.tokens[b, :n]])
        logits = policy(seq[None]).logits[0, prompt.numel() - 1: -1]  # predicts the emitted tokens
        # greedy reports the raw log-softmax (the processed one-hot would be all zeros)
        ref = logits.log_softmax(-1) if params.greedy else processed_logprobs(logits, params)
        ref = ref.gather(-1, out.tokens[b, :n, None]).squeeze(-1)
        torch.testing.assert_close(out.logprobs[b, :n], ref, atol=1e-4, rtol=0)
        assert torch.isfinite(out.logprobs[b, :n]).all()


def test_tau_plain_is_one_and_forward_count():
    policy = tiny_policy()
    out = generate(policy, _prompts(32), GenerateConfig(max_new_tokens=9, sampling=GREEDY))
    assert out.tau == 1.0 and out.accept_rate.numel() == 0
    assert out.num_target_forwards == 9  # prefill + 8 decode steps
    assert (out.lengths == 9).all()


def test_tau_random_draft_in_range():
    policy = tiny_policy()
    out = generate(policy, _prompts(32), GenerateConfig(max_new_tokens=9, num_draft_tokens=4),
                   draft=random_draft(policy))
    assert out.tau >= 1.0 and out.accept_rate.numel() == 4
    assert ((out.accept_rate >= 0) & (out.accept_rate <= 1)).all()
    assert (out.accept_rate[1:] <= out.accept_rate[:-1] + 1e-12).all()  # P(a>=j) is non-increasing


@pytest.mark.parametrize("speculative", [False, True])
def test_eos_and_padding(speculative):
    policy, draft = structured_pair(layer_scale=100.0)
    prompts = _prompts(32)
    base = generate(policy, prompts, GenerateConfig(max_new_tokens=15, sampling=GREEDY))
    eos = int(base.tokens[0, 4])
    cfg = GenerateConfig(max_new_tokens=15, sampling=GREEDY, eos_token_id=eos, pad_token_id=-7,
                         num_draft_tokens=4)
    out = generate(policy, prompts, cfg, draft=draft if speculative else None)
    for b in range(len(prompts)):
        n = int(out.lengths[b])
        row = base.tokens[b]
        hits = (row == eos).nonzero()
        expect = int(hits[0]) + 1 if hits.numel() else 15
        assert n == expect
        assert torch.equal(out.tokens[b, :n], row[:n])
        assert (out.tokens[b, n:] == -7).all() and (out.logprobs[b, n:] == 0).all()


def test_max_new_tokens_one():
    policy, draft = structured_pair()
    out = generate(policy, _prompts(32), GenerateConfig(max_new_tokens=1), draft=draft)
    assert out.tokens.shape == (4, 1) and (out.lengths == 1).all() and out.num_target_forwards == 1


# -- prompt groups -------------------------------------------------------------------------------
@pytest.mark.parametrize("speculative", [False, True])
def test_group_prefill_once_and_greedy_groups_identical(speculative):
    policy, draft = structured_pair(layer_scale=100.0)
    prompts, G = _prompts(32), 3
    batch_sizes = []
    # the head runs once per target forward: on the prompts' last positions in the prefill, then per row
    hook = policy.lm_head.register_forward_hook(lambda m, args, out: batch_sizes.append(out.shape[0]))
    cfg = GenerateConfig(max_new_tokens=10, sampling=GREEDY, num_draft_tokens=2)
    out = generate(policy, prompts, cfg, draft=draft if speculative else None, group_size=G)
    hook.remove()
    assert batch_sizes[0] == len(prompts)  # one prefill row per prompt ...
    assert all(b == len(prompts) * G for b in batch_sizes[1:])  # ... decode rows per sample
    assert out.tokens.shape == (len(prompts) * G, 10) and out.group_size == G
    groups = out.tokens.view(len(prompts), G, 10)  # (B0, G, T): row b*G + g
    assert (groups == groups[:, :1]).all()
    single = generate(policy, prompts, cfg, draft=draft if speculative else None)
    assert torch.equal(groups[:, 0], single.tokens)


def test_sampled_groups_differ_and_are_valid():
    policy, draft = structured_pair(layer_scale=100.0)
    prompts, G = _prompts(32, lens=(2, 5)), 8
    out = generate(policy, prompts, GenerateConfig(max_new_tokens=10, sampling=SamplingParams(
        temperature=1.5)), draft=draft, group_size=G, generator=torch.Generator().manual_seed(0))
    groups = out.tokens.view(2, G, 10)
    assert ((out.tokens >= 0) & (out.tokens < 32)).all()
    assert len({tuple(r.tolist()) for r in groups[0]}) > 1  # independent samples per group


# -- engine --------------------------------------------------------------------------------------
def test_engine_refit_loads_and_fails_loudly():
    policy, draft = structured_pair(layer_scale=100.0)
    cfg = GenerateConfig(max_new_tokens=8, sampling=GREEDY, num_draft_tokens=2)
    new_policy, new_draft = tiny_policy(seed=5), random_draft(tiny_policy(seed=5), seed=6)
    engine = RolloutEngine(policy, draft, cfg)
    prompts = _prompts(32)
    counts = engine.refit(new_policy.state_dict(), new_draft.state_dict())
    assert counts["policy"] == len(new_policy.state_dict()) and counts["draft"] > 0
    got = engine.generate(prompts)
    ref = generate(new_policy, prompts, cfg)
    assert torch.equal(got.tokens, ref.tokens)
    for k, v in new_draft.state_dict().items():
        assert torch.equal(engine.draft.state_dict()[k], v)

    with pytest.raises(RefitError, match="no draft"):
        RolloutEngine(tiny_policy(), None, cfg).refit(None, new_draft.state_dict())
    bad = dict(new_draft.state_dict())
    bad.pop("fc.weight")
    with pytest.raises(RefitError, match="missing"):
        engine.refit(None, bad)
    bad = dict(new_policy.state_dict(), extra=torch.zeros(1))
    with pytest.raises(RefitError, match="unexpected"):
        engine.refit(bad)
    bad = dict(new_policy.state_dict())
    bad["norm.weight"] = torch.ones(7)
    with pytest.raises(RefitError, match="shape"):
        engine.refit(bad)


def _same_output(a, b, logp_atol=1e-5):
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.lengths, b.lengths)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=logp_atol, rtol=0)
    assert a.tau == pytest.approx(b.tau) and a.num_target_forwards == b.num_target_forwards
    torch.testing.assert_close(a.accept_rate, b.accept_rate)


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=1.0)])
def test_engine_reuses_runners_across_calls(speculative, params):
    """Cached runners (static buffers refilled per call) give exactly what a fresh generate does,
    for repeated shapes, a new shape in between, and EOS-finished rows left over from the last call."""
    policy, draft = structured_pair(layer_scale=100.0)
    draft = draft if speculative else None
    base = generate(policy, _prompts(32), GenerateConfig(max_new_tokens=12, sampling=GREEDY))
    cfg = GenerateConfig(max_new_tokens=12, sampling=params, num_draft_tokens=3,
                         eos_token_id=int(base.tokens[0, 3]))
    engine = RolloutEngine(policy, draft, cfg)
    calls = [(_prompts(32, seed=1), 2), (_prompts(32, seed=2), 2), (_prompts(32, lens=(2, 9)), 1),
             (_prompts(32, seed=3), 2)]
    for i, (prompts, G) in enumerate(calls):
        got = engine.generate(prompts, G, generator=torch.Generator().manual_seed(i))
        ref = generate(policy, prompts, cfg, draft, G, generator=torch.Generator().manual_seed(i))
        _same_output(got, ref)
    assert len(engine._runners) == 2  # calls 0, 1, 3 share one runner


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("G", [1, 3])
def test_bucketed_shapes_equal_exact_shapes(speculative, G):
    """Padding the batch (3 -> 4 prompts) and prompt length (9 -> 16), as the graphed path does, does
    not change any real row: padding rows are finished from the start and cut from the result."""
    policy, draft = structured_pair(layer_scale=100.0)
    prompts = _prompts(32, lens=(3, 9, 1))
    for params in (GREEDY, SamplingParams(temperature=1.0)):
        outs = [generate(policy, prompts, GenerateConfig(
            max_new_tokens=12, sampling=params, num_draft_tokens=3, bucket_shapes=b),
            draft if speculative else None, G, generator=torch.Generator().manual_seed(0))
            for b in (False, True)]
        _same_output(outs[0], outs[1], logp_atol=1e-4)


@pytest.mark.parametrize("speculative", [False, True])
def test_bucketed_engine_shares_one_runner_across_batch_and_prompt_sizes(speculative):
    """As on GPU: 4 prompts, then 3 (the 4th row turns into padding), then other lengths — one
    runner, and every call equals an exact-shape fresh generate."""
    policy, draft = structured_pair(layer_scale=100.0)
    cfg = GenerateConfig(max_new_tokens=10, sampling=SamplingParams(temperature=1.0),
                         num_draft_tokens=3, bucket_shapes=True)
    exact = GenerateConfig(max_new_tokens=10, sampling=SamplingParams(temperature=1.0),
                           num_draft_tokens=3)
    engine = RolloutEngine(policy, draft if speculative else None, cfg)
    for i, lens in enumerate([(3, 6, 1, 4), (9, 2, 5), (1, 1, 16, 2)]):
        prompts = _prompts(32, lens=lens, seed=i)
        got = engine.generate(prompts, 2, generator=torch.Generator().manual_seed(i))
        ref = generate(policy, prompts, exact, draft if speculative else None, 2,
                       generator=torch.Generator().manual_seed(i))
        _same_output(got, ref, logp_atol=1e-4)
    assert len(engine._runners) == 1


@pytest.mark.parametrize("speculative", [False, True])
def test_a_runner_for_longer_prompts_serves_shorter_ones(speculative):
    """RunnerShape.holds: after a call with long prompts, calls with shorter ones reuse that runner (right-
    padded to its prompt length; no new buffers, no new graphs) and equal a fresh exact-shape generate; a
    call with longer prompts than any kept runner builds a new one."""
    policy, draft = structured_pair(layer_scale=100.0)
    draft = draft if speculative else None
    cfg = GenerateConfig(max_new_tokens=10, sampling=SamplingParams(temperature=1.0), num_draft_tokens=3)
    engine = RolloutEngine(policy, draft, cfg, cache_runners=1)
    for i, lens in enumerate([(12, 3, 7, 2), (5, 2, 1, 4), (12, 12, 9, 1)]):
        prompts = _prompts(32, lens=lens, seed=i)
        got = engine.generate(prompts, 2, generator=torch.Generator().manual_seed(i))
        if i == 0:
            first = next(iter(engine._runners.values()))
        assert next(iter(engine._runners.values())) is first and first.shape.prompt_len == 12
        ref = generate(policy, prompts, cfg, draft, 2, generator=torch.Generator().manual_seed(i))
        _same_output(got, ref, logp_atol=1e-4)
    engine.generate(_prompts(32, lens=(13, 2, 2, 2)), 2)  # longer than the kept runner's prompts
    assert len(engine._runners) == 1 and next(iter(engine._runners.values())) is not first


def test_min_prompt_len_sizes_the_first_runner_for_the_run():
    """GenerateConfig.min_prompt_len (bucketed shapes): the first runner is built for the run's longest
    prompts, so calls whose prompts fall in other length buckets share it from the start; outputs equal
    an exact-shape generate. runner.rollouts.longest_prompt finds that length in the run's prompt stream."""
    from types import SimpleNamespace
    from specco.runner.rollouts import longest_prompt
    policy = tiny_policy()
    cfg = GenerateConfig(max_new_tokens=6, sampling=GREEDY, bucket_shapes=True, min_prompt_len=40)
    engine = RolloutEngine(policy, None, cfg)
    for i, lens in enumerate([(3, 5), (33, 2), (40, 1)]):
        prompts = _prompts(32, lens=lens, seed=i)
        got = engine.generate(prompts, 2)
        assert torch.equal(got.tokens, generate(policy, prompts, GenerateConfig(max_new_tokens=6, sampling=GREEDY),
                                                group_size=2).tokens)
    (runner,) = engine._runners.values()
    assert runner.shape.prompt_len == 48  # 40 rounded up to the 16-token bucket
    items = [3, 9, 4, 2, 17, 8]  # prompt lengths of a stream; the run sees the first steps x prompts_per_step
    stream = SimpleNamespace(num_rows=None, examples=lambda n, seed: [SimpleNamespace(prompt_ids=[0] * k)
                                                                      for k in items[:n]])
    run = SimpleNamespace(train=SimpleNamespace(steps=2, seed=0), rollout=SimpleNamespace(prompts_per_step=2))
    assert longest_prompt(stream, run) == 9 and longest_prompt(stream, run, cap=3) == 9
    run.train.steps = 3
    assert longest_prompt(stream, run) == 17
    # a dataset (num_rows rows an epoch): its longest row, whatever the run's length
    table = SimpleNamespace(num_rows=6, examples=stream.examples)
    run.train.steps = 1
    assert longest_prompt(table, run) == 17


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=1.0)])
def test_several_stop_ids_end_a_row_at_the_first_of_any(speculative, params):
    """eos_token_id=(a, b): every row is the stop-free generation (same uniforms) cut after its first a or
    b, as transformers' generate does with a list of eos ids; rows end at either."""
    from specco.data.tokenizer import truncate_at_stop
    policy, draft = structured_pair(layer_scale=100.0)
    draft = draft if speculative else None
    prompts = _prompts(32, lens=(3, 6, 1, 4, 2, 5), seed=4)
    base = GenerateConfig(max_new_tokens=16, sampling=params, num_draft_tokens=3)
    free = generate(policy, prompts, base, draft, 2, generator=torch.Generator().manual_seed(0))
    a, b = torch.bincount(free.tokens[:, 2:].flatten(), minlength=32).topk(2).indices.tolist()
    cfg = GenerateConfig(max_new_tokens=16, sampling=params, num_draft_tokens=3, eos_token_id=[a, b])
    assert cfg.eos_token_id == (a, b)
    got = generate(policy, prompts, cfg, draft, 2, generator=torch.Generator().manual_seed(0))
    ends = set()
    for r in range(got.tokens.shape[0]):
        want = truncate_at_stop(free.tokens[r, :int(free.lengths[r])], (a, b))
        assert got.tokens[r, :int(got.lengths[r])].tolist() == want, r
        ends.add(want[-1] if len(want) < int(free.lengths[r]) else None)
    assert {a, b} <= ends  # rows ended at each of the two ids
    with pytest.raises(ValueError, match="at least one stop id"):
        GenerateConfig(eos_token_id=())


def test_engine_refit_reaches_cached_runner():
    """Refit copies into the parameters' own storage (what captured graphs read) and a runner
    cached before the refit generates with the new weights."""
    policy, draft = structured_pair(layer_scale=100.0)
    cfg = GenerateConfig(max_new_tokens=10, sampling=GREEDY, num_draft_tokens=2)
    engine = RolloutEngine(policy, draft, cfg)
    prompts = _prompts(32)
    old = engine.generate(prompts)
    ptrs = engine._storage_fingerprint()
    new_policy = tiny_policy(seed=5)
    engine.refit(new_policy.state_dict())  # the draft stays (frozen): now a poor guesser
    assert engine._storage_fingerprint() == ptrs  # in place: same storage
    got = engine.generate(prompts)
    assert len(engine._runners) == 1  # the cached runner served both calls
    ref = generate(new_policy, prompts, cfg)  # lossless: plain decoding of the new policy
    assert torch.equal(got.tokens, ref.tokens) and not torch.equal(got.tokens, old.tokens)


def test_engine_drops_runners_when_parameters_are_replaced():
    policy = tiny_policy()
    cfg = GenerateConfig(max_new_tokens=8, sampling=GREEDY)
    engine = RolloutEngine(policy, None, cfg)
    prompts = _prompts(32)
    engine.generate(prompts)
    stale = next(iter(engine._runners.values()))
    with torch.no_grad():
        policy.lm_head.weight = torch.nn.Parameter(torch.randn_like(policy.lm_head.weight))
    got = engine.generate(prompts)
    assert next(iter(engine._runners.values())) is not stale
    assert torch.equal(got.tokens, generate(policy, prompts, cfg).tokens)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("speculative", [False, True])
def test_cuda_graphed_engine_after_refit_equals_eager(speculative):
    """On GPU: graphs captured before a refit replay with the new weights (fp32, greedy)."""
    dev = torch.device("cuda")
    policy, draft = structured_pair(layer_scale=100.0)
    policy, draft = policy.to(dev), draft.to(dev)
    cfg = GenerateConfig(max_new_tokens=12, sampling=GREEDY, num_draft_tokens=3)
    engine = RolloutEngine(policy, draft if speculative else None, cfg)
    prompts = _prompts(32)
    engine.generate(prompts, 2)  # captures
    new_policy = tiny_policy(seed=5).to(dev)
    engine.refit(new_policy.state_dict())
    got = engine.generate(prompts, 2)
    ref = generate(new_policy, prompts, GenerateConfig(max_new_tokens=12, sampling=GREEDY,
                                                       use_graphs=False), group_size=2)
    assert torch.equal(got.tokens, ref.tokens)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphed_runner_reuse_and_tail_recheck_equal_eager():
    """On GPU: a graphed runner captured for long prompts serves shorter ones (RunnerShape.holds), and
    speculation control re-choosing k within a level (recheck every 4 rounds) replays other step sets'
    graphs mid-level; greedy tokens stay those of eager plain decoding (fp32)."""
    dev = torch.device("cuda")
    policy, draft = structured_pair(layer_scale=100.0)
    policy, draft = policy.to(dev), draft.to(dev)
    cfg = GenerateConfig(max_new_tokens=40, sampling=GREEDY, num_draft_tokens=3, spec_control=True,
                         compact_below=0.5)
    engine = RolloutEngine(policy, draft, cfg, cache_runners=1)
    engine.controller.recheck_rounds, engine.controller.min_tries = 4, 8
    for i, lens in enumerate([(30, 3, 7, 2), (5, 2, 1, 4), (17, 9, 9, 1)]):
        prompts = _prompts(32, lens=lens, seed=i)
        got = engine.generate(prompts, 2)
        ref = generate(policy, prompts, GenerateConfig(max_new_tokens=40, sampling=GREEDY, use_graphs=False),
                       group_size=2)
        assert torch.equal(got.tokens, ref.tokens), i
    assert len(engine._runners) == 1


def test_engine_rejects_mismatched_draft():
    policy = tiny_policy()
    other = tiny_policy(V=40)
    with pytest.raises(ValueError, match="vocab"):
        RolloutEngine(policy, random_draft(other))


@pytest.mark.e2e
def test_engine_bounds_the_memory_of_its_cached_runners():
    """cache_gib: runners beyond the byte bound are dropped oldest first (the running one is kept)."""
    policy = tiny_policy()
    cfg = GenerateConfig(max_new_tokens=4, sampling=GREEDY)
    prompts = [_prompts(policy.cfg.vocab_size, lens=(n,)) for n in (3, 20, 40)]  # three length buckets
    unbounded = RolloutEngine(policy, None, cfg, cache_runners=8)
    for p in prompts:
        unbounded.generate(p, group_size=32)
    sizes = [r.nbytes() for r in unbounded._runners.values()]  # the last (longest prompts) is the largest
    assert len(sizes) == 3 and unbounded.cached_bytes() == sum(sizes) and sizes[-1] == max(sizes)
    bound = (max(sizes) + 0.5 * min(sizes)) / 2**30  # room for the running one, not for another beside it
    engine = RolloutEngine(policy, None, cfg, cache_runners=8, cache_gib=bound)
    outs = [engine.generate(p, group_size=32) for p in prompts]
    assert len(engine._runners) == 1 and engine.cached_bytes() <= bound * 2**30
    for a, p in zip(outs, prompts):  # dropping runners changes nothing but speed
        assert torch.equal(a.tokens, generate(policy, p, cfg, group_size=32).tokens)


@pytest.mark.e2e
def test_positions_past_max_position_embeddings_warn():
    policy = tiny_policy()
    cfg = GenerateConfig(max_new_tokens=policy.cfg.max_position_embeddings, sampling=GREEDY)
    with pytest.warns(UserWarning, match="max_position_embeddings"):
        generate(policy, [torch.tensor([1, 2])], cfg)
