"""The SFT stage's config slice (`[sft]` in a run config), owned by the SFT stage (train/sft.py)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..model.config import ConfigError


@dataclass(frozen=True)
class SFTSpec:
    """Supervised fine-tuning before RL, only when `data` is given: a pretrained policy starts RL as it is."""
    # What to fine-tune on: "" = no SFT stage; a file or `datasets.save_to_disk` directory with a prompt column
    # and a completion column (read with [data]'s prompt_key, completion_key and templating); or a
    # `reasoning_gym:NAME` source, whose reference answers are written in [data]'s format and options (the
    # from-scratch demo model learns its task this way)
    data: str = ""
    steps: int = 100
    lr: float = 1e-5
    # Sequences per SFT step
    batch: int = 16
    # A reasoning_gym `data` in the "lookup" format: the SFT prompts' length range in tokens ([] = [data]'s
    # context_tokens). A wide range (e.g. [1024, 32768], drawn log-uniformly) teaches retrieval at every distance
    # while most rows stay short
    context_tokens: tuple[int, ...] = ()
    # Rows per forward/backward (0 = the whole batch): micro-batches take the rows longest first, each cut to its
    # own length, and accumulate the whole batch's mean loss (train.sft.sft_micro_batches)
    micro_batch_rows: int = 0
    # Micro-batch (or batch) widths rounded up to a multiple of this with padding no loss reads (1 = exact): few
    # distinct shapes for cuDNN attention, which builds an execution plan per new length (~0.1-0.16 s each on the
    # H200), where exact widths bring new ones every step (as train.width_multiple for the RL step)
    width_multiple: int = 1

    def __post_init__(self):
        object.__setattr__(self, "context_tokens", tuple(self.context_tokens))
        if self.width_multiple < 1:
            raise ConfigError(f"sft.width_multiple={self.width_multiple}: must be >= 1 (1 = exact widths)")
        for name in ("steps", "batch", "micro_batch_rows"):
            v = getattr(self, name)
            if v < 0 or (name == "batch" and v < 1):
                raise ConfigError(f"sft.{name}={v}: must be >= {1 if name == 'batch' else 0}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"sft.lr={self.lr}: must be a finite number > 0")
