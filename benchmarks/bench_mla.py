"""MLA decode bandwidth (``flash_mla_decode``) beside FlashInfer 0.7.2's MLA kernels.

Rows are issue 6's table: batch x cached length, page size, 64 heads unless noted, one
query, bf16, gaussian inputs (never zeros), random page tables, ``num_splits=0``.
TB/s = (ckv + kpe bytes read once + q + out bytes) / median time of a CUDA-graph replay
of the call (triton do_bench, L2 flushed): device time, as a decode loop under CUDA
graphs runs it (eager timing let host time leak into the small rows: 128 x 1024 measured
1.45 and 2.63 TB/s in two runs of the same code, 2026-11-29). The FlashInfer figures were measured on the H200 on 2026-11-29 (issue
6); they are printed beside ours with the ratios, not re-measured here.

    python benchmarks/bench_mla.py [--backends sm80] [--dtype bf16] [--fp8] [--csv out.csv] [--no-md]

``--fp8`` adds, after each 16-bit row, the same row over an FP8 (e4m3) latent cache (one
``kv_descale`` for ckv and kpe), timed in the same run: its TB/s counts the cache at one
byte a value, and ``vs_16bit`` is our 16-bit time over the fp8 time (tokens per second;
issue 16's target is >= 1.7 on the memory-bound rows).
"""

import argparse
import os
import sys

import common
from common import append_results_md, bench, check_correct, error_text, print_table, randn, write_csv

# (batch, seqlen, page_size, nheads, FlashInfer fa3 TB/s, FlashInfer fa2 TB/s)
ROWS = [
    (64, 1024, 1, 64, 1.87, 1.44),
    (128, 1024, 1, 64, 2.85, 1.88),
    (768, 1024, 1, 64, 3.49, 2.14),
    (64, 2048, 1, 64, 2.50, 1.70),
    (128, 2048, 1, 64, 3.26, 2.00),
    (768, 2048, 1, 64, 3.61, 2.14),
    (128, 2048, 64, 128, 2.30, 1.17),
    (1, 32768, 1, 64, 0.68, 0.60),
]
COLUMNS = ["impl", "batch", "seqlen", "page", "heads", "time_us", "tbps", "fi_fa3", "fi_fa2", "x_fa3", "x_fa2",
           "target", "vs_16bit", "correct", "note"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="all", help="MLA backends (comma list) or all that run here")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--rows", default="all", help="indices into the table (comma list)")
    p.add_argument("--fp8", action="store_true", help="also an FP8 (e4m3) cache row after each row")
    p.add_argument("--no-md", action="store_true")
    p.add_argument("--csv", default=None)
    return p.parse_args(argv)


def one_row(fa, backend, batch, seqlen, page, heads, dtype, fp8=False):
    import torch

    from flash_attn_cute import fwd, tuning
    from flash_attn_cute.problems import MlaProblem

    torch.manual_seed(0)
    pages_per_seq = -(-seqlen // page)
    q_nope, q_pe = randn(batch, 1, heads, 512, dtype=dtype), randn(batch, 1, heads, 64, dtype=dtype)
    ckv = randn(batch * pages_per_seq, page, 512, dtype=dtype)
    kpe = randn(batch * pages_per_seq, page, 64, dtype=dtype)
    table = torch.randperm(batch * pages_per_seq, device=common.DEVICE).view(batch, -1).to(torch.int32)
    seqlens = torch.full((batch,), seqlen, dtype=torch.int32, device=common.DEVICE)
    kw, cache_elem = {}, 2
    if fp8:  # one scale for a token's 576 values
        both, kw["kv_descale"] = fa.quantize_fp8(torch.cat([ckv, kpe], -1).unsqueeze(2), granularity="tensor")
        ckv, kpe, cache_elem = both[..., 0, :512].contiguous(), both[..., 0, 512:].contiguous(), 1
        del both
    args = (q_nope, q_pe, ckv, kpe, seqlens, table)
    fn = lambda: fa.flash_mla_decode(*args, backend=backend, **kw)
    ms = bench(fn, graph=True)
    nbytes = batch * seqlen * (512 + 64) * cache_elem + (q_nope.numel() + q_pe.numel() + batch * heads * 512) * 2
    correct = ""
    if batch * seqlen * heads <= 128 * 2048 * 64:  # the reference materialises K and V per head in fp32
        from flash_attn_cute.testing import mla_decode_ref

        out = fn()
        correct = check_correct(out, mla_decode_ref(*args, **kw)[0], mla_decode_ref(*args, upcast=False, **kw)[0])
    problem = MlaProblem(dtype=dtype, batch=batch, max_seqlen_q=1, max_seqlen_k=pages_per_seq * page, nheads=heads,
                         page_size=page, softmax_scale=576 ** -0.5, causal=False, has_lse=False,
                         kv_dtype=ckv.dtype if fp8 else None)
    plan = fwd.resolve(problem, backend, 0, None, q_nope.device, tuning.from_env()).plan
    del args, q_nope, q_pe, ckv, kpe
    return ms, nbytes / (ms * 1e-3) / 1e12, correct, f"splits={plan.num_splits}"


def main(argv=None):
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_mla.py needs a CUDA GPU")
    import flash_attn_cute as fa
    from flash_attn_cute import fwd

    cap = torch.cuda.get_device_capability()
    backends = [b for b in sorted(fwd.MLA_BACKENDS) if fwd.backend_module(b, "mla").runs_on(cap)] \
        if args.backends == "all" else args.backends.split(",")
    dtype = common.parse_dtype(args.dtype)
    picked = ROWS if args.rows == "all" else [ROWS[int(i)] for i in args.rows.split(",")]
    rows = []
    for backend in backends:
        # Targets (issue 6): SM80 kernel >= 1.1x FlashInfer fa2, SM90 >= 1.1x fa3.
        peer = "fi_fa2" if backend == "sm80" else "fi_fa3"
        for (batch, seqlen, page, heads, fa3, fa2), fp8 in ((r, f) for r in picked for f in (False, True)[:1 + args.fp8]):
            mode = os.environ.get("FLASH_ATTN_CUTE_MLA_SM90_QK") if backend == "sm90" else None
            row = dict(impl=f"flash_attn_cute {backend}" + (f" qk={mode}" if mode else "") + (" fp8" if fp8 else ""),
                       batch=batch, seqlen=seqlen, page=page, heads=heads, fi_fa3=fa3, fi_fa2=fa2)
            # SM90 at 1 x 32768 (split-KV): >= 2.0 TB/s besides the 1.1x.
            floor = 2.0 if backend == "sm90" and batch == 1 else 0.0
            try:
                ms, tbps, correct, note = one_row(fa, backend, batch, seqlen, page, heads, dtype, fp8)
                met = tbps >= max(1.1 * row[peer], floor)
                missed = f"<1.1x {peer[3:]}" + (f" or <{floor}" if floor else "")
                row.update(time_us=ms * 1e3, tbps=tbps, x_fa3=tbps / fa3, x_fa2=tbps / fa2, correct=correct,
                           note=note, target="" if fp8 else ("met" if met else missed))
                if fp8 and rows and rows[-1].get("time_us"):  # the 16-bit row just before, same shape
                    row["vs_16bit"] = rows[-1]["time_us"] / row["time_us"]
            except Exception as e:  # keep the table going; the row says why
                row.update(note=error_text(e))
            rows.append(row)
            torch.cuda.empty_cache()
            print_table([row], COLUMNS)
    print()
    print_table(rows, COLUMNS)
    write_csv(args.csv, COLUMNS, rows)
    if not args.no_md and rows:
        append_results_md(
            f"MLA decode ({args.dtype}, 1 query, num_splits=0)", rows, COLUMNS,
            notes="TB/s = (ckv + kpe read once + q + out) / median time of a CUDA-graph replay. fi_fa3 / fi_fa2: FlashInfer 0.7.2 "
                  "BatchMLAPagedAttentionWrapper on the H200 (2026-11-29, issue 6), not re-measured; x_*: our "
                  "TB/s over theirs. Targets: the SM80 kernel >= 1.1x fa2; the SM90 kernel >= 1.1x fa3 "
                  "and >= 2.0 TB/s at 1 x 32768.")


if __name__ == "__main__":
    main()
