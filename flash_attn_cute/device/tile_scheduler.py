"""Which output tile a CTA computes: grid shape and block index -> work tile.

``SingleTileScheduler``: one CTA per (m_block, head[, split], batch), launched as a grid of
``(num_m_blocks, heads, batch * num_splits)``. The M blocks are handed out last-first:
under causal masking the last rows see the most keys, and a CTA that starts last would
otherwise finish last. (sequence, split) pairs past grid z's limit (``MAX_GRID_YZ``) fold
into x (``fold_batch``): the same grid, in the same order, whenever they fit.

``LptScheduler``: the same one CTA per tile, ordered longest-first across heads and
batches in L2-sized sections (causal and local masks). Both hand out a ``WorkTile``. Its
grid is flat on x (up to 2^31 - 1 CTAs), as is the persistent order's tile index: int32
arithmetic on tile counts, far from overflow at 200,000 sequences x 128 heads x 8 M blocks
(2e8), splits on y (<= 256).

``VarlenScheduler``: variable-length queries (cu_seqlens_q). One CTA per M block that holds
rows, on a flat grid of ``ceil(total_q * rows_per_query / tile_m) + batch`` CTAs: sequence b
owns the tiles from ``floor(cu_seqlens_q[b] * rows_per_query / tile_m) + b`` on, at least as
many as its M blocks, at most two more (those find no rows), one CTA per tile and head. A CTA finds its sequence by a
32-way search of the warp over those starts (log32(batch) rounds of one load per lane:
2 at 100 sequences, 4 at 200,000). The grid of the other schedulers spans
``max_seqlen_q``'s M blocks for every sequence: a serving step of 96 decode rows and 4
prefill rows of 1,024 queries launched 25,600 CTAs for 1,792 tiles, each empty CTA paying
its launch and prologue on an SM its shared memory keeps to one CTA.

``PersistentScheduler``: min(tiles, SMs) CTAs, CTA c computing tiles c, c + grid, c + 2 grid,
... of either order above (``work_of``: the tile the non-persistent grid would give its
idx-th CTA, x fastest, as the hardware launches them), or, over the LPT order, c and then the
indices an atomic counter hands out (the SM90 kernel's ``dynamic``, opt-in): a static stride over
tiles of different lengths gives the CTA that takes the heavy end of each round the most
work (b4 s8192 h8 d256 causal, 128 x 96 tiles: 27 % over the mean in a model of the KV
blocks per tile, 777 against 933 TFLOP/s one CTA per tile on an H100), the counter 0.5 %.
"""

from dataclasses import dataclass
from typing import NamedTuple, Union

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Int32

from flash_attn_cute.host.constants import MAX_GRID_YZ



@dataclass(frozen=True)
class WorkTile:
    m_block: Int32
    head: Int32  # the query head, or the KV head under pack_gqa (the head of the M rows)
    split_idx: Int32
    batch: Int32  # always a valid batch index (that of a CTA past the batch is clamped)
    in_batch: Union[Boolean, bool] = True  # False: a CTA of a folded grid past the last sequence: no rows


def fold_batch(num_m_blocks, batch):
    """(grid x, grid z) of a grid with the batch (or any outer index: (sequence, split)
    pairs) on z: ``num_m_blocks`` x fold and at most ``MAX_GRID_YZ`` on z, fold =
    ceil(batch / MAX_GRID_YZ) (1 whenever the batch fits on z, leaving the grid as it was).
    Block (x, z) is M block ``x % num_m_blocks`` of sequence ``z + MAX_GRID_YZ * (x //
    num_m_blocks)`` (``unfold_batch``)."""
    return num_m_blocks * cute.ceil_div(batch, MAX_GRID_YZ), cutlass.min(batch, MAX_GRID_YZ)


def m_blocks_divisor(num_m_blocks):
    """``num_m_blocks`` as the kernel argument ``unfold_batch`` divides by: a fast divisor,
    its multiplier computed at launch (host side), so that the division is a multiply-high
    and a shift. A division by a runtime value runs on the vector pipes, which takes the
    CTA's sequence index, and every length loaded with it, off the uniform datapath: the
    SM100 softmax warpgroup of an even-split kernel then spilled 58 values, the SM90
    gathering producer one per tile (a loop of subtractions did the same)."""
    return cute.fast_divmod_create_divisor_v2(num_m_blocks)


class TileDivisors(NamedTuple):
    """What a one-CTA-per-tile grid's block index is divided by (``tile_divisors``, made
    at launch): its M blocks (the head groups for ``VarlenScheduler``) and its splits."""

    rows: cute.FastDivmodDivisorV2
    splits: cute.FastDivmodDivisorV2


def tile_divisors(rows, num_splits) -> TileDivisors:
    """``TileDivisors`` of a grid, both fast divisors (``m_blocks_divisor``): the sequence
    index of a (sequence, split) pair then stays on the uniform datapath (a runtime division
    of it made the SM100 decode key's softmax warpgroup spill 98 values, sm_100a SASS)."""
    return TileDivisors(m_blocks_divisor(rows), m_blocks_divisor(num_splits))


@cute.jit
def unfold_batch(m_blocks: cute.FastDivmodDivisorV2, batch_size: Int32):
    """(M block index, sequence, whether it is < batch_size) of this CTA in a grid of
    ``fold_batch`` (``m_blocks``: ``m_blocks_divisor`` of its num_m_blocks); a CTA past the
    last sequence gets a valid index (the last one), its caller none of its rows."""
    bidx, _, bidz = cute.arch.block_idx()
    chunk, m_block = divmod(bidx, m_blocks)
    batch = bidz + chunk * MAX_GRID_YZ
    return m_block, cutlass.min(batch, batch_size - 1), batch < batch_size


class SingleTileScheduler:
    """Grid ``(num_m_blocks, heads, batch * num_splits)``, the splits of a sequence fastest on
    z, and z folded into x past its limit (``fold_batch`` over the (sequence, split) pairs):
    y holds the head groups alone, so no call whose heads fit y (``MAX_GRID_YZ``, checked by
    the host) exceeds a grid limit: 512 heads x 256 splits, or a batch-invariant plan's
    splits over many heads, once put 131,072 CTAs on y."""

    @staticmethod
    def grid(num_m_blocks, heads, num_splits, batch):
        """Launch grid for ``heads`` head groups (KV heads when packed) and ``num_splits``."""
        grid_x, grid_z = fold_batch(num_m_blocks, batch * num_splits)
        return (grid_x, heads, grid_z)

    @staticmethod
    @cute.jit
    def get_work(divisors: TileDivisors, batch_size: Int32) -> WorkTile:
        """The CTA's tile in a grid of ``grid(num_m_blocks, heads, num_splits, batch)``;
        ``divisors``: the kernel's ``tile_divisors(num_m_blocks, num_splits)`` argument."""
        m_block, pair, in_batch = unfold_batch(divisors.rows, batch_size * divisors.splits.divisor)
        batch, split_idx = divmod(pair, divisors.splits)
        return WorkTile(divisors.rows.divisor - 1 - m_block, cute.arch.block_idx()[1], split_idx, batch, in_batch)

    @staticmethod
    @cute.jit
    def work_of(idx: Int32, num_m_blocks: Int32, heads: Int32, num_splits: Int32) -> WorkTile:
        """The tile of CTA ``idx`` of the grid, linearized x fastest (then heads, then the
        (sequence, split) pairs)."""
        rest = idx // num_m_blocks
        pair = rest // heads
        batch = pair // num_splits
        return WorkTile(num_m_blocks - 1 - (idx - rest * num_m_blocks), rest - pair * heads,
                        pair - batch * num_splits, batch)


class VarlenScheduler:
    @staticmethod
    def grid(total_q, rows_per_query: int, tile_m: int, heads, num_splits, batch):
        """Launch grid for packed queries (``total_q``: the query tensor's rows), ``heads``
        head groups and ``num_splits``: every sequence's M blocks (see ``sequence_start``)
        times the heads on x, heads fastest, splits on y. Sequence-major, as the batch's
        order: a serving step lists its decode rows (long memory-bound tiles) first, and
        they then start first (heads on y ran the last head's decode tiles last: H200,
        mixed step page 64, 2.41 ms against 2.18 for the old grid)."""
        return ((cute.ceil_div(total_q * rows_per_query, tile_m) + batch) * heads, num_splits, 1)

    @staticmethod
    @cute.jit
    def sequence_start(mCuSeqlensQ: cute.Tensor, b: Int32, rows_per_query: cutlass.Constexpr[int],
                       tile_m: cutlass.Constexpr[int]) -> Int32:
        """The first tile of sequence b: increasing in b, and the next sequence's first is at
        least this one's M blocks further (floor(x + y) - floor(x) + 1 >= ceil(y))."""
        return (mCuSeqlensQ[b] * rows_per_query) // tile_m + b

    @staticmethod
    @cute.jit
    def get_work(mCuSeqlensQ: cute.Tensor, heads: cute.FastDivmodDivisorV2, rows_per_query: cutlass.Constexpr[int],
                 tile_m: cutlass.Constexpr[int], batch_size: Int32) -> WorkTile:
        """The CTA's tile in a grid of ``grid`` (``heads``: ``m_blocks_divisor`` of the head
        groups). Every lane of the calling warp must take part (warp votes); every warp of
        a CTA finds the same tile. The M blocks of a sequence are handed out last-first, as
        ``SingleTileScheduler`` does; a CTA past the sequence's M blocks gets no rows
        (``FwdTile.rows_valid_of``)."""
        bidx, split_idx, _ = cute.arch.block_idx()
        idx, head = divmod(bidx, heads)
        lane = cute.arch.lane_idx()
        # Invariant: sequence_start(lo) <= idx (when any sequence is), and the sequence of
        # idx is in [lo, hi). Each round probes 32 starts stride apart.
        lo = Int32(0)
        hi = batch_size
        stride = cute.ceil_div(hi - lo, 32)
        while stride > 1:
            b = lo + lane * stride
            below = Boolean(False)
            if b < hi:
                below = VarlenScheduler.sequence_start(mCuSeqlensQ, b, rows_per_query, tile_m) <= idx
            count = cute.arch.popc(cute.arch.vote_ballot_sync(below))
            lo = lo + cutlass.max(count - 1, 0) * stride
            hi = cutlass.min(lo + stride, hi)
            stride = cute.ceil_div(hi - lo, 32)
        b = lo + lane
        below = Boolean(False)
        if b < hi:
            below = VarlenScheduler.sequence_start(mCuSeqlensQ, b, rows_per_query, tile_m) <= idx
        count = cute.arch.popc(cute.arch.vote_ballot_sync(below))
        batch = cutlass.max(lo + count - 1, 0)
        end = VarlenScheduler.sequence_start(mCuSeqlensQ, batch + 1, rows_per_query, tile_m)
        return WorkTile(end - 1 - idx, head, split_idx, batch, count > 0 and idx < end)


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
