"""16-bit queries quantized to e4m3 inside a forward kernel (``quantize_q``): an FP8 (e4m3)
KV cache under bf16 / fp16 queries then runs the FP8 Q, K, V kernel (SM90: both GEMMs in
fp8 wgmma, V transposed by producer warps, ``fp8_operands``; also SM90's MLA TMA kernel;
SM100 on request: e4m3 tcgen05 MMAs, each softmax warpgroup quantizing its Q stage)
instead of widening every K and V block to 16 bits in shared memory.

The SM90 consumer warpgroups load their CTA's Q tile from global memory into registers (16-byte
loads in the partition of ``copy_utils.gmem_tiled_copy``; rows past the sequence and
columns past a padded head dim are zeros), reduce its amax (each thread, its warp by
shuffles, every consumer warp's through shared memory), store Q / 2^e in e4m3 into the
fp8 sQ that the mainloop reads, and fence the stores for wgmma (async proxy). 2^e joins
the softmax scale, as a ``q_descale`` does in FP8 attention. The loads overlap the
producer's first K TMA; no 16-bit staging buffer is needed (the fp8 tiles' shared memory,
``config.fp8_qkv_smem_bytes``, is unchanged but for the few amax words).

The scale: one per Q tile, a power of two, 2^e = 2^(E - 7) for the amax's binary exponent
E (amax = m 2^E, 1 <= m < 2), so that the scaled amax lies in [128, 256), below e4m3's
largest finite 448 (no saturation).

- A power of two makes Q / 2^e exact: every e4m3 value times 2^e is the element rounded
  to e4m3's 4 significant bits, the same value any power-of-two scale gives (per row or
  per tile) for every element of magnitude at least amax 2^-13 (scaled: e4m3's smallest
  normal, 2^-6). Smaller elements keep fewer bits (e4m3 subnormals: an error of at most
  amax 2^-17), and those below amax 2^-18 round to 0: only these depend on the tile's
  other rows. A per-row scale would buy that range for rows 2^13 below the tile's
  largest, at the price of a per-row softmax scale (``OnlineSoftmax``,
  ``variants.apply_to_scores`` with softcap or a score modifier, shared by every kernel,
  take one scalar); per tile it is one multiply of the scalar softmax scale, and the fold
  is exact (2^e changes the exponent only).
- e comes from the amax's exponent bits (``pow2_scales``): no division; an amax of 0 (a
  tile of zero queries) or below 2^-57 takes the clamp 2^-e = 2^64 (zeros stay zeros; the
  softmax scale times 2^-64 stays a normal fp32). The amax is a max.f32 chain, which
  ignores NaN: a NaN query spoils its own rows only, as in the 16-bit kernel (an infinite
  one, whose rows are NaN anyway, flushes its tile-mates to 0).

Because the small elements depend on the tile (its rows, hence tile_m and GQA packing),
the kernel is not bitwise batch invariant: ``batch_invariant`` calls keep the widening
kernel (``sm90.quantizes_q``). Accuracy (README, FP8 section): the quantized queries add
the error of rounding q to e4m3 (relative 2^-4 per element at most); the GPU tests bound
the kernel by PyTorch's FP8 algorithm on the same quantized queries
(``testing.quantize_q_ref``), and against the unquantized queries by that algorithm's own
distance from them.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from flash_attn_cute.device.copy_utils import aligned_row_ptr, gmem_tiled_copy

# 2^-e = 2^(7 - E) for an amax of biased exponent b: biased exponent 261 - b (scaled amax in
# [128, 256)); at most 2^64 (191), so that 2^e >= 2^-64 leaves the softmax scale normal.
_SCALED_AMAX_EXP = 7
_MAX_INV_SCALE_EXP = 64


@dsl_user_op
def pow2_scales(amax: Float32, *, loc=None, ip=None) -> tuple:
    """(2^-e, 2^e) of a tile's amax (>= 0): e = E - 7 for amax = m 2^E (1 <= m < 2), so that
    amax 2^-e lies in [128, 256); 2^-e at most 2^64 (amax 0, denormal or below 2^-57).
    From the exponent bits (biased b: 2^-e has 261 - b, 2^e 254 minus that), no division."""
    inv_bias = 127 + 127 + _SCALED_AMAX_EXP
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32(), T.f32()]), [Float32(amax).ir_value(loc=loc, ip=ip)],
        "{\n\t.reg .b32 b, c, s;\n\t"
        "mov.b32 b, $2;\n\t"
        "bfe.u32 b, b, 23, 8;\n\t"
        f"mov.b32 c, {inv_bias};\n\t"
        "sub.s32 s, c, b;\n\t"
        f"min.s32 s, s, {127 + _MAX_INV_SCALE_EXP};\n\t"
        "shl.b32 $0, s, 23;\n\t"
        "mov.b32 c, 254;\n\t"
        "sub.s32 s, c, s;\n\t"
        "shl.b32 $1, s, 23;\n\t}",
        "=f,=f,f", has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return tuple(Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(2))


@cute.jit
def quantize_q_tile(parts: tuple, row0: Int32, sAmax: cute.Tensor, rows_valid: Int32, cols_valid: cutlass.Constexpr,
                    tidx: Int32, num_threads: cutlass.Constexpr[int], sync, after_loads=None) -> Float32:
    """Q rows [row0, row0 + rows) of each part ``(q_rows, sQ)`` (``q_rows``: (rows, cols)
    16-bit gmem, packed under GQA; ``sQ``: its (rows, cols) e4m3 tile) stored as Q / 2^e,
    one 2^e for all the parts (MLA's q_nope and q_pe add into one score); returns 2^e.
    ``num_threads`` threads (this one ``tidx``) take part, each with its 16-byte chunks;
    tile rows at or past ``rows_valid`` and columns at or past ``cols_valid`` (a padded head
    dim; None: none) are zeros. ``sAmax``: one fp32 word per warp; ``sync()``: a barrier of
    the ``num_threads`` threads (run twice: the warps' amaxes written, then the tiles
    written and fenced for wgmma). ``after_loads()``, where given, runs once every load is
    issued and before any is used: a kernel's own first loads (the MLA TMA kernel's first
    KV tiles) then queue behind Q's, and the amax runs under their latency."""
    views = []  # per part: (thread's smem partition, its 16-bit registers, which chunks are real)
    for q_rows, sQ in parts:
        rows, cols = cute.size(sQ, mode=[0]), cute.size(sQ, mode=[1])
        q_dtype = q_rows.element_type
        thr_copy = gmem_tiled_copy(q_dtype, cols, num_threads).get_slice(tidx)
        tQsQ = thr_copy.partition_D(sQ)  # (CPY, M, chunks), e4m3
        tQcQ = thr_copy.partition_S(cute.make_identity_tensor((rows, cols)))
        rQ = cute.make_fragment_like(tQsQ, q_dtype)
        vec = cute.size(rQ, mode=[0])
        # Every chunk is loaded, with no branch around its load, before any is used: rows past
        # rows_valid read the tile's last real row and padded columns its last real chunk, and
        # are zeroed after. (Each load under its own branch, the compiler converted its values
        # inside the branch: one global round trip after another, four per CTA in the MLA
        # kernel's sm_90a SASS, sixteen in SM100's d 128 stage.) The tile holds a real row:
        # the last one, row0 + rows_valid - 1, is one, also where this part has none.
        real = []
        for m in cutlass.range_constexpr(cute.size(rQ, mode=[1])):
            row = tQcQ[0, m, 0][0]
            g_row = q_rows[row0 + cutlass.min(row, rows_valid - 1), None]
            for k in cutlass.range_constexpr(cute.size(rQ, mode=[2])):
                col = tQcQ[0, m, k][1]
                ok = row < rows_valid
                if cutlass.const_expr(cols_valid is not None):
                    ok = ok & (col < cols_valid)
                    col = cutlass.min(col, cols_valid - vec)
                cute.autovec_copy(cute.make_tensor(aligned_row_ptr(g_row, col, 16), rQ[None, m, k].layout),
                                  rQ[None, m, k])
                real.append(ok)
        views.append((tQsQ, rQ, real))
    if cutlass.const_expr(after_loads is not None):
        after_loads()
    # Four interleaved max chains (|x| is an operand modifier of FMNMX), then the warp's. The
    # fp32 values are made chunk by chunk, here and for the stores: only the 16-bit ones
    # stay live across the barrier.
    chains = []
    for _, rQ, real in views:
        for m in cutlass.range_constexpr(cute.size(rQ, mode=[1])):
            for k in cutlass.range_constexpr(cute.size(rQ, mode=[2])):
                ok = real[m * cute.size(rQ, mode=[2]) + k]
                x = cute.make_fragment_like(rQ[None, m, k], Float32)
                x.store(rQ[None, m, k].load().to(Float32))
                for i in cutlass.range_constexpr(cute.size(x)):
                    a = cutlass.select_(ok, cute.math.absf(x[i]), Float32(0.0))
                    if cutlass.const_expr(len(chains) < 4):
                        chains.append(a)
                    else:
                        chains[i % 4] = cute.arch.fmax(chains[i % 4], a)
    amax = Float32(0.0)
    for c in chains:
        amax = cute.arch.fmax(amax, c)
    amax = cute.arch.warp_reduction_max(amax, threads_in_group=32)
    warp, lane = tidx // 32, tidx % 32
    if lane == 0:
        sAmax[warp] = amax
    sync()
    amax = sAmax[0]
    for w in cutlass.range_constexpr(1, num_threads // 32):
        amax = cute.arch.fmax(amax, sAmax[w])
    inv_scale, scale = pow2_scales(amax)
    for tQsQ, rQ, real in views:
        r8 = cute.make_fragment_like(tQsQ)
        for m in cutlass.range_constexpr(cute.size(rQ, mode=[1])):
            for k in cutlass.range_constexpr(cute.size(rQ, mode=[2])):
                ok = real[m * cute.size(rQ, mode=[2]) + k]
                x = cute.make_fragment_like(rQ[None, m, k], Float32)
                x.store(rQ[None, m, k].load().to(Float32))
                for i in cutlass.range_constexpr(cute.size(x)):
                    x[i] = cutlass.select_(ok, x[i] * inv_scale, Float32(0.0))
                r8[None, m, k].store(x.load().to(tQsQ.element_type))
        cute.autovec_copy(r8, tQsQ)
    # Generic-proxy stores, read next by wgmma (async proxy), by every consumer warpgroup.
    cute.arch.fence_view_async_shared()
    sync()
    return scale
