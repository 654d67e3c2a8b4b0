"""An out_dir survives crashes, interruptions and bad input (issue 16): stages commit whole, an
interrupted run re-runs to the uninterrupted result bit for bit, one run per out_dir, one config per
run, non-finite numbers stop the run naming the step, bad config values are refused up front."""
import json

import pytest
import torch

from specco.config_load import load_config
from specco.faults import SimulatedCrash, crash_at, inject
from specco.model.config import ConfigError
from cli_helpers import DEMO  # noqa: E402

TINY = ["policy.hidden_size=32", "policy.num_layers=2", "draft.aux_layer_ids=[]", "policy.num_heads=2", "policy.num_kv_heads=1",
        "policy.intermediate_size=64", "sft.steps=4", "sft.batch=8", "train.warm_start_steps=2",
        "train.warm_start_prompts=4", "train.warm_start_batch=4", "train.steps=2", "train.checkpoint_every=1",
        "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=6", "data.eval_size=2"]

pytestmark = pytest.mark.e2e


def _cfg(out, *extra):
    return load_config(DEMO, [*TINY, f"out_dir={out}", *extra])


def _fingerprint(out, arms):
    """Everything a run computes, bytes for the weights and numbers for the logs (no timings)."""
    fp = {f: (out / f).read_bytes() for f in ("start_policy/model.safetensors", "warm_draft/model.safetensors")}
    fp["warm"] = {k: v for k, v in json.loads((out / "warm_draft/warm_metrics.json").read_text()).items()
                  if "time" not in k and k != "real"}
    for arm in arms:
        rows = [json.loads(x) for x in (out / "arms" / arm / "metrics.jsonl").read_text().splitlines()]
        fp[arm] = [{k: v for k, v in r.items() if "time" not in k and "per_s" not in k} for r in rows]
        last = sorted((out / "arms" / arm / "ckpt").glob("step_*"))[-1]
        fp[arm + "/ckpt"] = (last.name, (last / "tensors.safetensors").read_bytes())
    return fp


def _prepare(out, cfg):
    """The demo's first two stages (the fast part of the demo)."""
    from specco.runner.prepare import prepare_draft, prepare_policy
    from specco.runner.validate import check_job
    data = check_job(cfg)
    policy, tok, _ = prepare_policy(cfg, data, out, "cpu", progress=False)
    prepare_draft(cfg, policy, tok, data, out, progress=False)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The two stages of an uninterrupted run, once for the module (what every interrupted run must equal)."""
    out = tmp_path_factory.mktemp("prepared")
    _prepare(out, _cfg(out))
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The fingerprint of the whole uninterrupted demo (arms none and cotrained), once for the module."""
    from specco.runner.pipeline import run as run_demo
    out = tmp_path_factory.mktemp("uninterrupted")
    _fresh_process()
    with inject(crash_at("")):
        run_demo(_cfg(out, "arms=none,cotrained"), progress=False)
    return _fingerprint(out, ("none", "cotrained"))


STAGE_POINTS = ["start_policy/model", "start_policy/tokenizer", "start_policy/written", "warm_draft/start",
                "warm_draft/draft", "warm_draft/written"]


def test_stage_points_are_every_gap(tmp_path):
    seen = []
    with inject(crash_at("", seen=seen)):
        _prepare(tmp_path, _cfg(tmp_path))
    assert [p for p in seen if not p.endswith("committed")] == STAGE_POINTS
    # the warm start's per-step curve is kept beside its summary, one line per step
    hist = [json.loads(x) for x in (tmp_path / "warm_draft/warm_history.jsonl").read_text().splitlines()]
    assert len(hist) == 2 and all("draft/loss" in h and "draft/ce_pass1" in h for h in hist)


@pytest.mark.parametrize("point", STAGE_POINTS)
def test_kill_between_files_of_a_stage_reruns_to_the_same_stage(tmp_path, point, prepared):
    """A kill between any two files of the SFT or warm-draft stage leaves no stage under its final
    name (only a .tmp_* directory the next run removes), and the re-run writes the same bytes."""
    from specco.runner.stages import remove_stale_temporaries
    b = tmp_path / "b"
    with pytest.raises(SimulatedCrash), inject(crash_at(point)):
        _prepare(b, _cfg(b))
    stage = point.split("/")[0]
    assert not (b / stage).exists()
    remove_stale_temporaries(b)
    assert not list(b.glob(".tmp_*"))
    _prepare(b, _cfg(b))
    for f in ("start_policy/model.safetensors", "start_policy/tokenizer.json", "warm_draft/model.safetensors"):
        assert (prepared / f).read_bytes() == (b / f).read_bytes(), f


def _fresh_process():
    """The global RNG states a new Python process starts with (torch's fixed default seed)."""
    import random

    import numpy as np
    torch.manual_seed(67280421310721)
    random.seed(0)
    np.random.seed(0)


@pytest.mark.slow
@pytest.mark.parametrize("point,nth", [("start_policy/tokenizer", 1), ("warm_draft/start", 1),
                                       ("warm_draft/written", 1), ("checkpoint/state", 2),
                                       ("checkpoint/renamed", 3), ("checkpoint/pointer", 4)])
def test_interrupted_demo_equals_uninterrupted_demo(tmp_path, point, nth, uninterrupted):
    """The whole demo (tiny settings), killed at a stage boundary, an RL checkpoint write or a Ctrl-C in
    the warm start, then re-run: every weight byte and logged number equals the uninterrupted demo's."""
    from specco.runner.pipeline import run as run_demo
    b = tmp_path / "b"
    for crash in (point, None):
        _fresh_process()  # the re-run is a new process: no RNG state carries over from the killed one
        with inject(crash_at(crash, nth) if crash else crash_at("")):
            try:
                run_demo(_cfg(b, "arms=none,cotrained"), progress=False)
            except SimulatedCrash:
                assert crash
            else:
                assert not crash
    assert not list(b.glob(".tmp_*")) and not list(b.glob("arms/*/ckpt/.tmp_*"))
    assert _fingerprint(b, ("none", "cotrained")) == uninterrupted


def test_unloadable_stage_names_the_directory_to_delete(tmp_path):
    from specco.runner.stages import StageError
    cfg = _cfg(tmp_path)
    _prepare(tmp_path, cfg)
    (tmp_path / "warm_draft" / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(StageError, match=f"Delete {tmp_path / 'warm_draft'}"):
        _prepare(tmp_path, cfg)


def test_metrics_log_rewrite_is_atomic(tmp_path, monkeypatch):
    """A crash while the log is rewritten on resume keeps every old row."""
    import os

    from specco.runner.report import MetricsLog, read_jsonl
    log = MetricsLog(tmp_path, tensorboard=False)
    for s in (1, 2, 3):
        log.log(s, {"reward": float(s)})

    def dies(*a):
        raise SimulatedCrash("replace")
    monkeypatch.setattr(os, "replace", dies)
    with pytest.raises(SimulatedCrash):
        MetricsLog(tmp_path, resume_step=2, tensorboard=False)
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_second_concurrent_run_is_refused(tmp_path):
    from specco.runner.pipeline import run as run_demo
    from specco.runner.stages import RunLock, RunLockedError
    with RunLock(tmp_path):
        with pytest.raises(RunLockedError, match=str(tmp_path)):
            run_demo(_cfg(tmp_path), progress=False)
    RunLock(tmp_path).release()  # released: the next run may start


def test_changed_config_is_refused_listing_keys(tmp_path):
    from specco.runner.stages import record_config
    record_config(tmp_path, _cfg(tmp_path))
    (tmp_path / "start_policy").mkdir()
    record_config(tmp_path, _cfg(tmp_path))  # the same config: a resume
    with pytest.raises(ConfigError, match=r"train.lr: 5e-05 -> 0.001.*--force-new"):
        record_config(tmp_path, _cfg(tmp_path, "train.lr=1e-3"))
    # train.steps (and how often it evaluates, saves, checkpoints) may change: the run extends, recorded anew
    record_config(tmp_path, _cfg(tmp_path, "train.steps=4", "train.save_every=2"))
    assert (tmp_path / "start_policy").exists()
    assert json.loads((tmp_path / "config.json").read_text())["train"]["steps"] == 4
    record_config(tmp_path, _cfg(tmp_path, "train.steps=3"), force_new=True)
    assert not (tmp_path / "start_policy").exists()
    assert json.loads((tmp_path / "config.json").read_text())["train"]["steps"] == 3
    # --force-new with the same config starts over too (it used to resume: found re-running a CPU rehearsal)
    (tmp_path / "start_policy").mkdir()
    (tmp_path / "arms").mkdir()
    record_config(tmp_path, _cfg(tmp_path, "train.steps=3"), force_new=True)
    assert not (tmp_path / "start_policy").exists() and not (tmp_path / "arms").exists()


def test_a_key_added_since_the_run_started_resumes_at_its_default(tmp_path):
    """An out_dir written before specco had a key (its config.json lacks it) resumes when the new config has
    that key's default, and is refused when it does not."""
    from specco.runner.stages import record_config
    record_config(tmp_path, _cfg(tmp_path))
    f = tmp_path / "config.json"
    old = json.loads(f.read_text())
    del old["rollout"]["block_k"]
    f.write_text(json.dumps(old))
    record_config(tmp_path, _cfg(tmp_path))  # block_k = 0, the default: the same run
    with pytest.raises(ConfigError, match=r"rollout.block_k: 0 -> 5"):
        record_config(tmp_path, _cfg(tmp_path, "rollout.block_k=5"))


@pytest.mark.parametrize("override,match", [
    ("train.lr=inf", "train.lr=inf"), ("train.draft_lr=nan", "train.draft_lr=nan"),
    ("train.policy_grad_clip=-1", "train.policy_grad_clip=-1"), ("train.draft_grad_clip=0", "draft_grad_clip"),
    ("train.checkpoint_every=0", "train.checkpoint_every=0"), ("policy.num_heads=0", "policy.num_heads=0"),
    ("draft.aux_layer_ids=0,5", r"\[5\] out of range"), ("rollout.temperature=inf", "rollout.temperature"),
    ("train.on_nonfinite=ignore", "on_nonfinite"), ("rollout.cache_runners=-1", "cache_runners")])
def test_bad_values_are_named_before_any_stage(tmp_path, override, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(tmp_path, override)


def test_one_token_cp_pack_is_refused():
    from specco.runner.cotrain_cp import run_cotrain_step_cp
    with pytest.raises(ConfigError, match="seq-lens 1.*>= 2 tokens"):
        run_cotrain_step_cp(load_config(DEMO, []), seq_lens=(1,))


def _nan_on_step(monkeypatch, bad_call: int):
    """The co-training step's second call returns a NaN grad norm and leaves NaN weights behind."""
    import specco.runner.trainer as trainer
    real, calls = trainer.cotrain_step, [0]

    def step(policy, *a, **k):
        m = real(policy, *a, **k)
        calls[0] += 1
        if calls[0] == bad_call:
            with torch.no_grad():
                next(policy.parameters()).fill_(float("nan"))
            m["policy/grad_norm"] = float("nan")
        return m
    monkeypatch.setattr(trainer, "cotrain_step", step)


def test_nonfinite_stops_naming_step_and_quantity(tmp_path, monkeypatch):
    from test_grpo import DigitTask, _setup

    from specco.runner.rl import run_arm
    from specco.train.nonfinite import NonFiniteError
    tok, policy = _setup()
    _nan_on_step(monkeypatch, 2)
    with pytest.raises(NonFiniteError, match="RL step 2 of arm none.*policy/grad_norm = nan"):
        run_arm(_cfg(tmp_path, "train.steps=3"), "none", policy, None, DigitTask(), tok, tmp_path, progress=False)


def test_nonfinite_skip_drops_the_update(tmp_path, monkeypatch):
    from test_grpo import DigitTask, _setup

    from specco.runner.rl import run_arm
    tok, policy = _setup()
    _nan_on_step(monkeypatch, 2)
    out = {}
    rows = run_arm(_cfg(tmp_path, "train.steps=3", "train.on_nonfinite=skip"), "none", policy, None, DigitTask(),
                   tok, tmp_path, progress=False, state_out=out)
    assert [r["nonfinite_skipped"] for r in rows] == [0, 1, 0]
    assert all(bool(p.isfinite().all()) for p in out["state"].policy.parameters())


def test_cli_refuses_a_changed_config_with_status_2(tmp_path, capsys):
    from specco.cli import main
    from specco.runner.stages import record_config
    out = tmp_path / "run"
    record_config(out, load_config(DEMO, [*TINY, f"out_dir={out}"]))
    with pytest.raises(SystemExit) as e:
        main(["demo", "--quiet", "--out", str(out), *TINY, "rollout.k=2"])
    assert e.value.code == 2 and "rollout.k: 3 -> 2" in capsys.readouterr().err


def test_evaluation_decodes_on_the_engines_copy_after_its_runners_are_dropped(tmp_path, monkeypatch):
    """Evaluations run on the policy as sampled (the engine's bf16 copy under rollout.dtype, refit after every
    step) and only once the arm's engine has given back its KV caches and graphs: at 32K tokens an evaluation
    engine on the fp32 masters beside the arm's live one ran an 80 GB GPU out of memory (2026-12-07). The step
    after a mid-run evaluation builds its runner again."""
    from specco.runner import pipeline
    real, seen = pipeline.Outputs.evaluate, []

    def evaluate(self, st, policy, draft):
        seen.append((st.step, policy is st.engine.policy, draft is st.engine.draft,
                     next(policy.parameters()).dtype, len(st.engine._runners)))
        real(self, st, policy, draft)
    monkeypatch.setattr(pipeline.Outputs, "evaluate", evaluate)
    out = tmp_path / "run"
    pipeline.run(_cfg(out, "arms=cotrained", "rollout.dtype=bfloat16", "train.eval_every=1"), progress=False)
    assert seen == [(s, True, True, torch.bfloat16, 0) for s in (0, 1, 2)]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["tau"] >= 1 for r in rows)
    evals = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 1, 2]
