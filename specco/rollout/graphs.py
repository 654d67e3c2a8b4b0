"""Static-shape step functions, run eagerly (CPU) or replayed as captured CUDA graphs (GPU).

Why graphs: a decode step of a 0.5B model is ~1000 small kernels (1037 counted, eager, H200);
launched from Python that is ~12.7 ms at batch 1, against ~2.6 ms replayed from a CUDA graph here
(docs/DESIGN.md §6 quotes 1.41 ms for a leaner PyTorch model; the gap is kernel count, not attention). So every
per-token step (plain decode, draft proposal, verify, draft catch-up) is written as a function that
reads and writes *only* preallocated static buffers in place — no `.item()`, no data-dependent
shapes, no host-side randomness — and is captured once per DecodeRunner, i.e. once per shape
bucket: RolloutEngine keeps its runners, so repeated generate calls only replay (generate.py).
The prefill is one of these steps too ('prefill', captured first: it resets the decode state).

Capturing runs the functions a few times (warm-up on a side stream; the capture itself records
without executing), which would advance the decode state. `StepGraphs.capture` therefore snapshots
the small state tensors, calls `freeze()` (the runner marks every row finished, so no position
advances and no write can run past the cache — the compute is static-shaped, hence identical) and
restores the snapshot afterwards. The KV caches are *not* snapshotted: every step only writes cache
entries at positions >= the row's current position n, and those are always rewritten before they
are read (attention reads keys at positions <= the query's own), so the warm-up's writes are
harmless.
"""
from __future__ import annotations

from typing import Callable

import torch


class StepGraphs:
    """A named set of in-place step functions sharing one CUDA-graph memory pool."""

    def __init__(self, fns: dict[str, Callable[[], None]], use_graphs: bool):
        self.fns = fns
        self.use_graphs = use_graphs
        self.graphs: dict[str, torch.cuda.CUDAGraph] = {}

    def capture(self, state_tensors: list[torch.Tensor], order: list[str],
                freeze: Callable[[], None], warmup: int = 2, pool=None):
        """Capture `order` (the functions in the order one round runs them) as CUDA graphs.

        state_tensors: the small state that the steps mutate; restored after warm-up + capture.
        freeze: called after the snapshot, makes the warm-up steps leave positions unchanged.
        pool: a CUDA-graph memory pool to share with other graphs of the runner (default: a new one).
        """
        if not self.use_graphs or self.graphs:
            return
        saved = [t.clone() for t in state_tensors]
        freeze()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: lazy init (cuBLAS handles, autotuning) off-graph
            for _ in range(warmup):
                for name in order:
                    self.fns[name]()
        torch.cuda.current_stream().wait_stream(side)
        # Memory the caching allocator holds but nothing uses (e.g. a train step's activations) goes back
        # to the driver now: during capture nothing can be freed, and cuBLAS then failed its own
        # allocation (CUBLAS_STATUS_INTERNAL_ERROR, H200, after the warm start of a 316M policy).
        torch.cuda.empty_cache()
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        for name in order:  # captured in run order so they can share one pool
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.fns[name]()
            self.graphs[name] = g
        for t, s in zip(state_tensors, saved):
            t.copy_(s)
        torch.cuda.synchronize()

    def run(self, name: str):
        g = self.graphs.get(name)
        if g is not None:
            g.replay()
        else:
            self.fns[name]()
