"""What the serving features cost over the plain call, per backend, in one run.

Each row times a feature on and off on the same inputs (CUDA-graph replays, median) and
reports the ratio (issue 15's targets in brackets):

- ``sink``: ``learnable_sink`` on a prefill (b4 s8192 h16 d128, causal) and on a paged
  decode (b64 x 4096, 32 query / 8 KV heads, page 64) [<= 1.02];
- ``append_rotary``: ``flash_attn_with_kvcache`` appending one token per sequence with
  rotary (NeoX, rotary_dim 128) against the plain decode call, paged b64 x 4096 [<= 1.05];
- ``batch_invariant``: the decode benchmark rows (b1 x 131072 with 32 and 8 KV heads, the
  paged b64 x 4096) with ``batch_invariant=True`` against the default plan [<= 1.10].

    python benchmarks/bench_serving_costs.py [--backends sm90] [--csv out.csv] [--no-md]
"""

import argparse
import sys

import common
from common import bench, error_text, our_backends, print_exception, randn, report

COLUMNS = ["impl", "feature", "shape", "off_us", "on_us", "ratio", "target", "note"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="all")
    p.add_argument("--no-md", action="store_true")
    p.add_argument("--csv", default=None)
    return p.parse_args(argv)


def _paged_decode(batch=64, keys=4096, heads=32, heads_kv=8, d=128, page=64):
    import torch

    q = randn(batch, 1, heads, d, dtype=torch.bfloat16)
    pages = batch * keys // page
    k, v = (randn(pages + batch, page, heads_kv, d, dtype=torch.bfloat16) for _ in range(2))
    table = torch.randperm(pages, device=common.DEVICE).view(batch, -1).to(torch.int32)
    return q, k, v, table


def cases(fa, backend):
    """(feature, shape, target, fn_off, fn_on) for one backend."""
    import torch

    torch.manual_seed(0)
    out = []
    q, k, v = (randn(4, 8192, 16, 128, dtype=torch.bfloat16) for _ in range(3))
    sink16 = torch.randn(16, device=common.DEVICE)
    out.append(("sink", "prefill b4 s8192 h16 d128 causal", 1.02,
                lambda: fa.flash_attn_func(q, k, v, causal=True, backend=backend),
                lambda: fa.flash_attn_func(q, k, v, causal=True, learnable_sink=sink16, backend=backend)))
    qd, kc, vc, table = _paged_decode()
    lens = torch.full((64,), 4096, dtype=torch.int32, device=common.DEVICE)
    sink32 = torch.randn(32, device=common.DEVICE)
    out.append(("sink", "decode b64 x 4096 h32/8 page 64", 1.02,
                lambda: fa.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens, page_table=table, backend=backend),
                lambda: fa.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens, page_table=table,
                                                   learnable_sink=sink32, backend=backend)))
    k_new, v_new = (randn(64, 1, 8, 128, dtype=torch.bfloat16) for _ in range(2))
    cos, sin = (randn(table.shape[1] * 64, 64, dtype=torch.bfloat16) for _ in range(2))
    before = lens - 1  # the appended token is the 4096th key: the same attention as the plain call
    out.append(("append_rotary", "decode b64 x 4096 h32/8 page 64, 1 new token", 1.05,
                lambda: fa.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens, page_table=table, causal=True,
                                                   backend=backend),
                lambda: fa.flash_attn_with_kvcache(qd, kc, vc, k_new, v_new, cos, sin, cache_seqlens=before,
                                                   page_table=table, causal=True, rotary_interleaved=False,
                                                   backend=backend)))
    for heads_kv in (32, 8):
        q1 = randn(1, 1, 32, 128, dtype=torch.bfloat16)
        k1, v1 = (randn(1, 131072, heads_kv, 128, dtype=torch.bfloat16) for _ in range(2))
        lens1 = torch.full((1,), 131072, dtype=torch.int32, device=common.DEVICE)
        out.append(("batch_invariant", f"decode b1 x 131072 h32/{heads_kv}", 1.10,
                    lambda q1=q1, k1=k1, v1=v1, lens1=lens1: fa.flash_attn_with_kvcache(
                        q1, k1, v1, cache_seqlens=lens1, backend=backend),
                    lambda q1=q1, k1=k1, v1=v1, lens1=lens1: fa.flash_attn_with_kvcache(
                        q1, k1, v1, cache_seqlens=lens1, batch_invariant=True, backend=backend)))
    out.append(("batch_invariant", "decode b64 x 4096 h32/8 page 64", 1.10,
                lambda: fa.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens, page_table=table, backend=backend),
                lambda: fa.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens, page_table=table,
                                                   batch_invariant=True, backend=backend)))
    return out


def main(argv=None):
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_serving_costs.py needs a CUDA GPU")
    import flash_attn_cute as fa

    rows = []
    for backend in our_backends(args.backends):
        for feature, shape, target, off, on in cases(fa, backend):
            row = dict(impl=f"ours_{backend}", feature=feature, shape=shape, target=f"<= {target:.2f}",
                       off_us=float("nan"), on_us=float("nan"), ratio=float("nan"), note="")
            try:
                row["off_us"] = bench(off, graph=True) * 1e3
                row["on_us"] = bench(on, graph=True) * 1e3
                row["ratio"] = row["on_us"] / row["off_us"]
            except Exception as e:
                print_exception(f"{backend} {feature} {shape}", e)
                row["note"] = error_text(e)
            rows.append(row)
            print(f"{backend} {feature:16s} {shape:45s} {row['off_us']:9.1f} {row['on_us']:9.1f} us "
                  f"ratio {row['ratio']:.3f}", flush=True)
    report(args, "serving features: cost over the plain call (CUDA-graph replays, us)", "Serving feature costs", rows,
           COLUMNS, notes="ratio = on / off on the same inputs; targets from issue 15.")
    return rows


if __name__ == "__main__":
    main()
