"""Coupled sampling (rollout.sampler = "coupled"): keyed Gumbel-max draws, speculation by agreement.

* the noise is a pure function of (key, position, id) with Gumbel statistics;
* plain coupled decoding samples the target's exact joint (chi-square, 10^5 rows), and the same test
  rejects noise that ignores the position (p < 1e-6): it can fail;
* speculative decoding with it (EAGLE-3 at k = 1..3, DFlash, DSpark; groups, EOS, compaction) emits
  exactly plain coupled decoding's tokens: the property that lets every arm of a run decode the same text;
* in the RL loop, the arms of one seed decode the same completions and train the same policy step after step;
* on CUDA, the graphed engine (speculation control re-choosing k mid-level, compaction) still emits eager
  plain decoding's tokens;
* the config field reaches the engine and is validated.
"""
import importlib
import math

import pytest
import torch

from specco.config_load import load_config
from specco.model.config import ConfigError
from specco.rollout import sampling
from specco.rollout.engine import RolloutEngine
from specco.rollout.generate import GenerateConfig, generate
from specco.rollout.sampling import SamplingParams, keyed_gumbel
from specco.runner.derive import generate_config
from specco.runner.rl import run_arm
from specco.runner.warmstart import new_draft
from test_block_rollout import _block_draft
from test_grpo import DigitTask, _cfg, _setup
from test_rollout_helpers import random_draft, structured_pair, tiny_policy
from test_speculative import _chi_square_pvalue, _exact_joint
from cli_helpers import DEMO  # noqa: E402

COUPLED = SamplingParams(temperature=1.0, coupled=True)


def test_keyed_gumbel_is_a_pure_function_with_gumbel_statistics():
    key = torch.tensor([0, 1, 12345, 2**31 - 1])
    pos = torch.tensor([[0, 1, 2], [0, 1, 2], [7, 8, 9], [100, 101, 5000]])
    g = keyed_gumbel(key, pos, 50)
    assert g.shape == (4, 3, 50) and g.dtype == torch.float32 and torch.isfinite(g).all()
    assert torch.equal(g, keyed_gumbel(key, pos, 50))  # no hidden state
    assert torch.equal(g[2, 1], keyed_gumbel(key[2:3], pos[2:3, 1:2], 50)[0, 0])  # depends on (key, pos, id) only
    assert not torch.equal(g[0, 0], g[1, 0]) and not torch.equal(g[0, 0], g[0, 1])
    # Gumbel(0, 1): mean = Euler's gamma, variance = pi^2 / 6; over 2.56M draws both within ~5 s.e.
    big = keyed_gumbel(torch.arange(512), torch.arange(50).expand(512, 50), 100).double()
    n = big.numel()
    assert abs(big.mean().item() - 0.5772157) < 5 * math.sqrt(math.pi ** 2 / 6 / n)
    assert abs(big.var().item() - math.pi ** 2 / 6) < 0.01
    # the exceedance probability P(G > 2) = 1 - exp(-exp(-2))
    assert abs((big > 2).double().mean().item() - (1 - math.exp(-math.exp(-2)))) < 0.002


def _peaked_policy():
    policy = tiny_policy(V=8, h=16, layers=2, seed=3)
    with torch.no_grad():
        policy.lm_head.weight.mul_(25.0)  # peaked, position-dependent p: a wrong noise shows
    return policy


@pytest.mark.e2e
@pytest.mark.parametrize("broken", [False, True])
def test_coupled_plain_decoding_samples_the_exact_joint(broken, monkeypatch):
    """10^5 rows of one prompt (each row its own key): the first 3 tokens against the exact joint. Broken:
    noise that ignores the position (every token of a row reuses one draw), which is not a sample of p."""
    if broken:
        real = sampling.keyed_gumbel
        # the prefill's, and the plain step's (speculative.next_token)
        for name in ("specco.rollout.generate", "specco.rollout.speculative"):
            monkeypatch.setattr(importlib.import_module(name), "keyed_gumbel", lambda key, pos, V: real(key, torch.zeros_like(pos), V))
    policy, T = _peaked_policy(), 3
    prompt = torch.tensor([1, 5, 2])
    out = generate(policy, [prompt], GenerateConfig(max_new_tokens=T, sampling=COUPLED), group_size=100_000,
                   generator=torch.Generator().manual_seed(0))
    pvalue = _chi_square_pvalue(out.tokens, _exact_joint(policy, prompt, T, COUPLED))
    assert (pvalue < 1e-6) if broken else (pvalue > 1e-3), pvalue


def _prompts(V, lens=(3, 7, 1, 5, 9, 2), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (L,), generator=g) for L in lens]


def _drafts(kind):
    if kind == "eagle3-structured":
        policy, draft = structured_pair(layer_scale=100.0)
    elif kind == "eagle3-random":
        policy = tiny_policy()
        draft = random_draft(policy, draft_vocab=24)
    else:
        policy = tiny_policy(V=5, h=16, layers=2, seed=3)  # small vocabulary: a random drafter agrees often
        draft = _block_draft(policy, kind, gamma=3, scale=3.0)
    return policy.double(), draft.double()


@pytest.mark.parametrize("kind,k", [("eagle3-structured", 1), ("eagle3-structured", 3), ("eagle3-random", 2),
                                    ("dflash", 3), ("dspark", 2)])
@pytest.mark.e2e
def test_coupled_speculation_emits_plain_tokens(kind, k):
    """Any draft, any k: the same tokens and log-probs as plain coupled decoding with the same generator seed
    (fp64, so no verify-vs-step rounding flips an argmax), with groups, EOS cut-offs and compaction."""
    policy, draft = _drafts(kind)
    prompts = _prompts(policy.cfg.vocab_size)
    T = 24
    run = lambda cfg, d=None, seed=7: generate(policy, prompts, cfg, draft=d, group_size=2,  # noqa: E731
                                               generator=torch.Generator().manual_seed(seed))
    base = run(GenerateConfig(max_new_tokens=T, sampling=COUPLED))
    counts = torch.bincount(base.tokens.flatten(), minlength=policy.cfg.vocab_size).double()
    eos = int(torch.where(counts > 0, counts, math.inf).argmin())  # the rarest token: some rows stop, some run on
    cfg = GenerateConfig(max_new_tokens=T, sampling=COUPLED, num_draft_tokens=k, eos_token_id=eos,
                         pad_token_id=-1, compact_below=0.6)
    plain, spec = run(cfg), run(cfg, draft)
    assert (plain.lengths < T).any() and plain.lengths.max() >= 10  # EOS cut rows short, others ran on
    assert torch.equal(spec.tokens, plain.tokens) and torch.equal(spec.lengths, plain.lengths)
    torch.testing.assert_close(spec.logprobs, plain.logprobs, atol=1e-9, rtol=0)
    assert 0 < spec.accept_rate[0] < 1  # proposals were both accepted and rejected
    assert not torch.equal(run(cfg, draft, seed=8).tokens, spec.tokens)  # the seed matters
    if kind == "eagle3-structured":
        assert spec.tau > 1.3 and spec.num_target_forwards < plain.num_target_forwards


def test_sampler_config():
    cfg = load_config(DEMO, ["rollout.sampler=coupled"])
    assert generate_config(cfg, None, 0).sampling.coupled
    assert not generate_config(load_config(DEMO, []), None, 0).sampling.coupled
    with pytest.raises(ConfigError, match="rollout.sampler='gumbel'"):
        load_config(DEMO, ["rollout.sampler=gumbel"])
    assert not SamplingParams(temperature=0.0, coupled=True).keyed  # greedy is already deterministic


@pytest.mark.e2e
def test_coupled_arms_decode_the_same_tokens_and_stay_in_lockstep(tmp_path):
    """rollout.sampler = coupled in the RL loop: the no-draft, frozen and co-trained arms of one seed draw the
    same completions at every step (the policies train on the same data, so they stay equal), while their
    drafts differ; with the default rejection sampler the same arms' samples part ways."""
    tok, policy = _setup()
    draft = new_draft(policy, torch.randint(0, tok.vocab_size, (4, 8)), aux_layer_ids=(0, 1))
    keys = ("reward", "completion_len", "policy/loss", "policy/grad_norm")
    rows = {}
    for sampler in ("coupled", "rejection"):
        cfg = _cfg(tmp_path, "train.steps=3", f"rollout.sampler={sampler}", "rollout.max_new_tokens=12")
        rows[sampler] = {arm: run_arm(cfg, arm, policy, None if arm == "none" else draft, DigitTask(), tok,
                                      tmp_path / sampler / arm, progress=False)
                         for arm in ("none", "frozen", "cotrained")}
    c = rows["coupled"]
    for arm in ("frozen", "cotrained"):
        for a, b in zip(c["none"], c[arm]):
            for key in keys:
                assert abs(a[key] - b[key]) <= 1e-6 * max(1.0, abs(a[key])), (arm, a["step"], key, a[key], b[key])
    assert c["cotrained"][-1]["tau"] > 1.0  # the draft did speculate
    r = rows["rejection"]
    assert any(a["completion_len"] != b["completion_len"] or a["reward"] != b["reward"]
               for a, b in zip(r["none"], r["cotrained"]))


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.e2e
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("kind", ["eagle3-structured", "dflash"])
def test_controlled_coupled_speculation_equals_eager_plain(kind, device):
    """Speculation control re-choosing k within a level, compaction, a reused runner; on GPU the keyed noise
    inside captured graphs. fp64 so that no verify-vs-step rounding flips an argmax."""
    dev = torch.device(device)
    policy, draft = (m.to(dev) for m in _drafts(kind))
    cfg = GenerateConfig(max_new_tokens=40, sampling=COUPLED, num_draft_tokens=3, spec_control=True,
                         compact_below=0.5)
    engine = RolloutEngine(policy, draft, cfg, cache_runners=1)
    engine.controller.recheck_rounds, engine.controller.min_tries = 4, 8
    for i, lens in enumerate([(30, 3, 7, 2), (5, 2, 1, 4)]):
        prompts = _prompts(policy.cfg.vocab_size, lens=lens, seed=i)
        got = engine.generate(prompts, 2, generator=torch.Generator(device=dev).manual_seed(i))
        ref = generate(policy, prompts, GenerateConfig(max_new_tokens=40, sampling=COUPLED, use_graphs=False),
                       group_size=2, generator=torch.Generator(device=dev).manual_seed(i))
        assert torch.equal(got.tokens, ref.tokens), i
