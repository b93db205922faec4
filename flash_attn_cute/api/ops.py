"""The forward pass as a ``torch.library`` custom op, so ``torch.compile`` can trace it.

Dynamo cannot trace into a DSL launch (nor into validation that reads data pointers),
so under ``torch.compile`` each public entry point allocates its output in the graph
and calls one opaque op, ``flash_attn_cute::fwd``, that writes the output in place
(``mutates_args=("out",)``) and returns the LSE. Its fake implementation gives the LSE's
shape and dtype for tracing; its real implementation runs the entry point's spec
eagerly (``api.forward``, ``api.entry.run``), so validation, planning, the per-call cache
and the launch are exactly the eager ones (an invalid call fails when the compiled graph
runs). The traced side (``forward.traced_call``) calls the op by name: this module is
imported by the public API, which registers the op. CUDA-graph capture
(``mode="reduce-overhead"``) records the real implementation's launches.
"""

from __future__ import annotations

from typing import Optional

import torch

from flash_attn_cute.api import forward
from flash_attn_cute.api.entry import run

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
    """Writes attention into ``out``; returns the LSE (an empty tensor unless ``return_lse``):
    the entry point's spec run eagerly (``api.entry.run``)."""
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {_KINDS}, got {kind!r}")
    args = dict(q=q, out=out, cu_seqlens_q=cu_seqlens_q, page_table=page_table, learnable_sink=learnable_sink,
                max_seqlen_q=max_seqlen_q, softmax_scale=softmax_scale, causal=causal,
                window_size=(window_left, window_right), softcap=softcap, num_splits=num_splits, pack_gqa=pack_gqa,
                return_lse=True, backend=backend, batch_invariant=batch_invariant)
    if kind == "kvcache":
        seqlens = seqused_k if seqused_k is not None else max_seqlen_k
        args.update(k_cache=k, v_cache=v, cache_seqlens=seqlens)
        args = forward.prepare_kvcache(args)
    else:
        args.update(k=k, v=v, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q, seqused_k=seqused_k,
                    max_seqlen_k=max_seqlen_k)
    _, lse = run(forward.SPECS[kind], args)
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
