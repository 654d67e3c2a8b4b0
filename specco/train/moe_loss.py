"""The router's load-balancing auxiliary loss of a mixture-of-experts policy (model/moe.py), the one home of its
formula, and its share of the GRPO step's loss.

Switch Transformer (Fedus et al. 2021, eqs. 4-6) as transformers' `load_balancing_loss_func` computes it for
Qwen2-MoE / Qwen3-MoE (read there, written here): over the rows r of every sparse layer (a token counts once per
sparse layer), only rows whose mask is 1,

    p_r = softmax(router logits_r)                     (E,) in fp32
    f_e = #{(r, j): top-k choice j of row r is e} / R   the share of top-k assignments (Σ_e f_e = k)
    P_e = Σ_r p_r,e / R                                 the mean router probability of expert e
    L_aux = E · Σ_e f_e · P_e                           R = valid rows summed over the layers

Uniform routing gives L_aux = k; piling tokens onto few experts raises it. f_e is a count (no gradient), so the
gradient reaches the router through P_e only. The top-k choice here is the router's (softmax then top-k), the
same as the forward's (`moe.route`), normalised or not.

The coefficient is config.json's `router_aux_loss_coef` (or the run config's policy.router_aux_loss_coef), applied
whatever config.json's `output_router_logits` says: in transformers that flag (false in the Hub's Qwen MoE configs)
both returns the router logits and switches the loss on, so `from_pretrained(...)` + a labels loss trains without
it unless the user sets it; specco's step always has the logits, and a user who wants no aux loss sets the
coefficient to 0.

In the step (`aux_share`): transformers adds `router_aux_loss_coef · L_aux` of each forward call to its loss;
specco does the same per micro-batch on each rank, with L_aux over the micro-batch's trained tokens
(target_mask: the completions the step learns from; padding and prompts are excluded), weighted by the
micro-batch's share of the global trained-token count, so the shares of every micro-batch and rank add up to the
token-weighted mean of their L_aux (the whole batch on one device: exactly L_aux). The mean over ranks of a
product of means is not the global batch's product (L_aux is not a sum over tokens): under DP and CP the
balanced quantity is per shard, as in every data-parallel trainer that computes it per forward.
"""
from __future__ import annotations

from typing import Sequence

import torch


def load_balancing_loss(router_logits: Sequence[torch.Tensor], top_k: int,
                        mask: torch.Tensor | None = None) -> torch.Tensor:
    """L_aux (module docstring) of the sparse layers' router logits, each (B, S, E) or (B·S, E); mask (B, S)
    (1: the row counts) or None (every row). A 0-d fp32 tensor; 0 where no row counts."""
    E = router_logits[0].shape[-1]
    counts = router_logits[0].new_zeros(E, dtype=torch.float32)  # Σ over layers of top-k assignments per expert
    prob_sum = router_logits[0].new_zeros(E, dtype=torch.float32)  # Σ over layers of router probabilities
    rows = 0.0
    w = None if mask is None else mask.reshape(-1, 1).to(torch.float32)  # (B·S, 1)
    for logits in router_logits:
        probs = torch.softmax(logits.reshape(-1, E), dim=-1, dtype=torch.float32)  # (B·S, E)
        chosen = torch.zeros_like(probs).scatter_(1, torch.topk(probs.detach(), top_k, dim=-1).indices, 1.0)
        if w is not None:  # masked rows count for nothing
            probs, chosen = probs * w, chosen * w
        counts = counts + chosen.sum(0)
        prob_sum = prob_sum + probs.sum(0)
        rows = rows + (probs.shape[0] if w is None else w.sum())
    rows = torch.as_tensor(rows, dtype=torch.float32, device=counts.device).clamp_min(1.0)
    return E * torch.sum((counts / rows) * (prob_sum / rows))


def aux_share(router_logits: Sequence[torch.Tensor], top_k: int, mask: torch.Tensor,
              num_tokens: torch.Tensor) -> torch.Tensor:
    """One micro-batch's (and rank's) share of the step's L_aux: load_balancing_loss over its trained tokens
    `mask` (B, S) times their share of the global trained-token count `num_tokens` (module docstring)."""
    return load_balancing_loss(router_logits, top_k, mask) * (mask.sum() / num_tokens)
