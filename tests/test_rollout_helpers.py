"""Tiny models for the rollout tests (imported by test_rollout.py / test_speculative.py; no tests here).

`structured_pair` builds a policy/draft pair whose draft is *often but not always* right, so
speculative decoding sees ragged acceptance (rows accepting 0..k tokens in the same round):

* policy: embeddings e_x ~ N(0, 1); lm_head row v = e_{σ⁻¹(v)} for a permutation σ, so with a
  hidden state ≈ e_x the logits peak at σ(x): a "successor" bigram model. Its decoder layers are
  random with o_proj/down_proj scaled by `layer_scale`, so the context perturbs that bigram (and the
  target's KV cache matters for the result).
* draft: fc = identity on the (single) aux tap, attention o_proj = 0 and MLP down_proj = 0 (q/k/v
  stay random, so its KV cache is non-trivial), head row v = e_{σ⁻²(v)}: pass 1 at anchor i reads
  tap_i ≈ e_{x_i} and proposes σ²(x_i) = x_{i+2} (right). Chained passes reuse the same hidden, so
  they propose σ²(x_i) again — right only where σ acts with period dividing d-1 (e.g. σ's fixed
  points), wrong elsewhere: acceptance is ragged across rows by construction.
"""
import pytest
import torch

from specco.model.config import DraftConfig, PolicyConfig
from specco.model.draft import Eagle3Draft, build_vocab_maps
from specco.model.policy import Policy


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a small shared machine OpenMP
    spin-waiting against other processes slowed these tests ~100x. Restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_policy(V=32, h=32, layers=4, seed=0, tie=False, kv=2):
    torch.manual_seed(seed)
    pc = PolicyConfig(vocab_size=V, hidden_size=h, intermediate_size=2 * h, num_layers=layers,
                      num_heads=4, num_kv_heads=kv, tie_word_embeddings=tie)
    return Policy(pc).eval()


def random_draft(policy, seed=1, draft_vocab=None):
    torch.manual_seed(seed)
    dc = DraftConfig.for_policy(policy.cfg, draft_vocab_size=draft_vocab)
    return Eagle3Draft(dc).eval()


def sigma_perm(V, fixed, seed):
    """A permutation of 0..V-1 whose first `fixed` ids are fixed points, the rest shuffled."""
    g = torch.Generator().manual_seed(seed)
    rest = torch.arange(fixed, V)[torch.randperm(V - fixed, generator=g)]
    return torch.cat([torch.arange(fixed), rest])


@torch.no_grad()
def structured_pair(V=32, h=32, layers=4, layer_scale=5.0, fixed=12, draft_vocab=None, seed=0):
    policy = tiny_policy(V, h, layers, seed)
    g = torch.Generator().manual_seed(seed + 100)
    sigma = sigma_perm(V, fixed, seed)
    inv = torch.argsort(sigma)  # σ⁻¹
    emb = torch.randn(V, h, generator=g)
    policy.embed_tokens.weight.copy_(emb)
    policy.lm_head.weight.copy_(emb[inv])  # logits_v = e_{σ⁻¹(v)} · hidden
    for layer in policy.layers.values():
        layer.self_attn.o_proj.weight.mul_(layer_scale)
        layer.mlp.down_proj.weight.mul_(layer_scale)
    dc = DraftConfig.for_policy(policy.cfg, draft_vocab_size=draft_vocab, aux_layer_ids=(1,))
    draft = Eagle3Draft(dc).eval()
    if draft_vocab is not None and draft_vocab < V:
        # keep the fixed points and some more: a smaller vocab with a non-identity d2t
        counts = torch.zeros(V)
        counts[:fixed] = 10.0
        counts[fixed:] = torch.rand(V - fixed, generator=g)
        draft.set_vocab_maps(*build_vocab_maps(counts, draft_vocab))
    draft.fc.weight.copy_(torch.eye(h))
    draft.midlayer.self_attn.o_proj.weight.zero_()
    draft.midlayer.mlp.down_proj.weight.zero_()
    inv2 = inv[inv]  # σ⁻²
    draft.lm_head.weight.copy_(emb[inv2][draft.draft_to_target])
    return policy, draft
