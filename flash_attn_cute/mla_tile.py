"""The work of one MLA decode CTA, shared by the SM80 and SM90 MLA kernels: which packed
rows (query position x head) it owns, which split, and the KV blocks it walks from the
last to the first, in the three runs of ``BlockInfo`` (masked / unmasked / masked).

The sequence length is clamped to the page table's capacity (``SeqlenInfo``), so a bad
``cache_seqlens`` never walks past the table; page ids are clamped where rows are gathered
(``paged_kv.page_and_row``)."""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from flash_attn_cute.block_info import BlockInfo
from flash_attn_cute.seqlen_info import SeqlenInfo
from flash_attn_cute.tile_scheduler import SingleTileScheduler
from flash_attn_cute.variants import AttnCtx, VariantParams


@dataclass(frozen=True)
class MlaTile:
    """The rows one CTA computes and the KV blocks it walks (last to first)."""

    ctx: AttnCtx
    m_block: Int32
    split_idx: Int32
    rows_valid: Int32  # packed rows of the tile inside the sequence; <= 0: no work
    n_max: Int32
    n_tiles: Int32
    n_mid_hi: Int32  # blocks in [n_mid_lo, n_mid_hi) need no mask
    n_mid_lo: Int32

    @staticmethod
    @cute.jit
    def create(mQn: cute.Tensor, mCkv: cute.Tensor, mSeqlens: cute.Tensor, mPageTable: cute.Tensor,
               num_splits: Int32, block_info: BlockInfo, is_split: cutlass.Constexpr[bool]) -> "MlaTile":
        """This CTA's tile from the grid position (``SingleTileScheduler``); ``block_info``
        carries the kernel's tile shape, the heads packed per query position and the variant
        (causal or none: MLA has no window or softcap)."""
        work = SingleTileScheduler.get_work(num_splits)
        capacity = mPageTable.shape[1] * mCkv.shape[1]
        lens = SeqlenInfo.create(work.batch, mQn.shape[1], capacity, None, None, mSeqlens, capacity)
        no_window = VariantParams(Int32(-1), Int32(0), Float32(0.0), Float32(0.0))
        ctx = AttnCtx(work.batch, Int32(0), lens.seqlen_q, lens.seqlen_k, no_window)
        lo, hi = block_info.get_n_block_min_max(work.m_block, ctx, work.split_idx, num_splits, is_split)
        mid_hi, mid_lo = block_info.get_n_block_runs(work.m_block, ctx, lo, hi)
        rows_valid = lens.seqlen_q * block_info.qhead_per_kvhead_packed - work.m_block * block_info.tile_m
        return MlaTile(ctx, work.m_block, work.split_idx, rows_valid, hi, cutlass.max(hi - lo, 0), mid_hi, mid_lo)
