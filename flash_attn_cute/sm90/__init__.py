"""SM90 backend (warp-specialized TMA + wgmma): the seam's check / plan / compile / launcher.

Hopper only (sm_90a). Host-side only: the DSL is imported when a kernel is first
compiled, so planning is cheap and runs without a GPU.
"""

from __future__ import annotations

import os
from typing import Optional

from ..fwd import FwdPlan, FwdProblem, backend_entry_points, plan_rows, plan_splits
from ..tile_scheduler import l2_heads_for

NAME = "sm90"
HEAD_DIMS = (64, 96, 128, 192, 256)
# One CTA per SM (the tiles take most of the 227 KB of shared memory and the register
# file); a last wave 95% full, as for SM80.
_CTAS_PER_SM = 1
_SPLIT_TOLERANCE = 0.95


def _host():
    # The kernel module imports the DSL; its host helpers (tile table, key) are plain Python.
    from . import flash_fwd

    return flash_fwd

# wgmma and setmaxnreg exist on sm_90a only.
AUTO = True


def runs_on(capability: tuple) -> bool:
    return capability[0] == 9


def check(problem: FwdProblem) -> Optional[str]:
    for what, d in (("q/k", problem.d), ("v", problem.d_v)):
        if d not in HEAD_DIMS:
            return f"{what} head dimension {d} is not one of {HEAD_DIMS}"
    return _host().unsupported_reason(problem.d, problem.d_v)


def select_tile(problem: FwdProblem, rows_per_kv_head: int) -> tuple:
    return _host().select_tile(problem.d, problem.d_v, rows_per_kv_head, causal=problem.causal,
                               local=problem.local, page_size=problem.page_size or None)


def plan(problem: FwdProblem, num_splits: int, pack_gqa: Optional[bool], num_sms: Optional[int]) -> FwdPlan:
    """Tile from the SM90 tile table, GQA packing (None = FA3's rule on a 128-row tile), KV
    splits (0 = the wave-efficiency heuristic with this kernel's tile and one CTA per SM)."""
    pack_gqa, rows = plan_rows(problem, pack_gqa)
    tile = select_tile(problem, rows)
    num_splits = plan_splits(problem, num_splits, num_sms, pack_gqa, rows, tile_m=tile[0], tile_n=tile[1],
                             ctas_per_sm=_CTAS_PER_SM, tolerance=_SPLIT_TOLERANCE)
    return FwdPlan(NAME, tuple(tile), pack_gqa, num_splits)


def persistent(problem: FwdProblem, plan: FwdPlan) -> bool:
    """One CTA per SM looping over the tiles (``PersistentScheduler``), where it fits
    (``persistent_fits``) and was measured faster: a local window or a user mask (mask_mod,
    block mask), whose short tiles otherwise pay their pipeline fill and epilogue with
    nothing overlapping them. H200, B4 S8192 H16 d128 bf16, TFLOP/s persistent vs not:
    sliding window 1024 465 vs 435, document mask (block mask) 262 vs 259; plain causal
    583 vs 594 and non-causal 637 vs 682 are slower (long tiles, little fill to hide; not
    analysed further), decode (B64, 4096 keys, GQA 4) 4.25 vs 4.20 TB/s: left off.
    FLASH_ATTN_CUTE_SM90_PERSISTENT=0/1 overrides (where it fits)."""
    host = _host()
    fits = host.persistent_fits(problem.d, problem.d_v, plan.tile, plan.qhead_per_kvhead_packed(problem),
                                problem.varlen_q, plan.num_splits > 1, host.gathers_kv(plan.tile[1], problem.page_size))
    env = os.environ.get("FLASH_ATTN_CUTE_SM90_PERSISTENT")
    if env is not None:
        return fits and env != "0"
    user_mask = problem.variant is not None and (problem.variant.mask_mod is not None or problem.variant.block_q > 0)
    return fits and (problem.local or user_mask)


def _max_ctas() -> int:
    """The persistent grid's bound: one CTA per SM of the current device (1 where there is
    none: compile-only hosts never launch)."""
    import torch

    if not torch.cuda.is_available():
        return 1
    from ..heuristics import num_sms

    return num_sms(torch.cuda.current_device())


# compile_key, compile, launcher: the seam's shared entry points. The key's tile always
# carries ex2_emulate_every, then gather_kv and persistent; l2_heads and max_ctas are the
# kernel's extra runtime scalars.
compile_key, compile, launcher = backend_entry_points(
    NAME, "flash_attn_cute.sm90.flash_fwd", "compile_fwd_sm90", tile=lambda plan: (*plan.tile, 0)[:4],
    key_extra=lambda problem, plan: (_host().gathers_kv(plan.tile[1], problem.page_size),
                                     persistent(problem, plan)),
    extra_scalars=lambda problem: (int(l2_heads_for(problem.max_seqlen_k, problem.d, problem.d_v)), _max_ctas()))
