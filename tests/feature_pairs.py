"""Every pair of forward features in one small call each: the calls, their fp64 reference,
and what the API refuses.

Shared by the GPU sweep (``test_feature_pairs_gpu.py``: each accepted pair against an
fp64 reference, each refused one for its message) and the CPU one
(``test_feature_pairs.py``: every pair through validation and planning on a fake GPU,
and a covering subset of the kernels they need compiled for every arch). A call is built
from a set of features on top of a base of bf16, batch 2, 4 query heads over 2 KV heads
(GQA, so that packing means something), d 64, 70 queries over 300 keys:

- causal, local (window (40, 7); with causal the right side is 0, FA's rule), softcap
  (2.0: it bends N(0, 1) scores), score_mod (a per-head bias from an aux tensor plus an
  ALiBi-like slope), mask_mod (head h drops keys kv % (h + 3) == 1), block_mask (a
  document mask with row bounds; with mask_mod: the block mask of that mask_mod),
  learnable_sink, split (3 splits), pack_gqa (True), fp8 (e4m3 K/V with per-tensor
  descales, bf16 queries; where the SM90 kernel quantized those queries to e4m3 itself
  (the launch's plan, ``testing.recorded_plans``), its reference takes them quantized, and
  PyTorch's error is that of its FP8 algorithm, ``PairCall.mult`` 3 as in
  test_fp8_attention_gpu);
- paged (pages of 16 keys, vLLM's block size, in a shuffled pool) runs
  ``flash_attn_with_kvcache`` over 300 and 180 cached keys; varlen runs
  ``flash_attn_varlen_func`` over packed sequences of (70, 33) queries and (300, 180) keys;
  both: ``flash_attn_varlen_func`` with ``block_table`` and ``seqused_k``; neither:
  ``flash_attn_func``.
"""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch

FEATURES = ("causal", "local", "softcap", "score_mod", "mask_mod", "block_mask", "learnable_sink", "split",
            "pack_gqa", "paged", "varlen", "fp8")
PAIRS = tuple(itertools.combinations(FEATURES, 2))

# Pairs the API refuses, with the message it must give (it names the arguments).
REFUSED = {
    frozenset({"softcap", "score_mod"}): (ValueError, "softcap and score_mod cannot be combined"),
}

BATCH, NHEADS, NHEADS_KV, D = 2, 4, 2, 64
SEQLEN_Q, SEQLEN_K = 70, 300
VARLEN_Q, VARLEN_K = (70, 33), (300, 180)  # per sequence, packed
PAGE_SIZE = 16
WINDOW = (40, 7)
SOFTCAP = 2.0


def pair_score_mod(score, b, h, q_idx, kv_idx, aux):
    """A per-head bias (aux[0]) and an ALiBi-like slope: reads an aux tensor and both indices."""
    return score + aux[0][h] + 0.002 * (kv_idx - q_idx)


def pair_mask_mod(b, h, q_idx, kv_idx, aux):
    """Head h drops keys congruent to 1 mod (h + 3): a per-head mask with holes."""
    return kv_idx % (h + 3) != 1


@dataclass
class PairCall:
    """One call: ``fn(*args, **kwargs)`` returns (out, lse); ``reference(dtype,
    launches)`` is the same attention in ``dtype`` (fp64: the reference; bf16: PyTorch's
    own error), on the queries quantized to e4m3 as the SM90 kernel quantizes them where
    the launch that computed a row did (``launches``: ``testing.recorded_plans``' list;
    ``testing.attended_q``)."""

    name: str
    fn: Callable
    args: tuple
    kwargs: dict
    reference: Callable
    refusal: Optional[tuple]

    @staticmethod
    def mult(quantized_q: bool) -> float:
        """The kernel's error bound in multiples of PyTorch's (``check_close``)."""
        return 3.0 if quantized_q else 2.0


def _doc_ids(batch: int, seqlen: int, device) -> torch.Tensor:
    pos = torch.arange(seqlen, device=device)
    return torch.stack([(pos + 37 * b) // 61 for b in range(batch)]).to(torch.int32)


def _fp8(x: torch.Tensor):
    """(e4m3 x / descale, descale (1,) fp32): one per-tensor scale, amax at 448."""
    scale = (x.float().abs().amax() / 448.0).clamp(min=1e-12).reshape(1)
    return (x.float() / scale).to(torch.float8_e4m3fn), scale


def _cu(lens, device) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)


def make_pair_call(features, backend: Optional[str], device, seed: int = 0) -> PairCall:
    """The call of a set of features (see the module docstring) with random inputs on
    ``device`` (never zeros), ``backend=backend``."""
    from flash_attn_cute import (create_block_mask, flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache,
                                 mods)
    from flash_attn_cute.testing import any_quantized_q, attended_q, attention_serving_ref

    f = frozenset(features)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen).to(device=device, dtype=torch.bfloat16)
    paged, varlen = "paged" in f, "varlen" in f
    lens_q = VARLEN_Q if varlen else (SEQLEN_Q,) * BATCH
    lens_k = VARLEN_K if (varlen or paged) else (SEQLEN_K,) * BATCH
    max_q, max_k = max(lens_q), max(lens_k)

    q = randn(sum(lens_q), NHEADS, D) if varlen else randn(BATCH, SEQLEN_Q, NHEADS, D)
    cu_q = _cu(lens_q, device) if varlen else None
    page_table = cu_k = seqused_k = None
    mask_k = max_k  # the keys a block mask covers: a paged cache's capacity
    if paged:
        pages_per_seq = math.ceil(max_k / PAGE_SIZE)
        mask_k = pages_per_seq * PAGE_SIZE
        num_pages = BATCH * pages_per_seq + 5
        k, v = randn(num_pages, PAGE_SIZE, NHEADS_KV, D), randn(num_pages, PAGE_SIZE, NHEADS_KV, D)
        perm = torch.randperm(num_pages, generator=gen)[: BATCH * pages_per_seq]
        page_table = perm.view(BATCH, pages_per_seq).to(device=device, dtype=torch.int32)
        seqused_k = torch.tensor(lens_k, dtype=torch.int32, device=device)
    elif varlen:
        k, v = randn(sum(lens_k), NHEADS_KV, D), randn(sum(lens_k), NHEADS_KV, D)
        cu_k = _cu(lens_k, device)
    else:
        k, v = randn(BATCH, SEQLEN_K, NHEADS_KV, D), randn(BATCH, SEQLEN_K, NHEADS_KV, D)
    # The values the kernel attends over: an FP8 cache's dequantized ones.
    k_real, v_real, descales = k, v, {}
    if "fp8" in f:
        (k, k_descale), (v, v_descale) = _fp8(k), _fp8(v)
        k_real, v_real = k.float() * k_descale, v.float() * v_descale
        descales = dict(k_descale=k_descale, v_descale=v_descale)

    opts = dict(causal="causal" in f, window_size=WINDOW if "local" in f else (-1, -1),
                softcap=SOFTCAP if "softcap" in f else 0.0)
    user = {}
    aux = []
    if "score_mod" in f:
        aux.append(torch.randn(NHEADS, generator=gen).to(device=device, dtype=torch.float32))
        user["score_mod"] = pair_score_mod
    mask_mod = pair_mask_mod if "mask_mod" in f else None
    if "block_mask" in f:
        if mask_mod is None:  # a document mask: row bounds, no per-score predicate
            aux.append(_doc_ids(BATCH, max(max_q, mask_k), device))
            mask_mod = mods.document_mask(len(aux) - 1)
        user["block_mask"] = create_block_mask(mask_mod, BATCH, NHEADS if "mask_mod" in f else None, max_q, mask_k,
                                               aux_tensors=aux or None, device=device)
    if mask_mod is not None:
        user["mask_mod"] = mask_mod
    if aux:
        user["aux_tensors"] = aux
    sink = torch.randn(NHEADS, generator=gen).to(device=device) if "learnable_sink" in f else None
    kwargs = dict(opts, **user, **descales, learnable_sink=sink, num_splits=3 if "split" in f else 1,
                  pack_gqa=True if "pack_gqa" in f else False, return_lse=True, backend=backend)

    if paged and varlen:
        fn, args = flash_attn_varlen_func, (q, k, v)
        kwargs.update(cu_seqlens_q=cu_q, max_seqlen_q=max_q, seqused_k=seqused_k, block_table=page_table)
    elif paged:
        fn, args = flash_attn_with_kvcache, (q, k, v)
        kwargs.update(cache_seqlens=seqused_k, page_table=page_table)
    elif varlen:
        fn, args = flash_attn_varlen_func, (q, k, v, cu_q, cu_k, max_q, max_k)
    else:
        fn, args = flash_attn_func, (q, k, v)

    def attend(q_in, dtype, **extra):
        ref_kwargs = dict(opts, score_mod=user.get("score_mod"), mask_mod=mask_mod, aux_tensors=aux or None,
                          learnable_sink=None if sink is None else sink.to(dtype))
        return attention_serving_ref(q_in.to(dtype), k_real.to(dtype), v_real.to(dtype), cu_seqlens_q=cu_q,
                                     cu_seqlens_k=cu_k, seqused_k=seqused_k, page_table=page_table, upcast=False,
                                     **ref_kwargs, **extra)

    def reference(dtype, launches):
        if not any_quantized_q(launches):
            return attend(q, dtype)
        qq = attended_q(q, launches, cu_q)  # the queries the kernel attends with, row by row
        if dtype == torch.float64:
            return attend(qq, dtype)
        # PyTorch's own error on them: O by its FP8 algorithm (fp32 scores, P in e4m3 at 2^8
        # of its row max), the LSE in bf16.
        return attend(qq, torch.float32, p_fp8=True)[0], attend(qq, dtype)[1]

    return PairCall("-".join(sorted(f)), fn, args, kwargs, reference, REFUSED.get(f))


# The arch each backend's kernels are compiled for in the CPU sweep: the one the GPU sweep
# runs them on (the H200: the SM80 kernel too, FP8 K/V needing compute capability 8.9),
# and SM100's own.
PAIR_ARCHS = {"sm80": "sm_90a", "sm90": "sm_90a", "sm100": "sm_100a"}


def pair_keys(backend: str, features, arch: str, compile_keys: bool = False) -> list:
    """The compile keys a pair's call launches on ``backend`` (its real check and plan)
    for ``arch``, on CPU tensors (``fake_gpu_calls``); with ``compile_keys``, each is
    compiled too. Raises what the call raises (a refusal)."""
    with fake_gpu_calls(arch, compile_keys) as fake:
        call = make_pair_call(features, backend, "cpu")
        call.fn(*call.args, **call.kwargs)
    return fake.keys


def compile_pair(case: tuple) -> None:
    """The compile harness's target for ``(backend, features...)`` on CUTE_DSL_ARCH: the
    call is made in the compiling process, which registers its user variant's functions
    for the kernels that read them (``user_variants.registered_spec``)."""
    import os

    backend, *features = case
    pair_keys(backend, features, os.environ["CUTE_DSL_ARCH"], compile_keys=True)


class fake_gpu_calls:
    """A context in which the public API runs on CPU tensors as if on a 132-SM GPU of
    ``arch``'s capability: device checks off, every backend's real check, plan and compile
    key, its launcher replaced by one that records the key (and compiles it when
    ``compile_keys``), the combine a no-op. ``keys`` lists the keys in launch order."""

    def __init__(self, arch: str, compile_keys: bool = False):
        self.arch, self.compile_keys, self.keys, self._undo = arch, compile_keys, [], []

    def _set(self, obj, name, value):
        self._undo.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def __enter__(self):
        from types import SimpleNamespace

        from flash_attn_cute.api import call_cache, checks
        from flash_attn_cute.host import heuristics, keys
        from flash_attn_cute import seam

        call_cache.clear()
        real = seam.backend_module
        arch = self.arch

        def backend_module(name, kind="fwd"):
            module = real(name, kind)

            def launcher(problem, plan, device=None):
                key = module.compile_key(problem, plan, arch)
                self.keys.append(key)
                if self.compile_keys:
                    module.compile(key)
                return lambda *tensors: None

            names = [n for n in dir(module) if not n.startswith("__") and n != "launcher"]
            return SimpleNamespace(**{n: getattr(module, n) for n in names}, launcher=launcher)

        self._set(seam, "backend_module", backend_module)
        self._set(seam, "combine_launcher", lambda *a, **k: (lambda *tensors: None))
        self._set(checks, "check_device", lambda tensors: None)
        self._set(heuristics, "num_sms", lambda device: 132)
        self._set(torch.cuda, "get_device_capability", lambda device=None: keys.arch_capability(arch))
        return self

    def __exit__(self, *exc):
        from flash_attn_cute.api import call_cache

        for obj, name, value in reversed(self._undo):
            setattr(obj, name, value)
        call_cache.clear()
        return False
