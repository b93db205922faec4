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
import os
from typing import NamedTuple, Optional

import torch

from . import fwd, ops, user_variants
from .fwd import FwdProblem
from .heuristics import MAX_SPLITS

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "flash_attn_combine",
           "SUPPORTED_HEAD_DIMS", "SUPPORTED_DTYPES", "MAX_SPLITS", "BACKENDS"]

# Head dims some backend compiles (each backend's HEAD_DIMS says which it takes; a call
# the chosen backend cannot run falls back to SM80 or names the reason).
SUPPORTED_HEAD_DIMS = tuple(sorted(set().union(*(fwd.backend_module(b).HEAD_DIMS for b in fwd.BACKENDS))))
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
BACKENDS = tuple(fwd.BACKENDS)  # names accepted by ``backend=`` / FLASH_ATTN_CUTE_BACKEND
_INT32_MAX = 2**31 - 1  # kernels take lengths and windows as int32


# ---------------------------------------------------------------------------------------
# Validation helpers
# ---------------------------------------------------------------------------------------


def _tensor(name: str, t, rank: int, form: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {form}, got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"{name} must have shape {form} (rank {rank}), got shape {tuple(t.shape)}")
    return t


def _dtype(name: str, t: torch.Tensor, expected, what: str) -> None:
    expected = expected if isinstance(expected, tuple) else (expected,)
    if t.dtype not in expected:
        raise TypeError(f"{name} must be {what}, got {t.dtype}")


def _head_dim(name: str, d: int) -> None:
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"{name} head dimension must be one of {SUPPORTED_HEAD_DIMS}, got {d}")


def _layout(name: str, t: torch.Tensor) -> torch.Tensor:
    """Last dim contiguous; other strides arbitrary multiples of 16 bytes (the kernels copy
    128-bit vectors), data 16-byte aligned. Strides of size-1 dims do not address memory,
    so they are replaced by an aligned value (a free view) instead of being refused."""
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension (stride 1); got strides {t.stride()}")
    elems = 16 // t.element_size()
    bad = [i for i in range(t.dim() - 1) if t.shape[i] > 1 and t.stride(i) % elems]
    if bad or (t.numel() > 0 and t.data_ptr() % 16):
        raise ValueError(
            f"{name} must be 16-byte aligned with strides that are multiples of {elems} elements "
            f"(16 bytes) except the last; got strides {t.stride()} (call .contiguous() on it)")
    if any(t.shape[i] <= 1 and t.stride(i) % elems for i in range(t.dim() - 1)):
        strides, inner = list(t.stride()), 1
        for i in reversed(range(t.dim())):
            if i < t.dim() - 1 and t.shape[i] <= 1:
                strides[i] = -(-inner // elems) * elems
            inner = max(inner, strides[i] * max(t.shape[i], 1))
        t = t.as_strided(t.shape, strides)
    return t


def _int32_vector(name: str, t, length: int, form: str) -> torch.Tensor:
    _tensor(name, t, 1, form)
    _dtype(name, t, torch.int32, f"int32 of shape {form}")
    if t.shape[0] != length:
        raise ValueError(f"{name} must have shape {form} = ({length},), got {tuple(t.shape)}")
    if length > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous, got stride {t.stride()}")
    return t


def _int(name: str, x, lo: int, hi: Optional[int] = None) -> int:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    x = int(x)
    if x < lo or (hi is not None and x > hi):
        raise ValueError(f"{name} must be in [{lo}, {hi if hi is not None else 'inf'}], got {x}")
    return x


class _Options(NamedTuple):
    softmax_scale: float
    softcap: float
    causal: bool
    window_left: int
    window_right: int
    pack_gqa: Optional[bool]
    num_splits: int
    backend: Optional[str]


def _options(d: int, softmax_scale, causal, window_size, softcap, num_splits, pack_gqa, backend) -> _Options:
    """Validate and normalise the keyword arguments shared by the entry points."""
    if softmax_scale is None:
        softmax_scale = d ** -0.5
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    if not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a float (0.0 = off), got {type(softcap).__name__}")
    if not softcap >= 0 or not math.isfinite(softcap):
        raise ValueError(f"softcap must be >= 0 (0.0 = off), got {softcap}")
    causal, window_left, window_right = normalize_window(causal, window_size)
    if pack_gqa is not None and not isinstance(pack_gqa, bool):
        raise TypeError(f"pack_gqa must be True, False or None (auto), got {pack_gqa!r}")
    return _Options(float(softmax_scale), float(softcap), causal, window_left, window_right, pack_gqa,
                    _int("num_splits", num_splits, 0, MAX_SPLITS), _backend_name(backend))


def _variant(score_mod, mask_mod, aux_tensors, block_mask, opts: _Options, device, *, batch: int, nheads: int,
             max_seqlen_q: int, max_seqlen_k: int):
    """Validates a user variant; returns (opts, None) without one, else (opts with pack_gqa
    decided, (spec, kernel tensors, block ranges)). A block mask supplies the mask_mod and
    aux tensors it was built with unless they are given (the mask_mod must then be its own)."""
    if score_mod is None and mask_mod is None and block_mask is None:
        if aux_tensors is not None:
            raise ValueError("aux_tensors is given without a score_mod, mask_mod or block_mask to read it")
        return opts, None
    from .block_mask import BlockMask

    block_q, ranges = 0, None
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise TypeError(f"block_mask must be a flash_attn_cute.BlockMask (create_block_mask), "
                            f"got {type(block_mask).__name__}")
        if mask_mod is None:
            mask_mod = block_mask.mask_mod
        elif mask_mod is not block_mask.mask_mod:
            raise ValueError("mask_mod must be the function block_mask was created with (or None to use it)")
        if aux_tensors is None:
            aux_tensors = block_mask.aux_tensors
        if block_mask.batch not in (1, batch) or block_mask.nheads not in (1, nheads):
            raise ValueError(f"block_mask was built for batch {block_mask.batch} and nheads {block_mask.nheads}; "
                             f"this call has batch {batch} and nheads {nheads} (1 = broadcast)")
        if block_mask.seqlen_q < max_seqlen_q or block_mask.seqlen_k < max_seqlen_k:
            raise ValueError(f"block_mask covers seqlen_q {block_mask.seqlen_q} and seqlen_k {block_mask.seqlen_k}; "
                             f"this call needs at least {max_seqlen_q} and {max_seqlen_k}")
        if block_mask.ranges.device != device:
            raise ValueError(f"block_mask is on {block_mask.ranges.device}, but q is on {device}")
        if opts.pack_gqa:
            raise ValueError("pack_gqa=True cannot take a block_mask (its entries are per query head); "
                             "leave pack_gqa None")
        opts = opts._replace(pack_gqa=False)
        block_q, ranges = block_mask.block_q, block_mask.kernel_ranges(batch, nheads)
    if score_mod is not None and opts.softcap > 0:
        raise ValueError("softcap and score_mod cannot be combined: apply the cap inside score_mod "
                         "(flash_attn_cute.mods.softcap)")
    aux = user_variants.check_aux_tensors(aux_tensors, device)
    spec = user_variants.make_spec(score_mod, mask_mod, aux, block_q)
    return opts, (spec, user_variants.kernel_aux(aux) + (ranges,), ranges)


def normalize_window(causal, window_size) -> tuple[bool, int, int]:
    """``(causal, window_left, window_right)`` as the kernels take them.

    None entries mean -1 (unbounded). ``causal`` forces ``window_right = 0`` and stays
    True (a left window may remain: sliding-window causal). Without ``causal``, a window
    ``(-1, 0)`` is exactly causal and becomes ``causal=True``; any other window with a
    bounded side is local attention (``causal=False``)."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a pair (left, right) of ints >= 0, -1 or None, got {window_size!r}")
    left, right = (-1 if w is None else w for w in window_size)
    for side, w in (("window_size[0] (left)", left), ("window_size[1] (right)", right)):
        if isinstance(w, bool) or not isinstance(w, numbers.Integral):
            raise TypeError(f"{side} must be an int >= 0, -1 or None, got {w!r}")
        if not -1 <= w <= _INT32_MAX:
            raise ValueError(f"{side} must be in [0, 2**31 - 1], or -1/None for unbounded, got {w}")
    left, right = int(left), int(right)
    if causal:
        right = 0
    elif left == -1 and right == 0:
        causal = True
    return causal, left, right


def _backend_name(backend) -> Optional[str]:
    """The requested backend (argument, else FLASH_ATTN_CUTE_BACKEND), None = by device."""
    source = "backend"
    if backend is None:
        backend, source = os.environ.get("FLASH_ATTN_CUTE_BACKEND"), "FLASH_ATTN_CUTE_BACKEND"
    if backend is None or (isinstance(backend, str) and backend.strip().lower() in ("", "auto")):
        return None
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str or None, got {type(backend).__name__}")
    name = backend.strip().lower()
    if name not in BACKENDS:
        raise ValueError(f"{source} must be one of {BACKENDS} or None/'auto', got {backend!r}")
    return name


def _check_device(tensors: dict) -> None:
    """All tensors on one CUDA device (checked after every shape/dtype check)."""
    device = None
    for name, t in tensors.items():
        if t is None:
            continue
        if t.device.type != "cuda":
            raise ValueError(f"{name} must be a CUDA tensor, got device {t.device}")
        if device is None:
            device, first = t.device, name
        elif t.device != device:
            raise ValueError(f"{name} is on {t.device} but {first} is on {device}; all tensors "
                             f"must be on the same device")


def _check_out(out, shape: tuple, dtype: torch.dtype, form: str):
    if out is None:
        return None
    _tensor("out", out, len(shape), form)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"out must have shape {form} = {tuple(shape)}, got {tuple(out.shape)}")
    _dtype("out", out, dtype, f"{dtype} (the output dtype)")
    return _layout("out", out)


def _qkv(q, k, v, q_form: str, kv_rank: int, k_form: str, v_form: str):
    """Common q/k/v checks; returns (nheads, nheads_kv, d, d_v) and aligned views."""
    _tensor("k", k, kv_rank, k_form)
    _tensor("v", v, kv_rank, v_form)
    _dtype("q", q, SUPPORTED_DTYPES, "float16 or bfloat16")
    _dtype("k", k, q.dtype, f"{q.dtype} like q")
    _dtype("v", v, q.dtype, f"{q.dtype} like q")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k {k_form} and v {v_form} must agree on all but the last dim, got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    nheads, d = q.shape[-2], q.shape[-1]
    nheads_kv, d_v = k.shape[-2], v.shape[-1]
    if k.shape[-1] != d:
        raise ValueError(f"k head dimension ({k.shape[-1]}) must equal q's ({d})")
    if nheads_kv < 1 or nheads < 1 or nheads % nheads_kv:
        raise ValueError(f"nheads of q ({nheads}) must be a positive multiple of nheads_kv of k/v ({nheads_kv})")
    _head_dim("q/k", d)
    _head_dim("v", d_v)
    return nheads, nheads_kv, d, d_v, _layout("q", q), _layout("k", k), _layout("v", v)


# ---------------------------------------------------------------------------------------
# Per-call cache: a repeated call skips validation and planning
# ---------------------------------------------------------------------------------------
#
# A serving loop calls the same entry point with tensors of the same shapes, strides,
# dtypes and device every step. The key below captures everything validation and
# planning read (per tensor: class, shape, strides, dtype, device; the scalar arguments
# with their types, so ``causal=1`` never hits an entry made by ``causal=True``), so an
# entry made by a call that passed validation answers for every call with the same key:
# only the data pointers differ, and their 16-byte alignment is checked on every call.

_FAST_CACHE_SIZE = 1024
_fast_calls: dict = {}


class _FastEntry(NamedTuple):
    problem: FwdProblem
    resolved: object  # fwd.resolve(...)
    out_shape: tuple
    lse_shape: tuple
    seqlens_fill: Optional[int]  # flash_attn_with_kvcache with an int cache_seqlens
    block_ranges: Optional[torch.Tensor] = None  # a block mask's ranges, broadcast to the call


def _tensor_sig(t):
    """What validation reads of a tensor argument. The pointer's low bits stand in for its
    alignment: a misaligned call never matches an entry made by an aligned one."""
    if t is None:
        return None
    return t.__class__, t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() & 15


def _call_key(kind: str, tensors: tuple, scalars: tuple, window):
    """The per-call cache key, or None when the call cannot use the cache (a non-tensor
    argument: the full path then decides). Scalars travel with their types (``causal=1``
    never hits an entry made by ``causal=True``)."""
    try:
        return (kind, scalars, tuple(map(type, scalars)), window, tuple(map(type, window)),
                os.environ.get("FLASH_ATTN_CUTE_BACKEND"), *map(_tensor_sig, tensors))
    except (AttributeError, TypeError):
        return None


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


def _lookup(key):
    """(cached entry or None, the key if it can be stored)."""
    if key is None:
        return None, None
    try:
        return _fast_calls.get(key), key
    except TypeError:  # an unhashable argument (a list window, ...)
        return None, None


def _replay(entry: _FastEntry, q, k, v, out, return_lse, cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None,
            page_table=None, aux_tensors=None):
    if out is None:
        out = q.new_empty(entry.out_shape)
    lse = q.new_empty(entry.lse_shape, dtype=torch.float32) if return_lse else None
    if entry.seqlens_fill is not None:
        seqused_k = torch.full((entry.problem.batch,), entry.seqlens_fill, dtype=torch.int32, device=q.device)
    variant_tensors = fwd._NO_VARIANT
    if entry.problem.variant is not None:
        variant_tensors = user_variants.kernel_aux(aux_tensors or ()) + (entry.block_ranges,)
    fwd.run_resolved(entry.resolved, entry.problem, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k,
                     page_table, variant_tensors)
    return (out, lse) if return_lse else out


def _same(key, given: tuple, checked: tuple):
    """``key`` if validation handed the tensors through unchanged (it re-strides size-1
    dims with odd strides: such calls are not cached), else None."""
    return key if all(a is b for a, b in zip(given, checked)) else None


def clear_call_cache() -> None:
    """Forget every cached call (and the seam's resolved plans)."""
    _fast_calls.clear()
    fwd.clear_plan_cache()


# ---------------------------------------------------------------------------------------
# Shared launch path
# ---------------------------------------------------------------------------------------


def _flash_attn_fwd(q, k, v, out, opts: _Options, *, batch: int, max_seqlen_q: int, max_seqlen_k: int,
                    nheads: int, nheads_kv: int, d_v: int, return_lse: bool, cu_seqlens_q=None, cu_seqlens_k=None,
                    seqused_k=None, page_table=None, fast_key=None, seqlens_fill=None, variant=None):
    """Allocate outputs, describe the call as a ``FwdProblem`` and run it through the
    dispatch seam (``fwd.run_fwd``: backend, plan, launch, combine).

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
    spec, variant_tensors, block_ranges = (None, fwd._NO_VARIANT, None) if variant is None else variant
    problem = FwdProblem(
        q.dtype, batch, max_seqlen_q, max_seqlen_k, nheads, nheads_kv, q.shape[-1], d_v, opts.softmax_scale,
        opts.causal, opts.window_left, opts.window_right, opts.softcap, varlen, cu_seqlens_k is not None,
        seqused_k is not None, k.shape[1] if page_table is not None else 0, return_lse, spec)
    resolved = fwd.resolve(problem, opts.backend, opts.num_splits, opts.pack_gqa, q.device)
    fwd.run_resolved(resolved, problem, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table,
                     variant_tensors)
    if fast_key is not None:
        if len(_fast_calls) >= _FAST_CACHE_SIZE:
            _fast_calls.clear()
        _fast_calls[fast_key] = _FastEntry(problem, resolved, tuple(out.shape), lse_shape, seqlens_fill,
                                           block_ranges)
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
    hit, key = _lookup(_call_key("func", (q, k, v, out, *_aux_list(aux_tensors)),
                                 (softmax_scale, causal, softcap, num_splits, pack_gqa, return_lse, backend, score_mod,
                                  mask_mod, block_mask), window_size))
    if hit is not None:
        return _replay(hit, q, k, v, out, return_lse, aux_tensors=_aux_of(aux_tensors, block_mask))
    inputs = (q, k, v, out)
    _tensor("q", q, 4, _Q4)
    nheads, nheads_kv, d, d_v, q, k, v = _qkv(
        q, k, v, _Q4, 4, "(batch, seqlen_k, nheads_kv, headdim)", "(batch, seqlen_k, nheads_kv, headdim_v)")
    batch, seqlen_q = q.shape[:2]
    if k.shape[0] != batch:
        raise ValueError(f"k and v must have the batch size of q ({batch}), got {k.shape[0]}")
    opts = _options(d, softmax_scale, causal, window_size, softcap, num_splits, pack_gqa, backend)
    out = _check_out(out, (batch, seqlen_q, nheads, d_v), q.dtype, "(batch, seqlen_q, nheads, headdim_v)")
    _check_device({"q": q, "k": k, "v": v, "out": out})
    opts, variant = _variant(score_mod, mask_mod, aux_tensors, block_mask, opts, q.device, batch=batch,
                             nheads=nheads, max_seqlen_q=seqlen_q, max_seqlen_k=k.shape[1])
    return _flash_attn_fwd(q, k, v, out, opts, batch=batch, max_seqlen_q=seqlen_q, max_seqlen_k=k.shape[1],
                           nheads=nheads, nheads_kv=nheads_kv, d_v=d_v, return_lse=bool(return_lse),
                           fast_key=_same(key, inputs, (q, k, v, out)), variant=variant)


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
    hit, key = _lookup(_call_key("varlen", (q, k, v, cu_seqlens_q, cu_seqlens_k, out, *_aux_list(aux_tensors)),
                                 (max_seqlen_q, max_seqlen_k, softmax_scale, causal, softcap, num_splits, pack_gqa,
                                  return_lse, backend, score_mod, mask_mod, block_mask), window_size))
    if hit is not None:
        return _replay(hit, q, k, v, out, return_lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                       aux_tensors=_aux_of(aux_tensors, block_mask))
    inputs = (q, k, v, out)
    _tensor("q", q, 3, "(total_q, nheads, headdim)")
    nheads, nheads_kv, d, d_v, q, k, v = _qkv(
        q, k, v, "(total_q, nheads, headdim)", 3, "(total_k, nheads_kv, headdim)", "(total_k, nheads_kv, headdim_v)")
    _tensor("cu_seqlens_q", cu_seqlens_q, 1, "(batch + 1,)")
    batch = cu_seqlens_q.shape[0] - 1
    if batch < 0:
        raise ValueError("cu_seqlens_q must have shape (batch + 1,) with at least one entry, got (0,)")
    _int32_vector("cu_seqlens_q", cu_seqlens_q, batch + 1, "(batch + 1,)")
    _int32_vector("cu_seqlens_k", cu_seqlens_k, batch + 1, "(batch + 1,) like cu_seqlens_q")
    max_seqlen_q = _int("max_seqlen_q", max_seqlen_q, 0, _INT32_MAX)
    max_seqlen_k = _int("max_seqlen_k", max_seqlen_k, 0, _INT32_MAX)
    opts = _options(d, softmax_scale, causal, window_size, softcap, num_splits, pack_gqa, backend)
    out = _check_out(out, (q.shape[0], nheads, d_v), q.dtype, "(total_q, nheads, headdim_v)")
    _check_device({"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k, "out": out})
    opts, variant = _variant(score_mod, mask_mod, aux_tensors, block_mask, opts, q.device, batch=batch,
                             nheads=nheads, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    if k.shape[0] == 0:
        max_seqlen_k = 0
    return _flash_attn_fwd(q, k, v, out, opts, batch=batch, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                           nheads=nheads, nheads_kv=nheads_kv, d_v=d_v, return_lse=bool(return_lse),
                           cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                           fast_key=_same(key, inputs, (q, k, v, out)), variant=variant)


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
        hit, key = _lookup(_call_key(
            "kvcache", (q, k_cache, v_cache, None if int_seqlens is not None else cache_seqlens, page_table, out,
                        *_aux_list(aux_tensors)),
            (int_seqlens, softmax_scale, causal, softcap, num_splits, pack_gqa, return_lse, backend, score_mod,
             mask_mod, block_mask), window_size))
        if hit is not None:
            return _replay(hit, q, k_cache, v_cache, out, return_lse, seqused_k=cache_seqlens, page_table=page_table,
                           aux_tensors=_aux_of(aux_tensors, block_mask))
    inputs = (q, k_cache, v_cache, out)
    _tensor("q", q, 4, _Q4)
    paged = page_table is not None
    kv_form = "(num_pages, page_size, nheads_kv, {})" if paged else "(batch, max_seqlen_k, nheads_kv, {})"
    nheads, nheads_kv, d, d_v, q, k_cache, v_cache = _qkv(
        q, k_cache, v_cache, _Q4, 4, kv_form.format("headdim"), kv_form.format("headdim_v"))
    batch, seqlen_q = q.shape[:2]
    if paged:
        _tensor("page_table", page_table, 2, "(batch, max_pages_per_seq)")
        _dtype("page_table", page_table, torch.int32, "int32 of shape (batch, max_pages_per_seq)")
        if page_table.shape[0] != batch:
            raise ValueError(f"page_table must have shape (batch, max_pages_per_seq) with batch = {batch}, "
                             f"got {tuple(page_table.shape)}")
        if page_table.shape[1] > 1 and page_table.stride(1) != 1:
            raise ValueError(f"page_table must have a contiguous last dimension, got strides {page_table.stride()}")
        if k_cache.shape[1] < 1:
            raise ValueError("page_size (k_cache.shape[1]) must be >= 1")
        capacity = page_table.shape[1] * k_cache.shape[1]
    else:
        if k_cache.shape[0] != batch:
            raise ValueError(f"k_cache and v_cache must have shape (batch, max_seqlen_k, nheads_kv, headdim) "
                             f"with batch = {batch}, got {tuple(k_cache.shape)}")
        capacity = k_cache.shape[1]
    seqlens_fill = None
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        max_seqlen_k = seqlens_fill = _int("cache_seqlens", cache_seqlens, 0, capacity)
        cache_seqlens = torch.full((batch,), max_seqlen_k, dtype=torch.int32, device=q.device)
    else:
        _int32_vector("cache_seqlens", cache_seqlens, batch, "(batch,) or an int")
        max_seqlen_k = None
    opts = _options(d, softmax_scale, causal, window_size, softcap, num_splits, pack_gqa, backend)
    out = _check_out(out, (batch, seqlen_q, nheads, d_v), q.dtype, "(batch, seqlen_q, nheads, headdim_v)")
    _check_device({"q": q, "k_cache": k_cache, "v_cache": v_cache, "cache_seqlens": cache_seqlens,
                   "page_table": page_table, "out": out})
    if max_seqlen_k is None:  # lengths live on the device
        if check_cache_bounds:  # opt-in: one device -> host read
            max_seqlen_k = _check_cache_bounds(cache_seqlens, capacity, page_table, k_cache.shape)
        else:
            max_seqlen_k = capacity
    opts, variant = _variant(score_mod, mask_mod, aux_tensors, block_mask, opts, q.device, batch=batch,
                             nheads=nheads, max_seqlen_q=seqlen_q, max_seqlen_k=capacity)
    return _flash_attn_fwd(q, k_cache, v_cache, out, opts, batch=batch, max_seqlen_q=seqlen_q,
                           max_seqlen_k=max_seqlen_k, nheads=nheads, nheads_kv=nheads_kv, d_v=d_v,
                           return_lse=bool(return_lse), seqused_k=cache_seqlens, page_table=page_table,
                           fast_key=_same(key, inputs, (q, k_cache, v_cache, out)), seqlens_fill=seqlens_fill,
                           variant=variant)


def _check_cache_bounds(cache_seqlens: torch.Tensor, capacity: int, page_table, kv_shape) -> int:
    """Refuse cache lengths outside [0, capacity] and referenced pages outside
    [0, num_pages); returns max(cache_seqlens) (a tighter bound than the capacity, used
    by the split heuristic). Skipped, returning the capacity, under CUDA-graph capture."""
    if cache_seqlens.numel() == 0:
        return 0
    if cache_seqlens.is_cuda and torch.cuda.is_current_stream_capturing():
        return capacity
    stats = list(torch.aminmax(cache_seqlens))
    if page_table is not None and page_table.shape[1] > 0:
        pages_used = (cache_seqlens.clamp(min=0) + kv_shape[1] - 1) // kv_shape[1]
        used = torch.arange(page_table.shape[1], device=page_table.device)[None, :] < pages_used[:, None]
        stats += [torch.where(used, page_table, 0).min(), torch.where(used, page_table, 0).max()]
    lo, hi, *pages = torch.stack(stats).tolist()
    if lo < 0 or hi > capacity:
        what = "max_pages_per_seq * page_size" if page_table is not None else "max_seqlen_k (k_cache.shape[1])"
        raise ValueError(f"cache_seqlens must lie in [0, {what} = {capacity}], got values in [{lo}, {hi}]")
    if pages and (pages[0] < 0 or pages[1] >= kv_shape[0]):
        raise ValueError(f"page_table entries used by cache_seqlens must lie in [0, num_pages = {kv_shape[0]}), "
                         f"got values in [{pages[0]}, {pages[1]}]")
    return hi


def flash_attn_combine(out_partial, lse_partial, *, out=None, out_dtype=None, return_lse=False):
    """Merge split-KV partials: ``out = sum_s exp(lse_s - lse) * out_s``, ``lse = logsumexp_s lse_s``.

    out_partial ``(num_splits, batch, seqlen_q, nheads, d_v)`` fp32, lse_partial
    ``(num_splits, batch, nheads, seqlen_q)`` fp32, ``num_splits <= 256``. Returns out
    ``(batch, seqlen_q, nheads, d_v)`` in ``out_dtype`` (default: out's dtype if given,
    else fp32; fp16/bf16/fp32), or ``(out, lse)`` with lse ``(batch, nheads, seqlen_q)``."""
    form_o, form_l = "(num_splits, batch, seqlen_q, nheads, headdim_v)", "(num_splits, batch, nheads, seqlen_q)"
    _tensor("out_partial", out_partial, 5, form_o)
    _tensor("lse_partial", lse_partial, 4, form_l)
    _dtype("out_partial", out_partial, torch.float32, "float32")
    _dtype("lse_partial", lse_partial, torch.float32, "float32")
    ns, b, s, h, d_v = out_partial.shape
    if tuple(lse_partial.shape) != (ns, b, h, s):
        raise ValueError(f"lse_partial must have shape {form_l} = {(ns, b, h, s)} to match out_partial, "
                         f"got {tuple(lse_partial.shape)}")
    if not 1 <= ns <= MAX_SPLITS:
        raise ValueError(f"num_splits (out_partial.shape[0]) must be in [1, {MAX_SPLITS}], got {ns}")
    _head_dim("out_partial", d_v)
    if lse_partial.shape[-1] > 1 and lse_partial.stride(-1) != 1:
        raise ValueError(f"lse_partial must have a contiguous last dimension, got strides {lse_partial.stride()}")
    out_partial = _layout("out_partial", out_partial)
    if out_dtype is None:
        out_dtype = out.dtype if isinstance(out, torch.Tensor) else torch.float32
    if out_dtype not in SUPPORTED_DTYPES + (torch.float32,):
        raise TypeError(f"out_dtype must be float16, bfloat16 or float32, got {out_dtype}")
    out = _check_out(out, (b, s, h, d_v), out_dtype, "(batch, seqlen_q, nheads, headdim_v)")
    _check_device({"out_partial": out_partial, "lse_partial": lse_partial, "out": out})
    if out is None:
        out = out_partial.new_empty((b, s, h, d_v), dtype=out_dtype)
    lse = lse_partial.new_empty((b, h, s)) if return_lse else None
    if out.numel() > 0 or (lse is not None and lse.numel() > 0):
        fwd.combine_launcher(out.dtype, d_v, lse is not None)(out_partial, lse_partial, out, lse)
    return (out, lse) if return_lse else out
