"""CPU tests of the seam every kernel family shares (``seam.py``): one registry per problem
kind, tuning overrides as explicit plan arguments that are part of both caches' keys, one
``clear`` for every cache, and the host/device line (import without the DSL)."""

import ast
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flash_attn_cute import mla, mods, seam, sm80, sm90
from flash_attn_cute.api import call_cache
from flash_attn_cute.host import tuning
from flash_attn_cute.host.problems import FwdProblem, MlaProblem
from flash_attn_cute.host.tuning import Tuning
from flash_attn_cute.host.user_variants import make_spec

PACKAGE = Path(__file__).resolve().parents[1] / "flash_attn_cute"
BF16 = torch.bfloat16


def _problem(**kw):
    base = dict(dtype=BF16, batch=2, max_seqlen_q=4096, max_seqlen_k=4096, nheads=16, nheads_kv=16, d=128, d_v=128,
                softmax_scale=0.1, causal=False, window_left=-1, window_right=-1, softcap=0.0, varlen_q=False,
                varlen_k=False, has_seqused_k=False, page_size=0, has_lse=False)
    return FwdProblem(**{**base, **kw})


def test_import_does_not_load_the_dsl():
    # The backends plan in plain Python; the DSL loads when a kernel is first compiled.
    code = ("import sys, time; import torch; t = time.perf_counter(); import flash_attn_cute; "
            "print(time.perf_counter() - t, 'cutlass' in sys.modules)")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
            for _ in range(3)]
    assert all(loaded == "False" for _, loaded in runs)
    assert min(float(seconds) for seconds, _ in runs) < 0.3  # beyond torch (0.05-0.09 s measured)


# Modules that run on the device (or compile for it) must not reach back into the seam or
# the public API: the floors stay host (API, seam, backend plans) above device helpers.
HOST_ONLY = {"seam", "interface", "mla", "checks", "call_cache", "backend_kit", "aot", "ops"}
DEVICE_MODULES = ["device/fwd_kernel.py", "kernels/combine.py", "sm80/flash_fwd.py", "sm80/mla_decode.py",
                  "sm90/flash_fwd.py", "sm90/mla_decode.py", "sm100/flash_fwd.py"]


@pytest.mark.parametrize("path", DEVICE_MODULES)
def test_device_code_does_not_import_the_seam(path):
    tree = ast.parse((PACKAGE / path).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported |= {node.module.split(".")[-1]} | {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            imported |= {a.name.split(".")[-1] for a in node.names}
    assert not imported & HOST_ONLY, imported & HOST_ONLY


def test_registries_per_kind():
    assert seam.REGISTRIES == {"fwd": seam.BACKENDS, "mla": seam.MLA_BACKENDS} and mla.MLA_BACKENDS is seam.MLA_BACKENDS
    assert seam.candidates("fwd", (9, 0)) == ["sm90", "sm80"] and seam.candidates("fwd", (12, 0)) == ["sm80"]
    assert seam.candidates("mla", (9, 0)) == ["sm90", "sm80"] and seam.candidates("mla", (8, 6)) == []
    # The plan holds every choice: the key reads only (problem, plan).
    mla_problem = MlaProblem(dtype=BF16, batch=4, max_seqlen_q=1, max_seqlen_k=8192, nheads=64, page_size=64,
                             softmax_scale=576 ** -0.5, causal=False, has_lse=False)
    for kind, problem in (("fwd", _problem()), ("mla", mla_problem)):
        for name in seam.REGISTRIES[kind]:
            module = seam.backend_module(name, kind)
            if module.check(problem) is not None:
                continue
            plan = module.plan(problem, 0, None, 132, arch="sm_90a")
            assert plan.backend == name and isinstance(plan.config, tuple) and hasattr(plan.config, "_fields")
            assert module.compile_key(problem, plan, "sm_90a")[0] == f"{kind}_{name}"


def test_tuning_overrides_are_plan_arguments():
    p = _problem()
    assert sm80.plan(p, 1, None, None).config == (128, 64, 4, False, 0)
    tiled = sm80.plan(p, 1, None, None, tuning=Tuning(sm80_tile="64,128,4,1"))
    assert tiled.config == (64, 128, 4, True, 0)
    assert sm80.compile_key(p, tiled, "sm_90a") != sm80.compile_key(p, sm80.plan(p, 1, None, None), "sm_90a")
    assert sm90.plan(p, 1, None, None, tuning=Tuning(sm90_tile="128,96,2")).config[:4] == (128, 96, 2, 0)
    window = _problem(window_left=512)
    assert sm90.plan(window, 1, None, None).config.persistent
    assert not sm90.plan(window, 1, None, None, tuning=Tuning(sm90_persistent="0")).config.persistent
    causal = _problem(causal=True, window_right=0)
    assert sm90.plan(causal, 1, None, None, tuning=Tuning(sm90_persistent="1")).config.persistent
    # Non-causal d128 (128 x 176): two stages and a separate O buffer do not fit; "1" keeps it.
    assert not sm90.plan(p, 1, None, None, tuning=Tuning(sm90_persistent="1")).config.persistent
    # "dynamic": persistent, its own key value, and a fresh zeroed tile counter per launch
    # (never shared by two launches); the static persistent kernels take none.
    dyn = sm90.plan(causal, 1, None, None, tuning=Tuning(sm90_persistent="dynamic"))
    static = sm90.plan(causal, 1, None, None, tuning=Tuning(sm90_persistent="1"))
    assert dyn.config.persistent == "dynamic" and static.config.persistent is True
    assert sm90.compile_key(causal, dyn, "sm_90a")[-1] == "dynamic"
    assert sm90.compile_key(causal, static, "sm_90a")[-1] is True
    assert sm90.plan(p, 1, None, None, tuning=Tuning(sm90_persistent="dynamic")).config.persistent is False
    from types import SimpleNamespace

    tensors = SimpleNamespace(q=torch.empty(1))
    make = sm90._call_tensors(causal, dyn)
    first, second = make(tensors)[0], make(tensors)[0]
    assert first is not second and first.dtype == torch.int32 and first.shape == (1,) and int(first) == 0
    # the others get None for it, bound once with the scalars (no per-launch call)
    assert sm90._call_tensors(causal, static) is None and sm90._extra_scalars(causal, static, None)[-1] is None
    assert len(sm90._extra_scalars(causal, dyn, None)) == 2


def test_sm90_decode_tiles_and_ctas_per_sm():
    """16-bit decode rows of d <= 128: (64, 64, 2), two CTAs per SM, whatever the page size
    (pages of 64 or 128 by one TMA a block, 16 and 48 by 16-row TMA boxes, others by row
    gathers, as are 16 with FLASH_ATTN_CUTE_SM90_PAGED_KV=gather); batch invariant, d256, FP8
    caches, prefill: one CTA. A tile override names its CTAs in a fifth field."""
    gathers, boxes = tuning.Tuning(sm90_paged_kv="gather"), tuning.NO_TUNING
    for d, page, want, ctas, gather, box, knob in (
            (128, 0, (64, 64, 2), 2, False, 0, tuning.NO_TUNING), (64, 16, (64, 64, 2), 2, True, 0, gathers),
            (64, 16, (64, 64, 2), 2, False, 16, boxes), (64, 48, (64, 64, 2), 2, False, 16, boxes),
            (64, 8, (64, 64, 2), 2, True, 0, boxes), (128, 128, (64, 64, 2), 2, False, 0, boxes),
            (256, 0, (64, 80, 2), 1, False, 0, tuning.NO_TUNING)):
        p = _problem(d=d, d_v=d, max_seqlen_q=1, nheads_kv=4, page_size=page, has_seqused_k=page > 0)
        config = sm90.plan(p, 1, None, 132, tuning=knob).config
        assert (config[:3], config.ctas_per_sm, config.gather_kv, config.kv_box) == (want, ctas, gather, box), \
            (d, page, config)
        assert sm90.config.smem_bytes(d, d, *config[:3]) + 3072 <= (sm90.config.TWO_CTAS_SMEM if ctas == 2 else
                                                                    sm90.config.SMEM_LIMIT)
    decode = _problem(max_seqlen_q=1, nheads_kv=4)
    assert sm90.plan(decode._replace(batch_invariant=True), 1, None, 132).config.ctas_per_sm == 1
    assert sm90.plan(_problem(), 1, None, 132).config.ctas_per_sm == 1
    key = sm90.compile_key(decode, sm90.plan(decode, 1, None, 132), "sm_90a")
    assert key[-1] == 2  # the key names a two-CTA tile (its launch sets the shared-memory carveout)
    tuned = sm90.plan(decode, 1, None, 132, tuning=Tuning(sm90_tile="64,80,2,0,2")).config
    assert tuned[:3] == (64, 80, 2) and tuned.ctas_per_sm == 2
    assert sm90.plan(decode, 1, None, 132, tuning=Tuning(sm90_tile="64,128,3")).config.ctas_per_sm == 1


def test_sm90_prefill_tiles():
    """d128 16-bit prefill: 128 x 176 (FA3's C++ tile) only where nothing masks or modifies
    the scores (measured faster there, not under causal); 128 x 128 otherwise."""
    plain = _problem(causal=False, window_right=-1)
    assert sm90.plan(plain, 1, None, 132).config[:3] == (128, 176, 2)
    for other in (_problem(causal=True, window_right=0), _problem(causal=False, window_right=-1, softcap=30.0),
                  _problem(causal=False, window_left=256, window_right=0),
                  _problem(causal=False, window_right=-1, d=96, d_v=96),
                  _problem(causal=False, window_right=-1, variant=make_spec(mods.softcap(20.0), None, (), 0))):
        assert sm90.plan(other, 1, None, 132).config[1] != 176, other
    # A paged cache takes the largest multiple of 16 that divides its pages.
    assert sm90.plan(plain._replace(page_size=256, has_seqused_k=True), 1, None, 132).config[:2] == (128, 128)


def test_env_knobs_are_read_at_the_edge(monkeypatch):
    for name in tuning._ENV:
        monkeypatch.delenv(name, raising=False)
    assert tuning.from_env() == tuning.NO_TUNING and tuning.env_knobs() == (None,) * len(tuning._ENV)
    monkeypatch.setenv("FLASH_ATTN_CUTE_SM80_TILE", "64,64,4,0")
    monkeypatch.setenv("FLASH_ATTN_CUTE_MLA_SM90_QK", "split")
    assert tuning.from_env() == Tuning(sm80_tile="64,64,4,0", mla_sm90_qk="split")
    assert tuning.env_knobs()[1] == "64,64,4,0"


def test_a_knob_changed_between_calls_is_a_new_plan(fake_device, monkeypatch):
    # bench_tiles sets FLASH_ATTN_CUTE_SM80_TILE per iteration: each tile must be planned,
    # compiled and launched, not the first one replayed from the per-call cache.
    launched = []

    def launcher(problem, plan, device=None):
        return lambda tensors: launched.append(plan.config)

    fake = SimpleNamespace(AUTO=True, runs_on=sm80.runs_on, check=sm80.check, plan=sm80.plan, launcher=launcher)
    fake_device(lambda name, kind="fwd": fake)
    from flash_attn_cute import flash_attn_func

    q = k = v = torch.randn(1, 256, 2, 64, dtype=BF16)
    for tile in ("128,64,4,0", "64,64,4,1", "128,128,8,0", "64,64,4,1"):
        monkeypatch.setenv("FLASH_ATTN_CUTE_SM80_TILE", tile)
        flash_attn_func(q, k, v, backend="sm80")
    monkeypatch.delenv("FLASH_ATTN_CUTE_SM80_TILE")
    flash_attn_func(q, k, v, backend="sm80")
    assert launched == [(128, 64, 4, False, 0), (64, 64, 4, True, 0), (128, 128, 8, False, 0), (64, 64, 4, True, 0),
                        sm80.plan(_problem(d=64, d_v=64, max_seqlen_q=256), 1, None, None).config]


def test_one_clear_for_every_cache(fake_device, monkeypatch):
    launcher = lambda problem, plan, device=None: (lambda tensors: None)
    fakes = {kind: SimpleNamespace(AUTO=True, runs_on=lambda cap: True, check=lambda p: None,
                                   plan=seam.backend_module("sm80", kind).plan, launcher=launcher)
             for kind in ("fwd", "mla")}
    fake_device(lambda name, kind="fwd": fakes[kind])
    mla_problem = MlaProblem(dtype=BF16, batch=4, max_seqlen_q=1, max_seqlen_k=8192, nheads=64, page_size=64,
                             softmax_scale=576 ** -0.5, causal=False, has_lse=False)
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    seam.resolve(mla_problem, None, 1, None, "cuda:0")
    seam.resolve(_problem(), None, 1, None, "cuda:0")
    assert len(seam._plan_cache) == 2
    call_cache.clear()
    assert not seam._plan_cache
