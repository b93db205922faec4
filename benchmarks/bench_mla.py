"""MLA decode bandwidth (``flash_mla_decode``) beside FlashMLA (DeepSeek's SM90 dense decode)
and FlashInfer 0.7.2's MLA kernels, timed in the same process.

Rows are issue 32's table: batch x cached length, page size, heads (one latent KV head),
one query, bf16, gaussian inputs (never zeros), random page tables, ``num_splits=0``;
pages of 64 (FlashMLA's, and vLLM's and SGLang's FlashMLA backends'), then three rows at
pages of 1 and 16 (the gathering SM90 kernel; FlashMLA takes pages of 64 only).
TB/s = (ckv + kpe bytes read once + q + out bytes) / median time of a CUDA-graph replay
of the call (triton do_bench, L2 flushed): device time, as a decode loop under CUDA
graphs runs it (eager timing let host time leak into the small rows: 128 x 1024 measured
1.45 and 2.63 TB/s in two runs of the same code, 2026-11-29). TFLOP/s counts Q K^T (576)
and P V (512) per head and key.

FlashMLA (``sgl_kernel.flash_mla``, the sglang-kernel build of FlashMLA's SM90 dense
decode: q (b, 1, h, 576) and one (pages, 64, 1, 576) cache, the same values as ours
concatenated; its metadata computed once per row, outside the timing, as a serving step
computes it once for every layer) and FlashInfer (``flashinfer.mla.BatchMLAPagedAttentionWrapper``,
backends "fa3" and "fa2") run each row on the same values, planned once, timed the same
way; where they do not import, their columns stay empty (on the GPU machine:
``../shared/gpu/README.md``). FP8 rows (``--fp8``): FlashMLA's FP8 mode (e4m3 q and cache,
per-tensor descales) beside our FP8 cache with 16-bit q (quantized in the kernel) and with
the same e4m3 q (``q_descale``, the "fp8 q" rows).

    python benchmarks/bench_mla.py [--backends sm80] [--dtype bf16] [--rows 0,5] [--fp8]
                                   [--heads 8,16] [--peers flashmla,fa3,fa2 | --no-peers] [--csv out.csv] [--no-md]

``--heads`` runs each picked row at these head counts instead of its own: a count the
kernels pad (8, 24, 100: the last 64-row tile partly empty) beside the next multiple of
16 it costs the same as (the same tiles, bytes and splits; ``mla_kernel`` docstring).

``--fp8`` adds, after each 16-bit row, the same row over an FP8 (e4m3) latent cache (one
``kv_descale`` for ckv and kpe), then (SM90) that row with e4m3 queries, timed in the same
run: their TB/s count the cache at one byte a value, and ``vs_16bit`` is our 16-bit time
over the fp8 time (tokens per second; issue 32's target is >= 1.3 on rows of 64+ heads).
"""

import argparse
import os
import sys

import common
from common import append_results_md, bench, check_correct, error_text, print_table, randn, write_csv

# (batch, seqlen, page_size, nheads)
ROWS = [
    (64, 1024, 64, 64),
    (128, 1024, 64, 64),
    (768, 1024, 64, 64),
    (64, 2048, 64, 64),
    (128, 2048, 64, 64),
    (768, 2048, 64, 64),
    (128, 2048, 64, 128),
    (32, 8192, 64, 128),
    (128, 4096, 64, 128),
    (256, 4096, 64, 16),
    (1, 32768, 64, 64),
    (128, 2048, 1, 64),
    (768, 2048, 1, 64),
    (128, 2048, 16, 64),
]
PEERS = ("fa3", "fa2")  # FlashInfer backends
ALL_PEERS = ("flashmla",) + PEERS
COLUMNS = ["impl", "batch", "seqlen", "page", "heads", "time_us", "tbps", "tflops", "flashmla", "fi_fa3", "fi_fa2",
           "x_flashmla", "x_fa3", "x_fa2", "target", "vs_16bit", "correct", "fi_correct", "note"]
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
    p.add_argument("--peers", default=",".join(ALL_PEERS), help="peers to run (comma list): flashmla, fa3, fa2")
    p.add_argument("--no-peers", action="store_true", help="run no peer")
    p.add_argument("--schedule", action="store_true",
                   help="also our SM90 rows over a device schedule (get_mla_metadata, once a row, untimed)")
    p.add_argument("--skewed", action="store_true",
                   help="lengths drawn uniformly from [1, 2 x seqlen) per sequence instead of seqlen each")
    p.add_argument("--no-md", action="store_true")
    p.add_argument("--csv", default=None)
    return p.parse_args(argv)


def make_inputs(batch, seqlen, page, heads, dtype, skewed=False):
    """A row's tensors; ``skewed``: lengths uniform in [1, 2 seqlen) (seeded), the table
    sized for the longest."""
    import torch

    torch.manual_seed(0)
    lengths = torch.randint(1, 2 * seqlen, (batch,), dtype=torch.int32) if skewed else None
    pages_per_seq = -(-(2 * seqlen if skewed else seqlen) // page)
    q_nope, q_pe = randn(batch, 1, heads, 512, dtype=dtype), randn(batch, 1, heads, 64, dtype=dtype)
    ckv = randn(batch * pages_per_seq, page, 512, dtype=dtype)
    kpe = randn(batch * pages_per_seq, page, 64, dtype=dtype)
    table = torch.randperm(batch * pages_per_seq, device=common.DEVICE).view(batch, -1).to(torch.int32)
    seqlens = torch.full((batch,), seqlen, dtype=torch.int32, device=common.DEVICE) if lengths is None else \
        lengths.to(common.DEVICE)
    return q_nope, q_pe, ckv, kpe, seqlens, table


def row_bytes_flops(batch, seqlen, heads, cache_elem=2, keys=None):
    """(bytes, flops) of a row; ``keys``: the batch's total cached length (default batch x seqlen)."""
    keys = batch * seqlen if keys is None else keys
    nbytes = keys * (512 + 64) * cache_elem + batch * heads * (512 + 64 + 512) * 2
    return nbytes, 2 * heads * keys * (576 + 512)


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


def flashmla_call(inputs, heads, kv_descale=None):
    """FlashMLA's dense decode on the row's values (``sgl_kernel.flash_mla``): q and the
    cache concatenated into its 576-wide layout, its tile-scheduler metadata computed once.
    ``kv_descale``: its FP8 mode, e4m3 q (quantized per tensor here) and cache, both
    descales (1,). Raises where it does not import or take the row (pages of 64 only)."""
    import torch
    from sgl_kernel import flash_mla as fm

    from flash_attn_cute import quantize_fp8

    q_nope, q_pe, ckv, kpe, seqlens, table = inputs
    q = torch.cat([q_nope, q_pe], -1).contiguous()
    kv = torch.cat([ckv.view(torch.uint8) if kv_descale is not None else ckv,
                    kpe.view(torch.uint8) if kv_descale is not None else kpe], -1).unsqueeze(2).contiguous()
    kw = {}
    if kv_descale is not None:
        q, q_descale = quantize_fp8(q, granularity="tensor")
        kv = kv.view(torch.float8_e4m3fn)
        kw = dict(descale_q=q_descale.reshape(1).float(), descale_k=kv_descale.reshape(-1)[:1].float(),
                  is_fp8_kvcache=True)
    meta, splits = fm.get_mla_metadata(seqlens, q.shape[1] * heads, 1, is_fp8_kvcache=kv_descale is not None)
    return lambda: fm.flash_mla_with_kvcache(q, kv, table, seqlens, 512, meta, splits, softmax_scale=576 ** -0.5,
                                             causal=False, **kw)[0]


def flashmla_time(inputs, page, heads, refs=None, kv_descale=None):
    """(ms, correct) of ``flashmla_call`` as a CUDA-graph replay; (None, None) where it does
    not run (its error printed)."""
    if page != 64:
        return None, None
    try:
        fn = flashmla_call(inputs, heads, kv_descale)
        ms = bench(fn, graph=True)
    except Exception as e:
        print(f"[flashmla] {error_text(e)}", file=sys.stderr)
        return None, None
    correct = None
    if refs is not None:
        try:
            correct = check_correct(fn().reshape(refs[0].shape), *refs)
        except Exception as e:
            print(f"[flashmla check] {error_text(e)}", file=sys.stderr)
            correct = False
    return ms, correct


def references(inputs, fp8_wgmma=False, quantize_q=False, **kw):
    """(fp32 reference, PyTorch's own low-precision result, the multiple of its error a
    result may have) of a row (``kw``: an FP8 cache's ``kv_descale``), or None past
    ``REF_LIMIT``: computed once a row, for every implementation checked against it.
    ``fp8_wgmma``: the row runs both products in fp8 (our SM90 TMA kernel over an e4m3
    cache): the reference on the queries as quantized (``quantize_q``: by the kernel), and
    PyTorch's FP8 algorithm there (P rounded to e4m3), 3x (as ``tests/test_mla_gpu.py``)."""
    q_nope, _, _, _, seqlens, table = inputs
    if q_nope.shape[0] * int(seqlens.max()) * q_nope.shape[2] > REF_LIMIT:
        return None
    import torch

    from flash_attn_cute.testing import mla_decode_ref

    try:
        if fp8_wgmma:
            return (mla_decode_ref(*inputs, quantize_q=quantize_q, **kw)[0],
                    mla_decode_ref(*inputs, quantize_q=quantize_q, p_fp8=True, **kw)[0], 3.0)
        return mla_decode_ref(*inputs, **kw)[0], mla_decode_ref(*inputs, upcast=False, **kw)[0], 2.0
    except torch.cuda.OutOfMemoryError:  # the limit is the H200's: on an 80 GB card 256 x 4096 x 16 is not
        torch.cuda.empty_cache()
        print("[reference] out of memory: row not checked", file=sys.stderr)
        return None


def fp8_peer_inputs(fa, inputs):
    """(the row quantized as ``one_row`` quantizes it for us, its kv_descale): FlashMLA's
    FP8 row reads the same cache bytes."""
    import torch

    q_nope, q_pe, ckv, kpe, seqlens, table = inputs
    both, descale = fa.quantize_fp8(torch.cat([ckv, kpe], -1).unsqueeze(2), granularity="tensor")
    return (q_nope, q_pe, both[..., 0, :512].contiguous(), both[..., 0, 512:].contiguous(), seqlens, table), descale


def one_row(fa, backend, inputs, page, heads, refs, fp8=False, schedule=False):
    """``refs``: the 16-bit row's ``references`` (an FP8 row computes its own);
    ``schedule``: over ``get_mla_metadata``'s schedule, made once before the timing."""
    import torch

    from flash_attn_cute import seam
    from flash_attn_cute.host import tuning
    from flash_attn_cute.host.problems import MlaProblem

    q_nope, q_pe, ckv, kpe, seqlens, table = inputs
    batch, pages_per_seq = table.shape
    seqlen = int(seqlens[0])
    kw, cache_elem = {}, 2
    if schedule:
        kw["scheduler_metadata"] = fa.get_mla_metadata(seqlens, heads)
    if fp8:  # one scale for a token's 576 values
        both, kw["kv_descale"] = fa.quantize_fp8(torch.cat([ckv, kpe], -1).unsqueeze(2), granularity="tensor")
        ckv, kpe, cache_elem = both[..., 0, :512].contiguous(), both[..., 0, 512:].contiguous(), 1
        del both
    if fp8 == "q":  # FP8 queries too, quantized per tensor as FlashMLA's FP8 row quantizes them
        q8, kw["q_descale"] = fa.quantize_fp8(torch.cat([q_nope, q_pe], -1), granularity="tensor")
        q_nope, q_pe = q8[..., :512], q8[..., 512:]
    args = (q_nope, q_pe, ckv, kpe, seqlens, table)
    fn = lambda: fa.flash_mla_decode(*args, backend=backend, **kw)
    ms = bench(fn, graph=True)
    nbytes, flops = row_bytes_flops(batch, seqlen, heads, cache_elem, int(seqlens.sum()))
    wgmma8 = backend == "sm90" and page % 64 == 0  # fp8 wgmma (``sm90.mla.uses_tma``)
    if fp8 == "q":  # the reference on the dequantized queries
        q_deq = torch.cat([q_nope, q_pe], -1).float() * kw["q_descale"]
        refs = references((q_deq[..., :512], q_deq[..., 512:], *args[2:]), fp8_wgmma=wgmma8,
                          kv_descale=kw["kv_descale"])
    elif fp8:
        refs = references(args, fp8_wgmma=wgmma8, quantize_q=wgmma8, **kw)
    correct = "" if refs is None else check_correct(fn(), *refs)
    problem = MlaProblem(dtype=q_nope.dtype, batch=batch, max_seqlen_q=1, max_seqlen_k=pages_per_seq * page,
                         nheads=heads, page_size=page, softmax_scale=576 ** -0.5, causal=False, has_lse=False,
                         kv_dtype=ckv.dtype if fp8 else None)
    if schedule:
        from flash_attn_cute.host.mla_schedule import parts_of

        problem = problem._replace(schedule_parts=parts_of(kw["scheduler_metadata"].numel(), batch))
    plan = seam.resolve(problem, backend, 0, None, q_nope.device, tuning.from_env()).plan
    return ms, nbytes / (ms * 1e-3) / 1e12, flops / (ms * 1e-3) / 1e12, correct, f"splits={plan.num_splits}"


def targets_met(backend, row) -> str:
    """Issue 32: SM90 >= 1.0x FlashMLA on every row it runs (pages of 64), FP8 cache >= 1.3x
    our 16-bit row (64+ heads) and >= 1.0x FlashMLA's FP8; SM80 >= 1.1x FlashInfer fa2."""
    missed = []
    if backend == "sm80":
        if row.get("x_fa2") is None:
            missed.append("no fa2")  # not measured: the ratio target is not judged
        elif row["x_fa2"] < 1.1:
            missed.append("<1.1x fa2")
        return "; ".join(missed) or "met"
    if row.get("x_flashmla") is not None and row["x_flashmla"] < 1.0:
        missed.append("<1.0x flashmla")
    if row.get("vs_16bit") is not None and row["heads"] >= 64 and row["vs_16bit"] < 1.3:
        missed.append("<1.3x 16-bit")
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
    peers = [] if args.no_peers else args.peers.split(",")
    for batch, seqlen, page, heads in picked:
        inputs = make_inputs(batch, seqlen, page, heads, dtype, args.skewed)
        keys = int(inputs[4].sum())
        nbytes, _ = row_bytes_flops(batch, seqlen, heads, keys=keys)
        refs = references(inputs)
        fi_peers = [p for p in peers if p in PEERS]
        peer_ms, peer_ok = flashinfer_times(inputs, page, heads, fi_peers, refs) if fi_peers else ({}, {})
        peer_tbps = {p: nbytes / (ms * 1e-3) / 1e12 for p, ms in peer_ms.items()}
        mla_ms = {False: flashmla_time(inputs, page, heads, refs) if "flashmla" in peers else (None, None)}
        base_us = {}  # the backend's 16-bit rows (by schedule), for the FP8 rows' vs_16bit
        combos = [(b, f, s) for b in backends for f in (False, True, "q")[:1 + 2 * args.fp8]
                  for s in (False, True)[:1 + (args.schedule and b == "sm90" and page % 64 == 0)]]
        for backend, fp8, sched in combos:
            mode = os.environ.get("FLASH_ATTN_CUTE_MLA_SM90_QK") if backend == "sm90" else None
            if fp8 == "q" and backend != "sm90":
                continue  # FP8 queries: the SM90 TMA kernel alone
            row = dict(impl=f"flash_attn_cute {backend}" + (f" qk={mode}" if mode else "")
                       + {False: "", True: " fp8", "q": " fp8 q"}[fp8] + (" sched" if sched else ""),
                       batch=batch, seqlen=seqlen, page=page, heads=heads,
                       fi_fa3=peer_tbps.get("fa3"), fi_fa2=peer_tbps.get("fa2"),
                       fi_correct="/".join(f"{p} {peer_ok[p]}" for p in PEERS if p in peer_ok))
            try:
                ms, tbps, tflops, correct, note = one_row(fa, backend, inputs, page, heads, refs, fp8, sched)
                row.update(time_us=ms * 1e3, tbps=tbps, tflops=tflops, correct=correct, note=note)
                if fp8 and "flashmla" in peers and True not in mla_ms:
                    fp8_inputs, descale = fp8_peer_inputs(fa, inputs)
                    mla_ms[True] = flashmla_time(fp8_inputs, page, heads, kv_descale=descale)
                peer_time, peer_correct = mla_ms.get(bool(fp8), (None, None))
                if peer_time:
                    peer_bytes = row_bytes_flops(batch, seqlen, heads, 1 if fp8 else 2, keys)[0]
                    row["flashmla"] = peer_bytes / (peer_time * 1e-3) / 1e12
                    row["x_flashmla"] = peer_time / ms
                    if peer_correct is not None:
                        row["fi_correct"] = "/".join(x for x in (row["fi_correct"], f"flashmla {peer_correct}") if x)
                if fp8:  # FP8 TB/s count the cache at a byte a value: no ratio to 16-bit peers
                    if base_us.get(sched):  # the 16-bit row before, same shape and schedule
                        row["vs_16bit"] = base_us[sched] / row["time_us"]
                else:
                    base_us[sched] = row["time_us"]
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
                  "P V. flashmla: FlashMLA's SM90 dense decode (sglang-kernel 0.4.4; FP8 rows: its FP8 mode), "
                  "fi_fa3 / fi_fa2: FlashInfer 0.7.2 BatchMLAPagedAttentionWrapper, on the same values, same process, "
                  "same timing; x_*: their time over ours; correct / fi_correct: ours / the peers' output against the "
                  "same fp32 reference (rows up to REF_LIMIT). Targets (issue 32): SM90 >= 1.0x FlashMLA, FP8 cache "
                  ">= 1.3x our 16-bit row (64+ heads) and >= 1.0x FlashMLA's FP8; SM80 >= 1.1x fa2.")


if __name__ == "__main__":
    main()
