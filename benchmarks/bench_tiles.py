"""Tile sweep of the SM80 kernel on one prefill shape per head dim (tuning aid).

Each tile is a separate compile; FLASH_ATTN_CUTE_SM80_TILE selects it. Prints TFLOP/s
and writes a CSV: impl,causal,B,S,H,D,tile,avg_ms,tflops.
"""

import argparse
import os

import common  # noqa: F401  (puts the repo on sys.path)

TILES = {
    64: ["128,64,4,1", "128,64,4,0", "128,128,8,0", "128,128,8,1"],
    128: ["128,64,4,0", "128,128,8,0", "64,64,4,1", "64,128,4,1"],
    256: ["128,64,8,0", "64,64,4,0"],
}


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--csv", default="tiles.csv")
    p.add_argument("--seqlen", type=int, default=8192)
    args = p.parse_args()
    import torch
    from flash_attn_cute import flash_attn_func

    rows = []
    for d, heads in ((64, 32), (128, 16), (256, 8)):
        q, k, v = (common.randn(4, args.seqlen, heads, d, dtype=torch.bfloat16) for _ in range(3))
        for causal in (False, True):
            flops = 4 * 4 * heads * args.seqlen * args.seqlen * d / (2 if causal else 1)
            for tile in TILES[d]:
                os.environ["FLASH_ATTN_CUTE_SM80_TILE"] = tile
                try:
                    ms = common.bench(lambda: flash_attn_func(q, k, v, causal=causal, backend="sm80"))
                    tf = flops / ms / 1e9
                except Exception as e:  # a tile may not fit smem/registers
                    ms, tf = float("nan"), float("nan")
                    print(f"d{d} tile {tile}: {type(e).__name__}: {str(e)[:200]}")
                rows.append(dict(impl="ours_sm80", causal=causal, B=4, S=args.seqlen, H=heads, D=d,
                                 tile=tile, avg_ms=f"{ms:.4f}", tflops=f"{tf:.1f}"))
                print(f"d{d:3d} causal={causal!s:5} tile {tile:10s} {ms:8.3f} ms {tf:7.1f} TFLOP/s", flush=True)
    os.environ.pop("FLASH_ATTN_CUTE_SM80_TILE", None)
    with open(args.csv, "w") as f:
        f.write(",".join(rows[0]) + "\n")
        for r in rows:
            f.write(",".join(str(x) for x in r.values()) + "\n")


if __name__ == "__main__":
    main()
