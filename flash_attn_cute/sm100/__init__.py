"""SM100 backend (Blackwell: TMA, tcgen05 MMAs, tensor memory): the seam's check / plan /
compile / launcher.

Host-side only: the kernel module is imported when a kernel is first compiled; planning
(tests, benchmarks, AOT lists) uses the plain-Python ``config`` and needs no GPU.

Tile: ``q_stage`` 128-row Q stages per CTA (the M of one tcgen05 MMA each) and KV blocks
of ``tile_n`` = 128 keys; ``plan`` picks ``q_stage`` (2 for prefill, 1 for decode-shaped
problems and by default with split-KV) and the K/V ring depth that fits shared memory.
"""

from __future__ import annotations

import logging
from typing import NamedTuple, Optional

import torch

from flash_attn_cute.seam.backend_kit import (feature_refusal, fwd_entry_points, head_dim_refusal, head_groups,
                                              plan_rows, plan_splits, tile_head_dims)
from flash_attn_cute.host.keys import DTYPE_NAMES, QUANTIZE_Q, arch_capability, kv_box_field
from flash_attn_cute.host.paging import box_rows, tma_readable
from flash_attn_cute.host.problems import FwdPlan, FwdProblem
from flash_attn_cute.host.tuning import NO_TUNING, Tuning, fp8_kv_mode
from flash_attn_cute.sm100.config import HEAD_DIM_PAIRS, SMEM_LIMIT, TILE_M, kv_stages_for, smem_bytes

NAME = "sm100"
TILE_N = 128
# One CTA per SM (~190 KB of smem, all 512 TMEM columns at q_stage 2); the split heuristic
# counts the grid in 128-row m-blocks, as the other backends do with their own tiles.
_CTAS_PER_SM = 1
_SPLIT_TOLERANCE = 0.95

# tcgen05 and tensor memory: B200/GB200 (sm_100a). backend=None picks it on 10.x; a call its
# check refuses runs the SM80 kernel (seam.select_backend logs why). Compiled and SASS-checked
# for sm_100a on CPU, not yet run on Blackwell hardware.
AUTO = True
# backend_kit.FEATURES this kernel implements. Not "paged_leftpad" (cache_leftpad with a page
# table): a paged cache is read by TMA boxes of whole blocks or of 16-64 rows from a page's
# start (``host.paging``), and a sequence starting inside a page would need row gathers; the
# SM80 kernel runs such a call.
FEATURES = frozenset({"learnable_sink", "seqused_q", "batch_invariant", "fp8_kv", "fp8_qkv"})

log = logging.getLogger("flash_attn_cute")


class Sm100Config(NamedTuple):
    """The SM100 kernel's static choices (``select_tile``)."""

    q_stage: int  # 128-row Q stages per CTA (one tcgen05 MMA tile each)
    tile_n: int
    kv_stages: int  # K/V ring depth
    split_blocks: int = 0  # batch invariant: KV blocks per split (backend_kit.invariant_splits)
    ex2_emulate_every: int = 0  # every k-th exponential of an unmasked block on the FMA pipe (``ex2_share``)
    quantize_q: bool = False  # an e4m3 cache under 16-bit queries: Q quantized in the kernel (``quantizes_q``)
    kv_box: int = 0  # pages of a multiple of 16 keys holding no whole block: TMA boxes of this many rows


def runs_on(capability: tuple) -> bool:
    return capability[0] == 10


def check(problem: FwdProblem) -> Optional[str]:
    reason = head_dim_refusal(problem, HEAD_DIM_PAIRS)
    if reason is not None:
        return reason
    if problem.paged and not tma_readable(TILE_N, problem.page_size):
        return (f"paged KV needs a page_size that is a multiple of 16 keys (TMA boxes of 16-64 rows, or whole "
                f"{TILE_N}-key blocks), got {problem.page_size}")
    if DTYPE_NAMES.get(problem.dtype) not in ("fp16", "bf16", "e4m3"):
        return f"dtype {problem.dtype} is not fp16, bf16 or float8_e4m3fn"
    if problem.leftpad_k:
        return ("cache_leftpad with a paged cache is not implemented by this kernel (it reads pages by TMA boxes "
                "from a page's start; a sequence starting inside a page needs row gathers)")
    return feature_refusal(problem, FEATURES)


def select_q_stage(rows: int, is_split: bool) -> int:
    """2 Q stages (256 rows per CTA) for prefill; 1 when the (packed) rows fit one 128-row
    stage or the KV loop is split (decode: the second stage would only compute padding)."""
    if rows <= TILE_M or is_split:
        return 1
    return 2


def select_tile(d: int, d_v: int, q_stage: int, split_blocks: int = 0, fp8: bool = False,
                elem: int = 2) -> Sm100Config:
    """The deepest K/V ring that fits shared memory beside ``q_stage`` Q stages (and the
    fp8 staging rings of an FP8 cache; ``elem`` 1: FP8 Q, K and V)."""
    return Sm100Config(q_stage, TILE_N, kv_stages_for(d, d_v, q_stage, TILE_N, fp8, elem), split_blocks)


# Exponentials on the FMA pipe (``softmax.ex2_poly``), one in EX2_EVERY, in unmasked blocks.
# A B200 SM has 16 MUFU exp2 a clock beside 8,192 dense 16-bit tcgen05 FLOP: at d = 128 a
# score's Q K^T and P V take 512 FLOP, so the exponentials take as long as the MMAs (at d = 64,
# twice as long). FA4 (flash_fwd_sm100.py, its B200-tuned table) moves 1/8 of a 128-key row of
# its one-CTA kernels to the FMA pipe for d <= 128; this kernel has their structure (a softmax
# warpgroup per Q stage, rows one per thread), so it takes the same share. Compile-verified
# only (no Blackwell GPU here): the share is FA4's measurement, not ours.
EX2_EVERY = 8


def ex2_share(problem: FwdProblem, arch: Optional[str]) -> int:
    """Every k-th exponential on the FMA pipe (0: none): d, d_v <= 128 on sm_100 (sm_103's
    MUFU exp2 is fast: FA4 keeps it there), 16-bit Q and K (FP8 Q, K, V: the polynomial
    made the causal split decode key spill 2 values inside its KV loop, sm_100a SASS), no
    user score or mask mod (``ex2_poly`` takes finite inputs, which a user's mod need not
    give), and not batch invariant (which blocks a tile masks depends on its rows)."""
    if arch is not None and arch_capability(arch) >= (10, 3):
        return 0
    if (max(tile_head_dims(problem, HEAD_DIM_PAIRS)) > 128 or problem.qkv_fp8 or problem.variant is not None
            or problem.batch_invariant):
        return 0
    return EX2_EVERY


def quantizes_q(problem: FwdProblem, tuning: Tuning = NO_TUNING) -> bool:
    """Whether an e4m3 cache under 16-bit queries runs with the queries quantized to e4m3 in
    the kernel (``device/q_quant.py``: each softmax warpgroup quantizes its 128-row Q stage,
    one power-of-two scale per stage folded into its softmax scale) and both MMAs in e4m3, as
    FP8 Q, K, V runs, instead of two warps widening every K and V block to 16 bits. SM90's
    default (``sm90.quantizes_q``: 1.68-1.80x our bf16 keys/s against 1.55-1.66x widened on
    an H100); here on request only (``tuning.sm100_fp8_kv`` "quantize_q",
    FLASH_ATTN_CUTE_SM100_FP8_KV), until both are measured on a Blackwell GPU: it is
    compile-verified only, and it costs accuracy (q rounded to e4m3, README's FP8 section).
    Never for an e5m2 cache, nor batch invariant (the scale is one per stage: the bits a
    row keeps would depend on its stage-mates)."""
    mode = fp8_kv_mode(tuning.sm100_fp8_kv, "widen", "FLASH_ATTN_CUTE_SM100_FP8_KV")
    return (mode == "quantize_q" and problem.kv_dtype == torch.float8_e4m3fn and not problem.qkv_fp8
            and not problem.batch_invariant)


def pack_refusal(ratio: int) -> Optional[str]:
    """Why query heads cannot be packed at this GQA ratio (None: they can). Packed Q rows
    are one 3-D TMA box (pack, 128 / pack) per 128-row stage, so the ratio must divide 128;
    other ratios run unpacked (one query head per CTA row block), which is correct, only
    K/V are read once per query head instead of once per KV head."""
    if ratio <= 1:
        return "no GQA (one query head per KV head)"
    if TILE_M % ratio:
        return (f"GQA ratio {ratio} does not divide the {TILE_M}-row Q stage (packed rows are loaded by one "
                f"TMA box of whole query positions); running unpacked")
    return None


def plan(problem: FwdProblem, num_splits: int, pack_gqa: Optional[bool], num_sms: Optional[int],
         tuning: Tuning = NO_TUNING, arch: Optional[str] = None) -> FwdPlan:
    """q_stage, GQA packing (None = FA3's rule) and KV splits (0 = heuristic on ``num_sms``;
    batch invariant: fixed keys per split on the one tile_n, ``num_splits`` ignored)."""
    refusal = pack_refusal(problem.qhead_per_kvhead)
    if pack_gqa and refusal is not None and problem.qhead_per_kvhead > 1:
        log.info("flash_attn_cute: sm100 cannot pack GQA heads: %s", refusal)
    pack_gqa, rows = plan_rows(problem, pack_gqa, TILE_M, packable=refusal is None)
    num_splits, split_blocks = plan_splits(problem, num_splits, num_sms, head_groups(problem, pack_gqa), rows,
                                           tile_m=TILE_M, tile_n=TILE_N, ctas_per_sm=_CTAS_PER_SM,
                                           tolerance=_SPLIT_TOLERANCE)
    q_stage = select_q_stage(rows, num_splits > 1 or split_blocks > 0)
    d, d_v = tile_head_dims(problem, HEAD_DIM_PAIRS)  # the kernel's tile widths (padded head dims)
    quantize_q = quantizes_q(problem, tuning)
    widen = problem.kv_fp8 and not quantize_q
    if widen and q_stage == 2 and smem_bytes(d, d_v, 2, TILE_N, 1, fp8=True) > SMEM_LIMIT:
        q_stage = 1  # d 192: the fp8 staging rings leave no room for a second Q stage
    # e4m3 operands (FP8 Q, K, V, or the queries quantized here): no exponentials on the FMA
    # pipe (``ex2_share``).
    fp8_ops = problem.qkv_fp8 or quantize_q
    config = select_tile(d, d_v, q_stage, split_blocks, widen, 1 if fp8_ops else 2)
    ex2 = 0 if fp8_ops else ex2_share(problem, arch)
    kv_box = box_rows(TILE_N, problem.page_size) if problem.paged else 0
    return FwdPlan(NAME, config._replace(ex2_emulate_every=ex2, quantize_q=quantize_q, kv_box=kv_box), pack_gqa,
                   num_splits)


# compile_key(problem, plan, arch=None), compile(key), launcher(problem, plan, device=None):
# the seam's shared entry points over ``flash_fwd.compile_fwd_sm100``; the key holds the
# config's tile (split_blocks is a common field), then ex2_emulate_every where it is not 0,
# ``keys.QUANTIZE_Q`` where the kernel quantizes the queries and ``keys.kv_box_field`` where
# pages are read in boxes (each absent otherwise: the keys from before keep their form).
compile_key, compile, launcher = fwd_entry_points(
    NAME, "flash_attn_cute.sm100.flash_fwd", "compile_fwd_sm100", key_tile=lambda c: tuple(c[:3]),
    key_extra=lambda c: ((c.ex2_emulate_every,) if c.ex2_emulate_every else ()) + ((QUANTIZE_Q,) if c.quantize_q
                                                                                   else ())
    + ((kv_box_field(c.kv_box),) if c.kv_box else ()))
