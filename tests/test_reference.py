"""CPU self-check of flash_attn_cute.testing against a naive per-query loop.

The GPU tests trust ``attention_ref``; this file makes that trust earned: every mask
convention (bottom-right causal, windows, per-row key counts), softcap, GQA, varlen,
paged gather and fully masked rows are recomputed here one query at a time in float64.
"""

import math

import pytest
import torch

from flash_attn_cute.testing import (attention_kvcache_ref, attention_ref, attention_varlen_ref, check_close, check_lse,
                                     gather_paged_kv, is_close, visible_mask)


def naive_attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    seqlens_k=None):
    """One query row at a time, float64, visibility spelled out from the definition."""
    batch, sq, nheads, d = q.shape
    sk, nheads_kv, dv = k.shape[1], k.shape[2], v.shape[3]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    left, right = window_size
    out = torch.zeros(batch, sq, nheads, dv, dtype=torch.float64)
    lse = torch.full((batch, nheads, sq), float("-inf"), dtype=torch.float64)
    q, k, v = q.double(), k.double(), v.double()
    for b in range(batch):
        n_keys = sk if seqlens_k is None else int(seqlens_k[b])
        for h in range(nheads):
            hk = h // (nheads // nheads_kv)  # query head h reads kv head h // group
            for i in range(sq):
                diag = i + n_keys - sq
                visible = [
                    j for j in range(n_keys)
                    if (not causal or j <= diag)
                    and (left < 0 or j >= diag - left)
                    and (right < 0 or j <= diag + right)
                ]
                if not visible:
                    continue
                s = torch.stack([scale * torch.dot(q[b, i, h], k[b, j, hk]) for j in visible])
                if softcap > 0:
                    s = softcap * torch.tanh(s / softcap)
                m = s.max()
                p = torch.exp(s - m)
                lse[b, h, i] = m + torch.log(p.sum())
                out[b, i, h] = sum(p[t] * v[b, j, hk] for t, j in enumerate(visible)) / p.sum()
    return out, lse


def _qkv(batch, sq, sk, nheads, nheads_kv, d=8, dv=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    dv = d if dv is None else dv
    q = torch.randn(batch, sq, nheads, d, generator=g)
    k = torch.randn(batch, sk, nheads_kv, d, generator=g)
    v = torch.randn(batch, sk, nheads_kv, dv, generator=g)
    return q, k, v


def _assert_matches_naive(out, lse, out_n, lse_n):
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), out_n, atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_n))
    finite = torch.isfinite(lse_n)
    torch.testing.assert_close(lse.double()[finite], lse_n[finite], atol=1e-5, rtol=1e-5)


def test_causal_is_bottom_right_aligned():
    # 2 queries, 5 keys: the last query sits at the last key
    expected = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(visible_mask(2, 5, causal=True)[0, 0], expected)
    # 4 queries, 2 keys: the first two queries see nothing
    expected = torch.tensor([[0, 0], [0, 0], [1, 0], [1, 1]], dtype=torch.bool)
    assert torch.equal(visible_mask(4, 2, causal=True)[0, 0], expected)


def test_window_mask_by_hand():
    # 3 queries, 6 keys, diag(i) = i + 3; window (1, 1) keeps diag-1..diag+1
    expected = torch.tensor(
        [[0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(visible_mask(3, 6, window_size=(1, 1))[0, 0], expected)
    # (-1, -1) is no mask at all; causal overrides the right side to 0
    assert visible_mask(3, 6, window_size=(-1, -1)).all()
    assert torch.equal(visible_mask(3, 6, causal=True, window_size=(1, -1)),
                       visible_mask(3, 6, window_size=(1, 0)))


@pytest.mark.parametrize("sq,sk", [(1, 1), (1, 7), (5, 9), (9, 5), (6, 6)])
@pytest.mark.parametrize(
    "causal,window_size",
    [(False, (-1, -1)), (True, (-1, -1)), (False, (2, 1)), (False, (-1, 0)), (False, (1, -1)),
     (False, (0, 0)), (True, (3, -1))],
)
def test_masks_match_naive(sq, sk, causal, window_size):
    q, k, v = _qkv(2, sq, sk, 2, 2)
    out, lse = attention_ref(q, k, v, causal=causal, window_size=window_size)
    out_n, lse_n = naive_attention(q, k, v, causal=causal, window_size=window_size)
    _assert_matches_naive(out, lse, out_n, lse_n)


def test_softcap_and_scale_match_naive():
    q, k, v = _qkv(2, 5, 7, 2, 2, d=8)
    q = q * 4  # large scores, so the tanh cap really bites
    out, lse = attention_ref(q, k, v, softcap=2.0, softmax_scale=0.7)
    out_n, lse_n = naive_attention(q, k, v, softcap=2.0, softmax_scale=0.7)
    _assert_matches_naive(out, lse, out_n, lse_n)
    out_nocap, _ = attention_ref(q, k, v, softmax_scale=0.7)
    assert (out - out_nocap).abs().max() > 1e-2  # softcap did change the result


@pytest.mark.parametrize("nheads,nheads_kv", [(6, 2), (4, 1)])
def test_gqa_matches_naive_and_repeat(nheads, nheads_kv):
    q, k, v = _qkv(2, 4, 6, nheads, nheads_kv, d=8, dv=4)
    out, lse = attention_ref(q, k, v, causal=True)
    out_n, lse_n = naive_attention(q, k, v, causal=True)
    _assert_matches_naive(out, lse, out_n, lse_n)
    assert out.shape == (2, 4, nheads, 4) and lse.shape == (2, nheads, 4)
    g = nheads // nheads_kv
    out_mha, _ = attention_ref(q, k.repeat_interleave(g, 2), v.repeat_interleave(g, 2), causal=True)
    torch.testing.assert_close(out, out_mha)


def test_fully_masked_rows_are_zero_with_lse_minus_inf():
    q, k, v = _qkv(1, 6, 3, 2, 2)
    out, lse = attention_ref(q, k, v, causal=True)  # rows 0..2 see no key
    assert torch.equal(out[:, :3], torch.zeros_like(out[:, :3]))
    assert torch.isneginf(lse[:, :, :3]).all() and torch.isfinite(lse[:, :, 3:]).all()
    assert not torch.isnan(out).any()
    # a local window: query i sees keys i-4..i-3, so rows 0..2 see none
    out, lse = attention_ref(q, k, v, window_size=(1, 0))
    assert torch.equal(out[:, :3], torch.zeros_like(out[:, :3])) and torch.isneginf(lse[:, :, :3]).all()
    assert torch.isfinite(lse[:, :, 3:]).all()
    # no valid key at all: zero per-row key counts, and an empty key set
    out, lse = attention_ref(q, k, v, seqlens_k=torch.zeros(1, dtype=torch.int32))
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    out, lse = attention_ref(q, k[:, :0], v[:, :0])
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_seqlens_k_matches_naive():
    q, k, v = _qkv(3, 4, 9, 2, 1)
    seqlens_k = torch.tensor([9, 2, 5], dtype=torch.int32)
    for causal, window in [(False, (-1, -1)), (True, (-1, -1)), (False, (1, 0))]:
        out, lse = attention_ref(q, k, v, causal=causal, window_size=window, seqlens_k=seqlens_k)
        out_n, lse_n = naive_attention(q, k, v, causal=causal, window_size=window, seqlens_k=seqlens_k)
        _assert_matches_naive(out, lse, out_n, lse_n)


def test_varlen_matches_per_sequence_naive():
    seqlens_q = [0, 1, 5, 3, 2]
    seqlens_k = [4, 1, 7, 0, 2]  # an empty query sequence, and queries with no keys
    cu_q = torch.tensor([0] + torch.tensor(seqlens_q).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor(seqlens_k).cumsum(0).tolist(), dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(sum(seqlens_q), 4, 8, generator=g)
    k = torch.randn(sum(seqlens_k), 2, 8, generator=g)
    v = torch.randn(sum(seqlens_k), 2, 6, generator=g)
    out, lse = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True)
    assert out.shape == (q.shape[0], 4, 6) and lse.shape == (4, q.shape[0])
    for b in range(len(seqlens_q)):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        out_n, lse_n = naive_attention(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal=True)
        _assert_matches_naive(out[None, q0:q1], lse[None, :, q0:q1], out_n, lse_n)
    # sequence 3 has 3 queries and no keys
    assert torch.equal(out[6:9], torch.zeros_like(out[6:9])) and torch.isneginf(lse[:, 6:9]).all()


def test_paged_gather_matches_contiguous():
    batch, page_size, pages_per_seq, nheads_kv, d = 3, 4, 3, 2, 8
    g = torch.Generator().manual_seed(2)
    k_contig = torch.randn(batch, pages_per_seq * page_size, nheads_kv, d, generator=g)
    v_contig = torch.randn(batch, pages_per_seq * page_size, nheads_kv, d, generator=g)
    num_pages = batch * pages_per_seq + 2  # two pages belong to nobody
    page_table = torch.randperm(num_pages, generator=g)[: batch * pages_per_seq]
    page_table = page_table.view(batch, pages_per_seq).to(torch.int32)
    k_pages = torch.randn(num_pages, page_size, nheads_kv, d, generator=g)
    v_pages = torch.randn(num_pages, page_size, nheads_kv, d, generator=g)
    for b in range(batch):
        for p in range(pages_per_seq):
            rows = slice(p * page_size, (p + 1) * page_size)
            k_pages[page_table[b, p]] = k_contig[b, rows]
            v_pages[page_table[b, p]] = v_contig[b, rows]
    assert torch.equal(gather_paged_kv(k_pages, page_table), k_contig)

    q = torch.randn(batch, 2, 4, d, generator=g)
    cache_seqlens = torch.tensor([1, 12, 7], dtype=torch.int32)
    out_p, lse_p = attention_kvcache_ref(q, k_pages, v_pages, cache_seqlens, page_table, causal=True)
    out_c, lse_c = attention_kvcache_ref(q, k_contig, v_contig, cache_seqlens, causal=True)
    assert torch.equal(out_p, out_c) and torch.equal(lse_p, lse_c)
    out_n, lse_n = naive_attention(q, k_contig, v_contig, causal=True, seqlens_k=cache_seqlens)
    _assert_matches_naive(out_c, lse_c, out_n, lse_n)


def test_low_precision_mode():
    q, k, v = _qkv(2, 33, 47, 4, 2, d=64)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    out_ref, lse_ref = attention_ref(q, k, v, causal=True)
    out_lp, lse_lp = attention_ref(q, k, v, causal=True, upcast=False)
    assert out_ref.dtype == torch.float32 and out_lp.dtype == torch.bfloat16
    assert lse_lp.dtype == torch.float32
    err = (out_lp.float() - out_ref).abs().max().item()
    assert 0 < err < 5e-2  # PyTorch's own bf16 error: real, but small
    check_close(out_lp, out_ref, out_lp)  # trivially within 2x itself
    check_lse(lse_lp, lse_ref, lse_lp)


def test_check_close_rejects_nan_and_large_errors():
    ref = torch.randn(4, 8)
    low = ref.bfloat16()
    check_close(low, ref, low)
    bad = low.clone()
    bad[0, 0] = float("nan")
    assert not is_close(bad, ref, low)[0]
    with pytest.raises(AssertionError):
        check_close(bad, ref, low)
    with pytest.raises(AssertionError):
        check_close(low.float() + 0.1, ref, low)
    with pytest.raises(AssertionError):  # shape mismatch
        check_close(low[:2], ref, low)


def test_check_lse_minus_inf_must_match():
    lse_ref = torch.tensor([float("-inf"), 1.0, 2.0])
    check_lse(lse_ref.clone(), lse_ref, lse_ref + 1e-3)
    with pytest.raises(AssertionError):  # +inf where -inf is expected (FA2's old convention)
        check_lse(torch.tensor([float("inf"), 1.0, 2.0]), lse_ref, lse_ref)
    with pytest.raises(AssertionError):  # finite where -inf is expected
        check_lse(torch.tensor([0.0, 1.0, 2.0]), lse_ref, lse_ref)
    with pytest.raises(AssertionError):  # -inf where a finite value is expected
        check_lse(torch.tensor([float("-inf"), float("-inf"), 2.0]), lse_ref, lse_ref)


def test_attended_q_follows_each_launch():
    """A mixed plan's decode launch quantized its sequences' queries, the prefill launch did
    not: the reference takes each row as the launch that computed it took it."""
    from types import SimpleNamespace

    from flash_attn_cute.testing import RecordedLaunch, any_quantized_q, attended_q, quantize_q_ref

    def launch(q_class, quantize):
        plan = SimpleNamespace(config=SimpleNamespace(quantize_q=quantize))
        return RecordedLaunch(SimpleNamespace(q_class=q_class), plan)

    gen = torch.Generator().manual_seed(0)
    lens = [3, 20, 1, 40, 16]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    q = torch.randn(sum(lens), 4, 32, generator=gen).to(torch.bfloat16)
    qq, qf = quantize_q_ref(q), q.float()
    assert not torch.equal(qq, qf)
    mixed = [launch(16, True), launch(-16, False)]
    got = attended_q(q, mixed, cu)
    for b, n in enumerate(lens):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        assert torch.equal(got[rows], (qq if n <= 16 else qf)[rows]), (b, n)
    assert any_quantized_q(mixed) and not any_quantized_q([launch(0, False)])
    assert torch.equal(attended_q(q, [launch(0, True)], cu), qq)
    assert torch.equal(attended_q(q, [launch(-16, True)], cu)[:3], qf[:3])
    dense = q.view(1, -1, 4, 32)
    assert torch.equal(attended_q(dense, [launch(0, True)]), quantize_q_ref(dense))
    assert torch.equal(attended_q(dense, [launch(0, False)]), dense.float())
