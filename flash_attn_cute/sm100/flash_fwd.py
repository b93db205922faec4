"""FlashAttention forward kernel for SM100 (Blackwell): TMA, tcgen05 MMAs, tensor memory.

One CTA computes a (q_stage * 128) x d_v block of O for one (batch, head[, split]). The
M tile is cut into ``q_stage`` independent 128-row stages (one tcgen05 MMA tile each):
2 for prefill, so that the softmax of one stage hides the MMAs of the other; 1 for
decode-shaped problems (rows <= 128, and by default with split-KV), where a second stage
would only compute padding.

Warp roles (``WarpRoles``), all of one CTA:

* load warp: TMA of the Q stages (once) and of K and V one ``tile_n`` block at a time
  into ``kv_stages``-deep smem rings (``PipelineTmaUmma``: full = TMA bytes landed,
  empty = the MMA warp's tcgen05.commit once its MMAs have read the stage). A paged
  cache is read through the page table: one TMA a block where a page holds whole blocks
  (pages of a multiple of 128 keys), else ``kv_box`` = 16, 32 or 64 rows a TMA, each box
  through its own page-table entry (pages of another multiple of 16; ``host.paging``),
  into a row-major view of the stage (the same bytes as the MMA's operand layout,
  ``_check_row_major_view``).
* MMA warp: one thread issues ``tcgen05.mma``: S_s = Q_s K^T into tensor memory (TMEM),
  then O_s += P_s V with P_s read from TMEM (the "TS" form: P never touches smem).
  Issue order per block: PV_s(n-1), then QK_s(n) into the same columns (tcgen05 MMAs of
  one thread execute in order, so P_s is read before S_s is overwritten).
* softmax warpgroup per stage: thread t owns row t of its stage: tcgen05.ld of its S row
  (no cross-thread reduction at all), mask / score modifier through the variant,
  ``OnlineSoftmax.step``, P converted to 16 bits (FP8 Q, K, V: e4m3, at 2^8 of its row
  max, four a column) and tcgen05.st back into the second half of S's columns.
* correction warpgroup: rescales O_s in TMEM by the softmax's per-row correction before
  the MMA warp may issue the next PV_s (skipped per warp when no row max moved), then is
  the epilogue: O_s normalised from TMEM to global memory and the LSE.
* FP8 K/V only, two widening warps: the load warp's TMA puts the fp8 blocks in staging
  rings (``FP8_STAGES`` deep, half the bytes of a 16-bit block); the widening warps turn
  each into the 16-bit K or V stage the MMA warp reads (exact: every fp8 value is a
  16-bit value), zeroing V rows past a cache's length, and signal it like a TMA would
  (``PipelineAsyncUmma``: shared stores, proxy fence, arrive). ``k_descale`` joins the
  softmax scale, ``v_descale`` O's final scale.
* FP8 K/V with the queries quantized (``quantize_q``, on request: ``sm100.quantizes_q``):
  no staging and no widening; each softmax warpgroup first loads its 128-row stage of the
  16-bit Q, stores it into sQ in e4m3 with one power-of-two scale (``q_quant``; 2^e joins
  its softmax scale) and arrives on Q's mbarrier in place of the load warp's TMA; then the
  kernel runs as for FP8 Q, K, V (e4m3 MMAs, P in e4m3).

TMEM (512 columns x 128 lanes of 32 bits): S_0 [0, n), S_1 [n, 2n), O_0, O_1 after them;
P_s aliases the upper half of S_s. Handshakes are mbarriers (``_Barriers``); every role
walks the same KV blocks, computed from the shared ``BlockInfo``.
"""

from dataclasses import replace

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.cutlass_dsl import extract_mlir_values, new_from_mlir_values

from flash_attn_cute.device.block_info import BlockInfo
from flash_attn_cute.device.copy_utils import aligned_row_ptr, gmem_tiled_copy, widen_fp8
from flash_attn_cute.device.cute_utils import launch_ctas
from flash_attn_cute.device.fwd_kernel import (FwdArgs, FwdTile, compile_from_key, fwd_call, set_fwd_config, tile_grid,
                                               tile_work, zero_rows_from)
from flash_attn_cute.device.layout_utils import row_major_smem_layout, select  # fp8 staging: one TMA box each
from flash_attn_cute.device.named_barrier import Sm100FwdBarrier
from flash_attn_cute.device.paged_kv import box_in_page, clamp_page, kv_box_index, page_and_row, page_entry
from flash_attn_cute.device.q_quant import quantize_q_tile
from flash_attn_cute.host.keys import QUANTIZE_Q, parse_kv_box
from flash_attn_cute.sm100.config import (FP8_STAGES, HEAD_DIM_PAIRS, SMEM_LIMIT, TILE_M, TMEM_COLUMNS, WarpRoles,
                                          tmem_alloc_columns, tmem_columns)
from flash_attn_cute.device.softmax import FP8_P_OFFSET, LOG2_E, OnlineSoftmax
from flash_attn_cute.device.tile_scheduler import TileDivisors
from flash_attn_cute.device.variants import AttentionVariant, apply_to_scores


# How far (log2 units) a 16-bit P's running row max may lag the true one (``OnlineSoftmax``):
# P then reaches 2^8 = 256, far inside fp16 / bf16, and O is rescaled only when a row's max
# grows by more than 256x. FA4's SM100 kernel uses 8 for 16-bit Q (its note "Low Precision
# Scaling"). Compile-verified only, like the rest of this kernel.
RESCALE_THRESHOLD = 8.0


# ---------------------------------------------------------------------------------------
# mbarrier handshakes between the roles
# ---------------------------------------------------------------------------------------


class _Barriers:
    """Per-stage mbarriers (one completion per KV block; the waiter's phase is the
    block's parity, which is unambiguous because every producer waits, directly or
    through another role, for its previous completion to be consumed):

    * s_full[s]     MMA -> softmax: S_s of this block is in TMEM (tcgen05.commit; it also
                    means every earlier MMA, the previous PV_s included, completed)
    * p_full[s]     softmax -> MMA: P_s is in TMEM (128 arrivals)
    * scale_ready[s] softmax -> correction: the row correction of this block is in smem,
                    or (the last completion) the final 1/rowsum and LSE (128 arrivals)
    * o_rescaled[s] correction -> MMA: O_s is rescaled, the next PV_s may accumulate (128)
    * o_final[s]    MMA -> softmax, correction: the last PV_s completed (tcgen05.commit)
    """

    KINDS = ("s_full", "p_full", "scale_ready", "o_rescaled", "o_final")
    COUNTS = (1, TILE_M, TILE_M, TILE_M, 1)

    def __init__(self, base_ptr, q_stage: int):
        self.base = base_ptr
        self.q_stage = q_stage

    # A runtime value for the DSL (it is carried through dynamic loops and branches).
    def __extract_mlir_values__(self):
        return extract_mlir_values(self.base)

    def __new_from_mlir_values__(self, values):
        return _Barriers(new_from_mlir_values(self.base, values), self.q_stage)

    def ptr(self, kind: str, stage: int):
        return self.base + self.KINDS.index(kind) * self.q_stage + stage

    @staticmethod
    def init(base_ptr, q_stage: int):
        for k, count in enumerate(_Barriers.COUNTS):
            for s in range(q_stage):
                cute.arch.mbarrier_init(base_ptr + k * q_stage + s, count)

    def wait(self, kind: str, stage: int, phase):
        cute.arch.mbarrier_wait(self.ptr(kind, stage), phase)

    def arrive(self, kind: str, stage: int):
        cute.arch.mbarrier_arrive(self.ptr(kind, stage))

    def commit(self, kind: str, stage: int):
        """Arrives once every tcgen05 MMA issued so far by this thread completed."""
        tcgen05.commit(self.ptr(kind, stage))


# ---------------------------------------------------------------------------------------
# The kernel
# ---------------------------------------------------------------------------------------


class FlashAttnFwdSm100:
    __call__ = fwd_call  # the forward kernels' shared entry point: FwdArgs -> launch

    def __init__(self, dtype, head_dim: int, head_dim_v: int, tile: tuple, variant: AttentionVariant,
                 qhead_per_kvhead_packed: int = 1, is_split: bool = False, split_blocks: int = 0,
                 ex2_emulate_every: int = 0, q_class: int = 0, quantize_q: bool = False, kv_box: int = 0):
        """``tile`` = (q_stage, tile_n, kv_stages), as ``sm100.select_tile`` plans it;
        ``ex2_emulate_every``: ``sm100.ex2_share``; ``quantize_q``: 16-bit queries over an
        e4m3 cache quantized to e4m3 in the kernel (``sm100.quantizes_q``); ``kv_box``: a paged
        cache read in TMA boxes of this many rows (0: one box a block)."""
        set_fwd_config(self, dtype, head_dim, head_dim_v, variant, qhead_per_kvhead_packed, is_split, split_blocks,
                       q_class, HEAD_DIM_PAIRS)
        head_dim, head_dim_v = self.head_dim, self.head_dim_v  # the tile's widths (padded head dims)
        q_stage, tile_n, kv_stages = tile
        assert q_stage in (1, 2) and tile_n == 128
        assert head_dim % 16 == 0 and head_dim_v % 16 == 0
        assert TILE_M % qhead_per_kvhead_packed == 0, "packed GQA rows must tile the 128-row TMA box"
        self.q_stage = q_stage
        self.ex2_emulate_every = ex2_emulate_every
        assert not quantize_q or dtype.width == 16, "quantize_q: 16-bit queries"
        self.quantize_q = quantize_q
        self.tile_m = TILE_M * q_stage
        self.tile_n = tile_n
        self.kv_stages = kv_stages
        assert kv_box == 0 or tile_n % kv_box == 0, (kv_box, tile_n)
        self.kv_box = kv_box
        self.roles = WarpRoles(q_stage)
        self.tmem_s_offset = [s * tile_n for s in range(q_stage)]
        self.tmem_o_offset = [q_stage * tile_n + s * head_dim_v for s in range(q_stage)]
        self.tmem_p_offset = [off + tile_n // 2 for off in self.tmem_s_offset]  # P (16-bit) in S's upper half
        self.tmem_cols = tmem_alloc_columns(tmem_columns(q_stage, tile_n, head_dim_v))
        assert tmem_columns(q_stage, tile_n, head_dim_v) <= TMEM_COLUMNS
        self.mma_tiler_qk = (TILE_M, tile_n, head_dim)
        self.mma_tiler_pv = (TILE_M, head_dim_v, tile_n)
        # The output is stored straight from the correction warps' registers, 128 bits at a time.
        self.epi_cols = 32

    @cute.jit
    def launch(self, args: FwdArgs, stream):
        if cutlass.const_expr(args.mLeftpadK is not None):
            # One TMA box per page and KV block: a key start inside a page needs row gathers
            # (the backend's check refuses it; the SM80 kernel runs such a call).
            raise ValueError("the SM100 kernel does not read a paged cache from a per-sequence key start (mLeftpadK)")
        cta_group = tcgen05.CtaGroup.ONE
        kv_dtype = args.mK.element_type
        # The MMAs' operand type: Q's, or e4m3 where the kernel quantizes 16-bit Q (as FP8 Q, K, V).
        op = kv_dtype if self.quantize_q else self.dtype
        self.op_dtype = op
        tiled_mma_qk = sm100_utils.make_trivial_tiled_mma(
            op, op, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, Float32, cta_group,
            self.mma_tiler_qk[:2],
        )
        # P comes from TMEM (K-major), V from smem with d_v contiguous (MN-major).
        tiled_mma_pv = sm100_utils.make_trivial_tiled_mma(
            op, op, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN, Float32, cta_group,
            self.mma_tiler_pv[:2], tcgen05.OperandSource.TMEM,
        )
        sQ_layout = sm100_utils.make_smem_layout_a(tiled_mma_qk, self.mma_tiler_qk, op, self.q_stage)
        sK_layout = sm100_utils.make_smem_layout_b(tiled_mma_qk, self.mma_tiler_qk, op, self.kv_stages)
        sV_layout = sm100_utils.make_smem_layout_b(tiled_mma_pv, self.mma_tiler_pv, op, self.kv_stages)
        tP_layout = sm100_utils.make_smem_layout_a(tiled_mma_pv, self.mma_tiler_pv, op, 1)
        # quantize_q: the softmax warpgroups store their stage's e4m3 Q through a (128, d) row-major
        # view of sQ's memory (``q_quant`` partitions by row and column), the same bytes as the
        # K-major operand layout the MMA reads (``_check_row_major_view``).
        sQq_layout = row_major_smem_layout(op, TILE_M, self.head_dim, self.q_stage)
        if cutlass.const_expr(self.quantize_q):
            _check_row_major_view(sQ_layout, sQq_layout, TILE_M, self.head_dim, self.q_stage)

        # TMA views, the head (and batch / page) modes last:
        #   Q: (rows, d, h[, b]); packed GQA rows are ((g, s), d, h_kv[, b]): the g =
        #      qhead_per_kvhead_packed query heads of a KV head are one box mode, so the 128-row
        #      box is a 3-D TMA box.
        #   K: (s_k, d, h_kv[, b | pages]);  V: (d_v, s_k, h_kv[, b | pages]) (the MN-major B of P V).
        if cutlass.const_expr(args.varlen_q):
            q_modes = [0, 2, 1]
        else:
            q_modes = [1, 3, 2, 0]
        mQ_t = select(args.mQ, q_modes)
        if cutlass.const_expr(self.qhead_per_kvhead_packed > 1):
            mQ_t = self._pack_q_view(mQ_t)
        if cutlass.const_expr(args.varlen_k):
            k_modes, v_modes = [0, 2, 1], [2, 0, 1]
        else:
            k_modes, v_modes = [1, 3, 2, 0], [3, 1, 2, 0]
        tma_load = cpasync.CopyBulkTensorTileG2SOp(cta_group)
        tma_atom_Q, tma_Q = None, None  # quantize_q: the softmax warpgroups load Q
        if cutlass.const_expr(not self.quantize_q):
            tma_atom_Q, tma_Q = cute.nvgpu.make_tiled_tma_atom_A(
                tma_load, mQ_t, cute.select(sQ_layout, mode=[0, 1, 2]), self.mma_tiler_qk, tiled_mma_qk,
            )
        # FP8 K/V under 16-bit queries: staged in fp8 and widened (unless the queries are
        # quantized). FP8 Q, K and V (fp8_qkv) and quantize_q need no widening: the tcgen05
        # MMAs read e4m3 operands (V MN-major included), P is stored to TMEM in e4m3, 4 a column.
        self.fp8 = kv_dtype.width == 8 and self.dtype.width == 16 and not self.quantize_q
        # FP8: (tile_n, d) row-major staging tiles, one TMA box of the (keys, d, ...) view each.
        sK8_layout = row_major_smem_layout(kv_dtype, self.tile_n, self.head_dim, FP8_STAGES)
        sV8_layout = row_major_smem_layout(kv_dtype, self.tile_n, self.head_dim_v, FP8_STAGES)
        # Boxes of kv_box rows into the operand stages: their row-major (tile_n, d) views, the
        # same bytes as the MMA's K-major K and MN-major V layouts (checked while tracing).
        sKr_layout = row_major_smem_layout(op, self.tile_n, self.head_dim, self.kv_stages)
        sVr_layout = row_major_smem_layout(op, self.tile_n, self.head_dim_v, self.kv_stages)
        if cutlass.const_expr(self.kv_box and not self.fp8):
            _check_row_major_view(sK_layout, sKr_layout, self.tile_n, self.head_dim, self.kv_stages)
            _check_row_major_view(sV_layout, sVr_layout, self.tile_n, self.head_dim_v, self.kv_stages, mn_major=True)
        if cutlass.const_expr(self.fp8 or self.kv_box):
            # Row boxes of the (keys, d, h_kv[, b | pages]) views: a staging tile's (tile_n
            # rows), or kv_box rows of a stage (fp8 staging or the operand stage).
            rows_modes = [0, 2, 1] if args.varlen_k else [1, 3, 2, 0]
            rows = self.kv_box or self.tile_n
            box_dtype = kv_dtype if self.fp8 else op
            tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), select(args.mK, rows_modes),
                row_major_smem_layout(box_dtype, rows, self.head_dim), (rows, self.head_dim))
            tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), select(args.mV, rows_modes),
                row_major_smem_layout(box_dtype, rows, self.head_dim_v), (rows, self.head_dim_v))
            if cutlass.const_expr(self.fp8):
                kv_tx = (cute.size_in_bytes(kv_dtype, cute.select(sK8_layout, mode=[0, 1])),
                         cute.size_in_bytes(kv_dtype, cute.select(sV8_layout, mode=[0, 1])))
            else:  # a block's boxes fill one stage
                kv_tx = (cute.size_in_bytes(op, cute.select(sK_layout, mode=[0, 1, 2])),
                         cute.size_in_bytes(op, cute.select(sV_layout, mode=[0, 1, 2])))
        else:
            tma_atom_K, tma_K = cute.nvgpu.make_tiled_tma_atom_B(
                tma_load, select(args.mK, k_modes), cute.select(sK_layout, mode=[0, 1, 2]), self.mma_tiler_qk,
                tiled_mma_qk,
            )
            tma_atom_V, tma_V = cute.nvgpu.make_tiled_tma_atom_B(
                tma_load, select(args.mV, v_modes), cute.select(sV_layout, mode=[0, 1, 2]), self.mma_tiler_pv,
                tiled_mma_pv,
            )
            kv_tx = (cute.size_in_bytes(op, cute.select(sK_layout, mode=[0, 1, 2])),
                     cute.size_in_bytes(op, cute.select(sV_layout, mode=[0, 1, 2])))
        q_tx = 0 if self.quantize_q else self.q_stage * cute.size_in_bytes(op, cute.select(sQ_layout, mode=[0, 1, 2]))
        tx_bytes = (q_tx, *kv_tx)
        align8 = 1024 if self.fp8 else 16
        k8_elems, v8_elems = (cute.cosize(sK8_layout), cute.cosize(sV8_layout)) if self.fp8 else (16, 16)
        k8_field = cute.struct.Align[cute.struct.MemRange[kv_dtype, k8_elems], align8]
        v8_field = cute.struct.Align[cute.struct.MemRange[kv_dtype, v8_elems], align8]
        fp8_bars = 2 * FP8_STAGES if self.fp8 else 1

        @cute.struct
        class SharedStorage:
            mbar_Q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_K: cute.struct.MemRange[cutlass.Int64, 2 * self.kv_stages]
            mbar_V: cute.struct.MemRange[cutlass.Int64, 2 * self.kv_stages]
            mbar_roles: cute.struct.MemRange[cutlass.Int64, 5 * self.q_stage]
            tmem_holding_buf: Int32
            # Per row: the correction of the current block, then 1 / rowsum and the LSE.
            sStats: cute.struct.MemRange[Float32, 3 * self.q_stage * TILE_M]
            # quantize_q: each softmax warp's amax of its Q stage.
            sQAmax: cute.struct.MemRange[Float32, 4 * self.q_stage if self.quantize_q else 1]
            sQ: cute.struct.Align[cute.struct.MemRange[op, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[op, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[op, cute.cosize(sV_layout)], 1024]
            mbar_K8: cute.struct.MemRange[cutlass.Int64, fp8_bars]
            mbar_V8: cute.struct.MemRange[cutlass.Int64, fp8_bars]
            sK8: k8_field  # fp8: the staging rings (16-byte stand-ins otherwise)
            sV8: v8_field

        assert SharedStorage.size_in_bytes() <= SMEM_LIMIT, (SharedStorage.size_in_bytes(), SMEM_LIMIT)
        grid, grid_divisors, num_m_blocks, _ = tile_grid(args, self.tile_m, self.qhead_per_kvhead_packed)
        kernel = self.kernel(
            args, (tma_Q, tma_K, tma_V), (tma_atom_Q, tma_atom_K, tma_atom_V),
            (sQ_layout, sK_layout, sV_layout, tP_layout, sK8_layout, sV8_layout, sQq_layout, sKr_layout, sVr_layout),
            tiled_mma_qk, tiled_mma_pv,
            tx_bytes,
            SharedStorage,
            grid_divisors,
        )
        launch_ctas(kernel, grid, self.roles.num_threads, SharedStorage, stream, setmaxnreg=True)

    def _pack_q_view(self, mQ_t: cute.Tensor) -> cute.Tensor:
        """(s, d, h[, b]) -> ((g, s), d, h_kv[, b]), g = qhead_per_kvhead_packed: row (j, i)
        is query i of head h_kv * g + j (the packed row order of ``pack_gqa.packed_rows``)."""
        shape, stride = mQ_t.shape, mQ_t.stride
        rows = ((self.qhead_per_kvhead_packed, shape[0]), (stride[2], stride[0]))
        heads = (shape[2] // self.qhead_per_kvhead_packed, stride[2] * self.qhead_per_kvhead_packed)
        modes = [rows, (shape[1], stride[1]), heads] + ([(shape[3], stride[3])] if cute.rank(mQ_t) == 4 else [])
        layout = cute.make_layout(tuple(m[0] for m in modes), stride=tuple(m[1] for m in modes))
        return cute.make_tensor(mQ_t.iterator, layout)

    @cute.kernel
    def kernel(self, args: FwdArgs, tma_views: tuple, tma_atoms: tuple, smem_layouts: tuple,
               tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma, tx_bytes: cutlass.Constexpr,
               SharedStorage: cutlass.Constexpr, grid_divisors: TileDivisors):
        """``args``: the caller's tensors (Q and K for shapes only: loads go through the TMA
        views) and scalars; ``smem_layouts``: Q, K, V and P's (TMEM) operand layouts, then
        the fp8 K and V staging, Q's row-major view (quantize_q), K's and V's (boxes); ``grid_divisors``: what
        ``tile_work`` divides the block index by (``tile_grid``)."""
        tma_Q, tma_K, tma_V = tma_views
        tma_atom_Q, tma_atom_K, tma_atom_V = tma_atoms
        sQ_layout, sK_layout, sV_layout, tP_layout, sK8_layout, sV8_layout, sQq_layout, sKr_layout, sVr_layout = \
            smem_layouts
        roles = self.roles
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == roles.load_warp:
            for atom in (tma_atom_Q, tma_atom_K, tma_atom_V):
                if cutlass.const_expr(atom is not None):
                    cpasync.prefetch_descriptor(atom)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        one_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        if cutlass.const_expr(self.quantize_q):
            # One arrive per softmax warpgroup, once its stage of Q is stored and fenced.
            pipeline_q = pipeline.PipelineAsyncUmma.create(
                barrier_storage=storage.mbar_Q.data_ptr(), num_stages=1,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.q_stage),
                consumer_group=one_thread, defer_sync=True,
            )
        else:
            pipeline_q = pipeline.PipelineTmaUmma.create(
                barrier_storage=storage.mbar_Q.data_ptr(), num_stages=1, producer_group=one_thread,
                consumer_group=one_thread, tx_count=tx_bytes[0], defer_sync=True,
            )
        pipeline_k8, pipeline_v8 = None, None
        if cutlass.const_expr(self.fp8):
            # TMA -> widening warps (one release per warp), widening threads -> MMA warp.
            widen_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, len(roles.widen_warps))
            widen_threads = pipeline.CooperativeGroup(pipeline.Agent.Thread, 32 * len(roles.widen_warps))
            pipeline_k8, pipeline_v8 = (
                pipeline.PipelineTmaAsync.create(
                    barrier_storage=mbar.data_ptr(), num_stages=FP8_STAGES, producer_group=one_thread,
                    consumer_group=widen_warps, tx_count=tx, defer_sync=True,
                )
                for mbar, tx in ((storage.mbar_K8, tx_bytes[1]), (storage.mbar_V8, tx_bytes[2]))
            )
            pipeline_k, pipeline_v = (
                pipeline.PipelineAsyncUmma.create(
                    barrier_storage=mbar.data_ptr(), num_stages=self.kv_stages, producer_group=widen_threads,
                    consumer_group=one_thread, defer_sync=True,
                )
                for mbar in (storage.mbar_K, storage.mbar_V)
            )
        else:
            pipeline_k = pipeline.PipelineTmaUmma.create(
                barrier_storage=storage.mbar_K.data_ptr(), num_stages=self.kv_stages, producer_group=one_thread,
                consumer_group=one_thread, tx_count=tx_bytes[1], defer_sync=True,
            )
            pipeline_v = pipeline.PipelineTmaUmma.create(
                barrier_storage=storage.mbar_V.data_ptr(), num_stages=self.kv_stages, producer_group=one_thread,
                consumer_group=one_thread, tx_count=tx_bytes[2], defer_sync=True,
            )
        if warp_idx == roles.load_warp:
            with cute.arch.elect_one():
                _Barriers.init(storage.mbar_roles.data_ptr(), self.q_stage)
        bars = _Barriers(storage.mbar_roles.data_ptr(), self.q_stage)
        # Softmax, correction and MMA warps touch TMEM: they meet once the MMA warp allocated it.
        tmem_users = 32 * (roles.num_softmax_warps + 4 + 1)
        tmem_barrier = pipeline.NamedBarrier(barrier_id=int(Sm100FwdBarrier.TMEM_ALLOC), num_threads=tmem_users)
        tmem = cutlass.utils.TmemAllocator(
            storage.tmem_holding_buf.ptr, barrier_for_retrieve=tmem_barrier, allocator_warp_id=roles.mma_warp,
        )
        pipeline.pipeline_init_arrive()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sStats = storage.sStats.get_tensor(cute.make_layout((TILE_M, 3, self.q_stage)))
        sK8, sV8 = None, None
        if cutlass.const_expr(self.fp8):
            sK8 = storage.sK8.get_tensor(sK8_layout.outer, swizzle=sK8_layout.inner)
            sV8 = storage.sV8.get_tensor(sV8_layout.outer, swizzle=sV8_layout.inner)

        pipeline.pipeline_init_wait()

        # Each role derives the tile after its register reconfiguration, so that little
        # stays live across setmaxnreg. A tile past the end of its sequence has no work.
        # The sink enters the non-split kernel's finalize; a split kernel leaves it to the combine.
        mSink = args.mLearnableSink if cutlass.const_expr(not self.is_split) else None
        if warp_idx >= roles.mma_warp:
            cute.arch.setmaxregister_decrease(roles.other_regs)
            tile = self.tile_of(args, grid_divisors)
            if tile.rows_valid > 0:
                if warp_idx == roles.load_warp:
                    if tile.n_block_max > tile.n_block_min:
                        if cutlass.const_expr(self.fp8):  # into the staging rings
                            self.load(tma_Q, tma_K, tma_V, args.mPageTable, sQ, sK8, sV8, tma_atom_Q, tma_atom_K,
                                      tma_atom_V, tiled_mma_qk, tiled_mma_pv, pipeline_q, pipeline_k8, pipeline_v8,
                                      tile, args.varlen_q, args.varlen_k, args.paged)
                        else:
                            sK_load, sV_load = sK, sV  # where the TMA writes the operand stages
                            if cutlass.const_expr(self.kv_box):  # their row-major views
                                sK_load = storage.sK.get_tensor(sKr_layout.outer, swizzle=sKr_layout.inner)
                                sV_load = storage.sV.get_tensor(sVr_layout.outer, swizzle=sVr_layout.inner)
                            self.load(tma_Q, tma_K, tma_V, args.mPageTable, sQ, sK_load, sV_load, tma_atom_Q,
                                      tma_atom_K, tma_atom_V, tiled_mma_qk, tiled_mma_pv, pipeline_q, pipeline_k,
                                      pipeline_v, tile, args.varlen_q, args.varlen_k, args.paged)
                if cutlass.const_expr(self.fp8):
                    if warp_idx >= roles.widen_warps[0]:
                        if tile.n_block_max > tile.n_block_min:
                            self.widen(sK8, sV8, sK, sV, (pipeline_k8, pipeline_v8, pipeline_k, pipeline_v), tile,
                                       args.cache_tail_may_be_garbage, tidx - 32 * roles.widen_warps[0])
                if warp_idx == roles.mma_warp:
                    tmem.allocate(self.tmem_cols)
                    tmem.wait_for_alloc()
                    tmem_ptr = tmem.retrieve_ptr(Float32)
                    if tile.n_block_max > tile.n_block_min:
                        self.mma(tmem_ptr, sQ, sK, sV, tP_layout, tiled_mma_qk, tiled_mma_pv,
                                 pipeline_q, pipeline_k, pipeline_v, bars, tile,
                                 args.cache_tail_may_be_garbage and not self.fp8)  # fp8: zeroed as widened
                    tmem.relinquish_alloc_permit()
                    # Every TMEM reader is done: free it.
                    tmem_barrier.arrive_and_wait()
                    tmem.free(tmem_ptr, self.tmem_cols)
        elif warp_idx < roles.num_softmax_warps:
            cute.arch.setmaxregister_increase(roles.softmax_regs)
            tile = self.tile_of(args, grid_divisors)
            if tile.rows_valid > 0:
                tmem.wait_for_alloc()
                tmem_ptr = tmem.retrieve_ptr(Float32)
                if tile.n_block_max > tile.n_block_min:
                    quant = None
                    if cutlass.const_expr(self.quantize_q):
                        sQq = storage.sQ.get_tensor(sQq_layout.outer, swizzle=sQq_layout.inner)
                        quant = (tile.q_rows(args.mQ, self.qhead_per_kvhead_packed, args.varlen_q), sQq,
                                 storage.sQAmax.get_tensor(cute.make_layout((4, self.q_stage))), pipeline_q)
                    # fp8 K: k_descale joins the softmax scale (read only by a tile with rows)
                    self.softmax_loop(tmem_ptr, tiled_mma_qk, sStats, bars, tile.with_k_descale(args), warp_idx // 4,
                                      tidx % TILE_M, mSink, quant)
                tmem_barrier.arrive()
        else:
            cute.arch.setmaxregister_decrease(roles.correction_regs)
            tile = self.tile_of(args, grid_divisors)
            if tile.rows_valid > 0:
                tmem.wait_for_alloc()
                tmem_ptr = tmem.retrieve_ptr(Float32)
                self.correction_loop(tmem_ptr, tiled_mma_pv, sStats, bars, args.mO, args.mLSE, tile, tidx % TILE_M,
                                     args.varlen_q, mSink, args.mVDescale)
                tmem_barrier.arrive()

    def block_info(self) -> BlockInfo:
        return BlockInfo(self.tile_m, self.tile_n, self.qhead_per_kvhead_packed, self.variant, self.split_blocks,
                         self.q_class)

    def tile_of(self, args: FwdArgs, grid_divisors: TileDivisors) -> FwdTile:
        """This CTA's tile, as each role derives it (``fwd_kernel.tile_work``)."""
        work = tile_work(args, grid_divisors, self.tile_m, self.qhead_per_kvhead_packed)
        return FwdTile.create(args, work, self.block_info(), self.is_split)

    # -----------------------------------------------------------------------------------
    # Load warp
    # -----------------------------------------------------------------------------------

    @cute.jit
    def load(self, tma_Q, tma_K, tma_V, mPageTable, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V,
             tiled_mma_qk, tiled_mma_pv, pipeline_q, pipeline_k, pipeline_v, tile,
             varlen_q: cutlass.Constexpr, varlen_k: cutlass.Constexpr, paged: cutlass.Constexpr):
        """Q once (every stage on one barrier), then K(n0), then K(n) with V(n+1), ...,
        and V(n_min) last: the MMA warp consumes K one block ahead of V."""
        ctx, seqlen = tile.ctx, tile.seqlen
        thr_mma_qk = tiled_mma_qk.get_slice(0)
        thr_mma_pv = tiled_mma_pv.get_slice(0)
        if cutlass.const_expr(not self.quantize_q):  # (quantize_q: the softmax warpgroups load Q)
            head_q = tile.head_rows(self.qhead_per_kvhead_packed)
            if cutlass.const_expr(varlen_q):
                # Packed rows are ((qhead_per_kvhead_packed, s), ...): the offset is on s.
                q_off = ((0, seqlen.offset_q), 0) if cutlass.const_expr(self.qhead_per_kvhead_packed > 1) else (
                    seqlen.offset_q, 0)
                mQ_cur = cute.domain_offset(q_off, tma_Q[None, None, head_q])
            else:
                mQ_cur = tma_Q[None, None, head_q, ctx.batch]
            gQ = cute.flat_divide(mQ_cur, cute.select(self.mma_tiler_qk, mode=[0, 2]))
            tQsQ, tQgQ = cpasync.tma_partition(
                tma_atom_Q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 3),
                cute.group_modes(thr_mma_qk.partition_A(gQ), 0, 3),
            )
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            pipeline_q.producer_acquire(q_state)
            for s in cutlass.range_constexpr(self.q_stage):
                cute.copy(tma_atom_Q, tQgQ[None, tile.m_block * self.q_stage + s, 0], tQsQ[None, s],
                          tma_bar_ptr=pipeline_q.producer_get_barrier(q_state))

        if cutlass.const_expr(self.fp8 or self.kv_box):
            k_src = self._kv_rows_source(tma_K, tma_atom_K, sK, self.head_dim, tile, mPageTable, varlen_k, paged)
            v_src = self._kv_rows_source(tma_V, tma_atom_V, sV, self.head_dim_v, tile, mPageTable, varlen_k, paged)
        else:
            k_src = self._kv_source(tma_K, tma_atom_K, sK, thr_mma_qk, tile, mPageTable, varlen_k, paged, is_v=False)
            v_src = self._kv_source(tma_V, tma_atom_V, sV, thr_mma_pv, tile, mPageTable, varlen_k, paged, is_v=True)
        ring = FP8_STAGES if cutlass.const_expr(self.fp8) else self.kv_stages  # the fp8 staging rings, or the K/V rings
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, ring)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, ring)
        n_block_max, n_block_min = tile.n_block_max, tile.n_block_min
        self._load_block(tma_atom_K, k_src, pipeline_k, k_state, n_block_max - 1, mPageTable, ctx.batch)
        k_state.advance()
        for i in cutlass.range(n_block_max - 1 - n_block_min, unroll=1):
            n_block = n_block_max - 2 - i
            self._load_block(tma_atom_K, k_src, pipeline_k, k_state, n_block, mPageTable, ctx.batch)
            k_state.advance()
            self._load_block(tma_atom_V, v_src, pipeline_v, v_state, n_block + 1, mPageTable, ctx.batch)
            v_state.advance()
        self._load_block(tma_atom_V, v_src, pipeline_v, v_state, n_block_min, mPageTable, ctx.batch)

    def _kv_source(self, tma_X, tma_atom, sX, thr_mma, tile, mPageTable, varlen_k, paged, is_v: bool):
        """(smem stages, gmem blocks) of the TMA partition. Unpaged: the blocks of this
        (batch, head); paged: the (tile_n, d) boxes of every page (a page holds whole blocks)."""
        tiler = cute.select(self.mma_tiler_pv, mode=[1, 2]) if is_v else cute.select(self.mma_tiler_qk, mode=[1, 2])
        if cutlass.const_expr(paged):
            mX_cur = tma_X[None, None, tile.head_kv, None]  # (tile_n | d_v, d | tile_n, num_pages)
        elif cutlass.const_expr(varlen_k):
            off = (0, tile.seqlen.offset_k) if is_v else (tile.seqlen.offset_k, 0)
            mX_cur = cute.domain_offset(off, tma_X[None, None, tile.head_kv])
        else:
            mX_cur = tma_X[None, None, tile.head_kv, tile.ctx.batch]
        gX = cute.flat_divide(mX_cur, tiler)
        part = thr_mma.partition_B(gX)
        tXsX, tXgX = cpasync.tma_partition(
            tma_atom, 0, cute.make_layout(1), cute.group_modes(sX, 0, 3), cute.group_modes(part, 0, 3)
        )
        if cutlass.const_expr(paged):
            # Block n is sub-block ``sub`` of its page: the page table maps blocks like keys,
            # in units of page_size / tile_n blocks (K: (TMA, sub, 1, pages); V: (TMA, 1, sub, pages)).
            batch, num_pages = tile.ctx.batch, tXgX.shape[3]
            per_page = tXgX.shape[2] if cutlass.const_expr(is_v) else tXgX.shape[1]

            def block(n):
                page, sub = page_and_row(mPageTable, batch, n, per_page, num_pages)
                return tXgX[None, 0, sub, page] if cutlass.const_expr(is_v) else tXgX[None, sub, 0, page]
        elif cutlass.const_expr(is_v):
            block = lambda n: tXgX[None, 0, n]  # (TMA, 1, n_blocks)
        else:
            block = lambda n: tXgX[None, n, 0]  # (TMA, n_blocks, 1)
        return tXsX, block

    def _kv_rows_source(self, tma_X, tma_atom, sX, cols: int, tile, mPageTable, varlen_k, paged):
        """``_kv_source`` for row-major stages (the fp8 staging rings, or a stage's row-major
        view under ``kv_box``): (tile_n, cols) boxes of the (keys, cols, h_kv[, b | pages])
        view, one a block, or (``kv_box``, cols) boxes, ``tile_n / kv_box`` a block, box j of
        a stage holding the block's rows [j kv_box, (j + 1) kv_box). Boxes: (smem boxes,
        gmem boxes of every page, the sequence's last key) for ``_load_boxes``."""
        rows = self.kv_box or self.tile_n
        if cutlass.const_expr(self.kv_box):
            sX = cute.flat_divide(sX, (rows, cols))  # (rows, cols, boxes, 1, stages)
        if cutlass.const_expr(paged):
            gX = cute.local_tile(tma_X[None, None, tile.head_kv, None], (rows, cols), (None, 0, None))
        elif cutlass.const_expr(varlen_k):
            gX = cute.local_tile(cute.domain_offset((tile.seqlen.offset_k, 0), tma_X[None, None, tile.head_kv]),
                                 (self.tile_n, cols), (None, 0))
        else:
            gX = cute.local_tile(tma_X[None, None, tile.head_kv, tile.ctx.batch], (self.tile_n, cols), (None, 0))
        tXsX, tXgX = cpasync.tma_partition(
            tma_atom, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2)
        )
        if cutlass.const_expr(self.kv_box):
            return tXsX, tXgX, tile.ctx.seqlen_k - 1
        if cutlass.const_expr(paged):
            batch, num_pages = tile.ctx.batch, tXgX.shape[2]

            def block(n):  # (TMA, blocks a page, pages)
                page, sub = page_and_row(mPageTable, batch, n, tXgX.shape[1], num_pages)
                return tXgX[None, sub, page]
        else:
            block = lambda n: tXgX[None, n]
        return tXsX, block

    @cute.jit
    def _load_block(self, tma_atom, src, pipe, state, n_block, mPageTable, batch):
        """TMA of block ``n_block`` into the stage of ``state`` once it is free. A paged
        block's page entry is read before the wait (as the SM90 kernel's ``load_kv``): a global
        load is not moved above an mbarrier wait, so its round trip would follow every release.
        ``kv_box``: ``_load_boxes``."""
        if cutlass.const_expr(self.kv_box):
            self._load_boxes(tma_atom, src, pipe, state, n_block, mPageTable, batch)
        else:
            tXsX, block = src
            gX = block(n_block)
            pipe.producer_acquire(state)
            cute.copy(tma_atom, gX, tXsX[None, state.index], tma_bar_ptr=pipe.producer_get_barrier(state))

    @cute.jit
    def _load_boxes(self, tma_atom, src, pipe, state, n_block, mPageTable, batch):
        """``_load_block`` in boxes of ``kv_box`` rows (pages that hold no whole block), each
        through its own page-table entry, all read before the wait for the stage (as the SM90
        kernel's ``load_kv_boxes``), the boxes issued in a loop (``paged_kv.kv_box_index``:
        a box past the sequence's last key reads that key's box again, rows the masks and
        the V-tail zeroing, ``_zero_v_tail`` / ``_widen_block``, take out)."""
        tXsX, tXgX, last = src  # (TMA, boxes, 1, stages), (TMA, boxes a page, pages), the last key
        boxes_per_page, num_pages = tXgX.shape[1], tXgX.shape[2]
        box_of = lambda j: kv_box_index(n_block, j, self.tile_n, self.kv_box, last)
        boxes = self.tile_n // self.kv_box
        entries = [page_entry(mPageTable, batch, box_of(j), boxes_per_page)[0] for j in range(boxes)]
        pipe.producer_acquire(state)
        # One TMA site in a loop of boxes (an unrolled one, even of two boxes, made ptxas keep
        # the shared-memory base on the stack of every role: 47 reloads, 46 in KV loops, on a
        # q_stage 2 softcap key), its entry picked from the registers by selects.
        for j in cutlass.range(boxes, unroll=1):
            entry = entries[0]
            for i in cutlass.range_constexpr(1, boxes):
                entry = cutlass.select_(j == i, entries[i], entry)
            sub = box_in_page(box_of(j), boxes_per_page)
            cute.copy(tma_atom, tXgX[None, sub, clamp_page(entry, num_pages)], tXsX[None, j, 0, state.index],
                      tma_bar_ptr=pipe.producer_get_barrier(state))

    # -----------------------------------------------------------------------------------
    # Widening warps (FP8 K/V)
    # -----------------------------------------------------------------------------------

    @cute.jit
    def widen(self, sK8, sV8, sK, sV, pipes: tuple, tile, cache_tail_may_be_garbage: cutlass.Constexpr, wtidx):
        """Each staged fp8 block, in the load warp's order (K one block ahead of V), into
        the K or V stage the MMA warp reads next. ``wtidx``: this thread among the widening
        warps. V rows past the sequence end are zeroed (a cache's tail may hold NaN)."""
        pipeline_k8, pipeline_v8, pipeline_k, pipeline_v = pipes
        nthreads = 32 * len(self.roles.widen_warps)
        # The MMA operand stages as (tile_n, d) views: K is K-major (N, K) with N fastest in
        # its domain, V is MN-major (d_v, tile_n) with d_v fastest (``_zero_v_tail``).
        k_view = lambda st: cute.composition(sK[None, None, None, st],
                                             cute.make_layout((self.tile_n, self.head_dim), stride=(1, self.tile_n)))
        v_view = lambda st: cute.composition(sV[None, None, None, st], cute.make_layout(
            (self.tile_n, self.head_dim_v), stride=(self.head_dim_v, 1)))
        k_job = (pipeline_k8, sK8, pipeline_k, k_view, gmem_tiled_copy(self.dtype, self.head_dim, nthreads),
                 self.head_dim)
        v_job = (pipeline_v8, sV8, pipeline_v, v_view, gmem_tiled_copy(self.dtype, self.head_dim_v, nthreads),
                 self.head_dim_v)
        k8_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, FP8_STAGES)
        v8_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, FP8_STAGES)
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.kv_stages)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.kv_stages)
        seqlen_k = tile.ctx.seqlen_k if cutlass.const_expr(cache_tail_may_be_garbage) else None
        n_block_max, n_block_min = tile.n_block_max, tile.n_block_min
        self._widen_block(k_job, k8_state, k_state, None, wtidx)
        k8_state.advance()
        k_state.advance()
        for i in cutlass.range(n_block_max - 1 - n_block_min, unroll=1):
            n_block = n_block_max - 2 - i
            self._widen_block(k_job, k8_state, k_state, None, wtidx)
            k8_state.advance()
            k_state.advance()
            self._widen_block(v_job, v8_state, v_state, self._rows_valid(seqlen_k, n_block + 1), wtidx)
            v8_state.advance()
            v_state.advance()
        self._widen_block(v_job, v8_state, v_state, self._rows_valid(seqlen_k, n_block_min), wtidx)

    def _rows_valid(self, seqlen_k, n_block):
        return None if seqlen_k is None else seqlen_k - n_block * self.tile_n

    @cute.jit
    def _widen_block(self, job, s8, s16, rows_valid, wtidx):
        """One staged block into its 16-bit stage, 16 rows at a time (a thread holds that
        slab's chunks in flight: the widening warps keep 96 registers or fewer)."""
        pipe8, sX8, pipe16, view, tiled_copy, cols = job
        thr_copy = tiled_copy.get_slice(wtidx)
        pipe8.consumer_wait(s8)
        pipe16.producer_acquire(s16)
        src, dst = sX8[None, None, s8.index], view(s16.index)
        coords = cute.make_identity_tensor((self.tile_n, cols))
        slab = (16, cols)
        for r in cutlass.range(self.tile_n // 16, unroll=1):
            widen_fp8(thr_copy.partition_S(cute.local_tile(src, slab, (r, 0))),
                      thr_copy.partition_D(cute.local_tile(dst, slab, (r, 0))), self.dtype,
                      thr_copy.partition_S(cute.local_tile(coords, slab, (r, 0))), rows_valid)
        # Generic-proxy stores, read next by tcgen05.mma (async proxy).
        cute.arch.fence_view_async_shared()
        pipe16.producer_commit(s16)
        pipe8.consumer_release(s8)

    # -----------------------------------------------------------------------------------
    # MMA warp
    # -----------------------------------------------------------------------------------

    @cute.jit
    def mma(self, tmem_ptr, sQ, sK, sV, tP_layout, tiled_mma_qk, tiled_mma_pv, pipeline_q, pipeline_k,
            pipeline_v, bars, tile, cache_tail_may_be_garbage: cutlass.Constexpr):
        thr_mma_qk = tiled_mma_qk.get_slice(0)
        thr_mma_pv = tiled_mma_pv.get_slice(0)
        tSrQ = thr_mma_qk.make_fragment_A(sQ)
        tSrK = thr_mma_qk.make_fragment_B(sK)
        tOrV = thr_mma_pv.make_fragment_B(sV)
        tStS = [self._tmem_S(tmem_ptr, thr_mma_qk, s) for s in range(self.q_stage)]
        tOtO = [self._tmem_O(tmem_ptr, thr_mma_pv, s) for s in range(self.q_stage)]
        tP = cute.make_tensor(tStS[0].iterator, tP_layout.outer)
        tOrP_base = thr_mma_pv.make_fragment_A(tP)[None, None, None, 0]
        tOrP = [
            cute.make_tensor(cute.recast_ptr(tmem_ptr + self.tmem_p_offset[s], dtype=tOrP_base.element_type),
                             tOrP_base.layout)
            for s in range(self.q_stage)
        ]
        num_blocks = tile.n_block_max - tile.n_block_min

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.kv_stages)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.kv_stages)
        pipeline_q.consumer_wait(q_state)
        pipeline_k.consumer_wait(k_state)
        for s in cutlass.range_constexpr(self.q_stage):
            self._gemm(tiled_mma_qk, tStS[s], tSrQ[None, None, None, s], tSrK[None, None, None, k_state.index],
                       accumulate=False)
            with cute.arch.elect_one():
                bars.commit("s_full", s)
        pipeline_k.consumer_release(k_state)
        k_state.advance()
        if cutlass.const_expr(cache_tail_may_be_garbage):
            # Before the first P V (which waits for the softmax of S(n_max - 1) anyway).
            self._zero_v_tail(pipeline_v, v_state, sV, tile)
        for i in cutlass.range(1, num_blocks, unroll=1):
            pipeline_k.consumer_wait(k_state)
            pipeline_v.consumer_wait(v_state)
            for s in cutlass.range_constexpr(self.q_stage):
                self._pv(tiled_mma_pv, tOtO[s], tOrP[s], tOrV[None, None, None, v_state.index], bars, s, i - 1)
                self._gemm(tiled_mma_qk, tStS[s], tSrQ[None, None, None, s],
                           tSrK[None, None, None, k_state.index], accumulate=False)
                with cute.arch.elect_one():
                    bars.commit("s_full", s)
            pipeline_k.consumer_release(k_state)
            pipeline_v.consumer_release(v_state)
            k_state.advance()
            v_state.advance()
        pipeline_v.consumer_wait(v_state)
        for s in cutlass.range_constexpr(self.q_stage):
            self._pv(tiled_mma_pv, tOtO[s], tOrP[s], tOrV[None, None, None, v_state.index], bars, s, num_blocks - 1)
            with cute.arch.elect_one():
                bars.commit("o_final", s)
        pipeline_v.consumer_release(v_state)
        pipeline_q.consumer_release(q_state)

    @cute.jit
    def _zero_v_tail(self, pipeline_v, v_state, sV, tile):
        """Zeroes the V rows of the first visited block past the sequence end. A KV cache
        holds whatever was there past seqused_k (the TMA box reads it); P is 0 there, but
        0 * NaN is NaN. K needs nothing: its scores are masked to -inf by a select. The
        MMA warp writes the zeros (generic proxy) and fences them for tcgen05.mma (async
        proxy) before any lane issues the P V that reads the stage."""
        rows_valid = tile.ctx.seqlen_k - (tile.n_block_max - 1) * self.tile_n
        if rows_valid < self.tile_n:
            pipeline_v.consumer_wait(v_state)
            # (tile_n, d_v) view of the stage: the MN-major B layout of P V is (d_v, tile_n) with d_v fastest.
            sV_s = cute.composition(sV[None, None, None, v_state.index],
                                    cute.make_layout((self.tile_n, self.head_dim_v), stride=(self.head_dim_v, 1)))
            zero_rows_from(sV_s, rows_valid, cute.arch.lane_idx(), 32)
            cute.arch.fence_view_async_shared()
            cute.arch.sync_warp()

    @cute.jit
    def _pv(self, tiled_mma_pv, tOtO, tOrP, tOrV, bars, s: cutlass.Constexpr, j):
        """O_s (+)= P_s(j) V(j) once P_s is in TMEM and O_s was rescaled for block j."""
        bars.wait("p_full", s, j & 1)
        if j > 0:
            bars.wait("o_rescaled", s, (j - 1) & 1)
        self._gemm(tiled_mma_pv, tOtO, tOrP, tOrV, accumulate=j > 0)

    @cute.jit
    def _gemm(self, tiled_mma, acc, tCrA, tCrB, accumulate):
        """acc (+)= A B over the K slices, one tcgen05.mma each (issued by one thread)."""
        # A fresh atom per call: its ACCUMULATE field is rewritten below.
        atom = cute.make_mma_atom(tiled_mma.op)
        for k in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
            atom.set(tcgen05.Field.ACCUMULATE, accumulate or k != 0)
            cute.gemm(atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)

    def _tmem_S(self, tmem_ptr, thr_mma_qk, s: int):
        layout = thr_mma_qk.make_fragment_C(thr_mma_qk.partition_shape_C(self.mma_tiler_qk[:2])).layout
        return cute.make_tensor(tmem_ptr + self.tmem_s_offset[s], layout)

    def _tmem_O(self, tmem_ptr, thr_mma_pv, s: int):
        layout = thr_mma_pv.make_fragment_C(thr_mma_pv.partition_shape_C(self.mma_tiler_pv[:2])).layout
        return cute.make_tensor(tmem_ptr + self.tmem_o_offset[s], layout)

    # -----------------------------------------------------------------------------------
    # Softmax warpgroups
    # -----------------------------------------------------------------------------------

    @cute.jit
    def softmax_loop(self, tmem_ptr, tiled_mma_qk, sStats, bars, tile, stage, tidx, mSink, quant=None):
        """Stage ``stage`` (warp-uniform, 0 or 1); thread ``tidx`` owns row ``tidx`` of it;
        ``mSink``: the learnable sinks (None: none, or a split kernel); ``quant``: see
        ``_quantize_q``."""
        if cutlass.const_expr(self.q_stage == 1):
            self._softmax_stage(tmem_ptr, tiled_mma_qk, sStats, bars, tile, 0, tidx, mSink, quant)
        else:
            if stage == 0:
                self._softmax_stage(tmem_ptr, tiled_mma_qk, sStats, bars, tile, 0, tidx, mSink, quant)
            else:
                self._softmax_stage(tmem_ptr, tiled_mma_qk, sStats, bars, tile, 1, tidx, mSink, quant)

    @cute.jit
    def _quantize_q(self, quant, tile, s: cutlass.Constexpr, tidx) -> Float32:
        """quantize_q: this warpgroup's Q stage, its 16-bit rows (packed under GQA) loaded into
        registers and stored into sQ in e4m3 as Q / 2^e (``q_quant.quantize_q_tile``: one
        power-of-two scale for the stage), then Q's mbarrier takes this warpgroup's arrive
        (the MMA warp waits for every stage's). ``quant`` = (the tile's (rows, d) 16-bit Q
        rows, sQ's (128, d, q_stage) row-major view, the (4, q_stage) amax words, Q's
        pipeline). Returns 2^e."""
        q_rows, sQq, sQAmax, pipeline_q = quant
        barrier_id = int(Sm100FwdBarrier.Q_QUANT) + s
        scale = quantize_q_tile(((q_rows, sQq[None, None, s]),), tile.m_block * self.tile_m + s * TILE_M,
                                sQAmax[None, s], tile.rows_valid - s * TILE_M, self.head_dim_valid, tidx, TILE_M,
                                lambda: cute.arch.barrier(barrier_id=barrier_id, number_of_threads=TILE_M))
        if tidx == 0:  # after the warpgroup's barrier: every thread's stores are fenced
            pipeline_q.producer_commit(pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1))
        return scale

    @cute.jit
    def _softmax_stage(self, tmem_ptr, tiled_mma_qk, sStats, bars, tile, s: cutlass.Constexpr, tidx, mSink,
                       quant=None):
        if cutlass.const_expr(quant is not None):
            # 2^e joins the softmax scale, as a q_descale does.
            tile = replace(tile, softmax_scale=tile.softmax_scale * self._quantize_q(quant, tile, s, tidx))
        thr_mma_qk = tiled_mma_qk.get_slice(0)
        tSAcc = self._tmem_S(tmem_ptr, thr_mma_qk, s)[(None, None), 0, 0]  # (128, tile_n)
        tScS = thr_mma_qk.partition_C(cute.make_identity_tensor(self.mma_tiler_qk[:2]))[(None, None), 0, 0]
        load_atom = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(32)), Float32)
        thr_load = tcgen05.make_tmem_copy(load_atom, tSAcc).get_slice(tidx)
        tStS_t2r = thr_load.partition_S(tSAcc)
        tScS_t2r = thr_load.partition_D(tScS)
        p_cols = self.tile_n * self.op_dtype.width // 32  # P's row packed in 32-bit columns
        tStP = cute.make_tensor(tSAcc.iterator + self.tile_n // 2,
                                cute.composition(tSAcc.layout, cute.make_layout((TILE_M, p_cols))))
        store_atom = cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(16)), Float32)
        thr_store = tcgen05.make_tmem_copy(store_atom, tStP).get_slice(tidx)
        tStP_r2t = thr_store.partition_D(tStP)
        p_shape = thr_store.partition_S(cute.make_identity_tensor((TILE_M, p_cols))).shape

        has_mod = cutlass.const_expr(self.variant.has_score_mod)
        scale_log2 = LOG2_E if has_mod else tile.softmax_scale * LOG2_E
        # FP8 P: 2^8 at the row max before its e4m3 rounding. 16-bit P: the row max may lag by
        # RESCALE_THRESHOLD, so that after the first blocks a row's correction is almost
        # always exactly 1 and the correction warps skip the TMEM pass over O.
        fp8_p = self.op_dtype.width == 8
        softmax = OnlineSoftmax(1, Float32(scale_log2), threads_per_row=1, max_offset=FP8_P_OFFSET if fp8_p else 0,
                                rescale_threshold=0.0 if fp8_p else RESCALE_THRESHOLD)
        n_cols = cute.size(tScS_t2r)
        # The thread's row as a 1 x n_cols view (the variant) and as a one-row accumulator (the softmax).
        row_view = cute.make_layout((1, n_cols), stride=(0, 1))
        acc_view = cute.make_layout(((n_cols, 1), 1, 1), stride=((1, 0), 0, 0))
        tScS_mn = cute.make_tensor(tScS_t2r.iterator, cute.composition(tScS_t2r.layout, row_view))

        block_info = self.block_info()
        runs = tile.n_block_runs(block_info)
        row0 = tile.m_block * self.tile_m + s * TILE_M
        block_info.walk_n_blocks(
            lambda _, n_block, masked: self._softmax_step(
                thr_load, tStS_t2r, thr_store, tStP_r2t, p_shape, tScS_mn, row_view, acc_view, softmax, sStats,
                bars, tile, row0, s, tidx, n_block, masked),
            tile.n_block_min, tile.n_block_max, runs)

        # The last PV_s completed, so the correction consumed the last row correction:
        # hand it 1 / rowsum and the LSE in the same slots.
        bars.wait("o_final", s, 0)
        inv = cute.make_rmem_tensor(((1, 1), 1, 1), Float32)
        inv.fill(1.0)
        lse = cute.make_rmem_tensor((1,), Float32)
        sinks = None
        if cutlass.const_expr(mSink is not None):
            sinks = tile.row_sinks(mSink, tScS_mn, row0, self.qhead_per_kvhead_packed)
        softmax.finalize(inv, lse, sinks)  # inv <- O's scale: 1 / rowsum (0 for a row that saw no key)
        sStats[tidx, 1, s] = inv[0]
        sStats[tidx, 2, s] = lse[0]
        bars.arrive("scale_ready", s)

    @cute.jit
    def _softmax_step(self, thr_load, tStS_t2r, thr_store, tStP_r2t, p_shape, tScS_mn, row_view, acc_view,
                      softmax, sStats, bars, tile, row0, s: cutlass.Constexpr, tidx, n_block,
                      masked: cutlass.Constexpr):
        j = tile.n_block_max - 1 - n_block  # blocks visited before this one
        bars.wait("s_full", s, j & 1)
        tSrS = cute.make_rmem_tensor(thr_load.partition_D(cute.make_identity_tensor((TILE_M, self.tile_n))).shape,
                                     Float32)
        cute.copy(thr_load, tStS_t2r, tSrS)
        s_mn = cute.make_tensor(tSrS.iterator, cute.composition(tSrS.layout, row_view))
        col0 = n_block * self.tile_n
        packed = self.qhead_per_kvhead_packed
        apply_to_scores(self.variant, s_mn, tScS_mn, tile.ctx, row0, col0, packed, tile.softmax_scale, masked)
        # A masked block may hold -inf scores, which only MUFU maps to 0.
        row_scale = softmax.step(cute.make_tensor(tSrS.iterator, cute.composition(tSrS.layout, acc_view)),
                                 ex2_emulate_every=0 if masked else self.ex2_emulate_every, packed_f32x2=True)
        if j > 0:
            sStats[tidx, 0, s] = row_scale[0]
            bars.arrive("scale_ready", s)
        # P (16-bit) packed two per 32-bit TMEM column, register i of S -> element i of P.
        # Converted and stored one TMEM-copy chunk at a time, so that P's registers die early.
        tSrP32 = cute.make_rmem_tensor(p_shape, Float32)
        tSrP = cute.make_tensor(cute.recast_ptr(tSrP32.iterator, dtype=self.op_dtype), tSrS.layout)
        for i in cutlass.range_constexpr(cute.size(tStP_r2t, mode=[2])):
            tSrP[None, None, i].store(tSrS[None, None, i].load().to(self.op_dtype))
            cute.copy(thr_store, tSrP32[None, None, i], tStP_r2t[None, None, i])
        cute.arch.fence_view_async_tmem_store()
        bars.arrive("p_full", s)

    # -----------------------------------------------------------------------------------
    # Correction warpgroup (and epilogue)
    # -----------------------------------------------------------------------------------

    @cute.jit
    def correction_loop(self, tmem_ptr, tiled_mma_pv, sStats, bars, mO, mLSE, tile, tidx,
                        varlen_q: cutlass.Constexpr, mSink, mVDescale=None):
        """Rescales O per block, then the epilogue; a tile without KV blocks stores O = 0 and
        LSE = -inf, or the row's sink (``mSink``: None without one, or in a split kernel).
        ``mVDescale`` (fp8 V): O's final scale is also ``v_descale[b, h_kv]``."""
        thr_mma_pv = tiled_mma_pv.get_slice(0)
        num_blocks = tile.n_block_max - tile.n_block_min
        for j in cutlass.range(1, num_blocks, unroll=1):
            for s in cutlass.range_constexpr(self.q_stage):
                bars.wait("scale_ready", s, (j - 1) & 1)
                scale = sStats[tidx, 0, s]
                # tcgen05.ld/st are warp-wide: a warp whose 32 rows kept their max skips the pass.
                if not cute.arch.vote_all_sync(scale == 1.0):
                    self._rescale_o(self._tmem_O(tmem_ptr, thr_mma_pv, s), tidx, scale)
                cute.arch.fence_view_async_tmem_store()
                bars.arrive("o_rescaled", s)
        for s in cutlass.range_constexpr(self.q_stage):
            inv = Float32(0.0)
            lse = -Float32.inf
            if cutlass.const_expr(mSink is not None):
                if num_blocks == 0:  # only then: its address would stay live at 64 registers (q_stage 2)
                    lse = tile.row_sink(mSink, tile.m_block * self.tile_m + s * TILE_M + tidx,
                                        self.qhead_per_kvhead_packed)
            if num_blocks > 0:
                bars.wait("scale_ready", s, (num_blocks - 1) & 1)
                bars.wait("o_final", s, 0)
                inv = sStats[tidx, 1, s]
                if cutlass.const_expr(mVDescale is not None):
                    inv = inv * mVDescale[tile.ctx.batch, tile.head_kv]
                lse = sStats[tidx, 2, s]
            self._epilogue_stage(self._tmem_O(tmem_ptr, thr_mma_pv, s), mO, mLSE, tile, s, tidx, inv, lse,
                                 num_blocks > 0, varlen_q)

    @cute.jit
    def _rescale_o(self, tOtO, tidx, scale):
        """O row *= scale, 16 TMEM columns at a time."""
        cols = 16
        tOtO_i = cute.composition(tOtO, cute.make_layout((TILE_M, cols)))
        load = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(cols)), Float32), tOtO_i
        ).get_slice(tidx)
        store = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(cols)), Float32), tOtO_i
        ).get_slice(tidx)
        t2r = load.partition_S(tOtO_i)
        r2t = store.partition_D(tOtO_i)
        frag_shape = load.partition_D(cute.make_identity_tensor((TILE_M, cols))).shape
        for i in cutlass.range_constexpr(self.head_dim_v // cols):
            frag = cute.make_rmem_tensor(frag_shape, Float32)
            cute.copy(load, cute.make_tensor(t2r.iterator + i * cols, t2r.layout), frag)
            frag.store(frag.load() * scale)
            cute.copy(store, frag, cute.make_tensor(r2t.iterator + i * cols, r2t.layout))

    @cute.jit
    def _epilogue_stage(self, tOtO, mO, mLSE, tile, s: cutlass.Constexpr, tidx, inv, lse, has_blocks,
                        varlen_q: cutlass.Constexpr):
        """Row ``tidx`` of stage s: O * (1 / rowsum) from TMEM straight to global memory
        (128-bit stores), and its LSE. A split with no key writes O = 0, LSE = -inf."""
        row = s * TILE_M + tidx
        o_rows = tile.out_rows(mO, self.qhead_per_kvhead_packed, self.is_split, varlen_q)
        row_g = tile.m_block * self.tile_m + row
        cols = self.epi_cols
        tOtO_i = cute.composition(tOtO, cute.make_layout((TILE_M, cols)))
        load = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(cols)), Float32), tOtO_i
        ).get_slice(tidx)
        t2r = load.partition_S(tOtO_i)
        frag_shape = load.partition_D(cute.make_identity_tensor((TILE_M, cols))).shape
        vec = 128 // self.out_dtype.width
        store_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.out_dtype, num_bits_per_copy=128)
        # A padded d_v (``head_dim_v_valid``): the 128-bit stores of its padding columns are
        # left out (static: d_v is a multiple of 8, a store's 8 or 4 columns all in or all out).
        d_v = _stored_cols(self.head_dim_v_valid, self.head_dim_v)
        for i in cutlass.range_constexpr(-(-d_v // cols)):
            frag = cute.make_rmem_tensor(frag_shape, Float32)
            if has_blocks:
                cute.copy(load, cute.make_tensor(t2r.iterator + i * cols, t2r.layout), frag)
            else:
                frag.fill(0.0)
            out = cute.make_rmem_tensor(frag_shape, self.out_dtype)
            out.store((frag.load() * inv).to(self.out_dtype))
            # Register c of the fragment is column c of the row: (vec, cols / vec) for 128-bit stores.
            out = cute.make_tensor(out.iterator, cute.make_layout((vec, cols // vec)))
            if row < tile.rows_valid:
                g_row = o_rows[row_g, None]
                for v in cutlass.range_constexpr(min(cols, d_v - i * cols) // vec):
                    dst = cute.make_tensor(aligned_row_ptr(g_row, i * cols + v * vec, 16), cute.make_layout(vec))
                    cute.copy(store_atom, out[None, v], dst)
        if cutlass.const_expr(mLSE is not None):
            lse_rows = tile.lse_rows(mLSE, self.qhead_per_kvhead_packed, self.is_split, varlen_q)
            if row < tile.rows_valid:
                lse_rows[row_g] = lse


def _stored_cols(cols_valid, cols: int) -> int:
    """The columns of a row the epilogue stores: the head dim's (``cols_valid`` where it is
    padded, else the tile's ``cols``). Plain Python: evaluated while tracing."""
    return cols if cols_valid is None else cols_valid


# ---------------------------------------------------------------------------------------
# Host side: compilation on fake tensors (key, planning and launch: sm100/__init__.py)
# ---------------------------------------------------------------------------------------


def _check_row_major_view(op_layout, row_layout, rows: int, cols: int, stages: int, mn_major: bool = False):
    """A row-major (rows, cols, stages) view maps every (row, column, stage) where the MMA's
    operand layout does (their swizzles and the offsets of a grid of rows and columns
    compared while tracing; both tile 8-row swizzle atoms along the rows, then along the
    columns): Q's stages (quantize_q stores them row by row), K's (K-major, keys the rows)
    and V's (``mn_major``: the (d_v, keys) B operand with d_v fastest, keys the rows of the
    view) under ``kv_box``, whose TMA boxes write the views."""
    assert str(op_layout.inner) == str(row_layout.inner), (op_layout, row_layout)
    domain = cute.make_layout((rows, cols), stride=(cols, 1) if mn_major else (1, rows))
    for stage in range(stages):
        a = cute.composition(cute.slice_(op_layout.outer, (None, None, None, stage)), domain)
        base = stage * cute.cosize(cute.slice_(op_layout.outer, (None, None, None, 0)))
        for m in sorted({m for m in (0, 1, 7, 8, 15, 16, 63, 64, rows - 1) if m < rows}):
            for k in sorted({k for k in (0, 1, 15, 16, 31, 32, 63, 64, cols // 2, cols - 1) if k < cols}):
                got, want = base + int(cute.crd2idx((m, k), a)), int(cute.crd2idx((m, k, stage), row_layout.outer))
                assert got == want, (m, k, stage, got, want, op_layout, row_layout)


def compile_fwd_sm100(key: tuple):
    """Compiles the kernel for ``key`` (``sm100.compile_key``) on fake tensors: no GPU needed.
    The key's fields after the common ones: ex2_emulate_every (where not 0), then
    ``keys.QUANTIZE_Q`` (where the kernel quantizes the queries), then ``keys.kv_box_field``
    (where a paged cache is read in boxes)."""

    def make(dtype, d, d_v, tile, variant, packed, is_split, split_blocks, *extra, q_class):
        ex2 = [x for x in extra if x != QUANTIZE_Q and not parse_kv_box(x)]
        kv_box = max([parse_kv_box(x) for x in extra] + [0])
        return FlashAttnFwdSm100(dtype, d, d_v, tile, variant, packed, is_split, split_blocks, ex2[0] if ex2 else 0,
                                 q_class=q_class, quantize_q=QUANTIZE_Q in extra, kv_box=kv_box)

    return compile_from_key(key, 3, make)
