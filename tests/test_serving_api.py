"""CPU tests of the serving engine's call surface (issue 15): varlen queries over dense or
paged caches with per-sequence key counts, SGLang's packed ``flash_attn_with_kvcache``,
attention sinks, the append path's arguments and the legacy positional form. Every
argument is refused before any launch with a message naming it; valid calls reach the
launcher with the tensors the kernels read (the kernels' numerics are GPU tests)."""

import importlib
from types import SimpleNamespace

import pytest
import torch

from flash_attn_cute import seam, sm80
from flash_attn_cute.seam.backend_kit import FEATURES, feature_refusal
from flash_attn_cute.interface import flash_attn_varlen_func, flash_attn_with_kvcache
from flash_attn_cute.api.call_args import FwdTensors

BF16 = torch.bfloat16


@pytest.fixture
def launches(fake_device):
    """A fake GPU whose SM80-planned launcher records (problem, plan, tensors)."""
    calls = []

    def launcher(problem, plan, device=None):
        return lambda tensors: calls.append(SimpleNamespace(problem=problem, plan=plan, tensors=tensors))

    fake = SimpleNamespace(AUTO=True, runs_on=sm80.runs_on, check=lambda p: None, plan=sm80.plan, launcher=launcher)
    fake_device(lambda name, kind="fwd": fake)
    return calls


@pytest.fixture
def no_launch(fake_device):
    def refuse(*a, **kw):
        raise AssertionError("launched")

    fake_device(lambda name, kind="fwd": SimpleNamespace(AUTO=True, runs_on=sm80.runs_on, check=sm80.check,
                                                         plan=sm80.plan, launcher=refuse))


def mixed_step(page_size=16, lens_q=(1, 1, 7, 0, 300), lens_k=(40, 513, 100, 9, 600), h=8, hk=2, d=64, pages=200):
    """A vLLM-style mixed step: decode rows, a spec-decode row, an empty row, a prefill chunk."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lens_q), h, d, generator=g).to(BF16)
    k = torch.randn(pages, page_size, hk, d, generator=g).to(BF16)
    v = torch.randn(pages, page_size, hk, d, generator=g).to(BF16)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    max_pages = -(-max(lens_k) // page_size)
    table = torch.randint(0, pages, (len(lens_q), max_pages), generator=g, dtype=torch.int32)
    return dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, max_seqlen_q=max(lens_q), seqused_k=torch.tensor(lens_k,
                dtype=torch.int32), page_table=table)


def test_varlen_queries_over_a_paged_cache_reach_the_kernel(launches):
    a = mixed_step()
    out, lse = flash_attn_varlen_func(**a, causal=True, return_lse=True)
    # A mixed step: two launches over the same tensors (seam.mixed_short_q), the sequences
    # of at most 64 // 4 = 16 queries on the decode tile, then the others.
    short, call = launches
    assert (short.problem.q_class, short.problem.max_seqlen_q, short.plan.config.tile_m) == (16, 16, 64)
    p = call.problem
    assert p.varlen_q and not p.varlen_k and p.has_seqused_k and p.page_size == 16 and p.batch == 5
    assert p.max_seqlen_q == 300 and p.max_seqlen_k == a["page_table"].shape[1] * 16 and p.q_class == -16
    assert call.plan.num_splits == 1
    for c in (short, call):
        q, k, v, o, l, cu_q, cu_k, seqused, table = c.tensors[:9]
        assert q is a["q"] and k is a["k"] and cu_q is a["cu_seqlens_q"] and cu_k is None
        assert seqused is a["seqused_k"] and table is a["page_table"]
    assert call.tensors[3] is out and call.tensors[4] is lse
    # Nothing to mix: every sequence short, or a batch cache read without seqused_k.
    launches.clear()
    flash_attn_varlen_func(**dict(a, max_seqlen_q=16), causal=True)
    assert len(launches) == 1 and launches[0].problem.q_class == 0
    assert out.shape == (309, 8, 64) and lse.shape == (8, 309)
    # vLLM's names: block_table for page_table
    a2 = dict(a, block_table=a.pop("page_table"))
    flash_attn_varlen_func(**a2, causal=True)
    assert launches[-1].tensors[8] is a2["block_table"]


def test_varlen_over_a_batch_cache_and_dense_queries(launches):
    # FA4's kvcache tests: dense q with cu_seqlens_q None over a batch cache with seqused_k.
    q = torch.randn(3, 4, 8, 64).to(BF16)
    k = v = torch.randn(3, 50, 2, 64).to(BF16)
    seqused = torch.tensor([50, 7, 0], dtype=torch.int32)
    out, lse = flash_attn_varlen_func(q, k, v, seqused_k=seqused, causal=True, return_lse=True)
    p = launches[-1].problem
    assert not p.varlen_q and not p.varlen_k and p.has_seqused_k and p.page_size == 0
    assert (p.batch, p.max_seqlen_q, p.max_seqlen_k) == (3, 4, 50)
    assert out.shape == (3, 4, 8, 64) and lse.shape == (3, 8, 4)
    # packed keys with per-sequence counts (keys past seqused_k[b] unused)
    qp = torch.randn(6, 8, 64).to(BF16)
    kp = vp = torch.randn(30, 2, 64).to(BF16)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    flash_attn_varlen_func(qp, kp, vp, cu, torch.tensor([0, 10, 30], dtype=torch.int32), 4, 20,
                           seqused_k=torch.tensor([5, 20], dtype=torch.int32))
    p = launches[-1].problem
    assert p.varlen_q and p.varlen_k and p.has_seqused_k and p.max_seqlen_k == 20


def test_sglang_packed_kvcache_call(launches):
    a = mixed_step(page_size=64)
    out = flash_attn_with_kvcache(a["q"], a["k"], a["v"], cache_seqlens=a["seqused_k"], page_table=a["page_table"],
                                  cu_seqlens_q=a["cu_seqlens_q"], max_seqlen_q=a["max_seqlen_q"], causal=True)
    p = launches[-1].problem
    assert p.varlen_q and p.has_seqused_k and p.page_size == 64 and p.max_seqlen_q == 300
    assert out.shape == a["q"].shape
    assert launches[-1].tensors[5] is a["cu_seqlens_q"] and launches[-1].tensors[7] is a["seqused_k"]


def test_legacy_positional_cache_seqlens(launches):
    q = torch.randn(2, 1, 8, 64).to(BF16)
    k = v = torch.randn(2, 30, 2, 64).to(BF16)
    lens = torch.tensor([3, 30], dtype=torch.int32)
    flash_attn_with_kvcache(q, k, v, lens)
    assert launches[-1].tensors[7] is lens
    flash_attn_with_kvcache(q, k, v, 17)  # an int for all sequences
    assert launches[-1].tensors[7].tolist() == [17, 17]
    flash_attn_with_kvcache(q, k, v)  # None: the whole cache
    assert launches[-1].tensors[7].tolist() == [30, 30]


def _varlen_case(mutate):
    a = mixed_step()
    mutate(a)
    return lambda: flash_attn_varlen_func(**a)


VARLEN_CASES = [
    ("page_table_with_cu_k", lambda a: a.update(cu_seqlens_k=a["cu_seqlens_q"]), ValueError,
     "page_table and cu_seqlens_k cannot be combined"),
    ("page_table_without_seqused", lambda a: a.pop("seqused_k"), ValueError, "page_table needs seqused_k"),
    ("seqused_int64", lambda a: a.update(seqused_k=a["seqused_k"].long()), TypeError, "seqused_k must be int32"),
    ("seqused_length", lambda a: a.update(seqused_k=a["seqused_k"][:2]), ValueError, r"seqused_k must have shape"),
    ("seqused_q_length", lambda a: a.update(seqused_q=a["seqused_k"][:2]), ValueError, r"seqused_q must have shape"),
    ("table_batch", lambda a: a.update(page_table=a["page_table"][:2]), ValueError, "page_table must have shape"),
    ("both_table_names", lambda a: a.update(block_table=a["page_table"]), ValueError,
     "page_table and block_table name the same argument"),
    ("q_rank_without_cu", lambda a: a.pop("cu_seqlens_q"), ValueError, "without cu_seqlens_q"),
    ("sink_length", lambda a: a.update(learnable_sink=torch.zeros(3)), ValueError,
     r"learnable_sink must have shape \(nheads,\) = \(8,\)"),
    ("sink_int", lambda a: a.update(learnable_sink=torch.zeros(8, dtype=torch.int32)), TypeError,
     "learnable_sink must be float32, bfloat16 or float16"),
    ("sink_2d", lambda a: a.update(learnable_sink=torch.zeros(1, 8)), ValueError, "learnable_sink must have shape"),
    ("sink_and_s_aux", lambda a: a.update(learnable_sink=torch.zeros(8), s_aux=torch.zeros(8)), ValueError,
     "learnable_sink and s_aux"),
    ("batch_invariant_int", lambda a: a.update(batch_invariant=1), TypeError, "batch_invariant must be a bool"),
    ("max_seqlen_q_float", lambda a: a.update(max_seqlen_q=3.0), TypeError, "max_seqlen_q must be an int"),
    ("k_dense_batch", lambda a: a.update(page_table=None, seqused_k=None, k=torch.randn(2, 9, 2, 64).to(BF16),
                                         v=torch.randn(2, 9, 2, 64).to(BF16)), ValueError, "the batch of q"),
]


@pytest.mark.parametrize("name,mutate,exc,match", VARLEN_CASES, ids=[c[0] for c in VARLEN_CASES])
def test_varlen_validation(no_launch, name, mutate, exc, match):
    with pytest.raises(exc, match=match):
        _varlen_case(mutate)()


def _append_case(mutate, paged=False):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 1, 8, 64, generator=g).to(BF16)
    shape = (6, 16, 2, 64) if paged else (2, 48, 2, 64)
    a = dict(q=q, k_cache=torch.randn(shape, generator=g).to(BF16), v_cache=torch.randn(shape, generator=g).to(BF16),
             k=torch.randn(2, 1, 2, 64, generator=g).to(BF16), v=torch.randn(2, 1, 2, 64, generator=g).to(BF16),
             rotary_cos=torch.randn(48, 16, generator=g).to(BF16), rotary_sin=torch.randn(48, 16, generator=g).to(BF16),
             cache_seqlens=torch.tensor([5, 9], dtype=torch.int32))
    if paged:
        a["page_table"] = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    mutate(a)
    return lambda: flash_attn_with_kvcache(**a)


APPEND_CASES = [
    ("k_without_v", False, lambda a: a.pop("v"), ValueError, "k and v .* must be given together"),
    ("k_shape", False, lambda a: a.update(k=a["k"][:, :, :1]), ValueError, r"k must have shape"),
    ("v_dtype", False, lambda a: a.update(v=a["v"].half()), TypeError, "v must be torch.bfloat16"),
    ("cos_without_sin", False, lambda a: a.pop("rotary_sin"), ValueError, "rotary_cos and rotary_sin"),
    ("rotary_dim_not_16", False, lambda a: a.update(rotary_cos=a["rotary_cos"][:, :4], rotary_sin=a["rotary_sin"][:, :4]),
     ValueError, "rotary_dim a multiple of 16"),
    ("rotary_too_wide", False, lambda a: a.update(rotary_cos=torch.zeros(48, 40).to(BF16),
                                                  rotary_sin=torch.zeros(48, 40).to(BF16)), ValueError, "rotary_dim"),
    ("rotary_too_short", False, lambda a: a.update(rotary_cos=a["rotary_cos"][:20], rotary_sin=a["rotary_sin"][:20]),
     ValueError, "must cover every cache position"),
    ("rotary_fp32", False, lambda a: a.update(rotary_cos=a["rotary_cos"].float(), rotary_sin=a["rotary_sin"].float()),
     TypeError, "rotary_cos must be torch.bfloat16"),
    ("batch_idx_with_pages", True, lambda a: a.update(cache_batch_idx=torch.tensor([1, 0], dtype=torch.int32)),
     ValueError, "cache_batch_idx applies to a contiguous cache"),
    ("leftpad_int64", False, lambda a: a.update(cache_leftpad=torch.tensor([1, 0])), TypeError,
     "cache_leftpad must be int32"),
    ("seqlens_no_room", False, lambda a: a.update(cache_seqlens=48), ValueError, r"cache_seqlens must be in \[0, 47\]"),
    ("packed_q_dense_k", False, lambda a: a.update(q=a["q"][:, 0], cu_seqlens_q=torch.tensor([0, 1, 2],
                                                                                           dtype=torch.int32)),
     ValueError, r"k must have shape \(total_new, nheads_kv, headdim\)"),
    ("cu_k_new_bad_length", False, lambda a: a.update(q=a["q"][:, 0], k=a["k"][:, 0], v=a["v"][:, 0],
                                                       cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32),
                                                       cu_seqlens_k_new=torch.tensor([0, 2], dtype=torch.int32)),
     ValueError, r"cu_seqlens_k_new must have shape"),
]


@pytest.mark.parametrize("name,paged,mutate,exc,match", APPEND_CASES, ids=[c[0] for c in APPEND_CASES])
def test_append_validation(no_launch, name, paged, mutate, exc, match):
    with pytest.raises(exc, match=match):
        _append_case(mutate, paged)()


def test_features_a_kernel_lacks_are_refused_by_name(fake_device):
    # A backend's check names the feature it does not implement (the API never launches it).
    def refuse(*a, **kw):
        raise AssertionError("launched")

    bare = SimpleNamespace(AUTO=True, runs_on=sm80.runs_on, check=lambda p: feature_refusal(p, frozenset()),
                           plan=sm80.plan, launcher=refuse)
    fake_device(lambda name, kind="fwd": bare)
    q = k = v = torch.randn(1, 8, 2, 64).to(BF16)
    for kw, name in (({"learnable_sink": torch.zeros(2)}, "learnable_sink"), ({"batch_invariant": True},
                                                                           "batch_invariant"),
                     ({"seqused_q": torch.tensor([3], dtype=torch.int32)}, "seqused_q")):
        with pytest.raises(NotImplementedError, match=f"{name} is not implemented"):
            flash_attn_varlen_func(q, k, v, backend="sm80", **kw)
    # every forward backend implements all of them, except FP8 attention on SM80 (no fp8 MMA)
    # and cache_leftpad over pages on SM100 (its pages are TMA boxes of whole KV blocks)
    for name, module in seam.BACKENDS.items():
        lacks = {"sm80": {"fp8_qkv"}, "sm100": {"paged_leftpad"}}.get(name, set())
        assert importlib.import_module(module).FEATURES == {n for _, n in FEATURES} - lacks, name


def test_sink_and_seqused_q_reach_the_kernel(launches):
    # launch(FwdTensors): every slot always there (None when absent), the sink as fp32.
    a = mixed_step()
    sink = torch.randn(8).to(BF16)
    used = torch.tensor([1, 1, 3, 0, 200], dtype=torch.int32)
    flash_attn_varlen_func(**a, seqused_q=used, s_aux=sink, causal=True)
    call = launches[-1]
    assert call.problem.has_sink and call.problem.has_seqused_q and len(call.tensors) == len(FwdTensors._fields)
    assert call.tensors[9] is used
    assert call.tensors[10].dtype == torch.float32 and torch.equal(call.tensors[10], sink.float())
    fp32_sink = torch.randn(8)
    flash_attn_varlen_func(**a, learnable_sink=fp32_sink)
    assert launches[-1].tensors[9] is None and launches[-1].tensors[10] is fp32_sink  # no copy
    flash_attn_varlen_func(**a)
    assert launches[-1].tensors[9:] == (None,) * (len(FwdTensors._fields) - 9) and not launches[-1].problem.has_sink


def test_batch_invariant_is_always_split_with_the_sink_in_the_combine(launches, monkeypatch):
    # Fixed keys per split (4096), the splits the capacity needs, a split kernel and the
    # combine even for one split; the combine gets the sink, the kernel fp32 partials.
    combines = []
    monkeypatch.setattr(seam, "combine_launcher", lambda out_dtype, d_v, has_lse, has_sink=False, split_groups=1, arch=None:
                        lambda *t: combines.append((has_sink, t)))
    a = mixed_step(page_size=16)  # capacity 608 keys: one split
    sink = torch.randn(8)
    out = flash_attn_varlen_func(**a, learnable_sink=sink, batch_invariant=True, num_splits=5)
    call = launches[-1]
    assert call.plan.num_splits == 1 and call.plan.is_split and call.plan.config.split_blocks == 32
    o_partial, lse_partial = call.tensors[3:5]
    assert o_partial.dtype == torch.float32 and o_partial.shape == (1, *out.shape)
    assert lse_partial.shape == (1, 8, out.shape[0])
    has_sink, (cp_o, cp_lse, c_out, c_lse, c_sink) = combines[-1]
    assert has_sink and c_sink is call.tensors[10] and c_out.shape == (1, *out.shape)
    b = mixed_step(page_size=16, lens_k=(40, 513, 100, 9, 9000))
    flash_attn_varlen_func(**b, batch_invariant=True)
    assert launches[-1].plan.num_splits == 3  # ceil(9008 / 4096)


def test_seqused_q_split_partials_start_empty(launches, monkeypatch):
    # Rows past seqused_q are not computed: split partials start at LSE -inf so that the
    # combine writes them as rows that saw no key, never uninitialised memory.
    monkeypatch.setattr(seam, "combine_launcher", lambda out_dtype, d_v, has_lse, has_sink=False, split_groups=1, arch=None: lambda *t: None)
    a = mixed_step()
    flash_attn_varlen_func(**a, seqused_q=torch.tensor([1, 1, 3, 0, 200], dtype=torch.int32), num_splits=3)
    lse_partial = launches[-2].tensors[4]  # the mixed plan's short part (the long one is never split)
    assert launches[-1].plan.num_splits == 1
    assert lse_partial.shape[0] == 3 and bool(torch.isinf(lse_partial).all())
