"""Live-row compaction (specco/rollout/compaction.py) changes no output.

Generations with compaction (aggressive threshold, so it happens early and more than once) are
compared with the same generations without it: plain and speculative, greedy and sampled (the same
generator seed: compaction keeps the random stream), group sampling, EOS so rows finish at different
rounds, and a runner reused across calls. Tokens and lengths must be equal; log-probs within 1e-5
(fp32 kernels over a different batch size may round differently in the last bits); τ and acceptance
counters equal, since padding rows of a compacted state never count.
"""
import pytest
import torch

from specco.rollout import compaction
from specco.rollout.generate import DecodeRunner, GenerateConfig
from specco.rollout.sampling import SamplingParams
from test_rollout_helpers import one_thread, random_draft, sigma_perm, structured_pair, tiny_policy  # noqa: F401

GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=1.0)
COUPLED = SamplingParams(temperature=1.0, coupled=True)


def _prompts(V, n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g) for _ in range(n)]


def _run(policy, draft, prompts, cfg, group_size, seed, runner=None):
    runner = runner or DecodeRunner(policy, cfg, draft)
    runner.prefill(prompts, group_size, generator=torch.Generator().manual_seed(seed))
    runner.run()
    return runner.result(), runner


def _frequent_token(policy, draft, prompts, cfg, group_size):
    """The token found in the most rows of a generation: as EOS it makes rows finish at many rounds."""
    out, _ = _run(policy, draft, prompts, GenerateConfig(**{**cfg.__dict__, "compact_below": 0.0}), group_size, 0)
    V = policy.cfg.vocab_size
    present = torch.zeros(out.tokens.shape[0], V, dtype=torch.long).scatter_(1, out.tokens[:, 1:].clamp(0, V - 1), 1)
    return int(present.sum(0).argmax())


def _structured_prompts(V, n=12, fixed=12):
    """structured_pair's policy follows a permutation σ (tests/test_rollout_helpers.py), almost
    deterministically. Prompts ending on σ's longest cycle reach its first token (the EOS) after
    1..len(cycle) tokens; two prompts ending on a fixed point of σ never do: a long tail."""
    sigma = sigma_perm(V, fixed, 0).tolist()  # structured_pair's σ (seed 0)
    seen, cycles = set(), []
    for start in range(V):
        cyc, x = [], start
        while x not in seen:
            seen.add(x)
            cyc.append(x)
            x = sigma[x]
        cycles.append(cyc)
    cyc = max(cycles, key=len)
    g = torch.Generator().manual_seed(0)
    lasts = [cyc[(3 * i) % len(cyc)] for i in range(n - 2)] + [0, 5]  # 0, 5: fixed points
    prompts = [torch.cat([torch.randint(0, V, (int(torch.randint(0, 6, (1,), generator=g)),), generator=g),
                          torch.tensor([t])]) for t in lasts]
    return prompts, cyc[0]


def _assert_same(a, b):
    assert torch.equal(a.lengths, b.lengths)
    assert torch.equal(a.tokens, b.tokens)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    assert a.tau == b.tau and torch.equal(a.accept_rate, b.accept_rate)
    assert a.num_target_forwards == b.num_target_forwards
    assert torch.equal(a.row_rounds, b.row_rounds)  # per-row rounds move with their rows
    # the per-row counts add up to τ's denominator (the prefill's first token is not a round's)
    assert abs((a.lengths - 1).sum().item() / max(1, a.row_rounds.sum().item()) - a.tau) < 1e-12 or a.tau == 1.0


def compaction_case(kind: str, sampling: SamplingParams, G: int = 4, T: int = 64):
    """(policy, draft or None, prompts, EOS id, base GenerateConfig) of one case, on CPU: rows finish at
    many different rounds and some run to T. Shared with bench/compaction_check.py (CUDA graphs)."""
    base_cfg = GenerateConfig(max_new_tokens=T, sampling=sampling, num_draft_tokens=3, pad_token_id=-1)
    if kind == "structured_draft":  # a draft that agrees with the target often: ragged acceptance
        policy, draft = structured_pair()
        prompts, eos = _structured_prompts(policy.cfg.vocab_size)
    else:
        policy = tiny_policy()
        draft = random_draft(policy, draft_vocab=24) if kind == "random_draft" else None
        prompts = _prompts(policy.cfg.vocab_size)
        eos = _frequent_token(policy, draft, prompts, base_cfg, G)
    return policy, draft, prompts, eos, base_cfg


@pytest.mark.e2e
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("kind", ["plain", "random_draft", "structured_draft"])
def test_compaction_changes_no_output(kind, sampling):
    G, T = 4, 64
    policy, draft, prompts, eos, base_cfg = compaction_case(kind, sampling, G, T)
    off = GenerateConfig(**{**base_cfg.__dict__, "eos_token_id": eos, "compact_below": 0.0})
    on = GenerateConfig(**{**base_cfg.__dict__, "eos_token_id": eos, "compact_below": 0.6})
    ref, _ = _run(policy, draft, prompts, off, G, seed=5)
    got, runner = _run(policy, draft, prompts, on, G, seed=5)
    assert (ref.lengths < T).sum() >= 24 and (ref.lengths == T).any(), "rows should finish at many rounds"
    assert runner.stack.levels, "compaction never happened: the test would prove nothing"
    _assert_same(got, ref)
    # The runner is reused: a second call (new prompts, same shape bucket) goes through the kept
    # compacted states and must again match a generation without compaction.
    prompts2 = _prompts(policy.cfg.vocab_size, seed=1)
    ref2, _ = _run(policy, draft, prompts2, off, G, seed=9)
    got2, _ = _run(policy, draft, prompts2, on, G, seed=9, runner=runner)
    _assert_same(got2, ref2)


def test_compaction_nests():
    """48 rows with a high threshold compact more than once (e.g. 48 -> 16 -> 8)."""
    policy = tiny_policy()
    prompts, G, T = _prompts(policy.cfg.vocab_size), 4, 64
    base = GenerateConfig(max_new_tokens=T, sampling=SAMPLED, pad_token_id=-1)
    eos = _frequent_token(policy, None, prompts, base, G)
    on = GenerateConfig(**{**base.__dict__, "eos_token_id": eos, "compact_below": 0.9})
    off = GenerateConfig(**{**base.__dict__, "eos_token_id": eos, "compact_below": 0.0})
    runner = DecodeRunner(policy, on, None)
    runner.prefill(prompts, G, generator=torch.Generator().manual_seed(3))
    depth = 0
    for _ in range(T - 1):  # run(), watching how deep the chain of compacted states gets
        live = int((~runner.st.finished).sum())
        if live == 0:
            break
        size = compaction.compact_size(live, runner.st.finished.numel(), on.compact_below, on.compact_min_rows)
        if size is not None:
            runner._compact(size)
        depth = max(depth, runner.stack.depth)
        runner.round()
    got = runner.result()
    ref, _ = _run(policy, None, prompts, off, G, seed=3)
    assert depth >= 2
    _assert_same(got, ref)


def test_compact_size_and_pick_rows():
    assert compaction.compact_size(10, 1024, 0.25, 8) == 16
    assert compaction.compact_size(300, 1024, 0.25, 8) is None  # not below the threshold
    assert compaction.compact_size(3, 1024, 0.25, 8) == 8  # at least min_rows
    assert compaction.compact_size(5, 12, 0.5, 8) is None  # 8 rows would not halve 12
    assert compaction.compact_size(0, 64, 0.25, 8) is None and compaction.compact_size(4, 64, 0.0, 8) is None
    finished = torch.tensor([True, False, True, True, False, True])
    rows = compaction.pick_rows(finished, 4)
    assert rows.tolist() == [1, 4, 0, 2]  # live rows first, then distinct finished rows
    with pytest.raises(ValueError, match="cannot compact"):
        compaction.pick_rows(finished, 1)


def test_smaller_sizes_are_what_compact_size_returns():
    """compaction.smaller_sizes (the levels a tracked plain round is kept for) lists exactly the sizes compact_size
    can return from a state of `current` rows, for every live count."""
    for current in (1, 2, 5, 8, 16, 48, 64, 256):
        for min_rows in (1, 8):
            for below in (0.0, 0.6, 0.999):
                reach = {compaction.compact_size(live, current, below, min_rows) for live in range(1, current + 1)}
                sizes = compaction.smaller_sizes(current, below, min_rows)
                assert sizes == sorted(reach - {None}), (current, min_rows, below)


def test_compact_size_down_to_min_rows():
    # rollout.compact_min_rows = 1: a lone tail row gets a level of its own
    assert compaction.compact_size(1, 8, 0.25, min_rows=1) == 1
    assert compaction.compact_size(2, 8, 0.25, min_rows=1) == 2
    assert compaction.compact_size(3, 16, 0.25, min_rows=1) == 4
    assert compaction.compact_size(3, 16, 0.25, min_rows=8) == 8
    assert compaction.compact_size(1, 1, 0.99, min_rows=1) is None  # nothing smaller than one row


def test_compact_below_is_validated():
    with pytest.raises(ValueError, match="compact_below"):
        GenerateConfig(compact_below=1.0)
    with pytest.raises(ValueError, match="compact_min_rows"):
        GenerateConfig(compact_min_rows=6)
    with pytest.raises(ValueError, match="compact_min_rows"):
        GenerateConfig(compact_min_rows=0)


def test_compact_min_rows_reaches_the_engine_from_the_run_config():
    from specco.config import ConfigError
    from specco.config_load import load_config
    from specco.runner.derive import generate_config
    cfg = load_config("configs/long_cotrain.toml", ["rollout.compact_min_rows=1"])
    assert generate_config(cfg, 1, 0).compact_min_rows == 1
    assert generate_config(load_config("configs/long_cotrain.toml"), 1, 0).compact_min_rows == 8
    with pytest.raises(ConfigError, match="compact_min_rows=3"):
        load_config("configs/long_cotrain.toml", ["rollout.compact_min_rows=3"])


@pytest.mark.parametrize("kind,control", [("plain", False), ("structured_draft", False), ("dflash", False),
                                          ("structured_draft", True), ("dflash", True)])  # control: k per level
def test_compaction_down_to_one_row_changes_no_output(kind, control):
    """compact_min_rows = 1: the chain of compacted states goes below 8 rows (the default floor) down to the
    last live row's own 1-row state, and the result (tokens, log-probs, τ, per-row rounds) equals a generation
    without compaction. With speculation control (k chosen per level, as the RL runs decode) under coupled
    sampling, the tokens, lengths and log-probs must still equal (τ and rounds then depend on the k chosen)."""
    if kind == "dflash":
        from test_block_rollout import _block_draft
        policy = tiny_policy(V=16, h=32, layers=3, seed=5)
        draft = _block_draft(policy, kind, gamma=3, scale=3.0)
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(0, 15, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g)
                   for _ in range(24)]
        base, eos, G = GenerateConfig(max_new_tokens=40, sampling=SAMPLED, num_draft_tokens=3), 2, 2
    else:
        policy, draft, prompts, eos, base = compaction_case(kind, SAMPLED)
        G = 1 if kind == "structured_draft" else 4  # its 2 never-ending prompts: 2 * G rows run to the end
    if control:
        base = GenerateConfig(**{**base.__dict__, "sampling": COUPLED, "spec_control": True})
    on = GenerateConfig(**{**base.__dict__, "eos_token_id": eos, "compact_below": 0.6, "compact_min_rows": 1})
    off = GenerateConfig(**{**base.__dict__, "eos_token_id": eos, "compact_below": 0.0})
    ref, _ = _run(policy, draft, prompts, off, G, seed=5)
    got, runner = _run(policy, draft, prompts, on, G, seed=5)
    levels = sorted(runner.stack.levels)
    assert min(levels) < 8, f"no level below 8 rows ({levels}): the test would prove nothing"
    assert [p.rows for p in runner.phases][-1] < 8
    if control:
        assert torch.equal(got.lengths, ref.lengths) and torch.equal(got.tokens, ref.tokens)
        torch.testing.assert_close(got.logprobs, ref.logprobs, atol=1e-5, rtol=0)
    else:
        _assert_same(got, ref)


def test_compaction_with_bucket_padding_rows():
    """Shape buckets add padding rows (finished from the start, cut from the result): 12 prompts -> a
    16-prompt bucket, 64 rows of which 16 padding. Compaction may pick them as its own padding; the
    result must equal an unbucketed, uncompacted generation."""
    policy, draft, prompts, eos, base = compaction_case("random_draft", SAMPLED)
    on = GenerateConfig(**{**base.__dict__, "eos_token_id": eos, "compact_below": 0.6, "bucket_shapes": True})
    off = GenerateConfig(**{**base.__dict__, "eos_token_id": eos, "compact_below": 0.0, "bucket_shapes": False})
    got, runner = _run(policy, draft, prompts, on, 4, seed=11)
    ref, _ = _run(policy, draft, prompts, off, 4, seed=11)
    assert runner.shape.prompts == 16 and runner.stack.levels
    _assert_same(got, ref)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_compaction_with_a_block_drafter_changes_no_output(kind, sampling):
    """The block drafter's trunk cache and per-row block buffers move with their rows: the same tokens, τ and
    acceptance counts with and without compaction (a broken move would keep the output — verification is
    lossless — but not the acceptance, which is why τ and the counters are compared too)."""
    from test_block_rollout import _block_draft
    policy = tiny_policy(V=16, h=32, layers=3, seed=5)
    draft = _block_draft(policy, kind, gamma=3, scale=3.0)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 15, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g) for _ in range(24)]
    base = GenerateConfig(max_new_tokens=40, sampling=sampling, num_draft_tokens=3, eos_token_id=2)
    ref, _ = _run(policy, draft, prompts, GenerateConfig(**{**base.__dict__, "compact_below": 0.0}), 2, seed=1)
    got, runner = _run(policy, draft, prompts, GenerateConfig(**{**base.__dict__, "compact_below": 0.6}), 2, seed=1)
    assert runner.stack.levels, "compaction never happened: the test would prove nothing"
    assert (ref.lengths < 40).any() and ref.tau > 1.0
    _assert_same(got, ref)


def test_row_rounds_are_each_rows_decode_rounds():
    """Plain decoding emits one token per round per live row, so a row's rounds are its length minus the
    prefill's token; with a draft a row needs at most that many, and the batch's target forwards (prefill
    included) are one more than its slowest row's rounds when rows stop at different times."""
    policy = tiny_policy()
    prompts = _prompts(policy.cfg.vocab_size)
    cfg = GenerateConfig(max_new_tokens=24, sampling=GREEDY, num_draft_tokens=3, eos_token_id=3, compact_below=0.0)
    plain, _ = _run(policy, None, prompts, cfg, 2, seed=0)
    assert torch.equal(plain.row_rounds, plain.lengths - 1)
    assert (plain.lengths < 24).any() and plain.num_target_forwards == int(plain.row_rounds.max()) + 1
    policy, draft = structured_pair()
    spec, _ = _run(policy, draft, _prompts(policy.cfg.vocab_size), cfg, 2, seed=0)
    assert (spec.row_rounds <= spec.lengths - 1).all() and (spec.row_rounds < spec.lengths - 1).any()


def test_phases_count_every_round_once_per_level():
    """GenerateOutput.phases: a Phase (rows, rounds, seconds, tau) per level entered, the whole batch first
    and then each compacted size (smaller each time); their rounds add up to the call's decode rounds, and
    the levels' τ, weighted by their live row-rounds, give back the call's τ."""
    policy, draft, prompts, eos, base = compaction_case("structured_draft", GREEDY)
    cfg = GenerateConfig(**{**base.__dict__, "eos_token_id": eos, "compact_below": 0.6})
    out, runner = _run(policy, draft, prompts, cfg, 4, seed=0)
    rows = [p.rows for p in out.phases]
    assert len(rows) >= 2 and rows == sorted(rows, reverse=True) and rows[0] == len(prompts) * 4
    assert sum(p.rounds for p in out.phases) == out.num_target_forwards - 1  # the prefill is not a round
    assert all(p.seconds >= 0 for p in out.phases)
    assert all(1.0 <= p.tau <= cfg.num_draft_tokens + 1 for p in out.phases)
    # the levels split the call's counts: decode tokens Σ (lengths - 1) and live row-rounds Σ row_rounds
    assert sum(p.emitted for p in out.phases) == int((out.lengths - 1).sum())
    assert sum(p.row_rounds for p in out.phases) == int(out.row_rounds.sum())
    assert len({p.tau for p in out.phases}) > 1  # the structured draft accepts differently at the tail
    off, _ = _run(policy, draft, prompts, GenerateConfig(**{**cfg.__dict__, "compact_below": 0.0}), 4, seed=0)
    assert len(off.phases) == 1 and off.phases[0].rounds == off.num_target_forwards - 1
    assert off.phases[0].tau == pytest.approx(off.tau)  # one level: its τ is the call's
