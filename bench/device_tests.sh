#!/bin/bash
# The test suite's GPU paths on the GPU machine (CI has no GPU): the CUDA-graphed engine, the Triton kernels
# compiled for the device (on CPU they run under Triton's interpreter), the bf16 cases the interpreter cannot
# round like the GPU, and the CUDA-only tests (skipped on CPU).
#
#   bash bench/device_tests.sh                  # the default files below, fast lane
#   bash bench/device_tests.sh tests/test_rollout.py -k cuda
#
# Call it with `carry: [".whl"]` (bench/device_wheels.sh puts pytest's wheels there); it installs them into
# /tmp/site on a fresh machine, as bench/device_rl.sh does.
set -u
export PYTHONPATH=/tmp/site:$PWD/.whl/stubs:$PWD PYTHONUNBUFFERED=1
if [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ $# -eq 0 ]; then
  set -- tests/test_rollout.py tests/test_decode_path.py tests/test_block_rollout.py tests/test_block_runner.py \
         tests/test_attention_ops.py tests/test_compaction.py tests/test_speculative.py tests/test_compile.py \
         tests/test_coupled.py tests/test_micro_batch_indices.py \
         -m "not slow"
fi
python3 -m pytest -q -p no:cacheprovider "$@" 2>&1 | tail -30
