"""Compile-only tests of every forward backend, for each arch it targets: no GPU needed.

The keys come from the GPU sweeps themselves (``test_flash_attn_gpu.compile_keys`` and
``test_serving_gpu.compile_keys``: the backend's own plan on the sweeps' problems); a
covering subset of them, in which every value of every key field appears, is compiled
through tests/compile_harness.py. The SASS is then checked for the instructions each
kernel is built from, and for spills. Pairs of keys that differ only by the learnable
sink show what it costs: nothing at all in a split kernel (the combine adds it), no
local memory in the others.
"""

import re

import pytest
import torch
import test_flash_attn_gpu
import test_serving_gpu
from compile_harness import compile_entries, covering_subset
from sass_sweep import sass_histogram

from flash_attn_cute import seam
from flash_attn_cute.host.keys import QUANTIZE_Q, parse_key, parse_kv_box
from flash_attn_cute.host.tuning import NO_TUNING, Tuning

BF16 = torch.bfloat16

# The archs each backend is compiled for: its own, and the H200 it is tested on.
ARCHS = {"sm80": ["sm_80", "sm_90a"], "sm90": ["sm_90a"], "sm100": ["sm_100a"]}
# Instructions each backend's SASS must hold.
SASS_EXPECT = {
    "sm80": ["HMMA.16816.F32", "LDSM", "LDGSTS", "MUFU.EX2"],  # mma.sync from ldmatrix, cp.async loads
    "sm90": ["HGMMA", "MUFU.EX2"],  # wgmma (its loads depend on the key: sm90_loads)
    # tcgen05.mma (f16 kind), tcgen05.ld/st of TMEM, TMA, tcgen05.commit
    "sm100": ["UTCHMMA", "LDTM", "STTM", "UTMALDG", "UTCBAR", "MUFU.EX2"],
}
# Instructions a backend's SASS must not hold: the SM100 kernel's tensor-core work is all tcgen05.
SASS_FORBID = {"sm100": [r"\bHMMA\b"]}


TILE_LEN = {"sm80": 4, "sm90": 4, "sm100": 3}  # config fields before the common ones (keys.parse_key)


def fields(backend, key):
    return parse_key(key, TILE_LEN[backend])


def spill_bound(backend, key):
    """Local-memory instructions a key may have. SM80: unbounded (its d128 tile spills a
    little by design, RESULTS.md). SM90: none, except d=64 with a mask (three consumer
    warpgroups at 160 registers each spill a few scalars in the masked-block loop only;
    the unmasked loop is clean), and paged keys whose KV rows are gathered: bounded so
    they cannot grow."""
    if backend == "sm80":
        return None
    f = fields(backend, key)
    if backend == "sm90" and f.d <= 64 and (f.flags[0] or f.flags[1]) and f.dtype_name != "e4m3":
        return 40
    if backend == "sm90" and f.dtype_name == "e4m3" and f.tile[0] == 192:
        # FP8 Q, K, V with three consumer warpgroups: the transposing warps run at 32
        # registers and keep one value on the stack across each V block's waits (one
        # store per tile, one reload per block, outside the transposes' loop).
        return 2
    if backend == "sm100" and "/" in f.dtype_name and f.d > 128:
        if QUANTIZE_Q in key:
            # The queries quantized at d 192: a softmax thread holds its 24 16-byte chunks of
            # Q across the amax barrier, and tile scalars go to the stack meanwhile (stored
            # and reloaded once per tile, before the KV loop); compile-verified only.
            return 48
        # FP8 K/V at d 192: the softmax warpgroup keeps 6 tile scalars on the stack (the
        # same key with 16-bit K/V has none); compile-verified only, not measured.
        return 12
    if backend == "sm90" and any(parse_kv_box(x) for x in f.extra):
        # Pages read in TMA boxes (keys.kv_box_field): with three consumer warpgroups the
        # producer (32 registers) keeps one value on the stack per tile.
        return 2
    if backend == "sm90" and f.extra[0]:
        # A gathering producer at 40 registers keeps one value on the stack per block, and one
        # more per tile since the grid may fold the batch (tile_scheduler.unfold_batch): a
        # page id of the tile's first block, across the wait for its stage.
        return 6
    return 0
CASES = [(b, a) for b in sorted(seam.BACKENDS) for a in ARCHS[b]]


def compile_keys(backend, arch):
    """The forward keys of both GPU sweeps on ``backend`` for ``arch``."""
    return test_flash_attn_gpu.compile_keys(backend, arch)[0] | test_serving_gpu.compile_keys(backend, arch)[0]


def sink_pairs(arch, backend):
    """[(key with a learnable sink, the same key without)]: a decode step (32 query heads
    packed over 8 KV heads, a 2048-token cache) unsplit, and batch invariant (split
    kernels of fixed keys per split, which leave the sink to the combine)."""
    module = seam.backend_module(backend)
    pairs = []
    for invariant in (False, True):
        problem = seam.FwdProblem(dtype=BF16, batch=3, max_seqlen_q=1, max_seqlen_k=2048, nheads=32, nheads_kv=8,
                                 d=128, d_v=128, softmax_scale=128 ** -0.5, causal=True, window_left=-1,
                                 window_right=0, softcap=0.0, varlen_q=False, varlen_k=False, has_seqused_k=True,
                                 page_size=0, has_lse=True, has_sink=True, batch_invariant=invariant)
        keys = [module.compile_key(p, module.plan(p, 1, True, 132), arch)
                for p in (problem, problem._replace(has_sink=False))]
        pairs.append(tuple(keys))
    return pairs


def sm100_extra_keys(arch):
    """Beyond the sweep's covering subset: a contiguous KV cache (seqused_k, not paged) in
    decode shape (packed GQA, split, q_stage 1), whose last KV block's tail V rows the
    kernel zeroes (the covering subset reaches that code only through a paged key)."""
    module = seam.backend_module("sm100")
    problem = seam.FwdProblem(dtype=BF16, batch=2, max_seqlen_q=1, max_seqlen_k=4096, nheads=32, nheads_kv=8, d=128,
                             d_v=128, softmax_scale=128 ** -0.5, causal=False, window_left=-1, window_right=-1,
                             softcap=0.0, varlen_q=False, varlen_k=False, has_seqused_k=True, page_size=0,
                             has_lse=True)
    return ([module.compile_key(problem, module.plan(problem, 3, True, 148), arch)] + fp8_keys(arch, "sm100")
            + fp8_attention_keys(arch, "sm100") + sm100_quantized_q_keys(arch) + sm100_box_keys(arch))


def sm100_quantized_q_keys(arch):
    """An e4m3 cache under 16-bit queries on the SM100 kernel with the queries quantized in
    the kernel (FLASH_ATTN_CUTE_SM100_FP8_KV=quantize_q, ``sm100.quantizes_q``): a decode
    step split over a contiguous cache (packed GQA, q_stage 1), a causal prefill chunk over
    pages of 128 (two Q stages, two quantizing warpgroups), fp16 queries at d 192, and a
    varlen prefill at d 64."""
    if arch != "sm_100a":
        return []
    module = seam.backend_module("sm100")
    decode = seam.FwdProblem(dtype=BF16, batch=2, max_seqlen_q=1, max_seqlen_k=4096, nheads=32, nheads_kv=8, d=128,
                            d_v=128, softmax_scale=128 ** -0.5, causal=False, window_left=-1, window_right=-1,
                            softcap=0.0, varlen_q=False, varlen_k=False, has_seqused_k=True, page_size=0,
                            has_lse=True, kv_dtype=torch.float8_e4m3fn)
    problems = [(decode, 4, True), (decode._replace(max_seqlen_q=512, causal=True, window_right=0, page_size=128), 1,
                                    True),
                (decode._replace(d=192, dtype=torch.float16), 1, True),
                (decode._replace(d=64, d_v=64, max_seqlen_q=2048, varlen_q=True, varlen_k=True, has_seqused_k=False),
                 1, None)]
    tuning = Tuning(sm100_fp8_kv="quantize_q")
    return [module.compile_key(p, module.plan(p, ns, pack, 148, tuning=tuning), arch) for p, ns, pack in problems]


def fp8_keys(arch, backend="sm80"):
    """FP8 K/V widened to 16 bits on the SM80 kernel (for sm_90a: sm_80 has no fp8
    conversion instructions and the API refuses FP8 below compute capability 8.9), the SM90
    kernel (FLASH_ATTN_CUTE_SM90_FP8_KV=widen: its default quantizes q, ``quantized_q_keys``)
    and the SM100 kernel: a
    decode step over a contiguous cache split, and over pages of 16 (SM100: 128, its one
    page size) with a window and softcap, e4m3 with bf16 queries; e5m2 with fp16 queries;
    SM90 and SM100 also a prefill chunk over pages of 64 (SM90: one CTA per SM, the decode
    keys run two; SM100: 128, two Q stages), and SM100 d 192."""
    if arch == "sm_80" or (backend == "sm100") != (arch == "sm_100a"):
        return []
    module = seam.backend_module(backend)
    base = seam.FwdProblem(dtype=BF16, batch=2, max_seqlen_q=1, max_seqlen_k=4096, nheads=32, nheads_kv=8, d=128,
                          d_v=128, softmax_scale=128 ** -0.5, causal=False, window_left=-1, window_right=-1,
                          softcap=0.0, varlen_q=False, varlen_k=False, has_seqused_k=True, page_size=0,
                          has_lse=True, kv_dtype=torch.float8_e4m3fn)
    page = 128 if backend == "sm100" else 16
    problems = [(base, 4), (base._replace(page_size=page, window_left=300, window_right=0, softcap=20.0), 1),
                (base._replace(dtype=torch.float16, kv_dtype=torch.float8_e5m2), 1)]
    if backend != "sm80":
        problems.append((base._replace(max_seqlen_q=512, causal=True, window_right=0,
                                       page_size={"sm90": 64, "sm100": 128}[backend]), 1))
    if backend == "sm100":
        problems.append((base._replace(d=192), 1))
    tuning = WIDEN if backend == "sm90" else NO_TUNING
    return [module.compile_key(p, module.plan(p, ns, True, 132, tuning=tuning), arch) for p, ns in problems]


WIDEN = Tuning(sm90_fp8_kv="widen")  # SM90: an e4m3 cache under 16-bit queries widened (not the default)


def quantized_q_problems():
    """(name, problem, num_splits, pack_gqa): an e4m3 cache under 16-bit queries on the SM90
    kernel that quantizes the queries (``sm90.quantizes_q``): decode steps (one
    query, 32 query heads packed over 8 KV heads: at most 64 rows) over a contiguous cache
    split by the heuristic and over pages of 1, 16 (row gathers) and 64 (TMA), fp16 queries
    among them; a prefill chunk (causal, 2048 queries: three consumer warpgroups); d 256
    varlen split with an LSE; d 192 / 128 with a sink, window and softcap; paged
    cache_leftpad (gathered)."""
    decode = seam.FwdProblem(dtype=BF16, batch=2, max_seqlen_q=1, max_seqlen_k=4096, nheads=32, nheads_kv=8, d=128,
                            d_v=128, softmax_scale=128 ** -0.5, causal=False, window_left=-1, window_right=-1,
                            softcap=0.0, varlen_q=False, varlen_k=False, has_seqused_k=True, page_size=0,
                            has_lse=True, kv_dtype=torch.float8_e4m3fn)
    causal = dict(causal=True, window_right=0)
    prefill = decode._replace(max_seqlen_q=2048, has_seqused_k=False, has_lse=False, **causal)
    return [("decode", decode, 0, True),
            ("decode_page1", decode._replace(page_size=1, **causal), 3, True),
            ("decode_page16_fp16", decode._replace(dtype=torch.float16, page_size=16, **causal), 0, True),
            ("decode_page64", decode._replace(page_size=64, **causal), 0, True),
            ("prefill", prefill, 1, None),
            ("prefill_d256_varlen_split", prefill._replace(d=256, d_v=256, varlen_q=True, varlen_k=True,
                                                           has_lse=True), 3, None),
            ("prefill_d192_sink_local_softcap", prefill._replace(d=192, has_sink=True, window_left=200,
                                                                 softcap=20.0), 1, None),
            ("chunk_paged_leftpad", decode._replace(max_seqlen_q=128, page_size=64, leftpad_k=True, **causal), 1,
             None)]


def quantized_q_keys(arch):
    """The SM90 keys of ``quantized_q_problems`` (sm_90a only), planned with
    FLASH_ATTN_CUTE_SM90_FP8_KV=quantize_q: by default the gathered pages (1, 16,
    cache_leftpad) keep the widening kernel (``sm90.plan``), the GPU tests name the knob."""
    if arch != "sm_90a":
        return []
    from flash_attn_cute.host.tuning import Tuning

    module = seam.backend_module("sm90")
    tuning = Tuning(sm90_fp8_kv="quantize_q")
    return [module.compile_key(p, module.plan(p, ns, pack, 132, tuning), arch)
            for _, p, ns, pack in quantized_q_problems()]


def fp8_attention_keys(arch, backend="sm90"):
    """FP8 Q, K and V on the SM90 kernel (sm_90a) or the SM100 kernel (sm_100a): prefill
    tiles of d 128 (non-causal) and d 64 (causal; SM90: three consumer warpgroups), d 256
    (SM100: 128) varlen split with an LSE, d 192 / 128 with a sink, window and softcap, and a
    decode step over pages of 64 (SM100: 128; packed GQA rows, a cache tail zeroed: SM90 in
    the V transposes, SM100 in smem); SM90 also a decode over pages of 16 and a prefill
    chunk of d 80 (padded) over pages of 1, whose rows producer warp 0 gathers."""
    if arch != {"sm90": "sm_90a", "sm100": "sm_100a"}[backend]:
        return []
    base = seam.FwdProblem(dtype=torch.float8_e4m3fn, batch=2, max_seqlen_q=4096, max_seqlen_k=4096, nheads=16,
                          nheads_kv=4, d=128, d_v=128, softmax_scale=128 ** -0.5, causal=False, window_left=-1,
                          window_right=-1, softcap=0.0, varlen_q=False, varlen_k=False, has_seqused_k=False,
                          page_size=0, has_lse=False)
    d_split = 256 if backend == "sm90" else 128
    problems = [(base, 1), (base._replace(d=64, d_v=64, causal=True, window_right=0), 1),
                (base._replace(d=d_split, d_v=d_split, varlen_q=True, varlen_k=True, has_lse=True), 3),
                (base._replace(d=192, has_sink=True, window_left=200, window_right=0, softcap=20.0), 1),
                (base._replace(max_seqlen_q=1, page_size={"sm90": 64, "sm100": 128}[backend], has_seqused_k=True,
                               causal=True, window_right=0), 0)]
    if backend == "sm90":  # pages of 16 (vLLM's: TMA boxes of 16 rows) and 1 (rows gathered by producer warp 0)
        problems += [(base._replace(max_seqlen_q=1, page_size=16, has_seqused_k=True, causal=True, window_right=0),
                      0),
                     (base._replace(max_seqlen_q=512, page_size=1, has_seqused_k=True, causal=True,
                                    window_right=0, d=80, d_v=80), 1)]
    module = seam.backend_module(backend)
    return [module.compile_key(p, module.plan(p, ns, None, 132), arch) for p, ns in problems]


def two_level_pairs(arch):
    """[(key with fp8_two_level_interval, the same problem's key without)] on the SM90 FP8
    Q, K, V kernel (sm_90a only): the prefill tiles the option changes (d 64: 192 x 128, three
    consumer warpgroups; d 128: 128 x 128, two; d 192: 64 x 64, one), a decode step over pages
    of 64 (packed GQA, a cache tail zeroed), and 16-bit queries over an e4m3 cache (quantized
    in the kernel) in decode, split by the heuristic, interval 1 (every P V flushed)."""
    if arch != "sm_90a":
        return []
    module = seam.backend_module("sm90")
    base = seam.FwdProblem(dtype=torch.float8_e4m3fn, batch=2, max_seqlen_q=4096, max_seqlen_k=4096, nheads=16,
                           nheads_kv=4, d=128, d_v=128, softmax_scale=128 ** -0.5, causal=False, window_left=-1,
                           window_right=-1, softcap=0.0, varlen_q=False, varlen_k=False, has_seqused_k=False,
                           page_size=0, has_lse=False, fp8_two_level_interval=4)
    decode = base._replace(max_seqlen_q=1, page_size=64, has_seqused_k=True, causal=True, window_right=0)
    problems = [(base, 1), (base._replace(d=64, d_v=64), 1), (base._replace(d=192, d_v=192, has_lse=True), 1),
                (decode, 0), (decode._replace(dtype=BF16, kv_dtype=torch.float8_e4m3fn, page_size=0,
                                              max_seqlen_k=131072, fp8_two_level_interval=1), 0)]
    key = lambda p, ns: module.compile_key(p, module.plan(p, ns, None, 132), arch)
    return [(key(p, ns), key(p._replace(fp8_two_level_interval=0), ns)) for p, ns in problems]


def sm80_extra_keys(arch):
    return fp8_keys(arch)


BOXES = Tuning(sm90_paged_kv="boxes")


def box_problems():
    """(name, problem, TMA boxes a K block): pages of a multiple of 16 keys read by TMA boxes
    (FLASH_ATTN_CUTE_SM90_PAGED_KV=boxes): 16-bit decode over pages of 16 (two CTAs a SM,
    (64, 64): four boxes), an e4m3 cache under bf16 queries and FP8 q, k, v decode ((64,
    128): eight), 16-bit prefill over pages of 16 at d 128 ((128, 128), two consumer
    warpgroups: eight boxes) and d 64 ((192, 128), three: eight), FP8 prefill over pages of
    16 at d 128 ((192, 96): six) and of 32 at d 256 ((128, 96): boxes of 32, three)."""
    dec = seam.FwdProblem(dtype=BF16, batch=64, max_seqlen_q=1, max_seqlen_k=4096, nheads=32, nheads_kv=8, d=128,
                         d_v=128, softmax_scale=128 ** -0.5, causal=False, window_left=-1, window_right=-1,
                         softcap=0.0, varlen_q=False, varlen_k=False, has_seqused_k=True, page_size=16, has_lse=False)
    prefill = dec._replace(batch=2, max_seqlen_q=2048, has_seqused_k=False)
    e4m3 = torch.float8_e4m3fn
    return [("bf16_decode", dec, 4), ("e4m3_cache_decode", dec._replace(kv_dtype=e4m3), 8),
            ("fp8_decode", dec._replace(dtype=e4m3), 8),
            ("bf16_prefill", prefill._replace(causal=True, window_right=0), 8),
            ("bf16_prefill_d64", prefill._replace(d=64, d_v=64, causal=True, window_right=0), 8),
            ("fp8_prefill", prefill._replace(dtype=e4m3), 6),
            ("fp8_prefill_d256_page32", prefill._replace(dtype=e4m3, d=256, d_v=256, page_size=32), 3)]


def box_keys(arch):
    """The SM90 keys of ``box_problems`` (sm_90a only)."""
    if arch != "sm_90a":
        return []
    module = seam.backend_module("sm90")
    return [module.compile_key(p, module.plan(p, 0, p.max_seqlen_q == 1 or None, 132, tuning=BOXES), arch)
            for _, p, _ in box_problems()]


def sm100_box_problems():
    """(name, problem, num_splits, tuning, TMA boxes a block) of the SM100 kernel over pages
    of a multiple of 16 keys that hold no whole 128-key block, each box through its own
    page-table entry: 16-bit split decode over pages of 16 (eight boxes, q_stage 1), 16-bit
    prefill over pages of 64 (two, q_stage 2), d 64 over pages of 16, (192, 128) over pages
    of 32 (four), an e4m3 cache widened (its fp8 staging rings, pages of 32), an e4m3 cache
    with the queries quantized (pages of 48: boxes of 16) and FP8 q, k, v (pages of 16):
    the e4m3 operand stages."""
    dec = seam.FwdProblem(dtype=BF16, batch=2, max_seqlen_q=1, max_seqlen_k=4096, nheads=8, nheads_kv=2, d=128,
                         d_v=128, softmax_scale=128 ** -0.5, causal=True, window_left=-1, window_right=0,
                         softcap=0.0, varlen_q=False, varlen_k=False, has_seqused_k=True, page_size=16, has_lse=True)
    e4m3 = torch.float8_e4m3fn
    quantize = Tuning(sm100_fp8_kv="quantize_q")
    return [("bf16_split_decode_page16", dec, 0, NO_TUNING, 8),
            ("bf16_prefill_page64", dec._replace(max_seqlen_q=1024, page_size=64), 1, NO_TUNING, 2),
            ("d64_prefill_page16", dec._replace(max_seqlen_q=300, d=64, d_v=64), 1, NO_TUNING, 8),
            ("d192_decode_page32", dec._replace(d=192, causal=False, window_right=-1, page_size=32), 2, NO_TUNING, 4),
            ("e4m3_cache_widened_page32", dec._replace(kv_dtype=e4m3, page_size=32), 0, NO_TUNING, 4),
            ("e4m3_cache_quantized_q_page48", dec._replace(kv_dtype=e4m3, max_seqlen_q=256, page_size=48), 1,
             quantize, 8),
            ("fp8_prefill_page16", dec._replace(dtype=e4m3, max_seqlen_q=512), 1, NO_TUNING, 8)]


def sm100_box_keys(arch):
    """The SM100 keys of ``sm100_box_problems`` (sm_100a only)."""
    if arch != "sm_100a":
        return []
    module = seam.backend_module("sm100")
    return [module.compile_key(p, module.plan(p, ns, True, 148, tuning=t), arch)
            for _, p, ns, t, _ in sm100_box_problems()]


def dynamic_tile_keys(arch):
    """SM90 "dynamic" persistent kernels over LPT tiles, which draw them from an atomic
    counter (``flash_fwd`` ``dynamic``; FLASH_ATTN_CUTE_SM90_PERSISTENT=dynamic): FP8 Q, K, V d 256 causal (four producer warps walk the
    tiles: warp 0 loads, 1-3 transpose V) and bf16 d 128 causal (producer warp 0 alone)."""
    if arch != "sm_90a":
        return []
    module = seam.backend_module("sm90")
    on = Tuning(sm90_persistent="dynamic")
    base = seam.FwdProblem(dtype=torch.float8_e4m3fn, batch=4, max_seqlen_q=8192, max_seqlen_k=8192, nheads=8,
                          nheads_kv=8, d=256, d_v=256, softmax_scale=0.0625, causal=True, window_left=-1,
                          window_right=0, softcap=0.0, varlen_q=False, varlen_k=False, has_seqused_k=False,
                          page_size=0, has_lse=False)
    problems = (base, base._replace(dtype=torch.bfloat16, d=128, d_v=128, nheads=16, nheads_kv=16))
    return [module.compile_key(p, module.plan(p, 1, None, 132, tuning=on), arch) for p in problems]


EXTRA_KEYS = {"sm100": sm100_extra_keys, "sm80": sm80_extra_keys,
              "sm90": lambda arch: (fp8_keys(arch, "sm90") + fp8_attention_keys(arch) + quantized_q_keys(arch)
                                    + [k for pair in two_level_pairs(arch) for k in pair] + box_keys(arch)
                                    + dynamic_tile_keys(arch))}


def sm100_cache_tail_zeroed(key) -> bool:
    """Whether an SM100 key reads a KV cache (seqused_k or paged), where V rows past the
    length are zeroed in smem before P V: 16-bit shared stores the other keys never emit
    (FP8 K/V: the widening zeroes them in its 16-byte stores)."""
    f = fields("sm100", key)
    return (f.has_seqused_k or f.paged) and f.dtype_name in ("bf16", "fp16")


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    cache = {}

    def get(backend, arch):
        if (backend, arch) not in cache:
            keys = covering_subset(compile_keys(backend, arch))
            keys += [k for k in EXTRA_KEYS.get(backend, lambda a: [])(arch) if k not in keys]
            keys += [k for pair in sink_pairs(arch, backend) for k in pair if k not in keys]
            entries = [(f"k{i}", f"flash_attn_cute.{backend}:compile", key) for i, key in enumerate(keys)]
            root = tmp_path_factory.mktemp(f"{backend}_{arch}")
            cache[backend, arch] = keys, *compile_entries(arch, entries, root)
        return cache[backend, arch]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("backend,arch", CASES)
def test_forward_compiles(artifacts, backend, arch):
    keys, out_dir, seconds = artifacts(backend, arch)
    assert len(keys) >= 4, keys  # the sweep's key fields take several values each
    print(f"\n{backend} {arch}: {len(keys)} keys, " + ", ".join(f"{v:.1f}s" for v in seconds.values()))
    for i, key in enumerate(keys):
        cubins = list((out_dir / f"k{i}").glob(f"*.{arch}.cubin"))
        assert len(cubins) == 1 and cubins[0].read_bytes()[:4] == b"\x7fELF", key


@pytest.mark.slow
@pytest.mark.parametrize("backend,arch", CASES)
def test_forward_sass(artifacts, backend, arch):
    keys, out_dir, _ = artifacts(backend, arch)
    for i, key in enumerate(keys):
        sass_files = list((out_dir / f"k{i}").glob("*.sass"))
        if not sass_files:
            pytest.skip("no usable nvdisasm (pip install nvidia-cuda-nvdisasm): no SASS to check")
        sass = sass_files[0].read_text()
        # fp8 MMAs (test_fp8_attention_sass, test_quantized_q_sass)
        fp8_qkv = fields(backend, key).dtype_name == "e4m3" or QUANTIZE_Q in key
        for op in SASS_EXPECT[backend]:
            assert op in sass or (fp8_qkv and op in ("HGMMA", "UTCHMMA")), (op, key)
        for pattern in SASS_FORBID.get(backend, []):
            assert not re.search(pattern, sass), (pattern, key)
        if backend == "sm100":
            assert ("STS.U16" in sass) == sm100_cache_tail_zeroed(key), ("V tail zeroing", key)
            if QUANTIZE_Q in key:
                # e4m3 MMAs only, and stage 0's softmax warpgroup meets on its own barrier
                # (amax, then stores) before it arrives on Q's mbarrier.
                assert "UTCQMMA" in sass and "UTCHMMA" not in sass, key
                assert re.search(r"BAR\.SYNC\.DEFER_BLOCKING 0x2, 0x80", sass), key
            # The softmax sums its row in packed pairs (FADD2); where the key moves a share of
            # the exponentials to the FMA pipe (its last field, sm100.ex2_share), the
            # polynomial runs packed too (fma.rn.f32x2 appears in no other code).
            assert "FADD2" in sass, key
            ptx = next((out_dir / f"k{i}").glob("*.ptx")).read_text()
            ex2 = [x for x in fields(backend, key).extra if x != QUANTIZE_Q and not parse_kv_box(x)]
            assert ("fma.rn.f32x2" in ptx) == bool(ex2 and ex2[0]), ("ex2 emulation", key)
        bound = spill_bound(backend, key)
        spills = len(re.findall(r"\b(LDL|STL)\b", sass))
        assert bound is None or spills <= bound, ("local-memory spill", spills, key)
        if backend == "sm90":
            for op in sm90_loads(key):
                assert op in sass, (op, key)


def loop_ops(sass: str, pattern: str) -> int:
    """Instructions matching ``pattern`` inside the kernel's loops (the lines a backward
    branch spans)."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"\s*(\.L_x_\d+):", line))}
    loops = [(labels[m.group(1)], i) for i, line in enumerate(lines)
             if (m := re.search(r"BRA `\((\.L_x_\d+)\)", line)) and labels.get(m.group(1), i) < i]
    hits = [i for i, line in enumerate(lines) if re.search(pattern, line)]
    return sum(any(lo <= i <= hi for lo, hi in loops) for i in hits)


def loop_local_memory(sass: str) -> int:
    """Local-memory instructions inside the kernel's loops: the KV loops, where a spill costs
    once per block rather than once per tile."""
    return loop_ops(sass, r"\b(LDL|STL)\b")


@pytest.mark.slow
@pytest.mark.parametrize("backend,arch", CASES)
def test_sink_sass(artifacts, backend, arch):
    # The sink enters once: a split kernel (batch invariant: split_blocks > 0) compiles to
    # the same instructions with or without it, the combine adds it; an unsplit kernel reads
    # it per row after the KV loop, which it leaves without more local memory (the SM90 and
    # SM100 keys have none at all: spill_bound; the SM80 decode tile spills by design, and on
    # sm_90a the sink moves a few of those spills outside its loops).
    keys, out_dir, _ = artifacts(backend, arch)
    (plain_sink, plain), (split_sink, split) = sink_pairs(arch, backend)
    if not list((out_dir / f"k{keys.index(plain)}").glob("*.sass")):
        pytest.skip("no usable nvdisasm (pip install nvidia-cuda-nvdisasm): no SASS to check")
    hist = {k: sass_histogram(out_dir / f"k{keys.index(k)}")[0] for k in (plain_sink, plain, split_sink, split)}
    f = fields(backend, split_sink)
    assert f.is_split and f.split_blocks > 0 and f.has_sink and not fields(backend, plain_sink).is_split
    assert hist[split_sink] == hist[split], "a split kernel reads the sink"
    assert hist[plain_sink] != hist[plain], "the unsplit kernel ignores the sink"
    sass = {k: next((out_dir / f"k{keys.index(k)}").glob("*.sass")).read_text() for k in (plain_sink, plain)}
    in_loops = loop_local_memory(sass[plain_sink]), loop_local_memory(sass[plain])
    assert in_loops[0] <= in_loops[1], ("the sink adds local memory to the KV loops", in_loops)


@pytest.mark.slow
@pytest.mark.parametrize("backend,arch", [("sm80", "sm_90a"), ("sm90", "sm_90a"), ("sm100", "sm_100a")])
def test_fp8_sass(artifacts, backend, arch):
    # FP8 K/V: the fp8 blocks land by 16-byte cp.async (SM80) or TMA / row gathers (SM90,
    # SM100), 8-byte shared loads of the staged chunks, the hardware fp8 -> f16 conversion,
    # 16-byte shared stores into the 16-bit buffers the MMAs read.
    keys, out_dir, _ = artifacts(backend, arch)
    mma = {"sm80": "HMMA.16816.F32", "sm90": "HGMMA.64x", "sm100": "UTCHMMA"}[backend]
    for key in fp8_keys(arch, backend):
        sass_files = list((out_dir / f"k{keys.index(key)}").glob("*.sass"))
        if not sass_files:
            pytest.skip("no usable nvdisasm (pip install nvidia-cuda-nvdisasm): no SASS to check")
        sass = sass_files[0].read_text()
        fmt = key[2].split("/")[1].upper()
        loads = sm90_loads(key) if backend == "sm90" else {"sm80": ["LDGSTS.E.BYPASS.LTC128B.128"],
                                                          "sm100": ["UTMALDG"]}[backend]
        for op in (f"F2FP.F16.{fmt}.UNPACK_B", "LDS.64", "STS.128", mma, *loads):
            assert op in sass, (op, key)
        bound = spill_bound(backend, key)
        assert bound is None or len(re.findall(r"\b(LDL|STL)\b", sass)) <= bound, ("local memory", key)


@pytest.mark.slow
@pytest.mark.parametrize("backend,arch", [("sm90", "sm_90a"), ("sm100", "sm_100a")])
def test_fp8_attention_sass(artifacts, backend, arch):
    # FP8 Q, K, V: both GEMMs on fp8 operands (SM90: QGMMA e4m3 x e4m3, V transposed by
    # ldmatrix / stmatrix.trans in the producer warps; SM100: UTCQMMA, V read MN-major, P
    # stored to TMEM), P rounded to e4m3 in pairs, O out in bf16 pairs unless split; local
    # memory within ``spill_bound``.
    keys, out_dir, _ = artifacts(backend, arch)
    for key in fp8_attention_keys(arch, backend):
        sass_files = list((out_dir / f"k{keys.index(key)}").glob("*.sass"))
        if not sass_files:
            pytest.skip("no usable nvdisasm (pip install nvidia-cuda-nvdisasm): no SASS to check")
        sass = sass_files[0].read_text()
        f = fields(backend, key)
        ops = (("QGMMA.64x", ".E4M3.E4M3", "LDSM.16.M88.4", "STSM.16.MT88.4", *sm90_loads(key)) if backend == "sm90"
               else ("UTCQMMA", "STTM", "LDTM", "UTMALDG"))
        for op in ops + ("F2FP.SATFINITE.E4M3.F32.PACK_AB",):
            assert op in sass, (op, key)
        assert not re.search(r"\b(HGMMA|UTCHMMA)\b", sass), key
        assert len(re.findall(r"\b(LDL|STL)\b", sass)) <= spill_bound(backend, key), ("local memory", key)
        assert ("F2FP.BF16.F32.PACK_AB" in sass) != f.is_split, key
        if backend == "sm100" and (f.has_seqused_k or f.paged):  # a cache's V tail zeroed in smem, a byte a value
            assert "STS.U8" in sass, key


@pytest.mark.slow
def test_two_level_sass(artifacts):
    # fp8_two_level_interval: the P V QGMMA (A from registers) takes a run-time scale-d
    # predicate (a uniform one: O restarts from zero after each flush), a constant zero-init
    # at interval 1 (every P V flushed), the flush adds FFMAs, and the wgmma groups stay as
    # many as without the option (no serialization); local memory within ``spill_bound``
    # (the tiles are planned for it: ``config.two_level_fits``).
    keys, out_dir, _ = artifacts("sm90", "sm_90a")
    pairs = two_level_pairs("sm_90a")
    assert len(pairs) == 5
    for with_tl, without in pairs:
        f = fields("sm90", with_tl)
        assert f.extra[-1] in ("two_level4", "two_level1") and not any("two_level" in str(x) for x in without)
        sass_of = lambda k: list((out_dir / f"k{keys.index(k)}").glob("*.sass"))
        if not sass_of(with_tl):
            pytest.skip("no usable nvdisasm (pip install nvidia-cuda-nvdisasm): no SASS to check")
        sass, plain = sass_of(with_tl)[0].read_text(), sass_of(without)[0].read_text()
        pv = r"QGMMA\.64x\d+x32\.F32\.E4M3\.E4M3 R\d+, R\d+, gdesc\[UR\d+\], "
        first = pv + (r"RZ, !UPT" if f.extra[-1] == "two_level1" else r"R\d+, !?UP\d")
        assert re.search(first, sass), with_tl
        assert not re.search(pv + r"(RZ, !UPT|R\d+, !?UP\d)", plain), without
        hist, hist_plain = (sass_histogram(out_dir / f"k{keys.index(k)}")[0] for k in (with_tl, without))
        for op in ("WARPGROUP.ARRIVE", "WARPGROUP.DEPBAR.LE"):
            assert hist.get(op) == hist_plain.get(op), (op, with_tl)
        assert hist["FFMA"] > hist_plain["FFMA"], with_tl
        assert len(re.findall(r"\b(LDL|STL)\b", sass)) <= spill_bound("sm90", with_tl), ("local memory", with_tl)


@pytest.mark.slow
def test_dynamic_tiles_sass(artifacts):
    # "Dynamic" persistent SM90 kernels over masked (LPT) tiles draw the next one with one
    # atomic add (producer warp 0) and hand it over through named barriers: TILE_FULL /
    # TILE_EMPTY (5, 6) with the consumers (their threads and warp 0's), and, where other
    # producer warps walk the tiles (FP8 Q, K, V: V transposes), 7 / 8 over the producer
    # warpgroup. The other kernels (the static persistent ones included) have neither.
    keys, out_dir, _ = artifacts("sm90", "sm_90a")
    listed = dynamic_tile_keys("sm_90a")
    assert len(listed) == 2 and all(fields("sm90", k).extra[1] == "dynamic" for k in listed)
    expected = {k: {(5, 288), (6, 288)} | ({(7, 128), (8, 128)} if fields("sm90", k).dtype_name == "e4m3" else set())
                for k in listed}
    seen = 0
    for i, key in enumerate(keys):
        f = fields("sm90", key)
        if len(f.flags) > 3 and f.flags[3] is not None:
            continue  # a user variant: masked or not by its own spec
        sass_files = list((out_dir / f"k{i}").glob("*.sass"))
        if not sass_files:
            pytest.skip("no usable nvdisasm (pip install nvidia-cuda-nvdisasm): no SASS to check")
        sass = sass_files[0].read_text()
        atomics = re.findall(r"\bATOMG\.E\.ADD\S*", sass)
        handout = {(int(b, 16), int(n, 16))
                   for b, n in re.findall(r"BAR\.(?:SYNC\.DEFER_BLOCKING|ARV) (0x[5-8]), (0x[0-9a-f]+)", sass)}
        if f.extra[1] == "dynamic" and (f.flags[0] or f.flags[1]) and not f.varlen_q:  # over LPT tiles
            seen += 1
            assert len(atomics) == 1 and handout, (key, atomics, handout)
            assert key not in expected or handout == expected[key], (key, handout)
        else:
            assert not atomics and not handout, key
    assert seen == 2


def sm90_loads(key):
    """The SM90 kernel's load instructions for a key: TMA for Q (unpacked) and for KV
    (unless paged rows are gathered); cp.async for packed-GQA Q rows and for gathered KV
    rows, whose stages complete through cp.async mbarrier arrives; 16-byte loads into
    registers for the Q the kernel quantizes (``keys.QUANTIZE_Q``)."""
    f = fields("sm90", key)
    pack, gather_kv = f.qhead_per_kvhead_packed, f.extra[0]
    ops = ["LDG.E.128" if QUANTIZE_Q in f.extra else "LDGSTS" if pack > 1 else "UTMALDG"]
    ops += ["LDGSTS", "ARRIVES.LDGSTSBAR"] if gather_kv else ["UTMALDG"]
    return ops


@pytest.mark.slow
def test_quantized_q_sass(artifacts):
    # 16-bit Q over an e4m3 cache, quantized in the kernel: both GEMMs on fp8 operands
    # (QGMMA e4m3 x e4m3, no HGMMA), Q loaded into registers by 16-byte loads, converted in
    # pairs (F2FP.SATFINITE.E4M3: Q and P) and stored 8 bytes a chunk into sQ, V transposed
    # by ldmatrix / stmatrix.trans; O out in q's dtype (16-bit pairs) unless split; no local
    # memory at all.
    keys, out_dir, _ = artifacts("sm90", "sm_90a")
    qkeys = quantized_q_keys("sm_90a")
    assert len(qkeys) == len(set(qkeys)) == len(quantized_q_problems())
    for key in qkeys:
        f = fields("sm90", key)
        assert QUANTIZE_Q in f.extra and "/e4m3" in f.dtype_name, key
        sass_files = list((out_dir / f"k{keys.index(key)}").glob("*.sass"))
        if not sass_files:
            pytest.skip("no usable nvdisasm (pip install nvidia-cuda-nvdisasm): no SASS to check")
        sass = sass_files[0].read_text()
        out_pack = "F2FP.F16.F32.PACK_AB" if f.dtype_name.startswith("fp16") else "F2FP.BF16.F32.PACK_AB"
        for op in ("QGMMA.64x", ".E4M3.E4M3", "F2FP.SATFINITE.E4M3.F32.PACK_AB", "STS.64", "LDSM.16.M88.4",
                   "STSM.16.MT88.4", *sm90_loads(key)):
            assert op in sass, (op, key)
        assert not re.search(r"\bHGMMA\b", sass), key
        assert (out_pack in sass) != f.is_split, key
        assert len(re.findall(r"\b(LDL|STL)\b", sass)) == 0, ("local memory", key)


@pytest.mark.slow
def test_box_sass(artifacts):
    # Pages smaller than a KV block read by TMA boxes: each K and V block is boxes x the
    # 128-byte-wide TMAs of a row (16-bit d 128, e4m3 d 256: two) of bulk-tensor loads, every one after its
    # own page-table entry; the KV rows never by cp.async (LDGSTS only for packed Q rows);
    # local memory within the bound (``spill_bound``).
    keys, out_dir, _ = artifacts("sm90", "sm_90a")
    for (name, problem, boxes), key in zip(box_problems(), box_keys("sm_90a")):
        f = fields("sm90", key)
        assert not f.extra[0] and any(parse_kv_box(x) for x in f.extra), (name, key)
        sass_files = list((out_dir / f"k{keys.index(key)}").glob("*.sass"))
        if not sass_files:
            pytest.skip("no usable nvdisasm (pip install nvidia-cuda-nvdisasm): no SASS to check")
        sass = sass_files[0].read_text()
        per_row = max(1, problem.d * (1 if problem.kv_fp8 or problem.qkv_fp8 else 2) // 128)  # 128-byte TMAs
        loads = len(re.findall(r"\bUTMALDG\b", sass))
        # K and V of the first block, then the loop's K and V (its body unrolled once or not):
        # at least two blocks' boxes each for K and V, Q's TMA aside.
        assert loads >= 4 * boxes * per_row, (name, loads, boxes)
        assert "ARRIVES.LDGSTSBAR" not in sass, name
        assert f.qhead_per_kvhead_packed > 1 or QUANTIZE_Q in f.extra or "LDGSTS" not in sass, name
        assert len(re.findall(r"\b(LDL|STL)\b", sass)) <= spill_bound("sm90", key), ("local memory", name)


@pytest.mark.slow
def test_sm100_box_sass(artifacts):
    # The SM100 kernel over pages that hold no whole block: a block's boxes come from one
    # TMA site in a loop of boxes (K's first block, the KV loop's K and V, V's last block:
    # four sites of the 128-byte-wide TMAs of a row, 16-bit d 128: two, d 192: three, e4m3
    # operands or staging at d 128: one), after the page-table reads of all the block's
    # boxes; no local memory (the boxes unrolled, ptxas kept the shared-memory base on the
    # stack of every role: ``_load_boxes``).
    keys, out_dir, _ = artifacts("sm100", "sm_100a")
    for (name, problem, _, _, boxes), key in zip(sm100_box_problems(), sm100_box_keys("sm_100a")):
        f = fields("sm100", key)
        assert any(parse_kv_box(x) == 128 // boxes for x in f.extra), (name, key)
        sass_files = list((out_dir / f"k{keys.index(key)}").glob("*.sass"))
        if not sass_files:
            pytest.skip("no usable nvdisasm (pip install nvidia-cuda-nvdisasm): no SASS to check")
        sass = sass_files[0].read_text()
        elem = 1 if problem.kv_fp8 or problem.qkv_fp8 else 2
        per_row = lambda d: max(1, d * elem // 128)
        assert loop_ops(sass, r"\bUTMALDG\b") >= 2 * (per_row(problem.d) + per_row(problem.d_v)), name
        assert len(re.findall(r"\bLDG\b", sass)) >= 4 * boxes, name  # each site's entries
        assert not re.findall(r"\b(LDL|STL)\b", sass), ("local memory", name)


def test_plan_is_what_the_launcher_compiles():
    # compile_key(problem, plan) is the whole identity of a binary: a different tile,
    # pack or split decision yields a different key.
    from test_validation import _problem

    module = seam.backend_module("sm80")
    decode = _problem(nheads=32, nheads_kv=8, max_seqlen_k=131072, has_seqused_k=True)
    plan = module.plan(decode, 0, None, 132)
    assert plan.pack_gqa and plan.num_splits > 1 and plan.config.tile_m == 64
    key = module.compile_key(decode, plan, "sm_90a")
    assert key[1] == "sm_90a" and module.compile_key(decode, plan._replace(num_splits=1), "sm_90a") != key
    assert module.plan(decode, 1, False, None).num_splits == 1


# cache_leftpad over a paged cache (FwdProblem.leftpad_k, FwdArgs.mLeftpadK): the SM80
# kernel (its row gathers add the start) and the SM90 kernel (row gathers for every page
# size, a start inside a page moving each block off the pages' TMA boxes); the SM100 kernel
# refuses it (its check), so a B200 runs the SM80 kernel.
LEFTPAD_CASES = [("sm80", "sm_80"), ("sm80", "sm_90a"), ("sm90", "sm_90a")]


def leftpad_problems(arch):
    """(problem, num_splits): a split decode step over pages of 16 and a prefill chunk over
    pages of 128 (SM90: TMA-sized pages, gathered here), and FP8 K/V over pages of 64 (not
    for sm_80: no fp8 conversions)."""
    base = seam.FwdProblem(dtype=BF16, batch=4, max_seqlen_q=1, max_seqlen_k=4096, nheads=32, nheads_kv=8, d=128,
                          d_v=128, softmax_scale=128 ** -0.5, causal=True, window_left=-1, window_right=0,
                          softcap=0.0, varlen_q=False, varlen_k=False, has_seqused_k=True, page_size=16,
                          has_lse=True, leftpad_k=True)
    problems = [(base, 3), (base._replace(page_size=128, max_seqlen_q=256), 1)]
    if arch != "sm_80":
        problems.append((base._replace(page_size=64, kv_dtype=torch.float8_e4m3fn), 0))
    return problems


def leftpad_key_pairs(backend, arch):
    """[(key with leftpad_k, the same problem's key without)]; FP8 K/V on SM90 by the widening
    kernel (the quantizing one: ``quantized_q_keys``)."""
    module = seam.backend_module(backend)
    tuning = WIDEN if backend == "sm90" else NO_TUNING
    key = lambda p, ns: module.compile_key(p, module.plan(p, ns, True, 132, tuning=tuning), arch)
    return [(key(p, ns), key(p._replace(leftpad_k=False), ns)) for p, ns in leftpad_problems(arch)]


@pytest.fixture(scope="module")
def leftpad_artifacts(tmp_path_factory):
    cache = {}

    def get(backend, arch):
        if (backend, arch) not in cache:
            keys = [k for pair in leftpad_key_pairs(backend, arch) for k in pair]
            entries = [(f"k{i}", f"flash_attn_cute.{backend}:compile", key) for i, key in enumerate(keys)]
            cache[backend, arch] = keys, *compile_entries(arch, entries, tmp_path_factory.mktemp(f"lp_{backend}"))
        return cache[backend, arch]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("backend,arch", LEFTPAD_CASES)
def test_leftpad_compiles_and_sass(leftpad_artifacts, backend, arch):
    keys, out_dir, _ = leftpad_artifacts(backend, arch)
    for i, key in enumerate(keys):
        cubins = list((out_dir / f"k{i}").glob(f"*.{arch}.cubin"))
        assert len(cubins) == 1 and cubins[0].read_bytes()[:4] == b"\x7fELF", key
    pairs = leftpad_key_pairs(backend, arch)
    if backend == "sm90":  # without key starts: pages of 16 in TMA boxes, of 64 and 128 whole blocks by TMA
        assert [fields(backend, without).extra[0] for _, without in pairs] == [False, False, False]
        assert parse_kv_box(fields(backend, pairs[0][1]).extra[-1]) == 16
    for with_lp, without in pairs:
        f, g = fields(backend, with_lp), fields(backend, without)
        # The ``paged`` field differs (keys.PAGED_LEFTPAD); on SM90 also the plan's gathers.
        assert f.leftpad_k and not g.leftpad_k and f.paged and g.paged is True
        assert [i for i, (x, y) in enumerate(zip(with_lp, without)) if x != y][0] == 5 + TILE_LEN[backend] + 7
        if backend == "sm90":
            assert f.extra[0], "a paged cache with key starts is gathered"
        sass_of = lambda k: list((out_dir / f"k{keys.index(k)}").glob("*.sass"))
        if not sass_of(with_lp):
            pytest.skip("no usable nvdisasm (pip install nvidia-cuda-nvdisasm): no SASS to check")
        sass = sass_of(with_lp)[0].read_text()
        for op in SASS_EXPECT[backend] + (sm90_loads(with_lp) if backend == "sm90" else []):
            assert op in sass, (op, with_lp)
        if backend == "sm90":
            assert not re.search(r"\bUTMALDG\b", sass) or f.qhead_per_kvhead_packed == 1  # KV never by TMA
        bound = spill_bound(backend, with_lp)
        assert bound is None or len(re.findall(r"\b(LDL|STL)\b", sass)) <= bound, ("local memory", with_lp)
        assert sass_histogram(out_dir / f"k{keys.index(with_lp)}")[0] != \
            sass_histogram(out_dir / f"k{keys.index(without)}")[0], "the key starts are read"


def test_leftpad_refused_by_sm100():
    p = leftpad_problems("sm_100a")[0][0]._replace(page_size=128)
    assert "cache_leftpad with a paged cache" in seam.backend_module("sm100").check(p)
    assert seam.backend_module("sm100").check(p._replace(leftpad_k=False)) is None
