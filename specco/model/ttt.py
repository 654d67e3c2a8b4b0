"""EAGLE-3 training-time test (TTT): K teacher-forced draft passes over a whole sequence.

Every position i is an anchor. Pass d (1-based) at anchor i simulates the draft's d-th chained
step at serving time:

    | pass 1                         | pass d >= 2
    | hidden: fc(taps_i)             | hidden: pass d-1 output at i (pre-norm, NOT detached)
    | token:  emb(x_{i+1})           | token:  emb(x_{i+d})
    | RoPE:   i                      | RoPE:   i + d - 1
    | teacher: policy logits at i+1  | teacher: policy logits at i+d

Attention of a pass-d query at anchor i sees the trunk (pass-1 K/V at j <= i) and the branch
(pass-p K/V, p = 2..d, at the same anchor i). This is exactly what the serving draft's
position-indexed cache holds at depth d: positions <= i hold pass-1 K/V (from the target's
taps) and positions i+1..i+d-1 hold the chained passes' K/V.

The module is plain: shifts along the sequence and the attention are arguments, so context
parallelism can pass a CP-aware roll and a ring attention without this file knowing.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..ops.attention import ttt_attention
from .draft import Eagle3Draft
from .layers import rope_cos_sin


def shift_left(x: torch.Tensor, d: int) -> torch.Tensor:
    """y[:, i] = x[:, i + d] along dim 1, zero-filled past the end (single-device TTT shift).

    Values shifted in from past the end (or, in packed batches, from the next sequence) only
    reach anchors whose targets are masked out, and attention never crosses a sequence border.
    """
    if d == 0:
        return x
    pad = torch.zeros_like(x[:, :d])
    return torch.cat([x[:, d:], pad], dim=1)


def ttt_forward(draft: Eagle3Draft, aux: torch.Tensor, embed: torch.Tensor,
                positions: torch.Tensor, num_passes: int,
                shift: Callable[[torch.Tensor, int], torch.Tensor] = shift_left,
                attn: Callable = ttt_attention, q_start: int = 0) -> list[torch.Tensor]:
    """Run K TTT passes; return each pass's decoder output before the final norm, (B, S - q_start, h).

    aux: (B, S, k*h) detached aux taps; embed: (B, S, h) detached policy embeddings of x_j;
    positions: (B, S) global RoPE positions of the anchors (zigzag positions under CP).
    `attn(q, k_trunk, v_trunk, k_branch, v_branch)` is the trunk+branch attention.

    `q_start`: the passes run at anchors q_start..S-1 only. The anchors before it still give the trunk its
    pass-1 K/V (a per-position projection of their taps and tokens), but their queries, passes 2..K and
    outputs are skipped: exact for a loss that trains no anchor before q_start (train/drafters.py derives it
    from the batch's first trained column). A 32K-token prompt with a 1K-token completion then costs the
    draft ~(S - q_start)·S attention, not S²/2 per pass. Needs `attn` to take `q_start=` (ops/attention.py's
    ttt_attention; padded rows only: it is passed only when > 0).
    """
    layer = draft.midlayer
    sa = layer.self_attn
    trunk_in = draft.project_taps(aux)  # (B, S, h): pass 1's hidden at every anchor (the trunk's keys)
    hidden = trunk_in[:, q_start:]  # (B, S - q_start, h): the anchors whose passes run
    kw = {"q_start": q_start} if q_start else {}
    trunk_k = trunk_v = None
    branch_k: list[torch.Tensor] = []
    branch_v: list[torch.Tensor] = []
    outs = []
    for d in range(1, num_passes + 1):
        emb = shift(embed, d).to(hidden.dtype)  # emb(x_{i+d})
        if d == 1:  # every anchor: its K/V are the trunk; only the queries from q_start on are used
            cos, sin = rope_cos_sin(positions, sa.head_dim, draft.cfg.rope_theta, hidden.dtype,
                                    scaling=draft.cfg.rope_scaling)
            q, trunk_k, trunk_v = sa.qkv(layer.attn_input(trunk_in, emb), cos, sin)  # q (B,H,S,D), k/v (B,Hkv,S,D)
            o = attn(q[:, :, q_start:], trunk_k, trunk_v, None, None, **kw)
        else:
            cos, sin = rope_cos_sin(positions[:, q_start:] + (d - 1), sa.head_dim, draft.cfg.rope_theta,
                                    hidden.dtype, scaling=draft.cfg.rope_scaling)
            q, k, v = sa.qkv(layer.attn_input(hidden, emb[:, q_start:]), cos, sin)  # (B,H|Hkv,S-q_start,D)
            branch_k.append(k)
            branch_v.append(v)
            kb = torch.stack(branch_k, dim=3)  # (B, Hkv, S - q_start, d-1, D): passes 2..d at each anchor
            vb = torch.stack(branch_v, dim=3)
            o = attn(q, trunk_k, trunk_v, kb, vb, **kw)
        hidden = layer.finish(hidden, sa.out(o))
        outs.append(hidden)
    return outs
