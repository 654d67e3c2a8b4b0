"""The RL trainer's config slice (`[train]` in a run config): GRPO/PPO with co-training, its schedule, precision,
micro-batching and checkpoints. Owned by the trainer (train/step_config.py's StepConfig holds the step's own defaults,
which these fields read); specco/config.py composes it into the run config."""
from __future__ import annotations

from dataclasses import dataclass

from ..model.config import check as _check, check_finite_fields
from .step_config import LR_SCHEDULES, StepConfig

_STEP = StepConfig()  # the step owns its defaults; the config reads them

# train.compile: torch.compile backend of the trainer's decoder layers (train/compile.py); "none" = eager
COMPILE_BACKENDS = ("none", "inductor", "aot_eager")


@dataclass(frozen=True)
class TrainSpec:
    seed: int = 0
    steps: int = 30  # RL steps (a finished run extends when this grows: run it again with the larger value)
    warm_start_steps: int = 150  # offline draft training against the frozen SFT policy
    warm_start_prompts: int = 256  # prompts whose policy samples (x4) form the warm-start pool
    # pool rows drawn per warm-start step; the draft trains on (and the policy runs on) every draft_row_stride-th
    warm_start_batch: int = 64
    # The policy's LR: ~1e-6 suits a pretrained policy (GRPO recipes use 1e-6 to 3e-6; the from-scratch demo
    # model, configs/demo.toml, uses 5e-5)
    lr: float = 1e-6
    warm_start_lr: float = 1e-3  # offline draft training (decays to 10% over the warm start)
    # The draft's own LR while co-training (public runs use ~50x the policy's). Lower than the warm
    # start's: each RL step brings a few noisy rows, and at 1e-3 the co-trained draft's loss rose
    # above the frozen draft's (bench/results/gpu_rl_deep_lr1e-3, docs/DESIGN.md §6).
    draft_lr: float = 2e-4
    draft_weight: float = _STEP.draft_weight  # lambda in L_policy + lambda * L_draft
    clip_eps: float = _STEP.clip_eps
    # > 0: a KL penalty kl_coef * KL_k3(policy || reference) per trained token, the reference being the
    # arm's frozen starting policy (the SFT policy), as GRPO does. 0: no reference policy is kept.
    kl_coef: float = _STEP.kl_coef
    # PPO: every rollout batch is split into `minibatches` (whole prompt groups, interleaved: minibatch j
    # holds the groups g with g % minibatches == j) and trained for `ppo_epochs` passes, one optimizer
    # step per minibatch and pass. With more than one update the old log-probs are recomputed once
    # before the first update and the PPO ratio / clip fraction become meaningful; with exactly one the
    # recompute is skipped (the ratio is exactly 1 on-policy).
    ppo_epochs: int = 1
    minibatches: int = 1
    policy_grad_clip: float = _STEP.policy_grad_clip
    draft_grad_clip: float = _STEP.draft_grad_clip
    warmup_steps: int = 0
    # the policy's LR after its warmup: "cosine" decays to 10% by the last RL step, "constant" holds it (GRPO
    # recipes commonly do; a short run then moves the policy ~1.7x as far as under an 8-step cosine)
    lr_schedule: str = "constant"
    draft_warmup_steps: int = 5  # RL phase: the draft's LR ramps up so the warm start is not shaken
    loss_chunk: int = _STEP.loss_chunk  # sequence chunk for vocabulary-sized fp32 work
    # The draft co-trains on rollout rows 0, n, 2n, ... (1 = all; always at least one row): its
    # share of the train step shrinks ~n-fold while it still sees an unbiased sample of the
    # policy's outputs (the G samples of a prompt are i.i.d.). The demo: 64 of 512 rows.
    draft_row_stride: int = _STEP.draft_row_stride
    # > 0: a floor on the completion tokens the draft co-trains on per RL step. The stride then shrinks, step by
    # step, to the largest divisor of rollout.group_size (<= draft_row_stride) whose rows hold that many
    # (train/cotrain.draft_stride; logged as draft/row_stride). Why: when the policy's answers shorten — 4 of 14
    # long H200 runs, e.g. 615 -> 299 tokens in the fourteenth — a fixed stride starves the draft of tokens just
    # when the text it must follow changes fastest. 0 = the fixed stride.
    draft_min_tokens: int = 0
    # The co-trained draft trains in every n-th PPO update of an RL step (updates 0, n, 2n, ... counted over
    # ppo_epochs x minibatches; 1 = every update). Why: at small shapes a draft update is bound by the host's
    # dispatch of its ~1,300-1,700 ops, not by its rows (drift workload, H200: +0.06-0.09 s per step for four updates
    # of 16 rows), so one update of 64 rows costs about one of 16. With minibatches = 4, draft_update_stride = 4 and
    # draft_row_stride = 1 the draft sees as many rows per step (minibatch 0's) in a quarter of the dispatches, in
    # one AdamW step instead of four (docs/experiments/drift.md).
    draft_update_stride: int = 1
    # Rows per forward/backward of the train step (0 = all at once); gradients accumulate, the
    # update equals the whole-batch one. Lower it when the train step runs out of memory.
    micro_batch_rows: int = _STEP.micro_batch_rows
    # Micro-batch widths (each cut to its longest row) rounded up to a multiple of this (1 = exact), so a run
    # sees few distinct shapes: for kernels that plan per shape (cuDNN attention). The TTT trunk runs on
    # FlashAttention-2 on CUDA (ops/attention.ttt_trunk_impl), which does not, so exact widths are the default.
    # Under share_prompts also each packed group's shared prefix length (rounded down; parallel/shared_prompts.py).
    width_multiple: int = _STEP.width_multiple
    # The policy's train-step forward (and log-prob recompute) runs each prompt group's shared prompt once: a
    # group's rows packed into one, [prompt[:-1] | prompt[-1], completion_1 | ... | prompt[-1], completion_n], each
    # segment attending to the whole prefix and causally to itself (parallel/shared_prompts.py). Exact (every
    # gradient is the rows' own); the policy's work on the prompt falls n-fold (group_size n): for long prompts
    # and short completions. Micro-batches then hold whole groups (micro_batch_rows rounds up to a multiple of
    # group_size); the draft trains on the rows as before. One device (not with CP or PP).
    share_prompts: bool = _STEP.share_prompts
    # Recompute each policy layer's activations in the backward instead of keeping them
    # (train/activation_checkpointing.py): long contexts, at one extra layer forward per layer.
    activation_checkpointing: bool = False
    # torch.compile the RL trainer's decoder layers (train/compile.py): "inductor" fuses the eager forward's
    # elementwise kernels (norms, RoPE, SwiGLU, casts); "aot_eager" only checks that they compile; "none" =
    # eager. With activation_checkpointing the checkpoint runs the compiled forward and its recompute runs the
    # same graph again. The rollout engine is never compiled (its decode path has its own fused kernels).
    compile: str = "none"
    # ... and the co-trained EAGLE-3 draft's per-pass layer work with the same backend (train/compile.py
    # apply_draft_compile: norms, q/k/v with RoPE, output projection, MLP; its attention and loss stay eager).
    # Not yet measured on the GPU
    compile_draft: bool = False
    # Before an arm's first RL step, the trainer's policy runs a forward + backward and a no-grad forward once at
    # every micro-batch shape the run can bring (runner/derive.train_shapes, train/compile.warm_shapes), so the
    # one-time work per shape (cuDNN attention plans: 104 + 158 ms of host time in an update's first pass over new
    # widths on the H200) lands before the timed steps, as a long run pays it once, not inside a short run's
    # first steps. Needs width_multiple >= 64 (a few dozen shapes at most); not with CP or PP (other layouts).
    warm_widths: bool = False
    # Mixed precision of the train step (and the log-prob recompute): "bf16" runs forwards and losses
    # under torch.autocast(bfloat16) with fp32 weights, gradients and optimizer state; "none" = off.
    # "auto" = bf16 for a pretrained policy on a GPU, "none" elsewhere (the tiny demo, CPUs)
    amp: str = "auto"
    # DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13): a completion that runs into the last
    # `overlong_buffer` tokens before rollout.max_new_tokens loses up to `overlong_penalty` of its reward,
    # linearly, all of it at the budget (losses.overlong_penalty), so runaway rows get a gradient toward stopping.
    # Shapes the advantages only: the logged `reward` stays the task's score. 0 = off
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    checkpoint_every: int = 10
    # Every save_every RL steps and at the end: out_dir/policy (a Hugging Face checkpoint transformers loads) and
    # out_dir/draft (specco generate --draft, specco export), written atomically. 0 = at the end only
    save_every: int = 10
    # Evaluation on the eval set ([data] eval / eval_fraction / a procedural source's held-out stream) before the
    # first RL step, every eval_every steps and at the end: mean reward and accuracy, greedy and sampled at the
    # rollout temperature (eval.jsonl, eval.png), decoded on the policy as the rollouts sample it (the engine's
    # copy in rollout.dtype; a tensor-parallel engine's: the trainer's), after the engine has given back its KV
    # caches and graphs (the next rollout captures them again). 0 = before and after only
    eval_every: int = 10
    keep_checkpoints: int = 2  # newest checkpoints kept per arm (each holds the AdamW state too)
    # A NaN/inf loss, gradient norm or weight: "stop" the run with an error naming the step and the
    # quantity, or "skip" that RL step's update (keeps a copy of the weights and AdamW state to go back to).
    on_nonfinite: str = "stop"
    # The refit guard (runner/refit_guard.py): after every refit the engine's weights must equal the
    # trainer's (fingerprints), and a collapse of the draft's acceptance is an error naming the step.
    refit_guard: bool = True

    def __post_init__(self):
        check_finite_fields(self, "train")
        _check(self.checkpoint_every >= 1, f"train.checkpoint_every={self.checkpoint_every}: must be >= 1 "
               "(every RL run also checkpoints at its last step)")
        for n in ("policy_grad_clip", "draft_grad_clip"):
            _check(getattr(self, n) > 0, f"train.{n}={getattr(self, n)}: must be > 0 (the max gradient norm; a "
                   "negative one flips the update direction)")
        _check(self.warmup_steps >= 0 and self.draft_warmup_steps >= 0,
               "train.warmup_steps and train.draft_warmup_steps must be >= 0")
        _check(self.on_nonfinite in ("stop", "skip"), f"train.on_nonfinite={self.on_nonfinite!r}: use 'stop' "
               "or 'skip'")
        _check(self.compile in COMPILE_BACKENDS, f"train.compile={self.compile!r}: use one of "
               f"{', '.join(repr(x) for x in COMPILE_BACKENDS)}")
        _check(not self.compile_draft or self.compile != "none", "train.compile_draft=true with train.compile="
               "'none': it compiles with train.compile's backend; set train.compile=inductor (or aot_eager)")
        _check(self.lr_schedule in LR_SCHEDULES, f"train.lr_schedule={self.lr_schedule!r}: use one of "
               f"{', '.join(repr(x) for x in LR_SCHEDULES)}")
        _check(self.steps >= 0 and self.warm_start_steps >= 0, "train.steps and train.warm_start_steps must be >= 0")
        _check(self.eval_every >= 0 and self.save_every >= 0, f"train.eval_every={self.eval_every}, train.save_every="
               f"{self.save_every}: must be >= 0 (0 = only at the start and end / only at the end)")
        _check(self.lr > 0 and self.draft_lr > 0 and self.warm_start_lr > 0,
               "train.lr, train.draft_lr and train.warm_start_lr must be > 0")
        _check(self.draft_weight >= 0, f"train.draft_weight={self.draft_weight}: must be >= 0")
        _check(self.clip_eps > 0, f"train.clip_eps={self.clip_eps}: must be > 0")
        _check(self.kl_coef >= 0, f"train.kl_coef={self.kl_coef}: must be >= 0 (0 = no KL penalty)")
        _check(self.ppo_epochs >= 1, f"train.ppo_epochs={self.ppo_epochs}: must be >= 1")
        _check(self.minibatches >= 1, f"train.minibatches={self.minibatches}: must be >= 1")
        _check(self.loss_chunk >= 1, "train.loss_chunk must be >= 1")
        _check(self.keep_checkpoints >= 1, f"train.keep_checkpoints={self.keep_checkpoints}: keep at least 1 "
               "(the run resumes from the newest)")
        _check(self.amp in ("auto", "none", "bf16"), f"train.amp={self.amp!r}: use 'auto', 'none' or 'bf16' (fp16 "
               "would need loss scaling)")
        _check(self.warm_start_batch >= 1,
               f"train.warm_start_batch={self.warm_start_batch}: must be >= 1 (lower it, e.g. 4-8, "
               "if the draft warm start runs out of memory)")
        _check(self.warm_start_prompts >= 1,
               f"train.warm_start_prompts={self.warm_start_prompts}: must be >= 1")
        _check(self.micro_batch_rows >= 0, f"train.micro_batch_rows={self.micro_batch_rows}: must be "
               ">= 0 (0 = the whole batch in one forward/backward)")
        _check(self.width_multiple >= 1, f"train.width_multiple={self.width_multiple}: must be >= 1 "
               "(1 = every micro-batch cut to its own longest row)")
        _check(self.overlong_buffer >= 0 and self.overlong_penalty >= 0,
               f"train.overlong_buffer={self.overlong_buffer}, train.overlong_penalty={self.overlong_penalty}: both "
               "must be >= 0 (overlong_buffer 0 = no length penalty)")
        _check(self.draft_row_stride >= 1, f"train.draft_row_stride={self.draft_row_stride}: "
               "must be >= 1 (1 = the draft trains on every rollout row)")
        _check(not self.warm_widths or self.width_multiple >= 64,
               f"train.warm_widths with train.width_multiple={self.width_multiple}: every width up to the longest row "
               "would be a shape to warm; set width_multiple >= 64 (the long configs use 128)")
        _check(self.draft_update_stride >= 1, f"train.draft_update_stride={self.draft_update_stride}: must be >= 1 "
               "(1 = the draft trains in every PPO update)")
        _check(self.draft_min_tokens >= 0, f"train.draft_min_tokens={self.draft_min_tokens}: must be >= 0 "
               "(0 = the fixed train.draft_row_stride)")
