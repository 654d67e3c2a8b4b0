"""The training batch: a leaf module (torch only), so `train/`, `parallel/` and `runner/` can all use it
without importing each other.

Two layouts share one type:

* right-padded rows (B, S), one sequence per row (`cu_seqlens` None): the single-device default;
* packed THD rows (B, T) whose sequences sit back to back with borders `cu_seqlens` (every row the same
  borders; usually B = 1). Attention and the TTT shifts must then stay inside each sequence, so a packed
  batch needs a packing-aware attention core and shift (`parallel.cp` provides them for any cp, 1
  included); `train.cotrain.cotrain_step` refuses a packed batch without one.

Index conventions (the trap: two are in use). Per-token fields (`target_mask`, per-token
`advantages`, `draft_mask`) are indexed by the token j they describe. Log-prob fields (`logp_old`,
`logp_ref`) are indexed like the logits that produce them: entry i is the log-prob of token i+1
predicted at position i. That way a recompute needs only a *left* shift of the tokens, which the CP
shift provides across ranks; a token-indexed log-prob would need a right shift.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


def mask_spans(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """((B,) first, (B,) one past the last) nonzero column of each row of a (B, S) mask, on the host in one sync;
    a row with none: (S, 0)."""
    S = mask.shape[1]
    cols = torch.arange(1, S + 1, device=mask.device)
    on = mask != 0
    span = torch.stack([torch.where(on, cols - 1, S).amin(1), (on * cols).amax(1)]).cpu()  # (2, B)
    return span[0], span[1]


@dataclass
class TrainBatch:
    """One batch of sequences (prompt + completion).

    tokens (B, S); target_mask (B, S): 1 where token j is trained on (a completion token);
    advantages (B,) per sample, or (B, S) per token (indexed by token j: packed rows);
    logp_old (B, S): log-prob of token i+1 at position i under the policy that sampled the batch
    (None: on-policy, the step's own log-probs detached, ratio exactly 1 — one update per rollout);
    logp_ref (B, S): the same under the frozen reference policy (KL term), or None;
    positions (B, S): RoPE positions (None: 0..S-1; packed and CP batches pass per-sequence positions);
    draft_mask (B, S): the draft's target mask if it differs from target_mask (a packed batch marks
    there which sequences the draft trains on, see train.cotrain.draft_rows); None: target_mask;
    cu_seqlens: sequence borders of a packed row (None: one sequence per row);
    trained_from: a host-side bound, no row trains (target or draft mask) a token before this column (0: none
    known). Right-padded rows only; a subset of rows or of the masks keeps it valid. Set by the train step's
    micro-batches (train/cotrain.py), where the mask is read on the host anyway; EAGLE-3's TTT then skips the
    anchors before it (model/ttt.py): a long prompt's anchors predict nothing.
    """
    tokens: torch.Tensor
    target_mask: torch.Tensor
    advantages: torch.Tensor | None = None
    logp_old: torch.Tensor | None = None
    logp_ref: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    draft_mask: torch.Tensor | None = None
    cu_seqlens: tuple[int, ...] | None = None
    trained_from: int = 0

    @property
    def packed(self) -> bool:
        """Several sequences in one row (attention must not cross their borders)."""
        return self.cu_seqlens is not None and len(self.cu_seqlens) > 2

    def rows(self, a: int, b: int) -> "TrainBatch":
        """Rows a..b-1 of every per-row field."""
        take = lambda t: t[a:b] if torch.is_tensor(t) else t  # noqa: E731
        return TrainBatch(**{f.name: take(getattr(self, f.name)) for f in dataclasses.fields(self)})

    def take(self, idx: torch.Tensor) -> "TrainBatch":
        """Rows `idx` (a 1-D index tensor, any order) of every per-row field (padded rows only)."""
        if self.cu_seqlens is not None:
            raise ValueError("TrainBatch.take: a packed batch's rows share one set of sequence borders")
        idx = idx.to(self.tokens.device)  # once, not per field: from the host each copy is a device sync
        pick = lambda t: t.index_select(0, idx) if torch.is_tensor(t) else t  # noqa: E731
        return TrainBatch(**{f.name: pick(getattr(self, f.name)) for f in dataclasses.fields(self)})

    def trained_lengths(self) -> torch.Tensor:
        """(B,) on the host: one past each row's last trained token (target or draft mask), 0 for a row
        with none. One host sync."""
        return self.trained_spans()[1]

    def trained_spans(self) -> tuple[torch.Tensor, torch.Tensor]:
        """((B,) first, (B,) one past the last) column of each row's trained tokens (target or draft mask), on
        the host in one sync; a row with none: (S, 0)."""
        return mask_spans(self.target_mask if self.draft_mask is None else self.target_mask + self.draft_mask)

    def trimmed(self, width: int | None = None) -> "TrainBatch":
        """Right-padded rows without their trailing columns past the last trained token of any row
        (`width`: that column count when the caller already knows it, from `trained_lengths`).

        Exact: with causal attention no trained position sees a later column, and the TTT shifts and
        block anchors read only trained tokens (their masks are 0 there). A micro-batch of short rows
        then costs its own length, not the whole batch's longest row (long-tailed completions)."""
        if self.cu_seqlens is not None:
            return self
        s = max(1, int(self.trained_lengths().max()) if width is None else width)
        if s == self.tokens.shape[1]:
            return self
        cut = lambda t: t[:, :s] if torch.is_tensor(t) and t.dim() == 2 else t  # noqa: E731
        return TrainBatch(**{f.name: cut(getattr(self, f.name)) for f in dataclasses.fields(self)})

    def columns_from(self, c: int) -> "TrainBatch":
        """Right-padded rows from column c on (every (B, S) field cut [:, c:]): what a loss over logits of positions
        c.. reads (model/policy.py `logits_from`). Exact for the next-token losses when no token before c+1 is
        trained: shift_left within the cut equals the whole row's shift, cut."""
        if c == 0:
            return self
        if self.cu_seqlens is not None:
            raise ValueError("TrainBatch.columns_from: a packed row's sequences start anywhere; cut padded rows only")
        cut = lambda t: t[:, c:] if torch.is_tensor(t) and t.dim() == 2 else t  # noqa: E731
        fields = {f.name: cut(getattr(self, f.name)) for f in dataclasses.fields(self)}
        return TrainBatch(**{**fields, "trained_from": max(0, self.trained_from - c)})

    def to(self, device) -> "TrainBatch":
        move = lambda t: t.to(device) if torch.is_tensor(t) else t  # noqa: E731
        return TrainBatch(**{f.name: move(getattr(self, f.name)) for f in dataclasses.fields(self)})


def device_indices(groups: list[list[int]], device) -> list[torch.Tensor]:
    """Each list of row indices as a long tensor on `device`, from one host-to-device copy that does not wait.

    Why: `torch.tensor(list, device=cuda)` (or indexing a CUDA tensor with a CPU index) copies from pageable
    host memory and synchronizes the stream. Once per micro-batch that drained the GPU's queue 5 times per
    micro-batch, so the host could never run ahead: the draft's host-bound span (many small kernels) and the
    policy's short micro-batches could not overlap the long micro-batches' GPU work (H200 profile of a 64-row
    update: 21-23 stream syncs, 126 ms of idle GPU in 494 ms; bench/cotrain_ragged.py). Here the indices go
    through pinned memory with `non_blocking` (torch's pinned allocator keeps the buffer until the copy is
    done), and the groups are views of one device tensor."""
    flat = torch.tensor([i for g in groups for i in g], dtype=torch.long)
    dev = torch.device(device)
    if dev.type == "cuda":
        flat = flat.pin_memory()
    flat = flat.to(dev, non_blocking=True)
    return list(torch.split(flat, [len(g) for g in groups]))


def round_up(n: int, multiple: int) -> int:
    """`n` rounded up to a multiple of `multiple`: the trainer's widths (train.width_multiple: the minibatch, its
    micro-batch cuts and the shapes `train.warm_widths` warms all round the same way) and the engine's buckets."""
    return -(-n // multiple) * multiple


def longest_first(lengths: torch.Tensor, rows: int) -> list[list[int]]:
    """Row indices in chunks of `rows`, the longest rows first (stable: equal lengths keep their order), for
    micro-batches whose rows are alike in length (train.cotrain.micro_batches, train.sft)."""
    order = sorted(range(len(lengths)), key=lambda r: -int(lengths[r]))
    return [order[a:a + rows] for a in range(0, len(order), rows)]


def pack(batch: TrainBatch, lengths: list[int]) -> TrainBatch:
    """Right-padded rows with true lengths `lengths` -> one packed row (1, sum(lengths)) with cu_seqlens.

    Per-sample advantages (B,) become per-token (1, T) (constant within each sequence); log-prob fields
    keep their convention (position i of a sequence -> position cu[b] + i of the pack); positions restart
    at 0 in every sequence. Fields that are None stay None.
    """
    B = batch.tokens.shape[0]
    if len(lengths) != B:
        raise ValueError(f"pack: {len(lengths)} lengths for {B} rows")
    cu = [0]
    for L in lengths:
        cu.append(cu[-1] + int(L))

    def cat(x):
        return None if x is None else torch.cat([x[b, :L] for b, L in enumerate(lengths)])[None]  # (1, T)

    adv = batch.advantages
    if adv is not None and adv.dim() == 1:
        adv = adv[:, None].expand(B, batch.tokens.shape[1])  # (B, S): one value per sample
    positions = torch.cat([torch.arange(L, device=batch.tokens.device) for L in lengths])[None]  # (1, T)
    return TrainBatch(tokens=cat(batch.tokens), target_mask=cat(batch.target_mask), advantages=cat(adv),
                      logp_old=cat(batch.logp_old), logp_ref=cat(batch.logp_ref), positions=positions,
                      draft_mask=cat(batch.draft_mask), cu_seqlens=tuple(cu))
