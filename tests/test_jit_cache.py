"""Tests of flash_attn_cute.host.jit_cache (CPU only).

The cross-process tests compile a tiny real CuTe kernel (y = 2 x) against fake tensors
with ``CUTE_DSL_ARCH=sm_80`` in fresh Python processes, export it, and load it back in
another process: exactly what happens to the attention kernels, without needing a GPU
(the kernel is compiled and loaded, never launched). The in-process tests use stand-in
"compiled functions" to exercise the bookkeeping and the error paths.
"""

import json
import logging
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from flash_attn_cute.host import jit_cache

REPO = Path(__file__).resolve().parents[1]

CHILD = r'''
import contextlib, json, os, sys, time
import torch  # imported first, as in any real caller: its import is not a cache cost
import cutlass
import cutlass.cute as cute
from flash_attn_cute.host import jit_cache
from flash_attn_cute.device.cute_utils import COMPILE_OPTIONS, fake_stream, fake_tensor


@cute.kernel
def _scale_kernel(x: cute.Tensor, y: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    i = bidx * 128 + tidx
    if i < cute.size(x.shape[0]):
        y[i] = x[i] * cutlass.Float32(2.0)


@cute.jit
def scale(x: cute.Tensor, y: cute.Tensor, stream):
    n = cute.size(x.shape[0])
    _scale_kernel(x, y).launch(grid=[(n + 127) // 128, 1, 1], block=[128, 1, 1], stream=stream)


def rendezvous(tag):
    """Wait until both racing processes reach this point (TEST_RENDEZVOUS = a folder)."""
    folder = os.environ.get("TEST_RENDEZVOUS")
    if not folder:
        return
    open(os.path.join(folder, f"{tag}-{os.getpid()}"), "w").close()
    deadline = time.time() + 120
    while sum(f.startswith(tag + "-") for f in os.listdir(folder)) < 2 and time.time() < deadline:
        time.sleep(0.01)


def compile_fn():
    if os.environ.get("TEST_NO_LOCK"):
        rendezvous("compile")  # both processes compile, then both export and rename
    x, y = fake_tensor(cutlass.Float32, 1), fake_tensor(cutlass.Float32, 1)
    return cute.compile(scale, x, y, fake_stream(), options=COMPILE_OPTIONS)


if os.environ.get("TEST_NO_LOCK"):
    jit_cache._file_lock = lambda path: contextlib.nullcontext()
if os.environ.get("TEST_FINGERPRINT"):  # pinned by the test (or "sources changed")
    jit_cache.cached_fingerprint = lambda: os.environ["TEST_FINGERPRINT"]
key = ("scale", "fp32", 1, True, None, (128, 1))
rendezvous("start")
t0 = time.perf_counter()
fn = jit_cache.get_or_compile("tiny", key, compile_fn)
seconds = time.perf_counter() - t0
assert callable(fn) and jit_cache.get_or_compile("tiny", key, compile_fn) is fn
print(json.dumps({"stats": jit_cache.stats(), "seconds": seconds, "path": str(jit_cache.cache_path("tiny", key)),
                  "type": type(fn).__name__}))
'''


def _env(**extra):
    env = dict(os.environ)  # carries FLASH_ATTN_CUTE_CACHE_DIR from the jit_cache_dir fixture
    env.update(CUTE_DSL_ARCH="sm_80", PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _start(script: Path, **extra):
    return subprocess.Popen([sys.executable, str(script)], cwd=REPO, env=_env(**extra), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(proc) -> dict:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, f"child failed (rc {proc.returncode}):\n{err[-4000:]}"
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture
def child(tmp_path):
    """Runs CHILD in a fresh process. Every child of one test uses the fingerprint of the
    sources as they are when the test starts, so that a source edited meanwhile (in a
    working tree being edited) cannot turn an expected disk hit into a miss."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    fingerprint = jit_cache.source_fingerprint()

    def run(**extra) -> dict:
        return _finish(_start(script, **{"TEST_FINGERPRINT": fingerprint, **extra}))

    run.script, run.fingerprint = script, fingerprint
    return run


def _objects(folder: Path):
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.o")) if folder.exists() else []


# ---------------------------------------------------------------------------------------
# Across processes, with a real kernel
# ---------------------------------------------------------------------------------------


def test_second_process_loads_from_disk(jit_cache_dir, child, capsys):
    first = child()
    second = child()
    assert first["stats"]["compiles"] == 1 and first["stats"]["disk_writes"] == 1
    assert first["stats"]["disk_loads"] == 0
    assert second["stats"]["compiles"] == 0 and second["stats"]["disk_loads"] == 1
    assert second["stats"]["disk_errors"] == first["stats"]["disk_errors"] == 0
    assert first["path"] == second["path"] and Path(first["path"]).is_file()
    assert Path(first["path"]).parent.parent == jit_cache_dir
    assert not [p for p in jit_cache_dir.rglob("*") if ".tmp" in p.name], "temporary file left behind"
    with capsys.disabled():
        print(f"\n[jit_cache] tiny kernel: cold compile+export {first['seconds'] * 1e3:.1f} ms, "
              f"load from disk {second['seconds'] * 1e3:.1f} ms (get_or_compile wall time, fresh processes)")


def test_cache_disabled_by_env(jit_cache_dir, child):
    for _ in range(2):
        r = child(FLASH_ATTN_CUTE_CACHE="0")
        assert r["stats"]["compiles"] == 1 and r["stats"]["disk_loads"] == r["stats"]["disk_writes"] == 0
    assert _objects(jit_cache_dir) == []


def test_cache_dir_env_moves_cache(jit_cache_dir, child, tmp_path):
    r = child()
    assert r["stats"]["disk_writes"] == 1 and Path(r["path"]).is_relative_to(jit_cache_dir)
    other = tmp_path / "elsewhere"
    r = child(FLASH_ATTN_CUTE_CACHE_DIR=other)
    assert r["stats"]["compiles"] == 1 and r["stats"]["disk_loads"] == 0  # the first folder is not read
    assert Path(r["path"]).is_relative_to(other) and len(_objects(other)) == 1
    r = child(FLASH_ATTN_CUTE_CACHE_DIR=other)
    assert r["stats"]["compiles"] == 0 and r["stats"]["disk_loads"] == 1


def test_changed_fingerprint_recompiles(jit_cache_dir, child):
    child()
    r = child(TEST_FINGERPRINT="edited-sources")
    assert r["stats"]["compiles"] == 1 and r["stats"]["disk_loads"] == 0
    assert Path(r["path"]).parent == jit_cache_dir / "edited-sources"
    assert len(_objects(jit_cache_dir)) == 2


def test_concurrent_processes_compile_once(jit_cache_dir, child, tmp_path):
    # Both start get_or_compile together; the lock makes one compile and the other load.
    meet = tmp_path / "meet"
    meet.mkdir()
    procs = [_start(child.script, TEST_RENDEZVOUS=meet, TEST_FINGERPRINT=child.fingerprint) for _ in range(2)]
    results = [_finish(p) for p in procs]
    assert sum(r["stats"]["compiles"] for r in results) == 1
    assert sum(r["stats"]["disk_loads"] for r in results) == 1
    assert len(_objects(jit_cache_dir)) == 1


def test_concurrent_writers_without_lock_both_succeed(jit_cache_dir, child, tmp_path):
    # No lock: both compile, export to their own temporary files and rename over each
    # other; both calls succeed and the surviving file is a valid module.
    meet = tmp_path / "meet"
    meet.mkdir()
    procs = [_start(child.script, TEST_RENDEZVOUS=meet, TEST_NO_LOCK=1, TEST_FINGERPRINT=child.fingerprint)
             for _ in range(2)]
    results = [_finish(p) for p in procs]
    assert [r["stats"]["compiles"] for r in results] == [1, 1]
    assert [r["stats"]["disk_writes"] for r in results] == [1, 1]
    assert len(_objects(jit_cache_dir)) == 1
    assert not [p for p in jit_cache_dir.rglob("*") if ".tmp" in p.name]
    r = child()
    assert r["stats"]["disk_loads"] == 1 and r["stats"]["compiles"] == 0


# ---------------------------------------------------------------------------------------
# In process, with stand-in compiled functions
# ---------------------------------------------------------------------------------------


class FakeCompiled:
    """Stands for a JitCompiledFunction: callable, and export_to_c writes (or fails)."""

    def __init__(self, payload=b"not an object file", fail=None):
        self.payload, self.fail = payload, fail

    def __call__(self, *args):
        return "called"

    def export_to_c(self, object_file_path, function_name=None, **kwargs):
        assert object_file_path.endswith(".o") and function_name.startswith("fac_")
        if self.fail:
            raise self.fail
        Path(object_file_path).write_bytes(self.payload)


def test_memory_cache(jit_cache_dir, monkeypatch):
    monkeypatch.setenv("FLASH_ATTN_CUTE_CACHE", "0")
    calls = []
    make = lambda: calls.append(1) or FakeCompiled()
    fn = jit_cache.get_or_compile("mem", ("a", 1, True, None, (2, "b")), make)
    assert jit_cache.get_or_compile("mem", ("a", 1, True, None, (2, "b")), make) is fn
    jit_cache.get_or_compile("mem", ("a", 2, True, None, (2, "b")), make)
    jit_cache.get_or_compile("other", ("a", 1, True, None, (2, "b")), make)
    assert len(calls) == 3
    assert jit_cache.stats()["memory_hits"] == 1 and jit_cache.stats()["compiles"] == 3
    jit_cache.clear_memory_cache()
    jit_cache.get_or_compile("mem", ("a", 1, True, None, (2, "b")), make)
    assert len(calls) == 4


# Keys that must be refused: a float (inexact), a list and a dict (mutable), an arbitrary
# object (its repr is not a stable identity across processes), a float nested in a
# tuple, and a key that is not a tuple.
@pytest.mark.parametrize("key", [(1.5,), ([1, 2],), ({"a": 1},), (object(),), ((1, 2.0),), [1, 2]])
def test_key_must_be_plain_tuple(key):
    with pytest.raises(AssertionError):
        jit_cache.get_or_compile("k", key, FakeCompiled)


@pytest.mark.parametrize("name", ["a/b", "", "x y", "../up"])  # path separators, blanks
def test_name_must_be_file_safe(name):
    with pytest.raises(AssertionError):
        jit_cache.get_or_compile(name, (1,), FakeCompiled)


def test_unusable_cache_dir_falls_back_to_memory(jit_cache_dir, monkeypatch, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("FLASH_ATTN_CUTE_CACHE_DIR", str(blocker / "sub"))  # cannot mkdir under a file
    monkeypatch.setattr(jit_cache, "_warned", False)
    with pytest.warns(RuntimeWarning, match="disk kernel cache unavailable"):
        fn = jit_cache.get_or_compile("bad", (1,), FakeCompiled)
    assert fn() == "called" and jit_cache.stats()["compiles"] == 1 and jit_cache.stats()["disk_errors"] == 1
    with warnings_as_errors():  # warned once only
        jit_cache.get_or_compile("bad", (2,), FakeCompiled)


def test_export_failure_falls_back(jit_cache_dir, monkeypatch):
    monkeypatch.setattr(jit_cache, "_warned", False)
    with pytest.warns(RuntimeWarning, match="writing"):
        fn = jit_cache.get_or_compile("exp", (1,), lambda: FakeCompiled(fail=OSError("disk full")))
    assert fn() == "called" and jit_cache.stats()["disk_writes"] == 0
    assert [p for p in jit_cache_dir.rglob("*") if p.suffix == ".o"] == []  # no partial/temporary file


def test_corrupt_cache_file_is_recompiled_and_replaced(jit_cache_dir, monkeypatch):
    path = jit_cache.cache_path("bad_o", (1,))
    path.parent.mkdir(parents=True)
    path.write_bytes(b"garbage")
    monkeypatch.setattr(jit_cache, "_warned", False)
    with pytest.warns(RuntimeWarning, match="loading"):
        fn = jit_cache.get_or_compile("bad_o", (1,), lambda: FakeCompiled(payload=b"fresh"))
    assert fn() == "called" and jit_cache.stats()["compiles"] == 1
    assert jit_cache.stats()["disk_errors"] == 1  # tried once, not again under the lock
    assert path.read_bytes() == b"fresh"


def test_cache_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.delenv("FLASH_ATTN_CUTE_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert jit_cache.cache_dir() == Path.home() / ".cache" / "flash_attn_cute"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert jit_cache.cache_dir() == tmp_path / "xdg" / "flash_attn_cute"
    monkeypatch.setenv("FLASH_ATTN_CUTE_CACHE_DIR", str(tmp_path / "mine"))
    assert jit_cache.cache_dir() == tmp_path / "mine"


# Spellings of "off" and of "on" (unset is on).
@pytest.mark.parametrize("value,enabled", [("0", False), ("false", False), ("OFF", False), ("1", True),
                                           ("", True), (None, True)])
def test_cache_enabled(monkeypatch, value, enabled):
    if value is None:
        monkeypatch.delenv("FLASH_ATTN_CUTE_CACHE", raising=False)
    else:
        monkeypatch.setenv("FLASH_ATTN_CUTE_CACHE", value)
    assert jit_cache.cache_enabled() is enabled


def test_fingerprint_tracks_sources_and_versions(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg"
    shutil.copytree(REPO / "flash_attn_cute", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    moved = tmp_path / "moved"
    shutil.copytree(pkg, moved)
    base = jit_cache.source_fingerprint(pkg)
    assert base == jit_cache.source_fingerprint(pkg)  # deterministic
    assert base == jit_cache.source_fingerprint(moved)  # independent of where the package lives
    (pkg / "__pycache__").mkdir(exist_ok=True)
    (pkg / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0")
    (pkg / "notes.txt").write_text("not a source")
    assert jit_cache.source_fingerprint(pkg) == base  # only .py files count
    src = pkg / "device" / "cute_utils.py"
    src.write_text(src.read_text() + "\n# edited\n")
    edited = jit_cache.source_fingerprint(pkg)
    assert edited != base
    (pkg / "sm80" / "new_kernel.py").write_text("X = 1\n")
    assert jit_cache.source_fingerprint(pkg) not in (base, edited)
    import cutlass

    monkeypatch.setattr(cutlass, "__version__", "0.0.0-other")
    assert jit_cache.source_fingerprint(moved) != base


def test_first_compile_logs_one_info_line(jit_cache_dir, monkeypatch, caplog):
    monkeypatch.setenv("FLASH_ATTN_CUTE_CACHE", "0")
    caplog.set_level(logging.INFO, logger="flash_attn_cute")
    for _ in range(2):  # the second call is a memory hit: no new line
        jit_cache.get_or_compile("logged", ("fwd", 64, True), FakeCompiled)
    records = [r for r in caplog.records if r.name == "flash_attn_cute"]
    assert len(records) == 1 and records[0].levelno == logging.INFO
    assert re.search(r"compiled logged \('fwd', 64, True\) in \d+\.\d+ s", records[0].getMessage())


def _make_unsafe(folder: Path, how: str) -> str:
    """Makes ``folder`` unsafe to load from; returns the reason the warning should name."""
    if how == "chown":
        os.chown(folder, 12345, -1)
        return "owned by uid 12345"
    folder.chmod(folder.stat().st_mode | (stat.S_IWGRP if how == "g+w" else stat.S_IWOTH))
    return "writable by group or others"


needs_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown needs root")
UNSAFE = [("root", "g+w"), ("root", "o+w"), ("fingerprint", "g+w"), ("fingerprint", "o+w"),
          pytest.param("root", "chown", marks=needs_root), pytest.param("fingerprint", "chown", marks=needs_root)]


# The cache root or its fingerprint folder, writable by group / others or owned by
# another user: the planted entry is neither loaded nor overwritten.
@pytest.mark.parametrize("which,how", UNSAFE)
def test_unsafe_cache_folder_is_not_loaded(jit_cache_dir, monkeypatch, which, how):
    path = jit_cache.cache_path("unsafe", (1,))
    path.parent.mkdir(parents=True)
    path.write_bytes(b"planted")
    reason = _make_unsafe(jit_cache_dir if which == "root" else path.parent, how)
    monkeypatch.setattr(jit_cache, "_warned_unsafe", set())
    with pytest.warns(RuntimeWarning, match=reason):
        fn = jit_cache.get_or_compile("unsafe", (1,), lambda: FakeCompiled(payload=b"fresh"))
    assert fn() == "called"
    s = jit_cache.stats()
    assert s["compiles"] == 1 and s["disk_loads"] == s["disk_writes"] == s["disk_errors"] == 0
    assert path.read_bytes() == b"planted"
    with warnings_as_errors():  # one warning per folder
        jit_cache.get_or_compile("unsafe", (2,), FakeCompiled)


@pytest.mark.parametrize("how", ["g+w", pytest.param("chown", marks=needs_root)])
def test_unsafe_prebuilt_folder_is_skipped(jit_cache_dir, monkeypatch, tmp_path, how):
    prebuilt = tmp_path / "prebuilt"
    planted = jit_cache.cache_path("pre", (1,), root=prebuilt)
    planted.parent.mkdir(parents=True)
    planted.write_bytes(b"planted")
    reason = _make_unsafe(prebuilt, how)
    monkeypatch.setenv("FLASH_ATTN_CUTE_PREBUILT", str(prebuilt))
    monkeypatch.setattr(jit_cache, "_warned_unsafe", set())
    with pytest.warns(RuntimeWarning, match=reason):
        jit_cache.get_or_compile("pre", (1,), lambda: FakeCompiled(payload=b"fresh"))
    s = jit_cache.stats()
    assert s["compiles"] == 1 and s["disk_loads"] == s["disk_errors"] == 0 and s["disk_writes"] == 1
    assert planted.read_bytes() == b"planted" and jit_cache.cache_path("pre", (1,)).read_bytes() == b"fresh"


def test_group_writable_entry_is_recompiled_and_replaced(jit_cache_dir, monkeypatch):
    path = jit_cache.cache_path("gw", (1,))
    path.parent.mkdir(parents=True)
    path.write_bytes(b"planted")
    path.chmod(0o664)
    monkeypatch.setattr(jit_cache, "_warned_unsafe", set())
    with pytest.warns(RuntimeWarning, match="writable by group or others"):
        jit_cache.get_or_compile("gw", (1,), lambda: FakeCompiled(payload=b"fresh"))
    assert jit_cache.stats()["disk_errors"] == 0 and jit_cache.stats()["disk_writes"] == 1
    assert path.read_bytes() == b"fresh" and stat.S_IMODE(path.stat().st_mode) == 0o644


def test_created_folders_and_files_are_not_group_writable(jit_cache_dir):
    old = os.umask(0o002)  # a umask that would make them group-writable
    try:
        jit_cache.get_or_compile("modes", (1,), FakeCompiled)
    finally:
        os.umask(old)
    path = jit_cache.cache_path("modes", (1,))
    assert [stat.S_IMODE(p.stat().st_mode) for p in (jit_cache_dir, path.parent, path)] == [0o755, 0o755, 0o644]


def test_prebuilt_dirs(monkeypatch, tmp_path):
    monkeypatch.delenv("FLASH_ATTN_CUTE_PREBUILT", raising=False)
    assert jit_cache.prebuilt_dirs() == []
    monkeypatch.setenv("FLASH_ATTN_CUTE_PREBUILT", os.pathsep.join([str(tmp_path / "a"), "", str(tmp_path / "b")]))
    assert jit_cache.prebuilt_dirs() == [tmp_path / "a", tmp_path / "b"]


def test_entry_hash_ignores_where_the_arch_comes_from(monkeypatch):
    """An entry built with CUTE_DSL_ARCH=sm_90a is the one a server that detects its
    H200 (CUTE_DSL_ARCH unset) looks for: the DSL's arch setting and the install path
    of its libraries are not in the entry hash (the key names the arch)."""
    from cutlass.cutlass_dsl import CuTeDSL

    envar = CuTeDSL._get_dsl().envar
    key = ("fwd_sm80", "sm_90a", "bf16", 128)
    seen = set()
    for arch in ("sm_90a", None, "sm_80"):
        monkeypatch.setattr(envar, "_arch", arch)
        settings = jit_cache._dsl_settings()
        assert "arch" not in settings and "/" not in settings and "lineinfo=" in settings
        seen.add((settings, jit_cache.cache_path("fwd_sm80", key)))
        assert envar._arch == arch  # never detected (no GPU query)
    assert len(seen) == 1
    monkeypatch.setattr(envar, "lineinfo", not envar.lineinfo)  # a real compile setting still counts
    assert jit_cache.cache_path("fwd_sm80", key) != seen.pop()[1]


class warnings_as_errors:
    def __enter__(self):
        import warnings

        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        warnings.simplefilter("error")

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
