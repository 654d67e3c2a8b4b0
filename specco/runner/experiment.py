"""The comparison around a job (`specco compare`, `specco demo`): several arms from one starting policy and seed —
no draft, a frozen draft, co-trained drafts of any kind — and the report that sets them side by side.

The arms run through the same pipeline as a job (runner/pipeline.py: one arm per `arms` entry, each in
out_dir/arms/<arm>/); the measurements only a comparison needs (config plain_baseline: a plain decode and
train step on the arm's own tokens; frozen_shadow: a frozen copy of the warm draft scored beside the
co-trained one) attach to each arm's RL step as hooks (runner/measure.py), so the step itself measures
nothing but itself. This module writes what they measured:
out_dir/report.md, summary.json and the plots.
"""
from __future__ import annotations

import json
from pathlib import Path

from .report import (markdown_table, plain_baseline_table, plot_arms, plot_time_split, same_token_end_to_end,
                     shadow_position_table, shadow_table, steady_rows, time_split, window_mean)

# The comparison's arms when a config names one (`specco compare CONFIG` on a job's config)
DEFAULT_ARMS = ("none", "frozen", "cotrained")


_FIRST_KEYS = (("completion_len", "completion len"), ("completion_len_max", "len max"),
               ("rollout/rows_at_max", "rows at max"), ("tau", "tau"), ("rollout/slowest_row_tau", "slowest row tau"),
               ("rollout/tau_rows_at_max", "tau of rows at max"), ("target_forwards", "target forwards"),
               ("time/rollout_tail", "tail s"),
               ("time/rollout", "rollout s"), ("tokens_per_s", "tokens/s"))


def first_step_table(arm_rows) -> tuple[str, dict] | None:
    """The like-for-like comparison: every arm's step 1 (same SFT policy, same prompts; sampled with each
    arm's own random stream), with tokens/s relative to the no-draft arm. None without a 'none' arm."""
    firsts = {a: rs[0] for a, rs in arm_rows.items() if rs}
    if "none" not in firsts:
        return None
    base = firsts["none"].get("tokens_per_s")
    out, rows = {}, []
    for arm, r in firsts.items():
        vals = {name: r.get(k, float("nan")) for k, name in _FIRST_KEYS}
        vals["tokens/s vs none"] = r.get("tokens_per_s", float("nan")) / base if base else float("nan")
        # the batch decodes until its last row stops: that row emitted <= len max tokens in every round, so
        # its own acceptance length is at most len max / target forwards (1.0 without a draft)
        vals["slowest row tau <="] = r.get("completion_len_max", float("nan")) / max(1, r.get("target_forwards", 1))
        out[arm] = vals
        rows.append([arm, *vals.values()])
    return markdown_table(["arm", *out["none"].keys()], rows), out


def write_report(cfg, out: Path, arm_rows, sft_m, warm_m, elapsed, warm_by_kind: dict | None = None) -> dict:
    plot_arms(arm_rows, [("tau", "acceptance length tau"), ("reward", "reward (band: ±1 s.e. over prompts)"),
                         ("completion_len", "mean completion length")], out / "tau_reward.png", smooth=3)
    plot_arms(arm_rows, [("draft/loss", "draft loss on the current rollouts"), ("accept/pos1", "acceptance, position 1"),
                         ("rollout/tau_full_k", "tau at the full k (apart from the controller's k)")],
              out / "draft.png", smooth=3)
    plot_time_split(arm_rows, out / "time_split.png")
    learn_header = ["arm", "reward (first 25%)", "reward (last 25%)", "accuracy (last 25%)", "completion len (first 25%)",
                    "completion len (last 25%)", "tau (first 25%)", "tau (last 25%)", "tau at full k (first 25%)",
                    "tau at full k (last 25%)", "accept pos1 (first 25%)",
                    "accept pos1 (last 25%)", "draft loss (first 25%)", "draft loss (last 25%)"]
    learn_keys = [("reward", 0, .25), ("reward", .75, 1), ("accuracy", .75, 1), ("completion_len", 0, .25),
                  ("completion_len", .75, 1), ("tau", 0, .25), ("tau", .75, 1), ("rollout/tau_full_k", 0, .25),
                  ("rollout/tau_full_k", .75, 1), ("accept/pos1", 0, .25),
                  ("accept/pos1", .75, 1), ("draft/loss", 0, .25), ("draft/loss", .75, 1)]
    # "est. same-token rollout speedup": rollout/measured_speedup, each step's decoding against an estimate of
    # plain decoding of the same tokens at the same levels (runner.rollouts.measured_speedup) — free of the work
    # drift between arms that the per-step ratios below carry; an arm without speculation control has none. Its
    # end-to-end counterpart (report.same_token_end_to_end) keeps the arm's own other phases on both sides. An
    # estimate: it prices plain rounds at the costs the controller timed when each level began (short contexts),
    # and on the H200's long workload it read ~20% below the measured plain baseline (plain_baseline_table)
    time_header = ["arm", "tokens/s", "rollout s/step", "log-prob s/step", "train s/step", "refit s/step",
                   "other s/step", "step s", "rollout share", "est. same-token rollout speedup",
                   "est. same-token end-to-end speedup"]
    learn_rows, time_rows = [], []
    summary = {"arms": {}, "sft": sft_m, "warm_start": warm_m, "elapsed_s": elapsed,
               "warm_start_by_kind": warm_by_kind or {}}
    for arm, rs in arm_rows.items():
        lr = [arm] + [window_mean(rs, k, lo, hi) for k, lo, hi in learn_keys]
        split = time_split(rs)  # means over steps 2.. (the first captures the CUDA graphs)
        step_s = sum(split.values())
        tr = [arm, window_mean(steady_rows(rs), "tokens_per_s"), split["rollout"], split["log-prob"], split["train"],
              split["refit"] + split["refit guard"], split["other"], step_s,
              split["rollout"] / step_s if step_s else float("nan"),
              window_mean(steady_rows(rs), "rollout/measured_speedup"), same_token_end_to_end(rs)]
        learn_rows.append(lr)
        time_rows.append(tr)
        summary["arms"][arm] = {**dict(zip(learn_header[1:], lr[1:])), **dict(zip(time_header[1:], tr[1:]))}
    base = summary["arms"].get("none")
    if base:
        # tokens/s: decoding speed alone; the per-step speedups also count that the arms' policies (hence
        # their completion lengths) drift apart after step 1
        time_header += ["tokens/s vs none", "rollout speedup", "train vs none", "end-to-end speedup"]
        for arm, tr in zip(arm_rows, time_rows):
            s = summary["arms"][arm]
            s["tokens/s vs none"] = s["tokens/s"] / base["tokens/s"]
            s["rollout speedup vs none"] = base["rollout s/step"] / s["rollout s/step"]
            s["train overhead vs none"] = s["train s/step"] / base["train s/step"]
            s["end-to-end speedup vs none"] = base["step s"] / s["step s"]
            tr += [s["tokens/s vs none"], s["rollout speedup vs none"], s["train overhead vs none"],
                   s["end-to-end speedup vs none"]]
    table = markdown_table(learn_header, learn_rows) + "\n\n" + markdown_table(time_header, time_rows)
    # the comparison tables, each when the run has its data: (summary key, caption, (markdown, values) or None)
    for key, caption, made in (
            ("step 1", "Step 1 (every arm starts from the same policy and prompts; includes the engine's first-call "
             "setup, on a GPU its CUDA graph capture)", first_step_table(arm_rows)),
            ("plain baseline", "Plain baseline (config plain_baseline: every step's prompts also decoded without the "
             "draft on the same engine, coupled sampling, so the same tokens, and every step's updates also run "
             "without the draft on the same minibatches, then undone; steps 2..; the no-draft step is the arm's step "
             "with those two in place of its rollout and train)", plain_baseline_table(arm_rows)),
            ("frozen shadow", "Frozen shadow (config frozen_shadow: the co-trained draft and a frozen copy of its warm "
             "draft, both scored on the arm's own rollouts under the sampling policy before each update; simulated "
             "tau)", shadow_table(arm_rows)),
            ("frozen shadow by output position", "Frozen shadow by output position (config shadow_window: the same "
             "two drafts scored on the tokens of each window of output positions)", shadow_position_table(arm_rows))):
        if made:
            summary[key] = made[1]
            table += f"\n\n{caption}:\n\n" + made[0]
    acc = []
    firsts = {arm: json.loads(l) for arm in arm_rows if (f := out / "arms" / arm / "eval.jsonl").exists()
              for l in f.read_text().splitlines()[:1]}
    if firsts:  # the RL starting policy's evaluation (every arm starts from it; the first arm's row)
        a = next(iter(firsts.values()))
        acc = [f"Accuracy of the RL starting policy on {a['eval/n']} held-out prompts: greedy "
               f"{a['eval/accuracy_greedy']:.3f}, sampled {a['eval/accuracy_sampled']:.3f}.\n"]
    md = ["# specco comparison report\n", f"Data `{cfg.data.source}`, policy `{cfg.policy.source}`, "
          f"k = {cfg.rollout.k}" + (f" (block drafters: {cfg.rollout.block_k})" if cfg.rollout.block_k else "")
          + f", T = {cfg.rollout.temperature} ({cfg.rollout.sampler} sampling), {cfg.train.steps} RL steps, "
          f"total time {elapsed:.0f} s.\n", *acc, "## Arms\n", table, "",
          "![tau and reward](tau_reward.png)\n", "![draft](draft.png)\n", "![time split](time_split.png)\n",
          "## Warm start (offline draft training against the frozen SFT policy)\n",
          "```json", json.dumps(warm_by_kind or warm_m, indent=1), "```", "## SFT\n", "```json", json.dumps(sft_m), "```"]
    (out / "report.md").write_text("\n".join(md))
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print("\n" + table + f"\n\nreport: {out / 'report.md'}", flush=True)
    return summary
