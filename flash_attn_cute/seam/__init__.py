"""The dispatch seam of every kernel family: problem -> plan -> launch (-> combine).

The public API validates a call and describes it once as a problem (``host.problems``: no
tensors, hashable). Each problem kind has its registry of backend modules:

- ``"fwd"`` (``FwdProblem``, ``BACKENDS``): ``flash_attn_func``, ``flash_attn_varlen_func``,
  ``flash_attn_with_kvcache``;
- ``"mla"`` (``MlaProblem``, ``MLA_BACKENDS``): ``flash_mla_decode``.

A backend module owns everything architecture-specific about its kind:

- ``AUTO`` and ``runs_on(capability) -> bool``: whether ``backend=None`` may pick it, and
  the GPUs it runs on;
- ``check(problem) -> str | None``: why it cannot run the problem (None: it can);
- ``plan(problem, num_splits, pack_gqa, num_sms, tuning=NO_TUNING, arch=None) -> FwdPlan``:
  its config (its own named tuple), GQA packing and KV splits (0 = its heuristic on
  ``num_sms`` SMs); ``tuning`` holds explicit overrides (``tuning.py``), never the
  environment; ``arch`` (the call's, ``resolve``) for a config that depends on it;
- ``compile_key(problem, plan, arch=None)`` and ``compile(key)``: the binary, a pure
  function of a short key that reads only the problem and the plan;
- ``launcher(problem, plan, device=None)``: a callable taking the kind's kernel tensor list
  (``api.call_args.FwdTensors``, ``MlaTensors``: one named tuple) with the compiled
  kernel and every runtime scalar bound (``backend_kit`` builds these three).

``resolve`` selects, plans and binds once per distinct problem and keeps the result in a
cache, so a repeated call (a decode loop) costs one dict lookup before the launch;
``run_resolved`` allocates the split-KV partials each kind states (``partial_shapes``),
launches, and combines (adding the learnable sink there: split kernels leave it out). A
plan is split when ``plan.is_split``: more than one split, or batch invariant (always).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
from typing import Callable, NamedTuple, Optional

import torch

from flash_attn_cute.host import heuristics
from flash_attn_cute.host.registry import BACKENDS, MLA_BACKENDS, REGISTRIES
from flash_attn_cute.host.constants import MAX_SPLITS, MIXED_ROWS
from flash_attn_cute.host.keys import arch_of_capability
from flash_attn_cute.host.problems import FwdPlan, FwdProblem, MlaProblem
from flash_attn_cute.host.tuning import NO_TUNING, Tuning

__all__ = ["FwdProblem", "MlaProblem", "FwdPlan", "BACKENDS", "MLA_BACKENDS", "REGISTRIES", "backend_module",
           "candidates", "select_backend", "resolve", "run_resolved", "clear_plan_cache", "MAX_SPLITS"]

_KIND_LABEL = {"fwd": "", "mla": "MLA "}  # in messages
_PLAN_CACHE_SIZE = 4096  # distinct problems remembered; a serving loop repeats a handful

log = logging.getLogger("flash_attn_cute")


def backend_module(name: str, kind: str = "fwd"):
    """The module of a registered backend of a problem kind (imported on first use)."""
    return importlib.import_module(REGISTRIES[kind][name])


def candidates(kind: str, capability: tuple) -> list:
    """The backends ``backend=None`` tries on a GPU of ``capability``, in order: the
    automatic ones that run there, newest architecture first (SM80 last)."""
    names = sorted(REGISTRIES[kind], key=lambda n: int(n[2:]), reverse=True)
    out = []
    for name in names:
        module = backend_module(name, kind)
        if module.AUTO and module.runs_on(tuple(capability)):
            out.append(name)
    return out


def capability_refusal(problem, capability: tuple) -> Optional[str]:
    """Why no backend runs ``problem`` on a GPU of ``capability`` (None: one may): FP8 K/V
    needs the fp8 conversion instructions of compute capability 8.9."""
    if getattr(problem, "kv_fp8", False) and tuple(capability) < (8, 9):
        return (f"FP8 K/V needs a GPU of compute capability >= 8.9 (its conversion instructions), "
                f"got {capability[0]}.{capability[1]}")
    if getattr(problem, "qkv_fp8", False) and tuple(capability) < (9, 0):
        return (f"FP8 attention (q, k and v in FP8) runs on the SM90 (Hopper) kernel, it needs fp8 wgmma; "
                f"got compute capability {capability[0]}.{capability[1]} (FP8 K/V caches with 16-bit "
                f"queries run from 8.9)")
    return None


def select_backend(requested: Optional[str], problem, device) -> tuple:
    """(backend name, module) to run ``problem`` on ``device``.

    ``requested`` (already validated, see ``checks.backend_name``) must accept the problem
    or the call fails naming its reason. ``None`` takes the newest automatic backend that
    runs on the GPU and accepts the problem, logging each refusal (a Hopper call the SM90
    kernel refuses runs the SM80 kernel)."""
    kind = problem.kind
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 0):
        raise RuntimeError(f"flash_attn_cute needs a GPU of compute capability >= 8.0, "
                           f"{device} has {major}.{minor}")
    reason = capability_refusal(problem, (major, minor))
    if reason is not None:
        raise NotImplementedError(f"{reason} ({device})")
    if requested is not None:
        module = backend_module(requested, kind)
        reason = module.check(problem)
        if reason is None and not module.runs_on((major, minor)):
            reason = f"its kernels do not run on compute capability {major}.{minor} ({device})"
        if reason is not None:
            raise NotImplementedError(f"backend {requested!r} cannot run this call: {reason}")
        return requested, module
    reasons = []
    for name in candidates(kind, (major, minor)):
        module = backend_module(name, kind)
        reason = module.check(problem)
        if reason is None:
            return name, module
        reasons.append(f"{name}: {reason}")
        log.info("flash_attn_cute: %s %skernel refused the call (%s)", name, _KIND_LABEL[kind], reason)
    raise NotImplementedError(f"no {_KIND_LABEL[kind]}kernel runs this call on {device} (compute capability "
                              f"{major}.{minor}): " + ("; ".join(reasons) or "none runs there"))


def combine_launcher(out_dtype: torch.dtype, d_v: int, has_lse: bool, has_sink: bool = False,
                     split_groups: int = 1, arch: Optional[str] = None, split_info: bool = False) -> Callable:
    """The compiled split-KV combine for ``arch`` (see ``combine.combine_launcher``);
    imported lazily."""
    from flash_attn_cute.kernels.combine import combine_launcher as launcher

    return launcher(out_dtype, d_v, has_lse, has_sink, split_groups, arch, split_info)


class Resolved(NamedTuple):
    plan: FwdPlan
    launch: Callable
    combine: Optional[Callable]  # set when plan.is_split
    then: Optional["Resolved"] = None  # a mixed plan's second launch (never split)


def mixed_short_q(problem) -> int:
    """The query count that splits a mixed plan (0: none). A varlen call over a cache
    (a serving step: decode rows of 1-8 queries beside chunked-prefill rows of hundreds)
    is planned on its longest sequence, so its decode rows would run on the prefill tile.
    Instead it runs as two launches over the same tensors, each skipping the other's
    sequences on the device (no host sync): those of at most ``MIXED_ROWS`` packed rows
    on the decode tile (split-KV where its heuristic says so), then the others unsplit on
    the prefill tile. H200, 96 decode rows (512-32,768 keys) + 4 x 1,024 prefill rows,
    h32/8 d128 page 64: one launch 2.35 ms, two separate calls 2.02 ms."""
    if (problem.kind != "fwd" or not problem.varlen_q or problem.q_class or problem.batch_invariant
            or problem.variant is not None or not (problem.has_seqused_k or problem.paged)):
        return 0
    short_q = max(1, MIXED_ROWS // problem.qhead_per_kvhead)
    return short_q if problem.max_seqlen_q > short_q else 0


def mixed_parts(problem, num_splits: int) -> list:
    """The launches ``resolve`` plans for ``problem``, as [(problem, num_splits)]: itself, or
    the two parts of a mixed plan (``mixed_short_q``): the short sequences with the call's
    ``num_splits``, then the others unsplit (the AOT builder lists the same parts)."""
    short_q = mixed_short_q(problem)
    if not short_q:
        return [(problem, num_splits)]
    return [(problem._replace(max_seqlen_q=short_q, q_class=short_q), num_splits),
            (problem._replace(q_class=-short_q), 1)]


_plan_cache: dict = {}


def clear_plan_cache() -> None:
    """Forget every resolved plan, of every kind."""
    _plan_cache.clear()


def _resolve(problem, requested: Optional[str], num_splits: int, pack_gqa: Optional[bool], device,
             tuning: Tuning, sm_margin: int) -> Resolved:
    parts = mixed_parts(problem, num_splits)
    if len(parts) == 2:
        (short, short_splits), (rest, rest_splits) = parts
        return _resolve(short, requested, short_splits, pack_gqa, device, tuning, sm_margin)._replace(
            then=_resolve(rest, requested, rest_splits, pack_gqa, device, tuning, sm_margin))
    name, module = select_backend(requested, problem, device)
    num_sms = max(1, heuristics.num_sms(device) - sm_margin) if num_splits == 0 else None
    # The arch the launcher compiles for, from the call's device: a planner whose config
    # depends on it (SM100's sm_103 rule, SM80's shared memory) plans what it compiles.
    arch = arch_of_capability(torch.cuda.get_device_capability(device))
    # The call's device made current while planning: a planner that weighs bytes against SM
    # time reads its bandwidth (``heuristics.hbm_bytes_per_us``), not whichever device is current.
    with torch.cuda.device(device) if torch.cuda.is_available() else contextlib.nullcontext():
        plan = module.plan(problem, num_splits, pack_gqa, num_sms, tuning=tuning, arch=arch)
    plan = plan._replace(sm_margin=sm_margin)
    combine = None
    if plan.scheduled:  # lane groups for the splits a sequence has on average
        combine = combine_launcher(problem.out_dtype, problem.d_v, problem.has_lse, problem.has_sink,
                                   heuristics.combine_split_groups(-(-plan.num_splits // problem.batch)), arch,
                                   split_info=True)
    elif plan.is_split:
        combine = combine_launcher(problem.out_dtype, problem.d_v, problem.has_lse, problem.has_sink,
                                   heuristics.combine_split_groups(plan.num_splits, problem.batch_invariant), arch)
    return Resolved(plan, module.launcher(problem, plan, device), combine)


def resolve(problem, requested: Optional[str], num_splits: int, pack_gqa: Optional[bool], device,
            tuning: Tuning = NO_TUNING, sm_margin: int = 0) -> Resolved:
    """Backend, plan, bound launcher and combine for a problem of any kind, cached per
    distinct call (the tuning overrides are part of the key). ``sm_margin``: SMs the call
    leaves free (FA3's keyword, for kernels that run beside it, e.g. communication): the
    split heuristic (``num_splits=0``) and persistent grids count the others."""
    cache_key = (problem, requested, num_splits, pack_gqa, device, tuning, sm_margin)
    hit = _plan_cache.get(cache_key)
    if hit is None:
        hit = _resolve(problem, requested, num_splits, pack_gqa, device, tuning, sm_margin)
        if len(_plan_cache) >= _PLAN_CACHE_SIZE:
            _plan_cache.clear()
        _plan_cache[cache_key] = hit
    return hit


def run_resolved(resolved: Resolved, problem, tensors) -> None:
    """Launch ``resolved`` as ``launch(tensors)`` (the kind's kernel tensor list, a named
    tuple with ``out`` and ``lse`` fields: ``api.call_args.FwdTensors`` / ``MlaTensors``);
    split (``plan.is_split``), into fp32 partials of the shapes the problem states, then the
    combine into ``out`` / ``lse`` (``problem.combine_views``: it adds a forward call's
    learnable sink, which split kernels leave out). Where the kernels leave rows out
    (``problem.rows_unwritten``: seqused_q), their LSE partials start at -inf, so the
    combine writes them as rows that saw no key instead of merging uninitialised memory.
    A mixed plan (``resolved.then``): unsplit, its two launches run on two streams and
    join; split, the second part follows the first one's combine (which wrote the second
    part's rows as empty) and overwrites its rows."""
    out = tensors.out
    if resolved.then is not None and not resolved.plan.is_split and out.is_cuda:
        # Two streams: the long sequences' compute-bound tiles fill the SMs the short
        # ones' memory-bound tail leaves idle (H200, the serving step of ``mixed_short_q``
        # as graph replays: 2.23 against 2.35 ms at page 16, 2.01 against 2.05 at page 64;
        # eager the same). A split first part stays in order: its combine writes every row.
        main = torch.cuda.current_stream(out.device)
        side = _side_stream(out.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            resolved.launch(tensors)
        resolved.then.launch(tensors)
        main.wait_stream(side)
        return
    _run_one(resolved, problem, tensors, problem.rows_unwritten or resolved.then is not None)
    if resolved.then is not None:
        resolved.then.launch(tensors)


_side_streams: dict = {}


def _side_stream(device) -> torch.cuda.Stream:
    """The stream a mixed plan runs its first launch on, one per device (created once)."""
    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams[device] = torch.cuda.Stream(device)
    return stream


def _run_one(resolved: Resolved, problem, tensors, rows_unwritten: bool) -> None:
    if not resolved.plan.is_split:
        resolved.launch(tensors)
        return
    scheduled = resolved.plan.scheduled
    # A schedule's slots hold pieces of any sequence: a batch mode of 1 (``scheduled_partials``).
    out_shape = tuple(tensors.out.shape)
    o_shape, lse_shape = problem.partial_shapes(resolved.plan.num_splits, (1,) + out_shape[1:] if scheduled else
                                                out_shape)
    # One allocation for both partials (host time: one allocator call less per call).
    o_numel = math.prod(o_shape)
    partials = tensors.out.new_empty((o_numel + math.prod(lse_shape),), dtype=torch.float32)
    out_partial = partials[:o_numel].view(o_shape)
    lse_partial = partials[o_numel:].view(lse_shape)
    if rows_unwritten:
        lse_partial.fill_(-math.inf)
    if scheduled:
        kernel_tensors, combine_args = problem.scheduled_partials(out_partial, lse_partial, tensors)
        resolved.launch(kernel_tensors)
        resolved.combine(*combine_args)
        return
    resolved.launch(tensors._replace(out=out_partial, lse=lse_partial))
    resolved.combine(*problem.combine_views(out_partial, lse_partial, tensors))
