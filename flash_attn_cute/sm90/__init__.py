"""SM90 backend (warp-specialized TMA + wgmma): the seam's check / plan / compile_key /
compile / launcher.

Hopper only (sm_90a). Host-side only: the tile table and fit rules are plain Python
(``sm90/config.py``); the DSL is imported when a kernel is first compiled, so planning is
cheap and runs without a GPU.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from flash_attn_cute.host import heuristics
from flash_attn_cute.seam.backend_kit import (feature_refusal, fwd_entry_points, head_dim_refusal, head_groups,
                                              plan_rows, plan_splits, tile_head_dims)
from flash_attn_cute.host.problems import FwdPlan, FwdProblem
from flash_attn_cute.host.tuning import NO_TUNING, Tuning, fp8_kv_mode, paged_kv_boxes
from flash_attn_cute.sm90 import config

NAME = "sm90"
# Tiles of every pair of constants.HEAD_DIM_TILES; other head dims (multiples of 8 up to
# 256) run on the next tile, padded inside the kernel (TMA fills the columns past them with
# zeros, predicated row gathers and stores skip them).
HEAD_DIM_PAIRS = None
# One CTA per SM (the prefill tiles take most of the 227 KB of shared memory and the
# register file; 16-bit decode tiles: config.decode_two_ctas); a last wave 95% full, as for SM80.
_CTAS_PER_SM = 1
_SPLIT_TOLERANCE = 0.95

# wgmma and setmaxnreg exist on sm_90a only.
AUTO = True
# backend_kit.FEATURES this kernel implements
FEATURES = frozenset({"learnable_sink", "seqused_q", "batch_invariant", "fp8_kv", "fp8_qkv", "paged_leftpad"})


class Sm90Config(NamedTuple):
    """The SM90 kernel's static choices."""

    tile_m: int  # tile_m / 64 consumer warpgroups
    tile_n: int
    num_stages: int  # K/V pipeline depth
    ex2_emulate_every: int  # every k-th exponential on the FMA pipe (0: none)
    gather_kv: bool  # paged rows gathered by cp.async (pages not holding whole tile_n blocks)
    persistent: object  # one CTA per SM looping over the tiles: False, True, or "dynamic" (``persistent``)
    split_blocks: int = 0  # batch invariant: KV blocks per split (backend_kit.invariant_splits)
    ctas_per_sm: int = 1  # 2: a tile that fits twice (config.fp8_ctas_per_sm, config.decode_two_ctas)
    quantize_q: bool = False  # an e4m3 cache under 16-bit queries: Q quantized in the kernel (quantizes_q)
    # FP8 Q, K, V kernel (qkv_fp8 or quantize_q): P V accumulated in two levels, every n KV
    # blocks (FwdProblem.fp8_two_level_interval; 0: off, and always 0 for the other kernels).
    two_level: int = 0
    # Pages of a multiple of 16 keys that hold no whole tile_n block: each block is read in
    # TMA boxes of this many rows, one page-table entry each (``config.kv_box_rows``; 0:
    # one box per block, or gathered rows).
    kv_box: int = 0


def runs_on(capability: tuple) -> bool:
    return capability[0] == 9


def check(problem: FwdProblem) -> Optional[str]:
    reason = head_dim_refusal(problem, HEAD_DIM_PAIRS)
    if reason is not None:
        return reason
    d, d_v = tile_head_dims(problem, HEAD_DIM_PAIRS)
    if problem.qkv_fp8 and problem.fp8_two_level_interval and not config.two_level_fits(d_v, 64, 32):
        # (16-bit queries over an e4m3 cache take the widening kernel there instead: ``plan``.)
        return (f"fp8_two_level_interval with FP8 q, k, v needs head_dim_v <= 192 (got {problem.d_v}): the "
                f"second O accumulator does not fit the registers; pass fp8_two_level_interval=0")
    return config.unsupported_reason(d, d_v) or feature_refusal(problem, FEATURES)


def plan(problem: FwdProblem, num_splits: int, pack_gqa: Optional[bool], num_sms: Optional[int],
         tuning: Tuning = NO_TUNING, arch: Optional[str] = None) -> FwdPlan:
    """Tile from the SM90 tile table for the padded head dims (``tile_head_dims``;
    ``tuning.sm90_tile`` overrides), GQA packing (None =
    FA3's rule on a 128-row tile), KV splits (0 = the wave-efficiency heuristic with this
    kernel's tile and one CTA per SM; batch invariant: fixed keys per split, ``num_splits``
    ignored), row gathers for paged caches, persistence."""
    pack_gqa, rows = plan_rows(problem, pack_gqa)
    d, d_v = tile_head_dims(problem, HEAD_DIM_PAIRS)  # the kernel's tile widths (padded head dims)
    sixteen_bit = not problem.kv_fp8 and not problem.qkv_fp8
    quantize_q = quantizes_q(problem, tuning)
    # Pages of a multiple of 16 keys that hold no whole block: TMA boxes (``config.kv_box_rows``)
    # unless the knob names row gathers (``tuning.paged_kv_boxes``: the measurement).
    boxes = paged_kv_boxes(tuning.sm90_paged_kv)
    # Plain 16-bit attention: no mask, no softcap, no user variant (``select_tile``).
    plain = sixteen_bit and not (problem.causal or problem.local or problem.softcap or problem.variant is not None)
    tile = config.select_tile(d, d_v, rows, causal=problem.causal, local=problem.local,
                              page_size=problem.page_size or None, override=tuning.sm90_tile,
                              batch_invariant=problem.batch_invariant, plain=plain)
    # The FP8 Q, K, V kernel's tile (what no 16-bit or widening adjustment below touches).
    fp8_tile = None
    if problem.qkv_fp8 or quantize_q:
        fp8_tile = config.fp8_qkv_tile(d, d_v, tile, problem.page_size, problem.causal or problem.local,
                                       measured=not tuning.sm90_tile and not problem.batch_invariant,
                                       leftpad_k=problem.leftpad_k, boxes=boxes, keep_n=bool(tuning.sm90_tile))
    two_level = problem.fp8_two_level_interval if problem.qkv_fp8 or quantize_q else 0
    if two_level and not tuning.sm90_tile:  # (a tuning override's tile is taken as it is)
        fp8_tile = config.fp8_two_level_tile(d, d_v, fp8_tile, problem.page_size, problem.leftpad_k, boxes)
        if fp8_tile is None:
            # d_v > 192: O twice does not fit the registers. 16-bit queries over an e4m3
            # cache take the widening kernel (16-bit MMAs, no fp8 accumulation to split);
            # FP8 q, k, v is refused (``check``).
            assert quantize_q, "check refuses FP8 q, k, v here"
            quantize_q, two_level = False, 0
    ctas_per_sm = _CTAS_PER_SM
    # The CTAs per SM the split heuristic counts: the two-CTA decode tiles are split as for
    # one (H200 b1 x 131072 h32/8 d128, 16-bit: 16 splits 139.1 us, 32 splits, two a SM, 142.4).
    split_ctas = None
    fp8_decode = None
    if (problem.qkv_fp8 or quantize_q) and rows <= 64 and not (problem.batch_invariant or tuning.sm90_tile or two_level):
        # (two-level: O twice does not fit the registers of two CTAs a SM)
        fp8_decode = config.fp8_qkv_decode_tile(d, d_v, problem.page_size, problem.leftpad_k, boxes)
        if fp8_decode is not None:
            (fp8_tile, ctas_per_sm), split_ctas = fp8_decode, 1
    if quantize_q and tuning.sm90_fp8_kv is None and fp8_decode is None:
        # Outside decode (two CTAs a SM) the default quantizes q only where the FP8 kernel
        # reads blocks by TMA (whole, or in boxes: pages of 16): its one-CTA row gathers
        # (pages of 1, cache_leftpad) were slower than widening. H100, 2026-12-05, b64 x 4096 h32/8 d128
        # decode, us (bench_fp8_decode.py, one run): pages of 1 452.7 quantized q against
        # 258.3 widened, pages of 16 402.9 against 258.2 (``fp8_qkv_decode_tile``: 248.1 and
        # 214.7). FLASH_ATTN_CUTE_SM90_FP8_KV=quantize_q still takes it there.
        quantize_q = not config.gathers_kv(fp8_tile[1], problem.page_size, problem.leftpad_k, boxes)
    widen = problem.kv_fp8 and not quantize_q
    if sixteen_bit and rows <= 64 and not problem.batch_invariant and not tuning.sm90_tile:
        tile, ctas_per_sm = config.decode_two_ctas(d, d_v, tile)
        split_ctas = 1
    if widen:
        decode = rows <= 64 and not problem.batch_invariant and not tuning.sm90_tile
        tile = config.fp8_tile(d, d_v, tile, tile[2] if tuning.sm90_tile else 4, decode)
        # Two CTAs per SM where measured: decode tiles, and tuning sweeps.
        if decode or tuning.sm90_tile:
            ctas_per_sm = config.fp8_ctas_per_sm(d, d_v, tile)
    ctas_per_sm = config.override_ctas(tuning.sm90_tile) or ctas_per_sm
    if problem.qkv_fp8 or quantize_q:
        tile = fp8_tile
    num_splits, split_blocks = plan_splits(problem, num_splits, num_sms, head_groups(problem, pack_gqa), rows,
                                           tile_m=tile[0], tile_n=tile[1], ctas_per_sm=split_ctas or ctas_per_sm,
                                           tolerance=_SPLIT_TOLERANCE)
    gather_kv = config.gathers_kv(tile[1], problem.page_size, problem.leftpad_k, boxes)
    kv_box = config.kv_box_rows(tile[1], problem.page_size, problem.leftpad_k, boxes)
    if problem.qkv_fp8 or quantize_q:
        # (16-bit queries quantized in the kernel: one tile per CTA, ``flash_fwd``)
        fits = config.fp8_qkv_persistent_fits(d, d_v, tile, gather_kv) and ctas_per_sm == 1 and not quantize_q
        persist = persistent(problem, fits, tuning.sm90_persistent, fp8_persistent(problem, d, d_v, rows))
    else:  # (the widening kernel: not built persistent)
        fits = not widen and config.persistent_fits(d, d_v, tile, problem.qhead_per_kvhead if pack_gqa else 1,
                                                    problem.varlen_q, num_splits > 1 or split_blocks > 0, gather_kv,
                                                    problem.has_seqused_q)
        persist = persistent(problem, fits, tuning.sm90_persistent)
    two_level = two_level if problem.qkv_fp8 or quantize_q else 0  # (the gathered pages' gate may widen)
    return FwdPlan(NAME, Sm90Config(*tile, gather_kv, persist, split_blocks, ctas_per_sm, quantize_q, two_level,
                                    kv_box),
                   pack_gqa, num_splits)


# The FP8 Q, K, V kernel's persistent CTAs (``fp8_persistent``) by default: on since its GPU
# test ran CTAs that loop over several tiles (``test_fp8_attention_persistent``, H100,
# 2026-12-06: dense d256, splits 1 and 3); ragged or paged keys and varlen queries stay one
# CTA per tile until a GPU test has run them persistent in FP8.
FP8_PERSISTENT_DEFAULT = True


def fp8_persistent(problem: FwdProblem, d: int, d_v: int, rows: int) -> bool:
    """Whether the FP8 Q, K, V kernel runs persistent where it fits
    (``config.fp8_qkv_persistent_fits``: two consumer warpgroups, one CTA per SM) and no knob
    decides: prefill (more than 64 packed rows; decode unmeasured) at head dims over 128
    without a mask, whose long tiles gain the next tile's loads under this one's epilogue;
    while ``FP8_PERSISTENT_DEFAULT`` is off, only by FLASH_ATTN_CUTE_SM90_PERSISTENT=1.
    H100, 2026-12-06, b4 s8192 h8 d256, TFLOP/s, one CTA per tile / persistent, two runs
    each (``FLASH_ATTN_CUTE_SM90_PERSISTENT`` 0 / 1): non-causal 981-1014 / 1038-1040; causal
    933-938 / 777-779 (the static order of the LPT tiles leaves SMs idle: not taken). Local
    windows and user masks (unmeasured in FP8) stay one CTA per tile, as do the shapes no GPU
    test has run persistent in FP8 (``FP8_PERSISTENT_DEFAULT``)."""
    masked = problem.causal or problem.local or problem.variant is not None
    dense = not (problem.varlen_q or problem.varlen_k or problem.has_seqused_k or problem.page_size
                 or problem.leftpad_k)
    return FP8_PERSISTENT_DEFAULT and rows > 64 and max(d, d_v) > 128 and not masked and dense


def quantizes_q(problem: FwdProblem, tuning: Tuning = NO_TUNING) -> bool:
    """Whether an FP8 cache under 16-bit queries runs the FP8 Q, K, V kernel with the queries
    quantized to e4m3 in the kernel (``q_quant``; fp8 wgmma for both GEMMs, as a call with
    e4m3 q and q_descale) rather than the kernel that widens every K and V block to 16 bits
    in shared memory and runs bf16 wgmma. H100, 2026-12-05, h32/8 d128 decode, keys/s
    against our bf16 kernel (``bench_fp8_decode.py``, one run): b1 x 131072 1.68x (widening
    1.55x; FA3's FP8 decode 1.49x), b64 x 4096 contiguous 1.80x (1.66x), pages of 64 1.71x
    (1.66x). Decode runs two CTAs a SM (``config.fp8_qkv_decode_tile``; H100, 2026-12-06,
    against our bf16: pages of 1 1.50x, 16 1.72x, widening 1.46x and 1.45x). Outside decode,
    at gathered pages (1, cache_leftpad) ``plan`` keeps the widening kernel unless the
    knob names this one (its one-CTA row gathers were slower there in decode; unmeasured at
    prefill shapes).

    The widening kernel stays where the queries may not be quantized, or cannot be here:
    ``tuning.sm90_fp8_kv`` "widen" (FLASH_ATTN_CUTE_SM90_FP8_KV, for A/B measurements); an
    e5m2 cache (the FP8 kernel's MMAs and V transposes are e4m3 x e4m3; e5m2 values would
    need their own wgmma operand types, not built); ``batch_invariant`` (the queries'
    scale is one per tile, and the elements e4m3 holds as subnormals round differently
    under another tile's scale: a row's bits would depend on the rows it shares a tile
    with, which the batch and GQA packing decide)."""
    mode = fp8_kv_mode(tuning.sm90_fp8_kv, "quantize_q", "FLASH_ATTN_CUTE_SM90_FP8_KV")
    if problem.kv_dtype != torch.float8_e4m3fn or mode != "quantize_q" or problem.batch_invariant:
        return False
    # User variants and context-parallel shards keep the widening kernel unless the knob
    # names this one: the quantizing kernel has compiled for them but not yet run them on a
    # GPU (its GPU tests of 2026-12-05 cover windows, softcap, sinks, varlen, splits, pages).
    return tuning.sm90_fp8_kv == "quantize_q" or (problem.variant is None and not problem.cp)


def persistent(problem: FwdProblem, fits: bool, override: Optional[str] = None, rule: Optional[bool] = None) -> bool:
    """One CTA per SM looping over the tiles (``PersistentScheduler``), where it fits
    (``config.persistent_fits``) and was measured faster: a local window or a user mask
    (mask_mod, block mask), whose short tiles otherwise pay their pipeline fill and epilogue
    with nothing overlapping them. H200, B4 S8192 H16 d128 bf16, TFLOP/s persistent vs not:
    sliding window 1024 465 vs 435, document mask (block mask) 262 vs 259; plain causal
    583 vs 594 and non-causal 637 vs 682 are slower (long tiles, little fill to hide; not
    analysed further), decode (B64, 4096 keys, GQA 4) 4.25 vs 4.20 TB/s: left off.
    ``override`` "0" / "1" (``tuning.sm90_persistent``) replaces the rule where it fits;
    ``rule``: another kernel's own rule in place of this one (``fp8_persistent``).
    ``override`` "dynamic": persistent where it fits, and over the LPT order of masked tiles
    the CTAs draw their tiles from an atomic counter (``flash_fwd`` ``dynamic``, its own
    key: the config's ``persistent`` is then "dynamic"). Opt-in until a GPU has run it: it
    is compile-verified (sm_90a SASS) and its GPU tests are written
    (``test_persistent_dynamic_tiles``, ``test_fp8_attention_persistent``), but the device
    was not lent in the session that built it (2026-12-08)."""
    if override == "dynamic":
        return "dynamic" if fits else False
    if override is not None:
        return fits and override != "0"
    if rule is not None:
        return fits and rule
    user_mask = problem.variant is not None and (problem.variant.mask_mod is not None or problem.variant.block_q > 0)
    return fits and (problem.local or user_mask)


def _extra_scalars(problem: FwdProblem, plan: FwdPlan, device) -> tuple:
    """``l2_heads`` (the LPT order's L2 section) and ``max_ctas`` (the persistent grid's
    bound: the SM count of the call's device; 1 where it is unused or there is no GPU), then
    the tile counter's None where the kernel takes none (``_call_tensors`` makes the others'
    at each launch; binding None here keeps the common launch free of that call)."""
    max_ctas = max(1, heuristics.num_sms(device) - plan.sm_margin) if plan.config.persistent and device is not None \
        else 1
    counter = () if plan.config.persistent == "dynamic" else (None,)
    return (int(heuristics.l2_heads_for(problem.max_seqlen_k, problem.d, problem.d_v)), max_ctas) + counter


def _call_tensors(problem: FwdProblem, plan: FwdPlan):
    """A "dynamic" persistent kernel's tile counter, (1,) int32 zeros made for each launch
    (``flash_fwd``'s hand-out of LPT tiles draws from it; two launches, e.g. the two streams
    of a mixed plan, never share one); None for the others (``_extra_scalars`` binds theirs)."""
    if plan.config.persistent != "dynamic":
        return None
    return lambda tensors: (torch.zeros(1, dtype=torch.int32, device=tensors.q.device),)


# compile_key, compile, launcher: the seam's shared entry points. The key holds the tile
# (m, n, stages, ex2) first and gather_kv, persistent (, ctas_per_sm where it is 2)
# (, keys.QUANTIZE_Q where set) (, keys.two_level_field where set) last (``config.key_extra``).
compile_key, compile, launcher = fwd_entry_points(
    NAME, "flash_attn_cute.sm90.flash_fwd", "compile_fwd_sm90", key_tile=lambda c: tuple(c[:4]),
    key_extra=lambda c: config.key_extra(c.gather_kv, c.persistent, c.ctas_per_sm, c.quantize_q, c.two_level,
                                         c.kv_box),
    extra_scalars=_extra_scalars, call_tensors=_call_tensors)
