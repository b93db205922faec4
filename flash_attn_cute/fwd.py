"""The dispatch seam of the forward pass: problem -> plan -> launch (-> combine).

``interface.py`` validates the user's arguments and describes the call once as a
``FwdProblem`` (shapes, dtype, variant, layout flags; no tensors). A backend module
(``sm80``, ``sm90``, ... registered in ``BACKENDS``) owns everything
architecture-specific about it:

- ``HEAD_DIMS``: the head dimensions it compiles;
- ``runs_on(capability) -> bool`` and ``AUTO``: the GPUs it runs on, and whether
  ``backend=None`` picks it there (every registered backend does today; the README
  marks SM100 as compile-verified);
- ``check(problem) -> str | None``: why it cannot run the problem (None: it can);
- ``plan(problem, num_splits, pack_gqa, num_sms) -> FwdPlan``: its tile, whether to pack
  GQA heads, how many KV splits (0 = its own heuristic, on ``num_sms`` SMs);
- ``compile_key(problem, plan)`` and ``compile(key)``: the binary, a pure function of a
  short key (ahead-of-time builds and the compile tests use these two directly);
- ``launcher(problem, plan)``: a callable ``(q, k, v, out, lse, cu_seqlens_q,
  cu_seqlens_k, seqused_k, page_table)`` with the compiled kernel and every runtime
  scalar already bound.

``run_fwd`` resolves backend, plan, launcher and combine once per distinct problem and
keeps them in a small cache, so a repeated call (a decode loop) costs one dict lookup
before the launch: no planning, no key building, no device query.
"""

from __future__ import annotations

import importlib
import logging
import math
from typing import Callable, NamedTuple, Optional

import torch

from .heuristics import MAX_SPLITS

__all__ = ["FwdProblem", "FwdPlan", "BACKENDS", "backend_module", "select_backend", "resolve", "run_fwd",
           "run_resolved", "clear_plan_cache", "MAX_SPLITS"]

# One line per backend: name -> module exposing HEAD_DIMS, check, plan, compile_key,
# compile, launcher. Imported on first use.
BACKENDS = {
    "sm80": "flash_attn_cute.sm80",
    "sm90": "flash_attn_cute.sm90",
    "sm100": "flash_attn_cute.sm100",
}
_PLAN_CACHE_SIZE = 4096  # distinct problems remembered; a serving loop repeats a handful

log = logging.getLogger("flash_attn_cute")


class FwdProblem(NamedTuple):
    """One forward call, described without its tensors (hashable: the plan cache key).

    ``max_seqlen_k`` is the bound the planner may assume (the cache capacity when the
    per-sequence lengths live on the device); ``page_size`` is 0 without a page table."""

    dtype: torch.dtype
    batch: int
    max_seqlen_q: int
    max_seqlen_k: int
    nheads: int
    nheads_kv: int
    d: int
    d_v: int
    softmax_scale: float
    causal: bool  # bottom-right causal; with a left window it is local with window_right 0
    window_left: int  # -1: unbounded
    window_right: int  # -1: unbounded (0 under causal)
    softcap: float  # 0: off
    varlen_q: bool
    varlen_k: bool
    has_seqused_k: bool
    page_size: int  # 0: not paged
    has_lse: bool
    variant: Optional[object] = None  # user_variants.VariantSpec (score_mod / mask_mod / block mask)

    @property
    def qhead_per_kvhead(self) -> int:
        return self.nheads // self.nheads_kv

    @property
    def local(self) -> bool:
        """A bounded window other than plain causal (kernels then take the Local variant)."""
        return self.window_left >= 0 or (self.window_right >= 0 and not self.causal)

    @property
    def paged(self) -> bool:
        return self.page_size > 0

    @property
    def variant_flags(self) -> tuple:
        """(causal, local, softcap) as the kernels' variants take them (local wins over
        causal), then the user variant's key when there is one."""
        flags = (self.causal and not self.local, self.local, self.softcap > 0)
        return flags if self.variant is None else flags + (self.variant.key,)


class FwdPlan(NamedTuple):
    """What a backend decided for a problem."""

    backend: str
    tile: tuple  # backend-specific static tile configuration (part of the compile key)
    pack_gqa: bool
    num_splits: int
    q_stage: int = 1  # SM100: tensor-core pipelines per Q tile

    def qhead_per_kvhead_packed(self, problem: FwdProblem) -> int:
        """Rows per query position in the M tile: the GQA ratio when packed, else 1."""
        return problem.qhead_per_kvhead if self.pack_gqa else 1


def plan_rows(problem: FwdProblem, pack_gqa: Optional[bool], tile_m: int = 128, packable: bool = True) -> tuple:
    """(pack_gqa, rows per KV head group): ``pack_gqa`` None takes FA3's rule on a
    ``tile_m``-row tile; packing needs GQA and a ratio the backend can pack."""
    from . import heuristics

    ratio = problem.qhead_per_kvhead
    if pack_gqa is None:
        pack_gqa = heuristics.should_pack_gqa(problem.max_seqlen_q, ratio, tile_m, varlen_q=problem.varlen_q)
    pack_gqa = bool(pack_gqa and ratio > 1 and packable)
    return pack_gqa, problem.max_seqlen_q * (ratio if pack_gqa else 1)


def plan_splits(problem: FwdProblem, num_splits: int, num_sms: Optional[int], pack_gqa: bool, rows: int, *,
                tile_m: int, tile_n: int, ctas_per_sm: int, tolerance: float = 0.95) -> int:
    """``heuristics.resolve_num_splits`` on the grid a backend launches: one CTA per
    (batch, head group, m-block) of its tile, ``ctas_per_sm`` resident per SM."""
    from . import heuristics

    return heuristics.resolve_num_splits(
        num_splits, num_sms, ctas=problem.batch * (problem.nheads_kv if pack_gqa else problem.nheads), rows=rows,
        max_seqlen_k=problem.max_seqlen_k, tile_m=tile_m, tile_n=tile_n, ctas_per_sm=ctas_per_sm,
        tolerance=tolerance)


def backend_module(name: str):
    """The module of a registered backend (imported on first use)."""
    return importlib.import_module(BACKENDS[name])


def _by_capability(capability: tuple) -> str:
    """The preferred backend for a GPU: the newest registered one that runs on it and is
    chosen automatically (``AUTO``), else SM80."""
    for cand in ("sm100", "sm90"):
        if cand in BACKENDS:
            module = backend_module(cand)
            if module.AUTO and module.runs_on(capability):
                return cand
    return "sm80"


def select_backend(requested: Optional[str], problem: FwdProblem, device) -> tuple:
    """(backend name, module) to run ``problem`` on ``device``.

    ``requested`` (already validated, see ``interface._backend_name``) must accept the
    problem or the call fails naming its reason. ``None`` takes the backend of the GPU's
    generation and falls back to SM80, logging why, when that backend's ``check``
    refuses the problem."""
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 0):
        raise RuntimeError(f"flash_attn_cute needs a GPU of compute capability >= 8.0, "
                           f"{device} has {major}.{minor}")
    if requested is not None:
        module = backend_module(requested)
        reason = module.check(problem)
        if reason is None and not module.runs_on((major, minor)):
            reason = f"its kernels do not run on compute capability {major}.{minor} ({device})"
        if reason is not None:
            raise NotImplementedError(f"backend {requested!r} cannot run this call: {reason}")
        return requested, module
    name = _by_capability((major, minor))
    module = backend_module(name)
    reason = module.check(problem)
    if reason is not None and name != "sm80":
        log.info("flash_attn_cute: %s kernel refused the call (%s); running the SM80 kernel", name, reason)
        name, module = "sm80", backend_module("sm80")
        reason = module.check(problem)
    if reason is not None:
        raise NotImplementedError(f"no kernel runs this call: {reason}")
    return name, module


def key_fields(problem: FwdProblem, plan: FwdPlan) -> tuple:
    """What every forward kernel's compile key holds after its backend's tile, in order:
    the variant flags, the packed GQA ratio, split on/off, LSE out (a split kernel always
    writes partial LSEs), varlen q/k, seqused_k, paged."""
    return (problem.variant_flags, plan.qhead_per_kvhead_packed(problem), plan.num_splits > 1,
            problem.has_lse or plan.num_splits > 1, problem.varlen_q, problem.varlen_k, problem.has_seqused_k,
            problem.paged)


def make_key(name: str, arch: str, dtype_name: str, d: int, d_v: int, tile: tuple, flags, pack, is_split, has_lse,
             varlen_q, varlen_k, has_seqused_k, paged, extra: tuple = ()) -> tuple:
    """A forward compile key: ``("fwd_<name>", arch, dtype, d, d_v, *tile, flags, pack, is_split,
    has_lse, varlen_q, varlen_k, has_seqused_k, paged, *extra)``, the tile already in the
    backend's canonical form (its fields spread into the key); ``extra``: static choices of
    the backend's own, last."""
    flags = tuple(bool(f) for f in flags[:3]) + tuple(flags[3:])  # [user variant key]
    return (f"fwd_{name}", arch, dtype_name, d, d_v, *tile, flags, int(pack),
            bool(is_split), bool(has_lse), bool(varlen_q), bool(varlen_k), bool(has_seqused_k), bool(paged),
            *extra)


class KeyFields(NamedTuple):
    """A forward compile key read back (``parse_key``)."""

    arch: str
    dtype_name: str
    d: int
    d_v: int
    tile: tuple
    flags: tuple  # (causal, local, softcap[, user variant key])
    pack: int
    is_split: bool
    has_lse: bool
    varlen_q: bool
    varlen_k: bool
    has_seqused_k: bool
    paged: bool
    extra: tuple  # the backend's own fields after the common ones


def parse_key(key: tuple, tile_len: int) -> KeyFields:
    """``make_key``'s inverse, for a backend whose tile has ``tile_len`` fields."""
    rest = 5 + tile_len
    return KeyFields(*key[1:5], tuple(key[5:rest]), *key[rest:rest + 8], tuple(key[rest + 8:]))


def backend_key(name: str, problem: FwdProblem, plan: FwdPlan, arch: str, tile: Optional[tuple] = None,
                extra: tuple = ()) -> tuple:
    """A backend's ``compile_key``: ``make_key`` on the problem and plan (``tile``: the plan's
    tile in the backend's canonical form, default the plan's own)."""
    from .cute_utils import DTYPE_NAMES

    return make_key(name, arch, DTYPE_NAMES[problem.dtype], problem.d, problem.d_v,
                    plan.tile if tile is None else tile, *key_fields(problem, plan), extra)


_NO_VARIANT = (None,) * 5  # the aux slots and block ranges (user_variants.MAX_AUX + 1)


def bind_launcher(name: str, key: tuple, compile_fn: Callable, problem: FwdProblem, plan: FwdPlan,
                  extra_scalars: tuple = ()) -> Callable:
    """The backends' ``launcher``: the kernel compiled for ``key`` (``jit_cache``, under
    ``fwd_<name>``) with the runtime scalars every forward kernel takes after its tensors
    (softmax_scale, window_left, window_right, softcap, num_splits, max_seqlen_q, batch,
    then ``extra_scalars``) bound. Split kernels get fp32 partials as out/lse; a user
    variant's tensors (``variant_tensors``: the aux slots, the block ranges) follow the
    page table."""
    from . import jit_cache

    fn = jit_cache.get_or_compile(f"fwd_{name}", key, lambda: compile_fn(key))
    scalars = (float(problem.softmax_scale), int(problem.window_left), int(problem.window_right),
               float(problem.softcap), int(plan.num_splits), int(problem.max_seqlen_q), int(problem.batch),
               *extra_scalars)

    def launch(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table, variant_tensors=_NO_VARIANT):
        fn(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table, *variant_tensors, *scalars)

    return launch


def backend_entry_points(name: str, kernel_module: str, compile_fn: str,
                         tile: Callable = lambda plan: plan.tile, key_extra: Callable = lambda problem, plan: (),
                         extra_scalars: Callable = lambda problem: ()):
    """A backend's ``compile_key``, ``compile`` and ``launcher`` (the seam's last three
    functions), the same for every forward kernel: ``compile_fn`` of ``kernel_module``
    (imported on first compile: it imports the DSL) compiles a key; ``tile(plan)`` is the
    plan's tile in the key's canonical form; ``key_extra(problem, plan)``, the backend's own
    key fields (``make_key``); ``extra_scalars(problem)``, the runtime scalars the kernel
    takes after the common ones (``bind_launcher``)."""

    def compile_key(problem: FwdProblem, plan: FwdPlan, arch: Optional[str] = None) -> tuple:
        from .cute_utils import target_arch

        return backend_key(name, problem, plan, arch or target_arch(), tile(plan), key_extra(problem, plan))

    def compile(key: tuple):
        return getattr(importlib.import_module(kernel_module), compile_fn)(key)

    def launcher(problem: FwdProblem, plan: FwdPlan) -> Callable:
        """``launch(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table)``."""
        return bind_launcher(name, compile_key(problem, plan), compile, problem, plan, extra_scalars(problem))

    return compile_key, compile, launcher


def combine_launcher(out_dtype: torch.dtype, d_v: int, has_lse: bool) -> Callable:
    """The compiled split-KV combine (see ``combine.combine_launcher``); imported lazily."""
    from .combine import combine_launcher as launcher

    return launcher(out_dtype, d_v, has_lse)


class _Resolved(NamedTuple):
    plan: FwdPlan
    launch: Callable
    combine: Optional[Callable]  # set when plan.num_splits > 1


_plan_cache: dict = {}


def clear_plan_cache() -> None:
    """Forget every resolved plan (tests that fake the device call this)."""
    _plan_cache.clear()


def _resolve(problem: FwdProblem, requested: Optional[str], num_splits: int, pack_gqa: Optional[bool],
             device) -> _Resolved:
    name, module = select_backend(requested, problem, device)
    num_sms = None
    if num_splits == 0:
        from . import heuristics

        num_sms = heuristics.num_sms(device)
    plan = module.plan(problem, num_splits, pack_gqa, num_sms)
    combine = combine_launcher(problem.dtype, problem.d_v, problem.has_lse) if plan.num_splits > 1 else None
    return _Resolved(plan, module.launcher(problem, plan), combine)


def resolve(problem: FwdProblem, requested: Optional[str], num_splits: int, pack_gqa: Optional[bool],
            device) -> _Resolved:
    """Backend, plan, bound launcher and combine for a problem, cached per distinct call."""
    cache_key = (problem, requested, num_splits, pack_gqa, device)
    hit = _plan_cache.get(cache_key)
    if hit is None:
        hit = _resolve(problem, requested, num_splits, pack_gqa, device)
        if len(_plan_cache) >= _PLAN_CACHE_SIZE:
            _plan_cache.clear()
        _plan_cache[cache_key] = hit
    return hit


def run_fwd(problem: FwdProblem, q, k, v, out, lse, *, cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None,
            page_table=None, requested: Optional[str] = None, num_splits: int = 1,
            pack_gqa: Optional[bool] = None, variant_tensors: tuple = _NO_VARIANT) -> None:
    """Plan, launch and (for split-KV) combine into ``out`` / ``lse`` (allocated by the caller)."""
    run_resolved(resolve(problem, requested, num_splits, pack_gqa, q.device), problem, q, k, v, out, lse,
                 cu_seqlens_q, cu_seqlens_k, seqused_k, page_table, variant_tensors)


def run_resolved(resolved: _Resolved, problem: FwdProblem, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                 seqused_k, page_table, variant_tensors: tuple = _NO_VARIANT) -> None:
    """``run_fwd`` with the resolution already done (the public API's per-call cache)."""
    ns = resolved.plan.num_splits
    # A user variant's tensors ride along only when there is one: the plain launch keeps
    # the nine-argument contract (and one argument less on the decode hot path).
    extra = (variant_tensors,) if problem.variant is not None else ()
    if ns == 1:
        resolved.launch(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table, *extra)
        return
    lse_shape = (problem.nheads, q.shape[0]) if problem.varlen_q else (problem.batch, problem.nheads, q.shape[1])
    o_shape = (ns, *q.shape[:-1], problem.d_v)
    # One allocation for both partials (host time: one allocator call less per call).
    o_numel = math.prod(o_shape)
    partials = q.new_empty((o_numel + ns * math.prod(lse_shape),), dtype=torch.float32)
    out_partial = partials[:o_numel].view(o_shape)
    lse_partial = partials[o_numel:].view(ns, *lse_shape)
    resolved.launch(q, k, v, out_partial, lse_partial, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table, *extra)
    if problem.varlen_q:  # the combine contract is batched: view packed rows as batch 1
        resolved.combine(out_partial.unsqueeze(1), lse_partial.unsqueeze(1), out.unsqueeze(0),
                         None if lse is None else lse.unsqueeze(0))
    else:
        resolved.combine(out_partial, lse_partial, out, lse)
