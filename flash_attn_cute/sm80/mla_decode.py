"""MLA decode for SM80 and later: mma.sync (HMMA 16816 F32), cp.async row gathers,
asymmetric warp roles.

One CTA computes ``tile_m`` = 64 packed rows (query position x head, heads fastest:
``pack_gqa`` over one KV head) of one sequence [and one KV split] against the shared
latent cache: K = [ckv (512), kpe (64)], V = ckv. Any head count: the last tile of a
sequence may be partial (``mla_kernel`` docstring); its Q rows past the end re-read the
last valid row, its O and LSE rows past it are not stored. Per KV tile of ``tile_n`` = 32 keys:

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
row scales, the stages' FULL mbarriers. Two stages (152 KB) fit the A100's 163 KB; three
(188 KB) fit the H100/H200 (227 KB) and keep the next tiles' loads in flight while the S
warps run one tile ahead of the O warps. Smem reads per tile: Q 72 KB (each S warp reads
its 16 rows), K 4 x 36 KB, P 8 x 4 KB, V 36 KB: ~280 KB, about 2200 cycles at 128 B/clk
against 4100 cycles for the tile's 36.9 KB at the H200's 9 B/clk per SM of HBM bandwidth.
The tensor work per SMSP (one S warp and two O warps: 1.1 M FMA) is ~1600 cycles at the
measured mma.sync rate of Hopper (about two thirds of wgmma peak). So neither bounds the
kernel: the pipeline has to keep tiles in flight, which is what the S-ahead-of-O overlap
and loads that no warp waits for buy.

Synchronisation. FULL is an mbarrier per KV stage (``flash_attn_cute.device.mbarrier``: the PTX
of sm_80); the others are named barriers (``named_barrier.Sm80MlaBarrier``, ``bar.sync`` /
``bar.arrive``):

    FULL[s]      each O thread, right after issuing its gathers of tile i into stage s:
                 ``cp.async.mbarrier.arrive.noinc``, which arrives once they landed; the
                 S warps wait on the phase. No O warp waits for a load.
    P_FULL[b]    S warps arrive after writing P(i) and its row corrections; O warps sync
                 (which also orders tile i's smem: the S warps waited FULL on it).
    P_EMPTY[b]   O warps arrive after reading P(i); S warps sync before P(i + 2).
    O_DONE       O warps only: every O warp finished PV on stage s before it is refilled.
    FINAL        S warps arrive after writing 1 / row sum; O warps sync, scale, store.

Before FULL was an mbarrier, the O warps waited (``cp.async.wait_group``) for tile i + 1
to land before their P V of tile i, so a stage was refilled only after the next tile had
arrived: about one tile in flight. Now stage s is refilled as soon as P V of its tile is
done (H200, same call, 2026-12-01: 768 x 2048 2.41 against 2.26 TB/s, 128 x 1024 2.17
against 2.00, 128 x 2048 2.34 against 2.15). A fourth stage (225 KB) was no faster then
(2.39 TB/s at 768 x 2048): the pipeline, not the ring, is what held the tiles back.

Every named-barrier arrival is matched by a sync of the same phase: arrivals for tiles
nobody will consume are skipped, so no barrier is left half-arrived at exit. Each FULL
phase gets exactly one arrival per O thread, for a tile the S warps will wait on.

FP8 latent cache: the first 128 O threads gather their own fp8 chunks of each tile into an
fp8 staging ring (``fp8_stages`` deep; ``mla_kernel.MlaFp8Staging``: one key a thread),
issuing tile i + fp8_stages at the start of step i, and widen a tile's chunks into its
16-bit stage once they landed (waiting for their own copies), just before a plain
arrival on its FULL mbarrier (release: the widened stores are seen by the S warps); two KV
stages.
The scores and O carry ``kv_descale``.
"""

from dataclasses import dataclass
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warp

from flash_attn_cute.device import mbarrier
from flash_attn_cute.device.block_info import BlockInfo
from flash_attn_cute.host.constants import D_CKV, D_KPE
from flash_attn_cute.device.copy_utils import copy_rows, gmem_tiled_copy
from flash_attn_cute.device.cute_utils import launch_ctas
from flash_attn_cute.device.epilogue import store_lse, store_o
from flash_attn_cute.device.layout_utils import acc_mn_view
from flash_attn_cute.device.mla_kernel import (MlaArgs, MlaFp8Staging, MlaGather, MlaTile, compile_mla_from_key,
                                               mla_call, set_mla_config)
from flash_attn_cute.device.named_barrier import Sm80MlaBarrier
from flash_attn_cute.sm80.config import MlaWarpRoles
from flash_attn_cute.sm80.gemm import smem_layout
from flash_attn_cute.device.softmax import LOG2_E, OnlineSoftmax
from flash_attn_cute.device.tile_scheduler import SingleTileScheduler, TileDivisors, tile_divisors
from flash_attn_cute.device.variants import apply_to_scores


class MlaDecodeSm80:
    __call__ = mla_call  # the MLA kernels' shared entry point: MlaArgs -> launch

    def __init__(self, dtype, qhead_per_kvhead: int, causal: bool, is_split: bool, split_blocks: int, stages: int,
                 fp8_stages: int = 0, roles: MlaWarpRoles = MlaWarpRoles()):
        set_mla_config(self, dtype, qhead_per_kvhead, causal, is_split, split_blocks)
        self.stages = stages
        self.fp8_stages = fp8_stages  # an FP8 cache's staging depth (0: 16 bits)
        self.roles = roles
        self.tile_m, self.tile_n = roles.tile_m, roles.tile_n

    @cute.jit
    def launch(self, args: MlaArgs, stream):
        m, n, st = self.tile_m, self.tile_n, self.stages
        sQn_layout = smem_layout(m, D_CKV, 1)
        sQp_layout = smem_layout(m, D_KPE, 1)
        sC_layout = smem_layout(n, D_CKV, st)
        sKp_layout = smem_layout(n, D_KPE, st)
        sP_layout = smem_layout(m, n, 2)
        # An FP8 cache's staging ring (``MlaFp8Staging.smem``).
        kv_dtype = args.mCkv.element_type
        self.fp8 = kv_dtype.width == 8
        assert self.fp8 == (self.fp8_stages > 0), "an FP8 cache needs staging stages (sm80/mla.py plan)"
        sC8_layout, sKp8_layout, c8_field, kp8_field = MlaFp8Staging.smem(kv_dtype, n, self.fp8_stages)

        @cute.struct
        class SharedStorage:
            sQn: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQn_layout)], 1024]
            sQp: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQp_layout)], 1024]
            sC: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sC_layout)], 1024]
            sKp: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKp_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sP_layout)], 1024]
            sScale: cute.struct.Align[cute.struct.MemRange[Float32, 2 * m], 16]
            sInv: cute.struct.Align[cute.struct.MemRange[Float32, m], 16]
            mbar_full: cute.struct.Align[cute.struct.MemRange[cutlass.Int64, st], 8]
            sC8: c8_field  # an FP8 cache's staging (16-byte stand-ins otherwise)
            sKp8: kp8_field

        op = warp.MmaF16BF16Op(self.dtype, Float32, (16, 8, 16))
        # S: 4 warps along M, each 16 rows x all keys. O: 8 warps along N, each all rows
        # x 16-column slices of every 128 (ldmatrix.x4.trans feeds two n8 atoms at once).
        mma_S = cute.make_tiled_mma(op, (self.roles.s_warps, 1, 1), permutation_mnk=(m, 16, 16))
        mma_O = cute.make_tiled_mma(op, (1, self.roles.o_warps, 1),
                                    permutation_mnk=(16, 16 * self.roles.o_warps, 16))
        num_m_blocks = args.num_m_blocks(m, self.qhead_per_kvhead_packed)
        kernel = self.kernel(
            args, (sQn_layout, sQp_layout, sC_layout, sKp_layout, sP_layout, sC8_layout, sKp8_layout), mma_S, mma_O,
            gmem_tiled_copy(self.dtype, D_CKV, self.roles.o_threads),
            gmem_tiled_copy(self.dtype, D_KPE, self.roles.o_threads),
            SharedStorage,
            tile_divisors(num_m_blocks, args.num_splits),
        )
        grid = SingleTileScheduler.grid(num_m_blocks, args.num_kv_heads(), args.num_splits, args.batch_size)
        launch_ctas(kernel, grid, self.roles.threads, SharedStorage, stream)

    @cute.kernel
    def kernel(
        self,
        args: MlaArgs,
        smem_layouts: tuple,  # Qn, Qp, ckv, kpe, P, fp8 staging ckv and kpe
        mma_S: cute.TiledMma,
        mma_O: cute.TiledMma,
        copy_C: cute.TiledCopy,
        copy_Kp: cute.TiledCopy,
        SharedStorage: cutlass.Constexpr,
        divisors: TileDivisors,  # the grid's M blocks and splits (tile_scheduler.tile_divisors)
    ):
        sQn_layout, sQp_layout, sC_layout, sKp_layout, sP_layout, sC8_layout, sKp8_layout = smem_layouts
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tile = MlaTile.create(
            args, BlockInfo(self.tile_m, self.tile_n, self.qhead_per_kvhead_packed, self.variant, self.split_blocks),
            self.is_split, divisors)
        args = args.for_kv_head(tile.head_kv)  # a KV-head mode: this CTA's head of the caches
        if tile.rows_valid > 0:
            storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
            smem = _MlaSmem(
                storage.sQn.get_tensor(sQn_layout)[None, None, 0], storage.sQp.get_tensor(sQp_layout)[None, None, 0],
                storage.sC.get_tensor(sC_layout), storage.sKp.get_tensor(sKp_layout),
                storage.sP.get_tensor(sP_layout),
                storage.sScale.get_tensor(cute.make_layout((self.tile_m, 2))),
                storage.sInv.get_tensor(cute.make_layout((self.tile_m,))),
                storage.sC8.get_tensor(sC8_layout.outer, swizzle=sC8_layout.inner) if self.fp8 else None,
                storage.sKp8.get_tensor(sKp8_layout.outer, swizzle=sKp8_layout.inner) if self.fp8 else None,
                storage.mbar_full.data_ptr().toint(),
            )
            if tidx == 0:
                for s in cutlass.range_constexpr(self.stages):
                    mbarrier.init(mbarrier.nth(smem.full, s), self.roles.o_threads)
            cute.arch.barrier()  # the FULL mbarriers are initialised before anyone arrives
            if warp_idx < self.roles.s_warps:
                # An FP8 cache: the scores carry kv_descale.
                self.score_warps(tile.with_kv_descale(args), smem, mma_S, args.mLSE, tidx)
            else:
                self.output_warps(tile, smem, mma_O, copy_C, copy_Kp, args, tidx - self.roles.s_threads)

    # ------------------------------------------------------------------ S warps

    @cute.jit
    def score_warps(self, tile, smem, mma_S, mLSE, tidx):
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

        softmax = OnlineSoftmax(2 * cute.size(tSrQn, mode=[1]), Float32(tile.softmax_scale * LOG2_E))
        acc_shape = thr_mma.partition_shape_C((self.tile_m, self.tile_n))
        ops = _ScoreOps(mma_S, copy_A, copy_B, tSrQn, tSrQp, tSrC, tSrKp, tSsQn, tSsQp, tSsC, tSsKp, tScS_mn, tSsP)
        for i in cutlass.range(tile.n_tiles, unroll=1):
            self.score_tile(tile, smem, ops, softmax, i)

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
        cute.arch.barrier_arrive(barrier_id=int(Sm80MlaBarrier.FINAL), number_of_threads=n_all)
        if cutlass.const_expr(mLSE is not None):
            store_lse(lse, tScS_mn, tile.lse_rows(mLSE, self.qhead_per_kvhead_packed, self.is_split, False),
                      tile.m_block * self.tile_m, tile.rows_valid)

    @cute.jit
    def score_tile(self, tile, smem, ops, softmax, i):
        """Tile i: wait for its KV, S = Q K^T, mask (edge blocks only), softmax step,
        then P and the row corrections into P buffer i % 2 once the O warps freed it."""
        n_all = self.roles.threads
        stage, buf = i % self.stages, i % 2
        n_block = tile.n_block_max - 1 - i
        mbarrier.wait(mbarrier.nth(smem.full, stage), mbarrier.phase_of(i, self.stages))
        acc_S = self.qk(ops, stage)
        if n_block >= tile.n_mid_hi or n_block < tile.n_mid_lo:
            apply_to_scores(self.variant, acc_mn_view(acc_S), ops.tScS_mn, tile.ctx, tile.m_block * self.tile_m,
                            n_block * self.tile_n, self.qhead_per_kvhead_packed, tile.softmax_scale, True)
        row_scale = softmax.step(acc_S)
        if i >= 2:
            cute.arch.barrier(barrier_id=int(Sm80MlaBarrier.P_EMPTY) + buf, number_of_threads=n_all)
        rP = cute.make_fragment_like(acc_S, self.dtype)
        rP.store(acc_S.load().to(self.dtype))
        cute.autovec_copy(rP, ops.tSsP[None, None, None, buf])
        self.write_rows(smem.sScale[None, buf], row_scale, ops.tScS_mn)
        cute.arch.barrier_arrive(barrier_id=int(Sm80MlaBarrier.P_FULL) + buf, number_of_threads=n_all)

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

    # ------------------------------------------------------------------ O warps

    @cute.jit
    def output_warps(self, tile, smem, mma_O, copy_C, copy_Kp, args: MlaArgs, otidx):
        """Gathers Q and the KV tiles (cp.async), O += P V over 64 columns per warp,
        rescaled by the S warps' corrections; at the end O / row sum to gmem."""
        n_all, n_o = self.roles.threads, self.roles.o_threads
        thr_C, thr_Kp = copy_C.get_slice(otidx), copy_Kp.get_slice(otidx)
        # Q rows of this tile (packed: heads of one position adjacent). Rows past the end
        # re-read the last row (finite scores, never stored): only cp.async writes Q, so
        # the FULL mbarrier of tile 0, which tracks this thread's earlier copies, covers it.
        packed = self.qhead_per_kvhead_packed
        mQn_rows, mQp_rows = tile.q_rows(args.mQn, packed, False), tile.q_rows(args.mQp, packed, False)
        row0, last = tile.m_block * self.tile_m, tile.rows_valid - 1
        copy_rows(copy_C, thr_C.partition_D(smem.sQn),
                  thr_C.partition_S(cute.make_identity_tensor((self.tile_m, D_CKV))),
                  lambda r, m: mQn_rows[row0 + cutlass.min(r, last), None])
        copy_rows(copy_Kp, thr_Kp.partition_D(smem.sQp),
                  thr_Kp.partition_S(cute.make_identity_tensor((self.tile_m, D_KPE))),
                  lambda r, m: mQp_rows[row0 + cutlass.min(r, last), None])
        fp8 = None
        if cutlass.const_expr(self.fp8):
            # The first 128 O threads gather (one key each) and widen their chunks; the
            # loads in flight are the staging ring's.
            cute.arch.cp_async_commit_group()
            fp8 = MlaFp8Staging.create(args, smem.sC8, smem.sKp8, smem.sC, smem.sKp, self.dtype, 128, otidx % 128)
            for j in cutlass.range_constexpr(self.fp8_stages):
                if j < tile.n_tiles:
                    self.issue_fp8(fp8, tile, j, args, otidx)
                cute.arch.cp_async_commit_group()
            # The page lookup of the next gather is loaded a step early (loop-carried).
            page, row = self.lookup(fp8, tile, args, cutlass.min(self.fp8_stages, tile.n_tiles - 1), otidx)
            # Q and tile 0 landed (the older groups): S may start.
            cute.arch.cp_async_wait_group(self.fp8_stages - 1)
            if tile.n_tiles > 0:
                self.widen(fp8, 0, 0, otidx)
                mbarrier.arrive(mbarrier.nth(smem.full, 0))
        else:
            # A 16-bit cache: every O thread gathers its rows of each tile into its stage.
            gather = MlaGather.create(smem.sC, smem.sKp, self.dtype, n_o, otidx)
            for j in cutlass.range_constexpr(self.stages):
                if j < tile.n_tiles:
                    gather.issue(args, gather.lookup(tile, args, j, self.tile_n), j)
                    mbarrier.cp_async_arrive(mbarrier.nth(smem.full, j))

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
            if cutlass.const_expr(self.fp8):
                # Tile i + fp8_stages into tile i's staging (widened in the previous step):
                # the HBM reads run ahead of the KV ring, bounded by the staging alone.
                ahead = self.fp8_stages
                if i + ahead < tile.n_tiles:
                    if otidx < 128:
                        fp8.issue(args, i + ahead, page, row)
                cute.arch.cp_async_commit_group()
                page, row = self.lookup(fp8, tile, args, cutlass.min(i + ahead + 1, tile.n_tiles - 1), otidx)
            cute.arch.barrier(barrier_id=int(Sm80MlaBarrier.P_FULL) + buf, number_of_threads=n_all)
            if cutlass.const_expr(self.fp8):
                if i + 1 < tile.n_tiles:  # let the S warps start tile i + 1 while PV(i) runs
                    # Tile i + 1 landed (the newer groups: tiles i + 2 .. i + fp8_stages).
                    cute.arch.cp_async_wait_group(self.fp8_stages - 1)
                    self.widen(fp8, (i + 1) % self.fp8_stages, (i + 1) % self.stages, otidx)
                    mbarrier.arrive(mbarrier.nth(smem.full, (i + 1) % self.stages))
            self.scale_rows(acc_O, smem.sScale[None, buf], tOcO_mn)
            # One k16 slice of P and of V live at a time: 128 + 16 + 16 registers.
            for k in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
                cute.copy(copy_P, tOsP[None, None, k, buf], tOrP_cv[None, None, k])
                cute.copy(copy_V, tOsV[None, None, k, stage], tOrV_cv[None, None, k])
                cute.gemm(mma_O, acc_O, tOrP[None, None, k], tOrV[None, None, k], acc_O)
            if i + 2 < tile.n_tiles:
                cute.arch.barrier_arrive(barrier_id=int(Sm80MlaBarrier.P_EMPTY) + buf, number_of_threads=n_all)
            cute.arch.barrier(barrier_id=int(Sm80MlaBarrier.O_DONE), number_of_threads=n_o)
            if cutlass.const_expr(not self.fp8):
                # Refill the stage; its FULL phase completes when the copies land, without
                # any O thread waiting for them.
                if i + self.stages < tile.n_tiles:
                    gather.issue(args, gather.lookup(tile, args, i + self.stages, self.tile_n), stage)
                    mbarrier.cp_async_arrive(mbarrier.nth(smem.full, stage))

        # Nothing in flight at exit: with no KV tile (an empty sequence or split) no phase
        # tracked this thread's Q copies; otherwise they all landed already.
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier(barrier_id=int(Sm80MlaBarrier.FINAL), number_of_threads=n_all)
        self.scale_rows(acc_O, smem.sInv, tOcO_mn)
        tile.descale_o(args, acc_O)  # an FP8 cache: O carries kv_descale
        # Each row as the first + a static offset: one register for all rows of O (a row index
        # each was spilled across the mainloop: 3 STL / LDL).
        store_o(acc_O, self.out_dtype, tOcO_mn, tile.out_rows(args.mO, packed, self.is_split, False), row0,
                tile.rows_valid, rows_from_first=True)

    @cute.jit
    def scale_rows(self, acc_O: cute.Tensor, sRow: cute.Tensor, tOcO_mn: cute.Tensor):
        o_mn = acc_mn_view(acc_O)
        for r in cutlass.range_constexpr(cute.size(o_mn, mode=[0])):
            o_mn[r, None].store(o_mn[r, None].load() * sRow[tOcO_mn[0, 0][0] + _acc_row_offset(r)])

    @cute.jit
    def widen(self, fp8, slot, stage, otidx):
        """An FP8 cache: a loading thread's landed chunks of staging ``slot`` into 16-bit
        ``stage``."""
        if cutlass.const_expr(fp8 is not None):
            if otidx < 128:
                fp8.widen(slot, stage, self.dtype)

    @cute.jit
    def lookup(self, fp8, tile, args: MlaArgs, i, otidx):
        """An FP8 cache: (page, row) of a loading thread's key of tile i (``MlaFp8Staging.lookup``;
        zeros for the other O threads)."""
        page, row = Int32(0), Int32(0)
        if otidx < 128:
            page, row = fp8.lookup(tile, args, i, self.tile_n)
        return page, row

    @cute.jit
    def issue_fp8(self, fp8, tile, i, args: MlaArgs, otidx):
        """An FP8 cache: the first 128 O threads' cp.async of tile i's fp8 chunks into
        staging i % fp8_stages."""
        if otidx < 128:
            page, row = fp8.lookup(tile, args, i, self.tile_n)
            fp8.issue(args, i, page, row)


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
    sC8: Optional[cute.Tensor]  # an FP8 cache's staging (tile_n, 512, fp8_stages); else None
    sKp8: Optional[cute.Tensor]
    full: Int32  # shared address of the FULL mbarriers, one per KV stage (``mbarrier.nth``)


# ---------------------------------------------------------------------------------------
# Compilation from a compile key (planning and launch: sm80/mla.py).
# ---------------------------------------------------------------------------------------


def compile_mla_sm80(key: tuple):
    """Compiles the kernel for ``key`` (``keys.mla_key``; config ``(stages[, fp8_stages])``) on
    fake tensors: no GPU needed."""
    return compile_mla_from_key(key, MlaDecodeSm80)
