"""Multi-head latent attention (DeepSeek V2/V3 style) decode over a paged latent cache.

Every query head attends to one shared cache of 512 ``ckv`` plus 64 rotary ``kpe`` values
per token (with a KV-head mode, FlashMLA's ``h_kv``: its group's KV head of the cache):
scores ``(q_nope . ckv + q_pe . kpe) * softmax_scale``, output ``softmax(scores) . ckv``.
Any head count from 1 to 128: the kernels pack a KV head's query heads x query positions
into 64-row tiles and predicate the partial last one (``mla_kernel``), so q and out are
never padded or copied. The public entry point is ``flash_mla_decode``: it validates the
call (``checks``), describes it as an ``MlaProblem`` and runs it through the seam every
kernel family shares (``seam.py``: the ``"mla"`` kind, backends in ``seam.MLA_BACKENDS``),
with the per-call cache of the forward entry points (``call_cache``). Split-KV partials
(fp32) are merged by the package's combine kernel (d_v 512). The host path never
synchronises with the device: the kernels clamp each length to ``max_pages_per_seq *
page_size`` and each page id into the pool.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from flash_attn_cute.api import call_cache, checks
from flash_attn_cute.host import tuning
from flash_attn_cute import seam
from flash_attn_cute.host.constants import D_CKV, D_KPE, MAX_SPLITS, MLA_MAX_NHEADS, MLA_NHEADS
from flash_attn_cute.seam import MLA_BACKENDS
from flash_attn_cute.host.problems import MlaProblem

__all__ = ["flash_mla_decode", "MlaProblem", "MLA_BACKENDS", "MLA_NHEADS", "MLA_MAX_NHEADS", "D_CKV", "D_KPE"]


def _backend(backend) -> Optional[str]:
    """``backend=`` must name an MLA backend; FLASH_ATTN_CUTE_BACKEND naming a backend
    without an MLA kernel means automatic choice here (it is set for the forward)."""
    name = checks.backend_name(backend)
    if name is None or name in MLA_BACKENDS:
        return name
    if backend is None:
        return None
    raise NotImplementedError(f"backend {name!r} has no MLA kernel (MLA backends: {tuple(MLA_BACKENDS)})")


def _validate(q_nope, q_pe, ckv_cache, kpe_cache, cache_seqlens, page_table, softmax_scale, causal, num_splits,
              out, backend, batch_invariant=False, kv_descale=None):
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
    checks.check_dtype("q_nope", q_nope, checks.SUPPORTED_DTYPES, "float16 or bfloat16")
    checks.check_dtype("q_pe", q_pe, q_nope.dtype, f"{q_nope.dtype} like q_nope")
    if ckv_cache.dtype in checks.FP8_DTYPES:  # an FP8 latent cache: one dtype, one descale
        checks.check_dtype("kpe_cache", kpe_cache, ckv_cache.dtype, f"{ckv_cache.dtype} like ckv_cache")
    else:
        for name, t in (("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):
            checks.check_dtype(name, t, q_nope.dtype, f"{q_nope.dtype} like q_nope, or an FP8 dtype "
                                                      f"{checks.FP8_DTYPES} (both caches)")
    checks.descale("kv_descale", kv_descale, ((batch,), (batch, 1), (batch, nheads_kv)),
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
    out = checks.check_out(out, (batch, seqlen_q, nheads, D_CKV), q_nope.dtype, q_form.format(D_CKV))
    checks.check_device({"q_nope": q_nope, "q_pe": q_pe, "ckv_cache": ckv_cache, "kpe_cache": kpe_cache,
                         "cache_seqlens": cache_seqlens, "page_table": page_table, "out": out,
                         "kv_descale": kv_descale})
    return (*tensors, out, scale, num_splits, backend)


def _kernel_caches(problem: MlaProblem, ckv_cache, kpe_cache) -> tuple:
    """The caches as the kernels take them: 3-D for one latent head (FlashMLA's 4-D form with
    nheads_kv 1 loses its KV-head mode, a view: the kernels of the 3-D form run it), else
    as given."""
    if problem.kv_heads or ckv_cache.dim() == 3:
        return ckv_cache, kpe_cache
    return ckv_cache[:, :, 0], kpe_cache[:, :, 0]


def _kv_descale_view(problem: MlaProblem, kv_descale, device):
    """The cache's descale as the kernels read it, for an FP8 cache: fp32 ``(batch,)`` for
    one latent head, ``(batch, nheads_kv)`` with a KV-head mode (broadcast views of one
    element, of ``(batch,)`` and of ``(batch, 1)``; 1.0 when None); else None (a 16-bit
    cache ignores it)."""
    if not problem.kv_fp8:
        return None
    if kv_descale is None or kv_descale.numel() == 1:
        view = checks.descale_view(kv_descale, problem.batch, problem.nheads_kv, device)
        return view if problem.kv_heads else view[:, 0]
    if not problem.kv_heads:
        return kv_descale.reshape(problem.batch)  # (batch,) or (batch, 1)
    return kv_descale.reshape(problem.batch, -1).expand(problem.batch, problem.nheads_kv)


def flash_mla_decode(q_nope, q_pe, ckv_cache, kpe_cache, cache_seqlens, page_table, *, softmax_scale=None,
                     causal=False, num_splits=0, return_lse=False, out=None, backend=None, batch_invariant=False,
                     kv_descale=None):
    """MLA decode against a paged latent cache.

    q_nope ``(batch, seqlen_q, nheads, 512)``, q_pe ``(batch, seqlen_q, nheads, 64)``;
    ckv_cache ``(num_pages, page_size, 512)``, kpe_cache ``(num_pages, page_size, 64)``
    (any ``page_size >= 1``), or with a KV-head mode (FlashMLA's ``h_kv``) ``(num_pages,
    page_size, nheads_kv, 512)`` and ``(..., nheads_kv, 64)``: KV head ``j`` serves the query
    heads ``[j * g, (j + 1) * g)``, ``g = nheads / nheads_kv``; page_table ``(batch,
    max_pages_per_seq)`` int32; cache_seqlens ``(batch,)`` int32. fp16 or bf16, last dims
    contiguous, other strides multiples of 16 bytes: FlashMLA's combined 576-wide q and
    k_cache are taken as views (``q[..., :512]``, ``q[..., 512:]``, ``k_cache[..., :512]``,
    ``k_cache[..., 512:]``), never copied. ``nheads`` any count from 1 to 128 (a multiple of
    ``nheads_kv``). Scores ``(q_nope . ckv + q_pe . kpe) * softmax_scale`` (default
    ``576 ** -0.5``); ``causal`` masks bottom-right aligned (query ``i`` of ``seqlen_q``
    sees keys ``<= i + cache_seqlens[b] - seqlen_q``). Returns out ``(batch, seqlen_q,
    nheads, 512)`` in the input dtype, or ``(out, lse)`` with lse ``(batch, nheads,
    seqlen_q)`` fp32, natural log (-inf and out 0 for a query that sees no key).
    ``num_splits``: 0 = heuristic from the shapes, 1 = none, n = n KV splits.
    ``batch_invariant=True``: a sequence's output and LSE are bitwise the same whatever else
    is in the batch (a fixed number of keys per KV split; ``num_splits`` is then ignored).

    FP8 latent cache: ``ckv_cache`` and ``kpe_cache`` both ``float8_e4m3fn`` (or
    ``float8_e5m2``), the queries fp16/bf16, and ``kv_descale`` fp32 (one element, or
    ``(batch,)`` / ``(batch, 1)``, or FA3's ``(batch, nheads_kv)``; default 1) the factor
    that turns the stored values of
    both caches back into real ones (one scale per token's 576 values, as vLLM stores an
    MLA cache; quantize with ``quantize_fp8(torch.cat([ckv, kpe], -1), granularity=
    "tensor")``). The kernels widen the cache to 16 bits in shared memory; scores and
    output use the descale. On the GPUs the MLA kernels run on that have fp8 conversions
    (sm_90, sm_100; not the A100). ``kv_descale`` is ignored for a 16-bit cache.

    No device synchronisation: lengths beyond the table's capacity and page ids outside
    the pool are clamped in the kernel (wrong results, never an illegal read). A
    repeated call (same shapes, strides, dtypes, arguments) skips validation and planning."""
    hit, key = call_cache.lookup(call_cache.key(
        "mla", (q_nope, q_pe, ckv_cache, kpe_cache, cache_seqlens, page_table, out, kv_descale),
        (softmax_scale, causal, num_splits, return_lse, backend, batch_invariant)))
    if hit is not None:
        if out is None:
            out = q_nope.new_empty(hit.out_shape)
        lse = q_nope.new_empty(hit.lse_shape, dtype=torch.float32) if return_lse else None
        seam.run_resolved(hit.resolved, hit.problem, (q_nope, q_pe, *_kernel_caches(hit.problem, ckv_cache, kpe_cache)),
                         out, lse,
                         (cache_seqlens, page_table, _kv_descale_view(hit.problem, kv_descale, q_nope.device)))
        return (out, lse) if return_lse else out
    inputs = (q_nope, q_pe, ckv_cache, kpe_cache, out)
    q_nope, q_pe, ckv_cache, kpe_cache, out, scale, num_splits, name = _validate(
        q_nope, q_pe, ckv_cache, kpe_cache, cache_seqlens, page_table, softmax_scale, causal, num_splits, out,
        backend, batch_invariant, kv_descale)
    # Cacheable when validation handed the tensors through unchanged (checked before out is allocated).
    fast_key = call_cache.same(key, inputs, (q_nope, q_pe, ckv_cache, kpe_cache, out))
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
    problem = MlaProblem(dtype=q_nope.dtype, batch=batch, max_seqlen_q=seqlen_q, max_seqlen_k=capacity, nheads=nheads,
                         page_size=ckv_cache.shape[1], softmax_scale=scale, causal=causal, has_lse=bool(return_lse),
                         batch_invariant=batch_invariant,
                         kv_dtype=ckv_cache.dtype if ckv_cache.dtype in checks.FP8_DTYPES else None,
                         nheads_kv=ckv_cache.shape[2] if ckv_cache.dim() == 4 else 1)
    resolved = seam.resolve(problem, name, num_splits, None, q_nope.device, tuning.from_env())
    seam.run_resolved(resolved, problem, (q_nope, q_pe, *_kernel_caches(problem, ckv_cache, kpe_cache)), out, lse,
                     (cache_seqlens, page_table, _kv_descale_view(problem, kv_descale, q_nope.device)))
    call_cache.store(fast_key, call_cache.Entry(problem, resolved, out_shape, lse_shape))
    return (out, lse) if return_lse else out
