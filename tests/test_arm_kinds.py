"""One run, several draft kinds: the arm syntax `<mode>` / `<mode>-<kind>`, the config each arm sees
(derive.arm_config, rollout.block_k), one warm draft per kind from one sample pool, and a tiny run whose
arms use EAGLE-3 and DFlash side by side."""
import json
import shutil

import pytest

from specco.config_load import load_config
from specco.model.config import ConfigError
from specco.model.dflash import BlockDraft
from specco.model.draft import Eagle3Draft
from specco.runner.derive import arm_config, check_parallel, step_config, warm_configs

from test_run_safety import _cfg, _prepare
from cli_helpers import DEMO  # noqa: E402

ALL_KINDS = "arms=none,frozen,cotrained,cotrained-dflash,frozen-dflash,cotrained-dspark"

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("overrides,match", [
    (["arms=none-dflash"], "'none-dflash': the no-draft arm has no draft kind; write 'none'"),
    (["arms=none,bogus"], "unknown mode 'bogus'.*mode in none, frozen, cotrained"),
    (["arms=cotrained-eagle4"], "unknown draft kind 'eagle4'.*kind in eagle3, dflash, dspark"),
    (["arms=frozen,frozen"], "'frozen' and 'frozen' are the same arm"),
    (["arms=cotrained,cotrained-eagle3"], "'cotrained' and 'cotrained-eagle3' are the same arm"),
    (["draft.kind=dflash", "arms=frozen-dflash,frozen"], "'frozen-dflash' and 'frozen' are the same arm"),
    (["rollout.block_k=-1"], r"rollout.block_k=-1: must be >= 0"),
])
def test_bad_arms_are_refused_naming_the_choices(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(DEMO, overrides)


def test_arm_config_per_arm():
    cfg = load_config(DEMO, [ALL_KINDS, "rollout.block_k=6", "draft.draft_vocab_size=50", "draft.init=/some/eagle3"])
    seen = {}
    for arm in cfg.arms:
        acfg, mode = arm_config(cfg, arm)
        seen[arm] = (mode, acfg.draft.kind, acfg.rollout.k)
        assert acfg.arms == (arm,) and arm_config(acfg, arm) == (acfg, mode)  # applying it again: no change
        assert acfg.train == cfg.train and acfg.draft.aux_layer_ids == cfg.draft.aux_layer_ids
        if acfg.draft.kind == "eagle3":  # the run's own draft: every draft key as configured
            assert acfg.draft == cfg.draft and acfg.rollout == cfg.rollout
        else:  # draft.init and draft_vocab_size describe the run's EAGLE-3 draft, not this one
            assert (acfg.draft.init, acfg.draft.draft_vocab_size) == ("", 0)
    assert seen == {"none": ("none", "eagle3", 3), "frozen": ("frozen", "eagle3", 3),
                    "cotrained": ("cotrained", "eagle3", 3), "cotrained-dflash": ("cotrained", "dflash", 6),
                    "frozen-dflash": ("frozen", "dflash", 6), "cotrained-dspark": ("cotrained", "dspark", 6)}
    # block_k = 0: block drafters propose rollout.k tokens like EAGLE-3
    assert arm_config(load_config(DEMO, [ALL_KINDS]), "cotrained-dspark")[0].rollout.k == 3
    # the mode decides the step: only co-trained arms train their draft
    assert step_config(*arm_config(cfg, "cotrained-dflash")).draft_weight == cfg.train.draft_weight
    assert step_config(*arm_config(cfg, "frozen-dflash")).draft_weight == 0.0


def test_warm_configs_one_per_kind_the_run_kind_first():
    cfg = load_config(DEMO, [ALL_KINDS, "rollout.block_k=5"])
    w = warm_configs(cfg)
    assert [(k, c.draft.kind, c.rollout.k) for k, c in w.items()] == [
        ("eagle3", "eagle3", 3), ("dflash", "dflash", 5), ("dspark", "dspark", 5)]
    # draft.kind first when an arm uses it warm; a kind no arm needs warm has no warm start
    assert list(warm_configs(load_config(DEMO, ["draft.kind=dflash", "arms=none,cotrained-eagle3,frozen"]))) == [
        "dflash", "eagle3"]
    assert list(warm_configs(load_config(DEMO, ["draft.kind=dflash", "arms=none,cotrained-eagle3"]))) == ["eagle3"]
    # a cold arm needs its kind's warm draft only for its frozen shadow (the offline stage it skipped)
    assert list(warm_configs(load_config(DEMO, ["arms=none,cold-dflash", "frozen_shadow=[]"]))) == []
    assert list(warm_configs(load_config(DEMO, ["arms=none,cold-dflash", "frozen_shadow=[cold-dflash]"]))) == [
        "dflash"]


def test_block_arms_under_pp_are_refused_by_name():
    with pytest.raises(ConfigError, match=r"arms \['cotrained-dflash', 'frozen-dspark'\] with parallel.pp=2.*"
                                          "EAGLE-3 drafts only"):
        check_parallel(load_config(DEMO, ["parallel.pp=2", "arms=none,cotrained,cotrained-dflash,frozen-dspark"]),
                       2)
    check_parallel(load_config(DEMO, ["parallel.pp=2", "arms=none,cotrained-eagle3"]), 2)


def test_make_arm_uses_the_mode():
    from specco.model.config import PolicyConfig
    from specco.model.dflash import BlockDraftConfig
    from specco.model.policy import Policy
    from specco.runner.derive import generate_config
    from specco.runner.trainer import make_arm
    cfg = load_config(DEMO, [ALL_KINDS])
    policy = Policy(PolicyConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                                 num_kv_heads=2))
    draft = BlockDraft(BlockDraftConfig.for_policy(policy.cfg, "dflash", gamma=3, mask_id=49))
    gcfg = generate_config(cfg, None, 0)
    n_policy = sum(p.numel() for p in policy.parameters())
    for arm, mode, trains_draft in (("frozen-dflash", "frozen", False), ("cotrained-dflash", "cotrained", True)):
        st = make_arm(arm_config(cfg, arm)[0], arm, policy, draft, gcfg)
        assert (st.arm, st.mode) == (arm, mode) and isinstance(st.draft, BlockDraft)
        n_opt = sum(p.numel() for g in st.opt.param_groups for p in g["params"])
        assert (n_opt > n_policy) == trains_draft
    with pytest.raises(ConfigError, match="unknown mode 'cotrain'"):
        make_arm(cfg, "cotrain-dflash", policy, draft, gcfg)


def test_force_new_deletes_every_warm_draft(tmp_path):
    from specco.runner.stages import record_config
    record_config(tmp_path, _cfg(tmp_path, "arms=none,cotrained-dflash,cotrained-dspark"))
    for d in ("warm_draft", "warm_draft_dflash", "warm_draft_dspark", "cold_draft_eagle3", "cold_draft_dflash",
              "warm_draft_notes"):
        (tmp_path / d).mkdir()
    record_config(tmp_path, _cfg(tmp_path), force_new=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "warm_draft_notes"]  # not a run output


ARMS = ("none", "cotrained", "cotrained-dflash")
MIXED = ("arms=" + ",".join(ARMS), "rollout.block_k=4")


@pytest.fixture(scope="module")
def mixed_run(tmp_path_factory):
    """A tiny run (~10 s on CPU) with an EAGLE-3 and a DFlash arm, block_k = 4 against rollout.k = 3."""
    from specco.runner.pipeline import run as run_demo
    out = tmp_path_factory.mktemp("mixed")
    summary = run_demo(_cfg(out, *MIXED), progress=False)
    return out, summary


def _rows(out, arm):
    return [json.loads(x) for x in (out / "arms" / arm / "metrics.jsonl").read_text().splitlines()]


def test_mixed_run_arms_use_their_kinds_draft(mixed_run):
    from specco.runner.warmstart import load_draft_dir
    from specco.train.checkpoint import load_latest
    out, summary = mixed_run
    assert isinstance(load_draft_dir(out / "warm_draft"), Eagle3Draft)
    block = load_draft_dir(out / "warm_draft_dflash")
    assert isinstance(block, BlockDraft) and (block.kind, block.cfg.gamma) == ("dflash", 4)  # γ = block_k
    for arm in ARMS:
        assert [r["step"] for r in _rows(out, arm)] == [1, 2]
    # the DFlash arm proposes block_k = 4 tokens a round and logs the block drafter's metrics; EAGLE-3: k = 3
    assert all("accept/pos4" in r and "draft/accept_slot3" in r and "draft/tau_prob" in r
               for r in _rows(out, "cotrained-dflash"))
    assert all("accept/pos3" in r and "accept/pos4" not in r and "draft/tau_prob" not in r
               for r in _rows(out, "cotrained"))
    _, state = load_latest(out / "arms" / "cotrained-dflash" / "ckpt", restore_rng=False)
    assert state["arm"] == "cotrained-dflash"
    assert set(summary["arms"]) == set(ARMS)
    assert set(summary["warm_start_by_kind"]) == {"eagle3", "dflash"}
    assert summary["warm_start"] == summary["warm_start_by_kind"]["eagle3"]
    assert json.loads((out / "summary.json").read_text())["warm_start_by_kind"].keys() == {"eagle3", "dflash"}


def test_the_run_kinds_warm_draft_is_a_single_kind_runs(mixed_run, tmp_path):
    """Adding a DFlash arm changes nothing of the run's EAGLE-3 warm draft (same RNG stream, same pool)."""
    out, _ = mixed_run
    _prepare(tmp_path, _cfg(tmp_path))  # the default arms: none, frozen, cotrained
    for f in ("start_policy/model.safetensors", "warm_draft/model.safetensors"):
        assert (tmp_path / f).read_bytes() == (out / f).read_bytes(), f


def test_rerun_skips_every_warm_start(mixed_run, monkeypatch):
    import specco.runner.prepare as prep
    from specco.runner.pipeline import run
    out, summary = mixed_run

    def refuse(*a, **k):
        raise AssertionError("a finished run sampled a warm-start pool or trained a warm draft again")
    monkeypatch.setattr(prep, "sample_pool", refuse)
    monkeypatch.setattr(prep, "warm_start", refuse)
    again = run(_cfg(out, *MIXED), progress=False)
    assert again["warm_start_by_kind"] == summary["warm_start_by_kind"]


def test_one_missing_warm_draft_is_recomputed_alone_to_the_same_bytes(mixed_run, tmp_path, monkeypatch):
    """A run interrupted between the two warm starts: the second kind's is recomputed from a pool sampled
    once more, to the same bytes (the pool and the kind's RNG stream depend on the run seed only)."""
    import specco.runner.prepare as prep
    from specco.runner.validate import check_job
    src, _ = mixed_run
    out = tmp_path / "run"
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("arms", ".lock"))
    shutil.rmtree(out / "warm_draft_dflash")
    calls = []
    real = prep.sample_pool
    monkeypatch.setattr(prep, "sample_pool", lambda *a, **k: calls.append(1) or real(*a, **k))
    cfg = _cfg(out, *MIXED)
    data = check_job(cfg)
    policy, tok, _ = prep.prepare_policy(cfg, data, out, "cpu", progress=False)
    drafts, _ = prep.prepare_drafts(cfg, policy, tok, data, out, progress=False)
    assert len(calls) == 1 and isinstance(drafts["dflash"], BlockDraft)
    f = "warm_draft_dflash/model.safetensors"
    assert (out / f).read_bytes() == (src / f).read_bytes()
