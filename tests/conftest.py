"""Shared pytest set-up.

- Tests marked ``gpu`` (the marker is registered in pyproject.toml) are skipped when
  ``torch.cuda.is_available()`` is False, so ``python -m pytest -q tests`` passes on a
  CPU-only machine and runs everything on a GPU one.
- A GPU test whose call the backend under test refuses is skipped with the reason.
- ``jit_cache_dir``: a fresh disk-cache folder for the JIT cache tests only, so they
  neither read nor pollute the user's ~/.cache/flash_attn_cute. Other tests (the GPU
  tests in particular) keep the normal cache so repeated runs stay fast.
"""

import os

import pytest
import torch


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    # trylast: slice after ``-m gpu`` has deselected the CPU tests, so every shard of a
    # GPU run gets GPU tests (sliced first, the first shards held only CPU tests).
    _keep_shard(config, items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _keep_shard(config, items):
    """FLASH_ATTN_CUTE_TEST_SHARD="i/n" keeps the i-th of n contiguous slices of the
    collected tests, so n processes can split a GPU run. Slices are contiguous because
    neighbouring tests share a compiled kernel: each kernel then compiles in one shard."""
    spec = os.environ.get("FLASH_ATTN_CUTE_TEST_SHARD")
    if not spec:
        return
    i, n = (int(x) for x in spec.split("/"))
    lo, hi = len(items) * i // n, len(items) * (i + 1) // n
    deselected = items[:lo] + items[hi:]
    items[:] = items[lo:hi]
    config.hook.pytest_deselected(items=deselected)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """A GPU test whose call the requested backend refuses (its ``check`` names a reason:
    a head dim or page size it does not compile) is reported as skipped, with the reason."""
    outcome = yield
    exc = outcome.excinfo
    if exc and issubclass(exc[0], NotImplementedError) and "cannot run this call" in str(exc[1]):
        if "gpu" in item.keywords:
            outcome.force_exception(pytest.skip.Exception(str(exc[1]), _use_item_location=True))


@pytest.fixture
def jit_cache_dir(tmp_path, monkeypatch):
    """Points FLASH_ATTN_CUTE_CACHE_DIR at an empty temporary folder (and enables the disk
    cache) for this test and the subprocesses it starts; clears the in-memory cache and
    the counters around it."""
    from flash_attn_cute.host import jit_cache

    cache = tmp_path / "jit_cache"
    monkeypatch.setenv("FLASH_ATTN_CUTE_CACHE_DIR", str(cache))
    monkeypatch.delenv("FLASH_ATTN_CUTE_CACHE", raising=False)
    jit_cache.clear_memory_cache()
    jit_cache.reset_stats()
    yield cache
    jit_cache.clear_memory_cache()
    jit_cache.reset_stats()


@pytest.fixture
def fake_device(monkeypatch):
    """CPU tensors pass as a 132-SM Hopper GPU (capability 9.0, device check off, caches
    cleared around the test); ``use(backend_module)`` installs a stand-in for
    ``seam.backend_module(name, kind)`` (fake launchers: the launch contract without a kernel);
    the split-KV combine is a no-op unless the test installs its own."""
    from flash_attn_cute.api import call_cache, checks
    from flash_attn_cute.host import heuristics
    from flash_attn_cute import seam

    call_cache.clear()
    monkeypatch.setattr(checks, "check_device", lambda tensors: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(heuristics, "num_sms", lambda device: 132)
    monkeypatch.setattr(seam, "combine_launcher", lambda out_dtype, d_v, has_lse, has_sink=False, split_groups=1,
                        arch=None, split_info=False: lambda *tensors: None)
    monkeypatch.delenv("FLASH_ATTN_CUTE_BACKEND", raising=False)
    yield lambda backend_module: monkeypatch.setattr(seam, "backend_module", backend_module)
    call_cache.clear()
