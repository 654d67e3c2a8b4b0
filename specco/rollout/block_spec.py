"""Block speculation with a DFlash / DSpark drafter (model/dflash.py, docs/DESIGN.md §2b): one draft forward
proposes a whole block of k tokens; verification is EAGLE-3's, unchanged.

Invariant between rounds, for every live row (x_n = last_tok, state.py):
    target cache: K/V valid at positions < n.
    draft cache:  per draft layer, the trunk K/V (from the target taps) valid at positions < n.

One round:
  propose   one forward of the block [emb(x_n), mask, ..., mask] at positions n..n+W-1
            (forward.block_propose_hidden). Predicting slot j gives q_j over the target vocabulary
            through the policy's head (DFlash: slots 1..γ, DSpark: slots 0..γ-1 plus the Markov bias
            w2(w1(prev)) of the previous token — x_n for the first slot, then the previous proposal —
            so DSpark's slots are sampled in order). x̂_{j+1} ~ q_j, j < k (k <= γ: the leading slots).
  verify    SpeculativeSteps.verify: one target forward over [x_n, x̂_1..x̂_k] with taps and the
            lossless acceptance rule with each slot's distribution as q.
  catch up  the verify's taps at positions n..n+k become trunk K/V (static width k+1; entries past
            n+a sit at positions >= the next round's n, rewritten before any query reads them — the
            same argument as EAGLE-3's catch-up), then n += a+1. The block's own K/V that the propose
            step wrote at n..n+W-1 (W <= k+1) are among those overwritten.
DSpark's confidence head could end a block early; the engine does not use it (the controller picks k).
"""
from __future__ import annotations

import torch

from ..model.dflash import BlockDraft
from ..model.layers import KVCache
from ..model.policy import Policy
from .forward import RopeTable, block_propose_hidden, block_trunk_write
from .sampling import keyed_draw, processed_probs, sample_from_probs
from .speculative import SpeculativeSteps
from .state import fill_groups, group_leaders
from .tp import gather_vocab, tp_group_of


class BlockSpeculativeSteps(SpeculativeSteps):
    """propose / verify / catch_up for a block drafter; verify (and the uniform layout) is inherited."""

    def __init__(self, policy: Policy, draft: BlockDraft, *args, **kw):
        super().__init__(policy, draft, *args, **kw)
        if self.k > draft.cfg.gamma:
            raise ValueError(f"k={self.k} draft tokens per round but the {draft.kind} drafter's blocks "
                             f"predict gamma={draft.cfg.gamma}: set rollout.k <= {draft.cfg.gamma}")

    def _slot_tokens(self, logits: torch.Tensor, j0: int) -> torch.Tensor:
        """Proposals x̂_{j0+1..j0+n} (B, n) from the logits (B, n, V) of slots j0..j0+n-1 over the target
        vocabulary, slot j with its own uniform u[:, j]; stores their q for verify. DFlash's independent
        slots go through in one call (one softmax and one sampling for all: a round's kernel count, which
        sets its cost once the batch is small, does not grow with k); DSpark's one at a time."""
        if self.params.greedy:
            return logits.argmax(-1)
        n = logits.shape[1]
        if self.params.keyed:  # slot j predicts the token at position n+1+j
            pos = self.st.n[:, None] + 1 + j0 + self.offsets[None, :n]  # (B, n)
            return keyed_draw(logits, self.params, self.st.key, pos)
        q = processed_probs(logits, self.params)  # (B, n, V)
        self.st.q_draft[:, j0:j0 + n].copy_(q)
        return sample_from_probs(q, self.st.u[:, j0:j0 + n])

    def propose(self):
        st, draft, policy = self.st, self.draft, self.policy
        emb = policy.embed_tokens.weight
        # the logits through the policy's LM head, as in training (block_losses): with an untied head the
        # embedding matrix would score each slot against the *input* embeddings (found on the H200: warm
        # drafts with a simulated tau of 4.8 were accepted 2% of the time)
        head = policy.lm_head.weight
        hidden = block_propose_hidden(draft, policy.embed_tokens(st.last_tok), emb[draft.cfg.mask_id],
                                      st.n, st.d_cache, self.draft_rope)  # (B, W, h)
        slots = draft.predicting(hidden[:, None])[:, 0, : self.k]  # (B, k, h): slot j predicts x_{n+1+j}
        if draft.kind == "dflash":  # independent slots: one head GEMM and one sampling for all of them
            # under engine tp the head is this rank's V/tp rows: the slots' logits gathered along the vocabulary
            logits = gather_vocab(draft.logits(slots, head), tp_group_of(policy))  # (B, k, V)
            st.draft_tok[:, : self.k].copy_(self._slot_tokens(logits, 0))
            return
        prev = st.last_tok
        for j in range(self.k):  # DSpark: the Markov bias of slot j needs the proposal before it
            tok = self._slot_tokens(draft.logits(slots[:, j], head, prev)[:, None], j)[:, 0]
            st.draft_tok[:, j].copy_(tok)
            prev = tok

    def catch_up(self):
        st, k = self.st, self.k
        pos = st.n[:, None] + self.offsets  # (B, k+1)
        block_trunk_write(self.draft, st.taps[:, : k + 1], pos, st.d_cache, self.draft_rope)
        a = st.num_accepted
        live = ~st.finished
        st.n.add_(torch.where(live, a + 1, 0))
        block = st.block[:, : k + 1]
        st.last_tok.copy_(torch.where(live, block.gather(1, a[:, None]).squeeze(1), st.last_tok))


def block_prefill(draft: BlockDraft, taps_aux: torch.Tensor, group_size: int, cache: KVCache,
                  rope: RopeTable) -> None:
    """The trunk K/V of the prompts (B0, S) from the target prefill's taps, written once per prompt on
    the group leaders' rows and copied to the G samples (positions < S; padded entries are rewritten
    by catch-ups before they are read, as in speculative.draft_prefill)."""
    B0, S, _ = taps_aux.shape
    pos = torch.arange(S, device=taps_aux.device).expand(B0, S)
    block_trunk_write(draft, taps_aux, pos, group_leaders(cache, group_size), rope)
    fill_groups(cache, group_size, S)
