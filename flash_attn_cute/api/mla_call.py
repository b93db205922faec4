"""``flash_mla_decode`` as a spec of the run path (``entry.Spec``): its validation into an
``MlaProblem``, and the MLA kernels' tensors (``call_args.MlaTensors``) from its
arguments; lookup, replay, planning, launch and storage are ``entry.run``'s.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from flash_attn_cute.api import checks
from flash_attn_cute.api.call_args import MlaTensors, cp_tensors, descale_view
from flash_attn_cute.api.entry import Checked, Spec
from flash_attn_cute.host.constants import D_CKV, D_KPE, MAX_SPLITS, MLA_MAX_NHEADS
from flash_attn_cute.host.problems import MlaProblem
from flash_attn_cute.host.registry import MLA_BACKENDS


def _backend(backend) -> Optional[str]:
    """``backend=`` must name an MLA backend; FLASH_ATTN_CUTE_BACKEND naming a backend
    without an MLA kernel means automatic choice here (it is set for the forward)."""
    name = checks.backend_name(backend)
    if name is None or name in MLA_BACKENDS:
        return name
    if backend is None:
        return None
    raise NotImplementedError(f"backend {name!r} has no MLA kernel (MLA backends: {tuple(MLA_BACKENDS)})")


def _check(q_nope, q_pe, ckv_cache, kpe_cache, cache_seqlens, page_table, softmax_scale, causal, num_splits,
           out, backend, batch_invariant=False, kv_descale=None, q_descale=None):
    """Shapes, then dtypes, then scalars, then the device; errors name the argument."""
    q_form = "(batch, seqlen_q, nheads, {})"
    checks.check_tensor("q_nope", q_nope, 4, q_form.format(D_CKV))
    checks.check_tensor("q_pe", q_pe, 4, q_form.format(D_KPE))
    cache_form = f"(num_pages, page_size, {D_CKV}) or (num_pages, page_size, nheads_kv, {D_CKV})"
    checks.check_tensor("ckv_cache", ckv_cache, ckv_cache.dim() if isinstance(ckv_cache, torch.Tensor) else 3,
                        cache_form)
    if ckv_cache.dim() not in (3, 4):
        raise ValueError(f"ckv_cache must have shape {cache_form} (rank 3, or 4 with FlashMLA's KV-head mode), "
                         f"got shape {tuple(ckv_cache.shape)}")
    kv_heads = ckv_cache.dim() == 4
    checks.check_tensor("kpe_cache", kpe_cache, ckv_cache.dim(),
                        f"(num_pages, page_size{', nheads_kv' if kv_heads else ''}, {D_KPE}) like ckv_cache")
    checks.check_tensor("page_table", page_table, 2, "(batch, max_pages_per_seq)")
    batch, seqlen_q, nheads, d = q_nope.shape
    for name, t, want in (("q_nope", q_nope, D_CKV), ("q_pe", q_pe, D_KPE), ("ckv_cache", ckv_cache, D_CKV),
                          ("kpe_cache", kpe_cache, D_KPE)):
        if t.shape[-1] != want:
            raise ValueError(f"{name} head dimension must be {want} (MLA: ckv 512, kpe 64), got {t.shape[-1]}")
    if tuple(q_pe.shape[:3]) != (batch, seqlen_q, nheads):
        raise ValueError(f"q_pe must have shape (batch, seqlen_q, nheads, 64) = {(batch, seqlen_q, nheads, D_KPE)} "
                         f"like q_nope, got {tuple(q_pe.shape)}")
    if tuple(kpe_cache.shape[:-1]) != tuple(ckv_cache.shape[:-1]):
        raise ValueError(f"kpe_cache (num_pages, page_size{', nheads_kv' if kv_heads else ''}, 64) must have the "
                         f"pages{' and KV heads' if kv_heads else ''} of ckv_cache, got {tuple(kpe_cache.shape)} "
                         f"and {tuple(ckv_cache.shape)}")
    nheads_kv = ckv_cache.shape[2] if kv_heads else 1
    if not 1 <= nheads <= MLA_MAX_NHEADS:
        raise ValueError(f"nheads (q_nope.shape[2]) must be in 1..{MLA_MAX_NHEADS}, got {nheads}")
    if nheads_kv < 1 or nheads % nheads_kv:
        raise ValueError(f"nheads (q_nope.shape[2] = {nheads}) must be a multiple of nheads_kv "
                         f"(ckv_cache.shape[2] = {nheads_kv}): each KV head serves nheads / nheads_kv query heads")
    if seqlen_q < 1:
        raise ValueError(f"seqlen_q (q_nope.shape[1]) must be >= 1, got {seqlen_q}")
    checks.page_table_arg(page_table, batch, ckv_cache.shape[1], "ckv_cache")
    checks.int32_vector("cache_seqlens", cache_seqlens, batch, "(batch,)")
    # FlashMLA's FP8 mode: e4m3 queries over an e4m3 cache
    e4m3_cache = ckv_cache.dtype == torch.float8_e4m3fn
    checks.check_dtype("q_nope", q_nope, checks.SUPPORTED_DTYPES + ((torch.float8_e4m3fn,) if e4m3_cache else ()),
                       "float16 or bfloat16" + (", or float8_e4m3fn (with q_descale)" if e4m3_cache else
                                                " (float8_e4m3fn queries need a float8_e4m3fn cache)"))
    checks.check_dtype("q_pe", q_pe, q_nope.dtype, f"{q_nope.dtype} like q_nope")
    if ckv_cache.dtype in checks.FP8_DTYPES:  # an FP8 latent cache: one dtype, one descale
        checks.check_dtype("kpe_cache", kpe_cache, ckv_cache.dtype, f"{ckv_cache.dtype} like ckv_cache")
    else:
        for name, t in (("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):
            checks.check_dtype(name, t, q_nope.dtype, f"{q_nope.dtype} like q_nope, or an FP8 dtype "
                                                      f"{checks.FP8_DTYPES} (both caches)")
    for name, d in (("kv_descale", kv_descale), ("q_descale", q_descale)):
        checks.descale(name, d, ((batch,), (batch, 1), (batch, nheads_kv)),
                       f"one element or shape (batch,) = {(batch,)}, (batch, 1) or FA3's (batch, nheads_kv) = "
                       f"{(batch, nheads_kv)}")
    scale = checks.softmax_scale(softmax_scale, (D_CKV + D_KPE) ** -0.5)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    num_splits = checks.int_arg("num_splits", num_splits, 0, MAX_SPLITS)
    if not isinstance(batch_invariant, bool):
        raise TypeError(f"batch_invariant must be a bool, got {type(batch_invariant).__name__}")
    backend = _backend(backend)
    tensors = [checks.aligned(n, t) for n, t in (("q_nope", q_nope), ("q_pe", q_pe), ("ckv_cache", ckv_cache),
                                                  ("kpe_cache", kpe_cache))]
    out = checks.check_out(out, (batch, seqlen_q, nheads, D_CKV), _out_dtype(q_nope.dtype), q_form.format(D_CKV))
    checks.check_device({"q_nope": q_nope, "q_pe": q_pe, "ckv_cache": ckv_cache, "kpe_cache": kpe_cache,
                         "cache_seqlens": cache_seqlens, "page_table": page_table, "out": out,
                         "kv_descale": kv_descale, "q_descale": q_descale})
    return (*tensors, out, scale, num_splits, backend)


def _kernel_caches(problem: MlaProblem, ckv_cache, kpe_cache) -> tuple:
    """The caches as the kernels take them: 3-D for one latent head (FlashMLA's 4-D form with
    nheads_kv 1 loses its KV-head mode, a view: the kernels of the 3-D form run it), else
    as given."""
    if problem.kv_heads or ckv_cache.dim() == 3:
        return ckv_cache, kpe_cache
    return ckv_cache[:, :, 0], kpe_cache[:, :, 0]


def _out_dtype(q_dtype: torch.dtype) -> torch.dtype:
    """The output's dtype: the queries', bf16 for FP8 queries (as FlashMLA's FP8 mode)."""
    return torch.bfloat16 if q_dtype.itemsize == 1 else q_dtype


def kv_descale_view(problem: MlaProblem, kv_descale, device, fp8: bool = None):
    """The cache's descale as the kernels read it, for an FP8 cache (``fp8``; None: the
    problem's cache is FP8): fp32 ``(batch,)`` for one latent head, ``(batch, nheads_kv)``
    with a KV-head mode (broadcast views of one element, of ``(batch,)`` and of ``(batch,
    1)``; 1.0 when None); else None (a 16-bit cache ignores it). FP8 queries' ``q_descale``
    the same way."""
    if not (problem.kv_fp8 if fp8 is None else fp8):
        return None
    if kv_descale is None or kv_descale.numel() == 1:
        view = descale_view(kv_descale, problem.batch, problem.nheads_kv, device)
        return view if problem.kv_heads else view[:, 0]
    if not problem.kv_heads:
        return kv_descale.reshape(problem.batch)  # (batch,) or (batch, 1)
    return kv_descale.reshape(problem.batch, -1).expand(problem.batch, problem.nheads_kv)


def check_schedule_args(cache_seqlens, nheads, nheads_kv, seqlen_q) -> None:
    """``get_mla_metadata``'s arguments."""
    checks.int32_vector("cache_seqlens", cache_seqlens, cache_seqlens.shape[0] if isinstance(
        cache_seqlens, torch.Tensor) else 0, "(batch,)")
    checks.check_device({"cache_seqlens": cache_seqlens})
    for name, value, low in (("nheads", nheads, 1), ("nheads_kv", nheads_kv, 1), ("seqlen_q", seqlen_q, 1)):
        checks.int_arg(name, value, low, 1 << 30)
    if nheads % nheads_kv:
        raise ValueError(f"nheads ({nheads}) must be a multiple of nheads_kv ({nheads_kv})")


def _schedule_parts(schedule, batch: int, device) -> int:
    """The CTAs per grid slice ``scheduler_metadata`` (``get_mla_metadata``) was made for;
    0 without one."""
    if schedule is None:
        return 0
    from flash_attn_cute.host.mla_schedule import parts_of

    if not isinstance(schedule, torch.Tensor) or schedule.dtype != torch.int32 or schedule.dim() != 1 \
            or not schedule.is_contiguous():
        raise TypeError("scheduler_metadata must be the int32 tensor get_mla_metadata returns")
    parts = parts_of(schedule.numel(), batch)
    if not 1 <= parts < MAX_SPLITS:
        raise ValueError(f"scheduler_metadata has {schedule.numel()} elements: not a get_mla_metadata schedule "
                         f"for a batch of {batch}")
    if schedule.device != device:
        raise ValueError(f"scheduler_metadata is on {schedule.device} but q_nope is on {device}")
    return parts


def _validate(args: dict) -> Checked:
    q_nope, q_pe, ckv_cache, kpe_cache, out, scale, num_splits, name = _check(
        args["q_nope"], args["q_pe"], args["ckv_cache"], args["kpe_cache"], args["cache_seqlens"],
        args["page_table"], args.get("softmax_scale"), args.get("causal", False), args.get("num_splits", 0),
        args.get("out"), args.get("backend"), args.get("batch_invariant", False), args.get("kv_descale"),
        args.get("q_descale"))
    args = dict(args, q_nope=q_nope, q_pe=q_pe, ckv_cache=ckv_cache, kpe_cache=kpe_cache, out=out)
    batch, seqlen_q, nheads, _ = q_nope.shape
    out_shape, lse_shape = (batch, seqlen_q, nheads, D_CKV), (batch, nheads, seqlen_q)
    capacity = args["page_table"].shape[1] * ckv_cache.shape[1]
    cp = checks.context_parallel(args, batch, bool(args.get("causal")), q_nope.device)
    schedule_parts = _schedule_parts(args.get("scheduler_metadata"), batch, q_nope.device)
    problem = None
    if batch and capacity and ckv_cache.shape[0]:
        problem = MlaProblem(
            dtype=q_nope.dtype, batch=batch, max_seqlen_q=seqlen_q, max_seqlen_k=capacity, nheads=nheads,
            page_size=ckv_cache.shape[1], softmax_scale=scale, causal=bool(args.get("causal")),
            has_lse=bool(args.get("return_lse")), batch_invariant=bool(args.get("batch_invariant")),
            kv_dtype=ckv_cache.dtype if ckv_cache.dtype in checks.FP8_DTYPES else None,
            nheads_kv=ckv_cache.shape[2] if ckv_cache.dim() == 4 else 1, cp=cp, schedule_parts=schedule_parts)
    return Checked(args, problem, out_shape, lse_shape, name, num_splits, None)


def _tensors(entry, args: dict, out, lse) -> MlaTensors:
    problem = entry.problem
    ckv, kpe = _kernel_caches(problem, args["ckv_cache"], args["kpe_cache"])
    device = args["q_nope"].device
    # The schedule only where the plan runs it (another kernel plans its splits on the host).
    schedule = args.get("scheduler_metadata") if entry.resolved.plan.scheduled else None
    return MlaTensors(args["q_nope"], args["q_pe"], ckv, kpe, out, lse, args["cache_seqlens"], args["page_table"],
                      kv_descale_view(problem, args.get("kv_descale"), device),
                      kv_descale_view(problem, args.get("q_descale"), device, problem.q_fp8),
                      **cp_tensors(problem, args, device), schedule=schedule)


def _empty(c: Checked):
    """No page or no sequence: out 0, lse -inf."""
    q = c.args["q_nope"]
    out = c.args.get("out")
    if out is None:
        out = q.new_empty(c.out_shape, dtype=_out_dtype(q.dtype))
    out.zero_()
    if not c.args.get("return_lse"):
        return out
    return out, torch.full(c.lse_shape, -math.inf, dtype=torch.float32, device=q.device)


MLA = Spec("mla", ("q_nope", "q_pe", "ckv_cache", "kpe_cache", "cache_seqlens", "page_table", "out", "kv_descale",
                   "q_descale", "softmax_scale", "causal", "num_splits", "return_lse", "backend", "batch_invariant",
                   "scheduler_metadata", *checks.CP_ARGS),
           _validate, _tensors, _empty, lambda args: _out_dtype(args["q_nope"].dtype), device_arg="q_nope",
           inputs=("q_nope", "q_pe", "ckv_cache", "kpe_cache", "out"))
