"""The streamed refit from an FSDP-sharded trainer (parallel.dp_shard 2, gloo) against the whole-state refit on one
process: every rank's engine must hold exactly (bit for bit) what an engine refit from the unsharded policy
holds, and the fingerprints the trainer side took as the buckets streamed past must equal the whole-state guard's.

Exact, not a tolerance: a gather only moves bytes, and the trainer casts each shard to the engine's dtype before
gathering with the same elementwise rounding (round to nearest even) the engine's copy_ applies to a whole tensor.
Shapes: the policy's vocabulary (33) and the draft-free layers' rows do not divide by 2, so FSDP's shards are
uneven (torch.chunk) and the gather must drop the padding. Bounds: 1 byte (every tensor its own bucket, the bound
smaller than any tensor) and 4 KB (several per bucket); engines in fp32 and bf16.

Then an offload cycle (release the weights, restore, refit from the shards again) gives the same engine. The guard's
mutation: one rank's engine gets one bf16 ulp changed in one tensor after the refit; that rank's
guard names the tensor, the other rank's stays silent.
"""
import copy

import pytest
import torch

from specco.parallel.mesh import Mesh, spawn_local

pytestmark = pytest.mark.dist  # ~16 s on 2 cores (three launches of 2 processes)


def _worker(rank, world, bound, dtype):
    from torch.distributed.tensor import DTensor
    from specco.parallel.fsdp import apply_fsdp
    from specco.rollout.engine import RefitError, RolloutEngine
    from specco.rollout.weights import fingerprint_rows
    from specco.runner.refit import refit_engine, state_buckets
    from test_rollout_helpers import random_draft, tiny_policy
    mesh = Mesh.build(dp=world, dp_shard=world, backend="gloo")
    policy = tiny_policy(V=33, seed=5)  # the trainer's weights (the same on every rank: same seed)
    draft = random_draft(policy, seed=6)
    ref = RolloutEngine(tiny_policy(V=33, seed=3).to(dtype), random_draft(policy, seed=4).to(dtype))
    ref.refit(policy.state_dict(), draft.state_dict())  # the single-process, whole-state refit

    trainer = apply_fsdp(copy.deepcopy(policy).train(), mesh.fsdp_mesh)
    sd = trainer.state_dict()
    assert isinstance(sd["embed_tokens.weight"], DTensor) and sd["embed_tokens.weight"].to_local().shape[0] == (
        17 if rank == 0 else 16)  # uneven shards
    engine = RolloutEngine(tiny_policy(V=33, seed=3).to(dtype), random_draft(policy, seed=4).to(dtype))
    for b in state_buckets(sd, bound, engine.dtypes("policy")):  # the bound counts whole tensors, not shards
        assert len(b) == 1 or sum(v.numel() * v.element_size() for _, v in b) <= bound
    rows = refit_engine(engine, sd, draft.state_dict(), bound, guard=True)
    for name in ("policy", "draft"):
        want, got = getattr(ref, name).state_dict(), getattr(engine, name).state_dict()
        for k in want:
            assert torch.equal(got[k], want[k]), (rank, name, k)
        whole = fingerprint_rows(getattr(policy if name == "policy" else draft, "state_dict")(), ref.dtypes(name))
        assert rows[name].keys() == whole.keys() and all(torch.equal(rows[name][k], whole[k]) for k in whole)
    engine.check_fingerprints(rows["policy"], rows["draft"], step=1)
    # rollout.offload between two refits: the weights dropped, allocated again, refilled from the shards
    engine.release(weights=True, refilled=("policy", "draft"))
    engine.restore()
    rows = refit_engine(engine, sd, draft.state_dict(), bound, guard=True)
    for name in ("policy", "draft"):
        want, got = getattr(ref, name).state_dict(), getattr(engine, name).state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want), (rank, name)
    engine.check_fingerprints(rows["policy"], rows["draft"], step=1)
    if rank == 1:
        with torch.no_grad():
            w = engine.policy.layers["1"].self_attn.o_proj.weight
            w.view(-1)[3] = torch.nextafter(w.view(-1)[3], torch.tensor(1e9, dtype=w.dtype))
        with pytest.raises(RefitError, match=r"step 1.*policy weights differ.*layers.1.self_attn.o_proj"):
            engine.check_fingerprints(rows["policy"], rows["draft"], step=1)
    else:
        engine.check_fingerprints(rows["policy"], rows["draft"], step=1)


@pytest.mark.parametrize("bound,dtype", [(1, torch.bfloat16), (4096, torch.bfloat16), (4096, torch.float32)])
def test_streamed_refit_from_fsdp_shards_equals_the_whole_refit(bound, dtype):
    spawn_local(_worker, 2, bound, dtype)
