"""Multi-head latent attention (DeepSeek V2/V3 style) decode over a paged latent cache.

Every query head attends to one shared cache of 512 ``ckv`` plus 64 rotary ``kpe`` values
per token (with a KV-head mode, FlashMLA's ``h_kv``: its group's KV head of the cache):
scores ``(q_nope . ckv + q_pe . kpe) * softmax_scale``, output ``softmax(scores) . ckv``.
Any head count from 1 to 128: the kernels pack a KV head's query heads x query positions
into 64-row tiles and predicate the partial last one (``mla_kernel``), so q and out are
never padded or copied. The public entry point is ``flash_mla_decode``: a spec of the run
path every entry point shares (``api.mla_call.MLA``, ``api.entry.run``: validation, the
per-call cache, the seam's ``"mla"`` kind with its backends in ``MLA_BACKENDS``). Split-KV partials
(fp32) are merged by the package's combine kernel (d_v 512). The host path never
synchronises with the device: the kernels clamp each length to ``max_pages_per_seq *
page_size`` and each page id into the pool.
"""

from __future__ import annotations

from flash_attn_cute.api import mla_call
from flash_attn_cute.api.entry import run
from flash_attn_cute.host.constants import D_CKV, D_KPE, MLA_MAX_NHEADS, MLA_NHEADS
from flash_attn_cute.host.problems import MlaProblem
from flash_attn_cute.host.registry import MLA_BACKENDS

__all__ = ["flash_mla_decode", "get_mla_metadata", "MlaProblem", "MLA_BACKENDS", "MLA_NHEADS", "MLA_MAX_NHEADS",
           "D_CKV", "D_KPE"]


def get_mla_metadata(cache_seqlens, nheads: int, nheads_kv: int = 1, seqlen_q: int = 1, num_sms=None):
    """A length-balanced split schedule for ``flash_mla_decode(..., scheduler_metadata=)``
    (FlashMLA's ``get_mla_metadata``), computed on the device from ``cache_seqlens``
    ``(batch,)`` int32 by one small kernel, with no host sync (CUDA-graph safe): call it once
    per decode step, after the lengths are set, and hand the result to every layer's call.
    ``nheads`` (query heads), ``nheads_kv`` and ``seqlen_q`` as the decode calls have them;
    ``num_sms``: the SMs to spread over (default: the device's). Returns an int32 tensor.

    The SM90 MLA kernel over pages of a multiple of 64 runs it: each sequence is cut into
    pieces by its length so that the pieces of the whole batch fill the SMs evenly
    (``host/mla_schedule.py``); a sequence of one piece is written whole, the others are
    merged by the combine. Other kernels, an explicit ``num_splits``, ``batch_invariant``
    and context parallelism plan their splits on the host and ignore it. A schedule made
    from other lengths than the call's gives wrong results (as FlashMLA's; never an
    out-of-bounds access). It pays on batches of mixed lengths (H200: 1.10x the host's plan
    on 64 sequences of 1 to 2047 keys); where no sequence needs cutting it plans what the
    host plans and costs 2-8 us more a call (``benchmarks/RESULTS.md``)."""
    import torch

    from flash_attn_cute.host import heuristics
    from flash_attn_cute.host.mla_schedule import NO_CAPACITY, schedule_numel, schedule_parts
    from flash_attn_cute.kernels.mla_schedule import launch_schedule

    mla_call.check_schedule_args(cache_seqlens, nheads, nheads_kv, seqlen_q)
    slices = -(-seqlen_q * (nheads // nheads_kv) // 64) * nheads_kv
    parts = schedule_parts(num_sms or heuristics.num_sms(cache_seqlens.device), slices)
    batch = cache_seqlens.shape[0]
    schedule = torch.empty(schedule_numel(parts, batch), dtype=torch.int32, device=cache_seqlens.device)
    launch_schedule(cache_seqlens, schedule, NO_CAPACITY, parts)
    return schedule


def flash_mla_decode(q_nope, q_pe, ckv_cache, kpe_cache, cache_seqlens, page_table, *, softmax_scale=None,
                     causal=False, num_splits=0, return_lse=False, out=None, backend=None, batch_invariant=False,
                     kv_descale=None, q_descale=None, scheduler_metadata=None, cp_world_size=1, cp_rank=0,
                     cp_tot_seqused_k=None, cp_kv_interleave=1):
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
    ``scheduler_metadata``: ``get_mla_metadata(cache_seqlens, ...)`` of this step's lengths
    (FlashMLA's ``tile_scheduler_metadata``): the KV splits follow each sequence's length
    instead of the table's capacity (SM90, pages of a multiple of 64; see there).

    FP8 latent cache: ``ckv_cache`` and ``kpe_cache`` both ``float8_e4m3fn`` (or
    ``float8_e5m2``), the queries fp16/bf16, and ``kv_descale`` fp32 (one element, or
    ``(batch,)`` / ``(batch, 1)``, or FA3's ``(batch, nheads_kv)``; default 1) the factor
    that turns the stored values of
    both caches back into real ones (one scale per token's 576 values, as vLLM stores an
    MLA cache; quantize with ``quantize_fp8(torch.cat([ckv, kpe], -1), granularity=
    "tensor")``). On Hopper an e4m3 cache in pages of a multiple of 64 runs in fp8 wgmma
    (FlashMLA's FP8 recipe): the queries are rounded to e4m3 in the kernel (one
    power-of-two scale per 64 query rows, folded into the softmax scale), P to e4m3
    (relative error 2^-4 per element at most; the output's error against the fp32
    reference on the dequantized cache is stated in the README); other page sizes, e5m2
    and other GPUs widen the cache to 16 bits in shared memory (q unrounded). Scores and
    output use the descale. On the GPUs the MLA kernels run on that have fp8 conversions
    (sm_90, sm_100; not the A100). ``kv_descale`` is ignored for a 16-bit cache.

    FP8 queries (FlashMLA's FP8 mode, as vLLM calls it): ``q_nope`` and ``q_pe``
    ``float8_e4m3fn`` with an e4m3 cache in pages of a multiple of 64 (sm_90), and
    ``q_descale`` fp32 in the forms of ``kv_descale`` (default 1), the factor that turns
    them back into real ones; the output is bf16.

    No device synchronisation: lengths beyond the table's capacity and page ids outside
    the pool are clamped in the kernel (wrong results, never an illegal read). A
    repeated call (same shapes, strides, dtypes, arguments) skips validation and planning.

    Context parallelism (``cp_world_size``, ``cp_rank``, ``cp_tot_seqused_k``,
    ``cp_kv_interleave``; FlashInfer's ``enable_dcp`` / ``cp_world`` / ``cp_rank``): the
    cache is rank ``cp_rank``'s shard, as in ``flash_attn_varlen_func``; ``causal`` then
    needs ``cp_tot_seqused_k``, the global lengths. ``flash_attn_cute.distributed.
    cp_mla_decode`` runs the shard and merges the ranks."""
    return run(mla_call.MLA, locals())
