"""GPU tests of the split-KV combine kernel alone, against a float64 logsumexp reference."""

import math

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

NEG_INF = -math.inf


def combine_fwd(out_partial, lse_partial, out, lse=None, sink=None, split_groups=None):
    """The combine as the package launches it: ``split_groups`` from the split count unless given."""
    from flash_attn_cute.kernels.combine import combine_launcher
    from flash_attn_cute.host.heuristics import combine_split_groups

    if split_groups is None:
        split_groups = combine_split_groups(out_partial.shape[0])
    combine_launcher(out.dtype, out.shape[-1], lse is not None, sink is not None, split_groups)(
        out_partial, lse_partial, out, lse, sink)


def reference(out_partial, lse_partial):
    """float64 (out (b, s, h, d), lse (b, h, s)). A split with lse -inf contributes nothing,
    whatever its O partial holds; a row with no valid split gives O = 0, lse = -inf."""
    lse_p = lse_partial.double().permute(0, 1, 3, 2)  # (splits, b, s, h)
    valid = lse_p > NEG_INF
    lse = torch.logsumexp(lse_p, dim=0)  # -inf where no split is valid
    scale = torch.where(valid, torch.exp(lse_p - lse.unsqueeze(0)), torch.zeros_like(lse_p))
    o_p = torch.where(valid.unsqueeze(-1), out_partial.double(), torch.zeros((), dtype=torch.float64))
    out = (scale.unsqueeze(-1) * o_p).sum(dim=0)
    return out, lse.permute(0, 2, 1)


def make_inputs(num_splits, batch, seqlen, nheads, d_v, lse_layout="contiguous", seed=0):
    """Random partials (never zero) with -inf holes whose O partial is NaN, so that reading
    them would poison the result. lse_layout picks the strides of lse_partial."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    out_partial = torch.randn(num_splits, batch, seqlen, nheads, d_v, device="cuda", generator=g) + 0.25
    # Spread of several units: scales span orders of magnitude, yet no row is one split.
    lse = torch.randn(num_splits, batch, nheads, seqlen, device="cuda", generator=g) * 3.0 + 5.0
    dead = torch.rand(num_splits, batch, nheads, seqlen, device="cuda", generator=g) < 0.1
    if num_splits > 1:
        dead[1::5] = True  # whole splits with nothing to contribute (as in varlen / causal)
    dead[:, batch - 1, nheads - 1, seqlen - 1] = True  # one row with no valid split at all
    lse = lse.masked_fill(dead, NEG_INF)
    out_partial = out_partial.masked_fill(dead.permute(0, 1, 3, 2).unsqueeze(-1), float("nan"))
    if lse_layout == "transposed":  # stored (splits, b, s, h): seqlen is not the unit stride
        lse = lse.permute(0, 1, 3, 2).contiguous().permute(0, 1, 3, 2)
    elif lse_layout == "strided":  # seqlen stride 2 in a (b, splits, h, 2 s) buffer: b outermost
        buf = torch.full((batch, num_splits, nheads, 2 * seqlen), 1e4, device="cuda")
        buf[..., ::2] = lse.permute(1, 0, 2, 3)
        lse = buf[..., ::2].permute(1, 0, 2, 3)
    return out_partial, lse


def check(out_partial, lse_partial, out_dtype, with_lse=True, out=None, split_groups=None):
    num_splits, batch, seqlen, nheads, d_v = out_partial.shape
    if out is None:
        out = torch.full((batch, seqlen, nheads, d_v), float("nan"), device="cuda", dtype=out_dtype)
    lse = torch.full((batch, nheads, seqlen), float("nan"), device="cuda") if with_lse else None
    combine_fwd(out_partial, lse_partial, out, lse, split_groups=split_groups)
    torch.cuda.synchronize()
    ref_out, ref_lse = reference(out_partial, lse_partial)
    # Error bound relative to the output dtype's rounding: twice the error of casting the
    # exact result, plus 1e-5 for the fp32 arithmetic (approximate exp2 / log2) before it.
    cast_err = (ref_out.to(out_dtype).double() - ref_out).abs()
    err = (out.double() - ref_out).abs()
    assert not out.isnan().any()
    bad = err > 2 * cast_err + 1e-5
    assert not bad.any(), f"{bad.sum()} bad elements, max err {err.max():.3g}, first at {bad.nonzero()[0].tolist()}"
    empty = ref_lse == NEG_INF
    assert empty.any()
    assert (out.double()[empty.permute(0, 2, 1)] == 0).all()
    if with_lse:
        assert (lse[empty] == NEG_INF).all()
        lse_err = (lse.double() - ref_lse)[~empty].abs()
        lse_cast_err = (ref_lse.float().double() - ref_lse)[~empty].abs()
        assert (lse_err <= 2 * lse_cast_err + 1e-5).all(), f"max lse err {lse_err.max():.3g}"
    return out


# 1: nothing to combine; 2, 3: fewer splits than the cp.async ring (8 stages); 17: a
# prime, not a multiple of any unroll or of the lanes per row; 128, 256: up to the maximum.
NUM_SPLITS = [1, 2, 3, 17, 128, 256]
# Every output dtype: different elements per thread (8 vs 4) and store conversions.
OUT_DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# 64: one column block; 128: the common case; 256: two column blocks along grid.y.
HEAD_DIMS_V = [64, 128, 256]


@pytest.mark.parametrize("with_lse", [True, False])  # the LSE output is a separate kernel
@pytest.mark.parametrize("d_v", HEAD_DIMS_V)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("num_splits", NUM_SPLITS)
def test_combine(num_splits, out_dtype, d_v, with_lse):
    # Odd batch, seqlen and heads: the last row tile of a CTA is partial, rows of a CTA
    # straddle heads, and row-to-(seqlen, head) decomposition is exercised.
    out_partial, lse_partial = make_inputs(num_splits, batch=3, seqlen=37, nheads=5, d_v=d_v, seed=num_splits)
    check(out_partial, lse_partial, out_dtype, with_lse)


# Lane groups sharing a row (each every G-th split, summed through smem): every G the
# kernel takes, over split counts below G (idle groups), not a multiple of G, and the
# maximum; rows per CTA drop to tile_m / G, so the row tail and head straddling move.
@pytest.mark.parametrize("split_groups", [1, 2, 4, 8])
@pytest.mark.parametrize("num_splits", [3, 17, 64, 256])
@pytest.mark.parametrize("out_dtype,d_v", [(torch.bfloat16, 512), (torch.float32, 96), (torch.float16, 8)])
def test_split_groups(split_groups, num_splits, out_dtype, d_v):
    out_partial, lse_partial = make_inputs(num_splits, 2, 3, 11, d_v, seed=num_splits + split_groups)
    check(out_partial, lse_partial, out_dtype, split_groups=split_groups)


def test_split_groups_with_sink():
    """The sink joins group 0's reduction once, whatever G."""
    num_splits, batch, seqlen, nheads, d_v = 40, 3, 1, 5, 128
    out_partial, lse_partial = make_inputs(num_splits, batch, seqlen, nheads, d_v, seed=5)
    sink = torch.linspace(-3.0, 9.0, nheads, device="cuda")
    results = []
    for split_groups in (1, 4):
        out = torch.full((batch, seqlen, nheads, d_v), float("nan"), device="cuda")
        lse = torch.full((batch, nheads, seqlen), float("nan"), device="cuda")
        combine_fwd(out_partial, lse_partial, out, lse, sink, split_groups=split_groups)
        results.append((out, lse))
    ref_out, ref_lse = reference(out_partial, lse_partial)
    with_sink = torch.logaddexp(ref_lse, sink.double().view(1, nheads, 1))
    ref_out = ref_out * torch.exp(ref_lse - with_sink).permute(0, 2, 1).unsqueeze(-1).nan_to_num(0.0)
    for out, lse in results:
        assert not out.isnan().any()
        assert (out.double() - ref_out).abs().max() < 1e-5
        assert (lse.double() - with_sink).abs().max() < 1e-4


# LSE partial strides are arbitrary: the natural layout, (splits, b, s, h) storage seen as
# (splits, b, h, s), and a non-unit-stride view with batch outermost.
@pytest.mark.parametrize("lse_layout", ["contiguous", "transposed", "strided"])
@pytest.mark.parametrize("num_splits", [3, 17])
def test_lse_partial_strides(lse_layout, num_splits):
    out_partial, lse_partial = make_inputs(num_splits, 3, 37, 5, 128, lse_layout=lse_layout, seed=7)
    assert lse_partial.is_contiguous() == (lse_layout == "contiguous")
    check(out_partial, lse_partial, torch.bfloat16)


# Head dims besides the usual ones: 96 and 192 are not multiples of the 128-wide column block
# (column predicate), 512 spans four blocks, 8 and 24 are tiny (one / three threads per row).
@pytest.mark.parametrize("d_v", [8, 24, 96, 192, 512])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_other_head_dims(d_v, out_dtype):
    out_partial, lse_partial = make_inputs(17, 3, 37, 5, d_v, seed=d_v)
    check(out_partial, lse_partial, out_dtype)


# Decode-like (seqlen 1: rows are heads) and a larger prefill-like shape (many row tiles).
@pytest.mark.parametrize("batch,seqlen,nheads", [(2, 1, 7), (1, 1, 1), (2, 1031, 3)])
def test_shapes(batch, seqlen, nheads):
    out_partial, lse_partial = make_inputs(5, batch, seqlen, nheads, 128, seed=batch * seqlen)
    check(out_partial, lse_partial, torch.float16)


def test_strided_views_and_no_stray_writes():
    """O partial and O as non-contiguous views (last dim contiguous): the kernel honours their
    strides and writes nothing outside O (the rest of O's buffer stays NaN)."""
    num_splits, batch, seqlen, nheads, d_v = 4, 3, 37, 5, 96
    op, lse_partial = make_inputs(num_splits, batch, seqlen, nheads, d_v, seed=3)
    # (splits, b, h, s, d) storage seen as (splits, b, s, h, d)
    out_partial = op.permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4)
    buf = torch.full((batch, seqlen, nheads + 2, d_v + 32), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = buf[:, :, 1 : nheads + 1, 16 : 16 + d_v]
    check(out_partial, lse_partial, torch.bfloat16, out=out)
    outside = torch.ones(buf.shape, dtype=torch.bool, device="cuda")
    outside[:, :, 1 : nheads + 1, 16 : 16 + d_v] = False
    assert buf[outside].isnan().all()


def test_recompiles_only_per_key(monkeypatch):
    """A new shape or split count reuses the compiled kernel: sizes and strides are symbolic."""
    from flash_attn_cute.kernels import combine

    compile_calls = []
    real = combine.compile_combine

    def counting(key):
        compile_calls.append(key)
        return real(key)

    monkeypatch.setattr(combine, "compile_combine", counting)
    for num_splits, seqlen in [(3, 5), (7, 11), (2, 64)]:
        out_partial, lse_partial = make_inputs(num_splits, 2, seqlen, 3, 64, seed=num_splits)
        check(out_partial, lse_partial, torch.float16, with_lse=False)
    assert len(compile_calls) <= 1


def test_sink_and_a_batch_past_grid_z():
    """A learnable sink per head (one more logit, no value) and 70,001 sequences: the batch
    folds into grid x past 65,535; both ends of it are merged."""
    num_splits, batch, seqlen, nheads, d_v = 3, 70_001, 1, 2, 64
    out_partial, lse_partial = make_inputs(num_splits, batch, seqlen, nheads, d_v, seed=11)
    sink = torch.tensor([4.0, -30.0], device="cuda")
    out = torch.full((batch, seqlen, nheads, d_v), float("nan"), device="cuda")
    lse = torch.full((batch, nheads, seqlen), float("nan"), device="cuda")
    combine_fwd(out_partial, lse_partial, out, lse, sink)
    torch.cuda.synchronize()
    ref_out, ref_lse = reference(out_partial, lse_partial)
    with_sink = torch.logaddexp(ref_lse, sink.double().view(1, nheads, 1))
    ref_out = ref_out * torch.exp(ref_lse - with_sink).permute(0, 2, 1).unsqueeze(-1).nan_to_num(0.0)
    assert not out.isnan().any()
    for rows in (slice(0, 1000), slice(batch - 1000, batch)):
        assert (out[rows].double() - ref_out[rows]).abs().max() < 1e-5
        assert (lse[rows].double() - with_sink[rows]).abs().max() < 1e-4
    # the row with no valid split: O = 0 and lse = the sink
    assert (out[-1, -1, -1] == 0).all() and abs(lse[-1, -1, -1] - sink[-1]) < 1e-4
