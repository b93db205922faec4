"""Static configuration of the SM80 kernels, in plain Python (no DSL import): the forward
tile table and the MLA kernel's warp roles and pipeline depth. The host planners
(``sm80/__init__.py``, ``sm80/mla.py``) and the CPU tests use it without compiling
anything; the kernels read their roles from here."""

from dataclasses import dataclass
from typing import Optional

from flash_attn_cute.host.constants import D_CKV
from flash_attn_cute.host.keys import arch_capability


def select_tile(head_dim: int, head_dim_v: int, rows_per_kv_head: int, override: Optional[str] = None,
                batch_invariant: bool = False) -> tuple:
    """(tile_m, tile_n, num_warps, q_in_regs). acc_O holds tile_m * d_v / threads fp32
    values, acc_S tile_m * tile_n / threads, Q's fragment (when kept in registers)
    tile_m * d / threads 16-bit values; all under 255 registers per thread.
    ``override`` "m,n,warps,q_in_regs" (``tuning.Tuning.sm80_tile``) replaces it (tuning sweeps).
    ``batch_invariant``: tile_n depends on the head dims alone (rows_per_kv_head depends on
    max_seqlen_q, i.e. on the batch): the decode tile's n for prefill too, with 8 warps
    (a 4-warp 128 x 128 tile would hold 128 + 128 accumulator registers a thread)."""
    if override:
        m, n, w, *q = (int(x) for x in override.split(","))
        return m, n, w, bool(q and q[0])
    d = max(head_dim, head_dim_v)
    if rows_per_kv_head <= 64:
        # Decode-shaped: a 128-row tile would be mostly padding.
        return (64, 128, 4, True) if d <= 128 else (64, 64, 4, False)
    if d <= 128 and batch_invariant:
        return 128, 128, 8, False
    if d <= 128:
        # 4 warps beat 8 on the H200 (2026-11-29 sweep, benchmarks/bench_tiles.py): each
        # warp re-reads K and V from smem, so more warps per tile cost smem bandwidth.
        # Q in registers did not pay at d=64 (within noise, and it spills).
        return 128, 64, 4, False
    return 128, 64, 8, False


def smem_kb(arch: str) -> int:
    """Shared memory one CTA may use on ``arch`` (``sm_80``, ``sm_89``, ``sm_90a``...): 163 KB
    on the A100, 227 KB from sm_90 on, 99 KB on the other 8.x and 12.x parts."""
    return MLA_SMEM_KB.get(arch_capability(arch), 99)


def fp8_staging_fits(tile: tuple, head_dim: int, head_dim_v: int, arch: str) -> tuple:
    """The forward tile with FP8 K/V: each block also lands in fp8 staging buffers (tile_n x
    (d + d_v) bytes) beside the 16-bit K and V the MMAs read. tile_n is halved (down to 32)
    until Q, K, V and the staging fit ``smem_kb(arch)`` (the 99 KB parts: the decode tile at
    d 128 needs 112 KB with 128 keys a block, 64 KB with 64)."""
    m, n, warps, q_in_regs = tile

    def kb(n_):
        return (2 * (m * head_dim + n_ * (head_dim + head_dim_v)) + n_ * (head_dim + head_dim_v)) / 1024 + 1

    while n > 32 and kb(n) > smem_kb(arch):
        n //= 2
    return m, n, warps, q_in_regs


def fp8_refusal(head_dim: int, head_dim_v: int, batch_invariant: bool) -> Optional[str]:
    """Why the SM80 kernel cannot stage FP8 K/V for these head dims (None: it can). A
    16-byte copy moves 16 fp8 values; a row of 96 of them lies in a 32-column swizzle atom,
    two copies wide, so the 8-warp tiles (d > 128, or batch invariant) would copy 128 rows a
    pass into blocks of 64."""
    if 96 in (head_dim, head_dim_v) and (max(head_dim, head_dim_v) > 128 or batch_invariant):
        return f"FP8 K/V with head dims ({head_dim}, {head_dim_v}) is not supported (an 8-warp tile over 96 columns)"
    return None


@dataclass(frozen=True)
class MlaWarpRoles:
    """Static warp roles and what each holds in registers (fp32 words per thread).

    ``threads * regs_cap <= 65536``: on SM80 every thread of a kernel gets the same
    register count, so the cap is what the O warps must fit in."""

    s_warps: int = 4  # QK^T + online softmax, 16 rows each
    o_warps: int = 8  # PV over 64 columns each + cp.async gathers
    tile_m: int = 64
    tile_n: int = 32

    @property
    def s_threads(self) -> int:
        return 32 * self.s_warps

    @property
    def o_threads(self) -> int:
        return 32 * self.o_warps

    @property
    def threads(self) -> int:
        return self.s_threads + self.o_threads

    @property
    def regs_cap(self) -> int:
        return (65536 // self.threads) // 8 * 8

    @property
    def o_regs(self) -> int:
        """O accumulator per O thread: the number the role split is chosen for."""
        return self.tile_m * D_CKV // self.o_threads

    def __post_init__(self):
        assert self.tile_m == 16 * self.s_warps and D_CKV % (16 * self.o_warps) == 0
        assert self.o_regs + 32 <= self.regs_cap, "O plus one P/V k-slice must fit the per-thread cap"


# An FP8 cache: the O threads' fp8 staging ring depth (the tiles in flight from HBM).
MLA_FP8_STAGING = 2


def mla_smem_kb(stages: int, staging: int = 0) -> float:
    """Shared memory of the MLA kernel (KB): Q, the KV stages, two P buffers, the fp8
    staging, 1 KB of row statistics and alignment."""
    return 72 + 36 * stages + 8 + 18 * staging + 1


# Shared memory of the MLA kernel: Q 72 KB + stages x 36 KB + P 8 KB. Two stages fit the
# A100 (163 KB per CTA), three the H100/H200 and B200 (227 KB); GPUs with 99 KB
# (sm_86, sm_89, sm_120) cannot hold Q and one stage, so they are refused.
MLA_SMEM_KB = {(8, 0): 163, (9, 0): 227, (10, 0): 227, (10, 3): 227}


def mla_stages_for(arch: str, override: Optional[str] = None, fp8: bool = False) -> int:
    """MLA pipeline depth: 3 from sm_90 on (188 KB of shared memory; H200, 2026-11-29: 2.31
    against 1.79 TB/s for 2 stages at 768 x 2048), 2 on the A100 (152 KB of its 163). An FP8
    cache: 2 (its fp8 staging, ``MLA_FP8_STAGING`` x 18 KB, takes the third's room; its own
    knob, ``tuning.mla_fp8_stages``, sets both depths). ``override`` "2" / "3"
    (``tuning.Tuning.mla_stages``, 16-bit caches) replaces it (tuning sweeps)."""
    major, minor = arch_capability(arch)
    sm = 10 * major + minor
    if fp8:
        return 2
    if override:
        if override not in ("2", "3") or (override == "3" and sm < 90):
            raise ValueError(f"FLASH_ATTN_CUTE_MLA_STAGES={override}: 2, or 3 on sm_90 and later")
        return int(override)
    return 3 if sm >= 90 else 2
