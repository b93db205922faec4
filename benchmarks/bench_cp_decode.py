"""Context-parallel decode on one GPU: per-layer cost of a rank's shard attention + merge
against one-GPU attention over the whole cache, for 1 to 8 ranks.

    python benchmarks/bench_cp_decode.py [--B 8] [--K 131072] [--H 32] [--hkv 8] [--csv out.csv]

Each row is one group size W: ``shard`` is rank 0's ``flash_attn_with_kvcache(...,
cp_world_size=W, cp_rank=0, cp_tot_seqused_k=...)`` over its 1/W of the cache (causal,
the CP variant); ``merge`` is one rank's share of the merge's local work (the rescale of
ag_rs, or a2a's combine kernel over W partials: ``distributed.merge_local`` of all W
ranks, divided by W); ``bytes`` is what one rank sends in the merge's collectives (the
all-gathered LSEs and the reduce-scattered fp32 outputs for ag_rs; the all-to-all of
outputs and LSEs for a2a) and ``comm_us`` their time at ``--link-gbs`` (a model: the
collectives need W GPUs, issue 35). ``one_gpu`` is the whole cache on one GPU; ``speedup``
= one_gpu / (shard + merge + comm_us). CUDA-graph replays, triton do_bench medians; the
peers (FA3, FA4) have no context-parallel entry point to time on one GPU.
"""

import argparse

from common import bench, print_exception, report

COLUMNS = ["W", "op", "B", "K", "H", "Hkv", "D", "shard_us", "merge_us", "bytes", "comm_us", "total_us",
           "one_gpu_us", "speedup", "shard_bw_tbs"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--B", type=int, default=8)
    p.add_argument("--K", type=int, default=131072, help="global keys per sequence")
    p.add_argument("--H", type=int, default=32)
    p.add_argument("--hkv", type=int, default=8)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--worlds", default="1,2,4,8")
    p.add_argument("--link-gbs", type=float, default=400.0,
                   help="per-GPU collective bandwidth for the comm model, GB/s (H200 NVLink: 450 GB/s each way)")
    p.add_argument("--csv", default=None)
    p.add_argument("--no-md", action="store_true")
    return p.parse_args(argv)


def main(argv=None):
    import torch

    from flash_attn_cute import flash_attn_with_kvcache
    from flash_attn_cute.distributed import OPS, merge_local

    args = parse_args(argv)
    b, k, h, hkv, d = args.B, args.K, args.H, args.hkv, args.D
    dt = torch.bfloat16
    q = torch.randn(b, 1, h, d, device="cuda", dtype=dt)
    kc = torch.randn(b, k, hkv, d, device="cuda", dtype=dt)
    vc = torch.randn_like(kc)
    tot = torch.full((b,), k, dtype=torch.int32, device="cuda")
    one = bench(lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=tot, causal=True), graph=True) * 1e3
    rows = []
    for world in (int(w) for w in args.worlds.split(",")):
        n = -(-k // world)
        ks, vs = kc[:, :n], vc[:, :n]  # rank 0's shard (its values do not change the time)
        lens = torch.full((b,), n, dtype=torch.int32, device="cuda")
        cp = dict(cp_world_size=world, cp_rank=0, cp_tot_seqused_k=tot) if world > 1 else {}
        try:
            shard = bench(lambda: flash_attn_with_kvcache(q, ks, vs, cache_seqlens=lens, causal=True, return_lse=True,
                                                          **cp), graph=True) * 1e3
        except Exception as e:  # noqa: BLE001 (a row, not the run)
            print_exception(f"W={world}", e)
            continue
        out, lse = flash_attn_with_kvcache(q, ks, vs, cache_seqlens=lens, causal=True, return_lse=True, **cp)
        outs = [out.view(b, h, d)] * world
        lses = [lse.view(b, h)] * world
        for op in OPS:
            merge = (bench(lambda: merge_local(outs, lses, op=op), graph=True) * 1e3 / world) if world > 1 else 0.0
            tokens_heads = b * h
            if op == "ag_rs":  # LSE all-gather in, fp32 outputs reduce-scattered out
                sent = tokens_heads * 4 * (world - 1) + tokens_heads * d * 4 * (world - 1) / world
            else:  # all-to-all of the bf16 outputs and fp32 LSEs
                sent = tokens_heads * (d * 2 + 4) * (world - 1) / world
            comm = sent / (args.link_gbs * 1e9) * 1e6
            total = shard + merge + comm
            rows.append(dict(W=world, op=op, B=b, K=k, H=h, Hkv=hkv, D=d, shard_us=shard, merge_us=merge,
                             bytes=int(sent), comm_us=comm, total_us=total, one_gpu_us=one, speedup=one / total,
                             shard_bw_tbs=2 * b * n * hkv * d * 2 / (shard * 1e-6) / 1e12))
            if world == 1:
                break
    notes = (f"`python benchmarks/bench_cp_decode.py --B {b} --K {k} --H {h} --hkv {hkv}`; one GPU (rank 0's shard "
             "timed; the collectives modelled at --link-gbs, measured in issue 35's two-GPU run). Limits: the shard "
             "is a 1/W-size decode, bandwidth bound like the whole; the merge adds a few us per layer.")
    report(args, "context-parallel decode (one GPU)", "Context-parallel decode, one GPU", rows, COLUMNS, notes)


if __name__ == "__main__":
    main()
