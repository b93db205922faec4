"""What every forward kernel class shares: its runtime argument list, its common static
configuration and its compilation from a compile key.

The launcher (``seam.bind_launcher``) calls a compiled kernel with the tensors and scalars
of ``FwdArgs``, in that order, then the backend's extra scalars; ``cute_utils.compile_fwd``
compiles it on fakes of the same list. A kernel class binds ``__call__ = fwd_call`` and
implements ``launch(args, *extra_scalars, stream)``: the list is written once, here, and
travels as one value (into the ``@cute.kernel`` too, where it is a tuple of its fields).
No base class: the kernels share this entry point and helpers, never a mainloop.
"""

from dataclasses import dataclass, replace
from typing import Callable, NamedTuple, Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from flash_attn_cute.device.block_info import BlockInfo
from flash_attn_cute.host.constants import padded_head_dims
from flash_attn_cute.device.cute_utils import CUTE_DTYPE_BY_NAME, compile_fwd, kernel_out_dtype
from flash_attn_cute.host.keys import parse_key
from flash_attn_cute.device.pack_gqa import packed_lse_rows, packed_rows, query_and_head_of_row
from flash_attn_cute.device.seqlen_info import SeqlenInfo
from flash_attn_cute.device.tile_scheduler import (SingleTileScheduler, TileDivisors, VarlenScheduler, WorkTile,
                                                   tile_divisors)
from flash_attn_cute.device.user_variant_kernel import make_variant
from flash_attn_cute.device.variants import AttentionVariant, AttnCtx, VariantParams, cp_ctx


class FwdArgs(NamedTuple):
    """The runtime arguments of every forward kernel (None where a feature is off)."""

    mQ: cute.Tensor  # (b, s_q, h, d) or (total_q, h, d)
    mK: cute.Tensor  # (b, s_k, h_kv, d), (total_k, h_kv, d) or (num_pages, page_size, h_kv, d)
    mV: cute.Tensor  # as mK, with d_v
    mO: cute.Tensor  # (b, s_q, h, d_v) / (total_q, h, d_v); split: (num_splits, ...) fp32
    mLSE: Optional[cute.Tensor]  # (b, h, s_q) / (h, total_q); split: (num_splits, ...)
    mCuSeqlensQ: Optional[cute.Tensor]  # (b + 1,) int32
    mCuSeqlensK: Optional[cute.Tensor]  # (b + 1,) int32
    mSeqUsedK: Optional[cute.Tensor]  # (b,) int32
    mPageTable: Optional[cute.Tensor]  # (b, max_pages) int32
    mSeqUsedQ: Optional[cute.Tensor]  # (b,) int32: query rows per sequence (the rest not computed)
    mLearnableSink: Optional[cute.Tensor]  # (h,) fp32: one logit per query head (read by non-split kernels)
    mKDescale: Optional[cute.Tensor]  # (b, h_kv) fp32, FP8 K/V only: K = the fp8 values x k_descale
    mVDescale: Optional[cute.Tensor]  # (b, h_kv) fp32, FP8 K/V only
    # (b,) int32, paged caches only (cache_leftpad, FA3's leftpad_k): sequence b's key j is
    # cache position leftpad[b] + j, and mSeqUsedK counts its keys from there
    # (``SeqlenInfo.leftpad_k``, ``paged_kv``).
    mLeftpadK: Optional[cute.Tensor]
    mAux0: Optional[cute.Tensor]  # a user variant's aux tensors (user_variants.MAX_AUX slots)
    mAux1: Optional[cute.Tensor]
    mAux2: Optional[cute.Tensor]
    mAux3: Optional[cute.Tensor]
    mBlockRanges: Optional[cute.Tensor]  # a block mask's key ranges (b, h, q blocks, 4) int32
    # Context parallelism (``variants.ContextParallel``; both None otherwise): (b,) int32, each
    # sequence's key count over every rank (cp_tot_seqused_k), and (3,) int32: this rank, the
    # ranks, the tokens per round-robin block.
    mCpTotSeqlenK: Optional[cute.Tensor]
    mCpInfo: Optional[cute.Tensor]
    softmax_scale: Float32
    window_left: Int32
    window_right: Int32
    softcap: Float32
    num_splits: Int32
    max_seqlen_q: Int32
    batch_size: Int32

    @property
    def varlen_q(self) -> bool:
        return self.mCuSeqlensQ is not None

    @property
    def paged(self) -> bool:
        return self.mPageTable is not None

    @property
    def varlen_k(self) -> bool:
        """Packed (total_k, ...) K/V: cu_seqlens_k without a page table (with one, the
        lengths come from cu_seqlens_k but the rows from the pages)."""
        return self.mCuSeqlensK is not None and self.mPageTable is None

    @property
    def cache_tail_may_be_garbage(self) -> bool:
        """K/V rows past a sequence's end, inside its last KV block, hold whatever a cache
        held there (seqused_k, paged): finite is not guaranteed, so P V must not read them."""
        return self.mSeqUsedK is not None or self.mPageTable is not None

    @property
    def aux(self) -> tuple:
        """The aux tensors present, in slot order."""
        return tuple(t for t in (self.mAux0, self.mAux1, self.mAux2, self.mAux3) if t is not None)

    def variant_ctx(self, batch, head, seqlen_q, seqlen_k, has_score_mod: bool) -> AttnCtx:
        """The variant context of a CTA (``1 / softcap`` computed once when a score
        modifier may read it)."""
        cap_inv = Float32(0.0)
        if cutlass.const_expr(has_score_mod):
            cap_inv = cute.arch.rcp_approx(self.softcap)
        return AttnCtx(batch, head, seqlen_q, seqlen_k,
                       VariantParams(self.window_left, self.window_right, self.softcap, cap_inv),
                       self.aux, self.mBlockRanges, cp_ctx(self.mCpInfo, self.mCpTotSeqlenK, batch))

    def heads(self) -> tuple:
        """(query heads, KV heads), from the tensors' head modes."""
        return self.mQ.shape[cute.rank(self.mQ) - 2], self.mK.shape[cute.rank(self.mK) - 2]

    def row_blocks(self, tile_m: int, qhead_per_kvhead_packed: int) -> tuple:
        """(M blocks of the longest (packed) query sequence, head groups: the KV heads under
        pack_gqa, else the query heads): the grid's extent over output rows."""
        heads_q, heads_kv = self.heads()
        heads = heads_kv if cutlass.const_expr(qhead_per_kvhead_packed > 1) else heads_q
        return cute.ceil_div(self.max_seqlen_q * qhead_per_kvhead_packed, tile_m), heads


def set_fwd_config(kernel, dtype, head_dim: int, head_dim_v: int, variant: AttentionVariant,
                   qhead_per_kvhead_packed: int = 1, is_split: bool = False, split_blocks: int = 0,
                   q_class: int = 0, head_dim_pairs=None) -> None:
    """The static configuration every forward kernel class holds, set on ``kernel``.
    ``split_blocks`` > 0: split s covers the absolute KV blocks [s * split_blocks, (s + 1) *
    split_blocks) (batch invariant, ``BlockInfo``); 0: even splits of each tile's range.
    ``head_dim`` / ``head_dim_v`` are the tensors' (the key's); the kernel's tiles, MMAs and
    smem use the padded widths (``constants.padded_head_dims`` over the kernel's
    ``head_dim_pairs``) and ``head_dim_valid`` / ``head_dim_v_valid`` bound its loads and
    stores (None where nothing is padded)."""
    padded = padded_head_dims(head_dim, head_dim_v, head_dim_pairs)
    assert padded is not None, (head_dim, head_dim_v, head_dim_pairs)
    kernel.dtype = dtype
    kernel.out_dtype = kernel_out_dtype(dtype, is_split)
    kernel.head_dim, kernel.head_dim_v = padded
    kernel.head_dim_valid = head_dim if head_dim != padded[0] else None
    kernel.head_dim_v_valid = head_dim_v if head_dim_v != padded[1] else None
    kernel.variant = variant
    kernel.qhead_per_kvhead_packed = qhead_per_kvhead_packed  # rows per query position in the M tile
    kernel.is_split = is_split
    kernel.split_blocks = split_blocks
    kernel.q_class = q_class  # the sequences it computes (FwdProblem.q_class; BlockInfo)


@cute.jit
def fwd_call(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
             mLSE: Optional[cute.Tensor], mCuSeqlensQ: Optional[cute.Tensor],
             mCuSeqlensK: Optional[cute.Tensor], mSeqUsedK: Optional[cute.Tensor],
             mPageTable: Optional[cute.Tensor], mSeqUsedQ: Optional[cute.Tensor],
             mLearnableSink: Optional[cute.Tensor], mKDescale: Optional[cute.Tensor],
             mVDescale: Optional[cute.Tensor], mLeftpadK: Optional[cute.Tensor], mAux0: Optional[cute.Tensor],
             mAux1: Optional[cute.Tensor],
             mAux2: Optional[cute.Tensor], mAux3: Optional[cute.Tensor], mBlockRanges: Optional[cute.Tensor],
             mCpTotSeqlenK: Optional[cute.Tensor], mCpInfo: Optional[cute.Tensor], softmax_scale: Float32, window_left: Int32,
             window_right: Int32, softcap: Float32, num_splits: Int32, max_seqlen_q: Int32, batch_size: Int32,
             *extra_scalars_and_stream):
    """The compiled entry point of every forward kernel class (``__call__ = fwd_call``, not a
    base class: the classes share this argument list, nothing else). ``FwdArgs`` in order,
    then the kernel's extra scalars (their types come from the values compiled with) and
    the stream, handed to the class's ``launch(args, *extra_scalars, stream)``."""
    self.launch(FwdArgs(mQ, mK, mV, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mPageTable, mSeqUsedQ,
                        mLearnableSink, mKDescale, mVDescale, mLeftpadK, mAux0, mAux1, mAux2, mAux3, mBlockRanges,
                        mCpTotSeqlenK, mCpInfo, softmax_scale, window_left,
                        window_right, softcap, num_splits, max_seqlen_q, batch_size),
                *extra_scalars_and_stream)


def compile_from_key(key: tuple, tile_len: int, make_kernel: Callable, extra_scalars: tuple = ()):
    """Compiles a forward kernel for a compile key (``seam.make_key``) on fake tensors (no GPU
    needed): ``make_kernel(dtype, d, d_v, tile, variant, qhead_per_kvhead_packed, is_split,
    split_blocks, *key_extra, q_class=)`` builds the kernel object; ``extra_scalars`` are placeholders
    of its extra runtime scalars."""
    f = parse_key(key, tile_len)
    q_name, _, kv_name = f.dtype_name.partition("/")  # "bf16", or "bf16/e4m3" for FP8 K/V (keys.dtype_key)
    dtype = CUTE_DTYPE_BY_NAME[q_name]
    variant = make_variant(*f.flags)
    kernel = make_kernel(dtype, f.d, f.d_v, f.tile, variant, f.qhead_per_kvhead_packed, f.is_split, f.split_blocks,
                         *f.extra, q_class=f.q_class)
    return compile_fwd(kernel, dtype, f.d, f.d_v, f.arch, kv_dtype=CUTE_DTYPE_BY_NAME[kv_name or q_name],
                       is_split=f.is_split, has_lse=f.has_lse,
                       varlen_q=f.varlen_q, varlen_k=f.varlen_k, has_seqused_k=f.has_seqused_k, paged=f.paged,
                       has_seqused_q=f.has_seqused_q, has_sink=f.has_sink, leftpad_k=f.leftpad_k,
                       extra_scalars=extra_scalars,
                       user_key=f.flags[3] if len(f.flags) > 3 else None, cp=len(f.flags) > 4)


@cute.jit
def zero_rows_from(sX: cute.Tensor, first_row: Int32, tidx: Int32, num_threads: cutlass.Constexpr[int]):
    """Zeroes rows [first_row, rows) of a (rows, cols) smem tile, 8 columns per thread and
    step (``num_threads`` threads, this one ``tidx``). The writes are generic-proxy: the
    caller fences them (``fence_view_async_shared``) before an MMA reads the tile."""
    cols = cute.size(sX, mode=[1])
    chunks = cols // 8
    for idx in cutlass.range(first_row * chunks + tidx, cute.size(sX, mode=[0]) * chunks, num_threads, unroll=1):
        row = idx // chunks
        col = (idx - row * chunks) * 8
        for j in cutlass.range_constexpr(8):
            sX[row, col + j] = sX.element_type(0.0)


def tile_grid(args: FwdArgs, tile_m: int, qhead_per_kvhead_packed: int) -> tuple:
    """(grid, divisors, M blocks of the longest sequence, head groups) of a kernel with one
    CTA per tile: ``VarlenScheduler`` for packed queries, else ``SingleTileScheduler``.
    ``divisors`` (``tile_scheduler.tile_divisors`` of the head groups, resp. of the M
    blocks, and of the splits) is the kernel argument ``tile_work`` divides the block
    index by."""
    num_m_blocks, heads = args.row_blocks(tile_m, qhead_per_kvhead_packed)
    if cutlass.const_expr(args.varlen_q):
        grid = VarlenScheduler.grid(cute.size(args.mQ.shape[0]), qhead_per_kvhead_packed, tile_m, heads,
                                    args.num_splits, args.batch_size)
        divisors = tile_divisors(heads, args.num_splits)
    else:
        grid = SingleTileScheduler.grid(num_m_blocks, heads, args.num_splits, args.batch_size)
        divisors = tile_divisors(num_m_blocks, args.num_splits)
    return grid, divisors, num_m_blocks, heads


@cute.jit
def tile_work(args: FwdArgs, divisors: TileDivisors, tile_m: cutlass.Constexpr[int],
              qhead_per_kvhead_packed: cutlass.Constexpr[int]) -> WorkTile:
    """This CTA's tile in a grid of ``tile_grid`` (``divisors``: its divisors). Every lane
    of the calling warp takes part."""
    work = None
    if cutlass.const_expr(args.varlen_q):
        work = VarlenScheduler.get_work(args.mCuSeqlensQ, divisors.rows, qhead_per_kvhead_packed, tile_m,
                                        args.batch_size)
    else:
        work = SingleTileScheduler.get_work(divisors, args.batch_size)
    return work


def split_slice(mX: cute.Tensor, split_idx: Int32) -> cute.Tensor:
    """Split partial ``split_idx`` of an (num_splits, ...) output tensor."""
    return mX[(split_idx,) + (None,) * (cute.rank(mX) - 1)]


@dataclass(frozen=True)
class FwdTile:
    """The output tile one CTA computes: its sequence, variant context, (packed) rows and
    KV block range. ``create`` makes it from a forward kernel's arguments and a work tile
    of the scheduler, ``of_work`` from a sequence and a context built otherwise (the MLA
    kernels' ``mla_kernel.MlaTile``)."""

    ctx: AttnCtx
    seqlen: SeqlenInfo
    m_block: Int32
    head_kv: Int32
    split_idx: Int32
    rows_valid: Int32  # rows of the tile inside the (packed) sequence; <= 0: no work
    softmax_scale: Float32
    n_block_min: Optional[Int32]
    n_block_max: Optional[Int32]

    @staticmethod
    @cute.jit
    def create(args: FwdArgs, work: WorkTile, block_info: BlockInfo, is_split: cutlass.Constexpr[bool]) -> "FwdTile":
        head_kv = FwdTile.head_kv_of(args, work, block_info)
        seqlen = FwdTile.seqlen_of(args, work)
        ctx = FwdTile.ctx_of(args, work, seqlen, block_info)
        return FwdTile.of_work(work, ctx, seqlen, head_kv, args.softmax_scale, args.num_splits, block_info, is_split)

    # ``create`` in steps, for a kernel that checks for rows before it builds the rest
    # (``FwdTile(..., None, None)``, then ``with_n_block_range``).

    @staticmethod
    def head_kv_of(args: FwdArgs, work: WorkTile, block_info: BlockInfo) -> Int32:
        """The KV head of a work tile (whose head is the KV head already under pack_gqa)."""
        heads_q, heads_kv = args.heads()
        if cutlass.const_expr(block_info.qhead_per_kvhead_packed > 1):
            return work.head
        return work.head // (heads_q // heads_kv)

    @staticmethod
    def seqlen_of(args: FwdArgs, work: WorkTile) -> SeqlenInfo:
        """The work tile's sequence. A paged cache has no offsets (but its key start, with
        mLeftpadK); its lengths come from seqused_k (or cu_seqlens_k); seqused_q, where
        given, counts its query rows."""
        return SeqlenInfo.create_for(work.batch, args.mQ, args.mK, args.mCuSeqlensQ, args.mCuSeqlensK,
                                     args.mSeqUsedK, args.mPageTable, args.mSeqUsedQ, args.mLeftpadK)

    @staticmethod
    def ctx_of(args: FwdArgs, work: WorkTile, seqlen: SeqlenInfo, block_info: BlockInfo) -> AttnCtx:
        return args.variant_ctx(work.batch, work.head, seqlen.seqlen_q, seqlen.seqlen_k,
                                block_info.variant.has_score_mod)

    @staticmethod
    @cute.jit
    def rows_valid_of(seqlen: SeqlenInfo, work: WorkTile, block_info: BlockInfo) -> Int32:
        """Rows of the work tile's M block inside the (packed) sequence; <= 0: none (also
        for a CTA of a folded grid past the last sequence, and for a sequence outside the
        kernel's ``q_class``)."""
        rows = seqlen.seqlen_q * block_info.qhead_per_kvhead_packed - work.m_block * block_info.tile_m
        if not work.in_batch:
            rows = Int32(0)
        if cutlass.const_expr(block_info.q_class > 0):  # the short sequences of a mixed plan
            if seqlen.seqlen_q > block_info.q_class:
                rows = Int32(0)
        if cutlass.const_expr(block_info.q_class < 0):  # the long ones
            if seqlen.seqlen_q <= -block_info.q_class:
                rows = Int32(0)
        return rows

    @staticmethod
    @cute.jit
    def of_work(work: WorkTile, ctx: AttnCtx, seqlen: SeqlenInfo, head_kv: Int32, softmax_scale: Float32,
                num_splits: Int32, block_info: BlockInfo, is_split: cutlass.Constexpr[bool]) -> "FwdTile":
        """The tile of ``work`` in a sequence whose lengths, context and KV head are known."""
        n_block_min, n_block_max = block_info.get_n_block_min_max(work.m_block, ctx, work.split_idx, num_splits,
                                                                  is_split)
        rows_valid = FwdTile.rows_valid_of(seqlen, work, block_info)
        return FwdTile(ctx, seqlen, work.m_block, head_kv, work.split_idx, rows_valid, softmax_scale,
                       n_block_min, n_block_max)

    def with_n_block_range(self, block_info: BlockInfo, num_splits: Int32, is_split: bool) -> "FwdTile":
        """This tile with its KV block range, for a tile made without one (its fields None)."""
        n_block_min, n_block_max = block_info.get_n_block_min_max(self.m_block, self.ctx, self.split_idx, num_splits,
                                                                  is_split)
        return replace(self, n_block_min=n_block_min, n_block_max=n_block_max)

    def with_k_descale(self, args: FwdArgs) -> "FwdTile":
        """FP8 K: the softmax scale times ``k_descale[b, h_kv]`` (S = q . k scales with it,
        before any softcap or score modifier); the tile itself otherwise."""
        if args.mKDescale is None:
            return self
        return replace(self, softmax_scale=self.softmax_scale * args.mKDescale[self.ctx.batch, self.head_kv])

    def n_block_runs(self, block_info: BlockInfo, n_block_max=None):
        """(n_mid_hi, n_mid_lo) of ``BlockInfo.get_n_block_runs`` over [n_block_min,
        ``n_block_max``) (default: the tile's)."""
        n_block_max = self.n_block_max if n_block_max is None else n_block_max
        return block_info.get_n_block_runs(self.m_block, self.ctx, self.n_block_min, n_block_max)

    def head_rows(self, qhead_per_kvhead_packed: int):
        """The head the tile's rows index: the KV head under pack_gqa, else the query head."""
        return self.head_kv if qhead_per_kvhead_packed > 1 else self.ctx.head

    def q_rows(self, mQ: cute.Tensor, qhead_per_kvhead_packed: int, varlen_q: bool) -> cute.Tensor:
        """(rows, d) view of the query rows of this tile's head group (packed under pack_gqa)."""
        return packed_rows(self.seqlen.q_view(mQ, self.ctx.batch, varlen_q), self.head_rows(qhead_per_kvhead_packed),
                           qhead_per_kvhead_packed)

    def out_rows(self, mO: cute.Tensor, qhead_per_kvhead_packed: int, is_split: bool, varlen_q: bool) -> cute.Tensor:
        """(rows, d_v) view of the output rows of this tile's head group (its split's partial)."""
        if cutlass.const_expr(is_split):
            mO = split_slice(mO, self.split_idx)
        return self.q_rows(mO, qhead_per_kvhead_packed, varlen_q)

    def row_sink(self, mLearnableSink: cute.Tensor, row: Int32, qhead_per_kvhead_packed: int) -> Float32:
        """The learnable sink (fp32, natural log) of packed row ``row`` of the head group: that
        of its query head (``pack_gqa.query_and_head_of_row``; without packing, the CTA's)."""
        if cutlass.const_expr(qhead_per_kvhead_packed == 1):
            return mLearnableSink[self.ctx.head]
        return mLearnableSink[query_and_head_of_row(row, self.head_kv, qhead_per_kvhead_packed)[1]]

    def row_sinks(self, mLearnableSink: cute.Tensor, tXcX_mn: cute.Tensor, row0: Int32,
                  qhead_per_kvhead_packed: int) -> cute.Tensor:
        """(rows,) ``row_sink`` of each of this thread's softmax rows: ``tXcX_mn`` the (row,
        col) coordinates of an accumulator holding them, tile row ``r`` being packed row
        ``row0 + r`` (without packing, one head: one load)."""
        num_rows = cute.size(tXcX_mn, mode=[0])
        sinks = cute.make_rmem_tensor((num_rows,), Float32)
        if cutlass.const_expr(qhead_per_kvhead_packed == 1):
            sinks.fill(self.row_sink(mLearnableSink, row0, 1))
        else:
            for r in range(num_rows):  # static: traced once per row
                sinks[r] = self.row_sink(mLearnableSink, row0 + tXcX_mn[r, 0][0], qhead_per_kvhead_packed)
        return sinks

    def lse_rows(self, mLSE: cute.Tensor, qhead_per_kvhead_packed: int, is_split: bool, varlen_q: bool) -> cute.Tensor:
        """(rows,) view of the LSE of this tile's head group (its split's partial)."""
        if cutlass.const_expr(is_split):
            mLSE = split_slice(mLSE, self.split_idx)
        return packed_lse_rows(self.seqlen.lse_view(mLSE, self.ctx.batch, varlen_q),
                               self.head_rows(qhead_per_kvhead_packed), qhead_per_kvhead_packed)
