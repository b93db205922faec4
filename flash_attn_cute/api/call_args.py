"""Every public argument, described once: its aliases, its part in the per-call cache key,
the kernel tensor it becomes and the problem flag its presence sets.

The entry points (``interface.py``, ``mla.py``) keep their explicit signatures and hand
their arguments, as a dict, to the generic run path (``entry.run``). What that path does
with an argument depends only on its row here (``ARGS``):

- ``kind``: ``"tensor"`` (the cache key holds its signature: class, shape, strides, dtype,
  device, alignment; a non-tensor value makes the call uncacheable and validation
  decides), ``"tensors"`` (a list of tensors: ``aux_tensors``), ``"value"`` (the key holds
  the value and its type: flags, scalars, functions, block masks) or ``"window"`` (a
  ``(left, right)`` pair, compared element-wise with its types);
- ``aliases``: other names of the same argument (vLLM's ``block_table``, ``s_aux``,
  SGLang's ``sinks``, FA2's ``return_softmax_lse``, FA3's ``return_attn_probs``); ``either``: an alias that may be
  given beside the name (a flag: either one set sets it), else giving both is an error;
- ``slot``: the field of the forward kernels' tensor list (``FwdTensors``) it fills;
- ``flag``: the ``FwdProblem`` field its presence sets (a compile-key input).

The forward kernels' tensor list (``FwdTensors``) is in the order of ``device.fwd_kernel.
FwdArgs``'s tensor fields; a test keeps the two equal. MLA's is ``MlaTensors``
(``device.mla_kernel.MlaArgs``). Adding a keyword: its row here (and its slot / flag if
kernels read it), its validation in the entry point's ``validate``, its kernel code, its
tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple, Optional

import torch

from flash_attn_cute.api import call_cache


@dataclass(frozen=True)
class Arg:
    name: str
    kind: str = "value"  # "tensor", "tensors", "value" or "window" (see the module docstring)
    aliases: tuple = ()
    either: bool = False  # an alias may be given beside the name (flags)
    slot: Optional[str] = None  # the FwdTensors field it fills
    flag: Optional[str] = None  # the FwdProblem field its presence sets


ARGS = {a.name: a for a in (
    # queries, keys, values, output
    Arg("q", "tensor", slot="q"), Arg("k", "tensor", slot="k"), Arg("v", "tensor", slot="v"),
    Arg("k_cache", "tensor", slot="k"), Arg("v_cache", "tensor", slot="v"), Arg("out", "tensor", slot="out"),
    # lengths, layouts
    Arg("cu_seqlens_q", "tensor", slot="cu_seqlens_q", flag="varlen_q"),
    Arg("cu_seqlens_k", "tensor", slot="cu_seqlens_k", flag="varlen_k"),
    Arg("seqused_q", "tensor", slot="seqused_q", flag="has_seqused_q"),
    Arg("seqused_k", "tensor", slot="seqused_k", flag="has_seqused_k"),
    Arg("cache_seqlens", "tensor", slot="seqused_k", flag="has_seqused_k"),
    Arg("cache_seqlens_int"),  # an int cache_seqlens (``forward.prepare_kvcache``): the same for every sequence
    Arg("page_table", "tensor", aliases=("block_table",), slot="page_table"),
    Arg("max_seqlen_q"), Arg("max_seqlen_k"),
    # the KV-cache append (flash_attn_with_kvcache)
    Arg("k_new", "tensor"), Arg("v_new", "tensor"), Arg("rotary_cos", "tensor"), Arg("rotary_sin", "tensor"),
    Arg("cache_batch_idx", "tensor"), Arg("cache_leftpad", "tensor"), Arg("cu_seqlens_k_new", "tensor"),
    Arg("rotary_interleaved"), Arg("check_cache_bounds"),
    # the softmax
    Arg("softmax_scale"), Arg("causal"), Arg("window_size", "window"), Arg("softcap"),
    Arg("learnable_sink", "tensor", aliases=("s_aux", "sinks"), slot="learnable_sink", flag="has_sink"),
    # FP8 (FA3's descales); MLA's one latent descale
    Arg("q_descale", "tensor"), Arg("k_descale", "tensor", slot="k_descale"),
    Arg("v_descale", "tensor", slot="v_descale"), Arg("kv_descale", "tensor"),
    # user variants
    Arg("score_mod"), Arg("mask_mod"), Arg("aux_tensors", "tensors"), Arg("block_mask"),
    # planning and outputs
    Arg("num_splits"), Arg("pack_gqa"), Arg("backend"), Arg("batch_invariant"),
    Arg("fp8_two_level_interval"),  # the FP8 P V product in two levels (FwdProblem.fp8_two_level_interval)
    Arg("return_lse", aliases=("return_softmax_lse", "return_attn_probs"), either=True),
    Arg("sm_margin"),  # SMs left free (FA3): the split heuristic and persistent grids (``seam.resolve``)
    # FA3's keywords that change nothing here, or are refused (``checks.fa3_keywords``)
    Arg("qv", "tensor"), Arg("rotary_seqlens", "tensor"), Arg("scheduler_metadata", "tensor"),
    Arg("attention_chunk"), Arg("deterministic"),
    # context parallelism (the FA3 fork's keywords; ``checks.context_parallel``): the kernels get
    # the global lengths and a rank tensor where their masks need them (``cp_tensors``)
    Arg("cp_world_size"), Arg("cp_rank"), Arg("cp_tot_seqused_k", "tensor"), Arg("cp_kv_interleave"),
    # MLA (flash_mla_decode)
    Arg("q_nope", "tensor"), Arg("q_pe", "tensor"), Arg("ckv_cache", "tensor"), Arg("kpe_cache", "tensor"),
)}
ALIAS_OF = {alias: arg.name for arg in ARGS.values() for alias in arg.aliases}


def fold_aliases(args: dict) -> dict:
    """``args`` (an entry point's locals) with every alias folded into its argument: a
    flag alias ORed in, any other one taking the argument's place (giving both is an
    error naming them)."""
    for alias, name in ALIAS_OF.items():
        if alias not in args:
            continue
        value = args.pop(alias)
        if ARGS[name].either:
            args[name] = bool(args.get(name) or value)
        elif value is not None:
            if args.get(name) is not None:
                raise ValueError(f"{name} and {alias} name the same argument: give one of them")
            args[name] = value
    return args


def cache_key(kind: str, names: tuple, args: dict):
    """The per-call cache key of a call of entry point ``kind`` over the arguments ``names``
    (``call_cache.key``: tensors by signature, values with their types, the window apart),
    or None when the call cannot use the cache (the full path then decides)."""
    tensor_names, list_names, value_names, window_name = _key_layout(names)
    tensors = [args.get(n) for n in tensor_names]
    for n in list_names:
        tensors.extend(_as_list(args.get(n)))
    window = args.get(window_name, ()) if window_name else ()
    return call_cache.key(kind, tuple(tensors), tuple(args.get(n) for n in value_names), window)


@lru_cache(maxsize=None)
def _key_layout(names: tuple) -> tuple:
    """``names`` split by their part in a cache key (a repeated call pays only the lookups)."""
    kinds = [ARGS[n].kind for n in names]
    pick = lambda k: tuple(n for n, kind in zip(names, kinds) if kind == k)
    windows = pick("window")
    return pick("tensor"), pick("tensors"), pick("value"), windows[0] if windows else None


def _as_list(value) -> tuple:
    """A tensor list as extra key tensors (any other value makes the key fail to hash or
    compare, and the full path then validates it)."""
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


class FwdTensors(NamedTuple):
    """The forward kernels' tensor arguments, in their launch order (``FwdArgs``): None
    where a feature is off. ``lse`` None: no LSE; split plans replace ``out`` / ``lse`` by
    their fp32 partials (``seam.run_resolved``)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    lse: Optional[torch.Tensor] = None
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_k: Optional[torch.Tensor] = None
    seqused_k: Optional[torch.Tensor] = None
    page_table: Optional[torch.Tensor] = None
    seqused_q: Optional[torch.Tensor] = None
    learnable_sink: Optional[torch.Tensor] = None  # fp32 (the kernels' and the combine's)
    k_descale: Optional[torch.Tensor] = None  # fp32 (batch, nheads_kv) views (``kernel_descales``)
    v_descale: Optional[torch.Tensor] = None
    leftpad_k: Optional[torch.Tensor] = None  # a paged cache's per-sequence first key (cache_leftpad)
    aux0: Optional[torch.Tensor] = None  # a user variant's aux tensors (``user_variants.kernel_aux``)
    aux1: Optional[torch.Tensor] = None
    aux2: Optional[torch.Tensor] = None
    aux3: Optional[torch.Tensor] = None
    block_ranges: Optional[torch.Tensor] = None  # a block mask's key ranges
    cp_tot_seqused_k: Optional[torch.Tensor] = None  # context parallelism (``cp_tensors``)
    cp_info: Optional[torch.Tensor] = None


class MlaTensors(NamedTuple):
    """The MLA kernels' tensor arguments, in their launch order (``MlaArgs``)."""

    q_nope: torch.Tensor
    q_pe: torch.Tensor
    ckv: torch.Tensor
    kpe: torch.Tensor
    out: torch.Tensor
    lse: Optional[torch.Tensor]
    cache_seqlens: torch.Tensor
    page_table: torch.Tensor
    kv_descale: Optional[torch.Tensor]  # fp32 (batch,) / (batch, nheads_kv) for an FP8 cache
    q_descale: Optional[torch.Tensor] = None  # the same for FP8 queries
    cp_tot_seqused_k: Optional[torch.Tensor] = None  # context parallelism (``cp_tensors``)
    cp_info: Optional[torch.Tensor] = None
    # a device-computed schedule (``scheduler_metadata``) and, on a scheduled plan, the fp32
    # partials beside out / lse (``MlaProblem.scheduled_partials``)
    schedule: Optional[torch.Tensor] = None
    o_partial: Optional[torch.Tensor] = None
    lse_partial: Optional[torch.Tensor] = None


FLAGS = {arg.slot: arg.flag for arg in ARGS.values() if arg.flag}
# Each FwdTensors field with the arguments that fill it (one per entry point's naming).
_SOURCES = tuple((f, tuple(a.name for a in ARGS.values() if a.slot == f)) for f in FwdTensors._fields)


def fwd_tensors(args: dict, **given) -> FwdTensors:
    """The kernels' tensors of a forward call from its (validated, or cached-signature)
    arguments by their slots, then ``given`` (launch-time values: out, lse, the fp32 sink,
    the descale views, a variant's tensors, a pre-step's outputs)."""
    values = []
    for field, sources in _SOURCES:
        if field in given:
            values.append(given[field])
            continue
        value = None
        for name in sources:
            x = args.get(name)
            if isinstance(x, torch.Tensor):
                value = x
                break
        values.append(value)
    return FwdTensors._make(values)


def problem_flags(tensors: FwdTensors) -> dict:
    """The ``FwdProblem`` flags a call's tensors set by being there (``Arg.flag``)."""
    return {flag: getattr(tensors, slot) is not None for slot, flag in FLAGS.items()}


_ONES: dict = {}


def descale_view(t, batch: int, nheads_kv: int, device):
    """A checked descale (``checks.descales``) as the kernels read it: fp32 ``(batch,
    nheads_kv)``, a broadcast view for one element or None (1.0). Cheap: the per-call
    replay runs it."""
    if t is None:
        t = _ONES.get(device)
        if t is None:
            t = torch.ones(1, dtype=torch.float32, device=device)
            # Made during a CUDA-graph capture, its fill runs only when the graph replays (and
            # it lives in the graph's pool): not one to keep for eager calls.
            if not (t.is_cuda and torch.cuda.is_current_stream_capturing()):
                _ONES[device] = t
    if t.numel() == 1:
        return t.reshape(1, 1).expand(batch, nheads_kv)
    return t


def kernel_descales(problem, k_descale, v_descale, device, q_descale=None) -> tuple:
    """(k_descale, v_descale) as ``problem``'s kernel reads them: ``descale_view`` of each for
    FP8 K/V; for FP8 queries the first is ``q_descale * k_descale`` (both scale the scores
    alike: one factor per (batch, KV head)); else (None, None) (16-bit K/V ignore them)."""
    if not (problem.kv_fp8 or problem.qkv_fp8):
        return None, None
    k_view = descale_view(k_descale, problem.batch, problem.nheads_kv, device)
    if problem.qkv_fp8 and q_descale is not None:
        k_view = descale_view(q_descale, problem.batch, problem.nheads_kv, device) * k_view
    return k_view, descale_view(v_descale, problem.batch, problem.nheads_kv, device)


_CP_INFOS: dict = {}


def cp_tensors(problem, args: dict, device) -> dict:
    """The kernels' context-parallel tensors of a call whose problem maps keys to global
    positions (``problem.cp``): the caller's ``cp_tot_seqused_k`` and (rank, world,
    interleave) as a (3,) int32 device tensor (one per device and values, kept; made per
    call while a CUDA graph is being captured, where a kept one would hold nothing until
    the graph runs); none otherwise."""
    if not problem.cp:
        return {}
    values = (int(args.get("cp_rank", 0)), int(args["cp_world_size"]), int(args.get("cp_kv_interleave", 1)))
    key = (device, values)
    t = _CP_INFOS.get(key)
    if t is None and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        t = _filled(values, device)
    elif t is None:
        t = _CP_INFOS[key] = torch.tensor(values, dtype=torch.int32, device=device)
    return dict(cp_tot_seqused_k=args["cp_tot_seqused_k"], cp_info=t)


def _filled(values: tuple, device) -> torch.Tensor:
    """A small int32 device tensor of ``values`` made with fills (capturable in a CUDA graph)."""
    t = torch.empty((len(values),), dtype=torch.int32, device=device)
    for i, v in enumerate(values):
        t[i:i + 1].fill_(v)
    return t
