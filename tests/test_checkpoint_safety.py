"""Checkpoints cannot run code, cannot be pointed outside their directory, and a damaged newest one
falls back to the previous intact one (issue 16). Every refusal names the file."""
import errno
import json
import os
import pickle

import pytest
import torch

from specco.train.checkpoint import (CheckpointError, latest_checkpoint, load_checkpoint, load_latest,
                                     save_checkpoint)


class _Evil:
    """A pickle that creates a file when unpickled (a stand-in for os.system)."""
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _state(step=1, scale=1.0):
    g = torch.Generator().manual_seed(step)
    return {"policy": {"w": torch.full((3, 2), scale), "b": torch.arange(4)}, "gen": g, "step": step,
            "opt": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2)}},
                    "param_groups": [{"lr": 0.1 / 3, "betas": (0.9, 0.999), "params": [0]}]},
            "arm": "none", "data_offset": 7, "none": None}


def test_round_trip_is_exact(tmp_path):
    import random
    st = _state()
    save_checkpoint(tmp_path, 1, st)
    before = (torch.rand(3), random.random())
    ck = latest_checkpoint(tmp_path)
    assert sorted(os.listdir(ck)) == ["state.json", "tensors.safetensors"]  # no pickle anywhere
    g = torch.Generator()
    s = load_checkpoint(ck, generators={"gen": g})
    assert torch.equal(torch.rand(3), before[0]) and random.random() == before[1]  # RNG restored
    assert torch.equal(torch.rand(4, generator=g), torch.rand(4, generator=_state()["gen"]))
    assert s["opt"]["state"][0]["step"].item() == 3.0 and s["opt"]["param_groups"][0]["lr"] == 0.1 / 3
    assert s["opt"]["param_groups"][0]["betas"] == (0.9, 0.999) and s["none"] is None
    assert torch.equal(s["policy"]["b"], torch.arange(4)) and s["data_offset"] == 7


def test_crafted_pickle_never_runs_and_is_refused_by_name(tmp_path):
    marker = tmp_path / "pwned"
    ck = tmp_path / "ckpt" / "step_000002"
    ck.mkdir(parents=True)
    (ck / "state.pt").write_bytes(pickle.dumps({"step": _Evil(str(marker))}))
    (tmp_path / "ckpt" / "latest").write_text("step_000002\n")
    with pytest.raises(CheckpointError, match="state.pt.*pickle"):
        load_latest(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="state.pt"):
        load_checkpoint(ck)
    assert not marker.exists()


@pytest.mark.parametrize("target", ["../../evil", "/tmp/evil", "step_000001/../../evil", "notastep"])
def test_pointer_outside_the_checkpoint_directory_is_refused(tmp_path, target):
    evil = tmp_path / "evil"
    evil.mkdir()
    save_checkpoint(evil, 1, _state())  # a loadable checkpoint outside the run
    root = tmp_path / "a" / "b" / "ckpt"
    save_checkpoint(root, 1, _state())
    (root / "latest").write_text(target + "\n")
    with pytest.raises(CheckpointError, match="latest"):
        load_latest(root)


def test_truncated_newest_falls_back_to_previous(tmp_path):
    save_checkpoint(tmp_path, 1, _state(1, 1.0))
    save_checkpoint(tmp_path, 2, _state(2, 2.0))
    f = tmp_path / "step_000002" / "tensors.safetensors"
    f.write_bytes(f.read_bytes()[:len(f.read_bytes()) // 2])
    said = []
    path, s = load_latest(tmp_path, say=said.append)
    assert path.name == "step_000001" and s["step"] == 1
    assert str(f) in said[0] and "previous intact" in said[1]


@pytest.mark.parametrize("damage", ["header", "nan", "missing_key", "json", "no_tensors"])
def test_damaged_checkpoint_errors_name_the_file(tmp_path, damage):
    ck = save_checkpoint(tmp_path, 1, _state())
    f, j = ck / "tensors.safetensors", ck / "state.json"
    if damage == "header":
        f.write_bytes(b"\xff" * 8 + f.read_bytes()[8:])
    elif damage == "nan":
        from safetensors.torch import load_file, save_file
        t = load_file(str(f))
        t["policy.w"][0, 0] = float("nan")
        save_file(t, str(f))
    elif damage == "missing_key":
        meta = json.loads(j.read_text())
        meta["state"]["policy"]["w"] = {"__tensor__": "nope"}
        j.write_text(json.dumps(meta))
    elif damage == "json":
        j.write_text(j.read_text()[:20])
    else:
        f.unlink()
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(ck)
    assert str(ck) in str(e.value)
    with pytest.raises(CheckpointError, match="no intact checkpoint"):  # nothing older to fall back to
        load_latest(tmp_path, say=lambda m: None)


@pytest.mark.parametrize("edit", ["tuple", "tensor_key", "dict_pairs", "rng", "generator"])
def test_wrong_type_in_state_json_names_the_file(tmp_path, edit):
    """Valid JSON with a value of the wrong type raised a bare TypeError naming nothing (issue 34 item 7)."""
    ck = save_checkpoint(tmp_path, 1, _state())
    j = ck / "state.json"
    meta = json.loads(j.read_text())
    if edit == "tuple":
        meta["state"]["opt"]["param_groups"][0]["betas"] = {"__tuple__": 5}
    elif edit == "tensor_key":
        meta["state"]["policy"]["w"] = {"__tensor__": ["policy.w"]}  # a list: unhashable
    elif edit == "dict_pairs":
        meta["state"]["opt"]["state"] = {"__dict__": 3}
    elif edit == "rng":
        meta["rng"]["python"] = "not a state"
    else:
        meta["state"]["gen"] = {"__tensor__": "policy.w"}  # a float tensor where a generator state belongs
    j.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=str(j)):
        load_checkpoint(ck, generators={"gen": torch.Generator()})


def test_full_disk_says_so_and_leaves_no_temporary(tmp_path, monkeypatch):
    import safetensors.torch

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(CheckpointError, match="no space left"):
        save_checkpoint(tmp_path, 1, _state())
    assert os.listdir(tmp_path) == []


@pytest.mark.e2e
def test_rl_loop_resumes_from_previous_checkpoint_when_newest_is_truncated(tmp_path, capsys):
    """A 6-step arm killed after step 4 whose step-4 checkpoint is then truncated resumes from step 2,
    saying so, and ends where the uninterrupted run ends."""
    from test_grpo import DigitTask, _cfg, _setup

    from specco.runner.rl import run_arm
    tok, policy = _setup()
    cfg = _cfg(tmp_path, "train.steps=6")
    straight = run_arm(cfg, "none", policy, None, DigitTask(), tok, tmp_path / "a", progress=False)
    run_arm(cfg, "none", policy, None, DigitTask(), tok, tmp_path / "b", progress=False, stop_after=4)
    f = tmp_path / "b" / "ckpt" / "step_000004" / "tensors.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    rest = run_arm(cfg, "none", policy, None, DigitTask(), tok, tmp_path / "b", progress=False)
    err = capsys.readouterr().err
    assert "previous intact checkpoint" in err and str(f) in err
    assert [r["step"] for r in rest] == [3, 4, 5, 6]
    assert [r["reward"] for r in rest] == [r["reward"] for r in straight[2:]]
    a = load_checkpoint(latest_checkpoint(tmp_path / "a" / "ckpt"), restore_rng=False)
    b = load_checkpoint(latest_checkpoint(tmp_path / "b" / "ckpt"), restore_rng=False)
    assert all(torch.equal(a["policy"][k], b["policy"][k]) for k in a["policy"])
