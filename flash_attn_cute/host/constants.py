"""Numbers that host and device code both read, with no imports: one home for each.

Plain Python (importing it never loads the DSL), so the public API, the planners and the
kernels take these from one place instead of restating them."""

MAX_SPLITS = 256  # split-KV partials the combine kernel accepts
# batch_invariant: every KV split holds this many keys (rounded up to whole KV blocks), from
# key 0 of the sequence, so a sequence's splits never depend on the rest of the batch.
KEYS_PER_SPLIT = 4096
# A varlen call over a cache whose sequences mix decode rows and longer ones (a serving
# step) runs as two launches (``seam.mixed_short_q``): the sequences of at most this many
# packed rows on the decode tile, the others on the prefill tile.
MIXED_ROWS = 64
INT32_MAX = 2**31 - 1  # kernels take lengths, windows and page ids as int32
MAX_GRID_YZ = 65535  # CUDA's limit on a grid's y and z extents (x: 2^31 - 1)

# Head dims: the public API takes any multiple of 8 up to 256 (16-byte rows, as FA3 and
# vLLM do); a kernel compiles the next tile width it is written for (FA3's table), loads
# the columns past the head dim as zeros (TMA's out-of-bounds fill, predicated cp.async)
# and never stores them. A head dim of a tile width pads nothing: its key and SASS are
# those of the kernel it always was.
HEAD_DIM_ALIGN = 8
MAX_HEAD_DIM = 256
HEAD_DIM_TILES = (64, 96, 128, 192, 256)


def padded_head_dims(d: int, d_v: int, pairs=None):
    """(tile d, tile d_v): the smallest (by d + d_v) pair of ``pairs`` (default: every pair of
    ``HEAD_DIM_TILES``) that holds (d, d_v); None when none does."""
    if pairs is None:
        pairs = [(a, b) for a in HEAD_DIM_TILES for b in HEAD_DIM_TILES]
    fits = [p for p in pairs if p[0] >= d and p[1] >= d_v]
    return min(fits, key=lambda p: (p[0] + p[1], p[0])) if fits else None


# MLA (DeepSeek V2/V3): every query head attends to one latent cache row of D_CKV values
# (both K and V) plus D_KPE rotary values (K only).
D_CKV, D_KPE = 512, 64
# Query heads of an MLA call: any count from 1 to MLA_MAX_NHEADS (FlashMLA's range, DeepSeek's
# 128 at one GPU down to 8 or 4 a GPU under tensor parallelism 16 or 32). The kernels pack a
# KV head's query heads x query positions into 64-row tiles and predicate the last tile, so a
# count costs what the next multiple of 64 rows does.
MLA_MAX_NHEADS = 128
MLA_NHEADS = range(1, MLA_MAX_NHEADS + 1)
