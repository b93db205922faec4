"""Compile-side helpers shared by every kernel: DSL dtypes, fake tensors, compile options,
the launch of a kernel's grid.

Compilation is a pure function of a compile key: every kernel is compiled against
fake tensors whose sizes and leading strides are symbolic (``cute.sym_int``), so a
new sequence length, batch or page count never recompiles, and compiling needs no GPU.
"""

from typing import Optional

import cutlass
import cutlass.cute as cute

from flash_attn_cute.host.constants import D_CKV, D_KPE

CUTE_DTYPE_BY_NAME = {"fp16": cutlass.Float16, "bf16": cutlass.BFloat16, "fp32": cutlass.Float32, "i32": cutlass.Int32,
                      "e4m3": cutlass.Float8E4M3FN, "e5m2": cutlass.Float8E5M2}


def fake_tensor(dtype, rank: int, *, align: int = 16, shape=None, contiguous_last: bool = True):
    """A fake gmem tensor of ``rank`` modes: sizes symbolic unless ``shape`` fixes some
    (``None`` entries stay symbolic), the last mode of stride 1, other strides symbolic
    (divisible by 16 bytes when ``align`` is 16, so 128-bit copies stay legal)."""
    if shape is None:
        shape = (None,) * rank
    assert len(shape) == rank
    sizes = tuple(cute.sym_int() if s is None else s for s in shape)
    elems_per_align = max(1, align * 8 // dtype.width)
    strides = tuple(cute.sym_int64(divisibility=elems_per_align) for _ in range(rank - 1))
    strides = strides + ((1,) if contiguous_last else (cute.sym_int64(),))
    return cute.runtime.make_fake_tensor(dtype, sizes, strides, assumed_align=align)


def kernel_out_dtype(dtype, is_split: bool):
    """The forward kernels' output dtype (the DSL side of ``problems.out_dtype``): split
    partials are fp32; FP8 queries give a bf16 output; otherwise the query's dtype."""
    return cutlass.Float32 if is_split else (cutlass.BFloat16 if dtype.width == 8 else dtype)


def fake_fwd_tensors(dtype, d: int, dv: int, *, is_split: bool, has_lse: bool, varlen_q: bool, varlen_k: bool,
                     has_seqused_k: bool, paged: bool, has_seqused_q: bool, has_sink: bool, kv_dtype=None,
                     leftpad_k: bool = False) -> tuple:
    """The forward kernels' tensor arguments as fake tensors, in their order: mQ, mK, mV,
    mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mPageTable, mSeqUsedQ, mLearnableSink,
    mKDescale, mVDescale, mLeftpadK (None where absent; ``leftpad_k``: a paged cache's
    per-sequence key starts, (batch,) int32). A split kernel writes fp32 partials with a
    leading split mode; head dims are static; the sink is fp32 (the host converts a 16-bit
    one). ``kv_dtype`` (default ``dtype``): an fp8 K/V comes with its two descales, fp32
    (batch, nheads_kv) of any strides (a broadcast scalar has stride 0)."""
    kv_dtype = kv_dtype or dtype
    fp8 = kv_dtype.width == 8
    q_rank = 3 if varlen_q else 4
    kv_rank = 3 if (varlen_k and not paged) else 4
    split_mode = (None,) if is_split else ()
    out_dtype = kernel_out_dtype(dtype, is_split)
    int_vec = lambda rank: fake_tensor(cutlass.Int32, rank, align=4)
    return (
        fake_tensor(dtype, q_rank, shape=(None,) * (q_rank - 1) + (d,)),
        fake_tensor(kv_dtype, kv_rank, shape=(None,) * (kv_rank - 1) + (d,)),
        fake_tensor(kv_dtype, kv_rank, shape=(None,) * (kv_rank - 1) + (dv,)),
        fake_tensor(out_dtype, len(split_mode) + q_rank, shape=split_mode + (None,) * (q_rank - 1) + (dv,)),
        fake_tensor(cutlass.Float32, len(split_mode) + q_rank - 1, align=4) if has_lse else None,
        int_vec(1) if varlen_q else None,
        int_vec(1) if varlen_k else None,
        int_vec(1) if has_seqused_k else None,
        int_vec(2) if paged else None,
        int_vec(1) if has_seqused_q else None,
        fake_tensor(cutlass.Float32, 1, align=4) if has_sink else None,
        fake_tensor(cutlass.Float32, 2, align=4, contiguous_last=False) if fp8 else None,
        fake_tensor(cutlass.Float32, 2, align=4, contiguous_last=False) if fp8 else None,
        int_vec(1) if leftpad_k else None,
    )


def fake_variant_tensors(user_key: Optional[tuple], cp: bool = False) -> tuple:
    """A user variant's kernel tensors as fakes (``user_variants.VariantSpec.key``): the
    aux slots (strides all symbolic: broadcast views are fine), then the block mask's
    key ranges, then context parallelism's global lengths (b,) and rank / world /
    interleave (3,) (``cp``);
    None where absent."""
    from flash_attn_cute.host.user_variants import MAX_AUX

    aux, ranges = [], None
    if user_key is not None:
        _, _, _, aux_sig, block_q, row_bounds = user_key
        for dtype_name, rank in aux_sig:
            dt = cutlass.Uint8 if dtype_name == "Boolean" else getattr(cutlass, dtype_name)
            aux.append(fake_tensor(dt, rank, align=max(1, dt.width // 8), contiguous_last=False))
        if block_q:
            cols = 6 if row_bounds else 4  # BlockMask.kernel_ranges
            ranges = fake_tensor(cutlass.Int32, 4, align=4, shape=(None, None, None, cols), contiguous_last=False)
    cp_tensors = (fake_tensor(cutlass.Int32, 1, align=4), fake_tensor(cutlass.Int32, 1, align=4)) if cp else \
        (None, None)
    return tuple(aux) + (None,) * (MAX_AUX - len(aux)) + (ranges,) + cp_tensors


def compile_fwd(kernel, dtype, d: int, dv: int, arch: str, *, is_split: bool, has_lse: bool, varlen_q: bool,
                varlen_k: bool, has_seqused_k: bool, paged: bool, has_seqused_q: bool, has_sink: bool,
                extra_scalars: tuple = (), user_key: Optional[tuple] = None, kv_dtype=None,
                leftpad_k: bool = False, cp: bool = False):
    """``cute.compile`` of a forward kernel on its fake arguments: the tensors of
    ``fake_fwd_tensors`` and ``fake_variant_tensors``, then softmax_scale, window_left,
    window_right, softcap, num_splits, max_seqlen_q, batch (runtime values; placeholders
    here), then the kernel's ``extra_scalars``, then the stream."""
    tensors = fake_fwd_tensors(dtype, d, dv, is_split=is_split, has_lse=has_lse, varlen_q=varlen_q,
                               varlen_k=varlen_k, has_seqused_k=has_seqused_k, paged=paged,
                               has_seqused_q=has_seqused_q, has_sink=has_sink, kv_dtype=kv_dtype,
                               leftpad_k=leftpad_k)
    tensors = tensors + fake_variant_tensors(user_key, cp)
    F32, I32 = cutlass.Float32, cutlass.Int32
    scalars = (F32(1.0), I32(-1), I32(-1), F32(0.0), I32(1), I32(1), I32(1)) + tuple(extra_scalars)
    return cute.compile(kernel, *tensors, *scalars, fake_stream(), options=compile_options(arch))


def fake_mla_tensors(dtype, nheads: int, *, is_split: bool, has_lse: bool, kv_dtype=None,
                     kv_heads: bool = False, cp: bool = False, scheduled: bool = False) -> tuple:
    """The MLA kernels' tensor arguments as fake tensors, in their order (``mla_kernel.MlaArgs``):
    q_nope, q_pe, ckv, kpe, O, LSE (None when absent), cache lengths, page table, the
    cache's descale (``kv_dtype`` fp8: fp32 (batch,) of any stride, a broadcast scalar has
    stride 0; else None), the queries' (``dtype`` fp8, as the cache's; else None; the output
    then bf16). Heads and head dims are static; a split kernel writes fp32
    partials with a leading split mode and always an LSE. ``kv_heads``: caches with a
    KV-head mode (num_pages, page_size, nheads_kv, d), ``nheads`` then the query heads per KV
    head (the query head count, nheads_kv times it, symbolic like nheads_kv) and the descale
    (batch, nheads_kv). ``cp``: context parallelism's global lengths (b,) and rank (1,),
    int32 (else None). ``scheduled``: a device-computed schedule (int32, flat) and the
    fp32 partials beside the output (``mla_kernel.MlaArgs``; else three None)."""
    kv_dtype = kv_dtype or dtype
    split_mode = (None,) if is_split else ()
    out_dtype = cutlass.Float32 if is_split else (cutlass.BFloat16 if dtype.width == 8 else dtype)
    q_heads = None if kv_heads else nheads
    cache = lambda d: fake_tensor(kv_dtype, 4, shape=(None, None, None, d)) if kv_heads else \
        fake_tensor(kv_dtype, 3, shape=(None, None, d))
    return (
        fake_tensor(dtype, 4, shape=(None, None, q_heads, D_CKV)),
        fake_tensor(dtype, 4, shape=(None, None, q_heads, D_KPE)),
        cache(D_CKV),
        cache(D_KPE),
        fake_tensor(out_dtype, len(split_mode) + 4, shape=split_mode + (None, None, q_heads, D_CKV)),
        fake_tensor(cutlass.Float32, len(split_mode) + 3, align=4) if (has_lse or is_split) else None,
        fake_tensor(cutlass.Int32, 1, align=4),
        fake_tensor(cutlass.Int32, 2, align=4),
        fake_tensor(cutlass.Float32, 2 if kv_heads else 1, align=4, contiguous_last=False)
        if kv_dtype.width == 8 else None,
        fake_tensor(cutlass.Float32, 2 if kv_heads else 1, align=4, contiguous_last=False)
        if dtype.width == 8 else None,
        fake_tensor(cutlass.Int32, 1, align=4) if cp else None,
        fake_tensor(cutlass.Int32, 1, align=4) if cp else None,
        fake_tensor(cutlass.Int32, 1, align=4) if scheduled else None,
        fake_tensor(cutlass.Float32, 5, shape=(None, None, None, q_heads, D_CKV)) if scheduled else None,
        fake_tensor(cutlass.Float32, 4, align=4) if scheduled else None,
    )


def compile_mla(kernel, dtype, nheads: int, arch: str, *, is_split: bool, has_lse: bool, kv_dtype=None,
                kv_heads: bool = False, cp: bool = False, scheduled: bool = False):
    """``cute.compile`` of an MLA kernel on its fake arguments: the tensors of
    ``fake_mla_tensors``, then softmax_scale, num_splits, max_seqlen_q, batch (runtime
    values; placeholders here), then the stream."""
    tensors = fake_mla_tensors(dtype, nheads, is_split=is_split is True, has_lse=has_lse, kv_dtype=kv_dtype,
                               kv_heads=kv_heads, cp=cp, scheduled=scheduled)
    F32, I32 = cutlass.Float32, cutlass.Int32
    return cute.compile(kernel, *tensors, F32(1.0), I32(1), I32(1), I32(1), fake_stream(), options=compile_options(arch))


def launch_ctas(kernel, grid, num_threads: int, SharedStorage, stream, setmaxnreg: bool = False,
                ctas_per_sm: int = 1):
    """Launches a ``@cute.kernel`` call on ``grid``: CTAs of ``num_threads`` threads with the
    dynamic shared memory of ``SharedStorage``. ``setmaxnreg``: the kernel's warp roles
    trade registers (setmaxnreg), which needs a register cap at entry
    (``min_blocks_per_mp``: ``ctas_per_sm`` CTAs share the register file)."""
    # Several CTAs per SM need the whole shared memory carveout (100%); naming it also keeps
    # the DSL from asking the device for it, so that compiling needs no GPU.
    carveout = {"preferred_smem_carveout": 100} if ctas_per_sm > 1 else {}
    kernel.launch(grid=grid, block=(num_threads, 1, 1), smem=SharedStorage.size_in_bytes(), stream=stream,
                  min_blocks_per_mp=ctas_per_sm if setmaxnreg else 0, **carveout)


def fake_stream():
    """The stream is taken from the TVM-FFI environment (torch's current stream) at call time."""
    return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)


COMPILE_OPTIONS = "--enable-tvm-ffi"


def compile_options(arch: str) -> str:
    """Options for ``cute.compile``: TVM-FFI calling convention, and the arch named in the
    compile key passed explicitly, so that the binary matches its key whatever the DSL
    read from the environment at import."""
    return f"{COMPILE_OPTIONS} --gpu-arch {arch}"
