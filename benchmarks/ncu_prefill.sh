#!/usr/bin/env bash
# Nsight Compute profiles of the prefill kernels, ours (SM90) and FA4, one process each;
# the text reports land in $OUT/ncu_<impl>_d<D>[c].txt. Needs hardware counters (ncu works
# on the Firecracker runtime of the H200 machines, not on gVisor).
#   bash benchmarks/ncu_prefill.sh "128 64c"     # D with a trailing c for causal
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
cd "$(dirname "$0")"
for cfg in ${1:-128}; do
  D=${cfg%c}; causal=""; [ "$cfg" != "$D" ] && causal="--causal"
  for impl in ours fa4; do
    name=FlashAttnFwdSm90; [ $impl = fa4 ] && name=FlashAttentionForwardSm90
    timeout 240 ncu --clock-control none --kernel-name "regex:$name" --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
      --section SchedulerStats --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
      --section SourceCounters --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$,regex:sm__pipe_tensor.*cycles_active\.avg\.pct_of_peak_sustained_active$,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum' \
      python ncu_prefill.py --impl $impl --D "$D" $causal > "$OUT/ncu_${impl}_d${cfg}.txt" 2>&1
    echo "ncu $impl d$cfg rc=$?"; grep -E "Duration|pipe_tensor|Issue Slots Busy|issue_stalled"  "$OUT/ncu_${impl}_d${cfg}.txt" | head -40
  done
done
