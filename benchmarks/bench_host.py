"""Host (Python) time per call of the public API on a tiny decode, with peers.

A serving engine calls attention once per layer per decode step with tiny batches, so
the time Python spends before the launch matters as much as the kernel. Problem: warm
caches, b1, one query, 512 cached keys, 32 query / 8 KV heads, d128, bf16.

``flash_mla_decode`` (64 heads, page 64) is timed the same way, beside them.

Each call is timed on the host only: ``calls`` back-to-back calls (no synchronisation
inside; the kernels are shorter than the host path, so the launch queue never fills)
timed with ``time.perf_counter``, then one synchronisation outside the timed region;
the median over ``repeats`` such loops, in microseconds per call.

    python benchmarks/bench_host.py [--csv out.csv]
"""

import argparse
import statistics
import sys
import time

import common
from common import UNAVAILABLE, error_text, load_fa4, our_backends, print_exception, randn, report, sdpa

COLUMNS = ["impl", "call", "us_per_call", "ratio_vs_sdpa", "note"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--K", type=int, default=512)
    p.add_argument("--H", type=int, default=32)
    p.add_argument("--hkv", type=int, default=8)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--profile", action="store_true", help="print a cProfile of each of our cases")
    p.add_argument("--no-md", action="store_true")
    p.add_argument("--csv", default=None)
    return p.parse_args(argv)


def host_us(fn, calls, repeats):
    import torch

    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def main(argv=None):
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_host.py needs a CUDA GPU")
    import flash_attn_cute as fa

    torch.manual_seed(0)
    dtype, K, H, hkv, D = torch.bfloat16, args.K, args.H, args.hkv, args.D
    q = randn(1, 1, H, D, dtype=dtype)
    k, v = randn(1, K, hkv, D, dtype=dtype), randn(1, K, hkv, D, dtype=dtype)
    seqlens = torch.full((1,), K, dtype=torch.int32, device=common.DEVICE)
    page = 64
    kp = k.view(K // page, page, hkv, D).clone()
    vp = v.view(K // page, page, hkv, D).clone()
    table = torch.arange(K // page, dtype=torch.int32, device=common.DEVICE).view(1, -1)
    cu_q = torch.tensor([0, 1], dtype=torch.int32, device=common.DEVICE)
    cu_k = torch.tensor([0, K], dtype=torch.int32, device=common.DEVICE)

    cases = []
    for backend in our_backends():
        cases += [
            (f"ours_{backend}", "flash_attn_func", lambda b=backend: fa.flash_attn_func(q, k, v, backend=b)),
            (f"ours_{backend}", "flash_attn_varlen_func", lambda b=backend: fa.flash_attn_varlen_func(
                q[0], k[0], v[0], cu_q, cu_k, 1, K, backend=b)),
            (f"ours_{backend}", "flash_attn_with_kvcache", lambda b=backend: fa.flash_attn_with_kvcache(
                q, k, v, seqlens, backend=b)),
            (f"ours_{backend}", "flash_attn_with_kvcache paged64", lambda b=backend: fa.flash_attn_with_kvcache(
                q, kp, vp, seqlens, page_table=table, backend=b)),
            (f"ours_{backend}", "flash_attn_with_kvcache check_cache_bounds=True",
             lambda b=backend: fa.flash_attn_with_kvcache(q, k, v, seqlens, backend=b, check_cache_bounds=True)),
        ]
    # flash_mla_decode through the same seam and per-call cache: 64 heads, b4 x 512 (one
    # launch) and b1 x 32768 (split-KV: the kernel, then the combine).
    from flash_attn_cute import seam

    cap = torch.cuda.get_device_capability()
    for mla_batch, mla_len in ((4, 512), (1, 32768)):
        pages = mla_batch * mla_len // page
        q_nope, q_pe = randn(mla_batch, 1, 64, 512, dtype=dtype), randn(mla_batch, 1, 64, 64, dtype=dtype)
        ckv, kpe = randn(pages, page, 512, dtype=dtype), randn(pages, page, 64, dtype=dtype)
        mla_table = torch.arange(pages, dtype=torch.int32, device=common.DEVICE).view(mla_batch, -1)
        mla_lens = torch.full((mla_batch,), mla_len, dtype=torch.int32, device=common.DEVICE)
        for backend in sorted(seam.MLA_BACKENDS):
            if seam.backend_module(backend, "mla").runs_on(cap):
                mla_args = (q_nope, q_pe, ckv, kpe, mla_lens, mla_table)
                cases.append((f"ours_{backend}", f"flash_mla_decode b{mla_batch} x {mla_len} page {page}",
                              lambda b=backend, a=mla_args: fa.flash_mla_decode(*a, backend=b)))
    fa4, why = load_fa4()
    if fa4 is not None:
        cases.append(("fa4", "flash_attn_func", lambda: fa4.flash_attn_func(q, k, v)))
    try:
        sdpa_fn, note = sdpa(q, k, v, backend="cudnn")
        cases.append(("sdpa_cudnn", "scaled_dot_product_attention " + note, sdpa_fn))
        sdpa_fn, note = sdpa(q, k, v, backend="flash")
        cases.append(("sdpa_flash", "scaled_dot_product_attention " + note, sdpa_fn))
    except Exception as e:
        print_exception("sdpa", e)

    # Warm every case first (JIT, allocator, CPU and GPU clocks), so the first case
    # measured is not the one that pays for ramping up.
    with torch.no_grad():
        t_end = time.perf_counter() + 1.0
        while time.perf_counter() < t_end:
            for _, _, fn in cases:
                fn()
        torch.cuda.synchronize()
    if args.profile:
        import cProfile
        import pstats

        for impl, call, fn in cases:
            if impl.startswith("ours") and "check_cache_bounds" not in call:
                prof = cProfile.Profile()
                with torch.no_grad():
                    prof.runcall(lambda: [fn() for _ in range(2000)])
                torch.cuda.synchronize()
                print(f"--- {impl} {call}")
                pstats.Stats(prof).sort_stats("tottime").print_stats(8)
    rows = []
    for impl, call, fn in cases:
        row = dict(impl=impl, call=call, us_per_call=float("nan"), note="")
        try:
            with torch.no_grad():
                row["us_per_call"] = host_us(fn, args.calls, args.repeats)
        except Exception as e:
            print_exception(f"{impl} {call}", e)
            row["note"] = f"{UNAVAILABLE}: {error_text(e)}"
        rows.append(row)
    if fa4 is None:
        rows.append(dict(impl="fa4", call="flash_attn_func", us_per_call=float("nan"), note=f"{UNAVAILABLE}: {why}"))
    sdpa_us = min((r["us_per_call"] for r in rows if r["impl"].startswith("sdpa") and r["us_per_call"] == r["us_per_call"]),
                  default=float("nan"))
    for r in rows:
        r["ratio_vs_sdpa"] = sdpa_us / r["us_per_call"] if r["us_per_call"] == r["us_per_call"] else float("nan")

    report(args, f"host time per call, b1 q1 k{K} h{H}/{hkv} d{D} bf16 (us; ratio = best SDPA time / this time)",
           f"Host time per call: b1 q1 k{K} h{H}/{hkv} d{D}", rows, COLUMNS,
           notes="Median over loops of back-to-back calls, host clock, warm caches; "
                 "ratio_vs_sdpa = best SDPA us / row us.")
    return rows


if __name__ == "__main__":
    main()
