"""GPU tests of FP8 attention (q, k and v in e4m3 with FA3's ``q_descale`` / ``k_descale`` /
``v_descale``, output bf16) on the SM90 kernel: both GEMMs in fp8 wgmma, V transposed in
shared memory, P rounded to e4m3.

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
from flash_attn_cute.testing import (attention_kvcache_ref, attention_ref, attention_varlen_ref, check_close, check_lse,
                                     dequantize_kv)

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
