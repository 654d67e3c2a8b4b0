"""The refit guard (docs/DESIGN.md §6): after every refit, check that the rollout engine holds exactly the
trainer's policy and draft, and watch the live acceptance for the signature of a broken weight sync.

Why. The bug class peers report most (NeMo-RL #2646, SGLang #31674, miles #1926): the draft's — or the
policy's — weights silently stop reaching the rollout engine; acceptance pins at 0 (τ → 1.0) or at 1.0
while the trainer's draft loss keeps falling, and a run goes on for days. Two checks, on by default
(`train.refit_guard`):
  * weights: `RolloutEngine.check_weights` compares fingerprints of the engine's and the trainer's state
    dicts (one pass over the weights, no copy);
  * acceptance: the first draft position's acceptance (over the rounds that proposed one — speculation
    control may legitimately decode plainly) collapsing to ≈ 0, or pinning at exactly 1.0, when the
    previous steps were clearly between, is an error that names the step and the figures compared.
"""
from __future__ import annotations

import statistics

from ..rollout.engine import RefitError

# Collapse thresholds: the previous steps' mean acceptance must have been at least LIVE for a drop below
# COLLAPSED to count, and at most PINNED_BELOW for an exact 1.0 to count; at least MIN_TRIES proposals.
LIVE, COLLAPSED, PINNED_BELOW, MIN_TRIES, WINDOW = 0.2, 0.02, 0.9, 64, 3


def check_acceptance(history: list[float], accept_pos1: float, proposed: int, step: int) -> None:
    """Raise RefitError if this step's acceptance looks like a broken refit (module docstring);
    `history`: the previous steps' first-position acceptance (steps that proposed at least MIN_TRIES)."""
    if proposed < MIN_TRIES or len(history) < 2:
        return
    before = statistics.mean(history[-WINDOW:])
    if before >= LIVE and accept_pos1 < COLLAPSED:
        raise RefitError(f"step {step}: the draft's first-token acceptance collapsed to {accept_pos1:.3f} over "
                         f"{proposed} proposals, after {before:.2f} on average over the previous "
                         f"{min(WINDOW, len(history))} steps — the draft the engine speculates with is probably "
                         "not the trained one (refit); set train.refit_guard=false to run on anyway")
    if accept_pos1 == 1.0 and before <= PINNED_BELOW:
        raise RefitError(f"step {step}: the draft's first-token acceptance is pinned at exactly 1.0 over {proposed} "
                         f"proposals, after {before:.2f} on average before — the engine's draft and policy are "
                         "probably not the trainer's; set train.refit_guard=false to run on anyway")
