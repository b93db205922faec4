"""SM80 backend (mma.sync, cp.async): the seam's check / plan / compile / launcher.

Runs on every GPU of compute capability >= 8.0. Host-side only: the DSL is imported
when a kernel is first compiled, so planning (tests, benchmarks, AOT lists) is cheap.
"""

from __future__ import annotations

import os
from typing import Optional

from ..fwd import FwdPlan, FwdProblem, backend_entry_points, plan_rows, plan_splits

NAME = "sm80"
HEAD_DIMS = (64, 96, 128, 192, 256)  # for both d (q/k) and d_v (v)
# The split heuristic counts the grid in 128 x 128 tiles and two resident CTAs per SM
# (255 registers x 128 threads); a last wave 95% full (H200 sweep, 2026-11-29: 8 splits
# beat 7, 32 beat 28, for B=1 K=131072 H=32 with 32 / 8 KV heads).
_SPLIT_TILE_M, _SPLIT_TILE_N = 128, 128
_CTAS_PER_SM = 2
_SPLIT_TOLERANCE = 0.95

# Every GPU of compute capability >= 8.0 runs mma.sync and cp.async.
AUTO = True


def runs_on(capability: tuple) -> bool:
    return capability >= (8, 0)


def check(problem: FwdProblem) -> Optional[str]:
    for what, d in (("q/k", problem.d), ("v", problem.d_v)):
        if d not in HEAD_DIMS:
            return f"{what} head dimension {d} is not one of {HEAD_DIMS}"
    return None


def select_tile(head_dim: int, head_dim_v: int, rows_per_kv_head: int) -> tuple:
    """(tile_m, tile_n, num_warps, q_in_regs). acc_O holds tile_m * d_v / threads fp32
    values, acc_S tile_m * tile_n / threads, Q's fragment (when kept in registers)
    tile_m * d / threads 16-bit values; all under 255 registers per thread.
    FLASH_ATTN_CUTE_SM80_TILE="m,n,warps,q_in_regs" overrides (for tuning sweeps)."""
    override = os.environ.get("FLASH_ATTN_CUTE_SM80_TILE")
    if override:
        m, n, w, *q = (int(x) for x in override.split(","))
        return m, n, w, bool(q and q[0])
    d = max(head_dim, head_dim_v)
    if rows_per_kv_head <= 64:
        # Decode-shaped: a 128-row tile would be mostly padding.
        return (64, 128, 4, True) if d <= 128 else (64, 64, 4, False)
    if d <= 128:
        # 4 warps beat 8 on the H200 (2026-11-29 sweep, benchmarks/bench_tiles.py): each
        # warp re-reads K and V from smem, so more warps per tile cost smem bandwidth.
        # Q in registers did not pay at d=64 (within noise, and it spills).
        return 128, 64, 4, False
    return 128, 64, 8, False


def plan(problem: FwdProblem, num_splits: int, pack_gqa: Optional[bool], num_sms: Optional[int]) -> FwdPlan:
    """Tile, GQA packing (None = FA3's rule) and KV splits (0 = heuristic on ``num_sms``)."""
    pack_gqa, rows = plan_rows(problem, pack_gqa, _SPLIT_TILE_M)
    num_splits = plan_splits(problem, num_splits, num_sms, pack_gqa, rows, tile_m=_SPLIT_TILE_M,
                             tile_n=_SPLIT_TILE_N, ctas_per_sm=_CTAS_PER_SM, tolerance=_SPLIT_TOLERANCE)
    return FwdPlan(NAME, select_tile(problem.d, problem.d_v, rows), pack_gqa, num_splits)


# compile_key, compile, launcher: the seam's shared entry points (q_in_regs a bool in the key).
compile_key, compile, launcher = backend_entry_points(
    NAME, "flash_attn_cute.sm80.flash_fwd", "compile_fwd_sm80", tile=lambda plan: (*plan.tile[:3], bool(plan.tile[3])))
