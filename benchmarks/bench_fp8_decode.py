"""FP8 (e4m3) KV-cache decode beside the bf16 path, FA3 and FA4, in the same run.

Rows (issue 33's): one sequence of 131,072 keys (contiguous cache), and 64 sequences of
4,096 keys, contiguous and in pages of 1, 16 and 64; one query, 32 query heads, 8 KV heads
(``--hkv 32``: 32),
d128, ``flash_attn_with_kvcache`` with default arguments (num_splits=0), timed as
CUDA-graph replays. ``cache_tbps``: bytes of K and V as stored (fp8: 1 byte per value)
per second; ``keys_vs_bf16``: keys per second against our best bf16 kernel on the same
row (>= 1.8 is the target). FP8 rows for each of our kernels that runs here (SM80, SM90),
with the call's default arguments: on SM90 the kernel quantizes the 16-bit queries to e4m3
itself and runs both GEMMs in fp8 wgmma (``device/q_quant.py``); ``ours_sm90 fp8 widen``:
the same call on the SM90 kernel that widens the cache to 16 bits instead
(FLASH_ATTN_CUTE_SM90_FP8_KV=widen, the A/B of the two in one run); ``ours_sm90 fp8 q``:
FP8 attention, the caller quantizing the queries (one descale per batch and KV head,
FA3's fp8 decode). ``correctness`` of a row whose kernel quantizes q: against the fp32
reference on the queries quantized as the kernel quantizes them
(``testing.quantize_q_ref``; for ``fp8 q``, the caller's) within 3x PyTorch's own FP8
algorithm (P in e4m3) on them; the other rows within 2x PyTorch's error in q's dtype.

    python benchmarks/bench_fp8_decode.py [--csv out.csv] [--no-md] [--sm90-tiles "64,64,3@32;..."]
                                          [--two-level N] [--rows "paged 1,paged 16"] [--gathers]

``--gathers`` adds, on the paged rows of a multiple of 16 keys that hold no whole block
(pages of 16), ``ours_sm90 bf16 gather``, ``ours_sm90 fp8 gather`` and ``ours_sm90 fp8 q
gather``: the same calls with the pages' rows gathered by cp.async
(FLASH_ATTN_CUTE_SM90_PAGED_KV=gather) instead of the default TMA boxes, the A/B of the two in
one run (the bf16 gather row counts toward "our best bf16"). Pages of 64 in boxes on the (64,
128) decode tile: ``--sm90-tiles 64,128,2,0,2:boxes``.

``--two-level N`` adds ``ours_sm90 fp8 2lN`` and ``ours_sm90 fp8 q 2lN``: the two SM90 fp8
rows with ``fp8_two_level_interval=N`` (the P V product accumulated in two levels).

``--sm90-tiles`` (a tuning aid) adds SM90 fp8 rows on the named tiles
(FLASH_ATTN_CUTE_SM90_TILE "m,n,stages[,ex2,ctas]", ``tuning.py``; the fp8 plan keeps n and
fits the stages), each with its own ``num_splits`` after "@" on the one-sequence row
(default, and on the batched rows: 0, the heuristic) and its kernel after ":"
(FLASH_ATTN_CUTE_SM90_FP8_KV "quantize_q" / "widen"; default: the call's), "+boxes" (or
":boxes" alone) reading a paged cache by TMA boxes (FLASH_ATTN_CUTE_SM90_PAGED_KV). ``--rows``
narrows the rows by cache name. FA3 (the fa3-fwd build of its Hopper
kernels, where ``fa3_fwd_interface`` imports: ``../shared/gpu/pack_peers.sh``) on the
contiguous rows, which it runs (no paged KV): its bf16 decode and its FP8 decode with e4m3
q, k, v (the queries quantized by ``quantize_fp8``, one descale per batch and KV head).
"""

import argparse
import math
import os
import sys

import common
from common import UNAVAILABLE, bench, check_correct, error_text, load_fa3, load_fa4, our_backends, print_exception, report

COLUMNS = ["impl", "cache", "shape", "us", "cache_tbps", "keys_vs_bf16", "correctness", "note"]
ROWS = [("contiguous", 1, 131072, 0), ("contiguous", 64, 4096, 0), ("paged 1", 64, 4096, 1), ("paged 16", 64, 4096, 16),
        ("paged 64", 64, 4096, 64)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--H", type=int, default=32)
    p.add_argument("--hkv", type=int, default=8)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--no-md", action="store_true")
    p.add_argument("--csv", default=None)
    p.add_argument("--q-dtype", default="bf16", choices=["bf16", "fp16"],
                   help="the queries' dtype, and the 16-bit cache's the fp8 rows are compared with")
    p.add_argument("--sm90-tiles", default="", help='";"-separated "m,n,stages[,ex2,ctas][@num_splits][:kv_mode]"')
    p.add_argument("--rows", default="", help='","-separated subset of the rows by cache name ("paged 16,contiguous")')
    p.add_argument("--gathers", action="store_true", help="add SM90 rows at pages of a multiple of 16 with the "
                   "cache's rows gathered (FLASH_ATTN_CUTE_SM90_PAGED_KV=gather) instead of the default TMA boxes: "
                   "bf16, fp8 (q quantized) and fp8 q")
    p.add_argument("--two-level", type=int, default=0, metavar="N", help="add SM90 fp8 rows with "
                   "fp8_two_level_interval=N")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_fp8_decode.py needs a CUDA GPU")
    import flash_attn_cute as fa
    from flash_attn_cute.testing import attention_kvcache_ref, dequantize_kv, is_close, quantize_q_ref

    fa4, fa4_why = load_fa4()
    fa3, fa3_why = load_fa3()
    H, hkv, D = args.H, args.hkv, args.D
    qdtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.q_dtype]
    rows = []
    for name, B, K, page in ROWS:
        if args.rows and name not in args.rows.split(","):
            continue
        torch.manual_seed(0)
        dev = common.DEVICE
        q = torch.randn(B, 1, H, D, device=dev, dtype=qdtype)
        seqlens = torch.full((B,), K, dtype=torch.int32, device=dev)
        k, v = (torch.randn(B, K, hkv, D, device=dev) for _ in range(2))
        k8, kd = fa.quantize_fp8(k)
        v8, vd = fa.quantize_fp8(v)
        kq, vq = dequantize_kv(k8, kd).to(qdtype), dequantize_kv(v8, vd).to(qdtype)  # the 16-bit cache: same values
        del k, v
        table = None
        if page:
            pages_per_seq = math.ceil(K / page)
            table = torch.randperm(B * pages_per_seq, device=dev).view(B, -1).to(torch.int32)
            inv = table.flatten().long().argsort()  # pool page p holds (sequence, page) inv[p]

            def pool(x):
                return x.view(B * pages_per_seq, page, hkv, D)[inv]

            k8p, v8p, kqp, vqp = pool(k8), pool(v8), pool(kq), pool(vq)
        else:
            k8p, v8p, kqp, vqp = k8, v8, kq, vq
        ref, _ = attention_kvcache_ref(q, kq.float(), vq.float(), seqlens)
        pt_out, _ = attention_kvcache_ref(q, kq, vq, seqlens, upcast=False)
        fp8_refs = lambda qx: (attention_kvcache_ref(qx, kq.float(), vq.float(), seqlens)[0],
                               attention_kvcache_ref(qx, kq.float(), vq.float(), seqlens, p_fp8=True)[0])
        refs_qq = fp8_refs(quantize_q_ref(q))  # the queries the SM90 kernel attends with over the e4m3 cache
        # FP8 attention's queries (ours with q_descale, FA3's fp8 decode): one descale per batch and KV head.
        q8, qd = fa.quantize_fp8(q.view(B, 1, hkv, -1))
        refs_q8 = fp8_refs(dequantize_kv(q8, qd).view(B, 1, H, D))
        q8 = q8.view(B, 1, H, D)
        group = []

        def record(impl, fn, elem_bytes, note="", refs=None):
            row = dict(impl=impl, cache=name, shape=f"b{B} x {K} h{H}/{hkv} d{D}", us=float("nan"),
                       cache_tbps=float("nan"), keys_vs_bf16=float("nan"), correctness=False, note=note)
            try:
                if refs is None:
                    row["correctness"] = check_correct(fn(), ref, pt_out)
                else:
                    row["correctness"] = bool(is_close(fn(), *refs, mult=3.0)[0])
                t = bench(fn, graph=True)
                row.update(us=t * 1e3, cache_tbps=2 * B * K * hkv * D * elem_bytes / (t * 1e-3) / 1e12)
            except Exception as e:
                print_exception(f"{impl} {name}", e)
                row["note"] = f"{UNAVAILABLE}: {error_text(e)}"
            group.append(row)

        for b in our_backends("all"):
            record(f"ours_{b} {args.q_dtype}", lambda b=b: fa.flash_attn_with_kvcache(q, kqp, vqp, seqlens, page_table=table,
                                                                            backend=b), 2)
        fp8_call = lambda b, n=0: lambda: fa.flash_attn_with_kvcache(q, k8p, v8p, seqlens, page_table=table,
                                                                     k_descale=kd, v_descale=vd, backend=b,
                                                                     fp8_two_level_interval=n)
        for b in our_backends("all"):
            record(f"ours_{b} fp8", fp8_call(b), 1, refs=refs_qq if b == "sm90" else None)
        if "sm90" in our_backends("all"):
            os.environ["FLASH_ATTN_CUTE_SM90_FP8_KV"] = "widen"
            record("ours_sm90 fp8 widen", fp8_call("sm90"), 1)
            os.environ.pop("FLASH_ATTN_CUTE_SM90_FP8_KV")
            record("ours_sm90 fp8 q", lambda: fa.flash_attn_with_kvcache(
                q8, k8p, v8p, seqlens, page_table=table, q_descale=qd, k_descale=kd, v_descale=vd, backend="sm90"), 1,
                   refs=refs_q8)
            if args.two_level:
                n = args.two_level
                record(f"ours_sm90 fp8 2l{n}", fp8_call("sm90", n), 1, refs=refs_qq)
                record(f"ours_sm90 fp8 q 2l{n}", lambda: fa.flash_attn_with_kvcache(
                    q8, k8p, v8p, seqlens, page_table=table, q_descale=qd, k_descale=kd, v_descale=vd,
                    backend="sm90", fp8_two_level_interval=n), 1, refs=refs_q8)
        if args.gathers and page and page % 16 == 0 and page % 64 and "sm90" in our_backends("all"):
            # The same calls with the paged cache's rows gathered (FLASH_ATTN_CUTE_SM90_PAGED_KV).
            os.environ["FLASH_ATTN_CUTE_SM90_PAGED_KV"] = "gather"
            record(f"ours_sm90 {args.q_dtype} gather", lambda: fa.flash_attn_with_kvcache(
                q, kqp, vqp, seqlens, page_table=table, backend="sm90"), 2)
            record("ours_sm90 fp8 gather", fp8_call("sm90"), 1, refs=refs_qq)
            record("ours_sm90 fp8 q gather", lambda: fa.flash_attn_with_kvcache(
                q8, k8p, v8p, seqlens, page_table=table, q_descale=qd, k_descale=kd, v_descale=vd, backend="sm90"), 1,
                   refs=refs_q8)
            os.environ.pop("FLASH_ATTN_CUTE_SM90_PAGED_KV")
        for spec in filter(None, args.sm90_tiles.split(";")):
            spec_tile, _, mode = spec.partition(":")
            tile, _, splits = spec_tile.partition("@")
            os.environ["FLASH_ATTN_CUTE_SM90_TILE"] = tile
            modes = set(filter(None, mode.split("+")))
            if "boxes" in modes:  # the paged cache read by TMA boxes (FLASH_ATTN_CUTE_SM90_PAGED_KV)
                os.environ["FLASH_ATTN_CUTE_SM90_PAGED_KV"] = "boxes"
            if modes - {"boxes"}:
                os.environ["FLASH_ATTN_CUTE_SM90_FP8_KV"] = (modes - {"boxes"}).pop()
            widened = "widen" in modes
            record(f"ours_sm90 fp8 [{spec}]", lambda s=int(splits or 0) if B == 1 else 0: fa.flash_attn_with_kvcache(
                q, k8p, v8p, seqlens, page_table=table, k_descale=kd, v_descale=vd, backend="sm90", num_splits=s), 1,
                   refs=None if widened else refs_qq)
            os.environ.pop("FLASH_ATTN_CUTE_SM90_TILE")
            os.environ.pop("FLASH_ATTN_CUTE_SM90_FP8_KV", None)
            os.environ.pop("FLASH_ATTN_CUTE_SM90_PAGED_KV", None)
        if fa3 is not None and table is None:
            # FA3's own FP8 decode: the same e4m3 q, k, v and (batch, nheads_kv) descales, split-KV.
            first = lambda r: r[0] if isinstance(r, tuple) else r
            record(f"fa3 {args.q_dtype}", lambda: first(fa3.flash_attn_with_kvcache(q, kq, vq, cache_seqlens=seqlens,
                                                                                     num_splits=0)), 2)
            record("fa3 fp8 q", lambda: first(fa3.flash_attn_with_kvcache(
                q8, k8, v8, cache_seqlens=seqlens, num_splits=0, q_descale=qd, k_descale=kd, v_descale=vd)), 1,
                refs=refs_q8)
        elif fa3 is None:
            group.append(dict(impl="fa3", cache=name, note=f"{UNAVAILABLE}: {fa3_why}"))
        if fa4 is not None:
            def fa4_fn():
                with torch.no_grad():
                    r = (fa4.flash_attn_func(q, kqp, vqp) if table is None else
                         fa4.flash_attn_varlen_func(q, kqp, vqp, seqused_k=seqlens, page_table=table))
                return r[0] if isinstance(r, tuple) else r

            record(f"fa4 {args.q_dtype}", fa4_fn, 2)
        else:
            group.append(dict(impl=f"fa4 {args.q_dtype}", cache=name, note=f"{UNAVAILABLE}: {fa4_why}"))
        best_bf16 = min((r["us"] for r in group if r["impl"].startswith("ours_")
                         and r["impl"].endswith((" " + args.q_dtype, f" {args.q_dtype} gather"))
                         and r["us"] == r["us"]),
                        default=float("nan"))
        for r in group:
            if r.get("us") is not None and r["us"] == r["us"]:  # timed (not NaN, not a peer that is absent)
                r["keys_vs_bf16"] = best_bf16 / r["us"]
        rows += group
    report(args, f"FP8 KV-cache decode, {args.q_dtype} queries, h{H}/{hkv} d{D} (us: CUDA-graph replay)", "FP8 KV-cache decode", rows,
           COLUMNS, notes="flash_attn_with_kvcache, default arguments; cache_tbps counts the cache as stored; "
                          "keys_vs_bf16 = our best bf16 time / this time.")
    return rows


if __name__ == "__main__":
    main()
