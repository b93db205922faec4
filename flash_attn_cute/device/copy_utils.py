"""Global-memory row copies shared by the kernels: 128-bit cp.async tiled copies, the
shared-memory swizzle their rows are laid out in, and row copies that keep the alignment
their layout guarantees (gathered rows: paged KV, packed GQA, epilogues that store from
registers)."""

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync
from cutlass.cutlass_dsl import dsl_user_op


def swizzle_atom_cols(cols: int) -> int:
    """Columns of the 8-row swizzle atom that rows of ``cols`` 16-bit elements are laid out
    in: 64 (128 bytes, one bank sweep) when they divide the row, else 32."""
    return 64 if cols % 64 == 0 else 32


def gmem_tiled_copy(dtype, cols: int, num_threads: int):
    """128-bit cp.async, consecutive threads along a row of the smem atom."""
    elems = 128 // dtype.width
    threads_per_row = swizzle_atom_cols(cols) // elems
    atom = cute.make_copy_atom(
        cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), dtype, num_bits_per_copy=128
    )
    thr = cute.make_layout((num_threads // threads_per_row, threads_per_row), stride=(threads_per_row, 1))
    return cute.make_tiled_copy_tv(atom, thr, cute.make_layout((1, elems)))


def aligned_row_ptr(row: cute.Tensor, col, align_bytes: int):
    """Pointer to row[col] (global or shared) with the alignment the row layout guarantees
    (a dynamic column offset would otherwise drop it to one element)."""
    ptr = row.iterator + col
    return cute.make_ptr(row.element_type, ptr.toint(), ptr.memspace, assumed_align=align_bytes)


@dsl_user_op
def bulk_store_row(g_row: cute.Tensor, s_row: cute.Tensor, nbytes: int, *, loc=None, ip=None):
    """One thread: the first ``nbytes`` of shared row ``s_row`` to global row ``g_row`` by
    one bulk copy (``cp.async.bulk`` into this thread's bulk group; no tensor map, so any
    row stride). Both rows 16-byte aligned, ``nbytes`` a multiple of 16. The writers of
    ``s_row`` fence it for the async proxy and meet the issuing thread first; the issuer
    commits and waits (``cp_async_bulk_wait_group(0, read=True)``) before the shared
    memory is written again or the CTA exits."""
    assert nbytes % 16 == 0, nbytes
    llvm.inline_asm(None, [g_row.iterator.toint().ir_value(loc=loc, ip=ip),
                           s_row.iterator.toint().ir_value(loc=loc, ip=ip)],
                    f"cp.async.bulk.global.shared::cta.bulk_group [$0], [$1], {nbytes};", "l,r",
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@cute.jit
def chunk_predicates(tXsX_row: cute.Tensor, tXcX_row: cute.Tensor, cols_valid: cutlass.Constexpr[int]):
    """(atoms, chunks) predicates of one thread's chunks of a row (``tXsX_row`` (CPY,
    chunks), CPY = (atom values, atoms)): chunk k is copied when its first column is below
    ``cols_valid`` (a padded head dim: a chunk holds 8 or 16 columns of a head dim that is a
    multiple of 8, resp. 16, so it is all in or all out). A predicated cp.async copies 0
    bytes and zero-fills its 16 (``cp.async ..., 16, 0``): the padding columns of an MMA
    tile are zeros, as a TMA's out-of-bounds fill makes them."""
    chunks = cute.size(tXsX_row, mode=[1])
    atoms = cute.size(tXsX_row, mode=[0, 1])
    pred = cute.make_rmem_tensor(cute.make_layout((atoms, chunks), stride=(0, 1)), cutlass.Boolean)
    for k in cutlass.range_constexpr(chunks):
        pred[0, k] = tXcX_row[0, k][1] < cols_valid
    return pred


@cute.jit
def copy_row(tiled_copy: cute.TiledCopy, tXsX_row: cute.Tensor, tXcX_row: cute.Tensor, g_row: cute.Tensor,
             cols_valid: cutlass.Constexpr = None):
    """One thread's 16-byte chunks of one row: ``tXsX_row`` (CPY, chunks) its smem
    destinations, ``tXcX_row`` their (row, col) coordinates, ``g_row`` the (cols,) gmem
    row. One cp.async (LDGSTS) per chunk, each from a 16-byte aligned pointer; with
    ``cols_valid`` (a padded head dim), chunks at or past it are zero-filled
    (``chunk_predicates``)."""
    pred = None
    if cutlass.const_expr(cols_valid is not None):
        pred = chunk_predicates(tXsX_row, tXcX_row, cols_valid)
    for k in cutlass.range_constexpr(cute.size(tXsX_row, mode=[1])):
        src = cute.make_tensor(aligned_row_ptr(g_row, tXcX_row[0, k][1], 16), tXsX_row[None, k].layout)
        if cutlass.const_expr(pred is None):
            cute.copy(tiled_copy, src, tXsX_row[None, k])
        else:
            cute.copy(tiled_copy, src, tXsX_row[None, k], pred=pred[None, k])


@cute.jit
def copy_rows(tiled_copy: cute.TiledCopy, tXsX: cute.Tensor, tXcX: cute.Tensor, src_of, rows_valid=None,
              cols_valid: cutlass.Constexpr = None):
    """A thread's rows of a (rows, cols) smem tile: ``tXsX`` (CPY, M, chunks) partitioned
    by ``tiled_copy``, ``tXcX`` the same partition of the tile's coordinates.
    ``src_of(row, m)`` is the source of tile row ``row``, the thread's partition row m: a
    (cols,) gmem row (``copy_row``) or this thread's (CPY, chunks) partition of it (one
    tiled copy). With ``rows_valid``, tile rows at or past it are zero-filled instead: a
    NaN left in V would survive a zero probability, and zero Q rows keep the scores of
    padding rows finite. With ``cols_valid`` (a padded head dim), so are the columns at or
    past it (``chunk_predicates``)."""
    for m in cutlass.range_constexpr(cute.size(tXsX, mode=[1])):
        row = tXcX[0, m, 0][0]
        if cutlass.const_expr(rows_valid is None):
            _copy_src(tiled_copy, tXsX[None, m, None], tXcX[None, m, None], src_of(row, m), cols_valid)
        else:
            if row < rows_valid:
                _copy_src(tiled_copy, tXsX[None, m, None], tXcX[None, m, None], src_of(row, m), cols_valid)
            else:
                tXsX[None, m, None].fill(0.0)


@cute.jit
def _copy_src(tiled_copy: cute.TiledCopy, tXsX_row: cute.Tensor, tXcX_row: cute.Tensor, src,
              cols_valid: cutlass.Constexpr = None):
    if cutlass.const_expr(cute.rank(src) > 1):
        if cutlass.const_expr(cols_valid is None):
            cute.copy(tiled_copy, src, tXsX_row)
        else:
            cute.copy(tiled_copy, src, tXsX_row, pred=chunk_predicates(tXsX_row, tXcX_row, cols_valid))
    else:
        copy_row(tiled_copy, tXsX_row, tXcX_row, src, cols_valid)


@cute.jit
def widen_fp8(tXs8: cute.Tensor, tXs: cute.Tensor, dtype, tXc=None, rows_valid=None, before_store=None,
              group: cutlass.Constexpr = None):
    """FP8 K/V: a thread's chunks of a staged fp8 block, widened into the same chunks of
    the 16-bit tile the MMAs read (exact: every fp8 value is a bf16 and an fp16 value).
    ``tXs8`` and ``tXs`` are (CPY, M, chunks) partitions by one tiled copy. With
    ``rows_valid`` (and ``tXc``, the same partition of the tile's coordinates), rows at or
    past it are zeroed instead: what a cache holds past a sequence's end may be NaN, and a
    zero probability does not cancel it in P V. ``before_store()``, if given, runs between
    the loads and the stores (a barrier that frees the 16-bit tile: it waits while the
    loads are in flight).

    Every chunk is loaded before the first is stored: the compiler cannot move a load
    from one buffer above a store to the other (it cannot tell they do not alias), so one
    chunk at a time would put a full shared-memory round trip per chunk on the path of a
    warpgroup with no other warps to hide it (H200, SM90 decode: 1.46 TB/s of fp8).
    ``group`` (no ``tXc``, ``rows_valid`` or ``before_store``): ``group`` chunks at a time
    instead, 4 + 8 registers each, for a thread short of registers."""
    if cutlass.const_expr(group is not None):
        chunks = [(m, k) for m in range(cute.size(tXs, mode=[1])) for k in range(cute.size(tXs, mode=[2]))]
        for g in cutlass.range_constexpr(0, len(chunks), group):
            part = chunks[g:g + group]
            r8s = [cute.make_fragment_like(tXs8[None, m, k]) for m, k in part]
            for r8, (m, k) in zip(r8s, part):
                cute.autovec_copy(tXs8[None, m, k], r8)
            for r8, (m, k) in zip(r8s, part):
                r16 = cute.make_fragment_like(tXs[None, m, k])
                r16.store(r8.load().to(dtype))
                cute.autovec_copy(r16, tXs[None, m, k])
    else:
        r8 = cute.make_fragment_like(tXs8)
        cute.autovec_copy(tXs8, r8)
        r16 = cute.make_fragment_like(tXs)
        if cutlass.const_expr(before_store is not None):
            before_store()
        for m in cutlass.range_constexpr(cute.size(tXs, mode=[1])):
            for k in cutlass.range_constexpr(cute.size(tXs, mode=[2])):
                r16[None, m, k].store(r8[None, m, k].load().to(dtype))
                if cutlass.const_expr(rows_valid is not None):
                    if tXc[0, m, k][0] >= rows_valid:
                        r16[None, m, k].fill(0.0)
        cute.autovec_copy(r16, tXs)
