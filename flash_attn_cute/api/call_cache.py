"""The per-call cache: a repeated call skips validation and planning.

A serving loop calls the same entry point with tensors of the same shapes, strides,
dtypes and device every step. ``key`` captures everything validation and planning read
(per tensor: class, shape, strides, dtype, device and the pointer's alignment; the scalar
arguments with their types, so ``causal=1`` never hits an entry made by ``causal=True``;
the knob environment variables, ``tuning.env_knobs``), so an entry stored by a call that
passed validation answers for every call with the same key: only the data pointers
differ. Every entry point of every problem kind stores ``Entry`` values here; ``clear``
forgets them and every resolved plan.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from flash_attn_cute import seam
from flash_attn_cute.host.tuning import env_knobs

_CACHE_SIZE = 1024
_calls: dict = {}


class Entry(NamedTuple):
    """What a replay launches from: the problem, its resolved plan (backend, bound
    launcher, combine), the outputs' shapes, and what else the entry point's spec needs
    (``extra``: ``forward.FwdExtra`` for the forward ones)."""

    problem: object  # a problem of any kind (host.problems)
    resolved: seam.Resolved
    out_shape: tuple
    lse_shape: tuple
    extra: object = None


def _tensor_sig(t):
    """What validation reads of a tensor argument. The pointer's low bits stand in for its
    alignment: a misaligned call never matches an entry made by an aligned one."""
    if t is None:
        return None
    return t.__class__, t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() & 15


def key(kind: str, tensors: tuple, scalars: tuple, window=()):
    """The cache key of a call, or None when the call cannot use the cache (a non-tensor
    argument: the full path then decides)."""
    try:
        return (kind, scalars, tuple(map(type, scalars)), window, tuple(map(type, window)), env_knobs(),
                *map(_tensor_sig, tensors))
    except (AttributeError, TypeError):
        return None


def lookup(k):
    """(cached entry or None, the key if it can be stored)."""
    if k is None:
        return None, None
    try:
        return _calls.get(k), k
    except TypeError:  # an unhashable argument (a list window, ...)
        return None, None


def same(k, given: tuple, checked: tuple):
    """``k`` if validation handed the tensors through unchanged (it re-strides size-1 dims
    with odd strides: such calls are not cached), else None."""
    return k if all(a is b for a, b in zip(given, checked)) else None


def store(k, entry: Entry) -> None:
    if k is None:
        return
    if len(_calls) >= _CACHE_SIZE:
        _calls.clear()
    _calls[k] = entry


def clear() -> None:
    """Forget every cached call and every resolved plan, of every entry point and kind."""
    _calls.clear()
    seam.clear_plan_cache()
