"""README.md's worked example ("Train your own model on your own data") runs as written, and the two guides stay short.

What the test takes from README.md:

* every fenced block after `<!-- worked-example-file: NAME -->` is written, verbatim, to NAME in a temporary working
  directory (the data file, the reward function, the transformers snippet the reader writes);
* every ```bash block after `<!-- worked-example -->` is run there, command by command in order (`\\` continuations
  joined, `#` comment lines dropped, each line split as the shell splits it). A command is `specco ...` (run
  in-process through `specco.cli.main`) or `python FILE` (a subprocess); anything else fails the test, so keep the
  worked example in those two forms.

What it substitutes, and nothing else:

* `specco train` / `specco compare`: the value of `--policy` (SmolLM2 in the README, which needs the `gguf` package
  and 7 GB of memory) becomes a tiny random Hugging Face Llama (`job_helpers.tiny_llama`, 8 layers so the EAGLE-3
  draft gets the three aux layers vLLM's export needs), and `job_helpers.job_overrides` is appended (2 RL steps of
  2 prompts x 2 samples of <= 8 tokens, a 2-step warm start, CPU); the README's own overrides come first, so these
  win where both set a key. The README's `--out` is kept.
* `specco generate`: `--max-new-tokens 8 --device cpu` appended.

Then every path of the README's out_dir table must exist, and each command's own outputs must be there. Fails when a
README command, flag, override key, file name or output path stops working.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from job_helpers import job_overrides, tiny_llama

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
FENCE = re.compile(r"```[^\n]*\n(.*?)^```", re.S | re.M)

pytestmark = pytest.mark.e2e


def _block_after(text: str, pos: int) -> str:
    m = FENCE.search(text, pos)
    assert m is not None, f"README.md: no fenced block after the marker at offset {pos}"
    assert text[pos:m.start()].strip() == "", "README.md: a worked-example marker must sit right above its block"
    return m.group(1)


def worked_example(text: str) -> tuple[dict[str, str], list[list[str]]]:
    """(files the reader writes: name -> content, commands: argv lists in order) from README.md's markers."""
    files = {m.group(1): _block_after(text, m.end())
             for m in re.finditer(r"<!-- worked-example-file: (\S+) -->", text)}
    commands = []
    for m in re.finditer(r"<!-- worked-example -->", text):
        block = _block_after(text, m.end()).replace("\\\n", " ")
        commands += [shlex.split(line) for line in block.splitlines()
                     if line.strip() and not line.lstrip().startswith("#")]
    return files, commands


def out_table_paths(text: str) -> list[str]:
    """The paths in the first column of the table that follows the first worked-example command block."""
    start = text.index("<!-- worked-example -->")
    table = re.search(r"^\| path \| what \|\n\|[-| ]+\|\n((?:\|.*\n)+)", text[start:], re.M)
    assert table is not None, "README.md: the worked example's table of out_dir paths is missing"
    paths = []
    for row in table.group(1).splitlines():
        paths += re.findall(r"`([^`]+)`", row.split("|")[1])
    return paths


def _substitute(argv: list[str], policy: Path, run_out: list[str]) -> list[str]:
    cmd = argv[1]
    if cmd in ("train", "compare"):
        assert "--policy" in argv, f"the worked example's `specco {cmd}` names no --policy: {argv}"
        argv = list(argv)
        argv[argv.index("--policy") + 1] = str(policy)
        out = argv[argv.index("--out") + 1]
        run_out.append(out)
        return argv[1:] + ["--quiet"] + [o for o in job_overrides(Path(out)) if not o.startswith("out_dir=")]
    if cmd == "generate":
        return argv[1:] + ["--max-new-tokens", "8", "--device", "cpu"]
    return argv[1:]


def _run_specco(args: list[str]):
    from specco.cli import main
    try:
        main(args)
    except SystemExit as e:  # main exits non-zero on a handled error (ConfigError, RewardError, ...)
        assert e.code in (0, None), f"`specco {shlex.join(args)}` exited with {e.code}"


@pytest.mark.slow
def test_readme_worked_example_runs_as_written(tmp_path, monkeypatch):
    text = README.read_text(encoding="utf-8")
    files, commands = worked_example(text)
    assert {"problems.jsonl", "my_rewards.py", "load.py"} <= files.keys(), sorted(files)
    assert [c[:2] for c in commands if c[0] == "specco"][0] == ["specco", "train"], commands
    policy = tiny_llama(tmp_path / "tiny_llama", num_layers=8)
    work = tmp_path / "work"
    work.mkdir()
    for name, content in files.items():
        (work / name).write_text(content)
    monkeypatch.chdir(work)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    run_out: list[str] = []
    for argv in commands:
        if argv[0] == "specco":
            _run_specco(_substitute(argv, policy, run_out))
            if argv[1] == "export":
                assert (work / argv[argv.index("--out") + 1] / "config.json").is_file()
        elif argv[0] == "python" and len(argv) == 2 and argv[1] in files:
            r = subprocess.run([sys.executable, argv[1]], cwd=work, env=env, capture_output=True, text=True,
                               timeout=300)
            assert r.returncode == 0, f"`python {argv[1]}` failed:\n{r.stderr[-3000:]}"
            assert r.stdout.strip(), f"`python {argv[1]}` printed nothing"
        else:
            pytest.fail(f"README.md's worked example runs `{shlex.join(argv)}`, which this test does not know how "
                        "to run: keep it to `specco ...` and `python FILE` (tests/test_readme.py)")
    assert run_out, "the worked example never runs specco train"
    out = work / run_out[0]
    for p in out_table_paths(text):
        assert (out / p).exists(), f"README.md says {p} is in out_dir; {out} holds {sorted(os.listdir(out))}"
    assert (out / "policy" / "config.json").is_file() and (out / "draft").is_dir()
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2  # job_overrides' 2 RL steps


def test_worked_example_parses():
    """Fast: the markers are there and the commands parse (the slow test runs them)."""
    files, commands = worked_example(README.read_text(encoding="utf-8"))
    assert files and commands
    assert any(c[:2] == ["specco", "train"] for c in commands)


def test_guides_stay_short():
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 350
    assert len((ROOT / "BENCHMARKS.md").read_text(encoding="utf-8").splitlines()) <= 400
