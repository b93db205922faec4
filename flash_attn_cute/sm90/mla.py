"""SM90 MLA decode backend: the seam's check / plan / compile_key / compile / launcher for
the ``"mla"`` kind (see ``seam/__init__.py``). Two kernels: pages that hold whole 64-key
tiles (page size a multiple of 64) with a 16-bit or e4m3 cache take
``sm90/mla_decode_tma.py`` (two warpgroups, TMA, FlashMLA's seesaw over 64-key tiles;
e4m3: fp8 wgmma); other page sizes and e5m2 caches ``sm90/mla_decode.py`` (1 producer +
2 consumer warpgroups, cp.async row gathers, an FP8 cache widened to 16 bits).
The DSL is imported only when a kernel is compiled."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from flash_attn_cute.seam.backend_kit import mla_entry_points, mla_refusal, plan_splits
from flash_attn_cute.host.constants import MLA_NHEADS
from flash_attn_cute.host.problems import FwdPlan, MlaProblem
from flash_attn_cute.host.tuning import NO_TUNING, Tuning, fp8_stages_override
from flash_attn_cute.sm90.config import MlaRoles, QK_MODES, SMEM_LIMIT, mla_roles

NAME = "sm90"
NHEADS = MLA_NHEADS
# Automatic on 9.x (preferred to SM80): all GPU tests pass on the H200 in both Q K^T
# modes (2026-11-29), and it reads 3.06 TB/s at 768 x 2048 where the SM80 kernel reads 2.31.
AUTO = True
# what the kernels implement of backend_kit.MLA_FEATURES (FP8 queries: the TMA kernel alone, ``check``)
FEATURES = frozenset({"batch_invariant", "fp8_kv", "fp8_q"})
# 224 KB of shared memory and 384 threads at 504 registers per thread-slot: one CTA per
# SM. The split heuristic counts 64-row tiles of 32-key blocks against num_sms.
_CTAS_PER_SM = 1
_SPLIT_TOLERANCE = 0.9
# "one" against "split", H200, 2026-11-29, bf16, 64 heads, page 1 (kernel times): 627
# against 665 us at 768 x 2048, 337 against 354 at 768 x 1024, equal below one wave.
# "seesaw" against "one", H200, 2026-12-01, bench_mla.py (same run), TB/s: 128 heads 32 x
# 8192 page 64 1.763 / 1.687, 16 heads 256 x 4096 page 64 3.558 / 3.409, 768 x 2048 3.041
# / 3.023, the small rows within 1.2%; the consumers alone (no gathers) 4.33 against 3.80
# at 768 x 2048, so what bounds both now is the bytes the stages keep in flight.
DEFAULT_QK_MODE = "seesaw"


# The TMA kernel's config: 64-key tiles in two buffers.
TMA_CONFIG = (64, 2, "tma")
TMA_PAGE = 64  # page sizes it reads: multiples of this (a tile is one box row range of one page)


class MlaSm90Config(NamedTuple):
    tile_n: int  # keys per stage
    stages: int
    qk: str  # how the consumer warpgroups share Q K^T (``config.MlaRoles.qk``), or "tma" (mla_decode_tma)
    split_blocks: int = 0  # batch invariant: KV blocks per split (backend_kit.invariant_splits)
    fp8_stages: int = 0  # an FP8 cache's staging depth (``config.MlaRoles.fp8_stages``); 0: 16 bits
    scheduled: bool = False  # the TMA kernel over a device-computed schedule (``plan``)


def runs_on(capability: tuple) -> bool:
    return capability[0] == 9  # wgmma and setmaxnreg: sm_90a only


def check(problem: MlaProblem) -> Optional[str]:
    if problem.q_fp8 and problem.page_size % TMA_PAGE:
        return f"FP8 queries need pages of a multiple of {TMA_PAGE} keys (the TMA kernel), got {problem.page_size}"
    return mla_refusal(problem, FEATURES)


def uses_tma(problem: MlaProblem, qk: Optional[str] = None) -> bool:
    """The TMA kernel: a 16-bit or e4m3 cache (e4m3: fp8 wgmma, queries quantized in the
    kernel) in pages of a multiple of 64 keys, unless FLASH_ATTN_CUTE_MLA_SM90_QK (``qk``)
    names a mode of the gathering kernel ("tma" or unset: the TMA kernel where it applies,
    the gathering "seesaw" elsewhere; for an FP8 cache that is the kernel that widens it
    to 16 bits). FP8 queries always take it (``check`` refuses them other pages)."""
    return (problem.page_size % TMA_PAGE == 0 and problem.kv_dtype in (None, torch.float8_e4m3fn)
            and (qk in (None, "tma") or problem.q_fp8))


def roles(qk: Optional[str] = None, fp8: bool = False, fp8_stages: Optional[str] = None) -> MlaRoles:
    """The kernel's static roles for a Q K^T mode: "seesaw" (the warpgroups take turns
    computing S, tile by tile; 4 stages of 32 keys), "one" (warpgroup 0 computes S and
    hands P to warpgroup 1 through smem; 4 stages) or "split" (each half of the K slices,
    summed through smem; 3 stages). None: ``DEFAULT_QK_MODE``. An FP8 cache
    (``fp8``) takes two fp8 staging tiles (36 KB) from the 16-bit stages: 3, resp. 2
    (``fp8_stages`` "s,s8", ``tuning.mla_fp8_stages``, overrides both depths)."""
    mode = DEFAULT_QK_MODE if qk in (None, "tma") else qk
    if mode not in QK_MODES:
        raise ValueError(f"FLASH_ATTN_CUTE_MLA_SM90_QK={mode}: one of {QK_MODES + ('tma',)}")
    if not fp8:
        return MlaRoles(qk=mode) if mode != "split" else MlaRoles(stages=3, qk="split")
    stages, staging = fp8_stages_override(fp8_stages) or ((3, 2) if mode != "split" else (2, 2))
    if mode == "seesaw" and stages < 3:  # a warpgroup waits for tile i + 1 before releasing i - 1
        raise ValueError(f"FLASH_ATTN_CUTE_MLA_FP8_STAGES={fp8_stages}: qk=seesaw needs three KV stages at least")
    r = None
    try:  # MlaRoles asserts its shared memory fits; checked here too (python -O drops asserts)
        r = mla_roles(32, stages, mode, staging)
    except AssertionError:
        pass
    if r is None or r.smem_bytes() > SMEM_LIMIT:
        raise ValueError(f"FLASH_ATTN_CUTE_MLA_FP8_STAGES={fp8_stages}: {stages} KV stages and {staging} staging "
                         f"tiles are over the {SMEM_LIMIT} bytes of shared memory with qk={mode}")
    return r


def plan(problem: MlaProblem, num_splits: int, pack_gqa: Optional[bool], num_sms: Optional[int],
         tuning: Tuning = NO_TUNING, arch: Optional[str] = None) -> FwdPlan:
    """One CTA per (64 packed rows of a KV head's query heads, KV head, split, batch)
    (``mla_kernel.MlaTile``: a partial last tile is predicated); 65 to 128 heads take two
    CTAs per query position (two 64-row tiles, the cache read through L2 twice). ``num_splits`` 0 = the
    package's wave-efficiency heuristic on this grid (shapes only; batch invariant: fixed
    keys per split). Pages of a multiple of 64 keys over a 16-bit cache: the TMA kernel
    (``uses_tma``; 64-key tiles), which runs a device-computed schedule where the call
    gives one (``scheduler_metadata``; not with an explicit ``num_splits``, batch
    invariance or context parallelism, which plan on the host as the other kernel does).
    ``tuning.mla_sm90_qk`` overrides the Q K^T mode of the
    gathering kernel, and a mode of it also replaces the TMA kernel (A/B runs, and the
    GPU tests of each)."""
    rows = problem.max_seqlen_q * problem.qhead_per_kvhead  # packed rows of one KV head
    r = roles(tuning.mla_sm90_qk, problem.kv_fp8, tuning.mla_fp8_stages)
    tile_n, stages, qk, fp8_stages = r.tile_n, r.stages, r.qk, r.fp8_stages
    tma = uses_tma(problem, tuning.mla_sm90_qk)
    if tma:
        (tile_n, stages, qk), fp8_stages = TMA_CONFIG, 0
    if tma and problem.schedule_parts and num_splits == 0 and not problem.batch_invariant and not problem.cp:
        # A device-computed schedule (``scheduler_metadata``): its work items and partial
        # slots replace the host's splits (``kernels/mla_schedule.py``).
        from flash_attn_cute.host.mla_schedule import max_slots

        return FwdPlan(NAME, MlaSm90Config(tile_n, stages, qk, 0, fp8_stages, True), True,
                       max_slots(problem.schedule_parts))
    num_splits, split_blocks = plan_splits(problem, num_splits, num_sms, problem.nheads_kv, rows, tile_m=r.tile_m,
                                           tile_n=tile_n, ctas_per_sm=_CTAS_PER_SM, tolerance=_SPLIT_TOLERANCE)
    return FwdPlan(NAME, MlaSm90Config(tile_n, stages, qk, split_blocks, fp8_stages), True, num_splits)


# compile_key, compile, launcher: the seam's MLA entry points; the key ends with the config
# as one tuple (tile_n, stages, qk[, fp8_stages for an FP8 cache]).
compile_key, compile, launcher = mla_entry_points(
    NAME, "flash_attn_cute.sm90.mla_decode", "compile_mla_sm90",
    key_config=lambda c: ((c.tile_n, c.stages, c.qk) + ((c.fp8_stages,) if c.fp8_stages else ()),))
