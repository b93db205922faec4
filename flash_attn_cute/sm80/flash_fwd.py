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

FP8 (e4m3 / e5m2) K and V with 16-bit queries: each block lands by cp.async in an fp8
staging buffer (half the bytes of a 16-bit one), and all threads widen it into the
16-bit K or V buffer the MMAs read (exact: every fp8 value is a bf16 and an fp16 value;
one 8-byte shared load and one 16-byte shared store per 8 elements). The descales are
never multiplied into the values: ``k_descale[b, h_kv]`` joins the softmax scale (S =
q . k scales with it, before any softcap or score modifier), ``v_descale[b, h_kv]``
scales O once before the epilogue.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass.cute.nvgpu import warp

from flash_attn_cute.device.block_info import BlockInfo
from flash_attn_cute.device.copy_utils import copy_rows, gmem_tiled_copy, widen_fp8
from flash_attn_cute.device.cute_utils import launch_ctas
from flash_attn_cute.device.epilogue import store_lse, store_o
from flash_attn_cute.device.fwd_kernel import (FwdArgs, FwdTile, compile_from_key, fwd_call, set_fwd_config, tile_grid,
                                               tile_work)
from flash_attn_cute.device.layout_utils import acc_mn_view, acc_to_operand_a
from flash_attn_cute.device.paged_kv import paged_row_fns
from flash_attn_cute.sm80.gemm import gemm_rs, gemm_ss, smem_layout
from flash_attn_cute.device.softmax import LOG2_E, OnlineSoftmax
from flash_attn_cute.device.tile_scheduler import TileDivisors
from flash_attn_cute.device.variants import AttentionVariant, apply_to_scores


class FlashAttnFwdSm80:
    __call__ = fwd_call  # the forward kernels' shared entry point: FwdArgs -> launch

    def __init__(self, dtype, head_dim: int, head_dim_v: int, tile_m: int, tile_n: int, num_warps: int,
                 variant: AttentionVariant, qhead_per_kvhead_packed: int = 1, is_split: bool = False,
                 q_in_regs: bool = False, split_blocks: int = 0, q_class: int = 0):
        set_fwd_config(self, dtype, head_dim, head_dim_v, variant, qhead_per_kvhead_packed, is_split, split_blocks,
                       q_class)
        head_dim, head_dim_v = self.head_dim, self.head_dim_v  # the tile's widths (padded head dims)
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
        sQ_layout = smem_layout(self.tile_m, self.head_dim)
        sK_layout = smem_layout(self.tile_n, self.head_dim)
        sV_layout = smem_layout(self.tile_n, self.head_dim_v)

        # FP8 K/V: row-major staging buffers of the fp8 blocks (unused 16-byte stand-ins otherwise).
        kv_dtype = args.mK.element_type
        fp8 = cutlass.const_expr(kv_dtype.width == 8)
        sK8_layout = cute.make_ordered_layout((self.tile_n, self.head_dim), order=(1, 0))
        sV8_layout = cute.make_ordered_layout((self.tile_n, self.head_dim_v), order=(1, 0))
        k8_field = cute.struct.Align[cute.struct.MemRange[kv_dtype, cute.cosize(sK8_layout) if fp8 else 16], 128]
        v8_field = cute.struct.Align[cute.struct.MemRange[kv_dtype, cute.cosize(sV8_layout) if fp8 else 16], 128]

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            sK8: k8_field
            sV8: v8_field

        tiled_mma = cute.make_tiled_mma(
            warp.MmaF16BF16Op(self.dtype, Float32, (16, 8, 16)),
            (self.num_threads // 32, 1, 1),
            permutation_mnk=(self.num_threads // 32 * 16, 16, 16),
        )
        grid, grid_divisors, num_m_blocks, _ = tile_grid(args, self.tile_m, self.qhead_per_kvhead_packed)
        kernel = self.kernel(
            args, (sQ_layout, sK_layout, sV_layout, sK8_layout, sV8_layout),
            gmem_tiled_copy(self.dtype, self.head_dim, self.num_threads),
            gmem_tiled_copy(self.dtype, self.head_dim_v, self.num_threads),
            (gmem_tiled_copy(kv_dtype, self.head_dim, self.num_threads),
             gmem_tiled_copy(kv_dtype, self.head_dim_v, self.num_threads)),
            tiled_mma,
            SharedStorage,
            grid_divisors,
        )
        launch_ctas(kernel, grid, self.num_threads, SharedStorage, stream)

    @cute.kernel
    def kernel(
        self,
        args: FwdArgs,
        smem_layouts: tuple,  # Q, K, V, fp8 K and V staging
        gmem_copy_QK: cute.TiledCopy,
        gmem_copy_V: cute.TiledCopy,
        gmem_copy_KV8: tuple,  # K, V in their own dtype (fp8 caches: 16 elements per cp.async)
        tiled_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
        grid_divisors: TileDivisors,  # what tile_work divides the block index by (tile_grid)
    ):
        tidx, _, _ = cute.arch.thread_idx()
        block_info = BlockInfo(self.tile_m, self.tile_n, self.qhead_per_kvhead_packed, self.variant, self.split_blocks,
                         self.q_class)
        # The tile (``FwdTile.create``) in steps: its context and KV range only once it has rows.
        work = tile_work(args, grid_divisors, self.tile_m, self.qhead_per_kvhead_packed)
        head_kv = FwdTile.head_kv_of(args, work, block_info)
        seqlen = FwdTile.seqlen_of(args, work)
        rows_valid = FwdTile.rows_valid_of(seqlen, work, block_info)
        if rows_valid > 0:
            ctx = FwdTile.ctx_of(args, work, seqlen, block_info)
            tile = FwdTile(ctx, seqlen, work.m_block, head_kv, work.split_idx, rows_valid, args.softmax_scale, None,
                           None).with_k_descale(args)
            self.attend(args, tile, block_info, smem_layouts, gmem_copy_QK, gmem_copy_V, gmem_copy_KV8, tiled_mma,
                        SharedStorage, tidx)

    @cute.jit
    def attend(self, args: FwdArgs, tile: FwdTile, block_info: BlockInfo, smem_layouts: tuple, gmem_copy_QK,
               gmem_copy_V, gmem_copy_KV8: tuple, tiled_mma, SharedStorage: cutlass.Constexpr, tidx):
        sQ_layout, sK_layout, sV_layout, sK8_layout, sV8_layout = smem_layouts
        fp8 = cutlass.const_expr(args.mK.element_type.width == 8)
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sQ_layout)
        sK = storage.sK.get_tensor(sK_layout)
        sV = storage.sV.get_tensor(sV_layout)
        # (d_v, tile_n) view of V: the B operand of O += P V.
        sVt = cute.composition(
            sV, cute.make_layout((self.head_dim_v, self.tile_n), stride=(self.tile_n, 1))
        )

        # Q rows of this head group (packed under pack_gqa).
        mQ_rows = tile.q_rows(args.mQ, self.qhead_per_kvhead_packed, args.varlen_q)
        row0 = tile.m_block * self.tile_m
        tile = tile.with_n_block_range(block_info, args.num_splits, self.is_split)
        runs = tile.n_block_runs(block_info)

        thr_copy_QK = gmem_copy_QK.get_slice(tidx)
        thr_copy_V = gmem_copy_V.get_slice(tidx)
        tQsQ = thr_copy_QK.partition_D(sQ)
        tQcQ = thr_copy_QK.partition_S(cute.make_identity_tensor((self.tile_m, self.head_dim)))
        widen = None
        if cutlass.const_expr(fp8):
            # Blocks land in the staging buffers; ``widen`` maps each thread's 8-element
            # chunks of a staged block onto the same chunks of the 16-bit buffer (the
            # partition of the 16-bit cp.async: 16-byte aligned stores).
            sK8 = storage.sK8.get_tensor(sK8_layout)
            sV8 = storage.sV8.get_tensor(sV8_layout)
            widen = _Widen(thr_copy_QK.partition_D(sK8), thr_copy_QK.partition_D(sK),
                           thr_copy_V.partition_D(sV8), thr_copy_V.partition_D(sV))
            thr_copy_QK = gmem_copy_KV8[0].get_slice(tidx)
            thr_copy_V = gmem_copy_KV8[1].get_slice(tidx)
            kv = _KVLoader(gmem_copy_KV8[0], gmem_copy_KV8[1], thr_copy_QK.partition_D(sK8),
                           thr_copy_QK.partition_S(cute.make_identity_tensor((self.tile_n, self.head_dim))),
                           thr_copy_V.partition_D(sV8),
                           thr_copy_V.partition_S(cute.make_identity_tensor((self.tile_n, self.head_dim_v))),
                           *self.kv_sources(args, tile, thr_copy_QK, thr_copy_V))
        else:
            k_src, v_src = self.kv_sources(args, tile, thr_copy_QK, thr_copy_V)
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
        n_block_min, n_block_max = tile.n_block_min, tile.n_block_max
        copy_rows(gmem_copy_QK, tQsQ, tQcQ, lambda r, m: mQ_rows[row0 + r, None], tile.rows_valid,
                  self.head_dim_valid)
        if n_block_max > n_block_min:
            self.load_kv(kv.copy_K, kv.tKsK, kv.tKcK, kv.k_src, n_block_max - 1,
                         tile.seqlen.seqlen_k - (n_block_max - 1) * self.tile_n, self.head_dim_valid)
        cute.arch.cp_async_commit_group()
        if cutlass.const_expr(self.q_in_regs):
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()
            cute.copy(smem_thr_copy_Q, mma.tSsQ, smem_thr_copy_Q.retile(mma.tSrQ))

        block_info.walk_n_blocks(
            lambda _, n_block, masked: self.one_block(tile, mma, kv, widen, softmax, acc_O, n_block_min, n_block,
                                                      masked),
            n_block_min, n_block_max, runs)
        if cutlass.const_expr(args.mVDescale is not None):
            acc_O.store(acc_O.load() * args.mVDescale[tile.ctx.batch, tile.head_kv])

        packed = self.qhead_per_kvhead_packed
        tOcO_mn = acc_mn_view(thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.head_dim_v))))
        sinks = None
        if cutlass.const_expr(args.mLearnableSink is not None and not self.is_split):  # split: the combine's
            sinks = tile.row_sinks(args.mLearnableSink, tOcO_mn, row0, packed)
        lse = cute.make_rmem_tensor((softmax.num_rows,), Float32)
        softmax.finalize(acc_O, lse, sinks)
        # O (two consecutive columns per store) and the LSE straight from registers.
        o_rows = tile.out_rows(args.mO, packed, self.is_split, args.varlen_q)
        store_o(acc_O, self.out_dtype, tOcO_mn, o_rows, row0, tile.rows_valid, cols_valid=self.head_dim_v_valid)
        if cutlass.const_expr(args.mLSE is not None):
            store_lse(lse, tOcO_mn, tile.lse_rows(args.mLSE, packed, self.is_split, args.varlen_q), row0,
                      tile.rows_valid)

    @cute.jit
    def one_block(self, tile, mma, kv, widen, softmax, acc_O, n_block_min, n_block, masked: cutlass.Constexpr):
        seqlen = tile.seqlen
        # K(n) has landed and every warp is done with V(n+1): V's buffer is free.
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()
        if cutlass.const_expr(widen is not None):  # fp8: K(n) staged -> K's buffer, the staging free again
            widen.k(self.dtype)
        if cutlass.const_expr(masked):
            self.load_kv(kv.copy_V, kv.tVsV, kv.tVcV, kv.v_src, n_block, seqlen.seqlen_k - n_block * self.tile_n,
                         self.head_dim_v_valid)
        else:
            self.load_kv(kv.copy_V, kv.tVsV, kv.tVcV, kv.v_src, n_block, None, self.head_dim_v_valid)
        cute.arch.cp_async_commit_group()
        if cutlass.const_expr(widen is not None):
            cute.arch.barrier()  # every thread's part of K(n) widened

        tiled_mma = mma.tiled_mma
        acc_S = cute.make_rmem_tensor(tiled_mma.get_slice(0).partition_shape_C((self.tile_m, self.tile_n)), Float32)
        acc_S.fill(0.0)
        if cutlass.const_expr(self.q_in_regs):
            gemm_rs(tiled_mma, acc_S, mma.tSrQ, mma.tSrK, mma.tSsK, mma.smem_thr_copy_K)
        else:
            gemm_ss(tiled_mma, acc_S, mma.tSrQ, mma.tSrK, mma.tSsQ, mma.tSsK, mma.smem_thr_copy_Q,
                    mma.smem_thr_copy_K)
        apply_to_scores(self.variant, acc_mn_view(acc_S), mma.tScS_mn, tile.ctx, tile.m_block * self.tile_m,
                        n_block * self.tile_n, self.qhead_per_kvhead_packed, tile.softmax_scale, masked)

        # V(n) has landed and every warp is done reading K(n): prefetch K(n-1).
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()
        if cutlass.const_expr(widen is not None):
            widen.v(self.dtype)
        if n_block > n_block_min:
            self.load_kv(kv.copy_K, kv.tKsK, kv.tKcK, kv.k_src, n_block - 1, None, self.head_dim_valid)
        cute.arch.cp_async_commit_group()
        if cutlass.const_expr(widen is not None):
            cute.arch.barrier()  # every thread's part of V(n) widened

        softmax.step(acc_S, acc_O)
        rP = cute.make_fragment_like(acc_S, self.dtype)
        rP.store(acc_S.load().to(self.dtype))
        gemm_rs(tiled_mma, acc_O, acc_to_operand_a(rP), mma.tOrVt, mma.tOsVt, mma.smem_thr_copy_V)

    def kv_sources(self, args: FwdArgs, tile: FwdTile, thr_copy_QK, thr_copy_V):
        """K and V as load sources: a row function through the page table for a paged
        cache (from the sequence's key start with cache_leftpad), else the thread's
        partition of the (tile_n, d, n_blocks) tiling, whose per-block address is one
        multiply-add on a few hoisted offsets."""
        batch, head_kv = tile.ctx.batch, tile.head_kv
        if cutlass.const_expr(args.paged):
            return paged_row_fns(args.mK, args.mV, args.mPageTable, batch, head_kv, tile.seqlen.leftpad_k)
        mK_h = tile.seqlen.k_view(args.mK, batch, args.varlen_k)[None, head_kv, None]
        mV_h = tile.seqlen.k_view(args.mV, batch, args.varlen_k)[None, head_kv, None]
        gK = cute.local_tile(mK_h, (self.tile_n, self.head_dim), (None, 0))
        gV = cute.local_tile(mV_h, (self.tile_n, self.head_dim_v), (None, 0))
        return thr_copy_QK.partition_S(gK), thr_copy_V.partition_S(gV)

    @cute.jit
    def load_kv(self, tiled_copy, tXsX, tXcX, src, n_block, rows_valid, cols_valid: cutlass.Constexpr = None):
        """cp.async of KV block n_block into smem, from a tiled partition or a row function
        (key -> gmem row); with ``rows_valid``, rows past it are zero-filled, with
        ``cols_valid`` (a padded head dim), columns past it."""
        if cutlass.const_expr(isinstance(src, cute.Tensor)):
            copy_rows(tiled_copy, tXsX, tXcX, lambda r, m: src[None, m, None, n_block], rows_valid, cols_valid)
        else:
            key0 = n_block * self.tile_n
            copy_rows(tiled_copy, tXsX, tXcX, lambda r, m: src(key0 + r), rows_valid, cols_valid)


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
class _Widen:
    """FP8 K/V: this thread's chunks of the staging buffers and of the 16-bit buffers,
    both (CPY, M, chunks) partitions of the 16-bit cp.async (8 elements per chunk)."""

    tKs8: cute.Tensor
    tKsK: cute.Tensor
    tVs8: cute.Tensor
    tVsV: cute.Tensor

    @cute.jit
    def k(self, dtype):
        widen_fp8(self.tKs8, self.tKsK, dtype)

    @cute.jit
    def v(self, dtype):
        widen_fp8(self.tVs8, self.tVsV, dtype)


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
    return compile_from_key(
        key, 4, lambda dtype, d, dv, tile, variant, packed, is_split, split_blocks, q_class: FlashAttnFwdSm80(
            dtype, d, dv, *tile[:3], variant, qhead_per_kvhead_packed=packed, is_split=is_split, q_in_regs=tile[3],
            split_blocks=split_blocks, q_class=q_class))
