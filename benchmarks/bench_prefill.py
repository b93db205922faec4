"""Prefill (square, batched) forward throughput: ours vs SDPA, FA4 and the CUTLASS FA2 example.

Default: B=4, S=8192, bf16, (D, H) in (64, 32), (128, 16), (256, 8), causal and not.
Implementations:
  ours_<backend>         flash_attn_cute.flash_attn_func(..., backend=<backend>), per --backends
  ours_fp8              with --fp8: q, k, v quantized to e4m3 (one descale per batch and head,
                        quantize_fp8), automatic backend, bf16 output; its correctness is
                        checked on the dequantized values against PyTorch's own FP8 algorithm
                        (testing.attention_ref(p_fp8=True)) with a 3x bound
  ours_fp8_2l<n>        with --fp8 --fp8-two-level n: ours_fp8 with fp8_two_level_interval=n
  ours_fp8_dyn          with --fp8 --fp8-dynamic: ours_fp8 with FLASH_ATTN_CUTE_SM90_PERSISTENT=dynamic
                        (persistent CTAs; masked tiles drawn from an atomic counter)
  sdpa_flash            torch SDPA, flash backend only
  sdpa_cudnn            torch SDPA, cuDNN backend only
  fa4                   flash_attn.cute.flash_attn_func (skipped if not importable)
  fa3                   FlashAttention-3's Hopper kernels (the fa3-fwd build, fa3_fwd_interface:
                        ../shared/gpu/pack_peers.sh; skipped if not importable)
  fa3_fp8               with --fp8: FA3 on the same e4m3 q, k, v and descales as ours_fp8
  cutlass_fa2_example   FlashAttentionForwardAmpere from the CUTLASS CuTe-DSL example,
                        loaded from the file named by $CUTLASS_FA2_EXAMPLE (skipped if unset),
                        128x128 tiles, 128 threads (128x64 where 128x128 does not fit)

tflops = 4*B*H*S*S*D / t, halved for causal. ratio_vs_best_peer = (time of the fastest
implementation other than ours) / (this row's time): > 1 means faster than every peer; for
the fp8 rows (ours_fp8*, fa3_fp8) the peers are the fp8 ones (fa3_fp8) where one ran.
ratio_vs_ours_16bit (with --fp8): our fastest 16-bit row's time / this row's time.
correct: the output of batch 0, heads 0..1 against the fp32 reference, bounded by 2x
PyTorch's own low-precision error.
"""

import argparse
import importlib.util
import math
import os
import sys

from common import UNAVAILABLE, append_results_md, attention_flops, bench, check_correct, error_text, load_fa3, load_fa4, \
    our_backends, parse_dtype, print_exception, print_table, randn, sdpa, write_csv

COLUMNS = ["impl", "causal", "B", "S", "H", "D", "avg_ms", "tflops", "ratio_vs_best_peer", "correct"]
FP8_COLUMNS = COLUMNS[:-1] + ["ratio_vs_ours_16bit", "correct"]
IMPLS = ["ours", "sdpa_flash", "sdpa_cudnn", "fa4", "fa3", "cutlass_fa2_example"]
HEADS_FOR_DIM = {64: 32, 128: 16, 256: 8}  # constant model width H * D = 2048
REF_HEADS = 2  # heads of batch 0 checked against the fp32 reference


def is_fp8(impl):
    """Rows that run e4m3 q, k, v (ours and FA3's): compared with each other."""
    return impl.startswith("ours_fp8") or impl == "fa3_fp8"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--B", type=int, default=4)
    p.add_argument("--S", type=int, default=8192, help="seqlen_q = seqlen_k")
    p.add_argument("--dims", default="64,128,256", help="head dims, heads from %s" % HEADS_FOR_DIM)
    p.add_argument("--causal", choices=["both", "true", "false"], default="both")
    p.add_argument("--quick", action="store_true", help="only D=128, non-causal")
    p.add_argument("--impls", default=",".join(IMPLS), help="comma-separated subset of " + ",".join(IMPLS))
    p.add_argument("--backends", default="all", help="our backends to run as impl 'ours' (default: all registered)")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--fp8", action="store_true", help="add ours_fp8 (e4m3 q, k, v) beside the 16-bit rows")
    p.add_argument("--fp8-two-level", type=int, default=0, metavar="N",
                   help="with --fp8: also ours_fp8_2l<N>, fp8_two_level_interval=N")
    p.add_argument("--fp8-dynamic", action="store_true",
                   help="with --fp8: also ours_fp8_dyn, FLASH_ATTN_CUTE_SM90_PERSISTENT=dynamic")
    p.add_argument("--warmup", type=float, default=25, help="do_bench warmup, ms")
    p.add_argument("--rep", type=float, default=150, help="do_bench rep, ms")
    p.add_argument("--no-md", action="store_true", help="do not update benchmarks/RESULTS.md")
    p.add_argument("--csv", default=None, metavar="PATH", help="write the rows to this CSV file")
    return p.parse_args(argv)


def load_cutlass_example(path):
    spec = importlib.util.spec_from_file_location("cutlass_fa2_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cutlass_example_fn(module, q, k, v, causal, softmax_scale):
    """Compile the example for this problem (as its run() does) and return (fn, note)."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    import torch
    from cutlass.cute.runtime import from_dlpack

    cls = module.FlashAttentionForwardAmpere
    dtype = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}[q.dtype]
    head_dim = q.shape[-1]
    for m_block, n_block in ((128, 128), (128, 64)):
        if cls.can_implement(dtype, head_dim, m_block, n_block, 128, causal):
            break
    else:
        raise ValueError(f"example cannot implement head_dim={head_dim}")
    o = torch.empty_like(q)

    def to_cute(t):
        return (from_dlpack(t, assumed_align=16)
                .mark_layout_dynamic(leading_dim=3)
                .mark_compact_shape_dynamic(mode=3, stride_order=t.dim_order(),
                                            divisibility=128 // dtype.width))

    qc, kc, vc, oc = (to_cute(t) for t in (q, k, v, o))
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    kernel = cls(head_dim, m_block, n_block, 128, causal)
    compiled = cute.compile(kernel, qc, kc, vc, oc, softmax_scale, stream)

    def fn():
        compiled(qc, kc, vc, oc, softmax_scale, stream)
        return o

    return fn, f"{m_block}x{n_block}"


def main(argv=None):
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_prefill.py needs a CUDA GPU")
    import flash_attn_cute
    from flash_attn_cute.testing import attention_ref, dequantize_kv, is_close

    dtype = parse_dtype(args.dtype)
    impls = [x for x in args.impls.split(",") if x]

    backends = our_backends(args.backends)
    dims = [128] if args.quick else [int(x) for x in args.dims.split(",")]
    causals = [False] if args.quick else {"both": [False, True], "true": [True], "false": [False]}[args.causal]
    B, S = args.B, args.S

    fa4, fa4_why = load_fa4() if "fa4" in impls else (None, "not requested")
    fa3, fa3_why = load_fa3() if "fa3" in impls else (None, "not requested")
    example_path = os.environ.get("CUTLASS_FA2_EXAMPLE")
    example, example_why = None, "CUTLASS_FA2_EXAMPLE not set"
    if "cutlass_fa2_example" in impls and example_path:
        try:
            example = load_cutlass_example(example_path)
        except Exception as e:
            example_why = error_text(e)
            print_exception("cutlass_fa2_example", e)

    columns = FP8_COLUMNS if args.fp8 else COLUMNS
    rows = []
    notes = {}  # note text -> the configs it applies to (so a missing peer is noted once)
    for D in dims:
        H = HEADS_FOR_DIM.get(D, 2048 // D)
        for causal in causals:
            torch.manual_seed(0)
            q, k, v = (randn(B, S, H, D, dtype=dtype) for _ in range(3))
            scale = 1.0 / math.sqrt(D)
            sl = (slice(0, 1), slice(None), slice(0, REF_HEADS))
            out_ref, _ = attention_ref(q[sl], k[sl], v[sl], causal=causal)
            out_pt, _ = attention_ref(q[sl], k[sl], v[sl], causal=causal, upcast=False)
            flops = attention_flops(B, H, S, S, D, causal=causal)
            group = []
            where = f"D={D}{' causal' if causal else ''}"

            ours = [f"ours_{b}" for b in backends] if "ours" in impls else []
            if args.fp8:
                ours.append("ours_fp8")
                if args.fp8_two_level:
                    ours.append(f"ours_fp8_2l{args.fp8_two_level}")
                if args.fp8_dynamic:
                    ours.append("ours_fp8_dyn")
                fp8_inputs = [flash_attn_cute.quantize_fp8(x) for x in (q, k, v)]
                (q8, qd), (k8, kd), (v8, vd) = fp8_inputs
                deq = [dequantize_kv(x8[sl], d[:1, :REF_HEADS]) for x8, d in fp8_inputs]
                out_ref8, _ = attention_ref(*deq, causal=causal)
                out_pt8, _ = attention_ref(*deq, causal=causal, p_fp8=True)
            peers = [i for i in impls if i != "ours"] + (["fa3_fp8"] if args.fp8 and "fa3" in impls else [])
            for impl in ours + peers:
                row = dict(impl=impl, causal=causal, B=B, S=S, H=H, D=D, avg_ms=float("nan"),
                           tflops=float("nan"), ratio_vs_best_peer=float("nan"), correct=False)
                group.append(row)
                try:
                    if impl == "ours_fp8_dyn":
                        def fn(knob="FLASH_ATTN_CUTE_SM90_PERSISTENT"):
                            # the knob is read at each call (``tuning.from_env``), its plan cached apart
                            prev = os.environ.get(knob)
                            os.environ[knob] = "dynamic"
                            try:
                                return flash_attn_cute.flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd,
                                                                       k_descale=kd, v_descale=vd)
                            finally:
                                if prev is None:
                                    os.environ.pop(knob)
                                else:
                                    os.environ[knob] = prev
                    elif impl.startswith("ours_fp8"):
                        fn = lambda n=args.fp8_two_level if impl != "ours_fp8" else 0: flash_attn_cute.flash_attn_func(
                            q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd,
                            fp8_two_level_interval=n)
                    elif impl.startswith("ours_"):
                        fn = lambda b=impl[len("ours_"):]: flash_attn_cute.flash_attn_func(
                            q, k, v, causal=causal, backend=b)
                    elif impl in ("sdpa_flash", "sdpa_cudnn"):
                        fn, _ = sdpa(q, k, v, backend=impl.split("_")[1], causal=causal)
                    elif impl == "fa4":
                        if fa4 is None:
                            raise RuntimeError(fa4_why)

                        def fn():
                            with torch.no_grad():
                                r = fa4.flash_attn_func(q, k, v, causal=causal)
                            return r[0] if isinstance(r, tuple) else r
                    elif impl in ("fa3", "fa3_fp8"):
                        if fa3 is None:
                            raise RuntimeError(fa3_why)
                        fa3_args = (q, k, v) if impl == "fa3" else (q8, k8, v8)
                        fa3_kw = {} if impl == "fa3" else dict(q_descale=qd, k_descale=kd, v_descale=vd)

                        def fn(a=fa3_args, kw=fa3_kw):
                            r = fa3.flash_attn_func(*a, causal=causal, **kw)
                            return r[0] if isinstance(r, tuple) else r
                    elif impl == "cutlass_fa2_example":
                        if example is None:
                            raise RuntimeError(example_why)
                        fn, tile = cutlass_example_fn(example, q, k, v, causal, scale)
                        notes.setdefault(f"cutlass_fa2_example: tile {tile}", []).append(where)
                    else:
                        raise ValueError(f"unknown impl {impl}")
                    out = fn()
                    if is_fp8(impl):
                        row["correct"] = bool(is_close(out[sl], out_ref8, out_pt8, mult=3.0)[0])
                    else:
                        row["correct"] = check_correct(out[sl], out_ref, out_pt)
                    t_ms = bench(fn, args.warmup, args.rep)
                    row.update(avg_ms=t_ms, tflops=flops / (t_ms * 1e-3) / 1e12)
                except Exception as e:
                    print_exception(f"{impl} D={D} causal={causal}", e)
                    row["impl"] = f"{impl} ({UNAVAILABLE})"
                    notes.setdefault(f"{impl}: {UNAVAILABLE}: {error_text(e)}", []).append(where)
                torch.cuda.empty_cache()

            peer_ms = {fp8: [r["avg_ms"] for r in group if not r["impl"].startswith("ours")
                             and is_fp8(r["impl"]) == fp8 and not math.isnan(r["avg_ms"])] for fp8 in (False, True)}
            for r in group:
                peers_ms = peer_ms[is_fp8(r["impl"])] or peer_ms[False]  # fp8 rows: fp8 peers where one ran
                if peers_ms and not math.isnan(r["avg_ms"]):
                    r["ratio_vs_best_peer"] = min(peers_ms) / r["avg_ms"]
            ours16 = [r["avg_ms"] for r in group if r["impl"].startswith("ours_")
                      and not is_fp8(r["impl"]) and not math.isnan(r["avg_ms"])]
            for r in group:
                r["ratio_vs_ours_16bit"] = min(ours16) / r["avg_ms"] if ours16 and not math.isnan(r["avg_ms"]) \
                    else float("nan")
            rows += group

    write_csv(args.csv, columns, rows)
    print(f"\nprefill {args.dtype}: avg_ms (median), tflops TFLOP/s, ratio = best peer time / this time")
    print_table(rows, columns)
    notes = [f"{text} ({', '.join(where)})" for text, where in notes.items()]
    for n in notes:
        print("note:", n)
    if not args.no_md:
        title = f"Prefill forward: B={B} S={S} {args.dtype}" + (" and fp8" if args.fp8 else "") + (
            " (quick)" if args.quick else "")
        append_results_md(title, rows, columns, notes="\n".join(
            ["avg_ms median (triton do_bench); ratio_vs_best_peer = fastest non-ours time / row time"
             " (fp8 rows: the fastest fp8 peer's where one ran)."]
            + [f"- {n}" for n in notes]))
    return rows


if __name__ == "__main__":
    main()
