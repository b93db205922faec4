"""Context-parallel test helpers shared by the CPU (gloo) and GPU (one-GPU emulation)
tests: shards of a whole cache as the ``cp_*`` keywords assume them, and an fp64
reference of one shard's attention over global positions."""

import math

import torch


def shard_attention_ref(q, k, v, q_pos, k_pos, *, causal=False, window=(-1, -1), scale=None):
    """fp64 attention of q ``(sq, h, d)`` over k / v ``(sk, h_kv, d*)`` whose keys sit at
    global positions ``k_pos`` (sk,), the queries at ``q_pos`` (sq,): out ``(sq, h, d_v)``
    (0 where a row sees no key) and natural-log lse ``(sq, h)`` (-inf there)."""
    h, h_kv = q.shape[1], k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k = k.double().repeat_interleave(h // h_kv, dim=1)
    v = v.double().repeat_interleave(h // h_kv, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    left, right = window
    if causal:
        right = 0
    rel = k_pos[None, :].to(q.device) - q_pos[:, None].to(q.device)  # key - query
    keep = torch.ones_like(rel, dtype=torch.bool)
    if right >= 0:
        keep &= rel <= right
    if left >= 0:
        keep &= rel >= -left
    s = s.masked_fill(~keep[None], -math.inf)
    lse = torch.logsumexp(s, dim=-1)  # (h, sq)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    out = torch.einsum("hqk,khd->qhd", p, v)
    return out, lse.transpose(0, 1)


def query_positions(seqlen_k: int, seqlen_q: int) -> torch.Tensor:
    """Bottom-right aligned: the queries are the last ``seqlen_q`` of ``seqlen_k`` positions."""
    return torch.arange(seqlen_k - seqlen_q, seqlen_k)


def compile_cp_calls(case: list) -> None:
    """The compile harness's target for ``[backend, kind]`` on CUTE_DSL_ARCH: the kernels of
    a causal and a windowed context-parallel shard call (``kind`` "fwd"), or a causal MLA
    one ("mla"), made on CPU tensors with their real checks, plans and keys, compiled."""
    import os

    from feature_pairs import fake_gpu_calls

    import flash_attn_cute as fac

    backend, kind = case
    with fake_gpu_calls(os.environ["CUTE_DSL_ARCH"], compile_keys=True):
        if kind == "fwd":
            q = torch.randn(2, 4, 8, 128, dtype=torch.bfloat16)
            kc = torch.randn(2, 256, 2, 128, dtype=torch.bfloat16)
            lens, tot = torch.full((2,), 100, dtype=torch.int32), torch.full((2,), 399, dtype=torch.int32)
            for mask in (dict(causal=True), dict(window_size=(64, 0))):
                fac.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=lens, cp_world_size=4, cp_rank=1,
                                            cp_tot_seqused_k=tot, backend=backend, return_lse=True, **mask)
        else:
            qn, qp = torch.randn(2, 2, 16, 512, dtype=torch.bfloat16), torch.randn(2, 2, 16, 64, dtype=torch.bfloat16)
            ckv, kpe = torch.randn(8, 64, 512, dtype=torch.bfloat16), torch.randn(8, 64, 64, dtype=torch.bfloat16)
            table, lens = torch.arange(8, dtype=torch.int32).view(2, 4), torch.tensor([100, 200], dtype=torch.int32)
            fac.flash_mla_decode(qn, qp, ckv, kpe, lens, table, causal=True, cp_world_size=2, cp_rank=1,
                                 cp_tot_seqused_k=lens * 2, backend=backend)


__all__ = ["shard_attention_ref", "query_positions", "compile_cp_calls"]
