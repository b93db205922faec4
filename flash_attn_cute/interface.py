"""Public API: FlashAttention forward (inference only, no autograd).

- ``flash_attn_func``          dense batch: q ``(b, s_q, h, d)``, k/v ``(b, s_k, h_kv, d*)``
- ``flash_attn_varlen_func``   the general call (FA3/FA4's): packed or dense queries over
                               packed, dense or paged keys, with per-sequence key counts
                               (``seqused_k``): a serving engine's mixed step is one call
- ``flash_attn_with_kvcache``  decode against a (possibly paged) KV cache, with the new
                               tokens appended in place and rotary embedding applied
- ``flash_attn_combine``       merge split-KV partial results

Semantics: scores are ``softmax_scale * q.k`` (default ``d ** -0.5``), then
``softcap * tanh(s / softcap)`` when ``softcap > 0``. ``causal`` and windows are aligned
to the bottom-right corner: query ``i`` sees key ``j`` when
``i + s_k - s_q - window_left <= j <= i + s_k - s_q + window_right`` (a side of -1 is
unbounded; causal is ``window_right = 0``). ``learnable_sink`` (``(nheads,)``, gpt-oss) is
one extra logit per query head in each softmax denominator, with a zero value column.
``lse`` is the natural-log sum of exp of the (scaled, capped) scores, the sink included;
``-inf`` for a query that sees no key and has no sink (its output is 0).

Every argument is validated (shapes, then dtypes, then scalars, then the device) before
anything is launched; errors name the argument and the expected form. A repeated call
(same shapes, strides, dtypes, device and arguments) skips validation and planning
(``call_cache``).
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple, Optional

import torch

from flash_attn_cute.api import call_cache, checks
from flash_attn_cute.host import heuristics, tuning, user_variants
from flash_attn_cute import seam
from flash_attn_cute.api import ops
from flash_attn_cute.seam.backend_kit import NO_VARIANT
from flash_attn_cute.api.checks import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, normalize_window  # noqa: F401  (public names)
from flash_attn_cute.host.constants import INT32_MAX, MAX_SPLITS
from flash_attn_cute.host.keys import arch_of_capability
from flash_attn_cute.host.problems import FwdProblem, out_dtype

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "flash_attn_combine",
           "SUPPORTED_HEAD_DIMS", "SUPPORTED_DTYPES", "MAX_SPLITS", "BACKENDS"]

BACKENDS = checks.BACKEND_NAMES  # names accepted by ``backend=`` / FLASH_ATTN_CUTE_BACKEND

_Q4 = "(batch, seqlen_q, nheads, headdim)"
_Q3 = "(total_q, nheads, headdim)"


class _Call(NamedTuple):
    """A validated call: the tensors the kernels read and what describes the problem."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: Optional[torch.Tensor]
    opts: checks.Options
    batch: int
    max_seqlen_q: int
    max_seqlen_k: int
    nheads: int
    nheads_kv: int
    d_v: int
    return_lse: bool
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_k: Optional[torch.Tensor] = None
    seqused_q: Optional[torch.Tensor] = None
    seqused_k: Optional[torch.Tensor] = None
    page_table: Optional[torch.Tensor] = None
    learnable_sink: Optional[torch.Tensor] = None
    variant: Optional[tuple] = None  # checks.user_variant's (spec, kernel tensors, block ranges)
    k_descale: Optional[torch.Tensor] = None  # checked (checks.descales); read for FP8 K/V only
    v_descale: Optional[torch.Tensor] = None
    q_descale: Optional[torch.Tensor] = None  # read for FP8 queries only
    # A paged cache's per-sequence key starts (cache_leftpad): (batch,) int32; seqused_k then
    # counts the keys from there (kv_cache_ops)
    leftpad_k: Optional[torch.Tensor] = None


# ---------------------------------------------------------------------------------------
# The shared launch path and the per-call cache replay
# ---------------------------------------------------------------------------------------


def _aux_list(aux_tensors) -> tuple:
    """The aux tensors as extra per-call-key tensors (a non-list value makes the key fail
    to hash or compare, and the full path then validates it)."""
    if aux_tensors is None:
        return ()
    return tuple(aux_tensors) if isinstance(aux_tensors, (list, tuple)) else (aux_tensors,)


def _aux_of(aux_tensors, block_mask):
    return block_mask.aux_tensors if aux_tensors is None and block_mask is not None else aux_tensors


def _no_fp8_under_compile(k, *descales) -> None:
    if k.dtype in checks.FP8_DTYPES or any(t is not None for t in descales):
        raise NotImplementedError("FP8 K/V and q_descale / k_descale / v_descale are not traceable by torch.compile "
                                  "yet: call flash_attn_cute outside the compiled region")


def _no_variant_under_compile(*variant_args) -> None:
    if any(a is not None for a in variant_args):
        raise NotImplementedError("score_mod / mask_mod / aux_tensors / block_mask are not traceable by "
                                  "torch.compile yet: call flash_attn_cute outside the compiled region")


def _launch(entry: call_cache.Entry, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
            page_table, learnable_sink, variant_tensors, k_descale=None, v_descale=None, q_descale=None,
            leftpad_k=None) -> None:
    problem = entry.problem
    # The kernels and the combine read the sink as fp32 (a no-op for an fp32 sink; a
    # 16-bit one costs one small conversion per call, not a compiled variant per dtype).
    sink = None if learnable_sink is None else learnable_sink.float()
    k_descale, v_descale = checks.kernel_descales(problem, k_descale, v_descale, q.device, q_descale)
    rest = (cu_seqlens_q, cu_seqlens_k, seqused_k, page_table, seqused_q, sink, k_descale, v_descale)
    if problem.variant is not None or problem.leftpad_k:
        rest += (variant_tensors,)
    if problem.leftpad_k:
        rest += (leftpad_k,)
    seam.run_resolved(entry.resolved, problem, (q, k, v), out, lse, rest, sink, problem.has_seqused_q)


def _replay(entry: call_cache.Entry, q, k, v, out, return_lse, cu_seqlens_q=None, cu_seqlens_k=None,
            seqused_q=None, seqused_k=None, page_table=None, learnable_sink=None, aux_tensors=None, k_descale=None,
            v_descale=None, q_descale=None):
    if out is None:
        out = q.new_empty(entry.out_shape, dtype=entry.problem.out_dtype)
    lse = q.new_empty(entry.lse_shape, dtype=torch.float32) if return_lse else None
    if entry.seqlens_fill is not None:
        seqused_k = torch.full((entry.problem.batch,), entry.seqlens_fill, dtype=torch.int32, device=q.device)
    variant_tensors = NO_VARIANT
    if entry.problem.variant is not None:
        variant_tensors = user_variants.kernel_aux(aux_tensors or ()) + (entry.block_ranges,)
    _launch(entry, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table, learnable_sink,
            variant_tensors, k_descale, v_descale, q_descale)
    return (out, lse) if return_lse else out


def clear_call_cache() -> None:
    """Forget every cached call and every resolved plan (``call_cache.clear``)."""
    call_cache.clear()


def _empty_result(out, lse, learnable_sink, varlen_q: bool):
    """Every query sees no key: out 0; lse the sink (the only logit left), else -inf."""
    out.zero_()
    if lse is not None:
        if learnable_sink is None:
            lse.fill_(-math.inf)
        else:
            sink = learnable_sink.float()
            lse.copy_(sink[:, None] if varlen_q else sink[None, :, None])


def _run(call: _Call, fast_key=None, seqlens_fill=None):
    """``_execute`` the call; its entry answers later calls with ``fast_key``."""
    result, entry = _execute(call, seqlens_fill)
    if entry is not None:
        call_cache.store(fast_key, entry)
    return result


def _execute(call: _Call, seqlens_fill=None, prologue=None) -> tuple:
    """(result, per-call cache entry or None): allocate outputs, describe the call as a
    ``FwdProblem`` and run it through the dispatch seam (``seam.resolve`` and
    ``seam.run_resolved``: backend, plan, launch, combine). ``max_seqlen_k == 0`` (or an
    empty batch) means every query sees no key: no launch, no entry. ``prologue()``, if
    given, runs once the call is planned, before its launch (or its empty result):
    ``kv_cache_ops``' append, so that a call no kernel runs leaves the cache untouched."""
    q, k, v, out = call.q, call.k, call.v, call.out
    varlen_q = call.cu_seqlens_q is not None
    lse_shape = (call.nheads, q.shape[0]) if varlen_q else (call.batch, call.nheads, q.shape[1])
    if out is None:
        out = q.new_empty(*q.shape[:-1], call.d_v, dtype=out_dtype(q.dtype))
    lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device) if call.return_lse else None
    if out.numel() == 0 or call.batch == 0 or call.max_seqlen_q == 0 or call.max_seqlen_k == 0:
        if prologue is not None:
            prologue()
        _empty_result(out, lse, call.learnable_sink, varlen_q)
        return ((out, lse) if call.return_lse else out), None
    opts = call.opts
    spec, variant_tensors, block_ranges = (None, NO_VARIANT, None) if call.variant is None else call.variant
    problem = FwdProblem(
        dtype=q.dtype, batch=call.batch, max_seqlen_q=call.max_seqlen_q, max_seqlen_k=call.max_seqlen_k,
        nheads=call.nheads, nheads_kv=call.nheads_kv, d=q.shape[-1], d_v=call.d_v, softmax_scale=opts.softmax_scale,
        causal=opts.causal, window_left=opts.window_left, window_right=opts.window_right, softcap=opts.softcap,
        varlen_q=varlen_q, varlen_k=call.cu_seqlens_k is not None, has_seqused_k=call.seqused_k is not None,
        page_size=k.shape[1] if call.page_table is not None else 0, has_lse=call.return_lse, variant=spec,
        has_seqused_q=call.seqused_q is not None, has_sink=call.learnable_sink is not None,
        batch_invariant=opts.batch_invariant,
        kv_dtype=k.dtype if k.dtype in checks.FP8_DTYPES and q.dtype not in checks.FP8_DTYPES else None,
        leftpad_k=call.leftpad_k is not None)
    resolved = seam.resolve(problem, opts.backend, opts.num_splits, opts.pack_gqa, q.device, tuning.from_env())
    entry = call_cache.Entry(problem, resolved, tuple(out.shape), lse_shape, seqlens_fill, block_ranges)
    if prologue is not None:
        prologue()
    _launch(entry, q, k, v, out, lse, call.cu_seqlens_q, call.cu_seqlens_k, call.seqused_q, call.seqused_k,
            call.page_table, call.learnable_sink, variant_tensors, call.k_descale, call.v_descale, call.q_descale,
            call.leftpad_k)
    return ((out, lse) if call.return_lse else out), entry


# ---------------------------------------------------------------------------------------
# Public entry points
# ---------------------------------------------------------------------------------------


def flash_attn_func(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), learnable_sink=None,
                    s_aux=None, sinks=None, softcap=0.0, num_splits=1, pack_gqa=None, return_lse=False, out=None,
                    backend=None, batch_invariant=False, score_mod=None, mask_mod=None, aux_tensors=None,
                    block_mask=None, q_descale=None, k_descale=None, v_descale=None):
    """Attention over a dense batch.

    q ``(batch, seqlen_q, nheads, d)``, k ``(batch, seqlen_k, nheads_kv, d)``, v
    ``(batch, seqlen_k, nheads_kv, d_v)``; fp16 or bf16, last dim contiguous (other strides
    free). ``nheads`` a multiple of ``nheads_kv`` (GQA/MQA). ``num_splits``: 1 = no split-KV,
    0 = heuristic, n = n splits (<= 256). ``pack_gqa``: None = heuristic. Returns out
    ``(batch, seqlen_q, nheads, d_v)`` in q's dtype, or ``(out, lse)`` with lse
    ``(batch, nheads, seqlen_q)`` fp32 when ``return_lse``. ``out`` may be preallocated.
    ``learnable_sink``, ``batch_invariant``, FP8 K/V (``k_descale``, ``v_descale``) and FP8
    attention (e4m3 q, k, v with ``q_descale``; bf16 out): see ``flash_attn_varlen_func``.

    User variants (``user_variants.py``, examples in ``mods.py``): ``score_mod(score, b, h,
    q_idx, kv_idx, aux)`` rewrites each scaled score, ``mask_mod(b, h, q_idx, kv_idx, aux)``
    keeps a score where True (ANDed with causal / window_size), ``aux_tensors`` (<= 4
    tensors) is their ``aux``, ``block_mask`` (``create_block_mask``) lets the kernel skip
    empty blocks and the predicate on full ones. ``s_aux`` (vLLM) and ``sinks`` (SGLang)
    are aliases of ``learnable_sink``."""
    learnable_sink = _sink(learnable_sink, s_aux, sinks)
    if torch.compiler.is_compiling():
        _no_variant_under_compile(score_mod, mask_mod, aux_tensors, block_mask)
        _no_fp8_under_compile(k, q_descale, k_descale, v_descale)
        return ops.traced_call("func", q, k, v, out, learnable_sink=learnable_sink, max_seqlen_q=q.shape[1],
                               softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                               num_splits=num_splits, pack_gqa=pack_gqa, return_lse=return_lse, backend=backend,
                               batch_invariant=batch_invariant)
    hit, key = call_cache.lookup(call_cache.key(
        "func", (q, k, v, out, learnable_sink, q_descale, k_descale, v_descale, *_aux_list(aux_tensors)),
        (softmax_scale, causal, softcap, num_splits, pack_gqa, return_lse, backend, batch_invariant, score_mod,
         mask_mod, block_mask), window_size))
    if hit is not None:
        return _replay(hit, q, k, v, out, return_lse, learnable_sink=learnable_sink,
                       aux_tensors=_aux_of(aux_tensors, block_mask),
                       k_descale=k_descale, v_descale=v_descale, q_descale=q_descale)
    inputs = (q, k, v, out)
    checks.check_tensor("q", q, 4, _Q4)
    nheads, nheads_kv, d, d_v, q, k, v = checks.qkv(
        q, k, v, _Q4, 4, "(batch, seqlen_k, nheads_kv, headdim)", "(batch, seqlen_k, nheads_kv, headdim_v)")
    batch, seqlen_q = q.shape[:2]
    if k.shape[0] != batch:
        raise ValueError(f"k and v must have the batch size of q ({batch}), got {k.shape[0]}")
    checks.learnable_sink(learnable_sink, nheads)
    checks.descales(k, q_descale, k_descale, v_descale, batch, nheads_kv)
    opts = checks.options(d, softmax_scale, causal, window_size, softcap, num_splits, pack_gqa, backend,
                          batch_invariant)
    out = checks.check_out(out, (batch, seqlen_q, nheads, d_v), out_dtype(q.dtype),
                           "(batch, seqlen_q, nheads, headdim_v)")
    checks.check_device({"q": q, "k": k, "v": v, "learnable_sink": learnable_sink, "q_descale": q_descale,
                         "k_descale": k_descale, "v_descale": v_descale, "out": out})
    opts, variant = checks.user_variant(score_mod, mask_mod, aux_tensors, block_mask, opts, q.device, batch=batch,
                                        nheads=nheads, max_seqlen_q=seqlen_q, max_seqlen_k=k.shape[1])
    call = _Call(q, k, v, out, opts, batch, seqlen_q, k.shape[1], nheads, nheads_kv, d_v, bool(return_lse),
                 learnable_sink=learnable_sink, variant=variant,
                 k_descale=k_descale, v_descale=v_descale, q_descale=q_descale)
    return _run(call, call_cache.same(key, inputs, (q, k, v, out)))


def _sink(learnable_sink, s_aux, sinks):
    """``learnable_sink`` or one of its aliases: vLLM's ``s_aux``, SGLang's ``sinks``."""
    return _alias("learnable_sink", _alias("learnable_sink", learnable_sink, "s_aux", s_aux), "sinks", sinks)


def _alias(name: str, value, alias: str, alias_value):
    """``value`` or its vLLM-style alias (never both)."""
    if alias_value is None:
        return value
    if value is not None:
        raise ValueError(f"{name} and {alias} name the same argument: give one of them")
    return alias_value


def flash_attn_varlen_func(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, *,
                           seqused_q=None, seqused_k=None, page_table=None, block_table=None, softmax_scale=None,
                           causal=False, window_size=(-1, -1), learnable_sink=None, s_aux=None, sinks=None,
                           softcap=0.0,
                           num_splits=1, pack_gqa=None, return_lse=False, out=None, backend=None,
                           batch_invariant=False, score_mod=None, mask_mod=None, aux_tensors=None, block_mask=None,
                           q_descale=None, k_descale=None, v_descale=None):
    """Attention over variable-length sequences: the general call (FA3/FA4 names and semantics).

    Queries: packed ``(total_q, nheads, d)`` with ``cu_seqlens_q`` ``(batch + 1,)`` int32
    (sequence ``b`` is rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``), or dense
    ``(batch, seqlen_q, nheads, d)`` without it. Keys and values, one of:

    - packed ``(total_k, nheads_kv, d*)`` with ``cu_seqlens_k`` ``(batch + 1,)``;
    - dense ``(batch, seqlen_k, nheads_kv, d*)`` (a batch KV cache);
    - paged ``(num_pages, page_size, nheads_kv, d*)`` with ``page_table`` ``(batch,
      max_pages_per_seq)`` int32 (vLLM's ``block_table``), any ``page_size >= 1``;
      ``cu_seqlens_k`` is None and ``seqused_k`` required.

    ``seqused_k`` ``(batch,)`` int32: each sequence's key count (its first keys; with packed
    keys, starting at ``cu_seqlens_k[b]``). ``seqused_q`` ``(batch,)``: each sequence's
    query count (rows past it are not written). Each sequence's queries are the last
    positions of its keys for causal and windows (bottom-right). ``max_seqlen_q`` /
    ``max_seqlen_k`` bound the lengths for the grid and the split heuristic (None: the
    tensors' bounds; the host never reads the device). Cumulative lengths are not checked
    on the host (a device sync); lengths past a cache's capacity and page ids outside the
    pool are clamped in the kernels: wrong results, never an illegal access.

    ``learnable_sink`` (vLLM's ``s_aux``, SGLang's ``sinks``) ``(nheads,)`` fp32/bf16/fp16:
    one logit per query head added to every softmax denominator with a zero value
    (gpt-oss); the LSE includes it; exact under split-KV (the combine adds it once). ``batch_invariant=True``: a
    sequence's output and LSE are bitwise the same whatever else is in the batch (a fixed
    number of keys per KV split and batch-independent tiles; ``num_splits`` is then
    ignored). Returns out ``(total_q, nheads, d_v)`` (dense: ``(batch, seqlen_q, nheads,
    d_v)``), and lse ``(nheads, total_q)`` (dense: ``(batch, nheads, seqlen_q)``) when
    ``return_lse``. User variants as in ``flash_attn_func`` (``q_idx`` / ``kv_idx`` are
    positions inside each sequence; ``b`` its index).

    FP8 K/V (an e4m3 or e5m2 cache, fp16/bf16 queries; FA3's arguments): ``k_descale`` /
    ``v_descale`` fp32 ``(batch, nheads_kv)`` or one element (default 1.0), the real keys
    and values being the stored ones times their descale; the kernel widens each block in
    shared memory (exact) and applies the descales to the scores and the output. Runs on
    the SM80 kernel (any GPU of compute capability >= 8.9; Hopper picks it automatically).
    For 16-bit K/V the descales are checked and ignored, as in FA3.

    FP8 attention (Hopper, the SM90 kernel; SM100 compiled): q, k and v all ``float8_e4m3fn`` with
    ``q_descale`` / ``k_descale`` / ``v_descale`` (fp32 ``(batch, nheads_kv)`` or one
    element, default 1.0); the output is bf16. Both GEMMs run in fp8 (P rounded to e4m3);
    paged keys need pages of a multiple of 64 tokens."""
    page_table = _alias("page_table", page_table, "block_table", block_table)
    learnable_sink = _sink(learnable_sink, s_aux, sinks)
    if torch.compiler.is_compiling():
        _no_variant_under_compile(score_mod, mask_mod, aux_tensors, block_mask)
        _no_fp8_under_compile(k, q_descale, k_descale, v_descale)
        return ops.traced_call("varlen", q, k, v, out, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                               seqused_q=seqused_q, seqused_k=seqused_k, page_table=page_table,
                               learnable_sink=learnable_sink, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                               softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                               num_splits=num_splits, pack_gqa=pack_gqa, return_lse=return_lse, backend=backend,
                               batch_invariant=batch_invariant)
    hit, key = call_cache.lookup(call_cache.key(
        "varlen", (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table, learnable_sink, out,
                   q_descale, k_descale, v_descale, *_aux_list(aux_tensors)),
        (max_seqlen_q, max_seqlen_k, softmax_scale, causal, softcap, num_splits, pack_gqa, return_lse, backend,
         batch_invariant, score_mod, mask_mod, block_mask), window_size))
    if hit is not None:
        return _replay(hit, q, k, v, out, return_lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                       seqused_q=seqused_q, seqused_k=seqused_k, page_table=page_table, learnable_sink=learnable_sink,
                       aux_tensors=_aux_of(aux_tensors, block_mask),
                       k_descale=k_descale, v_descale=v_descale, q_descale=q_descale)
    inputs = (q, k, v, out)
    call = _varlen_call(q, k, v, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                        page_table, learnable_sink, return_lse,
                        (softmax_scale, causal, window_size, softcap, num_splits, pack_gqa, backend, batch_invariant),
                        (score_mod, mask_mod, aux_tensors, block_mask), (q_descale, k_descale, v_descale))
    return _run(call, call_cache.same(key, inputs, (call.q, call.k, call.v, call.out)))


def _varlen_call(q, k, v, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                 page_table, learnable_sink, return_lse, option_args: tuple, variant_args: tuple,
                 descale_args: tuple = (None, None, None)) -> _Call:
    """Validates ``flash_attn_varlen_func``'s (and the packed ``flash_attn_with_kvcache``'s)
    arguments: shapes, then dtypes, then scalars, then the device."""
    varlen_q = cu_seqlens_q is not None
    if not isinstance(q, torch.Tensor):
        checks.check_tensor("q", q, 3, _Q3)
    if varlen_q and q.dim() != 3:
        raise ValueError(f"q must have shape {_Q3} with cu_seqlens_q (rank 3), got shape {tuple(q.shape)}")
    if not varlen_q and q.dim() != 4:
        raise ValueError(f"q must have shape {_Q4} without cu_seqlens_q, or {_Q3} with it; got shape {tuple(q.shape)}")
    paged, varlen_k = page_table is not None, cu_seqlens_k is not None
    if paged and varlen_k:
        raise ValueError("page_table and cu_seqlens_k cannot be combined: with a page table the caches are "
                         "(num_pages, page_size, nheads_kv, headdim) and seqused_k gives each sequence's key count")
    if paged and seqused_k is None:
        raise ValueError("page_table needs seqused_k (batch,) int32: each sequence's key count")
    kv_form = ("(num_pages, page_size, nheads_kv, {})" if paged else "(total_k, nheads_kv, {})" if varlen_k
               else "(batch, seqlen_k, nheads_kv, {})")
    nheads, nheads_kv, d, d_v, q, k, v = checks.qkv(q, k, v, _Q3 if varlen_q else _Q4, 3 if varlen_k else 4,
                                                    kv_form.format("headdim"), kv_form.format("headdim_v"))
    batch = checks.packed_queries(q, cu_seqlens_q, None)[0] if varlen_q else q.shape[0]
    if varlen_k:
        checks.int32_vector("cu_seqlens_k", cu_seqlens_k, batch + 1, "(batch + 1,) like cu_seqlens_q")
        capacity = k.shape[0]
    else:
        capacity = checks.cache_capacity(k, batch, page_table, "k and v", why=" (the batch of q)")
    for name, t in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        if t is not None:
            checks.int32_vector(name, t, batch, "(batch,)")
    checks.learnable_sink(learnable_sink, nheads)
    checks.descales(k, *descale_args, batch, nheads_kv)
    if max_seqlen_q is None:
        max_seqlen_q = q.shape[0] if varlen_q else q.shape[1]
    max_seqlen_q = checks.int_arg("max_seqlen_q", max_seqlen_q, 0, INT32_MAX)
    if not varlen_q:
        max_seqlen_q = q.shape[1]  # the grid covers the dense queries' mode
    max_seqlen_k = capacity if max_seqlen_k is None else checks.int_arg("max_seqlen_k", max_seqlen_k, 0, INT32_MAX)
    if not varlen_k:
        max_seqlen_k = min(max_seqlen_k, capacity)
    opts = checks.options(d, *option_args)
    out = checks.check_out(out, (*q.shape[:-1], d_v), out_dtype(q.dtype),
                           "(total_q, nheads, headdim_v)" if varlen_q else "(batch, seqlen_q, nheads, headdim_v)")
    checks.check_device({"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k,
                         "seqused_q": seqused_q, "seqused_k": seqused_k, "page_table": page_table,
                         "learnable_sink": learnable_sink, "q_descale": descale_args[0], "k_descale": descale_args[1],
                         "v_descale": descale_args[2], "out": out})
    # A block mask covers every key a sequence may have: the cache's capacity, or for packed
    # keys the caller's bound (the total key count when none is given).
    opts, variant = checks.user_variant(*variant_args, opts, q.device, batch=batch, nheads=nheads,
                                        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k if varlen_k else capacity)
    if varlen_k and k.shape[0] == 0:
        max_seqlen_k = 0
    return _Call(q, k, v, out, opts, batch, max_seqlen_q, max_seqlen_k, nheads, nheads_kv, d_v, bool(return_lse),
                 cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table, learnable_sink, variant,
                 descale_args[1], descale_args[2], descale_args[0])


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, *, page_table=None,
                            block_table=None, cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None,
                            softmax_scale=None, causal=False,
                            window_size=(-1, -1), learnable_sink=None, s_aux=None, sinks=None, softcap=0.0,
                            rotary_interleaved=True,
                            num_splits=0, pack_gqa=None, return_lse=False, return_softmax_lse=False, out=None,
                            backend=None, check_cache_bounds=False, batch_invariant=False, score_mod=None,
                            mask_mod=None, aux_tensors=None, block_mask=None, q_descale=None, k_descale=None,
                            v_descale=None):
    """Attention of new queries against a KV cache (decode, speculative decode, chunked
    prefill), FA2/FA3's call: optionally appends new keys and values to the cache and
    applies rotary embedding, then attends.

    q ``(batch, seqlen_q, nheads, d)``, or packed ``(total_q, nheads, d)`` with
    ``cu_seqlens_q`` / ``max_seqlen_q`` (SGLang's form). Without ``page_table`` the caches
    are ``(batch_cache, max_seqlen_k, nheads_kv, d*)``; with it (vLLM's ``block_table``)
    ``(num_pages, page_size, nheads_kv, d*)`` (any ``page_size >= 1``) and ``page_table``
    ``(batch, max_pages_per_seq)`` int32 lists each sequence's pages. ``cache_seqlens``
    ``(batch,)`` int32 (or an int for all; None: the whole capacity) is the number of
    tokens in the cache; the queries are the last positions of the keys for
    causal/windows. (The form ``flash_attn_with_kvcache(q, k_cache, v_cache,
    cache_seqlens)`` of earlier releases is still accepted: a lengths tensor or int in
    ``k``'s place is taken as ``cache_seqlens``.)

    Append: ``k`` ``(batch, seqlen_new, nheads_kv, d)`` and ``v`` ``(batch, seqlen_new,
    nheads_kv, d_v)`` (with packed queries: ``(total_new, nheads_kv, d*)`` with
    ``cu_seqlens_k_new``, FA3's name, default ``cu_seqlens_q``: the new tokens are the query
    tokens, a serving engine's mixed step) are written into the cache at positions
    ``cache_seqlens[b] .. + seqlen_new`` (in place; the attention then covers
    ``cache_seqlens + seqlen_new`` keys; the caller advances ``cache_seqlens`` itself).
    ``rotary_cos`` / ``rotary_sin`` ``(seqlen_ro, rotary_dim / 2)`` in q's dtype, ``seqlen_ro`` covering every cache
    position: rotary embedding (``rotary_interleaved``: GPT-J pairs, else GPT-NeoX halves)
    of the first ``rotary_dim`` channels of the new k at its positions and of q (at
    ``cache_seqlens + i`` for causal/local, else at ``cache_seqlens``; q itself is left
    unchanged). ``cache_batch_idx`` ``(batch,)`` int32: cache row of each batch row
    (contiguous caches only, as in FA2); ``cache_leftpad`` ``(batch,)`` int32: the sequence
    starts at that cache position (FA3's ``leftpad_k``, contiguous or paged): its keys are
    cache positions ``[cache_leftpad[b], cache_seqlens[b] + seqlen_new)``, causal / windows
    aligned to the bottom-right of those, new tokens still written at ``cache_seqlens[b] +
    t`` and rotated at that absolute position. Append and rotary are one CuTe-DSL kernel
    (``kv_append.py``) launched before the attention; no host sync.

    FP8 caches (e4m3 / e5m2, ``k_descale`` / ``v_descale`` fp32 ``(batch, nheads_kv)`` or one
    element, None = 1): new tokens in q's 16-bit dtype are rotated in fp32 and stored as
    ``fp8(x / descale[b, h_kv])`` (round to nearest even, saturating at the format's largest
    finite value: 448 for e4m3, 57344 for e5m2); new tokens already in the cache's dtype are
    copied as they are, or (k with rotary) dequantized, rotated and requantized. With e4m3
    q (FP8 attention) q is rotated the same way with ``q_descale`` (its rotary tables and
    16-bit new tokens in fp16 or bf16). The attention then reads the cache with the descales.

    Safety: the kernels never read or write outside the cache, without any host-side check:
    lengths are clamped to the capacity (``max_seqlen_k``, or ``max_pages_per_seq *
    page_size``), page ids into ``[0, num_pages)``, ``cache_batch_idx`` entries into ``[0,
    batch_cache)`` (a bad entry writes and reads the rows of the clamped cache row, another
    sequence's), ``cache_leftpad`` into ``[0, length]``, so an out-of-range value gives
    wrong results, never an illegal access. The default path never synchronises with the
    device, so it can be captured in a CUDA graph (the split heuristic then plans for the
    capacity). ``check_cache_bounds=True`` (a debugging aid) reads ``cache_seqlens``,
    ``cache_batch_idx`` and the referenced page-table entries back to the host (one read),
    raises ValueError on any value out of range, and plans for the true maximum length:
    one device-to-host sync per call, skipped under CUDA-graph capture.

    ``learnable_sink`` (aliases ``s_aux``, ``sinks``), ``batch_invariant``, FP8 caches and
    FP8 attention: as in ``flash_attn_varlen_func``;
    ``return_softmax_lse`` is FA2/FA3's name for ``return_lse``. User variants as in
    ``flash_attn_func``: ``q_idx`` counts the new queries from 0 and ``kv_idx`` the cache
    positions."""
    page_table = _alias("page_table", page_table, "block_table", block_table)
    learnable_sink = _sink(learnable_sink, s_aux, sinks)
    return_lse = bool(return_lse or return_softmax_lse)
    if cache_seqlens is None and v is None and (isinstance(k, numbers.Integral) or (
            isinstance(k, torch.Tensor) and k.dim() == 1 and k.dtype == torch.int32)):
        k, cache_seqlens = None, k  # flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens)
    appends = k is not None or v is not None or rotary_cos is not None or rotary_sin is not None
    remaps = cache_batch_idx is not None or cache_leftpad is not None
    if torch.compiler.is_compiling():
        _no_variant_under_compile(score_mod, mask_mod, aux_tensors, block_mask)
        _no_fp8_under_compile(k_cache, q_descale, k_descale, v_descale)
        if appends or remaps:
            raise NotImplementedError("flash_attn_with_kvcache with k/v, rotary, cache_batch_idx or cache_leftpad "
                                      "is not traceable by torch.compile yet: call it outside the compiled region")
        return ops.traced_call("kvcache", q, k_cache, v_cache, out, cu_seqlens_q=cu_seqlens_q,
                               cache_seqlens=cache_seqlens, page_table=page_table, learnable_sink=learnable_sink,
                               max_seqlen_q=max_seqlen_q if cu_seqlens_q is not None else q.shape[1],
                               softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                               num_splits=num_splits, pack_gqa=pack_gqa, return_lse=return_lse, backend=backend,
                               batch_invariant=batch_invariant)
    option_args = (softmax_scale, causal, window_size, softcap, num_splits, pack_gqa, backend, batch_invariant)
    variant_args = (score_mod, mask_mod, aux_tensors, block_mask)
    if k is None:
        cu_seqlens_k_new = None  # it describes the new tokens only (FA3, SGLang pass it regardless)
    if appends or remaps:
        from flash_attn_cute.api import kv_cache_ops

        return kv_cache_ops.append_and_attend(
            q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            page_table, cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q, learnable_sink, bool(rotary_interleaved),
            return_lse, out, check_cache_bounds, option_args, variant_args, (q_descale, k_descale, v_descale))
    key = None
    if not check_cache_bounds:
        int_seqlens = cache_seqlens if not isinstance(cache_seqlens, torch.Tensor) else None
        hit, key = call_cache.lookup(call_cache.key(
            "kvcache", (q, k_cache, v_cache, None if int_seqlens is not None else cache_seqlens, page_table,
                        cu_seqlens_q, learnable_sink, out, q_descale, k_descale, v_descale, *_aux_list(aux_tensors)),
            (int_seqlens, max_seqlen_q, softmax_scale, causal, softcap, num_splits, pack_gqa, return_lse, backend,
             batch_invariant, score_mod, mask_mod, block_mask), window_size))
        if hit is not None:
            return _replay(hit, q, k_cache, v_cache, out, return_lse, cu_seqlens_q=cu_seqlens_q,
                           seqused_k=cache_seqlens, page_table=page_table, learnable_sink=learnable_sink,
                           aux_tensors=_aux_of(aux_tensors, block_mask),
                           k_descale=k_descale, v_descale=v_descale, q_descale=q_descale)
    inputs = (q, k_cache, v_cache, out)
    call, seqlens_fill = _kvcache_call(q, k_cache, v_cache, cache_seqlens, page_table, cu_seqlens_q, max_seqlen_q,
                                       learnable_sink, return_lse, out, check_cache_bounds, option_args, variant_args,
                                       descale_args=(q_descale, k_descale, v_descale))
    return _run(call, call_cache.same(key, inputs, (call.q, call.k, call.v, call.out)), seqlens_fill)


def _kvcache_call(q, k_cache, v_cache, cache_seqlens, page_table, cu_seqlens_q, max_seqlen_q, learnable_sink,
                  return_lse, out, check_cache_bounds, option_args, variant_args, min_tokens: int = 0,
                  descale_args: tuple = (None, None, None)) -> tuple:
    """(validated call, int cache_seqlens or None) of ``flash_attn_with_kvcache`` without an
    append: the keys are the cache's first ``cache_seqlens`` tokens. ``min_tokens`` (an
    append's new tokens) is added to what the cache must hold."""
    varlen_q = cu_seqlens_q is not None
    nheads, nheads_kv, d, d_v, q, k_cache, v_cache, batch, seqlen_q = checks.queries_and_cache(
        q, k_cache, v_cache, cu_seqlens_q, max_seqlen_q, page_table, "batch")
    capacity = checks.cache_capacity(k_cache, batch, page_table, "k_cache and v_cache")
    cache_seqlens, seqlens_fill = checks.cache_lengths(cache_seqlens, batch, capacity, min_tokens, q.device)
    max_seqlen_k = seqlens_fill
    checks.learnable_sink(learnable_sink, nheads)
    checks.descales(k_cache, *descale_args, batch, nheads_kv)
    opts = checks.options(d, *option_args)
    out = checks.check_out(out, (*q.shape[:-1], d_v), out_dtype(q.dtype),
                           "(total_q, nheads, headdim_v)" if varlen_q else "(batch, seqlen_q, nheads, headdim_v)")
    checks.check_device({"q": q, "k_cache": k_cache, "v_cache": v_cache, "cache_seqlens": cache_seqlens,
                         "page_table": page_table, "cu_seqlens_q": cu_seqlens_q, "learnable_sink": learnable_sink,
                         "q_descale": descale_args[0], "k_descale": descale_args[1], "v_descale": descale_args[2],
                         "out": out})
    if max_seqlen_k is None:  # lengths live on the device
        if check_cache_bounds:  # opt-in: one device -> host read
            max_seqlen_k = checks.cache_bounds(cache_seqlens, capacity, page_table, k_cache.shape, min_tokens)
        else:
            max_seqlen_k = capacity
    opts, variant = checks.user_variant(*variant_args, opts, q.device, batch=batch, nheads=nheads,
                                        max_seqlen_q=seqlen_q, max_seqlen_k=capacity)
    call = _Call(q, k_cache, v_cache, out, opts, batch, seqlen_q, max_seqlen_k, nheads, nheads_kv, d_v,
                 bool(return_lse), cu_seqlens_q=cu_seqlens_q, seqused_k=cache_seqlens, page_table=page_table,
                 learnable_sink=learnable_sink, variant=variant, k_descale=descale_args[1], v_descale=descale_args[2],
                 q_descale=descale_args[0])
    return call, seqlens_fill


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
        seam.combine_launcher(out.dtype, d_v, lse is not None, split_groups=heuristics.combine_split_groups(ns),
                             arch=arch_of_capability(torch.cuda.get_device_capability(out.device)))(
            out_partial, lse_partial, out, lse, None)
    return (out, lse) if return_lse else out
