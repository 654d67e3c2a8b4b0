"""Cold arms (`cold`, `cold-<kind>`): a draft co-trained from the start of RL with no offline warm start, its
kind's warm draft as the frozen shadow (issue 36: the steps a cold draft needs to catch up with the offline stage).

* the syntax and what a cold arm does (derive.arm_config: what a co-trained arm does);
* run_arm: a cold arm is a co-trained arm started from another draft, step for step; its shadow is the draft given;
* a tiny run: the cold draft is the warm draft's own initialisation (the same RNG stream, no training), the cold
  arm co-trains it, and its shadow scores the warm draft on the same rollouts as the co-trained arm's shadow.
"""
import json

import pytest
import torch

from specco.config_load import load_config
from specco.model.config import ConfigError
from specco.runner.derive import arm_config, step_config
from specco.runner.rl import run_arm
from specco.runner.warmstart import load_draft_dir, new_draft

from test_grpo import DigitTask, _cfg as grpo_cfg, _setup
from test_run_safety import _cfg, _prepare
from cli_helpers import DEMO  # noqa: E402

pytestmark = pytest.mark.e2e


def test_cold_arms_parse_and_train_their_draft():
    cfg = load_config(DEMO, ["arms=none,cotrained,cold,cold-dflash", "frozen_shadow=[cold,cold-dflash]",
                             "plain_baseline=[cold]", "rollout.sampler=coupled"])
    assert cfg.measures_shadow("cold") and cfg.measures_shadow("cold-dflash") and cfg.measures_plain("cold")
    for arm, kind in (("cold", "eagle3"), ("cold-dflash", "dflash")):
        acfg, mode = arm_config(cfg, arm)
        assert (mode, acfg.draft.kind, acfg.arms) == ("cotrained", kind, (arm,))
        assert arm_config(acfg, arm) == (acfg, mode)  # applying it again: no change
        assert step_config(acfg, mode).draft_weight == cfg.train.draft_weight  # it trains its draft
    with pytest.raises(ConfigError, match="'cold' and 'cold-eagle3' are the same arm"):
        load_config(DEMO, ["arms=cold,cold-eagle3"])
    with pytest.raises(ConfigError, match="mode in none, frozen, cotrained, cold"):
        load_config(DEMO, ["arms=chilly"])


def test_cold_arm_is_a_cotrained_arm_from_its_draft(tmp_path):
    """run_arm with arm 'cold' and a draft: the co-trained arm's steps from that draft, to the last digit; the
    shadow argument is what frozen_shadow scores (here another draft: the scores part from the arm's own)."""
    tok, policy = _setup()
    torch.manual_seed(1)
    cold = new_draft(policy, torch.randint(0, tok.vocab_size, (4, 8)), aux_layer_ids=(0, 1))
    warm = new_draft(policy, torch.randint(0, tok.vocab_size, (4, 8)), aux_layer_ids=(0, 1))
    rows = {}
    for arm in ("cotrained", "cold"):
        cfg = grpo_cfg(tmp_path, "train.steps=2", "rollout.max_new_tokens=8", f"arms=[{arm}]",
                       f"frozen_shadow=[{arm}]")
        rows[arm] = run_arm(cfg, arm, policy, cold, DigitTask(), tok, tmp_path / arm, progress=False,
                            shadow=warm if arm == "cold" else None)
    for a, b in zip(rows["cotrained"], rows["cold"]):
        for key in ("reward", "tau", "policy/loss", "draft/loss", "shadow/cotrained/loss"):
            assert a[key] == b[key], (a["step"], key)
    # step 1: the co-trained arm's shadow is its own starting draft, the cold arm's the other draft
    a, b = rows["cotrained"][0], rows["cold"][0]
    assert a["shadow/frozen/loss"] == a["shadow/cotrained/loss"]
    assert b["shadow/frozen/loss"] != b["shadow/cotrained/loss"]


COLD = ("arms=cotrained,cold", "frozen_shadow=[cotrained,cold]", "rollout.sampler=coupled")


def test_cold_run_starts_from_the_untrained_warm_draft(tmp_path_factory):
    from specco.runner.pipeline import run
    out = tmp_path_factory.mktemp("cold")
    summary = run(_cfg(out, *COLD), progress=False)
    assert set(summary["arms"]) == {"cotrained", "cold"}
    # the cold draft is the warm start's own initial draft: a run warm-starting for 0 steps writes the same bytes
    ref = tmp_path_factory.mktemp("zero")
    _prepare(ref, _cfg(ref, "train.warm_start_steps=0"))
    f = "model.safetensors"
    assert (out / "cold_draft_eagle3" / f).read_bytes() == (ref / "warm_draft" / f).read_bytes()
    assert (out / "cold_draft_eagle3" / f).read_bytes() != (out / "warm_draft" / f).read_bytes()
    warm_m = json.loads((out / "cold_draft_eagle3" / "warm_metrics.json").read_text())
    assert warm_m["sim_tau_start"] is None and "T=0.0" in warm_m["real"]
    rows = {arm: [json.loads(x) for x in (out / "arms" / arm / "metrics.jsonl").read_text().splitlines()]
            for arm in ("cotrained", "cold")}
    # step 1, coupled sampling: both arms decode the same tokens, so each shadow scores the warm draft alike
    a, b = rows["cotrained"][0], rows["cold"][0]
    assert a["reward"] == b["reward"] and a["completion_len"] == b["completion_len"]
    for k in ("sim_accept_len", "loss"):
        assert b[f"shadow/frozen/{k}"] == pytest.approx(a[f"shadow/frozen/{k}"], rel=1e-6), k
    assert b["shadow/cotrained/loss"] != a["shadow/cotrained/loss"]  # ... and the cold one is another draft
    # the cold arm co-trained its draft: the draft it saved is neither the cold start nor the warm draft
    saved = load_draft_dir(out / "arms" / "cold" / "draft").state_dict()
    for start in ("cold_draft_eagle3", "warm_draft"):
        sd = load_draft_dir(out / start).state_dict()
        assert any(not torch.equal(saved[k], sd[k]) for k in sd), start


def test_committed_drift_config_is_the_third_runs():
    """configs/drift.toml is the config of the third H200 run (bench/results/drift_2026-12-04/run3_cot16-24), every
    default spelled out; the first two runs differ from it in the task (5-10 terms, the rewrite format, a quarter of
    the SFT references worked, 600 SFT steps), the lr and (the first) the arms only."""
    from specco.config_load import config_to_dict
    from pathlib import Path
    runs = Path(__file__).resolve().parents[1] / "bench" / "results" / "drift_2026-12-04"
    defaults = config_to_dict(load_config())  # every field at its default

    def as_run(mine: dict, run: dict, default: dict) -> dict:
        """`mine` without the fields the run's config.json predates, each at its default (what the run did)."""
        out = {}
        for k, v in mine.items():
            if k not in run:
                assert v == default[k], f"{k}={v!r} is not its default, which a run before the field had"
            elif isinstance(v, dict) and isinstance(run[k], dict):
                out[k] = as_run(v, run[k], default[k])
            else:
                out[k] = v
        return out

    def saved(name):
        return json.loads((runs / name / "config.json").read_text())
    mine = config_to_dict(load_config(DEMO.parent / "drift.toml"))
    assert as_run(mine, saved("run3_cot16-24"), defaults) == saved("run3_cot16-24")
    task = ["data.format=rewrite", "data.options.min_terms=5", "data.options.max_terms=10", "data.cot_fraction=0.25",
            "sft.steps=600"]
    second = config_to_dict(load_config(DEMO.parent / "drift.toml", [*task, "train.lr=1e-5"]))
    assert as_run(second, saved("run2_lr1e-5"), defaults) == saved("run2_lr1e-5")
    first = config_to_dict(load_config(DEMO.parent / "drift.toml", [
        *task, "train.lr=5e-5", "arms=[none,frozen,cotrained,cold,cotrained-dflash,cold-dflash]",
        "plain_baseline=[cotrained,cotrained-dflash]", "frozen_shadow=[cotrained,cold,cotrained-dflash,cold-dflash]"]))
    assert as_run(first, saved("run1_lr5e-5"), defaults) == saved("run1_lr5e-5")


def test_cold_arm_co_trains_an_imported_draft_as_is(tmp_path, tiny_start):
    """draft.init with a cold arm (an off-domain start: a published draft co-trained from step 1): the cold draft is
    the imported one unchanged, the warm draft (its shadow) the same import warm-started on this policy."""
    from specco.runner.pipeline import run
    over = [o for o in tiny_start.overrides("eagle3") if not o.startswith("train.warm_start_steps")]
    cfg = load_config(DEMO, [*over, "train.warm_start_steps=2", "train.warm_start_prompts=4",
                             "train.warm_start_batch=4", "train.steps=1", "rollout.prompts_per_step=2",
                             "rollout.group_size=2", "rollout.max_new_tokens=6", "data.eval_size=2",
                             "arms=[none,cold]", "frozen_shadow=[cold]", f"out_dir={tmp_path}"])
    run(cfg, progress=False)
    imported = load_draft_dir(tiny_start.drafts["eagle3"]).state_dict()
    cold = load_draft_dir(tmp_path / "cold_draft_eagle3").state_dict()
    warm = load_draft_dir(tmp_path / "warm_draft").state_dict()
    assert all(torch.equal(cold[k], imported[k]) for k in imported)
    assert any(not torch.equal(warm[k], imported[k]) for k in imported)
    (row,) = [json.loads(x) for x in (tmp_path / "arms" / "cold" / "metrics.jsonl").read_text().splitlines()]
    assert row["shadow/frozen/loss"] != row["shadow/cotrained/loss"]
