"""Which output tile a CTA computes: grid shape and block index -> work tile.

``SingleTileScheduler``: one CTA per (m_block, head[, split], batch), launched as a grid of
``(num_m_blocks, heads * num_splits, batch)``. The M blocks are handed out last-first:
under causal masking the last rows see the most keys, and a CTA that starts last would
otherwise finish last. Persistent schedulers (SM90, SM100) expose the same ``WorkTile``.
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
