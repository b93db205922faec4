#!/usr/bin/env bash
# A/B timing of two package trees in one GPU call: the working tree ("new") against a copy
# of another revision ("base"), made on the CPU machine beforehand (ab/ is ignored by git:
# name it in the call's carry, beside .gpu):
#   mkdir -p ab/base && git archive <rev> flash_attn_cute | tar -x -C ab/base
# The trees run alternately (base, new, base, new, ...) so that clock and machine drift fall
# on both, each with its own kernel cache; the command gets "--csv $OUT/<name>_<side>_<pass>.csv"
# appended, and benchmarks/ab_compare.py prints base / new per row at the end.
#   PASSES=2 bash benchmarks/ab_run.sh mla python benchmarks/bench_mla.py --backends sm90 --no-peers --no-md
# BASE (default ab/base) names the base tree; STEP_TIMEOUT (default 240 s) bounds each pass.
set -u
name=$1; shift
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
base=$(cd "${BASE:-ab/base}" && pwd) || exit 1
if [ -f .gpu/setup.sh ]; then source .gpu/setup.sh > /dev/null || exit 1; fi
for pass in $(seq 1 "${PASSES:-2}"); do
  for side in base new; do
    root=$([ "$side" = base ] && echo "$base" || pwd)
    FLASH_ATTN_CUTE_CACHE_DIR=/tmp/fac_ab_$side PYTHONPATH="$root:${PYTHONPATH:-}" timeout "${STEP_TIMEOUT:-240}" \
      "$@" --csv "$OUT/${name}_${side}_${pass}.csv" > "$OUT/${name}_${side}_${pass}.log" 2>&1
    echo "$side pass $pass: rc $?"
  done
done
python benchmarks/ab_compare.py "$OUT" "$name" | tee "$OUT/${name}_ab.txt"
