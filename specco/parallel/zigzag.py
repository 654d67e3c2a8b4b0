"""The zigzag context-parallel layout — the one definition used by data, model and tests (docs/DESIGN.md §4).

Packed sequences (THD): a flat token stream whose sequence borders are `cu_seqlens` (cumulative
lengths, `cu_seqlens[0] == 0`). Each sequence of length L is padded to 2·cp·c tokens with
c = ceil(L / (2·cp)) and cut into 2·cp chunks of c tokens; rank r holds chunks r and 2·cp−1−r:

    L = 10, cp = 2 -> c = 3, padded to 12:   chunks  [0 1 2][3 4 5][6 7 8][9 P P]
                                             rank 0: chunk 0 + chunk 3 -> positions 0 1 2 9 P P
                                             rank 1: chunk 1 + chunk 2 -> positions 3 4 5 6 7 8

Why zigzag: under causal attention chunk j costs ~j, so pairing chunk r with chunk 2·cp−1−r gives
every rank the same work. Every sequence of a pack is zigzagged on its own, so a rank's local
stream is, per sequence, [front chunk (c tokens); back chunk (c tokens)], sequences back to back:
local cu_seqlens are cumsum(2·c_i) and are the same on every rank (they depend only on the
global lengths), which is what lets K/V shards travel a ring and be sliced the same way everywhere.

Padding (P above) always sits at the *end* of a sequence (global positions >= L). Under causal
attention a pad key is therefore seen only by pad queries, so real tokens never need a mask in
attention; losses mask pads through the (sharded, zero-filled) target masks and the CP shift,
which returns zero past a sequence's true end. Sequences shorter than 2·cp tokens just have more
padding (c = 1); a zero-length sequence has c = 0 and contributes nothing. No assumption on cp
being a power of two.

Within one local sequence slice the local order is sorted by global position (chunk r comes
before chunk 2·cp−1−r), so "causal over the local tokens" is exactly the true causal mask among
them — ring attention's step 0 relies on that.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = ["ZigzagLayout", "shard", "unshard", "positions", "local_cu_seqlens", "valid_mask",
           "chunk_sizes", "local_index"]


def _cu(cu_seqlens) -> tuple[int, ...]:
    """Normalise cu_seqlens (list / tuple / tensor) to a tuple of ints and validate it (a boundary)."""
    cu = tuple(int(x) for x in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens))
    if len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing with >= 1 sequence, got {cu}")
    return cu


def chunk_sizes(cu_seqlens, cp: int) -> tuple[int, ...]:
    """c_i = ceil(L_i / (2·cp)): tokens per chunk of each sequence (a sequence pads to 2·cp·c_i)."""
    cu = _cu(cu_seqlens)
    if cp < 1:
        raise ValueError(f"cp must be >= 1, got {cp}")
    return tuple(-(-(b - a) // (2 * cp)) for a, b in zip(cu, cu[1:]))


def local_cu_seqlens(cu_seqlens, cp: int) -> tuple[int, ...]:
    """Local cu_seqlens (identical on every rank): sequence i spans 2·c_i local tokens."""
    out = [0]
    for c in chunk_sizes(cu_seqlens, cp):
        out.append(out[-1] + 2 * c)
    return tuple(out)


@functools.lru_cache(maxsize=256)
def _plan(cu: tuple[int, ...], cp: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(global flat index or -1 for pad, global position within the sequence), both (T_local,) int64."""
    if not 0 <= rank < cp:
        raise ValueError(f"rank {rank} is outside the CP group of size {cp}")
    idx, pos = [], []
    for (start, end), c in zip(zip(cu, cu[1:]), chunk_sizes(cu, cp)):
        L = end - start
        for chunk in (rank, 2 * cp - 1 - rank):  # front chunk, then back chunk
            p = torch.arange(chunk * c, (chunk + 1) * c)  # (c,) positions of this chunk
            pos.append(p)
            idx.append(torch.where(p < L, start + p, torch.full_like(p, -1)))
    empty = torch.zeros(0, dtype=torch.long)
    return (torch.cat(idx) if idx else empty), (torch.cat(pos) if pos else empty)


def local_index(cu_seqlens, cp: int, rank: int) -> torch.Tensor:
    """(T_local,) int64: global flat index (into the packed stream) of each local token, -1 for padding."""
    return _plan(_cu(cu_seqlens), cp, rank)[0]


def positions(cu_seqlens, cp: int, rank: int, device=None) -> torch.Tensor:
    """(T_local,) int64 global position of each local token *within its own sequence* (for RoPE).

    Pad tokens continue their sequence's numbering (positions >= L), which keeps RoPE defined;
    nothing real ever attends to them (see module docstring).
    """
    return _plan(_cu(cu_seqlens), cp, rank)[1].to(device)


def valid_mask(cu_seqlens, cp: int, rank: int, device=None) -> torch.Tensor:
    """(T_local,) bool: True for real tokens, False for padding."""
    return (_plan(_cu(cu_seqlens), cp, rank)[0] >= 0).to(device)


def shard(x: torch.Tensor, cu_seqlens, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s zigzag shard of the packed tensor x along `dim` (size cu_seqlens[-1] there).

    Returns a tensor with T_local = local_cu_seqlens[-1] entries along `dim`; padding is zero
    (False / 0 for bool / integer tensors). Differentiable (index_select), works for any dtype.
    """
    cu = _cu(cu_seqlens)
    dim = dim % x.dim()
    if x.shape[dim] != cu[-1]:
        raise ValueError(f"x has {x.shape[dim]} tokens along dim {dim} but cu_seqlens ends at {cu[-1]}")
    idx = _plan(cu, cp, rank)[0].to(x.device)
    out = x.index_select(dim, idx.clamp_min(0))  # pads temporarily read token 0 ...
    pad = (idx < 0).nonzero().flatten()
    return out.index_fill(dim, pad, 0) if pad.numel() else out  # ... and are zeroed here


def unshard(parts: list[torch.Tensor] | tuple[torch.Tensor, ...], cu_seqlens, dim: int = 1) -> torch.Tensor:
    """Inverse of `shard`: the cp = len(parts) rank shards -> the packed tensor (padding dropped)."""
    cu = _cu(cu_seqlens)
    cp = len(parts)
    dim = dim % parts[0].dim()
    # Position of each global token inside cat(parts): invert the concatenated local indices.
    cat_idx = torch.cat([_plan(cu, cp, r)[0] for r in range(cp)])  # (cp·T_local,)
    where = (cat_idx >= 0).nonzero().flatten()  # (T_global,) positions in cat(parts) of real tokens
    inv = torch.empty(cu[-1], dtype=torch.long)
    inv[cat_idx[where]] = where
    return torch.cat(list(parts), dim=dim).index_select(dim, inv.to(parts[0].device))


@dataclass(frozen=True)
class ZigzagLayout:
    """Everything a CP rank needs to know about the current packed batch's sequence dimension.

    One object per (batch, rank); tensors of shape (B, T_local, ...) or (B, H, T_local, D) share it
    along their token dimension (every row of B has the same borders — B = 1 for a THD pack, or
    B equal-length right-padded rows with cu_seqlens = [0, S]).
    """
    cu_seqlens: tuple[int, ...]  # global, unpadded
    cp: int
    rank: int

    def __post_init__(self):
        object.__setattr__(self, "cu_seqlens", _cu(self.cu_seqlens))
        _plan(self.cu_seqlens, self.cp, self.rank)  # validates rank / cp

    @property
    def chunks(self) -> tuple[int, ...]:
        """c_i per sequence."""
        return chunk_sizes(self.cu_seqlens, self.cp)

    @property
    def seqlens(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.cu_seqlens, self.cu_seqlens[1:]))

    @property
    def local_cu_seqlens(self) -> tuple[int, ...]:
        return local_cu_seqlens(self.cu_seqlens, self.cp)

    @property
    def num_local(self) -> int:
        return self.local_cu_seqlens[-1]

    def seq_slices(self) -> list[tuple[int, int]]:
        """(local start, c) of every non-empty sequence: front rows [s, s+c), back rows [s+c, s+2c)."""
        return [(s, c) for s, c in zip(self.local_cu_seqlens, self.chunks) if c > 0]

    def positions(self, device=None) -> torch.Tensor:
        return positions(self.cu_seqlens, self.cp, self.rank, device)

    def valid(self, device=None) -> torch.Tensor:
        return valid_mask(self.cu_seqlens, self.cp, self.rank, device)

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        return shard(x, self.cu_seqlens, self.cp, self.rank, dim)

    def unshard(self, parts, dim: int = 1) -> torch.Tensor:
        if len(parts) != self.cp:
            raise ValueError(f"unshard needs {self.cp} parts, got {len(parts)}")
        return unshard(parts, self.cu_seqlens, dim)

    def for_rank(self, rank: int) -> "ZigzagLayout":
        return ZigzagLayout(self.cu_seqlens, self.cp, rank)
