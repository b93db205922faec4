"""Two-level cache of compiled kernels: in memory, then on disk.

``get_or_compile(name, key, compile_fn)`` returns a callable for ``(name, key)``:

1. the in-memory dict of this process;
2. unless ``FLASH_ATTN_CUTE_CACHE=0``, an object file on disk, loaded with
   ``cute.runtime.load_module(path, enable_tvm_ffi=True)`` (milliseconds instead of
   the seconds a compile takes);
3. otherwise ``compile_fn()``, whose result is exported with ``export_to_c`` so that
   the next process finds it on disk.

Layout on disk::

    $FLASH_ATTN_CUTE_CACHE_DIR                 (default: $XDG_CACHE_HOME/flash_attn_cute,
                                                or ~/.cache/flash_attn_cute)
      <fingerprint>/                           sha256 of every .py source of the package
                                               and of the cutlass-dsl and tvm-ffi versions
        <name>-<entry hash[:24]>.o             entry hash = sha256(repr((key, dsl settings)))
        <name>-<entry hash[:24]>.lock          fcntl lock: one process compiles, others wait

Editing any source of the package, or upgrading the DSL or TVM-FFI, changes the
fingerprint, so stale binaries are never loaded (old folders can simply be deleted).
The entry hash also covers the DSL's compile-affecting settings (target arch from
``CUTE_DSL_ARCH`` or the detected GPU, lineinfo, opt flags...), so an ``sm_80`` binary
compiled on a CPU machine is never handed to an ``sm_90`` GPU by mistake; keys still
should name everything the kernel specialises on.

Files appear atomically (export to a temporary file in the same folder, then
``os.replace``), so a reader never sees a partial file and two racing writers both
succeed. The cache is best effort: any disk error is reported by one warning and the
freshly compiled in-memory function is used; a call never fails because of the cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import threading
import time
import uuid
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

__all__ = ["get_or_compile", "clear_memory_cache", "stats", "reset_stats", "cache_dir", "cache_path",
           "cache_enabled", "source_fingerprint"]

_PACKAGE_DIR = Path(__file__).resolve().parent
_CACHE_FORMAT = "1"  # bump when the on-disk layout or export options change
_LOCK_TIMEOUT_S = 900.0  # longer than any single compile; then we compile without the lock

_memory: dict[tuple[str, tuple], Callable] = {}
_stats = {"memory_hits": 0, "compiles": 0, "disk_loads": 0, "disk_writes": 0, "disk_errors": 0}
_mutex = threading.RLock()  # the DSL compiler is not meant to run concurrently in one process
_warned = False


# ---------------------------------------------------------------------------------------
# Public helpers
# ---------------------------------------------------------------------------------------


def stats() -> dict:
    """Counters since import (or ``reset_stats``): memory hits, compiles, disk loads and
    writes, disk errors. Tests use them to prove that a process loaded from disk."""
    return dict(_stats)


def reset_stats() -> None:
    for k in _stats:
        _stats[k] = 0


def clear_memory_cache() -> None:
    """Forget every in-memory function (the disk cache is untouched)."""
    with _mutex:
        _memory.clear()


def cache_enabled() -> bool:
    """The disk cache is on unless ``FLASH_ATTN_CUTE_CACHE`` is 0/false/off/no."""
    return os.environ.get("FLASH_ATTN_CUTE_CACHE", "1").strip().lower() not in ("0", "false", "off", "no")


def cache_dir() -> Path:
    """Root folder of the disk cache (before the fingerprint sub-folder)."""
    env = os.environ.get("FLASH_ATTN_CUTE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "flash_attn_cute"


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
def _cached_fingerprint() -> str:
    # Computed once per process: sources edited after import are not what is running.
    return source_fingerprint()


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
    both caches. ``name`` is a short file-name-safe label (``fwd_sm80``, ``combine``);
    ``key`` a tuple of ints/strs/bools/None/tuples that determines the binary."""
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


def cache_path(name: str, key: tuple) -> Path:
    """Where ``(name, key)`` lives on disk (whether or not it is there yet)."""
    digest = hashlib.sha256(repr((key, _dsl_settings())).encode()).hexdigest()[:24]
    return cache_dir() / _cached_fingerprint() / f"{name}-{digest}.o"


def _compile(compile_fn: Callable[[], Any]) -> Any:
    fn = compile_fn()
    _stats["compiles"] += 1
    return fn


def _load_or_compile(name: str, key: tuple, compile_fn: Callable[[], Any]) -> Callable:
    if not cache_enabled():
        return _compile(compile_fn)
    try:
        path = cache_path(name, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        func_name = "fac_" + path.stem.rsplit("-", 1)[1]  # deterministic symbol name
    except Exception as e:  # unwritable home, read-only FS, DSL internals moved...
        _disk_error("preparing the cache folder", e)
        return _compile(compile_fn)

    fn = _try_load(path, func_name)
    if fn is not None:
        return fn
    with _file_lock(path.with_suffix(".lock")):
        # Another process may have written it while we waited for the lock.
        fn = _try_load(path, func_name)
        if fn is not None:
            return fn
        fn = _compile(compile_fn)
        _try_export(fn, path, func_name)
    return fn


def _try_load(path: Path, func_name: str):
    if not path.exists():
        return None
    try:
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
        os.replace(tmp, path)  # atomic: readers see the old state or the whole file
        _stats["disk_writes"] += 1
    except Exception as e:
        _disk_error(f"writing {path}", e)
        with contextlib.suppress(OSError):
            tmp.unlink()


def _dsl_settings() -> str:
    """The DSL's compile-affecting settings (target arch, lineinfo, opt flags...)."""
    try:
        from cutlass.cutlass_dsl import CuTeDSL

        return CuTeDSL._get_dsl().envar.cache_key_str()
    except Exception:  # private API moved: fall back to the raw environment
        return ";".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("CUTE_DSL_"))


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
