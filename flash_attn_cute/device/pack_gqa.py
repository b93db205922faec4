"""Packed GQA: the query heads that share one KV head laid along the M dimension.

With ``qhead_per_kvhead_packed`` (= g) query heads per KV head laid along M, packed row
``r`` of KV head ``h_kv`` is query position ``r // g`` of query head ``h_kv * g + r % g``:
the heads of one position are adjacent, so a decode step (one position) fills g rows of
one tile and K/V are read once for all of them. The views below express that as a
layout, so a row load, a TMA box or an epilogue store addresses packed rows like plain
ones; ``query_and_head_of_row`` is the same map for one row (masks, score modifiers).

One definition for every architecture; g == 1 (not packed) returns the plain view.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32


def packed_rows(mX_b: cute.Tensor, head: Int32, qhead_per_kvhead_packed: cutlass.Constexpr[int]) -> cute.Tensor:
    """(s, h, d) tensor of one batch entry -> (rows, d) view of one head group.

    ``head`` is the query head without packing, the KV head with it. With packing the
    row mode is ``(qhead_per_kvhead_packed, s)`` with strides ``(head stride, row stride)``."""
    if cutlass.const_expr(qhead_per_kvhead_packed == 1):
        return mX_b[None, head, None]
    base = mX_b[None, head * qhead_per_kvhead_packed, None]
    return cute.make_tensor(
        base.iterator,
        cute.make_layout(
            ((qhead_per_kvhead_packed, mX_b.shape[0]), mX_b.shape[2]),
            stride=((mX_b.stride[1], mX_b.stride[0]), mX_b.stride[2]),
        ),
    )


def packed_lse_rows(mL_b: cute.Tensor, head: Int32, qhead_per_kvhead_packed: cutlass.Constexpr[int]) -> cute.Tensor:
    """(h, s) LSE of one batch entry -> (rows,) view in the M tile's row order."""
    if cutlass.const_expr(qhead_per_kvhead_packed == 1):
        return mL_b[head, None]
    base = mL_b[head * qhead_per_kvhead_packed, None]
    return cute.make_tensor(
        base.iterator,
        cute.make_layout((qhead_per_kvhead_packed, mL_b.shape[1]), stride=(mL_b.stride[0], mL_b.stride[1])),
    )


def query_of_row(row, qhead_per_kvhead_packed: cutlass.Constexpr[int]):
    """Query position of a packed row (the row itself without packing)."""
    if cutlass.const_expr(qhead_per_kvhead_packed == 1):
        return row
    return row // qhead_per_kvhead_packed


def query_and_head_of_row(row, head: Int32, qhead_per_kvhead_packed: cutlass.Constexpr[int]):
    """(query position, query head) of a packed row; ``head`` as in ``packed_rows``. One
    division serves both (the head is the remainder, recovered by a multiply-add)."""
    q_idx = query_of_row(row, qhead_per_kvhead_packed)
    if cutlass.const_expr(qhead_per_kvhead_packed == 1):
        return q_idx, head
    return q_idx, head * qhead_per_kvhead_packed + row - q_idx * qhead_per_kvhead_packed
