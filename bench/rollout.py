"""Rollout decode speed: plain (graphed) decode vs EAGLE-3 speculative decode, per batch size.

Reports per batch size: plain step time and tokens/s, speculative tokens/s, τ, t_verify, t_draft
(= (t_propose + t_catch_up) / k: k draft forwards per round), measured speedup (spec tok/s over plain
tok/s, both graphed on CUDA — never against an eager loop, docs/DESIGN.md §6) and the ideal speedup
τ·t_step / (t_verify + k·t_draft). On CUDA, in the same run:
  * the ANCHOR (bench/anchor.py): an independent minimal plain-PyTorch decoder of the same shapes,
    torch.compile'd and CUDA-graphed (and the same eager-graphed), timed at the same KV position —
    step over the faster of the two (`step_over_anchor`) is the figure the engine is judged by; also its
    naive masked verify of k+1 tokens;
  * the read floor: (weight + live KV bytes) / the copy bandwidth measured in the run, and for the
    verify also FLOPs / 700 TFLOP/s;
  * speculation control: the k the engine picks after one teaching call, predicted vs measured, and
    what a tracked plain round costs over a plain step (rollout/control.py, rule for levels);
  * diagnostic only: the engine's decode forward alone, captured bare (no sampling/bookkeeping).

Before timing, on CUDA, checks that the graphed path emits exactly the eager path's greedy tokens
(CI has no GPU, so this is where the CUDA-graph code is exercised).

SYNTHETIC TIMING SETUP (`--draft self`, the default). Weights are random, so a real draft would never
agree with the policy. To get a meaningful τ we build a pair that agrees by construction: the
policy's o_proj / down_proj are scaled by `--policy-layer-scale` (default 0: every layer is an exact
identity on the residual, yet still computes all its matmuls, so timing is unchanged), its
embeddings are tied and scaled so that its logits peak on the *current* token (it repeats the last
prompt token). The draft's fc selects the last aux tap (= the embedding), its attention o_proj and
MLP down_proj are 0, its head is the policy head's rows: it proposes "repeat" as well, so τ → k+1.
`--draft-noise` perturbs the draft head to dial τ down — per token: the draft then misses some tokens
always, and a row repeating such a token accepts nothing (a straggler that keeps the whole batch
decoding). `--draft-scale` c < 1 instead flattens the draft's distribution (logits × c), so at
T > 0 every position is accepted with about the same probability q(repeat): ragged but stochastic
acceptance, as with a real draft. τ here says nothing about real acceptance;
the point is timing the verify/draft/bookkeeping machinery at a known τ.

DFLASH (`--draft dflash`): a random-weight DFlash drafter with γ = `--k` (W = k + 1 slots) in place of the
EAGLE-3 pair. Its τ means nothing; the point is the cost of its round's parts at their static shapes:
t_propose (one block forward + the head over the k slots + sampling), t_verify (the target over k + 1
tokens per row), t_catch_up (the trunk K/V write of the verified taps). `--anchor graphed` times only the
anchor's CUDA-graphed eager form (its compiled form costs minutes of inductor at the long316m shapes and
was slower there).

RL-LIKE MODE (`--rl-like`): what one GRPO step's rollout costs. Times repeated
`RolloutEngine.generate` calls (32 prompts of 7-11 tokens x 8 samples = 256 rows, 40 new tokens,
T = 1, k = 3; the 113M policy of configs/gpu.toml, fp32 with TF32 matmuls, `--draft self`), plain vs
speculative: per-call wall time (host clock, synchronized; the first call, which captures the
graphs, reported apart), tokens/s, τ and the speedup. `--no-graph-cache` builds a fresh runner per
call (graphs captured per call, as before the engine cached them). It also checks that an engine
whose graphs were captured before a refit generates what an eager loop of the new weights does.

A/B against another revision: `--impl=DIR` imports `specco` from DIR instead of this checkout
(e.g. `git archive HEAD specco | tar -x -C DIR`); `--summarize a.json b.json ...` prints a table.

    python bench/rollout.py --device cuda --model 0.5b --batch-sizes 1,2,4,8,16,32,64 --k 4
    python bench/rollout.py --device cpu --model tiny --batch-sizes 1,2,4
    python bench/rollout.py --device cuda --model long316m --batch-sizes 16,64,256 --draft dflash --k 7 \
        --dtype float32 --prompt-len 1536 --max-new 680 --anchor graphed
    python bench/rollout.py --device cuda --rl-like --out bench/results/rollout_rl_cuda.json
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
from pathlib import Path

import torch

# --impl=DIR must act before specco is imported (argparse documents it below).
_IMPL = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--impl=")), None)
sys.path.insert(0, str(Path(_IMPL).resolve()) if _IMPL else str(Path(__file__).resolve().parents[1]))
from specco.model.config import DraftConfig, PolicyConfig  # noqa: E402
from specco.model.dflash import BlockDraft, BlockDraftConfig  # noqa: E402
from specco.model.draft import Eagle3Draft  # noqa: E402
from specco.model.policy import Policy  # noqa: E402
from specco.rollout.control import SpecController  # noqa: E402
from specco.rollout.generate import DecodeRunner, GenerateConfig, generate  # noqa: E402
from specco.rollout.forward import RopeTable, policy_forward  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import capture, timeit  # noqa: E402
from _rollout_rl import bench_rl, refit_check  # noqa: E402
from anchor import anchor_step_time, copy_bandwidth  # noqa: E402
from specco.rollout.sampling import SamplingParams  # noqa: E402

MODELS = {
    "tiny": dict(vocab_size=2048, hidden_size=128, intermediate_size=352, num_layers=4, num_heads=4,
                 num_kv_heads=2, tie_word_embeddings=True),
    # Qwen2.5-0.5B shapes (random weights): qwen2 has qkv bias and tied embeddings.
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                 num_heads=14, num_kv_heads=2, tie_word_embeddings=True, attention_bias=True,
                 model_type="qwen2", rope_theta=1000000.0, max_position_embeddings=32768),
    # Qwen3-8B shapes (random weights), tied for the `--draft self` pair: heads 32 / 8 and the vocabulary split 2, 4
    # and 8 ways, so bench/engine_tp1.py runs it at rollout tp 1-8 (a policy that fits one GPU: 16 GB in bf16)
    "8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
               num_kv_heads=8, tie_word_embeddings=True, model_type="qwen3", qk_norm=True, rope_theta=1000000.0,
               max_position_embeddings=40960),
    # Qwen2.5-72B shapes, tied for the `--draft self` pair: 143 GB in bf16, more than one H200 holds;
    # bench/engine_tp1.py --no-whole builds only each rank's shard of it (36 GB at tp 4)
    "72b": dict(vocab_size=152064, hidden_size=8192, intermediate_size=29568, num_layers=80, num_heads=64,
                num_kv_heads=8, tie_word_embeddings=True, attention_bias=True, model_type="qwen2",
                rope_theta=1000000.0, max_position_embeddings=32768),
    # configs/gpu.toml's from-scratch policy (char vocabulary), tied for the `--draft self` pair.
    "rl113m": dict(vocab_size=101, hidden_size=1024, intermediate_size=2816, num_layers=10,
                   num_heads=16, num_kv_heads=4, tie_word_embeddings=True, model_type="llama",
                   max_position_embeddings=256),
    # configs/long.toml's 316M 28-layer policy (issue 15), tied for the `--draft self` pair.
    "long316m": dict(vocab_size=101, hidden_size=1024, intermediate_size=2816, num_layers=28,
                     num_heads=16, num_kv_heads=4, tie_word_embeddings=True, model_type="llama",
                     max_position_embeddings=4096),
}


# --draft-scale for --rl-like with rl113m: calibrated on CPU to tau ~3.4 at k = 3, T = 1.
RL_DRAFT_SCALE = 0.35


def timed(fn, device, iters, warmup=2):
    """Median-free mean seconds per call (calls are back-to-back, as in a decode loop)."""
    for _ in range(warmup):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) / iters


@torch.no_grad()
def build(args, device, dtype):
    torch.manual_seed(0)
    pc = PolicyConfig(**MODELS[args.model])
    with torch.device(device):  # random init on the device: seconds less for the 0.5B model
        policy = Policy(pc)
        draft = None
        if args.draft == "dflash":  # random weights: τ ~ 1, the round's parts are timed at their static shapes
            draft = BlockDraft(BlockDraftConfig.for_policy(pc, "dflash", args.k, mask_id=pc.vocab_size - 1))
        elif args.draft != "none":
            dc = DraftConfig.for_policy(pc, draft_vocab_size=args.draft_vocab)
            draft = Eagle3Draft(dc)
    if args.draft == "self":  # synthetic agreeing pair, see the module docstring
        h = pc.hidden_size
        for layer in policy.layers.values():
            layer.self_attn.o_proj.weight.mul_(args.policy_layer_scale)
            layer.mlp.down_proj.weight.mul_(args.policy_layer_scale)
        # tied head: logit_x = c·|e_x|²/rms(e_x) ≈ c·0.02·h; pick c so that the self-logit is ~20
        policy.embed_tokens.weight.mul_(20.0 / (0.02 * h))
        n_aux = len(dc.aux_layer_ids)
        fc = torch.zeros(h, n_aux * h)
        fc[:, (n_aux - 1) * h:] = torch.eye(h)  # select the last aux tap
        draft.fc.weight.copy_(fc)
        draft.midlayer.self_attn.o_proj.weight.zero_()
        draft.midlayer.mlp.down_proj.weight.zero_()
        draft.norm.weight.copy_(policy.norm.weight)
        draft.init_head_from_policy(policy.lm_head.weight)
        draft.lm_head.weight.mul_(args.draft_scale)
        if args.draft_noise > 0:
            w = draft.lm_head.weight
            w.add_(args.draft_noise * w.std() * torch.randn_like(w))
    policy = policy.to(device=device, dtype=dtype).eval()
    if draft is not None:
        draft = draft.to(device=device, dtype=dtype).eval()
    return policy, draft


def _release(device):
    """Free a deleted runner's KV cache and CUDA-graph pools before the next one is built: at fp32 with 256
    rows x 2,216 positions each runner holds ~32 GB of cache plus its graphs' pools, and the H200 ran out
    with three alive (2026-12-01)."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def prompts_for(args, batch, vocab):
    g = torch.Generator().manual_seed(batch)
    return [torch.randint(0, vocab, (args.prompt_len,), generator=g) for _ in range(batch)]


@torch.no_grad()
def check_graphs(policy, draft, args, vocab):
    """CUDA only: graphed decode (plain and speculative, greedy and sampled with the same seed)
    emits the eager path's tokens; also reports the speculative path's agreement with plain."""
    prompts = [p[: 5 + 3 * i] for i, p in enumerate(prompts_for(args, 4, vocab))]
    for temp in (0.0, 1.0):
        for d in (None, draft):
            outs = [generate(policy, prompts, GenerateConfig(
                max_new_tokens=24, sampling=SamplingParams(temperature=temp),
                num_draft_tokens=args.k, use_graphs=g), draft=d,
                generator=torch.Generator(policy.lm_head.weight.device).manual_seed(0))
                for g in (False, True)]
            agree = (outs[0].tokens == outs[1].tokens).float().mean().item()
            print(f"graph check (T={temp}, {'spec' if d is not None else 'plain'}): graphed == "
                  f"eager on {agree:.1%} of tokens; tau {outs[1].tau:.2f}", flush=True)
            if agree < 0.95:  # bf16 near-ties may flip a few tokens; more means a bug
                raise SystemExit("graphed decode disagrees with eager decode")


@torch.no_grad()
def graph_floor(policy, batch, cache_len, pos_at, device, iters):
    """Diagnostic: bare CUDA-graph replay of the engine's decode forward alone (logits included, no
    sampling or bookkeeping) at KV position `pos_at`."""
    cache = policy.new_cache(batch, cache_len)
    rope = RopeTable.build(policy.cfg.head_dim, policy.cfg.rope_theta, cache_len, device,
                           policy.embed_tokens.weight.dtype, scaling=policy.cfg.rope_scaling)
    tok = torch.zeros(batch, 1, dtype=torch.long, device=device)
    pos = torch.full((batch, 1), pos_at, dtype=torch.long, device=device)
    g, _ = capture(lambda: policy_forward(policy, tok, pos, cache, rope))  # its tensors live through the timing
    return timed(g.replay, device, iters)


def isolated(runner, name, device, iters):
    """Time one captured step alone, restoring the decode state afterwards.

    Rows are marked finished while timing so a repeated step cannot advance positions past the
    cache (finished rows are frozen); the step's compute is static-shaped, hence unchanged.
    """
    saved = [t.clone() for t in runner.st.small_tensors()]
    runner.st.finished.fill_(True)
    level = runner.level
    t = timed(lambda: level.graphs[level.k].run(name), device, iters)
    for dst, src in zip(runner.st.small_tensors(), saved):
        dst.copy_(src)
    return t


def floors(policy, batch, pos, tokens, bw, peak_flops=700e12):
    """Physical floors of one forward of `tokens` new tokens per row at KV position `pos`:
    (weight + live-KV bytes) / measured copy bandwidth, and matmul FLOPs / peak (dense bf16 ~700
    TFLOP/s sustained on the H200). Returns seconds (bytes floor, FLOPs floor)."""
    c = policy.cfg
    params = {p.data_ptr(): p for p in policy.parameters()}.values()  # tied weights once
    el = next(iter(params)).element_size()
    weight_bytes = sum(p.numel() for p in params) * el - c.vocab_size * c.hidden_size * el * (
        0 if c.tie_word_embeddings else 1)  # the embedding table is gathered, not read, when untied
    kv_bytes = batch * c.num_layers * 2 * c.num_kv_heads * c.head_dim * (pos + tokens) * el
    matmul_params = sum(p.numel() for n, p in policy.named_parameters() if p.dim() == 2 and "embed" not in n)
    if c.tie_word_embeddings:
        matmul_params += c.vocab_size * c.hidden_size  # the head
    attn_flops = 4 * batch * tokens * c.num_layers * c.num_heads * c.head_dim * (pos + tokens)
    flops = 2 * matmul_params * batch * tokens + attn_flops
    return (weight_bytes + kv_bytes) / bw, flops / peak_flops


@torch.no_grad()
def bench_batch(policy, draft, args, batch, device, bw):
    k, iters = args.k, args.iters
    T = max(args.max_new, (args.iters + 4) * (k + 1) + 2)  # rows must stay live for all timed rounds
    sampling = SamplingParams(temperature=args.temperature)
    cfg = GenerateConfig(max_new_tokens=T, sampling=sampling, num_draft_tokens=k, spec_control=False)
    prompts = prompts_for(args, batch, draft.cfg.draft_vocab_size if draft else policy.cfg.vocab_size)
    res = {"batch": batch, "kv_position": args.prompt_len, "max_new_tokens": T}

    plain = DecodeRunner(policy, cfg, None, torch.Generator(device).manual_seed(0))
    plain.prefill(prompts)
    t_step = timed(plain.round, device, iters)
    res.update(t_step_ms=t_step * 1e3, plain_tok_s=batch / t_step, cache_len=plain.shape.cache_len)
    if device == "cuda":
        pos = args.prompt_len
        dtype = policy.embed_tokens.weight.dtype
        temp = max(args.temperature, 1e-3)
        # --anchor graphed skips the compiled form (minutes of inductor at large shapes, and slower than
        # the graphed eager one at the long316m shape): the best of what was timed is the baseline
        t_anchor_eager = anchor_step_time(policy.cfg, batch, pos, 1, dtype, temp, False, timeit)
        t_anchor = anchor_step_time(policy.cfg, batch, pos, 1, dtype, temp, True, timeit) \
            if args.anchor == "both" else float("nan")
        f_bytes, f_flops = floors(policy, batch, pos, 1, bw)
        t_diag = graph_floor(policy, batch, plain.st.t_cache.max_len, pos, device, iters)
        best = min(t for t in (t_anchor, t_anchor_eager) if t == t)  # nan: not timed
        res.update(t_anchor_ms=t_anchor * 1e3, t_anchor_graphed_eager_ms=t_anchor_eager * 1e3,
                   step_over_anchor=t_step / best, floor_ms=max(f_bytes, f_flops) * 1e3,
                   step_over_floor=t_step / max(f_bytes, f_flops), t_forward_graph_ms=t_diag * 1e3)
        if draft is not None:
            try:
                t_anchor_verify = anchor_step_time(policy.cfg, batch, pos, k + 1, dtype, temp,
                                                   args.anchor == "both", timeit)
            except Exception as e:  # a compiler failure on the baseline's verify shape: say so, go on
                print(f"anchor verify (B={batch}, T={k + 1}) failed to compile: {type(e).__name__}", flush=True)
                t_anchor_verify = float("nan")
            v_bytes, v_flops = floors(policy, batch, pos, k + 1, bw)
            # over the anchor step of the same form (compiled under --anchor both, graphed eager otherwise)
            anchor_step = t_anchor if args.anchor == "both" else t_anchor_eager
            res.update(t_anchor_verify_ms=t_anchor_verify * 1e3, anchor_verify_over_step=t_anchor_verify / anchor_step,
                       verify_floor_bytes_ms=v_bytes * 1e3, verify_floor_flops_ms=v_flops * 1e3)
    del plain
    _release(device)

    if draft is not None:
        spec = DecodeRunner(policy, cfg, draft, torch.Generator(device).manual_seed(0))
        spec.prefill(prompts)
        spec.round()
        e0, f0 = int(spec.st.n_emitted), int(spec.st.n_row_forwards)
        t_round = timed(spec.round, device, iters, warmup=0)
        e1, f1 = int(spec.st.n_emitted), int(spec.st.n_row_forwards)
        assert not bool(spec.st.finished[:batch].any()), "a row finished during timing; raise T"
        tau = (e1 - e0) / (f1 - f0)
        t_verify = isolated(spec, "verify", device, iters)
        t_propose = isolated(spec, "propose", device, iters)
        t_catch = isolated(spec, "catch_up", device, iters)
        t_draft = (t_propose + t_catch) / k
        spec_tps = (e1 - e0) / (t_round * iters)
        ideal = tau * t_step / (t_verify + k * t_draft)
        res.update(tau=tau, accept_rate=(spec.st.n_accepted.double() / f1).tolist(),
                   t_round_ms=t_round * 1e3, t_verify_ms=t_verify * 1e3,
                   t_propose_ms=t_propose * 1e3, t_catch_up_ms=t_catch * 1e3,
                   t_draft_ms=t_draft * 1e3, verify_over_step=t_verify / t_step,
                   spec_tok_s=spec_tps, speedup=spec_tps / res["plain_tok_s"], ideal_speedup=ideal,
                   speedup_over_ideal=spec_tps / res["plain_tok_s"] / ideal)
        if device == "cuda":
            res["verify_over_floor"] = t_verify / max(res["verify_floor_bytes_ms"], res["verify_floor_flops_ms"]) * 1e3
        del spec
        _release(device)
        if device == "cuda":  # speculation control: the k the engine picks, and what it gets
            ctl_cfg = dataclasses.replace(cfg, spec_control=True)
            ctl = SpecController(k)
            run = DecodeRunner(policy, ctl_cfg, draft, torch.Generator(device).manual_seed(1), ctl)
            run.prefill(prompts)  # a first call teaches the controller this pair's acceptance
            for _ in range(4):
                run.round()
            run.result()
            run.prefill(prompts)
            e0 = int(run.st.n_emitted)
            t_ctl = timed(run.round, device, iters, warmup=0)
            tps = (int(run.st.n_emitted) - e0) / (t_ctl * iters)
            ch = run.level.choice
            res.update(control_k=ch.k, control_predicted_speedup=ch.predicted_speedup,
                       control_speedup=tps / res["plain_tok_s"], control_costs_ms=ch.costs_ms)
            if run.level.track_cost is not None:  # the tracked plain round (rollout/control.py, rule for levels)
                res.update(control_track_ms=run.level.track_cost * 1e3,
                           track_over_step=run.level.track_cost / run.level.costs[0])
            del run
            _release(device)
    return res


def summarize(paths):
    """Print one table from result JSONs of this script (e.g. before/after)."""
    print(f"{'file':34s} {'kind':8s} {'row':14s} {'value'}")
    for p in paths:
        d = json.loads(Path(p).read_text())
        name = Path(p).name
        if "rl" in d:
            r = d["rl"]
            for arm in ("plain", "spec"):
                print(f"{name:34s} {'rl':8s} {arm:14s} first {r[arm]['first_call_ms']:7.1f} ms  "
                      f"median {r[arm]['median_call_ms']:7.2f} ms/call  {r[arm]['tok_s']:8.0f} tok/s"
                      f"  tau {r[arm]['tau']:.2f}")
            print(f"{name:34s} {'rl':8s} {'speedup':14s} {r['speedup']:.2f}x (spec vs plain, median call)")
        for r in d.get("results", []):
            line = f"step {r['t_step_ms']:.3f} ms"
            if "t_anchor_ms" in r:
                line += f"  anchor {r['t_anchor_ms']:.3f} ms ({r['step_over_anchor']:.2f})  floor ({r['step_over_floor']:.2f})"
            if "speedup" in r:
                line += f"  spec {r['speedup']:.2f}x tau {r['tau']:.2f} verify/step {r['verify_over_step']:.2f}"
            print(f"{name:34s} {d['meta'].get('model', ''):8s} B={r['batch']:<12d} {line}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--model", choices=sorted(MODELS), default=None,
                    help="default: tiny; rl113m with --rl-like")
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    ap.add_argument("--k", type=int, default=None, help="default 4; 3 with --rl-like")
    ap.add_argument("--draft", choices=["self", "random", "dflash", "none"], default="self",
                    help="dflash: a random-weight DFlash drafter with gamma = --k (timing of its round's parts)")
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--draft-noise", type=float, default=0.0)
    ap.add_argument("--draft-scale", type=float, default=None,
                    help="default 1; with --rl-like and rl113m %(RL)s, which puts tau near the GPU RL "
                    "runs' 3.4" % {"RL": RL_DRAFT_SCALE})
    ap.add_argument("--policy-layer-scale", type=float, default=0.0)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--prompt-len", type=int, default=128, help="also the KV position of the timed steps")
    ap.add_argument("--max-new", type=int, default=0,
                    help="max_new_tokens of the timed generation (sets S_max; default: just what timing needs)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--anchor", choices=["both", "graphed"], default="both",
                    help="anchor forms timed: compiled and graphed eager, or the graphed eager one alone")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                    help="default: bfloat16 on cuda (float32 + TF32 with --rl-like), float32 on cpu")
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU intra-op threads (1 avoids OpenMP thrash on small shared machines)")
    ap.add_argument("--no-check", action="store_true", help="skip the graphed-vs-eager check")
    ap.add_argument("--rl-like", action="store_true", help="time engine.generate calls (docstring)")
    ap.add_argument("--rl-prompts", type=int, default=32)
    ap.add_argument("--rl-group", type=int, default=8)
    ap.add_argument("--rl-new-tokens", type=int, default=40)
    ap.add_argument("--rl-calls", type=int, default=10, help="timed calls per arm")
    ap.add_argument("--rl-warmup", type=int, default=3, help="untimed calls first (capture)")
    ap.add_argument("--no-graph-cache", action="store_true",
                    help="rl-like: a fresh runner (graph capture) in every call")
    ap.add_argument("--impl", default=None, help="--impl=DIR: import specco from DIR")
    ap.add_argument("--summarize", nargs="+", default=None, help="print a table of result JSONs")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.summarize:
        summarize(args.summarize)
        return
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available")
    if device == "cpu":
        torch.set_num_threads(args.threads)
    args.model = args.model or ("rl113m" if args.rl_like else "tiny")
    args.k = args.k or (3 if args.rl_like else 4)
    if args.draft_scale is None:
        args.draft_scale = RL_DRAFT_SCALE if args.rl_like and args.model == "rl113m" else 1.0
    default_dtype = "bfloat16" if device == "cuda" and not args.rl_like else "float32"
    dtype = getattr(torch, args.dtype or default_dtype)
    if dtype == torch.float32 and device == "cuda":  # as the GPU RL runs: TF32 matmuls
        torch.set_float32_matmul_precision("high")
    policy, draft = build(args, device, dtype)
    vocab = draft.cfg.draft_vocab_size if draft else policy.cfg.vocab_size
    if device == "cuda" and not args.no_check:
        check_graphs(policy, draft, args, vocab)
    meta = {k: v for k, v in vars(args).items()}
    meta.update(dtype=str(dtype), torch=torch.__version__,
                gpu=torch.cuda.get_device_name() if device == "cuda" else None,
                graphs=device == "cuda", impl=str(Path(_IMPL).resolve()) if _IMPL else "checkout",
                note="synthetic agreeing draft (see docstring); tau is by construction"
                if args.draft == "self" else "")
    result = {"meta": meta}
    if args.rl_like:
        result["rl"] = bench_rl(policy, draft, args, device)
        if device == "cuda" and not args.no_check:
            result["refit_check"] = refit_check(policy, draft, args, device, dtype)
        name = f"rollout_rl_{device}.json"
    else:
        rows = []
        bw = copy_bandwidth() if device == "cuda" else None
        meta["copy_bandwidth_TBps"] = bw / 1e12 if bw else None
        for b in [int(x) for x in args.batch_sizes.split(",")]:
            r = bench_batch(policy, draft, args, b, device, bw)
            rows.append(r)
            line = (f"B={b:3d} step {r['t_step_ms']:7.3f} ms  plain {r['plain_tok_s']:9.1f} tok/s")
            if "t_anchor_ms" in r:
                line += (f"  anchor {r['t_anchor_ms']:.3f} ms, graphed eager {r['t_anchor_graphed_eager_ms']:.3f} ms "
                         f"(step/best anchor {r['step_over_anchor']:.2f})  floor "
                         f"{r['floor_ms']:.3f} ms (step/floor {r['step_over_floor']:.2f})")
            if "tau" in r:
                line += (f"  | spec {r['spec_tok_s']:9.1f} tok/s  tau {r['tau']:.2f}  verify "
                         f"{r['t_verify_ms']:.3f} ms  draft {r['t_draft_ms']:.3f} ms  speedup "
                         f"{r['speedup']:.2f} (ideal {r['ideal_speedup']:.2f}, verify/step {r['verify_over_step']:.2f})")
            if "control_k" in r:
                line += (f"  | control k={r['control_k']} predicted {r['control_predicted_speedup']:.2f} "
                         f"measured {r['control_speedup']:.2f}")
            if "track_over_step" in r:
                line += f"  tracked plain round / plain step {r['track_over_step']:.3f}"
            print(line, flush=True)
        result["results"] = rows
        name = f"rollout_{device}.json"
    out = Path(args.out or Path(__file__).parent / "results" / name)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
