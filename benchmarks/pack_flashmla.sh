#!/usr/bin/env bash
# FlashMLA alone (sglang-kernel's flashmla_ops, from the .peers bundle of
# ../shared/gpu/pack_peers.sh), repacked small enough (~1.1 MB) to carry beside .gpu in one
# device call: .gpu (~58 MB) and .peers (~11 MB) together pass the 64 MiB a call may carry, so
# MLA's same-run tables beside FlashMLA otherwise take two calls back to back on one warm
# machine. Writes .mla_peer/ (ignored by git); carry [".gpu", ".mla_peer"] and the benchmark
# scripts pick FlashMLA up (benchmarks/gpu_run.sh sources .mla_peer/with_mla_peer.sh).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
[ -f .peers/peers.tar.xz ] || { echo "pack_flashmla: run ../shared/gpu/pack_peers.sh first"; exit 1; }
t=$(mktemp -d); mkdir -p .mla_peer
xz -dc .peers/peers.tar.xz | tar -C "$t" -xf - sgl_kernel
(cd "$t" && tar cf - sgl_kernel) | xz -9e -T2 > .mla_peer/peers.tar.xz
cat > .mla_peer/with_mla_peer.sh <<'EOS'
# Source on the GPU machine after .gpu/setup.sh, in the same command: FlashMLA importable as
# `from sgl_kernel import flash_mla`.
mkdir -p /tmp/peers-site
[ -d /tmp/peers-site/sgl_kernel ] || xz -dc .mla_peer/peers.tar.xz | tar -C /tmp/peers-site -xf - || return 1
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/peers-site"
python3 -c "from sgl_kernel import flash_mla; print('peer: flashmla')" || return 1
EOS
rm -rf "$t"
ls -la .mla_peer
