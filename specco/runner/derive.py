"""Every configuration derived from the run config, built here and only here (docs/DESIGN.md §7).

    arm_config(cfg, arm)               -> (the run config as `arm` sees it, the arm's mode)
    warm_configs(cfg)                  -> {draft kind: the config its warm start runs with}
    step_config(cfg, mode)             -> train.cotrain.StepConfig      (the co-training step)
    generate_config(cfg, eos, pad)     -> rollout.config.GenerateConfig (the rollout engine)
    check_parallel(cfg, world, cmd)    -> the launch's (pp, dp, cp), or a ConfigError naming what to change

Both derived configs are frozen dataclasses; their values come from the run config's one set of
defaults (`specco/config.py`), so the RL loop, the warm start, the context-parallel command and
`specco generate` cannot drift apart.
"""
from __future__ import annotations

import copy
import dataclasses
import math

import torch

from ..batch import longest_first, round_up
from ..config import BLOCK_KINDS, RunConfig, split_arm
from ..model.config import ConfigError, PolicyConfig
from ..rollout.config import GenerateConfig
from ..rollout.sampling import SamplingParams
from ..train.cotrain import AMP_DTYPES, StepConfig
from ..train.sft import tiny_policy_config

__all__ = ["arm_config", "warm_configs", "step_config", "draft_updates", "generate_config", "engine_dtype", "engine_copy",
           "at_temperature", "check_parallel"]


def arm_config(cfg: RunConfig, arm: str) -> tuple[RunConfig, str]:
    """(The run config as `arm` sees it, what the arm does: none / frozen / cotrained). A cold arm does what a
    co-trained one does, from another starting draft (runner/pipeline.arm_drafts).

    An arm `<mode>-<kind>` sees draft.kind = kind. For a kind other than the run's draft.kind, draft.init
    (a draft of the run's kind) does not apply and draft_vocab_size (EAGLE-3's) is the automatic 0 for a block
    drafter: those keys describe the run's own draft. A block-drafter arm's rollout.k is rollout.block_k
    when that is set. `arms` is just (arm,), so the result is a valid config (an arm `cotrained-dflash`
    next to a bare `cotrained` would be a duplicate under draft.kind=dflash) and applying arm_config
    to it again changes nothing."""
    mode, kind = split_arm(arm, cfg.draft.kind)  # kind None: the no-draft arm, which sees the run config
    draft, rollout = cfg.draft, cfg.rollout
    if kind is not None and kind != draft.kind:
        draft = dataclasses.replace(draft, kind=kind, init="",
                                    draft_vocab_size=0 if kind in BLOCK_KINDS else draft.draft_vocab_size)
    if kind in BLOCK_KINDS and rollout.block_k:
        rollout = dataclasses.replace(rollout, k=rollout.block_k)
    shadow = cfg.measures_shadow(arm)  # shadow_window windows the shadow: an arm without one has none (a no-draft
    # arm beside shadowed ones was refused at its start, after the run's SFT and warm starts)
    return dataclasses.replace(cfg, draft=draft, rollout=rollout, arms=(arm,),
                               plain_baseline=(arm,) if cfg.measures_plain(arm) else (),
                               frozen_shadow=(arm,) if shadow else (),
                               shadow_window=cfg.shadow_window if shadow else 0), \
        "cotrained" if mode == "cold" else mode


def warm_configs(cfg: RunConfig) -> dict[str, RunConfig]:
    """{kind: the config the warm start of that kind's draft runs with (its co-trained arm's)} for every kind a
    warm draft serves: a frozen or co-trained arm's, and a cold arm's whose frozen shadow scores its kind's warm
    draft (frozen_shadow). The run's draft.kind first (out_dir/warm_draft), then the arms' order. A kind no arm
    needs warm is not warm-started (a DFlash-only run spent ~1 minute on an unused EAGLE-3 warm start; at 32K
    tokens one takes ~4 minutes)."""
    kinds = [k for m, k in (split_arm(a, cfg.draft.kind) for a in cfg.arms)
             if k and (m != "cold" or cfg.measures_shadow(f"{m}-{k}"))]
    order = [cfg.draft.kind] if cfg.draft.kind in kinds else []
    return {k: arm_config(cfg, f"cotrained-{k}")[0] for k in dict.fromkeys(order + kinds)}


def step_config(cfg: RunConfig, mode: str = "cotrained", draft_row_stride: int | None = None) -> StepConfig:
    """The co-training step's config for an arm of `mode` ('none' and 'frozen' train no draft: lambda = 0);
    `draft_row_stride`: this RL step's stride under train.draft_min_tokens (runner/trainer.rl_step_config), None for
    train.draft_row_stride."""
    t, d = cfg.train, cfg.draft
    return StepConfig(draft_weight=t.draft_weight if mode == "cotrained" else 0.0,
                      ttt_passes=d.ttt_passes, pass_decay=d.pass_decay, clip_eps=t.clip_eps,
                      kl_coef=t.kl_coef, temperature=max(cfg.rollout.temperature, 1e-6),
                      policy_grad_clip=t.policy_grad_clip, draft_grad_clip=t.draft_grad_clip,
                      loss_chunk=t.loss_chunk, draft_row_stride=draft_row_stride or t.draft_row_stride,
                      micro_batch_rows=t.micro_batch_rows,
                      width_multiple=width_multiple(cfg), amp_dtype=AMP_DTYPES.get(t.amp),
                      share_prompts=t.share_prompts)


def draft_updates(u: int, every: int) -> bool:
    """Whether the co-trained draft trains in PPO update `u` (0-based, over ppo_epochs x minibatches) of an RL step
    under train.draft_update_stride = `every`: updates 0, every, 2*every, ..."""
    return u % every == 0


def width_multiple(cfg: RunConfig) -> int:
    """What every micro-batch width is rounded up to: train.width_multiple, and under tensor-parallel sequence
    parallelism a multiple of parallel.tp too (each rank holds S/tp tokens of the residual stream, parallel/tp.py)."""
    w, p = cfg.train.width_multiple, cfg.parallel
    return math.lcm(w, p.tp) if p.tp_sequence_parallel else w


def train_shapes(cfg: RunConfig, prompt_len: int) -> list[tuple[int, int]]:
    """The (rows, width) micro-batch shapes this rank's RL trainer can run (config train.warm_widths): rows from
    cutting a minibatch — and, with frozen_shadow, the whole step's rows — into train.micro_batch_rows (the last
    cut holds the rest); widths every multiple of `width_multiple(cfg)` up to the longest possible row,
    `prompt_len` + rollout.max_new_tokens, rounded up as the minibatches are (runner/rollouts.build_batch)."""
    t, r = cfg.train, cfg.rollout
    step_rows = r.prompts_per_step * r.group_size // cfg.parallel.dp

    def cuts(n: int) -> set[int]:  # the row counts of cotrain.micro_batch_cuts on n rows (None there: all n)
        m = t.micro_batch_rows
        return {n} if m <= 0 or m >= n else {len(idx) for idx in longest_first(torch.zeros(n), m)}

    rows = cuts(step_rows // t.minibatches) | (cuts(step_rows) if cfg.frozen_shadow else set())
    w = width_multiple(cfg)
    top = round_up(prompt_len + r.max_new_tokens, w)
    return sorted((b, width) for b in rows for width in range(w, top + 1, w))


def generate_config(cfg: RunConfig, eos_id: int | tuple[int, ...] | None, pad_id: int) -> GenerateConfig:
    """The rollout engine's config: sampling, k, length budget and compaction from `cfg.rollout`."""
    r = cfg.rollout
    return GenerateConfig(max_new_tokens=r.max_new_tokens,
                          sampling=SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
                                                  coupled=r.sampler == "coupled"),
                          num_draft_tokens=r.k, eos_token_id=eos_id, pad_token_id=pad_id,
                          compact_below=r.compact_below, compact_min_rows=r.compact_min_rows,
                          spec_control={"auto": None, "on": True, "off": False}[r.spec_control])


def on_device(cfg: RunConfig, device: torch.device) -> RunConfig:
    """`cfg` with its "auto" precision keys decided for `device`, once, at the start of a run: train.amp "auto" is
    bf16 (autocast over fp32 master weights; under FSDP its bf16 gathers and compute, fp32 reductions) for a
    pretrained policy on a GPU, in every layout, pipeline stages included; rollout.dtype "auto" gives that policy
    an engine copy in bf16. Both are off elsewhere (the tiny demo model, CPUs, where bf16 matmuls are slow).

    The engine's copy is only the sampler in every layout: the PPO's old log-probs come from the trainer (under
    pipeline parallelism its stages in turn: rollouts.StagePipe) and the policy the run evaluates and saves is the
    trainer's masters (gathered where it holds part of them: rl.full_models), so neither is a rounded copy."""
    pretrained_gpu = torch.device(device).type == "cuda" and cfg.policy.source != "tiny"
    amp = cfg.train.amp if cfg.train.amp != "auto" else ("bf16" if pretrained_gpu else "none")
    dtype = cfg.rollout.dtype if cfg.rollout.dtype != "auto" else ("bfloat16" if pretrained_gpu else "")
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, amp=amp),
                               rollout=dataclasses.replace(cfg.rollout, dtype=dtype))


def engine_dtype(cfg: RunConfig) -> torch.dtype | None:
    """The dtype of the rollout engine's model copies (rollout.dtype), None to keep the policy's ("auto" left
    unresolved, as in a test that builds an arm directly: the policy's)."""
    return getattr(torch, cfg.rollout.dtype) if cfg.rollout.dtype not in ("", "auto") else None


def engine_copy(module: torch.nn.Module | None, cfg: RunConfig) -> torch.nn.Module | None:
    """`module` (a policy or draft) in the rollout engine's dtype (engine_dtype): itself where it already is (or no
    dtype is set), else a cast copy. For the engines the RL loop does not own (the warm start's pool sampling and
    tau checks): they decode on what the RL rollouts decode on, at the KV cache's size there (a 64-row pool of
    34K-token rows of the long-context workload is 71 GB in fp32, 36 GB in bf16) and speed."""
    dt = engine_dtype(cfg)
    if module is None or dt is None or next(module.parameters()).dtype == dt:
        return module
    return copy.deepcopy(module).to(dt)


def at_temperature(gen_cfg: GenerateConfig, temperature: float) -> GenerateConfig:
    """`gen_cfg` with only the sampling temperature changed (evaluations at T = 0 and the run's T)."""
    return dataclasses.replace(gen_cfg, sampling=dataclasses.replace(gen_cfg.sampling, temperature=temperature))


# What each command runs: the mesh dimensions it supports.
_SUPPORTED = {"train": ("pp", "dp", "cp", "tp"), "cotrain-cp": ("dp", "cp")}


def _check_fsdp(cfg: RunConfig, world: int, command: str) -> None:
    """What FSDP (parallel.dp_shard, parallel/fsdp.py) is not wired into yet, refused by name with the fix."""
    p, off = cfg.parallel, "drop parallel.dp_shard (plain data parallelism: parallel.dp)"
    if command != "train":
        raise ConfigError(f"parallel.dp_shard={p.shard}: FSDP runs in `specco train` only; {off}")
    if p.pp * p.dp * p.cp == 1:
        raise ConfigError(f"parallel.dp_shard={p.shard} on one process: nothing to shard over (FSDP at world 1 is "
                          f"not wired); set parallel.dp_shard to the number of processes or {off}")


def _check_ep(cfg: RunConfig, command: str) -> None:
    """What expert parallelism (parallel.ep, parallel/ep.py) is not wired into, refused by name with the fix: it is
    tested (tests/test_ep.py, test_ep_fsdp.py, test_ep_pp.py) with plain data parallelism, context parallelism, FSDP
    (parallel.dp_shard: the dense parameters sharded, the expert slices left to ep) and pipeline parallelism (each
    stage's experts over its own ranks), fp64, on gloo. Whether the
    policy is a mixture of experts whose num_experts ep divides is validate.check_moe_layout's (it reads
    config.json)."""
    p, off = cfg.parallel, "or set parallel.ep=1"
    if command != "train":
        raise ConfigError(f"parallel.ep={p.ep}: expert parallelism runs in `specco train` only; set parallel.ep=1")
    if p.tp > 1:
        raise ConfigError(f"parallel.ep={p.ep} with parallel.tp={p.tp}: expert parallelism under tensor parallelism "
                          f"is not implemented; set parallel.tp=1 {off}")
    if (p.dp * p.cp) % p.ep:
        raise ConfigError(f"parallel.ep={p.ep} does not divide parallel.dp × parallel.cp = {p.dp * p.cp}: expert "
                          "parallelism borrows those ranks (they hold different tokens); set parallel.ep to a "
                          "divisor of it")
    if cfg.train.compile != "none":  # the dispatch reads its split sizes on the host
        raise ConfigError(f"train.compile={cfg.train.compile!r} with parallel.ep={p.ep}: compiling the expert-parallel "
                          f"layers is not wired; set train.compile=none {off}")
    if cfg.policy.source == "tiny" and cfg.policy.family != "qwen3_moe":
        raise ConfigError(f"parallel.ep={p.ep}: policy.source='tiny' with policy.family={cfg.policy.family!r} is a "
                          "dense model (no experts to place); set parallel.ep=1, or policy.family='qwen3_moe' with "
                          "policy.num_experts, or train a mixture-of-experts checkpoint")


def tiny_policy(cfg: RunConfig, tok) -> PolicyConfig:
    """The from-scratch policy's config (policy.source = 'tiny'): sizes and architecture from [policy], the
    vocabulary the tokenizer's; the one place they are read (prepare builds it, validate and plan check its shape).
    policy.router_aux_loss_coef is applied to the built policy, as to a loaded one (prepare.with_run_overrides)."""
    ps = cfg.policy
    return tiny_policy_config(tok, ps.hidden_size, ps.num_layers, ps.num_heads, ps.num_kv_heads, ps.intermediate_size,
                              ps.max_positions, ps.rope_theta, family=ps.family, num_experts=ps.num_experts,
                              num_experts_per_tok=ps.num_experts_per_tok,
                              moe_intermediate_size=ps.moe_intermediate_size)


def _check_tp(cfg: RunConfig) -> None:
    """What tensor parallelism (parallel.tp, parallel/tp.py) is not wired into, refused by name with the fix: it
    is tested (tests/test_tp.py, test_rl_tp.py) alone and with FSDP, context and pipeline parallelism and activation
    checkpointing, in fp64 and bf16 autocast, without compile (dynamo failed on the TP layers: RecursionError)."""
    p, off = cfg.parallel, "or set parallel.tp=1"
    if p.tp_sequence_parallel and (p.cp > 1 or p.pp > 1):  # a stage's activations and the ring's chunks would
        # be cut along the sequence twice
        raise ConfigError(f"parallel.tp_sequence_parallel=true with parallel.cp={p.cp}, parallel.pp={p.pp}: sequence "
                          "parallelism under context or pipeline parallelism is not implemented; drop "
                          "parallel.tp_sequence_parallel")
    if cfg.train.compile != "none":
        raise ConfigError(f"train.compile={cfg.train.compile!r} with parallel.tp={p.tp}: compiling the "
                          f"tensor-parallel layers is not wired; set train.compile=none {off}")
    if cfg.policy.source == "tiny":  # a pretrained policy's sizes: validate.check_policy, from its config.json
        check_tp_sizes(cfg.policy, p.tp, "policy.")


def check_tp_sizes(sizes, tp: int, where: str, key_name: str = "parallel.tp") -> None:
    """A ConfigError unless tp divides the heads, kv heads and MLP width of `sizes` (a PolicySpec or PolicyConfig;
    `where` prefixes its keys): each tp rank holds 1/tp of each (parallel/tp.py; apply_tp's own check is the
    backstop). `key_name` rollout.tp: the engine's shard (rollout/tp.py) also cuts the vocabulary and a mixture of
    experts' expert widths."""
    keys = ("num_heads", "num_kv_heads", "intermediate_size") + (
        ("vocab_size", "moe_intermediate_size", "shared_expert_intermediate_size") if key_name == "rollout.tp" else ())
    for key in keys:
        n = getattr(sizes, key, None)  # a PolicySpec has no vocab_size (the tiny policy's is its tokenizer's)
        if n and n % tp:  # (0 / None: a dense policy's expert widths)
            raise ConfigError(f"{key_name}={tp}: {where}{key}={n} is not a multiple of it (each tp rank holds "
                              f"{key} / tp of every layer); pick a tp that divides it")


def _check_rollout_tp(cfg: RunConfig) -> None:
    """rollout.tp (the engine's tensor parallelism, rollout/tp.py) against the layout, refused by name with the fix.
    The engine tp groups are cut from the ranks that train on one DP group's rollouts (its cp x tp ranks, which
    hold the same sampler), so the tokens are those of one rank decoding them whole."""
    p, n = cfg.parallel, cfg.rollout.tp
    if (p.cp * p.tp) % n:
        raise ConfigError(f"rollout.tp={n}: the engine's ranks are those that share one DP group's rollouts, "
                          f"parallel.cp x parallel.tp = {p.cp} x {p.tp} = {p.cp * p.tp} of them, which rollout.tp must "
                          "divide; set rollout.tp to a divisor of it (or raise parallel.tp / parallel.cp)")
    dspark = [a for a in cfg.arms if split_arm(a, cfg.draft.kind)[1] == "dspark"]
    if dspark:  # its Markov bias reads whole-vocabulary rows of its own (rollout/tp.py)
        raise ConfigError(f"arms {dspark} with rollout.tp={n}: a DSpark draft on a tensor-parallel engine is not "
                          "implemented; use DFlash or EAGLE-3 arms, or rollout.tp=1")
    if cfg.policy.source == "tiny":  # a pretrained policy's sizes: validate.check_policy, from its config.json
        check_tp_sizes(cfg.policy, n, "policy.", "rollout.tp")


def check_parallel(cfg: RunConfig, world: int, command: str = "train") -> tuple[int, int, int]:
    """Validate cfg.parallel against the launch (WORLD_SIZE = `world`) for `command`; return (pp, dp, cp).

    Every refusal names the key and what to change: a dimension the command does not implement
    (pipeline parallelism: `specco train` only), sizes whose product is not the number of processes, prompts that
    do not split into whole GRPO groups per data-parallel rank and PPO minibatch."""
    p = cfg.parallel
    for dim in ("pp", "dp", "cp", "tp"):
        if getattr(p, dim) > 1 and dim not in _SUPPORTED[command]:
            what = {"pp": "pipeline parallelism runs in `specco train` only",
                    "tp": "tensor parallelism runs in `specco train` only"}.get(dim, "not supported")
            raise ConfigError(f"parallel.{dim}={getattr(p, dim)}: {what} in `specco {command}`; "
                              f"set parallel.{dim}=1")
    n = p.pp * p.dp * p.cp * p.tp
    if n != world:
        others = p.pp * p.cp * p.tp
        if world == 1:
            how = f"launch it with `torchrun --nproc-per-node {n} -m specco {command} ...` (or --nnodes x --nproc-per-node = {n})"
        elif world % others == 0:
            how = f"set parallel.dp={world // others}" + "".join(
                f" (with parallel.{k}={v})" for k, v in (("pp", p.pp), ("cp", p.cp), ("tp", p.tp)) if v > 1)
        else:
            how = f"set parallel.pp x parallel.dp x parallel.cp x parallel.tp = {world}"
        raise ConfigError(f"parallel.pp x parallel.dp x parallel.cp x parallel.tp = {p.pp} x {p.dp} x {p.cp} x "
                          f"{p.tp} = {n} but {world} process(es) were launched (WORLD_SIZE): {how}")
    if p.ep > 1:  # before tp's and FSDP's checks: the refusal names ep
        _check_ep(cfg, command)
    if p.tp > 1:
        _check_tp(cfg)
    if cfg.rollout.tp > 1:
        _check_rollout_tp(cfg)
    if cfg.train.compile != "none" and command != "train":
        raise ConfigError(f"train.compile={cfg.train.compile!r}: compiles the RL trainer's layers (`specco train`); "
                          f"`specco {command}` does not; set train.compile=none")
    if cfg.train.compile != "none" and (p.pp > 1 or p.cp > 1):
        # the ring's sends and the pipeline's stage modules run inside the layers: not traced here
        raise ConfigError(f"train.compile={cfg.train.compile!r} with parallel.pp={p.pp}, parallel.cp={p.cp}: "
                          "compiling the layers of a pipeline stage or under context parallelism is not "
                          "implemented; set train.compile=none")
    if p.fsdp:
        _check_fsdp(cfg, world, command)
    if command == "train" and p.pp > 1:
        why = "the pipeline co-trains EAGLE-3 drafts only (block drafters under PP are not implemented)"
        if cfg.draft.kind != "eagle3":
            raise ConfigError(f"draft.kind={cfg.draft.kind!r} with parallel.pp={p.pp}: {why}; use "
                              "draft.kind=eagle3 or parallel.pp=1")
        block = [a for a in cfg.arms if split_arm(a, cfg.draft.kind)[1] in BLOCK_KINDS]
        if block:
            raise ConfigError(f"arms {block} with parallel.pp={p.pp}: {why}; drop those arms or use "
                              "parallel.pp=1")
        if cfg.policy.source == "tiny" and cfg.policy.num_layers < p.pp:
            raise ConfigError(f"parallel.pp={p.pp} > policy.num_layers={cfg.policy.num_layers}: every stage needs a "
                              "layer")
    if command == "train":
        r, t = cfg.rollout, cfg.train
        if r.prompts_per_step % p.dp:
            raise ConfigError(f"rollout.prompts_per_step={r.prompts_per_step} must be divisible by "
                              f"parallel.dp={p.dp}: each rank rolls out whole prompt groups")
        if (r.prompts_per_step // p.dp) % t.minibatches:
            raise ConfigError(f"rollout.prompts_per_step / parallel.dp = {r.prompts_per_step // p.dp} prompts per "
                              f"rank must be divisible by train.minibatches={t.minibatches}: every PPO minibatch "
                              "holds whole prompt groups")
    return p.pp, p.dp, p.cp
