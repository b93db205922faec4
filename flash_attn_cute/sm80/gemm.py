"""mma.sync GEMM loops over a K-sliced tile, with the next slice's ldmatrix issued
before the current slice's MMAs (register double buffering)."""

import cutlass
import cutlass.cute as cute


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
