"""The static shape a DecodeRunner's buffers and graphs are built for, and how a call's shape is bucketed.

With CUDA graphs every buffer has a fixed shape, so a runner serves the calls whose shape it holds: the
batch padded up to a bucket (prompts: next power of two up to 32, then multiples of 32), the prompt length
up to a multiple of 16, and a KV cache as long as prompt + max_new_tokens + the drafter's lookahead.
Also the right-padded prompt layout the prefill step reads (`pad_prompts`, `PromptBuffers`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..batch import round_up
from .config import GenerateConfig
from .drafters import engine_kind


@dataclass(frozen=True)
class RunnerShape:
    """The static shape a DecodeRunner's buffers and graphs are built for."""
    prompts: int  # B0 rows of the prefill (padded), each the leader of a group
    group_size: int  # G samples per prompt: B0*G decode rows
    prompt_len: int  # S, prefill length (padded)
    cache_len: int  # target and draft KV cache length

    @classmethod
    def bucket(cls, num_prompts: int, prompt_len: int, group_size: int, cfg: GenerateConfig,
               k: int, bucketed: bool) -> "RunnerShape":
        B0, S = num_prompts, prompt_len
        if bucketed:  # few distinct shapes, so graphs captured once serve many calls
            B0 = 1 << (B0 - 1).bit_length() if B0 <= 32 else round_up(B0, 32)
            S = round_up(max(S, cfg.min_prompt_len), 16)
        # Verify writes up to n + k with n <= L + T - 2 while a row is live; + slack.
        cache_len = S + cfg.max_new_tokens + k + 1
        if bucketed:  # 16-aligned rows for the attention kernels
            cache_len = round_up(cache_len, 16)
        return cls(B0, group_size, S, cache_len)

    def holds(self, other: "RunnerShape") -> bool:
        """A runner of this shape can serve a call of shape `other`: the same rows, prompts no longer (they
        are right-padded to this prompt_len, as bucketing pads them anyway) and a cache at least as long.
        So prompts whose length bucket changes from call to call (an RL task's 63- and 65-token prompts
        are buckets 64 and 80) do not rebuild the runner, and recapture its graphs, at every change."""
        return ((self.prompts, self.group_size) == (other.prompts, other.group_size)
                and self.prompt_len >= other.prompt_len and self.cache_len >= other.cache_len)


def execution_modes(cfg: GenerateConfig, device: torch.device) -> tuple[bool, bool]:
    """(use CUDA graphs, pad shapes to buckets) for `cfg` on `device`."""
    use_graphs = (device.type == "cuda") if cfg.use_graphs is None else cfg.use_graphs
    if use_graphs and device.type != "cuda":
        raise ValueError("use_graphs=True needs the model on a CUDA device")
    return use_graphs, use_graphs if cfg.bucket_shapes is None else cfg.bucket_shapes


def speculation_control(cfg: GenerateConfig, device: torch.device) -> bool:
    """Whether a speculative runner for `cfg` on `device` runs speculation control (GenerateConfig.spec_control;
    None: on iff CUDA graphs are, since it times their captured steps)."""
    return execution_modes(cfg, device)[0] if cfg.spec_control is None else cfg.spec_control


def lookahead(cfg: GenerateConfig, draft) -> int:
    """How many positions past n a round may write (the drafter kind's lookahead at k_max; 0 without a draft)."""
    kind = engine_kind(draft)
    return 0 if kind is None else kind.lookahead(draft, cfg.num_draft_tokens)


def runner_shape(cfg: GenerateConfig, device: torch.device, draft, num_prompts: int,
                 prompt_len: int, group_size: int) -> RunnerShape:
    """The shape (bucket) a DecodeRunner uses for this call: what RolloutEngine keys its runners by."""
    _, bucketed = execution_modes(cfg, device)
    return RunnerShape.bucket(num_prompts, prompt_len, group_size, cfg, lookahead(cfg, draft), bucketed)


def pad_prompts(prompts: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts -> right-padded ids (B0, S) and lengths (B0,), int64 on the host."""
    if len(prompts) == 0:
        raise ValueError("generate() needs at least one prompt")
    rows = [torch.as_tensor(p, dtype=torch.long).flatten() for p in prompts]
    if min(r.numel() for r in rows) < 1:
        raise ValueError("every prompt needs at least one token")
    lens = torch.tensor([r.numel() for r in rows])
    ids = torch.zeros(len(rows), int(lens.max()), dtype=torch.long)  # (B0, S) right-padded
    for b, r in enumerate(rows):
        ids[b, : r.numel()] = r
    return ids, lens


@dataclass
class PromptBuffers:
    """Static inputs of the prefill step, refilled on the host side each call."""
    ids: torch.Tensor  # (B0, S) int64 right-padded prompt ids
    lens: torch.Tensor  # (B0,) int64 prompt lengths (1 for padding prompts)
    real: torch.Tensor  # (B0,) bool, False for padding prompts
    u0: torch.Tensor | None  # (B0*G,) uniforms for the first token (None when greedy or coupled)
    key0: torch.Tensor | None = None  # (B0*G,) int64 row keys of coupled sampling (sampling.keyed_gumbel)
