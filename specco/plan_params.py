"""`specco plan`'s parameters: exact counts (the models built on the meta device) and the bytes a rank keeps of them
— fp32 master weights, gradients, AdamW moments, the KL reference, the compute-dtype copies. The layouts, the
activations and the engine are plan.py's; the sparse layers' own formulas plan_moe.py's."""
from __future__ import annotations

import dataclasses
import math
from functools import lru_cache
from typing import TYPE_CHECKING

import torch

from .config import BLOCK_KINDS
from .model.config import DraftConfig, PolicyConfig
from .plan_moe import (expert_copy_bytes, expert_params, experts_gathered, held_expert_params, sparse_layer_parts,
                       sparse_layers)

if TYPE_CHECKING:
    from .plan import Layout, Shapes


# -- parameter counts (exact: the models built on the meta device) ---------------------------------------------

@lru_cache(maxsize=32)
def policy_parts(pc: PolicyConfig) -> tuple[int, int, int]:
    """(parameters of one dense decoder layer, of the embedding, of final norm + head) of the specco Policy (a
    sparse layer's: plan_moe.sparse_layer_parts)."""
    from .model.policy import Policy
    with torch.device("meta"):  # num_experts 0: layer 0 is the dense SwiGLU layer whatever pc's MoE fields say
        m = Policy(dataclasses.replace(pc, num_layers=1, num_experts=0))
    count = lambda mod: sum(p.numel() for p in mod.parameters()) if mod is not None else 0  # noqa: E731
    head = count(m.norm) + (0 if pc.tie_word_embeddings else count(m.lm_head))
    return count(m.layers["0"]), count(m.embed_tokens), head


@lru_cache(maxsize=32)
def draft_params(s: Shapes) -> int:
    """Parameters of the co-trained draft, built on the meta device (0 without one)."""
    if s.draft_kind is None:
        return 0
    from .model.dflash import BlockDraft, BlockDraftConfig
    from .model.draft import Eagle3Draft
    taps = tuple(range(s.num_taps))
    with torch.device("meta"):
        if s.draft_kind in BLOCK_KINDS:
            m = BlockDraft(BlockDraftConfig.for_policy(s.policy, s.draft_kind, s.gamma, mask_id=0,
                                                       num_layers=s.draft_layers, aux_layer_ids=taps))
        else:
            m = Eagle3Draft(DraftConfig.for_policy(s.policy, s.draft_vocab, taps))
    return sum(p.numel() for p in m.parameters())


@lru_cache(maxsize=32)
def layer_norm_params(pc: PolicyConfig) -> int:
    """Parameters of one decoder layer that tensor parallelism keeps whole on every rank: its two RMSNorms and
    Qwen3's q/k norms (parallel/tp.py and rollout/tp.py split the projections only)."""
    return 2 * pc.hidden_size + (2 * pc.head_dim if pc.qk_norm else 0)


def layer_params(pc: PolicyConfig, i: int) -> int:
    """Parameters of decoder layer i: a dense layer's, or a sparse one's with all E of its experts."""
    return sum(sparse_layer_parts(pc)) if pc.is_moe_layer(i) else policy_parts(pc)[0]


def dense_rest_params(pc: PolicyConfig, i: int) -> int:
    """Parameters of layer i outside its experts: a dense layer's all, a sparse layer's all but its experts (which
    plan_moe.experts_held / experts_gathered place)."""
    return sparse_layer_parts(pc)[0] if pc.is_moe_layer(i) else policy_parts(pc)[0]


def rank_params(pc: PolicyConfig, layers: range, first: bool, last: bool, tp: int = 1) -> int:
    """Parameters one tp rank holds of a stage of `layers` (global ids), before FSDP and expert parallelism: its
    layers' projections / tp beside their whole norms, the embedding whole, the final norm whole and the head's
    vocabulary rows / tp (loss-parallel; a head tied to the embedding counts once, whole). tp = 1: stage_params.
    Sparse layers count every expert (a MoE policy trains at tp 1; ep's cut: plan_moe.expert_params)."""
    _, embed, head = policy_parts(pc)
    norms = layer_norm_params(pc)
    tied = pc.tie_word_embeddings
    head_rows = 0 if tied else head - pc.hidden_size
    return (sum((layer_params(pc, i) - norms) // tp + norms for i in layers) + (embed if first else 0)
            + ((pc.hidden_size + head_rows // tp) if last else 0))


def policy_params(pc: PolicyConfig) -> int:
    """The whole policy's parameters (= PolicyConfig.num_params: tests/test_plan.py checks both)."""
    return stage_params(pc, range(pc.num_layers), True, True)


def stage_params(pc: PolicyConfig, layers: range, first: bool, last: bool) -> int:
    """Parameters a pipeline stage of `layers` holds: its layers, the embedding on the first, final norm + head on
    the last."""
    _, embed, head = policy_parts(pc)
    return sum(layer_params(pc, i) for i in layers) + (embed if first else 0) + (head if last else 0)


def engine_params(pc: PolicyConfig, tp: int = 1) -> int:
    """Parameters one rank of a tensor-parallel engine of tp ranks holds (rollout/tp.tp_shard; tp 1: the whole
    policy): the policy of tp_shard's local shape — H/tp query and Hkv/tp kv heads, I/tp MLP rows, a MoE's
    moe_intermediate_size / tp of every expert and shared_expert_intermediate_size / tp of the shared expert, the
    router, norms and embedding whole — with an untied head of V/tp rows (a tied head held as an untied copy)."""
    if tp == 1:
        return policy_params(pc)
    from .rollout.tp import local_config
    return policy_params(local_config(pc, tp)) - (pc.vocab_size - pc.vocab_size // tp) * pc.hidden_size


# -- the trainer's state ---------------------------------------------------------------------------------------

def master_bytes(params: int, lay: Layout, experts: int = 0) -> int:
    """fp32 master weights: 4 B/param, sharded over dp_shard × cp under FSDP (MixedPrecisionPolicy keeps the
    sharded parameters fp32), whole otherwise. `params`: what one tp rank holds but its experts (rank_params less
    plan_moe.expert_params); `experts`: the expert parameters it keeps (plan_moe.held_expert_params: whole slices,
    or their FSDP shards)."""
    return 4 * (math.ceil(params / lay.shard) + experts)


def grad_bytes(params: int, lay: Layout, experts: int = 0) -> int:
    """fp32 gradients, as the master weights (FSDP reduce-scatters them into the shards in reduce_dtype fp32, an
    FSDP'd expert slice's over its replica group; a plain slice's stay whole, summed over that group)."""
    return 4 * (math.ceil(params / lay.shard) + experts)


def adamw_bytes(params: int, lay: Layout, experts: int = 0) -> int:
    """AdamW's two moments, exp_avg and exp_avg_sq, fp32 like the parameters: 8 B/param, sharded like them."""
    return 8 * (math.ceil(params / lay.shard) + experts)


def reference_bytes(s: Shapes, lay: Layout, layers: range | None = None, first: bool = True,
                    last: bool = True) -> int:
    """The KL reference (train.kl_coef > 0; 0 without): a frozen copy of the starting policy in the master
    weights' fp32, 4 B/param (trainer.make_arm). Under FSDP sharded and expert-placed like the trainer's policy
    (its dense rest over dp_shard × cp, its experts as plan_moe.held_expert_params); without FSDP a whole copy, every
    expert (expert parallelism places the trainer's copy only). Under PP without tp it is this rank's stage
    (`layers`, `first`, `last`: its log-probs pipelined like the old ones, rollouts.StagePipe), placed and sharded
    as the trainer's stage. No gradients or AdamW state. Its forward's gathered layers are the no-grad log-prob
    recompute's (transient, not at the train step's peak: plan.py's docstring)."""
    if not s.kl_reference:
        return 0
    pc = s.policy
    if lay.pp > 1 and lay.tp == 1 and layers is not None:
        params = rank_params(pc, layers, first, last, 1)
        return master_bytes(params - expert_params(pc, layers), lay, held_expert_params(pc, layers, lay))
    every = range(pc.num_layers)
    whole = rank_params(pc, every, True, True, lay.tp)  # tensor-parallel like the trainer
    if not lay.fsdp:
        return 4 * whole
    return master_bytes(whole - expert_params(pc, every), lay, held_expert_params(pc, every, lay))


def compute_copy_bytes(pc: PolicyConfig, layers: range, first: bool, last: bool, lay: Layout, c: int,
                       in_flight: int = 1) -> int:
    """The weights in compute dtype beside the master copy. Under FSDP: the all-gathered units, in c bytes: the
    root (embedding, final norm, head: never resharded, parallel/fsdp.py), two layers (the one computing and the
    one prefetched; the stage's largest) plus one layer's unsharded gradient before its reduce-scatter (4 B/param);
    under PP no layer reshards after forward, so the stage's every layer. A sparse layer's gathered experts
    (plan_moe.experts_gathered): at ep 1 part of its layer's unit; at ep > 1 a unit of their own inside it, always
    resharded after forward, so under PP only two layers' at once. Without FSDP: bf16 autocast keeps a cast copy of
    every weight a matmul used, saved for its backward (c = 2); none in fp32. Plain fp32 expert slices are cast by
    autocast per call: plan_moe.expert_copy_bytes (per micro-batch in flight)."""
    _, embed, head = policy_parts(pc)
    norms = layer_norm_params(pc)
    head = pc.hidden_size + (head - pc.hidden_size) // lay.tp if not pc.tie_word_embeddings else head
    experts = expert_copy_bytes(pc, layers, lay, c, in_flight)
    if not lay.fsdp:
        dense = rank_params(pc, layers, first, last, lay.tp) - expert_params(pc, layers)
        return (2 * dense if c < 4 else 0) + experts
    gathered = sparse_layer_parts(pc)[1] // pc.num_experts * experts_gathered(pc, lay) if pc.moe else 0
    in_unit, nested = (gathered, 0) if lay.ep == 1 else (0, gathered)  # the layer's own unit / the slice's unit
    units = [(dense_rest_params(pc, i) + (in_unit if pc.is_moe_layer(i) else 0) - norms) // lay.tp + norms
             for i in layers]
    with_slices = [u + (nested if pc.is_moe_layer(i) else 0) for u, i in zip(units, layers)]
    root = (embed if first else 0) + (head if last else 0)
    if lay.pp > 1:
        held = sum(units) + min(2, sparse_layers(pc, layers)) * nested
    else:
        held = min(2, len(units)) * max(with_slices)
    return c * (root + held) + 4 * max(with_slices) + experts
