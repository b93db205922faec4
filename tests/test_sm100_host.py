"""CPU tests of the SM100 backend: planning (q_stage, splits, packing) and resource budgets
(TMEM columns, shared memory, registers). No GPU. Its kernels are compiled for sm_100a and
their SASS checked (tcgen05 MMAs, TMEM loads/stores, TMA) by tests/test_fwd_compile.py."""

import pytest
import torch

from flash_attn_cute import seam, sm100
from flash_attn_cute.host import heuristics, keys
from flash_attn_cute.sm100.config import (SMEM_LIMIT, TILE_M, TMEM_COLUMNS, WarpRoles, kv_stages_for, smem_bytes,
                                          tmem_alloc_columns, tmem_columns)

ARCH = "sm_100a"


def _problem(**kw):
    base = dict(dtype=torch.bfloat16, batch=2, max_seqlen_q=1024, max_seqlen_k=1024, nheads=8, nheads_kv=8, d=128,
                d_v=128, softmax_scale=0.1, causal=False, window_left=-1, window_right=-1, softcap=0.0,
                varlen_q=False, varlen_k=False, has_seqused_k=False, page_size=0, has_lse=True)
    return seam.FwdProblem(**{**base, **kw})


# ---------------------------------------------------------------------------------------
# The seam
# ---------------------------------------------------------------------------------------


def test_module_exposes_the_seam():
    assert sm100.NAME == "sm100"
    for name in ("HEAD_DIM_PAIRS", "check", "plan", "compile_key", "compile", "launcher"):
        assert hasattr(sm100, name), name


@pytest.mark.parametrize("d,dv,tile", [(64, 64, (64, 64)), (128, 128, (128, 128)), (192, 128, (192, 128)),
                                       (96, 96, (128, 128)), (128, 64, (128, 128)), (40, 40, (64, 64)),
                                       (160, 120, (192, 128)), (8, 8, (64, 64))])
def test_check_accepts_head_dims_its_tiles_hold(d, dv, tile):
    """Any head dims inside one of the kernel's tiles run on the smallest, padded."""
    from flash_attn_cute.seam.backend_kit import tile_head_dims

    assert sm100.check(_problem(d=d, d_v=dv)) is None
    assert tile_head_dims(_problem(d=d, d_v=dv), sm100.HEAD_DIM_PAIRS) == tile


@pytest.mark.parametrize("d,dv", [(256, 256), (192, 192), (200, 128), (64, 136)])
def test_check_refuses_other_head_dims(d, dv):
    reason = sm100.check(_problem(d=d, d_v=dv))
    assert reason is not None and "(192, 128)" in reason


@pytest.mark.parametrize("page_size", [1, 8, 24, 40])
def test_check_refuses_pages_no_tma_box_reads(page_size):
    # Pages TMA boxes of 16 rows at least cannot read (row gathers): the SM80 kernel runs them.
    reason = sm100.check(_problem(page_size=page_size, has_seqused_k=True))
    assert reason is not None and "page_size" in reason and "multiple of 16" in reason


@pytest.mark.parametrize("page_size,kv_box", [(16, 16), (32, 32), (48, 16), (64, 64), (96, 32), (128, 0), (256, 0),
                                              (384, 0)])
def test_pages_read_in_boxes_or_whole_blocks(page_size, kv_box):
    # A page of a multiple of 128 keys holds whole KV blocks (one TMA each, the block's page
    # and sub-block from the table); other multiples of 16 are read in boxes of the largest
    # of 64, 32, 16 rows dividing the page, a key field of their own ("kv_box16").
    p = _problem(page_size=page_size, has_seqused_k=True)
    assert sm100.check(p) is None
    plan = sm100.plan(p, 1, None, 148)
    assert plan.config.kv_box == kv_box
    key = sm100.compile_key(p, plan, "sm_100a")
    assert (f"kv_box{kv_box}" in key) == (kv_box > 0)
    if kv_box == 0:  # whole blocks: the key of pages of 128
        assert key == sm100.compile_key(p._replace(page_size=128), sm100.plan(p._replace(page_size=128), 1, None,
                                                                                 148), "sm_100a")
    assert sm100.plan(_problem(), 1, None, 148).config.kv_box == 0  # not paged


def test_check_refuses_fp32():
    assert "dtype" in sm100.check(_problem(dtype=torch.float32))


# ---------------------------------------------------------------------------------------
# q_stage
# ---------------------------------------------------------------------------------------


def test_q_stage_prefill_is_2():
    plan = sm100.plan(_problem(max_seqlen_q=4096, max_seqlen_k=4096), 1, None, 148)
    assert plan.config.q_stage == 2 and plan.config[0] == 2 and plan.num_splits == 1


@pytest.mark.parametrize("seqlen_q", [1, 64, 128])
def test_q_stage_short_queries_is_1(seqlen_q):
    assert sm100.plan(_problem(max_seqlen_q=seqlen_q), 1, None, 148).config.q_stage == 1


def test_q_stage_counts_packed_rows():
    # 16 query positions x 8 heads per KV head = 128 packed rows: one stage.
    p = _problem(max_seqlen_q=16, nheads=32, nheads_kv=4)
    plan = sm100.plan(p, 1, True, 148)
    assert plan.pack_gqa and plan.config.q_stage == 1
    # 32 x 8 = 256 rows: two stages.
    assert sm100.plan(p._replace(max_seqlen_q=32), 1, True, 148).config.q_stage == 2
    # Unpacked, 32 rows per head: one stage.
    assert sm100.plan(p._replace(max_seqlen_q=32), 1, False, 148).config.q_stage == 1


def test_q_stage_is_1_with_split_kv():
    # Prefill-sized queries with an explicit split: one stage.
    plan = sm100.plan(_problem(max_seqlen_q=1024, max_seqlen_k=65536), 4, None, 148)
    assert plan.num_splits == 4 and plan.config.q_stage == 1
    # Decode with the auto heuristic: splits, one stage.
    decode = _problem(batch=1, max_seqlen_q=1, max_seqlen_k=131072, nheads=32, nheads_kv=8, has_seqused_k=True)
    plan = sm100.plan(decode, 0, None, 148)
    assert plan.pack_gqa and plan.num_splits > 1 and plan.config.q_stage == 1


def test_pack_gqa_needs_a_ratio_dividing_128():
    assert sm100.pack_refusal(8) is None and sm100.pack_refusal(2) is None and sm100.pack_refusal(1)
    assert sm100.pack_refusal(6)  # 128 rows are not whole query positions
    p = _problem(max_seqlen_q=1, nheads=12, nheads_kv=2)
    assert not sm100.plan(p, 1, True, 148).pack_gqa


@pytest.mark.parametrize("ratio", [3, 5, 6, 7, 12, 24])
def test_pack_gqa_refusal_names_its_reason_and_runs_unpacked(ratio, caplog):
    # A ratio that does not divide the 128-row Q stage is refused with a reason, and the
    # call runs unpacked: one query head per row block, every head's rows whole.
    reason = sm100.pack_refusal(ratio)
    assert reason is not None and f"GQA ratio {ratio}" in reason and "divide" in reason and "unpacked" in reason
    p = _problem(max_seqlen_q=1, nheads=2 * ratio, nheads_kv=2, max_seqlen_k=8192)
    with caplog.at_level("INFO", logger="flash_attn_cute"):
        plan = sm100.plan(p, 1, True, 148)
    assert not plan.pack_gqa and plan.qhead_per_kvhead_packed(p) == 1 and plan.config.q_stage == 1
    assert reason in caplog.text
    assert sm100.compile_key(p, plan, ARCH)[9] == 1  # the unpacked kernel
    # pack_gqa=None (the heuristic's choice) falls back silently.
    caplog.clear()
    with caplog.at_level("INFO", logger="flash_attn_cute"):
        assert not sm100.plan(p, 1, None, 148).pack_gqa
    assert reason not in caplog.text


@pytest.mark.parametrize("ratio", [2, 4, 8, 16, 32, 64, 128])
def test_pack_gqa_ratios_dividing_128_pack(ratio):
    assert sm100.pack_refusal(ratio) is None
    p = _problem(max_seqlen_q=1, nheads=2 * ratio, nheads_kv=2)
    plan = sm100.plan(p, 1, True, 148)
    assert plan.pack_gqa and sm100.compile_key(p, plan, ARCH)[9] == ratio


def test_backend_is_automatic_on_blackwell():
    # backend=None picks this kernel on compute capability 10.x (seam.select_backend), not elsewhere.
    assert sm100.AUTO and sm100.runs_on((10, 0)) and sm100.runs_on((10, 3))
    assert not sm100.runs_on((9, 0)) and not sm100.runs_on((12, 0))


def test_compile_key_layout_is_the_shared_one():
    # keys.make_key / keys.parse_key: the key is the plan's tile spread between d_v and the flags.
    p = _problem(causal=True, window_right=0, has_seqused_k=True, page_size=128)
    plan = sm100.plan(p, 3, None, 148)
    key = sm100.compile_key(p, plan, ARCH)
    assert key == ("fwd_sm100", ARCH, "bf16", 128, 128, *plan.config[:3], (True, False, False), 1, True, True, False,
                   False, True, True, False, False, 0, 0, sm100.EX2_EVERY)
    f = keys.parse_key(key, 3)
    assert f.tile == plan.config[:3] and f.flags == (True, False, False) and f.paged and f.has_seqused_k and f.is_split
    assert f.split_blocks == 0 and f.q_class == 0 and not f.has_sink and not f.has_seqused_q
    assert f.extra == (sm100.EX2_EVERY,)  # ex2_emulate_every, last (sm100.ex2_share)


def test_compile_key_tracks_the_plan():
    p = _problem(batch=1, max_seqlen_q=1, max_seqlen_k=131072, nheads=32, nheads_kv=8, has_seqused_k=True)
    plan = sm100.plan(p, 0, None, 148)
    key = sm100.compile_key(p, plan, ARCH)
    assert key[0] == "fwd_sm100" and key[1] == ARCH
    assert key[5] == plan.config.q_stage == 1 and key[9] == 4  # q_stage, packed rows per position
    assert sm100.compile_key(p, plan._replace(num_splits=1), ARCH) != key
    assert sm100.compile_key(p, sm100.plan(p, 1, None, 148), ARCH)[10] is False  # not split


# ---------------------------------------------------------------------------------------
# Split-KV: the same resolution and the same per-split block ranges as the other backends
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 64, 300])
def test_explicit_splits_match_the_sm80_backend(num_splits):
    from flash_attn_cute import sm80

    for p in (_problem(max_seqlen_k=8192), _problem(max_seqlen_q=1, max_seqlen_k=200),
              _problem(batch=1, max_seqlen_q=1, max_seqlen_k=65536, nheads=32, nheads_kv=8)):
        assert sm100.plan(p, num_splits, False, None).num_splits == sm80.plan(p, num_splits, False, None).num_splits


@pytest.mark.parametrize("num_sms", [132, 148])
def test_auto_splits_are_resolve_num_splits_on_the_sm100_tile(num_sms):
    for batch, sk, h, hkv in ((1, 131072, 32, 8), (4, 8192, 16, 16), (2, 512, 8, 8), (1, 65536, 64, 8)):
        p = _problem(batch=batch, max_seqlen_q=1, max_seqlen_k=sk, nheads=h, nheads_kv=hkv, has_seqused_k=True)
        plan = sm100.plan(p, 0, None, num_sms)
        ratio = h // hkv if plan.pack_gqa else 1
        expect = heuristics.resolve_num_splits(
            0, num_sms, ctas=batch * (hkv if plan.pack_gqa else h), rows=ratio, max_seqlen_k=sk, tile_m=TILE_M,
            tile_n=sm100.TILE_N, ctas_per_sm=1, tolerance=0.95)
        assert plan.num_splits == expect


def _split_ranges(n_blocks: int, num_splits: int):
    """The kernels' split of [0, n_blocks) (block_info.BlockInfo.get_n_block_min_max)."""
    per = -(-n_blocks // num_splits)
    return [(min(n_blocks, s * per), min(n_blocks, s * per + per)) for s in range(num_splits)]


@pytest.mark.parametrize("seqlen_k,num_splits", [(131072, 8), (4224, 3), (200, 4), (128, 1), (1000, 7)])
def test_split_ranges_partition_the_keys(seqlen_k, num_splits):
    # Every backend walks the same BlockInfo split: contiguous, disjoint, covering ranges.
    n_blocks = -(-seqlen_k // sm100.TILE_N)
    ranges = _split_ranges(n_blocks, num_splits)
    covered = [b for lo, hi in ranges for b in range(lo, hi)]
    assert covered == list(range(n_blocks))


def test_split_uses_the_shared_block_info():
    import inspect

    from flash_attn_cute.device import fwd_kernel
    from flash_attn_cute.sm100 import flash_fwd

    # The tile (split bounds included) comes from the shared FwdTile.create, on BlockInfo.
    src = inspect.getsource(flash_fwd)
    assert "FwdTile.create(" in src and "n_block_runs(" in src and "BlockInfo(" in src
    assert "get_n_block_min_max" in inspect.getsource(fwd_kernel.FwdTile.of_work)
    assert "get_n_block_runs" in inspect.getsource(fwd_kernel.FwdTile.n_block_runs)


# ---------------------------------------------------------------------------------------
# Resources
# ---------------------------------------------------------------------------------------

CONFIGS = [(d, dv, q) for d, dv in sm100.HEAD_DIM_PAIRS for q in (1, 2)]


@pytest.mark.parametrize("d,dv,q_stage", CONFIGS)
def test_tmem_columns_fit(d, dv, q_stage):
    used = tmem_columns(q_stage, sm100.TILE_N, dv)
    assert used <= TMEM_COLUMNS
    alloc = tmem_alloc_columns(used)
    assert alloc >= used and alloc <= TMEM_COLUMNS and alloc & (alloc - 1) == 0 and alloc >= 32


@pytest.mark.parametrize("d,dv,q_stage", CONFIGS)
def test_shared_memory_fits(d, dv, q_stage):
    stages = kv_stages_for(d, dv, q_stage, sm100.TILE_N)
    assert stages >= 1
    assert smem_bytes(d, dv, q_stage, sm100.TILE_N, stages) <= SMEM_LIMIT == 232448
    # The deepest ring that fits: one more stage would not.
    if stages < 4:
        assert smem_bytes(d, dv, q_stage, sm100.TILE_N, stages + 1) > SMEM_LIMIT
    # The plan carries that ring depth.
    p = _problem(d=d, d_v=dv, max_seqlen_q=4096 if q_stage == 2 else 64)
    plan = sm100.plan(p, 1, False, None)
    assert plan.config == (q_stage, sm100.TILE_N, stages, 0, sm100.EX2_EVERY if max(d, dv) <= 128 else 0, False, 0)


def test_ex2_share():
    # FMA-pipe exponentials (FA4's share on B200) for d <= 128 on sm_100, nowhere else.
    p = _problem(causal=True, softcap=30.0)
    assert sm100.ex2_share(p, "sm_100a") == sm100.ex2_share(p, None) == sm100.EX2_EVERY == 8
    assert sm100.ex2_share(p._replace(d=64, d_v=64), "sm_100a") == 8
    assert sm100.ex2_share(p, "sm_103a") == 0  # fast MUFU exp2 there (FA4 keeps it)
    assert sm100.ex2_share(p._replace(d=192, d_v=128), "sm_100a") == 0
    assert sm100.ex2_share(p._replace(batch_invariant=True), "sm_100a") == 0
    assert sm100.ex2_share(p._replace(dtype=torch.float8_e4m3fn), "sm_100a") == 0
    assert sm100.ex2_share(p._replace(kv_dtype=torch.float8_e4m3fn), "sm_100a") == 8  # FP8 K/V, 16-bit MMAs
    assert sm100.ex2_share(p._replace(variant=object()), "sm_100a") == 0
    plan = sm100.plan(p, 1, None, 148, arch="sm_103a")
    key = sm100.compile_key(p, plan, "sm_103a")
    assert plan.config.ex2_emulate_every == 0 and keys.parse_key(key, 3).extra == ()


@pytest.mark.parametrize("q_stage", [1, 2])
def test_warp_roles(q_stage):
    roles = WarpRoles(q_stage)
    assert roles.num_warps % 4 == 0 and roles.num_threads == 32 * roles.num_warps
    softmax = set(range(roles.num_softmax_warps))
    others = {roles.mma_warp, roles.load_warp}
    assert softmax.isdisjoint(roles.correction_warps) and others.isdisjoint(softmax | set(roles.correction_warps))
    # setmaxnreg acts per warpgroup: the MMA and load warps share one, apart from the math.
    assert roles.mma_warp // 4 == roles.load_warp // 4 == roles.num_warps // 4 - 1
    # TMEM lanes: warp w reads lanes 32 (w % 4)..: every 128-thread role covers all 128 rows.
    assert sorted(w % 4 for w in roles.correction_warps) == [0, 1, 2, 3]
    assert roles.registers_per_sm() <= 65536
    # setmaxnreg moves registers inside the CTA's pool: what the launch allocated (ptxas's
    # entry count, 64K / threads rounded down to 8, x threads) must cover the budgets.
    entry = 65536 // roles.num_threads // 8 * 8
    assert entry * roles.num_threads >= roles.registers_per_sm()
    for regs in (roles.softmax_regs, roles.correction_regs, roles.other_regs):
        assert regs % 8 == 0 and 24 <= regs <= 256


def test_fp8_cache_quantizes_q_on_request():
    """An e4m3 cache under 16-bit queries: the widening kernel by default (fp8 staging rings,
    16-bit K/V stages); FLASH_ATTN_CUTE_SM100_FP8_KV=quantize_q quantizes the queries in the
    kernel (e4m3 Q, K, V stages, no staging rings, no exponentials on the FMA pipe, the
    key's QUANTIZE_Q field); never for e5m2, batch invariance or FP8 q, k, v."""
    from flash_attn_cute.host.tuning import Tuning

    quantize = Tuning(sm100_fp8_kv="quantize_q")
    for seqlen_q, d, dv in ((1, 128, 128), (1024, 128, 128), (1024, 192, 128), (1024, 64, 64)):
        p = _problem(max_seqlen_q=seqlen_q, d=d, d_v=dv, kv_dtype=torch.float8_e4m3fn, has_seqused_k=True)
        widen = sm100.plan(p, 1, True, 148)
        assert not widen.config.quantize_q and keys.QUANTIZE_Q not in sm100.compile_key(p, widen, ARCH)
        assert widen == sm100.plan(p, 1, True, 148, tuning=Tuning(sm100_fp8_kv="widen"))
        plan = sm100.plan(p, 1, True, 148, tuning=quantize)
        c = plan.config
        assert c.quantize_q and c.ex2_emulate_every == 0
        # Q, K and V one byte a value and no staging: the stages of FP8 q, k, v.
        assert c.kv_stages == kv_stages_for(d, dv, c.q_stage, c.tile_n, fp8=False, elem=1)
        assert c.q_stage == widen.config.q_stage or (d == 192 and c.q_stage == 2 and widen.config.q_stage == 1)
        key = sm100.compile_key(p, plan, ARCH)
        assert key[-1] == keys.QUANTIZE_Q and "/e4m3" in key[2], key
    p = _problem(kv_dtype=torch.float8_e5m2, dtype=torch.float16)
    assert not sm100.plan(p, 1, True, 148, tuning=quantize).config.quantize_q
    p = _problem(kv_dtype=torch.float8_e4m3fn, batch_invariant=True)
    assert not sm100.plan(p, 1, True, 148, tuning=quantize).config.quantize_q
    p = _problem(dtype=torch.float8_e4m3fn, kv_dtype=torch.float8_e4m3fn)
    assert not sm100.plan(p, 1, True, 148, tuning=quantize).config.quantize_q
    with pytest.raises(ValueError, match="FLASH_ATTN_CUTE_SM100_FP8_KV='fp8'"):
        sm100.plan(_problem(kv_dtype=torch.float8_e4m3fn), 1, True, 148, tuning=Tuning(sm100_fp8_kv="fp8"))
