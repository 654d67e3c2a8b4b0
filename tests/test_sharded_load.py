"""Sharded HF loading (parallel/load.py, hf_io.load_policy_rows) on gloo equals the whole load, shard for shard.

Reference: `load_policy(dir).to(dtype)` on one process — the whole-model path — then sharded by FSDP itself
(`apply_fsdp` of a copy: the shards FSDP cuts from whole tensors). Sharded: `load_sharded_policy(dir,
mesh.fsdp_mesh, ...)`, the policy built on the meta device, sharded, then each rank filling only its rows from
the safetensors files. Every rank's local shard of every parameter must be bit for bit FSDP's own shard of the
whole load (tolerance: none — the same file bytes, cast once to the same dtype; nothing is summed), and also
the rows `shard_rows` names of the whole tensor; the tied head must stay the embedding's parameter; a forward
equals the whole model's exactly (same weights, same single-process arithmetic after FSDP's all-gather).

Checkpoints: Llama-, Qwen2- (q/k/v biases) and Qwen3-style (qk-norm) random policies written by `save_policy`,
tied and untied, one of them stored in bf16 and loaded in fp32 (the cast). Sizes chosen so the FSDP cut
straddles the fused parts: qkv_proj is 48 q + 16 k + 16 v rows (dp_shard 4: rows 40-60 and 60-80 cross q|k and
k|v), gate_up_proj 51 + 51 rows (chunks of 26 cross gate|up at 51), vocab 53 (uneven: 14, 14, 14, 11).
Layouts: dp_shard 2, dp_shard 4, and HSDP 2 x 2 (a Replicate mesh dim). Mutations checked to fail here: the
parts of a fused parameter walked in reverse order (HFTensors.read_rows_into; fails on qkv_proj at dp_shard 2),
a part read at the wrong offset (a shape error), and a floor instead of FSDP's ceil chunk in shard_rows (its
own check against the local shard's length).

`sharded_copy` (the trainer's and the KL reference's shards in trainer.make_arm, cut from the whole starting
policy in memory) against the same reference, `apply_fsdp(copy.deepcopy(whole))`: every local shard bit for bit,
the tied head still the embedding, the whole policy left unchanged, activation checkpointing (`prepare`) on the
copy's layers only, and a forward equal to the whole model's. A `forward_only` copy (the reference) holds only
shards after a forward, root and last layer included; the trainer's layout keeps its root gathered there (so
the check can fail). Mutation checked to fail here: every rank copying the first rows (`whole[name][:n]`).
"""
import copy

import pytest
import torch

from specco.model.config import PolicyConfig
from specco.model.hf_io import load_policy, save_policy
from specco.model.policy import Policy
from specco.parallel.fsdp import apply_fsdp, shard_rows
from specco.parallel.load import load_sharded_policy, sharded_copy
from specco.parallel.mesh import Mesh, spawn_local

pytestmark = pytest.mark.dist

SHAPE = dict(vocab_size=53, hidden_size=48, intermediate_size=51, num_layers=2, num_heads=6, num_kv_heads=2)
CASES = {  # name: (PolicyConfig overrides, dtype on disk)
    "llama_untied": (dict(model_type="llama"), torch.float32),
    "llama_tied_bf16": (dict(model_type="llama", tie_word_embeddings=True), torch.bfloat16),
    "qwen2_tied": (dict(model_type="qwen2", attention_bias=True, tie_word_embeddings=True), torch.float32),
    "qwen3_untied": (dict(model_type="qwen3", qk_norm=True), torch.float32),
}


def _write(root):
    for i, (name, (over, dtype)) in enumerate(CASES.items()):
        torch.manual_seed(i)
        policy = Policy(PolicyConfig(**SHAPE, **over))
        with torch.no_grad():  # norms and biases away from their init, so a misplaced row shows
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        save_policy(policy.to(dtype), root / name)


def _check(rank, world, root, dp_shard):
    mesh = Mesh.build(dp=world, dp_shard=dp_shard, backend="gloo")
    for name in CASES:
        d = root / name
        whole = load_policy(d).to(torch.float64)
        ref = apply_fsdp(copy.deepcopy(whole), mesh.fsdp_mesh)  # FSDP's own shards of the whole load
        got = load_sharded_policy(d, mesh.fsdp_mesh, "cpu", torch.float64)
        ref_params, whole_params = dict(ref.named_parameters()), dict(whole.named_parameters())
        assert list(ref_params) == [k for k, _ in got.named_parameters()], name
        for k, p in got.named_parameters():
            local, start, stop = shard_rows(p)
            assert local.dtype == torch.float64
            assert torch.equal(local, ref_params[k].to_local()), (name, k, rank)
            assert torch.equal(local, whole_params[k][start:stop]), (name, k, rank)
        if whole.cfg.tie_word_embeddings:
            assert got.lm_head.weight is got.embed_tokens.weight
        ids = torch.randint(0, SHAPE["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(rank))
        with torch.no_grad():
            assert torch.equal(got(ids).logits, whole(ids).logits), name


@pytest.mark.parametrize("world,dp_shard", [(2, 2), (4, 4), (4, 2)], ids=["dp_shard2", "dp_shard4", "hsdp2x2"])
def test_sharded_load_equals_whole_load_shard_for_shard(tmp_path, world, dp_shard):
    _write(tmp_path)
    spawn_local(_check, world, tmp_path, dp_shard)


def _check_copy(rank, world, root, dp_shard):
    from torch.distributed.tensor import DTensor
    from specco.train.activation_checkpointing import _CheckpointedForward, apply_activation_checkpointing
    mesh = Mesh.build(dp=world, dp_shard=dp_shard, backend="gloo")
    for name in CASES:
        whole = load_policy(root / name).to(torch.float64)
        before = {k: v.clone() for k, v in whole.state_dict().items()}
        ref = dict(apply_fsdp(copy.deepcopy(whole), mesh.fsdp_mesh).named_parameters())
        got = sharded_copy(whole, mesh.fsdp_mesh, prepare=apply_activation_checkpointing)
        assert list(ref) == [k for k, _ in got.named_parameters()], name
        for k, p in got.named_parameters():
            assert torch.equal(shard_rows(p)[0], ref[k].to_local()), (name, k, rank)
        assert all(isinstance(layer.__dict__.get("forward"), _CheckpointedForward) for layer in got.layers.values())
        assert not any("forward" in layer.__dict__ for layer in whole.layers.values())  # the source is not wrapped
        assert all(torch.equal(v, before[k]) for k, v in whole.state_dict().items()), name
        if whole.cfg.tie_word_embeddings:
            assert got.lm_head.weight is got.embed_tokens.weight
        ids = torch.randint(0, SHAPE["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(rank))
        fwd_only = sharded_copy(whole, mesh.fsdp_mesh, forward_only=True,
                                prepare=lambda m: m.requires_grad_(False)).eval()
        with torch.no_grad():
            assert torch.equal(got(ids).logits, whole(ids).logits), name
            assert torch.equal(fwd_only(ids).logits, whole(ids).logits), name
        assert all(isinstance(p, DTensor) and not p.requires_grad for p in fwd_only.parameters()), name
        assert not all(isinstance(p, DTensor) for p in got.parameters()), name  # the trainer's root stays gathered


@pytest.mark.parametrize("world,dp_shard", [(2, 2), (4, 2)], ids=["dp_shard2", "hsdp2x2"])
def test_sharded_copy_equals_fsdp_of_a_deepcopy(tmp_path, world, dp_shard):
    _write(tmp_path)
    spawn_local(_check_copy, world, tmp_path, dp_shard)
