"""CPU tests of ``quantize_fp8``: layouts of the descales, the round trip, refusals."""

import pytest
import torch

from flash_attn_cute.host.fp8 import quantize_fp8


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("granularity,shape", [("tensor", (1,)), ("head", (4,)), ("batch_head", (3, 4))])
def test_round_trip_and_layout(granularity, shape, dtype):
    x = torch.randn(3, 50, 4, 64) * torch.tensor([1.0, 10.0, 0.1, 1000.0]).view(1, 1, 4, 1)
    x[1, :, 2] = 0  # an all-zero (batch, head) group: descale 1, no NaN
    x_fp8, descale = quantize_fp8(x, granularity=granularity, dtype=dtype)
    assert x_fp8.dtype == dtype and x_fp8.shape == x.shape and descale.dtype == torch.float32
    assert tuple(descale.shape) == shape
    view = {"tensor": (1, 1, 1, 1), "head": (1, 1, 4, 1), "batch_head": (3, 1, 4, 1)}[granularity]
    back = x_fp8.float() * descale.view(view)
    rel = 2.0 ** -(3 if dtype == torch.float8_e4m3fn else 2)  # half an ulp of the mantissa, relative
    assert torch.isfinite(back).all()
    big = x.abs() > descale.view(view) * 2 ** -6  # normal range of the format
    assert ((back - x).abs() <= rel * x.abs() + 1e-6)[big].all()
    amax = (x_fp8.float().abs()).amax()
    assert amax <= torch.finfo(dtype).max


def test_refusals():
    with pytest.raises(TypeError, match="floating-point"):
        quantize_fp8(torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(TypeError, match="dtype must be one of"):
        quantize_fp8(torch.randn(2, 2), dtype=torch.float16)
    with pytest.raises(ValueError, match="granularity"):
        quantize_fp8(torch.randn(2, 2), granularity="row")
    with pytest.raises(ValueError, match=r"\(batch, seqlen, nheads, headdim\)"):
        quantize_fp8(torch.randn(5, 2, 8), granularity="batch_head")


# ---------------------------------------------------------------------------------------
# FP8 K/V caches through the public API (CPU: a fake device, launches recorded)
# ---------------------------------------------------------------------------------------

from types import SimpleNamespace  # noqa: E402

from flash_attn_cute import (flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, seam, sm80,  # noqa: E402
                             sm90, sm100)
from flash_attn_cute.host.problems import FwdProblem  # noqa: E402
from flash_attn_cute.host.tuning import NO_TUNING, Tuning  # noqa: E402

E4M3 = torch.float8_e4m3fn
WIDEN = Tuning(sm90_fp8_kv="widen")  # SM90: an FP8 cache widened to 16 bits (not the default)


@pytest.fixture
def launches(fake_device):
    """The real backends' check and plan, with launchers that record (problem, plan, tensors)."""
    calls = []

    def module(name, kind="fwd"):
        real = {"sm80": sm80, "sm90": sm90}.get(name, sm80)

        def launcher(problem, plan, device=None):
            return lambda tensors: calls.append(SimpleNamespace(problem=problem, plan=plan, tensors=tensors))

        return SimpleNamespace(AUTO=name in ("sm80", "sm90"), runs_on=real.runs_on, check=real.check,
                               plan=real.plan, launcher=launcher)

    fake_device(module)
    return calls


def _kv(batch=2, seqlen=64, hkv=2, d=64, dtype=E4M3):
    return torch.randn(batch, seqlen, hkv, d).to(dtype), torch.randn(batch, seqlen, hkv, d).to(dtype)


def test_fp8_cache_reaches_the_sm90_kernel_with_descales(launches):
    q = torch.randn(2, 1, 8, 64).to(torch.bfloat16)
    k8, v8 = _kv()
    kd, vd = torch.rand(2, 2) + 0.5, torch.rand(1) + 0.5
    flash_attn_with_kvcache(q, k8, v8, cache_seqlens=torch.tensor([64, 3], dtype=torch.int32), k_descale=kd,
                            v_descale=vd)
    call = launches[-1]
    # Hopper: the SM90 kernel, on one consumer warpgroup (it widens each block into one buffer)
    assert call.problem.kv_dtype == E4M3 and call.plan.backend == "sm90" and call.plan.config.tile_m == 64
    k_descale, v_descale = call.tensors[11:13]
    assert k_descale is kd and v_descale.shape == (2, 2) and v_descale.stride() == (0, 0)
    key = sm90.compile_key(call.problem, call.plan, "sm_90a")
    plain = sm90.compile_key(call.problem._replace(kv_dtype=None), call.plan, "sm_90a")
    assert key[2] == "bf16/e4m3" and plain[2] == "bf16"
    # no descale: 1.0; the same call replayed from the per-call cache passes the same views
    flash_attn_func(q, k8, v8)
    one = launches[-1].tensors[11]
    assert one.shape == (2, 2) and float(one[1, 1]) == 1.0
    flash_attn_func(q, k8, v8)
    assert launches[-1].tensors[11].shape == (2, 2)
    # packed queries over a paged fp8 pool (a mixed step: both launches get the descales)
    qp = torch.randn(21, 8, 64).to(torch.bfloat16)
    pool8 = torch.randn(40, 16, 2, 64).to(E4M3)
    launches.clear()
    flash_attn_varlen_func(qp, pool8, pool8, cu_seqlens_q=torch.tensor([0, 1, 21], dtype=torch.int32), max_seqlen_q=20,
                           seqused_k=torch.tensor([30, 100], dtype=torch.int32),
                           page_table=torch.arange(16, dtype=torch.int32).view(2, 8), k_descale=kd, v_descale=kd)
    assert len(launches) == 2 and all(c.tensors[11] is kd and c.problem.kv_fp8 for c in launches)


def test_fp8_refusals(launches):
    q = torch.randn(2, 1, 8, 64).to(torch.bfloat16)
    k8, v8 = _kv()
    with pytest.raises(TypeError, match="share one dtype"):
        flash_attn_with_kvcache(q, k8, v8.to(torch.bfloat16))
    with pytest.raises(TypeError, match="like q, or an FP8 dtype"):
        flash_attn_with_kvcache(q, k8.to(torch.float16), v8.to(torch.float16))
    with pytest.raises(ValueError, match=r"k_descale must have shape \(batch, nheads_kv\) = \(2, 2\)"):
        flash_attn_with_kvcache(q, k8, v8, k_descale=torch.ones(2, 8))
    with pytest.raises(TypeError, match="v_descale must be float32"):
        flash_attn_func(q, k8, v8, v_descale=torch.ones(2, 2, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="q_descale must be a torch.Tensor"):
        flash_attn_func(q, k8, v8, q_descale=1.0)
    with pytest.raises(TypeError, match="FP8 queries need k and v in"):
        flash_attn_func(q.to(E4M3), k8.to(torch.bfloat16), v8)
    # Appending into an FP8 cache takes q's 16-bit dtype or the cache's own (tests/test_kv_append_api.py)
    with pytest.raises(TypeError, match="k must be torch.bfloat16 like q, or torch.float8_e4m3fn like the cache"):
        flash_attn_with_kvcache(q, k8, v8, k=torch.randn(2, 1, 2, 64).to(torch.float8_e5m2),
                                v=torch.randn(2, 1, 2, 64).to(torch.float8_e5m2), cache_seqlens=3)
    # 16-bit caches: descales checked, then ignored (no fp8 problem)
    k, v = _kv(dtype=torch.bfloat16)
    flash_attn_with_kvcache(q, k, v, k_descale=torch.ones(2, 2), v_descale=torch.ones(1))
    assert launches[-1].problem.kv_dtype is None and launches[-1].tensors[11] is None


def test_fp8_needs_compute_capability_8_9(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    p = FwdProblem(dtype=torch.bfloat16, batch=1, max_seqlen_q=1, max_seqlen_k=64, nheads=8, nheads_kv=2, d=64,
                   d_v=64, softmax_scale=0.1, causal=False, window_left=-1, window_right=-1, softcap=0.0,
                   varlen_q=False, varlen_k=False, has_seqused_k=False, page_size=0, has_lse=False, kv_dtype=E4M3)
    with pytest.raises(NotImplementedError, match="compute capability >= 8.9"):
        seam.select_backend(None, p, "cuda:0")
    assert sm100.check(p) is None and sm90.check(p) is None and sm80.check(p) is None


def test_fp8_tiles_fit_the_shared_memory_of_the_arch():
    # The staging buffers add tile_n x (d + d_v) bytes: on the 99 KB parts (sm_89, sm_120)
    # the decode tile's KV block halves; the 227 KB parts keep the measured tile.
    decode = FwdProblem(dtype=torch.bfloat16, batch=2, max_seqlen_q=1, max_seqlen_k=4096, nheads=32, nheads_kv=8,
                        d=128, d_v=128, softmax_scale=0.1, causal=False, window_left=-1, window_right=-1,
                        softcap=0.0, varlen_q=False, varlen_k=False, has_seqused_k=True, page_size=0, has_lse=False,
                        kv_dtype=E4M3)
    assert sm80.plan(decode, 1, None, 132, arch="sm_90a").config[:2] == (64, 128)
    assert sm80.plan(decode, 1, None, 132, arch="sm_89").config[:2] == (64, 64)
    assert sm80.plan(decode._replace(kv_dtype=None), 1, None, 132, arch="sm_89").config[:2] == (64, 128)
    assert sm80.plan(decode._replace(d=256, d_v=256), 1, None, 132, arch="sm_120").config[:2] == (64, 32)
    # An 8-warp tile over rows of 96 fp8 values would copy 128 rows a pass into 64-row blocks.
    assert "not supported" in sm80.check(decode._replace(d=96, d_v=256))
    assert sm80.check(decode._replace(d=96, d_v=96)) is None
    # SM90's widening kernel (FLASH_ATTN_CUTE_SM90_FP8_KV=widen; the default quantizes q:
    # test_fp8_cache_quantizes_q_on_sm90): one consumer warpgroup, the stages that fit next to
    # the widened K and V blocks (decode rows of d <= 128: a tile that fits twice, two CTAs per SM)
    for d, rows, tile, ctas in ((128, 1, (64, 64, 3), 2), (64, 4, (64, 64, 3), 2), (128, 2048, (64, 128, 4), 1),
                                (64, 2048, (64, 128, 4), 1), (256, 1, (64, 64, 4), 1), (256, 2048, (64, 64, 4), 1)):
        p = decode._replace(d=d, d_v=d, max_seqlen_q=rows)
        config = sm90.plan(p, 1, False, 132, tuning=WIDEN).config
        assert config[:3] == tile and config.ctas_per_sm == ctas and not config.persistent, (d, rows, config)
        assert sm90.config.fp8_smem_bytes(d, d, *tile) <= (sm90.config.TWO_CTAS_SMEM if ctas == 2 else
                                                            sm90.config.SMEM_LIMIT)
    # a tuning override's tile that does not fit beside the widened buffers: tile_n shrinks
    assert sm90.config.fp8_tile(256, 256, (128, 128, 2, 0), 2) == (64, 64, 2, 0)
    # batch invariant: the decode rows keep the prefill tile (its tile_n may not depend on the rows)
    assert sm90.plan(decode._replace(batch_invariant=True), 1, False, 132).config[:2] == (64, 128)
    # a two-CTA key names it last (fp8 decode, and 16-bit decode: config.decode_two_ctas); a
    # one-CTA key keeps its form
    assert sm90.compile_key(decode, sm90.plan(decode, 1, False, 132, tuning=WIDEN), "sm_90a")[-1] == 2
    plain = decode._replace(kv_dtype=None, max_seqlen_q=2048)
    assert sm90.compile_key(plain, sm90.plan(plain, 1, False, 132), "sm_90a")[-2:] == (False, False)


# ---------------------------------------------------------------------------------------
# FP8 attention: q, k and v in e4m3 (SM90 kernel; fake device, launches recorded)
# ---------------------------------------------------------------------------------------


def _fp8_problem(**kw):
    base = dict(dtype=E4M3, batch=4, max_seqlen_q=8192, max_seqlen_k=8192, nheads=16, nheads_kv=16, d=128, d_v=128,
                softmax_scale=0.1, causal=False, window_left=-1, window_right=-1, softcap=0.0, varlen_q=False,
                varlen_k=False, has_seqused_k=False, page_size=0, has_lse=False)
    return FwdProblem(**{**base, **kw})


def test_fp8_attention_reaches_the_sm90_kernel(launches):
    q8 = torch.randn(2, 100, 8, 128).to(E4M3)
    k8, v8 = _kv(seqlen=300, d=128)
    qd, kd, vd = torch.rand(2, 2) + 0.5, torch.rand(2, 2) + 0.5, torch.rand(1) + 0.5
    out = flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=True)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 100, 8, 128)
    call = launches[-1]
    assert call.problem.qkv_fp8 and call.problem.kv_dtype is None and not call.problem.kv_fp8
    assert call.plan.backend == "sm90" and call.plan.config[:3] == (192, 96, 2) and not call.plan.config.persistent
    k_descale, v_descale = call.tensors[11:13]
    # q_descale joins k_descale: both scale the scores, one factor per (batch, KV head)
    assert torch.equal(k_descale, qd * kd) and v_descale.shape == (2, 2) and float(v_descale[1, 0]) == float(vd)
    assert sm90.compile_key(call.problem, call.plan, "sm_90a")[2] == "e4m3"
    # without q_descale, k_descale passes as given; the replay from the per-call cache too
    for _ in range(2):
        flash_attn_func(q8, k8, v8, k_descale=kd)
        assert launches[-1].tensors[11] is kd
    # out: bf16 (a 16-bit out of another dtype is refused)
    flash_attn_func(q8, k8, v8, out=torch.empty(2, 100, 8, 128, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="out must be"):
        flash_attn_func(q8, k8, v8, out=torch.empty(2, 100, 8, 128, dtype=torch.float16))
    # packed queries and keys, split: the combine writes bf16
    launches.clear()
    qp, kp = torch.randn(50, 8, 128).to(E4M3), torch.randn(8000, 2, 128).to(E4M3)
    out = flash_attn_varlen_func(qp, kp, kp, torch.tensor([0, 20, 50], dtype=torch.int32),
                                 torch.tensor([0, 4000, 8000], dtype=torch.int32), 30, 4000, num_splits=2)
    assert out.dtype == torch.bfloat16 and launches[-1].plan.num_splits == 2


def test_fp8_attention_refusals(launches, monkeypatch):
    q8 = torch.randn(2, 1, 8, 64).to(E4M3)
    k8, v8 = _kv()
    with pytest.raises(NotImplementedError, match="fp8_qkv is not implemented"):
        flash_attn_func(q8, k8, v8, backend="sm80")
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        flash_attn_func(q8.float().to(torch.float8_e5m2), k8, v8)
    with pytest.raises(TypeError, match="k and v in"):
        flash_attn_func(q8, k8.to(torch.float8_e5m2), v8.to(torch.float8_e5m2))
    # Pages of 16 (vLLM's): TMA boxes of 16 rows, one page lookup each (config.kv_box_rows),
    # or with FLASH_ATTN_CUTE_SM90_PAGED_KV=gather gathered rows on one consumer warpgroup
    # (config.fp8_qkv_tile); pages of 8: gathered either way.
    for page_size, knob, gathered, box in ((16, None, False, 16), (16, "gather", True, 0), (8, "boxes", True, 0)):
        if knob:
            monkeypatch.setenv("FLASH_ATTN_CUTE_SM90_PAGED_KV", knob)
        pool = torch.randn(64 // page_size * 2, page_size, 2, 64).to(E4M3)
        table = torch.arange(64 // page_size * 2, dtype=torch.int32).view(2, -1)
        launches.clear()
        flash_attn_with_kvcache(q8, pool, pool, cache_seqlens=torch.tensor([60, 3], dtype=torch.int32),
                                page_table=table)
        config = launches[-1].plan.config
        assert (config.gather_kv, config.kv_box) == (gathered, box) and config.tile_m == 64, config
    monkeypatch.delenv("FLASH_ATTN_CUTE_SM90_PAGED_KV")
    with pytest.raises(ValueError, match=r"multiple of 16 in \[16, 256\] \(FP8 tensors\), got 40"):
        flash_attn_func(*(torch.randn(2, 8, 2, 40).to(E4M3) for _ in range(3)))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    with pytest.raises(NotImplementedError, match="FP8 attention"):
        flash_attn_func(q8, k8, v8)
    assert sm80.check(_fp8_problem()) == "fp8_qkv is not implemented by this kernel"
    assert sm100.check(_fp8_problem()) is None  # compile-verified (test_fwd_compile)
    assert sm100.plan(_fp8_problem(), 1, None, 148).config.kv_stages == 4  # one byte a value: the deepest ring


@pytest.mark.parametrize("page_size", [0, 64, 128, 192, 320, 1024])
@pytest.mark.parametrize("d,d_v", [(64, 64), (96, 96), (128, 128), (192, 128), (256, 256)])
def test_fp8_attention_tiles(d, d_v, page_size):
    # tile_n: a multiple of 32 (the 8-bit k-block and the transposes' unit) dividing the page,
    # two stages of K, V and V^T beside Q within the shared memory
    for causal in (False, True):
        for rows in (1, 8192):
            p = _fp8_problem(d=d, d_v=d_v, page_size=page_size, has_seqused_k=page_size > 0, causal=causal,
                             window_right=0 if causal else -1, max_seqlen_q=rows)
            config = sm90.plan(p, 1, None, 132).config
            m, n, stages = config[:3]
            assert n % 32 == 0 and (not page_size or page_size % n == 0) and stages >= 2, config
            assert sm90.config.fp8_qkv_smem_bytes(d, d_v, m, n, stages) <= sm90.config.SMEM_LIMIT
            assert not config.gather_kv
            # persistent: non-causal dense prefill over d 128 where it fits (sm90.fp8_persistent)
            fp8_persistent = rows > 1 and not causal and max(d, d_v) > 128 and m // 64 < 3 and not page_size
            assert config.persistent == (fp8_persistent and sm90.FP8_PERSISTENT_DEFAULT), config
            # 16-bit queries over the e4m3 cache (quantized in the kernel): one tile per CTA
            p16 = p._replace(dtype=torch.bfloat16, kv_dtype=E4M3)
            assert not sm90.plan(p16, 1, None, 132).config.persistent
            assert not sm90.plan(p16, 1, None, 132, tuning=Tuning(sm90_persistent="1")).config.persistent
            knob = sm90.plan(p, 1, None, 132, tuning=Tuning(sm90_persistent="1")).config
            assert knob.persistent == (m // 64 < 3 and knob.ctas_per_sm == 1), knob
            # decode (one row) at d <= 128: two CTAs a SM (config.fp8_qkv_decode_tile)
            two = rows == 1 and max(d, d_v) <= 128
            assert config.ctas_per_sm == (2 if two else 1), config
            if two:
                assert sm90.config.fp8_qkv_smem_bytes(d, d_v, m, n, stages) + 3072 <= sm90.config.TWO_CTAS_SMEM
    # the measured prefill tiles (config.fp8_qkv_tile)
    if page_size == 0 and d == d_v:
        want = {64: ((192, 160), (192, 128)), 96: ((192, 96),) * 2, 128: ((192, 96),) * 2, 256: ((128, 96),) * 2}[d]
        for causal, tile in zip((False, True), want):
            p = _fp8_problem(d=d, d_v=d_v, causal=causal, window_right=0 if causal else -1)
            assert sm90.plan(p, 1, None, 132).config[:2] == tile


# ---------------------------------------------------------------------------------------
# An e4m3 cache under 16-bit queries on SM90: the queries quantized in the kernel (the
# default, ``sm90.quantizes_q``), the widening kernel by FLASH_ATTN_CUTE_SM90_FP8_KV=widen
# ---------------------------------------------------------------------------------------


def test_fp8_cache_quantizes_q_on_sm90():
    from flash_attn_cute.host.keys import QUANTIZE_Q

    decode = _fp8_problem(dtype=torch.bfloat16, kv_dtype=E4M3, batch=2, max_seqlen_q=1, max_seqlen_k=4096,
                          nheads=32, nheads_kv=8, has_seqused_k=True)
    plan = sm90.plan(decode, 1, True, 132)
    config = plan.config
    # The FP8 Q, K, V kernel's decode tile (one consumer warpgroup, two CTAs per SM,
    # config.fp8_qkv_decode_tile), not the widening kernel's (64, 64, 3)
    assert config.quantize_q and config[:3] == (64, 128, 2) and config.ctas_per_sm == 2 and not config.persistent
    key = sm90.compile_key(decode, plan, "sm_90a")
    assert key[2] == "bf16/e4m3" and key[-1] == QUANTIZE_Q and key[-2] == 2 and key[-4:-2] == (False, False)
    assert sm90.config.parse_key_extra(key[-2:]) == dict(ctas_per_sm=2, quantize_q=True, two_level=0, kv_box=0)
    # the knob keeps the widening kernel, its own key
    widen = sm90.plan(decode, 1, True, 132, tuning=WIDEN)
    assert not widen.config.quantize_q and widen.config[:3] == (64, 64, 3) and widen.config.ctas_per_sm == 2
    assert sm90.compile_key(decode, widen, "sm_90a")[-1] == 2
    assert sm90.config.parse_key_extra((2,)) == dict(ctas_per_sm=2, quantize_q=False, two_level=0, kv_box=0)
    assert sm90.config.parse_key_extra((2, QUANTIZE_Q, "kv_box16")) == dict(ctas_per_sm=2, quantize_q=True,
                                                                              two_level=0, kv_box=16)
    with pytest.raises(ValueError, match="FLASH_ATTN_CUTE_SM90_FP8_KV='bf16'"):
        sm90.plan(decode, 1, True, 132, tuning=Tuning(sm90_fp8_kv="bf16"))
    # fp16 queries too; the tiles are FP8 attention's (a prefill chunk: the measured (192, 96))
    assert sm90.plan(decode._replace(dtype=torch.float16), 1, True, 132).config.quantize_q
    prefill = decode._replace(max_seqlen_q=2048, causal=True, window_right=0)
    assert sm90.plan(prefill, 1, None, 132).config[:3] == (192, 96, 2)
    assert sm90.plan(prefill, 1, None, 132).config[:3] == sm90.plan(prefill._replace(dtype=E4M3, kv_dtype=None), 1,
                                                                    None, 132).config[:3]
    # every page size: one TMA per block (64, 128, 256); row gathers on one consumer
    # warpgroup (1; 16 with FLASH_ATTN_CUTE_SM90_PAGED_KV=gather; cache_leftpad). Decode
    # quantizes at every page size, two CTAs a SM ((64, 64, 3) where it gathers); a prefill
    # chunk over gathered pages widens unless the knob names the quantizing kernel (its
    # one-CTA gathers measured slower, sm90.plan; pages of 16 in boxes quantize: below)
    QUANTIZE = Tuning(sm90_fp8_kv="quantize_q")
    gathers = Tuning(sm90_paged_kv="gather")
    for page, gather, tile_n in ((1, True, 64), (16, True, 64), (64, False, 64), (128, False, 128),
                                 (256, False, 128)):
        for rows in (1, 2048):
            p = decode._replace(page_size=page, max_seqlen_q=rows)
            c = sm90.plan(p, 1, None, 132, tuning=QUANTIZE._replace(sm90_paged_kv="gather")).config
            assert c.quantize_q and c.gather_kv == gather and (c.tile_m == 64 or not gather), (page, rows, c)
            assert c.kv_box == 0, (page, rows, c)
            assert rows > 1 or (c.tile_n == tile_n and c.ctas_per_sm == 2 and c.num_stages == (3 if gather else 2)), \
                (page, c)
            assert sm90.plan(p, 1, None, 132, tuning=gathers).config.quantize_q == (rows == 1 or not gather), \
                (page, rows)
    # Pages of 16 by TMA boxes of 16 rows by default wherever the FP8 kernels read them: the
    # two-CTA decode tile, a prefill chunk (quantizing: no one-CTA gathers to avoid), d 256
    # decode, FP8 q, k, v and the widening kernel; the knob's "boxes" plans the same
    boxes = Tuning(sm90_paged_kv="boxes")
    for rows, tile in ((1, (64, 128, 2)), (2048, (192, 96, 2))):
        for knob in (NO_TUNING, boxes):
            c = sm90.plan(decode._replace(page_size=16, max_seqlen_q=rows), 1, None, 132, tuning=knob).config
            assert c.quantize_q and not c.gather_kv and c.kv_box == 16 and c[:3] == tile, (rows, c)
    for p in (decode._replace(page_size=16, d=256, d_v=256), decode._replace(page_size=16, dtype=E4M3, kv_dtype=None,
                                                                            max_seqlen_q=2048)):
        for knob in (NO_TUNING, boxes):
            c = sm90.plan(p, 1, None, 132, tuning=knob).config
            assert not c.gather_kv and c.kv_box == 16, (p, c)
        assert sm90.plan(p, 1, None, 132, tuning=gathers).config.gather_kv
    widened = sm90.plan(decode._replace(page_size=16), 1, None, 132, tuning=WIDEN).config
    assert not widened.quantize_q and not widened.gather_kv and widened.kv_box == 16, widened
    assert sm90.plan(decode._replace(page_size=16), 1, None, 132, tuning=WIDEN._replace(sm90_paged_kv="gather")
                     ).config.gather_kv
    with pytest.raises(ValueError, match="FLASH_ATTN_CUTE_SM90_PAGED_KV='box'"):
        sm90.plan(decode._replace(page_size=16), 1, None, 132, tuning=Tuning(sm90_paged_kv="box"))
    for rows, quantized in ((1, True), (2048, False)):
        lp = decode._replace(page_size=64, leftpad_k=True, max_seqlen_q=rows)
        c = sm90.plan(lp, 1, True, 132, tuning=QUANTIZE).config
        assert c.quantize_q and c.gather_kv and c.tile_m == 64
        assert sm90.plan(lp, 1, True, 132).config.quantize_q == quantized
    # context-parallel shards (and user variants) widen by default: the quantizing kernel has
    # compiled for them but not yet run them on a GPU; the knob names it
    cpp = decode._replace(cp=True, causal=True, window_right=0)
    assert not sm90.plan(cpp, 1, True, 132).config.quantize_q
    assert sm90.plan(cpp, 1, True, 132, tuning=QUANTIZE).config.quantize_q
    # the widening kernel stays where q may not be quantized: e5m2 caches, batch_invariant
    assert not sm90.plan(decode._replace(kv_dtype=torch.float8_e5m2), 1, True, 132).config.quantize_q
    inv = sm90.plan(decode._replace(batch_invariant=True), 1, True, 132)
    assert not inv.config.quantize_q and inv.config.split_blocks > 0
    # split plans: the heuristic on the FP8 tile; the SM80 kernel widens (no such choice)
    assert sm90.plan(decode._replace(batch=1, max_seqlen_k=131072), 0, True, 132).num_splits > 1
    assert not hasattr(sm80.plan(decode, 1, True, 132).config, "quantize_q")


def test_fp8_cache_knob_through_the_api(launches, monkeypatch):
    # flash_attn_with_kvcache reads the knob once per call; it enters the per-call cache key,
    # so the same call planned with and without it gets each its kernel. Out keeps q's dtype.
    q = torch.randn(2, 1, 8, 64).to(torch.float16)
    k8, v8 = _kv()
    lens = torch.tensor([64, 3], dtype=torch.int32)
    out = flash_attn_with_kvcache(q, k8, v8, cache_seqlens=lens)
    assert out.dtype == torch.float16 and launches[-1].plan.config.quantize_q
    monkeypatch.setenv("FLASH_ATTN_CUTE_SM90_FP8_KV", "widen")
    flash_attn_with_kvcache(q, k8, v8, cache_seqlens=lens)
    assert not launches[-1].plan.config.quantize_q and launches[-1].plan.config.ctas_per_sm == 2
    monkeypatch.delenv("FLASH_ATTN_CUTE_SM90_FP8_KV")
    flash_attn_with_kvcache(q, k8, v8, cache_seqlens=lens)
    assert launches[-1].plan.config.quantize_q
    # the descales reach the kernel as for the widening kernel (q_descale is for e4m3 q only)
    kd = torch.rand(2, 2) + 0.5
    flash_attn_with_kvcache(q, k8, v8, cache_seqlens=lens, k_descale=kd, q_descale=torch.ones(1))
    assert launches[-1].tensors[11] is kd


# ---------------------------------------------------------------------------------------
# fp8_two_level_interval: the FP8 P V product accumulated in two levels (SM90 FP8 Q, K, V
# kernel only; ``fp8_operands.TwoLevelPV``)
# ---------------------------------------------------------------------------------------


def _key(problem, backend=sm90, tuning=Tuning(), num_splits=1, pack_gqa=None):
    plan = backend.plan(problem, num_splits, pack_gqa, 132, tuning=tuning)
    return plan, backend.compile_key(problem, plan, "sm_90a" if backend is not sm100 else "sm_100a")


def test_two_level_plans_and_keys():
    from flash_attn_cute.host.keys import QUANTIZE_Q, parse_key

    decode = _fp8_problem(max_seqlen_q=1, max_seqlen_k=131072, nheads=32, nheads_kv=8, has_seqused_k=True)
    quantized = decode._replace(dtype=torch.bfloat16, kv_dtype=E4M3)
    for problem, tail in ((_fp8_problem(), ()), (decode, ()), (quantized, (QUANTIZE_Q,))):
        plan, key = _key(problem._replace(fp8_two_level_interval=4), pack_gqa=problem.max_seqlen_q == 1)
        assert plan.config.two_level == 4 and key[-1] == "two_level4" and key[-1 - len(tail):-1] == tail
        fields = parse_key(key, 4)  # (the key round trip: the kernel's keyword arguments)
        assert sm90.config.parse_key_extra(fields.extra[2:]) == dict(ctas_per_sm=1, quantize_q=bool(tail),
                                                                     two_level=4, kv_box=0)
        # 0 (the default): the key of today's kernel, no field
        off_plan, off = _key(problem._replace(fp8_two_level_interval=0), pack_gqa=problem.max_seqlen_q == 1)
        assert off == _key(problem, pack_gqa=problem.max_seqlen_q == 1)[1] and not any(
            isinstance(f, str) and f.startswith("two_level") for f in off)
        assert off_plan.config.two_level == 0 and sm90.config.parse_key_extra(parse_key(off, 4).extra[2:])[
            "two_level"] == 0
    # Every other kernel ignores it: 16-bit attention, the widening kernel (its knob,
    # batch_invariant, e5m2), SM80 and SM100 (FP8 attention there: compiled, not run)
    bf16 = _fp8_problem(dtype=torch.bfloat16)
    for problem, backend, tuning in ((bf16, sm90, Tuning()), (quantized, sm90, WIDEN),
                                     (quantized._replace(batch_invariant=True), sm90, Tuning()),
                                     (quantized._replace(kv_dtype=torch.float8_e5m2, dtype=torch.float16), sm90,
                                      Tuning()),
                                     (quantized, sm80, Tuning()), (_fp8_problem(), sm100, Tuning()), (bf16, sm100,
                                                                                                       Tuning())):
        pack = problem.max_seqlen_q == 1
        assert _key(problem._replace(fp8_two_level_interval=4), backend, tuning, pack_gqa=pack)[1] == \
            _key(problem, backend, tuning, pack_gqa=pack)[1], (problem, backend)


@pytest.mark.parametrize("page_size", [0, 64, 1])
@pytest.mark.parametrize("d,d_v", [(64, 64), (96, 96), (128, 128), (192, 128), (192, 192), (256, 256)])
def test_two_level_tiles(d, d_v, page_size):
    # The second O accumulator (d_v / 2 fp32 registers a consumer thread) fits beside S and P
    # (config.two_level_fits: the sums measured clear of local memory in sm_90a SASS), the
    # tile still an FP8 Q, K, V one (test_fp8_attention_tiles); d_v > 192 fits nowhere: FP8
    # q, k, v is refused, 16-bit queries over an e4m3 cache take the widening kernel.
    for causal in (False, True):
        for rows in (1, 8192):
            p = _fp8_problem(d=d, d_v=d_v, page_size=page_size, has_seqused_k=page_size > 0, causal=causal,
                             window_right=0 if causal else -1, max_seqlen_q=rows, fp8_two_level_interval=4)
            q16 = p._replace(dtype=torch.bfloat16, kv_dtype=E4M3)
            if d_v > 192:
                assert "fp8_two_level_interval with FP8 q, k, v needs head_dim_v <= 192" in sm90.check(p)
                assert sm90.check(p._replace(fp8_two_level_interval=0)) is None
                c = sm90.plan(q16, 1, None, 132, tuning=Tuning(sm90_fp8_kv="quantize_q")).config
                assert not c.quantize_q and c.two_level == 0, c
                continue
            assert sm90.check(p) is None
            c = sm90.plan(p, 1, None, 132).config
            m, n, stages = c[:3]
            assert c.two_level == 4 and sm90.config.two_level_fits(d_v, m, n), c
            assert n % 32 == 0 and (page_size in (0, 1) or page_size % n == 0) and stages >= 2, c
            assert sm90.config.fp8_qkv_smem_bytes(d, d_v, m, n, stages) <= sm90.config.SMEM_LIMIT
            assert c.gather_kv == (page_size == 1) and (m == 64 or not c.gather_kv)
            off = sm90.plan(p._replace(fp8_two_level_interval=0), 1, None, 132).config
            # decode: two-level keeps the one-CTA tile (O twice does not fit two CTAs' registers)
            assert c.ctas_per_sm == 1 and (off.ctas_per_sm == 2) == (rows == 1 and max(d, d_v) <= 128), (c, off)
            assert c[:3] == off[:3] or rows == 1 or not sm90.config.two_level_fits(d_v, *off[:2]), (c, off)
            qc = sm90.plan(q16, 1, None, 132, tuning=Tuning(sm90_fp8_kv="quantize_q")).config
            assert qc.quantize_q and qc[:3] == c[:3] and qc.two_level == 4
    # the prefill tiles that change: fewer keys (d 64), fewer rows (d 96, 128), one warpgroup (d 192)
    if page_size == 0:
        want = {(64, 64): (192, 128), (96, 96): (128, 128), (128, 128): (128, 128), (192, 128): (128, 128),
                (192, 192): (64, 64)}.get((d, d_v))
        if want:
            assert sm90.plan(_fp8_problem(d=d, d_v=d_v, fp8_two_level_interval=4), 1, None,
                             132).config[:2] == want
        # a tuning override's tile is taken as it is
        override = Tuning(sm90_tile="192,96,2")
        if d_v <= 192:
            p = _fp8_problem(d=d, d_v=d_v, fp8_two_level_interval=4)
            assert sm90.plan(p, 1, None, 132, tuning=override).config[:2] == (192, 96)


def test_two_level_through_the_api(launches):
    q8 = torch.randn(2, 100, 8, 128).to(E4M3)
    k8, v8 = _kv(seqlen=300, d=128)
    flash_attn_func(q8, k8, v8, fp8_two_level_interval=4)
    call = launches[-1]
    assert call.problem.fp8_two_level_interval == 4 and call.plan.config.two_level == 4
    assert call.plan.config[:2] == (128, 128)
    # the per-call cache keys the value: the same call without it gets today's kernel
    flash_attn_func(q8, k8, v8)
    assert launches[-1].problem.fp8_two_level_interval == 0 and launches[-1].plan.config[:2] == (192, 96)
    flash_attn_func(q8, k8, v8, fp8_two_level_interval=4)
    assert launches[-1].plan.config.two_level == 4
    # 16-bit queries over an e4m3 cache (quantized in the kernel): kvcache and varlen
    lens = torch.tensor([300, 7], dtype=torch.int32)
    q = torch.randn(2, 1, 8, 128).to(torch.bfloat16)
    flash_attn_with_kvcache(q, k8, v8, cache_seqlens=lens, fp8_two_level_interval=1)
    call = launches[-1]
    assert call.plan.config.quantize_q and call.plan.config.two_level == 1
    cu_q = torch.tensor([0, 1, 2], dtype=torch.int32)
    flash_attn_varlen_func(q[:, 0], k8.view(-1, 2, 128), v8.view(-1, 2, 128), cu_q,
                           torch.tensor([0, 300, 600], dtype=torch.int32), 1, 300, fp8_two_level_interval=16)
    assert launches[-1].plan.config.quantize_q and launches[-1].plan.config.two_level == 16
    # 16-bit attention ignores it (its problem is the one without it)
    k, v = k8.to(torch.bfloat16), v8.to(torch.bfloat16)
    flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, fp8_two_level_interval=4)
    assert launches[-1].problem.fp8_two_level_interval == 0 and launches[-1].plan.config.two_level == 0
    # FP8 q, k, v of d_v 256: refused with the reason (no kernel keeps both accumulators)
    q256, k256 = torch.randn(1, 8, 2, 256).to(E4M3), torch.randn(1, 8, 2, 256).to(E4M3)
    with pytest.raises(NotImplementedError, match="fp8_two_level_interval with FP8 q, k, v needs head_dim_v <= 192"):
        flash_attn_func(q256, k256, k256, fp8_two_level_interval=4)
    flash_attn_func(q256, k256, k256)
