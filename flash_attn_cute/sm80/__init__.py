"""SM80 backend (mma.sync, cp.async): the seam's check / plan / compile_key / compile / launcher.

Runs on every GPU of compute capability >= 8.0. Host-side only: the DSL is imported
when a kernel is first compiled, so planning (tests, benchmarks, AOT lists) is cheap.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from flash_attn_cute.seam.backend_kit import (feature_refusal, fwd_entry_points, head_dim_refusal, head_groups,
                                              plan_rows, plan_splits, tile_head_dims)
from flash_attn_cute.host.problems import FwdPlan, FwdProblem
from flash_attn_cute.host.tuning import NO_TUNING, Tuning
from flash_attn_cute.sm80.config import fp8_refusal, fp8_staging_fits, select_tile

NAME = "sm80"
# Tiles of every pair of constants.HEAD_DIM_TILES, for d (q/k) and d_v (v) apart; other head
# dims (multiples of 8 up to 256) run on the next tile, padded inside the kernel.
HEAD_DIM_PAIRS = None
# The split heuristic counts the grid in 128 x 128 tiles and two resident CTAs per SM
# (255 registers x 128 threads); a last wave 95% full (H200 sweep, 2026-11-29: 8 splits
# beat 7, 32 beat 28, for B=1 K=131072 H=32 with 32 / 8 KV heads).
_SPLIT_TILE_M, _SPLIT_TILE_N = 128, 128
_CTAS_PER_SM = 2
_SPLIT_TOLERANCE = 0.95

# Every GPU of compute capability >= 8.0 runs mma.sync and cp.async.
AUTO = True
# backend_kit.FEATURES this kernel implements
FEATURES = frozenset({"learnable_sink", "seqused_q", "batch_invariant", "fp8_kv", "paged_leftpad"})


class Sm80Config(NamedTuple):
    """The SM80 kernel's static choices (``config.select_tile``)."""

    tile_m: int
    tile_n: int
    num_warps: int
    q_in_regs: bool  # Q's fragment kept in registers for the whole KV loop
    split_blocks: int = 0  # batch invariant: KV blocks per split (backend_kit.invariant_splits)


def runs_on(capability: tuple) -> bool:
    return capability >= (8, 0)


def check(problem: FwdProblem) -> Optional[str]:
    reason = head_dim_refusal(problem, HEAD_DIM_PAIRS)
    if reason is not None:
        return reason
    if problem.kv_fp8:
        reason = fp8_refusal(*tile_head_dims(problem, HEAD_DIM_PAIRS), problem.batch_invariant)
        if reason is not None:
            return reason
    return feature_refusal(problem, FEATURES)


def plan(problem: FwdProblem, num_splits: int, pack_gqa: Optional[bool], num_sms: Optional[int],
         tuning: Tuning = NO_TUNING, arch: Optional[str] = None) -> FwdPlan:
    """Tile (of the padded head dims, ``tile_head_dims``; ``tuning.sm80_tile`` overrides),
    GQA packing (None = FA3's rule) and KV splits
    (0 = heuristic on ``num_sms``; batch invariant: fixed keys per split, ``num_splits``
    ignored). FP8 K/V: the tile's KV block shrinks where its staging would not fit the
    shared memory of ``arch`` (the call's, ``seam.resolve``; None: the tile of the 227 KB
    parts)."""
    pack_gqa, rows = plan_rows(problem, pack_gqa, _SPLIT_TILE_M)
    d, d_v = tile_head_dims(problem, HEAD_DIM_PAIRS)
    tile = select_tile(d, d_v, rows, tuning.sm80_tile, problem.batch_invariant)
    if problem.kv_fp8 and arch is not None:
        tile = fp8_staging_fits(tile, d, d_v, arch)
    num_splits, split_blocks = plan_splits(problem, num_splits, num_sms, head_groups(problem, pack_gqa), rows,
                                           tile_m=_SPLIT_TILE_M, tile_n=_SPLIT_TILE_N, ctas_per_sm=_CTAS_PER_SM,
                                           tolerance=_SPLIT_TOLERANCE, kernel_tile_n=tile[1])
    return FwdPlan(NAME, Sm80Config(*tile, split_blocks), pack_gqa, num_splits)


# compile_key, compile, launcher: the seam's shared entry points; the key holds the whole config.
compile_key, compile, launcher = fwd_entry_points(
    NAME, "flash_attn_cute.sm80.flash_fwd", "compile_fwd_sm80",
    key_tile=lambda c: (c.tile_m, c.tile_n, c.num_warps, bool(c.q_in_regs)))
