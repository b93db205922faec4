"""SM80 MLA decode backend (mma.sync, cp.async gathers): the MLA seam's check / plan /
compile_key / compile / launcher (see ``flash_attn_cute.mla``). The kernel is
``sm80/mla_decode.py``; the DSL is imported only when a kernel is compiled."""

from __future__ import annotations

import os
from typing import Optional

from ..cute_utils import DTYPE_NAMES, target_arch
from ..fwd import FwdPlan, plan_splits
from ..mla import MlaProblem

NAME = "sm80"
NHEADS = (16, 32, 64, 128)
AUTO = True
_TILE_M, _TILE_N = 64, 32  # mla_decode.MlaWarpRoles
# Shared memory of the kernel: Q 72 KB + stages x 36 KB + P 8 KB. Two stages fit the
# A100 (163 KB per CTA), three the H100/H200 and B200 (227 KB); GPUs with 99 KB
# (sm_86, sm_89, sm_120) cannot hold Q and one stage, so they are refused.
_SMEM_KB = {(8, 0): 163, (9, 0): 227, (10, 0): 227, (10, 3): 227}
# One CTA per SM (the smem above): the split heuristic counts the grid in 64-row tiles
# of 32-key blocks against num_sms resident CTAs, last wave at least 90% full.
_CTAS_PER_SM = 1
_SPLIT_TOLERANCE = 0.9


def runs_on(capability: tuple) -> bool:
    return tuple(capability) in _SMEM_KB


def stages_for(arch: str) -> int:
    """Pipeline depth: 3 from sm_90 on (188 KB of shared memory; H200, 2026-11-29: 2.31
    against 1.79 TB/s for 2 stages at 768 x 2048), 2 on the A100 (152 KB of its 163).
    FLASH_ATTN_CUTE_MLA_STAGES overrides it (tuning sweeps)."""
    sm = int("".join(c for c in arch[3:] if c.isdigit()))
    override = os.environ.get("FLASH_ATTN_CUTE_MLA_STAGES")
    if override:
        if override not in ("2", "3") or (override == "3" and sm < 90):
            raise ValueError(f"FLASH_ATTN_CUTE_MLA_STAGES={override}: 2, or 3 on sm_90 and later")
        return int(override)
    return 3 if sm >= 90 else 2


def check(problem: MlaProblem) -> Optional[str]:
    if problem.nheads not in NHEADS:
        return f"nheads {problem.nheads} is not one of {NHEADS}"
    return None


def plan(problem: MlaProblem, num_splits: int, num_sms: Optional[int]) -> FwdPlan:
    """One CTA per (64 packed rows, split, batch); ``num_splits`` 0 = the package's
    wave-efficiency heuristic on this grid (shapes only, never the device lengths)."""
    rows = problem.max_seqlen_q * problem.nheads
    num_splits = plan_splits(problem, num_splits, num_sms, True, rows, tile_m=_TILE_M, tile_n=_TILE_N,
                             ctas_per_sm=_CTAS_PER_SM, tolerance=_SPLIT_TOLERANCE)
    return FwdPlan(NAME, (_TILE_M, _TILE_N), True, num_splits)


def compile_key(problem: MlaProblem, plan: FwdPlan, arch: Optional[str] = None) -> tuple:
    """The kernel's compile key; a split kernel always writes partial LSEs."""
    from .mla_decode import mla_key

    arch = arch or target_arch()
    return mla_key(arch, DTYPE_NAMES[problem.dtype], problem.nheads, problem.causal, plan.num_splits > 1,
                   problem.has_lse or plan.num_splits > 1, stages_for(arch))


def compile(key: tuple):
    from .mla_decode import compile_mla_sm80

    return compile_mla_sm80(key)


def launcher(problem: MlaProblem, plan: FwdPlan):
    """``launch(q_nope, q_pe, ckv, kpe, out, lse, cache_seqlens, page_table)`` with the
    kernel (JIT disk cache, under ``mla_sm80``) and its runtime scalars bound."""
    from .. import jit_cache

    key = compile_key(problem, plan)
    fn = jit_cache.get_or_compile("mla_sm80", key, lambda: compile(key))
    scalars = (float(problem.softmax_scale), int(plan.num_splits), int(problem.max_seqlen_q), int(problem.batch))

    def launch(q_nope, q_pe, ckv, kpe, out, lse, cache_seqlens, page_table):
        fn(q_nope, q_pe, ckv, kpe, out, lse, cache_seqlens, page_table, *scalars)

    return launch
