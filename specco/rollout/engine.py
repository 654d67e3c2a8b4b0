"""RolloutEngine: the rollout side of an RL step — holds the policy (+ draft) and generates with them.

The trainer owns the authoritative weights; after each optimizer step it calls `refit` to copy them
into the engine's models. Refit is a boundary and fails loudly (STYLE §10): a draft state without a
draft, a missing/unexpected key or a shape mismatch raises. (A public peer ran for days at zero
acceptance because a draft refit that took no weights was only a warning.)
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import nn

from ..model.draft import Eagle3Draft
from ..model.policy import Policy
from .generate import GenerateConfig, GenerateOutput, generate


class RefitError(RuntimeError):
    """New weights could not be loaded into the rollout engine exactly."""


def _load_exact(model: nn.Module, state: Mapping[str, torch.Tensor], what: str) -> int:
    """Copy `state` into `model` in place; every key must exist on both sides with equal shapes."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise RefitError(f"{what} refit: state keys do not match the engine's model; "
                         f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                         f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}")
    bad = [(k, tuple(v.shape), tuple(own[k].shape)) for k, v in state.items()
           if tuple(v.shape) != tuple(own[k].shape)]
    if bad:
        raise RefitError(f"{what} refit: shape mismatch (key, given, expected): {bad[:8]}")
    with torch.no_grad():
        for k, v in state.items():  # in-place copy keeps tied weights tied and graph buffers valid
            own[k].copy_(v)
    return len(state)


class RolloutEngine:
    def __init__(self, policy: Policy, draft: Eagle3Draft | None = None,
                 cfg: GenerateConfig | None = None):
        self.policy, self.draft = policy.eval(), draft
        self.cfg = cfg or GenerateConfig()
        if draft is not None:
            draft.eval()
            self._check_draft_fits(policy, draft)

    @staticmethod
    def _check_draft_fits(policy: Policy, draft: Eagle3Draft):
        """The tap contract between policy and draft (DESIGN §2), checked once at the boundary."""
        pc, dc = policy.cfg, draft.cfg
        if dc.hidden_size != pc.hidden_size:
            raise ValueError(f"draft hidden_size {dc.hidden_size} != policy hidden_size {pc.hidden_size}")
        if dc.target_vocab_size != pc.vocab_size:
            raise ValueError(f"draft target_vocab_size {dc.target_vocab_size} != policy vocab "
                             f"{pc.vocab_size}")
        held = {int(i) for i in policy.layers}
        missing = [i for i in dc.aux_layer_ids if i not in held]
        if missing:
            raise ValueError(f"draft aux layers {missing} are not layers of the policy "
                             f"(it holds {sorted(held)})")
        if policy.embed_tokens is None or policy.lm_head is None:
            raise ValueError("speculative rollouts need a whole policy (embedding and head)")

    def generate(self, prompts: Sequence, group_size: int = 1,
                 generator: torch.Generator | None = None,
                 cfg: GenerateConfig | None = None) -> GenerateOutput:
        return generate(self.policy, prompts, cfg or self.cfg, self.draft, group_size, generator)

    def refit(self, policy_state: Mapping[str, torch.Tensor] | None,
              draft_state: Mapping[str, torch.Tensor] | None = None) -> dict:
        """Load new weights. policy_state None keeps the policy; draft_state None keeps the draft
        (a frozen draft is legitimate). Returns {'policy': n_tensors, 'draft': n_tensors}."""
        if draft_state is not None and self.draft is None:
            raise RefitError("refit got a draft state but this engine has no draft: the draft "
                             "weights would be dropped (build the engine with draft=...)")
        n_policy = _load_exact(self.policy, policy_state, "policy") if policy_state is not None else 0
        n_draft = _load_exact(self.draft, draft_state, "draft") if draft_state is not None else 0
        return {"policy": n_policy, "draft": n_draft}
