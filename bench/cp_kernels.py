"""Where a ring step's time goes on the GPU, and what the adapter's kernel options save.

Three parts, one call (H200: about three minutes):

1. **check** — every CUDA block kernel of `specco/ops/sdpa_adapter.py` (cuDNN, flash) with native GQA
   on/off and strided row-slice inputs on/off, forward and joint-statistics backward, causal square
   and rectangular non-causal blocks, against the fp64 torch kernel on fresh random inputs:
   ‖x − ref‖/‖ref‖ for out, lse, dq, dk, dv (bf16 operands: expect 1e-3…1e-2). A variant that raises
   is reported, not fatal.
2. **variants** — one rank's ring fwd+bwd (bench/cp_attention.py's replay, graphed and eager) for
   each combination of the adapter sets NATIVE_GQA and STRIDED_OK, as TFLOP/s and as a ratio to cuDNN
   causal SDPA over all S tokens (the issue's figure of merit).
3. **profile** — the same replay under torch.profiler: device time per iteration by kernel, grouped
   into attention kernels, the branch (Triton), and everything else (copies, merges, accumulations).

    python bench/cp_kernels.py --device cuda                      # all three parts
    python bench/cp_kernels.py --device cuda --parts profile --seqs 8192 --cps 8
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import timeit  # noqa: E402
from cp_attention import RankReplay, _graphed_time, _sdpa_fwd_bwd, add_problem_args, make_inputs  # noqa: E402
from specco.ops import sdpa_adapter as ad  # noqa: E402
from specco.parallel import ring_attention  # noqa: E402

_CUDA = {"cudnn", "flash"}
# name -> (adapter NATIVE_GQA, adapter STRIDED_OK, ring merge impl)
VARIANTS = {"repeat+copy": (set(), set(), "torch"), "native_gqa": (_CUDA, set(), "torch"),
            "native_gqa+strided": (_CUDA, _CUDA, "torch"), "all (+fused merge)": (_CUDA, _CUDA, None)}


def _set_variant(name):
    gqa, strided, merge = VARIANTS[name]
    ad.NATIVE_GQA.clear()
    ad.NATIVE_GQA.update(gqa)
    ad.STRIDED_OK.clear()
    ad.STRIDED_OK.update(strided)
    ring_attention.MERGE_IMPL = merge


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def check(dev, H, Hkv, D, dtype):
    """Part 1. Inputs are row slices of larger (B, H, T, D) tensors, as a ring step's blocks are."""
    rows = []
    g = torch.Generator(device=dev).manual_seed(11)
    for impl, idt in (("cudnn", dtype), ("flash", dtype), ("efficient", torch.float32)):
        for name in (VARIANTS if impl != "efficient" else ["repeat+copy"]):  # efficient: no native GQA
            _set_variant(name)
            for causal, Sq, Sk in ((True, 384, 384), (False, 256, 512), (False, 512, 256)):
                mk = lambda h, s: torch.randn(2, h, 2 * s, D, generator=g, device=dev, dtype=idt)  # noqa: E731
                q, dout = mk(H, Sq)[:, :, Sq:], mk(H, Sq)[:, :, :Sq]      # (2, H, Sq, D) strided views
                k, v = mk(Hkv, Sk)[:, :, Sk:], mk(Hkv, Sk)[:, :, :Sk]     # (2, Hkv, Sk, D)
                row = {"impl": impl, "variant": name, "causal": causal, "Sq": Sq, "Sk": Sk}
                try:
                    out, lse = ad.block_attn_fwd(q, k, v, causal, impl=impl)
                    o64, l64 = ad.block_attn_fwd(q.double(), k.double(), v.double(), causal, impl="torch")
                    grads = ad.block_attn_bwd(dout, q, k, v, out, lse, causal, impl=impl, grad_dtype=torch.float32)
                    # the reference backward uses the kernel's own (out, lse): it checks the backward alone
                    refs = ad.block_attn_bwd(dout.double(), q.double(), k.double(), v.double(), out.double(),
                                             lse.double(), causal, impl="torch")
                    row.update(out=_rel(out, o64), lse=_rel(lse, l64),
                               **{n: _rel(x, r) for n, x, r in zip(("dq", "dk", "dv"), grads, refs)})
                    row["finite"] = all(bool(torch.isfinite(x).all()) for x in (out, lse, *grads))
                except Exception as e:  # noqa: BLE001 - reported: this part asks *whether* a variant runs
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                rows.append(row)
                errs = {k_: v_ for k_, v_ in row.items() if k_ in ("out", "lse", "dq", "dk", "dv")}
                print(f"check {impl:5} {name:18} causal={causal!s:5} {Sq}x{Sk}: "
                      + (row.get("error") or " ".join(f"{k_} {v_:.1e}" for k_, v_ in errs.items())), flush=True)
    # fp32 on CUDA: the efficient kernel must not materialise the scores (torch's kernel would: 32 GiB here)
    S = 16384
    q, k, v = (torch.randn(1, H if i == 0 else Hkv, S, D, generator=g, device=dev) for i in range(3))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out, lse = ad.block_attn_fwd(q, k, v, True)
    ad.block_attn_bwd(torch.randn_like(out), q, k, v, out, lse, True)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    rows.append({"impl": "efficient_memory", "S": S, "picked": ad._pick_impl(q, None), "peak_gib_above_inputs": peak})
    print(f"check fp32 causal S={S}: impl {ad._pick_impl(q, None)}, peak {peak:.2f} GiB above the inputs", flush=True)
    del q, k, v, out, lse
    # the fused in-place merge (Triton) on a row view of an fp32 accumulator, some rows with an empty part B
    from specco.ops.attention import merge_lse
    for S in (1000, 4096):
        oa = torch.randn(2, H, S + 8, D, generator=g, device=dev)
        la = torch.randn(2, H, S + 8, generator=g, device=dev)
        ob = torch.randn(2, H, S, D, generator=g, device=dev).to(dtype)
        lb = torch.randn(2, H, S, generator=g, device=dev)
        lb[:, :, :7] = float("-inf")
        ref_o, ref_l = merge_lse(oa[:, :, 8:].double(), la[:, :, 8:].double(), ob.double(), lb.double())
        merge_lse(oa[:, :, 8:], la[:, :, 8:], ob, lb, inplace=True, impl="triton")
        row = {"impl": "triton_merge", "S": S, "out": _rel(oa[:, :, 8:], ref_o), "lse": _rel(la[:, :, 8:], ref_l)}
        rows.append(row)
        print(f"check triton merge S={S}: out {row['out']:.1e} lse {row['lse']:.1e}", flush=True)
    return rows


def variants(dev, seqs, cps, H, Hkv, D, P, dtype, iters):
    """Part 2."""
    rows = []
    for S in seqs:
        q, k, v, kb, vb = make_inputs(S, H, Hkv, D, P, dev, dtype)
        t_full = timeit(_sdpa_fwd_bwd(S, H, D, dev, dtype, True), dev, iters, 3)
        flops_full = 3.5 * 4 * H * D * S * S / 2
        for cp in cps:
            for rank in sorted({0, cp - 1}):
                rep = RankReplay(q, k, v, kb, vb, cp, rank, None)
                dout = torch.randn_like(rep.q)

                def ring(rep=rep, dout=dout):
                    out, lse = rep.forward()
                    rep.backward(dout, out, lse)
                for name in VARIANTS:
                    _set_variant(name)
                    t_eager = timeit(ring, dev, iters, 3)
                    t_graph = _graphed_time(ring, dev, iters)
                    r = {"S": S, "cp": cp, "rank": rank, "variant": name, "eager_ms": 1e3 * t_eager,
                         "graph_ms": 1e3 * t_graph if t_graph else None,
                         "eager_ratio": (flops_full / cp / t_eager) / (flops_full / t_full),
                         "graph_ratio": (flops_full / cp / t_graph) / (flops_full / t_full) if t_graph else None,
                         "sdpa_full_tflops": flops_full / t_full / 1e12}
                    rows.append(r)
                    print(f"S={S} cp={cp} rank={rank} {name:18}: eager {r['eager_ms']:.3f} ms "
                          f"({r['eager_ratio']:.2f}), graphed {r['graph_ms'] or float('nan'):.3f} ms "
                          f"({r['graph_ratio'] or float('nan'):.2f})", flush=True)
                del rep
    return rows


def _category(name):
    n = name.lower()
    if "triton" in n or "_branch" in n:
        return "branch (triton)"
    if any(t in n for t in ("cudnn", "fmha", "flash", "sm90", "xmma", "cutlass", "attn", "gemm")):
        return "attention kernels"
    return "other (copies, merges, accumulation)"


def profile(dev, seqs, cps, H, Hkv, D, P, dtype, variant, reps=5):
    """Part 3: device time per replay by kernel and by category."""
    from torch.profiler import ProfilerActivity, profile as tprofile
    _set_variant(variant)
    out = []
    for S in seqs:
        q, k, v, kb, vb = make_inputs(S, H, Hkv, D, P, dev, dtype)
        for cp in cps:
            rep = RankReplay(q, k, v, kb, vb, cp, cp - 1, None)
            dout = torch.randn_like(rep.q)

            def ring():
                o, lse = rep.forward()
                rep.backward(dout, o, lse)
            for _ in range(3):
                ring()
            torch.cuda.synchronize()
            with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(reps):
                    ring()
                torch.cuda.synchronize()
            per_kernel = defaultdict(lambda: [0.0, 0])
            for ev in prof.events():
                if ev.device_type == torch.autograd.DeviceType.CUDA:
                    per_kernel[ev.name][0] += ev.device_time_total / reps  # microseconds
                    per_kernel[ev.name][1] += 1
            cats = defaultdict(float)
            for name, (us, _) in per_kernel.items():
                cats[_category(name)] += us
            top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:14]
            rec = {"S": S, "cp": cp, "rank": cp - 1, "variant": variant,
                   "device_us_per_replay": sum(cats.values()), "by_category_us": dict(cats),
                   "launches_per_replay": sum(c for _, c in per_kernel.values()) / reps,
                   "top_kernels": [{"name": n[:120], "us": us, "calls": c / reps} for n, (us, c) in top]}
            out.append(rec)
            print(f"\nprofile S={S} cp={cp} rank={cp - 1} ({variant}): {rec['device_us_per_replay']:.0f} us of "
                  f"kernels, {rec['launches_per_replay']:.0f} launches per replay", flush=True)
            for c, us in sorted(cats.items(), key=lambda kv: -kv[1]):
                print(f"   {us:9.1f} us  {c}")
            for t in rec["top_kernels"]:
                print(f"   {t['us']:9.1f} us  x{t['calls']:<5.0f} {t['name'][:90]}")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_problem_args(ap)
    ap.add_argument("--parts", default="check,variants,profile")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--profile-variant", default="all (+fused merge)", choices=sorted(VARIANTS))
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.device != "cuda" or not torch.cuda.is_available():
        sys.exit("bench/cp_kernels.py measures the CUDA kernels: run it on a GPU (--device cuda)")
    dtype = torch.bfloat16
    seqs = [int(s) for s in a.seqs.split(",")]
    cps = [int(c) for c in a.cps.split(",")]
    parts = a.parts.split(",")
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
           "command": " ".join(["python"] + sys.argv), "args": vars(a)}
    if "check" in parts:
        res["check"] = check(a.device, a.heads, a.kv_heads, a.head_dim, dtype)
    if "variants" in parts:
        res["variants"] = variants(a.device, seqs, cps, a.heads, a.kv_heads, a.head_dim, a.branch, dtype, a.iters)
    if "profile" in parts:
        res["profile"] = profile(a.device, seqs[:2], cps, a.heads, a.kv_heads, a.head_dim, a.branch, dtype,
                                 a.profile_variant)
    out = Path(a.out or os.environ.get("OUT", "bench/results")) / "cp_kernels_cuda.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")
    if "variants" in res:
        print(f"\n{'S':>6} {'cp':>3} {'rank':>4} " + " ".join(f"{n:>20}" for n in VARIANTS) + "   (graphed ratio)")
        keys = sorted({(r["S"], r["cp"], r["rank"]) for r in res["variants"]})
        for key in keys:
            by = {r["variant"]: r for r in res["variants"] if (r["S"], r["cp"], r["rank"]) == key}
            print(f"{key[0]:>6} {key[1]:>3} {key[2]:>4} " + " ".join(
                f"{(by[n]['graph_ratio'] or float('nan')):>9.2f} ({by[n]['eager_ratio']:.2f} e)" for n in VARIANTS))


if __name__ == "__main__":
    main()
