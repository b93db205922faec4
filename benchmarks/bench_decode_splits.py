"""Sweep num_splits of flash_attn_with_kvcache on a decode-shaped problem, with peers.

Default: B=1, Q=1, K=131072, H=32, D=128, Hkv=32, bf16, num_splits in
1,2,4,8,16,32,64,96,128 and 0 (auto). Peers on the same problem (num_splits=-1):
FA4 (flash_attn.cute), torch SDPA with the flash and the cuDNN backend.

    python benchmarks/bench_decode_splits.py [--hkv 8] [--paged 64] [--csv out.csv]

tflops = 4*B*Q*K*H*D / t; bw (TB/s) counts K and V read once: 2*B*K*Hkv*D*bytes / t.
correctness compares each output with the fp32 reference (flash_attn_cute.testing),
bounded by 2x PyTorch's own low-precision error.
"""

import argparse
import math
import sys

import common
from common import UNAVAILABLE, append_results_md, bench, check_correct, error_text, load_fa4, our_backends, \
    parse_dtype, print_exception, print_table, randn, sdpa, write_csv

COLUMNS = [
    "benchmark_type", "num_splits", "B", "Q", "K", "H", "D", "kvheads_per_group",
    "arithmetic_intensity", "avg_time", "tflops", "bw", "correctness",
    "impl", "backend", "pack_gqa", "dtype",
]
TABLE_COLUMNS = ["impl", "num_splits", "avg_time", "tflops", "bw", "correctness", "backend"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--B", type=int, default=1, help="batch")
    p.add_argument("--Q", type=int, default=1, help="queries per sequence")
    p.add_argument("--K", type=int, default=131072, help="cached keys per sequence (cache_seqlens)")
    p.add_argument("--H", type=int, default=32, help="query heads")
    p.add_argument("--D", type=int, default=128, help="head dim (d = d_v)")
    p.add_argument("--hkv", type=int, default=None, help="kv heads (default: H, i.e. MHA); e.g. 8 for GQA")
    p.add_argument("--paged", type=int, default=0, metavar="PAGE_SIZE",
                   help="use a paged KV cache with this page size (0: contiguous)")
    p.add_argument("--splits", default="1,2,4,8,16,32,64,96,128",
                   help="comma-separated num_splits to sweep; 0 (auto) is always added")
    p.add_argument("--pack-gqa", choices=["auto", "true", "false"], default="auto")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--warmup", type=float, default=25, help="do_bench warmup, ms")
    p.add_argument("--rep", type=float, default=150, help="do_bench rep, ms")
    p.add_argument("--no-peers", action="store_true", help="skip FA4 and SDPA")
    p.add_argument("--graph", action="store_true", help="time CUDA-graph replays (device time, no host time)")
    p.add_argument("--launch-only", action="store_true",
                   help="also time the seam's launch path alone (impl ours_launch): no argument validation, "
                        "i.e. the kernels plus allocation")
    p.add_argument("--backends", default="all", help="comma-separated backends to sweep (default: all registered)")
    p.add_argument("--no-md", action="store_true", help="do not update benchmarks/RESULTS.md")
    p.add_argument("--csv", default=None, metavar="PATH", help="write the rows to this CSV file")
    return p.parse_args(argv)


def decode_problem(q, k_cache, v_cache, page_table, max_seqlen_k):
    """The FwdProblem flash_attn_with_kvcache builds for this call (default arguments)."""
    from flash_attn_cute.host.problems import FwdProblem

    b, sq, h, d = q.shape
    return FwdProblem(dtype=q.dtype, batch=b, max_seqlen_q=sq, max_seqlen_k=max_seqlen_k, nheads=h,
                      nheads_kv=k_cache.shape[2], d=d, d_v=v_cache.shape[-1], softmax_scale=d ** -0.5, causal=False,
                      window_left=-1, window_right=-1, softcap=0.0, varlen_q=False, varlen_k=False,
                      has_seqused_k=True, page_size=k_cache.shape[1] if page_table is not None else 0, has_lse=False)


def chosen_num_splits(backend, problem, pack_gqa):
    """The num_splits that auto (0) resolves to: the backend's own plan."""
    import torch

    from flash_attn_cute import seam
    from flash_attn_cute.host import heuristics

    sms = heuristics.num_sms(torch.device("cuda"))
    return seam.backend_module(backend).plan(problem, 0, pack_gqa, sms).num_splits


def launch_only(backend, problem, q, k_cache, v_cache, cache_seqlens, page_table, num_splits, pack_gqa):
    """The seam's launch path without the public API's argument validation (``seam.resolve``
    once, then ``seam.run_resolved`` of the kernels' tensor list): what the kernels (and the
    output allocation) cost."""
    from flash_attn_cute import seam
    from flash_attn_cute.api.call_args import FwdTensors
    from flash_attn_cute.host import tuning

    resolved = seam.resolve(problem, backend, num_splits, pack_gqa, q.device, tuning.from_env())

    def fn():
        out = q.new_empty(*q.shape[:-1], v_cache.shape[-1])
        seam.run_resolved(resolved, problem, FwdTensors(q, k_cache, v_cache, out, seqused_k=cache_seqlens,
                                                        page_table=page_table))
        return out

    return fn


def main(argv=None):
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_decode_splits.py needs a CUDA GPU")
    import flash_attn_cute
    from flash_attn_cute.testing import attention_kvcache_ref, gather_paged_kv

    torch.manual_seed(0)
    dtype = parse_dtype(args.dtype)
    B, Q, K, H, D = args.B, args.Q, args.K, args.H, args.D
    hkv = args.hkv or H
    assert H % hkv == 0, "H must be a multiple of --hkv"
    pack_gqa = {"auto": None, "true": True, "false": False}[args.pack_gqa]
    page_size = args.paged

    q = randn(B, Q, H, D, dtype=dtype)
    if page_size:
        pages_per_seq = math.ceil(K / page_size)
        num_pages = B * pages_per_seq
        k_cache = randn(num_pages, page_size, hkv, D, dtype=dtype)
        v_cache = randn(num_pages, page_size, hkv, D, dtype=dtype)
        page_table = torch.randperm(num_pages, device=common.DEVICE).view(B, pages_per_seq).to(torch.int32)
    else:
        k_cache, v_cache = randn(B, K, hkv, D, dtype=dtype), randn(B, K, hkv, D, dtype=dtype)
        page_table = None
    cache_seqlens = torch.full((B,), K, dtype=torch.int32, device=common.DEVICE)

    out_ref, _ = attention_kvcache_ref(q, k_cache, v_cache, cache_seqlens, page_table)
    out_pt, _ = attention_kvcache_ref(q, k_cache, v_cache, cache_seqlens, page_table, upcast=False)

    flops = common.attention_flops(B, H, Q, K, D)
    nbytes = 2 * B * K * hkv * D * q.element_size()
    bench_type = f"decode_{'paged' + str(page_size) if page_size else 'contiguous'}"
    base = dict(benchmark_type=bench_type, B=B, Q=Q, K=K, H=H, D=D, kvheads_per_group=H // hkv,
                arithmetic_intensity=flops / nbytes, pack_gqa=args.pack_gqa, dtype=args.dtype)
    rows = []

    def record(impl, num_splits, backend, fn):
        row = dict(base, impl=impl, num_splits=num_splits, backend=backend,
                   avg_time=float("nan"), tflops=float("nan"), bw=float("nan"), correctness=False)
        if fn is None:
            row["backend"] = backend or UNAVAILABLE
            rows.append(row)
            return row
        try:
            out = fn()
            row["correctness"] = check_correct(out, out_ref, out_pt)
            t_ms = bench(fn, args.warmup, args.rep, graph=args.graph)
            row.update(avg_time=t_ms, tflops=flops / (t_ms * 1e-3) / 1e12, bw=nbytes / (t_ms * 1e-3) / 1e12)
        except Exception as e:
            print_exception(f"{impl} num_splits={num_splits}", e)
            row["backend"] = f"{UNAVAILABLE}: {error_text(e)}"
        rows.append(row)
        return row

    # --- ours: the sweep, then auto, per backend
    problem = decode_problem(q, k_cache, v_cache, page_table, K)
    splits = [int(s) for s in args.splits.split(",") if s.strip() and int(s) != 0]
    for backend in our_backends(args.backends):
        for num_splits in splits + [0]:
            kwargs = dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens,
                          page_table=page_table, num_splits=num_splits, pack_gqa=pack_gqa, backend=backend)
            note = backend
            if num_splits == 0:
                note = f"{backend} auto->{chosen_num_splits(backend, problem, pack_gqa)}"
            record("ours", num_splits, note, lambda kw=kwargs: flash_attn_cute.flash_attn_with_kvcache(**kw))
            if args.launch_only and num_splits != 0:
                record("ours_launch", num_splits, backend, launch_only(
                    backend, problem, q, k_cache, v_cache, cache_seqlens, page_table, num_splits, pack_gqa))

    if not args.no_peers:
        # --- FA4 (its own heuristic picks num_splits)
        fa4, why = load_fa4()
        if fa4 is None:
            record("fa4", -1, f"{UNAVAILABLE}: {why}", None)
        else:
            def fa4_call(num_splits):
                def fn():
                    with torch.no_grad():
                        if page_table is None:
                            r = fa4.flash_attn_func(q, k_cache, v_cache, num_splits=num_splits,
                                                    pack_gqa=pack_gqa)
                        else:
                            r = fa4.flash_attn_varlen_func(q, k_cache, v_cache, seqused_k=cache_seqlens,
                                                           page_table=page_table, num_splits=num_splits,
                                                           pack_gqa=pack_gqa)
                    return r[0] if isinstance(r, tuple) else r

                return fn

            # its own split heuristic (num_splits=0) if this FA4 build takes it, else no split
            fa4_fn, note = fa4_call(0), "flash_attn.cute num_splits=0"
            try:
                fa4_fn()
            except Exception as e:
                print_exception("fa4 num_splits=0", e)
                fa4_fn, note = fa4_call(1), "flash_attn.cute num_splits=1"
            record("fa4", -1, note, fa4_fn)

        # --- SDPA on a contiguous cache (a paged one is gathered once, untimed)
        k_c = gather_paged_kv(k_cache, page_table) if page_table is not None else k_cache
        v_c = gather_paged_kv(v_cache, page_table) if page_table is not None else v_cache
        k_c, v_c = k_c[:, :K], v_c[:, :K]
        for name in ("flash", "cudnn"):
            try:
                fn, note = sdpa(q, k_c, v_c, backend=name)
            except Exception as e:
                print_exception(f"sdpa_{name}", e)
                record(f"sdpa_{name}", -1, f"{UNAVAILABLE}: {error_text(e)}", None)
                continue
            note = ", ".join(x for x in (note, "gathered cache" if page_table is not None else "") if x)
            record(f"sdpa_{name}", -1, note or name, fn)

    write_csv(args.csv, COLUMNS, rows)
    print(f"\n{bench_type}: B={B} Q={Q} K={K} H={H} Hkv={hkv} D={D} {args.dtype} "
          f"pack_gqa={args.pack_gqa} (ms, TFLOP/s, TB/s)")
    print_table(rows, TABLE_COLUMNS)
    if not args.no_md:
        title = f"Decode num_splits sweep: {bench_type} B={B} Q={Q} K={K} H={H} Hkv={hkv} D={D} {args.dtype}"
        append_results_md(title, rows, TABLE_COLUMNS + ["pack_gqa"],
                          notes=f"avg_time ms (median{' of CUDA-graph replays' if args.graph else ', eager calls'}), "
                                "tflops TFLOP/s, bw TB/s (K and V read once).")
    return rows


if __name__ == "__main__":
    main()
