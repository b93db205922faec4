"""CPU tests of the KV-append + rotary kernel: compiles, SASS, key, mapping, reference.

Each arch compiles a covering subset of the key space in its own subprocess through
tests/compile_harness.py; the SASS it keeps is then checked for what the design relies
on: every byte of q / k / v moves through 128-bit loads and stores, nothing spills, no
shared memory. The fp32 references of flash_attn_cute.testing (which the GPU tests trust)
are checked here against independent formulations.
"""

import concurrent.futures
import itertools
import math
import os
import re

import pytest
import torch
from compile_harness import compile_entries, covering_subset

from flash_attn_cute.testing import apply_rotary_ref, gather_paged_kv, kv_append_ref

# sm_80: the lowest supported arch; sm_90a: the main target (H200); sm_100a: Blackwell.
ARCHS = ["sm_80", "sm_90a", "sm_100a"]

# (rotary_dim, interleaved): none, GPT-J and GPT-NeoX over every channel of d = 64, and
# both over fewer channels than d (pass-through tail).
ROTARY = [(0, False), (64, True), (64, False), (32, True), (32, False)]


def key_space(arch):
    """Every flag combination the kernel accepts, over fp16 / bf16 and (d, d_v) in
    (64, 128), (128, 64): paged caches take neither batch idx nor leftpad."""
    from flash_attn_cute.kv_append import append_key

    keys = set()
    for dtype, (d, d_v), (rd, inter), per_query, has_q, has_kv, paged, idx, leftpad in itertools.product(
            ["fp16", "bf16"], [(64, 128), (128, 64)], ROTARY, [True, False], [True, False], [True, False],
            [True, False], [True, False], [True, False]):
        if paged and (idx or leftpad):
            continue
        keys.add(append_key(arch, dtype, d, d_v, rd, inter, per_query, has_q, has_kv, paged, idx, leftpad))
    return keys


def entry_name(key):
    _, _, dtype, d, d_v, rd, inter, per_query, has_q, has_kv, paged, idx, leftpad = key
    rot = "norot" if rd == 0 else f"{'gptj' if inter else 'neox'}{rd}"
    flags = [n for n, f in (("perq", per_query), ("q", has_q), ("kv", has_kv), ("paged", paged), ("idx", idx),
                            ("leftpad", leftpad)) if f]
    return "_".join([dtype, f"d{d}x{d_v}", rot] + flags)


def rotary_kind(key):
    return "none" if key[5] == 0 else "gptj" if key[6] else "neox"


def entries(arch):
    """A covering subset of the key space: every value of every field, and every rotary
    kind with every (q, new kv) combination and with both cache kinds (the branches that
    change the code most) and with both cache kinds, with and without new kv. Field 1 (the arch) is the same for all."""
    combos = {k + ((rotary_kind(k), k[8], k[9]), (rotary_kind(k), k[9], k[10])): k for k in key_space(arch)}
    return [(entry_name(combos[c]), "flash_attn_cute.kv_append:compile_append", combos[c])
            for c in covering_subset(combos, fixed_fields=2)]


def test_covering_subset_spans_every_value():
    chosen = [k for *_, k in entries("sm_90a")]
    assert len(chosen) <= 16
    for i in range(2, 13):
        assert {k[i] for k in chosen} == {k[i] for k in key_space("sm_90a")}, i
    assert {(rotary_kind(k), k[8], k[9]) for k in chosen} == {(r, q, kv) for r in ("none", "gptj", "neox")
                                                               for q in (True, False) for kv in (True, False)}
    assert {(rotary_kind(k), k[9], k[10]) for k in chosen} == {(r, kv, p) for r in ("none", "gptj", "neox")
                                                                for kv in (True, False) for p in (True, False)}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """{arch: (artifact dir, {entry: compile seconds})}; archs in parallel given the cores."""
    root = tmp_path_factory.mktemp("kv_append_artifacts")
    workers = len(ARCHS) if (os.cpu_count() or 1) >= 6 else 1
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = {arch: pool.submit(compile_entries, arch, entries(arch), root) for arch in ARCHS}
        result = {arch: f.result() for arch, f in futures.items()}
    for arch, (_, times) in result.items():
        print(f"\n{arch} compile seconds: " + ", ".join(f"{k} {v:.2f}" for k, v in times.items()))
    return result


def all_entries():
    return [(arch, name, key) for arch in ARCHS for name, _, key in entries(arch)]


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
    _, _, _, _, _, rd, interleaved, _, has_q, has_kv, _, _, _ = key
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
    # No local memory (spills) and no shared memory.
    assert not re.search(r"\b(LDL|STL|LDS|STS)\b", sass)


def test_compile_times_recorded(artifacts):
    for arch, (_, times) in artifacts.items():
        assert times and all(t < 120 for t in times.values()), (arch, times)


# ---------------------------------------------------------------------------------------
# Host side: key, launcher, thread mapping
# ---------------------------------------------------------------------------------------


def test_key_fields_and_normalisation():
    from flash_attn_cute.kv_append import append_key

    key = append_key("sm_90a", "bf16", 128, 128, 64, True, True, True, True, False, True, False)
    assert key == ("kv_append", "sm_90a", "bf16", 128, 128, 64, True, True, True, True, False, True, False)
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
    from flash_attn_cute import jit_cache, kv_append

    seen = []
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setattr(jit_cache, "get_or_compile", lambda name, key, fn: seen.append((name, key)) or "fn")
    assert kv_append.append_launcher(torch.float16, 128, 64, 32, False, True, True, True, True, False, False) == "fn"
    assert seen == [("kv_append", ("kv_append", "sm_90a", "fp16", 128, 64, 32, False, True, True, True, True,
                                   False, False))]


@pytest.mark.parametrize("interleaved", [True, False])
def test_items_cover_every_chunk_once(interleaved):
    """Every (d, rotary_dim): the thread items of a row own each 16-byte chunk exactly
    once, and an item that rotates owns whole pairs."""
    import cutlass

    from flash_attn_cute.kv_append import KVAppendRotary

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
