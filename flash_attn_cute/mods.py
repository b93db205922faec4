"""Building blocks for ``score_mod`` / ``mask_mod`` functions, and built-in variants
written with them.

Every function here works on both sides of a user variant (``user_variants.py``): on
torch tensors in the reference (``flash_attn_cute.testing.attention_ref``) and on DSL
scalars inside a kernel, so one definition serves both::

    from flash_attn_cute import mods

    def alibi(score, b, h, q_idx, kv_idx, aux):
        return score + aux[0][h] * (kv_idx - q_idx)

    def doc_mask(b, h, q_idx, kv_idx, aux):
        return aux[0][b, q_idx] == aux[0][b, kv_idx]

The built-in variants below are factories (``alibi()``, ``document_mask()``, ...) whose
arguments are compile-time constants (closure values: a new window recompiles) or the
slot of ``aux_tensors`` they read (runtime data: new slopes never recompile). Causal,
sliding-window and softcap attention also have built-in fast paths (``causal=``,
``window_size=``, ``softcap=``) whose parameters are runtime values.
"""

from __future__ import annotations

import math

import torch

__all__ = ["where", "exp", "exp2", "log", "log2", "tanh", "sqrt", "rsqrt", "abs", "minimum", "maximum", "sigmoid",
           "and_masks", "or_masks", "alibi", "alibi_slopes", "relative_position_bias", "document_mask", "prefix_lm",
           "causal_mask", "sliding_window", "softcap"]


def _torch(*xs) -> bool:
    return any(isinstance(x, torch.Tensor) for x in xs)


def _number(*xs) -> bool:
    return all(isinstance(x, (bool, int, float)) for x in xs)


def _float(x):
    from cutlass import Float32

    return Float32(x)


def where(cond, a, b):
    """``a`` where ``cond`` else ``b`` (``torch.where`` / a DSL select)."""
    if _torch(cond, a, b):
        return torch.where(cond, a, b)
    if isinstance(cond, bool):
        return a if cond else b
    import cutlass

    if isinstance(a, float) or isinstance(b, float) or "Float" in type(a).__name__ or "Float" in type(b).__name__:
        a, b = _float(a), _float(b)
    else:
        a, b = cutlass.Int32(a), cutlass.Int32(b)
    return cutlass.select_(cond, a, b)


def _unary(name: str, torch_fn, math_fn, dsl_fn):
    def fn(x):
        if _torch(x):
            return torch_fn(x)
        if _number(x):
            return math_fn(x)
        return dsl_fn(_float(x))

    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = f"{name}(x) on a torch tensor, a number or a DSL scalar (fp32 in kernels)."
    return fn


def _cute_math(name: str, fastmath: bool = True):
    def fn(x):
        import cutlass.cute as cute

        op = getattr(cute.math, name)
        return op(x, fastmath=True) if fastmath else op(x)

    return fn


exp = _unary("exp", torch.exp, math.exp, _cute_math("exp"))
exp2 = _unary("exp2", torch.exp2, lambda x: 2.0 ** x, _cute_math("exp2"))
log = _unary("log", torch.log, math.log, _cute_math("log"))
log2 = _unary("log2", torch.log2, math.log2, _cute_math("log2"))
tanh = _unary("tanh", torch.tanh, math.tanh, _cute_math("tanh"))
sqrt = _unary("sqrt", torch.sqrt, math.sqrt, _cute_math("sqrt"))
rsqrt = _unary("rsqrt", torch.rsqrt, lambda x: 1.0 / math.sqrt(x), _cute_math("rsqrt"))
sigmoid = _unary("sigmoid", torch.sigmoid, lambda x: 1.0 / (1.0 + math.exp(-x)),
                 lambda x: 1.0 / (1.0 + _cute_math("exp")(-x)))


def abs(x):  # noqa: A001 - the name users expect next to exp and log
    """|x| on a torch tensor, a number or a DSL scalar (int stays int)."""
    if _torch(x) or _number(x):
        return x.abs() if _torch(x) else (x if x >= 0 else -x)
    return where(x < 0, -x, x)


def minimum(a, b):
    """Elementwise minimum (ints stay ints)."""
    if _number(a, b):
        return min(a, b)
    return where(a < b, a, b)


def maximum(a, b):
    """Elementwise maximum (ints stay ints)."""
    if _number(a, b):
        return max(a, b)
    return where(a > b, a, b)


# ------------------------------------------------------------------------------ combinators

def and_masks(*masks):
    """A mask_mod keeping what every one of ``masks`` keeps."""
    def mask(b, h, q_idx, kv_idx, aux):
        keep = masks[0](b, h, q_idx, kv_idx, aux)
        for m in masks[1:]:
            keep = keep & m(b, h, q_idx, kv_idx, aux)
        return keep

    return mask


def or_masks(*masks):
    """A mask_mod keeping what any one of ``masks`` keeps."""
    def mask(b, h, q_idx, kv_idx, aux):
        keep = masks[0](b, h, q_idx, kv_idx, aux)
        for m in masks[1:]:
            keep = keep | m(b, h, q_idx, kv_idx, aux)
        return keep

    return mask


# ------------------------------------------------------------------------------ built-in variants

def alibi(slot: int = 0):
    """ALiBi score_mod: ``score + slopes[h] * (kv_idx - q_idx)`` with ``aux[slot]`` the
    per-head slopes, (nheads,) float32 (``alibi_slopes``)."""
    def alibi_mod(score, b, h, q_idx, kv_idx, aux):
        return score + aux[slot][h] * (kv_idx - q_idx)

    return alibi_mod


def alibi_slopes(nheads: int, device="cuda") -> torch.Tensor:
    """The ALiBi paper's slopes, 2 ** (-8 (h + 1) / nheads), (nheads,) float32."""
    return torch.exp2(-8.0 * (torch.arange(nheads, device=device, dtype=torch.float32) + 1) / nheads)


def relative_position_bias(max_distance: int, slot: int = 0):
    """T5-style learned bias: ``score + table[h, clamp(kv_idx - q_idx, -M, M) + M]`` with
    ``aux[slot]`` the table, (nheads, 2 M + 1) float32, M = ``max_distance``."""
    m = int(max_distance)

    def rel_bias_mod(score, b, h, q_idx, kv_idx, aux):
        return score + aux[slot][h, minimum(maximum(kv_idx - q_idx, -m), m) + m]

    return rel_bias_mod


def document_mask(slot: int = 0):
    """Packed-sequence mask: query and key in the same document, ``aux[slot]`` the
    document id of every position, (batch, seqlen) int32 (self-attention: q and k share
    positions). Combine with ``causal=True`` (or ``causal_mask``) for causal packing."""
    def doc_mask(b, h, q_idx, kv_idx, aux):
        return aux[slot][b, q_idx] == aux[slot][b, kv_idx]

    return doc_mask


def prefix_lm(slot: int = 0):
    """Prefix-LM: bidirectional over each sequence's first ``aux[slot][b]`` positions
    ((batch,) int32), causal after them."""
    def prefix_mask(b, h, q_idx, kv_idx, aux):
        return (kv_idx <= q_idx) | (kv_idx < aux[slot][b])

    return prefix_mask


def causal_mask(b, h, q_idx, kv_idx, aux):
    """Top-left causal (as in FlexAttention); ``causal=True`` is the bottom-right built-in."""
    return kv_idx <= q_idx


def sliding_window(window: int):
    """Causal sliding window of ``window`` keys before the query (a compile-time constant;
    ``window_size=(window, 0)`` is the built-in, runtime-sized equivalent)."""
    w = int(window)

    def window_mask(b, h, q_idx, kv_idx, aux):
        return (kv_idx <= q_idx) & (q_idx - kv_idx <= w)

    return window_mask


def softcap(cap: float):
    """score_mod ``cap * tanh(score / cap)`` (``softcap=`` is the built-in equivalent)."""
    c, inv = float(cap), 1.0 / float(cap)

    def softcap_mod(score, b, h, q_idx, kv_idx, aux):
        return c * tanh(score * inv)

    return softcap_mod
