"""fp32 GQA causal attention on CUDA: SDPA's `enable_gqa` (math path) vs K/V repeated to H heads
(memory-efficient kernel), as `specco.model.layers.causal_sdpa` chooses. One layer, fwd+bwd: time,
peak memory above the inputs, and rel. error of out and every gradient against fp64.

    python bench/policy_attention_memory.py            # H200: S = 8192, H = 16, Hkv = 4, D = 64
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specco.model.layers import causal_sdpa  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs CUDA: on CPU both routes run the same flash kernel")
    torch.manual_seed(0)
    S, H, Hkv, D = a.seq, a.heads, a.kv_heads, a.head_dim
    q = torch.randn(1, H, S, D, device="cuda", requires_grad=True)
    k, v = (torch.randn(1, Hkv, S, D, device="cuda", requires_grad=True) for _ in range(2))
    dout = torch.randn(1, H, S, D, device="cuda")
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref_o = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)
    ref = [ref_o.detach(), *torch.autograd.grad(ref_o, (qd, kd, vd), dout.double())]
    rel = lambda x, r: ((x.double() - r).norm() / r.norm()).item()  # noqa: E731
    rows = []
    for name, expand in (("enable_gqa (math)", False), ("expanded (memory-efficient)", True)):
        for _ in range(2):  # warm-up
            torch.autograd.grad(causal_sdpa(q, k, v, expand_gqa=expand), (q, k, v), dout)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t = time.perf_counter()
        o = causal_sdpa(q, k, v, expand_gqa=expand)
        grads = torch.autograd.grad(o, (q, k, v), dout)
        torch.cuda.synchronize()
        row = {"route": name, "ms": 1e3 * (time.perf_counter() - t),
               "peak_gib_above_inputs": (torch.cuda.max_memory_allocated() - base) / 2**30,
               "rel_err": dict(zip(("out", "dq", "dk", "dv"), (rel(x, r) for x, r in zip((o, *grads), ref))))}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del o, grads
    out = Path(os.environ.get("OUT", "bench/results")) / "policy_attention_memory_cuda.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "args": vars(a), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
