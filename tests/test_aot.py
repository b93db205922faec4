"""Tests of flash_attn_cute.aot (CPU only): presets -> keys, and the AOT round trip.

The round trip builds a tiny description (one split SM80 decode kernel at d 64 and the
d_v 64 combine it needs) with the command line and two worker processes, then proves
that fresh processes load every entry without compiling: through
``FLASH_ATTN_CUTE_CACHE_DIR``, and through a read-only ``FLASH_ATTN_CUTE_PREBUILT``
folder in a process without ``CUTE_DSL_ARCH`` (a server detecting its GPU). Every
process runs a frozen copy of the package, so an edit of the working tree during the
test cannot change the source fingerprint between the build and the loads.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flash_attn_cute import aot, seam
from flash_attn_cute.kernels import combine
from flash_attn_cute.host import jit_cache

REPO = Path(__file__).resolve().parents[1]
TINY = [{"api": "kvcache", "d": 64, "num_splits": 2}]

LOADER = r'''
import importlib, json, os, sys
import torch  # imported first, as in any real caller
import flash_attn_cute
from flash_attn_cute import aot
from flash_attn_cute.host import jit_cache

entries = aot.read_manifest(sys.argv[1])
assert entries, "no manifest for this fingerprint"


def compile_fn(entry):
    def run():
        assert os.environ.get("TEST_ALLOW_COMPILE"), f"compiled {entry.name} {entry.key}"
        module, fn = entry.target.split(":")
        return getattr(importlib.import_module(module), fn)(entry.key)
    return run


for e in entries:
    assert callable(jit_cache.get_or_compile(e.name, e.key, compile_fn(e)))
first = jit_cache.stats()
jit_cache.clear_memory_cache()
for e in entries:  # what is on disk now loads (a rebuilt entry included)
    jit_cache.get_or_compile(e.name, e.key, compile_fn(e))
print(json.dumps({"stats": first, "again": jit_cache.stats(), "n": len(entries),
                  "package": os.path.dirname(flash_attn_cute.__file__)}))
'''


@pytest.fixture(scope="module")
def frozen(tmp_path_factory):
    """A copy of the package and the loader script: (src folder, loader path)."""
    src = tmp_path_factory.mktemp("src")
    shutil.copytree(REPO / "flash_attn_cute", src / "flash_attn_cute", ignore=shutil.ignore_patterns("__pycache__"))
    loader = src / "loader.py"
    loader.write_text(LOADER)
    return src, loader


def _env(src: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUTE_DSL_", "FLASH_ATTN_CUTE_"))}
    env["PYTHONPATH"] = str(src)
    env.update({k: str(v) for k, v in extra.items() if v is not None})
    return env


def _load(frozen, root: Path, **extra) -> dict:
    src, loader = frozen
    proc = subprocess.run([sys.executable, str(loader), str(root)], cwd=src, env=_env(src, **extra),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"loader failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(result["package"]) == src / "flash_attn_cute"
    result["stderr"] = proc.stderr
    return result


@pytest.fixture(scope="module")
def built(frozen, tmp_path_factory):
    """TINY built for sm_80 with the command line and --jobs 2: (out folder, stderr)."""
    src, _ = frozen
    base = tmp_path_factory.mktemp("aot")
    preset, out = base / "tiny.json", base / "out"
    preset.write_text(json.dumps(TINY))
    cmd = [sys.executable, "-m", "flash_attn_cute.aot", "--arch", "sm_80", "--preset", str(preset), "--out", str(out),
           "--jobs", "2"]
    proc = subprocess.run(cmd, cwd=src, env=_env(src), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"aot build failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}"
    return out, proc.stderr


def _tree(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns, p.stat().st_mode)
            for p in [folder, *folder.rglob("*")]}


# ---------------------------------------------------------------------------------------
# The round trip (real kernels, fresh processes)
# ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_builds_the_jit_layout(built):
    out, stderr = built
    assert "2 entries for sm_80: 1 combine, 1 fwd_sm80" in stderr
    assert "[aot sm_80] [" in stderr and "2/2" in stderr and "compiled in" in stderr
    assert "2 entries (2 compiled, 0 already there, 0 failed)" in stderr and "with 2 processes" in stderr
    (manifest,) = out.glob("*/" + aot.MANIFEST)
    listed = json.loads(manifest.read_text())["entries"]
    expected, _ = aot.entries_for(TINY, "sm_80")
    assert sorted((e["name"], aot._to_tuple(e["key"])) for e in listed) == sorted((e.name, e.key) for e in expected)
    assert {e.name for e in expected} == {"fwd_sm80", "combine"}
    # The entry file names are what this process (CUTE_DSL_ARCH unset) computes.
    objects = sorted(p.name for p in manifest.parent.glob("*.o"))
    assert objects == sorted(f"{e.name}-{jit_cache._entry_digest(e.key)}.o" for e in expected)
    assert not [p for p in out.rglob("*") if ".tmp" in p.name or p.suffix == ".lock"]


@pytest.mark.slow
def test_fresh_process_loads_every_entry(frozen, built):
    out, _ = built
    r = _load(frozen, out, CUTE_DSL_ARCH="sm_80", FLASH_ATTN_CUTE_CACHE_DIR=out)
    assert r["n"] == 2
    assert r["stats"]["compiles"] == 0 and r["stats"]["disk_loads"] == 2 and r["stats"]["disk_errors"] == 0
    assert r["stats"]["prebuilt_loads"] == 0


@pytest.mark.slow
def test_prebuilt_folder_serves_a_server_without_arch_env(frozen, built, tmp_path):
    out, _ = built
    prebuilt, cache = tmp_path / "prebuilt", tmp_path / "cache"
    shutil.copytree(out, prebuilt)
    for p in prebuilt.rglob("*"):
        p.chmod(0o555 if p.is_dir() else 0o444)
    prebuilt.chmod(0o555)
    before = _tree(prebuilt)
    search = os.pathsep.join([str(tmp_path / "missing"), str(prebuilt)])
    # No CUTE_DSL_ARCH: as on a GPU server, where the DSL detects the arch.
    r = _load(frozen, prebuilt, FLASH_ATTN_CUTE_CACHE_DIR=cache, FLASH_ATTN_CUTE_PREBUILT=search)
    assert r["stats"]["compiles"] == 0 and r["stats"]["prebuilt_loads"] == r["stats"]["disk_loads"] == 2
    assert r["stats"]["disk_writes"] == 0 and r["stats"]["disk_errors"] == 0
    assert _tree(prebuilt) == before  # nothing written, not even a lock file
    assert list(cache.rglob("*.o")) == []
    for p in [prebuilt, *prebuilt.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)


@pytest.mark.slow
def test_prebuilt_folder_is_read_with_the_cache_off(frozen, built, jit_cache_dir, monkeypatch):
    # In this process, posing as the frozen package (its fingerprint): the entries load.
    out, _ = built
    fingerprint = jit_cache.source_fingerprint(frozen[0] / "flash_attn_cute")
    monkeypatch.setattr(jit_cache, "cached_fingerprint", lambda: fingerprint)
    monkeypatch.setenv("FLASH_ATTN_CUTE_CACHE", "0")
    monkeypatch.setenv("FLASH_ATTN_CUTE_PREBUILT", str(out))
    entries = aot.read_manifest(out)
    assert len(entries) == 2
    for e in entries:
        assert callable(jit_cache.get_or_compile(e.name, e.key, lambda: pytest.fail("compiled")))
    assert jit_cache.stats()["prebuilt_loads"] == 2 and jit_cache.stats()["compiles"] == 0
    assert not jit_cache_dir.exists()


@pytest.mark.slow
def test_corrupted_entry_is_recompiled_and_replaced(frozen, built, tmp_path):
    out, _ = built
    cache = tmp_path / "cache"
    shutil.copytree(out, cache)
    (victim,) = cache.glob("*/combine-*.o")
    victim.write_bytes(victim.read_bytes()[:200])
    r = _load(frozen, cache, CUTE_DSL_ARCH="sm_80", FLASH_ATTN_CUTE_CACHE_DIR=cache, TEST_ALLOW_COMPILE=1)
    assert r["stats"]["compiles"] == 1 and r["stats"]["disk_loads"] == 1 and r["stats"]["disk_writes"] == 1
    assert r["stats"]["disk_errors"] == 1 and "disk kernel cache unavailable (loading" in r["stderr"]
    assert victim.stat().st_size > 200
    assert r["again"]["compiles"] == 1 and r["again"]["disk_loads"] == 3  # the rewritten file loads


# ---------------------------------------------------------------------------------------
# Presets and descriptions (no compile)
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch,capability", [("sm_80", (8, 0)), ("sm_90a", (9, 0)), ("sm_100a", (10, 0)),
                                               ("sm_103a", (10, 3))])
def test_preset_keys_are_what_the_launchers_ask_for(monkeypatch, arch, capability):
    """Resolving every preset problem the way a call does (device faked) asks the JIT
    cache for exactly the preset's entries: the runtime plans with the call's arch
    (``seam.resolve``), so sm_103 takes SM100's sm_103 rule (no FMA-pipe exponentials) as the
    AOT build does."""
    asked = set()
    monkeypatch.setenv("CUTE_DSL_ARCH", arch)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(jit_cache, "get_or_compile", lambda name, key, fn: asked.add((name, key)) or (lambda *a: None))
    seam.clear_plan_cache()
    descriptions = aot.load_descriptions("all")
    try:
        for description in descriptions:
            for one in aot.expand(description):
                seam.resolve(aot.problem_of(one), None, one["num_splits"], one["pack_gqa"], torch.device("cuda", 0))
    finally:
        seam.clear_plan_cache()
    entries, skipped = aot.entries_for(descriptions, arch)
    assert skipped == []
    assert asked == {(e.name, e.key) for e in entries}
    assert len(entries) == len(asked)


def test_presets_cover_the_serving_shapes():
    decode, _ = aot.entries_for(aot.load_descriptions("decode"), "sm_80")
    prefill, _ = aot.entries_for(aot.load_descriptions("prefill"), "sm_80")
    mla, _ = aot.entries_for(aot.load_descriptions("mla"), "sm_80")
    serving, _ = aot.entries_for(aot.load_descriptions("serving"), "sm_80")
    everything, _ = aot.entries_for(aot.load_descriptions("all"), "sm_80")
    assert set(everything) == set(decode) | set(prefill) | set(serving) | set(mla)
    # Serving steps: packed queries over pages with seqused_k; the mixed steps (max_seqlen_q
    # 2048) as both launches of their plan: the short sequences (64 // ratio queries) and the rest.
    from flash_attn_cute.host.keys import parse_key

    steps = [parse_key(e.key, 4) for e in serving if e.name == "fwd_sm80"]
    assert all(f.varlen_q and f.paged and f.has_seqused_k and not f.varlen_k for f in steps)
    assert {f.q_class for f in steps} == {0, 64, -64, 16, -16, 8, -8} and {f.has_sink for f in steps} == {False, True}
    # MLA: every dtype / heads / causal / (split, LSE) key of the SM80 MLA kernel (2 stages on sm_80)
    mla_keys = {e.key for e in mla if e.name == "mla_sm80"}
    assert len(mla_keys) == 2 * 4 * 2 * 3 and all(k[-1] == 2 for k in mla_keys)  # a split always has an LSE
    assert {e.target for e in mla if e.name == "mla_sm80"} == {"flash_attn_cute.sm80.mla:compile"}
    assert {e.key for e in mla if e.name == "combine"} == {combine.combine_key(t, 512, lse, "sm_80")
                                                           for t in ("bf16", "fp16") for lse in (False, True)}
    hopper, _ = aot.entries_for(aot.load_descriptions("mla"), "sm_90a")
    assert {e.name for e in hopper} == {"mla_sm90", "combine"}
    fwd_keys = [e.key for e in decode if e.name == "fwd_sm80"]
    # fwd_key: (name, arch, dtype, d, dv, tile_m, tile_n, warps, q_in_regs, flags, pack, split, lse, vq, vk, su, paged)
    assert {k[2] for k in fwd_keys} == {"bf16", "fp16"} and {k[3] for k in fwd_keys} == {64, 128}
    assert {k[10] for k in fwd_keys} == {1, 4, 8} and {k[11] for k in fwd_keys} == {False, True}
    assert {k[16] for k in fwd_keys} == {False, True} and all(k[15] for k in fwd_keys)  # paged or not, seqused_k
    combines = {e.key for e in decode if e.name == "combine"}
    assert combines == {combine.combine_key(t, d, lse, "sm_80") for t in ("bf16", "fp16") for d in (64, 128)
                        for lse in (False, True)}
    dims = {(e.key[3], e.key[4]) for e in prefill}
    assert dims == {(64, 64), (128, 128), (256, 256), (192, 128)}
    assert {e.key[13] for e in prefill} == {False, True}  # dense and varlen


def test_serving_features_are_described():
    # learnable_sink / seqused_q / batch_invariant: the keys a serving engine's calls ask for
    # (a batch-invariant plan is always split, its combine adds the sink).
    from flash_attn_cute.host.keys import parse_key

    described = [{"api": "kvcache", "seqlen_k": 8192, "page_size": 64, "qhead_per_kvhead": 4,
                  "learnable_sink": True, "batch_invariant": [False, True]}]
    entries, skipped = aot.entries_for(described, "sm_80")
    assert skipped == []
    fwd_keys = [parse_key(e.key, 4) for e in entries if e.name == "fwd_sm80"]
    assert {(f.has_sink, f.is_split, f.split_blocks) for f in fwd_keys} == {(True, False, 0), (True, True, 32)}
    assert {e.key for e in entries if e.name == "combine"} == {combine.combine_key("bf16", 128, False, "sm_80",
                                                                                   has_sink=True)}
    used_q = aot.entries_for([{"api": "varlen", "seqlen_q": 512, "seqused_q": True}], "sm_80")[0]
    assert [parse_key(e.key, 4).has_seqused_q for e in used_q] == [True]
    mla, _ = aot.entries_for([{"api": "mla", "qhead_per_kvhead": 64, "nheads_kv": 1, "page_size": 64,
                               "batch_invariant": True}], "sm_80")
    assert {e.name for e in mla} == {"mla_sm80", "combine"} and mla[0].key[7] == 128  # split_blocks
    with pytest.raises(ValueError, match="no learnable_sink"):
        aot.expand({"api": "mla", "qhead_per_kvhead": 64, "nheads_kv": 1, "learnable_sink": True})
    # Any head count; nheads_kv > 1: caches with a KV-head mode ("<g>/hkv" keys); at most 128 heads.
    heads, _ = aot.entries_for([{"api": "mla", "qhead_per_kvhead": g, "nheads_kv": hkv, "page_size": 64}
                                for g, hkv in ((8, 1), (3, 1), (4, 2))], "sm_80")
    assert [e.key[3] for e in heads] == [8, 3, "4/hkv"]
    assert aot.problem_of(aot.expand({"api": "mla", "qhead_per_kvhead": 4, "nheads_kv": 2})[0]).nheads == 8
    with pytest.raises(ValueError, match=r"nheads_kv \* qhead_per_kvhead .* in 1..128"):
        aot.expand({"api": "mla", "qhead_per_kvhead": 64, "nheads_kv": 4})
    # FP8 caches: keys of the SM90 kernel with the fp8 dtype on Hopper; refused below 8.9, as at runtime
    fp8 = [{"api": "kvcache", "page_size": 16, "qhead_per_kvhead": 4, "kv_fp8": True}]
    hopper, skipped = aot.entries_for(fp8, "sm_90a")
    assert skipped == [] and [(e.name, e.key[2]) for e in hopper] == [("fwd_sm90", "bf16/e4m3")]
    ampere, skipped = aot.entries_for(fp8, "sm_80")
    assert ampere == [] and "compute capability >= 8.9" in skipped[0]
    # An FP8 MLA latent cache: the SM90 MLA key with the fp8 dtype; pages of 64: the TMA
    # kernel in fp8 wgmma, pages of 16: the gathering kernel and its staging depth.
    mla8, skipped = aot.entries_for([{"api": "mla", "qhead_per_kvhead": 64, "nheads_kv": 1, "page_size": page,
                                      "kv_fp8": True} for page in (64, 16)], "sm_90a")
    assert skipped == [] and [(e.name, e.key[2], e.key[8]) for e in mla8] == [
        ("mla_sm90", "bf16/e4m3", (64, 2, "tma")), ("mla_sm90", "bf16/e4m3", (32, 3, "seesaw", 2))]
    # FP8 attention (e4m3 q, k, v): SM90 keys of dtype e4m3, a split's combine writes bf16;
    # refused on Ampere (no fp8 MMA), and not a form of MLA or of an FP8 cache
    qkv8, skipped = aot.entries_for([{"api": "varlen", "dtype": "e4m3", "seqlen_q": 4096, "num_splits": [1, 2]}],
                                    "sm_90a")
    assert skipped == [] and {(e.name, e.key[1 if e.name == "combine" else 2]) for e in qkv8} == {
        ("fwd_sm90", "e4m3"), ("combine", "bf16")}
    ampere, skipped = aot.entries_for([{"dtype": "e4m3", "seqlen_q": 4096}], "sm_80")
    assert ampere == [] and "FP8 attention" in skipped[0]
    for bad in ({"api": "mla", "dtype": "e4m3", "qhead_per_kvhead": 64, "nheads_kv": 1}, {"dtype": "e4m3",
                                                                                         "kv_fp8": True}):
        with pytest.raises(ValueError, match="e4m3"):
            aot.expand(bad)


def test_expand_and_validate(tmp_path):
    assert len(aot.expand({"d": [64, 128], "causal": [False, True], "window": [-1, 0]})) == 4
    assert [o["window"] for o in aot.expand({"window": [[-1, -1], [128, 0]]})] == [[-1, -1], [128, 0]]
    assert aot.expand({})[0]["d_v"] is None and aot.problem_of(aot.expand({"d": 64})[0]).d_v == 64
    p = aot.problem_of(aot.expand({"api": "kvcache", "page_size": 16, "qhead_per_kvhead": 4, "nheads_kv": 2})[0])
    assert (p.has_seqused_k, p.paged, p.varlen_q, p.nheads, p.nheads_kv) == (True, True, False, 8, 2)
    assert aot.problem_of(aot.expand({"causal": False, "window": [-1, 0]})[0]).causal  # normalised like the API
    bad = [{"head_dim": 64}, {"dtype": "fp32"}, {"api": "paged"}, {"page_size": 16}, {"num_splits": 0},
           {"d": 0}, {"causal": 1}, {"window": [1]}, {"softcap": -1.0}]
    for description in bad:
        with pytest.raises(ValueError):
            aot.expand(description)
    f = tmp_path / "mine.json"
    f.write_text(json.dumps(TINY))
    assert aot.load_descriptions(str(f)) == TINY
    f.write_text(json.dumps(TINY[0]))
    with pytest.raises(ValueError, match="list"):
        aot.load_descriptions(str(f))
    with pytest.raises(ValueError):
        aot.load_descriptions("nonexistent-preset")


def test_refused_problems_are_reported():
    entries, skipped = aot.entries_for([{"d": [64, 80]}], "sm_80")  # 80: the 96 tile, padded
    assert len(entries) == 2 and not skipped
    entries, skipped = aot.entries_for([{"d": [64, 256]}], "sm_100a", backend="sm100")
    assert len(entries) == 1 and len(skipped) == 1 and "256" in skipped[0]
    with pytest.raises(ValueError, match="arch"):
        aot.entries_for(TINY, "ampere")


def test_dry_run_lists_entries(capsys):
    assert aot.main(["--arch", "sm_80", "--preset", "decode", "--out", "/nonexistent", "--dry-run"]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.strip().splitlines()) == len(aot.entries_for(aot.load_descriptions("decode"), "sm_80")[0])
    assert "entries for sm_80" in captured.err
    assert not Path("/nonexistent").exists()
    with pytest.raises(SystemExit):
        aot.main(["--arch", "sm_80", "--preset", "nope", "--out", "/nonexistent"])


def test_mla_schedule_is_described():
    # schedule (scheduler_metadata): get_mla_metadata's kernel on every arch; on Hopper, pages of
    # 64 and num_splits 0, the TMA kernel's "schedule" key and the combine with per-sequence slots
    one = {"api": "mla", "qhead_per_kvhead": 64, "nheads_kv": 1, "page_size": 64, "schedule": True,
           "num_splits": 0, "num_sms": 132}
    from flash_attn_cute.host.mla_schedule import schedule_key

    hopper, skipped = aot.entries_for([one], "sm_90a")
    assert skipped == []
    by_name = {e.name: e for e in hopper}
    assert set(by_name) == {"mla_sm90", "combine", "mla_schedule"}
    assert by_name["mla_sm90"].key[5] == "schedule"
    assert by_name["combine"].key == combine.combine_key("bf16", 512, False, "sm_90a", split_info=True)
    assert by_name["mla_schedule"].key == schedule_key("sm_90a")
    assert by_name["mla_schedule"].target == "flash_attn_cute.kernels.mla_schedule:compile_from_key"
    ampere, _ = aot.entries_for([one], "sm_80")  # planned on the host there: no scheduled key
    assert {e.name for e in ampere} >= {"mla_sm80", "mla_schedule"}
    assert all(e.key[5] != "schedule" for e in ampere if e.name == "mla_sm80")
    with pytest.raises(ValueError, match="schedule"):
        aot.entries_for([{"api": "func", "schedule": True}], "sm_80")


def test_mla_auto_splits_build_both_kernels_on_hopper():
    # num_splits 0 on the SM90 MLA TMA kernel (pages of 64): its split model weighs the
    # device's HBM bandwidth (64 x 1024: unsplit on an H100, two splits on an H200), which a
    # description does not state: both kernels and the combine. The gathering kernel (pages
    # of 1) and an explicit count build what they plan.
    one = {"api": "mla", "qhead_per_kvhead": 64, "nheads_kv": 1, "batch": 64, "seqlen_k": 1024, "num_splits": 0,
           "num_sms": 132}
    tma, _ = aot.entries_for([dict(one, page_size=64)], "sm_90a")
    assert {e.key[5] for e in tma if e.name == "mla_sm90"} == {False, True}
    assert any(e.name == "combine" for e in tma)
    for other in (dict(one, page_size=1), dict(one, page_size=64, num_splits=1)):
        entries, _ = aot.entries_for([other], "sm_90a")
        assert len({e.key for e in entries if e.name == "mla_sm90"}) == 1, other
