"""The one run path under every public entry point: lookup -> replay, or validate ->
resolve -> launch -> store.

An entry point is a ``Spec``: its cache-key name and argument names, how a call is
validated into a ``Checked`` call (the problem, its kernel tensors' builder, the output
shapes), and, where it has one, the ``torch.compile`` path. ``run(spec, args)`` does the
rest, the same way for all of them:

1. ``spec.prepare(args)``: aliases folded (``call_args.fold_aliases``) and legacy forms;
2. under ``torch.compile``: ``spec.traced(args)`` (the custom op, ``api/ops.py``);
3. the per-call cache (``call_cache``): a call whose key (``call_args.cache_key``) matches
   a stored entry skips validation and planning, and is launched from the entry;
4. otherwise ``spec.validate(args)``; a call that computes nothing (no key, no query)
   returns its empty result; the problem is resolved (``seam.resolve``: backend, plan,
   bound launcher), launched, and its entry stored when validation handed the tensors
   through unchanged (``call_cache.same``).

Launching (``launch``) is the same for a replay and a first call: the outputs are
allocated from the entry's shapes (or the caller's ``out``), ``spec.tensors(entry, args,
out, lse)`` builds the kernels' tensor list (running any pre-step, such as the KV-cache
append), and ``seam.run_resolved`` launches it (split-KV partials and the combine
included).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch

from flash_attn_cute import seam
from flash_attn_cute.api import call_cache
from flash_attn_cute.api.call_args import cache_key, fold_aliases
from flash_attn_cute.host import tuning


class Checked(NamedTuple):
    """A validated call: the arguments as the kernels take them (validation may return
    aligned views of the caller's tensors), its problem (None: nothing to compute, the
    result is ``spec.empty``'s) and the outputs' shapes; ``extra``: what a replay needs
    beyond them (``call_cache.Entry.extra``)."""

    args: dict
    problem: object
    out_shape: tuple
    lse_shape: tuple
    requested: Optional[str] = None  # backend=
    num_splits: int = 0
    pack_gqa: Optional[bool] = None
    extra: object = None
    sm_margin: int = 0  # SMs the call leaves free (FA3's keyword; ``seam.resolve``)


@dataclass(frozen=True)
class Spec:
    """An entry point of the run path (see the module docstring)."""

    name: str  # its per-call cache key's first field
    arg_names: tuple  # the arguments the cache key covers (``call_args.ARGS`` rows)
    validate: Callable  # (args) -> Checked; raises before anything launches
    tensors: Callable  # (entry, args, out, lse) -> the kernels' tensor list
    empty: Callable  # (checked) -> the result of a call with nothing to compute
    out_dtype: Callable  # (args) -> the output's dtype
    device_arg: str = "q"  # the argument whose device the call runs on
    prepare: Callable = lambda args: args  # (args) -> args, the legacy forms unfolded
    cacheable: Callable = lambda args: True  # (args) -> whether the call may use the per-call cache
    traced: Optional[Callable] = None  # (args) -> result, under torch.compile
    inputs: tuple = ()  # the tensor arguments validation must hand through unchanged to store an entry


def run(spec: Spec, args: dict):
    """A call of ``spec``'s entry point with ``args`` (its arguments by name)."""
    args = spec.prepare(fold_aliases(args))  # (an entry point's locals(): its own dict)
    if spec.traced is not None and torch.compiler.is_compiling():
        return spec.traced(args)
    key = None
    if spec.cacheable(args):
        hit, key = call_cache.lookup(cache_key(spec.name, spec.arg_names, args))
        if hit is not None:
            return launch(spec, hit, args)
    checked = spec.validate(args)
    if checked.problem is None:
        return spec.empty(checked)
    problem = checked.problem
    resolved = seam.resolve(problem, checked.requested, checked.num_splits, checked.pack_gqa,
                            checked.args[spec.device_arg].device, tuning.from_env(), checked.sm_margin)
    entry = call_cache.Entry(problem, resolved, checked.out_shape, checked.lse_shape, checked.extra)
    result = launch(spec, entry, checked.args)
    call_cache.store(call_cache.same(key, tuple(args.get(n) for n in spec.inputs),
                                     tuple(checked.args.get(n) for n in spec.inputs)), entry)
    return result


def launch(spec: Spec, entry: call_cache.Entry, args: dict):
    """Allocates the outputs and launches ``entry`` over ``args``: the shared last step of a
    replay and of a first call. Returns ``out``, or ``(out, lse)`` with ``return_lse``."""
    first = args[spec.device_arg]
    out = args.get("out")
    if out is None:
        out = first.new_empty(entry.out_shape, dtype=spec.out_dtype(args))
    lse = first.new_empty(entry.lse_shape, dtype=torch.float32) if args.get("return_lse") else None
    seam.run_resolved(entry.resolved, entry.problem, spec.tensors(entry, args, out, lse))
    return (out, lse) if lse is not None else out
