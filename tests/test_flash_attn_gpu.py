"""GPU tests of the forward API against the fp32 reference (flash_attn_cute.testing).

Compile budget. Each distinct compile key is a JIT compile of a few seconds. The SM80
key is (dtype, d, d_v, tile, causal/local/softcap, packed GQA ratio, split on/off, lse
on/off, varlen, seqused_k, paged), and the tile depends on seqlen_q * packed ratio
(<= 64 rows: the decode tile). Sequence lengths, batch, heads, windows, page size and
the number of splits are runtime values. So the feature configurations are a curated
list (each axis value once against the defaults, plus crossings that interact), every
prefill seqlen pair is swept inside each one for free, and the decode pairs (a second
tile, hence a second compile) only inside the configs marked ``decode``.
``PYTHONPATH=. python tests/test_flash_attn_gpu.py`` prints the compile keys this file
needs on a 132-SM GPU (H200), derived with the interface's own heuristics.

Every call writes into an ``out=`` tensor poisoned with NaN (a row the kernel forgets
to write fails), then the allocate path is called too and must be bit-identical
(determinism). Errors are bounded by 2x PyTorch's own low-precision error (check_close).
"""

import math
from dataclasses import dataclass

import pytest
import torch

from flash_attn_cute.testing import (attention_kvcache_ref, attention_ref, attention_varlen_ref, backends_on_this_gpu,
                                     check_close, check_lse)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BACKEND = None  # the backend under test, set by the autouse ``backend`` fixture
DEVICE = "cuda"
# what a refused call may raise (validation happens in Python, before any launch)
REFUSALS = (ValueError, TypeError, AssertionError, RuntimeError, NotImplementedError)


def _api():
    """Imported lazily so that collection works on a machine without a GPU."""
    import flash_attn_cute

    return flash_attn_cute


@pytest.fixture(params=backends_on_this_gpu(), autouse=True)
def backend(request):
    """Every test runs once per registered backend (the ``backend=`` of each call); a
    call the backend refuses (``check``) is reported as a skip with its reason."""
    global BACKEND
    BACKEND = request.param
    yield request.param
    BACKEND = None


@dataclass(frozen=True)
class Cfg:
    """One feature configuration; the defaults are the 'base' kernel."""

    name: str
    dtype: torch.dtype = torch.bfloat16
    d: int = 128
    dv: int = 128
    causal: bool = False
    window: tuple = (-1, -1)
    softcap: float = 0.0
    nheads: int = 3
    nheads_kv: int = 3
    pack_gqa: object = False
    num_splits: int = 1
    decode: bool = False  # also sweep the decode-tile seqlen pairs (one more compile)
    paged: bool = False  # kvcache configs only
    seqlen_qs: tuple = (1, 4)  # kvcache configs only

    def mask_kwargs(self):
        return dict(causal=self.causal, window_size=self.window, softcap=self.softcap)

    def api_kwargs(self):
        return dict(self.mask_kwargs(), num_splits=self.num_splits, pack_gqa=self.pack_gqa,
                    backend=BACKEND)


GQA = dict(nheads=6, nheads_kv=2)  # 3 q heads per kv head: not a power of two
MQA = dict(nheads=4, nheads_kv=1)
FP16 = dict(dtype=torch.float16)

# flash_attn_func configurations. First block: one axis at a time away from the base
# (bf16, d=128, MHA, no mask, no split), so each axis value is seen once in isolation.
# Second block: crossings that exercise interactions (mask x split x pack_gqa x head dims).
FUNC_CFGS = [
    Cfg("base", decode=True),  # also the kernel of the GQA/MQA configs without packing
    Cfg("fp16", **FP16),  # the other input dtype (every other config is bf16 unless marked)
    Cfg("d64", d=64, dv=64),  # each supported head dim once: 64 (128x128 tile), 96 (padded
    Cfg("d96", d=96, dv=96),  # k-block), 192/256 (8 warps)
    Cfg("d192", d=192, dv=192),
    Cfg("d256", d=256, dv=256, decode=True),  # the decode tile narrows its n-tile above d=128
    Cfg("d192_dv128", d=192, dv=128),  # DeepSeek-style q/k wider than v
    Cfg("d128_dv64", d=128, dv=64),  # v narrower than q/k the other way round
    Cfg("causal", causal=True),  # bottom-right aligned; (203, 113) gives empty rows
    Cfg("local_100_17", window=(100, 17)),  # both sides bounded
    Cfg("local_inf_8", window=(-1, 8)),  # right bound only (same kernel: windows are runtime)
    Cfg("local_33_inf", window=(33, -1)),  # left bound only
    Cfg("softcap", softcap=3.0),  # small cap: tanh really bends N(0, 1) scores
    Cfg("gqa", **GQA, decode=True),  # unpacked GQA: the base kernel, other head indexing
    Cfg("gqa_pack", **GQA, pack_gqa=True, decode=True),  # packed rows straddle m-tiles
    Cfg("mqa", **MQA),  # a single kv head
    Cfg("mqa_pack", **MQA, pack_gqa=True),  # packed ratio 4 (its own compile)
    Cfg("split3", num_splits=3, decode=True),  # split-KV + combine, uneven split lengths
    Cfg("split_auto", num_splits=0, decode=True),  # heuristic: splits on (1, 4224), not on (1, 1)
    # crossings
    Cfg("causal_gqa_pack_split3", causal=True, **GQA, pack_gqa=True, num_splits=3),  # serving combo
    Cfg("fp16_d64_causal", **FP16, d=64, dv=64, causal=True),
    Cfg("fp16_d256_causal_split3", **FP16, d=256, dv=256, causal=True, num_splits=3),  # widest combine
    Cfg("d192_dv128_causal_gqa_pack", d=192, dv=128, causal=True, **GQA, pack_gqa=True),
    Cfg("d128_dv64_causal_split3", d=128, dv=64, causal=True, num_splits=3),  # combine at d_v 64
    Cfg("fp16_d96_local", **FP16, d=96, dv=96, window=(100, 17)),
    Cfg("local_gqa_pack_split3", window=(100, 17), **GQA, pack_gqa=True, num_splits=3),  # splits that
    # fall entirely outside the window
    Cfg("fp16_softcap_causal", **FP16, softcap=3.0, causal=True),  # score modifier + mask composed
    Cfg("causal_split_auto", causal=True, num_splits=0),  # auto splits under causal: early rows skip whole splits
    # head dims between the tile widths (any multiple of 8 up to 256): the next tile, the
    # columns past the head dim loaded as zeros and never stored
    Cfg("d8", d=8, dv=8),  # the smallest, on the 64 tile
    Cfg("d40", d=40, dv=40, decode=True),  # decode tile too
    Cfg("d72_causal_gqa_pack_split3", d=72, dv=72, causal=True, **GQA, pack_gqa=True, num_splits=3),  # packed Q rows
    # by cp.async, fp32 partials stored from registers
    Cfg("d136_dv80_local", d=136, dv=80, window=(100, 17)),  # (192, 96) tile
    Cfg("fp16_d224_dv248_softcap_causal", **FP16, d=224, dv=248, softcap=3.0, causal=True),  # (256, 256) tile
]
_BY_NAME = {c.name: c for c in FUNC_CFGS}

# (seqlen_q, seqlen_k), all runtime values: swept inside every config at no compile cost.
PREFILL_PAIRS = [
    (113, 203),  # neither a tile multiple; seqlen_q < seqlen_k
    (128, 128),  # exact tile multiples
    (203, 113),  # seqlen_q > seqlen_k: causal/local rows with no visible key
    (239, 1024),  # seqlen_q < seqlen_k, several n-blocks, partial m-block
    (1024, 239),  # seqlen_q >> seqlen_k: many fully masked rows under causal
    (1024, 1024),  # square, several tiles each way
]
# seqlen_q * packed ratio <= 64 selects the decode tile: a separate compile
DECODE_PAIRS = [
    (1, 1),  # smallest possible problem, a single key
    (1, 4224),  # decode: one query, 33 n-blocks (4224 = 33 x 128), splits really split
    (17, 239),  # a few queries (speculative decode), partial tiles both ways
]


def _func_params():
    params = []
    for cfg in FUNC_CFGS:
        for sq, sk in PREFILL_PAIRS + (DECODE_PAIRS if cfg.decode else []):
            params.append(pytest.param(cfg, sq, sk, id=f"{cfg.name}-{sq}x{sk}"))
    return params


def _randn(*shape, dtype):
    # never zeros: a kernel that skips work must not pass by accident
    return torch.randn(*shape, device=DEVICE, dtype=dtype)


def _nan(shape, dtype):
    return torch.full(shape, float("nan"), device=DEVICE, dtype=dtype)


def _check_against_ref(out, lse, out_ref, lse_ref, out_pt, lse_pt, dtype):
    assert out.dtype == dtype
    check_close(out, out_ref, out_pt)
    check_lse(lse, lse_ref, lse_pt)


def _run_func(cfg, seqlen_q, seqlen_k, batch=2, seed=0):
    fa = _api()
    torch.manual_seed(seed)
    q = _randn(batch, seqlen_q, cfg.nheads, cfg.d, dtype=cfg.dtype)
    k = _randn(batch, seqlen_k, cfg.nheads_kv, cfg.d, dtype=cfg.dtype)
    v = _randn(batch, seqlen_k, cfg.nheads_kv, cfg.dv, dtype=cfg.dtype)
    out_ref, lse_ref = attention_ref(q, k, v, **cfg.mask_kwargs())
    out_pt, lse_pt = attention_ref(q, k, v, **cfg.mask_kwargs(), upcast=False)

    out_buf = _nan((batch, seqlen_q, cfg.nheads, cfg.dv), cfg.dtype)
    out, lse = fa.flash_attn_func(q, k, v, **cfg.api_kwargs(), return_lse=True, out=out_buf)
    assert out.data_ptr() == out_buf.data_ptr(), "out= must be written in place and returned"
    assert lse.shape == (batch, cfg.nheads, seqlen_q)
    _check_against_ref(out, lse, out_ref, lse_ref, out_pt, lse_pt, cfg.dtype)

    # allocate path: same kernel, must be bit-identical
    out2, lse2 = fa.flash_attn_func(q, k, v, **cfg.api_kwargs(), return_lse=True)
    assert out2.shape == (batch, seqlen_q, cfg.nheads, cfg.dv)
    assert torch.equal(out2, out) and torch.equal(lse2, lse), "not deterministic"


@pytest.mark.parametrize("cfg,seqlen_q,seqlen_k", _func_params())
def test_flash_attn_func(cfg, seqlen_q, seqlen_k):
    _run_func(cfg, seqlen_q, seqlen_k)


# one large problem per kind of work (a few hundred MB for the fp32 reference), on
# kernels already compiled above
@pytest.mark.parametrize("name", ["base", "causal", "causal_gqa_pack_split3"])
def test_flash_attn_func_large(name):
    _run_func(_BY_NAME[name], 4224, 4224, batch=1)


@pytest.mark.parametrize("mask", ["causal", "local"])
@pytest.mark.parametrize("sm_margin", [0, 100])
def test_persistent_dynamic_tiles(mask, sm_margin, monkeypatch):
    # Persistent CTAs over masked (LPT) tiles take them from an atomic counter (SM90
    # ``flash_fwd`` ``dynamic``; FLASH_ATTN_CUTE_SM90_PERSISTENT=dynamic): 2 x 1800 queries x
    # 8 heads over 1500 keys, GQA 4, sm_margin 100 leaves 32 CTAs that loop over ~15 tiles
    # each; twice (the counter starts at zero every launch), out= poisoned each time.
    if BACKEND != "sm90":
        pytest.skip("the SM90 kernel's persistent tiles")
    monkeypatch.setenv("FLASH_ATTN_CUTE_SM90_PERSISTENT", "dynamic")
    fa = _api()
    q = _randn(2, 1800, 8, 128, dtype=torch.bfloat16)
    k, v = (_randn(2, 1500, 2, 128, dtype=torch.bfloat16) for _ in range(2))
    kw = dict(causal=True) if mask == "causal" else dict(window_size=(300, 0))
    out_ref, lse_ref = attention_ref(q, k, v, **kw)
    out_pt, lse_pt = attention_ref(q, k, v, upcast=False, **kw)
    out = torch.empty_like(q)
    for _ in range(2):
        out.fill_(float("nan"))
        _, lse = fa.flash_attn_func(q, k, v, return_lse=True, out=out, backend=BACKEND, sm_margin=sm_margin, **kw)
        _check_against_ref(out, lse, out_ref, lse_ref, out_pt, lse_pt, torch.bfloat16)


def test_flash_attn_func_explicit_scale():
    # softmax_scale is a runtime value: the base kernel, no compile
    fa = _api()
    q, k, v = (_randn(2, 77, 3, 128, dtype=torch.bfloat16) for _ in range(3))
    out_ref, lse_ref = attention_ref(q, k, v, softmax_scale=0.3)
    out_pt, lse_pt = attention_ref(q, k, v, softmax_scale=0.3, upcast=False)
    out, lse = fa.flash_attn_func(q, k, v, softmax_scale=0.3, return_lse=True, backend=BACKEND)
    _check_against_ref(out, lse, out_ref, lse_ref, out_pt, lse_pt, torch.bfloat16)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_flash_attn_func_no_lse(num_splits):
    # return_lse=False: a kernel without the lse output (1), a combine without it (3)
    fa = _api()
    q, k, v = (_randn(2, 113, 3, 128, dtype=torch.bfloat16) for _ in range(3))
    out_ref, _ = attention_ref(q, k, v)
    out_pt, _ = attention_ref(q, k, v, upcast=False)
    out = fa.flash_attn_func(q, k, v, num_splits=num_splits, backend=BACKEND)
    assert isinstance(out, torch.Tensor), "return_lse=False returns the output alone"
    check_close(out, out_ref, out_pt)


def test_flash_attn_func_pack_gqa_auto():
    # pack_gqa=None resolves to True or False; both kernels come from the 'gqa*' configs
    fa = _api()
    q = _randn(2, 113, 6, 128, dtype=torch.bfloat16)
    k, v = (_randn(2, 203, 2, 128, dtype=torch.bfloat16) for _ in range(2))
    out_ref, lse_ref = attention_ref(q, k, v)
    out_pt, lse_pt = attention_ref(q, k, v, upcast=False)
    out, lse = fa.flash_attn_func(q, k, v, pack_gqa=None, return_lse=True, backend=BACKEND)
    _check_against_ref(out, lse, out_ref, lse_ref, out_pt, lse_pt, torch.bfloat16)


@pytest.mark.parametrize(
    "shape,dtype",
    [
        ((2, 64, 3, 64), torch.bfloat16),  # wrong d_v
        ((2, 65, 3, 128), torch.bfloat16),  # wrong seqlen_q
        ((2, 64, 6, 128), torch.bfloat16),  # wrong nheads
        ((2, 64, 3, 128), torch.float32),  # right shape, wrong dtype
    ],
    ids=["d_v", "seqlen", "nheads", "dtype"],
)
def test_out_of_wrong_shape_raises_before_launch(shape, dtype):
    fa = _api()
    q, k, v = (_randn(2, 64, 3, 128, dtype=torch.bfloat16) for _ in range(3))
    out = torch.full(shape, 7.0, device=DEVICE, dtype=dtype)
    with pytest.raises(REFUSALS):
        fa.flash_attn_func(q, k, v, out=out, backend=BACKEND)
    torch.cuda.synchronize()
    assert (out == 7.0).all(), "out was written although the call was refused"


def test_deterministic_split():
    # split-KV + combine on a decode-like shape, three times: bit-identical
    fa = _api()
    cfg = _BY_NAME["split3"]
    q = _randn(2, 5, 3, 128, dtype=cfg.dtype)
    k, v = (_randn(2, 4224, 3, 128, dtype=cfg.dtype) for _ in range(2))
    results = [fa.flash_attn_func(q, k, v, **cfg.api_kwargs(), return_lse=True) for _ in range(3)]
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])


# ----------------------------------------------------------------------------- varlen

VARLEN_CFGS = [
    Cfg("varlen_base", decode=True),
    Cfg("varlen_causal_gqa_pack", causal=True, **GQA, pack_gqa=True),
    Cfg("varlen_local", window=(100, 17)),
    Cfg("varlen_causal_split3", causal=True, num_splits=3),
    Cfg("varlen_fp16_d64_softcap_causal", **FP16, d=64, dv=64, softcap=3.0, causal=True),
    Cfg("varlen_d192_dv128_gqa", d=192, dv=128, **GQA),
    Cfg("varlen_causal_gqa_pack_split_auto", causal=True, **GQA, pack_gqa=True, num_splits=0),
    Cfg("varlen_d104_causal", d=104, dv=104, causal=True),  # a padded head dim over packed rows
]

# per-sequence (seqlens_q, seqlens_k): runtime values, free inside each config
VARLEN_LENS = {
    # an empty query sequence (k=17), 1x1, ragged non-multiples both ways, queries with no key
    "ragged_empty": ([0, 1, 113, 203, 128, 1, 7], [17, 1, 203, 113, 128, 0, 7]),
    # one long sequence among short ones (many tiles in one batch entry)
    "long_short": ([1024, 77, 1], [1500, 77, 1]),
}
# max_seqlen_q 1 selects the decode tile: only in the configs marked decode
VARLEN_DECODE_LENS = {"decode": ([1, 1, 1], [4224, 1, 300])}


def _varlen_params():
    params = []
    for cfg in VARLEN_CFGS:
        for name in list(VARLEN_LENS) + (list(VARLEN_DECODE_LENS) if cfg.decode else []):
            params.append(pytest.param(cfg, name, id=f"{cfg.name}-{name}"))
    return params


def _cu(seqlens):
    return torch.tensor([0] + torch.tensor(seqlens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("cfg,lens", _varlen_params())
def test_flash_attn_varlen_func(cfg, lens):
    fa = _api()
    torch.manual_seed(0)
    seqlens_q, seqlens_k = {**VARLEN_LENS, **VARLEN_DECODE_LENS}[lens]
    cu_q, cu_k = _cu(seqlens_q), _cu(seqlens_k)
    total_q, total_k = sum(seqlens_q), sum(seqlens_k)
    q = _randn(total_q, cfg.nheads, cfg.d, dtype=cfg.dtype)
    k = _randn(total_k, cfg.nheads_kv, cfg.d, dtype=cfg.dtype)
    v = _randn(total_k, cfg.nheads_kv, cfg.dv, dtype=cfg.dtype)
    out_ref, lse_ref = attention_varlen_ref(q, k, v, cu_q, cu_k, **cfg.mask_kwargs())
    out_pt, lse_pt = attention_varlen_ref(q, k, v, cu_q, cu_k, **cfg.mask_kwargs(), upcast=False)

    args = (q, k, v, cu_q, cu_k, max(seqlens_q), max(seqlens_k))
    out_buf = _nan((total_q, cfg.nheads, cfg.dv), cfg.dtype)
    out, lse = fa.flash_attn_varlen_func(*args, **cfg.api_kwargs(), return_lse=True, out=out_buf)
    assert out.data_ptr() == out_buf.data_ptr()
    assert lse.shape == (cfg.nheads, total_q), "varlen lse layout is (nheads, total_q)"
    _check_against_ref(out, lse, out_ref, lse_ref, out_pt, lse_pt, cfg.dtype)

    out2, lse2 = fa.flash_attn_varlen_func(*args, **cfg.api_kwargs(), return_lse=True)
    assert torch.equal(out2, out) and torch.equal(lse2, lse), "not deterministic"


def test_flash_attn_varlen_func_no_lse_and_bad_out():
    # split, so the forward kernel is varlen_causal_split3's (it keeps partial lse)
    fa = _api()
    seqlens = [3, 0, 130]
    cu = _cu(seqlens)
    q, k, v = (_randn(sum(seqlens), 3, 128, dtype=torch.bfloat16) for _ in range(3))
    out_ref, _ = attention_varlen_ref(q, k, v, cu, cu, causal=True)
    out_pt, _ = attention_varlen_ref(q, k, v, cu, cu, causal=True, upcast=False)
    out = fa.flash_attn_varlen_func(q, k, v, cu, cu, 130, 130, causal=True, num_splits=3, backend=BACKEND)
    assert isinstance(out, torch.Tensor)
    check_close(out, out_ref, out_pt)
    bad = torch.full((sum(seqlens) + 1, 3, 128), 7.0, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(REFUSALS):
        fa.flash_attn_varlen_func(q, k, v, cu, cu, 130, 130, out=bad, backend=BACKEND)
    torch.cuda.synchronize()
    assert (bad == 7.0).all()


# ---------------------------------------------------------------------------- kvcache

# seqlen_qs: decode (1) and a few speculative tokens (4) share the decode tile; a
# chunked-prefill append over several m-blocks (133, the prefill tile: one more compile)
# is causal in practice, so only causal configs get it. With cache_seqlens 1, most of its
# causal rows see no key.
KV_CFGS = [
    Cfg("kv_base", num_splits=0),  # flash_attn_with_kvcache defaults to num_splits=0
    Cfg("kv_causal_split3", causal=True, num_splits=3, seqlen_qs=(1, 4, 133)),
    Cfg("kv_causal_gqa_pack", causal=True, **GQA, pack_gqa=True, num_splits=0, seqlen_qs=(1, 4, 133)),
    Cfg("kv_fp16_d64_split3", **FP16, d=64, dv=64, num_splits=3),
    Cfg("kv_local_gqa", window=(100, 17), **GQA, num_splits=0),
    Cfg("paged_base_split3", paged=True, num_splits=3),
    Cfg("paged_causal", paged=True, causal=True, num_splits=0, seqlen_qs=(1, 4, 133)),
    Cfg("paged_causal_gqa_pack_split3", paged=True, causal=True, **GQA, pack_gqa=True, num_splits=3),
    # a padded head dim over every page size: gathered rows (pages 1, 16) and TMA blocks
    Cfg("paged_d80_causal_gqa_pack", paged=True, d=80, dv=80, causal=True, **GQA, pack_gqa=True, num_splits=0),
]
PAGE_SIZES = [1, 16, 64, 128, 256]  # degenerate, smaller than a tile, half a tile, one tile, larger
KV_CAPACITY = 1000  # keys per cache row (rounded up to whole pages when paged)
# ragged: a single key, the full capacity (None), and two in between (one under a tile)
KV_CACHE_SEQLENS = [1, None, 517, 64]


def _kv_params():
    params = []
    for cfg in KV_CFGS:
        for page_size in PAGE_SIZES if cfg.paged else [None]:
            for sq in cfg.seqlen_qs:
                suffix = f"-page{page_size}" if page_size else ""
                params.append(pytest.param(cfg, page_size, sq, id=f"{cfg.name}{suffix}-q{sq}"))
    return params


def _make_caches(cfg, batch, capacity, page_size):
    """Random K/V caches: contiguous (batch, capacity, ...), or a pool of pages handed
    out in a random, non-contiguous order (torch.randperm) with a few pages owned by
    nobody. Slots past cache_seqlens hold random data too, so masking is tested.
    Returns (k_cache, v_cache, page_table or None, capacity in keys per row)."""
    if page_size is None:
        k = _randn(batch, capacity, cfg.nheads_kv, cfg.d, dtype=cfg.dtype)
        v = _randn(batch, capacity, cfg.nheads_kv, cfg.dv, dtype=cfg.dtype)
        return k, v, None, capacity
    pages_per_seq = math.ceil(capacity / page_size)
    num_pages = batch * pages_per_seq + 3
    k = _randn(num_pages, page_size, cfg.nheads_kv, cfg.d, dtype=cfg.dtype)
    v = _randn(num_pages, page_size, cfg.nheads_kv, cfg.dv, dtype=cfg.dtype)
    perm = torch.randperm(num_pages, device=DEVICE)[: batch * pages_per_seq]
    page_table = perm.view(batch, pages_per_seq).to(torch.int32)
    return k, v, page_table, pages_per_seq * page_size


def _run_kvcache(cfg, seqlen_q, page_size, cache_seqlens, capacity=KV_CAPACITY, seed=0):
    """cache_seqlens: per-row key counts, None meaning the full capacity of the row."""
    fa = _api()
    torch.manual_seed(seed)
    batch = len(cache_seqlens)
    k_cache, v_cache, page_table, capacity = _make_caches(cfg, batch, capacity, page_size)
    cache_seqlens = torch.tensor([capacity if s is None else s for s in cache_seqlens],
                                 dtype=torch.int32, device=DEVICE)
    q = _randn(batch, seqlen_q, cfg.nheads, cfg.d, dtype=cfg.dtype)
    ref_args = (q, k_cache, v_cache, cache_seqlens, page_table)
    out_ref, lse_ref = attention_kvcache_ref(*ref_args, **cfg.mask_kwargs())
    out_pt, lse_pt = attention_kvcache_ref(*ref_args, **cfg.mask_kwargs(), upcast=False)

    kwargs = dict(cfg.api_kwargs(), page_table=page_table, return_lse=True)
    out_buf = _nan((batch, seqlen_q, cfg.nheads, cfg.dv), cfg.dtype)
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, **kwargs, out=out_buf)
    assert out.data_ptr() == out_buf.data_ptr()
    assert lse.shape == (batch, cfg.nheads, seqlen_q)
    _check_against_ref(out, lse, out_ref, lse_ref, out_pt, lse_pt, cfg.dtype)

    out2, lse2 = fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, **kwargs)
    assert torch.equal(out2, out) and torch.equal(lse2, lse), "not deterministic"


@pytest.mark.parametrize("cfg,page_size,seqlen_q", _kv_params())
def test_flash_attn_with_kvcache(cfg, page_size, seqlen_q):
    _run_kvcache(cfg, seqlen_q, page_size, KV_CACHE_SEQLENS)


DECODE_CFG = Cfg("decode_gqa", nheads=32, nheads_kv=8, pack_gqa=True)


@pytest.mark.parametrize("num_splits", [0, 3])
@pytest.mark.parametrize("page_size", [None, 64], ids=["contiguous", "paged64"])
def test_decode_gqa_pack(page_size, num_splits):
    # the serving shape: B=2, 32 q heads over 8 kv heads, one query, 4224 cached keys
    cfg = Cfg(**{**DECODE_CFG.__dict__, "num_splits": num_splits, "paged": page_size is not None})
    _run_kvcache(cfg, 1, page_size, cache_seqlens=[None, 3001], capacity=4224)


@pytest.mark.parametrize("mode", ["boxes", "gather"])
@pytest.mark.parametrize("page_size,seqlen_q", [(16, 1), (32, 4), (48, 133)])
def test_paged_boxes_nan_past_the_end(page_size, seqlen_q, mode, monkeypatch):
    # Pages of a multiple of 16 keys that hold no whole KV block (SM90 with
    # FLASH_ATTN_CUTE_SM90_PAGED_KV=boxes: TMA boxes of 16 or 32 rows, one page lookup each;
    # 48: three boxes a page; "gather": row gathers): lengths that end inside a box, a page
    # and a block, a sequence of one key (a block's later boxes start past its end), and NaN
    # in every row past each length (whole boxes read there, by the masks and the V tail's
    # zeroing taken out).
    monkeypatch.setenv("FLASH_ATTN_CUTE_SM90_PAGED_KV", mode)
    cfg = Cfg("boxes", causal=True, **GQA, pack_gqa=True, num_splits=0, paged=True)
    torch.manual_seed(5)
    lens = [1, 517, 64, 300]
    k_cache, v_cache, page_table, capacity = _make_caches(cfg, len(lens), 600, page_size)
    cache_seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    ref_args_clean = (k_cache.clone(), v_cache.clone())
    pages_per_seq = page_table.shape[1]
    for b, n in enumerate(lens):
        for p in range(pages_per_seq):
            start = p * page_size
            if start + page_size > n:
                rows = slice(max(0, n - start), page_size)
                k_cache[page_table[b, p], rows] = float("nan")
                v_cache[page_table[b, p], rows] = float("nan")
    q = _randn(len(lens), seqlen_q, cfg.nheads, cfg.d, dtype=cfg.dtype)
    ref_args = (q, *ref_args_clean, cache_seqlens, page_table)
    out_ref, lse_ref = attention_kvcache_ref(*ref_args, **cfg.mask_kwargs())
    out_pt, lse_pt = attention_kvcache_ref(*ref_args, **cfg.mask_kwargs(), upcast=False)
    out, lse = _api().flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, **cfg.api_kwargs(),
                                              page_table=page_table, return_lse=True)
    _check_against_ref(out, lse, out_ref, lse_ref, out_pt, lse_pt, cfg.dtype)


def test_kvcache_zero_length_row():
    # cache_seqlens 0: either refused cleanly, or the row's output is 0 and its lse -inf
    fa = _api()
    q = _randn(2, 1, 3, 128, dtype=torch.bfloat16)
    k_cache, v_cache = (_randn(2, KV_CAPACITY, 3, 128, dtype=torch.bfloat16) for _ in range(2))
    cache_seqlens = torch.tensor([0, KV_CAPACITY], dtype=torch.int32, device=DEVICE)
    try:
        out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, return_lse=True,
                                              backend=BACKEND)
    except REFUSALS as e:
        pytest.skip(f"interface refuses cache_seqlens == 0: {e}")
    out_ref, lse_ref = attention_kvcache_ref(q, k_cache, v_cache, cache_seqlens)
    out_pt, lse_pt = attention_kvcache_ref(q, k_cache, v_cache, cache_seqlens, upcast=False)
    _check_against_ref(out, lse, out_ref, lse_ref, out_pt, lse_pt, torch.bfloat16)


@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "paged16"])  # both clamp paths
def test_kvcache_unchecked_lengths_clamped(page_size):
    # check_cache_bounds=False skips the host read: lengths over the capacity must be
    # clamped by the kernel (same result as the capacity), never read past the cache.
    fa = _api()
    cfg = Cfg("clamp", nheads=4, nheads_kv=2, paged=page_size is not None)
    k_cache, v_cache, page_table, capacity = _make_caches(cfg, 2, 300, page_size)
    q = _randn(2, 1, cfg.nheads, cfg.d, dtype=cfg.dtype)
    over = torch.tensor([capacity + 1000, 77], dtype=torch.int32, device=DEVICE)
    clamped = torch.tensor([capacity, 77], dtype=torch.int32, device=DEVICE)
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, over, page_table=page_table, num_splits=3,
                                     backend=BACKEND, check_cache_bounds=False)
    out_ref, _ = attention_kvcache_ref(q, k_cache, v_cache, clamped, page_table)
    out_pt, _ = attention_kvcache_ref(q, k_cache, v_cache, clamped, page_table, upcast=False)
    check_close(out, out_ref, out_pt)


def test_kvcache_no_lse_and_bad_out():
    # long enough that auto splits: kv_base's forward kernel, a combine without lse
    fa = _api()
    q = _randn(2, 1, 3, 128, dtype=torch.bfloat16)
    k_cache, v_cache = (_randn(2, KV_CAPACITY, 3, 128, dtype=torch.bfloat16) for _ in range(2))
    cache_seqlens = torch.tensor([KV_CAPACITY, 17], dtype=torch.int32, device=DEVICE)
    out_ref, _ = attention_kvcache_ref(q, k_cache, v_cache, cache_seqlens)
    out_pt, _ = attention_kvcache_ref(q, k_cache, v_cache, cache_seqlens, upcast=False)
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, backend=BACKEND)
    assert isinstance(out, torch.Tensor)
    check_close(out, out_ref, out_pt)
    bad = torch.full((2, 1, 3, 64), 7.0, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(REFUSALS):
        fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, out=bad, backend=BACKEND)
    torch.cuda.synchronize()
    assert (bad == 7.0).all()


def test_kvcache_heads_times_splits_past_a_grid_dimension():
    # 512 query heads x 256 splits = 131,072 (head, split) pairs: more than a grid's y or z
    # extent (65,535) holds; the splits ride with the batch on z, folded into x past it.
    fa = _api()
    torch.manual_seed(5)
    q = _randn(2, 1, 512, 64, dtype=torch.bfloat16)
    k_cache, v_cache = (_randn(2, 16384, 8, 64, dtype=torch.bfloat16) for _ in range(2))
    lens = torch.tensor([16384, 9000], dtype=torch.int32, device=DEVICE)
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, lens, num_splits=256, pack_gqa=False,
                                          return_lse=True, backend=BACKEND)
    out_ref, lse_ref = attention_kvcache_ref(q, k_cache, v_cache, lens)
    out_pt, lse_pt = attention_kvcache_ref(q, k_cache, v_cache, lens, upcast=False)
    _check_against_ref(out, lse, out_ref, lse_ref, out_pt, lse_pt, torch.bfloat16)


# --------------------------------------------------------------------- compile count


def compile_keys(backend="sm80", arch="sm_90a", num_sms=132):
    """(forward keys, combine keys) this file compiles on ``backend`` for ``arch``, from
    the backend's own ``plan`` and ``compile_key`` on ``num_sms`` SMs (the H200's 132):
    the problems as the tests build them, calls the backend refuses left out. The CPU
    compile tests compile a covering subset of these keys."""
    from flash_attn_cute import interface, seam
    from flash_attn_cute.kernels.combine import combine_key
    from flash_attn_cute.host.keys import DTYPE_NAMES

    module = seam.backend_module(backend)
    keys, comb = set(), set()

    def add(cfg, kind, batch, max_sq, max_sk, has_lse=True, page_size=0):
        if max_sq == 0 or max_sk == 0:
            return
        causal, left, right = interface.normalize_window(cfg.causal, cfg.window)
        problem = seam.FwdProblem(
            dtype=cfg.dtype, batch=batch, max_seqlen_q=max_sq, max_seqlen_k=max_sk, nheads=cfg.nheads,
            nheads_kv=cfg.nheads_kv, d=cfg.d, d_v=cfg.dv, softmax_scale=cfg.d ** -0.5, causal=causal,
            window_left=left, window_right=right, softcap=cfg.softcap, varlen_q=kind == "varlen",
            varlen_k=kind == "varlen", has_seqused_k=kind in ("kvcache", "paged"), page_size=page_size,
            has_lse=has_lse)
        if module.check(problem) is not None:
            return
        plan = module.plan(problem, cfg.num_splits, cfg.pack_gqa, num_sms)
        keys.add(module.compile_key(problem, plan, arch))
        if plan.is_split:
            comb.add(combine_key(DTYPE_NAMES[cfg.dtype], cfg.dv, has_lse, arch))

    base = _BY_NAME["base"]
    for cfg in FUNC_CFGS:
        for sq, sk in PREFILL_PAIRS + (DECODE_PAIRS if cfg.decode else []):
            add(cfg, "func", 2, sq, sk)
    for name in ("base", "causal", "causal_gqa_pack_split3"):
        add(_BY_NAME[name], "func", 1, 4224, 4224)
    add(base, "func", 2, 77, 77)  # explicit scale
    for ns in (1, 3):
        add(Cfg("no_lse", num_splits=ns), "func", 2, 113, 113, has_lse=False)
    add(Cfg("pack_auto", **GQA, pack_gqa=None), "func", 2, 113, 203)
    add(_BY_NAME["split3"], "func", 2, 5, 4224)  # determinism
    for cfg in VARLEN_CFGS:
        for lq, lk in list(VARLEN_LENS.values()) + (list(VARLEN_DECODE_LENS.values()) if cfg.decode else []):
            add(cfg, "varlen", len(lq), max(lq), max(lk))
    add(Cfg("varlen_no_lse", causal=True, num_splits=3), "varlen", 3, 130, 130, has_lse=False)
    for cfg in KV_CFGS:
        for page_size in PAGE_SIZES if cfg.paged else [None]:
            cap = KV_CAPACITY if page_size is None else math.ceil(KV_CAPACITY / page_size) * page_size
            for sq in cfg.seqlen_qs:
                add(cfg, "paged" if cfg.paged else "kvcache", len(KV_CACHE_SEQLENS), sq, cap,
                    page_size=page_size or 0)
    for page_size in (None, 64):
        for ns in (0, 3):
            add(Cfg(**{**DECODE_CFG.__dict__, "num_splits": ns}), "paged" if page_size else "kvcache",
                2, 1, 4224, page_size=page_size or 0)
    add(Cfg("kv_zero", num_splits=0), "kvcache", 2, 1, KV_CAPACITY)
    add(Cfg("grid", d=64, dv=64, nheads=512, nheads_kv=8, num_splits=256), "kvcache", 2, 1, 16384)
    add(Cfg("kv_no_lse", num_splits=0), "kvcache", 2, 1, KV_CAPACITY, has_lse=False)
    return keys, comb


if __name__ == "__main__":
    from flash_attn_cute import seam as _fwd

    for name in _fwd.BACKENDS:
        keys, comb = compile_keys(name)
        print(f"{name}: {len(keys)} forward kernels + {len(comb)} combine kernels")
