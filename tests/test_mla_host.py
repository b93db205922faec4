"""CPU tests of ``flash_mla_decode``'s host side: validation (every error names its
argument, before any launch), the MLA seam's planning and backend registry. No GPU."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch


import flash_attn_cute
from flash_attn_cute import mla, seam
from flash_attn_cute.api import mla_call
from flash_attn_cute.mla import MlaProblem, flash_mla_decode
from flash_attn_cute.host.tuning import Tuning

BF16 = torch.bfloat16


def E4(*shape):
    return torch.randn(*shape).to(torch.float8_e4m3fn)


def E5(*shape):
    return torch.randn(*shape).to(torch.float8_e5m2)


def inputs(b=2, sq=1, h=16, pages=6, page=4, max_pages=3, dtype=BF16):
    return dict(
        q_nope=torch.randn(b, sq, h, 512).to(dtype), q_pe=torch.randn(b, sq, h, 64).to(dtype),
        ckv_cache=torch.randn(pages, page, 512).to(dtype), kpe_cache=torch.randn(pages, page, 64).to(dtype),
        cache_seqlens=torch.full((b,), 5, dtype=torch.int32),
        page_table=torch.arange(b * max_pages, dtype=torch.int32).view(b, max_pages) % pages,
    )


def call(**over):
    kw = inputs()
    opts = {k: over.pop(k) for k in list(over) if k not in kw}
    kw.update(over)
    return flash_mla_decode(kw.pop("q_nope"), kw.pop("q_pe"), kw.pop("ckv_cache"), kw.pop("kpe_cache"),
                            kw.pop("cache_seqlens"), kw.pop("page_table"), **opts)


def test_exported():
    assert flash_attn_cute.flash_mla_decode is flash_mla_decode
    assert "flash_mla_decode" in flash_attn_cute.__all__


@pytest.mark.parametrize("over,exc,match", [
    (dict(q_nope=torch.randn(2, 1, 16, 576).to(BF16)), ValueError, "q_nope head dimension must be 512"),
    (dict(q_pe=torch.randn(2, 1, 16, 128).to(BF16)), ValueError, "q_pe head dimension must be 64"),
    (dict(q_pe=torch.randn(2, 1, 8, 64).to(BF16)), ValueError, "q_pe must have shape"),
    (dict(ckv_cache=torch.randn(6, 4, 256).to(BF16)), ValueError, "ckv_cache head dimension"),
    (dict(kpe_cache=torch.randn(5, 4, 64).to(BF16)), ValueError, "kpe_cache .* must have the pages"),
    (dict(kpe_cache=torch.randn(6, 4, 64)), TypeError, "kpe_cache must be torch.bfloat16"),
    (dict(q_pe=torch.randn(2, 1, 16, 64).half()), TypeError, "q_pe must be"),
    (dict(q_nope=torch.randn(2, 1, 16, 512), q_pe=torch.randn(2, 1, 16, 64)), TypeError, "q_nope must be float16"),
    (dict(page_table=torch.zeros(2, 3, dtype=torch.int64)), TypeError, "page_table must be int32"),
    (dict(page_table=torch.zeros(3, 3, dtype=torch.int32)), ValueError, "page_table must have shape"),
    (dict(page_table=torch.zeros(2, 6, dtype=torch.int32)[:, ::2]), ValueError, "page_table must have a contiguous"),
    (dict(page_table=torch.zeros(6, dtype=torch.int32)), ValueError, "page_table must have shape"),
    (dict(cache_seqlens=torch.zeros(2, dtype=torch.int64)), TypeError, "cache_seqlens must be int32"),
    (dict(cache_seqlens=torch.zeros(3, dtype=torch.int32)), ValueError, "cache_seqlens must have shape"),
    (dict(q_nope=torch.randn(2, 1, 129, 512).to(BF16), q_pe=torch.randn(2, 1, 129, 64).to(BF16)), ValueError,
     r"nheads \(q_nope.shape\[2\]\) must be in 1..128, got 129"),
    (dict(q_nope=torch.randn(2, 1, 0, 512).to(BF16), q_pe=torch.randn(2, 1, 0, 64).to(BF16)), ValueError,
     r"nheads \(q_nope.shape\[2\]\) must be in 1..128, got 0"),
    # A KV-head mode (FlashMLA's (num_pages, page_size, h_kv, d)): nheads a multiple of h_kv, kpe alike.
    (dict(ckv_cache=torch.randn(6, 4, 3, 512).to(BF16), kpe_cache=torch.randn(6, 4, 3, 64).to(BF16)), ValueError,
     r"nheads \(q_nope.shape\[2\] = 16\) must be a multiple of nheads_kv \(ckv_cache.shape\[2\] = 3\)"),
    (dict(ckv_cache=torch.randn(6, 4, 2, 512).to(BF16)), ValueError, r"kpe_cache must have shape \(num_pages, "
     r"page_size, nheads_kv, 64\) like ckv_cache \(rank 4\)"),
    (dict(ckv_cache=torch.randn(6, 4, 2, 512).to(BF16), kpe_cache=torch.randn(6, 4, 4, 64).to(BF16)), ValueError,
     "kpe_cache .* must have the pages and KV heads of ckv_cache"),
    (dict(ckv_cache=torch.randn(6, 4, 2, 512).to(BF16), kpe_cache=torch.randn(6, 4, 2, 64).to(BF16),
          kv_descale=torch.ones(2, 4)), ValueError, r"kv_descale must have .* \(batch, nheads_kv\) = \(2, 2\)"),
    (dict(ckv_cache=torch.randn(6, 4, 2, 2, 512).to(BF16)), ValueError,
     r"ckv_cache must have shape \(num_pages, page_size, 512\) or \(num_pages, page_size, nheads_kv, 512\) "
     r"\(rank 3, or 4"),
    (dict(q_nope=torch.randn(2, 0, 16, 512).to(BF16), q_pe=torch.randn(2, 0, 16, 64).to(BF16)), ValueError,
     "seqlen_q"),
    (dict(ckv_cache=torch.randn(6, 0, 512).to(BF16), kpe_cache=torch.randn(6, 0, 64).to(BF16)), ValueError,
     "page_size"),
    (dict(q_nope="x"), TypeError, "q_nope must be a torch.Tensor"),
    (dict(softmax_scale="1"), TypeError, "softmax_scale"),
    (dict(softmax_scale=float("inf")), ValueError, "softmax_scale must be finite"),
    (dict(causal=1), TypeError, "causal must be a bool"),
    (dict(num_splits=-1), ValueError, "num_splits"),
    (dict(num_splits=1.0), TypeError, "num_splits must be an int"),
    (dict(backend="sm70"), ValueError, "backend must be one of"),
    (dict(backend="sm100"), NotImplementedError, "has no MLA kernel"),
    (dict(out=torch.empty(2, 1, 16, 256, dtype=BF16)), ValueError, "out must have shape"),
    (dict(out=torch.empty(2, 1, 16, 512)), TypeError, "out must be"),
    # An FP8 latent cache: both caches in one fp8 dtype, an fp32 descale of one element or (batch,).
    (dict(ckv_cache=torch.randn(6, 4, 512).to(torch.float8_e4m3fn)), TypeError,
     "kpe_cache must be torch.float8_e4m3fn like ckv_cache"),
    (dict(kpe_cache=torch.randn(6, 4, 64).to(torch.float8_e4m3fn)), TypeError,
     "kpe_cache must be torch.bfloat16 like q_nope, or an FP8 dtype"),
    (dict(ckv_cache=torch.randn(6, 4, 512).to(torch.float8_e4m3fn),
          kpe_cache=torch.randn(6, 4, 64).to(torch.float8_e5m2)), TypeError, "kpe_cache must be"),
    (dict(q_nope=torch.randn(2, 1, 16, 512).to(torch.float8_e4m3fn)), TypeError, "q_nope must be float16"),
    (dict(kv_descale=torch.ones(3)), ValueError, r"kv_descale must have one element or shape \(batch,\)"),
    (dict(kv_descale=torch.ones(2, 2)), ValueError, r"kv_descale must have one element or shape \(batch,\)"),
    (dict(kv_descale=torch.ones(1, dtype=torch.float64)), TypeError, "kv_descale must be float32"),
    (dict(kv_descale=1.0), TypeError, "kv_descale must be a torch.Tensor"),
    # FP8 queries (FlashMLA's FP8 mode): e4m3 over an e4m3 cache, q_descale as kv_descale, out bf16.
    (dict(q_nope=E4(2, 1, 16, 512), q_pe=E4(2, 1, 16, 64), ckv_cache=E5(6, 4, 512), kpe_cache=E5(6, 4, 64)),
     TypeError, "float8_e4m3fn queries need a float8_e4m3fn cache"),
    (dict(q_nope=E4(2, 1, 16, 512), q_pe=torch.randn(2, 1, 16, 64).to(BF16), ckv_cache=E4(6, 4, 512),
          kpe_cache=E4(6, 4, 64)), TypeError, "q_pe must be torch.float8_e4m3fn like q_nope"),
    (dict(q_descale=torch.ones(3)), ValueError, r"q_descale must have one element or shape \(batch,\)"),
    (dict(q_nope=E4(2, 1, 16, 512), q_pe=E4(2, 1, 16, 64), ckv_cache=E4(6, 4, 512), kpe_cache=E4(6, 4, 64),
          out=E4(2, 1, 16, 512)), TypeError, "out must be torch.bfloat16"),
])
def test_validation_names_the_argument(over, exc, match):
    with pytest.raises(exc, match=match):
        call(**over)


def test_cpu_tensors_are_refused_after_the_other_checks():
    with pytest.raises(ValueError, match="q_nope must be a CUDA tensor"):
        call()


def test_ckv_stride_alignment_is_checked():
    ckv = torch.randn(6, 4, 520).to(BF16)[:, :, :512]  # rows 1040 B apart: fine (16 B multiple)
    with pytest.raises(ValueError, match="CUDA"):
        call(ckv_cache=ckv)
    odd = torch.randn(6 * 4 * 512 + 1).to(BF16)[1:].view(6, 4, 512)  # misaligned data pointer
    with pytest.raises(ValueError, match="ckv_cache must be 16-byte aligned"):
        call(ckv_cache=odd)


def _problem(batch=1, sq=1, capacity=32768, h=64, page=1, causal=False, lse=False, hkv=1):
    return MlaProblem(dtype=BF16, batch=batch, max_seqlen_q=sq, max_seqlen_k=capacity, nheads=h, page_size=page,
                      softmax_scale=576 ** -0.5, causal=causal, has_lse=lse, nheads_kv=hkv)


def test_plan_splits_from_shapes_only():
    sm80 = seam.backend_module("sm80", "mla")
    # one sequence of 32k keys on 132 SMs: split; a full batch: not; explicit counts kept
    assert sm80.plan(_problem(), 0, None, 132, arch="sm_90a").num_splits > 8
    assert sm80.plan(_problem(batch=768, capacity=2048), 0, None, 132, arch="sm_90a").num_splits == 1
    assert sm80.plan(_problem(batch=64, capacity=512), 0, None, 132, arch="sm_90a").num_splits == 1  # <= 512 keys
    assert sm80.plan(_problem(), 5, None, None, arch="sm_90a").num_splits == 5
    assert sm80.plan(_problem(capacity=100), 7, None, None, arch="sm_90a").num_splits == 2  # >= 64 keys a split


def test_compile_key_fields_and_registry():
    sm80 = seam.backend_module("sm80", "mla")
    p = _problem(h=128, causal=True)
    plan = sm80.plan(p, 3, None, None, arch="sm_90a")
    assert plan.config == (3, 0, 0) and plan.pack_gqa and plan.qhead_per_kvhead_packed(p) == 128
    key = sm80.compile_key(p, plan, "sm_90a")
    assert key == ("mla_sm80", "sm_90a", "bf16", 128, True, True, True, 0, 3)
    plan_a100 = sm80.plan(p, 1, None, None, arch="sm_80")
    assert sm80.compile_key(p, plan_a100, "sm_80") == ("mla_sm80", "sm_80", "bf16", 128, True, False, False, 0, 2)
    # batch invariant: 128 blocks of 32 keys per split, the splits the capacity needs, always split
    inv = sm80.plan(p._replace(batch_invariant=True), 3, None, None, arch="sm_90a")
    assert inv.config.split_blocks == 128 and inv.num_splits == 8 and inv.is_split
    assert sm80.compile_key(p, inv, "sm_90a")[5:8] == (True, True, 128)
    one = sm80.plan(p._replace(batch_invariant=True, max_seqlen_k=100), 3, None, None, arch="sm_90a")
    assert one.num_splits == 1 and one.is_split
    assert "batch_invariant covers" in sm80.check(p._replace(batch_invariant=True, max_seqlen_k=2 ** 21))
    # the pipeline depth is the plan's: a tuning override changes the plan, never the key builder
    deep = sm80.plan(p, 1, None, None, tuning=Tuning(mla_stages="2"), arch="sm_90a")
    assert deep.config.stages == 2 and sm80.compile_key(p, deep, "sm_90a")[-1] == 2
    # An FP8 cache: two KV stages and the staging depth at the key's end; the knob sets both.
    p8 = p._replace(kv_dtype=torch.float8_e4m3fn)
    assert sm80.compile_key(p8, sm80.plan(p8, 3, None, None, arch="sm_90a"), "sm_90a")[2:] == (
        "bf16/e4m3", 128, True, True, True, 0, 2, 2)
    knob = sm80.plan(p8, 3, None, None, Tuning(mla_fp8_stages="2,4"), arch="sm_90a")
    assert sm80.compile_key(p8, knob, "sm_90a")[-2:] == (2, 4)
    with pytest.raises(ValueError, match="MLA_FP8_STAGES"):
        sm80.plan(p8, 3, None, None, Tuning(mla_fp8_stages="3,4"), arch="sm_90a")
    # The 16-bit depth knob leaves an FP8 cache's plan alone.
    assert sm80.plan(p8, 3, None, None, Tuning(mla_stages="3"), arch="sm_90a").config.stages == 2

    with pytest.raises(ValueError, match="MLA_STAGES"):
        sm80.plan(p, 1, None, None, tuning=Tuning(mla_stages="3"), arch="sm_80")
    assert sm80.check(p) is None and sm80.check(p._replace(nheads=8)) is None
    assert "outside 1..128" in sm80.check(p._replace(nheads=129))
    assert "not a multiple of nheads_kv 4" in sm80.check(p._replace(nheads=6, nheads_kv=4))
    assert sm80.runs_on((8, 0)) and sm80.runs_on((9, 0)) and not sm80.runs_on((8, 6))
    # the forward registry is untouched: forward backends never see an MLA problem
    assert "flash_attn_cute.sm80.mla" not in seam.BACKENDS.values()
    assert seam.REGISTRIES["mla"] is mla.MLA_BACKENDS


def test_kv_descale_views():
    # What the kernels read: fp32 (batch,), from one element (broadcast, stride 0), (batch,)
    # or (batch, 1); None for a 16-bit cache; 1.0 when not given.
    p8 = _problem(batch=3)._replace(kv_dtype=torch.float8_e4m3fn)
    one = mla_call.kv_descale_view(p8, torch.tensor([2.0]), "cpu")
    assert one.shape == (3,) and one.stride() == (0,) and one.tolist() == [2.0] * 3
    assert mla_call.kv_descale_view(p8, torch.tensor([[1.0], [2.0], [3.0]]), "cpu").tolist() == [1.0, 2.0, 3.0]
    assert mla_call.kv_descale_view(p8, None, "cpu").tolist() == [1.0] * 3
    assert mla_call.kv_descale_view(_problem(batch=3), torch.tensor([2.0]), "cpu") is None


def test_warp_roles_fit_the_register_file():
    from flash_attn_cute.sm80.config import MlaWarpRoles

    roles = MlaWarpRoles()
    assert roles.threads == 384 and roles.regs_cap == 168 and roles.o_regs == 128
    with pytest.raises(AssertionError):
        MlaWarpRoles(o_warps=4)  # 256 O registers a thread: over the cap


def test_sm90_seam_key_roles_and_selection(monkeypatch):
    from flash_attn_cute.sm90.config import MlaRoles

    sm90 = seam.backend_module("sm90", "mla")
    assert mla.MLA_BACKENDS["sm90"] == "flash_attn_cute.sm90.mla"
    assert sm90.runs_on((9, 0)) and not sm90.runs_on((8, 0)) and not sm90.runs_on((10, 0))
    p = _problem(h=128, causal=True)
    plan = sm90.plan(p, 3, None, None)
    assert plan.backend == "sm90" and plan.num_splits == 3
    default = sm90.compile_key(p, plan, "sm_90a")
    assert default[:8] == ("mla_sm90", "sm_90a", "bf16", 128, True, True, True, 0)
    assert default[8] == (32, 4, "seesaw") and plan.config == (32, 4, "seesaw", 0, 0, False)
    one = sm90.plan(p, 3, None, None, tuning=Tuning(mla_sm90_qk="one"))
    assert sm90.compile_key(p, one, "sm_90a")[8] == (32, 4, "one")
    split = sm90.plan(p, 3, None, None, tuning=Tuning(mla_sm90_qk="split"))
    assert sm90.compile_key(p, split, "sm_90a")[8] == (32, 3, "split")
    inv = sm90.plan(p._replace(batch_invariant=True), 3, None, None)
    assert inv.config.split_blocks == 128 and inv.num_splits == 8 and sm90.compile_key(p, inv, "sm_90a")[7] == 128
    assert sm90.plan(p, 3, None, None, tuning=Tuning(mla_sm90_qk="seesaw")) == plan
    # An FP8 cache: "bf16/e4m3", two fp8 staging tiles in the key, one 16-bit stage fewer.
    p8 = p._replace(kv_dtype=torch.float8_e4m3fn)
    key8 = sm90.compile_key(p8, sm90.plan(p8, 3, None, None), "sm_90a")
    assert key8[2] == "bf16/e4m3" and key8[8] == (32, 3, "seesaw", 2)
    split8 = sm90.plan(p8, 3, None, None, tuning=Tuning(mla_sm90_qk="split"))
    assert sm90.compile_key(p8, split8, "sm_90a")[8] == (32, 2, "split", 2)
    with pytest.raises(ValueError, match="MLA_SM90_QK"):
        sm90.plan(p, 3, None, None, tuning=Tuning(mla_sm90_qk="half"))
    # backend=None on a 9.x GPU: the SM90 kernel when it is automatic, else SM80.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    name, _ = seam.select_backend(None, p, "cuda:0")
    assert name == ("sm90" if sm90.AUTO else "sm80")
    assert seam.select_backend("sm90", p, "cuda:0")[0] == "sm90"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert seam.select_backend(None, p, "cuda:0")[0] == "sm80"
    with pytest.raises(NotImplementedError, match="compute capability 8.0"):
        seam.select_backend("sm90", p, "cuda:0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))  # 99 KB of smem
    with pytest.raises(NotImplementedError, match="no MLA kernel runs this call"):
        seam.select_backend(None, p, "cuda:0")
    # roles: the register pool and 227 KB of shared memory bound them
    assert MlaRoles().threads == 384 and MlaRoles().o_cols == 256
    assert MlaRoles().qk == "seesaw" and MlaRoles().stages == 4
    assert MlaRoles(qk="one").smem_bytes() <= MlaRoles().smem_bytes() <= 227 * 1024
    assert MlaRoles().xchg_words == 64 * 8 + 512  # a correction and a max per row and stage; row sums
    with pytest.raises(AssertionError):
        MlaRoles(stages=2)  # seesaw waits for tile i + 1 before releasing i - 1: two stages would hang
    with pytest.raises(ValueError, match="three KV stages"):
        sm90.plan(p8, 3, None, None, tuning=Tuning(mla_fp8_stages="2,2"))
    assert sm90.plan(p8, 3, None, None, tuning=Tuning(mla_sm90_qk="one", mla_fp8_stages="2,2")).config.stages == 2
    assert MlaRoles(stages=3, qk="split").smem_bytes() <= 227 * 1024
    with pytest.raises(AssertionError):
        MlaRoles(qk="split")  # 4 stages + the S exchange: over 227 KB
    with pytest.raises(AssertionError):
        MlaRoles(stages=5)  # 5 stages: over 227 KB
    with pytest.raises(AssertionError):
        MlaRoles(consumer_regs=240, producer_regs=40)  # over the 512-register pool


def test_repeated_call_skips_validation_and_planning(fake_device, monkeypatch):
    # A decode loop: the second call with the same shapes replays the cached entry (no
    # validation, no planning); out=None must not defeat the cache.
    launched, validated = [], []
    fake = SimpleNamespace(AUTO=True, runs_on=lambda cap: True, check=lambda p: None,
                           plan=seam.backend_module("sm80", "mla").plan,
                           launcher=lambda problem, plan, device=None: (lambda t: launched.append(t)))
    fake_device(lambda name, kind="fwd": fake)
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    real = mla_call.MLA
    monkeypatch.setattr(mla_call, "MLA", replace(real, validate=lambda a: validated.append(1) or real.validate(a)))
    args = inputs()
    for _ in range(3):
        out = flash_mla_decode(**args, num_splits=1)
        assert out.shape == (2, 1, 16, 512)
    assert len(validated) == 1 and len(launched) == 3
    flash_mla_decode(**args, num_splits=1, causal=True)  # another call: validated and planned again
    assert len(validated) == 2


# ---------------------------------------------------------------------------------------
# Any head count (1..128), KV heads (FlashMLA's h_kv) and FlashMLA's combined 576 layout.
# ---------------------------------------------------------------------------------------

ANY_HEADS = [1, 3, 4, 8, 9, 16, 24, 63, 64, 100, 126, 128]


@pytest.mark.parametrize("h", ANY_HEADS)
def test_any_head_count_validates(h):
    # Validation passes every check but the device (CPU tensors), for 3-D and 4-D caches.
    with pytest.raises(ValueError, match="q_nope must be a CUDA tensor"):
        call(q_nope=torch.randn(2, 2, h, 512).to(BF16), q_pe=torch.randn(2, 2, h, 64).to(BF16))
    hkv = next(k for k in (4, 2, 1) if h % k == 0)
    with pytest.raises(ValueError, match="q_nope must be a CUDA tensor"):
        call(q_nope=torch.randn(2, 1, h, 512).to(BF16), q_pe=torch.randn(2, 1, h, 64).to(BF16),
             ckv_cache=torch.randn(6, 4, hkv, 512).to(BF16), kpe_cache=torch.randn(6, 4, hkv, 64).to(BF16),
             kv_descale=torch.ones(2, hkv))


@pytest.mark.parametrize("backend", ["sm80", "sm90"])
@pytest.mark.parametrize("h,sq", [(1, 1), (8, 1), (24, 1), (63, 1), (100, 1), (126, 1), (3, 2), (9, 2), (100, 2)])
def test_padded_heads_cost_no_more_than_the_next_count(backend, h, sq):
    # A head count runs on the grid and splits of the next supported one (16, 32, 64, 128),
    # for the same shapes: the same CTAs, tiles and KV splits, so the same bytes read. (On
    # any count whose packed rows fill the same 64-row tiles the grids are equal too.)
    module = seam.backend_module(backend, "mla")
    nxt = next(n for n in (16, 32, 64, 128) if n >= h)
    for batch, capacity in ((1, 32768), (4, 8192), (132, 2048), (768, 2048)):
        a = module.plan(_problem(batch=batch, sq=sq, capacity=capacity, h=h), 0, None, 132, arch="sm_90a")
        b = module.plan(_problem(batch=batch, sq=sq, capacity=capacity, h=nxt), 0, None, 132, arch="sm_90a")
        tiles = lambda n: -(-sq * n // 64)
        assert tiles(h) <= tiles(nxt)
        if tiles(h) == tiles(nxt):
            assert a.num_splits == b.num_splits, (batch, capacity)
        assert a.config == b.config  # the kernel's static choices do not depend on the count


def test_keys_of_head_counts_and_kv_heads():
    from flash_attn_cute.host.keys import mla_heads_key, parse_mla_key

    sm80, sm90 = seam.backend_module("sm80", "mla"), seam.backend_module("sm90", "mla")
    p = _problem(h=8, causal=True)
    # One latent head: the heads field is nheads, as in the keys of 16/32/64/128 (unchanged).
    assert sm80.compile_key(p, sm80.plan(p, 1, None, None, arch="sm_80"), "sm_80") == (
        "mla_sm80", "sm_80", "bf16", 8, True, False, False, 0, 2)
    assert sm90.compile_key(p, sm90.plan(p, 1, None, None), "sm_90a")[3] == 8
    for h in (16, 32, 64, 128):
        q = _problem(h=h)
        assert sm80.compile_key(q, sm80.plan(q, 1, None, None, arch="sm_80"), "sm_80")[3] == h
    # KV heads: "<query heads per KV head>/hkv"; the KV-head count itself is a runtime value.
    for hkv in (2, 4):
        q = _problem(h=8, hkv=hkv, causal=True)
        plan = sm90.plan(q, 1, None, None)
        key = sm90.compile_key(q, plan, "sm_90a")
        assert key[3] == f"{8 // hkv}/hkv" and plan.qhead_per_kvhead_packed(q) == 8 // hkv
        f = parse_mla_key(key)
        assert (f.qhead_per_kvhead, f.kv_heads, f.causal, f.config) == (8 // hkv, True, True, ((32, 4, "seesaw"),))
    assert mla_heads_key(16) == 16 and parse_mla_key(("mla_sm80", "sm_80", "bf16", 16, False, False, False, 0, 2))[
        2:4] == (16, False)
    # 128 heads over 4 KV heads and 32 over 1 pack the same 32 rows per query position but
    # read different caches: different keys.
    a, b = _problem(h=128, hkv=4), _problem(h=32)
    assert sm80.compile_key(a, sm80.plan(a, 1, None, None, arch="sm_80"), "sm_80") != \
        sm80.compile_key(b, sm80.plan(b, 1, None, None, arch="sm_80"), "sm_80")


def test_kv_heads_grid_and_splits():
    # The KV heads are a grid mode: the split heuristic counts batch x nheads_kv CTAs of
    # seqlen_q x (nheads / nheads_kv) packed rows.
    sm80 = seam.backend_module("sm80", "mla")
    one = sm80.plan(_problem(batch=1, capacity=32768, h=16), 0, None, 132, arch="sm_90a")
    four = sm80.plan(_problem(batch=1, capacity=32768, h=64, hkv=4), 0, None, 132, arch="sm_90a")
    assert one.num_splits > four.num_splits > 1
    assert _problem(h=64, hkv=4).qhead_per_kvhead == 16 and _problem(h=64, hkv=4).kv_heads
    assert not _problem(h=64).kv_heads


def test_kv_descale_views_with_kv_heads():
    p8 = _problem(batch=3, h=8, hkv=2)._replace(kv_dtype=torch.float8_e4m3fn)
    full = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    assert mla_call.kv_descale_view(p8, full, "cpu").tolist() == full.tolist()
    per_seq = mla_call.kv_descale_view(p8, torch.tensor([1.0, 2.0, 3.0]), "cpu")
    assert per_seq.shape == (3, 2) and per_seq.tolist() == [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]
    assert mla_call.kv_descale_view(p8, torch.tensor([[1.0], [2.0], [3.0]]), "cpu").tolist() == per_seq.tolist()
    one = mla_call.kv_descale_view(p8, torch.tensor([2.0]), "cpu")
    assert one.shape == (3, 2) and one.stride() == (0, 0)
    assert mla_call.kv_descale_view(p8, None, "cpu").tolist() == [[1.0, 1.0]] * 3


def _flashmla_inputs(b=2, sq=1, h=16, hkv=1, pages=6, page=4, max_pages=3):
    """FlashMLA's layout: q (b, s_q, h, 576), one k_cache (num_pages, page_size, h_kv, 576)."""
    q = torch.randn(b, sq, h, 576).to(BF16)
    k_cache = torch.randn(pages, page, hkv, 576).to(BF16)
    table = torch.arange(b * max_pages, dtype=torch.int32).view(b, max_pages) % pages
    return q, k_cache, torch.full((b,), 5, dtype=torch.int32), table


@pytest.mark.parametrize("hkv", [1, 2])
def test_flashmla_layout_views_reach_the_kernel_uncopied(fake_device, monkeypatch, hkv):
    # q[..., :512], q[..., 512:], k_cache[..., :512], k_cache[..., 512:]: strided views, taken
    # as they are (no copy); one KV head runs the 3-D kernels (the head mode dropped, a view).
    launched = []
    fake = SimpleNamespace(AUTO=True, runs_on=lambda cap: True, check=lambda p: None,
                           plan=seam.backend_module("sm80", "mla").plan,
                           launcher=lambda problem, plan, device=None: (lambda t: launched.append((problem, t))))
    fake_device(lambda name, kind="fwd": fake)
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    q, k_cache, lens, table = _flashmla_inputs(h=8, hkv=hkv)
    views = (q[..., :512], q[..., 512:], k_cache[..., :512], k_cache[..., 512:])
    for _ in range(2):  # the second call replays the per-call cache
        out = flash_mla_decode(*views, lens, table, num_splits=1)
        assert out.shape == (2, 1, 8, 512)
    for problem, tensors in launched:
        assert problem.nheads_kv == hkv and problem.qhead_per_kvhead == 8 // hkv
        qn, qp, ckv, kpe = tensors[:4]
        assert qn.data_ptr() == q.data_ptr() and qp.data_ptr() == q.data_ptr() + 512 * 2
        assert ckv.data_ptr() == k_cache.data_ptr() and kpe.data_ptr() == k_cache.data_ptr() + 512 * 2
        assert ckv.dim() == (4 if hkv > 1 else 3) and ckv.stride(-1) == 1 and ckv.stride(1) == hkv * 576
    assert len(launched) == 2


def test_sm90_tma_kernel_selection():
    # Pages of a multiple of 64 over a 16-bit or e4m3 cache: the TMA kernel (64-key tiles,
    # config (64, 2, "tma_lag") over 16 bits, (64, 2, "tma") over e4m3: fp8 wgmma, the key's
    # dtype field "bf16/e4m3"); other page sizes and e5m2 caches: the gathering kernel; a
    # mode of the gathering kernel named by FLASH_ATTN_CUTE_MLA_SM90_QK replaces it (A/B
    # runs; an FP8 cache then widened), "tma", "tma_runs" and "tma_lag" name the TMA
    # kernel's modes (their own keys, the same splits; the gathering kernel where the TMA
    # kernel does not apply).
    sm90 = seam.backend_module("sm90", "mla")
    for page in (64, 128, 256):
        p = _problem(h=64)._replace(page_size=page, max_seqlen_k=4096)
        plan = sm90.plan(p, 0, None, 132)  # a 16-bit cache: the lagging row max (``DEFAULT_TMA_MODE``)
        assert plan.config[:3] == (64, 2, "tma_lag")
        assert sm90.compile_key(p, plan, "sm_90a")[8] == (64, 2, "tma_lag")
        assert sm90.plan(p, 0, None, 132, tuning=Tuning(mla_sm90_qk="tma_lag")) == plan
        assert sm90.plan(p, 0, None, 132, tuning=Tuning(mla_sm90_qk="seesaw")).config[:3] == (32, 4, "seesaw")
        for mode in ("tma", "tma_runs", "tma_lag"):
            other = sm90.plan(p, 0, None, 132, tuning=Tuning(mla_sm90_qk=mode))
            assert other == plan._replace(config=plan.config._replace(qk=mode))
            assert sm90.compile_key(p, other, "sm_90a")[8] == (64, 2, mode)
        p8 = p._replace(kv_dtype=torch.float8_e4m3fn)
        assert sm90.plan(p8, 0, None, 132, tuning=Tuning(mla_sm90_qk="tma_lag")).config[:3] == (64, 2, "tma_lag")
        plan8 = sm90.plan(p8, 0, None, 132)
        assert plan8.config[:3] == (64, 2, "tma") and plan8.config.fp8_stages == 0
        assert sm90.compile_key(p8, plan8, "sm_90a")[2] == "bf16/e4m3"
        assert sm90.plan(p8, 0, None, 132, tuning=Tuning(mla_sm90_qk="seesaw")).config[:3] == (32, 3, "seesaw")
        assert sm90.plan(p._replace(kv_dtype=torch.float8_e5m2), 0, None, 132).config[:3] == (32, 3, "seesaw")
    for page in (1, 16, 32, 96):
        p = _problem(h=64)._replace(page_size=page, max_seqlen_k=4096)
        assert sm90.plan(p, 0, None, 132).config[:3] == (32, 4, "seesaw")
        for knob in ("tma", "tma_runs", "tma_lag"):
            assert sm90.plan(p, 0, None, 132, tuning=Tuning(mla_sm90_qk=knob)).config[:3] == (32, 4, "seesaw")
        # FP8 queries: the TMA kernel alone runs them (other pages refused, on every MLA backend)
        q8 = p._replace(dtype=torch.float8_e4m3fn, kv_dtype=torch.float8_e4m3fn)
        assert "pages of a multiple of 64" in sm90.check(q8)
        assert "fp8_q" in seam.backend_module("sm80", "mla").check(q8)
    q8 = _problem(h=64)._replace(page_size=64, max_seqlen_k=4096, dtype=torch.float8_e4m3fn,
                                 kv_dtype=torch.float8_e4m3fn)
    assert sm90.check(q8) is None and q8.out_dtype == torch.bfloat16
    for knob in (None, "seesaw"):  # the knob cannot send them to the gathering kernel
        plan = sm90.plan(q8, 0, None, 132, tuning=Tuning(mla_sm90_qk=knob))
        assert plan.config[:3] == (64, 2, "tma") and sm90.compile_key(q8, plan, "sm_90a")[2] == "e4m3/e4m3"
    assert sm90.plan(q8, 0, None, 132, tuning=Tuning(mla_sm90_qk="tma_lag")).config[:3] == (64, 2, "tma_lag")
    # The split heuristic counts 64-key tiles: one sequence of 32768 keys (512 tiles) fills
    # half the SMs or more.
    long = _problem(h=64)._replace(page_size=64, batch=1, max_seqlen_k=32768)
    assert sm90.plan(long, 0, None, 132).num_splits >= 64


def test_sm90_tma_split_model():
    # The TMA kernel's split count comes from its cost model (``sm90.mla.split_time_us``),
    # fitted to H100 times of 2026-12-07; its choices on the rows measured that day (H100's
    # bandwidth) and on an H200's: 64 x 1024 at 64 heads unsplit on the H100 (50.8 us
    # against 59.7 at two splits), 32 x 8192 at 128 heads in two (165.2 against 245.3 at
    # one, 206.9 at three), one sequence of 32768 keys in fewer than the 128 splits of the
    # wave rule on the H100 (40.9 us at 64 against 43.3 at 128); full grids unsplit; 512
    # keys or fewer never split.
    from flash_attn_cute.host import heuristics
    from flash_attn_cute.sm90 import mla as sm90_mla

    sm90 = seam.backend_module("sm90", "mla")
    h100, h200 = 3.35e6 * 0.92, 4.9e6 * 0.92
    e4m3 = torch.float8_e4m3fn

    def splits(batch, capacity, h, bw, kv=None):
        p = _problem(h=h)._replace(page_size=64, batch=batch, max_seqlen_k=capacity, kv_dtype=kv)
        return sm90_mla.tma_num_splits(p, 132, bw)

    for kv in (None, e4m3):
        assert splits(64, 1024, 64, h100, kv) == 1
        for bw in (h100, h200):
            assert splits(32, 8192, 128, bw, kv) == 2
            for batch, capacity, h in ((128, 2048, 64), (768, 2048, 64), (128, 4096, 128), (256, 4096, 16)):
                assert splits(batch, capacity, h, bw, kv) == 1, (batch, capacity, h)
            assert 64 <= splits(1, 32768, 64, bw, kv) <= 128
            assert splits(1, 512, 64, bw, kv) == 1 and splits(1, 1024, 64, bw, kv) > 1
    assert splits(1, 32768, 64, h100) < 128
    # each split's step in the combine (``SplitCosts.split_us``): 64 splits of eight tiles at
    # 1 x 32768 on the H100 (bf16 41.2 us against 42.2 at 74, e4m3 36.0 against 39.9 at
    # 103), 16 of eight at 4 x 8192 in 16 bits (40.8 against 41.7 at 26)
    for kv in (None, e4m3):
        assert splits(1, 32768, 64, h100, kv) == 64
    assert splits(4, 8192, 64, h100) == 16 and splits(4, 8192, 64, h100, e4m3) < 26
    # the plan takes it (batch invariance and an explicit count do not)
    p = _problem(h=64)._replace(page_size=64, batch=1, max_seqlen_k=32768)
    assert sm90.plan(p, 0, None, 132).num_splits == sm90_mla.tma_num_splits(p, 132, heuristics.hbm_bytes_per_us())
    assert sm90.plan(p, 5, None, 132).num_splits == 5
    # splitting costs the partials' bytes: the model's time of two splits of a full grid
    # exceeds one split's by at least their write and read
    c = sm90_mla.SPLIT_COSTS[False]
    one = sm90_mla.split_time_us(132, 1, 32, 1, 132, 73728, 10**6, h100, c)
    two = sm90_mla.split_time_us(132, 1, 32, 2, 132, 73728, 10**6, h100, c)
    assert two > one
