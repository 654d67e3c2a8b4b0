"""The rollout engine's own config: what one `generate` call decodes and how.

The engine owns these defaults: the run config's `[rollout]` section reads its from here (specco/config.py;
runner.derive.generate_config builds a GenerateConfig from a RunConfig), so a GenerateConfig built directly
(tests, benches, `specco generate`) gets a run's values and the engine never reaches up into the
application's config.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .sampling import SamplingParams

# rollout.offload: what the engine gives back between a rollout and the next refit (RolloutEngine.release)
OFFLOAD_MODES = ("none", "cache", "weights+cache")


@dataclass(frozen=True)
class GenerateConfig:
    max_new_tokens: int = 40
    sampling: SamplingParams = field(default_factory=SamplingParams)
    num_draft_tokens: int = 3  # k_max, draft tokens proposed per round at most (speculative only)
    # Speculation control (control.py): choose k in 0..k_max per call and per compaction level from
    # costs the runner measures on its graphs and the live acceptance. None: on iff CUDA graphs are
    # (eager CPU timings are noisy, and the CPU demo reports τ at fixed k); True forces it anywhere.
    spec_control: bool | None = None
    # The stop token, or several (a tuple: a row ends at the first of any, as transformers' generate does with
    # generation_config's eos list, e.g. Qwen's <|im_end|> and <|endoftext|>). None: only max_new_tokens.
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int = 0  # fills tokens past each row's length
    use_graphs: bool | None = None  # None: CUDA graphs on CUDA, eager on CPU
    bucket_shapes: bool | None = None  # pad batch / prompt length to buckets; None: iff graphs
    # Live-row compaction (compaction.py): when live rows <= this fraction of the batch, continue on a
    # smaller batch holding just them. 0 disables.
    compact_below: float = 0.25
    compact_min_rows: int = 8  # the smallest compacted state (compaction.compact_size)
    # With bucketed shapes (CUDA graphs): the prompt bucket is at least this long. An RL loop sets it to its
    # run's longest prompt (runner.rollouts.longest_prompt), so steps whose prompts fall in different length
    # buckets share one runner from the first step on (RunnerShape.holds covers the shorter ones).
    min_prompt_len: int = 0

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if isinstance(self.eos_token_id, (list, tuple)):
            if not self.eos_token_id:
                raise ValueError("eos_token_id=(): give at least one stop id, or None for none")
            object.__setattr__(self, "eos_token_id", tuple(int(i) for i in self.eos_token_id))
        if not 0 <= self.compact_below < 1:
            raise ValueError(f"compact_below must be in [0, 1) (0 disables compaction), got {self.compact_below}")
        if self.compact_min_rows < 1 or self.compact_min_rows & (self.compact_min_rows - 1):
            raise ValueError(f"compact_min_rows must be a power of two >= 1, got {self.compact_min_rows}")
