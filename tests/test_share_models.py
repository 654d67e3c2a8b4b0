"""Rank 0's starting models reach the other ranks without pickling a model (runner/setup.py), on gloo.

Reference: the models rank 0 holds (every rank builds the same ones from one seed, so each can compare; only
rank 0 passes them in). After `share_model` / `share_policy` every rank's copy must equal them bit for bit
(tolerance: none, the bytes are copied): every parameter and buffer (EAGLE-3's long d2t and bool t2d maps
included), the dtype (a bf16 policy), the class and config, the train/eval flag, a tied head still the
embedding's parameter. No pickled payload may carry a tensor or a module: broadcast_object_list is wrapped to
refuse them and to bound each payload at 64 KB (a recipe is a few KB; the tiny policy's weights are ~90 KB).

share_policy from a directory every rank reads: each rank loads it itself (share_model patched to fail
on the receiving ranks proves nothing was broadcast); when rank 0's policy is NOT the directory's weights
(one weight changed after loading), the digests differ and every rank falls back to the broadcast, ending
with rank 0's weights; so do they when one rank cannot read the directory. Mutations checked to fail here:
skipping the re-tie after `to_empty` (share_model's own check of the built layout against rank 0's names it), and
accepting a directory copy without comparing digests (the perturbed case: 'fallback',
layers.1.mlp.down_proj.weight).
"""
import pickle

import pytest
import torch
import torch.distributed as dist

from specco.model.config import PolicyConfig
from specco.model.hf_io import load_policy, save_policy
from specco.model.policy import Policy
from specco.parallel.mesh import Mesh, spawn_local
from specco.runner import setup
from specco.runner.warmstart import new_block_draft, new_draft

pytestmark = pytest.mark.dist

V = 61


def _models():
    torch.manual_seed(0)
    cfg = PolicyConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                       num_kv_heads=2, tie_word_embeddings=True, model_type="qwen3", qk_norm=True)
    policy = Policy(cfg)
    tokens = torch.randint(0, V, (4, 8))
    eagle = new_draft(policy, tokens, draft_vocab_size=20, aux_layer_ids=(0, 1)).eval()
    dflash = new_block_draft(policy, tokens, "dflash", gamma=2, aux_layer_ids=(0, 1))
    return policy, eagle, dflash


def _same(a, b, what):
    assert type(a) is type(b) and a.cfg == b.cfg and a.training == b.training, what
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb), what
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), (what, k)


def _no_pickled_models():
    """Wrap broadcast_object_list: a payload holding a tensor or module, or over 64 KB, fails the test."""
    real = dist.broadcast_object_list

    def checked(objs, *a, **kw):
        for o in objs:
            if o is not None:
                data = pickle.dumps(o)
                assert len(data) < 64 * 1024, f"a {len(data)}-byte pickled payload"
                assert b"torch._utils\n_rebuild" not in data and b"_rebuild_tensor" not in data, "a pickled tensor"
                assert not isinstance(o, torch.nn.Module)
        return real(objs, *a, **kw)
    dist.broadcast_object_list = checked


def _share(rank, world, d):
    _no_pickled_models()
    mesh = Mesh.build(dp=world, backend="gloo")
    policy, eagle, dflash = _models()
    bf16 = Policy(policy.cfg).to(torch.bfloat16)  # another seed's weights: a second, bf16 policy
    mine = [setup.share_model(m if rank == 0 else None, mesh, "cpu") for m in (policy, eagle, dflash, bf16)]
    for ref, got, what in zip((policy, eagle, dflash, bf16), mine, ("policy", "eagle3", "dflash", "bf16")):
        _same(ref, got, what)
    assert mine[0].lm_head.weight is mine[0].embed_tokens.weight
    assert setup.share_model(None, mesh, "cpu") is None
    (tok,) = setup.from_rank0(({"pad": 0} if rank == 0 else None,), mesh, "cpu")
    assert tok == {"pad": 0}

    # every rank reads the directory itself: nothing is broadcast
    ref = load_policy(d)
    real_share_model = setup.share_model
    if rank != 0:
        setup.share_model = lambda *a: (_ for _ in ()).throw(AssertionError("broadcast instead of a read"))
    got = setup.share_policy(ref if rank == 0 else None, d, mesh, "cpu")
    setup.share_model = real_share_model
    _same(ref, got, "read")
    assert got.lm_head.weight is got.embed_tokens.weight
    # rank 0's policy is not the directory's weights: the digests differ, so it is broadcast
    if rank == 0:
        with torch.no_grad():
            ref.layers["1"].mlp.down_proj.weight[0, 0] += 1.0
    got = setup.share_policy(ref if rank == 0 else None, d, mesh, "cpu")
    expect = load_policy(d)
    with torch.no_grad():
        expect.layers["1"].mlp.down_proj.weight[0, 0] += 1.0
    _same(expect, got, "fallback")
    # a rank that cannot read the directory (here: its reads fail): every rank takes the broadcast
    real_load = setup.load_policy
    if rank == world - 1:
        setup.load_policy = lambda *a, **k: (_ for _ in ()).throw(OSError("not on this node"))
    got = setup.share_policy(ref if rank == 0 else None, d, mesh, "cpu")
    setup.load_policy = real_load
    _same(expect, got, "unreadable on one rank")


@pytest.mark.parametrize("world", [2, 3])
def test_models_reach_every_rank_as_tensors(tmp_path, world):
    policy, _, _ = _models()
    save_policy(policy, tmp_path / "policy")
    spawn_local(_share, world, tmp_path / "policy")
