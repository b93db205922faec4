"""Tile sweep of the SM80 kernel on one prefill shape per head dim (tuning aid).

Each tile is its own plan and compile: FLASH_ATTN_CUTE_SM80_TILE="m,n,warps,q_in_regs"
is read at the API edge on every call and is part of the per-call and plan caches' keys
(``tuning.py``), so each iteration runs the tile it names; the ``config`` column is the
plan the call resolved to (``fwd.resolve``), which the CSV shows distinct per tile.

    python benchmarks/bench_tiles.py [--csv tiles.csv] [--seqlen 8192] [--no-md]
"""

import argparse
import os

import common
from common import attention_flops, report

TILES = {
    64: ["128,64,4,1", "128,64,4,0", "128,128,8,0", "128,128,8,1"],
    128: ["128,64,4,0", "128,128,8,0", "64,64,4,1", "64,128,4,1"],
    256: ["128,64,8,0", "64,64,4,0"],
}
COLUMNS = ["impl", "causal", "B", "S", "H", "D", "tile", "config", "ms", "tflops"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--csv", default="tiles.csv")
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--no-md", action="store_true")
    return p.parse_args(argv)


def resolved_config(q, k, causal):
    """The config the call's plan holds (what was compiled and launched)."""
    import torch

    from flash_attn_cute import fwd, tuning
    from flash_attn_cute.problems import FwdProblem

    b, s, h, d = q.shape
    problem = FwdProblem(dtype=q.dtype, batch=b, max_seqlen_q=s, max_seqlen_k=k.shape[1], nheads=h,
                         nheads_kv=k.shape[2], d=d, d_v=d, softmax_scale=d ** -0.5, causal=causal,
                         window_left=-1, window_right=0 if causal else -1, softcap=0.0, varlen_q=False,
                         varlen_k=False, has_seqused_k=False, page_size=0, has_lse=False)
    return fwd.resolve(problem, "sm80", 1, None, torch.device("cuda"), tuning.from_env()).plan.config


def main(argv=None):
    args = parse_args(argv)
    import torch
    from flash_attn_cute import flash_attn_func

    rows = []
    for d, heads in ((64, 32), (128, 16), (256, 8)):
        q, k, v = (common.randn(4, args.seqlen, heads, d, dtype=torch.bfloat16) for _ in range(3))
        for causal in (False, True):
            flops = attention_flops(4, heads, args.seqlen, args.seqlen, d, causal=causal)
            for tile in TILES[d]:
                os.environ["FLASH_ATTN_CUTE_SM80_TILE"] = tile
                config = ""
                try:
                    ms = common.bench(lambda: flash_attn_func(q, k, v, causal=causal, backend="sm80"))
                    tf = flops / ms / 1e9
                    config = ",".join(str(int(x)) for x in resolved_config(q, k, causal))
                except Exception as e:  # a tile may not fit smem/registers
                    ms, tf = float("nan"), float("nan")
                    common.print_exception(f"d{d} tile {tile}", e)
                rows.append(dict(impl="ours_sm80", causal=causal, B=4, S=args.seqlen, H=heads, D=d, tile=tile,
                                 config=config, ms=ms, tflops=tf))
                print(f"d{d:3d} causal={causal!s:5} tile {tile:10s} plan {config:10s} {ms:8.3f} ms {tf:7.1f} TFLOP/s",
                      flush=True)
    os.environ.pop("FLASH_ATTN_CUTE_SM80_TILE", None)
    report(args, f"SM80 tile sweep, b4 s{args.seqlen} bf16 (TFLOP/s)", "SM80 tile sweep", rows, COLUMNS,
           notes="Each row's tile is planned and compiled on its own (config = the resolved plan); "
                 "causal FLOPs halved.")
    return rows


if __name__ == "__main__":
    main()
