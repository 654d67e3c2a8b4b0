"""`specco demo` / `specco train`: SFT -> draft warm starts (one per draft kind) -> RL arms -> report.

Every stage writes into `out_dir` and is skipped when its output already exists, so a run that
was interrupted resumes where it stopped (the RL arms resume from their own checkpoints).
"""
from __future__ import annotations

import copy
import functools
import gc
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import RunConfig
from ..data.tasks import get_task
from ..data.tokenizer import build_char_tokenizer, load_tokenizer
from ..model.hf_io import load_policy, save_policy
from ..model.policy import Policy
from ..parallel.mesh import Mesh
from ..rollout.engine import RolloutEngine
from ..rollout.shapes import speculation_control
from ..train.cotrain import AMP_DTYPES, StepConfig
from ..train.sft import sft, tiny_policy_config
from .report import (markdown_table, plain_baseline_table, plot_arms, plot_time_split, read_jsonl, same_token_end_to_end,
                     shadow_table, steady_rows, time_split, window_mean)
from .derive import arm_config, at_temperature, check_parallel, generate_config, step_config, warm_configs
from .rl import run_arm
from .stages import (RunLock, commit_dir, load_stage, record_config, remove_stale_temporaries, seed_stage,
                     warm_draft_stage)
from ..faults import point
from ..train.nonfinite import check_finite
from .warmstart import initial_draft, load_draft_dir, measure_tau, sample_pool, warm_start

# Pretrained policies' SFT reads task stream `seed + PRETRAINED_SFT_STREAM`, disjoint from the RL
# prompts (stream `seed`), the warm-start pool (+1000), the tau probe (+2000) and evaluation (1):
# a few SFT steps should teach the answer format, not pre-solve the RL problems.
PRETRAINED_SFT_STREAM = 3000


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
    if pol_dir.is_dir():  # committed whole (stages.commit_dir): done
        return load_stage(pol_dir, lambda: (load_policy(pol_dir, device=device), load_tokenizer(pol_dir),
                                            json.loads((pol_dir / "sft_metrics.json").read_text())))
    dtype = getattr(torch, cfg.policy.dtype)
    if src == "tiny":
        tok = build_char_tokenizer()
        task = get_task(cfg.task.name, mode=cfg.task.mode, cot_fraction=cfg.task.cot_fraction,
                        **task_overrides(cfg))
        seed_stage(cfg.train.seed, "sft")
        pc = tiny_policy_config(tok, cfg.policy.hidden_size, cfg.policy.num_layers,
                                cfg.policy.num_heads, cfg.policy.num_kv_heads,
                                cfg.policy.intermediate_size, cfg.policy.max_positions)
        policy = Policy(pc).to(device)
        _say(f"[1/4] SFT of a {pc.num_params / 1e6:.2f}M-parameter policy on {cfg.task.name} "
             f"({cfg.train.sft_steps} steps)", progress)
        t = time.perf_counter()
        m = sft(policy, tok, task, cfg.train.sft_steps, batch_size=cfg.train.sft_batch, lr=cfg.train.sft_lr,
                seed=cfg.train.seed, progress=progress, amp_dtype=AMP_DTYPES[cfg.train.amp],
                micro_batch_rows=cfg.train.sft_micro_batch_rows)
        metrics = {"sft_time_s": time.perf_counter() - t, "sft_final_loss": m["loss_last"]}
    else:
        if src == "smollm2":
            from ..data.smollm2 import prepare_smollm2
            src_dir = prepare_smollm2(out.parent / "_smollm2")
        else:
            src_dir = Path(src)
        policy, tok = load_policy(src_dir, device=device).to(dtype), load_tokenizer(src_dir)
        _say(f"[1/4] loaded policy {src_dir} ({policy.cfg.num_params / 1e6:.1f}M parameters)", progress)
        metrics = format_sft(cfg, policy, tok, progress) if cfg.train.sft_steps else {}
    policy = policy.to(dtype)
    check_finite(f"SFT ({cfg.train.sft_steps} steps)", {"sft/final_loss": metrics.get("sft_final_loss", 0.0)},
                 modules=(policy,))
    with commit_dir(pol_dir) as tmp:
        save_policy(policy, tmp)
        point("sft_policy/model")
        tok.save(tmp)
        point("sft_policy/tokenizer")
        (tmp / "sft_metrics.json").write_text(json.dumps(metrics))
    return policy, tok, metrics


def format_sft(cfg: RunConfig, policy, tok, progress=True) -> dict:
    """A short SFT of a pretrained policy on chat prompts -> `<answer>{a}</answer><eos>`.

    Instruct models such as SmolLM2 answer in prose ("The answer is 6."), which reasoning_gym's
    extractor scores 0, so RL would start with no reward signal. A few small-LR steps teach the tag
    format. Accuracy is measured before and after (greedy and at the rollout temperature).
    """
    task = get_task(cfg.task.name, mode="chat", tokenizer=tok, **task_overrides(cfg))
    t = cfg.train
    before = engine_accuracy(cfg, policy, tok, task)
    _say(f"      accuracy before SFT: {before}", progress)
    _say(f"      format SFT: {t.sft_steps} steps x {t.sft_batch} chat prompts, lr {t.sft_lr:g}", progress)
    m = sft(policy, tok, task, t.sft_steps, batch_size=t.sft_batch, lr=t.sft_lr,
            seed=t.seed + PRETRAINED_SFT_STREAM, progress=progress)
    return {"sft_time_s": m["time_s"], "sft_steps": t.sft_steps, "sft_batch": t.sft_batch,
            "sft_lr": t.sft_lr, "sft_loss_first": m["loss_first"], "sft_final_loss": m["loss_last"],
            "before": before}


@torch.no_grad()
def engine_accuracy(cfg: RunConfig, policy, tok, task, eval_seed: int = 1) -> dict:
    """Accuracy on `task.eval_size` held-out prompts, generated by the KV-cached rollout engine.

    `train.sft.evaluate` recomputes the whole sequence per new token, which costs minutes for a 135M
    model with ~130-token chat prompts on CPU and far longer for 2.5K-token completions. Same stream
    (`eval_seed`) and the same `score == 1` rule; `max_new_tokens` is the rollout budget, so the
    policy may write before it answers. `tagged` = fraction of completions with an <answer> tag (chat mode).
    """
    items = task.prompts(cfg.task.eval_size, seed=eval_seed)
    prompts = [task.prompt_ids(it, tok) for it in items]
    dev = next(policy.parameters()).device
    res = {"n": len(items)}
    run_gcfg = generate_config(cfg, tok.stop_ids, tok.pad_id)
    for name, temp in (("greedy", 0.0), ("T", cfg.rollout.temperature)):
        gcfg = at_temperature(run_gcfg, temp)
        out = RolloutEngine(policy, None, gcfg).generate(
            prompts, generator=torch.Generator(device=dev).manual_seed(cfg.train.seed))
        texts = [tok.decode(out.tokens[i, :int(out.lengths[i])]) for i in range(len(items))]
        scores = [task.score(x, it) for x, it in zip(texts, items)]
        res[f"accuracy_{name}"] = sum(sc == 1.0 for sc in scores) / len(items)
        res[f"tagged_{name}"] = sum("<answer>" in x for x in texts) / len(items)
    return res


def task_overrides(cfg: RunConfig) -> dict:
    """reasoning_gym options from the config (0 = keep the task preset's value)."""
    t = cfg.task
    opts = {"min_terms": t.min_terms, "max_terms": t.max_terms, "max_digits": t.max_digits}
    return {k: v for k, v in opts.items() if v}


def prepare_drafts(cfg: RunConfig, policy, tok, task, out: Path, progress=True) -> tuple[dict, dict]:
    """Every warm draft the arms use ({kind: draft}, {kind: warm metrics}), kinds as derive.warm_configs.
    The warm-start pool is the same for every kind (one seed): sampled at most once per run, and not at all
    when every kind's warm draft is already on disk."""
    pool = warm_pool(cfg, policy, task, tok)
    drafts, metrics = {}, {}
    for kind in warm_configs(cfg):
        drafts[kind], metrics[kind] = prepare_draft(cfg, policy, tok, task, out, progress, kind=kind, pool=pool)
    return drafts, metrics


def warm_pool(cfg: RunConfig, policy, task, tok):
    """The warm-start pool (tokens, mask) of policy samples, as a function that samples it on its first call
    only. Sampled without a draft, so the run config's k (or any arm's) does not change it."""
    gcfg = generate_config(cfg, tok.stop_ids, tok.pad_id)
    return functools.cache(lambda: sample_pool(policy, task, tok, n_prompts=cfg.train.warm_start_prompts, group=4,
                                               gen_cfg=gcfg, seed=cfg.train.seed + 1000))


def prepare_draft(cfg: RunConfig, policy, tok, task, out: Path, progress=True, kind: str | None = None,
                  pool=None):
    """The warm-started draft of `kind` (default draft.kind) and the offline sim-vs-real tau figures, cached
    in out/warm_draft (draft.kind) or out/warm_draft_<kind> (stages.warm_draft_stage). `pool`: warm_pool's
    function, shared by the kinds (None: this call's own). The draft and its warm start see the config of
    the kind's co-trained arm (derive.warm_configs: a new block drafter's γ is its rollout.k)."""
    kind = kind or cfg.draft.kind
    stage = warm_draft_stage(kind, cfg.draft.kind)
    d_dir = out / stage
    if d_dir.is_dir():  # committed whole (stages.commit_dir): done
        dev = next(policy.parameters()).device
        return load_stage(d_dir, lambda: (load_draft_dir(d_dir, device=dev),
                                          json.loads((d_dir / "warm_metrics.json").read_text())))
    point(f"{stage}/start")
    kcfg = warm_configs(cfg)[kind]
    gcfg = generate_config(kcfg, tok.stop_ids, tok.pad_id)
    t = time.perf_counter()  # warm_time_s: includes sampling the pool when this kind is the first to need it
    tokens, mask = (pool or warm_pool(cfg, policy, task, tok))()
    seed_stage(cfg.train.seed, stage)  # the new draft's init draws from the global RNG
    draft = initial_draft(policy, tokens, kcfg.draft, gamma=kcfg.rollout.k, mask_fallback=tok.pad_id)  # new, or imported from draft.init
    _say(f"[2/4] {kind} draft warm start: {cfg.train.warm_start_steps} offline steps x "
         f"{cfg.train.warm_start_batch} rows on {tokens.shape[0]} policy samples, draft vocab "
         f"{draft.cfg.draft_vocab_size}/{draft.cfg.target_vocab_size}", progress)
    scfg: StepConfig = step_config(kcfg, "cotrained")
    hist = warm_start(policy, draft, tokens, mask, cfg.train.warm_start_steps, cfg.train.warm_start_lr,
                      batch_size=cfg.train.warm_start_batch, scfg=scfg, seed=cfg.train.seed,
                      progress=progress)
    for i, h in enumerate(hist):
        check_finite(f"{kind} draft warm start step {i + 1}", h, ("draft/loss", "draft/grad_norm"))
    check_finite(f"{kind} draft warm start", modules=(draft,))
    last = hist[-min(10, len(hist)):] if hist else []
    sim = sum(h["draft/sim_accept_len"] for h in last) / max(1, len(last))
    real = {f"T={T}": measure_tau(policy, draft, task, tok, min(64, cfg.train.warm_start_prompts),
                                  at_temperature(gcfg, T),
                                  seed=cfg.train.seed + 2000)
            for T in (0.0, cfg.rollout.temperature)}
    metrics = {"warm_time_s": time.perf_counter() - t, "sim_tau_start": hist[0]["draft/sim_accept_len"] if hist else None,
               "sim_tau_end": sim, "real": real, "draft_vocab_size": draft.cfg.draft_vocab_size,
               "draft_params": sum(p.numel() for p in draft.parameters())}
    with commit_dir(d_dir) as tmp:
        draft.save(tmp)
        point(f"{stage}/draft")
        (tmp / "warm_metrics.json").write_text(json.dumps(metrics, indent=1))
        # every step's metrics (loss, per-pass or per-slot CE and acceptance): two warm starts of one config
        # that end far apart (the H200's fifth long run) can then be told apart by their curves
        (tmp / "warm_history.jsonl").write_text("".join(json.dumps(h) + "\n" for h in hist))
    return draft, metrics


def parallel_setup(cfg: RunConfig) -> Mesh | None:
    """The RL loop's mesh: None for one process; under torchrun, the pp x dp x cp mesh with
    parallel.pp x parallel.dp x parallel.cp = WORLD_SIZE. Anything else is refused with what to change
    (derive.check_parallel), instead of silently running one independent copy per rank."""
    pp, dp, cp = check_parallel(cfg, int(os.environ.get("WORLD_SIZE", "1")), "train")
    if pp * dp * cp == 1:
        return None
    p = cfg.parallel
    backend = p.backend if p.backend != "auto" else ("nccl" if pick_device(cfg.device).type == "cuda" else "gloo")
    return Mesh.build(dp, cp, backend, pp=pp)


def _from_rank0(objs: tuple, mesh: Mesh | None, device) -> tuple:
    """Rank 0's `objs` (models, tokenizer) on every rank, sent through the process group (a collective).
    Models travel on the host and land on each rank's own device."""
    if mesh is None:
        return objs
    box = [None]
    if mesh.rank == 0:
        # a host copy (Module.to moves in place; rank 0 keeps its models where they are)
        box = [tuple(copy.deepcopy(o).cpu() if isinstance(o, torch.nn.Module) else o for o in objs)]
    dist.broadcast_object_list(box, group=dist.group.WORLD, group_src=0)  # every rank of every stage
    if mesh.rank == 0:
        return objs
    return tuple(o.to(device) if isinstance(o, torch.nn.Module) else o for o in box[0])


def run_demo(cfg: RunConfig, progress: bool = True, force_new: bool = False) -> dict:
    """The whole job. Returns the summary that is also written to out_dir/summary.json (rank 0; other
    data-parallel ranks return {}). `force_new`: delete a previous run's outputs in out_dir even when it
    had another config (otherwise an error, runner/stages.py)."""
    validate_run(cfg)  # every config value, before any stage runs
    mesh = parallel_setup(cfg)
    rank = mesh.rank if mesh is not None else 0
    lock = RunLock(Path(cfg.out_dir)) if rank == 0 else None
    try:
        return _run_demo(cfg, mesh, rank, progress and rank == 0, force_new)
    finally:
        if lock is not None:
            lock.release()


def validate_run(cfg: RunConfig) -> None:
    """What the config tree cannot check alone because it needs the policy: the draft's aux layers
    against a pretrained policy's depth (the tiny policy's are checked by RunConfig itself)."""
    from ..model.config import ConfigError
    from ..model.hf_io import load_policy_config
    src = cfg.policy.source
    if src in ("tiny", "smollm2") or not cfg.draft.aux_layer_ids:
        return
    if not Path(src).is_dir():
        raise ConfigError(f"policy.source={src!r}: not 'tiny', 'smollm2' or an existing HF directory")
    n = load_policy_config(src).num_layers
    bad = [i for i in cfg.draft.aux_layer_ids if not 0 <= i < n]
    if bad:
        raise ConfigError(f"draft.aux_layer_ids={list(cfg.draft.aux_layer_ids)}: {bad} out of range for "
                          f"{src}, which has {n} layers (ids 0..{n - 1})")


def _run_demo(cfg: RunConfig, mesh, rank: int, progress: bool, force_new: bool) -> dict:
    out = Path(cfg.out_dir)
    if rank == 0:
        record_config(out, cfg, force_new)
        for p in remove_stale_temporaries(out):
            _say(f"removed {p}, left by an interrupted run", progress)
    device = mesh.device if mesh is not None and mesh.device.type == "cuda" else pick_device(cfg.device)
    if cfg.plain_baseline and not speculation_control(generate_config(cfg, None, 0), device):
        from ..model.config import ConfigError
        raise ConfigError(f"plain_baseline={list(cfg.plain_baseline)} on {device.type}: speculation control, which "
                          "builds the plain step set the baseline decodes with, is off there under "
                          f"rollout.spec_control={cfg.rollout.spec_control}; set rollout.spec_control=on")
    if device.type == "cuda":  # fp32 policies train and decode with TF32 matmuls (10-bit mantissa products),
        # the engine's decode attention included (ops/decode_attention._ieee)
        torch.set_float32_matmul_precision("high")
    t_start = time.perf_counter()
    # SFT and warm start run on rank 0 (each stage is skipped when its output exists in rank 0's out_dir);
    # the other ranks receive the policy, tokenizer and drafts through the process group, so no path
    # needs to be shared between nodes (README: only rank 0 reads and writes out_dir).
    policy = tok = None
    sft_m, drafts, warm_m = {}, {}, {}
    if rank == 0:
        policy, tok, sft_m = prepare_policy(cfg, out, device, progress)
    policy, tok = _from_rank0((policy, tok), mesh, device)
    mode = cfg.task.mode if cfg.policy.source == "tiny" else "chat"
    task = get_task(cfg.task.name, mode=mode, tokenizer=tok, cot_fraction=cfg.task.cot_fraction,
                    **task_overrides(cfg))
    if rank == 0:  # the report's accuracy figures; other data-parallel ranks skip the evaluation
        seed_stage(cfg.train.seed, "eval")
        # after SFT (a pretrained policy's "before" figures are in sft_m["before"]); by the rollout engine,
        # as the long-reasoning workload's 2.5K-token completions need a KV cache
        sft_m["after"] = engine_accuracy(cfg, policy, tok, task)
        sft_m["accuracy_T"] = sft_m["after"]["accuracy_T"]
        _say(f"      accuracy of the RL starting policy: {sft_m['after']}", progress)
        drafts, warm_m = prepare_drafts(cfg, policy, tok, task, out, progress)
    kinds = tuple(warm_configs(cfg))  # every rank knows them: the drafts travel in this order
    drafts = dict(zip(kinds, _from_rank0(tuple(drafts.get(k) for k in kinds), mesh, device)))
    _say(f"[3/4] RL: {cfg.train.steps} GRPO steps x arms {', '.join(cfg.arms)}"
         + (f" on {mesh.dp} data-parallel x {mesh.cp} context-parallel ranks" if mesh is not None else ""), progress)
    arm_rows = {}
    for arm in cfg.arms:
        arm_cfg, _ = arm_config(cfg, arm)  # its draft kind's warm draft (the no-draft arm drops it)
        run_arm(arm_cfg, arm, policy, drafts[arm_cfg.draft.kind], task, tok, out / "arms" / arm, device,
                progress=progress, mesh=mesh)
        # the rank-0 log, including rows from before a resume, for the report
        arm_rows[arm] = read_jsonl(out / "arms" / arm / "metrics.jsonl") if rank == 0 else []
        gc.collect()  # the arm's models, optimizer and graph pools go before the next arm starts
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rank != 0:
        return {}
    _say("[4/4] report", progress)
    summary = write_report(cfg, out, arm_rows, sft_m, warm_m[cfg.draft.kind], time.perf_counter() - t_start,
                           warm_by_kind=warm_m)
    return summary


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
             "tau)", shadow_table(arm_rows))):
        if made:
            summary[key] = made[1]
            table += f"\n\n{caption}:\n\n" + made[0]
    acc = []
    if "after" in sft_m:  # accuracy of the RL starting policy (a pretrained one's also before its format SFT)
        b, a = sft_m.get("before"), sft_m["after"]
        chat = cfg.policy.source != "tiny"
        fmt = ("greedy {accuracy_greedy:.3f}" + (" (tagged {tagged_greedy:.2f})" if chat else "")
               + ", T {accuracy_T:.3f}").format
        acc = [f"Accuracy on {a['n']} held-out prompts: before SFT "
               f"{fmt(**b) if b else 'n/a (no SFT)'}; RL start {fmt(**a)}.\n"]
    md = ["# specco demo report\n", f"Task `{cfg.task.name}`, policy `{cfg.policy.source}`, "
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
