"""CPU tests of MLA decode's device-computed split schedule (``host/mla_schedule.py``,
``kernels/mla_schedule.py``; ``get_mla_metadata`` / ``scheduler_metadata=``): the reference
schedule's bounds and coverage, the SM90 plan and compile key it selects, the run path's
tensors (partials beside the output, the combine's slots), validation; no GPU (the GPU
file ``test_mla_schedule_gpu.py`` checks the kernel's tensor against the reference)."""

import random
from types import SimpleNamespace

import pytest
import torch

from flash_attn_cute import flash_mla_decode, seam
from flash_attn_cute.host import mla_schedule as ms
from flash_attn_cute.mla import MlaProblem

BF16 = torch.bfloat16


def _lengths(seed, batch, top):
    rng = random.Random(seed)
    shape = rng.choice(["uniform", "skewed", "one_long", "empty"])
    if shape == "uniform":
        return [top] * batch
    if shape == "one_long":
        return [top] + [rng.randint(0, 100) for _ in range(batch - 1)]
    if shape == "empty":
        return [0] * batch
    return [rng.randint(0, top) for _ in range(batch)]


@pytest.mark.parametrize("seed", range(40))
def test_reference_schedule_bounds_and_coverage(seed):
    rng = random.Random(1000 + seed)
    batch, parts = rng.randint(1, 300), rng.randint(1, 254)
    capacity = rng.choice([64, 4096, 2**31 - 1])
    seqlens = _lengths(seed, batch, rng.choice([1, 64, 5000, 40000]))
    items, info = ms.reference_schedule(seqlens, capacity, parts)
    assert len(items) == ms.max_items(parts, batch) and len(info) == batch
    live = [it for it in items if it[0] >= 0]
    assert all(it == (-1, 0, 0, -1) for it in items[len(live):])  # live items first
    slots = [it[3] for it in live if it[3] >= 0]
    assert sorted(slots) == list(range(len(slots))) and len(slots) <= ms.max_slots(parts)
    for b, n in enumerate(seqlens):
        blocks = -(-min(n, capacity) // ms.TILE_N)
        pieces = [it for it in live if it[0] == b]
        base, count = info[b]
        assert count == len(pieces) >= 1 and count <= parts + 1
        # the pieces cover [0, blocks) in order, none empty unless the sequence is
        assert pieces[0][1] == 0 and pieces[-1][2] == blocks
        assert all(p[2] == q[1] for p, q in zip(pieces, pieces[1:]))
        assert all(p[2] > p[1] for p in pieces) or blocks == 0
        # one piece: the output itself; several: consecutive slots from base
        assert [p[3] for p in pieces] == ([-1] if count == 1 else list(range(base, base + count)))
    # balance: no piece over the chunk (ceil of the batch's cost over the parts)
    chunk = max(-(-sum(-(-min(n, capacity) // 64) + ms.OVERHEAD_BLOCKS for n in seqlens) // parts), ms.MIN_BLOCKS)
    assert all(hi - lo <= chunk for _, lo, hi, _ in live)


def test_uniform_rows_plan_as_the_host():
    # the benchmark's uniform rows: the schedule cuts them as the host heuristic splits them
    for batch, keys, heads, pieces in ((64, 1024, 64, 2), (128, 2048, 64, 1), (64, 2048, 64, 2), (1, 32768, 64, 128)):
        parts = ms.schedule_parts(132, -(-heads // 64))
        items, info = ms.reference_schedule([keys] * batch, 2**31 - 1, parts)
        assert {count for _, count in info} == {pieces}


def test_numel_round_trip():
    for parts in (1, 66, 132, 255):
        for batch in (1, 7, 1000):
            assert ms.parts_of(ms.schedule_numel(parts, batch), batch) == parts
    assert ms.parts_of(6 * 4, 4) == -1 and ms.parts_of(6 * 4 + 3, 4) == -1
    assert ms.schedule_parts(132, 1) == 132 and ms.schedule_parts(132, 2) == 66 and ms.schedule_parts(500, 1) == 255
    assert ms.schedule_parts(132, 400) == 1


def _problem(**kw):
    base = dict(dtype=BF16, batch=8, max_seqlen_q=1, max_seqlen_k=8192, nheads=64, page_size=64, softmax_scale=0.1,
                causal=False, has_lse=False, schedule_parts=132)
    return MlaProblem(**{**base, **kw})


def test_sm90_plan_and_key():
    sm90 = seam.backend_module("sm90", "mla")
    p = _problem()
    plan = sm90.plan(p, 0, None, 132)
    assert plan.scheduled and plan.is_split and plan.num_splits == ms.max_slots(132)
    key = sm90.compile_key(p, plan, "sm_90a")
    assert key[5] == "schedule" and key[6] is False  # the final LSE only when asked for
    assert sm90.compile_key(p._replace(has_lse=True), plan, "sm_90a")[6] is True
    # host-planned where the schedule does not apply: other page sizes, explicit splits,
    # batch invariance, context parallelism
    for other, splits in ((p._replace(page_size=16), 0), (p, 3), (p._replace(batch_invariant=True), 0),
                          (p._replace(cp=True, causal=True), 0), (p._replace(schedule_parts=0), 0)):
        assert not sm90.plan(other, splits, None, 132).scheduled
    assert not seam.backend_module("sm80", "mla").plan(p, 0, None, 132).scheduled


def test_scheduled_run_path(fake_device, monkeypatch):
    """The kernel gets out / lse and the fp32 partials (slots, batch, ...) of batch stride 0
    beside them, and the combine the (batch, 2) slots at the schedule's tail."""
    launched, combined = [], []
    sm90 = seam.backend_module("sm90", "mla")
    fake = SimpleNamespace(AUTO=True, runs_on=lambda cap: True, check=lambda p: None, plan=sm90.plan,
                           launcher=lambda problem, plan, device=None: (lambda t: launched.append((plan, t))))
    fake_device(lambda name, kind="fwd": fake)
    monkeypatch.setattr(seam, "combine_launcher", lambda *a, split_info=False, **kw: (
        lambda *t: combined.append((split_info, t))))
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    b, h, parts = 3, 64, 132
    q, qp = torch.randn(b, 1, h, 512).to(BF16), torch.randn(b, 1, h, 64).to(BF16)
    ckv, kpe = torch.randn(20, 64, 512).to(BF16), torch.randn(20, 64, 64).to(BF16)
    lens, table = torch.tensor([5, 700, 0], dtype=torch.int32), torch.zeros(b, 4, dtype=torch.int32)
    schedule = torch.zeros(ms.schedule_numel(parts, b), dtype=torch.int32)
    results = [flash_mla_decode(q, qp, ckv, kpe, lens, table, scheduler_metadata=schedule, return_lse=True)
               for _ in range(2)]  # the second call replays the per-call cache
    assert len(launched) == len(combined) == 2
    for (plan, t), (split_info, c), (out, lse) in zip(launched, combined, results):
        assert plan.scheduled and split_info
        assert t.out is out and t.lse is lse and t.schedule is schedule
        assert t.o_partial.shape == (ms.max_slots(parts), b, 1, h, 512) and t.o_partial.stride(1) == 0
        assert t.lse_partial.shape == (ms.max_slots(parts), b, h, 1) and t.lse_partial.stride(1) == 0
        assert c[0] is t.o_partial and c[2] is out and c[3] is lse and c[4] is None
        info = c[5]
        assert info.shape == (b, 2) and info.data_ptr() == schedule.data_ptr() + 4 * 4 * ms.max_items(parts, b)
    # without a schedule: the host's plan, no schedule tensor
    flash_mla_decode(q, qp, ckv, kpe, lens, table)
    assert not launched[-1][0].scheduled and launched[-1][1].schedule is None
    # pages of 16 with a schedule: the gathering kernel, which plans on the host (schedule dropped)
    flash_mla_decode(q, qp, torch.randn(80, 16, 512).to(BF16), torch.randn(80, 16, 64).to(BF16), lens,
                     torch.zeros(b, 16, dtype=torch.int32), scheduler_metadata=schedule)
    assert not launched[-1][0].scheduled and launched[-1][1].schedule is None


def test_schedule_validation(fake_device):
    b = 2
    args = (torch.randn(b, 1, 16, 512).to(BF16), torch.randn(b, 1, 16, 64).to(BF16),
            torch.randn(4, 64, 512).to(BF16), torch.randn(4, 64, 64).to(BF16), torch.full((b,), 5, dtype=torch.int32),
            torch.zeros(b, 2, dtype=torch.int32))
    with pytest.raises(TypeError, match="scheduler_metadata must be the int32 tensor"):
        flash_mla_decode(*args, scheduler_metadata=torch.zeros(ms.schedule_numel(4, b), dtype=torch.int64))
    for numel in (5, ms.schedule_numel(ms.MAX_SPLITS, b)):  # no schedule's size; too many parts
        with pytest.raises(ValueError, match="not a get_mla_metadata schedule for a batch of 2"):
            flash_mla_decode(*args, scheduler_metadata=torch.zeros(numel, dtype=torch.int32))
