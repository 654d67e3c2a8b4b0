"""A GRPO group's shared prompt run once in the policy's train-step forward (`train.share_prompts`).

A group's n samples of one prompt are n rows that repeat the prompt: at the long-context workload's 32K-token
prompts and ~1K-token completions ~96% of a train step's tokens are prompt tokens, each prompt n times. Here the
group becomes one packed row (G groups -> G rows):

    [ prompt[0 : p] | prompt[p : P], c_1 | prompt[p : P], c_2 | ... | prompt[p : P], c_n | pad ]
      shared prefix    segment 1            segment 2                 segment n

where segment i is row i's columns p .. E_i - 1 (E_i: one past its last trained token; P: the group's first
trained column; p = P - 1, rounded down to a multiple of train.width_multiple), each at its row's own RoPE
positions. The attention core (`SharedRows.attn_core`) lets the prefix attend causally to itself and segment i's
query at column t attend to every prefix key and causally to its own segment: exactly the keys and values of row
i's columns 0..t, since row i's columns below p hold the prefix's tokens at the prefix's positions. So every
hidden state, log-prob and gradient equals the unshared step's (the prefix's parameter gradient is the sum over
its segments, as it was the sum over the n rows), and the prefix's layers run once instead of n times: exact up
to the order of float sums (tests/test_shared_prompts.py, fp64 to 1e-12).

Why each segment starts with at least prompt[P-1] (not at c_1): the logit that predicts c_1 sits at column P-1,
so the last prompt token must be a query of each segment with its segment's completion after it; as keys the
segment's prompt tokens are the same in every segment (same tokens, same positions, same prefix before them).
Why p is rounded down: the prefix's causal attention is cuDNN's on CUDA, which plans per new length
(`_group_layout`); at most width_multiple - 1 prompt tokens per segment are run again instead.

The draft (EAGLE-3 or a block drafter) trains on the padded rows as before: its inputs, the detached taps and
teacher logits, are unpacked from the packed row (`SharedRows.unpack`), so the draft's loss is unchanged too.
One device, right-padded rows only (not with context or pipeline parallelism: config.py refuses those by name).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..batch import TrainBatch, device_indices, round_up
from ..model.layers import causal_sdpa
from ..model.ttt import shift_left
from ..ops.attention import autocast_inputs, prefix_causal_bwd, prefix_causal_fwd, ttt_trunk_impl

__all__ = ["SharedRows", "prompt_groups", "share_prompts", "shared_micro_batches", "prefix_segments_attention"]


def prefix_segments_attention(q: torch.Tensor, k_pre: torch.Tensor, v_pre: torch.Tensor, k_own: torch.Tensor,
                              v_own: torch.Tensor) -> torch.Tensor:
    """A packed row's segments against its shared prefix: q (n, H, L, D), the prefix's k_pre / v_pre (1, Hkv, p,
    D), each segment's own k_own / v_own (n, Hkv, L, D) -> (n, H, L, D), segment query j seeing every prefix key
    and its own keys 0..j. The same as causal_sdpa(lower_right=True) over [prefix, own] per segment, without
    making n copies of the prefix's keys and values (n x p x Hkv x D each, forward and recompute, their
    gradients summed back over the copies): every segment's queries as one block of n*L against the prefix
    (no mask), the own causal squares apart, merged (ops/attention.prefix_causal_fwd); the backward runs each
    block's kernel with the joint (out, lse), the prefix's gradient from one block. Scale 1/sqrt(D)."""
    (q, k_pre, v_pre, k_own, v_own), no_autocast = autocast_inputs(q, k_pre, v_pre, k_own, v_own)
    with no_autocast:
        return _PrefixSegments.apply(q, k_pre, v_pre, k_own, v_own, ttt_trunk_impl(q))


class _PrefixSegments(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k_pre, v_pre, k_own, v_own, impl):
        out, lse = prefix_causal_fwd(q, k_pre, v_pre, k_own, v_own, None, impl)
        out = out.to(q.dtype)  # what the kernels' backward reads for D = rowsum(dout * out)
        ctx.save_for_backward(q, k_pre, v_pre, k_own, v_own, out, lse)
        ctx.impl = impl
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k_pre, v_pre, k_own, v_own, out, lse = ctx.saved_tensors
        dq, dk_pre, dv_pre, dk_own, dv_own = prefix_causal_bwd(dout, q, k_pre, v_pre, k_own, v_own, out, lse, None,
                                                               ctx.impl)
        return dq.to(q.dtype), dk_pre, dv_pre, dk_own, dv_own, None


def prompt_groups(batch: TrainBatch) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    """The rows of `batch` that share a prompt, as lists of row indices in row order (first appearance), with
    each row's ((B,) first, (B,) one past the last) trained column (TrainBatch.trained_spans).

    Rows share a prompt when their first trained columns P agree and their tokens before P are equal (read on
    the host: one copy of the tokens per minibatch). A row with nothing trained is a group of its own. Grouping
    never changes a result, only how much is shared: rows in different groups are simply not shared."""
    first, end = batch.trained_spans()
    tokens = batch.tokens.cpu()
    groups: dict[tuple, list[int]] = {}
    for r in range(tokens.shape[0]):
        P = int(first[r])
        key = ("row", r) if int(end[r]) == 0 else (P, tokens[r, :P].numpy().tobytes())
        groups.setdefault(key, []).append(r)
    return list(groups.values()), first, end


@dataclass
class SharedRows:
    """One micro-batch of whole prompt groups: the packed batch the policy trains on (`batch`, (G, T)), the
    padded rows it stands for (`rows`, (R, W): what the draft trains on), and the maps between them.

    `index` (R,): the rows of the batch `rows` holds, in order (on the batch's device).
    `src` (R, W): the packed flat index g * T + c of row column t (a row with nothing trained, and columns past
    a row's end: the packed row 0's last column, always padding: finite values no loss reads).
    `prefix[g]`: the shared prefix length P_g - 1 of packed row g; `segments[g]`: its (start column, length)s."""
    batch: TrainBatch
    rows: TrainBatch
    index: torch.Tensor
    src: torch.Tensor
    prefix: list[int]
    segments: list[list[tuple[int, int]]]
    # what a forward or loss over the packed batch asks of a layout (parallel/layout.py)
    shift = staticmethod(shift_left)
    skips_prompt = True
    packed = False

    # Eager under train.compile: traced into, its per-group loop over this micro-batch's own prefix and segment
    # lengths made a new graph for every micro-batch (a graph per RL step until the recompile limit); disabled, the
    # compiled layer breaks around it and its graphs are reused (tests/test_shared_prompts.py counts them).
    @torch.compiler.disable
    def attn_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The policy's attention over packed rows (`Policy.forward(attn_core=...)`): q (G, H, T, D), k/v
        (G, Hkv, T, D) -> (G, H, T, D). Per packed row: causal SDPA over the prefix, then every segment's queries
        (zero-padded to the longest, a batch of n) against [prefix keys, the segment's keys] with the causal mask
        aligned to the lower right (query j sees keys 0 .. prefix + j: causal_sdpa(lower_right=True)); padding
        queries are dropped and the row's tail columns are 0 (nothing reads them)."""
        T = q.shape[2]
        out = []
        for g, (p, segs) in enumerate(zip(self.prefix, self.segments)):
            parts = [causal_sdpa(q[g:g + 1, :, :p], k[g:g + 1, :, :p], v[g:g + 1, :, :p])] if p else []
            L = max(n for _, n in segs)

            def seg(x, s, n):  # (heads, n, D) -> (heads, L, D): a segment's columns, zero-padded at the end
                return F.pad(x[g, :, s:s + n], (0, 0, 0, L - n))

            q_seg = torch.stack([seg(q, s, n) for s, n in segs])  # (n_seg, H, L, D)
            k_own, v_own = (torch.stack([seg(x, s, n) for s, n in segs]) for x in (k, v))  # (n_seg, Hkv, L, D)
            if p:
                o = prefix_segments_attention(q_seg, k[g:g + 1, :, :p], v[g:g + 1, :, :p], k_own, v_own)
            else:
                o = causal_sdpa(q_seg, k_own, v_own)  # (n_seg, H, L, D)
            parts += [o[i:i + 1, :, :n] for i, (_, n) in enumerate(segs)]
            used = p + sum(n for _, n in segs)
            if used < T:
                parts.append(q.new_zeros(1, q.shape[1], T - used, q.shape[3]))
            out.append(torch.cat(parts, dim=2))  # (1, H, T, D)
        return torch.cat(out)

    def unpack(self, x: torch.Tensor, cut: int = 0) -> torch.Tensor:
        """(G, T - cut, ...) over the packed columns cut.. -> (R, W - cut, ...) over the rows' columns cut..
        (the taps with cut 0; the teacher logits with the step's cut, Policy.forward's logits_from). Exact
        copies: a row column t >= cut maps to a packed column >= t >= cut (segments sit at or after their row
        columns; the prefix at the same ones)."""
        T = self.batch.tokens.shape[1]
        g, c = self.src // T, self.src % T
        idx = g[:, cut:] * (T - cut) + (c[:, cut:] - cut)  # (R, W - cut)
        return x.flatten(0, 1)[idx]


def _group_layout(grp: list[int], first: torch.Tensor, end: torch.Tensor,
                  multiple: int = 1) -> tuple[int, list[tuple[int, int]]]:
    """A group's packed row: its shared prefix length p and each trained row's segment (start column, length),
    the row's columns p .. E - 1 in turn (a group with nothing trained -- prompt_groups keeps such a row alone --
    p = 0 and one column of padding no row maps to). p is P - 1 rounded down to a multiple of `multiple`
    (train.width_multiple): the prefix's causal SDPA is cuDNN's on CUDA, which builds an execution plan per new
    length, and prompts of every length would bring new ones each step (the 2026-12-07 H100 probe: the first
    shared variant after a new batch ~1 s slower than the next ones); the < `multiple` prompt tokens after p
    are run once per segment instead (exact as well: the same keys, the same positions)."""
    if not int(end[grp[0]]):
        return 0, [(0, 1)]
    p = max(0, int(first[grp[0]]) - 1)
    p -= p % multiple
    segs, at = [], p
    for r in grp:
        segs.append((at, int(end[r]) - p))
        at += int(end[r]) - p
    return p, segs


def _width(segs: list[tuple[int, int]]) -> int:
    """A packed row's used columns: its last segment's end (the segments follow the prefix back to back)."""
    return segs[-1][0] + segs[-1][1]


def share_prompts(batch: TrainBatch, groups: list[list[int]], first: torch.Tensor, end: torch.Tensor,
                  width_multiple: int = 1) -> SharedRows:
    """The rows `groups` (whole prompt groups of `batch`, prompt_groups's) as one SharedRows. `first`, `end`:
    every row's trained span (host)."""
    order = [r for grp in groups for r in grp]
    W = max(1, max(int(end[r]) for r in order))
    index = device_indices([order], batch.tokens.device)[0]
    rows = dataclasses.replace(batch.take(index).trimmed(W),
                               trained_from=min(int(first[r]) for r in order))
    R = len(order)
    # packed row g: prefix columns 0..p-1 from the group's rows, then each row's columns p..E-1 in turn
    prefix, segments = zip(*(_group_layout(grp, first, end, width_multiple) for grp in groups))
    T = round_up(max(map(_width, segments)) + 1, width_multiple)  # + 1: a padding column ending every row
    g_of = torch.empty(R, W, dtype=torch.long)
    c_of = torch.empty(R, W, dtype=torch.long)
    k = 0
    for g, grp in enumerate(groups):
        p = prefix[g]
        starts = {r: s for r, (s, _) in zip(grp, segments[g])} if int(end[grp[0]]) else {}
        for r in grp:
            t = torch.arange(W)
            if r in starts:  # prefix columns as they are, the rest shifted to the row's segment
                c = torch.where(t < p, t, starts[r] + t - p)
                on = t < int(end[r])  # past the row's end: the padding column (0, T - 1)
                g_of[k], c_of[k] = torch.where(on, g, 0), torch.where(on, c, T - 1)
            else:
                g_of[k], c_of[k] = 0, T - 1
            k += 1
    flat = g_of * T + c_of  # (R, W) packed flat index of each row column
    src = flat.to(batch.tokens.device)
    # the packed batch: every (R, W) field gathered at the packed columns (the inverse of `src` on its image)
    G = len(groups)
    back = torch.full((G * T,), -1, dtype=torch.long)
    back[flat.flatten()] = torch.arange(R * W)  # a prefix column: any of its group's rows (equal)
    back[T - 1] = -1  # packed row 0's last column is padding, whatever mapped there
    back = back.to(batch.tokens.device)
    valid = back >= 0

    def gather(x):  # (R, W) -> (G, T), 0 at padding
        if x is None:
            return None
        flat = x.flatten()[back.clamp(min=0)]
        return torch.where(valid, flat, torch.zeros((), dtype=flat.dtype, device=flat.device)).view(G, T)

    adv = rows.advantages
    if adv is not None and adv.dim() == 1:
        adv = adv[:, None].expand(R, W)  # (R, W): one value per sample, indexed by token
    positions = rows.positions if rows.positions is not None else torch.arange(W, device=src.device).expand(R, W)
    packed = TrainBatch(tokens=gather(rows.tokens), target_mask=gather(rows.target_mask), advantages=gather(adv),
                        logp_old=gather(rows.logp_old), logp_ref=gather(rows.logp_ref), positions=gather(positions),
                        trained_from=rows.trained_from)
    return SharedRows(packed, rows, index, src, list(prefix), list(segments))


def shared_micro_batches(batch: TrainBatch, rows: int, draft_stride: int = 1, width_multiple: int = 1):
    """(draft rows, SharedRows) per micro-batch of whole prompt groups, about `rows` rows each (0: the whole
    batch, one micro-batch), the widest groups first (cotrain.micro_batches' order). The draft rows are the
    micro-batch's rows (in SharedRows.rows' order) whose index in `batch` is 0 mod `draft_stride`."""
    groups, first, end = prompt_groups(batch)
    groups.sort(key=lambda grp: -_width(_group_layout(grp, first, end, width_multiple)[1]))
    cuts, cur = [], []
    for grp in groups:
        cur.append(grp)
        if rows > 0 and sum(map(len, cur)) >= rows:
            cuts.append(cur)
            cur = []
    if cur:
        cuts.append(cur)
    sels = [[i for i, r in enumerate(r for grp in cut for r in grp) if r % draft_stride == 0] for cut in cuts]
    for cut, sel in zip(cuts, device_indices(sels, batch.tokens.device)):
        yield sel, share_prompts(batch, cut, first, end, width_multiple)
