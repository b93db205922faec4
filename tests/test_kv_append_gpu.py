"""GPU tests of the KV-append + rotary kernel (flash_attn_cute/kv_append.py) against the fp32
references of flash_attn_cute.testing (``kv_append_ref``; those are checked on CPU in
tests/test_kv_append_compile.py): 16-bit caches, FP8 caches (the quantization's bounds
are given with those tests, below), and end to end through ``flash_attn_with_kvcache``
(FP8 appends then the attention, ``cache_leftpad`` over paged caches, the
``cache_batch_idx`` bound check), per backend.

Inputs are random normals (never zero); q_out is NaN and the metadata outputs -7 before
the call, and every cache slot the append is to write is NaN, so a missed write shows.
Every cache and output lives inside a larger buffer whose guard regions on both sides
must come out bit-identical: nothing is written out of bounds.

Bounds. Everything that is copied (v, pass-through channels past rotary_dim, untouched
cache slots) and the int32 metadata must match bitwise. A rotated value must satisfy

    |out - ref32| <= ulp_dtype(ref32) + 2^-21 * (|x0| + |x1|)

with ref32 the fp32 reference before rounding and (x0, x1) the pair it comes from: the
kernel rounds its fp32 result once to fp16 / bf16 (at most half an ulp), and its fp32
evaluation of x0 cos - x1 sin (FMA-contracted) and the reference's (separately rounded
products) each err by at most 2^-23 (|x0| + |x1|) since |cos|, |sin| <= 1; the bound
doubles both terms, so it also covers a rounding that lands on the other side of a
binade edge, and it is tight enough that a wrong position, a swapped pair or a sign error
fails by orders of magnitude.
"""

import math
from dataclasses import dataclass

import pytest
import torch

from flash_attn_cute.testing import kv_append_ref, quantize_ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEVICE = "cuda"
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = (E4M3, E5M2)
GUARD = 512  # elements on each side of every cache and output (a multiple of 16 bytes)
POISON_INT = -7


def launch(q, k_new, v_new, k_cache, v_cache, seqlens, page_table, batch_idx, leftpad, cos, sin, q_out, seqused,
           k_offsets, cu_q=None, cu_k=None, *, interleaved, per_query):
    from flash_attn_cute.kernels.kv_append import append_launcher

    rotary_dim = 0 if cos is None else 2 * cos.shape[1]
    fn = append_launcher(k_cache.dtype, k_cache.shape[-1], v_cache.shape[-1], rotary_dim, interleaved, per_query,
                         q is not None, k_new is not None, page_table is not None, batch_idx is not None,
                         leftpad is not None, varlen=cu_q is not None or cu_k is not None)
    fn(q, k_new, v_new, k_cache, v_cache, seqlens, page_table, batch_idx, leftpad, cos, sin, q_out, seqused,
       k_offsets, cu_q, cu_k, None, None, None)  # no descales: a 16-bit cache


def guarded(shape, dtype, gen, fill=None):
    """(buffer, view): a view of ``shape`` inside a random buffer, GUARD elements of
    margin on each side; the view is filled with ``fill`` when given."""
    n = math.prod(shape)
    if dtype in FP8:
        buf = quantize_ref(torch.randn(n + 2 * GUARD, device=DEVICE, generator=gen) * 8, dtype)
    elif dtype.is_floating_point:
        buf = torch.randn(n + 2 * GUARD, dtype=dtype, device=DEVICE, generator=gen)
    else:
        buf = torch.randint(-1000, 1000, (n + 2 * GUARD,), dtype=dtype, device=DEVICE, generator=gen)
    view = buf[GUARD:GUARD + n].view(shape)
    if fill is not None and dtype in FP8:
        assert math.isnan(fill)
        view.view(torch.uint8).fill_(0x7F)  # NaN in e4m3 and in e5m2
    elif fill is not None:
        view.fill_(fill)
    return buf, view


def check_guards(before, bufs):
    for name, buf in bufs.items():
        assert bits(buf[:GUARD]).equal(bits(before[name][:GUARD])), f"{name}: written before its start"
        assert bits(buf[-GUARD:]).equal(bits(before[name][-GUARD:])), f"{name}: written past its end"


def bits(x):
    """The bit patterns of a tensor (fp8 caches too), to compare bit for bit."""
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])


def ulp(y, dtype):
    """The spacing of ``dtype`` at |y| (subnormal spacing below the smallest normal)."""
    fi = torch.finfo(dtype)
    _, e = torch.frexp(y.abs().clamp(min=fi.tiny))
    return torch.ldexp(torch.full_like(y, fi.eps), e - 1)


def pair_magnitude(x, rotary_dim, interleaved):
    """|x0| + |x1| of the rotary pair of every rotated channel (|x| for the others), fp32."""
    m = x.float().abs()
    if rotary_dim:
        r = m[..., :rotary_dim]
        partner = r.unflatten(-1, (-1, 2)).flip(-1).flatten(-2) if interleaved else r.roll(rotary_dim // 2, -1)
        m[..., :rotary_dim] = r + partner
    return m


def check_rotated(name, out, ref16, ref32, mag, rotated):
    """Bitwise equal to the rounded reference, or (rotated channels only) within the bound."""
    exact = bits(out) == bits(ref16)
    close = (out.float() - ref32).abs() <= ulp(ref32, out.dtype) + 2.0**-21 * mag
    ok = exact | (rotated & close)
    if not ok.all():
        idx = tuple(i[0].item() for i in (~ok).nonzero(as_tuple=True))
        raise AssertionError(f"{name}: {(~ok).sum().item()} of {ok.numel()} wrong; first at {idx}: "
                             f"{out[idx].item()} vs reference {ref32[idx].item()} (rotated: {rotated[idx].item()})")


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype = torch.bfloat16
    d: int = 128
    d_v: int = 128
    rotary: str = "neox"  # "neox" (GPT-NeoX halves), "gptj" (interleaved), "none"
    rotary_dim: int = 0  # 0: all of d
    s_new: int = 1  # 0: no new k / v
    sq: int = 0  # 0: s_new (at least 1); -1: no q
    batch: int = 3
    h: int = 4
    h_kv: int = 2
    page_size: int = 0  # 0: contiguous cache
    batch_idx: bool = False
    leftpad: bool = False
    per_query: bool = True
    packed_qkv: bool = False  # q, k_new, v_new: strided views of one (b, s, h + 2 h_kv, d) tensor
    q_inplace: bool = False  # q_out is q
    slack: int = 40  # cache positions beyond the longest append


def rope_tables(seqlen_ro, rotary_dim, dtype):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=DEVICE) / rotary_dim))
    angles = torch.arange(seqlen_ro, dtype=torch.float64, device=DEVICE)[:, None] * inv_freq[None]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def cache_layout(c, capacity: int, gen):
    """(page_table, batch_idx, the caches' leading dims) of a case (any of ``Case``,
    ``VarlenCase``, ``Fp8Case``): with pages, every sequence's ``capacity / page_size`` pages
    drawn from a pool of 5 more; without, ``cache_batch_idx`` a permutation into a cache of 2
    more rows when the case has one."""
    page_table = batch_idx = None
    if c.page_size:
        max_pages = capacity // c.page_size
        num_pages = c.batch * max_pages + 5
        page_table = torch.randperm(num_pages, device=DEVICE, generator=gen)[:c.batch * max_pages]
        page_table = page_table.view(c.batch, max_pages).int()
        return page_table, batch_idx, (num_pages, c.page_size)
    b_cache = c.batch + 2 if c.batch_idx else c.batch
    if c.batch_idx:
        batch_idx = torch.randperm(b_cache, device=DEVICE, generator=gen)[:c.batch].int()
    return page_table, batch_idx, (b_cache, capacity)


def build(c: Case, seed=0):
    """Inputs of a case: (tensors dict for ``launch`` and the reference, guarded buffers)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    rd = 0 if c.rotary == "none" else (c.rotary_dim or c.d)
    sq = -1 if c.sq < 0 else (c.sq or max(c.s_new, 1))
    if c.page_size:
        max_pages = -(-(c.s_new + c.slack) // c.page_size)
        capacity = max_pages * c.page_size
    else:
        capacity = c.s_new + c.slack
    rnd = lambda *shape: torch.randn(*shape, dtype=c.dtype, device=DEVICE, generator=gen)
    rint = lambda hi, shape: torch.randint(0, hi, shape, device=DEVICE, generator=gen)
    if c.packed_qkv:
        assert sq == c.s_new and c.d == c.d_v
        qkv = rnd(c.batch, sq, c.h + 2 * c.h_kv, c.d)
        q, k_new, v_new = qkv[:, :, :c.h], qkv[:, :, c.h:c.h + c.h_kv], qkv[:, :, c.h + c.h_kv:]
    else:
        q = rnd(c.batch, sq, c.h, c.d) if sq > 0 else None
        k_new = rnd(c.batch, c.s_new, c.h_kv, c.d) if c.s_new else None
        v_new = rnd(c.batch, c.s_new, c.h_kv, c.d_v) if c.s_new else None
    # Every append fits; the last row fills its cache exactly.
    seqlens = rint(capacity - c.s_new + 1, (c.batch,))
    seqlens[-1] = capacity - c.s_new
    leftpad = (torch.rand(c.batch, device=DEVICE, generator=gen) * (seqlens + 1)).long() if c.leftpad else None
    page_table, batch_idx, cache_rows = cache_layout(c, capacity, gen)
    bufs = {}
    bufs["k_cache"], k_cache = guarded(cache_rows + (c.h_kv, c.d), c.dtype, gen)
    bufs["v_cache"], v_cache = guarded(cache_rows + (c.h_kv, c.d_v), c.dtype, gen)
    cos = sin = None
    if rd:
        cos, sin = rope_tables(capacity + max(sq, 1), rd, c.dtype)
    q_out = None
    if q is not None:
        if c.q_inplace:
            q_out = q
        else:
            bufs["q_out"], q_out = guarded(tuple(q.shape), c.dtype, gen, float("nan"))
    bufs["seqused"], seqused = guarded((c.batch,), torch.int32, gen, POISON_INT)
    k_offsets = None
    if (batch_idx is not None or c.leftpad) and not c.page_size:  # a paged cache is read from its starts
        bufs["k_offsets"], k_offsets = guarded((c.batch + 1,), torch.int32, gen, POISON_INT)
    t = dict(q=q, k_new=k_new, v_new=v_new, k_cache=k_cache, v_cache=v_cache, seqlens=seqlens.int(),
             page_table=page_table, batch_idx=batch_idx, leftpad=None if leftpad is None else leftpad.int(),
             cos=cos, sin=sin, q_out=q_out, seqused=seqused, k_offsets=k_offsets, cu_q=None, cu_k=None)
    poison_slots(t, c)
    return t, bufs


def ref_args(t):
    return (t["q"], t["k_new"], t["v_new"], t["k_cache"], t["v_cache"], t["seqlens"], t["page_table"],
            t["batch_idx"], t["leftpad"], t["cos"], t["sin"])


def poison_slots(t, c):
    """NaN into every cache slot the append will write (the reference's own placement)."""
    if t["k_new"] is None:
        return
    nan_k, nan_v = torch.full_like(t["k_new"], float("nan")), torch.full_like(t["v_new"], float("nan"))
    _, k_poisoned, v_poisoned, _, _ = kv_append_ref(None, nan_k, nan_v, *ref_args(t)[3:9], cu_seqlens_k_new=t["cu_k"])
    t["k_cache"].copy_(k_poisoned)
    t["v_cache"].copy_(v_poisoned)


def rotary_dim_of(t):
    return 0 if t["cos"] is None else 2 * t["cos"].shape[1]


def expected(c: Case, t):
    """What the outputs must hold after the launch, computed before it (the caches are
    updated in place): rounded and fp32 references, pair magnitudes and the rotated
    channels of q and of the cache slots the new keys land in."""
    rd, interleaved = rotary_dim_of(t), c.rotary == "gptj"
    kw = dict(page_table=t["page_table"], cache_batch_idx=t["batch_idx"], cache_leftpad=t["leftpad"],
              rotary_cos=t["cos"], rotary_sin=t["sin"], interleaved=interleaved, q_positions_per_query=c.per_query,
              cu_seqlens_q=t["cu_q"], cu_seqlens_k_new=t["cu_k"])
    args = (t["q"], t["k_new"], t["v_new"], t["k_cache"], t["v_cache"], t["seqlens"])
    e = dict(ref16=kv_append_ref(*args, **kw), ref32=kv_append_ref(*args, upcast=True, **kw), k_mag=None)
    if t["q"] is not None:
        e["q_mag"] = pair_magnitude(t["q"], rd, interleaved)
        e["q_rot"] = (torch.arange(c.d, device=DEVICE) < rd).expand(t["q"].shape)
    if t["k_new"] is not None:
        # Pair magnitudes and a rotated-channel indicator of the new keys, put into cache
        # layout by the reference itself (without rotary: a plain placement).
        zeros_k = torch.zeros(t["k_cache"].shape, device=DEVICE)
        zeros_v = torch.zeros(t["v_cache"].shape, device=DEVICE)
        place_kw = dict(kw, rotary_cos=None, rotary_sin=None, upcast=True)
        place = lambda x: kv_append_ref(None, x, t["v_new"].float(), zeros_k, zeros_v, t["seqlens"], **place_kw)[1]
        e["k_mag"] = place(pair_magnitude(t["k_new"], rd, interleaved))
        indicator = torch.zeros(t["k_new"].shape, device=DEVICE)
        indicator[..., :rd] = 1
        e["k_rot"] = place(indicator) > 0
    return e


def verify(c: Case, t, e):
    ref16, ref32 = e["ref16"], e["ref32"]
    assert t["seqused"].tolist() == ref16[3].tolist()
    if t["k_offsets"] is not None:
        assert t["k_offsets"].tolist() == ref16[4].tolist()
    if t["q"] is not None:
        check_rotated("q_out", t["q_out"], ref16[0], ref32[0], e["q_mag"], e["q_rot"])
    assert bits(t["v_cache"]).equal(bits(ref16[2])), "v_cache"
    if e["k_mag"] is None:
        assert bits(t["k_cache"]).equal(bits(ref16[1])), "k_cache"
    else:
        check_rotated("k_cache", t["k_cache"], ref16[1], ref32[1], e["k_mag"], e["k_rot"])


def launch_case(c: Case, t):
    launch(t["q"], t["k_new"], t["v_new"], t["k_cache"], t["v_cache"], t["seqlens"], t["page_table"],
           t["batch_idx"], t["leftpad"], t["cos"], t["sin"], t["q_out"], t["seqused"], t["k_offsets"], t["cu_q"],
           t["cu_k"], interleaved=c.rotary == "gptj", per_query=c.per_query)


def run_and_check(c: Case, t, bufs):
    e = expected(c, t)
    before = {name: buf.clone() for name, buf in bufs.items()}
    launch_case(c, t)
    torch.cuda.synchronize()
    check_guards(before, bufs)
    verify(c, t, e)


CONTIGUOUS = [
    Case(),  # bf16 decode, GPT-NeoX over all of d
    Case(dtype=torch.float16, rotary="gptj", batch_idx=True),
    Case(d=64, d_v=128, rotary="gptj", rotary_dim=32, s_new=300, per_query=False, leftpad=True),
    Case(dtype=torch.float16, d=128, d_v=64, rotary_dim=64, s_new=257, sq=1, batch_idx=True, leftpad=True),
    Case(rotary="none", batch_idx=True, leftpad=True),  # no rotary: q_out is a copy
    Case(dtype=torch.float16, d=64, d_v=64, rotary_dim=16, s_new=4, packed_qkv=True, leftpad=True, per_query=False),
    Case(rotary="gptj", s_new=2, sq=-1),  # rotated k only
    Case(rotary="none", s_new=0, sq=-1, batch_idx=True, leftpad=True),  # metadata only
    Case(dtype=torch.float16, s_new=0, sq=2, q_inplace=True),  # q only, rotated in place
]

PAGED = [
    Case(page_size=1),
    Case(dtype=torch.float16, d=64, d_v=128, rotary="gptj", page_size=1, s_new=200, sq=1),
    Case(rotary="gptj", rotary_dim=64, page_size=16, per_query=False, q_inplace=True),
    Case(dtype=torch.float16, d=128, d_v=64, rotary="none", page_size=16, s_new=300),
    Case(dtype=torch.float16, d=64, d_v=64, page_size=64),
    Case(rotary_dim=32, page_size=64, s_new=129, packed_qkv=True),
    Case(rotary="gptj", page_size=256, h=8, h_kv=1),
    Case(dtype=torch.float16, d=128, d_v=64, page_size=256, s_new=511, sq=1),
    Case(page_size=16, leftpad=True, s_new=5),  # paged leftpad: key counts only, no offsets
    Case(rotary="none", page_size=1, leftpad=True, s_new=0, sq=-1),
]


def case_id(c):
    fields = {f: getattr(c, f) for f in c.__dataclass_fields__}
    base = Case()
    changed = [f"{k}={str(v).replace('torch.', '')}" for k, v in fields.items() if v != getattr(base, k)]
    return "-".join(changed) or "default"


@pytest.mark.parametrize("case", CONTIGUOUS + PAGED, ids=case_id)
def test_append(case):
    t, bufs = build(case)
    run_and_check(case, t, bufs)


@pytest.mark.parametrize("paged", [False, True])
def test_batch_200k(paged):
    """Decode over 200,000 sequences (more CTAs than a grid y / z dimension allows); small
    caches (paged: two pages of 2 per sequence) keep the fp32 references small."""
    c = Case(d=64, d_v=64, h=2, h_kv=1, batch=200_000, slack=3, rotary="gptj" if paged else "neox",
             page_size=2 if paged else 0, batch_idx=not paged, leftpad=not paged)
    t, bufs = build(c, seed=1)
    run_and_check(c, t, bufs)


def test_out_of_range_contiguous():
    """Garbage cache_seqlens, batch idx and leftpad, positions past the rotary table: no
    write outside the caches, and exactly the reference's clamped semantics. The rows are
    chosen so that no two rows with writes share a cache row after clamping."""
    c = Case(dtype=torch.float16, rotary="gptj", s_new=8, batch=6, batch_idx=True, leftpad=True, slack=56)
    t, bufs = build(c, seed=2)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=DEVICE)
    cap = t["k_cache"].shape[1]  # 64; the cache has 8 rows
    t["seqlens"] = i32([cap - 4, cap, -3, 2**31 - 1, -2**31, 10])  # 4 written, none, 5, none, none, 8
    t["batch_idx"] = i32([0, -5, 70, 1, 2**31 - 1, 3])  # -> rows 0, 0 (no write), 7, 1, 7 (no write), 3
    t["leftpad"] = i32([-4, 100, 3, 5, 0, 2**31 - 1])
    t["cos"], t["sin"] = t["cos"][:16], t["sin"][:16]  # positions past 15 use row 15
    poison_slots(t, c)
    run_and_check(c, t, bufs)


def test_out_of_range_paged():
    """Garbage page ids and cache_seqlens: ids are clamped into the pool, positions past
    the table's capacity dropped, no write outside the pool. Clamped pages (0 and the
    last) receive one row's writes each, so the result is still exactly defined."""
    c = Case(rotary="neox", s_new=8, batch=4, page_size=16, slack=56)  # max_pages 4: capacity 64
    t, bufs = build(c, seed=3)
    num_pages = t["k_cache"].shape[0]
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=DEVICE)
    t["seqlens"] = i32([5, 60, -100, 30])  # pages idx 0; idx 3 (4 dropped); nothing; idx 1 and 2
    t["page_table"] = i32([[-7, 2**31 - 1, -1, 5],
                           [4, 6, 7, num_pages + 99],
                           [-2**31, num_pages, 12345, -1],
                           [9, 1, 2, 2**31 - 1]])
    t["cos"], t["sin"] = t["cos"][:33], t["sin"][:33]
    poison_slots(t, c)
    run_and_check(c, t, bufs)


def test_cuda_graph_replay_decode_steps():
    """Captured once (no host sync allowed), replayed for three decode steps with new
    cache_seqlens, page table and token values written in place: every step matches (the
    last row's cache is full after the first step: its tokens are dropped)."""
    c = Case(page_size=16, batch=5, s_new=1)
    t, bufs = build(c, seed=4)
    launch_case(c, t)  # compile / load outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            launch_case(c, t)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    for step in range(3):
        t["seqlens"].add_(1)
        t["page_table"].copy_(t["page_table"].roll(1, 0))
        for name in ("q", "k_new", "v_new"):
            t[name].copy_(torch.randn(t[name].shape, dtype=c.dtype, device=DEVICE, generator=gen))
        poison_slots(t, c)
        e = expected(c, t)
        before = {name: buf.clone() for name, buf in bufs.items()}
        graph.replay()
        torch.cuda.synchronize()
        check_guards(before, bufs)
        verify(c, t, e)


def test_decode_append_costs_a_few_microseconds():
    """b = 128 sequences of h = 32, h_kv = 8, d = 128 (paged, page 64), one token each:
    one launch per step, timed as a CUDA-graph replay of 50 launches (so the time is the
    device's, gaps between launches included). The budget is 5% of a ~250 us decode
    attention call."""
    c = Case(batch=128, h=32, h_kv=8, page_size=64, slack=2000)
    t, _ = build(c, seed=6)
    launch_case(c, t)
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for _ in range(50):
            launch_case(c, t)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / 50)
    us = sorted(times)[len(times) // 2]
    print(f"\nkv_append decode b=128 h=32 h_kv=8 d=128 paged: {us:.2f} us per launch")
    assert us <= 12.5, us


# ---------------------------------------------------------------------------------------
# Varlen (packed) mode: q (total_q, h, d) with cu_seqlens_q, new k / v (total_new, h_kv, d*)
# with cu_seqlens_k_new, as a serving engine's mixed step passes them
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VarlenCase:
    dtype: torch.dtype = torch.bfloat16
    d: int = 128
    d_v: int = 128
    rotary: str = "neox"
    rotary_dim: int = 0  # 0: all of d
    h: int = 4
    h_kv: int = 2
    batch: int = 16
    # "ragged": 0..600 new tokens, every other sequence 1; "decode": 1 each; "shifted": 3
    # for the first sequence, then 1 each (no row is where a decode step would put it)
    lengths: str = "ragged"
    # "same": the query rows are the new rows (one cu tensor for both); "decode": one query
    # per sequence (its own cu tensor); "only": q without new k / v
    q: str = "same"
    page_size: int = 0
    batch_idx: bool = False
    leftpad: bool = False
    per_query: bool = True
    packed_qkv: bool = False  # q, k_new, v_new: strided views of one (total, h + 2 h_kv, d) tensor
    q_inplace: bool = False
    slack: int = 24


def new_lengths(c: VarlenCase, gen):
    if c.lengths in ("decode", "shifted"):
        return [3 if i == 0 and c.lengths == "shifted" else 1 for i in range(c.batch)]
    long = torch.randint(2, 601, (c.batch,), generator=gen).tolist()
    lengths = [[1, 0, long[i], 1][i % 4] for i in range(c.batch)]
    lengths[2] = 600
    return lengths


def build_varlen(c: VarlenCase, seed=0):
    """Inputs of a varlen case (tensors dict for ``launch`` and the reference, guarded
    buffers): every append fits, the last sequence fills its cache exactly."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    lengths_k = new_lengths(c, torch.Generator().manual_seed(seed))
    lengths_q = lengths_k if c.q == "same" else [1] * c.batch
    cum = lambda lengths: torch.tensor([0] + lengths, device=DEVICE).cumsum(0).int()
    cu_k = cum(lengths_k) if c.q != "only" else None
    cu_q = cu_k if c.q == "same" else cum(lengths_q)
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    rd = 0 if c.rotary == "none" else (c.rotary_dim or c.d)
    capacity = max(lengths_k) + c.slack
    if c.page_size:
        max_pages = -(-capacity // c.page_size)
        capacity = max_pages * c.page_size
    rnd = lambda *shape: torch.randn(*shape, dtype=c.dtype, device=DEVICE, generator=gen)
    if c.packed_qkv:
        assert c.q == "same" and c.d == c.d_v
        qkv = rnd(total_k, c.h + 2 * c.h_kv, c.d)
        q, k_new, v_new = qkv[:, :c.h], qkv[:, c.h:c.h + c.h_kv], qkv[:, c.h + c.h_kv:]
    else:
        q = rnd(total_q, c.h, c.d)
        k_new = rnd(total_k, c.h_kv, c.d) if cu_k is not None else None
        v_new = rnd(total_k, c.h_kv, c.d_v) if cu_k is not None else None
    n_new = torch.tensor(lengths_k, device=DEVICE) if cu_k is not None else torch.zeros(c.batch, device=DEVICE)
    seqlens = (torch.rand(c.batch, device=DEVICE, generator=gen) * (capacity - n_new + 1)).long()
    seqlens[-1] = capacity - n_new[-1]
    leftpad = (torch.rand(c.batch, device=DEVICE, generator=gen) * (seqlens + 1)).int() if c.leftpad else None
    page_table, batch_idx, cache_rows = cache_layout(c, capacity, gen)
    bufs = {}
    bufs["k_cache"], k_cache = guarded(cache_rows + (c.h_kv, c.d), c.dtype, gen)
    bufs["v_cache"], v_cache = guarded(cache_rows + (c.h_kv, c.d_v), c.dtype, gen)
    cos = sin = None
    if rd:
        cos, sin = rope_tables(capacity + 1, rd, c.dtype)
    if c.q_inplace:
        q_out = q
    else:
        bufs["q_out"], q_out = guarded(tuple(q.shape), c.dtype, gen, float("nan"))
    bufs["seqused"], seqused = guarded((c.batch,), torch.int32, gen, POISON_INT)
    k_offsets = None
    if (c.batch_idx or c.leftpad) and not c.page_size:
        bufs["k_offsets"], k_offsets = guarded((c.batch + 1,), torch.int32, gen, POISON_INT)
    t = dict(q=q, k_new=k_new, v_new=v_new, k_cache=k_cache, v_cache=v_cache, seqlens=seqlens.int(),
             page_table=page_table, batch_idx=batch_idx, leftpad=leftpad, cos=cos, sin=sin, q_out=q_out,
             seqused=seqused, k_offsets=k_offsets, cu_q=cu_q, cu_k=cu_k)
    poison_slots(t, c)
    return t, bufs


VARLEN = [
    # Mixed step, the engine's layout: one qkv tensor, one cu tensor, contiguous cache.
    VarlenCase(packed_qkv=True, batch_idx=True, leftpad=True),
    VarlenCase(dtype=torch.float16, d=64, d_v=128, rotary="gptj", page_size=16),
    VarlenCase(rotary_dim=64, page_size=64, h=8, h_kv=1, q="decode", per_query=False),
    VarlenCase(rotary="none", page_size=16, d_v=64),
    VarlenCase(rotary="gptj", page_size=16, leftpad=True),
    VarlenCase(dtype=torch.float16, rotary="gptj", rotary_dim=32, q="only", q_inplace=True, leftpad=True),
]


def varlen_id(c):
    fields = {f: getattr(c, f) for f in c.__dataclass_fields__}
    base = VarlenCase()
    changed = [f"{k}={str(v).replace('torch.', '')}" for k, v in fields.items() if v != getattr(base, k)]
    return "-".join(changed) or "default"


@pytest.mark.parametrize("case", VARLEN, ids=varlen_id)
def test_append_varlen(case):
    t, bufs = build_varlen(case)
    run_and_check(case, t, bufs)


@pytest.mark.parametrize("lengths", ["decode", "shifted"])
def test_varlen_200k_sequences(lengths):
    """200,000 sequences of one token (a decode step in varlen form: every row found by
    the first probe), or the first of three ("shifted": every other row found by a
    bisection of ~18 steps over the 200,001 entries); more CTAs than a grid y / z
    dimension allows. Small paged caches keep the references small."""
    c = VarlenCase(d=64, d_v=64, h=2, h_kv=1, batch=200_000, lengths=lengths, rotary="gptj", page_size=4, slack=3)
    t, bufs = build_varlen(c, seed=1)
    run_and_check(c, t, bufs)


def test_varlen_untrusted_cumulative_lengths():
    """Cumulative lengths that are not monotone, negative, past the packed rows, and a
    cu_seqlens_q shorter than batch + 1: no access out of bounds (guard regions around
    every output, caches included, come out bit-identical), rows outside every sequence
    unwritten (q_out keeps its NaN there), and exactly the reference's search otherwise.
    Sequences have distinct cache rows, so no two written rows share a slot."""
    c = VarlenCase(dtype=torch.float16, rotary="gptj", q="decode", batch=8, batch_idx=True, leftpad=True, slack=40)
    t, bufs = build_varlen(c, seed=2)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=DEVICE)
    total_k, total_q = t["k_new"].shape[0], t["q"].shape[0]
    t["cu_k"] = i32([3, 10, 5, total_k + 1000, 7, 2**31 - 1, -2**31, 12, total_k - 1])
    # 5 sequences' worth for a batch of 8; rows 0 and 1 in no sequence, the others in 0 and 2.
    t["cu_q"] = i32([2, 4, 3, 9, -1, total_q + 6])
    poison_slots(t, c)
    e = expected(c, t)
    assert torch.isnan(e["ref16"][0].float()).any() and not torch.isnan(e["ref16"][0].float()).all()
    before = {name: buf.clone() for name, buf in bufs.items()}
    launch_case(c, t)
    torch.cuda.synchronize()
    check_guards(before, bufs)
    verify(c, t, e)


# ---------------------------------------------------------------------------------------
# FP8: new tokens quantized into an e4m3 / e5m2 cache with k_descale / v_descale, tokens
# already in the cache's dtype copied (or, k with rotary, dequantized, rotated and
# requantized), e4m3 q (FP8 attention) rotated with q_descale
# ---------------------------------------------------------------------------------------
#
# Bounds. Every fp8 value the kernel only copies (fp8 v, fp8 k without rotary, channels
# past rotary_dim) and every value it quantizes without rotating (16-bit v, 16-bit k
# without rotary or past rotary_dim: x / descale, both IEEE, then round to nearest even)
# must equal ``quantize_ref`` of the reference bit for bit. A rotated value goes through
# the rotation, whose fp32 evaluation may differ from the reference's by 2^-22 (|x0| +
# |x1|) (FMA contraction, see the module docstring), then the division: the kernel's
# quotient lies within eps = 2^-21 (|x0| + |x1|) / descale + 2^-22 |q32| of the
# reference's q32, so its fp8 value must lie between the roundings of q32 - eps and q32 +
# eps (rounding is monotone): the reference's own rounding wherever q32 is not within eps
# of a rounding midpoint, and one of its two neighbours where it is.

needs_fp8 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                               reason="FP8 needs compute capability >= 8.9")


@dataclass(frozen=True)
class Fp8Case:
    cache: torch.dtype = E4M3
    tokens: str = "16"  # "16": new tokens in ``dtype`` (quantized); "fp8": in the cache's dtype
    q_fp8: bool = False  # e4m3 q (FP8 attention; e4m3 caches), rotated with q_descale
    dtype: torch.dtype = torch.bfloat16  # 16-bit tokens, rotary tables (and 16-bit q)
    d: int = 128
    d_v: int = 128
    rotary: str = "neox"
    rotary_dim: int = 0  # 0: all of d
    s_new: int = 1
    sq: int = 0  # 0: s_new (at least 1); -1: no q
    batch: int = 3
    h: int = 4
    h_kv: int = 2
    page_size: int = 0
    batch_idx: bool = False
    leftpad: bool = False
    per_query: bool = True
    descale: str = "batch_head"  # "tensor": one element (broadcast); "none": None (1.0)
    amp: float = 1.0  # token magnitude (1000: many values saturate at the format's largest finite value)
    varlen: bool = False  # packed (total, h, d) rows with cu_seqlens (ragged lengths)
    slack: int = 40


def fp8_values(shape, dtype, gen, amp):
    """Random tokens in ``dtype`` (fp8: quantized from normals of magnitude ``amp``)."""
    x = torch.randn(shape, device=DEVICE, generator=gen) * amp
    return quantize_ref(x * 4, dtype) if dtype in FP8 else x.to(dtype)


def descales(c: Fp8Case, gen, batch):
    """(q_descale, k_descale, v_descale) as the user passes them."""
    if c.descale == "none":
        return None, None, None
    if c.descale == "tensor":
        one = lambda: torch.rand(1, device=DEVICE, generator=gen) + 0.25
        return one(), one(), one()
    per = lambda: torch.rand(batch, c.h_kv, device=DEVICE, generator=gen) + 0.25
    return per(), per(), per()


def kernel_view(t, batch, h_kv):
    """A descale as the kernel reads it: fp32 (batch, h_kv), a broadcast view for one element."""
    from flash_attn_cute.api.call_args import descale_view

    return descale_view(t, batch, h_kv, torch.device(DEVICE))


def build_fp8(c: Fp8Case, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    rd = 0 if c.rotary == "none" else (c.rotary_dim or c.d)
    token_dtype = c.cache if c.tokens == "fp8" else c.dtype
    q_dtype = E4M3 if c.q_fp8 else c.dtype
    if c.varlen:
        lengths = [[1, 0, c.s_new, 1][i % 4] for i in range(c.batch)]
        cu = torch.tensor([0] + lengths, device=DEVICE).cumsum(0).int()
        q_shape, k_shape, v_shape = ((sum(lengths), c.h, c.d), (sum(lengths), c.h_kv, c.d),
                                     (sum(lengths), c.h_kv, c.d_v))
        n_new = torch.tensor(lengths, device=DEVICE)
    else:
        sq = -1 if c.sq < 0 else (c.sq or max(c.s_new, 1))
        cu = None
        q_shape = (c.batch, sq, c.h, c.d) if sq > 0 else None
        k_shape, v_shape = (c.batch, c.s_new, c.h_kv, c.d), (c.batch, c.s_new, c.h_kv, c.d_v)
        n_new = torch.full((c.batch,), c.s_new, device=DEVICE)
    capacity = c.s_new + c.slack
    if c.page_size:
        max_pages = -(-capacity // c.page_size)
        capacity = max_pages * c.page_size
    q = fp8_values(q_shape, q_dtype, gen, 1.0) if q_shape is not None else None
    k_new = fp8_values(k_shape, token_dtype, gen, c.amp) if c.s_new else None
    v_new = fp8_values(v_shape, token_dtype, gen, c.amp) if c.s_new else None
    seqlens = (torch.rand(c.batch, device=DEVICE, generator=gen) * (capacity - n_new + 1)).long()
    seqlens[-1] = capacity - n_new[-1]
    leftpad = (torch.rand(c.batch, device=DEVICE, generator=gen) * (seqlens + 1)).int() if c.leftpad else None
    page_table, batch_idx, cache_rows = cache_layout(c, capacity, gen)
    bufs = {}
    bufs["k_cache"], k_cache = guarded(cache_rows + (c.h_kv, c.d), c.cache, gen)
    bufs["v_cache"], v_cache = guarded(cache_rows + (c.h_kv, c.d_v), c.cache, gen)
    cos = sin = None
    if rd:
        cos, sin = rope_tables(capacity + 8, rd, c.dtype)
    has_q = q is not None and (rd > 0 or not c.q_fp8)  # e4m3 q without rotary is not the append's
    q_out = None
    if has_q:
        bufs["q_out"], q_out = guarded(tuple(q.shape), q_dtype, gen, float("nan"))
    bufs["seqused"], seqused = guarded((c.batch,), torch.int32, gen, POISON_INT)
    k_offsets = None
    if (batch_idx is not None or c.leftpad) and not c.page_size:
        bufs["k_offsets"], k_offsets = guarded((c.batch + 1,), torch.int32, gen, POISON_INT)
    qd, kd, vd = descales(c, gen, c.batch)
    t = dict(q=q if has_q else None, k_new=k_new, v_new=v_new, k_cache=k_cache, v_cache=v_cache,
             seqlens=seqlens.int(), page_table=page_table, batch_idx=batch_idx, leftpad=leftpad, cos=cos, sin=sin,
             q_out=q_out, seqused=seqused, k_offsets=k_offsets, cu_q=cu if has_q and c.varlen else None,
             cu_k=cu if k_new is not None and c.varlen else None, qd=qd, kd=kd, vd=vd)
    poison_fp8(t)
    return t, bufs


def fp8_ref_kw(c: Fp8Case, t, **extra):
    return dict(page_table=t["page_table"], cache_batch_idx=t["batch_idx"], cache_leftpad=t["leftpad"],
                rotary_cos=t["cos"], rotary_sin=t["sin"], interleaved=c.rotary == "gptj",
                q_positions_per_query=c.per_query, cu_seqlens_q=t["cu_q"], cu_seqlens_k_new=t["cu_k"],
                q_descale=t["qd"], k_descale=t["kd"], v_descale=t["vd"], **extra)


def poison_fp8(t):
    """NaN bytes into every cache slot the append will write (the reference's placement)."""
    if t["k_new"] is None:
        return
    nan = lambda x: torch.full(x.shape, float("nan"), device=DEVICE)
    kw = dict(page_table=t["page_table"], cache_batch_idx=t["batch_idx"], cu_seqlens_k_new=t["cu_k"])
    _, k_p, v_p, _, _ = kv_append_ref(None, nan(t["k_new"]), nan(t["v_new"]), t["k_cache"], t["v_cache"],
                                      t["seqlens"], **kw)
    t["k_cache"].copy_(k_p)
    t["v_cache"].copy_(v_p)


def token_scales(descale, b, h_kv, group=1):
    """Each token row's descale: ``b`` its sequences (any shape) -> b.shape + (h, 1) fp32."""
    d = torch.ones(1, device=DEVICE) if descale is None else descale.float()
    d = d.reshape(1, 1).expand(int(b.max()) + 1, h_kv) if d.numel() == 1 else d
    return d[b.long()].repeat_interleave(group, dim=-1)[..., None]


def token_batches(c: Fp8Case, t, x, cu):
    """The sequence of every token row of x: (b, s) for dense tokens, (total,) for packed."""
    if cu is None:
        return torch.arange(x.shape[0], device=DEVICE)[:, None].expand(x.shape[0], x.shape[1])
    from flash_attn_cute.testing import varlen_rows_ref

    return varlen_rows_ref(cu, c.batch, x.shape[0])[0]


def expected_fp8(c: Fp8Case, t):
    """References (fp8 and fp32 before the last rounding, stored units) and each written
    value's tolerance eps (module comment) in the layout of the caches / q_out."""
    rd, interleaved = rotary_dim_of(t), c.rotary == "gptj"
    args = (t["q"], t["k_new"], t["v_new"], t["k_cache"], t["v_cache"], t["seqlens"])
    kw = fp8_ref_kw(c, t)
    e = dict(ref8=kv_append_ref(*args, **kw), ref32=kv_append_ref(*args, upcast=True, **kw))
    if t["q"] is not None:
        scale = token_scales(t["qd"], token_batches(c, t, t["q"], t["cu_q"]), c.h_kv, c.h // c.h_kv) if c.q_fp8 \
            else 1.0
        x = t["q"].float() * scale
        e["q_eps"] = 2.0**-21 * pair_magnitude(x, rd, interleaved) / scale + 2.0**-22 * e["ref32"][0].abs()
        e["q_rot"] = (torch.arange(c.d, device=DEVICE) < rd).expand(t["q"].shape)
    if t["k_new"] is not None:
        scale = token_scales(t["kd"], token_batches(c, t, t["k_new"], t["cu_k"]), c.h_kv)
        x = t["k_new"].float() * (scale if c.tokens == "fp8" else 1.0)
        zeros = lambda cache: torch.zeros(cache.shape, device=DEVICE)
        place_kw = dict(page_table=t["page_table"], cache_batch_idx=t["batch_idx"], cu_seqlens_k_new=t["cu_k"],
                        upcast=True)
        place = lambda y: kv_append_ref(None, y, t["v_new"].float(), zeros(t["k_cache"]), zeros(t["v_cache"]),
                                        t["seqlens"], **place_kw)[1]
        e["k_eps"] = 2.0**-21 * place(pair_magnitude(x, rd, interleaved) / scale) + 2.0**-22 * e["ref32"][1].abs()
        indicator = torch.zeros(t["k_new"].shape, device=DEVICE)
        indicator[..., :rd] = 1
        e["k_rot"] = place(indicator) > 0
    return e


def check_fp8(name, out, ref8, ref32, eps, rotated):
    """Bit for bit the reference's fp8 value, or (rotated values only) between the roundings
    of ref32 - eps and ref32 + eps."""
    exact = bits(out) == bits(ref8)
    o = out.float()
    lo, hi = quantize_ref(ref32 - eps, out.dtype).float(), quantize_ref(ref32 + eps, out.dtype).float()
    ok = exact | (rotated & (o >= lo) & (o <= hi))
    if not ok.all():
        idx = tuple(i[0].item() for i in (~ok).nonzero(as_tuple=True))
        raise AssertionError(f"{name}: {(~ok).sum().item()} of {ok.numel()} wrong; first at {idx}: {o[idx].item()} "
                             f"vs reference {ref32[idx].item()} (rounded {ref8[idx].float().item()}, rotated "
                             f"{rotated[idx].item()})")
    # Off the reference's rounding only next to a midpoint: rarely.
    assert (~exact).sum().item() <= max(4, exact.numel() // 1000), (name, (~exact).sum().item())


def verify_fp8(c: Fp8Case, t, e):
    ref8, ref32 = e["ref8"], e["ref32"]
    assert t["seqused"].tolist() == ref8[3].tolist()
    if t["k_offsets"] is not None:
        assert t["k_offsets"].tolist() == ref8[4].tolist()
    if t["q"] is not None:
        if c.q_fp8:
            check_fp8("q_out", t["q_out"], ref8[0], ref32[0], e["q_eps"], e["q_rot"])
        else:
            mag = pair_magnitude(t["q"], rotary_dim_of(t), c.rotary == "gptj")
            check_rotated("q_out", t["q_out"], ref8[0], ref32[0], mag, e["q_rot"])
    none = torch.zeros(t["v_cache"].shape, dtype=torch.bool, device=DEVICE)
    check_fp8("v_cache", t["v_cache"], ref8[2], ref32[2], torch.zeros_like(ref32[2]), none)
    if t["k_new"] is None:
        assert bits(t["k_cache"]).equal(bits(ref8[1])), "k_cache"
    else:
        check_fp8("k_cache", t["k_cache"], ref8[1], ref32[1], e["k_eps"], e["k_rot"])


def launch_fp8(c: Fp8Case, t):
    from flash_attn_cute.kernels.kv_append import append_launcher

    rd = rotary_dim_of(t)
    fp8_tokens = t["k_new"] is not None and t["k_new"].dtype in FP8
    fn = append_launcher(c.dtype, c.d, c.d_v, rd, c.rotary == "gptj", c.per_query, t["q"] is not None,
                         t["k_new"] is not None, t["page_table"] is not None, t["batch_idx"] is not None,
                         t["leftpad"] is not None, varlen=c.varlen, q_dtype=E4M3 if c.q_fp8 else None,
                         new_dtype=c.cache if fp8_tokens else None, cache_dtype=c.cache)
    qd = kernel_view(t["qd"], c.batch, c.h_kv) if c.q_fp8 and t["q"] is not None else None
    kd, vd = (kernel_view(t["kd"], c.batch, c.h_kv), kernel_view(t["vd"], c.batch, c.h_kv)) \
        if t["k_new"] is not None else (None, None)
    fn(t["q"], t["k_new"], t["v_new"], t["k_cache"], t["v_cache"], t["seqlens"], t["page_table"], t["batch_idx"],
       t["leftpad"], t["cos"], t["sin"], t["q_out"], t["seqused"], t["k_offsets"], t["cu_q"], t["cu_k"], qd, kd, vd)


FP8_CASES = [
    Fp8Case(),  # bf16 decode into e4m3, GPT-NeoX over all of d, per (batch, head) descales
    Fp8Case(cache=E5M2, dtype=torch.float16, d=64, d_v=128, rotary="gptj", rotary_dim=32, s_new=37, page_size=16),
    Fp8Case(tokens="fp8", rotary_dim=64, page_size=1, s_new=5),  # fp8 k requantized after rotary, v copied
    Fp8Case(tokens="fp8", rotary="none", page_size=64, s_new=70, sq=-1),  # copies only
    Fp8Case(cache=E5M2, tokens="fp8", rotary="gptj", batch_idx=True, leftpad=True, s_new=3),
    Fp8Case(rotary="none", leftpad=True, descale="tensor", s_new=9),  # one broadcast descale
    Fp8Case(descale="none", page_size=16, leftpad=True, s_new=2, per_query=False),  # None: 1.0
    Fp8Case(amp=1000.0, s_new=8),  # most values past 448 x descale: saturated at 448, never NaN
    Fp8Case(cache=E5M2, amp=1000.0, rotary="none", s_new=8),
    Fp8Case(q_fp8=True, tokens="fp8", rotary="gptj", page_size=16, s_new=4, h=8, h_kv=2),  # FP8 attention
    Fp8Case(q_fp8=True, rotary_dim=64, s_new=2, sq=3),  # e4m3 q, bf16 tokens quantized
    Fp8Case(varlen=True, batch=9, s_new=40, page_size=16, rotary="gptj"),
    Fp8Case(varlen=True, batch=6, s_new=11, tokens="fp8", q_fp8=True, batch_idx=True, leftpad=True),
    Fp8Case(varlen=True, batch=5, s_new=7, cache=E5M2, leftpad=True, page_size=64, rotary="none"),
]


def fp8_id(c):
    fields = {f: getattr(c, f) for f in c.__dataclass_fields__}
    base = Fp8Case()
    changed = [f"{k}={str(v).replace('torch.', '')}" for k, v in fields.items() if v != getattr(base, k)]
    return "-".join(changed) or "default"


@needs_fp8
@pytest.mark.parametrize("case", FP8_CASES, ids=fp8_id)
def test_append_fp8(case):
    t, bufs = build_fp8(case)
    e = expected_fp8(case, t)
    before = {name: buf.clone() for name, buf in bufs.items()}
    launch_fp8(case, t)
    torch.cuda.synchronize()
    check_guards(before, bufs)
    verify_fp8(case, t, e)
    if case.amp > 100 and case.cache == E4M3:
        stored = t["k_cache"].float()
        assert (stored.abs() == 448).any() and not torch.isnan(stored[e["k_rot"] | ~e["k_rot"]]).any()


# ---------------------------------------------------------------------------------------
# End to end: flash_attn_with_kvcache appends (quantizing into an FP8 cache), then attends;
# cache_leftpad over a paged cache; the cache_batch_idx bound check
# ---------------------------------------------------------------------------------------


def _api():
    import flash_attn_cute

    return flash_attn_cute


def _backends():
    from flash_attn_cute.testing import backends_on_this_gpu

    return backends_on_this_gpu()


def sequence_rows(cache, page_table, batch_idx, batch):
    """(batch, capacity, h_kv, d*) per-sequence view of a cache (fp8 gathered as bytes)."""
    from flash_attn_cute.testing import gather_paged_kv

    raw = cache.view(torch.uint8) if cache.dtype in FP8 else cache
    if page_table is not None:
        x = gather_paged_kv(raw, page_table)
    elif batch_idx is not None:
        x = raw[batch_idx.long()]
    else:
        x = raw[:batch]
    return x.view(cache.dtype) if cache.dtype in FP8 else x


def dequantized(x8, descale):
    """fp32 values of per-sequence fp8 rows (batch, s, h_kv, d) with a (batch, h_kv) / one
    element / None descale."""
    from flash_attn_cute.testing import dequantize_kv

    return x8.float() if descale is None else dequantize_kv(x8, descale)


def attend_ref(q, k, v, ends, leftpad, cu_q, **kw):
    """(out, lse) of q (dense, or packed with ``cu_q``) over per-sequence keys (batch, cap, h_kv,
    d*): sequence b's keys are positions [leftpad[b], ends[b]) (leftpad None: 0)."""
    from flash_attn_cute.testing import attention_kvcache_ref, attention_serving_ref

    if cu_q is None:
        return attention_kvcache_ref(q, k, v, ends, cache_leftpad=leftpad, **kw)
    if leftpad is not None:
        cap = k.shape[1]
        rows = (leftpad.long()[:, None] + torch.arange(cap, device=k.device)[None]).clamp(max=cap - 1)
        take = lambda c: torch.gather(c, 1, rows[:, :, None, None].expand(-1, -1, *c.shape[2:]))
        k, v, ends = take(k), take(v), ends - leftpad.long()
    return attention_serving_ref(q, k, v, cu_seqlens_q=cu_q, seqused_k=ends.int(), **kw)


def new_counts(c, t):
    if t["k_new"] is None:
        return torch.zeros(c.batch, dtype=torch.long, device=DEVICE)
    if t["cu_k"] is not None:
        return (t["cu_k"][1:] - t["cu_k"][:-1]).long()
    return torch.full((c.batch,), t["k_new"].shape[1], dtype=torch.long, device=DEVICE)


E2E_FP8 = [
    dict(causal=True, num_splits=0),
    dict(cache=E5M2, dtype=torch.float16, page_size=16, rotary="gptj", s_new=4, causal=True, num_splits=3),
    dict(tokens="fp8", page_size=1, rotary_dim=64, s_new=2, causal=False, num_splits=0),
    dict(page_size=64, rotary="none", s_new=70, causal=True, num_splits=1),  # a prefill chunk
    dict(batch_idx=True, leftpad=True, rotary="gptj", s_new=3, causal=True, num_splits=0),
    dict(varlen=True, batch=9, s_new=40, page_size=16, tokens="fp8", causal=True, num_splits=0),
    dict(page_size=16, leftpad=True, s_new=3, causal=True, num_splits=3),  # paged leftpad over FP8 pages
    dict(page_size=128, leftpad=True, s_new=1, causal=False, num_splits=0, descale="tensor"),
    dict(q_fp8=True, tokens="fp8", rotary="gptj", page_size=64, s_new=4, causal=True, num_splits=0),
    dict(q_fp8=True, s_new=2, sq=2, causal=False, num_splits=3, descale="tensor"),
]


def e2e_id(cfg):
    return "-".join(f"{k}={str(v).replace('torch.', '')}" for k, v in cfg.items())


@needs_fp8
@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("cfg", E2E_FP8, ids=e2e_id)
def test_fp8_append_then_attend(backend, cfg):
    """The stored bytes as the kernel-level tests require them (``verify_fp8``: exact but
    next to rounding midpoints of rotated values), then the attention over what was stored:
    within 2x PyTorch's own error on the dequantized cache (FP8 attention, and 16-bit
    queries the SM90 kernel quantizes over an e4m3 cache: 3x that of the same FP8 algorithm
    in PyTorch on the same quantized queries, as in test_fp8_attention_gpu)."""
    causal, num_splits = cfg["causal"], cfg["num_splits"]
    c = Fp8Case(**{k: v for k, v in cfg.items() if k not in ("causal", "num_splits")}, per_query=causal, h=8,
                slack=300)
    t, bufs = build_fp8(c, seed=1)
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    q = t["q"]
    if q is None:  # e4m3 q without rotary: not the append's, the attention's only
        q = fp8_values((c.batch, max(c.sq, c.s_new, 1), c.h, c.d), E4M3, gen, 1.0)
    e = expected_fp8(c, t)
    out_dtype = torch.bfloat16 if c.q_fp8 else c.dtype
    out = torch.full((*q.shape[:-1], c.d_v), float("nan"), dtype=out_dtype, device=DEVICE)
    before = {name: bufs[name].clone() for name in ("k_cache", "v_cache")}
    cu = t["cu_k"] if c.varlen else None
    from flash_attn_cute.testing import any_quantized_q, recorded_plans

    with recorded_plans() as plans:
        res = _api().flash_attn_with_kvcache(
            q, t["k_cache"], t["v_cache"], k=t["k_new"], v=t["v_new"], rotary_cos=t["cos"], rotary_sin=t["sin"],
            cache_seqlens=t["seqlens"], cache_batch_idx=t["batch_idx"], cache_leftpad=t["leftpad"],
            page_table=t["page_table"], cu_seqlens_q=cu, max_seqlen_q=c.s_new if c.varlen else None,
            rotary_interleaved=c.rotary == "gptj", q_descale=t["qd"], k_descale=t["kd"], v_descale=t["vd"],
            causal=causal, num_splits=num_splits, return_lse=True, out=out, backend=backend)
    torch.cuda.synchronize()
    quantized_q = any_quantized_q(plans)
    assert res[0] is out
    check_guards(before, {name: bufs[name] for name in before})
    none = torch.zeros(t["v_cache"].shape, dtype=torch.bool, device=DEVICE)
    check_fp8("v_cache", t["v_cache"], e["ref8"][2], e["ref32"][2], torch.zeros_like(e["ref32"][2]), none)
    check_fp8("k_cache", t["k_cache"], e["ref8"][1], e["ref32"][1], e["k_eps"], e["k_rot"])
    # The attention over the stored cache, the queries rotated as the reference rotates them.
    q_att = e["ref8"][0] if t["q"] is not None else q
    rows = lambda cache: sequence_rows(cache, t["page_table"], t["batch_idx"], c.batch)
    k, v = dequantized(rows(t["k_cache"]), t["kd"]), dequantized(rows(t["v_cache"]), t["vd"])
    capacity = k.shape[1]
    ends = (t["seqlens"].long() + new_counts(c, t)).clamp(max=capacity)
    kw = dict(causal=causal)
    if c.q_fp8:
        bq = token_batches(c, t, q_att, cu)
        q32 = q_att.float() * token_scales(t["qd"], bq, c.h_kv, c.h // c.h_kv)
        out_ref, lse_ref = attend_ref(q32, k, v, ends, t["leftpad"], cu, **kw)
        out_pt, _ = attend_ref(q32, k, v, ends, t["leftpad"], cu, p_fp8=True, **kw)
        bf = lambda x: x.to(torch.bfloat16)
        _, lse_pt = attend_ref(bf(q32), bf(k), bf(v), ends, t["leftpad"], cu, upcast=False, **kw)
        mult = 3.0
    elif quantized_q:
        from flash_attn_cute.testing import attended_q

        # the queries the kernel attends with: a mixed plan's prefill rows are not quantized
        qq = attended_q(q_att, plans, cu)
        out_ref, lse_ref = attend_ref(qq, k, v, ends, t["leftpad"], cu, **kw)
        out_pt, _ = attend_ref(qq, k, v, ends, t["leftpad"], cu, p_fp8=True, **kw)
        bf = lambda x: x.to(torch.bfloat16)
        _, lse_pt = attend_ref(bf(qq), bf(k), bf(v), ends, t["leftpad"], cu, upcast=False, **kw)
        mult = 3.0
    else:
        out_ref, lse_ref = attend_ref(q_att.float(), k, v, ends, t["leftpad"], cu, **kw)
        lo = lambda x: x.to(c.dtype)
        out_pt, lse_pt = attend_ref(q_att, lo(k), lo(v), ends, t["leftpad"], cu, upcast=False, **kw)
        mult = 2.0
    from flash_attn_cute.testing import check_close, check_lse

    check_close(out, out_ref, out_pt, mult=mult)
    check_lse(res[1], lse_ref, lse_pt, mult=mult)


def verify_caches(c, t, e):
    """The caches after an append (16-bit): v bit for bit, k within the rotary bound."""
    ref16, ref32 = e["ref16"], e["ref32"]
    assert bits(t["v_cache"]).equal(bits(ref16[2])), "v_cache"
    if e["k_mag"] is None:
        assert bits(t["k_cache"]).equal(bits(ref16[1])), "k_cache"
    else:
        check_rotated("k_cache", t["k_cache"], ref16[1], ref32[1], e["k_mag"], e["k_rot"])


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("page_size", [1, 16, 64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("append", [False, True])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_leftpad(backend, page_size, causal, append, num_splits):
    """cache_leftpad over a paged cache (FA3's leftpad_k): sequence b's keys are cache
    positions [leftpad[b], end) of its pages, key j at leftpad[b] + j, the masks aligned to
    the bottom-right of end - leftpad; the new tokens at cache_seqlens[b] + t, rotated at
    that absolute position. Starts at 0, mid-page, a page boundary plus a few, and at the
    end (no key without an append: out 0, lse -inf)."""
    c = Case(page_size=page_size, leftpad=True, s_new=3 if append else 0, sq=3, per_query=causal, h=8, h_kv=2,
             batch=5, slack=400, rotary="neox" if append else "none")
    t, bufs = build(c, seed=7)
    lens = t["seqlens"]
    lp = (torch.rand(c.batch, device=DEVICE) * (lens + 1).float()).int()
    lp[0], lp[1] = 0, lens[1]
    lp[2] = min(int(lens[2]), page_size + 3)
    t["leftpad"] = lp
    e = expected(c, t)
    out = torch.full((*t["q"].shape[:-1], c.d_v), float("nan"), dtype=c.dtype, device=DEVICE)
    before = {name: bufs[name].clone() for name in ("k_cache", "v_cache")}
    res = _api().flash_attn_with_kvcache(
        t["q"], t["k_cache"], t["v_cache"], k=t["k_new"], v=t["v_new"], rotary_cos=t["cos"], rotary_sin=t["sin"],
        cache_seqlens=lens, cache_leftpad=lp, page_table=t["page_table"], causal=causal, num_splits=num_splits,
        rotary_interleaved=False, return_lse=True, out=out, backend=backend)
    torch.cuda.synchronize()
    check_guards(before, {name: bufs[name] for name in before})
    verify_caches(c, t, e)
    q_att = e["ref16"][0]
    ends = lens.long() + c.s_new
    from flash_attn_cute.testing import attention_kvcache_ref, check_close, check_lse

    kw = dict(page_table=t["page_table"], cache_leftpad=lp, causal=causal)
    out_ref, lse_ref = attention_kvcache_ref(q_att.float(), e["ref16"][1], e["ref16"][2], ends, **kw)
    out_pt, lse_pt = attention_kvcache_ref(q_att, e["ref16"][1], e["ref16"][2], ends, upcast=False, **kw)
    check_close(res[0], out_ref, out_pt)
    check_lse(res[1], lse_ref, lse_pt)
    if not append:
        assert torch.isinf(res[1][1]).all() and (res[0][1] == 0).all()  # leftpad == length: no key


@pytest.mark.parametrize("backend", _backends())
def test_paged_leftpad_varlen_mixed_step(backend):
    """A serving step over pages with cache_leftpad: packed queries that are the new tokens
    (decode rows and chunks of up to 600: a mixed plan, two launches), split-KV on the
    decode part, the same starts for both launches."""
    c = VarlenCase(page_size=16, leftpad=True, h=8, h_kv=2, rotary="neox", slack=200)
    t, bufs = build_varlen(c, seed=3)
    e = expected(c, t)
    out = torch.full((*t["q"].shape[:-1], c.d_v), float("nan"), dtype=c.dtype, device=DEVICE)
    res = _api().flash_attn_with_kvcache(
        t["q"], t["k_cache"], t["v_cache"], k=t["k_new"], v=t["v_new"], rotary_cos=t["cos"], rotary_sin=t["sin"],
        cache_seqlens=t["seqlens"], cache_leftpad=t["leftpad"], page_table=t["page_table"], cu_seqlens_q=t["cu_q"],
        cu_seqlens_k_new=t["cu_k"], max_seqlen_q=int((t["cu_q"][1:] - t["cu_q"][:-1]).max()), causal=True,
        rotary_interleaved=False, return_lse=True, out=out, num_splits=0, backend=backend)
    torch.cuda.synchronize()
    verify_caches(c, t, e)
    from flash_attn_cute.testing import check_close, check_lse

    rows = lambda cache: sequence_rows(cache, t["page_table"], None, c.batch)
    ends = t["seqlens"].long() + (t["cu_k"][1:] - t["cu_k"][:-1]).long()
    k, v = rows(e["ref16"][1]), rows(e["ref16"][2])
    out_ref, lse_ref = attend_ref(e["ref16"][0].float(), k.float(), v.float(), ends, t["leftpad"], t["cu_q"],
                                  causal=True)
    out_pt, lse_pt = attend_ref(e["ref16"][0], k, v, ends, t["leftpad"], t["cu_q"], causal=True, upcast=False)
    check_close(res[0], out_ref, out_pt)
    check_lse(res[1], lse_ref, lse_pt)


@pytest.mark.parametrize("backend", _backends())
def test_cache_batch_idx_bound_check(backend):
    """check_cache_bounds refuses a cache_batch_idx entry outside [0, batch_cache) naming it,
    before anything is written; unchecked, the kernel clamps it into the cache (the row
    then writes the last cache row), nothing outside the cache is written."""
    c = Case(batch_idx=True, s_new=2, sq=2, h=8, h_kv=2)  # batch 3, batch_cache 5
    t, bufs = build(c, seed=4)
    api = _api()
    call = lambda **kw: api.flash_attn_with_kvcache(
        t["q"], t["k_cache"], t["v_cache"], k=t["k_new"], v=t["v_new"], rotary_cos=t["cos"], rotary_sin=t["sin"],
        cache_seqlens=t["seqlens"], rotary_interleaved=False, causal=True, backend=backend, **kw)
    before = {name: buf.clone() for name, buf in bufs.items()}
    for bad, shown in (([0, 5, 1], 5), ([-3, 2, 1], -3)):
        with pytest.raises(ValueError, match=rf"cache_batch_idx entries must lie in \[0, batch_cache = 5\).* got "
                                             rf"{shown} "):
            call(cache_batch_idx=torch.tensor(bad, dtype=torch.int32, device=DEVICE), check_cache_bounds=True)
    torch.cuda.synchronize()
    for name in ("k_cache", "v_cache"):
        assert bits(bufs[name]).equal(bits(before[name])), f"{name} written before the refusal"
    call(cache_batch_idx=t["batch_idx"], check_cache_bounds=True)  # in range: runs
    t["batch_idx"] = torch.tensor([0, 99, 1], dtype=torch.int32, device=DEVICE)  # 99 -> row 4
    poison_slots(t, c)
    e = expected(c, t)
    before = {name: bufs[name].clone() for name in ("k_cache", "v_cache")}
    call(cache_batch_idx=t["batch_idx"])
    torch.cuda.synchronize()
    check_guards(before, {name: bufs[name] for name in before})
    verify_caches(c, t, e)


@needs_fp8
@pytest.mark.parametrize("backend", _backends())
def test_fp8_append_cuda_graph(backend):
    """A decode step appending into an FP8 paged cache, captured once (no host sync allowed)
    and replayed with new lengths and tokens: each replay leaves the cache and the output
    an eager call on a copy of the same state gives, bit for bit."""
    c = Fp8Case(page_size=16, s_new=1, h=8, slack=200)
    t, _ = build_fp8(c, seed=5)
    api = _api()
    out = torch.empty((*t["q"].shape[:-1], c.d_v), dtype=c.dtype, device=DEVICE)

    def step(k_cache, v_cache, out):
        return api.flash_attn_with_kvcache(
            t["q"], k_cache, v_cache, k=t["k_new"], v=t["v_new"], rotary_cos=t["cos"], rotary_sin=t["sin"],
            cache_seqlens=t["seqlens"], page_table=t["page_table"], k_descale=t["kd"], v_descale=t["vd"],
            causal=True, out=out, backend=backend)

    step(t["k_cache"], t["v_cache"], out)  # compile / load outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            step(t["k_cache"], t["v_cache"], out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    gen = torch.Generator(device=DEVICE).manual_seed(6)
    for _ in range(3):
        t["seqlens"].add_(1)
        t["q"].copy_(torch.randn(t["q"].shape, device=DEVICE, generator=gen).to(c.dtype))
        t["k_new"].copy_(torch.randn(t["k_new"].shape, device=DEVICE, generator=gen).to(c.dtype))
        t["v_new"].copy_(torch.randn(t["v_new"].shape, device=DEVICE, generator=gen).to(c.dtype))
        k_copy, v_copy = t["k_cache"].clone(), t["v_cache"].clone()
        graph.replay()
        eager = step(k_copy, v_copy, None)
        torch.cuda.synchronize()
        assert bits(out).equal(bits(eager))
        assert bits(t["k_cache"]).equal(bits(k_copy)) and bits(t["v_cache"]).equal(bits(v_copy))
