"""Paged decode bandwidth across page sizes, with FA4 and SDPA in the same run.

Default: B=64, one query, 4096 cached keys, 32 query heads, d128, bf16, KV heads 32 and
8, caches contiguous and paged (page sizes 1, 16, 64, 128; random page tables), each
called as a user calls it: ``flash_attn_with_kvcache`` with default arguments
(num_splits=0). bw (TB/s) counts K and V read once.

    python benchmarks/bench_paged_decode.py [--pages 0,1,16,64,128] [--hkv 32,8] [--csv out.csv]
"""

import argparse
import math
import sys

import common
from common import UNAVAILABLE, bench, check_correct, error_text, load_fa4, our_backends, print_exception, randn, \
    report, sdpa

COLUMNS = ["impl", "page_size", "B", "K", "H", "hkv", "D", "avg_time", "bw", "ratio_vs_fa4", "correctness", "note"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--B", type=int, default=64)
    p.add_argument("--K", type=int, default=4096)
    p.add_argument("--H", type=int, default=32)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--hkv", default="32,8")
    p.add_argument("--pages", default="0,1,16,64,128", help="page sizes; 0 = contiguous cache")
    p.add_argument("--backends", default="all")
    p.add_argument("--no-md", action="store_true")
    p.add_argument("--csv", default=None)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_paged_decode.py needs a CUDA GPU")
    import flash_attn_cute as fa
    from flash_attn_cute.testing import attention_kvcache_ref, gather_paged_kv

    backends = our_backends(args.backends)
    fa4, fa4_why = load_fa4()
    B, K, H, D, dtype = args.B, args.K, args.H, args.D, torch.bfloat16
    rows = []
    for hkv in (int(x) for x in args.hkv.split(",")):
        for page in (int(x) for x in args.pages.split(",")):
            torch.manual_seed(0)
            q = randn(B, 1, H, D, dtype=dtype)
            seqlens = torch.full((B,), K, dtype=torch.int32, device=common.DEVICE)
            if page:
                pages_per_seq = math.ceil(K / page)
                k = randn(B * pages_per_seq, page, hkv, D, dtype=dtype)
                v = randn(B * pages_per_seq, page, hkv, D, dtype=dtype)
                table = torch.randperm(B * pages_per_seq, device=common.DEVICE).view(B, -1).to(torch.int32)
            else:
                k, v, table = randn(B, K, hkv, D, dtype=dtype), randn(B, K, hkv, D, dtype=dtype), None
            ref, _ = attention_kvcache_ref(q, k, v, seqlens, table)
            pt_out, _ = attention_kvcache_ref(q, k, v, seqlens, table, upcast=False)
            nbytes = 2 * B * K * hkv * D * q.element_size()
            group = []

            def record(impl, fn, note=""):
                row = dict(impl=impl, page_size=page, B=B, K=K, H=H, hkv=hkv, D=D, avg_time=float("nan"),
                           bw=float("nan"), ratio_vs_fa4=float("nan"), correctness=False, note=note)
                try:
                    row["correctness"] = check_correct(fn(), ref, pt_out)
                    t = bench(fn)
                    row.update(avg_time=t, bw=nbytes / (t * 1e-3) / 1e12)
                except Exception as e:
                    print_exception(f"{impl} page {page} hkv {hkv}", e)
                    row["note"] = f"{UNAVAILABLE}: {error_text(e)}"
                group.append(row)

            for b in backends:
                record(f"ours_{b}", lambda b=b: fa.flash_attn_with_kvcache(q, k, v, seqlens, page_table=table,
                                                                            backend=b))
            if fa4 is not None:
                def fa4_fn():
                    with torch.no_grad():
                        if table is None:
                            r = fa4.flash_attn_func(q, k, v)
                        else:
                            r = fa4.flash_attn_varlen_func(q, k, v, seqused_k=seqlens, page_table=table)
                    return r[0] if isinstance(r, tuple) else r

                record("fa4", fa4_fn)
            else:
                group.append(dict(impl="fa4", page_size=page, hkv=hkv, note=f"{UNAVAILABLE}: {fa4_why}"))
            if page == 0:
                try:
                    fn, note = sdpa(q, k, v, backend="cudnn")
                    record("sdpa_cudnn", fn, note)
                except Exception as e:
                    print_exception("sdpa_cudnn", e)
            fa4_bw = next((r["bw"] for r in group if r["impl"] == "fa4" and r.get("bw") == r.get("bw")), None)
            for r in group:
                if fa4_bw and r.get("bw") == r.get("bw"):
                    r["ratio_vs_fa4"] = r["bw"] / fa4_bw
            rows += group
            del k, v
            torch.cuda.empty_cache()

    report(args, f"paged decode B={B} K={K} H={H} D={D} bf16 (ms, TB/s of K+V; ratio = bw / FA4 bw)",
           f"Paged decode: B={B} K={K} H={H} D={D} bf16", rows, COLUMNS,
           notes="flash_attn_with_kvcache with default arguments (num_splits=0, no host check); "
                 "page_size 0 = contiguous cache.")
    return rows


if __name__ == "__main__":
    main()
