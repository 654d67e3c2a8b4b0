# Issue 35 validation on one H200 (not run yet: the device was refused): GPU tests of the new kernels, the
# kernel sweep old vs new + the fused verify tail, then the engine figures the goals are stated in.
# Needs old_decode_attention.py (git show main:specco/ops/decode_attention.py) beside it; run from the repo root.
set -x
export PYTHONUNBUFFERED=1
M="--device cuda --model 0.5b --k 4 --anchor graphed"
timeout 150 python -m pytest -q tests/test_decode_attention.py tests/test_fused_verify.py tests/test_decode_path.py -k "decode_attention or split_plan or fused or kernel_configs or chunk_edges or bf16" 2>&1 | tail -4
timeout 120 python bench/decode_attention.py --old old_decode_attention.py --sweep --tail --kv 8192,30000 --block-n 64 --warps 4 --stages 2,3 --waves 2,4 --out $OUT/da2.json 2>&1 | grep -v Warn
timeout 200 python bench/rollout.py $M --batch-sizes 8,32 --prompt-len 30000 --out $OUT/r30k.json 2>&1 | grep -v Warn | tail -8
timeout 100 python bench/rollout.py $M --batch-sizes 32 --prompt-len 8192 --no-check --out $OUT/r8k.json 2>&1 | tail -3
timeout 80 python bench/rollout.py $M --batch-sizes 32 --prompt-len 1024 --no-check --out $OUT/r1k.json 2>&1 | tail -3
timeout 120 python bench/rollout.py $M --draft dflash --k 7 --batch-sizes 8,32 --prompt-len 30000 --no-check --out $OUT/rdf.json 2>&1 | tail -4
