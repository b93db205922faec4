"""SM80 MLA decode backend (mma.sync, cp.async gathers): the seam's check / plan /
compile_key / compile / launcher for the ``"mla"`` kind (see ``seam/__init__.py``). The kernel is
``sm80/mla_decode.py``; the DSL is imported only when a kernel is compiled."""

from __future__ import annotations

from typing import NamedTuple, Optional

from flash_attn_cute.seam.backend_kit import mla_entry_points, mla_refusal, plan_splits
from flash_attn_cute.host.constants import MLA_NHEADS
from flash_attn_cute.host.problems import FwdPlan, MlaProblem
from flash_attn_cute.host.tuning import NO_TUNING, Tuning, fp8_stages_override
from flash_attn_cute.sm80.config import MLA_FP8_STAGING, MLA_SMEM_KB, MlaWarpRoles, mla_smem_kb, mla_stages_for, smem_kb

NAME, NHEADS, AUTO = "sm80", MLA_NHEADS, True
FEATURES = frozenset({"batch_invariant", "fp8_kv"})  # what this kernel implements of backend_kit.MLA_FEATURES
# One CTA per SM (72 KB of Q and 36 KB per stage): the split heuristic counts the grid in
# 64-row tiles of 32-key blocks against num_sms resident CTAs, last wave at least 90% full.
_CTAS_PER_SM, _SPLIT_TOLERANCE = 1, 0.9


class MlaSm80Config(NamedTuple):
    stages: int  # KV pipeline depth (``config.mla_stages_for``)
    split_blocks: int = 0  # batch invariant: KV blocks per split (backend_kit.invariant_splits)
    fp8_stages: int = 0  # an FP8 cache's staging depth (``config.MLA_FP8_STAGING``); 0: 16 bits


def runs_on(capability: tuple) -> bool:
    return tuple(capability) in MLA_SMEM_KB


def check(problem: MlaProblem) -> Optional[str]:
    return mla_refusal(problem, FEATURES)


def plan(problem: MlaProblem, num_splits: int, pack_gqa: Optional[bool], num_sms: Optional[int],
         tuning: Tuning = NO_TUNING, arch: Optional[str] = None) -> FwdPlan:
    """One CTA per (64 packed rows of a KV head's query heads, KV head, split, batch)
    (``mla_kernel.MlaTile``: a partial last tile is predicated); ``num_splits`` 0 = the package's
    wave-efficiency heuristic on this grid (shapes only, never the device lengths; batch
    invariant: fixed keys per split). The query heads are always packed (``pack_gqa`` is
    ignored); the depth is the arch's (the call's, ``seam.resolve``; None: the A100's, the
    smallest shared memory; ``tuning.mla_stages`` overrides)."""
    roles = MlaWarpRoles()
    rows = problem.max_seqlen_q * problem.qhead_per_kvhead  # packed rows of one KV head
    num_splits, split_blocks = plan_splits(problem, num_splits, num_sms, problem.nheads_kv, rows, tile_m=roles.tile_m,
                                           tile_n=roles.tile_n, ctas_per_sm=_CTAS_PER_SM, tolerance=_SPLIT_TOLERANCE)
    arch = arch or "sm_80"
    stages, staging = mla_stages_for(arch, tuning.mla_stages, problem.kv_fp8), 0
    if problem.kv_fp8:
        stages, staging = fp8_stages_override(tuning.mla_fp8_stages) or (stages, MLA_FP8_STAGING)
        limit = smem_kb(arch)
        if mla_smem_kb(stages, staging) > limit:
            raise ValueError(f"MLA over an FP8 cache with {stages} KV stages and {staging} staging tiles "
                             f"(FLASH_ATTN_CUTE_MLA_FP8_STAGES): {mla_smem_kb(stages, staging)} KB of shared memory, "
                             f"over the {limit} KB of {arch}")
    return FwdPlan(NAME, MlaSm80Config(stages, split_blocks, staging), True, num_splits)


# compile_key, compile, launcher: the seam's MLA entry points (the key ends with the stages
# [and an FP8 cache's staging depth]).
compile_key, compile, launcher = mla_entry_points(
    NAME, "flash_attn_cute.sm80.mla_decode", "compile_mla_sm80",
    key_config=lambda c: (c.stages,) + ((c.fp8_stages,) if c.fp8_stages else ()))
