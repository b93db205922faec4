"""Context parallelism on one GPU: every rank's shard attended on the one device (the
``cp_*`` keywords of flash_attn_with_kvcache, flash_attn_varlen_func and flash_mla_decode),
merged by ``distributed.merge_local`` (the code ``cp_merge`` runs after its collectives),
against a one-GPU call over the whole cache and an fp64 reference, per backend.

Cases: dense and paged caches, packed queries, MLA; 2, 4 and 8 ranks; round-robin by token
and by blocks of 16; queries of length 1 and 4; causal, a window and no mask; sequences
short enough that some ranks hold no key (out 0, lse -inf there: never NaN). Outputs are
poisoned with NaN. Bound: the error against fp64 at most twice the one-GPU call's, plus
2^-8 of the largest partial (each rank's bf16 output is rounded once before the merge).
"""

import math

import pytest
import torch

from cp_reference import query_positions, shard_attention_ref
from flash_attn_cute import distributed
from flash_attn_cute.distributed import merge_local, shard_positions
from flash_attn_cute.testing import backends_on_this_gpu, check_close, check_lse

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEVICE = "cuda"
BF16 = torch.bfloat16
H, HKV, D = 8, 2, 128
MASKS = {"causal": dict(causal=True), "window": dict(window_size=(37, 2)), "none": {}}
CASES = [  # (entry, world, interleave, seqlen_q, mask)
    ("kvcache", 2, 1, 1, "causal"), ("kvcache", 4, 1, 4, "causal"), ("kvcache", 8, 16, 4, "causal"),
    ("kvcache", 4, 1, 4, "window"), ("kvcache", 8, 1, 1, "none"),
    ("paged", 2, 1, 4, "causal"), ("paged", 4, 16, 1, "causal"), ("paged", 8, 1, 4, "window"),
    ("paged", 4, 1, 1, "none"),
    ("varlen", 2, 1, 4, "causal"), ("varlen", 8, 16, 4, "causal"), ("varlen", 4, 1, 1, "window"),
    ("mla", 2, 1, 1, "causal"), ("mla", 4, 1, 4, "causal"), ("mla", 8, 16, 4, "causal"), ("mla", 4, 1, 1, "none"),
]
PAGE = {"paged": 16, "varlen": 16, "mla": 64}


@pytest.fixture(params=backends_on_this_gpu())
def backend(request):
    return request.param


def _i32(x):
    return torch.tensor(x, dtype=torch.int32, device=DEVICE)


def _paged(rows_per_seq: list, page: int, width: tuple, dtype=BF16, seed=0):
    """A page pool holding each sequence's rows (list of (n, *width) tensors) on shuffled
    pages: (pool (pages, page, *width), page_table (batch, max_pages))."""
    g = torch.Generator().manual_seed(seed)
    pages_per = [max(1, math.ceil(r.shape[0] / page)) for r in rows_per_seq]
    total = sum(pages_per)
    perm = torch.randperm(total, generator=g).tolist()
    pool = torch.randn(total, page, *width, dtype=dtype, device=DEVICE)  # garbage past each sequence's end
    table = torch.zeros(len(rows_per_seq), max(pages_per), dtype=torch.int32)
    nxt = 0
    for b, rows in enumerate(rows_per_seq):
        for p in range(pages_per[b]):
            pid = perm[nxt]
            nxt += 1
            table[b, p] = pid
            chunk = rows[p * page:(p + 1) * page]
            pool[pid, :chunk.shape[0]] = chunk
    return pool, table.to(DEVICE)


def _lengths(seqlen_q: int):
    return [613, 9, 1, 0] if seqlen_q == 1 else [411, 5, 2]


def _fwd_call(fac, entry, backend, q, k_rows, v_rows, mask, cp):
    """One attention call over the given per-sequence key rows (a shard's or the whole
    cache's): (out, lse) as (batch, seqlen_q, H, D) and (batch, H, seqlen_q)."""
    batch, seqlen_q = q.shape[:2]
    cap = max(1, max(r.shape[0] for r in k_rows))
    common = dict(backend=backend, return_lse=True, **MASKS[mask], **cp)
    lens = _i32([r.shape[0] for r in k_rows])
    if entry == "kvcache":
        kc = torch.randn(batch, cap + 3, HKV, D, dtype=BF16, device=DEVICE)
        vc = torch.randn_like(kc)
        for b, (kr, vr) in enumerate(zip(k_rows, v_rows)):
            kc[b, :kr.shape[0]], vc[b, :vr.shape[0]] = kr, vr
        out = torch.full_like(q, float("nan"))
        return fac.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, out=out, **common)
    kp, table = _paged(k_rows, PAGE[entry], (HKV, D), seed=1)
    vp, _ = _paged(v_rows, PAGE[entry], (HKV, D), seed=1)
    if entry == "paged":
        out = torch.full_like(q, float("nan"))
        return fac.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, page_table=table, out=out, **common)
    qp = q.reshape(batch * seqlen_q, H, D)
    cu = _i32(list(range(0, batch * seqlen_q + 1, seqlen_q)))
    out = torch.full_like(qp, float("nan"))
    o, lse = fac.flash_attn_varlen_func(qp, kp, vp, cu_seqlens_q=cu, max_seqlen_q=seqlen_q, seqused_k=lens,
                                        page_table=table, out=out, **common)
    return o.view(batch, seqlen_q, H, D), lse.view(H, batch, seqlen_q).permute(1, 0, 2)


def _mla_call(fac, backend, qn, qp, ckv_rows, kpe_rows, mask, cp):
    page = PAGE["mla"]
    ckv, table = _paged(ckv_rows, page, (512,), seed=2)
    kpe, _ = _paged(kpe_rows, page, (64,), seed=2)
    lens = _i32([r.shape[0] for r in ckv_rows])
    out = torch.full_like(qn, float("nan"))
    return fac.flash_mla_decode(qn, qp, ckv, kpe, lens, table, causal=mask == "causal", backend=backend,
                                return_lse=True, out=out, **cp)


@pytest.mark.parametrize("entry,world,interleave,seqlen_q,mask", CASES,
                         ids=["-".join(map(str, c)) for c in CASES])
def test_shards_merged_are_the_whole_cache(backend, entry, world, interleave, seqlen_q, mask):
    import flash_attn_cute as fac

    if entry == "mla" and backend not in backends_on_this_gpu("mla"):
        pytest.skip(f"{backend} has no MLA kernel")
    torch.manual_seed(world * 100 + interleave * 10 + seqlen_q)
    tot = _lengths(seqlen_q)
    batch = len(tot)
    mla = entry == "mla"
    heads = 16 if mla else H
    if mla:
        qn = torch.randn(batch, seqlen_q, heads, 512, dtype=BF16, device=DEVICE)
        qpe = torch.randn(batch, seqlen_q, heads, 64, dtype=BF16, device=DEVICE)
        ckv = [torch.randn(n, 512, dtype=BF16, device=DEVICE) for n in tot]
        kpe = [torch.randn(n, 64, dtype=BF16, device=DEVICE) for n in tot]
        call = lambda rows, cp: _mla_call(fac, backend, qn, qpe, rows[0], rows[1], mask, cp)
        whole_rows = (ckv, kpe)
    else:
        q = torch.randn(batch, seqlen_q, heads, D, dtype=BF16, device=DEVICE)
        k = [torch.randn(n, HKV, D, dtype=BF16, device=DEVICE) for n in tot]
        v = [torch.randn(n, HKV, D, dtype=BF16, device=DEVICE) for n in tot]
        call = lambda rows, cp: _fwd_call(fac, entry, backend, q, rows[0], rows[1], mask, cp)
        whole_rows = (k, v)
    tot_lens = _i32(tot)
    one_out, one_lse = call(whole_rows, {})
    outs, lses = [], []
    for r in range(world):
        pos = [shard_positions(n, world, r, interleave).to(DEVICE) for n in tot]
        rows = tuple([x[p] for x, p in zip(xs, pos)] for xs in whole_rows)
        o, l = call(rows, dict(cp_world_size=world, cp_rank=r, cp_tot_seqused_k=tot_lens,
                               cp_kv_interleave=interleave))
        assert not torch.isnan(o).any() and not torch.isnan(l).any(), f"rank {r}: NaN in a shard's output"
        outs.append(o.reshape(batch * seqlen_q, heads, -1)), lses.append(l.permute(0, 2, 1).reshape(-1, heads))
    assert any(bool(torch.isneginf(l).all(dim=1).any()) for l in lses), "no empty shard row exercised"
    # the fp64 reference over the whole cache
    ref_o, ref_l = [], []
    for b, n in enumerate(tot):
        if mla:
            qb = torch.cat([qn[b], qpe[b]], -1)
            kb = torch.cat([ckv[b], kpe[b]], -1)[:, None]
            vb = ckv[b][:, None]
            scale = 576 ** -0.5
        else:
            qb, kb, vb, scale = q[b], k[b], v[b], None
        o, l = shard_attention_ref(qb, kb, vb, query_positions(n, seqlen_q).to(DEVICE), torch.arange(n, device=DEVICE),
                                   causal=mask == "causal", window=MASKS[mask].get("window_size", (-1, -1)),
                                   scale=scale)
        ref_o.append(o), ref_l.append(l)
    ref_o, ref_l = torch.cat(ref_o), torch.cat(ref_l)
    one_o = one_out.reshape(batch * seqlen_q, heads, -1)
    one_l = one_lse.permute(0, 2, 1).reshape(-1, heads)
    atol = 2 ** -8 * max(float(o.abs().max()) for o in outs)
    for op in distributed.OPS:
        merged = merge_local(outs, lses, op=op, return_lse=True)
        m_o = torch.cat([m[0] for m in merged], dim=1)
        m_l = torch.cat([m[1] for m in merged], dim=1)
        assert m_o.dtype == BF16 and not torch.isnan(m_o).any()
        check_close(m_o.double(), ref_o, one_o.double(), mult=2.0, atol=atol, name=f"{op} out")
        check_lse(m_l, ref_l, one_l.double(), mult=2.0, atol=1e-3, name=f"{op} lse")


def test_cp_decode_one_rank_is_the_plain_call(backend):
    """``cp_decode`` on a group of one (the default process group, gloo or NCCL of one
    process): the plain call, bit for bit."""
    import torch.distributed as dist

    import flash_attn_cute as fac

    import socket

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    q = torch.randn(2, 1, H, D, dtype=BF16, device=DEVICE)
    kc = torch.randn(2, 300, HKV, D, dtype=BF16, device=DEVICE)
    vc = torch.randn_like(kc)
    lens = _i32([300, 17])
    out, lse = distributed.cp_decode(q, kc, vc, cache_seqlens=lens, causal=True, backend=backend, return_lse=True)
    ref, ref_lse = fac.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True, backend=backend,
                                               return_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
