"""GPU tests of the serving engine's call (issue 15), per backend, against the fp32 reference.

- varlen queries over a paged cache: a mixed step (decode rows with 1 query, spec-decode
  rows, empty rows, chunked-prefill rows of hundreds of queries), page sizes 1 to 256,
  causal / local / softcap, split-KV; dense and packed queries over a batch cache;
- attention sinks on every entry point, with and without split-KV;
- batch invariance: a sequence's output and LSE bitwise equal across batch compositions;
- per-sequence query counts (``seqused_q``), dense and packed queries;
- any batch size: 200,000 sequences.

``compile_keys`` lists the forward kernels these calls compile: the CPU compile tests
(test_fwd_compile.py) compile a covering subset of them with the main sweep's.

Outputs are poisoned with NaN; errors are bounded by 2x PyTorch's own low-precision error
(``check_close``). A feature the backend under test does not implement is a skip with the
backend's reason (conftest).
"""

import math

import pytest
import torch

from flash_attn_cute.testing import attention_serving_ref, backends_on_this_gpu, check_close, check_lse

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEVICE = "cuda"
BF16 = torch.bfloat16


def _api():
    import flash_attn_cute

    return flash_attn_cute


@pytest.fixture(params=backends_on_this_gpu())
def backend(request):
    return request.param


def _randn(*shape, dtype=BF16):
    return torch.randn(*shape, device=DEVICE, dtype=dtype)


def _nan(shape, dtype=BF16):
    return torch.full(shape, float("nan"), device=DEVICE, dtype=dtype)


def _i32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def _cu(lens):
    return _i32([0, *torch.tensor(lens).cumsum(0).tolist()])


# A serving step: decode rows (1 query), spec-decode rows (2-8), an empty row, chunked
# prefill rows (hundreds of queries continuing a context). Keys >= queries per row.
LENS_Q = (1, 1, 4, 0, 600, 1, 8, 113, 1)
LENS_K = (40, 1000, 9, 17, 700, 4000, 8, 300, 1)


def _paged_step(page_size, nheads=8, nheads_kv=2, d=128, lens_q=LENS_Q, lens_k=LENS_K, seed=0):
    torch.manual_seed(seed)
    q = _randn(sum(lens_q), nheads, d)
    max_pages = math.ceil(max(lens_k) / page_size)
    num_pages = len(lens_k) * max_pages + 5
    k = _randn(num_pages, page_size, nheads_kv, d)
    v = _randn(num_pages, page_size, nheads_kv, d)
    table = torch.randperm(num_pages, device=DEVICE)[: len(lens_k) * max_pages].view(len(lens_k), max_pages)
    return q, k, v, _cu(lens_q), max(lens_q), _i32(lens_k), table.to(torch.int32)


MASKS = {"causal": dict(causal=True), "local": dict(causal=True, window_size=(96, 0)),
         "softcap": dict(softcap=20.0), "window_both": dict(window_size=(200, 30))}


def _check(out, lse, ref_kwargs, **tensors):
    out_ref, lse_ref = attention_serving_ref(**tensors, **ref_kwargs)
    out_pt, lse_pt = attention_serving_ref(**tensors, **ref_kwargs, upcast=False)
    check_close(out, out_ref, out_pt)
    check_lse(lse, lse_ref, lse_pt)


@pytest.mark.parametrize("num_splits", [1, 0, 3])
@pytest.mark.parametrize("mask", ["causal", "local", "softcap"])
@pytest.mark.parametrize("page_size", [1, 16, 64, 128, 256])
def test_mixed_step_varlen_over_paged_cache(backend, page_size, mask, num_splits):
    if num_splits != 1 and mask != "causal":
        pytest.skip("split-KV crossed with the causal mask only (compile budget)")
    fa = _api()
    q, k, v, cu_q, max_q, seqused_k, table = _paged_step(page_size)
    out = _nan(q.shape)
    out, lse = fa.flash_attn_varlen_func(q, k, v, cu_q, None, max_q, None, seqused_k=seqused_k, page_table=table,
                                         num_splits=num_splits, return_lse=True, out=out, backend=backend,
                                         **MASKS[mask])
    assert lse.shape == (q.shape[1], q.shape[0])
    _check(out, lse, MASKS[mask], q=q, k=k, v=v, cu_seqlens_q=cu_q, seqused_k=seqused_k, page_table=table)
    # SGLang's form: the same step through flash_attn_with_kvcache with packed queries
    out2 = fa.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqused_k, page_table=table, cu_seqlens_q=cu_q,
                                      max_seqlen_q=max_q, num_splits=num_splits, backend=backend, **MASKS[mask])
    if num_splits == 1:
        assert torch.equal(out2, out)
    else:
        check_close(out2, *(attention_serving_ref(q=q, k=k, v=v, cu_seqlens_q=cu_q, seqused_k=seqused_k,
                                                  page_table=table, upcast=u, **MASKS[mask])[0]
                            for u in (True, False)))


@pytest.mark.parametrize("pack_gqa", [None, True])
def test_mixed_step_gqa_packing_and_graph_capture(backend, pack_gqa):
    # 32 query heads over 8 KV heads (the serving shape), captured in a CUDA graph and
    # replayed with new lengths and pages: no host sync anywhere on the path.
    fa = _api()
    q, k, v, cu_q, max_q, seqused_k, table = _paged_step(64, nheads=32, nheads_kv=8)
    kw = dict(seqused_k=seqused_k, page_table=table, causal=True, num_splits=0, pack_gqa=pack_gqa, backend=backend)
    out = torch.empty_like(q)
    fa.flash_attn_varlen_func(q, k, v, cu_q, None, max_q, None, out=out, **kw)  # compile, warm the cache
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fa.flash_attn_varlen_func(q, k, v, cu_q, None, max_q, None, out=out, **kw)
    seqused_k.copy_(_i32([7, 999, 3, 0, 650, 3999, 8, 120, 1]))
    table.copy_(table.flip(0))
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    ref = [attention_serving_ref(q=q, k=k, v=v, cu_seqlens_q=cu_q, seqused_k=seqused_k, page_table=table,
                                 causal=True, upcast=u)[0] for u in (True, False)]
    check_close(out, *ref)


@pytest.mark.parametrize("layout", ["dense_q", "packed_q", "packed_kv"])
def test_varlen_over_a_batch_cache(backend, layout):
    # FA4's kvcache tests call flash_attn_varlen_func with a batch cache and seqused_k,
    # queries dense (cu_seqlens_q None) or packed; packed keys may also carry seqused_k.
    fa = _api()
    torch.manual_seed(1)
    lens_q, lens_k = (3, 1, 0, 5), (64, 30, 7, 5)
    kc, vc = _randn(4, 64, 2, 64), _randn(4, 64, 2, 64)
    seqused_k = _i32(lens_k)
    kw = dict(seqused_k=seqused_k, causal=True, return_lse=True, backend=backend)
    if layout == "dense_q":
        q = _randn(4, 5, 4, 64)
        out, lse = fa.flash_attn_varlen_func(q, kc, vc, **kw)
        _check(out, lse, dict(causal=True), q=q, k=kc, v=vc, seqused_k=seqused_k)
        return
    q, cu_q = _randn(sum(lens_q), 4, 64), _cu(lens_q)
    if layout == "packed_q":
        out, lse = fa.flash_attn_varlen_func(q, kc, vc, cu_q, None, max(lens_q), None, **kw)
        _check(out, lse, dict(causal=True), q=q, k=kc, v=vc, cu_seqlens_q=cu_q, seqused_k=seqused_k)
        return
    kp, vp, cu_k = kc.flatten(0, 1), vc.flatten(0, 1), _cu([64] * 4)  # rows past seqused_k unused
    out, lse = fa.flash_attn_varlen_func(q, kp, vp, cu_q, cu_k, max(lens_q), 64, **kw)
    _check(out, lse, dict(causal=True), q=q, k=kp, v=vp, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=seqused_k)


# ------------------------------------------------------------------------------ sinks


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("mask", ["none", "causal", "local_softcap"])
@pytest.mark.parametrize("entry", ["func", "varlen_paged", "kvcache_decode"])
def test_learnable_sink(backend, entry, mask, num_splits):
    fa = _api()
    torch.manual_seed(2)
    masks = {"none": {}, "causal": dict(causal=True), "local_softcap": dict(causal=True, window_size=(50, 0),
                                                                           softcap=15.0)}[mask]
    if entry == "func":
        q, k, v = _randn(2, 77, 4, 128), _randn(2, 300, 2, 128), _randn(2, 300, 2, 128)
        sink = torch.randn(4, device=DEVICE) * 2
        out, lse = fa.flash_attn_func(q, k, v, learnable_sink=sink, num_splits=num_splits, return_lse=True,
                                      backend=backend, **masks)
        _check(out, lse, dict(masks, learnable_sink=sink), q=q, k=k, v=v)
    elif entry == "varlen_paged":
        q, k, v, cu_q, max_q, seqused_k, table = _paged_step(16)
        sink = torch.randn(8, device=DEVICE, dtype=BF16)  # FA4 takes bf16 sinks too
        out, lse = fa.flash_attn_varlen_func(q, k, v, cu_q, None, max_q, None, seqused_k=seqused_k,
                                             page_table=table, learnable_sink=sink, num_splits=num_splits,
                                             return_lse=True, backend=backend, **masks)
        _check(out, lse, dict(masks, learnable_sink=sink), q=q, k=k, v=v, cu_seqlens_q=cu_q, seqused_k=seqused_k,
               page_table=table)
    else:  # decode, 32 query heads packed over 8 KV heads: the sink is per query head
        q, kc, vc = _randn(3, 1, 32, 128), _randn(3, 2048, 8, 128), _randn(3, 2048, 8, 128)
        seqlens = _i32([2048, 1, 0])  # a row with no key: out 0, lse = the sink
        sink = torch.randn(32, device=DEVICE)
        out, lse = fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, learnable_sink=sink, pack_gqa=True,
                                              num_splits=num_splits, return_lse=True, backend=backend, **masks)
        _check(out, lse, dict(masks, learnable_sink=sink), q=q, k=kc, v=vc, seqused_k=seqlens)
        assert torch.allclose(lse[2, :, 0], sink.float())


# ------------------------------------------------------------------------------ seqused_q

SEQUSED_LENS_K = (300, 64, 1000, 5)
SEQUSED_Q = (5, 0, 77, 3)  # rows used of each sequence's 80 (dense) or of its packed rows
SEQUSED_PACKED = (9, 4, 100, 3)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("layout", ["dense_q", "packed_q"])
def test_seqused_q(backend, layout, num_splits):
    # FA4's semantics: rows past seqused_q[b] are not computed (their output may be left
    # unwritten), and causal masking aligns the used rows with the sequence's last keys.
    fa = _api()
    torch.manual_seed(9)
    kc, vc = _randn(4, 1024, 2, 128), _randn(4, 1024, 2, 128)
    seqused_k, seqused_q = _i32(SEQUSED_LENS_K), _i32(SEQUSED_Q)
    sink = torch.randn(8, device=DEVICE)
    kw = dict(seqused_k=seqused_k, seqused_q=seqused_q, causal=True, learnable_sink=sink, num_splits=num_splits,
              return_lse=True, backend=backend)
    if layout == "dense_q":
        q = _randn(4, 80, 8, 128)
        out, lse = fa.flash_attn_varlen_func(q, kc, vc, out=_nan(q.shape), **kw)
        ref = [attention_serving_ref(q=q, k=kc, v=vc, seqused_q=seqused_q, seqused_k=seqused_k, causal=True,
                                     learnable_sink=sink, upcast=u) for u in (True, False)]
        rows = [(b, slice(0, n)) for b, n in enumerate(SEQUSED_Q)]
        pick_o, pick_l = (lambda t, b, r: t[b, r]), (lambda t, b, r: t[b, :, r])
    else:
        cu_q = _cu(SEQUSED_PACKED)
        q = _randn(sum(SEQUSED_PACKED), 8, 128)
        out, lse = fa.flash_attn_varlen_func(q, kc, vc, cu_q, None, max(SEQUSED_PACKED), None, out=_nan(q.shape),
                                             **kw)
        ref = [attention_serving_ref(q=q, k=kc, v=vc, cu_seqlens_q=cu_q, seqused_q=seqused_q, seqused_k=seqused_k,
                                     causal=True, learnable_sink=sink, upcast=u) for u in (True, False)]
        starts = cu_q.tolist()
        rows = [(None, slice(starts[b], starts[b] + n)) for b, n in enumerate(SEQUSED_Q)]
        pick_o, pick_l = (lambda t, b, r: t[r]), (lambda t, b, r: t[:, r])
    for b, r in rows:
        check_close(pick_o(out, b, r), pick_o(ref[0][0], b, r), pick_o(ref[1][0], b, r))
        check_lse(pick_l(lse, b, r), pick_l(ref[0][1], b, r), pick_l(ref[1][1], b, r))


# ------------------------------------------------------------------------------ batch invariance


def _decode_rows(lens, capacity=8192, seed=3, page_size=64):
    """A paged decode batch whose row 0 is always the same sequence (same q, keys, values)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    batch, pages_per_seq = len(lens), capacity // page_size
    q = torch.randn(batch, 1, 32, 128, device=DEVICE, generator=g).to(BF16)
    k = torch.randn(batch * pages_per_seq, page_size, 8, 128, device=DEVICE, generator=g).to(BF16)
    v = torch.randn(batch * pages_per_seq, page_size, 8, 128, device=DEVICE, generator=g).to(BF16)
    table = torch.arange(batch * pages_per_seq, device=DEVICE, dtype=torch.int32).view(batch, pages_per_seq)
    return q, k, v, table, _i32(lens)


def test_batch_invariant_decode_bitwise(backend):
    fa = _api()
    q0, k0, v0, t0, _ = _decode_rows([5000])
    results = []
    for others in ([], [300] * 5, [8000] * 63, [100, 7000, 2]):
        q, k, v, table, lens = _decode_rows([5000] + others, seed=4)
        q[0], k[: t0.shape[1]], v[: t0.shape[1]] = q0[0], k0, v0  # row 0 is the same sequence
        out, lse = fa.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, page_table=table, return_lse=True,
                                              batch_invariant=True, backend=backend)
        results.append((out[0].clone(), lse[0].clone()))
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])
    ref = [attention_serving_ref(q=q0, k=k0, v=v0, seqused_k=_i32([5000]), page_table=t0, upcast=u)[0][0]
           for u in (True, False)]
    check_close(results[0][0], *ref)


def test_batch_invariant_varlen_bitwise(backend):
    # A prefill chunk's rows in different mixed steps: bitwise the same.
    fa = _api()
    torch.manual_seed(5)
    q_x, k_x, v_x = _randn(200, 8, 128), _randn(1, 3000, 2, 128), _randn(1, 3000, 2, 128)
    outs = []
    for lens_q, lens_k in (([200], [3000]), ([1, 1, 200, 7], [50, 900, 3000, 64]), ([200] + [1] * 40,
                                                                                     [3000] + [6000] * 40)):
        x = lens_q.index(200)
        q = _randn(sum(lens_q), 8, 128)
        kc, vc = _randn(len(lens_k), 6000, 2, 128), _randn(len(lens_k), 6000, 2, 128)
        start = sum(lens_q[:x])
        q[start:start + 200] = q_x
        kc[x, :3000], vc[x, :3000] = k_x[0], v_x[0]
        out, lse = fa.flash_attn_varlen_func(q, kc, vc, _cu(lens_q), None, max(lens_q), None,
                                             seqused_k=_i32(lens_k), causal=True, return_lse=True,
                                             batch_invariant=True, backend=backend)
        outs.append((out[start:start + 200].clone(), lse[:, start:start + 200].clone()))
    for out, lse in outs[1:]:
        assert torch.equal(out, outs[0][0]) and torch.equal(lse, outs[0][1])


def test_batch_invariant_across_tiles(backend):
    # A decode row beside other decodes (decode-shaped tile) and beside a 600-query
    # prefill chunk (the prefill tile: other tile_m, warps, rows per CTA): the same bits,
    # since tile_n and the splits never depend on the batch and a row's arithmetic does
    # not depend on the tile's rows.
    fa = _api()
    torch.manual_seed(10)
    k, v = _randn(2 * 128, 64, 8, 128), _randn(2 * 128, 64, 8, 128)
    table = torch.arange(2 * 128, device=DEVICE, dtype=torch.int32).view(2, 128)
    q0 = _randn(1, 32, 128)
    outs = []
    for lens_q in ([1, 1], [1, 600]):
        q = torch.cat([q0, _randn(lens_q[1], 32, 128)])
        out, lse = fa.flash_attn_varlen_func(q, k, v, _cu(lens_q), None, max(lens_q), None,
                                             seqused_k=_i32([5000, 3000]), page_table=table, causal=True,
                                             return_lse=True, batch_invariant=True, backend=backend)
        outs.append((out[0].clone(), lse[:, 0].clone()))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_batch_invariant_mla_bitwise():
    fa = _api()
    from flash_attn_cute import seam

    cap = torch.cuda.get_device_capability()
    for name in sorted(seam.MLA_BACKENDS):
        if not seam.backend_module(name, "mla").runs_on(cap):
            continue
        g = torch.Generator(device=DEVICE).manual_seed(6)
        x_nope, x_pe = (torch.randn(1, 1, 64, n, device=DEVICE, generator=g).to(BF16) for n in (512, 64))
        x_ckv, x_kpe = (torch.randn(64, 64, n, device=DEVICE, generator=g).to(BF16) for n in (512, 64))
        outs = []
        for batch in (1, 9, 130):
            q_nope, q_pe = _randn(batch, 1, 64, 512), _randn(batch, 1, 64, 64)
            ckv, kpe = _randn(batch * 64, 64, 512), _randn(batch * 64, 64, 64)
            q_nope[0], q_pe[0], ckv[:64], kpe[:64] = x_nope[0], x_pe[0], x_ckv, x_kpe
            table = torch.arange(batch * 64, device=DEVICE, dtype=torch.int32).view(batch, 64)
            lens = _i32([4000] + [4096] * (batch - 1))
            out, lse = fa.flash_mla_decode(q_nope, q_pe, ckv, kpe, lens, table, return_lse=True,
                                           batch_invariant=True, backend=name)
            outs.append((out[0].clone(), lse[0].clone()))
        for out, lse in outs[1:]:
            assert torch.equal(out, outs[0][0]) and torch.equal(lse, outs[0][1]), name


# ------------------------------------------------------------------------------ any batch size

N_SEQS = 200_000


def test_200k_sequences_varlen_and_kvcache(backend):
    fa = _api()
    torch.manual_seed(7)
    # varlen: 200,000 sequences of 1 query and 3 keys (an embedding-style workload)
    q, k, v = _randn(N_SEQS, 2, 64), _randn(3 * N_SEQS, 1, 64), _randn(3 * N_SEQS, 1, 64)
    cu_q, cu_k = torch.arange(N_SEQS + 1, device=DEVICE, dtype=torch.int32), \
        torch.arange(0, 3 * N_SEQS + 1, 3, device=DEVICE, dtype=torch.int32)
    out, lse = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 1, 3, return_lse=True, backend=backend)
    ref = [_dense_ref(q.view(N_SEQS, 1, 2, 64), k.view(N_SEQS, 3, 1, 64), v.view(N_SEQS, 3, 1, 64), u)
           for u in (True, False)]
    check_close(out.view(N_SEQS, 1, 2, 64), ref[0][0], ref[1][0])
    check_lse(lse.view(2, N_SEQS, 1).transpose(0, 1), ref[0][1], ref[1][1])
    # kvcache decode: batch 200,000 (x 2 heads: past a 65,535 grid dimension either way)
    kc, vc = _randn(N_SEQS, 16, 1, 64), _randn(N_SEQS, 16, 1, 64)
    qd = _randn(N_SEQS, 1, 2, 64)
    lens = torch.randint(1, 17, (N_SEQS,), device=DEVICE, dtype=torch.int32)
    out = fa.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens, backend=backend)
    mask = torch.arange(16, device=DEVICE)[None, :] < lens[:, None]
    ref = [_dense_ref(qd, kc, vc, u, key_mask=mask)[0] for u in (True, False)]
    check_close(out, *ref)


def _dense_ref(q, k, v, upcast, key_mask=None):
    """Batched attention without a per-sequence loop (200,000 sequences)."""
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q * q.shape[-1] ** -0.5, k).float()
    if key_mask is not None:
        s = s.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None])
    return torch.einsum("bhqk,bkhd->bqhd", p.to(v.dtype), v), lse


def test_200k_sequences_mla():
    fa = _api()
    from flash_attn_cute import seam

    cap = torch.cuda.get_device_capability()
    torch.manual_seed(8)
    q_nope, q_pe = _randn(N_SEQS, 1, 16, 512), _randn(N_SEQS, 1, 16, 64)
    ckv, kpe = _randn(N_SEQS, 4, 512), _randn(N_SEQS, 4, 64)  # one 4-token page per sequence
    table = torch.arange(N_SEQS, device=DEVICE, dtype=torch.int32).view(N_SEQS, 1)
    lens = torch.randint(1, 5, (N_SEQS,), device=DEVICE, dtype=torch.int32)
    for name in sorted(seam.MLA_BACKENDS):
        if not seam.backend_module(name, "mla").runs_on(cap):
            continue
        out = fa.flash_mla_decode(q_nope, q_pe, ckv, kpe, lens, table, backend=name)
        q = torch.cat([q_nope, q_pe], -1)
        k = torch.cat([ckv, kpe], -1)[:, :, None]
        mask = torch.arange(4, device=DEVICE)[None, :] < lens[:, None]
        for rows in (slice(0, 1000), slice(N_SEQS - 1000, N_SEQS)):  # both ends of the folded grid
            ref = [_mla_rows(q[rows], k[rows], ckv[rows, :, None], mask[rows], u) for u in (True, False)]
            check_close(out[rows], *ref)


def _mla_rows(q, k, v, mask, upcast):
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    s = torch.einsum("bqhd,bkhd->bhqk", q * 576 ** -0.5, k.expand(-1, -1, q.shape[2], -1)).float()
    s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
    p = torch.softmax(s, -1)
    return torch.einsum("bhqk,bkhd->bqhd", p.to(v.dtype), v.expand(-1, -1, q.shape[2], -1))


# ------------------------------------------------------------------------------ compile keys


def serving_problems():
    """(FwdProblem, num_splits, pack_gqa) of this file's forward calls, as the public API
    describes them (bf16; ``max_seqlen_k`` the cache capacity where the lengths live on
    the device)."""
    from flash_attn_cute import interface, seam

    def problem(batch, sq, sk, h, hk, d, mask=None, *, varlen_q=False, varlen_k=False, seqused_k=True, page_size=0,
                lse=True, sink=False, seqused_q=False, invariant=False):
        mask = mask or {}
        causal, left, right = interface.normalize_window(mask.get("causal", False), mask.get("window_size", (-1, -1)))
        return seam.FwdProblem(
            dtype=BF16, batch=batch, max_seqlen_q=sq, max_seqlen_k=sk, nheads=h, nheads_kv=hk, d=d, d_v=d,
            softmax_scale=d ** -0.5, causal=causal, window_left=left, window_right=right,
            softcap=mask.get("softcap", 0.0), varlen_q=varlen_q, varlen_k=varlen_k, has_seqused_k=seqused_k,
            page_size=page_size, has_lse=lse, has_seqused_q=seqused_q, has_sink=sink, batch_invariant=invariant)

    def step(page_size, **kw):  # _paged_step's call
        cap = math.ceil(max(LENS_K) / page_size) * page_size
        return problem(len(LENS_Q), max(LENS_Q), cap, kw.pop("h", 8), kw.pop("hk", 2), 128, kw.pop("mask", None),
                       varlen_q=True, page_size=page_size, **kw)

    out = []
    for page_size in (1, 16, 64, 128, 256):
        for mask in ("causal", "local", "softcap"):
            for ns in ((1, 0, 3) if mask == "causal" else (1,)):
                out += [(step(page_size, mask=MASKS[mask], lse=lse), ns, None) for lse in (True, False)]
    out += [(step(64, h=32, hk=8, mask=MASKS["causal"], lse=False), 0, pack) for pack in (None, True)]
    dense = dict(mask=dict(causal=True))
    out += [(problem(4, 5, 64, 4, 2, 64, **dense), 1, None),
            (problem(4, 5, 64, 4, 2, 64, varlen_q=True, **dense), 1, None),
            (problem(4, 5, 64, 4, 2, 64, varlen_q=True, varlen_k=True, **dense), 1, None)]
    sink_masks = {"none": {}, "causal": dict(causal=True), "local_softcap": dict(causal=True, window_size=(50, 0),
                                                                               softcap=15.0)}
    for mask in sink_masks.values():
        for ns in (1, 3):
            out += [(problem(2, 77, 300, 4, 2, 128, mask, seqused_k=False, sink=True), ns, None),
                    (step(16, mask=mask, sink=True), ns, None),
                    (problem(3, 1, 2048, 32, 8, 128, mask, sink=True), ns, True)]
    for ns in (1, 3):
        out += [(problem(4, 80, 1024, 8, 2, 128, dict(causal=True), sink=True, seqused_q=True), ns, None),
                (problem(4, max(SEQUSED_PACKED), 1024, 8, 2, 128, dict(causal=True), varlen_q=True, sink=True,
                         seqused_q=True), ns, None)]
    for batch in (1, 6, 64, 4):  # batch invariance: decode over 64-token pages, then varlen over a batch cache
        out.append((problem(batch, 1, 8192, 32, 8, 128, page_size=64, invariant=True), 0, None))
    for lens_q in ([200], [1, 1, 200, 7], [200] + [1] * 40):
        out.append((problem(len(lens_q), 200, 6000, 8, 2, 128, dict(causal=True), varlen_q=True, invariant=True), 1,
                    None))
    for max_q in (1, 600):  # a decode row beside decodes, then beside a prefill chunk
        out.append((problem(2, max_q, 8192, 32, 8, 128, dict(causal=True), varlen_q=True, page_size=64,
                            invariant=True), 1, None))
    out += [(problem(N_SEQS, 1, 3, 2, 1, 64, varlen_q=True, varlen_k=True, seqused_k=False), 1, None),
            (problem(N_SEQS, 1, 16, 2, 1, 64, lse=False), 0, None)]
    return out


def compile_keys(backend="sm80", arch="sm_90a", num_sms=132):
    """(forward keys, combine keys) of ``serving_problems`` on ``backend`` for ``arch`` (as
    ``test_flash_attn_gpu.compile_keys``); calls the backend refuses are left out."""
    from flash_attn_cute import seam
    from flash_attn_cute.host.keys import DTYPE_NAMES, combine_key

    module = seam.backend_module(backend)
    keys, comb = set(), set()
    for problem, num_splits, pack_gqa in serving_problems():
        if module.check(problem) is not None:
            continue
        plan = module.plan(problem, num_splits, pack_gqa, num_sms)
        keys.add(module.compile_key(problem, plan, arch))
        if plan.is_split:
            comb.add(combine_key(DTYPE_NAMES[problem.dtype], problem.d_v, problem.has_lse, arch, problem.has_sink))
    return keys, comb
