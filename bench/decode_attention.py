"""Where a verify step's time goes at long context, and the decode-attention kernel's launch shapes.

Qwen2.5-0.5B shapes (H 14, Hkv 2, D 64, 24 layers), bf16, random weights and a random-filled cache
(never zeros: METHOD.md). Three parts, each printed as a table and saved to one JSON:

  * sweep: one step's attention (24 layers' `decode_attention`, each over its own layer cache so nothing
    is served from L2) at KV position × batch × T new tokens per row, for every launch shape of the grid
    (block_n × num_warps × num_stages × waves), and for `--old FILE` (another revision's
    ops/decode_attention.py) — captured in one CUDA graph per variant, median of replays. Each variant's
    output is checked against the old kernel's (or the twin's) at the first layer. Read floor = the
    live cache bytes / the measured copy bandwidth.
  * profile: the policy's cached forward at T = 1 (plain step) and T = k+1 (verify), graphed and timed,
    and its kernels' device time grouped by name (torch.profiler over an eager call: the same kernels).
  * tail: the verify's vocabulary-sized sampling/acceptance work (processed log-probs of (B, k+1, V),
    the acceptance rule, the residual draw) against the plain step's fused sampling of (B, V).

    python bench/decode_attention.py --old /tmp/main_decode_attention.py --sweep --profile --tail
"""
from __future__ import annotations

import argparse
import importlib.util
import itertools
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from specco.ops import decode_attention as da  # noqa: E402
from _results import write_results  # noqa: E402
from anchor import copy_bandwidth  # noqa: E402

H, HKV, D, LAYERS = 14, 2, 64, 24


def load_old(path: str):
    """Another revision's ops/decode_attention.py as a module (its relative import made absolute; Triton
    reads a kernel's source from its file, so the patched copy is written to disk)."""
    src = Path(path).read_text().replace("from .attention import", "from specco.ops.attention import")
    f = Path(tempfile.mkdtemp()) / "old_decode_attention.py"
    f.write_text(src)
    spec = importlib.util.spec_from_file_location("old_decode_attention", f)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def graph_ms(fn, iters=30):
    """Median ms of a CUDA-graph replay of fn (warmed up on a side stream first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


def sweep(args, old, bw):
    rows = []
    grid = [da.KernelConfig(bn, w, st, wv) for bn, w, st, wv in itertools.product(
        args.block_n, args.warps, args.stages, args.waves)]
    for kv, B in itertools.product(args.kv, args.batch):
        S = kv + 128  # the engine's cache: prompt + the new tokens, a little past the timed position
        k_cache = torch.randn(LAYERS, B, HKV, S, D, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        for T in args.T:
            q = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16)
            pos = (kv + torch.arange(T, device="cuda")).expand(B, T).contiguous()
            floor = B * LAYERS * 2 * HKV * (kv + T) * D * 2 / bw * 1e3
            ref = (old.decode_attention if old else da.decode_attention_reference)(q, k_cache[0], v_cache[0], pos)
            variants = ([("old", lambda l, q=q, pos=pos: old.decode_attention(q, k_cache[l], v_cache[l], pos))]
                        if old else [])
            variants += [(f"bn{c.block_n}_w{c.num_warps}_s{c.num_stages}_x{c.waves}",
                          lambda l, q=q, pos=pos, c=c: da.decode_attention(q, k_cache[l], v_cache[l], pos, config=c))
                         for c in grid]
            res = {}
            for name, f in variants:
                try:
                    err = (f(0).float() - ref.float()).abs().max().item()
                    res[name] = (graph_ms(lambda: [f(l) for l in range(LAYERS)]), err)
                except Exception as e:  # a shape Triton cannot compile (e.g. out of shared memory): skip it
                    print(f"  {name}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            best = min((v for k, v in res.items() if k != "old"), key=lambda v: v[0])
            best_name = next(k for k, v in res.items() if v is best)
            dflt = da.kernel_config(14 // HKV * T, torch.bfloat16)
            dname = f"bn{dflt.block_n}_w{dflt.num_warps}_s{dflt.num_stages}_x{dflt.waves}"
            row = dict(kv=kv, B=B, T=T, floor_ms=floor, best=best_name, best_ms=best[0],
                       default=dname, default_ms=res.get(dname, (float("nan"),))[0],
                       old_ms=res["old"][0] if "old" in res else None,
                       max_err=max(v[1] for v in res.values()), all={k: v[0] for k, v in res.items()})
            rows.append(row)
            print(f"KV {kv:6d} B {B:3d} T {T}: floor {floor:6.3f}  old {row['old_ms'] or 0:6.3f}  default "
                  f"{row['default_ms']:6.3f}  best {best[0]:6.3f} ({best_name})  max|err| {row['max_err']:.2e}",
                  flush=True)
        k_cache = v_cache = None  # freed (not `del`: the lambdas above read them; pyflakes flags a del)
        torch.cuda.empty_cache()
    return rows


def build_policy():
    from rollout import MODELS
    from specco.model.config import PolicyConfig
    from specco.model.policy import Policy
    torch.manual_seed(0)
    with torch.device("cuda"):
        policy = Policy(PolicyConfig(**MODELS["0.5b"]))
    return policy.to(torch.bfloat16).eval()


@torch.no_grad()
def profile(args, old):
    from torch.profiler import ProfilerActivity, profile as torch_profile
    from specco.rollout import forward as fwd
    policy = build_policy()
    aux = (1, 11, 20)  # EAGLE-3's taps of a 24-layer policy: the verify returns them
    out = []
    kernels = {"new": da.decode_attention} | ({"old": old.decode_attention} if old else {})
    for kv, B in itertools.product(args.kv, args.batch):
        S = kv + 128
        cache = policy.new_cache(B, S)
        cache.k.normal_()
        cache.v.normal_()
        rope = fwd.RopeTable.build(policy.cfg.head_dim, policy.cfg.rope_theta, S, "cuda", torch.bfloat16,
                                   scaling=policy.cfg.rope_scaling)
        for name, kern in kernels.items():
            fwd.decode_attention = kern
            for T in args.T:
                tok = torch.randint(0, 1000, (B, T), device="cuda")
                pos = (kv + torch.arange(T, device="cuda")).expand(B, T).contiguous()
                taps = aux if T > 1 else None
                fn = lambda: fwd.policy_forward(policy, tok, pos, cache, rope, tap_layers=taps)  # noqa: E731
                ms = graph_ms(fn)
                with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                    fn()
                    torch.cuda.synchronize()
                by = {}
                for e in prof.events():
                    if e.device_type == torch.autograd.DeviceType.CUDA:
                        key = e.name[:60]
                        by[key] = by.get(key, 0.0) + e.device_time_total / 1e3
                top = sorted(by.items(), key=lambda kv_: -kv_[1])[:8]
                out.append(dict(kv=kv, B=B, T=T, kernel=name, forward_ms=ms, kernels_ms=dict(top),
                                kernel_sum_ms=sum(by.values())))
                print(f"forward KV {kv} B {B} T {T} [{name}]: {ms:.3f} ms graphed; device sum "
                      f"{sum(by.values()):.3f}: " + "; ".join(f"{k[:40]} {v:.3f}" for k, v in top[:5]), flush=True)
        fwd.decode_attention = da.decode_attention
        cache = None  # freed (not `del`: fn above reads it; pyflakes flags a del)
        torch.cuda.empty_cache()
    return out


@torch.no_grad()
def tail(args):
    """The verify's sampling/acceptance chain (speculative.py's T > 0 branch) vs the plain fused draw."""
    from specco.rollout import acceptance
    from specco.rollout.sampling import SamplingParams, pick_tokens_logp, processed_logprobs
    V, k, params = 151936, 4, SamplingParams(temperature=1.0)
    out = []
    for B in args.batch:
        logits = torch.randn(B, k + 1, V, device="cuda", dtype=torch.bfloat16) * 3
        q = torch.softmax(torch.randn(B, k, V, device="cuda") * 3, -1)
        dtok = torch.randint(0, V, (B, k), device="cuda")
        u = torch.rand(B, 2 * k + 1, device="cuda")

        def verify_tail():
            logp = processed_logprobs(logits, params)
            v = acceptance.verify_sampling(logp.exp(), q, dtok, u[:, k:2 * k], u[:, 2 * k])
            return logp.gather(-1, v.tokens[..., None]), v

        def fused_tail():
            return acceptance.verify_sampling_logits(logits, 1.0, q, dtok, u[:, k:2 * k], u[:, 2 * k])

        plain = graph_ms(lambda: pick_tokens_logp(logits[:, 0], params, u[:, 0]))
        ver, fused = graph_ms(verify_tail), graph_ms(fused_tail)
        agree = (fused_tail()[0].num_accepted == verify_tail()[1].num_accepted).float().mean().item()
        out.append(dict(B=B, verify_tail_ms=ver, fused_verify_tail_ms=fused, plain_sample_ms=plain,
                        accepted_agree=agree))
        print(f"tail B {B}: verify sampling/acceptance {ver:.3f} ms, fused {fused:.3f} ms (a agrees on {agree:.0%}), "
              f"plain fused sampling {plain:.3f} ms", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ap.add_argument("--old", default=None, help="another revision's ops/decode_attention.py")
    ap.add_argument("--kv", type=ints, default=[1024, 8192, 30000])
    ap.add_argument("--batch", type=ints, default=[8, 32])
    ap.add_argument("--T", type=ints, default=[1, 5, 8])
    ap.add_argument("--block-n", type=ints, default=[64])
    ap.add_argument("--warps", type=ints, default=[4, 8])
    ap.add_argument("--stages", type=ints, default=[3])
    ap.add_argument("--waves", type=ints, default=[4])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--tail", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    old = load_old(args.old) if args.old else None
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    res = {"copy_bandwidth_TBps": bw / 1e12, "args": {k: v for k, v in vars(args).items()}}
    if args.sweep:
        res["sweep"] = sweep(args, old, bw)
    if args.profile:
        res["profile"] = profile(args, old)
    if args.tail:
        res["tail"] = tail(args)
    write_results(res, "decode_attention", torch.device("cuda"), args.out)


if __name__ == "__main__":
    main()
