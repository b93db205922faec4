"""GPU tests of the KV-append + rotary kernel (flash_attn_cute/kv_append.py) against the fp32
references of flash_attn_cute.testing (``kv_append_ref``; those are checked on CPU in
tests/test_kv_append_compile.py).

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

from flash_attn_cute.testing import kv_append_ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEVICE = "cuda"
GUARD = 512  # elements on each side of every cache and output (a multiple of 16 bytes)
POISON_INT = -7


def launch(q, k_new, v_new, k_cache, v_cache, seqlens, page_table, batch_idx, leftpad, cos, sin, q_out, seqused,
           k_offsets, cu_q=None, cu_k=None, *, interleaved, per_query):
    from flash_attn_cute.kv_append import append_launcher

    rotary_dim = 0 if cos is None else 2 * cos.shape[1]
    fn = append_launcher(k_cache.dtype, k_cache.shape[-1], v_cache.shape[-1], rotary_dim, interleaved, per_query,
                         q is not None, k_new is not None, page_table is not None, batch_idx is not None,
                         leftpad is not None, varlen=cu_q is not None or cu_k is not None)
    fn(q, k_new, v_new, k_cache, v_cache, seqlens, page_table, batch_idx, leftpad, cos, sin, q_out, seqused,
       k_offsets, cu_q, cu_k)


def guarded(shape, dtype, gen, fill=None):
    """(buffer, view): a view of ``shape`` inside a random buffer, GUARD elements of
    margin on each side; the view is filled with ``fill`` when given."""
    n = math.prod(shape)
    if dtype.is_floating_point:
        buf = torch.randn(n + 2 * GUARD, dtype=dtype, device=DEVICE, generator=gen)
    else:
        buf = torch.randint(-1000, 1000, (n + 2 * GUARD,), dtype=dtype, device=DEVICE, generator=gen)
    view = buf[GUARD:GUARD + n].view(shape)
    if fill is not None:
        view.fill_(fill)
    return buf, view


def check_guards(before, bufs):
    for name, buf in bufs.items():
        assert bits(buf[:GUARD]).equal(bits(before[name][:GUARD])), f"{name}: written before its start"
        assert bits(buf[-GUARD:]).equal(bits(before[name][-GUARD:])), f"{name}: written past its end"


def bits(x):
    return x.view(torch.int16) if x.element_size() == 2 else x.view(torch.int32)


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
    page_table = batch_idx = None
    if c.page_size:
        num_pages = c.batch * max_pages + 5
        page_table = torch.randperm(num_pages, device=DEVICE, generator=gen)[:c.batch * max_pages]
        page_table = page_table.view(c.batch, max_pages).int()
        cache_rows = (num_pages, c.page_size)
    else:
        b_cache = c.batch + 2 if c.batch_idx else c.batch
        if c.batch_idx:
            batch_idx = torch.randperm(b_cache, device=DEVICE, generator=gen)[:c.batch].int()
        cache_rows = (b_cache, capacity)
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
    if batch_idx is not None or c.leftpad:
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
    page_table = batch_idx = None
    if c.page_size:
        num_pages = c.batch * max_pages + 5
        page_table = torch.randperm(num_pages, device=DEVICE, generator=gen)[:c.batch * max_pages]
        page_table = page_table.view(c.batch, max_pages).int()
        cache_rows = (num_pages, c.page_size)
    else:
        b_cache = c.batch + 2 if c.batch_idx else c.batch
        if c.batch_idx:
            batch_idx = torch.randperm(b_cache, device=DEVICE, generator=gen)[:c.batch].int()
        cache_rows = (b_cache, capacity)
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
    if c.batch_idx or c.leftpad:
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
