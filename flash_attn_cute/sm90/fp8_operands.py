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


@cute.jit
def transpose_v_block(sV32: cute.Tensor, sVt32: cute.Tensor, ptid: Int32, num_warps: cutlass.Constexpr[int],
                      rows_valid: Int32, zero_tail: cutlass.Constexpr[bool]):
    """One V block (keys, d_v) of fp8 into V^T (d_v, keys) in the key order ``sigma``, by
    ``num_warps`` warps (this thread: ``ptid`` among them). Both as 32-bit words: ``sV32``
    (keys, d_v / 4), ``sVt32`` (d_v, keys / 4), swizzles in their layouts.

    A thread's unit: four words of V (keys k0, k0 + 1, k0 + 8, k0 + 9, columns d0..d0 + 3),
    a 4 x 4 byte transpose (8 ``prmt``), four words of V^T (rows d0..d0 + 3, one word each).
    Lane L = 4 q + c takes k0 = 32 kb + 16 l + 2 c and d0 = 32 dd + 4 q; a warp covers one
    (kb, l, dd) at a time. Loads: each word instruction reads 4 rows x 8 words, the rows'
    swizzles spread them over the 32 banks. Stores: lane q writes its rows rotated by
    q // 2 (byte e of each word goes out at step (e - q // 2) mod 4), so that one store
    instruction's 8 rows per c are distinct mod 8: distinct swizzle chunks, 32 banks.
    ``zero_tail``: keys at or past ``rows_valid`` are zeroed (a cache's tail may hold NaN
    bytes, and a zero probability does not cancel NaN in P V)."""
    keys = cute.size(sV32, mode=[0])
    cols = cute.size(sV32, mode=[1]) * 4
    warp = ptid // 32
    lane = ptid % 32
    c = lane % 4
    q = lane // 4
    s = q // 2
    # Stage-one selectors: bytes (s, s + 1) and (s + 2, s + 3) (mod 4) of two words, interleaved.
    b0 = s % 4
    b1 = (s + 1) % 4
    b2 = (s + 2) % 4
    b3 = (s + 3) % 4
    sel_lo = b0 | ((b0 + 4) << 4) | (b1 << 8) | ((b1 + 4) << 12)
    sel_hi = b2 | ((b2 + 4) << 4) | (b3 << 8) | ((b3 + 4) << 12)
    units = (keys // 32) * 2 * (cols // 32)
    # A loop, not unrolled: unrolled, the units' addresses outlive the 40 registers of a
    # producer warp (192 spill stores at d = 128).
    for it in cutlass.range(cute.ceil_div(units, num_warps), unroll=1):
        unit = warp + num_warps * it
        if cutlass.const_expr(units % num_warps == 0):
            _transpose_unit(sV32, sVt32, unit, c, q, s, sel_lo, sel_hi, rows_valid, zero_tail)
        else:
            if unit < units:
                _transpose_unit(sV32, sVt32, unit, c, q, s, sel_lo, sel_hi, rows_valid, zero_tail)


@cute.jit
def _transpose_unit(sV32: cute.Tensor, sVt32: cute.Tensor, unit: Int32, c: Int32, q: Int32, s: Int32, sel_lo: Int32,
                    sel_hi: Int32, rows_valid: Int32, zero_tail: cutlass.Constexpr[bool]):
    """``transpose_v_block``'s unit ``unit`` = (2 kb + l) * (d_v / 32) + dd for this lane."""
    d_groups = cute.size(sV32, mode=[1]) // 8
    dd = unit % d_groups
    kl = unit // d_groups  # 2 kb + l
    k0 = 16 * kl + 2 * c
    w = [_v_word(sV32, k0 + _WORD_KEYS[r], 8 * dd + q, rows_valid, zero_tail) for r in range(4)]
    t01_lo = _prmt(w[0], w[1], sel_lo)
    t23_lo = _prmt(w[2], w[3], sel_lo)
    t01_hi = _prmt(w[0], w[1], sel_hi)
    t23_hi = _prmt(w[2], w[3], sel_hi)
    out = (_prmt(t01_lo, t23_lo, 0x5410), _prmt(t01_lo, t23_lo, 0x7632),
           _prmt(t01_hi, t23_hi, 0x5410), _prmt(t01_hi, t23_hi, 0x7632))
    col = 4 * kl + c
    for j in cutlass.range_constexpr(4):
        sVt32[32 * dd + 4 * q + (j + s) % 4, col] = out[j]


@cute.jit
def _v_word(sV32: cute.Tensor, key: Int32, col: Int32, rows_valid: Int32, zero_tail: cutlass.Constexpr[bool]):
    """One word of V (4 columns of one key); 0 at or past ``rows_valid`` with ``zero_tail``."""
    word = Uint32(sV32[key, col])
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
