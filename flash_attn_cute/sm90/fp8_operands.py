"""FP8 operands of the SM90 forward's P V wgmma (FP8 Q, K and V): P from the S registers
and V transposed in shared memory, in one agreed key order.

An 8-bit wgmma reads both operands K-major: P (tile_m x keys) from registers, and V^T
(d_v x keys, keys contiguous) from shared memory. V arrives by TMA as (keys, d_v), d_v
contiguous, so the producer warpgroup transposes each block (``transpose_v_block``).

The key order of V^T is chosen so that P needs no data movement between threads. For
a 64 x 32 k-block of the 8-bit A operand, thread T (lane L = T % 32, c = L % 4) holds
value (i, j, l) (i < 4, j < 2, l < 2) at row L / 4 + 8 j and k-index 4 c + i + 16 l; the
fp32 accumulator of S gives it value (a, b, g) at row L / 4 + 8 b and column 2 c + a + 8 g.
Letting k-index 4 c + i + 16 l of block kb stand for key

    sigma(4 c + i + 16 l) = 16 l + 8 (i // 2) + 2 c + (i % 2)    (within the 32 keys)

makes A value (i, j, l) of k-block kb the thread's own S value (a = i % 2, b = j,
g = 4 kb + 2 l + i // 2) (``p_to_fp8``: a register reorder, folded into the
conversions). V^T position 4 c + i + 16 l then holds key sigma(...): each 32-bit word of
a V^T row gathers the same column of keys {k0, k0 + 1, k0 + 8, k0 + 9}, k0 = 16 l + 2 c.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

# Offsets of the four keys of one V^T word from k0 (sigma at i = 0..3).
_WORD_KEYS = (0, 1, 8, 9)


@dsl_user_op
def _prmt(a: Uint32, b: Uint32, sel: Int32, *, loc=None, ip=None) -> Uint32:
    """PTX ``prmt.b32``: byte n of the result is byte sel[4n+3:4n] of {b, a} (a's bytes 0-3,
    b's 4-7). No side effects, so the scheduler may move it (cute.arch.prmt may not)."""
    return Uint32(llvm.inline_asm(
        T.i32(), [Uint32(a).ir_value(loc=loc, ip=ip), Uint32(b).ir_value(loc=loc, ip=ip),
                  Int32(sel).ir_value(loc=loc, ip=ip)],
        "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT))


@dataclass(frozen=True)
class FP8TileGeometry:
    """Byte offsets in an fp8 (rows, cols, stages) tile of ``wgmma_utils.smem_layout``: atoms
    of 8 rows x ``width`` bytes (swizzle S<bits, 4, 3>: 16-byte chunk c of row r sits at
    c ^ (r % 8 >> (3 - bits))), tiled down the rows, then across the columns. The
    transposes compute their addresses from this directly, with the thread-constant parts
    hoisted, instead of evaluating the swizzled layout per access (110 instructions per
    4 x 4 unit at d = 128 that way)."""

    rows: int
    cols: int
    width: int
    bits: int
    stage_bytes: int

    @staticmethod
    def of(layout, rows: int, cols: int) -> "FP8TileGeometry":
        """The geometry of ``layout`` (static, fp8), checked against the layout itself at
        every 4-byte column of the first 16 rows of two stages."""
        bits = layout.inner.num_bits
        assert layout.inner.num_base == 4 and layout.inner.num_shift == 3, layout
        geo = FP8TileGeometry(rows, cols, 16 << bits, bits, cute.crd2idx((0, 0, 1), layout))
        assert geo.width >= 32 and cols % geo.width == 0 and rows % 16 == 0, layout
        for stage in range(2):
            for r in range(16):
                for col in range(0, cols, 4):
                    assert geo.offset(r, col) + stage * geo.stage_bytes == cute.crd2idx((r, col, stage), layout), \
                        (layout, r, col, stage)
        return geo

    def offset(self, r, col):
        """Byte offset of (r, col) in stage 0 (non-negative ints or DSL integers; masks and
        shifts rather than % and //, which signed integers would pay for)."""
        w, log_w = self.width, 4 + self.bits
        chunk = ((col & (w - 1)) >> 4) ^ ((r & 7) >> (3 - self.bits))
        return (r & 7) * w + (r >> 3) * 8 * w + (col >> log_w) * self.rows * w + (chunk << 4) + (col & 15)


@cute.jit
def transpose_v_block(sV32: cute.Tensor, sVt32: cute.Tensor, gv: cutlass.Constexpr, gt: cutlass.Constexpr,
                      stage_v: Int32, stage_t: Int32, ptid: Int32, num_warps: cutlass.Constexpr[int],
                      rows_valid: Int32, zero_tail: cutlass.Constexpr[bool]):
    """One V block (keys, d_v) of fp8 into V^T (d_v, keys) in the key order ``sigma``, by
    ``num_warps`` warps (this thread: ``ptid`` among them). ``sV32`` / ``sVt32``: the V and
    V^T stages as flat 32-bit words, ``gv`` / ``gt`` their geometries.

    A thread's 4 x 4 unit: four words of V (keys k0, k0 + 1, k0 + 8, k0 + 9, columns d0..d0 +
    3), a byte transpose (8 ``prmt``), four words of V^T (rows d0..d0 + 3). Lane L = 4 q + c
    takes k0 = 16 kl + 2 c and d0 = 32 dd + 4 q; a warp step covers one column group dd
    and ``_KL_PER_STEP`` consecutive kl. Loads: an instruction reads 4 rows x 8 words, the
    rows' swizzles spread them over the 32 banks. Stores: lane q writes its rows rotated by
    q // 2 (byte e of each word goes out at step (e - q // 2) mod 4), so that one store
    instruction's 8 rows per c are distinct mod 8: distinct swizzle chunks, 32 banks.
    ``zero_tail``: keys at or past ``rows_valid`` are zeroed (a cache's tail may hold NaN
    bytes, and a zero probability does not cancel NaN in P V)."""
    warp = ptid >> 5
    lane = ptid & 31
    c = lane & 3
    q = lane >> 2
    s = q >> 1
    # Stage-one selectors: bytes (s, s + 1) and (s + 2, s + 3) (mod 4) of two words, interleaved.
    b0 = s & 3
    b1 = (s + 1) & 3
    b2 = (s + 2) & 3
    b3 = (s + 3) & 3
    sel_lo = b0 | ((b0 + 4) << 4) | (b1 << 8) | ((b1 + 4) << 12)
    sel_hi = b2 | ((b2 + 4) << 4) | (b3 << 8) | ((b3 + 4) << 12)
    d_groups = gv.cols // 32
    kl_steps = gv.rows // (16 * _KL_PER_STEP)
    steps = d_groups * kl_steps
    # A loop, not unrolled: unrolled, the steps' addresses outlive the 40 registers of a
    # producer warp.
    for it in cutlass.range(cute.ceil_div(steps, num_warps), unroll=1):
        step = warp + num_warps * it
        if cutlass.const_expr(steps % num_warps == 0):
            _transpose_step(sV32, sVt32, gv, gt, stage_v, stage_t, step, c, q, s, sel_lo, sel_hi, rows_valid,
                            zero_tail)
        else:
            if step < steps:
                _transpose_step(sV32, sVt32, gv, gt, stage_v, stage_t, step, c, q, s, sel_lo, sel_hi, rows_valid,
                                zero_tail)


_KL_PER_STEP = 2  # 16-key groups per warp step: two units in flight hide the loads' latency


@cute.jit
def _transpose_step(sV32: cute.Tensor, sVt32: cute.Tensor, gv: cutlass.Constexpr, gt: cutlass.Constexpr,
                    stage_v: Int32, stage_t: Int32, step: Int32, c: Int32, q: Int32, s: Int32, sel_lo: Int32,
                    sel_hi: Int32, rows_valid: Int32, zero_tail: cutlass.Constexpr[bool]):
    """``transpose_v_block``'s step ``step`` = dd * kl_steps + kl // _KL_PER_STEP."""
    kl_steps = gv.rows // (16 * _KL_PER_STEP)
    dd = step // kl_steps
    kl0 = (step - dd * kl_steps) * _KL_PER_STEP
    v_base = stage_v * gv.stage_bytes
    t_base = stage_t * gt.stage_bytes
    d0 = 32 * dd + 4 * q
    for g in cutlass.range_constexpr(_KL_PER_STEP):
        kl = kl0 + g
        w = [_v_word(sV32, v_base + gv.offset(16 * kl + 2 * c + _WORD_KEYS[r], d0), 16 * kl + 2 * c + _WORD_KEYS[r],
                     rows_valid, zero_tail) for r in range(4)]
        t01_lo = _prmt(w[0], w[1], sel_lo)
        t23_lo = _prmt(w[2], w[3], sel_lo)
        t01_hi = _prmt(w[0], w[1], sel_hi)
        t23_hi = _prmt(w[2], w[3], sel_hi)
        out = (_prmt(t01_lo, t23_lo, 0x5410), _prmt(t01_lo, t23_lo, 0x7632),
               _prmt(t01_hi, t23_hi, 0x5410), _prmt(t01_hi, t23_hi, 0x7632))
        for j in cutlass.range_constexpr(4):
            sVt32[(t_base + gt.offset(d0 + ((j + s) & 3), 16 * kl + 4 * c)) >> 2] = out[j]


@cute.jit
def _v_word(sV32: cute.Tensor, byte: Int32, key: Int32, rows_valid: Int32, zero_tail: cutlass.Constexpr[bool]):
    """The V word at ``byte``; 0 for a key at or past ``rows_valid`` with ``zero_tail``."""
    word = Uint32(sV32[byte >> 2])
    if cutlass.const_expr(zero_tail):
        if key >= rows_valid:
            word = Uint32(0)
    return word


def p_to_fp8(acc_S: cute.Tensor, tOrP: cute.Tensor):
    """P = S (fp32 accumulator, ((2, 2, N / 8), 1, 1)) into the fp8 A operand ``tOrP``
    (((4, 2, 2), 1, N / 32), compact) in the ``sigma`` key order: A value (i, j, l) of
    k-block kb is S value (i % 2, j, 4 kb + 2 l + i // 2). Adjacent A values (i = 0, 1)
    are adjacent S values, so the conversion still packs pairs (cvt e4m3x2)."""
    kblocks = cute.size(tOrP, mode=[2])
    src = cute.make_tensor(acc_S.iterator,
                           cute.make_layout((((2, 2), 2, 2), 1, kblocks), stride=(((1, 4), 2, 8), 0, 16)))
    dst = cute.make_tensor(tOrP.iterator, cute.make_layout((((2, 2), 2, 2), 1, kblocks)))
    dst.store(src.load().to(tOrP.element_type))
