"""GPU tests of ``flash_mla_decode`` against the fp32 reference (``testing.mla_decode_ref``:
pages gathered, K = [ckv, kpe] and V = ckv materialised), once per MLA backend that runs
on the device.

Compile budget: the SM80 key is (dtype, heads, causal, split, lse); page size, lengths,
batch and the number of splits are runtime values. So each case below sweeps page sizes
and ragged lengths inside one key, and the keys are a curated list (16/32/64/128 heads
once, causal x split x lse on 64 heads, fp16 on 128 heads; then each other head count of
FlashMLA's tests once, KV heads, FP8 and batch invariance over them, FlashMLA's views).
``out=`` is poisoned with NaN so a row the kernel forgets fails; the allocate path must
then be bit-identical. The SM90 key adds the consumers' Q K^T mode
(FLASH_ATTN_CUTE_MLA_SM90_QK: "seesaw", the default, "one" or "split"; run the file once
per mode to test each).
"""

import math
import os

import pytest
import torch

from flash_attn_cute.sm90.config import TMA_MODES
from flash_attn_cute.testing import backends_on_this_gpu, check_close, check_lse, mla_decode_ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(params=backends_on_this_gpu("mla"))
def backend(request):
    return request.param


def make_inputs(seqlens, nheads, page_size, seqlen_q=1, dtype=torch.bfloat16, seed=0, spare_pages=3, nheads_kv=None,
                jumps=False):
    """Gaussian inputs; a shuffled pool with spare pages (the table is a strided view of
    a wider one), capacity one page above the longest sequence. ``nheads_kv``: caches with
    a KV-head mode, (num_pages, page_size, nheads_kv, d) (None: the 3-D latent caches).
    ``jumps``: each sequence's first page 6x and middle page 3x larger, so that a row max
    rises far (by ~2^16 and ~2^8) where the kernels reach them: tiles go from the end down."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    batch = len(seqlens)
    max_pages = max(1, math.ceil(max(seqlens) / page_size)) + 1
    num_pages = batch * max_pages + spare_pages
    randn = lambda *s: torch.randn(*s, generator=g, device="cuda").to(dtype)
    q_nope, q_pe = randn(batch, seqlen_q, nheads, 512), randn(batch, seqlen_q, nheads, 64)
    heads = () if nheads_kv is None else (nheads_kv,)
    ckv, kpe = randn(num_pages, page_size, *heads, 512), randn(num_pages, page_size, *heads, 64)
    perm = torch.randperm(num_pages, generator=g, device="cuda")[: batch * max_pages].to(torch.int32)
    wide = torch.full((batch, max_pages + 5), -7, dtype=torch.int32, device="cuda")
    wide[:, :max_pages] = perm.view(batch, max_pages)
    page_table = wide[:, :max_pages]  # row stride max_pages + 5
    cache_seqlens = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    if jumps:
        for b, n in enumerate(seqlens):
            for idx, factor in ((0, 6.0), (max(1, math.ceil(n / page_size)) // 2, 3.0)):
                page = page_table[b, idx].long()
                ckv[page] *= factor
                kpe[page] *= factor
    return q_nope, q_pe, ckv, kpe, cache_seqlens, page_table


def run_and_check(backend, inputs, *, causal=False, num_splits=1, return_lse=False):
    import flash_attn_cute

    q_nope = inputs[0]
    out = torch.full(q_nope.shape, float("nan"), dtype=q_nope.dtype, device="cuda")
    res = flash_attn_cute.flash_mla_decode(*inputs, causal=causal, num_splits=num_splits, return_lse=return_lse,
                                           out=out, backend=backend)
    out_ref, lse_ref = mla_decode_ref(*inputs, causal=causal)
    out_pt, lse_pt = mla_decode_ref(*inputs, causal=causal, upcast=False)
    if return_lse:
        assert res[0] is out
        assert res[1].shape == (q_nope.shape[0], q_nope.shape[2], q_nope.shape[1])  # (batch, nheads, seqlen_q)
        check_lse(res[1], lse_ref, lse_pt)
    else:
        assert res is out
    check_close(out, out_ref, out_pt)
    again = flash_attn_cute.flash_mla_decode(*inputs, causal=causal, num_splits=num_splits, return_lse=return_lse,
                                             backend=backend)
    again = again[0] if return_lse else again
    assert torch.equal(again, out), "allocate path differs from out= path"


SEQLENS = (1, 77, 300, 33)  # 1, not multiples of the page or 32-key tile, one multiple of 33


@pytest.mark.parametrize("nheads", [16, 32, 64, 128])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_mla_heads_pages(backend, nheads, page_size):
    run_and_check(backend, make_inputs(SEQLENS, nheads, page_size))


# 192: three 64-key tiles a page (the TMA loader's FastDivmod by a divisor not a power of two).
@pytest.mark.parametrize("page_size", [32, 128, 192])
def test_mla_more_pages(backend, page_size):
    run_and_check(backend, make_inputs((129, 1, 512), 64, page_size, seed=1))


@pytest.mark.parametrize("seqlen_q", [1, 2])
@pytest.mark.parametrize("num_splits", [1, 3, 0])
@pytest.mark.parametrize("page_size", [1, 64])
def test_mla_causal_splits_lse(backend, seqlen_q, num_splits, page_size):
    run_and_check(backend, make_inputs((2, 1000, 65, 1), 64, page_size, seqlen_q=seqlen_q, seed=2),
                  causal=True, num_splits=num_splits, return_lse=True)


@pytest.mark.parametrize("num_splits", [1, 0])
def test_mla_fp16_128_heads(backend, num_splits):
    run_and_check(backend, make_inputs((3, 700, 2048), 128, 16, seqlen_q=2, dtype=torch.float16, seed=3),
                  causal=True, num_splits=num_splits, return_lse=True)


def test_mla_split_many_empty_and_long(backend):
    # 16 heads, 7 splits: some splits of the short sequences hold no key (-inf partials);
    # a zero-length sequence gives out 0 and lse -inf.
    run_and_check(backend, make_inputs((0, 5, 4097), 16, 16, seed=4), num_splits=7, return_lse=True)


def test_mla_clamps_bad_lengths_and_pages(backend):
    # Out-of-range lengths and page ids must not fault; the result is the clamped one.
    import flash_attn_cute

    q_nope, q_pe, ckv, kpe, seqlens, table = make_inputs((40, 64), 32, 16, seed=5)
    bad = table.clone()
    bad[0, 0] = 10**6
    bad[1, 1] = -5
    long = torch.tensor([10**7, 64], dtype=torch.int32, device="cuda")
    out = flash_attn_cute.flash_mla_decode(q_nope, q_pe, ckv, kpe, long, bad, backend=backend)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()


def poison_past_the_end(ckv, kpe, seqlens, table, value=float("nan")):
    """Copies of the caches with ``value`` in every row past each sequence's end (the rest of
    its last page and its spare pages): a kernel must mask or zero them (P = 0 times NaN
    would poison O). FP8 caches: pass byte views and a byte (0x7F: NaN in e4m3)."""
    page = ckv.shape[1]
    ckv_bad, kpe_bad = ckv.clone(), kpe.clone()
    for b, n in enumerate(seqlens.tolist()):
        for t in range(n, table.shape[1] * page):
            ckv_bad[table[b, t // page], t % page] = value
            kpe_bad[table[b, t // page], t % page] = value
    return ckv_bad, kpe_bad


def test_mla_nan_past_the_end(backend):
    # Cache rows past each sequence's end (the rest of its last page and its spare page)
    # hold NaN (``poison_past_the_end``).
    import flash_attn_cute

    inputs = make_inputs((5, 70, 33), 64, 16, seed=6)
    q_nope, q_pe, ckv, kpe, seqlens, table = inputs
    out_ref, _ = mla_decode_ref(*inputs)
    out_pt, _ = mla_decode_ref(*inputs, upcast=False)
    ckv_bad, kpe_bad = poison_past_the_end(ckv, kpe, seqlens, table)
    out = flash_attn_cute.flash_mla_decode(q_nope, q_pe, ckv_bad, kpe_bad, seqlens, table, backend=backend)
    check_close(out, out_ref, out_pt)


# ---------------------------------------------------------------------------------------
# FP8 latent cache (e4m3 / e5m2 with kv_descale): the reference runs on the dequantized
# values (``mla_decode_ref(kv_descale=)``), PyTorch's own error on the same values in q's
# dtype. Compile keys: the dtype field "bf16/e4m3" (one key per case below).
# ---------------------------------------------------------------------------------------


def fp8_inputs(seqlens, nheads, page_size, *, seqlen_q=1, dtype=torch.bfloat16, fp8=torch.float8_e4m3fn, seed=10,
               per_batch=False, nheads_kv=None, jumps=False):
    """``make_inputs`` with the caches quantized: one scale for ckv and kpe together (the
    576 values of a token, as vLLM stores them), or (``per_batch``) a descale per sequence
    (the pool quantized once, each sequence's descale a power of two apart from it), per
    (sequence, KV head) with ``nheads_kv`` (FA3's (batch, nheads_kv))."""
    from flash_attn_cute import quantize_fp8

    q_nope, q_pe, ckv, kpe, seqlens_t, table = make_inputs(seqlens, nheads, page_size, seqlen_q=seqlen_q, dtype=dtype,
                                                           seed=seed, nheads_kv=nheads_kv, jumps=jumps)
    if nheads_kv is None:
        both, descale = quantize_fp8(torch.cat([ckv, kpe], -1).unsqueeze(2), granularity="tensor", dtype=fp8)
        ckv8, kpe8 = both[..., 0, :512].contiguous(), both[..., 0, 512:].contiguous()
    else:
        both, descale = quantize_fp8(torch.cat([ckv, kpe], -1), granularity="tensor", dtype=fp8)
        ckv8, kpe8 = both[..., :512].contiguous(), both[..., 512:].contiguous()
    if per_batch:
        cols = 1 if nheads_kv is None else nheads_kv
        factors = [[2.0 ** ((i + j) % 3 - 1) for j in range(cols)] for i in range(len(seqlens))]
        descale = descale * torch.tensor(factors, device="cuda")
        descale = descale[:, 0] if nheads_kv is None else descale
    return (q_nope, q_pe, ckv8, kpe8, seqlens_t, table), descale.float()


def fp8_wgmma(backend, ckv):
    """Whether the kernel planned for this FP8 cache runs fp8 wgmma with the queries
    quantized in the kernel (``sm90.mla.uses_tma``: the SM90 TMA kernel, an e4m3 cache in
    pages of a multiple of 64, FLASH_ATTN_CUTE_MLA_SM90_QK unset or a TMA mode); else the
    cache is widened to 16 bits."""
    sm90 = backend == "sm90" or (backend is None and torch.cuda.get_device_capability()[0] == 9)
    return (sm90 and ckv.dtype == torch.float8_e4m3fn and ckv.shape[1] % 64 == 0
            and os.environ.get("FLASH_ATTN_CUTE_MLA_SM90_QK", "tma") in TMA_MODES)


# The fp8 wgmma kernel rounds P against its running row max, PyTorch's FP8 algorithm
# against the final one: the same error per value, drawn differently (as the FP8 forward's
# tests, test_fp8_attention_gpu.MULT).
FP8_WGMMA_MULT = 3.0


def check_fp8(backend, inputs, kv_descale, out, lse, *, causal=False):
    """An FP8 cache's result against the fp32 reference on the dequantized cache. Widened
    to 16 bits: within 2x PyTorch's own error on the same values in q's dtype. fp8 wgmma
    (``fp8_wgmma``): against the reference on the queries the kernel quantizes, within 3x
    PyTorch's FP8 algorithm there (P rounded to e4m3); against the unquantized queries,
    within 3x that algorithm's distance from them (the error quantizing q costs). The LSE
    on the quantized queries within 2x PyTorch's bf16 error on the unquantized ones (bf16
    on the quantized queries is almost exact: e4m3 values and their power-of-two scale fit
    bf16, while fp8 wgmma accumulates the 576 products in fewer bits than fp32, 2-4e-3 in
    the LSE measured on an H100), and against the unquantized reference within 3x the
    distance of PyTorch's bf16 LSE on the quantized queries from it."""
    ref = lambda **kw: mla_decode_ref(*inputs, causal=causal, kv_descale=kv_descale, **kw)
    out_ref, lse_ref = ref()
    _, lse_pt = ref(upcast=False)
    if not fp8_wgmma(backend, inputs[2]):
        if lse is not None:
            check_lse(lse, lse_ref, lse_pt)
        check_close(out, out_ref, ref(upcast=False)[0])
        return
    out_ref_q, lse_ref_q = ref(quantize_q=True)
    out_alg, _ = ref(quantize_q=True, p_fp8=True)
    check_close(out, out_ref_q, out_alg, mult=FP8_WGMMA_MULT)
    check_close(out, out_ref, out_alg, mult=FP8_WGMMA_MULT, name="out (unquantized q)")
    if lse is not None:
        check_lse(lse, lse_ref_q, lse_pt)
        lse_alg = ref(quantize_q=True, upcast=False)[1]
        check_lse(lse, lse_ref, lse_alg, mult=FP8_WGMMA_MULT, name="lse (unquantized q)")


def run_and_check_fp8(backend, inputs, kv_descale, *, causal=False, num_splits=1, return_lse=False):
    import flash_attn_cute

    q_nope = inputs[0]
    out = torch.full(q_nope.shape, float("nan"), dtype=q_nope.dtype, device="cuda")
    res = flash_attn_cute.flash_mla_decode(*inputs, causal=causal, num_splits=num_splits, return_lse=return_lse,
                                           out=out, backend=backend, kv_descale=kv_descale)
    check_fp8(backend, inputs, kv_descale, out, res[1] if return_lse else None, causal=causal)


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_mla_fp8_pages(backend, page_size):
    inputs, descale = fp8_inputs(SEQLENS + (1000,), 64, page_size)
    run_and_check_fp8(backend, inputs, descale)


@pytest.mark.parametrize("num_splits", [3, 0])
def test_mla_fp8_causal_splits_per_batch_descale(backend, num_splits):
    inputs, descale = fp8_inputs((2, 1000, 65, 1), 64, 64, seqlen_q=2, seed=11, per_batch=True)
    run_and_check_fp8(backend, inputs, descale, causal=True, num_splits=num_splits, return_lse=True)


def test_mla_fp8_e5m2_fp16_16_heads_default_descale(backend):
    # No kv_descale: 1.0. e5m2 values of a unit-scale Gaussian stay in range unscaled.
    import flash_attn_cute

    q_nope, q_pe, ckv, kpe, seqlens, table = make_inputs((300, 33, 4097), 16, 16, dtype=torch.float16, seed=12)
    inputs = (q_nope, q_pe, ckv.to(torch.float8_e5m2), kpe.to(torch.float8_e5m2), seqlens, table)
    out = flash_attn_cute.flash_mla_decode(*inputs, backend=backend, num_splits=0)
    check_close(out, mla_decode_ref(*inputs)[0], mla_decode_ref(*inputs, upcast=False)[0])


@pytest.mark.parametrize("page_size", [16, 64])
def test_mla_fp8_nan_past_the_end(backend, page_size):
    # FP8 cache bytes past each sequence's end are NaN (0x7f in e4m3): never read into a
    # score (pages of 64, fp8 wgmma: tile 0's tail zeroed as V is transposed).
    import flash_attn_cute

    inputs, descale = fp8_inputs((5, 70, 33, 129), 64, page_size, seed=13)
    q_nope, q_pe, ckv, kpe, seqlens, table = inputs
    ckv_bad, kpe_bad = poison_past_the_end(ckv.view(torch.uint8), kpe.view(torch.uint8), seqlens, table, 0x7F)
    for splits in (1, 2):
        out = flash_attn_cute.flash_mla_decode(q_nope, q_pe, ckv_bad.view(ckv.dtype), kpe_bad.view(kpe.dtype),
                                               seqlens, table, backend=backend, kv_descale=descale, num_splits=splits)
        check_fp8(backend, inputs, descale, out, None)


def test_mla_fp8_split_many_empty_and_long(backend):
    # An FP8 cache with a zero-length sequence (out 0, lse -inf) and splits holding no key:
    # CTAs without tiles still look their first gather's page up (key 0, never past the table).
    inputs, descale = fp8_inputs((0, 5, 4097), 16, 16, seed=14)
    run_and_check_fp8(backend, inputs, descale, num_splits=7, return_lse=True)


# ---------------------------------------------------------------------------------------
# Any head count (1..128), KV heads (FlashMLA's h_kv) and FlashMLA's combined 576 layout.
# The kernels pack a KV head's query heads x query positions into 64-row tiles and
# predicate the last one: 3, 9, 24 or 100 heads at seqlen_q 2 put two query positions in
# one tile (each row's causal limit its own), 100 and 126 heads a partial second tile.
# Compile keys: (dtype, heads, causal, split, lse) per case; the page size, lengths and
# split count are runtime values, so each case mixes them.
# ---------------------------------------------------------------------------------------

SEQLENS_HEADS = (1, 77, 300, 1000)  # a sequence of 1 key: with seqlen_q 2 causal, query 0 sees none
# (nheads, page_size, seqlen_q, causal, num_splits, return_lse)
HEAD_CASES = [
    (1, 1, 2, True, 0, True), (3, 16, 2, True, 3, True), (4, 64, 1, False, 1, False), (8, 16, 1, False, 0, True),
    (8, 64, 2, True, 1, True), (9, 1, 2, True, 3, True), (16, 16, 2, True, 0, True), (24, 64, 2, True, 3, True),
    (63, 32, 1, False, 3, True), (64, 1, 2, True, 1, False), (100, 16, 2, True, 3, True),
    (100, 128, 1, False, 0, False), (126, 1, 2, True, 0, True), (128, 64, 2, True, 3, True),
]


@pytest.mark.parametrize("nheads,page_size,seqlen_q,causal,num_splits,return_lse", HEAD_CASES)
def test_mla_any_head_count(backend, nheads, page_size, seqlen_q, causal, num_splits, return_lse):
    run_and_check(backend, make_inputs(SEQLENS_HEADS, nheads, page_size, seqlen_q=seqlen_q, seed=20 + nheads),
                  causal=causal, num_splits=num_splits, return_lse=return_lse)


def test_mla_odd_heads_fp16(backend):
    run_and_check(backend, make_inputs((5, 700, 2048), 9, 16, seqlen_q=2, dtype=torch.float16, seed=21),
                  causal=True, num_splits=0, return_lse=True)


# (nheads, nheads_kv, page_size, seqlen_q, causal, num_splits, return_lse): 4, 16, 32, 3 and 1
# query heads per KV head (1: the unpacked row path; 3 at seqlen_q 2: positions share a tile).
KV_HEAD_CASES = [
    (8, 2, 16, 1, False, 0, True), (64, 4, 64, 2, True, 3, True), (128, 4, 1, 2, True, 0, True),
    (6, 2, 64, 2, True, 1, False), (4, 4, 16, 2, True, 3, True),
]


@pytest.mark.parametrize("nheads,nheads_kv,page_size,seqlen_q,causal,num_splits,return_lse", KV_HEAD_CASES)
def test_mla_kv_heads(backend, nheads, nheads_kv, page_size, seqlen_q, causal, num_splits, return_lse):
    run_and_check(backend, make_inputs(SEQLENS_HEADS, nheads, page_size, seqlen_q=seqlen_q, seed=40 + nheads,
                                       nheads_kv=nheads_kv),
                  causal=causal, num_splits=num_splits, return_lse=return_lse)


def test_mla_kv_heads_nan_past_the_end(backend):
    # Each KV head's rows past a sequence's end hold NaN (the 4-D pool): masked, never in O.
    import flash_attn_cute

    inputs = make_inputs((5, 70, 33), 16, 16, seed=41, nheads_kv=2)
    q_nope, q_pe, ckv, kpe, seqlens, table = inputs
    out_ref, _ = mla_decode_ref(*inputs)
    out_pt, _ = mla_decode_ref(*inputs, upcast=False)
    ckv_bad, kpe_bad = poison_past_the_end(ckv, kpe, seqlens, table)
    out = flash_attn_cute.flash_mla_decode(q_nope, q_pe, ckv_bad, kpe_bad, seqlens, table, backend=backend)
    check_close(out, out_ref, out_pt)


# FP8 latent caches with any head count and with KV heads (descale per sequence, or per
# (sequence, KV head): FA3's (batch, nheads_kv)).
@pytest.mark.parametrize("nheads,nheads_kv,page_size,seqlen_q,causal,num_splits", [
    (8, None, 64, 2, True, 0), (100, None, 16, 1, False, 3), (3, None, 1, 2, True, 1), (16, 2, 16, 2, True, 3),
    (8, 4, 64, 1, False, 0)])
def test_mla_fp8_any_heads_and_kv_heads(backend, nheads, nheads_kv, page_size, seqlen_q, causal, num_splits):
    inputs, descale = fp8_inputs(SEQLENS_HEADS, nheads, page_size, seqlen_q=seqlen_q, seed=50 + nheads,
                                 per_batch=True, nheads_kv=nheads_kv)
    run_and_check_fp8(backend, inputs, descale, causal=causal, num_splits=num_splits, return_lse=True)


@pytest.mark.parametrize("nheads,nheads_kv,page,fp8", [(24, None, 16, False), (8, 2, 16, False),
                                                      (64, None, 64, False), (64, None, 64, True)])
def test_mla_batch_invariant_any_heads_bitwise(backend, nheads, nheads_kv, page, fp8):
    # One sequence of 4500 keys (two splits of 4096) in batches of 1, 3 and 40 (the others of
    # other lengths): bitwise the same output and LSE (fixed keys per split), and close to
    # the reference. Pages of 64: the SM90 TMA kernel (an e4m3 cache: fp8 wgmma, q quantized
    # per tile of one sequence's heads, so still invariant).
    import flash_attn_cute

    heads = () if nheads_kv is None else (nheads_kv,)
    g = torch.Generator(device="cuda").manual_seed(60 + nheads)
    randn = lambda *s: torch.randn(*s, generator=g, device="cuda").to(torch.bfloat16)
    pages_per_seq = 5120 // page  # capacity 5120: the same two splits in every batch
    x = (randn(1, 2, nheads, 512), randn(1, 2, nheads, 64), randn(pages_per_seq, page, *heads, 512),
         randn(pages_per_seq, page, *heads, 64))
    outs = []
    for batch in (1, 3, 40):
        q_nope, q_pe = randn(batch, 2, nheads, 512), randn(batch, 2, nheads, 64)
        ckv, kpe = randn(batch * pages_per_seq, page, *heads, 512), randn(batch * pages_per_seq, page, *heads, 64)
        q_nope[:1], q_pe[:1], ckv[:pages_per_seq], kpe[:pages_per_seq] = x
        if fp8:
            ckv, kpe = ckv.to(torch.float8_e4m3fn), kpe.to(torch.float8_e4m3fn)
        table = torch.arange(batch * pages_per_seq, device="cuda", dtype=torch.int32).view(batch, pages_per_seq)
        lens = torch.tensor([4500] + [(977 * i) % 5120 + 1 for i in range(1, batch)], dtype=torch.int32,
                            device="cuda")
        inputs = (q_nope, q_pe, ckv, kpe, lens, table)
        out, lse = flash_attn_cute.flash_mla_decode(*inputs, causal=True, return_lse=True, batch_invariant=True,
                                                    backend=backend)
        if batch == 3 and fp8:
            check_fp8(backend, inputs, None, out, lse, causal=True)
        elif batch == 3:
            check_close(out, mla_decode_ref(*inputs, causal=True)[0], mla_decode_ref(*inputs, causal=True,
                                                                                      upcast=False)[0])
        outs.append((out[0].clone(), lse[0].clone()))
    for out, lse in outs[1:]:
        assert torch.equal(out, outs[0][0]) and torch.equal(lse, outs[0][1])


@pytest.mark.parametrize("nheads,nheads_kv,page_size,seqlen_q", [(16, 1, 64, 2), (8, 2, 16, 1), (128, 1, 1, 1)])
def test_mla_flashmla_layout_views(backend, nheads, nheads_kv, page_size, seqlen_q):
    # FlashMLA's combined layout: q (b, s_q, h, 576) and one k_cache (num_pages, page_size,
    # h_kv, 576), passed as views q[..., :512], q[..., 512:], k_cache[..., :512],
    # k_cache[..., 512:] (no copies): right against the reference, and bitwise the result of
    # the same call on contiguous copies.
    import flash_attn_cute

    q_nope, q_pe, ckv, kpe, lens, table = make_inputs(SEQLENS_HEADS, nheads, page_size, seqlen_q=seqlen_q,
                                                      seed=70 + nheads, nheads_kv=nheads_kv)
    q, k_cache = torch.cat([q_nope, q_pe], -1), torch.cat([ckv, kpe], -1)
    views = (q[..., :512], q[..., 512:], k_cache[..., :512], k_cache[..., 512:])
    assert views[0].data_ptr() == q.data_ptr() and views[3].data_ptr() == k_cache.data_ptr() + 512 * 2
    run_and_check(backend, (*views, lens, table), causal=seqlen_q > 1, num_splits=0, return_lse=True)
    out = flash_attn_cute.flash_mla_decode(*views, lens, table, causal=seqlen_q > 1, backend=backend)
    copies = tuple(t.contiguous() for t in views)
    assert torch.equal(out, flash_attn_cute.flash_mla_decode(*copies, lens, table, causal=seqlen_q > 1,
                                                             backend=backend))


@pytest.mark.parametrize("nheads_kv", [1, 2])
def test_mla_fp8_flashmla_layout_views(backend, nheads_kv):
    # One 576-wide e4m3 cache (num_pages, page_size, h_kv, 576) read as its two views.
    inputs, descale = fp8_inputs(SEQLENS_HEADS, 16, 64, seqlen_q=2, seed=80, nheads_kv=nheads_kv)
    q_nope, q_pe, ckv8, kpe8, lens, table = inputs
    k_cache = torch.cat([ckv8.view(torch.uint8), kpe8.view(torch.uint8)], -1).view(ckv8.dtype)
    views = (k_cache[..., :512], k_cache[..., 512:])
    assert views[1].data_ptr() == k_cache.data_ptr() + 512
    run_and_check_fp8(backend, (q_nope, q_pe, *views, lens, table), descale, causal=True, num_splits=0,
                      return_lse=True)


# ---------------------------------------------------------------------------------------
# The SM90 TMA kernel (sm90/mla_decode_tma.py: pages of a multiple of 64 keys, 16-bit
# caches). Its schedule has a full step per pair of 64-key tiles and tails for the last
# one to three tiles of either warpgroup: lengths of 1 to 9 tiles (each split's share with
# num_splits 3), a tile cut by the sequence end (rows past it NaN in the page), pages of
# 64, 128 and 256 (a tile is one of a page's 64-key sub-blocks). The same cases run the
# gathering kernel at page 64 (FLASH_ATTN_CUTE_MLA_SM90_QK=seesaw), and both are checked
# against the reference; on SM80 they run the SM80 kernel.
# ---------------------------------------------------------------------------------------

TILE_SEQLENS = (1, 64, 65, 128, 190, 256, 257, 385, 449, 576)  # 1 to 9 tiles of 64 keys


@pytest.mark.parametrize("page_size", [64, 128, 256])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("knob", [None, "seesaw", "tma"])  # None: "tma_lag" over bf16, "tma" over e4m3
@pytest.mark.parametrize("fp8", [False, True])
def test_mla_tma_tile_counts(backend, page_size, num_splits, knob, fp8, monkeypatch):
    # fp8: the e4m3 cache in fp8 wgmma (or widened by the gathering kernel: the knob),
    # per-batch descales.
    if knob:
        monkeypatch.setenv("FLASH_ATTN_CUTE_MLA_SM90_QK", knob)
    if fp8:
        inputs, descale = fp8_inputs(TILE_SEQLENS, 64, page_size, seed=110 + page_size, per_batch=True)
        run_and_check_fp8(backend, inputs, descale, num_splits=num_splits, return_lse=True)
    else:
        run_and_check(backend, make_inputs(TILE_SEQLENS, 64, page_size, seed=90 + page_size), num_splits=num_splits,
                      return_lse=True)


@pytest.mark.parametrize("nheads,seqlen_q,page_size", [(16, 2, 64), (128, 2, 128), (100, 1, 64), (8, 2, 256)])
def test_mla_tma_causal_heads(backend, nheads, seqlen_q, page_size):
    run_and_check(backend, make_inputs(TILE_SEQLENS, nheads, page_size, seqlen_q=seqlen_q, seed=95 + nheads),
                  causal=True, num_splits=0, return_lse=True)


@pytest.mark.parametrize("knob", [None, "tma", "tma_runs", "tma_lag"])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("causal,seqlen_q,num_splits", [(False, 1, 1), (True, 2, 3)])
def test_mla_tma_max_jumps(backend, knob, fp8, causal, seqlen_q, num_splits, monkeypatch):
    # Row maxima that rise far mid-sequence and at its end (``make_inputs(jumps=True)``):
    # the running max moves and O is rescaled; under the SM90 TMA kernel's modes
    # (``sm90.config.TMA_MODES``: steps split by mask runs, and a lagging max, the default
    # over 16-bit caches) the other tiles keep theirs (corrections exactly 1, their rescale
    # skipped) and e4m3 P reaches 2^8.5.
    if knob:
        if backend != "sm90":
            pytest.skip("a mode of the SM90 TMA kernel")
        monkeypatch.setenv("FLASH_ATTN_CUTE_MLA_SM90_QK", knob)
    if fp8:
        inputs, descale = fp8_inputs(TILE_SEQLENS, 64, 64, seqlen_q=seqlen_q, seed=130, jumps=True)
        run_and_check_fp8(backend, inputs, descale, causal=causal, num_splits=num_splits, return_lse=True)
    else:
        run_and_check(backend, make_inputs(TILE_SEQLENS, 64, 64, seqlen_q=seqlen_q, seed=131, jumps=True),
                      causal=causal, num_splits=num_splits, return_lse=True)


@pytest.mark.parametrize("nheads,nheads_kv,seqlen_q,page_size", [(16, None, 2, 64), (128, None, 2, 128),
                                                                 (100, None, 1, 64), (8, 4, 2, 256)])
def test_mla_fp8_tma_causal_heads(backend, nheads, nheads_kv, seqlen_q, page_size):
    inputs, descale = fp8_inputs(TILE_SEQLENS, nheads, page_size, seqlen_q=seqlen_q, seed=120 + nheads,
                                 per_batch=True, nheads_kv=nheads_kv)
    run_and_check_fp8(backend, inputs, descale, causal=True, num_splits=0, return_lse=True)


# FP8 queries (FlashMLA's FP8 mode): e4m3 q_nope / q_pe with q_descale over an e4m3 cache,
# out bf16. The reference dequantizes both (fp32); the bound is 3x PyTorch's FP8 algorithm
# there (P rounded to e4m3), the LSE 2x PyTorch's bf16 one.
@pytest.mark.parametrize("nheads,nheads_kv,page_size,seqlen_q,causal,num_splits,per_batch", [
    (64, None, 64, 1, False, 1, False), (128, None, 128, 2, True, 3, True), (16, 2, 64, 2, True, 0, True),
    (100, None, 256, 1, False, 0, False)])
def test_mla_fp8_queries(backend, nheads, nheads_kv, page_size, seqlen_q, causal, num_splits, per_batch):
    import flash_attn_cute

    inputs, kv_descale = fp8_inputs(TILE_SEQLENS, nheads, page_size, seqlen_q=seqlen_q, seed=130 + nheads,
                                    per_batch=per_batch, nheads_kv=nheads_kv)
    q_nope, q_pe, ckv, kpe, lens, table = inputs
    q = torch.cat([q_nope, q_pe], -1).float()
    batch = q.shape[0]
    # One descale per sequence (per_batch) or for the tensor: the amax at e4m3's largest, 448.
    amax = q.abs().amax(dim=(1, 2, 3)) if per_batch else q.abs().amax().expand(batch)
    q_descale = (amax / 448.0).float()
    q8 = (q / q_descale.view(-1, 1, 1, 1)).to(torch.float8_e4m3fn)
    q_descale = q_descale if per_batch else q_descale[:1]
    args = (q8[..., :512], q8[..., 512:], ckv, kpe, lens, table)
    call = lambda: flash_attn_cute.flash_mla_decode(*args, causal=causal, num_splits=num_splits, return_lse=True,
                                                     backend=backend, kv_descale=kv_descale, q_descale=q_descale)
    if backend == "sm80":
        with pytest.raises(Exception, match="fp8_q"):
            call()
        return
    out, lse = call()
    assert out.dtype == torch.bfloat16
    q_deq = q8.float() * q_descale.view(-1, 1, 1, 1)
    ref = lambda q_, **kw: mla_decode_ref(q_[..., :512], q_[..., 512:], ckv, kpe, lens, table, causal=causal,
                                          kv_descale=kv_descale, **kw)
    out_ref, lse_ref = ref(q_deq)
    out_alg, _ = ref(q_deq, p_fp8=True)
    _, lse_pt = ref(q_deq.to(torch.bfloat16), upcast=False)
    check_close(out, out_ref, out_alg, mult=FP8_WGMMA_MULT)
    check_lse(lse, lse_ref, lse_pt)


@pytest.mark.parametrize("page_size", [64, 128])
@pytest.mark.parametrize("nheads_kv", [None, 2])
def test_mla_tma_nan_past_the_end(backend, page_size, nheads_kv):
    # Rows past each sequence's end (the rest of its last tile and page, and its spare
    # page) hold NaN: tile 0's tail is read by TMA whole and must be zeroed before P V.
    import flash_attn_cute

    inputs = make_inputs((5, 70, 33, 129, 64), 32, page_size, seed=97, nheads_kv=nheads_kv)
    q_nope, q_pe, ckv, kpe, seqlens, table = inputs
    out_ref, _ = mla_decode_ref(*inputs)
    out_pt, _ = mla_decode_ref(*inputs, upcast=False)
    ckv_bad, kpe_bad = poison_past_the_end(ckv, kpe, seqlens, table)
    for splits in (1, 2):
        out = flash_attn_cute.flash_mla_decode(q_nope, q_pe, ckv_bad, kpe_bad, seqlens, table, backend=backend,
                                               num_splits=splits)
        check_close(out, out_ref, out_pt)


@pytest.mark.parametrize("page_size", [64, 16])
def test_mla_fp8_nan_query_head(backend, page_size):
    # A NaN in one query head over an FP8 cache (pages of 64 on SM90: q quantized in the
    # kernel, one scale per 64-head tile): that head's output is NaN, the other heads of its
    # tile are bit-identical to the call without the NaN (the tile's amax skips NaN).
    import flash_attn_cute

    inputs, descale = fp8_inputs((300, 77), 64, page_size, seed=15)
    q_nope, q_pe = inputs[0], inputs[1]
    q_pe[1, 0, 9, 3] = 0  # (not the tile's amax in the clean call either: the same scale)
    q_pe_nan = q_pe.clone()
    q_pe_nan[1, 0, 9, 3] = float("nan")
    out = flash_attn_cute.flash_mla_decode(q_nope, q_pe_nan, *inputs[2:], backend=backend, kv_descale=descale)
    clean = flash_attn_cute.flash_mla_decode(*inputs, backend=backend, kv_descale=descale)
    assert out[1, 0, 9].isnan().all(), "the NaN query head's output is not NaN"
    others = torch.ones(out.shape[:3], dtype=torch.bool, device="cuda")
    others[1, 0, 9] = False
    assert not out[others].isnan().any(), "NaN spread beyond the NaN query head"
    assert torch.equal(out[others], clean[others]), "other heads' results moved with the NaN head"
    check_fp8(backend, inputs, descale, clean, None)
