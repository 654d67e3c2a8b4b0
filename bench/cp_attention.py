"""Per-rank throughput of zigzag ring trunk+branch attention, simulated on ONE device.

For one rank r of a cp-way ring over one sequence of S tokens, replay every ring step's block
forward and backward for r's shard sequentially, without communication (the ring's K/V shards are
the other ranks' real zigzag shards of the same sequence): step 0 the local causal block, then cp−1
rectangular blocks, each merged with `merge_lse` into an fp32 accumulator, plus the local TTT
branch (P keys per anchor); backward with the joint (out, lse), dK/dV accumulated per visiting shard.
It uses the same `fwd_step` / `bwd_step` / `step_kind` as the distributed code.

Throughput counts the useful causal FLOPs of a rank's share: fwd 4·H·D·S²/2 / cp (zigzag gives
every rank exactly 1/cp of the causal work), bwd 2.5× fwd. Baselines, also fwd+bwd:
* `sdpa_full`: causal SDPA over all S tokens on one device (cuDNN on CUDA) — what the ring's per-rank
  rate should approach; ring/sdpa_full is the figure of merit (1.0 = no loss from splitting the work).
* `sdpa_local`: causal SDPA over S/cp tokens — a single-device problem of the same token count.
Before timing, the replay is checked against fp64 autograd through the dense reference on the full
sequence (dout only on rank r's rows, so the full dK/dV equal the sum of r's per-step shares): relative
errors of out and every gradient are reported, for the kernels the run selects (adapter default: cuDNN
on CUDA; branch ⊕ merge: the Triton kernels on CUDA). `ring_trunk_ms` times the same replay without the
branch, so ring_ms − ring_trunk_ms is what the branch costs. Timing: CUDA events, median of --iters.

    python bench/cp_attention.py --device cuda --seqs 8192,16384,32768 --cps 2,4,8     # H200, bf16
    python bench/cp_attention.py --device cpu --small                                   # CI check
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import timeit  # noqa: E402
from specco.ops.attention import _use_triton, branch_bwd_into, branch_merge_fwd  # noqa: E402
from specco.ops.sdpa_adapter import _pick_impl, lse_dtype  # noqa: E402
from specco.parallel.ring_attention import add_shares, bwd_step, fwd_step, step_kind  # noqa: E402
from specco.parallel.zigzag import ZigzagLayout  # noqa: E402


class RankReplay:
    """One rank's ring fwd+bwd, with the visiting shards taken from the full sequence (no comm)."""

    def __init__(self, q_full, k_full, v_full, kb_full, vb_full, cp, rank, impl):
        S = q_full.shape[2]
        self.lays = [ZigzagLayout((0, S), cp, r) for r in range(cp)]
        self.lay, self.cp, self.rank, self.impl = self.lays[rank], cp, rank, impl
        sh = lambda x, r: self.lays[r].shard(x, dim=2).contiguous()  # noqa: E731
        self.q = sh(q_full, rank)
        self.kv = [(sh(k_full, r), sh(v_full, r)) for r in range(cp)]  # every rank's trunk shard
        self.kb = sh(kb_full, rank) if kb_full is not None else None
        self.vb = sh(vb_full, rank) if vb_full is not None else None
        self.scale = 1.0 / math.sqrt(q_full.shape[-1])

    def _src(self, step):
        return (self.rank - step) % self.cp

    def forward(self):
        q = self.q
        md = lse_dtype(q)
        out_acc = q.new_empty(q.shape, dtype=md)
        lse_acc = q.new_empty(q.shape[:3], dtype=md)
        for step in range(self.cp):
            k, v = self.kv[self._src(step)]
            fwd_step(step_kind(step, self.rank, self.cp), q, k, v, out_acc, lse_acc, self.lay, self.scale, self.impl)
        if self.kb is not None:  # as RingTTTAttention.forward: branch ⊕ merge ⊕ rounding, one pass
            return branch_merge_fwd(q, self.kb, self.vb, out_acc, lse_acc, self.scale, q.dtype)
        return out_acc.to(q.dtype), lse_acc

    def backward(self, dout, out, lse):
        """As `_ring_bwd`: the first step starts a zeroed fp32 buffer for the own shard; later steps add
        their shares in place into the buffer that arrives with the visiting shard — here a standing fp32
        buffer per source rank (made once; its contents only matter for `_check`, which runs once)."""
        q = self.q
        md = lse_dtype(q)
        dq = torch.zeros(q.shape, dtype=md, device=q.device)
        if not hasattr(self, "arriving"):
            self.arriving = {src: (torch.zeros(k.shape, dtype=md, device=k.device),
                                   torch.zeros(v.shape, dtype=md, device=v.device))
                             for src, (k, v) in enumerate(self.kv) if src != self.rank}
        dkv = {}
        for step in range(self.cp):
            src = self._src(step)
            k, v = self.kv[src]
            shares = bwd_step(step_kind(step, self.rank, self.cp), dout, q, k, v, out, lse, dq, self.lay,
                              self.scale, self.impl)
            if step == 0:
                buf = (torch.zeros(k.shape, dtype=md, device=k.device), torch.zeros(v.shape, dtype=md, device=v.device))
            else:
                buf = self.arriving[src]
            add_shares(buf[0], buf[1], shares)
            dkv[src] = buf
        dkb = dvb = None
        if self.kb is not None:
            dkb, dvb = branch_bwd_into(dout, q, self.kb, self.vb, out, lse, dq, self.scale)
        return dq.to(q.dtype), dkv, dkb, dvb


def _check(replay, q, k, v, kb, vb, H, Hkv):
    """Replay vs fp64 autograd through full-sequence attention with dout only on this rank's rows."""
    from specco.ops.reference import dense_ttt_reference
    leaves = [None if x is None else x.detach().double().requires_grad_() for x in (q, k, v, kb, vb)]
    if kb is None:
        out_ref = F.scaled_dot_product_attention(*leaves[:3], is_causal=True, enable_gqa=H != Hkv)
    else:
        out_ref, _ = dense_ttt_reference(*leaves)
    lay = replay.lay
    g = torch.Generator(device=q.device).manual_seed(3)
    dout_local = torch.randn(replay.q.shape, generator=g, device=q.device, dtype=q.dtype)
    # scatter this rank's dout into the full sequence (zeros on other ranks' rows)
    zeros = [torch.zeros_like(dout_local) for _ in range(replay.cp)]
    zeros[replay.rank] = dout_local
    dout_full = lay.unshard(zeros, dim=2).double()
    grads = torch.autograd.grad(out_ref, [x for x in leaves if x is not None], dout_full)
    out, lse = replay.forward()
    dq, dkv, dkb, dvb = replay.backward(dout_local, out, lse)
    dk_full = lay.unshard([dkv[r][0] for r in range(replay.cp)], dim=2)
    dv_full = lay.unshard([dkv[r][1] for r in range(replay.cp)], dim=2)
    rel = lambda a, b: ((a.double() - b).norm() / b.norm().clamp_min(1e-12)).item()  # noqa: E731
    errs = {"out": rel(out, lay.shard(out_ref.detach(), dim=2)), "dq": rel(dq, lay.shard(grads[0], dim=2)),
            "dk": rel(dk_full, grads[1]), "dv": rel(dv_full, grads[2])}
    if kb is not None:
        errs["dk_branch"] = rel(dkb, lay.shard(grads[3], dim=2))
        errs["dv_branch"] = rel(dvb, lay.shard(grads[4], dim=2))
    return errs


def _graphed_time(fn, dev, iters):
    """Seconds per replay of `fn` captured in one CUDA graph: the same kernels without the host's
    launch cost, i.e. how much of a small-block ring step is launch overhead. None if capture fails."""
    if dev != "cuda":
        return None
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up (lazy inits, autotuning) off the capture
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return timeit(graph.replay, dev, iters, 3)
    except Exception as e:  # report, keep the eager figures
        print(f"CUDA graph capture failed: {type(e).__name__}: {e}", flush=True)
        return None


def make_inputs(S, H, Hkv, D, P, dev, dtype, seed=0):
    """One sequence: q (1, H, S, D), trunk k/v (1, Hkv, S, D), branch k/v (1, Hkv, S, P, D) or None."""
    g = torch.Generator(device=dev).manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, device=dev, dtype=dtype)  # noqa: E731
    q, k, v = mk(1, H, S, D), mk(1, Hkv, S, D), mk(1, Hkv, S, D)
    kb, vb = (mk(1, Hkv, S, P, D), mk(1, Hkv, S, P, D)) if P else (None, None)
    return q, k, v, kb, vb


def _sdpa_fwd_bwd(T, H, D, device, dtype, cudnn):
    q, k, v = (torch.randn(1, H, T, D, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    dout = torch.randn(1, H, T, D, device=device, dtype=dtype)

    def run():
        if cudnn:
            from torch.nn.attention import SDPBackend, sdpa_kernel
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(o, (q, k, v), dout)
    return run


def add_problem_args(ap: argparse.ArgumentParser) -> None:
    """The ring problem's arguments, shared with bench/cp_kernels.py: sizes, ring degrees, heads, branch."""
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seqs", default="8192,16384,32768")
    ap.add_argument("--cps", default="2,4,8")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--branch", type=int, default=2, help="P branch keys per anchor (pass P+1); 0 = trunk only")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_problem_args(ap)
    ap.add_argument("--dtype", default=None, help="default bf16 on cuda, fp32 on cpu")
    ap.add_argument("--impl", default=None, help="force an adapter kernel: flash / cudnn / cpu_flash / torch")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--small", action="store_true", help="tiny sizes (CPU check)")
    ap.add_argument("--graph", action="store_true", help="also time each rank's ring fwd+bwd replayed from one "
                    "CUDA graph (launch overhead removed)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.small:
        a.seqs, a.cps, a.heads, a.kv_heads, a.head_dim, a.iters = "256,512", "2,4", 4, 2, 32, 2
    dev = a.device
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if dev == "cuda" else torch.float32)
    H, Hkv, D, P = a.heads, a.kv_heads, a.head_dim, a.branch
    rows = []
    for S in (int(s) for s in a.seqs.split(",")):
        q, k, v, kb, vb = make_inputs(S, H, Hkv, D, P, dev, dtype)
        fwd_flops_full = 4 * H * D * S * S / 2
        t_full = timeit(_sdpa_fwd_bwd(S, H, D, dev, dtype, dev == "cuda"), dev, a.iters, 3)
        for cp in (int(c) for c in a.cps.split(",")):
            if S % (2 * cp):
                continue
            for rank in sorted({0, cp - 1}):  # rank 0: all "back" steps; rank cp-1: all "front" steps
                errs = None
                if S == min(int(s) for s in a.seqs.split(",")):
                    # correctness at <= 2048 tokens: the dense reference materialises S·(1+P)·S scores
                    Sc = min(S, 2048)
                    ins = [None if x is None else x[:, :, :Sc] for x in (q, k, v, kb, vb)]
                    errs = _check(RankReplay(*ins, cp, rank, a.impl), *ins, H, Hkv)
                rep = RankReplay(q, k, v, kb, vb, cp, rank, a.impl)
                dout = torch.randn_like(rep.q)

                def ring(rep=rep):
                    out, lse = rep.forward()
                    rep.backward(dout, out, lse)
                t_ring = timeit(ring, dev, a.iters, 3)
                t_graph = _graphed_time(ring, dev, a.iters) if a.graph else None
                t_trunk = t_ring
                if P:  # the same replay without the branch
                    t_trunk = timeit(functools.partial(ring, RankReplay(q, k, v, None, None, cp, rank, a.impl)),
                                     dev, a.iters, 3)
                t_local = timeit(_sdpa_fwd_bwd(S // cp, H, D, dev, dtype, dev == "cuda"), dev, a.iters, 3)
                flops_rank = 3.5 * fwd_flops_full / cp
                row = {"S": S, "cp": cp, "rank": rank, "H": H, "Hkv": Hkv, "D": D, "P": P, "dtype": str(dtype),
                       "ring_ms": 1e3 * t_ring, "ring_tflops": flops_rank / t_ring / 1e12,
                       "ring_trunk_ms": 1e3 * t_trunk, "ring_trunk_tflops": flops_rank / t_trunk / 1e12,
                       "sdpa_full_tflops": 3.5 * fwd_flops_full / t_full / 1e12,
                       "sdpa_local_tflops": 3.5 * 4 * H * D * (S // cp) ** 2 / 2 / t_local / 1e12,
                       "check_rel_err": errs}
                row["ring_vs_sdpa_full"] = row["ring_tflops"] / row["sdpa_full_tflops"]
                if t_graph:
                    row["ring_graph_ms"] = 1e3 * t_graph
                    row["ring_graph_tflops"] = flops_rank / t_graph / 1e12
                    row["ring_graph_vs_sdpa_full"] = row["ring_graph_tflops"] / row["sdpa_full_tflops"]
                rows.append(row)
                print(f"S={S:>6} cp={cp} rank={rank}: ring {row['ring_tflops']:.4g} TFLOP/s "
                      f"({row['ring_ms']:.1f} ms; trunk only {row['ring_trunk_ms']:.1f} ms), "
                      f"sdpa full {row['sdpa_full_tflops']:.4g}, "
                      f"sdpa S/cp {row['sdpa_local_tflops']:.4g}, ratio {row['ring_vs_sdpa_full']:.2f}"
                      + (f", graphed {row['ring_graph_tflops']:.4g} ({row['ring_graph_vs_sdpa_full']:.2f})"
                         if t_graph else "")
                      + (f", max rel err {max(errs.values()):.1e}" if errs else ""), flush=True)
    out = Path(a.out or os.environ.get("OUT", "bench/results")) / f"cp_attention_{dev}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    probe = torch.empty(1, H, 8, D, device=dev, dtype=dtype)
    meta = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"), "command": " ".join(["python"] + sys.argv),
            "trunk_kernel": a.impl or _pick_impl(probe, None),
            "branch_kernel": ("triton" if _use_triton(probe, probe.new_empty(1, Hkv, 8, max(P, 1), D), None)
                              else "torch") if P else None}
    out.write_text(json.dumps({**meta, "args": vars(a), "rows": rows}, indent=1))
    print(f"wrote {out}")
    print(f"\n{'S':>6} {'cp':>3} {'rank':>4} {'ring TF/s':>10} {'trunk TF/s':>10} {'cuDNN TF/s':>10} {'ratio':>6}"
          f" {'err':>8}   ({meta['trunk_kernel']} trunk, {meta['branch_kernel']} branch, {meta['device']})")
    for r in rows:
        e = max(r["check_rel_err"].values()) if r["check_rel_err"] else float("nan")
        print(f"{r['S']:>6} {r['cp']:>3} {r['rank']:>4} {r['ring_tflops']:>10.1f} {r['ring_trunk_tflops']:>10.1f} "
              f"{r['sdpa_full_tflops']:>10.1f} {r['ring_vs_sdpa_full']:>6.2f} {e:>8.1e}")


if __name__ == "__main__":
    main()
