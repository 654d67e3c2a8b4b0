"""Decode state shared by plain and speculative decoding, and the one commit/bookkeeping step.

Per row b the state means:
    x_0..x_{n_b}  committed tokens (prompt + emitted); x_{n_b} = `last_tok[b]` is committed but not
                  yet fed to the target, so the target cache is valid at positions < n_b.
    out_tokens[b, :out_len[b]]  the emitted tokens (the first comes from the prefill).
    finished[b]   EOS emitted or max_new_tokens reached; the row is then frozen (n, last_tok and
                  out_len stop changing) while the batch keeps its static shape.
All tensors are preallocated with static shapes so that steps can be captured in CUDA graphs, and
they are reused across generate calls of the same shape bucket (generate.py): every field is
re-initialised by the prefill step, and KV-cache entries at positions >= n_b are stale by design.

Rows of a state may be *padding* (a shape bucket rounds the batch up): such rows are finished from
the start, so they never emit, never advance and never count in τ, though they are computed.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..model.layers import KVCache


@dataclass
class DecodeState:
    n: torch.Tensor  # (B,) int64 position of last_tok
    last_tok: torch.Tensor  # (B,) int64
    out_tokens: torch.Tensor  # (B, T + W) int64; W columns of slack so block writes never clamp
    out_logp: torch.Tensor  # (B, T + W) fp32 target log-prob of each emitted token
    out_len: torch.Tensor  # (B,) int64
    finished: torch.Tensor  # (B,) bool
    row_rounds: torch.Tensor  # (B,) int64 decode rounds the row took part in (its own τ = emitted / rounds)
    n_emitted: torch.Tensor  # () int64 tokens emitted by decode rounds (prefill excluded)
    n_row_forwards: torch.Tensor  # () int64 active rows summed over decode rounds
    n_accepted: torch.Tensor  # (k,) int64 row-rounds whose draft token j+1 was accepted
    n_proposed: torch.Tensor  # (k,) int64 row-rounds that proposed a token j+1 (k >= j+1)
    n_tried: torch.Tensor  # (k,) int64 row-rounds that proposed token j+1 with tokens 1..j accepted
    t_cache: KVCache
    # -- speculative only (None for plain decode) --
    d_cache: KVCache | None = None
    d_logits0: torch.Tensor | None = None  # (B, Vd) draft pass-1 logits at anchor n-1
    d_hidden0: torch.Tensor | None = None  # (B, h) draft pass-1 output at anchor n-1 (pre-norm)
    draft_tok: torch.Tensor | None = None  # (B, k) proposals x̂_1..x̂_k (target ids)
    q_draft: torch.Tensor | None = None  # (B, k, V) processed draft probs (sampling only)
    taps: torch.Tensor | None = None  # (B, k+1, n_aux*h) verify taps, read by the catch-up
    num_accepted: torch.Tensor | None = None  # (B,) this round's a
    block: torch.Tensor | None = None  # (B, k+1) this round's emitted block (first a+1 valid)
    u: torch.Tensor | None = None  # (B, n_uniforms) this round's uniforms, filled outside graphs
    key: torch.Tensor | None = None  # (B,) int64 row keys of coupled sampling (instead of u)

    def small_tensors(self) -> list[torch.Tensor]:
        """Every state tensor except the KV caches (what graph warm-up must restore)."""
        out = []
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                out.append(v)
        return out


def group_leaders(cache: KVCache, group_size: int) -> KVCache:
    """Rows 0, G, 2G, ... of a per-sample cache, as a view: where a prompt shared by the G samples
    of its group is prefilled once (writes through the view land in the cache itself)."""
    if group_size == 1:
        return cache
    return KVCache(cache.k[:, ::group_size], cache.v[:, ::group_size])


def fill_groups(cache: KVCache, group_size: int, upto: int):
    """Copy each group leader's cache entries at positions < upto to the other G-1 rows of its
    group (rows b*G+1 .. b*G+G-1), in place: the prompt's K/V, written once by the prefill."""
    if group_size == 1:
        return
    for t in (cache.k, cache.v):  # (L, B0*G, Hkv, S_max, D)
        per_group = t.unflatten(1, (-1, group_size))[..., :upto, :]  # (L, B0, G, Hkv, upto, D)
        per_group[:, :, 1:].copy_(per_group[:, :, :1])


def is_stop(tokens: torch.Tensor, stop_ids: torch.Tensor) -> torch.Tensor:
    """tokens (...) int64 -> (...) bool: is the token one of stop_ids (n_stop,)? A broadcast compare:
    static shapes, capturable in a CUDA graph."""
    return (tokens[..., None] == stop_ids).any(-1)


def commit(st: DecodeState, block: torch.Tensor, count: torch.Tensor, logp: torch.Tensor,
           max_new_tokens: int, stop_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Append the first `count[b]` tokens of `block[b]` to row b's output, with EOS/length cut-off.

    block: (B, W) candidate tokens, count: (B,) how many are valid (1 for plain decode, a+1 for
    speculative), logp: (B, W) their target log-probs. Active rows (not finished before this call)
    emit min(count, up to and including the first stop token, room left); finished rows emit nothing.
    Updates out_*, finished and the τ counters; returns (emitted counts (B,), active (B,) — the
    rows that were unfinished when the call started).
    Static shapes only: writes go through gather/where/scatter at out_len + j, j < W, into a buffer
    with W columns of slack, so no index is ever clamped onto another (which would race).
    """
    B, W = block.shape
    j = torch.arange(W, device=block.device)  # (W,)
    active = ~st.finished
    in_block = j[None, :] < count[:, None]  # (B, W)
    if stop_ids is not None:
        is_eos = is_stop(block, stop_ids) & in_block
        first_eos = torch.where(is_eos.any(-1), is_eos.long().argmax(-1), W)  # (B,)
        count = torch.minimum(count, first_eos + 1)
    count = torch.minimum(count, max_new_tokens - st.out_len)
    count = torch.where(active, count, 0)
    write = j[None, :] < count[:, None]  # (B, W)
    idx = st.out_len[:, None] + j[None, :]  # (B, W) < T + W: never clamped
    st.out_tokens.scatter_(1, idx, torch.where(write, block, st.out_tokens.gather(1, idx)))
    st.out_logp.scatter_(1, idx, torch.where(write, logp.float(), st.out_logp.gather(1, idx)))
    st.out_len.add_(count)
    done = st.out_len >= max_new_tokens
    if stop_ids is not None:
        done |= (is_stop(block, stop_ids) & write).any(-1)
    st.finished.logical_or_(active & done)
    st.n_emitted.add_(count.sum())
    st.n_row_forwards.add_(active.sum())
    st.row_rounds.add_(active.long())
    return count, active
