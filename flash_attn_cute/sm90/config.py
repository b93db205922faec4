"""Static configuration of the SM90 kernels, in plain Python (no DSL import): the forward
kernel's warp roles and register budgets, its tile table and fit rules, and the MLA
kernel's roles. The host planner (``sm90/__init__.py``, ``sm90/mla.py``) and the CPU tests
use it without compiling anything; the kernels read their roles from here."""

from dataclasses import dataclass
from typing import Optional

from flash_attn_cute.host.constants import D_CKV, D_KPE
from flash_attn_cute.host.paging import KV_BOX_ROWS, box_rows
from flash_attn_cute.host.keys import QUANTIZE_Q, kv_box_field, parse_kv_box, parse_two_level, two_level_field

SMEM_LIMIT = 227 * 1024  # sm_90 opt-in shared memory per block


def smem_bytes(d, dv, tile_m, tile_n, stages, elem=2):
    return elem * (tile_m * d + stages * tile_n * (d + dv)) + 1024


def select_tile(d: int, dv: int, rows_per_kv_head: int, *, causal: bool = False, local: bool = False,
                page_size: Optional[int] = None, override: Optional[str] = None, batch_invariant: bool = False,
                plain: bool = False):
    """(tile_m, tile_n, num_stages, ex2_emulate_every). tile_m / 64 consumer warpgroups,
    each holding a 64 x tile_n S, its P and a 64 x d_v O in registers; stages of K and V
    in smem; every ex2_emulate_every-th exponential on the FMA pipe (0: none).
    ``override`` "m,n,stages[,ex2[,ctas]]" (``tuning.Tuning.sm90_tile``) replaces it (tuning
    sweeps; ``ctas``: ``override_ctas``).
    With a paged cache, tile_n divides the page size where a divisor >= 64 exists (one TMA
    per block, inside one page); other page sizes keep the tile and gather rows
    (``gathers_kv``). ``batch_invariant``: tile_n depends on the head dims, the window and
    the page size alone (rows_per_kv_head depends on max_seqlen_q, i.e. on the batch): the
    decode tile takes the prefill tile's n, and no exponential moves to the FMA pipe (it
    would only in unmasked blocks, and which blocks a tile masks depends on its rows).
    ``plain``: 16-bit attention without a mask (causal, window, user mask), softcap or score
    mod: d = d_v = 128 takes FA3's (C++) 128 x 176 tile (H200, b4 s8192 h16, with the deferred O rescale:
    652.6 against 640.1 TFLOP/s at 128 x 128, same run; causal has no gain: 594.6 against
    598.3, ``bench_tiles.py --sm90``)."""
    if override:
        m, n, s, *e = (int(x) for x in override.split(",")[:4])
        return m, n, s, (e[0] if e and not batch_invariant else 0)
    dmax = max(d, dv)
    if dmax <= 64:
        tile = (192, 128, 2)
    elif dmax <= 128:
        tile = (128, 176 if plain and d == dv == 128 else 128, 2)
    elif d <= 192 and dv <= 128:
        tile = (128, 96 if local else 128, 2)
    elif dmax <= 192:
        tile = (128, 96 if local else 112, 2)
    else:
        tile = (128, 64, 2)  # 64 measured faster than 80 on the H200 (690 vs 675 TFLOP/s, b4 s8192)
    if rows_per_kv_head <= 64:
        # Decode-shaped: one consumer warpgroup, deeper KV pipeline (more bytes in flight);
        # 16-bit K/V: ``decode_two_ctas``.
        tile = (64, 128, 3) if dmax <= 128 else (64, tile[1] if batch_invariant else 80, 2)
    if page_size is not None:
        m, n, s = tile
        tile = (m, next((t for t in range(n, 63, -16) if page_size % t == 0), n), s)
    m, n, s = tile
    while s > 2 and smem_bytes(d, dv, m, n, s) > SMEM_LIMIT:
        s -= 1
    return m, n, s, 0


def decode_two_ctas(d: int, dv: int, tile: tuple) -> tuple:
    """(tile, CTAs per SM) of a 16-bit decode tile (``select_tile``'s, tile_m 64): for d <=
    128, (64, 64, 2), two CTAs per SM (it fits twice with 3 KB of mbarriers and alignment
    besides ``smem_bytes``), so that one CTA's softmax and wgmma chain runs while the
    other's loads wait. H200, b64 x 4096 h32 d128, TB/s (64, 64, 2) two CTAs against (64,
    128, 3) one CTA, same run (``bench_paged_decode.py``): 8 KV heads contiguous 4.217 /
    4.116 (FA4 4.159), page 16 4.165 / 4.085, page 64 4.190 / 4.175; 32 KV heads contiguous
    4.463 / 4.457, page 1 4.169 / 4.103, 16 4.302 / 4.233, 64 4.478 / 4.442, 128 4.464 /
    4.455. (64, 80, 2) two CTAs: within 1.5% of (64, 64, 2)."""
    if tile[0] != 64 or max(d, dv) > 128:
        return tile, 1
    two = (64, 64, 2, tile[3])
    assert smem_bytes(d, dv, *two[:3]) + 3072 <= TWO_CTAS_SMEM
    return two, 2


def override_ctas(override: Optional[str]) -> int:
    """CTAs per SM a tile override names (its fifth field; 0: the planner's choice)."""
    parts = override.split(",") if override else []
    return int(parts[4]) if len(parts) > 4 else 0


def fp8_smem_bytes(d: int, dv: int, tile_m: int, tile_n: int, stages: int) -> int:
    """Shared memory of a tile over FP8 K/V: 16-bit Q, fp8 stages, one widened 16-bit K
    and V block, 2 KB for the mbarriers and the 1 KB alignment of the buffers."""
    return 2 * tile_m * d + stages * tile_n * (d + dv) + 2 * tile_n * (d + dv) + 2048


# Shared memory of an SM (228 KB) less 1 KB reserved per CTA, halved: two CTAs per SM.
TWO_CTAS_SMEM = 113 * 1024


def fp8_ctas_per_sm(d: int, dv: int, tile: tuple) -> int:
    """CTAs per SM of an FP8 tile: two where the tile fits twice (the register file is then
    split too, ``WarpRoles.for_consumers``), so that one CTA's widening, softmax and wgmma
    chain runs while the other's waits."""
    return 2 if fp8_smem_bytes(d, dv, *tile[:3]) <= TWO_CTAS_SMEM else 1


def fp8_tile(d: int, dv: int, tile: tuple, max_stages: int = 4, decode: bool = False) -> tuple:
    """The tile over FP8 K/V: the consumers widen each staged block into one 16-bit buffer
    its wgmma read, so one consumer warpgroup (tile_m 64: no second one reads a buffer the
    first overwrites); tile_n as for 16 bits, rounded to 64 rows; as many stages (up to
    ``max_stages``: 4, or a tuning override's) as fit.

    ``decode`` (at most 64 packed rows, not batch invariant: its tile_n may not depend on
    the rows) with d <= 128: (64, 64, 3), which fits twice per SM (``fp8_ctas_per_sm``).
    One CTA's chain of widening, Q K^T, softmax and P V bounds a decode CTA (ncu, one CTA
    per SM: 33% of issue slots busy, 42% of DRAM bandwidth); two CTAs per SM overlap their
    chains. H200, h32/8 d128, us: b1 x 131072 116.0 against 131.6 on (64, 128, 4); b64 x
    4096 paged 64 212.2 against 275.2, paged 16 252.7 against 273.2; (64, 64, 2) within 1%
    of (64, 64, 3)."""
    if decode and max(d, dv) <= 128:
        tile, max_stages = (64, 64, 3, 0), 3
    # A multiple of 64 rows: a gathering producer (128 threads, 16 fp8 values a copy) copies
    # up to 64 rows a pass (``copy_utils.gmem_tiled_copy``: rows of 96 values).
    n = max(64, tile[1] - tile[1] % 64)
    while n > 64 and fp8_smem_bytes(d, dv, 64, n, 2) > SMEM_LIMIT:  # a tuning override's tile_n
        n -= 64
    stages = next((s for s in range(max_stages, 2, -1) if fp8_smem_bytes(d, dv, 64, n, s) <= SMEM_LIMIT), 2)
    return 64, n, stages, 0


def fp8_qkv_smem_bytes(d: int, dv: int, tile_m: int, tile_n: int, stages: int) -> int:
    """Shared memory of an FP8 Q, K, V tile: Q, the K, V and V^T stages (one byte a value)
    and 2 KB: the mbarriers (and, where the kernel quantizes 16-bit Q, its amax words) below
    sQ's 1 KB alignment, and the unused 16-bit stand-ins (sO, sKw, sVw: 48 bytes) padded to
    sVt's. d = 256, (128, 128, 2): 231,424 bytes allocated, the buffers + 2,048.
    16-bit Q is quantized from registers (``q_quant``): no 16-bit staging buffer."""
    return tile_m * d + stages * tile_n * (d + 2 * dv) + 2048


def fp8_qkv_tile(d: int, dv: int, tile: tuple, page_size: int = 0, causal: bool = False,
                 measured: bool = True, leftpad_k: bool = False, boxes: bool = False, keep_n: bool = False) -> tuple:
    """The tile of FP8 Q, K and V from the 16-bit one: tile_n a multiple of 32 (an 8-bit
    wgmma's k-block, the unit of the V transposes) that divides a page of a multiple of 64
    keys (one TMA per block; other pages are gathered) and fits two stages, and the stages
    that fit.

    ``measured`` (no tuning override, a prefill tile): the tile measured best instead of
    the 16-bit one. H200, b4 s8192, TFLOP/s non-causal / causal (``bench_tiles.py
    --sm90-fp8``, results/tiles_sm90_fp8_*2026-12-01_s0.csv): d64 (192, 160) 643 / 514, (192,
    128) 613 / 567, (192, 192) 535 / 458; d128 (192, 96) 897 / 801 (three consumer
    warpgroups: the exponentials of two overlap the third's GEMMs), (128, 192) 822 / 763,
    (128, 128) 767 / 731, (128, 224) 811 / 736, (192, 128) 715 / 655 (spills at 160
    registers), 3 or 4 stages no faster; d256 (128, 96) 937 / 891, (128, 64) 761 / 723.
    d256 again, H100 2026-12-06 (one process per variant, two runs each): (128, 96)
    1007-1010 / 916; (128, 128) (FA3's tile; fits since the unused stand-ins lost their
    alignment) 932-947 / 861-866 (consumer spills at 232 registers), 969-995 / 916-928 with
    (24, 240) budgets; FA3's ping-pong at d256 FP8 976-980 / 903-907 (128, 96), 971-975 /
    922-924 (128, 128). Kept (128, 96), no ping-pong.

    ``boxes``: pages of another multiple of 16 are read by TMA boxes (``kv_box_rows``), not
    gathered. ``keep_n`` (a tuning override's tile): a tile_n that a page of a multiple of 64
    does not divide is kept where boxes read it, for measuring them there."""
    m, n, stages = tile[:3]
    if measured and m > 64:
        dmax = max(d, dv)
        if dmax <= 64:
            n = 128 if causal else 160
        elif dmax <= 128:
            m, n = 192, 96
        elif dmax > 192:
            n = 96
    # A page of a multiple of 64 keys holds whole blocks (one TMA each); other pages of a
    # multiple of 16 keys are read in boxes of 16 or 32 rows (``kv_box_rows``: tile_n is a
    # multiple of 32 here); the rest (1, 8, ...) are gathered row by row (``gathers_kv``) by
    # producer warps 0 (K) and 1 (V; warps 2-3 transpose V), which needs the registers of a
    # one-consumer-warpgroup tile: tile_m 64. sm_90a SASS, pages of 16 gathered, causal
    # prefill, local-memory accesses: d 128 (128, 128) 316, (128, 96) 265, (64, 128) 0; d 64
    # (128, 128) 277; d 256 (128, 96) 225, (64, 96) 0.
    tma_pages = page_size and page_size % 64 == 0 and not leftpad_k  # cache_leftpad: gathered (gathers_kv)
    boxed = boxes and page_size and not (tma_pages or leftpad_k) and page_size % min(KV_BOX_ROWS) == 0
    if page_size and not (tma_pages or boxed):
        m = 64
    divides = lambda t: page_size % t == 0 or (keep_n and kv_box_rows(t, page_size, leftpad_k, boxes) > 0)
    fits = lambda t: (not tma_pages or divides(t)) and fp8_qkv_smem_bytes(d, dv, m, t, 2) <= SMEM_LIMIT
    n = next(t for t in range(n - n % 32, 31, -32) if fits(t))
    while stages > 2 and fp8_qkv_smem_bytes(d, dv, m, n, stages) > SMEM_LIMIT:
        stages -= 1
    return m, n, stages, tile[3]


def fp8_qkv_decode_tile(d: int, dv: int, page_size: int = 0, leftpad_k: bool = False, boxes: bool = False):
    """(tile, CTAs per SM) of FP8 Q, K, V decode (at most 64 packed rows, not batch
    invariant, d and d_v <= 128; None otherwise): two CTAs per SM, so that one CTA's chain
    of Q K^T, softmax, V transposes and P V runs while the other's loads wait. Where blocks
    come by TMA, whole or in boxes of ``kv_box_rows`` (pages of 16), (64, 128, 2)
    (``fp8_qkv_tile`` fits tile_n to a page of 64); where rows are gathered (pages of 1,
    cache_leftpad), (64, 64, 3): a warp gathers half as
    many rows a block, with a third stage in flight. H100, 2026-12-06, h32/8 d128, bf16 q
    quantized in the kernel, us (``bench_fp8_decode.py --sm90-tiles``, one run): b1 x
    131072 108.8 against 110.1 on (64, 128, 3) one CTA; b64 x 4096 contiguous 198.9 / 198.5,
    pages of 64 197.5 / 213.5; pages of 16 (64, 64, 3) 214.7 against 274.5 (and (64, 128,
    2) 220.9), pages of 1 248.1 against 337.8 (255.5); the widening kernel 255.0 at both.
    Pages of 64 with four stages ((64, 64, 4): as many bytes in flight as (64, 128, 2),
    still two CTAs a SM): H100, 2026-12-07, same run, 201.2 against 197.8 us: kept two."""
    if max(d, dv) > 128:
        return None
    gathered = gathers_kv(64, page_size, leftpad_k, boxes)  # (no page holds a whole block)
    tile = fp8_qkv_tile(d, dv, (64, 64, 3, 0) if gathered else (64, 128, 2, 0), page_size, measured=False,
                        leftpad_k=leftpad_k, boxes=boxes)
    assert fp8_qkv_smem_bytes(d, dv, *tile[:3]) + 3072 <= TWO_CTAS_SMEM, tile
    return tile, 2


# Under two-level accumulation (``fp8_two_level_interval``) a consumer thread of the FP8 Q,
# K, V kernel holds O twice (d_v fp32 values), S (tile_n / 2) and P (tile_n / 8 words):
# their sum that stays clear of local memory with 3, 2 and 1 consumer warpgroups (160, 232
# and 256 registers, ``WarpRoles``). sm_90a SASS, two-level, local-memory instructions: 3
# warpgroups d 64 (192, 128) 2 (as without the option at d 128), (192, 160) 170, d 96
# (192, 96) 96, d 128 (192, 96) 482; 2 warpgroups d 128 (128, 128) 0, (128, 160) 120; 1
# warpgroup d 128 (64, 128) 0, d 192 (64, 64) 0, d 256 (64, 64) 607.
TWO_LEVEL_REGS = {3: 144, 2: 208, 1: 232}


def two_level_fits(dv: int, tile_m: int, tile_n: int) -> bool:
    """Whether the FP8 Q, K, V tile keeps both O accumulators in registers (``TWO_LEVEL_REGS``)."""
    return dv + tile_n // 2 + tile_n // 8 <= TWO_LEVEL_REGS[tile_m // 64]


def fp8_two_level_tile(d: int, dv: int, tile: tuple, page_size: int = 0, leftpad_k: bool = False,
                       boxes: bool = False):
    """The FP8 Q, K, V tile (``fp8_qkv_tile``'s) under two-level accumulation: the same
    where ``two_level_fits``; else, from its tile_m down, 64 rows (one consumer warpgroup)
    at a time, the widest tile_n (a multiple of 32, <= the tile's, or <= max(its, 128) once
    tile_m is lowered) that fits, taken where it keeps 96 columns at least (tile_m is lowered
    first: a narrow block pays the softmax's row reductions for fewer keys) or tile_m is 64;
    ``fp8_qkv_tile`` then fits it to the page size and shared memory. None where nothing
    fits: d_v > 192 (the 256 tile). Chosen from SASS register fits, not timed."""
    m, n, stages, ex2 = tile[:4]
    if two_level_fits(dv, m, n):
        return tile
    for rows in range(m, 63, -64):
        cap = n if rows == m else max(n, 128)
        t = next((t for t in range(cap - cap % 32, 31, -32) if two_level_fits(dv, rows, t)), 0)
        if t >= (32 if rows == 64 else 96):
            return fp8_qkv_tile(d, dv, (rows, t, stages, ex2), page_size, measured=False, leftpad_k=leftpad_k,
                                boxes=boxes)
    return None


def kv_box_rows(tile_n: int, page_size: int, leftpad_k: bool = False, boxes: bool = False) -> int:
    """Rows of the TMA boxes a paged cache is read by where its pages hold no whole tile_n
    block (0: one box per block, or no boxes at all, ``gathers_kv``): ``paging.box_rows``,
    the largest of ``KV_BOX_ROWS`` that divides both the page and the block. None of them
    divides the page (pages of 1, 8, 24, ...), or a sequence starts inside a page
    (``leftpad_k``), or ``boxes`` is off (the planner passes ``tuning.paged_kv_boxes``): 0,
    and rows are gathered."""
    if not boxes or leftpad_k:
        return 0
    return box_rows(tile_n, page_size)


def gathers_kv(tile_n: int, page_size: int, leftpad_k: bool = False, boxes: bool = False) -> bool:
    """Whether a paged cache (page_size > 0) is read by cp.async row gathers: its pages
    hold neither whole tile_n blocks (one TMA box each) nor boxes of ``kv_box_rows`` rows;
    or its sequences start at a per-sequence position (``leftpad_k``: cache_leftpad), so a
    block starts inside a page."""
    return page_size > 0 and (page_size % tile_n != 0 or leftpad_k) and not kv_box_rows(tile_n, page_size, leftpad_k,
                                                                                         boxes)


def persistent_fits(d: int, dv: int, tile: tuple, pack: int, varlen_q: bool, is_split: bool,
                    gather_kv: bool, seqused_q: bool = False) -> bool:
    """Whether a persistent kernel fits: where O leaves by TMA (batch tensors, unpacked,
    unsplit, every row written) it needs its own shared-memory buffer next to Q, K and V (``separate_o``);
    d >= 192 tiles have no room for it. The tile loop's live values do not fit the
    registers of three consumer warpgroups (d <= 64, 160 registers each: 67 local-memory
    accesses, 0 one CTA per tile), nor those of a gathering producer at 40 (two consumer
    warpgroups: 10, 2 one CTA per tile). Those stay one CTA per tile."""
    m, n, stages = tile[:3]
    if not persistent_registers_fit(m, gather_kv):
        return False
    uses_tma_o = pack == 1 and not varlen_q and not is_split and not seqused_q
    return smem_bytes(d, dv, m, n, stages) + (2 * m * dv if uses_tma_o else 0) <= SMEM_LIMIT


def persistent_registers_fit(tile_m: int, gather_kv: bool) -> bool:
    """The register limits of ``persistent_fits``: at most two consumer warpgroups, one
    where a producer gathers rows."""
    return tile_m // 64 < 3 and not (gather_kv and tile_m // 64 >= 2)


def fp8_qkv_persistent_fits(d: int, dv: int, tile: tuple, gather_kv: bool) -> bool:
    """``persistent_fits`` for the FP8 Q, K, V kernel: its O leaves from registers (no
    buffer of its own), so the stages alone must fit; the same register limits."""
    m, n, stages = tile[:3]
    return persistent_registers_fit(m, gather_kv) and fp8_qkv_smem_bytes(d, dv, m, n, stages) <= SMEM_LIMIT


def key_extra(gather_kv: bool, persistent, ctas_per_sm: int, quantize_q: bool, two_level: int = 0,
              kv_box: int = 0) -> tuple:
    """The forward key's SM90 fields after the common ones: gather_kv, persistent (a bool,
    or "dynamic": ``sm90.persistent``), then
    ctas_per_sm where it is 2, ``keys.QUANTIZE_Q`` where the kernel quantizes 16-bit
    queries, ``keys.two_level_field`` where the FP8 P V product is accumulated in two
    levels and ``keys.kv_box_field`` where pages are read in boxes of fewer than tile_n
    rows (each absent otherwise: the keys from before either existed keep their form)."""
    return (gather_kv, persistent) + ((ctas_per_sm,) if ctas_per_sm > 1 else ()) + \
        ((QUANTIZE_Q,) if quantize_q else ()) + ((two_level_field(two_level),) if two_level else ()) + \
        ((kv_box_field(kv_box),) if kv_box else ())


def parse_key_extra(rest: tuple) -> dict:
    """The kernel's keyword arguments (ctas_per_sm, quantize_q, two_level, kv_box) from the
    fields ``key_extra`` put after gather_kv and persistent."""
    flags = [x for x in rest if x == QUANTIZE_Q or parse_two_level(x) or parse_kv_box(x)]
    ctas = [x for x in rest if x not in flags]
    assert len(ctas) <= 1 and len(flags) == len(set(flags)) <= 3, rest
    two_level = max([parse_two_level(x) for x in flags] + [0])
    kv_box = max([parse_kv_box(x) for x in flags] + [0])
    return dict(ctas_per_sm=ctas[0] if ctas else 1, quantize_q=QUANTIZE_Q in rest, two_level=two_level,
                kv_box=kv_box)


def unsupported_reason(d: int, dv: int) -> Optional[str]:
    """Why the SM90 kernel cannot run a problem (None when it can); the caller falls back.
    Every page size runs: by TMA per block, or by row gathers."""
    if d % 16 or dv % 16 or d > 256 or dv > 256 or d < 16 or dv < 16:
        return f"SM90 kernel needs head dims that are multiples of 16 up to 256, got ({d}, {dv})"
    return None


class WarpgroupRoles:
    """The thread counts of an SM90 kernel of one producer warpgroup (warps 0-3) and
    ``num_consumer_wgs`` consumer warpgroups: a mixin of its frozen role dataclass."""

    producer_warps = (0, 1, 2, 3)
    producer_threads = 128

    @property
    def consumer_threads(self) -> int:
        return 128 * self.num_consumer_wgs

    @property
    def threads(self) -> int:
        return self.producer_threads + self.consumer_threads


@dataclass(frozen=True)
class WarpRoles(WarpgroupRoles):
    """Warp roles and their register budgets (setmaxnreg). The producer warpgroup only
    issues TMA from one thread, so it gives its registers to the consumers, which hold
    S, P and O in registers. Budgets sum to at most 64K registers per CTA."""

    num_consumer_wgs: int
    producer_regs: int
    consumer_regs: int
    gather_kv: bool  # every producer warp gathers KV rows by cp.async (else warp 0 issues TMA)
    transpose_v: bool = False  # FP8 Q, K, V: producer warps 1-3 (2-3: split_gather) transpose V for the P V wgmma

    @property
    def gather_threads(self) -> int:
        """Threads that gather the rows of one block (``gather_kv``): the producer warpgroup,
        or one warp where the others transpose V (FP8 Q, K, V: ``split_gather``)."""
        return 32 if self.transpose_v else self.producer_threads

    @property
    def split_gather(self) -> bool:
        """FP8 Q, K, V gathering rows: warp 0 gathers K, warp 1 V, each with its own page
        lookups in flight (one warp gathering both waited for two lookup round trips per
        block). H100, b64 x 4096 h32/8 d128 decode, quantizing kernel, us (``bench_fp8_decode.py``),
        one warp (2026-12-05) / two (2026-12-06): pages of 1 453 / 340, 16 407 / 275; the
        widening kernel in the same runs 258 / 256, 258 / 255."""
        return self.transpose_v and self.gather_kv

    @property
    def first_transposer(self) -> int:
        """The first producer warp that transposes V (after the TMA issuer or the two gatherers)."""
        return 2 if self.split_gather else 1

    @property
    def transposer_warps(self) -> int:
        """Producer warps that transpose V (fp8 Q, K, V): those from ``first_transposer``."""
        return len(self.producer_warps) - self.first_transposer if self.transpose_v else 0

    @staticmethod
    def for_consumers(num_consumer_wgs: int, gather_kv: bool = False, ctas_per_sm: int = 1,
                      transpose_v: bool = False, kv_boxes: bool = False) -> "WarpRoles":
        # A gathering producer holds a page and a row per gathered row (8 of each at
        # tile_n 128) to overlap their lookups: with one consumer warpgroup the register
        # file has room for 96 (56 spilled); with two, 40, paid for by the consumers
        # (240 -> 232). The launch gives every thread 65536 / threads registers, the pool
        # setmaxnreg redistributes: producer + consumers <= 512, 504, 512 for 1, 2, 3.
        # Transposing producer warps (FP8 Q, K, V) hold four words of V and their
        # transposes per step: the gathering producer's budgets.
        # A producer reading a block in TMA boxes (``kv_box_rows``) holds a page-table
        # entry per box (8 at tile_n 128, pages of 16) across the wait for the stage: the
        # gathering producer's budgets (sm_90a SASS, 16-bit d128 prefill over pages of 16,
        # (128, 128): 36 local-memory instructions at 24 registers, none at 40).
        busy = gather_kv or transpose_v or kv_boxes
        regs = {1: (96 if busy else 56, 256), 2: (40, 232) if busy else (24, 240),
                3: (32, 160)}[num_consumer_wgs]
        if ctas_per_sm == 2:  # two CTAs of one consumer warpgroup share the file: 256 per pair
            assert num_consumer_wgs == 1
            regs = (64, 192) if gather_kv else (56, 200)
        return WarpRoles(num_consumer_wgs, *regs, gather_kv, transpose_v)


QK_MODES = ("one", "split", "seesaw")
# The TMA kernel's modes (``sm90.mla``: its default per cache dtype, DEFAULT_TMA_MODE;
# FLASH_ATTN_CUTE_MLA_SM90_QK names one): "tma"; "tma_runs", its
# steady steps split by mask runs (``mla_decode_tma.step_runs``: no mask test inside the
# unmasked run); "tma_lag", those runs and a lagging running row max
# (``mla_decode_tma.RESCALE_LOG2``: O's rescale skipped by a warp whose rows kept their max).
TMA_MODES = ("tma", "tma_runs", "tma_lag")


@dataclass(frozen=True)
class MlaRoles(WarpgroupRoles):
    """Static warp roles, tiles and register budgets (setmaxnreg)."""

    tile_m: int = 64  # packed rows: one wgmma M
    tile_n: int = 32  # keys per stage
    stages: int = 4  # 3 with qk="split" (its S exchange takes the fourth's smem)
    num_consumer_wgs: int = 2  # each owns D_CKV / num_consumer_wgs output columns
    producer_regs: int = 40
    consumer_regs: int = 232
    # How the consumer warpgroups share S = Q K^T.
    # "one": warpgroup 0 computes all of S and the softmax, and hands P (bf16, written over
    #   the stage's kpe rows, which only S reads) and the row corrections to warpgroup 1
    #   through shared memory; 4 stages. See the module docstring.
    # "split": each computes S over half of the k16 slices and the fp32 halves are summed
    #   through a 2 x 2 x 8 KB exchange; both run the softmax; 3 stages.
    # "seesaw" (FlashMLA's schedule): the warpgroups take turns, tile by tile, computing S
    #   and the softmax; each publishes P, its row corrections and row maxima through shared
    #   memory, and both add every tile's P V to their halves of O; 4 stages.
    # H200, 2026-11-29, bf16, 64 heads, page 1: "one" 3.06 against 2.96 TB/s at 768 x 2048,
    # 3.08 against 2.94 at 768 x 1024 (both pass every GPU test); "seesaw" against "one":
    # ``sm90/mla.py`` (DEFAULT_QK_MODE). "seesaw" needs three stages at least (a warpgroup
    # waits for tile i + 1 before it releases tile i - 1).
    qk: str = "seesaw"
    # An FP8 cache: the producer gathers fp8 tiles into staging buffers this deep (each
    # thread its own chunks), then widens its chunks into the 16-bit stages; 0: 16 bits.
    fp8_stages: int = 0

    @property
    def o_cols(self) -> int:
        return D_CKV // self.num_consumer_wgs

    @property
    def xchg_words(self) -> int:
        """fp32 words exchanged between the consumer warpgroups. "split": S per thread x 128
        threads x 2 warpgroups x 2 buffers. "one": a row correction per row and stage, then
        the final 1 / row sum. "seesaw": a row correction and a row max per row and stage,
        then each thread's two row sums, both warpgroups (``mla_decode.sum_row_sums``)."""
        if self.qk == "split":
            return 4 * self.tile_m * self.tile_n
        # "seesaw": then each thread's row sums, both warpgroups (2 rows a thread).
        return self.tile_m * self.row_cols + (2 * 128 * 2 if self.qk == "seesaw" else 0)

    @property
    def row_cols(self) -> int:
        """Per-row fp32 values exchanged ("one", "seesaw"; ``sXchg`` as (tile_m, row_cols)):
        a correction per stage, then "one": the final 1 / row sum, "seesaw": a row max per
        stage."""
        return self.stages + 1 if self.qk == "one" else 2 * self.stages

    def smem_bytes(self, elem: int = 2) -> int:
        """Q, the stages, the fp8 staging, the exchange, and 4 KB for the mbarriers and alignment."""
        return ((elem * (self.tile_m + self.stages * self.tile_n) + self.fp8_stages * self.tile_n) * (D_CKV + D_KPE)
                + 4 * self.xchg_words + 4 * 1024)

    def __post_init__(self):
        # The launch gives each thread 65536 / 384 registers; setmaxnreg moves them around
        # within the warpgroups' sum (per-warpgroup budgets of 128 threads).
        assert self.qk in QK_MODES, self.qk
        assert self.producer_regs + self.num_consumer_wgs * self.consumer_regs <= 512
        assert self.tile_m == 64 and self.tile_n % 16 == 0 and self.o_cols <= 256
        assert self.o_cols * self.tile_m // 128 + 40 <= self.consumer_regs, "O half + S, P, stats"
        # "one" / "seesaw": P (tile_m x tile_n) lives in a stage's kpe rows (tile_n x
        # D_KPE), same size and stage stride; one warpgroup computes each tile's S.
        assert self.qk == "split" or (self.tile_m == D_KPE and self.num_consumer_wgs == 2)
        assert self.smem_bytes() <= SMEM_LIMIT, "shared memory"
        assert self.qk != "seesaw" or self.stages >= 3, "seesaw: three stages at least"


def mla_roles(tile_n: int, stages: int, qk: str, fp8_stages: int = 0) -> MlaRoles:
    """The MLA kernel's roles from its key's config. An FP8 cache's producer also widens
    (``mla_kernel.WIDEN_GROUP`` chunks in flight): 56 registers (at 40 ptxas spilled the
    tile's scalars around the role split), taken from the consumers (the highest register
    of the 16-bit kernel's S warpgroup is R179)."""
    regs = dict(producer_regs=56, consumer_regs=224) if fp8_stages else {}
    return MlaRoles(tile_n=tile_n, stages=stages, qk=qk, fp8_stages=fp8_stages, **regs)
