"""`specco plan` for mixture-of-experts policies (Qwen2-MoE / Qwen3-MoE, model/moe.py) under expert parallelism
(parallel.ep, parallel/ep.py): the formulas plan.py adds for the sparse layers, one home each.

**What a rank holds** (parallel/ep.py, parallel/fsdp.py, trainer.make_arm). A sparse decoder layer is its *dense
rest* — attention, norms, the router `gate` (E, h), Qwen2-MoE's shared expert and its sigmoid gate (1, h) — and its
E experts, two 3-D tensors (E, 2I, h) and (E, h, I). The dense rest is held like a dense layer's parameters (FSDP
shards it over dp_shard × cp and gathers it per layer). Expert parallelism cuts the experts along E: rank j of an ep
group holds experts [j·E/ep, (j+1)·E/ep), a slice the R = dp × cp / ep ranks of its replica group all hold. Each
rank keeps its experts' fp32 weights, gradients and both AdamW moments (16 B/param) as (`experts_held`):

    no FSDP                 the slice whole, E/ep experts (a plain fp32 tensor)
    FSDP, ep 1              sharded with its layer along E over dp_shard × cp: ceil(E / (dp_shard·cp)) experts, and
                            gathered whole with the layer's unit (in compute dtype, for its forward and backward)
    FSDP, ep > 1, R > 1     the slice FSDP-sharded over its replica group, a unit of its own inside its layer's,
                            always resharded after forward: ceil(E/ep / R) experts, the E/ep gathered per layer
    FSDP, ep > 1, R = 1     the slice whole (`ignored_params`: one holder), plain fp32 as without FSDP

The cut is torch.chunk's along E (parallel/fsdp.shard_rows: the fullest rank holds the ceiling). Plain fp32 slices
under bf16 autocast are cast anew by every expert GEMM (`expert_copy_bytes`); FSDP's slices are gathered in its
mixed precision's bf16 (`experts_gathered`, plan_params.compute_copy_bytes). The KL reference is placed and sharded
as the trainer's policy under FSDP (forward-only), and without FSDP keeps a whole copy, every expert
(plan_params.reference_bytes). The rollout engine holds the whole policy, every expert, in rollout.dtype (taken as
given for every layout, as for a dense policy: config.py keeps the policy's dtype under ep, FSDP, PP and TP today);
a tensor-parallel engine (rollout/tp.py) cuts every expert's SwiGLU and the shared expert I/tp, router whole
(plan_params.engine_params). Layers that mlp_only_layers or decoder_sparse_step make dense
(PolicyConfig.is_moe_layer) are counted as dense layers.

**Activations** (`moe_activation_bytes`, in place of a dense layer's SwiGLU term; read off SparseMoE.mix,
moe.route, Experts.forward / EPExperts.forward and checked to the byte against autograd's saved tensors,
tests/test_plan_moe.py). Per token of the layer's N tokens, with k experts each (N·k assignments):

    routed_token_bytes      the router's and the combine's tensors, per token
    dispatched_row_bytes    the experts' tensors, per assignment a rank's experts compute

**Routing.** How many of the assignments a rank's experts compute depends on the router. Without ep it is all N·k.
Under ep, the ep ranks of a group each route their own N tokens and send each assignment to its expert's rank, so a
rank receives a share of the group's ep·N·k assignments; the plan takes the **uniform expectation**, ep·N·k / ep =
N·k rows per rank (each expert equally likely; the group's mean whatever the routing): the same per-token bytes as
ep 1, plus the dispatch's permutation and un-permutation. A router that favours the experts of one rank makes that
rank's share (and its SwiGLU activations) larger in proportion: keep headroom for it (bench/moe_verify.py measures
the experts a batch touches).

**Layouts** (`ep_degrees`, `moe_layout_runs`). ep borrows its ranks from a stage's dp × cp ranks, so it divides
dp × cp and num_experts (under pp each stage's experts are cut over that stage's dp × cp ranks: parallel/ep.py; the
router's aux loss spans the stages through train/moe_loss.RouterBalance). FSDP runs at every ep, 1 included (the
experts then sharded with their layers). The trainer refuses tensor parallelism of MoE layers
(runner/validate.check_moe_layout) and ep > 1 on a dense policy; a tensor-parallel engine over MoE runs.

Not modelled: routing imbalance (above); the backward's transients (each local expert's `gate_up_proj[e]`
select-backward builds a zero-filled gradient of the whole slice before autograd adds it up).
"""
from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

import torch

from .model.config import PolicyConfig

if TYPE_CHECKING:
    from .plan import Layout


# -- parameter counts (exact: a sparse layer built on the meta device) -----------------------------------------

@lru_cache(maxsize=32)
def sparse_layer_parts(pc: PolicyConfig) -> tuple[int, int]:
    """(parameters of one sparse decoder layer outside its experts: attention, norms, router, Qwen2-MoE's shared
    expert and its gate; its E experts' parameters), of the specco DecoderLayer built on the meta device."""
    from .model.policy import DecoderLayer
    first = next(i for i in range(pc.num_layers) if pc.is_moe_layer(i))
    with torch.device("meta"):
        layer = DecoderLayer(pc, first)
    experts = sum(p.numel() for p in layer.mlp.experts.parameters())
    return sum(p.numel() for p in layer.parameters()) - experts, experts


def sparse_layers(pc: PolicyConfig, layers: range) -> int:
    """How many of `layers` (global ids) are sparse (PolicyConfig.is_moe_layer); 0 for a dense policy."""
    return sum(pc.is_moe_layer(i) for i in layers)


def expert_params(pc: PolicyConfig, layers: range) -> int:
    """Parameters of every expert of the sparse layers among `layers` (a rank at ep holds 1/ep of them)."""
    n = sparse_layers(pc, layers)
    return n * sparse_layer_parts(pc)[1] if n else 0


def active_params(pc: PolicyConfig, total: int) -> int:
    """Parameters a token runs through, of a policy of `total` parameters: all but the E - k experts of each sparse
    layer that its router does not pick (Qwen3-30B-A3B: 30.5 B total, 3.3 B active)."""
    if not pc.moe:
        return total
    skipped = expert_params(pc, range(pc.num_layers)) // pc.num_experts * (pc.num_experts - pc.num_experts_per_tok)
    return total - skipped


# -- activations -----------------------------------------------------------------------------------------------

def routed_token_bytes(pc: PolicyConfig, c: int, r: int) -> int:
    """Per token, what a sparse MLP saves for its backward outside the experts' GEMMs (c: matmul outputs' bytes,
    r: the residual stream's, as plan.layer_activation_bytes). The router's input is the post-attention norm's
    output, which plan.layer_activation_bytes' norm term counts already.
        4E              route's fp32 softmax over all E experts (softmax saves its output)
        8k              topk's expert ids (int64)
        4k + 4          norm_topk_prob: the k fp32 top probabilities and their sum (the division saves both)
        16k             the assignments' expert order (argsort) and their rows (int64: the gathers save them)
        k·c             each assignment's routing weight, in the logits' dtype (the combine's product saves it)
        k·h·c           the expert outputs (the combine's product saves them)
        k·h·r           the weighted outputs cast to the residual's dtype (`index_add_` saves its source)
    Qwen2-MoE's shared expert adds its SwiGLU (4·Is·c), its output h·c and its sigmoid gate c (their product saves
    both), and under bf16 autocast over fp32 weights (c < r) autocast's copies of the input for its two matmuls,
    2·h·c (the router's copy is the norm term's)."""
    h, k, E, Is = pc.hidden_size, pc.num_experts_per_tok, pc.num_experts, pc.shared_expert_intermediate_size
    out = 4 * E + 8 * k + ((4 * k + 4) if pc.norm_topk_prob else 0) + 16 * k + k * c + k * h * c + k * h * r
    if Is:
        out += 4 * Is * c + h * c + c + (2 * h * c if c < r else 0)
    return out


def dispatched_row_bytes(pc: PolicyConfig, c: int, ep: int = 1) -> int:
    """Per assignment a rank's experts compute, what their GEMMs save: the row itself, h·c (the gathered rows, or
    autocast's copy of each expert's segment when c < r), the fused gate|up output, silu(gate) and silu·up, 4I·c
    (a dense SwiGLU's). Under ep (EPExperts.forward) also the received rows' permutation to local-expert order, 8
    (int64), and the experts' outputs before they are permuted back, h·c (`index_copy` saves its source)."""
    dispatch = 8 + pc.hidden_size * c if ep > 1 else 0
    return pc.hidden_size * c + 4 * pc.moe_intermediate_size * c + dispatch


def moe_activation_bytes(pc: PolicyConfig, c: int, r: int, ep: int = 1) -> int:
    """Per token, a sparse MLP's saved bytes at the uniform expectation of k assignments per token computed on
    each rank (module docstring, **Routing**): routed_token_bytes + k · dispatched_row_bytes."""
    return routed_token_bytes(pc, c, r) + pc.num_experts_per_tok * dispatched_row_bytes(pc, c, ep)


def router_aux_bytes(pc: PolicyConfig) -> int:
    """Per token and sparse layer, what the router's load-balancing loss keeps for the backward when its weight is
    > 0 (train/moe_loss.router_sums): its softmax of the router logits (softmax saves its output), 4E in fp32 for
    fp32 and bf16 logits (8E for fp64 ones, the tests'). It lives outside the layer, so activation checkpointing keeps
    it too. What it keeps once per micro-batch: router_aux_step_bytes."""
    return 4 * pc.num_experts


def router_aux_step_bytes(pc: PolicyConfig, tokens: int) -> int:
    """What the aux loss keeps once per micro-batch of `tokens` tokens on a stage with sparse layers, whatever their
    number (train/moe_loss.router_sums, aux_from_sums, aux_share), fp32:
        4·tokens        the (N, 1) mask column (`probs * w` saves it; the same tensor for every layer)
        4(2E + 1)       the cat of [counts, prob sums, rows] (its row slice is saved by clamp_min: one storage)
        4               the clamped rows
        8E              the two (E,) quotients counts/R and P/R (their product saves both)
        4               the micro-batch's share of the step's tokens (0-d)"""
    return 4 * tokens + 16 * pc.num_experts + 12


# -- where the experts live ------------------------------------------------------------------------------------

def expert_replicas(lay: Layout) -> int:
    """R: the ranks of a stage that hold the same expert slice (its replica group, parallel/ep.ep_groups): dp × cp
    / ep."""
    return lay.dp * lay.cp // lay.ep


def experts_held(pc: PolicyConfig, lay: Layout) -> int:
    """Experts of one sparse layer whose fp32 weights, gradients, AdamW moments (and KL reference, under FSDP) the
    fullest rank keeps (module docstring, **What a rank holds**): E/ep whole without FSDP or with one holder (R = 1);
    under FSDP the ceiling of torch.chunk's cut along E, of all E over dp_shard × cp at ep 1 (with the layer), of
    the E/ep of the slice over its R replicas at ep > 1 (a unit of its own)."""
    local = pc.num_experts // lay.ep
    if not lay.fsdp:
        return local
    if lay.ep == 1:
        return -(-local // lay.shard)
    return -(-local // expert_replicas(lay))


def experts_gathered(pc: PolicyConfig, lay: Layout) -> int:
    """Experts of one sparse layer that FSDP all-gathers in compute dtype for the layer's forward and again for its
    backward: every one at ep 1 (in the layer's unit), the E/ep of the slice when its replicas shard it (its own
    unit, resharded after forward even where the layer's unit is not: under pp); 0 for plain fp32 slices (no FSDP,
    or one holder: autocast's copies instead, expert_copy_bytes)."""
    if not lay.fsdp or (lay.ep > 1 and expert_replicas(lay) == 1):
        return 0
    return pc.num_experts // lay.ep


def held_expert_params(pc: PolicyConfig, layers: range, lay: Layout) -> int:
    """Expert parameters of the sparse layers among `layers` whose fp32 state the fullest rank of `lay` keeps:
    experts_held of each (0 for a dense policy)."""
    n = sparse_layers(pc, layers)
    return n * sparse_layer_parts(pc)[1] // pc.num_experts * experts_held(pc, lay) if n else 0


def expert_copy_bytes(pc: PolicyConfig, layers: range, lay: Layout, c: int, in_flight: int) -> int:
    """bf16 autocast's copies of the rank's plain fp32 expert slices (c < 4; no FSDP, or FSDP with one holder:
    experts_gathered 0), beside plan_params.compute_copy_bytes' dense ones. Each expert GEMM reads
    `gate_up_proj[e]` / `down_proj[e]`, views, which autocast casts anew on every call (its cache keeps leaf
    parameters only) and the GEMM saves for its backward: a bf16 copy of the rank's E/ep experts per sparse layer and
    micro-batch in flight, until that layer's backward; under activation checkpointing only the recomputed layer's.
    Every local expert is counted as touched: at N·k assignments one is missed with probability (1 - 1/E)^(N·k).
    FSDP's gathered slices are bf16 already (its mixed precision): no copy; the GEMMs save views of the gathered
    weights, which FSDP frees after the forward and gathers again for the backward."""
    n = sparse_layers(pc, layers)
    if c >= 4 or not n or experts_gathered(pc, lay):
        return 0
    return 2 * sparse_layer_parts(pc)[1] // lay.ep * (1 if lay.ac else n * in_flight)


# -- layouts ---------------------------------------------------------------------------------------------------

def ep_degrees(pc: PolicyConfig, ranks: int) -> list[int]:
    """The expert-parallel degrees of a stage of `ranks` = dp × cp ranks (ep borrows ep of them, parallel/ep.py):
    the divisors of both `ranks` and num_experts; [1] for a dense policy (parallel.ep > 1 is refused there)."""
    if not pc.moe:
        return [1]
    return [d for d in range(1, ranks + 1) if ranks % d == 0 and pc.num_experts % d == 0]


def moe_layout_runs(pc: PolicyConfig, lay: Layout) -> bool:
    """Whether the trainer runs `lay` for a MoE policy (runner/validate.check_moe_layout): not with tensor
    parallelism of MoE layers (FSDP at ep 1 and ep with pp run: module docstring, **Layouts**); a dense policy at
    ep 1 only (parallel.ep > 1 is refused there)."""
    if not pc.moe:
        return lay.ep == 1
    return lay.tp == 1
