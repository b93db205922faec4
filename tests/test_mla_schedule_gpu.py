"""GPU tests of the device-computed MLA split schedule (``get_mla_metadata``,
``kernels/mla_schedule.py``) and of ``flash_mla_decode(..., scheduler_metadata=)`` over it:
the schedule kernel's tensor equals the host reference (``host.mla_schedule.
reference_schedule``) element for element, and the scheduled SM90 TMA kernel (pages of a
multiple of 64) against the fp32 reference on batches of very different lengths (pieces
written whole and pieces merged by the combine in one launch), with ``out=`` poisoned."""

import pytest
import torch

from flash_attn_cute.testing import check_close, check_lse, mla_decode_ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                       reason="the scheduled kernel is SM90's"),
]

# one long sequence among short and empty ones: it is cut into many pieces, the others not
SKEWED = (9000, 1, 0, 300, 64, 2049, 77, 4096)
MANY = tuple(9000 if i % 500 == 7 else (i * 37) % 300 for i in range(1500))  # three cut, past 512 threads


# (the last: more sequences than the kernel's 512 threads, so its prefix sums carry over chunks)
@pytest.mark.parametrize("seqlens,nheads,num_sms", [(SKEWED, 64, None), (SKEWED, 128, 24), ((5000,), 16, None),
                                                    (tuple(range(0, 6000, 61)), 64, 132),
                                                    (MANY, 64, 132)])
def test_schedule_matches_reference(seqlens, nheads, num_sms):
    import flash_attn_cute
    from flash_attn_cute.host import heuristics
    from flash_attn_cute.host.mla_schedule import ITEM_FIELDS, NO_CAPACITY, reference_schedule, schedule_parts

    lens = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    schedule = flash_attn_cute.get_mla_metadata(lens, nheads)
    parts = schedule_parts(num_sms or heuristics.num_sms(lens.device), -(-nheads // 64))
    if num_sms is not None:
        schedule = flash_attn_cute.get_mla_metadata(lens, nheads, num_sms=num_sms)
    items, info = reference_schedule(list(seqlens), NO_CAPACITY, parts)
    got = schedule.cpu().tolist()
    n = ITEM_FIELDS * len(items)
    assert [tuple(got[i:i + 4]) for i in range(0, n, 4)] == items
    assert [tuple(got[i:i + 2]) for i in range(n, len(got), 2)] == info


def _inputs(seqlens, nheads, page_size, seqlen_q=1, seed=0, fp8=False, nheads_kv=None):
    """Gaussian inputs over a shuffled pool; ``nheads_kv``: caches with a KV-head mode."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    batch = len(seqlens)
    max_pages = max(1, -(-max(seqlens) // page_size)) + 1
    num_pages = batch * max_pages + 2
    randn = lambda *s: torch.randn(*s, generator=g, device="cuda").to(torch.bfloat16)
    q_nope, q_pe = randn(batch, seqlen_q, nheads, 512), randn(batch, seqlen_q, nheads, 64)
    heads = () if nheads_kv is None else (nheads_kv,)
    ckv, kpe = randn(num_pages, page_size, *heads, 512), randn(num_pages, page_size, *heads, 64)
    table = torch.randperm(num_pages, generator=g, device="cuda")[: batch * max_pages].to(torch.int32)
    inputs = [q_nope, q_pe, ckv, kpe, torch.tensor(seqlens, dtype=torch.int32, device="cuda"),
              table.view(batch, max_pages)]
    descale = None
    if fp8:
        from flash_attn_cute import quantize_fp8

        both, descale = quantize_fp8(torch.cat([ckv, kpe], -1).unsqueeze(2), granularity="tensor")
        inputs[2], inputs[3] = both[..., 0, :512].contiguous(), both[..., 0, 512:].contiguous()
        descale = descale.float()
        assert nheads_kv is None, "one latent head"

    return inputs, descale


@pytest.mark.parametrize("nheads,page_size,seqlen_q,causal,return_lse,fp8,nheads_kv", [
    (64, 64, 1, False, False, False, None), (128, 128, 2, True, True, False, None),
    (16, 64, 1, False, True, False, None), (64, 64, 1, False, True, True, None), (128, 64, 2, True, False, True, None),
    (16, 64, 2, True, True, False, 2)])
def test_scheduled_decode(nheads, page_size, seqlen_q, causal, return_lse, fp8, nheads_kv):
    import flash_attn_cute

    inputs, descale = _inputs(SKEWED, nheads, page_size, seqlen_q, seed=nheads + seqlen_q, fp8=fp8,
                              nheads_kv=nheads_kv)
    schedule = flash_attn_cute.get_mla_metadata(inputs[4], nheads, nheads_kv=nheads_kv or 1, seqlen_q=seqlen_q)
    out = torch.full(inputs[0].shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    kw = dict(causal=causal, return_lse=return_lse, kv_descale=descale)
    res = flash_attn_cute.flash_mla_decode(*inputs, out=out, scheduler_metadata=schedule, **kw)
    assert (res[0] if return_lse else res) is out
    lse = res[1] if return_lse else None
    if fp8:
        from test_mla_gpu import check_fp8

        check_fp8("sm90", inputs, descale, out, lse, causal=causal)
        return
    out_ref, lse_ref = mla_decode_ref(*inputs, causal=causal)
    out_pt, lse_pt = mla_decode_ref(*inputs, causal=causal, upcast=False)
    check_close(out, out_ref, out_pt)
    if return_lse:
        check_lse(lse, lse_ref, lse_pt)
    # a second step with other lengths: a new schedule, the same compiled kernels
    inputs[4] = torch.tensor(SKEWED[::-1], dtype=torch.int32, device="cuda")
    schedule = flash_attn_cute.get_mla_metadata(inputs[4], nheads, seqlen_q=seqlen_q)
    res = flash_attn_cute.flash_mla_decode(*inputs, scheduler_metadata=schedule, **kw)
    out_ref, _ = mla_decode_ref(*inputs, causal=causal)
    out_pt, _ = mla_decode_ref(*inputs, causal=causal, upcast=False)
    check_close(res[0] if return_lse else res, out_ref, out_pt)


def test_scheduled_decode_in_a_graph():
    """The schedule and the decode captured in one CUDA graph, replayed after the lengths
    change in place (as a serving engine's step)."""
    import flash_attn_cute

    inputs, _ = _inputs(SKEWED, 64, 64, seed=7)
    lens = inputs[4]
    flash_attn_cute.flash_mla_decode(*inputs, scheduler_metadata=flash_attn_cute.get_mla_metadata(lens, 64))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_cute.flash_mla_decode(*inputs, scheduler_metadata=flash_attn_cute.get_mla_metadata(lens, 64))
    for new in (SKEWED[::-1], (0, 5000, 1, 1, 9000, 64, 3000, 2)):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        check_close(out, mla_decode_ref(*inputs)[0], mla_decode_ref(*inputs, upcast=False)[0])
