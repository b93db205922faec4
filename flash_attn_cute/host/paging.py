"""How a TMA kernel reads a paged KV cache: a page that holds whole KV blocks gives one TMA
box a block; a page of another multiple of 16 keys gives boxes of 16, 32 or 64 rows, each
through its own page-table entry (``box_rows``); other pages (1, 8, 24, ...) need row
gathers, which a kernel either has (SM90's producer warpgroup) or leaves to another kernel.
The arithmetic both TMA kernels (SM90, SM100) plan with; plain Python."""

from __future__ import annotations

# The rows of a TMA box over pages that hold no whole KV block: from the largest (fewest
# boxes a block) down; a page of a multiple of 16 keys takes boxes of 16 at least.
KV_BOX_ROWS = (64, 32, 16)


def box_rows(tile_n: int, page_size: int) -> int:
    """Rows of the TMA boxes a cache in pages of ``page_size`` keys is read by under KV blocks
    of ``tile_n`` keys: 0 where a page holds whole blocks (one box a block) or none of
    ``KV_BOX_ROWS`` divides both the page and the block (rows must be gathered); else the
    largest that does, so that a box lies inside one page and a block is ``tile_n / rows``
    boxes."""
    if not page_size or page_size % tile_n == 0:
        return 0
    return next((r for r in KV_BOX_ROWS if page_size % r == 0 and tile_n % r == 0), 0)


def tma_readable(tile_n: int, page_size: int) -> bool:
    """Whether a paged cache is read by TMA alone: whole blocks a page, or boxes."""
    return page_size % tile_n == 0 or box_rows(tile_n, page_size) > 0
