"""Global-memory row copies shared by the kernels: 128-bit cp.async tiled copies and
row pointers that keep the alignment their layout guarantees (gathered rows: paged KV,
packed GQA, epilogues that store from registers)."""

import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync


def gmem_tiled_copy(dtype, cols: int, num_threads: int):
    """128-bit cp.async, consecutive threads along a row of the smem atom."""
    elems = 128 // dtype.width
    threads_per_row = (64 if cols % 64 == 0 else 32) // elems
    atom = cute.make_copy_atom(
        cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), dtype, num_bits_per_copy=128
    )
    thr = cute.make_layout((num_threads // threads_per_row, threads_per_row), stride=(threads_per_row, 1))
    return cute.make_tiled_copy_tv(atom, thr, cute.make_layout((1, elems)))


def aligned_row_ptr(row: cute.Tensor, col, align_bytes: int):
    """Pointer to row[col] with the alignment the row layout guarantees (a dynamic
    column offset would otherwise drop it to one element)."""
    ptr = row.iterator + col
    return cute.make_ptr(row.element_type, ptr.toint(), cute.AddressSpace.gmem, assumed_align=align_bytes)
