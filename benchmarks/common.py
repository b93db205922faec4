"""Shared helpers for the benchmark scripts: timing, inputs, peers, CSV and RESULTS.md.

Nothing here touches CUDA at import time, so ``--help`` works on a machine without a GPU.
"""

import csv
import datetime
import math
import os
import re
import sys
import time
import traceback

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # run as `python benchmarks/x.py` without installing
    sys.path.insert(0, REPO_ROOT)

RESULTS_MD = os.path.join(REPO_ROOT, "benchmarks", "RESULTS.md")
UNAVAILABLE = "unavailable"
DEVICE = "cuda"


# ------------------------------------------------------------------------------ timing

def bench(fn, warmup_ms=25, rep_ms=150, graph=False):
    """Median time of ``fn()`` in ms. One untimed call first, so JIT compiles and
    lazy allocations are excluded; then triton's do_bench (which flushes L2 between
    runs), or CUDA events if triton is missing. ``graph``: time a CUDA-graph replay of
    ``fn`` (device time as a serving loop under graphs sees it: no host time can leak
    into a short kernel's measurement)."""
    import torch

    fn()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm the side stream's allocator pool before capture
            with torch.cuda.graph(g, stream=stream):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        fn = g.replay
    # The first call may have compiled for tens of seconds with the GPU idle, and the
    # H200 idles at 345 MHz: keep it busy ~100 ms so the clocks are up before timing
    # (without this the first row after a compile measured up to 2x slow, e.g. MLA
    # sm90 64 x 1024 at 89 us against 74 us for 64 x 2048, 2026-11-29).
    spin_until = time.perf_counter() + 0.1
    while time.perf_counter() < spin_until:
        fn()
        torch.cuda.synchronize()
    try:
        from triton.testing import do_bench
    except ImportError:
        return _bench_cuda_events(fn, warmup_ms, rep_ms)
    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def _bench_cuda_events(fn, warmup_ms, rep_ms):
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        fn()
    end.record()
    torch.cuda.synchronize()
    est_ms = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / est_ms))):
        fn()
    times = []
    for _ in range(max(5, int(rep_ms / est_ms))):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


# ------------------------------------------------------------------------------ inputs

def randn(*shape, dtype):
    """Random normal inputs (never zeros: a kernel that skips work must not look fast)."""
    import torch

    return torch.randn(*shape, dtype=dtype, device=DEVICE)


def parse_dtype(name):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}[name]


def check_correct(out, out_ref, out_torch, mult=2.0):
    """True/False from testing.is_close; never raises (a benchmark keeps going)."""
    from flash_attn_cute.testing import is_close

    try:
        return bool(is_close(out, out_ref, out_torch, mult=mult)[0])
    except Exception:
        return False


def error_text(exc):
    """One short line for a failed implementation, printed next to its row."""
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {msg}"[:160]


def print_exception(label, exc):
    print(f"[{label}] {error_text(exc)}", file=sys.stderr)
    if os.environ.get("BENCH_VERBOSE"):
        traceback.print_exc()


# ------------------------------------------------------------------------------- peers

def our_backends(arg="all"):
    """--backends: "all" = every registered backend that runs on this GPU (an SM100 kernel
    is not listed on a Hopper), else the comma list as given."""
    import torch
    from flash_attn_cute import seam

    if arg != "all":
        return [b.strip() for b in arg.split(",") if b.strip()]
    cap = torch.cuda.get_device_capability()
    return [b for b in sorted(seam.BACKENDS) if seam.backend_module(b).runs_on(cap)]


def load_fa4():
    """FlashAttention-4's CuTe module (``flash_attn.cute``) or (None, reason)."""
    try:
        import flash_attn.cute as fa4

        return fa4, ""
    except Exception as e:  # ImportError, or a broken install failing at import
        return None, error_text(e)


def load_fa3():
    """FlashAttention-3's Hopper forward (the fa3-fwd build, ``fa3_fwd_interface``; on the GPU
    machine: ``../shared/gpu/pack_peers.sh``), or (None, why)."""
    try:
        import fa3_fwd_interface as fa3

        return fa3, ""
    except Exception as e:  # not installed here
        return None, error_text(e)


def sdpa(q, k, v, *, backend, causal=False, scale=None):
    """torch SDPA with a single backend forced; q (b, sq, h, d), k/v (b, sk, hkv, d).

    Returns (fn, note): ``fn()`` runs the attention and returns the output in
    (b, sq, h, dv). GQA uses ``enable_gqa=True`` where the backend takes it, else K/V
    repeated to all heads once, outside the timed function (note says which).
    Raises if the backend refuses the problem.
    """
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdp_backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (b, h, s, d) views
    group = q.shape[2] // k.shape[2]

    def make(kt, vt, enable_gqa):
        def fn():
            with sdpa_kernel(sdp_backend):
                o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale,
                                                   enable_gqa=enable_gqa)
            return o.transpose(1, 2)

        return fn

    if group == 1:
        fn, note = make(kt, vt, False), ""
    else:
        try:
            fn, note = make(kt, vt, True), "enable_gqa"
            fn()
        except RuntimeError:
            kt, vt = kt.repeat_interleave(group, 1), vt.repeat_interleave(group, 1)
            fn, note = make(kt, vt, False), "repeat_kv"
    fn()  # raises here if the backend cannot run this problem
    return fn, note


def attention_flops(batch, nheads, seqlen_q, seqlen_k, d, d_v=None, causal=False):
    """FLOPs of forward attention: two GEMMs (Q K^T and P V), 2 FLOPs per multiply-add;
    causal (square) halves them, as FA3/FA4 count."""
    flops = 2 * batch * nheads * seqlen_q * seqlen_k * (d + (d if d_v is None else d_v))
    return flops / 2 if causal else flops


# ----------------------------------------------------------------------------- output

def write_csv(path, columns, rows):
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({c: _fmt(r.get(c, "")) for c in columns})
    print(f"wrote {path}")


def _fmt(x):
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        return f"{x:.4g}" if abs(x) < 1e4 else f"{x:.0f}"
    return str(x)


def format_table(rows, columns):
    cells = [[_fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(x.rjust(w) for x, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def print_table(rows, columns):
    print(format_table(rows, columns))


def device_name():
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"


def append_results_md(title, rows, columns=None, notes="", path=RESULTS_MD):
    """Write or replace the section ``title`` of benchmarks/RESULTS.md: a heading, the
    UTC date and the GPU name, optional notes, and the rows as a markdown table.
    Other sections are kept as they are."""
    if columns is None:
        columns = list(rows[0].keys()) if rows else []
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"<!-- section: {title} -->", f"## {title}", "",
             f"{stamp} on {device_name()}", ""]
    if notes:
        lines += [notes, ""]
    lines.append("| " + " | ".join(columns) + " |")
    lines.append("|" + "|".join("---" for _ in columns) + "|")
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c, "")).replace("|", "/") for c in columns) + " |")
    lines += [f"<!-- end section: {title} -->", ""]
    section = "\n".join(lines)

    text = open(path).read() if os.path.exists(path) else "# Benchmark results\n\n"
    pattern = re.compile(rf"<!-- section: {re.escape(title)} -->.*?<!-- end section: {re.escape(title)} -->\n?",
                         re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: section, text)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    with open(path, "w") as f:
        f.write(text)
    print(f"updated {path} ({title})")


def report(args, header, title, rows, columns, notes=""):
    """A benchmark's output: the CSV (``--csv``), the table on stdout under ``header``, and
    the section ``title`` of RESULTS.md (unless ``--no-md``)."""
    write_csv(args.csv, columns, rows)
    print(f"\n{header}")
    print_table(rows, columns)
    if not args.no_md:
        append_results_md(title, rows, columns, notes=notes)
