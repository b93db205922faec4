"""Online softmax over register tiles, shared by every kernel that holds S in registers.

The accumulator is viewed as (rows, cols) per thread (``layout_utils.acc_mn_view``,
for mma.sync and wgmma fragments alike); a row is
spread over ``threads_per_row`` adjacent lanes (4 for mma.sync m16n8 and for wgmma),
so the row max is reduced across them every block, while the row sum stays
thread-local until ``finalize`` (one reduction per CTA instead of one per block).
"""

import math
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from flash_attn_cute.device.layout_utils import acc_mn_view

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)
# FP8 P operands: P = 2^8 exp2(s - max) before its e4m3 rounding (``OnlineSoftmax``'s
# max_offset, as FA4 on SM100): the large probabilities keep 3 mantissa bits, and the small
# ones stay normal numbers 2^8 longer.
FP8_P_OFFSET = 8


# 2^f on [-0.5, 0.5], degree 3, least squares on Chebyshev nodes: relative error 1.0e-4,
# far below the 16-bit rounding of P.
_EX2_POLY = (0.9999244625475714, 0.6931210287571801, 0.24264038535997637, 0.05592207752216313)
_ROUND_MAGIC = 12582912.0  # 1.5 * 2**23: x + magic holds round(x) in its low mantissa bits


@dsl_user_op
def _ex2_scale_by_int(x_rounded: Float32, frac_ex2: Float32, *, loc=None, ip=None) -> Float32:
    """frac_ex2 * 2^n, n the integer in the low bits of x_rounded: n << 23 added to the
    exponent field (the magic's own bits shift out of the word)."""
    return Float32(
        llvm.inline_asm(
            T.f32(),
            [Float32(x_rounded).ir_value(loc=loc, ip=ip), Float32(frac_ex2).ir_value(loc=loc, ip=ip)],
            "{\n\t.reg .b32 n, p;\n\tmov.b32 n, $1;\n\tmov.b32 p, $2;\n\t"
            "shl.b32 n, n, 23;\n\tadd.s32 p, p, n;\n\tmov.b32 $0, p;\n\t}",
            "=f,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


def ex2_poly(x: Float32) -> Float32:
    """2^x on the FMA pipe (x <= 0, finite): round, a cubic on the fraction, exponent add.

    The MUFU unit does 16 exp2 per clock per SM, the FMA pipe 128 FFMA: at small head dims
    the softmax is bound by MUFU, so a share of the exponentials moves here. Inputs below
    -126 give 2^-126, not 0, so only blocks without -inf scores may use it."""
    x = cute.arch.fmax(x, Float32(-126.0))
    x_rounded = x + Float32(_ROUND_MAGIC)
    f = x - (x_rounded - Float32(_ROUND_MAGIC))
    c0, c1, c2, c3 = (Float32(c) for c in _EX2_POLY)
    poly = ((c3 * f + c2) * f + c1) * f + c0
    return _ex2_scale_by_int(x_rounded, poly)


def ex2_poly_2(x: Float32, y: Float32) -> tuple:
    """``ex2_poly`` of two values with packed f32x2 arithmetic (sm_100: FADD2, FFMA2): the
    same steps, two values an instruction (the cubic as three fused multiply-adds)."""
    magic = (Float32(_ROUND_MAGIC), Float32(_ROUND_MAGIC))
    xy = (cute.arch.fmax(x, Float32(-126.0)), cute.arch.fmax(y, Float32(-126.0)))
    xy_rounded = cute.arch.add_packed_f32x2(xy, magic)
    f = cute.arch.sub_packed_f32x2(xy, cute.arch.sub_packed_f32x2(xy_rounded, magic))
    c0, c1, c2, c3 = ((Float32(c), Float32(c)) for c in _EX2_POLY)
    poly = cute.arch.fma_packed_f32x2(cute.arch.fma_packed_f32x2(cute.arch.fma_packed_f32x2(c3, f, c2), f, c1), f, c0)
    return _ex2_scale_by_int(xy_rounded[0], poly[0]), _ex2_scale_by_int(xy_rounded[1], poly[1])


def _reduce_ilp(row: cute.Tensor, op):
    """op over one thread's part of a row (rmem), as four interleaved partial chains
    instead of one dependent chain: the softmax sits on the MMA warps' critical path."""
    n = cute.size(row)
    lanes = 4 if n % 4 == 0 else (2 if n % 2 == 0 else 1)
    acc = [row[i] for i in range(lanes)]
    for i in range(lanes, n, lanes):
        for j in range(lanes):
            acc[j] = op(acc[j], row[i + j])
    while len(acc) > 1:
        acc = [op(acc[2 * i], acc[2 * i + 1]) for i in range(len(acc) // 2)]
    return acc[0]


def _sum_packed(row: cute.Tensor):
    """The sum of one thread's part of a row (rmem, an even length that is a multiple of
    4) in two interleaved chains of packed f32x2 adds (sm_100: FADD2): four partial sums,
    as ``_reduce_ilp``, in half its instructions."""
    n = cute.size(row)
    assert n % 4 == 0, n
    acc = [(row[0], row[1]), (row[2], row[3])]
    for i in range(4, n, 4):
        acc = [cute.arch.add_packed_f32x2(acc[j], (row[i + 2 * j], row[i + 2 * j + 1])) for j in range(2)]
    pair = cute.arch.add_packed_f32x2(acc[0], acc[1])
    return pair[0] + pair[1]


def _row_allreduce(val: Float32, op, threads_per_row: int):
    """Butterfly reduction over the adjacent lanes that share a row (traced at compile time)."""
    offset = threads_per_row // 2
    while offset >= 1:
        val = op(val, cute.arch.shuffle_sync_bfly(val, offset=offset))
        offset //= 2
    return val


class OnlineSoftmax:
    """Running row max and row sum of exp2(scale_log2 * (s - max) + max_offset).

    ``max_offset`` (an integer, 0 for 16-bit P) scales P by 2^max_offset before it is
    rounded to an 8-bit P operand; the row sum carries the same factor, so it cancels in
    O, and ``finalize`` takes it out of the LSE.

    ``rescale_threshold`` (log2 units, 0: off) lets the running max lag: a block whose row
    max exceeds the running one by at most that much keeps the old max, so its correction
    is exactly 1 (a kernel can skip rescaling O) and its P reaches 2^threshold, which a
    16-bit P holds with the same relative precision as P <= 1 (FA4's SM100 rule: 8 for
    16-bit P, 0 for FP8 P, whose e4m3 range its 2^8 offset already fills)."""

    def __init__(self, num_rows: int, scale_log2: Float32, threads_per_row: int = 4, max_offset: int = 0,
                 rescale_threshold: float = 0.0):
        self.num_rows = num_rows
        self.scale_log2 = scale_log2
        self.threads_per_row = threads_per_row
        self.max_offset = max_offset
        self.rescale_threshold = rescale_threshold
        self.row_max = cute.make_rmem_tensor((num_rows,), Float32)
        self.row_sum = cute.make_rmem_tensor((num_rows,), Float32)
        self.row_max.fill(-Float32.inf)
        self.row_sum.fill(0.0)

    @cute.jit
    def step(self, acc_S: cute.Tensor, acc_O: Optional[cute.Tensor] = None,
             ex2_emulate_every: cutlass.Constexpr[int] = 0, packed_f32x2: cutlass.Constexpr[bool] = False) -> cute.Tensor:
        """Folds one block of scores into the running stats: acc_S becomes P (unnormalised,
        fp32). Returns the per-row correction exp2(scale_log2 * (old_max - new_max)) that
        the output accumulated so far must be multiplied by (``rescale_o``); with acc_O
        given, applies it at once (the SM80 kernel's combined form).

        Split from the rescale so a wgmma kernel can compute P while the previous
        block's P V is still in flight and rescale O only once that product landed.

        ``ex2_emulate_every`` = k > 0 computes every k-th exponential with ``ex2_poly``
        (FMA pipe) instead of MUFU; only for blocks whose scores are all finite.
        ``packed_f32x2`` (sm_100: FADD2 / FFMA2, two fp32 values an instruction) sums the
        row in packed pairs and emulates adjacent pairs instead, columns 2k - 2 and 2k - 1
        of every 2k (``ex2_poly_2``: the same share)."""
        s_mn = acc_mn_view(acc_S)
        row_scale = cute.make_rmem_tensor((self.num_rows,), Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            row = s_mn[r, None].load()
            m_new = _row_allreduce(
                _reduce_ilp(s_mn[r, None], cute.arch.fmax), cute.arch.fmax, self.threads_per_row
            )
            m_new = cute.arch.fmax(m_new, self.row_max[r])
            if cutlass.const_expr(self.rescale_threshold > 0):
                # Keep the old max where the new one is at most the threshold above it (from
                # -inf, the growth is inf or NaN: never kept).
                if (m_new - self.row_max[r]) * self.scale_log2 <= Float32(self.rescale_threshold):
                    m_new = self.row_max[r]
            # A row with nothing visible yet keeps max -inf; exp2 of (-inf) - (-inf) would be NaN.
            m_scaled = m_new * self.scale_log2
            if m_new == -Float32.inf:
                m_scaled = Float32(0.0)
            m_shift = m_scaled  # what P's exponent subtracts
            if cutlass.const_expr(self.max_offset != 0):
                m_shift = m_scaled - Float32(self.max_offset)
            if cutlass.const_expr(ex2_emulate_every > 0):
                s_mn[r, None].store(row * self.scale_log2 - m_shift)
                # Columns in groups of `width` (a packed pair, or one); every k-th group on the FMA pipe.
                width = 2 if packed_f32x2 else 1
                for c in cutlass.range_constexpr(0, cute.size(s_mn, mode=[1]), width):
                    if cutlass.const_expr((c // width) % ex2_emulate_every != ex2_emulate_every - 1):
                        for j in cutlass.range_constexpr(c, c + width):
                            s_mn[r, j] = cute.math.exp2(s_mn[r, j], fastmath=True)
                    elif cutlass.const_expr(packed_f32x2):
                        s_mn[r, c], s_mn[r, c + 1] = ex2_poly_2(s_mn[r, c], s_mn[r, c + 1])
                    else:
                        s_mn[r, c] = ex2_poly(s_mn[r, c])
            else:
                s_mn[r, None].store(cute.math.exp2(row * self.scale_log2 - m_shift, fastmath=True))
            row_p = s_mn[r, None]
            correction = cute.math.exp2(self.row_max[r] * self.scale_log2 - m_scaled, fastmath=True)
            self.row_max[r] = m_new
            row_total = _sum_packed(row_p) if cutlass.const_expr(packed_f32x2) else _reduce_ilp(row_p, _add)
            self.row_sum[r] = self.row_sum[r] * correction + row_total
            row_scale[r] = correction
        if cutlass.const_expr(acc_O is not None):
            self.rescale_o(acc_O, row_scale)
        return row_scale

    @cute.jit
    def rescale_o(self, acc_O: cute.Tensor, row_scale: cute.Tensor):
        """acc_O rows *= row_scale (the correction ``step`` returned)."""
        o_mn = acc_mn_view(acc_O)
        for r in cutlass.range_constexpr(self.num_rows):
            o_mn[r, None].store(o_mn[r, None].load() * row_scale[r])

    @cute.jit
    def finalize(self, acc_O: cute.Tensor, lse: cute.Tensor, sink: Optional[cute.Tensor] = None):
        """Normalises acc_O and writes the natural-log LSE per row into ``lse`` (rmem,
        num_rows). A row that saw no key gets O = 0 and LSE = -inf. ``sink`` (rmem,
        num_rows; learnable sinks in the natural log of the scaled scores): one more logit
        per row with a zero value; the LSE includes it, and a row that saw no key gets
        O = 0 and LSE = its sink."""
        o_mn = acc_mn_view(acc_O)
        for r in cutlass.range_constexpr(self.num_rows):
            total, empty, inv = self._row_total(r)
            if cutlass.const_expr(sink is not None):
                inv, lse_r = self._with_sink(r, total, sink[r])
                if cutlass.const_expr(self.max_offset != 0):
                    inv = inv * Float32(2.0 ** -self.max_offset)
            else:
                lse_r = (self.row_max[r] * self.scale_log2 + cute.math.log2(total, fastmath=True)) * LN_2
                if empty:
                    lse_r = -Float32.inf
            o_mn[r, None].store(o_mn[r, None].load() * inv)
            lse[r] = lse_r

    @cute.jit
    def _with_sink(self, r: cutlass.Constexpr[int], total: Float32, sink: Float32):
        """(O's scale, LSE) of row r with a sink, in the log2 domain of the running max:
        m' = max(m, sink), L = total * 2^(m - m') + 2^(sink - m'), O * 2^(m - m') / L,
        LSE = m' + log2 L (back to the natural log)."""
        m = self.row_max[r] * self.scale_log2  # -inf for a row that saw no key
        sink_log2 = sink * LOG2_E
        m_new = cute.arch.fmax(m, sink_log2)
        if m_new == -Float32.inf:  # no key and a -inf sink: nothing at all, never NaN
            m_new = Float32(0.0)
        kept = cute.math.exp2(m - m_new, fastmath=True)
        total = total * kept + cute.math.exp2(sink_log2 - m_new, fastmath=True)
        scale = Float32(0.0)
        if total > 0.0:
            scale = cute.arch.rcp_approx(total) * kept
        return scale, (m_new + cute.math.log2(total, fastmath=True)) * LN_2

    @cute.jit
    def inv_row_sums(self) -> cute.Tensor:
        """(num_rows,) 1 / row sum, 0 for a row that saw no key: what ``finalize`` scales O
        by, for a warp that holds O without the statistics."""
        inv = cute.make_rmem_tensor((self.num_rows,), Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            inv[r] = self._row_total(r)[2]
        return inv

    @cute.jit
    def _row_total(self, r: cutlass.Constexpr[int]):
        """(row sum over the lanes sharing row r, whether the row saw no key, 1 / row sum or
        0: O's scale). The sum is the true one (``max_offset`` taken out), O's scale
        takes out the factor O carries too."""
        total = _row_allreduce(self.row_sum[r], _add, self.threads_per_row)
        empty = total == 0.0 or total != total
        inv = cute.arch.rcp_approx(total)
        if cutlass.const_expr(self.max_offset != 0):
            total = total * Float32(2.0 ** -self.max_offset)
        if empty:
            inv = Float32(0.0)
        return total, empty, inv


def _add(a, b):
    return a + b
