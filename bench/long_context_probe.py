"""Where a long-context run's time goes, at configs/long_context.toml's shapes (random weights): the draft warm
start's pool sampling (engine.generate on the trainer's own fp32 policy, as runner/warmstart.sample_pool calls it)
against a bf16 engine copy, split into prefill and per-step cost, and one SFT step's forward + backward.

    python bench/long_context_probe.py [--rows 64] [--context 32000] [--new 8,136] [--out FILE]

Random weights never emit <eos>, so every row decodes `new` tokens: (t(new2) - t(new1)) / (new2 - new1) is the
decode step, t(new1) mostly the prefill.

`--train-steps N` (> 0) also times the RL train step at the run's shapes: `--train-rows` rows of the workload's
prompts with random completions of `--completion` tokens, the config's step (bf16 autocast, activation
checkpointing, micro-batches, draft row stride), each variant on the same batch, the order rotating per step, and
each run twice on a batch, the second timed (`step_s`; the first, which plans the batch's new shapes for cuDNN, in
`first_pass_s`):
`policy` (no draft), `eagle3` (EAGLE-3 TTT from the first trained column on: train/drafters.first_anchor),
`eagle3_whole` (every anchor and every position's logits, as before 2026-12-05: first_anchor forced to 0 in the
step and the drafter) and `dflash`; `policy_shared`, `eagle3_shared` and `dflash_shared` are those with each
prompt group's shared prompt run once (train.share_prompts: parallel/shared_prompts.py), whose policy loss must
equal the unshared step's (`policy_loss`: a check, not a timing); `policy_shared_copied` is `policy_shared` with the
segments' attention as before 2026-12-07 (the prefix's keys and values copied once per segment).
The draft's overhead is each variant's step minus `policy`'s; on CUDA each variant's peak memory too (`peak_gib`).
`--profile VARIANT ...` then profiles two more steps of each named variant on the last batch (`profile`: wall time,
the kernels' summed device time, the top kernels), to split a step's time into kernels and host waits.
`--decode 0` skips the decode part. `--variants NAME ...` times only those. Activation checkpointing as the config
says (on in long_context.toml; `--set train.activation_checkpointing=false`: the step without its recompute), and
the trainer's layers compiled as `train.compile` says (`--set train.activation_checkpointing=false
train.compile=inductor`); or `--settings none:on inductor:on inductor:off` times the variants under each
(train.compile, checkpointing on/off) setting in turn in one process, on the same batches (the data, model and
drafts built once; the JSON's `train.settings`).

    python bench/long_context_probe.py --decode 0 --train-steps 4"""
from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from _results import write_results
from _timing import device_times
from specco.config_load import load_config
from specco.data.source import load_data
from specco.data.tokenizer import build_char_tokenizer
from specco.model.layers import causal_sdpa
from specco.model.policy import Policy
from specco.parallel import shared_prompts
from specco.parallel.layout import PADDED, SHARED_PROMPTS
from specco.rollout.engine import RolloutEngine
from specco.runner.derive import generate_config
from specco.runner.derive import step_config
from specco.runner.warmstart import new_block_draft, new_draft
from specco.train import cotrain, drafters
from specco.train.activation_checkpointing import apply_activation_checkpointing, remove_activation_checkpointing
from specco.train.compile import COMPILE_BACKENDS, apply_compile, remove_compile, warm_up
from specco.train.cotrain import AMP_DTYPES, TrainBatch, build_optimizer, cotrain_step
from specco.train.sft import sft_batch, sft_loss, tiny_policy_config


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn) -> float:
    _sync()
    t = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/long_context.toml")
    ap.add_argument("--rows", type=int, default=64, help="prompts x 4 samples, as sample_pool")
    ap.add_argument("--context", type=int, default=32000)
    ap.add_argument("--new", default="8,136")
    ap.add_argument("--sft-rows", type=int, default=4)
    ap.add_argument("--decode", type=int, default=1, help="0: skip the decode and SFT timings")
    ap.add_argument("--train-steps", type=int, default=0, help="timed RL train steps per variant (0: none)")
    ap.add_argument("--train-rows", type=int, default=0, help="rows per train step (0: the config's step)")
    ap.add_argument("--completion", default="470,1540", help="completion lengths lo,hi (the workload's range)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--variants", nargs="*", default=[],
                    help="time only these variants (default: all; e.g. policy_shared dflash_shared)")
    ap.add_argument("--settings", nargs="*", default=[], metavar="COMPILE:on|off",
                    help="time the variants under each (train.compile, activation checkpointing) setting in this one "
                         "process, e.g. none:on inductor:on inductor:off (default: the config's)")
    ap.add_argument("--profile", nargs="*", default=[],
                    help="variants to profile after the timings (e.g. policy_shared)")
    ap.add_argument("--set", nargs="*", default=[], help="config overrides (key=value), e.g. a small policy on CPU")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    for setting in a.settings:
        backend, _, ckpt = setting.partition(":")
        if backend not in COMPILE_BACKENDS or ckpt not in ("on", "off"):
            raise SystemExit(f"--settings {setting!r}: write COMPILE:on or COMPILE:off, COMPILE one of "
                             f"{', '.join(COMPILE_BACKENDS)} (on/off: activation checkpointing)")
    torch.set_float32_matmul_precision("high")
    dev = torch.device(a.device)
    new1, new2 = (int(x) for x in a.new.split(","))
    cfg = load_config(a.config, [f"data.context_tokens=[{a.context},{a.context}]", f"rollout.max_new_tokens={new2}",
                                 *a.set])
    tok = build_char_tokenizer()
    train, _, _ = load_data(cfg.data, tok)
    pc = cfg.policy
    policy = Policy(tiny_policy_config(tok, pc.hidden_size, pc.num_layers, pc.num_heads, pc.num_kv_heads,
                                       pc.intermediate_size, pc.max_positions, pc.rope_theta)).to(dev)
    prompts = [e.prompt_ids for e in train.examples(a.rows // 4, seed=0)]
    res = {"rows": a.rows, "context": a.context, "shape": vars(pc)}
    if a.train_steps:  # the config's own prompt lengths (data.context_tokens), not --context
        tcfg = load_config(a.config, a.set)
        res["train"] = train_step_times(tcfg, policy, load_data(tcfg.data, tok)[0], a, dev, tok.pad_id)
    if a.decode:
        decode_and_sft(a, cfg, tok, train, policy, prompts, res, dev, new1, new2)
    write_results(res, "long_context_probe", dev, a.out)


def train_batch(cfg, train, rows: int, completion: tuple[int, int], vocab: int, dev, seed: int = 0) -> TrainBatch:
    """`rows` right-padded rows: the workload's prompts (group_size rows per prompt) then random completion tokens
    of uniform lengths in `completion`, trained on the completions only (as runner/rollouts.build_batch marks)."""
    g = torch.Generator().manual_seed(seed)
    group = cfg.rollout.group_size
    prompts = [e.prompt_ids for e in train.examples(-(-rows // group), seed=seed) for _ in range(group)][:rows]
    comp = torch.randint(completion[0], completion[1] + 1, (rows,), generator=g).tolist()
    S = max(len(p) + c for p, c in zip(prompts, comp))
    S = -(-S // 128) * 128  # the RL loop pads every batch's width to a multiple of 128 (configs' width_multiple)
    tokens = torch.zeros(rows, S, dtype=torch.long)
    mask = torch.zeros(rows, S)
    for r, (p, c) in enumerate(zip(prompts, comp)):
        tokens[r, :len(p)] = torch.tensor(p)
        tokens[r, len(p):len(p) + c] = torch.randint(1, vocab, (c,), generator=g)
        mask[r, len(p):len(p) + c] = 1
    return TrainBatch(tokens=tokens.to(dev), target_mask=mask.to(dev),
                      advantages=torch.randn(rows, generator=g).to(dev),
                      logp_old=(-torch.rand(rows, S, generator=g) * 3).to(dev))


def _copied_prefix(q, k_pre, v_pre, k_own, v_own):
    """The segments' attention as before 2026-12-07 (`policy_shared_copied`): each segment's keys and values
    [prefix, own] copied out, the prefix once per segment, then causal_sdpa aligned to the lower right."""
    n = q.shape[0]
    return causal_sdpa(q, torch.cat([k_pre.expand(n, -1, -1, -1), k_own], 2),
                       torch.cat([v_pre.expand(n, -1, -1, -1), v_own], 2), lower_right=True)


def train_step_times(cfg, policy, train, a, dev, pad_id: int) -> dict:
    """Seconds per RL train step of each variant (module docstring), on the same batches. The random completions
    use every token id, so DFlash's mask token is the pad id, as the runner's fallback (runner/prepare.py).
    With `--settings`, the same variants and batches under each (compile, checkpointing) setting in turn, in this
    one process: `{"settings": {"COMPILE:on|off": ...}}`. Each setting's first step warms it, untimed."""
    rows = a.train_rows or cfg.rollout.prompts_per_step * cfg.rollout.group_size
    lo, hi = (int(x) for x in a.completion.split(","))
    warm = train_batch(cfg, train, 4, (lo, hi), policy.cfg.vocab_size, dev, seed=99).tokens
    eagle = new_draft(policy, warm, cfg.draft.draft_vocab_size, cfg.draft.aux_layer_ids)
    dflash = new_block_draft(policy, warm, "dflash", cfg.rollout.block_k, cfg.draft.aux_layer_ids, pad_id,
                             cfg.draft.block_layers, cfg.draft.num_anchors)
    whole_anchor = lambda batch, passes, layout: 0  # noqa: E731  (TTT at every anchor)
    real = drafters.first_anchor
    variants = {"policy": (None, real, PADDED), "eagle3": (eagle, real, PADDED),
                "eagle3_whole": (eagle, whole_anchor, PADDED), "dflash": (dflash, real, PADDED),
                "policy_shared": (None, real, SHARED_PROMPTS), "eagle3_shared": (eagle, real, SHARED_PROMPTS),
                "dflash_shared": (dflash, real, SHARED_PROMPTS), "policy_shared_copied": (None, real, SHARED_PROMPTS)}
    unknown = set(a.variants) - set(variants)
    if unknown:
        raise SystemExit(f"--variants: no variant {sorted(unknown)}; the variants are {list(variants)}")
    if a.variants:
        variants = {n: v for n, v in variants.items() if n in a.variants}
    settings = a.settings or [f"{cfg.train.compile}:{'on' if cfg.train.activation_checkpointing else 'off'}"]
    out = {}
    for setting in settings:
        backend, ckpt = setting.split(":")
        print(f"setting {setting} (train.compile {backend}, activation checkpointing {ckpt})", flush=True)
        # the layers as this setting says, whatever the last one left (compile's graphs are shared: built once)
        remove_activation_checkpointing(remove_compile(policy))
        if ckpt == "on":
            apply_activation_checkpointing(policy)
        if backend != "none":  # as the trainer does (runner/trainer.py), before the first step
            secs = warm_up(apply_compile(policy, backend), AMP_DTYPES[cfg.train.amp])
            print(f"{setting}: compiled the layers in {secs:.1f} s", flush=True)
        out[setting] = _variant_times(cfg, policy, train, a, dev, variants, rows, (lo, hi), real)
    return out[settings[0]] if not a.settings else {"settings": out}


def _variant_times(cfg, policy, train, a, dev, variants, rows, completion, real) -> dict:
    """train_step_times' loop for the layers as they are: every variant on the same batches (seed = step)."""
    lo, hi = completion
    scfg = step_config(cfg, "cotrained")
    opts = {n: build_optimizer(policy, d, 0.0, 0.0) for n, (d, _, _) in variants.items()}  # lr 0: weights stay put
    times: dict[str, list[float]] = {n: [] for n in variants}
    first: dict[str, list[float]] = {n: [] for n in variants}  # each variant's first (planning) pass on a batch
    losses: dict[str, list[float]] = {n: [] for n in variants if variants[n][0] is not None}
    policy_losses: dict[str, list[float]] = {n: [] for n in variants}
    peaks: dict[str, float] = {}  # GiB, CUDA only
    prof: dict[str, dict] = {}
    names = list(variants)
    homes = (drafters, cotrain)  # the step's logits_from and the drafter's anchors
    segments = shared_prompts.prefix_segments_attention

    def select(name):  # the variant's draft and layout; its anchors and segments' attention patched in
        draft, anchor, layout = variants[name]
        for home in homes:
            home.first_anchor = anchor
        shared_prompts.prefix_segments_attention = _copied_prefix if name.endswith("_copied") else segments
        return draft, layout

    try:
        for step in range(a.train_steps + 1):  # step 0 warms every variant (allocator, kernels), untimed
            batch = train_batch(cfg, train, rows, (lo, hi), policy.cfg.vocab_size, dev, seed=step)
            for name in names[step % len(names):] + names[:step % len(names)]:
                draft, layout = select(name)
                m = {}
                run = lambda: m.update(cotrain_step(policy, draft, batch, opts[name], None, scfg,  # noqa: E731
                                                    layout=layout))
                # untimed first: it plans the batch's new shapes (cuDNN builds an execution plan per shape), which
                # a fixed order would charge to whichever variant of a layout came first on the batch
                t_first = _timed(run)
                if dev.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(dev)
                t = _timed(run)
                if step:
                    times[name].append(t)
                    first[name].append(t_first)
                    if dev.type == "cuda":  # the step's peak, the models and their optimizer state included
                        peaks[name] = max(peaks.get(name, 0.0), torch.cuda.max_memory_allocated(dev) / 2 ** 30)
                    if draft is not None:  # eagle3 and eagle3_whole train the very same loss (a check, not a timing)
                        losses[name].append(m["draft/loss"])
                    policy_losses[name].append(m["policy/loss"])
                print(f"step {step} {name}: {t:.3f} s (first pass on the batch {t_first:.3f} s)", flush=True)
        for name in a.profile:  # on the last batch, whose shapes every variant has planned
            draft, layout = select(name)
            prof[name] = profile_step(lambda: cotrain_step(policy, draft, batch, opts[name], None, scfg, layout=layout),
                                      dev)
    finally:
        for home in homes:
            home.first_anchor = real
        shared_prompts.prefix_segments_attention = segments
    out = {"rows": rows, "width": int(batch.tokens.shape[1]), "completion": [lo, hi],
           "step_s": {n: sum(v) / len(v) for n, v in times.items()}, "steps_s": times, "first_pass_s": first,
           "draft_loss": losses, "policy_loss": policy_losses,
           "peak_gib": peaks, "profile": prof}
    base = lambda n: "policy_shared" if "shared" in n else "policy"  # noqa: E731
    out["draft_overhead_s"] = {n: out["step_s"][n] - out["step_s"][base(n)]
                               for n in names if not n.startswith("policy") and base(n) in names}
    print(out["step_s"], out["draft_overhead_s"], flush=True)
    return out


def profile_step(run, dev, top: int = 30) -> dict:
    """Where one step's time goes: its wall time under the profiler, the sum of its kernels' device time (their
    gap to the wall is host time the device waited through: launches, planning, synchronisations), and the `top`
    kernels by device time, each with its share of the kernel time."""
    kern, host_us, _ = device_times(run, dev, reps=2)
    total = sum(kern.values())
    rows = sorted(kern.items(), key=lambda kv: -kv[1])[:top]
    out = {"wall_s": host_us / 1e6, "kernel_s": total / 1e6,
           "top": [{"kernel": k[:160], "ms": v / 1e3, "share": v / total} for k, v in rows]}
    print(f"profile: wall {out['wall_s']:.3f} s, kernels {out['kernel_s']:.3f} s", flush=True)
    for r in out["top"]:
        print(f"  {r['ms']:9.2f} ms {r['share']:6.1%}  {r['kernel'][:100]}", flush=True)
    return out


def decode_and_sft(a, cfg, tok, train, policy, prompts, res, dev, new1, new2):
    """The decode-step and SFT timings (module docstring) into `res`."""
    for name, model in (("fp32", policy), ("bf16", None)):
        if model is None:
            model = Policy(policy.cfg).to(dev, torch.bfloat16)
        for n in (new1, new2):
            g = dataclasses.replace(generate_config(cfg, tok.stop_ids, tok.pad_id), max_new_tokens=n)
            eng = RolloutEngine(model, None, g)
            eng.generate(prompts, group_size=4, generator=torch.Generator(dev).manual_seed(0))  # capture, compile
            t = _timed(lambda: eng.generate(prompts, group_size=4, generator=torch.Generator(dev).manual_seed(0)))
            res[f"{name}_generate_{n}_s"] = t
            print(f"{name} generate {a.rows} rows x {n} new at {a.context}: {t:.3f} s", flush=True)
            eng = None
            torch.cuda.empty_cache()
        t1, t2 = res[f"{name}_generate_{new1}_s"], res[f"{name}_generate_{new2}_s"]
        res[f"{name}_step_ms"] = 1e3 * (t2 - t1) / (new2 - new1)
        print(f"{name} decode step {res[f'{name}_step_ms']:.2f} ms", flush=True)
    ex = train.examples(a.sft_rows, seed=1)
    ids, mask = sft_batch(ex, tok, device=dev)
    def step():
        with torch.autocast("cuda", torch.bfloat16):
            loss = sft_loss(policy, ids, mask)
        loss.backward()
    step()
    res["sft_micro_batch_s"] = min(_timed(step) for _ in range(3))
    res["sft_micro_batch_tokens"] = int(ids.numel())
    print(f"SFT forward+backward, {a.sft_rows} rows x {ids.shape[1]}: {res['sft_micro_batch_s']:.3f} s", flush=True)


if __name__ == "__main__":
    main()
