"""Public API: FlashAttention forward (inference only, no autograd).

Three entry points share one internal ``_flash_attn_fwd`` that picks the backend,
resolves ``pack_gqa`` and ``num_splits``, launches the kernel and, for split-KV,
the combine kernel:

- ``flash_attn_func``          dense batch: q ``(b, s_q, h, d)``, k/v ``(b, s_k, h_kv, d*)``
- ``flash_attn_varlen_func``   packed sequences with ``cu_seqlens``: q ``(total_q, h, d)``
- ``flash_attn_with_kvcache``  decode against a (possibly paged) KV cache
- ``flash_attn_combine``       merge split-KV partial results

Semantics: scores are ``softmax_scale * q.k`` (default ``d ** -0.5``), then
``softcap * tanh(s / softcap)`` when ``softcap > 0``. ``causal`` and windows are aligned
to the bottom-right corner: query ``i`` sees key ``j`` when
``i + s_k - s_q - window_left <= j <= i + s_k - s_q + window_right`` (a side of -1 is
unbounded; causal is ``window_right = 0``). ``lse`` is the natural-log sum of exp of the
(scaled, capped) scores, ``-inf`` for a query that sees no key (its output is 0).

Every argument is validated (shapes, then dtypes, then scalars, then the device) before
anything is launched; errors name the argument and the expected form.
"""

from __future__ import annotations

import math
import numbers

import torch

from . import call_cache, checks, fwd, ops, tuning, user_variants
from .backend_kit import NO_VARIANT
from .checks import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, normalize_window  # noqa: F401  (public names)
from .constants import INT32_MAX, MAX_SPLITS
from .problems import FwdProblem

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "flash_attn_combine",
           "SUPPORTED_HEAD_DIMS", "SUPPORTED_DTYPES", "MAX_SPLITS", "BACKENDS"]

BACKENDS = checks.BACKEND_NAMES  # names accepted by ``backend=`` / FLASH_ATTN_CUTE_BACKEND

# ---------------------------------------------------------------------------------------
# Per-call cache replay (``call_cache``: a repeated call skips validation and planning)
# ---------------------------------------------------------------------------------------


def _aux_list(aux_tensors) -> tuple:
    """The aux tensors as extra per-call-key tensors (a non-list value makes the key fail
    to hash or compare, and the full path then validates it)."""
    if aux_tensors is None:
        return ()
    return tuple(aux_tensors) if isinstance(aux_tensors, (list, tuple)) else (aux_tensors,)


def _aux_of(aux_tensors, block_mask):
    return block_mask.aux_tensors if aux_tensors is None and block_mask is not None else aux_tensors


def _no_variant_under_compile(*variant_args) -> None:
    if any(a is not None for a in variant_args):
        raise NotImplementedError("score_mod / mask_mod / aux_tensors / block_mask are not traceable by "
                                  "torch.compile yet: call flash_attn_cute outside the compiled region")


def _replay(entry: call_cache.Entry, q, k, v, out, return_lse, cu_seqlens_q=None, cu_seqlens_k=None,
            seqused_k=None, page_table=None, aux_tensors=None):
    if out is None:
        out = q.new_empty(entry.out_shape)
    lse = q.new_empty(entry.lse_shape, dtype=torch.float32) if return_lse else None
    if entry.seqlens_fill is not None:
        seqused_k = torch.full((entry.problem.batch,), entry.seqlens_fill, dtype=torch.int32, device=q.device)
    rest = (cu_seqlens_q, cu_seqlens_k, seqused_k, page_table)
    if entry.problem.variant is not None:
        rest += (user_variants.kernel_aux(aux_tensors or ()) + (entry.block_ranges,),)
    fwd.run_resolved(entry.resolved, entry.problem, (q, k, v), out, lse, rest)
    return (out, lse) if return_lse else out


def clear_call_cache() -> None:
    """Forget every cached call and every resolved plan (``call_cache.clear``)."""
    call_cache.clear()


# ---------------------------------------------------------------------------------------
# Shared launch path
# ---------------------------------------------------------------------------------------


def _flash_attn_fwd(q, k, v, out, opts: checks.Options, *, batch: int, max_seqlen_q: int, max_seqlen_k: int,
                    nheads: int, nheads_kv: int, d_v: int, return_lse: bool, cu_seqlens_q=None, cu_seqlens_k=None,
                    seqused_k=None, page_table=None, fast_key=None, seqlens_fill=None, variant=None):
    """Allocate outputs, describe the call as a ``FwdProblem`` and run it through the
    dispatch seam (``fwd.resolve`` and ``fwd.run_resolved``: backend, plan, launch, combine).

    ``max_seqlen_k == 0`` (or an empty batch) means every query sees no key: out is 0 and
    lse -inf, with no launch."""
    varlen = cu_seqlens_q is not None
    lse_shape = (nheads, q.shape[0]) if varlen else (batch, nheads, q.shape[1])
    if out is None:
        out = q.new_empty(*q.shape[:-1], d_v)
    lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device) if return_lse else None
    if out.numel() == 0 or batch == 0 or max_seqlen_q == 0 or max_seqlen_k == 0:
        out.zero_()
        if lse is not None:
            lse.fill_(-math.inf)
        return (out, lse) if return_lse else out
    spec, variant_tensors, block_ranges = (None, NO_VARIANT, None) if variant is None else variant
    problem = FwdProblem(
        dtype=q.dtype, batch=batch, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, nheads=nheads,
        nheads_kv=nheads_kv, d=q.shape[-1], d_v=d_v, softmax_scale=opts.softmax_scale, causal=opts.causal,
        window_left=opts.window_left, window_right=opts.window_right, softcap=opts.softcap, varlen_q=varlen,
        varlen_k=cu_seqlens_k is not None, has_seqused_k=seqused_k is not None,
        page_size=k.shape[1] if page_table is not None else 0, has_lse=return_lse, variant=spec)
    resolved = fwd.resolve(problem, opts.backend, opts.num_splits, opts.pack_gqa, q.device, tuning.from_env())
    rest = (cu_seqlens_q, cu_seqlens_k, seqused_k, page_table)
    if spec is not None:
        rest += (variant_tensors,)
    fwd.run_resolved(resolved, problem, (q, k, v), out, lse, rest)
    call_cache.store(fast_key, call_cache.Entry(problem, resolved, tuple(out.shape), lse_shape, seqlens_fill,
                                                block_ranges))
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------
# Public entry points
# ---------------------------------------------------------------------------------------

_Q4 = "(batch, seqlen_q, nheads, headdim)"


def flash_attn_func(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    num_splits=1, pack_gqa=None, return_lse=False, out=None, backend=None, score_mod=None,
                    mask_mod=None, aux_tensors=None, block_mask=None):
    """Attention over a dense batch.

    q ``(batch, seqlen_q, nheads, d)``, k ``(batch, seqlen_k, nheads_kv, d)``, v
    ``(batch, seqlen_k, nheads_kv, d_v)``; fp16 or bf16, last dim contiguous (other strides
    free). ``nheads`` a multiple of ``nheads_kv`` (GQA/MQA). ``num_splits``: 1 = no split-KV,
    0 = heuristic, n = n splits (<= 256). ``pack_gqa``: None = heuristic. Returns out
    ``(batch, seqlen_q, nheads, d_v)`` in q's dtype, or ``(out, lse)`` with lse
    ``(batch, nheads, seqlen_q)`` fp32 when ``return_lse``. ``out`` may be preallocated.

    User variants (``user_variants.py``, examples in ``mods.py``): ``score_mod(score, b, h,
    q_idx, kv_idx, aux)`` rewrites each scaled score, ``mask_mod(b, h, q_idx, kv_idx, aux)``
    keeps a score where True (ANDed with causal / window_size), ``aux_tensors`` (<= 4
    tensors) is their ``aux``, ``block_mask`` (``create_block_mask``) lets the kernel skip
    empty blocks and the predicate on full ones."""
    if torch.compiler.is_compiling():
        _no_variant_under_compile(score_mod, mask_mod, aux_tensors, block_mask)
        return ops.traced_call("func", q, k, v, out, max_seqlen_q=q.shape[1], softmax_scale=softmax_scale,
                               causal=causal, window_size=window_size, softcap=softcap, num_splits=num_splits,
                               pack_gqa=pack_gqa, return_lse=return_lse, backend=backend)
    hit, key = call_cache.lookup(call_cache.key("func", (q, k, v, out, *_aux_list(aux_tensors)),
                                 (softmax_scale, causal, softcap, num_splits, pack_gqa, return_lse, backend, score_mod,
                                  mask_mod, block_mask), window_size))
    if hit is not None:
        return _replay(hit, q, k, v, out, return_lse, aux_tensors=_aux_of(aux_tensors, block_mask))
    inputs = (q, k, v, out)
    checks.check_tensor("q", q, 4, _Q4)
    nheads, nheads_kv, d, d_v, q, k, v = checks.qkv(
        q, k, v, _Q4, 4, "(batch, seqlen_k, nheads_kv, headdim)", "(batch, seqlen_k, nheads_kv, headdim_v)")
    batch, seqlen_q = q.shape[:2]
    if k.shape[0] != batch:
        raise ValueError(f"k and v must have the batch size of q ({batch}), got {k.shape[0]}")
    opts = checks.options(d, softmax_scale, causal, window_size, softcap, num_splits, pack_gqa, backend)
    out = checks.check_out(out, (batch, seqlen_q, nheads, d_v), q.dtype, "(batch, seqlen_q, nheads, headdim_v)")
    checks.check_device({"q": q, "k": k, "v": v, "out": out})
    opts, variant = checks.user_variant(score_mod, mask_mod, aux_tensors, block_mask, opts, q.device, batch=batch,
                             nheads=nheads, max_seqlen_q=seqlen_q, max_seqlen_k=k.shape[1])
    return _flash_attn_fwd(q, k, v, out, opts, batch=batch, max_seqlen_q=seqlen_q, max_seqlen_k=k.shape[1],
                           nheads=nheads, nheads_kv=nheads_kv, d_v=d_v, return_lse=bool(return_lse),
                           fast_key=call_cache.same(key, inputs, (q, k, v, out)), variant=variant)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           num_splits=1, pack_gqa=None, return_lse=False, out=None, backend=None, score_mod=None,
                           mask_mod=None, aux_tensors=None, block_mask=None):
    """Attention over packed variable-length sequences.

    q ``(total_q, nheads, d)``, k ``(total_k, nheads_kv, d)``, v ``(total_k, nheads_kv, d_v)``;
    sequence ``b`` is rows ``cu_seqlens[b]:cu_seqlens[b+1]`` (int32, ``(batch + 1,)``,
    starting at 0, non-decreasing; zero-length sequences are fine; not checked on the
    host: that would need a device sync). ``max_seqlen_q/k`` bound the lengths (used for
    the grid and heuristics). Returns out ``(total_q, nheads, d_v)``, and lse
    ``(nheads, total_q)`` when ``return_lse``; causal/windows align each sequence's own
    bottom-right corner. User variants as in ``flash_attn_func`` (``q_idx``/``kv_idx``
    are positions inside each sequence; ``b`` its index)."""
    if torch.compiler.is_compiling():
        _no_variant_under_compile(score_mod, mask_mod, aux_tensors, block_mask)
        return ops.traced_call("varlen", q, k, v, out, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                               max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale,
                               causal=causal, window_size=window_size, softcap=softcap, num_splits=num_splits,
                               pack_gqa=pack_gqa, return_lse=return_lse, backend=backend)
    hit, key = call_cache.lookup(call_cache.key("varlen", (q, k, v, cu_seqlens_q, cu_seqlens_k, out, *_aux_list(aux_tensors)),
                                 (max_seqlen_q, max_seqlen_k, softmax_scale, causal, softcap, num_splits, pack_gqa,
                                  return_lse, backend, score_mod, mask_mod, block_mask), window_size))
    if hit is not None:
        return _replay(hit, q, k, v, out, return_lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                       aux_tensors=_aux_of(aux_tensors, block_mask))
    inputs = (q, k, v, out)
    checks.check_tensor("q", q, 3, "(total_q, nheads, headdim)")
    nheads, nheads_kv, d, d_v, q, k, v = checks.qkv(
        q, k, v, "(total_q, nheads, headdim)", 3, "(total_k, nheads_kv, headdim)", "(total_k, nheads_kv, headdim_v)")
    checks.check_tensor("cu_seqlens_q", cu_seqlens_q, 1, "(batch + 1,)")
    batch = cu_seqlens_q.shape[0] - 1
    if batch < 0:
        raise ValueError("cu_seqlens_q must have shape (batch + 1,) with at least one entry, got (0,)")
    checks.int32_vector("cu_seqlens_q", cu_seqlens_q, batch + 1, "(batch + 1,)")
    checks.int32_vector("cu_seqlens_k", cu_seqlens_k, batch + 1, "(batch + 1,) like cu_seqlens_q")
    max_seqlen_q = checks.int_arg("max_seqlen_q", max_seqlen_q, 0, INT32_MAX)
    max_seqlen_k = checks.int_arg("max_seqlen_k", max_seqlen_k, 0, INT32_MAX)
    opts = checks.options(d, softmax_scale, causal, window_size, softcap, num_splits, pack_gqa, backend)
    out = checks.check_out(out, (q.shape[0], nheads, d_v), q.dtype, "(total_q, nheads, headdim_v)")
    checks.check_device({"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k, "out": out})
    opts, variant = checks.user_variant(score_mod, mask_mod, aux_tensors, block_mask, opts, q.device, batch=batch,
                             nheads=nheads, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    if k.shape[0] == 0:
        max_seqlen_k = 0
    return _flash_attn_fwd(q, k, v, out, opts, batch=batch, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                           nheads=nheads, nheads_kv=nheads_kv, d_v=d_v, return_lse=bool(return_lse),
                           cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                           fast_key=call_cache.same(key, inputs, (q, k, v, out)), variant=variant)


def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, *, page_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0, num_splits=0, pack_gqa=None,
                            return_lse=False, out=None, backend=None, check_cache_bounds=False, score_mod=None,
                            mask_mod=None, aux_tensors=None, block_mask=None):
    """Attention of new queries against a KV cache (decode, speculative decode, chunked prefill).

    q ``(batch, seqlen_q, nheads, d)``. Without ``page_table`` the caches are
    ``(batch, max_seqlen_k, nheads_kv, d*)``; with it they are
    ``(num_pages, page_size, nheads_kv, d*)`` (any ``page_size >= 1``) and ``page_table``
    ``(batch, max_pages_per_seq)`` int32 lists each sequence's pages. ``cache_seqlens``
    ``(batch,)`` int32 (or an int for all) is the number of valid keys of each sequence;
    the queries are its last ``seqlen_q`` positions for causal/windows.

    Safety: the kernel never reads outside the cache, without any host-side check: it
    clamps each sequence's length to the capacity (``max_seqlen_k``, or
    ``max_pages_per_seq * page_size``) and each page id into ``[0, num_pages)``, so an
    out-of-range ``cache_seqlens`` or page-table entry gives wrong results, never an
    illegal read. The default path never synchronises with the device, so it can be
    captured in a CUDA graph and costs no round trip (the split heuristic then plans for
    the capacity). ``check_cache_bounds=True`` (a debugging aid) reads ``cache_seqlens``
    and the referenced page-table entries back to the host, raises ValueError on any
    value out of range, and plans for the true maximum length: one device-to-host sync
    per call (0.15-0.3 ms on the H200), skipped under CUDA-graph capture.

    User variants as in ``flash_attn_func``: ``q_idx`` counts the new queries from 0 and
    ``kv_idx`` the cache positions (a query's own position is ``q_idx + cache_seqlens[b]
    - seqlen_q``: pass cache_seqlens in ``aux_tensors`` to use it)."""
    if torch.compiler.is_compiling():
        _no_variant_under_compile(score_mod, mask_mod, aux_tensors, block_mask)
        return ops.traced_call("kvcache", q, k_cache, v_cache, out, cache_seqlens=cache_seqlens, page_table=page_table,
                               max_seqlen_q=q.shape[1], softmax_scale=softmax_scale, causal=causal,
                               window_size=window_size, softcap=softcap, num_splits=num_splits, pack_gqa=pack_gqa,
                               return_lse=return_lse, backend=backend)
    key = None
    if not check_cache_bounds:
        int_seqlens = cache_seqlens if not isinstance(cache_seqlens, torch.Tensor) else None
        hit, key = call_cache.lookup(call_cache.key(
            "kvcache", (q, k_cache, v_cache, None if int_seqlens is not None else cache_seqlens, page_table, out,
                        *_aux_list(aux_tensors)),
            (int_seqlens, softmax_scale, causal, softcap, num_splits, pack_gqa, return_lse, backend, score_mod,
             mask_mod, block_mask), window_size))
        if hit is not None:
            return _replay(hit, q, k_cache, v_cache, out, return_lse, seqused_k=cache_seqlens, page_table=page_table,
                           aux_tensors=_aux_of(aux_tensors, block_mask))
    inputs = (q, k_cache, v_cache, out)
    checks.check_tensor("q", q, 4, _Q4)
    paged = page_table is not None
    kv_form = "(num_pages, page_size, nheads_kv, {})" if paged else "(batch, max_seqlen_k, nheads_kv, {})"
    nheads, nheads_kv, d, d_v, q, k_cache, v_cache = checks.qkv(
        q, k_cache, v_cache, _Q4, 4, kv_form.format("headdim"), kv_form.format("headdim_v"))
    batch, seqlen_q = q.shape[:2]
    if paged:
        checks.page_table(page_table, batch, k_cache.shape[1], "k_cache")
        capacity = page_table.shape[1] * k_cache.shape[1]
    else:
        if k_cache.shape[0] != batch:
            raise ValueError(f"k_cache and v_cache must have shape (batch, max_seqlen_k, nheads_kv, headdim) "
                             f"with batch = {batch}, got {tuple(k_cache.shape)}")
        capacity = k_cache.shape[1]
    seqlens_fill = None
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        max_seqlen_k = seqlens_fill = checks.int_arg("cache_seqlens", cache_seqlens, 0, capacity)
        cache_seqlens = torch.full((batch,), max_seqlen_k, dtype=torch.int32, device=q.device)
    else:
        checks.int32_vector("cache_seqlens", cache_seqlens, batch, "(batch,) or an int")
        max_seqlen_k = None
    opts = checks.options(d, softmax_scale, causal, window_size, softcap, num_splits, pack_gqa, backend)
    out = checks.check_out(out, (batch, seqlen_q, nheads, d_v), q.dtype, "(batch, seqlen_q, nheads, headdim_v)")
    checks.check_device({"q": q, "k_cache": k_cache, "v_cache": v_cache, "cache_seqlens": cache_seqlens,
                         "page_table": page_table, "out": out})
    if max_seqlen_k is None:  # lengths live on the device
        if check_cache_bounds:  # opt-in: one device -> host read
            max_seqlen_k = checks.cache_bounds(cache_seqlens, capacity, page_table, k_cache.shape)
        else:
            max_seqlen_k = capacity
    opts, variant = checks.user_variant(score_mod, mask_mod, aux_tensors, block_mask, opts, q.device, batch=batch,
                             nheads=nheads, max_seqlen_q=seqlen_q, max_seqlen_k=capacity)
    return _flash_attn_fwd(q, k_cache, v_cache, out, opts, batch=batch, max_seqlen_q=seqlen_q,
                           max_seqlen_k=max_seqlen_k, nheads=nheads, nheads_kv=nheads_kv, d_v=d_v,
                           return_lse=bool(return_lse), seqused_k=cache_seqlens, page_table=page_table,
                           fast_key=call_cache.same(key, inputs, (q, k_cache, v_cache, out)), seqlens_fill=seqlens_fill,
                           variant=variant)


def flash_attn_combine(out_partial, lse_partial, *, out=None, out_dtype=None, return_lse=False):
    """Merge split-KV partials: ``out = sum_s exp(lse_s - lse) * out_s``, ``lse = logsumexp_s lse_s``.

    out_partial ``(num_splits, batch, seqlen_q, nheads, d_v)`` fp32, lse_partial
    ``(num_splits, batch, nheads, seqlen_q)`` fp32, ``num_splits <= 256``. Returns out
    ``(batch, seqlen_q, nheads, d_v)`` in ``out_dtype`` (default: out's dtype if given,
    else fp32; fp16/bf16/fp32), or ``(out, lse)`` with lse ``(batch, nheads, seqlen_q)``."""
    form_o, form_l = "(num_splits, batch, seqlen_q, nheads, headdim_v)", "(num_splits, batch, nheads, seqlen_q)"
    checks.check_tensor("out_partial", out_partial, 5, form_o)
    checks.check_tensor("lse_partial", lse_partial, 4, form_l)
    checks.check_dtype("out_partial", out_partial, torch.float32, "float32")
    checks.check_dtype("lse_partial", lse_partial, torch.float32, "float32")
    ns, b, s, h, d_v = out_partial.shape
    if tuple(lse_partial.shape) != (ns, b, h, s):
        raise ValueError(f"lse_partial must have shape {form_l} = {(ns, b, h, s)} to match out_partial, "
                         f"got {tuple(lse_partial.shape)}")
    if not 1 <= ns <= MAX_SPLITS:
        raise ValueError(f"num_splits (out_partial.shape[0]) must be in [1, {MAX_SPLITS}], got {ns}")
    checks.check_head_dim("out_partial", d_v)
    if lse_partial.shape[-1] > 1 and lse_partial.stride(-1) != 1:
        raise ValueError(f"lse_partial must have a contiguous last dimension, got strides {lse_partial.stride()}")
    out_partial = checks.aligned("out_partial", out_partial)
    if out_dtype is None:
        out_dtype = out.dtype if isinstance(out, torch.Tensor) else torch.float32
    if out_dtype not in SUPPORTED_DTYPES + (torch.float32,):
        raise TypeError(f"out_dtype must be float16, bfloat16 or float32, got {out_dtype}")
    out = checks.check_out(out, (b, s, h, d_v), out_dtype, "(batch, seqlen_q, nheads, headdim_v)")
    checks.check_device({"out_partial": out_partial, "lse_partial": lse_partial, "out": out})
    if out is None:
        out = out_partial.new_empty((b, s, h, d_v), dtype=out_dtype)
    lse = lse_partial.new_empty((b, h, s)) if return_lse else None
    if out.numel() > 0 or (lse is not None and lse.numel() > 0):
        fwd.combine_launcher(out.dtype, d_v, lse is not None)(out_partial, lse_partial, out, lse)
    return (out, lse) if return_lse else out
