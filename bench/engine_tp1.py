"""The rollout engine's tensor-parallel code path at tp = 1 against the whole-policy engine, in the same run (issue 37).

A tp group of one rank (NCCL on CUDA, gloo on CPU; this process alone) and `rollout/tp.tp_shard` of the policy: the
engine then runs every TP piece — the all-reduce after o_proj and down_proj (inside the captured CUDA graphs), the
vocabulary-parallel token choice (`pick_vocab_parallel`: the all-gather of 5 numbers per row) and the gathered logits
where a sampling rule reads them — on a group that changes nothing. Timed against the engine on the whole policy, the
two interleaved (A B A B ...; the mean of each), for the plain graphed step and the speculative round (bench/rollout.py's
synthetic `--draft self` pair, so τ is known), at each batch size and KV position. Also checks that both emit the same
greedy tokens.

Under torchrun at world N (issue 39) the tp group is the N ranks: the engine's shard `tpN` (each rank 1/N of the
heads, MLP width and vocabulary; two all-reduces per layer and the vocabulary-parallel pick inside the graphs)
against the whole engine each rank also holds (`--no-whole`: the shard alone, built without a whole copy anywhere by
`build_shard`, so a policy no GPU holds runs, e.g. the 72b shape at tp 2-8). Per run
also the verify of k+1 tokens per row alone (rollout.py's `isolated`: the captured verify step) and the speculative
speedup over the same engine's plain step, τ·t_step / t_round (tokens per second, speculative over plain). Every rank
times its own engine in lock-step with the others; rank 0 writes its figures (the ranks' steps end together: the
all-reduces wait for the slowest).

    python bench/engine_tp1.py --device cuda --model 0.5b --batch-sizes 1,32 --prompt-lens 1024,8192 --out bench/results/engine_tp1_2026-12-04/engine_tp1_cuda.json
    python bench/engine_tp1.py --device cpu --model tiny --batch-sizes 1,4 --prompt-lens 64 --iters 5
    torchrun --nproc-per-node 4 bench/engine_tp1.py --device cuda --model 8b --batch-sizes 1,32 --prompt-lens 1024
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_results  # noqa: E402
from rollout import MODELS, _release, build, isolated, prompts_for, timed  # noqa: E402
from specco.rollout.generate import DecodeRunner, GenerateConfig  # noqa: E402
from specco.rollout.sampling import SamplingParams  # noqa: E402
from specco.model.config import DraftConfig, PolicyConfig  # noqa: E402
from specco.model.draft import Eagle3Draft  # noqa: E402
from specco.model.policy import Policy  # noqa: E402
from specco.rollout.tp import tp_shard  # noqa: E402


@torch.no_grad()
def build_shard(args, device, dtype, group):
    """This rank's engine shard of a `--draft self` pair (bench/rollout.py's `build`: its module docstring) and the
    whole draft, without the whole policy anywhere: tp_shard cuts a meta-device policy (shapes only), the shard is
    then allocated on the device and filled here. The pair's recipe on the shard: every layer an identity on the
    residual (o_proj and down_proj at 0: their partial sums all-reduce to 0), the embedding (whole on every rank:
    drawn from the same seed, so every rank's is the same) scaled so the tied head's self-logit is ~20, the head's
    V/tp rows that embedding's block; the draft proposes "repeat" from the last aux tap with the head's rows of its
    vocabulary (the embedding's rows: whole here). The cut weights (q/k/v, gate/up) are random per rank: the layer
    is an identity whatever they are, and the timing is of their shapes."""
    pc = PolicyConfig(**MODELS[args.model])
    if not pc.tie_word_embeddings:
        raise SystemExit(f"--no-whole builds the `--draft self` pair of a tied policy; {args.model} is untied")
    with torch.device("meta"):  # in the engine's dtype already: a 72b shard in fp32 would not fit at tp 2
        shard = tp_shard(Policy(pc).to(dtype), group)  # shapes only: this rank's local config, tp attributes set
    shard = shard.to_empty(device=device)
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    torch.manual_seed(0)  # the whole tensors first, in the same order on every rank: the same values everywhere
    emb = shard.embed_tokens.weight
    emb.normal_(0.0, 0.02).mul_(20.0 / (0.02 * pc.hidden_size))
    rows = pc.vocab_size // tp
    shard.lm_head.weight.copy_(emb[rank * rows:(rank + 1) * rows])  # the tied head's block (tp.py: an untied copy)
    for name, t in shard.named_parameters():
        if name.startswith(("embed_tokens", "lm_head")):
            continue
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            t.zero_()  # policy_layer_scale 0: the layer adds nothing to the residual (it still runs every matmul)
        elif "norm" in name:
            t.fill_(1.0)
        elif name.endswith(".bias"):
            t.zero_()
        else:
            t.normal_(0.0, 0.02)
    dc = DraftConfig.for_policy(pc, draft_vocab_size=args.draft_vocab)
    with torch.device(device):
        draft = Eagle3Draft(dc)
    h, n_aux = pc.hidden_size, len(dc.aux_layer_ids)
    draft.fc.weight.zero_()
    draft.fc.weight[:, (n_aux - 1) * h:].copy_(torch.eye(h))  # select the last aux tap (= the embedding)
    draft.midlayer.self_attn.o_proj.weight.zero_()
    draft.midlayer.mlp.down_proj.weight.zero_()
    draft.norm.weight.fill_(1.0)  # the policy's final norm (ones)
    draft.init_head_from_policy(emb)  # the tied head is the embedding
    draft.lm_head.weight.mul_(args.draft_scale)
    return shard.to(dtype).eval(), draft.to(dtype).eval()


def _runner(policy, draft, args, batch, prompts, device):
    T = max(args.max_new, (args.iters * args.reps + 6) * (args.k + 1) + 2)  # rows stay live through every timed round
    cfg = GenerateConfig(max_new_tokens=T, sampling=SamplingParams(temperature=args.temperature),
                         num_draft_tokens=args.k, spec_control=False)
    run = DecodeRunner(policy, cfg, draft, torch.Generator(device).manual_seed(0))
    run.prefill(prompts)
    run.round()
    return run


def bench_point(whole, shard, draft, args, batch, device) -> dict:
    """One batch size: the plain and speculative rounds of the whole engine (None: skipped) and of this rank's shard
    `tp{N}`, interleaved; the verify alone and the speedup per engine; whether both decode the same greedy tokens."""
    prompts = prompts_for(args, batch, draft.cfg.draft_vocab_size)
    res = {"batch": batch, "kv_position": args.prompt_len}
    name = f"tp{dist.get_world_size()}"
    engines = {n: p for n, p in (("whole", whole), (name, shard)) if p is not None}
    for kind, d in (("plain", None), ("spec", draft)):
        runs = {n: _runner(p, d, args, batch, prompts, device) for n, p in engines.items()}
        times = {n: [] for n in runs}
        for _ in range(args.reps):
            for n, r in runs.items():
                times[n].append(timed(r.round, device, args.iters, warmup=1))
        for n in runs:
            res[f"{kind}_{n}_ms"] = sum(times[n]) / len(times[n]) * 1e3
        if whole is not None:
            res[f"{kind}_{name}_over_whole"] = res[f"{kind}_{name}_ms"] / res[f"{kind}_whole_ms"]
        if kind == "spec":
            for n, r in runs.items():
                tau = int(r.st.n_emitted) / max(1, int(r.st.n_row_forwards))
                res[f"tau_{n}"] = tau
                # tokens/s speculative over plain: τ·B / t_round over B / t_step
                res[f"speedup_{n}"] = tau * res[f"plain_{n}_ms"] / res[f"spec_{n}_ms"]
                res[f"verify_{n}_ms"] = isolated(r, "verify", device, args.iters) * 1e3
                res[f"verify_over_step_{n}"] = res[f"verify_{n}_ms"] / res[f"plain_{n}_ms"]
            res["tau"] = res[f"tau_{next(iter(runs))}"]
        del runs
        _release(device)
    if whole is None:
        return res
    # greedy: the same tokens from both (a short generation)
    cfg = GenerateConfig(max_new_tokens=24, sampling=SamplingParams(temperature=0.0), num_draft_tokens=args.k,
                         spec_control=False)
    outs = []
    for p in (whole, shard):
        r = DecodeRunner(p, cfg, draft, torch.Generator(device).manual_seed(0))
        r.prefill(prompts)
        r.run()
        outs.append(r.result().tokens.cpu())
        del r
        _release(device)
    res["greedy_tokens_equal"] = bool(torch.equal(outs[0], outs[1]))
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--model", choices=sorted(MODELS), default="0.5b")
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--prompt-lens", default="1024,8192")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--reps", type=int, default=3, help="interleaved A/B repetitions")
    ap.add_argument("--max-new", type=int, default=0)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    ap.add_argument("--no-whole", action="store_true",
                    help="the shard alone, no whole copy built (build_shard): a policy one GPU cannot hold")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = args.device
    # the knobs of build() in bench/rollout.py for the synthetic agreeing pair (its module docstring)
    args.draft, args.draft_vocab, args.draft_noise, args.draft_scale, args.policy_layer_scale = "self", 32000, 0.0, 1.0, 0.0
    dtype = getattr(torch, args.dtype or ("bfloat16" if device == "cuda" else "float32"))
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if "WORLD_SIZE" in os.environ:  # torchrun (or a caller's env://): the tp group is every rank
        dist.init_process_group(backend)
    else:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group(backend, rank=0, world_size=1)
    rows = []
    for plen in (int(x) for x in args.prompt_lens.split(",")):
        args.prompt_len = plen
        if args.no_whole:  # the shard alone, never a whole copy
            whole, (shard, draft) = None, build_shard(args, device, dtype, dist.group.WORLD)
        else:
            whole, draft = build(args, device, dtype)  # seeded: the same weights on every rank
            shard = tp_shard(whole, dist.group.WORLD)
        for b in (int(x) for x in args.batch_sizes.split(",")):
            r = bench_point(whole, shard, draft, args, b, device)
            if dist.get_rank() == 0:
                print(json.dumps(r), flush=True)
            rows.append(r)
        del whole, shard, draft
        _release(device)
    world = dist.get_world_size()
    if dist.get_rank() == 0:
        write_results({"model": args.model, "dtype": str(dtype), "k": args.k, "world": world, "tp": world,
                       "rows": rows}, f"engine_tp{world}", torch.device(device), args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    from specco.parallel.mesh import run_worker  # noqa: E402
    run_worker(main)  # under torchrun: no interpreter teardown after success (its docstring)
