"""The tracked plain round (rollout/speculative.py `track`) and the rule for levels that uses it (control.py).

A level that decodes plainly because a verify does not pay at its batch size runs the tracked round: the plain
step's token plus the draft's catch-up of its taps, so the smaller levels after it may speculate. Shown here:
the tracked round emits exactly the plain step's tokens and log-probs (same sampler, same draw) in every
sampling mode; after tracked rounds the draft's state is what a fresh recompute over the sequence gives
(EAGLE-3's pass-1 cache and carried output, the block drafter's trunk K/V); and with costs that make the root
too large to speculate, the root tracks, a compacted level speculates at a high acceptance, and the tokens stay
those of plain decoding — where the old rule (no tracked round) leaves every level plain.
"""
from types import SimpleNamespace

import pytest
import torch

from specco.model.layers import KVCache
from specco.rollout import levels
from specco.rollout.control import Choice, LevelK, SpecController
from specco.rollout.forward import RopeTable, block_trunk_write
from specco.rollout.generate import DecodeRunner, GenerateConfig
from specco.rollout.sampling import SamplingParams
from specco.rollout.shapes import pad_prompts
from test_block_rollout import _block_draft
from test_compaction import _structured_prompts
from test_rollout_helpers import one_thread, structured_pair, tiny_policy  # noqa: F401
from test_speculative import _prompts, assert_round_invariant

GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=1.0)
COUPLED = SamplingParams(temperature=1.0, coupled=True)


def _tracking_runner(policy, draft, sampling, T=40, k=3, **kw):
    """A runner with speculation control (it builds the plain and tracked step sets) and compaction on down
    to one row, so its root level has a tracked round."""
    kw = {"compact_min_rows": 1, **kw}
    cfg = GenerateConfig(max_new_tokens=T, sampling=sampling, num_draft_tokens=k, spec_control=True, **kw)
    return DecodeRunner(policy, cfg, draft)


def _drive(runner, prompts, G, seed, ks):
    """Prefill, then one round per entry of `ks` on the root: "t" a tracked plain round, 0 the plain step,
    k > 0 a speculative round of k."""
    runner.prefill(prompts, G, generator=torch.Generator().manual_seed(seed))
    level = runner.level
    for k in ks:
        level.k, level.tracking = (0, True) if k == "t" else (k, False)
        runner.round()


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED, COUPLED], ids=["greedy", "sampled", "coupled"])
@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
@torch.no_grad()
def test_tracked_round_emits_the_plain_steps_tokens(kind, sampling):
    """Eight tracked rounds and eight plain steps from the same prefill and draws: equal tokens, lengths and
    log-probs, bit for bit (one sampler, next_token, over the same logits)."""
    if kind == "dflash":
        policy = tiny_policy(V=16, h=32, layers=3, seed=5)
        draft = _block_draft(policy, "dflash", gamma=3, scale=3.0)
        prompts = _prompts(policy.cfg.vocab_size - 1)  # not its mask token
    else:
        policy, draft = structured_pair()
        prompts = _prompts(policy.cfg.vocab_size)
    outs = []
    for ks in (["t"] * 8, [0] * 8):
        runner = _tracking_runner(policy, draft, sampling)
        _drive(runner, prompts, 2, seed=3, ks=ks)
        assert runner.level.tracked is not None
        outs.append((runner.st.out_tokens.clone(), runner.st.out_len.clone(), runner.st.out_logp.clone(),
                     runner.st.n.clone()))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert int(outs[0][1].min()) > 5  # the rounds emitted


@pytest.mark.parametrize("params", [GREEDY, SAMPLED])
@torch.no_grad()
def test_tracked_rounds_keep_the_eagle3_invariant(params):
    """Tracked rounds between speculative ones: the draft's pass-1 cache and carried output equal a fresh
    recompute over each row's sequence (test_speculative.assert_round_invariant), with rounds of every kind
    and acceptances and rejections among the speculative ones."""
    policy, draft = structured_pair(layer_scale=100.0)
    draft.midlayer.self_attn.o_proj.weight.normal_(0, 0.02)  # the draft's K/V depend on its inputs
    prompts = _prompts(policy.cfg.vocab_size, lens=(3, 7, 1, 5))
    runner = _tracking_runner(policy, draft, params)
    _drive(runner, prompts, 2, seed=1, ks=["t", "t", "t", 3, 2, "t", 3, "t"])
    assert_round_invariant(policy, draft, runner.st, prompts, 2)


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
@torch.no_grad()
def test_tracked_rounds_keep_the_block_drafters_trunk(kind):
    """After tracked and speculative rounds the block drafter's trunk K/V at positions < n equal the trunk
    written from a fresh forward's taps over the row's sequence (fp64, atol 1e-10)."""
    policy = tiny_policy(V=16, h=32, layers=3, seed=5).double()
    draft = _block_draft(policy, kind, gamma=3, scale=3.0).double()
    prompts = _prompts(policy.cfg.vocab_size - 1, lens=(3, 6, 4, 8))
    runner = _tracking_runner(policy, draft, GREEDY)
    _drive(runner, prompts, 1, seed=0, ks=["t", "t", 3, "t", 2, "t", "t"])
    st = runner.st
    assert not st.finished.any()
    dc = draft.cfg
    rope = RopeTable.build(dc.head_dim, dc.rope_theta, st.d_cache.max_len, "cpu", torch.float64,
                           scaling=dc.rope_scaling)
    for b, prompt in enumerate(prompts):
        n = int(st.n[b])
        seq = torch.cat([prompt, st.out_tokens[b, : st.out_len[b]]])
        assert n == seq.numel() - 1
        taps = policy(seq[None, :n], tap_layers=dc.aux_layer_ids).taps.aux
        fresh = KVCache.empty(dc.num_layers, 1, dc.num_kv_heads, st.d_cache.max_len, dc.head_dim, "cpu",
                              torch.float64)
        block_trunk_write(draft, taps, torch.arange(n)[None], fresh, rope)
        torch.testing.assert_close(st.d_cache.k[:, b, :, :n], fresh.k[:, 0, :, :n], atol=1e-10, rtol=0)
        torch.testing.assert_close(st.d_cache.v[:, b, :, :n], fresh.v[:, 0, :, :n], atol=1e-10, rtol=0)


def _costs_by_rows(monkeypatch):
    """Level.measure replaced by costs that grow with the rows: a round of k costs 1 + 0.1·k·(rows/8)² plain
    steps, so speculation cannot pay at 48 rows (the root: k = 1 costs 4.6 steps) and pays at <= 16."""
    def measure(self, iters=None):
        self.costs = {k: 1.0 + 0.1 * k * (self.rows / 8) ** 2 for k in self.steps}
        self.track_cost = 1.05 if self.tracked is not None else None
        return self.costs
    monkeypatch.setattr(levels.Level, "measure", measure)


@pytest.mark.parametrize("tracked", [True, False], ids=["tracked", "old_rule"])
@torch.no_grad()
def test_root_too_large_to_speculate_tracks_and_the_tail_speculates(tracked, monkeypatch):
    """The H200 dense twin's case: the root chooses plain; with the tracked round a compacted level chooses
    k > 0 and its rounds accept like speculation from a sound draft state (a broken state would accept
    little from this near-deterministic pair), and the tokens equal a plain call's under coupled sampling.
    Without it (old_rule: no tracked round built) every level stays plain — what this change is for."""
    _costs_by_rows(monkeypatch)
    if not tracked:
        real_init = levels.Level.__init__
        monkeypatch.setattr(levels.Level, "__init__",
                            lambda self, st, steps, graphs, root_rows, tracked=None:
                            real_init(self, st, steps, graphs, root_rows))
    policy, draft = structured_pair()
    prompts, eos = _structured_prompts(policy.cfg.vocab_size)
    runner = _tracking_runner(policy, draft, COUPLED, T=64, eos_token_id=eos, compact_below=0.6,
                              compact_min_rows=8)
    runner.prefill(prompts, 4, generator=torch.Generator().manual_seed(5))
    runner.run()
    got = runner.result()
    root, below = got.choices[0], got.choices[1:]
    assert root.rows == 48 and root.k == 0 and root.tracked is tracked
    assert below, "no compaction: the test would prove nothing"
    runner.prefill_padded(*pad_prompts(prompts), 4, generator=torch.Generator().manual_seed(5), speculate=False)
    runner.run()
    plain = runner.result()
    assert torch.equal(got.tokens, plain.tokens) and torch.equal(got.lengths, plain.lengths)
    torch.testing.assert_close(got.logprobs, plain.logprobs, atol=1e-5, rtol=0)
    if tracked:
        spec = [c for c in below if c.k > 0]
        assert spec and all(c.rows <= 16 for c in spec), [str(c) for c in got.choices]
        tail = [p for p in got.phases if p.rows <= 16]
        assert max(p.tau for p in tail) > 2.0, [(p.rows, p.tau) for p in got.phases]
    else:
        assert all(c.k == 0 and not c.tracked for c in got.choices) and got.tau == 1.0


def test_a_hopeless_draft_is_not_tracked():
    """A level at k = 0 tracks only while the draft promises tokens: with every position tried and never
    accepted E[τ] = 1, the level runs the untracked plain step (and keeps the smaller levels plain)."""
    ctl = SpecController(k_max=3)
    lk = LevelK(ctl)
    zeros = torch.zeros(3, dtype=torch.long)

    def level():
        return SimpleNamespace(k=0, tracked=object(), tracking=False, rows=64,
                               costs={0: 1.0, 1: 5.0, 2: 6.0, 3: 7.0}, choice=None,
                               st=SimpleNamespace(n_accepted=zeros, n_tried=zeros))
    fresh = level()
    lk.enter(fresh, allow_speculation=True)  # the optimistic prior: an untried draft is tracked
    assert fresh.k == 0 and fresh.tracking and str(fresh.choice) == "64:k0t"
    ctl.update(torch.zeros(3), torch.full((3,), 1000.0))  # tried often, never accepted
    hopeless = level()
    lk.enter(hopeless, allow_speculation=True)
    assert hopeless.k == 0 and not hopeless.tracking and str(hopeless.choice) == "64:k0"
    plain_call = level()
    lk.enter(plain_call, allow_speculation=False)
    assert not plain_call.tracking
    assert isinstance(plain_call.choice, Choice)


@torch.no_grad()
def test_no_tracking_once_no_smaller_level_pays(monkeypatch):
    """A level tracks for the levels below it. Where speculation costs 20 plain steps a round at every size, the
    first call tracks at the root (its smaller levels not measured yet), measures them, and the second call's
    root, knowing that no smaller level pays, runs the untracked plain step."""
    def measure(self, iters=None):
        self.costs = {k: 1.0 + 20.0 * (k > 0) for k in self.steps}
        self.track_cost = 1.05 if self.tracked is not None else None
        return self.costs
    monkeypatch.setattr(levels.Level, "measure", measure)
    policy, draft = structured_pair()
    prompts, eos = _structured_prompts(policy.cfg.vocab_size)
    runner = _tracking_runner(policy, draft, COUPLED, T=64, eos_token_id=eos, compact_below=0.6,
                              compact_min_rows=8)
    roots = []
    for _ in range(2):
        runner.prefill(prompts, 4, generator=torch.Generator().manual_seed(5))
        runner.run()
        out = runner.result()
        assert all(c.k == 0 for c in out.choices) and len(out.choices) > 1
        roots.append(out.choices[0])
    assert roots[0].tracked and not roots[1].tracked
