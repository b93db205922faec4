"""Context-parallel decode on torch.distributed: a context larger than one GPU holds.

A serving engine shards each sequence's KV cache by token over the ``world`` ranks of a
group (vLLM's decode context parallelism, SGLang's DCP): rank ``r`` holds every
``world``-th block of ``cp_kv_interleave`` tokens (1: tokens ``r, r + world, ...``), for
all the KV heads its queries read. A decode step then runs in three parts:

1. the queries of every rank are all-gathered over heads (each rank serves ``heads /
   world`` query heads; attention on a shard needs all of them);
2. each rank attends its shard (``flash_attn_with_kvcache`` / ``flash_attn_varlen_func`` /
   ``flash_mla_decode`` with ``cp_world_size``, ``cp_rank``, ``cp_tot_seqused_k``: causal
   masks and windows taken on global positions) and keeps the natural-log LSE;
3. the partial outputs are merged over the ranks and each rank keeps its own heads
   (``cp_merge``), as if one GPU had attended the whole cache:

       lse = logsumexp_r lse_r        O = sum_r exp(lse_r - lse) * O_r

``cp_merge`` has vLLM's two forms: ``"ag_rs"`` (``cp_lse_ag_out_rs``: all-gather the LSEs,
rescale the local output by ``exp(lse_r - lse)``, reduce-scatter it over heads; the
output travels once, in fp32) and ``"a2a"`` (all-to-all of the outputs and LSEs by head
slice, then this package's split-KV combine kernel merges the ``world`` partials of the
rank's heads). Both run on torch.distributed (NCCL on GPUs, gloo on CPUs), without a
host synchronisation, and can be captured in a CUDA graph. ``cp_decode`` and
``cp_mla_decode`` run the three parts.

``merge_local`` is the same merge with every rank's partials on one device: the exchange
the collectives would make done by indexing, the code after it the same; it tests a
sharding on one GPU against a one-GPU call over the whole cache.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

OPS = ("ag_rs", "a2a")
LSE_LAYOUTS = ("tokens_heads", "heads_tokens")
# torch >= 2.12 names them *_single (the *_tensor names warn there); one call each
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _gather(x: torch.Tensor, world: int, group) -> torch.Tensor:
    """(world, *x.shape): every rank's ``x`` (gathered flat along the first mode, as gloo
    requires it; NCCL takes either)."""
    x = x.contiguous()
    out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather(out, x, group=group)
    return out.view(world, *x.shape)


def _check_merge_args(out, lse, world: int, op: str, lse_layout: str) -> torch.Tensor:
    """``lse`` as (tokens, heads) (a view), after the checks every merge shares."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if lse_layout not in LSE_LAYOUTS:
        raise ValueError(f"lse_layout must be one of {LSE_LAYOUTS}, got {lse_layout!r}")
    if not isinstance(out, torch.Tensor) or out.dim() != 3:
        raise ValueError(f"out must be a (tokens, heads, head_dim) tensor, got "
                         f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}")
    tokens, heads = out.shape[:2]
    lse_th = lse if lse_layout == "tokens_heads" else lse.transpose(0, 1) if lse.dim() == 2 else lse
    if lse_th.dim() != 2 or tuple(lse_th.shape) != (tokens, heads):
        want = (tokens, heads) if lse_layout == "tokens_heads" else (heads, tokens)
        raise ValueError(f"lse must have shape {want} ({lse_layout.replace('_', ', ')}) for out {tuple(out.shape)}, "
                         f"got {tuple(lse.shape)}")
    if lse.dtype != torch.float32:
        raise ValueError(f"lse must be float32 (the kernels' natural-log LSE), got {lse.dtype}")
    if heads % world:
        raise ValueError(f"the heads of out ({heads}) must be a multiple of the group's size ({world}): each rank "
                         "keeps heads / world of them")
    return lse_th


def _by_rank(x: torch.Tensor, world: int) -> torch.Tensor:
    """(tokens, heads, ...) -> (world, tokens, heads / world, ...), contiguous: the slice of
    heads each rank keeps, rank-major (what the collectives send)."""
    tokens, heads = x.shape[:2]
    return x.reshape(tokens, world, heads // world, *x.shape[2:]).movedim(1, 0).contiguous()


def _with_sink(lse_all: torch.Tensor, sink: Optional[torch.Tensor]) -> torch.Tensor:
    """(world, tokens, heads) LSEs, with a learnable sink as one more rank (its logit, zero value)."""
    if sink is None:
        return lse_all
    return torch.cat([lse_all, sink.float().expand(1, *lse_all.shape[1:])], dim=0)


def _weights(lse_all: torch.Tensor, sink: Optional[torch.Tensor]) -> tuple:
    """(weights (world, tokens, heads), lse (tokens, heads)): ``exp(lse_r - lse)``, 0 where
    no rank saw a key (lse -inf)."""
    lse = torch.logsumexp(_with_sink(lse_all, sink), dim=0)
    finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    weights = torch.exp(lse_all - finite)  # exp(-inf - x) = 0 for an empty rank
    return weights, lse


def _ag_rs_send(out: torch.Tensor, weights: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """ag_rs: this rank's output rescaled by its weight (``_weights`` of the all-gathered
    LSEs, without a sink), fp32, arranged by the rank that keeps each head slice (the
    reduce-scatter's input)."""
    return _by_rank(out.float() * weights[rank].unsqueeze(-1), world)


def _ag_rs_finish(recv: torch.Tensor, lse: torch.Tensor, rank: int, world: int, sink: Optional[torch.Tensor],
                  out_dtype, return_lse: bool) -> tuple:
    """ag_rs after the reduce-scatter: this rank's heads (``recv`` (tokens, heads', d) fp32,
    ``lse`` the merged LSE of every head), a learnable sink of those heads folded in
    (``O * exp(lse - logaddexp(lse, sink))``: the sink is one more term of the softmax
    with a zero value, so only this rank's own heads need it), cast: (out, lse or None)."""
    tokens, heads = lse.shape
    mine = lse.view(tokens, world, heads // world)[:, rank]
    if sink is not None:
        with_sink = torch.logaddexp(mine, sink)
        recv = recv * torch.exp(mine - with_sink).unsqueeze(-1)  # 0 where no rank saw a key
        mine = with_sink
    return recv.to(out_dtype), (mine if return_lse else None)


def _a2a_finish(recv_out: torch.Tensor, recv_lse: torch.Tensor, sink: Optional[torch.Tensor], out_dtype,
                return_lse: bool) -> tuple:
    """a2a: the ``world`` partials of this rank's heads, (world, tokens, heads', d) and
    (world, tokens, heads') fp32, merged by the split-KV combine kernel on a GPU (by the
    same formula in torch for CPU tensors, where no kernel runs): (out, lse or None)."""
    world, tokens, heads, d = recv_out.shape
    if recv_out.device.type != "cuda":
        weights, lse = _weights(recv_lse, sink)
        out = (recv_out.float() * weights.unsqueeze(-1)).sum(0)
        return out.to(out_dtype), (lse if return_lse else None)
    from flash_attn_cute.host import heuristics
    from flash_attn_cute.seam import combine_launcher

    out = torch.empty((tokens, heads, d), dtype=out_dtype, device=recv_out.device)
    lse = torch.empty((tokens, heads), dtype=torch.float32, device=recv_out.device) if return_lse else None
    combine = combine_launcher(out_dtype, d, return_lse, sink is not None, heuristics.combine_split_groups(world, False))
    # the combine's batched contract: (splits, batch 1, seqlen = tokens, heads, d); LSEs (splits, 1, heads, tokens)
    combine(recv_out.float().unsqueeze(1), recv_lse.transpose(1, 2).unsqueeze(1), out.unsqueeze(0),
            None if lse is None else lse.transpose(0, 1).unsqueeze(0), None if sink is None else sink.float())
    return out, lse


def _result(out, lse, lse_layout: str, return_lse: bool):
    if not return_lse:
        return out
    return out, (lse if lse_layout == "tokens_heads" else lse.transpose(0, 1))


def cp_merge(out: torch.Tensor, lse: torch.Tensor, group=None, *, op: str = "ag_rs", return_lse: bool = False,
             lse_layout: str = "tokens_heads", learnable_sink: Optional[torch.Tensor] = None):
    """Merges the ranks' attention partials over ``group`` (a torch.distributed process
    group; None: the default one); every rank calls it.

    ``out`` ``(tokens, heads, d)``: this rank's attention over its key shard for all the
    group's query heads; ``lse`` fp32 natural log, ``(tokens, heads)`` or, with
    ``lse_layout="heads_tokens"``, ``(heads, tokens)`` (any strides; -inf where the shard
    held no key). ``heads`` a multiple of the group's size: rank ``r`` keeps heads ``[r *
    heads / world, (r + 1) * heads / world)``. Returns their merged output ``(tokens,
    heads / world, d)`` in out's dtype, and with ``return_lse`` their LSE (in the declared
    layout). ``learnable_sink`` ``(heads / world,)``: the sink logits of the heads this rank
    keeps, added once to the merged softmax (the shard calls leave it out). ``op``: see the
    module docstring."""
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    lse_th = _check_merge_args(out, lse, world, op, lse_layout)
    sink = _check_sink(learnable_sink, out.shape[1] // world)
    tokens, heads, d = out.shape
    if world == 1 and sink is None:  # one rank: its attention is the whole one
        return _result(out, lse_th, lse_layout, return_lse)
    if op == "a2a" or world == 1:
        send_out, send_lse = _by_rank(out, world), _by_rank(lse_th.float(), world)
        recv_out, recv_lse = torch.empty_like(send_out), torch.empty_like(send_lse)
        if world > 1:
            dist.all_to_all_single(recv_out, send_out, group=group)
            dist.all_to_all_single(recv_lse, send_lse, group=group)
        else:
            recv_out, recv_lse = send_out, send_lse
        merged, merged_lse = _a2a_finish(recv_out, recv_lse, sink, out.dtype, return_lse)
        return _result(merged, merged_lse, lse_layout, return_lse)
    weights, merged_lse = _weights(_gather(lse_th.float(), world, group), None)
    send = _ag_rs_send(out, weights, rank, world)
    recv = torch.empty(send.shape[1:], dtype=torch.float32, device=out.device)
    _reduce_scatter(recv, send.view(world * tokens, *send.shape[2:]), group=group)
    return _result(*_ag_rs_finish(recv, merged_lse, rank, world, sink, out.dtype, return_lse), lse_layout,
                   return_lse)


def _check_sink(sink, heads: int):
    if sink is None:
        return None
    if not isinstance(sink, torch.Tensor) or tuple(sink.shape) != (heads,):
        raise ValueError(f"learnable_sink must have shape ({heads},): the sink logits of the heads this rank keeps")
    return sink.float()


def merge_local(outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor], *, op: str = "ag_rs",
                return_lse: bool = False, lse_layout: str = "tokens_heads",
                learnable_sink: Optional[torch.Tensor] = None) -> list:
    """``cp_merge`` of ``world = len(outs)`` ranks whose partials all live on one device:
    ``outs[r]`` / ``lses[r]`` rank r's arguments. The exchanges the collectives would make
    (all-gather, reduce-scatter, all-to-all) are made by indexing; the code before and
    after them is ``cp_merge``'s. ``learnable_sink`` ``(heads,)``: every head's (rank r
    adds its slice). Returns the list of what each rank's ``cp_merge`` returns."""
    world = len(outs)
    lse_ths = [_check_merge_args(o, l, world, op, lse_layout) for o, l in zip(outs, lses)]
    heads = outs[0].shape[1]
    full_sink = _check_sink(learnable_sink, heads)
    sinks = [None if full_sink is None else full_sink[r * heads // world:(r + 1) * heads // world]
             for r in range(world)]
    results = []
    if op == "a2a" or world == 1:
        sends = [(_by_rank(o, world), _by_rank(l.float(), world)) for o, l in zip(outs, lse_ths)]
        for j in range(world):
            recv_out = torch.stack([s[0][j] for s in sends])
            recv_lse = torch.stack([s[1][j] for s in sends])
            merged, merged_lse = _a2a_finish(recv_out, recv_lse, sinks[j], outs[0].dtype, return_lse)
            results.append(_result(merged, merged_lse, lse_layout, return_lse))
        return results
    weights, merged_lse = _weights(torch.stack([l.float() for l in lse_ths]), None)  # what every rank computes
    sends = [_ag_rs_send(o, weights, r, world) for r, o in enumerate(outs)]
    for j in range(world):
        recv = sum(s[j] for s in sends)
        results.append(_result(*_ag_rs_finish(recv, merged_lse, j, world, sinks[j], outs[0].dtype, return_lse),
                               lse_layout, return_lse))
    return results


def shard_positions(seqlen: int, world: int, rank: int, interleave: int = 1) -> torch.Tensor:
    """The global positions of rank ``rank``'s keys of a sequence of ``seqlen`` tokens, in
    its cache order (the layout the kernels' ``cp_*`` keywords assume): every ``world``-th
    block of ``interleave`` tokens, from block ``rank`` on."""
    pos = torch.arange(seqlen)
    return pos[(pos // interleave) % world == rank]


def shard_length(seqlen, world: int, rank: int, interleave: int = 1):
    """How many of a sequence's ``seqlen`` tokens rank ``rank`` holds (an int, or an int
    tensor elementwise): ``shard_positions(...).numel()`` without building it."""
    blocks, tail = seqlen // interleave, seqlen % interleave
    full = blocks // world + ((blocks % world) > rank)  # this rank's whole blocks
    return full * interleave + tail * ((blocks % world) == rank)


def _gather_heads(x: torch.Tensor, world: int, group) -> torch.Tensor:
    """(..., heads', d) of every rank -> (..., world * heads', d), rank-major over heads."""
    gathered = _gather(x, world, group)
    return gathered.movedim(0, -3).reshape(*x.shape[:-2], world * x.shape[-2], x.shape[-1])


def _tokens(out: torch.Tensor, lse: torch.Tensor, packed: bool) -> tuple:
    """A kernel call's out and lse as the merge takes them: (tokens, heads, d), and lse
    (tokens, heads) [dense: lse (batch, heads, seqlen) made token-major] or (heads, tokens)."""
    if packed:
        return out, lse, "heads_tokens"
    b, s, h, d = out.shape
    return out.reshape(b * s, h, d), lse.permute(0, 2, 1).reshape(b * s, h), "tokens_heads"


def _untokens(out, lse, shape: tuple, packed: bool, return_lse: bool):
    """``_tokens``' inverse on the merged result."""
    if packed:
        return (out, lse) if return_lse else out
    b, s = shape[:2]
    out = out.reshape(b, s, *out.shape[1:])
    if not return_lse:
        return out
    return out, lse.reshape(b, s, -1).permute(0, 2, 1)


def _group_shape(group) -> tuple:
    return dist.get_world_size(group), dist.get_rank(group)


def cp_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group=None, *,
              cache_seqlens=None, cp_tot_seqused_k: Optional[torch.Tensor] = None, page_table=None,
              cu_seqlens_q=None, max_seqlen_q=None, causal: bool = False, window_size=(-1, -1),
              softmax_scale=None, softcap: float = 0.0, cp_kv_interleave: int = 1, num_splits: int = 0,
              learnable_sink=None, op: str = "ag_rs", return_lse: bool = False, **kwargs):
    """Attention of this rank's queries against a KV cache sharded over ``group``: the
    one-GPU ``flash_attn_with_kvcache`` of the whole cache, for this rank's heads.

    ``q`` ``(batch, seqlen_q, heads / world, d)`` (or packed ``(total_q, heads / world,
    d)`` with ``cu_seqlens_q``): rank r's query heads ``[r * heads / world, ...)``;
    ``k_cache`` / ``v_cache`` (and ``page_table``, ``cache_seqlens``): this rank's shard,
    in ``flash_attn_with_kvcache``'s layouts, with every KV head; ``cp_tot_seqused_k``
    ``(batch,)`` int32: the global lengths (needed with causal or a window). The queries
    are all-gathered over heads, the shard attended (``cp_rank`` = this rank) and the
    partials merged (``cp_merge(op=)``). ``learnable_sink`` ``(heads / world,)``: this
    rank's heads' sinks, added once in the merge. Other keywords go to the attention
    call. Returns out ``(batch, seqlen_q, heads / world, d_v)`` (packed: ``(total_q, ...)``),
    and lse ``(batch, heads / world, seqlen_q)`` (packed: ``(heads / world, total_q)``)
    with ``return_lse``."""
    from flash_attn_cute.interface import flash_attn_with_kvcache

    world, rank = _group_shape(group)
    q_all = _gather_heads(q, world, group) if world > 1 else q
    out, lse = flash_attn_with_kvcache(
        q_all, k_cache, v_cache, cache_seqlens=cache_seqlens, page_table=page_table, cu_seqlens_q=cu_seqlens_q,
        max_seqlen_q=max_seqlen_q, causal=causal, window_size=window_size, softmax_scale=softmax_scale,
        softcap=softcap, num_splits=num_splits, return_lse=True, cp_world_size=world, cp_rank=rank,
        cp_tot_seqused_k=cp_tot_seqused_k if world > 1 else None, cp_kv_interleave=cp_kv_interleave, **kwargs)
    packed = cu_seqlens_q is not None
    out_t, lse_t, layout = _tokens(out, lse, packed)
    merged = cp_merge(out_t, lse_t, group, op=op, return_lse=return_lse, lse_layout=layout,
                      learnable_sink=learnable_sink)
    m_out, m_lse = merged if return_lse else (merged, None)
    return _untokens(m_out, m_lse, out.shape, packed, return_lse)


def cp_mla_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor, kpe_cache: torch.Tensor,
                  cache_seqlens: torch.Tensor, page_table: torch.Tensor, group=None, *,
                  cp_tot_seqused_k: Optional[torch.Tensor] = None, causal: bool = False, softmax_scale=None,
                  cp_kv_interleave: int = 1, num_splits: int = 0, op: str = "ag_rs", return_lse: bool = False,
                  **kwargs):
    """``flash_mla_decode`` over a latent cache sharded over ``group``: ``q_nope`` /
    ``q_pe`` ``(batch, seqlen_q, heads / world, 512 / 64)`` this rank's query heads, the
    caches, ``page_table`` and ``cache_seqlens`` this rank's shard; the queries are
    all-gathered (one 576-wide gather, taken back as views), the shard attended and the
    partials merged as in ``cp_decode``. Returns out ``(batch, seqlen_q, heads / world,
    512)`` [and lse ``(batch, heads / world, seqlen_q)``]."""
    from flash_attn_cute.mla import flash_mla_decode

    world, rank = _group_shape(group)
    if world > 1:
        q = _gather_heads(torch.cat([q_nope, q_pe], dim=-1), world, group)
        q_nope, q_pe = q[..., :q_nope.shape[-1]], q[..., q_nope.shape[-1]:]
    out, lse = flash_mla_decode(q_nope, q_pe, ckv_cache, kpe_cache, cache_seqlens, page_table,
                                softmax_scale=softmax_scale, causal=causal, num_splits=num_splits, return_lse=True,
                                cp_world_size=world, cp_rank=rank,
                                cp_tot_seqused_k=cp_tot_seqused_k if world > 1 else None,
                                cp_kv_interleave=cp_kv_interleave, **kwargs)
    out_t, lse_t, layout = _tokens(out, lse, False)
    merged = cp_merge(out_t, lse_t, group, op=op, return_lse=return_lse, lse_layout=layout)
    m_out, m_lse = merged if return_lse else (merged, None)
    return _untokens(m_out, m_lse, out.shape, False, return_lse)


__all__ = ["cp_merge", "cp_decode", "cp_mla_decode", "merge_local", "shard_positions", "shard_length", "OPS"]
