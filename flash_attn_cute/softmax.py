"""Online softmax over register tiles, shared by every kernel that holds S in registers.

The accumulator is viewed as (rows, cols) per thread (``acc_mn_view``); a row is
spread over ``threads_per_row`` adjacent lanes (4 for mma.sync m16n8 and for wgmma),
so the row max is reduced across them every block, while the row sum stays
thread-local until ``finalize`` (one reduction per CTA instead of one per block).
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


def acc_mn_view(acc: cute.Tensor) -> cute.Tensor:
    """((2, 2), MMA_M, MMA_N) accumulator -> ((2, MMA_M), (2, MMA_N)) rows x cols.

    In the m16n8 C fragment the inner mode holds (col pair, row half)."""
    lay = cute.make_layout(acc.layout.shape)
    mn = cute.make_layout(
        ((lay.shape[0][1], lay.shape[1]), (lay.shape[0][0], lay.shape[2])),
        stride=((lay.stride[0][1], lay.stride[1]), (lay.stride[0][0], lay.stride[2])),
    )
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))


def acc_to_operand_a(acc: cute.Tensor) -> cute.Tensor:
    """C fragment (4, MMA_M, MMA_N) of an m16n8k16 product reused as the A fragment
    ((4, 2), MMA_M, MMA_N / 2) of the next one: two n8 atoms make one k16 slice."""
    div = cute.logical_divide(acc.layout, (None, None, 2))
    lay = cute.make_layout(
        ((div.shape[0], div.shape[2][0]), div.shape[1], div.shape[2][1]),
        stride=((div.stride[0], div.stride[2][0]), div.stride[1], div.stride[2][1]),
    )
    return cute.make_tensor(acc.iterator, lay)


def _row_allreduce(val: Float32, op, threads_per_row: int):
    """Butterfly reduction over the adjacent lanes that share a row (traced at compile time)."""
    offset = threads_per_row // 2
    while offset >= 1:
        val = op(val, cute.arch.shuffle_sync_bfly(val, offset=offset))
        offset //= 2
    return val


class OnlineSoftmax:
    """Running row max and row sum of exp2(scale_log2 * (s - max))."""

    def __init__(self, num_rows: int, scale_log2: Float32, threads_per_row: int = 4):
        self.num_rows = num_rows
        self.scale_log2 = scale_log2
        self.threads_per_row = threads_per_row
        self.row_max = cute.make_rmem_tensor((num_rows,), Float32)
        self.row_sum = cute.make_rmem_tensor((num_rows,), Float32)
        self.row_max.fill(-Float32.inf)
        self.row_sum.fill(0.0)

    @cute.jit
    def step(self, acc_S: cute.Tensor, acc_O: cute.Tensor):
        """Folds one block of scores into the running stats: acc_S becomes P (unnormalised,
        fp32) and acc_O is rescaled by exp2(scale_log2 * (old_max - new_max))."""
        s_mn = acc_mn_view(acc_S)
        o_mn = acc_mn_view(acc_O)
        for r in cutlass.range_constexpr(self.num_rows):
            row = s_mn[r, None].load()
            m_new = _row_allreduce(
                row.reduce(cute.ReductionOp.MAX, -Float32.inf, 0), cute.arch.fmax, self.threads_per_row
            )
            m_new = cute.arch.fmax(m_new, self.row_max[r])
            # A row with nothing visible yet keeps max -inf; exp2 of (-inf) - (-inf) would be NaN.
            m_scaled = m_new * self.scale_log2
            if m_new == -Float32.inf:
                m_scaled = Float32(0.0)
            p = cute.math.exp2(row * self.scale_log2 - m_scaled, fastmath=True)
            s_mn[r, None].store(p)
            correction = cute.math.exp2(self.row_max[r] * self.scale_log2 - m_scaled, fastmath=True)
            self.row_max[r] = m_new
            self.row_sum[r] = self.row_sum[r] * correction + p.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            o_mn[r, None].store(o_mn[r, None].load() * correction)

    @cute.jit
    def finalize(self, acc_O: cute.Tensor, lse: cute.Tensor):
        """Normalises acc_O and writes the natural-log LSE per row into ``lse`` (rmem,
        num_rows). A row that saw no key gets O = 0 and LSE = -inf."""
        o_mn = acc_mn_view(acc_O)
        for r in cutlass.range_constexpr(self.num_rows):
            total = _row_allreduce(self.row_sum[r], _add, self.threads_per_row)
            empty = total == 0.0 or total != total
            inv = cute.arch.rcp_approx(total)
            if empty:
                inv = Float32(0.0)
            o_mn[r, None].store(o_mn[r, None].load() * inv)
            lse_r = (self.row_max[r] * self.scale_log2 + cute.math.log2(total, fastmath=True)) * LN_2
            if empty:
                lse_r = -Float32.inf
            lse[r] = lse_r


def _add(a, b):
    return a + b
