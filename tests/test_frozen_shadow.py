"""The frozen shadow (config `frozen_shadow`): a co-trained arm scores its own draft and a frozen copy of its warm
draft on every step's rollouts, under the policy that sampled them.

* the arm's trajectory is the one it has without the shadow (the evaluation runs under no_grad and draws nothing);
* at step 1 both drafts are the warm draft, so the two scores are equal, and equal to `draft_eval` of the warm
  draft on the recorded rollouts under the starting policy (recomputed here); after an update they part;
* a resumed arm's shadow is still the warm draft (the checkpoint restores only the trained copy);
* the report's table is the stated arithmetic; the field's refusals.
"""
import dataclasses

import pytest
import torch

from specco.config_load import load_config
from specco.model.config import ConfigError
from specco.runner.derive import step_config
from specco.runner.report import shadow_position_table, shadow_table
from specco.runner.measure import draft_eval
from specco.runner.rl import run_arm
from specco.runner.rollouts import minibatches
from specco.runner.warmstart import new_block_draft, new_draft
from test_grpo import DigitTask, _cfg, _setup
from cli_helpers import DEMO  # noqa: E402

TRAINED = ("reward", "completion_len", "policy/loss", "draft/loss", "policy/grad_norm", "draft/grad_norm")

pytestmark = pytest.mark.e2e


def _warm(kind, policy, tok):
    tokens = torch.randint(0, tok.vocab_size, (4, 8))
    if kind == "eagle3":
        return new_draft(policy, tokens, aux_layer_ids=(0, 1))
    return new_block_draft(policy, tokens, kind, gamma=2, aux_layer_ids=(0, 1))


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_shadow_scores_both_drafts_without_changing_the_trajectory(tmp_path, kind):
    tok, policy = _setup()
    warm = _warm(kind, policy, tok)
    arm = "cotrained" if kind == "eagle3" else f"cotrained-{kind}"
    common = ("train.steps=3", "rollout.max_new_tokens=8", "train.draft_lr=1e-2", f"arms=[{arm}]")
    rows, record = {}, []
    for name, extra in (("with", (f"frozen_shadow=[{arm}]",)), ("without", ())):
        cfg = _cfg(tmp_path, *common, *extra)
        rows[name] = run_arm(cfg, arm, policy, warm, DigitTask(), tok, tmp_path / name, progress=False,
                             record=record if name == "with" else None)
    for a, b in zip(rows["with"], rows["without"]):
        for key in TRAINED:
            assert a[key] == b[key], (a["step"], key)
        assert not any(k.startswith("shadow/") for k in b) and a["time/shadow"] > 0
    first, later = rows["with"][0], rows["with"][1:]
    sim = "shadow/{}/sim_accept_len"
    keys = [k.partition("/frozen/")[2] for k in first if k.startswith("shadow/frozen/")]
    assert "sim_accept_len" in keys and "loss" in keys
    for k in keys:  # step 1: both are the warm draft
        assert first[f"shadow/cotrained/{k}"] == first[f"shadow/frozen/{k}"], k
    # ... scored as draft_eval scores it, on the step's rollouts under the starting policy
    cfg = _cfg(tmp_path, *common, f"frozen_shadow=[{arm}]")
    from specco.runner.derive import arm_config
    acfg, mode = arm_config(cfg, arm)
    scfg = step_config(acfg, mode)
    whole = minibatches(record[0], 1, scfg, tok.pad_id, "cpu", None)[0]
    ref = draft_eval(policy, warm, whole.batch, scfg, None, whole.layout)
    assert first[sim.format("frozen")] == pytest.approx(ref["draft/sim_accept_len"], rel=1e-6)
    assert first["shadow/frozen/loss"] == pytest.approx(ref["draft/loss"], rel=1e-6)
    # after the first update the co-trained draft is another draft (a high draft LR: it moves visibly)
    assert all(r["shadow/cotrained/loss"] != r["shadow/frozen/loss"] for r in later)


def test_resumed_arm_keeps_the_warm_draft_as_its_shadow(tmp_path):
    """A crash after step 2 and a resume: step 3's shadow scores equal the uninterrupted run's (the shadow is the
    warm draft again, the co-trained copy comes back from the checkpoint)."""
    tok, policy = _setup()
    warm = _warm("eagle3", policy, tok)
    cfg = _cfg(tmp_path, "train.steps=3", "rollout.max_new_tokens=8", "train.draft_lr=1e-2",
               "frozen_shadow=[cotrained]", "train.checkpoint_every=1")
    whole = run_arm(cfg, "cotrained", policy, warm, DigitTask(), tok, tmp_path / "a", progress=False)
    run_arm(cfg, "cotrained", policy, warm, DigitTask(), tok, tmp_path / "b", progress=False, stop_after=2)
    resumed = run_arm(cfg, "cotrained", policy, warm, DigitTask(), tok, tmp_path / "b", progress=False)
    for k in ("shadow/frozen/sim_accept_len", "shadow/frozen/loss", "shadow/cotrained/loss"):
        assert resumed[-1][k] == whole[-1][k], k


def test_shadow_table_arithmetic():
    def row(co, fr):
        return {"shadow/cotrained/sim_accept_len": co, "shadow/frozen/sim_accept_len": fr}
    rows = {"cotrained": [row(3.0, 3.0), row(3.2, 3.0), row(3.3, 2.9), row(3.6, 2.4)], "frozen": [{"tau": 2.0}]}
    _, got = shadow_table(rows)
    assert set(got) == {"cotrained"}
    c = got["cotrained"]  # 4 steps: the first 25% is step 1, the last 25% step 4
    assert c["steps"] == 4 and c["co-trained sim tau (first 25%)"] == 3.0 and c["frozen sim tau (last 25%)"] == 2.4
    assert c["co-trained / frozen (last 25%)"] == pytest.approx(3.6 / 2.4)
    assert c["co-trained last / first"] == pytest.approx(3.6 / 3.0)
    assert shadow_table({"none": [{"tau": 1.0}]}) is None


def test_frozen_shadow_refusals(tmp_path):
    ok = _cfg(tmp_path, "arms=[none,frozen,cotrained-dflash]", "frozen_shadow=[cotrained-dflash]")
    assert ok.measures_shadow("cotrained-dflash") and not ok.measures_shadow("frozen")
    for overrides, match in ((["arms=[none,cotrained]", "frozen_shadow=[cotrained-dflash]"], "not one of arms"),
                             (["arms=[frozen]", "frozen_shadow=[frozen]"], "no draft in training"),
                             (["arms=[cotrained]", "frozen_shadow=[cotrained]", "parallel.pp=2"], "pp = 1")):
        with pytest.raises(ConfigError, match=match):
            load_config(DEMO, [f"out_dir={tmp_path}", *overrides])


def test_committed_long_eagle3_config_is_the_ninth_runs():
    """configs/long_eagle3.toml is configs/long_ab.toml with the ninth H200 run's overrides (bench/results/
    long_rl_shadow_2026-12-02/NOTES.md), out_dir aside."""
    from specco.config_load import config_to_dict
    mine = config_to_dict(load_config("configs/long_eagle3.toml"))
    ran = config_to_dict(load_config("configs/long_ab.toml", ["arms=[cotrained]", "plain_baseline=[cotrained]",
                                                             "frozen_shadow=[cotrained]", "train.draft_row_stride=8",
                                                             "train.steps=7"]))
    assert mine.pop("out_dir") == "runs/long_eagle3" and ran.pop("out_dir") == "runs/long_ab"
    assert mine == ran


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_output_windows_score_the_tokens_at_those_positions(tmp_path, kind):
    """config shadow_window: the shadow's per-window scores are draft_eval on the batch whose targets are the
    completion tokens at those output positions (cut here row by row, independently of measure.output_windows);
    for EAGLE-3 the windows' pass-1 targets partition the whole batch's; one window as long as the longest
    completion is the whole batch, bit for bit. In a run (3 steps) the keys are logged every step, the
    trajectory is unchanged (the first test's TRAINED keys), and the report's table reads them."""
    from specco.runner.derive import arm_config
    from specco.runner.measure import draft_evals, output_windows
    tok, policy = _setup()
    warm = _warm(kind, policy, tok)
    arm = "cotrained" if kind == "eagle3" else f"cotrained-{kind}"
    common = ("train.steps=3", "rollout.max_new_tokens=8", "train.draft_lr=1e-2", f"arms=[{arm}]",
              f"frozen_shadow=[{arm}]", "train.draft_row_stride=1")
    record = []
    plain = run_arm(_cfg(tmp_path, *common), arm, policy, warm, DigitTask(), tok, tmp_path / "a", progress=False)
    rows = run_arm(_cfg(tmp_path, *common, "shadow_window=3"), arm, policy, warm, DigitTask(), tok, tmp_path / "b",
                   progress=False, record=record)
    for a, b in zip(rows, plain):
        assert all(a[k] == b[k] for k in TRAINED) and a["shadow/frozen/sim_accept_len"] == b["shadow/frozen/sim_accept_len"]
        assert {"shadow/frozen/sim_accept_len@0", "shadow/cotrained/sim_accept_len@3"} <= set(a)
    acfg, mode = arm_config(_cfg(tmp_path, *common), arm)
    scfg = step_config(acfg, mode)
    whole = minibatches(record[0], 1, scfg, tok.pad_id, "cpu", None)[0].batch
    longest = int(whole.target_mask.sum(-1).max())
    got = draft_evals(policy, {"w": warm}, whole, scfg, window=3)["w"]
    windows = output_windows(whole, 3)
    assert [w for w, _ in windows] == list(range(0, longest, 3))
    for start in range(0, longest, 3):
        cut = whole.target_mask.clone()
        for r in range(cut.shape[0]):  # the row's completion tokens, counted from its first
            idx = cut[r].nonzero().flatten().tolist()
            for j, col in enumerate(idx):
                if not start <= j < start + 3:
                    cut[r, col] = 0
        ref = draft_eval(policy, warm, dataclasses.replace(whole, target_mask=cut), scfg)
        # the window's first trained column, where EAGLE-3's passes start (TrainBatch.trained_from)
        assert windows[start // 3][1].trained_from == int(cut.nonzero()[:, 1].min()) > 0
        assert got[f"draft/sim_accept_len@{start}"] == pytest.approx(ref["draft/sim_accept_len"], rel=1e-6), start
        assert got[f"draft/tokens@{start}"] == ref["draft/tokens"]
    if kind == "eagle3":  # pass-1 targets: each completion token (but the first two of a row) in one window
        assert sum(got[f"draft/tokens@{s}"] for s in range(0, longest, 3)) == got["draft/tokens"]
    one = draft_evals(policy, {"w": warm}, whole, scfg, window=longest)["w"]
    assert one["draft/sim_accept_len@0"] == one["draft/sim_accept_len"] == got["draft/sim_accept_len"]
    table, vals = shadow_position_table({arm: rows})
    last = rows[-1]  # 3 steps: the last 25% is the last step
    assert vals[arm][3]["frozen sim tau (last 25%)"] == last["shadow/frozen/sim_accept_len@3"]
    assert vals[arm][3]["co-trained / frozen"] == pytest.approx(
        last["shadow/cotrained/sim_accept_len@3"] / last["shadow/frozen/sim_accept_len@3"])
    assert "output position from" in table


def test_shadow_window_refusals():
    with pytest.raises(ConfigError, match="without frozen_shadow"):
        load_config(DEMO, ["shadow_window=64"])
    with pytest.raises(ConfigError, match="with parallel.cp=2: not implemented"):
        load_config(DEMO, ["shadow_window=64", "frozen_shadow=[cotrained]", "parallel.cp=2"])


def test_an_arm_without_a_shadow_sees_no_window():
    """shadow_window windows the frozen shadow: an arm that has none (no draft, frozen) sees 0, so a run with a
    no-draft arm beside shadowed ones starts every arm (it was refused at the no-draft arm's start, after SFT and
    the warm starts: the 32K DFlash run's command, checked on CPU 2026-12-07)."""
    from specco.runner.derive import arm_config
    cfg = load_config(DEMO, ["arms=[none,frozen,cotrained]", "frozen_shadow=[cotrained]", "shadow_window=64"])
    assert arm_config(cfg, "none")[0].shadow_window == 0
    assert arm_config(cfg, "frozen")[0].shadow_window == 0
    co = arm_config(cfg, "cotrained")[0]
    assert co.shadow_window == 64 and co.frozen_shadow == ("cotrained",)
    assert arm_config(co, "cotrained")[0] == co  # an arm config is a fixed point


def test_an_arms_config_error_stops_the_run_before_any_stage(tmp_path, monkeypatch):
    """check_job derives every arm's config before anything runs: an error there names itself before the SFT."""
    from specco.runner import derive, validate

    def refuse(cfg, arm):
        raise ConfigError(f"arm {arm}: refused")
    monkeypatch.setattr(derive, "arm_config", refuse)
    with pytest.raises(ConfigError, match="arm none: refused"):
        validate.check_job(load_config(DEMO, ["arms=[none,cotrained]", f"out_dir={tmp_path / 'run'}"]))
    assert not (tmp_path / "run").exists()
