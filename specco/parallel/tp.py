"""Tensor parallelism of the trainer's policy, applied from outside the plain model (STYLE §1; torchtitan's
`apply_tp`, gpt-fast's `tp.py`): DTensor `parallelize_module` over the `tp` axis of the mesh.

    mesh = Mesh.build(dp=2, dp_shard=2, tp=2)
    policy = split_stage(policy, pp, s)       # (under PP the stage is cut first)
    apply_tp(policy, mesh.tp_mesh)            # TP ...
    apply_activation_checkpointing(policy)    # (optional) ...
    apply_fsdp(policy, mesh.fsdp_mesh)        # ... then FSDP over the dp_shard × cp ranks: 2-D (fsdp, tp) DTensors
    opt = build_optimizer(policy, draft, ...)

torchtitan's order. Context parallelism needs nothing here (the ring attention runs on the rank's local heads);
under pipeline parallelism each tp rank of a stage talks to the same tp rank of the neighbouring stages (the
residual stream and the taps are replicated over tp), on groups parallel/mesh.py builds per tp rank.

What each of the tp ranks holds, per decoder layer (Megatron's split; h hidden, H / Hkv query / kv heads, I the
MLP width):

    q_proj, k_proj, v_proj   column-parallel  Shard(0) of the output rows: H/tp query and Hkv/tp kv heads
    o_proj                   row-parallel     Shard(1): the input columns of those heads; the output all-reduced
    gate_proj, up_proj       column-parallel  I/tp rows each
    down_proj                row-parallel     Shard(1); the output all-reduced
    q_norm, k_norm (Qwen3)   replicated DTensors; the input seen as Shard(2) (the heads dim), see below
    input / post-attention norms, the embedding, the final norm: plain, replicated
    lm_head                  column-parallel over the vocabulary, its logits left cut (loss-parallel, below)

So a layer's forward costs two all-reduces of (B, S, h) (after o_proj and after down_proj) and its backward two
(the gradients flowing into q/k/v and gate/up, whose input is replicated). Between them every rank holds its heads'
activations only: attention runs on H/tp query and Hkv/tp kv heads of the same GQA groups (head j of a rank's
queries reads kv head j // G of the rank's kv heads, as globally, because both are cut into tp contiguous blocks
and G = H / Hkv is preserved), so the attention core (SDPA, the ring, packed rows) is the unsharded one.

**The fused projections.** The policy trains `qkv_proj` = rows [q | k | v] and `gate_up_proj` = [gate | up] as one
Linear each (model/layers.fuse_linears). Column-sharding the fused weight in tp contiguous blocks would give rank 0
all of q and part of k, rank 1 the rest: wrong heads everywhere. The choices were (a) permute the fused rows to
[q_0 k_0 v_0 | q_1 k_1 v_1 | ...] before distributing (gpt-fast's `weight_splits`), or (b) split the fused Linear
back into its parts and shard each (`layers.unfuse_linears`). (a) keeps one GEMM, but the DTensor's global view
is then the permuted tensor: its state dict, the refit to the engine, the checkpoints and the HF export would all
have to know and undo the permutation, and FSDP's second cut along dim 0 of the local rows would cut across the
local q/k/v again. (b) gives plain ColwiseParallel placements whose global view is exactly HF's `q_proj.weight`
(the names `state_dict()` already reported for the fused module), so the refit's `full_tensor()`, DCP and the
export need nothing new, and FSDP2's 2-D sharding composes as torchtitan's does. It costs three (two) GEMMs for
one in training, where each is large and compute-bound; the engine keeps its fused copy for decode, where the
fusion pays (docs/DESIGN.md §6). We take (b).

**Head counts.** The views in `Attention.qkv` use -1 for the head dim count, and `apply_tp` sets each attention's
`num_heads` / `num_kv_heads` (and the MLP's `inter`) to the rank's local counts, so nothing reads the global ones.

**q/k norms.** Qwen3's q_norm / k_norm weights (head_dim,) are shared by every head. A plain replicated weight would
get, on each rank, the gradient of its own heads only — a partial sum that must be all-reduced over tp (nothing
else would: the weight is not a DTensor and its inputs are local). As torchtitan's Qwen3 does, they are
`SequenceParallel(sequence_dim=2)` modules: their weight becomes a Replicate DTensor and their input is declared
Shard(2) (the heads), so DTensor's autograd turns the partial gradient into the sum. (A test drops this and fails.)

**The head: loss-parallel over the vocabulary; the embedding replicated.** lm_head is ColwiseParallel with its
output left a Shard(-1) DTensor: each rank holds V/tp rows of the head (its weight, gradient and AdamW moments / tp),
computes those logits (the head's FLOPs / tp) and keeps only them — (B, S, V/tp), never the whole (B, S, V). The
readers of full-vocabulary rows (issue 37's list), each in a loss-parallel form or an explicit gather:

    the policy's token log-probs     loss-parallel: `vocab_parallel_logprobs` (a max, a log-sum-exp and the target's
      (train/losses.token_logprobs)  logit, each an all-reduce of (B, S)), every row of the step
    the EAGLE-3 teacher and the      gathered: `vocab_rows`, the draft's rows only (train.draft_row_stride: 1/n of
      block drafters' teacher        the rows); the teacher is detached, so this gather has no backward
    the block drafters' logits       gathered: the head's weight (`train/drafters`, detached, per micro-batch)
      through the live head
    the engine's sampling / verify   its own whole copy (the refit gathers the shards)

What the loss-parallel log-probs save: the all-gather of tokens × V per micro-batch (8K tokens × 151,936 × 2 B = 2.5
GB in bf16) and the whole logits' memory on each rank (× 2 in fp32). The draft's teachers stay whole (their soft
targets, argmax and draft-vocabulary subset read every column), on its rows only; a loss-parallel soft CE over the
draft vocabulary is the next step there. Why not a replicated head: at Qwen3-8B's shapes (h 4096, 36 layers,
V 151,936) the head is 0.62 B of 8.19 B parameters and 2·h·V = 1.24 GFLOP per token against the layers' ~14.9; at tp
8 a rank would do 1.9 GFLOP of layers and the whole 1.24 of head per token (40% of its forward) and hold the head
whole. The embedding stays replicated (a lookup: no FLOPs to split; a vocabulary-parallel one needs a masked lookup
and an all-reduce of (B, S, h)); a head tied to it (tie_word_embeddings) stays replicated with it, its logits whole.
Every rank sees the same taps and teachers, so the draft (replicated, below) trains identically on every tp rank with
no all-reduce over tp.

**The draft: replicated over tp.** Every tp rank holds the whole draft and, its inputs being replicated, computes
the same update (no all-reduce over tp; tests/test_tp.py checks the bits). Sizes (the specco models built on the meta
device at Qwen3-8B's shapes, V 151,936, an EAGLE-3 draft over a 32k vocabulary): the policy's parameters per tp
rank are 4.41 / 2.51 / 1.57 B at tp 2 / 4 / 8 (layers and head / tp, the embedding whole) and the draft's 0.40 B,
9% / 16% / 25% of that, before FSDP divides the policy's share further (parallel/fsdp.py: the draft stays whole
there too). Tensor-parallel, the draft would pay two all-reduces of (B, S, h) per layer call, and it is called K
times per micro-batch (the TTT passes) on small matmuls that are latency-bound already; it would be the change to
make where the draft's 16 B/param outweigh the policy's shard.

**Sequence parallelism (`sequence_parallel=True`, config parallel.tp_sequence_parallel).** Between the
row-parallel outputs and the next column-parallel inputs the residual stream, the norms and the residual adds are
cut along the sequence instead of replicated (Megatron-SP, torchtitan's default): each rank holds (B, S/tp, h) of
the residual stream and computes the norms on it (RMSNorm weights as replicated DTensors: their gradient summed over
the ranks' tokens), o_proj / down_proj reduce-scatter instead of all-reducing, and an all-gather rebuilds the whole
sequence before q/k/v, gate/up and the head. The same bytes move (an all-reduce is a reduce-scatter plus an
all-gather); the residual stream's and the norms' activations shrink by tp. What it needs from the rest: S a multiple
of tp (the micro-batch widths are rounded up to it, derive.step_config), the token count taken from the ids rather
than the embedding's output (model/policy.py), and the taps, which the draft reads whole, gathered along the sequence
after the forward (a forward hook on the policy; `PolicyOutput.hidden` stays this rank's slice). Not with context or
pipeline parallelism (a stage's activations and the ring's chunks would be cut twice): refused by name.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)

from ..model.layers import unfuse_linears
from ..model.policy import StageTaps, Taps

__all__ = ["apply_tp", "layer_plan", "tp_copy", "is_tensor_parallel", "vocab_parallel_logprobs", "vocab_rows"]


def layer_plan(qk_norm: bool, sequence_parallel: bool = False) -> dict:
    """The parallelize_module plan of one decoder layer (module docstring's table; sequence parallel: its last
    section)."""
    plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    if sequence_parallel:  # (B, S/tp, h) between the blocks: gathered before them, reduce-scattered after
        whole = PrepareModuleInput(input_layouts=(Shard(1), None, None, None),  # (x, cos, sin, attn_core)
                                   desired_input_layouts=(Replicate(), None, None, None), use_local_output=True)
        plan.update({
            "input_layernorm": SequenceParallel(use_local_output=True),
            "self_attn": whole,
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "post_attention_layernorm": SequenceParallel(use_local_output=True),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                      use_local_output=True),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        })
    if qk_norm:
        # (B, S, H_local, D): the heads dim (2) is what the tp ranks hold different parts of
        plan["self_attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["self_attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def apply_tp(policy: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool = False,
             plan: dict | None = None) -> nn.Module:
    """Shard a Policy (or a pipeline stage of one) in place over `tp_mesh` (`Mesh.tp_mesh`, 1-D): each decoder layer's
    projections unfused and column / row-parallel, its local head counts set, the head's vocabulary rows sharded with
    its logits left cut (module docstring). The embedding and norms stay plain (replicated). Call it on the plain
    model BEFORE activation checkpointing and FSDP (torchtitan's order), and before building the optimizer (the
    parameters become DTensors). A collective over tp_mesh (distribute_tensor broadcasts nothing but checks nothing
    either: every rank must hold the same weights, which the callers' copies of one starting policy do). `plan`: the
    layers' plan (default `layer_plan`; tests/test_tp.py passes broken ones and checks that they fail). Returns
    `policy`."""
    tp = tp_mesh.size()
    cfg = policy.cfg
    if cfg.moe:  # a boundary (validate.check_moe_layout refuses it first): the plan cuts dense SwiGLUs only
        raise ValueError(f"tensor parallelism of a mixture-of-experts policy ({cfg.model_type}) is not implemented; "
                         "use tp = 1")
    for name, n in (("num_heads", cfg.num_heads), ("num_kv_heads", cfg.num_kv_heads),
                    ("intermediate_size", cfg.intermediate_size)):
        if n % tp:  # a boundary: the config check refuses it first (derive.check_parallel), this is the backstop
            raise ValueError(f"tensor parallelism over {tp} ranks: policy {name}={n} is not a multiple of {tp}")
    plan = layer_plan(cfg.qk_norm, sequence_parallel) if plan is None else plan
    sp = Shard(1) if sequence_parallel else Replicate()  # what the head's input is
    head = policy.lm_head
    if head is not None and head.weight is not getattr(policy.embed_tokens, "weight", None):  # a tied head stays
        # replicated with its embedding (module docstring)
        # (a vocabulary tp does not divide is cut as torch.chunk cuts: the tests' 61 tokens are 31 + 30 rows)
        parallelize_module(head, tp_mesh, ColwiseParallel(input_layouts=sp, output_layouts=Shard(-1),
                                                           use_local_output=False))  # the logits stay a DTensor
    elif head is not None and sequence_parallel:  # replicated: only its input gathered
        parallelize_module(head, tp_mesh, PrepareModuleInput(input_layouts=(sp,), desired_input_layouts=(Replicate(),),
                                                             use_local_output=True))
    if sequence_parallel:
        if policy.embed_tokens is not None:  # each rank keeps its slice of the sequence (no communication)
            parallelize_module(policy.embed_tokens, tp_mesh, PrepareModuleOutput(
                output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=True))
        if policy.norm is not None:
            parallelize_module(policy.norm, tp_mesh, SequenceParallel(use_local_output=True))
        policy.register_forward_hook(functools.partial(_gather_taps, mesh=tp_mesh))
    for layer in policy.layers.values():
        attn, mlp = layer.self_attn, layer.mlp
        unfuse_linears(attn, "qkv_proj")
        unfuse_linears(mlp, "gate_up_proj")
        attn.num_heads, attn.num_kv_heads = cfg.num_heads // tp, cfg.num_kv_heads // tp  # local counts
        mlp.inter = cfg.intermediate_size // tp
        parallelize_module(layer, tp_mesh, plan)
    return policy


def is_tensor_parallel(model: nn.Module) -> bool:
    """Whether `apply_tp` sharded `model` (a layer's projections unfused and distributed)."""
    return any(getattr(layer.self_attn, "qkv_proj", 0) is None for layer in model.layers.values())


def vocab_shard(logits: DTensor) -> tuple[torch.Tensor, int]:
    """(this rank's logits (..., V/tp), the vocabulary id of its first column): the head's cut along the vocabulary
    (ColwiseParallel's Shard(-1): torch.chunk's, ceil(V / tp) columns per rank, the last ranks' fewer)."""
    (placement,) = logits.placements
    mesh = logits.device_mesh
    V, tp, r = logits.shape[-1], mesh.size(), mesh.get_local_rank()
    assert placement.is_shard() and placement.dim in (-1, logits.ndim - 1), placement
    local = logits.to_local()
    start = min(r * -(-V // tp), V)
    assert local.shape[-1] == min(-(-V // tp), V - start), (local.shape, V, tp, r)
    return local, start


def vocab_parallel_logprobs(logits: DTensor, tokens: torch.Tensor, temperature: float, chunk_elements: int
                            ) -> torch.Tensor:
    """log p(tokens) under softmax(logits / T), fp32 at least, from logits (B, S, V) cut along the vocabulary over
    the tp ranks (the head's Shard(-1) output), without gathering them — the loss-parallel form of
    train/losses.token_logprobs (Megatron's vocab-parallel cross-entropy):

        m      = max_v z_v                              all-reduce MAX (constant for the gradient: it cancels)
        lse    = m + log Σ_ranks Σ_{v of the rank} exp(z_v − m)      all-reduce SUM of (B, S)
        z_t    = Σ_ranks [t among the rank's ids] · z_t             all-reduce SUM of (B, S): the owner's value
        log p  = z_t − lse

    with z = logits / T. Three all-reduces of (B, S) floats replace the all-gather of (B, S, V); the result is
    replicated over tp, so each rank's gradient lands on its own columns: ([t among them] · onehot − softmax) · g / T.
    As token_logprobs, a chunk of positions at a time (`_VocabParallelLogprobs`; `chunk_elements` fp32 elements of
    work, token_logprobs' own bound): only the rank's logits and the (N,) logsumexp are kept for the backward, never
    its (N, V/tp) fp32 log-softmax."""
    local, start = vocab_shard(logits)
    rows = max(1, chunk_elements // local.shape[-1])
    return _VocabParallelLogprobs.apply(local, tokens, start, max(temperature, 1e-6), rows,
                                        logits.device_mesh.get_group())


def _all_reduce(x: torch.Tensor, op, group) -> torch.Tensor:
    """The loss-parallel log-probs' reductions over tp (one home: tests/test_tp.py's mutation drops them)."""
    dist.all_reduce(x, op=op, group=group)
    return x


class _VocabParallelLogprobs(torch.autograd.Function):
    """`vocab_parallel_logprobs` on this rank's columns `local` (..., V_local) starting at vocabulary id `start`."""

    @staticmethod
    def forward(ctx, local, tokens, start, temperature, rows, group):
        dt = torch.promote_types(local.dtype, torch.float32)
        flat, tok = local.reshape(-1, local.shape[-1]), tokens.reshape(-1, 1)  # (N, V_local), (N, 1)
        N, Vl = flat.shape
        mine = (tok >= start) & (tok < start + Vl)  # (N, 1): the target id is among this rank's columns
        idx = (tok - start).clamp(0, Vl - 1)
        m = torch.empty(N, dtype=dt, device=local.device)
        for s in range(0, N, rows):
            m[s:s + rows] = flat[s:s + rows].to(dt).amax(-1) / temperature
        m = _all_reduce(m, dist.ReduceOp.MAX, group)
        sumexp = torch.empty_like(m)
        for s in range(0, N, rows):
            sumexp[s:s + rows] = (flat[s:s + rows].to(dt) / temperature - m[s:s + rows, None]).exp().sum(-1)
        lse = m + _all_reduce(sumexp, dist.ReduceOp.SUM, group).log()
        z_t = torch.where(mine, flat.gather(1, idx).to(dt) / temperature, 0.0).squeeze(1)
        z_t = _all_reduce(z_t, dist.ReduceOp.SUM, group)
        ctx.save_for_backward(local, mine, idx, lse)
        ctx.temperature, ctx.rows = temperature, rows
        return (z_t - lse).view(tokens.shape)

    @staticmethod
    def backward(ctx, g):
        local, mine, idx, lse = ctx.saved_tensors
        T, rows = ctx.temperature, ctx.rows
        flat = local.reshape(-1, local.shape[-1])
        gf = g.reshape(-1, 1).to(lse.dtype)  # (N, 1): the loss is replicated over tp, its gradient too
        grad = torch.empty_like(flat)
        for s in range(0, flat.shape[0], rows):
            e = s + rows
            d = torch.exp(flat[s:e].to(lse.dtype) / T - lse[s:e, None]).mul_(-gf[s:e])  # -softmax(z) · g
            d.scatter_add_(1, idx[s:e], gf[s:e] * mine[s:e])
            grad[s:e] = d.div_(T)
        return grad.view_as(local), None, None, None, None, None


def vocab_rows(logits: torch.Tensor, rows) -> torch.Tensor:
    """`logits[rows]` whole along the vocabulary and detached (a teacher): under tensor parallelism the rows'
    vocabulary shards all-gathered (only those rows: the draft's, a fraction of the batch); a plain tensor as it is."""
    if not isinstance(logits, DTensor):
        return logits[rows]
    local, _ = vocab_shard(logits)
    local = local.detach()[rows]  # (b, S, V/tp)
    shape = (*local.shape[:-1], logits.shape[-1])
    whole = torch.empty(shape, dtype=local.dtype, device=local.device)  # only for the stride
    return DTensor.from_local(local, logits.device_mesh, logits.placements, run_check=False, shape=whole.shape,
                              stride=whole.stride()).full_tensor()


def _gather_taps(policy, args, out, *, mesh: DeviceMesh):
    """Forward hook of a sequence-parallel policy: its taps (this rank's slice of the sequence, detached) gathered
    whole along the sequence, so the draft reads what it reads at tp = 1 (module docstring). One all-gather per tap
    tensor: the joined `taps` are rebuilt from the gathered parts (aux = their concatenation in id order)."""
    def whole(t):  # (B, S/tp, h) -> (B, S, h): an all-gather over tp
        return DTensor.from_local(t, mesh, [Shard(1)], run_check=False).full_tensor()
    if out.stage_taps is None:
        return out
    st = out.stage_taps
    out.stage_taps = StageTaps(None if st.embed is None else whole(st.embed),
                               {i: whole(t) for i, t in st.layers.items()})
    if out.taps is not None:
        ids = out.taps.layer_ids
        out.taps = Taps(out.stage_taps.embed, torch.cat([out.stage_taps.layers[i] for i in ids], dim=-1), ids)
    return out


def tp_copy(policy: nn.Module, tp_mesh: DeviceMesh, fsdp_mesh: DeviceMesh | None = None, *, prepare=None,
            sequence_parallel: bool = False, **fsdp) -> nn.Module:
    """A tensor-parallel copy of the whole `policy` (left as it is), FSDP-sharded too over `fsdp_mesh` when given:
    torchtitan's order — TP, then `prepare(model)` (activation checkpointing, freezing a reference), then FSDP
    (`fsdp`: apply_fsdp's mp_policy / reshard_after_forward / forward_only). A collective over both meshes.

    Unlike parallel/load.sharded_copy, each rank holds a transient whole copy while the shards are cut: FSDP's
    meta-init-then-fill-rows path reads rows of dim 0 only (fsdp.shard_rows), and a row-parallel weight is cut
    along dim 1. What this costs: one whole policy per rank for the moment of the copy, the same as the engine's."""
    import copy

    from .fsdp import apply_fsdp
    model = apply_tp(copy.deepcopy(policy), tp_mesh, sequence_parallel=sequence_parallel)
    if prepare is not None:
        prepare(model)
    if fsdp_mesh is not None:
        apply_fsdp(model, fsdp_mesh, **fsdp)
    return model
