"""``flash_attn_with_kvcache``'s append path: new keys and values written into the cache,
rotary embedding of q and the new keys, then the attention over the grown cache.

One CuTe-DSL kernel (``kv_append.py``) appends and rotates (quantizing into an FP8 cache
with the descales), and writes what the attention then needs on the device (each
sequence's key count, and for a remapped contiguous cache, ``cache_batch_idx`` /
``cache_leftpad``, each sequence's first cache row): no host sync, so the whole step is
capturable in a CUDA graph. The attention is the ordinary call, planned before the append
runs (a call no kernel takes leaves the cache untouched):

- without a remap, the cache itself (contiguous or paged) with ``seqused_k``;
- with ``cache_batch_idx`` / ``cache_leftpad`` on a contiguous cache, the cache viewed as
  packed rows ``(batch_cache * max_seqlen_k, nheads_kv, d)`` with per-sequence offsets as
  ``cu_seqlens_k`` and the key counts as ``seqused_k``: no kernel reads a cache row it was
  not pointed at;
- with ``cache_leftpad`` on a paged cache (which cannot be flattened), the pages with each
  sequence's key start (the kernels' ``mLeftpadK``) and the key counts from it.

FP8 caches take the attention's descales (``k_descale`` / ``v_descale``), with which the
append quantizes the new tokens; FP8 attention (e4m3 q) also rotates q with ``q_descale``.
A repeated call (same shapes, strides, dtypes and arguments: a decode loop) skips
validation and planning here too (``call_cache``).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from flash_attn_cute.api import call_cache, checks
from flash_attn_cute.host.constants import INT32_MAX
from flash_attn_cute.host.problems import out_dtype


class _Layout(NamedTuple):
    """What the append reads and writes beside the call's tensors, and how the attention
    then reads the cache."""

    rotary: bool  # q is rotated: the attention reads the append's q_out
    remap: bool  # a contiguous cache with cache_batch_idx / cache_leftpad: flattened rows and offsets
    leftpad_k: bool  # a paged cache with cache_leftpad: per-sequence key starts
    q_scaled: bool  # e4m3 q, rotated with q_descale
    kv_scaled: bool  # new tokens into an FP8 cache, with k_descale / v_descale


class _AppendEntry(NamedTuple):
    append: object  # the compiled kv_append launcher
    attention: call_cache.Entry
    layout: _Layout
    seqlens_fill: Optional[int]


def _check_new_kv(k, v, rows: tuple, nheads_kv: int, d: int, d_v: int, varlen: bool, dtypes: tuple, what: str):
    """The new tokens: (batch, seqlen_new, ...) or packed (total_new, ...) with ``rows`` the
    leading dims they must have beyond the token count (``(batch,)`` or ``()``), both of one
    of ``dtypes`` (``what`` names them). Returns the aligned views and seqlen_new (the
    packed token count when varlen)."""
    if (k is None) != (v is None):
        raise ValueError("k and v (the new tokens) must be given together, or neither")
    if k is None:
        return None, None, 0
    lead = "total_new" if varlen else "batch, seqlen_new"
    rank = 3 if varlen else 4
    checks.check_tensor("k", k, rank, f"({lead}, nheads_kv, headdim)")
    checks.check_tensor("v", v, rank, f"({lead}, nheads_kv, headdim_v)")
    want_k, want_v = (*rows, k.shape[len(rows)], nheads_kv, d), (*rows, k.shape[len(rows)], nheads_kv, d_v)
    if tuple(k.shape) != want_k:
        raise ValueError(f"k must have shape ({lead}, nheads_kv, headdim) = {want_k}, got {tuple(k.shape)}")
    if tuple(v.shape) != want_v:
        raise ValueError(f"v must have shape ({lead}, nheads_kv, headdim_v) = {want_v}, got {tuple(v.shape)}")
    checks.check_dtype("k", k, dtypes, what)
    checks.check_dtype("v", v, k.dtype, f"{k.dtype} like k")
    return checks.aligned("k", k), checks.aligned("v", v), k.shape[len(rows)]


def _token_dtypes(q, k_cache, k, rotary_cos) -> tuple:
    """(the 16-bit dtype of the rotary tables and of 16-bit new tokens, how to name it, the
    dtypes new tokens may have, how to name them). A 16-bit cache takes q's dtype; an FP8
    cache also its own (copied, or dequantized to rotate). With e4m3 q (FP8 attention) the
    16-bit dtype is that of k where k is 16-bit, else that of the rotary tables."""
    if q.dtype in checks.SUPPORTED_DTYPES:
        if k_cache.dtype not in checks.FP8_DTYPES:
            return q.dtype, f"{q.dtype} like q", (q.dtype,), f"{q.dtype} like q"
        return (q.dtype, f"{q.dtype} like q", (q.dtype, k_cache.dtype),
                f"{q.dtype} like q, or {k_cache.dtype} like the cache")
    tokens = checks.SUPPORTED_DTYPES + (k_cache.dtype,), f"float16, bfloat16 or {k_cache.dtype} like the cache"
    if isinstance(k, torch.Tensor) and k.dtype in checks.SUPPORTED_DTYPES:
        return (k.dtype, f"{k.dtype} like k", *tokens)
    if isinstance(rotary_cos, torch.Tensor):
        what = "float16 or bfloat16 (with e4m3 q, the dtype q is rotated in)"
        checks.check_dtype("rotary_cos", rotary_cos, checks.SUPPORTED_DTYPES, what)
        return (rotary_cos.dtype, f"{rotary_cos.dtype} like rotary_cos", *tokens)
    return (torch.bfloat16, "bfloat16", *tokens)  # nothing 16-bit: the kernel only moves fp8 bytes


def _check_rotary(cos, sin, dtype, what: str, d: int, capacity: int) -> int:
    """Returns rotary_dim (0 without rotary); the tables in ``dtype`` (``what`` names it)."""
    if (cos is None) != (sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together, or neither")
    if cos is None:
        return 0
    checks.check_tensor("rotary_cos", cos, 2, "(seqlen_ro, rotary_dim / 2)")
    checks.check_tensor("rotary_sin", sin, 2, "(seqlen_ro, rotary_dim / 2)")
    if tuple(sin.shape) != tuple(cos.shape):
        raise ValueError(f"rotary_sin must have the shape of rotary_cos {tuple(cos.shape)}, got {tuple(sin.shape)}")
    rotary_dim = 2 * cos.shape[1]
    if rotary_dim == 0 or rotary_dim > d or rotary_dim % 16:
        raise ValueError(f"rotary_cos must have shape (seqlen_ro, rotary_dim / 2) with rotary_dim a multiple of 16 "
                         f"in [16, headdim = {d}], got rotary_dim {rotary_dim}")
    if cos.shape[0] < capacity:
        raise ValueError(f"rotary_cos and rotary_sin must cover every cache position: seqlen_ro "
                         f"(rotary_cos.shape[0]) must be >= the cache capacity {capacity}, got {cos.shape[0]}")
    checks.check_dtype("rotary_cos", cos, dtype, what)
    checks.check_dtype("rotary_sin", sin, dtype, what)
    for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")
    return rotary_dim


def append_and_attend(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                      cache_leftpad, page_table, cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q, learnable_sink,
                      rotary_interleaved: bool, return_lse: bool, out, check_cache_bounds: bool, option_args: tuple,
                      variant_args: tuple, descale_args: tuple = (None, None, None)):
    """``flash_attn_with_kvcache`` with ``k``/``v``, rotary, ``cache_batch_idx`` or
    ``cache_leftpad`` (arguments as there; ``option_args`` / ``variant_args`` are the shared
    keyword arguments of ``checks.options`` and ``checks.user_variant``, ``descale_args``
    ``(q_descale, k_descale, v_descale)``). Packed queries (``cu_seqlens_q``) come with
    packed new tokens (``cu_seqlens_k_new``, default ``cu_seqlens_q``: the new tokens are
    the query tokens)."""
    from flash_attn_cute.interface import _Call, _execute

    varlen = cu_seqlens_q is not None
    if varlen and cu_seqlens_k_new is None and k is not None:
        cu_seqlens_k_new = cu_seqlens_q
    q_descale, k_descale, v_descale = descale_args
    key = None
    if not check_cache_bounds:
        int_seqlens = cache_seqlens if not isinstance(cache_seqlens, torch.Tensor) else None
        scalars = (int_seqlens, max_seqlen_q, rotary_interleaved, return_lse, *option_args[:2], *option_args[3:],
                   *variant_args[:2], variant_args[3])
        hit, key = call_cache.lookup(call_cache.key(
            "kvcache_append", (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin,
                               None if int_seqlens is not None else cache_seqlens, cache_batch_idx, cache_leftpad,
                               page_table, cu_seqlens_q, cu_seqlens_k_new, learnable_sink, out, q_descale, k_descale,
                               v_descale, *(variant_args[2] or ())), scalars, option_args[2]))
        if hit is not None:
            return _replay(hit, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                           cache_leftpad, page_table, cu_seqlens_q, cu_seqlens_k_new, learnable_sink, return_lse,
                           out, variant_args, descale_args)
    inputs = (q, k_cache, v_cache, k, v, out)
    paged = page_table is not None
    nheads, nheads_kv, d, d_v, q, k_cache, v_cache, batch, seqlen_q = checks.queries_and_cache(
        q, k_cache, v_cache, cu_seqlens_q, max_seqlen_q, page_table, "batch_cache")
    if paged and cache_batch_idx is not None:
        raise ValueError("cache_batch_idx applies to a contiguous cache; with a page_table, point each sequence's "
                         "page_table row at its pages instead (as in FA2)")
    remap = not paged and (cache_batch_idx is not None or cache_leftpad is not None)
    capacity = checks.cache_capacity(k_cache, batch, page_table, "k_cache and v_cache",
                                     rows_per_sequence=cache_batch_idx is None, why=" (or pass cache_batch_idx)")
    dtype, dtype_what, token_dtypes, token_what = _token_dtypes(q, k_cache, k, rotary_cos)
    k, v, seqlen_new = _check_new_kv(k, v, () if varlen else (batch,), nheads_kv, d, d_v, varlen, token_dtypes,
                                     token_what)
    if varlen and k is not None:
        checks.int32_vector("cu_seqlens_k_new", cu_seqlens_k_new, batch + 1, "(batch + 1,) like cu_seqlens_q")
    # A packed step's sequences each append their own count: only the capacity bounds them.
    new_per_seq = 0 if varlen else seqlen_new
    rotary_dim = _check_rotary(rotary_cos, rotary_sin, dtype, dtype_what, d, capacity)
    for name, t in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        if t is not None:
            checks.int32_vector(name, t, batch, "(batch,)")
    cache_seqlens, seqlens_fill = checks.cache_lengths(cache_seqlens, batch, capacity, new_per_seq, q.device)
    checks.learnable_sink(learnable_sink, nheads)
    checks.descales(k_cache, q_descale, k_descale, v_descale, batch, nheads_kv)
    opts = checks.options(d, *option_args)
    out = checks.check_out(out, (*q.shape[:-1], d_v), out_dtype(q.dtype),
                           "(total_q, nheads, headdim_v)" if varlen else "(batch, seqlen_q, nheads, headdim_v)")
    if remap and not _flattenable(k_cache, v_cache):
        raise ValueError("cache_batch_idx / cache_leftpad need caches whose (batch_cache, max_seqlen_k) dims can be "
                         "viewed as one (a contiguous slice of rows: call .contiguous() on k_cache and v_cache)")
    if remap and k_cache.shape[0] * capacity > INT32_MAX:
        raise ValueError("cache_batch_idx / cache_leftpad address cache rows as int32: batch_cache * max_seqlen_k "
                         f"must be <= 2**31 - 1, got {k_cache.shape[0] * capacity}")
    if max(capacity, rotary_cos.shape[0] if rotary_dim else 0) >= 1 << 30:
        raise ValueError(f"the append kernel takes cache capacities and rotary tables below 2**30 positions, got "
                         f"{max(capacity, rotary_cos.shape[0] if rotary_dim else 0)}")
    chunks = sum(t.numel() * t.element_size() for t in (q, k, v) if t is not None) // 16
    if chunks >= 1 << 31:
        raise ValueError(f"q, k and v of one append call must hold fewer than 2**31 16-byte chunks (32 GiB), "
                         f"got {chunks}")
    checks.check_device({"q": q, "k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v, "rotary_cos": rotary_cos,
                         "rotary_sin": rotary_sin, "cache_seqlens": cache_seqlens, "cache_batch_idx": cache_batch_idx,
                         "cache_leftpad": cache_leftpad, "page_table": page_table, "cu_seqlens_q": cu_seqlens_q,
                         "cu_seqlens_k_new": cu_seqlens_k_new, "learnable_sink": learnable_sink,
                         "q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale, "out": out})
    max_seqlen_k = capacity
    if check_cache_bounds:
        max_seqlen_k = checks.cache_bounds(cache_seqlens, capacity, page_table, k_cache.shape, new_per_seq,
                                           batch_idx=cache_batch_idx, leftpad=cache_leftpad)
    opts, variant = checks.user_variant(*variant_args, opts, q.device, batch=batch, nheads=nheads,
                                        max_seqlen_q=seqlen_q, max_seqlen_k=capacity)
    from flash_attn_cute.kernels import kv_append

    fp8_cache = k_cache.dtype in checks.FP8_DTYPES
    layout = _Layout(rotary=rotary_dim > 0, remap=remap, leftpad_k=paged and cache_leftpad is not None,
                     q_scaled=rotary_dim > 0 and q.dtype in checks.FP8_DTYPES,
                     kv_scaled=k is not None and fp8_cache)
    append = kv_append.append_launcher(
        dtype, d, d_v, rotary_dim, rotary_interleaved, opts.causal or opts.window_left >= 0 or opts.window_right >= 0,
        layout.rotary, k is not None, paged, cache_batch_idx is not None, cache_leftpad is not None, varlen,
        q_dtype=q.dtype if layout.q_scaled else None, new_dtype=k.dtype if k is not None and k.dtype != dtype else None,
        cache_dtype=k_cache.dtype if fp8_cache else None, device=q.device)
    q_att, seqused, k_offsets, run_append = _prepare(
        append, layout, q, k, v, k_cache, v_cache, cache_seqlens, page_table, cache_batch_idx, cache_leftpad,
        rotary_cos, rotary_sin, cu_seqlens_q, cu_seqlens_k_new, batch, nheads_kv, descale_args)
    k_att, v_att = (_flat(k_cache), _flat(v_cache)) if remap else (k_cache, v_cache)
    call = _Call(q_att, k_att, v_att, out, opts, batch, seqlen_q, max_seqlen_k, nheads, nheads_kv, d_v, return_lse,
                 cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=k_offsets, seqused_k=seqused, page_table=page_table,
                 learnable_sink=learnable_sink, variant=variant, k_descale=k_descale, v_descale=v_descale,
                 q_descale=q_descale, leftpad_k=cache_leftpad if layout.leftpad_k else None)
    result, entry = _execute(call, prologue=run_append)
    if entry is not None and all(a is b for a, b in zip(inputs, (q, k_cache, v_cache, k, v, out))):
        call_cache.store(key, _AppendEntry(append, entry, layout, seqlens_fill))
    return result


def _flattenable(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return all(t.shape[0] <= 1 or t.stride(0) == t.shape[1] * t.stride(1) for t in (k_cache, v_cache))


def _flat(cache: torch.Tensor) -> torch.Tensor:
    """(batch_cache, s, h, d) -> (batch_cache * s, h, d), a view."""
    return cache.view(cache.shape[0] * cache.shape[1], *cache.shape[2:])


def _prepare(append, layout: _Layout, q, k, v, k_cache, v_cache, cache_seqlens, page_table, cache_batch_idx,
             cache_leftpad, cos, sin, cu_seqlens_q, cu_seqlens_k_new, batch: int, nheads_kv: int, descale_args: tuple):
    """(the queries to attend with, key counts, key offsets or None, ``run``): the append
    kernel's outputs allocated and its descales viewed as it reads them (fp32 ``(batch,
    nheads_kv)``); ``run()`` launches it, once the attention is planned."""
    q_rot = torch.empty_like(q) if layout.rotary else None
    seqused = torch.empty((batch,), dtype=torch.int32, device=q.device)
    k_offsets = torch.empty((batch + 1,), dtype=torch.int32, device=q.device) if layout.remap else None
    view = lambda t: checks.descale_view(t, batch, nheads_kv, q.device)
    q_descale = view(descale_args[0]) if layout.q_scaled else None
    k_descale, v_descale = (view(descale_args[1]), view(descale_args[2])) if layout.kv_scaled else (None, None)

    def run():
        append(q if layout.rotary else None, k, v, k_cache, v_cache, cache_seqlens, page_table, cache_batch_idx,
               cache_leftpad, cos, sin, q_rot, seqused, k_offsets, cu_seqlens_q if layout.rotary else None,
               cu_seqlens_k_new if k is not None else None, q_descale, k_descale, v_descale)

    return (q_rot if layout.rotary else q), seqused, k_offsets, run


def _replay(hit: _AppendEntry, q, k_cache, v_cache, k, v, cos, sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            page_table, cu_seqlens_q, cu_seqlens_k_new, learnable_sink, return_lse, out, variant_args, descale_args):
    from flash_attn_cute.host import user_variants
    from flash_attn_cute.seam.backend_kit import NO_VARIANT
    from flash_attn_cute.interface import _aux_of, _launch

    entry, layout = hit.attention, hit.layout
    batch = entry.problem.batch
    if hit.seqlens_fill is not None:
        cache_seqlens = torch.full((batch,), hit.seqlens_fill, dtype=torch.int32, device=q.device)
    q_att, seqused, k_offsets, run_append = _prepare(
        hit.append, layout, q, k, v, k_cache, v_cache, cache_seqlens, page_table, cache_batch_idx, cache_leftpad,
        cos, sin, cu_seqlens_q, cu_seqlens_k_new, batch, entry.problem.nheads_kv, descale_args)
    if out is None:
        out = q.new_empty(entry.out_shape, dtype=entry.problem.out_dtype)
    lse = q.new_empty(entry.lse_shape, dtype=torch.float32) if return_lse else None
    k_att, v_att = (_flat(k_cache), _flat(v_cache)) if layout.remap else (k_cache, v_cache)
    variant_tensors = NO_VARIANT
    if entry.problem.variant is not None:
        aux = _aux_of(variant_args[2], variant_args[3])
        variant_tensors = user_variants.kernel_aux(aux or ()) + (entry.block_ranges,)
    run_append()
    q_descale, k_descale, v_descale = descale_args
    _launch(entry, q_att, k_att, v_att, out, lse, cu_seqlens_q, k_offsets, None, seqused, page_table, learnable_sink,
            variant_tensors, k_descale, v_descale, q_descale, cache_leftpad if layout.leftpad_k else None)
    return (out, lse) if return_lse else out
