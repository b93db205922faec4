"""Reference attention for tests and benchmarks (plain PyTorch, any device).

``attention_ref`` computes softmax(scale * q k^T [softcapped, masked]) v and the
row log-sum-exp (natural log), by default in float32 on upcast copies of the inputs.
With ``upcast=False`` it instead computes the way PyTorch would in the input dtype
(matmuls in fp16/bf16, softmax in fp32, probabilities rounded to the input dtype):
the distance of that result from the fp32 one is "PyTorch's own error", and
``check_close`` bounds a kernel's error by a multiple of it.

Conventions (those of FlashAttention):
  * q (batch, seqlen_q, nheads, d), k (batch, seqlen_k, nheads_kv, d),
    v (batch, seqlen_k, nheads_kv, d_v); nheads a multiple of nheads_kv (GQA/MQA).
    GQA is expanded with repeat_interleave here only, never in a kernel.
  * masks are aligned to the bottom-right corner: with sk keys visible to a batch row,
    query i and key j are at the same position when j == i + sk - seqlen_q.
    ``causal`` keeps j <= i + sk - sq; ``window_size=(left, right)`` keeps
    i + sk - sq - left <= j <= i + sk - sq + right, -1 meaning unbounded on that side.
  * a fully masked query row has output 0 and lse -inf.
"""

import contextlib
import math
from typing import NamedTuple

import torch


@contextlib.contextmanager
def _exact_fp32_matmul():
    """The fp32 reference must not silently use TF32."""
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(prev)


def backends_on_this_gpu(kind: str = "fwd") -> list:
    """Registered backends of a problem kind (``seam.REGISTRIES``: "fwd", "mla") whose
    kernels run on the current GPU; all of them without a GPU (the GPU tests that
    parametrize over them are skipped then)."""
    from flash_attn_cute.seam import REGISTRIES, backend_module

    names = sorted(REGISTRIES[kind])
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        names = [n for n in names if backend_module(n, kind).runs_on(cap)]
    return names


def visible_mask(seqlen_q, seqlen_k, seqlens_k=None, *, causal=False, window_size=(-1, -1), device=None):
    """Boolean (batch or 1, 1, seqlen_q, seqlen_k) mask, True where query i may attend key j.

    ``seqlens_k`` (batch,) gives the number of valid keys of each batch row (the rest of
    the seqlen_k columns are padding); the bottom-right alignment uses that count.
    """
    left, right = window_size
    left = -1 if left is None else left
    right = -1 if right is None else right
    if causal:
        right = 0
    i = torch.arange(seqlen_q, device=device).view(1, 1, -1, 1)
    j = torch.arange(seqlen_k, device=device).view(1, 1, 1, -1)
    if seqlens_k is None:
        sk = torch.full((1, 1, 1, 1), seqlen_k, device=device, dtype=torch.long)
    else:
        sk = seqlens_k.to(device=device, dtype=torch.long).view(-1, 1, 1, 1)
    diag = i + sk - seqlen_q  # the key at query i's own position
    mask = j < sk
    if right >= 0:
        mask = mask & (j <= diag + right)
    if left >= 0:
        mask = mask & (j >= diag - left)
    return mask


def attention_ref(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                  seqlens_k=None, upcast=True, score_mod=None, mask_mod=None, aux_tensors=None, batch_idx=None,
                  learnable_sink=None, p_fp8=False):
    """Returns (out (b, sq, h, dv), lse (b, h, sq) float32).

    ``out`` is float32 when ``upcast`` (the default), else in the input dtype.
    ``seqlens_k`` (batch,) int: only the first seqlens_k[b] keys of row b exist.
    ``learnable_sink`` (h,): one more logit per head in each denominator, value 0 (the LSE
    includes it; a row that sees no key has out 0 and lse = the sink).
    ``score_mod`` / ``mask_mod`` (``user_variants.py``) run here on broadcast index
    tensors: b (b,1,1,1), h (1,h,1,1), q_idx (1,1,sq,1), kv_idx (1,1,1,sk), with
    ``aux_tensors``; ``batch_idx`` renumbers the batch rows (varlen calls one at a time).
    ``p_fp8``: PyTorch's own FP8 attention, the error the FP8 kernels are measured against:
    fp32 scores, probabilities scaled to 2^8 at each row's max and rounded to e4m3 for P V
    (the kernels' P operand), divided by the unrounded row sum.
    """
    batch, seqlen_q, nheads, d = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    assert nheads % nheads_kv == 0, "nheads must be a multiple of nheads_kv"
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    # Scores in fp32, or in fp64 for fp64 inputs (the feature-pair sweep's reference).
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    group = nheads // nheads_kv
    with _exact_fp32_matmul():
        # (b, h, sq, sk), query head h on KV head h // group: K broadcast over its group, not
        # repeated (an MLA latent head under 128 query heads would be 128 copies of the cache).
        # In low precision this matmul rounds its output to q's dtype.
        qg = (q * softmax_scale).view(batch, seqlen_q, nheads_kv, group, d)
        scores = torch.einsum("bqhgd,bkhd->bhgqk", qg, k).reshape(batch, nheads, seqlen_q, seqlen_k).to(acc)
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        b_idx, h_idx, q_idx, kv_idx = _index_tensors(batch, nheads, seqlen_q, seqlen_k, q.device, batch_idx)
        aux = tuple(aux_tensors or ())
        if score_mod is not None:
            scores = score_mod(scores, b_idx, h_idx, q_idx, kv_idx, aux).to(acc)
        mask = visible_mask(seqlen_q, seqlen_k, seqlens_k, causal=causal, window_size=window_size,
                            device=q.device)
        if mask_mod is not None:
            mask = mask & mask_mod(b_idx, h_idx, q_idx, kv_idx, aux)
        scores = scores.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # -inf on fully masked rows
        if learnable_sink is not None:
            lse = torch.logaddexp(lse, learnable_sink.to(acc).view(1, -1, 1))
        # exp(s - lse) is the softmax; on fully masked rows it is exp(-inf) = 0, not NaN
        probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
        if p_fp8:
            row_max = scores.amax(dim=-1, keepdim=True)
            row_max = torch.where(torch.isinf(row_max), 0.0, row_max)
            p8 = (torch.exp(scores - row_max) * 256.0).to(torch.float8_e4m3fn).float()
            # exp(max - lse) = 1 / the row's exact sum (its sink included).
            inv_sum = torch.exp(row_max - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
            probs = p8 * (inv_sum / 256.0)
        probs = probs.to(v.dtype).view(batch, nheads_kv, group, seqlen_q, seqlen_k)
        out = torch.einsum("bhgqk,bkhd->bqhgd", probs, v).reshape(batch, seqlen_q, nheads, v.shape[-1])
    return out, lse


def _index_tensors(batch, nheads, seqlen_q, seqlen_k, device, batch_idx=None):
    b = torch.arange(batch, device=device) if batch_idx is None else torch.as_tensor(batch_idx, device=device)
    return (b.view(-1, 1, 1, 1), torch.arange(nheads, device=device).view(1, -1, 1, 1),
            torch.arange(seqlen_q, device=device).view(1, 1, -1, 1),
            torch.arange(seqlen_k, device=device).view(1, 1, 1, -1))


def attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, **kwargs):
    """q (total_q, h, d), k/v (total_k, hkv, d*), cu_seqlens int (batch+1,).

    Returns (out (total_q, h, dv), lse (h, total_q)); each sequence is attended alone.
    """
    nheads, dv = q.shape[1], v.shape[2]
    out_dtype = torch.float32 if kwargs.get("upcast", True) else q.dtype
    out = torch.zeros(q.shape[0], nheads, dv, dtype=out_dtype, device=q.device)
    lse = torch.full((nheads, q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if q1 == q0:
            continue
        o_b, lse_b = attention_ref(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], batch_idx=[b], **kwargs)
        out[q0:q1] = o_b[0]
        lse[:, q0:q1] = lse_b[0]
    return out, lse


def attention_serving_ref(q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                          page_table=None, **kwargs):
    """``flash_attn_varlen_func``'s general call, one sequence at a time: q packed
    (total_q, h, d) with ``cu_seqlens_q`` or dense (b, sq, h, d); k/v packed with
    ``cu_seqlens_k``, dense (b, sk, hkv, d*) or paged (num_pages, page_size, hkv, d*) with
    ``page_table``; ``seqused_q`` / ``seqused_k`` (b,): the sequence's query / key counts.
    Returns (out, lse) in the layouts of the call (packed: (total_q, h, dv), (h, total_q));
    rows past ``seqused_q`` are left 0 (out) and -inf (lse)."""
    if page_table is not None:
        k, v = gather_paged_kv(k, page_table), gather_paged_kv(v, page_table)
    varlen_q = cu_seqlens_q is not None
    batch = cu_seqlens_q.shape[0] - 1 if varlen_q else q.shape[0]
    nheads, dv = q.shape[-2], v.shape[-1]
    out_dtype = torch.float32 if kwargs.get("upcast", True) else q.dtype
    out = torch.zeros(*q.shape[:-1], dv, dtype=out_dtype, device=q.device)
    lse = torch.full((nheads, q.shape[0]) if varlen_q else (batch, nheads, q.shape[1]), float("-inf"),
                     dtype=torch.float32, device=q.device)
    cq = cu_seqlens_q.tolist() if varlen_q else None
    ck = cu_seqlens_k.tolist() if cu_seqlens_k is not None else None
    for b in range(batch):
        q0, q1 = (cq[b], cq[b + 1]) if varlen_q else (0, q.shape[1])
        if seqused_q is not None:
            q1 = q0 + min(int(seqused_q[b]), q1 - q0)
        if ck is not None:
            k0, k1 = ck[b], ck[b + 1]
            k_b, v_b = k[k0:k1], v[k0:k1]
        else:
            k_b, v_b = k[b], v[b]
        if seqused_k is not None:
            k_b, v_b = k_b[:int(seqused_k[b])], v_b[:int(seqused_k[b])]
        q_b = q[q0:q1] if varlen_q else q[b, q0:q1]
        if q_b.shape[0] == 0:
            continue
        o_b, lse_b = attention_ref(q_b[None], k_b[None], v_b[None], batch_idx=[b], **kwargs)
        if varlen_q:
            out[q0:q1], lse[:, q0:q1] = o_b[0], lse_b[0]
        else:
            out[b, q0:q1], lse[b, :, q0:q1] = o_b[0], lse_b[0]
    return out, lse


def gather_paged_kv(cache, page_table):
    """(num_pages, page_size, hkv, d) pages + (batch, pages_per_seq) table ->
    contiguous (batch, pages_per_seq * page_size, hkv, d)."""
    batch, pages_per_seq = page_table.shape
    pages = cache[page_table.long()]  # (batch, pages_per_seq, page_size, hkv, d)
    return pages.reshape(batch, pages_per_seq * cache.shape[1], *cache.shape[2:])


def dequantize_kv(x8, descale):
    """The real values of an FP8 cache ``(batch, seqlen, hkv, d)`` (fp32): the stored values
    times ``descale`` ``(batch, hkv)`` or one element."""
    scale = descale.float()
    scale = scale.view(1, 1, 1, 1) if scale.numel() == 1 else scale.view(x8.shape[0], 1, x8.shape[2], 1)
    return x8.float() * scale


def quantize_q_ref(q):
    """The queries the SM90 kernel attends with over an e4m3 cache (``device/q_quant.py``), as
    fp32: q / 2^e rounded to e4m3, times 2^e, with 2^e = 2^(E - 7) for the amax = m 2^E
    (1 <= m < 2) of each row (query and head, the last dim) and 2^e >= 2^-64. The kernel
    takes one scale per Q tile; a power of two gives every element the same value either
    way (rounded to 4 significant bits) but those below 2^-13 of the tile's amax (e4m3
    subnormals), which move by at most 2^-16 of it: far below the FP8 errors tests bound."""
    x = q.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    e = (torch.frexp(amax).exponent - 1 - 7).clamp(min=-64)  # frexp: amax = f 2^x, 0.5 <= f < 1
    e = torch.where(amax > 0, e, torch.full_like(e, -64))
    scale = torch.exp2(e.float())
    return (x / scale).to(torch.float8_e4m3fn).float() * scale


class RecordedLaunch(NamedTuple):
    """One launch ``recorded_plans`` saw: its problem (a mixed plan's part carries
    ``q_class``, the sequences it computes) and its plan."""

    problem: object
    plan: object


@contextlib.contextmanager
def recorded_plans():
    """Within it, every forward or MLA launch (a mixed plan: both parts, ``seam.mixed_parts``)
    is appended to the yielded list as a ``RecordedLaunch``, so that a test takes its
    reference from the kernel that computed each row (e.g. ``plan.config.quantize_q``: the
    SM90 kernel quantized 16-bit queries) instead of restating the planner's rules."""
    from flash_attn_cute import seam

    launches, run = [], seam.run_resolved

    def recording(resolved, problem, tensors):
        part = resolved
        for part_problem, _ in seam.mixed_parts(problem, resolved.plan.num_splits):
            launches.append(RecordedLaunch(part_problem, part.plan))
            part = part.then
        return run(resolved, problem, tensors)

    seam.run_resolved = recording
    try:
        yield launches
    finally:
        seam.run_resolved = run


def _quantizes_q(launch: RecordedLaunch) -> bool:
    return getattr(launch.plan.config, "quantize_q", False)


def any_quantized_q(launches) -> bool:
    """Whether any of ``recorded_plans``' launches quantized 16-bit queries to e4m3 (the SM90
    kernel over an e4m3 cache, ``sm90.quantizes_q``; other kernels' configs have no such field)."""
    return any(_quantizes_q(launch) for launch in launches)


def attended_q(q, launches, cu_seqlens_q=None):
    """The queries each row of ``q`` was attended with, fp32: ``quantize_q_ref(q)`` where the
    launch that computed its sequence quantized them, else ``q``. Dense q ``(batch, seqlen,
    h, d)``: one launch computes every row. Varlen q ``(total, h, d)`` with ``cu_seqlens_q``:
    a mixed plan's two launches take the sequences by query count (``q_class``: n > 0 those
    of at most n queries, -n those of more), and may differ (decode rows quantized, prefill
    rows not)."""
    qf, qq = q.float(), quantize_q_ref(q)
    if cu_seqlens_q is None:
        return qq if any_quantized_q(launches) else qf
    lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    quantized = torch.zeros_like(lens, dtype=torch.bool)
    for launch in launches:
        n = launch.problem.q_class
        if _quantizes_q(launch):
            quantized |= (lens <= n) if n > 0 else (lens > -n) if n < 0 else torch.ones_like(quantized)
    rows = torch.repeat_interleave(quantized, lens, output_size=q.shape[0])
    return torch.where(rows.view(-1, *([1] * (q.dim() - 1))), qq, qf)


def attention_kvcache_ref(q, k_cache, v_cache, cache_seqlens, page_table=None, cache_leftpad=None, **kwargs):
    """Decode/append attention over the first cache_seqlens[b] keys of each cache row,
    causal/windows aligned to the bottom-right of (seqlen_q, cache_seqlens[b]).
    ``cache_leftpad`` (b,): sequence b's keys are cache positions [leftpad[b],
    cache_seqlens[b]) instead (key j at position leftpad[b] + j), the masks aligned to the
    bottom-right of (seqlen_q, cache_seqlens[b] - leftpad[b]); contiguous or paged."""
    if page_table is not None:
        k_cache = gather_paged_kv(k_cache, page_table)
        v_cache = gather_paged_kv(v_cache, page_table)
    if cache_leftpad is not None:
        start = cache_leftpad.long().to(k_cache.device)
        cap = k_cache.shape[1]
        rows = (start[:, None] + torch.arange(cap, device=k_cache.device)[None]).clamp(max=cap - 1)  # (b, cap)
        take = lambda c: torch.gather(c, 1, rows[:, :, None, None].expand(-1, -1, *c.shape[2:]))
        k_cache, v_cache = take(k_cache), take(v_cache)
        cache_seqlens = (cache_seqlens.long().to(start.device) - start).clamp(min=0)
    return attention_ref(q, k_cache, v_cache, seqlens_k=cache_seqlens, **kwargs)


def _max_abs_err(x, ref):
    """Max |x - ref| over finite reference entries; +inf if x has a NaN or a wrong inf."""
    x, ref = x.float(), ref.float()
    if x.shape != ref.shape:
        raise AssertionError(f"shape {tuple(x.shape)} != reference shape {tuple(ref.shape)}")
    if x.numel() == 0:
        return 0.0
    if torch.isnan(x).any():
        return float("inf")
    finite = torch.isfinite(ref)
    # non-finite reference entries (lse = -inf on empty rows) must be matched exactly
    if not torch.equal(x[~finite], ref[~finite]) or not torch.isfinite(x[finite]).all():
        return float("inf")
    return (x[finite] - ref[finite]).abs().max().item() if finite.any() else 0.0


def is_close(out, out_ref, out_torch, mult=2.0, atol=1e-5):
    """(ok, err, bound): err = max|out - ref| must be <= mult * max|out_torch - ref| + atol.
    A NaN in ``out`` (or an inf where the reference is finite) is never close."""
    err = _max_abs_err(out, out_ref)
    torch_err = _max_abs_err(out_torch, out_ref)
    bound = mult * torch_err + atol
    return err <= bound, err, bound


def check_close(out, out_ref, out_torch, mult=2.0, atol=1e-5, name="out"):
    """Assert the kernel's error is at most ``mult`` times PyTorch's own (plus atol)."""
    ok, err, bound = is_close(out, out_ref, out_torch, mult=mult, atol=atol)
    assert ok, f"{name}: max abs error {err:.3e} > bound {bound:.3e} (mult={mult} x PyTorch error + {atol})"


def check_lse(lse, lse_ref, lse_torch, mult=2.0, atol=1e-3, name="lse"):
    """LSE check: same bound as ``check_close``; -inf (fully masked rows) must match exactly.
    The default atol is looser because lse is O(log seqlen) and PyTorch's own lse error
    can be tiny when few keys are visible, while the kernel works with exp2/log2."""
    assert lse.dtype == torch.float32, f"{name}: dtype {lse.dtype}, expected float32"
    check_close(lse, lse_ref, lse_torch, mult=mult, atol=atol, name=name)


def mla_decode_ref(q_nope, q_pe, ckv_cache, kpe_cache, cache_seqlens, page_table, *, softmax_scale=None,
                   causal=False, upcast=True, kv_descale=None, quantize_q=False, p_fp8=False):
    """MLA decode as plain attention: the pages gathered, K = [ckv, kpe] and V = ckv
    materialised (one shared KV head, or the caches' ``nheads_kv`` heads for 4-D caches
    ``(num_pages, page_size, nheads_kv, d)``: GQA), then ``attention_ref``. Returns (out (b,
    sq, h, 512), lse (b, h, sq)); ``upcast=False`` is PyTorch's own low-precision
    computation. An FP8 cache is dequantized first: the stored values times ``kv_descale``
    (one element, ``(batch,)`` / ``(batch, 1)``: sequence b's, or ``(batch, nheads_kv)``), in
    q's dtype for ``upcast=False``. The FP8 wgmma kernel's algorithm: ``quantize_q`` (the
    576 values of a query head rounded to e4m3 as the kernel rounds them,
    ``quantize_q_ref``) and ``p_fp8`` (P rounded to e4m3, ``attention_ref``)."""
    q = torch.cat([q_nope, q_pe], dim=-1)
    if quantize_q:
        q = quantize_q_ref(q)
    fp8 = ckv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    heads = (lambda c: c) if ckv_cache.dim() == 4 else (lambda c: c.unsqueeze(2))
    # FP8 pages are gathered as bytes (indexing fp8 tensors is not supported everywhere).
    gather = lambda c: gather_paged_kv(heads(c.view(torch.uint8) if fp8 else c), page_table)
    ckv, kpe = gather(ckv_cache), gather(kpe_cache)  # (b, capacity, h_kv, 512 | 64)
    if fp8:
        scale = torch.ones(1, device=q.device) if kv_descale is None else kv_descale.float()
        scale = scale.view(1, 1, 1, 1) if scale.numel() == 1 else scale.view(ckv.shape[0], 1, -1, 1)
        ckv, kpe = ((x.view(ckv_cache.dtype).float() * scale).to(torch.float32 if upcast else q.dtype)
                    for x in (ckv, kpe))
    k = torch.cat([ckv, kpe], dim=-1)
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    return attention_ref(q, k, ckv, softmax_scale=softmax_scale, causal=causal, seqlens_k=cache_seqlens,
                         upcast=upcast, p_fp8=p_fp8)


# ---------------------------------------------------------------------------------------
# User-variant compile cases (compile-only tests: tests/test_variants_host.py)
# ---------------------------------------------------------------------------------------


def bias_table_mod(score, b, h, q_idx, kv_idx, aux):
    """A table-lookup score_mod: (nheads, 16, 16) bias indexed by positions mod 16."""
    return score + aux[0][h, q_idx % 16, kv_idx % 16]


def per_head_mask_mod(b, h, q_idx, kv_idx, aux):
    """A per-head mask_mod: head h drops keys congruent to 1 mod (h + 2)."""
    return kv_idx % (h + 2) != 1


def variant_case_problem(name: str, backend: str):
    """(problem, num_splits, pack_gqa) of a named user-variant compile case, its spec
    registered: ``alibi_document`` (ALiBi + document mask + block mask, causal prefill),
    ``document_rows`` (a document block mask with row bounds: no mask_mod call in the
    kernel) and ``table_perhead_paged`` (bias table + per-head mask, paged GQA decode, split)."""
    from flash_attn_cute import mods
    from flash_attn_cute.host.problems import FwdProblem
    from flash_attn_cute.host.user_variants import make_spec

    if name in ("alibi_document", "document_rows"):
        aux = (torch.empty(16, dtype=torch.float32), torch.empty(2, 4096, dtype=torch.int32))
        rows = name == "document_rows"
        spec = make_spec(None if rows else mods.alibi(0), mods.document_mask(1), aux, 128, row_bounds=rows)
        return FwdProblem(dtype=torch.bfloat16, batch=2, max_seqlen_q=4096, max_seqlen_k=4096, nheads=16,
                          nheads_kv=16, d=128, d_v=128, softmax_scale=0.088, causal=True, window_left=-1,
                          window_right=0, softcap=0.0, varlen_q=False, varlen_k=False, has_seqused_k=False,
                          page_size=0, has_lse=True, variant=spec), 1, False
    if name == "table_perhead_paged":
        aux = (torch.empty(8, 16, 16, dtype=torch.bfloat16),)
        spec = make_spec(bias_table_mod, per_head_mask_mod, aux, 0)
        page_size = 64 if backend != "sm90" else 16  # SM90: the row-gathering producer
        return FwdProblem(dtype=torch.bfloat16, batch=4, max_seqlen_q=2, max_seqlen_k=8192, nheads=8, nheads_kv=2,
                          d=128, d_v=128, softmax_scale=0.088, causal=False, window_left=-1, window_right=-1,
                          softcap=0.0, varlen_q=False, varlen_k=False, has_seqused_k=True, page_size=page_size,
                          has_lse=True, variant=spec), 4, True
    raise ValueError(f"unknown variant compile case {name!r}")


def compile_variant_case(case: tuple):
    """Compiles a named case (``variant_case_problem``) for (backend, name) on fakes: the
    compile harness's target (the spec must be registered in the compiling process)."""
    from flash_attn_cute import seam

    backend, name = case
    problem, num_splits, pack_gqa = variant_case_problem(name, backend)
    module = seam.backend_module(backend)
    plan = module.plan(problem, num_splits, pack_gqa, 132)
    return module.compile(module.compile_key(problem, plan))


# ---------------------------------------------------------------------------------------
# KV-cache append with rotary embedding (kv_append.py; tests/test_kv_append_gpu.py)
# ---------------------------------------------------------------------------------------


def apply_rotary_ref(x, cos, sin, positions, interleaved, rotary_dim):
    """x (b, s, h, d) rotated by position: returns float32 (b, s, h, d), computed in fp32.

    ``cos`` / ``sin`` (seqlen_ro, rotary_dim / 2); ``positions`` (b, s) ints, absolute,
    clamped into [0, seqlen_ro) as the kernel does. The first ``rotary_dim`` channels are
    rotated in pairs, (x[2i], x[2i+1]) when ``interleaved`` (GPT-J), else (x[i],
    x[i + rotary_dim / 2]) (GPT-NeoX): (x0 cos - x1 sin, x0 sin + x1 cos) with column i of
    the tables; the other channels pass through."""
    out = x.float().clone()
    if rotary_dim == 0:
        return out
    half = rotary_dim // 2
    rows = positions.to(device=x.device, dtype=torch.long).clamp(0, cos.shape[0] - 1)
    c = cos.float()[rows][:, :, None, :]  # (b, s, 1, rotary_dim / 2)
    s = sin.float()[rows][:, :, None, :]
    xr = out[..., :rotary_dim]
    x0, x1 = (xr[..., 0::2], xr[..., 1::2]) if interleaved else (xr[..., :half], xr[..., half:])
    o0, o1 = x0 * c - x1 * s, x0 * s + x1 * c
    if interleaved:
        out[..., 0:rotary_dim:2], out[..., 1:rotary_dim:2] = o0, o1
    else:
        out[..., :half], out[..., half:rotary_dim] = o0, o1
    return out


def varlen_rows_ref(cu_seqlens, batch, rows):
    """(b, t, found) of every packed row r in [0, rows): the sequence b whose rows
    [cu[b], cu[b + 1]) hold r, t = r - max(cu[b], 0), and whether the row lies in that
    sequence at all. Found by the kernel's search, step for step (nb = min(len(cu) - 1,
    batch); probe g = min(r, nb - 1): found if cu[g] <= r < cu[g + 1]; else bisect
    [lo, hi) = [0, g) if cu[g] > r, else [g + 1, nb): while hi - lo > 1, mid = (lo + hi)
    // 2, lo = mid if cu[mid] <= r else hi = mid; then, if lo < hi, found = cu[lo] <= r <
    cu[lo + 1]), so that cumulative lengths that are not monotone give the same rows as
    on the GPU; for monotone ones b is the one sequence holding r
    (tests/test_kv_append_compile.py checks that)."""
    cu = cu_seqlens.long()
    device = cu.device
    nb = min(cu.shape[0] - 1, batch)
    r = torch.arange(rows, device=device)
    if nb <= 0:
        zeros = torch.zeros(rows, dtype=torch.long, device=device)
        return zeros, r, torch.zeros(rows, dtype=torch.bool, device=device)
    g = r.clamp(max=nb - 1)
    hit = (cu[g] <= r) & (r < cu[g + 1])
    after = cu[g] <= r
    lo = torch.where(hit, g, torch.where(after, g + 1, 0))
    hi = torch.where(hit, g + 1, torch.where(after, nb, g))
    while True:
        active = hi - lo > 1
        if not active.any():
            break
        mid = (lo + hi) // 2
        go = cu[mid.clamp(max=nb)] <= r
        lo = torch.where(active & go, mid, lo)
        hi = torch.where(active & ~go, mid, hi)
    b = lo.clamp(max=nb - 1)
    first = torch.where(lo < hi, cu[b], 0)
    found = (lo < hi) & (first <= r) & (r < cu[b + 1])
    return b, r - first.clamp(min=0), found


FP8_TYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize_ref(x32, dtype):
    """fp32 values (already divided by their descale) into the fp8 ``dtype``: round to
    nearest even, saturating at the format's largest finite value (448 for e4m3, 57344 for
    e5m2; NaN stays NaN), what the kernels' ``cvt.rn.satfinite`` does. torch's own
    conversion overflows e5m2 to inf, hence the clamp (which rounding to nearest then
    leaves as it is below the largest finite value)."""
    fmax = torch.finfo(dtype).max
    return x32.float().clamp(-fmax, fmax).to(dtype)


def _descale_rows(descale, b, nheads_kv, device, group=1):
    """A (batch, h_kv) or one-element descale (None: 1) for the batch indices ``b`` (any
    shape): fp32 of shape b.shape + (h_kv * group, 1), each KV head's repeated over its
    ``group`` query heads."""
    t = torch.ones(1, device=device) if descale is None else descale.float().to(device)
    t = t.reshape(1, 1).expand(int(b.max()) + 1 if b.numel() else 1, nheads_kv) if t.numel() == 1 else t
    return t[b.long()].repeat_interleave(group, dim=-1)[..., None]


def kv_append_ref(q, k_new, v_new, k_cache, v_cache, cache_seqlens, page_table=None, cache_batch_idx=None,
                  cache_leftpad=None, rotary_cos=None, rotary_sin=None, interleaved=True, q_positions_per_query=True,
                  upcast=False, cu_seqlens_q=None, cu_seqlens_k_new=None, q_descale=None, k_descale=None,
                  v_descale=None):
    """What ``kv_append`` computes, without modifying any input: returns (q_rot, k_cache
    after, v_cache after, seqused (b,) int32, k_offsets (b + 1,) int32 or None).

    New token t of row b goes to absolute position p = cache_seqlens[b] + t, of cache row
    cache_batch_idx[b] (clamped into the cache; b without it) or of page
    page_table[b, p // page_size] (clamped into the pool), row p % page_size; positions
    outside [0, capacity) are dropped. q and the new k are rotated (``apply_rotary_ref``)
    at their absolute positions: k token t at p, query i at cache_seqlens[b] + i when
    ``q_positions_per_query`` else at cache_seqlens[b]. seqused = end - leftpad with end =
    clamp(cache_seqlens + s_new, 0, capacity) and leftpad clamped into [0, end];
    k_offsets (contiguous caches with cache_batch_idx or cache_leftpad) = cache row *
    s_cache + leftpad, then 0. Rotated values are rounded once to the input dtype, or
    kept in float32 (and the caches upcast) with ``upcast``. Several tokens landing on
    one slot (only possible with out-of-range indices) leave one of them, unspecified.

    Varlen (packed) mode: ``cu_seqlens_q`` with q (total_q, h, d), ``cu_seqlens_k_new``
    with k_new / v_new (total_new, h_kv, d*), (b + 1,) cumulative row counts; row r of
    sequence b (``varlen_rows_ref``) is token t = r - cu[b] of b. Rows outside every
    sequence are not written: their q_rot rows are NaN (the kernel leaves q_out there as
    it was). s_new of sequence b is max(c[b + 1] - c[b], 0) with c = cu_seqlens_k_new
    clamped into [0, total_new] (0 for b >= len(cu) - 1).

    FP8 (``quantize_ref``): into an e4m3 / e5m2 cache, 16-bit new tokens are stored as
    fp8(x / descale[b, h_kv]), k rotated first (``k_descale``, ``v_descale``: (b, h_kv) or
    one element, None = 1); fp8 new tokens are copied as they are, except k's rotated
    channels: dequantized (x * k_descale), rotated, quantized again. e4m3 q is rotated the
    same way with ``q_descale`` (per KV head). With ``upcast`` the fp8 slots written hold
    the fp32 values before that last rounding (in stored units: divided by the descale)."""
    rotary_dim = 0 if rotary_cos is None else 2 * rotary_cos.shape[1]
    start = cache_seqlens.long()
    batch = start.shape[0]
    device = k_cache.device
    paged = page_table is not None
    capacity = page_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    start_of = lambda b: start[b] if batch else torch.zeros_like(b)  # b is 0 when batch is 0
    fp8_cache = k_cache.dtype in FP8_TYPES
    h_kv = k_cache.shape[2]

    def rotate(x, positions, scale=None, fp8_out=None):
        """x (B, S, h, d) rotated at ``positions``; fp8 (``fp8_out``, ``scale`` (B, S, h, 1)):
        dequantized first if x is fp8, quantized after (fp8 channels it does not rotate
        copied as they are)."""
        if fp8_out is None:
            y = apply_rotary_ref(x, rotary_cos, rotary_sin, positions, interleaved, rotary_dim)
            return y if upcast else y.to(x.dtype)
        fp8_in = x.dtype in FP8_TYPES
        x32 = x.float() * scale if fp8_in else x.float()
        y = apply_rotary_ref(x32, rotary_cos, rotary_sin, positions, interleaved, rotary_dim) / scale
        if fp8_in:
            y[..., rotary_dim:] = x[..., rotary_dim:].float()
        return y if upcast else quantize_ref(y, fp8_out)

    def stored(x, scale):
        """v (B, S, h, d) as the cache stores it."""
        if not fp8_cache:
            return x
        if x.dtype in FP8_TYPES:
            return x.float() if upcast else x
        return x.float() / scale if upcast else quantize_ref(x.float() / scale, k_cache.dtype)

    q_rot = None
    q_fp8 = q is not None and q.dtype in FP8_TYPES
    q_scale = lambda b: _descale_rows(q_descale, b, h_kv, device, q.shape[-2] // h_kv) if q_fp8 else None
    q_out_dtype = q.dtype if q_fp8 else None
    if q is not None and cu_seqlens_q is not None:
        bq, tq, found = varlen_rows_ref(cu_seqlens_q, batch, q.shape[0])
        q_rot = rotate(q[None], (start_of(bq) + (tq if q_positions_per_query else 0))[None],
                       None if not q_fp8 else q_scale(bq)[None], q_out_dtype)[0]
        if q_rot.dtype in FP8_TYPES:
            q_rot = q_rot.view(torch.uint8)
            q_rot[~found] = 0x7F  # NaN: the kernel leaves these rows as they were
            q_rot = q_rot.view(q.dtype)
        else:
            q_rot[~found] = float("nan")
    elif q is not None:
        t = torch.arange(q.shape[1], device=device)
        bq = torch.arange(batch, device=device)[:, None].expand(batch, q.shape[1])
        q_rot = rotate(q, start[:, None] + (t[None] if q_positions_per_query else 0), q_scale(bq), q_out_dtype)
    k_out = k_cache.float().clone() if upcast else k_cache.clone()
    v_out = v_cache.float().clone() if upcast else v_cache.clone()
    s_new = torch.zeros(batch, dtype=torch.long, device=device)
    k_scale = lambda b: _descale_rows(k_descale, b, h_kv, device) if fp8_cache else None
    v_scale = lambda b: _descale_rows(v_descale, b, h_kv, device) if fp8_cache else None
    k_fp8_out = k_cache.dtype if fp8_cache else None
    if k_new is not None:
        if cu_seqlens_k_new is not None:
            bk, tk, found = varlen_rows_ref(cu_seqlens_k_new, batch, k_new.shape[0])
            pos = start_of(bk) + tk  # (total_new,)
            k_rot = rotate(k_new[None], pos[None], None if not fp8_cache else k_scale(bk)[None], k_fp8_out)[0]
            v_st = stored(v_new[None], None if not fp8_cache else v_scale(bk)[None])[0]
            (rows,) = (found & (pos >= 0) & (pos < capacity)).nonzero(as_tuple=True)
            bs, p, k_src, v_src = bk[rows], pos[rows], k_rot[rows], v_st[rows]
            c = cu_seqlens_k_new.long().clamp(0, k_new.shape[0])
            nb = max(min(c.shape[0] - 1, batch), 0)
            s_new[:nb] = (c[1:nb + 1] - c[:nb]).clamp(min=0)
        else:
            s_new += k_new.shape[1]
            pos = start[:, None] + torch.arange(k_new.shape[1], device=device)[None]  # (b, s_new)
            bt = torch.arange(batch, device=device)[:, None].expand(batch, k_new.shape[1])
            k_rot = rotate(k_new, pos, k_scale(bt), k_fp8_out)
            v_st = stored(v_new, v_scale(bt))
            bs, ts = ((pos >= 0) & (pos < capacity)).nonzero(as_tuple=True)
            p, k_src, v_src = pos[bs, ts], k_rot[bs, ts], v_st[bs, ts]
        if paged:
            page = page_table.long()[bs, p // k_cache.shape[1]].clamp(0, k_cache.shape[0] - 1)
            slot = (page, p % k_cache.shape[1])
        else:
            row = bs.clamp(max=k_cache.shape[0] - 1)
            if cache_batch_idx is not None:
                row = cache_batch_idx.long()[bs].clamp(0, k_cache.shape[0] - 1)
            slot = (row, p)
        for dst, src in ((k_out, k_src), (v_out, v_src)):
            if dst.dtype in FP8_TYPES:  # as bytes: fp8 indexing is not implemented everywhere
                dst.view(torch.uint8)[slot] = src.to(dst.dtype).view(torch.uint8)
            else:
                dst[slot] = src.to(dst.dtype)
    end = (start + s_new).clamp(0, capacity)
    leftpad = torch.zeros_like(end) if cache_leftpad is None else torch.minimum(cache_leftpad.long().clamp(min=0), end)
    seqused = (end - leftpad).int()
    k_offsets = None
    if not paged and (cache_batch_idx is not None or cache_leftpad is not None):
        row = torch.arange(batch, device=device).clamp(max=k_cache.shape[0] - 1)
        if cache_batch_idx is not None:
            row = cache_batch_idx.long().clamp(0, k_cache.shape[0] - 1)
        k_offsets = torch.cat([row * k_cache.shape[1] + leftpad, torch.zeros(1, dtype=torch.long, device=device)])
        k_offsets = k_offsets.int()
    return q_rot, k_out, v_out, seqused, k_offsets
