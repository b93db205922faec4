"""Which KV blocks one CTA visits, and which of them need a per-element mask.

Shared by every architecture: the tile sizes are static, the sequence lengths and
the variant's window are runtime values. So is the split layout: ``split_blocks`` > 0
(batch invariant) gives split s the absolute blocks [s * split_blocks, (s + 1) *
split_blocks), the same in any batch; 0 cuts each tile's range into num_splits even parts.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from flash_attn_cute.device.variants import AttentionVariant, AttnCtx


@dataclass(frozen=True)
class BlockInfo:
    tile_m: cutlass.Constexpr[int]
    tile_n: cutlass.Constexpr[int]
    qhead_per_kvhead_packed: cutlass.Constexpr[int]  # rows per query position in the M tile
    variant: cutlass.Constexpr[AttentionVariant]
    split_blocks: cutlass.Constexpr[int] = 0  # KV blocks per split (batch invariant), 0: even splits
    q_class: cutlass.Constexpr[int] = 0  # FwdProblem.q_class: n > 0 only sequences of <= n queries, -n: > n

    def query_range(self, m_block: Int32, ctx: AttnCtx):
        """First and last query position held by the rows of this M tile."""
        packed = self.qhead_per_kvhead_packed
        row_lo = m_block * self.tile_m
        row_hi = cutlass.min((m_block + 1) * self.tile_m, ctx.seqlen_q * packed) - 1
        return row_lo // packed, row_hi // packed

    @cute.jit
    def get_n_block_min_max(
        self, m_block: Int32, ctx: AttnCtx, split_idx: Int32, num_splits: Int32, is_split: cutlass.Constexpr
    ):
        """[n_block_min, n_block_max) for this CTA; empty (min >= max) when nothing is visible.
        With splits, the visible range is cut into num_splits near-equal chunks, or
        (``split_blocks``) intersected with the split's fixed blocks."""
        n_block_max = cute.ceil_div(ctx.seqlen_k, self.tile_n)
        n_block_min = Int32(0)
        q_lo, q_hi = self.query_range(m_block, ctx)
        lo, hi = self.variant.key_range(q_lo, q_hi, ctx)
        if cutlass.const_expr(hi is not None):
            n_block_max = cutlass.min(n_block_max, cute.ceil_div(cutlass.max(hi, 0), self.tile_n))
        if cutlass.const_expr(lo is not None):
            n_block_min = cutlass.max(lo, 0) // self.tile_n
        if cutlass.const_expr(is_split and self.split_blocks > 0):
            n_block_min = cutlass.max(n_block_min, split_idx * self.split_blocks)
            # The last split also takes any blocks past the grid's splits: none when the
            # planner's max_seqlen_k bounds every length (the splits are then the same in
            # any batch), and the rest of the keys, not a silent cut, when a hint was low.
            if split_idx < num_splits - 1:
                n_block_max = cutlass.min(n_block_max, (split_idx + 1) * self.split_blocks)
        elif cutlass.const_expr(is_split):
            per_split = cute.ceil_div(cutlass.max(n_block_max - n_block_min, 0), num_splits)
            n_block_min = n_block_min + split_idx * per_split
            n_block_max = cutlass.min(n_block_max, n_block_min + per_split)
        return n_block_min, n_block_max

    @cute.jit
    def get_unmasked_n_block_range(self, m_block: Int32, ctx: AttnCtx):
        """[lo, hi): blocks needing neither the sequence-end nor the variant's mask."""
        q_lo, q_hi = self.query_range(m_block, ctx)
        key_lo, key_hi = self.variant.unmasked_key_range(q_lo, q_hi, ctx)
        n_lo = Int32(0)
        n_hi = ctx.seqlen_k // self.tile_n
        if cutlass.const_expr(key_hi is not None):
            n_hi = cutlass.min(n_hi, cutlass.max(key_hi, 0) // self.tile_n)
        if cutlass.const_expr(key_lo is not None):
            n_lo = cute.ceil_div(cutlass.max(key_lo, 0), self.tile_n)
        return n_lo, n_hi

    @cute.jit
    def get_n_block_runs(self, m_block: Int32, ctx: AttnCtx, n_block_min: Int32, n_block_max: Int32):
        """(n_mid_hi, n_mid_lo): kernels walk [n_block_min, n_block_max) top-down in three
        runs, [n_mid_hi, n_block_max) masked (sequence end, causal diagonal),
        [n_mid_lo, n_mid_hi) unmasked, and [n_block_min, n_mid_lo) masked again (a local
        window's left edge; empty without a mask). Separate loops keep the hot middle
        loop free of mask state."""
        n_lo, n_hi = self.get_unmasked_n_block_range(m_block, ctx)
        n_mid_hi = cutlass.max(cutlass.min(n_hi, n_block_max), n_block_min)
        n_mid_lo = cutlass.min(cutlass.max(n_lo, n_block_min), n_mid_hi)
        return n_mid_hi, n_mid_lo

    @cute.jit
    def walk_n_blocks(self, step, n_block_min: Int32, n_block_max: Int32, runs: tuple, carry=None):
        """The KV walk of every kernel: ``carry = step(carry, n_block, masked)`` on the
        blocks [n_block_min, n_block_max) from the last to the first, in the three runs
        ``runs`` = ``get_n_block_runs(..., n_block_min, n_block_max)`` split them into
        (``masked`` static per run); returns the carry."""
        n_mid_hi, n_mid_lo = runs
        for i in cutlass.range(n_block_max - n_mid_hi, unroll=1):
            carry = step(carry, n_block_max - 1 - i, True)
        for i in cutlass.range(n_mid_hi - n_mid_lo, unroll=1):
            carry = step(carry, n_mid_hi - 1 - i, False)
        if cutlass.const_expr(self.variant.has_mask):
            for i in cutlass.range(n_mid_lo - n_block_min, unroll=1):
                carry = step(carry, n_mid_lo - 1 - i, True)
        return carry
