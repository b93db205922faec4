"""What both MLA decode kernel classes share (``sm80/mla_decode.py``, ``sm90/mla_decode.py``):
their runtime argument list, their compilation from a compile key, the work of one CTA, and
a loading thread's share of a KV tile's gather (``MlaGather``; an FP8 cache: ``MlaFp8Staging``).

The launcher (``backend_kit.mla_entry_points``) calls a compiled kernel with the tensors
and scalars of ``MlaArgs``, in that order, then the stream; ``cute_utils.compile_mla``
compiles it on fakes of the same list. A kernel class binds ``__call__ = mla_call`` and
implements ``launch(args, stream)``: the list is written once, here, and travels as one
value (into the ``@cute.kernel`` too). As for the forward kernels (``fwd_kernel.py``), no
base class: the kernels share this entry point and helpers, never a mainloop.

The work of a CTA (``MlaTile``): ``tile_m`` packed rows (query position x head, heads
fastest: ``pack_gqa`` over one KV head) of one sequence [and one KV split], and the KV
blocks it walks from the last to the first. The sequence length is clamped to the page
table's capacity (``SeqlenInfo``), so a bad ``cache_seqlens`` never walks past the table;
page ids are clamped where rows are gathered (``paged_kv.page_and_row``).

Head counts. The rows of a KV head are its ``g`` query heads x the query positions, g any
count (1 to 128; the key holds it, ``keys.mla_heads_key``): ``ceil(seqlen_q * g / tile_m)``
tiles, the last one partial. Its rows past ``rows_valid`` are never stored (O and LSE
stores are predicated), their Q rows are a copy of the last valid row (SM80) or zeros
(SM90), so their scores are finite, and the causal limit is each row's own query position
(``pack_gqa.query_of_row``): no host-side padding of q or out. Caches with a KV-head mode
(FlashMLA's ``(num_pages, page_size, h_kv, d)``, h_kv > 1) put the KV heads on the grid's
head mode; each CTA takes its head's 3-D slices of the caches and its descale column
(``MlaArgs.for_kv_head``), so the gathers and the mainloops are those of one latent head.
"""

from dataclasses import dataclass, fields, replace
from typing import Callable, NamedTuple, Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from flash_attn_cute.device.block_info import BlockInfo
from flash_attn_cute.host.constants import D_CKV, D_KPE
from flash_attn_cute.device.copy_utils import copy_row, copy_rows, gmem_tiled_copy, swizzle_atom_cols, widen_fp8
from flash_attn_cute.device.cute_utils import CUTE_DTYPE_BY_NAME, compile_mla
from flash_attn_cute.device.fwd_kernel import FwdTile
from flash_attn_cute.device.layout_utils import row_major_smem_layout
from flash_attn_cute.host.keys import parse_mla_key
from flash_attn_cute.host.mla_schedule import ITEM_FIELDS
from flash_attn_cute.device.paged_kv import page_lookups
from flash_attn_cute.device.seqlen_info import SeqlenInfo
from flash_attn_cute.device.tile_scheduler import SingleTileScheduler, TileDivisors, WorkTile
from flash_attn_cute.device.user_variant_kernel import make_variant
from flash_attn_cute.device.variants import AttnCtx, VariantParams, cp_ctx


class MlaArgs(NamedTuple):
    """The runtime arguments of both MLA kernels."""

    mQn: cute.Tensor  # q_nope (b, s_q, h, 512)
    mQp: cute.Tensor  # q_pe (b, s_q, h, 64)
    # latent cache (num_pages, page_size, 512): K's first 512 columns and V; with a KV-head
    # mode (num_pages, page_size, h_kv, 512)
    mCkv: cute.Tensor
    mKpe: cute.Tensor  # rotary keys (num_pages, page_size[, h_kv], 64)
    mO: cute.Tensor  # (b, s_q, h, 512); split: (num_splits, ...) fp32
    mLSE: Optional[cute.Tensor]  # (b, h, s_q); split: (num_splits, ...)
    mSeqlens: cute.Tensor  # cache lengths (b,) int32
    mPageTable: cute.Tensor  # (b, max_pages) int32
    # an FP8 cache: fp32 (b,) [(b, h_kv) with a KV-head mode], the stored values' factor; else None
    mKvDescale: Optional[cute.Tensor]
    mQDescale: Optional[cute.Tensor]  # FP8 queries: fp32 (b,) [(b, h_kv)], their factor; else None
    # context parallelism (as the forward's ``FwdArgs``): the global lengths (b,), and rank,
    # world and interleave (3,)
    mCpTotSeqlenK: Optional[cute.Tensor]
    mCpInfo: Optional[cute.Tensor]
    # A device-computed schedule (``kernels/mla_schedule.py``; SM90 TMA kernel): int32, its
    # work items then the combine's per-sequence slots; fp32 partials (slots, b, s_q, h, 512)
    # and (slots, b, h, s_q), of batch stride 0 (a slot is one piece of one sequence), for
    # the items of a sequence in several pieces; mO / mLSE for the others. Else None.
    mSchedule: Optional[cute.Tensor]
    mOPartial: Optional[cute.Tensor]
    mLSEPartial: Optional[cute.Tensor]
    softmax_scale: Float32
    num_splits: Int32  # splits; with a schedule, its partial slots (2 x its parts)
    max_seqlen_q: Int32
    batch_size: Int32

    def num_items(self) -> Int32:
        """The schedule's work items, the grid's outer mode (``mla_schedule.max_items``)."""
        return self.num_splits // 2 + self.batch_size

    def num_m_blocks(self, tile_m: int, qhead_per_kvhead: int) -> Int32:
        """M blocks of ``tile_m`` packed rows (query position x head of one KV head) per
        sequence: the grid's x."""
        return cute.ceil_div(self.max_seqlen_q * qhead_per_kvhead, tile_m)

    @property
    def kv_heads(self) -> bool:
        """The caches have a KV-head mode (static: the tensors' rank)."""
        return cute.rank(self.mCkv) == 4

    def num_kv_heads(self):
        """The grid's head mode: the caches' KV heads, 1 for one latent head."""
        return self.mCkv.shape[2] if self.kv_heads else 1

    def for_kv_head(self, head_kv) -> "MlaArgs":
        """These arguments with the caches and the descale of KV head ``head_kv``: 3-D caches
        (num_pages, page_size, d) and a (b,) descale, what the loads read; unchanged for
        one latent head."""
        if not self.kv_heads:
            return self
        head = lambda d: None if d is None else d[None, head_kv]
        return self._replace(mCkv=self.mCkv[None, None, head_kv, None], mKpe=self.mKpe[None, None, head_kv, None],
                             mKvDescale=head(self.mKvDescale), mQDescale=head(self.mQDescale))


def set_mla_config(kernel, dtype, qhead_per_kvhead: int, causal, is_split, split_blocks: int) -> None:
    """The static configuration both MLA kernel classes hold, set on ``kernel``
    (``split_blocks``: as the forward kernels', ``fwd_kernel.set_fwd_config``; ``causal``:
    a bool, or ``"cp"``: causal over a context-parallel shard; ``is_split`` a bool, or
    ``"schedule"``: work items from a device-computed schedule, each writing the output or
    a partial, ``MlaArgs.mSchedule``)."""
    kernel.scheduled = is_split == "schedule"
    is_split = is_split is True
    kernel.dtype = dtype
    # split partials are fp32; FP8 queries give bf16 (FlashMLA's FP8 mode)
    kernel.out_dtype = Float32 if is_split else (cutlass.BFloat16 if dtype.width == 8 else dtype)
    kernel.qhead_per_kvhead_packed = qhead_per_kvhead  # the query heads of a KV head ride its rows
    kernel.variant = make_variant(bool(causal), False, False, None, "cp" if causal == "cp" else None)
    kernel.is_split = is_split
    kernel.split_blocks = split_blocks


@cute.jit
def mla_call(self, mQn: cute.Tensor, mQp: cute.Tensor, mCkv: cute.Tensor, mKpe: cute.Tensor, mO: cute.Tensor,
             mLSE: Optional[cute.Tensor], mSeqlens: cute.Tensor, mPageTable: cute.Tensor,
             mKvDescale: Optional[cute.Tensor], mQDescale: Optional[cute.Tensor], mCpTotSeqlenK: Optional[cute.Tensor],
             mCpInfo: Optional[cute.Tensor], mSchedule: Optional[cute.Tensor], mOPartial: Optional[cute.Tensor],
             mLSEPartial: Optional[cute.Tensor],
             softmax_scale: Float32, num_splits: Int32, max_seqlen_q: Int32, batch_size: Int32, stream):
    """The compiled entry point of both MLA kernel classes (``__call__ = mla_call``):
    ``MlaArgs`` in order, then the stream, handed to the class's ``launch(args, stream)``."""
    self.launch(MlaArgs(mQn, mQp, mCkv, mKpe, mO, mLSE, mSeqlens, mPageTable, mKvDescale, mQDescale, mCpTotSeqlenK,
                        mCpInfo, mSchedule, mOPartial, mLSEPartial, softmax_scale, num_splits, max_seqlen_q,
                        batch_size), stream)


def compile_mla_from_key(key: tuple, make_kernel: Callable):
    """Compiles an MLA kernel for a compile key (``keys.mla_key``) on fake tensors (no GPU
    needed): ``make_kernel(dtype, qhead_per_kvhead, causal, is_split, split_blocks, *config)``
    builds the kernel object, ``config`` being the key's backend fields. The dtype field is
    q's, then ``/`` and the cache's for an FP8 cache (``keys.dtype_key``); the heads field
    says whether the caches have a KV-head mode (``keys.mla_heads_key``)."""
    f = parse_mla_key(key)
    q_name, _, kv_name = f.dtype_name.partition("/")
    dtype = CUTE_DTYPE_BY_NAME[q_name]
    kernel = make_kernel(dtype, f.qhead_per_kvhead, f.causal, f.is_split, f.split_blocks, *f.config)
    return compile_mla(kernel, dtype, f.qhead_per_kvhead, f.arch, is_split=f.is_split, has_lse=f.has_lse,
                       kv_dtype=CUTE_DTYPE_BY_NAME[kv_name or q_name], kv_heads=f.kv_heads,
                       cp=f.causal == "cp", scheduled=f.is_split == "schedule")


@dataclass(frozen=True)
class MlaTile(FwdTile):
    """A forward tile (``FwdTile``: rows, split, KV range [n_block_min, n_block_max)) with
    what the MLA kernels' single KV loop reads: the number of blocks it visits, and the
    unmasked run [n_mid_lo, n_mid_hi) of ``BlockInfo.get_n_block_runs`` (blocks outside it
    take the sequence-end and causal masks). The query heads of a KV head are packed over
    it: ``head_kv`` the grid's head (with a KV-head mode; also the context's head, as under
    the forward's pack_gqa), else 0, the one latent head."""

    n_tiles: Int32
    n_mid_hi: Int32
    n_mid_lo: Int32

    @staticmethod
    @cute.jit
    def create(args: MlaArgs, block_info: BlockInfo, is_split: cutlass.Constexpr[bool],
               divisors: TileDivisors) -> "MlaTile":
        """This CTA's tile from the grid position (``SingleTileScheduler``, ``divisors`` the
        kernel's ``tile_divisors`` argument); ``block_info`` carries the kernel's tile
        shape, the heads packed per query position and the variant (causal or none: MLA has
        no window or softcap). With a schedule (``args.mSchedule``) the grid's outer index
        is a work item: its sequence, its KV blocks [lo, hi) (within the tile's own range)
        and its partial slot as ``split_idx`` (-1: it writes the output); an item past the
        last has no rows."""
        scheduled = cutlass.const_expr(args.mSchedule is not None)
        work = SingleTileScheduler.get_work(divisors, args.num_items() if scheduled else args.batch_size)
        item_batch, lo, hi, slot = work.batch, Int32(0), Int32(0), Int32(0)
        if cutlass.const_expr(scheduled):
            row = ITEM_FIELDS * work.batch
            item_batch, lo, hi, slot = (args.mSchedule[row], args.mSchedule[row + 1], args.mSchedule[row + 2],
                                        args.mSchedule[row + 3])
            # A schedule made for another batch (a wrong result, as stale lengths give) never
            # reads or writes out of bounds: items naming no sequence of this call or no partial
            # slot of its buffer compute nothing.
            live = item_batch >= 0 and item_batch < args.batch_size and slot < args.num_splits
            work = WorkTile(work.m_block, work.head, Int32(0), cutlass.min(cutlass.max(item_batch, 0),
                                                                           args.batch_size - 1), work.in_batch)
        capacity = args.mPageTable.shape[1] * args.mCkv.shape[1]
        seqlen = SeqlenInfo.create(work.batch, args.mQn.shape[1], capacity, None, None, args.mSeqlens, capacity)
        no_window = VariantParams(Int32(-1), Int32(0), Float32(0.0), Float32(0.0))
        head_kv = work.head if cutlass.const_expr(args.kv_heads) else Int32(0)
        ctx = AttnCtx(work.batch, head_kv, seqlen.seqlen_q, seqlen.seqlen_k, no_window,
                      cp=cp_ctx(args.mCpInfo, args.mCpTotSeqlenK, work.batch))
        tile = FwdTile.of_work(work, ctx, seqlen, head_kv, args.softmax_scale, args.num_splits, block_info,
                               is_split and not scheduled)
        if cutlass.const_expr(scheduled):
            rows_valid = tile.rows_valid if live else Int32(0)
            tile = replace(tile, split_idx=slot, rows_valid=rows_valid,
                           n_block_min=cutlass.max(tile.n_block_min, lo),
                           n_block_max=cutlass.min(tile.n_block_max, hi))
        n_mid_hi, n_mid_lo = tile.n_block_runs(block_info)
        return MlaTile(*(getattr(tile, f.name) for f in fields(FwdTile)),
                       cutlass.max(tile.n_block_max - tile.n_block_min, 0), n_mid_hi, n_mid_lo)

    def with_kv_descale(self, args: MlaArgs) -> "MlaTile":
        """An FP8 cache: the softmax scale times ``kv_descale[b]`` (the scores scale with the
        stored keys), and FP8 queries' ``q_descale[b]``; the tile itself otherwise."""
        scale = self.softmax_scale
        if args.mKvDescale is not None:
            scale = scale * args.mKvDescale[self.ctx.batch]
        if args.mQDescale is not None:
            scale = scale * args.mQDescale[self.ctx.batch]
        return self if args.mKvDescale is None and args.mQDescale is None else replace(self, softmax_scale=scale)

    @cute.jit
    def descale_o(self, args: MlaArgs, acc_O: cute.Tensor):
        """An FP8 cache: O (registers) times ``kv_descale[b]`` (V is the stored values times it)."""
        if cutlass.const_expr(args.mKvDescale is not None):
            acc_O.store(acc_O.load() * args.mKvDescale[self.ctx.batch])


@cute.jit
def load_q_rows(tile: "MlaTile", sQn: cute.Tensor, sQp: cute.Tensor, args: MlaArgs, dtype,
                qhead_per_kvhead: cutlass.Constexpr[int], tile_m: cutlass.Constexpr[int],
                num_threads: cutlass.Constexpr[int], tidx):
    """The tile's Q rows (q_nope into ``sQn``, q_pe into ``sQp``) by cp.async of
    ``num_threads`` threads: packed rows form no TMA box. Rows past the tile's last query
    are zero-filled (finite scores for rows never stored). The caller commits, waits and
    fences the copies (wgmma reads them through the async proxy) and meets its threads."""
    row0 = tile.m_block * tile_m
    for mQ, sQ, cols in ((args.mQn, sQn, D_CKV), (args.mQp, sQp, D_KPE)):
        copy_Q = gmem_tiled_copy(dtype, cols, num_threads)
        thr_Q = copy_Q.get_slice(tidx)
        tQsQ, tQcQ = thr_Q.partition_D(sQ), thr_Q.partition_S(cute.make_identity_tensor((tile_m, cols)))
        q_rows = tile.q_rows(mQ, qhead_per_kvhead, False)
        copy_rows(copy_Q, tQsQ, tQcQ, lambda row, m: q_rows[row0 + row, None], tile.rows_valid)


@dataclass(frozen=True)
class MlaGather:
    """A 16-bit latent cache, one loading thread's share of a KV tile's row gather: its
    16-byte chunks of ckv and kpe (128-bit cp.async), the same keys for both (both copies
    lay 8 threads along a row of 64-column swizzle atoms), so one page lookup per key
    serves both. ``lookup`` and ``issue`` are split so that a kernel can load the page
    table before it waits for a free stage."""

    copy_C: cute.TiledCopy
    copy_Kp: cute.TiledCopy
    tCcC: cute.Tensor  # (CPY, rows, chunks) coordinates of this thread's ckv chunks
    tKcKp: cute.Tensor
    tCsC: cute.Tensor  # (CPY, rows, chunks, stages) its chunks of the stages
    tKsKp: cute.Tensor

    @staticmethod
    def create(sC, sKp, dtype, num_threads: int, tidx) -> "MlaGather":
        """``sC``/``sKp``: the stages (tile_n, cols, stages); ``num_threads`` loading threads."""
        copy_C, copy_Kp = gmem_tiled_copy(dtype, D_CKV, num_threads), gmem_tiled_copy(dtype, D_KPE, num_threads)
        thr_C, thr_Kp = copy_C.get_slice(tidx), copy_Kp.get_slice(tidx)
        rows = cute.size(sC, mode=[0])
        return MlaGather(copy_C, copy_Kp, thr_C.partition_S(cute.make_identity_tensor((rows, D_CKV))),
                         thr_Kp.partition_S(cute.make_identity_tensor((rows, D_KPE))),
                         thr_C.partition_D(sC), thr_Kp.partition_D(sKp))

    @cute.jit
    def lookup(self, tile, args: MlaArgs, i, tile_n: cutlass.Constexpr):
        """(pages, rows in page) of this thread's keys of tile i (KV block n_block_max - 1 -
        i), loaded together. Rows past the sequence end re-read the last key: finite, and
        their scores are masked to -inf (so only cp.async writes a stage)."""
        return page_lookups(args.mPageTable, tile.ctx.batch, self.tCcC, (tile.n_block_max - 1 - i) * tile_n,
                            tile.ctx.seqlen_k - 1, 0, cute.size(self.tCsC, mode=[1]),
                            args.mCkv.shape[1], args.mCkv.shape[0])

    @cute.jit
    def issue(self, args: MlaArgs, pages, stage):
        """cp.async of this thread's chunks of the tile ``lookup`` gave ``pages`` for, into
        ``stage``."""
        tPrPage, tPrRow = pages
        for m in cutlass.range_constexpr(cute.size(self.tCsC, mode=[1])):
            copy_row(self.copy_C, self.tCsC[None, m, None, stage], self.tCcC[None, m, None],
                     args.mCkv[tPrPage[m], tPrRow[m], None])
            copy_row(self.copy_Kp, self.tKsKp[None, m, None, stage], self.tKcKp[None, m, None],
                     args.mKpe[tPrPage[m], tPrRow[m], None])


# Chunks a loading thread widens at once: their loads are issued before the first store (the
# compiler keeps a shared load below a possibly aliasing shared store), 4 + 8 registers each.
# SM80: one at a time spilled more of the O warps' scalars (27 local-memory instructions
# against 23, fp16/e5m2, 16 heads).
WIDEN_GROUP = 3


@dataclass(frozen=True)
class MlaFp8Staging:
    """An FP8 latent cache, one loading thread's share: it gathers its own 16-byte chunks
    of a KV tile (one key: 8 of ckv, 1 of kpe, one page lookup; 16 fp8 values a chunk, 4
    threads along a 64-column row slice, so 128 threads cover 32 keys) by cp.async into
    an fp8 staging tile, and, once ``cp.async.wait_group`` says they landed, widens
    exactly those chunks into the 16-bit stage the MMAs read. The chunks are private to
    the thread: no barrier among the loading threads, only the caller's signal to the
    MMA warps (and, for wgmma, its proxy fence) after ``widen``."""

    copy_C8: cute.TiledCopy
    copy_Kp8: cute.TiledCopy
    tCcC: cute.Tensor  # (CPY, 1, chunks) coordinates of this thread's ckv chunks
    tKcKp: cute.Tensor
    tCs8: cute.Tensor  # (CPY, 1, chunks, staging) its staging chunks
    tKs8: cute.Tensor
    tCs16: cute.Tensor  # (CPY, 1, chunks, stages) the same chunks of the 16-bit stages
    tKs16: cute.Tensor

    @staticmethod
    def smem(kv_dtype, tile_n: int, stages: int) -> tuple:
        """(ckv layout, kpe layout, ckv field, kpe field) of the staging in a kernel's shared
        storage: fp8 rows byte-swizzled (the 16-byte chunks written and read back stay
        whole), ``stages`` deep; a 16-bit cache (``stages`` 0) gets 16-byte stand-ins."""
        layouts = tuple(row_major_smem_layout(kv_dtype, tile_n, cols, max(stages, 1)) for cols in (D_CKV, D_KPE))
        fields = tuple(cute.struct.Align[cute.struct.MemRange[kv_dtype, cute.cosize(layout)], 1024] if stages
                       else cute.struct.MemRange[kv_dtype, 16] for layout in layouts)
        return (*layouts, *fields)

    @staticmethod
    def create(args: MlaArgs, sC8, sKp8, sC, sKp, dtype, num_threads: int, tidx) -> "MlaFp8Staging":
        """``sC8``/``sKp8``: the staging (tile_n, cols, staging stages) in fp8; ``sC``/``sKp``:
        the 16-bit stages; ``num_threads`` loading threads (tile_n = num_threads / 4 keys)."""
        kv_dtype = args.mCkv.element_type
        copy_C8, copy_Kp8 = gmem_tiled_copy(kv_dtype, D_CKV, num_threads), gmem_tiled_copy(kv_dtype, D_KPE, num_threads)
        thr_C8, thr_Kp8 = copy_C8.get_slice(tidx), copy_Kp8.get_slice(tidx)
        thr_C16 = _chunks_copy(dtype, D_CKV, num_threads).get_slice(tidx)
        thr_Kp16 = _chunks_copy(dtype, D_KPE, num_threads).get_slice(tidx)
        rows = cute.size(sC8, mode=[0])
        assert rows * 4 == num_threads, "one key a loading thread (gather, widen and lookup touch partition row 0)"
        return MlaFp8Staging(copy_C8, copy_Kp8, thr_C8.partition_S(cute.make_identity_tensor((rows, D_CKV))),
                             thr_Kp8.partition_S(cute.make_identity_tensor((rows, D_KPE))),
                             thr_C8.partition_D(sC8), thr_Kp8.partition_D(sKp8),
                             thr_C16.partition_D(sC), thr_Kp16.partition_D(sKp))

    @cute.jit
    def lookup(self, tile, args: MlaArgs, i, tile_n: cutlass.Constexpr):
        """(page, row) of this thread's key of tile i (KV block n_block_max - 1 - i): a load
        of the page table, issued a step before ``issue`` needs it so that its latency
        overlaps the widening. Rows past the sequence end re-read the last key: finite, and
        their scores are masked to -inf. ``i`` is a tile of the range, or -1 (a CTA without
        tiles: its sequence's last key, or key 0 for an empty sequence, never a table
        entry before the first; the API launches nothing for a zero capacity)."""
        last = cutlass.max(tile.ctx.seqlen_k - 1, 0)
        tPrPage, tPrRow = page_lookups(args.mPageTable, tile.ctx.batch, self.tCcC, (tile.n_block_max - 1 - i) * tile_n,
                                       last, 0, 1, args.mCkv.shape[1], args.mCkv.shape[0])
        return tPrPage[0], tPrRow[0]

    @cute.jit
    def issue(self, args: MlaArgs, i, page, row):
        """cp.async of this thread's chunks of tile i (its key at ``page``, ``row``) into
        staging tile i % staging stages."""
        slot = i % cute.size(self.tCs8, mode=[3])
        copy_row(self.copy_C8, self.tCs8[None, 0, None, slot], self.tCcC[None, 0, None], args.mCkv[page, row, None])
        copy_row(self.copy_Kp8, self.tKs8[None, 0, None, slot], self.tKcKp[None, 0, None], args.mKpe[page, row, None])

    @cute.jit
    def widen(self, slot, stage, dtype):
        """This thread's chunks of staging tile ``slot`` into 16-bit stage ``stage``,
        ``WIDEN_GROUP`` at a time (``copy_utils.widen_fp8``)."""
        widen_fp8(self.tCs8[None, None, None, slot], self.tCs16[None, None, None, stage], dtype, group=WIDEN_GROUP)
        widen_fp8(self.tKs8[None, None, None, slot], self.tKs16[None, None, None, stage], dtype, group=WIDEN_GROUP)


def _chunks_copy(dtype, cols: int, num_threads: int) -> cute.TiledCopy:
    """The 16-bit twin of ``gmem_tiled_copy(fp8, cols, num_threads)``: the same thread
    layout, 16 values a thread and chunk, so a thread's chunks of a 16-bit tile are the
    widened values of its fp8 chunks."""
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=128)
    per_row = swizzle_atom_cols(cols) // 16
    thr = cute.make_layout((num_threads // per_row, per_row), stride=(per_row, 1))
    return cute.make_tiled_copy_tv(atom, thr, cute.make_layout((1, 16)))

