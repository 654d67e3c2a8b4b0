"""Pure-torch dense-mask references that *define* the meaning of specco's attention ops (STYLE §8).

Nothing clever here on purpose: build the key set explicitly, build the boolean mask explicitly, run a
plain softmax in the input dtype (tests pass fp64) and let autograd produce the gradients.
"""

from __future__ import annotations

import math

import torch


def dense_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                              scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(scale · q kᵀ + mask) v with an explicit boolean mask (True = visible).

    q (B, H, Sq, D); k, v (B, Hkv, Sk, D), GQA by repeat_interleave (query head h uses kv head h // G);
    mask (Sq, Sk) or None. Returns (out (B, H, Sq, D), lse (B, H, Sq)), both in q's dtype.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # (B, H, Sk, D)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale  # (B, H, Sq, Sk)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.softmax(s, dim=-1), v), lse


def ttt_mask(S: int, P: int, device=None) -> torch.Tensor:
    """Visibility over keys [trunk (S); branch (S·P, anchor-major)] for the S queries of a pass.

    Query i sees trunk j <= i and branch entries a·P + p with a == i (its own anchor's P keys).
    Returns (S, S + S·P) bool.
    """
    i = torch.arange(S, device=device)
    trunk = i[None, :] <= i[:, None]  # (S, S)
    anchor_of_branch_key = torch.arange(S * P, device=device) // max(P, 1)  # (S·P,)
    branch = anchor_of_branch_key[None, :] == i[:, None]  # (S, S·P)
    return torch.cat([trunk, branch], dim=1)


def dense_ttt_reference(q_d: torch.Tensor, k_trunk: torch.Tensor, v_trunk: torch.Tensor,
                        k_branch: torch.Tensor | None, v_branch: torch.Tensor | None,
                        scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """TTT pass-d attention over the explicit key set [trunk; branch] with `ttt_mask` (docs/DESIGN.md §2, §3).

    q_d (B, H, S, D); k_trunk, v_trunk (B, Hkv, S, D); k_branch, v_branch (B, Hkv, S, P, D) or None.
    Returns (out, lse) in the input dtype; differentiable w.r.t. every input.
    """
    B, Hkv, S, D = k_trunk.shape
    if k_branch is None:
        k_all, v_all, P = k_trunk, v_trunk, 0
    else:
        P = k_branch.shape[3]
        # (B, Hkv, S, P, D) -> (B, Hkv, S·P, D): key a·P + p is anchor a's p-th branch key.
        k_all = torch.cat([k_trunk, k_branch.reshape(B, Hkv, S * P, D)], dim=2)
        v_all = torch.cat([v_trunk, v_branch.reshape(B, Hkv, S * P, D)], dim=2)
    return dense_attention_reference(q_d, k_all, v_all, ttt_mask(S, P, q_d.device), scale)
