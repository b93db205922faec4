"""MLA decode's length-balanced split schedule, computed on the device (no host sync).

FlashMLA splits a decode batch over the SMs by the sequences' lengths, which only the
device knows (``cache_seqlens``), in a small metadata kernel run once per decode step
(``get_mla_metadata``) and read by every layer. This is that kernel for this package's
SM90 MLA kernel (``sm90/mla_decode_tma.py``): without it the split count is planned on the
host from the page table's capacity and divides every sequence alike, so a batch of
mixed lengths waits for its longest sequence on a few SMs.

The schedule, for ``parts`` CTAs per grid slice (one slice per 64-row M block and KV head:
``num_sms / slices``, ``schedule_parts``), over sequences of ``n_b = ceil(min(len_b,
capacity) / 64)`` KV blocks:

    chunk = max(ceil(sum_b (n_b + OVERHEAD_BLOCKS) / parts), MIN_BLOCKS)
    s_b   = max(1, ceil(n_b / chunk))              pieces of sequence b
    piece k of b: blocks [k n_b / s_b, (k + 1) n_b / s_b)   (integer division)

Work items are the pieces in batch order (sum_b s_b <= parts + batch: ``max_items``); a
sequence of one piece writes its output directly, one of several writes fp32 partials to
consecutive slots (sum over split sequences of s_b < 2 parts: ``max_slots``, as s_b > 1
means n_b > chunk, so s_b < 2 n_b / chunk) that the combine merges per sequence from
(slot_base, s_b). ``OVERHEAD_BLOCKS`` charges each sequence a CTA's fixed cost (Q in, O
out) in KV blocks, as FlashMLA's metadata does; ``MIN_BLOCKS`` keeps pieces from being all
overhead. On uniform lengths this plans what the host heuristic plans (64 x 1024: two
pieces a sequence; 128 x 2048: one).

Measured (H200, 2026-12-06, CUDA-graph replays, ``bench_mla.py --schedule [--skewed]``): 64
sequences of lengths uniform in [1, 2048), 64 heads: 56.7 against 62.2 us for the host's even
splits (1.10x; FlashMLA takes 0.80x of that time); where no sequence needs cutting (uniform 128 x 2048,
or 128 heads over mixed lengths up to 4096) 0.95-0.97x the host plan: the grid's items past the
last, and the combine launched for sequences it then skips.

The tensor (int32, flat): ``max_items`` rows of (batch, block_lo, block_hi, slot) (slot -1:
the output itself; batch -1: no work, past the last item), then ``batch`` rows of
(slot_base, s_b). One CTA of ``THREADS`` threads computes it: a sum over the batch, then
block-wide prefix sums over it in chunks of sequences (``kernels/mla_schedule.py``).
"""

from __future__ import annotations

from flash_attn_cute.host.constants import MAX_SPLITS

TILE_N = 64  # the SM90 MLA kernel's KV block
OVERHEAD_BLOCKS = 4
MIN_BLOCKS = 4
ITEM_FIELDS = 4  # batch, block_lo, block_hi, slot
INFO_FIELDS = 2  # slot_base, pieces


# get_mla_metadata's capacity (it has no page table; the kernels clamp lengths to theirs):
# the largest a block count of 64 keys rounds up from without overflowing int32
NO_CAPACITY = 2**31 - TILE_N
THREADS = 512  # the schedule kernel's CTA (``kernels/mla_schedule.py``)


def schedule_key(arch: str) -> tuple:
    """The schedule kernel's compile key (its JIT cache name is the first field)."""
    return ("mla_schedule", THREADS, OVERHEAD_BLOCKS, MIN_BLOCKS, arch)


def max_items(parts: int, batch: int) -> int:
    return parts + batch


def max_slots(parts: int) -> int:
    return 2 * parts


def schedule_numel(parts: int, batch: int) -> int:
    return ITEM_FIELDS * max_items(parts, batch) + INFO_FIELDS * batch


def info_view(schedule, batch: int):
    """The (batch, INFO_FIELDS) rows (slot_base, pieces) at the tail of a schedule tensor."""
    return schedule[schedule.numel() - INFO_FIELDS * batch:].view(batch, INFO_FIELDS)


def parts_of(numel: int, batch: int) -> int:
    """The ``parts`` a schedule tensor of ``numel`` elements was made for (``schedule_numel``
    inverted; -1 when none)."""
    rest = numel - (ITEM_FIELDS + INFO_FIELDS) * batch
    return rest // ITEM_FIELDS if rest > 0 and rest % ITEM_FIELDS == 0 else -1


def schedule_parts(num_sms: int, slices: int) -> int:
    """CTAs per grid slice (``slices``: M blocks x KV heads): the SMs each slice gets, at
    least one, below ``MAX_SPLITS`` (a sequence has at most parts + 1 pieces)."""
    return max(1, min(MAX_SPLITS - 1, num_sms // max(1, slices)))


def reference_schedule(seqlens: list, capacity: int, parts: int) -> tuple:
    """The schedule of this module as Python lists (the tests' reference):
    (items [(batch, lo, hi, slot)] of length ``max_items``, info [(slot_base, pieces)])."""
    blocks = [-(-min(max(n, 0), capacity) // TILE_N) for n in seqlens]
    chunk = max(-(-sum(n + OVERHEAD_BLOCKS for n in blocks) // parts), MIN_BLOCKS)
    items, info, slot = [], [], 0
    for b, n in enumerate(blocks):
        pieces = max(1, -(-n // chunk))
        info.append((slot, pieces))
        for k in range(pieces):
            items.append((b, k * n // pieces, (k + 1) * n // pieces, slot + k if pieces > 1 else -1))
        slot += pieces if pieces > 1 else 0
    items += [(-1, 0, 0, -1)] * (max_items(parts, len(seqlens)) - len(items))
    return items, info
