"""User-defined attention variants: ``score_mod`` and ``mask_mod`` written once, in plain
Python, compiled into every forward kernel and run by the torch reference.

    score_mod(score, batch, head, q_idx, kv_idx, aux) -> new score
    mask_mod(batch, head, q_idx, kv_idx, aux) -> keep (a boolean)

``score`` is the scaled score (``softmax_scale * q.k``), ``head`` the query head (also
under pack_gqa), ``q_idx``/``kv_idx`` positions in the query and key sequences
(top-left aligned, as in FlexAttention), ``aux`` the user's ``aux_tensors``. In a kernel
the arguments are DSL scalars (``Float32``, ``Int32``) and ``aux[i][j, k]`` loads one
element; in the reference they are broadcastable torch tensors. The functions
therefore use only what both understand: arithmetic, comparisons, ``&``/``|``/``~`` on
conditions, ``flash_attn_cute.mods`` (``where``, ``exp``, ``tanh``, ...) and indexing of
aux tensors with a full index tuple.

Host side (``VariantSpec``): a call's functions are identified by a digest of their
code, constants, closure values and the simple globals they read, plus the aux tensors'
dtypes and ranks. That digest is part of the compile key (new slopes or document ids
never recompile; an edited function does), and the spec is registered under it so that
``compile(key)`` finds the functions. Kernel side (``UserVariant``): an
``AttentionVariant`` composing the user's functions with the built-in causal/local mask
and, with a block mask, the key ranges ``block_mask.create_block_mask`` computed.
"""

from __future__ import annotations

import hashlib
import linecache
import os
import sys
import types
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

MAX_AUX = 4  # aux tensor slots of the kernels' argument list (FwdArgs.mAux0..3)
AUX_DTYPES = {torch.float32: "Float32", torch.float16: "Float16", torch.bfloat16: "BFloat16",
              torch.int32: "Int32", torch.int64: "Int64", torch.int16: "Int16", torch.int8: "Int8",
              torch.uint8: "Uint8", torch.bool: "Boolean"}

SUPPORTED = ("supported inside score_mod / mask_mod: arithmetic (+ - * / // %), comparisons, & | ~ on "
             "conditions, flash_attn_cute.mods functions (where, exp, exp2, log, log2, tanh, sqrt, rsqrt, "
             "abs, minimum, maximum, sigmoid), int/float constants, and aux tensor indexing with a full index "
             "tuple (aux[i][idx0, idx1]); not supported: Python if/and/or/not/loops on the arguments, torch "
             "functions, captured tensors")


_PROCESS_NONCE = os.urandom(8).hex()


class VariantCompileError(TypeError):
    """A score_mod / mask_mod the kernel compiler cannot translate."""


# ------------------------------------------------------------------------------ host


def function_digest(fn: Callable) -> str:
    """16 hex digits over what determines ``fn``'s behaviour in a kernel: its bytecode and
    constants (nested code included), the names it reads, its defaults, closure values and
    the values of simple globals it reads (numbers, strings, functions, recursively).
    Stable across processes, so the disk cache can serve a binary to a new process."""
    h = hashlib.sha256()
    _feed(h, fn, set())
    return h.hexdigest()[:16]


def _feed(h, obj, seen: set) -> None:
    if isinstance(obj, (bool, int, float, complex, str, bytes, type(None))):
        h.update(repr((type(obj).__name__, obj)).encode())
    elif isinstance(obj, (tuple, list, frozenset)):
        h.update(f"{type(obj).__name__}{len(obj)}".encode())
        for x in obj:
            _feed(h, x, seen)
    elif isinstance(obj, types.CodeType):
        h.update(obj.co_code)
        h.update(repr((obj.co_name, obj.co_names, obj.co_varnames, obj.co_freevars)).encode())
        for c in obj.co_consts:
            _feed(h, c, seen)
    elif isinstance(obj, types.FunctionType):
        if id(obj) in seen:
            h.update(b"<recursive>")
            return
        seen.add(id(obj))
        h.update(f"{obj.__module__}.{obj.__qualname__}".encode())
        _feed(h, obj.__code__, seen)
        _feed(h, obj.__defaults__, seen)
        _feed(h, tuple(sorted((obj.__kwdefaults__ or {}).items())), seen)
        for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or ()):
            _feed(h, name, seen)
            _feed(h, _closure_value(obj, name, cell), seen)
        for name in sorted(_global_names(obj.__code__)):
            if name in obj.__globals__:
                _feed(h, name, seen)
                _feed(h, _global_value(obj.__globals__[name]), seen)
    elif isinstance(obj, types.ModuleType):
        h.update(f"<module {obj.__name__}>".encode())
    elif hasattr(obj, "func") and hasattr(obj, "args"):  # functools.partial
        _feed(h, (obj.func, obj.args, tuple(sorted(obj.keywords.items()))), seen)
    elif isinstance(obj, (types.BuiltinFunctionType, type)):
        h.update(f"<{getattr(obj, '__module__', '')}.{obj.__qualname__}>".encode())
    else:  # an object the digest cannot see into: unique to this process (ids repeat across
        # processes, so the nonce keeps another process from loading this binary from disk)
        h.update(f"<{type(obj).__qualname__} {id(obj)} {_PROCESS_NONCE}>".encode())


def _closure_value(fn, name, cell):
    try:
        value = cell.cell_contents
    except ValueError:  # an empty cell (a name bound later)
        return "<empty>"
    if isinstance(value, torch.Tensor):
        raise ValueError(f"{_fn_name(fn)} captures the torch.Tensor {name!r}: a kernel cannot read a captured "
                         f"tensor; pass it in aux_tensors and read it as aux[i][...]")
    return value


def _global_value(value):
    """Globals enter the digest by value when simple, by name otherwise (a module)."""
    if isinstance(value, torch.Tensor):
        return f"<tensor global {tuple(value.shape)} {value.dtype}>"
    return value


def _global_names(code: types.CodeType) -> set:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _global_names(c)
    return names


def _fn_name(fn) -> str:
    return f"{getattr(fn, '__qualname__', type(fn).__name__)!r}"


@dataclass(frozen=True, eq=False)
class VariantSpec:
    """A call's user variant without its tensors: hashable by ``key`` (part of the compile
    key as the last of the variant flags); ``score_mod``/``mask_mod`` ride along."""

    score_mod: Optional[Callable]
    mask_mod: Optional[Callable]
    aux_sig: tuple  # ((dtype name, rank), ...) of the aux tensors
    block_q: int  # query rows per block-mask entry; 0 without a block mask
    key: tuple = field(default=())

    def __hash__(self):
        return hash(self.key)

    def __eq__(self, other):
        return isinstance(other, VariantSpec) and self.key == other.key


_registry: dict = {}


def make_spec(score_mod, mask_mod, aux_tensors: tuple, block_q: int) -> VariantSpec:
    """The spec of a call (``aux_tensors`` already validated), registered by its key."""
    for what, fn in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{what} must be a function, got {type(fn).__name__}")
    aux_sig = tuple((AUX_DTYPES[t.dtype], t.dim()) for t in aux_tensors)
    key = ("user", function_digest(score_mod) if score_mod is not None else None,
           function_digest(mask_mod) if mask_mod is not None else None, aux_sig, int(block_q))
    spec = VariantSpec(score_mod, mask_mod, aux_sig, int(block_q), key)
    _registry[key] = spec
    return spec


def registered_spec(key: tuple) -> VariantSpec:
    spec = _registry.get(key)
    if spec is None:
        raise RuntimeError(f"compile key names a user variant ({key[1]}, {key[2]}) that no call in this process "
                           f"defined: user variants compile from a call (or make_spec) in the same process")
    return spec


def check_aux_tensors(aux_tensors, device) -> tuple:
    """``aux_tensors`` as a tuple of tensors on ``device`` with supported dtypes, else
    TypeError/ValueError naming the entry."""
    if aux_tensors is None:
        return ()
    if isinstance(aux_tensors, torch.Tensor) or not isinstance(aux_tensors, (list, tuple)):
        raise TypeError(f"aux_tensors must be a list or tuple of torch.Tensor, got {type(aux_tensors).__name__}")
    if len(aux_tensors) > MAX_AUX:
        raise ValueError(f"aux_tensors holds at most {MAX_AUX} tensors, got {len(aux_tensors)}")
    for i, t in enumerate(aux_tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"aux_tensors[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in AUX_DTYPES:
            raise TypeError(f"aux_tensors[{i}] has dtype {t.dtype}; supported: "
                            f"{', '.join(str(d) for d in AUX_DTYPES)}")
        if t.dim() < 1 or t.numel() == 0:
            raise ValueError(f"aux_tensors[{i}] must have rank >= 1 and at least one element, got shape "
                             f"{tuple(t.shape)}")
        if t.device != device:
            raise ValueError(f"aux_tensors[{i}] is on {t.device}, but q is on {device}")
    return tuple(aux_tensors)


def kernel_aux(aux_tensors: tuple) -> tuple:
    """The aux tensors as the kernels take them (bool as uint8: the same bytes), padded
    with None to the ``MAX_AUX`` slots."""
    out = tuple(t.view(torch.uint8) if t.dtype == torch.bool else t for t in aux_tensors)
    return out + (None,) * (MAX_AUX - len(out))


def describe_error(kind: str, fn, err: BaseException) -> str:
    """Names the function, the line of it being traced when ``err`` was raised, the error
    and what is supported."""
    where = ""
    tb = err.__traceback__
    code = getattr(fn, "__code__", None)
    line = None
    while tb is not None:
        if code is not None and tb.tb_frame.f_code is code:
            line = tb.tb_lineno
        tb = tb.tb_next
    if line is not None:
        src = linecache.getline(code.co_filename, line).strip()
        where = f" at {code.co_filename}:{line}: `{src}`"
    return (f"{kind} {_fn_name(fn)} cannot be compiled into the kernel{where}: {type(err).__name__}: {err}. "
            f"{SUPPORTED}")


# ------------------------------------------------------------------------------ kernel

def kernel_variant(user_key: tuple, base_mask):
    """The kernel-side variant of a registered spec, over the built-in ``base_mask``."""
    return UserVariant(registered_spec(user_key), base_mask)


def _dsl():
    import cutlass
    import cutlass.cute as cute

    return cutlass, cute


class AuxTensor:
    """One aux tensor inside a kernel: ``t[i, j]`` (a full index) loads the element as
    ``Float32`` (floating types), ``Int32`` (integers) or ``Boolean`` (bool); a partial
    index ``t[i]`` of a rank-2 tensor selects a row (kernel only: in torch that indexes
    the first dimension with a broadcast tensor, so write ``t[i, j]``)."""

    def __init__(self, t, dtype_name: str):
        self._t, self._dtype_name = t, dtype_name

    def __getitem__(self, idx):
        cutlass, cute = _dsl()
        idx = idx if isinstance(idx, tuple) else (idx,)
        rank = cute.rank(self._t)
        if len(idx) > rank:
            raise IndexError(f"aux tensor of rank {rank} indexed with {len(idx)} indices")
        idx = tuple(cutlass.Int32(i) for i in idx)
        if len(idx) < rank:
            return AuxTensor(self._t[idx + (None,) * (rank - len(idx))], self._dtype_name)
        value = self._t[idx]
        if self._dtype_name == "Boolean":
            return value != cutlass.Uint8(0)
        if self._dtype_name.startswith(("Float", "BFloat")):
            return cutlass.Float32(value)
        return cutlass.Int32(value)


class UserVariant:
    """``AttentionVariant`` interface over a ``VariantSpec``: the user's score modifier,
    the built-in mask (causal / local, may be None) AND the user's mask, and key ranges
    from the built-in mask intersected with the block mask's (``ctx.block_ranges``:
    (batch, heads, q blocks, 4) int32 = kept keys [lo, hi), keys kept by every row
    [full_lo, full_hi), per ``block_q`` query rows; see block_mask.py)."""

    def __init__(self, spec: VariantSpec, base_mask):
        self.spec, self.base = spec, base_mask
        self.has_score_mod = spec.score_mod is not None
        self.has_mask = base_mask is not None or spec.mask_mod is not None

    def key(self) -> tuple:
        return self.spec.key + ((self.base.key(),) if self.base is not None else ())

    def _aux(self, ctx) -> tuple:
        return tuple(AuxTensor(t, name) for t, (name, _) in zip(ctx.aux, self.spec.aux_sig))

    def _call(self, kind: str, fn, args: tuple):
        try:
            return fn(*args)
        except VariantCompileError:
            raise
        except Exception as err:  # the DSL refused an expression while tracing the user's code
            raise VariantCompileError(describe_error(kind, fn, err)) from err

    def score_mod(self, s, q_idx, k_idx, head, ctx):
        cutlass, _ = _dsl()
        out = self._call("score_mod", self.spec.score_mod, (s, ctx.batch, head, q_idx, k_idx, self._aux(ctx)))
        return cutlass.Float32(out)

    def mask(self, q_idx, k_idx, head, ctx):
        cutlass, _ = _dsl()
        keep = None
        if self.base is not None:
            keep = self.base.mask(q_idx, k_idx, head, ctx)
        if self.spec.mask_mod is not None:
            user = self._call("mask_mod", self.spec.mask_mod, (ctx.batch, head, q_idx, k_idx, self._aux(ctx)))
            if isinstance(user, bool):
                user = cutlass.Boolean(user)
            keep = user if keep is None else keep & user
        return keep

    def key_range(self, q_min, q_max, ctx):
        lo, hi = (None, None) if self.base is None else self.base.key_range(q_min, q_max, ctx)
        if self.spec.block_q > 0:
            b_lo, b_hi, _, _ = self._block_ranges(q_min, q_max, ctx)
            lo, hi = _intersect(lo, hi, b_lo, b_hi)
        return lo, hi

    def unmasked_key_range(self, q_min, q_max, ctx):
        cutlass, _ = _dsl()
        lo, hi = (None, None) if self.base is None else self.base.unmasked_key_range(q_min, q_max, ctx)
        if self.spec.mask_mod is None:
            return lo, hi
        if self.spec.block_q == 0:  # no block mask: every block takes the predicate
            return cutlass.Int32(0), cutlass.Int32(0)
        _, _, f_lo, f_hi = self._block_ranges(q_min, q_max, ctx)
        return _intersect(lo, hi, f_lo, f_hi)

    def _block_ranges(self, q_min, q_max, ctx):
        return _block_ranges(ctx.block_ranges, ctx.batch, ctx.head, q_min, q_max, self.spec.block_q)


def _intersect(lo, hi, lo2, hi2):
    cutlass, _ = _dsl()
    lo = lo2 if lo is None else cutlass.max(lo, lo2)
    hi = hi2 if hi is None else cutlass.min(hi, hi2)
    return lo, hi


def _make_block_ranges():
    cutlass, cute = _dsl()
    Int32 = cutlass.Int32

    @cute.jit
    def block_ranges(mRanges: cute.Tensor, batch: Int32, head: Int32, q_min: Int32, q_max: Int32,
                     block_q: cutlass.Constexpr[int]):
        """Union of the kept-key ranges and intersection of the every-row-kept ranges of
        the block-mask entries covering queries [q_min, q_max] (one entry per ``block_q``
        rows; a kernel tile of ``tile_m`` rows spans ceil(tile_m / block_q) or one more)."""
        lo, hi = mRanges[batch, head, q_min // block_q, 0], mRanges[batch, head, q_min // block_q, 1]
        f_lo, f_hi = mRanges[batch, head, q_min // block_q, 2], mRanges[batch, head, q_min // block_q, 3]
        for qb in cutlass.range(q_min // block_q + 1, q_max // block_q + 1, unroll=1):
            lo = cutlass.min(lo, mRanges[batch, head, qb, 0])
            hi = cutlass.max(hi, mRanges[batch, head, qb, 1])
            f_lo = cutlass.max(f_lo, mRanges[batch, head, qb, 2])
            f_hi = cutlass.min(f_hi, mRanges[batch, head, qb, 3])
        return lo, hi, f_lo, f_hi

    return block_ranges


_block_ranges_fn = None


def _block_ranges(mRanges, batch, head, q_min, q_max, block_q):
    global _block_ranges_fn
    if _block_ranges_fn is None:  # built on first use: importing this module must not need the DSL
        _block_ranges_fn = _make_block_ranges()
    return _block_ranges_fn(mRanges, batch, head, q_min, q_max, block_q)


def is_dsl_value(x) -> bool:
    """Whether ``x`` is a DSL scalar (kernel tracing) rather than a torch tensor / number."""
    return "cutlass" in sys.modules and not isinstance(x, (torch.Tensor, bool, int, float))
