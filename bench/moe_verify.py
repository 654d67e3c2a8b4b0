"""What a verify of k+1 tokens per row costs on a mixture-of-experts target, against a plain decode step, and the
same for its dense twin of equal active parameters (issue 38, items 3-4).

A plain decode step routes B tokens, so each MoE layer reads at most B·top_k of its E experts; a verify of k+1
tokens per row routes B·(k+1) of them (rollout/forward.py), so the experts it reads grow with k until all E are
read. A dense MLP reads the same weights whatever the number of tokens. So verify / step, which is close to 1 for a
small dense model at small B (the step is a weight read), can be far above 1 for a MoE target: this bench measures
by how much, and whether the experts read explain it.

The two models (random weights, built here):
  * MoE: Qwen3-MoE shapes (qk-norm, norm_topk_prob, untied head), every layer sparse: E experts of width I,
    top_k per token;
  * the dense twin: the same config with num_experts = 0 and intermediate_size = top_k·I, model_type qwen3 (the
    same attention). Equal active parameters per token, the router aside:

        active = total − Σ_MoE layers [(E − top_k)·3·h·I + h·E]      (MoE: the experts a token skips, the router)
        active = total                                               (dense twin)
        equal, since top_k·3·h·I = 3·h·(top_k·I); the router's h·E per layer is reported apart.

Per batch size B (`--batches`) at KV position `--kv` (each row has a prefilled prefix of that length), for both
models: a plain step (1 token per row) and a verify of k+1 tokens per row for each k in `--ks`, all on the engine's
own decode forward (`rollout.forward.policy_forward`, logits included), CUDA-graphed on CUDA as
bench/rollout.py's `graph_floor` captures it (the MoE experts then take the grouped GEMM: bf16, a Hopper GPU;
an fp32 copy would take `Experts.every`, every expert on every row, which is not what this bench measures, so
on CUDA it checks the grouped GEMM applies); on CPU eager fp32, a smoke whose timings mean nothing.
The verify's first token per row is the plain step's token (the last accepted token a real verify starts from),
so the verify's routed set contains the step's. The measurements of one B are interleaved over `--rounds`
rounds (A B A B ..., each `--iters` back-to-back calls; the median round reported).

On CUDA each plain step is also timed against bench/anchor.py's independent plain-PyTorch decoder of the same
config (`--anchor`): the MoE's experts there in each of three ways a user might write them (grouped GEMM, every
expert, per-token gathered experts), the best the baseline; `step_over_anchor` is the engine's step over it.

Reported per measurement:
  * t_ms, and verify / step for the MoE and for the dense twin (the number issue 38 asks to explain);
  * experts touched: the mean over MoE layers of the distinct experts the n = B·T routed tokens chose, read from
    the router on the very inputs timed (forward hooks on an eager forward), beside the uniform-routing
    expectation E·(1 − (1 − top_k/E)^n) (exact for independent uniform top_k-subsets). Random routing is close to
    uniform here (the two agree within a few %: check the table), so a trained router, whose consecutive tokens
    of a row may share experts, may touch fewer, and a real target's verify then costs less than here. That
    takes the embedding at std `--embed-std` 1.0 rather than the init's 0.02: at 0.02 every token's residual
    stream is dominated by what it shares with its row (attention over the same prefix), so a row's k+1 tokens
    route alike and past layer 0 touch far fewer experts than uniform (hidden 1024, 16 layers, B = 1, k = 7:
    4.1 of the 10.5 uniform ones, measured on CPU) — an artifact of random weights, not a property of MoE
    targets. Shapes and kernels are the same at either std, so the timing of a given routing is unaffected;
  * the read floor: bytes of the weights the forward must read — attention, norms, the head, and the dense MLP
    or the router plus only the experts touched (per layer, the measured count × one expert's bytes) — plus the
    live KV bytes (B·L·2·Hkv·D·(kv + T)), over a copy bandwidth measured in the same run (bench/anchor.py's on
    CUDA, a host copy on CPU); t / floor says how far the measured time is from it. The embedding rows are
    gathered (B·T·h), not read whole, and left out. Also the matmul FLOPs and, on CUDA, FLOPs / 700 TFLOP/s
    (bench/rollout.py's bf16 figure): where that floor is above the read floor, the forward is compute-bound.

Writes `moe_verify_cuda.json` (or `_cpu`) under bench/results (bench/_results.py; `--out` to change) and prints a
markdown table.

Under torchrun at world N (issue 39: the MoE engine's verify cost at rollout tp N) both models are replaced by this
rank's engine shard over the N ranks (rollout/tp.tp_shard: heads, every expert's SwiGLU width, the dense twin's MLP
and the vocabulary cut N ways; the all-reduces inside the captured graphs), so every figure is one rank's: its
parameter counts and read floor are its shard's (1/N of each expert's bytes, the router whole), the experts touched
the same as at tp 1 (the router is not cut). Rank 0 writes the JSON (`tp` in it); the ranks time in lock-step.

    python bench/moe_verify.py --device cuda [--anchor compiled]
    torchrun --nproc-per-node 2 bench/moe_verify.py --device cuda --out $OUT/moe_verify_tp2.json
    python bench/moe_verify.py --device cpu --hidden 64 --layers 2 --experts 8 --moe-inter 32 --heads 4 \
        --kv-heads 2 --vocab 256 --batches 1,4 --kv 16 --ks 1,3 --rounds 1 --iters 2
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from _results import write_results  # noqa: E402
from _timing import capture  # noqa: E402
from rollout import timed  # noqa: E402
from specco.model.config import PolicyConfig  # noqa: E402
from specco.model.moe import SparseMoE, route  # noqa: E402
from specco.model.policy import Policy  # noqa: E402
from specco.rollout.forward import RopeTable, policy_forward  # noqa: E402

PEAK_FLOPS = 700e12  # dense bf16 matmul, sustained on the H200 (bench/rollout.py's `floors`)


def configs(a) -> tuple[PolicyConfig, PolicyConfig]:
    """The MoE config and its dense twin (module docstring): the twin is the same dataclass with the expert fields
    cleared and intermediate_size = top_k·I (already the MoE config's, where no layer uses it)."""
    moe = PolicyConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.top_k * a.moe_inter,
                       num_layers=a.layers, num_heads=a.heads, num_kv_heads=a.kv_heads, model_type="qwen3_moe",
                       qk_norm=True, norm_topk_prob=True, num_experts=a.experts, num_experts_per_tok=a.top_k,
                       moe_intermediate_size=a.moe_inter, max_position_embeddings=max(4096, a.kv + max(a.ks) + 16))
    dense = dataclasses.replace(moe, model_type="qwen3", num_experts=0, num_experts_per_tok=0,
                                moe_intermediate_size=0, norm_topk_prob=False)
    return moe, dense


def param_counts(policy: Policy) -> dict:
    """Parameter counts by part, from the real parameters (tied ones once). `expert_each` is per MoE layer: one
    expert's parameters (gate, up, down rows: 3·h·I). `active` is the module docstring's formula."""
    out = dict(embed=0, head=0, attention_norms=0, mlp_dense=0, experts=0, router=0)
    expert_each = []
    for layer in policy.layers.values():
        if isinstance(layer.mlp, SparseMoE):
            e = layer.mlp.experts
            expert_each.append((e.gate_up_proj.numel() + e.down_proj.numel()) // e.num_experts)
    for name, p in policy.named_parameters():  # a tied head is the embedding, listed once
        if name.startswith("embed_tokens"):
            part = "embed"
        elif name.startswith("lm_head"):
            part = "head"
        elif ".mlp.experts." in name:
            part = "experts"
        elif ".mlp.gate." in name:
            part = "router"
        elif ".mlp." in name:
            part = "mlp_dense"
        else:  # self_attn (qkv, o, q/k norms), the layer norms, the final norm
            part = "attention_norms"
        out[part] += p.numel()
    out["total"] = sum(out.values())
    top_k = policy.cfg.num_experts_per_tok
    out["active"] = out["total"] - out["router"] - sum((policy.cfg.num_experts - top_k) * n for n in expert_each)
    out["expert_each"] = expert_each
    # the weight matrices one token multiplies: every 2-D+ parameter but the gathered embedding (the head when tied),
    # the experts at top_k / E of theirs (a token passes top_k of the E), the router whole
    out["matmul_active"] = sum(
        p.numel() * top_k // policy.cfg.num_experts if ".mlp.experts." in n else p.numel()
        for n, p in policy.named_parameters()  # tied parameters once (named_parameters dedupes)
        if p.dim() >= 2 and (policy.cfg.tie_word_embeddings or not n.startswith("embed_tokens")))
    out["tied"] = policy.cfg.tie_word_embeddings
    return out


def read_bytes(counts: dict, touched: list[int] | None, el: int) -> int:
    """Bytes of the weights one forward reads: attention and norms, the head (the embedding when tied: it is the
    head then), and the dense MLP or the router plus `touched[l]` experts of MoE layer l. The untied embedding is
    gathered (B·T rows), not read, and left out."""
    n = counts["attention_norms"] + (counts["embed"] if counts["tied"] else counts["head"]) + counts["mlp_dense"]
    if touched is not None:
        n += counts["router"] + sum(t * each for t, each in zip(touched, counts["expert_each"]))
    return n * el


def kv_bytes(cfg: PolicyConfig, batch: int, kv: int, tokens: int, el: int) -> int:
    """Live K and V read by one forward: every layer's keys and values at positions < kv + tokens, per row."""
    return batch * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * (kv + tokens) * el


def matmul_flops(cfg: PolicyConfig, counts: dict, batch: int, kv: int, tokens: int) -> int:
    """2·(matmul parameters a token passes through: `matmul_active`)·(B·T) + attention's 4·B·T·L·H·D·(kv + T) (QKᵀ
    and PV; an upper bound, a verify's causal keys are fewer)."""
    attn = 4 * batch * tokens * cfg.num_layers * cfg.num_heads * cfg.head_dim * (kv + tokens)
    return 2 * counts["matmul_active"] * batch * tokens + attn


def uniform_touched(E: int, top_k: int, n: int) -> float:
    """Expected distinct experts among n tokens, each choosing a uniform random top_k-subset of E:
    an expert is missed by one token with probability 1 − top_k/E, by all n with (1 − top_k/E)^n."""
    return E * (1 - (1 - top_k / E) ** n)


def copy_bandwidth(device: str) -> float:
    """Copy bandwidth, bytes read + written per second: bench/anchor.py's on CUDA (2 GiB), a 128 MiB host copy on
    CPU (only so the CPU smoke runs every line: a host floor means little)."""
    if device == "cuda":
        from anchor import copy_bandwidth as cuda_copy_bandwidth
        return cuda_copy_bandwidth()
    nbytes = 128 << 20
    a = torch.ones(nbytes // 2, dtype=torch.uint8)
    b = torch.empty_like(a)
    return nbytes / timed(lambda: b.copy_(a), device, 5, warmup=1)


@torch.no_grad()
def experts_touched(policy: Policy, fn) -> list[int]:
    """Run `fn` (an eager forward) with a hook on every MoE layer's router; per MoE layer, the number of distinct
    experts its tokens were routed to (`moe.route`, the block's own rule, on the logits it computed)."""
    counts, hooks = [], []

    def hook(mod, inp, logits, mlp):
        _, idx = route(logits, mlp.top_k, mlp.norm_topk_prob)  # (N, top_k)
        counts.append(int(idx.unique().numel()))

    for layer in policy.layers.values():
        if isinstance(layer.mlp, SparseMoE):
            hooks.append(layer.mlp.gate.register_forward_hook(
                lambda mod, inp, out, mlp=layer.mlp: hook(mod, inp, out, mlp)))
    try:
        fn()
    finally:
        for h in hooks:
            h.remove()
    return counts


@torch.no_grad()
def bench_batch(models: dict, counts: dict, a, batch: int, device: str, bw: float) -> dict:
    """Every measurement of one batch size, both models (module docstring)."""
    g = torch.Generator().manual_seed(batch)
    V, kv, T_max = a.vocab, a.kv, max(a.ks) + 1
    prompt = torch.randint(0, V, (batch, kv), generator=g).to(device)
    step_tok = torch.randint(0, V, (batch, 1), generator=g)
    tokens = {"step": step_tok}
    for k in a.ks:  # the verify starts from the step's token: its routed set contains the step's
        tokens[f"verify_k{k}"] = torch.cat([step_tok, torch.randint(0, V, (batch, k), generator=g)], dim=1)
    runs, res, keep = {}, {"batch": batch, "kv_position": kv}, []
    for mname, policy in models.items():
        cfg, el = policy.cfg, policy.lm_head.weight.element_size()
        cache_len = -(-(kv + T_max) // 16) * 16  # 16-aligned rows for the attention kernels, as the engine's
        cache = policy.new_cache(batch, cache_len)
        rope = RopeTable.build(cfg.head_dim, cfg.rope_theta, cache_len, device, policy.lm_head.weight.dtype,
                               scaling=cfg.rope_scaling)
        pos0 = torch.arange(kv, device=device).expand(batch, kv).contiguous()
        policy_forward(policy, prompt, pos0, cache, rope, prefill=True, compute_logits=False)  # the KV prefix
        res[mname] = {}
        for name, tok in tokens.items():
            tok = tok.to(device)
            T = tok.shape[1]
            pos = (kv + torch.arange(T, device=device)).expand(batch, T).contiguous()
            fn = lambda tok=tok, pos=pos, cache=cache, rope=rope, policy=policy: policy_forward(  # noqa: E731
                policy, tok, pos, cache, rope)[0]
            touched = experts_touched(policy, fn) if cfg.moe else None
            m = {"tokens_per_row": T, "tokens": batch * T}
            if touched is not None:
                m.update(experts_touched=statistics.fmean(touched), experts_touched_layers=touched,
                         experts_touched_uniform=uniform_touched(cfg.num_experts, cfg.num_experts_per_tok, batch * T))
            wb, kb = read_bytes(counts[mname], touched, el), kv_bytes(cfg, batch, kv, T, el)
            m.update(weight_bytes=wb, kv_bytes=kb, floor_ms=(wb + kb) / bw * 1e3,
                     flops=matmul_flops(cfg, counts[mname], batch, kv, T))
            if device == "cuda":
                m["flops_floor_ms"] = m["flops"] / PEAK_FLOPS * 1e3
                eager = fn().argmax(-1)
                graph, out = capture(fn)
                graph.replay()
                m["graph_eager_argmax_agree"] = (out.argmax(-1) == eager).float().mean().item()
                if m["graph_eager_argmax_agree"] < 0.95:  # bf16 near-ties may flip a few; more means a bug
                    raise SystemExit(f"{mname} {name} B={batch}: the graphed forward disagrees with the eager one")
                # the graph reads and writes its tensors where they lay at capture (tokens, positions, this model's
                # KV cache and RoPE table): they must outlive it. Dropped with the loop's variables, their memory
                # went to the next tensors and the replays embedded garbage ids (a device-side index assert on the
                # first H200 run, 2026-12-04)
                runs[mname, name] = graph.replay
                keep.append((tok, pos, out, cache, rope))
            else:
                runs[mname, name] = fn
            res[mname][name] = m
    times = {key: [] for key in runs}
    for _ in range(a.rounds):  # interleaved: drift in clocks or thermals hits every measurement alike
        for key, run in runs.items():
            times[key].append(timed(run, device, a.iters, warmup=1))
    for (mname, name), ts in times.items():
        m = res[mname][name]
        m["t_ms"] = statistics.median(ts) * 1e3
        m["t_ms_rounds"] = [t * 1e3 for t in ts]
        m["t_over_floor"] = m["t_ms"] / m["floor_ms"]
    for mname in models:
        r = res[mname]
        r["verify_over_step"] = {str(k): r[f"verify_k{k}"]["t_ms"] / r["step"]["t_ms"] for k in a.ks}
    if device == "cuda" and a.anchor != "none":
        anchor_steps(models, res, a, batch)
    del runs, keep
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return res


def anchor_steps(models: dict, res: dict, a, batch: int) -> None:
    """The plain step of each model against bench/anchor.py's plain-PyTorch decoder of the same config at the same
    KV position (CUDA-graphed, and compiled with `--anchor compiled`): the MoE in each of `--anchor-modes`, the
    best of them the baseline (`anchor_best_ms`, `step_over_anchor`); a mode that fails (a kernel or compile
    error) is reported with its error and left out. The anchor draws its own random weights (routing close to
    uniform, as the policy's here: embeddings N(0, 1))."""
    from _timing import timeit
    from anchor import anchor_step_time
    for mname, policy in models.items():
        modes = a.anchor_modes if policy.cfg.moe else ["dense"]  # the dense twin: its one MLP (mode unused)
        per = {}
        for mode in modes:
            try:
                per[mode] = anchor_step_time(policy.cfg, batch, a.kv, 1, policy.lm_head.weight.dtype, 1.0,
                                             a.anchor == "compiled", timeit, moe_mode=mode) * 1e3
            except Exception as e:  # noqa: BLE001 (a baseline variant that cannot run is reported, not fatal)
                per[mode] = f"failed: {type(e).__name__}: {str(e)[:300]}"
            torch.cuda.empty_cache()
        step = res[mname]["step"]
        step["anchor_ms"] = per
        ok = [t for t in per.values() if isinstance(t, float)]
        if ok:
            step["anchor_best_ms"] = min(ok)
            step["step_over_anchor"] = step["t_ms"] / min(ok)


def table(rows: list[dict], ks: list[int]) -> str:
    """The markdown table of the results: one line per (B, model, measurement)."""
    lines = ["| B | model | tokens/row | t (ms) | verify/step | experts touched (uniform) | weights MB | KV MB "
             "| read floor (ms) | t/floor | FLOP floor (ms) | step / anchor |", "|---" * 12 + "|"]
    for r in rows:
        for mname in ("moe", "dense"):
            for k in [0] + ks:  # 0: the plain step
                m = r[mname]["verify_k%d" % k if k else "step"]
                ratio = f"{r[mname]['verify_over_step'][str(k)]:.2f}" if k else ""
                touched = (f"{m['experts_touched']:.1f} ({m['experts_touched_uniform']:.1f})"
                           if "experts_touched" in m else "")
                flops = f"{m['flops_floor_ms']:.3f}" if "flops_floor_ms" in m else ""
                anchor = f"{m['step_over_anchor']:.2f}" if "step_over_anchor" in m else ""
                lines.append(f"| {r['batch']} | {mname} | {m['tokens_per_row']} | {m['t_ms']:.3f} | {ratio} | "
                             f"{touched} | {m['weight_bytes'] / 1e6:.1f} | {m['kv_bytes'] / 1e6:.1f} | "
                             f"{m['floor_ms']:.3f} | {m['t_over_floor']:.2f} | {flops} | {anchor} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--kv", type=int, default=1024, help="KV position of the timed forwards (prefilled prefix)")
    ap.add_argument("--ks", default="3,7", help="draft lengths k: verifies of k+1 tokens per row")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--moe-inter", type=int, default=1024, help="each expert's SwiGLU width I")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32768,
                    help="small, so the head (the same in both models) does not hide the MLPs; 151936 is Qwen3's")
    ap.add_argument("--embed-std", type=float, default=1.0,
                    help="std of the random embeddings (module docstring: 1 routes near uniformly, 0.02 does not)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per batch size (median reported)")
    ap.add_argument("--iters", type=int, default=20, help="back-to-back calls per round")
    ap.add_argument("--threads", type=int, default=1, help="CPU intra-op threads")
    ap.add_argument("--anchor", choices=["graphed", "compiled", "none"], default="graphed",
                    help="CUDA: time each plain step against bench/anchor.py's decoder, CUDA-graphed eager or also "
                         "torch.compile'd (inductor: ~1 min per model, mode and batch)")
    ap.add_argument("--anchor-modes", default="grouped,dense,gather", help="the MoE anchor's expert paths")
    ap.add_argument("--out", default=None, help="default moe_verify_<device type>.json under bench/results")
    a = ap.parse_args()
    a.ks = [int(k) for k in a.ks.split(",")]
    a.anchor_modes = a.anchor_modes.split(",")
    device = a.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available")
    if device == "cpu":
        torch.set_num_threads(a.threads)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the captured MoE path needs bf16
    tp = int(os.environ.get("WORLD_SIZE", 1))
    if tp > 1:  # torchrun: the engine's tp group is every rank (module docstring); the anchor is one GPU's
        a.anchor = "none"
        import torch.distributed as dist
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    t0 = time.perf_counter()
    models = {}
    for mname, cfg in zip(("moe", "dense"), configs(a)):
        torch.manual_seed(0)
        with torch.device(device):
            models[mname] = Policy(cfg).to(dtype).eval()
        with torch.no_grad():  # tokens distinct enough to route near uniformly (module docstring)
            models[mname].embed_tokens.weight.normal_(0, a.embed_std)
        if tp > 1:  # seeded above: every rank cuts the same whole model
            from specco.rollout.tp import tp_shard
            models[mname] = tp_shard(models[mname], dist.group.WORLD).eval()
        if device == "cuda" and not all(m.graph_safe() for m in models[mname].modules() if isinstance(m, SparseMoE)):
            raise SystemExit("the experts do not take the grouped GEMM here (bf16 on a Hopper GPU, widths multiples "
                             "of 8): this bench measures that path")
    counts = {m: param_counts(p) for m, p in models.items()}
    assert counts["moe"]["active"] == counts["dense"]["active"], counts  # the twin's definition
    bw = copy_bandwidth(device)
    rows = []
    for b in [int(x) for x in a.batches.split(",")]:
        rows.append(bench_batch(models, counts, a, b, device, bw))
        r = rows[-1]
        print(f"B={b}: verify/step moe {r['moe']['verify_over_step']} dense {r['dense']['verify_over_step']}",
              flush=True)
    if tp > 1 and dist.get_rank() != 0:
        return dist.destroy_process_group()
    print(table(rows, a.ks))
    fields = {"tp": tp, "dtype": str(dtype), "graphs": device == "cuda", "copy_bandwidth_TBps": bw / 1e12,
              "anchor": a.anchor if device == "cuda" else "none", "anchor_modes": a.anchor_modes,
              "peak_flops": PEAK_FLOPS if device == "cuda" else None, "kv_position": a.kv, "ks": a.ks,
              "rounds": a.rounds, "iters": a.iters,
              "config": {m: dataclasses.asdict(p.cfg) for m, p in models.items()},
              "params": counts,
              "active_params_formula": "active = total - sum over MoE layers of ((E - top_k)*3*h*I + h*E) "
                                       "(the experts a token skips, and the router); the dense twin's active = "
                                       "its total; equal because top_k*3*h*I = 3*h*(top_k*I)",
              "embed_std": a.embed_std,
              "routing_note": "random weights with embeddings at std embed_std (1: each token's own embedding "
                              "dominates its residual stream) route close to uniformly: experts_touched ~ "
                              "experts_touched_uniform = E*(1-(1-top_k/E)^n); a trained router may touch fewer. "
                              "At std 0.02 a row's tokens route alike and touch far fewer (docstring)",
              "seconds": time.perf_counter() - t0, "rows": rows}
    write_results(fields, "moe_verify" if tp == 1 else f"moe_verify_tp{tp}", torch.device(device), a.out)
    if tp > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    from specco.parallel.mesh import run_worker  # noqa: E402
    run_worker(main)  # under torchrun: no interpreter teardown after success (its docstring)
