"""KV-cache append with rotary embedding: the step before every ``flash_attn_with_kvcache``.

One launch writes the new tokens into the cache, rotates q and the new k at their absolute
positions, and writes the per-sequence metadata the attention then reads:

  - k_cache[row(b), p] = rotary(k_new[b, t], p)  and  v_cache[row(b), p] = v_new[b, t],
    p = cache_seqlens[b] + t, for every new token t with 0 <= p < capacity (others are
    dropped); paged caches: page page_table[b, p // page_size], row p % page_size;
  - q_out[b, i] = rotary(q[b, i], cache_seqlens[b] + (i if q_positions_per_query else 0));
  - seqused_out[b] = end - leftpad, end = clamp(cache_seqlens[b] + s_new, 0, capacity),
    leftpad = clamp(cache_leftpad[b], 0, end) (0 without cache_leftpad);
  - k_offsets_out[b] = row(b) * s_cache + leftpad and k_offsets_out[batch] = 0, only for
    contiguous caches with cache_batch_idx or cache_leftpad: the attention then reads the
    flattened (b_cache * s_cache, h_kv, d) cache with cu_seqlens_k = k_offsets_out and
    seqused_k = seqused_out. A paged cache with cache_leftpad gets seqused_out only: the
    attention reads its pages from each sequence's start (``FwdArgs.mLeftpadK``).

Rotary over the first rotary_dim channels, in fp32, rounded once: interleaved (GPT-J) pairs
(x[2i], x[2i+1]), otherwise (GPT-NeoX) pairs (x[i], x[i + rotary_dim / 2]), each rotated by
cos / sin of column i of row clamp(position, 0, seqlen_ro - 1) of rotary_cos / rotary_sin.
Positions are absolute cache positions, with cache_leftpad too (FA2's convention).

FP8 (the key's dtype field, ``append_key``): the caches may be e4m3 / e5m2, with new tokens
in the 16-bit dtype or in the cache's own; q may be e4m3 (FP8 attention, with e4m3 caches).
A value written into an fp8 row is computed in fp32 and stored as fp8(x / descale) (IEEE
division, then cvt.rn.satfinite: round to nearest even, saturating at the format's largest
finite value, 448 / 57344; NaN stays NaN), descale = k_descale[b, h_kv] / v_descale[b,
h_kv] for the caches, q_descale[b, h // (h / h_kv)] for q. An fp8 source that is rotated
(new k with rotary, e4m3 q) is read as x8 * descale first; fp8 channels that are not
rotated (all of v, k without rotary, the channels past rotary_dim) are copied bit for bit.
fp8 rows move in 64-bit accesses (8 values, the chunk of a 16-bit item), 16-bit ones in
128-bit ones.

Launch contract (``append_launcher(...)`` returns ``fn``; torch's current stream, no host
sync, no allocation: CUDA-graph capturable)::

    fn(q, k_new, v_new, k_cache, v_cache, cache_seqlens, page_table, cache_batch_idx,
       cache_leftpad, rotary_cos, rotary_sin, q_out, seqused_out, k_offsets_out,
       cu_seqlens_q, cu_seqlens_k_new, q_descale, k_descale, v_descale)

  q, q_out          (b, sq, h, d) (varlen: (total_q, h, d)), or both None when the key has
                    no q; q_out may be q itself (each thread reads its chunks before
                    writing them)
  k_new, v_new      (b, s_new, h_kv, d) and (b, s_new, h_kv, d_v) (varlen: (total_new,
                    h_kv, d) and (total_new, h_kv, d_v)), or both None
  k_cache, v_cache  (b_cache, s_cache, h_kv, d*) or paged (num_pages, page_size, h_kv, d*);
                    always given (they define the capacity)
  cache_seqlens     (b,) int32, always given; seqused_out (b,) int32, always given
  page_table        (b, max_pages) int32 when paged, else None
  cache_batch_idx   (b,) int32 or None (contiguous caches only)
  cache_leftpad     (b,) int32 or None
  rotary_cos, rotary_sin           (seqlen_ro >= 1, rotary_dim / 2) in the key's 16-bit
                                   dtype, or None when rotary_dim is 0
  k_offsets_out     (b + 1,) int32 when contiguous and (cache_batch_idx or cache_leftpad)
                    is given, else None
  cu_seqlens_q      (b + 1,) int32 in varlen mode with q, else None
  cu_seqlens_k_new  (b + 1,) int32 in varlen mode with new k / v, else None (may be the
                    same tensor as cu_seqlens_q: the query rows are the new rows)
  q_descale         (b, h_kv) fp32 (any strides: a broadcast element has stride 0) with an
                    e4m3 q, else None
  k_descale, v_descale             (b, h_kv) fp32 with new k / v into fp8 caches, else None

Varlen (packed) mode, the ``varlen`` flag of the key (FA3's ``flash_attn_with_kvcache(...,
cu_seqlens_q=, cu_seqlens_k_new=)``, a serving engine's mixed step): new row r of sequence
b (cu_seqlens_k_new[b] <= r < cu_seqlens_k_new[b + 1]) is token t = r - cu_seqlens_k_new[b]
of b, placed and rotated at p = cache_seqlens[b] + t as above; query row r of sequence b is
rotated at cache_seqlens[b] + (r - cu_seqlens_q[b]) with q_positions_per_query, else at
cache_seqlens[b]; s_new of sequence b (for seqused_out) is its count of new rows. The
cumulative lengths are device data too, never trusted: a row's sequence is found by a
search that reads only entries 0..min(len(cu) - 1, b), then checked to hold the row
(rows outside every sequence, or not found because the lengths are not monotone, are not
written: q_out keeps what it held there); offsets count from max(cu[b], 0), and the
counts for seqused_out are max(c[b + 1] - c[b], 0) with c the entries clamped into [0,
total rows]. ``flash_attn_cute.testing.varlen_rows_ref`` is the search, step for step.

Last dims contiguous; the other strides and the base addresses 16-byte aligned. Shapes are
the caller's to validate (the public API does); device data never is trusted: cache rows,
page ids and rotary rows are clamped into their tensors and positions outside the cache
are not written, so wrong values give wrong results, never an access out of bounds. Sizes
(the caller's to check, on the host): q, k_new and v_new together below 2^31 16-byte
chunks (32 GiB), capacities and rotary tables below 2^30 rows, tokens per sequence (and
packed rows) below 2^30, b_cache * s_cache below 2^31 (k_offsets_out is int32, as is the
attention's cu_seqlens_k).

Bytes per appended token (16-bit dtype): k and v are read once and written once,
4 * h_kv * (d + d_v) bytes (8 KiB at h_kv = 8, d = d_v = 128); each query token adds
4 * h * d bytes for q -> q_out, and each distinct position 2 * rotary_dim bytes of
cos / sin (shared by all heads of that token, so they come from L1 / L2). Into an FP8
cache 16-bit tokens take 3 * h_kv * (d + d_v) bytes (a 4-byte descale per (token, head)
besides, from L1).

Design. The work is pure data movement, so the kernel is a flat, memory-bound SIMT copy:
every thread owns one 16-byte chunk of one (token, head) row of q, k or v (two chunks,
the two halves of its rotary pairs, for GPT-NeoX), loads it with one 128-bit load, rotates
it in fp32 registers and stores it with one 128-bit store. No shared memory, no
cooperation between threads: a decode step (s_new = 1) is one launch of
about b * (h * d + h_kv * (d + d_v)) / 8 threads, short enough that its cost is the launch
and two dependent DRAM round trips (cache_seqlens, then cos / sin or the page id). The
flat thread index runs over [q | k | v] segments (row-major over (b, t, head, chunk), so
consecutive threads touch consecutive bytes), with the batch on grid x: any batch size.
Divisions by runtime sizes are FastDivmod multiplications set up once on the host side of
the launch. Varlen: a segment runs over (packed row, head, chunk); each thread finds its
row's sequence once, in the cumulative lengths: a first probe at the sequence the row
would be in if every earlier sequence had one row (decode rows, found with two independent
loads), else a bisection (about log2(b) dependent 4-byte loads from L1 / L2, since the
threads of a warp share one or two rows), the only loop of the kernel. Measured on an
H200 (CUDA-graph replays, h = 32, h_kv = 8, d = 128, paged 64; b = 200,000: h = 8,
h_kv = 1): a varlen decode step costs what the dense one does (b = 128: 2.33 against
2.20 us; 4096: 30.5 against 30.5; 200,000: 261 against 274), rows that need the
bisection add 0.6 us at b = 128, 2.6 at 4096 and ~90 at 200,000 (18 dependent loads and
18 load instructions per warp: the cost a bisection alone gave every decode step); a
mixed step of 4,044 rows over 64 sequences moves 3.3 TB/s.
"""

from typing import Optional, Type

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from flash_attn_cute.host import jit_cache
from flash_attn_cute.device.cute_utils import CUTE_DTYPE_BY_NAME, compile_options, fake_stream, fake_tensor
from flash_attn_cute.host.keys import DTYPE_NAMES, arch_capability, target_arch

# The fp8 formats a cache may hold (e4m3 also for FP8 attention's q).
FP8_TYPES = (cutlass.Float8E4M3FN, cutlass.Float8E5M2)

# Positions are clamped into [-POS_LIMIT, POS_LIMIT] before any arithmetic: cache_seqlens
# + token index can then never overflow int32, whatever cache_seqlens holds.
POS_LIMIT = 1 << 30


class KVAppendRotary:
    def __init__(
        self,
        dtype: Type[cutlass.Numeric],
        head_dim: int,
        head_dim_v: int,
        rotary_dim: int,
        interleaved: bool,
        q_positions_per_query: bool,
        paged: bool,
        varlen: bool = False,
        num_threads: int = 128,
        q_dtype: Optional[Type[cutlass.Numeric]] = None,
        new_dtype: Optional[Type[cutlass.Numeric]] = None,
        cache_dtype: Optional[Type[cutlass.Numeric]] = None,
    ):
        # ``dtype``: the 16-bit type of the rotary tables and of every 16-bit operand; q,
        # the new tokens and the caches may instead be fp8 (``q_dtype`` e4m3: FP8
        # attention; ``cache_dtype`` e4m3 / e5m2 with new tokens in ``dtype`` or in it).
        assert dtype in (cutlass.Float16, cutlass.BFloat16), dtype
        self.dtype = dtype
        self.q_dtype = q_dtype or dtype
        self.cache_dtype = cache_dtype or dtype
        self.new_dtype = new_dtype or dtype
        assert self.cache_dtype in (dtype, *FP8_TYPES), self.cache_dtype
        assert self.new_dtype in (dtype, self.cache_dtype), (self.new_dtype, self.cache_dtype)
        assert self.q_dtype == dtype or (self.q_dtype == cutlass.Float8E4M3FN == self.cache_dtype), self.q_dtype
        # Elements of one item's chunk: 16 bytes of a 16-bit row (8 bytes of an fp8 one).
        self.vec = 128 // dtype.width
        assert head_dim % self.vec == 0 and head_dim_v % self.vec == 0, (head_dim, head_dim_v)
        # A multiple of 16: a NeoX half (rotary_dim / 2) is whole chunks, so a thread's two
        # partner chunks are both 16-byte aligned, and so are its cos / sin columns.
        assert rotary_dim % 16 == 0 and 0 <= rotary_dim <= head_dim, rotary_dim
        self.head_dim, self.head_dim_v, self.rotary_dim = head_dim, head_dim_v, rotary_dim
        self.interleaved = interleaved and rotary_dim > 0
        self.neox = not interleaved and rotary_dim > 0
        self.q_positions_per_query = q_positions_per_query
        self.paged = paged
        self.varlen = varlen
        self.lead = 2 if varlen else 3  # modes before the head mode: (total,) or (b, s)
        self.num_threads = num_threads
        self.rot_chunks = rotary_dim // self.vec
        # NeoX: item j < half owns chunks j and j + half (the two halves of its pairs);
        # the other items own one pass-through chunk each. Interleaved or no rotary: item
        # j owns chunk j (an interleaved chunk holds whole pairs).
        self.half = self.rot_chunks // 2 if self.neox else 0
        self.items_qk = head_dim // self.vec - self.half
        self.items_v = head_dim_v // self.vec

    @cute.jit
    def __call__(
        self,
        mQ: Optional[cute.Tensor],  # (b, sq, h, d)
        mK: Optional[cute.Tensor],  # (b, s_new, h_kv, d)
        mV: Optional[cute.Tensor],  # (b, s_new, h_kv, d_v)
        mKCache: cute.Tensor,  # (b_cache, s_cache, h_kv, d) or (num_pages, page_size, h_kv, d)
        mVCache: cute.Tensor,  # same, d_v
        mSeqlens: cute.Tensor,  # (b,) int32
        mPageTable: Optional[cute.Tensor],  # (b, max_pages) int32
        mBatchIdx: Optional[cute.Tensor],  # (b,) int32
        mLeftpad: Optional[cute.Tensor],  # (b,) int32
        mCos: Optional[cute.Tensor],  # (seqlen_ro, rotary_dim / 2)
        mSin: Optional[cute.Tensor],
        mQOut: Optional[cute.Tensor],  # (b, sq, h, d)
        mSeqused: cute.Tensor,  # (b,) int32
        mKOffsets: Optional[cute.Tensor],  # (b + 1,) int32
        mCuQ: Optional[cute.Tensor],  # (b + 1,) int32, varlen with q
        mCuK: Optional[cute.Tensor],  # (b + 1,) int32, varlen with new k / v
        mQDescale: Optional[cute.Tensor],  # (b, h_kv) fp32, e4m3 q
        mKDescale: Optional[cute.Tensor],  # (b, h_kv) fp32, fp8 caches with new k / v
        mVDescale: Optional[cute.Tensor],
        stream,
    ):
        if const_expr((mQ is None) != (mQOut is None) or (mK is None) != (mV is None)):
            raise ValueError("q and q_out, k_new and v_new come in pairs")
        if const_expr((mCos is None) != (self.rotary_dim == 0) or (mSin is None) != (mCos is None)):
            raise ValueError("rotary_cos / rotary_sin are given exactly when rotary_dim > 0")
        if const_expr((mPageTable is not None) != self.paged):
            raise ValueError("page_table is given exactly for paged caches")
        if const_expr(self.paged and mBatchIdx is not None):
            raise ValueError("cache_batch_idx is for contiguous caches")
        if const_expr((mKOffsets is not None) != (not self.paged and (mBatchIdx is not None or mLeftpad is not None))):
            raise ValueError("k_offsets_out is written exactly for contiguous caches with cache_batch_idx or "
                             "cache_leftpad")
        if const_expr((mCuQ is not None) != (self.varlen and mQ is not None)
                      or (mCuK is not None) != (self.varlen and mK is not None)):
            raise ValueError("cu_seqlens_q / cu_seqlens_k_new are given exactly in varlen mode with q / new k, v")
        if const_expr((mQDescale is not None) != (mQ is not None and self.q_dtype.width == 8)
                      or (mKDescale is not None) != (mK is not None and self.cache_dtype.width == 8)
                      or (mVDescale is not None) != (mKDescale is not None)):
            raise ValueError("q_descale is given exactly with an fp8 q, k_descale / v_descale exactly with new "
                             "k / v into an fp8 cache")
        for what, tensors, dtype in (("q and q_out", (mQ, mQOut), self.q_dtype),
                                     ("k_new and v_new", (mK, mV), self.new_dtype),
                                     ("the caches", (mKCache, mVCache), self.cache_dtype),
                                     ("cos / sin", (mCos, mSin), self.dtype),
                                     ("the descales", (mQDescale, mKDescale, mVDescale), Float32)):
            for t in tensors:
                if const_expr(t is not None and t.element_type != dtype):
                    raise TypeError(f"{what} must be {dtype}, got {t.element_type}")
        # Segment sizes in items: rows x items per row (items_* are compile-time constants).
        # Varlen: the rows are the packed (total, h) rows and the lengths (q_len, s_new)
        # are unused (1).
        n_q, n_kv, s_new = Int32(0), Int32(0), Int32(0)
        q_heads, q_len, kv_heads = Int32(1), Int32(1), Int32(1)
        lead = self.lead
        if const_expr(mQ is not None):
            n_q = cute.size(mQ.shape[:lead]) * self.items_qk
            q_heads = mQ.shape[lead - 1]
            if const_expr(not self.varlen):
                q_len = mQ.shape[1]
        if const_expr(mK is not None):
            n_kv = cute.size(mK.shape[:lead])
            kv_heads = mK.shape[lead - 1]
            if const_expr(not self.varlen):
                s_new = mK.shape[1]
        batch = mSeqlens.shape[0]
        # Every thread index below batch + 1 also writes that entry's metadata.
        total = cutlass.max(n_q + n_kv * (self.items_qk + self.items_v), batch + 1)
        # Divisors of the flat row index and of positions into pages; at least 1, so that
        # an empty segment or cache (never indexed) still makes a valid divisor.
        div_q_heads = cute.fast_divmod_create_divisor_v2(cutlass.max(q_heads, 1))
        div_q_len = cute.fast_divmod_create_divisor_v2(cutlass.max(q_len, 1))
        div_kv_heads = cute.fast_divmod_create_divisor_v2(cutlass.max(kv_heads, 1))
        div_kv_len = cute.fast_divmod_create_divisor_v2(cutlass.max(s_new, 1))
        div_page = cute.fast_divmod_create_divisor_v2(cutlass.max(mKCache.shape[1], 1))
        # e4m3 q: the query heads per KV head, q_descale being per KV head (FA3's layout).
        div_group = None
        if const_expr(mQDescale is not None):
            div_group = cute.fast_divmod_create_divisor_v2(cutlass.max(q_heads // cutlass.max(mKCache.shape[2], 1), 1))
        self.kernel(
            mQ, mK, mV, mKCache, mVCache, mSeqlens, mPageTable, mBatchIdx, mLeftpad, mCos, mSin, mQOut, mSeqused,
            mKOffsets, mCuQ, mCuK, mQDescale, mKDescale, mVDescale, n_q, n_kv, s_new, div_q_heads, div_q_len,
            div_kv_heads, div_kv_len, div_page, div_group,
        ).launch(grid=[cute.ceil_div(total, self.num_threads), 1, 1], block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        mQ: Optional[cute.Tensor],
        mK: Optional[cute.Tensor],
        mV: Optional[cute.Tensor],
        mKCache: cute.Tensor,
        mVCache: cute.Tensor,
        mSeqlens: cute.Tensor,
        mPageTable: Optional[cute.Tensor],
        mBatchIdx: Optional[cute.Tensor],
        mLeftpad: Optional[cute.Tensor],
        mCos: Optional[cute.Tensor],
        mSin: Optional[cute.Tensor],
        mQOut: Optional[cute.Tensor],
        mSeqused: cute.Tensor,
        mKOffsets: Optional[cute.Tensor],
        mCuQ: Optional[cute.Tensor],
        mCuK: Optional[cute.Tensor],
        mQDescale: Optional[cute.Tensor],
        mKDescale: Optional[cute.Tensor],
        mVDescale: Optional[cute.Tensor],
        n_q: Int32,  # items of the q segment
        n_kv: Int32,  # (b, s_new, h_kv) (varlen: (total_new, h_kv)) rows of the k and of the v segment
        s_new: Int32,  # dense only
        div_q_heads: cute.FastDivmodDivisorV2,
        div_q_len: cute.FastDivmodDivisorV2,
        div_kv_heads: cute.FastDivmodDivisorV2,
        div_kv_len: cute.FastDivmodDivisorV2,
        div_page: cute.FastDivmodDivisorV2,
        div_group: Optional[cute.FastDivmodDivisorV2],  # query heads per KV head, e4m3 q only
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        g = bidx * self.num_threads + tidx
        self.write_metadata(g, mK, mKCache, mSeqlens, mPageTable, mBatchIdx, mLeftpad, mSeqused, mKOffsets, mCuK,
                            s_new)
        if const_expr(mQ is not None):
            if g < n_q:
                row, item = g // self.items_qk, g % self.items_qk
                if const_expr(self.varlen):
                    r, head = divmod(row, div_q_heads)
                    b, t, found = self.find_sequence(mCuQ, mSeqlens.shape[0], r)
                    if found:
                        pos = self.start_position(mSeqlens, b)
                        if const_expr(self.q_positions_per_query):
                            pos += t
                        scale = self.q_scale(mQDescale, b, head, div_group)
                        self.rotate_item(mQ[r, head, None], mQOut[r, head, None], item, mCos, mSin, pos, scale,
                                         scale)
                else:
                    bt, head = divmod(row, div_q_heads)
                    b, t = divmod(bt, div_q_len)
                    pos = self.start_position(mSeqlens, b)
                    if const_expr(self.q_positions_per_query):
                        pos += t
                    scale = self.q_scale(mQDescale, b, head, div_group)
                    self.rotate_item(mQ[b, t, head, None], mQOut[b, t, head, None], item, mCos, mSin, pos, scale,
                                     scale)
        if const_expr(mK is not None):
            gk = g - n_q
            n_k = n_kv * self.items_qk
            if gk >= 0 and gk < n_k:
                row, item = gk // self.items_qk, gk % self.items_qk
                if const_expr(self.varlen):
                    r, head = divmod(row, div_kv_heads)
                    b, t, found = self.find_sequence(mCuK, mSeqlens.shape[0], r)
                    if found:
                        pos = self.start_position(mSeqlens, b) + t
                        if self.in_cache(mKCache, mPageTable, pos):
                            gDst = self.cache_row(mKCache, mPageTable, mBatchIdx, b, pos, head, div_page)
                            src_scale, dst_scale = self.kv_scales(mKDescale, b, head, self.rotary_dim > 0)
                            self.rotate_item(mK[r, head, None], gDst, item, mCos, mSin, pos, src_scale, dst_scale)
                else:
                    bt, head = divmod(row, div_kv_heads)
                    b, t = divmod(bt, div_kv_len)
                    pos = self.start_position(mSeqlens, b) + t
                    if self.in_cache(mKCache, mPageTable, pos):
                        gDst = self.cache_row(mKCache, mPageTable, mBatchIdx, b, pos, head, div_page)
                        src_scale, dst_scale = self.kv_scales(mKDescale, b, head, self.rotary_dim > 0)
                        self.rotate_item(mK[b, t, head, None], gDst, item, mCos, mSin, pos, src_scale, dst_scale)
            gv = gk - n_k
            if gv >= 0 and gv < n_kv * self.items_v:
                row, item = gv // self.items_v, gv % self.items_v
                if const_expr(self.varlen):
                    r, head = divmod(row, div_kv_heads)
                    b, t, found = self.find_sequence(mCuK, mSeqlens.shape[0], r)
                    if found:
                        pos = self.start_position(mSeqlens, b) + t
                        if self.in_cache(mVCache, mPageTable, pos):
                            gDst = self.cache_row(mVCache, mPageTable, mBatchIdx, b, pos, head, div_page)
                            _, dst_scale = self.kv_scales(mVDescale, b, head, False)
                            self.copy_chunk(mV[r, head, None], gDst, item, None, dst_scale)
                else:
                    bt, head = divmod(row, div_kv_heads)
                    b, t = divmod(bt, div_kv_len)
                    pos = self.start_position(mSeqlens, b) + t
                    if self.in_cache(mVCache, mPageTable, pos):
                        gDst = self.cache_row(mVCache, mPageTable, mBatchIdx, b, pos, head, div_page)
                        _, dst_scale = self.kv_scales(mVDescale, b, head, False)
                        self.copy_chunk(mV[b, t, head, None], gDst, item, None, dst_scale)

    @cute.jit
    def q_scale(self, mQDescale: Optional[cute.Tensor], b: Int32, head: Int32,
                div_group: Optional[cute.FastDivmodDivisorV2]):
        """q_descale of query head ``head`` of sequence ``b`` (its KV head's), or None for a
        16-bit q. e4m3 q is dequantized, rotated and requantized with it (both scales)."""
        scale = None
        if const_expr(mQDescale is not None):
            head_kv, _ = divmod(head, div_group)
            scale = mQDescale[b, head_kv]
        return scale

    @cute.jit
    def kv_scales(self, mDescale: Optional[cute.Tensor], b: Int32, head: Int32, rotated: cutlass.Constexpr[bool]):
        """(source scale, destination scale) of a new k / v row into the cache: None where
        the side is 16-bit. New tokens in the cache's fp8 dtype are copied as they are,
        unless rotated (k with rotary): then dequantized, rotated and requantized, with the
        same descale (neither side is read for a plain copy)."""
        src_scale, dst_scale = None, None
        if const_expr(mDescale is not None and (rotated or self.new_dtype != self.cache_dtype)):
            dst_scale = mDescale[b, head]
            if const_expr(self.new_dtype == self.cache_dtype):
                src_scale = dst_scale
        return src_scale, dst_scale

    @cute.jit
    def find_sequence(self, mCu: cute.Tensor, batch: Int32, r: Int32):
        """(b, t, found) of packed row ``r`` (0 <= r < the tensor's rows): the sequence b
        whose rows [cu[b], cu[b + 1]) hold r, and t = r - max(cu[b], 0) (in [0, r]).

        First probe: g = min(r, nb - 1), the sequence of r when every sequence before it
        has one row (a decode step; in a mixed step whose decode rows come first, those
        and the last sequence's rows): two independent loads, and most rows are found
        there. Otherwise a bisection over [0, g) or [g + 1, nb) (about log2(batch)
        dependent loads, from L1 / L2: the threads of a warp share one or two rows), then
        a check that the interval found holds r. Untrusted lengths: only entries 0..nb
        are read, nb = min(len(cu) - 1, batch); a row outside every sequence, or that the
        search misses because the lengths are not monotone, is not found."""
        nb = cutlass.min(mCu.shape[0] - 1, batch)
        b, first = Int32(0), Int32(0)
        found = cutlass.Boolean(False)
        if nb > 0:
            g = cutlass.min(r, nb - 1)
            c_g, c_next = mCu[g], mCu[g + 1]
            if c_g <= r and r < c_next:
                b, first = g, c_g
                found = cutlass.Boolean(True)
            else:
                lo, hi = Int32(0), g
                if c_g <= r:  # and c_next <= r: r lies after sequence g
                    lo, hi = g + 1, nb
                while hi - lo > 1:
                    mid = (lo + hi) >> 1
                    if mCu[mid] <= r:
                        lo = mid
                    else:
                        hi = mid
                if lo < hi:
                    b, first = lo, mCu[lo]
                    found = first <= r and r < mCu[lo + 1]
        return b, r - cutlass.max(first, 0), found

    @cute.jit
    def start_position(self, mSeqlens: cute.Tensor, b: Int32) -> Int32:
        return cutlass.max(cutlass.min(mSeqlens[b], POS_LIMIT), -POS_LIMIT)

    @cute.jit
    def capacity(self, mCache: cute.Tensor, mPageTable: Optional[cute.Tensor]) -> Int32:
        if const_expr(self.paged):
            return mPageTable.shape[1] * mCache.shape[1]
        return mCache.shape[1]

    @cute.jit
    def in_cache(self, mCache: cute.Tensor, mPageTable: Optional[cute.Tensor], pos: Int32):
        # Each cache against its own capacity: a v_cache shorter than k_cache still stays
        # in bounds.
        return pos >= 0 and pos < self.capacity(mCache, mPageTable)

    @cute.jit
    def cache_row(
        self,
        mCache: cute.Tensor,
        mPageTable: Optional[cute.Tensor],
        mBatchIdx: Optional[cute.Tensor],
        b: Int32,
        pos: Int32,  # 0 <= pos < capacity
        head: Int32,
        div_page: cute.FastDivmodDivisorV2,
    ) -> cute.Tensor:
        """(d*,) gmem row of token position ``pos`` of sequence ``b`` for ``head``."""
        last = mCache.shape[0] - 1
        if const_expr(self.paged):
            page_idx, r = divmod(pos, div_page)  # page_idx < max_pages since pos < capacity
            page = cutlass.max(cutlass.min(mPageTable[b, page_idx], last), 0)
            return mCache[page, r, head, None]
        cache_b = cutlass.min(b, last)
        if const_expr(mBatchIdx is not None):
            cache_b = cutlass.max(cutlass.min(mBatchIdx[b], last), 0)
        return mCache[cache_b, pos, head, None]

    @cute.jit
    def load_chunk(self, gRow: cute.Tensor, c: Int32, scale: Optional[Float32] = None) -> cute.TensorSSA:
        """Chunk ``c`` of a (d,) gmem row as fp32: one 128-bit load of a 16-bit row (64-bit
        of an fp8 one), times ``scale`` when given (an fp8 row's descale)."""
        rX = cute.make_rmem_tensor((self.vec,), gRow.element_type)
        cute.autovec_copy(cute.flat_divide(gRow, (self.vec,))[None, c], rX)
        x = rX.load().to(Float32)
        if const_expr(scale is not None):
            x = x * scale
        return x

    @cute.jit
    def store_chunk(self, x: cute.TensorSSA, gRow: cute.Tensor, c: Int32, scale: Optional[Float32] = None):
        """fp32 values (divided by ``scale`` when given: an fp8 row's descale) rounded once
        to the row's dtype, one store to chunk ``c``. Into fp8 the rounding is to nearest
        even, saturating at the format's largest finite value (cvt.rn.satfinite)."""
        if const_expr(scale is not None):
            x = x / scale
        rX = cute.make_rmem_tensor((self.vec,), gRow.element_type)
        rX.store(x.to(gRow.element_type))
        cute.autovec_copy(rX, cute.flat_divide(gRow, (self.vec,))[None, c])

    @cute.jit
    def copy_chunk(self, gSrc: cute.Tensor, gDst: cute.Tensor, c: Int32, src_scale: Optional[Float32] = None,
                   dst_scale: Optional[Float32] = None):
        """Chunk ``c`` from one row to another: the bits as they are between rows of one
        dtype, else through fp32 (a 16-bit value quantized into an fp8 cache)."""
        if const_expr(gSrc.element_type == gDst.element_type):
            rX = cute.make_rmem_tensor((self.vec,), gSrc.element_type)
            cute.autovec_copy(cute.flat_divide(gSrc, (self.vec,))[None, c], rX)
            cute.autovec_copy(rX, cute.flat_divide(gDst, (self.vec,))[None, c])
        else:
            self.store_chunk(self.load_chunk(gSrc, c, src_scale), gDst, c, dst_scale)

    @cute.jit
    def load_cos_sin(self, mCos: cute.Tensor, mSin: cute.Tensor, pos: Int32, c: Int32, n: cutlass.Constexpr[int]):
        """Columns [c * n, (c + 1) * n) of cos / sin at row ``pos`` clamped into the table, fp32."""
        row = cutlass.max(cutlass.min(pos, mCos.shape[0] - 1), 0)
        rCos = cute.make_rmem_tensor((n,), self.dtype)
        rSin = cute.make_rmem_tensor((n,), self.dtype)
        cute.autovec_copy(cute.flat_divide(mCos[row, None], (n,))[None, c], rCos)
        cute.autovec_copy(cute.flat_divide(mSin[row, None], (n,))[None, c], rSin)
        return rCos.load().to(Float32), rSin.load().to(Float32)

    @cute.jit
    def rotate_item(
        self,
        gSrc: cute.Tensor,  # (d,) gmem row
        gDst: cute.Tensor,  # (d,) gmem row
        item: Int32,
        mCos: Optional[cute.Tensor],
        mSin: Optional[cute.Tensor],
        pos: Int32,  # absolute position, unclamped
        src_scale: Optional[Float32] = None,  # an fp8 source's descale (dequantized before the rotation)
        dst_scale: Optional[Float32] = None,  # an fp8 destination's descale (quantized after it)
    ):
        if const_expr(self.neox):
            if item < self.half:
                # Pairs (x[i], x[i + rotary_dim / 2]): chunk item and chunk item + half,
                # cos / sin columns of chunk item.
                cos, sin = self.load_cos_sin(mCos, mSin, pos, item, self.vec)
                x0 = self.load_chunk(gSrc, item, src_scale)
                x1 = self.load_chunk(gSrc, item + self.half, src_scale)
                self.store_chunk(x0 * cos - x1 * sin, gDst, item, dst_scale)
                self.store_chunk(x0 * sin + x1 * cos, gDst, item + self.half, dst_scale)
            else:
                self.copy_chunk(gSrc, gDst, item + self.half, src_scale, dst_scale)
        elif const_expr(self.interleaved):
            if item < self.rot_chunks:
                # Pairs (x[2i], x[2i + 1]) inside the chunk: vec / 2 cos / sin columns.
                cos, sin = self.load_cos_sin(mCos, mSin, pos, item, self.vec // 2)
                rX = cute.make_rmem_tensor((self.vec,), Float32)
                rX.store(self.load_chunk(gSrc, item, src_scale))
                rCos = cute.make_rmem_tensor((self.vec // 2,), Float32)
                rSin = cute.make_rmem_tensor((self.vec // 2,), Float32)
                rCos.store(cos)
                rSin.store(sin)
                for i in cutlass.range_constexpr(self.vec // 2):
                    x0, x1 = rX[2 * i], rX[2 * i + 1]
                    rX[2 * i] = x0 * rCos[i] - x1 * rSin[i]
                    rX[2 * i + 1] = x0 * rSin[i] + x1 * rCos[i]
                self.store_chunk(rX.load(), gDst, item, dst_scale)
            else:
                self.copy_chunk(gSrc, gDst, item, src_scale, dst_scale)
        else:
            self.copy_chunk(gSrc, gDst, item, src_scale, dst_scale)

    @cute.jit
    def write_metadata(
        self,
        g: Int32,
        mK: Optional[cute.Tensor],
        mKCache: cute.Tensor,
        mSeqlens: cute.Tensor,
        mPageTable: Optional[cute.Tensor],
        mBatchIdx: Optional[cute.Tensor],
        mLeftpad: Optional[cute.Tensor],
        mSeqused: cute.Tensor,
        mKOffsets: Optional[cute.Tensor],
        mCuK: Optional[cute.Tensor],
        s_new: Int32,
    ):
        batch = mSeqlens.shape[0]
        if g < batch:
            n_new = s_new
            if const_expr(self.varlen and mK is not None):
                # Sequence g's new tokens: cu entries clamped into [0, total_new], a negative
                # length counts 0; entries past the tensor (len(cu) < batch + 1) count 0.
                n_new = Int32(0)
                if g < mCuK.shape[0] - 1:
                    rows = mK.shape[0]
                    lo = cutlass.max(cutlass.min(mCuK[g], rows), 0)
                    hi = cutlass.max(cutlass.min(mCuK[g + 1], rows), 0)
                    n_new = cutlass.max(hi - lo, 0)
            end = self.start_position(mSeqlens, g) + n_new
            end = cutlass.max(cutlass.min(end, self.capacity(mKCache, mPageTable)), 0)
            leftpad = Int32(0)
            if const_expr(mLeftpad is not None):
                leftpad = cutlass.max(cutlass.min(mLeftpad[g], end), 0)
            mSeqused[g] = end - leftpad
            if const_expr(mKOffsets is not None):
                cache_b = cutlass.min(g, mKCache.shape[0] - 1)
                if const_expr(mBatchIdx is not None):
                    cache_b = cutlass.max(cutlass.min(mBatchIdx[g], mKCache.shape[0] - 1), 0)
                mKOffsets[g] = cache_b * mKCache.shape[1] + leftpad
        if const_expr(mKOffsets is not None):
            if g == batch:
                mKOffsets[g] = 0  # the end of the offsets: never read as a length


# ---------------------------------------------------------------------------------------
# Host side: compile key, compilation against fake tensors, launch
# ---------------------------------------------------------------------------------------


def append_key(arch: str, dtype_name: str, d: int, d_v: int, rotary_dim: int, interleaved: bool,
               q_positions_per_query: bool, has_q: bool, has_new_kv: bool, paged: bool, has_batch_idx: bool,
               has_leftpad: bool, varlen: bool = False, q_dtype_name: Optional[str] = None,
               new_dtype_name: Optional[str] = None, cache_dtype_name: Optional[str] = None) -> tuple:
    """``("kv_append", arch, dtype, d, d_v, rotary_dim, interleaved, q_positions_per_query,
    has_q, has_new_kv, paged, has_batch_idx, has_leftpad, varlen)``; flags that change
    nothing (interleaved without rotary, q positions without a rotated q, varlen without
    q or new k / v: then only metadata is written, the same as dense) are normalised to
    False so that they do not make distinct binaries.

    ``dtype`` is the 16-bit type of the rotary tables and of the 16-bit operands
    (``dtype_name``); where q (e4m3), the new tokens or the caches (e4m3 / e5m2) are fp8
    it is ``"<dtype>/<q>/<new k, v>/<caches>"`` (``"bf16/bf16/bf16/e4m3"``: bf16 tokens
    quantized into an e4m3 cache), q's and the new tokens' names normalised to the 16-bit
    one when they are not passed. Paged caches take a leftpad (it only shortens the key
    counts written), never a batch idx."""
    assert not (paged and has_batch_idx), "batch idx is for contiguous caches"
    rotary_dim = int(rotary_dim)
    names = (dtype_name, (q_dtype_name if has_q else None) or dtype_name,
             (new_dtype_name if has_new_kv else None) or dtype_name, cache_dtype_name or dtype_name)
    dtype_field = dtype_name if len(set(names)) == 1 else "/".join(names)
    return ("kv_append", arch, dtype_field, int(d), int(d_v), rotary_dim, bool(interleaved) and rotary_dim > 0,
            bool(q_positions_per_query) and rotary_dim > 0 and bool(has_q), bool(has_q), bool(has_new_kv),
            bool(paged), bool(has_batch_idx), bool(has_leftpad), bool(varlen) and (bool(has_q) or bool(has_new_kv)))


def compile_append(key: tuple):
    """Compile for ``key`` = append_key(...). Pure function of the key: sizes and leading
    strides are symbolic, so no batch, length, head count or page size recompiles."""
    (name, arch, dtype_field, d, d_v, rotary_dim, interleaved, q_per_query, has_q, has_new_kv, paged, has_batch_idx,
     has_leftpad, varlen) = key
    assert name == "kv_append"
    dtype_name, *fp8_names = dtype_field.split("/")
    q_name, new_name, cache_name = fp8_names or (dtype_name,) * 3
    dtype, q_dtype, new_dtype, cache_dtype = (CUTE_DTYPE_BY_NAME[n] for n in (dtype_name, q_name, new_name,
                                                                              cache_name))
    rank = 3 if varlen else 4  # (total, h, d) or (b, s, h, d)
    x = lambda dt, dim, r=rank: fake_tensor(dt, r, shape=(None,) * (r - 1) + (dim,))
    i32 = lambda rank: fake_tensor(Int32, rank, align=4)
    rot = lambda: fake_tensor(dtype, 2, shape=(None, rotary_dim // 2)) if rotary_dim > 0 else None
    # Descales: fp32 (b, h_kv) of any strides (one element broadcast has stride 0).
    descale = lambda given: fake_tensor(Float32, 2, align=4, contiguous_last=False) if given else None
    q_descale = has_q and q_dtype.width == 8
    kv_descale = has_new_kv and cache_dtype.width == 8
    tensors = (
        x(q_dtype, d) if has_q else None, x(new_dtype, d) if has_new_kv else None,
        x(new_dtype, d_v) if has_new_kv else None, x(cache_dtype, d, 4), x(cache_dtype, d_v, 4), i32(1),
        i32(2) if paged else None, i32(1) if has_batch_idx else None, i32(1) if has_leftpad else None, rot(), rot(),
        x(q_dtype, d) if has_q else None, i32(1), i32(1) if not paged and (has_batch_idx or has_leftpad) else None,
        i32(1) if varlen and has_q else None, i32(1) if varlen and has_new_kv else None,
        descale(q_descale), descale(kv_descale), descale(kv_descale),
    )
    kernel = KVAppendRotary(dtype, d, d_v, rotary_dim, interleaved, q_per_query, paged, varlen, q_dtype=q_dtype,
                            new_dtype=new_dtype, cache_dtype=cache_dtype)
    return cute.compile(kernel, *tensors, fake_stream(), options=compile_options(arch))


def append_launcher(dtype, d: int, d_v: int, rotary_dim: int, interleaved: bool, q_positions_per_query: bool,
                    has_q: bool, has_new_kv: bool, paged: bool, has_batch_idx: bool, has_leftpad: bool,
                    varlen: bool = False, q_dtype=None, new_dtype=None, cache_dtype=None, device=None):
    """The compiled append for torch dtypes (``dtype`` the 16-bit one; ``q_dtype``,
    ``new_dtype``, ``cache_dtype`` where q, the new tokens or the caches differ: fp8) and
    the static flags of ``append_key``, called as in the module docstring (None where
    absent). Runs on torch's current stream. An fp8 operand needs the conversion
    instructions of compute capability 8.9: refused below (NotImplementedError), before
    anything compiles or runs."""
    arch = target_arch(device)
    names = [DTYPE_NAMES[t] if t is not None else None for t in (q_dtype, new_dtype, cache_dtype)]
    if any(n in ("e4m3", "e5m2") for n in names) and arch_capability(arch) < (8, 9):
        raise NotImplementedError(f"an FP8 cache append (or FP8 queries) needs a GPU of compute capability >= 8.9 "
                                  f"(its fp8 conversion instructions), got {arch}")
    key = append_key(arch, DTYPE_NAMES[dtype], d, d_v, rotary_dim, interleaved, q_positions_per_query,
                     has_q, has_new_kv, paged, has_batch_idx, has_leftpad, varlen, *names)
    return jit_cache.get_or_compile("kv_append", key, lambda: compile_append(key))
