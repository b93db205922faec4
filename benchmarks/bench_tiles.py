"""Tile sweep of the SM80 kernel, or of the SM90 kernel in 16 bits (``--sm90``) or on FP8 q,
k, v (``--sm90-fp8``), on one prefill shape per head dim (tuning aid).

Each tile is its own plan and compile: FLASH_ATTN_CUTE_SM80_TILE="m,n,warps,q_in_regs"
(FLASH_ATTN_CUTE_SM90_TILE="m,n,stages") is read at the API edge on every call and is
part of the per-call and plan caches' keys (``tuning.py``), so each iteration runs the
tile it names; the ``config`` column is the plan the call resolved to (``seam.resolve``),
which the CSV shows distinct per tile.

    python benchmarks/bench_tiles.py [--sm90 | --sm90-fp8] [--csv tiles.csv] [--seqlen 8192] [--no-md]
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
# FP8 Q, K, V on SM90: tile_n a multiple of 32; (128, 256) spills the consumers' S.
FP8_SM90_TILES = {
    64: ["192,128,2", "128,128,2", "128,192,2", "192,160,2"],
    128: ["128,128,2", "128,192,2", "128,224,2"],
    256: ["128,64,2", "128,96,2", "128,128,2"],
}
# 16-bit SM90: the table's tiles, FA3's (C++) d128 non-causal 128 x 176 and tiles between
# (192 x 160 at d64 spills the consumers' registers: not listed).
SM90_TILES = {
    64: ["192,128,2", "128,128,2"],
    128: ["128,128,2", "128,144,2", "128,160,2", "128,176,2"],
    256: ["128,64,2", "128,80,2"],
}
# (backend, tile variable, tile table, label) per sweep
SWEEPS = {
    "sm80": ("sm80", "FLASH_ATTN_CUTE_SM80_TILE", TILES, "SM80 bf16"),
    "sm90": ("sm90", "FLASH_ATTN_CUTE_SM90_TILE", SM90_TILES, "SM90 bf16"),
    "sm90_fp8": ("sm90", "FLASH_ATTN_CUTE_SM90_TILE", FP8_SM90_TILES, "SM90 FP8 (e4m3 q, k, v)"),
}
COLUMNS = ["impl", "causal", "B", "S", "H", "D", "tile", "config", "ms", "tflops"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--csv", default="tiles.csv")
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--no-md", action="store_true")
    p.add_argument("--sm90", action="store_true", help="sweep the SM90 kernel in 16 bits")
    p.add_argument("--sm90-fp8", action="store_true", help="sweep the SM90 kernel on e4m3 q, k, v")
    p.add_argument("--tiles", default=None, help='replaces the table: "D=tile/tile;D=..." (e.g. '
                   '"128=128,192,2,0/128,192,2,4"); only those head dims run')
    p.add_argument("--causal", choices=["both", "true", "false"], default="both")
    return p.parse_args(argv)


def resolved_config(q, k, causal, backend="sm80"):
    """The config the call's plan holds (what was compiled and launched)."""
    import torch

    from flash_attn_cute import seam
    from flash_attn_cute.host import tuning
    from flash_attn_cute.host.problems import FwdProblem

    b, s, h, d = q.shape
    problem = FwdProblem(dtype=q.dtype, batch=b, max_seqlen_q=s, max_seqlen_k=k.shape[1], nheads=h,
                         nheads_kv=k.shape[2], d=d, d_v=d, softmax_scale=d ** -0.5, causal=causal,
                         window_left=-1, window_right=0 if causal else -1, softcap=0.0, varlen_q=False,
                         varlen_k=False, has_seqused_k=False, page_size=0, has_lse=False)
    return seam.resolve(problem, backend, 1, None, torch.device("cuda"), tuning.from_env()).plan.config


def main(argv=None):
    args = parse_args(argv)
    import torch
    from flash_attn_cute import flash_attn_func

    backend, var, tiles, what = SWEEPS["sm90_fp8" if args.sm90_fp8 else ("sm90" if args.sm90 else "sm80")]
    if args.tiles:
        tiles = {int(d): t.split("/") for d, t in (part.split("=") for part in args.tiles.split(";"))}
    causals = {"both": (False, True), "true": (True,), "false": (False,)}[args.causal]
    rows = []
    for d, heads in ((64, 32), (128, 16), (256, 8)):
        if d not in tiles:
            continue
        q, k, v = (common.randn(4, args.seqlen, heads, d, dtype=torch.bfloat16) for _ in range(3))
        if args.sm90_fp8:
            q, k, v = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
        for causal in causals:
            flops = attention_flops(4, heads, args.seqlen, args.seqlen, d, causal=causal)
            for tile in tiles[d]:
                os.environ[var] = tile
                config = ""
                try:
                    ms = common.bench(lambda: flash_attn_func(q, k, v, causal=causal, backend=backend))
                    tf = flops / ms / 1e9
                    config = ",".join(str(int(x)) for x in resolved_config(q, k, causal, backend))
                except Exception as e:  # a tile may not fit smem/registers
                    ms, tf = float("nan"), float("nan")
                    common.print_exception(f"d{d} tile {tile}", e)
                impl = f"ours_{backend}" + ("_fp8" if args.sm90_fp8 else "")
                rows.append(dict(impl=impl, causal=causal, B=4, S=args.seqlen, H=heads, D=d, tile=tile,
                                 config=config, ms=ms, tflops=tf))
                print(f"d{d:3d} causal={causal!s:5} tile {tile:10s} plan {config:10s} {ms:8.3f} ms {tf:7.1f} TFLOP/s",
                      flush=True)
    os.environ.pop(var, None)
    report(args, f"{what} tile sweep, b4 s{args.seqlen} (TFLOP/s)", f"{what} tile sweep", rows, COLUMNS,
           notes="Each row's tile is planned and compiled on its own (config = the resolved plan); "
                 "causal FLOPs halved.")
    return rows


if __name__ == "__main__":
    main()
