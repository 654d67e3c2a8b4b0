"""Correctness of the multi-GPU layouts (issue 39, first item): two RL steps of the co-trained EAGLE-3 arm at world N
against the world-1 trainer on the same rollouts, under torchrun (NCCL on GPUs, gloo on CPUs).

Each layout runs the RL loop `specco train` runs (runner/rl.run_arm, the library function its pipeline calls per
arm: rollout -> rewards -> PPO 2 epochs x 2 minibatches with the log-prob recompute and a KL reference -> refit),
on the demo config's tiny policy (its vocabulary padded from the char tokenizer's 101 to 104 rows, ids the tokenizer
never makes, so that an engine tp of 2 or 8 splits it) and a digits task (reward = the share of digits in the
completion: graded, so the advantages are not zero):

    dp_shard     parallel.dp_shard=N          FSDP: the policy, its AdamW state and the KL reference sharded
    rollout_tp   parallel.cp=N rollout.tp=N   the engine tensor-parallel over the cp ranks (rollout/tp.py)
    ep           parallel.dp=N parallel.ep=N  a Qwen3-MoE policy (4 experts, top 2), its experts cut over the ranks

Every DP rank samples its own stream (trainer.make_arm), so a world-N run's rollouts are not a world-1 run's. The
reference is therefore what tests/test_rl_fsdp.py replays: every rank records its rollouts, rank 0 trains the union
of them with `train_on_rollouts` on a world-1 arm of the same config (the layout's keys removed), step by step, and
compares each step's metrics; the reference parameters after both steps are broadcast and every rank compares its
own view of the world-N run's (the FSDP shards / expert slices gathered; a whole copy as it is), so a wrong rank is
caught wherever it sits. Compared by name (an expert-parallel policy's gathered state lists its keys in another
order). Two layouts also run a twin in the same processes, the piece under test off:
  * rollout_tp at rollout.tp=1: the tp-N engine's rollouts (tokens) and rewards against the whole engine's;
  * ep at parallel.ep=1 (plain DP over the same ranks). For the MoE the twin, not the world-1 replay, is the
    reference of the metrics and weights, as tests/test_ep.py: the router's aux loss is a statistic of each
    rank's micro-batch (token fractions x mean router probabilities), not of the union, so dp N and one process
    train differently by design (seen at dp 2, fp64: aux loss 6.5e-3 relative, policy loss 2e-4, weights 2.2e-2 =
    7 lr apart after the 8 updates, against ~1e-15 for the ep 1 twin); dp N at
    ep 1 against one process is the dense layouts' replay and tests/test_dp.py.

Tolerances (the bounds, and why):
  * CPU (gloo, fp64 models): only summation orders differ (reduce-scatter vs one process's sums, the engine's
    all-reduces), ~1e-15 relative: metrics rtol 1e-9, parameters atol 1e-10 after the 8 AdamW updates; policy/loss,
    ratio and KL statistics 1e-6 (a bound from fp32 log-probs, as tests/test_rl_cp.py). Rollouts at rollout.tp N
    equal rollout.tp 1's token for token.
  * GPU (NCCL, fp32 masters, train.amp=bf16, a bf16 engine copy): the runs round different tensors to bf16 (FSDP
    casts every dense weight, the replay's autocast casts at each matmul; other micro-batch shapes, other kernels),
    so as tests/test_fsdp.py derives: losses, grad norms, ratio and KL within 2e-2 x max(1, |value|) (bf16's 8-bit
    mantissa, 3.9e-3 per rounding, a few roundings deep), clip fraction within 5e-2 (a flipped clip decision is a
    whole token of a ~100-token minibatch). Parameters: every AdamW update moves a weight by about lr (m/sqrt(v) ~ 1
    in the first updates) in both runs, so a component whose gradient sign the rounding flips is off by at most
    2 lr per update: max |dw| <= 2 lr x updates (a hard bound), mean |dw| <= 0.05 lr x updates (seen in
    tests/test_ep_fsdp.py: mean 0.0067 lr after one update). The engine's rollouts at tp N vs tp 1 are reported, not
    bounded (one bf16 near-tie flips a sample and every later token of its row).
Exit status 1 if any comparison fails (the JSON is written first: `passed` per layout and per check).

    torchrun --nproc-per-node 2 bench/multi_gpu_check.py --device cuda --out $OUT/multi_gpu_check.json
    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/multi_gpu_check.py --device cpu
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_results  # noqa: E402
from specco.config_load import load_config  # noqa: E402
from specco.data.source import Example  # noqa: E402
from specco.data.tokenizer import build_char_tokenizer  # noqa: E402
from specco.model.policy import Policy  # noqa: E402
from specco.parallel.mesh import Mesh  # noqa: E402
from specco.rewards.core import RewardBatch  # noqa: E402

DEMO = Path(__file__).resolve().parents[1] / "configs" / "demo.toml"
ARM = "cotrained"
# a small batch of the demo: 2 steps, PPO 2 x 2 (8 AdamW updates of the policy), a KL reference
BASE = ("train.steps=2", "rollout.group_size=4", "rollout.max_new_tokens=6", "rollout.k=2", "train.lr=3e-3",
        "train.draft_warmup_steps=0", "rollout.prompts_per_step=8", "train.ppo_epochs=2", "train.minibatches=2",
        "train.kl_coef=0.1", "train.draft_row_stride=1")
# name -> (overrides at world n, MoE policy, the twin's overrides: the same ranks with the piece under test off)
LAYOUTS = {
    "dp_shard": (lambda n: (f"parallel.dp_shard={n}",), False, None),
    "rollout_tp": (lambda n: (f"parallel.cp={n}", f"rollout.tp={n}"), False, ("rollout.tp=1",)),
    "ep": (lambda n: (f"parallel.dp={n}", f"parallel.ep={n}"), True, ("parallel.ep=1",)),
}
EXACT = ("draft/tokens", "ppo/updates")
CPU_TOL = {"rtol": 1e-9, "logprob_rtol": 1e-6, "clip_rtol": 1e-9, "param_max_lr": None, "param_atol": 1e-10}
GPU_TOL = {"rtol": 2e-2, "logprob_rtol": 2e-2, "clip_rtol": 5e-2, "param_max_lr": 2.0, "param_mean_lr": 0.05}
LOGPROB_KEYS = ("policy/loss", "policy/ratio_mean", "policy/ratio_dev", "policy/kl")
METRIC_KEYS = (*LOGPROB_KEYS, "draft/loss", "policy/grad_norm", "draft/grad_norm", "policy/clip_frac")


class DigitTask:
    """Prompts 'a' / 'b'; reward = the share of digits in the completion (a job's data shape, runner.validate.JobData:
    `train` a prompt source, `rewards`). Graded, so a from-scratch policy's groups have non-zero advantages."""
    name, num_rows, eval, sft = "digits", None, None, None

    def __init__(self):
        self.tok = build_char_tokenizer()
        self.train = self

    def examples(self, n, seed, offset=0):
        return [Example(offset + i, p, self.tok.encode(p, add_bos=True), {}, None)
                for i, p in enumerate("ab"[(offset + i) % 2] for i in range(n))]

    def rewards(self, prompts, completions, completion_ids, columns):
        r = torch.tensor([sum(c.isdigit() for c in t) / max(1, len(t)) for t in completions], dtype=torch.float32)
        return RewardBatch(rewards=r, valid=torch.ones(len(r), dtype=torch.bool), metrics={}, full_marks=r >= 1)


def models(moe: bool, dtype: torch.dtype, device):
    """The demo's tiny policy (vocabulary padded to 104) and a fresh EAGLE-3 draft; moe: the same as a Qwen3-MoE
    (4 experts of width 16, top 2, layer 1 dense, aux coefficient 0.01). Seeded: every rank builds the same."""
    from specco.runner.warmstart import new_draft
    from specco.train.sft import tiny_policy_config
    tok = build_char_tokenizer()
    p = load_config(DEMO, []).policy
    pc = tiny_policy_config(tok, p.hidden_size, p.num_layers, p.num_heads, p.num_kv_heads, p.intermediate_size)
    pc = dataclasses.replace(pc, vocab_size=104)
    if moe:
        pc = dataclasses.replace(pc, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=16, norm_topk_prob=True, decoder_sparse_step=1,
                                 mlp_only_layers=(1,), router_aux_loss_coef=0.01)
    torch.manual_seed(0)
    policy = Policy(pc).to(dtype)
    torch.manual_seed(1)
    draft = new_draft(policy, torch.randint(0, tok.vocab_size, (4, 8))).to(dtype)
    return tok, policy.to(device), draft.to(device)


def whole(st) -> dict[str, torch.Tensor]:
    """Every trained weight by name, whole (FSDP shards and expert slices gathered: a collective), on the host.
    By name, not concatenated: an expert-parallel policy's gathered state lists its keys in another order."""
    from specco.runner.trainer import full_state
    out = {f"policy.{k}": v.detach().cpu() for k, v in full_state(st.policy).items()}
    out.update({f"draft.{k}": v.detach().cpu() for k, v in st.draft.state_dict().items()})
    return out


def close(a: float, b: float, rtol: float) -> bool:
    return abs(a - b) <= rtol * max(1.0, abs(b))


def replay(cfg1, policy, draft, tok, groups, device) -> tuple[list[dict], dict]:
    """The world-1 trainer on the union of the DP ranks' rollouts (`groups[dp_rank][step]`), step by step: its
    metrics per step and its weights after the last."""
    from specco.runner.derive import generate_config
    from specco.runner.rollouts import Rollouts
    from specco.runner.trainer import make_arm, train_on_rollouts
    ref = make_arm(cfg1, ARM, policy, draft, generate_config(cfg1, tok.eos_id, tok.pad_id))
    rows = []
    for step in range(len(groups[0])):
        parts = [g[step] for g in groups]
        ro = Rollouts([p for x in parts for p in x.pairs], parts[0].group_size,
                      torch.cat([x.advantages for x in parts]), [lp for x in parts for lp in x.engine_logprobs])
        rows.append(train_on_rollouts(ref, cfg1, ro, tok.pad_id, device))
    return rows, whole(ref)


def compare_metrics(rows: list[dict], ref: list[dict], tol: dict) -> dict:
    """Per step and key: the two values, the relative deviation, the bound and whether it holds."""
    out, ok = [], True
    for r, q in zip(rows, ref):
        step = {}
        for k in (*METRIC_KEYS, *EXACT, "policy/aux_loss"):
            if k not in q or k not in r:
                continue
            rtol = (0.0 if k in EXACT else tol["logprob_rtol"] if k in LOGPROB_KEYS
                    else tol["clip_rtol"] if k == "policy/clip_frac" else tol["rtol"])
            good = close(float(r[k]), float(q[k]), rtol)
            ok &= good
            step[k] = {"run": float(r[k]), "world1": float(q[k]), "rel_dev": abs(r[k] - q[k]) / max(1.0, abs(q[k])),
                       "bound": rtol, "ok": good}
        out.append(step)
    return {"steps": out, "ok": ok}


def compare_params(mine: dict, ref: dict, tol: dict, lr: float, updates: int) -> dict:
    """This rank's view of the world-N weights against the reference's (module docstring's bounds)."""
    if mine.keys() != ref.keys():
        return {"ok": False, "keys_differ": sorted(set(mine) ^ set(ref))}
    if any(mine[k].shape != ref[k].shape for k in ref):
        return {"ok": False, "shapes_differ": [k for k in ref if mine[k].shape != ref[k].shape]}
    a = torch.cat([mine[k].double().flatten() for k in ref])
    b = torch.cat([ref[k].double().flatten() for k in ref])
    d = (a - b).abs()
    res = {"max_abs": d.max().item(), "mean_abs": d.mean().item(), "numel": d.numel()}
    if tol.get("param_atol") is not None:  # fp64: summation order only
        res["bound"] = f"atol {tol['param_atol']} + rtol {tol['rtol']}"
        res["ok"] = bool((d <= tol["param_atol"] + tol["rtol"] * b.abs()).all())
    else:  # bf16: the lr bound of an AdamW update per flipped sign
        res.update(max_over_lr=res["max_abs"] / lr, mean_over_lr=res["mean_abs"] / lr, updates=updates,
                   bound=f"max <= {tol['param_max_lr']} lr x {updates}, mean <= {tol['param_mean_lr']} lr x {updates}")
        res["ok"] = (res["max_abs"] <= tol["param_max_lr"] * lr * updates
                     and res["mean_abs"] <= tol["param_mean_lr"] * lr * updates)
    return res


def perturb(st, delta: float) -> None:
    """Add `delta` to the first element this rank holds of the policy's first parameter (its FSDP shard or expert
    slice, or its whole copy): what a rank that trained wrongly would hold. The check must catch it."""
    from torch.distributed.tensor import DTensor
    p = next(st.policy.parameters())
    with torch.no_grad():
        (p.to_local() if isinstance(p, DTensor) else p).view(-1)[0] += delta


def check_layout(name: str, a, world: int, rank: int, device, work: Path) -> dict:
    """One layout at world N against its reference (module docstring): the world-1 replay of the run's rollouts,
    or, for a layout with a twin, the twin run in the same processes (the same rollouts on CPU)."""
    from specco.runner.rl import run_arm
    over, moe, twin = LAYOUTS[name]
    gpu = device.type == "cuda"
    prec = ("train.amp=bf16", "rollout.dtype=bfloat16") if gpu else ()
    base = (*BASE, *prec, "device=" + device.type)
    dtype = torch.float32 if gpu else torch.float64
    tol = GPU_TOL if gpu else CPU_TOL
    runs = {}
    for kind, extra in (("run", ()), ("twin", twin)):
        if extra is None:
            continue
        c = load_config(DEMO, [*base, *over(world), *extra, f"out_dir={work}"])
        p = c.parallel
        mesh = Mesh.build(p.dp, p.cp, tp=p.tp, rollout_tp=c.rollout.tp, pp=p.pp, ep=p.ep,
                          dp_shard=p.shard if p.fsdp else 1)
        tok, policy, draft = models(moe, dtype, device)
        st, rec = {}, []
        rows = run_arm(c, ARM, policy, draft, DigitTask(), tok, work / f"{name}_{kind}", device, progress=False,
                       mesh=mesh, state_out=st, record=rec)
        runs[kind] = (rows, st["state"], rec, mesh, c)
    rows, st, rec, mesh, cfg = runs["run"]
    if a.perturb_rank == rank and name == a.perturb_layout:
        # 10x the parameter bound: far outside it, yet a small change (the metrics are already logged)
        perturb(st, 10 * (tol["param_atol"] if tol.get("param_atol") else tol["param_max_lr"] * cfg.train.lr * 8))
    mine = whole(st)
    if not moe:  # the world-1 trainer on the union of the DP ranks' rollouts, on rank 0, sent to every rank
        groups = [None] * mesh.dp
        dist.all_gather_object(groups, rec, group=mesh.dp_group)  # every DP rank's rollouts, in DP order
        ref = [None, None]
        if rank == 0:
            cfg1 = load_config(DEMO, [*base, f"out_dir={work}"])
            ref = list(replay(cfg1, *models(moe, dtype, device)[1:], tok=tok, groups=groups, device=device))
        dist.broadcast_object_list(ref, src=0)
        ref_rows, ref_whole = ref
        reference = "world-1 replay of the run's rollouts"
    else:  # the aux loss is a statistic of each rank's micro-batch (not of the union): the ep 1 twin's trajectory
        ref_rows, ref_whole = runs["twin"][0], whole(runs["twin"][1])
        reference = f"the same ranks at {', '.join(twin)}"
    updates = cfg.train.steps * cfg.train.ppo_epochs * cfg.train.minibatches
    lr = max(cfg.train.lr, cfg.train.draft_lr)
    params = [None] * world
    dist.all_gather_object(params, compare_params(mine, ref_whole, tol, lr, updates))
    res = {"overrides": list(over(world)), "moe": moe, "reference": reference,
           "metrics": compare_metrics(rows, ref_rows, tol), "params_per_rank": params,
           "rewards": [r.get("reward") for r in rows], "tau": [r.get("tau") for r in rows]}
    checks = [res["metrics"]["ok"], *(x["ok"] for x in params)]
    if twin is not None:  # the rollouts of the two runs: the same tokens (CPU, fp64), reported (GPU, bf16)
        twin_rows, _, twin_rec = runs["twin"][:3]
        pairs = [(x, y) for ro, ro1 in zip(rec, twin_rec) for x, y in zip(ro.pairs, ro1.pairs)]
        same = sum(x == y for x, y in pairs) / max(1, len(pairs))
        rew = [(r["reward"], q["reward"]) for r, q in zip(rows, twin_rows)]
        res["rollouts_vs_twin"] = {"rows_equal": same, "rewards": rew}
        if not gpu:
            checks.append(same == 1.0 and all(close(x, y, tol["rtol"]) for x, y in rew))
    res["passed"] = all(checks)
    if rank == 0:
        dev = ", ".join(f"{x.get('max_abs', float('nan')):.2e}" for x in params)
        print(f"{name}: {'PASS' if res['passed'] else 'FAIL'} against {reference}; params max |dw| per rank {dev}",
              flush=True)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--out", default=None)
    ap.add_argument("--perturb-rank", type=int, default=-1, help="tests: this rank's trained weights perturbed")
    ap.add_argument("--perturb-layout", default="dp_shard", help="tests: in this layout")
    a = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (the device machines' rule)
    mesh0 = Mesh.build(int(os.environ.get("WORLD_SIZE", 1)), backend="nccl" if a.device == "cuda" else "gloo")
    world, rank = mesh0.world, mesh0.rank
    device = torch.device("cuda", torch.cuda.current_device()) if a.device == "cuda" else torch.device("cpu")
    if a.device == "cuda":  # the replay and the run on the same matmul precision (fp32 masters: no TF32)
        torch.backends.cuda.matmul.allow_tf32 = False
    work = [tempfile.mkdtemp(prefix="mgpu_check_") if rank == 0 else None]
    dist.broadcast_object_list(work, src=0)  # one out_dir for all ranks (the sharded checkpoints' convention)
    results = {n: check_layout(n, a, world, rank, device, Path(work[0])) for n in a.layouts.split(",")}
    passed = all(r["passed"] for r in results.values())
    if rank == 0:
        write_results({"world": world, "tolerances": GPU_TOL if a.device == "cuda" else CPU_TOL, "passed": passed,
                       "layouts": results}, "multi_gpu_check", device, a.out)
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    from specco.parallel.mesh import run_worker  # noqa: E402
    run_worker(main)  # under torchrun: no interpreter teardown after success (its docstring)
