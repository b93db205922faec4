"""MLA decode for SM90 (Hopper): one producer warpgroup gathering the latent cache by
cp.async, two consumer warpgroups on asynchronous wgmma, each owning half of the
512-wide output (the FA3 layout of seed 000, written for this package).

One CTA computes ``tile_m`` = 64 packed rows (query position x head, heads fastest, as
``pack_gqa`` with one KV head) of one sequence [and one KV split] against the shared
latent cache: K = [ckv (512), kpe (64)], V = ckv. Per KV tile of ``tile_n`` = 32 keys:

    bytes from HBM     32 x (512 + 64) x 2                 = 36.9 KB
    S = Q K^T          64 x 32 x 576 x 2                   = 2.36 MFLOP
    O += P V           64 x 32 x 512 x 2                   = 2.10 MFLOP
    useful work        4.46 MFLOP / 36.9 KB                = 121 FLOP per cache byte

With 64 heads a CTA is one sequence's whole query block, so at 4 TB/s the tensor cores
must sustain ~480 TFLOP/s of useful work: wgmma has to stay busy, which is why the
softmax of tile n overlaps P V of tile n - 1 (the FA3 intra-warpgroup pipeline). 128
heads take two CTAs (two 64-row tiles) per query position, reading the cache through L2.

Roles (``MlaRoles``; setmaxnreg budgets sum to 504 of the 512 a 384-thread CTA may hold):

- warpgroup 0, the **producer** (40 registers): gathers each 32-key tile's ckv and kpe
  rows with 128-bit cp.async (LDGSTS), every row through its own page lookup
  (``paged_kv.page_and_row``, page ids clamped into the pool), so page size 1 costs the
  same as 64. A thread copies 2 rows x (8 + 1) chunks per tile; both lookups are issued
  before the stage is even acquired, so their latency overlaps the wait. Rows past the
  sequence end re-read the last valid key (finite data, in L2): their scores are masked
  to -inf, so P is exactly 0 against finite V and no 0 * NaN can reach O. Each thread
  signals the stage's full mbarrier with a cp.async arrive (``PipelineCpAsync``).
- warpgroups 1-2, the **consumers** (232 registers): each computes a partial S over half
  of the 36 k16 slices (SS wgmma: warpgroup 0 ckv columns 0-255, warpgroup 1 ckv 256-511
  and kpe); the two fp32 partials are summed through shared memory (thread t of either
  warpgroup holds the same S elements, so it is an elementwise exchange behind one named
  barrier, and both sums are bit-identical: fp32 addition commutes). Each then keeps its
  own online softmax of the same S (no statistics exchanged) and computes
  O[:, 256 w : 256 (w + 1)] += P V by RS wgmma, P straight from registers and V the same
  ckv stage (MN-major view). Registers: O 64 x 256 fp32 / 128 threads = 128, S 16, P 8,
  row statistics 6; no spills.

  Tensor work per tile: 36 wgmma 64x32x16 for S (split between the warpgroups) and 4 of
  64x256x16 for P V, 4.46 MFLOP. ``split_qk=False`` lets both warpgroups compute all of S
  instead (6.8 MFLOP, Q read twice from smem, no exchange, a fourth stage); it measured
  15% slower (``MlaRoles.split_qk``) and stays selectable for tuning.

One KV pipeline: K and V are the same ckv tile, so a stage is freed only after the P V
that reads it. The consumer loop holds two stages at once (S of tile n, P V of tile n - 1),
so the third (fourth without the exchange) is in flight from HBM while they work: the
next load never waits on the tile in use (seed 000's reason for 32 x 4 over 64 x 2).

Shared memory (bf16/fp16): Q 64 x 576 x 2 = 72 KB, 3 stages x 36 KB = 108 KB, the S
exchange 2 x 2 x 8 KB = 32 KB, 6 mbarriers: 212 KB of the 227 KB (``split_qk=False``:
4 stages, 216 KB). O leaves straight from registers (2 adjacent columns per store, fp32
partials for split-KV, merged by ``combine.py``), so no O buffer is borrowed.

Measured (H200, 2026-11-29, bf16, 64 heads, page 1, ``benchmarks/bench_mla.py``): 2.87
TB/s at 768 x 2048 (FlashInfer fa3 3.61), 2.82 at 128 x 2048. That is 1.7 us per 32-key
tile per SM against ~0.55 us of wgmma issue for it, so the consumers mostly wait on the
KV pipeline: one stage in flight (37 KB per SM) is too little for the gather latency.
Next step, to be confirmed by ncu: more bytes in flight (Q K^T with Q from registers for
the kpe part or a smaller exchange to free a fourth stage, or TMA for page sizes >= 32).
"""

from dataclasses import dataclass
from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warpgroup

from flash_attn_cute.block_info import BlockInfo
from flash_attn_cute.copy_utils import aligned_row_ptr, gmem_tiled_copy
from flash_attn_cute.cute_utils import CUTE_DTYPE_BY_NAME, compile_options, fake_stream, fake_tensor
from flash_attn_cute.layout_utils import acc_mn_view, acc_to_operand_a, transpose_view
from flash_attn_cute.mla_tile import MlaTile
from flash_attn_cute.pack_gqa import packed_lse_rows, packed_rows
from flash_attn_cute.paged_kv import page_and_row
from flash_attn_cute.sm90.wgmma_utils import convert_pairs, smem_layout, wgmma_gemm
from flash_attn_cute.softmax import LOG2_E, OnlineSoftmax
from flash_attn_cute.tile_scheduler import SingleTileScheduler
from flash_attn_cute.variants import apply_to_scores, make_variant

D_CKV, D_KPE = 512, 64
# Named barriers over the consumer threads (0 is __syncthreads): Q landed; S halves written.
_CONSUMERS_BAR, _XCHG_BAR = 1, 2


@dataclass(frozen=True)
class MlaRoles:
    """Static warp roles, tiles and register budgets (setmaxnreg)."""

    tile_m: int = 64  # packed rows: one wgmma M
    tile_n: int = 32  # keys per stage
    stages: int = 3  # 4 with split_qk=False (the S exchange takes the fourth's smem)
    num_consumer_wgs: int = 2  # each owns D_CKV / num_consumer_wgs output columns
    producer_regs: int = 40
    consumer_regs: int = 232
    # True: each consumer computes S over half of the K dimension (ckv columns 0-255;
    # ckv 256-511 and kpe) and the fp32 halves are summed through shared memory (two
    # 2 x 8 KB buffers, by tile parity): half the Q K^T tensor work and smem reads, one
    # named barrier per tile, one stage less. False: both compute the whole S.
    # H200, 2026-11-29, bf16, 64 heads, page 1: 2.87 against 2.48 TB/s at 768 x 2048,
    # 2.89 against 2.50 at 768 x 1024 (both modes pass every GPU test).
    split_qk: bool = True

    @property
    def producer_threads(self) -> int:
        return 128

    @property
    def consumer_threads(self) -> int:
        return 128 * self.num_consumer_wgs

    @property
    def threads(self) -> int:
        return self.producer_threads + self.consumer_threads

    @property
    def o_cols(self) -> int:
        return D_CKV // self.num_consumer_wgs

    @property
    def xchg_words(self) -> int:
        """fp32 words of the S exchange: (S per thread, 128 threads, 2 warpgroups, 2 buffers)."""
        return 4 * self.tile_m * self.tile_n if self.split_qk else 4

    def smem_bytes(self, elem: int = 2) -> int:
        return elem * (self.tile_m + self.stages * self.tile_n) * (D_CKV + D_KPE) + 4 * self.xchg_words + 4 * 1024

    def __post_init__(self):
        # The launch gives each thread 65536 / 384 registers; setmaxnreg moves them around
        # within the warpgroups' sum (per-warpgroup budgets of 128 threads).
        assert self.producer_regs + self.num_consumer_wgs * self.consumer_regs <= 512
        assert self.tile_m == 64 and self.tile_n % 16 == 0 and self.o_cols <= 256
        assert self.o_cols * self.tile_m // 128 + 40 <= self.consumer_regs, "O half + S, P, stats"
        assert self.smem_bytes() <= 227 * 1024


class MlaDecodeSm90:
    def __init__(self, dtype, nheads: int, causal: bool, is_split: bool, roles: MlaRoles = MlaRoles()):
        self.dtype = dtype
        self.nheads = nheads  # packed rows per query position
        self.variant = make_variant(causal, False, False)
        self.is_split = is_split
        self.out_dtype = Float32 if is_split else dtype
        self.roles = roles

    @cute.jit
    def __call__(self, mQn: cute.Tensor, mQp: cute.Tensor, mCkv: cute.Tensor, mKpe: cute.Tensor, mO: cute.Tensor,
                 mLSE: Optional[cute.Tensor], mSeqlens: cute.Tensor, mPageTable: cute.Tensor,
                 softmax_scale: Float32, num_splits: Int32, max_seqlen_q: Int32, batch_size: Int32, stream):
        """The MLA kernels' runtime contract (``MlaDecodeSm80.__call__``): q_nope / q_pe
        (b, s_q, h, 512 / 64), ckv / kpe (num_pages, page_size, 512 / 64), O (b, s_q, h, 512)
        [fp32 with a leading split mode], LSE (b, h, s_q) [same], lengths (b,), page table
        (b, max_pages) int32, then the scalars."""
        r = self.roles
        layouts = (
            smem_layout(self.dtype, r.tile_m, D_CKV), smem_layout(self.dtype, r.tile_m, D_KPE),
            smem_layout(self.dtype, r.tile_n, D_CKV, r.stages), smem_layout(self.dtype, r.tile_n, D_KPE, r.stages),
        )

        @cute.struct
        class SharedStorage:
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2 * r.stages]
            sQn: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layouts[0])], 1024]
            sQp: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layouts[1])], 1024]
            sC: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layouts[2])], 1024]
            sKp: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layouts[3])], 1024]
            sXchg: cute.struct.Align[cute.struct.MemRange[Float32, r.xchg_words], 16]

        k_major, mn_major = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        # S: one warpgroup-wide 64 x 32 product (both consumers issue it). O: the two
        # consumer warpgroups side by side along N, 64 x 256 each, P from registers.
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, k_major, k_major, Float32, atom_layout_mnk=(1, 1, 1),
            tiler_mn=(r.tile_m, r.tile_n))
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, k_major, mn_major, Float32, atom_layout_mnk=(1, r.num_consumer_wgs, 1),
            tiler_mn=(r.tile_m, r.o_cols), a_source=warpgroup.OperandSource.RMEM)
        num_m_blocks = cute.ceil_div(max_seqlen_q * self.nheads, r.tile_m)
        self.kernel(
            mQn, mQp, mCkv, mKpe, mO, mLSE, mSeqlens, mPageTable, softmax_scale, num_splits,
            layouts[0], layouts[1], layouts[2], layouts[3], tiled_mma_qk, tiled_mma_pv, SharedStorage,
        ).launch(
            grid=SingleTileScheduler.grid(num_m_blocks, 1, num_splits, batch_size),
            block=(r.threads, 1, 1),
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=1,  # a register cap at entry, which setmaxnreg needs
        )

    @cute.kernel
    def kernel(
        self, mQn, mQp, mCkv, mKpe, mO, mLSE, mSeqlens, mPageTable, softmax_scale: Float32, num_splits: Int32,
        sQn_layout: cute.ComposedLayout, sQp_layout: cute.ComposedLayout, sC_layout: cute.ComposedLayout,
        sKp_layout: cute.ComposedLayout, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        r = self.roles
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        # Full: one cp.async arrive per producer thread once its copies landed. Empty: one
        # arrive per consumer warp after the P V that last reads the stage.
        pipeline_kv = pipeline.PipelineCpAsync.create(
            barrier_storage=storage.mbar_kv.data_ptr(), num_stages=r.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, r.producer_threads),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, r.consumer_threads // 32),
            defer_sync=True,
        )
        pipeline.pipeline_init_arrive()
        smem = _Sm90Smem(
            storage.sQn.get_tensor(sQn_layout.outer, swizzle=sQn_layout.inner),
            storage.sQp.get_tensor(sQp_layout.outer, swizzle=sQp_layout.inner),
            storage.sC.get_tensor(sC_layout.outer, swizzle=sC_layout.inner),
            storage.sKp.get_tensor(sKp_layout.outer, swizzle=sKp_layout.inner),
            storage.sXchg.get_tensor(cute.make_layout(r.xchg_words)),
        )
        tile = MlaTile.create(mQn, mCkv, mSeqlens, mPageTable, num_splits,
                              BlockInfo(r.tile_m, r.tile_n, self.nheads, self.variant), self.is_split)
        pipeline.pipeline_init_wait()
        if tile.rows_valid > 0:
            if warp_idx < r.producer_threads // 32:
                cute.arch.setmaxregister_decrease(r.producer_regs)
                if tile.n_tiles > 0:
                    self.load(tile, smem, pipeline_kv, mCkv, mKpe, mPageTable, tidx)
            else:
                cute.arch.setmaxregister_increase(r.consumer_regs)
                self.mma(tile, smem, pipeline_kv, tiled_mma_qk, tiled_mma_pv, mQn, mQp, mO, mLSE, softmax_scale,
                         tidx - r.producer_threads)

    # ------------------------------------------------------------------ producer

    @cute.jit
    def load(self, tile, smem, pipeline_kv, mCkv, mKpe, mPageTable, tidx):
        """Tiles n_max - 1 down to n_min (the first visited is the only one the sequence
        end can cut), one stage each, gathered row by row."""
        r = self.roles
        copy_C = gmem_tiled_copy(self.dtype, D_CKV, r.producer_threads)
        copy_Kp = gmem_tiled_copy(self.dtype, D_KPE, r.producer_threads)
        thr_C, thr_Kp = copy_C.get_slice(tidx), copy_Kp.get_slice(tidx)
        # Both copies lay 8 threads along a row (64-element swizzle atoms), so a thread's
        # ckv rows and kpe rows are the same keys: one page lookup serves both.
        tCcC = thr_C.partition_S(cute.make_identity_tensor((r.tile_n, D_CKV)))
        tKcKp = thr_Kp.partition_S(cute.make_identity_tensor((r.tile_n, D_KPE)))
        tCsC, tKsKp = thr_C.partition_D(smem.sC), thr_Kp.partition_D(smem.sKp)  # (CPY, rows, chunks, stages)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, r.stages)
        for i in cutlass.range(tile.n_tiles, unroll=1):
            key0 = (tile.n_max - 1 - i) * r.tile_n
            rows = cute.size(tCsC, mode=[1])
            tPrPage = cute.make_rmem_tensor((rows,), Int32)
            tPrRow = cute.make_rmem_tensor((rows,), Int32)
            for m in cutlass.range_constexpr(rows):
                key = cutlass.min(key0 + tCcC[0, m, 0][0], tile.ctx.seqlen_k - 1)
                tPrPage[m], tPrRow[m] = page_and_row(mPageTable, tile.ctx.batch, key, mCkv.shape[1], mCkv.shape[0])
            pipeline_kv.producer_acquire(state)
            for m in cutlass.range_constexpr(rows):
                self.gather_row(copy_C, tCsC[None, m, None, state.index], tCcC[None, m, None],
                                mCkv[tPrPage[m], tPrRow[m], None])
                self.gather_row(copy_Kp, tKsKp[None, m, None, state.index], tKcKp[None, m, None],
                                mKpe[tPrPage[m], tPrRow[m], None])
            pipeline_kv.producer_commit(state)
            state.advance()
        # Keep the CTA alive until the consumers released every stage it filled.
        pipeline_kv.producer_tail(state)

    @cute.jit
    def gather_row(self, tiled_copy, tXsX_row, tXcX_row, g_row):
        """This thread's 16-byte chunks of one row: LDGSTS each, aligned source pointers."""
        for k in cutlass.range_constexpr(cute.size(tXsX_row, mode=[1])):
            col = tXcX_row[0, k][1]
            cute.copy(tiled_copy, cute.make_tensor(aligned_row_ptr(g_row, col, 16), tXsX_row[None, k].layout),
                      tXsX_row[None, k])

    # ------------------------------------------------------------------ consumers

    @cute.jit
    def load_q(self, tile, smem, mQn, mQp, cidx):
        """Q rows gathered by the consumers themselves (packed rows: no TMA box), zero past
        the last query; the cp.async and zero stores are made visible to wgmma (async
        proxy) before either warpgroup issues."""
        r = self.roles
        row0 = tile.m_block * r.tile_m
        for mQ, sQ, cols in ((mQn, smem.sQn, D_CKV), (mQp, smem.sQp, D_KPE)):
            copy_Q = gmem_tiled_copy(self.dtype, cols, r.consumer_threads)
            thr_Q = copy_Q.get_slice(cidx)
            tQsQ, tQcQ = thr_Q.partition_D(sQ), thr_Q.partition_S(cute.make_identity_tensor((r.tile_m, cols)))
            q_rows = packed_rows(mQ[tile.ctx.batch, None, None, None], Int32(0), self.nheads)
            for m in cutlass.range_constexpr(cute.size(tQsQ, mode=[1])):
                row = tQcQ[0, m, 0][0]
                if row < tile.rows_valid:
                    self.gather_row(copy_Q, tQsQ[None, m, None], tQcQ[None, m, None], q_rows[row0 + row, None])
                else:
                    tQsQ[None, m, None].fill(0.0)
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=_CONSUMERS_BAR, number_of_threads=r.consumer_threads)

    @cute.jit
    def mma(self, tile, smem, pipeline_kv, tiled_mma_qk, tiled_mma_pv, mQn, mQp, mO, mLSE, softmax_scale: Float32,
            cidx):
        """Consumer warpgroups: their operands and accumulators, Q, the KV loop
        (``mainloop``), the final normalisation and the epilogue."""
        r = self.roles
        wg_idx = cute.arch.make_warp_uniform(cidx // 128)
        # wgmma operands are warpgroup-wide descriptors: partition by the first thread.
        wg_qk = tiled_mma_qk.get_slice(0)
        wg_pv = tiled_mma_pv.get_slice(wg_idx * 128)
        ops = _Sm90Ops(
            tiled_mma_qk, tiled_mma_pv,
            wg_qk.make_fragment_A(wg_qk.partition_A(smem.sQn)), wg_qk.make_fragment_A(wg_qk.partition_A(smem.sQp)),
            wg_qk.make_fragment_B(wg_qk.partition_B(smem.sC)), wg_qk.make_fragment_B(wg_qk.partition_B(smem.sKp)),
            wg_pv.make_fragment_B(wg_pv.partition_B(transpose_view(smem.sC))),
            acc_mn_view(tiled_mma_qk.get_slice(cidx % 128).partition_C(
                cute.make_identity_tensor((r.tile_m, r.tile_n)))),
            smem.sXchg,
        )
        # P in 16 bits laid out like S (pairwise conversion), read through the A view.
        rP = cute.make_rmem_tensor(tiled_mma_qk.partition_shape_C((r.tile_m, r.tile_n)), self.dtype)
        tOrP = acc_to_operand_a(rP)
        acc_O = cute.make_rmem_tensor(tiled_mma_pv.partition_shape_C((r.tile_m, D_CKV)), Float32)
        acc_O.fill(0.0)
        softmax = OnlineSoftmax(cute.size(ops.tScS_mn, mode=[0]), Float32(softmax_scale * LOG2_E))
        # The correction O still owes, applied just before the next P V (loop-carried):
        # rescaling 128 registers while Q K^T runs keeps it off the critical path.
        scale_carry = cute.make_rmem_tensor((softmax.num_rows,), Float32)
        scale_carry.fill(1.0)

        self.load_q(tile, smem, mQn, mQp, cidx)
        if tile.n_tiles > 0:
            self.mainloop(tile, ops, pipeline_kv, softmax, acc_O, tOrP, scale_carry, softmax_scale, cidx)
        lse = cute.make_rmem_tensor((softmax.num_rows,), Float32)
        softmax.finalize(acc_O, lse)
        self.epilogue(tile, acc_O, lse, ops, mO, mLSE, cidx, wg_idx)

    @cute.jit
    def mainloop(self, tile, ops, pipeline_kv, stats: OnlineSoftmax, acc_O, tOrP, scale_carry,
                 softmax_scale: Float32, cidx):
        """Tiles n_max - 1 down to n_min: S(n) by SS wgmma in flight with O += P(n+1) V(n+1)
        by RS wgmma, the softmax of S(n) while P V still runs."""
        r = self.roles
        wg_idx = cute.arch.make_warp_uniform(cidx // 128)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, r.stages)
        self.kv_wait(pipeline_kv, state)
        acc_S = self.qk(ops, state.index, wg_idx)
        warpgroup.wait_group(0)
        self.sum_s_halves(ops, acc_S, wg_idx, cidx, 0)
        self.softmax(ops, tile, stats, acc_S, tOrP, None, tile.n_max - 1, softmax_scale)
        for i in cutlass.range(tile.n_tiles - 1, unroll=1):
            state_v = state.clone()
            state.advance()
            self.kv_wait(pipeline_kv, state)
            acc_S = self.qk(ops, state.index, wg_idx)
            self.rescale_o(stats, acc_O, scale_carry)
            wgmma_gemm(ops.mma_pv, acc_O, tOrP, ops.tOrVt[None, None, None, state_v.index], False, -1)
            warpgroup.wait_group(1)  # S landed (the older group); P V may still run
            self.sum_s_halves(ops, acc_S, wg_idx, cidx, (i + 1) % 2)
            self.softmax(ops, tile, stats, acc_S, None, scale_carry, tile.n_max - 2 - i, softmax_scale)
            warpgroup.wait_group(0)  # P V landed: tOrP and the stage are free
            self.kv_release(pipeline_kv, state_v)
            convert_pairs(acc_S, cute.make_tensor(tOrP.iterator, acc_S.layout))
        self.rescale_o(stats, acc_O, scale_carry)
        wgmma_gemm(ops.mma_pv, acc_O, tOrP, ops.tOrVt[None, None, None, state.index], False, 0)
        self.kv_release(pipeline_kv, state)

    @cute.jit
    def rescale_o(self, stats: OnlineSoftmax, acc_O, scale_carry):
        """O *= the carried correction (a method call on ``stats`` inside the loop body
        would make the DSL carry the Python object through the loop)."""
        stats.rescale_o(acc_O, scale_carry)

    @cute.jit
    def qk(self, ops, stage, wg_idx):
        """Issues S = Qn ckv^T + Qp kpe^T (or this warpgroup's half of its K slices) as one
        wgmma group; returns the accumulator, still in flight."""
        acc_S = cute.make_rmem_tensor(ops.mma_qk.partition_shape_C((self.roles.tile_m, self.roles.tile_n)), Float32)
        n_slices, p_slices = cute.size(ops.tSrQn, mode=[2]), cute.size(ops.tSrQp, mode=[2])
        if cutlass.const_expr(not self.roles.split_qk):
            self.issue_qk(ops, acc_S, stage, ((0, n_slices), (0, p_slices)))
        elif wg_idx == 0:
            self.issue_qk(ops, acc_S, stage, ((0, n_slices // 2), (0, 0)))
        else:
            self.issue_qk(ops, acc_S, stage, ((n_slices // 2, n_slices), (0, p_slices)))
        return acc_S

    @cute.jit
    def issue_qk(self, ops, acc_S, stage, k_ranges: cutlass.Constexpr):
        """wgmma over k16 slices [lo, hi) of (Qn, ckv) then of (Qp, kpe), one commit group."""
        warpgroup.fence()
        atom = cute.make_mma_atom(ops.mma_qk.op)  # fresh: its ACCUMULATE field is rewritten
        atom.set(warpgroup.Field.ACCUMULATE, False)
        for (lo, hi), tSrA, tSrB in zip(k_ranges, (ops.tSrQn, ops.tSrQp), (ops.tSrC, ops.tSrKp)):
            for k in cutlass.range_constexpr(lo, hi):
                cute.gemm(atom, acc_S, tSrA[None, None, k], tSrB[None, None, k, stage], acc_S)
                atom.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

    @cute.jit
    def sum_s_halves(self, ops, acc_S, wg_idx, cidx, buf):
        """split_qk: S = own half + the other warpgroup's, through shared memory. Thread t
        of either warpgroup holds the same S elements, so the exchange is elementwise; the
        sums are bit-identical in both (fp32 addition commutes). Two buffers by tile
        parity: a warpgroup rewrites buffer b only after the next tile's barrier, which
        the other passes only after reading b."""
        if cutlass.const_expr(self.roles.split_qk):
            n = cute.size(acc_S)
            t = cidx % 128
            sX = cute.make_tensor(ops.sXchg.iterator,
                                  cute.make_layout((n, 128, 2, 2), stride=(128, 1, 128 * n, 256 * n)))
            for v in cutlass.range_constexpr(n):
                sX[v, t, wg_idx, buf] = acc_S[v]
            cute.arch.barrier(barrier_id=_XCHG_BAR, number_of_threads=self.roles.consumer_threads)
            for v in cutlass.range_constexpr(n):
                acc_S[v] = acc_S[v] + sX[v, t, 1 - wg_idx, buf]

    @cute.jit
    def softmax(self, ops, tile, softmax: OnlineSoftmax, acc_S, tOrP, scale_carry, n_block, softmax_scale: Float32):
        """Masks block n_block where it needs it (sequence end, causal diagonal) and folds
        it into the running statistics. With ``tOrP`` (first block: nothing in flight) P
        goes to the operand registers at once; else the correction is carried and P is
        converted once the P V reading the previous P landed."""
        r = self.roles
        if n_block >= tile.n_mid_hi or n_block < tile.n_mid_lo:
            apply_to_scores(self.variant, acc_mn_view(acc_S), ops.tScS_mn, tile.ctx, tile.m_block * r.tile_m,
                            n_block * r.tile_n, self.nheads, softmax_scale, True)
        row_scale = softmax.step(acc_S)
        if cutlass.const_expr(tOrP is not None):
            convert_pairs(acc_S, cute.make_tensor(tOrP.iterator, acc_S.layout))
        if cutlass.const_expr(scale_carry is not None):
            scale_carry.store(row_scale.load())
        return row_scale

    @cute.jit
    def kv_wait(self, pipeline_kv, state):
        """Gathered rows were written by cp.async (generic proxy); wgmma reads shared
        memory through the async proxy, hence the fence after the wait."""
        pipeline_kv.consumer_wait(state)
        cute.arch.fence_view_async_shared()

    @cute.jit
    def kv_release(self, pipeline_kv, state):
        if cute.arch.lane_idx() == 0:  # one arrive per consumer warp
            pipeline_kv.consumer_release(state)

    @cute.jit
    def epilogue(self, tile, acc_O, lse, ops, mO, mLSE, cidx, wg_idx):
        """Each warpgroup stores its 256 columns from registers (vectors of the two
        adjacent columns a thread holds), rows past the last query skipped; warpgroup 0
        writes the LSE (both hold the same)."""
        r = self.roles
        if cutlass.const_expr(self.is_split):
            mO = mO[tile.split_idx, None, None, None, None]
        o_rows = packed_rows(mO[tile.ctx.batch, None, None, None], Int32(0), self.nheads)
        rO = cute.make_fragment_like(acc_O, self.out_dtype)
        rO.store(acc_O.load().to(self.out_dtype))
        rO_mn = acc_mn_view(rO)
        tOcO_mn = acc_mn_view(ops.mma_pv.get_slice(cidx).partition_C(cute.make_identity_tensor((r.tile_m, D_CKV))))
        # A thread's columns in a row: pairs (stride 1) every 8 columns.
        g_cols = cute.make_layout(rO_mn[0, None].shape, stride=((1, 8, 0),))
        row0 = tile.m_block * r.tile_m
        for i in cutlass.range_constexpr(cute.size(rO_mn, mode=[0])):
            row = tOcO_mn[i, 0][0]
            if row < tile.rows_valid:
                dst = aligned_row_ptr(o_rows[row0 + row, None], tOcO_mn[i, 0][1], 2 * self.out_dtype.width // 8)
                cute.autovec_copy(rO_mn[i, None], cute.make_tensor(dst, g_cols))
        if cutlass.const_expr(mLSE is not None):
            if cutlass.const_expr(self.is_split):
                mLSE = mLSE[tile.split_idx, None, None, None]
            lse_rows = packed_lse_rows(mLSE[tile.ctx.batch, None, None], Int32(0), self.nheads)
            if wg_idx == 0 and ops.tScS_mn[0, 0][1] == 0:
                for i in cutlass.range_constexpr(cute.size(lse)):
                    row = ops.tScS_mn[i, 0][0]
                    if row < tile.rows_valid:
                        lse_rows[row0 + row] = lse[i]


@dataclass(frozen=True)
class _Sm90Smem:
    sQn: cute.Tensor  # (64, 512)
    sQp: cute.Tensor  # (64, 64)
    sC: cute.Tensor  # (tile_n, 512, stages): K's first 512 columns and V
    sKp: cute.Tensor  # (tile_n, 64, stages)
    sXchg: cute.Tensor  # flat fp32, see MlaRoles.split_qk


@dataclass(frozen=True)
class _Sm90Ops:
    """The consumers' MMAs, wgmma operand fragments (descriptors) and S coordinates."""

    mma_qk: cute.TiledMma
    mma_pv: cute.TiledMma
    tSrQn: cute.Tensor
    tSrQp: cute.Tensor
    tSrC: cute.Tensor  # (.., stages)
    tSrKp: cute.Tensor
    tOrVt: cute.Tensor  # this warpgroup's 256 columns of V^T, (.., stages)
    tScS_mn: cute.Tensor
    sXchg: cute.Tensor


# ---------------------------------------------------------------------------------------
# Host side: compile key -> binary on fake tensors (planning and launch: sm90/mla.py).
# ---------------------------------------------------------------------------------------


def mla_key(arch: str, dtype_name: str, nheads: int, causal: bool, is_split: bool, has_lse: bool,
            roles: MlaRoles = MlaRoles()) -> tuple:
    return ("mla_sm90", arch, dtype_name, int(nheads), bool(causal), bool(is_split), bool(has_lse),
            (roles.tile_n, roles.stages, roles.split_qk))


def compile_mla_sm90(key: tuple):
    """Compiles the kernel for ``key`` (``mla_key``) on fake tensors: no GPU needed."""
    _, arch, dtype_name, nheads, causal, is_split, has_lse, (tile_n, stages, split_qk) = key
    dtype = CUTE_DTYPE_BY_NAME[dtype_name]
    lead = (None,) if is_split else ()  # the split mode of the partials
    specs = [(dtype, (None, None, nheads, D_CKV)), (dtype, (None, None, nheads, D_KPE)),
             (dtype, (None, None, D_CKV)), (dtype, (None, None, D_KPE)),
             (cutlass.Float32 if is_split else dtype, lead + (None, None, nheads, D_CKV))]
    tensors = [fake_tensor(dt, len(shape), shape=shape) for dt, shape in specs]
    tensors.append(fake_tensor(cutlass.Float32, len(lead) + 3, align=4) if (has_lse or is_split) else None)
    tensors += [fake_tensor(cutlass.Int32, rank, align=4) for rank in (1, 2)]
    kernel = MlaDecodeSm90(dtype, nheads, causal, is_split, MlaRoles(tile_n=tile_n, stages=stages, split_qk=split_qk))
    one = cutlass.Int32(1)
    return cute.compile(kernel, *tensors, cutlass.Float32(1.0), one, one, one, fake_stream(),
                        options=compile_options(arch))
