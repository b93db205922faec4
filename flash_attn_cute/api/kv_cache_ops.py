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
``APPEND`` is the entry point's spec of the run path (``entry.run``): its validation
plans the attention (``forward.checked``) and its launch runs the append first
(``_tensors``), so a repeated call (a decode loop) skips validation and planning here too.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from flash_attn_cute.api import checks
from flash_attn_cute.api.call_args import descale_view
from flash_attn_cute.api.entry import Checked, Spec
from flash_attn_cute.api.forward import (OPTION_ARGS, VARIANT_ARGS, Dims, checked, empty_result, launch_tensors,
                                         options_of, traced, user_variant_of)
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


class _Append(NamedTuple):
    """The append step of an entry (``forward.FwdExtra.append``)."""

    launch: object  # the compiled kv_append launcher
    layout: _Layout


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


def _validate(args: dict) -> Checked:
    """``flash_attn_with_kvcache`` with new tokens, rotary, ``cache_batch_idx`` or
    ``cache_leftpad``. Packed queries (``cu_seqlens_q``) come with packed new tokens
    (``cu_seqlens_k_new``, default ``cu_seqlens_q``: the new tokens are the query tokens)."""
    if args.get("cp_world_size", 1) != 1:
        raise NotImplementedError(
            f"context parallelism (cp_world_size = {args['cp_world_size']}) does not combine with the KV-cache append "
            "(k / v, rotary, cache_batch_idx, cache_leftpad): append each new token to the shard that owns it, then "
            "attend")
    q, k_cache, v_cache, k, v = args["q"], args["k_cache"], args["v_cache"], args.get("k_new"), args.get("v_new")
    rotary_cos, rotary_sin = args.get("rotary_cos"), args.get("rotary_sin")
    cache_batch_idx, cache_leftpad = args.get("cache_batch_idx"), args.get("cache_leftpad")
    page_table, cu_seqlens_q = args.get("page_table"), args.get("cu_seqlens_q")
    varlen = cu_seqlens_q is not None
    if varlen and args.get("cu_seqlens_k_new") is None and k is not None:
        args = dict(args, cu_seqlens_k_new=cu_seqlens_q)
    cu_seqlens_k_new = args.get("cu_seqlens_k_new")
    q_descale, k_descale, v_descale = args.get("q_descale"), args.get("k_descale"), args.get("v_descale")
    paged = page_table is not None
    nheads, nheads_kv, d, d_v, q, k_cache, v_cache, batch, seqlen_q = checks.queries_and_cache(
        q, k_cache, v_cache, cu_seqlens_q, args.get("max_seqlen_q"), page_table, "batch_cache")
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
    seqlens = args.get("cache_seqlens")
    cache_seqlens, seqlens_fill = checks.cache_lengths(
        seqlens if seqlens is not None else args.get("cache_seqlens_int"), batch, capacity, new_per_seq, q.device)
    checks.learnable_sink(args.get("learnable_sink"), nheads)
    checks.descales(k_cache, q_descale, k_descale, v_descale, batch, nheads_kv)
    out = checks.check_out(args.get("out"), (*q.shape[:-1], d_v), out_dtype(q.dtype),
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
    args = dict(args, q=q, k_cache=k_cache, v_cache=v_cache, k_new=k, v_new=v, out=out, cache_seqlens=cache_seqlens)
    checks.check_device({n: args.get(n) for n in (
        "q", "k_cache", "v_cache", "k_new", "v_new", "rotary_cos", "rotary_sin", "cache_seqlens", "cache_batch_idx",
        "cache_leftpad", "page_table", "cu_seqlens_q", "cu_seqlens_k_new", "learnable_sink", "q_descale",
        "k_descale", "v_descale", "out")})
    max_seqlen_k = capacity
    if args.get("check_cache_bounds"):
        max_seqlen_k = checks.cache_bounds(cache_seqlens, capacity, page_table, k_cache.shape, new_per_seq,
                                           batch_idx=cache_batch_idx, leftpad=cache_leftpad)
    opts = options_of(args, d)
    dims = Dims(batch, seqlen_q, max_seqlen_k, nheads, nheads_kv, d, d_v)
    opts, variant = user_variant_of(args, opts, dims, capacity)
    from flash_attn_cute.kernels import kv_append

    fp8_cache = k_cache.dtype in checks.FP8_DTYPES
    layout = _Layout(rotary=rotary_dim > 0, remap=remap, leftpad_k=paged and cache_leftpad is not None,
                     q_scaled=rotary_dim > 0 and q.dtype in checks.FP8_DTYPES,
                     kv_scaled=k is not None and fp8_cache)
    launch = kv_append.append_launcher(
        dtype, d, d_v, rotary_dim, bool(args.get("rotary_interleaved", True)),
        opts.causal or opts.window_left >= 0 or opts.window_right >= 0, layout.rotary, k is not None, paged,
        cache_batch_idx is not None, cache_leftpad is not None, varlen,
        q_dtype=q.dtype if layout.q_scaled else None, new_dtype=k.dtype if k is not None and k.dtype != dtype else None,
        cache_dtype=k_cache.dtype if fp8_cache else None, device=q.device)
    # The attention reads the append's outputs: key counts always, offsets into the flattened
    # cache for a remap, each sequence's first key for a paged cache with cache_leftpad.
    flags = dict(has_seqused_k=True, varlen_k=remap, leftpad_k=layout.leftpad_k)
    return checked(args, dims, opts, variant, seqlens_fill, _Append(launch, layout), flags)


def _flattenable(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return all(t.shape[0] <= 1 or t.stride(0) == t.shape[1] * t.stride(1) for t in (k_cache, v_cache))


def _flat(cache: torch.Tensor) -> torch.Tensor:
    """(batch_cache, s, h, d) -> (batch_cache * s, h, d), a view."""
    return cache.view(cache.shape[0] * cache.shape[1], *cache.shape[2:])


def _run_append(append: _Append, args: dict, batch: int, nheads_kv: int) -> tuple:
    """Runs the append kernel; returns (the queries to attend with, key counts, key offsets
    or None). Its outputs are allocated per call and its descales viewed as it reads them
    (fp32 ``(batch, nheads_kv)``)."""
    layout, q, k = append.layout, args["q"], args.get("k_new")
    q_rot = torch.empty_like(q) if layout.rotary else None
    seqused = torch.empty((batch,), dtype=torch.int32, device=q.device)
    k_offsets = torch.empty((batch + 1,), dtype=torch.int32, device=q.device) if layout.remap else None
    view = lambda t: descale_view(t, batch, nheads_kv, q.device)
    q_descale = view(args.get("q_descale")) if layout.q_scaled else None
    k_descale, v_descale = ((view(args.get("k_descale")), view(args.get("v_descale"))) if layout.kv_scaled
                            else (None, None))
    seqlens = args.get("cache_seqlens")
    if seqlens is None:  # an int cache_seqlens replayed
        seqlens = torch.full((batch,), args["cache_seqlens_int"], dtype=torch.int32, device=q.device)
    append.launch(q if layout.rotary else None, k, args.get("v_new"), args["k_cache"], args["v_cache"], seqlens,
                  args.get("page_table"), args.get("cache_batch_idx"), args.get("cache_leftpad"),
                  args.get("rotary_cos"), args.get("rotary_sin"), q_rot, seqused, k_offsets,
                  args.get("cu_seqlens_q") if layout.rotary else None,
                  args.get("cu_seqlens_k_new") if k is not None else None, q_descale, k_descale, v_descale)
    return (q_rot if layout.rotary else q), seqused, k_offsets


def _tensors(entry, args: dict, out, lse):
    """The append, then the attention's tensors over the grown cache (see the module
    docstring): the append runs once the attention is planned."""
    append, problem = entry.extra.append, entry.problem
    q_att, seqused, k_offsets = _run_append(append, args, problem.batch, problem.nheads_kv)
    layout = append.layout
    k_att, v_att = (_flat(args["k_cache"]), _flat(args["v_cache"])) if layout.remap else (args["k_cache"],
                                                                                          args["v_cache"])
    return launch_tensors(entry, args, out, lse, q=q_att, k=k_att, v=v_att, seqused_k=seqused, cu_seqlens_k=k_offsets,
                          leftpad_k=args.get("cache_leftpad") if layout.leftpad_k else None)


def _empty(c: Checked):
    """No key to attend (an empty batch or query set): the append still runs."""
    _run_append(c.extra.append, c.args, c.args["cache_seqlens"].shape[0], c.args["k_cache"].shape[2])
    return empty_result(c)


APPEND = Spec("kvcache_append", ("q", "k_cache", "v_cache", "k_new", "v_new", "rotary_cos", "rotary_sin",
                                 "cache_seqlens", "cache_batch_idx", "cache_leftpad", "page_table", "cu_seqlens_q",
                                 "cu_seqlens_k_new", "learnable_sink", "out", *VARIANT_ARGS, "cache_seqlens_int",
                                 "max_seqlen_q", "rotary_interleaved", *OPTION_ARGS),
              _validate, _tensors, _empty, lambda args: out_dtype(args["q"].dtype),
              cacheable=lambda args: not args.get("check_cache_bounds"), traced=traced("kvcache"),
              inputs=("q", "k_cache", "v_cache", "k_new", "v_new", "out"))
