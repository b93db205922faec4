"""MLA decode for SM80 and later: mma.sync (HMMA 16816 F32), cp.async row gathers,
asymmetric warp roles.

One CTA computes ``tile_m`` = 64 packed rows (query position x head, heads fastest:
``pack_gqa`` with one KV head) of one sequence [and one KV split] against the shared
latent cache: K = [ckv (512), kpe (64)], V = ckv. Per KV tile of ``tile_n`` = 32 keys:

    bytes from HBM       32 x (512 + 64) x 2      = 36.9 KB
    S = Q K^T            64 x 32 x 576 x 2        = 2.36 MFLOP
    O += P V             64 x 32 x 512 x 2        = 2.10 MFLOP     (121 FLOP / byte)

The register problem: O is 64 x 512 fp32 = 128 KB, i.e. 256 registers per thread for
one 128-thread FA2 CTA (over the 255 limit, before S, P and addresses). The SM80 register
file is 64 K registers per SM, enough for O many times over; the limit is per thread.
So the warps take asymmetric roles (the seed-001 idea), sized to the work each holds:

- 4 **S warps** (QK^T + softmax): each owns 16 rows x all 32 keys of S, so the online
  softmax of a row stays inside one warp (``softmax.OnlineSoftmax``, no cross-warp
  reduction). Registers: S 16, Q/K fragments 2 x 12, row statistics 4.
- 8 **O warps** (PV + loads): each owns all 64 rows x 64 columns of O, 128 fp32
  registers, plus one k16 slice of P (16) and of V (16): ~160 of the 168 a thread gets
  at 384 threads (65536 / 384, rounded down to 8). Sixteen O warps would halve O per
  thread but leave 85 registers a thread once loaders are counted, and the P and V
  fragments do not shrink. The O warps also issue the cp.async gathers: a stage is free
  exactly when they finish PV on it (the S warps are done with a tile before its P
  exists), so no "empty" barrier is needed and no warps idle waiting on one. 256
  threads gather a 32-key tile with one page lookup and 9 LDGSTS of 16 B each per thread:
  page size 1 costs the same gathers as page size 64.

Shared memory: Q 64 x 576 x 2 = 72 KB, ``stages`` x 36 KB of KV, two 4 KB P buffers,
row scales. Two stages (152 KB) fit the A100's 163 KB; three (188 KB) fit the H100/H200
(227 KB) and keep the next tile's load in flight while the S warps run one tile ahead of
the O warps. Smem reads per tile: Q 72 KB (each S warp reads its 16 rows), K 4 x 36 KB,
P 8 x 4 KB, V 36 KB: ~280 KB, about 2200 cycles at 128 B/clk against 4100 cycles for the
tile's 36.9 KB at the H200's 9 B/clk per SM of HBM bandwidth. The tensor work per SMSP
(one S warp and two O warps: 1.1 M FMA) is ~1600 cycles at the measured mma.sync rate of
Hopper (about two thirds of wgmma peak). So neither bounds the kernel: the pipeline has
to keep ~37 KB in flight per SM, which is what the S-ahead-of-O overlap buys.

Synchronisation (named barriers, ``bar.sync`` / ``bar.arrive``; id 0 unused):

    FULL[s]      O warps arrive once their gathers of tile i landed; S warps sync.
    P_FULL[b]    S warps arrive after writing P(i) and its row corrections; O warps sync
                 (which also orders tile i's smem: the S warps waited FULL on it).
    P_EMPTY[b]   O warps arrive after reading P(i); S warps sync before P(i + 2).
    O_DONE       O warps only: every O warp finished PV on stage s before it is refilled.
    FINAL        S warps arrive after writing 1 / row sum; O warps sync, scale, store.

Every arrival is matched by a sync of the same phase: arrivals for tiles nobody will
consume are skipped, so no barrier is left half-arrived at exit.
"""

from dataclasses import dataclass
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warp

from flash_attn_cute.block_info import BlockInfo
from flash_attn_cute.copy_utils import aligned_row_ptr, gmem_tiled_copy
from flash_attn_cute.constants import D_CKV, D_KPE
from flash_attn_cute.cute_utils import CUTE_DTYPE_BY_NAME, compile_options, fake_stream, fake_tensor
from flash_attn_cute.keys import parse_mla_key
from flash_attn_cute.mla_tile import MlaTile
from flash_attn_cute.pack_gqa import packed_lse_rows, packed_rows
from flash_attn_cute.paged_kv import page_and_row
from flash_attn_cute.sm80.config import MlaWarpRoles
from flash_attn_cute.softmax import LOG2_E, OnlineSoftmax, acc_mn_view
from flash_attn_cute.tile_scheduler import SingleTileScheduler
from flash_attn_cute.variants import apply_to_scores, make_variant

class _Bar:
    """Named barrier ids (0 is __syncthreads, left alone)."""

    def __init__(self, stages: int):
        self.full = 1  # + stage
        self.p_full = 1 + stages  # + P buffer
        self.p_empty = 3 + stages
        self.o_done = 5 + stages
        self.final = 6 + stages
        assert self.final < 16


def _staged_smem_layout(rows: int, cols: int, stages: int):
    """(rows, cols, stages) of 16-bit elements in 8 x 64 swizzled atoms (8 x 32 when cols
    is 32): ldmatrix reads and 128-bit cp.async writes bank-conflict free."""
    wide = cols % 64 == 0
    atom = cute.make_composed_layout(
        cute.make_swizzle(3 if wide else 2, 3, 3), 0,
        cute.make_layout((8, 64 if wide else 32), stride=(64 if wide else 32, 1)),
    )
    return cute.tile_to_shape(atom, (rows, cols, stages), (0, 1, 2))


class MlaDecodeSm80:
    def __init__(self, dtype, nheads: int, causal: bool, is_split: bool, stages: int,
                 roles: MlaWarpRoles = MlaWarpRoles()):
        self.dtype = dtype
        self.nheads = nheads  # packed rows per query position
        self.variant = make_variant(causal, False, False)
        self.is_split = is_split
        self.out_dtype = Float32 if is_split else dtype
        self.stages = stages
        self.roles = roles
        self.tile_m, self.tile_n = roles.tile_m, roles.tile_n
        self.bar = _Bar(stages)

    @cute.jit
    def __call__(
        self,
        mQn: cute.Tensor,  # (b, s_q, h, 512)
        mQp: cute.Tensor,  # (b, s_q, h, 64)
        mCkv: cute.Tensor,  # (num_pages, page_size, 512)
        mKpe: cute.Tensor,  # (num_pages, page_size, 64)
        mO: cute.Tensor,  # (b, s_q, h, 512); split: (num_splits, ...) fp32
        mLSE: Optional[cute.Tensor],  # (b, h, s_q); split: (num_splits, ...)
        mSeqlens: cute.Tensor,  # (b,) int32
        mPageTable: cute.Tensor,  # (b, max_pages) int32
        softmax_scale: Float32,
        num_splits: Int32,
        max_seqlen_q: Int32,
        batch_size: Int32,
        stream,
    ):
        m, n, st = self.tile_m, self.tile_n, self.stages
        sQn_layout = _staged_smem_layout(m, D_CKV, 1)
        sQp_layout = _staged_smem_layout(m, D_KPE, 1)
        sC_layout = _staged_smem_layout(n, D_CKV, st)
        sKp_layout = _staged_smem_layout(n, D_KPE, st)
        sP_layout = _staged_smem_layout(m, n, 2)

        @cute.struct
        class SharedStorage:
            sQn: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQn_layout)], 1024]
            sQp: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQp_layout)], 1024]
            sC: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sC_layout)], 1024]
            sKp: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKp_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sP_layout)], 1024]
            sScale: cute.struct.Align[cute.struct.MemRange[Float32, 2 * m], 16]
            sInv: cute.struct.Align[cute.struct.MemRange[Float32, m], 16]

        op = warp.MmaF16BF16Op(self.dtype, Float32, (16, 8, 16))
        # S: 4 warps along M, each 16 rows x all keys. O: 8 warps along N, each all rows
        # x 16-column slices of every 128 (ldmatrix.x4.trans feeds two n8 atoms at once).
        mma_S = cute.make_tiled_mma(op, (self.roles.s_warps, 1, 1), permutation_mnk=(m, 16, 16))
        mma_O = cute.make_tiled_mma(op, (1, self.roles.o_warps, 1),
                                    permutation_mnk=(16, 16 * self.roles.o_warps, 16))
        num_m_blocks = cute.ceil_div(max_seqlen_q * self.nheads, m)
        self.kernel(
            mQn, mQp, mCkv, mKpe, mO, mLSE, mSeqlens, mPageTable, softmax_scale, num_splits,
            sQn_layout, sQp_layout, sC_layout, sKp_layout, sP_layout, mma_S, mma_O,
            gmem_tiled_copy(self.dtype, D_CKV, self.roles.o_threads),
            gmem_tiled_copy(self.dtype, D_KPE, self.roles.o_threads),
            SharedStorage,
        ).launch(
            grid=SingleTileScheduler.grid(num_m_blocks, 1, num_splits, batch_size),
            block=(self.roles.threads, 1, 1),
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self, mQn, mQp, mCkv, mKpe, mO, mLSE, mSeqlens, mPageTable,
        softmax_scale: Float32, num_splits: Int32,
        sQn_layout: cute.ComposedLayout, sQp_layout: cute.ComposedLayout, sC_layout: cute.ComposedLayout,
        sKp_layout: cute.ComposedLayout, sP_layout: cute.ComposedLayout,
        mma_S: cute.TiledMma, mma_O: cute.TiledMma, copy_C: cute.TiledCopy, copy_Kp: cute.TiledCopy,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tile = MlaTile.create(mQn, mCkv, mSeqlens, mPageTable, num_splits,
                              BlockInfo(self.tile_m, self.tile_n, self.nheads, self.variant), self.is_split)
        if tile.rows_valid > 0:
            storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
            smem = _MlaSmem(
                storage.sQn.get_tensor(sQn_layout)[None, None, 0], storage.sQp.get_tensor(sQp_layout)[None, None, 0],
                storage.sC.get_tensor(sC_layout), storage.sKp.get_tensor(sKp_layout),
                storage.sP.get_tensor(sP_layout),
                storage.sScale.get_tensor(cute.make_layout((self.tile_m, 2))),
                storage.sInv.get_tensor(cute.make_layout((self.tile_m,))),
            )
            if warp_idx < self.roles.s_warps:
                self.score_warps(tile, smem, mma_S, softmax_scale, mLSE, tidx)
            else:
                self.output_warps(tile, smem, mma_O, copy_C, copy_Kp, mQn, mQp, mCkv, mKpe, mPageTable, mO,
                                  tidx - self.roles.s_threads)

    # ------------------------------------------------------------------ S warps

    @cute.jit
    def score_warps(self, tile, smem, mma_S, softmax_scale: Float32, mLSE, tidx):
        """QK^T over [ckv, kpe] for 16 rows per warp, mask, online softmax; P and the row
        corrections to smem for the O warps; at the end 1 / row sum and the LSE."""
        n_all = self.roles.threads
        thr_mma = mma_S.get_slice(tidx)
        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        copy_A = cute.make_tiled_copy_A(ldsm, mma_S).get_slice(tidx)
        copy_B = cute.make_tiled_copy_B(ldsm, mma_S).get_slice(tidx)
        tSrQn = thr_mma.make_fragment_A(thr_mma.partition_A(smem.sQn))
        tSrQp = thr_mma.make_fragment_A(thr_mma.partition_A(smem.sQp))
        tSrC = thr_mma.make_fragment_B(thr_mma.partition_B(smem.sC[None, None, 0]))
        tSrKp = thr_mma.make_fragment_B(thr_mma.partition_B(smem.sKp[None, None, 0]))
        tSsQn, tSsQp = copy_A.partition_S(smem.sQn), copy_A.partition_S(smem.sQp)
        tSsC, tSsKp = copy_B.partition_S(smem.sC), copy_B.partition_S(smem.sKp)  # (CPY, N, K, stages)
        tScS_mn = acc_mn_view(thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n))))
        tSsP = thr_mma.partition_C(smem.sP)  # (MMA, MMA_M, MMA_N, 2)

        softmax = OnlineSoftmax(2 * cute.size(tSrQn, mode=[1]), Float32(softmax_scale * LOG2_E))
        acc_shape = thr_mma.partition_shape_C((self.tile_m, self.tile_n))
        ops = _ScoreOps(mma_S, copy_A, copy_B, tSrQn, tSrQp, tSrC, tSrKp, tSsQn, tSsQp, tSsC, tSsKp, tScS_mn, tSsP)
        for i in cutlass.range(tile.n_tiles, unroll=1):
            self.score_tile(tile, smem, ops, softmax, softmax_scale, i)

        # 1 / row sum as a "row of ones" through finalize, which normalises its argument.
        rInv = cute.make_rmem_tensor(acc_shape, Float32)
        rInv.fill(1.0)
        lse = cute.make_rmem_tensor((softmax.num_rows,), Float32)
        softmax.finalize(rInv, lse)
        rInv_mn = acc_mn_view(rInv)
        inv = cute.make_rmem_tensor((softmax.num_rows,), Float32)
        for r in cutlass.range_constexpr(softmax.num_rows):
            inv[r] = rInv_mn[r, 0]
        self.write_rows(smem.sInv, inv, tScS_mn)
        cute.arch.barrier_arrive(barrier_id=self.bar.final, number_of_threads=n_all)
        if cutlass.const_expr(mLSE is not None):
            self.store_lse(mLSE, lse, tScS_mn, tile)

    @cute.jit
    def score_tile(self, tile, smem, ops, softmax, softmax_scale: Float32, i):
        """Tile i: wait for its KV, S = Q K^T, mask (edge blocks only), softmax step,
        then P and the row corrections into P buffer i % 2 once the O warps freed it."""
        n_all = self.roles.threads
        stage, buf = i % self.stages, i % 2
        n_block = tile.n_max - 1 - i
        cute.arch.barrier(barrier_id=self.bar.full + stage, number_of_threads=n_all)
        acc_S = self.qk(ops, stage)
        if n_block >= tile.n_mid_hi or n_block < tile.n_mid_lo:
            apply_to_scores(self.variant, acc_mn_view(acc_S), ops.tScS_mn, tile.ctx, tile.m_block * self.tile_m,
                            n_block * self.tile_n, self.nheads, softmax_scale, True)
        row_scale = softmax.step(acc_S)
        if i >= 2:
            cute.arch.barrier(barrier_id=self.bar.p_empty + buf, number_of_threads=n_all)
        rP = cute.make_fragment_like(acc_S, self.dtype)
        rP.store(acc_S.load().to(self.dtype))
        cute.autovec_copy(rP, ops.tSsP[None, None, None, buf])
        self.write_rows(smem.sScale[None, buf], row_scale, ops.tScS_mn)
        cute.arch.barrier_arrive(barrier_id=self.bar.p_full + buf, number_of_threads=n_all)

    @cute.jit
    def qk(self, ops, stage):
        """S = Qn C^T + Qp Kpe^T over 36 k16 slices, alternating between two accumulators:
        a warp's 16 x 32 tile is only 4 independent HMMAs per slice, fewer than the
        HMMA latency covers, so even and odd slices go to separate chains, summed at the
        end (H200, 2026-11-29: 2.01 against 1.83 TB/s at 128 x 1024, within noise at
        768 x 2048, where a tile still takes ~2 us against ~1 us of tensor work)."""
        acc_shape = ops.mma.get_slice(0).partition_shape_C((self.tile_m, self.tile_n))
        acc = [cute.make_rmem_tensor(acc_shape, Float32), cute.make_rmem_tensor(acc_shape, Float32)]
        acc[0].fill(0.0)
        acc[1].fill(0.0)
        operands = ((ops.tSrQn, ops.tSrC, ops.tSsQn, ops.tSsC), (ops.tSrQp, ops.tSrKp, ops.tSsQp, ops.tSsKp))
        step = 0
        for tSrA, tSrB, tSsA, tSsB in operands:
            tSrA_cv, tSrB_cv = ops.copy_A.retile(tSrA), ops.copy_B.retile(tSrB)
            for k in cutlass.range_constexpr(cute.size(tSsA, mode=[2])):
                cute.copy(ops.copy_A, tSsA[None, None, k], tSrA_cv[None, None, k])
                cute.copy(ops.copy_B, tSsB[None, None, k, stage], tSrB_cv[None, None, k])
                cute.gemm(ops.mma, acc[step % 2], tSrA[None, None, k], tSrB[None, None, k], acc[step % 2])
                step += 1
        acc[0].store(acc[0].load() + acc[1].load())
        return acc[0]

    @cute.jit
    def write_rows(self, sRow: cute.Tensor, vals: cute.Tensor, tScS_mn: cute.Tensor):
        """Per-row values to smem: the lane holding column 0 of the row writes it."""
        if tScS_mn[0, 0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(vals)):
                sRow[tScS_mn[r, 0][0]] = vals[r]

    @cute.jit
    def store_lse(self, mLSE, lse, tScS_mn, tile):
        if cutlass.const_expr(self.is_split):
            mLSE = mLSE[tile.split_idx, None, None, None]
        mLSE_rows = packed_lse_rows(mLSE[tile.ctx.batch, None, None], Int32(0), self.nheads)
        row0 = tile.m_block * self.tile_m
        for r in cutlass.range_constexpr(cute.size(lse)):
            row = tScS_mn[r, 0][0]
            if tScS_mn[0, 0][1] == 0 and row < tile.rows_valid:
                mLSE_rows[row0 + row] = lse[r]

    # ------------------------------------------------------------------ O warps

    @cute.jit
    def output_warps(self, tile, smem, mma_O, copy_C, copy_Kp, mQn, mQp, mCkv, mKpe, mPageTable, mO, otidx):
        """Gathers Q and the KV tiles (cp.async), O += P V over 64 columns per warp,
        rescaled by the S warps' corrections; at the end O / row sum to gmem."""
        n_all, n_o = self.roles.threads, self.roles.o_threads
        thr_C, thr_Kp = copy_C.get_slice(otidx), copy_Kp.get_slice(otidx)
        gather = _Gather(
            thr_C.partition_D(smem.sC), thr_Kp.partition_D(smem.sKp),
            thr_C.partition_S(cute.make_identity_tensor((self.tile_n, D_CKV))),
            mCkv, mKpe, mPageTable, tile.ctx.batch,
        )
        # Q rows of this tile (packed: heads of one position adjacent), zero past the end.
        mQn_rows = packed_rows(mQn[tile.ctx.batch, None, None, None], Int32(0), self.nheads)
        mQp_rows = packed_rows(mQp[tile.ctx.batch, None, None, None], Int32(0), self.nheads)
        row0 = tile.m_block * self.tile_m
        self.copy_rows(copy_C, thr_C.partition_D(smem.sQn),
                       thr_C.partition_S(cute.make_identity_tensor((self.tile_m, D_CKV))),
                       lambda r: mQn_rows[row0 + r, None], tile.rows_valid)
        self.copy_rows(copy_Kp, thr_Kp.partition_D(smem.sQp),
                       thr_Kp.partition_S(cute.make_identity_tensor((self.tile_m, D_KPE))),
                       lambda r: mQp_rows[row0 + r, None], tile.rows_valid)
        cute.arch.cp_async_commit_group()
        for j in cutlass.range_constexpr(self.stages):
            if j < tile.n_tiles:
                self.load_tile(copy_C, copy_Kp, gather, tile, j)
            cute.arch.cp_async_commit_group()
        # Q and tile 0 landed (the older groups): S may start.
        cute.arch.cp_async_wait_group(self.stages - 1)
        if tile.n_tiles > 0:
            cute.arch.barrier_arrive(barrier_id=self.bar.full, number_of_threads=n_all)

        thr_mma = mma_O.get_slice(otidx)
        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype)
        copy_P = cute.make_tiled_copy_A(ldsm, mma_O).get_slice(otidx)
        copy_V = cute.make_tiled_copy_B(ldsm_t, mma_O).get_slice(otidx)
        # V^T: the (512, tile_n, stages) view of the ckv stages, B of O += P V.
        sVt = cute.composition(smem.sC, cute.make_layout((D_CKV, self.tile_n, self.stages),
                                                         stride=(self.tile_n, 1, D_CKV * self.tile_n)))
        tOrP = thr_mma.make_fragment_A(thr_mma.partition_A(smem.sP[None, None, 0]))
        tOrV = thr_mma.make_fragment_B(thr_mma.partition_B(sVt[None, None, 0]))
        tOsP, tOsV = copy_P.partition_S(smem.sP), copy_V.partition_S(sVt)  # (CPY, M|N, K, stages)
        tOrP_cv, tOrV_cv = copy_P.retile(tOrP), copy_V.retile(tOrV)
        acc_O = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.tile_m, D_CKV)), Float32)
        acc_O.fill(0.0)
        tOcO_mn = acc_mn_view(thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, D_CKV))))

        for i in cutlass.range(tile.n_tiles, unroll=1):
            stage, buf = i % self.stages, i % 2
            cute.arch.barrier(barrier_id=self.bar.p_full + buf, number_of_threads=n_all)
            if i + 1 < tile.n_tiles:  # let the S warps start tile i + 1 while PV(i) runs
                cute.arch.cp_async_wait_group(self.stages - 2)
                cute.arch.barrier_arrive(barrier_id=self.bar.full + (i + 1) % self.stages, number_of_threads=n_all)
            self.scale_rows(acc_O, smem.sScale[None, buf], tOcO_mn)
            # One k16 slice of P and of V live at a time: 128 + 16 + 16 registers.
            for k in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
                cute.copy(copy_P, tOsP[None, None, k, buf], tOrP_cv[None, None, k])
                cute.copy(copy_V, tOsV[None, None, k, stage], tOrV_cv[None, None, k])
                cute.gemm(mma_O, acc_O, tOrP[None, None, k], tOrV[None, None, k], acc_O)
            if i + 2 < tile.n_tiles:
                cute.arch.barrier_arrive(barrier_id=self.bar.p_empty + buf, number_of_threads=n_all)
            cute.arch.barrier(barrier_id=self.bar.o_done, number_of_threads=n_o)
            if i + self.stages < tile.n_tiles:
                self.load_tile(copy_C, copy_Kp, gather, tile, i + self.stages)
            cute.arch.cp_async_commit_group()

        cute.arch.barrier(barrier_id=self.bar.final, number_of_threads=n_all)
        self.scale_rows(acc_O, smem.sInv, tOcO_mn)
        self.store_o(acc_O, tOcO_mn, mO, tile)

    @cute.jit
    def scale_rows(self, acc_O: cute.Tensor, sRow: cute.Tensor, tOcO_mn: cute.Tensor):
        o_mn = acc_mn_view(acc_O)
        for r in cutlass.range_constexpr(cute.size(o_mn, mode=[0])):
            o_mn[r, None].store(o_mn[r, None].load() * sRow[tOcO_mn[0, 0][0] + _acc_row_offset(r)])

    @cute.jit
    def load_tile(self, copy_C, copy_Kp, gather, tile, i):
        """cp.async of tile i (KV block n_max - 1 - i, walked last to first) into its stage."""
        n_block = tile.n_max - 1 - i
        stage = i % self.stages
        key0 = n_block * self.tile_n
        rows_valid = tile.ctx.seqlen_k - key0
        page_size, num_pages = gather.mCkv.shape[1], gather.mCkv.shape[0]
        for m in cutlass.range_constexpr(cute.size(gather.tCsC, mode=[1])):
            r = gather.tCcC[0, m, 0][0]
            if r < rows_valid:
                page, row = page_and_row(gather.mPageTable, gather.batch, key0 + r, page_size, num_pages)
                self.copy_row(copy_C, gather.tCsC[None, m, None, stage], gather.tCcC[None, m, None],
                              gather.mCkv[page, row, None])
                self.copy_row(copy_Kp, gather.tKsKp[None, m, None, stage], gather.tCcC[None, m, None],
                              gather.mKpe[page, row, None])
            else:  # a NaN left in V would survive a zero probability
                gather.tCsC[None, m, None, stage].fill(0.0)
                gather.tKsKp[None, m, None, stage].fill(0.0)

    @cute.jit
    def copy_rows(self, tiled_copy, tXsX, tXcX, row_fn, rows_valid):
        """Rows of a (rows, cols) smem tile from ``row_fn(row)`` (1-D gmem rows); zeros past ``rows_valid``."""
        for m in cutlass.range_constexpr(cute.size(tXsX, mode=[1])):
            r = tXcX[0, m, 0][0]
            if r < rows_valid:
                self.copy_row(tiled_copy, tXsX[None, m, None], tXcX[None, m, None], row_fn(r))
            else:
                tXsX[None, m, None].fill(0.0)

    @cute.jit
    def copy_row(self, tiled_copy, tXsX_row, tXcX_row, g_row):
        """One thread's 16-byte chunks of one gathered row (LDGSTS each)."""
        for k in cutlass.range_constexpr(cute.size(tXsX_row, mode=[1])):
            src = cute.make_tensor(aligned_row_ptr(g_row, tXcX_row[0, k][1], 16), tXsX_row[None, k].layout)
            cute.copy(tiled_copy, src, tXsX_row[None, k])

    @cute.jit
    def store_o(self, acc_O, tOcO_mn, mO, tile):
        """O rows to gmem, two adjacent columns per store, rows past the sequence skipped."""
        if cutlass.const_expr(self.is_split):
            mO = mO[tile.split_idx, None, None, None, None]
        mO_rows = packed_rows(mO[tile.ctx.batch, None, None, None], Int32(0), self.nheads)
        rO = cute.make_fragment_like(acc_O, self.out_dtype)
        rO.store(acc_O.load().to(self.out_dtype))
        rO_mn = acc_mn_view(rO)
        pair_bits = 2 * self.out_dtype.width
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.out_dtype, num_bits_per_copy=pair_bits)
        # Row r of the thread is its first row + a static offset: one live register for all
        # eight rows (separate row values were spilled across the mainloop, 3 STL/LDL).
        row_base = tile.m_block * self.tile_m + tOcO_mn[0, 0][0]
        rows_left = tile.rows_valid - tOcO_mn[0, 0][0]
        for r in cutlass.range_constexpr(cute.size(rO_mn, mode=[0])):
            if _acc_row_offset(r) < rows_left:
                g_row = mO_rows[row_base + _acc_row_offset(r), None]
                for j in cutlass.range_constexpr(cute.size(rO_mn.shape[1][1])):
                    ptr = aligned_row_ptr(g_row, tOcO_mn[r, (0, j)][1], pair_bits // 8)
                    cute.copy(atom, rO_mn[r, (None, j)], cute.make_tensor(ptr, cute.make_layout(2)))


def _acc_row_offset(r: int) -> int:
    """Row of entry r of an mma.sync m16n8 accumulator's row view (``acc_mn_view``: mode
    (2, MMA_M)) relative to the thread's first row, for a warp that spans every M tile:
    the two rows of an atom are 8 apart, the atoms 16."""
    return 8 * (r % 2) + 16 * (r // 2)


@dataclass(frozen=True)
class _ScoreOps:
    """The S warps' MMA, ldmatrix copies, fragments and smem partitions."""

    mma: cute.TiledMma
    copy_A: object
    copy_B: object
    tSrQn: cute.Tensor
    tSrQp: cute.Tensor
    tSrC: cute.Tensor
    tSrKp: cute.Tensor
    tSsQn: cute.Tensor
    tSsQp: cute.Tensor
    tSsC: cute.Tensor  # (CPY, N, K, stages)
    tSsKp: cute.Tensor
    tScS_mn: cute.Tensor
    tSsP: cute.Tensor  # (MMA, MMA_M, MMA_N, 2)


@dataclass(frozen=True)
class _MlaSmem:
    sQn: cute.Tensor
    sQp: cute.Tensor
    sC: cute.Tensor  # (tile_n, 512, stages)
    sKp: cute.Tensor  # (tile_n, 64, stages)
    sP: cute.Tensor  # (tile_m, tile_n, 2)
    sScale: cute.Tensor  # (tile_m, 2) fp32
    sInv: cute.Tensor  # (tile_m,) fp32


@dataclass(frozen=True)
class _Gather:
    """One O thread's share of a KV tile's row gather: smem destinations per stage, its
    row coordinates (the same rows for ckv and kpe), and the paged sources."""

    tCsC: cute.Tensor  # (CPY, rows, chunks, stages)
    tKsKp: cute.Tensor
    tCcC: cute.Tensor
    mCkv: cute.Tensor
    mKpe: cute.Tensor
    mPageTable: cute.Tensor
    batch: Int32


# ---------------------------------------------------------------------------------------
# Compilation from a compile key (planning and launch: sm80/mla.py).
# ---------------------------------------------------------------------------------------


def compile_mla_sm80(key: tuple):
    """Compiles the kernel for ``key`` (``keys.mla_key``; config ``(stages,)``) on fake
    tensors: no GPU needed."""
    arch, dtype_name, nheads, causal, is_split, has_lse, (stages,) = parse_mla_key(key)
    dtype = CUTE_DTYPE_BY_NAME[dtype_name]
    F32, I32 = cutlass.Float32, cutlass.Int32
    split = (None,) if is_split else ()
    out_dtype = F32 if is_split else dtype
    tensors = (
        fake_tensor(dtype, 4, shape=(None, None, nheads, D_CKV)),
        fake_tensor(dtype, 4, shape=(None, None, nheads, D_KPE)),
        fake_tensor(dtype, 3, shape=(None, None, D_CKV)),
        fake_tensor(dtype, 3, shape=(None, None, D_KPE)),
        fake_tensor(out_dtype, len(split) + 4, shape=split + (None, None, nheads, D_CKV)),
        fake_tensor(F32, len(split) + 3, align=4) if (has_lse or is_split) else None,
        fake_tensor(I32, 1, align=4),
        fake_tensor(I32, 2, align=4),
    )
    kernel = MlaDecodeSm80(dtype, nheads, causal, is_split, stages)
    return cute.compile(kernel, *tensors, F32(1.0), I32(1), I32(1), I32(1), fake_stream(),
                        options=compile_options(arch))
