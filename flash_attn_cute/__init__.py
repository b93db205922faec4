"""FlashAttention forward kernels in the CUTLASS CuTe Python DSL, compiled at first call.

Public API (inference forward, no autograd): ``flash_attn_func``, ``flash_attn_varlen_func``,
``flash_attn_with_kvcache``, ``flash_attn_combine``, ``flash_mla_decode`` (MLA decode over a
paged latent cache). See ``flash_attn_cute.interface`` and ``flash_attn_cute.mla``. User
variants: ``score_mod`` / ``mask_mod`` / ``aux_tensors`` / ``block_mask`` arguments,
``create_block_mask``, building blocks and built-in variants in ``flash_attn_cute.mods``.
"""

from importlib.metadata import PackageNotFoundError, version as _version

from flash_attn_cute.interface import (BACKENDS, MAX_SPLITS, SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, flash_attn_combine,
                                       flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache)
from flash_attn_cute import mods
from flash_attn_cute.host.block_mask import BlockMask, create_block_mask
from flash_attn_cute.host.fp8 import quantize_fp8
from flash_attn_cute.mla import flash_mla_decode, get_mla_metadata
from flash_attn_cute.host.user_variants import VariantCompileError

try:
    __version__ = _version("flash_attn_cute")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.1.0"

__all__ = [
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "flash_attn_combine",
    "flash_mla_decode",
    "get_mla_metadata",
    "create_block_mask",
    "quantize_fp8",
    "BlockMask",
    "VariantCompileError",
    "mods",
    "SUPPORTED_HEAD_DIMS",
    "SUPPORTED_DTYPES",
    "MAX_SPLITS",
    "BACKENDS",
    "__version__",
]
