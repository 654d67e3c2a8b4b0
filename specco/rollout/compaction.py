"""Live-row compaction: once most rows of a generation have finished, go on with a smaller batch.

Why. RL rollouts have a long length tail, and a static-shape decoder computes every row of the batch
until the last one finishes: in the H200 RL run of configs/gpu.toml the plain arm ran 40 decode rounds
at 1,024 rows while the mean completion was 8.5 tokens (bench/results/gpu_rl_deep_1024). When the
live rows fall to `compact_below` of the batch, the runner gathers them (with their KV caches and
every per-row decode buffer) into a state of `compact_size` rows — a power of two, with captured
graphs of its own kept for later calls — and decodes on there; `scatter_outputs` writes the results
back when the generation ends. It can happen again from the smaller state.

Exactness. Every step treats rows independently (per-row positions, caches and attention), so moving
a row to another batch changes nothing but floating-point batch-size effects of the kernels. The
uniforms of each round are still drawn for all the original rows and then gathered (generate.py), so
a sampled generation consumes the same random stream as without compaction and, up to those rounding
effects, emits the same tokens.

Where the levels live. `LevelStack` holds a runner's root level (every row) and the compacted levels (one per
size, built on first use and kept across calls); while a generation compacts, the levels it entered form a
chain, each holding some rows of the one before:

    stack = LevelStack(root, make)     make(rows, root_rows) -> a new Level (levels.py) of `rows` rows
    stack.current                      the level the next round runs on
    stack.enter(size)                  move the current level's live rows into the `size`-row level
    stack.unwind()                     write the outputs back, innermost first: the root is current again
"""
from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING, Callable

import torch

from ..model.layers import KVCache
from .state import DecodeState

if TYPE_CHECKING:  # levels.py builds the levels; this module only moves rows between them
    from .levels import Level

# Run-level counters (not per row): carried over as they are.
COUNTERS = ("n_emitted", "n_row_forwards", "n_accepted", "n_proposed", "n_tried")
# What the generation's result reads: written back to the parent rows at the end.
OUTPUTS = ("out_tokens", "out_logp", "out_len", "finished", "row_rounds")


def compact_size(live: int, current: int, below: float, min_rows: int) -> int | None:
    """Rows of the smaller state to move `live` live rows into, or None to stay at `current` rows:
    compact when live <= below · current and the new size (next power of two >= live, at least
    min_rows: GenerateConfig.compact_min_rows) at least halves the batch."""
    if below <= 0 or live == 0 or live > below * current:
        return None
    size = max(min_rows, 1 << (live - 1).bit_length())
    return size if size <= current // 2 else None


def smaller_sizes(current: int, below: float, min_rows: int) -> list[int]:
    """Every size `compact_size` may move a `current`-row state into, smallest first: the powers of two from
    min_rows (a power of two, GenerateConfig checks) to current // 2; none when compaction is off."""
    sizes, size = [], max(1, min_rows)
    while below > 0 and size <= current // 2:
        sizes.append(size)
        size *= 2
    return sizes


def pick_rows(finished: torch.Tensor, size: int) -> torch.Tensor:
    """(size,) int64 rows of the current state for the smaller one: every live row, then distinct
    finished rows as padding (they stay finished, so they never emit; distinct so that writing the
    outputs back never writes one row twice). One host sync (nonzero)."""
    live = (~finished).nonzero().squeeze(1)
    done = finished.nonzero().squeeze(1)
    if live.numel() > size or live.numel() + done.numel() < size:
        raise ValueError(f"cannot compact {live.numel()} live of {finished.numel()} rows into {size}")
    return torch.cat([live, done[: size - live.numel()]])


def gather_state(src: DecodeState, dst: DecodeState, rows: torch.Tensor) -> None:
    """dst (len(rows) rows) <- src's rows `rows`: every per-row tensor, both KV caches, the counters."""
    for f in fields(src):
        a, b = getattr(src, f.name), getattr(dst, f.name)
        if a is None:
            continue
        if isinstance(a, KVCache):  # (L, B, Hkv, S_max, D): rows are dim 1
            torch.index_select(a.k, 1, rows, out=b.k)
            torch.index_select(a.v, 1, rows, out=b.v)
        elif f.name in COUNTERS:
            b.copy_(a)
        else:
            torch.index_select(a, 0, rows, out=b)


def scatter_outputs(child: DecodeState, parent: DecodeState, rows: torch.Tensor) -> None:
    """parent's rows `rows` <- child's outputs (tokens, log-probs, lengths, finished) and counters."""
    for name in OUTPUTS:
        getattr(parent, name).index_copy_(0, rows, getattr(child, name))
    for name in COUNTERS:
        getattr(parent, name).copy_(getattr(child, name))


class LevelStack:
    """A runner's root level, its compacted levels by size, and the chain of levels the running generation
    entered (module docstring). `make(rows, root_rows)` builds a level (with its graphs) around a `root_rows`
    buffer: which root row each of its rows holds, rewritten at each entry."""

    def __init__(self, root: Level, make: Callable[[int, torch.Tensor], Level]):
        self.root, self.make = root, make
        self.levels: dict[int, Level] = {}  # compacted levels by row count, kept across calls
        self.chain: list[tuple[Level, torch.Tensor]] = []  # entered levels: (level, rows of its parent)

    @property
    def current(self) -> Level:
        return self.chain[-1][0] if self.chain else self.root

    @property
    def depth(self) -> int:
        """How many compactions the running generation is in (0: at the root)."""
        return len(self.chain)

    def enter(self, size: int) -> Level:
        """Gather the current level's live rows (and finished ones as padding: pick_rows) into the `size`-row
        level, which becomes current. Its state's counters carry on from the parent's (COUNTERS)."""
        parent = self.current
        level = self.levels.get(size)
        if level is None:  # built (and captured) once per size, reused by later calls
            level = self.levels[size] = self.make(size, torch.empty(size, dtype=torch.long, device=parent.st.n.device))
        rows = pick_rows(parent.st.finished, size)
        gather_state(parent.st, level.st, rows)
        # root rows compose down the chain: the root's rows are themselves (root_rows None)
        level.root_rows.copy_(rows if parent.root_rows is None else parent.root_rows[rows])
        self.chain.append((level, rows))
        return level

    def unwind(self) -> None:
        """Write every entered level's outputs back into its parent, innermost first; the root is current."""
        while self.chain:
            level, rows = self.chain.pop()
            scatter_outputs(level.st, self.current.st, rows)
