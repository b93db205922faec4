"""CPU tests of ``quantize_fp8``: layouts of the descales, the round trip, refusals."""

import pytest
import torch

from flash_attn_cute.fp8 import quantize_fp8


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("granularity,shape", [("tensor", (1,)), ("head", (4,)), ("batch_head", (3, 4))])
def test_round_trip_and_layout(granularity, shape, dtype):
    x = torch.randn(3, 50, 4, 64) * torch.tensor([1.0, 10.0, 0.1, 1000.0]).view(1, 1, 4, 1)
    x[1, :, 2] = 0  # an all-zero (batch, head) group: descale 1, no NaN
    x_fp8, descale = quantize_fp8(x, granularity=granularity, dtype=dtype)
    assert x_fp8.dtype == dtype and x_fp8.shape == x.shape and descale.dtype == torch.float32
    assert tuple(descale.shape) == shape
    view = {"tensor": (1, 1, 1, 1), "head": (1, 1, 4, 1), "batch_head": (3, 1, 4, 1)}[granularity]
    back = x_fp8.float() * descale.view(view)
    rel = 2.0 ** -(3 if dtype == torch.float8_e4m3fn else 2)  # half an ulp of the mantissa, relative
    assert torch.isfinite(back).all()
    big = x.abs() > descale.view(view) * 2 ** -6  # normal range of the format
    assert ((back - x).abs() <= rel * x.abs() + 1e-6)[big].all()
    amax = (x_fp8.float().abs()).amax()
    assert amax <= torch.finfo(dtype).max


def test_refusals():
    with pytest.raises(TypeError, match="floating-point"):
        quantize_fp8(torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(TypeError, match="dtype must be one of"):
        quantize_fp8(torch.randn(2, 2), dtype=torch.float16)
    with pytest.raises(ValueError, match="granularity"):
        quantize_fp8(torch.randn(2, 2), granularity="row")
    with pytest.raises(ValueError, match=r"\(batch, seqlen, nheads, headdim\)"):
        quantize_fp8(torch.randn(5, 2, 8), granularity="batch_head")
