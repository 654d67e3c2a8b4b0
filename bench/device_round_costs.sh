#!/bin/bash
# One device call: the decode round's cost at the long workload's shape (configs/long.toml's 316M policy, KV
# position 1,536 in a 2,216-position cache), plain vs EAGLE-3 (synthetic agreeing pair, k = 3) vs DFlash
# (random weights, gamma = 7: its propose / verify / catch-up parts), in fp32 (TF32 matmuls, as the RL runs)
# and bf16 (rollout.dtype = "bfloat16"), at 16 / 64 / 256 rows; JSON per variant into $OUT (or
# bench/results/). Each variant runs in its own process so one that fails (e.g. out of memory) does not stop
# the others. ~3-4 minutes on an H200.
#
#   bash bench/device_round_costs.sh [BATCH_SIZES]
set -u
B=${1:-16,64,256}
DEST=${OUT:-bench/results}
mkdir -p "$DEST"
COMMON="--device cuda --model long316m --batch-sizes $B --prompt-len 1536 --max-new 680 --anchor graphed --iters 20"
for dt in float32 bfloat16; do
  for v in "eagle3:--draft self --k 3 --draft-vocab 101" "dflash:--draft dflash --k 7"; do
    name=${v%%:*}; args=${v#*:}
    # shellcheck disable=SC2086  # COMMON and args are lists of options
    timeout 150 python3 bench/rollout.py $COMMON $args --dtype "$dt" --no-check \
      --out "$DEST/rounds_long316m_${name}_${dt}_cuda.json" 2>&1 | grep -E "^B=|Error|error" | cut -c1-400
  done
done
