"""CPU tests of the KV-append + rotary kernel: compiles, SASS, key, mapping, reference.

Each arch compiles a covering subset of the key space in its own subprocess through
tests/compile_harness.py; the SASS it keeps is then checked for what the design relies
on: every byte of q / k / v moves through 128-bit loads and stores, nothing spills, no
shared memory. The fp32 references of flash_attn_cute.testing (which the GPU tests trust)
are checked here against independent formulations.
"""

import itertools
import math
import re

import pytest
import torch
from compile_harness import compile_archs, compile_entries, covering_subset

from flash_attn_cute.testing import (apply_rotary_ref, attention_kvcache_ref, gather_paged_kv, kv_append_ref,
                                     quantize_ref, varlen_rows_ref)

# sm_80: the lowest supported arch; sm_90a: the main target (H200); sm_100a: Blackwell.
ARCHS = ["sm_80", "sm_90a", "sm_100a"]

# (rotary_dim, interleaved): none, GPT-J and GPT-NeoX over every channel of d = 64, and
# both over fewer channels than d (pass-through tail).
ROTARY = [(0, False), (64, True), (64, False), (32, True), (32, False)]


def key_space(arch):
    """Every flag combination the kernel accepts, over fp16 / bf16 and (d, d_v) in
    (64, 128), (128, 64): paged caches take a leftpad (key counts only), never a batch idx."""
    from flash_attn_cute.kernels.kv_append import append_key

    keys = set()
    for dtype, (d, d_v), (rd, inter), per_query, has_q, has_kv, paged, idx, leftpad, varlen in itertools.product(
            ["fp16", "bf16"], [(64, 128), (128, 64)], ROTARY, [True, False], [True, False], [True, False],
            [True, False], [True, False], [True, False], [True, False]):
        if paged and idx:
            continue
        keys.add(append_key(arch, dtype, d, d_v, rd, inter, per_query, has_q, has_kv, paged, idx, leftpad, varlen))
    return keys


def entry_name(key):
    _, _, dtype, d, d_v, rd, inter, per_query, has_q, has_kv, paged, idx, leftpad, varlen = key
    dtype = dtype.replace("/", "_")  # FP8: "bf16/bf16/bf16/e4m3" (kv_append.append_key)
    rot = "norot" if rd == 0 else f"{'gptj' if inter else 'neox'}{rd}"
    flags = [n for n, f in (("perq", per_query), ("q", has_q), ("kv", has_kv), ("paged", paged), ("idx", idx),
                            ("leftpad", leftpad), ("varlen", varlen)) if f]
    return "_".join([dtype, f"d{d}x{d_v}", rot] + flags)


def rotary_kind(key):
    return "none" if key[5] == 0 else "gptj" if key[6] else "neox"


def varlen_parts(k):
    """Of a varlen key (Nones for a dense one): its (q, new kv), its cache kind when it
    has new kv, its per-query positions when it has q: the branches varlen changes (q
    rows, k / v rows into either cache, the metadata)."""
    if not k[13]:
        return None, None, None
    cache = "paged" if k[10] else "idx" if k[11] else "contig"
    return (k[8], k[9]), cache if k[9] else None, k[7] if k[8] else None


def entries(arch):
    """A covering subset of the key space: every value of every field, every rotary kind
    with every (q, new kv) combination and with both cache kinds, with and without new kv
    (the branches that change the code most), and varlen with q only, new kv only and
    both, into paged, batch-indexed and plain contiguous caches, with and without
    per-query positions. Field 1 (the arch) is the same for all."""
    combos = {k + ((rotary_kind(k), k[8], k[9]), (rotary_kind(k), k[9], k[10])) + varlen_parts(k): k
              for k in key_space(arch)}
    return [(entry_name(combos[c]), "flash_attn_cute.kernels.kv_append:compile_append", combos[c])
            for c in covering_subset(combos, fixed_fields=2)]


def test_covering_subset_spans_every_value():
    chosen = [k for *_, k in entries("sm_90a")]
    assert len(chosen) <= 16
    for i in range(2, 14):
        assert {k[i] for k in chosen} == {k[i] for k in key_space("sm_90a")}, i
    assert {(rotary_kind(k), k[8], k[9]) for k in chosen} == {(r, q, kv) for r in ("none", "gptj", "neox")
                                                               for q in (True, False) for kv in (True, False)}
    assert {(rotary_kind(k), k[9], k[10]) for k in chosen} == {(r, kv, p) for r in ("none", "gptj", "neox")
                                                                for kv in (True, False) for p in (True, False)}
    parts = [varlen_parts(k) for k in chosen]
    assert {p[0] for p in parts} == {None, (True, True), (True, False), (False, True)}
    assert {p[1] for p in parts} == {None, "paged", "idx", "contig"}
    assert {p[2] for p in parts} == {None, True, False}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """{arch: (artifact dir, {entry: compile seconds})} (``compile_harness.compile_archs``)."""
    return compile_archs(ARCHS, entries, tmp_path_factory.mktemp("kv_append_artifacts"))


def all_entries():
    return [(arch, name, key) for arch in ARCHS for name, _, key in entries(arch)]


@pytest.mark.slow
@pytest.mark.parametrize("arch,name,key", all_entries(), ids=[f"{a}-{n}" for a, n, _ in all_entries()])
def test_cubin_ptx_and_sass(artifacts, arch, name, key):
    d = artifacts[arch][0] / name
    cubins = list(d.glob(f"*.{arch}.cubin"))
    assert len(cubins) == 1 and cubins[0].read_bytes()[:4] == b"\x7fELF"
    ptx = next(d.glob("*.ptx")).read_text()
    assert re.search(rf"^\.target\s+{arch}\b", ptx, re.M)
    sass_files = list(d.glob("*.sass"))
    if not sass_files:
        pytest.skip("no usable nvdisasm (pip install nvidia-cuda-nvdisasm): no SASS to check")
    sass = sass_files[0].read_text()
    _, _, _, _, _, rd, interleaved, _, has_q, has_kv, _, _, _, varlen = key
    moves_data = has_q or has_kv
    # q / k / v chunks: one 128-bit load and one 128-bit store each.
    assert bool(re.search(r"\bLDG\.E(\.\w+)*\.128\b", sass)) == moves_data
    assert bool(re.search(r"\bSTG\.E(\.\w+)*\.128\b", sass)) == moves_data
    # No narrower data store: the only other stores are the 32-bit metadata words.
    assert not re.search(r"\bSTG\.E(\.\w+)*\.(64|U16|S16|16|U8|S8|8)\b", sass)
    # No 16-bit element loads. 64-bit loads only for GPT-J cos / sin (vec / 2 columns per
    # chunk); GPT-NeoX reads cos / sin in 128 bits too.
    assert not re.search(r"\bLDG\.E(\.\w+)*\.(U16|S16|16|U8|S8|8)\b", sass)
    assert bool(re.search(r"\bLDG\.E(\.\w+)*\.64\b", sass)) == (interleaved and rd > 0 and moves_data)
    # Rotary in fp32 registers: FFMA only when something is rotated.
    assert ("FFMA" in sass) == (rd > 0 and moves_data)
    # No local memory (spills) and no shared memory; no subroutine (no division routine:
    # every division by a runtime size is a FastDivmod multiplication).
    assert not re.search(r"\b(LDL|STL|LDS|STS)\b", sass)
    assert not re.search(r"\bCALL\b", sass)
    # Varlen: one bisection loop per segment (q, k, v; a thread runs one segment, so one
    # search), each iteration one 32-bit load of the cumulative lengths and nothing else
    # that touches memory. Dense: no loop at all.
    loops = backward_loops(sass)
    assert len(loops) == (has_q + 2 * has_kv if varlen else 0), len(loops)
    for body in loops:
        mem = [ins for ins in body if re.search(r"\b(LDG|STG|LD|ST|ATOM|RED)\b", ins)]
        assert len(mem) == 1 and re.search(r"\bLDG\.E\s", mem[0]), mem


def backward_loops(sass):
    """Instruction lists of the loops of a SASS listing: from a label to a later branch
    back to it (the trailing self-branch after EXIT is no loop)."""
    lines = sass.splitlines()
    labels, addr_of_line, pending = {}, {}, []
    for i, line in enumerate(lines):
        m = re.match(r"^(\.L_x_\d+):", line)
        if m:
            pending.append(m.group(1))
            continue
        m = re.search(r"/\*([0-9a-f]{4,})\*/", line)
        if m:
            addr_of_line[i] = int(m.group(1), 16)
            for name in pending:
                labels[name] = i
            pending = []
    loops = []
    for i, line in enumerate(lines):
        m = re.search(r"\bBRA\s+`\((\.L_x_\d+)\)", line)
        if m and i in addr_of_line and m.group(1) in labels:
            start = labels[m.group(1)]
            if addr_of_line[start] < addr_of_line[i]:
                loops.append([lines[j] for j in range(start, i + 1) if j in addr_of_line])
    return loops


# ---------------------------------------------------------------------------------------
# FP8: tokens quantized into an e4m3 / e5m2 cache, fp8 tokens copied or requantized, e4m3 q
# (FP8 attention) rotated with its descale. sm_90a and sm_100a: sm_80 has no fp8
# conversions (append_launcher refuses FP8 below compute capability 8.9).
# ---------------------------------------------------------------------------------------

FP8_ARCHS = ["sm_90a", "sm_100a"]


def fp8_keys(arch):
    """(dtype_name, d, d_v, rotary_dim, interleaved, per_query, has_q, has_kv, paged, idx, leftpad, varlen,
    q, new, cache): every source / destination pair of dtypes, with and without rotary, in
    every cache layout (contiguous, batch idx + leftpad, paged, paged + leftpad) and varlen."""
    from flash_attn_cute.kernels.kv_append import append_key

    specs = [
        ("bf16", 128, 128, 128, False, True, True, True, False, False, False, False, None, None, "e4m3"),
        ("fp16", 64, 128, 32, True, True, True, True, True, False, True, True, None, None, "e5m2"),
        ("bf16", 64, 64, 32, False, False, True, True, False, True, True, False, None, "e4m3", "e4m3"),
        ("bf16", 128, 64, 0, False, False, False, True, True, False, False, False, None, "e5m2", "e5m2"),
        ("bf16", 128, 128, 64, True, True, True, True, True, False, False, True, "e4m3", "e4m3", "e4m3"),
        ("fp16", 128, 128, 128, False, True, True, True, False, False, False, False, "e4m3", None, "e4m3"),
        ("bf16", 128, 128, 0, False, False, False, False, True, False, True, False, None, None, "e4m3"),
    ]
    return [append_key(arch, *spec) for spec in specs]


@pytest.fixture(scope="module")
def fp8_artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv_append_fp8_artifacts")
    out = {}
    for arch in FP8_ARCHS:
        entries = [(entry_name(k), "flash_attn_cute.kernels.kv_append:compile_append", k) for k in fp8_keys(arch)]
        out[arch] = compile_entries(arch, entries, root)
    return out


def fp8_parts(key):
    """(q, new k / v, cache) dtype names of a key (its 16-bit name where not fp8)."""
    names = key[2].split("/")
    return tuple(names[1:]) if len(names) == 4 else (names[0],) * 3


@pytest.mark.parametrize("arch,key", [(a, k) for a in FP8_ARCHS for k in fp8_keys(a)],
                         ids=[f"{a}-{entry_name(k)}" for a in FP8_ARCHS for k in fp8_keys(a)])
@pytest.mark.slow
def test_fp8_cubin_and_sass(fp8_artifacts, arch, key):
    d = fp8_artifacts[arch][0] / entry_name(key)
    cubins = list(d.glob(f"*.{arch}.cubin"))
    assert len(cubins) == 1 and cubins[0].read_bytes()[:4] == b"\x7fELF"
    ptx = next(d.glob("*.ptx")).read_text()
    sass_files = list(d.glob("*.sass"))
    if not sass_files:
        pytest.skip("no usable nvdisasm (pip install nvidia-cuda-nvdisasm): no SASS to check")
    sass = sass_files[0].read_text()
    _, _, _, _, _, rd, _, _, has_q, has_kv, _, _, _, _ = key
    q_name, new_name, cache_name = fp8_parts(key)
    fp8 = ("e4m3", "e5m2")
    # What is rounded into fp8 from fp32: 16-bit tokens into the cache, and every rotated fp8
    # row (k from fp8 tokens, e4m3 q); plain fp8 copies are bytes.
    quantize_kv = has_kv and cache_name in fp8 and (new_name not in fp8 or rd > 0)
    quantize_q = has_q and q_name in fp8
    for name, quantized in ((cache_name, quantize_kv), (q_name, quantize_q)):
        if quantized:
            assert f"F2FP.SATFINITE.{name.upper()}.F32.PACK" in sass, name
            assert f"cvt.rn.satfinite.{name}x2.f32" in ptx  # round to nearest even, saturating
    if quantize_kv or quantize_q:
        assert "div.rn.f32" in ptx and "div.approx" not in ptx  # x / descale, IEEE-rounded
    # fp8 sources that are rotated are widened in registers first.
    if (has_kv and new_name in fp8 and rd > 0) or quantize_q:
        assert re.search(r"F2FP\.F16\.E[45]M[23]\.UNPACK", sass)
    # fp8 rows move in 64-bit accesses (an 8-value chunk), 16-bit ones in 128-bit.
    if (has_kv and cache_name in fp8) or quantize_q:
        assert re.search(r"\bSTG\.E(\.\w+)*\.64\b", sass)
    if (has_kv and new_name in fp8) or quantize_q:
        assert re.search(r"\bLDG\.E(\.\w+)*\.64\b", sass)
    if (has_kv and new_name not in fp8) or (has_q and q_name not in fp8):
        assert re.search(r"\bLDG\.E(\.\w+)*\.128\b", sass)
    assert not re.search(r"\bSTG\.E(\.\w+)*\.(U16|S16|16|U8|S8|8)\b", sass)
    assert not re.search(r"\b(LDL|STL|LDS|STS)\b", sass)
    # The only subroutine: the slow path of an IEEE division (denormal / huge quotients).
    assert not re.search(r"\bCALL\b", sass) or quantize_kv or quantize_q


@pytest.mark.slow
def test_compile_times_recorded(artifacts):
    for arch, (_, times) in artifacts.items():
        assert times and all(t < 120 for t in times.values()), (arch, times)


# ---------------------------------------------------------------------------------------
# Host side: key, launcher, thread mapping
# ---------------------------------------------------------------------------------------


def test_key_fields_and_normalisation():
    from flash_attn_cute.kernels.kv_append import append_key

    key = append_key("sm_90a", "bf16", 128, 128, 64, True, True, True, True, False, True, False)
    assert key == ("kv_append", "sm_90a", "bf16", 128, 128, 64, True, True, True, True, False, True, False, False)
    # varlen is the last field of every key (dense: False, its default).
    assert append_key("sm_90a", "bf16", 128, 128, 64, True, True, True, True, False, True, False, True) == \
        key[:-1] + (True,)
    # Varlen without q and without new k / v writes metadata only, as dense does: one binary.
    assert append_key("sm_90a", "bf16", 128, 128, 64, True, True, False, False, True, False, False, True) == \
        append_key("sm_90a", "bf16", 128, 128, 64, True, True, False, False, True, False, False, False)
    # Without rotary, interleaving and query positions change nothing: one binary.
    no_rot = {append_key("sm_90a", "bf16", 128, 128, 0, i, p, True, True, False, False, False)
              for i in (True, False) for p in (True, False)}
    assert len(no_rot) == 1
    # Without q, query positions change nothing.
    assert append_key("sm_80", "fp16", 64, 64, 64, False, True, False, True, True, False, False) == \
        append_key("sm_80", "fp16", 64, 64, 64, False, False, False, True, True, False, False)
    with pytest.raises(AssertionError):
        append_key("sm_90a", "bf16", 128, 128, 64, True, True, True, True, True, True, False)


def test_launcher_goes_through_jit_cache(monkeypatch):
    from flash_attn_cute.host import jit_cache
    from flash_attn_cute.kernels import kv_append

    seen = []
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setattr(jit_cache, "get_or_compile", lambda name, key, fn: seen.append((name, key)) or "fn")
    assert kv_append.append_launcher(torch.float16, 128, 64, 32, False, True, True, True, True, False, False) == "fn"
    assert kv_append.append_launcher(torch.float16, 128, 64, 32, False, True, True, True, True, False, False,
                                     varlen=True) == "fn"
    assert seen == [("kv_append", ("kv_append", "sm_90a", "fp16", 128, 64, 32, False, True, True, True, True,
                                   False, False, varlen)) for varlen in (False, True)]


@pytest.mark.parametrize("interleaved", [True, False])
def test_items_cover_every_chunk_once(interleaved):
    """Every (d, rotary_dim): the thread items of a row own each 16-byte chunk exactly
    once, and an item that rotates owns whole pairs."""
    import cutlass

    from flash_attn_cute.kernels.kv_append import KVAppendRotary

    for d in range(16, 513, 16):
        for rd in range(0, d + 1, 16):
            k = KVAppendRotary(cutlass.BFloat16, d, d, rd, interleaved, True, False)
            owned = []
            for j in range(k.items_qk):
                if k.neox and j < k.half:
                    owned += [j, j + k.half]  # channels 8j + e and 8j + e + rd / 2: one pair
                else:
                    owned.append(j + k.half)
                    assert not k.neox or (j + k.half) * k.vec >= rd  # pass-through
            assert sorted(owned) == list(range(d // k.vec)), (d, rd)
            assert k.items_v == d // k.vec


# ---------------------------------------------------------------------------------------
# The references the GPU tests trust, against independent formulations
# ---------------------------------------------------------------------------------------


def rope_tables(seqlen_ro, rotary_dim, dtype=torch.float32):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    angles = torch.arange(seqlen_ro, dtype=torch.float64)[:, None] * inv_freq[None]
    return angles.cos().to(dtype), angles.sin().to(dtype), angles


@pytest.mark.parametrize("interleaved", [True, False])
def test_rotary_ref_is_complex_multiplication(interleaved):
    torch.manual_seed(0)
    b, s, h, d, rd = 2, 5, 3, 64, 32
    cos, sin, angles = rope_tables(20, rd)
    x = torch.randn(b, s, h, d, dtype=torch.float64)
    positions = torch.randint(0, 20, (b, s))
    out = apply_rotary_ref(x, cos, sin, positions, interleaved, rd)
    xr = x[..., :rd]
    pairs = xr.reshape(b, s, h, rd // 2, 2) if interleaved else torch.stack([xr[..., :rd // 2], xr[..., rd // 2:]], -1)
    z = torch.view_as_complex(pairs.contiguous()) * torch.polar(torch.ones_like(angles), angles)[positions][:, :, None]
    zr = torch.view_as_real(z)
    expect = zr.flatten(-2) if interleaved else torch.cat([zr[..., 0], zr[..., 1]], -1)
    torch.testing.assert_close(out[..., :rd], expect.float(), atol=1e-5, rtol=1e-5)
    assert torch.equal(out[..., rd:], x[..., rd:].float())
    # Positions past the table use its last row, negative ones its first.
    far = apply_rotary_ref(x, cos, sin, torch.full((b, s), 99), interleaved, rd)
    last = apply_rotary_ref(x, cos, sin, torch.full((b, s), 19), interleaved, rd)
    assert torch.equal(far, last)
    assert torch.equal(apply_rotary_ref(x, cos, sin, torch.full((b, s), -4), interleaved, rd),
                       apply_rotary_ref(x, cos, sin, torch.zeros(b, s, dtype=torch.long), interleaved, rd))


def test_kv_append_ref_paged_matches_contiguous():
    """The same append through a page table (page size 4, shuffled pages) and into
    contiguous rows (permuted by cache_batch_idx) gives the same sequences."""
    torch.manual_seed(1)
    b, s_new, sq, h, h_kv, d, d_v, ps, max_pages = 3, 6, 2, 4, 2, 32, 16, 4, 5
    cap = ps * max_pages
    cos, sin, _ = rope_tables(64, 16, torch.bfloat16)
    q = torch.randn(b, sq, h, d, dtype=torch.bfloat16)
    k_new = torch.randn(b, s_new, h_kv, d, dtype=torch.bfloat16)
    v_new = torch.randn(b, s_new, h_kv, d_v, dtype=torch.bfloat16)
    seqlens = torch.tensor([0, 7, cap - 2], dtype=torch.int32)  # the last one is partly dropped
    page_table = torch.randperm(b * max_pages).view(b, max_pages).int()
    k_pool = torch.randn(b * max_pages, ps, h_kv, d, dtype=torch.bfloat16)
    v_pool = torch.randn(b * max_pages, ps, h_kv, d_v, dtype=torch.bfloat16)
    inputs = [t.clone() for t in (q, k_new, v_new, k_pool, v_pool, seqlens, page_table)]
    paged = kv_append_ref(q, k_new, v_new, k_pool, v_pool, seqlens, page_table=page_table, rotary_cos=cos,
                          rotary_sin=sin, interleaved=False)
    for before, after in zip(inputs, (q, k_new, v_new, k_pool, v_pool, seqlens, page_table)):
        assert torch.equal(before, after)  # inputs untouched
    perm = torch.tensor([2, 0, 1], dtype=torch.int32)
    k_rows = torch.empty(b, cap, h_kv, d, dtype=torch.bfloat16)
    v_rows = torch.empty(b, cap, h_kv, d_v, dtype=torch.bfloat16)
    k_rows[perm.long()] = gather_paged_kv(k_pool, page_table)
    v_rows[perm.long()] = gather_paged_kv(v_pool, page_table)
    contig = kv_append_ref(q, k_new, v_new, k_rows, v_rows, seqlens, cache_batch_idx=perm, rotary_cos=cos,
                           rotary_sin=sin, interleaved=False)
    assert torch.equal(paged[0], contig[0])
    assert torch.equal(gather_paged_kv(paged[1], page_table), contig[1][perm.long()])
    assert torch.equal(gather_paged_kv(paged[2], page_table), contig[2][perm.long()])
    assert paged[3].tolist() == contig[3].tolist() == [s_new, 7 + s_new, cap]
    assert paged[4] is None and contig[4].tolist() == [2 * cap, 0, cap, 0]
    # Token t of row 1 sits at position 7 + t: rotated with cos / sin row 7 + t.
    for t in range(s_new):
        row = paged[1][page_table[1, (7 + t) // ps], (7 + t) % ps]
        expect = apply_rotary_ref(k_new[1:2, t:t + 1], cos, sin, torch.tensor([[7 + t]]), False, 16)[0, 0]
        assert torch.equal(row, expect.to(torch.bfloat16))


def test_kv_append_ref_metadata_and_positions():
    torch.manual_seed(2)
    b, s_cache, d = 4, 8, 16
    k_cache = torch.randn(3, s_cache, 1, d, dtype=torch.float16)
    v_cache = torch.randn(3, s_cache, 1, d, dtype=torch.float16)
    k_new = torch.randn(b, 3, 1, d, dtype=torch.float16)
    q = torch.randn(b, 2, 2, d, dtype=torch.float16)
    cos, sin, _ = rope_tables(32, d, torch.float16)
    seqlens = torch.tensor([2, 6, -2, 2**31 - 1], dtype=torch.int32)
    leftpad = torch.tensor([1, 9, 0, -3], dtype=torch.int32)
    batch_idx = torch.tensor([2, 0, 7, -1], dtype=torch.int32)
    out = kv_append_ref(q, k_new, k_new, k_cache, v_cache, seqlens, cache_batch_idx=batch_idx,
                        cache_leftpad=leftpad, rotary_cos=cos, rotary_sin=sin, q_positions_per_query=False)
    assert out[3].tolist() == [4, 0, 1, 8]
    assert out[4].tolist() == [2 * 8 + 1, 0 + 8, 2 * 8 + 0, 0, 0]
    # Row 2 (cache_seqlens -2) writes only its last token, at position 0 of cache row 2
    # (batch idx 7 clamped), the slot row 0 (position 2) does not touch.
    assert torch.equal(out[2][2, 0], k_new[2, 2]) and torch.equal(out[2][2, 2], k_new[0, 0])
    # Non-causal: every query of a row at cache_seqlens[b].
    q_rot = out[0]
    same = apply_rotary_ref(q, cos, sin, seqlens.long()[:, None].expand(b, 2), True, d).half()
    assert torch.equal(q_rot, same)
    assert not math.isnan(q_rot.float().sum().item())


# ---------------------------------------------------------------------------------------
# Varlen (packed) references
# ---------------------------------------------------------------------------------------


def cumulative(lengths, first=0):
    return torch.tensor([first] + lengths, dtype=torch.int32).cumsum(0).int()


def test_varlen_rows_ref_is_searchsorted():
    """Monotone cumulative lengths (empty sequences, a first offset, rows past the end,
    entries past the batch): the bisection finds the one sequence holding each row."""
    gen = torch.Generator().manual_seed(3)
    for batch in (1, 2, 3, 7, 64, 1000):
        lengths = (torch.randint(0, 6, (batch,), generator=gen) * torch.randint(0, 2, (batch,), generator=gen))
        for first, extra in ((0, 0), (2, 0), (0, 3)):
            cu = cumulative(lengths.tolist() + [4] * extra, first)  # extra: entries past the batch, ignored
            end = int(cu[batch])
            rows = end + 3
            b, t, found = varlen_rows_ref(cu, batch, rows)
            r = torch.arange(rows)
            assert torch.equal(found, (r >= first) & (r < end)), (batch, first)
            expect = torch.searchsorted(cu[1:batch + 1].long(), r, right=True)
            assert torch.equal(b[found], expect[found])
            assert torch.equal(t[found], (r - cu.long()[expect])[found])
    # No sequence, or a cumulative tensor too short for one: nothing found.
    for cu, batch in ((torch.tensor([0, 4], dtype=torch.int32), 0), (torch.tensor([0], dtype=torch.int32), 3)):
        assert not varlen_rows_ref(cu, batch, 5)[2].any()


def test_varlen_rows_ref_untrusted_lengths():
    """Non-monotone, negative and too large cumulative lengths: a row found for b lies in
    [cu[b], cu[b + 1]), and t is its offset from max(cu[b], 0)."""
    gen = torch.Generator().manual_seed(4)
    for _ in range(200):
        batch = int(torch.randint(1, 12, (1,), generator=gen))
        cu = torch.randint(-6, 40, (batch + 1,), generator=gen, dtype=torch.int32)
        rows = int(torch.randint(0, 30, (1,), generator=gen))
        b, t, found = varlen_rows_ref(cu, batch, rows)
        r = torch.arange(rows)
        c = cu.long()
        assert bool(((b >= 0) & (b < batch)).all())
        assert bool(((c[b] <= r) & (r < c[b + 1]) | ~found).all())
        assert torch.equal(t[found], (r - c[b].clamp(min=0))[found])
        assert bool(((t >= 0) & (t <= r))[found].all())


def varlen_problem(paged, lengths_q, lengths_k, seed):
    """Packed inputs and caches: page size 4 x 4 pages (shuffled) or contiguous rows
    permuted by cache_batch_idx, with leftpad. Start positions: random, one negative,
    one that overflows the capacity (16)."""
    gen = torch.Generator().manual_seed(seed)
    b, h, h_kv, d, d_v, ps, max_pages = len(lengths_k), 3, 2, 32, 16, 4, 4
    cap = ps * max_pages
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(torch.bfloat16)
    q = rnd(sum(lengths_q), h, d)
    k_new, v_new = rnd(sum(lengths_k), h_kv, d), rnd(sum(lengths_k), h_kv, d_v)
    seqlens = torch.tensor([int(torch.randint(0, cap - n + 1, (1,), generator=gen)) for n in lengths_k])
    seqlens[1], seqlens[2] = -2, cap - 1  # partly before the cache; partly past its end
    kw = {}
    if paged:
        kw["page_table"] = torch.randperm(b * max_pages, generator=gen).view(b, max_pages).int()
        rows = b * max_pages + 1
    else:
        kw["cache_batch_idx"] = torch.randperm(b + 2, generator=gen)[:b].int()
        kw["cache_leftpad"] = torch.randint(0, 5, (b,), generator=gen).int()
        rows = b + 2
    k_cache, v_cache = rnd(rows, ps if paged else cap, h_kv, d), rnd(rows, ps if paged else cap, h_kv, d_v)
    return q, k_new, v_new, k_cache, v_cache, seqlens.int(), kw


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("per_query", [False, True])
def test_kv_append_ref_varlen_is_dense_per_sequence(paged, per_query):
    """Ragged packed rows (empty sequences, one-token rows, q lengths other than the new
    k / v lengths) against one dense call per sequence, applied one after another."""
    lengths_q = [1, 1, 5, 0, 2, 3, 1]
    lengths_k = [0, 3, 5, 1, 1, 4, 1]
    q, k_new, v_new, k_cache, v_cache, seqlens, kw = varlen_problem(paged, lengths_q, lengths_k, 5)
    cos, sin, _ = rope_tables(40, 16, torch.bfloat16)
    rot = dict(rotary_cos=cos, rotary_sin=sin, interleaved=paged, q_positions_per_query=per_query)
    cu_q, cu_k = cumulative(lengths_q), cumulative(lengths_k)
    out = kv_append_ref(q, k_new, v_new, k_cache, v_cache, seqlens, cu_seqlens_q=cu_q, cu_seqlens_k_new=cu_k,
                        **kw, **rot)
    k_now, v_now = k_cache, v_cache
    for b in range(len(lengths_k)):
        one = {name: x[b:b + 1] for name, x in kw.items()}
        if not paged:
            one.setdefault("cache_batch_idx", torch.tensor([b], dtype=torch.int32))
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        dense = kv_append_ref(q[None, qs], k_new[None, ks], v_new[None, ks], k_now, v_now, seqlens[b:b + 1], **one,
                              **rot)
        assert torch.equal(out[0][qs], dense[0][0]), b
        assert out[3][b] == dense[3][0]
        if out[4] is not None:
            assert out[4][b] == dense[4][0]
        k_now, v_now = dense[1], dense[2]
    assert torch.equal(out[1], k_now) and torch.equal(out[2], v_now)
    assert not torch.equal(out[1], k_cache)  # something was written
    if out[4] is not None:
        assert out[4][-1] == 0


def test_kv_append_ref_varlen_equal_lengths_is_dense():
    """Every sequence 3 tokens, the same cumulative tensor for q and new k / v: exactly
    the dense result, fp32 (upcast) too."""
    q, k_new, v_new, k_cache, v_cache, seqlens, kw = varlen_problem(True, [3] * 5, [3] * 5, 6)
    cos, sin, _ = rope_tables(40, 32, torch.bfloat16)
    cu = cumulative([3] * 5)
    for upcast in (False, True):
        args = dict(kw, rotary_cos=cos, rotary_sin=sin, interleaved=False, upcast=upcast)
        packed = kv_append_ref(q, k_new, v_new, k_cache, v_cache, seqlens, cu_seqlens_q=cu, cu_seqlens_k_new=cu,
                               **args)
        dense = kv_append_ref(q.view(5, 3, *q.shape[1:]), k_new.view(5, 3, *k_new.shape[1:]),
                              v_new.view(5, 3, *v_new.shape[1:]), k_cache, v_cache, seqlens, **args)
        assert torch.equal(packed[0], dense[0].flatten(0, 1))
        for x, y in zip(packed[1:4], dense[1:4]):
            assert torch.equal(x, y)


def test_kv_append_ref_varlen_untrusted_lengths():
    """Non-monotone cumulative lengths, some past the rows: only rows found by the
    search are written (others: q_rot NaN, cache untouched), seqused counts the clamped,
    non-negative lengths."""
    q, k_new, v_new, k_cache, v_cache, seqlens, kw = varlen_problem(False, [2] * 6, [2] * 6, 7)
    seqlens = torch.tensor([0, 3, 5, 0, 2, 1], dtype=torch.int32)
    total = k_new.shape[0]  # 12
    cu = torch.tensor([2, 5, 3, 9, 10, 40, -2], dtype=torch.int32)  # rows 0, 1 in no sequence
    cos, sin, _ = rope_tables(40, 16, torch.bfloat16)
    out = kv_append_ref(q, k_new, v_new, k_cache, v_cache, seqlens, cu_seqlens_q=cu, cu_seqlens_k_new=cu,
                        rotary_cos=cos, rotary_sin=sin, **kw)
    b, t, found = varlen_rows_ref(cu, 6, total)
    assert found.any() and not found.all()
    assert torch.isnan(out[0][~found].float()).all() and not torch.isnan(out[0][found].float()).any()
    c = cu.long().clamp(0, total)
    n_new = (c[1:] - c[:-1]).clamp(min=0)
    assert out[3].tolist() == (seqlens.long() + n_new).clamp(0, k_cache.shape[1]).sub(
        torch.minimum(kw["cache_leftpad"].long(), (seqlens.long() + n_new).clamp(0, k_cache.shape[1]))).tolist()
    written = set()
    for r in found.nonzero()[:, 0].tolist():
        p = int(seqlens[b[r]] + t[r])
        written.add((int(kw["cache_batch_idx"][b[r]]), p))
        assert torch.equal(out[2][int(kw["cache_batch_idx"][b[r]]), p], v_new[r])
    changed = {tuple(i) for i in (out[2] != v_cache).any(-1).any(-1).nonzero().tolist()}
    assert changed <= written and len(written) == int(found.sum())


# ---------------------------------------------------------------------------------------
# FP8 and paged-leftpad references
# ---------------------------------------------------------------------------------------


def test_quantize_ref_rounds_to_nearest_even_and_saturates():
    e4m3 = torch.tensor([1.0625, 1.1875, 448.0, 464.0, 1e6, -1e9, 2.0**-10, 3 * 2.0**-10])
    assert quantize_ref(e4m3, torch.float8_e4m3fn).float().tolist() == [1.0, 1.25, 448.0, 448.0, 448.0, -448.0,
                                                                        0.0, 2.0**-8]
    e5m2 = torch.tensor([61440.0, 1e6, -1e6, 1.125, 1.375])
    assert quantize_ref(e5m2, torch.float8_e5m2).float().tolist() == [57344.0, 57344.0, -57344.0, 1.0, 1.5]
    assert torch.isnan(quantize_ref(torch.tensor([float("nan")]), torch.float8_e4m3fn).float()).all()


def _fp8_problem(seed, paged, token_dtype, cache_dtype=torch.float8_e4m3fn):
    g = torch.Generator().manual_seed(seed)
    b, s_new, h, h_kv, d = 3, 4, 4, 2, 32
    rnd = lambda *shape, dtype=torch.bfloat16: (torch.randn(*shape, generator=g) * 3).to(dtype)
    q = rnd(b, 1, h, d)
    k_new, v_new = rnd(b, s_new, h_kv, d, dtype=token_dtype), rnd(b, s_new, h_kv, d, dtype=token_dtype)
    shape = (10, 4, h_kv, d) if paged else (b, 16, h_kv, d)
    k_cache, v_cache = rnd(*shape, dtype=cache_dtype), rnd(*shape, dtype=cache_dtype)
    kw = dict(page_table=torch.randperm(10, generator=g)[:9].view(3, 3).int()) if paged else {}
    seqlens = torch.tensor([0, 5, 9], dtype=torch.int32)
    kd, vd = torch.rand(b, h_kv, generator=g) + 0.25, torch.tensor([0.5])
    return q, k_new, v_new, k_cache, v_cache, seqlens, kw, kd, vd


@pytest.mark.parametrize("paged", [False, True])
def test_kv_append_ref_fp8_is_the_16bit_append_quantized(paged):
    """16-bit tokens into an FP8 cache: the fp32 (upcast) append into a 16-bit copy of the
    cache, each written slot divided by its (b, h_kv) descale and rounded (``quantize_ref``);
    every other slot's bytes untouched."""
    q, k_new, v_new, k_cache, v_cache, seqlens, kw, kd, vd = _fp8_problem(8, paged, torch.bfloat16)
    cos, sin, _ = rope_tables(32, 16, torch.bfloat16)
    rot = dict(rotary_cos=cos, rotary_sin=sin, interleaved=False)
    out = kv_append_ref(q, k_new, v_new, k_cache, v_cache, seqlens, k_descale=kd, v_descale=vd, **kw, **rot)
    up = kv_append_ref(q, k_new, v_new, k_cache, v_cache, seqlens, k_descale=kd, v_descale=vd, upcast=True, **kw,
                       **rot)
    # The same append into a 16-bit cache (fp32 values), then the quantization by hand.
    ref32 = kv_append_ref(q, k_new, v_new, k_cache.float(), v_cache.float(), seqlens, upcast=True, **kw, **rot)
    nan_k = torch.full_like(k_new, float("nan"))
    placed = kv_append_ref(None, nan_k, nan_k, k_cache.float(), v_cache.float(), seqlens, **kw)[1]
    written = torch.isnan(placed)
    rows = torch.arange(k_cache.shape[0])
    if paged:  # the batch row of each page, for its descale
        owner = torch.full((k_cache.shape[0],), 0)
        owner[kw["page_table"].flatten().long()] = torch.arange(3).repeat_interleave(3)
        rows = owner
    kd_rows = kd[rows][:, None, :, None]
    for got, got32, ref, scale in ((out[1], up[1], ref32[1], kd_rows), (out[2], up[2], ref32[2], vd)):
        expect32 = torch.where(written, ref / scale, got32)
        assert torch.equal(got32, expect32)
        expect = torch.where(written, quantize_ref(ref / scale, got.dtype).float(), got.float())
        assert torch.equal(got.float(), expect)
    untouched = ~written
    assert torch.equal(out[1].view(torch.uint8)[untouched], k_cache.view(torch.uint8)[untouched])
    assert torch.equal(out[2].view(torch.uint8)[untouched], v_cache.view(torch.uint8)[untouched])
    assert torch.equal(out[0], ref32[0].to(torch.bfloat16))  # 16-bit q: rotated as before


def test_kv_append_ref_fp8_tokens():
    """Tokens already in the cache's fp8 dtype: v (and k without rotary) copied byte for
    byte; k with rotary: its rotated channels dequantized, rotated in fp32 and requantized
    with k_descale, its other channels copied."""
    q, k_new, v_new, k_cache, v_cache, seqlens, kw, kd, vd = _fp8_problem(9, False, torch.float8_e5m2,
                                                                          torch.float8_e5m2)
    plain = kv_append_ref(None, k_new, v_new, k_cache, v_cache, seqlens, k_descale=kd, v_descale=vd)
    for b in range(3):
        p = slice(int(seqlens[b]), int(seqlens[b]) + k_new.shape[1])
        assert torch.equal(plain[1][b, p].view(torch.uint8), k_new[b].view(torch.uint8))
        assert torch.equal(plain[2][b, p].view(torch.uint8), v_new[b].view(torch.uint8))
    cos, sin, _ = rope_tables(32, 16, torch.bfloat16)
    rot = kv_append_ref(None, k_new, v_new, k_cache, v_cache, seqlens, k_descale=kd, v_descale=vd, rotary_cos=cos,
                        rotary_sin=sin)
    assert torch.equal(rot[2].view(torch.uint8), plain[2].view(torch.uint8))
    for b in range(3):
        p = slice(int(seqlens[b]), int(seqlens[b]) + k_new.shape[1])
        pos = torch.arange(p.start, p.stop)[None]
        x = k_new[b:b + 1].float() * kd[b][None, None, :, None]
        expect = quantize_ref(apply_rotary_ref(x, cos, sin, pos, True, 16) / kd[b][None, None, :, None],
                              torch.float8_e5m2)[0]
        assert torch.equal(rot[1][b, p, :, :16].view(torch.uint8), expect[..., :16].view(torch.uint8))
        assert torch.equal(rot[1][b, p, :, 16:].view(torch.uint8), k_new[b, :, :, 16:].view(torch.uint8))


def test_kv_append_ref_fp8_queries():
    """e4m3 q (FP8 attention): rotated channels dequantized with q_descale of the head's KV
    head, rotated, requantized; the others copied."""
    g = torch.Generator().manual_seed(10)
    q = (torch.randn(2, 3, 4, 32, generator=g) * 4).to(torch.float8_e4m3fn)
    cache = torch.zeros(2, 16, 2, 32, dtype=torch.float8_e4m3fn)
    qd = torch.tensor([[0.5, 2.0], [1.5, 0.25]])
    cos, sin, _ = rope_tables(32, 16, torch.bfloat16)
    seqlens = torch.tensor([3, 7], dtype=torch.int32)
    out = kv_append_ref(q, None, None, cache, cache, seqlens, rotary_cos=cos, rotary_sin=sin, q_descale=qd)[0]
    assert out.dtype == torch.float8_e4m3fn
    scale = qd.repeat_interleave(2, dim=1)[:, None, :, None]  # heads 0, 1 -> KV head 0; 2, 3 -> 1
    pos = seqlens.long()[:, None] + torch.arange(3)[None]
    expect = quantize_ref(apply_rotary_ref(q.float() * scale, cos, sin, pos, True, 16) / scale, torch.float8_e4m3fn)
    assert torch.equal(out[..., :16].view(torch.uint8), expect[..., :16].view(torch.uint8))
    assert torch.equal(out[..., 16:].view(torch.uint8), q[..., 16:].view(torch.uint8))


def test_attention_kvcache_ref_leftpad_is_a_shifted_cache():
    """Keys [leftpad, end) of a paged cache are the keys [0, end - leftpad) of the cache
    shifted by leftpad: the masks align to the bottom-right of the relative length."""
    g = torch.Generator().manual_seed(11)
    b, ps, pages, h, d = 3, 4, 5, 2, 16
    pool = torch.randn(b * pages, ps, h, d, generator=g)
    vpool = torch.randn(b * pages, ps, h, d, generator=g)
    table = torch.randperm(b * pages, generator=g).view(b, pages).int()
    q = torch.randn(b, 3, h, d, generator=g)
    lens, leftpad = torch.tensor([20, 9, 5]), torch.tensor([3, 0, 5])
    out, lse = attention_kvcache_ref(q, pool, vpool, lens, page_table=table, cache_leftpad=leftpad, causal=True)
    dense_k, dense_v = gather_paged_kv(pool, table), gather_paged_kv(vpool, table)
    for i in range(b):
        lo, hi = int(leftpad[i]), int(lens[i])
        o, l_ = attention_kvcache_ref(q[i:i + 1], dense_k[i:i + 1, lo:], dense_v[i:i + 1, lo:],
                                      torch.tensor([hi - lo]), causal=True)
        assert torch.allclose(out[i], o[0], atol=1e-6) and torch.equal(torch.isinf(lse[i]), torch.isinf(l_[0]))
    assert torch.isinf(lse[2]).all()  # leftpad == length: no key
