"""EAGLE-3 speculative decoding: the per-round steps (propose, verify, catch up) and the draft prefill.

Invariant between rounds, for every live row (x_n = last_tok, see state.py):
    target cache: K/V valid at positions < n.
    draft cache:  pass-1 K/V valid for anchors 0..n-1, where pass-1 at anchor i is
                  step(hidden = fc(taps_i), emb(x_{i+1}), RoPE position i) and writes position i.
    d_logits0 / d_hidden0: that pass-1 step's output at anchor n-1 — the draft's guess for x_{n+1}.

One round (docs/DESIGN.md §2 table, §6):
  propose   x̂_1 from d_logits0; then chained passes d = 2..k at anchor n-1: hidden = previous pass's
            output (pre-norm), token input emb(x̂_{d-1}), RoPE position n+d-2, writing draft cache
            position n+d-2. A pass-d query thus sees trunk anchors <= n-1 plus its branch n..n+d-2 —
            exactly EAGLE-3's TTT attention mask. x̂_d comes from pass d (k draft forwards total,
            counting the catch-up that produced d_logits0).
  verify    ONE target forward over [x_n, x̂_1..x̂_k] at positions n..n+k (with taps), then the
            acceptance rule (acceptance.py): a accepted + 1 correction/bonus token.
  catch up  draft pass-1 over anchors n..n+k with the verify's taps and emb(block_j) (block_j is
            x_{n+j+1} for j <= a). Static width k+1: anchors past n+a see rejected tokens, but their
            cache entries sit at positions >= n+a+1 = the next round's n, which the next round's
            chained passes and catch-up overwrite before any query can read them. The output at
            anchor n+a becomes the next d_logits0 / d_hidden0. Then n += a+1.
Rejection is a length change: nothing is copied in either cache.

A tracked plain round (k = 0, `track`): a plain step — one target forward at position n, the plain
sampler's token, so exactly the tokens PlainSteps emits — that also keeps the invariant: its taps at n
go through the catch-up (one anchor), so a level that decodes plainly because speculation does not pay
at its batch size leaves the draft ready for the smaller levels after it (control.py, rule for levels).
"""
from __future__ import annotations

import torch

from ..model.draft import Eagle3Draft
from ..model.layers import KVCache
from ..model.policy import Policy
from . import acceptance
from .forward import RopeTable, draft_step, policy_forward
from .tp import pick_one, pick_vocab_parallel, tp_group_of, verify_sampling_vocab_parallel, vocab_parallel
from .sampling import (SamplingParams, keyed_draw, keyed_gumbel, pick_tokens_logp, processed_logprobs,
                       processed_probs, sample_from_probs)
from .state import DecodeState, commit, fill_groups, group_leaders


def next_token(policy: Policy, st: DecodeState, params: SamplingParams,
               logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain sampler's token for position n+1 from the target's logits (B, V) (B, V/tp under engine tp) at
    position n, and its log-prob: (B,), (B,). One home for plain decoding and the tracked round, so both emit
    the same token from the same draw (st.u[:, 0], or the row key at n+1)."""
    if vocab_parallel(policy, params):  # a tp shard choosing from its vocabulary block
        return pick_one(logits, params, tp_group_of(policy), st.key, st.n + 1, None if st.u is None else st.u[:, 0])
    if st.key is not None:  # coupled: the keyed noise of the token's position n+1
        noise = keyed_gumbel(st.key, (st.n + 1)[:, None], logits.shape[-1])[:, 0]
    else:
        noise = st.u[:, 0] if st.u is not None else None
    return pick_tokens_logp(logits, params, noise)


def gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x: (B, W, D), idx: (B,) -> x[b, idx[b]] (B, D) with a static-shape gather."""
    B, _, D = x.shape
    return x.gather(1, idx[:, None, None].expand(B, 1, D)).squeeze(1)


class SpeculativeSteps:
    """The three in-place round steps over a DecodeState, for k draft tokens per round.

    The state's buffers are sized for the runner's largest k (`st.draft_tok.shape[1]`); a smaller k
    (speculation control, control.py) uses their leading columns, so one state serves every k and
    the choice can change between rounds. Uniform layout of st.u (sampling only), whatever k:
    [:, 0:k] draft samples x̂_1..x̂_k, [:, k:2k] acceptance tests, [:, 2k] residual/bonus sample
    (the runner draws num_uniforms(k_max) per row and round, so the random stream does not depend on k).
    """

    def __init__(self, policy: Policy, draft: Eagle3Draft, st: DecodeState, params: SamplingParams,
                 k: int, max_new_tokens: int, stop_ids: torch.Tensor | None, rope: RopeTable,
                 draft_rope: RopeTable):
        self.policy, self.draft, self.st, self.params = policy, draft, st, params
        self.k, self.max_new_tokens, self.stop_ids = k, max_new_tokens, stop_ids
        self.rope, self.draft_rope = rope, draft_rope
        self.offsets = torch.arange(k + 1, device=st.n.device)  # (k+1,) positions n..n+k
        self.aux = tuple(draft.cfg.aux_layer_ids)
        # k = 0: the tracked plain round (module docstring)
        self.order = ["propose", "verify", "catch_up"] if k > 0 else ["track", "catch_up"]
        self.fns = {"propose": self.propose, "verify": self.verify, "track": self.track, "catch_up": self.catch_up}

    @staticmethod
    def num_uniforms(k: int) -> int:
        return 2 * k + 1

    def _draft_token(self, logits: torch.Tensor, j: int) -> torch.Tensor:
        """Proposal x̂_{j+1} (target ids) from draft logits (B, Vd); stores q for the verifier."""
        if self.params.greedy:
            return self.draft.draft_to_target[logits.argmax(-1)]
        if self.params.keyed:  # x̂_{j+1} sits at position n+1+j
            pos = (self.st.n + 1 + j)[:, None]  # (B, 1)
            return keyed_draw(self.draft.to_target_logits(logits)[:, None], self.params, self.st.key, pos)[:, 0]
        q = processed_probs(self.draft.to_target_logits(logits), self.params)  # (B, V)
        self.st.q_draft[:, j].copy_(q)
        return sample_from_probs(q, self.st.u[:, j])

    def propose(self):
        st = self.st
        logits, hidden = st.d_logits0, st.d_hidden0  # pass 1 at anchor n-1 (from the catch-up)
        tok = self._draft_token(logits, 0)
        st.draft_tok[:, 0].copy_(tok)
        for j in range(1, self.k):  # pass d = j+1 at anchor n-1, RoPE position n+j-1
            emb = self.policy.embed_tokens(tok)[:, None]  # (B, 1, h)
            pos = (st.n + (j - 1))[:, None]  # (B, 1)
            logits, hidden = draft_step(self.draft, hidden[:, None], emb, pos, st.d_cache, self.draft_rope)
            logits, hidden = logits[:, 0], hidden[:, 0]  # (B, Vd), (B, h)
            tok = self._draft_token(logits, j)
            st.draft_tok[:, j].copy_(tok)

    def verify(self):
        st, k = self.st, self.k
        draft_tok = st.draft_tok[:, :k]
        inp = torch.cat([st.last_tok[:, None], draft_tok], dim=1)  # (B, k+1)
        pos = st.n[:, None] + self.offsets  # (B, k+1)
        p = self.params
        vp = vocab_parallel(self.policy, p)  # a tp shard choosing from its vocabulary block
        logits, _, taps = policy_forward(self.policy, inp, pos, st.t_cache, self.rope, tap_layers=self.aux,
                                         whole_logits=not vp)
        if vp and not p.greedy and not p.keyed:  # rejection sampling, p never gathered
            verdict, logp = verify_sampling_vocab_parallel(logits, p.temperature, st.q_draft[:, :k], draft_tok,
                                                           st.u[:, k:2 * k], st.u[:, 2 * k], tp_group_of(self.policy))
        elif vp:  # greedy / coupled: the target's own choices at the k+1 positions, then agreement
            target, logp = pick_vocab_parallel(logits, p, tp_group_of(self.policy), st.key, pos + 1)
            verdict = acceptance.verify_tokens(target, draft_tok)
        elif p.greedy:
            verdict = acceptance.verify_greedy(logits, draft_tok)
            logp = logits.float().log_softmax(-1).gather(-1, verdict.tokens[..., None]).squeeze(-1)  # raw (generate.py)
        elif p.keyed:
            logp_all = processed_logprobs(logits, p)  # (B, k+1, V)
            gumbel = keyed_gumbel(st.key, pos + 1, logp_all.shape[-1])  # tokens at positions n+1..n+k+1
            verdict = acceptance.verify_coupled(logp_all, gumbel, draft_tok)
            logp = logp_all.gather(-1, verdict.tokens[..., None]).squeeze(-1)  # (B, k+1)
        elif p.top_k == 0 and p.top_p == 1.0:  # fused on CUDA: p is never materialised (acceptance.py)
            verdict, logp = acceptance.verify_sampling_logits(logits, p.temperature, st.q_draft[:, :k], draft_tok,
                                                              st.u[:, k:2 * k], st.u[:, 2 * k])
        else:
            logp_all = processed_logprobs(logits, p)  # (B, k+1, V)
            verdict = acceptance.verify_sampling(logp_all.exp(), st.q_draft[:, :k], draft_tok,
                                                 st.u[:, k:2 * k], st.u[:, 2 * k])
            logp = logp_all.gather(-1, verdict.tokens[..., None]).squeeze(-1)  # (B, k+1)
        a = verdict.num_accepted
        _, active = commit(st, verdict.tokens, a + 1, logp, self.max_new_tokens, self.stop_ids)
        # per draft position j+1: accepted in this round (a > j), counted over rows live at its start
        j = self.offsets[None, :k]  # (1, k)
        st.n_accepted[:k].add_(((j < a[:, None]) & active[:, None]).sum(0))
        st.n_proposed[:k].add_(active.sum())
        st.n_tried[:k].add_(((j <= a[:, None]) & active[:, None]).sum(0))  # tokens 1..j accepted
        st.num_accepted.copy_(a)
        st.block[:, : k + 1].copy_(verdict.tokens)
        st.taps[:, : k + 1].copy_(taps.aux)

    def track(self):
        """A plain step that keeps the draft's invariant: the target forward at n with taps, the plain sampler's
        token (next_token), committed as a round with none accepted; the catch-up then takes the one anchor n."""
        st = self.st
        logits, _, taps = policy_forward(self.policy, st.last_tok[:, None], st.n[:, None], st.t_cache, self.rope,
                                         tap_layers=self.aux, whole_logits=not vocab_parallel(self.policy, self.params))
        tok, logp = next_token(self.policy, st, self.params, logits[:, 0])
        commit(st, tok[:, None], torch.ones_like(tok), logp[:, None], self.max_new_tokens, self.stop_ids)
        st.num_accepted.zero_()
        st.block[:, 0].copy_(tok)
        st.taps[:, :1].copy_(taps.aux)

    def catch_up(self):
        st, k = self.st, self.k
        hidden = self.draft.project_taps(st.taps[:, : k + 1])  # (B, k+1, h): fc(taps_{n+j})
        block = st.block[:, : k + 1]
        emb = self.policy.embed_tokens(block)  # (B, k+1, h): emb(x_{n+j+1}) for j <= a
        pos = st.n[:, None] + self.offsets  # (B, k+1)
        logits, out = draft_step(self.draft, hidden, emb, pos, st.d_cache, self.draft_rope)
        a = st.num_accepted
        st.d_logits0.copy_(gather_rows(logits, a))
        st.d_hidden0.copy_(gather_rows(out, a))
        # Rows still live advance by a+1; rows finished now or before stay frozen (static shapes).
        live = ~st.finished
        st.n.add_(torch.where(live, a + 1, 0))
        st.last_tok.copy_(torch.where(live, block.gather(1, a[:, None]).squeeze(1), st.last_tok))


def draft_prefill(policy: Policy, draft: Eagle3Draft, prompt_ids: torch.Tensor,
                  prompt_lens: torch.Tensor, taps_aux: torch.Tensor, first_tok: torch.Tensor,
                  group_size: int, cache: KVCache, rope: RopeTable):
    """Bring the draft to the round invariant right after the target prefill (static shapes, in
    place: part of the prefill step, which is graphed when the decode steps are).

    prompt_ids: (B0, S) right-padded, prompt_lens: (B0,), taps_aux: (B0, S, n_aux*h) from the
    target prefill, first_tok: (B0*G,) the token sampled from the prefill (x_n with n = L_b),
    cache: the per-sample draft cache (B0*G rows), overwritten at positions < L_b.
    Anchors 0..L_b-2 only need prompt tokens, so they run once per prompt (on the group leaders'
    rows) and are copied to the G samples; anchor L_b-1 (whose token input is the sampled x_{L_b})
    runs per sample. Returns (d_logits0 (B0*G, Vd), d_hidden0 (B0*G, h)).
    """
    B0, S = prompt_ids.shape
    if S > 1:  # anchor i = 0..S-2: fc(taps_i), emb(x_{i+1}); padded entries are overwritten later
        pos = torch.arange(S - 1, device=prompt_ids.device).expand(B0, S - 1)
        draft_step(draft, draft.project_taps(taps_aux[:, :-1]), policy.embed_tokens(prompt_ids[:, 1:]),
                   pos, group_leaders(cache, group_size), rope, prefill=True)
        fill_groups(cache, group_size, S - 1)
    last = (prompt_lens - 1).repeat_interleave(group_size)  # (N,) anchor L_b - 1
    last_tap = gather_rows(taps_aux, prompt_lens - 1).repeat_interleave(group_size, dim=0)  # (N, k*h)
    logits, out = draft_step(draft, draft.project_taps(last_tap[:, None]),
                             policy.embed_tokens(first_tok)[:, None], last[:, None], cache, rope)
    return logits[:, 0], out[:, 0]
