"""The mixture-of-experts MLP of Qwen2-MoE / Qwen3-MoE policies: a top-k router, E SwiGLU experts and, for
Qwen2-MoE, a sigmoid-gated shared expert. A plain single-device module (no expert parallelism inside: that is
applied from outside, issue 38 item 2).

    logits = x Wrᵀ                                        (N, E) router logits, kept for the aux loss
    p = softmax(logits) in fp32;  w, idx = topk(p, k)      softmax over ALL experts, then the k largest
    w = w / Σ_k w          only when norm_topk_prob         (Qwen3-MoE checkpoints set it, Qwen1.5-MoE not)
    y = Σ_j w_j · SwiGLU_{idx_j}(x)                         w cast back to x's dtype first
    y += sigmoid(x wsᵀ) · SwiGLU_shared(x)                  Qwen2-MoE only

These are transformers' numerics (Qwen2MoeTopKRouter / Qwen3MoeTopKRouter, Qwen2MoeSparseMoeBlock), read
from its code and written here; tests/test_moe.py compares logits and gradients with it. The router's
weights w are differentiable (top-k *values*), so the policy loss trains the router through them; the
load-balancing loss (train/moe_loss.py) reads the router logits the block keeps from its last forward.

**Expert weights.** The E experts are two 3-D parameters, `gate_up_proj` (E, 2I, h) with rows [gate | up]
per expert and `down_proj` (E, h, I): one tensor per projection, so a grouped GEMM (or an expert-parallel
shard along E) takes them as they are. Checkpoints come in two layouts and both load:

* per expert, `experts.{e}.gate_proj.weight` (I, h), `.up_proj.weight` (I, h), `.down_proj.weight` (h, I):
  every Qwen1.5-MoE / Qwen3-MoE checkpoint on the Hub, and what transformers 5's `save_pretrained` writes
  (its conversion mapping fuses them into 3-D tensors on load and splits them again on save);
* fused, `experts.gate_up_proj` (E, 2I, h) and `experts.down_proj` (E, h, I): transformers 5's in-memory
  parameters, which a state dict saved without its conversion holds.

specco **writes the per-expert layout**: it is what transformers itself writes, and what every reader loads
(transformers 4.x and 5.x, vLLM, SGLang), while the fused one is read by transformers 5 only. `state_dict()`
reports the per-expert tensors as views of the 3-D parameters (as `layers.fuse_linears` does for q/k/v), so
the rollout engine's in-place refit and the checkpoints see HF's names.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.grouped_mm import grouped_mm, grouped_mm_applies
from .layers import SwiGLU

_PER_EXPERT = ("gate_proj", "up_proj", "down_proj")


class Experts(nn.Module):
    """E SwiGLU experts: down_e(silu(gate_e x) * up_e x), as two 3-D parameters (module docstring)."""

    def __init__(self, num_experts: int, hidden: int, inter: int):
        super().__init__()
        self.num_experts, self.inter = num_experts, inter
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))  # (E, 2I, h): [gate | up]
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))  # (E, h, I)
        self.register_state_dict_post_hook(_split_experts)
        self.register_load_state_dict_pre_hook(functools.partial(_join_experts, num_experts=num_experts))

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x (N, h) rows, idx (N, k) their experts, weights (N, k) the router's weights -> (N, h):
        Σ_j weights[n, j] · expert_{idx[n, j]}(x[n]).

        The N·k (row, expert) assignments are sorted by expert, so each expert's rows are one contiguous
        segment: one GEMM pair per expert a batch touches (untouched experts cost nothing), then the weighted
        outputs are added back to their rows (`index_add_`, ascending expert order per row, as transformers)."""
        N, k = idx.shape
        flat = idx.reshape(-1)  # (N·k,) expert of each assignment, row-major
        order = flat.argsort(stable=True)  # (N·k,) assignments grouped by expert
        rows = order // k  # (N·k,) the row each sorted assignment came from
        # (E,) rows per expert; not torch.bincount, which reads the largest id on the host (no CUDA graph then)
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=x.device).index_add_(
            0, flat, torch.ones_like(flat))
        y = expert_ffn(x[rows], counts, self.gate_up_proj, self.down_proj)  # (N·k, h): rows grouped by expert
        y = y * weights.reshape(-1)[order, None].to(y.dtype)  # (N·k, h)
        return torch.zeros_like(x).index_add_(0, rows, y.to(x.dtype))

    def every(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """`forward`'s function with every expert run on every row and the experts a row did not choose weighted
        by zero: no host read and no ragged shape, so a CUDA graph can capture it in any dtype, at E/k times the
        chosen experts' FLOPs and every expert's weights read. The rollout engine's path on a GPU where the
        grouped GEMM does not apply (fp32 engine copies: the from-scratch policies' samplers); `forward` keeps
        the loop for training, where the FLOPs count. Adding exact zeros changes no sum, so for k = 2 a row's
        output is the loop's a + b."""
        w = torch.zeros(idx.shape[0], self.num_experts, dtype=weights.dtype, device=x.device).scatter_(
            1, idx, weights)  # (N, E) the router's weights, zero off the chosen experts
        gate, up = torch.matmul(x, self.gate_up_proj.transpose(1, 2)).split(self.inter, dim=-1)  # (E, N, I) each
        y = torch.matmul(F.silu(gate) * up, self.down_proj.transpose(1, 2))  # (E, N, h)
        y = y * w.t()[:, :, None].to(y.dtype)  # (E, N, h)
        return y.sum(0).to(x.dtype)  # (N, h)


def expert_ffn(xs: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The experts' SwiGLU over rows grouped by expert, the one home of its math (Experts, and this rank's slice
    of them under expert parallelism: parallel/ep.EPExperts): xs (M, h) rows sorted by expert, counts (G,) int64
    on xs's device (rows per expert, in order), gate_up (G, 2I, h) [gate | up], down (G, h, I) -> (M, h),
    down_g(silu(gate_g x) * up_g x) for each row x of expert g's segment. Under autocast the operands are cast as
    a linear's would be (`_autocast_operands`); the grouped GEMM where it applies (ops/grouped_mm.py: Hopper, bf16),
    else the loop."""
    xs_c, w1, w2 = _autocast_operands(xs, gate_up, down)
    if grouped_mm_applies(xs_c, w1, w2):
        return expert_ffn_grouped(xs_c, counts, w1, w2)
    return expert_ffn_loop(xs, counts, gate_up, down)


@torch.compiler.disable
def expert_ffn_loop(xs: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """`expert_ffn` as one (gate_up, down) GEMM pair per expert with rows: the reference path (any device, dtype).
    Reads the counts on the host (one sync), so it is not CUDA-graph capturable; the grouped path is. Left out of
    torch.compile: its Python branches on the counts made dynamo recompile per pattern of empty experts until its
    recompile limit (the H200 MoE run's log), for nothing to fuse."""
    inter = down.shape[-1]
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        if n:
            seg = xs[start:start + n]  # (n, h) the rows routed to expert e
            gate, up = F.linear(seg, gate_up[e]).split(inter, dim=-1)  # (n, I) each
            outs.append(F.linear(F.silu(gate) * up, down[e]))  # (n, h)
            start += n
    return torch.cat(outs) if outs else xs.new_zeros(xs.shape)


def expert_ffn_grouped(xs: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """`expert_ffn` as two grouped GEMMs over all experts (ops/grouped_mm.py; CUDA, bf16): segment ends are
    cumulative counts on the device, so nothing is read on the host. w1 (G, 2I, h), w2 (G, h, I): the expert
    parameters, or their autocast casts."""
    ends = counts.cumsum(0).to(torch.int32)  # (G,) one past each expert's last row
    gate_up = grouped_mm(xs, w1.transpose(1, 2), ends)  # (M, 2I)
    gate, up = gate_up.split(w2.shape[-1], dim=-1)
    return grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), ends)  # (M, h)


def _autocast_operands(xs: torch.Tensor, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(xs, *weights) cast to the autocast dtype where autocast is on for xs's device, else as they are: what
    autocast does to a linear's operands. The grouped GEMM is on none of autocast's cast lists, so without this a
    bf16-autocast train step over fp32 master weights (train.amp=bf16) took the loop: a host read of the counts
    and one GEMM pair per expert, and under torch.compile a recompile per pattern of empty experts (the H200 MoE
    run hit dynamo's recompile limit). The casts are differentiable: the gradients reach the fp32 masters."""
    kind = xs.device.type
    if not torch.is_autocast_enabled(kind):
        return (xs, *weights)
    dt = torch.get_autocast_dtype(kind)
    return tuple(t.to(dt) for t in (xs, *weights))


def _split_experts(mod, state, prefix, local_metadata):
    """state_dict post-hook of `Experts`: the 3-D parameters become HF's per-expert tensors, as views (an
    in-place `copy_` into them writes the parameters: the engine's refit)."""
    gate_up, down = state.pop(f"{prefix}gate_up_proj"), state.pop(f"{prefix}down_proj")
    I = mod.inter
    for e in range(mod.num_experts):
        state[f"{prefix}{e}.gate_proj.weight"] = gate_up[e, :I]  # (I, h)
        state[f"{prefix}{e}.up_proj.weight"] = gate_up[e, I:]  # (I, h)
        state[f"{prefix}{e}.down_proj.weight"] = down[e]  # (h, I)


def _join_experts(mod, state, prefix, local_metadata, strict, missing, unexpected, errors, *, num_experts):
    """load_state_dict pre-hook of `Experts`: HF's per-expert tensors, when every one is present, are stacked
    into the 3-D parameters. A state dict holding the fused keys (transformers 5's) loads as it is; a partial
    set is left alone, so the strict load names what is missing."""
    keys = [f"{prefix}{e}.{p}.weight" for e in range(num_experts) for p in _PER_EXPERT]
    if all(k in state for k in keys):
        per = {p: [state.pop(f"{prefix}{e}.{p}.weight") for e in range(num_experts)] for p in _PER_EXPERT}
        state[f"{prefix}gate_up_proj"] = torch.stack(
            [torch.cat([g, u]) for g, u in zip(per["gate_proj"], per["up_proj"])])  # (E, 2I, h)
        state[f"{prefix}down_proj"] = torch.stack(per["down_proj"])  # (E, h, I)


def split_fused_experts(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict with transformers 5's fused expert tensors (`...experts.gate_up_proj` (E, 2I, h),
    `...experts.down_proj` (E, h, I)) rewritten to the per-expert names `Experts.state_dict` reports, so one
    key check covers both checkpoint layouts (hf_io.load_policy). Other keys pass unchanged."""
    out = {}
    for k, v in sd.items():
        if k.endswith("experts.gate_up_proj") and v.dim() == 3:
            pre, I = k[:-len("gate_up_proj")], v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{pre}{e}.gate_proj.weight"], out[f"{pre}{e}.up_proj.weight"] = v[e, :I], v[e, I:]
        elif k.endswith("experts.down_proj") and v.dim() == 3:
            pre = k[:-len("down_proj")]
            for e in range(v.shape[0]):
                out[f"{pre}{e}.down_proj.weight"] = v[e]
        else:
            out[k] = v
    return out


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's choice, the one home of the formula: logits (N, E) -> (weights (N, k) in logits' dtype,
    expert ids (N, k)). Softmax over all E experts in fp32, the k largest probabilities, renormalised to sum
    to 1 when `norm_topk_prob` (otherwise they sum to < 1: the expert output is scaled down with them)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # (N, E)
    weights, idx = torch.topk(probs, top_k, dim=-1)  # (N, k) each
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), idx


class SparseMoE(nn.Module):
    """The sparse MLP of one decoder layer; module names mirror transformers' (`gate` is the router,
    `shared_expert` / `shared_expert_gate` Qwen2-MoE's always-on expert), so HF keys map by prefix."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, inter: int, norm_topk_prob: bool,
                 shared_inter: int = 0):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = nn.Linear(hidden, num_experts, bias=False)  # (E, h) the router
        self.experts = Experts(num_experts, hidden, inter)
        self.shared_expert = SwiGLU(hidden, shared_inter) if shared_inter else None
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if shared_inter else None
        # The router logits (B·S, E) of the last forward, for the load-balancing loss (Policy.forward collects
        # them into PolicyOutput.router_logits). Kept here rather than returned because a decoder layer's
        # signature, (x, cos, sin, core) -> x, is shared with activation checkpointing, compile and pipeline
        # stages; Policy.forward clears it after reading, so no graph outlives its step.
        self.router_logits: torch.Tensor | None = None

    def mix(self, rows: torch.Tensor, every: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """rows (N, h) -> (output (N, h), router logits (N, E)): the block's function, stateless (the rollout
        engine's decode calls it directly, rollout/forward.py). every: each expert on each row (`Experts.every`)."""
        logits = self.gate(rows)  # (N, E)
        weights, idx = route(logits, self.top_k, self.norm_topk_prob)
        out = (self.experts.every if every else self.experts)(rows, idx, weights)  # (N, h)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(rows)) * self.shared_expert(rows)
        return out, logits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., h) -> (..., h); keeps the router logits for the training loss (`router_logits`)."""
        out, self.router_logits = self.mix(x.reshape(-1, x.shape[-1]))  # (N, h), (N, E)
        return out.view(x.shape)

    def graph_safe(self) -> bool:
        """Whether `forward` in the weights' dtype, on their device, can be captured in a CUDA graph: only the
        grouped-GEMM path keeps the expert counts on the device (the loop reads them on the host; the engine
        then takes `Experts.every`)."""
        e = self.experts
        w = e.gate_up_proj  # (E, 2I, h)
        return grouped_mm_applies(w.new_empty(0, w.shape[-1]), w, e.down_proj)
