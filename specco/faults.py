"""Named fault-injection points, so tests can kill a run at an exact place, deterministically.

Code that writes something a crash could leave half-done calls `point("stage/what-was-just-written")`
between its writes. In production no hook is set and `point` does nothing. A test installs a hook with
`inject(hook)`; the hook raises (a `SimulatedCrash`, say) at the point it wants to die at, and the test
then re-runs to check that the interrupted run recovers to the uninterrupted result.

A whole process can be killed at a point too, for tests of a launcher's restart (torchrun --max-restarts): the
environment variable SPECCO_FAULT="POINT[#NTH][@RANK]" makes the process of that RANK (torchrun's $RANK; any
rank without @) exit at once, with status 43 and no cleanup, the NTH time (default 1) it reaches POINT; with
SPECCO_FAULT_ONCE=FILE it fires only while FILE does not exist and creates FILE first, so the restarted job
runs through.
"""
from __future__ import annotations

import os
import re
from contextlib import contextmanager
from typing import Callable

_hook: Callable[[str], None] | None = None
KILLED_EXIT = 43


def _env_fault() -> Callable[[str], None] | None:
    """The kill hook SPECCO_FAULT describes (module docstring), or None when it is unset."""
    spec = os.environ.get("SPECCO_FAULT")
    if not spec:
        return None
    m = re.fullmatch(r"([^#@]+)(?:#(\d+))?(?:@(\d+))?", spec)
    if m is None:
        raise ValueError(f"SPECCO_FAULT={spec!r}: expected POINT[#NTH][@RANK], e.g. rl_step/updated#2@1")
    target, nth, rank = m.group(1), int(m.group(2) or 1), m.group(3)
    if rank is not None and rank != os.environ.get("RANK", "0"):
        return None
    once, hits = os.environ.get("SPECCO_FAULT_ONCE"), [0]

    def kill(name: str):
        if name != target:
            return
        hits[0] += 1
        if hits[0] == nth and not (once and os.path.exists(once)):
            if once:
                open(once, "w").close()
            os._exit(KILLED_EXIT)  # a crash: no finally blocks, no flushes, no goodbye to the process group
    return kill


_killer = _env_fault()


class SimulatedCrash(BaseException):
    """Raised by test hooks. A BaseException, like KeyboardInterrupt, so no `except Exception` in the
    code under test swallows it."""


def point(name: str) -> None:
    if _hook is not None:
        _hook(name)
    if _killer is not None:
        _killer(name)


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
