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
from flash_attn_cute.host import heuristics
from flash_attn_cute.host.constants import D_CKV, D_KPE, MAX_SPLITS, MLA_NHEADS
from flash_attn_cute.host.problems import FwdPlan, MlaProblem
from flash_attn_cute.host.tuning import NO_TUNING, Tuning, fp8_stages_override
from flash_attn_cute.sm90.config import MlaRoles, QK_MODES, SMEM_LIMIT, TMA_MODES, mla_roles

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


# The TMA kernel's tiles: 64 keys, two buffers (its mode: ``DEFAULT_TMA_MODE``).
TMA_TILE = (64, 2)
# Its modes (``config.TMA_MODES``, FLASH_ATTN_CUTE_MLA_SM90_QK names one): "tma", "tma_runs"
# (no mask test in the unmasked blocks' steps) and "tma_lag" (those and a lagging row max).
# The default over a 16-bit cache is "tma_lag", over an e4m3 cache "tma". H100, 2026-12-07,
# one run, two alternating passes a mode (``results/mla_tma_modes_ab_h100_2026-12-07_s29.txt``),
# "tma" / "tma_lag" time: bf16 128 heads 1.026x (128 x 2048) and 1.024x (32 x 8192), 64 heads
# 1.002x (128 x 2048, 64 x 1024); an e4m3 cache under bf16 q 0.959-0.997x, e4m3 q 0.980-1.005x
# ("tma_runs": 0.969-1.010x). sm_90a SASS, 64 heads, the steady step's instructions a thread,
# warpgroup 0 / 1: "tma" 1,094 / 1,037, "tma_runs" 1,038 / 918, "tma_lag" 801 / 839 where
# its rescales are skipped; e4m3 under 16-bit q 1,098 / 992, 1,033 / 881, 791 / 862: fewer
# instructions, yet the e4m3 steps are no faster (not profiled).
DEFAULT_TMA_MODE = {False: "tma_lag", True: "tma"}  # by kv_fp8
TMA_PAGE = 64  # page sizes it reads: multiples of this (a tile is one box row range of one page)


class SplitCosts(NamedTuple):
    """The TMA kernel's times in the split model (``split_time_us``), us."""
    tile_us: float  # one CTA's 64-key tile where few CTAs run: its own pipeline's pace
    full_us: float  # the same with every SM busy: the tensor pipe at the clocks a full machine holds
    cta_us: float  # a CTA's fixed cost (Q in, the first tiles' two round trips, O out), once a wave
    split_us: float = 0.12  # a split's serial step in the combine (each of its CTAs streams every split)


# Least-squares fit to 24 rows graph-timed on one H100, 2026-12-07 (bf16 rms error 3.3 %, e4m3
# 4.0 %; ``benchmarks/results/mla_splits_h100_2026-12-07_s27.txt``): 1 x 32768 at 16-128
# splits, 32 x 8192 (128 heads) at 1-4, 64 x 1024 at 1, 2, 4, 64 x 2048 at 2-4, and the
# unsplit rows of ``bench_mla.py`` (128-768 sequences, 16-128 heads). The fitted bandwidth
# was 3.08 TB/s (``heuristics.hbm_bytes_per_us``), the partials' bytes cost twice (written,
# read back by the combine). An e4m3 tile is no faster in a CTA's own pipeline than half a
# 16-bit one's bytes would say: its V transposes and quantized P sit on that path.
# ``split_us``: the rows of one long sequence (1 x 32768, 64 heads) pay for every split
# beyond what the tiles and partial bytes above say: 64 -> 128 splits halves a CTA's tiles
# (8 -> 4, -5.8 us in the model) yet measured +1.2 to +3.1 us (bf16 40.9-41.2 -> 43.2-43.3,
# e4m3 35.6-36.0 -> 36.8-39.1; ``results/mla_splits_h100_2026-12-07_s27.txt``, ``_s28``):
# 0.11-0.14 us a split. With it the model takes 64 splits there (was 74 / 103: 42.2 / 39.9
# us against 41.2 / 36.0 at 64, s28) and 16 at 4 x 8192 (e4m3: 22, was 26); the rows of
# fewer than ten splits keep their counts.
SPLIT_COSTS = {False: SplitCosts(1.685, 2.105, 8.0), True: SplitCosts(1.463, 1.796, 10.4)}


def split_time_us(ctas: int, m_blocks: int, n_blocks: int, splits: int, num_sms: int, tile_bytes: int,
                  partial_bytes: int, bytes_per_us: float, costs: SplitCosts) -> float:
    """Modelled time of the TMA kernel (and combine) over ``ctas`` unsplit CTAs (batch x KV
    heads x ``m_blocks`` 64-row blocks) of ``n_blocks`` 64-key tiles cut into ``splits``:
    wave by wave, each CTA's fixed cost and then its tiles at the slowest of its own
    pipeline, the tensor pipe's share of a machine ``k / num_sms`` busy, and HBM's share
    (``m_blocks`` CTAs read each tile, through L2 once); a split run adds its fp32
    partials (``partial_bytes`` a split), written and read back, and the combine's step
    over each split (``costs.split_us``). The fixed launch costs
    are left out: they do not depend on ``splits``."""
    tiles = heuristics.ceildiv(n_blocks, splits)

    def wave(k: int) -> float:  # a wave of k CTAs
        per_tile = max(costs.tile_us, costs.full_us * k / num_sms, k * tile_bytes / m_blocks / bytes_per_us)
        return costs.cta_us + tiles * per_tile

    full, rest = divmod(ctas * splits, num_sms)
    total = full * wave(num_sms) + (wave(rest) if rest else 0.0)
    return total + ((2 * partial_bytes / bytes_per_us + costs.split_us) * splits if splits > 1 else 0.0)


def splits_weigh_bandwidth(problem: MlaProblem) -> bool:
    """Whether ``num_splits=0`` plans from the device's HBM bandwidth (``tma_num_splits``):
    the AOT builder then builds the split and the unsplit kernel. Not over a device
    schedule (``plan``: its items replace the splits), nor batch invariant."""
    return uses_tma(problem) and not problem.batch_invariant and (not problem.schedule_parts or problem.cp)


def tma_num_splits(problem: MlaProblem, num_sms: int, bytes_per_us: float) -> int:
    """The split count ``split_time_us`` puts lowest (ties: fewer), among the counts that
    change the tiles a split holds; no split at ``heuristics.NO_SPLIT_KEYS`` keys or fewer
    (the combine's launch costs more host time than it saves). The wave-efficiency rule
    the other kernels use counts CTAs only, but a split MLA row writes 2 KB of fp32 partial
    per query row and split against 1.2 KB a key it reads: H100, 2026-12-07, 64 x 1024
    at 64 heads: 50.8 us unsplit against 59.7 at the two splits that rule takes (the 64
    CTAs of one split already pull most of HBM's bandwidth), 1 x 32768: 40.9 at 64 splits
    against 43.3 at its 128."""
    if problem.max_seqlen_k <= heuristics.NO_SPLIT_KEYS:
        return 1
    rows = problem.max_seqlen_q * problem.qhead_per_kvhead
    m_blocks = heuristics.ceildiv(rows, 64)
    ctas = problem.batch * problem.nheads_kv * m_blocks
    n_blocks = heuristics.ceildiv(problem.max_seqlen_k, 64)
    tile_bytes = 64 * (D_CKV + D_KPE) * (1 if problem.kv_fp8 else 2)
    partial_bytes = problem.batch * problem.nheads_kv * rows * (D_CKV + 1) * 4  # O and the LSE, fp32
    costs = SPLIT_COSTS[problem.kv_fp8]
    best, best_time = 1, None
    # (more splits than two waves of CTAs only add CTA costs and partials in the model)
    for s in heuristics.split_counts(n_blocks, min(n_blocks, MAX_SPLITS, heuristics.ceildiv(2 * num_sms, ctas))):
        t = split_time_us(ctas, m_blocks, n_blocks, s, num_sms, tile_bytes, partial_bytes, bytes_per_us, costs)
        if best_time is None or t < best_time:
            best, best_time = s, t
    return best


class MlaSm90Config(NamedTuple):
    tile_n: int  # keys per stage
    stages: int
    qk: str  # how the consumer warpgroups share Q K^T (``config.MlaRoles.qk``), or a TMA_MODES (mla_decode_tma)
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
    names a mode of the gathering kernel (unset or one of ``TMA_MODES``: the TMA kernel
    where it applies, the gathering "seesaw" elsewhere; for an FP8 cache that is the
    kernel that widens it to 16 bits). FP8 queries always take it (``check`` refuses them other pages)."""
    return (problem.page_size % TMA_PAGE == 0 and problem.kv_dtype in (None, torch.float8_e4m3fn)
            and (qk in (None,) + TMA_MODES or problem.q_fp8))


def roles(qk: Optional[str] = None, fp8: bool = False, fp8_stages: Optional[str] = None) -> MlaRoles:
    """The kernel's static roles for a Q K^T mode: "seesaw" (the warpgroups take turns
    computing S, tile by tile; 4 stages of 32 keys), "one" (warpgroup 0 computes S and
    hands P to warpgroup 1 through smem; 4 stages) or "split" (each half of the K slices,
    summed through smem; 3 stages). None: ``DEFAULT_QK_MODE``. An FP8 cache
    (``fp8``) takes two fp8 staging tiles (36 KB) from the 16-bit stages: 3, resp. 2
    (``fp8_stages`` "s,s8", ``tuning.mla_fp8_stages``, overrides both depths)."""
    mode = DEFAULT_QK_MODE if qk in (None,) + TMA_MODES else qk
    if mode not in QK_MODES:
        raise ValueError(f"FLASH_ATTN_CUTE_MLA_SM90_QK={mode}: one of {QK_MODES + TMA_MODES}")
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
    CTAs per query position (two 64-row tiles, the cache read through L2 twice).
    ``num_splits`` 0: the TMA kernel's split model (``tma_num_splits``: shapes, SMs and the
    current device's HBM bandwidth), the gathering kernel's the package's wave-efficiency
    heuristic on its grid (shapes only); batch invariant: fixed keys per split. Pages of a
    multiple of 64 keys over a 16-bit or e4m3 cache: the TMA kernel (``uses_tma``; 64-key
    tiles; its mode ``DEFAULT_TMA_MODE``), which runs a device-computed schedule where the
    call gives one (``scheduler_metadata``; not with an explicit ``num_splits``, batch
    invariance or context parallelism, which plan on the host as the other kernel does).
    ``tuning.mla_sm90_qk`` names the TMA kernel's mode (``config.TMA_MODES``) or the Q K^T
    mode of the gathering kernel, which then also replaces the TMA kernel (A/B runs, and
    the GPU tests of each)."""
    rows = problem.max_seqlen_q * problem.qhead_per_kvhead  # packed rows of one KV head
    r = roles(tuning.mla_sm90_qk, problem.kv_fp8, tuning.mla_fp8_stages)
    tile_n, stages, qk, fp8_stages = r.tile_n, r.stages, r.qk, r.fp8_stages
    tma = uses_tma(problem, tuning.mla_sm90_qk)
    if tma:
        (tile_n, stages), fp8_stages = TMA_TILE, 0
        qk = tuning.mla_sm90_qk if tuning.mla_sm90_qk in TMA_MODES else DEFAULT_TMA_MODE[problem.kv_fp8]
    if tma and problem.schedule_parts and num_splits == 0 and not problem.batch_invariant and not problem.cp:
        # A device-computed schedule (``scheduler_metadata``): its work items and partial
        # slots replace the host's splits (``kernels/mla_schedule.py``).
        from flash_attn_cute.host.mla_schedule import max_slots

        return FwdPlan(NAME, MlaSm90Config(tile_n, stages, qk, 0, fp8_stages, True), True,
                       max_slots(problem.schedule_parts))
    if tma and num_splits == 0 and not problem.batch_invariant:
        num_splits = tma_num_splits(problem, num_sms, heuristics.hbm_bytes_per_us())
    num_splits, split_blocks = plan_splits(problem, num_splits, num_sms, problem.nheads_kv, rows, tile_m=r.tile_m,
                                           tile_n=tile_n, ctas_per_sm=_CTAS_PER_SM, tolerance=_SPLIT_TOLERANCE)
    return FwdPlan(NAME, MlaSm90Config(tile_n, stages, qk, split_blocks, fp8_stages), True, num_splits)


# compile_key, compile, launcher: the seam's MLA entry points; the key ends with the config
# as one tuple (tile_n, stages, qk[, fp8_stages for an FP8 cache]).
compile_key, compile, launcher = mla_entry_points(
    NAME, "flash_attn_cute.sm90.mla_decode", "compile_mla_sm90",
    key_config=lambda c: ((c.tile_n, c.stages, c.qk) + ((c.fp8_stages,) if c.fp8_stages else ()),))
