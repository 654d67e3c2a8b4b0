"""`specco demo` / `specco train`: SFT -> draft warm start -> RL with three arms -> report.

Every stage writes into `out_dir` and is skipped when its output already exists, so a run that
was interrupted resumes where it stopped (the RL arms resume from their own checkpoints).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from ..config import RunConfig, config_to_dict
from ..data.tasks import get_task
from ..data.tokenizer import build_char_tokenizer, load_tokenizer
from ..model.draft import Eagle3Draft
from ..model.hf_io import load_policy, save_policy
from ..model.policy import Policy
from ..train.cotrain import StepConfig
from ..train.sft import evaluate, sft, tiny_policy_config
from .report import markdown_table, plot_arms, read_jsonl
from .rl import generate_config, run_arm, step_config
from .warmstart import measure_tau, new_draft, sample_pool, warm_start


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _say(msg: str, progress: bool):
    if progress:
        print(msg, flush=True)


def prepare_policy(cfg: RunConfig, out: Path, device, progress=True):
    """The RL starting point: SFT'd tiny policy, SmolLM2, or a HF directory. Cached in out/sft_policy."""
    pol_dir = out / "sft_policy"
    src = cfg.policy.source
    if (pol_dir / "config.json").exists():
        return load_policy(pol_dir, device=device), load_tokenizer(pol_dir), json.loads(
            (pol_dir / "sft_metrics.json").read_text()) if (pol_dir / "sft_metrics.json").exists() else {}
    dtype = getattr(torch, cfg.policy.dtype)
    if src == "tiny":
        tok = build_char_tokenizer()
        task = get_task(cfg.task.name, mode=cfg.task.mode, **task_overrides(cfg))
        torch.manual_seed(cfg.train.seed)
        pc = tiny_policy_config(tok, cfg.policy.hidden_size, cfg.policy.num_layers,
                                cfg.policy.num_heads, cfg.policy.num_kv_heads,
                                cfg.policy.intermediate_size)
        policy = Policy(pc).to(device)
        _say(f"[1/4] SFT of a {pc.num_params / 1e6:.2f}M-parameter policy on {cfg.task.name} "
             f"({cfg.train.sft_steps} steps)", progress)
        t = time.perf_counter()
        m = sft(policy, tok, task, cfg.train.sft_steps, lr=cfg.train.sft_lr, seed=cfg.train.seed,
                progress=progress)
        metrics = {"sft_time_s": time.perf_counter() - t, "sft_final_loss": m.get("final_loss")}
    else:
        if src == "smollm2":
            from ..data.smollm2 import prepare_smollm2
            src_dir = prepare_smollm2(out.parent / "_smollm2")
        else:
            src_dir = Path(src)
        policy, tok, metrics = load_policy(src_dir, device=device), load_tokenizer(src_dir), {}
        _say(f"[1/4] loaded policy {src_dir} ({policy.cfg.num_params / 1e6:.1f}M parameters)", progress)
    policy = policy.to(dtype)
    save_policy(policy, pol_dir)
    tok.save(pol_dir)
    (pol_dir / "sft_metrics.json").write_text(json.dumps(metrics))
    return policy, tok, metrics


def task_overrides(cfg: RunConfig) -> dict:
    """reasoning_gym options from the config (0 = keep the task preset's value)."""
    t = cfg.task
    opts = {"min_terms": t.min_terms, "max_terms": t.max_terms, "max_digits": t.max_digits}
    return {k: v for k, v in opts.items() if v}


def prepare_draft(cfg: RunConfig, policy, tok, task, out: Path, progress=True):
    """Warm-started draft (cached in out/warm_draft) and the offline sim-vs-real tau figures."""
    d_dir = out / "warm_draft"
    if (d_dir / "draft_config.json").exists():
        dev = next(policy.parameters()).device
        return Eagle3Draft.load(d_dir, device=dev), json.loads((d_dir / "warm_metrics.json").read_text())
    gcfg = generate_config(cfg, tok.eos_id, tok.pad_id)
    t = time.perf_counter()
    tokens, mask = sample_pool(policy, task, tok, n_prompts=cfg.train.warm_start_prompts, group=4, gen_cfg=gcfg,
                               seed=cfg.train.seed + 1000)
    draft = new_draft(policy, tokens, cfg.draft.draft_vocab_size, cfg.draft.aux_layer_ids,
                      cfg.draft.init_head_from_policy)
    _say(f"[2/4] draft warm start: {cfg.train.warm_start_steps} offline steps on "
         f"{tokens.shape[0]} policy samples", progress)
    scfg: StepConfig = step_config(cfg, "cotrained")
    hist = warm_start(policy, draft, tokens, mask, cfg.train.warm_start_steps, cfg.train.draft_lr,
                      batch_size=64, scfg=scfg, seed=cfg.train.seed, progress=progress)
    last = hist[-min(10, len(hist)):] if hist else []
    sim = sum(h["draft/sim_accept_len"] for h in last) / max(1, len(last))
    real = {f"T={T}": measure_tau(policy, draft, task, tok, min(64, cfg.train.warm_start_prompts), cfg.rollout.k, T,
                                  cfg.rollout.max_new_tokens, seed=cfg.train.seed + 2000)
            for T in (0.0, cfg.rollout.temperature)}
    metrics = {"warm_time_s": time.perf_counter() - t, "sim_tau_start": hist[0]["draft/sim_accept_len"] if hist else None,
               "sim_tau_end": sim, "real": real, "draft_params": sum(p.numel() for p in draft.parameters())}
    draft.save(d_dir)
    (d_dir / "warm_metrics.json").write_text(json.dumps(metrics, indent=1))
    return draft, metrics


def run_demo(cfg: RunConfig, progress: bool = True) -> dict:
    """The whole job. Returns the summary that is also written to out_dir/summary.json."""
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config_to_dict(cfg), indent=1))
    device = pick_device(cfg.device)
    if device.type == "cuda":  # fp32 policies train with TF32 matmuls (10-bit mantissa products)
        torch.set_float32_matmul_precision("high")
    t_start = time.perf_counter()
    policy, tok, sft_m = prepare_policy(cfg, out, device, progress)
    mode = cfg.task.mode if cfg.policy.source == "tiny" else "chat"
    task = get_task(cfg.task.name, mode=mode, tokenizer=tok, **task_overrides(cfg))
    ev = evaluate(policy, tok, task, n=cfg.task.eval_size, temperature=cfg.rollout.temperature)
    sft_m["accuracy_T"] = ev["accuracy"]
    draft, warm_m = prepare_draft(cfg, policy, tok, task, out, progress)
    _say(f"[3/4] RL: {cfg.train.steps} GRPO steps x arms {', '.join(cfg.arms)}", progress)
    arm_rows = {}
    for arm in cfg.arms:
        arm_rows[arm] = run_arm(cfg, arm, policy, draft, task, tok, out / "arms" / arm, device,
                                progress=progress)
        # include rows from before a resume, for the report
        arm_rows[arm] = read_jsonl(out / "arms" / arm / "metrics.jsonl")
    _say("[4/4] report", progress)
    summary = write_report(cfg, out, arm_rows, sft_m, warm_m, time.perf_counter() - t_start)
    return summary


def _mean(rows, key, lo=0.0, hi=1.0):
    """Mean of `key` over the fraction [lo, hi) of the steps."""
    vals = [r[key] for r in rows if key in r]
    if not vals:
        return float("nan")
    a, b = int(len(vals) * lo), max(int(len(vals) * lo) + 1, int(len(vals) * hi))
    return sum(vals[a:b]) / len(vals[a:b])


def write_report(cfg, out: Path, arm_rows, sft_m, warm_m, elapsed) -> dict:
    plot_arms(arm_rows, [("tau", "acceptance length tau"), ("reward", "reward")], out / "tau_reward.png",
              smooth=3)
    plot_arms(arm_rows, [("draft/loss", "draft loss (TTT)"), ("accept/pos1", "acceptance, position 1")],
              out / "draft.png", smooth=3)
    header = ["arm", "reward (first 25%)", "reward (last 25%)", "tau (first 25%)", "tau (last 25%)",
              "tokens/s", "rollout s/step", "train s/step", "refit s/step"]
    rows, summary = [], {"arms": {}, "sft": sft_m, "warm_start": warm_m, "elapsed_s": elapsed}
    for arm, rs in arm_rows.items():
        r = [arm, _mean(rs, "reward", 0, .25), _mean(rs, "reward", .75, 1), _mean(rs, "tau", 0, .25),
             _mean(rs, "tau", .75, 1), _mean(rs, "tokens_per_s"), _mean(rs, "time/rollout"),
             _mean(rs, "time/train"), _mean(rs, "time/refit")]
        rows.append(r)
        summary["arms"][arm] = dict(zip(header[1:], r[1:]))
    base = summary["arms"].get("none")
    if base:
        for arm, s in summary["arms"].items():
            s["rollout speedup vs none"] = base["rollout s/step"] / s["rollout s/step"]
            s["train overhead vs none"] = s["train s/step"] / base["train s/step"]
    table = markdown_table(header, rows)
    md = [f"# specco demo report\n", f"Task `{cfg.task.name}`, policy `{cfg.policy.source}`, "
          f"k = {cfg.rollout.k}, T = {cfg.rollout.temperature}, {cfg.train.steps} RL steps, "
          f"total time {elapsed:.0f} s.\n", "## Arms\n", table, "",
          "![tau and reward](tau_reward.png)\n", "![draft](draft.png)\n",
          "## Warm start (offline draft training against the frozen SFT policy)\n",
          "```json", json.dumps(warm_m, indent=1), "```", "## SFT\n", "```json", json.dumps(sft_m), "```"]
    (out / "report.md").write_text("\n".join(md))
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print("\n" + table + f"\n\nreport: {out / 'report.md'}", flush=True)
    return summary
