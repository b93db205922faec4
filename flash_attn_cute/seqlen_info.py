"""Where one batch entry's queries and keys live, for every layout the API accepts.

Batch tensors carry their length in a mode; packed (varlen) tensors get it from
cumulative lengths; a KV cache gets it from ``seqused_k`` (cache_seqlens). One
definition, used by every architecture's kernel and by the combine kernel.
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
    ) -> "SeqlenInfo":
        """``seqlen_k_capacity`` bounds a KV cache's used length (cache rows, or pages x
        page size): whatever ``seqused_k`` says, no key past the cache is read."""
        offset_q, seqlen_q = Int32(0), seqlen_q_static
        if cutlass.const_expr(mCuSeqlensQ is not None):
            offset_q = mCuSeqlensQ[batch]
            seqlen_q = mCuSeqlensQ[batch + 1] - offset_q
        offset_k, seqlen_k = Int32(0), seqlen_k_static
        if cutlass.const_expr(mCuSeqlensK is not None):
            offset_k = mCuSeqlensK[batch]
            seqlen_k = mCuSeqlensK[batch + 1] - offset_k
        if cutlass.const_expr(mSeqUsedK is not None):
            seqlen_k = mSeqUsedK[batch]
            if cutlass.const_expr(seqlen_k_capacity is not None):
                seqlen_k = cutlass.max(cutlass.min(seqlen_k, seqlen_k_capacity), 0)
        return SeqlenInfo(offset_q, seqlen_q, offset_k, seqlen_k)
