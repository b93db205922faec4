"""Split-KV combine: merge per-split partial outputs into the final O (and its LSE).

    lse = logsumexp_s lse_s            O = sum_s exp(lse_s - lse) * O_s

With a learnable sink (one logit per head, zero value: the split kernels leave it out) it
is one more term of the logsumexp, ``lse = logsumexp(lse_s..., sink)``, and of no O_s.

Arch-neutral (SM80 and up): cp.async and 128-bit global stores, no TMA, no tensor cores.
The kernel is memory bound: every O partial element is read exactly once, with coalesced
128-bit cp.async copies, several splits in flight per thread.
Launched in stream order, not as a programmatic dependent launch: with the split kernels
releasing it at their epilogues (``griddepcontrol``) and this kernel waiting on their grid,
H100 2026-12-06, us, two runs each: GQA decode b1 x 131072 h32/8 d128 (16 splits) fp8
110.6 -> 110.1, bf16 190.8 -> 189.9; MLA 64 x 1024 (2 splits) fp8 50.5 -> 49.6, but MLA
1 x 32768 (128 splits, 128 CTAs of one wave) 45.1 -> 48.0, fp8 40.3 -> 43.1: launched
while the split kernel still holds 128 SMs, this kernel's CTAs crowd onto the 4 idle ones.

A "row" is one (batch, seqlen, head) triple. A CTA owns ``tile_m / split_groups`` rows of
one batch and one ``k_block`` wide column slice of d_v (a batch past grid z's limit folds
into x, ``tile_scheduler.fold_batch``). ``split_groups`` (G, a runtime power of two <=
tile_m, ``heuristics.combine_split_groups``) lane groups share a row, group g taking the
splits g, g + G, ...: a decode with few rows and many splits (MLA 1 x 32768: 64 rows, 128
splits) would otherwise stream each row's 128 splits one after another in 32 CTAs.
  1. ``load_lse``: the LSE of every split for its rows goes to smem (coalesced along seqlen),
  2. ``reduce``: a lane group per row reduces max / sum over splits and rewrites smem in
     place with the per-split weights exp(lse_s - max_s lse_s) (group 0 writes; the other
     groups run the same shuffles and discard them). Lane j of a group takes the splits
     j, j + group, ... in order, then the group's butterfly: the order depends on d_v
     alone, so splits of weight 0 (empty ones) add exact zeros and a row's result does not
     depend on how many trailing empty splits the launch has (batch invariance: batch-
     invariant plans run with G = 1, since G follows the split count),
  3. ``accumulate``: each thread streams its 128-bit column chunk of its group's splits with
     a nonzero weight through a private ``stages``-deep smem ring into fp32 registers (the
     first stages - 1 of them issued right after the LSEs, before any weight is known); the
     groups > 0 then hand their sums to group 0 through their own ring slot 0, added in
     group order, and group 0 normalises once by 1 / sum of the weights,
  4. ``store``: convert and write that chunk of O with one 128-bit store.
"""

from typing import Optional, Type

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from flash_attn_cute.host import jit_cache
from flash_attn_cute.host.constants import MAX_SPLITS
from flash_attn_cute.device.cute_utils import CUTE_DTYPE_BY_NAME, compile_options, fake_stream, fake_tensor
from flash_attn_cute.host.keys import DTYPE_NAMES, combine_key, target_arch
from flash_attn_cute.device.softmax import LN_2, LOG2_E
from flash_attn_cute.device.tile_scheduler import fold_batch, m_blocks_divisor, unfold_batch


class FlashAttnCombine:
    def __init__(
        self,
        dtype: Type[cutlass.Numeric],
        head_dim_v: int,
        max_splits: int = MAX_SPLITS,
        stages: int = 8,
    ):
        assert dtype in (cutlass.Float16, cutlass.BFloat16, Float32), dtype
        assert head_dim_v % 8 == 0 and 8 <= head_dim_v <= 512, head_dim_v
        assert stages & (stages - 1) == 0, "the ring slot is split % stages"
        self.dtype = dtype
        self.head_dim_v = head_dim_v
        self.max_splits = max_splits
        self.stages = stages
        # A thread owns 128 bits of its output row (8 halves or 4 floats), so the store is
        # one 128-bit STG; the fp32 partials behind it are vec / 4 128-bit cp.async per split.
        self.vec = 128 // dtype.width
        self.chunks = self.vec // 4
        # Column slice: a power of two so that a row's threads are an aligned lane group of
        # one warp (shuffle reductions, warp-level sync); capped at 128 so that large head
        # dims spread over grid.y and small (decode) problems still spread over more SMs.
        self.k_block = min(128, max(self.vec, 1 << (head_dim_v - 1).bit_length()))
        self.threads_per_row = self.k_block // self.vec  # 1..32, divides 32
        # Few rows per CTA, so that small (decode) problems still make many CTAs; at least a
        # full warp, since the shuffles and warp syncs use a full lane mask.
        self.tile_m = max(8, 32 // self.threads_per_row)
        self.num_threads = self.tile_m * self.threads_per_row
        self.is_even_k = head_dim_v % self.k_block == 0
        # smem: LSEs, max_splits x tile_m fp32 (8 KB), and the ring, stages x tile_m x k_block
        # fp32 (32 KB at k_block 128). The ring keeps stages - 1 splits, 28 KB per CTA, in
        # flight: about what one SM needs to cover DRAM latency, so that even a grid of one
        # CTA per SM streams near full speed.
        smem_bytes = 4 * self.tile_m * (max_splits + stages * self.k_block)
        assert smem_bytes <= 48 * 1024, "static smem limit"

    @cute.jit
    def __call__(
        self,
        mOPartial: cute.Tensor,  # (num_splits, batch, seqlen, nheads, d_v) fp32, d_v contiguous
        mLSEPartial: cute.Tensor,  # (num_splits, batch, nheads, seqlen) fp32, natural log
        mO: cute.Tensor,  # (batch, seqlen, nheads, d_v), d_v contiguous
        mLSE: Optional[cute.Tensor],  # (batch, nheads, seqlen) fp32, or None
        mSink: Optional[cute.Tensor],  # (nheads,) fp32 learnable sinks, or None
        split_groups: Int32,  # G: a power of two <= tile_m (heuristics.combine_split_groups)
        # (batch, 2) int32 (slot_base, splits) of a device schedule (``mla_schedule``): batch
        # b merges the partials [slot_base, slot_base + splits) (the partials' batch stride
        # is 0), and a sequence of one split (written whole by its kernel) is skipped; None:
        # every sequence merges all num_splits partials
        mSplitInfo: Optional[cute.Tensor],
        stream,
    ):
        # num_splits <= max_splits is the caller's to check: the LSE smem is sized for it.
        if const_expr(mOPartial.element_type != Float32 or mLSEPartial.element_type != Float32):
            raise TypeError("O partial and LSE partial must be fp32")
        if const_expr(mO.element_type != self.dtype):
            raise TypeError(f"O must be {self.dtype}")
        # Every tensor gets one row mode of shape (seqlen, nheads), indexed by the coordinate
        # (r % seqlen, r // seqlen) of a flat row r: seqlen fastest, the contiguous direction
        # of the LSEs, so that a CTA's rows are mostly one contiguous run of LSEs.
        mOPartial = cute.group_modes(mOPartial, 2, 4)  # (num_splits, batch, row, d_v)
        mO = cute.group_modes(mO, 1, 3)  # (batch, row, d_v)
        mLSEPartial = cute.make_tensor(
            mLSEPartial.iterator, cute.group_modes(cute.select(mLSEPartial.layout, mode=[0, 1, 3, 2]), 2, 4)
        )  # (num_splits, batch, row)
        if const_expr(mLSE is not None):
            mLSE = cute.make_tensor(
                mLSE.iterator, cute.group_modes(cute.select(mLSE.layout, mode=[0, 2, 1]), 1, 3)
            )  # (batch, row)
        # Split-major: a split's tile_m LSEs are one contiguous smem row, so the cp.async that
        # land them and the weight reads of the streaming threads are bank-conflict free.
        sLSE_layout = cute.make_ordered_layout((self.max_splits, self.tile_m), order=(1, 0))
        # (4, chunks, num_threads, stages): a 16 B chunk per (chunk, thread, stage) with the
        # thread index fastest, so the 128-bit smem writes and reads of a quarter warp hit
        # 8 distinct 16 B bank groups.
        sO_layout = cute.make_ordered_layout(
            (4, self.chunks, self.num_threads, self.stages), order=(0, 2, 1, 3)
        )
        rows_per_cta = Int32(self.tile_m) // split_groups
        num_m_blocks = cute.ceil_div(cute.size(mO.shape[1]), rows_per_cta)
        grid_x, grid_z = fold_batch(num_m_blocks, cute.size(mO.shape[0]))
        grid = [grid_x, cute.ceil_div(self.head_dim_v, self.k_block), grid_z]
        self.kernel(mOPartial, mLSEPartial, mO, mLSE, mSink, mSplitInfo, sLSE_layout, sO_layout,
                    m_blocks_divisor(num_m_blocks), split_groups, rows_per_cta).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mOPartial: cute.Tensor,  # (num_splits, batch, row, d_v)
        mLSEPartial: cute.Tensor,  # (num_splits, batch, row)
        mO: cute.Tensor,  # (batch, row, d_v)
        mLSE: Optional[cute.Tensor],  # (batch, row)
        mSink: Optional[cute.Tensor],  # (nheads,)
        mSplitInfo: Optional[cute.Tensor],  # (batch, 2)
        sLSE_layout: cute.Layout,
        sO_layout: cute.Layout,
        m_blocks: cute.FastDivmodDivisorV2,  # row tiles per sequence (tile_scheduler.m_blocks_divisor)
        split_groups: Int32,
        rows_per_cta: Int32,  # tile_m / split_groups
    ):
        m_block, batch_idx, in_batch = unfold_batch(m_blocks, cute.size(mO.shape[0]))
        num_splits = mOPartial.shape[0]
        if const_expr(mSplitInfo is not None):
            # This sequence's slots; one split (or none) means its kernel wrote it whole.
            # (clamped into the slots: a schedule of another batch never reads past them)
            base = cutlass.min(cutlass.max(mSplitInfo[batch_idx, 0], 0), num_splits)
            num_splits = cutlass.min(cutlass.min(mSplitInfo[batch_idx, 1], num_splits - base), self.max_splits)
            in_batch = in_batch and num_splits > 1
            mOPartial = cute.domain_offset((base, 0, 0, 0), mOPartial)
            mLSEPartial = cute.domain_offset((base, 0, 0), mLSEPartial)
        if in_batch:
            self.combine_rows(mOPartial, mLSEPartial, mO, mLSE, mSink, sLSE_layout, sO_layout, m_block, batch_idx,
                              num_splits, split_groups, rows_per_cta)

    @cute.jit
    def combine_rows(self, mOPartial, mLSEPartial, mO, mLSE, mSink, sLSE_layout, sO_layout, m_block, batch_idx,
                     num_splits: Int32, split_groups: Int32, rows_per_cta: Int32):
        """The CTA's rows of sequence ``batch_idx``, its column slice ``blockIdx.y``, over
        ``num_splits`` partials."""
        tidx, _, _ = cute.arch.thread_idx()
        k_block_idx = cute.arch.block_idx()[1]
        seqlen = mO.shape[1][0]
        num_rows = cute.size(mO.shape[1])

        smem = cutlass.memory.SmemAllocator()
        sLSE = smem.allocate_tensor(Float32, sLSE_layout, byte_alignment=16)  # (max_splits, tile_m)
        sO = smem.allocate_tensor(Float32, sO_layout, byte_alignment=16)  # (4, chunks, threads, stages)

        self.load_lse(mLSEPartial[None, batch_idx, None], sLSE, m_block, num_splits, seqlen, num_rows, tidx,
                      rows_per_cta)

        # Reduction and streaming share one mapping: lane group (m, g) (threads_per_row lanes
        # of one warp) owns row m for the splits of group g, lane j of it owns columns
        # [j * vec, (j + 1) * vec).
        j = tidx % self.threads_per_row
        m = (tidx // self.threads_per_row) % rows_per_cta
        g = tidx // (self.threads_per_row * rows_per_cta)
        row = m_block * rows_per_cta + m
        row_crd = (row % seqlen, row // seqlen)  # (seqlen idx, head idx)
        col = k_block_idx * self.k_block + j * self.vec
        is_valid = row < num_rows and (const_expr(self.is_even_k) or col < self.head_dim_v)
        # (4, chunks, num_splits): this thread's vec columns of its row, per split (an address
        # past the end for an invalid thread, never dereferenced)
        gOPartial = cute.flat_divide(mOPartial[None, batch_idx, row_crd, None], (1, self.vec))
        tOgOPartial = cute.flat_divide(gOPartial[0, None, None, col // self.vec], (4,))
        tOsOPartial = sO[None, None, tidx, None]  # (4, chunks, stages), private to this thread
        self.prefetch_splits(tOgOPartial, tOsOPartial, num_splits, g, split_groups, is_valid)
        # The LSE group was committed before the stages - 1 prefetch groups.
        cute.arch.cp_async_wait_group(self.stages - 1)
        cute.arch.sync_threads()

        sink = None
        if const_expr(mSink is not None):
            sink = mSink[cutlass.min(row_crd[1], mO.shape[1][1] - 1)]  # rows past the end: any head
        lse, inv_sum = self.reduce(sLSE, m, j, num_splits, sink, g == 0)
        if const_expr(mLSE is not None):
            if k_block_idx == 0 and j == 0 and g == 0 and row < num_rows:
                mLSE[batch_idx, row_crd] = lse
        # The weights of row m were written by group 0, in other warps when G > 1.
        cute.arch.sync_threads()

        tOrO = cute.make_rmem_tensor((4, self.chunks), Float32)
        tOrO.fill(0.0)
        if is_valid:
            self.accumulate(tOrO, tOgOPartial, tOsOPartial, sLSE, m, num_splits, g, split_groups)
        if split_groups > 1:  # uniform over the CTA
            if g > 0:
                cute.autovec_copy(tOrO, tOsOPartial[None, None, 0])
            cute.arch.sync_threads()
            if g == 0 and is_valid:
                tOrOGroup = cute.make_rmem_tensor((4, self.chunks), Float32)
                group_stride = self.threads_per_row * rows_per_cta
                for h in cutlass.range(1, split_groups):
                    cute.autovec_copy(sO[None, None, tidx + h * group_stride, 0], tOrOGroup)
                    tOrO.store(tOrO.load() + tOrOGroup.load())
        if g == 0 and is_valid:
            tOrO.store(tOrO.load() * inv_sum)
            tOgO = cute.flat_divide(mO[batch_idx, row_crd, None], (self.vec,))[None, col // self.vec]
            self.store(tOrO, tOgO)

    @cute.jit
    def load_lse(
        self,
        gLSEPartial: cute.Tensor,  # (num_splits, row) of this batch
        sLSE: cute.Tensor,  # (max_splits, tile_m)
        m_block: Int32,
        num_splits: Int32,
        seqlen: Int32,
        num_rows: Int32,
        tidx: Int32,
        rows_per_cta: Int32,
    ):
        # Consecutive threads take consecutive rows: along seqlen the LSEs are contiguous, so
        # a warp reads whole sectors. cp.async rather than loads: nothing waits on any single
        # one of them, so a thread's whole column of splits is in flight at once.
        atom = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.ALWAYS), Float32, num_bits_per_copy=32
        )
        m = tidx % rows_per_cta
        split_start = tidx // rows_per_cta
        split_step = self.num_threads // rows_per_cta
        row = m_block * rows_per_cta + m
        tLsLSE = cute.flat_divide(sLSE, (1,))  # (1, max_splits, tile_m)
        if row < num_rows:
            tLgLSE = cute.flat_divide(gLSEPartial[None, (row % seqlen, row // seqlen)], (1,))  # (1, num_splits)
            for s in cutlass.range(split_start, num_splits, split_step):
                cute.copy(atom, tLgLSE[None, s], tLsLSE[None, s, m])
        else:  # rows past the end: -inf, i.e. all weights 0 (they are never stored)
            for s in cutlass.range(split_start, num_splits, split_step):
                sLSE[s, m] = -Float32.inf
        cute.arch.cp_async_commit_group()

    @cute.jit
    def reduce(self, sLSE: cute.Tensor, m: Int32, j: Int32, num_splits: Int32, sink: Optional[Float32],
               is_writer):
        """Turn row m of sLSE into weights exp(lse_s - max lse) in place (lane groups with
        ``is_writer``; the others may read weights as LSEs and return garbage, unused);
        return (lse, 1 / sum of weights). A row with no valid split gets lse -inf, all
        weights exactly 0 and 1 / sum = 0: never NaN. ``sink``: one more term of the max and
        the sum (after the group's reductions, so it is added once), with no weight of its
        own: such a row gets lse = the sink and O = 0."""
        group = const_expr(self.threads_per_row)
        lse_max = -Float32.inf
        for s in cutlass.range(j, num_splits, group, unroll=4):
            lse_max = cute.arch.fmax(lse_max, sLSE[s, m])
        lse_max = cute.arch.warp_reduction_max(lse_max, threads_in_group=group)
        if const_expr(sink is not None):
            lse_max = cute.arch.fmax(lse_max, sink)
        # exp2(-inf - (-inf)) would be NaN: an all -inf row is shifted by 0 instead.
        max_log2 = Float32(0.0) if lse_max == -Float32.inf else lse_max * LOG2_E
        lse_sum = Float32(0.0)
        for s in cutlass.range(j, num_splits, group, unroll=4):
            weight = cute.math.exp2(sLSE[s, m] * LOG2_E - max_log2, approx=True)
            if is_writer:
                sLSE[s, m] = weight
            lse_sum += weight
        lse_sum = cute.arch.warp_reduction_sum(lse_sum, threads_in_group=group)
        if const_expr(sink is not None):
            lse_sum += cute.math.exp2(sink * LOG2_E - max_log2, approx=True)
        inv_sum = Float32(0.0) if lse_sum == 0.0 else cute.arch.rcp_approx(lse_sum)
        # log2(0) = -inf: lse = -inf for a row with no valid split.
        return (cute.math.log2(lse_sum, approx=True) + max_log2) * LN_2, inv_sum

    @cute.jit
    def prefetch_splits(
        self,
        tOgOPartial: cute.Tensor,  # (4, chunks, num_splits) gmem
        tOsOPartial: cute.Tensor,  # (4, chunks, stages) smem, private to this thread
        num_splits: Int32,
        group: Int32,
        split_groups: Int32,
        is_valid,
    ):
        """The group's first stages - 1 splits into ring slots 0 .. stages - 2, one commit
        group each (empty ones too, so that every thread counts the same groups), issued
        before the LSEs have landed: their latency overlaps the LSEs' instead of following
        it (a split of weight 0 is read here all the same, and never used)."""
        atom = self.partial_copy_atom()
        for i in cutlass.range_constexpr(self.stages - 1):
            if is_valid and group + i * split_groups < num_splits:
                cute.copy(atom, tOgOPartial[None, None, group + i * split_groups], tOsOPartial[None, None, i])
            cute.arch.cp_async_commit_group()

    def partial_copy_atom(self) -> cute.CopyAtom:
        # .cg: each partial is read exactly once, keep it out of L1.
        return cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), Float32, num_bits_per_copy=128
        )

    @cute.jit
    def accumulate(
        self,
        tOrO: cute.Tensor,  # (4, chunks) fp32, zero: gets the weighted sum of the group's splits
        tOgOPartial: cute.Tensor,  # (4, chunks, num_splits) gmem
        tOsOPartial: cute.Tensor,  # (4, chunks, stages) smem, private to this thread
        sLSE: cute.Tensor,  # (max_splits, tile_m) weights
        m: Int32,
        num_splits: Int32,
        group: Int32,
        split_groups: Int32,
    ):
        """Splits group, group + split_groups, ...: the i-th of them in ring slot i % stages,
        the first stages - 1 already in flight (``prefetch_splits``). Returns with no copy in
        flight, so the caller may reuse the ring."""
        atom = self.partial_copy_atom()
        stages = const_expr(self.stages)
        tOrOPartial = cute.make_rmem_tensor((4, self.chunks), Float32)
        for i in cutlass.range((num_splits - group + split_groups - 1) // split_groups):
            nxt = i + (stages - 1)
            # Refills the slot read in the previous iteration: only this thread uses it.
            self.load_split(atom, tOgOPartial, tOsOPartial, sLSE, m, num_splits, group + nxt * split_groups,
                            nxt % stages)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(stages - 1)
            weight = sLSE[group + i * split_groups, m]
            # A slot whose copy was skipped holds stale bytes (maybe NaN): never touch it.
            if weight > 0.0:
                cute.autovec_copy(tOsOPartial[None, None, i % stages], tOrOPartial)
                tOrO.store(tOrO.load() + weight * tOrOPartial.load())
        cute.arch.cp_async_wait_group(0)

    @cute.jit
    def load_split(
        self,
        atom: cute.CopyAtom,
        tOgOPartial: cute.Tensor,  # (4, chunks, num_splits) gmem
        tOsOPartial: cute.Tensor,  # (4, chunks, stages) smem
        sLSE: cute.Tensor,  # (max_splits, tile_m) weights
        m: Int32,
        num_splits: Int32,
        split: Int32,
        stage: Int32,
    ):
        # A split of weight 0 (lse -inf, or underflow) past the prefetched ones is not read
        # at all: its partial may be garbage or NaN, and it costs no bandwidth.
        if split < num_splits:
            if sLSE[split, m] > 0.0:
                cute.copy(atom, tOgOPartial[None, None, split], tOsOPartial[None, None, stage])

    @cute.jit
    def store(
        self,
        tOrO: cute.Tensor,  # (4, chunks) fp32 accumulator
        tOgO: cute.Tensor,  # (vec,) gmem, 16 B aligned
    ):
        rO = cute.make_rmem_tensor((self.vec,), self.dtype)
        rO.store(tOrO.load().to(self.dtype))
        cute.autovec_copy(rO, tOgO)


# ---------------------------------------------------------------------------------------
# Host side: compile key, compilation against fake tensors, launch
# ---------------------------------------------------------------------------------------


def compile_combine(key: tuple):
    """Compile for ``key`` = combine_key(...). Pure function of the key: sizes and leading
    strides are symbolic, so no shape ever recompiles; needs no GPU."""
    name, out_dtype_name, head_dim_v, has_lse, has_sink, arch = key[:6]
    split_info = key[6:] == ("split_info",)
    assert name == "combine"
    dtype = CUTE_DTYPE_BY_NAME[out_dtype_name]
    mOPartial = fake_tensor(Float32, 5, shape=(None, None, None, None, head_dim_v))
    # LSEs: fp32 scalars read one at a time, any strides (e.g. a transposed view).
    mLSEPartial = fake_tensor(Float32, 4, align=4, contiguous_last=False)
    mO = fake_tensor(dtype, 4, shape=(None, None, None, head_dim_v))
    mLSE = fake_tensor(Float32, 3, align=4, contiguous_last=False) if has_lse else None
    mSink = fake_tensor(Float32, 1, align=4) if has_sink else None
    kernel = FlashAttnCombine(dtype, head_dim_v)
    mSplitInfo = fake_tensor(Int32, 2, align=4, shape=(None, 2)) if split_info else None
    return cute.compile(kernel, mOPartial, mLSEPartial, mO, mLSE, mSink, Int32(1), mSplitInfo, fake_stream(),
                        options=compile_options(arch))


def combine_launcher(out_dtype, head_dim_v: int, has_lse: bool, has_sink: bool = False, split_groups: int = 1,
                     arch: Optional[str] = None, split_info: bool = False):
    """The compiled combine for an output dtype (torch), d_v, LSE on/off and sink on/off:
    called as ``fn(out_partial, lse_partial, out, lse, sink)`` with out_partial
    (num_splits, b, s, h, d_v) fp32, lse_partial (num_splits, b, h, s) fp32, out (b, s, h,
    d_v), lse (b, h, s) fp32 or None, sink (h,) fp32 or None, and ``split_groups`` lane
    groups per row (``heuristics.combine_split_groups``; a runtime argument, not in the
    key). Shapes are validated by the public API. Runs on torch's current stream.
    ``split_info``: the launcher takes a sixth argument, the (batch, 2) int32 slots of a
    device schedule (``FlashAttnCombine.__call__``'s ``mSplitInfo``)."""
    assert split_groups in (1, 2, 4, 8), split_groups  # a power of two <= tile_m (>= 8)
    key = combine_key(DTYPE_NAMES[out_dtype], head_dim_v, has_lse, arch or target_arch(), has_sink, split_info)
    fn = jit_cache.get_or_compile("combine", key, lambda: compile_combine(key))
    if split_info:
        return lambda out_partial, lse_partial, out, lse, sink, info: fn(out_partial, lse_partial, out, lse, sink,
                                                                         split_groups, info)
    return lambda out_partial, lse_partial, out, lse, sink: fn(out_partial, lse_partial, out, lse, sink,
                                                               split_groups, None)

