"""The device kernel of MLA decode's length-balanced split schedule: what it computes,
and the host's arithmetic of it, are ``host/mla_schedule.py``'s."""

from __future__ import annotations

import torch

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from flash_attn_cute.host import jit_cache
from flash_attn_cute.host.keys import target_arch
from flash_attn_cute.host.mla_schedule import INFO_FIELDS, ITEM_FIELDS, MIN_BLOCKS, OVERHEAD_BLOCKS, THREADS, TILE_N, \
    schedule_key

WARPS = THREADS // 32


class MlaSchedule:
    """The schedule kernel: one CTA, ``THREADS`` threads."""

    @cute.jit
    def __call__(self, mSeqlens: cute.Tensor, mSchedule: cute.Tensor, capacity: Int32, parts: Int32, stream):
        self.kernel(mSeqlens, mSchedule, capacity, parts).launch(grid=[1, 1, 1], block=[THREADS, 1, 1],
                                                                 stream=stream)

    @cute.kernel
    def kernel(self, mSeqlens: cute.Tensor, mSchedule: cute.Tensor, capacity: Int32, parts: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        batch = mSeqlens.shape[0]
        n_items = parts + batch
        smem = cutlass.memory.SmemAllocator()
        # per-warp sums of the two prefix sums (items, slots), and pass 1's total
        sWarp = smem.allocate_tensor(Int32, cute.make_layout((WARPS, 2)), byte_alignment=16)
        # Pass 1: the batch's cost in KV blocks.
        cost = Int32(0)
        for b in cutlass.range(tidx, batch, THREADS):
            cost += self.blocks(mSeqlens, b, capacity) + OVERHEAD_BLOCKS
        total, _ = self.block_scan(cost, sWarp, 0, tidx)
        chunk = cutlass.max((total + parts - 1) // parts, Int32(MIN_BLOCKS))
        # Pass 2: pieces and slots per sequence, their prefix sums, the items.
        item_base = Int32(0)
        slot_base = Int32(0)
        for start in cutlass.range(0, batch, THREADS, unroll=1):
            b = start + tidx
            n = Int32(0)
            pieces = Int32(0)
            if b < batch:
                n = self.blocks(mSeqlens, b, capacity)
                pieces = cutlass.max((n + chunk - 1) // chunk, Int32(1))
            slots = pieces if pieces > 1 else Int32(0)
            items_total, items_before = self.block_scan(pieces, sWarp, 0, tidx)
            slots_total, slots_before = self.block_scan(slots, sWarp, 1, tidx)
            if b < batch:
                first = item_base + items_before
                slot0 = slot_base + slots_before
                mSchedule[ITEM_FIELDS * n_items + INFO_FIELDS * b] = slot0
                mSchedule[ITEM_FIELDS * n_items + INFO_FIELDS * b + 1] = pieces
                for k in cutlass.range(pieces, unroll=1):
                    row = ITEM_FIELDS * (first + k)
                    mSchedule[row] = b
                    mSchedule[row + 1] = k * n // pieces
                    mSchedule[row + 2] = (k + 1) * n // pieces
                    mSchedule[row + 3] = slot0 + k if pieces > 1 else Int32(-1)
            item_base += items_total
            slot_base += slots_total
        for j in cutlass.range(item_base + tidx, n_items, THREADS):
            mSchedule[ITEM_FIELDS * j] = Int32(-1)
            mSchedule[ITEM_FIELDS * j + 1] = Int32(0)
            mSchedule[ITEM_FIELDS * j + 2] = Int32(0)
            mSchedule[ITEM_FIELDS * j + 3] = Int32(-1)

    @cute.jit
    def blocks(self, mSeqlens: cute.Tensor, b, capacity: Int32) -> Int32:
        """KV blocks of sequence b: its length clamped to [0, capacity], as the kernels clamp it."""
        n = cutlass.min(cutlass.max(mSeqlens[b], Int32(0)), capacity)
        return (n + TILE_N - 1) // TILE_N

    @cute.jit
    def block_scan(self, value: Int32, sWarp: cute.Tensor, col: cutlass.Constexpr[int], tidx) -> tuple:
        """(sum over the CTA, exclusive prefix sum in thread order) of ``value``; every
        thread calls it (two barriers; column ``col`` of ``sWarp`` is free again on return)."""
        lane = tidx % 32
        warp = tidx // 32
        inclusive = value
        for i in cutlass.range_constexpr(5):
            up = cute.arch.shuffle_sync_up(inclusive, 1 << i)
            if lane >= (1 << i):
                inclusive += up
        if lane == 31:
            sWarp[warp, col] = inclusive
        cute.arch.sync_threads()
        before = inclusive - value
        total = Int32(0)
        for w in cutlass.range_constexpr(WARPS):
            s = sWarp[w, col]
            total += s
            if w < warp:
                before += s
        cute.arch.sync_threads()
        return total, before


def compile_from_key(key: tuple):
    """Compiles the schedule kernel for ``key`` (``schedule_key``) on fake tensors (no GPU)."""
    from flash_attn_cute.device.cute_utils import compile_options, fake_stream, fake_tensor

    assert key == schedule_key(key[-1]), key
    return cute.compile(MlaSchedule(), fake_tensor(Int32, 1, align=4), fake_tensor(Int32, 1, align=4), Int32(1),
                        Int32(1), fake_stream(), options=compile_options(key[-1]))


def compile_schedule(arch: str):
    """The compiled schedule kernel for ``arch``, through the JIT cache."""
    key = schedule_key(arch)
    return jit_cache.get_or_compile(key[0], key, lambda: compile_from_key(key))


def launch_schedule(cache_seqlens: torch.Tensor, schedule: torch.Tensor, capacity: int, parts: int) -> None:
    """Fill ``schedule`` (int32, ``schedule_numel(parts, batch)``) on torch's current stream."""
    fn = compile_schedule(target_arch(cache_seqlens.device))
    fn(cache_seqlens, schedule, capacity, parts)
