"""The FMA-pipe exp2 of the softmax (``softmax.ex2_poly`` / ``ex2_poly_2``), modelled step
by step in float32 on the CPU: the constants and the exponent trick, over the whole range
the kernels feed it (scores minus the row max, times scale; up to +8 with an FP8 P's
offset). The SM100 kernel uses it by default (``sm100.ex2_share``) and no GPU here runs
that kernel, so this is what checks its arithmetic; the instructions themselves are checked
in the SASS (``test_fwd_compile``)."""

import math

import torch

from flash_attn_cute.device.softmax import _EX2_POLY, _ROUND_MAGIC


def _fma32(a, b, c):
    # float32 fused multiply-add: the product of two float32 is exact in float64.
    return (a.double() * b.double() + c).float()


def ex2_poly_model(x: torch.Tensor) -> torch.Tensor:
    """``ex2_poly``'s operations in float32: clamp, round by the magic constant, the cubic
    on the fraction (Horner, fused), and the integer part added to the exponent field."""
    magic = torch.tensor(_ROUND_MAGIC, dtype=torch.float32)
    x = torch.clamp_min(x.float(), -126.0)
    x_rounded = x + magic
    f = x - (x_rounded - magic)
    c0, c1, c2, c3 = (torch.tensor(c, dtype=torch.float32) for c in _EX2_POLY)
    poly = _fma32(_fma32(_fma32(c3, f, c2), f, c1), f, c0)
    n = x_rounded.view(torch.int32)
    return (poly.view(torch.int32) + (n << 23)).view(torch.float32)


def _rel_err(x: torch.Tensor) -> torch.Tensor:
    return (ex2_poly_model(x).double() / torch.exp2(x.double()) - 1.0).abs()


def test_ex2_poly_is_exp2_within_fp16_rounding():
    # Below 2^-11 (fp16's unit roundoff 4.9e-4, bf16's 3.9e-3): P's own rounding dominates.
    x = torch.linspace(-125.0, 8.0, 1_000_001, dtype=torch.float32)
    rel = _rel_err(x)
    assert rel.max() < 2e-4, (rel.max().item(), x[rel.argmax()].item())


def test_ex2_poly_integers_and_fraction_boundaries():
    # Integer inputs and the round-to-nearest ties at +-0.5 land on the right power of two.
    x = torch.tensor([-100.0, -20.0, -1.0, 0.0, 1.0, 7.0, -0.5, 0.5, -2.5, 3.5])
    rel = _rel_err(x)
    assert rel.max() < 2e-4, rel


def test_ex2_poly_underflow_is_tiny_and_finite():
    # Scores far below the row max (or -inf in a block that may use it: masked blocks do
    # not) clamp to 2^-126-ish: finite, positive, far below any unmasked P.
    x = torch.tensor([-126.0, -200.0, -1e30, -math.inf])
    got = ex2_poly_model(x)
    assert torch.isfinite(got).all() and (got >= 0).all() and (got < 2.0 ** -125).all()
