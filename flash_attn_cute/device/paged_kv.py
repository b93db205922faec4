"""Paged KV caches: key position -> (page, row in page) through the page table.

The cache is a pool ``(num_pages, page_size, h_kv, d)``; sequence ``b``'s key ``t`` lives
in page ``page_table[b, t // page_size]``, row ``t % page_size``. A page id outside the
pool is clamped into it: a corrupt table gives wrong keys, never a read outside the cache
(the lengths themselves are clamped to the table's capacity by ``SeqlenInfo``). Any page
size works, 1 included; one definition for every kernel that gathers rows.

With ``cache_leftpad`` (``SeqlenInfo.leftpad_k``, the kernels' ``mLeftpadK``) sequence b's
key j is cache position ``leftpad_k + j``: the lookups take the start (``key_start``) and
add it to every key before the page division (None: nothing added, the code of a cache
without it). ``SeqlenInfo`` bounds start + length by the capacity.
"""

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Int32


@cute.jit
def clamp_page(page: Int32, num_pages: Int32):
    """A page id from the table clamped into [0, num_pages): a bad entry reads a real page."""
    return cutlass.max(cutlass.min(page, num_pages - 1), 0)


@cute.jit
def page_entry(mPageTable: cute.Tensor, batch: Int32, t: Int32, page_size):
    """``page_and_row`` without the clamp: (page-table entry as stored, row inside the page)
    of key position ``t``, for a read issued ahead of its use (``clamp_page`` there would
    make it wait at once). ``page_size``: an Int32, or its ``cute.FastDivmodDivisorV2``
    made once at launch (a multiply instead of a runtime division, for lookups in every
    step of a loop: the SM90 MLA TMA kernel's, about 25 instructions fewer each in its sm_90a
    SASS). ``page_and_row`` keeps its own two lines: built on this one, it moved the SM90
    gathering kernels' page lookups and left 65 local-memory instructions in their sm_90a SASS."""
    if cutlass.const_expr(isinstance(page_size, cute.FastDivmodDivisorV2)):
        page_idx, row = divmod(t, page_size)
        return mPageTable[batch, page_idx], row
    page_idx = t // page_size
    return mPageTable[batch, page_idx], t - page_idx * page_size


def kv_box_index(n_block: Int32, j, tile_n: int, kv_box: int, last: Int32):
    """The box (in units of ``kv_box`` keys from the sequence's first key) that box ``j`` of
    KV block ``n_block`` reads, for the TMA kernels that read pages holding no whole block
    in boxes (``host.paging.box_rows``): its first key's, at most the sequence's ``last``
    key's (a box past the end reads the last key's box again: its page-table entry may lie
    past the table's row; the masks and the V-tail zeroing take its rows out). The page
    table maps boxes like keys in units of ``boxes_per_page`` (``page_entry``)."""
    return cutlass.min(n_block * tile_n + j * kv_box, last) // kv_box


def box_in_page(box: Int32, boxes_per_page: Int32):
    """The row of ``box`` among its page's boxes (``page_entry``'s second value, recomputed
    where the entry was read before a wait: only the entries are carried across it)."""
    return box - (box // boxes_per_page) * boxes_per_page


@cute.jit
def page_and_row(mPageTable: cute.Tensor, batch: Int32, t: Int32, page_size: Int32, num_pages: Int32):
    """(page id clamped into [0, num_pages), row inside the page) of key position ``t``."""
    page_idx = t // page_size
    return clamp_page(mPageTable[batch, page_idx], num_pages), t - page_idx * page_size


@cute.jit
def lookup_key(tXcX: cute.Tensor, t0: Int32, last: Int32, m: cutlass.Constexpr[int], key_start: Optional[Int32] = None):
    """The cache position ``page_lookups`` looks up for partition row ``m`` of the block whose
    first key is ``t0``: its key, at most ``last``, plus ``key_start`` (None: nothing)."""
    t = cutlass.min(t0 + tXcX[0, m, 0][0], last)
    if cutlass.const_expr(key_start is not None):
        t = t + key_start
    return t


@cute.jit
def rows_in_page(tXcX: cute.Tensor, t0: Int32, last: Int32, first: cutlass.Constexpr[int],
                 count: cutlass.Constexpr[int], page_size: Int32, key_start: Optional[Int32] = None):
    """The rows in page ``page_lookups`` returns, without reading the table: for entries
    looked up ahead (``clamp=False``) whose rows are recomputed where they are used."""
    tPrRow = cute.make_rmem_tensor((count,), Int32)
    for i in cutlass.range_constexpr(count):
        t = lookup_key(tXcX, t0, last, first + i, key_start)
        tPrRow[i] = t - (t // page_size) * page_size
    return tPrRow


@cute.jit
def page_lookups(mPageTable: cute.Tensor, batch: Int32, tXcX: cute.Tensor, t0: Int32, last: Int32,
                 first: cutlass.Constexpr[int], count: cutlass.Constexpr[int], page_size: Int32, num_pages: Int32,
                 key_start: Optional[Int32] = None, clamp: cutlass.Constexpr[bool] = True):
    """(pages, rows in page): two (count,) register tensors for the partition rows [first,
    first + count) of a KV block whose first key is ``t0`` (``tXcX``: a thread's (CPY, M,
    chunks) coordinates of the block). The lookups are issued together, before any copy
    needs one, so their latencies overlap (one after another, page size 1 read 1.65 TB/s
    on the H200). Keys past ``last``, the sequence's last, look ``last`` up: a real page.
    ``key_start``: the cache position of key 0 (``SeqlenInfo.leftpad_k``). ``clamp=False``:
    the entries as stored (``page_entry``), for lookups issued a block ahead of their use,
    which clamps them (``clamp_page``; a clamp here would wait for the read at once)."""
    tPrPage = cute.make_rmem_tensor((count,), Int32)
    tPrRow = cute.make_rmem_tensor((count,), Int32)
    for i in cutlass.range_constexpr(count):
        t = lookup_key(tXcX, t0, last, first + i, key_start)
        if cutlass.const_expr(clamp):
            tPrPage[i], tPrRow[i] = page_and_row(mPageTable, batch, t, page_size, num_pages)
        else:
            tPrPage[i], tPrRow[i] = page_entry(mPageTable, batch, t, page_size)
    return tPrPage, tPrRow


def paged_row_fns(mK: cute.Tensor, mV: cute.Tensor, mPageTable: cute.Tensor, batch: Int32, head_kv: Int32,
                  key_start: Optional[Int32] = None):
    """Row functions over paged caches ``mK``/``mV`` (num_pages, page_size, h_kv, d*): key
    -> 1-D gmem tensor (d*,) of that key for ``head_kv``, the key at cache position
    ``key_start`` + key (``SeqlenInfo.leftpad_k``; None: the key itself). Both take the page
    geometry from K (the API checks that V agrees), so a K row and a V row of the same
    key share one page lookup after common-subexpression elimination."""
    page_size, num_pages = mK.shape[1], mK.shape[0]

    def row_fn(mX):
        mX_h = mX[None, None, head_kv, None]  # (num_pages, page_size, d*)

        def row(t):
            if cutlass.const_expr(key_start is not None):
                t = t + key_start
            page, r = page_and_row(mPageTable, batch, t, page_size, num_pages)
            return mX_h[page, r, None]

        return row

    return row_fn(mK), row_fn(mV)
