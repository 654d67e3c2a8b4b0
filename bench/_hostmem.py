"""A process's resident host memory around one call (Linux /proc), for the benches that measure what a load or a
set-up step costs per rank (bench/sharded_load.py, bench/shard_arm.py)."""
from __future__ import annotations

import gc
from pathlib import Path

MB = 2 ** 20


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def measure(make):
    """(peak - before, after - before, the result) of `make()` in this process's resident memory: the high-water
    mark is reset to the current RSS first (clear_refs 5), so the peak is the call's own."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status("VmRSS")
    out = make()
    return _status("VmHWM") - before, _status("VmRSS") - before, out
