"""K-pass TTT attention (trunk + branch) vs K independent causal attentions of the same size.

For each pass d = 1..K the TTT attention is the causal trunk over S pass-1 keys plus a branch of
d-1 keys per query, merged exactly; the baseline is K plain causal SDPA calls (the cost a draft
would pay if each pass were an ordinary causal attention). Both fwd+bwd. The branch should cost
little: the ratio TTT / baseline is the figure of merit.

Also checks, before timing, that each adapter kernel available on the device matches an fp64
reference (outputs and gradients) on a small problem: the CUDA paths of specco/ops/sdpa_adapter.py
are exercised here because CI has no GPU.

    python bench/ttt_attention.py --device cuda --seqs 4096,8192,16384 --K 3
    python bench/ttt_attention.py --device cpu --small
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import timeit  # noqa: E402
from specco.ops.attention import _use_triton, ttt_attention  # noqa: E402
from specco.ops.sdpa_adapter import _pick_impl  # noqa: E402
from specco.ops.reference import dense_ttt_reference  # noqa: E402


def check_kernels(device, dtype):
    """Each adapter impl vs an fp64 dense reference: rel. error of out and all grads."""
    # None = what ttt_attention selects by default (cuDNN trunk + Triton branch on CUDA); on CUDA every
    # row's branch ⊕ merge runs the Triton kernels, so each row checks them too.
    impls = ["cpu_flash", "torch", None] if device == "cpu" else ["flash", "cudnn", "torch", None]
    B, H, Hkv, S, D, P = 2, 8, 2, 256, 128, 2
    g = torch.Generator(device="cpu").manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=g).to(device)  # noqa: E731
    q, k, v = mk(B, H, S, D), mk(B, Hkv, S, D), mk(B, Hkv, S, D)
    kb, vb, dout = mk(B, Hkv, S, P, D), mk(B, Hkv, S, P, D), mk(B, H, S, D)
    leaves64 = [t.double().requires_grad_() for t in (q, k, v, kb, vb)]
    ref = dense_ttt_reference(*leaves64)[0]
    ref_g = torch.autograd.grad(ref, leaves64, dout.double())
    rows = {}
    for impl in impls:
        try:
            leaves = [t.to(dtype).requires_grad_() for t in (q, k, v, kb, vb)]
            out = ttt_attention(*leaves, impl=impl)
            grads = torch.autograd.grad(out, leaves, dout.to(dtype))
            errs = [((a.double() - b).norm() / b.norm()).item() for a, b in zip([out, *grads], [ref, *ref_g])]
            rows[impl or "default"] = {"max_rel_err": max(errs), "errs(out,dq,dk,dv,dkb,dvb)": errs}
        except Exception as e:  # report, do not hide: a kernel that fails here must not be used
            rows[impl or "default"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    return rows


def bench(device, dtype, seqs, K, B, H, Hkv, D):
    rows = []
    for S in seqs:
        torch.manual_seed(0)
        mk = lambda *s: torch.randn(*s, device=device, dtype=dtype, requires_grad=True)  # noqa: E731
        qs = [mk(B, H, S, D) for _ in range(K)]
        kt, vt = mk(B, Hkv, S, D), mk(B, Hkv, S, D)
        kbs = [mk(B, Hkv, S, 1, D) for _ in range(K - 1)]
        vbs = [mk(B, Hkv, S, 1, D) for _ in range(K - 1)]
        dout = torch.randn(B, H, S, D, device=device, dtype=dtype)

        def ttt():
            outs = []
            for d in range(1, K + 1):
                kb = torch.cat(kbs[: d - 1], 3) if d > 1 else None
                vb = torch.cat(vbs[: d - 1], 3) if d > 1 else None
                outs.append(ttt_attention(qs[d - 1], kt, vt, kb, vb))
            torch.autograd.backward(outs, [dout] * K)

        ks = [mk(B, Hkv, S, D) for _ in range(K)]
        vs = [mk(B, Hkv, S, D) for _ in range(K)]

        def base():
            outs = [F.scaled_dot_product_attention(qs[d], ks[d], vs[d], is_causal=True,
                                                   enable_gqa=Hkv != H) for d in range(K)]
            torch.autograd.backward(outs, [dout] * K)

        t_ttt, t_base = timeit(ttt, device), timeit(base, device)
        # causal fwd+bwd FLOPs: 4*B*H*S^2*D/2 fwd, x2.5 for fwd+bwd (bwd = 2x fwd)
        flops = K * 3.5 * 2 * B * H * S * S * D
        rows.append({"S": S, "K": K, "t_ttt_s": t_ttt, "t_causal_x_K_s": t_base,
                     "ratio": t_ttt / t_base, "ttt_tflops": flops / t_ttt / 1e12,
                     "baseline_tflops": flops / t_base / 1e12})
        print(f"S={S:6d} K={K}  TTT {t_ttt * 1e3:8.2f} ms  {K}x causal {t_base * 1e3:8.2f} ms  "
              f"ratio {t_ttt / t_base:.3f}  ({flops / t_ttt / 1e12:.0f} vs {flops / t_base / 1e12:.0f} TFLOP/s)",
              flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seqs", default="4096,8192,16384")
    ap.add_argument("--K", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--small", action="store_true", help="tiny sizes (CPU smoke run)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    if a.small:
        a.seqs, a.heads, a.kv_heads, a.head_dim = "256,512", 4, 2, 64
    res = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
           "torch": torch.__version__, "dtype": str(dtype), "date": time.strftime("%Y-%m-%d"),
           "command": " ".join(["python"] + sys.argv),
           "kernel_check": check_kernels(a.device, dtype)}
    print(json.dumps(res["kernel_check"], indent=1))
    probe = torch.empty(1, a.heads, 8, a.head_dim, device=a.device, dtype=dtype)
    res["trunk_kernel"] = _pick_impl(probe, None)
    res["branch_kernel"] = "triton" if _use_triton(probe, probe.new_empty(1, a.kv_heads, 8, 1, a.head_dim),
                                                   None) else "torch"
    res["rows"] = bench(a.device, dtype, [int(s) for s in a.seqs.split(",")], a.K, a.batch,
                        a.heads, a.kv_heads, a.head_dim)
    out = Path(a.out or os.environ.get("OUT", "bench/results")) / f"ttt_attention_{a.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print("wrote", out)
    print("\nkernel check max rel err: " + ", ".join(
        f"{k}={v.get('max_rel_err', float('nan')):.1e}" for k, v in res["kernel_check"].items()))
    print(f"{'S':>6} {'K':>2} {'TTT ms':>8} {'Kx causal ms':>12} {'ratio':>6}   "
          f"({res['trunk_kernel']} trunk, {res['branch_kernel']} branch)")
    for r in res["rows"]:
        print(f"{r['S']:>6} {r['K']:>2} {1e3 * r['t_ttt_s']:>8.2f} {1e3 * r['t_causal_x_K_s']:>12.2f} {r['ratio']:>6.3f}")


if __name__ == "__main__":
    main()
