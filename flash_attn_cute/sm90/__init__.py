"""SM90 backend (warp-specialized TMA + wgmma): the seam's check / plan / compile / launcher.

Hopper only (sm_90a). Host-side only: the DSL is imported when a kernel is first
compiled, so planning is cheap and runs without a GPU.
"""

from __future__ import annotations

from typing import Optional

from ..cute_utils import DTYPE_NAMES, target_arch
from ..fwd import FwdPlan, FwdProblem, bind_launcher, plan_rows, plan_splits
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
    return _host().unsupported_reason(problem.d, problem.d_v, problem.paged, problem.page_size or None)


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


def compile_key(problem: FwdProblem, plan: FwdPlan, arch: Optional[str] = None) -> tuple:
    """The kernel's compile key. A split kernel always writes partial LSEs."""
    return _host().fwd_key(arch or target_arch(), DTYPE_NAMES[problem.dtype], problem.d, problem.d_v, plan.tile,
                           problem.variant_flags, plan.qhead_per_kvhead_packed(problem), plan.num_splits > 1,
                           problem.has_lse or plan.num_splits > 1, problem.varlen_q, problem.varlen_k,
                           problem.has_seqused_k, problem.paged)


def compile(key: tuple):
    return _host().compile_fwd_sm90(key)


def launcher(problem: FwdProblem, plan: FwdPlan):
    """``launch(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table)``: see
    ``fwd.bind_launcher``."""
    return bind_launcher(NAME, compile_key(problem, plan), compile, problem, plan,
                         extra_scalars=(int(l2_heads_for(problem.max_seqlen_k, problem.d, problem.d_v)),))
