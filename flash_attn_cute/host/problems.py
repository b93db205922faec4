"""The problem kinds the seam (``seam/__init__.py``) dispatches, and the plan a backend makes of one.

A problem describes one call without its tensors (hashable: it keys the plan cache); a
backend's ``plan`` turns it into a ``FwdPlan`` holding every choice the compile key reads.
Each kind states the shapes of its split-KV partials (``partial_shapes``) so that the seam
allocates and combines them the same way for every kind. Plain Python (no DSL).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from flash_attn_cute.host.constants import D_CKV, D_KPE
from flash_attn_cute.host.fp8 import FP8_DTYPES
from flash_attn_cute.host.mla_schedule import info_view


def out_dtype(q_dtype: torch.dtype) -> torch.dtype:
    """The output dtype of a call with queries in ``q_dtype``: bf16 for FP8 queries (as in
    FA3 and FA4), q's dtype otherwise."""
    return torch.bfloat16 if q_dtype in FP8_DTYPES else q_dtype


def _partials(num_splits: int, out_shape: tuple, lse_shape: tuple) -> tuple:
    return (num_splits, *out_shape), (num_splits, *lse_shape)


class FwdProblem(NamedTuple):
    """One forward call (``flash_attn_func`` / ``_varlen_func`` / ``_with_kvcache``).

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
    has_seqused_q: bool = False  # per-sequence query counts (dense queries, rows past them unwritten)
    has_sink: bool = False  # learnable_sink: one logit per query head in every denominator
    batch_invariant: bool = False  # fixed keys per split and batch-independent tiles
    # The sequences a kernel computes (the two launches of a mixed plan, ``seam.mixed_short_q``):
    # 0 every one; n > 0 those of at most n queries; -n those of more than n.
    q_class: int = 0
    kv_dtype: Optional[torch.dtype] = None  # FP8 K/V (with k_descale / v_descale); None: q's dtype
    # A paged cache whose sequences start at a per-sequence cache position (cache_leftpad;
    # FwdArgs.mLeftpadK): key j of sequence b is cache position leftpad[b] + j.
    leftpad_k: bool = False
    # Context parallelism where it changes the kernel (a causal or windowed call over a key
    # shard, cp_world_size > 1): the kernels' ``ContextParallel`` variant, reading the rank,
    # the group size, the interleave and the global lengths at run time.
    cp: bool = False
    # fp8_two_level_interval (FP8 Q or K/V only, else 0): the FP8 P V wgmma accumulates n KV
    # blocks, then O is added into an fp32 accumulator (0: off). Only the SM90 FP8 Q, K, V
    # kernel reads it (``sm90.plan``); every other kernel ignores it.
    fp8_two_level_interval: int = 0

    @property
    def kv_fp8(self) -> bool:
        return self.kv_dtype is not None

    @property
    def qkv_fp8(self) -> bool:
        """FP8 Q, K and V (FP8 attention, ``q_descale`` / ``k_descale`` / ``v_descale``)."""
        return self.dtype in FP8_DTYPES

    @property
    def out_dtype(self) -> torch.dtype:
        return out_dtype(self.dtype)

    kind = "fwd"

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
        causal), then the user variant's key when there is one, or None and the context
        parallelism (``cp``; never with a user variant)."""
        flags = (self.causal and not self.local, self.local, self.softcap > 0)
        if self.cp:
            return flags + (None, "cp")
        return flags if self.variant is None else flags + (self.variant.key,)

    def lse_shape(self, out_shape: tuple) -> tuple:
        """LSE ``(nheads, total_q)`` for packed queries, else ``(batch, nheads, seqlen_q)``."""
        if self.varlen_q:
            return out_shape[1], out_shape[0]
        return out_shape[0], out_shape[2], out_shape[1]

    def partial_shapes(self, num_splits: int, out_shape: tuple) -> tuple:
        """(O partials, LSE partials): a leading split mode on out and lse, fp32."""
        return _partials(num_splits, out_shape, self.lse_shape(out_shape))

    @property
    def rows_unwritten(self) -> bool:
        """Whether the kernels leave some output rows out (``seqused_q``): their split-KV LSE
        partials then start at -inf (``seam.run_resolved``)."""
        return self.has_seqused_q

    def combine_views(self, out_partial, lse_partial, tensors) -> tuple:
        """The partials, the outputs and the sink of the call's kernel tensors
        (``api.call_args.FwdTensors``: the sink ``(nheads,)`` fp32 or None; the split kernels
        leave it out, the combine adds it once) in the combine kernel's batched contract:
        packed query rows are one sequence of batch 1."""
        out, lse, sink = tensors.out, tensors.lse, tensors.learnable_sink
        if not self.varlen_q:
            return out_partial, lse_partial, out, lse, sink
        return (out_partial.unsqueeze(1), lse_partial.unsqueeze(1), out.unsqueeze(0),
                None if lse is None else lse.unsqueeze(0), sink)


class MlaProblem(NamedTuple):
    """One MLA decode call (``flash_mla_decode``). A kind of its own rather than a
    ``FwdProblem`` with d = 576: a forward backend must never see it (the SM80 forward
    would run it as 576-wide GQA, reading K and V as separate tensors), and windows,
    softcap and varlen mean nothing here. ``max_seqlen_k`` is the cache capacity
    (``max_pages_per_seq * page_size``): the lengths live on the device. ``nheads_kv`` > 1:
    the caches have a KV-head mode (FlashMLA's ``h_kv``), each KV head serving its
    ``qhead_per_kvhead`` query heads; 1: one latent head shared by every query head."""

    dtype: torch.dtype
    batch: int
    max_seqlen_q: int
    max_seqlen_k: int
    nheads: int
    page_size: int
    softmax_scale: float
    causal: bool  # bottom-right aligned
    has_lse: bool
    batch_invariant: bool = False  # fixed keys per split: bitwise the same in any batch
    kv_dtype: Optional[torch.dtype] = None  # an FP8 latent cache (with kv_descale); None: q's dtype
    nheads_kv: int = 1  # KV heads of the caches (nheads a multiple of it)
    cp: bool = False  # causal over a context-parallel shard: as ``FwdProblem.cp``
    # a device-computed split schedule (``scheduler_metadata``, ``kernels/mla_schedule.py``) for
    # this many CTAs per grid slice; 0: none (the host plans the splits)
    schedule_parts: int = 0

    @property
    def kv_fp8(self) -> bool:
        return self.kv_dtype is not None

    @property
    def q_fp8(self) -> bool:
        """FP8 queries (with ``q_descale``; FlashMLA's FP8 mode): ``dtype`` is theirs."""
        return self.dtype.itemsize == 1

    @property
    def out_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.q_fp8 else self.dtype

    @property
    def causal_key(self):
        """The compile key's causal field (``keys.mla_key``): ``"cp"`` under ``cp``, else the bool."""
        return "cp" if self.cp else self.causal

    @property
    def qhead_per_kvhead(self) -> int:
        """Query heads per KV head: the rows per query position of the kernels' M tile."""
        return self.nheads // self.nheads_kv

    @property
    def kv_heads(self) -> bool:
        """The caches have a KV-head mode (``(num_pages, page_size, nheads_kv, d)``); one
        latent head (nheads_kv 1) runs on the caches without it."""
        return self.nheads_kv > 1

    kind = "mla"
    has_sink = False  # no learnable sink
    d = D_CKV + D_KPE
    d_v = D_CKV

    def lse_shape(self, out_shape: tuple) -> tuple:
        return out_shape[0], out_shape[2], out_shape[1]

    def partial_shapes(self, num_splits: int, out_shape: tuple) -> tuple:
        return _partials(num_splits, out_shape, self.lse_shape(out_shape))

    def scheduled_partials(self, out_partial, lse_partial, tensors):
        """A scheduled plan's kernel tensors (``FwdPlan.scheduled``): the output and LSE kept,
        the fp32 partials (slots, 1, ...) beside them with a batch mode of stride 0 (a slot
        holds one piece of one sequence), and the combine's arguments."""
        batch = tensors.out.shape[0]
        o = out_partial.expand(out_partial.shape[0], batch, *out_partial.shape[2:])
        lse = lse_partial.expand(lse_partial.shape[0], batch, *lse_partial.shape[2:])
        info = info_view(tensors.schedule, batch)
        return tensors._replace(o_partial=o, lse_partial=lse), (o, lse, tensors.out, tensors.lse, None, info)

    rows_unwritten = False  # every query row is computed

    def combine_views(self, out_partial, lse_partial, tensors) -> tuple:
        return out_partial, lse_partial, tensors.out, tensors.lse, None  # MLA has no sink


class FwdPlan(NamedTuple):
    """What a backend decided for a problem: all the compile key reads beside the problem.

    ``config`` is the backend's own named tuple (``Sm80Config``, ``Sm90Config``,
    ``Sm100Config``, ``MlaSm80Config``, ``MlaSm90Config``): tiles, stages, warp counts and
    every other static choice, among them ``split_blocks`` (KV blocks per split of a
    batch-invariant plan; 0: splits divide each tile's KV range evenly)."""

    backend: str
    config: tuple
    pack_gqa: bool
    num_splits: int
    # SMs the call leaves free (FA3's ``sm_margin``): the split heuristic and persistent grids
    # count the others (set by ``seam.resolve``; not a compile-key input)
    sm_margin: int = 0

    @property
    def scheduled(self) -> bool:
        """MLA work items from a device-computed schedule (``kernels/mla_schedule.py``):
        ``num_splits`` is then its partial slots."""
        return bool(getattr(self.config, "scheduled", False))

    @property
    def is_split(self) -> bool:
        """Whether the kernel writes fp32 partials that the combine merges: split-KV, and
        every batch-invariant plan (even of one split, so that a sequence's bits do not
        depend on whether another sequence made the batch split)."""
        return self.num_splits > 1 or self.config.split_blocks > 0

    def qhead_per_kvhead_packed(self, problem) -> int:
        """Rows per query position in the M tile: the GQA ratio when packed, else 1 (MLA
        always packs the query heads of a KV head)."""
        if problem.kind == "mla":
            return problem.qhead_per_kvhead
        return problem.qhead_per_kvhead if self.pack_gqa else 1
