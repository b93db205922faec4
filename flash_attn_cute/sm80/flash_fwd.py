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
import os
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warp

from flash_attn_cute import jit_cache
from flash_attn_cute.block_info import BlockInfo
from flash_attn_cute.cute_utils import (
    COMPILE_OPTIONS, CUTE_DTYPE_BY_NAME, DTYPE_NAMES, fake_stream, fake_tensor, target_arch,
)
from flash_attn_cute.seqlen_info import SeqlenInfo
from flash_attn_cute.softmax import LOG2_E, OnlineSoftmax, acc_mn_view, acc_to_operand_a
from flash_attn_cute.sm80.gemm import gemm_rs, gemm_ss
from flash_attn_cute.variants import AttentionVariant, AttnCtx, VariantParams, make_variant


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


def _gmem_tiled_copy(dtype, cols: int, num_threads: int):
    """128-bit cp.async, consecutive threads along a row of the smem atom."""
    elems = 128 // dtype.width
    threads_per_row = (64 if cols % 64 == 0 else 32) // elems
    atom = cute.make_copy_atom(
        cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), dtype, num_bits_per_copy=128
    )
    thr = cute.make_layout((num_threads // threads_per_row, threads_per_row), stride=(threads_per_row, 1))
    return cute.make_tiled_copy_tv(atom, thr, cute.make_layout((1, elems)))


def _aligned_row_ptr(row: cute.Tensor, col, align_bytes: int):
    """Pointer to row[col] with the alignment the row layout guarantees (a dynamic
    column offset would otherwise drop it to one element)."""
    ptr = row.iterator + col
    return cute.make_ptr(row.element_type, ptr.toint(), cute.AddressSpace.gmem, assumed_align=align_bytes)


class FlashAttnFwdSm80:
    def __init__(
        self,
        dtype,
        head_dim: int,
        head_dim_v: int,
        tile_m: int,
        tile_n: int,
        num_warps: int,
        variant: AttentionVariant,
        qhead_per_kvhead_packed: int = 1,
        is_split: bool = False,
        q_in_regs: bool = False,
        out_dtype=None,
    ):
        self.dtype = dtype
        self.out_dtype = out_dtype if out_dtype is not None else (Float32 if is_split else dtype)
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.num_threads = num_warps * 32
        self.variant = variant
        self.pack = qhead_per_kvhead_packed
        self.is_split = is_split
        # Q in registers for the whole KV loop removes Q's ldmatrix traffic, a fifth of
        # the shared-memory reads of each block, at the cost of its fragment's registers.
        self.q_in_regs = q_in_regs
        assert head_dim % 32 == 0 and head_dim_v % 32 == 0
        assert tile_m % (16 * num_warps) == 0 and tile_n % 16 == 0

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (b, s_q, h, d) or (total_q, h, d)
        mK: cute.Tensor,  # (b, s_k, h_kv, d), (total_k, h_kv, d) or (num_pages, page_size, h_kv, d)
        mV: cute.Tensor,  # as mK, with d_v
        mO: cute.Tensor,  # (b, s_q, h, d_v) / (total_q, h, d_v); split: (num_splits, ...) fp32
        mLSE: Optional[cute.Tensor],  # (b, h, s_q) / (h, total_q); split: (num_splits, ...)
        mCuSeqlensQ: Optional[cute.Tensor],  # (b + 1,) int32
        mCuSeqlensK: Optional[cute.Tensor],  # (b + 1,) int32
        mSeqUsedK: Optional[cute.Tensor],  # (b,) int32
        mPageTable: Optional[cute.Tensor],  # (b, max_pages) int32
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        softcap: Float32,
        num_splits: Int32,
        max_seqlen_q: Int32,
        batch_size: Int32,
        stream,
    ):
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
        heads_q = mQ.shape[cute.rank(mQ) - 2]
        heads_kv = mK.shape[cute.rank(mK) - 2]
        heads_eff = heads_kv if cutlass.const_expr(self.pack > 1) else heads_q
        num_m_blocks = cute.ceil_div(max_seqlen_q * self.pack, self.tile_m)
        self.kernel(
            mQ, mK, mV, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mPageTable,
            softmax_scale, window_left, window_right, softcap, num_splits,
            sQ_layout, sK_layout, sV_layout,
            _gmem_tiled_copy(self.dtype, self.head_dim, self.num_threads),
            _gmem_tiled_copy(self.dtype, self.head_dim_v, self.num_threads),
            tiled_mma,
            SharedStorage,
        ).launch(
            grid=(num_m_blocks, heads_eff * num_splits, batch_size),
            block=(self.num_threads, 1, 1),
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        mCuSeqlensQ: Optional[cute.Tensor],
        mCuSeqlensK: Optional[cute.Tensor],
        mSeqUsedK: Optional[cute.Tensor],
        mPageTable: Optional[cute.Tensor],
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        softcap: Float32,
        num_splits: Int32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        gmem_copy_QK: cute.TiledCopy,
        gmem_copy_V: cute.TiledCopy,
        tiled_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, bidy, batch = cute.arch.block_idx()
        num_m_blocks, _, _ = cute.arch.grid_dim()
        # Heaviest (last, for causal) M blocks first: they finish last otherwise.
        m_block = num_m_blocks - 1 - bidx
        head = bidy // num_splits
        split_idx = bidy - head * num_splits
        varlen_q = cutlass.const_expr(mCuSeqlensQ is not None)
        varlen_k = cutlass.const_expr(mCuSeqlensK is not None)
        paged = cutlass.const_expr(mPageTable is not None)
        if cutlass.const_expr(self.pack > 1):
            head_kv = head
        else:
            head_kv = head // (mQ.shape[cute.rank(mQ) - 2] // mK.shape[cute.rank(mK) - 2])

        capacity = None
        if cutlass.const_expr(paged):
            capacity = mPageTable.shape[1] * mK.shape[1]
        elif cutlass.const_expr(not varlen_k):
            capacity = mK.shape[1]
        seqlen = SeqlenInfo.create(
            batch,
            mQ.shape[0] if varlen_q else mQ.shape[1],
            mK.shape[0] if varlen_k else mK.shape[1],
            mCuSeqlensQ,
            mCuSeqlensK,
            mSeqUsedK,
            capacity,
        )
        rows_valid = seqlen.seqlen_q * self.pack - m_block * self.tile_m
        if rows_valid > 0:
            cap_inv = Float32(0.0)
            if cutlass.const_expr(self.variant.has_score_mod):
                cap_inv = cute.arch.rcp_approx(softcap)
            ctx = AttnCtx(
                batch, head, seqlen.seqlen_q, seqlen.seqlen_k,
                VariantParams(window_left, window_right, softcap, cap_inv),
            )
            self.attend(
                ctx, seqlen, m_block, head_kv, split_idx, num_splits, rows_valid,
                mQ, mK, mV, mO, mLSE, mPageTable, softmax_scale,
                sQ_layout, sK_layout, sV_layout, gmem_copy_QK, gmem_copy_V, tiled_mma, SharedStorage,
                varlen_q, varlen_k, paged, tidx,
            )

    @cute.jit
    def attend(
        self, ctx, seqlen, m_block, head_kv, split_idx, num_splits, rows_valid,
        mQ, mK, mV, mO, mLSE, mPageTable, softmax_scale,
        sQ_layout, sK_layout, sV_layout, gmem_copy_QK, gmem_copy_V, tiled_mma, SharedStorage,
        varlen_q: cutlass.Constexpr, varlen_k: cutlass.Constexpr, paged: cutlass.Constexpr, tidx,
    ):
        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sQ_layout)
        sK = storage.sK.get_tensor(sK_layout)
        sV = storage.sV.get_tensor(sV_layout)
        # (d_v, tile_n) view of V: the B operand of O += P V.
        sVt = cute.composition(
            sV, cute.make_layout((self.head_dim_v, self.tile_n), stride=(self.tile_n, 1))
        )

        # Row functions: global row index -> 1-D gmem tensor of that row.
        q_rows = self.rows_of_q_like(mQ, ctx.batch, seqlen.offset_q, head_kv if self.pack > 1 else ctx.head, varlen_q)
        k_src, v_src = self.kv_sources(mK, mV, mPageTable, ctx.batch, seqlen.offset_k, head_kv, varlen_k, paged, tidx,
                                       gmem_copy_QK, gmem_copy_V)

        block_info = BlockInfo(self.tile_m, self.tile_n, self.pack, self.variant)
        n_block_min, n_block_max = block_info.get_n_block_min_max(
            m_block, ctx, split_idx, num_splits, self.is_split
        )
        n_unmasked_lo, n_unmasked_hi = block_info.get_unmasked_n_block_range(m_block, ctx)

        thr_copy_QK = gmem_copy_QK.get_slice(tidx)
        thr_copy_V = gmem_copy_V.get_slice(tidx)
        tQsQ = thr_copy_QK.partition_D(sQ)
        tQcQ = thr_copy_QK.partition_S(cute.make_identity_tensor((self.tile_m, self.head_dim)))
        tKsK = thr_copy_QK.partition_D(sK)
        tKcK = thr_copy_QK.partition_S(cute.make_identity_tensor((self.tile_n, self.head_dim)))
        tVsV = thr_copy_V.partition_D(sV)
        tVcV = thr_copy_V.partition_S(cute.make_identity_tensor((self.tile_n, self.head_dim_v)))

        thr_mma = tiled_mma.get_slice(tidx)
        tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
        tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK))
        tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(sVt))
        acc_O = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.tile_m, self.head_dim_v)), Float32)
        acc_O.fill(0.0)

        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype)
        smem_thr_copy_Q = cute.make_tiled_copy_A(ldsm, tiled_mma).get_slice(tidx)
        smem_thr_copy_K = cute.make_tiled_copy_B(ldsm, tiled_mma).get_slice(tidx)
        smem_thr_copy_V = cute.make_tiled_copy_B(ldsm_t, tiled_mma).get_slice(tidx)
        tSsQ = smem_thr_copy_Q.partition_S(sQ)
        tSsK = smem_thr_copy_K.partition_S(sK)
        tOsVt = smem_thr_copy_V.partition_S(sVt)

        # Identity coordinates of this thread's S elements, for masks and score mods.
        tScS_mn = acc_mn_view(thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n))))

        has_mod = cutlass.const_expr(self.variant.has_score_mod)
        # With a score modifier the kernel scales S before calling it; otherwise the
        # scale folds into the exp2 argument (one FFMA per score).
        scale_log2 = LOG2_E if has_mod else softmax_scale * LOG2_E
        softmax = OnlineSoftmax(acc_O.shape[0][0] * acc_O.shape[1], Float32(scale_log2))

        # Prologue: Q, then the last K block (the only one the sequence end may cut).
        self.load_rows(gmem_copy_QK, tQsQ, tQcQ, q_rows, m_block * self.tile_m, rows_valid)
        if n_block_max > n_block_min:
            self.load_kv(gmem_copy_QK, tKsK, tKcK, k_src, n_block_max - 1,
                         seqlen.seqlen_k - (n_block_max - 1) * self.tile_n)
        cute.arch.cp_async_commit_group()
        if cutlass.const_expr(self.q_in_regs):
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()
            cute.copy(smem_thr_copy_Q, tSsQ, smem_thr_copy_Q.retile(tSrQ))

        step = functools.partial(
            self.one_block, ctx, seqlen, m_block, n_block_min, softmax, softmax_scale, acc_O,
            tiled_mma, tSrQ, tSrK, tOrVt, tSsQ, tSsK, tOsVt,
            smem_thr_copy_Q, smem_thr_copy_K, smem_thr_copy_V,
            gmem_copy_QK, gmem_copy_V, tKsK, tKcK, tVsV, tVcV, k_src, v_src, tScS_mn,
        )
        # Blocks are visited top-down in three runs: masked ones above the unmasked
        # range (sequence end, causal diagonal), the unmasked range itself, and masked
        # ones below it (a local window's left edge). Separate loops keep the hot
        # middle loop free of mask state.
        n_mid_hi = cutlass.max(cutlass.min(n_unmasked_hi, n_block_max), n_block_min)
        n_mid_lo = cutlass.min(cutlass.max(n_unmasked_lo, n_block_min), n_mid_hi)
        for i in cutlass.range(n_block_max - n_mid_hi, unroll=1):
            step(n_block_max - 1 - i, masked=True)
        for i in cutlass.range(n_mid_hi - n_mid_lo, unroll=1):
            step(n_mid_hi - 1 - i, masked=False)
        if cutlass.const_expr(self.variant.has_mask):
            for i in cutlass.range(n_mid_lo - n_block_min, unroll=1):
                step(n_mid_lo - 1 - i, masked=True)

        lse = cute.make_rmem_tensor((softmax.num_rows,), Float32)
        softmax.finalize(acc_O, lse)
        self.epilogue(acc_O, lse, mO, mLSE, ctx, seqlen, m_block, head_kv, split_idx, rows_valid,
                      thr_mma, varlen_q)

    @cute.jit
    def one_block(
        self, ctx, seqlen, m_block, n_block_min, softmax, softmax_scale, acc_O,
        tiled_mma, tSrQ, tSrK, tOrVt, tSsQ, tSsK, tOsVt,
        smem_thr_copy_Q, smem_thr_copy_K, smem_thr_copy_V,
        gmem_copy_QK, gmem_copy_V, tKsK, tKcK, tVsV, tVcV, k_src, v_src, tScS_mn,
        n_block, masked: cutlass.Constexpr,
    ):
        # K(n) has landed and every warp is done with V(n+1): V's buffer is free.
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()
        if cutlass.const_expr(masked):
            self.load_kv(gmem_copy_V, tVsV, tVcV, v_src, n_block, seqlen.seqlen_k - n_block * self.tile_n)
        else:
            self.load_kv(gmem_copy_V, tVsV, tVcV, v_src, n_block, None)
        cute.arch.cp_async_commit_group()

        acc_S = cute.make_rmem_tensor(tiled_mma.get_slice(0).partition_shape_C((self.tile_m, self.tile_n)), Float32)
        acc_S.fill(0.0)
        if cutlass.const_expr(self.q_in_regs):
            gemm_rs(tiled_mma, acc_S, tSrQ, tSrK, tSsK, smem_thr_copy_K)
        else:
            gemm_ss(tiled_mma, acc_S, tSrQ, tSrK, tSsQ, tSsK, smem_thr_copy_Q, smem_thr_copy_K)
        self.apply_variant(acc_S, tScS_mn, ctx, seqlen, m_block, n_block, softmax_scale, masked)

        # V(n) has landed and every warp is done reading K(n): prefetch K(n-1).
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()
        if n_block > n_block_min:
            self.load_kv(gmem_copy_QK, tKsK, tKcK, k_src, n_block - 1, None)
        cute.arch.cp_async_commit_group()

        softmax.step(acc_S, acc_O)
        rP = cute.make_fragment_like(acc_S, self.dtype)
        rP.store(acc_S.load().to(self.dtype))
        gemm_rs(tiled_mma, acc_O, acc_to_operand_a(rP), tOrVt, tOsVt, smem_thr_copy_V)

    @cute.jit
    def apply_variant(self, acc_S, tScS_mn, ctx, seqlen, m_block, n_block, softmax_scale, masked: cutlass.Constexpr):
        """Score modifier on every block; sequence-end and variant mask on masked blocks."""
        s_mn = acc_mn_view(acc_S)
        has_mod = cutlass.const_expr(self.variant.has_score_mod)
        if cutlass.const_expr(has_mod or masked):
            row0 = m_block * self.tile_m
            col0 = n_block * self.tile_n
            for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
                q_idx = (row0 + tScS_mn[r, 0][0]) // self.pack
                for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                    k_idx = col0 + tScS_mn[0, c][1]
                    s = s_mn[r, c]
                    if cutlass.const_expr(has_mod):
                        s = self.variant.score_mod(s * softmax_scale, q_idx, k_idx, ctx)
                    if cutlass.const_expr(masked):
                        keep = k_idx < seqlen.seqlen_k
                        if cutlass.const_expr(self.variant.has_mask):
                            keep = keep and self.variant.mask(q_idx, k_idx, ctx)
                        if not keep:
                            s = -Float32.inf
                    s_mn[r, c] = s

    @cute.jit
    def load_rows(self, tiled_copy, tXsX, tXcX, row_fn, row_base, rows_valid):
        """cp.async rows [row_base, row_base + tile) of a gmem operand into smem; with
        ``rows_valid`` given, rows past it are zero-filled instead (a NaN left in V
        would survive a zero probability)."""
        align = 16
        elems = 128 // self.dtype.width
        for m in cutlass.range_constexpr(cute.size(tXsX, mode=[1])):
            row = tXcX[0, m, 0][0]
            if cutlass.const_expr(rows_valid is None):
                self._copy_row(tiled_copy, tXsX, tXcX, row_fn(row_base + row), m, align, elems)
            else:
                if row < rows_valid:
                    self._copy_row(tiled_copy, tXsX, tXcX, row_fn(row_base + row), m, align, elems)
                else:
                    tXsX[None, m, None].fill(0.0)

    @cute.jit
    def _copy_row(self, tiled_copy, tXsX, tXcX, g_row, m, align, elems):
        for k in cutlass.range_constexpr(cute.size(tXsX, mode=[2])):
            ptr = _aligned_row_ptr(g_row, tXcX[0, m, k][1], align)
            src = cute.make_tensor(ptr, tXsX[None, m, k].layout)
            cute.copy(tiled_copy, src, tXsX[None, m, k])

    def rows_of_q_like(self, mX, batch, offset, head, varlen: bool):
        """Row function over a Q-shaped tensor (b, s, h, d) / (total, h, d): row r is
        query r, or with pack_gqa query r // pack of query head head * pack + r % pack."""
        if cutlass.const_expr(varlen):
            mX_b = cute.domain_offset((offset, 0, 0), mX)
        else:
            mX_b = mX[batch, None, None, None]
        if cutlass.const_expr(self.pack == 1):
            mX_rows = mX_b[None, head, None]
        else:
            base = mX_b[None, head * self.pack, None]
            mX_rows = cute.make_tensor(
                base.iterator,
                cute.make_layout(
                    ((self.pack, mX_b.shape[0]), mX_b.shape[2]),
                    stride=((mX_b.stride[1], mX_b.stride[0]), mX_b.stride[2]),
                ),
            )
        return lambda r: mX_rows[r, None]

    def kv_sources(self, mK, mV, mPageTable, batch, offset_k, head_kv, varlen_k: bool, paged: bool, tidx,
                   gmem_copy_QK, gmem_copy_V):
        """K and V as load sources: a row function through the page table for a paged
        cache, else the thread's partition of the (tile_n, d, n_blocks) tiling, whose
        per-block address is one multiply-add on a few hoisted offsets."""
        if cutlass.const_expr(paged):
            mK_p = mK[None, None, head_kv, None]  # (num_pages, page_size, d)
            mV_p = mV[None, None, head_kv, None]
            page_size = mK.shape[1]

            last_page = mK.shape[0] - 1

            def page_of(t):
                # A page id outside the pool is clamped into it: a bad table gives wrong
                # keys, never a read outside the cache.
                page_idx = t // page_size
                page = cutlass.max(cutlass.min(mPageTable[batch, page_idx], last_page), 0)
                return page, t - page_idx * page_size

            def k_row(t):
                page, r = page_of(t)
                return mK_p[page, r, None]

            def v_row(t):
                page, r = page_of(t)
                return mV_p[page, r, None]

            return k_row, v_row
        if cutlass.const_expr(varlen_k):
            mK_h = cute.domain_offset((offset_k, 0), mK[None, head_kv, None])
            mV_h = cute.domain_offset((offset_k, 0), mV[None, head_kv, None])
        else:
            mK_h = mK[batch, None, head_kv, None]
            mV_h = mV[batch, None, head_kv, None]
        gK = cute.local_tile(mK_h, (self.tile_n, self.head_dim), (None, 0))
        gV = cute.local_tile(mV_h, (self.tile_n, self.head_dim_v), (None, 0))
        return gmem_copy_QK.get_slice(tidx).partition_S(gK), gmem_copy_V.get_slice(tidx).partition_S(gV)

    @cute.jit
    def load_kv(self, tiled_copy, tXsX, tXcX, src, n_block, rows_valid):
        """Loads KV block n_block into smem from a tiled partition or a row function."""
        if cutlass.const_expr(isinstance(src, cute.Tensor)):
            for m in cutlass.range_constexpr(cute.size(tXsX, mode=[1])):
                if cutlass.const_expr(rows_valid is None):
                    cute.copy(tiled_copy, src[None, m, None, n_block], tXsX[None, m, None])
                else:
                    if tXcX[0, m, 0][0] < rows_valid:
                        cute.copy(tiled_copy, src[None, m, None, n_block], tXsX[None, m, None])
                    else:
                        tXsX[None, m, None].fill(0.0)
        else:
            self.load_rows(tiled_copy, tXsX, tXcX, src, n_block * self.tile_n, rows_valid)

    @cute.jit
    def epilogue(self, acc_O, lse, mO, mLSE, ctx, seqlen, m_block, head_kv, split_idx, rows_valid, thr_mma, varlen_q: cutlass.Constexpr):
        """Stores O (two consecutive columns per store) and the LSE straight from registers."""
        if cutlass.const_expr(self.is_split):
            mO = mO[split_idx, None, None, None, None] if cutlass.const_expr(not varlen_q) else mO[split_idx, None, None, None]
        head = head_kv if cutlass.const_expr(self.pack > 1) else ctx.head
        o_row = self.rows_of_q_like(mO, ctx.batch, seqlen.offset_q, head, varlen_q)
        rO = cute.make_fragment_like(acc_O, self.out_dtype)
        rO.store(acc_O.load().to(self.out_dtype))
        rO_mn = acc_mn_view(rO)
        tOcO_mn = acc_mn_view(thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.head_dim_v))))
        pair_bits = 2 * self.out_dtype.width
        store_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.out_dtype, num_bits_per_copy=pair_bits)
        row0 = m_block * self.tile_m
        for r in cutlass.range_constexpr(cute.size(rO_mn, mode=[0])):
            row = tOcO_mn[r, 0][0]
            if row < rows_valid:
                g_row = o_row(row0 + row)
                for j in cutlass.range_constexpr(cute.size(rO_mn.shape[1][1])):
                    col = tOcO_mn[r, (0, j)][1]
                    dst = cute.make_tensor(_aligned_row_ptr(g_row, col, pair_bits // 8), cute.make_layout(2))
                    cute.copy(store_atom, rO_mn[r, (None, j)], dst)
        if cutlass.const_expr(mLSE is not None):
            if cutlass.const_expr(self.is_split):
                mLSE = mLSE[split_idx, None, None, None] if cutlass.const_expr(not varlen_q) else mLSE[split_idx, None, None]
            mLSE_rows = self.lse_rows(mLSE, ctx.batch, seqlen.offset_q, head, varlen_q)
            for r in cutlass.range_constexpr(cute.size(rO_mn, mode=[0])):
                row = tOcO_mn[r, 0][0]
                # The four lanes sharing a row hold the same LSE; the one at column 0 writes it.
                if tOcO_mn[0, 0][1] == 0 and row < rows_valid:
                    mLSE_rows[row0 + row] = lse[r]

    def lse_rows(self, mLSE, batch, offset, head, varlen: bool):
        """(b, h, s) / (h, total) LSE -> (rows,) view in the M tile's row order."""
        if cutlass.const_expr(varlen):
            mL = cute.domain_offset((0, offset), mLSE)
        else:
            mL = mLSE[batch, None, None]
        if cutlass.const_expr(self.pack == 1):
            mL_rows = mL[head, None]
        else:
            base = mL[head * self.pack, None]
            mL_rows = cute.make_tensor(
                base.iterator,
                cute.make_layout((self.pack, mL.shape[1]), stride=(mL.stride[0], mL.stride[1])),
            )
        return mL_rows


# ---------------------------------------------------------------------------------------
# Host side: tile choice, compile key, compilation on fake tensors, launch.
# ---------------------------------------------------------------------------------------


def select_tile(head_dim: int, head_dim_v: int, rows_per_kv_head: int):
    """(tile_m, tile_n, num_warps, q_in_regs). acc_O holds tile_m * d_v / threads fp32
    values, acc_S tile_m * tile_n / threads, Q's fragment (when kept in registers)
    tile_m * d / threads 16-bit values; all under 255 registers per thread.
    FLASH_ATTN_CUTE_SM80_TILE="m,n,warps,q_in_regs" overrides (for tuning sweeps)."""
    override = os.environ.get("FLASH_ATTN_CUTE_SM80_TILE")
    if override:
        m, n, w, *q = (int(x) for x in override.split(","))
        return m, n, w, bool(q and q[0])
    d = max(head_dim, head_dim_v)
    if rows_per_kv_head <= 64:
        # Decode-shaped: a 128-row tile would be mostly padding.
        return (64, 128, 4, True) if d <= 128 else (64, 64, 4, False)
    if d <= 128:
        # 4 warps beat 8 on the H200 (2026-11-29 sweep, benchmarks/bench_tiles.py): each
        # warp re-reads K and V from smem, so more warps per tile cost smem bandwidth.
        # Q in registers did not pay at d=64 (within noise, and it spills).
        return 128, 64, 4, False
    return 128, 64, 8, False


def compile_fwd_sm80(key: tuple):
    """Compiles the kernel for ``key`` (see ``fwd_key``) on fake tensors: no GPU needed."""
    (_, _arch, dtype_name, d, dv, tile_m, tile_n, num_warps, q_in_regs, flags, pack, is_split, has_lse,
     varlen_q, varlen_k, has_seqused_k, paged) = key
    causal, local, softcap = flags
    dtype = CUTE_DTYPE_BY_NAME[dtype_name]
    out_dtype = Float32 if is_split else dtype
    kernel = FlashAttnFwdSm80(
        dtype, d, dv, tile_m, tile_n, num_warps, make_variant(causal, local, softcap),
        qhead_per_kvhead_packed=pack, is_split=is_split, q_in_regs=q_in_regs,
    )
    q_rank = 3 if varlen_q else 4
    kv_rank = 3 if (varlen_k and not paged) else 4
    split_mode = (None,) if is_split else ()
    mQ = fake_tensor(dtype, q_rank, shape=(None,) * (q_rank - 1) + (d,))
    mK = fake_tensor(dtype, kv_rank, shape=(None,) * (kv_rank - 1) + (d,))
    mV = fake_tensor(dtype, kv_rank, shape=(None,) * (kv_rank - 1) + (dv,))
    mO = fake_tensor(out_dtype, len(split_mode) + q_rank, shape=split_mode + (None,) * (q_rank - 1) + (dv,))
    mLSE = fake_tensor(Float32, len(split_mode) + q_rank - 1, align=4) if has_lse else None
    int_vec = lambda rank: fake_tensor(cutlass.Int32, rank, align=4)
    return cute.compile(
        kernel,
        mQ, mK, mV, mO, mLSE,
        int_vec(1) if varlen_q else None,
        int_vec(1) if varlen_k else None,
        int_vec(1) if has_seqused_k else None,
        int_vec(2) if paged else None,
        Float32(1.0), Int32(-1), Int32(-1), Float32(0.0), Int32(1), Int32(1), Int32(1),
        fake_stream(),
        options=COMPILE_OPTIONS,
    )


def fwd_key(arch, dtype_name, d, dv, tile, flags, pack, is_split, has_lse, varlen_q, varlen_k, has_seqused_k, paged):
    tile_m, tile_n, num_warps, q_in_regs = tile
    return ("fwd_sm80", arch, dtype_name, d, dv, tile_m, tile_n, num_warps, bool(q_in_regs),
            tuple(bool(f) for f in flags), int(pack),
            bool(is_split), bool(has_lse), bool(varlen_q), bool(varlen_k), bool(has_seqused_k), bool(paged))


def flash_attn_fwd_sm80(
    q, k, v, out, lse, *, cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None, page_table=None,
    max_seqlen_q: int, softmax_scale: float, causal: bool, window_left: int, window_right: int,
    softcap: float, num_splits: int, pack_gqa: bool,
) -> None:
    """Launches the SM80 forward on validated tensors (see flash_attn_cute.interface)."""
    varlen_q = cu_seqlens_q is not None
    heads, heads_kv = q.shape[-2], k.shape[-2]
    qhpk = heads // heads_kv
    pack = qhpk if (pack_gqa and qhpk > 1) else 1
    d, dv = q.shape[-1], v.shape[-1]
    batch = (cu_seqlens_q.shape[0] - 1) if varlen_q else q.shape[0]
    local = window_left >= 0 or (window_right >= 0 and not causal)
    is_split = num_splits > 1
    tile = select_tile(d, dv, max_seqlen_q * pack)
    key = fwd_key(
        target_arch(), DTYPE_NAMES[q.dtype], d, dv, tile, (causal and not local, local, softcap > 0),
        pack, is_split, lse is not None, varlen_q, cu_seqlens_k is not None, seqused_k is not None,
        page_table is not None,
    )
    fn = jit_cache.get_or_compile("fwd_sm80", key, lambda: compile_fwd_sm80(key))
    if causal and local:
        window_right = 0
    fn(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table,
       float(softmax_scale), int(window_left), int(window_right), float(softcap),
       int(num_splits), int(max_seqlen_q), int(batch))
