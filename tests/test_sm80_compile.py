"""Compile-only tests of the SM80 forward kernel: no GPU needed.

Each target arch compiles in a subprocess, because the DSL reads CUTE_DSL_ARCH and
CUTE_DSL_KEEP once, at import. The SASS is then checked for the instructions the
kernel is built from.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Each config exercises one part of the compile key; together they cover every head
# dim class (64: 128x128 tile, 128: 4 warps, 256: 8 warps), each variant, pack_gqa,
# split-KV with LSE, varlen and the paged cache with seqused_k.
CONFIGS = [
    dict(dtype="fp16", d=64, dv=64, tile=(128, 64, 4, True), flags=(False, False, False)),
    dict(dtype="bf16", d=128, dv=128, tile=(128, 64, 4, False), flags=(True, False, False), has_lse=True),
    dict(dtype="bf16", d=256, dv=256, tile=(128, 64, 8, False), flags=(False, True, False)),
    dict(dtype="bf16", d=128, dv=128, tile=(128, 64, 4, False), flags=(True, False, True), pack=4, is_split=True, has_lse=True),
    dict(dtype="fp16", d=128, dv=128, tile=(128, 64, 4, False), flags=(False, False, False), varlen_q=True, varlen_k=True),
    dict(dtype="bf16", d=128, dv=128, tile=(64, 128, 4, True), flags=(False, False, False), pack=8, is_split=True,
         has_lse=True, has_seqused_k=True, paged=True),
]

_SCRIPT = textwrap.dedent(
    """
    import json, pathlib, sys
    from flash_attn_cute.sm80.flash_fwd import compile_fwd_sm80, fwd_key
    arch, configs, out = sys.argv[1], json.loads(sys.argv[2]), pathlib.Path(sys.argv[3])
    for i, c in enumerate(configs):
        key = fwd_key(arch, c["dtype"], c["d"], c["dv"], tuple(c["tile"]), tuple(c["flags"]), c.get("pack", 1),
                      c.get("is_split", False), c.get("has_lse", False), c.get("varlen_q", False),
                      c.get("varlen_k", False), c.get("has_seqused_k", False), c.get("paged", False))
        fn = compile_fwd_sm80(key)
        cubin, sass = fn.__cubin__, fn.__sass__
        (out / f"{i}.cubin").write_bytes(cubin if isinstance(cubin, bytes) else cubin.encode())
        if sass:
            (out / f"{i}.sass").write_text(sass if isinstance(sass, str) else sass.decode())
        print("compiled", key, flush=True)
    """
)


def _nvdisasm():
    try:
        import nvidia.cu13  # noqa: F401  (nvidia-cuda-nvdisasm installs under nvidia/cu13/bin)

        cand = Path(nvidia.cu13.__path__[0]) / "bin" / "nvdisasm"
        if cand.exists():
            return str(cand)
    except ImportError:
        pass
    return shutil.which("nvdisasm")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])  # the kernel's own arch, and the H200 it runs on
def test_sm80_kernel_compiles(arch, tmp_path):
    env = dict(os.environ, CUTE_DSL_ARCH=arch, CUTE_DSL_DUMP_DIR=str(tmp_path / "dump"), PYTHONPATH=str(ROOT),
               FLASH_ATTN_CUTE_CACHE="0")
    (tmp_path / "dump").mkdir()
    disasm = _nvdisasm()
    env["CUTE_DSL_KEEP"] = "cubin,sass" if disasm else "cubin"
    if disasm:
        env["PATH"] = str(Path(disasm).parent) + os.pathsep + env.get("PATH", "")
    res = subprocess.run([sys.executable, "-c", _SCRIPT, arch, json.dumps(CONFIGS), str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    assert res.stdout.count("compiled") == len(CONFIGS)
    for i in range(len(CONFIGS)):
        assert (tmp_path / f"{i}.cubin").stat().st_size > 1000
    if not disasm:
        pytest.skip("nvdisasm not installed: cubins checked, SASS not")
    for f in (tmp_path / f"{i}.sass" for i in range(len(CONFIGS))):
        text = f.read_text()
        assert "HMMA.16816.F32" in text, f.name  # mma.sync m16n8k16 with fp32 accumulation
        assert "LDSM" in text, f.name  # ldmatrix feeds the MMAs from swizzled smem
        assert "LDGSTS" in text, f.name  # cp.async K/V/Q loads
        assert "MUFU.EX2" in text, f.name  # softmax through exp2
