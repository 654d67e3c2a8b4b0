"""The one timing helper of the benches: median seconds per call.

CUDA: events around each call (device time, after a synchronize); elsewhere the host clock.
"""
from __future__ import annotations

import time

import torch


def timeit(fn, device, iters: int = 10, warmup: int = 3) -> float:
    device = torch.device(device).type
    for _ in range(warmup):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if device == "cuda":
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            fn()
            t1.record()
            torch.cuda.synchronize()
            times.append(t0.elapsed_time(t1) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]
