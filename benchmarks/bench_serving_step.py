"""One mixed serving step as ONE varlen call over a paged cache, beside FA4 and beside a two-call split.

The step a serving engine runs every iteration under load: 96 decode rows (one query each,
cache lengths drawn from 512-32,768) and 4 chunked-prefill rows (1,024 queries each,
continuing contexts of 0-8,192 tokens), packed: decode rows first, then the prefill rows.
32 query heads, 8 KV heads, d128, bf16, causal (bottom-right); the KV pool holds every
sequence's pages in a random order; one row per page size (16, 64).

- ``ours_<backend>``: ``flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q=, max_seqlen_q=,
  seqused_k=, page_table=, causal=True, num_splits=0)``: the whole step, one call;
- ``ours_<backend>_split``: the same step as two calls into one output: the prefill rows
  through ``flash_attn_varlen_func``, the decode rows through ``flash_attn_with_kvcache``;
- ``fa4``: ``flash_attn.cute.flash_attn_varlen_func`` with the same arguments (its default
  num_splits), and ``fa4_auto`` with ``num_splits=0`` where that FA4 takes it.

``us``: median time of a CUDA-graph replay (device time, what a serving loop under graphs
sees); ``eager_us``: the plain call, host time included. ``ratio_vs_fa4`` = best FA4 time /
our time (graph replays; > 1: faster); ``single_vs_split`` = two-call time / one-call time
(>= 1: the single call is no slower). ``correctness``: 6 rows (the shortest and longest
decode, two random decodes, the shortest and longest prefill context) against
``testing.attention_serving_ref``, within 2x PyTorch's own bf16 error. ``--sinks`` adds the
same step with a learnable sink per head (gpt-oss).

    python benchmarks/bench_serving_step.py [--pages 16,64] [--sinks] [--csv out.csv] [--no-md]
"""

import argparse
import dataclasses
import sys

import common
from common import UNAVAILABLE, bench, check_correct, error_text, load_fa4, our_backends, print_exception, report

COLUMNS = ["impl", "page_size", "sinks", "us", "eager_us", "ratio_vs_fa4", "single_vs_split", "correctness", "note"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--decode", type=int, default=96, help="decode rows (one query each)")
    p.add_argument("--decode-lens", default="512,32768", help="range of the decode rows' cache lengths")
    p.add_argument("--prefill", type=int, default=4, help="chunked-prefill rows")
    p.add_argument("--chunk", type=int, default=1024, help="queries per prefill row")
    p.add_argument("--context", default="0,8192", help="range of the prefill rows' earlier context")
    p.add_argument("--H", type=int, default=32)
    p.add_argument("--hkv", type=int, default=8)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--pages", default="16,64", help="page sizes, one row each")
    p.add_argument("--sinks", action="store_true", help="also the step with a learnable sink per head")
    p.add_argument("--backends", default="all")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-md", action="store_true")
    p.add_argument("--csv", default=None)
    return p.parse_args(argv)


@dataclasses.dataclass
class Step:
    """A packed mixed step over a paged pool. Sequence b has ``seqused_k[b]`` keys, in the
    pages ``page_table[b, :ceil(seqused_k[b] / page_size)]`` (the rest of its row is 0),
    and its queries are the last ``cu_seqlens_q[b+1] - cu_seqlens_q[b]`` positions."""

    q: object              # (total_q, H, D)
    k_cache: object        # (num_pages, page_size, hkv, D)
    v_cache: object
    cu_seqlens_q: object   # (batch + 1,) int32
    seqused_k: object      # (batch,) int32
    page_table: object     # (batch, max_pages) int32
    max_seqlen_q: int
    n_decode: int          # rows [0, n_decode) have one query; the rest are prefill chunks
    seed: int


def _range(text):
    lo, hi = (int(x) for x in text.split(","))
    return lo, hi


def sequence_kv(step: Step, b: int):
    """Sequence b's keys and values, dense ``(seqused_k[b], hkv, D)``: drawn from its own seed,
    so they can be drawn again to check the pages (``tests/test_serve_example.py``)."""
    import torch

    *_, hkv, d = step.k_cache.shape
    n = int(step.seqused_k[b])
    g = torch.Generator(device=step.k_cache.device).manual_seed(step.seed * 100_003 + b)
    k, v = (torch.randn(n, hkv, d, generator=g, device=step.k_cache.device, dtype=step.k_cache.dtype)
            for _ in range(2))
    return k, v


def build_step(page_size, n_decode=96, decode_lens=(512, 32768), n_prefill=4, chunk=1024, context=(0, 8192),
               H=32, hkv=8, D=128, dtype=None, device="cuda", seed=0) -> Step:
    """The step: lengths drawn from ``seed``, pages handed out in a random order from a pool
    with 5% more pages than the sequences hold (the spare ones random, never read)."""
    import torch

    dtype = dtype or torch.bfloat16
    g = torch.Generator().manual_seed(seed)
    decode = torch.randint(decode_lens[0], decode_lens[1] + 1, (n_decode,), generator=g)
    prefill = torch.randint(context[0], context[1] + 1, (n_prefill,), generator=g) + chunk
    seqused = torch.cat([decode, prefill]).int()
    lens_q = torch.tensor([1] * n_decode + [chunk] * n_prefill)
    pages_per_seq = (seqused + page_size - 1) // page_size
    num_pages = int(pages_per_seq.sum()) * 21 // 20 + 1
    order = torch.randperm(num_pages, generator=g)
    table = torch.zeros(len(seqused), int(pages_per_seq.max()), dtype=torch.int32)
    start = 0
    for b, n in enumerate(pages_per_seq.tolist()):
        table[b, :n] = order[start:start + n].int()
        start += n
    gd = torch.Generator(device=device).manual_seed(seed)  # the big tensors are drawn where they live

    def randn(*shape):
        return torch.randn(*shape, generator=gd, device=device, dtype=dtype)

    k_cache, v_cache = randn(num_pages, page_size, hkv, D), randn(num_pages, page_size, hkv, D)
    step = Step(randn(int(lens_q.sum()), H, D), k_cache, v_cache,
                torch.cat([torch.zeros(1), lens_q.cumsum(0)]).to(device, torch.int32), seqused.to(device),
                table.to(device), int(lens_q.max()), n_decode, seed)
    for b in range(len(seqused)):  # one sequence at a time: never the whole step dense in memory
        k, v = sequence_kv(step, b)
        rows = torch.arange(k.shape[0], device=device)
        pages = step.page_table[b].long()[rows // page_size]
        k_cache[pages, rows % page_size] = k
        v_cache[pages, rows % page_size] = v
    return step


def check_rows(step: Step) -> list:
    """The rows ``check_subset`` compares: shortest and longest decode, two random decodes,
    shortest and longest prefill context."""
    import torch

    lens = step.seqused_k.cpu()
    dec, pre = lens[:step.n_decode], lens[step.n_decode:]
    g = torch.Generator().manual_seed(step.seed + 1)
    rows = [int(dec.argmin()), int(dec.argmax()), *torch.randint(0, step.n_decode, (2,), generator=g).tolist()]
    if pre.numel():
        rows += [step.n_decode + int(pre.argmin()), step.n_decode + int(pre.argmax())]
    return sorted(set(rows))


def check_subset(step: Step, out, rows=None, learnable_sink=None) -> bool:
    """``out`` (the step's packed output) on ``rows`` against ``attention_serving_ref`` of
    those sequences alone (``common.check_correct``: 2x PyTorch's own error)."""
    import torch

    from flash_attn_cute.testing import attention_serving_ref

    rows = check_rows(step) if rows is None else rows
    cu = step.cu_seqlens_q.cpu().tolist()
    spans = [torch.arange(cu[b], cu[b + 1]) for b in rows]
    index = torch.cat(spans).to(step.q.device)
    cu_sub = torch.tensor([0, *torch.tensor([s.numel() for s in spans]).cumsum(0).tolist()], dtype=torch.int32,
                          device=step.q.device)
    sel = torch.tensor(rows, device=step.q.device)
    kwargs = dict(cu_seqlens_q=cu_sub, seqused_k=step.seqused_k[sel], page_table=step.page_table[sel], causal=True,
                  learnable_sink=learnable_sink)
    ref, _ = attention_serving_ref(step.q[index], step.k_cache, step.v_cache, **kwargs)
    pt, _ = attention_serving_ref(step.q[index], step.k_cache, step.v_cache, upcast=False, **kwargs)
    return check_correct(out[index], ref, pt)


def single_call(step: Step, backend, sink):
    import flash_attn_cute as fa

    return lambda: fa.flash_attn_varlen_func(
        step.q, step.k_cache, step.v_cache, cu_seqlens_q=step.cu_seqlens_q, max_seqlen_q=step.max_seqlen_q,
        seqused_k=step.seqused_k, page_table=step.page_table, causal=True, learnable_sink=sink, num_splits=0,
        backend=backend)


def two_calls(step: Step, backend, sink):
    """Prefill rows through ``flash_attn_varlen_func``, decode rows through
    ``flash_attn_with_kvcache``, both writing into one packed output."""
    import flash_attn_cute as fa

    nd = step.n_decode
    q_dec = step.q[:nd].unsqueeze(1)  # (nd, 1, H, D)
    q_pre = step.q[nd:]
    cu_pre = step.cu_seqlens_q[nd:] - nd
    out = step.q.new_empty(step.q.shape)

    def fn():
        fa.flash_attn_varlen_func(q_pre, step.k_cache, step.v_cache, cu_seqlens_q=cu_pre,
                                  max_seqlen_q=step.max_seqlen_q, seqused_k=step.seqused_k[nd:],
                                  page_table=step.page_table[nd:], causal=True, learnable_sink=sink, num_splits=0,
                                  backend=backend, out=out[nd:])
        fa.flash_attn_with_kvcache(q_dec, step.k_cache, step.v_cache, cache_seqlens=step.seqused_k[:nd],
                                   page_table=step.page_table[:nd], causal=True, learnable_sink=sink, num_splits=0,
                                   backend=backend, out=out[:nd].unsqueeze(1))
        return out

    return fn


def fa4_call(fa4, step: Step, sink, num_splits=None):
    import torch

    extra = {} if num_splits is None else {"num_splits": num_splits}
    if sink is not None:
        extra["learnable_sink"] = sink

    def fn():
        with torch.no_grad():
            r = fa4.flash_attn_varlen_func(step.q, step.k_cache, step.v_cache, cu_seqlens_q=step.cu_seqlens_q,
                                           max_seqlen_q=step.max_seqlen_q, seqused_k=step.seqused_k,
                                           page_table=step.page_table, causal=True, **extra)
        return r[0] if isinstance(r, tuple) else r

    return fn


def measure(impl, fn, step, page_size, sink) -> dict:
    """One row: correctness on the check rows, graph-replay and eager times (us)."""
    row = dict(impl=impl, page_size=page_size, sinks="yes" if sink is not None else "no", us=float("nan"),
               eager_us=float("nan"), ratio_vs_fa4=float("nan"), single_vs_split=float("nan"), correctness=False,
               note="")
    try:
        row["correctness"] = check_subset(step, fn(), learnable_sink=sink)
        row["eager_us"] = bench(fn) * 1e3
    except Exception as e:
        print_exception(f"{impl} page {page_size}", e)
        row["note"] = f"{UNAVAILABLE}: {error_text(e)}"
        return row
    try:
        row["us"] = bench(fn, graph=True) * 1e3
    except Exception as e:  # a call that cannot be captured still has its eager time
        print_exception(f"{impl} page {page_size} (graph)", e)
        row["note"] = f"no graph: {error_text(e)}"
    return row


def finish(group):
    """ratio_vs_fa4 from the best FA4 graph time; single_vs_split per backend."""
    fa4 = [r["us"] for r in group if r["impl"].startswith("fa4") and r["us"] == r["us"]]
    times = {r["impl"]: r["us"] for r in group}
    for r in group:
        if r["impl"].startswith("ours") and r["us"] == r["us"]:
            if fa4:
                r["ratio_vs_fa4"] = min(fa4) / r["us"]
            split = times.get(f"{r['impl']}_split", float("nan"))
            if not r["impl"].endswith("_split") and split == split:
                r["single_vs_split"] = split / r["us"]
    return group


def main(argv=None):
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_serving_step.py needs a CUDA GPU")
    backends = our_backends(args.backends)
    fa4, fa4_why = load_fa4()
    sink = torch.randn(args.H, generator=torch.Generator().manual_seed(7)).to(common.DEVICE, torch.bfloat16)
    rows = []
    for page_size in (int(x) for x in args.pages.split(",")):
        step = build_step(page_size, args.decode, _range(args.decode_lens), args.prefill, args.chunk,
                          _range(args.context), args.H, args.hkv, args.D, torch.bfloat16, common.DEVICE, args.seed)
        for s in [None] + ([sink] if args.sinks else []):  # bf16: the sink dtype FA4 takes
            group = []
            for b in backends:
                group.append(measure(f"ours_{b}", single_call(step, b, s), step, page_size, s))
                group.append(measure(f"ours_{b}_split", two_calls(step, b, s), step, page_size, s))
            if fa4 is None:
                group.append(dict(impl="fa4", page_size=page_size, note=f"{UNAVAILABLE}: {fa4_why}"))
            else:
                group.append(measure("fa4", fa4_call(fa4, step, s), step, page_size, s))
                group.append(measure("fa4_auto", fa4_call(fa4, step, s, num_splits=0), step, page_size, s))
            rows += finish(group)
        del step
        torch.cuda.empty_cache()
    lens = f"{args.decode} decode rows (K {args.decode_lens.replace(',', '-')}) + {args.prefill} x {args.chunk} " \
           f"prefill rows (context {args.context.replace(',', '-')})"
    report(args, f"mixed serving step: {lens}, H={args.H} hkv={args.hkv} D={args.D} bf16 causal (us: graph replay)",
           f"Serving step: {lens}, H={args.H} hkv={args.hkv} D={args.D} bf16", rows, COLUMNS,
           notes="us = median CUDA-graph replay, eager_us = plain call (host time included); ratio_vs_fa4 = best FA4 "
                 "time / ours; single_vs_split = two-call time / one-call time; correctness on 6 rows vs "
                 "testing.attention_serving_ref.")
    return rows


if __name__ == "__main__":
    main()
