#!/usr/bin/env bash
# One batched GPU session: sharded GPU tests in parallel (compiles spread over cores),
# then the benchmarks. Logs and CSVs go to $OUT (the device tool brings them back).
#   bash benchmarks/gpu_run.sh [tests|bench|all] [extra pytest args]
set -u
what=${1:-all}; shift || true
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source .gpu/setup.sh || exit 1
export FLASH_ATTN_CUTE_CACHE_DIR=${FLASH_ATTN_CUTE_CACHE_DIR:-/tmp/fac_cache}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
if [ "$what" = tests ] || [ "$what" = all ]; then
  n=${SHARDS:-6}
  start=$(date +%s)
  for i in $(seq 0 $((n - 1))); do
    FLASH_ATTN_CUTE_TEST_SHARD=$i/$n timeout ${TEST_TIMEOUT:-420} python -m pytest -q -m gpu -p no:cacheprovider \
      tests/test_flash_attn_gpu.py tests/test_combine_gpu.py "$@" > "$OUT/test_$i.log" 2>&1 &
  done
  wait
  echo "tests took $(( $(date +%s) - start )) s"
  for i in $(seq 0 $((n - 1))); do echo "--- shard $i"; grep -E "passed|failed|error" "$OUT/test_$i.log" | tail -2; done
  cat "$OUT"/test_*.log > "$OUT/tests.log" && rm -f "$OUT"/test_*.log  # the device tool returns 8 files at most
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -40
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout 120 python benchmarks/bench_decode_splits.py --csv "$OUT/decode_splits.csv" 2>&1 | tail -16
  timeout 120 python benchmarks/bench_decode_splits.py --hkv 8 --csv "$OUT/decode_splits_gqa.csv" 2>&1 | tail -16
  timeout 120 python benchmarks/bench_decode_splits.py --paged 64 --csv "$OUT/decode_splits_paged64.csv" 2>&1 | tail -16
  timeout 240 python benchmarks/bench_prefill.py --csv "$OUT/prefill.csv" 2>&1 | tail -32
  cp benchmarks/RESULTS.md "$OUT/RESULTS.md"
fi
