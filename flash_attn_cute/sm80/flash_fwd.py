"""FlashAttention-2 style forward kernel for SM80 (mma.sync m16n8k16, ldmatrix, cp.async).

It also runs on SM90 and later: every instruction it uses exists there.

One CTA computes a (tile_m x d_v) block of O for one (batch, head[, split]). It walks
its KV blocks from the last to the first, so only the first block visited can be
cut by the end of the sequence; the variant decides which blocks need a mask and
which can be skipped outright. K and V each have one shared-memory buffer: V(n)
streams in while S = Q K(n)^T is computed, K(n-1) while P V(n) is.

Every global row is addressed through a row function, so the same load handles
batch tensors, packed (varlen) tensors, query heads packed into the M tile
(pack_gqa) and paged KV caches (a page-table lookup per row).
"""

import functools
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warp

from flash_attn_cute.block_info import BlockInfo
from flash_attn_cute.copy_utils import aligned_row_ptr, gmem_tiled_copy
from flash_attn_cute.fwd_kernel import FwdArgs, compile_from_key, fwd_call, set_fwd_config
from flash_attn_cute.pack_gqa import packed_lse_rows, packed_rows
from flash_attn_cute.paged_kv import paged_row_fns
from flash_attn_cute.seqlen_info import SeqlenInfo
from flash_attn_cute.softmax import LOG2_E, OnlineSoftmax, acc_mn_view, acc_to_operand_a
from flash_attn_cute.sm80.gemm import gemm_rs, gemm_ss
from flash_attn_cute.tile_scheduler import SingleTileScheduler
from flash_attn_cute.variants import AttentionVariant, AttnCtx, apply_to_scores


def _smem_layout(dtype, rows: int, cols: int):
    """Swizzled (rows, cols) tile: 8-row atoms 64 (or 32) columns wide so that ldmatrix
    and the 128-bit cp.async writes are both bank-conflict free."""
    atom_cols = 64 if cols % 64 == 0 else 32
    atom = cute.make_composed_layout(
        cute.make_swizzle(3 if atom_cols == 64 else 2, 3, 3),
        0,
        cute.make_layout((8, atom_cols), stride=(atom_cols, 1)),
    )
    return cute.tile_to_shape(atom, (rows, cols), (0, 1))


class FlashAttnFwdSm80:
    __call__ = fwd_call  # the forward kernels' shared entry point: FwdArgs -> launch

    def __init__(self, dtype, head_dim: int, head_dim_v: int, tile_m: int, tile_n: int, num_warps: int,
                 variant: AttentionVariant, qhead_per_kvhead_packed: int = 1, is_split: bool = False,
                 q_in_regs: bool = False):
        set_fwd_config(self, dtype, head_dim, head_dim_v, variant, qhead_per_kvhead_packed, is_split)
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.num_threads = num_warps * 32
        # Q in registers for the whole KV loop removes Q's ldmatrix traffic, a fifth of
        # the shared-memory reads of each block, at the cost of its fragment's registers.
        self.q_in_regs = q_in_regs
        assert head_dim % 32 == 0 and head_dim_v % 32 == 0
        assert tile_m % (16 * num_warps) == 0 and tile_n % 16 == 0

    @cute.jit
    def launch(self, args: FwdArgs, stream):
        sQ_layout = _smem_layout(self.dtype, self.tile_m, self.head_dim)
        sK_layout = _smem_layout(self.dtype, self.tile_n, self.head_dim)
        sV_layout = _smem_layout(self.dtype, self.tile_n, self.head_dim_v)

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]

        tiled_mma = cute.make_tiled_mma(
            warp.MmaF16BF16Op(self.dtype, Float32, (16, 8, 16)),
            (self.num_threads // 32, 1, 1),
            permutation_mnk=(self.num_threads // 32 * 16, 16, 16),
        )
        heads_q, heads_kv = args.heads()
        heads_rows = heads_kv if cutlass.const_expr(self.pack > 1) else heads_q
        num_m_blocks = cute.ceil_div(args.max_seqlen_q * self.pack, self.tile_m)
        self.kernel(
            args, (sQ_layout, sK_layout, sV_layout),
            gmem_tiled_copy(self.dtype, self.head_dim, self.num_threads),
            gmem_tiled_copy(self.dtype, self.head_dim_v, self.num_threads),
            tiled_mma,
            SharedStorage,
        ).launch(
            grid=SingleTileScheduler.grid(num_m_blocks, heads_rows, args.num_splits, args.batch_size),
            block=(self.num_threads, 1, 1),
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        args: FwdArgs,
        smem_layouts: tuple,  # Q, K, V
        gmem_copy_QK: cute.TiledCopy,
        gmem_copy_V: cute.TiledCopy,
        tiled_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        sQ_layout, sK_layout, sV_layout = smem_layouts
        mQ, mK, mV, mO, mLSE = args.mQ, args.mK, args.mV, args.mO, args.mLSE
        mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mPageTable = args.mCuSeqlensQ, args.mCuSeqlensK, args.mSeqUsedK, args.mPageTable
        softmax_scale, num_splits = args.softmax_scale, args.num_splits
        tidx, _, _ = cute.arch.thread_idx()
        work = SingleTileScheduler.get_work(num_splits)
        varlen_q = cutlass.const_expr(mCuSeqlensQ is not None)
        varlen_k = cutlass.const_expr(mCuSeqlensK is not None)
        paged = cutlass.const_expr(mPageTable is not None)
        if cutlass.const_expr(self.pack > 1):
            head_kv = work.head
        else:
            head_kv = work.head // (mQ.shape[cute.rank(mQ) - 2] // mK.shape[cute.rank(mK) - 2])
        seqlen = SeqlenInfo.create_for(work.batch, mQ, mK, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mPageTable)
        rows_valid = seqlen.seqlen_q * self.pack - work.m_block * self.tile_m
        if rows_valid > 0:
            ctx = args.variant_ctx(work.batch, work.head, seqlen.seqlen_q, seqlen.seqlen_k,
                                   self.variant.has_score_mod)
            tile = _Tile(ctx, seqlen, work.m_block, head_kv, work.split_idx, rows_valid, softmax_scale)
            self.attend(
                tile, num_splits, mQ, mK, mV, mO, mLSE, mPageTable,
                sQ_layout, sK_layout, sV_layout, gmem_copy_QK, gmem_copy_V, tiled_mma, SharedStorage,
                varlen_q, varlen_k, paged, tidx,
            )

    @cute.jit
    def attend(
        self, tile, num_splits, mQ, mK, mV, mO, mLSE, mPageTable,
        sQ_layout, sK_layout, sV_layout, gmem_copy_QK, gmem_copy_V, tiled_mma, SharedStorage,
        varlen_q: cutlass.Constexpr, varlen_k: cutlass.Constexpr, paged: cutlass.Constexpr, tidx,
    ):
        ctx, seqlen, m_block = tile.ctx, tile.seqlen, tile.m_block
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sQ_layout)
        sK = storage.sK.get_tensor(sK_layout)
        sV = storage.sV.get_tensor(sV_layout)
        # (d_v, tile_n) view of V: the B operand of O += P V.
        sVt = cute.composition(
            sV, cute.make_layout((self.head_dim_v, self.tile_n), stride=(self.tile_n, 1))
        )

        # Q rows of this head group (packed under pack_gqa): row index -> (d,) gmem row.
        packed = self.pack
        mQ_rows = packed_rows(seqlen.q_view(mQ, ctx.batch, varlen_q), tile.head_rows(packed), packed)
        q_rows = lambda r: mQ_rows[r, None]

        block_info = BlockInfo(self.tile_m, self.tile_n, self.pack, self.variant)
        n_block_min, n_block_max = block_info.get_n_block_min_max(
            m_block, ctx, tile.split_idx, num_splits, self.is_split
        )
        n_mid_hi, n_mid_lo = block_info.get_n_block_runs(m_block, ctx, n_block_min, n_block_max)

        thr_copy_QK = gmem_copy_QK.get_slice(tidx)
        thr_copy_V = gmem_copy_V.get_slice(tidx)
        tQsQ = thr_copy_QK.partition_D(sQ)
        tQcQ = thr_copy_QK.partition_S(cute.make_identity_tensor((self.tile_m, self.head_dim)))
        k_src, v_src = self.kv_sources(mK, mV, mPageTable, ctx.batch, seqlen, tile.head_kv, varlen_k, paged,
                                       thr_copy_QK, thr_copy_V)
        kv = _KVLoader(
            gmem_copy_QK, gmem_copy_V,
            thr_copy_QK.partition_D(sK),
            thr_copy_QK.partition_S(cute.make_identity_tensor((self.tile_n, self.head_dim))),
            thr_copy_V.partition_D(sV),
            thr_copy_V.partition_S(cute.make_identity_tensor((self.tile_n, self.head_dim_v))),
            k_src, v_src,
        )

        thr_mma = tiled_mma.get_slice(tidx)
        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype)
        smem_thr_copy_Q = cute.make_tiled_copy_A(ldsm, tiled_mma).get_slice(tidx)
        smem_thr_copy_K = cute.make_tiled_copy_B(ldsm, tiled_mma).get_slice(tidx)
        smem_thr_copy_V = cute.make_tiled_copy_B(ldsm_t, tiled_mma).get_slice(tidx)
        mma = _MmaOperands(
            tiled_mma,
            thr_mma.make_fragment_A(thr_mma.partition_A(sQ)),
            thr_mma.make_fragment_B(thr_mma.partition_B(sK)),
            thr_mma.make_fragment_B(thr_mma.partition_B(sVt)),
            smem_thr_copy_Q.partition_S(sQ),
            smem_thr_copy_K.partition_S(sK),
            smem_thr_copy_V.partition_S(sVt),
            smem_thr_copy_Q, smem_thr_copy_K, smem_thr_copy_V,
            # Identity coordinates of this thread's S elements, for masks and score mods.
            acc_mn_view(thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))),
        )
        acc_O = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.tile_m, self.head_dim_v)), Float32)
        acc_O.fill(0.0)

        has_mod = cutlass.const_expr(self.variant.has_score_mod)
        # With a score modifier the kernel scales S before calling it; otherwise the
        # scale folds into the exp2 argument (one FFMA per score).
        scale_log2 = LOG2_E if has_mod else tile.softmax_scale * LOG2_E
        softmax = OnlineSoftmax(acc_O.shape[0][0] * acc_O.shape[1], Float32(scale_log2))

        # Prologue: Q, then the last K block (the only one the sequence end may cut).
        self.load_rows(gmem_copy_QK, tQsQ, tQcQ, q_rows, m_block * self.tile_m, tile.rows_valid)
        if n_block_max > n_block_min:
            self.load_kv(kv.copy_K, kv.tKsK, kv.tKcK, kv.k_src, n_block_max - 1,
                         seqlen.seqlen_k - (n_block_max - 1) * self.tile_n)
        cute.arch.cp_async_commit_group()
        if cutlass.const_expr(self.q_in_regs):
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()
            cute.copy(smem_thr_copy_Q, mma.tSsQ, smem_thr_copy_Q.retile(mma.tSrQ))

        step = functools.partial(self.one_block, tile, mma, kv, softmax, acc_O, n_block_min)
        for i in cutlass.range(n_block_max - n_mid_hi, unroll=1):
            step(n_block_max - 1 - i, masked=True)
        for i in cutlass.range(n_mid_hi - n_mid_lo, unroll=1):
            step(n_mid_hi - 1 - i, masked=False)
        if cutlass.const_expr(self.variant.has_mask):
            for i in cutlass.range(n_mid_lo - n_block_min, unroll=1):
                step(n_mid_lo - 1 - i, masked=True)

        lse = cute.make_rmem_tensor((softmax.num_rows,), Float32)
        softmax.finalize(acc_O, lse)
        self.epilogue(acc_O, lse, mO, mLSE, tile, thr_mma, varlen_q)

    @cute.jit
    def one_block(self, tile, mma, kv, softmax, acc_O, n_block_min, n_block, masked: cutlass.Constexpr):
        seqlen = tile.seqlen
        # K(n) has landed and every warp is done with V(n+1): V's buffer is free.
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()
        if cutlass.const_expr(masked):
            self.load_kv(kv.copy_V, kv.tVsV, kv.tVcV, kv.v_src, n_block, seqlen.seqlen_k - n_block * self.tile_n)
        else:
            self.load_kv(kv.copy_V, kv.tVsV, kv.tVcV, kv.v_src, n_block, None)
        cute.arch.cp_async_commit_group()

        tiled_mma = mma.tiled_mma
        acc_S = cute.make_rmem_tensor(tiled_mma.get_slice(0).partition_shape_C((self.tile_m, self.tile_n)), Float32)
        acc_S.fill(0.0)
        if cutlass.const_expr(self.q_in_regs):
            gemm_rs(tiled_mma, acc_S, mma.tSrQ, mma.tSrK, mma.tSsK, mma.smem_thr_copy_K)
        else:
            gemm_ss(tiled_mma, acc_S, mma.tSrQ, mma.tSrK, mma.tSsQ, mma.tSsK, mma.smem_thr_copy_Q,
                    mma.smem_thr_copy_K)
        apply_to_scores(self.variant, acc_mn_view(acc_S), mma.tScS_mn, tile.ctx, tile.m_block * self.tile_m,
                        n_block * self.tile_n, self.pack, tile.softmax_scale, masked)

        # V(n) has landed and every warp is done reading K(n): prefetch K(n-1).
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()
        if n_block > n_block_min:
            self.load_kv(kv.copy_K, kv.tKsK, kv.tKcK, kv.k_src, n_block - 1, None)
        cute.arch.cp_async_commit_group()

        softmax.step(acc_S, acc_O)
        rP = cute.make_fragment_like(acc_S, self.dtype)
        rP.store(acc_S.load().to(self.dtype))
        gemm_rs(tiled_mma, acc_O, acc_to_operand_a(rP), mma.tOrVt, mma.tOsVt, mma.smem_thr_copy_V)

    @cute.jit
    def load_rows(self, tiled_copy, tXsX, tXcX, row_fn, row_base, rows_valid):
        """cp.async rows [row_base, row_base + tile) of a gmem operand into smem; with
        ``rows_valid`` given, rows past it are zero-filled instead (a NaN left in V
        would survive a zero probability)."""
        for m in cutlass.range_constexpr(cute.size(tXsX, mode=[1])):
            if cutlass.const_expr(rows_valid is None):
                self._copy_row(tiled_copy, tXsX, tXcX, row_fn(row_base + tXcX[0, m, 0][0]), m)
            else:
                self._copy_row_or_zero(tiled_copy, tXsX, tXcX, m, rows_valid,
                                       lambda: row_fn(row_base + tXcX[0, m, 0][0]))

    @cute.jit
    def _copy_row_or_zero(self, tiled_copy, tXsX, tXcX, m, rows_valid, src_fn):
        """Row m of the partition from ``src_fn()`` if it is below ``rows_valid``, else zeros."""
        if tXcX[0, m, 0][0] < rows_valid:
            src = src_fn()
            if cutlass.const_expr(isinstance(src, cute.Tensor) and cute.rank(src) > 1):
                cute.copy(tiled_copy, src, tXsX[None, m, None])
            else:
                self._copy_row(tiled_copy, tXsX, tXcX, src, m)
        else:
            tXsX[None, m, None].fill(0.0)

    @cute.jit
    def _copy_row(self, tiled_copy, tXsX, tXcX, g_row, m):
        for k in cutlass.range_constexpr(cute.size(tXsX, mode=[2])):
            ptr = aligned_row_ptr(g_row, tXcX[0, m, k][1], 16)
            src = cute.make_tensor(ptr, tXsX[None, m, k].layout)
            cute.copy(tiled_copy, src, tXsX[None, m, k])

    def kv_sources(self, mK, mV, mPageTable, batch, seqlen, head_kv, varlen_k: bool, paged: bool,
                   thr_copy_QK, thr_copy_V):
        """K and V as load sources: a row function through the page table for a paged
        cache, else the thread's partition of the (tile_n, d, n_blocks) tiling, whose
        per-block address is one multiply-add on a few hoisted offsets."""
        if cutlass.const_expr(paged):
            return paged_row_fns(mK, mV, mPageTable, batch, head_kv)
        mK_h = seqlen.k_view(mK, batch, varlen_k)[None, head_kv, None]
        mV_h = seqlen.k_view(mV, batch, varlen_k)[None, head_kv, None]
        gK = cute.local_tile(mK_h, (self.tile_n, self.head_dim), (None, 0))
        gV = cute.local_tile(mV_h, (self.tile_n, self.head_dim_v), (None, 0))
        return thr_copy_QK.partition_S(gK), thr_copy_V.partition_S(gV)

    @cute.jit
    def load_kv(self, tiled_copy, tXsX, tXcX, src, n_block, rows_valid):
        """Loads KV block n_block into smem from a tiled partition or a row function."""
        if cutlass.const_expr(isinstance(src, cute.Tensor)):
            for m in cutlass.range_constexpr(cute.size(tXsX, mode=[1])):
                if cutlass.const_expr(rows_valid is None):
                    cute.copy(tiled_copy, src[None, m, None, n_block], tXsX[None, m, None])
                else:
                    self._copy_row_or_zero(tiled_copy, tXsX, tXcX, m, rows_valid,
                                           lambda: src[None, m, None, n_block])
        else:
            self.load_rows(tiled_copy, tXsX, tXcX, src, n_block * self.tile_n, rows_valid)

    @cute.jit
    def epilogue(self, acc_O, lse, mO, mLSE, tile, thr_mma, varlen_q: cutlass.Constexpr):
        """Stores O (two consecutive columns per store) and the LSE straight from registers."""
        ctx, seqlen = tile.ctx, tile.seqlen
        if cutlass.const_expr(self.is_split):
            mO = mO[(tile.split_idx,) + (None,) * (cute.rank(mO) - 1)]
        head = tile.head_rows(self.pack)
        mO_rows = packed_rows(seqlen.q_view(mO, ctx.batch, varlen_q), head, self.pack)
        rO = cute.make_fragment_like(acc_O, self.out_dtype)
        rO.store(acc_O.load().to(self.out_dtype))
        rO_mn = acc_mn_view(rO)
        tOcO_mn = acc_mn_view(thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.head_dim_v))))
        pair_bits = 2 * self.out_dtype.width
        store_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.out_dtype, num_bits_per_copy=pair_bits)
        row0 = tile.m_block * self.tile_m
        for r in cutlass.range_constexpr(cute.size(rO_mn, mode=[0])):
            row = tOcO_mn[r, 0][0]
            if row < tile.rows_valid:
                g_row = mO_rows[row0 + row, None]
                for j in cutlass.range_constexpr(cute.size(rO_mn.shape[1][1])):
                    col = tOcO_mn[r, (0, j)][1]
                    dst = cute.make_tensor(aligned_row_ptr(g_row, col, pair_bits // 8), cute.make_layout(2))
                    cute.copy(store_atom, rO_mn[r, (None, j)], dst)
        if cutlass.const_expr(mLSE is not None):
            if cutlass.const_expr(self.is_split):
                mLSE = mLSE[(tile.split_idx,) + (None,) * (cute.rank(mLSE) - 1)]
            mLSE_rows = packed_lse_rows(seqlen.lse_view(mLSE, ctx.batch, varlen_q), head,
                                        self.pack)
            for r in cutlass.range_constexpr(cute.size(rO_mn, mode=[0])):
                row = tOcO_mn[r, 0][0]
                # The four lanes sharing a row hold the same LSE; the one at column 0 writes it.
                if tOcO_mn[0, 0][1] == 0 and row < tile.rows_valid:
                    mLSE_rows[row0 + row] = lse[r]


@dataclass(frozen=True)
class _Tile:
    """The output tile one CTA computes, with its sequence and variant context."""

    ctx: AttnCtx
    seqlen: SeqlenInfo
    m_block: Int32
    head_kv: Int32
    split_idx: Int32
    rows_valid: Int32  # rows of the tile inside the (packed) sequence
    softmax_scale: Float32

    def head_rows(self, qhead_per_kvhead_packed: int):
        """The head the tile's rows index: the KV head under pack_gqa, else the query head."""
        return self.head_kv if qhead_per_kvhead_packed > 1 else self.ctx.head


@dataclass(frozen=True)
class _KVLoader:
    """cp.async copies of K and V blocks into their smem buffers: the tiled copies, this
    thread's smem partitions and coordinates, and the gmem sources (a partition of the
    block tiling, or a row function for paged caches)."""

    copy_K: cute.TiledCopy
    copy_V: cute.TiledCopy
    tKsK: cute.Tensor
    tKcK: cute.Tensor
    tVsV: cute.Tensor
    tVcV: cute.Tensor
    k_src: object
    v_src: object


@dataclass(frozen=True)
class _MmaOperands:
    """Register fragments, smem partitions and ldmatrix copies of both GEMMs."""

    tiled_mma: cute.TiledMma
    tSrQ: cute.Tensor
    tSrK: cute.Tensor
    tOrVt: cute.Tensor
    tSsQ: cute.Tensor
    tSsK: cute.Tensor
    tOsVt: cute.Tensor
    smem_thr_copy_Q: object
    smem_thr_copy_K: object
    smem_thr_copy_V: object
    tScS_mn: cute.Tensor


# ---------------------------------------------------------------------------------------
# Host side: compile key and compilation on fake tensors (planning and launch: sm80/__init__.py).
# ---------------------------------------------------------------------------------------


def compile_fwd_sm80(key: tuple):
    """Compiles the kernel for ``key`` (``sm80.compile_key``) on fake tensors: no GPU needed."""
    return compile_from_key(key, 4, lambda dtype, d, dv, tile, variant, pack, is_split: FlashAttnFwdSm80(
        dtype, d, dv, *tile[:3], variant, qhead_per_kvhead_packed=pack, is_split=is_split, q_in_regs=tile[3]))
