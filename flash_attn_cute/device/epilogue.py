"""The register epilogue every kernel that ends with O in registers shares: O and the LSE
stored straight from the accumulator to their global rows; and, from sm_90 on, O staged
in shared memory and stored a row a thread by bulk copies (``store_o_staged``).

An accumulator fragment is seen through ``layout_utils.acc_mn_view`` (rows x cols per
thread, mma.sync and wgmma alike); the matching view of the identity tensor gives each
element's (row, col) in the tile. The rows are gmem views (``FwdTile.out_rows`` /
``lse_rows``: batch or varlen offsets, packed GQA heads, a split's partial), indexed by
the tile's first row ``row0`` plus the tile row; rows at or past ``rows_valid`` lie past
the sequence and are not written.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from flash_attn_cute.device.copy_utils import aligned_row_ptr, bulk_store_row
from flash_attn_cute.device.layout_utils import acc_mn_view


@cute.jit
def store_o(acc_O: cute.Tensor, out_dtype: cutlass.Constexpr, tOcO_mn: cute.Tensor, mO_rows: cute.Tensor,
            row0: Int32, rows_valid: Int32, rows_from_first: cutlass.Constexpr[bool] = False,
            cols_from_first: cutlass.Constexpr[bool] = False, pairs_copied: cutlass.Constexpr[bool] = False,
            cols_valid: cutlass.Constexpr = None):
    """acc_O (fp32 C fragment) converted to ``out_dtype`` and stored to
    ``mO_rows[row0 + row, col]`` from registers: the two adjacent columns a thread holds
    in each 8-column group go out as one store.

    A row's address comes from its own row index, or (``rows_from_first``) from the
    thread's first row plus a static offset: one register then addresses every row,
    where a row index each would live across a long mainloop. Likewise a pair's from its
    own column, or (``cols_from_first``) from the row's first column plus a static offset
    (64-bit offsets folded into the row's address, instead of one per pair). A pair is
    stored from its place in the fragment, or (``pairs_copied``) from a two-register copy;
    each kernel keeps the forms it was tuned with (ptxas schedules and packs them
    differently: 16-bit pairs stay packed from the fragment, a copy unpacks them).
    ``cols_valid`` (a padded head dim d_v, a multiple of 8): pairs at or past it are not
    stored (pair by pair, so ``cols_from_first`` then stores pair by pair too)."""
    rO = cute.make_fragment_like(acc_O, out_dtype)
    rO.store(acc_O.load().to(out_dtype))
    rO_mn = acc_mn_view(rO)
    if cutlass.const_expr(rows_from_first):
        row_base = row0 + tOcO_mn[0, 0][0]
        rows_left = rows_valid - tOcO_mn[0, 0][0]
    for r in cutlass.range_constexpr(cute.size(rO_mn, mode=[0])):
        if cutlass.const_expr(rows_from_first):
            row_offset = cute.crd2idx((r, 0), tOcO_mn.layout)[0]  # static
            if row_offset < rows_left:
                _store_row(rO_mn, tOcO_mn, r, mO_rows[row_base + row_offset, None], cols_from_first, pairs_copied,
                           cols_valid)
        else:
            row = tOcO_mn[r, 0][0]
            if row < rows_valid:
                _store_row(rO_mn, tOcO_mn, r, mO_rows[row0 + row, None], cols_from_first, pairs_copied, cols_valid)


@cute.jit
def _store_row(rO_mn: cute.Tensor, tOcO_mn: cute.Tensor, r: cutlass.Constexpr[int], g_row: cute.Tensor,
               cols_from_first: cutlass.Constexpr, pairs_copied: cutlass.Constexpr,
               cols_valid: cutlass.Constexpr = None):
    """Row r of the accumulator view into its gmem row, two adjacent columns per store."""
    dtype = rO_mn.element_type
    align = 2 * dtype.width // 8
    if cutlass.const_expr(cols_from_first and cols_valid is None):
        # The thread's columns sit at static offsets from its first one: the column strides
        # of ``tOcO_mn``, adjacent in pairs, so the copy vectorises two columns per store.
        cols = cute.make_layout(rO_mn[r, None].shape, stride=_column_offsets(tOcO_mn[r, None].layout.stride))
        cute.autovec_copy(rO_mn[r, None], cute.make_tensor(aligned_row_ptr(g_row, tOcO_mn[r, 0][1], align), cols))
    else:
        store_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=2 * dtype.width)
        rO_pairs = _pairs(rO_mn[r, None])
        for j in cutlass.range_constexpr(cute.size(rO_pairs, mode=[1])):
            if cutlass.const_expr(cols_valid is None):
                _store_pair(store_atom, rO_mn, rO_pairs, tOcO_mn, r, j, g_row, align, pairs_copied)
            else:
                if tOcO_mn[r, 2 * j][1] < cols_valid:
                    _store_pair(store_atom, rO_mn, rO_pairs, tOcO_mn, r, j, g_row, align, pairs_copied)


@cute.jit
def _store_pair(store_atom, rO_mn: cute.Tensor, rO_pairs: cute.Tensor, tOcO_mn: cute.Tensor, r: cutlass.Constexpr,
                j: cutlass.Constexpr, g_row: cute.Tensor, align: cutlass.Constexpr, pairs_copied: cutlass.Constexpr):
    dst = cute.make_tensor(aligned_row_ptr(g_row, tOcO_mn[r, 2 * j][1], align), cute.make_layout(2))
    if cutlass.const_expr(pairs_copied):
        pair = cute.make_rmem_tensor((2,), rO_mn.element_type)
        pair[0] = rO_mn[r, 2 * j]
        pair[1] = rO_mn[r, 2 * j + 1]
        cute.copy(store_atom, pair, dst)
    else:
        cute.copy(store_atom, rO_pairs[None, j], dst)


# Staged O's row padding in elements: 16 bytes for 16-bit O, 32 for fp32, so that the pair
# stores of a warp's eight rows fall on different banks (at most two ways for fp32).
O_STAGE_PAD = 8


def staged_o_bytes(out_dtype, rows: int, cols: int) -> int:
    """Shared memory that ``staged_o`` lays a (rows, cols) tile over."""
    return rows * (cols + O_STAGE_PAD) * out_dtype.width // 8


def staged_o(smem_ptr, out_dtype, rows: int, cols: int) -> cute.Tensor:
    """A (rows, cols) tile of ``out_dtype`` at ``smem_ptr`` (16-byte aligned, free shared
    memory of ``staged_o_bytes``), rows padded by ``O_STAGE_PAD``: the staging of
    ``store_o_staged``."""
    return cute.make_tensor(cute.recast_ptr(smem_ptr, dtype=out_dtype),
                            cute.make_layout((rows, cols), stride=(cols + O_STAGE_PAD, 1)))


@cute.jit
def store_o_staged(acc_O: cute.Tensor, out_dtype: cutlass.Constexpr, tOcO_mn: cute.Tensor, sO: cute.Tensor,
                   mO_rows: cute.Tensor, row0: Int32, rows_valid: Int32, tidx: Int32,
                   num_threads: cutlass.Constexpr[int], barrier_id: cutlass.Constexpr[int]):
    """``store_o``'s result through shared memory (sm_90 on): acc_O converted into ``sO``
    (``staged_o``; its whole rows, by the ``num_threads`` threads that hold acc_O, ``tidx``
    in [0, num_threads)), which meet at named barrier ``barrier_id``; then thread ``tidx``
    stores row ``tidx`` (below ``rows_valid``) to ``mO_rows[row0 + tidx]`` by one bulk copy
    and waits until it has read it. From registers a warp's pair stores touch eight rows
    each and queue up in the LSU (MLA decode, ncu: lg_throttle 0.64 stalls per issue at 128
    heads, none for FlashMLA's TMA stores). ``sO`` must not be written or read by anyone
    else until every thread passed this."""
    rows, cols = cute.size(sO, mode=[0]), cute.size(sO, mode=[1])
    store_o(acc_O, out_dtype, tOcO_mn, sO, 0, rows, cols_from_first=True)
    cute.arch.fence_view_async_shared()
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=num_threads)
    if tidx < rows_valid and tidx < rows:
        bulk_store_row(mO_rows[row0 + tidx, None], sO[tidx, None], cols * out_dtype.width // 8)
        cute.arch.cp_async_bulk_commit_group()
        cute.arch.cp_async_bulk_wait_group(0, read=True)


@cute.jit
def store_lse(lse: cute.Tensor, tXcX_mn: cute.Tensor, mLSE_rows: cute.Tensor, row0: Int32, rows_valid: Int32,
              group_writes=None):
    """lse[r] (one value per row of the thread, ``OnlineSoftmax.finalize``) to
    ``mLSE_rows[row0 + row]``; ``tXcX_mn`` the coordinates of any accumulator whose rows
    are the softmax's (S or O). The four lanes sharing a row hold the same LSE; the one at
    column 0 writes it. ``group_writes``: whether this thread's group writes, where
    several groups (warpgroups) hold the same rows; the other threads skip the loop."""
    if cutlass.const_expr(group_writes is None):
        for r in cutlass.range_constexpr(cute.size(lse)):
            row = tXcX_mn[r, 0][0]
            if tXcX_mn[0, 0][1] == 0 and row < rows_valid:
                mLSE_rows[row0 + row] = lse[r]
    else:
        if group_writes and tXcX_mn[0, 0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(lse)):
                row = tXcX_mn[r, 0][0]
                if row < rows_valid:
                    mLSE_rows[row0 + row] = lse[r]


def _pairs(row: cute.Tensor) -> cute.Tensor:
    """One row of an accumulator view, columns (2, MMA_N) (mma.sync) or (2, N / 8, MMA_N)
    (wgmma) -> (2, pairs): pair j holds columns 2j and 2j + 1 of the view, adjacent in the
    tile's row."""
    return cute.logical_divide(row, cute.make_layout(2))


def _column_offsets(stride):
    """The column components of an identity tensor's strides (basis elements, ``1@1``)."""
    if isinstance(stride, tuple):
        return tuple(_column_offsets(x) for x in stride)
    if isinstance(stride, cute.ScaledBasis):
        return stride.value if stride.mode == [1] else 0
    return 0
