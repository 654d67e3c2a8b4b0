"""Config errors say what to change; overrides coerce types; a round-trip keeps values."""
import pytest

from specco.config import RunConfig
from specco.config_load import config_to_dict, load_config
from specco.model.config import ConfigError, DraftConfig, PolicyConfig
from cli_helpers import DEMO  # noqa: E402


def test_defaults_and_overrides():
    cfg = load_config(DEMO, ["train.steps=7", "rollout.k=2", "draft.aux_layer_ids=1,2",
                             "draft.init_head_from_policy=false", "train.lr=3e-4"])
    assert cfg.train.steps == 7 and cfg.rollout.k == 2 and cfg.draft.aux_layer_ids == (1, 2)
    assert cfg.draft.init_head_from_policy is False and cfg.train.lr == 3e-4
    assert isinstance(cfg, RunConfig)


def test_toml_file(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('out_dir = "x"\n[train]\nsteps = 3\n[rollout]\ngroup_size = 4\n')
    cfg = load_config(p, ["train.steps=5"])
    assert cfg.out_dir == "x" and cfg.train.steps == 5 and cfg.rollout.group_size == 4
    d = config_to_dict(cfg)
    assert d["rollout"]["group_size"] == 4


@pytest.mark.parametrize("override,needle", [
    ("train.stpes=3", "did you mean 'train.steps'"),
    ("rollout.k=0", "k >= 1"),
    ("rollout.group_size=1", "group_size=1"),
    ("rollout.top_p=0", "top_p"),
    ("rollout.compact_below=1", "compact_below"),
    ("train.keep_checkpoints=0", "keep at least 1"),
    ("train.steps=abc", "expected int"),
    ("policy.hidden_size=102", "divisible"),
    ("arms=none,bogus", "bogus"),
    ("draft.ttt_passes=0", "ttt_passes"),
    ("nosuch=1", "unknown config key 'nosuch'"),
])
def test_bad_values_are_clear_errors(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(DEMO, [override])


def test_missing_file_and_bad_override():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/no/such.toml")
    with pytest.raises(ConfigError, match="key.sub=value"):
        load_config(DEMO, ["train.steps"])


def test_aux_layer_out_of_range():
    pc = PolicyConfig(vocab_size=10, hidden_size=16, intermediate_size=32, num_layers=4,
                      num_heads=2, num_kv_heads=1)
    with pytest.raises(ConfigError, match="out of range"):
        DraftConfig.for_policy(pc, aux_layer_ids=(1, 7))
    with pytest.raises(ConfigError, match="ascending"):
        DraftConfig.for_policy(pc, aux_layer_ids=(2, 1))


def test_list_overrides_accept_toml_syntax():
    from specco.config_load import load_config
    for text in ('arms=["none", "cotrained-dflash"]', "arms=[none,cotrained-dflash]", "arms=none,cotrained-dflash"):
        assert load_config(DEMO, [text]).arms == ("none", "cotrained-dflash")
    assert load_config(DEMO, ["draft.aux_layer_ids=[0, 2]"]).draft.aux_layer_ids == (0, 2)


@pytest.mark.parametrize("path", sorted(str(p) for p in __import__("pathlib").Path(__file__).parents[1].glob("configs/*.toml")))
def test_committed_configs_load_and_derive(path):
    """Every committed config loads, and every arm's derived configs build (a typo in a config nobody runs
    on CPU would otherwise surface only on the GPU)."""
    from specco.config_load import load_config
    from specco.runner.derive import arm_config, check_parallel, generate_config, step_config, warm_configs
    cfg = load_config(path)
    check_parallel(cfg, cfg.parallel.pp * cfg.parallel.dp * cfg.parallel.cp, "train")
    for arm in cfg.arms:
        acfg, mode = arm_config(cfg, arm)
        step_config(acfg, mode)
        generate_config(acfg, 2, 0)
    assert set(warm_configs(cfg)) >= {cfg.draft.kind}
    if cfg.policy.source == "tiny":  # prompts (at most 2 characters a term + bos) and completions fit
        assert cfg.policy.max_positions >= cfg.rollout.max_new_tokens


@pytest.mark.parametrize("given,dp,replicate,shard,fsdp", [
    ({}, 1, 1, 1, False),
    ({"dp": 4}, 4, 4, 1, False),  # dp alone: its old meaning, pure replication
    ({"dp_replicate": 2}, 2, 2, 1, False),
    ({"dp_shard": 4}, 4, 1, 4, True),
    ({"dp_shard": 2, "dp_replicate": 2}, 4, 2, 2, True),  # HSDP
    ({"dp": 4, "dp_shard": 2}, 4, 2, 2, True),  # a missing factor is derived
    ({"dp": 4, "dp_replicate": 2}, 4, 2, 2, True),
    ({"dp_shard": 1, "cp": 2}, 1, 1, 1, True),  # the FSDP axis is dp_shard x cp: shards over the cp ranks
])
def test_parallel_dp_factors(given, dp, replicate, shard, fsdp):
    """parallel.dp = dp_replicate x dp_shard; unset sizes are derived; dp_shard turns FSDP on."""
    p = load_config(DEMO, [f"parallel.{k}={v}" for k, v in given.items()]).parallel
    assert (p.dp, p.replicate, p.shard, p.fsdp) == (dp, replicate, shard, fsdp)
    assert config_to_dict(load_config(DEMO, [f"parallel.{k}={v}" for k, v in given.items()]))["parallel"] == {
        "dp": dp, "dp_shard": given.get("dp_shard", 0), "dp_replicate": given.get("dp_replicate", 0),
        "cp": given.get("cp", 1), "pp": 1, "tp": 1, "tp_sequence_parallel": False, "ep": 1, "backend": "auto",
        "timeout_s": 1800.0}  # as written (a pre-FSDP
    # run's record still matches: timeout_s is a key a re-run may change, runner/stages.py)


@pytest.mark.parametrize("given,needle", [
    (["parallel.dp=2", "parallel.dp_shard=2", "parallel.dp_replicate=2"],
     r"parallel.dp=2 but parallel.dp_replicate × parallel.dp_shard = 2 × 2 = 4: dp is their product; drop "
     r"parallel.dp \(it is derived\) or set it to 4"),
    (["parallel.dp=4", "parallel.dp_shard=3"], r"parallel.dp=4 is not a multiple of parallel.dp_shard=3"),
    (["parallel.dp=6", "parallel.dp_replicate=4"], r"parallel.dp=6 is not a multiple of parallel.dp_replicate=4"),
    (["parallel.dp_shard=-1"], r"parallel.dp_shard=-1: must be >= 1 \(or 0: derived\)"),
])
def test_parallel_dp_contradictions_are_named(given, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(DEMO, given)
