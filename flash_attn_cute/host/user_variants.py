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
``compile(key)`` finds the functions. Kernel side (``user_variant_kernel.UserVariant``,
its own module: this one is host code): an ``AttentionVariant`` composing the user's
functions with the built-in causal/local mask and, with a block mask, the key ranges
``block_mask.create_block_mask`` computed.
"""

from __future__ import annotations

import hashlib
import linecache
import os
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
    # The block mask's table holds each row's kept interval (``BlockMask.row_bounds``): the
    # kernels mask by those bounds and never call mask_mod.
    row_bounds: bool = False

    def __hash__(self):
        return hash(self.key)

    def __eq__(self, other):
        return isinstance(other, VariantSpec) and self.key == other.key


_registry: dict = {}


def make_spec(score_mod, mask_mod, aux_tensors: tuple, block_q: int, row_bounds: bool = False) -> VariantSpec:
    """The spec of a call (``aux_tensors`` already validated), registered by its key.
    ``row_bounds``: the block mask's table holds per-row key intervals (``BlockMask``)."""
    for what, fn in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{what} must be a function, got {type(fn).__name__}")
    aux_sig = tuple((AUX_DTYPES[t.dtype], t.dim()) for t in aux_tensors)
    key = ("user", function_digest(score_mod) if score_mod is not None else None,
           function_digest(mask_mod) if mask_mod is not None else None, aux_sig, int(block_q), bool(row_bounds))
    spec = VariantSpec(score_mod, mask_mod, aux_sig, int(block_q), key, bool(row_bounds))
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
