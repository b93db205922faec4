"""Compile-only tests of every forward backend, for each arch it targets: no GPU needed.

The keys come from the GPU sweep itself (``test_flash_attn_gpu.compile_keys``: the
backend's own plan on the sweep's problems); a covering subset of them, in which every
value of every key field appears, is compiled through tests/compile_harness.py. The SASS
is then checked for the instructions each kernel is built from, and for spills.
"""

import re

import pytest
import torch
from compile_harness import compile_entries, covering_subset
from test_flash_attn_gpu import compile_keys

from flash_attn_cute import fwd

BF16 = torch.bfloat16

# The archs each backend is compiled for: its own, and the H200 it is tested on.
ARCHS = {"sm80": ["sm_80", "sm_90a"], "sm90": ["sm_90a"], "sm100": ["sm_100a"]}
# Instructions each backend's SASS must hold.
SASS_EXPECT = {
    "sm80": ["HMMA.16816.F32", "LDSM", "LDGSTS", "MUFU.EX2"],  # mma.sync from ldmatrix, cp.async loads
    "sm90": ["HGMMA", "MUFU.EX2"],  # wgmma (its loads depend on the key: sm90_loads)
    # tcgen05.mma (f16 kind), tcgen05.ld/st of TMEM, TMA, tcgen05.commit
    "sm100": ["UTCHMMA", "LDTM", "STTM", "UTMALDG", "UTCBAR", "MUFU.EX2"],
}
# Instructions a backend's SASS must not hold: the SM100 kernel's tensor-core work is all tcgen05.
SASS_FORBID = {"sm100": [r"\bHMMA\b"]}


def spill_bound(backend, key):
    """Local-memory instructions a key may have. SM80: unbounded (its d128 tile spills a
    little by design, RESULTS.md). SM90: none, except d=64 with a mask (three consumer
    warpgroups at 160 registers each spill a few scalars in the masked-block loop only;
    the unmasked loop is clean), and paged keys whose KV rows are gathered: bounded so
    they cannot grow."""
    if backend == "sm80":
        return None
    if backend == "sm90" and key[3] <= 64 and (key[9][0] or key[9][1]):
        return 40
    if backend == "sm90" and key[17]:
        return 4  # a gathering producer at 40 registers keeps one value on the stack per block
    return 0
CASES = [(b, a) for b in sorted(fwd.BACKENDS) for a in ARCHS[b]]


def sm100_extra_keys(arch):
    """Beyond the sweep's covering subset: a contiguous KV cache (seqused_k, not paged) in
    decode shape (packed GQA, split, q_stage 1), whose last KV block's tail V rows the
    kernel zeroes (the covering subset reaches that code only through a paged key)."""
    module = fwd.backend_module("sm100")
    problem = fwd.FwdProblem(dtype=BF16, batch=2, max_seqlen_q=1, max_seqlen_k=4096, nheads=32, nheads_kv=8, d=128,
                             d_v=128, softmax_scale=128 ** -0.5, causal=False, window_left=-1, window_right=-1,
                             softcap=0.0, varlen_q=False, varlen_k=False, has_seqused_k=True, page_size=0,
                             has_lse=True)
    return [module.compile_key(problem, module.plan(problem, 3, True, 148), arch)]


EXTRA_KEYS = {"sm100": sm100_extra_keys}


def sm100_cache_tail_zeroed(key) -> bool:
    """Whether an SM100 key reads a KV cache (seqused_k or paged), where V rows past the
    length are zeroed in smem before P V: 16-bit shared stores the other keys never emit."""
    return key[14] or key[15]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    cache = {}

    def get(backend, arch):
        if (backend, arch) not in cache:
            keys = covering_subset(compile_keys(backend, arch)[0])
            keys += [k for k in EXTRA_KEYS.get(backend, lambda a: [])(arch) if k not in keys]
            entries = [(f"k{i}", f"flash_attn_cute.{backend}:compile", key) for i, key in enumerate(keys)]
            root = tmp_path_factory.mktemp(f"{backend}_{arch}")
            cache[backend, arch] = keys, *compile_entries(arch, entries, root)
        return cache[backend, arch]

    return get


@pytest.mark.parametrize("backend,arch", CASES)
def test_forward_compiles(artifacts, backend, arch):
    keys, out_dir, seconds = artifacts(backend, arch)
    assert len(keys) >= 4, keys  # the sweep's key fields take several values each
    print(f"\n{backend} {arch}: {len(keys)} keys, " + ", ".join(f"{v:.1f}s" for v in seconds.values()))
    for i, key in enumerate(keys):
        cubins = list((out_dir / f"k{i}").glob(f"*.{arch}.cubin"))
        assert len(cubins) == 1 and cubins[0].read_bytes()[:4] == b"\x7fELF", key


@pytest.mark.parametrize("backend,arch", CASES)
def test_forward_sass(artifacts, backend, arch):
    keys, out_dir, _ = artifacts(backend, arch)
    for i, key in enumerate(keys):
        sass_files = list((out_dir / f"k{i}").glob("*.sass"))
        if not sass_files:
            pytest.skip("no usable nvdisasm (pip install nvidia-cuda-nvdisasm): no SASS to check")
        sass = sass_files[0].read_text()
        for op in SASS_EXPECT[backend]:
            assert op in sass, (op, key)
        for pattern in SASS_FORBID.get(backend, []):
            assert not re.search(pattern, sass), (pattern, key)
        if backend == "sm100":
            assert ("STS.U16" in sass) == sm100_cache_tail_zeroed(key), ("V tail zeroing", key)
        bound = spill_bound(backend, key)
        spills = len(re.findall(r"\b(LDL|STL)\b", sass))
        assert bound is None or spills <= bound, ("local-memory spill", spills, key)
        if backend == "sm90":
            for op in sm90_loads(key):
                assert op in sass, (op, key)


def sm90_loads(key):
    """The SM90 kernel's load instructions for a key: TMA for Q (unpacked) and for KV
    (unless paged rows are gathered); cp.async for packed-GQA Q rows and for gathered KV
    rows, whose stages complete through cp.async mbarrier arrives."""
    pack, gather_kv = key[10], key[17]
    ops = ["LDGSTS"] if pack > 1 or gather_kv else []
    if pack == 1 or not gather_kv:
        ops.append("UTMALDG")
    if gather_kv:
        ops.append("ARRIVES.LDGSTSBAR")
    return ops


def test_plan_is_what_the_launcher_compiles():
    # compile_key(problem, plan) is the whole identity of a binary: a different tile,
    # pack or split decision yields a different key.
    from test_validation import _problem

    module = fwd.backend_module("sm80")
    decode = _problem(nheads=32, nheads_kv=8, max_seqlen_k=131072, has_seqused_k=True)
    plan = module.plan(decode, 0, None, 132)
    assert plan.pack_gqa and plan.num_splits > 1 and plan.config.tile_m == 64
    key = module.compile_key(decode, plan, "sm_90a")
    assert key[1] == "sm_90a" and module.compile_key(decode, plan._replace(num_splits=1), "sm_90a") != key
    assert module.plan(decode, 1, False, None).num_splits == 1
