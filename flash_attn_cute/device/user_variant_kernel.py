"""The kernel side of a user variant (``user_variants.py`` is the host side: digest, spec,
registry, aux checks): ``UserVariant``, the ``AttentionVariant`` that runs the user's
``score_mod`` / ``mask_mod`` inside a kernel, its aux tensors (``AuxTensor``) and the
key ranges of a block mask.

``make_variant`` builds every kernel's variant from its compile key's flags: the built-in
ones (``variants.py``), or this one from the spec the key names
(``user_variants.registered_spec``): the user's score modifier, the built-in mask (causal /
local, may be None) AND the user's mask, and key ranges from the built-in mask
intersected with the block mask's (``ctx.block_ranges``: (batch, heads, q blocks, 4)
int32 = kept keys [lo, hi), keys kept by every row [full_lo, full_hi), per ``block_q``
query rows; see block_mask.py).
"""

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from flash_attn_cute.host.user_variants import VariantCompileError, VariantSpec, describe_error, registered_spec
from flash_attn_cute.device.variants import AttentionVariant, Causal, Compose, ContextParallel, Local, Softcap


def kernel_variant(user_key: tuple, base_mask, base_mod=None):
    """The kernel-side variant of a registered spec, over the built-in ``base_mask`` and
    ``base_mod`` (the built-in softcap: only without a user ``score_mod``)."""
    return UserVariant(registered_spec(user_key), base_mask, base_mod)


class AuxTensor:
    """One aux tensor inside a kernel: ``t[i, j]`` (a full index) loads the element as
    ``Float32`` (floating types), ``Int32`` (integers) or ``Boolean`` (bool); a partial
    index ``t[i]`` of a rank-2 tensor selects a row (kernel only: in torch that indexes
    the first dimension with a broadcast tensor, so write ``t[i, j]``)."""

    def __init__(self, t, dtype_name: str):
        self._t, self._dtype_name = t, dtype_name

    def __getitem__(self, idx):
        idx = idx if isinstance(idx, tuple) else (idx,)
        rank = cute.rank(self._t)
        if len(idx) > rank:
            raise IndexError(f"aux tensor of rank {rank} indexed with {len(idx)} indices")
        idx = tuple(Int32(i) for i in idx)
        if len(idx) < rank:
            return AuxTensor(self._t[idx + (None,) * (rank - len(idx))], self._dtype_name)
        value = self._t[idx]
        if self._dtype_name == "Boolean":
            return value != cutlass.Uint8(0)
        if self._dtype_name.startswith(("Float", "BFloat")):
            return cutlass.Float32(value)
        return Int32(value)


class UserVariant(AttentionVariant):
    """A ``VariantSpec`` as an ``AttentionVariant`` (see the module docstring)."""

    def __init__(self, spec: VariantSpec, base_mask, base_mod=None):
        # The built-in softcap is a score modifier like the user's: dropping it here made
        # softcap + mask_mod ignore the cap (issue 30's wrong result).
        assert base_mod is None or spec.score_mod is None, "softcap and score_mod are refused together"
        self.spec, self.base, self.base_mod = spec, base_mask, base_mod
        self.has_score_mod = spec.score_mod is not None or base_mod is not None
        self.has_mask = base_mask is not None or spec.mask_mod is not None
        # A block mask with row bounds (over a causal / local base mask or none) keeps one
        # key interval per row: the kernels mask by two bounds per row (``row_interval``,
        # ``variants.apply_to_scores``); otherwise element by element (``mask``).
        assert base_mask is None or base_mask.mask_is_key_interval
        self.mask_is_key_interval = spec.row_bounds

    def key(self) -> tuple:
        return (self.spec.key + ((self.base.key(),) if self.base is not None else ())
                + ((self.base_mod.key(),) if self.base_mod is not None else ()))

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
        if self.base_mod is not None:
            return self.base_mod.score_mod(s, q_idx, k_idx, head, ctx)
        out = self._call("score_mod", self.spec.score_mod, (s, ctx.batch, head, q_idx, k_idx, self._aux(ctx)))
        return cutlass.Float32(out)

    def mask(self, q_idx, k_idx, head, ctx):
        keep = None
        if self.base is not None:
            keep = self.base.mask(q_idx, k_idx, head, ctx)
        if self.spec.mask_mod is not None:
            user = self._call("mask_mod", self.spec.mask_mod, (ctx.batch, head, q_idx, k_idx, self._aux(ctx)))
            if isinstance(user, bool):
                user = cutlass.Boolean(user)
            keep = user if keep is None else keep & user
        return keep

    def row_interval(self, q_idx, head, ctx):
        """The base mask's interval of the row intersected with the block mask's row bounds
        (``spec.row_bounds`` only)."""
        lo, hi = (None, None) if self.base is None else self.base.row_interval(q_idx, head, ctx)
        table = ctx.block_ranges
        return _intersect(lo, hi, table[ctx.batch, head, q_idx, 4], table[ctx.batch, head, q_idx, 5])

    def key_range(self, q_min, q_max, ctx):
        lo, hi = (None, None) if self.base is None else self.base.key_range(q_min, q_max, ctx)
        if self.spec.block_q > 0:
            b_lo, b_hi, _, _ = self._block_ranges(q_min, q_max, ctx)
            lo, hi = _intersect(lo, hi, b_lo, b_hi)
        return lo, hi

    def unmasked_key_range(self, q_min, q_max, ctx):
        lo, hi = (None, None) if self.base is None else self.base.unmasked_key_range(q_min, q_max, ctx)
        if self.spec.mask_mod is None:
            return lo, hi
        if self.spec.block_q == 0:  # no block mask: every block takes the predicate
            return Int32(0), Int32(0)
        _, _, f_lo, f_hi = self._block_ranges(q_min, q_max, ctx)
        return _intersect(lo, hi, f_lo, f_hi)

    def _block_ranges(self, q_min, q_max, ctx):
        return _block_ranges(ctx.block_ranges, ctx.batch, ctx.head, q_min, q_max, self.spec.block_q)


def _intersect(lo, hi, lo2, hi2):
    lo = lo2 if lo is None else cutlass.max(lo, lo2)
    hi = hi2 if hi is None else cutlass.min(hi, hi2)
    return lo, hi


@cute.jit
def _block_ranges(mRanges: cute.Tensor, batch: Int32, head: Int32, q_min: Int32, q_max: Int32,
                  block_q: cutlass.Constexpr[int]):
    """Union of the kept-key ranges and intersection of the every-row-kept ranges of the
    block-mask entries covering queries [q_min, q_max] (one entry per ``block_q`` rows; a
    kernel tile of ``tile_m`` rows spans ceil(tile_m / block_q) or one more)."""
    lo, hi = mRanges[batch, head, q_min // block_q, 0], mRanges[batch, head, q_min // block_q, 1]
    f_lo, f_hi = mRanges[batch, head, q_min // block_q, 2], mRanges[batch, head, q_min // block_q, 3]
    for qb in cutlass.range(q_min // block_q + 1, q_max // block_q + 1, unroll=1):
        lo = cutlass.min(lo, mRanges[batch, head, qb, 0])
        hi = cutlass.max(hi, mRanges[batch, head, qb, 1])
        f_lo = cutlass.max(f_lo, mRanges[batch, head, qb, 2])
        f_hi = cutlass.min(f_hi, mRanges[batch, head, qb, 3])
    return lo, hi, f_lo, f_hi


def make_variant(causal: bool, local: bool, softcap: bool, user_key: Optional[tuple] = None,
                 cp: Optional[str] = None) -> AttentionVariant:
    """The variant for the public API's flags (local wins over causal: the host folds
    causal into window_right = 0); ``user_key`` names a registered user variant
    (``user_variants.VariantSpec.key``), composed with the built-in mask and, when the
    user gives no ``score_mod``, with the built-in softcap (the host refuses both); ``cp``
    (``"cp"``, ``FwdProblem.cp``): the keys are a context-parallel shard, the masks taken
    on global positions (``ContextParallel``; no user variant)."""
    mask = Local() if local else (Causal() if causal else None)
    mod = Softcap() if softcap else None
    if user_key is not None:
        return kernel_variant(user_key, mask, mod)
    variant = mask or mod or AttentionVariant()
    if mask is not None and mod is not None:
        variant = Compose(mod, mask)
    if cp is not None:
        variant = ContextParallel(variant)
    return variant
