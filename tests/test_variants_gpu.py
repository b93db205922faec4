"""GPU tests of user variants (score_mod / mask_mod / aux_tensors / block_mask) against
the fp32 reference, on every backend that runs here.

The same Python function runs in the kernel (compiled through the DSL) and in
``attention_ref`` (on torch index tensors): no second definition. Inputs are gaussian,
``out=`` is poisoned with NaN, errors are bounded by 2x PyTorch's own low-precision
error. Each case is one compile per backend (sequence lengths, batch and aux values are
runtime), so the cases are a curated list: every built-in variant, two user-written
ones, causal and not, varlen, split-KV, paged decode with GQA packing, block-mask
skipping against the predicate-only path, and fully masked rows.
"""

import pytest
import torch

from flash_attn_cute.testing import (attention_kvcache_ref, attention_ref, attention_varlen_ref, backends_on_this_gpu,
                                     bias_table_mod, check_close, check_lse)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEVICE = "cuda"


def _fa():
    import flash_attn_cute

    return flash_attn_cute


@pytest.fixture(params=backends_on_this_gpu())
def backend(request):
    return request.param


def randn(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device=DEVICE, dtype=dtype)


# ------------------------------------------------------------------------------ user-written variants
# (the bias-table score_mod is testing.bias_table_mod, shared with the compile tests)

def per_head_mask(b, h, q_idx, kv_idx, aux):
    """A user-written mask_mod: head h drops every key congruent to 1 mod (h + 2), and
    keys more than 300 positions ahead of the query."""
    return (kv_idx % (h + 2) != 1) & (kv_idx - q_idx <= 300)


def empty_rows(b, h, q_idx, kv_idx, aux):
    """Queries with q_idx % 7 == 3 see no key at all (out 0, lse -inf)."""
    return q_idx % 7 != 3


def doc_ids(batch, seqlen, doc_len, device=DEVICE):
    """(batch, seqlen) int32 document ids: documents of ~doc_len tokens, offset per row."""
    pos = torch.arange(seqlen, device=device)
    return torch.stack([(pos + 37 * b) // doc_len for b in range(batch)]).to(torch.int32)


def _run_func(fa, backend, q, k, v, *, ref_kwargs, api_kwargs, mult=2.0):
    out = torch.full_like(q[..., : v.shape[-1]], float("nan"))
    out, lse = fa.flash_attn_func(q, k, v, out=out, return_lse=True, backend=backend, **api_kwargs)
    ref_out, ref_lse = attention_ref(q, k, v, **ref_kwargs)
    pt_out, pt_lse = attention_ref(q, k, v, upcast=False, **ref_kwargs)
    check_close(out, ref_out, pt_out, mult=mult)
    check_lse(lse, ref_lse, pt_lse)
    return out, lse


CASES = {
    # name: (score_mod factory, mask_mod factory, aux builder (b, h, sq, sk) -> list, causal)
    "alibi": (lambda: _fa().mods.alibi(), None, lambda b, h, sq, sk: [_fa().mods.alibi_slopes(h)], False),
    "alibi_causal": (lambda: _fa().mods.alibi(), None, lambda b, h, sq, sk: [_fa().mods.alibi_slopes(h)], True),
    "rel_bias": (lambda: _fa().mods.relative_position_bias(64), None,
                 lambda b, h, sq, sk: [randn(h, 129, dtype=torch.float32)], True),
    "softcap": (lambda: _fa().mods.softcap(5.0), None, lambda b, h, sq, sk: None, True),
    "bias_table": (lambda: bias_table_mod, None, lambda b, h, sq, sk: [randn(h, 16, 16, dtype=torch.bfloat16)], False),
    "document": (None, lambda: _fa().mods.document_mask(), lambda b, h, sq, sk: [doc_ids(b, sk, 100)], True),
    "prefix_lm": (None, lambda: _fa().mods.prefix_lm(),
                  lambda b, h, sq, sk: [torch.randint(0, sk, (b,), device=DEVICE, dtype=torch.int32)], False),
    "sliding": (None, lambda: _fa().mods.sliding_window(64), lambda b, h, sq, sk: None, False),
    "per_head": (None, lambda: per_head_mask, lambda b, h, sq, sk: None, False),
    "alibi_document": (lambda: _fa().mods.alibi(0), lambda: _fa().mods.document_mask(1),
                       lambda b, h, sq, sk: [_fa().mods.alibi_slopes(h), doc_ids(b, sk, 150)], True),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("seqlens", [(257, 257), (128, 384), (1, 300)])
def test_variant_func(backend, name, seqlens):
    fa = _fa()
    torch.manual_seed(hash(name) % 1000)
    score_f, mask_f, aux_f, causal = CASES[name]
    sq, sk = seqlens
    if name in ("document", "alibi_document") and sq != sk:
        pytest.skip("document masks are self-attention (q and k share positions)")
    b, h = 2, 4
    q, k, v = randn(b, sq, h, 128), randn(b, sk, h, 128), randn(b, sk, h, 128)
    score_mod = score_f() if score_f else None
    mask_mod = mask_f() if mask_f else None
    aux = aux_f(b, h, sq, sk)
    kw = dict(causal=causal, score_mod=score_mod, mask_mod=mask_mod, aux_tensors=aux)
    _run_func(fa, backend, q, k, v, ref_kwargs=kw, api_kwargs=kw)


@pytest.mark.parametrize("name", ["document", "prefix_lm", "sliding", "per_head", "alibi_document"])
def test_block_mask_matches_predicate(backend, name):
    """With a block mask (empty blocks skipped, full ones without the predicate) the result
    equals the predicate-only path and the reference; the causal flag composes."""
    fa = _fa()
    torch.manual_seed(1)
    score_f, mask_f, aux_f, causal = CASES[name]
    b, h, s = 2, 4, 777
    q, k, v = randn(b, s, h, 128), randn(b, s, h, 128), randn(b, s, h, 128)
    score_mod, mask_mod, aux = (score_f() if score_f else None), mask_f(), aux_f(b, h, s, s)
    bm = fa.create_block_mask(mask_mod, b, h, s, s, aux_tensors=aux, device=DEVICE)
    assert 0 < bm.sparsity() < 1 or name == "per_head"
    kw = dict(causal=causal, score_mod=score_mod, mask_mod=mask_mod, aux_tensors=aux)
    out_pred, lse_pred = _run_func(fa, backend, q, k, v, ref_kwargs=kw, api_kwargs=kw)
    api = dict(causal=causal, score_mod=score_mod, aux_tensors=aux, block_mask=bm)
    out_bm, lse_bm = _run_func(fa, backend, q, k, v, ref_kwargs=kw, api_kwargs=api)
    torch.testing.assert_close(out_bm.float(), out_pred.float(), atol=2e-2, rtol=0)
    torch.testing.assert_close(lse_bm, lse_pred, atol=1e-3, rtol=0)


def test_block_mask_broadcast_and_empty_rows(backend):
    """A block mask built with batch/nheads None broadcasts; fully masked rows give out 0
    and lse -inf (with and without the block mask)."""
    fa = _fa()
    torch.manual_seed(2)
    b, h, s = 3, 2, 300
    q, k, v = randn(b, s, h, 64), randn(b, s, h, 64), randn(b, s, h, 64)
    bm = fa.create_block_mask(empty_rows, None, None, s, s, device=DEVICE, block_size=64)
    kw = dict(mask_mod=empty_rows)
    for api in (kw, dict(block_mask=bm)):
        out, lse = _run_func(fa, backend, q, k, v, ref_kwargs=kw, api_kwargs=api)
        rows = torch.arange(s, device=DEVICE) % 7 == 3
        assert torch.all(out[:, rows] == 0) and torch.all(torch.isinf(lse[:, :, rows]))


def test_variant_varlen(backend):
    fa = _fa()
    torch.manual_seed(3)
    h = 4
    lens = [300, 1, 129, 64]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=DEVICE, dtype=torch.int32)
    total = int(cu[-1])
    q, k, v = randn(total, h, 128), randn(total, h, 128), randn(total, h, 128)
    docs = doc_ids(len(lens), max(lens), 50)
    kw = dict(causal=True, score_mod=fa.mods.alibi(0), mask_mod=fa.mods.document_mask(1),
              aux_tensors=[fa.mods.alibi_slopes(h), docs])
    out = torch.full_like(q, float("nan"))
    out, lse = fa.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), out=out, return_lse=True,
                                         backend=backend, **kw)
    ref_out, ref_lse = attention_varlen_ref(q, k, v, cu, cu, **kw)
    pt_out, pt_lse = attention_varlen_ref(q, k, v, cu, cu, upcast=False, **kw)
    check_close(out, ref_out, pt_out)
    check_lse(lse, ref_lse, pt_lse)


def test_variant_split_kv(backend):
    fa = _fa()
    torch.manual_seed(4)
    b, h, sq, sk = 2, 4, 3, 2000
    q, k, v = randn(b, sq, h, 128), randn(b, sk, h, 128), randn(b, sk, h, 128)
    kw = dict(score_mod=fa.mods.alibi(), mask_mod=per_head_mask, aux_tensors=[fa.mods.alibi_slopes(h)])
    for num_splits in (3, 0):
        _run_func(fa, backend, q, k, v, ref_kwargs=kw, api_kwargs=dict(kw, num_splits=num_splits))


@pytest.mark.parametrize("page_size", [16, 64])
def test_variant_paged_decode_gqa(backend, page_size):
    """Decode against a paged cache with GQA packing: ``head`` is the query head inside the
    kernel (per-head slopes and a per-head mask would be wrong with the KV head)."""
    fa = _fa()
    torch.manual_seed(5)
    b, h, hkv, sq, cap = 3, 8, 2, 2, 1024
    pages = cap // page_size
    k_cache, v_cache = randn(b * pages, page_size, hkv, 128), randn(b * pages, page_size, hkv, 128)
    table = torch.randperm(b * pages, device=DEVICE, dtype=torch.int32).view(b, pages)
    seqlens = torch.tensor([1, 517, 1024], device=DEVICE, dtype=torch.int32)
    q = randn(b, sq, h, 128)
    kw = dict(score_mod=fa.mods.alibi(), mask_mod=per_head_mask, aux_tensors=[fa.mods.alibi_slopes(h)])
    out = torch.full_like(q, float("nan"))
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, seqlens, page_table=table, out=out, return_lse=True,
                                         pack_gqa=True, backend=backend, **kw)
    ref_out, ref_lse = attention_kvcache_ref(q, k_cache, v_cache, seqlens, page_table=table, **kw)
    pt_out, pt_lse = attention_kvcache_ref(q, k_cache, v_cache, seqlens, page_table=table, upcast=False, **kw)
    check_close(out, ref_out, pt_out)
    check_lse(lse, ref_lse, pt_lse)


def test_new_aux_values_do_not_recompile(backend):
    """New slopes / ids are runtime data: one compile, results follow the data."""
    fa = _fa()
    from flash_attn_cute.host import jit_cache

    torch.manual_seed(6)
    b, h, s = 1, 4, 200
    q, k, v = randn(b, s, h, 128), randn(b, s, h, 128), randn(b, s, h, 128)
    mod = fa.mods.alibi()
    kw = dict(score_mod=mod, aux_tensors=[fa.mods.alibi_slopes(h)])
    _run_func(fa, backend, q, k, v, ref_kwargs=kw, api_kwargs=kw)
    builds = lambda: jit_cache.stats()["compiles"] + jit_cache.stats()["disk_loads"]  # noqa: E731
    before = builds()
    slopes = torch.rand(h, device=DEVICE)
    kw = dict(score_mod=mod, aux_tensors=[slopes])
    _run_func(fa, backend, q, k, v, ref_kwargs=kw, api_kwargs=kw)
    assert builds() == before


def test_bad_variant_inputs(backend):
    fa = _fa()
    q = randn(1, 64, 2, 128)

    def uses_if(score, b, h, q_idx, kv_idx, aux):
        if score > 0:
            return score
        return -score

    with pytest.raises(fa.VariantCompileError, match="uses_if.*if score > 0"):
        fa.flash_attn_func(q, q, q, score_mod=uses_if, backend=backend)
    with pytest.raises(ValueError, match=r"aux_tensors\[0\] is on cpu"):
        fa.flash_attn_func(q, q, q, score_mod=fa.mods.alibi(), aux_tensors=[torch.ones(2)], backend=backend)
    with pytest.raises(TypeError, match=r"aux_tensors\[0\] has dtype torch.complex64"):
        fa.flash_attn_func(q, q, q, score_mod=fa.mods.alibi(),
                           aux_tensors=[torch.ones(2, device=DEVICE, dtype=torch.complex64)], backend=backend)
    with pytest.raises(ValueError, match="softcap and score_mod"):
        fa.flash_attn_func(q, q, q, score_mod=fa.mods.alibi(), softcap=3.0,
                           aux_tensors=[fa.mods.alibi_slopes(2)], backend=backend)
