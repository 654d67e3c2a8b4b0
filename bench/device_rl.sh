#!/bin/bash
# A long `specco train CONFIG` on the GPU machine across device calls of at most 10 minutes each.
#
#   bash bench/device_rl.sh CONFIG [SECONDS]
#   SMOKE="key=value ..." bash bench/device_rl.sh CONFIG [SECONDS]
#   OVERRIDES="key=value ..." bash bench/device_rl.sh CONFIG [SECONDS]
#
# OVERRIDES go to the real run's command line (`specco train CONFIG $OVERRIDES`); give the same ones on every
# call of one run (a re-run with other overrides is refused by the out_dir's config check); not out_dir.
# With TAIL=1, the call that finds the run finished also runs `bench/tail_rows.py` on its out_dir (once; its
# JSON lands in $OUT): per-row acceptance of each warm draft against length and entropy.
# With SMOKE set, a fresh machine first runs CONFIG with those overrides (a tiny policy, a few steps: every
# arm's CUDA-graphed path) in the foreground, and starts the real run only if that succeeds.
# The first call installs the carried wheels (reasoning_gym and its pure-Python needs, in .whl/, made by
# bench/device_wheels.sh) and starts
# the run in its own process session, so it outlives the call; every call (the first included) then follows
# it for SECONDS (default 540) and copies the log tail and, once the run is done, its outputs into $OUT as
# one archive. A later call on the same (warm) machine finds the run still going and follows it again; on a
# fresh machine it starts the run again, which resumes from whatever stage outputs and checkpoints exist.
# Those live on the machine only: a machine left idle past its release time (30 s in this workplace) is handed
# back with them, and the next call starts the run over, SFT included (the fourteenth run lost its first call's
# 9 minutes so). Keep a call's SECONDS under its timeout by a margin and make the next call at once.
# Two runs in one call, the second started once the first is done (each its own archive; the MoE run and its twin,
# 2026-12-05):
#   mkdir -p $OUT/a $OUT/b; OUT=$OUT/a bash bench/device_rl.sh A.toml 520; [ -f <A's out_dir>/summary.json ] &&
#   [ $SECONDS -lt 480 ] && OUT=$OUT/b bash bench/device_rl.sh B.toml $((560-SECONDS))
set -u
CONFIG=$1; WAIT=${2:-540}
export PYTHONPATH=/tmp/site:$PWD/.whl/stubs:$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUTDIR=$(python3 -c "import tomllib,sys; print(tomllib.load(open(sys.argv[1],'rb'))['out_dir'])" "$CONFIG")
mkdir -p "$OUTDIR"
LOG=$OUTDIR/run.log
if [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
fi
if [ -n "${SMOKE:-}" ] && [ ! -f /tmp/smoke/summary.json ]; then
  # shellcheck disable=SC2086  # SMOKE is a list of overrides
  timeout 300 python3 -m specco train "$CONFIG" out_dir=/tmp/smoke $SMOKE 2>&1 | tr '\r' '\n' | grep -v -E 'it/s|s/it' | tail -25
  [ -f /tmp/smoke/summary.json ] || { echo "SMOKE FAILED"; exit 1; }
fi
if ! pgrep -f "specco train $CONFIG" >/dev/null; then
  if [ -f "$OUTDIR/summary.json" ]; then echo "done already"; else
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    # shellcheck disable=SC2086  # OVERRIDES is a list of overrides
    setsid nohup python3 -m specco train "$CONFIG" ${OVERRIDES:-} >>"$LOG" 2>&1 < /dev/null &
    sleep 2
  fi
fi
t0=$(date +%s)
snapshot() {  # what the run has written so far, as one archive in $OUT (a call cut short still returns it); no
  # weights: the arms' saved policies (~300 MB each at 76M) made the archive too large to return and its writing
  # ran a call past its limit
  [ -n "${OUT:-}" ] && tar czf "$OUT/run.tgz" -C "$OUTDIR" --exclude=ckpt --exclude=start_policy --exclude='warm_draft*' \
    --exclude=tb --exclude='*.safetensors' . 2>/dev/null
}
while pgrep -f "specco train $CONFIG" >/dev/null && [ $(( $(date +%s) - t0 )) -lt "$WAIT" ]; do
  sleep 5; [ $(( ($(date +%s) - t0) % 30 )) -lt 5 ] && snapshot
done
tr '\r' '\n' < "$LOG" | grep -v -E '^\s*$' | grep -v -E '[0-9]+%\|' | tail -40
tr '\r' '\n' < "$LOG" | grep -E '[0-9]+%\|' | tail -3
nvidia-smi --query-gpu=memory.used --format=csv,noheader
if [ -n "${OUT:-}" ]; then
  snapshot
  for d in "$OUTDIR"/warm_draft*; do
    [ -f "$d/warm_metrics.json" ] && cp "$d/warm_metrics.json" "$OUT/$(basename $d)_metrics.json"
    [ -f "$d/warm_history.jsonl" ] && cp "$d/warm_history.jsonl" "$OUT/$(basename $d)_history.jsonl"
  done
  [ -f "$OUTDIR/start_policy/sft_metrics.json" ] && cp "$OUTDIR/start_policy/sft_metrics.json" "$OUT/"
fi
if [ -n "${TAIL:-}" ] && [ -f "$OUTDIR/summary.json" ] && [ ! -f "$OUTDIR/tail_rows.json" ]; then
  # shellcheck disable=SC2086  # OVERRIDES is a list of overrides
  timeout 300 python3 bench/tail_rows.py "$CONFIG" ${OVERRIDES:-} --out "$OUTDIR/tail_rows.json" 2>&1 | tail -20
fi
[ -n "${OUT:-}" ] && [ -f "$OUTDIR/tail_rows.json" ] && cp "$OUTDIR/tail_rows.json" "$OUT/"
pgrep -f "specco train $CONFIG" >/dev/null && echo "STILL RUNNING" || echo "NOT RUNNING"
