"""Attention variants: what a kernel does to each score, and which scores it keeps.

A variant is a score modifier and a mask predicate, each a DSL function of
(q index, k index, query head) and the CTA's context (batch, lengths, the per-launch
runtime parameters, the user's auxiliary tensors). Kernels
call them per element and know nothing else about the variant; the variant's
``key`` is part of every compile key, so two variants never share a binary.

The variant also tells the kernel which KV blocks it can skip (``key_range``) and
which need no per-element predicate at all (``unmasked_key_range``): causal and
local attention skip fully-masked blocks without a kernel-side special case.

Index conventions: q and k are positions inside the sequence; causal and local
windows are aligned to the bottom-right corner, so query i sees key j when
``i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right``.
"""

from dataclasses import dataclass, replace
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from flash_attn_cute.device.pack_gqa import query_and_head_of_row


@dataclass(frozen=True)
class VariantParams:
    """Runtime values a variant may read; passed to the kernel as scalars so that
    changing a window size or a softcap never recompiles."""

    window_left: Int32
    window_right: Int32
    softcap: Float32  # the cap itself; 0 when off
    softcap_inv: Float32  # 1 / softcap, computed once per CTA instead of per score


@dataclass(frozen=True)
class CpCtx:
    """A context-parallel shard's runtime facts (``ContextParallel``): this rank, the
    ranks, the tokens per block of the round-robin, and the sequence's key count over
    every rank (``cp_tot_seqused_k``). Runtime values: one compiled kernel serves every
    rank and group size."""

    rank: Int32
    world: Int32
    interleave: Int32
    tot_seqlen_k: Int32


def cp_ctx(info: Optional[cute.Tensor], tot_seqlen_k: Optional[cute.Tensor], batch) -> Optional[CpCtx]:
    """The ``CpCtx`` of sequence ``batch`` from a kernel's context-parallel tensors (``info``
    (3,) int32: rank, world, interleave; the global lengths (b,)); None without them."""
    if info is None:
        return None
    return CpCtx(info[0], info[1], info[2], tot_seqlen_k[batch])


@dataclass(frozen=True)
class AttnCtx:
    """Per-CTA context handed to variant functions."""

    batch: Int32
    head: Int32
    seqlen_q: Int32
    seqlen_k: Int32
    params: VariantParams
    aux: tuple = ()  # the user variant's auxiliary gmem tensors (user_variant_kernel.UserVariant)
    block_ranges: Optional[cute.Tensor] = None  # a block mask's key ranges (block_mask.py)
    cp: Optional[CpCtx] = None  # a context-parallel shard (``ContextParallel``); None otherwise


class AttentionVariant:
    """Plain softmax attention: no score modifier, no mask."""

    has_score_mod = False
    has_mask = False
    # Whether each query q keeps exactly the keys ``row_interval(q, ...)`` (causal, sliding
    # window, a block mask with row bounds): a kernel may then mask a row with two bounds
    # instead of calling ``mask`` per score.
    mask_is_key_interval = False

    def key(self) -> tuple:
        return ("base",)

    def score_mod(self, s, q_idx, k_idx, head, ctx: AttnCtx):
        """``s`` is the scaled score (q.k * softmax_scale) of query ``q_idx`` and key
        ``k_idx`` of query head ``head``; returns the modified score."""
        return s

    def mask(self, q_idx, k_idx, head, ctx: AttnCtx):
        """True where the score is kept."""
        return True

    def key_range(self, q_min, q_max, ctx: AttnCtx):
        """Keys [lo, hi) that any query in [q_min, q_max] may see (None: no bound)."""
        return None, None

    def row_interval(self, q_idx, head, ctx: AttnCtx):
        """Keys [lo, hi) query ``q_idx`` of query head ``head`` keeps (None: no bound), for
        a mask that is a key interval per row."""
        return self.key_range(q_idx, q_idx, ctx)

    def unmasked_key_range(self, q_min, q_max, ctx: AttnCtx):
        """Keys [lo, hi) kept for every query in [q_min, q_max]: blocks inside it
        skip the mask. (None, None): every block is masked (safe default for a
        user mask whose shape the kernel cannot know)."""
        if cutlass.const_expr(self.has_mask):
            return Int32(0), Int32(0)
        return None, None


class KeyIntervalMask(AttentionVariant):
    """A mask that keeps, for each query q, exactly the keys ``key_range(q, q)``."""

    has_mask = True
    mask_is_key_interval = True


class Causal(KeyIntervalMask):
    def key(self):
        return ("causal",)

    @cute.jit
    def mask(self, q_idx, k_idx, head, ctx: AttnCtx):
        return k_idx <= q_idx + ctx.seqlen_k - ctx.seqlen_q

    def key_range(self, q_min, q_max, ctx: AttnCtx):
        return None, q_max + ctx.seqlen_k - ctx.seqlen_q + 1

    def unmasked_key_range(self, q_min, q_max, ctx: AttnCtx):
        return Int32(0), q_min + ctx.seqlen_k - ctx.seqlen_q + 1


class Local(KeyIntervalMask):
    """Sliding window; a negative side is unbounded (the host passes -1)."""

    def key(self):
        return ("local",)

    @cute.jit
    def mask(self, q_idx, k_idx, head, ctx: AttnCtx):
        diag = q_idx + ctx.seqlen_k - ctx.seqlen_q
        p = ctx.params
        keep_right = k_idx <= diag + p.window_right
        keep_left = k_idx >= diag - p.window_left
        keep_right = keep_right or p.window_right < 0
        keep_left = keep_left or p.window_left < 0
        return keep_right and keep_left

    @cute.jit
    def _window(self, q_left, q_right, ctx: AttnCtx):
        """Keys [lo, hi) inside the window of query q_left (left edge) and q_right (right edge)."""
        p = ctx.params
        off = ctx.seqlen_k - ctx.seqlen_q
        lo = q_left + off - p.window_left
        hi = q_right + off + p.window_right + 1
        if p.window_left < 0:
            lo = Int32(0)
        if p.window_right < 0:
            hi = ctx.seqlen_k
        return lo, hi

    def key_range(self, q_min, q_max, ctx: AttnCtx):
        return self._window(q_min, q_max, ctx)

    def unmasked_key_range(self, q_min, q_max, ctx: AttnCtx):
        # Kept for every query: inside the window of the last query's left edge and
        # of the first query's right edge.
        return self._window(q_max, q_min, ctx)


class Softcap(AttentionVariant):
    """s -> softcap * tanh(s / softcap) on the scaled score."""

    has_score_mod = True

    def key(self):
        return ("softcap",)

    @cute.jit
    def score_mod(self, s, q_idx, k_idx, head, ctx: AttnCtx):
        p = ctx.params
        return p.softcap * cute.math.tanh(s * p.softcap_inv, fastmath=True)


class Compose(AttentionVariant):
    """A score modifier applied before a mask (softcap with causal, for instance)."""

    def __init__(self, mod: AttentionVariant, mask: AttentionVariant):
        assert mod.has_score_mod and not mod.has_mask
        assert mask.has_mask and not mask.has_score_mod
        self._mod, self._mask = mod, mask
        self.has_score_mod = True
        self.has_mask = True
        self.mask_is_key_interval = mask.mask_is_key_interval

    def key(self):
        return self._mod.key() + self._mask.key()

    def score_mod(self, s, q_idx, k_idx, head, ctx):
        return self._mod.score_mod(s, q_idx, k_idx, head, ctx)

    def mask(self, q_idx, k_idx, head, ctx):
        return self._mask.mask(q_idx, k_idx, head, ctx)

    def key_range(self, q_min, q_max, ctx):
        return self._mask.key_range(q_min, q_max, ctx)

    def row_interval(self, q_idx, head, ctx):
        return self._mask.row_interval(q_idx, head, ctx)

    def unmasked_key_range(self, q_min, q_max, ctx):
        return self._mask.unmasked_key_range(q_min, q_max, ctx)


@cute.jit
def apply_to_scores(
    variant: cutlass.Constexpr,
    s_mn: cute.Tensor,  # (rows, cols) view of this thread's scores (layout_utils.acc_mn_view)
    tScS_mn: cute.Tensor,  # the same view of the (row, col) tile coordinates
    ctx: AttnCtx,
    row0: Int32,  # first tile row (a packed row under pack_gqa)
    col0: Int32,  # first key of the block
    qhead_per_kvhead_packed: cutlass.Constexpr[int],  # packed rows per query position (1: unpacked)
    softmax_scale: Float32,
    masked: cutlass.Constexpr[bool],
):
    """The variant over one block of scores, in place, for every kernel that holds S in
    registers: the score modifier on every block (on the scaled score), and on a masked
    block the sequence end and the variant's mask (-inf where a score is dropped).
    Under pack_gqa ``ctx.head`` is the KV head; a row's query position and query head
    come from ``pack_gqa.query_and_head_of_row``. A mask that is a key interval per row
    (``mask_is_key_interval``) costs two bounds per row and a compare or two per score."""
    has_mod = cutlass.const_expr(variant.has_score_mod)
    by_row = cutlass.const_expr(masked and variant.mask_is_key_interval)
    if cutlass.const_expr(has_mod or masked):
        for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
            q_idx, head = query_and_head_of_row(row0 + tScS_mn[r, 0][0], ctx.head, qhead_per_kvhead_packed)
            lo_rel, hi_rel = None, None
            if cutlass.const_expr(by_row):
                lo_rel, hi_rel = row_bounds_rel(variant, q_idx, head, ctx, col0)
            for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                k_idx = col0 + tScS_mn[0, c][1]
                s = s_mn[r, c]
                if cutlass.const_expr(has_mod):
                    s = variant.score_mod(s * softmax_scale, q_idx, k_idx, head, ctx)
                if cutlass.const_expr(by_row):
                    col = tScS_mn[0, c][1]
                    drop = col >= hi_rel
                    if cutlass.const_expr(lo_rel is not None):
                        drop = drop or col < lo_rel
                    if drop:
                        s = -Float32.inf
                elif cutlass.const_expr(masked):
                    keep = k_idx < ctx.seqlen_k
                    if cutlass.const_expr(variant.has_mask):
                        keep = keep and variant.mask(q_idx, k_idx, head, ctx)
                    if not keep:
                        s = -Float32.inf
                s_mn[r, c] = s


@cute.jit
def row_bounds_rel(variant: cutlass.Constexpr, q_idx, head, ctx: AttnCtx, col0):
    """A key-interval mask's kept keys of one row, relative to the block's first key
    ``col0``, the sequence end folded in: (lo_rel or None: no lower bound, hi_rel); a
    block column c is kept when lo_rel <= c < hi_rel."""
    lo, hi = variant.row_interval(q_idx, head, ctx)
    hi_rel = ctx.seqlen_k - col0
    if cutlass.const_expr(hi is not None):
        hi_rel = cutlass.min(hi_rel, hi - col0)
    lo_rel = None
    if cutlass.const_expr(lo is not None):
        lo_rel = lo - col0
    return lo_rel, hi_rel


class ContextParallel(AttentionVariant):
    """A shard of the keys under context parallelism (vLLM's DCP, the FA3 fork's
    ``cp_world_size`` / ``cp_rank`` / ``cp_tot_seqused_k``): the cache holds every
    ``world``-th block of ``interleave`` tokens of the sequence, this rank's local key j
    being global key ``((j // I) * world + rank) * I + j % I`` (I = 1: ``j * world +
    rank``). Masks are the base variant's on global positions (the queries are the last
    ``seqlen_q`` of the ``tot_seqlen_k`` global keys, bottom-right as ever); key ranges come
    back as local ones, exactly (the map is increasing), so block skipping and the
    two-bound row masks work unchanged and the per-key map runs only where a mask is not
    a key interval. Rank, world and interleave are runtime values (``CpCtx``): the divisions
    by them run once per row bound, not per score."""

    def __init__(self, base: AttentionVariant):
        assert base.has_mask
        self.base = base
        self.has_score_mod = base.has_score_mod
        self.has_mask = True
        self.mask_is_key_interval = base.mask_is_key_interval

    def key(self):
        return self.base.key() + ("cp",)

    def _global_ctx(self, ctx: AttnCtx) -> AttnCtx:
        return replace(ctx, seqlen_k=ctx.cp.tot_seqlen_k)

    def global_key(self, k_idx, ctx: AttnCtx):
        """The global position of local key ``k_idx``."""
        i = ctx.cp.interleave
        return ((k_idx // i) * ctx.cp.world + ctx.cp.rank) * i + k_idx % i

    @cute.jit
    def local_count(self, x, ctx: AttnCtx):
        """Local keys whose global position is below ``x``: the first local index at or
        past global position ``x``."""
        i, w = ctx.cp.interleave, ctx.cp.world
        x = cutlass.max(x, 0)
        block = x // i  # x's global block of ``interleave`` tokens
        ahead = block - ctx.cp.rank  # global blocks before x's from this rank's first
        count = Int32(0)
        if ahead > 0:
            count = ((ahead + w - 1) // w) * i  # this rank's whole blocks before x's block
        if ahead >= 0:  # (nested: ahead % w of a negative ahead truncates toward zero)
            if ahead % w == 0:
                count = count + (x - block * i)  # x's block is this rank's: its tokens before x
        return count

    def _local(self, lo, hi, ctx: AttnCtx):
        return (None if lo is None else self.local_count(lo, ctx)), (None if hi is None else self.local_count(hi, ctx))

    def score_mod(self, s, q_idx, k_idx, head, ctx: AttnCtx):
        return self.base.score_mod(s, q_idx, self.global_key(k_idx, ctx), head, self._global_ctx(ctx))

    def mask(self, q_idx, k_idx, head, ctx: AttnCtx):
        return self.base.mask(q_idx, self.global_key(k_idx, ctx), head, self._global_ctx(ctx))

    def key_range(self, q_min, q_max, ctx: AttnCtx):
        return self._local(*self.base.key_range(q_min, q_max, self._global_ctx(ctx)), ctx)

    def row_interval(self, q_idx, head, ctx: AttnCtx):
        return self._local(*self.base.row_interval(q_idx, head, self._global_ctx(ctx)), ctx)

    def unmasked_key_range(self, q_min, q_max, ctx: AttnCtx):
        return self._local(*self.base.unmasked_key_range(q_min, q_max, self._global_ctx(ctx)), ctx)
