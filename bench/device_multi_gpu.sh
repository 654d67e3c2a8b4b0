#!/bin/bash
# Issue 39's multi-GPU runs on a device machine of N H200s (nvidia-h200-xN), one torchrun per step, NCCL, NVLink
# multicast off (KINDS.md: it can take the host's shared GPUs out of service).
#
#   bash bench/device_multi_gpu.sh N [STEP ...]     # N = 2, 4 or 8 (the kind's GPU count); default: every step
#
# Each step writes one JSON into $OUT (at most 8 files come back a call: every step list below is <= 8) and prints
# its table into the call's output. Steps run one after another, each under `timeout` so one that hangs (a
# collective waiting on a dead rank) costs its own budget only; a failed step prints FAILED and the next runs.
# Time estimates per step ("est.", NOT measured: scaled from the one-GPU runs of BENCHMARKS.md, start-up of N
# ranks and CUDA-graph capture included). A kind's steps together exceed one 10-minute call, so make two calls
# per kind, part A then part B:
#
#   N=2  A: check fsdp3b fsdp7b refit (~1.5 + 1 + 2 + 1.5 = 6 min)   B: engine e72b ep1 epN moe (~2 + 3 + 1 + 1 + 1)
#   N=4  A: check fsdp3b fsdp7b refit (~1.5 + 1 + 1.5 + 1.5 = 5.5)   B: engine e72b ep1 epN moe (~2 + 3 + 1 + 1 + 1)
#   N=8  A: fsdp3b fsdp7b refit a3b (~1 + 1.5 + 2 + 3 = 7.5 min)     B: engine e72b ep1 epN moe (~2 + 3 + 1 + 1 + 1)
#
# The steps (torchrun --nproc-per-node N unless said):
#   check    bench/multi_gpu_check.py at world 2 (always 2 ranks: the dp_shard 2, rollout.tp 2, ep 2 against
#            the world-1 trainer on the same rollouts, bf16 bounds in its docstring; exits 1 on a failed bound).
#            est. 1.5 min (tiny models; graph capture of the engines)
#   fsdp3b   bench/fsdp_step.py --sizes 3b: the bf16 co-training step at dp_shard N, 32 rows x 2,048 tokens split
#            over the ranks; per-rank step and peak, the planner beside it. est. 1 min (3.5 s a step at world 1)
#   fsdp3bc  fsdp3b with the layers compiled (train.compile = inductor, inside FSDP's hooks; not in the default
#            list: run it beside fsdp3b when a call has room). est. 2 min (the compile included)
#   fsdp7b   the same for Qwen2.5-7B's shape (does not fit one GPU with its AdamW state), micro-batches of 2 rows.
#            est. 1.5-2 min
#   refit    bench/refit.py --sizes 3b at dp_shard N: the streamed refit from the FSDP shards into every rank's
#            bf16 engine (buckets whole/64/512 MB, guard on/off) and the offload cycle. est. 1.5 min
#   engine   bench/engine_tp1.py --model 8b at rollout tp N against the whole engine on every rank: plain step,
#            verify, speculative round and speedup, B 1 / 32, KV 1,024. est. 2 min
#   e72b     the same for Qwen2.5-72B's shape (143 GB in bf16: no GPU holds it whole), the shard alone (--no-whole:
#            built without a whole copy), 71 / 36 / 18 GB a rank at tp 2 / 4 / 8. est. 3 min
#   ep1/epN  bench/ep_step.py --size 1b (configs/moe.toml's MoE) at dp_shard N, ep 1 and ep N. est. 1 min each
#   moe      bench/moe_verify.py at rollout tp N (its default 16-expert model; kv heads 8 at N = 8). est. 1 min
#   a3b      bench/ep_step.py --size a3b at ep N (Qwen3-30B-A3B's shape: N = 8 only). est. 3 min
# The world-1 figures they stand beside are BENCHMARKS.md's (one H200): fsdp_step plain / fsdp1 (1.5b, 3b), refit
# at world 1, engine_tp1 at tp 1 (0.5b; the 8b's tp 1 is the `whole` engine of the engine step itself), moe_verify
# at tp 1. Not yet run on one H200: `python3 bench/ep_step.py --device cuda --size 1b` (the MoE step at world 1).
set -u
N=${1:?usage: bash bench/device_multi_gpu.sh N [STEP ...]}
shift
STEPS=${*:-check fsdp3b fsdp7b refit engine ep1 epN moe}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/mgpu_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__, "GPUs", torch.cuda.device_count())'
run() {  # run NAME SECONDS CMD...: one step, bounded, its failure reported and survived
  local name=$1 secs=$2; shift 2
  echo "=== $name ($(date -u +%H:%M:%S))"
  local t0=$SECONDS
  timeout "$secs" "$@" 2>&1 | grep -v -E 'UserWarning|_register_pre_backward_hook|^\s*$' | tail -40
  local rc=${PIPESTATUS[0]}
  echo "=== $name rc=$rc $((SECONDS - t0)) s"
  [ "$rc" = 0 ] || echo "=== $name FAILED"
}
TR="python3 -m torch.distributed.run --standalone --nproc-per-node"
for step in $STEPS; do
  case $step in
    check)  run check 300 $TR 2 bench/multi_gpu_check.py --device cuda --out "$OUT/multi_gpu_check_w2.json" ;;
    fsdp3b) run fsdp3b 240 $TR "$N" bench/fsdp_step.py --device cuda --sizes 3b --reps 4 \
              --out "$OUT/fsdp_step_w${N}_3b.json" ;;
    # 7b: micro-batches of 2 rows (the planner: 136 GiB a rank at 4 rows and dp_shard 2, too close to the H200's
    # 139 GiB; 102 at 2 rows, 60 at dp_shard 8)
    fsdp3bc) run fsdp3bc 300 $TR "$N" bench/fsdp_step.py --device cuda --sizes 3b --reps 4 --compile inductor \
              --out "$OUT/fsdp_step_w${N}_3b_compiled.json" ;;
    fsdp7b) run fsdp7b 300 $TR "$N" bench/fsdp_step.py --device cuda --sizes 7b --micro-rows 2 --reps 4 \
              --out "$OUT/fsdp_step_w${N}_7b.json" ;;
    refit)  run refit 300 $TR "$N" bench/refit.py --device cuda --sizes 3b --buckets whole,64,512 --reps 3 \
              --out "$OUT/refit_w${N}.json" ;;
    engine) run engine 300 $TR "$N" bench/engine_tp1.py --device cuda --model 8b --batch-sizes 1,32 \
              --prompt-lens 1024 --out "$OUT/engine_tp${N}_8b.json" ;;
    e72b)   run e72b 400 $TR "$N" bench/engine_tp1.py --device cuda --model 72b --no-whole --batch-sizes 1,32 \
              --prompt-lens 1024 --out "$OUT/engine_tp${N}_72b.json" ;;
    ep1)    run ep1 240 $TR "$N" bench/ep_step.py --device cuda --size 1b --ep 1 --reps 4 \
              --out "$OUT/ep_step_w${N}_ep1.json" ;;
    epN)    run epN 240 $TR "$N" bench/ep_step.py --device cuda --size 1b --ep "$N" --reps 4 \
              --out "$OUT/ep_step_w${N}_ep${N}.json" ;;
    moe)    kvh=4; [ "$N" -ge 8 ] && kvh=8  # the kv heads must split N ways
            run moe 240 $TR "$N" bench/moe_verify.py --device cuda --kv-heads $kvh --batches 1,8,32,128 \
              --out "$OUT/moe_verify_tp${N}.json" ;;
    a3b)    run a3b 400 $TR "$N" bench/ep_step.py --device cuda --size a3b --ep "$N" --rows 16 --reps 3 \
              --out "$OUT/ep_step_w${N}_a3b.json" ;;
    *) echo "unknown step $step (check fsdp3b fsdp7b refit engine e72b ep1 epN moe a3b)"; exit 2 ;;
  esac
done
ls -la "$OUT"
