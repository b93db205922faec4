#!/usr/bin/env bash
# One batched GPU session: sharded GPU tests in parallel (compiles spread over cores),
# then the benchmarks. Logs and CSVs go to $OUT (the device tool brings them back).
#   bash benchmarks/gpu_run.sh [tests|variants|bench|all] [extra pytest args]
# TESTS="tests/test_a.py ..." narrows the test run (default: every GPU test under tests/).
set -u
what=${1:-all}; shift || true
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# With the package installed normally (pip install -e ".[dev]") nothing is needed; the
# .gpu/ bundle (../shared/gpu/bundle.sh) is an option for machines without a registry.
if [ -f .gpu/setup.sh ]; then source .gpu/setup.sh || exit 1; fi
# FlashMLA beside .gpu in the same call (benchmarks/pack_flashmla.sh), for bench_mla's peer column.
if [ -f .mla_peer/with_mla_peer.sh ]; then source .mla_peer/with_mla_peer.sh || echo "gpu_run: FlashMLA from .mla_peer not importable; bench_mla runs without it"; fi
python -c "import flash_attn_cute, cutlass" || { echo "flash_attn_cute or the CuTe DSL is not importable"; exit 1; }
export FLASH_ATTN_CUTE_CACHE_DIR=${FLASH_ATTN_CUTE_CACHE_DIR:-/tmp/fac_cache}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
if [ "$what" = tests ] || [ "$what" = all ]; then
  n=${SHARDS:-12}
  start=$(date +%s)
  # Shard logs live outside $OUT (the device tool returns 8 files at most, and a run cut
  # short by an outer timeout would otherwise leave 16 of them there, most never returned).
  logs=$(mktemp -d)
  for i in $(seq 0 $((n - 1))); do
    FLASH_ATTN_CUTE_TEST_SHARD=$i/$n timeout ${TEST_TIMEOUT:-420} python -m pytest -q -m gpu -p no:cacheprovider \
      ${TESTS:-tests} "$@" > "$logs/test_$i.log" 2>&1 &
  done
  wait
  echo "tests took $(( $(date +%s) - start )) s"
  for i in $(seq 0 $((n - 1))); do echo "--- shard $i"; grep -E "passed|failed|error" "$logs/test_$i.log" | tail -2; done
  cat "$logs"/test_*.log > "$OUT/tests.log"
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -40
fi
if [ "$what" = variants ] || [ "$what" = all ]; then
  # Our kernels' compile keys do not depend on sizes: compile them in parallel at a tiny
  # size (into the disk cache), then time the real problem in one process.
  for v in causal sliding1024 document alibi softcap30; do
    timeout 240 python benchmarks/bench_variants.py --backends sm90 --variants $v --B 1 --S 512 --no-flex --no-md \
      > "$OUT/warm_$v.log" 2>&1 &
  done
  wait
  cat "$OUT"/warm_*.log > "$OUT/variants_warm.log" && rm -f "$OUT"/warm_*.log
  timeout 420 python benchmarks/bench_variants.py --backends sm90 --csv "$OUT/variants.csv" 2>&1 | tail -30
  cp benchmarks/RESULTS.md "$OUT/RESULTS.md"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout 300 python benchmarks/bench_prefill.py --fp8 --csv "$OUT/prefill.csv" 2>&1 | tail -40
  timeout 200 python benchmarks/bench_fp8_decode.py --csv "$OUT/fp8_decode.csv" 2>&1 | tail -20
  timeout 150 python benchmarks/bench_decode_splits.py --csv "$OUT/decode_splits.csv" 2>&1 | tail -28
  timeout 150 python benchmarks/bench_decode_splits.py --hkv 8 --csv "$OUT/decode_splits_gqa.csv" 2>&1 | tail -28
  timeout 200 python benchmarks/bench_paged_decode.py --csv "$OUT/paged_decode.csv" 2>&1 | tail -40
  timeout 90 python benchmarks/bench_host.py --csv "$OUT/host.csv" 2>&1 | tail -16
  timeout 240 python benchmarks/bench_mla.py --csv "$OUT/mla.csv" 2>&1 | tail -12
  timeout 240 python benchmarks/bench_serving_step.py --sinks --csv "$OUT/serving_step.csv" 2>&1 | tail -14
  timeout 240 python benchmarks/bench_serving_costs.py --csv "$OUT/serving_costs.csv" 2>&1 | tail -12
  timeout 120 python examples/serve_paged.py --steps 64 2>&1 | tail -6
  timeout 200 python benchmarks/bench_cp_decode.py --csv "$OUT/cp_decode.csv" 2>&1 | tail -12
  timeout 120 torchrun --nproc-per-node 1 examples/cp_decode.py 2>&1 | tail -3
  python benchmarks/plot_splits.py "$OUT"/decode_splits*.csv --out "$OUT/decode_splits.png" 2>&1 | tail -2
  cp benchmarks/RESULTS.md "$OUT/RESULTS.md"
fi
