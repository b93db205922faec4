"""CPU tests of everything host-side: argument validation, window/causal normalisation,
heuristics, backend selection, early exits and the split-KV/combine plumbing.

No GPU is needed: shape and dtype checks come before the device check, so CPU tensors
exercise them; the device check itself is tested on CPU tensors and on stand-ins. The
plumbing tests replace the kernel and the combine kernel by PyTorch fakes that assert
the kernel call contract (shapes, dtypes, keyword arguments) and compute the same
partial results, then compare the public API's output with flash_attn_cute.testing.
"""

import importlib
import math
from types import SimpleNamespace

import pytest
import torch

import flash_attn_cute
from flash_attn_cute import interface, seam, sm80
from flash_attn_cute.api import checks
from flash_attn_cute.host import heuristics
from flash_attn_cute.host.heuristics import ceildiv, num_splits_heuristic, should_pack_gqa
from flash_attn_cute.interface import (flash_attn_combine, flash_attn_func, flash_attn_varlen_func,
                                       flash_attn_with_kvcache, normalize_window)
from flash_attn_cute.testing import attention_kvcache_ref, attention_ref, attention_varlen_ref, visible_mask

F16, BF16 = torch.float16, torch.bfloat16


def make_qkv(b=2, sq=5, sk=7, h=4, hk=2, d=64, dv=64, dtype=F16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=g).to(dtype)
    k = torch.randn(b, sk, hk, d, generator=g).to(dtype)
    v = torch.randn(b, sk, hk, dv, generator=g).to(dtype)
    return q, k, v


def make_varlen(lens_q=(3, 0, 5), lens_k=(4, 2, 0), h=4, hk=2, d=64, dv=64, dtype=F16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), h, d, generator=g).to(dtype)
    k = torch.randn(sum(lens_k), hk, d, generator=g).to(dtype)
    v = torch.randn(sum(lens_k), hk, dv, generator=g).to(dtype)
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k)


# ---------------------------------------------------------------------------------------
# Fakes of the kernels (contract checkers) and the fixture that installs them
# ---------------------------------------------------------------------------------------

KERNEL_KWARGS = {"cu_seqlens_q", "cu_seqlens_k", "seqused_k", "page_table", "max_seqlen_q", "softmax_scale",
                 "causal", "window_left", "window_right", "softcap", "num_splits", "pack_gqa"}


def _partials(q, k, v, seqlens_k, ns, *, scale, causal, wl, wr, softcap):
    """(ns, b, sq, h, dv), (ns, b, h, sq): attention restricted to key chunk i of ns."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    kf = k.float().repeat_interleave(h // hk, 2)
    vf = v.float().repeat_interleave(h // hk, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), kf) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    mask = visible_mask(sq, sk, seqlens_k, causal=causal, window_size=(wl, wr))
    chunk, j = ceildiv(max(sk, 1), ns), torch.arange(sk)
    outs, lses = [], []
    for i in range(ns):
        si = s.masked_fill(~(mask & (j >= i * chunk) & (j < (i + 1) * chunk)), -math.inf)
        lse = torch.logsumexp(si, -1)
        p = torch.exp(si - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
        outs.append(torch.einsum("bhqk,bkhd->bqhd", p, vf))
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def fake_kernel(q, k, v, out, lse, **kw):
    """Checks the interface -> kernel contract, then writes what the kernel would."""
    assert set(kw) == KERNEL_KWARGS, set(kw) ^ KERNEL_KWARGS
    ns, varlen = kw["num_splits"], kw["cu_seqlens_q"] is not None
    batch = kw["cu_seqlens_q"].shape[0] - 1 if varlen else q.shape[0]
    lse_shape = (q.shape[1], q.shape[0]) if varlen else (batch, q.shape[2], q.shape[1])
    o_shape = (*q.shape[:-1], v.shape[-1])
    if ns > 1:
        assert out.dtype == torch.float32 and tuple(out.shape) == (ns, *o_shape)
        assert lse is not None and lse.dtype == torch.float32 and tuple(lse.shape) == (ns, *lse_shape)
    else:
        assert out.dtype == q.dtype and tuple(out.shape) == o_shape
        assert lse is None or (lse.dtype == torch.float32 and tuple(lse.shape) == lse_shape)
    assert isinstance(kw["softmax_scale"], float) and isinstance(kw["softcap"], float)
    assert isinstance(kw["pack_gqa"], bool) and isinstance(kw["max_seqlen_q"], int)
    assert not kw["causal"] or kw["window_right"] == 0, "causal must come with window_right = 0"
    fake_kernel.calls.append(kw)
    if kw["page_table"] is not None:
        from flash_attn_cute.testing import gather_paged_kv

        k, v = gather_paged_kv(k, kw["page_table"]), gather_paged_kv(v, kw["page_table"])
    mask_kw = dict(scale=kw["softmax_scale"], causal=kw["causal"], wl=kw["window_left"], wr=kw["window_right"],
                   softcap=kw["softcap"])
    o_full = out if ns > 1 else out.unsqueeze(0)
    l_full = lse if ns > 1 else (None if lse is None else lse.unsqueeze(0))
    if not varlen:
        op, lp = _partials(q, k, v, kw["seqused_k"], ns, **mask_kw)
        o_full.copy_(op)
        if l_full is not None:
            l_full.copy_(lp)
        return
    cq, ck = kw["cu_seqlens_q"].tolist(), kw["cu_seqlens_k"].tolist()
    for b in range(batch):
        if cq[b + 1] > cq[b]:
            op, lp = _partials(q[None, cq[b]:cq[b + 1]], k[None, ck[b]:ck[b + 1]], v[None, ck[b]:ck[b + 1]],
                               None, ns, **mask_kw)
            o_full[:, cq[b]:cq[b + 1]] = op[:, 0]
            if l_full is not None:
                l_full[..., cq[b]:cq[b + 1]] = lp[:, 0]


def fake_combine(out_partial, lse_partial, out, lse, sink):
    """Checks the combine contract (batched views, even for varlen), then merges (the sink:
    one more logit per head, with no value)."""
    ns, b, s, h, dv = out_partial.shape
    assert tuple(lse_partial.shape) == (ns, b, h, s) and tuple(out.shape) == (b, s, h, dv)
    assert lse is None or tuple(lse.shape) == (b, h, s)
    assert out_partial.dtype == lse_partial.dtype == torch.float32
    assert sink is None or (sink.dtype == torch.float32 and tuple(sink.shape) == (h,))
    fake_combine.calls += 1
    tot = torch.logsumexp(lse_partial, 0)
    if sink is not None:
        tot = torch.logaddexp(tot, sink.view(1, h, 1))
    w = torch.exp(lse_partial - torch.where(torch.isinf(tot), 0.0, tot))
    out.copy_(torch.einsum("nbhs,nbshd->bshd", w, out_partial))
    if lse is not None:
        lse.copy_(tot)


def _refuse(*args, **kwargs):
    raise AssertionError("a kernel was launched although there was nothing to compute")


def _fake_backend(kernel):
    """The SM80 backend's real check and plan, with ``kernel`` in place of its launcher:
    the seam's launch contract translated to the keyword form fake_kernel asserts."""

    def launcher(problem, plan, device=None):
        def launch(t):
            # none of this file's calls has them
            assert t.seqused_q is None and t.learnable_sink is None and t.k_descale is None and t.v_descale is None
            assert t.leftpad_k is None and t.aux0 is None and t.block_ranges is None
            kernel(t.q, t.k, t.v, t.out, t.lse, cu_seqlens_q=t.cu_seqlens_q, cu_seqlens_k=t.cu_seqlens_k,
                   seqused_k=t.seqused_k, page_table=t.page_table, max_seqlen_q=problem.max_seqlen_q,
                   softmax_scale=problem.softmax_scale,
                   causal=problem.causal, window_left=problem.window_left, window_right=problem.window_right,
                   softcap=problem.softcap, num_splits=plan.num_splits, pack_gqa=plan.pack_gqa)

        return launch

    return SimpleNamespace(AUTO=True, runs_on=sm80.runs_on, check=sm80.check, plan=sm80.plan,
                           launcher=launcher)


@pytest.fixture
def fake_gpu(fake_device, monkeypatch):
    """CPU tensors pass as a 132-SM Hopper GPU running the fake kernels."""
    fake_kernel.calls, fake_combine.calls = [], 0
    fake_device(lambda name, kind="fwd": _fake_backend(fake_kernel))
    fake_combine.split_groups = []

    def launcher(out_dtype, d_v, has_lse, has_sink=False, split_groups=1, arch=None):
        fake_combine.split_groups.append(split_groups)
        return fake_combine

    monkeypatch.setattr(seam, "combine_launcher", launcher)
    yield SimpleNamespace(kernel=fake_kernel, combine=fake_combine)


@pytest.fixture
def no_launch(fake_gpu, monkeypatch):
    monkeypatch.setattr(seam, "backend_module", lambda name, kind="fwd": _fake_backend(_refuse))
    monkeypatch.setattr(seam, "combine_launcher", _refuse)
    monkeypatch.setattr(heuristics, "num_sms", _refuse)


def close(a, b, tol=5e-3):
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol, equal_nan=False)


# ---------------------------------------------------------------------------------------
# Validation: each case breaks exactly one argument of an otherwise valid call
# ---------------------------------------------------------------------------------------


def _func_case(mutate):
    q, k, v = make_qkv()
    args = dict(q=q, k=k, v=v)
    mutate(args)
    return lambda: flash_attn_func(args.pop("q"), args.pop("k"), args.pop("v"), **args)


# Each row is one rule of the contract: (id, mutation, exception, message fragment).
FUNC_CASES = [
    ("q_not_tensor", lambda a: a.update(q=a["q"].tolist()), TypeError, "q must be a torch.Tensor"),
    ("q_fp32", lambda a: a.update(q=a["q"].float()), TypeError, "q must be float16, bfloat16"),
    ("k_dtype_mixed", lambda a: a.update(k=a["k"].to(BF16)), TypeError, "k must be torch.float16"),
    ("v_dtype_mixed", lambda a: a.update(v=a["v"].to(BF16)), TypeError, "v must be torch.float16"),
    ("q_rank3", lambda a: a.update(q=a["q"][0]), ValueError, r"q must have shape \(batch, seqlen_q"),
    ("k_rank5", lambda a: a.update(k=a["k"][None]), ValueError, r"k must have shape"),
    ("batch_mismatch", lambda a: a.update(k=a["k"][:1], v=a["v"][:1]), ValueError, "batch size of q"),
    ("k_v_seqlen_mismatch", lambda a: a.update(v=a["v"][:, :3]), ValueError, "must agree on all but the last"),
    ("k_v_heads_mismatch", lambda a: a.update(v=a["v"][:, :, :1]), ValueError, "must agree on all but the last"),
    ("k_headdim_mismatch", lambda a: a.update(k=torch.zeros(2, 7, 2, 128, dtype=F16)), ValueError,
     "k head dimension"),
    ("heads_not_multiple", lambda a: a.update(k=torch.zeros(2, 7, 3, 64, dtype=F16),
                                              v=torch.zeros(2, 7, 3, 64, dtype=F16)), ValueError,
     "multiple of nheads_kv"),
    ("d_unsupported", lambda a: a.update(q=torch.zeros(2, 5, 4, 84, dtype=F16),
                                         k=torch.zeros(2, 7, 2, 84, dtype=F16)), ValueError,
     r"q/k head dimension must be a multiple of 8 in \[8, 256\], got 84"),
    ("dv_unsupported", lambda a: a.update(v=torch.zeros(2, 7, 2, 264, dtype=F16)), ValueError,
     r"v head dimension must be a multiple of 8 in \[8, 256\], got 264"),
    ("q_last_dim_strided", lambda a: a.update(q=torch.zeros(2, 5, 64, 4, dtype=F16).transpose(2, 3)),
     ValueError, "q must have a contiguous last dimension"),
    ("k_misaligned_stride", lambda a: a.update(k=torch.zeros(2, 7, 2, 68, dtype=F16)[..., :64]), ValueError,
     "k must be 16-byte aligned"),
    ("v_misaligned_pointer", lambda a: a.update(v=torch.zeros(2 * 7 * 2 * 64 + 1, dtype=F16)[1:]
                                                .view(2, 7, 2, 64)), ValueError, "v must be 16-byte aligned"),
    ("num_splits_negative", lambda a: a.update(num_splits=-1), ValueError, "num_splits must be in"),
    ("num_splits_too_many", lambda a: a.update(num_splits=257), ValueError, "num_splits must be in"),
    ("num_splits_float", lambda a: a.update(num_splits=2.0), TypeError, "num_splits must be an int"),
    ("window_left_negative", lambda a: a.update(window_size=(-2, -1)), ValueError, "window_size"),
    ("window_right_negative", lambda a: a.update(window_size=(3, -7)), ValueError, "window_size"),
    ("window_over_int32", lambda a: a.update(window_size=(2**31, -1)), ValueError, "window_size"),
    ("window_not_pair", lambda a: a.update(window_size=(3,)), TypeError, "window_size must be a pair"),
    ("window_float", lambda a: a.update(window_size=(3.5, 0)), TypeError, "window_size"),
    ("softcap_negative", lambda a: a.update(softcap=-1.0), ValueError, "softcap must be >= 0"),
    ("softcap_str", lambda a: a.update(softcap="1"), TypeError, "softcap must be a float"),
    ("scale_str", lambda a: a.update(softmax_scale="0.1"), TypeError, "softmax_scale"),
    ("scale_inf", lambda a: a.update(softmax_scale=math.inf), ValueError, "softmax_scale must be finite"),
    ("causal_str", lambda a: a.update(causal="yes"), TypeError, "causal must be a bool"),
    ("pack_gqa_str", lambda a: a.update(pack_gqa="auto"), TypeError, "pack_gqa"),
    ("two_level_negative", lambda a: a.update(fp8_two_level_interval=-1), ValueError,
     r"fp8_two_level_interval must be in \[0, 2147483647\], got -1"),
    ("two_level_float", lambda a: a.update(fp8_two_level_interval=4.0), TypeError,
     "fp8_two_level_interval must be an int"),
    ("two_level_bool", lambda a: a.update(fp8_two_level_interval=True), TypeError,
     "fp8_two_level_interval must be an int"),
    ("out_shape", lambda a: a.update(out=torch.zeros(2, 5, 4, 128, dtype=F16)), ValueError, "out must have shape"),
    ("out_dtype", lambda a: a.update(out=torch.zeros(2, 5, 4, 64, dtype=BF16)), TypeError, "out must be"),
    ("out_strided", lambda a: a.update(out=torch.zeros(2, 5, 64, 4, dtype=F16).transpose(2, 3)), ValueError,
     "out must have a contiguous last dimension"),
    ("backend_unknown", lambda a: a.update(backend="sm75"), ValueError, "backend must be one of"),
    # FA3's keywords: accepted at what changes nothing here, refused where they ask for more
    ("qv_given", lambda a: a.update(qv=torch.zeros(2, 5, 4, 64, dtype=F16)), NotImplementedError,
     "qv .* not supported: MLA decode is flash_attn_cute.flash_mla_decode"),
    ("attention_chunk", lambda a: a.update(attention_chunk=128), NotImplementedError,
     r"attention_chunk=128 \(chunked local attention\) is not supported"),
    ("attention_chunk_negative", lambda a: a.update(attention_chunk=-1), ValueError, "attention_chunk must be in"),
    ("deterministic_str", lambda a: a.update(deterministic="yes"), TypeError, "deterministic must be a bool"),
    ("sm_margin_negative", lambda a: a.update(sm_margin=-1), ValueError, "sm_margin must be in"),
    ("sm_margin_float", lambda a: a.update(sm_margin=1.5), TypeError, "sm_margin must be an int"),
    ("cpu_tensors", lambda a: None, ValueError, "q must be a CUDA tensor"),
]


@pytest.mark.parametrize("mutate,exc,match", [c[1:] for c in FUNC_CASES], ids=[c[0] for c in FUNC_CASES])
def test_flash_attn_func_refuses(mutate, exc, match, monkeypatch):
    monkeypatch.delenv("FLASH_ATTN_CUTE_BACKEND", raising=False)
    with pytest.raises(exc, match=match):
        _func_case(mutate)()


def _varlen_case(mutate):
    q, k, v, cq, ck, mq, mk = make_varlen()
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=mq, max_seqlen_k=mk)
    mutate(args)
    return lambda: flash_attn_varlen_func(**args)


# One row per varlen-specific rule (the shared q/k/v rules are covered above).
VARLEN_CASES = [
    ("q_rank4", lambda a: a.update(q=a["q"][None]), ValueError, r"q must have shape \(total_q"),
    ("k_rank4", lambda a: a.update(k=a["k"][None]), ValueError, r"k must have shape \(total_k"),
    ("cu_q_int64", lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"].long()), TypeError, "cu_seqlens_q must be int32"),
    ("cu_q_2d", lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"][None]), ValueError, "cu_seqlens_q must have shape"),
    ("cu_q_empty", lambda a: a.update(cu_seqlens_q=torch.zeros(0, dtype=torch.int32)), ValueError, "cu_seqlens_q"),
    ("cu_k_length", lambda a: a.update(cu_seqlens_k=a["cu_seqlens_k"][:-1]), ValueError, "cu_seqlens_k must have"),
    ("cu_k_list", lambda a: a.update(cu_seqlens_k=[0, 4, 6, 6]), TypeError, "cu_seqlens_k must be a torch.Tensor"),
    ("cu_k_strided", lambda a: a.update(cu_seqlens_k=torch.zeros(8, dtype=torch.int32)[::2]), ValueError,
     "cu_seqlens_k must be contiguous"),
    ("max_q_negative", lambda a: a.update(max_seqlen_q=-1), ValueError, "max_seqlen_q"),
    ("max_k_float", lambda a: a.update(max_seqlen_k=4.0), TypeError, "max_seqlen_k must be an int"),
    ("out_shape", lambda a: a.update(out=torch.zeros(8, 4, 32, dtype=F16)), ValueError, r"out must have shape"),
    ("cpu_tensors", lambda a: None, ValueError, "q must be a CUDA tensor"),
]


@pytest.mark.parametrize("mutate,exc,match", [c[1:] for c in VARLEN_CASES], ids=[c[0] for c in VARLEN_CASES])
def test_flash_attn_varlen_func_refuses(mutate, exc, match):
    with pytest.raises(exc, match=match):
        _varlen_case(mutate)()


def _kvcache_case(mutate, paged):
    q, _, _ = make_qkv(sq=2)
    if paged:  # 6 pages of 3 slots, 2 sequences of up to 3 pages
        k, v = torch.randn(6, 3, 2, 64).to(F16), torch.randn(6, 3, 2, 64).to(F16)
        args = dict(page_table=torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32))
    else:
        k, v = torch.randn(2, 9, 2, 64).to(F16), torch.randn(2, 9, 2, 64).to(F16)
        args = {}
    args.update(q=q, k_cache=k, v_cache=v, cache_seqlens=torch.tensor([4, 9], dtype=torch.int32))
    mutate(args)
    return lambda: flash_attn_with_kvcache(**args)


# (id, paged?, mutation, exception, fragment): paged and contiguous caches have different
# shape rules, so the capacity and batch rules appear for both.
KVCACHE_CASES = [
    ("cache_batch", False, lambda a: a.update(k_cache=a["k_cache"][:1], v_cache=a["v_cache"][:1]), ValueError,
     "k_cache and v_cache must have shape"),
    ("cache_v_len", False, lambda a: a.update(v_cache=a["v_cache"][:, :4]), ValueError, "must agree on all"),
    ("seqlens_int64", False, lambda a: a.update(cache_seqlens=a["cache_seqlens"].long()), TypeError,
     "cache_seqlens must be int32"),
    ("seqlens_length", False, lambda a: a.update(cache_seqlens=a["cache_seqlens"][:1]), ValueError,
     "cache_seqlens must have shape"),
    ("seqlens_2d", False, lambda a: a.update(cache_seqlens=a["cache_seqlens"][None]), ValueError, "cache_seqlens"),
    ("seqlens_int_over", False, lambda a: a.update(cache_seqlens=10), ValueError, r"cache_seqlens must be in \[0, 9\]"),
    ("seqlens_int_negative", False, lambda a: a.update(cache_seqlens=-1), ValueError, "cache_seqlens must be in"),
    ("seqlens_float", False, lambda a: a.update(cache_seqlens=3.0), TypeError, "cache_seqlens"),
    ("page_table_int64", True, lambda a: a.update(page_table=a["page_table"].long()), TypeError,
     "page_table must be int32"),
    ("page_table_1d", True, lambda a: a.update(page_table=a["page_table"][0]), ValueError, "page_table must have"),
    ("page_table_batch", True, lambda a: a.update(page_table=a["page_table"][:1]), ValueError, "page_table must have"),
    ("page_table_strided", True, lambda a: a.update(page_table=torch.zeros(2, 6, dtype=torch.int32)[:, ::2]),
     ValueError, "page_table must have a contiguous"),
    ("page_size_zero", True, lambda a: a.update(k_cache=torch.zeros(6, 0, 2, 64, dtype=F16),
                                                v_cache=torch.zeros(6, 0, 2, 64, dtype=F16)), ValueError,
     "page_size"),
    ("paged_seqlens_int_over", True, lambda a: a.update(cache_seqlens=10), ValueError, r"\[0, 9\]"),
    ("cpu_tensors", False, lambda a: None, ValueError, "q must be a CUDA tensor"),
    ("cpu_tensors_paged", True, lambda a: None, ValueError, "q must be a CUDA tensor"),
]


@pytest.mark.parametrize("paged,mutate,exc,match", [c[1:] for c in KVCACHE_CASES], ids=[c[0] for c in KVCACHE_CASES])
def test_flash_attn_with_kvcache_refuses(paged, mutate, exc, match):
    with pytest.raises(exc, match=match):
        _kvcache_case(mutate, paged)()


# Data-dependent cache bounds (read back from the device): lengths over capacity or
# negative, and referenced pages outside the pool, are refused before any launch.
@pytest.mark.parametrize("paged,seqlens,table,match", [
    (False, [4, 10], None, r"cache_seqlens must lie in \[0, max_seqlen_k"),  # one row over capacity 9
    (False, [-1, 3], None, r"cache_seqlens must lie in"),  # negative length
    (True, [4, 10], [[0, 1, 2], [3, 4, 5]], r"max_pages_per_seq \* page_size = 9"),  # over 3 pages of 3
    (True, [4, 7], [[0, 1, 2], [3, 4, 6]], r"page_table entries .* num_pages = 6"),  # page 6 of 6 used
    (True, [4, 7], [[0, 1, 2], [-1, 4, 5]], r"page_table entries"),  # negative page used
])
def test_kvcache_bounds_refused_without_launch(no_launch, paged, seqlens, table, match):
    q, _, _ = make_qkv(sq=2)
    shape = (6, 3, 2, 64) if paged else (2, 9, 2, 64)
    k, v = torch.randn(shape).to(F16), torch.randn(shape).to(F16)
    pt = None if table is None else torch.tensor(table, dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        flash_attn_with_kvcache(q, k, v, torch.tensor(seqlens, dtype=torch.int32), page_table=pt,
                                check_cache_bounds=True)


def test_kvcache_bounds_check_is_opt_in(fake_gpu, monkeypatch):
    # By default cache_seqlens is never read back (no sync); the kernel is then handed the
    # capacity as max_seqlen_k and clamps lengths itself. check_cache_bounds=True reads it.
    monkeypatch.setattr(checks, "cache_bounds", _refuse)
    q, _, _ = make_qkv(sq=1)
    k, v = torch.randn(2, 9, 2, 64).to(F16), torch.randn(2, 9, 2, 64).to(F16)
    flash_attn_with_kvcache(q, k, v, torch.tensor([4, 12], dtype=torch.int32))
    assert fake_kernel.calls and fake_kernel.calls[-1]["max_seqlen_q"] == 1
    with pytest.raises(AssertionError):
        flash_attn_with_kvcache(q, k, v, torch.tensor([4, 12], dtype=torch.int32), check_cache_bounds=True)


def test_kvcache_bounds_ignore_unused_pages():
    # Entries past ceil(cache_seqlens / page_size) are never read: garbage there is fine.
    table = torch.tensor([[0, 1, 99], [3, -5, 77]], dtype=torch.int32)
    hi = checks.cache_bounds(torch.tensor([6, 3], dtype=torch.int32), 9, table, (6, 3, 2, 64))
    assert hi == 6  # max(cache_seqlens): the split heuristic's tighter bound


# (id, mutation, exception, fragment) for the public combine.
COMBINE_CASES = [
    ("partial_fp16", lambda a: a.update(out_partial=a["out_partial"].half()), TypeError, "out_partial must be float32"),
    ("lse_fp16", lambda a: a.update(lse_partial=a["lse_partial"].half()), TypeError, "lse_partial must be float32"),
    ("partial_rank4", lambda a: a.update(out_partial=a["out_partial"][0]), ValueError, "out_partial must have shape"),
    ("lse_mismatch", lambda a: a.update(lse_partial=a["lse_partial"][:, :, :1]), ValueError,
     "lse_partial must have shape"),
    ("too_many_splits", lambda a: a.update(out_partial=torch.zeros(257, 1, 2, 2, 64),
                                           lse_partial=torch.zeros(257, 1, 2, 2)), ValueError, "num_splits"),
    ("dv_unsupported", lambda a: a.update(out_partial=torch.zeros(3, 2, 5, 4, 44)), ValueError, "head dimension"),
    ("out_dtype_int", lambda a: a.update(out_dtype=torch.int32), TypeError, "out_dtype"),
    ("out_shape", lambda a: a.update(out=torch.zeros(2, 5, 4, 128)), ValueError, "out must have shape"),
    ("out_vs_out_dtype", lambda a: a.update(out=torch.zeros(2, 5, 4, 64), out_dtype=F16), TypeError, "out must be"),
    ("cpu_tensors", lambda a: None, ValueError, "out_partial must be a CUDA tensor"),
]


@pytest.mark.parametrize("mutate,exc,match", [c[1:] for c in COMBINE_CASES], ids=[c[0] for c in COMBINE_CASES])
def test_flash_attn_combine_refuses(mutate, exc, match):
    args = dict(out_partial=torch.zeros(3, 2, 5, 4, 64), lse_partial=torch.zeros(3, 2, 4, 5))
    mutate(args)
    with pytest.raises(exc, match=match):
        flash_attn_combine(args.pop("out_partial"), args.pop("lse_partial"), **args)


def test_shape_errors_come_before_device_errors():
    q, k, v = make_qkv()
    with pytest.raises(ValueError, match="batch size"):  # CPU tensors AND a wrong batch
        flash_attn_func(q, k[:1], v[:1])


def test_check_device_names_the_offending_tensor():
    dev = lambda s: SimpleNamespace(device=torch.device(s))
    checks.check_device({"q": dev("cuda:0"), "k": dev("cuda:0"), "out": None})
    with pytest.raises(ValueError, match="out is on cuda:1 but q is on cuda:0"):
        checks.check_device({"q": dev("cuda:0"), "k": dev("cuda:0"), "out": dev("cuda:1")})
    with pytest.raises(ValueError, match="page_table must be a CUDA tensor"):
        checks.check_device({"q": dev("cuda:0"), "page_table": dev("cpu")})


def test_size_one_dims_with_odd_strides_are_restrided_not_refused():
    # A (1, 5, 4, 64) view whose batch stride is odd: that stride addresses nothing.
    base = torch.randn(1 * 5 * 4 * 64).to(F16)
    q = base.as_strided((1, 5, 4, 64), (7, 256, 64, 1))
    q2 = checks.aligned("q", q)
    assert q2.stride(0) % 8 == 0 and q2.data_ptr() == q.data_ptr() and torch.equal(q2, q)


# ---------------------------------------------------------------------------------------
# Window / causal normalisation
# ---------------------------------------------------------------------------------------


# (causal, window_size) -> (causal, left, right) as the kernels receive them; one row per rule.
@pytest.mark.parametrize("causal,window,expected", [
    (False, (-1, -1), (False, -1, -1)),  # plain attention
    (False, (None, None), (False, -1, -1)),  # None means unbounded
    (True, (-1, -1), (True, -1, 0)),  # causal = right window 0
    (True, (None, 5), (True, -1, 0)),  # causal overrides a right window
    (True, (8, 3), (True, 8, 0)),  # sliding-window causal keeps its left side
    (False, (-1, 0), (True, -1, 0)),  # (-1, 0) IS causal
    (False, (None, 0), (True, -1, 0)),  # ... also spelled with None
    (False, (4, 0), (False, 4, 0)),  # a bounded left side makes it local
    (False, (0, 0), (False, 0, 0)),  # diagonal only: local
    (False, (-1, 3), (False, -1, 3)),  # right-bounded only: local
    (False, (2, None), (False, 2, -1)),  # left-bounded only: local
])
def test_normalize_window(causal, window, expected):
    assert normalize_window(causal, window) == expected


def test_kernel_receives_normalised_scalars(fake_gpu):
    q, k, v = make_qkv(d=128, dv=128)
    flash_attn_func(q, k, v, window_size=(-1, 0), softcap=3)
    kw = fake_gpu.kernel.calls[-1]
    assert kw["causal"] is True and (kw["window_left"], kw["window_right"]) == (-1, 0)
    assert kw["softmax_scale"] == pytest.approx(128 ** -0.5) and kw["softcap"] == 3.0
    flash_attn_func(q, k, v, causal=True, window_size=(None, 7), softmax_scale=0.5)
    kw = fake_gpu.kernel.calls[-1]
    assert (kw["causal"], kw["window_left"], kw["window_right"], kw["softmax_scale"]) == (True, -1, 0, 0.5)


# ---------------------------------------------------------------------------------------
# Heuristics
# ---------------------------------------------------------------------------------------


# Grids at and above 80% of one wave of 132 SMs (H100) never split, however long K is.
@pytest.mark.parametrize("total_mblocks", [106, 132, 1000])
def test_num_splits_is_1_when_grid_fills_gpu(total_mblocks):
    assert num_splits_heuristic(total_mblocks, 132, 1024) == 1


def test_num_splits_decode_long_context():
    # B=1, H=32, K=131072 decode on 132 SMs: 32 CTAs fill a quarter of the GPU.
    n_blocks = ceildiv(131072, 128)
    s = num_splits_heuristic(1 * 32 * 1, 132, n_blocks)
    assert s > 1 and 32 * s >= 0.85 * 132, s
    # Packed GQA (8 KV heads): fewer CTAs, so more splits.
    assert num_splits_heuristic(1 * 8 * 1, 132, n_blocks) > s


def test_num_splits_bounds_and_eligibility():
    # total_mblocks: 1 (worst case) .. just under the 80% cut; n_blocks: tiny, odd, large.
    for total in (1, 2, 7, 33, 105):
        for n_blocks in (1, 4, 5, 11, 64, 1000):
            for max_splits in (8, 128):
                s = num_splits_heuristic(total, 132, n_blocks, max_splits)
                assert 1 <= s <= min(n_blocks, max_splits, 132)
                # a split count that does not change the blocks per split is never chosen
                assert s == 1 or ceildiv(n_blocks, s) != ceildiv(n_blocks, s - 1)


def test_num_splits_small_or_degenerate():
    assert num_splits_heuristic(1, 132, 4) == 1  # <= 4 KV blocks: the combine costs more
    assert num_splits_heuristic(0, 132, 100) == 1
    assert num_splits_heuristic(1, 0, 100) == 1


def test_resolve_num_splits_clamps():
    r = lambda ns, sk, **kw: heuristics.resolve_num_splits(
        ns, 132, ctas=kw.get("b", 1) * kw.get("h", 1), rows=1, max_seqlen_k=sk, tile_m=128, tile_n=128,
        ctas_per_sm=2, tolerance=0.95)
    assert r(100, 128) == 2  # explicit: at most ceil(seqlen_k / 64) splits
    assert r(256, 10**6) == 256
    assert r(0, 131072) > 1  # auto on a near-empty grid
    assert r(0, 131072, b=64, h=32) == 1  # auto on a full grid
    assert r(0, 64) == 1


def test_combine_split_groups():
    """Lane groups per combine row: each group keeps >= 16 splits, at most 8 groups, and
    batch-invariant plans keep one (the groups' order of addition must not follow the batch)."""
    groups = heuristics.combine_split_groups
    assert [groups(n) for n in (1, 2, 31, 32, 63, 64, 127, 128, 256)] == [1, 1, 1, 2, 2, 4, 4, 8, 8]
    assert groups(256, batch_invariant=True) == 1


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_combine_split_groups_plumbing(fake_gpu, batch_invariant):
    # 131072 keys: 32 splits of 4096 keys when batch invariant, else the 128 asked for
    q, k, v = make_qkv(b=1, sq=1, sk=131072, h=2, hk=2, d=64, dtype=BF16)
    out = flash_attn_func(q, k, v, num_splits=128, batch_invariant=batch_invariant)
    close(out, attention_ref(q, k, v)[0], 2e-2)
    assert fake_gpu.kernel.calls[-1]["num_splits"] == (32 if batch_invariant else 128)
    assert fake_gpu.combine.split_groups == [1 if batch_invariant else 8]


def test_fa3_keywords_plumbing(fake_gpu):
    """FA3's keywords: ``return_attn_probs`` returns the LSE as ``return_lse`` does;
    ``deterministic``, ``qv=None``, ``attention_chunk=0`` and ``scheduler_metadata`` change
    nothing; ``sm_margin`` leaves SMs to other kernels: the split heuristic counts the others
    (one decode row of 131072 keys, 2 heads: 128 splits on 132 SMs, 31 on the 32 left)."""
    q, k, v = make_qkv(b=1, sq=1, sk=131072, h=2, hk=2, d=64, dtype=BF16)
    out, lse = flash_attn_func(q, k, v, num_splits=0, return_lse=True)
    splits = fake_gpu.kernel.calls[-1]["num_splits"]
    out2, lse2 = flash_attn_func(q, k, v, num_splits=0, return_attn_probs=True, deterministic=True, qv=None,
                                 attention_chunk=0)
    assert fake_gpu.kernel.calls[-1]["num_splits"] == splits
    close(out2, out, 0)
    close(lse2, lse, 0)
    flash_attn_func(q, k, v, num_splits=0, sm_margin=100)
    fewer = fake_gpu.kernel.calls[-1]["num_splits"]
    assert (splits, fewer) == (128, 31)  # 2 CTAs x 128 splits on 132 SMs; 2 x 31 on the 32 left
    cache_seqlens = torch.full((1,), 131072, dtype=torch.int32)
    md = torch.zeros(8, dtype=torch.int32)
    o3 = flash_attn_with_kvcache(q, k, v, cache_seqlens=cache_seqlens, scheduler_metadata=md, sm_margin=0,
                                 rotary_seqlens=None, qv=None, attention_chunk=0)
    close(o3, out, 0)
    with pytest.raises(NotImplementedError, match="rotary_seqlens"):
        flash_attn_with_kvcache(q, k, v, cache_seqlens=cache_seqlens, rotary_seqlens=cache_seqlens)
    with pytest.raises(TypeError, match="scheduler_metadata must be a tensor"):
        flash_attn_with_kvcache(q, k, v, cache_seqlens=cache_seqlens, scheduler_metadata=[1, 2])


# (seqlen_q, qhead_per_kvhead, varlen, expected): decode and short queries pack; MHA,
# tile-multiple prefill and lengths whose padding packing does not reduce (100 rows of
# 128 vs 200 of 256) do not; varlen packs because only max_seqlen_q is known.
@pytest.mark.parametrize("sq,qpk,varlen,expected", [
    (1, 8, False, True), (16, 4, False, True), (40, 3, False, True), (100, 2, False, False),
    (1, 1, False, False), (128, 8, False, False), (1024, 4, False, False),
    (1000, 4, True, True), (5, 1, True, False),
])
def test_should_pack_gqa(sq, qpk, varlen, expected):
    assert should_pack_gqa(sq, qpk, 128, varlen_q=varlen) is expected


def test_num_sms_is_cached(monkeypatch):
    calls = []

    def props(index):
        calls.append(index)
        return SimpleNamespace(multi_processor_count=132)

    heuristics._num_sms_of.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    try:
        assert heuristics.num_sms("cuda:0") == heuristics.num_sms(torch.device("cuda", 0)) == 132
        assert calls == [0]
    finally:
        heuristics._num_sms_of.cache_clear()


def test_no_sm_query_without_auto_splits(fake_gpu, monkeypatch):
    monkeypatch.setattr(heuristics, "num_sms", _refuse)
    q, k, v = make_qkv()
    flash_attn_func(q, k, v, num_splits=3)  # explicit splits: no device query


# ---------------------------------------------------------------------------------------
# Backend selection
# ---------------------------------------------------------------------------------------


def _problem(**kw):
    """A small valid FwdProblem; keywords override fields."""
    base = dict(dtype=BF16, batch=1, max_seqlen_q=1, max_seqlen_k=128, nheads=4, nheads_kv=4, d=128, d_v=128,
                softmax_scale=0.1, causal=False, window_left=-1, window_right=-1, softcap=0.0, varlen_q=False,
                varlen_k=False, has_seqused_k=False, page_size=0, has_lse=False)
    return seam.FwdProblem(**{**base, **kw})


# Capabilities: Ampere and Ada run the SM80 kernel, Hopper the SM90 one, Blackwell (10.x)
# the SM100 one; other generations (12.x) the SM80 kernel; Turing is refused.
@pytest.mark.parametrize("cap,expected", [((8, 0), "sm80"), ((8, 9), "sm80"), ((9, 0), "sm90"),
                                          ((10, 0), "sm100"), ((10, 3), "sm100"),
                                          ((12, 0), "sm80"), ((7, 5), RuntimeError)])
def test_backend_by_capability(monkeypatch, cap, expected):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    if expected is RuntimeError:
        with pytest.raises(RuntimeError, match="compute capability >= 8.0"):
            seam.select_backend(None, _problem(), "cuda:0")
    else:
        assert seam.select_backend(None, _problem(), "cuda:0")[0] == expected


def test_backend_names_explicit_and_env(monkeypatch):
    monkeypatch.delenv("FLASH_ATTN_CUTE_BACKEND", raising=False)
    assert checks.backend_name("sm80") == "sm80"
    assert checks.backend_name(" SM80 ") == "sm80"
    assert checks.backend_name("sm100") == "sm100"
    with pytest.raises(ValueError, match="backend must be one of"):
        checks.backend_name("hopper")
    with pytest.raises(TypeError, match="backend must be a str"):
        checks.backend_name(90)
    monkeypatch.setenv("FLASH_ATTN_CUTE_BACKEND", "sm90")
    assert checks.backend_name(None) == "sm90"
    assert checks.backend_name("sm80") == "sm80"  # the argument beats the env
    monkeypatch.setenv("FLASH_ATTN_CUTE_BACKEND", "bogus")
    with pytest.raises(ValueError, match="FLASH_ATTN_CUTE_BACKEND must be one of"):
        checks.backend_name(None)
    for auto in ("", "auto"):
        monkeypatch.setenv("FLASH_ATTN_CUTE_BACKEND", auto)
        assert checks.backend_name(None) is None


def test_explicit_backend_refusal_names_the_reason(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert seam.select_backend("sm80", _problem(), "cuda:0")[0] == "sm80"  # SM80 kernel on a Hopper GPU
    with pytest.raises(NotImplementedError, match=r"'sm80' cannot run this call: head dims \(d, d_v\) = \(128, 264\)"):
        seam.select_backend("sm80", _problem(d_v=264), "cuda:0")
    with pytest.raises(NotImplementedError, match="'sm100' cannot run this call: .* compute capability 9.0"):
        seam.select_backend("sm100", _problem(), "cuda:0")  # tcgen05 kernels on a Hopper GPU


def test_auto_backend_falls_back_to_sm80_with_a_reason(monkeypatch, caplog):
    # A Hopper backend that refuses paged caches: auto selection runs SM80 and logs why.
    hopper = SimpleNamespace(AUTO=True, runs_on=lambda cap: cap[0] == 9,
                             check=lambda p: "paged KV not supported" if p.paged else None)
    modules = {"sm90": hopper, "sm80": sm80, "sm100": seam.backend_module("sm100")}
    monkeypatch.setattr(seam, "backend_module", lambda name, kind="fwd": modules[name])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert seam.select_backend(None, _problem(), "cuda:0")[0] == "sm90"
    with caplog.at_level("INFO", logger="flash_attn_cute"):
        assert seam.select_backend(None, _problem(page_size=16), "cuda:0")[0] == "sm80"
    assert "paged KV not supported" in caplog.text
    with pytest.raises(NotImplementedError, match="paged KV not supported"):
        seam.select_backend("sm90", _problem(page_size=16), "cuda:0")


def test_blackwell_runs_sm100_and_falls_back_to_sm80(fake_gpu, monkeypatch, caplog):
    # Capability 10.0 with backend=None: the SM100 backend (its real check and plan) runs
    # the calls it accepts; a call its check refuses (head dim 256) runs the SM80 backend,
    # with the reason on the flash_attn_cute logger.
    from flash_attn_cute import sm100

    launched = []

    def backend(name, kind="fwd"):
        def kernel(*args, **kwargs):
            launched.append(name)
            fake_kernel(*args, **kwargs)

        fake = _fake_backend(kernel)
        if name == "sm100":
            return SimpleNamespace(**{**vars(fake), "AUTO": sm100.AUTO,
                                      "runs_on": sm100.runs_on, "check": sm100.check, "plan": sm100.plan})
        # Each fake runs where its backend runs (the SM90 kernel not on 10.x).
        return SimpleNamespace(**{**vars(fake), "runs_on": importlib.import_module(seam.BACKENDS[name]).runs_on})

    monkeypatch.setattr(seam, "backend_module", backend)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    q, k, v = make_qkv(d=128, dv=128)
    close(flash_attn_func(q, k, v, causal=True), attention_ref(q, k, v, causal=True)[0])
    assert launched == ["sm100"]
    q, k, v = make_qkv(d=256, dv=256)
    with caplog.at_level("INFO", logger="flash_attn_cute"):
        close(flash_attn_func(q, k, v), attention_ref(q, k, v)[0])
    assert launched == ["sm100", "sm80"]
    assert "sm100 kernel refused the call" in caplog.text and "(256, 256)" in caplog.text
    with pytest.raises(NotImplementedError, match="'sm100' cannot run this call: head dims"):
        flash_attn_func(q, k, v, backend="sm100")


def test_call_cache_never_skips_a_refusal(fake_gpu):
    # A cached call answers only for calls with the same argument types and tensor
    # signatures: anything validation would refuse still reaches validation.
    q, k, v = make_qkv()
    flash_attn_func(q, k, v, causal=True)
    flash_attn_func(q, k, v, causal=True)  # cached
    with pytest.raises(TypeError, match="causal must be a bool"):
        flash_attn_func(q, k, v, causal=1)  # equal to True, but an int
    with pytest.raises(TypeError, match="k must be torch.float16"):
        flash_attn_func(q, k.to(BF16), v, causal=True)
    with pytest.raises(ValueError, match="must be 16-byte aligned"):
        buf = torch.zeros(k.numel() + 1, dtype=F16)[1:].view(k.shape)  # same shape/strides, misaligned
        flash_attn_func(q, buf, v, causal=True)
    with pytest.raises(ValueError, match="window_size"):
        flash_attn_func(q, k, v, window_size=(-2, 0))
    assert len(fake_kernel.calls) == 2


def test_call_cache_replays_kvcache_with_int_lengths(fake_gpu):
    q, k, v = make_qkv(b=2, sq=1, sk=300)
    for _ in range(2):  # the second call is a replay: it must rebuild the lengths tensor
        out = flash_attn_with_kvcache(q, k, v, 200, num_splits=3)
        close(out, attention_kvcache_ref(q, k, v, torch.tensor([200, 200]))[0])
        assert fake_gpu.kernel.calls[-1]["seqused_k"].tolist() == [200, 200]
    assert len(fake_gpu.kernel.calls) == 2 and fake_gpu.combine.calls == 2


def test_plan_cache_resolves_once(fake_gpu, monkeypatch):
    # A repeated call reuses the resolved plan and launcher: no second planning.
    plans = []
    real = _fake_backend(fake_kernel)
    counting = SimpleNamespace(**{**vars(real), "plan": lambda *a, **kw: plans.append(a) or sm80.plan(*a, **kw)})
    monkeypatch.setattr(seam, "backend_module", lambda name, kind="fwd": counting)
    q, k, v = make_qkv()
    for _ in range(3):
        flash_attn_func(q, k, v)
    assert len(plans) == 1 and len(fake_kernel.calls) == 3
    flash_attn_func(q, k, v, causal=True)  # another problem: planned again
    assert len(plans) == 2


# ---------------------------------------------------------------------------------------
# Empty inputs: results without any launch
# ---------------------------------------------------------------------------------------


# (b, sq, sk): empty batch, no queries (both: empty result), no keys (zeros and lse -inf).
@pytest.mark.parametrize("b,sq,sk", [(0, 5, 7), (2, 0, 7), (2, 5, 0), (0, 0, 0)])
def test_flash_attn_func_empty(no_launch, b, sq, sk):
    q, k, v = make_qkv(b=b, sq=sq, sk=sk, dv=128)
    out_buf = torch.full((b, sq, 4, 128), math.nan, dtype=F16)
    out, lse = flash_attn_func(q, k, v, return_lse=True, out=out_buf, num_splits=0)
    assert out.shape == (b, sq, 4, 128) and lse.shape == (b, 4, sq) and lse.dtype == torch.float32
    assert out.data_ptr() == out_buf.data_ptr() and (out == 0).all() and (lse == -math.inf).all()
    assert flash_attn_func(q, k, v).shape == (b, sq, 4, 128)


# (lens_q, lens_k): no sequences at all, only empty queries, only empty keys.
@pytest.mark.parametrize("lens_q,lens_k", [((), ()), ((0, 0), (3, 4)), ((2, 3), (0, 0))])
def test_flash_attn_varlen_func_empty(no_launch, lens_q, lens_k):
    q, k, v, cq, ck, mq, mk = make_varlen(lens_q or (0,), lens_k or (0,))
    if not lens_q:
        cq = ck = torch.zeros(1, dtype=torch.int32)
    out, lse = flash_attn_varlen_func(q, k, v, cq, ck, mq, mk, return_lse=True, num_splits=4)
    assert out.shape == (sum(lens_q), 4, 64) and lse.shape == (4, sum(lens_q))
    assert (out == 0).all() and (lse == -math.inf).all()


# (b, sq, cache_seqlens): empty batch, no queries, empty caches (tensor and int forms).
# Lengths in a tensor are only known on the host with check_cache_bounds=True (by
# default the kernel runs and finds them empty itself).
@pytest.mark.parametrize("b,sq,seqlens", [(0, 1, "tensor"), (2, 0, "tensor"), (2, 3, [0, 0]), (2, 3, 0)])
def test_flash_attn_with_kvcache_empty(no_launch, b, sq, seqlens):
    q, k, v = make_qkv(b=b, sq=sq, sk=9)
    if seqlens == "tensor":
        seqlens = torch.full((b,), 4, dtype=torch.int32)
    elif isinstance(seqlens, list):
        seqlens = torch.tensor(seqlens, dtype=torch.int32)
    out, lse = flash_attn_with_kvcache(q, k, v, seqlens, return_lse=True, check_cache_bounds=True)
    assert out.shape == (b, sq, 4, 64) and lse.shape == (b, 4, sq)
    assert (out == 0).all() and (lse == -math.inf).all()


def test_flash_attn_combine_empty(no_launch):
    out, lse = flash_attn_combine(torch.zeros(3, 0, 5, 4, 64), torch.zeros(3, 0, 4, 5), return_lse=True)
    assert out.shape == (0, 5, 4, 64) and lse.shape == (0, 4, 5) and out.dtype == torch.float32


# ---------------------------------------------------------------------------------------
# Plumbing through fake kernels: splits, combine views, GQA packing, paged caches
# ---------------------------------------------------------------------------------------


# num_splits: 1 (no combine), 3 (explicit), 0 (auto: 4 packed CTAs on 132 SMs with 6
# KV blocks -> 6 splits); masks: none, causal, local, softcap -- each changes what a
# split sees (local leaves some splits empty).
@pytest.mark.parametrize("num_splits,expected", [(1, 1), (3, 3), (0, 6)])
@pytest.mark.parametrize("mask", [{}, {"causal": True}, {"window_size": (40, 3)}, {"softcap": 2.0}])
def test_flash_attn_func_plumbing(fake_gpu, num_splits, expected, mask):
    q, k, v = make_qkv(b=2, sq=3, sk=700, h=4, hk=2, d=64, dv=128, dtype=BF16)
    out, lse = flash_attn_func(q, k, v, num_splits=num_splits, return_lse=True, **mask)
    ref, ref_lse = attention_ref(q, k, v, **mask)
    close(out, ref, 2e-2)  # bf16 output rounding
    close(lse, ref_lse, 1e-4)
    kw = fake_gpu.kernel.calls[-1]
    assert kw["num_splits"] == expected
    assert fake_gpu.combine.calls == (1 if expected > 1 else 0)
    assert kw["pack_gqa"] is True  # auto: 3 query rows x 2 heads per KV head fill the tile better


def test_flash_attn_func_pack_gqa_forwarding(fake_gpu):
    q, k, v = make_qkv(h=4, hk=4)
    flash_attn_func(q, k, v, pack_gqa=True)
    assert fake_gpu.kernel.calls[-1]["pack_gqa"] is False  # nothing to pack without GQA
    q, k, v = make_qkv(h=4, hk=1)
    flash_attn_func(q, k, v, pack_gqa=False)
    assert fake_gpu.kernel.calls[-1]["pack_gqa"] is False


def test_out_buffer_and_strided_inputs(fake_gpu):
    # q as a slice of a packed qkv tensor: strided heads/rows, last dim contiguous.
    qkv = torch.randn(2, 6, 3, 4, 64).to(F16)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    out_buf = torch.full((2, 6, 4, 64), math.nan, dtype=F16)
    out = flash_attn_func(q, k, v, causal=True, out=out_buf, num_splits=2)
    assert out.data_ptr() == out_buf.data_ptr()
    close(out_buf, attention_ref(q, k, v, causal=True)[0])
    assert fake_gpu.kernel.calls[-1]["cu_seqlens_q"] is None and q.stride(1) == 3 * 4 * 64


# num_splits 1 and 3: the varlen combine goes through batch-1 views (checked by the fake).
@pytest.mark.parametrize("num_splits", [1, 3])
def test_flash_attn_varlen_func_plumbing(fake_gpu, num_splits):
    q, k, v, cq, ck, mq, mk = make_varlen((3, 0, 70, 1), (200, 5, 130, 0))
    out, lse = flash_attn_varlen_func(q, k, v, cq, ck, mq, mk, causal=True, num_splits=num_splits, return_lse=True)
    ref, ref_lse = attention_varlen_ref(q, k, v, cq, ck, causal=True)
    close(out, ref)
    close(lse, ref_lse, 1e-4)
    assert fake_gpu.combine.calls == (num_splits > 1)
    kw = fake_gpu.kernel.calls[-1]
    assert kw["max_seqlen_q"] == 70 and kw["seqused_k"] is None and kw["page_table"] is None


# page_size: 1 (degenerate), 3 (odd), 16 (typical); num_splits: auto (the default) and 1.
@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("num_splits", [0, 1])
def test_flash_attn_with_kvcache_paged_plumbing(fake_gpu, page_size, num_splits):
    g = torch.Generator().manual_seed(1)
    b, sq, h, hk, d, pages_per_seq = 3, 2, 4, 2, 64, ceildiv(300, page_size)
    num_pages = b * pages_per_seq + 2
    q = torch.randn(b, sq, h, d, generator=g).to(F16)
    k = torch.randn(num_pages, page_size, hk, d, generator=g).to(F16)
    v = torch.randn(num_pages, page_size, hk, d, generator=g).to(F16)
    table = torch.randperm(num_pages, generator=g)[: b * pages_per_seq].view(b, -1).to(torch.int32)
    seqlens = torch.tensor([300, 1, 77], dtype=torch.int32)
    out, lse = flash_attn_with_kvcache(q, k, v, seqlens, page_table=table, causal=True, num_splits=num_splits,
                                       return_lse=True)
    ref, ref_lse = attention_kvcache_ref(q, k, v, seqlens, page_table=table, causal=True)
    close(out, ref)
    close(lse, ref_lse, 1e-4)
    kw = fake_gpu.kernel.calls[-1]
    assert kw["page_table"] is table and kw["seqused_k"] is seqlens


def test_flash_attn_with_kvcache_int_seqlens(fake_gpu):
    q, k, v = make_qkv(b=2, sq=1, sk=300)
    out = flash_attn_with_kvcache(q, k, v, 200, window_size=(50, -1), num_splits=3)
    close(out, attention_kvcache_ref(q, k, v, torch.tensor([200, 200]), window_size=(50, -1))[0])
    assert fake_gpu.kernel.calls[-1]["seqused_k"].tolist() == [200, 200]


def test_flash_attn_combine_public(fake_gpu):
    g = torch.Generator().manual_seed(2)
    op, lp = torch.randn(5, 2, 3, 4, 64, generator=g), torch.randn(5, 2, 4, 3, generator=g)
    lp[:, 0, 0, 0] = -math.inf  # a row no split saw: out 0, lse -inf
    out, lse = flash_attn_combine(op, lp, out_dtype=BF16, return_lse=True)
    assert out.dtype == BF16 and lse.shape == (2, 4, 3)
    assert lse[0, 0, 0] == -math.inf and (out[0, 0, 0] == 0).all()
    w = torch.softmax(lp, 0).nan_to_num(0.0)
    close(out, torch.einsum("nbhs,nbshd->bshd", w, op), 2e-2)


def test_public_api_exports():
    for name in ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "flash_attn_combine",
                 "SUPPORTED_HEAD_DIMS", "__version__"):
        assert hasattr(flash_attn_cute, name), name
    assert flash_attn_cute.SUPPORTED_HEAD_DIMS == tuple(range(8, 257, 8))
