"""The CLI end to end at toy sizes: demo writes its report, generate reads what demo wrote,
config mistakes exit with a clear message and status 2, and a rerun reuses finished stages."""
import json
import sys

import pytest

from specco.cli import main
from cli_helpers import DEMO  # noqa: E402

SMALL = ["policy.hidden_size=32", "policy.num_layers=2", "draft.aux_layer_ids=[]", "policy.num_heads=2", "policy.num_kv_heads=1",
         "policy.intermediate_size=64", "sft.steps=10", "train.warm_start_steps=3",
         "train.steps=2", "rollout.prompts_per_step=2", "rollout.group_size=2",
         "rollout.max_new_tokens=8", "data.eval_size=4"]

pytestmark = pytest.mark.e2e


@pytest.mark.slow
def test_demo_then_generate(tmp_path, capsys):
    out = tmp_path / "run"
    main(["demo", "--quiet", "--out", str(out), *SMALL])
    for f in ("report.md", "summary.json", "tau_reward.png", "draft.png", "config.json",
              "start_policy/config.json", "start_policy/tokenizer.json", "warm_draft/draft_config.json"):
        assert (out / f).exists(), f
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["arms"]) == {"none", "frozen", "cotrained"}
    assert isinstance(summary["sft"]["sft_final_loss"], float)  # the report's SFT loss is filled in
    for arm in ("none", "frozen", "cotrained"):
        rows = [json.loads(x) for x in (out / "arms" / arm / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2]
        assert (out / "arms" / arm / "tb").is_dir()
    # a rerun finds every stage done and every arm finished: it only rewrites the report
    main(["demo", "--quiet", "--out", str(out), *SMALL])
    capsys.readouterr()
    main(["generate", "--policy", str(out / "start_policy"), "--draft", str(out / "warm_draft"),
          "--prompt", "1+2+3=", "--k", "2", "--max-new-tokens", "6"])
    captured = capsys.readouterr()
    assert captured.out.startswith("1+2+3=") and "tau =" in captured.err


def test_config_error_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", "train.stpes=3"])
    assert e.value.code == 2
    assert "did you mean 'train.steps'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["demo", "--bogus"])
    assert e.value.code == 2


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for cmd in ("demo", "train", "generate", "cotrain-cp"):
        assert cmd in text


def test_rl_loop_refuses_inconsistent_parallel_settings(tmp_path, monkeypatch):
    """`specco train` runs under torchrun with parallel.pp x parallel.dp x parallel.cp = WORLD_SIZE; anything else is a clear error (not N independent copies writing one out_dir)."""
    from specco.config_load import load_config
    from specco.model.config import ConfigError
    from specco.runner.pipeline import run as run_demo
    with pytest.raises(ConfigError, match="torchrun --nproc-per-node 2"):
        run_demo(load_config(DEMO, ["parallel.dp=2", f"out_dir={tmp_path}"]), progress=False)
    with pytest.raises(ConfigError, match="torchrun --nproc-per-node 4"):
        run_demo(load_config(DEMO, ["parallel.cp=2", "parallel.dp=2", f"out_dir={tmp_path}"]), progress=False)
    with pytest.raises(ConfigError, match="torchrun --nproc-per-node 2"):
        run_demo(load_config(DEMO, ["parallel.pp=2", f"out_dir={tmp_path}"]), progress=False)
    from specco.runner.derive import check_parallel
    with pytest.raises(ConfigError, match="parallel.pp=2: pipeline parallelism runs in `specco train` only"):
        check_parallel(load_config(DEMO, ["parallel.pp=2"]), 2, "cotrain-cp")
    assert check_parallel(load_config(DEMO, ["parallel.pp=2", "train.amp=bf16"]), 2) == (2, 1, 1)  # bf16 under PP
    with pytest.raises(ConfigError, match="set parallel.dp=2 \\(with parallel.pp=2\\)"):
        check_parallel(load_config(DEMO, ["parallel.pp=2"]), 4)
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="divisible by parallel.dp=3"):
        run_demo(load_config(DEMO, ["parallel.dp=3", "rollout.prompts_per_step=4", f"out_dir={tmp_path}"]),
                 progress=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="set parallel.dp=2"):
        run_demo(load_config(DEMO, [f"out_dir={tmp_path}"]), progress=False)
    assert not any(tmp_path.iterdir())  # refused before writing anything


def test_block_drafter_under_pp_is_refused_by_name():
    from specco.config import ConfigError
    from specco.config_load import load_config
    from specco.runner.derive import check_parallel
    cfg = load_config(DEMO, ["parallel.pp=2", "draft.kind=dflash"])
    with pytest.raises(ConfigError, match="draft.kind='dflash' with parallel.pp=2"):
        check_parallel(cfg, 2)


@pytest.mark.parametrize("world,ends", [("2", "returns"), ("1", "returns"), ("2", "raises"), ("2", "exit 0"),
                                        ("1", "exit 0"), ("2", "exit 1")])
def test_run_main_ends_a_succeeded_torchrun_worker_without_teardown(monkeypatch, world, ends):
    """`specco` / `python -m specco` (cli.run_main, through parallel.mesh.run_worker, which the bench scripts torchrun
    launches also end with): under torchrun (WORLD_SIZE > 1) a command that succeeded (returned or exited 0) ends by
    os._exit(0), skipping the interpreter's teardown where process-group threads crashed now and then; one process,
    or a command that failed (an exception, a non-zero exit), is as before."""
    import os
    from specco import cli
    exits = []

    def fake_main():
        if ends == "raises":
            raise RuntimeError("the command failed")
        if ends.startswith("exit"):
            sys.exit(int(ends[-1]))
    monkeypatch.setattr(cli, "main", fake_main)
    monkeypatch.setattr(os, "_exit", exits.append)
    monkeypatch.setenv("WORLD_SIZE", world)
    if ends == "raises":
        with pytest.raises(RuntimeError, match="the command failed"):
            cli.run_main()
    elif ends == "exit 1":
        with pytest.raises(SystemExit) as e:
            cli.run_main()
        assert e.value.code == 1
    else:
        cli.run_main()
    assert exits == ([0] if world == "2" and ends in ("returns", "exit 0") else [])
