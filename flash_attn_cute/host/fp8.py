"""FP8 quantization for users and tests: tensors in the layouts the FP8 paths take.

``quantize_fp8(x)`` returns ``(x_fp8, descale)`` with ``x ~= x_fp8.float() * descale``
(broadcast over the quantized groups): one scale per tensor, per head, or per (batch,
head) as vLLM and FA3 pass ``k_descale`` / ``v_descale`` ``(batch, nheads_kv)``. Plain
torch: it runs once per cache write or weight load, not on the attention's hot path.
"""

from __future__ import annotations

import torch

__all__ = ["quantize_fp8", "FP8_DTYPES"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_GROUPINGS = ("tensor", "head", "batch_head")


def quantize_fp8(x: torch.Tensor, *, granularity: str = "batch_head", dtype: torch.dtype = torch.float8_e4m3fn):
    """(x_fp8, descale fp32): ``x`` ``(..., nheads, headdim)`` scaled so each group's amax
    maps to the format's largest finite value, rounded to ``dtype`` (e4m3 by default).

    ``granularity``: "tensor" -> descale ``(1,)``; "head" -> ``(nheads,)``; "batch_head"
    (x ``(batch, seqlen, nheads, headdim)``, a batch KV cache) -> ``(batch, nheads)``. A group
    of zeros gets descale 1."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dtype in FP8_DTYPES:
        raise TypeError(f"x must be a floating-point tensor (fp32/fp16/bf16), got {getattr(x, 'dtype', type(x))}")
    if dtype not in FP8_DTYPES:
        raise TypeError(f"dtype must be one of {FP8_DTYPES}, got {dtype}")
    if granularity not in _GROUPINGS:
        raise ValueError(f"granularity must be one of {_GROUPINGS}, got {granularity!r}")
    if x.dim() < 2 or (granularity == "batch_head" and x.dim() != 4):
        want = "(batch, seqlen, nheads, headdim)" if granularity == "batch_head" else "(..., nheads, headdim)"
        raise ValueError(f"x must have shape {want} for granularity {granularity!r}, got {tuple(x.shape)}")
    xf = x.float()
    if granularity == "tensor":
        amax = xf.abs().amax().reshape(1)
        shape = (1,) * x.dim()
    elif granularity == "head":
        amax = xf.abs().flatten(0, -3).amax(dim=(0, 2)) if x.dim() > 2 else xf.abs().amax(dim=-1)
        shape = (1,) * (x.dim() - 2) + (x.shape[-2], 1)
    else:
        amax = xf.abs().amax(dim=(1, 3))
        shape = (x.shape[0], 1, x.shape[2], 1)
    scale = torch.where(amax > 0, amax / torch.finfo(dtype).max, torch.ones_like(amax))
    x_fp8 = (xf / scale.view(shape)).clamp(torch.finfo(dtype).min, torch.finfo(dtype).max).to(dtype)
    return x_fp8, scale.float().contiguous()
