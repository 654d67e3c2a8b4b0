"""The timing helpers of the benches: median seconds per call (`timeit`), and a CUDA graph of a call (`capture`).

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


def capture(fn):
    """(a CUDA graph of `fn`, its output): warmed twice on a side stream, then captured. The graph reads and writes
    the tensors `fn` used where they lay at capture: the caller keeps them alive while it replays the graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out
