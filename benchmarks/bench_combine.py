"""The split-KV combine alone, timed as CUDA-graph replays, on the shapes the split plans
produce (MLA and GQA decode); GB/s counts the fp32 partials read and the output written.

    python benchmarks/bench_combine.py                          # split groups as planned, and 1
    python benchmarks/bench_combine.py --stages 8,4              # the cp.async ring depth too

``--stages`` rebuilds the kernel with another ring depth (an experiment, not a knob of the
package: it compiles outside the JIT cache). do_bench flushes L2 before each replay, so the
partials come from DRAM, where after the split kernel they would partly sit in L2.
"""

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

# (num_splits, batch, nheads, d_v): MLA 1 x 32768 and 64 x 2048 / 1024 (64 heads, d_v 512),
# GQA decode 1 x 131072 and 8 x 32768 (32 query heads, d 128), a 4-split batch.
SHAPES = [(128, 1, 64, 512), (2, 64, 64, 512), (128, 1, 32, 128), (32, 8, 32, 128), (4, 128, 32, 128)]


def launcher(stages: int, d_v: int, split_groups: int):
    import torch

    from flash_attn_cute.kernels import combine
    from flash_attn_cute.host.keys import DTYPE_NAMES, target_arch

    if stages == 8:
        return combine.combine_launcher(torch.bfloat16, d_v, False, False, split_groups)
    real = combine.FlashAttnCombine
    combine.FlashAttnCombine = functools.partial(real, stages=stages)
    try:
        fn = combine.compile_combine(combine.combine_key(DTYPE_NAMES[torch.bfloat16], d_v, False, target_arch(), False))
    finally:
        combine.FlashAttnCombine = real
    return lambda *t: fn(*t, split_groups)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", default="8", help="comma-separated ring depths (8: the package's)")
    p.add_argument("--csv", default=None)
    args = p.parse_args(argv)
    import torch

    from flash_attn_cute.host.heuristics import combine_split_groups

    rows = []
    for ns, b, h, dv in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(ns * b)
        out_partial = torch.randn(ns, b, 1, h, dv, device="cuda", generator=g)
        lse_partial = torch.randn(ns, b, h, 1, device="cuda", generator=g) * 3.0
        out = torch.empty(b, 1, h, dv, device="cuda", dtype=torch.bfloat16)
        nbytes = out_partial.numel() * 4 + lse_partial.numel() * 4 + out.numel() * 2
        for stages in (int(s) for s in args.stages.split(",")):
            for groups in sorted({combine_split_groups(ns), 1}, reverse=True):
                fn = launcher(stages, dv, groups)
                ms = common.bench(lambda: fn(out_partial, lse_partial, out, None, None), graph=True)
                rows.append(dict(num_splits=ns, batch=b, nheads=h, d_v=dv, stages=stages, split_groups=groups,
                                 us=round(ms * 1e3, 2), gb_s=round(nbytes / ms / 1e6, 1)))
                print(rows[-1], flush=True)
    if args.csv:
        common.write_csv(args.csv, list(rows[0]), rows)


if __name__ == "__main__":
    main()
