"""Named fault-injection points, so tests can kill a run at an exact place, deterministically.

Code that writes something a crash could leave half-done calls `point("stage/what-was-just-written")`
between its writes. In production no hook is set and `point` does nothing. A test installs a hook with
`inject(hook)`; the hook raises (a `SimulatedCrash`, say) at the point it wants to die at, and the test
then re-runs to check that the interrupted run recovers to the uninterrupted result.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

_hook: Callable[[str], None] | None = None


class SimulatedCrash(BaseException):
    """Raised by test hooks. A BaseException, like KeyboardInterrupt, so no `except Exception` in the
    code under test swallows it."""


def point(name: str) -> None:
    if _hook is not None:
        _hook(name)


@contextmanager
def inject(hook: Callable[[str], None]):
    global _hook
    prev, _hook = _hook, hook
    try:
        yield
    finally:
        _hook = prev


def crash_at(target: str, nth: int = 1, seen: list | None = None) -> Callable[[str], None]:
    """A hook that raises SimulatedCrash the `nth` time the point named `target` is reached; every point
    reached is appended to `seen` (tests list a run's points by running it once with target="")."""
    hits = [0]

    def hook(name: str):
        if seen is not None:
            seen.append(name)
        if name == target:
            hits[0] += 1
            if hits[0] == nth:
                raise SimulatedCrash(f"{name} #{nth}")
    return hook
