"""The timing helpers of the benches: median seconds per call (`timeit`), a CUDA graph of a call (`capture`), and
per-kernel device time of a call under the profiler (`device_times`).

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


def device_times(fn, dev, reps=3):
    """({kernel name: device (or CPU) microseconds per call} of fn (`leaf_kernels`), host microseconds per call, the
    profile): two untimed calls first, then `reps` profiled ones."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    for _ in range(2):
        fn()
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        for _ in range(reps):
            fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
    host_us = (time.perf_counter() - t0) / reps * 1e6
    return leaf_kernels(prof, dev, reps), host_us, prof


def leaf_kernels(prof, dev, reps: int) -> dict:
    """{kernel name: device microseconds per call} of a profile of `reps` calls: on CUDA the events that ran on the
    device (kernels, copies), which nest nothing, so they add up to the device's busy time; an op's or an autograd
    node's device time is its kernels' again (a custom autograd Function shows under its own name too). Elsewhere
    every op's CPU time (they nest)."""
    from torch.autograd import DeviceType
    out = {}
    for ev in prof.key_averages():
        if dev.type != "cuda":
            t = ev.cpu_time_total
        elif ev.device_type == DeviceType.CUDA:
            t = ev.device_time_total
        else:
            continue
        if t:
            out[ev.key] = t / reps
    return out
