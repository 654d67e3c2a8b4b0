"""The plain baseline (config `plain_baseline`): a no-draft rollout of an arm's own tokens in the same step.

* an engine with a draft decodes plainly on request (`speculate=False`): under the coupled sampler the same
  tokens as its speculative call and as a no-draft engine, without touching the controller's acceptance;
* in the RL loop the arm logs the baseline's time and the rows it matched, and its trajectory is the one it
  has without the baseline (the plain decode draws from a copy of the sampler, never the arm's own);
* the draft's share of the train step is timed inside it, and is a part of time/train;
* the report's table is the stated arithmetic;
* `base = "other.toml"` configs and the field's refusals.
"""
import math

import pytest
import torch

from specco.config_load import load_config
from specco.model.config import ConfigError
from specco.rollout.engine import RolloutEngine
from specco.rollout.generate import GenerateConfig
from specco.runner.report import baseline_split, plain_baseline_table, plot_time_split
from specco.runner.rl import run_arm
from specco.runner.warmstart import new_draft
from test_coupled import COUPLED, _drafts, _prompts
from test_grpo import DigitTask, _cfg, _setup

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("kind", ["eagle3-structured", "dflash"])
def test_engine_decodes_plainly_on_request(kind):
    """fp64 (no verify-vs-step rounding flips a draw): speculate=False emits the speculative call's tokens
    and a no-draft engine's, runs no draft token (τ = 1) and leaves the controller's pooled counts alone."""
    policy, draft = _drafts(kind)
    cfg = GenerateConfig(max_new_tokens=30, sampling=COUPLED, num_draft_tokens=3, spec_control=True,
                         compact_below=0.5)
    engine = RolloutEngine(policy, draft, cfg, cache_runners=1)
    # on CPU the controller times its candidates with the host clock, and at this size speculation may not pay:
    # margin 0 makes it speculate whenever asked, so the calls below do what they say
    engine.controller.margin = 0.0
    prompts = _prompts(policy.cfg.vocab_size)
    gen = lambda: torch.Generator().manual_seed(5)  # noqa: E731
    spec = engine.generate(prompts, 2, generator=gen())
    pooled = (engine.controller.accepted.clone(), engine.controller.tried.clone())
    plain = engine.generate(prompts, 2, generator=gen(), speculate=False)
    assert torch.equal(engine.controller.accepted, pooled[0]) and torch.equal(engine.controller.tried, pooled[1])
    ref = RolloutEngine(policy, None, cfg).generate(prompts, 2, generator=gen())
    assert spec.tau > 1.0 and plain.tau == 1.0 and plain.num_target_forwards > spec.num_target_forwards
    for out in (spec, plain):
        assert torch.equal(out.tokens, ref.tokens) and torch.equal(out.lengths, ref.lengths)
    assert {c.k for c in plain.choices} == {0}
    again = engine.generate(prompts, 2, generator=gen())  # speculation is back on the next call
    assert torch.equal(again.tokens, spec.tokens) and again.tau > 1.0


def test_plain_decode_needs_speculation_control():
    policy, draft = _drafts("eagle3-structured")
    engine = RolloutEngine(policy, draft, GenerateConfig(max_new_tokens=8, sampling=COUPLED, spec_control=False))
    with pytest.raises(ValueError, match="needs speculation control"):
        engine.generate(_prompts(policy.cfg.vocab_size), speculate=False)


def test_rl_arm_measures_its_plain_baseline_without_changing_its_trajectory(tmp_path):
    tok, policy = _setup()
    draft = new_draft(policy, torch.randint(0, tok.vocab_size, (4, 8)), aux_layer_ids=(0, 1))
    # three steps: the plain train step's undoing of the optimizer shows from step 3 on (with its moments left
    # advanced, Adam's bias correction makes the first update the same; the second's differs)
    common = ("train.steps=3", "rollout.sampler=coupled", "rollout.max_new_tokens=12", "rollout.spec_control=on",
              "arms=[cotrained]")
    rows = {}
    for name, extra in (("with", ("plain_baseline=[cotrained]",)), ("without", ())):
        cfg = _cfg(tmp_path, *common, *extra)
        rows[name] = run_arm(cfg, "cotrained", policy, draft, DigitTask(), tok, tmp_path / name, progress=False)
    # (not tau: on CPU the controller times its candidates with the host clock, so its k choices, and hence
    # tau, vary from run to run; the tokens, and all that is trained on them, do not)
    for a, b in zip(rows["with"], rows["without"]):
        for key in ("reward", "completion_len", "policy/loss", "draft/loss", "policy/grad_norm"):
            assert a[key] == b[key], (a["step"], key)
        assert "time/rollout_plain" not in b
        assert a["time/rollout_plain"] > 0 and a["rollout/plain_rows_equal"] == 1.0
        assert a["rollout/plain_speedup"] == pytest.approx(a["time/rollout_plain"] / a["time/rollout"])
        assert "rows x" in a["time/rollout_plain_phases"]
        for r in (a, b):  # the draft's forward and backward: a part of the train step
            assert 0 < r["time/train_draft"] < r["time/train"]
        assert a["time/train_plain"] > 0 and "time/train_plain" not in b  # the same updates without the draft


def test_plain_train_step_reruns_the_updates_without_the_draft(tmp_path, monkeypatch):
    """The plain train step starts where the real updates started: its policy loss and grad norm equal theirs,
    update by update (the policy's gradients do not depend on the draft: disjoint graphs). Its seconds are left
    out of the step's time/other (a plain pass made 2 s slower here does not show up there)."""
    import time
    import specco.runner.trainer as trainer
    calls = []
    real = trainer.cotrain_step

    def recording(policy, draft, *a, **k):
        out = real(policy, draft, *a, **k)
        calls.append((draft is None, out["policy/loss"], out["policy/grad_norm"]))
        if draft is None:
            time.sleep(1.0)
        return out
    monkeypatch.setattr(trainer, "cotrain_step", recording)
    tok, policy = _setup()
    draft = new_draft(policy, torch.randint(0, tok.vocab_size, (4, 8)), aux_layer_ids=(0, 1))
    cfg = _cfg(tmp_path, "train.steps=2", "rollout.sampler=coupled", "rollout.max_new_tokens=12",
               "rollout.spec_control=on", "arms=[cotrained]", "plain_baseline=[cotrained]", "train.minibatches=2")
    rows = run_arm(cfg, "cotrained", policy, draft, DigitTask(), tok, tmp_path / "p", progress=False)
    assert [c[0] for c in calls] == [False, False, True, True] * 2  # the real updates, then the plain ones
    for i in range(0, len(calls), 4):
        assert calls[i:i + 2] == [(False, *c[1:]) for c in calls[i + 2:i + 4]]
    for r in rows:
        assert r["time/train_plain"] > 2.0 and r["time/other"] < 2.0


def test_frozen_arm_has_no_draft_train_time(tmp_path):
    tok, policy = _setup()
    draft = new_draft(policy, torch.randint(0, tok.vocab_size, (4, 8)), aux_layer_ids=(0, 1))
    cfg = _cfg(tmp_path, "train.steps=1", "rollout.max_new_tokens=8")
    (row,) = run_arm(cfg, "frozen", policy, draft, DigitTask(), tok, tmp_path / "f", progress=False)
    assert "time/train_draft" not in row


def test_plain_baseline_table_arithmetic():
    def row(roll, plain, draft, rest=1.0, equal=1.0):
        return {"time/rollout": roll, "time/rollout_plain": plain, "time/train_draft": draft, "time/train": rest,
                "rollout/plain_rows_equal": equal}
    rows = {"cotrained": [row(9.0, 9.0, 0.0), row(2.0, 4.0, 0.5), row(3.0, 8.0, 0.5, equal=0.5)],
            "frozen": [row(1.0, 1.0, 0.0)]}  # one step: quoted over it (steady_rows keeps a lone step)
    _, got = plain_baseline_table(rows)
    c = got["cotrained"]  # steps 2-3: step = roll + 1.0; no-draft step = step - roll + plain - draft
    step, no_draft = (3.0 + 4.0), (3.0 + 4.0) - 5.0 + 12.0 - 1.0
    assert c["steps"] == 2 and c["rows equal"] == 0.75
    assert c["rollout speedup"] == pytest.approx(12.0 / 5.0)
    assert c["end-to-end speedup"] == pytest.approx(no_draft / step)
    assert c["no-draft rollout share"] == pytest.approx(12.0 / no_draft)
    assert c["draft train s/step"] == pytest.approx(0.5)
    assert got["frozen"]["rollout speedup"] == 1.0
    assert plain_baseline_table({"none": [{"time/rollout": 1.0}]}) is None
    # the time-split bar of the no-draft step: the same no-draft step, phase by phase
    split = baseline_split(rows["cotrained"])
    assert split["rollout"] == pytest.approx(6.0) and split["train"] == pytest.approx(0.5)
    assert sum(split.values()) == pytest.approx(c["no-draft step s"])
    assert baseline_split([{"time/rollout": 1.0}]) is None
    assert math.isnan(c["plain train rerun s/step"])  # not rerun: no low bound
    # with the updates rerun without the draft (time/train_plain): the no-draft step still takes train - draft,
    # and the rerun gives the low-bound column
    measured = [{**r, "time/train_plain": 0.25} for r in rows["cotrained"]]
    _, got = plain_baseline_table({"cotrained": measured})
    g = got["cotrained"]
    assert g["end-to-end speedup"] == pytest.approx(no_draft / step) and g["no-draft train s/step"] == pytest.approx(0.5)
    assert g["plain train rerun s/step"] == pytest.approx(0.25)
    assert g["end-to-end speedup, rerun train (low)"] == pytest.approx((no_draft - 2 * 0.5 + 2 * 0.25) / step)  # sums over 2 steps


def test_time_split_plot_has_the_baseline_bar(tmp_path, monkeypatch):
    import specco.runner.report as report
    if report._pyplot() is None:
        pytest.skip("no matplotlib")
    bars = []
    plt = report._pyplot()
    real_bar = plt.Axes.bar
    monkeypatch.setattr(plt.Axes, "bar", lambda self, x, *a, **k: bars.append(list(x)) or real_bar(self, x, *a, **k))
    rows = [{"time/rollout": 2.0, "time/rollout_plain": 4.0, "time/train": 1.0, "time/train_draft": 0.2}] * 3
    assert plot_time_split({"cotrained": rows, "frozen": [{"time/rollout": 2.0}]}, tmp_path / "t.png").exists()
    assert bars[0] == ["cotrained", "frozen", "cotrained\nplain, same tokens"]


def test_config_base_and_plain_baseline_refusals(tmp_path):
    (tmp_path / "a.toml").write_text('out_dir = "runs/a"\narms = ["none", "cotrained"]\n[rollout]\nk = 2\n'
                                     'sampler = "coupled"\n[train]\nsteps = 3\n')
    (tmp_path / "b.toml").write_text('base = "a.toml"\nout_dir = "runs/b"\n[rollout]\nk = 4\n')
    cfg = load_config(tmp_path / "b.toml")
    assert (cfg.out_dir, cfg.rollout.k, cfg.rollout.sampler, cfg.train.steps) == ("runs/b", 4, "coupled", 3)
    assert cfg.arms == ("none", "cotrained")
    (tmp_path / "c.toml").write_text('base = "d.toml"\n')
    (tmp_path / "d.toml").write_text('base = "c.toml"\n')
    with pytest.raises(ConfigError, match="loops back"):
        load_config(tmp_path / "c.toml")
    (tmp_path / "e.toml").write_text('base = "missing.toml"\n')
    with pytest.raises(ConfigError, match="missing.toml does not exist"):
        load_config(tmp_path / "e.toml")
    ok = load_config(tmp_path / "a.toml", ["plain_baseline=[cotrained-eagle3]"])
    assert ok.measures_plain("cotrained") and not ok.measures_plain("none")
    for overrides, match in ((["plain_baseline=[frozen]"], "not one of arms"),
                             (["arms=[none]", "plain_baseline=[none]"], "decodes plainly already"),
                             (["plain_baseline=[cotrained]", "rollout.sampler=rejection"], "set rollout.sampler=coupled"),
                             (["plain_baseline=[cotrained]", "rollout.spec_control=off"], "spec_control=on or auto")):
        with pytest.raises(ConfigError, match=match):
            load_config(tmp_path / "a.toml", overrides)
    assert not math.isnan(load_config("configs/long_ab.toml").train.lr)  # the committed config loads
    assert load_config("configs/long_ab.toml").plain_baseline == ("cotrained", "cotrained-dflash")


TINY_LONG = ("device=cpu", "policy.hidden_size=64", "policy.num_layers=4", "policy.num_heads=4", "policy.num_kv_heads=2",
             "policy.intermediate_size=128", "policy.max_positions=512", "data.options.min_terms=4", "data.options.max_terms=6",
             "rollout.max_new_tokens=64", "rollout.prompts_per_step=4", "rollout.group_size=4", "train.steps=2",
             "sft.steps=40", "train.warm_start_steps=8", "train.warm_start_prompts=8", "data.eval_size=4",
             "train.amp=none", "train.micro_batch_rows=4", "train.compile=none", "rollout.spec_control=on")


@pytest.mark.slow
def test_committed_long_ab_config_runs_at_a_tiny_shape(tmp_path):
    """`specco train configs/long_ab.toml` (base long.toml, coupled sampler, four arms, the plain baseline in the
    co-trained two) end to end on CPU at a tiny shape: the report's plain-baseline table has both co-trained arms,
    their baseline rows equal to the speculative ones (> 0.9: in fp32 a verify forward and a one-token step can
    round a near-tie apart, which changes one of the 16 rows; the fp64 tests above require exact equality)."""
    import json
    from specco.cli import main
    main(["train", "configs/long_ab.toml", f"out_dir={tmp_path / 'run'}", *TINY_LONG, "--force-new"])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert set(summary["arms"]) == {"cotrained", "cotrained-dflash", "frozen", "frozen-dflash"}
    base = summary["plain baseline"]
    assert set(base) == {"cotrained", "cotrained-dflash"}
    for arm in base.values():
        assert arm["rows equal"] > 0.9 and arm["plain rollout s/step"] > 0 and arm["draft train s/step"] > 0
    report = (tmp_path / "run" / "report.md").read_text()
    assert "Plain baseline" in report and "Frozen shadow" in report  # long_ab.toml's frozen_shadow: both co-trained
    assert set(summary["frozen shadow"]) == {"cotrained", "cotrained-dflash"}
    for arm in base.values():
        assert arm["no-draft train s/step"] > 0  # the plain train step ran
