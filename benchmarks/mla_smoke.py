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
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
