"""CPU compile tests of the split-KV combine kernel: no GPU, runs in CI.

Each arch compiles in its own subprocess through tests/compile_harness.py; the artifacts
it keeps (PTX, cubin and, when nvdisasm is installed, SASS) are then checked here for the
instructions the design relies on.
"""

import re

import pytest
from compile_harness import compile_archs

# sm_80: the lowest supported arch (cp.async needs it); sm_90a: the main target. Each arch is
# a separate compile target with its own SASS, so each is checked on its own.
ARCHS = ["sm_80", "sm_90a"]
# Every output dtype: 16-bit outputs pack with F2FP and give 8 elements (two 128-bit partial
# copies) per thread, fp32 gives 4 (one copy): different thread counts and code paths.
DTYPES = ["fp16", "bf16", "fp32"]
# 64: one column block covers the row (64 threads for 16-bit outputs); 128: the common case;
# 256: two column blocks along grid.y.
HEAD_DIMS_V = [64, 128, 256]
# The LSE output is a const_expr branch: both the kernel with it and the one without.
WITH_LSE = [True, False]
# The learnable sink (one logit per head) likewise.
WITH_SINK = [False, True]

CONFIGS = [(d, v, lse, sink) for d in DTYPES for v in HEAD_DIMS_V for lse in WITH_LSE for sink in WITH_SINK]


def config_name(dtype, head_dim_v, with_lse, with_sink=False):
    return f"{dtype}_d{head_dim_v}_{'lse' if with_lse else 'nolse'}" + ("_sink" if with_sink else "")


def entries(arch):
    from flash_attn_cute.kernels.combine import combine_key

    return [(config_name(*c), "flash_attn_cute.kernels.combine:compile_combine", combine_key(*c[:3], arch, has_sink=c[3]))
            for c in CONFIGS]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """{arch: (artifact dir, {entry: compile seconds})} (``compile_harness.compile_archs``)."""
    return compile_archs(ARCHS, entries, tmp_path_factory.mktemp("combine_artifacts"))


def config_dir(artifacts, arch, dtype, head_dim_v, with_lse, with_sink=False):
    return artifacts[arch][0] / config_name(dtype, head_dim_v, with_lse, with_sink)


@pytest.mark.slow
@pytest.mark.parametrize("with_sink", WITH_SINK)
@pytest.mark.parametrize("with_lse", WITH_LSE)
@pytest.mark.parametrize("head_dim_v", HEAD_DIMS_V)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_cubin_and_ptx(artifacts, arch, dtype, head_dim_v, with_lse, with_sink):
    d = config_dir(artifacts, arch, dtype, head_dim_v, with_lse, with_sink)
    cubins = list(d.glob(f"*.{arch}.cubin"))
    assert len(cubins) == 1, sorted(p.name for p in d.iterdir())
    assert cubins[0].read_bytes()[:4] == b"\x7fELF"
    ptx = next(d.glob("*.ptx")).read_text()
    assert re.search(rf"^\.target\s+{arch}\b", ptx, re.M)
    # O partial: 16-byte cp.async bypassing L1 (.cg); LSE partial: 4-byte cp.async.
    assert re.search(r"cp\.async\.cg\.shared\.global(\.\w+)*\s+\[[^]]+\],\s*\[[^]]+\],\s*16", ptx)
    assert re.search(r"cp\.async\.ca\.shared\.global(\.\w+)*\s+\[[^]]+\],\s*\[[^]]+\],\s*4", ptx)


@pytest.mark.slow
@pytest.mark.parametrize("with_sink", WITH_SINK)
@pytest.mark.parametrize("with_lse", WITH_LSE)
@pytest.mark.parametrize("head_dim_v", HEAD_DIMS_V)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_sass(artifacts, arch, dtype, head_dim_v, with_lse, with_sink):
    sass_files = list(config_dir(artifacts, arch, dtype, head_dim_v, with_lse, with_sink).glob("*.sass"))
    if not sass_files:
        pytest.skip("no usable nvdisasm (pip install nvidia-cuda-nvdisasm): no SASS to check")
    sass = sass_files[0].read_text()
    # Every O partial byte arrives through 128-bit LDGSTS (cp.async.cg), e.g.
    # LDGSTS.E.BYPASS.LTC128B.128; the only synchronous global load is a row's sink.
    assert re.search(r"\bLDGSTS\.E\.BYPASS(\.\w+)*\.128\b", sass)
    assert bool(re.search(r"\bLDG\.E", sass)) == with_sink
    assert "DEPBAR" in sass  # cp.async.wait_group
    # O is written with 128-bit stores only; the only other store is the 32-bit LSE.
    assert re.search(r"\bSTG\.E\.128\b", sass)
    assert not re.search(r"\bSTG\.E\.(64|U16|16|U8|8)\b", sass)
    assert bool(re.search(r"\bSTG\.E\s", sass)) == with_lse
    # Scales exp2 on the MUFU; the log of the sum (MUFU.LG2) only exists for the LSE output.
    assert "MUFU.EX2" in sass
    assert ("MUFU.LG2" in sass) == with_lse
    # No register spills.
    assert not re.search(r"\b(LDL|STL)\b", sass)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tile_config_every_head_dim(dtype):
    """Static invariants the kernel relies on, for every supported d_v (multiples of 8 up to 512)."""
    import cutlass

    from flash_attn_cute.kernels.combine import FlashAttnCombine

    cute_dtype = {"fp16": cutlass.Float16, "bf16": cutlass.BFloat16, "fp32": cutlass.Float32}[dtype]
    for head_dim_v in range(8, 513, 8):
        k = FlashAttnCombine(cute_dtype, head_dim_v)
        assert k.vec * cute_dtype.width == 128  # one 128-bit store per thread
        assert 32 % k.threads_per_row == 0  # a row's lanes never straddle warps
        assert k.num_threads % 32 == 0  # full warps: full-mask shuffles and warp syncs
        assert k.k_block % k.vec == 0 and head_dim_v % k.vec == 0
        # the column blocks cover d_v and only the last one is partial
        n_blocks = -(-head_dim_v // k.k_block)
        assert (n_blocks - 1) * k.k_block < head_dim_v <= n_blocks * k.k_block
        assert k.is_even_k == (head_dim_v % k.k_block == 0)


def test_compile_is_keyed_by_arch_from_env(monkeypatch):
    from flash_attn_cute.kernels.combine import combine_key, target_arch

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_80")
    assert target_arch() == "sm_80"
    assert combine_key("bf16", 128, True, target_arch()) == ("combine", "bf16", 128, True, False, "sm_80")
    assert combine_key("bf16", 128, True, target_arch(), has_sink=True) == ("combine", "bf16", 128, True, True, "sm_80")

