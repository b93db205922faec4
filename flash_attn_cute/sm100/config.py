"""Static configuration of the SM100 forward kernel, in plain Python (no DSL import):
warp roles and register budgets, TMEM columns, shared-memory bytes and the K/V ring
depth. The host planner and the CPU tests use it without compiling anything."""

from dataclasses import dataclass

TILE_M = 128  # rows of one Q stage: the M of one cta_group::1 tcgen05 MMA
# The (d, d_v) tiles the kernel compiles; other head dims run on the smallest tile holding
# them, padded inside the kernel (``constants.padded_head_dims``).
HEAD_DIM_PAIRS = ((64, 64), (128, 128), (192, 128))
SMEM_LIMIT = 232448  # sm_100 opt-in shared memory per block
TMEM_COLUMNS = 512


@dataclass(frozen=True)
class WarpRoles:
    """Which warp does what, and its register budget (setmaxnreg, per thread).

    Warps [4s, 4s + 4) are the softmax warpgroup of stage s, then one correction /
    epilogue warpgroup, then a warpgroup holding the MMA warp, the load warp and two
    widening warps (FP8 K/V only; idle otherwise: setmaxnreg acts on whole warpgroups, and
    a warp reads only the TMEM lanes 32 * (warp % 4)..+31, so every 128-row role is a
    whole warpgroup).

    Budgets (x 128 threads per warpgroup, within the 64K registers of the SM):
    q_stage 2: 2 x 184 + 64 + 80 = 512 (entry 128 x 512 threads); q_stage 1: 192 + 128 +
    96 (entry 168 x 384 threads). A softmax thread holds its whole S row (tile_n fp32) and
    P (at 176 the causal + softcap step spills); the MMA warp keeps the smem descriptors
    of every K slice live across its loop (at 64 registers it spills them)."""

    q_stage: int

    @property
    def num_softmax_warps(self) -> int:
        return 4 * self.q_stage

    @property
    def correction_warps(self) -> tuple:
        return tuple(range(self.num_softmax_warps, self.num_softmax_warps + 4))

    @property
    def mma_warp(self) -> int:
        return self.num_softmax_warps + 4

    @property
    def load_warp(self) -> int:
        return self.num_softmax_warps + 5

    @property
    def widen_warps(self) -> tuple:
        return (self.num_softmax_warps + 6, self.num_softmax_warps + 7)

    @property
    def num_warps(self) -> int:
        return self.num_softmax_warps + 8

    @property
    def num_threads(self) -> int:
        return 32 * self.num_warps

    @property
    def softmax_regs(self) -> int:
        return 184 if self.q_stage == 2 else 192

    @property
    def correction_regs(self) -> int:
        return 64 if self.q_stage == 2 else 128

    @property
    def other_regs(self) -> int:
        return 80 if self.q_stage == 2 else 96

    def registers_per_sm(self) -> int:
        return 128 * (self.q_stage * self.softmax_regs + self.correction_regs + self.other_regs)


def tmem_columns(q_stage: int, tile_n: int, d_v: int) -> int:
    """TMEM columns used: S (P aliased inside) and O of every stage."""
    return q_stage * (tile_n + d_v)


def tmem_alloc_columns(used: int) -> int:
    """tcgen05.alloc takes a power of two >= 32."""
    n = 32
    while n < used:
        n *= 2
    return n


# FP8 K/V: fp8 blocks land (TMA) in staging rings this deep, and the widening warps write
# them, 16-bit, into the K/V rings the MMAs read.
FP8_STAGES = 2


def smem_bytes(d: int, d_v: int, q_stage: int, tile_n: int, kv_stages: int, elem: int = 2,
               fp8: bool = False) -> int:
    """Shared memory of one CTA: Q stages, K and V rings (1 KiB aligned each), the fp8
    staging rings (``fp8``), row statistics and mbarriers."""
    align = lambda x: (x + 1023) // 1024 * 1024
    q = align(q_stage * TILE_M * d * elem)
    k = align(kv_stages * tile_n * d * elem)
    v = align(kv_stages * tile_n * d_v * elem)
    staging = align(FP8_STAGES * tile_n * d) + align(FP8_STAGES * tile_n * d_v) if fp8 else 0
    stats = q_stage * TILE_M * 3 * 4
    barriers = 8 * (2 + 4 * kv_stages + 5 * q_stage + (4 * FP8_STAGES if fp8 else 0)) + 4
    return q + k + v + staging + stats + barriers + 1024  # + the allocator's alignment slack


def kv_stages_for(d: int, d_v: int, q_stage: int, tile_n: int, fp8: bool = False, elem: int = 2) -> int:
    """Deepest K/V ring (at most 4, at least 1) that fits the shared memory (``elem``: bytes
    a value of Q, K and V)."""
    for stages in (4, 3, 2, 1):
        if smem_bytes(d, d_v, q_stage, tile_n, stages, elem, fp8=fp8) <= SMEM_LIMIT:
            return stages
    raise ValueError(f"no K/V stage fits in shared memory for d={d}, d_v={d_v}, q_stage={q_stage}")
