"""Validation of the public API's arguments, shared by every entry point.

Every check raises before anything is launched, with a message that names the argument
and the expected form. Order inside an entry point: shapes, then dtypes, then scalars,
then the device. Plain Python and torch (no DSL).
"""

from __future__ import annotations

import logging
import math
import numbers
import os
from typing import NamedTuple, Optional

import torch

from flash_attn_cute.host import user_variants
from flash_attn_cute.host.constants import HEAD_DIM_ALIGN, INT32_MAX, MAX_GRID_YZ, MAX_HEAD_DIM, MAX_SPLITS
from flash_attn_cute.host.fp8 import FP8_DTYPES  # K/V caches (with 16-bit queries), and e4m3 queries (FP8 attention)
from flash_attn_cute.host.registry import BACKENDS

# Head dims the forward takes: every multiple of 8 up to 256 (FA3's and vLLM's range), each
# run on the next tile width its kernel compiles (``constants.padded_head_dims``; a backend
# whose tiles cannot hold a pair falls back to SM80 or names the reason).
SUPPORTED_HEAD_DIMS = tuple(range(HEAD_DIM_ALIGN, MAX_HEAD_DIM + 1, HEAD_DIM_ALIGN))
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
log = logging.getLogger("flash_attn_cute")
BACKEND_NAMES = tuple(BACKENDS)  # names accepted by ``backend=`` / FLASH_ATTN_CUTE_BACKEND


def check_tensor(name: str, t, rank: int, form: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {form}, got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"{name} must have shape {form} (rank {rank}), got shape {tuple(t.shape)}")
    return t


def check_dtype(name: str, t: torch.Tensor, expected, what: str) -> None:
    expected = expected if isinstance(expected, tuple) else (expected,)
    if t.dtype not in expected:
        raise TypeError(f"{name} must be {what}, got {t.dtype}")


def check_head_dim(name: str, d: int, fp8: bool = False) -> None:
    """A multiple of 8 (16-byte rows of 16-bit values) in [8, 256]; FP8 tensors: of 16
    (their rows are copied 16 bytes at a time, and a TMA row stride is a multiple of 16
    bytes)."""
    align = 2 * HEAD_DIM_ALIGN if fp8 else HEAD_DIM_ALIGN
    if d % align or not align <= d <= MAX_HEAD_DIM:
        what = " (FP8 tensors)" if fp8 else ""
        raise ValueError(f"{name} head dimension must be a multiple of {align} in [{align}, {MAX_HEAD_DIM}]{what}, "
                         f"got {d}")


def aligned(name: str, t: torch.Tensor) -> torch.Tensor:
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


def int32_vector(name: str, t, length: int, form: str) -> torch.Tensor:
    check_tensor(name, t, 1, form)
    check_dtype(name, t, torch.int32, f"int32 of shape {form}")
    if t.shape[0] != length:
        raise ValueError(f"{name} must have shape {form} = ({length},), got {tuple(t.shape)}")
    if length > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous, got stride {t.stride()}")
    return t


def int_arg(name: str, x, lo: int, hi: Optional[int] = None) -> int:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    x = int(x)
    if x < lo or (hi is not None and x > hi):
        raise ValueError(f"{name} must be in [{lo}, {hi if hi is not None else 'inf'}], got {x}")
    return x


def softmax_scale(scale, default: float) -> float:
    if scale is None:
        scale = default
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a float or None, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"softmax_scale must be finite, got {scale}")
    return float(scale)


def page_table_arg(table, batch: int, page_size: int, cache_name: str) -> None:
    """``(batch, max_pages_per_seq)`` int32 with a contiguous last dim; ``page_size``
    (``<cache_name>.shape[1]``) at least 1."""
    check_tensor("page_table", table, 2, "(batch, max_pages_per_seq)")
    check_dtype("page_table", table, torch.int32, "int32 of shape (batch, max_pages_per_seq)")
    if table.shape[0] != batch:
        raise ValueError(f"page_table must have shape (batch, max_pages_per_seq) with batch = {batch}, "
                         f"got {tuple(table.shape)}")
    if table.shape[1] > 1 and table.stride(1) != 1:
        raise ValueError(f"page_table must have a contiguous last dimension, got strides {table.stride()}")
    if page_size < 1:
        raise ValueError(f"page_size ({cache_name}.shape[1]) must be >= 1")


SINK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def learnable_sink(sink, nheads: int) -> None:
    """``(nheads,)`` float32/bfloat16/float16, contiguous: one logit per query head."""
    if sink is None:
        return
    check_tensor("learnable_sink", sink, 1, "(nheads,)")
    if sink.shape[0] != nheads:
        raise ValueError(f"learnable_sink must have shape (nheads,) = ({nheads},) (one logit per query head), "
                         f"got {tuple(sink.shape)}")
    check_dtype("learnable_sink", sink, SINK_DTYPES, "float32, bfloat16 or float16")
    if nheads > 1 and sink.stride(0) != 1:
        raise ValueError(f"learnable_sink must be contiguous, got stride {sink.stride()}")


def packed_queries(q: torch.Tensor, cu_seqlens_q, max_seqlen_q) -> tuple:
    """(batch, max_seqlen_q) of packed queries ``(total_q, ...)`` with ``cu_seqlens_q``
    ``(batch + 1,)`` int32; ``max_seqlen_q`` None bounds the lengths by ``total_q`` (never
    read from the device)."""
    check_tensor("cu_seqlens_q", cu_seqlens_q, 1, "(batch + 1,)")
    batch = cu_seqlens_q.shape[0] - 1
    if batch < 0:
        raise ValueError("cu_seqlens_q must have shape (batch + 1,) with at least one entry, got (0,)")
    int32_vector("cu_seqlens_q", cu_seqlens_q, batch + 1, "(batch + 1,)")
    if max_seqlen_q is None:
        return batch, q.shape[0]
    return batch, int_arg("max_seqlen_q", max_seqlen_q, 0, INT32_MAX)


def queries_and_cache(q, k_cache, v_cache, cu_seqlens_q, max_seqlen_q, page_table, cache_batch: str):
    """``flash_attn_with_kvcache``'s q (packed ``(total_q, nheads, headdim)`` with
    ``cu_seqlens_q``, else dense) and caches (paged with ``page_table``, else
    ``(<cache_batch>, max_seqlen_k, nheads_kv, headdim*)``): returns (nheads, nheads_kv, d,
    d_v, q, k_cache, v_cache (aligned views), batch, max_seqlen_q)."""
    varlen_q = cu_seqlens_q is not None
    q_form = "(total_q, nheads, headdim)" if varlen_q else "(batch, seqlen_q, nheads, headdim)"
    check_tensor("q", q, 3 if varlen_q else 4, q_form)
    kv_form = ("(num_pages, page_size, nheads_kv, {})" if page_table is not None
               else f"({cache_batch}, max_seqlen_k, nheads_kv, {{}})")
    dims = qkv(q, k_cache, v_cache, q_form, 4, kv_form.format("headdim"), kv_form.format("headdim_v"))
    q = dims[4]
    batch, seqlen_q = packed_queries(q, cu_seqlens_q, max_seqlen_q) if varlen_q else q.shape[:2]
    return (*dims, batch, seqlen_q)


def cache_capacity(k, batch: int, page_table, name: str, rows_per_sequence: bool = True,
                   why: str = "") -> int:
    """Keys one sequence of a cache can hold: ``max_pages_per_seq * page_size`` with a
    ``page_table`` (checked), else the cache's length mode, the cache having one row per
    sequence (``rows_per_sequence``; ``why`` says how else it may be laid out)."""
    if page_table is not None:
        page_table_arg(page_table, batch, k.shape[1], name)
        return page_table.shape[1] * k.shape[1]
    if rows_per_sequence and k.shape[0] != batch:
        raise ValueError(f"{name} must have shape (batch, max_seqlen_k, nheads_kv, headdim) with batch = {batch}"
                         f"{why}, got {tuple(k.shape)}")
    return k.shape[1]


def cache_lengths(cache_seqlens, batch: int, capacity: int, room: int, device) -> tuple:
    """(lengths (batch,) int32, the int they were filled with or None): ``cache_seqlens`` as
    a tensor, an int in [0, capacity - room] for every sequence, or None (the whole cache,
    less ``room`` for the tokens an append adds)."""
    if cache_seqlens is None:
        cache_seqlens = capacity - room
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        fill = int_arg("cache_seqlens", cache_seqlens, 0, capacity - room)
        return torch.full((batch,), fill, dtype=torch.int32, device=device), fill
    int32_vector("cache_seqlens", cache_seqlens, batch, "(batch,) or an int")
    return cache_seqlens, None


# FA3 keywords that change nothing here or are refused (``fa3_keywords``)
FA3_ARGS = ("qv", "attention_chunk", "rotary_seqlens", "deterministic", "scheduler_metadata")


class Options(NamedTuple):
    softmax_scale: float
    softcap: float
    causal: bool
    window_left: int
    window_right: int
    pack_gqa: Optional[bool]
    num_splits: int
    backend: Optional[str]
    batch_invariant: bool = False
    fp8_two_level_interval: int = 0
    sm_margin: int = 0


def options(d: int, scale, causal, window_size, softcap, num_splits, pack_gqa, backend,
            batch_invariant=False, fp8_two_level_interval=0, sm_margin=0) -> Options:
    """Validate and normalise the keyword arguments shared by the forward entry points."""
    scale = softmax_scale(scale, d ** -0.5)
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a float (0.0 = off), got {type(softcap).__name__}")
    if not softcap >= 0 or not math.isfinite(softcap):
        raise ValueError(f"softcap must be >= 0 (0.0 = off), got {softcap}")
    causal, window_left, window_right = normalize_window(causal, window_size)
    if pack_gqa is not None and not isinstance(pack_gqa, bool):
        raise TypeError(f"pack_gqa must be True, False or None (auto), got {pack_gqa!r}")
    if not isinstance(batch_invariant, bool):
        raise TypeError(f"batch_invariant must be a bool, got {type(batch_invariant).__name__}")
    return Options(scale, float(softcap), causal, window_left, window_right, pack_gqa,
                   int_arg("num_splits", num_splits, 0, MAX_SPLITS), backend_name(backend), batch_invariant,
                   two_level_interval(fp8_two_level_interval), int_arg("sm_margin", sm_margin, 0, INT32_MAX))


def fa3_keywords(args: dict) -> None:
    """The ``FA3_ARGS`` of a call's arguments (absent ones at their defaults). FA3's keywords
    with no effect here are accepted so that FA3 calls run unchanged: ``deterministic``
    (the forward is deterministic: fixed split and combine orders, no atomics; FA3's flag
    chooses a backward) and ``scheduler_metadata`` (FA3's ``get_scheduler_metadata``
    result; not needed: plans come from shapes, on the host).
    Those asking for what is not built are refused: ``qv`` (FA3's extra query-value
    product of absorbed MLA; MLA decode is ``flash_mla_decode``), ``attention_chunk > 0``
    (chunked local attention) and ``rotary_seqlens`` (rotary positions apart from the
    cache lengths)."""
    qv, attention_chunk, rotary_seqlens = args.get("qv"), args.get("attention_chunk", 0), args.get("rotary_seqlens")
    deterministic, scheduler_metadata = args.get("deterministic", False), args.get("scheduler_metadata")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    if scheduler_metadata is not None and not isinstance(scheduler_metadata, torch.Tensor):
        raise TypeError(f"scheduler_metadata must be a tensor or None, got {type(scheduler_metadata).__name__}")
    if qv is not None:
        raise NotImplementedError("qv (FA3's query-value product of absorbed MLA) is not supported: MLA decode is "
                                  "flash_attn_cute.flash_mla_decode")
    if int_arg("attention_chunk", attention_chunk, 0, INT32_MAX):
        raise NotImplementedError(f"attention_chunk={attention_chunk} (chunked local attention) is not supported; "
                                  "pass 0")
    if rotary_seqlens is not None:
        raise NotImplementedError("rotary_seqlens (rotary positions apart from cache_seqlens) is not supported: "
                                  "the keys and queries are rotated at their cache positions")


def two_level_interval(n) -> int:
    """``fp8_two_level_interval``: an int >= 0 (FlashInfer's name and meaning; 0 = off). Any
    value is accepted for any call: only the SM90 FP8 Q, K, V kernel reads it."""
    return int_arg("fp8_two_level_interval", n, 0, INT32_MAX)


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
        if not -1 <= w <= INT32_MAX:
            raise ValueError(f"{side} must be in [0, 2**31 - 1], or -1/None for unbounded, got {w}")
    left, right = int(left), int(right)
    if causal:
        right = 0
    elif left == -1 and right == 0:
        causal = True
    return causal, left, right


def backend_name(backend) -> Optional[str]:
    """The requested backend (argument, else FLASH_ATTN_CUTE_BACKEND), None = by device."""
    source = "backend"
    if backend is None:
        backend, source = os.environ.get("FLASH_ATTN_CUTE_BACKEND"), "FLASH_ATTN_CUTE_BACKEND"
    if backend is None or (isinstance(backend, str) and backend.strip().lower() in ("", "auto")):
        return None
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str or None, got {type(backend).__name__}")
    name = backend.strip().lower()
    if name not in BACKEND_NAMES:
        raise ValueError(f"{source} must be one of {BACKEND_NAMES} or None/'auto', got {backend!r}")
    return name


def check_device(tensors: dict) -> None:
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


def check_out(out, shape: tuple, dtype: torch.dtype, form: str):
    if out is None:
        return None
    check_tensor("out", out, len(shape), form)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"out must have shape {form} = {tuple(shape)}, got {tuple(out.shape)}")
    check_dtype("out", out, dtype, f"{dtype} (the output dtype)")
    return aligned("out", out)


def qkv(q, k, v, q_form: str, kv_rank: int, k_form: str, v_form: str):
    """Common q/k/v checks; returns (nheads, nheads_kv, d, d_v) and aligned views."""
    check_tensor("k", k, kv_rank, k_form)
    check_tensor("v", v, kv_rank, v_form)
    if q.dtype in FP8_DTYPES:  # FP8 attention: q_descale / k_descale / v_descale scale q, k and v
        if q.dtype != torch.float8_e4m3fn:
            raise TypeError(f"FP8 queries must be float8_e4m3fn (FP8 attention with e4m3 q, k and v), got "
                            f"{q.dtype}; float8_e5m2 is supported for K/V caches with 16-bit queries")
        if k.dtype != q.dtype or v.dtype != q.dtype:
            raise TypeError(f"FP8 queries need k and v in {q.dtype} too, got k {k.dtype} and v {v.dtype}")
    else:
        check_dtype("q", q, SUPPORTED_DTYPES, "float16, bfloat16 or float8_e4m3fn")
        if k.dtype in FP8_DTYPES or v.dtype in FP8_DTYPES:  # an FP8 cache: k_descale / v_descale scale it
            if k.dtype != v.dtype:
                raise TypeError(f"k and v must share one dtype: an FP8 cache has both in float8_e4m3fn or both in "
                                f"float8_e5m2, got k {k.dtype} and v {v.dtype}")
        else:
            check_dtype("k", k, q.dtype, f"{q.dtype} like q, or an FP8 dtype {FP8_DTYPES}")
            check_dtype("v", v, q.dtype, f"{q.dtype} like q, or an FP8 dtype {FP8_DTYPES}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k {k_form} and v {v_form} must agree on all but the last dim, got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    nheads, d = q.shape[-2], q.shape[-1]
    nheads_kv, d_v = k.shape[-2], v.shape[-1]
    if k.shape[-1] != d:
        raise ValueError(f"k head dimension ({k.shape[-1]}) must equal q's ({d})")
    if nheads_kv < 1 or nheads < 1 or nheads % nheads_kv:
        raise ValueError(f"nheads of q ({nheads}) must be a positive multiple of nheads_kv of k/v ({nheads_kv})")
    if nheads > MAX_GRID_YZ:  # the head groups are the grid's y extent (tile_scheduler)
        raise ValueError(f"nheads of q must be in [1, {MAX_GRID_YZ}], got {nheads}")
    check_head_dim("q/k", d, k.dtype in FP8_DTYPES)
    check_head_dim("v", d_v, v.dtype in FP8_DTYPES)
    return nheads, nheads_kv, d, d_v, aligned("q", q), aligned("k", k), aligned("v", v)


def descales(k, q_descale, k_descale, v_descale, batch: int, nheads_kv: int) -> None:
    """FA3's ``q_descale`` / ``k_descale`` / ``v_descale``: fp32 tensors of shape ``(batch,
    nheads_kv)`` (or one element, broadcast), the factors that turn the stored FP8 values
    back into real ones. They apply to FP8 tensors only (as in FA3, where vLLM passes unit
    scales for 16-bit caches too): with 16-bit K/V they are checked and ignored."""
    for name, t in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        descale(name, t, ((batch, nheads_kv),), f"shape (batch, nheads_kv) = {(batch, nheads_kv)} or one element")


def descale(name: str, t, shapes: tuple, form: str) -> None:
    """One descale argument: None, or an fp32 tensor of one element or of one of ``shapes``
    (``form`` says which, in the messages)."""
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (float32, {form}), got {type(t).__name__}")
    check_dtype(name, t, torch.float32, "float32")
    if t.numel() != 1 and tuple(t.shape) not in shapes:
        raise ValueError(f"{name} must have {form}, got {tuple(t.shape)}")


def user_variant(score_mod, mask_mod, aux_tensors, block_mask, opts: Options, device, *, batch: int, nheads: int,
                 max_seqlen_q: int, max_seqlen_k: int):
    """Validates a user variant; returns (opts, None) without one, else (opts with pack_gqa
    decided, (spec, kernel tensors, block ranges)). A block mask supplies the mask_mod and
    aux tensors it was built with unless they are given (the mask_mod must then be its own)."""
    if score_mod is None and mask_mod is None and block_mask is None:
        if aux_tensors is not None:
            raise ValueError("aux_tensors is given without a score_mod, mask_mod or block_mask to read it")
        return opts, None
    from flash_attn_cute.host.block_mask import BlockMask

    block_q, ranges, rows = 0, None, False
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
        # Its row bounds replace the mask_mod only over the aux tensors they were computed on.
        own_aux = len(aux_tensors) == len(block_mask.aux_tensors) and all(
            a is b for a, b in zip(aux_tensors, block_mask.aux_tensors))
        rows = block_mask.row_bounds is not None and own_aux
        if block_mask.batch not in (1, batch) or block_mask.nheads not in (1, nheads):
            raise ValueError(f"block_mask was built for batch {block_mask.batch} and nheads {block_mask.nheads}; "
                             f"this call has batch {batch} and nheads {nheads} (1 = broadcast)")
        if block_mask.seqlen_q < max_seqlen_q or block_mask.seqlen_k < max_seqlen_k:
            raise ValueError(f"block_mask covers seqlen_q {block_mask.seqlen_q} and seqlen_k {block_mask.seqlen_k}; "
                             f"this call needs at least {max_seqlen_q} and {max_seqlen_k}")
        if block_mask.ranges.device != device:
            raise ValueError(f"block_mask is on {block_mask.ranges.device}, but q is on {device}")
        # Its entries are per query head: the rows run unpacked (pack_gqa is a performance
        # choice, as FA4 drops it for block sparsity that is not broadcast over heads).
        if opts.pack_gqa:
            log.info("flash_attn_cute: pack_gqa=True with a block_mask runs unpacked (block-mask entries are per "
                     "query head)")
        opts = opts._replace(pack_gqa=False)
        block_q, ranges = block_mask.block_q, block_mask.kernel_ranges(batch, nheads, rows)
    if score_mod is not None and opts.softcap > 0:
        raise ValueError("softcap and score_mod cannot be combined: apply the cap inside score_mod "
                         "(flash_attn_cute.mods.softcap)")
    aux = user_variants.check_aux_tensors(aux_tensors, device)
    spec = user_variants.make_spec(score_mod, mask_mod, aux, block_q, rows)
    return opts, (spec, user_variants.kernel_aux(aux) + (ranges,), ranges)


def cache_bounds(cache_seqlens: torch.Tensor, capacity: int, table, kv_shape, new_tokens: int = 0,
                 batch_idx: Optional[torch.Tensor] = None, leftpad: Optional[torch.Tensor] = None) -> int:
    """Refuse cache lengths outside [0, capacity - new_tokens] (``new_tokens``: an append's),
    referenced pages outside [0, num_pages) (those from a sequence's ``leftpad`` on, where
    given) and ``batch_idx`` entries (``cache_batch_idx``) outside [0, batch_cache =
    kv_shape[0]): all read back in one device-to-host transfer. Returns max(cache_seqlens)
    + new_tokens (a tighter bound than the capacity, used by the split heuristic). Skipped,
    returning the capacity, under CUDA-graph capture."""
    if cache_seqlens.numel() == 0:
        return 0
    if cache_seqlens.is_cuda and torch.cuda.is_current_stream_capturing():
        return capacity
    if new_tokens:
        cache_seqlens = cache_seqlens + new_tokens
    stats = list(torch.aminmax(cache_seqlens))
    paged = table is not None and table.shape[1] > 0
    if paged:
        pages_used = (cache_seqlens.clamp(min=0) + kv_shape[1] - 1) // kv_shape[1]
        page_idx = torch.arange(table.shape[1], device=table.device)[None, :]
        used = page_idx < pages_used[:, None]
        if leftpad is not None:
            used &= page_idx >= (leftpad.clamp(min=0) // kv_shape[1])[:, None]
        stats += [torch.where(used, table, 0).min(), torch.where(used, table, 0).max()]
    if batch_idx is not None:
        stats += list(torch.aminmax(batch_idx))
    values = torch.stack([t.to(torch.int64) for t in stats]).tolist()
    lo, hi = values[:2]
    if lo < new_tokens or hi > capacity:
        what = "max_pages_per_seq * page_size" if table is not None else "max_seqlen_k (k_cache.shape[1])"
        plus = f" + the {new_tokens} new tokens" if new_tokens else ""
        raise ValueError(f"cache_seqlens{plus} must lie in [0, {what} = {capacity}], got values in "
                         f"[{lo - new_tokens}, {hi - new_tokens}]{plus}")
    if paged and (values[2] < 0 or values[3] >= kv_shape[0]):
        raise ValueError(f"page_table entries used by cache_seqlens must lie in [0, num_pages = {kv_shape[0]}), "
                         f"got values in [{values[2]}, {values[3]}]")
    if batch_idx is not None:
        idx_lo, idx_hi = values[-2:]
        if idx_lo < 0 or idx_hi >= kv_shape[0]:
            bad = idx_lo if idx_lo < 0 else idx_hi
            raise ValueError(f"cache_batch_idx entries must lie in [0, batch_cache = {kv_shape[0]}) "
                             f"(k_cache.shape[0]), got {bad} (entries in [{idx_lo}, {idx_hi}])")
    return hi


CP_ARGS = ("cp_world_size", "cp_rank", "cp_tot_seqused_k", "cp_kv_interleave")


def context_parallel(args: dict, batch: int, masked: bool, device, why_not: Optional[str] = None) -> bool:
    """The context-parallel keywords (the FA3 fork's ``cp_world_size``, ``cp_rank``,
    ``cp_tot_seqused_k``; ``cp_kv_interleave``, vLLM's ``cp_kv_cache_interleave_size``):
    this call's keys are rank ``cp_rank``'s shard of each sequence, every ``world``-th
    block of ``interleave`` tokens. Returns the problem's ``cp`` field: whether the kernels
    must map keys to global positions (``masked``: causal or a window, whose limits are
    global); False otherwise (without a mask a shard's attention is plain attention over
    its keys). ``why_not``: the call's feature that
    context parallelism does not combine with (refused when world > 1)."""
    world = int_arg("cp_world_size", args.get("cp_world_size", 1), 1, 1 << 16)
    rank = int_arg("cp_rank", args.get("cp_rank", 0), 0, world - 1)
    interleave = int_arg("cp_kv_interleave", args.get("cp_kv_interleave", 1), 1, INT32_MAX)
    tot = args.get("cp_tot_seqused_k")
    if tot is not None:
        int32_vector("cp_tot_seqused_k", tot, batch, "(batch,)")
        if tot.device != device:
            raise ValueError(f"cp_tot_seqused_k is on {tot.device} but q is on {device}; all tensors must be on "
                             "the same device")
    if world == 1:
        return False
    if why_not is not None:
        raise NotImplementedError(f"context parallelism (cp_world_size = {world}) does not combine with {why_not}")
    if not masked:
        return False
    if tot is None:
        raise ValueError(f"cp_tot_seqused_k (batch,) int32 is required with cp_world_size = {world} and a causal "
                         "mask or a window: the masks are taken on global key positions, and it is each "
                         "sequence's key count over every rank")
    return True
