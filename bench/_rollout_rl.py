"""bench/rollout.py's `--rl-like` mode (its docstring): repeated `RolloutEngine.generate` calls as in one GRPO
step, plain vs speculative, and the check that graphs captured before a refit replay the new weights.
Imported by bench/rollout.py after it has put the chosen specco (`--impl`) on sys.path."""
from __future__ import annotations

import copy
import inspect
import statistics
import time

import torch

from specco.model.policy import Policy
from specco.rollout.engine import RolloutEngine
from specco.rollout.generate import GenerateConfig, generate
from specco.rollout.sampling import SamplingParams


def rl_prompts(args, call, vocab):
    """One RL step's prompts: `--rl-prompts` prompts of 7-11 tokens (the chain_sum CoT prompts)."""
    g = torch.Generator().manual_seed(1000 + call)
    lens = torch.randint(7, 12, (args.rl_prompts,), generator=g)
    return [torch.randint(0, vocab, (int(n),), generator=g) for n in lens]


def make_engine(policy, draft, cfg, cache: bool):
    kw = {}
    if not cache:
        if "cache_runners" not in inspect.signature(RolloutEngine).parameters:
            raise SystemExit("--no-graph-cache: this specco has no engine cache to turn off")
        kw["cache_runners"] = 0
    return RolloutEngine(policy, draft, cfg, **kw)


@torch.no_grad()
def bench_rl(policy, draft, args, device):
    """Repeated engine.generate calls in the RL setting; returns per-arm stats and the speedup."""
    vocab = policy.cfg.vocab_size
    cfg = GenerateConfig(max_new_tokens=args.rl_new_tokens,
                         sampling=SamplingParams(temperature=args.temperature),
                         num_draft_tokens=args.k)
    res = {}
    for arm, d in (("plain", None), ("spec", draft)):
        engine = make_engine(policy, d, cfg, not args.no_graph_cache)
        gen = torch.Generator(device).manual_seed(0)
        times, toks, taus, ks = [], 0, [], []
        for call in range(args.rl_warmup + args.rl_calls):
            prompts = rl_prompts(args, call, vocab)
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = engine.generate(prompts, group_size=args.rl_group, generator=gen)
            n_tok = int(out.lengths.sum())  # syncs
            times.append(time.perf_counter() - t0)
            if call >= args.rl_warmup:
                toks += n_tok
                taus.append(out.tau)
                ks.append([(c.rows, c.k, round(c.predicted_speedup, 3)) for c in out.choices])
        timed_s = times[args.rl_warmup:]
        res[arm] = dict(first_call_ms=times[0] * 1e3, median_call_ms=statistics.median(timed_s) * 1e3,
                        mean_call_ms=statistics.mean(timed_s) * 1e3, tok_s=toks / sum(timed_s),
                        tau=statistics.mean(taus), calls_ms=[t * 1e3 for t in times], k_chosen=ks)
        print(f"rl-like {arm:5s}: first call {res[arm]['first_call_ms']:8.1f} ms, median "
              f"{res[arm]['median_call_ms']:7.2f} ms/call, {res[arm]['tok_s']:9.0f} tok/s, "
              f"tau {res[arm]['tau']:.2f}  (rows, k, predicted) per level, last call: "
              f"{ks[-1] if ks else None}", flush=True)
    res["speedup"] = res["plain"]["median_call_ms"] / res["spec"]["median_call_ms"]
    return res


@torch.no_grad()
def refit_check(policy, draft, args, device, dtype):
    """An engine captures its graphs, is refit to other weights, and must then generate what an
    eager (ungraphed) loop of the new weights does — greedy, fp32 matmuls without TF32 so that
    near-ties do not flip. Speculative decoding is lossless, so its reference is plain decoding."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        torch.manual_seed(1)
        with torch.device(device):
            new_policy = Policy(policy.cfg).to(dtype=dtype).eval()  # random weights
        prompts = rl_prompts(args, 0, policy.cfg.vocab_size)[:8]
        cfg = GenerateConfig(max_new_tokens=24, sampling=SamplingParams(temperature=0.0),
                             num_draft_tokens=args.k)
        ref = generate(new_policy, prompts, GenerateConfig(
            max_new_tokens=24, sampling=SamplingParams(temperature=0.0), use_graphs=False),
            group_size=2)
        out = {}
        for arm, d in (("plain", None), ("spec", draft)):
            engine = RolloutEngine(copy.deepcopy(policy), copy.deepcopy(d), cfg)
            before = engine.generate(prompts, group_size=2)  # captures (and caches) the graphs
            engine.refit(new_policy.state_dict())
            got = engine.generate(prompts, group_size=2)
            out[arm] = dict(agree_with_new_eager=(got.tokens == ref.tokens).float().mean().item(),
                            changed_by_refit=(before.tokens != got.tokens).float().mean().item())
            print(f"refit check ({arm}): graphed after refit == eager new weights on "
                  f"{out[arm]['agree_with_new_eager']:.1%} of tokens; refit changed "
                  f"{out[arm]['changed_by_refit']:.1%}", flush=True)
            if out[arm]["agree_with_new_eager"] < 0.95 or out[arm]["changed_by_refit"] < 0.5:
                raise SystemExit("graphs replayed after a refit do not use the new weights")
        return out
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
