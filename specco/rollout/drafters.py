"""The drafter kinds as the rollout engine sees them: one object per kind, answering the engine's questions.

    kind = engine_kind(draft)                  EAGLE3 or BLOCK (None without a draft): the one place the engine
                                               looks at a draft's class
    kind.lookahead(draft, k)                   positions past n a round may write (the KV cache's slack)
    kind.draft_buffers(policy, draft, rows, cache_len, device)   the draft's per-row state: cache and carries
    kind.prefill(policy, draft, st, ids, lens, taps_aux, first, G, rope)   the draft to its round invariant
    kind.steps(policy, draft, st, params, k, max_new_tokens, stop_ids, rope, draft_rope)   one round's steps

The runner (generate.py), its levels (levels.py) and the shape bucketing (shapes.py) call these and nothing
kind-specific, so a third drafter kind is one more object here (with its model, its training side in
train/drafters.py, and its export), not a branch in every engine file. The training step asks the same
question of train/drafters.py's `drafter`.

EAGLE-3 (model/draft.py, speculative.py): a chain of k single-token draft passes per round, the draft's
pass-1 output at anchor n-1 carried between rounds (`d_logits0` / `d_hidden0`). A block drafter (DFlash,
DSpark: model/dflash.py, block_spec.py): one forward of a block of mask slots per round, nothing carried
but the trunk K/V; its block may reach past the verify's k + 1 tokens, which the lookahead covers.
"""
from __future__ import annotations

import torch

from ..model.dflash import BlockDraft
from ..model.layers import KVCache
from ..model.policy import Policy
from .block_spec import BlockSpeculativeSteps, block_prefill
from .forward import RopeTable
from .speculative import SpeculativeSteps, draft_prefill
from .state import DecodeState

__all__ = ["engine_kind", "EAGLE3", "BLOCK"]


class _Eagle3:
    """EAGLE-3: chained single-token passes; the catch-up's pass-1 output is carried to the next round."""
    name = "eagle3"
    steps = SpeculativeSteps

    def lookahead(self, draft, k: int) -> int:
        """Verify writes positions n..n+k."""
        return k

    def draft_buffers(self, policy: Policy, draft, rows: int, cache_len: int, device) -> dict:
        """The draft cache (pass-1 K/V per anchor) and the carried pass-1 output at anchor n-1."""
        dtype = draft.fc.weight.dtype
        return {"d_cache": draft.new_cache(rows, cache_len),
                "d_logits0": torch.zeros(rows, draft.cfg.draft_vocab_size, dtype=dtype, device=device),
                "d_hidden0": torch.zeros(rows, draft.cfg.hidden_size, dtype=dtype, device=device)}

    def prefill(self, policy: Policy, draft, st: DecodeState, ids: torch.Tensor, lens: torch.Tensor,
                taps_aux: torch.Tensor, first: torch.Tensor, group_size: int, rope: RopeTable) -> None:
        """Pass 1 over the prompt's anchors and the first sampled token (speculative.draft_prefill)."""
        d_logits0, d_hidden0 = draft_prefill(policy, draft, ids, lens, taps_aux, first, group_size, st.d_cache, rope)
        st.d_logits0.copy_(d_logits0)
        st.d_hidden0.copy_(d_hidden0)


class _Block:
    """A block drafter (DFlash / DSpark): one block forward per round over the trunk K/V of the target's taps."""
    name = "block"
    steps = BlockSpeculativeSteps

    def lookahead(self, draft, k: int) -> int:
        """The verify's n+k, or the block's last slot n+W-1 if that is further (its propose writes the block)."""
        return max(k, draft.cfg.block_size - 1)

    def draft_buffers(self, policy: Policy, draft, rows: int, cache_len: int, device) -> dict:
        """The trunk K/V of every draft layer; no carried pass-1 output."""
        c = draft.cfg
        return {"d_cache": KVCache.empty(c.num_layers, rows, c.num_kv_heads, cache_len, c.head_dim, device,
                                         draft.fc.weight.dtype)}

    def prefill(self, policy: Policy, draft, st: DecodeState, ids: torch.Tensor, lens: torch.Tensor,
                taps_aux: torch.Tensor, first: torch.Tensor, group_size: int, rope: RopeTable) -> None:
        """The prompts' trunk K/V from the prefill's taps (block_spec.block_prefill); the first token is the
        first round's anchor, read then."""
        block_prefill(draft, taps_aux, group_size, st.d_cache, rope)


EAGLE3, BLOCK = _Eagle3(), _Block()


def engine_kind(draft) -> _Eagle3 | _Block | None:
    """The engine-side kind of `draft` (a model of model/draft.py or model/dflash.py; None: plain decoding)."""
    if draft is None:
        return None
    return BLOCK if isinstance(draft, BlockDraft) else EAGLE3
