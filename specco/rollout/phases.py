"""A generate call's phases: one per level it decoded at (the whole batch, then each compacted size).

How much of a rollout is its tail (a few long rows decoding alone) is the question compaction and the tail
re-check answer; `GenerateOutput.phases` measures it. The runner's decode loop drives a `PhaseClock`:

    clock = PhaseClock(st)       at the first round, on the root's state
    clock.tick()                 after each round
    clock.lap(st, rows)          just before compacting into a `rows`-row level (st: the level left)
    phases = clock.stop(st)      after the last round

Time is read between the per-round host syncs, so a phase holds exactly its own rounds (a level's first use
includes its graph capture). The token counters run on across levels (compaction.COUNTERS), so a phase's
tokens and row-rounds are the difference of two reads of them.
"""
from __future__ import annotations

import time
from typing import NamedTuple

import torch

from .state import DecodeState


class Phase(NamedTuple):
    """One level a call decoded at (DecodeRunner.run): its rows, decode rounds and wall seconds (timed between
    the per-round host syncs; a level's first use includes its capture), and the tokens emitted and live
    row-rounds there, whose ratio is the level's own τ: a tail level's acceptance apart from the call's mean."""
    rows: int
    rounds: int
    seconds: float
    emitted: int
    row_rounds: int

    @property
    def tau(self) -> float:
        return self.emitted / self.row_rounds if self.row_rounds else 1.0


def _counters(st: DecodeState) -> tuple[int, int]:
    """(tokens emitted, live row-rounds) so far in this call: one host read."""
    emitted, forwards = torch.stack((st.n_emitted, st.n_row_forwards)).tolist()
    return emitted, forwards


class PhaseClock:
    """Rounds, wall time and counters of the running phase; the finished phases in `phases`."""

    def __init__(self, st: DecodeState):
        self.phases: list[Phase] = []
        self.rows, self.rounds, self.t0 = st.finished.numel(), 0, time.perf_counter()
        self.counts = _counters(st)

    def tick(self) -> None:
        self.rounds += 1

    def _end(self, st: DecodeState, t: float) -> tuple[int, int]:
        now = _counters(st)
        self.phases.append(Phase(self.rows, self.rounds, t - self.t0, now[0] - self.counts[0], now[1] - self.counts[1]))
        return now

    def lap(self, st: DecodeState, rows: int) -> None:
        """End the running phase at `st` (the level being left) and start one of `rows` rows."""
        t = time.perf_counter()
        self.counts = self._end(st, t)
        self.rows, self.rounds, self.t0 = rows, 0, t

    def stop(self, st: DecodeState) -> tuple[Phase, ...]:
        self._end(st, time.perf_counter())
        return tuple(self.phases)
