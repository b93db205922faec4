"""GPU tests of FP8 attention (q, k and v in e4m3 with FA3's ``q_descale`` / ``k_descale`` /
``v_descale``, output bf16) on the SM90 kernel: both GEMMs in fp8 wgmma, V transposed in
shared memory, P rounded to e4m3. Then the same kernel under 16-bit queries over an e4m3
cache, the default on Hopper: the kernel quantizes the queries itself (``device/q_quant.py``;
output in q's dtype), checked against the queries quantized as it quantizes them and
against the unquantized ones; and the calls that keep the widening kernel.

The reference is fp32 attention on the dequantized values (``testing.dequantize_kv``).
PyTorch's own error on the same quantized inputs bounds the kernel's (``check_close``): for
O, that of the same FP8 algorithm in PyTorch (``attention_ref(p_fp8=True)``: fp32 scores,
P at 2^8 of its row max rounded to e4m3); for the LSE, that of PyTorch's bf16 attention
on the dequantized values (fp8 wgmma accumulates Q K^T with a shortened fp32 mantissa, so
the scores are not exact). Outputs are poisoned with NaN, and so are the cache bytes past
each sequence's end.
"""

import pytest
import torch

from flash_attn_cute import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, quantize_fp8
from flash_attn_cute.testing import (attention_kvcache_ref, attention_ref, attention_serving_ref, attention_varlen_ref,
                                     check_close, check_lse, dequantize_kv, quantize_q_ref)

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HOPPER, reason="FP8 attention runs on Hopper (SM90)")]

DEVICE = "cuda"
E4M3 = torch.float8_e4m3fn
BACKENDS = [None, "sm90"]
# The kernel rounds P against its running row max, PyTorch against the final one: the same
# error per value, drawn differently; the largest of many differs by more than 2x.
MULT = 3.0


def _torch(ref_fn, q, k, v, **kw):
    """PyTorch's own (out, lse) on the dequantized inputs: O by the FP8 algorithm, the LSE
    in bf16."""
    out_torch, _ = ref_fn(q, k, v, p_fp8=True, **kw)
    bf = lambda x: x.to(torch.bfloat16)
    _, lse_torch = ref_fn(bf(q), bf(k), bf(v), upcast=False, **kw)
    return out_torch, lse_torch


def _i32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def _quantize(x, hkv):
    """(x in e4m3, descale (batch, hkv)) of x (batch, seqlen, h, d): one scale per KV head
    group (FA3's descale layout for q as for k and v)."""
    b, s, h, d = x.shape
    x8, descale = quantize_fp8(x.reshape(b, s, hkv, (h // hkv) * d), granularity="batch_head")
    return x8.reshape(b, s, h, d), descale


def _inputs(batch, seqlen_q, seqlen_k, h, hkv, d, dv=None, seed=0):
    torch.manual_seed(seed)
    dv = dv or d
    q = torch.randn(batch, seqlen_q, h, d, device=DEVICE)
    k = torch.randn(batch, seqlen_k, hkv, d, device=DEVICE) * torch.linspace(0.5, 2.0, hkv, device=DEVICE).view(
        1, 1, hkv, 1)
    v = torch.randn(batch, seqlen_k, hkv, dv, device=DEVICE) * 3.0
    (q8, qd), (k8, kd), (v8, vd) = _quantize(q, hkv), _quantize(k, hkv), _quantize(v, hkv)
    return q8, k8, v8, qd, kd, vd


def _dequantized(q8, k8, v8, qd, kd, vd):
    hkv = k8.shape[2]
    b, s, h, d = q8.shape
    q = dequantize_kv(q8.reshape(b, s, hkv, -1), qd).reshape(b, s, h, d)
    return q, dequantize_kv(k8, kd), dequantize_kv(v8, vd)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("d", [64, 128, 256, 112])  # 112: padded to the 128 tile
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_attention(backend, d, causal):
    q8, k8, v8, qd, kd, vd = _inputs(2, 777, 1001, 8, 2, d)
    out = torch.full(q8.shape, float("nan"), device=DEVICE, dtype=torch.bfloat16)
    res = flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd, return_lse=True,
                          out=out, backend=backend)
    assert res[0] is out and out.dtype == torch.bfloat16
    q, k, v = _dequantized(q8, k8, v8, qd, kd, vd)
    out_ref, lse_ref = attention_ref(q, k, v, causal=causal)
    out_torch, lse_torch = _torch(attention_ref, q, k, v, causal=causal)
    check_close(out, out_ref, out_torch, mult=MULT)
    check_lse(res[1], lse_ref, lse_torch)


@pytest.mark.parametrize("persistent,sm_margin", [("0", 0), ("1", 0), ("1", 100), ("dynamic", 0), ("dynamic", 100)])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_attention_persistent(persistent, sm_margin, num_splits, causal, monkeypatch):
    """d 256 with more tiles than SMs (2 sequences x 2048 queries x 8 heads: 256 tiles of
    128 rows, x 3 splits), one CTA per tile and persistent CTAs that loop over several
    (FLASH_ATTN_CUTE_SM90_PERSISTENT; ``sm90.fp8_persistent``): the pipeline states, the V
    transposes and the Q loads carried from tile to tile; with ``sm_margin`` the grid leaves
    100 SMs free, so each CTA loops over 8 to 24 tiles. Causal: the LPT tiles in a static
    stride ("1") or handed out by the atomic counter ("dynamic": ``flash_fwd`` ``dynamic``),
    the empty ones (queries before the keys' diagonal see none: 548 of 2048 rows) among them."""
    monkeypatch.setenv("FLASH_ATTN_CUTE_SM90_PERSISTENT", persistent)
    q8, k8, v8, qd, kd, vd = _inputs(2, 2048, 1500, 8, 2, 256, seed=7)
    out = torch.full(q8.shape, float("nan"), device=DEVICE, dtype=torch.bfloat16)
    res = flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, num_splits=num_splits,
                          return_lse=True, out=out, backend="sm90", sm_margin=sm_margin, causal=causal)
    q, k, v = _dequantized(q8, k8, v8, qd, kd, vd)
    out_ref, lse_ref = attention_ref(q, k, v, causal=causal)
    out_torch, lse_torch = _torch(attention_ref, q, k, v, causal=causal)
    check_close(out, out_ref, out_torch, mult=MULT)
    check_lse(res[1], lse_ref, lse_torch)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_fp8_attention_persistent_varlen(num_splits, monkeypatch):
    """Persistent CTAs (FLASH_ATTN_CUTE_SM90_PERSISTENT=1; the default keeps varlen one CTA
    per tile, ``sm90.fp8_persistent``) over packed d 256 sequences of different lengths, an
    empty and a one-query one among them: 268 tiles of 128 packed rows (GQA 4), so that CTAs
    loop over tiles of different sequences and lengths."""
    monkeypatch.setenv("FLASH_ATTN_CUTE_SM90_PERSISTENT", "1")
    lens_q, lens_k = [2048, 0, 1, 1500, 700], [1800, 40, 300, 1500, 2100]
    q8, k8, v8, qd, kd, vd = _inputs(1, sum(lens_q), sum(lens_k), 8, 2, 256, seed=11)
    q8, k8, v8 = q8[0], k8[0], v8[0]
    b = len(lens_q)
    qd, kd, vd = (x.expand(b, 2).contiguous() for x in (qd, kd, vd))
    cu_q = _i32([0] + torch.tensor(lens_q).cumsum(0).tolist())
    cu_k = _i32([0] + torch.tensor(lens_k).cumsum(0).tolist())
    out = torch.full(q8.shape, float("nan"), device=DEVICE, dtype=torch.bfloat16)
    _, lse = flash_attn_varlen_func(q8, k8, v8, cu_q, cu_k, max(lens_q), max(lens_k), num_splits=num_splits,
                                    q_descale=qd, k_descale=kd, v_descale=vd, return_lse=True, out=out,
                                    backend="sm90")
    # One descale per KV head (the batch's rows repeat the first's).
    q = q8.float() * qd[0].repeat_interleave(4).view(1, 8, 1)
    k, v = k8.float() * kd[0].view(1, 2, 1), v8.float() * vd[0].view(1, 2, 1)
    out_ref, lse_ref = attention_varlen_ref(q, k, v, cu_q, cu_k)
    out_torch, lse_torch = _torch(lambda *a, **kw: attention_varlen_ref(*a, cu_q, cu_k, **kw), q, k, v)
    check_close(out, out_ref, out_torch, mult=MULT)
    check_lse(lse, lse_ref, lse_torch)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_attention_dims_sink_no_descale(backend):
    """d 192 / d_v 128 (tile_n 96), a learnable sink, and no descales (all 1)."""
    torch.manual_seed(1)
    q = torch.randn(1, 300, 4, 192, device=DEVICE).to(E4M3)
    k = torch.randn(1, 450, 4, 192, device=DEVICE).to(E4M3)
    v = torch.randn(1, 450, 4, 128, device=DEVICE).to(E4M3)
    sink = torch.randn(4, device=DEVICE)
    out, lse = flash_attn_func(q, k, v, learnable_sink=sink, return_lse=True, backend=backend)
    out_ref, lse_ref = attention_ref(q.float(), k.float(), v.float(), learnable_sink=sink)
    out_torch, lse_torch = _torch(attention_ref, q.float(), k.float(), v.float(), learnable_sink=sink)
    check_close(out, out_ref, out_torch, mult=MULT)
    check_lse(lse, lse_ref, lse_torch)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal,num_splits", [(True, 1), (False, 3)])
def test_fp8_attention_varlen(backend, causal, num_splits):
    """Packed queries and keys (an empty sequence, a one-query one), split-KV."""
    lens_q, lens_k = [300, 0, 1, 129], [500, 17, 64, 129]
    q8, k8, v8, qd, kd, vd = _inputs(1, sum(lens_q), sum(lens_k), 8, 4, 128, seed=2)
    q8, k8, v8 = q8[0], k8[0], v8[0]
    qd, kd, vd = qd.expand(4, 4).contiguous(), kd.expand(4, 4).contiguous(), vd.expand(4, 4).contiguous()
    cu_q = _i32([0] + torch.tensor(lens_q).cumsum(0).tolist())
    cu_k = _i32([0] + torch.tensor(lens_k).cumsum(0).tolist())
    out = torch.full(q8.shape, float("nan"), device=DEVICE, dtype=torch.bfloat16)
    _, lse = flash_attn_varlen_func(q8, k8, v8, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                    num_splits=num_splits, q_descale=qd, k_descale=kd, v_descale=vd, return_lse=True,
                                    out=out, backend=backend)
    # One descale per KV head (the batch's rows repeat the first's).
    q = q8.float() * qd[0].repeat_interleave(2).view(1, 8, 1)
    k, v = k8.float() * kd[0].view(1, 4, 1), v8.float() * vd[0].view(1, 4, 1)
    out_ref, lse_ref = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=causal)
    out_torch, lse_torch = _torch(lambda *a, **kw: attention_varlen_ref(*a, cu_q, cu_k, **kw), q, k, v, causal=causal)
    check_close(out, out_ref, out_torch, mult=MULT)
    check_lse(lse, lse_ref, lse_torch)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_attention_local_softcap(backend):
    q8, k8, v8, qd, kd, vd = _inputs(2, 640, 640, 4, 4, 128, seed=3)
    kw = dict(window_size=(100, 0), softcap=20.0)
    out = flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, backend=backend, **kw)
    q, k, v = _dequantized(q8, k8, v8, qd, kd, vd)
    out_ref, _ = attention_ref(q, k, v, **kw)
    out_torch, _ = _torch(attention_ref, q, k, v, **kw)
    check_close(out, out_ref, out_torch, mult=MULT)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seqlen_q,num_splits", [(1, 0), (4, 3), (200, 1)])
@pytest.mark.parametrize("page_size", [64, 16, 1])  # one TMA per block; rows gathered (vLLM's 16; 1)
def test_fp8_attention_paged_cache(backend, seqlen_q, num_splits, page_size):
    """FP8 queries over an FP8 paged cache (NaN bytes past each length)."""
    batch, h, hkv, d = 3, 8, 2, 128
    pages_per_seq = 1024 // page_size
    q8, k8, v8, qd, kd, vd = _inputs(batch, seqlen_q, pages_per_seq * page_size, h, hkv, d, seed=4)
    lens = _i32([1000, seqlen_q + 37, 513])
    num_pages = batch * pages_per_seq + 5
    table = torch.randperm(num_pages, device=DEVICE)[:batch * pages_per_seq].view(batch, pages_per_seq).int()

    def pool(x8):
        bytes_ = x8.view(torch.uint8).clone()
        for b, n in enumerate(lens.tolist()):
            bytes_[b, n:] = 0x7F  # NaN in e4m3
        p = torch.full((num_pages, page_size, *x8.shape[2:]), 0x7F, device=DEVICE, dtype=torch.uint8)
        p[table.long()] = bytes_.view(batch, pages_per_seq, page_size, *x8.shape[2:])
        return p.view(E4M3)

    out, lse = flash_attn_with_kvcache(q8, pool(k8), pool(v8), cache_seqlens=lens, page_table=table, causal=True,
                                       num_splits=num_splits, q_descale=qd, k_descale=kd, v_descale=vd,
                                       return_lse=True, backend=backend)
    q, k, v = _dequantized(q8, k8, v8, qd, kd, vd)
    out_ref, lse_ref = attention_kvcache_ref(q, k, v, lens, causal=True)
    out_torch, lse_torch = _torch(lambda *a, **kw: attention_kvcache_ref(*a, lens, **kw), q, k, v, causal=True)
    check_close(out, out_ref, out_torch, mult=MULT)
    check_lse(lse, lse_ref, lse_torch)


def test_fp8_attention_refusals():
    q8, k8, v8, qd, kd, vd = _inputs(1, 64, 64, 2, 2, 64)
    with pytest.raises(NotImplementedError, match="fp8_qkv"):
        flash_attn_func(q8, k8, v8, backend="sm80")
    with pytest.raises(TypeError, match="k and v in"):
        flash_attn_func(q8, k8.float().to(torch.bfloat16), v8)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        flash_attn_func(q8.float().to(torch.float8_e5m2), k8, v8)
    with pytest.raises(ValueError, match=r"head dimension must be a multiple of 16 in \[16, 256\] \(FP8"):
        flash_attn_func(*(x.view(torch.uint8)[..., :40].contiguous().view(E4M3) for x in (q8, k8, v8)))


# ---------------------------------------------------------------------------------------
# 16-bit queries over an e4m3 cache: the SM90 kernel quantizes the queries itself
# (``device/q_quant.py``, one power-of-two scale per Q tile) and runs the FP8 kernel above
# ---------------------------------------------------------------------------------------

WIDEN_KNOB = "FLASH_ATTN_CUTE_SM90_FP8_KV"


def _cache8(batch, seqlen, hkv, d, scale=1.0, fp8=E4M3):
    """(fp8 cache, descale (batch, hkv)): random values of a few magnitudes per KV head."""
    x = torch.randn(batch, seqlen, hkv, d, device=DEVICE) * scale
    x = x * torch.linspace(0.5, 2.0, hkv, device=DEVICE).view(1, 1, hkv, 1)
    return quantize_fp8(x, dtype=fp8)


def _poisoned(x8, lens):
    """A copy of a (batch, capacity, hkv, d) fp8 cache with NaN bytes past each length."""
    raw = x8.view(torch.uint8).clone()
    for b, n in enumerate(lens.tolist()):
        raw[b, n:] = 0x7F  # NaN in e4m3 and in e5m2
    return raw.view(x8.dtype)


def _pool(x8, table, page_size, num_pages):
    """(num_pages, page_size, hkv, d) pages holding x8 (batch, pages x page_size, hkv, d) at
    ``table``; the other pages NaN bytes."""
    batch, pages_per_seq = table.shape
    pool = torch.full((num_pages, page_size, *x8.shape[2:]), 0x7F, device=DEVICE, dtype=torch.uint8)
    pool[table.long()] = x8.view(torch.uint8).view(batch, pages_per_seq, page_size, *x8.shape[2:])
    return pool.view(x8.dtype)


def _check_quantized_q(out, lse, q, ref_fn, k, v, **kw):
    """The kernel against fp32 references on the dequantized cache. With q quantized as the
    kernel quantizes it (``testing.quantize_q_ref``): O within MULT x PyTorch's FP8
    algorithm on those queries, the LSE within 2x PyTorch's bf16 one (the kernel's own
    error). With the unquantized q: within MULT x the distance of that same algorithm from
    it, the LSE within 2x (the error that quantizing q costs, as PyTorch measures it)."""
    qq = quantize_q_ref(q)
    out_ref_q, lse_ref_q = ref_fn(qq, k, v, **kw)
    out_torch, lse_torch = _torch(ref_fn, qq, k, v, **kw)
    check_close(out, out_ref_q, out_torch, mult=MULT)
    out_ref, lse_ref = ref_fn(q.float(), k, v, **kw)
    check_close(out, out_ref, out_torch, mult=MULT, name="out (unquantized q)")
    if lse is not None:
        check_lse(lse, lse_ref_q, lse_torch)
        check_lse(lse, lse_ref, lse_torch, name="lse (unquantized q)")


# (page_size, seqlen_q, nheads, nheads_kv, causal, num_splits, q dtype): decode (GQA packed),
# speculative decode, a prefill chunk; every page size (None: contiguous; 1 and 16: row
# gathers; 64, 128, 256: one TMA per block), heuristic and explicit splits.
QQ_PAGED = [
    (None, 1, 32, 8, False, 0, torch.bfloat16),
    (1, 1, 16, 2, True, 3, torch.bfloat16),
    (16, 4, 8, 8, True, 0, torch.float16),
    (64, 1, 32, 8, True, 5, torch.bfloat16),
    (128, 200, 8, 2, True, 1, torch.bfloat16),
    (256, 7, 12, 4, False, 2, torch.bfloat16),
]


@pytest.mark.parametrize("page_size,seqlen_q,h,hkv,causal,num_splits,qdtype", QQ_PAGED,
                         ids=[f"page{c[0]}-sq{c[1]}-h{c[2]}/{c[3]}-causal{int(c[4])}-splits{c[5]}" for c in QQ_PAGED])
def test_quantized_q_over_fp8_cache(page_size, seqlen_q, h, hkv, causal, num_splits, qdtype, monkeypatch):
    """flash_attn_with_kvcache(bf16 / fp16 q, e4m3 cache): the default call (at pages of 1,
    where the default leaves a prefill chunk's row gathers to the widening kernel, the knob
    names the quantizing one; decode quantizes there by default). Lengths not a
    multiple of any tile, NaN bytes past each length, output poisoned with NaN; sequence 1's
    queries all zero (zero amax: its tiles' scale takes the clamp, no division) and one head
    of sequence 0 zero (a zero row in a tile with others)."""
    if page_size == 1:
        monkeypatch.setenv(WIDEN_KNOB, "quantize_q")
    torch.manual_seed(20)
    batch, capacity, d = 3, 1024, 128
    q = torch.randn(batch, seqlen_q, h, d, device=DEVICE).to(qdtype)
    q[1] = 0
    q[0, :, 1] = 0
    k8, kd = _cache8(batch, capacity, hkv, d)
    v8, vd = _cache8(batch, capacity, hkv, d, scale=3.0)
    lens = _i32([1000, seqlen_q + 37, 513])
    k8p, v8p, table = _poisoned(k8, lens), _poisoned(v8, lens), None
    if page_size is not None:
        pages_per_seq = capacity // page_size
        num_pages = batch * pages_per_seq + 3
        table = torch.randperm(num_pages, device=DEVICE)[:batch * pages_per_seq].view(batch, pages_per_seq).int()
        k8p, v8p = _pool(k8p, table, page_size, num_pages), _pool(v8p, table, page_size, num_pages)
    out = torch.full(q.shape, float("nan"), device=DEVICE, dtype=qdtype)
    res = flash_attn_with_kvcache(q, k8p, v8p, cache_seqlens=lens, page_table=table, k_descale=kd, v_descale=vd,
                                  causal=causal, num_splits=num_splits, return_lse=True, out=out)
    assert res[0] is out and out.dtype == qdtype
    _check_quantized_q(out, res[1], q, lambda *a, **kw: attention_kvcache_ref(*a, lens, **kw),
                       dequantize_kv(k8, kd), dequantize_kv(v8, vd), causal=causal)


# (case, page_size, seqlen_q, d, call keywords): TMA boxes (pages of a multiple of 16 that
# hold no whole block) outside FP8 decode's two-CTA tile: decode at d 256 (one CTA a SM),
# two-level accumulation, the widening kernel's prefill chunk (boxes of 32 rows).
BOXES_BEYOND_DECODE = [("d256-decode", 16, 1, 256, {}), ("two-level", 48, 3, 128, dict(fp8_two_level_interval=2)),
                       ("widen-chunk", 32, 200, 128, {})]


@pytest.mark.parametrize("case,page_size,seqlen_q,d,kw", BOXES_BEYOND_DECODE, ids=[c[0] for c in BOXES_BEYOND_DECODE])
def test_fp8_cache_boxes_beyond_decode_tile(case, page_size, seqlen_q, d, kw, monkeypatch):
    """bf16 q over an e4m3 cache in pages read by TMA boxes, on the tiles other than FP8
    decode's: causal, lengths no multiple of a page, NaN bytes past each length and in the
    unused pages, output poisoned with NaN."""
    if case == "widen-chunk":
        monkeypatch.setenv(WIDEN_KNOB, "widen")
    torch.manual_seed(23)
    batch, capacity, h, hkv = 2, 1024 - 1024 % page_size, 8, 2
    q = torch.randn(batch, seqlen_q, h, d, device=DEVICE).to(torch.bfloat16)
    k8, kd = _cache8(batch, capacity, hkv, d)
    v8, vd = _cache8(batch, capacity, hkv, d, scale=2.0)
    lens = _i32([capacity - 7, seqlen_q + 300])
    pages_per_seq = capacity // page_size
    num_pages = batch * pages_per_seq + 3
    table = torch.randperm(num_pages, device=DEVICE)[:batch * pages_per_seq].view(batch, pages_per_seq).int()
    k8p = _pool(_poisoned(k8, lens), table, page_size, num_pages)
    v8p = _pool(_poisoned(v8, lens), table, page_size, num_pages)
    out = torch.full(q.shape, float("nan"), device=DEVICE, dtype=q.dtype)
    res = flash_attn_with_kvcache(q, k8p, v8p, cache_seqlens=lens, page_table=table, k_descale=kd, v_descale=vd,
                                  causal=True, return_lse=True, out=out, backend="sm90", **kw)
    assert res[0] is out
    if case == "widen-chunk":
        _check_widened(out, res[1], q, k8, v8, kd, vd, lens)
    else:
        _check_quantized_q(out, res[1], q, lambda *a, **kw: attention_kvcache_ref(*a, lens, **kw),
                           dequantize_kv(k8, kd), dequantize_kv(v8, vd), causal=True)


@pytest.mark.parametrize("d,causal,kw", [(64, True, {}), (256, False, {}),
                                         (80, True, dict(window_size=(100, 0), softcap=20.0))],
                         ids=["d64-causal", "d256", "d80-local-softcap"])
def test_quantized_q_prefill(d, causal, kw):
    """flash_attn_func(bf16 q, e4m3 k and v): the prefill tiles (d 64: three consumer
    warpgroups; d 80: padded to the 96 tile, its columns past 80 zero), 777 queries over
    1001 keys (no multiple of a tile)."""
    torch.manual_seed(21)
    q = torch.randn(2, 777, 8, d, device=DEVICE).to(torch.bfloat16)
    k8, kd = _cache8(2, 1001, 2, d)
    v8, vd = _cache8(2, 1001, 2, d, scale=3.0)
    out = torch.full(q.shape, float("nan"), device=DEVICE, dtype=torch.bfloat16)
    res = flash_attn_func(q, k8, v8, causal=causal, k_descale=kd, v_descale=vd, return_lse=True, out=out, **kw)
    assert res[0] is out
    _check_quantized_q(out, res[1], q, attention_ref, dequantize_kv(k8, kd), dequantize_kv(v8, vd), causal=causal,
                       **kw)


def test_quantized_q_varlen_sink_split():
    """flash_attn_varlen_func over packed e4m3 keys: an empty and a one-query sequence, one
    of 5 queries over 3 keys (causal: its first two see none, the sink alone), three splits
    (the combine adds the learnable sink), per-tensor descales."""
    torch.manual_seed(22)
    lens_q, lens_k = [300, 0, 1, 129, 5], [500, 17, 64, 129, 3]
    cu_q = _i32([0] + torch.tensor(lens_q).cumsum(0).tolist())
    cu_k = _i32([0] + torch.tensor(lens_k).cumsum(0).tolist())
    q = torch.randn(sum(lens_q), 8, 128, device=DEVICE).to(torch.bfloat16)
    k8, kd = quantize_fp8(torch.randn(sum(lens_k), 4, 128, device=DEVICE), granularity="tensor")
    v8, vd = quantize_fp8(torch.randn(sum(lens_k), 4, 128, device=DEVICE) * 2, granularity="tensor")
    sink = torch.randn(8, device=DEVICE)
    out = torch.full(q.shape, float("nan"), device=DEVICE, dtype=torch.bfloat16)
    _, lse = flash_attn_varlen_func(q, k8, v8, cu_q, cu_k, max(lens_q), max(lens_k), causal=True, num_splits=3,
                                    k_descale=kd, v_descale=vd, learnable_sink=sink, return_lse=True, out=out)
    _check_quantized_q(out, lse, q, lambda *a, **kw: attention_varlen_ref(*a, cu_q, cu_k, **kw),
                       k8.float() * kd, v8.float() * vd, causal=True, learnable_sink=sink)


def test_quantized_q_serving_step(monkeypatch):
    """A serving step over an e4m3 paged pool (pages of 16, the quantizing kernel named by
    the knob): decode rows, a speculative row, an empty row and a prefill chunk in one
    varlen call (a mixed plan: two launches of quantizing kernels), a learnable sink,
    split-KV by the heuristic."""
    monkeypatch.setenv(WIDEN_KNOB, "quantize_q")
    torch.manual_seed(23)
    page_size, h, hkv, d = 16, 8, 2, 128
    lens_q, lens_k = [1, 1, 5, 0, 300], [40, 900, 100, 9, 600]
    batch, pages_per_seq = len(lens_q), 64
    q = torch.randn(sum(lens_q), h, d, device=DEVICE).to(torch.bfloat16)
    k8, kd = _cache8(batch, pages_per_seq * page_size, hkv, d)
    v8, vd = _cache8(batch, pages_per_seq * page_size, hkv, d, scale=2.0)
    table = torch.randperm(batch * pages_per_seq, device=DEVICE).view(batch, pages_per_seq).int()
    seqused = _i32(lens_k)
    k8p = _pool(_poisoned(k8, seqused), table, page_size, batch * pages_per_seq)
    v8p = _pool(_poisoned(v8, seqused), table, page_size, batch * pages_per_seq)
    cu_q = _i32([0] + torch.tensor(lens_q).cumsum(0).tolist())
    sink = torch.randn(h, device=DEVICE)
    out = torch.full(q.shape, float("nan"), device=DEVICE, dtype=torch.bfloat16)
    out, lse = flash_attn_varlen_func(q, k8p, v8p, cu_seqlens_q=cu_q, max_seqlen_q=max(lens_q), seqused_k=seqused,
                                      page_table=table, causal=True, learnable_sink=sink, k_descale=kd, v_descale=vd,
                                      return_lse=True, out=out, num_splits=0)
    _check_quantized_q(out, lse, q, lambda *a, **kw: attention_serving_ref(*a, **kw), dequantize_kv(k8, kd),
                       dequantize_kv(v8, vd), cu_seqlens_q=cu_q, seqused_k=seqused, causal=True, learnable_sink=sink)


def test_quantized_q_paged_leftpad(monkeypatch):
    """cache_leftpad over an e4m3 paged cache (pages of 64, read by row gathers since the
    sequences start inside pages; the quantizing kernel named by the knob): three queries a
    sequence, causal."""
    monkeypatch.setenv(WIDEN_KNOB, "quantize_q")
    torch.manual_seed(24)
    batch, pages_per_seq, page_size, h, hkv, d = 3, 12, 64, 8, 2, 128
    q = torch.randn(batch, 3, h, d, device=DEVICE).to(torch.bfloat16)
    k8, kd = _cache8(batch, pages_per_seq * page_size, hkv, d)
    v8, vd = _cache8(batch, pages_per_seq * page_size, hkv, d, scale=2.0)
    lens, leftpad = _i32([700, 131, 768]), _i32([0, 70, 64 + 5])
    table = torch.randperm(batch * pages_per_seq, device=DEVICE).view(batch, pages_per_seq).int()
    k8p = _pool(_poisoned(k8, lens), table, page_size, batch * pages_per_seq)
    v8p = _pool(_poisoned(v8, lens), table, page_size, batch * pages_per_seq)
    out = torch.full(q.shape, float("nan"), device=DEVICE, dtype=torch.bfloat16)
    res = flash_attn_with_kvcache(q, k8p, v8p, cache_seqlens=lens, cache_leftpad=leftpad, page_table=table,
                                  k_descale=kd, v_descale=vd, causal=True, return_lse=True, out=out)
    _check_quantized_q(out, res[1], q,
                       lambda *a, **kw: attention_kvcache_ref(*a, lens, cache_leftpad=leftpad, **kw),
                       dequantize_kv(k8, kd), dequantize_kv(v8, vd), causal=True)


def _widening_inputs(fp8=E4M3, qdtype=torch.bfloat16, seed=25):
    torch.manual_seed(seed)
    q = torch.randn(2, 2, 16, 128, device=DEVICE).to(qdtype)
    k8, kd = _cache8(2, 700, 4, 128, fp8=fp8)
    v8, vd = _cache8(2, 700, 4, 128, scale=2.0, fp8=fp8)
    return q, k8, v8, kd, vd, _i32([700, 333])


def _check_widened(out, lse, q, k8, v8, kd, vd, lens):
    """The widening kernel's bound: within 2x PyTorch's own error on the dequantized cache
    in q's dtype. Quantized queries (e4m3: 3 mantissa bits) could not meet it."""
    k, v = dequantize_kv(k8, kd), dequantize_kv(v8, vd)
    out_ref, lse_ref = attention_kvcache_ref(q, k, v, lens, causal=True)
    out_pt, lse_pt = attention_kvcache_ref(q, k.to(q.dtype), v.to(q.dtype), lens, causal=True, upcast=False)
    check_close(out, out_ref, out_pt)
    check_lse(lse, lse_ref, lse_pt)


@pytest.mark.parametrize("case", ["e5m2", "batch_invariant", "knob"])
def test_fp8_cache_widening_kernel_where_q_stays(case, monkeypatch):
    """Where the queries are not quantized, the SM90 kernel widens the cache (bf16 wgmma on
    the exact values): an e5m2 cache (fp16 q), batch_invariant (a per-tile scale would make
    a row depend on its tile-mates), and FLASH_ATTN_CUTE_SM90_FP8_KV=widen (the A/B knob),
    which gives other bits than the default call."""
    fp8, qdtype = (torch.float8_e5m2, torch.float16) if case == "e5m2" else (E4M3, torch.bfloat16)
    q, k8, v8, kd, vd, lens = _widening_inputs(fp8, qdtype)
    kw = dict(cache_seqlens=lens, k_descale=kd, v_descale=vd, causal=True, return_lse=True, backend="sm90")
    if case == "knob":
        default = flash_attn_with_kvcache(q, k8, v8, **kw)[0]
        monkeypatch.setenv(WIDEN_KNOB, "widen")
    out, lse = flash_attn_with_kvcache(q, k8, v8, batch_invariant=case == "batch_invariant", **kw)
    _check_widened(out, lse, q, k8, v8, kd, vd, lens)
    if case == "knob":
        assert not torch.equal(out, default)


# ---------------------------------------------------------------------------------------
# fp8_two_level_interval at 131,072 keys: the fp8 P V wgmma adds into its accumulator with
# about 14 bits, so once O is large against one block's P V the late blocks lose their low
# bits; the option flushes O into an fp32 accumulator every n KV blocks
# ---------------------------------------------------------------------------------------

LONG_KEYS = 131072


def _long_context(seqlen_q, h, hkv, d=128, seed=30):
    """q small (scores within about +-0.75 of each other: every key weighs alike, O grows
    with the keys seen), k normal, v uniform in [0.5, 1.5] (positive: the P V products add
    up instead of cancelling), each quantized per (batch, KV head) to e4m3."""
    torch.manual_seed(seed)
    q = torch.randn(1, seqlen_q, h, d, device=DEVICE) * 0.25
    k = torch.randn(1, LONG_KEYS, hkv, d, device=DEVICE)
    v = torch.rand(1, LONG_KEYS, hkv, d, device=DEVICE) + 0.5
    return q, quantize_fp8(k), quantize_fp8(v)


def _rel_err(out, ref):
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


# (path, seqlen_q, nheads, nheads_kv): FP8 q, k, v with descales on the decode tile (GQA rows
# packed: 64 a KV head) and on a prefill tile (128 rows: the option's 128 x 128 tile instead of
# 192 x 96); 16-bit q over the e4m3 cache (quantized in the kernel) on the decode tile.
TWO_LEVEL_CASES = [("fp8_qkv", 16, 8, 2), ("fp8_qkv", 128, 4, 4), ("quantize_q", 16, 8, 2)]
# Bounds of the option's error (of max |O|): emulating the wgmma as products aligned to the
# largest exponent and truncated to 14 (13) bits gives, on these inputs, 1.6e-4 (9.9e-4) at
# interval 1 and 5.0e-3 (1.4e-2) at 4, against 0.85 (0.92) without; O leaves in bf16 (2e-3).
TWO_LEVEL_BOUND = {1: 0.01, 4: 0.03}


@pytest.mark.parametrize("path,seqlen_q,h,hkv", TWO_LEVEL_CASES, ids=[f"{c[0]}-sq{c[1]}" for c in TWO_LEVEL_CASES])
def test_two_level_accumulation_long_context(path, seqlen_q, h, hkv):
    """One split (num_splits=1: one CTA accumulates all 131,072 keys, 1024 blocks), against
    fp32 attention on the dequantized inputs (the queries as the kernel quantizes them on
    the quantize_q path): the option's error within ``TWO_LEVEL_BOUND`` and no worse than
    without it. Measured on an H100 (max |O - ref| / max |ref|): fp8_qkv-sq16 off 0.86,
    interval 1 3.0e-3, 4 8.0e-3; fp8_qkv-sq128 off 0.86, 1 3.4e-3, 4 8.1e-3; quantize_q-sq16
    off 0.86, 1 3.0e-3, 4 8.0e-3 (O's bf16 rounding and the quantized inputs add to the
    emulated accumulation error)."""
    q, (k8, kd), (v8, vd) = _long_context(seqlen_q, h, hkv)
    k, v = dequantize_kv(k8, kd), dequantize_kv(v8, vd)
    if path == "fp8_qkv":
        q8, qd = _quantize(q, hkv)
        q_ref = dequantize_kv(q8.reshape(1, seqlen_q, hkv, -1), qd).reshape(q.shape)
        run = lambda **kw: flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, num_splits=1, **kw)
    else:
        q16 = q.to(torch.bfloat16)
        q_ref = quantize_q_ref(q16)
        run = lambda **kw: flash_attn_with_kvcache(q16, k8, v8, k_descale=kd, v_descale=vd, num_splits=1, **kw)
    out_ref, _ = attention_ref(q_ref, k, v)
    errs = {}
    for interval in (0, 1, 4):
        out = run(fp8_two_level_interval=interval)
        assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
        errs[interval] = _rel_err(out, out_ref)
    print(f"\n{path} seqlen_q {seqlen_q}: max |O - ref| / max |ref| by interval: {errs}")
    for interval, bound in TWO_LEVEL_BOUND.items():
        assert errs[interval] <= bound, (interval, errs)
        assert errs[interval] <= errs[0], (interval, errs)


@pytest.mark.parametrize("page_size", [None, 64, 1])
def test_quantized_q_nan_query_head(page_size, monkeypatch):
    """A NaN in one query head (GQA decode, heads of one KV group packed in one Q tile, q
    quantized per tile in the kernel): that head's output is NaN, as in PyTorch, and the
    other heads of its tile keep their scale and match the reference (the tile's amax skips
    NaN instead of spreading it)."""
    if page_size == 1:
        monkeypatch.setenv(WIDEN_KNOB, "quantize_q")
    torch.manual_seed(26)
    batch, capacity, h, hkv, d = 2, 512, 32, 8, 128
    q = torch.randn(batch, 1, h, d, device=DEVICE).to(torch.bfloat16)
    q[0, 0, 5, 17] = 0  # (not the tile's amax in the clean call either: the same scale)
    q_nan = q.clone()
    q_nan[0, 0, 5, 17] = float("nan")  # head 5: KV group 1, beside heads 4, 6, 7
    k8, kd = _cache8(batch, capacity, hkv, d)
    v8, vd = _cache8(batch, capacity, hkv, d, scale=3.0)
    lens = _i32([500, 301])
    k8p, v8p, table = k8, v8, None
    if page_size is not None:
        pages_per_seq = capacity // page_size
        num_pages = batch * pages_per_seq + 3
        table = torch.randperm(num_pages, device=DEVICE)[:batch * pages_per_seq].view(batch, pages_per_seq).int()
        k8p, v8p = _pool(k8, table, page_size, num_pages), _pool(v8, table, page_size, num_pages)
    out = torch.full(q.shape, float("nan"), device=DEVICE, dtype=q.dtype)
    flash_attn_with_kvcache(q_nan, k8p, v8p, cache_seqlens=lens, page_table=table, k_descale=kd, v_descale=vd,
                            out=out)
    assert out[0, 0, 5].isnan().all(), "the NaN query head's output is not NaN"
    out_clean = flash_attn_with_kvcache(q, k8p, v8p, cache_seqlens=lens, page_table=table, k_descale=kd,
                                        v_descale=vd)
    others = torch.ones(batch, 1, h, dtype=torch.bool, device=DEVICE)
    others[0, 0, 5] = False
    assert not out[others].isnan().any(), "NaN spread beyond the NaN query head"
    assert torch.equal(out[others], out_clean[others]), "other heads' results moved with the NaN head"
