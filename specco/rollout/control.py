"""Speculation control: how many draft tokens k to propose per round, chosen per call and per level.

Whether speculation pays depends on the batch and on acceptance. With k draft tokens a round emits
on average

    E[τ_k] = 1 + Σ_{j=1..k} Π_{i<=j} α_i          α_i = P(token i accepted | tokens 1..i-1 accepted)

tokens per row and costs t_round(k) = t_propose(k) + t_verify(k) + t_catch_up(k); plain decoding
emits 1 token per t_step. The choice maximising tokens per second is

    k* = argmax_{k in 0..k_max}  E[τ_k] / t_round(k)          (t_round(0) = t_step, E[τ_0] = 1)

and the predicted speedup over plain decoding is E[τ_k*] · t_step / t_round(k*). The costs are
measured by the runner itself on each level's captured graphs (one level per batch size: the root and
every compacted size, generate.py); the α_i are the live per-position acceptance of the current run,
pooled over calls with exponential forgetting so the choice follows a drifting policy/draft pair.

Losslessness does not depend on the choice: every k verifies with the same acceptance rule, and the
round draws the same uniforms whatever k is, so outputs keep the target's distribution and, for a
fixed k, are exactly those of plain speculative decoding with that k.

Rows left at a level are not the rows the estimate came from. The rows still decoding once most have
finished are the long ones, and in RL the longest are often a weak policy's runaway, high-entropy text,
on which a draft accepts far less than on the rest (H200, configs/long.toml: DFlash accepted ~1.4 tokens
per round on the row that decoded alone for 1,200 rounds, against a mean τ of 5.8, and its round cost
1.8x a plain one there). The pooled α come from every row of this and earlier calls, so they would keep
that tail speculating at a loss. So within a level the runner re-chooses every `recheck_rounds` rounds
from the counts of that level's rounds since its last choice alone (`LevelRecheck`: a window, not
everything since the level began), once the window's first position has `min_tries` tries.

A window, because the rows' acceptance changes within a level too, and a level cannot see deeper
than its k. The rounds just after a level begins mix rows about to finish (3-token direct answers,
high entropy) with the worked ones; a choice made then lowered k, and with counts kept since the
level began the positions above that k were never tried again, so their early estimates stayed and
pinned the level (H200, configs/long_cotrain.toml, 2026-12-03: DFlash's 256-row level sat at k = 2
for 356 rounds at τ 2.84, 1.99 ms per token, where its k = 7 rounds had run at τ 6.5, ~1.5 ms per
token, in another run; the next level, entered at k = 7, ran at τ 6.8). In a window the positions
above the current k have no tries, so they take the optimistic prior capped by the deepest tried
position (`alphas`): the level probes a deeper k, and the next window measures it. A probe that the
next window undoes (a failed one) makes the level sit out re-checks before the next probe: 1 after the
first failure, then 2, 4, 8, ... (a probe that holds resets this), so a level whose deep positions
really are poor spends ever fewer windows probing; between probes the untried positions count as
never accepted. Probing changes which k runs, never what is emitted (the paragraph below).

Rule for levels: a plain step leaves the draft without state for its tokens (the draft's cache and
EAGLE-3's pass-1 output are kept up to date by the rounds' catch-ups), so a level that decodes plainly
decides for every smaller level of the call too. A level that chooses k = 0 while the draft still
promises tokens (E[τ_k_max] above the margin with the acceptance known then) and a smaller level may
follow runs the *tracked* plain round instead (speculative.py: the plain step's token, plus the
catch-up of its taps), and the levels after it choose their k afresh: in RL the root's batch is often
too large for a verify to pay while the tail's few long rows gain most (H200, the dense twin of
configs/moe.toml, 2026-12-05: its DFlash arm chose plain at 256 rows, and the untracked rule kept the
64-, 16- and 8-row levels plain for the whole run). The tracking costs the draft's catch-up of one token
per round (measured: Level.track_cost), so a level tracks only while some smaller level may speculate: one
not yet measured, or one whose measured costs make a k pay at the acceptance known then (LevelK._track). A
level left plain untracked (a hopeless draft, no smaller level that pays, or the last level) keeps every
smaller level plain. Speculative levels may lower k or switch to plain freely.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


def expected_tokens(alphas: torch.Tensor) -> float:
    """E[τ_k] = 1 + Σ_{j<=k} Π_{i<=j} α_i for the conditional acceptances α (k,) of the module docstring."""
    return 1.0 + float(torch.cumprod(alphas.double(), 0).sum())


@dataclass
class Choice:
    """What the controller chose for one level (logged as rollout/k_chosen etc.)."""
    rows: int
    k: int
    predicted_speedup: float  # E[τ_k] · t_step / t_round(k) with the acceptance known at the time
    costs_ms: dict[int, float]  # measured t_round(k) per candidate k, ms
    tracked: bool = False  # k = 0 run as the tracked plain round (module docstring, rule for levels)

    def __str__(self) -> str:
        """rows:k, as rollout/k_path logs it: e.g. 256:k0t (tracked plain) 64:k7."""
        return f"{self.rows}:k{self.k}{'t' if self.tracked else ''}"


@dataclass
class SpecController:
    """Per-position acceptance estimates and the k rule above.

    prior: α_i before enough evidence. It is optimistic (1.0) on purpose: a controller that starts
    pessimistic picks plain decoding and, since plain rounds test no draft token, never learns
    otherwise. With the optimistic prior an unknown pair is tried at the k that would pay if all were
    accepted; the evidence then decides. memory: how much of the pooled counts survives each update
    (1 keeps everything, 0 only the newest call) — it also makes a controller that settled on plain
    decoding fall back to the prior after a few calls and probe again, so a draft that improves
    (co-training) is noticed; min_tries: row-rounds a position needs before its estimate replaces
    the prior; margin: speculation must beat plain by this factor (noise guard, so a near-tie never
    makes rollouts slower than plain); recheck_rounds: how often (rounds) a speculating level re-chooses
    from its own rows' acceptance (module docstring; 0 never).
    """
    k_max: int
    prior: float = 1.0
    memory: float = 0.5
    min_tries: float = 64.0
    margin: float = 1.03
    recheck_rounds: int = 32
    tried: torch.Tensor = field(init=False)
    accepted: torch.Tensor = field(init=False)

    def __post_init__(self):
        self.tried = torch.zeros(self.k_max, dtype=torch.float64)
        self.accepted = torch.zeros(self.k_max, dtype=torch.float64)

    def alphas(self, live: tuple | None = None, pooled: bool = True, probe: bool = True) -> torch.Tensor:
        """(k_max,) conditional acceptance per position from the pooled counts (unless not `pooled`) plus
        `live` ((n_accepted, n_tried) per position: the current call's so far, or one level's); positions
        with too few tries use the prior, and such a position never exceeds the estimate of the one before it.
        probe False: a position with no tries at all counts as never accepted (LevelRecheck between probes)."""
        acc, tried = (self.accepted, self.tried) if pooled else \
            (torch.zeros_like(self.accepted), torch.zeros_like(self.tried))
        if live is not None:
            acc = acc + live[0].double().cpu()[: self.k_max]
            tried = tried + live[1].double().cpu()[: self.k_max]
        est = torch.where(tried >= self.min_tries, acc / tried.clamp(min=1), torch.full_like(tried, self.prior))
        for j in range(1, self.k_max):
            if tried[j] < self.min_tries:
                est[j] = min(est[j], est[j - 1])
        if not probe:
            est = torch.where(tried > 0, est, torch.zeros_like(est))
        return est

    def expected_tokens(self, k: int, live: tuple | None = None, pooled: bool = True, probe: bool = True) -> float:
        """E[τ_k] = 1 + Σ_{j<=k} Π_{i<=j} α_i."""
        return expected_tokens(self.alphas(live, pooled, probe)[:k]) if k > 0 else 1.0

    def update(self, accepted: torch.Tensor, tried: torch.Tensor) -> None:
        """Fold in one generation's counts (n_accepted, n_tried per position; state.py)."""
        self.accepted = self.memory * self.accepted + accepted.double().cpu()[: self.k_max]
        self.tried = self.memory * self.tried + tried.double().cpu()[: self.k_max]

    def choose(self, costs: dict[int, float], rows: int, allow_speculation: bool = True,
               live: tuple | None = None, pooled: bool = True, probe: bool = True) -> Choice:
        """The k of largest predicted throughput among the measured candidates (`costs`: k -> s/round);
        live: acceptance counts (see `alphas`) — the current call's so far, added to the pooled ones, or
        with pooled=False one level's window alone (the re-check, module docstring); probe: see `alphas`."""
        t_step = costs[0]
        ms = {k: t * 1e3 for k, t in costs.items()}
        speedups = {k: self.expected_tokens(k, live, pooled, probe) * t_step / t for k, t in costs.items() if k > 0}
        if allow_speculation and speedups:
            k = max(speedups, key=speedups.get)
            if speedups[k] > self.margin:
                return Choice(rows, k, speedups[k], ms)
        return Choice(rows, 0, 1.0, ms)


class LevelRecheck:
    """The re-check of one level's k (module docstring): counts in a window since the last choice, probes
    of a deeper k, and the backoff after a failed probe. One per level entered; `counts` are the level's
    running (n_accepted, n_tried) per position (state.py), on the device."""

    def __init__(self, ctl: SpecController, counts: tuple[torch.Tensor, torch.Tensor]):
        self.ctl = ctl
        self.base = tuple(c.clone() for c in counts)  # the counts when the window began
        self.backoff = 1  # re-checks to sit out after the next failed probe
        self.wait = 0  # re-checks left before a probe may run
        self.probe_k: int | None = None  # the k a running probe tries

    def __call__(self, costs: dict[int, float], rows: int, k_now: int,
                 counts: tuple[torch.Tensor, torch.Tensor]) -> Choice | None:
        """The level's next choice, or None while the window's first position has fewer than `min_tries`
        tries (the window then grows on; one small host read per call)."""
        here = tuple((c - b).double().cpu() for c, b in zip(counts, self.base))
        if float(here[1][0]) < self.ctl.min_tries:
            return None
        self.base = tuple(c.clone() for c in counts)
        probe = self.wait == 0
        choice = self.ctl.choose(costs, rows, True, here, pooled=False, probe=probe)
        if self.probe_k is not None:  # this window ran the probe: did it hold?
            failed = choice.k < self.probe_k
            self.wait, self.backoff = (self.backoff, self.backoff * 2) if failed else (0, 1)
            self.probe_k = None
        elif not probe:
            self.wait -= 1
        if choice.k > k_now:  # deeper than this window could see: a probe, judged by the next window
            self.probe_k = choice.k
        return choice


class LevelK:
    """The per-level choice of k for one runner (module docstring): `enter` picks a level's k when a call
    enters it (the root after the prefill, each compacted level after its gather), `recheck` re-chooses within
    the level every `recheck_rounds` rounds; `choices` records every pick of the running call, root first.
    Without a controller (speculation control off) every level runs the k it was built with (k_max, or 0
    without a draft) and nothing is recorded.

    `level`: a levels.Level (not imported: levels.py imports Choice from here). Its `k` (and `tracking`) is what
    this writes: Level.round runs `level.k`'s step set. below(level): the sizes a level compacted from `level` may
    take, each as (rows, its measured costs), or None for one not measured yet (the runner's LevelStack knows);
    None: every smaller level counts as unknown."""

    def __init__(self, ctl: SpecController | None, below=None):
        self.ctl, self.below = ctl, below
        self.choices: list[Choice] = []  # one per level entered, and one per change of k within a level
        self._recheck: LevelRecheck | None = None  # the current level's re-check

    def start(self) -> None:
        """A new call: no choices yet."""
        self.choices = []

    def enter(self, level, allow_speculation: bool) -> None:
        """Choose `level`'s k from its measured costs (measured on first use) and the pooled plus this call's
        acceptance, and whether a k = 0 runs tracked. allow_speculation False: plain, untracked (a plain call,
        or below a level left plain untracked: the rule for levels in the module docstring)."""
        level.tracking = False
        if self.ctl is not None:
            if not level.costs:
                level.measure()
            live = (level.st.n_accepted, level.st.n_tried)  # this call's counts so far (compaction copies them)
            level.choice = self.ctl.choose(level.costs, level.rows, allow_speculation, live)
            level.k = level.choice.k
            self._track(level, allow_speculation, live)
            self.choices.append(level.choice)
            self._recheck = LevelRecheck(self.ctl, live)
        if not allow_speculation:
            level.k = 0

    def _track(self, level, allow_speculation: bool, live: tuple) -> None:
        """A level at k = 0 runs the tracked plain round if it has one (a smaller level may follow), the call
        speculates, the draft still promises tokens (E[τ_k_max] > margin; the optimistic prior counts, so an
        untried draft is tracked), and some smaller level may speculate: one not measured yet, or one whose
        measured costs make some k pay with the acceptance known now. So a weak draft on a batch where no level
        pays is not tracked (its catch-up would be a cost for nothing) once the levels' costs are known."""
        ctl = self.ctl
        level.tracking = (level.k == 0 and allow_speculation and level.tracked is not None
                          and ctl.expected_tokens(ctl.k_max, live) > ctl.margin
                          and any(c is None or ctl.choose(c[1], c[0], True, live).k > 0
                                  for c in (self.below(level) if self.below is not None else [None])))
        level.choice.tracked = level.tracking

    def recheck(self, level, rounds: int) -> None:
        """After `rounds` rounds at this level: every `recheck_rounds`-th, re-choose a speculating level's k from
        the acceptance of its latest rounds alone (LevelRecheck). Once plain, a level stays plain (tracked if it
        may be, so the levels below may speculate again: `_track`)."""
        ctl = self.ctl
        if ctl is None or level.k == 0 or rounds == 0 or ctl.recheck_rounds <= 0 or rounds % ctl.recheck_rounds:
            return
        choice = self._recheck(level.costs, level.rows, level.k, (level.st.n_accepted, level.st.n_tried))
        if choice is not None and choice.k != level.k:
            level.k, level.choice = choice.k, choice
            if choice.k == 0:
                self._track(level, True, (level.st.n_accepted, level.st.n_tried))
            self.choices.append(choice)
