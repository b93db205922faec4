"""Where one batch entry's queries and keys live, for every layout the API accepts.

Batch tensors carry their length in a mode; packed (varlen) tensors get it from
cumulative lengths; a KV cache gets it from ``seqused_k`` (cache_seqlens), and queries
from ``seqused_q`` where given (the first rows of the dense mode or of the packed range).
A paged cache with ``cache_leftpad`` (the kernels' ``mLeftpadK``) has a per-sequence key
start: key j is cache position ``leftpad_k + j``, which the page lookups add
(``paged_kv``); its ``seqused_k`` counts the keys from there. One definition, used by every
architecture's kernel and by the combine kernel.
"""

from dataclasses import dataclass
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Int32


@dataclass(frozen=True)
class SeqlenInfo:
    offset_q: Int32  # first row of this batch entry in a packed Q (0 for batch tensors)
    seqlen_q: Int32
    offset_k: Int32
    seqlen_k: Int32
    # Paged caches with mLeftpadK: the cache position of key 0, in [0, capacity]; None
    # (no offset, nothing added to a position) otherwise.
    leftpad_k: Optional[Int32] = None

    @staticmethod
    @cute.jit
    def create(
        batch: Int32,
        seqlen_q_static: Int32,  # Q's length mode; unused when mCuSeqlensQ is given
        seqlen_k_static: Int32,
        mCuSeqlensQ: Optional[cute.Tensor],  # (batch + 1,) int32
        mCuSeqlensK: Optional[cute.Tensor],  # (batch + 1,) int32
        mSeqUsedK: Optional[cute.Tensor],  # (batch,) int32
        seqlen_k_capacity: Optional[Int32] = None,
        mSeqUsedQ: Optional[cute.Tensor] = None,  # (batch,) int32
        mLeftpadK: Optional[cute.Tensor] = None,  # (batch,) int32, with seqused_k and a capacity
    ) -> "SeqlenInfo":
        """``seqlen_k_capacity`` bounds a KV cache's used length (cache rows, or pages x
        page size): whatever ``seqused_k`` says, no key past the cache is read. Likewise
        ``seqused_q`` is clamped to the rows the sequence has (its dense mode, or its
        packed range), so no query row past them is read or written. ``mLeftpadK``: the
        key start, clamped into [0, capacity], and the length into [0, capacity - start],
        so that start + key stays inside the cache too."""
        offset_q, seqlen_q = Int32(0), seqlen_q_static
        if cutlass.const_expr(mCuSeqlensQ is not None):
            offset_q = mCuSeqlensQ[batch]
            seqlen_q = mCuSeqlensQ[batch + 1] - offset_q
        if cutlass.const_expr(mSeqUsedQ is not None):
            seqlen_q = cutlass.max(cutlass.min(mSeqUsedQ[batch], seqlen_q), 0)
        offset_k, seqlen_k = Int32(0), seqlen_k_static
        if cutlass.const_expr(mCuSeqlensK is not None):
            offset_k = mCuSeqlensK[batch]
            seqlen_k = mCuSeqlensK[batch + 1] - offset_k
        leftpad_k = None
        if cutlass.const_expr(mSeqUsedK is not None):
            seqlen_k = mSeqUsedK[batch]
            if cutlass.const_expr(seqlen_k_capacity is not None):
                room = seqlen_k_capacity
                if cutlass.const_expr(mLeftpadK is not None):
                    leftpad_k = cutlass.max(cutlass.min(mLeftpadK[batch], seqlen_k_capacity), 0)
                    room = seqlen_k_capacity - leftpad_k
                seqlen_k = cutlass.max(cutlass.min(seqlen_k, room), 0)
        if cutlass.const_expr(mLeftpadK is not None and leftpad_k is None):
            raise ValueError("mLeftpadK needs seqused_k and a cache capacity (a paged cache)")
        return SeqlenInfo(offset_q, seqlen_q, offset_k, seqlen_k, leftpad_k)

    @staticmethod
    @cute.jit
    def create_for(
        batch: Int32,
        mQ: cute.Tensor,  # (b, s_q, h, d) or (total_q, h, d)
        mK: cute.Tensor,  # (b, s_k, h_kv, d), (total_k, h_kv, d) or (num_pages, page_size, h_kv, d)
        mCuSeqlensQ: Optional[cute.Tensor],
        mCuSeqlensK: Optional[cute.Tensor],
        mSeqUsedK: Optional[cute.Tensor],
        mPageTable: Optional[cute.Tensor],  # (b, max_pages) int32
        mSeqUsedQ: Optional[cute.Tensor] = None,
        mLeftpadK: Optional[cute.Tensor] = None,  # (b,) int32, paged caches only
    ) -> "SeqlenInfo":
        """``create`` from a kernel's tensors: static lengths from their modes, and the
        cache capacity (pages x page size, or the cache's length mode) as the clamp."""
        if cutlass.const_expr(mLeftpadK is not None and mPageTable is None):
            raise ValueError("mLeftpadK is for paged caches (a contiguous cache is read with cu_seqlens_k offsets)")
        varlen_q = cutlass.const_expr(mCuSeqlensQ is not None)
        varlen_k = cutlass.const_expr(mCuSeqlensK is not None)
        capacity = None
        if cutlass.const_expr(mPageTable is not None):
            capacity = mPageTable.shape[1] * mK.shape[1]
        elif cutlass.const_expr(not varlen_k):
            capacity = mK.shape[1]
        return SeqlenInfo.create(
            batch,
            mQ.shape[0] if varlen_q else mQ.shape[1],
            mK.shape[0] if varlen_k else mK.shape[1],
            mCuSeqlensQ,
            mCuSeqlensK,
            mSeqUsedK,
            capacity,
            mSeqUsedQ,
            mLeftpadK,
        )

    def q_view(self, mX: cute.Tensor, batch: Int32, varlen: cutlass.Constexpr[bool]) -> cute.Tensor:
        """(b, s, ...) or packed (total, ...) Q-like tensor -> (s, ...) of this batch entry."""
        return _batch_view(mX, batch, self.offset_q, varlen)

    def k_view(self, mX: cute.Tensor, batch: Int32, varlen: cutlass.Constexpr[bool]) -> cute.Tensor:
        """(b, s, ...) or packed (total, ...) K-like tensor -> (s, ...) of this batch entry."""
        return _batch_view(mX, batch, self.offset_k, varlen)

    def lse_view(self, mLSE: cute.Tensor, batch: Int32, varlen: cutlass.Constexpr[bool]) -> cute.Tensor:
        """(b, h, s_q) or packed (h, total_q) LSE -> (h, s_q) of this batch entry."""
        if cutlass.const_expr(varlen):
            return cute.domain_offset((0, self.offset_q), mLSE)
        return mLSE[batch, None, None]


def _batch_view(mX: cute.Tensor, batch: Int32, offset: Int32, varlen: bool) -> cute.Tensor:
    rank = cute.rank(mX)
    if cutlass.const_expr(varlen):
        return cute.domain_offset((offset,) + (0,) * (rank - 1), mX)
    return mX[(batch,) + (None,) * (rank - 1)]
