"""The forward entry points as specs of the run path (``entry.Spec``): ``FUNC``
(``flash_attn_func``), ``VARLEN`` (``flash_attn_varlen_func``) and ``KVCACHE``
(``flash_attn_with_kvcache`` without an append; with one: ``kv_cache_ops.APPEND``).

Each spec validates a call into its problem (``fwd_problem``) and builds the kernels'
tensors from the arguments by their slots (``call_args.fwd_tensors``); lookup, replay,
planning, launch and storage are ``entry.run``'s. Validation order inside each: shapes,
then dtypes, then scalars, then the device; every error names the argument.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from flash_attn_cute.api import checks
from flash_attn_cute.api.call_args import cp_tensors, fwd_tensors, kernel_descales, problem_flags
from flash_attn_cute.api.entry import Checked, Spec
from flash_attn_cute.host import user_variants
from flash_attn_cute.host.constants import INT32_MAX
from flash_attn_cute.host.problems import FwdProblem, out_dtype

Q4 = "(batch, seqlen_q, nheads, headdim)"
Q3 = "(total_q, nheads, headdim)"

# Cache-key arguments shared by the forward entry points (beyond their tensors).
OPTION_ARGS = ("softmax_scale", "causal", "softcap", "num_splits", "pack_gqa", "return_lse", "backend",
            "batch_invariant", "score_mod", "mask_mod", "block_mask", "window_size", *checks.CP_ARGS,
            "fp8_two_level_interval", "sm_margin", *checks.FA3_ARGS)
VARIANT_ARGS = ("q_descale", "k_descale", "v_descale", "aux_tensors")


class FwdExtra(NamedTuple):
    """What a forward replay needs beyond the problem and the plan (``call_cache.Entry.extra``)."""

    seqlens_fill: Optional[int] = None  # flash_attn_with_kvcache with an int cache_seqlens
    block_ranges: Optional[torch.Tensor] = None  # a block mask's ranges, broadcast to the call
    append: object = None  # the KV-cache append's launcher and layout (``kv_cache_ops``)


class Dims(NamedTuple):
    """What validation learnt of a call's sizes."""

    batch: int
    max_seqlen_q: int
    max_seqlen_k: int
    nheads: int
    nheads_kv: int
    d: int
    d_v: int


def fwd_problem(args: dict, dims: Dims, opts: checks.Options, variant, flags: Optional[dict] = None,
                cp: bool = False) -> FwdProblem:
    """The ``FwdProblem`` of validated arguments: sizes, options and the user variant,
    and the flags its tensors set by being there (``call_args.problem_flags``; ``flags``:
    those of tensors a pre-step makes, the append's); ``cp``: ``checks.context_parallel``'s.
    ``fp8_two_level_interval`` is kept for FP8 q or K/V only (0 otherwise: a 16-bit call's
    problem, and so its plan, is the same with any interval)."""
    q, k = args["q"], args["k"] if "k" in args else args["k_cache"]
    flags = {**problem_flags(fwd_tensors(args, out=q)), **(flags or {})}
    fp8 = q.dtype in checks.FP8_DTYPES or k.dtype in checks.FP8_DTYPES
    return FwdProblem(
        dtype=q.dtype, batch=dims.batch, max_seqlen_q=dims.max_seqlen_q, max_seqlen_k=dims.max_seqlen_k,
        nheads=dims.nheads, nheads_kv=dims.nheads_kv, d=dims.d, d_v=dims.d_v, softmax_scale=opts.softmax_scale,
        causal=opts.causal, window_left=opts.window_left, window_right=opts.window_right, softcap=opts.softcap,
        page_size=k.shape[1] if args.get("page_table") is not None else 0, has_lse=bool(args.get("return_lse")),
        variant=None if variant is None else variant[0], batch_invariant=opts.batch_invariant,
        kv_dtype=k.dtype if k.dtype in checks.FP8_DTYPES and q.dtype not in checks.FP8_DTYPES else None, cp=cp,
        fp8_two_level_interval=opts.fp8_two_level_interval if fp8 else 0, **flags)


def checked(args: dict, dims: Dims, opts: checks.Options, variant, seqlens_fill=None, append=None,
            flags: Optional[dict] = None) -> Checked:
    """The ``Checked`` call of validated forward arguments; no problem (an empty result)
    when every query sees no key (``max_seqlen_k == 0``: also a context-parallel rank
    holding no key yet) or there is no query."""
    q, out = args["q"], args.get("out")
    why_not = ("score_mod / mask_mod / block_mask" if variant is not None else
               "learnable_sink (add it once, in the merge: distributed.cp_merge(learnable_sink=))"
               if args.get("learnable_sink") is not None else None)
    cp = checks.context_parallel(args, dims.batch, opts.causal or opts.window_left >= 0 or opts.window_right >= 0,
                                 q.device, why_not)
    out_shape = (*q.shape[:-1], dims.d_v)
    lse_shape = (dims.nheads, q.shape[0]) if args.get("cu_seqlens_q") is not None else (dims.batch, dims.nheads,
                                                                                         q.shape[1])
    empty = ((out is not None and out.numel() == 0) or math.prod(out_shape) == 0 or dims.batch == 0
             or dims.max_seqlen_q == 0 or dims.max_seqlen_k == 0)
    problem = None if empty else fwd_problem(args, dims, opts, variant, flags, cp)
    block_ranges = None if variant is None else variant[2]
    return Checked(args, problem, out_shape, lse_shape, opts.backend, opts.num_splits, opts.pack_gqa,
                   FwdExtra(seqlens_fill, block_ranges, append), opts.sm_margin)


def launch_tensors(entry, args: dict, out, lse, **given):
    """The kernels' tensors of a forward call (``call_args.fwd_tensors``): the fp32 sink
    (a 16-bit one costs one small conversion per call, not a compiled variant per dtype),
    the descales as the kernel reads them, a user variant's aux tensors and block ranges;
    ``given`` replaces what a pre-step computed (the append's queries, lengths, offsets)."""
    problem = entry.problem
    sink = args.get("learnable_sink")
    k_descale, v_descale = kernel_descales(problem, args.get("k_descale"), args.get("v_descale"),
                                           args["q"].device, args.get("q_descale"))
    variant = {}
    if problem.variant is not None:
        aux = args.get("aux_tensors")
        if aux is None and args.get("block_mask") is not None:
            aux = args["block_mask"].aux_tensors
        variant = dict(zip(("aux0", "aux1", "aux2", "aux3"), user_variants.kernel_aux(tuple(aux or ()))),
                       block_ranges=entry.extra.block_ranges)
    if entry.extra.seqlens_fill is not None:  # an int cache_seqlens: the same length for every sequence
        given.setdefault("seqused_k", torch.full((problem.batch,), entry.extra.seqlens_fill, dtype=torch.int32,
                                                 device=args["q"].device))
    return fwd_tensors(args, out=out, lse=lse, learnable_sink=None if sink is None else sink.float(),
                       k_descale=k_descale, v_descale=v_descale, **variant, **cp_tensors(problem, args, args["q"].device),
                       **given)


def empty_result(c: Checked):
    """Every query sees no key: out 0; lse the sink (the only logit left), else -inf."""
    q = c.args["q"]
    out = c.args.get("out")
    if out is None:
        out = q.new_empty(c.out_shape, dtype=out_dtype(q.dtype))
    out.zero_()
    if not c.args.get("return_lse"):
        return out
    lse = torch.full(c.lse_shape, -math.inf, dtype=torch.float32, device=q.device)
    sink = c.args.get("learnable_sink")
    if sink is not None:
        lse.copy_(sink.float()[:, None] if c.args.get("cu_seqlens_q") is not None else sink.float()[None, :, None])
    return out, lse


def _out_dtype(args: dict):
    return out_dtype(args["q"].dtype)


def user_variant_of(args: dict, opts: checks.Options, dims: Dims, max_seqlen_k: int) -> tuple:
    """(opts, variant): ``checks.user_variant`` over the call's variant arguments."""
    return checks.user_variant(args.get("score_mod"), args.get("mask_mod"), args.get("aux_tensors"),
                               args.get("block_mask"), opts, args["q"].device, batch=dims.batch, nheads=dims.nheads,
                               max_seqlen_q=dims.max_seqlen_q, max_seqlen_k=max_seqlen_k)


def options_of(args: dict, d: int) -> checks.Options:
    """``checks.options`` of the call's softmax and planning arguments (FA3's keywords that
    change nothing checked too, ``checks.fa3_keywords``)."""
    checks.fa3_keywords(args)
    return checks.options(d, args.get("softmax_scale"), args.get("causal", False), args.get("window_size", (-1, -1)),
                          args.get("softcap", 0.0), args.get("num_splits", 1), args.get("pack_gqa"),
                          args.get("backend"), args.get("batch_invariant", False),
                          args.get("fp8_two_level_interval", 0), args.get("sm_margin", 0))


def _device(args: dict, names: tuple) -> None:
    checks.check_device({n: args.get(n) for n in names})


def traced(kind: str):
    """The ``torch.compile`` path of an entry point: the custom op ``flash_attn_cute::fwd``
    (``api/ops.py``), which runs this module's spec eagerly when the graph runs."""

    def call(args: dict):
        refuse_untraceable(args)
        # The op does not carry it (it only changes FP8 kernels, which are not traced): checked here.
        checks.two_level_interval(args.get("fp8_two_level_interval", 0))
        checks.fa3_keywords(args)
        return traced_call(kind, args)

    return call


def refuse_untraceable(args: dict) -> None:
    """What the custom op does not take yet: user variants, FP8 tensors and descales, and
    the KV-cache append (its own kernel before the attention)."""
    if any(args.get(n) is not None for n in ("score_mod", "mask_mod", "aux_tensors", "block_mask")):
        raise NotImplementedError("score_mod / mask_mod / aux_tensors / block_mask are not traceable by "
                                  "torch.compile yet: call flash_attn_cute outside the compiled region")
    k = args["k"] if "k" in args else args["k_cache"]
    if k.dtype in checks.FP8_DTYPES or any(args.get(n) is not None for n in ("q_descale", "k_descale", "v_descale")):
        raise NotImplementedError("FP8 K/V and q_descale / k_descale / v_descale are not traceable by torch.compile "
                                  "yet: call flash_attn_cute outside the compiled region")
    if args.get("cp_world_size", 1) != 1:
        raise NotImplementedError("cp_world_size > 1 is not traceable by torch.compile yet: call flash_attn_cute "
                                  "outside the compiled region")
    if args.get("sm_margin", 0) != 0:
        raise NotImplementedError("sm_margin > 0 is not traceable by torch.compile yet: call flash_attn_cute "
                                  "outside the compiled region")
    if any(args.get(n) is not None for n in ("k_new", "v_new", "rotary_cos", "rotary_sin", "cache_batch_idx",
                                             "cache_leftpad")):
        raise NotImplementedError("flash_attn_with_kvcache with k/v, rotary, cache_batch_idx or cache_leftpad "
                                  "is not traceable by torch.compile yet: call it outside the compiled region")


def traced_call(kind: str, args: dict):
    """An entry point's body under ``torch.compile`` (its arguments by name, aliases
    folded): the output allocated in the graph, then the op. A kvcache call's lengths
    travel as ``seqused_k`` (an int as ``max_seqlen_k``)."""
    q, out = args["q"], args.get("out")
    k, v = (args["k_cache"], args["v_cache"]) if kind == "kvcache" else (args["k"], args["v"])
    if out is None:
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    seqused_k, max_seqlen_k = args.get("seqused_k"), args.get("max_seqlen_k")
    max_seqlen_q = args.get("max_seqlen_q")
    if kind == "kvcache":
        seqused_k, max_seqlen_k = args.get("cache_seqlens"), args.get("cache_seqlens_int")
        if args.get("cu_seqlens_q") is None:
            max_seqlen_q = q.shape[1]
    elif kind == "func":
        max_seqlen_q = q.shape[1]
    left, right = (-1 if w is None else w for w in args.get("window_size", (-1, -1)))
    return_lse = bool(args.get("return_lse"))
    lse = torch.ops.flash_attn_cute.fwd(
        kind, q, k, v, out, args.get("cu_seqlens_q"), args.get("cu_seqlens_k"), args.get("seqused_q"), seqused_k,
        args.get("page_table"), args.get("learnable_sink"), max_seqlen_q, max_seqlen_k, args.get("softmax_scale"),
        args.get("causal", False), left, right, float(args.get("softcap", 0.0)), args.get("num_splits", 1),
        args.get("pack_gqa"), return_lse, args.get("backend"), args.get("batch_invariant", False))
    return (out, lse) if return_lse else out


# --------------------------------------------------------------------------- flash_attn_func


def _validate_func(args: dict) -> Checked:
    q, k, v = args["q"], args["k"], args["v"]
    checks.check_tensor("q", q, 4, Q4)
    nheads, nheads_kv, d, d_v, q, k, v = checks.qkv(
        q, k, v, Q4, 4, "(batch, seqlen_k, nheads_kv, headdim)", "(batch, seqlen_k, nheads_kv, headdim_v)")
    batch, seqlen_q = q.shape[:2]
    if k.shape[0] != batch:
        raise ValueError(f"k and v must have the batch size of q ({batch}), got {k.shape[0]}")
    checks.learnable_sink(args.get("learnable_sink"), nheads)
    checks.descales(k, args.get("q_descale"), args.get("k_descale"), args.get("v_descale"), batch, nheads_kv)
    opts = options_of(args, d)
    out = checks.check_out(args.get("out"), (batch, seqlen_q, nheads, d_v), out_dtype(q.dtype),
                           "(batch, seqlen_q, nheads, headdim_v)")
    args = dict(args, q=q, k=k, v=v, out=out)
    _device(args, ("q", "k", "v", "learnable_sink", "q_descale", "k_descale", "v_descale", "out"))
    dims = Dims(batch, seqlen_q, k.shape[1], nheads, nheads_kv, d, d_v)
    opts, variant = user_variant_of(args, opts, dims, k.shape[1])
    return checked(args, dims, opts, variant)


FUNC = Spec("func", ("q", "k", "v", "out", "learnable_sink", *VARIANT_ARGS, *OPTION_ARGS), _validate_func,
            lambda entry, args, out, lse: launch_tensors(entry, args, out, lse), empty_result, _out_dtype,
            traced=traced("func"), inputs=("q", "k", "v", "out"))


# --------------------------------------------------------------------- flash_attn_varlen_func


def validate_varlen(args: dict) -> Checked:
    """``flash_attn_varlen_func``'s arguments (and the packed ``flash_attn_with_kvcache``'s)."""
    q, k, v = args["q"], args["k"], args["v"]
    cu_seqlens_q, cu_seqlens_k = args.get("cu_seqlens_q"), args.get("cu_seqlens_k")
    page_table, seqused_q, seqused_k = args.get("page_table"), args.get("seqused_q"), args.get("seqused_k")
    varlen_q = cu_seqlens_q is not None
    if not isinstance(q, torch.Tensor):
        checks.check_tensor("q", q, 3, Q3)
    if varlen_q and q.dim() != 3:
        raise ValueError(f"q must have shape {Q3} with cu_seqlens_q (rank 3), got shape {tuple(q.shape)}")
    if not varlen_q and q.dim() != 4:
        raise ValueError(f"q must have shape {Q4} without cu_seqlens_q, or {Q3} with it; got shape {tuple(q.shape)}")
    paged, varlen_k = page_table is not None, cu_seqlens_k is not None
    if paged and varlen_k:
        raise ValueError("page_table and cu_seqlens_k cannot be combined: with a page table the caches are "
                         "(num_pages, page_size, nheads_kv, headdim) and seqused_k gives each sequence's key count")
    if paged and seqused_k is None:
        raise ValueError("page_table needs seqused_k (batch,) int32: each sequence's key count")
    kv_form = ("(num_pages, page_size, nheads_kv, {})" if paged else "(total_k, nheads_kv, {})" if varlen_k
               else "(batch, seqlen_k, nheads_kv, {})")
    nheads, nheads_kv, d, d_v, q, k, v = checks.qkv(q, k, v, Q3 if varlen_q else Q4, 3 if varlen_k else 4,
                                                    kv_form.format("headdim"), kv_form.format("headdim_v"))
    batch = checks.packed_queries(q, cu_seqlens_q, None)[0] if varlen_q else q.shape[0]
    if varlen_k:
        checks.int32_vector("cu_seqlens_k", cu_seqlens_k, batch + 1, "(batch + 1,) like cu_seqlens_q")
        capacity = k.shape[0]
    else:
        capacity = checks.cache_capacity(k, batch, page_table, "k and v", why=" (the batch of q)")
    for name, t in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        if t is not None:
            checks.int32_vector(name, t, batch, "(batch,)")
    checks.learnable_sink(args.get("learnable_sink"), nheads)
    checks.descales(k, args.get("q_descale"), args.get("k_descale"), args.get("v_descale"), batch, nheads_kv)
    max_seqlen_q, max_seqlen_k = args.get("max_seqlen_q"), args.get("max_seqlen_k")
    if max_seqlen_q is None:
        max_seqlen_q = q.shape[0] if varlen_q else q.shape[1]
    max_seqlen_q = checks.int_arg("max_seqlen_q", max_seqlen_q, 0, INT32_MAX)
    if not varlen_q:
        max_seqlen_q = q.shape[1]  # the grid covers the dense queries' mode
    max_seqlen_k = capacity if max_seqlen_k is None else checks.int_arg("max_seqlen_k", max_seqlen_k, 0, INT32_MAX)
    if not varlen_k:
        max_seqlen_k = min(max_seqlen_k, capacity)
    opts = options_of(args, d)
    out = checks.check_out(args.get("out"), (*q.shape[:-1], d_v), out_dtype(q.dtype),
                           "(total_q, nheads, headdim_v)" if varlen_q else "(batch, seqlen_q, nheads, headdim_v)")
    args = dict(args, q=q, k=k, v=v, out=out)
    _device(args, ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "page_table",
                   "learnable_sink", "q_descale", "k_descale", "v_descale", "out"))
    # A block mask covers every key a sequence may have: the cache's capacity, or for packed
    # keys the caller's bound (the total key count when none is given).
    dims = Dims(batch, max_seqlen_q, max_seqlen_k, nheads, nheads_kv, d, d_v)
    opts, variant = user_variant_of(args, opts, dims, max_seqlen_k if varlen_k else capacity)
    if varlen_k and k.shape[0] == 0:
        dims = dims._replace(max_seqlen_k=0)
    return checked(args, dims, opts, variant)


VARLEN = Spec("varlen", ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "page_table",
                         "learnable_sink", "out", *VARIANT_ARGS, "max_seqlen_q", "max_seqlen_k", *OPTION_ARGS),
              validate_varlen, lambda entry, args, out, lse: launch_tensors(entry, args, out, lse), empty_result,
              _out_dtype, traced=traced("varlen"), inputs=("q", "k", "v", "out"))


# -------------------------------------------------------------------- flash_attn_with_kvcache


def prepare_kvcache(args: dict) -> dict:
    """``flash_attn_with_kvcache``'s arguments as the specs read them: the new tokens as
    ``k_new`` / ``v_new`` (``k`` / ``v`` name the caches' slots), the earlier form
    ``(q, k_cache, v_cache, cache_seqlens)`` (lengths in ``k``'s place) unfolded, an int
    ``cache_seqlens`` as ``cache_seqlens_int`` (a value of the cache key), and
    ``cu_seqlens_k_new`` dropped without new tokens (FA3 and SGLang pass it regardless)."""
    k, v = args.pop("k", None), args.pop("v", None)
    if args.get("cache_seqlens") is None and v is None and (
            isinstance(k, int) and not isinstance(k, bool) or (
            isinstance(k, torch.Tensor) and k.dim() == 1 and k.dtype == torch.int32)):
        k, args["cache_seqlens"] = None, k
    args["k_new"], args["v_new"] = k, v
    seqlens = args.get("cache_seqlens")
    if seqlens is not None and not isinstance(seqlens, torch.Tensor):
        args["cache_seqlens_int"], args["cache_seqlens"] = seqlens, None
    if k is None:
        args["cu_seqlens_k_new"] = None
    return args


def appends(args: dict) -> bool:
    """Whether a ``flash_attn_with_kvcache`` call runs the append step (``kv_cache_ops``)."""
    return any(args.get(n) is not None for n in ("k_new", "v_new", "rotary_cos", "rotary_sin", "cache_batch_idx",
                                                  "cache_leftpad"))


def validate_kvcache(args: dict, min_tokens: int = 0) -> tuple:
    """(checked arguments, Dims, opts, variant, seqlens_fill) of ``flash_attn_with_kvcache``
    without an append: the keys are the cache's first ``cache_seqlens`` tokens. ``min_tokens``
    (an append's new tokens) is added to what the cache must hold."""
    q, k_cache, v_cache = args["q"], args["k_cache"], args["v_cache"]
    cu_seqlens_q, page_table = args.get("cu_seqlens_q"), args.get("page_table")
    varlen_q = cu_seqlens_q is not None
    nheads, nheads_kv, d, d_v, q, k_cache, v_cache, batch, seqlen_q = checks.queries_and_cache(
        q, k_cache, v_cache, cu_seqlens_q, args.get("max_seqlen_q"), page_table, "batch")
    capacity = checks.cache_capacity(k_cache, batch, page_table, "k_cache and v_cache")
    seqlens = args.get("cache_seqlens")
    cache_seqlens, seqlens_fill = checks.cache_lengths(
        seqlens if seqlens is not None else args.get("cache_seqlens_int"), batch, capacity, min_tokens, q.device)
    checks.learnable_sink(args.get("learnable_sink"), nheads)
    checks.descales(k_cache, args.get("q_descale"), args.get("k_descale"), args.get("v_descale"), batch, nheads_kv)
    opts = options_of(args, d)
    out = checks.check_out(args.get("out"), (*q.shape[:-1], d_v), out_dtype(q.dtype),
                           "(total_q, nheads, headdim_v)" if varlen_q else "(batch, seqlen_q, nheads, headdim_v)")
    args = dict(args, q=q, k_cache=k_cache, v_cache=v_cache, out=out, cache_seqlens=cache_seqlens)
    _device(args, ("q", "k_cache", "v_cache", "cache_seqlens", "page_table", "cu_seqlens_q", "learnable_sink",
                   "q_descale", "k_descale", "v_descale", "out"))
    max_seqlen_k = seqlens_fill
    if max_seqlen_k is None:  # lengths live on the device
        if args.get("check_cache_bounds"):  # opt-in: one device -> host read
            max_seqlen_k = checks.cache_bounds(cache_seqlens, capacity, page_table, k_cache.shape, min_tokens)
        else:
            max_seqlen_k = capacity
    dims = Dims(batch, seqlen_q, max_seqlen_k, nheads, nheads_kv, d, d_v)
    opts, variant = user_variant_of(args, opts, dims, capacity)
    return args, dims, opts, variant, seqlens_fill


def _validate_kvcache(args: dict) -> Checked:
    args, dims, opts, variant, seqlens_fill = validate_kvcache(args)
    return checked(args, dims, opts, variant, seqlens_fill)


KVCACHE = Spec("kvcache", ("q", "k_cache", "v_cache", "cache_seqlens", "page_table", "cu_seqlens_q", "learnable_sink",
                           "out", *VARIANT_ARGS, "cache_seqlens_int", "max_seqlen_q", *OPTION_ARGS), _validate_kvcache,
               lambda entry, args, out, lse: launch_tensors(entry, args, out, lse), empty_result, _out_dtype,
               cacheable=lambda args: not args.get("check_cache_bounds"), traced=traced("kvcache"),
               inputs=("q", "k_cache", "v_cache", "out"))
SPECS = {"func": FUNC, "varlen": VARLEN, "kvcache": KVCACHE}
