"""MLA decode for SM90 (Hopper): one producer warpgroup gathering the latent cache by
cp.async, two consumer warpgroups on asynchronous wgmma, each owning half of the
512-wide output (the FA3 layout of seed 000, written for this package).

One CTA computes ``tile_m`` = 64 packed rows (query position x head, heads fastest, as
``pack_gqa`` over one KV head) of one sequence [and one KV split] against the shared
latent cache: K = [ckv (512), kpe (64)], V = ckv. Any head count: the last tile of a
sequence may be partial (``mla_kernel`` docstring); the consumers zero its Q rows past the
end (``load_q``) and store no O or LSE row past it. Per KV tile of ``tile_n`` = 32 keys:

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
- warpgroups 1-2, the **consumers** (232 registers each). In the default ``qk="seesaw"``
  (FlashMLA's schedule) they take turns: warpgroup 0 computes S and the softmax of the
  even tiles, warpgroup 1 of the odd ones, each issuing S of its next tile before it waits
  for the other's P, so one's S runs under the other's softmax. The owner of a tile
  publishes P (over the stage's kpe rows, as below), its row corrections and its row
  maxima (the other adopts them: both keep the same running max, each sums only its own
  tiles' P, and the two row sums are added at the end); both add every tile's P V to
  their 256 columns (SS wgmma). See ``seesaw``.
  With ``qk="one"`` (the split of FlashInfer's fa3 MLA kernel, with our separate
  producer):
  - the **S warpgroup** (consumer 0) computes all of S (36 SS wgmma 64x32x16: Q and the
    stage), masks it (``apply_to_scores``), runs the online softmax, and publishes P
    (16-bit, stmatrix) with the 64 row corrections O owes before it (fp32, ``sXchg``);
    then its own O[:, 0:256] += P V. At the end it shares 1 / row sum and writes the LSE.
  - the **O warpgroup** (consumer 1) per tile waits for P, rescales O[:, 256:512] by the
    shared corrections and adds P V (2 wgmma 64x256x16); at the end it scales by the
    shared 1 / row sum. Registers: S warpgroup O 128 + S 16 + P 8 + statistics 6
    (highest register R179), O warpgroup O 128 + a few (R151); no spills.

  P lives over the stage's own kpe rows: 64 x 32 x 2 = 4 KB, exactly a kpe stage, read
  only by S, which has landed (wgmma waited) before P is written. The rows stay P until
  both warpgroups released the stage, so P needs no buffer and no empty barrier of its
  own, and the S warpgroup cannot lap the O warpgroup (the KV pipeline bounds it). Both
  warpgroups read P from there (SS): an RS copy in the S warpgroup's registers is
  written while its previous P V still reads them, and ptxas then serialises every
  wgmma of the kernel (C7513, a wait after each of the 78 HGMMA: see ``publish_p``).

  Critical path per tile: the S warpgroup issues S(n) (36 k-slices), then its P V(n - 1)
  (2), waits for S(n), runs the softmax and publishes P(n) before waiting for its P V,
  so the O warpgroup's P V(n) overlaps the S warpgroup's P V(n - 1) and S(n + 1).

  ``qk="split"`` (3 stages): each consumer computes S over half of the 36 k16 slices; the
  fp32 partials are summed through a 2 x 2 x 8 KB exchange (thread t of either warpgroup
  holds the same S elements: an elementwise exchange behind one named barrier, bit-
  identical sums) and each runs the softmax and its P V by RS wgmma, P from registers.

Synchronisation. KV pipeline: full = 128 cp.async arrives; empty = one arrive per
consumer warp (8), each warpgroup after the P V that last reads the stage. K and V are
the same ckv tile, so the S warpgroup holds two stages (S of tile n, P V of tile n - 1)
and two more are in flight from HBM (74 KB per SM; one, 37 KB, with the 3 stages of
"split"). "seesaw" needs three stages at least: a warpgroup waits for tile i + 1 before
it releases tile i - 1. P pipeline ("one", "seesaw"): a full mbarrier per stage, one
arrive per thread of the warpgroup that computed the stage's S, after its stmatrix, row
stores and proxy fence (generic-proxy stores read by wgmma); waited by a try_wait loop.
Named barriers (``named_barrier.Sm90MlaBarrier``): Q landed, the S exchange ("split"),
the final 1 / row sum ("one") or row sums ("seesaw").

Shared memory (bf16/fp16): Q 64 x 576 x 2 = 72 KB, 4 stages x 36 KB = 144 KB, the row
exchange (``MlaRoles.xchg_words``: "one" 64 x 5 x 4 = 1.25 KB; "seesaw" 64 x 8 x 4 B of
corrections and maxima and 2 KB of row sums, 4 KB), 16 mbarriers: 224 KB of the 227 KB
("split": 3 stages and a 32 KB exchange, 212 KB). O leaves straight from registers (2 adjacent columns per
store, fp32 partials for split-KV, merged by ``combine.py``), so no O buffer is borrowed.

FP8 latent cache (``roles.fp8_stages`` > 0): each producer thread gathers its own 16-byte
chunks of a tile (one row: 8 of ckv, 1 of kpe, one page lookup) by cp.async into an fp8
staging tile (``fp8_stages`` deep, 18 KB each, taken from one 16-bit stage), and, one
tile later, once ``cp.async.wait_group`` says its own chunks landed, widens exactly those
chunks into the 16-bit stage (no barrier among producer threads: the chunks are private),
fences them for wgmma and arrives on the stage's full barrier (``PipelineAsync``). The
consumers are unchanged; the scores and O carry ``kv_descale``.

Measured (H200, 2026-11-29, bf16, 64 heads, page 1, ``benchmarks/bench_mla.py``, two
runs): 3.06 / 3.11 TB/s at 768 x 2048 (``qk="split"``: 2.96; FlashInfer fa3 3.61), 3.08 /
3.07 at 768 x 1024 (2.94), 3.01 / 3.05 at 128 x 2048 (2.90), 1.81 at 128 heads page 64
(1.72). Kernel times (torch.profiler): 627 against 665 us at 768 x 2048, 56 against 60
at 128 x 1024, equal at 64 x 1024 and 1 x 32768 (split-KV). ncu at 768 x 2048: 557 us (585 with "split"), DRAM 72% of
peak (68%), tensor pipe 44% (41%), issue slots 35%; the largest stall is long
scoreboard (3.4 of 8.0 cycles between issues). The fourth stage bought 5 to 7%, not the
gap to FlashInfer: next suspects are the producer's gather issue rate (one dependent
page lookup per row) and TMA for page sizes >= 32.

2026-12-01 (H200, same runs): the consumers alone (gathers skipped) reach 3.80 TB/s at 768
x 2048 with "one", 4.33 with "seesaw" (128 heads 32 x 8192 page 64: 417 and 484 TFLOP/s);
the producer alone (consumers release at once) 4.01 / 3.95 TB/s (3.16 at 128 heads). The
whole kernel: 3.04 / 3.02 TB/s, 1.76 / 1.69 at 128 heads ("seesaw" / "one"). Neither side
bounds it: the consumers hold two of the four stages (S of the next tile, the current P V)
and a third until the previous P V lands, so one to two 37 KB stages are in flight against
HBM's latency (ncu,
"seesaw" 768 x 2048: DRAM 72%, tensor pipe 44%, long scoreboard 3.2 of the stalls per
issue, the producer's). Page lookups a tile ahead changed nothing (3.19 against 3.20);
bulk L2 prefetches of the rows two or four tiles ahead (``cp.async.bulk.prefetch.L2``, a
row per instruction) halved it (1.69 / 1.53 TB/s).

2026-12-02 (H200, ``results/mla_sm90_*_2026-12-02_s9.csv``): freeing a stage earlier did
not help. The seesaw's "other" warpgroup releasing tile i - 1 before it waits for tile i + 1
read 3.022 / 3.156 TB/s at 768 x 2048 against 3.011 / 3.101 (two passes; every row within
the passes' spread). FlashInfer fa3's shape in these roles (``qk="one"``, 2 stages of 64 keys)
read 2.843 against 3.010. The L2 runs at 85% of its throughput at 72% DRAM (seventh
session's ncu).

2026-12-02, FlashInfer fa3 under ncu beside this kernel at 768 x 2048
(``results/ncu/ncu_mla_{fi_fa3,sm90}_768x2048_2026-12-02_s10.txt``): 505 against 559 us, DRAM
79.1 against 71.4%, L2 88.4 against 84.6%; its grid is 132 persistent CTAs of two warpgroups
(256 threads, 227 registers) that both load and compute, ours 768 CTAs (5.82 waves) of three;
it issues 97.8 M instructions to our 186.7 M. A persistent schedule (no fill or drain per
sequence, no partial last wave) is what that profile pointed to. Tried the same day: one
CTA per SM over this kernel's tile order, the KV and P pipeline states carried from tile to
tile (commit 55c08bd, reverted in 46bb4c5; its GPU tests passed): 768 x 2048
595.4 / 595.6 us one CTA per tile against 597.5 / 592.5 persistent, 128 heads 128 x 2048
page 64 180.0 / 181.3 against 177.6 / 177.8, every other row within 0.6%
(``results/mla_persistent_ab_*_2026-12-02_s11.csv``). The fill, drain and last wave are not
the gap; the steady state is. Not kept.
"""

from dataclasses import dataclass
from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32
from cutlass.cute.nvgpu import warpgroup

from flash_attn_cute.device.block_info import BlockInfo
from flash_attn_cute.host.constants import D_CKV, D_KPE
from flash_attn_cute.device.cute_utils import launch_ctas
from flash_attn_cute.device.epilogue import store_lse, store_o
from flash_attn_cute.device.layout_utils import acc_mn_view, acc_to_operand_a, row_major_smem_layout, transpose_view
from flash_attn_cute.device.mla_kernel import (MlaArgs, MlaFp8Staging, MlaGather, MlaTile, compile_mla_from_key,
                                               load_q_rows, mla_call, set_mla_config)
from flash_attn_cute.device.named_barrier import Sm90MlaBarrier
from flash_attn_cute.sm90.config import MlaRoles, TMA_MODES, mla_roles
from flash_attn_cute.sm90.mla_decode_tma import MlaDecodeSm90Tma
from flash_attn_cute.sm90.wgmma_utils import convert_pairs, kv_release, kv_wait, wgmma_gemm
from flash_attn_cute.device.softmax import LOG2_E, OnlineSoftmax
from flash_attn_cute.device.tile_scheduler import SingleTileScheduler, TileDivisors, tile_divisors
from flash_attn_cute.device.variants import apply_to_scores


class MlaDecodeSm90:
    __call__ = mla_call  # the MLA kernels' shared entry point: MlaArgs -> launch

    def __init__(self, dtype, qhead_per_kvhead: int, causal: bool, is_split: bool, split_blocks: int,
                 roles: MlaRoles = MlaRoles()):
        set_mla_config(self, dtype, qhead_per_kvhead, causal, is_split, split_blocks)
        self.roles = roles

    @cute.jit
    def launch(self, args: MlaArgs, stream):
        r = self.roles
        kv_dtype = args.mCkv.element_type
        self.fp8 = kv_dtype.width == 8
        assert self.fp8 == (r.fp8_stages > 0), "an FP8 cache needs staging stages (sm90/mla.py roles)"
        # An FP8 cache's staging tiles (each producer thread reads back only its own chunks).
        sC8_layout, sKp8_layout, c8_field, kp8_field = MlaFp8Staging.smem(kv_dtype, r.tile_n, r.fp8_stages)
        layouts = (
            row_major_smem_layout(self.dtype, r.tile_m, D_CKV), row_major_smem_layout(self.dtype, r.tile_m, D_KPE),
            row_major_smem_layout(self.dtype, r.tile_n, D_CKV, r.stages), row_major_smem_layout(self.dtype, r.tile_n, D_KPE, r.stages),
            # "one": P of a stage, K-major A operand, over the same bytes as its kpe rows.
            row_major_smem_layout(self.dtype, r.tile_m, r.tile_n, r.stages), sC8_layout, sKp8_layout,
        )

        @cute.struct
        class SharedStorage:
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2 * r.stages]
            mbar_p: cute.struct.MemRange[cutlass.Int64, 2 * r.stages]
            sQn: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layouts[0])], 1024]
            sQp: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layouts[1])], 1024]
            sC: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layouts[2])], 1024]
            sKp: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layouts[3])], 1024]
            sXchg: cute.struct.Align[cute.struct.MemRange[Float32, r.xchg_words], 16]
            sC8: c8_field  # an FP8 cache's staging (16-byte stand-ins otherwise)
            sKp8: kp8_field

        k_major, mn_major = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        # S: one warpgroup-wide 64 x 32 product. O: the two consumer warpgroups side by side
        # along N, 64 x 256 each; P from registers (RS, qk="split") or from shared memory
        # (SS, qk="one").
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, k_major, k_major, Float32, atom_layout_mnk=(1, 1, 1),
            tiler_mn=(r.tile_m, r.tile_n))
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, k_major, mn_major, Float32, atom_layout_mnk=(1, r.num_consumer_wgs, 1),
            tiler_mn=(r.tile_m, r.o_cols), a_source=warpgroup.OperandSource.RMEM)
        tiled_mma_pv_ss = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, k_major, mn_major, Float32, atom_layout_mnk=(1, r.num_consumer_wgs, 1),
            tiler_mn=(r.tile_m, r.o_cols))
        num_m_blocks = args.num_m_blocks(r.tile_m, self.qhead_per_kvhead_packed)
        launch_ctas(self.kernel(args, tile_divisors(num_m_blocks, args.num_splits), layouts, tiled_mma_qk,
                                tiled_mma_pv, tiled_mma_pv_ss, SharedStorage),
                    SingleTileScheduler.grid(num_m_blocks, args.num_kv_heads(), args.num_splits, args.batch_size),
                    r.threads,
                    SharedStorage, stream, setmaxnreg=True)

    @cute.kernel
    def kernel(
        self,
        args: MlaArgs,
        divisors: TileDivisors,  # the grid's M blocks and splits (tile_scheduler.tile_divisors)
        smem_layouts: tuple,  # Qn, Qp, ckv, kpe, P, fp8 staging ckv and kpe
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        tiled_mma_pv_ss: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        sQn_layout, sQp_layout, sC_layout, sKp_layout, sP_layout, sC8_layout, sKp8_layout = smem_layouts
        r = self.roles
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        # Full: one cp.async arrive per producer thread once its copies landed (an FP8 cache:
        # one plain arrive per producer thread once it widened and fenced its chunks). Empty:
        # one arrive per consumer warp (of both warpgroups) after the P V that last reads the stage.
        kv_pipeline = pipeline.PipelineAsync if cutlass.const_expr(self.fp8) else pipeline.PipelineCpAsync
        pipeline_kv = kv_pipeline.create(
            barrier_storage=storage.mbar_kv.data_ptr(), num_stages=r.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, r.producer_threads),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, r.consumer_threads // 32),
            defer_sync=True,
        )
        # qk="one" / "seesaw", P of a stage: full = one arrive per thread of the warpgroup
        # that computed the stage's S, once it wrote P and the row corrections (and maxima).
        # Its empty side is never used: the stage's KV release already orders the next write
        # (see ``publish_p``).
        pipeline_p = None
        if cutlass.const_expr(r.qk != "split"):
            pipeline_p = pipeline.PipelineAsync.create(
                barrier_storage=storage.mbar_p.data_ptr(), num_stages=r.stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4),
                defer_sync=True,
            )
        pipeline.pipeline_init_arrive()
        smem = _Sm90Smem(
            storage.sQn.get_tensor(sQn_layout.outer, swizzle=sQn_layout.inner),
            storage.sQp.get_tensor(sQp_layout.outer, swizzle=sQp_layout.inner),
            storage.sC.get_tensor(sC_layout.outer, swizzle=sC_layout.inner),
            storage.sKp.get_tensor(sKp_layout.outer, swizzle=sKp_layout.inner),
            storage.sKp.get_tensor(sP_layout.outer, swizzle=sP_layout.inner),
            storage.sXchg.get_tensor(cute.make_layout(r.xchg_words)),
            storage.sC8.get_tensor(sC8_layout.outer, swizzle=sC8_layout.inner) if self.fp8 else None,
            storage.sKp8.get_tensor(sKp8_layout.outer, swizzle=sKp8_layout.inner) if self.fp8 else None,
        )
        tile = MlaTile.create(
            args, BlockInfo(r.tile_m, r.tile_n, self.qhead_per_kvhead_packed, self.variant, self.split_blocks),
            self.is_split, divisors)
        pipeline.pipeline_init_wait()
        if tile.rows_valid > 0:
            if warp_idx < r.producer_threads // 32:
                cute.arch.setmaxregister_decrease(r.producer_regs)
                if tile.n_tiles > 0:
                    if cutlass.const_expr(self.fp8):
                        self.load_fp8(tile, smem, pipeline_kv, args, tidx)
                    else:
                        self.load(tile, smem, pipeline_kv, args, tidx)
            else:
                cute.arch.setmaxregister_increase(r.consumer_regs)
                self.mma(tile, smem, pipeline_kv, pipeline_p, tiled_mma_qk, tiled_mma_pv, tiled_mma_pv_ss, args,
                         tidx - r.producer_threads)

    # ------------------------------------------------------------------ producer

    @cute.jit
    def load(self, tile, smem, pipeline_kv, args: MlaArgs, tidx):
        """Tiles n_block_max - 1 down to n_block_min (the first visited is the only one the
        sequence end can cut), one stage each, gathered row by row."""
        r = self.roles
        # A KV-head mode: this CTA's head of the caches, taken inside each role so that its
        # pointers are not live across setmaxnreg (taken before the split, the causal
        # even-split 4/hkv key kept 9 local-memory instructions in its prologue, against the
        # 8 of the 3-D key it matches here; the other keys tried keep none either way).
        args = args.for_kv_head(tile.head_kv)
        gather = MlaGather.create(smem.sC, smem.sKp, self.dtype, r.producer_threads, tidx)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, r.stages)
        for i in cutlass.range(tile.n_tiles, unroll=1):
            pages = gather.lookup(tile, args, i, r.tile_n)  # before the wait for a free stage
            pipeline_kv.producer_acquire(state)
            gather.issue(args, pages, state.index)
            pipeline_kv.producer_commit(state)
            state.advance()
        # Keep the CTA alive until the consumers released every stage it filled.
        pipeline_kv.producer_tail(state)

    @cute.jit
    def load_fp8(self, tile, smem, pipeline_kv, args: MlaArgs, tidx):
        """An FP8 cache: each thread gathers its chunks of tile i + fp8_stages - 1 into the
        staging, then widens its own (landed) chunks of tile i into tile i's 16-bit stage
        (``mla_kernel.MlaFp8Staging``)."""
        r = self.roles
        ahead = r.fp8_stages - 1
        args = args.for_kv_head(tile.head_kv)  # as in ``load``
        fp8 = MlaFp8Staging.create(args, smem.sC8, smem.sKp8, smem.sC, smem.sKp, self.dtype, r.producer_threads, tidx)
        last = tile.n_tiles - 1
        for p in cutlass.range_constexpr(ahead):
            if p < tile.n_tiles:
                page, row = fp8.lookup(tile, args, p, r.tile_n)
                fp8.issue(args, p, page, row)
            cute.arch.cp_async_commit_group()
        # The page lookup of the next gather is loaded a step early (loop-carried).
        page, row = fp8.lookup(tile, args, cutlass.min(ahead, last), r.tile_n)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, r.stages)
        for i in cutlass.range(tile.n_tiles, unroll=1):
            if i + ahead < tile.n_tiles:
                fp8.issue(args, i + ahead, page, row)
            cute.arch.cp_async_commit_group()
            page, row = fp8.lookup(tile, args, cutlass.min(i + ahead + 1, last), r.tile_n)
            cute.arch.cp_async_wait_group(ahead)  # this thread's chunks of tile i landed
            pipeline_kv.producer_acquire(state)
            fp8.widen(i % r.fp8_stages, state.index, self.dtype)
            # Generic-proxy stores, read next by wgmma (async proxy).
            cute.arch.fence_view_async_shared()
            pipeline_kv.producer_commit(state)
            state.advance()
        pipeline_kv.producer_tail(state)

    # ------------------------------------------------------------------ consumers

    @cute.jit
    def load_q(self, tile, smem, args: MlaArgs, cidx):
        """Q rows gathered by the consumers themselves (``mla_kernel.load_q_rows``), made
        visible to wgmma (async proxy) before either warpgroup issues."""
        r = self.roles
        load_q_rows(tile, smem.sQn, smem.sQp, args, self.dtype, self.qhead_per_kvhead_packed, r.tile_m,
                    r.consumer_threads, cidx)
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=int(Sm90MlaBarrier.CONSUMERS), number_of_threads=r.consumer_threads)

    @cute.jit
    def mma(self, tile, smem, pipeline_kv, pipeline_p, tiled_mma_qk, tiled_mma_pv, tiled_mma_pv_ss, args: MlaArgs,
            cidx):
        """Consumer warpgroups: their operands and accumulators, Q, the KV loop, the final
        normalisation and the epilogue. qk="seesaw": both run ``seesaw``, warpgroup 0 first;
        qk="split": both run ``mainloop``; qk="one": warpgroup 0 runs it (``s_warpgroup``),
        warpgroup 1 ``o_warpgroup``."""
        r = self.roles
        wg_idx = cute.arch.make_warp_uniform(cidx // 128)
        # wgmma operands are warpgroup-wide descriptors: partition by the first thread.
        wg_qk = tiled_mma_qk.get_slice(0)
        wg_pv = tiled_mma_pv.get_slice(wg_idx * 128)
        wg_pv_ss = tiled_mma_pv_ss.get_slice(wg_idx * 128)
        thr_qk = tiled_mma_qk.get_slice(cidx % 128)
        # P stores of the S warpgroup (qk="one"): two stmatrix x4 per thread and tile.
        stsm = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        thr_stsm = cute.make_tiled_copy_C(stsm, tiled_mma_qk).get_slice(cidx % 128)
        ops = _Sm90Ops(
            tiled_mma_qk, tiled_mma_pv, tiled_mma_pv_ss,
            wg_qk.make_fragment_A(wg_qk.partition_A(smem.sQn)), wg_qk.make_fragment_A(wg_qk.partition_A(smem.sQp)),
            wg_qk.make_fragment_B(wg_qk.partition_B(smem.sC)), wg_qk.make_fragment_B(wg_qk.partition_B(smem.sKp)),
            wg_pv.make_fragment_B(wg_pv.partition_B(transpose_view(smem.sC))),
            wg_pv_ss.make_fragment_A(wg_pv_ss.partition_A(smem.sP)),
            thr_stsm, thr_stsm.partition_D(smem.sP),
            acc_mn_view(thr_qk.partition_C(cute.make_identity_tensor((r.tile_m, r.tile_n)))),
            smem.sXchg,
        )
        acc_O = cute.make_rmem_tensor(tiled_mma_pv.partition_shape_C((r.tile_m, D_CKV)), Float32)
        acc_O.fill(0.0)
        lse = cute.make_rmem_tensor((cute.size(ops.tScS_mn, mode=[0]),), Float32)
        self.load_q(tile, smem, args, cidx)
        args = args.for_kv_head(tile.head_kv)  # a KV-head mode: its descale column (as in ``load``)
        tile_s = tile.with_kv_descale(args)  # an FP8 cache: the scores carry kv_descale
        if cutlass.const_expr(r.qk == "split"):
            self.s_warpgroup(tile_s, ops, pipeline_kv, None, acc_O, lse, cidx)
        elif cutlass.const_expr(r.qk == "seesaw"):
            if wg_idx == 0:
                self.seesaw(tile_s, ops, pipeline_kv, pipeline_p, acc_O, lse, cidx, True)
            else:
                self.seesaw(tile_s, ops, pipeline_kv, pipeline_p, acc_O, lse, cidx, False)
        elif wg_idx == 0:
            self.s_warpgroup(tile_s, ops, pipeline_kv, pipeline_p, acc_O, lse, cidx)
        else:
            self.o_warpgroup(tile, ops, pipeline_kv, pipeline_p, acc_O)
        tile.descale_o(args, acc_O)  # and O, its V
        self.epilogue(tile, acc_O, lse, ops, args.mO, args.mLSE, cidx, wg_idx)

    @cute.jit
    def s_warpgroup(self, tile, ops, pipeline_kv, pipeline_p, acc_O, lse, cidx):
        """A warpgroup that computes S (all of it, or its half with qk="split"): the KV loop,
        then O normalised and the LSE; with qk="one" it also shares 1 / row sum."""
        r = self.roles
        tOrP = None
        if cutlass.const_expr(pipeline_p is None):
            # P in 16 bits laid out like S (pairwise conversion), read through the A view.
            tOrP = acc_to_operand_a(cute.make_rmem_tensor(ops.mma_qk.partition_shape_C((r.tile_m, r.tile_n)),
                                                          self.dtype))
        softmax = OnlineSoftmax(cute.size(ops.tScS_mn, mode=[0]), Float32(tile.softmax_scale * LOG2_E))
        # The correction O still owes, applied just before the next P V (loop-carried):
        # rescaling 128 registers while Q K^T runs keeps it off the critical path.
        scale_carry = cute.make_rmem_tensor((softmax.num_rows,), Float32)
        scale_carry.fill(1.0)
        if tile.n_tiles > 0:
            self.mainloop(tile, ops, pipeline_kv, pipeline_p, softmax, acc_O, tOrP, scale_carry, cidx)
        if cutlass.const_expr(pipeline_p is not None):
            self.share_inv_sum(ops, softmax)
        softmax.finalize(acc_O, lse)

    @cute.jit
    def mainloop(self, tile, ops, pipeline_kv, pipeline_p, stats: OnlineSoftmax, acc_O, tOrP, scale_carry, cidx):
        """Tiles n_block_max - 1 down to n_block_min: S(n) by SS wgmma in flight with O += P(n+1) V(n+1),
        the softmax of S(n) while P V still runs. qk="split": P from registers (RS).
        qk="one" (``pipeline_p``): P(n) and its row corrections go to shared memory as soon
        as the softmax is done, for warpgroup 1 and for this warpgroup's own P V (SS)."""
        r = self.roles
        wg_idx = cute.arch.make_warp_uniform(cidx // 128)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, r.stages)
        kv_wait(pipeline_kv, state, True)
        acc_S = self.qk(ops, state.index, wg_idx)
        warpgroup.wait_group(0)
        self.sum_s_halves(ops, acc_S, wg_idx, cidx, 0)
        # The first tile's correction multiplies an O of zeros: 1 (as carried) keeps it so.
        self.softmax(ops, tile, stats, acc_S, tile.n_block_max - 1)
        self.share_p(ops, pipeline_p, state, acc_S, tOrP, scale_carry)
        for i in cutlass.range(tile.n_tiles - 1, unroll=1):
            state_v = state.clone()
            state.advance()
            kv_wait(pipeline_kv, state, True)
            acc_S = self.qk(ops, state.index, wg_idx)
            self.rescale_o(stats, acc_O, scale_carry)
            self.p_wait(pipeline_p, state_v)
            self.pv(ops, pipeline_p, acc_O, tOrP, state_v, -1)
            warpgroup.wait_group(1)  # S landed (the older group); P V may still run
            self.sum_s_halves(ops, acc_S, wg_idx, cidx, (i + 1) % 2)
            scale_carry.store(self.softmax(ops, tile, stats, acc_S, tile.n_block_max - 2 - i).load())
            if cutlass.const_expr(pipeline_p is not None):
                # P to smem while this warpgroup's P V still runs: the other's P V(n) waits
                # only on this softmax, not on the end of P V(n + 1) here.
                self.share_p(ops, pipeline_p, state, acc_S, tOrP, scale_carry)
            warpgroup.wait_group(0)  # P V landed: P and the stage are free
            kv_release(pipeline_kv, state_v, True)
            if cutlass.const_expr(pipeline_p is None):
                self.share_p(ops, pipeline_p, state, acc_S, tOrP, scale_carry)
        self.rescale_o(stats, acc_O, scale_carry)
        self.p_wait(pipeline_p, state)
        self.pv(ops, pipeline_p, acc_O, tOrP, state, 0)
        kv_release(pipeline_kv, state, True)

    @cute.jit
    def pv(self, ops, pipeline_p, acc_O, tOrP, state, wg_wait: cutlass.Constexpr[int]):
        """O[:, this warpgroup's columns] += P V of one stage: P from registers (RS), or with
        qk="one" from the stage's P tile (SS; the caller waited on its P barrier)."""
        if cutlass.const_expr(pipeline_p is None):
            wgmma_gemm(ops.mma_pv, acc_O, tOrP, ops.tOrVt[None, None, None, state.index], False, wg_wait)
        else:
            wgmma_gemm(ops.mma_pv_ss, acc_O, ops.tOsP[None, None, None, state.index],
                       ops.tOrVt[None, None, None, state.index], False, wg_wait)

    @cute.jit
    def p_wait(self, pipeline_p, state):
        """qk="one" / "seesaw": the stage's P and row corrections are written and fenced by
        every thread of the warpgroup that computed its S. Its own wgmma needs this too
        (other warps wrote most of P);
        for it the barrier completed a softmax ago, so the wait costs one probe. A try_wait
        loop, not ``consumer_wait`` (try_wait then NANOSLEEP): the O warpgroup waits here
        every tile; H200, 2026-11-29: 627 against 632 us at 768 x 2048, 56 against 59 us
        at 128 x 1024 (kernel times, torch.profiler)."""
        if cutlass.const_expr(pipeline_p is not None):
            ready = pipeline_p.consumer_try_wait(state)
            while not ready:
                ready = pipeline_p.consumer_try_wait(state)

    @cute.jit
    def share_p(self, ops, pipeline_p, state, acc_S, tOrP, row_scale):
        """P of ``state`` where P V reads it: registers (qk="split"; the caller waited for
        the P V reading the previous P), or shared memory (``publish_p``)."""
        if cutlass.const_expr(pipeline_p is None):
            convert_pairs(acc_S, cute.make_tensor(tOrP.iterator, acc_S.layout))
        else:
            self.publish_p(ops, pipeline_p, state, acc_S, row_scale)

    @cute.jit
    def publish_p(self, ops, pipeline_p, state, acc_S, row_scale, row_max=None):
        """qk="one" / "seesaw": P (16-bit) over the kpe rows of S's own stage, and the row
        corrections O owes before it (and, ``row_max``, the row maxima the other warpgroup
        adopts), then one arrive per thread on the stage's P barrier. The kpe
        rows are free: S of this stage landed (wgmma waited), and only S reads them. They
        stay P until both warpgroups released the stage, so no empty barrier is needed.
        P V reads P from here in both warpgroups: an RS copy in registers would be the
        conversion's own registers, written before the wgmma wait of the P V still reading
        the previous P, and ptxas then serialises every wgmma of the kernel (C7513)."""
        rP = cute.make_fragment_like(acc_S, self.dtype)
        convert_pairs(acc_S, rP)
        cute.copy(ops.thr_stsm, ops.thr_stsm.retile(rP), ops.tPsP[None, None, None, state.index])
        self.write_rows(ops, state.index, row_scale)
        if cutlass.const_expr(row_max is not None):  # qk="seesaw": the other warpgroup adopts it
            self.write_rows(ops, self.roles.stages + state.index, row_max)
        # Generic-proxy stores, read next by the other warpgroup's wgmma (async proxy).
        cute.arch.fence_view_async_shared()
        pipeline_p.producer_commit(state)

    def rows_view(self, ops) -> cute.Tensor:
        """sXchg's per-row values as (tile_m, ``MlaRoles.row_cols``) (qk="one" / "seesaw")."""
        return cute.make_tensor(ops.sXchg.iterator, cute.make_layout((self.roles.tile_m, self.roles.row_cols)))

    @cute.jit
    def write_rows(self, ops, col, vals):
        """sXchg[row, col] = vals[r] for this thread's rows (qk="one" / "seesaw"): the four
        lanes of a row hold the same value, the one at column 0 writes it."""
        sRows = self.rows_view(ops)
        if ops.tScS_mn[0, 0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(vals)):
                sRows[ops.tScS_mn[r, 0][0], col] = vals[r]

    @cute.jit
    def scale_rows(self, ops, acc_O, col):
        """O rows *= sXchg[row, col] (qk="one", the O warpgroup: thread t holds the rows
        thread t of the S warpgroup wrote)."""
        sRows = self.rows_view(ops)
        o_mn = acc_mn_view(acc_O)
        for r in cutlass.range_constexpr(cute.size(ops.tScS_mn, mode=[0])):
            o_mn[r, None].store(o_mn[r, None].load() * sRows[ops.tScS_mn[r, 0][0], col])

    @cute.jit
    def share_inv_sum(self, ops, stats: OnlineSoftmax):
        """qk="one": 1 / row sum (0 for a row that saw no key) for the O warpgroup, the value
        ``OnlineSoftmax.finalize`` applies here."""
        self.write_rows(ops, self.roles.stages, stats.inv_row_sums())
        cute.arch.barrier_arrive(barrier_id=int(Sm90MlaBarrier.STATS), number_of_threads=self.roles.consumer_threads)

    @cute.jit
    def o_warpgroup(self, tile, ops, pipeline_kv, pipeline_p, acc_O):
        """qk="one", warpgroup 1: per tile, wait for P and the row corrections, rescale its
        O half, O += P V by SS wgmma (P and V both from the stage), release the stage; at
        the end, O / row sum from the S warpgroup."""
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.roles.stages)
        for _ in cutlass.range(tile.n_tiles, unroll=1):
            self.p_wait(pipeline_p, state)
            kv_wait(pipeline_kv, state, True)  # landed long ago: the S warpgroup waited on it
            self.scale_rows(ops, acc_O, state.index)
            self.pv(ops, pipeline_p, acc_O, None, state, 0)
            kv_release(pipeline_kv, state, True)
            state.advance()
        cute.arch.barrier(barrier_id=int(Sm90MlaBarrier.STATS), number_of_threads=self.roles.consumer_threads)
        self.scale_rows(ops, acc_O, self.roles.stages)

    @cute.jit
    def seesaw(self, tile, ops, pipeline_kv, pipeline_p, acc_O, lse, cidx, first: cutlass.Constexpr[bool]):
        """qk="seesaw": warpgroup 0 (``first``) computes S and the softmax of the even tiles,
        warpgroup 1 of the odd ones, and both add every tile's P V to their halves of O.
        Its own tile: S was issued a step early; wait for it, fold it into the statistics
        (whose row max is already the previous tile's, ``adopt``), publish P, the row
        corrections and maxima, rescale O and issue P V (``own_step``). The other's tile:
        issue S of the next own tile first, so that its wgmma runs under the other
        warpgroup's softmax, then wait for the other's P and statistics, apply them and
        issue P V (``other_step``). Each step leaves its P V in flight; at an own step the
        wgmma groups in flight are S(i), P V(i - 1) in that order, at an other step P V(i - 1),
        S(i + 1). No wgmma issue is conditional (ptxas serialises every wgmma of the kernel
        otherwise): past the last tile S is computed on a stale stage and dropped."""
        r = self.roles
        stats = OnlineSoftmax(cute.size(ops.tScS_mn, mode=[0]), Float32(tile.softmax_scale * LOG2_E))
        n = tile.n_tiles
        if n > 0:
            acc_S = cute.make_rmem_tensor(ops.mma_qk.partition_shape_C((r.tile_m, r.tile_n)), Float32)
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, r.stages)
            prev = state.clone()  # tile i - 1's stage, released once this warpgroup's P V of it landed
            if cutlass.const_expr(first):
                kv_wait(pipeline_kv, state, True)
                self.issue_s(ops, acc_S, state.index)
                self.own_step(tile, ops, pipeline_kv, pipeline_p, stats, acc_S, acc_O, state, prev, 0, 0)
                prev = state.clone()
                state.advance()
            for p in cutlass.range((n - 1) // 2 if first else n // 2, unroll=1):
                i = 2 * p + (1 if first else 0)
                self.other_step(tile, ops, pipeline_kv, pipeline_p, stats, acc_S, acc_O, state, prev, i)
                prev = state.clone()
                state.advance()
                self.own_step(tile, ops, pipeline_kv, pipeline_p, stats, acc_S, acc_O, state, prev, i + 1, 1)
                prev = state.clone()
                state.advance()
            # The last tile is warpgroup 1's for an even count, else warpgroup 0's.
            if n % 2 == (0 if first else 1):
                self.other_step(tile, ops, pipeline_kv, pipeline_p, stats, acc_S, acc_O, state, prev, n - 1)
                warpgroup.wait_group(0)
                kv_release(pipeline_kv, state, True)
            else:
                warpgroup.wait_group(0)
                kv_release(pipeline_kv, prev, True)
        self.sum_row_sums(ops, stats, cidx)
        stats.finalize(acc_O, lse)

    @cute.jit
    def own_step(self, tile, ops, pipeline_kv, pipeline_p, stats: OnlineSoftmax, acc_S, acc_O, state, prev, i,
                 s_wait: cutlass.Constexpr[int]):
        """qk="seesaw", tile i is this warpgroup's: S(i) (issued a step ago) into the
        statistics, P(i) and its row corrections and maxima out, O rescaled, P V(i) issued.
        ``s_wait``: the wgmma groups after S(i) (P V(i - 1); none at tile 0)."""
        warpgroup.wait_group(s_wait)  # S(i) landed; P V(i - 1) may still run
        row_scale = self.softmax(ops, tile, stats, acc_S, tile.n_block_max - 1 - i)
        self.publish_p(ops, pipeline_p, state, acc_S, row_scale, stats.row_max)
        if cutlass.const_expr(s_wait > 0):
            warpgroup.wait_group(0)  # P V(i - 1) landed: O may be rescaled, its stage is free
            kv_release(pipeline_kv, prev, True)
        stats.rescale_o(acc_O, row_scale)
        self.p_wait(pipeline_p, state)  # every warp's part of P
        self.pv(ops, pipeline_p, acc_O, None, state, -1)

    @cute.jit
    def other_step(self, tile, ops, pipeline_kv, pipeline_p, stats: OnlineSoftmax, acc_S, acc_O, state, prev, i):
        """qk="seesaw", tile i is the other warpgroup's: S(i + 1) issued, then the other's
        P(i) and statistics applied and P V(i) issued."""
        nxt = state.clone()
        nxt.advance()
        if i + 1 < tile.n_tiles:
            kv_wait(pipeline_kv, nxt, True)
        self.issue_s(ops, acc_S, nxt.index)
        self.p_wait(pipeline_p, state)
        warpgroup.wait_group(1)  # P V(i - 1) landed (S(i + 1) may still run)
        if i > 0:
            kv_release(pipeline_kv, prev, True)
        self.adopt(ops, stats, acc_O, state.index)
        kv_wait(pipeline_kv, state, True)  # landed long ago: the other warpgroup waited on it
        self.pv(ops, pipeline_p, acc_O, None, state, -1)

    @cute.jit
    def issue_s(self, ops, acc_S, stage):
        """S = Qn ckv^T + Qp kpe^T of one stage, one wgmma group (not waited)."""
        n_slices, p_slices = cute.size(ops.tSrQn, mode=[2]), cute.size(ops.tSrQp, mode=[2])
        self.issue_qk(ops, acc_S, stage, ((0, n_slices), (0, p_slices)))

    @cute.jit
    def adopt(self, ops, stats: OnlineSoftmax, acc_O, col):
        """qk="seesaw": the other warpgroup's softmax step of the tile in stage ``col``: its
        row max becomes ours, and O and our row sums take its correction."""
        sRows = self.rows_view(ops)
        row_scale = cute.make_rmem_tensor((stats.num_rows,), Float32)
        for m in cutlass.range_constexpr(stats.num_rows):
            row = ops.tScS_mn[m, 0][0]
            row_scale[m] = sRows[row, col]
            stats.row_max[m] = sRows[row, self.roles.stages + col]
            stats.row_sum[m] = stats.row_sum[m] * row_scale[m]
        stats.rescale_o(acc_O, row_scale)

    @cute.jit
    def sum_row_sums(self, ops, stats: OnlineSoftmax, cidx):
        """qk="seesaw": each warpgroup summed only its own tiles' P (both at the final row
        max): thread t of either holds the same rows, so the partial sums are exchanged
        thread by thread through shared memory, behind one named barrier."""
        r = self.roles
        t, wg = cidx % 128, cidx // 128
        sSums = cute.make_tensor(ops.sXchg.iterator + r.tile_m * r.row_cols,
                                 cute.make_layout((stats.num_rows, 128, 2)))
        for m in cutlass.range_constexpr(stats.num_rows):
            sSums[m, t, wg] = stats.row_sum[m]
        cute.arch.barrier(barrier_id=int(Sm90MlaBarrier.STATS), number_of_threads=r.consumer_threads)
        for m in cutlass.range_constexpr(stats.num_rows):
            stats.row_sum[m] = stats.row_sum[m] + sSums[m, t, 1 - wg]

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
        if cutlass.const_expr(self.roles.qk != "split"):
            self.issue_s(ops, acc_S, stage)
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
        """qk="split": S = own half + the other warpgroup's, through shared memory. Thread t
        of either warpgroup holds the same S elements, so the exchange is elementwise; the
        sums are bit-identical in both (fp32 addition commutes). Two buffers by tile
        parity: a warpgroup rewrites buffer b only after the next tile's barrier, which
        the other passes only after reading b."""
        if cutlass.const_expr(self.roles.qk == "split"):
            n = cute.size(acc_S)
            t = cidx % 128
            sX = cute.make_tensor(ops.sXchg.iterator,
                                  cute.make_layout((n, 128, 2, 2), stride=(128, 1, 128 * n, 256 * n)))
            for v in cutlass.range_constexpr(n):
                sX[v, t, wg_idx, buf] = acc_S[v]
            cute.arch.barrier(barrier_id=int(Sm90MlaBarrier.XCHG), number_of_threads=self.roles.consumer_threads)
            for v in cutlass.range_constexpr(n):
                acc_S[v] = acc_S[v] + sX[v, t, 1 - wg_idx, buf]

    @cute.jit
    def softmax(self, ops, tile, softmax: OnlineSoftmax, acc_S, n_block):
        """Masks block n_block where it needs it (sequence end, causal diagonal) and folds
        it into the running statistics: acc_S becomes P (fp32); returns the correction O
        owes before P V."""
        r = self.roles
        if n_block >= tile.n_mid_hi or n_block < tile.n_mid_lo:
            apply_to_scores(self.variant, acc_mn_view(acc_S), ops.tScS_mn, tile.ctx, tile.m_block * r.tile_m,
                            n_block * r.tile_n, self.qhead_per_kvhead_packed, tile.softmax_scale, True)
        return softmax.step(acc_S)

    @cute.jit
    def epilogue(self, tile, acc_O, lse, ops, mO, mLSE, cidx, wg_idx):
        """Each warpgroup stores its 256 columns from registers, rows past the last query
        skipped; warpgroup 0 writes the LSE (the S warpgroup with qk="one"; with "split" and
        "seesaw" both hold the same)."""
        r = self.roles
        packed = self.qhead_per_kvhead_packed
        o_rows = tile.out_rows(mO, packed, self.is_split, False)
        tOcO_mn = acc_mn_view(ops.mma_pv.get_slice(cidx).partition_C(cute.make_identity_tensor((r.tile_m, D_CKV))))
        row0 = tile.m_block * r.tile_m
        store_o(acc_O, self.out_dtype, tOcO_mn, o_rows, row0, tile.rows_valid, cols_from_first=True)
        if cutlass.const_expr(mLSE is not None):
            store_lse(lse, ops.tScS_mn, tile.lse_rows(mLSE, packed, self.is_split, False), row0, tile.rows_valid,
                      group_writes=wg_idx == 0)


@dataclass(frozen=True)
class _Sm90Smem:
    sQn: cute.Tensor  # (64, 512)
    sQp: cute.Tensor  # (64, 64)
    sC: cute.Tensor  # (tile_n, 512, stages): K's first 512 columns and V
    sKp: cute.Tensor  # (tile_n, 64, stages)
    sP: cute.Tensor  # (64, tile_n, stages): qk="one" / "seesaw", P over the same bytes as sKp
    sXchg: cute.Tensor  # flat fp32, see MlaRoles.xchg_words
    sC8: Optional[cute.Tensor]  # an FP8 cache's staging (tile_n, 512, fp8_stages); else None
    sKp8: Optional[cute.Tensor]  # (tile_n, 64, fp8_stages)


@dataclass(frozen=True)
class _Sm90Ops:
    """The consumers' MMAs, wgmma operand fragments (descriptors) and S coordinates."""

    mma_qk: cute.TiledMma
    mma_pv: cute.TiledMma  # P from registers (qk="split")
    mma_pv_ss: cute.TiledMma  # P from shared memory (qk="one" / "seesaw", both warpgroups)
    tSrQn: cute.Tensor
    tSrQp: cute.Tensor
    tSrC: cute.Tensor  # (.., stages)
    tSrKp: cute.Tensor
    tOrVt: cute.Tensor  # this warpgroup's 256 columns of V^T, (.., stages)
    tOsP: cute.Tensor  # P as the SS A operand, (.., stages)
    thr_stsm: cute.ThrCopy  # P registers -> smem (stmatrix)
    tPsP: cute.Tensor  # this thread's stmatrix destinations in sP, (.., stages)
    tScS_mn: cute.Tensor
    sXchg: cute.Tensor


# ---------------------------------------------------------------------------------------
# Compilation from a compile key (planning and launch: sm90/mla.py).
# ---------------------------------------------------------------------------------------


def compile_mla_sm90(key: tuple):
    """Compiles the kernel for ``key`` (``keys.mla_key``; config ``((tile_n, stages, qk[,
    fp8_stages]),)``, qk one of ``config.TMA_MODES``: ``mla_decode_tma.MlaDecodeSm90Tma``) on fake tensors: no GPU
    needed."""

    def make(dtype, heads, causal, is_split, split_blocks, config):
        if config[2] in TMA_MODES:
            return MlaDecodeSm90Tma(dtype, heads, causal, is_split, split_blocks, lag_max=config[2] == "tma_lag",
                                    mask_runs=config[2] != "tma")
        return MlaDecodeSm90(dtype, heads, causal, is_split, split_blocks, mla_roles(*config))

    return compile_mla_from_key(key, make)
