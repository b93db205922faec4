"""Which output tile a CTA computes: grid shape and block index -> work tile.

``SingleTileScheduler``: one CTA per (m_block, head[, split], batch), launched as a grid of
``(num_m_blocks, heads * num_splits, batch)``. The M blocks are handed out last-first:
under causal masking the last rows see the most keys, and a CTA that starts last would
otherwise finish last.

``LptScheduler``: the same one CTA per tile, ordered longest-first across heads and
batches in L2-sized sections (causal and local masks). Both hand out a ``WorkTile``.

``PersistentScheduler``: min(tiles, SMs) CTAs, CTA c computing tiles c, c + grid, c + 2 grid,
... of either order above (``work_of``: the tile the non-persistent grid would give its
idx-th CTA, x fastest, as the hardware launches them). A static stride: the orders are
already longest-first, so a dynamic (atomic counter) hand-out is not needed.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32


@dataclass(frozen=True)
class WorkTile:
    m_block: Int32
    head: Int32  # the query head, or the KV head under pack_gqa (the head of the M rows)
    split_idx: Int32
    batch: Int32


class SingleTileScheduler:
    @staticmethod
    def grid(num_m_blocks, heads, num_splits, batch):
        """Launch grid for ``heads`` head groups (KV heads when packed) and ``num_splits``."""
        return (num_m_blocks, heads * num_splits, batch)

    @staticmethod
    @cute.jit
    def get_work(num_splits: Int32) -> WorkTile:
        bidx, bidy, batch = cute.arch.block_idx()
        num_m_blocks, _, _ = cute.arch.grid_dim()
        head = bidy // num_splits
        return WorkTile(num_m_blocks - 1 - bidx, head, bidy - head * num_splits, batch)

    @staticmethod
    @cute.jit
    def work_of(idx: Int32, num_m_blocks: Int32, heads: Int32, num_splits: Int32) -> WorkTile:
        """The tile of CTA ``idx`` of the grid, linearized x fastest."""
        rest = idx // num_m_blocks
        head_splits = heads * num_splits
        batch = rest // head_splits
        bidy = rest - batch * head_splits
        head = bidy // num_splits
        return WorkTile(num_m_blocks - 1 - (idx - rest * num_m_blocks), head, bidy - head * num_splits, batch)


class LptScheduler:
    """Longest-processing-time first, L2-aware, for causal and local masks (one CTA per tile).

    The grid is flat over (m_block, head, batch) [x num_splits]. Tiles are handed out in
    sections of ``l2_heads`` (head, batch) pairs, as many as fit their K and V in L2;
    inside a section the heaviest M blocks of every pair come first. The plain order
    (``SingleTileScheduler``) runs all M blocks of one head together, so under causal
    masking its last wave holds the light tiles of a few heads and idles most SMs."""

    @staticmethod
    def grid(num_m_blocks, heads, num_splits, batch):
        return (num_m_blocks * heads * batch, num_splits, 1)

    @staticmethod
    @cute.jit
    def get_work(num_m_blocks: Int32, heads: Int32, batch_size: Int32, l2_heads: Int32) -> WorkTile:
        t, split_idx, _ = cute.arch.block_idx()
        return LptScheduler.tile(t, split_idx, num_m_blocks, heads, batch_size, l2_heads)

    @staticmethod
    @cute.jit
    def work_of(idx: Int32, num_m_blocks: Int32, heads: Int32, batch_size: Int32, l2_heads: Int32) -> WorkTile:
        """The tile of CTA ``idx`` of the grid, linearized x fastest (splits outermost)."""
        tiles = num_m_blocks * heads * batch_size
        split_idx = idx // tiles
        return LptScheduler.tile(idx - split_idx * tiles, split_idx, num_m_blocks, heads, batch_size, l2_heads)

    @staticmethod
    @cute.jit
    def tile(t: Int32, split_idx: Int32, num_m_blocks: Int32, heads: Int32, batch_size: Int32,
             l2_heads: Int32) -> WorkTile:
        section_tiles = l2_heads * num_m_blocks
        section = t // section_tiles
        in_section = t - section * section_tiles
        num_bh = heads * batch_size
        full_sections = num_bh // l2_heads
        # The last section holds the remainder of the (head, batch) pairs.
        minor = l2_heads
        if section >= full_sections:
            minor = num_bh - full_sections * l2_heads
        block = in_section // minor
        bh = section * l2_heads + (in_section - block * minor)
        batch = bh // heads
        return WorkTile(num_m_blocks - 1 - block, bh - batch * heads, split_idx, batch)


class PersistentScheduler:
    """min(tiles, max_ctas) CTAs (max_ctas: the SM count, one CTA per SM), each looping over
    the tiles idx = blockIdx.x + i * gridDim.x of the non-persistent order (``work_of``)."""

    @staticmethod
    def num_tiles(num_m_blocks, heads, num_splits, batch):
        return num_m_blocks * heads * num_splits * batch

    @staticmethod
    def grid(num_tiles, max_ctas):
        return (cutlass.min(num_tiles, max_ctas), 1, 1)
