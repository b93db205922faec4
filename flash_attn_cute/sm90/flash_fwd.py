"""FlashAttention-3 style forward kernel for SM90 (Hopper): TMA + wgmma, warp-specialized.

One CTA computes a (tile_m x d_v) block of O for one (batch, head[, split]). Its
threads split into roles:

* warpgroup 0, the producer: its first warp issues TMA loads of Q (once) and of K and
  V (one tile_n block per pipeline stage) into shared memory, each stage guarded by
  a pair of mbarriers (``PipelineTmaAsync``: "full" counts the TMA bytes in, "empty"
  counts the consumer warps out). It needs few registers and gives them up.
* warpgroups 1.., the consumers (tile_m / 64 of them): each owns 64 rows of the tile and
  issues asynchronous wgmma: S = Q K^T from shared memory (SS), the online softmax in
  registers, then O += P V with P straight from the S registers (RS).

The consumer loop overlaps within a warpgroup: block n's Q K^T is issued before the
softmax of block n+1 waits on it, so the tensor cores work on P V(n+1) and S(n) while
the warpgroup computes exp2. With several consumer warpgroups (d <= 128), one named
barrier per warpgroup makes them take turns issuing (ping-pong), so one's softmax hides
the other's MMAs.

O leaves through shared memory and a TMA store (batch tensors), or straight from
registers (packed GQA rows, varlen, seqused_q, fp32 split partials). The grid is one CTA per tile,
in longest-first, L2-aware order under causal/local masks (``LptScheduler``), or, when
``persistent``, one CTA per SM looping over the tiles of that same order
(``PersistentScheduler``): the pipeline states live across tiles, so the producer loads
the next tile's Q, K and V while the consumers finish the current one and run its
epilogue. A short tile (a block-masked one visits ~5 KV blocks) no longer pays its
pipeline fill and its epilogue back to back with nothing overlapping them. Under masks
(the LPT order) a persistent CTA takes its next tile from an atomic counter
(``dynamic``, FA3's dynamic persistent scheduler): the tiles' lengths differ, and a static
stride over the LPT order left the CTAs that took the heavy end of each round 27 % over
the mean (b4 s8192 h8 d256 causal, 128 x 96 tiles; H100: 777 against 933 TFLOP/s one CTA
per tile). Opt-in (FLASH_ATTN_CUTE_SM90_PERSISTENT=dynamic, ``sm90.persistent``) until a GPU
has run it. Warp 0 of the producer fetches the next index while it loads the current tile
and hands it to the other warps that walk the tiles through one shared-memory slot and a
pair of named barriers per reader group (the consumers, and the producer warps that
transpose V or gather rows: ``Sm90FwdBarrier.TILE_FULL`` ...), so that the producer side
starts the next tile's blocks without waiting for the consumers' epilogue.

KV blocks are visited from the last to the first (only the first visited can be cut by
the sequence end), in the same three runs as the SM80 kernel: masked blocks above the
unmasked range, the unmasked range, masked blocks below it. Per-score masking and score
modification go through the variant (``variants.apply_to_scores``).

FP8 K/V under 16-bit queries: the stages hold fp8 blocks that the consumer widens into one
16-bit buffer (``take``). FP8 Q, K and V (``fp8_qkv``): both GEMMs run as fp8 wgmma; fp8
wgmma reads B K-major only, so producer warps 1-3 (2-3 where warps 0 and 1 gather K and V
rows) turn each V stage into a V^T stage
(``transposes``, ldmatrix / stmatrix.trans, in the key order that makes P's 8-bit A
operand the thread's own S registers: ``fp8_operands``), a third ring between them and the
consumers; the output is bf16, from registers. 16-bit Q over an e4m3 cache (``quantize_q``,
the default for that call): the consumers load the Q tile themselves and quantize it to
e4m3 into sQ with one power-of-two scale (``q_quant``), then run the FP8 Q, K, V kernel,
the scale folded into the softmax scale; the output is in q's dtype.
"""

from dataclasses import dataclass, replace
from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup

from flash_attn_cute.device.block_info import BlockInfo
from flash_attn_cute.device.copy_utils import copy_row, copy_rows, gmem_tiled_copy, widen_fp8
from flash_attn_cute.device.cute_utils import fake_tensor, launch_ctas
from flash_attn_cute.device.epilogue import store_lse, store_o
from flash_attn_cute.device.fwd_kernel import (FwdArgs, FwdTile, compile_from_key, fwd_call, set_fwd_config, tile_grid,
                                               tile_work, zero_rows_from)
from flash_attn_cute.device.layout_utils import (acc_mn_view, acc_to_operand_a, row_major_smem_layout, select,
                                                 transpose_view)
from flash_attn_cute.device.named_barrier import Sm90FwdBarrier
from flash_attn_cute.device.paged_kv import (box_in_page, clamp_page, kv_box_index, page_and_row, page_entry,
                                             page_lookups, rows_in_page)
from flash_attn_cute.sm90.config import TWO_CTAS_SMEM, WarpRoles, parse_key_extra
from flash_attn_cute.sm90.fp8_operands import FP8TileGeometry, TwoLevelPV, p_to_fp8, transpose_v_block
from flash_attn_cute.device.q_quant import quantize_q_tile
from flash_attn_cute.sm90.wgmma_utils import convert_pairs, kv_release, kv_wait, wgmma_gemm
from flash_attn_cute.device.softmax import FP8_P_OFFSET, LOG2_E, OnlineSoftmax
from flash_attn_cute.device.tile_scheduler import LptScheduler, PersistentScheduler, SingleTileScheduler, TileDivisors
from flash_attn_cute.device.variants import AttentionVariant, apply_to_scores
from flash_attn_cute.host.keys import parse_key


class FlashAttnFwdSm90:
    __call__ = fwd_call  # the forward kernels' shared entry point: FwdArgs -> launch

    def __init__(self, dtype, head_dim: int, head_dim_v: int, tile_m: int, tile_n: int, num_stages: int,
                 variant: AttentionVariant, qhead_per_kvhead_packed: int = 1, is_split: bool = False,
                 ex2_emulate_every: int = 0, gather_kv: bool = False, persistent: bool = False, split_blocks: int = 0,
                 q_class: int = 0, ctas_per_sm: int = 1, quantize_q: bool = False, two_level: int = 0,
                 kv_box: int = 0):
        set_fwd_config(self, dtype, head_dim, head_dim_v, variant, qhead_per_kvhead_packed, is_split, split_blocks,
                       q_class)
        # 16-bit Q over an e4m3 cache: Q is quantized to e4m3 in the kernel (``q_quant``) and
        # everything after runs as for FP8 Q, K and V; q_dtype is what mQ holds, dtype what
        # the MMAs and sQ take (the output keeps q's dtype: set_fwd_config's out_dtype).
        self.q_dtype = dtype
        self.quantize_q = quantize_q
        if quantize_q:
            assert dtype.width == 16 and not persistent, "quantize_q: 16-bit queries, one tile per CTA"
            self.dtype = cutlass.Float8E4M3FN
        head_dim, head_dim_v = self.head_dim, self.head_dim_v  # the tile's widths (padded head dims)
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.num_stages = num_stages
        # Every k-th exponential of an unmasked block on the FMA pipe (softmax.ex2_poly):
        # at d=64 the MUFU unit, not the tensor cores, bounds the loop. Off by default:
        # k = 4, 8, 16 measured no faster on the H200 (486 / 506 / 516 vs 513 TFLOP/s).
        self.ex2_emulate_every = ex2_emulate_every
        # Paged KV whose pages hold neither whole tile_n blocks nor 16-row boxes (page size 1,
        # 8, ...; cache_leftpad): the producer warpgroup gathers rows with cp.async, one page
        # lookup per row (``paged_kv``), and signals each stage with cp.async mbarrier arrives.
        self.gather_kv = gather_kv
        # Pages of a multiple of 16 keys that hold no whole block: each block comes in
        # tile_n / kv_box TMA boxes, one page lookup each (0: one box per block).
        self.kv_box = kv_box
        assert not (kv_box and gather_kv) and tile_n % max(kv_box, 1) == 0, (kv_box, gather_kv, tile_n)
        # One CTA per SM looping over tiles (``PersistentScheduler``), else one per tile;
        # "dynamic": masked (LPT) tiles drawn from a counter (module docstring).
        self.persistent = bool(persistent)
        self.dynamic_tiles = persistent == "dynamic"
        # Two CTAs per SM (fp8 tiles that fit twice): each gets half the register file.
        self.ctas_per_sm = ctas_per_sm
        # FP8 Q, K and V: both GEMMs in fp8 wgmma. Its B operand is K-major, so producer
        # warps 1-3 (2-3: ``split_gather``) transpose each V block (``transposes``,
        # ``fp8_operands``); P is rounded to e4m3 with its row max at 2^8 (``FP8_P_OFFSET``),
        # O leaves in bf16 (quantize_q: in q's dtype).
        self.fp8_qkv = self.dtype.width == 8
        # FP8 Q, K, V: the P V product accumulated in two levels, O flushed into an fp32
        # accumulator every ``two_level`` KV blocks (``fp8_operands.TwoLevelPV``); 0: off.
        self.two_level = two_level
        assert not two_level or self.fp8_qkv, "two-level accumulation: FP8 Q, K, V only"
        self.roles = WarpRoles.for_consumers(tile_m // 64, gather_kv, ctas_per_sm, transpose_v=self.fp8_qkv,
                                             kv_boxes=kv_box > 0)
        # Ping-pong pays when the softmax of one warpgroup can hide the other's MMAs;
        # at d=256 the MMAs dominate and the turn-taking only adds waits.
        self.use_scheduler_barrier = self.roles.num_consumer_wgs >= 2 and max(head_dim, head_dim_v) <= 128
        # Packed GQA rows do not form a TMA box; those Q tiles are gathered by cp.async.
        # quantize_q: the consumers load Q themselves (``q_quant``).
        self.use_tma_q = self.qhead_per_kvhead_packed == 1 and not quantize_q
        # With a large O (d_v >= 128) the rescale of O by the new row max is moved off the
        # critical path: it runs while Q K^T of the next block is in flight, just before
        # the P V that needs it (the correction of block n is carried to iteration n-1).
        # At d_v = 128 ptxas otherwise leaves O's 64 rescale FMULs as one run after the
        # exponentials, on the path to the next Q K^T (SASS). H200, b4 s8192 h16 d128,
        # TFLOP/s deferred / not (same run): causal 612.8 / 601.0, non-causal 640.1 / 644.0.
        # FP8 q/k/v at d_v = 128 is the exception: its P V GEMM is half as long, so the
        # deferred rescale no longer hides; H100, b4 s8192 d128, TFLOP/s as ratio to FA3's
        # FP8 in the same run, deferred / not: non-causal 0.971 / 1.005, causal 0.908 / 0.937.
        # d256 FP8 measured neutral (ours 989 / 986 TFLOP/s non-causal, 930 / 934 causal): kept.
        self.rescale_o_before_pv = head_dim_v > 128 if self.fp8_qkv else head_dim_v >= 128
        assert tile_m % 64 == 0 and tile_n % 16 == 0 and head_dim % 16 == 0 and head_dim_v % 16 == 0

    @cute.jit
    def launch(self, args: FwdArgs, l2_heads: Int32, max_ctas: Int32, mTileCounter: Optional[cute.Tensor], stream):
        """``l2_heads``: l2_heads_for(...), (head, batch) pairs per L2 section of the LPT order;
        ``max_ctas``: the persistent grid's bound (the SM count; unused otherwise);
        ``mTileCounter``: (1,) int32, zero at launch: the dynamic hand-out's counter (the
        "dynamic" persistent kernels take one, those over LPT tiles draw from it; None
        otherwise)."""
        mQ, mK, mV, mO = args.mQ, args.mK, args.mV, args.mO
        varlen_q, varlen_k = cutlass.const_expr(args.varlen_q), cutlass.const_expr(args.varlen_k)
        sQ_layout = row_major_smem_layout(self.dtype, self.tile_m, self.head_dim)
        sO_layout = row_major_smem_layout(self.dtype, self.tile_m, self.head_dim_v)
        # O leaves through smem (Q's buffer, free by then) and one TMA store, for batch
        # tensors in the input dtype; packed rows, varlen rows (a box would spill into the
        # next sequence), rows cut by seqused_q (the box would write rows past it) and fp32
        # split partials are stored from registers.
        self.use_tma_o = (self.use_tma_q and not varlen_q and not self.is_split and args.mSeqUsedQ is None
                          and not self.fp8_qkv)  # fp8: O (bf16) would not fit Q's buffer
        self.use_lpt = self.variant.has_mask and not varlen_q
        # Persistent CTAs over the LPT order take their tiles from a counter (module docstring).
        self.dynamic = self.dynamic_tiles and self.use_lpt
        assert self.dynamic_tiles == (mTileCounter is not None), "dynamic persistent kernels take a tile counter"
        # A persistent CTA loads the next Q while this tile's O is still in smem: O gets its
        # own buffer (``persistent_fits`` keeps the keys where it does not fit non-persistent).
        self.separate_o = self.persistent and self.use_tma_o
        self.cache_tail_may_be_garbage = args.cache_tail_may_be_garbage
        # FP8 K/V: the stages hold fp8 blocks (TMA or gathers, half the bytes of 16-bit ones);
        # the consumers widen each into a 16-bit buffer the wgmma reads (``take_k``/``take_v``).
        kv_dtype = args.mK.element_type
        self.fp8 = kv_dtype.width == 8 and not self.fp8_qkv
        assert not self.fp8 or self.roles.num_consumer_wgs == 1, "fp8 K/V: one consumer warpgroup (sm90/config.py)"
        sK_layout = row_major_smem_layout(kv_dtype, self.tile_n, self.head_dim, self.num_stages)
        sV_layout = row_major_smem_layout(kv_dtype, self.tile_n, self.head_dim_v, self.num_stages)
        sKw_layout = row_major_smem_layout(self.dtype, self.tile_n, self.head_dim, 1)
        sVw_layout = row_major_smem_layout(self.dtype, self.tile_n, self.head_dim_v, 1)
        # Unused stand-ins stay unaligned: two 1 KB alignments would keep FP8 Q, K, V d256
        # (128, 128, 2) 1 KB over the limit (``fp8_qkv_smem_bytes``).
        kw_field = cute.struct.MemRange[self.dtype, 8]
        vw_field = cute.struct.MemRange[self.dtype, 8]
        if cutlass.const_expr(self.fp8):
            kw_field = cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKw_layout)], 1024]
            vw_field = cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sVw_layout)], 1024]
        # FP8 Q, K, V: V^T stages (d_v, tile_n), keys contiguous, written by the transposes.
        sVt_layout = row_major_smem_layout(kv_dtype, self.head_dim_v, self.tile_n, self.num_stages)
        vt_field = cute.struct.MemRange[kv_dtype, 16]  # unused (16-bit kernels keep their smem layout)
        if cutlass.const_expr(self.fp8_qkv):
            vt_field = cute.struct.Align[cute.struct.MemRange[kv_dtype, cute.cosize(sVt_layout)], 1024]
            self.v_geometry = FP8TileGeometry.of(sV_layout, self.tile_n, self.head_dim_v)
            self.vt_geometry = FP8TileGeometry.of(sVt_layout, self.head_dim_v, self.tile_n)

        # O reuses Q's buffer (free once the last Q K^T completed), or has its own (separate_o).
        q_elems = cute.cosize(sQ_layout)
        o_field = cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sO_layout)], 1024]
        if cutlass.const_expr(not self.separate_o):
            if cutlass.const_expr(self.use_tma_o):
                q_elems = max(q_elems, cute.cosize(sO_layout))
            o_field = cute.struct.MemRange[self.dtype, 8]  # unused

        @cute.struct
        class SharedStorage:
            mbar_Q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_K: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            mbar_V: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            mbar_Vt: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages if self.fp8_qkv else 1]
            # dynamic: the next tile's index, warp 0 to the others (empty in the other kernels)
            sTile: cute.struct.MemRange[Int32, 1 if self.dynamic else 0]
            # quantize_q: each consumer warp's amax of the Q tile (in the 1 KB below sQ's alignment).
            sQAmax: cute.struct.MemRange[Float32, self.roles.consumer_threads // 32 if self.quantize_q else 1]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, q_elems], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[kv_dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[kv_dtype, cute.cosize(sV_layout)], 1024]
            sO: o_field
            sKw: kw_field  # fp8: the widened block (unused 16-byte stand-ins otherwise)
            sVw: vw_field
            sVt: vt_field

        # A tile planned to fit twice per SM must: else it silently runs one CTA per SM.
        assert self.ctas_per_sm == 1 or SharedStorage.size_in_bytes() <= TWO_CTAS_SMEM, SharedStorage.size_in_bytes()

        # Each consumer warpgroup owns 64 rows: wgmma's M.
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, Float32,
            atom_layout_mnk=(self.tile_m // 64, 1, 1), tiler_mn=(64, self.tile_n),
        )
        # 8-bit wgmma reads B K-major only: V^T (fp8_qkv).
        v_major = cute.nvgpu.OperandMajorMode.K if self.fp8_qkv else cute.nvgpu.OperandMajorMode.MN
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, v_major, Float32,
            atom_layout_mnk=(self.tile_m // 64, 1, 1), tiler_mn=(64, self.head_dim_v),
            a_source=warpgroup.OperandSource.RMEM,
        )

        # TMA views: (rows, d, head[, batch]) so a tile is (tile, d) at fixed head/batch.
        tma_op = cpasync.CopyBulkTensorTileG2SOp()
        if cutlass.const_expr(args.paged):
            kv_modes = [1, 3, 2, 0]  # (page_size, d, h_kv, num_pages)
        elif cutlass.const_expr(varlen_k):
            kv_modes = [0, 2, 1]  # (total_k, d, h_kv)
        else:
            kv_modes = [1, 3, 2, 0]  # (s_k, d, h_kv, b)
        tma_atom_K, tma_K, tma_atom_V, tma_V = None, mK, None, mV
        if cutlass.const_expr(not self.gather_kv):
            # One box per block, or (kv_box) a box of kv_box rows: the stage's first rows.
            rows = self.kv_box or self.tile_n
            box_layout = lambda layout, cols: (row_major_smem_layout(kv_dtype, rows, cols) if self.kv_box
                                               else cute.select(layout, mode=[0, 1]))
            tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(
                tma_op, select(mK, kv_modes), box_layout(sK_layout, self.head_dim), (rows, self.head_dim)
            )
            tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(
                tma_op, select(mV, kv_modes), box_layout(sV_layout, self.head_dim_v), (rows, self.head_dim_v)
            )
        tma_atom_Q, tma_Q = None, mQ
        if cutlass.const_expr(self.use_tma_q):
            q_modes = [0, 2, 1] if varlen_q else [1, 3, 2, 0]
            tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(
                tma_op, select(mQ, q_modes), sQ_layout, (self.tile_m, self.head_dim)
            )
        tma_atom_O, tma_O = None, mO
        if cutlass.const_expr(self.use_tma_o):
            tma_atom_O, tma_O = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), select(mO, [1, 3, 2, 0]), sO_layout, (self.tile_m, self.head_dim_v)
            )
        tx_bytes = (
            cute.size_in_bytes(self.dtype, sQ_layout),
            cute.size_in_bytes(kv_dtype, cute.select(sK_layout, mode=[0, 1])),
            cute.size_in_bytes(kv_dtype, cute.select(sV_layout, mode=[0, 1])),
        )

        grid, grid_divisors, num_m_blocks, heads_eff = tile_grid(args, self.tile_m, self.qhead_per_kvhead_packed)
        if cutlass.const_expr(self.persistent):
            grid = PersistentScheduler.grid(
                PersistentScheduler.num_tiles(num_m_blocks, heads_eff, args.num_splits, args.batch_size), max_ctas
            )
        elif cutlass.const_expr(self.use_lpt):
            grid = LptScheduler.grid(num_m_blocks, heads_eff, args.num_splits, args.batch_size)
        kernel = self.kernel(
            args, (tma_Q, tma_K, tma_V, tma_O), (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O),
            (sQ_layout, sK_layout, sV_layout, sO_layout, sKw_layout, sVw_layout, sVt_layout), tiled_mma_qk,
            tiled_mma_pv,
            gmem_tiled_copy(self.dtype, self.head_dim, self.roles.consumer_threads),
            tx_bytes, SharedStorage, num_m_blocks, grid_divisors, heads_eff, l2_heads, mTileCounter,
        )
        launch_ctas(kernel, grid, self.roles.threads, SharedStorage, stream, setmaxnreg=True,
                    ctas_per_sm=self.ctas_per_sm)

    @cute.kernel
    def kernel(
        self,
        args: FwdArgs,  # the caller's tensors (Q and K for their shapes: loads go through the views) and scalars
        tma_views: tuple,  # Q, K, V, O: TMA views, or the tensors themselves where no TMA applies
        tma_atoms: tuple,  # Q, K, V, O: TMA atoms or None
        smem_layouts: tuple,  # Q, K, V, O, widened K and V (fp8 K/V), V^T (fp8 Q, K, V)
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        gmem_copy_Q: cute.TiledCopy,
        tx_bytes: cutlass.Constexpr,
        SharedStorage: cutlass.Constexpr,
        num_m_blocks: Int32,
        grid_divisors: TileDivisors,  # what tile_work divides the block index by (tile_grid)
        heads_eff: Int32,
        l2_heads: Int32,
        mTileCounter: Optional[cute.Tensor],
    ):
        tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O = tma_atoms
        sQ_layout, sK_layout, sV_layout, sO_layout, sKw_layout, sVw_layout, sVt_layout = smem_layouts
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == 0:
            for atom in tma_atoms:
                if cutlass.const_expr(atom is not None):
                    cpasync.prefetch_descriptor(atom)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        tma_warp = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        # The TMA pipelines count one arrive per consumer warp (lane 0 signals).
        consumer_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.roles.consumer_threads // 32)
        pipeline_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_Q.data_ptr(), num_stages=1, producer_group=tma_warp,
            consumer_group=consumer_warps, tx_count=tx_bytes[0], defer_sync=True,
        )
        # fp8_qkv: V's stages are read by the transposes (one arrive per transposing warp),
        # the consumers read the V^T stages (``pipeline_vt``).
        v_readers = consumer_warps
        if cutlass.const_expr(self.fp8_qkv):
            v_readers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.roles.transposer_warps)
        if cutlass.const_expr(self.gather_kv):
            # Full: one cp.async arrive per gathering thread, once its copies landed. Empty:
            # one arrive per reading warp (``wgmma_utils.kv_release``), as for TMA.
            gatherers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.roles.gather_threads)
            pipeline_k, pipeline_v = (
                pipeline.PipelineCpAsync.create(
                    barrier_storage=mbar.data_ptr(), num_stages=self.num_stages, producer_group=gatherers,
                    consumer_group=readers, defer_sync=True,
                )
                for mbar, readers in ((storage.mbar_K, consumer_warps), (storage.mbar_V, v_readers))
            )
        else:
            pipeline_k, pipeline_v = (
                pipeline.PipelineTmaAsync.create(
                    barrier_storage=mbar.data_ptr(), num_stages=self.num_stages, producer_group=tma_warp,
                    consumer_group=readers, tx_count=tx, defer_sync=True,
                )
                for mbar, tx, readers in ((storage.mbar_K, tx_bytes[1], consumer_warps),
                                          (storage.mbar_V, tx_bytes[2], v_readers))
            )
        pipeline_vt = None
        if cutlass.const_expr(self.fp8_qkv):
            # Full: every transposing thread arrives once its stores are fenced. Empty: one
            # arrive per consumer warp (``kv_release``).
            pipeline_vt = pipeline.PipelineAsync.create(
                barrier_storage=storage.mbar_Vt.data_ptr(), num_stages=self.num_stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32 * self.roles.transposer_warps),
                consumer_group=consumer_warps, defer_sync=True,
            )
        pipeline.pipeline_init_arrive()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        o_storage = storage.sO if cutlass.const_expr(self.separate_o) else storage.sQ
        sO = o_storage.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        sKw, sVw, sVt, sV_addr, sVt_addr, sQAmax = None, None, None, None, None, None
        if cutlass.const_expr(self.fp8):
            sKw = storage.sKw.get_tensor(sKw_layout.outer, swizzle=sKw_layout.inner)
            sVw = storage.sVw.get_tensor(sVw_layout.outer, swizzle=sVw_layout.inner)
        if cutlass.const_expr(self.fp8_qkv):
            sVt = storage.sVt.get_tensor(sVt_layout.outer, swizzle=sVt_layout.inner)
            # The transposes' buffer addresses (they compute the swizzled offsets themselves).
            sV_addr, sVt_addr = storage.sV.data_ptr().toint(), storage.sVt.data_ptr().toint()
        if cutlass.const_expr(self.quantize_q):
            sQAmax = storage.sQAmax.get_tensor(cute.make_layout(self.roles.consumer_threads // 32))
        io = _Io(*tma_views, *tma_atoms, sQ, sK, sV, sO, pipeline_q, pipeline_k, pipeline_v, gmem_copy_Q, sKw, sVw,
                 sVt, sV_addr, sVt_addr, pipeline_vt, sQAmax)

        block_info = BlockInfo(self.tile_m, self.tile_n, self.qhead_per_kvhead_packed, self.variant, self.split_blocks,
                         self.q_class)
        sched = _Sched(num_m_blocks, grid_divisors, heads_eff, l2_heads, mTileCounter,
                       storage.sTile.get_tensor(cute.make_layout(1)) if cutlass.const_expr(self.dynamic) else None)
        pipeline.pipeline_init_wait()

        if warp_idx < len(self.roles.producer_warps):
            cute.arch.setmaxregister_decrease(self.roles.producer_regs)
            if cutlass.const_expr(self.roles.split_gather):
                # The lane as the gathering thread: non-negative for ptxas (tidx - 32 left
                # signed-division fixups and 64 spilled address words in the V warp).
                if warp_idx == 0:
                    self.load(args, io, sched, block_info, warp_idx, tidx & 31, parts="k")
                if warp_idx == 1:
                    self.load(args, io, sched, block_info, warp_idx, tidx & 31, parts="v", walker="producer")
            elif cutlass.const_expr(self.dynamic and self.gather_kv and not self.fp8_qkv):
                # every producer warp gathers; warp 0 alone draws the tiles
                if warp_idx == 0:
                    self.load(args, io, sched, block_info, warp_idx, tidx)
                else:
                    self.load(args, io, sched, block_info, warp_idx, tidx, walker="producer")
            elif warp_idx == 0 or cutlass.const_expr(self.gather_kv and not self.fp8_qkv):
                self.load(args, io, sched, block_info, warp_idx, tidx)
            if cutlass.const_expr(self.fp8_qkv):
                first = self.roles.first_transposer
                if warp_idx >= first:
                    self.transposes(args, io, sched, block_info, tidx - 32 * first)
        else:
            cute.arch.setmaxregister_increase(self.roles.consumer_regs)
            self.mma(args, io, (tiled_mma_qk, tiled_mma_pv), sched, block_info, tidx - 128)

    # -----------------------------------------------------------------------------------
    # Tiles
    # -----------------------------------------------------------------------------------

    @cute.jit
    def work_at(self, idx, args: FwdArgs, sched: "_Sched"):
        """The tile of persistent step ``idx`` (``PersistentScheduler``), or of this CTA."""
        work = None
        if cutlass.const_expr(self.persistent and self.use_lpt):
            work = LptScheduler.work_of(idx, sched.num_m_blocks, sched.heads, args.batch_size, sched.l2_heads)
        elif cutlass.const_expr(self.persistent):
            work = SingleTileScheduler.work_of(idx, sched.num_m_blocks, sched.heads, args.num_splits)
        elif cutlass.const_expr(self.use_lpt):
            work = LptScheduler.get_work(sched.num_m_blocks, sched.heads, args.batch_size, sched.l2_heads)
        else:
            work = tile_work(args, sched.grid_divisors, self.tile_m, self.qhead_per_kvhead_packed)
        return work

    @cute.jit
    def for_each_tile(self, args: FwdArgs, sched: "_Sched", tile_fn, q_state, state,
                      walker: cutlass.Constexpr[str] = "consumer"):
        """The CTA's tiles, ``(q_state, state) = tile_fn(work, q_state, state)`` each: one,
        or (persistent) every gridDim.x-th from blockIdx.x, or (``dynamic``) blockIdx.x and
        then those the counter hands out, the pipeline states carried from one to the next.
        Producer and consumers walk the same tiles in the same order: under ``dynamic`` the
        ``walker`` "publisher" (producer warp 0) draws each next index, the other producer
        warps ("producer") and the consumers ("consumer") read it (``next_tile``)."""
        if cutlass.const_expr(self.persistent):
            idx = cute.arch.block_idx()[0]
            num_tiles = PersistentScheduler.num_tiles(sched.num_m_blocks, sched.heads, args.num_splits,
                                                      args.batch_size)
            if cutlass.const_expr(self.dynamic and walker != "publisher"):
                self.hand_out_barrier(walker, "empty", arrive=True)  # the slot starts free
            while idx < num_tiles:
                nxt = idx
                if cutlass.const_expr(self.dynamic and walker == "publisher"):
                    # Drawn before the tile's loads, so the atomic's round trip runs under them.
                    nxt = self.draw_tile(sched)
                q_state, state = tile_fn(self.work_at(idx, args, sched), q_state, state)
                if cutlass.const_expr(self.dynamic):
                    idx = self.next_tile(sched, nxt, walker)
                else:
                    idx += cute.arch.grid_dim()[0]
        else:
            q_state, state = tile_fn(self.work_at(None, args, sched), q_state, state)
        return q_state, state

    @cute.jit
    def draw_tile(self, sched: "_Sched") -> Int32:
        """``dynamic``: the next tile of this CTA (lane 0 of producer warp 0 adds one to the
        counter; the first grid-size tiles are the CTAs' first), in every lane."""
        drawn = Int32(0)
        if cute.arch.lane_idx() == 0:
            drawn = cute.arch.atomic_add(sched.tile_counter.iterator.llvm_ptr, Int32(1), sem="relaxed",
                                         scope="gpu")
        return cute.arch.shuffle_sync(drawn, 0) + cute.arch.grid_dim()[0]

    @cute.jit
    def next_tile(self, sched: "_Sched", drawn: Int32, walker: cutlass.Constexpr[str]) -> Int32:
        """``dynamic``: the publisher writes the index it drew into the slot once every reader
        took the last one; a reader waits for it, takes it and frees the slot. The producer
        warps that read it (V transposes, row gathers) meet the publisher on their own pair
        of barriers, so that they start the next tile's blocks while the consumers still
        finish this one."""
        idx = drawn
        if cutlass.const_expr(walker == "publisher"):
            for group in cutlass.range_constexpr(len(self.reader_groups())):
                self.hand_out_barrier(self.reader_groups()[group], "empty", arrive=False)
            if cute.arch.lane_idx() == 0:
                sched.sTile[0] = drawn
            for group in cutlass.range_constexpr(len(self.reader_groups())):
                self.hand_out_barrier(self.reader_groups()[group], "full", arrive=True)
        else:
            self.hand_out_barrier(walker, "full", arrive=False)
            idx = sched.sTile[0]
            self.hand_out_barrier(walker, "empty", arrive=True)
        return idx

    def reader_groups(self) -> tuple:
        """``dynamic``: who reads the drawn tile: the consumers, and the other producer warps
        where they walk the tiles too (``producer_walkers``)."""
        return ("consumer",) + (("producer",) if self.producer_walkers() > 32 else ())

    def producer_walkers(self) -> int:
        """Producer threads that walk the tiles: warp 0, or every producer warp where they
        all load (gather_kv) or transpose V (FP8 Q, K, V)."""
        return 32 * (len(self.roles.producer_warps) if self.fp8_qkv or self.gather_kv else 1)

    def hand_out_barrier(self, group: str, which: str, arrive: bool):
        """``dynamic``: the "full" or "empty" barrier between the publisher and a reader
        ``group``: the publisher's warp and the group's threads."""
        barrier = {("consumer", "full"): Sm90FwdBarrier.TILE_FULL, ("consumer", "empty"): Sm90FwdBarrier.TILE_EMPTY,
                   ("producer", "full"): Sm90FwdBarrier.TILE_FULL_PRODUCER,
                   ("producer", "empty"): Sm90FwdBarrier.TILE_EMPTY_PRODUCER}[group, which]
        threads = self.producer_walkers() if group == "producer" else 32 + self.roles.consumer_threads
        if arrive:
            cute.arch.barrier_arrive(barrier_id=int(barrier), number_of_threads=threads)
        else:
            cute.arch.barrier(barrier_id=int(barrier), number_of_threads=threads)

    # -----------------------------------------------------------------------------------
    # Producer
    # -----------------------------------------------------------------------------------

    @cute.jit
    def load(self, args: FwdArgs, io: "_Io", sched: "_Sched", block_info: BlockInfo, warp_idx, tidx,
             parts: cutlass.Constexpr[str] = "kv", walker: cutlass.Constexpr[str] = "publisher"):
        """The producer's tiles (``for_each_tile``): a stage of the next tile is loaded as
        soon as the consumers free it. ``parts``: the blocks this warp loads, K and V, or
        (``split_gather``) K or V alone."""
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        q_state, state = self.for_each_tile(
            args, sched,
            lambda work, q_st, st: self.load_tile(args, io, work, block_info, q_st, st, warp_idx, tidx, parts),
            q_state, state, walker=walker)
        # Keep the CTA alive until the consumers released every stage it filled.
        (io.pipeline_k if cutlass.const_expr(parts == "k") else io.pipeline_v).producer_tail(state)

    @cute.jit
    def load_tile(self, args: FwdArgs, io: "_Io", work, block_info: BlockInfo, q_state, state, warp_idx, tidx,
                  parts: cutlass.Constexpr[str]):
        """Q once (warp 0), then K one block ahead of V, so that the consumers' Q K^T of
        block n can start while P V of block n+1 still waits for V. KV blocks go by TMA from
        warp 0, or are gathered row by row by the whole warpgroup (``gather_kv``; FP8 Q, K,
        V: K by warp 0, V by warp 1). Nothing for a tile without rows or KV blocks (the
        consumers skip its loads alike)."""
        tile = FwdTile.create(args, work, block_info, self.is_split)
        if tile.rows_valid > 0:
            if tile.n_block_max > tile.n_block_min:
                q_state, state = self.load_blocks(args, io, tile, q_state, state, warp_idx, tidx, parts)
        return q_state, state

    @cute.jit
    def load_q_tma(self, io: "_Io", args: FwdArgs, tile: FwdTile, q_state, warp_idx):
        """Q by TMA from warp 0 (``use_tma_q``), once the consumers freed the last tile's."""
        if warp_idx == 0:
            if cutlass.const_expr(args.varlen_q):
                mQ_cur = cute.domain_offset((tile.seqlen.offset_q, 0), io.tma_Q[None, None, tile.ctx.head])
            else:
                mQ_cur = io.tma_Q[None, None, tile.ctx.head, tile.ctx.batch]
            gQ = cute.local_tile(mQ_cur, (self.tile_m, self.head_dim), (tile.m_block, 0))
            tQsQ, tQgQ = cpasync.tma_partition(
                io.tma_atom_Q, 0, cute.make_layout(1), cute.group_modes(io.sQ, 0, 2), cute.group_modes(gQ, 0, 2)
            )
            # Waits (persistent) until every consumer warp finished the last tile's Q K^T.
            io.pipeline_q.producer_acquire(q_state)
            cute.copy(io.tma_atom_Q, tQgQ, tQsQ, tma_bar_ptr=io.pipeline_q.producer_get_barrier(q_state))
        q_state.advance()
        return q_state

    @cute.jit
    def load_blocks(self, args: FwdArgs, io: "_Io", tile: FwdTile, q_state, state, warp_idx, tidx,
                    parts: cutlass.Constexpr[str]):
        if cutlass.const_expr(self.roles.split_gather and self.gathers_ahead()):
            # Lookups a block ahead at pages of 1 only (the page size is not in the key: one
            # uniform branch). H100, 2026-12-07, b64 x 4096 h32/8 d128 decode over an e4m3
            # cache with e4m3 q, us, same-machine A/B (``ab_run.sh``): pages of 1 251.2 ->
            # 219.6, pages of 16 216.5 -> 222.0.
            if io.tma_K.shape[1] == 1:
                q_state, state = self.gather_blocks_ahead(args, io, tile, q_state, state, warp_idx, tidx, parts)
            else:
                q_state, state = self.load_blocks_in_turn(args, io, tile, q_state, state, warp_idx, tidx, parts)
            return q_state, state
        return self.load_blocks_in_turn(args, io, tile, q_state, state, warp_idx, tidx, parts)

    @cute.jit
    def load_blocks_in_turn(self, args: FwdArgs, io: "_Io", tile: FwdTile, q_state, state, warp_idx, tidx,
                            parts: cutlass.Constexpr[str]):
        """K and V blocks in the consumers' order (last to first: K of the next block, then
        V of this one), each loaded once its stage is free."""
        if cutlass.const_expr(self.gather_kv):
            load_k, load_v = self.kv_gatherers(args, io, tile, tidx)
        else:
            load_k, load_v = self.kv_tma_loaders(args, io, tile)
        if cutlass.const_expr(parts == "k"):
            load_v = lambda n_block, st: None
        if cutlass.const_expr(parts == "v"):
            load_k = lambda n_block, st: None
        n_block_min, n_block_max = tile.n_block_min, tile.n_block_max
        load_k(n_block_max - 1, state)
        if cutlass.const_expr(self.use_tma_q and parts != "v"):
            q_state = self.load_q_tma(io, args, tile, q_state, warp_idx)
        for i in cutlass.range(n_block_max - 1 - n_block_min, unroll=1):
            n_block = n_block_max - 2 - i
            state_v = state.clone()
            state.advance()
            load_k(n_block, state)
            load_v(n_block + 1, state_v)
        load_v(n_block_min, state)
        state.advance()
        return q_state, state

    def kv_tma_loaders(self, args: FwdArgs, io: "_Io", tile: FwdTile):
        """(load_k, load_v): ``(n_block, state) ->`` the block into the stage, by one TMA
        (``load_kv``) or, over pages smaller than a block, one per box (``load_kv_boxes``)."""
        if cutlass.const_expr(args.mLeftpadK is not None):
            # A key start inside a page moves every block off the page's TMA boxes.
            raise ValueError("a paged cache with mLeftpadK (cache_leftpad) is read by row gathers (gather_kv)")
        head_kv, batch = tile.head_kv, tile.ctx.batch
        sK, sV = io.sK, io.sV
        if cutlass.const_expr(args.paged):
            rows = self.kv_box or self.tile_n
            mK_cur = io.tma_K[None, None, head_kv, None]  # (page_size, d, num_pages)
            mV_cur = io.tma_V[None, None, head_kv, None]
            gK = cute.local_tile(mK_cur, (rows, self.head_dim), (None, 0, None))
            gV = cute.local_tile(mV_cur, (rows, self.head_dim_v), (None, 0, None))
            if cutlass.const_expr(self.kv_box):
                # (kv_box, d, boxes, 1, stages): box j of a stage holds the block's rows
                # [j kv_box, (j + 1) kv_box).
                sK = cute.flat_divide(sK, (rows, self.head_dim))
                sV = cute.flat_divide(sV, (rows, self.head_dim_v))
        else:
            if cutlass.const_expr(args.varlen_k):
                mK_cur = cute.domain_offset((tile.seqlen.offset_k, 0), io.tma_K[None, None, head_kv])
                mV_cur = cute.domain_offset((tile.seqlen.offset_k, 0), io.tma_V[None, None, head_kv])
            else:
                mK_cur = io.tma_K[None, None, head_kv, batch]
                mV_cur = io.tma_V[None, None, head_kv, batch]
            gK = cute.local_tile(mK_cur, (self.tile_n, self.head_dim), (None, 0))
            gV = cute.local_tile(mV_cur, (self.tile_n, self.head_dim_v), (None, 0))
        tKsK, tKgK = cpasync.tma_partition(
            io.tma_atom_K, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2)
        )
        tVsV, tVgV = cpasync.tma_partition(
            io.tma_atom_V, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2)
        )
        mPageTable = args.mPageTable
        if cutlass.const_expr(self.kv_box):
            last = tile.ctx.seqlen_k - 1
            load = lambda *a: self.load_kv_boxes(*a, mPageTable, batch, last)
        else:
            load = lambda *a: self.load_kv(*a, mPageTable, batch)
        load_k = lambda n_block, st: load(io.tma_atom_K, tKgK, tKsK, io.pipeline_k, n_block, st)
        load_v = lambda n_block, st: load(io.tma_atom_V, tVgV, tVsV, io.pipeline_v, n_block, st)
        return load_k, load_v

    @cute.jit
    def load_kv(self, tma_atom, tXgX, tXsX, pipe, n_block, state, mPageTable, batch):
        """TMA of KV block n_block into the stage of ``state``, once the consumers freed it.
        A page's entry is read before the wait for the stage: ptxas does not move a global
        load above an mbarrier wait, and the entry's round trip would otherwise come after
        the stage frees, on every block, before its TMA can start."""
        if cutlass.const_expr(mPageTable is not None):
            # Page size is a multiple of tile_n: block n is sub-block `sub` of one page (the
            # page table maps blocks like keys, in units of page_size / tile_n blocks).
            blocks_per_page = tXgX.shape[1]
            page, sub = page_and_row(mPageTable, batch, n_block, blocks_per_page, tXgX.shape[2])
            src = tXgX[None, sub, page]
        else:
            src = tXgX[None, n_block]
        pipe.producer_acquire(state)
        cute.copy(tma_atom, src, tXsX[None, state.index], tma_bar_ptr=pipe.producer_get_barrier(state))

    @cute.jit
    def load_kv_boxes(self, tma_atom, tXgX, tXsX, pipe, n_block, state, mPageTable, batch, last):
        """``load_kv`` in boxes of ``kv_box`` rows (pages that hold no whole block), each
        through its own page-table entry, all read before the wait for the stage; only the
        entries are carried across it (clamped, and the boxes in page recomputed, after).
        A box that starts past the sequence's ``last`` key reads the last key's box again
        (its entry may lie past the table's row): rows the masks and the V-tail zeroing
        take out."""
        boxes_per_page, num_pages = tXgX.shape[1], tXgX.shape[2]
        boxes = self.tile_n // self.kv_box
        box_of = lambda j: kv_box_index(n_block, j, self.tile_n, self.kv_box, last)
        entries = [page_entry(mPageTable, batch, box_of(j), boxes_per_page)[0] for j in range(boxes)]
        pipe.producer_acquire(state)
        for j in cutlass.range_constexpr(boxes):
            sub = box_in_page(box_of(j), boxes_per_page)
            cute.copy(tma_atom, tXgX[None, sub, clamp_page(entries[j], num_pages)], tXsX[None, j, 0, state.index],
                      tma_bar_ptr=pipe.producer_get_barrier(state))

    def gathers_ahead(self) -> bool:
        """Whether ``split_gather`` warps may look a block's pages up a block ahead (compiled
        in; ``load_blocks`` takes it at pages of 1 only): where a warp's rows of a block are at
        most 16 (the decode tiles, tile_n 64: two blocks' entries in 32 registers). sm_90a SASS,
        (64, 96, 2) with cache_leftpad (24 rows a thread): 102 local-memory loads ahead, none
        without."""
        return self.tile_n * max(self.head_dim, self.head_dim_v) // (16 * self.roles.gather_threads) <= 16

    @cute.jit
    def gather_blocks_ahead(self, args: FwdArgs, io: "_Io", tile: FwdTile, q_state, state, warp_idx, tidx,
                            parts: cutlass.Constexpr[str]):
        """``split_gather`` (FP8 Q, K, V over gathered rows): this warp's K or V blocks, each
        block's page lookups issued a block ahead (before the stage wait and the copies of
        the block before it), so that one warp keeps its copies going instead of waiting a
        page-table round trip per block. The blocks and stages in the order ``load_blocks``
        gives them (block n_block_max - 1 - j in stage j)."""
        if cutlass.const_expr(parts == "k"):
            mX, sX, cols, cols_valid, pipe = io.tma_K, io.sK, self.head_dim, self.head_dim_valid, io.pipeline_k
        else:
            mX, sX, cols, cols_valid, pipe = io.tma_V, io.sV, self.head_dim_v, self.head_dim_v_valid, io.pipeline_v
        tiled_copy = gmem_tiled_copy(args.mK.element_type, cols, self.roles.gather_threads)
        thr_copy = tiled_copy.get_slice(tidx)
        tXsX = thr_copy.partition_D(sX)
        tXcX = thr_copy.partition_S(cute.make_identity_tensor((self.tile_n, cols)))
        mX_h = mX[None, None, tile.head_kv, None]  # (num_pages, page_size, cols)
        rows = cute.size(tXsX, mode=[1])
        n_block_min, n_block_max = tile.n_block_min, tile.n_block_max
        last, batch, key_start = tile.seqlen.seqlen_k - 1, tile.ctx.batch, tile.seqlen.leftpad_k
        page_size, num_pages = mX_h.shape[1], mX_h.shape[0]
        # The page-table entries alone are carried (the rows in page are recomputed at their use:
        # carrying both, the warp spilled 40 words to local memory).
        lookups = lambda n: page_lookups(args.mPageTable, batch, tXcX, cutlass.max(n, n_block_min) * self.tile_n,
                                         last, 0, rows, page_size, num_pages, key_start, clamp=False)[0]
        gather = lambda n, st, ahead: self.gather_kv_block(tiled_copy, tXsX, tXcX, mX_h, args.mPageTable, batch,
                                                           pipe, n, st, tile.seqlen.seqlen_k, key_start, cols_valid,
                                                           ahead)
        cur = lookups(n_block_max - 1)
        nxt = lookups(n_block_max - 2)
        gather(n_block_max - 1, state, cur)
        if cutlass.const_expr(self.use_tma_q and parts != "v"):
            q_state = self.load_q_tma(io, args, tile, q_state, warp_idx)
        for j in cutlass.range(n_block_max - 1 - n_block_min, unroll=1):
            for i in cutlass.range_constexpr(rows):
                cur[i] = nxt[i]
            state.advance()
            # The block after this one: read now, used an iteration later.
            ahead = lookups(n_block_max - 3 - j)
            for i in cutlass.range_constexpr(rows):
                nxt[i] = ahead[i]
            gather(n_block_max - 2 - j, state, cur)
        state.advance()
        return q_state, state

    def kv_gatherers(self, args: FwdArgs, io: "_Io", tile: FwdTile, tidx):
        """(load_k, load_v) for ``gather_kv``: each gathering thread (the producer warpgroup;
        fp8 Q, K, V: warp 0 for K, warp 1 for V, ``split_gather``) copies its 16-byte chunks of the
        block's rows, each row through its own page lookup (``page_and_row``)."""
        nthreads = self.roles.gather_threads

        def loader(mX, sX, cols, cols_valid, pipe):
            tiled_copy = gmem_tiled_copy(args.mK.element_type, cols, nthreads)
            thr_copy = tiled_copy.get_slice(tidx)
            tXsX = thr_copy.partition_D(sX)
            tXcX = thr_copy.partition_S(cute.make_identity_tensor((self.tile_n, cols)))
            mX_h = mX[None, None, tile.head_kv, None]  # (num_pages, page_size, cols)
            return lambda n_block, st: self.gather_kv_block(tiled_copy, tXsX, tXcX, mX_h, args.mPageTable,
                                                            tile.ctx.batch, pipe, n_block, st, tile.seqlen.seqlen_k,
                                                            tile.seqlen.leftpad_k, cols_valid)

        return (loader(io.tma_K, io.sK, self.head_dim, self.head_dim_valid, io.pipeline_k),
                loader(io.tma_V, io.sV, self.head_dim_v, self.head_dim_v_valid, io.pipeline_v))

    @cute.jit
    def gather_kv_block(self, tiled_copy, tXsX, tXcX, mX_h, mPageTable, batch, pipe, n_block, state, seqlen_k,
                        key_start=None, cols_valid: cutlass.Constexpr = None, ahead=None):
        """cp.async of this thread's chunks of block n_block, then a cp.async arrive on the
        stage's full barrier (it fires when they land). The page lookups of a group of rows
        are issued before its first copy (``paged_kv.page_lookups``; ``key_start``: the
        sequence's first cache position with cache_leftpad, else None). Rows past the
        sequence end are not read: their scores are masked, and the consumers zero the V
        tail (``zero_v_tail``). ``cols_valid``: a padded head dim's columns (the rest
        zero-filled). ``ahead``: the rows' page-table entries, looked up a block ahead
        (``gather_blocks_ahead``; clamped here, at their use, and the rows in page computed)."""
        page_size, num_pages = mX_h.shape[1], mX_h.shape[0]
        tXsX_s = tXsX[None, None, None, state.index]
        rows = cute.size(tXsX_s, mode=[1])
        # Lookups in flight at once: every row's with one consumer warpgroup (96 producer
        # registers); 4 with two (40 registers: 8 spilled 126 values in the producer loop).
        group = rows if cutlass.const_expr(self.roles.producer_regs >= 96) else min(rows, 4)
        t0 = n_block * self.tile_n
        last = seqlen_k - 1
        if cutlass.const_expr(ahead is not None):
            group = rows
        for g in cutlass.range_constexpr(cute.ceil_div(rows, group)):
            count = min(group, rows - g * group)
            if cutlass.const_expr(ahead is None):
                tPrPage, tPrRow = page_lookups(mPageTable, batch, tXcX, t0, last, g * group, count, page_size,
                                               num_pages, key_start)
            else:
                tPrPage = ahead
                tPrRow = rows_in_page(tXcX, t0, last, g * group, count, page_size, key_start)
                for i in cutlass.range_constexpr(count):
                    tPrPage[i] = clamp_page(tPrPage[i], num_pages)
            if cutlass.const_expr(g == 0):
                pipe.producer_acquire(state)
            for i in cutlass.range_constexpr(count):
                m = g * group + i
                if t0 + tXcX[0, m, 0][0] <= last:
                    copy_row(tiled_copy, tXsX_s[None, m, None], tXcX[None, m, None], mX_h[tPrPage[i], tPrRow[i], None],
                             cols_valid)
        pipe.producer_commit(state)

    @cute.jit
    def transposes(self, args: FwdArgs, io: "_Io", sched: "_Sched", block_info: BlockInfo, ttid):
        """FP8 Q, K, V: producer warps 1-3, or 2-3 (``split_gather``; ``ttid`` among their
        threads) turn each V stage the TMA or the gathers filled into a V^T stage, in the
        consumers' order of blocks (last to first). The loading warps only load, so a
        transpose waiting for its V never delays a K load."""
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        state_t = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        state, state_t = self.for_each_tile(
            args, sched, lambda work, st, st_t: self.transpose_tile(args, io, work, block_info, st, st_t, ttid),
            state, state_t, walker="producer")
        io.pipeline_vt.producer_tail(state_t)

    @cute.jit
    def transpose_tile(self, args: FwdArgs, io: "_Io", work, block_info: BlockInfo, state, state_t, ttid):
        """The V blocks of one tile (``load_tile``'s): wait for the TMA's stage and a free V^T
        stage, transpose, fence the stores for the wgmma (async proxy), signal the V^T stage
        full, and give the TMA stage back (one arrive per warp, after its loads)."""
        tile = FwdTile.create(args, work, block_info, self.is_split)
        if tile.rows_valid > 0:
            for i in cutlass.range(tile.n_block_max - tile.n_block_min, unroll=1):
                n_block = tile.n_block_max - 1 - i
                io.pipeline_v.consumer_wait(state)
                io.pipeline_vt.producer_acquire(state_t)
                transpose_v_block(io.sV_addr, io.sVt_addr, self.v_geometry, self.vt_geometry, state.index,
                                  state_t.index, ttid, self.roles.transposer_warps,
                                  tile.ctx.seqlen_k - n_block * self.tile_n, self.cache_tail_may_be_garbage)
                cute.arch.fence_view_async_shared()
                io.pipeline_vt.producer_commit(state_t)
                cute.arch.sync_warp()
                kv_release(io.pipeline_v, state, self.gather_kv)
                state.advance()
                state_t.advance()
        return state, state_t

    # -----------------------------------------------------------------------------------
    # Consumers
    # -----------------------------------------------------------------------------------

    @cute.jit
    def mma(self, args: FwdArgs, io: "_Io", tiled_mmas: tuple, sched: "_Sched", block_info: BlockInfo, cidx):
        """Consumer warpgroups: for each of the CTA's tiles (``load``'s), the KV loop
        (wgmma + softmax), then the epilogue. ``tiled_mmas``: Q K^T and P V."""
        wg_idx = cute.arch.make_warp_uniform(cidx // 128)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        if cutlass.const_expr(self.persistent):
            # The first warpgroup opens its turn once: every tile leaves the ping-pong barriers
            # as it found them (each warpgroup issues the same number of blocks; the last
            # turn's arrive on the first warpgroup's barrier opens the next tile).
            self.scheduler_open(wg_idx)
        q_state, state = self.for_each_tile(
            args, sched,
            lambda work, q_st, st: self.mma_tile(args, io, tiled_mmas, work, block_info, q_st, st, cidx, wg_idx),
            q_state, state)

    @cute.jit
    def mma_tile(self, args: FwdArgs, io: "_Io", tiled_mmas: tuple, work, block_info: BlockInfo, q_state, state,
                 cidx, wg_idx):
        """One tile: the KV loop when it has KV blocks, then O and the LSE (zero and -inf
        rows without blocks)."""
        tiled_mma_qk, tiled_mma_pv = tiled_mmas
        tile = FwdTile.create(args, work, block_info, self.is_split)
        if tile.rows_valid > 0:
            # fp8 K: k_descale joins the softmax scale (read only for a tile with rows: a CTA
            # of a folded grid past the last sequence has no batch index to read it at).
            tile_k = tile.with_k_descale(args)
            if cutlass.const_expr(self.quantize_q):
                # sQ = Q / 2^e in e4m3: 2^e joins the softmax scale (as a q_descale does).
                tile_k = replace(tile_k, softmax_scale=tile_k.softmax_scale * self.load_q_quantized(args, io, tile,
                                                                                                     cidx))
            thr_mma_qk = tiled_mma_qk.get_slice(cidx)
            acc_O = cute.make_rmem_tensor(tiled_mma_pv.partition_shape_C((self.tile_m, self.head_dim_v)), Float32)
            acc_O.fill(0.0)
            # Identity coordinates of this thread's S elements, for masks and score mods.
            tScS_mn = acc_mn_view(thr_mma_qk.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n))))
            has_mod = cutlass.const_expr(self.variant.has_score_mod)
            # With a score modifier the kernel scales S before calling it; otherwise the
            # scale folds into the exp2 argument (one FFMA per score).
            scale_log2 = LOG2_E if has_mod else tile_k.softmax_scale * LOG2_E
            softmax = OnlineSoftmax(cute.size(tScS_mn, mode=[0]), Float32(scale_log2),
                                    max_offset=FP8_P_OFFSET if self.fp8_qkv else 0)
            if tile.n_block_max > tile.n_block_min:
                q_state, state = self.mainloop(args, io, tiled_mmas, acc_O, softmax, tScS_mn, tile_k, block_info,
                                               q_state, state, cidx, wg_idx)
                if cutlass.const_expr(args.mVDescale is not None):  # fp8: V = the fp8 values x v_descale
                    acc_O.store(acc_O.load() * args.mVDescale[tile.ctx.batch, tile.head_kv])
            sinks = None
            if cutlass.const_expr(args.mLearnableSink is not None and not self.is_split):  # split: the combine's
                sinks = tile.row_sinks(args.mLearnableSink, tScS_mn, tile.m_block * self.tile_m,
                                       self.qhead_per_kvhead_packed)
            lse = cute.make_rmem_tensor((softmax.num_rows,), Float32)
            softmax.finalize(acc_O, lse, sinks)
            self.epilogue(args, io, acc_O, lse, tile, tiled_mma_pv, cidx)
        return q_state, state

    @cute.jit
    def mainloop(self, args: FwdArgs, io: "_Io", tiled_mmas: tuple, acc_O, softmax: OnlineSoftmax, tScS_mn,
                 tile: FwdTile, block_info: BlockInfo, q_state, state, cidx, wg_idx):
        """The KV blocks of one tile, from the last to the first; returns the pipeline
        states advanced past them."""
        tiled_mma_qk, tiled_mma_pv = tiled_mmas
        wg_layout = cute.make_layout(self.roles.num_consumer_wgs, stride=128)
        # wgmma fragments are warpgroup-wide descriptors: partition by the warpgroup's first thread.
        wg_mma_qk = tiled_mma_qk.get_slice(wg_layout(wg_idx))
        wg_mma_pv = tiled_mma_pv.get_slice(wg_layout(wg_idx))
        tSrQ = wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(io.sQ))
        widen = None
        if cutlass.const_expr(self.fp8):
            # The wgmma read the widened buffers; each thread widens its 8-element chunks of a
            # staged block (the partition of a 16-bit 128-bit copy: 16-byte aligned stores).
            thr_copy_K = gmem_tiled_copy(self.dtype, self.head_dim, self.roles.consumer_threads).get_slice(cidx)
            thr_copy_V = gmem_tiled_copy(self.dtype, self.head_dim_v, self.roles.consumer_threads).get_slice(cidx)
            widen = _Widen(thr_copy_K.partition_D(io.sK), thr_copy_K.partition_D(io.sKw[None, None, 0]),
                           thr_copy_V.partition_D(io.sV), thr_copy_V.partition_D(io.sVw[None, None, 0]),
                           thr_copy_V.partition_S(cute.make_identity_tensor((self.tile_n, self.head_dim_v))))
        tSrK = wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(io.sKw if cutlass.const_expr(self.fp8) else io.sK))
        if cutlass.const_expr(self.fp8_qkv):
            # V^T stages and P in the RS wgmma's own 8-bit A layout, in the key order the
            # transposes wrote (``fp8_operands``).
            tOrVt = wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(io.sVt))
            tOrP = cute.make_rmem_tensor(tiled_mma_pv.partition_shape_A((self.tile_m, self.tile_n)), self.dtype)
        else:
            tOrVt = wg_mma_pv.make_fragment_B(
                wg_mma_pv.partition_B(transpose_view(io.sVw if cutlass.const_expr(self.fp8) else io.sV)))
            # P in 16 bits, laid out like S (so the conversion packs adjacent columns pairwise),
            # read by the RS wgmma through the A-operand view.
            rP = cute.make_rmem_tensor(tiled_mma_qk.partition_shape_C((self.tile_m, self.tile_n)), self.dtype)
            tOrP = acc_to_operand_a(rP)
        # The correction O still owes when rescale_o_before_pv defers it (loop-carried).
        scale_carry = None
        if cutlass.const_expr(self.rescale_o_before_pv):
            scale_carry = cute.make_rmem_tensor((softmax.num_rows,), Float32)
        two_level = None
        if cutlass.const_expr(self.two_level > 0):
            two_level = TwoLevelPV(acc_O, softmax.num_rows, self.two_level)
        mma = _MmaState(tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrVt, tOrP, tScS_mn, acc_O, softmax, scale_carry,
                        widen, two_level)

        if cutlass.const_expr(self.use_tma_q):
            io.pipeline_q.consumer_wait(q_state)
        elif cutlass.const_expr(not self.quantize_q):  # quantize_q: sQ written before the loop (mma_tile)
            if cutlass.const_expr(self.persistent):
                # Every warpgroup finished the last tile's Q K^T before Q is overwritten.
                self.consumers_sync()
            self.load_q_packed(args, io, tile, cidx)
        if cutlass.const_expr(not self.persistent):
            self.scheduler_open(wg_idx)
        row0 = tile.m_block * self.tile_m
        n_block_min, n_block_max = tile.n_block_min, tile.n_block_max

        # First block: S only (its P V is issued with the next block's Q K^T).
        k_stage = self.take_k(mma, io, state)
        acc_S = cute.make_rmem_tensor(tiled_mma_qk.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        wgmma_gemm(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, k_stage], True, 0)
        self.give_kv(io.pipeline_k, state)
        apply_to_scores(self.variant, acc_mn_view(acc_S), tScS_mn, tile.ctx, row0, (n_block_max - 1) * self.tile_n,
                        self.qhead_per_kvhead_packed, tile.softmax_scale, True)
        self.softmax(mma, acc_S, None)
        # fp8 K/V: zeroed as widened; fp8 Q, K, V: as transposed.
        if cutlass.const_expr(self.cache_tail_may_be_garbage and not self.fp8 and not self.fp8_qkv):
            self.zero_v_tail(io.pipeline_v, state, io.sV, tile.ctx.seqlen_k - (n_block_max - 1) * self.tile_n, cidx)

        # The first block is done: the runs cover [n_block_min, n_block_max - 1).
        n_hi = n_block_max - 1
        state = block_info.walk_n_blocks(
            lambda st, n_block, masked: self.mma_one_block(mma, io, tile, row0, st, n_block, masked, wg_idx),
            n_block_min, n_hi, tile.n_block_runs(block_info, n_hi), state)
        # Every Q K^T of the tile completed (waited on in its step): the producer may load
        # the next tile's Q into sQ while the last P V and the epilogue run.
        if cutlass.const_expr(self.use_tma_q):
            io.pipeline_q.consumer_release(q_state)
            q_state.advance()

        # Last P V (number n_block_max - 1 - n_block_min of the tile's).
        pv = n_hi - n_block_min
        self.rescale_carried(mma, pv)
        v_stage = self.take_v(mma, io, state, tile, n_block_min, last=True)
        wgmma_gemm(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, v_stage], False, 0,
                   self.pv_accumulates(mma, pv))
        self.give_v(io, state)
        state.advance()
        if cutlass.const_expr(mma.two_level is not None):
            mma.two_level.finish(acc_O)
        return q_state, state

    @cute.jit
    def mma_one_block(self, mma: "_MmaState", io: "_Io", tile: FwdTile, row0, state, n_block,
                      masked: cutlass.Constexpr, wg_idx):
        """S(n) = Q K(n)^T and O += P(n+1) V(n+1) in flight together; the softmax of S(n)
        starts once S lands, while P V still runs. Block n + 1's P V is the tile's number
        ``pv`` (the first block, n_block_max - 1, has number 0)."""
        pv = tile.n_block_max - 2 - n_block
        state_v = state.clone()
        state.advance()
        k_stage = self.take_k(mma, io, state)
        self.scheduler_sync(wg_idx)
        acc_S = cute.make_rmem_tensor(mma.tiled_mma_qk.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        wgmma_gemm(mma.tiled_mma_qk, acc_S, mma.tSrQ, mma.tSrK[None, None, None, k_stage], True, -1)
        self.rescale_carried(mma, pv)  # while Q K^T runs
        v_stage = self.take_v(mma, io, state_v, tile, n_block + 1)  # fp8: widened while Q K^T runs
        wgmma_gemm(mma.tiled_mma_pv, mma.acc_O, mma.tOrP, mma.tOrVt[None, None, None, v_stage], False, -1,
                   self.pv_accumulates(mma, pv))
        self.scheduler_arrive(wg_idx)
        warpgroup.wait_group(1)  # S landed; P V may still run
        self.give_kv(io.pipeline_k, state)
        apply_to_scores(self.variant, acc_mn_view(acc_S), mma.tScS_mn, tile.ctx, row0, n_block * self.tile_n,
                        self.qhead_per_kvhead_packed, tile.softmax_scale, masked)
        row_scale = mma.softmax.step(acc_S, ex2_emulate_every=0 if masked else self.ex2_emulate_every)
        warpgroup.wait_group(0)  # P V landed: acc_O and tOrP are free
        self.give_v(io, state_v)
        self.softmax(mma, acc_S, row_scale, pv + 1)
        return state

    @cute.jit
    def take_k(self, mma: "_MmaState", io: "_Io", state):
        """``take`` of K. Its widened buffer's last reader, the previous Q K^T, ran on each
        warp's tensor core for that warp's rows: a warp's ``wait_group`` covers only its
        own part, so the warps meet before any overwrites the buffer."""
        parts = None
        if cutlass.const_expr(mma.widen is not None):
            parts = (mma.widen.tKs8, mma.widen.tKsK, None)
        return self.take(io.pipeline_k, state, parts, None, True)

    @cute.jit
    def take_v(self, mma: "_MmaState", io: "_Io", state, tile: FwdTile, n_block, last: cutlass.Constexpr = False):
        """``take`` of V of block ``n_block``. FP8 over a cache whose tail may hold garbage:
        rows past the sequence end are zeroed as they are widened (``zero_v_tail`` for
        16-bit stages). The buffer's last reader, the previous P V, is known complete in
        every warp through ``take_k``'s meeting, except before the ``last`` P V."""
        if cutlass.const_expr(self.fp8_qkv):
            io.pipeline_vt.consumer_wait(state)  # the transposes fenced their stores
            return state.index
        parts, rows_valid = None, None
        if cutlass.const_expr(mma.widen is not None):
            parts = (mma.widen.tVs8, mma.widen.tVsV, mma.widen.tVcV)
            if cutlass.const_expr(self.cache_tail_may_be_garbage):
                rows_valid = tile.ctx.seqlen_k - n_block * self.tile_n
        return self.take(io.pipeline_v, state, parts, rows_valid, last)

    @cute.jit
    def take(self, pipe, state, parts, rows_valid, meet: cutlass.Constexpr):
        """Waits for a K/V stage; returns the stage index the wgmma reads. FP8 (``parts``:
        this thread's chunks of the fp8 stages, of the 16-bit buffer and of the tile's
        coordinates): the block is widened into the 16-bit buffer (index 0), the consumer
        warps meeting between its loads and stores if ``meet``; the stores are fenced for
        the wgmma (async proxy), every consumer thread's part done, and the fp8 stage goes
        back to the producer at once. One warpgroup reads the buffer (``config.fp8_tile``)."""
        kv_wait(pipe, state, self.gather_kv)
        stage = state.index
        if cutlass.const_expr(parts is not None):
            tXs8, tXsX, tXcX = parts
            widen_fp8(tXs8[None, None, None, state.index], tXsX, self.dtype, tXcX, rows_valid,
                      self.consumers_sync if cutlass.const_expr(meet) else None)
            cute.arch.fence_view_async_shared()
            self.consumers_sync()
            kv_release(pipe, state, self.gather_kv)
            stage = 0
        return stage

    def give_kv(self, pipe, state):
        """Frees a 16-bit stage once the wgmma that read it completed (fp8 stages were freed
        when widened)."""
        if cutlass.const_expr(not self.fp8):
            kv_release(pipe, state, self.gather_kv)

    def give_v(self, io: "_Io", state):
        """``give_kv`` of V, or of the V^T stage (fp8 Q, K, V: one arrive per warp)."""
        if cutlass.const_expr(self.fp8_qkv):
            kv_release(io.pipeline_vt, state, True)
        else:
            self.give_kv(io.pipeline_v, state)

    @cute.jit
    def softmax(self, mma: "_MmaState", acc_S, row_scale, pv=None):
        """P in the RS operand registers, O rescaled before P V number ``pv``, the one of
        this P (or its correction carried to it); without ``row_scale`` (first block) the
        softmax step runs here and O, still zero, needs no rescale."""
        first = cutlass.const_expr(row_scale is None)
        if cutlass.const_expr(first):
            row_scale = mma.softmax.step(acc_S)
        if cutlass.const_expr(self.fp8_qkv):
            p_to_fp8(acc_S, mma.tOrP)
        else:
            convert_pairs(acc_S, cute.make_tensor(mma.tOrP.iterator, acc_S.layout))
        if cutlass.const_expr(mma.scale_carry is not None):
            mma.scale_carry.store(row_scale.load())
        elif cutlass.const_expr(not first):
            self.rescale_o(mma, row_scale, pv)

    @cute.jit
    def zero_v_tail(self, pipeline_v, state, sV, rows_valid, cidx):
        """Zeroes the V rows of the first block past the sequence end. A KV cache holds
        whatever was there past seqused_k (the TMA box reads it); P is 0 there, but 0 * NaN
        is NaN. K needs nothing: its scores are masked to -inf."""
        if rows_valid < self.tile_n:
            kv_wait(pipeline_v, state, self.gather_kv)
            zero_rows_from(sV[None, None, state.index], rows_valid, cidx, self.roles.consumer_threads)
            # Generic-proxy stores, read next by wgmma (async proxy), by every warpgroup.
            cute.arch.fence_view_async_shared()
            self.consumers_sync()

    @cute.jit
    def rescale_carried(self, mma: "_MmaState", pv):
        """The deferred rescale of O (rescale_o_before_pv), just before its next P V, the
        tile's number ``pv``."""
        if cutlass.const_expr(mma.scale_carry is not None):
            self.rescale_o(mma, mma.scale_carry, pv)

    @cute.jit
    def rescale_o(self, mma: "_MmaState", row_scale, pv):
        """O's rows times the softmax's correction before P V number ``pv``; two-level:
        ``TwoLevelPV.rescale`` (a flush where that P V starts a group)."""
        if cutlass.const_expr(mma.two_level is not None):
            mma.two_level.rescale(mma.acc_O, row_scale, pv)
        else:
            mma.softmax.rescale_o(mma.acc_O, row_scale)

    def pv_accumulates(self, mma: "_MmaState", pv):
        """P V number ``pv``'s scale-d predicate under two-level accumulation (None: it always
        accumulates into O)."""
        return None if mma.two_level is None else mma.two_level.accumulates(pv)

    def consumers_sync(self):
        """Every consumer thread meets (``Sm90FwdBarrier.CONSUMERS``)."""
        cute.arch.barrier(barrier_id=int(Sm90FwdBarrier.CONSUMERS), number_of_threads=self.roles.consumer_threads)

    @cute.jit
    def scheduler_open(self, wg_idx):
        """The first warpgroup opens its own turn."""
        if cutlass.const_expr(self.use_scheduler_barrier):
            if wg_idx == 0:
                cute.arch.barrier_arrive(barrier_id=int(Sm90FwdBarrier.SCHEDULER), number_of_threads=2 * 128)

    def scheduler_sync(self, wg_idx):
        if cutlass.const_expr(self.use_scheduler_barrier):
            cute.arch.barrier(barrier_id=int(Sm90FwdBarrier.SCHEDULER) + wg_idx, number_of_threads=2 * 128)

    def scheduler_arrive(self, wg_idx):
        if cutlass.const_expr(self.use_scheduler_barrier):
            nxt = wg_idx + 1
            if cutlass.const_expr(self.roles.num_consumer_wgs == 2):
                nxt = 1 - wg_idx
            else:
                nxt = nxt - self.roles.num_consumer_wgs * (nxt // self.roles.num_consumer_wgs)
            cute.arch.barrier_arrive(barrier_id=int(Sm90FwdBarrier.SCHEDULER) + nxt, number_of_threads=2 * 128)

    @cute.jit
    def load_q_packed(self, args: FwdArgs, io: "_Io", tile: FwdTile, cidx):
        """Packed-GQA Q tile gathered row by row with cp.async by the consumers themselves,
        rows past the sequence zero-filled; then made visible to wgmma (async proxy)."""
        q_rows = tile.q_rows(args.mQ, self.qhead_per_kvhead_packed, args.varlen_q)
        thr_copy = io.gmem_copy_Q.get_slice(cidx)
        tQsQ = thr_copy.partition_D(io.sQ)
        tQcQ = thr_copy.partition_S(cute.make_identity_tensor((self.tile_m, self.head_dim)))
        row0 = tile.m_block * self.tile_m
        copy_rows(io.gmem_copy_Q, tQsQ, tQcQ, lambda row, m: q_rows[row0 + row, None], tile.rows_valid,
                  self.head_dim_valid)
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        cute.arch.fence_view_async_shared()
        self.consumers_sync()

    @cute.jit
    def load_q_quantized(self, args: FwdArgs, io: "_Io", tile: FwdTile, cidx) -> Float32:
        """quantize_q: the tile's 16-bit Q rows (packed under GQA) loaded by the consumers into
        registers, rows past the sequence zero, and stored into sQ in e4m3 as Q / 2^e
        (``q_quant.quantize_q_tile``: one power-of-two scale per tile); returns 2^e."""
        q_rows = tile.q_rows(args.mQ, self.qhead_per_kvhead_packed, args.varlen_q)
        return quantize_q_tile(((q_rows, io.sQ),), tile.m_block * self.tile_m, io.sQAmax, tile.rows_valid,
                               self.head_dim_valid, cidx, self.roles.consumer_threads, self.consumers_sync)

    # -----------------------------------------------------------------------------------
    # Epilogue
    # -----------------------------------------------------------------------------------

    @cute.jit
    def epilogue(self, args: FwdArgs, io: "_Io", acc_O, lse, tile: FwdTile, tiled_mma_pv, cidx):
        """O through smem and one TMA store (``use_tma_o``), else straight from registers
        two columns per store; the LSE from registers."""
        thr_mma_pv = tiled_mma_pv.get_slice(cidx)
        tOcO_mn = acc_mn_view(thr_mma_pv.partition_C(cute.make_identity_tensor((self.tile_m, self.head_dim_v))))
        row0 = tile.m_block * self.tile_m
        packed = self.qhead_per_kvhead_packed
        if cutlass.const_expr(self.use_tma_o):
            self.store_o_tma(acc_O, io, tiled_mma_pv, cidx, tile)
        else:
            store_o(acc_O, self.out_dtype, tOcO_mn, tile.out_rows(io.tma_O, packed, self.is_split, args.varlen_q),
                    row0, tile.rows_valid, pairs_copied=True, cols_valid=self.head_dim_v_valid)
        if cutlass.const_expr(args.mLSE is not None):
            store_lse(lse, tOcO_mn, tile.lse_rows(args.mLSE, packed, self.is_split, args.varlen_q), row0,
                      tile.rows_valid)

    @cute.jit
    def store_o_tma(self, acc_O, io: "_Io", tiled_mma_pv, cidx, tile: FwdTile):
        """registers -> smem (stmatrix) -> gmem (one TMA store; rows past the sequence are
        outside the tensor and clipped by the copy engine)."""
        rO = cute.make_fragment_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        # sO is Q's buffer: every warpgroup's last Q K^T completed before O overwrites it. Or
        # its own (separate_o): the last tile's TMA store read it (its issuer waited).
        self.consumers_sync()
        stsm = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        thr_copy = cute.make_tiled_copy_C(stsm, tiled_mma_pv).get_slice(cidx)
        cute.copy(thr_copy, thr_copy.retile(rO), thr_copy.partition_D(io.sO))
        # Generic-proxy writes, read next by the copy engine (async proxy).
        cute.arch.fence_view_async_shared()
        self.consumers_sync()
        if cidx < 32:
            gO = cute.local_tile(io.tma_O[None, None, tile.ctx.head, tile.ctx.batch], (self.tile_m, self.head_dim_v),
                                 (tile.m_block, 0))
            tOsO, tOgO = cpasync.tma_partition(
                io.tma_atom_O, 0, cute.make_layout(1), cute.group_modes(io.sO, 0, 2), cute.group_modes(gO, 0, 2)
            )
            cute.copy(io.tma_atom_O, tOsO, tOgO)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)


@dataclass(frozen=True)
class _Io:
    """What the roles load and store through: the gmem views (TMA views, or the tensors
    themselves where no TMA applies), their TMA atoms (None without TMA), the smem tiles
    (sO: Q's buffer, or its own with ``separate_o``), the pipelines guarding Q, K and V,
    and the consumers' cp.async copy of packed Q rows."""

    tma_Q: cute.Tensor
    tma_K: cute.Tensor
    tma_V: cute.Tensor
    tma_O: cute.Tensor
    tma_atom_Q: Optional[cute.CopyAtom]
    tma_atom_K: Optional[cute.CopyAtom]
    tma_atom_V: Optional[cute.CopyAtom]
    tma_atom_O: Optional[cute.CopyAtom]
    sQ: cute.Tensor
    sK: cute.Tensor  # (tile_n, d, stages)
    sV: cute.Tensor  # (tile_n, d_v, stages)
    sO: cute.Tensor
    pipeline_q: object
    pipeline_k: object
    pipeline_v: object
    gmem_copy_Q: cute.TiledCopy
    sKw: Optional[cute.Tensor]  # fp8: the widened K block (tile_n, d, 1) the wgmma reads; else None
    sVw: Optional[cute.Tensor]
    sVt: Optional[cute.Tensor]  # fp8 Q, K, V: V^T stages (d_v, tile_n, stages) the P V wgmma reads; else None
    sV_addr: Optional[Int32]  # fp8 Q, K, V: shared-window addresses of the V and V^T stages, for the transposes
    sVt_addr: Optional[Int32]
    pipeline_vt: object  # fp8 Q, K, V: the V^T stages (transposing warps -> consumers); else None
    sQAmax: Optional[cute.Tensor]  # quantize_q: one fp32 word per consumer warp (the Q tile's amax); else None


@dataclass(frozen=True)
class _Sched:
    """The grid's tiles, for ``work_at``: M blocks, head groups (``heads_eff``: KV heads
    under pack_gqa), and (head, batch) pairs per L2 section of the LPT order."""

    num_m_blocks: Int32
    grid_divisors: TileDivisors  # what tile_work divides the block index by (tile_grid)
    heads: Int32
    l2_heads: Int32
    tile_counter: Optional[cute.Tensor]  # dynamic: the launch's (1,) int32 counter
    sTile: Optional[cute.Tensor]  # dynamic: the shared slot of the next tile's index


@dataclass(frozen=True)
class _MmaState:
    """A consumer warpgroup's view of one tile's KV loop: the MMAs, its wgmma fragments
    (descriptors; tOrP the RS view of P's registers), the S coordinates, and what lives
    across the loop: O, the softmax statistics, the correction O still owes
    (``rescale_o_before_pv``; else None) and the second accumulator level (``two_level``)."""

    tiled_mma_qk: cute.TiledMma
    tiled_mma_pv: cute.TiledMma
    tSrQ: cute.Tensor
    tSrK: cute.Tensor
    tOrVt: cute.Tensor
    tOrP: cute.Tensor
    tScS_mn: cute.Tensor
    acc_O: cute.Tensor
    softmax: OnlineSoftmax
    scale_carry: Optional[cute.Tensor]
    widen: Optional["_Widen"]  # fp8 K/V only
    two_level: Optional[TwoLevelPV] = None  # FP8 Q, K, V with a two-level interval


@dataclass(frozen=True)
class _Widen:
    """FP8 K/V: a consumer thread's chunks of the fp8 stages (CPY, M, chunks, stages) and
    of the 16-bit buffers (CPY, M, chunks), and V's tile coordinates (tail rows zeroed)."""

    tKs8: cute.Tensor
    tKsK: cute.Tensor
    tVs8: cute.Tensor
    tVsV: cute.Tensor
    tVcV: cute.Tensor


# ---------------------------------------------------------------------------------------
# Compilation from a compile key (planning: sm90/__init__.py and sm90/config.py).
# ---------------------------------------------------------------------------------------


def fake_tile_counter(key: tuple):
    """A "dynamic" persistent kernel's tile counter (``launch``'s ``mTileCounter``) as a fake
    tensor; None for the others (``sm90._call_tensors`` passes the same)."""
    return fake_tensor(Int32, 1, align=4) if parse_key(key, 4).extra[1] == "dynamic" else None


def compile_fwd_sm90(key: tuple):
    """Compiles the kernel for ``key`` (``sm90.compile_key``) on fake tensors: no GPU needed."""
    return compile_from_key(
        key, 4, lambda dtype, d, dv, tile, variant, packed, is_split, split_blocks, gather_kv, persistent, *rest,
        q_class: FlashAttnFwdSm90(dtype, d, dv, *tile[:3], variant, qhead_per_kvhead_packed=packed, is_split=is_split,
                                  ex2_emulate_every=tile[3], gather_kv=gather_kv, persistent=persistent,
                                  split_blocks=split_blocks, q_class=q_class, **parse_key_extra(rest)),
        extra_scalars=(Int32(1), Int32(1), fake_tile_counter(key)))  # l2_heads, max_ctas, the tile counter
