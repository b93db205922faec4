"""``flash_attn_with_kvcache``'s append path: new keys and values written into the cache,
rotary embedding of q and the new keys, then the attention over the grown cache.

One CuTe-DSL kernel (``kv_append.py``) appends and rotates, and writes what the attention
then needs on the device (each sequence's key count, and for a remapped contiguous cache,
``cache_batch_idx`` / ``cache_leftpad``, each sequence's first cache row): no host sync, so
the whole step is capturable in a CUDA graph. The attention is the ordinary call:

- without a remap, the cache itself (contiguous or paged) with ``seqused_k``;
- with ``cache_batch_idx`` / ``cache_leftpad``, the contiguous cache viewed as packed rows
  ``(batch_cache * max_seqlen_k, nheads_kv, d)`` with per-sequence offsets as
  ``cu_seqlens_k`` and the key counts as ``seqused_k``: no kernel reads a cache row it was
  not pointed at.

A repeated call (same shapes, strides, dtypes and arguments: a decode loop) skips
validation and planning here too (``call_cache``).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from . import call_cache, checks
from .constants import INT32_MAX


class _AppendEntry(NamedTuple):
    append: object  # the compiled kv_append launcher
    attention: call_cache.Entry
    rotary: bool
    remap: bool
    seqlens_fill: Optional[int]


def _check_new_kv(k, v, q, rows: tuple, nheads_kv: int, d: int, d_v: int, varlen: bool):
    """The new tokens: (batch, seqlen_new, ...) or packed (total_new, ...) with ``rows`` the
    leading dims they must have beyond the token count (``(batch,)`` or ``()``). Returns the
    aligned views and seqlen_new (the packed token count when varlen)."""
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
    checks.check_dtype("k", k, q.dtype, f"{q.dtype} like q")
    checks.check_dtype("v", v, q.dtype, f"{q.dtype} like q")
    return checks.aligned("k", k), checks.aligned("v", v), k.shape[len(rows)]


def _check_rotary(cos, sin, q, d: int, capacity: int) -> int:
    """Returns rotary_dim (0 without rotary)."""
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
    checks.check_dtype("rotary_cos", cos, q.dtype, f"{q.dtype} like q")
    checks.check_dtype("rotary_sin", sin, q.dtype, f"{q.dtype} like q")
    for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")
    return rotary_dim


def append_and_attend(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                      cache_leftpad, page_table, cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q, learnable_sink,
                      rotary_interleaved: bool, return_lse: bool, out, check_cache_bounds: bool, option_args: tuple,
                      variant_args: tuple):
    """``flash_attn_with_kvcache`` with ``k``/``v``, rotary, ``cache_batch_idx`` or
    ``cache_leftpad`` (arguments as there; ``option_args`` / ``variant_args`` are the shared
    keyword arguments of ``checks.options`` and ``checks.user_variant``). Packed queries
    (``cu_seqlens_q``) come with packed new tokens (``cu_seqlens_k_new``, default
    ``cu_seqlens_q``: the new tokens are the query tokens)."""
    from .interface import _Call, _execute

    varlen = cu_seqlens_q is not None
    if varlen and cu_seqlens_k_new is None and k is not None:
        cu_seqlens_k_new = cu_seqlens_q
    key = None
    if not check_cache_bounds:
        int_seqlens = cache_seqlens if not isinstance(cache_seqlens, torch.Tensor) else None
        scalars = (int_seqlens, max_seqlen_q, rotary_interleaved, return_lse, *option_args[:2], *option_args[3:],
                   *variant_args[:2], variant_args[3])
        hit, key = call_cache.lookup(call_cache.key(
            "kvcache_append", (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin,
                               None if int_seqlens is not None else cache_seqlens, cache_batch_idx, cache_leftpad,
                               page_table, cu_seqlens_q, cu_seqlens_k_new, learnable_sink, out,
                               *(variant_args[2] or ())), scalars, option_args[2]))
        if hit is not None:
            return _replay(hit, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                           cache_leftpad, page_table, cu_seqlens_q, cu_seqlens_k_new, learnable_sink, return_lse,
                           out, variant_args)
    inputs = (q, k_cache, v_cache, k, v, out)
    paged = page_table is not None
    nheads, nheads_kv, d, d_v, q, k_cache, v_cache, batch, seqlen_q = checks.queries_and_cache(
        q, k_cache, v_cache, cu_seqlens_q, max_seqlen_q, page_table, "batch_cache")
    remap = cache_batch_idx is not None or cache_leftpad is not None
    if paged and remap:
        raise ValueError("cache_batch_idx and cache_leftpad apply to a contiguous cache; with a page_table, "
                         "point each sequence's page_table row at its pages instead (as in FA2)")
    capacity = checks.cache_capacity(k_cache, batch, page_table, "k_cache and v_cache",
                                     rows_per_sequence=cache_batch_idx is None, why=" (or pass cache_batch_idx)")
    k, v, seqlen_new = _check_new_kv(k, v, q, () if varlen else (batch,), nheads_kv, d, d_v, varlen)
    if varlen and k is not None:
        checks.int32_vector("cu_seqlens_k_new", cu_seqlens_k_new, batch + 1, "(batch + 1,) like cu_seqlens_q")
    # A packed step's sequences each append their own count: only the capacity bounds them.
    new_per_seq = 0 if varlen else seqlen_new
    rotary_dim = _check_rotary(rotary_cos, rotary_sin, q, d, capacity)
    for name, t in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        if t is not None:
            checks.int32_vector(name, t, batch, "(batch,)")
    cache_seqlens, seqlens_fill = checks.cache_lengths(cache_seqlens, batch, capacity, new_per_seq, q.device)
    checks.learnable_sink(learnable_sink, nheads)
    opts = checks.options(d, *option_args)
    out = checks.check_out(out, (*q.shape[:-1], d_v), q.dtype,
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
    chunks = sum(t.numel() for t in (q, k, v) if t is not None) * q.element_size() // 16
    if chunks >= 1 << 31:
        raise ValueError(f"q, k and v of one append call must hold fewer than 2**31 16-byte chunks (32 GiB), "
                         f"got {chunks}")
    checks.check_device({"q": q, "k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v, "rotary_cos": rotary_cos,
                         "rotary_sin": rotary_sin, "cache_seqlens": cache_seqlens, "cache_batch_idx": cache_batch_idx,
                         "cache_leftpad": cache_leftpad, "page_table": page_table, "cu_seqlens_q": cu_seqlens_q,
                         "cu_seqlens_k_new": cu_seqlens_k_new, "learnable_sink": learnable_sink, "out": out})
    max_seqlen_k = capacity
    if check_cache_bounds:
        max_seqlen_k = checks.cache_bounds(cache_seqlens, capacity, page_table, k_cache.shape, new_per_seq)
    opts, variant = checks.user_variant(*variant_args, opts, q.device, batch=batch, nheads=nheads,
                                        max_seqlen_q=seqlen_q, max_seqlen_k=capacity)
    from . import kv_append

    append = kv_append.append_launcher(
        q.dtype, d, d_v, rotary_dim, rotary_interleaved, opts.causal or opts.window_left >= 0 or opts.window_right >= 0,
        rotary_dim > 0, k is not None, paged, cache_batch_idx is not None, cache_leftpad is not None, varlen)
    q_att, seqused, k_offsets = _append(append, q, k, v, k_cache, v_cache, cache_seqlens, page_table, cache_batch_idx,
                                        cache_leftpad, rotary_cos, rotary_sin, cu_seqlens_q, cu_seqlens_k_new,
                                        batch, rotary_dim > 0, remap)
    k_att, v_att = (_flat(k_cache), _flat(v_cache)) if remap else (k_cache, v_cache)
    call = _Call(q_att, k_att, v_att, out, opts, batch, seqlen_q, max_seqlen_k, nheads, nheads_kv, d_v, return_lse,
                 cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=k_offsets, seqused_k=seqused, page_table=page_table,
                 learnable_sink=learnable_sink, variant=variant)
    result, entry = _execute(call)
    if entry is not None and all(a is b for a, b in zip(inputs, (q, k_cache, v_cache, k, v, out))):
        call_cache.store(key, _AppendEntry(append, entry, rotary_dim > 0, remap, seqlens_fill))
    return result


def _flattenable(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return all(t.shape[0] <= 1 or t.stride(0) == t.shape[1] * t.stride(1) for t in (k_cache, v_cache))


def _flat(cache: torch.Tensor) -> torch.Tensor:
    """(batch_cache, s, h, d) -> (batch_cache * s, h, d), a view."""
    return cache.view(cache.shape[0] * cache.shape[1], *cache.shape[2:])


def _append(append, q, k, v, k_cache, v_cache, cache_seqlens, page_table, cache_batch_idx, cache_leftpad, cos, sin,
            cu_seqlens_q, cu_seqlens_k_new, batch: int, rotary: bool, remap: bool):
    """Runs the append kernel; returns (the queries to attend with, key counts, key offsets or None)."""
    q_rot = torch.empty_like(q) if rotary else None
    seqused = torch.empty((batch,), dtype=torch.int32, device=q.device)
    k_offsets = torch.empty((batch + 1,), dtype=torch.int32, device=q.device) if remap else None
    append(q if rotary else None, k, v, k_cache, v_cache, cache_seqlens, page_table, cache_batch_idx, cache_leftpad,
           cos, sin, q_rot, seqused, k_offsets, cu_seqlens_q if rotary else None, cu_seqlens_k_new if k is not None
           else None)
    return (q_rot if rotary else q), seqused, k_offsets


def _replay(hit: _AppendEntry, q, k_cache, v_cache, k, v, cos, sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            page_table, cu_seqlens_q, cu_seqlens_k_new, learnable_sink, return_lse, out, variant_args):
    from . import user_variants
    from .backend_kit import NO_VARIANT
    from .interface import _aux_of, _launch

    entry = hit.attention
    batch = entry.problem.batch
    if hit.seqlens_fill is not None:
        cache_seqlens = torch.full((batch,), hit.seqlens_fill, dtype=torch.int32, device=q.device)
    q_att, seqused, k_offsets = _append(hit.append, q, k, v, k_cache, v_cache, cache_seqlens, page_table,
                                        cache_batch_idx, cache_leftpad, cos, sin, cu_seqlens_q, cu_seqlens_k_new,
                                        batch, hit.rotary, hit.remap)
    if out is None:
        out = q.new_empty(entry.out_shape)
    lse = q.new_empty(entry.lse_shape, dtype=torch.float32) if return_lse else None
    k_att, v_att = (_flat(k_cache), _flat(v_cache)) if hit.remap else (k_cache, v_cache)
    variant_tensors = NO_VARIANT
    if entry.problem.variant is not None:
        aux = _aux_of(variant_args[2], variant_args[3])
        variant_tensors = user_variants.kernel_aux(aux or ()) + (entry.block_ranges,)
    _launch(entry, q_att, k_att, v_att, out, lse, cu_seqlens_q, k_offsets, None, seqused, page_table, learnable_sink,
            variant_tensors)
    return (out, lse) if return_lse else out
