"""Proves a refactor changed no compiled kernel: every default compile key, and the SASS
opcode histogram of the kernels, are recorded before and after, then compared.

Sweeps: the forward problems of ``test_flash_attn_gpu.compile_keys`` (per backend and arch of
test_fwd_compile) and of the benchmarks, the MLA decode problems, the combine keys of the
split plans. Labels describe problems (``fwd/sm90/sm_90a/bench/prefill_d128_h16_causal``),
not keys. ``keys`` writes {label: repr(key)} (no compiling). ``sass`` compiles, through
tests/compile_harness.py, the covering subset of the test-sweep keys per backend and arch
plus every benchmark and MLA key, and writes {label: {"key", "hist": {opcode.modifiers:
count}, "total", "regs", "seconds"}} or {label: {"key", "error"}}; it resumes: labels of
--out already compiled with the same key are skipped (failures are retried).
``--arch sm_90a`` and ``--only REGEX`` (on labels) narrow a ``sass`` run. ``compare`` lists
the labels whose key, histogram, registers or error differ, or that one file lacks, and
then exits 1. --repo: the checkout whose package (and tests/) is used, first on sys.path.

    git worktree add --detach /work/baseline <commit>       # baseline, outside the changing tree
    python3 tests/sass_sweep.py keys --repo /work/baseline --out /work/sass_baseline/keys.json
    nice -n 10 python3 tests/sass_sweep.py sass --repo /work/baseline --out /work/sass_baseline/sass.json
    python3 tests/sass_sweep.py keys --repo /work/main --out /tmp/after/keys.json        # after
    nice -n 10 python3 tests/sass_sweep.py sass --repo /work/main --out /tmp/after/sass.json
    python3 tests/sass_sweep.py compare /work/sass_baseline/keys.json /tmp/after/keys.json
    python3 tests/sass_sweep.py compare /work/sass_baseline/sass.json /tmp/after/sass.json
"""

import argparse
import importlib
import inspect
import json
import math
import os
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import NamedTuple

# ----------------------------------------------------------------------------- ADAPTER
# Every call into the package's planning API is here and nowhere else; after an API change
# edit only this section. Problems are keyword dicts (FwdProblem / MlaProblem field names,
# see fwd_problem and mla_problems); fwd_key and mla_key return (key, resolved num_splits),
# or None when the backend's ``check`` refuses the problem. Both API forms work: bc8ffb0's
# (MlaProblem, MLA_BACKENDS in ``mla``; MLA ``plan(problem, num_splits, num_sms)``;
# DTYPE_NAMES in ``cute_utils``) and the one-seam form (MlaProblem, MLA_BACKENDS in ``fwd``;
# every ``plan(problem, num_splits, pack_gqa, num_sms, tuning, arch)``; ``keys.py``). Only
# ``plan.num_splits`` is read, so the FwdPlan layout does not matter. Something moved
# again: put its new "module:attr" first in the _pkg call.


def _pkg(*names):
    """The first importable attribute among "module:attr" names (new homes first)."""
    for name in names:
        module, attr = name.split(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):
            continue
    raise ImportError(f"none of {names}")


def _registry(kind):
    if kind == "fwd":
        return _pkg("flash_attn_cute.seam:BACKENDS", "flash_attn_cute.fwd:BACKENDS")
    return _pkg("flash_attn_cute.seam:MLA_BACKENDS", "flash_attn_cute.fwd:MLA_BACKENDS", "flash_attn_cute.mla:MLA_BACKENDS")


def _key(kind, backend, problem, num_splits, pack_gqa, num_sms, arch):
    module = importlib.import_module(_registry(kind)[backend])
    if module.check(problem) is not None:
        return None
    params = inspect.signature(module.plan).parameters
    if "pack_gqa" not in params:  # bc8ffb0's MLA plan
        plan = module.plan(problem, num_splits, num_sms)
    else:  # default tuning; the key's arch also for a config that depends on it
        plan = module.plan(problem, num_splits, pack_gqa, num_sms, **({"arch": arch} if "arch" in params else {}))
    return module.compile_key(problem, plan, arch), plan.num_splits


def fwd_key(backend, problem_kwargs, num_splits, pack_gqa, num_sms, arch):
    problem = _pkg("flash_attn_cute.seam:FwdProblem", "flash_attn_cute.fwd:FwdProblem")(**problem_kwargs)
    return _key("fwd", backend, problem, num_splits, pack_gqa, num_sms, arch)


def mla_key(backend, problem_kwargs, num_splits, num_sms, arch):
    problem = _pkg("flash_attn_cute.seam:MlaProblem", "flash_attn_cute.fwd:MlaProblem", "flash_attn_cute.mla:MlaProblem")(**problem_kwargs)
    return _key("mla", backend, problem, num_splits, True, num_sms, arch)  # MLA always packs its heads


def combine_key(dtype, d_v, has_lse, arch):  # the key alone
    dtype_name = _pkg("flash_attn_cute.host.keys:DTYPE_NAMES", "flash_attn_cute.keys:DTYPE_NAMES",
                      "flash_attn_cute.cute_utils:DTYPE_NAMES")[dtype]
    return _pkg("flash_attn_cute.host.keys:combine_key", "flash_attn_cute.keys:combine_key",
                "flash_attn_cute.combine:combine_key")(dtype_name, d_v, has_lse,
                                                                                            arch)


def compile_target(kind, backend):
    """The "module:function" compiling a key of ``kind`` (fwd, mla, combine)."""
    if kind == "combine":
        combine = _pkg("flash_attn_cute.kernels.combine:compile_combine", "flash_attn_cute.combine:compile_combine")
        return f"{combine.__module__}:compile_combine"
    return _registry(kind)[backend] + ":compile"


# ------------------------------------------------------------------------------ sweeps
ARCHS = {"sm80": ["sm_80", "sm_90a"], "sm90": ["sm_90a"], "sm100": ["sm_100a"]}  # test_fwd_compile.ARCHS
MLA_ARCHS = {"sm80": ["sm_80", "sm_90a"], "sm90": ["sm_90a"]}
NUM_SMS = 132  # H200
Row = NamedTuple("Row", [("label", str), ("kind", str), ("backend", str), ("arch", str), ("key", tuple),
                         ("in_sass", bool)])


def fwd_problem(dtype, batch, sq, sk, h, hkv, d, dv=None, causal=False, window=(-1, -1), softcap=0.0, kind="func",
                page_size=0, has_lse=True):
    """FwdProblem keywords as the public API builds them (window as interface.normalize_window)."""
    left, right = (-1 if w is None else w for w in window)
    if causal:
        right = 0
    elif left == -1 and right == 0:
        causal = True
    return dict(dtype=dtype, batch=batch, max_seqlen_q=sq, max_seqlen_k=sk, nheads=h, nheads_kv=hkv, d=d,
                d_v=dv or d, softmax_scale=d ** -0.5, causal=causal, window_left=left, window_right=right,
                softcap=softcap, varlen_q=kind == "varlen", varlen_k=kind == "varlen",
                has_seqused_k=kind in ("kvcache", "paged"), page_size=page_size, has_lse=has_lse)


def gpu_test_problems():
    """(name, kwargs, num_splits, pack_gqa) of every problem test_flash_attn_gpu.compile_keys
    plans, in its order (its loops over its tables, problems built by keyword)."""
    import test_flash_attn_gpu as t

    out = []

    def add(cfg, kind, batch, sq, sk, has_lse=True, page_size=0):
        if sq and sk:
            kw = fwd_problem(cfg.dtype, batch, sq, sk, cfg.nheads, cfg.nheads_kv, cfg.d, cfg.dv, cfg.causal,
                             cfg.window, cfg.softcap, kind, page_size, has_lse)
            name = (f"{cfg.name}/{kind}_b{batch}_q{sq}_k{sk}" + (f"_page{page_size}" if page_size else "")
                    + f"_splits{cfg.num_splits}" + ("" if has_lse else "_nolse"))
            out.append((name, kw, cfg.num_splits, cfg.pack_gqa))

    for cfg in t.FUNC_CFGS:
        for sq, sk in t.PREFILL_PAIRS + (t.DECODE_PAIRS if cfg.decode else []):
            add(cfg, "func", 2, sq, sk)
    for name in ("base", "causal", "causal_gqa_pack_split3"):
        add(t._BY_NAME[name], "func", 1, 4224, 4224)
    add(t._BY_NAME["base"], "func", 2, 77, 77)
    for ns in (1, 3):
        add(t.Cfg("no_lse", num_splits=ns), "func", 2, 113, 113, has_lse=False)
    add(t.Cfg("pack_auto", **t.GQA, pack_gqa=None), "func", 2, 113, 203)
    add(t._BY_NAME["split3"], "func", 2, 5, 4224)
    for cfg in t.VARLEN_CFGS:
        for lq, lk in list(t.VARLEN_LENS.values()) + (list(t.VARLEN_DECODE_LENS.values()) if cfg.decode else []):
            add(cfg, "varlen", len(lq), max(lq), max(lk))
    add(t.Cfg("varlen_no_lse", causal=True, num_splits=3), "varlen", 3, 130, 130, has_lse=False)
    for cfg in t.KV_CFGS:
        for ps in t.PAGE_SIZES if cfg.paged else [None]:
            cap = t.KV_CAPACITY if ps is None else math.ceil(t.KV_CAPACITY / ps) * ps
            for sq in cfg.seqlen_qs:
                add(cfg, "paged" if cfg.paged else "kvcache", len(t.KV_CACHE_SEQLENS), sq, cap, page_size=ps or 0)
    for ps in (None, 64):
        for ns in (0, 3):
            add(t.Cfg(**{**t.DECODE_CFG.__dict__, "num_splits": ns}), "paged" if ps else "kvcache", 2, 1, 4224,
                page_size=ps or 0)
    add(t.Cfg("kv_zero", num_splits=0), "kvcache", 2, 1, t.KV_CAPACITY)
    add(t.Cfg("kv_no_lse", num_splits=0), "kvcache", 2, 1, t.KV_CAPACITY, has_lse=False)
    return out


def bench_problems():
    """(name, kwargs, num_splits, pack_gqa) of the benchmarks' problems (as they call: no LSE,
    pack_gqa None), and the SM100-only extra key of test_fwd_compile."""
    import torch

    bf16, out = torch.bfloat16, []
    for d, h in ((64, 32), (128, 16), (256, 8)):
        for causal in (False, True):
            out.append((f"prefill_d{d}_h{h}" + ("_causal" * causal),
                        fwd_problem(bf16, 4, 8192, 8192, h, h, d, causal=causal, has_lse=False), 1, None))
    for hkv in (32, 8):
        out.append((f"decode_b1_k131072_h32_kv{hkv}_d128",
                    fwd_problem(bf16, 1, 1, 131072, 32, hkv, 128, kind="kvcache", has_lse=False), 0, None))
    for ps in (0, 16, 64, 128, 256):
        out.append(("paged_decode_b64_k4096_h32_kv8_d128_" + (f"page{ps}" if ps else "contiguous"),
                    fwd_problem(bf16, 64, 1, 4096, 32, 8, 128, kind="paged" if ps else "kvcache", page_size=ps,
                                has_lse=False), 0, None))
    prefill = dict(dtype=bf16, batch=4, sq=8192, sk=8192, h=16, hkv=16, d=128, has_lse=False)
    for name, extra in (("varlen_prefill_d128_causal", dict(kind="varlen", causal=True)),
                        ("window256_0_prefill_d128", dict(window=(256, 0))),
                        ("softcap30_prefill_d128", dict(softcap=30.0)),
                        ("fp16_prefill_d128", dict(dtype=torch.float16))):
        out.append((name, fwd_problem(**{**prefill, **extra}), 1, None))
    sm100_extra = ("sm100_extra_kvcache_decode_b2_k4096_h32_kv8_splits3",
                   fwd_problem(bf16, 2, 1, 4096, 32, 8, 128, kind="kvcache"), 3, True)
    return out, sm100_extra


def mla_problems():
    import torch

    base = dict(dtype=torch.bfloat16, batch=128, max_seqlen_q=1, max_seqlen_k=2048, nheads=64, page_size=64,
                softmax_scale=576 ** -0.5, causal=False, has_lse=False)
    cases = {"h64_page1": dict(page_size=1), "h64_page64": {}, "h32_page64": dict(nheads=32),
             "h128_page64_b32_k8192": dict(nheads=128, batch=32, max_seqlen_k=8192),
             "h16_page64_b256_k4096": dict(nheads=16, batch=256, max_seqlen_k=4096),
             "h64_page64_b1_k32768": dict(batch=1, max_seqlen_k=32768),
             "h64_page64_causal_q2": dict(causal=True, max_seqlen_q=2), "h64_page64_fp16": dict(dtype=torch.float16)}
    return [(f"{name}_{'lse' if lse else 'nolse'}", {**base, **kw, "has_lse": lse})
            for name, kw in cases.items() for lse in (False, True)]


def sweep():
    """[Row] of every sweep, combine keys last."""
    from compile_harness import covering_subset

    rows, combines = [], {}

    def record(label, kind, backend, arch, res, kw, in_sass):
        if res is not None:
            rows.append(Row(label, kind, backend, arch, res[0], in_sass))
            if res[1] > 1:
                dt, dv, lse = str(kw["dtype"]).split(".")[-1], kw.get("d_v", 512), kw["has_lse"]  # MLA: d_v 512
                combines[f"combine/{arch}/{dt}_dv{dv}_{'lse' if lse else 'nolse'}"] = combine_key(kw["dtype"], dv, lse,
                                                                                                  arch)

    tests, (bench, sm100_extra) = gpu_test_problems(), bench_problems()
    for backend, archs in ARCHS.items():
        for arch in archs:
            start = len(rows)
            for name, kw, ns, pack in tests:
                record(f"fwd/{backend}/{arch}/test/{name}", "fwd", backend, arch,
                       fwd_key(backend, kw, ns, pack, NUM_SMS, arch), kw, False)
            first = {}  # key -> the first test problem planning it: its label in the SASS subset
            for r in rows[start:]:
                first.setdefault(r.key, r.label)
            chosen = {first[k] for k in covering_subset(list(first))}
            rows[start:] = [r._replace(in_sass=r.label in chosen) for r in rows[start:]]
            for name, kw, ns, pack in bench + ([sm100_extra] if backend == "sm100" else []):
                record(f"fwd/{backend}/{arch}/bench/{name}", "fwd", backend, arch,
                       fwd_key(backend, kw, ns, pack, NUM_SMS, arch), kw, True)
    for backend, archs in MLA_ARCHS.items():
        for arch in archs:
            for name, kw in mla_problems():
                record(f"mla/{backend}/{arch}/{name}", "mla", backend, arch, mla_key(backend, kw, 0, NUM_SMS, arch),
                       kw, True)
    rows += [Row(label, "combine", None, label.split("/")[1], key, False) for label, key in sorted(combines.items())]
    assert len({r.label for r in rows}) == len(rows), "duplicate labels"
    try:  # the reproduced test sweep must plan the tests' own keys
        from test_flash_attn_gpu import compile_keys

        for backend, archs in ARCHS.items():
            for arch in archs:
                fwd_keys, comb_keys = compile_keys(backend, arch, NUM_SMS)
                if {r.key for r in rows if r.label.startswith(f"fwd/{backend}/{arch}/test/")} != set(fwd_keys) or \
                        not set(comb_keys) <= set(combines.values()):
                    print(f"WARNING: {backend} {arch}: test sweep differs from compile_keys'", file=sys.stderr)
    except Exception as e:  # noqa: BLE001: a check only
        print(f"WARNING: cannot cross-check with test_flash_attn_gpu.compile_keys: {e!r}", file=sys.stderr)
    return rows


# -------------------------------------------------------------------------------- SASS
INSN = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]\s+)?([A-Z][^\s;]*)")  # [@pred] OPCODE.modifiers


def sass_histogram(folder):
    """({opcode with its modifiers: count}, [registers per kernel where the SASS says it])."""
    hist, regs = Counter(), []
    files = sorted(Path(folder).rglob("*.sass"))
    if not files:
        raise RuntimeError("no SASS dumped (nvdisasm missing or too old?)")
    for f in files:
        text = f.read_text()
        regs += [int(r) for r in re.findall(r"SHI_REGISTERS=(\d+)", text)]
        ops = INSN.findall(text)
        assert len(ops) == len(re.findall(r"^\s*/\*[0-9a-f]{4,}\*/", text, re.M)), f"unparsed SASS lines in {f}"
        hist.update(ops)
    return dict(sorted(hist.items())), regs


def run_sass(rows, out, archs, only):
    from compile_harness import compile_entries

    done, t_all = json.loads(out.read_text()) if out.exists() else {}, time.time()
    for arch in archs:
        by_key = {}  # one compile per distinct key, recorded under each of its labels
        for r in rows:
            old = done.get(r.label, {})
            if r.in_sass and r.arch == arch and re.search(only, r.label) and (old.get("key") != repr(r.key)
                                                                               or "hist" not in old):
                by_key.setdefault(repr(r.key), []).append(r)
        print(f"{arch}: {len(by_key)} kernels to compile", file=sys.stderr, flush=True)
        for i, (key_repr, group) in enumerate(by_key.items()):
            r, t0 = group[0], time.time()
            try:
                with tempfile.TemporaryDirectory(prefix="sass_sweep_") as tmp:
                    target = compile_target(r.kind, r.backend)
                    out_dir, secs = compile_entries(arch, [("e0", target, r.key)], Path(tmp))
                    hist, regs = sass_histogram(out_dir / "e0")
                entry = dict(key=key_repr, hist=hist, total=sum(hist.values()), regs=regs, seconds=round(secs["e0"], 1))
            except Exception as e:  # noqa: BLE001: recorded, the sweep goes on
                entry = dict(key=key_repr, error=f"{type(e).__name__}: {str(e)[-3000:]}")
            done.update({g.label: entry for g in group})
            out.write_text(json.dumps(done, indent=1, sort_keys=True))
            status = f"{entry['total']} insns" if "hist" in entry else "FAILED " + entry["error"][:200]
            print(f"[{arch} {i + 1}/{len(by_key)}] {r.label}: {time.time() - t0:.0f} s, {status}", file=sys.stderr,
                  flush=True)
    print(f"done in {time.time() - t_all:.0f} s; {len(done)} labels in {out}", file=sys.stderr)


# ----------------------------------------------------------------------------- compare
def compare(a_path, b_path):
    a, b = json.loads(Path(a_path).read_text()), json.loads(Path(b_path).read_text())
    norm = lambda v: {"key": v} if isinstance(v, str) else v  # keys.json values are key reprs
    bad = 0
    for label in sorted(set(a) | set(b)):
        if label not in a or label not in b:
            print(f"ONLY IN {'B' if label not in a else 'A'}: {label}")
            bad += 1
            continue
        x, y = norm(a[label]), norm(b[label])
        both = "hist" in x and "hist" in y  # else one failed: its error says it
        lines = [f"  {f}: {x.get(f)} -> {y.get(f)}" for f in ("key", "error") + ("total", "regs") * both
                 if x.get(f) != y.get(f)]
        hx, hy = (x["hist"], y["hist"]) if both else ({}, {})
        lines += [f"  {op}: {hx.get(op, 0)} -> {hy.get(op, 0)} ({hy.get(op, 0) - hx.get(op, 0):+d})"
                  for op in sorted(set(hx) | set(hy)) if hx.get(op, 0) != hy.get(op, 0)]
        if lines:
            print(f"DIFFERS: {label}\n" + "\n".join(lines))
            bad += 1
    print(f"{len(set(a) | set(b))} labels, {bad} differ" + ("" if bad else ": identical"))
    return 1 if bad else 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("keys", "sass"):
        s = sub.add_parser(name)
        s.add_argument("--repo", required=True)
        s.add_argument("--out", required=True, type=Path)
        s.add_argument("--arch", default="sm_80,sm_90a,sm_100a")
        s.add_argument("--only", default="", help="regex on labels")
    sub.add_parser("compare").add_argument("files", nargs=2)
    args = p.parse_args(argv)
    if args.cmd == "compare":
        return compare(*args.files)
    repo = Path(args.repo).resolve()
    for var in [v for v in os.environ if v.startswith("FLASH_ATTN_CUTE_")]:
        del os.environ[var]  # tuning overrides (tiles, MLA stages / QK mode): default keys only
    sys.path[:0] = [str(repo), str(repo / "tests")]
    import compile_harness
    import flash_attn_cute

    compile_harness.REPO = repo  # the compile subprocess imports the package from --repo
    assert Path(flash_attn_cute.__file__).resolve().is_relative_to(repo), flash_attn_cute.__file__
    rows = sweep()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.cmd == "sass":
        return run_sass(rows, args.out, args.arch.split(","), args.only)
    args.out.write_text(json.dumps({r.label: repr(r.key) for r in rows}, indent=1, sort_keys=True))
    groups = Counter(r.label.rsplit("/", 1)[0].split("/test/")[0] + "/test" * ("/test/" in r.label) for r in rows)
    print("\n".join(f"{n:4d} {g}" for g, n in groups.items()))
    print(f"{len(rows)} labels, {sum(r.in_sass for r in rows)} in the SASS subset")


if __name__ == "__main__":
    sys.exit(main())
