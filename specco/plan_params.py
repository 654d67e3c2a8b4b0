"""`specco plan`'s parameters: exact counts (the models built on the meta device) and the bytes a rank keeps of them
— fp32 master weights, gradients, AdamW moments, the KL reference, the compute-dtype copies. The layouts, the
activations and the engine are plan.py's."""
from __future__ import annotations

import dataclasses
import math
from functools import lru_cache
from typing import TYPE_CHECKING

import torch

from .config import BLOCK_KINDS
from .model.config import DraftConfig, PolicyConfig

if TYPE_CHECKING:
    from .plan import Layout, Shapes


# -- parameter counts (exact: the models built on the meta device) ---------------------------------------------

@lru_cache(maxsize=32)
def policy_parts(pc: PolicyConfig) -> tuple[int, int, int]:
    """(parameters of one decoder layer, of the embedding, of final norm + head) of the specco Policy."""
    from .model.policy import Policy
    with torch.device("meta"):
        m = Policy(dataclasses.replace(pc, num_layers=1))
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


def rank_params(pc: PolicyConfig, layers: int, first: bool, last: bool, tp: int = 1) -> int:
    """Parameters one tp rank holds of a stage (before FSDP): its layers' projections / tp beside their whole
    norms, the embedding whole, the final norm whole and the head's vocabulary rows / tp (loss-parallel; a head
    tied to the embedding counts once, whole). tp = 1: stage_params."""
    layer, embed, head = policy_parts(pc)
    norms = layer_norm_params(pc)
    tied = pc.tie_word_embeddings
    head_rows = 0 if tied else head - pc.hidden_size
    return (layers * ((layer - norms) // tp + norms) + (embed if first else 0)
            + ((pc.hidden_size + head_rows // tp) if last else 0))


def policy_params(pc: PolicyConfig) -> int:
    """The whole policy's parameters (= PolicyConfig.num_params: tests/test_plan.py checks both)."""
    return stage_params(pc, pc.num_layers, True, True)


def stage_params(pc: PolicyConfig, layers: int, first: bool, last: bool) -> int:
    """Parameters a pipeline stage holds: its layers, the embedding on the first, final norm + head on the last."""
    layer, embed, head = policy_parts(pc)
    return layers * layer + (embed if first else 0) + (head if last else 0)


# -- the trainer's state ---------------------------------------------------------------------------------------

def master_bytes(params: int, lay: Layout) -> int:
    """fp32 master weights: 4 B/param, sharded over dp_shard × cp under FSDP (MixedPrecisionPolicy keeps the
    sharded parameters fp32), whole otherwise. `params`: what one tp rank holds (rank_params)."""
    return 4 * math.ceil(params / lay.shard)


def grad_bytes(params: int, lay: Layout) -> int:
    """fp32 gradients, as the master weights (FSDP reduce-scatters them into the shards in reduce_dtype fp32)."""
    return 4 * math.ceil(params / lay.shard)


def adamw_bytes(params: int, lay: Layout) -> int:
    """AdamW's two moments, exp_avg and exp_avg_sq, fp32 like the parameters: 8 B/param, sharded like them."""
    return 8 * math.ceil(params / lay.shard)


def reference_bytes(s: Shapes, lay: Layout) -> int:
    """The KL reference (train.kl_coef > 0; 0 without): a frozen copy of the whole starting policy in the master
    weights' fp32, 4 B/param, sharded over dp_shard × cp under FSDP like the trainer (trainer.make_arm cuts its
    shards; under PP too it is the whole policy, not a stage: its log-probs need every layer), whole otherwise.
    No gradients or AdamW state. Its forward's gathered layers are the no-grad log-prob recompute's (transient,
    not at the train step's peak: plan.py's docstring)."""
    pc = s.policy
    whole = rank_params(pc, pc.num_layers, True, True, lay.tp)  # tensor-parallel like the trainer
    return 4 * math.ceil(whole / lay.shard) if s.kl_reference else 0


def compute_copy_bytes(pc: PolicyConfig, layers: int, first: bool, last: bool, lay: Layout, c: int) -> int:
    """The weights in compute dtype beside the master copy. Under FSDP: the all-gathered units, in c bytes: the
    root (embedding, final norm, head: never resharded, parallel/fsdp.py), two layers (the one computing and the
    one prefetched) plus one layer's unsharded gradient before its reduce-scatter; under PP no layer reshards
    after forward, so the stage's every layer. Without FSDP: bf16 autocast keeps a cast copy of every weight
    a matmul used, saved for its backward (c = 2); none in fp32."""
    layer, embed, head = policy_parts(pc)
    layer = (layer - layer_norm_params(pc)) // lay.tp + layer_norm_params(pc)
    head = pc.hidden_size + (head - pc.hidden_size) // lay.tp if not pc.tie_word_embeddings else head
    if not lay.fsdp:
        return 2 * rank_params(pc, layers, first, last, lay.tp) if c < 4 else 0
    root = (embed if first else 0) + (head if last else 0)
    gathered = layers if lay.pp > 1 else min(2, layers)
    return c * (root + gathered * layer) + 4 * layer
