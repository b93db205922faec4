"""Launch heuristics: how many KV splits, whether to pack GQA heads, SM count.

Everything here is host-side arithmetic on shapes. ``num_sms`` reads the device once per
device and is only used when the caller asks for ``num_splits=0`` (auto); the compile
path never calls it, so compiling needs no GPU.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Optional

import torch

from flash_attn_cute.host.constants import MAX_SPLITS

__all__ = ["num_splits_heuristic", "resolve_num_splits", "num_sms", "hbm_bytes_per_us", "should_pack_gqa", "ceildiv",
           "MAX_SPLITS", "NO_SPLIT_KEYS", "combine_split_groups", "split_counts"]

_MIN_SPLIT_KEYS = 64  # a split holds at least this many keys (no split without keys)
# FA3's "4 KV blocks or fewer: the combine costs more than it saves", counted in keys so
# that a backend with narrower KV tiles (SM90 paged-64 or d > 128) does not split a tiny
# decode into two launches (H200, 2026-11-29: 33 us of host time against 17 unsplit).
NO_SPLIT_KEYS = 4 * 128


def ceildiv(a: int, b: int) -> int:
    return -(-a // b)


def num_splits_heuristic(total_mblocks: int, num_sms: int, num_n_blocks: int, max_splits: int = 128,
                         tolerance: float = 0.85) -> int:
    """Number of KV splits for split-KV ("flash-decoding"), FA2/FA3's wave-efficiency rule.

    ``total_mblocks`` is the number of CTAs of the unsplit grid (batch x heads x m-blocks),
    ``num_n_blocks`` the number of KV blocks one CTA walks. Splitting the KV loop ``s`` ways
    multiplies the grid by ``s``; it pays off only when the unsplit grid leaves SMs idle.

    - If the grid already fills >= 80% of one wave (``total_mblocks >= 0.8 * num_sms``),
      do not split: 1.
    - If there are at most 4 KV blocks (FA3's rule), the combine costs more than it
      saves: 1.
    - Otherwise, for each candidate ``s`` in ``1..min(max_splits, num_sms, num_n_blocks)``,
      the wave efficiency is ``w / ceil(w)`` with ``w = total_mblocks * s / num_sms``
      waves (1.0 = the last wave is full). Only ``s`` that actually change the number
      of KV blocks per split, ``ceil(n / s) != ceil(n / (s - 1))``, are candidates (with
      64 blocks, 12 splits are 11 splits of 6 blocks and one empty). Return the smallest
      candidate whose efficiency is >= ``tolerance`` (85%) of the best one: few splits (a
      cheap combine) unless more buy a clearly fuller machine.
    """
    if total_mblocks <= 0 or num_sms <= 0 or num_n_blocks <= 0:
        return 1
    if total_mblocks >= 0.8 * num_sms:
        return 1
    if num_n_blocks <= 4:
        return 1
    max_splits = max(1, min(max_splits, num_sms, num_n_blocks))

    def efficiency(s: int) -> float:
        waves = total_mblocks * s / num_sms
        return waves / math.ceil(waves)

    candidates = split_counts(num_n_blocks, max_splits)
    best = max(efficiency(s) for s in candidates)
    for s in candidates:
        if efficiency(s) >= tolerance * best:
            return s
    return 1


def split_counts(num_n_blocks: int, max_splits: int) -> list:
    """The split counts 1..``max_splits`` that change the KV blocks a split holds,
    ``ceil(n / s) != ceil(n / (s - 1))`` (1 always): with 64 blocks, 12 splits are 11
    splits of 6 blocks and one empty, no better than 11."""
    return [s for s in range(1, max_splits + 1)
            if s == 1 or ceildiv(num_n_blocks, s) != ceildiv(num_n_blocks, s - 1)]


def resolve_num_splits(num_splits: int, num_sms: Optional[int], *, ctas: int, rows: int, max_seqlen_k: int,
                       tile_m: int, tile_n: int, ctas_per_sm: int, tolerance: float) -> int:
    """``num_splits`` as a kernel runs it. 0 = auto: ``num_splits_heuristic`` on the unsplit
    grid of ``ctas`` (batch x head groups) times ``ceil(rows / tile_m)`` m-blocks, each
    walking ``ceil(max_seqlen_k / tile_n)`` KV blocks, on ``num_sms * ctas_per_sm``
    resident CTAs (causal/local skipping and varlen per-sequence lengths are ignored).
    Then clamped to ``ceil(max_seqlen_k / 64)`` and ``MAX_SPLITS``. The tile and
    occupancy are the calling backend's. Auto never splits 512 keys or fewer."""
    if num_splits == 0:
        if max_seqlen_k <= NO_SPLIT_KEYS:
            return 1
        total_mblocks = ctas * ceildiv(rows, tile_m)
        n_blocks = ceildiv(max_seqlen_k, tile_n)
        num_splits = num_splits_heuristic(total_mblocks, num_sms * ctas_per_sm, n_blocks, tolerance=tolerance)
    return max(1, min(num_splits, ceildiv(max_seqlen_k, _MIN_SPLIT_KEYS), MAX_SPLITS))


@lru_cache(maxsize=None)
def _num_sms_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# The HBM bandwidth a streaming kernel reaches, as a fraction of the peak the device reports:
# H100 SXM, 2026-12-07, 3.08 TB/s fitted to MLA decode times (``sm90/mla.py``'s split model)
# against 3.35 nominal.
_HBM_EFFICIENCY = 0.92
# Without a GPU (planning for a compile, AOT, tests): an H200's 4.9 TB/s, at that fraction.
_DEFAULT_HBM_BYTES_PER_US = 4.9e6 * _HBM_EFFICIENCY


@lru_cache(maxsize=None)
def _hbm_of(index: int) -> float:
    props = torch.cuda.get_device_properties(index)
    rate_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    if not rate_khz or not bus_bits:
        return _DEFAULT_HBM_BYTES_PER_US
    return rate_khz * 1e3 * 2 * bus_bits / 8 * _HBM_EFFICIENCY / 1e6  # double data rate


def hbm_bytes_per_us() -> float:
    """Bytes per microsecond a streaming kernel reads from HBM on the current CUDA device
    (without one, an H200's): the peak from the memory clock and bus width, times
    ``_HBM_EFFICIENCY``. For cost models that weigh bytes against SM time; the seam makes
    the call's device current while it plans (``seam._resolve``)."""
    if not torch.cuda.is_available():
        return _DEFAULT_HBM_BYTES_PER_US
    return _hbm_of(torch.cuda.current_device())


def num_sms(device) -> int:
    """Streaming multiprocessors of a CUDA device (cached per device index)."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _num_sms_of(index)


def should_pack_gqa(seqlen_q: int, qhead_per_kvhead: int, tile_m: int = 128, *, varlen_q: bool = False) -> bool:
    """Auto rule for ``pack_gqa=None``.

    Packing GQA lays the ``qhead_per_kvhead`` query heads that share one KV head along the
    M dimension, so one CTA handles ``seqlen_q * qhead_per_kvhead`` rows for one KV head:
    K/V are loaded once for all of them, and short queries (decode: ``seqlen_q`` of 1)
    still fill the ``tile_m``-row tile instead of wasting most of it.

    Rule (FA3's): with GQA/MQA (``qhead_per_kvhead > 1``), pack when the useful fraction
    of the M tiles without packing, ``seqlen_q / round_up(seqlen_q, tile_m)``, is below 90%
    of that with packing, ``rows / round_up(rows, tile_m)`` with
    ``rows = seqlen_q * qhead_per_kvhead``. Decode (``seqlen_q`` of 1..16) packs; a prefill
    whose ``seqlen_q`` is a multiple of ``tile_m`` does not (nothing to gain, and the
    packed index arithmetic costs a little). With variable-length queries only the
    maximum length is known and short sequences are common, so ``varlen_q`` packs.
    """
    if qhead_per_kvhead <= 1:
        return False
    if varlen_q:
        return True
    if seqlen_q <= 0:
        return False

    def useful(rows: int) -> float:
        return rows / (ceildiv(rows, tile_m) * tile_m)

    return useful(seqlen_q) < 0.9 * useful(seqlen_q * qhead_per_kvhead)


def l2_heads_for(seqlen_k: int, d: int, dv: int, elem_bytes: int = 2, l2_bytes: int = 50 * 1024 * 1024) -> int:
    """(head, batch) pairs whose K and V fit in L2 together, rounded down to a power of 2:
    the section width of the SM90 kernel's longest-first tile order. ``l2_bytes``: the
    H100/H200 L2 (50 MB)."""
    per_head = max(1, seqlen_k * (d + dv) * elem_bytes)
    n = max(1, l2_bytes // per_head)
    return 1 << (n.bit_length() - 1)


def combine_split_groups(num_splits: int, batch_invariant: bool = False) -> int:
    """Lane groups that share a row of the combine (``combine.FlashAttnCombine``), each
    streaming every G-th split: a power of two up to 8 that leaves each group at least 16
    splits. Many splits come with few rows (the split heuristic splits only grids that
    leave SMs idle), and one group per row then streams them all one after another: MLA
    1 x 32768 (64 rows, 128 splits) took 20.6 us in 32 CTAs, 12.9 us in 256 with 8 groups
    (H200, ncu, 2026-12-02); the combine alone (``bench_combine.py``, L2 flushed): 23.5 ->
    15.6 us there, 23.5 -> 9.4 us at 128 splits x 32 rows of d 128, 10.9 -> 9.3 us at 32 x
    256 with 2 groups.
    A function of the split count alone, and 1 for batch-invariant plans: the groups'
    sums add in group order, so G must not follow the batch (a batch-invariant plan's
    split count follows max_seqlen_k, which a varlen batch sets)."""
    groups = 1
    while not batch_invariant and groups < 8 and num_splits >= 32 * groups:
        groups *= 2
    return groups
