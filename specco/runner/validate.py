"""Every input of a job checked before out_dir is touched, so a corrected command just runs.

`check_job(cfg, device)` opens what the job will read — the policy directory (config.json, weights,
tokenizer), the training / eval / SFT data with their columns, the reward functions, an imported draft — and
returns the job's data (`JobData`). Anything wrong is a ConfigError (or FileNotFoundError) naming the file or
key and the fix; nothing has been written yet.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import RunConfig
from ..data.source import PromptSource, load_data
from ..model.config import ConfigError
from ..rewards import Rewards, RewardSpec


@dataclass
class JobData:
    """What a job reads besides its models: training prompts, held-out prompts (None: no evaluation), SFT
    examples (None: no SFT stage), the reward functions, and what loading them found (rows dropped...)."""
    train: PromptSource
    eval: PromptSource | None
    sft: PromptSource | None
    rewards: Rewards
    stats: dict


def default_rewards(cfg: RunConfig) -> tuple[RewardSpec, ...]:
    """The job's [[reward]] tables; a procedural reasoning_gym source without any scores with its own dataset's
    scorer. A dataset file has no default: a ConfigError says how to name one."""
    if cfg.reward:
        return cfg.reward
    if cfg.data.source.startswith("reasoning_gym:"):
        return (RewardSpec(name="reasoning_gym"),)
    raise ConfigError(f"no reward for data.source={cfg.data.source!r}: name one with --reward NAME_OR_FN (a built-in: "
                      "math, exact, reasoning_gym; or path/to/file.py:function) or a [[reward]] table in the config")


def check_policy(cfg: RunConfig, out: Path):
    """The policy's directory and tokenizer, checked (None, tokenizer for the from-scratch tiny model)."""
    from .prepare import source_dir, start_tokenizer
    src = source_dir(cfg, out)
    if src is not None:
        from ..model.hf_io import check_policy_dir, check_tokenizer_fits
        pc = check_policy_dir(src)
        check_moe_layout(cfg, pc, src / "config.json")
        from .derive import check_tp_sizes
        # before any stage: the trainer's layers (parallel/tp.py) and the engine's shard (rollout/tp.py) are cut at
        # make_arm
        for key, n in (("parallel.tp", cfg.parallel.tp), ("rollout.tp", cfg.rollout.tp)):
            if n > 1:
                check_tp_sizes(pc, n, f"the policy's ({src / 'config.json'}) ", key)
        check_tokenizer_fits(src)
        check_aux_coef(cfg, pc, src)
        bad = [i for i in cfg.draft.aux_layer_ids if not 0 <= i < pc.num_layers]
        if bad:
            raise ConfigError(f"draft.aux_layer_ids={list(cfg.draft.aux_layer_ids)}: {bad} out of range for "
                              f"{src}, which has {pc.num_layers} layers (ids 0..{pc.num_layers - 1})")
    tok = start_tokenizer(cfg, out)
    if src is None:  # the from-scratch policy: its shape is known before it exists
        from .derive import tiny_policy
        pc = tiny_policy(cfg, tok)
        where = f"policy.source='tiny', policy.family={cfg.policy.family!r}"
        check_moe_layout(cfg, pc, where)
        check_aux_coef(cfg, pc, where)
    if src is None and cfg.rollout.tp > 1 and tok.vocab_size % cfg.rollout.tp:  # the tiny policy's vocabulary is its
        # tokenizer's
        raise ConfigError(f"rollout.tp={cfg.rollout.tp}: the from-scratch policy's vocabulary is its tokenizer's "
                          f"{tok.vocab_size} tokens, not a multiple of it (each engine tp rank holds vocab / tp rows "
                          "of the head); set rollout.tp=1, or train a Hugging Face policy whose vocabulary it divides")
    return src, tok


def check_moe_layout(cfg: RunConfig, pc, where) -> None:
    """What a mixture-of-experts policy cannot run under yet, refused by name before out_dir is touched: tensor
    parallelism (its experts are placed by expert parallelism, parallel.ep, or sharded by FSDP, not cut by tp;
    apply_tp is the backstop); and parallel.ep
    on a dense policy or one whose num_experts it does not divide."""
    ep = cfg.parallel.ep
    if not pc.moe:
        if ep > 1:
            raise ConfigError(f"parallel.ep={ep}: the policy ({where}, model_type {pc.model_type!r}) has no "
                              "mixture-of-experts layers to place; set parallel.ep=1")
        return
    if ep > 1 and pc.num_experts % ep:
        raise ConfigError(f"parallel.ep={ep} does not divide the policy's num_experts={pc.num_experts} ({where}): each "
                          "ep rank holds num_experts / ep experts; set parallel.ep to a divisor of it")
    if cfg.parallel.tp > 1:
        raise ConfigError(f"parallel.tp={cfg.parallel.tp}: the policy ({where}) is a mixture of experts "
                          f"({pc.model_type}); tensor parallelism of MoE layers is not implemented (place the experts "
                          "with parallel.ep instead): use parallel.tp = 1")


def check_aux_coef(cfg: RunConfig, pc, where) -> None:
    """policy.router_aux_loss_coef is for a mixture-of-experts policy only (a key that would do nothing is refused)."""
    if cfg.policy.router_aux_loss_coef is not None and not pc.moe:
        raise ConfigError(f"policy.router_aux_loss_coef={cfg.policy.router_aux_loss_coef}: the policy ({where}, "
                          f"model_type {pc.model_type!r}) has no mixture-of-experts layers; remove the key")


def check_job(cfg: RunConfig, device: torch.device | None = None) -> JobData:
    """Open and check every input of the job (module docstring); returns its data."""
    out = Path(cfg.out_dir)
    if not cfg.policy.source:
        raise ConfigError("policy.source is not set: give the policy to train, a Hugging Face directory (--policy DIR "
                          "or policy.source=DIR), 'smollm2', or 'tiny' (the from-scratch demo model)")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out_dir={cfg.out_dir!r} is a file; give a directory (it is created if missing)")
    if cfg.policy.source == "tiny" and not cfg.sft.data:
        raise ConfigError("policy.source='tiny' is a from-scratch model: it needs an SFT stage, e.g. "
                          "sft.data=reasoning_gym:chain_sum (configs/demo.toml)")
    src, tok = check_policy(cfg, out)
    if cfg.draft.init and not Path(cfg.draft.init).is_dir():
        raise FileNotFoundError(f"draft.init={cfg.draft.init!r}: no such directory (a specco draft, an EAGLE-3 or a "
                                "DFlash layout); leave it empty to warm-start a new draft on the policy's samples")
    from .derive import arm_config
    for arm in cfg.arms:  # each arm's own view of the config is valid too, now rather than at the arm's start
        arm_config(cfg, arm)
    if device is not None:
        check_device_plan(cfg, device)
    train, eval_, stats = load_data(cfg.data, tok)
    sft = load_sft(cfg, tok) if cfg.sft.data else None
    rewards = Rewards(default_rewards(cfg))
    probe_rewards(rewards, train, tok)
    return JobData(train=train, eval=eval_, sft=sft, rewards=rewards, stats=stats)


def check_device_plan(cfg: RunConfig, device: torch.device) -> None:
    """What the config asks of the device it will run on: a plain baseline needs speculation control there."""
    from ..rollout.shapes import speculation_control
    from .derive import generate_config, on_device
    if cfg.plain_baseline and not speculation_control(generate_config(on_device(cfg, device), None, 0), device):
        raise ConfigError(f"plain_baseline={list(cfg.plain_baseline)} on {device.type}: speculation control, which "
                          "builds the plain step set the baseline decodes with, is off there under "
                          f"rollout.spec_control={cfg.rollout.spec_control}; set rollout.spec_control=on")


def load_sft(cfg: RunConfig, tok) -> PromptSource:
    """The SFT examples: [sft] data read like [data] (its keys, templating and, for a reasoning_gym source, its
    format and options), every row with a reference completion."""
    procedural = cfg.sft.data.startswith("reasoning_gym:")
    if cfg.sft.context_tokens and not (procedural and cfg.data.format == "lookup"):
        raise ConfigError(f"sft.context_tokens={list(cfg.sft.context_tokens)}: only a reasoning_gym sft.data in the "
                          f"'lookup' format (data.format) has a context length; remove it")
    spec = dataclasses.replace(cfg.data, source=cfg.sft.data, eval="", eval_fraction=0.0,
                               options=cfg.data.options if procedural else {},
                               context_tokens=cfg.sft.context_tokens or cfg.data.context_tokens)
    return load_data(spec, tok, need_reference=True)[0]


def probe_rewards(rewards: Rewards, source: PromptSource, tok, n: int = 4) -> None:
    """The reward functions called once on the first `n` training prompts, with each one's reference answer (or
    an empty string) as the completion: a function that raises, returns the wrong length, NaN or a non-number
    fails here, before any stage, with its error naming the function and the row (the values themselves are
    thrown away). A function with side effects sees this call too."""
    examples = source.examples(n, seed=0)
    texts = [e.reference or "" for e in examples]
    rewards([e.prompt for e in examples], texts, [tok.encode(t) for t in texts], [e.columns for e in examples])
