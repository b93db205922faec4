"""One compile harness for every kernel and arch: no GPU needed.

The DSL reads CUTE_DSL_ARCH / CUTE_DSL_KEEP / CUTE_DSL_DUMP_DIR once, at import, so each
arch compiles in its own subprocess (this file run as a script) with those variables
set. An entry is ``(label, "module:function", key)``: the function compiles the key
(``flash_attn_cute.sm80:compile``, ``flash_attn_cute.kernels.combine:compile_combine``...). The
artifacts it keeps (PTX, cubin and, when nvdisasm is installed, SASS) land in one folder
per label for the tests to read.
"""

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def find_nvdisasm():
    """nvdisasm from the nvidia-cuda-nvdisasm wheel (the one the DSL itself prefers), else PATH."""
    from importlib import metadata

    try:
        dist = metadata.distribution("nvidia-cuda-nvdisasm")
        for f in dist.files or []:
            if f.name == "nvdisasm" and Path(dist.locate_file(f)).is_file():
                return str(dist.locate_file(f))
    except metadata.PackageNotFoundError:
        pass
    return shutil.which("nvdisasm")


def _to_tuple(x):
    return tuple(_to_tuple(v) for v in x) if isinstance(x, list) else x


def _worker(entries_json: str, out_dir: str) -> None:
    """Subprocess body: compile every entry for $CUTE_DSL_ARCH, one artifact folder each."""
    from time import perf_counter

    dump_dir = Path(os.environ["CUTE_DSL_DUMP_DIR"])
    results = {}
    for label, target, key in json.loads(entries_json):
        module, fn = target.split(":")
        for f in dump_dir.iterdir():
            f.unlink()
        t0 = perf_counter()
        getattr(importlib.import_module(module), fn)(_to_tuple(key))
        results[label] = perf_counter() - t0
        dest = Path(out_dir) / label
        dest.mkdir(parents=True)
        for f in dump_dir.iterdir():
            shutil.move(str(f), dest / f.name)
        print(f"compiled {label} in {results[label]:.1f} s", file=sys.stderr, flush=True)
    print(json.dumps(results))


def compile_entries(arch: str, entries, root: Path, keep: str = None):
    """Compiles ``entries`` for ``arch`` in a subprocess; returns (artifact dir, {label:
    seconds}). ``keep`` defaults to PTX + cubin (+ SASS when nvdisasm is installed)."""
    if keep is None:
        keep = "ptx,cubin,sass" if find_nvdisasm() else "ptx,cubin"
    out_dir, dump_dir = root / arch, root / f"{arch}_dump"
    env = dict(os.environ, CUTE_DSL_ARCH=arch, CUTE_DSL_KEEP=keep, CUTE_DSL_DUMP_DIR=str(dump_dir),
               FLASH_ATTN_CUTE_CACHE="0")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    disasm = find_nvdisasm()
    if disasm:
        env["PATH"] = str(Path(disasm).parent) + os.pathsep + env.get("PATH", "")
    for d in (out_dir, dump_dir):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    proc = subprocess.run([sys.executable, __file__, json.dumps(list(entries)), str(out_dir)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0 and "sass" in keep and "nvdisasm" in proc.stderr:
        # The DSL refuses SASS dumping with an nvdisasm older than its toolchain: no SASS then.
        return compile_entries(arch, entries, root, "ptx,cubin")
    assert proc.returncode == 0, f"{arch} compile failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return out_dir, json.loads(proc.stdout.strip().splitlines()[-1])


def compile_archs(archs, entries_of, root: Path) -> dict:
    """{arch: (artifact dir, {label: seconds})}: ``entries_of(arch)`` compiled for each of
    ``archs`` (``compile_entries``), the archs side by side where the machine has two cores
    per compile process (on a 2-core CPU one arch after the other is faster: each DSL
    compile process takes a core and ~1 GB), then the compile times printed."""
    import concurrent.futures

    workers = max(1, min(len(archs), (os.cpu_count() or 1) // 2))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = {arch: pool.submit(compile_entries, arch, entries_of(arch), root) for arch in archs}
        result = {arch: f.result() for arch, f in futures.items()}
    for arch, (_, times) in result.items():
        print(f"\n{arch} compile seconds: " + ", ".join(f"{k} {v:.2f}" for k, v in times.items()))
    return result


def covering_subset(keys, fixed_fields=1):
    """A few keys that together show every value of every field of ``keys`` (greedy set
    cover; fields before ``fixed_fields`` are ignored): the compile tests compile these
    instead of the whole GPU sweep, yet every axis value the sweep uses is compiled."""
    keys = sorted(set(keys), key=repr)
    features = lambda k: {(i, repr(v)) for i, v in enumerate(k) if i >= fixed_fields}
    uncovered = set().union(*(features(k) for k in keys)) if keys else set()
    chosen = []
    while uncovered:
        best = max(keys, key=lambda k: len(features(k) & uncovered))
        chosen.append(best)
        uncovered -= features(best)
    return chosen


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
