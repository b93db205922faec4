"""What both MLA decode kernel classes share (``sm80/mla_decode.py``, ``sm90/mla_decode.py``):
their runtime argument list, their compilation from a compile key, and the work of one CTA.

The launcher (``backend_kit.mla_entry_points``) calls a compiled kernel with the tensors
and scalars of ``MlaArgs``, in that order, then the stream; ``cute_utils.compile_mla``
compiles it on fakes of the same list. A kernel class binds ``__call__ = mla_call`` and
implements ``launch(args, stream)``: the list is written once, here, and travels as one
value (into the ``@cute.kernel`` too). As for the forward kernels (``fwd_kernel.py``), no
base class: the kernels share this entry point and helpers, never a mainloop.

The work of a CTA (``MlaTile``): ``tile_m`` packed rows (query position x head, heads
fastest: ``pack_gqa`` with one KV head) of one sequence [and one KV split], and the KV
blocks it walks from the last to the first. The sequence length is clamped to the page
table's capacity (``SeqlenInfo``), so a bad ``cache_seqlens`` never walks past the table;
page ids are clamped where rows are gathered (``paged_kv.page_and_row``).
"""

from dataclasses import dataclass, fields
from typing import Callable, NamedTuple, Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from flash_attn_cute.block_info import BlockInfo
from flash_attn_cute.cute_utils import CUTE_DTYPE_BY_NAME, compile_mla
from flash_attn_cute.fwd_kernel import FwdTile
from flash_attn_cute.keys import parse_mla_key
from flash_attn_cute.seqlen_info import SeqlenInfo
from flash_attn_cute.tile_scheduler import SingleTileScheduler
from flash_attn_cute.variants import AttnCtx, VariantParams, make_variant


class MlaArgs(NamedTuple):
    """The runtime arguments of both MLA kernels."""

    mQn: cute.Tensor  # q_nope (b, s_q, h, 512)
    mQp: cute.Tensor  # q_pe (b, s_q, h, 64)
    mCkv: cute.Tensor  # latent cache (num_pages, page_size, 512): K's first 512 columns and V
    mKpe: cute.Tensor  # rotary keys (num_pages, page_size, 64)
    mO: cute.Tensor  # (b, s_q, h, 512); split: (num_splits, ...) fp32
    mLSE: Optional[cute.Tensor]  # (b, h, s_q); split: (num_splits, ...)
    mSeqlens: cute.Tensor  # cache lengths (b,) int32
    mPageTable: cute.Tensor  # (b, max_pages) int32
    softmax_scale: Float32
    num_splits: Int32
    max_seqlen_q: Int32
    batch_size: Int32

    def num_m_blocks(self, tile_m: int, nheads: int) -> Int32:
        """M blocks of ``tile_m`` packed rows (query position x head) per sequence: the grid's x."""
        return cute.ceil_div(self.max_seqlen_q * nheads, tile_m)


def set_mla_config(kernel, dtype, nheads: int, causal: bool, is_split: bool, split_blocks: int) -> None:
    """The static configuration both MLA kernel classes hold, set on ``kernel``
    (``split_blocks``: as the forward kernels', ``fwd_kernel.set_fwd_config``)."""
    kernel.dtype = dtype
    kernel.out_dtype = Float32 if is_split else dtype  # split partials are fp32
    kernel.qhead_per_kvhead_packed = nheads  # every query head rides the one latent KV head
    kernel.variant = make_variant(causal, False, False)
    kernel.is_split = is_split
    kernel.split_blocks = split_blocks


@cute.jit
def mla_call(self, mQn: cute.Tensor, mQp: cute.Tensor, mCkv: cute.Tensor, mKpe: cute.Tensor, mO: cute.Tensor,
             mLSE: Optional[cute.Tensor], mSeqlens: cute.Tensor, mPageTable: cute.Tensor, softmax_scale: Float32,
             num_splits: Int32, max_seqlen_q: Int32, batch_size: Int32, stream):
    """The compiled entry point of both MLA kernel classes (``__call__ = mla_call``):
    ``MlaArgs`` in order, then the stream, handed to the class's ``launch(args, stream)``."""
    self.launch(MlaArgs(mQn, mQp, mCkv, mKpe, mO, mLSE, mSeqlens, mPageTable, softmax_scale, num_splits,
                        max_seqlen_q, batch_size), stream)


def compile_mla_from_key(key: tuple, make_kernel: Callable):
    """Compiles an MLA kernel for a compile key (``keys.mla_key``) on fake tensors (no GPU
    needed): ``make_kernel(dtype, nheads, causal, is_split, split_blocks, *config)`` builds
    the kernel object, ``config`` being the key's backend fields."""
    f = parse_mla_key(key)
    dtype = CUTE_DTYPE_BY_NAME[f.dtype_name]
    kernel = make_kernel(dtype, f.nheads, f.causal, f.is_split, f.split_blocks, *f.config)
    return compile_mla(kernel, dtype, f.nheads, f.arch, is_split=f.is_split, has_lse=f.has_lse)


@dataclass(frozen=True)
class MlaTile(FwdTile):
    """A forward tile (``FwdTile``: rows, split, KV range [n_block_min, n_block_max)) with
    what the MLA kernels' single KV loop reads: the number of blocks it visits, and the
    unmasked run [n_mid_lo, n_mid_hi) of ``BlockInfo.get_n_block_runs`` (blocks outside it
    take the sequence-end and causal masks). The query heads are all packed over the one
    latent KV head (``head_kv`` 0)."""

    n_tiles: Int32
    n_mid_hi: Int32
    n_mid_lo: Int32

    @staticmethod
    @cute.jit
    def create(args: MlaArgs, block_info: BlockInfo, is_split: cutlass.Constexpr[bool],
               m_blocks: cute.FastDivmodDivisorV2) -> "MlaTile":
        """This CTA's tile from the grid position (``SingleTileScheduler``, ``m_blocks`` the
        kernel's ``m_blocks_divisor`` argument); ``block_info`` carries the kernel's tile
        shape, the heads packed per query position and the variant (causal or none: MLA has
        no window or softcap)."""
        work = SingleTileScheduler.get_work(m_blocks, args.num_splits, args.batch_size)
        capacity = args.mPageTable.shape[1] * args.mCkv.shape[1]
        seqlen = SeqlenInfo.create(work.batch, args.mQn.shape[1], capacity, None, None, args.mSeqlens, capacity)
        no_window = VariantParams(Int32(-1), Int32(0), Float32(0.0), Float32(0.0))
        ctx = AttnCtx(work.batch, Int32(0), seqlen.seqlen_q, seqlen.seqlen_k, no_window)
        tile = FwdTile.of_work(work, ctx, seqlen, Int32(0), args.softmax_scale, args.num_splits, block_info, is_split)
        n_mid_hi, n_mid_lo = tile.n_block_runs(block_info)
        return MlaTile(*(getattr(tile, f.name) for f in fields(FwdTile)),
                       cutlass.max(tile.n_block_max - tile.n_block_min, 0), n_mid_hi, n_mid_lo)
