#!/usr/bin/env bash
# Nsight Compute profiles, one process per implementation; text reports land in
# $OUT/ncu_<kind>_<impl>_<config>.txt. Needs hardware counters (ncu works on the
# Firecracker runtime of the H200 machines, not on gVisor).
#   bash benchmarks/ncu_profile.sh prefill "128 64c"       # D, trailing c = causal: ours (SM90) and FA4
#   IMPLS="ours-fp8:FlashAttnFwdSm90 fa3-fp8:device_kernel" bash benchmarks/ncu_profile.sh prefill 256  # FP8 q, k, v, FA3 beside
#   bash benchmarks/ncu_profile.sh mla "768x2048 64x1024"  # batch x seqlen, page 1, 64 heads: SM80 and SM90
#   bash benchmarks/ncu_profile.sh variant "document causal"  # bench_variants definitions, ours (SM90)
#   bash benchmarks/ncu_profile.sh decode 1x131072         # batch x seqlen, h32/8 d128: SM90 on bf16 and fp8 caches
#   IMPLS=sm90:MlaDecodeSm90 bash benchmarks/ncu_profile.sh mla 768x2048  # one implementation only
#   IMPLS="sm90:MlaDecodeSm90 sm90-fp8:MlaDecodeSm90" bash benchmarks/ncu_profile.sh mla 768x1024  # FP8 cache too
#   IMPLS="fi-fa3:BatchMLAPageAttentionHopperKernel sm90:MlaDecodeSm90" bash benchmarks/ncu_profile.sh mla 768x2048
#     # FlashInfer's fa3 kernel beside ours (with FlashInfer importable: ../shared/gpu/README.md)
#   IMPLS="flashmla:flash_fwd_splitkv_mla sm90:MlaDecodeSm90Tma" PAGE=64 bash benchmarks/ncu_profile.sh mla 768x2048
#     # FlashMLA's dense decode beside our TMA kernel (pages of 64; with .peers: ../shared/gpu/README.md);
#     # HEADS=128 for the 128-head rows, flashmla-fp8 / sm90-fp8 for the FP8 modes
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
cd "$(dirname "$0")"
kind=${1:-prefill}
for cfg in ${2:-128}; do
  if [ "$kind" = prefill ]; then
    D=${cfg%c}; extra="--D $D"; [ "$cfg" != "$D" ] && extra="$extra --causal"
    impls=${IMPLS:-"ours:FlashAttnFwdSm90 fa4:FlashAttentionForwardSm90"}
  elif [ "$kind" = decode ]; then
    extra="--batch ${cfg%x*} --seqlen ${cfg#*x}"
    impls="bf16:FlashAttnFwdSm90 fp8:FlashAttnFwdSm90"
  elif [ "$kind" = variant ]; then
    extra="--variant $cfg"
    impls="ours:FlashAttnFwdSm90"
  else
    extra="--batch ${cfg%x*} --seqlen ${cfg#*x} --page ${PAGE:-1} --heads ${HEADS:-64}"
    impls=${IMPLS:-"sm80:MlaDecodeSm80 sm90:MlaDecodeSm90"}
  fi
  for pair in $impls; do
    impl=${pair%%:*}; name=${pair#*:}; report="$OUT/ncu_${kind}_${impl}_${cfg}.txt"
    timeout 240 ncu --clock-control none --kernel-name "regex:$name" --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
      --section SchedulerStats --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
      --section SourceCounters --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$,regex:sm__pipe_tensor.*cycles_active\.avg\.pct_of_peak_sustained_active$,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum' \
      python ncu_profile.py "$kind" --impl "$impl" $extra > "$report" 2>&1
    echo "ncu $kind $impl $cfg rc=$?"; grep -E "Duration|pipe_tensor_cycles|DRAM Throughput|Issue Slots Busy|Achieved Occupancy|issue_stalled_(barrier|gmma|wait|long_scoreboard|mio_throttle|short_scoreboard)" "$report" | head -20
  done
done
