"""Ahead-of-time builds: compile a list of configurations on a machine without a GPU,
into the on-disk layout the JIT cache reads, so that a server compiles nothing.

Why: a first call compiles its kernel (seconds per configuration, more on a busy
host); a serving process would pay that on its first requests of each shape class.
Building the same binaries beforehand (in CI, or in the image build) and pointing the
server at them removes every compile from the serving path::

    python -m flash_attn_cute.aot --arch sm_90a --preset decode --out DIR [--jobs N]
                                  [--backend sm80] [--dry-run]

    FLASH_ATTN_CUTE_CACHE_DIR=DIR python serve.py    # a writable cache seeded with them
    FLASH_ATTN_CUTE_PREBUILT=DIR python serve.py     # read-only, searched after the cache

``--arch`` is the arch the server will ask for: ``cute_utils.target_arch`` (``sm_80``
on an A100, ``sm_86`` on an A10, ``sm_90a`` on an H100/H200, ``sm_100a`` on a B200).
``--preset`` is ``decode``, ``prefill``, ``serving``, ``mla``, ``all`` (the four) or a JSON file
holding a list of descriptions. The package sources and the DSL/TVM-FFI versions must be the ones the
server runs (they make the cache's fingerprint folder). Several worker processes
(``--jobs``, default: the CPU count; about 1 GB of memory each) compile in parallel;
each gets ``CUTE_DSL_ARCH`` in its environment before it imports the DSL (which reads
it once) and writes through ``jit_cache.get_or_compile``, the very code path of a
first call, so file names and format cannot diverge. Entries already in DIR are
kept. A progress bar goes to stderr; ``DIR/<fingerprint>/aot-manifest.json`` lists
what was built (``read_manifest``).

A description is a JSON object describing calls of the public API; every field is
optional, and a field given as a list expands to one description per combination
(``"window"`` takes a pair, or a list of pairs)::

    api               "func" (default) | "varlen" | "kvcache" | "serving" | "mla":
                      flash_attn_func, flash_attn_varlen_func (cu_seqlens q and k),
                      flash_attn_with_kvcache (cache_seqlens), a serving step
                      (flash_attn_varlen_func with cu_seqlens_q, seqused_k and, with
                      page_size, page_table: seqlen_q is its max_seqlen_q, and a step
                      mixing short and long rows builds both launches of its mixed
                      plan) or flash_mla_decode (qhead_per_kvhead query heads per KV head;
                      nheads_kv 1 is one latent head, > 1 caches with a KV-head mode)
    dtype             "bf16" (default) | "fp16" | "e4m3" (FP8 attention: q, k, v in e4m3 with
                      their descales, bf16 out; Hopper, not with api mla or kv_fp8)
    d, d_v            head dims of q/k and v (default 128; d_v defaults to d)
    qhead_per_kvhead  GQA ratio (default 1); nheads_kv (default 8), batch (default 1)
    seqlen_q          max_seqlen_q: 1 for decode (default), e.g. 4096 for prefill
    seqlen_k          max_seqlen_k, the cache capacity for kvcache (default 4096)
    causal            bool (default false); window [left, right] (default [-1, -1])
    softcap           float (default 0)
    page_size         kvcache, serving and mla: 0 (default) = contiguous cache, > 0 = paged
    has_lse           return_lse (default false)
    num_splits        1 (default), > 1 for split-KV (adds the combine kernel it
                      needs), 0 = the runtime heuristic, which then needs num_sms (mla:
                      the split and the unsplit kernel, whose choice weighs the device's
                      HBM bandwidth)
    num_sms, pack_gqa as the runtime gets them (default null: the auto rules)
    learnable_sink, seqused_q, batch_invariant
                      bools (default false): a sink tensor, a seqused_q tensor,
                      batch_invariant=True (mla: batch_invariant only)
    kv_fp8            bool (default false): an e4m3 K/V cache with its descales (mla:
                      an e4m3 latent cache; refused below compute capability 8.9, as at runtime)
    fp8_two_level_interval
                      int >= 0 (default 0): the keyword of that name (dtype e4m3 or kv_fp8;
                      ignored, as at runtime, elsewhere)
    schedule          bool (default false), api mla: calls with ``scheduler_metadata``
                      (``get_mla_metadata``): its kernel, and the kernel and combine that
                      run it where the runtime would (num_splits 0)

Each description becomes a problem (``FwdProblem``, ``MlaProblem``); the backend the runtime would pick for the
arch (or ``--backend``) turns it into a key through its ``plan`` and ``compile_key``,
so the keys are exactly those its launcher asks for. Descriptions that no backend
runs are reported and skipped.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import math
import multiprocessing
import os
import sys
import time
import uuid
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple, Optional

from flash_attn_cute.host.constants import MLA_MAX_NHEADS, MLA_NHEADS
from flash_attn_cute.host.keys import arch_capability

__all__ = ["PRESETS", "AotEntry", "load_descriptions", "expand", "entries_for", "build", "read_manifest", "main"]

MANIFEST = "aot-manifest.json"
_PAGE_SIZES = [0, 16, 64, 256]  # one paged key on SM80; on SM90, 16 is a row-gather key, 64 and 256 TMA keys
PRESETS = {
    # Serving decode: one query per sequence against a contiguous or paged cache,
    # GQA packed, with and without split-KV (and the combine kernels it needs).
    "decode": [
        {"api": "kvcache", "dtype": ["bf16", "fp16"], "d": [64, 128], "qhead_per_kvhead": [1, 4, 8],
         "seqlen_q": 1, "seqlen_k": 8192, "page_size": _PAGE_SIZES, "causal": [False, True],
         "num_splits": [1, 4], "has_lse": [False, True]},
    ],
    # MLA decode (flash_mla_decode): the query heads are qhead_per_kvhead over one latent
    # KV head; the keys depend on dtype, heads, causal, split and LSE only.
    "mla": [
        {"api": "mla", "dtype": ["bf16", "fp16"], "qhead_per_kvhead": [16, 32, 64, 128], "nheads_kv": 1,
         "seqlen_q": 1, "seqlen_k": 8192, "page_size": 64, "causal": [False, True], "num_splits": [1, 4],
         "has_lse": [False, True]},
    ],
    # A serving engine's step: packed queries over a paged cache with per-sequence key
    # counts, decode-only (max_seqlen_q 1) or mixed with chunked prefill (a mixed plan:
    # the decode-tile and prefill-tile launches), with and without sinks and split-KV.
    "serving": [
        {"api": "serving", "dtype": ["bf16", "fp16"], "d": [64, 128], "qhead_per_kvhead": [1, 4, 8],
         "seqlen_q": [1, 2048], "seqlen_k": 32768, "page_size": [16, 64], "causal": True, "num_splits": [1, 4],
         "learnable_sink": [False, True]},
    ],
    # Prefill: dense and packed variable-length batches (varlen packs GQA heads).
    "prefill": [
        {"api": ["func", "varlen"], "dtype": ["bf16", "fp16"], "d": [64, 128, 256], "causal": [False, True],
         "qhead_per_kvhead": [1, 4, 8], "seqlen_q": 4096, "seqlen_k": 4096},
        {"api": ["func", "varlen"], "dtype": ["bf16", "fp16"], "d": 192, "d_v": 128, "causal": [False, True],
         "qhead_per_kvhead": [1, 4, 8], "seqlen_q": 4096, "seqlen_k": 4096},
    ],
}
_DEFAULTS = {"api": "func", "dtype": "bf16", "d": 128, "d_v": None, "qhead_per_kvhead": 1, "nheads_kv": 8,
             "batch": 1, "seqlen_q": 1, "seqlen_k": 4096, "causal": False, "window": [-1, -1], "softcap": 0.0,
             "page_size": 0, "has_lse": False, "num_splits": 1, "num_sms": None, "pack_gqa": None,
             "learnable_sink": False, "seqused_q": False, "batch_invariant": False, "kv_fp8": False,
             "fp8_two_level_interval": 0, "schedule": False}
_APIS = {"func": (False, False, False), "varlen": (True, True, False), "kvcache": (False, False, True),
         "serving": (True, False, True), "mla": (False, False, True)}
_DTYPES = ("bf16", "fp16", "e4m3")


class AotEntry(NamedTuple):
    """One binary: the cache name and key the launcher asks for, and ``module:function``
    that compiles the key."""

    name: str
    key: tuple
    target: str


# ---------------------------------------------------------------------------------------
# Descriptions -> problems -> keys
# ---------------------------------------------------------------------------------------


def load_descriptions(preset: str) -> list:
    """The descriptions of a preset name (``decode``, ``prefill``, ``serving``, ``mla``,
    ``all``) or JSON file."""
    if preset == "all":
        return PRESETS["decode"] + PRESETS["prefill"] + PRESETS["serving"] + PRESETS["mla"]
    if preset in PRESETS:
        return list(PRESETS[preset])
    path = Path(preset)
    if not path.is_file():
        raise ValueError(f"--preset must be one of {sorted(PRESETS) + ['all']} or a JSON file, got {preset!r}")
    data = json.loads(path.read_text())
    if not isinstance(data, list) or not all(isinstance(d, dict) for d in data):
        raise ValueError(f"{path}: expected a JSON list of objects (descriptions), got {type(data).__name__}")
    return data


def expand(description: dict) -> list:
    """The single-valued descriptions (defaults filled in) a description stands for."""
    unknown = set(description) - set(_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown field(s) {sorted(unknown)} in {description}; known: {sorted(_DEFAULTS)}")
    fields = {**_DEFAULTS, **description}
    choices = []
    for name, value in fields.items():
        is_product = isinstance(value, list) and (name != "window" or (value and isinstance(value[0], list)))
        choices.append([(name, v) for v in value] if is_product else [(name, value)])
    out = []
    for combo in itertools.product(*choices):
        one = dict(combo)
        _validate(one)
        out.append(one)
    return out


def _validate(one: dict) -> None:
    def need(ok: bool, what: str):
        if not ok:
            raise ValueError(f"{what}, in {one}")

    is_int = lambda x: isinstance(x, int) and not isinstance(x, bool)
    need(one["api"] in _APIS, f"api must be one of {sorted(_APIS)}")
    need(one["dtype"] in _DTYPES, f"dtype must be one of {_DTYPES}")
    for f in ("d", "qhead_per_kvhead", "nheads_kv", "batch", "seqlen_q", "seqlen_k"):
        need(is_int(one[f]) and one[f] >= 1, f"{f} must be an int >= 1")
    need(one["d_v"] is None or (is_int(one["d_v"]) and one["d_v"] >= 1), "d_v must be an int >= 1 or null")
    for f in ("causal", "has_lse", "learnable_sink", "seqused_q", "batch_invariant", "kv_fp8"):
        need(isinstance(one[f], bool), f"{f} must be true or false")
    need(one["pack_gqa"] is None or isinstance(one["pack_gqa"], bool), "pack_gqa must be true, false or null")
    need(isinstance(one["softcap"], (int, float)) and not isinstance(one["softcap"], bool)
         and math.isfinite(one["softcap"]) and one["softcap"] >= 0, "softcap must be a number >= 0")
    need(isinstance(one["window"], list) and len(one["window"]) == 2, "window must be a pair [left, right]")
    need(is_int(one["page_size"]) and one["page_size"] >= 0, "page_size must be an int >= 0")
    need(one["page_size"] == 0 or one["api"] in ("kvcache", "serving", "mla"),
         "page_size > 0 needs api kvcache, serving or mla")
    need(one["dtype"] != "e4m3" or (one["api"] != "mla" and not one["kv_fp8"]),
         "dtype e4m3 (FP8 attention) is not for api mla nor with kv_fp8 (an FP8 cache under 16-bit queries)")
    if one["api"] == "mla":
        need(one["nheads_kv"] * one["qhead_per_kvhead"] in MLA_NHEADS,
             f"api mla: nheads_kv * qhead_per_kvhead (the query heads) in 1..{MLA_MAX_NHEADS}")
        need(not (one["learnable_sink"] or one["seqused_q"]), "api mla has no learnable_sink or seqused_q")
    need(not one["schedule"] or one["api"] == "mla", "schedule (scheduler_metadata) is for api mla")
    need(is_int(one["num_splits"]) and one["num_splits"] >= 0, "num_splits must be an int >= 0")
    need(is_int(one["fp8_two_level_interval"]) and one["fp8_two_level_interval"] >= 0,
         "fp8_two_level_interval must be an int >= 0")
    need(one["num_sms"] is None or (is_int(one["num_sms"]) and one["num_sms"] >= 1), "num_sms must be >= 1")
    need(one["num_splits"] != 0 or one["num_sms"] is not None, "num_splits 0 (auto) needs num_sms")


def problem_of(one: dict):
    """The problem (``FwdProblem``, or ``MlaProblem`` for api "mla") of an expanded
    description, as the public API builds it."""
    import torch

    from flash_attn_cute.api.checks import normalize_window
    from flash_attn_cute.host.problems import FwdProblem, MlaProblem

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "e4m3": torch.float8_e4m3fn}[one["dtype"]]
    if one["api"] == "mla":
        return MlaProblem(dtype=dtype, batch=one["batch"], max_seqlen_q=one["seqlen_q"], max_seqlen_k=one["seqlen_k"],
                          nheads=one["nheads_kv"] * one["qhead_per_kvhead"], nheads_kv=one["nheads_kv"],
                          page_size=max(1, one["page_size"]),
                          softmax_scale=576 ** -0.5, causal=one["causal"], has_lse=one["has_lse"],
                          batch_invariant=one["batch_invariant"],
                          kv_dtype=torch.float8_e4m3fn if one["kv_fp8"] else None,
                          schedule_parts=1 if one["schedule"] else 0)  # (its parts: no compile-key input)
    causal, window_left, window_right = normalize_window(one["causal"], tuple(one["window"]))
    varlen_q, varlen_k, seqused_k = _APIS[one["api"]]
    d, d_v = one["d"], one["d_v"] or one["d"]
    return FwdProblem(dtype=dtype, batch=one["batch"], max_seqlen_q=one["seqlen_q"], max_seqlen_k=one["seqlen_k"],
                      nheads=one["nheads_kv"] * one["qhead_per_kvhead"], nheads_kv=one["nheads_kv"], d=d, d_v=d_v,
                      softmax_scale=d ** -0.5, causal=causal, window_left=window_left, window_right=window_right,
                      softcap=float(one["softcap"]), varlen_q=varlen_q, varlen_k=varlen_k, has_seqused_k=seqused_k,
                      page_size=one["page_size"], has_lse=one["has_lse"], has_seqused_q=one["seqused_q"],
                      has_sink=one["learnable_sink"], batch_invariant=one["batch_invariant"],
                      kv_dtype=torch.float8_e4m3fn if one["kv_fp8"] else None,
                      fp8_two_level_interval=one["fp8_two_level_interval"] if one["dtype"] == "e4m3" or one["kv_fp8"]
                      else 0)


def _backend_for(arch: str, requested: Optional[str], problem):
    """(name, module, None) of the backend the runtime would run ``problem`` with on
    ``arch`` (``seam.select_backend``'s rule), or (None, None, why not)."""
    from flash_attn_cute import seam

    kind = problem.kind
    if requested is not None and requested in seam.REGISTRIES[kind]:
        names = [requested]
    else:
        names = seam.candidates(kind, arch_capability(arch))
    reasons = []
    for name in names:
        module = seam.backend_module(name, kind)
        reason = module.check(problem)
        if reason is None:
            return name, module, None
        reasons.append(f"{name}: {reason}")
    return None, None, "; ".join(reasons) or f"no {kind} backend runs on {arch}"


def entries_for(descriptions: list, arch: str, backend: Optional[str] = None) -> tuple:
    """(entries, skipped): the distinct binaries the descriptions need on ``arch``, in
    order, and a line per expanded description that no backend runs."""
    from flash_attn_cute import seam
    from flash_attn_cute.host.keys import DTYPE_NAMES, combine_key
    from flash_attn_cute.host.mla_schedule import schedule_key

    arch_capability(arch)  # refuses a malformed arch before any work
    entries, skipped = {}, []
    for description in descriptions:
        for one in expand(description):
            whole = problem_of(one)
            reason = seam.capability_refusal(whole, arch_capability(arch))
            if reason is not None:
                skipped.append(f"{one}: {reason}")
                continue
            for problem, num_splits in seam.mixed_parts(whole, one["num_splits"]):  # as seam.resolve plans it
                name, module, reason = _backend_for(arch, backend, problem)
                if name is None:
                    skipped.append(f"{one}: {reason}")
                    continue
                plans = [module.plan(problem, num_splits, one["pack_gqa"], one["num_sms"], arch=arch)]
                weighs = getattr(module, "splits_weigh_bandwidth", None)  # an optional backend hook
                if num_splits == 0 and weighs is not None and weighs(problem):
                    # The split count weighs the device's HBM bandwidth, which the description
                    # does not state: the split and the unsplit kernel both.
                    plans += [module.plan(problem, n, one["pack_gqa"], one["num_sms"], arch=arch) for n in (1, 2)]
                target = f"{seam.REGISTRIES[problem.kind][name]}:compile"
                for plan in plans:
                    key = module.compile_key(problem, plan, arch)
                    entries.setdefault((key[0], key), AotEntry(key[0], key, target))
                    if plan.is_split:
                        ckey = combine_key(DTYPE_NAMES[problem.out_dtype], problem.d_v, problem.has_lse, arch,
                                           problem.has_sink, plan.scheduled)
                        entries.setdefault(("combine", ckey),
                                           AotEntry("combine", ckey, "flash_attn_cute.kernels.combine:compile_combine"))
                if one["schedule"]:  # get_mla_metadata's kernel, whichever kernel runs the call
                    skey = schedule_key(arch)
                    entries.setdefault((skey[0], skey), AotEntry(skey[0], skey, "flash_attn_cute.kernels.mla_schedule:"
                                                                                 "compile_from_key"))
    return list(entries.values()), skipped


# ---------------------------------------------------------------------------------------
# Parallel build
# ---------------------------------------------------------------------------------------


def _build_one(task: tuple) -> dict:
    """Worker body: compile (or find) one entry through the JIT cache under $CUTE_DSL_ARCH."""
    name, key, target, arch = task
    result = {"name": name, "key": key, "target": target, "arch": arch, "compiled": False, "error": None}
    t0, cpu0 = time.perf_counter(), time.process_time()
    try:
        if os.environ.get("CUTE_DSL_ARCH") != arch:
            raise RuntimeError(f"worker started with CUTE_DSL_ARCH={os.environ.get('CUTE_DSL_ARCH')!r}, not {arch!r}")
        from flash_attn_cute.host import jit_cache

        module_name, fn_name = target.split(":")
        compile_fn = getattr(importlib.import_module(module_name), fn_name)
        before = jit_cache.stats()["compiles"]
        jit_cache.get_or_compile(name, key, lambda: compile_fn(key))
        result["compiled"] = jit_cache.stats()["compiles"] > before
        jit_cache.clear_memory_cache()  # a worker builds many: keep its memory flat
        path = jit_cache.cache_path(name, key)
        if not path.is_file():
            raise RuntimeError(f"compiled, but {path} was not written (see the warning above)")
        result.update(file=path.name, fingerprint=path.parent.name)
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"
    result["seconds"], result["cpu_seconds"] = time.perf_counter() - t0, time.process_time() - cpu0
    return result


@contextmanager
def _worker_env(arch: str, out: Path):
    """The environment worker processes start with (they inherit it at spawn): the
    target arch before any DSL import, the output folder as their cache, no pre-built
    folders (an entry found there would not be written to ``out``)."""
    saved = dict(os.environ)
    os.environ.update(CUTE_DSL_ARCH=arch, FLASH_ATTN_CUTE_CACHE_DIR=str(out), FLASH_ATTN_CUTE_CACHE="1")
    os.environ.pop("FLASH_ATTN_CUTE_PREBUILT", None)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


class _Progress:
    """done/total bar on a stream: redrawn in place on a terminal, a line per entry otherwise."""

    def __init__(self, total: int, label: str, stream):
        self.total, self.label, self.stream, self.done = total, label, stream, 0
        self.t0 = time.perf_counter()
        self.tty = hasattr(stream, "isatty") and stream.isatty()

    def update(self, r: dict) -> None:
        self.done += 1
        width = 24
        filled = width * self.done // max(self.total, 1)
        elapsed = int(time.perf_counter() - self.t0)
        what = "FAILED" if r["error"] else ("compiled" if r["compiled"] else "present")
        line = (f"[aot {self.label}] [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                f"{elapsed // 60}:{elapsed % 60:02d}  {r['name']} {what} in {r['seconds']:.1f} s")
        if self.tty:
            self.stream.write("\r" + line + "\033[K" + ("\n" if self.done == self.total else ""))
        else:
            self.stream.write(line + "\n")
        if r["error"]:
            newline = "\n" if self.tty and self.done < self.total else ""
            self.stream.write(f"{newline}  {r['name']} {r['key']}: {r['error']}\n")
        self.stream.flush()


def build(entries: list, arch: str, out, jobs: Optional[int] = None, stream=None) -> dict:
    """Compiles ``entries`` for ``arch`` into ``out`` with ``jobs`` spawned processes;
    returns a summary (counts, seconds, the fingerprint folder, failures) and updates
    the folder's manifest."""
    from flash_attn_cute.host import jit_cache

    stream = sys.stderr if stream is None else stream
    out = Path(out).expanduser().resolve()
    out.mkdir(mode=0o755, parents=True, exist_ok=True)
    unsafe = jit_cache.unsafe_reason(out)
    if unsafe is not None:  # the JIT would refuse to write (and to load) there
        raise ValueError(f"--out {out}: {unsafe}; use a folder of your own, not writable by group or others")
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(entries) or 1))
    tasks = [(e.name, e.key, e.target, arch) for e in entries]
    results, t0 = [], time.perf_counter()
    progress = _Progress(len(tasks), arch, stream)
    with _worker_env(arch, out), ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        worker = importlib.import_module(f"{__package__}.aot")._build_one  # picklable under `python -m`
        futures = {pool.submit(worker, t): t for t in tasks}
        for future in as_completed(futures):
            try:
                r = future.result()
            except Exception as e:  # a worker died (out of memory, a crash in the compiler)
                name, key, target, _ = futures[future]
                r = {"name": name, "key": key, "target": target, "arch": arch, "compiled": False,
                     "error": f"worker died: {type(e).__name__}: {e}", "seconds": 0.0, "cpu_seconds": 0.0}
            results.append(r)
            progress.update(r)
    ok = [r for r in results if not r["error"]]
    fingerprints = sorted({r["fingerprint"] for r in ok})
    if len(fingerprints) > 1:
        raise RuntimeError(f"the package sources changed during the build ({len(fingerprints)} fingerprints in "
                           f"{out}); build again from a stable tree")
    folder = out / fingerprints[0] if fingerprints else None
    if folder is not None:
        _update_manifest(folder, ok)
        for r in ok:  # the JIT's per-entry locks: no use in a folder that is shipped
            (folder / r["file"]).with_suffix(".lock").unlink(missing_ok=True)
    return {"arch": arch, "entries": len(results), "compiled": sum(r["compiled"] for r in ok),
            "present": sum(not r["compiled"] for r in ok), "failed": [r for r in results if r["error"]],
            "seconds": time.perf_counter() - t0, "jobs": jobs, "folder": folder,
            "compile_cpu_seconds": sum(r["cpu_seconds"] for r in ok if r["compiled"])}


def _update_manifest(folder: Path, results: list) -> None:
    import cutlass

    path = folder / MANIFEST
    entries = {}
    if path.is_file():
        entries = {e["file"]: e for e in json.loads(path.read_text()).get("entries", [])}
    for r in sorted(results, key=lambda r: r["file"]):
        entries[r["file"]] = {k: r[k] for k in ("name", "key", "target", "arch", "file")}
    head = json.dumps({"fingerprint": folder.name, "cutlass_dsl": cutlass.__version__})[:-1]
    rows = ",\n  ".join(json.dumps(e) for e in sorted(entries.values(), key=lambda e: e["file"]))
    tmp = folder / f".{MANIFEST}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"
    tmp.write_text(f'{head}, "entries": [\n  {rows}\n]}}\n')
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def _to_tuple(x):
    return tuple(_to_tuple(v) for v in x) if isinstance(x, list) else x


def read_manifest(root, fingerprint: Optional[str] = None) -> list:
    """The ``AotEntry`` list (each with its ``arch`` dropped) built into ``root`` for this
    package's sources (or ``fingerprint``); empty when there is none."""
    from flash_attn_cute.host import jit_cache

    path = Path(root) / (fingerprint or jit_cache.cached_fingerprint()) / MANIFEST
    if not path.is_file():
        return []
    return [AotEntry(e["name"], _to_tuple(e["key"]), e["target"]) for e in json.loads(path.read_text())["entries"]]


# ---------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------


def main(argv=None) -> int:
    from flash_attn_cute import seam

    parser = argparse.ArgumentParser(prog="python -m flash_attn_cute.aot", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", required=True, help="sm_80, sm_86, sm_90a, sm_100a...: what the server asks for")
    parser.add_argument("--preset", required=True,
                        help="decode | prefill | mla | all | FILE.json (a list of descriptions)")
    parser.add_argument("--out", required=True, help="folder to fill (the cache layout; existing entries are kept)")
    parser.add_argument("--jobs", type=int, default=None, help="worker processes (default: the CPU count)")
    parser.add_argument("--backend", choices=sorted(set(seam.BACKENDS) | set(seam.MLA_BACKENDS)), default=None,
                        help="force a backend (default: the runtime's choice for the arch)")
    parser.add_argument("--dry-run", action="store_true", help="list the entries, compile nothing")
    args = parser.parse_args(argv)
    try:
        major = arch_capability(args.arch)[0]
        entries, skipped = entries_for(load_descriptions(args.preset), args.arch, args.backend)
    except (ValueError, TypeError) as e:  # a bad preset or description: say which, no traceback
        parser.error(str(e))
    if major >= 9 and not args.arch.endswith(("a", "f")):
        print(f"note: without CUTE_DSL_ARCH a server on this GPU asks for {args.arch}a, not {args.arch}",
              file=sys.stderr)
    for line in skipped:
        print(f"skipped (no backend runs it): {line}", file=sys.stderr)
    counts = {}
    for e in entries:
        counts[e.name] = counts.get(e.name, 0) + 1
    print(f"{len(entries)} entries for {args.arch}: "
          + ", ".join(f"{n} {name}" for name, n in sorted(counts.items())), file=sys.stderr)
    if args.dry_run:
        for e in entries:
            print(e.name, e.key)
        return 0
    try:
        summary = build(entries, args.arch, args.out, args.jobs)
    except ValueError as e:
        parser.error(str(e))
    print(f"aot {args.arch}: {summary['entries']} entries ({summary['compiled']} compiled, {summary['present']} "
          f"already there, {len(summary['failed'])} failed) in {summary['seconds']:.0f} s with {summary['jobs']} "
          f"processes ({summary['compile_cpu_seconds']:.0f} CPU s of compiling) -> {summary['folder']}",
          file=sys.stderr)
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
