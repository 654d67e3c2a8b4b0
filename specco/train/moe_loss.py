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

Under pipeline parallelism a micro-batch's L_aux spans the sparse layers of every stage; `RouterBalance` sums its
pieces over the stages inside the 1F1B schedule, so each stage backpropagates exactly its share of the unsplit
step's term (its docstring; tests/test_ep_pp.py).
"""
from __future__ import annotations

from typing import Sequence

import torch


def router_sums(router_logits: Sequence[torch.Tensor], top_k: int, mask: torch.Tensor | None = None,
                num_experts: int | None = None) -> torch.Tensor:
    """The additive pieces of L_aux over these sparse layers' rows: a (2E + 1,) vector [Σ top-k assignments per
    expert (E,), Σ router probabilities per expert (E,), R valid rows]; sums over layers add, so a pipeline's stages
    each sum their own layers and the totals give L_aux (`aux_from_sums`). Only the probability part carries a
    gradient (the counts are a top-k choice). router_logits: (B, S, E) or (B·S, E) each; mask (B, S) (1: the row
    counts) or None (every row); no logits (a stage without sparse layers): zeros of E = `num_experts`. Probabilities
    in fp32 (transformers' precision), fp64 for fp64 logits (the equivalence tests)."""
    if not router_logits:
        return torch.zeros(2 * num_experts + 1, dtype=torch.float64)
    E = router_logits[0].shape[-1]
    dtype = torch.promote_types(router_logits[0].dtype, torch.float32)
    counts = router_logits[0].new_zeros(E, dtype=dtype)  # Σ over layers of top-k assignments per expert
    prob_sum = router_logits[0].new_zeros(E, dtype=dtype)  # Σ over layers of router probabilities
    rows = router_logits[0].new_zeros(1, dtype=dtype)
    w = None if mask is None else mask.reshape(-1, 1).to(dtype)  # (B·S, 1)
    for logits in router_logits:
        probs = torch.softmax(logits.reshape(-1, E), dim=-1, dtype=dtype)  # (B·S, E)
        chosen = torch.zeros_like(probs).scatter_(1, torch.topk(probs.detach(), top_k, dim=-1).indices, 1.0)
        if w is not None:  # masked rows count for nothing
            probs, chosen = probs * w, chosen * w
        counts = counts + chosen.sum(0)
        prob_sum = prob_sum + probs.sum(0)
        rows = rows + (probs.shape[0] if w is None else w.sum())
    return torch.cat([counts, prob_sum, rows])  # (2E + 1,)


def aux_from_sums(sums: torch.Tensor) -> torch.Tensor:
    """L_aux = E · Σ_e (C_e / R)(P_e / R) from `router_sums`' (2E + 1,) vector (summed over layers or stages);
    0 where no row counts."""
    E = (sums.numel() - 1) // 2
    counts, prob_sum, rows = sums[:E], sums[E:2 * E], sums[2 * E:].clamp_min(1.0)
    return E * torch.sum((counts / rows) * (prob_sum / rows))


def load_balancing_loss(router_logits: Sequence[torch.Tensor], top_k: int,
                        mask: torch.Tensor | None = None) -> torch.Tensor:
    """L_aux (module docstring) of the sparse layers' router logits, each (B, S, E) or (B·S, E); mask (B, S)
    (1: the row counts) or None (every row). A 0-d tensor (fp32; fp64 for fp64 logits); 0 where no row counts."""
    return aux_from_sums(router_sums(router_logits, top_k, mask))


def aux_share(router_logits: Sequence[torch.Tensor], top_k: int, mask: torch.Tensor,
              num_tokens: torch.Tensor) -> torch.Tensor:
    """One micro-batch's (and rank's) share of the step's L_aux: load_balancing_loss over its trained tokens
    `mask` (B, S) times their share of the global trained-token count `num_tokens` (module docstring)."""
    return load_balancing_loss(router_logits, top_k, mask) * (mask.sum() / num_tokens)


class RouterBalance:
    """The GRPO step's router load-balancing term on one pipeline stage (every stage at pp = 1: the whole policy):
    the `sums` hook of parallel.pipeline.one_f_one_b.

    L_aux of a micro-batch spans every sparse layer, but a stage holds only its own, and L_aux is not a sum over
    layers (a product of two means over all of them). Its pieces are (`router_sums`): C (counts), P (probability
    sums), R (rows), each a sum over layers. So each stage adds its own to the prefix received with the
    activations (`add`), the last stage has the totals, and they travel back with the gradients; the gradient
    reaches the routers through P only, with dL/dP_s,e = E · C_e / R² for every stage s, so the term a stage
    backpropagates with its output (`loss`) is

        share · E · Σ_e (C_e / R²) · P_s,e         C, R the micro-batch's totals (constants), P_s its own sums

    whose sum over the stages is share · L_aux in value and gradient: the pp = 1 step's loss exactly. share =
    the micro-batch's trained tokens / the step's (aux_share). The last stage also keeps the metric share · L_aux
    of the totals (`total`, summed over its micro-batches). coef = 0: no backward term, the metric still kept.
    Under pp = 1 nothing travels: the one stage's sums are the totals."""

    def __init__(self, num_experts: int, top_k: int, coef: float, num_tokens: torch.Tensor):
        self.E, self.top_k, self.coef, self.num_tokens = num_experts, top_k, coef, num_tokens
        self.numel = 2 * num_experts + 1  # the length of the vector the stages exchange (fp64)
        self.total = 0.0  # Σ over micro-batches of share · L_aux (last stage)
        self._own: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # m -> (this stage's sums, share)

    def record(self, m: int, router_logits: Sequence[torch.Tensor], mask: torch.Tensor) -> None:
        """Micro-batch m's forward on this stage: its sparse layers' router logits, its trained tokens (B, S)."""
        with torch.set_grad_enabled(self.coef > 0 and torch.is_grad_enabled()):
            sums = router_sums(router_logits, self.top_k, mask, self.E).to(mask.device)
        self._own[m] = (sums, mask.sum() / self.num_tokens)

    def add(self, m: int, prefix: torch.Tensor | None) -> torch.Tensor:
        """The sums of the stages up to this one: `prefix` (the earlier stages', None on the first) + this stage's."""
        own = self._own[m][0].detach().to(torch.float64)
        return own if prefix is None else prefix + own

    def loss(self, m: int, totals: torch.Tensor) -> torch.Tensor | None:
        """The term this stage backpropagates with micro-batch m (class docstring), None at coef 0; `totals`: the
        micro-batch's sums over every stage (the same on every stage: they come back with the gradients, so each
        stage's metric `total` is the last stage's)."""
        sums, share = self._own.pop(m)
        self.total = self.total + share.detach().to(torch.float64) * aux_from_sums(totals)
        if self.coef == 0 or not sums.requires_grad:
            return None
        E = self.E
        weight = (E * totals[:E] / totals[2 * E:].clamp_min(1.0).square()).to(sums.dtype)  # (E,) constants
        return self.coef * share.to(sums.dtype) * torch.sum(weight * sums[E:2 * E])
