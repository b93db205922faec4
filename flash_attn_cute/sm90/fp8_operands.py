"""FP8 operands of the SM90 forward's P V wgmma (FP8 Q, K and V): P from the S registers
and V transposed in shared memory, in one agreed key order; and the two-level accumulation
of its product (``TwoLevelPV``).

An 8-bit wgmma reads both operands K-major: P (tile_m x keys) from registers, and V^T
(d_v x keys, keys contiguous) from shared memory. V arrives by TMA as (keys, d_v), d_v
contiguous, so producer warps transpose each block (``transpose_v_block``).

The key order of V^T is chosen so that P needs no data movement between threads. For
a 64 x 32 k-block of the 8-bit A operand, thread T (lane L = T % 32, c = L % 4) holds
value (i, j, l) (i < 4, j < 2, l < 2) at row L / 4 + 8 j and k-index 4 c + i + 16 l; the
fp32 accumulator of S gives it value (a, b, g) at row L / 4 + 8 b and column 2 c + a + 8 g.
Letting k-index 4 c + i + 16 l of block kb stand for key

    sigma(4 c + i + 16 l) = 16 l + 8 (i // 2) + 2 c + (i % 2)    (within the 32 keys)

makes A value (i, j, l) of k-block kb the thread's own S value (a = i % 2, b = j,
g = 4 kb + 2 l + i // 2) (``p_to_fp8``: a register reorder, folded into the
conversions). V^T position 4 c + i + 16 l then holds key sigma(...): each b16 unit u of a
16-key V^T segment holds keys a(u), a(u) + 1 with a(u) = 2 (u // 2) + 8 (u % 2).

H200, d128 b4 s8192 (results/tiles_sm90_fp8_*2026-12-01_s0.csv): V transposed 4 bytes at a
time (4 x 4 units, 110 then 75 instructions each) ran the kernel at 447 and 531 TFLOP/s;
with ldmatrix / stmatrix.trans, 767 (same tile).
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from flash_attn_cute.device.layout_utils import acc_mn_view

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


@dsl_user_op
def _ldmatrix_x4(addr: Int32, *, loc=None, ip=None) -> tuple:
    """``ldmatrix.x4`` (b16, not transposed) at this lane's row address (shared window)."""
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32()] * 4), [Int32(addr).ir_value(loc=loc, ip=ip)],
        "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return tuple(Uint32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(4))


@dsl_user_op
def _stmatrix_x4_trans(addr: Int32, r0: Uint32, r1: Uint32, r2: Uint32, r3: Uint32, *, loc=None, ip=None):
    """``stmatrix.x4.trans`` (b16) of four registers at this lane's row address."""
    llvm.inline_asm(
        None, [Int32(addr).ir_value(loc=loc, ip=ip)] + [Uint32(r).ir_value(loc=loc, ip=ip) for r in (r0, r1, r2, r3)],
        "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [$0], {$1, $2, $3, $4};", "r,r,r,r,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


def _pair_key(j: Int32, first: bool):
    """Key (within 16) of row j of an ``ldmatrix`` of V: matrices "first" hold key
    a(j) + j % 2, the others a(j) + 1 - j % 2, a(j) = 2 (j // 2) + 8 (j % 2) (the keys of
    b16 unit j of a V^T segment). Each matrix's 8 rows then differ mod 8: no bank conflict."""
    a = ((j >> 1) << 1) + ((j & 1) << 3)
    return a + (j & 1) if first else a + 1 - (j & 1)


def _d_of_row(c: Int32, second: bool):
    """d (within 16) of memory row c of a transposed ``stmatrix`` of V^T: matrix "A" takes
    d 4t + e (+ 2 for t >= 2), "B" the other pair (t = c // 2, e = c % 2): 8 rows that
    differ mod 8."""
    t = c >> 1
    high = (t >> 1) ^ (1 if second else 0)
    return 4 * t + (c & 1) + 2 * high


@cute.jit
def transpose_v_block(sV_addr: Int32, sVt_addr: Int32, gv: cutlass.Constexpr, gt: cutlass.Constexpr,
                      stage_v: Int32, stage_t: Int32, ptid: Int32, num_warps: cutlass.Constexpr[int],
                      rows_valid: Int32, zero_tail: cutlass.Constexpr[bool]):
    """One V block (keys, d_v) of fp8 into V^T (d_v, keys) in the key order ``sigma``, by
    ``num_warps`` warps (this thread: ``ptid`` among them). ``sV_addr`` / ``sVt_addr``: the
    V and V^T buffers (shared window), ``gv`` / ``gt`` their geometries (``FP8TileGeometry``).

    A warp step takes 16 keys (kl) and every 32 columns p of d: per p one ``ldmatrix.x4``
    (8 x 16-byte rows of 4 matrices: keys of the V^T b16 units, ``_pair_key``, at 2 x 16
    columns), 4 ``prmt`` that pair each key's bytes with its partner's (a b16 of V^T holds
    keys a and a + 1 at one d), and one ``stmatrix.x4.trans``, which transposes the b16
    units into the V^T rows (``_d_of_row``). 16 bytes per thread in 7 instructions; the
    addresses' p terms are hoisted out of the key loop. ``zero_tail``: keys at or past
    ``rows_valid`` are zeroed (a cache's tail may hold NaN bytes, and a zero probability
    does not cancel NaN in P V)."""
    warp = ptid >> 5
    lane = ptid & 31
    mat = lane >> 3  # the ldmatrix / stmatrix matrix whose row this lane addresses
    row = lane & 7
    u = lane >> 2  # the b16 unit (ldmatrix row) of this thread's registers
    t = lane & 3
    # ldmatrix: matrices 0, 2 "first" keys, 1, 3 the partners; 0, 1 columns 0-15 of p, 2, 3 16-31.
    key_ld = cutlass.select_(mat & 1 == 0, _pair_key(row, True), _pair_key(row, False))
    col_ld = (mat >> 1) * 16
    # stmatrix: matrices 0, 2 "A" rows, 1, 3 "B"; 0, 1 columns 0-15 of p, 2, 3 16-31.
    d_st = cutlass.select_(mat & 1 == 0, _d_of_row(row, False), _d_of_row(row, True)) + (mat >> 1) * 16
    # prmt selectors: bytes e, e + 1 of the first key interleaved with its partner's; the
    # first key's register is R0 for even u, R1 for odd u; A pairs e = 0 (t < 2) or 2.
    e_a = (t >> 1) * 2
    e_b = 2 - e_a
    sel_a = cutlass.select_((u & 1) == 0, e_a | ((e_a + 4) << 4) | ((e_a + 1) << 8) | ((e_a + 5) << 12),
                            (e_a + 4) | (e_a << 4) | ((e_a + 5) << 8) | ((e_a + 1) << 12))
    sel_b = cutlass.select_((u & 1) == 0, e_b | ((e_b + 4) << 4) | ((e_b + 1) << 8) | ((e_b + 5) << 12),
                            (e_b + 4) | (e_b << 4) | ((e_b + 5) << 8) | ((e_b + 1) << 12))
    # This lane's ldmatrix row (key key_ld, columns 32 p + col_ld) at column group p:
    # ld_row + ld_x[p mod atoms] + the p's column atom, all but ld_x static. The 16-byte
    # chunk index 2 a + h (a = p mod atoms, h = col_ld / 16) is XORed with the row's
    # swizzle z: (2 a + h) ^ z = (2 a ^ (z & ~1)) + (h ^ (z & 1)).
    w, rows = gv.width, gv.rows
    atoms = min(w // 32, gv.cols // 32)  # column groups per swizzle row
    z = (key_ld & 7) >> (3 - gv.bits)
    ld_row = (sV_addr + stage_v * gv.stage_bytes + (key_ld & 7) * w + (key_ld >> 3) * 8 * w
              + (((col_ld >> 4) ^ (z & 1)) << 4))
    ld_x = [ld_row + (((2 * a) ^ (z & ~1)) << 4) for a in range(atoms)]
    # This lane's stmatrix row d_st (+ 32 p: whole swizzle periods of V^T, a static offset)
    # at key column 16 kl: st_row + the kl terms.
    st_row = sVt_addr + stage_t * gt.stage_bytes + gt.offset(d_st, 0)
    # The keys of this thread's two registers pairs (tail zeroing).
    key_r0 = _pair_key(u, True)
    key_r1 = _pair_key(u, False)
    for kl in cutlass.range(warp, rows // 16, num_warps, unroll=1):
        # Rows 16 kl.. of V: whole swizzle periods, a plain offset.
        ld_kl = kl * 16 * w
        st_at = st_row + gt.offset(d_st, 16 * kl) - gt.offset(d_st, 0)
        for p in cutlass.range_constexpr(gv.cols // 32):
            r = list(_ldmatrix_x4(ld_x[p % atoms] + ld_kl + ((32 * p) // w) * rows * w))
            if cutlass.const_expr(zero_tail):
                r = [_zero_past(r[i], 16 * kl + (key_r0 if i % 2 == 0 else key_r1), rows_valid) for i in range(4)]
            _stmatrix_x4_trans(st_at + 32 * p * gt.width,
                               _prmt(r[0], r[1], sel_a), _prmt(r[0], r[1], sel_b),
                               _prmt(r[2], r[3], sel_a), _prmt(r[2], r[3], sel_b))


@cute.jit
def _zero_past(word: Uint32, key: Int32, rows_valid: Int32) -> Uint32:
    """``word`` (4 bytes of one key), or 0 for a key at or past ``rows_valid``."""
    out = word
    if key >= rows_valid:
        out = Uint32(0)
    return out


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


class TwoLevelPV:
    """Two-level accumulation of the FP8 P V product, every ``interval`` KV blocks (the
    ``fp8_two_level_interval`` keyword; FA3's vLLM fork and FlashInfer do the same).

    Hopper's fp8 wgmma adds its products to the accumulator it is given in reduced
    precision (aligned to the largest exponent, about 14 bits kept), so once O is large
    against one block's P V (long contexts of many similar scores) the late blocks are
    truncated. Here the P V wgmma accumulates into O (the caller's ``acc_O``) for
    ``interval`` blocks only; O is then added into ``acc`` (fp32, CUDA-core FFMA) and the
    next P V starts O from zero through the wgmma's scale-d predicate (``accumulates``: no
    zeroing instructions).

    The online softmax's corrections: O is rescaled every block, as without the option,
    while ``acc`` keeps the product of the corrections since its last flush (``pending``,
    one per row) and takes it at the flush, ``acc = acc * pending + O``. Over ``interval``
    blocks that is interval - 1 FMUL (O's rescales) and one FFMA (the flush) per element,
    the count without the option; rescaling ``acc`` every block as well would add one FMUL
    per element and block. A flush replaces O's rescale: it takes the correction of the
    block whose P V follows into ``pending``, and O restarts from zero."""

    def __init__(self, acc_O: cute.Tensor, num_rows: int, interval: int):
        self.interval = interval
        self.num_rows = num_rows
        self.acc = cute.make_fragment_like(acc_O)
        self.acc.fill(0.0)
        self.pending = cute.make_rmem_tensor((num_rows,), Float32)
        self.pending.fill(1.0)

    def accumulates(self, pv: Int32):
        """Whether P V number ``pv`` of the tile (0: its first) adds into O: not the first of
        each group of ``interval``, which follows a flush."""
        return pv % self.interval != 0

    @cute.jit
    def rescale(self, acc_O: cute.Tensor, row_scale: cute.Tensor, pv: Int32):
        """Before P V number ``pv``: O's rows times ``row_scale`` (the softmax's correction),
        or, where that P V starts a group, the flush of O into ``acc``."""
        o_mn = acc_mn_view(acc_O)
        a_mn = acc_mn_view(self.acc)
        pending, rows = self.pending, self.num_rows  # (the run-time ``if`` may not carry ``self``)
        if self.accumulates(pv):
            for r in cutlass.range_constexpr(rows):
                o_mn[r, None].store(o_mn[r, None].load() * row_scale[r])
                pending[r] = pending[r] * row_scale[r]
        else:
            for r in cutlass.range_constexpr(rows):
                a_mn[r, None].store(a_mn[r, None].load() * pending[r] + o_mn[r, None].load())
                pending[r] = row_scale[r]

    @cute.jit
    def finish(self, acc_O: cute.Tensor):
        """After the tile's last P V landed: O = acc * pending + O, the whole product."""
        o_mn = acc_mn_view(acc_O)
        a_mn = acc_mn_view(self.acc)
        for r in cutlass.range_constexpr(self.num_rows):
            o_mn[r, None].store(a_mn[r, None].load() * self.pending[r] + o_mn[r, None].load())
