"""What every backend module builds its seam entry points from (see ``seam/__init__.py``): row and
split planning on its own tile, compile keys from (problem, plan), and the launcher that
binds a compiled kernel's runtime scalars. Plain Python: the kernel module (and the DSL)
is imported when a key is first compiled."""

from __future__ import annotations

import importlib
from typing import Callable, Optional

from flash_attn_cute.host import heuristics, jit_cache
from flash_attn_cute.host.constants import KEYS_PER_SPLIT, MAX_SPLITS, MLA_MAX_NHEADS, padded_head_dims
from flash_attn_cute.host.keys import dtype_key, make_key, mla_heads_key, mla_key, target_arch
from flash_attn_cute.host.problems import FwdPlan, FwdProblem, MlaProblem

# A user variant's kernel tensors when there is none: the aux slots and the block ranges
# (user_variants.MAX_AUX + 1).
NO_VARIANT = (None,) * 5


# Problem features a forward kernel must implement explicitly: (field, what it is).
FEATURES = (("has_sink", "learnable_sink"), ("has_seqused_q", "seqused_q"), ("batch_invariant", "batch_invariant"),
            ("kv_fp8", "fp8_kv"), ("qkv_fp8", "fp8_qkv"), ("leftpad_k", "paged_leftpad"))
# MLA has no sinks, no query counts
MLA_FEATURES = (("batch_invariant", "batch_invariant"), ("kv_fp8", "fp8_kv"), ("q_fp8", "fp8_q"))


def feature_refusal(problem, supported: frozenset, fields: tuple = FEATURES) -> Optional[str]:
    """Why a backend implementing ``supported`` (names of ``fields``: the forward's
    ``FEATURES``, or the subset another problem kind has) cannot run the problem's
    features (None: it can)."""
    for field, name in fields:
        if getattr(problem, field) and name not in supported:
            return f"{name} is not implemented by this kernel"
    if problem.batch_invariant and problem.max_seqlen_k > KEYS_PER_SPLIT * MAX_SPLITS:
        return (f"batch_invariant covers at most {KEYS_PER_SPLIT * MAX_SPLITS} keys ({MAX_SPLITS} splits of "
                f"{KEYS_PER_SPLIT}), got max_seqlen_k {problem.max_seqlen_k}")
    return None


def tile_head_dims(problem: FwdProblem, pairs=None) -> Optional[tuple]:
    """(d, d_v) of the tile a backend compiles for the problem's head dims: the smallest of
    its ``pairs`` (None: every pair of ``constants.HEAD_DIM_TILES``) that holds them, the
    columns past them padded inside the kernel; None when none holds them."""
    return padded_head_dims(problem.d, problem.d_v, pairs)


def head_dim_refusal(problem: FwdProblem, pairs=None) -> Optional[str]:
    """Why a backend whose tiles are ``pairs`` cannot run the problem's head dims (None:
    it can, padded to ``tile_head_dims``)."""
    if tile_head_dims(problem, pairs) is None:
        what = "up to 256 each" if pairs is None else f"inside one of the (d, d_v) tiles {tuple(pairs)}"
        return f"head dims (d, d_v) = ({problem.d}, {problem.d_v}) must be {what}"
    return None


def mla_refusal(problem: MlaProblem, supported: frozenset) -> Optional[str]:
    """An MLA backend's ``check``: the query heads its kernels pack (1 to ``MLA_MAX_NHEADS``,
    a multiple of the KV heads), and the features it implements (``supported``, names of
    ``MLA_FEATURES``)."""
    if not 1 <= problem.nheads <= MLA_MAX_NHEADS:
        return f"nheads {problem.nheads} is outside 1..{MLA_MAX_NHEADS}"
    if problem.nheads_kv < 1 or problem.nheads % problem.nheads_kv:
        return f"nheads {problem.nheads} is not a multiple of nheads_kv {problem.nheads_kv}"
    return feature_refusal(problem, supported, MLA_FEATURES)


def plan_rows(problem: FwdProblem, pack_gqa: Optional[bool], tile_m: int = 128, packable: bool = True) -> tuple:
    """(pack_gqa, rows per KV head group): ``pack_gqa`` None takes FA3's rule on a
    ``tile_m``-row tile; packing needs GQA and a ratio the backend can pack."""
    ratio = problem.qhead_per_kvhead
    if pack_gqa is None:
        pack_gqa = heuristics.should_pack_gqa(problem.max_seqlen_q, ratio, tile_m, varlen_q=problem.varlen_q)
    pack_gqa = bool(pack_gqa and ratio > 1 and packable)
    return pack_gqa, problem.max_seqlen_q * (ratio if pack_gqa else 1)


def plan_splits(problem, num_splits: int, num_sms: Optional[int], head_groups: int, rows: int, *, tile_m: int,
                tile_n: int, ctas_per_sm: int, tolerance: float = 0.95, kernel_tile_n: Optional[int] = None) -> tuple:
    """(num_splits, split_blocks) of a backend's plan. Batch invariant: ``invariant_splits``
    on the kernel's KV tile (``kernel_tile_n``, default ``tile_n``; ``num_splits`` ignored).
    Otherwise ``heuristics.resolve_num_splits`` on the grid a backend launches: one CTA per
    (batch, head group, m-block of ``rows``) of a ``tile_m`` x ``tile_n`` tile,
    ``ctas_per_sm`` resident per SM, and split_blocks 0 (even splits)."""
    if problem.batch_invariant:
        return invariant_splits(problem, kernel_tile_n or tile_n)
    return heuristics.resolve_num_splits(
        num_splits, num_sms, ctas=problem.batch * head_groups, rows=rows, max_seqlen_k=problem.max_seqlen_k,
        tile_m=tile_m, tile_n=tile_n, ctas_per_sm=ctas_per_sm, tolerance=tolerance), 0


def invariant_splits(problem, tile_n: int) -> tuple:
    """(num_splits, split_blocks) of a batch-invariant plan on KV blocks of ``tile_n`` keys:
    ``split_blocks`` blocks (``KEYS_PER_SPLIT`` keys) per split from the sequence's first
    key, and the splits the longest sequence needs (``max_seqlen_k``: the cache capacity
    for a KV cache, so a captured graph fits every later length). Split s of a sequence
    then holds the same keys in any batch; splits past its end are empty (O 0, LSE -inf)
    and add exact zeros in the combine."""
    split_blocks = heuristics.ceildiv(KEYS_PER_SPLIT, tile_n)
    return max(1, heuristics.ceildiv(problem.max_seqlen_k, split_blocks * tile_n)), split_blocks


def head_groups(problem: FwdProblem, pack_gqa: bool) -> int:
    """CTAs along the head mode: one per KV head when query heads are packed, else per query head."""
    return problem.nheads_kv if pack_gqa else problem.nheads


def fwd_key(name: str, problem: FwdProblem, plan: FwdPlan, arch: str, tile: tuple, extra: tuple = ()) -> tuple:
    """A forward backend's compile key (``keys.make_key``): ``tile`` and ``extra`` are the
    fields of the plan's config that go before and after the common ones."""
    return make_key(name, arch, dtype_key(problem.dtype, problem.kv_dtype), problem.d, problem.d_v, tile,
                    problem.variant_flags,
                    plan.qhead_per_kvhead_packed(problem), plan.is_split,
                    problem.has_lse or plan.is_split,  # a split kernel always writes partial LSEs
                    problem.varlen_q, problem.varlen_k, problem.has_seqused_k, problem.paged, problem.has_seqused_q,
                    problem.has_sink, plan.config.split_blocks, problem.q_class, extra, leftpad_k=problem.leftpad_k)


def entry_points(key: Callable, kernel_module: str, compile_fn: str, scalars: Callable,
                 call_tensors: Optional[Callable] = None):
    """A backend's ``compile_key``, ``compile`` and ``launcher``: ``key(problem, plan, arch)``
    builds the key (its first field names the JIT cache entry), ``compile_fn`` of
    ``kernel_module`` compiles it, ``scalars(problem, plan, device)`` are the runtime
    scalars the kernel takes after its tensors; the launcher is ``launch(tensors)`` =
    ``fn(*tensors, *scalars)``, ``tensors`` the kind's kernel tensor list in the kernel's
    argument order (``api.call_args.FwdTensors`` / ``MlaTensors``). ``call_tensors(problem,
    plan)``, where given, returns ``make(tensors)`` (or None: nothing to make for that
    plan): arguments made anew for every launch (a workspace no two launches may share),
    passed after the scalars."""

    def compile_key(problem, plan: FwdPlan, arch: Optional[str] = None) -> tuple:
        return key(problem, plan, arch or target_arch())

    def compile(k: tuple):
        return getattr(importlib.import_module(kernel_module), compile_fn)(k)

    def launcher(problem, plan: FwdPlan, device=None) -> Callable:
        k = compile_key(problem, plan, target_arch(device))
        fn = jit_cache.get_or_compile(k[0], k, lambda: compile(k))
        bound = tuple(scalars(problem, plan, device))
        make = call_tensors(problem, plan) if call_tensors is not None else None
        if make is not None:
            return lambda tensors: fn(*tensors, *bound, *make(tensors))
        return lambda tensors: fn(*tensors, *bound)

    return compile_key, compile, launcher


def fwd_entry_points(name: str, kernel_module: str, compile_fn: str, key_tile: Callable,
                     key_extra: Callable = lambda config: (), extra_scalars: Callable = lambda problem, plan, device: (),
                     call_tensors: Optional[Callable] = None):
    """A forward backend's entry points: the key holds ``key_tile(plan.config)`` then the
    common fields (the config's ``split_blocks`` among them) then ``key_extra(plan.config)``;
    the launcher binds softmax_scale,
    window_left, window_right, softcap, num_splits, max_seqlen_q, batch, then
    ``extra_scalars(problem, plan, device)``, then ``call_tensors``'s per-launch arguments
    (``entry_points``), and takes ``launch(tensors)``, an ``api.call_args.FwdTensors``
    (split kernels get fp32 partials as out/lse and leave the sink to the combine)."""

    def key(problem: FwdProblem, plan: FwdPlan, arch: str) -> tuple:
        return fwd_key(name, problem, plan, arch, key_tile(plan.config), key_extra(plan.config))

    def scalars(problem: FwdProblem, plan: FwdPlan, device) -> tuple:
        return (float(problem.softmax_scale), int(problem.window_left), int(problem.window_right),
                float(problem.softcap), int(plan.num_splits), int(problem.max_seqlen_q), int(problem.batch),
                *extra_scalars(problem, plan, device))

    return entry_points(key, kernel_module, compile_fn, scalars, call_tensors)


def mla_entry_points(name: str, kernel_module: str, compile_fn: str, key_config: Callable):
    """An MLA backend's entry points: the key (``keys.mla_key``) ends with
    ``key_config(plan.config)`` (its fields but ``split_blocks``, a common one); the launcher
    binds softmax_scale, num_splits, max_seqlen_q and batch after the tensors of
    ``launch(tensors)``, an ``api.call_args.MlaTensors``."""

    def key(problem: MlaProblem, plan: FwdPlan, arch: str) -> tuple:
        return mla_key(name, arch, dtype_key(problem.dtype, problem.kv_dtype),
                       mla_heads_key(problem.qhead_per_kvhead, problem.kv_heads), problem.causal_key,
                       "schedule" if plan.scheduled else plan.is_split,
                       problem.has_lse or (plan.is_split and not plan.scheduled), plan.config.split_blocks,
                       key_config(plan.config))

    def scalars(problem: MlaProblem, plan: FwdPlan, device) -> tuple:
        return float(problem.softmax_scale), int(plan.num_splits), int(problem.max_seqlen_q), int(problem.batch)

    return entry_points(key, kernel_module, compile_fn, scalars)
