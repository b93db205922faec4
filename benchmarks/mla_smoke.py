"""One MLA decode call per SM90 kernel against the fp32 reference, before a long GPU run:
a hang or a wrong result shows in seconds, and the run can stop there instead of spending
its device time on hung test shards (``timeout 60 python benchmarks/mla_smoke.py || exit``;
exit status 1 on a wrong result)."""

import sys

import torch

import flash_attn_cute
from flash_attn_cute.testing import mla_decode_ref


def main():
    if not torch.cuda.is_available():
        sys.exit("mla_smoke.py needs a CUDA GPU")
    torch.manual_seed(0)
    ok = True
    for page, lens, heads, splits in ((64, (1, 77, 300, 33), 64, 1), (64, (700, 5, 129), 128, 3), (1, (77, 300), 64, 1)):
        b, pages = len(lens), -(-max(lens) // page) + 1
        q_nope = torch.randn(b, 1, heads, 512, device="cuda", dtype=torch.bfloat16)
        q_pe = torch.randn(b, 1, heads, 64, device="cuda", dtype=torch.bfloat16)
        ckv = torch.randn(b * pages, page, 512, device="cuda", dtype=torch.bfloat16)
        kpe = torch.randn(b * pages, page, 64, device="cuda", dtype=torch.bfloat16)
        table = torch.randperm(b * pages, device="cuda").view(b, pages).to(torch.int32)
        seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        args = (q_nope, q_pe, ckv, kpe, seqlens, table)
        out = flash_attn_cute.flash_mla_decode(*args, num_splits=splits, backend="sm90")
        torch.cuda.synchronize()
        ref = mla_decode_ref(*args)[0]
        err = ((out.float() - ref).norm() / ref.norm()).item()
        good = err < 1e-2 and bool(torch.isfinite(out).all())
        ok &= good
        print(f"page {page} heads {heads} splits {splits}: rel err {err:.2e} {'ok' if good else 'WRONG'}", flush=True)
    # An e4m3 cache at pages of 64: the fp8 wgmma kernel (queries quantized in the kernel),
    # then the same call widened to 16 bits (FLASH_ATTN_CUTE_MLA_SM90_QK=seesaw): the
    # relative error of each against the fp32 reference on the dequantized cache (what the
    # README states as the FP8 path's accuracy).
    import os

    lens, heads, page = (4096, 1000, 77), 64, 64
    b, pages = len(lens), -(-max(lens) // page) + 1
    q_nope = torch.randn(b, 1, heads, 512, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(b, 1, heads, 64, device="cuda", dtype=torch.bfloat16)
    both, descale = flash_attn_cute.quantize_fp8(
        torch.randn(b * pages, page, 1, 576, device="cuda", dtype=torch.bfloat16), granularity="tensor")
    ckv, kpe = both[..., 0, :512].contiguous(), both[..., 0, 512:].contiguous()
    table = torch.randperm(b * pages, device="cuda").view(b, pages).to(torch.int32)
    args = (q_nope, q_pe, ckv, kpe, torch.tensor(lens, dtype=torch.int32, device="cuda"), table)
    ref = mla_decode_ref(*args, kv_descale=descale)[0]
    for knob in ("tma", "seesaw"):
        os.environ["FLASH_ATTN_CUTE_MLA_SM90_QK"] = knob
        out = flash_attn_cute.flash_mla_decode(*args, backend="sm90", kv_descale=descale)
        torch.cuda.synchronize()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        good = err < 5e-2 and bool(torch.isfinite(out).all())
        ok &= good
        print(f"fp8 e4m3 page {page} heads {heads} {knob}: rel err {err:.2e}, max abs err "
              f"{(out.float() - ref).abs().max().item():.2e} (max |ref| {ref.abs().max().item():.2e}) "
              f"{'ok' if good else 'WRONG'}", flush=True)
    os.environ.pop("FLASH_ATTN_CUTE_MLA_SM90_QK")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
