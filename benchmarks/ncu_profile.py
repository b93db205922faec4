"""One attention call to profile under Nsight Compute (``ncu_profile.sh`` runs it).

The call runs ``--calls`` times (the first compiles and warms; ncu skips the first two
launches of the kernel it filters and profiles the third):

    prefill: --impl ours|ours-fp8|fa4|fa3-fp8 --D 128 [--causal]  (b4 s8192, H = 2048 / D; ours = SM90;
             ours-fp8 / fa3-fp8: q, k, v in e4m3 with per (batch, head) descales, ours or
             FA3's Hopper kernel on the same values, with .peers: ../shared/gpu/README.md)
    mla:     --impl sm80|sm90[-fp8]|fi-fa3|fi-fa2|flashmla --batch 768 --seqlen 2048 [--page 1] [--heads 64]
             (-fp8: an e4m3 latent cache, one kv_descale; fi-*: FlashInfer's MLA wrapper,
             flashmla[-fp8]: FlashMLA's dense decode (pages of 64; -fp8 its FP8 mode), on the same values as
             ``bench_mla.py``, where they import)
    decode:  --impl bf16|fp8 --batch 1 --seqlen 131072 (h32/8 d128, one query, contiguous
             cache, the SM90 kernel; fp8: an e4m3 cache with descales)
    variant: --impl ours --variant causal|document|alibi|sliding1024|softcap30 (bench_variants'
             definitions, B4 S8192 H16 D128; ours = SM90)
"""

import argparse
import sys

import common
from common import load_fa3, load_fa4, randn

HEADS_FOR_DIM = {64: 32, 128: 16, 256: 8}


def prefill_fn(args):
    import torch

    H = HEADS_FOR_DIM.get(args.D, 2048 // args.D)
    q, k, v = (randn(args.B, args.S, H, args.D, dtype=torch.bfloat16) for _ in range(3))
    if args.impl in ("ours", "ours-fp8"):
        import flash_attn_cute

        if args.impl == "ours-fp8":
            (q, qd), (k, kd), (v, vd) = (flash_attn_cute.quantize_fp8(x) for x in (q, k, v))
            return lambda: flash_attn_cute.flash_attn_func(q, k, v, causal=args.causal, q_descale=qd, k_descale=kd,
                                                           v_descale=vd, backend="sm90")
        return lambda: flash_attn_cute.flash_attn_func(q, k, v, causal=args.causal, backend="sm90")
    if args.impl == "fa3-fp8":
        import flash_attn_cute

        fa3, why = load_fa3()
        if fa3 is None:
            sys.exit(f"FA3 unavailable: {why}")
        (q, qd), (k, kd), (v, vd) = (flash_attn_cute.quantize_fp8(x) for x in (q, k, v))
        return lambda: fa3.flash_attn_func(q, k, v, causal=args.causal, q_descale=qd, k_descale=kd, v_descale=vd)
    fa4, why = load_fa4()
    if fa4 is None:
        sys.exit(f"FA4 unavailable: {why}")
    return lambda: fa4.flash_attn_func(q, k, v, causal=args.causal)


def mla_fn(args):
    import torch

    import flash_attn_cute

    if args.impl.startswith("fi-") or args.impl.startswith("flashmla"):
        import bench_mla

        inputs = bench_mla.make_inputs(args.batch, args.seqlen, args.page, args.heads, torch.bfloat16)
        if args.impl == "flashmla-fp8":
            fp8_inputs, descale = bench_mla.fp8_peer_inputs(flash_attn_cute, inputs)
            return bench_mla.flashmla_call(fp8_inputs, args.heads, kv_descale=descale)
        if args.impl == "flashmla":
            return bench_mla.flashmla_call(inputs, args.heads)
        return bench_mla.flashinfer_call(inputs, args.page, args.heads, args.impl[3:])
    pages = -(-args.seqlen // args.page)
    q_nope = randn(args.batch, 1, args.heads, 512, dtype=torch.bfloat16)
    q_pe = randn(args.batch, 1, args.heads, 64, dtype=torch.bfloat16)
    ckv = randn(args.batch * pages, args.page, 512, dtype=torch.bfloat16)
    kpe = randn(args.batch * pages, args.page, 64, dtype=torch.bfloat16)
    table = torch.randperm(args.batch * pages, device=common.DEVICE).view(args.batch, -1).to(torch.int32)
    seqlens = torch.full((args.batch,), args.seqlen, dtype=torch.int32, device=common.DEVICE)
    backend, _, fp8 = args.impl.partition("-")
    kw = {}
    if fp8:
        both, kw["kv_descale"] = flash_attn_cute.quantize_fp8(torch.cat([ckv, kpe], -1).unsqueeze(2),
                                                              granularity="tensor")
        ckv, kpe = both[..., 0, :512].contiguous(), both[..., 0, 512:].contiguous()
    return lambda: flash_attn_cute.flash_mla_decode(q_nope, q_pe, ckv, kpe, seqlens, table, backend=backend, **kw)


def decode_fn(args):
    import torch

    import flash_attn_cute

    q = randn(args.batch, 1, 32, 128, dtype=torch.bfloat16)
    k, v = (randn(args.batch, args.seqlen, 8, 128, dtype=torch.bfloat16) for _ in range(2))
    lens = torch.full((args.batch,), args.seqlen, dtype=torch.int32, device=common.DEVICE)
    scales = {}
    if args.impl == "fp8":
        (k, kd), (v, vd) = flash_attn_cute.quantize_fp8(k), flash_attn_cute.quantize_fp8(v)
        scales = dict(k_descale=kd, v_descale=vd)
    return lambda: flash_attn_cute.flash_attn_with_kvcache(q, k, v, lens, backend="sm90", **scales)


def variant_fn(args):
    import torch

    import bench_variants
    import flash_attn_cute

    B, H, S, D = args.B, 16, args.S, args.D
    q, k, v = (randn(B, S, H, D, dtype=torch.bfloat16) for _ in range(3))
    (_, kwargs), *_ = bench_variants.variant_defs(args.variant, B, H, S, flash_attn_cute).ours
    return lambda: flash_attn_cute.flash_attn_func(q, k, v, backend="sm90", **kwargs)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=["prefill", "mla", "variant", "decode"])
    p.add_argument("--variant", default="document")
    p.add_argument("--impl", required=True, help="prefill: ours | ours-fp8 | fa4 | fa3-fp8; mla: sm80 | sm90 | fi-fa3 | fi-fa2")
    p.add_argument("--B", type=int, default=4)
    p.add_argument("--S", type=int, default=8192)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--batch", type=int, default=768)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--page", type=int, default=1)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--calls", type=int, default=3)
    args = p.parse_args(argv)
    import torch

    torch.manual_seed(0)
    fn = {"prefill": prefill_fn, "mla": mla_fn, "variant": variant_fn, "decode": decode_fn}[args.kind](args)
    for _ in range(args.calls):
        fn()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
