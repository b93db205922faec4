"""Two-level cache of compiled kernels: in memory, then on disk.

``get_or_compile(name, key, compile_fn)`` returns a callable for ``(name, key)``:

1. the in-memory dict of this process;
2. unless ``FLASH_ATTN_CUTE_CACHE=0``, an object file in the per-user cache folder,
   loaded with ``cute.runtime.load_module(path, enable_tvm_ffi=True)`` (milliseconds
   instead of the seconds a compile takes);
3. an object file in one of the read-only pre-built folders of
   ``FLASH_ATTN_CUTE_PREBUILT=DIR1:DIR2`` (filled by ``python -m flash_attn_cute.aot``;
   never written, read even with ``FLASH_ATTN_CUTE_CACHE=0``);
4. otherwise ``compile_fn()`` (logged at INFO through the ``flash_attn_cute`` logger:
   what and how long), whose result is exported with ``export_to_c`` into the cache
   folder so that the next process finds it.

Layout on disk (the per-user cache and every pre-built folder alike)::

    $FLASH_ATTN_CUTE_CACHE_DIR                 (default: $XDG_CACHE_HOME/flash_attn_cute,
                                                or ~/.cache/flash_attn_cute)
      <fingerprint>/                           sha256 of every .py source of the package
                                               and of the cutlass-dsl and tvm-ffi versions
        <name>-<entry hash[:24]>.o             entry hash = sha256(repr((key, dsl settings)))
        <name>-<entry hash[:24]>.lock          fcntl lock: one process compiles, others wait

Editing any source of the package, or upgrading the DSL or TVM-FFI, changes the
fingerprint, so stale binaries are never loaded (old folders can simply be deleted).
The entry hash covers the key and the DSL's compile-affecting settings that are the
same on every machine (lineinfo, opt flags...). It leaves out the DSL's target arch,
which comes from ``CUTE_DSL_ARCH`` on a build machine but is detected from the GPU on a
server (every kernel's key names the arch it is compiled for, see
``cute_utils.target_arch``), and it reduces library paths to file names (the install
location is no compile input): an entry built ahead of time with
``CUTE_DSL_ARCH=sm_90a`` is the one an H200 asks for.

Loading an object file runs its code, so a folder (the cache root, its fingerprint
folder, a pre-built folder) or an entry that is not owned by the current user (or
root), or that group or others may write, is never loaded from: one warning per
folder, then the kernel is compiled in memory (and not saved there).

Files appear atomically (export to a temporary file in the same folder, then
``os.replace``), so a reader never sees a partial file and two racing writers both
succeed; a corrupted entry is recompiled and replaced. The cache is best effort: any
disk error is reported by one warning and the freshly compiled in-memory function is
used; a call never fails because of the cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import stat
import threading
import time
import uuid
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Optional

__all__ = ["get_or_compile", "clear_memory_cache", "stats", "reset_stats", "cache_dir", "cache_path",
           "cache_enabled", "prebuilt_dirs", "source_fingerprint"]

_PACKAGE_DIR = Path(__file__).resolve().parents[1]  # flash_attn_cute/ (this is flash_attn_cute/host/)
_CACHE_FORMAT = "2"  # bump when the on-disk layout, entry hash or export options change
_LOCK_TIMEOUT_S = 900.0  # longer than any single compile; then we compile without the lock
_FOLDER_MODE = 0o755  # folders we create: never writable by group or others, whatever the umask
_FILE_MODE = 0o644
# DSL settings that differ between a build machine and a server for the same binary.
_HOST_SPECIFIC_SETTINGS = ("arch",)
_PATH_SETTINGS = ("shared_libs",)

log = logging.getLogger("flash_attn_cute")

_memory: dict[tuple[str, tuple], Callable] = {}
_stats = {"memory_hits": 0, "compiles": 0, "disk_loads": 0, "prebuilt_loads": 0, "disk_writes": 0,
          "disk_errors": 0, "unsafe_skips": 0}
_mutex = threading.RLock()  # the DSL compiler is not meant to run concurrently in one process
_warned = False
_warned_unsafe: set[str] = set()


# ---------------------------------------------------------------------------------------
# Public helpers
# ---------------------------------------------------------------------------------------


def stats() -> dict:
    """Counters since import (or ``reset_stats``): memory hits, compiles, disk loads (of
    which from pre-built folders), disk writes, disk errors, entries or folders skipped
    as unsafe. Tests use them to prove that a process loaded from disk."""
    return dict(_stats)


def reset_stats() -> None:
    for k in _stats:
        _stats[k] = 0


def clear_memory_cache() -> None:
    """Forget every in-memory function (the disk cache is untouched)."""
    with _mutex:
        _memory.clear()


def cache_enabled() -> bool:
    """The per-user disk cache is on unless ``FLASH_ATTN_CUTE_CACHE`` is 0/false/off/no
    (pre-built folders are read either way)."""
    return os.environ.get("FLASH_ATTN_CUTE_CACHE", "1").strip().lower() not in ("0", "false", "off", "no")


def cache_dir() -> Path:
    """Root folder of the disk cache (before the fingerprint sub-folder)."""
    env = os.environ.get("FLASH_ATTN_CUTE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "flash_attn_cute"


def prebuilt_dirs() -> list[Path]:
    """The read-only folders of ``FLASH_ATTN_CUTE_PREBUILT`` (``os.pathsep``-separated), in
    the order they are searched, after the cache folder."""
    env = os.environ.get("FLASH_ATTN_CUTE_PREBUILT", "")
    return [Path(p).expanduser() for p in env.split(os.pathsep) if p.strip()]


def source_fingerprint(package_dir: Path | str | None = None) -> str:
    """sha256 over the package's ``.py`` sources (relative path, length and bytes of each,
    in sorted order), the cutlass-dsl version and the tvm-ffi version."""
    import cutlass
    import tvm_ffi

    root = Path(package_dir) if package_dir is not None else _PACKAGE_DIR
    h = hashlib.sha256()
    h.update(f"format={_CACHE_FORMAT};cutlass_dsl={cutlass.__version__};tvm_ffi={tvm_ffi.__version__};".encode())
    for src in sorted(p for p in root.rglob("*.py") if p.is_file()):
        data = src.read_bytes()
        h.update(src.relative_to(root).as_posix().encode() + b"\0")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


@lru_cache(maxsize=1)
def cached_fingerprint() -> str:
    # Computed once per process: sources edited after import are not what is running.
    return source_fingerprint()


def cache_path(name: str, key: tuple, root: Path | str | None = None) -> Path:
    """Where ``(name, key)`` lives under ``root`` (default: ``cache_dir()``; a pre-built
    folder has the same layout), whether or not it is there yet."""
    base = Path(root) if root is not None else cache_dir()
    return base / cached_fingerprint() / f"{name}-{_entry_digest(key)}.o"


# ---------------------------------------------------------------------------------------
# get_or_compile
# ---------------------------------------------------------------------------------------


def _check_key(key: Any) -> None:
    if isinstance(key, tuple):
        for k in key:
            _check_key(k)
        return
    assert key is None or isinstance(key, (bool, int, str)), (
        f"compile keys may only hold ints, strs, bools, None and tuples of them; got {key!r} "
        f"of type {type(key).__name__}"
    )


def get_or_compile(name: str, key: tuple, compile_fn: Callable[[], Any]) -> Callable:
    """The compiled function for ``(name, key)``; ``compile_fn()`` runs only on a miss of
    every cache. ``name`` is a short file-name-safe label (``fwd_sm80``, ``combine``);
    ``key`` a tuple of ints/strs/bools/None/tuples that determines the binary, target
    arch included."""
    assert isinstance(name, str) and re.fullmatch(r"[A-Za-z0-9_.-]+", name), f"bad cache name {name!r}"
    assert isinstance(key, tuple), f"compile key must be a tuple, got {type(key).__name__}"
    _check_key(key)
    mem_key = (name, key)
    fn = _memory.get(mem_key)
    if fn is not None:
        _stats["memory_hits"] += 1
        return fn
    with _mutex:
        fn = _memory.get(mem_key)
        if fn is None:
            fn = _load_or_compile(name, key, compile_fn)
            _memory[mem_key] = fn
        else:
            _stats["memory_hits"] += 1
    return fn


def _entry_digest(key: tuple) -> str:
    return hashlib.sha256(repr((key, _dsl_settings())).encode()).hexdigest()[:24]


def _compile(name: str, key: tuple, compile_fn: Callable[[], Any]) -> Any:
    t0 = time.perf_counter()
    fn = compile_fn()
    _stats["compiles"] += 1
    log.info("flash_attn_cute: compiled %s %r in %.2f s", name, key, time.perf_counter() - t0)
    return fn


def _load_or_compile(name: str, key: tuple, compile_fn: Callable[[], Any]) -> Callable:
    folder = None  # the writable fingerprint folder, when the per-user cache is usable
    func_name = None
    try:
        fingerprint, digest = cached_fingerprint(), _entry_digest(key)
        file_name, func_name = f"{name}-{digest}.o", "fac_" + digest  # deterministic symbol name
        if cache_enabled():
            folder = _prepare_folder(cache_dir(), fingerprint)
    except Exception as e:  # unwritable home, read-only FS, DSL internals moved...
        _disk_error("preparing the cache folder", e)
    if func_name is None:
        return _compile(name, key, compile_fn)

    seen = None  # the cache entry as the first load found it (missing, or not loadable)
    if folder is not None:
        seen = _signature(folder / file_name)
        fn = _try_load(folder / file_name, func_name)
        if fn is not None:
            return fn
    for root in prebuilt_dirs():
        fn = _try_load_prebuilt(root, fingerprint, file_name, func_name)
        if fn is not None:
            _stats["prebuilt_loads"] += 1
            return fn
    if folder is None:
        return _compile(name, key, compile_fn)

    path = folder / file_name
    with _file_lock(path.with_suffix(".lock")):
        # Another process may have written it while we waited for the lock (a file
        # that failed to load and is unchanged is not loaded twice).
        fn = _try_load(path, func_name) if _signature(path) != seen else None
        if fn is not None:
            return fn
        fn = _compile(name, key, compile_fn)
        _try_export(fn, path, func_name)
    return fn


def _prepare_folder(root: Path, fingerprint: str) -> Optional[Path]:
    """Creates ``root/fingerprint`` (mode 755) and returns it, or None (after one warning)
    when either folder is not safe to load from."""
    folder = root / fingerprint
    for f in (root, folder):
        if not f.is_dir():
            f.mkdir(mode=_FOLDER_MODE, parents=True, exist_ok=True)
        if not _is_safe(f):
            return None
    return folder


def _try_load_prebuilt(root: Path, fingerprint: str, file_name: str, func_name: str):
    path = root / fingerprint / file_name
    try:
        if not path.exists() or not (_is_safe(root) and _is_safe(path.parent)):
            return None
    except OSError as e:  # e.g. a folder we may not stat
        _disk_error(f"reading {root}", e)
        return None
    return _try_load(path, func_name)


def unsafe_reason(path: Path) -> Optional[str]:
    """Why loading code from ``path`` (a folder or an object file) could run someone
    else's code: an owner other than us or root, or write access for group or others."""
    st = os.stat(path)
    if hasattr(os, "geteuid") and st.st_uid not in (os.geteuid(), 0):
        return f"it is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"it is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _is_safe(path: Path) -> bool:
    reason = unsafe_reason(path)
    if reason is None:
        return True
    _stats["unsafe_skips"] += 1
    if str(path) not in _warned_unsafe:
        _warned_unsafe.add(str(path))
        warnings.warn(
            f"flash_attn_cute: not loading compiled kernels from {path}: {reason}, and loading an "
            f"object file runs its code; compiling in memory instead. Make it yours and "
            f"`chmod go-w` it, or point FLASH_ATTN_CUTE_CACHE_DIR at a folder of your own.",
            RuntimeWarning,
            stacklevel=5,
        )
    return False


def _signature(path: Path):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def _try_load(path: Path, func_name: str):
    try:
        if not path.exists() or not _is_safe(path):
            return None
        import cutlass.cute as cute

        module = cute.runtime.load_module(str(path), enable_tvm_ffi=True)
        fn = getattr(module, func_name)
    except Exception as e:  # truncated / foreign file: recompile and overwrite it
        _disk_error(f"loading {path}", e)
        return None
    _stats["disk_loads"] += 1
    return fn


def _try_export(fn: Any, path: Path, func_name: str) -> None:
    # The temporary name must end in ".o": export_to_c picks the format from the suffix.
    tmp = path.with_name(f".{path.stem}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp.o")
    try:
        fn.export_to_c(str(tmp), function_name=func_name)
        os.chmod(tmp, _FILE_MODE)  # not group-writable under any umask: we load it later
        os.replace(tmp, path)  # atomic: readers see the old state or the whole file
        _stats["disk_writes"] += 1
    except Exception as e:
        _disk_error(f"writing {path}", e)
        with contextlib.suppress(OSError):
            tmp.unlink()


def _dsl_settings() -> str:
    """The DSL's compile-affecting settings that mean the same on every machine: all of
    ``cache_key_str``'s but the target arch (from ``CUTE_DSL_ARCH`` on a build machine,
    detected on a server, named by every key anyway; never read here, so no GPU query),
    with library paths reduced to their file names."""
    try:
        from cutlass.cutlass_dsl import CuTeDSL

        envar = CuTeDSL._get_dsl().envar
        parts = []
        for entry in sorted(type(envar)._ENV_VAR_SPEC, key=lambda e: e.key_name):
            if not entry.affects_compile or entry.key_name in _HOST_SPECIFIC_SETTINGS:
                continue
            value = getattr(envar, entry.attribute)
            if value is None:
                continue
            if entry.key_name in _PATH_SETTINGS:
                value = ",".join(os.path.basename(p) for p in re.split(r"[,;:]", str(value)) if p)
            parts.append(f"{entry.key_name}={value!r};")
        return "".join(parts)
    except Exception:  # private API moved: fall back to the raw environment
        return ";".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                        if k.startswith("CUTE_DSL_") and k != "CUTE_DSL_ARCH")


@contextlib.contextmanager
def _file_lock(lock_path: Path):
    """Exclusive fcntl lock so that processes racing on one key compile it once; if the
    lock cannot be taken (no fcntl, odd file system, timeout) we go on without it, which
    is still correct because the final rename is atomic."""
    fd = None
    try:
        import fcntl

        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + _LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"waited {_LOCK_TIMEOUT_S:.0f} s for {lock_path}")
                time.sleep(0.05)
    except Exception as e:
        _disk_error(f"locking {lock_path}", e)
        if fd is not None:
            os.close(fd)
            fd = None
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # closing the descriptor releases the flock


def _disk_error(what: str, err: BaseException) -> None:
    global _warned
    _stats["disk_errors"] += 1
    if not _warned:
        _warned = True
        warnings.warn(
            f"flash_attn_cute: disk kernel cache unavailable ({what}: {type(err).__name__}: {err}); "
            "using in-memory compilation only. Set FLASH_ATTN_CUTE_CACHE=0 to silence this, or "
            "FLASH_ATTN_CUTE_CACHE_DIR to a writable folder.",
            RuntimeWarning,
            stacklevel=4,
        )
