"""GPU tests of FP8 K/V caches (e4m3 / e5m2 with fp16 / bf16 queries) against the fp32
reference computed on the dequantized values (``testing.dequantize_kv``).

The kernel widens the stored fp8 values exactly and applies ``k_descale`` to the scores,
``v_descale`` to the output; PyTorch's own error is measured on the same quantized inputs
(the dequantized K/V rounded to q's dtype), and the kernel's error is bounded by twice it
(``check_close``). Outputs are poisoned with NaN, and so are the cache rows past each
sequence's end (a TMA block reads them). FP8 K/V runs on the SM80 kernel (compute
capability >= 8.9) and on the SM90 kernel (Hopper: automatic selection takes it).

These are the widening kernels: on SM90 an e4m3 cache under 16-bit queries quantizes the
queries by default (the FP8 kernel, ``test_fp8_attention_gpu.py``), so this module sets
FLASH_ATTN_CUTE_SM90_FP8_KV=widen (``widening_kernel``), and its bound (2x PyTorch's error
in q's dtype) stays the widening kernel's.
"""

import pytest
import torch

from flash_attn_cute import flash_attn_varlen_func, flash_attn_with_kvcache, quantize_fp8
from flash_attn_cute.testing import attention_kvcache_ref, attention_serving_ref, check_close, check_lse, dequantize_kv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                       reason="needs a CUDA GPU of compute capability >= 8.9"),
]

DEVICE = "cuda"
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
# None: automatic selection; each kernel by name where this GPU runs it.
BACKENDS = [None, "sm80"] + (["sm90"] if HOPPER else [])


@pytest.fixture(autouse=True)
def widening_kernel(monkeypatch):
    """SM90: the FP8 cache widened to 16 bits (its queries are not quantized)."""
    monkeypatch.setenv("FLASH_ATTN_CUTE_SM90_FP8_KV", "widen")


def _i32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def _cache(batch, seqlen, hkv, d, fp8, granularity="batch_head", scale=1.0):
    """(fp8 cache, descale (batch, hkv) or (1,)): random keys of a few magnitudes per head."""
    x = torch.randn(batch, seqlen, hkv, d, device=DEVICE) * scale
    x = x * torch.linspace(0.25, 4.0, hkv, device=DEVICE).view(1, 1, hkv, 1)
    return quantize_fp8(x, granularity=granularity, dtype=fp8)


def _paged(dense8, table, page_size, num_pages):
    """A (num_pages, page_size, hkv, d) pool holding ``dense8`` (batch, pages x page_size,
    hkv, d) in the pages of ``table`` (the rest random bytes); scattered as bytes."""
    batch, pages_per_seq = table.shape
    pool = torch.randint(0, 120, (num_pages, page_size, *dense8.shape[2:]), device=DEVICE, dtype=torch.uint8)
    pool[table.long()] = dense8.view(torch.uint8).view(batch, pages_per_seq, page_size, *dense8.shape[2:])
    return pool.view(dense8.dtype)


def _poison_tails(cache8, lens):
    """A copy of a (batch, capacity, hkv, d) fp8 cache with NaN bytes past each length."""
    poisoned = cache8.view(torch.uint8).clone()
    for b, n in enumerate(lens.tolist()):
        poisoned[b, n:] = 0x7F  # NaN in e4m3 and in e5m2
    return poisoned.view(cache8.dtype)


def _check(out, lse, out_ref, lse_ref, out_torch, lse_torch):
    check_close(out, out_ref, out_torch)
    if lse is not None:
        check_lse(lse, lse_ref, lse_torch)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fp8,qdtype", [(E4M3, torch.bfloat16), (E4M3, torch.float16), (E5M2, torch.bfloat16)])
@pytest.mark.parametrize("seqlen_q,causal,num_splits", [(1, False, 0), (1, False, 5), (4, True, 0), (4, True, 3)])
def test_fp8_kvcache(backend, fp8, qdtype, seqlen_q, causal, num_splits):
    torch.manual_seed(0)
    batch, capacity, h, hkv, d = 3, 1000, 8, 2, 128
    q = torch.randn(batch, seqlen_q, h, d, device=DEVICE, dtype=qdtype)
    k8, kd = _cache(batch, capacity, hkv, d, fp8)
    v8, vd = _cache(batch, capacity, hkv, d, fp8, scale=3.0)
    lens = _i32([1000, 37, 513])
    out = torch.full_like(q, float("nan"))
    res = flash_attn_with_kvcache(q, _poison_tails(k8, lens), _poison_tails(v8, lens), cache_seqlens=lens,
                                  k_descale=kd, v_descale=vd, causal=causal, num_splits=num_splits, return_lse=True,
                                  out=out, backend=backend)
    assert res[0] is out
    k, v = dequantize_kv(k8, kd), dequantize_kv(v8, vd)
    out_ref, lse_ref = attention_kvcache_ref(q, k, v, lens, causal=causal)
    out_torch, lse_torch = attention_kvcache_ref(q, k.to(qdtype), v.to(qdtype), lens, causal=causal, upcast=False)
    _check(out, res[1], out_ref, lse_ref, out_torch, lse_torch)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("granularity", ["batch_head", "tensor"])
def test_fp8_paged_decode(backend, page_size, granularity):
    torch.manual_seed(1)
    batch, pages_per_seq, h, hkv, d = 4, 2048 // page_size, 32, 8, 128
    num_pages = batch * pages_per_seq + 3
    q = torch.randn(batch, 1, h, d, device=DEVICE, dtype=torch.bfloat16)
    # Quantize per (sequence, head) in the sequences' dense layout, then scatter into pages.
    k_dense8, kd = _cache(batch, pages_per_seq * page_size, hkv, d, E4M3, granularity)
    v_dense8, vd = _cache(batch, pages_per_seq * page_size, hkv, d, E4M3, granularity)
    table = torch.randperm(num_pages, device=DEVICE)[:batch * pages_per_seq].view(batch, pages_per_seq).int()
    k8, v8 = _paged(k_dense8, table, page_size, num_pages), _paged(v_dense8, table, page_size, num_pages)
    lens = _i32([2048, 1, 700, 1500])
    out = flash_attn_with_kvcache(q, k8, v8, cache_seqlens=lens, page_table=table, k_descale=kd, v_descale=vd,
                                  window_size=(300, 0), softcap=20.0, causal=True, backend=backend)
    k, v = dequantize_kv(k_dense8, kd), dequantize_kv(v_dense8, vd)
    kw = dict(causal=True, window_size=(300, 0), softcap=20.0)
    out_ref, _ = attention_kvcache_ref(q, k, v, lens, **kw)
    out_torch, _ = attention_kvcache_ref(q, k.bfloat16(), v.bfloat16(), lens, upcast=False, **kw)
    check_close(out, out_ref, out_torch)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_varlen_mixed_step(backend):
    # A serving step over an FP8 paged pool: decode rows, a spec-decode row, an empty row and
    # a prefill chunk (a mixed plan: two launches of one kernel), with a learnable sink.
    torch.manual_seed(2)
    page_size, h, hkv, d = 16, 8, 2, 128
    lens_q, lens_k = [1, 1, 5, 0, 300], [40, 900, 100, 9, 600]
    batch, pages_per_seq = len(lens_q), 64
    q = torch.randn(sum(lens_q), h, d, device=DEVICE, dtype=torch.bfloat16)
    k_dense8, kd = _cache(batch, pages_per_seq * page_size, hkv, d, E4M3)
    v_dense8, vd = _cache(batch, pages_per_seq * page_size, hkv, d, E4M3)
    table = torch.arange(batch * pages_per_seq, device=DEVICE).flip(0).view(batch, pages_per_seq).int()
    k8, v8 = _paged(k_dense8, table, page_size, batch * pages_per_seq), _paged(v_dense8, table, page_size,
                                                                           batch * pages_per_seq)
    cu_q = _i32([0, *torch.tensor(lens_q).cumsum(0).tolist()])
    sink = torch.randn(h, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    out, lse = flash_attn_varlen_func(q, k8, v8, cu_seqlens_q=cu_q, max_seqlen_q=max(lens_q), seqused_k=_i32(lens_k),
                                      page_table=table, causal=True, learnable_sink=sink, k_descale=kd,
                                      v_descale=vd, return_lse=True, out=out, num_splits=0, backend=backend)
    k, v = dequantize_kv(k_dense8, kd), dequantize_kv(v_dense8, vd)
    kw = dict(cu_seqlens_q=cu_q, seqused_k=_i32(lens_k), causal=True, learnable_sink=sink)
    out_ref, lse_ref = attention_serving_ref(q, k, v, **kw)
    out_torch, lse_torch = attention_serving_ref(q, k.bfloat16(), v.bfloat16(), upcast=False, **kw)
    _check(out, lse, out_ref, lse_ref, out_torch, lse_torch)


def test_fp8_unit_scales_for_bf16():
    # 16-bit caches: descales are checked and ignored (FA3; vLLM passes unit scales)
    q = torch.randn(2, 1, 8, 128, device=DEVICE, dtype=torch.bfloat16)
    k = torch.randn(2, 256, 2, 128, device=DEVICE, dtype=torch.bfloat16)
    ones = torch.ones(2, 2, device=DEVICE)
    ref = flash_attn_with_kvcache(q, k, k)
    torch.testing.assert_close(flash_attn_with_kvcache(q, k, k, k_descale=ones * 3, v_descale=ones), ref, rtol=0,
                               atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("d", [64, 96, 256, 80, 208])
def test_fp8_head_dims_and_gqa_packing(backend, d):
    # Other head dims (fp8 rows of 64 / 96 / 256 bytes: each its own smem swizzle; 80 and
    # 208: padded to the 96 and 256 tiles, FP8 head dims being multiples of 16) and a GQA
    # ratio of 8 packed into the decode tile, with a paged cache of page 32.
    torch.manual_seed(3)
    batch, pages_per_seq, page_size, h, hkv = 2, 24, 32, 16, 2
    q = torch.randn(batch, 2, h, d, device=DEVICE, dtype=torch.bfloat16)
    k_dense8, kd = _cache(batch, pages_per_seq * page_size, hkv, d, E4M3)
    v_dense8, vd = _cache(batch, pages_per_seq * page_size, hkv, d, E4M3)
    table = torch.randperm(batch * pages_per_seq, device=DEVICE).view(batch, pages_per_seq).int()
    k8, v8 = (_paged(x, table, page_size, batch * pages_per_seq) for x in (k_dense8, v_dense8))
    lens = _i32([pages_per_seq * page_size, 333])
    out = torch.full_like(q, float("nan"))
    flash_attn_with_kvcache(q, k8, v8, cache_seqlens=lens, page_table=table, k_descale=kd, v_descale=vd, causal=True,
                            out=out, backend=backend)
    k, v = dequantize_kv(k_dense8, kd), dequantize_kv(v_dense8, vd)
    out_ref, _ = attention_kvcache_ref(q, k, v, lens, causal=True)
    out_torch, _ = attention_kvcache_ref(q, k.bfloat16(), v.bfloat16(), lens, causal=True, upcast=False)
    check_close(out, out_ref, out_torch)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size,mode", [(16, "gather"), (16, "boxes"), (32, "boxes"), (64, "gather")])
def test_fp8_paged_nan_tails(backend, page_size, mode, monkeypatch):
    # The pages of a sequence past its length hold NaN bytes (a serving pool's stale or
    # unwritten slots): TMA pages (64) and boxes of pages smaller than a block (SM90 with
    # FLASH_ATTN_CUTE_SM90_PAGED_KV=boxes: 16, 32) read them in the block, row gathers may
    # not, and either way no NaN may reach O.
    monkeypatch.setenv("FLASH_ATTN_CUTE_SM90_PAGED_KV", mode)
    torch.manual_seed(4)
    batch, pages_per_seq, h, hkv, d = 3, 640 // page_size, 16, 4, 128
    q = torch.randn(batch, 1, h, d, device=DEVICE, dtype=torch.bfloat16)
    k_dense8, kd = _cache(batch, pages_per_seq * page_size, hkv, d, E4M3)
    v_dense8, vd = _cache(batch, pages_per_seq * page_size, hkv, d, E4M3)
    lens = _i32([640, 97, 321])
    table = torch.randperm(batch * pages_per_seq, device=DEVICE).view(batch, pages_per_seq).int()
    k8 = _paged(_poison_tails(k_dense8, lens), table, page_size, batch * pages_per_seq)
    v8 = _paged(_poison_tails(v_dense8, lens), table, page_size, batch * pages_per_seq)
    out = flash_attn_with_kvcache(q, k8, v8, cache_seqlens=lens, page_table=table, k_descale=kd, v_descale=vd,
                                  num_splits=0, backend=backend)
    k, v = dequantize_kv(k_dense8, kd), dequantize_kv(v_dense8, vd)
    out_ref, _ = attention_kvcache_ref(q, k, v, lens)
    out_torch, _ = attention_kvcache_ref(q, k.bfloat16(), v.bfloat16(), lens, upcast=False)
    check_close(out, out_ref, out_torch)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size,mode", [(64, "gather"), (16, "gather"), (16, "boxes")])
def test_fp8_prefill_chunk_over_pages(backend, page_size, mode, monkeypatch):
    # A chunked-prefill step over an FP8 paged cache (pages of 64: whole TMA blocks; of 16:
    # row gathers and the widening kernel, or on SM90 with FLASH_ATTN_CUTE_SM90_PAGED_KV=boxes
    # TMA boxes under the quantizing kernel's (192, 96) tile): 200 queries a sequence, causal
    # bottom-right, NaN bytes past each length, the LSE.
    monkeypatch.setenv("FLASH_ATTN_CUTE_SM90_PAGED_KV", mode)
    torch.manual_seed(5)
    batch, h, hkv, d = 2, 8, 2, 128
    pages_per_seq = 1024 // page_size
    q = torch.randn(batch, 200, h, d, device=DEVICE, dtype=torch.bfloat16)
    k_dense8, kd = _cache(batch, pages_per_seq * page_size, hkv, d, E4M3)
    v_dense8, vd = _cache(batch, pages_per_seq * page_size, hkv, d, E4M3)
    lens = _i32([1024, 400])
    table = torch.randperm(batch * pages_per_seq, device=DEVICE).view(batch, pages_per_seq).int()
    k8 = _paged(_poison_tails(k_dense8, lens), table, page_size, batch * pages_per_seq)
    v8 = _paged(_poison_tails(v_dense8, lens), table, page_size, batch * pages_per_seq)
    out = torch.full_like(q, float("nan"))
    res = flash_attn_with_kvcache(q, k8, v8, cache_seqlens=lens, page_table=table, k_descale=kd, v_descale=vd,
                                  causal=True, return_lse=True, out=out, backend=backend)
    k, v = dequantize_kv(k_dense8, kd), dequantize_kv(v_dense8, vd)
    out_ref, lse_ref = attention_kvcache_ref(q, k, v, lens, causal=True)
    out_torch, lse_torch = attention_kvcache_ref(q, k.bfloat16(), v.bfloat16(), lens, causal=True, upcast=False)
    _check(out, res[1], out_ref, lse_ref, out_torch, lse_torch)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_varlen_packed_keys(backend):
    # flash_attn_varlen_func over packed FP8 keys (cu_seqlens_k, no cache), one descale for
    # the tensor: a sequence of 0 keys, ragged queries, causal.
    torch.manual_seed(6)
    h, hkv, d = 8, 2, 128
    lens_q, lens_k = [3, 1, 130, 0], [300, 0, 500, 77]
    cu_q = _i32([0, *torch.tensor(lens_q).cumsum(0).tolist()])
    cu_k = _i32([0, *torch.tensor(lens_k).cumsum(0).tolist()])
    q = torch.randn(sum(lens_q), h, d, device=DEVICE, dtype=torch.bfloat16)
    k8, kd = quantize_fp8(torch.randn(sum(lens_k), hkv, d, device=DEVICE), granularity="tensor")
    v8, vd = quantize_fp8(torch.randn(sum(lens_k), hkv, d, device=DEVICE) * 2, granularity="tensor")
    out = torch.full_like(q, float("nan"))
    out, lse = flash_attn_varlen_func(q, k8, v8, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
                                      max_seqlen_k=max(lens_k), causal=True, k_descale=kd, v_descale=vd,
                                      return_lse=True, out=out, backend=backend)
    k, v = k8.float() * kd, v8.float() * vd
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
    out_ref, lse_ref = attention_serving_ref(q, k, v, **kw)
    out_torch, lse_torch = attention_serving_ref(q, k.bfloat16(), v.bfloat16(), upcast=False, **kw)
    _check(out, lse, out_ref, lse_ref, out_torch, lse_torch)
