"""The co-training step's own config (train/cotrain.py) and the choices it accepts.

The step owns these defaults: the run config's `[train]` and `[draft]` sections read theirs from here
(specco/config.py), so a test or bench that builds a StepConfig directly gets the values a run gets, and no
component reaches up into the application's config for a default.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

LR_SCHEDULES = ("cosine", "constant")  # the policy's LR after warmup (cotrain.build_scheduler)


@dataclass(frozen=True)
class StepConfig:
    draft_weight: float = 1.0  # lambda
    ttt_passes: int = 3
    pass_decay: float = 0.8
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    temperature: float = 1.0  # the rollout's sampling temperature (log-probs are of softmax(z / T))
    policy_grad_clip: float = 1.0
    draft_grad_clip: float = 1.0
    loss_chunk: int = 1024
    # The draft trains on rollout rows 0, n, 2n, ... (1 = every row; at least row 0). GRPO rows are G i.i.d.
    # samples per prompt, so a stride that divides G keeps an unbiased sample of the policy's
    # outputs while cutting the draft's share of the step ~n-fold (docs/DESIGN.md §6: the overhead goal).
    draft_row_stride: int = 8
    # Rows per forward/backward (0 = the whole batch at once): gradients accumulate over
    # micro-batches with the whole batch's token counts as denominators, so the update is the
    # full-batch one (tested) while activation memory scales with the micro-batch.
    micro_batch_rows: int = 0
    # Micro-batch widths rounded up to a multiple of this (micro_batches): few distinct shapes per run.
    width_multiple: int = 1
    # Mixed precision: forwards and losses under torch.autocast in this dtype (None = off); weights,
    # gradients and optimizer state stay in their own dtype (fp32 master weights). bf16 only: fp16
    # would need loss scaling.
    amp_dtype: torch.dtype | None = None
    # The RL minibatches' layout (runner/rollouts.minibatches, one device): parallel.layout.SHARED_PROMPTS, each
    # prompt group's shared prompt run once by the policy (config train.share_prompts), else padded rows.
    share_prompts: bool = False

    def __post_init__(self):
        if self.amp_dtype not in (None, torch.bfloat16):
            raise ValueError(f"amp_dtype={self.amp_dtype}: only torch.bfloat16 (or None) is supported")


AMP_DTYPES = {"none": None, "bf16": torch.bfloat16}  # config train.amp -> StepConfig.amp_dtype
