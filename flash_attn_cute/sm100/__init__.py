"""SM100 backend (Blackwell: TMA, tcgen05 MMAs, tensor memory): the seam's check / plan /
compile / launcher.

Host-side only: the kernel module is imported when a kernel is first compiled; planning
(tests, benchmarks, AOT lists) uses the plain-Python ``config`` and needs no GPU.

Tile: ``q_stage`` 128-row Q stages per CTA (the M of one tcgen05 MMA each) and KV blocks
of ``tile_n`` = 128 keys; ``plan`` picks ``q_stage`` (2 for prefill, 1 for decode-shaped
problems and by default with split-KV) and the K/V ring depth that fits shared memory.
"""

from __future__ import annotations

from typing import Optional

from ..cute_utils import DTYPE_NAMES, target_arch
from ..fwd import FwdPlan, FwdProblem, bind_launcher, plan_rows, plan_splits
from .config import TILE_M, kv_stages_for

NAME = "sm100"
HEAD_DIMS = (64, 128, 192)  # q/k head dims; d_v is 64 or 128 (192 only as (192, 128))
HEAD_DIM_PAIRS = ((64, 64), (128, 128), (192, 128))
TILE_N = 128
PAGE_SIZES = (TILE_N,)  # a paged cache is read one page (= one KV block) per TMA
# One CTA per SM (~190 KB of smem, all 512 TMEM columns at q_stage 2); the split heuristic
# counts the grid in 128-row m-blocks, as the other backends do with their own tiles.
_CTAS_PER_SM = 1
_SPLIT_TOLERANCE = 0.95

# tcgen05 and tensor memory: B200/GB200 (sm_100a). Compiled and SASS-checked on CPU only: never run
# on Blackwell hardware yet, so backend=None keeps SM80 there until it has been.
AUTO = False


def runs_on(capability: tuple) -> bool:
    return capability[0] == 10


def check(problem: FwdProblem) -> Optional[str]:
    if (problem.d, problem.d_v) not in HEAD_DIM_PAIRS:
        return f"head dims (d, d_v) = ({problem.d}, {problem.d_v}) are not one of {HEAD_DIM_PAIRS}"
    if problem.paged and problem.page_size not in PAGE_SIZES:
        return (f"paged KV needs page_size in {PAGE_SIZES} (one TMA box per KV block), "
                f"got {problem.page_size}")
    if DTYPE_NAMES.get(problem.dtype) not in ("fp16", "bf16"):
        return f"dtype {problem.dtype} is not fp16 or bf16"
    return None


def select_q_stage(rows: int, num_splits: int) -> int:
    """2 Q stages (256 rows per CTA) for prefill; 1 when the (packed) rows fit one 128-row
    stage or the KV loop is split (decode: the second stage would only compute padding)."""
    if rows <= TILE_M or num_splits > 1:
        return 1
    return 2


def select_tile(d: int, d_v: int, q_stage: int) -> tuple:
    """(q_stage, tile_n, kv_stages): the deepest K/V ring that fits shared memory."""
    return q_stage, TILE_N, kv_stages_for(d, d_v, q_stage, TILE_N)


def can_pack(ratio: int) -> bool:
    """Packed GQA rows go through one TMA box per stage: the ratio must divide 128."""
    return ratio > 1 and TILE_M % ratio == 0


def plan(problem: FwdProblem, num_splits: int, pack_gqa: Optional[bool], num_sms: Optional[int]) -> FwdPlan:
    """q_stage, GQA packing (None = FA3's rule) and KV splits (0 = heuristic on ``num_sms``)."""
    pack_gqa, rows = plan_rows(problem, pack_gqa, TILE_M, packable=can_pack(problem.qhead_per_kvhead))
    num_splits = plan_splits(problem, num_splits, num_sms, pack_gqa, rows, tile_m=TILE_M, tile_n=TILE_N,
                             ctas_per_sm=_CTAS_PER_SM, tolerance=_SPLIT_TOLERANCE)
    q_stage = select_q_stage(rows, num_splits)
    return FwdPlan(NAME, select_tile(problem.d, problem.d_v, q_stage), pack_gqa, num_splits, q_stage)


def compile_key(problem: FwdProblem, plan: FwdPlan, arch: Optional[str] = None) -> tuple:
    """The kernel's compile key. A split kernel always writes partial LSEs."""
    from .flash_fwd import fwd_key

    return fwd_key(arch or target_arch(), DTYPE_NAMES[problem.dtype], problem.d, problem.d_v, plan.tile,
                   problem.variant_flags, plan.qhead_per_kvhead_packed(problem), plan.num_splits > 1,
                   problem.has_lse or plan.num_splits > 1, problem.varlen_q, problem.varlen_k,
                   problem.has_seqused_k, problem.paged)


def compile(key: tuple):
    from .flash_fwd import compile_fwd_sm100

    return compile_fwd_sm100(key)


def launcher(problem: FwdProblem, plan: FwdPlan):
    """``launch(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table)``: see
    ``fwd.bind_launcher``."""
    return bind_launcher(NAME, compile_key(problem, plan), compile, problem, plan)
