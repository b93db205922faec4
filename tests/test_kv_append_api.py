"""CPU tests of ``flash_attn_with_kvcache``'s append path (``kv_cache_ops``): appending into
an FP8 cache (the append kernel quantizes with the descales, which then reach the
attention), ``cache_leftpad`` over a paged cache (the attention's per-sequence key start,
``FwdArgs.mLeftpadK``) and the ``cache_batch_idx`` bound check. A fake GPU (``fake_device``)
runs fake launchers that record what the kernels are given; every refusal happens before
any launch. The kernels' numerics are GPU tests (tests/test_kv_append_gpu.py)."""

from types import SimpleNamespace

import pytest
import torch

from flash_attn_cute import seam, sm100, sm80, sm90
from flash_attn_cute.api import checks
from flash_attn_cute.host import keys
from flash_attn_cute.kernels import kv_append
from flash_attn_cute.interface import flash_attn_with_kvcache
from flash_attn_cute.host.problems import FwdProblem

BF16, E4M3, E5M2 = torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2
I32 = torch.int32


class EventLog(list):
    state = None


@pytest.fixture
def events(fake_device, monkeypatch):
    """[(kind, record)] in launch order: "append" (the append launcher's static arguments
    and the tensors it is called with) and "attention" (problem, plan, tensors), on a fake
    GPU whose backend plans as SM80 and checks as the module ``events.check`` names."""
    log = EventLog()
    state = SimpleNamespace(check=lambda p: None)

    def append_launcher(*static, **kw):
        def fn(*tensors):
            seqused = tensors[12]
            seqused.fill_(3)  # what the kernel writes: key counts
            log.append(("append", SimpleNamespace(static=static, kw=kw, tensors=tensors)))

        return fn

    def launcher(problem, plan, device=None):
        return lambda tensors: log.append(("attention", SimpleNamespace(problem=problem, plan=plan,
                                                                         tensors=tensors)))

    monkeypatch.setattr(kv_append, "append_launcher", append_launcher)
    fake = SimpleNamespace(AUTO=True, runs_on=sm80.runs_on, check=lambda p: state.check(p), plan=sm80.plan,
                           launcher=launcher)
    fake_device(lambda name, kind="fwd": fake)
    log.state = state
    return log


def _kinds(log):
    return [k for k, _ in log]


def _call(paged=False, cache_dtype=E4M3, token_dtype=BF16, q_dtype=BF16, rotary=True, batch=2, h=8, hk=2, d=64,
          **kw):
    g = torch.Generator().manual_seed(0)
    rnd = lambda *shape, dtype=BF16: torch.randn(*shape, generator=g).to(dtype)
    shape = (6, 16, hk, d) if paged else (batch, 48, hk, d)
    a = dict(q=rnd(batch, 1, h, d, dtype=q_dtype), k_cache=rnd(*shape, dtype=cache_dtype),
             v_cache=rnd(*shape, dtype=cache_dtype), k=rnd(batch, 1, hk, d, dtype=token_dtype),
             v=rnd(batch, 1, hk, d, dtype=token_dtype), cache_seqlens=torch.tensor([5, 9], dtype=I32))
    if rotary:
        rot_dtype = q_dtype if q_dtype != E4M3 else (token_dtype if token_dtype != E4M3 else BF16)
        a.update(rotary_cos=rnd(48, d // 2, dtype=rot_dtype), rotary_sin=rnd(48, d // 2, dtype=rot_dtype))
    if paged:
        a["page_table"] = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=I32)
    a.update(kw)
    return a


def test_fp8_append_quantizes_in_the_append_kernel_then_attends_with_the_descales(events):
    kd = torch.rand(2, 2) + 0.5
    vd = torch.tensor([0.25])
    a = _call(k_descale=kd, v_descale=vd, causal=True)
    out = flash_attn_with_kvcache(**a)
    assert out.dtype == BF16 and _kinds(events) == ["append", "attention"]  # one append launch, then the attention
    app, att = events[0][1], events[1][1]
    # launcher(dtype, d, d_v, rotary_dim, interleaved, q_positions_per_query, has_q, has_new_kv, paged,
    #          has_batch_idx, has_leftpad, varlen, q_dtype=, new_dtype=, cache_dtype=, device=)
    assert app.static == (BF16, 64, 64, 64, True, True, True, True, False, False, False, False)
    assert app.kw["cache_dtype"] == E4M3 and app.kw["new_dtype"] is None and app.kw["q_dtype"] is None
    # fn(q, k, v, k_cache, v_cache, seqlens, page_table, batch_idx, leftpad, cos, sin, q_out, seqused, k_offsets,
    #    cu_q, cu_k, q_descale, k_descale, v_descale): the descales as (batch, nheads_kv) fp32 views
    t = app.tensors
    assert t[3] is a["k_cache"] and t[1] is a["k"] and t[16] is None
    assert t[17] is kd and t[18].shape == (2, 2) and t[18].stride() == (0, 0) and float(t[18][1, 1]) == 0.25
    assert att.problem.kv_dtype == E4M3 and not att.problem.leftpad_k
    # launch(q, k, v, out, lse, cu_q, cu_k, seqused_k, page_table, seqused_q, sink, k_descale, v_descale)
    assert att.tensors[0] is t[11] and att.tensors[1] is a["k_cache"] and att.tensors[7] is t[12]
    assert att.tensors.k_descale is kd and att.tensors.v_descale.shape == (2, 2) and att.tensors.leftpad_k is None
    # The repeated call (the per-call cache) does the same with the new descale values.
    events.clear()
    flash_attn_with_kvcache(**a)
    assert _kinds(events) == ["append", "attention"]
    assert events[0][1].tensors[17] is kd and events[1][1].tensors[11] is kd


def test_fp8_tokens_and_fp8_attention(events):
    # New tokens already in the cache's fp8 dtype: new_dtype names it; None descales are 1.
    flash_attn_with_kvcache(**_call(token_dtype=E5M2, cache_dtype=E5M2))
    app = events[-2][1]
    assert app.kw["new_dtype"] == E5M2 and app.kw["cache_dtype"] == E5M2
    assert float(app.tensors[17].max()) == float(app.tensors[17].min()) == 1.0
    # e4m3 q (FP8 attention) with rotary: q rotated with q_descale (per KV head), output bf16.
    events.clear()
    qd = torch.rand(2, 2) + 0.5
    out = flash_attn_with_kvcache(**_call(q_dtype=E4M3, token_dtype=E4M3, q_descale=qd))
    app, att = events[0][1], events[1][1]
    assert app.kw["q_dtype"] == E4M3 and app.kw["new_dtype"] == E4M3 and app.static[0] == BF16
    assert app.tensors[16] is qd and app.tensors[11].dtype == E4M3
    assert att.problem.qkv_fp8 and out.dtype == BF16 and att.tensors[0] is app.tensors[11]
    # e4m3 q, 16-bit tokens: they set the 16-bit dtype (fp16 here, the rotary tables too).
    events.clear()
    flash_attn_with_kvcache(**_call(q_dtype=E4M3, token_dtype=torch.float16))
    assert events[0][1].static[0] == torch.float16 and events[0][1].kw["new_dtype"] is None
    # Without rotary, e4m3 q is not passed to the append (has_q False): no q_descale.
    events.clear()
    flash_attn_with_kvcache(**_call(q_dtype=E4M3, token_dtype=E4M3, rotary=False))
    assert events[0][1].static[6] is False and events[0][1].tensors[16] is None


FP8_REFUSALS = [
    ("tokens_other_fp8", dict(token_dtype=E5M2), TypeError,
     "k must be torch.bfloat16 like q, or torch.float8_e4m3fn like the cache"),
    ("tokens_fp16", dict(token_dtype=torch.float16), TypeError, "k must be torch.bfloat16 like q"),
    ("k_descale_shape", dict(k_descale=torch.ones(2, 8)), ValueError,
     r"k_descale must have shape \(batch, nheads_kv\) = \(2, 2\)"),
    ("v_descale_dtype", dict(v_descale=torch.ones(2, 2, dtype=BF16)), TypeError, "v_descale must be float32"),
    ("fp8_q_fp32_tables", dict(q_dtype=E4M3, token_dtype=E4M3, rotary_cos=torch.ones(48, 32),
                               rotary_sin=torch.ones(48, 32)), TypeError,
     "rotary_cos must be float16 or bfloat16"),
    ("fp8_q_tables_not_like_k", dict(q_dtype=E4M3, token_dtype=torch.float16), TypeError,
     "rotary_cos must be torch.float16 like k"),
    ("out_dtype_fp8_q", dict(q_dtype=E4M3, token_dtype=E4M3, out=torch.empty(2, 1, 8, 64, dtype=E4M3)), TypeError,
     "out must be torch.bfloat16"),
]


@pytest.mark.parametrize("name,kw,exc,match", FP8_REFUSALS, ids=[c[0] for c in FP8_REFUSALS])
def test_fp8_append_validation(events, name, kw, exc, match):
    a = _call(**{k: v for k, v in kw.items() if k in ("token_dtype", "q_dtype", "cache_dtype")})
    if name == "fp8_q_tables_not_like_k":
        a["rotary_cos"], a["rotary_sin"] = a["rotary_cos"].to(BF16), a["rotary_sin"].to(BF16)
    a.update({k: v for k, v in kw.items() if k not in ("token_dtype", "q_dtype", "cache_dtype")})
    with pytest.raises(exc, match=match):
        flash_attn_with_kvcache(**a)
    assert events == []  # nothing launched


def test_a_call_no_kernel_runs_leaves_the_cache_untouched(events):
    # The attention is planned before the append launches: a refusal appends nothing.
    events.state.check = lambda p: "not this one"
    with pytest.raises(NotImplementedError, match="not this one"):
        flash_attn_with_kvcache(**_call(backend="sm80"))
    assert events == []


def test_fp8_append_below_compute_capability_8_9_is_refused(monkeypatch):
    # The real launcher: an fp8 operand on sm_80 is refused before anything compiles.
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_80")
    with pytest.raises(NotImplementedError, match="compute capability >= 8.9"):
        kv_append.append_launcher(BF16, 64, 64, 0, False, False, False, True, False, False, False,
                                  cache_dtype=E4M3)


def test_append_key_dtype_field_and_paged_leftpad():
    key = lambda *names, **kw: kv_append.append_key("sm_90a", "bf16", 128, 128, 64, True, True, True, True,
                                                    kw.get("paged", False), False, kw.get("leftpad", False),
                                                    False, *names)
    # 16-bit: the field (and so every existing key) is the dtype alone.
    assert key()[2] == "bf16" and key("bf16", "bf16", "bf16")[2] == "bf16"
    assert key(None, None, "e4m3")[2] == "bf16/bf16/bf16/e4m3"
    assert key("e4m3", "e4m3", "e4m3")[2] == "bf16/e4m3/e4m3/e4m3"
    # Without q (no rotary for it) or new tokens, their dtypes are normalised away.
    no_q = kv_append.append_key("sm_90a", "bf16", 128, 128, 0, False, False, False, True, False, False, False,
                                False, "e4m3", "e4m3", "e4m3")
    assert no_q[2] == "bf16/bf16/e4m3/e4m3"
    # Paged caches take a leftpad (key counts), never a batch idx.
    assert key(paged=True, leftpad=True)[10:13] == (True, False, True)
    with pytest.raises(AssertionError):
        kv_append.append_key("sm_90a", "bf16", 128, 128, 0, False, False, False, True, True, True, False)


def test_paged_leftpad_reaches_the_attention_as_key_starts(events):
    leftpad = torch.tensor([2, 17], dtype=I32)
    a = _call(paged=True, cache_dtype=BF16, cache_leftpad=leftpad, causal=True)
    flash_attn_with_kvcache(**a)
    app, att = events[0][1], events[1][1]
    assert app.static[8:11] == (True, False, True)  # paged, no batch idx, leftpad
    assert app.tensors[8] is leftpad and app.tensors[13] is None  # no k_offsets: the cache is not flattened
    p = att.problem
    assert p.leftpad_k and p.paged and p.has_seqused_k and not p.varlen_k
    # the pages themselves, the key counts from the append, each sequence's start
    t = att.tensors
    assert t.k is a["k_cache"] and t.page_table is a["page_table"] and t.seqused_k is app.tensors[12]
    assert t.leftpad_k is leftpad and t.aux0 is None and t.block_ranges is None
    # The key: the paged field says so; the same call without leftpad keeps the plain key.
    key = sm80.compile_key(p, att.plan, "sm_80")
    plain = sm80.compile_key(p._replace(leftpad_k=False), att.plan, "sm_80")
    assert key[16] == keys.PAGED_LEFTPAD and plain[16] is True
    assert [i for i, (x, y) in enumerate(zip(key, plain)) if x != y] == [16]
    assert keys.parse_key(key, 4).leftpad_k and not keys.parse_key(plain, 4).leftpad_k
    # Without new tokens (cache_leftpad alone) the append still writes the key counts.
    events.clear()
    flash_attn_with_kvcache(**{**a, "k": None, "v": None, "rotary_cos": None, "rotary_sin": None})
    assert _kinds(events) == ["append", "attention"] and events[0][1].static[7] is False
    assert events[1][1].tensors.leftpad_k is leftpad
    # A repeated call hits the per-call cache and passes the starts again.
    events.clear()
    flash_attn_with_kvcache(**a)
    assert events[1][1].tensors.leftpad_k is leftpad
    # Packed queries over pages with leftpad: both launches of a mixed plan get the starts.
    events.clear()
    g = torch.Generator().manual_seed(3)
    q = torch.randn(130, 8, 64, generator=g).to(BF16)
    flash_attn_with_kvcache(q, a["k_cache"], a["v_cache"], cache_seqlens=torch.tensor([5, 9], dtype=I32),
                            page_table=a["page_table"], cache_leftpad=leftpad,
                            cu_seqlens_q=torch.tensor([0, 1, 130], dtype=I32), max_seqlen_q=129, causal=True)
    atts = [r for k, r in events if k == "attention"]
    assert len(atts) == 2 and all(r.tensors.leftpad_k is leftpad and r.problem.leftpad_k for r in atts)


def test_paged_leftpad_refusals(events):
    a = _call(paged=True, cache_dtype=BF16)
    with pytest.raises(ValueError, match="cache_batch_idx applies to a contiguous cache"):
        flash_attn_with_kvcache(**a, cache_batch_idx=torch.tensor([1, 0], dtype=I32))
    with pytest.raises(TypeError, match="cache_leftpad must be int32"):
        flash_attn_with_kvcache(**a, cache_leftpad=torch.tensor([1, 0]))
    with pytest.raises(ValueError, match=r"cache_leftpad must have shape \(batch,\)"):
        flash_attn_with_kvcache(**a, cache_leftpad=torch.tensor([1, 0, 3], dtype=I32))
    assert events == []


def _problem(**kw):
    base = dict(dtype=BF16, batch=4, max_seqlen_q=1, max_seqlen_k=4096, nheads=32, nheads_kv=8, d=128, d_v=128,
                softmax_scale=0.088, causal=True, window_left=-1, window_right=0, softcap=0.0, varlen_q=False,
                varlen_k=False, has_seqused_k=True, page_size=128, has_lse=True, leftpad_k=True)
    return FwdProblem(**{**base, **kw})


def test_backends_on_paged_leftpad():
    # SM90: a key start inside a page moves blocks off the pages' TMA boxes: row gathers,
    # for every page size (one that holds whole blocks too), 16-bit and FP8 K/V.
    for ps in (1, 16, 64, 128, 256):
        for kv_dtype in (None, E4M3):
            p = _problem(page_size=ps, kv_dtype=kv_dtype)
            assert sm90.check(p) is None and sm90.plan(p, 0, None, 132).config.gather_kv, (ps, kv_dtype)
            assert not sm90.plan(p._replace(leftpad_k=False), 0, None, 132).config.gather_kv or ps < 64
    # FP8 attention: rows gathered by producer warp 0, on one consumer warpgroup
    # (config.fp8_qkv_tile); SM80 has no FP8 attention.
    qkv = _problem(dtype=E4M3, page_size=128)
    config = sm90.plan(qkv, 0, None, 132).config
    assert sm90.check(qkv) is None and config.gather_kv and config.tile_m == 64 and sm80.check(qkv) is not None
    # SM100 refuses it with its reason; the automatic choice on a B200 falls back to SM80.
    assert "cache_leftpad with a paged cache" in sm100.check(_problem())
    assert sm80.check(_problem()) is None and sm100.check(_problem(leftpad_k=False)) is None


def test_sm100_leftpad_falls_back_to_sm80(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert seam.select_backend(None, _problem(), "cuda:0")[0] == "sm80"
    assert seam.select_backend(None, _problem(leftpad_k=False), "cuda:0")[0] == "sm100"
    with pytest.raises(NotImplementedError, match="cache_leftpad with a paged cache"):
        seam.select_backend("sm100", _problem(), "cuda:0")


def test_check_cache_bounds_reads_cache_batch_idx(events, monkeypatch):
    reads = []
    real = checks.cache_bounds
    monkeypatch.setattr(checks, "cache_bounds", lambda *a, **kw: reads.append(kw) or real(*a, **kw))
    a = _call(cache_dtype=BF16, k_cache=torch.randn(3, 48, 2, 64).to(BF16), v_cache=torch.randn(3, 48, 2, 64).to(BF16))
    for bad, shown in (([0, 3], 3), ([-1, 2], -1), ([2**31 - 1, 0], 2**31 - 1)):
        with pytest.raises(ValueError, match=rf"cache_batch_idx entries must lie in \[0, batch_cache = 3\).*got "
                                             rf"{shown} "):
            flash_attn_with_kvcache(**a, cache_batch_idx=torch.tensor(bad, dtype=I32), check_cache_bounds=True)
    assert events == [] and len(reads) == 3  # one read-back per call, before any launch
    flash_attn_with_kvcache(**a, cache_batch_idx=torch.tensor([2, 0], dtype=I32), check_cache_bounds=True)
    assert _kinds(events) == ["append", "attention"] and len(reads) == 4
    # Unchecked, an out-of-range index is the kernel's to clamp (no host read at all).
    events.clear()
    flash_attn_with_kvcache(**a, cache_batch_idx=torch.tensor([7, 0], dtype=I32))
    assert _kinds(events) == ["append", "attention"] and len(reads) == 4


def test_cache_bounds_pages_before_leftpad_are_not_checked():
    table = torch.tensor([[99, 99, 1, 2], [0, 1, 2, 3]], dtype=I32)  # sequence 0 starts at page 2
    lens = torch.tensor([60, 64], dtype=I32)
    with pytest.raises(ValueError, match="page_table entries"):
        checks.cache_bounds(lens, 64, table, (4, 16, 2, 64))
    assert checks.cache_bounds(lens, 64, table, (4, 16, 2, 64), leftpad=torch.tensor([32, 0], dtype=I32)) == 64
