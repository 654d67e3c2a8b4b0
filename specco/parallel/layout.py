"""How a batch's tokens are laid out on this rank, as the co-training step sees it: one object per layout.

    layout = PaddedRows()                        # single-device rows, right-padded (the default)
    layout = ZigzagPack(cp_group, zig)           # this CP rank's zigzag shard of a packed row (zig: ZigzagLayout)
    cotrain_step(policy, draft, batch, ..., layout=layout)

Every layout answers the same four questions, so the step, the drafter kinds (train/drafters.py), the
frozen-draft evaluation and the log-prob recompute never branch on which one they hold:

    .shift(x, d)      y[i] = x[i+d] within each sequence, 0 past its end (next-token targets, TTT shifts)
    .attn             the EAGLE-3 TTT trunk + branch attention (`ttt_forward(attn=...)`)
    .attn_core        the policy's attention core (`Policy.forward(attn_core=...)`; None: causal SDPA per row)
    .block            a block drafter's per-sequence plan (parallel.block_cp.BlockCP; None: one sequence per row)
    .packed           whether a row holds several sequences (then `.attn_core` must keep to each one)
    .skips_prompt     whether the step may skip the columns before a micro-batch's first trained column (the
                      policy's logits, EAGLE-3's anchors: train/drafters.first_anchor); needs `.attn` to take q_start=
    .shares_prompts   whether the policy's forward runs each prompt group's shared prompt once (SharedPrompts:
                      parallel/shared_prompts.py packs each micro-batch; the draft keeps the padded rows)

`ZigzagPack` with cp = 1 (group None) is how one device trains a *packed* row: attention, shifts and block
anchors then stay inside each sequence of the pack, which the padded-row versions would not.
"""
from __future__ import annotations

import functools
from typing import Callable

from ..model.ttt import shift_left
from ..ops.attention import ttt_attention
from .block_cp import BlockCP
from .cp import cp_attn, cp_core, cp_shift
from .zigzag import ZigzagLayout

__all__ = ["PaddedRows", "SharedPrompts", "ZigzagPack", "PADDED", "SHARED_PROMPTS"]


class PaddedRows:
    """Right-padded rows on one device (each row one sequence from position 0): `shift_left`, the plain TTT
    attention, causal SDPA in the policy, the block drafters' own single-process plan.

    `attn`: another TTT attention with the same meaning (a kernel choice, e.g. `functools.partial(ttt_attention,
    impl="flash")` in bench/cotrain_ragged.py, or a mutation in a test). Only ttt_attention (or a partial of it)
    takes the queries from an anchor on (`q_start`), so with another the step skips no prompt column."""
    packed = False
    shares_prompts = False

    def __init__(self, attn: Callable = ttt_attention):
        self.shift: Callable = shift_left
        self.attn: Callable = attn
        self.skips_prompt = (attn is ttt_attention
                             or isinstance(attn, functools.partial) and attn.func is ttt_attention)
        self.attn_core: Callable | None = None
        self.block = None

    def __repr__(self) -> str:
        return "PaddedRows()" if self.attn is ttt_attention else f"PaddedRows(attn={self.attn!r})"


class ZigzagPack:
    """This rank's zigzag shard of packed rows (`zig`: the batch's ZigzagLayout) over `group` (the CP group;
    None when zig.cp == 1): the CP shift (cp_shift), ring TTT attention, ring causal attention for the policy and
    the block drafters' ring plan (BlockCP). Built per packed batch: the borders are the batch's."""
    packed = True
    shares_prompts = False
    skips_prompt = False  # a row's sequences start anywhere, and the ring attention takes every query

    def __init__(self, group, zig: ZigzagLayout):
        self.group, self.zig = group, zig
        self.shift: Callable = functools.partial(cp_shift, group=group, layout=zig)
        self.attn: Callable = cp_attn(group, zig)
        self.attn_core: Callable | None = cp_core(group, zig)
        self.block = BlockCP(group, zig)

    def __repr__(self) -> str:
        return f"ZigzagPack(cp={self.zig.cp}, rank={self.zig.rank}, sequences={len(self.zig.cu_seqlens) - 1})"


class SharedPrompts(PaddedRows):
    """Padded rows whose prompt groups the policy's forward runs packed, each shared prompt once
    (`train.share_prompts`; parallel/shared_prompts.py): the train step and the log-prob recompute cut each
    minibatch into micro-batches of whole groups (shared_micro_batches) and run the policy on their packed rows
    with their own attention core; the draft trains on the padded rows, with these (PaddedRows') shift and TTT
    attention, from taps and logits unpacked to them."""
    shares_prompts = True

    def __repr__(self) -> str:
        return "SharedPrompts()"


PADDED = PaddedRows()  # the default layout: shared, it holds no state
SHARED_PROMPTS = SharedPrompts()
