"""Tensor parallelism of the rollout engine: each rank of a tp group decodes with its shard of the policy.

    shard = tp_shard(policy, group)              this rank's copy: H/tp query and Hkv/tp kv heads, I/tp MLP rows,
    engine = RolloutEngine(shard, draft, cfg)    V/tp head rows; the draft whole on every rank
    refit: InPlaceLoad(shard, ...) takes the trainer's whole tensors and keeps this rank's slice (weights.py)

What a rank holds (Megatron's split, as the trainer's parallel/tp.py; the engine keeps its fused projections):

    qkv_proj      rows [q_r | k_r | v_r]: the rank's H/tp query heads and the Hkv/tp kv heads they read (GQA groups
                  stay whole: both counts are cut in tp contiguous blocks and G = H/Hkv is kept), biases alike
    o_proj        the input columns of those heads; its output is a partial sum, all-reduced over the group
    gate_up_proj  rows [gate_r | up_r]; down_proj the matching input columns, its output all-reduced
    lm_head       V/tp rows of the vocabulary; the logits all-gathered along the vocabulary (`head_logits`)
    embedding, norms, q/k norms, the draft: whole on every rank

The KV cache is the rank's kv heads only (Hkv/tp of them): the cache's memory and every step's cache read split tp
ways, which is what a long-context decode step is bound by. A layer costs two all-reduces of (B, T, h); the head one
all-gather of (B, T, V). Every rank then holds the same whole logits, draws the same tokens from the same noise and
keeps the same draft state, so sampling, verification, compaction and speculation control run unchanged.

Not yet vocabulary-parallel: the sampler, the verify's acceptance and the residual draw read whole logits, so the
head's output is gathered (B·(k+1) rows of V per verify) where a reduction of (max, argmax, log-sum-exp) per row
would do for greedy and coupled sampling. Tied heads are held as an untied copy of the head's rows (the refit
writes the embedding and the head's slice from the same tensor). DSpark (its Markov bias reads whole-vocabulary
rows of its own) is refused.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from ..model.policy import Policy

# state-dict names (suffixes) cut along a dim, and the dim: the parts of the fused projections as the engine's model
# exposes them (layers.fuse_linears), so a refit of whole HF-named tensors slices each part by itself
_ROWS = (".q_proj.weight", ".q_proj.bias", ".k_proj.weight", ".k_proj.bias", ".v_proj.weight", ".v_proj.bias",
         ".gate_proj.weight", ".up_proj.weight")
_COLS = (".o_proj.weight", ".down_proj.weight")


def shard_dim(name: str) -> int | None:
    """The dim along which tensor `name` of the policy is cut over the tp ranks (None: whole on every rank)."""
    if name.endswith(_ROWS) or name == "lm_head.weight":
        return 0
    if name.endswith(_COLS):
        return 1
    return None


def shard_of(t: torch.Tensor, dim: int, rank: int, tp: int) -> torch.Tensor:
    """Rank `rank`'s contiguous block of `t` along `dim` (its size divisible by tp: tp_shard checks it)."""
    n = t.shape[dim] // tp
    return t.narrow(dim, rank * n, n)


def tp_shard(policy: Policy, group) -> Policy:
    """This rank's tensor-parallel copy of `policy` for the engine (module docstring), its tensors on the
    policy's device and in its dtype. `group`: the tp process group (its ranks all call this)."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    c = policy.cfg
    for what, n in (("num_heads", c.num_heads), ("num_kv_heads", c.num_kv_heads),
                    ("intermediate_size", c.intermediate_size), ("vocab_size", c.vocab_size)):
        if n % tp:
            raise ValueError(f"engine tensor parallelism over {tp} ranks: the policy's {what} = {n} is not divisible "
                             f"by {tp}; choose a rollout tp that divides the head counts, MLP width and vocabulary")
    if policy.embed_tokens is None or policy.lm_head is None or len(policy.layers) != c.num_layers:
        raise ValueError("engine tensor parallelism needs a whole policy (embedding, every layer, head)")
    local = dataclasses.replace(c, num_heads=c.num_heads // tp, num_kv_heads=c.num_kv_heads // tp,
                                intermediate_size=c.intermediate_size // tp, head_dim=c.head_dim,
                                tie_word_embeddings=False)
    p0 = next(policy.parameters())
    with torch.device("meta"):
        shard = Policy(local)
    shard.lm_head = nn.Linear(c.hidden_size, c.vocab_size // tp, bias=False, device="meta")
    shard = shard.to_empty(device=p0.device).to(p0.dtype)
    whole = policy.state_dict()
    with torch.no_grad():
        for name, dst in shard.state_dict().items():
            src, dim = whole[name], shard_dim(name)
            dst.copy_(src if dim is None else shard_of(src, dim, rank, tp))
    for buf_name, buf in policy.named_buffers():  # non-persistent buffers (none today) would be missed above
        if buf_name not in whole:
            raise ValueError(f"tp_shard: the policy's buffer {buf_name!r} is not in its state dict")
    shard.tp_group, shard.tp_rank, shard.tp_size = group, rank, tp
    shard.tp_slices = {n: d for n in shard.state_dict() if (d := shard_dim(n)) is not None}
    return shard.eval()


def tp_group_of(model: nn.Module):
    """The tp group a model was sharded over (tp_shard), or None for a whole model."""
    return getattr(model, "tp_group", None)


def reduce_partial(x: torch.Tensor, group) -> torch.Tensor:
    """Sum a row-parallel projection's partial outputs over the group, in place (no-op without a group)."""
    if group is not None:
        dist.all_reduce(x, group=group)
    return x


def head_logits(policy: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The policy head's logits (..., V): under tp each rank's V/tp columns, all-gathered along the vocabulary."""
    local = policy.lm_head(hidden)
    return gather_vocab(local, tp_group_of(policy))


def gather_vocab(local: torch.Tensor, group) -> torch.Tensor:
    """(..., V/tp) blocks of the ranks in order -> (..., V) on every rank (no-op without a group)."""
    if group is None:
        return local
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=-1)
