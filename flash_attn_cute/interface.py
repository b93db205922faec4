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
(``api.call_cache``). Each entry point is a spec of the one run path under every public
call (``api.entry.run``; the specs: ``api.forward``, ``api.kv_cache_ops``); its arguments
are described once, in ``api.call_args``.
"""

from __future__ import annotations

import torch

from flash_attn_cute import seam
from flash_attn_cute.api import call_cache, checks, forward, kv_cache_ops, ops  # noqa: F401 (ops: the custom op)
from flash_attn_cute.api.call_args import fold_aliases
from flash_attn_cute.api.checks import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, normalize_window  # noqa: F401 (public)
from flash_attn_cute.api.entry import run
from flash_attn_cute.host import heuristics
from flash_attn_cute.host.constants import MAX_SPLITS
from flash_attn_cute.host.keys import arch_of_capability

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "flash_attn_combine",
           "SUPPORTED_HEAD_DIMS", "SUPPORTED_DTYPES", "MAX_SPLITS", "BACKENDS"]

BACKENDS = checks.BACKEND_NAMES  # names accepted by ``backend=`` / FLASH_ATTN_CUTE_BACKEND


def clear_call_cache() -> None:
    """Forget every cached call and every resolved plan (``call_cache.clear``)."""
    call_cache.clear()


def flash_attn_func(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), learnable_sink=None,
                    s_aux=None, sinks=None, softcap=0.0, num_splits=1, pack_gqa=None, return_lse=False, out=None,
                    backend=None, batch_invariant=False, score_mod=None, mask_mod=None, aux_tensors=None,
                    block_mask=None, q_descale=None, k_descale=None, v_descale=None, fp8_two_level_interval=0,
                    cp_world_size=1, cp_rank=0, cp_tot_seqused_k=None, cp_kv_interleave=1, sm_margin=0,
                    deterministic=False, return_attn_probs=False, qv=None, attention_chunk=0):
    """Attention over a dense batch.

    q ``(batch, seqlen_q, nheads, d)``, k ``(batch, seqlen_k, nheads_kv, d)``, v
    ``(batch, seqlen_k, nheads_kv, d_v)``; fp16 or bf16, last dim contiguous (other strides
    free). ``nheads`` a multiple of ``nheads_kv`` (GQA/MQA). ``num_splits``: 1 = no split-KV,
    0 = heuristic, n = n splits (<= 256). ``pack_gqa``: None = heuristic. Returns out
    ``(batch, seqlen_q, nheads, d_v)`` in q's dtype, or ``(out, lse)`` with lse
    ``(batch, nheads, seqlen_q)`` fp32 when ``return_lse``. ``out`` may be preallocated.
    ``learnable_sink``, ``batch_invariant``, FP8 K/V (``k_descale``, ``v_descale``), FP8
    attention (e4m3 q, k, v with ``q_descale``; bf16 out) and ``fp8_two_level_interval``: see
    ``flash_attn_varlen_func``.

    User variants (``user_variants.py``, examples in ``mods.py``): ``score_mod(score, b, h,
    q_idx, kv_idx, aux)`` rewrites each scaled score, ``mask_mod(b, h, q_idx, kv_idx, aux)``
    keeps a score where True (ANDed with causal / window_size), ``aux_tensors`` (<= 4
    tensors) is their ``aux``, ``block_mask`` (``create_block_mask``) lets the kernel skip
    empty blocks and the predicate on full ones. ``s_aux`` (vLLM) and ``sinks`` (SGLang)
    are aliases of ``learnable_sink``. Context parallelism (``cp_*``) and FA3's keywords
    (``sm_margin``, ``deterministic``, ``return_attn_probs``, ``qv``, ``attention_chunk``):
    as in ``flash_attn_varlen_func``."""
    return run(forward.FUNC, locals())


def flash_attn_varlen_func(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, *,
                           seqused_q=None, seqused_k=None, page_table=None, block_table=None, softmax_scale=None,
                           causal=False, window_size=(-1, -1), learnable_sink=None, s_aux=None, sinks=None,
                           softcap=0.0,
                           num_splits=1, pack_gqa=None, return_lse=False, out=None, backend=None,
                           batch_invariant=False, score_mod=None, mask_mod=None, aux_tensors=None, block_mask=None,
                           q_descale=None, k_descale=None, v_descale=None, fp8_two_level_interval=0,
                           cp_world_size=1, cp_rank=0, cp_tot_seqused_k=None, cp_kv_interleave=1, sm_margin=0,
                           deterministic=False, return_attn_probs=False, qv=None, attention_chunk=0):
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
    paged keys need pages of a multiple of 64 tokens.

    ``fp8_two_level_interval`` (FlashInfer's name and meaning; an int >= 0, default 0: off):
    where the SM90 kernel computes P V in fp8 wgmma (FP8 attention, and 16-bit queries over
    an e4m3 cache, which it quantizes), the wgmma accumulates n KV blocks into a working O
    that is then added into a separate fp32 accumulator, as FA3's vLLM fork does for 128k
    contexts. Hopper's fp8 tensor cores add into their accumulator with about 14 bits, so
    without it, once O is large, the late blocks of a long context lose their low bits (1:
    every block, the most accurate; 4: FlashInfer's recommendation). It costs registers:
    prefill tiles may take fewer rows or keys, FP8 q, k, v with ``headdim_v`` > 192 is
    refused (NotImplementedError), and 16-bit queries over an e4m3 cache with ``headdim_v``
    > 192 take the widening kernel (16-bit MMAs). Every other kernel (16-bit attention,
    widened FP8 caches, SM80, SM100) ignores it, as FA3's fork and FlashInfer do, so it may
    be passed on every call.

    Context parallelism (the FA3 fork's keywords, vLLM's decode context parallelism;
    ``flash_attn_cute.distributed`` merges the ranks): the keys are rank ``cp_rank``'s
    shard of each sequence, the cache holding every ``cp_world_size``-th block of
    ``cp_kv_interleave`` tokens (1: round-robin by token, local key ``j`` being global
    position ``j * cp_world_size + cp_rank``); ``cp_tot_seqused_k`` ``(batch,)`` int32 is
    each sequence's key count over every rank, required with causal or a window (their
    limits are taken on global positions, the queries being the last of the global keys).
    A rank that holds no key of a sequence returns out 0 and lse -inf. Not with user
    variants, ``learnable_sink`` (the merge adds it once) or a KV-cache append.

    FA3's keywords: ``sm_margin`` (an int >= 0, default 0) leaves that many SMs free, for
    kernels that run beside this one (communication): the split heuristic and persistent
    grids count the others. ``deterministic`` is accepted (the forward is deterministic:
    fixed split and combine orders, no atomics), ``return_attn_probs`` is FA3's name for
    ``return_lse``; ``qv``, ``attention_chunk > 0`` (and for ``flash_attn_with_kvcache``
    ``rotary_seqlens``) are refused with NotImplementedError; ``scheduler_metadata`` is
    accepted and not needed (plans come from shapes, on the host)."""
    return run(forward.VARLEN, locals())


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, *, page_table=None,
                            block_table=None, cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None,
                            softmax_scale=None, causal=False,
                            window_size=(-1, -1), learnable_sink=None, s_aux=None, sinks=None, softcap=0.0,
                            rotary_interleaved=True,
                            num_splits=0, pack_gqa=None, return_lse=False, return_softmax_lse=False, out=None,
                            backend=None, check_cache_bounds=False, batch_invariant=False, score_mod=None,
                            mask_mod=None, aux_tensors=None, block_mask=None, q_descale=None, k_descale=None,
                            v_descale=None, fp8_two_level_interval=0, cp_world_size=1, cp_rank=0,
                            cp_tot_seqused_k=None, cp_kv_interleave=1, sm_margin=0, scheduler_metadata=None,
                            qv=None, rotary_seqlens=None, attention_chunk=0):
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

    ``learnable_sink`` (aliases ``s_aux``, ``sinks``), ``batch_invariant``, FP8 caches, FP8
    attention and ``fp8_two_level_interval``: as in ``flash_attn_varlen_func``;
    ``return_softmax_lse`` is FA2/FA3's name for ``return_lse``. User variants as in
    ``flash_attn_func``: ``q_idx`` counts the new queries from 0 and ``kv_idx`` the cache
    positions. Context parallelism (``cp_world_size``, ``cp_rank``, ``cp_tot_seqused_k``,
    ``cp_kv_interleave``): as in ``flash_attn_varlen_func``, without an append. FA3's
    ``sm_margin``, ``scheduler_metadata``, ``qv``, ``rotary_seqlens`` and
    ``attention_chunk``: as in ``flash_attn_varlen_func``."""
    args = forward.prepare_kvcache(fold_aliases(locals()))
    return run(kv_cache_ops.APPEND if forward.appends(args) else forward.KVCACHE, args)


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
