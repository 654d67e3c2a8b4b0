"""Block speculation in the rollout engine (DFlash / DSpark drafters, rollout/block_spec.py).

* the serving block forward equals the training forward of the same block (fp64: 1e-10);
* greedy block speculation emits exactly plain greedy decoding (any drafter: lossless);
* sampled block speculation has the target's exact joint distribution (chi-square, p > 1e-3), and the
  same test rejects a deliberately wrong verifier (p < 1e-6) — so it can fail.
"""
import pytest
import torch

from specco.model.dflash import BlockDraft, BlockDraftConfig
from specco.rollout import acceptance
from specco.rollout.engine import RolloutEngine
from specco.rollout.forward import RopeTable, block_propose_hidden, block_trunk_write
from specco.rollout.generate import GenerateConfig, generate
from specco.rollout.sampling import SamplingParams
from test_rollout_helpers import tiny_policy
from test_speculative import _chi_square_pvalue, _exact_joint, _wrong_verify_sampling

GREEDY = SamplingParams(temperature=0.0)


def _block_draft(policy, kind, gamma=3, layers=2, seed=1, scale=1.0):
    torch.manual_seed(seed)
    cfg = BlockDraftConfig.for_policy(policy.cfg, kind, gamma=gamma, mask_id=policy.cfg.vocab_size - 1,
                                      num_layers=layers)
    d = BlockDraft(cfg).to(policy.lm_head.weight.dtype).eval()
    with torch.no_grad():
        for n, p in d.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)  # not ones: a skipped norm would show
        if kind == "dspark":
            d.markov_w2.weight.normal_(0, 0.5)  # a live Markov bias, so its order of sampling matters
        d.norm.weight.mul_(scale)
    return d


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
@torch.no_grad()
def test_serving_block_equals_training_forward(kind):
    policy = tiny_policy(seed=2).double()
    draft = _block_draft(policy, kind).double()
    B, S = 2, 9
    ids = torch.randint(0, 31, (B, S))
    taps = policy(ids, tap_layers=draft.cfg.aux_layer_ids).taps.aux
    n = torch.tensor([4, 7])  # anchor (x_n) per row: trunk keys < n
    W = draft.cfg.block_size
    cache_len = 16
    cache = type(policy.new_cache(1, 1))(torch.zeros(2, B, 2, cache_len, 8, dtype=torch.float64),
                                         torch.zeros(2, B, 2, cache_len, 8, dtype=torch.float64))
    rope = RopeTable.build(draft.cfg.head_dim, draft.cfg.rope_theta, cache_len, "cpu", torch.float64,
                           scaling=draft.cfg.rope_scaling)
    block_trunk_write(draft, taps, torch.arange(S).expand(B, S), cache, rope)
    emb = policy.embed_tokens.weight
    got = block_propose_hidden(draft, emb[ids.gather(1, n[:, None]).squeeze(1)], emb[draft.cfg.mask_id], n,
                               cache, rope)
    slot_pos = n[:, None, None] + torch.arange(W)  # (B, 1, W)
    ref = draft(taps, emb[ids.gather(1, n[:, None])], emb[draft.cfg.mask_id], torch.arange(S).expand(B, S),
                slot_pos)[:, 0]  # (B, W, h)
    torch.testing.assert_close(got, ref, atol=1e-10, rtol=0)


@pytest.mark.e2e
@pytest.mark.parametrize("kind", ["dflash", "dspark"])
@pytest.mark.parametrize("k,group", [(1, 1), (3, 2)])
def test_greedy_block_speculation_equals_plain(kind, k, group):
    policy = tiny_policy(V=5, h=16, layers=2, seed=3)  # a small vocabulary: a random drafter agrees often
    draft = _block_draft(policy, kind, gamma=3, scale=3.0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 5, (n,), generator=g) for n in (3, 6, 1, 4)]
    T = 24
    base = generate(policy, prompts, GenerateConfig(max_new_tokens=T, sampling=GREEDY))
    eos = int(base.tokens[1, 6])  # some rows stop early, others run to T
    cfg = GenerateConfig(max_new_tokens=T, sampling=GREEDY, num_draft_tokens=k, eos_token_id=eos, pad_token_id=-1,
                         compact_below=0.6)
    plain = generate(policy, prompts, cfg, group_size=group)
    spec = generate(policy, prompts, cfg, draft=draft, group_size=group)
    assert torch.equal(spec.tokens, plain.tokens) and torch.equal(spec.lengths, plain.lengths)
    torch.testing.assert_close(spec.logprobs, plain.logprobs, atol=1e-5, rtol=0)
    assert 0 < spec.accept_rate[0] < 1  # proposals were both accepted and rejected


def _sampled(policy, draft, params, k, T=3, N=100_000, seed=0):
    prompt = torch.tensor([1, 5, 2])
    out = generate(policy, [prompt], GenerateConfig(max_new_tokens=T, sampling=params, num_draft_tokens=k),
                   draft=draft, group_size=N, generator=torch.Generator().manual_seed(seed))
    assert (out.lengths == T).all()
    return prompt, out


def _sampling_pair(kind):
    policy = tiny_policy(V=8, h=16, layers=2, seed=3)
    with torch.no_grad():
        policy.lm_head.weight.mul_(25.0)  # peaked p, and a q that differs from it
    return policy, _block_draft(policy, kind, gamma=3, seed=4, scale=0.3)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_block_speculative_sampling_is_lossless(kind):
    policy, draft = _sampling_pair(kind)
    params = SamplingParams(temperature=1.0)
    prompt, out = _sampled(policy, draft, params, k=2)
    assert 0.05 < out.accept_rate[0] < 0.95  # both branches of the rule are exercised
    pvalue = _chi_square_pvalue(out.tokens, _exact_joint(policy, prompt, 3, params))
    assert pvalue > 1e-3, pvalue


@pytest.mark.e2e
@pytest.mark.slow
def test_chi_square_rejects_wrong_verifier_with_block_drafter(monkeypatch):
    policy, draft = _sampling_pair("dflash")
    params = SamplingParams(temperature=1.0)
    monkeypatch.setattr(acceptance, "verify_sampling", _wrong_verify_sampling)
    prompt, out = _sampled(policy, draft, params, k=2)
    pvalue = _chi_square_pvalue(out.tokens, _exact_joint(policy, prompt, 3, params))
    assert pvalue < 1e-6, pvalue


def test_engine_takes_a_block_drafter_and_refits_it():
    policy = tiny_policy(V=8, h=16, layers=2, seed=3)
    draft = _block_draft(policy, "dflash")
    engine = RolloutEngine(policy, draft, GenerateConfig(max_new_tokens=8, sampling=GREEDY, num_draft_tokens=3))
    prompts = [torch.tensor([1, 2, 3])]
    a = engine.generate(prompts)
    new = _block_draft(policy, "dflash", seed=9)
    assert engine.refit(None, new.state_dict())["draft"] == len(new.state_dict())
    b = engine.generate(prompts)
    assert torch.equal(a.tokens, b.tokens)  # lossless: the draft changes speed, never the text
    with pytest.raises(ValueError, match="gamma"):
        RolloutEngine(policy, draft, GenerateConfig(max_new_tokens=8, num_draft_tokens=4)).generate(prompts)


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
@torch.no_grad()
def test_engine_proposals_score_through_the_policy_head(kind, monkeypatch):
    """The first block the engine proposes after the prefill has the training forward's slot logits, through
    the policy's LM head (an untied one here: scoring against the input embeddings instead left warm drafts
    accepted 2% of the time on the H200 while their simulated tau was 4.8)."""
    from specco.rollout import block_spec
    policy = tiny_policy(V=16, h=32, layers=3, seed=4).double()
    assert policy.lm_head.weight is not policy.embed_tokens.weight
    draft = _block_draft(policy, kind, gamma=3).double()
    seen = []
    orig = block_spec.BlockSpeculativeSteps._slot_tokens
    monkeypatch.setattr(block_spec.BlockSpeculativeSteps, "_slot_tokens",  # seen: (B, V) per slot
                        lambda self, logits, j0: seen.extend(logits.clone().unbind(1)) or orig(self, logits, j0))
    prompt = torch.tensor([3, 1, 4, 1, 5, 9])
    out = generate(policy, [prompt], GenerateConfig(max_new_tokens=4, sampling=GREEDY, num_draft_tokens=3),
                   draft=draft)
    S = len(prompt)
    ids = torch.cat([prompt, out.tokens[0, :1]])[None]  # the prompt and the prefill's token x_S (the anchor)
    taps = policy(ids, tap_layers=draft.cfg.aux_layer_ids).taps.aux
    emb, head = policy.embed_tokens.weight, policy.lm_head.weight
    slot_pos = torch.tensor([[[S + w for w in range(draft.cfg.block_size)]]])  # (1, 1, W)
    hid = draft.predicting(draft(taps, emb[ids[:, S:]], emb[draft.cfg.mask_id], torch.arange(S + 1)[None], slot_pos))
    prev = torch.cat([ids[:, S], torch.cat(seen[:2]).argmax(-1)])  # DSpark's Markov inputs: x_S, then its proposals
    for j in range(3):
        ref = draft.logits(hid[:, 0, j], head, prev[j:j + 1]) if kind == "dspark" else draft.logits(hid[:, 0], head)[:, j]
        torch.testing.assert_close(seen[j], ref, atol=1e-9, rtol=0)


@pytest.mark.e2e
@pytest.mark.parametrize("kind", ["dflash", "dspark"])
@torch.no_grad()
def test_every_round_proposes_what_the_training_forward_predicts(kind, monkeypatch):
    """At every round, not only the first: the engine's slot logits equal the training forward's block at the
    same anchor of the finished sequence (trunk = the policy's taps before the anchor), fp64. This covers the
    catch-up that extends the draft's trunk cache with the accepted tokens' taps, over ragged acceptance and
    rows finishing at different rounds. DSpark's slot j is compared where its Markov input (the previous
    proposal) is the sequence's own token, i.e. where the engine and the training forward condition alike.
    (Checked the same way on the CPU demo's warm DSpark, whose simulated τ is above its real one: the engine
    matched there too, so that gap is in the teacher-forced simulation on sampled sequences.)"""
    from specco.rollout import block_spec
    policy = tiny_policy(V=16, h=32, layers=3, seed=5).double()  # seed 5: some acceptance, a row ending early
    draft = _block_draft(policy, kind, gamma=3, scale=3.0).double()
    rounds = []
    orig_prop, orig_tok = block_spec.BlockSpeculativeSteps.propose, block_spec.BlockSpeculativeSteps._slot_tokens

    def propose(self):
        seen = []  # (B, V) per slot
        monkeypatch.setattr(block_spec.BlockSpeculativeSteps, "_slot_tokens",
                            lambda s, logits, j0: seen.extend(logits.clone().unbind(1)) or orig_tok(s, logits, j0))
        orig_prop(self)
        st = self.st
        rounds.append((st.n.clone(), st.finished.clone(), seen, st.draft_tok.clone()))

    monkeypatch.setattr(block_spec.BlockSpeculativeSteps, "propose", propose)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 15, (int(n),), generator=g) for n in (3, 6, 4, 8)]
    out = generate(policy, prompts, GenerateConfig(max_new_tokens=14, sampling=GREEDY, num_draft_tokens=3,
                                                   eos_token_id=2, compact_below=0.0), draft=draft)
    emb, head = policy.embed_tokens.weight, policy.lm_head.weight
    W, checked = draft.cfg.block_size, 0
    accepted = int(out.accept_counts[0].sum())
    for b, prompt in enumerate(prompts):
        seq = torch.cat([prompt, out.tokens[b, :int(out.lengths[b])]])
        taps = policy(seq[None], tap_layers=draft.cfg.aux_layer_ids).taps.aux
        for n, finished, seen, proposed in rounds:
            nb = int(n[b])
            if finished[b] or nb + 3 >= len(seq):  # done, or a block whose labels run past the sequence
                continue
            hid = draft.predicting(draft(taps[:, :nb], emb[seq[nb]][None, None], emb[draft.cfg.mask_id],
                                         torch.arange(nb)[None], torch.arange(nb, nb + W)[None, None]))
            for j in range(3):
                if kind == "dspark" and any(int(proposed[b, i]) != int(seq[nb + 1 + i]) for i in range(j)):
                    break  # the engine's Markov input differs from the sequence's own token from here on
                ref = (draft.logits(hid[:, 0, j], head, seq[nb + j][None]) if kind == "dspark"
                       else draft.logits(hid[:, 0], head)[:, j])
                torch.testing.assert_close(seen[j][b:b + 1], ref, atol=1e-9, rtol=0)
                checked += 1
    assert checked >= 20 and accepted > 0, (checked, accepted)  # many rounds compared, with some acceptance


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5, top_p=0.9)])
def test_dflash_slots_sampled_together_equal_one_at_a_time(params):
    """DFlash's k independent slots go through one softmax and one sampling (`_slot_tokens` on (B, k, V));
    slot by slot with the same uniforms gives the same tokens and the same stored q, bit for bit."""
    from types import SimpleNamespace
    from specco.rollout.block_spec import BlockSpeculativeSteps
    g = torch.Generator().manual_seed(0)
    B, k, V = 5, 4, 37
    logits = 3 * torch.randn(B, k, V, generator=g)

    def steps():
        st = SimpleNamespace(q_draft=torch.zeros(B, k, V), u=torch.rand(B, 2 * k + 1, generator=torch.Generator().manual_seed(1)))
        return SimpleNamespace(params=params, st=st)
    together, alone = steps(), steps()
    tok = BlockSpeculativeSteps._slot_tokens(together, logits, 0)
    one = torch.stack([BlockSpeculativeSteps._slot_tokens(alone, logits[:, j:j + 1], j)[:, 0] for j in range(k)], 1)
    assert tok.shape == (B, k) and torch.equal(tok, one)
    assert torch.equal(together.st.q_draft, alone.st.q_draft) and together.st.q_draft.sum() > 0
