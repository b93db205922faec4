"""mma.sync building blocks shared by the SM80 kernels (forward and MLA decode): the
swizzled shared-memory tiles ldmatrix reads, and GEMM loops over a K-sliced tile with the
next slice's ldmatrix issued before the current slice's MMAs (register double buffering)."""

from typing import Optional

import cutlass
import cutlass.cute as cute

from flash_attn_cute.device.copy_utils import swizzle_atom_cols


def smem_layout(rows: int, cols: int, stages: Optional[int] = None):
    """(rows, cols[, stages]) of 16-bit elements in 8-row swizzled atoms 64 (or 32) columns
    wide (``copy_utils.swizzle_atom_cols``): ldmatrix reads and the 128-bit cp.async writes
    of ``copy_utils.gmem_tiled_copy`` are both bank-conflict free."""
    atom_cols = swizzle_atom_cols(cols)
    atom = cute.make_composed_layout(
        cute.make_swizzle(3 if atom_cols == 64 else 2, 3, 3),
        0,
        cute.make_layout((8, atom_cols), stride=(atom_cols, 1)),
    )
    if stages is None:
        return cute.tile_to_shape(atom, (rows, cols), (0, 1))
    return cute.tile_to_shape(atom, (rows, cols, stages), (0, 1, 2))


@cute.jit
def gemm_ss(
    tiled_mma: cute.TiledMma,
    acc: cute.Tensor,
    tCrA: cute.Tensor,  # (MMA, MMA_M, MMA_K) register fragment of A
    tCrB: cute.Tensor,  # (MMA, MMA_N, MMA_K) register fragment of B
    tCsA: cute.Tensor,  # smem A, partitioned by smem_thr_copy_A
    tCsB: cute.Tensor,
    smem_thr_copy_A: cute.TiledCopy,
    smem_thr_copy_B: cute.TiledCopy,
):
    """acc += A @ B^T with both operands streamed from shared memory."""
    tCrA_view = smem_thr_copy_A.retile(tCrA)
    tCrB_view = smem_thr_copy_B.retile(tCrB)
    num_k = cute.size(tCsA.shape[2])
    cute.copy(smem_thr_copy_A, tCsA[None, None, 0], tCrA_view[None, None, 0])
    cute.copy(smem_thr_copy_B, tCsB[None, None, 0], tCrB_view[None, None, 0])
    for k in cutlass.range_constexpr(num_k):
        if cutlass.const_expr(k < num_k - 1):
            cute.copy(smem_thr_copy_A, tCsA[None, None, k + 1], tCrA_view[None, None, k + 1])
            cute.copy(smem_thr_copy_B, tCsB[None, None, k + 1], tCrB_view[None, None, k + 1])
        cute.gemm(tiled_mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)


@cute.jit
def gemm_rs(
    tiled_mma: cute.TiledMma,
    acc: cute.Tensor,
    tCrA: cute.Tensor,  # (MMA, MMA_M, MMA_K) A already in registers (P)
    tCrB: cute.Tensor,
    tCsB: cute.Tensor,
    smem_thr_copy_B: cute.TiledCopy,
):
    """acc += A @ B^T with A in registers and B streamed from shared memory."""
    tCrB_view = smem_thr_copy_B.retile(tCrB)
    num_k = cute.size(tCsB.shape[2])
    cute.copy(smem_thr_copy_B, tCsB[None, None, 0], tCrB_view[None, None, 0])
    for k in cutlass.range_constexpr(num_k):
        if cutlass.const_expr(k < num_k - 1):
            cute.copy(smem_thr_copy_B, tCsB[None, None, k + 1], tCrB_view[None, None, k + 1])
        cute.gemm(tiled_mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
