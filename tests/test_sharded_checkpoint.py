"""Sharded checkpoints (train/sharded_checkpoint.py): saved at one FSDP layout, resumed at another, the
continuation equals the uninterrupted run; no read runs code; damage is named; a crashed write is invisible.

Reference: the single-process co-training step (test_fsdp's fp64 EAGLE-3 models and batches), two AdamW steps.
Saved: the same first step at dp_shard 2 (2 gloo processes, the policy FSDP-sharded, the draft replicated), then
`save`. Resumed: FRESH models whose every parameter was overwritten with a constant (so a load that silently
skipped a tensor fails the comparison), sharded at dp_shard 4 (4 processes) or left whole (one process, no
process group), the optimizer built over them, `load`, the second step. Compared: every parameter and both AdamW
moments (and the step counters) of every parameter, gathered whole, against the reference after its second step.

Tolerance: rtol 1e-9, atol 1e-12, test_fsdp's: a checkpoint round trip is bit-exact (safetensors stores the fp64
bytes), so the only differences are the sharded steps' summation orders (reduce-scatter vs one autograd
accumulation, per-shard partial norms). Measured (`pytest -s` prints them): parameters 7.4e-16 absolute at
both dp_shard 4 and one process (weights of O(1): a few ulps), AdamW moments 2.2e-18 / 1.3e-18 absolute.
"""
import json
import pickle

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from specco.faults import SimulatedCrash, crash_at, inject
from specco.parallel.fsdp import apply_fsdp
from specco.parallel.mesh import Mesh, spawn_local
from specco.train.checkpoint import CheckpointError, latest_checkpoint
from specco.train.cotrain import StepConfig, build_optimizer, cotrain_step
from specco.train.grad_sync import grad_syncs
from specco.train.sharded_checkpoint import PickleRefused, load, load_latest, save

pytestmark = pytest.mark.dist

TOL = dict(rtol=1e-9, atol=1e-12)
CFG = StepConfig(ttt_passes=3, loss_chunk=5, draft_row_stride=2, micro_batch_rows=2)


def _setup(mesh=None, scramble=False):
    """test_fsdp's fp64 EAGLE-3 policy and draft (sharded over `mesh.fsdp_mesh` if given) and their AdamW."""
    from test_fsdp import LR, DRAFT_LR, _models
    policy, draft = _models("eagle3")
    if scramble:  # what a resume must overwrite: any tensor it misses shows in the comparison
        with torch.no_grad():
            for p in [*policy.parameters(), *draft.parameters()]:
                p.fill_(0.25)
    if mesh is not None:
        apply_fsdp(policy, mesh.fsdp_mesh)
    return policy, draft, build_optimizer(policy, draft, LR, DRAFT_LR)


def _step(policy, draft, opt, seed, mesh=None):
    """One co-training step on batch `seed`: the whole batch, or this rank's rows of it."""
    from test_fsdp import B, _dp_batch
    batch = _dp_batch(seed)
    if mesh is None:
        return cotrain_step(policy, draft, batch, opt, None, CFG)
    h = B // mesh.dp
    return cotrain_step(policy, draft, batch.rows(mesh.dp_rank * h, (mesh.dp_rank + 1) * h), opt, None, CFG,
                        grad_group=mesh.grad_group, grad_sync=grad_syncs(policy, mesh.grad_group))


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _snapshot(policy, draft, opt) -> dict:
    """Every parameter and its AdamW state, whole, by name."""
    out = {}
    for tag, mod in (("policy", policy), ("draft", draft)):
        for n, p in mod.named_parameters():
            out[f"{tag}.{n}"] = _full(p.detach()).clone()
            for k, v in opt.state[p].items():
                out[f"{tag}.{n}/{k}"] = _full(v).clone()
    return out


def _reference() -> dict:
    policy, draft, opt = _setup()
    _step(policy, draft, opt, 7)
    _step(policy, draft, opt, 8)
    return _snapshot(policy, draft, opt)


def _compare(got: dict, ref: dict, label: str):
    assert got.keys() == ref.keys()
    dev = {"param": 0.0, "moment": 0.0}
    for n in ref:
        d = (got[n].double() - ref[n].double()).abs().max().item()
        kind = "param" if "/" not in n else "moment"
        dev[kind] = max(dev[kind], d)
        torch.testing.assert_close(got[n], ref[n], **TOL, msg=lambda s: f"{label} {n}: {s}")
    print(f"{label}: max abs deviation", {k: f"{v:.1e}" for k, v in dev.items()})


def _save_worker(rank, world, root):
    mesh = Mesh.build(dp=world, dp_shard=world, backend="gloo")
    policy, draft, opt = _setup(mesh)
    _step(policy, draft, opt, 7, mesh)
    save(root, 1, {"policy": policy, "draft": draft, "opt": opt, "data_offset": 7, "betas": (0.9, 0.95)})


def _resume_worker(rank, world, root):
    mesh = Mesh.build(dp=world, dp_shard=world, backend="gloo")
    policy, draft, opt = _setup(mesh, scramble=True)
    path, extra = load_latest(root, {"policy": policy, "draft": draft, "opt": opt})
    assert path.name == "step_000001" and extra == {"data_offset": 7, "betas": (0.9, 0.95)}
    _step(policy, draft, opt, 8, mesh)
    got = _snapshot(policy, draft, opt)  # full_tensor(): collective
    if rank == 0:
        _compare(got, _reference(), f"resumed at dp_shard {world}")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One checkpoint after step 1 at dp_shard 2 (2 processes), shared by the tests that only read it."""
    root = tmp_path_factory.mktemp("sharded") / "ckpt"
    spawn_local(_save_worker, 2, str(root))
    return root


def test_saved_files_are_shards_and_json(saved):
    ck = latest_checkpoint(saved)
    shards = sorted(p.name for p in (ck / "shards").iterdir())
    assert all(s.endswith(".safetensors") for s in shards) and len(shards) == 2  # one per rank, no .metadata
    meta = json.loads((ck / "state.json").read_text())
    assert sorted(meta["files"]) == shards
    # the policy's sharded weights are stored with their GLOBAL shape (61-row embedding: uneven 31/30 chunks)
    assert meta["tensors"]["model.policy.embed_tokens.weight"]["shape"][0] == 61


def test_resume_at_dp_shard_4_equals_uninterrupted(saved):
    spawn_local(_resume_worker, 4, str(saved))


def test_resume_on_one_process_equals_uninterrupted(saved, monkeypatch):
    policy, draft, opt = _setup(scramble=True)

    def refuse(*a, **k):
        raise AssertionError("a checkpoint read unpickled something")
    for name in ("load", "loads", "Unpickler"):  # the whole read path: no pickle, no torch.load
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    extra = load(latest_checkpoint(saved), {"policy": policy, "draft": draft, "opt": opt})
    monkeypatch.undo()
    assert extra["data_offset"] == 7
    _step(policy, draft, opt, 8)
    _compare(_snapshot(policy, draft, opt), _reference(), "resumed on one process")


class _Evil:
    """A pickle that creates a file when unpickled (a stand-in for os.system)."""
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("where", ["shards/.metadata", "state.json", "shards/extra.safetensors", "shard"])
def test_planted_pickle_runs_no_code(saved, tmp_path, where):
    """DCP's default `.metadata` (a pickle) planted beside the shards, a pickle in place of state.json or of a
    shard, or as an extra file: refused by name, the pickle never unpickled."""
    import shutil
    ck = tmp_path / "ckpt" / "step_000001"
    shutil.copytree(latest_checkpoint(saved), ck)
    marker = tmp_path / "pwned"
    evil = pickle.dumps({"meta": _Evil(str(marker))})
    target = next((ck / "shards").iterdir()) if where == "shard" else ck / where
    target.write_bytes(evil)
    if where == "shard":  # same size as listed: only the reader's header check stands in the way
        meta = json.loads((ck / "state.json").read_text())
        meta["files"][target.name] = len(evil)
        (ck / "state.json").write_text(json.dumps(meta))
    policy, draft, opt = _setup()
    with pytest.raises(CheckpointError) as e:
        load(ck, {"policy": policy, "draft": draft, "opt": opt})
    assert str(target if where != "shard" else ck) in str(e.value), e.value
    if where == "shards/.metadata":  # a planted pickle is refused outright, not skipped for an older checkpoint
        with pytest.raises(PickleRefused):
            load_latest(tmp_path / "ckpt", {"policy": policy, "draft": draft, "opt": opt}, say=lambda m: None)
    assert not marker.exists()


def test_missing_shard_is_named(saved, tmp_path):
    import shutil
    ck = tmp_path / "step_000001"
    shutil.copytree(latest_checkpoint(saved), ck)
    gone = sorted((ck / "shards").iterdir())[1]
    gone.unlink()
    policy, draft, opt = _setup()
    with pytest.raises(CheckpointError, match=f"{gone}.*missing"):
        load(ck, {"policy": policy, "draft": draft, "opt": opt})


@pytest.mark.parametrize("edit", ["files", "extra", "param_groups", "tensor"])
def test_wrong_type_in_state_json_names_the_file(saved, tmp_path, edit):
    import shutil
    ck = tmp_path / "step_000001"
    shutil.copytree(latest_checkpoint(saved), ck)
    meta = json.loads((ck / "state.json").read_text())
    if edit == "files":
        meta["files"] = ["a", "b"]
    elif edit == "extra":
        meta["extra"]["betas"] = {"__tuple__": 5}
    elif edit == "param_groups":
        meta["optimizers"]["opt"]["param_groups"] = 3
    else:
        meta["tensors"]["model.draft.fc.weight"] = {"shape": "big", "dtype": "float64"}
    (ck / "state.json").write_text(json.dumps(meta))
    policy, draft, opt = _setup()
    with pytest.raises(CheckpointError, match=str(ck / "state.json")):
        load(ck, {"policy": policy, "draft": draft, "opt": opt})


def _crash_worker(rank, world, root, target):
    """Step 1 saved; step 2's save crashes (every rank, at `target`); the next reader resumes step 1."""
    mesh = Mesh.build(dp=world, dp_shard=world, backend="gloo")
    policy, draft, opt = _setup(mesh)
    _step(policy, draft, opt, 7, mesh)
    save(root, 1, {"policy": policy, "draft": draft, "opt": opt, "step": 1})
    _step(policy, draft, opt, 8, mesh)
    try:
        with inject(crash_at(target)):
            save(root, 2, {"policy": policy, "draft": draft, "opt": opt, "step": 2})
        crashed = False
    except SimulatedCrash:
        crashed = True
        # the points after the shards are rank 0's (it alone writes state.json and renames); its barrier here
        # meets the other ranks' closing barrier of `save`, as a restarted job's would
        dist.barrier()
    assert crashed == (rank == 0 or target == "sharded_checkpoint/shards")
    p2, d2, o2 = _setup(mesh, scramble=True)
    path, extra = load_latest(root, {"policy": p2, "draft": d2, "opt": o2})
    want = 2 if target == "sharded_checkpoint/renamed" else 1  # renamed: complete, only the pointer is stale
    assert path.name == f"step_{want:06d}" and extra == {"step": want}


@pytest.mark.parametrize("target", ["sharded_checkpoint/shards", "sharded_checkpoint/state",
                                    "sharded_checkpoint/renamed"])
def test_crash_mid_write_leaves_previous_loadable(tmp_path, target):
    spawn_local(_crash_worker, 2, str(tmp_path / "ckpt"), target)


def _unshared_worker(rank, world, tmp):
    """Each rank's `root` is its own directory: two nodes without a shared filesystem."""
    model = torch.nn.Linear(3, 2)
    with pytest.raises(CheckpointError, match=r"not one directory for every rank: rank\(s\) \[1\]"):
        save(f"{tmp}/node{rank}/ckpt", 1, {"model": model, "step": 1})


def test_root_not_shared_is_named(tmp_path):
    """Every rank (not only the blind one) stops with the error, before DCP's collectives could hang."""
    spawn_local(_unshared_worker, 2, str(tmp_path))
