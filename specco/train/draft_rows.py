"""What the draft's loss reads of one policy forward, cut to the draft's rows, and several micro-batches'
worth merged into one draft call.

Why merge: in the co-training step the draft trains on every `draft_row_stride`-th row, a few rows per
micro-batch, and its forward and backward there are launch-bound (on the H200 the long workload's draft
span stayed ~0.4 s a step when the stride went from 4 to 8 and its rows halved). The draft's graph is
disjoint from the policy's (taps, embeddings and teacher logits are detached), so its loss over the rows of
all micro-batches can run once after the policy's micro-batches: one call instead of one per micro-batch.

Rows of different widths are right-padded to the longest: the padding's target mask is 0, so it adds no
loss, gradient, count or statistic; no valid position attends to it (causal attention, and the TTT branch
is per anchor), and a block drafter's anchors depend only on the trained tokens (block_losses.sample_anchors).
The merged loss is the sum of the per-micro-batch losses up to rounding (tests/test_draft_merge.py).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

__all__ = ["DraftRows", "merge_rows"]


@dataclass
class DraftRows:
    """The draft's rows of one (micro-)batch: b rows of width S, every tensor indexed by token position."""
    aux: torch.Tensor  # (b, S, k*h) the policy's detached aux taps
    embed: torch.Tensor  # (b, S, h) its detached input embeddings
    logits: torch.Tensor  # (b, S, V) its logits: the teacher (read detached)
    tokens: torch.Tensor  # (b, S)
    mask: torch.Tensor  # (b, S) the draft's target mask (1 where token j is a trained target)
    positions: torch.Tensor  # (b, S) absolute RoPE positions

    @classmethod
    def of(cls, out, tokens: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor | None, rows) -> "DraftRows":
        """The rows `rows` (slice or index tensor) of a policy output with taps and its batch's fields
        (`positions` None: 0..S-1 in every row). Views where `rows` is a slice."""
        B, S = tokens.shape
        if positions is None:
            positions = torch.arange(S, device=tokens.device).expand(B, S)
        return cls(out.taps.aux[rows], out.taps.embed[rows], out.logits[rows], tokens[rows], mask[rows],
                   positions[rows])

    def detached_copy(self) -> "DraftRows":
        """Its own detached storage, so the policy forward it came from (and that forward's graph) can go."""
        return DraftRows(*(getattr(self, f.name).detach().clone() for f in fields(self)))

    def nbytes(self) -> int:
        return sum(getattr(self, f.name).nbytes for f in fields(self))


def merge_rows(parts: list[DraftRows]) -> DraftRows:
    """The rows of `parts` in one DraftRows, each right-padded to the longest width: zeros everywhere (target
    mask 0), positions counting on past each row's end."""
    if len(parts) == 1:
        return parts[0]
    S = max(p.tokens.shape[1] for p in parts)

    def pad(x: torch.Tensor, pad_to: int) -> torch.Tensor:  # (b, s, ...) -> (b, pad_to, ...)
        extra = pad_to - x.shape[1]
        return x if extra == 0 else F.pad(x, (0, 0) * (x.dim() - 2) + (0, extra))

    def positions(p: DraftRows) -> torch.Tensor:
        s = p.positions.shape[1]
        if s == S:
            return p.positions
        tail = p.positions[:, -1:] + torch.arange(1, S - s + 1, device=p.positions.device)  # (b, S - s)
        return torch.cat([p.positions, tail.to(p.positions.dtype)], dim=1)

    return DraftRows(*(torch.cat([pad(getattr(p, f.name), S) for p in parts]) for f in fields(DraftRows)
                       if f.name != "positions"), positions=torch.cat([positions(p) for p in parts]))
