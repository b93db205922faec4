"""The forward pass as a ``torch.library`` custom op, so ``torch.compile`` can trace it.

Dynamo cannot trace into a DSL launch (nor into validation that reads data pointers),
so under ``torch.compile`` each public entry point allocates its output in the graph
and calls one opaque op, ``flash_attn_cute::fwd``, that writes the output in place
(``mutates_args=("out",)``) and returns the LSE. Its fake implementation gives the LSE's
shape and dtype for tracing; its real implementation is the eager public function,
so validation, planning, the per-call cache and the launch are exactly the eager ones
(an invalid call fails when the compiled graph runs). CUDA-graph capture
(``mode="reduce-overhead"``) records the real implementation's launches.
"""

from __future__ import annotations

from typing import Optional

import torch

_KINDS = ("func", "varlen", "kvcache")


@torch.library.custom_op("flash_attn_cute::fwd", mutates_args=("out",))
def fwd(
    kind: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_k: Optional[torch.Tensor],
    seqused_q: Optional[torch.Tensor],
    seqused_k: Optional[torch.Tensor],  # kvcache: cache_seqlens
    page_table: Optional[torch.Tensor],
    learnable_sink: Optional[torch.Tensor],
    max_seqlen_q: Optional[int],
    max_seqlen_k: Optional[int],  # varlen: the bound; kvcache with int lengths: the length
    softmax_scale: Optional[float],
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    num_splits: int,
    pack_gqa: Optional[bool],
    return_lse: bool,
    backend: Optional[str],
    batch_invariant: bool,
) -> torch.Tensor:
    """Writes attention into ``out``; returns the LSE (an empty tensor unless ``return_lse``)."""
    from flash_attn_cute import interface

    opts = dict(softmax_scale=softmax_scale, causal=causal, window_size=(window_left, window_right),
                learnable_sink=learnable_sink, softcap=softcap, num_splits=num_splits, pack_gqa=pack_gqa,
                return_lse=True, out=out, backend=backend, batch_invariant=batch_invariant)
    if kind == "func":
        _, lse = interface.flash_attn_func(q, k, v, **opts)
    elif kind == "varlen":
        _, lse = interface.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                  seqused_q=seqused_q, seqused_k=seqused_k, page_table=page_table,
                                                  **opts)
    elif kind == "kvcache":
        seqlens = seqused_k if seqused_k is not None else max_seqlen_k
        _, lse = interface.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, page_table=page_table,
                                                   cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q, **opts)
    else:
        raise ValueError(f"kind must be one of {_KINDS}, got {kind!r}")
    return lse if return_lse else lse.new_empty((0,))


@fwd.register_fake
def _(kind, q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table, learnable_sink, max_seqlen_q,
      max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, num_splits, pack_gqa, return_lse,
      backend, batch_invariant):
    if not return_lse:
        return q.new_empty((0,), dtype=torch.float32)
    if q.dim() == 3:  # packed queries
        return q.new_empty((q.shape[-2], q.shape[0]), dtype=torch.float32)
    return q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)


def traced_call(kind: str, q, k, v, out, *, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                cache_seqlens=None, page_table=None, learnable_sink=None, max_seqlen_q=None, max_seqlen_k=None,
                softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, num_splits=1, pack_gqa=None,
                return_lse=False, backend=None, batch_invariant=False):
    """The public entry points' body under ``torch.compile``: output allocated in the
    graph, then the op. ``cache_seqlens`` travels as ``seqused_k`` (an int as ``max_seqlen_k``)."""
    if out is None:
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    if cache_seqlens is not None:
        if isinstance(cache_seqlens, int):
            max_seqlen_k = cache_seqlens
        else:
            seqused_k = cache_seqlens
    left, right = (-1 if w is None else w for w in window_size)
    lse = torch.ops.flash_attn_cute.fwd(
        kind, q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table, learnable_sink,
        max_seqlen_q, max_seqlen_k, softmax_scale, causal, left, right, float(softcap), num_splits, pack_gqa,
        return_lse, backend, batch_invariant)
    return (out, lse) if return_lse else out
