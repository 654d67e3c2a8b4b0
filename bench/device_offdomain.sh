#!/bin/bash
# Issue 36's off-domain start on the GPU machine: the three runs of configs/drift_offdomain_draft.toml's header
# (the drift SFT policy, the off-domain warm draft, the RL run) in order, each started once the one before it has
# written its summary, across device calls of at most 10 minutes; the stage outputs live on the machine, so make
# the next call at once (bench/device_rl.sh says why).
#
#   bash bench/device_offdomain.sh SECONDS
#   RL_OVERRIDES="train.steps=60" bash bench/device_offdomain.sh SECONDS   # the RL stage's overrides (same on each call)
#
# SECONDS counts from $CALL_START (epoch seconds, exported by the call's command line before anything else it runs)
# or from now. A stage followed in this call comes back as one archive, $OUT/<stage>.tar (bench/device_rl.sh's
# run.tgz, the warm drafts' metrics; one file each, as the device returns at most 8); a stage an earlier call saw
# finish is skipped.
set -u
END=$(( ${CALL_START:-$(date +%s)} + ${1:-540} ))
left() { echo $(( END - $(date +%s) )); }
ROOT=$OUT
stage() {  # stage NAME SUMMARY CONFIG: follow (or start) one stage; true once SUMMARY exists
  [ -f "$2" ] && return 0
  [ "$(left)" -gt 20 ] || return 1
  mkdir -p "$ROOT/$1"
  OUT=$ROOT/$1 bash bench/device_rl.sh "$3" "$(left)"
  tar cf "$ROOT/$1.tar" -C "$ROOT/$1" . && rm -rf "${ROOT:?}/$1"
  [ -f "$2" ]
}
OVERRIDES="train.steps=0 arms=[none] plain_baseline=[] frozen_shadow=[]" \
  stage sft runs/drift/summary.json configs/drift.toml || exit 0
stage draft runs/offdomain/summary.json configs/drift_offdomain_draft.toml || exit 0
OVERRIDES="${RL_OVERRIDES:-}" stage rl runs/drift_offdomain/summary.json configs/drift_offdomain.toml
