"""SM90 MLA decode backend (1 producer + 2 consumer warpgroups, wgmma, cp.async gathers):
the MLA seam's check / plan / compile_key / compile / launcher (see ``flash_attn_cute.mla``).
The kernel is ``sm90/mla_decode.py``; the DSL is imported only when a kernel is compiled."""

from __future__ import annotations

import os
from typing import Optional

from ..cute_utils import DTYPE_NAMES, target_arch
from ..fwd import FwdPlan, plan_splits
from ..mla import MlaProblem

NAME = "sm90"
NHEADS = (16, 32, 64, 128)
# Automatic on 9.x (preferred to SM80): all GPU tests pass on the H200 in both Q K^T
# modes (2026-11-29), and it reads 3.06 TB/s at 768 x 2048 where the SM80 kernel reads 2.31.
AUTO = True
_TILE_M, _TILE_N = 64, 32  # mla_decode.MlaRoles
# 224 KB of shared memory and 384 threads at 504 registers per thread-slot: one CTA per
# SM. The split heuristic counts 64-row tiles of 32-key blocks against num_sms.
_CTAS_PER_SM = 1
_SPLIT_TOLERANCE = 0.9


def runs_on(capability: tuple) -> bool:
    return capability[0] == 9  # wgmma and setmaxnreg: sm_90a only


def check(problem: MlaProblem) -> Optional[str]:
    if problem.nheads not in NHEADS:
        return f"nheads {problem.nheads} is not one of {NHEADS}"
    return None


def plan(problem: MlaProblem, num_splits: int, num_sms: Optional[int]) -> FwdPlan:
    """One CTA per (64 packed rows, split, batch); 128 heads take two CTAs per query
    position (two 64-row tiles, the cache read through L2 twice). ``num_splits`` 0 =
    the package's wave-efficiency heuristic on this grid (shapes only)."""
    rows = problem.max_seqlen_q * problem.nheads
    num_splits = plan_splits(problem, num_splits, num_sms, True, rows, tile_m=_TILE_M, tile_n=_TILE_N,
                             ctas_per_sm=_CTAS_PER_SM, tolerance=_SPLIT_TOLERANCE)
    return FwdPlan(NAME, (_TILE_M, _TILE_N), True, num_splits)


# "one" against "split", H200, 2026-11-29, bf16, 64 heads, page 1 (kernel times): 627
# against 665 us at 768 x 2048, 337 against 354 at 768 x 1024, equal below one wave.
DEFAULT_QK_MODE = "one"


def roles():
    """The kernel's static roles: how the two consumer warpgroups share Q K^T (``MlaRoles.
    qk``): "one" (warpgroup 0 computes S and hands P to warpgroup 1 through smem; 4 stages
    of 32 keys) or "split" (each half of the K slices, summed through smem; 3 stages).
    FLASH_ATTN_CUTE_MLA_SM90_QK overrides the default (tuning, and the GPU tests of both)."""
    from .mla_decode import QK_MODES, MlaRoles

    mode = os.environ.get("FLASH_ATTN_CUTE_MLA_SM90_QK") or DEFAULT_QK_MODE
    if mode not in QK_MODES:
        raise ValueError(f"FLASH_ATTN_CUTE_MLA_SM90_QK={mode}: one of {QK_MODES}")
    return MlaRoles() if mode == "one" else MlaRoles(stages=3, qk="split")


def compile_key(problem: MlaProblem, plan: FwdPlan, arch: Optional[str] = None) -> tuple:
    """The kernel's compile key; a split-KV kernel always writes partial LSEs."""
    from .mla_decode import mla_key

    return mla_key(arch or target_arch(), DTYPE_NAMES[problem.dtype], problem.nheads, problem.causal,
                   plan.num_splits > 1, problem.has_lse or plan.num_splits > 1, roles())


def compile(key: tuple):
    from .mla_decode import compile_mla_sm90

    return compile_mla_sm90(key)


def launcher(problem: MlaProblem, plan: FwdPlan):
    """``launch(q_nope, q_pe, ckv, kpe, out, lse, cache_seqlens, page_table)``: the kernel
    (JIT disk cache, under ``mla_sm90``) with its runtime scalars bound."""
    from .. import jit_cache

    key = compile_key(problem, plan)
    kernel = jit_cache.get_or_compile("mla_sm90", key, lambda: compile(key))
    scalars = (float(problem.softmax_scale), int(plan.num_splits), int(problem.max_seqlen_q), int(problem.batch))
    return lambda *tensors: kernel(*tensors, *scalars)
