"""Compile-only tests of the MLA decode kernels: the SM80 kernel for sm_80 (A100), sm_90a
(the H200 it is tested on) and sm_100a (B200, where MLA runs on it), the SM90 kernel for
sm_90a; no GPU needed. A covering subset of the
GPU tests' keys (nheads 16/32/64/128, dtype, causal, split, LSE and split layout value once:
even splits, and the batch-invariant 128 blocks of 32 keys per split) is compiled
through tests/compile_harness.py, and the SASS is checked for mma.sync (HMMA 16816 F32),
ldmatrix, cp.async gathers (LDGSTS) that arrive on the stage's mbarrier once landed
(ARRIVES.LDGSTSBAR), named barriers, and local-memory traffic (``SPILL_BOUND``). Head counts
outside 16/32/64/128 and caches with KV heads (``keys.mla_heads_key``): a few keys of both
kernels (``test_mla_head_counts_and_kv_heads_compile``)."""

import re

import pytest
from compile_harness import compile_entries

from flash_attn_cute.host.keys import mla_key
from flash_attn_cute.sm80.config import MLA_FP8_STAGING, mla_stages_for

ARCHS = ["sm_80", "sm_90a", "sm_100a"]
# (dtype, nheads, causal, split, lse, split_blocks): the GPU sweeps' keys, covered.
CONFIGS = [("bf16", 16, False, False, False, 0), ("bf16", 32, True, True, True, 0), ("fp16", 64, True, False, True, 0),
           ("bf16", 128, False, True, True, 0), ("bf16", 64, False, True, True, 128)]
SASS_EXPECT = ["HMMA.16816.F32", "LDSM", "LDGSTS", "MUFU.EX2", "BAR.SYNC", "BAR.ARV"]
# Local-memory instructions allowed (168 registers a thread, 128 of them the O warps' O).
# sm_80 (two stages), sm_90a and sm_100a (three): ptxas keeps one scalar of the tile (the
# grid's (sequence, split) pair, tile_scheduler.SingleTileScheduler) in local memory across
# the mainloop: one STL before the role split, one LDL per role after its loop (the split
# 128-head key on sm_80: STL at 0x0530, LDL at 0x2750, 0x2c10 and 0x60d0, none inside a
# loop; 2 for the other keys). Bounded so that it cannot grow into the mainloop.
SPILL_BOUND = {"sm_80": 4, "sm_90a": 4, "sm_100a": 4}


def keys(arch):
    return [mla_key("sm80", arch, dt, h, causal, split, lse, blocks, (mla_stages_for(arch),))
            for dt, h, causal, split, lse, blocks in CONFIGS]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    cache = {}

    def get(arch):
        if arch not in cache:
            entries = [(f"k{i}", "flash_attn_cute.sm80.mla:compile", k) for i, k in enumerate(keys(arch))]
            cache[arch] = compile_entries(arch, entries, tmp_path_factory.mktemp(f"mla_{arch}"))
        return cache[arch]

    return get


def check_artifacts(out_dir, keys_, arch, expect, spill_bound):
    """One cubin per key; with SASS (nvdisasm installed), the expected instructions and
    at most ``spill_bound`` local-memory instructions."""
    for i, key in enumerate(keys_):
        cubins = list((out_dir / f"k{i}").glob(f"*.{arch}.cubin"))
        assert len(cubins) == 1 and cubins[0].read_bytes()[:4] == b"\x7fELF", key
        sass_files = list((out_dir / f"k{i}").glob("*.sass"))
        if not sass_files:
            pytest.skip("no usable nvdisasm (pip install nvidia-cuda-nvdisasm): no SASS to check")
        sass = sass_files[0].read_text()
        for op in expect:
            assert op in sass, (op, key)
        spills = len(re.findall(r"\b(LDL|STL)\b", sass))
        assert spills <= spill_bound, ("local-memory spill", spills, key)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_mla_compiles_and_sass(artifacts, arch):
    out_dir, seconds = artifacts(arch)
    print(f"\nmla sm80 {arch}: " + ", ".join(f"{v:.1f}s" for v in seconds.values()))
    # The S warps wait on the FULL mbarriers with try_wait from sm_90 on (the sm_80 PTX,
    # test_wait, polls the barrier word with LDS); the O warps drain their copies before
    # the epilogue (DEPBAR: an empty split's Q copies are tracked by no phase).
    expect = SASS_EXPECT + ["ARRIVES.LDGSTSBAR", "DEPBAR.LE SB0"]
    expect += ["SYNCS.PHASECHK.TRANS64.TRYWAIT"] if arch != "sm_80" else []
    check_artifacts(out_dir, keys(arch), arch, expect, SPILL_BOUND[arch])


# The SM90 kernel (sm90/mla_decode.py): wgmma (HGMMA), the producer's cp.async gathers
# (LDGSTS), MUFU.EX2, mbarriers (SYNCS), setmaxnreg; no local memory at all (the
# consumers hold O 128 + S 16 + P 8 of their 232 registers).
SM90_CONFIGS = [("bf16", 64, False, False, False, 0), ("fp16", 128, True, True, True, 0),
                ("bf16", 16, True, False, True, 0), ("bf16", 64, True, True, True, 128)]
SM90_MODES = [(32, 4, "seesaw"), (32, 3, "split"), (32, 4, "one")]
SM90_SASS_EXPECT = ["HGMMA.64x32x16.F32", "HGMMA.64x256x16.F32", "LDGSTS", "MUFU.EX2", "SYNCS", "USETMAXREG"]


def compile_sm90(keys_, tmp_path, label, expect, depbar_bound):
    """The SM90 MLA keys compiled for sm_90a, their SASS checked (no local memory), and a
    bound on the wgmma waits: ptxas serialises every wgmma of a kernel (a wait after each
    HGMMA, info C7513) when registers a wgmma reads are rewritten while it may run, or when
    a wgmma is issued under a branch ("seesaw": 124 waits then). Returns the SASS texts."""
    entries = [(f"k{i}", "flash_attn_cute.sm90.mla:compile", k) for i, k in enumerate(keys_)]
    out_dir, seconds = compile_entries("sm_90a", entries, tmp_path)
    print(f"\n{label}: " + ", ".join(f"{v:.1f}s" for v in seconds.values()))
    check_artifacts(out_dir, keys_, "sm_90a", expect, 0)
    texts = [next((out_dir / f"k{i}").glob("*.sass")).read_text() for i in range(len(keys_))]
    for key, sass in zip(keys_, texts):
        assert sass.count("WARPGROUP.DEPBAR") <= depbar_bound, ("wgmma serialised", key)
    return texts


@pytest.mark.slow
def test_mla_sm90_compiles_and_sass(tmp_path):
    # Every Q K^T mode of the consumers ("seesaw": the warpgroups take turns computing S;
    # "one": warpgroup 0 computes S and shares P via smem; "split": halves summed via smem);
    # a handful of waits (13 "seesaw", 5 "one"), never ~78.
    keys90 = [mla_key("sm90", "sm_90a", *c, (SM90_MODES[i % len(SM90_MODES)],)) for i, c in enumerate(SM90_CONFIGS)]
    compile_sm90(keys90, tmp_path, "mla sm90 sm_90a", SM90_SASS_EXPECT, 16)


def test_stages_and_override():
    assert mla_stages_for("sm_80") == 2 and mla_stages_for("sm_90a") == 3 and mla_stages_for("sm_100a") == 3
    assert mla_stages_for("sm_90a", "2") == 2
    assert mla_stages_for("sm_90a", fp8=True) == 2  # the fp8 staging takes the third stage's room
    assert mla_stages_for("sm_90a", "3", fp8=True) == 2  # the 16-bit knob leaves FP8 caches alone
    with pytest.raises(ValueError, match="MLA_STAGES"):
        mla_stages_for("sm_80", "3")


# FP8 latent caches (dtype field "bf16/e4m3"): both kernels on sm_90a (FP8 needs compute
# capability 8.9), both SM90 Q K^T modes. The loading threads gather their own fp8 chunks
# (16-byte LDGSTS), read them back (LDS.128), unpack e4m3 pairs (F2FP.F16.E4M3.UNPACK_B)
# and store 16-bit chunks (STS.128). SM80: the gathers and the widening run in the O warps,
# whose 168 registers hold O (128): ptxas spills scalars of the loading threads' staging
# (9 local-memory instructions for bf16/e4m3 64 heads, 34 for fp16/e5m2 16 heads at the
# time of writing; 11 and 23 before the FULL mbarriers), bounded by FP8_SPILL_BOUND; the
# SM90 kernel spills none.
FP8_CONFIGS = [("bf16/e4m3", 64, True, True, True, 0), ("fp16/e5m2", 16, False, False, False, 0)]
FP8_SASS_EXPECT = ["LDGSTS", "LDS.128", "STS.128", "F2FP.F16.E"]
FP8_SPILL_BOUND = 40


@pytest.mark.slow
def test_mla_fp8_compiles_and_sass(tmp_path):
    keys8 = [mla_key("sm80", "sm_90a", *c, (mla_stages_for("sm_90a", fp8=True), MLA_FP8_STAGING)) for c in FP8_CONFIGS]
    keys8 += [mla_key("sm90", "sm_90a", *c, (((32, 2, "split", 2) if i % 2 else (32, 3, "seesaw", 2)),))
              for i, c in enumerate(FP8_CONFIGS)]
    entries = [(f"k{i}", f"flash_attn_cute.{k[0][4:]}.mla:compile", k) for i, k in enumerate(keys8)]
    out_dir, seconds = compile_entries("sm_90a", entries, tmp_path)
    print("\nmla fp8 sm_90a: " + ", ".join(f"{v:.1f}s" for v in seconds.values()))
    n80 = len(FP8_CONFIGS)
    # SM80: the widening threads publish a stage with a plain mbarrier arrive (release).
    check_artifacts(out_dir, keys8[:n80], "sm_90a", FP8_SASS_EXPECT + SASS_EXPECT + ["SYNCS.ARRIVE"], FP8_SPILL_BOUND)
    # check_artifacts numbers the entry directories from 0: the SM90 ones start at n80.
    for i, key in enumerate(keys8[n80:], start=n80):
        sass = next((out_dir / f"k{i}").glob("*.sass")).read_text()
        for op in FP8_SASS_EXPECT + SM90_SASS_EXPECT[2:]:
            assert op in sass, (op, key)
        assert not re.findall(r"\b(LDL|STL)\b", sass), ("local-memory spill", key)
        assert sass.count("WARPGROUP.DEPBAR") <= 16, ("wgmma serialised", key)


# Any head count and KV heads (FlashMLA's h_kv): a few keys of each kernel, on the arch its
# GPU tests run (sm_80 for the SM80 kernel's A100 budget, sm_90a for the SM90 kernel): an odd
# count (100, a partial second tile), 8 (DeepSeek at TP 16), and "g/hkv" keys (caches
# (num_pages, page_size, h_kv, d), g query heads per KV head; split, batch invariant, FP8).
# The same SASS checks and bounds as the 16/32/64/128 keys: at the time of writing the SM80
# keys keep 2 local-memory instructions like theirs, the SM90 ones none.
HEADS_SM80 = [("bf16", 8, True, False, True, 0), ("fp16", "4/hkv", True, True, True, 0)]
HEADS_SM90 = [(("bf16", 100, True, False, True, 0), (32, 4, "seesaw")),
              (("bf16", "2/hkv", True, True, True, 128), (32, 4, "seesaw")),
              (("bf16/e4m3", "2/hkv", True, False, True, 0), (32, 3, "seesaw", 2))]


@pytest.mark.slow
def test_mla_head_counts_and_kv_heads_compile(tmp_path):
    keys80 = [mla_key("sm80", "sm_80", *c, (mla_stages_for("sm_80"),)) for c in HEADS_SM80]
    out80, sec80 = compile_entries("sm_80", [(f"k{i}", "flash_attn_cute.sm80.mla:compile", k)
                                             for i, k in enumerate(keys80)], tmp_path / "sm80")
    keys90 = [mla_key("sm90", "sm_90a", *c, (mode,)) for c, mode in HEADS_SM90]
    print("\nmla heads sm80: " + ", ".join(f"{v:.1f}s" for v in sec80.values()))
    assert [k[3] for k in keys80 + keys90] == [8, "4/hkv", 100, "2/hkv", "2/hkv"]
    check_artifacts(out80, keys80, "sm_80", SASS_EXPECT + ["ARRIVES.LDGSTSBAR"], SPILL_BOUND["sm_80"])
    compile_sm90(keys90, tmp_path / "sm90", "mla heads sm90", SM90_SASS_EXPECT, 16)


# The SM90 TMA kernel (sm90/mla_decode_tma.py, pages of a multiple of 64, 16-bit caches):
# 64 x 64 S and 64 x 256 P V wgmma, bulk-tensor loads (UTMALDG) arriving on mbarriers
# (SYNCS), O staged in shared memory and stored a row a thread by bulk copies (UBLKCP),
# no local memory (O 128 + S 32 + P 16 of 255 registers; 207 at the time of writing), and
# the wgmma waits of its schedule (17: three or fewer per step and instantiation, never one
# per HGMMA). S's rotary chunk reads Q from registers (an RS wgmma: A is a register).
TMA_CONFIGS = [("bf16", 64, False, False, False, 0), ("fp16", 128, True, True, True, 0),
               ("bf16", "2/hkv", True, True, True, 128), ("bf16", 100, "cp", False, True, 0),
               ("bf16", 128, True, "schedule", True, 0)]  # a device schedule (kernels/mla_schedule.py)
TMA_SASS_EXPECT = ["HGMMA.64x64x16.F32", "HGMMA.64x256x16.F32", "UTMALDG", "MUFU.EX2", "SYNCS", "STSM", "UBLKCP"]


@pytest.mark.slow
def test_mla_sm90_tma_compiles_and_sass(tmp_path):
    keys_tma = [mla_key("sm90", "sm_90a", *c, ((64, 2, "tma"),)) for c in TMA_CONFIGS]
    for key, sass in zip(keys_tma, compile_sm90(keys_tma, tmp_path, "mla sm90 tma sm_90a", TMA_SASS_EXPECT, 20)):
        assert "USETMAXREG" not in sass, key  # two warpgroups of equal roles: no register trade
        assert re.search(r"HGMMA\.64x64x16\.F32(\.\w+)? R\d+, R\d+", sass), key  # Q's rotary chunk in registers


# The same kernel over an e4m3 cache: QGMMA (fp8 wgmma) for both products, V transposed by
# ldmatrix / prmt / stmatrix.trans (LDSM, PRMT, STSM), q quantized in the kernel (or FP8
# queries, "e4m3/e4m3", loaded as they are); no local memory (222 registers at the time of
# writing), the same 17 waits.
TMA_FP8_CONFIGS = [("bf16/e4m3", 64, False, False, False, 0), ("fp16/e4m3", "2/hkv", True, True, True, 128),
                   ("bf16/e4m3", 100, "cp", True, True, 0), ("e4m3/e4m3", 128, True, True, True, 0),
                   ("bf16/e4m3", 64, False, "schedule", False, 0)]
TMA_FP8_SASS_EXPECT = ["QGMMA.64x64x32.F32.E4M3.E4M3", "QGMMA.64x256x32.F32.E4M3.E4M3", "UTMALDG", "LDSM", "PRMT",
                       "STSM", "MUFU.EX2", "SYNCS", "UBLKCP"]


@pytest.mark.slow
def test_mla_sm90_tma_fp8_compiles_and_sass(tmp_path):
    keys_fp8 = [mla_key("sm90", "sm_90a", *c, ((64, 2, "tma"),)) for c in TMA_FP8_CONFIGS]
    for key, sass in zip(keys_fp8, compile_sm90(keys_fp8, tmp_path, "mla sm90 tma fp8 sm_90a", TMA_FP8_SASS_EXPECT,
                                                20)):
        assert "HGMMA" not in sass and "USETMAXREG" not in sass, key
        assert re.search(r"QGMMA\.64x64x32\.F32\.E4M3\.E4M3 R\d+, R\d+", sass), key  # the rotary chunk's RS S


# The TMA kernel's opt-in modes (sm90.config.TMA_MODES): "tma_runs" splits each warpgroup's
# steady loop by mask runs (the unmasked run's steps test no mask: three loops with a mask,
# causal or context-parallel, so up to 29 wgmma waits, still far from one per wgmma);
# "tma_lag" adds a lagging row max, a warp vote (VOTE.ALL) before each skippable rescale.
# No local memory; the default mode has no vote.
TMA_MODE_CONFIGS = [("bf16", 64, False, False, False, 0), ("bf16/e4m3", 100, "cp", True, True, 0),
                    ("e4m3/e4m3", 128, True, True, True, 0)]


@pytest.mark.slow
def test_mla_sm90_tma_modes_compile_and_sass(tmp_path):
    keys_ = [mla_key("sm90", "sm_90a", *c, ((64, 2, mode),)) for mode in ("tma_runs", "tma_lag")
             for c in TMA_MODE_CONFIGS]
    keys_default = [mla_key("sm90", "sm_90a", *TMA_MODE_CONFIGS[0], ((64, 2, "tma"),))]
    sass = compile_sm90(keys_ + keys_default, tmp_path, "mla sm90 tma modes sm_90a", ["UTMALDG", "MUFU.EX2"], 40)
    for key, text in zip(keys_, sass):
        lag = key[8][2] == "tma_lag"
        assert (text.count("VOTE.ALL") >= 13) if lag else ("VOTE.ALL" not in text), key
    assert "VOTE.ALL" not in sass[-1]
