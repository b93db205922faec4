"""Hardware-counter profile of one prefill call: ours (SM90) against FA4, same problem.

Run under Nsight Compute, one implementation per process (the kernel-name filter picks
the attention kernel; the first call compiles and warms, the profiled one is the last):

    ncu --clock-control none --kernel-name regex:FlashAttnFwdSm90 --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \\
        python benchmarks/ncu_prefill.py --impl ours --D 128
    ncu ... --kernel-name regex:FlashAttentionForwardSm90 ... python benchmarks/ncu_prefill.py --impl fa4 --D 128

``benchmarks/ncu_prefill.sh`` runs both for the configurations RESULTS.md lists and
keeps the reports' text.
"""

import argparse
import sys

from common import load_fa4, randn

HEADS_FOR_DIM = {64: 32, 128: 16, 256: 8}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=["ours", "fa4"], required=True)
    p.add_argument("--B", type=int, default=4)
    p.add_argument("--S", type=int, default=8192)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--calls", type=int, default=3)
    args = p.parse_args(argv)
    import torch

    torch.manual_seed(0)
    H = HEADS_FOR_DIM.get(args.D, 2048 // args.D)
    q, k, v = (randn(args.B, args.S, H, args.D, dtype=torch.bfloat16) for _ in range(3))
    if args.impl == "ours":
        import flash_attn_cute

        fn = lambda: flash_attn_cute.flash_attn_func(q, k, v, causal=args.causal, backend="sm90")
    else:
        fa4, why = load_fa4()
        if fa4 is None:
            sys.exit(f"FA4 unavailable: {why}")
        fn = lambda: fa4.flash_attn_func(q, k, v, causal=args.causal)
    for _ in range(args.calls):
        fn()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
