"""What runs inside the `math` reward's worker processes: math_verify with a per-row time limit.

Why processes. math_verify bounds its own work with `signal.alarm`, which Python allows only in a main
thread, and sympy can take unbounded time on a pathological expression (`\\boxed{9^{9^{9^9}}}`). Each
worker of the pool (specco.rewards.builtins.MathReward) runs these functions in its main thread, arms its
own interval timer per row and counts a row that outlives it as a timeout (score 0). A hang the timer
cannot break (a long C call that never returns to the interpreter) is caught by the parent's deadline,
which kills the pool.

This module is imported in fresh spawned processes, so it must stay light: math_verify only -- no
torch (specco.rewards' __init__ imports lazily for the same reason).
"""
from __future__ import annotations

import logging
import signal

# imported with the module, before any row's timer is armed: a cold import of math_verify's LaTeX parser
# takes about a second, which must not count against the first row
from math_verify import parse, verify

# math_verify warns once per process that its own timeouts are off; here they are off on purpose (its
# `signal.alarm(0)` on exit would also disarm our timer).
logging.getLogger("math_verify").setLevel(logging.ERROR)


class RowTimeout(BaseException):
    """Raised by the timer. A BaseException so that math_verify's and sympy's `except Exception` blocks,
    which turn parse errors into 'no match', cannot swallow it."""


_armed = False  # the handler raises only while a row runs: a late signal after the row ended is ignored


def _on_alarm(signum, frame):
    if _armed:
        raise RowTimeout


def verify_row(gold: str, pred: str) -> bool:
    """math_verify's equivalence of two extracted answers, gold first (its `verify` is not symmetric).

    Both are wrapped in `\\boxed{}` before `parse`: the box makes math_verify read the whole string as one
    LaTeX expression, so '0.5', '\\frac{1}{2}', '1/2' and '$42$' all parse (a bare 'x^2+1' would not)."""
    g = parse("\\boxed{" + gold + "}", parsing_timeout=None)
    p = parse("\\boxed{" + pred + "}", parsing_timeout=None)
    return bool(g) and bool(p) and bool(verify(g, p, timeout_seconds=None))


def verify_chunk(pairs: list[tuple[str, str]], timeout_s: float, row_fn=verify_row) -> list[tuple[float, bool]]:
    """(score, timed_out) per (gold, pred) pair: 1.0 equivalent, 0.0 not, unparsable, or out of time.

    `row_fn` is what one row runs (verify_row; a test passes a sleeper, by reference -- it is pickled)."""
    global _armed
    signal.signal(signal.SIGALRM, _on_alarm)
    out = []
    for gold, pred in pairs:
        try:
            _armed = True
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
            result = (1.0 if row_fn(gold, pred) else 0.0, False)
        except RowTimeout:
            result = (0.0, True)
        except Exception:  # math_verify's internals on odd input: not a match, as its own callers treat it
            result = (0.0, False)
        finally:
            _armed = False  # first: a signal arriving between these two lines is ignored by the handler
            signal.setitimer(signal.ITIMER_REAL, 0)
        out.append(result)
    return out
