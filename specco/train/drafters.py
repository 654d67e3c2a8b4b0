"""The drafter kinds as the training step sees them: one object per kind, answering the step's two questions.

    kind = drafter(draft)                               EAGLE3 or BLOCK: the one place a draft's class is looked at
    kind.check_layout(batch, layout)                    refuses a layout the kind cannot train on
    n, weights = kind.counts(draft, batch, cfg, layout)             the loss's per-pass / per-slot target counts
    loss, stats = kind.loss(draft, policy, out, mb, cfg, denominator, rows, layout=layout)

The co-training step (train/cotrain.py), the frozen draft's and the shadow's evaluations (runner/measure.py) and
the step's counts call these and nothing kind-specific, so a third drafter kind is one more object here (and its
model and engine steps), not a branch in every caller.

EAGLE-3 (model/draft.py, model/ttt.py, train/losses.py): K test-time-training passes of the draft layer over the
policy's taps; its counts are the targets of each pass (pass d predicts d tokens ahead: fewer of them), weighted
by `pass_weights`. A block drafter (DFlash, DSpark: model/dflash.py, train/block_losses.py): a block of γ mask
slots after each sampled anchor; its counts are the valid predictions per slot, weighted by `slot_weights`, and
its logits go through the policy's live (detached) head. `layout` is the batch's (parallel/layout.py:
PaddedRows or ZigzagPack): under context parallelism or on packed rows a block drafter uses its per-sequence plan
(`layout.block`: parallel.block_cp.BlockCP); EAGLE-3 uses its `shift` and TTT `attn`.

Both losses use the same rows (`draft_rows`: every cfg.draft_row_stride-th row) and the same detached teacher (the
policy's logits of the forward that made the taps), and are divided by the step's GLOBAL denominator
(`losses.draft_denominator` of the counts summed over every rank), so micro-batches and ranks add up.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
from torch.distributed.tensor import DTensor

from ..batch import TrainBatch
from ..model.dflash import BlockDraft, slot_weights
from ..model.ttt import shift_left, ttt_forward
from ..parallel.layout import PADDED
from ..parallel.tp import vocab_rows
from .block_losses import block_draft_loss, block_slot_counts, local_plan
from .losses import DraftStats, draft_loss_parts, normalize_draft_loss, pass_target_masks, pass_weights
from .step_config import StepConfig

__all__ = ["drafter", "EAGLE3", "BLOCK", "draft_rows", "draft_mask", "first_anchor"]


def draft_rows(batch: TrainBatch, cfg: StepConfig) -> slice:
    """The rows the draft trains on: 0, n, 2n, ... with n = cfg.draft_row_stride (a micro-batch gets its
    share of them from cotrain.micro_batches).

    GRPO rows are G i.i.d. samples per prompt, so a stride keeps an unbiased sample of the policy's
    outputs while the draft's share of the step shrinks ~n-fold. A packed row keeps every sequence here:
    the packer marks the draft's sequences in `batch.draft_mask` instead (same loss, same counts)."""
    return slice(0, None, cfg.draft_row_stride)


def draft_mask(batch: TrainBatch) -> torch.Tensor:
    """The tokens the draft learns to predict: the trained tokens, or the packer's draft sequences."""
    return batch.target_mask if batch.draft_mask is None else batch.draft_mask


def _positions(batch: TrainBatch) -> torch.Tensor:
    B, S = batch.tokens.shape
    return batch.positions if batch.positions is not None else \
        torch.arange(S, device=batch.tokens.device).expand(B, S)


def first_anchor(batch: TrainBatch, passes: int, layout) -> int:
    """The first anchor EAGLE-3's TTT passes must run at (ttt_forward's q_start): pass d at anchor i predicts
    token i+d+1 and passes 2..K build on pass 1 at the same anchor, so no anchor before the first trained
    column minus K+1 trains anything. Right-padded rows with a known bound only (TrainBatch.trained_from), on a
    layout that skips prompts (parallel/layout.py); packed and CP layouts: 0 (their shift and ring attention take
    the whole row). Also where the step's logits start (Policy.forward's logits_from): the GRPO loss and the block
    drafters' teachers read nothing before it."""
    if not layout.skips_prompt or batch.cu_seqlens is not None:
        return 0
    return max(0, min(batch.trained_from - passes - 1, batch.tokens.shape[1] - 1))


class _Eagle3:
    """EAGLE-3: K TTT passes of the draft layer, soft CE against the detached policy logits per pass."""
    name = "eagle3"

    def check_layout(self, batch: TrainBatch, layout) -> None:
        """Nothing to check: the layout's `shift` and `attn` carry EAGLE-3 across CP ranks and packed rows."""

    def counts(self, draft, batch: TrainBatch, cfg: StepConfig, layout=PADDED) -> tuple[torch.Tensor, torch.Tensor]:
        """((K,) targets of each pass on this rank's draft rows, (K,) pass weights)."""
        rows = draft_rows(batch, cfg)
        n = torch.stack([m.sum() for m in pass_target_masks(draft_mask(batch)[rows], cfg.ttt_passes, layout.shift)])
        return n, pass_weights(cfg.ttt_passes, cfg.pass_decay)

    def loss(self, draft, policy, out, batch: TrainBatch, cfg: StepConfig, denominator: torch.Tensor | None = None,
             rows=None, layout=PADDED):
        """L_draft of one (micro-)batch from a policy output with taps, and its summed statistics (DraftStats).
        `denominator`: the step's global one (None: this batch's own counts). Only the rows `rows` are used (a
        slice or index tensor; None: `draft_rows`): the policy forward that made `out` ran on all rows anyway."""
        rows = draft_rows(batch, cfg) if rows is None else rows
        aux, embed, logits = out.taps.aux[rows], out.taps.embed[rows], vocab_rows(out.logits, rows)
        q0 = first_anchor(batch, cfg.ttt_passes, layout)
        cut = out.logits_from  # the policy's logits start at that column (PolicyOutput.logits_from)
        if cut > q0:
            raise ValueError(f"the policy's logits start at column {cut}, after the draft's first anchor {q0}: the "
                             "teacher at the earlier anchors is missing (Policy.forward(logits_from) <= first_anchor)")
        outs = ttt_forward(draft, aux, embed, _positions(batch)[rows], cfg.ttt_passes, shift=layout.shift,
                           attn=layout.attn, q_start=q0)
        # the loss over anchors q0.. only: shift_left within the cut equals the whole row's shift, cut
        parts = draft_loss_parts(draft, outs, logits[:, q0 - cut:], draft_mask(batch)[rows][:, q0:], cfg.loss_chunk,
                                 layout.shift)
        loss = normalize_draft_loss(parts, pass_weights(cfg.ttt_passes, cfg.pass_decay), denominator)
        return loss, DraftStats.of(parts)


class _Block:
    """A block drafter (DFlash / DSpark): γ mask slots after sampled anchors, logits through the policy's head."""
    name = "block"

    def check_layout(self, batch: TrainBatch, layout) -> None:
        """Under CP (a shift other than shift_left) or on packed rows the anchors and the trunk's ring are per
        sequence: the layout's plan (`layout.block`) is required."""
        if layout.block is None and (layout.shift is not shift_left or batch.packed):
            raise ValueError(f"a block drafter under context parallelism or on packed rows needs a layout with a "
                             f"block plan (parallel.layout.ZigzagPack), not {layout!r}: its anchors and trunk ring "
                             "are per sequence")

    @staticmethod
    def _plan(block) -> Callable:
        """The plan function of block_losses: `local_plan`, or BlockCP's, which builds on it per sequence."""
        return local_plan if block is None else functools.partial(block.plan, local=local_plan)

    def counts(self, draft, batch: TrainBatch, cfg: StepConfig, layout=PADDED) -> tuple[torch.Tensor, torch.Tensor]:
        """((γ,) valid predictions per slot on this rank's draft rows, (γ,) slot weights). The anchors depend only
        on each row's content, so micro-batches agree; under CP each block is counted on the rank holding its
        anchor (`layout.block.plan`)."""
        rows = draft_rows(batch, cfg)
        n = block_slot_counts(draft, batch.tokens[rows], draft_mask(batch)[rows], self._plan(layout.block))
        return n, slot_weights(draft.cfg)

    def loss(self, draft, policy, out, batch: TrainBatch, cfg: StepConfig, denominator: torch.Tensor | None = None,
             rows=None, layout=PADDED):
        """As EAGLE-3's (the same rows, taps and detached teacher; BlockStats); the logits use the policy's live
        head and the mask slots its embed_tokens[mask_id], both detached. Of the layout only `block` is read."""
        rows = draft_rows(batch, cfg) if rows is None else rows
        mask_emb = policy.embed_tokens.weight[draft.cfg.mask_id].detach()
        return block_draft_loss(draft, out.taps.aux[rows], out.taps.embed[rows], vocab_rows(out.logits, rows),
                                batch.tokens[rows], draft_mask(batch)[rows], _positions(batch)[rows],
                                _whole(policy.lm_head.weight), mask_emb, denominator,
                                chunk=max(1, cfg.loss_chunk // draft.cfg.gamma), plan=self._plan(layout.block),
                                logits_from=out.logits_from)


def _whole(weight: torch.Tensor) -> torch.Tensor:
    """The policy's head weight whole and detached: gathered from its vocabulary shards under tensor parallelism
    (parallel/tp.py, an all-gather over tp), as it is otherwise (a plain tensor; under FSDP its unsharded one)."""
    return weight.detach().full_tensor() if isinstance(weight, DTensor) else weight


EAGLE3, BLOCK = _Eagle3(), _Block()


def drafter(draft) -> _Eagle3 | _Block:
    """The training-side kind of `draft` (a model of model/draft.py or model/dflash.py): the one dispatch."""
    return BLOCK if isinstance(draft, BlockDraft) else EAGLE3
