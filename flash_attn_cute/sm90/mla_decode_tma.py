"""MLA decode for SM90 over pages that hold whole 64-key tiles (page size a multiple of 64,
the MLA page of vLLM's and SGLang's FlashMLA backends): two warpgroups that both load and
compute, bulk-tensor (TMA) loads of 64-key tiles, FlashMLA's seesaw schedule (its SM90
dense decode, ``csrc/sm90/decode/dense/``, read for this module; written for this package).

One CTA computes ``TILE_M`` = 64 packed rows (query position x head of one KV head, as in
``mla_kernel``) of one sequence [and one KV split]. Per KV tile of ``TILE_N`` = 64 keys:

    bytes from HBM     64 x (512 + 64) x 2                 = 73.7 KB
    S = Q K^T          64 x 64 x 576 x 2                   = 4.72 MFLOP
    O += P V           64 x 64 x 512 x 2                   = 4.19 MFLOP

Why not the gathering kernel (``mla_decode.py``) at these page sizes. Its consumers read Q
from shared memory for every 32 keys (a 64 x 32 x 16 wgmma reads 2 KB of A and 1 KB of B
in the 16 cycles it computes: 192 bytes a cycle against the 128 shared memory serves), and
its producer warpgroup writes every row with 18 cp.async per thread and tile; the H200
profile (``results/ncu/ncu_mla_sm90_768x2048_2026-12-02_s10.txt``) shows 59% of the L1
bandwidth and twice FlashInfer's instruction count for the same bytes. Here a 64-key tile
halves the reads of Q per key (64 x 64 x 16: 4 KB in 32 cycles, at the 128-byte limit), a
tile's nine 64 x 64 chunks arrive by nine TMA instructions of one lane, and no warpgroup
is spent on loading.

Buffers and chunks. Q (72 KB) stays in shared memory; K tiles alternate between two
buffers (``sC`` 64 x 512 and ``sKp`` 64 x 64 each), tile i in buffer i % 2. A tile is nine
64 x 64 chunks, one TMA box and one mbarrier each (the waiter starts S on chunk 0 while
chunks 1-8 land): 0-3 are V's left half (O columns 0-255), 4-7 its right half, 8 the
rotary keys. Warpgroup w computes S and the softmax of the tiles in buffer w and O's
columns [256 w, 256 w + 256) of every tile.

The seesaw, per pair of tiles (a = i in buffer 0, b = i + 1 in buffer 1), the running row
max shared through ``sM``:

    WG0                                        WG1
    row max of S_a (m_a) -> SCALE0              .
    P_a, O *= corr_a                            SCALE0 -> row max of S_b (m_b) -> SCALE1
    O += P_a V_a[:, left] (P from registers)    P_b, O *= corr_a corr_b
    SCALE1 ->                                   P_b -> sP1; O += P_b V_b[:, right] (registers)
    TMA tile i + 2, chunks 0-3 (V_a left done)  .
    P_a *= corr_b -> sP0 -> P0                  P0 -> O += sP0 V_a[:, right] -> O1_ISSUED
    O1_ISSUED -> O *= corr_b,                   TMA tile i + 3, chunks 4-8 (V_b right done)
      O += sP1 V_b[:, left]                     TMA tile i + 2, chunks 4-8 (V_a right done)
    S_{i+2} chunks 0-3; TMA tile i + 3,         S_{i+3}, chunks 0-8
      chunks 0-3 (V_b left done); chunks 4-8

(named barriers ``Sm90MlaTmaBarrier``; "X ->" waits, "-> X" arrives). A warpgroup
publishes its row max before its exponentials (FlashMLA after them), so the other's
softmax starts while they run. With ``lag_max`` (mode "tma_lag", the default over 16-bit
caches: ``sm90/mla.py`` has the measurement) the shared max lags (``RESCALE_LOG2``, as
FA4's SM100 softmax): it moves only when a tile's scores pass it by more than a factor 2^8
(e4m3 P: 2^2.5), so after a sequence's first tiles the corrections are exactly 1 and a
warp skips the rescales above (O *= corr: 128 FMUL a thread, twice a step in warpgroup 0;
P_a *= corr_b) on a warp vote. Every chunk is
reloaded by the warpgroup that last read it, after its own wgmma wait; the only chunks the
other warpgroup reads (the other half of V, P) are released by the barrier order above.
sP0 lives over buffer 0's rotary chunk (free once S_a landed, reloaded only after WG1's
P V of it), sP1 in its own 8 KB. Each step ends with no wgmma in flight: the tails (the
last one to three tiles) are separate instantiations of the same step (static flags), so
no wgmma is ever issued under a branch ptxas cannot prove uniform (it would serialise
every wgmma of the kernel).

Masks. Tiles go from the sequence's last block down (``MlaTile``): only tile 0 can hold
keys past the sequence end. Its rows past the end hold what the page holds (NaN, maybe):
scores masked to -inf, and WG0 zeroes those V rows once S_0 landed, before either
warpgroup's P V reads them. Causal (and context-parallel) masks on the tiles outside the
unmasked run, as every kernel (``BlockInfo``).

Shared memory: Q 72 KB, two 72 KB buffers, sP1 8 KB, the row statistics and 18
mbarriers: 225.4 KB of the 227 (O's staging, 65 KB or 130 KB for fp32 partials, lies over Q
and the buffers once the last P V landed). 256 threads, 1 CTA per SM, no setmaxnreg (255
registers each: O 128 + S 32 + P 16; 225 used, no local memory).

An e4m3 cache (FlashMLA's FP8 recipe, the same seesaw): both products in fp8 wgmma
(QGMMA 64 x 64 x 32 and 64 x 256 x 32), half the bytes per key (36.9 KB a tile) and twice
the tensor rate. A tile is five chunks (four of 64 x 128 ckv bytes, one of 64 x 64 kpe).
The queries are quantized to e4m3 in the kernel (``q_quant.quantize_q_tile``: one
power-of-two scale for the tile's q_nope and q_pe, folded with ``kv_descale`` into the
softmax scale), P is rounded to e4m3 with its row max at 2^8 (``FP8_P_OFFSET``; "tma_lag":
a fresh max at 2^6, a lagging one up to 2^8.5, ``RESCALE_LOG2``; the LSE takes it back
out) and O is multiplied by ``kv_descale`` at the end. An 8-bit wgmma reads B K-major
only, so each warpgroup transposes its own half of V (ckv columns [256 w, 256 w
+ 256), the O columns it owns) of every tile into V^T (``transpose_half``:
``fp8_operands.transpose_v_block``, ldmatrix / prmt / stmatrix.trans, 128 bytes a thread
per half-tile), in the key order that lets its own P stay in registers (``p_to_fp8``);
the P it shares is stored in the RS operand's own layout, so the other warpgroup's SS
wgmma reads it in the same order. The transposes sit where a warpgroup would wait: under
the S of the next tile it owns, and before the barriers SCALE0 (warpgroup 1) and
O1_ISSUED (warpgroup 0); ``VT0`` / ``VT1`` meet a warpgroup's four warps once its V^T is
fenced. Tile 0's tail keys are zeroed as transposed. P V reads V^T, not the chunks, and
sP0 has its own 4 KB: a tile's chunks reload once its S and its transposes read them (the
left half by warpgroup 0 at its step's start and after its transpose of V_b, the right
halves by warpgroup 1 after SCALE0), about a step earlier than for 16 bits, where P V
reads the chunks. Q 36 KB, buffers 2 x 36 KB, V^T 2 x 32 KB, sP0 and sP1 4 KB each: 184
KB.

What bounds an e4m3 tile (the split model's fit, ``sm90/mla.py``, H100 2026-12-07): 1.46 us a
64-key tile in a CTA where few run (16-bit: 1.69), 1.80 us with every SM busy (16-bit: 2.11),
while its bytes at HBM's share take 1.58 us (132 CTAs): an e4m3 cache is not yet memory-bound,
so it gains 1.15-1.3x, not 2x, over 16 bits. Neither issue nor the tensor pipe sets that pace:
the steady step (a pair of tiles) is 1,050 instructions a thread in warpgroup 0 and 935 in
warpgroup 1 (sm_90a SASS, 64 heads: FMUL 292 / 132, PRMT 64, 16 LDSM and 16 STSM of the
transposes), about 0.6 us of issue a tile on a SM sub-partition's two warps, and the
QGMMAs 0.6 us at the tensor pipe's peak; the rest is the step's dependency chain (the
barriers of the seesaw, each wgmma wait). Warpgroup 0's 256 O rescales a step (O *= corr_a,
then corr_b) against warpgroup 1's 128 are the difference between the two loops. On that
chain, between S's wait and its row max, every step also runs the mask test of the sequence
end (``row_stats``): ptxas if-converts it, 91 and 111 instructions a step (16-bit: 71, 72),
which the modes "tma_runs" and "tma_lag" (``step_runs``; ``sm90/mla.py``) take out of
the unmasked blocks' steps. Each step also divides by the page's sub-block count twice
(``_TileLoader.page``), a FastDivmod multiply: with a runtime division the steps above
were 1,098 / 992 instructions (16-bit, lagging max: 1,089 / 967, now 1,054 / 939).

Beside FlashMLA (its SM90 dense decode as sglang-kernel 0.4.4 builds it; both SASS
listings summarised in ``benchmarks/results/sass_mla_flashmla_vs_tma_2026-12-05_s13.txt``,
``benchmarks/sass_summary.py``). Per kernel the same mix: 196 HGMMA (64 x 64 x 16 for S,
64 x 256 x 16 for P V), 59 bulk-tensor loads, 17 wgmma waits, about 205 MUFU.EX2; 7,784
instructions here against its 7,488 (this kernel at 2026-12-08, with the lagging max's
unmasked steps: 9,224, 240 HGMMA). Where its steady step spends issue slots that FlashMLA's
does not: warpgroup 1's 939 instructions a step hold ~240 between its P V's wait and its
next S that issue ten chunk loads, ~24 a chunk (coordinates computed in vector registers and
moved to uniform ones, 61 R2UR, an ELECT loop and a vote around each UTMALDG; 111 R2UR in
the whole step, 64 in warpgroup 0's), where FlashMLA keeps them in uniform registers.
Q's rotary chunk lives in registers in both (an RS wgmma for S's ninth chunk: a ninth less
of S's shared-memory A traffic, which sits at the 128 bytes a cycle shared memory serves; FlashMLA puts sP1 over that chunk's shared memory,
this kernel keeps it: nothing else needs the 8 KB). What it does that this kernel does not:
a metadata kernel hands each SM a length-balanced run of (sequence, block) work (persistent
CTAs: no partial last wave, no even-split rounding, and the next item's loads under the
last one's epilogue), and the combine starts under PDL. This kernel takes a device-computed schedule too
(``scheduler_metadata``, ``kernels/mla_schedule.py``): length-balanced pieces, one CTA each
(not persistent), a whole sequence written directly, pieces as fp32 partials in compact
slots (H200, 2026-12-06: 1.10x the host's even splits at 64 x mixed lengths ~1024, 0.95-0.97x
where nothing needs cutting; ``benchmarks/RESULTS.md``). What this kernel does that it does
not: the row max is published before the exponentials (see the seesaw above).

A CTA's first bytes. Its first two tiles wait for a page-table read, then their TMA, two
memory round trips under a loaded memory system, whatever the order; Q's loads need one.
Warp 0 issues the tiles once its loads of Q are out (``first_loads``), so that quantizing Q
(an e4m3 cache under 16-bit queries: Q in registers, its amax across the CTA, Q / 2^e to
shared memory) runs while the tiles are in flight, not after them: the quantizing call was
4-13 % slower than the same cache with e4m3 queries at 64 heads. H200, 2026-12-06, two
alternating passes of ``benchmarks/ab_run.sh`` (``results/mla_ab_h200_2026-12-06_s22.txt``),
this order and the rotary chunk in registers against neither, time ratios: an e4m3 cache
1.022x (64 x 1024), 1.047x (768 x 1024), 1.046x (128 x 2048), 1.021x and 1.013x (128 heads
128 x 2048, 32 x 8192); bf16 1.024x (64 x 1024), 1.002-1.006x elsewhere; e4m3 queries
1.002-1.019x. At 64+ heads the quantizing call now trails the e4m3 queries by 0.6-4.4 % on
the rows of one split, 8-12 % at 64 x 1024 and 64 x 2048 (splits of eight and sixteen tiles,
where a CTA's start weighs most; the profile that would split that time is not yet taken).

The epilogue, as FlashMLA's: O (or a split's fp32 partial) goes to shared memory over Q and
the buffers, rows padded by 16 (32) bytes, and leaves a row a thread by one bulk copy
(``cp.async.bulk``, 1 or 2 KB; no tensor map, so any row stride). From registers it took 64
pair stores a thread over eight rows each; ncu showed the LSU queue full (128 heads 128 x
2048: lg_throttle 0.64 and drain 0.12 stalls per issue, none for FlashMLA). H100, 2026-12-06,
CUDA-graph replays, three runs of the register epilogue against one of this (us): 128 x 1024
78.0-78.5 -> 74.4 (fp8 58.5-58.9 -> 53.3), 128 x 2048 126.8-127.3 -> 123.6 (fp8 87.1-87.7 ->
82.6), 128 heads 128 x 2048 165.5-166.2 -> 158.9 (fp8 146.9-147.8 -> 138.2); the split rows
(fp32 partials: 64 x 1024, 64 x 2048, 32 x 8192, 1 x 32768) within -0.6 to +1.6 %.

Measured (H200, 2026-12-06, CUDA-graph replays, FlashMLA in the same process,
``benchmarks/bench_mla.py``, table and CSV in ``benchmarks/RESULTS.md`` "MLA decode beside
FlashMLA"), ours / FlashMLA: bf16 at 64 heads 0.91-0.95x on the 64-sequence rows and 128 x
1024, 1.01-1.10x at 768 x 1024, 128 x 2048 and 768 x 2048, 1.12x at 16 heads; 128 heads
0.85-0.88x (473-512 TFLOP/s). An e4m3 cache: 1.07-1.28x our bf16 tokens per second,
0.87-1.07x FlashMLA's FP8 mode (e4m3 queries: 0.92-1.09x). The H100 run of the same day
(before the two changes above): bf16 0.85-1.09x, fp8 1.15-1.51x our bf16. Against FlashMLA in ncu
(``results/ncu/ncu_mla_*_h100_2026-12-05_s15.txt``, before the staged epilogue): at 128 heads
the tensor pipe is active 49 % of the time against its 58 %, with more barrier stalls (2.39
against 1.48 per issue) and 256 CTAs (1.94 waves) against 132 persistent ones that share the
work evenly; at 64 x 1024 the kernels are 48.2 and 46.0 us (0.955x; graph-timed 0.916x: the
rest lies outside the kernel, in the combine of two splits by elimination, not profiled; the
split model, ``sm90/mla.py``, runs that row unsplit on the H100: 1.07x FlashMLA graph-timed,
2026-12-07). The fp8 profile showed the loading warps waiting on page-table reads (``_TileLoader.page``).
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup

from flash_attn_cute.device.block_info import BlockInfo
from flash_attn_cute.device.cute_utils import launch_ctas
from flash_attn_cute.device.epilogue import staged_o, staged_o_bytes, store_lse, store_o_staged
from flash_attn_cute.device.fwd_kernel import zero_rows_from
from flash_attn_cute.device.layout_utils import acc_mn_view, acc_to_operand_a, row_major_smem_layout, select, \
    transpose_view
from flash_attn_cute.device.mla_kernel import MlaArgs, MlaTile, load_q_rows, mla_call, set_mla_config
from flash_attn_cute.device.named_barrier import Sm90MlaTmaBarrier
from flash_attn_cute.device.paged_kv import clamp_page, page_entry
from flash_attn_cute.device.softmax import FP8_P_OFFSET, LN_2, LOG2_E
from flash_attn_cute.device.tile_scheduler import SingleTileScheduler, TileDivisors, tile_divisors
from flash_attn_cute.device.variants import apply_to_scores
from flash_attn_cute.host.constants import D_CKV, D_KPE
from flash_attn_cute.sm90.fp8_operands import FP8TileGeometry, p_to_fp8, transpose_v_block
from flash_attn_cute.device.q_quant import quantize_q_tile
from flash_attn_cute.sm90.wgmma_utils import convert_pairs, wgmma_gemm

TILE_M = 64  # packed rows: one wgmma M
TILE_N = 64  # keys per tile: one TMA box row count, a page's sub-block
THREADS = 256
WG_THREADS = 128
HALF_BYTES = TILE_N * D_CKV // 2  # an fp8 half of V (64 x 256), or of V^T (256 x 64): 16 KB
# With ``lag_max`` ("tma_lag") the running row max lags (``row_stats``): a tile whose row max
# passes it by at most this (log2 units of the scaled scores) keeps it, its correction is
# exactly 1, and a warp whose rows all kept theirs skips O's rescale (``rescale_moved``: 128
# FMUL a thread, twice a step in warpgroup 0). P then reaches 2^threshold against the max it
# subtracts: 16-bit P keeps its relative precision (FA4's SM100 rule, 8); e4m3 P is offset to
# 2^LAG_P_OFFSET_E4M3 at a fresh max (not ``FP8_P_OFFSET``'s 2^8), so a stale one reaches
# 2^(6 + 2.5) = 362, under e4m3's largest, 448.
RESCALE_LOG2 = {False: 8.0, True: 2.5}
LAG_P_OFFSET_E4M3 = 6


@dataclass(frozen=True)
class _Chunks:
    """A tile's TMA boxes for a cache of ``width``-bit values: ckv in chunks of 128 bytes a
    row (the swizzle atom's row: 64 16-bit or 128 fp8 columns), then kpe in one; a chunk is
    ``slices`` wgmma K slices of S (16 or 32 columns)."""

    cols: int  # ckv columns per chunk
    c_chunks: int  # ckv chunks: 8 (16-bit) or 4 (fp8)
    slices: int
    kpe_slices: int
    ckv_bytes: int  # one ckv chunk's bytes (8 KB either way)
    kpe_bytes: int

    @staticmethod
    def of(width: int) -> "_Chunks":
        cols, k = 1024 // width, 256 // width
        return _Chunks(cols, D_CKV // cols, cols // k, D_KPE // k, TILE_N * 128, TILE_N * D_KPE * width // 8)

    @property
    def chunks(self) -> int:
        return self.c_chunks + 1

    @property
    def half(self) -> int:
        """A warpgroup's half of V: ckv chunks [half * w, half * (w + 1))."""
        return self.c_chunks // 2


class MlaDecodeSm90Tma:
    __call__ = mla_call  # the MLA kernels' shared entry point: MlaArgs -> launch

    def __init__(self, dtype, qhead_per_kvhead: int, causal, is_split: bool, split_blocks: int, lag_max: bool = False,
                 mask_runs: bool = False):
        set_mla_config(self, dtype, qhead_per_kvhead, causal, is_split, split_blocks)
        self.lag_max = lag_max  # the lagging row max (``RESCALE_LOG2``)
        self.mask_runs = mask_runs  # steady steps split by mask runs (``step_runs``)

    @cute.jit
    def launch(self, args: MlaArgs, stream):
        kv_dtype = args.mCkv.element_type
        # An FP8 (e4m3) cache: both products in fp8 wgmma, Q quantized to e4m3 in the kernel,
        # P rounded to e4m3, V^T written by the warpgroups (``transpose_half``).
        self.fp8 = kv_dtype.width == 8
        assert not self.fp8 or kv_dtype == cutlass.Float8E4M3FN, "an e4m3 cache (e5m2: mla_decode.py)"
        op_dtype = kv_dtype if self.fp8 else self.dtype  # Q's and P's dtype in the wgmma
        self.op_dtype = op_dtype
        self.chunks = _Chunks.of(kv_dtype.width)
        ch = self.chunks
        layouts = (
            row_major_smem_layout(op_dtype, TILE_M, D_CKV), row_major_smem_layout(op_dtype, TILE_M, D_KPE),
            row_major_smem_layout(kv_dtype, TILE_N, D_CKV, 2), row_major_smem_layout(kv_dtype, TILE_N, D_KPE, 2),
            row_major_smem_layout(op_dtype, TILE_M, TILE_N),  # P (sP0 over buffer 0's kpe, sP1)
            row_major_smem_layout(kv_dtype, D_CKV, TILE_N, 2),  # fp8: V^T (d, keys), two buffers
        )
        vt_field = cute.struct.MemRange[kv_dtype, 16]  # unused (16-bit caches keep their smem layout)
        p0_field = cute.struct.MemRange[op_dtype, 16]  # unused (16-bit: sP0 over buffer 0's kpe chunk)
        if cutlass.const_expr(self.fp8):
            # Byte offsets for the transposes: a warpgroup's half of V (64 x 256, 16 KB into
            # the buffer for the right half) and of V^T (256 rows, 16 KB down).
            geo = FP8TileGeometry.of(layouts[2], TILE_N, D_CKV)
            self.v_half_geometry = FP8TileGeometry(geo.rows, D_CKV // 2, geo.width, geo.bits, geo.stage_bytes)
            self.vt_geometry = FP8TileGeometry.of(layouts[5], D_CKV, TILE_N)
            assert geo.offset(0, D_CKV // 2) == HALF_BYTES and self.vt_geometry.offset(D_CKV // 2, 0) == HALF_BYTES
            vt_field = cute.struct.Align[cute.struct.MemRange[kv_dtype, cute.cosize(layouts[5])], 1024]
            p0_field = cute.struct.Align[cute.struct.MemRange[op_dtype, cute.cosize(layouts[4])], 1024]

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, 2 * ch.chunks]
            sM: cute.struct.MemRange[Float32, TILE_M]  # the running row max (log2 units, scaled)
            sCorr: cute.struct.MemRange[Float32, 2 * TILE_M]  # the corrections of S_a, S_b
            sSums: cute.struct.MemRange[Float32, 2 * TILE_M]  # the warpgroups' row sums
            sAmax: cute.struct.MemRange[Float32, THREADS // 32]  # fp8: each warp's amax of Q
            sQn: cute.struct.Align[cute.struct.MemRange[op_dtype, cute.cosize(layouts[0])], 1024]
            sQp: cute.struct.Align[cute.struct.MemRange[op_dtype, cute.cosize(layouts[1])], 1024]
            sC: cute.struct.Align[cute.struct.MemRange[kv_dtype, cute.cosize(layouts[2])], 1024]
            sKp: cute.struct.Align[cute.struct.MemRange[kv_dtype, cute.cosize(layouts[3])], 1024]
            sP1: cute.struct.Align[cute.struct.MemRange[op_dtype, cute.cosize(layouts[4])], 1024]
            sVt: vt_field
            sP0: p0_field

        # Staged O lies over Q, the buffers and (fp8) V^T: contiguous fields of 1 KB multiples.
        over = [(layouts[0], op_dtype), (layouts[1], op_dtype), (layouts[2], kv_dtype), (layouts[3], kv_dtype)]
        over += [(layouts[4], op_dtype), (layouts[5], kv_dtype)] if self.fp8 else []
        field_bytes = [cute.cosize(layout) * dtype.width // 8 for layout, dtype in over]
        staged_dtype = Float32 if self.scheduled else self.out_dtype  # a schedule's items may write partials
        assert all(b % 1024 == 0 for b in field_bytes) and staged_o_bytes(staged_dtype, TILE_M, D_CKV) <= sum(
            field_bytes), "staged O fits over Q and the buffers"
        # TMA views (page_size, d, [h_kv,] num_pages): a tile is (64, chunk) boxes of one page.
        modes = [1, 3, 2, 0] if args.kv_heads else [1, 2, 0]
        tma_op = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_C, tma_C = cpasync.make_tiled_tma_atom(tma_op, select(args.mCkv, modes),
                                                        row_major_smem_layout(kv_dtype, TILE_N, ch.cols),
                                                        (TILE_N, ch.cols))
        tma_atom_Kp, tma_Kp = cpasync.make_tiled_tma_atom(tma_op, select(args.mKpe, modes),
                                                          row_major_smem_layout(kv_dtype, TILE_N, D_KPE),
                                                          (TILE_N, D_KPE))

        k_major, mn_major = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            op_dtype, kv_dtype, k_major, k_major, Float32, atom_layout_mnk=(1, 1, 1), tiler_mn=(TILE_M, TILE_N))
        # The rotary chunk of S reads Q from registers (``issue_s``).
        tiled_mma_qk_rs = sm90_utils.make_trivial_tiled_mma(
            op_dtype, kv_dtype, k_major, k_major, Float32, atom_layout_mnk=(1, 1, 1), tiler_mn=(TILE_M, TILE_N),
            a_source=warpgroup.OperandSource.RMEM)
        # O: the two warpgroups side by side along N, 64 x 256 each; P from registers (its own
        # tile) or from shared memory (the other's). 8-bit wgmma reads B K-major only: V^T.
        v_major = k_major if self.fp8 else mn_major
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            op_dtype, kv_dtype, k_major, v_major, Float32, atom_layout_mnk=(1, 2, 1),
            tiler_mn=(TILE_M, D_CKV // 2), a_source=warpgroup.OperandSource.RMEM)
        tiled_mma_pv_ss = sm90_utils.make_trivial_tiled_mma(
            op_dtype, kv_dtype, k_major, v_major, Float32, atom_layout_mnk=(1, 2, 1),
            tiler_mn=(TILE_M, D_CKV // 2))
        num_m_blocks = args.num_m_blocks(TILE_M, self.qhead_per_kvhead_packed)
        # A schedule's work items take the place of the (sequence, split) pairs.
        grid_splits, grid_outer = (Int32(1), args.num_items()) if self.scheduled else (args.num_splits,
                                                                                      args.batch_size)
        # A page's 64-key sub-blocks: the loader's every-step page lookups divide by it.
        sub_blocks = cute.fast_divmod_create_divisor_v2(cutlass.max(args.mCkv.shape[1] // TILE_N, 1))
        launch_ctas(self.kernel(args, tile_divisors(num_m_blocks, grid_splits), sub_blocks, (tma_atom_C, tma_atom_Kp),
                                (tma_C, tma_Kp), layouts, (tiled_mma_qk, tiled_mma_qk_rs), tiled_mma_pv,
                                tiled_mma_pv_ss, SharedStorage),
                    SingleTileScheduler.grid(num_m_blocks, args.num_kv_heads(), grid_splits, grid_outer),
                    THREADS, SharedStorage, stream)

    @cute.kernel
    def kernel(
        self,
        args: MlaArgs,
        divisors: TileDivisors,  # the grid's M blocks and splits (tile_scheduler.tile_divisors)
        sub_blocks: cute.FastDivmodDivisorV2,  # 64-key sub-blocks a page (``_TileLoader.page``)
        tma_atoms: tuple,  # ckv, kpe
        tma_views: tuple,  # ckv, kpe: (page_size, d, [h_kv,] num_pages) coordinate tensors
        smem_layouts: tuple,  # Qn, Qp, ckv, kpe, P, V^T
        tiled_mmas_qk: tuple,  # S's MMAs: Q from shared memory, and (the rotary chunk) from registers
        tiled_mma_pv: cute.TiledMma,
        tiled_mma_pv_ss: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        sQn_layout, sQp_layout, sC_layout, sKp_layout, sP_layout, sVt_layout = smem_layouts
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == 0:
            for atom in tma_atoms:
                cpasync.prefetch_descriptor(atom)
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        mbar = storage.mbar.data_ptr()
        if tidx == 0:
            for i in cutlass.range_constexpr(2 * self.chunks.chunks):
                cute.arch.mbarrier_init(mbar + i, 1)  # one arrive (with the TMA bytes) per load
            cute.arch.mbarrier_init_fence()
        sC = storage.sC.get_tensor(sC_layout.outer, swizzle=sC_layout.inner)
        sKp = storage.sKp.get_tensor(sKp_layout.outer, swizzle=sKp_layout.inner)
        sVt, sC_addr, sVt_addr = None, None, None
        if cutlass.const_expr(self.fp8):
            sVt = storage.sVt.get_tensor(sVt_layout.outer, swizzle=sVt_layout.inner)
            sC_addr, sVt_addr = storage.sC.data_ptr().toint(), storage.sVt.data_ptr().toint()
        smem = _Smem(
            storage.sQn.get_tensor(sQn_layout.outer, swizzle=sQn_layout.inner),
            storage.sQp.get_tensor(sQp_layout.outer, swizzle=sQp_layout.inner),
            sC, sKp,
            # 16-bit: sP0 over buffer 0's kpe chunk (see the module docstring); fp8: its own,
            # so that the chunk reloads once S_a and the transposes read it. sP1 its own.
            (storage.sP0 if self.fp8 else storage.sKp).get_tensor(sP_layout.outer, swizzle=sP_layout.inner),
            storage.sP1.get_tensor(sP_layout.outer, swizzle=sP_layout.inner),
            sVt,
            storage.sM.get_tensor(cute.make_layout(TILE_M)),
            storage.sCorr.get_tensor(cute.make_layout((TILE_M, 2))),
            storage.sSums.get_tensor(cute.make_layout((TILE_M, 2))),
            storage.sAmax.get_tensor(cute.make_layout(THREADS // 32)),
            # O staged for the bulk row stores, over Q and the buffers (free once the last
            # P V is waited for); a schedule's partials in fp32 over the same bytes.
            staged_o(storage.sQn.data_ptr(), self.out_dtype, TILE_M, D_CKV),
            staged_o(storage.sQn.data_ptr(), Float32, TILE_M, D_CKV) if self.scheduled else None,
            mbar, sC_addr, sVt_addr,
        )
        tile = MlaTile.create(
            args, BlockInfo(TILE_M, TILE_N, self.qhead_per_kvhead_packed, self.variant, self.split_blocks),
            self.is_split, divisors)
        n_tiles = cute.arch.make_warp_uniform(tile.n_tiles)
        cute.arch.sync_threads()  # the mbarriers are initialised
        if tile.rows_valid > 0:
            loader = _TileLoader.create(args, tile, tma_atoms, tma_views, smem, self.chunks, sub_blocks)
            pages = (loader.page(0), loader.page(1))  # (ptxas issues these reads after Q's loads, in warp 0)
            first_loads = lambda: self.first_loads(loader, pages, n_tiles, warp_idx)
            self.mma(tile, n_tiles, smem, loader, first_loads, tiled_mmas_qk, tiled_mma_pv, tiled_mma_pv_ss, args,
                     tidx)

    @cute.jit
    def first_loads(self, loader, pages, n_tiles, warp_idx):
        """Tiles 0 and 1 by warp 0, issued (``mma``) once this thread's loads of Q are: a
        fresh CTA's first bytes then arrive Q first, and quantizing Q (an FP8 cache under
        16-bit queries) runs while the tiles are in flight rather than after them."""
        if warp_idx == 0:
            if n_tiles > 0:
                loader.load(pages[0], 0, 0, self.chunks.chunks)
            if n_tiles > 1:
                loader.load(pages[1], 1, 0, self.chunks.chunks)

    @cute.jit
    def mma(self, tile, n_tiles, smem, loader, first_loads, tiled_mmas_qk, tiled_mma_pv, tiled_mma_pv_ss,
            args: MlaArgs, tidx):
        """Both warpgroups: Q (then ``first_loads()``), the row max, their operands, the seesaw
        (``wg0`` / ``wg1``), the row sums and the epilogue."""
        wg_idx = cute.arch.make_warp_uniform(tidx // WG_THREADS)
        t = tidx % WG_THREADS
        scale = tile.softmax_scale
        if cutlass.const_expr(self.fp8 and self.dtype.width == 16):
            if tidx < TILE_M:
                smem.sM[tidx] = -Float32.inf
            # Q / 2^e in e4m3 (one power-of-two scale for the tile's q_nope and q_pe,
            # ``q_quant``); 2^e and the cache's descale join the softmax scale. The last of
            # its barriers is Q's (sM written, sQ fenced).
            tile = tile.with_kv_descale(args.for_kv_head(tile.head_kv))
            row0 = tile.m_block * TILE_M
            packed = self.qhead_per_kvhead_packed
            q_scale = quantize_q_tile(
                ((tile.q_rows(args.mQn, packed, False), smem.sQn), (tile.q_rows(args.mQp, packed, False), smem.sQp)),
                row0, smem.sAmax, tile.rows_valid, None, tidx, THREADS,
                lambda: cute.arch.barrier(barrier_id=int(Sm90MlaTmaBarrier.Q), number_of_threads=THREADS),
                first_loads)
            scale = tile.softmax_scale * q_scale
        else:
            # 16-bit Q and cache, or FP8 queries (their q_descale and the cache's descale
            # join the softmax scale): Q as it is.
            if cutlass.const_expr(self.fp8):
                tile = tile.with_kv_descale(args.for_kv_head(tile.head_kv))
                scale = tile.softmax_scale
            load_q_rows(tile, smem.sQn, smem.sQp, args, self.dtype, self.qhead_per_kvhead_packed, TILE_M, THREADS,
                        tidx)
            first_loads()
            if tidx < TILE_M:
                smem.sM[tidx] = -Float32.inf
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
            cute.arch.fence_view_async_shared()  # Q's cp.async and zero rows, read by wgmma
            cute.arch.barrier(barrier_id=int(Sm90MlaTmaBarrier.Q), number_of_threads=THREADS)
        # wgmma operands are warpgroup-wide descriptors: partition by the first thread.
        tiled_mma_qk, tiled_mma_qk_rs = tiled_mmas_qk
        wg_qk = tiled_mma_qk.get_slice(0)
        # Q's rotary chunk in registers (16 words a thread in 16 bits, 8 in e4m3) for S's last
        # chunk: 8 KB (4 KB) less shared-memory A traffic a tile, as FlashMLA. Q is in shared
        # memory and fenced (the Q barrier above).
        thr_qk_rs = tiled_mma_qk_rs.get_slice(t)
        tSsQp = thr_qk_rs.partition_A(smem.sQp)
        tSrQp = thr_qk_rs.make_fragment_A(tSsQp)
        cute.autovec_copy(tSsQp, tSrQp)
        wg_pv = tiled_mma_pv.get_slice(wg_idx * WG_THREADS)
        wg_pv_ss = tiled_mma_pv_ss.get_slice(wg_idx * WG_THREADS)
        if cutlass.const_expr(self.fp8):
            # V^T (K-major B); P stored in the RS wgmma's own A layout (the ``sigma`` key order
            # of the V^T the transposes write, ``fp8_operands``), which the other warpgroup's
            # SS wgmma reads at the same (row, k) places.
            tOrVt = wg_pv.make_fragment_B(wg_pv.partition_B(smem.sVt))
            thr_pv = tiled_mma_pv.get_slice(t)
            p_store = (None, thr_pv.partition_A(smem.sP0), thr_pv.partition_A(smem.sP1))
        else:
            tOrVt = wg_pv.make_fragment_B(wg_pv.partition_B(transpose_view(smem.sC)))
            stsm = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
            thr_stsm = cute.make_tiled_copy_C(stsm, tiled_mma_qk).get_slice(t)
            p_store = (thr_stsm, thr_stsm.partition_D(smem.sP0), thr_stsm.partition_D(smem.sP1))
        ops = _Ops(
            tiled_mma_qk, tiled_mma_qk_rs, tiled_mma_pv, tiled_mma_pv_ss,
            wg_qk.make_fragment_A(wg_qk.partition_A(smem.sQn)), tSrQp,
            wg_qk.make_fragment_B(wg_qk.partition_B(smem.sC)), wg_qk.make_fragment_B(wg_qk.partition_B(smem.sKp)),
            tOrVt,
            wg_pv_ss.make_fragment_A(wg_pv_ss.partition_A(smem.sP0)),
            wg_pv_ss.make_fragment_A(wg_pv_ss.partition_A(smem.sP1)),
            *p_store,
            acc_mn_view(tiled_mma_qk.get_slice(t).partition_C(cute.make_identity_tensor((TILE_M, TILE_N)))),
            Float32(scale * LOG2_E),
        )
        acc_O = cute.make_rmem_tensor(tiled_mma_pv.partition_shape_C((TILE_M, D_CKV)), Float32)
        acc_O.fill(0.0)
        row_sum = cute.make_rmem_tensor((cute.size(ops.tScS_mn, mode=[0]),), Float32)
        row_sum.fill(0.0)
        if n_tiles > 0:
            if wg_idx == 0:
                self.wg0(tile, n_tiles, smem, ops, loader, acc_O, row_sum, t)
            else:
                self.wg1(tile, n_tiles, smem, ops, loader, acc_O, row_sum, t)
        self.epilogue(tile, smem, ops, acc_O, row_sum, args, tidx, wg_idx)

    # ------------------------------------------------------------------ the seesaw

    @cute.jit
    def wg0(self, tile, n_tiles, smem, ops, loader, acc_O, row_sum, t):
        """Warpgroup 0: S of the even tiles, O's columns 0-255. Full steps while a tile i + 2
        follows, then one tail step."""
        acc_S = cute.make_rmem_tensor(ops.mma_qk.partition_shape_C((TILE_M, TILE_N)), Float32)
        self.issue_s(ops, smem, acc_S, 0, 0, 0, self.chunks.chunks)
        # Tile 0 may end past the sequence: zero those V rows before any P V reads them.
        rows_in_tile0 = tile.ctx.seqlen_k - (tile.n_block_max - 1) * TILE_N
        if cutlass.const_expr(self.fp8):
            # As transposed, this warpgroup's half (warpgroup 1 zeroes its own).
            self.transpose_half(smem, 0, 0, 0, rows_in_tile0, True, t)
        warpgroup.wait_group(0)
        if cutlass.const_expr(not self.fp8):
            # Both halves: the other warpgroup reads its half only after SCALE0 / P0.
            if rows_in_tile0 < TILE_N:
                zero_rows_from(smem.sC[None, None, 0], rows_in_tile0, t, WG_THREADS)
                cute.arch.fence_view_async_shared()
        # The pages of the step's loads, read a step ahead (loop-carried, ``_TileLoader.page``).
        a_page, a_sub = loader.page(2)
        b_page, b_sub = loader.page(3)
        full = (n_tiles - 1) // 2
        runs = self.step_runs(tile, full, 1)
        for r in cutlass.range_constexpr(len(runs)):
            masked, lo, hi = runs[r]
            for p in cutlass.range(lo, hi, unroll=1):
                a_page, a_sub, b_page, b_sub = self.wg0_step(tile, n_tiles, smem, ops, loader, acc_S, acc_O, row_sum,
                                                             2 * p, True, True, (a_page, a_sub, b_page, b_sub), t,
                                                             masked)
        last = full * 2
        ahead = (a_page, a_sub, b_page, b_sub)
        if n_tiles - last == 2:
            self.wg0_step(tile, n_tiles, smem, ops, loader, acc_S, acc_O, row_sum, last, True, False, ahead, t)
        else:
            self.wg0_step(tile, n_tiles, smem, ops, loader, acc_S, acc_O, row_sum, last, False, False, ahead, t)

    @cute.jit
    def wg1(self, tile, n_tiles, smem, ops, loader, acc_O, row_sum, t):
        """Warpgroup 1: S of the odd tiles, O's columns 256-511. Full steps while a tile i + 3
        follows, then the last one to three tiles."""
        acc_S = cute.make_rmem_tensor(ops.mma_qk.partition_shape_C((TILE_M, TILE_N)), Float32)
        if n_tiles > 1:
            self.issue_s(ops, smem, acc_S, 1, 0, 0, self.chunks.chunks)
            if cutlass.const_expr(self.fp8):
                self.transpose_half(smem, 1, 1, 0, TILE_N, False, t)
            warpgroup.wait_group(0)
        if cutlass.const_expr(self.fp8):
            # Tile 0's right half (the steps transpose that of tiles 2, 4, ...), tail zeroed.
            self.transpose_half(smem, 0, 1, 0, tile.ctx.seqlen_k - (tile.n_block_max - 1) * TILE_N, True, t)
        full = cutlass.max(n_tiles - 2, 0) // 2
        a_page, a_sub = loader.page(2)  # as in ``wg0``
        b_page, b_sub = loader.page(3)
        runs = self.step_runs(tile, full, 2)
        for r in cutlass.range_constexpr(len(runs)):
            masked, lo, hi = runs[r]
            for p in cutlass.range(lo, hi, unroll=1):
                a_page, a_sub, b_page, b_sub = self.wg1_step(tile, n_tiles, smem, ops, loader, acc_S, acc_O, row_sum,
                                                             2 * p, True, True, True, (a_page, a_sub, b_page, b_sub),
                                                             t, masked)
        i = 2 * full
        left = n_tiles - i
        ahead = (a_page, a_sub, b_page, b_sub)
        if left == 3:
            self.wg1_step(tile, n_tiles, smem, ops, loader, acc_S, acc_O, row_sum, i, True, True, False, ahead, t)
            self.wg1_step(tile, n_tiles, smem, ops, loader, acc_S, acc_O, row_sum, i + 2, False, False, False, ahead,
                          t)
        elif left == 2:
            self.wg1_step(tile, n_tiles, smem, ops, loader, acc_S, acc_O, row_sum, i, True, False, False, ahead, t)
        else:
            self.wg1_step(tile, n_tiles, smem, ops, loader, acc_S, acc_O, row_sum, i, False, False, False, ahead, t)

    @cute.jit
    def wg0_step(self, tile, n_tiles, smem, ops, loader, acc_S, acc_O, row_sum, i, has_b: cutlass.Constexpr[bool],
                 has_next: cutlass.Constexpr[bool], ahead, t, masked: cutlass.Constexpr[bool] = True):
        """Warpgroup 0, the pair (i, i + 1): ``has_b`` tile i + 1 exists, ``has_next`` tile
        i + 2 (whose S this step computes). On entry S_i is in ``acc_S``; on exit S_{i+2}.
        ``ahead``: the pages of tiles i + 2 and i + 3 (page, sub-block, page, sub-block);
        returns those of tiles i + 4 and i + 5, read at the step's start. ``masked`` False:
        tile i is inside the unmasked run (``step_runs``)."""
        half = self.chunks.half
        next_a, next_b = (ahead[0], ahead[1]), (ahead[2], ahead[3])
        upcoming = ahead
        if cutlass.const_expr(has_next):
            upcoming = loader.page(i + 4) + loader.page(i + 5)
            if cutlass.const_expr(self.fp8):
                if t < 32:  # V_a's left half is in V^T and S_a landed: its chunks are free now
                    loader.load(next_a, 0, 0, half)
        corr_a, m_use = self.row_stats(tile, ops, smem, acc_S, tile.n_block_max - 1 - i, 0, masked)
        cute.arch.barrier_arrive(barrier_id=int(Sm90MlaTmaBarrier.SCALE0), number_of_threads=THREADS)
        self.exponentiate(ops, acc_S, row_sum, m_use, corr_a)
        self.rescale_moved(acc_O, ops, corr_a)
        tOrP = self.p_operand(ops, acc_S)
        wgmma_gemm(ops.mma_pv, acc_O, tOrP, ops.tOrVt[None, None, None, 0], False, 0)
        cute.arch.barrier(barrier_id=int(Sm90MlaTmaBarrier.SCALE1), number_of_threads=THREADS)
        if cutlass.const_expr(has_next and not self.fp8):
            if t < 32:  # V_a's left half was read by this warpgroup alone, and that P V landed
                loader.load(next_a, 0, 0, half)
        # P_a at the pair's max, for warpgroup 1's half of V.
        corr_b = self.read_rows(ops, smem.sCorr, 1)
        self.rescale_moved(acc_S, ops, corr_b)
        self.store_p(ops, acc_S, ops.tPsP0)
        cute.arch.barrier_arrive(barrier_id=int(Sm90MlaTmaBarrier.P0), number_of_threads=THREADS)
        if cutlass.const_expr(has_b):
            if cutlass.const_expr(self.fp8):
                # V_b's left half (warpgroup 1's S_b read it: SCALE1) while warpgroup 1 works;
                # then its chunks are free.
                self.transpose_half(smem, 1, 0, ((i + 1) // 2) % 2, TILE_N, False, t)
                if cutlass.const_expr(has_next):
                    if i + 3 < n_tiles:
                        if t < 32:
                            loader.load(next_b, 1, 0, half)
            cute.arch.barrier(barrier_id=int(Sm90MlaTmaBarrier.O1_ISSUED), number_of_threads=THREADS)
            self.rescale_moved(acc_O, ops, corr_b)
            for r in cutlass.range_constexpr(cute.size(row_sum)):
                row_sum[r] = row_sum[r] * corr_b[r]
            wgmma_gemm(ops.mma_pv_ss, acc_O, ops.tOsP1, ops.tOrVt[None, None, None, 1], False, -1)
        if cutlass.const_expr(has_next):
            phase = ((i + 2) // 2) % 2
            self.issue_s(ops, smem, acc_S, 0, phase, 0, half)
            if cutlass.const_expr(self.fp8):
                # Tile i + 2's left half of V, under its S (its P V of tile i landed).
                self.transpose_half(smem, 0, 0, phase, TILE_N, False, t)
            warpgroup.wait_group(half)  # sP1 V_b landed: V_b's left half is free
            if cutlass.const_expr(not self.fp8):
                if i + 3 < n_tiles:
                    if t < 32:
                        loader.load(next_b, 1, 0, half)
            self.issue_s(ops, smem, acc_S, 0, phase, half, self.chunks.chunks)
        warpgroup.wait_group(0)
        return upcoming

    @cute.jit
    def wg1_step(self, tile, n_tiles, smem, ops, loader, acc_S, acc_O, row_sum, i, has_b: cutlass.Constexpr[bool],
                 has_next: cutlass.Constexpr[bool], has_next_b: cutlass.Constexpr[bool], ahead, t,
                 masked: cutlass.Constexpr[bool] = True):
        """Warpgroup 1, the pair (i, i + 1): ``has_b`` tile i + 1 exists (its S is in
        ``acc_S``), ``has_next`` tile i + 2, ``has_next_b`` tile i + 3 (whose S this step
        computes). ``ahead``, the return value and ``masked`` (tile i + 1): as for ``wg0_step``."""
        half, chunks = self.chunks.half, self.chunks.chunks
        next_a, next_b = (ahead[0], ahead[1]), (ahead[2], ahead[3])
        upcoming = ahead
        if cutlass.const_expr(has_next_b):
            upcoming = loader.page(i + 4) + loader.page(i + 5)
        if cutlass.const_expr(self.fp8):
            # V_a's right half while warpgroup 0 finds S_a's row max (tile 0's: ``wg1``).
            if i > 0:
                self.transpose_half(smem, 0, 1, (i // 2) % 2, TILE_N, False, t)
        cute.arch.barrier(barrier_id=int(Sm90MlaTmaBarrier.SCALE0), number_of_threads=THREADS)
        if cutlass.const_expr(self.fp8):
            # S_a landed (SCALE0), the right halves of V_a and V_b are in V^T and S_b landed
            # (the last step), P has shared memory of its own: their chunks are free now.
            if t < 32:
                if cutlass.const_expr(has_next):
                    loader.load(next_a, 0, half, chunks)
                if cutlass.const_expr(has_next_b):
                    loader.load(next_b, 1, half, chunks)
        corr = self.read_rows(ops, smem.sCorr, 0)  # corr_a, times corr_b where there is a tile b
        tOrP = None
        if cutlass.const_expr(has_b):
            corr_b, m_use = self.row_stats(tile, ops, smem, acc_S, tile.n_block_max - 2 - i, 1, masked)
            cute.arch.barrier_arrive(barrier_id=int(Sm90MlaTmaBarrier.SCALE1), number_of_threads=THREADS)
            for r in cutlass.range_constexpr(cute.size(corr)):
                corr[r] = corr[r] * corr_b[r]
            self.exponentiate(ops, acc_S, row_sum, m_use, corr)
            tOrP = self.p_operand(ops, acc_S)
        else:
            self.write_rows(ops, smem.sCorr, 1, None)
            cute.arch.barrier_arrive(barrier_id=int(Sm90MlaTmaBarrier.SCALE1), number_of_threads=THREADS)
            for r in cutlass.range_constexpr(cute.size(row_sum)):
                row_sum[r] = row_sum[r] * corr[r]
        self.rescale_moved(acc_O, ops, corr)
        if cutlass.const_expr(has_b):
            self.store_p(ops, acc_S, ops.tPsP1, tOrP)
            wgmma_gemm(ops.mma_pv, acc_O, tOrP, ops.tOrVt[None, None, None, 1], False, -1)
        cute.arch.barrier(barrier_id=int(Sm90MlaTmaBarrier.P0), number_of_threads=THREADS)
        wgmma_gemm(ops.mma_pv_ss, acc_O, ops.tOsP0, ops.tOrVt[None, None, None, 0], False, -1)
        if cutlass.const_expr(has_b):
            cute.arch.barrier_arrive(barrier_id=int(Sm90MlaTmaBarrier.O1_ISSUED), number_of_threads=THREADS)
        if cutlass.const_expr(has_next_b):
            warpgroup.wait_group(1)  # P_b V_b landed: V_b's right half and kpe are free
            if cutlass.const_expr(not self.fp8):
                if t < 32:
                    loader.load(next_b, 1, half, chunks)
        if cutlass.const_expr(has_next):
            warpgroup.wait_group(0)  # sP0 V_a landed: V_a's right half and sP0 (kpe) are free
            if cutlass.const_expr(not self.fp8):
                if t < 32:
                    loader.load(next_a, 0, half, chunks)
        if cutlass.const_expr(has_next_b):
            self.issue_s(ops, smem, acc_S, 1, ((i + 3) // 2) % 2, 0, chunks)
            if cutlass.const_expr(self.fp8):
                # Tile i + 3's right half of V, under its S.
                self.transpose_half(smem, 1, 1, ((i + 3) // 2) % 2, TILE_N, False, t)
        warpgroup.wait_group(0)
        return upcoming

    # ------------------------------------------------------------------ pieces

    @cute.jit
    def issue_s(self, ops, smem, acc_S, buf: cutlass.Constexpr[int], phase, lo: cutlass.Constexpr[int],
                hi: cutlass.Constexpr[int]):
        """S (+)= Q K^T over chunks [lo, hi) of buffer ``buf``, each after its TMA landed (its
        mbarrier's phase ``phase``), one wgmma group per chunk (not waited). Chunk 0 starts
        the accumulation."""
        ch = self.chunks
        for c in cutlass.range_constexpr(lo, hi):
            cute.arch.mbarrier_wait(smem.mbar + buf * ch.chunks + c, phase)
            warpgroup.fence()
            # fresh: its ACCUMULATE field is rewritten; the rotary chunk reads Q from registers
            atom = cute.make_mma_atom(ops.mma_qk.op if c < ch.c_chunks else ops.mma_qk_rs.op)
            atom.set(warpgroup.Field.ACCUMULATE, c > 0)
            slices = ch.slices if c < ch.c_chunks else ch.kpe_slices
            for k in cutlass.range_constexpr(slices):
                if cutlass.const_expr(c < ch.c_chunks):
                    cute.gemm(atom, acc_S, ops.tSrQn[None, None, c * slices + k],
                              ops.tSrC[None, None, c * slices + k, buf], acc_S)
                else:
                    cute.gemm(atom, acc_S, ops.tSrQp[None, None, k], ops.tSrKp[None, None, k, buf], acc_S)
                atom.set(warpgroup.Field.ACCUMULATE, True)
            warpgroup.commit_group()

    def step_runs(self, tile, full, own: int):
        """The steady loop's steps [0, ``full``) of a warpgroup whose tile at step p is
        ``n_block_max - own - 2 p``, as (masked, lo, hi) runs: with ``mask_runs``, the
        steps whose tile lies in the unmasked run [n_mid_lo, n_mid_hi) (``BlockInfo``) skip
        the mask test, which ptxas otherwise if-converts into every step (sm_90a: 71-111
        instructions a step, between S's wait and its row max); the steps above it (the
        sequence end, a causal diagonal) and, with a mask, below it (a window's or shard's
        left edge) test as before. Without it, one run that tests every step."""
        if cutlass.const_expr(not self.mask_runs):
            return ((True, 0, full),)
        top = cutlass.min((tile.n_block_max - tile.n_mid_hi + 2 - own) // 2, full)
        if cutlass.const_expr(not self.variant.has_mask):
            return ((True, 0, top), (False, top, full))
        bottom = cutlass.max(cutlass.min((tile.n_block_max - tile.n_mid_lo + 2 - own) // 2, full), top)
        return ((True, 0, top), (False, top, bottom), (True, bottom, full))

    @cute.jit
    def row_stats(self, tile, ops, smem, acc_S, n_block, col: cutlass.Constexpr[int],
                  masked: cutlass.Constexpr[bool] = True):
        """Block ``n_block``'s scores in ``acc_S`` (masked where it needs it) against the
        shared running max ``sM``: the new max goes to ``sM``, the correction of what came
        before to ``sCorr[:, col]``. Returns (correction, the max P subtracts). Split from
        ``exponentiate`` so that the other warpgroup, which needs only these, is released
        before the exponentials run. ``masked`` False: a block of the unmasked run."""
        if cutlass.const_expr(masked):
            if n_block >= tile.n_mid_hi or n_block < tile.n_mid_lo:
                apply_to_scores(self.variant, acc_mn_view(acc_S), ops.tScS_mn, tile.ctx, tile.m_block * TILE_M,
                                n_block * TILE_N, self.qhead_per_kvhead_packed, tile.softmax_scale, True)
        s_mn = acc_mn_view(acc_S)
        rows = cute.size(s_mn, mode=[0])
        corr = cute.make_rmem_tensor((rows,), Float32)
        m_new = cute.make_rmem_tensor((rows,), Float32)
        m_use = cute.make_rmem_tensor((rows,), Float32)
        for r in cutlass.range_constexpr(rows):
            m_old = smem.sM[ops.tScS_mn[r, 0][0]]
            m_tile = _row_max(s_mn[r, None]) * ops.scale_log2
            if cutlass.const_expr(self.lag_max):
                # The max moves only past the threshold (from -inf: at any score seen).
                m_new[r] = m_old
                if m_tile > m_old + Float32(RESCALE_LOG2[self.fp8]):
                    m_new[r] = m_tile
            else:
                m_new[r] = cute.arch.fmax(m_old, m_tile)
            # A row with nothing visible yet keeps max -inf: subtract 0 instead (never inf - inf).
            m_use[r] = m_new[r]
            if m_new[r] == -Float32.inf:
                m_use[r] = Float32(0.0)
            corr[r] = cute.math.exp2(m_old - m_use[r], fastmath=True)  # exactly 1 where a lagging max kept
        cute.arch.sync_warp()  # every lane of a row read sM before one writes it
        if ops.tScS_mn[0, 0][1] == 0:
            for r in cutlass.range_constexpr(rows):
                row = ops.tScS_mn[r, 0][0]
                smem.sM[row] = m_new[r]
                smem.sCorr[row, col] = corr[r]
        return corr, m_use

    @cute.jit
    def exponentiate(self, ops, acc_S, row_sum, m_use, corr):
        """acc_S becomes P = exp2(S * scale_log2 - max) (fp32; fp8: times 2^``p_offset``, the
        row max at 2^8, or 2^6 under a lagging max, where e4m3 keeps its 4 significant bits
        down to 2^-6), and the
        row sums take it after their correction ``corr`` (all this step's, for this
        warpgroup's sums)."""
        s_mn = acc_mn_view(acc_S)
        for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
            m_p = m_use[r] - self.p_offset() if cutlass.const_expr(self.fp8) else m_use[r]
            s_mn[r, None].store(cute.math.exp2(s_mn[r, None].load() * ops.scale_log2 - m_p, fastmath=True))
            row_sum[r] = row_sum[r] * corr[r] + _row_sum(s_mn[r, None])

    @cute.jit
    def read_rows(self, ops, sX, col: cutlass.Constexpr[int]):
        """This thread's rows of column ``col`` of a (TILE_M, 2) exchange."""
        vals = cute.make_rmem_tensor((cute.size(ops.tScS_mn, mode=[0]),), Float32)
        for r in cutlass.range_constexpr(cute.size(vals)):
            vals[r] = sX[ops.tScS_mn[r, 0][0], col]
        return vals

    @cute.jit
    def write_rows(self, ops, sX, col: cutlass.Constexpr[int], vals):
        """This thread's rows of column ``col`` (``vals``; None: 1), by the lane at column 0."""
        if ops.tScS_mn[0, 0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(ops.tScS_mn, mode=[0])):
                v = Float32(1.0) if cutlass.const_expr(vals is None) else vals[r]
                sX[ops.tScS_mn[r, 0][0], col] = v

    @cute.jit
    def rescale(self, acc, ops, corr):
        """Rows of an accumulator (S's rows: O's are the same) times ``corr``."""
        a_mn = acc_mn_view(acc)
        for r in cutlass.range_constexpr(cute.size(a_mn, mode=[0])):
            a_mn[r, None].store(a_mn[r, None].load() * corr[r])

    @cute.jit
    def rescale_moved(self, acc, ops, corr):
        """``rescale``; with a lagging max skipped by a warp whose rows all kept theirs."""
        if cutlass.const_expr(self.lag_max):
            kept = corr[0] == Float32(1.0)
            for r in cutlass.range_constexpr(1, cute.size(corr)):
                kept = kept & (corr[r] == Float32(1.0))
            if not cute.arch.vote_all_sync(kept):
                self.rescale(acc, ops, corr)
        else:
            self.rescale(acc, ops, corr)

    def p_offset(self) -> int:
        """e4m3 P's offset (log2): P = 2^offset exp2(S * scale_log2 - max)."""
        return LAG_P_OFFSET_E4M3 if self.lag_max else FP8_P_OFFSET

    def p_operand(self, ops, acc_S):
        """P as the A operand of P V: in 16 bits laid out like S (pairwise conversion), or in
        e4m3 in the RS wgmma's 8-bit A layout (``fp8_operands.p_to_fp8``: the ``sigma`` key
        order of V^T)."""
        if cutlass.const_expr(self.fp8):
            tOrP = cute.make_rmem_tensor(ops.mma_pv.partition_shape_A((TILE_M, TILE_N)), self.op_dtype)
            p_to_fp8(acc_S, tOrP)
            return tOrP
        tOrP = acc_to_operand_a(cute.make_rmem_tensor(ops.mma_qk.partition_shape_C((TILE_M, TILE_N)), self.dtype))
        convert_pairs(acc_S, cute.make_tensor(tOrP.iterator, acc_S.layout))
        return tOrP

    @cute.jit
    def store_p(self, ops, acc_S, tPsP, tOrP=None):
        """P to a shared P tile, fenced for the other warpgroup's wgmma: 16-bit by stmatrix;
        fp8 in the A operand's places (4-byte stores: 4 consecutive k a thread), from
        ``tOrP`` where the RS operand of the same P is at hand."""
        if cutlass.const_expr(self.fp8):
            cute.autovec_copy(self.p_operand(ops, acc_S) if cutlass.const_expr(tOrP is None) else tOrP, tPsP)
        else:
            rP = cute.make_fragment_like(acc_S, self.dtype)
            convert_pairs(acc_S, rP)
            cute.copy(ops.thr_stsm, ops.thr_stsm.retile(rP), tPsP)
        cute.arch.fence_view_async_shared()

    @cute.jit
    def transpose_half(self, smem, buf: cutlass.Constexpr[int], wg: cutlass.Constexpr[int], phase, rows_valid,
                       zero_tail: cutlass.Constexpr[bool], t):
        """fp8: warpgroup ``wg``'s half of V in buffer ``buf`` (ckv columns [256 wg, 256 wg +
        256), the O columns it owns) into V^T (``fp8_operands.transpose_v_block``; keys at or
        past ``rows_valid`` zeroed with ``zero_tail``) once its chunks landed (their
        mbarriers' ``phase``), fenced for the wgmma and met by the warpgroup's four warps."""
        ch = self.chunks
        for c in cutlass.range_constexpr(ch.half * wg, ch.half * (wg + 1)):
            cute.arch.mbarrier_wait(smem.mbar + buf * ch.chunks + c, phase)
        transpose_v_block(smem.sC_addr + wg * HALF_BYTES, smem.sVt_addr + wg * HALF_BYTES, self.v_half_geometry,
                          self.vt_geometry, buf, buf, t, WG_THREADS // 32, rows_valid, zero_tail)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=int(Sm90MlaTmaBarrier.VT0) + wg, number_of_threads=WG_THREADS)

    @cute.jit
    def epilogue(self, tile, smem, ops, acc_O, row_sum, args: MlaArgs, tidx, wg_idx):
        """Row sums of both warpgroups added (each summed its own tiles' P at the final max),
        O normalised, O and the LSE (natural log) stored from registers."""
        rows = cute.size(row_sum)
        for r in cutlass.range_constexpr(rows):
            row_sum[r] = _quad_sum(row_sum[r])
        if ops.tScS_mn[0, 0][1] == 0:
            for r in cutlass.range_constexpr(rows):
                smem.sSums[ops.tScS_mn[r, 0][0], wg_idx] = row_sum[r]
        cute.arch.barrier(barrier_id=int(Sm90MlaTmaBarrier.SUMS), number_of_threads=THREADS)
        lse = cute.make_rmem_tensor((rows,), Float32)
        inv = cute.make_rmem_tensor((rows,), Float32)
        for r in cutlass.range_constexpr(rows):
            row = ops.tScS_mn[r, 0][0]
            total = smem.sSums[row, 0] + smem.sSums[row, 1]
            inv[r] = cute.arch.rcp_approx(total)
            m_p = smem.sM[row] - self.p_offset() if cutlass.const_expr(self.fp8) else smem.sM[row]
            lse[r] = (m_p + cute.math.log2(total, fastmath=True)) * LN_2
            if total == 0.0 or total != total:  # no key seen: O 0, LSE -inf
                inv[r] = Float32(0.0)
                lse[r] = -Float32.inf
        self.rescale(acc_O, ops, inv)
        if cutlass.const_expr(self.fp8):
            tile.descale_o(args.for_kv_head(tile.head_kv), acc_O)
        row0 = tile.m_block * TILE_M
        tOcO_mn = acc_mn_view(ops.mma_pv.get_slice(tidx).partition_C(cute.make_identity_tensor((TILE_M, D_CKV))))
        if cutlass.const_expr(self.scheduled):
            # A piece of a sequence in several (a slot) writes fp32 partials, a whole one its
            # output; uniform over the CTA.
            if tile.split_idx >= 0:
                self.store(tile, smem.sO_partial, Float32, args.mOPartial, args.mLSEPartial, True, acc_O, lse,
                           tOcO_mn, ops, row0, tidx, wg_idx)
            else:
                self.store(tile, smem.sO, self.out_dtype, args.mO, args.mLSE, False, acc_O, lse, tOcO_mn, ops, row0,
                           tidx, wg_idx)
        else:
            self.store(tile, smem.sO, self.out_dtype, args.mO, args.mLSE, self.is_split, acc_O, lse, tOcO_mn, ops,
                       row0, tidx, wg_idx)

    @cute.jit
    def store(self, tile, sO, out_dtype: cutlass.Constexpr, mO, mLSE, is_split: cutlass.Constexpr[bool], acc_O, lse,
              tOcO_mn, ops, row0, tidx, wg_idx):
        """O (normalised) and the LSE to ``mO`` / ``mLSE`` (a split's partial slot when
        ``is_split``). O leaves through shared memory, a row a thread by one bulk copy
        (FlashMLA stores by TMA; the module docstring has the measurement)."""
        packed = self.qhead_per_kvhead_packed
        store_o_staged(acc_O, out_dtype, tOcO_mn, sO, tile.out_rows(mO, packed, is_split, False), row0,
                       tile.rows_valid, tidx, THREADS, int(Sm90MlaTmaBarrier.O_STAGED))
        if cutlass.const_expr(mLSE is not None):
            store_lse(lse, ops.tScS_mn, tile.lse_rows(mLSE, packed, is_split, False), row0, tile.rows_valid,
                      group_writes=wg_idx == 0)


def _row_max(row: cute.Tensor) -> Float32:
    """Max over one row of S across the four lanes that hold it."""
    m = row[0]
    for c in range(1, cute.size(row)):
        m = cute.arch.fmax(m, row[c])
    for offset in (2, 1):
        m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=offset))
    return m


def _row_sum(row: cute.Tensor) -> Float32:
    """This thread's part of a row sum, in two chains."""
    n = cute.size(row)
    acc = [row[0], row[1]]
    for c in range(2, n):
        acc[c % 2] = acc[c % 2] + row[c]
    return acc[0] + acc[1]


def _quad_sum(v: Float32) -> Float32:
    for offset in (2, 1):
        v = v + cute.arch.shuffle_sync_bfly(v, offset=offset)
    return v


@dataclass(frozen=True)
class _Smem:
    sQn: cute.Tensor  # (64, 512)
    sQp: cute.Tensor  # (64, 64)
    sC: cute.Tensor  # (64, 512, 2): K's first 512 columns and V, two buffers
    sKp: cute.Tensor  # (64, 64, 2)
    sP0: cute.Tensor  # (64, 64): P_a over buffer 0's kpe chunk
    sP1: cute.Tensor  # (64, 64): P_b
    sVt: cute.Tensor  # fp8: (512, 64, 2) V^T, keys in the ``sigma`` order; else None
    sM: cute.Tensor  # (64,) the running row max
    sCorr: cute.Tensor  # (64, 2) the corrections of S_a, S_b
    sSums: cute.Tensor  # (64, 2) the warpgroups' row sums
    sAmax: cute.Tensor  # (8,) fp8: each warp's amax of Q
    sO: cute.Tensor  # (64, 512) O in the output dtype (``epilogue.staged_o``), over sQn onwards
    sO_partial: cute.Tensor  # the same bytes as fp32 partials, with a schedule (else None)
    mbar: cute.Pointer  # 2 x (ckv chunks + 1) chunk mbarriers
    sC_addr: Int32  # fp8: shared-window addresses of sC and sVt, for the transposes; else None
    sVt_addr: Int32


@dataclass(frozen=True)
class _Ops:
    """The warpgroups' MMAs, wgmma operand fragments (descriptors), P stores and S coordinates."""

    mma_qk: cute.TiledMma
    mma_qk_rs: cute.TiledMma  # S's rotary chunk: Q from registers (``tSrQp``)
    mma_pv: cute.TiledMma
    mma_pv_ss: cute.TiledMma
    tSrQn: cute.Tensor
    tSrQp: cute.Tensor  # this thread's share of Q's rotary chunk, in registers
    tSrC: cute.Tensor  # (.., 2 buffers)
    tSrKp: cute.Tensor
    tOrVt: cute.Tensor  # this warpgroup's 256 columns of V^T, (.., 2 buffers)
    tOsP0: cute.Tensor
    tOsP1: cute.Tensor
    thr_stsm: cute.ThrCopy  # 16-bit P's stmatrix; None for fp8
    tPsP0: cute.Tensor
    tPsP1: cute.Tensor
    tScS_mn: cute.Tensor
    scale_log2: Float32


@dataclass(frozen=True)
class _TileLoader:
    """TMA of a tile's chunks into a buffer, by one warp: the copy elects its issuing lane
    with ``elect.sync`` over the whole warp (called from one lane alone, it hung the H200,
    2026-12-05). Tile i is KV block n_block_max - 1 - i, sub-block ``n % (page_size /
    64)`` of page ``page_table[b, n // (page_size / 64)]`` (page ids clamped into the pool,
    ``paged_kv.clamp_page``)."""

    tma_atom_C: cute.CopyAtom
    tma_atom_Kp: cute.CopyAtom
    tCgC: cute.Tensor  # (TMA, sub-blocks, chunks, pages)
    tCsC: cute.Tensor  # (TMA, 1, chunks, buffers)
    tKgKp: cute.Tensor
    tKsKp: cute.Tensor
    mPageTable: cute.Tensor
    batch: Int32
    n_block_max: Int32
    mbar: cute.Pointer
    chunks: _Chunks
    sub_blocks: cute.FastDivmodDivisorV2

    @staticmethod
    def create(args: MlaArgs, tile, tma_atoms, tma_views, smem: _Smem, chunks: _Chunks,
               sub_blocks: cute.FastDivmodDivisorV2) -> "_TileLoader":
        tma_C, tma_Kp = tma_views
        if cutlass.const_expr(args.kv_heads):
            tma_C, tma_Kp = tma_C[None, None, tile.head_kv, None], tma_Kp[None, None, tile.head_kv, None]
        parts = []
        for atom, view, s, cols in zip(tma_atoms, (tma_C, tma_Kp), (smem.sC, smem.sKp), (chunks.cols, D_KPE)):
            g = cute.flat_divide(view, (TILE_N, cols))  # (64, cols, sub-blocks, chunks, pages)
            s_chunks = cute.flat_divide(s, (TILE_N, cols))  # (64, cols, 1, chunks, buffers)
            ts, tg = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(s_chunks, 0, 2),
                                           cute.group_modes(g, 0, 2))
            parts += [tg, ts]
        return _TileLoader(*tma_atoms, *parts, args.mPageTable, tile.ctx.batch, tile.n_block_max, smem.mbar, chunks,
                           sub_blocks)

    @cute.jit
    def page(self, i):
        """(page-table entry, sub-block) of tile ``i`` (tiles past the first block read
        block 0's entry: never out of the table). Read a step before ``load`` needs it: a
        page-table read right before its TMA stalled the loading warp, and the barriers
        its warpgroup meets, for a global-memory latency at every load (long-scoreboard
        stalls 2.89 per issued instruction against FlashMLA's 0.55 in the H100 profile
        ``results/ncu/ncu_mla_sm90-fp8_128x2048_h100_2026-12-05_s15.txt``; this and the
        earlier fp8 reloads together took the FP8 128-head rows from 1.03-1.09x to
        1.13-1.20x our 16-bit kernel, same runs' FlashMLA FP8 ratio 0.77-0.79x to
        0.87-0.91x)."""
        # Unclamped here (``paged_kv.page_entry``): the clamp is ``load``'s.
        return page_entry(self.mPageTable, self.batch, cutlass.max(self.n_block_max - 1 - i, 0), self.sub_blocks)

    @cute.jit
    def load(self, where, buf: cutlass.Constexpr[int], lo: cutlass.Constexpr[int], hi: cutlass.Constexpr[int]):
        """Chunks [lo, hi) of the tile at ``where`` (``page``) into buffer ``buf``, each
        arriving on its mbarrier with its bytes (one lane arrives; the whole warp calls)."""
        page, sub = clamp_page(where[0], self.tCgC.shape[3]), where[1]
        ch = self.chunks
        for c in cutlass.range_constexpr(lo, hi):
            bar = self.mbar + buf * ch.chunks + c
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(bar, ch.ckv_bytes if c < ch.c_chunks else ch.kpe_bytes)
            if cutlass.const_expr(c < ch.c_chunks):
                cute.copy(self.tma_atom_C, self.tCgC[None, sub, c, page], self.tCsC[None, 0, c, buf], tma_bar_ptr=bar)
            else:
                cute.copy(self.tma_atom_Kp, self.tKgKp[None, sub, 0, page], self.tKsKp[None, 0, 0, buf],
                          tma_bar_ptr=bar)

