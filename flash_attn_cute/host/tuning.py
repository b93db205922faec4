"""Tuning overrides: explicit arguments to the backends' ``plan``, read from the environment
once per call at the API edge and part of both caches' keys.

A planner never reads the environment: ``plan(problem, num_splits, pack_gqa, num_sms,
tuning)`` gets a ``Tuning`` value, so the plan (and the compile key built from it) is a pure
function of its arguments, and a changed knob is a different per-call cache entry and a
different plan-cache entry (a tile sweep that sets a knob per iteration measures each tile).

A new knob: a field here, its variable in ``_ENV``, and the read in the backend's ``plan``.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional


class Tuning(NamedTuple):
    """Raw override strings (None: the planner's own choice); each backend parses its own."""

    sm80_tile: Optional[str] = None  # "m,n,warps,q_in_regs"
    sm90_tile: Optional[str] = None  # "m,n,stages[,ex2_emulate_every]"
    sm90_persistent: Optional[str] = None  # "0" / "1" / "dynamic" (where it fits; sm90.persistent)
    mla_stages: Optional[str] = None  # SM80 MLA pipeline depth: "2" / "3"
    mla_sm90_qk: Optional[str] = None  # SM90 MLA: "tma" (default) / the gathering kernel "seesaw" / "one" / "split"
    mla_fp8_stages: Optional[str] = None  # MLA over an FP8 cache: "stages,staging stages"
    # SM90, an e4m3 cache under 16-bit queries: "quantize_q" (the queries quantized in the
    # kernel, FP8 Q, K, V wgmma: the default) / "widen" (the cache widened to 16 bits)
    sm90_fp8_kv: Optional[str] = None
    # SM100, the same choice: "widen" (the default until measured on Blackwell) / "quantize_q"
    sm100_fp8_kv: Optional[str] = None
    # SM90, pages of a multiple of 16 keys that hold no whole KV block: "boxes" (the
    # default: TMA boxes of 16-64 rows, one page-table entry each, ``sm90.config.kv_box_rows``)
    # / "gather" (rows by cp.async, one page lookup a row). H100, 2026-12-07, b64 x 4096
    # h32/8 d128 decode at pages of 16, one run (``bench_fp8_decode.py --gathers``), us, boxes
    # against gathers: bf16 355.9 / 358.2, e4m3 cache under bf16 q 193.1 / 202.9, e4m3 q
    # 194.8 / 203.6.
    sm90_paged_kv: Optional[str] = None


NO_TUNING = Tuning()

_ENV = ("FLASH_ATTN_CUTE_BACKEND", "FLASH_ATTN_CUTE_SM80_TILE", "FLASH_ATTN_CUTE_SM90_TILE",
        "FLASH_ATTN_CUTE_SM90_PERSISTENT", "FLASH_ATTN_CUTE_MLA_STAGES", "FLASH_ATTN_CUTE_MLA_SM90_QK",
        "FLASH_ATTN_CUTE_MLA_FP8_STAGES", "FLASH_ATTN_CUTE_SM90_FP8_KV", "FLASH_ATTN_CUTE_SM100_FP8_KV",
        "FLASH_ATTN_CUTE_SM90_PAGED_KV")
# The values of sm90_fp8_kv / sm100_fp8_kv.
FP8_KV_MODES = ("quantize_q", "widen")


def fp8_kv_mode(value: Optional[str], default: str, variable: str) -> str:
    """An FP8-cache mode knob (``sm90_fp8_kv`` / ``sm100_fp8_kv``): its value, or the
    backend's ``default`` where unset; anything but ``FP8_KV_MODES`` is refused, naming the
    environment ``variable``."""
    mode = value or default
    if mode not in FP8_KV_MODES:
        raise ValueError(f"{variable}={mode!r}: one of {FP8_KV_MODES}")
    return mode


# The values of sm90_paged_kv.
PAGED_KV_MODES = ("gather", "boxes")


def paged_kv_boxes(value: Optional[str]) -> bool:
    """Whether ``sm90_paged_kv`` (FLASH_ATTN_CUTE_SM90_PAGED_KV) names TMA boxes for pages of a
    multiple of 16 keys that hold no whole KV block ("boxes", the default; "gather": row
    gathers); anything but ``PAGED_KV_MODES`` is refused."""
    mode = value or "boxes"
    if mode not in PAGED_KV_MODES:
        raise ValueError(f"FLASH_ATTN_CUTE_SM90_PAGED_KV={mode!r}: one of {PAGED_KV_MODES}")
    return mode == "boxes"


# os.environ.get encodes its key on every call: 10 us for seven of these on the CI machine.
# CPython's POSIX environ keeps a dict of bytes, read here with pre-encoded keys (0.5 us).
_ENV_DATA = getattr(os.environ, "_data", None) if os.name == "posix" else None
_ENV_BYTES = tuple(os.environ.encodekey(k) for k in _ENV) if _ENV_DATA is not None else None


def env_knobs() -> tuple:
    """The raw values of every knob variable (FLASH_ATTN_CUTE_BACKEND first), as the
    per-call cache keys them: one read per call."""
    if _ENV_DATA is not None:
        return tuple(v if v is None else os.environ.decodevalue(v) for v in map(_ENV_DATA.get, _ENV_BYTES))
    return tuple(map(os.environ.get, _ENV))


def fp8_stages_override(value: Optional[str]) -> Optional[tuple]:
    """``mla_fp8_stages`` "s,s8" as (16-bit stages, fp8 staging stages), or None."""
    if not value:
        return None
    try:
        stages, staging = (int(x) for x in value.split(","))
    except ValueError:
        raise ValueError(f"FLASH_ATTN_CUTE_MLA_FP8_STAGES={value}: two ints, 'stages,staging stages'") from None
    if stages < 2 or staging < 2:
        raise ValueError(f"FLASH_ATTN_CUTE_MLA_FP8_STAGES={value}: at least two of each")
    return stages, staging


def from_env(knobs: Optional[tuple] = None) -> Tuning:
    """The overrides of ``env_knobs()`` (read now when not given)."""
    values = env_knobs() if knobs is None else knobs
    if not any(values[1:]):
        return NO_TUNING
    return Tuning(*(v or None for v in values[1:]))
