"""Multi-head latent attention (DeepSeek V2/V3 style) decode over a paged latent cache.

Every query head attends to one shared cache of 512 ``ckv`` plus 64 rotary ``kpe`` values
per token: scores ``(q_nope . ckv + q_pe . kpe) * softmax_scale``, output
``softmax(scores) . ckv``. The public entry point is ``flash_mla_decode``; it goes through
the same problem -> plan -> launch (-> combine) seam as the forward pass (``fwd.py``),
with its own problem type and backend registry:

- ``MlaProblem`` rather than ``FwdProblem`` with d = 576: a forward backend's ``check``
  must never see an MLA call (the SM80 forward would accept d_v 512 in a future head-dim
  list and run it as 576-wide GQA, reading K and V as separate tensors), and half of
  ``FwdProblem``'s fields (windows, softcap, varlen) mean nothing here. It keeps the
  field names the shared planners read (``batch``, ``nheads``, ``nheads_kv``,
  ``max_seqlen_k``), so ``fwd.plan_splits`` and ``heuristics`` plan MLA splits unchanged.
- ``MLA_BACKENDS``: name -> module exposing ``NHEADS``, ``AUTO``, ``runs_on``, ``check``,
  ``plan(problem, num_splits, num_sms) -> FwdPlan``, ``compile_key``, ``compile`` and
  ``launcher(problem, plan)`` returning ``launch(q_nope, q_pe, ckv, kpe, out, lse,
  cache_seqlens, page_table)``. An SM90 kernel is one more line here and one module.

Split-KV partials (fp32) are merged by the package's combine kernel (``combine.py``, d_v
512). The host path never synchronises with the device: the kernels clamp each length
to ``max_pages_per_seq * page_size`` and each page id into the pool.
"""

from __future__ import annotations

import importlib
import logging
import math
import numbers
from typing import Callable, NamedTuple, Optional

import torch

from . import fwd, interface
from .heuristics import MAX_SPLITS

__all__ = ["flash_mla_decode", "MlaProblem", "MLA_BACKENDS", "MLA_NHEADS", "D_CKV", "D_KPE"]

D_CKV, D_KPE = 512, 64
MLA_NHEADS = (16, 32, 64, 128)
MLA_BACKENDS = {
    "sm80": "flash_attn_cute.sm80.mla",
    "sm90": "flash_attn_cute.sm90.mla",
}

log = logging.getLogger("flash_attn_cute")


class MlaProblem(NamedTuple):
    """One MLA decode call without its tensors (hashable: the plan cache key).
    ``max_seqlen_k`` is the cache capacity (``max_pages_per_seq * page_size``): the
    lengths live on the device and are never read back."""

    dtype: torch.dtype
    batch: int
    max_seqlen_q: int
    max_seqlen_k: int
    nheads: int
    page_size: int
    softmax_scale: float
    causal: bool  # bottom-right aligned
    has_lse: bool

    nheads_kv = 1  # one latent cache shared by every head (what the split planner reads)
    d = D_CKV + D_KPE
    d_v = D_CKV


def backend_module(name: str):
    return importlib.import_module(MLA_BACKENDS[name])


def _refusal(name: str, problem: MlaProblem, capability: tuple) -> Optional[str]:
    """Why backend ``name`` cannot run ``problem`` on a GPU of ``capability`` (None: it can)."""
    module = backend_module(name)
    if not module.runs_on(capability):
        return f"its MLA kernel does not run on compute capability {capability[0]}.{capability[1]}"
    return module.check(problem)


def select_backend(requested: Optional[str], problem: MlaProblem, device) -> tuple:
    """(name, module): the requested backend must run the call; None takes the newest
    automatic backend that runs on the device and accepts the call, else SM80."""
    capability = tuple(torch.cuda.get_device_capability(device))
    if requested is not None:
        reason = _refusal(requested, problem, capability)
        if reason is not None:
            raise NotImplementedError(f"backend {requested!r} cannot run this call on {device}: {reason}")
        return requested, backend_module(requested)
    reasons = []
    for name in sorted(MLA_BACKENDS, key=lambda n: (n != "sm80", n), reverse=True):
        if not backend_module(name).AUTO:
            continue
        reason = _refusal(name, problem, capability)
        if reason is None:
            return name, backend_module(name)
        reasons.append(f"{name}: {reason}")
        log.info("flash_attn_cute: %s MLA kernel refused the call (%s)", name, reason)
    raise NotImplementedError(f"no MLA kernel runs this call on {device}: " + ("; ".join(reasons) or "none is automatic"))


class _Resolved(NamedTuple):
    plan: fwd.FwdPlan
    launch: Callable
    combine: Optional[Callable]


_plan_cache: dict = {}


def resolve(problem: MlaProblem, requested: Optional[str], num_splits: int, device) -> _Resolved:
    """Backend, plan, bound launcher and combine, cached per distinct call."""
    key = (problem, requested, num_splits, device)
    hit = _plan_cache.get(key)
    if hit is None:
        name, module = select_backend(requested, problem, device)
        from . import heuristics

        num_sms = heuristics.num_sms(device) if num_splits == 0 else None
        plan = module.plan(problem, num_splits, num_sms)
        combine = fwd.combine_launcher(problem.dtype, D_CKV, problem.has_lse) if plan.num_splits > 1 else None
        hit = _Resolved(plan, module.launcher(problem, plan), combine)
        if len(_plan_cache) >= 1024:
            _plan_cache.clear()
        _plan_cache[key] = hit
    return hit


def run_resolved(resolved: _Resolved, problem: MlaProblem, q_nope, q_pe, ckv, kpe, out, lse, cache_seqlens,
                 page_table) -> None:
    ns = resolved.plan.num_splits
    if ns == 1:
        resolved.launch(q_nope, q_pe, ckv, kpe, out, lse, cache_seqlens, page_table)
        return
    b, s, h = problem.batch, problem.max_seqlen_q, problem.nheads
    o_numel = ns * b * s * h * D_CKV
    partials = q_nope.new_empty((o_numel + ns * b * h * s,), dtype=torch.float32)  # one allocation
    out_partial = partials[:o_numel].view(ns, b, s, h, D_CKV)
    lse_partial = partials[o_numel:].view(ns, b, h, s)
    resolved.launch(q_nope, q_pe, ckv, kpe, out_partial, lse_partial, cache_seqlens, page_table)
    resolved.combine(out_partial, lse_partial, out, lse)


class _MlaEntry(NamedTuple):
    problem: MlaProblem
    resolved: _Resolved
    out_shape: tuple
    lse_shape: tuple


def _backend(backend) -> Optional[str]:
    """``backend=`` must name an MLA backend; FLASH_ATTN_CUTE_BACKEND naming a backend
    without an MLA kernel means automatic choice here (it is set for the forward)."""
    name = interface._backend_name(backend)
    if name is None or name in MLA_BACKENDS:
        return name
    if backend is None:
        return None
    raise NotImplementedError(f"backend {name!r} has no MLA kernel (MLA backends: {tuple(MLA_BACKENDS)})")


def _validate(q_nope, q_pe, ckv_cache, kpe_cache, cache_seqlens, page_table, softmax_scale, causal, num_splits,
              out, backend):
    """Shapes, then dtypes, then scalars, then the device; errors name the argument."""
    _tensor, _dtype = interface._tensor, interface._dtype
    q_form = "(batch, seqlen_q, nheads, {})"
    _tensor("q_nope", q_nope, 4, q_form.format(D_CKV))
    _tensor("q_pe", q_pe, 4, q_form.format(D_KPE))
    _tensor("ckv_cache", ckv_cache, 3, f"(num_pages, page_size, {D_CKV})")
    _tensor("kpe_cache", kpe_cache, 3, f"(num_pages, page_size, {D_KPE})")
    _tensor("page_table", page_table, 2, "(batch, max_pages_per_seq)")
    batch, seqlen_q, nheads, d = q_nope.shape
    for name, t, want in (("q_nope", q_nope, D_CKV), ("q_pe", q_pe, D_KPE), ("ckv_cache", ckv_cache, D_CKV),
                          ("kpe_cache", kpe_cache, D_KPE)):
        if t.shape[-1] != want:
            raise ValueError(f"{name} head dimension must be {want} (MLA: ckv 512, kpe 64), got {t.shape[-1]}")
    if tuple(q_pe.shape[:3]) != (batch, seqlen_q, nheads):
        raise ValueError(f"q_pe must have shape (batch, seqlen_q, nheads, 64) = {(batch, seqlen_q, nheads, D_KPE)} "
                         f"like q_nope, got {tuple(q_pe.shape)}")
    if tuple(kpe_cache.shape[:2]) != tuple(ckv_cache.shape[:2]):
        raise ValueError(f"kpe_cache (num_pages, page_size, 64) must have the pages of ckv_cache, got "
                         f"{tuple(kpe_cache.shape)} and {tuple(ckv_cache.shape)}")
    if nheads not in MLA_NHEADS:
        raise ValueError(f"nheads (q_nope.shape[2]) must be one of {MLA_NHEADS}, got {nheads}")
    if seqlen_q < 1:
        raise ValueError(f"seqlen_q (q_nope.shape[1]) must be >= 1, got {seqlen_q}")
    if ckv_cache.shape[1] < 1:
        raise ValueError("page_size (ckv_cache.shape[1]) must be >= 1")
    if page_table.shape[0] != batch:
        raise ValueError(f"page_table must have shape (batch, max_pages_per_seq) with batch = {batch}, "
                         f"got {tuple(page_table.shape)}")
    if page_table.shape[1] > 1 and page_table.stride(1) != 1:
        raise ValueError(f"page_table must have a contiguous last dimension, got strides {page_table.stride()}")
    interface._int32_vector("cache_seqlens", cache_seqlens, batch, "(batch,)")
    _dtype("q_nope", q_nope, interface.SUPPORTED_DTYPES, "float16 or bfloat16")
    for name, t in (("q_pe", q_pe), ("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):
        _dtype(name, t, q_nope.dtype, f"{q_nope.dtype} like q_nope")
    _dtype("page_table", page_table, torch.int32, "int32 of shape (batch, max_pages_per_seq)")
    if softmax_scale is None:
        softmax_scale = (D_CKV + D_KPE) ** -0.5
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    if not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    num_splits = interface._int("num_splits", num_splits, 0, MAX_SPLITS)
    backend = _backend(backend)
    tensors = [interface._layout(n, t) for n, t in (("q_nope", q_nope), ("q_pe", q_pe), ("ckv_cache", ckv_cache),
                                                     ("kpe_cache", kpe_cache))]
    out = interface._check_out(out, (batch, seqlen_q, nheads, D_CKV), q_nope.dtype, q_form.format(D_CKV))
    interface._check_device({"q_nope": q_nope, "q_pe": q_pe, "ckv_cache": ckv_cache, "kpe_cache": kpe_cache,
                             "cache_seqlens": cache_seqlens, "page_table": page_table, "out": out})
    return (*tensors, out, float(softmax_scale), num_splits, backend)


def flash_mla_decode(q_nope, q_pe, ckv_cache, kpe_cache, cache_seqlens, page_table, *, softmax_scale=None,
                     causal=False, num_splits=0, return_lse=False, out=None, backend=None):
    """MLA decode against a paged latent cache.

    q_nope ``(batch, seqlen_q, nheads, 512)``, q_pe ``(batch, seqlen_q, nheads, 64)``;
    ckv_cache ``(num_pages, page_size, 512)``, kpe_cache ``(num_pages, page_size, 64)``
    (any ``page_size >= 1``); page_table ``(batch, max_pages_per_seq)`` int32;
    cache_seqlens ``(batch,)`` int32. fp16 or bf16, last dims contiguous. ``nheads`` in
    16, 32, 64, 128. Scores ``(q_nope . ckv + q_pe . kpe) * softmax_scale`` (default
    ``576 ** -0.5``); ``causal`` masks bottom-right aligned (query ``i`` of ``seqlen_q``
    sees keys ``<= i + cache_seqlens[b] - seqlen_q``). Returns out ``(batch, seqlen_q,
    nheads, 512)`` in the input dtype, or ``(out, lse)`` with lse ``(batch, nheads,
    seqlen_q)`` fp32, natural log (-inf and out 0 for a query that sees no key).
    ``num_splits``: 0 = heuristic from the shapes, 1 = none, n = n KV splits.

    No device synchronisation: lengths beyond the table's capacity and page ids outside
    the pool are clamped in the kernel (wrong results, never an illegal read). A
    repeated call (same shapes, strides, dtypes, arguments) skips validation and planning."""
    key = interface._call_key("mla", (q_nope, q_pe, ckv_cache, kpe_cache, cache_seqlens, page_table, out),
                              (softmax_scale, causal, num_splits, return_lse, backend), ())
    hit, key = interface._lookup(key)
    if hit is not None:
        if out is None:
            out = q_nope.new_empty(hit.out_shape)
        lse = q_nope.new_empty(hit.lse_shape, dtype=torch.float32) if return_lse else None
        run_resolved(hit.resolved, hit.problem, q_nope, q_pe, ckv_cache, kpe_cache, out, lse, cache_seqlens,
                     page_table)
        return (out, lse) if return_lse else out
    inputs = (q_nope, q_pe, ckv_cache, kpe_cache, out)
    q_nope, q_pe, ckv_cache, kpe_cache, out, scale, num_splits, name = _validate(
        q_nope, q_pe, ckv_cache, kpe_cache, cache_seqlens, page_table, softmax_scale, causal, num_splits, out,
        backend)
    batch, seqlen_q, nheads, _ = q_nope.shape
    out_shape, lse_shape = (batch, seqlen_q, nheads, D_CKV), (batch, nheads, seqlen_q)
    if out is None:
        out = q_nope.new_empty(out_shape)
    lse = q_nope.new_empty(lse_shape, dtype=torch.float32) if return_lse else None
    capacity = page_table.shape[1] * ckv_cache.shape[1]
    if batch == 0 or capacity == 0 or ckv_cache.shape[0] == 0:
        out.zero_()
        if lse is not None:
            lse.fill_(-math.inf)
        return (out, lse) if return_lse else out
    problem = MlaProblem(q_nope.dtype, batch, seqlen_q, capacity, nheads, ckv_cache.shape[1], scale, causal,
                         bool(return_lse))
    resolved = resolve(problem, name, num_splits, q_nope.device)
    run_resolved(resolved, problem, q_nope, q_pe, ckv_cache, kpe_cache, out, lse, cache_seqlens, page_table)
    if key is not None and all(a is b for a, b in zip(inputs, (q_nope, q_pe, ckv_cache, kpe_cache, out))):
        if len(interface._fast_calls) >= interface._FAST_CACHE_SIZE:
            interface._fast_calls.clear()
        interface._fast_calls[key] = _MlaEntry(problem, resolved, out_shape, lse_shape)
    return (out, lse) if return_lse else out


def clear_plan_cache() -> None:
    _plan_cache.clear()

