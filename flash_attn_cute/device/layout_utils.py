"""Register views of MMA accumulators, for both tensor-core generations.

Two C fragments reach the softmax:

* mma.sync m16n8 (SM80): ``((2, 2), MMA_M, MMA_N)``; the inner mode holds (col pair, row half).
* wgmma (SM90): ``((2, 2, N / 8), MMA_M, MMA_N)``; per warp the same m16n8 pattern,
  repeated N / 8 times along the columns of one instruction.

``row_major_smem_layout`` is the swizzled row-major smem tile wgmma reads (SM90, and
SM100's fp8 staging). ``acc_mn_view`` gives rows x cols per thread for either; ``acc_to_operand_a`` reuses a
C fragment as the A register operand of the next MMA (P of O += P V), which is
possible because the C layout of one MMA and the A layout of the next coincide
register for register once the column mode is regrouped into k slices.
"""

from typing import Optional

import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum


def _is_wgmma(layout) -> bool:
    return cute.rank(layout.shape[0]) == 3


def acc_mn_view(acc: cute.Tensor) -> cute.Tensor:
    """Accumulator -> ((2, MMA_M), cols) per thread: cols is (2, MMA_N) for mma.sync,
    (2, N / 8, MMA_N) for wgmma. Row r of the view is one row of the tile."""
    lay = cute.make_layout(acc.layout.shape)
    s, d = lay.shape, lay.stride
    rows = ((s[0][1], s[1]), (d[0][1], d[1]))
    if _is_wgmma(lay):
        cols = ((s[0][0], s[0][2], s[2]), (d[0][0], d[0][2], d[2]))
    else:
        cols = ((s[0][0], s[2]), (d[0][0], d[2]))
    mn = cute.make_layout((rows[0], cols[0]), stride=(rows[1], cols[1]))
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))


def acc_to_operand_a(acc: cute.Tensor) -> cute.Tensor:
    """C fragment reused as the A fragment of the next product.

    mma.sync: (4, MMA_M, MMA_N) -> ((4, 2), MMA_M, MMA_N / 2): two n8 atoms make one k16 slice.
    wgmma:    ((2, 2, N / 8), MMA_M, MMA_N) -> ((2, 2, 2), MMA_M, (N / 16, MMA_N)): the RS
    A fragment of a k16 instruction is two adjacent n8 column groups of the C fragment."""
    if _is_wgmma(acc.layout):
        assert acc.layout.shape[0][2] % 2 == 0, "wgmma N must be a multiple of 16 for P in registers"
        div = cute.logical_divide(acc.layout, ((None, None, 2), None, None))
        s, d = div.shape, div.stride
        lay = cute.make_layout(
            ((s[0][0], s[0][1], s[0][2][0]), s[1], (s[0][2][1], s[2])),
            stride=((d[0][0], d[0][1], d[0][2][0]), d[1], (d[0][2][1], d[2])),
        )
        return cute.make_tensor(acc.iterator, lay)
    div = cute.logical_divide(acc.layout, (None, None, 2))
    lay = cute.make_layout(
        ((div.shape[0], div.shape[2][0]), div.shape[1], div.shape[2][1]),
        stride=((div.stride[0], div.stride[2][0]), div.stride[1], div.stride[2][1]),
    )
    return cute.make_tensor(acc.iterator, lay)


def transpose_view(s: cute.Tensor) -> cute.Tensor:
    """(rows, cols, ...) smem tensor -> (cols, rows, ...) view of the same bytes."""
    shape = (s.shape[1], s.shape[0], *s.shape[2:])
    order = (1, 0, *range(2, cute.rank(s)))
    return cute.composition(s, cute.make_ordered_layout(shape, order=order))


def select(t: cute.Tensor, modes) -> cute.Tensor:
    """Tensor with its modes reordered (a view, no copy)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, modes))


def row_major_smem_layout(dtype, rows: int, cols: int, stages: Optional[int] = None):
    """Row-major (rows, cols[, stages]) smem tile in the widest wgmma swizzle its row allows:
    what SM90 wgmma reads, and SM100's fp8 staging tiles (one TMA box each)."""
    atom = warpgroup.make_smem_layout_atom(sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, cols), dtype)
    if stages is None:
        return cute.tile_to_shape(atom, (rows, cols), (0, 1))
    return cute.tile_to_shape(atom, (rows, cols, stages), (0, 1, 2))
