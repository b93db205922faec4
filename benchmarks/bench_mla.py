"""MLA decode bandwidth (``flash_mla_decode``) beside FlashInfer 0.7.2's MLA kernels, timed
in the same process.

Rows are issue 17's table: batch x cached length, page size, heads (one latent KV head),
one query, bf16, gaussian inputs (never zeros), random page tables, ``num_splits=0``.
TB/s = (ckv + kpe bytes read once + q + out bytes) / median time of a CUDA-graph replay
of the call (triton do_bench, L2 flushed): device time, as a decode loop under CUDA
graphs runs it (eager timing let host time leak into the small rows: 128 x 1024 measured
1.45 and 2.63 TB/s in two runs of the same code, 2026-11-29). TFLOP/s counts Q K^T (576)
and P V (512) per head and key.

FlashInfer (``flashinfer.mla.BatchMLAPagedAttentionWrapper``, backends "fa3" and "fa2")
runs each row on the same tensors, planned once, timed the same way; where it does not
import, its columns stay empty (on the GPU machine: ``../shared/gpu/README.md``).

    python benchmarks/bench_mla.py [--backends sm80] [--dtype bf16] [--rows 0,5] [--fp8]
                                   [--heads 8,16] [--peers fa3,fa2 | --no-peers] [--csv out.csv] [--no-md]

``--heads`` runs each picked row at these head counts instead of its own: a count the
kernels pad (8, 24, 100: the last 64-row tile partly empty) beside the next multiple of
16 it costs the same as (the same tiles, bytes and splits; ``mla_kernel`` docstring).

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

# (batch, seqlen, page_size, nheads)
ROWS = [
    (64, 1024, 1, 64),
    (128, 1024, 1, 64),
    (768, 1024, 1, 64),
    (64, 2048, 1, 64),
    (128, 2048, 1, 64),
    (768, 2048, 1, 64),
    (128, 2048, 64, 128),
    (32, 8192, 64, 128),
    (256, 4096, 64, 16),
    (1, 32768, 1, 64),
]
PEERS = ("fa3", "fa2")
COLUMNS = ["impl", "batch", "seqlen", "page", "heads", "time_us", "tbps", "tflops", "fi_fa3", "fi_fa2", "x_fa3",
           "x_fa2", "target", "vs_16bit", "correct", "fi_correct", "note"]
# The fp32 reference materialises K and V per head: rows up to this many (batch x seqlen x
# heads) are checked, ours and FlashInfer's outputs alike.
REF_LIMIT = 128 * 2048 * 64


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="all", help="MLA backends (comma list) or all that run here")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--rows", default="all", help="indices into the table (comma list)")
    p.add_argument("--fp8", action="store_true", help="also an FP8 (e4m3) cache row after each row")
    p.add_argument("--heads", default=None, help="head counts (comma list) to run each row at, instead of its own")
    p.add_argument("--peers", default=",".join(PEERS), help="FlashInfer backends to run (comma list)")
    p.add_argument("--no-peers", action="store_true", help="do not run FlashInfer")
    p.add_argument("--no-md", action="store_true")
    p.add_argument("--csv", default=None)
    return p.parse_args(argv)


def make_inputs(batch, seqlen, page, heads, dtype):
    import torch

    torch.manual_seed(0)
    pages_per_seq = -(-seqlen // page)
    q_nope, q_pe = randn(batch, 1, heads, 512, dtype=dtype), randn(batch, 1, heads, 64, dtype=dtype)
    ckv = randn(batch * pages_per_seq, page, 512, dtype=dtype)
    kpe = randn(batch * pages_per_seq, page, 64, dtype=dtype)
    table = torch.randperm(batch * pages_per_seq, device=common.DEVICE).view(batch, -1).to(torch.int32)
    seqlens = torch.full((batch,), seqlen, dtype=torch.int32, device=common.DEVICE)
    return q_nope, q_pe, ckv, kpe, seqlens, table


def row_bytes_flops(batch, seqlen, heads, cache_elem=2):
    nbytes = batch * seqlen * (512 + 64) * cache_elem + batch * heads * (512 + 64 + 512) * 2
    return nbytes, 2 * batch * heads * seqlen * (576 + 512)


def flashinfer_call(inputs, page, heads, peer, workspace=None):
    """FlashInfer's MLA wrapper (backend ``peer``: "fa3" or "fa2") planned once on the row's
    tensors: the call to time (or profile, ``ncu_profile.py``). Raises where FlashInfer
    does not import or does not take the row."""
    import torch
    from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata

    q_nope, q_pe, ckv, kpe, seqlens, table = inputs
    batch, pages_per_seq = table.shape
    dev = q_nope.device
    meta = MLAPlanMetadata.csr(
        qo_indptr=torch.arange(batch + 1, dtype=torch.int32, device=dev),
        kv_indptr=torch.arange(batch + 1, dtype=torch.int32, device=dev) * pages_per_seq,
        kv_indices=table.flatten().contiguous(), kv_len_arr=seqlens)
    query = (q_nope[:, 0].contiguous(), q_pe[:, 0].contiguous())
    if workspace is None:
        workspace = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    wrapper = BatchMLAPagedAttentionWrapper(workspace, backend=peer)
    wrapper.plan(metadata=meta, num_heads=heads, head_dim_ckv=512, head_dim_kpe=64, page_size=page,
                 causal=False, sm_scale=576 ** -0.5, q_data_type=q_nope.dtype, kv_data_type=ckv.dtype,
                 query_layout="split", kv_cache_layout="split")
    return lambda: wrapper.run(query=query, kv_cache=(ckv, kpe))


def flashinfer_times(inputs, page, heads, peers=PEERS, refs=None):
    """({peer: ms}, {peer: correct}) of FlashInfer's MLA wrapper on the row's tensors (fa3,
    fa2), each planned once and timed as a CUDA-graph replay; ({}, {}) where FlashInfer does
    not import, a peer that fails is left out (its error printed). ``refs``: the row's
    (fp32 reference, PyTorch low-precision) outputs, (b, 1, h, 512), against which each
    peer's output is checked as ours is (``check_correct``); None: not checked."""
    try:
        import torch
        import flashinfer.mla  # noqa: F401
    except Exception as e:  # not installed here
        print(f"[flashinfer] {error_text(e)}", file=sys.stderr)
        return {}, {}
    times, correct = {}, {}
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=inputs[0].device)
    for peer in peers:
        try:
            fn = flashinfer_call(inputs, page, heads, peer, workspace)
            times[peer] = bench(fn, graph=True)
        except Exception as e:
            print(f"[flashinfer {peer}] {error_text(e)}", file=sys.stderr)
            continue
        if refs is not None:  # (b, h, 512) against (b, 1, h, 512); never loses the timing
            try:
                correct[peer] = check_correct(fn().reshape(refs[0].shape), *refs)
            except Exception as e:
                print(f"[flashinfer {peer} check] {error_text(e)}", file=sys.stderr)
                correct[peer] = False
    return times, correct


def references(inputs, **kw):
    """(fp32 reference, PyTorch's own low-precision result) of a row (``kw``: an FP8 cache's
    ``kv_descale``), or None past ``REF_LIMIT``: computed once a row, for every
    implementation checked against it."""
    q_nope, _, _, _, seqlens, table = inputs
    if q_nope.shape[0] * int(seqlens[0]) * q_nope.shape[2] > REF_LIMIT:
        return None
    from flash_attn_cute.testing import mla_decode_ref

    return mla_decode_ref(*inputs, **kw)[0], mla_decode_ref(*inputs, upcast=False, **kw)[0]


def one_row(fa, backend, inputs, page, heads, refs, fp8=False):
    """``refs``: the 16-bit row's ``references`` (an FP8 row computes its own)."""
    import torch

    from flash_attn_cute import seam
    from flash_attn_cute.host import tuning
    from flash_attn_cute.host.problems import MlaProblem

    q_nope, q_pe, ckv, kpe, seqlens, table = inputs
    batch, pages_per_seq = table.shape
    seqlen = int(seqlens[0])
    kw, cache_elem = {}, 2
    if fp8:  # one scale for a token's 576 values
        both, kw["kv_descale"] = fa.quantize_fp8(torch.cat([ckv, kpe], -1).unsqueeze(2), granularity="tensor")
        ckv, kpe, cache_elem = both[..., 0, :512].contiguous(), both[..., 0, 512:].contiguous(), 1
        del both
    args = (q_nope, q_pe, ckv, kpe, seqlens, table)
    fn = lambda: fa.flash_mla_decode(*args, backend=backend, **kw)
    ms = bench(fn, graph=True)
    nbytes, flops = row_bytes_flops(batch, seqlen, heads, cache_elem)
    if fp8:
        refs = references(args, **kw)
    correct = "" if refs is None else check_correct(fn(), *refs)
    problem = MlaProblem(dtype=q_nope.dtype, batch=batch, max_seqlen_q=1, max_seqlen_k=pages_per_seq * page,
                         nheads=heads, page_size=page, softmax_scale=576 ** -0.5, causal=False, has_lse=False,
                         kv_dtype=ckv.dtype if fp8 else None)
    plan = seam.resolve(problem, backend, 0, None, q_nope.device, tuning.from_env()).plan
    return ms, nbytes / (ms * 1e-3) / 1e12, flops / (ms * 1e-3) / 1e12, correct, f"splits={plan.num_splits}"


def targets_met(backend, row) -> str:
    """Issue 17: SM90 >= 1.1x FlashInfer fa3 on every row, >= 3.9 TB/s at 768 x 2048, >= 560
    TFLOP/s with 128 heads, >= 2.0 TB/s at 1 x 32768; SM80 >= 1.1x fa2."""
    peer = "fa2" if backend == "sm80" else "fa3"
    missed = []
    if row.get(f"x_{peer}") is None:
        missed.append(f"no {peer}")  # not measured: the ratio target is not judged
    elif row[f"x_{peer}"] < 1.1:
        missed.append(f"<1.1x {peer}")
    if backend == "sm90":
        if (row["batch"], row["seqlen"]) == (768, 2048) and row["tbps"] < 3.9:
            missed.append("<3.9 TB/s")
        if row["heads"] == 128 and row["tflops"] < 560:
            missed.append("<560 TFLOP/s")
        if row["batch"] == 1 and row["tbps"] < 2.0:
            missed.append("<2.0 TB/s")
    return "; ".join(missed) or "met"


def main(argv=None):
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_mla.py needs a CUDA GPU")
    import flash_attn_cute as fa
    from flash_attn_cute import seam

    cap = torch.cuda.get_device_capability()
    backends = [b for b in sorted(seam.MLA_BACKENDS) if seam.backend_module(b, "mla").runs_on(cap)] \
        if args.backends == "all" else args.backends.split(",")
    dtype = common.parse_dtype(args.dtype)
    picked = ROWS if args.rows == "all" else [ROWS[int(i)] for i in args.rows.split(",")]
    if args.heads:
        picked = [(b, s, p, int(h)) for b, s, p, _ in picked for h in args.heads.split(",")]
    rows = []
    for batch, seqlen, page, heads in picked:
        inputs = make_inputs(batch, seqlen, page, heads, dtype)
        nbytes, _ = row_bytes_flops(batch, seqlen, heads)
        refs = references(inputs)
        peer_ms, peer_ok = ({}, {}) if args.no_peers else flashinfer_times(
            inputs, page, heads, args.peers.split(","), refs)
        peer_tbps = {p: nbytes / (ms * 1e-3) / 1e12 for p, ms in peer_ms.items()}
        for backend, fp8 in ((b, f) for b in backends for f in (False, True)[:1 + args.fp8]):
            mode = os.environ.get("FLASH_ATTN_CUTE_MLA_SM90_QK") if backend == "sm90" else None
            row = dict(impl=f"flash_attn_cute {backend}" + (f" qk={mode}" if mode else "") + (" fp8" if fp8 else ""),
                       batch=batch, seqlen=seqlen, page=page, heads=heads,
                       fi_fa3=peer_tbps.get("fa3"), fi_fa2=peer_tbps.get("fa2"),
                       fi_correct="/".join(f"{p} {peer_ok[p]}" for p in PEERS if p in peer_ok))
            try:
                ms, tbps, tflops, correct, note = one_row(fa, backend, inputs, page, heads, refs, fp8)
                row.update(time_us=ms * 1e3, tbps=tbps, tflops=tflops, correct=correct, note=note)
                if fp8:  # FP8 TB/s count the cache at a byte a value: no ratio to 16-bit peers
                    if rows and rows[-1].get("time_us"):  # the 16-bit row just before, same shape
                        row["vs_16bit"] = rows[-1]["time_us"] / row["time_us"]
                else:
                    for p in PEERS:
                        if row[f"fi_{p}"]:
                            row[f"x_{p}"] = tbps / row[f"fi_{p}"]
                    row["target"] = targets_met(backend, row)
            except Exception as e:  # keep the table going; the row says why
                row.update(note=error_text(e))
            rows.append(row)
            print_table([row], COLUMNS)
        del inputs
        torch.cuda.empty_cache()
    print()
    print_table(rows, COLUMNS)
    write_csv(args.csv, COLUMNS, rows)
    if not args.no_md and rows:
        append_results_md(
            f"MLA decode ({args.dtype}, 1 query, num_splits=0)", rows, COLUMNS,
            notes="TB/s = (ckv + kpe read once + q + out) / median time of a CUDA-graph replay; TFLOP/s: Q K^T and "
                  "P V. fi_fa3 / fi_fa2: FlashInfer 0.7.2 BatchMLAPagedAttentionWrapper on the same tensors, same "
                  "process, same timing; x_*: our TB/s over theirs; correct / fi_correct: ours / FlashInfer's output "
                  "against the same fp32 reference (rows up to REF_LIMIT). Targets (issue 17): SM90 >= 1.1x fa3, >= 3.9 "
                  "TB/s at 768 x 2048, >= 560 TFLOP/s with 128 heads, >= 2.0 TB/s at 1 x 32768; SM80 >= 1.1x fa2.")


if __name__ == "__main__":
    main()
