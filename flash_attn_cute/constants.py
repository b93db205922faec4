"""Numbers that host and device code both read, with no imports: one home for each.

Plain Python (importing it never loads the DSL), so the public API, the planners and the
kernels take these from one place instead of restating them."""

MAX_SPLITS = 256  # split-KV partials the combine kernel accepts
# batch_invariant: every KV split holds this many keys (rounded up to whole KV blocks), from
# key 0 of the sequence, so a sequence's splits never depend on the rest of the batch.
KEYS_PER_SPLIT = 4096
# A varlen call over a cache whose sequences mix decode rows and longer ones (a serving
# step) runs as two launches (``fwd.mixed_short_q``): the sequences of at most this many
# packed rows on the decode tile, the others on the prefill tile.
MIXED_ROWS = 64
INT32_MAX = 2**31 - 1  # kernels take lengths, windows and page ids as int32

# MLA (DeepSeek V2/V3): every query head attends to one latent cache row of D_CKV values
# (both K and V) plus D_KPE rotary values (K only).
D_CKV, D_KPE = 512, 64
# Query heads of an MLA call: any count from 1 to MLA_MAX_NHEADS (FlashMLA's range, DeepSeek's
# 128 at one GPU down to 8 or 4 a GPU under tensor parallelism 16 or 32). The kernels pack a
# KV head's query heads x query positions into 64-row tiles and predicate the last tile, so a
# count costs what the next multiple of 64 rows does.
MLA_MAX_NHEADS = 128
MLA_NHEADS = range(1, MLA_MAX_NHEADS + 1)
