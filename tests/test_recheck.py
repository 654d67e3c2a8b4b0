"""Speculation control's re-check within a level (rollout/control.py LevelRecheck): a window of the level's
latest rounds, probes of a deeper k, backoff after failed probes.

Counts are synthesised as the runner's state keeps them (state.py): per position j, `n_tried[j]` counts the
row-rounds that proposed a j-th draft token with tokens 1..j-1 accepted, `n_accepted[j]` those that had it
accepted too; a round at k tries positions 1..k only. Costs are pinned (CPU timings are noise). The
lossless side — any k sequence emits plain decoding's tokens — is tested through the runner in
test_decode_path.py, test_rollout.py and test_coupled.py; this file tests the choices.
"""
from __future__ import annotations

import torch

from specco.rollout.control import LevelRecheck, SpecController

# the shape of a block drafter's costs at a large batch (bench/results/rounds_long316m_dflash_*): deeper k
# costs more per round, but a deep accepted block pays for it
COSTS = {0: 1.0, 1: 1.25, 2: 1.35, 3: 1.5, 4: 1.7}
K_MAX = 4


class Counts:
    """A level's running (n_accepted, n_tried) per position, advanced one window at a time."""

    def __init__(self):
        self.acc = torch.zeros(K_MAX, dtype=torch.long)
        self.tried = torch.zeros(K_MAX, dtype=torch.long)

    def window(self, k: int, alphas: list[float], row_rounds: int = 1000):
        """`row_rounds` live row-rounds at k, conditional acceptance `alphas` per position."""
        reach = float(row_rounds)
        for j in range(k):
            t = round(reach)
            a = round(t * alphas[j])
            self.tried[j] += t
            self.acc[j] += a
            reach = a
        return self.acc.clone(), self.tried.clone()


def run_windows(alphas_per_window, k0=K_MAX, min_tries=64):
    """The k the level runs in each window, and the re-check after each: its choice (None: too few tries)."""
    ctl = SpecController(K_MAX, min_tries=min_tries)
    c = Counts()
    rc = LevelRecheck(ctl, (c.acc.clone(), c.tried.clone()))
    k, ks = k0, []
    for alphas in alphas_per_window:
        ks.append(k)
        choice = rc(COSTS, 256, k, c.window(k, alphas))
        if choice is not None:
            k = choice.k
    return ks


POOR = [0.9, 0.8, 0.3, 0.3]  # the first rounds of a level: rows about to finish drag deep positions down
GOOD = [0.95, 0.95, 0.95, 0.95]  # the worked rows after them


def test_a_level_climbs_back_after_its_rows_improve():
    """The H200 lock-in (control.py's docstring): a first window with poor deep acceptance lowers k; the
    rows then improve. Counts since the level began would keep the deep positions' early estimates forever
    (shown below with the controller's own rule); the window probes k_max and keeps it."""
    ks = run_windows([POOR, GOOD, GOOD, GOOD, GOOD])
    assert ks[0] == K_MAX and ks[1] == 2, ks  # the poor window lowers k to 2
    assert ks[2:] == [K_MAX, K_MAX, K_MAX], ks  # probe at window 3, held from then on

    # the old rule, counts since the level began: positions 3-4 keep their first window's estimates
    ctl, c = SpecController(K_MAX, min_tries=64), Counts()
    c.window(K_MAX, POOR)
    k, old = 2, []
    for _ in range(4):
        counts = c.window(k, GOOD)
        k = ctl.choose(COSTS, 256, True, counts, pooled=False).k
        old.append(k)
    assert old == [2, 2, 2, 2], old  # pinned: what the window fixes


def test_failed_probes_back_off():
    """Deep positions that stay poor: each probe fails, and the re-checks sat out before the next probe
    double (1, 2, 4): probes run in windows 2, 5, 9 and 15, every other window at k = 2."""
    ks = run_windows([POOR] * 16)
    probes = [i for i, k in enumerate(ks) if k == K_MAX]
    assert probes == [0, 2, 5, 9, 15], ks  # window 0 is the level's entry at k_max
    assert all(k == 2 for i, k in enumerate(ks) if i not in probes), ks


def test_a_held_probe_resets_the_backoff():
    """After two failed probes the rows improve: the next probe holds and k stays at k_max. When the rows
    turn poor again, the level drops, probes after one window (the backoff was reset), and after that
    failure sits out one re-check, not four."""
    ks = run_windows([POOR] * 5 + [GOOD] * 4 + [POOR] * 6)
    assert ks[:5] == [K_MAX, 2, K_MAX, 2, 2], ks
    assert ks[5:10] == [K_MAX] * 5, ks  # the probe lands in the first good window and holds; window 9 (poor)
    # still runs the k window 8 chose
    assert ks[10:] == [2, K_MAX, 2, 2, K_MAX], ks


def test_a_small_window_grows_until_it_has_enough_tries():
    """A level with few live rows (the tail): a window whose first position has < min_tries tries chooses
    nothing and keeps growing; once it has them, it chooses from all of it."""
    ctl, c = SpecController(K_MAX, min_tries=64), Counts()
    rc = LevelRecheck(ctl, (c.acc.clone(), c.tried.clone()))
    assert rc(COSTS, 8, K_MAX, c.window(K_MAX, [0.1, 0.1, 0.1, 0.1], row_rounds=40)) is None
    choice = rc(COSTS, 8, K_MAX, c.window(K_MAX, [0.1, 0.1, 0.1, 0.1], row_rounds=40))
    assert choice is not None and choice.k == 0  # 80 tries, nothing accepted: plain


def test_untried_positions_count_as_never_accepted_between_probes():
    """probe=False (between probes): positions without tries add nothing, so no deeper k can win;
    probe=True: they take the prior capped by the deepest tried position."""
    ctl = SpecController(K_MAX, min_tries=10)
    live = (torch.tensor([95, 90, 0, 0]), torch.tensor([100, 95, 0, 0]))
    a_probe, a_hold = ctl.alphas(live, pooled=False), ctl.alphas(live, pooled=False, probe=False)
    torch.testing.assert_close(a_probe[2:], torch.full((2,), 90 / 95, dtype=torch.float64))
    torch.testing.assert_close(a_hold[2:], torch.zeros(2, dtype=torch.float64))
    assert ctl.choose(COSTS, 256, True, live, pooled=False, probe=False).k == 2
    assert ctl.choose(COSTS, 256, True, live, pooled=False, probe=True).k == K_MAX
