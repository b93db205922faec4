"""Context-parallel decode: a KV cache sharded by token over the GPUs of a group.

    torchrun --nproc-per-node N examples/cp_decode.py [--seqlen 65536] [--interleave 1]

What each rank holds, as in a vLLM / SGLang decode-context-parallel engine:
- its query heads (``heads / N`` of them; a serving engine's tensor-parallel shard), for
  every sequence of the batch;
- its shard of every sequence's KV cache: every N-th block of ``interleave`` tokens (with
  interleave 1, global token ``t`` lives on rank ``t % N`` at local index ``t // N``), with
  all the KV heads its group's queries read;
- its shard's lengths (``cache_seqlens``) and the global ones (``cp_tot_seqused_k``).

One decode step is ``distributed.cp_decode``: all-gather the queries over heads, attend the
shard (``flash_attn_with_kvcache(..., cp_world_size=N, cp_rank=r, cp_tot_seqused_k=...)``,
causal masks on global positions), merge the ranks' partial outputs by their LSEs
(``cp_merge``) and keep this rank's heads. Every rank builds the same whole cache from one
seed here, so it can check its result against a one-GPU call over the whole cache.
N = 1 runs the same code (no collective is made).
"""

import argparse
import os

import torch
import torch.distributed as dist

from flash_attn_cute import flash_attn_with_kvcache
from flash_attn_cute.distributed import cp_decode, shard_positions


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seqlen", type=int, default=65536, help="global tokens per sequence (the last one shorter)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--heads-kv", type=int, default=8)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--seqlen-q", type=int, default=1, help="queries per sequence (> 1: speculative tokens)")
    p.add_argument("--interleave", type=int, default=1, help="tokens per round-robin block")
    p.add_argument("--op", default="ag_rs", choices=("ag_rs", "a2a"))
    args = p.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    world, rank = dist.get_world_size(), dist.get_rank()
    assert args.heads % world == 0, "the query heads must split evenly over the ranks"

    g = torch.Generator(device="cuda").manual_seed(0)  # the same whole cache on every rank
    b, s, h, hkv, d, sq = args.batch, args.seqlen, args.heads, args.heads_kv, args.headdim, args.seqlen_q
    tot = [s] * (b - 1) + [s // 3 + 1]
    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)

    # this rank's shard of the cache, its lengths and the global ones
    cap = -(-s // (world * args.interleave)) * args.interleave
    k_shard = torch.zeros(b, cap, hkv, d, device="cuda", dtype=torch.bfloat16)
    v_shard = torch.zeros_like(k_shard)
    lengths = []
    for i, n in enumerate(tot):
        pos = shard_positions(n, world, rank, args.interleave).cuda()
        k_shard[i, :pos.numel()], v_shard[i, :pos.numel()] = k[i, pos], v[i, pos]
        lengths.append(pos.numel())
    cache_seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    cp_tot_seqused_k = torch.tensor(tot, dtype=torch.int32, device="cuda")
    my_heads = slice(rank * h // world, (rank + 1) * h // world)

    out = cp_decode(q[:, :, my_heads], k_shard, v_shard, cache_seqlens=cache_seqlens,
                    cp_tot_seqused_k=cp_tot_seqused_k, causal=True, cp_kv_interleave=args.interleave, op=args.op)

    whole = flash_attn_with_kvcache(q, k, v, cache_seqlens=cp_tot_seqused_k, causal=True)[:, :, my_heads]
    err = (out.float() - whole.float()).abs().max().item()

    for _ in range(3):  # warm
        cp_decode(q[:, :, my_heads], k_shard, v_shard, cache_seqlens=cache_seqlens,
                  cp_tot_seqused_k=cp_tot_seqused_k, causal=True, cp_kv_interleave=args.interleave, op=args.op)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        cp_decode(q[:, :, my_heads], k_shard, v_shard, cache_seqlens=cache_seqlens,
                  cp_tot_seqused_k=cp_tot_seqused_k, causal=True, cp_kv_interleave=args.interleave, op=args.op)
    end.record()
    torch.cuda.synchronize()
    print(f"rank {rank}/{world}: out {tuple(out.shape)}, max |cp - one GPU| = {err:.3e}, "
          f"{start.elapsed_time(end) / 20 * 1e3:.1f} us per step (eager, {args.op})", flush=True)
    assert err < 2e-2, err
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
