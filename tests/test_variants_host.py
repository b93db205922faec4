"""CPU tests of user variants: compile keys, the torch side of the building blocks, block
masks against brute force, argument checks, and compile-only builds of the variant path
for sm_80, sm_90a and sm_100a (no GPU needed)."""

import re

import pytest
import torch
from compile_harness import compile_entries

from flash_attn_cute import create_block_mask, mods, seam
from flash_attn_cute.host.block_mask import EMPTY, FULL, PARTIAL
from flash_attn_cute.testing import attention_ref, variant_case_problem
from flash_attn_cute.host.user_variants import check_aux_tensors, function_digest, make_spec


def _spec_key(score_mod=None, mask_mod=None, aux=(), block_q=0):
    return make_spec(score_mod, mask_mod, tuple(aux), block_q).key


def test_key_follows_the_function_not_the_aux_values():
    a = _spec_key(mods.alibi(0), None, [torch.ones(8)])
    assert a == _spec_key(mods.alibi(0), None, [torch.randn(8)])  # new slopes: same binary
    assert a == _spec_key(mods.alibi(0), None, [torch.ones(16)])  # other sizes too (symbolic)
    assert a != _spec_key(mods.alibi(1), None, [torch.ones(8)])  # another slot: closure constant
    assert a != _spec_key(mods.alibi(0), None, [torch.ones(8, dtype=torch.bfloat16)])  # dtype
    assert a != _spec_key(mods.alibi(0), None, [torch.ones(8, 2)])  # rank
    assert a != _spec_key(mods.alibi(0), None, [torch.ones(8)], block_q=128)
    assert function_digest(mods.sliding_window(64)) != function_digest(mods.sliding_window(65))
    assert function_digest(mods.softcap(5.0)) == function_digest(mods.softcap(5.0))

    def f(score, b, h, q_idx, kv_idx, aux):
        return score * 2

    def g(score, b, h, q_idx, kv_idx, aux):
        return score * 3

    assert function_digest(f) != function_digest(g)


def test_captured_tensor_is_refused():
    t = torch.ones(4)

    def mod(score, b, h, q_idx, kv_idx, aux):
        return score + t[h]

    with pytest.raises(ValueError, match="captures the torch.Tensor 't'"):
        make_spec(mod, None, (), 0)


def test_aux_checks():
    with pytest.raises(TypeError, match="list or tuple"):
        check_aux_tensors(torch.ones(2), torch.device("cpu"))
    with pytest.raises(ValueError, match="at most 4"):
        check_aux_tensors([torch.ones(1)] * 5, torch.device("cpu"))
    with pytest.raises(TypeError, match=r"aux_tensors\[1\] has dtype torch.complex64"):
        check_aux_tensors([torch.ones(1), torch.ones(1, dtype=torch.complex64)], torch.device("cpu"))
    with pytest.raises(ValueError, match=r"aux_tensors\[0\] must have rank >= 1"):
        check_aux_tensors([torch.tensor(1.0)], torch.device("cpu"))


def test_reference_runs_the_same_functions():
    """The torch side: ALiBi and a document mask through attention_ref equal a hand-written
    bias and mask."""
    torch.manual_seed(0)
    b, s, h, d = 2, 40, 3, 16
    q, k, v = (torch.randn(b, s, h, d) for _ in range(3))
    slopes = mods.alibi_slopes(h, device="cpu")
    docs = torch.tensor([[i // 13 for i in range(s)], [i // 7 for i in range(s)]], dtype=torch.int32)
    out, lse = attention_ref(q, k, v, causal=True, score_mod=mods.alibi(0), mask_mod=mods.document_mask(1),
                             aux_tensors=[slopes, docs])
    pos = torch.arange(s)
    bias = slopes.view(1, h, 1, 1) * (pos.view(1, 1, 1, s) - pos.view(1, 1, s, 1))
    keep = (docs[:, None, :, None] == docs[:, None, None, :]) & (pos.view(1, 1, 1, s) <= pos.view(1, 1, s, 1))
    scores = torch.einsum("bqhd,bkhd->bhqk", q * d ** -0.5, k) + bias
    p = torch.softmax(scores.masked_fill(~keep, float("-inf")), -1)
    torch.testing.assert_close(out, torch.einsum("bhqk,bkhd->bqhd", p, v), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mask_mod,shape", [
    (mods.causal_mask, (None, None, 300, 300)),
    (mods.sliding_window(50), (None, None, 257, 400)),
    (mods.and_masks(mods.causal_mask, mods.document_mask(0)), (2, None, 333, 333)),
    (lambda b, h, q, k, aux: (k % (h + 2) != 1) | (q > 200), (1, 3, 260, 190)),
])
@pytest.mark.parametrize("block_size", [64, (128, 32)])
def test_block_mask_against_brute_force(mask_mod, shape, block_size):
    B, H, sq, sk = shape
    docs = torch.stack([torch.arange(sk) // 41, torch.arange(sk) // 77]).to(torch.int32)
    bm = create_block_mask(mask_mod, B, H, sq, sk, aux_tensors=[docs], device="cpu", block_size=block_size)
    bq, bk = bm.block_size
    intervals = []
    for b in range(B or 1):
        for h in range(H or 1):
            keep = mask_mod(torch.tensor(b), torch.tensor(h), torch.arange(sq)[:, None], torch.arange(sk)[None, :],
                            (docs,))
            keep = keep.expand(sq, sk)
            for qb in range(-(-sq // bq)):
                rows = keep[qb * bq:(qb + 1) * bq]
                lo, hi, f_lo, f_hi = bm.ranges[b, h, qb].tolist()
                kept = rows.any(0).nonzero().flatten()
                if len(kept):
                    assert (lo, hi) == (kept.min().item(), kept.max().item() + 1)
                else:
                    assert hi <= lo
                if f_hi > f_lo:
                    assert rows[:, f_lo:f_hi].all()
                run, best = 0, 0
                for j in range(sk):  # the longest every-row-kept run
                    run = run + 1 if rows[:, j].all() else 0
                    best = max(best, run)
                assert f_hi - f_lo == best
                for kb in range(-(-sk // bk)):
                    tile = rows[:, kb * bk:(kb + 1) * bk]
                    want = FULL if tile.all() else (PARTIAL if tile.any() else EMPTY)
                    assert bm.block_states[b, h, qb, kb].item() == want
            # Row bounds: each row's kept interval, present iff every row keeps one interval.
            kept = keep.int()
            runs = ((kept[:, 1:] - kept[:, :-1]) == 1).sum(1) + kept[:, 0]  # runs of kept keys per row
            intervals.append(bool((runs <= 1).all()))
            if bm.row_bounds is not None:
                for q in range(sq):
                    idx = keep[q].nonzero().flatten()
                    want = (idx.min().item(), idx.max().item() + 1) if len(idx) else (0, 0)
                    assert tuple(bm.row_bounds[b, h, q].tolist()) == want
    assert (bm.row_bounds is not None) == all(intervals)


def test_row_bounds_table_and_when_the_kernel_uses_it():
    """The kernels' table: block entries then row bounds in columns 4-5; the row bounds
    replace the mask_mod only over the block mask's own aux tensors."""
    from flash_attn_cute.api import checks

    sq = 300
    docs = (torch.arange(sq) // 41).to(torch.int32)[None].expand(2, sq).contiguous()
    mask = mods.document_mask(0)
    bm = create_block_mask(mask, 2, None, sq, sq, aux_tensors=[docs], device="cpu", block_size=64)
    assert bm.row_bounds is not None and bm.row_bounds.shape == (2, 1, sq, 2)
    table = bm.kernel_ranges(2, 3, rows=True)
    assert table.shape == (2, 3, sq, 6) and table.stride(1) == 0
    assert torch.equal(table[:, 0, :5, :4], bm.ranges[:, 0]) and not table[:, :, 5:, :4].any()
    assert torch.equal(table[:, 0, :, 4:], bm.row_bounds[:, 0])
    assert table[1, 2, 45].tolist()[4:] == [41, 82]
    holes = create_block_mask(lambda b, h, q, k, aux: k % 3 != 1, None, None, 70, 70, device="cpu")
    assert holes.row_bounds is None
    opts = checks.Options(softmax_scale=0.1, softcap=0.0, causal=True, window_left=-1, window_right=0, pack_gqa=None,
                          num_splits=1, backend=None)
    kw = dict(batch=2, nheads=3, max_seqlen_q=sq, max_seqlen_k=sq)
    _, (spec, tensors, ranges) = checks.user_variant(None, None, None, bm, opts, docs.device, **kw)
    assert spec.row_bounds and ranges.shape[-1] == 6 and spec.key[-1] is True
    _, (spec, _, ranges) = checks.user_variant(None, None, [docs.clone()], bm, opts, docs.device, **kw)
    assert not spec.row_bounds and ranges.shape[-1] == 4


# ------------------------------------------------------------------------------ compile-only

ARCHS = {"sm_80": ["sm80"], "sm_90a": ["sm80", "sm90"], "sm_100a": ["sm100"]}
MMA = {"sm80": "HMMA.16816.F32", "sm90": "HGMMA", "sm100": "UTCHMMA"}
VARIANT_CASES = ["alibi_document", "document_rows", "table_perhead_paged"]


@pytest.fixture(scope="module")
def variant_artifacts(tmp_path_factory):
    cache = {}

    def get(arch):
        if arch not in cache:
            entries = [(f"{b}_{c}", "flash_attn_cute.testing:compile_variant_case", [b, c])
                       for b in ARCHS[arch] for c in VARIANT_CASES]
            cache[arch] = compile_entries(arch, entries, tmp_path_factory.mktemp(f"variants_{arch}"))
        return cache[arch]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(ARCHS))
def test_variant_path_compiles(variant_artifacts, arch):
    out_dir, seconds = variant_artifacts(arch)
    print(f"\n{arch}: " + ", ".join(f"{k} {v:.1f}s" for k, v in seconds.items()))
    for backend in ARCHS[arch]:
        loads = {}
        for case in VARIANT_CASES:
            folder = out_dir / f"{backend}_{case}"
            cubins = list(folder.glob(f"*.{arch}.cubin"))
            assert len(cubins) == 1 and cubins[0].read_bytes()[:4] == b"\x7fELF", (backend, case)
            sass_files = list(folder.glob("*.sass"))
            if sass_files:
                sass = sass_files[0].read_text()
                assert MMA[backend] in sass, (backend, case)
                # the variant reads its aux tensors (row bounds: the block mask's table) from global memory
                assert re.search(r"\bLDG\.E", sass), (backend, case)
                loads[case] = len(re.findall(r"\bLDG\.E", sass))
        if loads:
            # Row bounds: two loads a row instead of the document ids of every score's query and key.
            assert loads["document_rows"] < loads["alibi_document"], (backend, loads)


def test_variant_key_is_in_the_compile_key():
    problem, num_splits, pack_gqa = variant_case_problem("alibi_document", "sm80")
    module = seam.backend_module("sm80")
    key = module.compile_key(problem, module.plan(problem, num_splits, pack_gqa, 132), "sm_80")
    plain = module.compile_key(problem._replace(variant=None), module.plan(problem, num_splits, pack_gqa, 132),
                               "sm_80")
    flags = next(f for f in key if isinstance(f, tuple))
    assert key != plain and flags[3] == problem.variant.key and len(key) == len(plain)


# ------------------------------------------------------------------------------ the public API on a fake GPU

@pytest.fixture
def fake_variant_gpu(fake_device):
    """CPU tensors pass as a 132-SM Hopper GPU whose (SM80-planned) launcher records its
    arguments: the variant's launch contract without a kernel."""
    from types import SimpleNamespace

    from flash_attn_cute import sm80

    calls = []

    def launcher(problem, plan, device=None):
        def launch(tensors):
            calls.append(SimpleNamespace(problem=problem, plan=plan, args=tensors))

        return launch

    backend = SimpleNamespace(AUTO=True, runs_on=sm80.runs_on, check=sm80.check,
                              plan=sm80.plan, launcher=launcher)
    fake_device(lambda name, kind="fwd": backend)
    yield calls


def _qkv(b=2, s=40, h=4, hk=2, d=64):
    return (torch.randn(b, s, h, d, dtype=torch.bfloat16), torch.randn(b, s, hk, d, dtype=torch.bfloat16),
            torch.randn(b, s, hk, d, dtype=torch.bfloat16))


def test_launch_contract_with_and_without_a_variant(fake_variant_gpu):
    from flash_attn_cute import flash_attn_func

    q, k, v = _qkv()
    flash_attn_func(q, k, v)
    plain = fake_variant_gpu[-1].args  # the kernels' tensor list (api.call_args.FwdTensors)
    assert plain.aux0 is None and plain.block_ranges is None
    slopes = mods.alibi_slopes(4, device="cpu")
    docs = (torch.arange(40) // 9).view(1, 40).expand(2, 40).to(torch.int32)
    bm = create_block_mask(mods.document_mask(1), None, None, 40, 40, aux_tensors=[slopes, docs], device="cpu",
                           block_size=16)
    for _ in range(2):  # the second call replays the per-call cache entry
        new_slopes = slopes + 1
        flash_attn_func(q, k, v, causal=True, score_mod=mods.alibi(0), aux_tensors=[new_slopes, docs], block_mask=bm)
        call = fake_variant_gpu[-1]
        t = call.args
        assert t.aux0 is new_slopes and t.aux1 is docs and (t.aux2, t.aux3) == (None, None)
        assert tuple(t.block_ranges.shape) == (2, 4, 3, 4) and t.block_ranges.stride(0) == 0
        assert call.problem.variant.block_q == 16 and not call.plan.pack_gqa
    assert fake_variant_gpu[-1].problem.variant == fake_variant_gpu[-2].problem.variant


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(aux_tensors=[torch.ones(4)]), ValueError, "without a score_mod"),
    (dict(score_mod=mods.softcap(5.0), softcap=3.0), ValueError, "softcap and score_mod"),
    (dict(block_mask="blocks"), TypeError, "block_mask must be a flash_attn_cute.BlockMask"),
    (dict(score_mod=3), TypeError, "score_mod must be a function"),
])
def test_variant_argument_errors(fake_variant_gpu, kwargs, exc, match):
    from flash_attn_cute import flash_attn_func

    q, k, v = _qkv()
    with pytest.raises(exc, match=match):
        flash_attn_func(q, k, v, **kwargs)
    assert not fake_variant_gpu  # refused before any launch


def test_block_mask_must_fit_the_call(fake_variant_gpu):
    from flash_attn_cute import flash_attn_func

    q, k, v = _qkv()
    small = create_block_mask(mods.causal_mask, None, None, 32, 40, device="cpu")
    with pytest.raises(ValueError, match="covers seqlen_q 32"):
        flash_attn_func(q, k, v, block_mask=small)
    per_batch = create_block_mask(mods.causal_mask, 3, None, 40, 40, device="cpu")
    with pytest.raises(ValueError, match="built for batch 3"):
        flash_attn_func(q, k, v, block_mask=per_batch)
    bm = create_block_mask(mods.causal_mask, None, None, 40, 40, device="cpu")
    with pytest.raises(ValueError, match="mask_mod must be the function block_mask was created with"):
        flash_attn_func(q, k, v, block_mask=bm, mask_mod=mods.sliding_window(3))
    assert not fake_variant_gpu
    # pack_gqa=True with a block mask (per query head entries) runs unpacked, as FA4 does.
    flash_attn_func(q, k, v, block_mask=bm, pack_gqa=True)
    assert len(fake_variant_gpu) == 1 and not fake_variant_gpu[0].plan.pack_gqa


def test_softcap_composes_with_a_user_mask_mod():
    """softcap with a user mask_mod (and no score_mod) keeps the cap: the kernel variant is
    built from the key's softcap flag as well as the user's spec (issue 30: the cap was
    dropped, 0.04-0.09 off in bf16)."""
    pytest.importorskip("cutlass")
    from flash_attn_cute.device.user_variant_kernel import make_variant

    def keep_all(b, h, q_idx, kv_idx, aux):
        return kv_idx >= 0

    key = _spec_key(None, keep_all)
    capped, plain = make_variant(False, False, True, key), make_variant(False, False, False, key)
    assert capped.has_score_mod and capped.has_mask and capped.base_mod is not None
    assert not plain.has_score_mod and plain.base_mod is None
    assert capped.key() != plain.key()
    local = make_variant(False, True, True, key)
    assert local.has_score_mod and local.base is not None and local.mask_is_key_interval is False
