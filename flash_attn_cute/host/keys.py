"""Compile keys: their layouts, written by the host planners and read back by the kernels.

A compile key is a short tuple that is the whole identity of a binary: the JIT cache, the
disk cache and ahead-of-time builds store a kernel under it, and a kernel module's
``compile(key)`` rebuilds the binary from the key alone. Plain Python: the seam and the
backends build keys without loading the DSL; the kernel modules parse them.

- Forward kernels: ``make_key`` / ``parse_key`` (``("fwd_<backend>", arch, dtype, d, d_v,
  *config fields, flags, qhead_per_kvhead_packed, is_split, has_lse, varlen_q, varlen_k,
  has_seqused_k, paged, has_seqused_q, has_sink, split_blocks, q_class, *backend extra)``).
  ``paged`` is a bool, or ``PAGED_LEFTPAD`` for a paged cache whose sequences start at a
  per-sequence position (``cache_leftpad``, the kernels' ``mLeftpadK``): a value of its own
  in an existing field, so that every other key stays what it was.
- MLA kernels: ``mla_key`` / ``parse_mla_key`` (``("mla_<backend>", arch, dtype, heads,
  causal, is_split, has_lse, split_blocks, *config)``; ``heads``: ``mla_heads_key``).
- The split-KV combine: ``combine_key``.

``split_blocks`` > 0 is a batch-invariant split kernel: split s covers the absolute KV
blocks [s * split_blocks, (s + 1) * split_blocks) (``BlockInfo.get_n_block_min_max``); 0
divides each tile's KV range evenly into the launch's num_splits.
"""

from __future__ import annotations

import os
import re
from typing import NamedTuple

import torch

DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32",
               torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


def dtype_key(dtype, kv_dtype=None) -> str:
    """A forward key's dtype field: q's dtype name, then ``/`` and K/V's for FP8 K/V
    (``"bf16/e4m3"``); ``fwd_kernel.compile_from_key`` splits it."""
    return DTYPE_NAMES[dtype] + (f"/{DTYPE_NAMES[kv_dtype]}" if kv_dtype is not None else "")


def target_arch(device=None) -> str:
    """The arch kernels are compiled for: CUTE_DSL_ARCH, else that of ``device`` (default:
    the current GPU), named the way the DSL names it. Never touches the CUDA driver when
    the env var is set."""
    arch = os.environ.get("CUTE_DSL_ARCH")
    if arch:
        return arch
    if not torch.cuda.is_available():
        raise RuntimeError("no GPU: set CUTE_DSL_ARCH (e.g. sm_90a) to compile without one")
    return arch_of_capability(torch.cuda.get_device_capability(device))


def arch_of_capability(capability: tuple) -> str:
    """The arch a call on a GPU of ``capability`` compiles for (``target_arch``'s rule from
    a capability the caller read): CUTE_DSL_ARCH, else ``sm_<major><minor>[a]``."""
    arch = os.environ.get("CUTE_DSL_ARCH")
    if arch:
        return arch
    major, minor = capability
    return f"sm_{major}{minor}{'a' if major >= 9 else ''}"


def arch_capability(arch: str) -> tuple:
    """(major, minor) of an arch named the way the DSL names it (``sm_80``, ``sm_90a``,
    ``sm_100a``, ``sm_103f``)."""
    m = re.fullmatch(r"sm_(\d+)(\d)[af]?", arch)
    if not m:
        raise ValueError(f"arch must look like sm_80, sm_86, sm_90a, sm_100a; got {arch!r}")
    return int(m.group(1)), int(m.group(2))


def target_arch_or_none(device=None):
    """``target_arch``, or None where there is neither CUTE_DSL_ARCH nor a GPU (a plan made
    on a CPU for a fake device, which never launches)."""
    if os.environ.get("CUTE_DSL_ARCH") or torch.cuda.is_available():
        return target_arch(device)
    return None


# The ``paged`` field of a forward key over a paged cache with per-sequence key starts.
PAGED_LEFTPAD = "paged+leftpad_k"
# The SM90 forward key's last field where its kernel quantizes 16-bit queries to e4m3
# (an e4m3 cache run by the FP8 Q, K, V kernel, ``sm90.quantizes_q``); absent otherwise, so
# that every other key stays what it was.
QUANTIZE_Q = "quantize_q"
# The SM90 forward key's field of two-level accumulation of the FP8 P V product every n KV
# blocks (``FwdProblem.fp8_two_level_interval``): ``"two_level<n>"``, absent for 0 (off),
# so that every other key stays what it was.
TWO_LEVEL = "two_level"
# The SM90 forward key's field of a paged cache read by TMA boxes of n < tile_n rows (pages of a
# multiple of 16 keys that hold no whole KV block): ``"kv_box<n>"``, absent otherwise.
KV_BOX = "kv_box"


def count_field(name: str, n: int) -> str:
    """The key field of a count n > 0 under ``name`` (``TWO_LEVEL``, ``KV_BOX``): ``"<name><n>"``."""
    assert n > 0, (name, n)
    return f"{name}{int(n)}"


def parse_count_field(name: str, field) -> int:
    """The count a key field holds under ``name`` (``count_field``'s inverse), 0 for any other field."""
    if isinstance(field, str) and field.startswith(name):
        return int(field[len(name):])
    return 0


def two_level_field(interval: int) -> str:
    """The key field of a two-level interval n > 0 (``"two_level4"``)."""
    return count_field(TWO_LEVEL, interval)


def parse_two_level(field) -> int:
    """The interval a key field holds (``two_level_field``'s inverse), 0 for any other field."""
    return parse_count_field(TWO_LEVEL, field)


def kv_box_field(rows: int) -> str:
    """The key field of TMA boxes of ``rows`` rows (``"kv_box16"``)."""
    return count_field(KV_BOX, rows)


def parse_kv_box(field) -> int:
    """The box rows a key field holds (``kv_box_field``'s inverse), 0 for any other field."""
    return parse_count_field(KV_BOX, field)


def make_key(name: str, arch: str, dtype_name: str, d: int, d_v: int, tile: tuple, flags, qhead_per_kvhead_packed,
             is_split, has_lse, varlen_q, varlen_k, has_seqused_k, paged, has_seqused_q, has_sink, split_blocks,
             q_class: int = 0, extra: tuple = (), leftpad_k: bool = False) -> tuple:
    """A forward compile key: ``("fwd_<name>", arch, dtype, d, d_v, *tile, flags,
    qhead_per_kvhead_packed, is_split, has_lse, varlen_q, varlen_k, has_seqused_k, paged,
    has_seqused_q, has_sink, split_blocks, q_class, *extra)``; ``tile``: the static fields of
    the backend's config that come first (spread into the key), ``extra``: the backend's own
    static choices, last; ``q_class`` (``FwdProblem.q_class``): the sequences it computes;
    ``leftpad_k`` (a paged cache only, ``FwdProblem.leftpad_k``): ``paged`` is ``PAGED_LEFTPAD``."""
    assert not leftpad_k or paged, "leftpad_k is for paged caches"
    flags = tuple(bool(f) for f in flags[:3]) + tuple(flags[3:])  # [user variant key]
    paged = PAGED_LEFTPAD if leftpad_k else bool(paged)
    return (f"fwd_{name}", arch, dtype_name, d, d_v, *tile, flags, int(qhead_per_kvhead_packed),
            bool(is_split), bool(has_lse), bool(varlen_q), bool(varlen_k), bool(has_seqused_k), paged,
            bool(has_seqused_q), bool(has_sink), int(split_blocks), int(q_class), *extra)


class KeyFields(NamedTuple):
    """A forward compile key read back (``parse_key``)."""

    arch: str
    dtype_name: str
    d: int
    d_v: int
    tile: tuple
    flags: tuple  # (causal, local, softcap[, user variant key][, None, "cp"])
    qhead_per_kvhead_packed: int
    is_split: bool
    has_lse: bool
    varlen_q: bool
    varlen_k: bool
    has_seqused_k: bool
    paged: object  # True / False, or PAGED_LEFTPAD (truthy)
    has_seqused_q: bool
    has_sink: bool
    split_blocks: int
    q_class: int
    extra: tuple  # the backend's own fields after the common ones

    @property
    def leftpad_k(self) -> bool:
        """A paged cache with per-sequence key starts (``mLeftpadK``)."""
        return self.paged == PAGED_LEFTPAD


_COMMON_FIELDS = 12  # flags .. q_class


def parse_key(key: tuple, tile_len: int) -> KeyFields:
    """``make_key``'s inverse, for a backend whose key tile has ``tile_len`` fields."""
    rest = 5 + tile_len
    return KeyFields(*key[1:5], tuple(key[5:rest]), *key[rest:rest + _COMMON_FIELDS],
                     tuple(key[rest + _COMMON_FIELDS:]))


def mla_heads_key(qhead_per_kvhead: int, kv_heads: bool = False):
    """An MLA key's heads field: the query heads packed per KV head, an int for caches of one
    latent head (``(num_pages, page_size, d)``: the int is nheads, as in every key before KV
    heads existed), ``"<g>/hkv"`` for caches with a KV-head mode (``(num_pages, page_size,
    nheads_kv, d)``, nheads_kv > 1, a runtime value like the batch). Like ``dtype_key``'s
    ``"bf16/e4m3"``: the new form leaves the existing keys as they were."""
    return f"{int(qhead_per_kvhead)}/hkv" if kv_heads else int(qhead_per_kvhead)


def parse_mla_heads(field) -> tuple:
    """``mla_heads_key``'s inverse: (query heads per KV head, whether the caches have a KV-head mode)."""
    if isinstance(field, str):
        g, _, mode = field.partition("/")
        assert mode == "hkv", field
        return int(g), True
    return int(field), False


def mla_key(name: str, arch: str, dtype_name: str, heads, causal, is_split: bool, has_lse: bool,
            split_blocks: int, config: tuple) -> tuple:
    """An MLA compile key: ``("mla_<name>", arch, dtype, heads, causal, is_split, has_lse,
    split_blocks, *config)``, ``heads`` a ``mla_heads_key`` (or an int: nheads over one
    latent head), ``config`` in the backend's key form; ``causal`` a bool, or ``"cp"``
    (``MlaProblem.cp``): causal over a context-parallel shard; ``is_split`` a bool, or
    ``"schedule"``: work items of a device-computed schedule (``kernels/mla_schedule.py``)."""
    heads = mla_heads_key(*parse_mla_heads(heads))
    causal = causal if causal == "cp" else bool(causal)
    is_split = is_split if is_split == "schedule" else bool(is_split)
    return (f"mla_{name}", arch, dtype_name, heads, causal, is_split, bool(has_lse),
            int(split_blocks), *config)


class MlaKeyFields(NamedTuple):
    arch: str
    dtype_name: str
    qhead_per_kvhead: int  # query heads packed per KV head (nheads, with one latent head)
    kv_heads: bool  # the caches have a KV-head mode (nheads_kv > 1)
    causal: object  # a bool, or "cp": causal over a context-parallel shard
    is_split: object  # a bool, or "schedule"
    has_lse: bool
    split_blocks: int
    config: tuple


def parse_mla_key(key: tuple) -> MlaKeyFields:
    """``mla_key``'s inverse."""
    return MlaKeyFields(key[1], key[2], *parse_mla_heads(key[3]), *key[4:8], tuple(key[8:]))


def combine_key(out_dtype_name: str, head_dim_v: int, has_lse: bool, arch: str, has_sink: bool = False,
                split_info: bool = False) -> tuple:
    """The split-KV combine kernel's key (``combine.compile_combine``): ``("combine", dtype,
    d_v, has_lse, has_sink, arch)``; ``has_sink``: it adds a learnable sink per head;
    ``split_info``: per-sequence (slot_base, splits) of a device schedule, one more field."""
    key = ("combine", out_dtype_name, head_dim_v, bool(has_lse), bool(has_sink), arch)
    return key + ("split_info",) if split_info else key
