"""specco's command line. Thin: each command builds a config and calls one library function.

    specco train --policy DIR --data FILE --reward NAME_OR_FN [k=v ...]   one job: a co-trained policy + draft
    specco train CONFIG [k=v ...]          the same from a TOML config (any size; under torchrun for several GPUs)
    specco compare CONFIG [k=v ...]        the job's pipeline with several arms (no draft / frozen / co-trained)
    specco demo                            a small comparison on a from-scratch model (CPU, <= 10 min)
    specco generate --policy DIR           text generation, with an optional draft (speculative)
    specco export --draft DIR ...          an EAGLE-3 or DFlash draft in the layout vLLM or SGLang loads
    specco cotrain-cp [CONFIG] ...         co-training steps with context parallelism (launch with torchrun)
    specco plan CONFIG --gpus N --gpu-mem GiB   each rank's memory for every layout, ranked
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# Configs shipped in the source checkout: `specco demo` runs demo.toml (smollm2.toml with --policy smollm2)
CONFIGS = Path(__file__).resolve().parents[1] / "configs"

FORCE_NEW_HELP = ("out_dir holds a run with another config: delete its outputs and start over (without it, "
                  "that is an error listing the differing keys)")


def _add_overrides(p):
    p.add_argument("overrides", nargs="*", metavar="key.sub=value",
                   help="config overrides, e.g. train.steps=10 rollout.k=2 parallel.cp=2")


def _add_job_options(p):
    p.add_argument("--policy", default=None, help="the policy: a Hugging Face directory, smollm2 or tiny "
                   "(policy.source)")
    p.add_argument("--data", default=None, help="training prompts: a JSONL / Parquet / CSV file, a "
                   "datasets.save_to_disk directory, or reasoning_gym:NAME (data.source)")
    p.add_argument("--reward", action="append", default=None, metavar="NAME_OR_FN",
                   help="a reward (repeatable, weight 1 each): a built-in (math, exact, reasoning_gym) or your "
                   "function, path/to/file.py:name or module:name (TRL or verl signature); replaces the "
                   "config's [[reward]] tables")
    p.add_argument("--out", default=None, help="output directory (out_dir)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--force-new", action="store_true", help=FORCE_NEW_HELP)
    _add_overrides(p)


def _job_config(a, path, arms=None):
    """The run config of a train / compare / demo command: the file, the job options, the overrides."""
    from .config_load import load_config
    ov = []
    if a.policy:
        ov.append(f"policy.source={a.policy}")
    if a.data:
        ov.append(f"data.source={a.data}")
    if a.out:
        ov.append(f"out_dir={a.out}")
    tables = {}
    if a.reward:
        # NAME (a built-in; an unknown one gets a did-you-mean) or FILE.py:FN / module:FN (a user function)
        tables["reward"] = [{"fn": r} if ":" in r else {"name": r} for r in a.reward]
    cfg = load_config(path, ov + list(a.overrides), tables)
    if arms is not None and len(cfg.arms) == 1:  # `specco compare` on a job's config: the standard arms
        import dataclasses
        cfg = dataclasses.replace(cfg, arms=arms)
    return cfg


def _shipped(name: str) -> Path:
    from .model.config import ConfigError
    path = CONFIGS / name
    if not path.exists():
        raise ConfigError(f"{path} not found (specco is not run from a source checkout?); pass a config file: "
                          f"specco train path/to/{name}")
    return path


def cmd_train(a):
    from .runner.pipeline import run
    if a.config is not None and "=" in a.config and not Path(a.config).exists():  # `train --policy D k=v`: an
        a.overrides, a.config = [a.config, *a.overrides], None  # override, not the optional config file
    if a.config is None and a.policy is None:
        from .model.config import ConfigError
        raise ConfigError("specco train needs a config file or --policy: specco train --policy DIR --data FILE "
                          "--reward math (see specco train --help)")
    run(_job_config(a, a.config), progress=not a.quiet, force_new=a.force_new)


def cmd_compare(a):
    from .runner.experiment import DEFAULT_ARMS
    from .runner.pipeline import run
    run(_job_config(a, a.config, arms=DEFAULT_ARMS), progress=not a.quiet, force_new=a.force_new)


def cmd_demo(a):
    from .runner.pipeline import run
    config = a.config or _shipped("smollm2.toml" if a.policy == "smollm2" else "demo.toml")
    if a.policy in (None, "tiny", "smollm2"):
        a.policy = None  # the shipped config names it
    run(_job_config(a, config), progress=not a.quiet, force_new=a.force_new)


def cmd_generate(a):
    import torch

    from .data.tokenizer import load_tokenizer, stop_token_ids, truncate_at_stop
    from .export import load_any_draft
    from .devices import resolve_device
    from .model.hf_io import check_tokenizer_fits, load_policy
    from .rollout.engine import RolloutEngine
    from .config_load import load_config
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
    from .export import export_any_draft, load_any_draft
    from .model.hf_io import load_policy_config
    policy_cfg = load_policy_config(a.policy) if a.policy else None
    draft = load_any_draft(a.draft, policy_cfg)
    _, line = export_any_draft(draft, a.out, a.engine, policy_cfg, dtype=a.dtype, overwrite=a.force)
    print(line)


def cmd_cotrain_cp(a):
    from .config_load import load_config
    from .runner.cotrain_cp import run_cotrain_step_cp
    cfg = load_config(a.config, a.overrides)
    run_cotrain_step_cp(cfg, steps=a.steps, seq_lens=tuple(int(x) for x in a.seq_lens.split(",")))


def cmd_plan(a):
    from .config_load import load_config
    from .plan import format_plan, plan_memory, write_json
    if a.config is not None and "=" in a.config and not Path(a.config).exists():  # an override, not a file
        a.overrides, a.config = [a.config, *a.overrides], None
    cfg = load_config(a.config, a.overrides)
    ac = {"both": (False, True), "on": (True,), "off": (False,),
          "config": (cfg.train.activation_checkpointing,)}[a.ac]
    plan = plan_memory(cfg, a.gpus, a.gpu_mem, model=a.model, prompt_tokens=a.prompt_tokens,
                       reserve_gib=a.reserve, ac=ac, offload=a.offload, engine_tp=a.engine_tp)
    print(format_plan(plan, a.top))
    if a.json:
        write_json(plan, a.json)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specco", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("train", help="one job: a co-trained policy + draft from your model, data and rewards",
                       description="Load the policy, [SFT when sft.data is given], start the draft (draft.init or a "
                       "warm start on the policy's own samples), run GRPO with the draft co-trained, and write "
                       "out_dir/policy (a Hugging Face checkpoint) and out_dir/draft every train.save_every steps "
                       "and at the end. Every input is checked before out_dir is touched; the config used is "
                       "written to out_dir/config.json; running it again resumes (or extends, when train.steps "
                       "grew).")
    p.add_argument("config", nargs="?", default=None, help="TOML config (optional with --policy/--data/--reward)")
    _add_job_options(p)
    p.set_defaults(fn=cmd_train)

    p = sub.add_parser("compare", help="the job with several arms (no draft / frozen / co-trained) and a report",
                       description="The train pipeline with the config's `arms` (a config naming one arm gets none, "
                       "frozen, cotrained), each from the same starting policy and seed, and a report "
                       "(out_dir/report.md, plots) with plain baselines and frozen shadows when configured.")
    p.add_argument("config", help="TOML config, e.g. configs/demo.toml")
    _add_job_options(p)
    p.set_defaults(fn=cmd_compare)

    p = sub.add_parser("demo", help="a small comparison on CPU: configs/demo.toml (from-scratch model, <= 10 min)",
                       description="SFT a tiny from-scratch policy on reasoning_gym chain_sum, warm-start an EAGLE-3 "
                       "draft, run GRPO with three arms (no draft / frozen / co-trained) from the same seed and "
                       "write a report. --policy smollm2 runs configs/smollm2.toml on SmolLM2-135M-Instruct.")
    p.add_argument("--config", default=None, help="TOML config (default: configs/demo.toml, or configs/smollm2.toml "
                   "with --policy smollm2)")
    _add_job_options(p)
    p.set_defaults(fn=cmd_demo)

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

    p = sub.add_parser("plan", help="each rank's memory for every layout of a run (pp x dp_replicate x dp_shard x cp x tp, "
                       "and ep for a mixture-of-experts policy)",
                       description="Per-rank memory of every feasible layout (parameters, gradients, AdamW, activations "
                       "with and without checkpointing, the draft, the rollout engine's weights and KV cache), fitting "
                       "layouts first, most headroom first (specco/plan.py has the formulas).")
    p.add_argument("config", nargs="?", default=None, help="TOML config (default: the built-in defaults)")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--gpu-mem", type=float, required=True, metavar="GiB", help="memory per GPU (H200: 141)")
    p.add_argument("--model", default=None, help="a published shape instead of policy.source: qwen3-8b, qwen3-32b, "
                   "dense-120b, qwen3-30b-a3b (mixture of experts)")
    p.add_argument("--prompt-tokens", type=int, default=0, help="longest prompt (default data.max_prompt_tokens, "
                   "else a lookup workload's data.context_tokens, else 512)")
    p.add_argument("--reserve", type=float, default=4.0, metavar="GiB", help="kept free per GPU (CUDA context, NCCL, "
                   "fragmentation)")
    p.add_argument("--ac", default="both", choices=["both", "on", "off", "config"],
                   help="activation checkpointing: list both, one, or train.activation_checkpointing's")
    p.add_argument("--offload", action="store_true", help="the engine's weights and KV cache released to the host "
                   "while the trainer runs (the peak is the larger phase, not their sum)")
    p.add_argument("--engine-tp", type=int, default=None, help="the rollout engine's tensor parallelism (rollout.tp: "
                   "its policy and KV cache split over N of the cp x tp ranks of a DP group); default: the config's")
    p.add_argument("--top", type=int, default=0, help="print only the first N layouts")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the plan as JSON")
    _add_overrides(p)
    p.set_defaults(fn=cmd_plan)
    return ap


def main(argv=None):
    from .model.config import ConfigError
    from .runner.stages import RunLockedError, StageError
    from .train.checkpoint import CheckpointError
    from .train.nonfinite import NonFiniteError
    from .rewards.core import RewardError
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
            RunLockedError, NonFiniteError, RewardError) as e:
        print(f"specco: {e}", file=sys.stderr)
        sys.exit(2)



def run_main():
    """The `specco` command and `python -m specco`: main() under parallel.mesh.run_worker (a torchrun worker whose
    command succeeded ends without the interpreter's teardown, which aborted now and then)."""
    from .parallel.mesh import run_worker
    run_worker(main)


if __name__ == "__main__":
    run_main()
