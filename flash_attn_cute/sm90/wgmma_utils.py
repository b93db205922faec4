"""wgmma building blocks shared by the SM90 kernels (forward and MLA decode): the wait for
and release of a K/V stage it reads, the fp32 -> 16-bit conversion of S into the P
operand, and one wgmma group over a warpgroup's fragments. (The swizzled row-major smem
tiles wgmma reads are ``device.layout_utils.row_major_smem_layout``, shared with SM100.)"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup


def convert_pairs(src: cute.Tensor, dst: cute.Tensor):
    """dst = src in dst's dtype (same compact layout), in power-of-two chunks: the
    conversion packs two values per instruction only on power-of-two vectors (a 64 x 96
    S would otherwise convert one value at a time)."""
    n = cute.size(src)
    chunk = n & -n  # largest power of two dividing n
    for i in range(n // chunk):
        part = cute.make_tensor(src.iterator + i * chunk, cute.make_layout(chunk))
        out = cute.make_tensor(dst.iterator + i * chunk, cute.make_layout(chunk))
        out.store(part.load().to(dst.element_type))


@cute.jit
def wgmma_gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor,
               zero_init: cutlass.Constexpr[bool], wg_wait: cutlass.Constexpr[int], accumulates=None):
    """acc (+)= A B over the K slices of one warpgroup's fragments, as one wgmma group.
    ``wg_wait`` >= 0 waits until at most that many groups are in flight; -1 returns at once.
    ``accumulates`` (a run-time Boolean, in place of ``zero_init``): whether the first K
    slice adds into acc (the wgmma's scale-d predicate)."""
    warpgroup.fence()
    # A fresh atom per call: its ACCUMULATE field is rewritten below.
    atom = cute.make_mma_atom(tiled_mma.op)
    if cutlass.const_expr(accumulates is None):
        atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    else:
        atom.set(warpgroup.Field.ACCUMULATE, accumulates)
    for k in cutlass.range_constexpr(cute.size(tCrA.shape[2])):
        cute.gemm(atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    if cutlass.const_expr(wg_wait >= 0):
        warpgroup.wait_group(wg_wait)


@cute.jit
def kv_wait(pipe, state, gathered: cutlass.Constexpr[bool]):
    """Waits for a K/V stage. Rows ``gathered`` by cp.async were written in the generic
    proxy; wgmma reads shared memory through the async proxy, hence the proxy fence."""
    pipe.consumer_wait(state)
    if cutlass.const_expr(gathered):
        cute.arch.fence_view_async_shared()


@cute.jit
def kv_release(pipe, state, gathered: cutlass.Constexpr[bool]):
    """Frees a K/V stage: one arrive per consumer warp. A TMA pipeline elects its lane
    itself; a cp.async pipeline (``gathered`` rows) would count every thread."""
    if cutlass.const_expr(gathered):
        if cute.arch.lane_idx() == 0:
            pipe.consumer_release(state)
    else:
        pipe.consumer_release(state)
