"""The package's import graph, checked on the CPU: every import of a package module by
another (at module level or inside a function) goes to the same layer or a lower one,
and no import chain comes back to where it started.

Layers, lowest first (``layer_of``; the folders are the layers):

0. ``host/`` and the per-arch ``config.py``: plain Python and torch, no DSL;
1. ``device/``: device code every kernel family shares;
2. kernels: ``kernels/``, ``sm*/flash_fwd.py``, ``sm*/mla_decode*.py`` and the per-arch
   device helpers (``sm80/gemm.py``, ``sm90/wgmma_utils.py``, ``sm90/fp8_operands.py``);
3. ``seam/backend_kit.py``: what backend modules build their entry points from;
4. backends: ``sm*/__init__.py``, ``sm*/mla.py`` (plans, keys, launchers; they name their
   kernels by module path, imported when a key first compiles);
5. ``seam/``: the dispatch (it imports backends by name, through the registry);
6. ``api/``: the call kit under the public entry points;
7. the public API: ``interface.py``, ``mla.py``, ``mods.py``, ``__init__.py``;
8. tools: ``aot.py``, ``testing.py``, ``distributed.py``.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "flash_attn_cute"
KERNEL_FILES = {"flash_fwd.py", "mla_decode.py", "mla_decode_tma.py", "gemm.py", "wgmma_utils.py", "fp8_operands.py"}


def layer_of(rel: Path) -> int:
    parts = rel.parts
    if parts[0] == "host" or rel.name == "config.py":
        return 0
    if parts[0] == "device":
        return 1
    if parts[0] == "kernels" or (parts[0].startswith("sm") and rel.name in KERNEL_FILES):
        return 2
    if rel.as_posix() == "seam/backend_kit.py":
        return 3
    if parts[0].startswith("sm"):
        return 4
    if parts[0] == "seam":
        return 5
    if parts[0] == "api":
        return 6
    if rel.name in ("aot.py", "testing.py", "distributed.py"):
        return 8
    return 7


def module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["flash_attn_cute", *parts])


MODULES = {module_name(p.relative_to(PACKAGE)): p.relative_to(PACKAGE) for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(rel: Path) -> set:
    """The package modules ``rel`` imports (``from flash_attn_cute.x import y`` names the
    module y when it is one, else x), wherever the import statement is."""
    out = set()
    for node in ast.walk(ast.parse((PACKAGE / rel).read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("flash_attn_cute"):
            assert node.level == 0, f"{rel}: relative import of {node.module}"
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if sub in MODULES else node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("flash_attn_cute")}
    out.discard(module_name(rel))
    return {m for m in out if m in MODULES}


GRAPH = {name: imports_of(rel) for name, rel in MODULES.items()}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_go_down_the_layers(name):
    mine = layer_of(MODULES[name])
    up = sorted(m for m in GRAPH[name] if layer_of(MODULES[m]) > mine)
    assert not up, f"{name} (layer {mine}) imports higher layers: " + ", ".join(
        f"{m} ({layer_of(MODULES[m])})" for m in up)


def test_no_import_cycles():
    state, cycles = {}, []

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_private_names_across_modules():
    """No module imports another's private (``_name``) names."""
    bad = []
    for name, rel in MODULES.items():
        for node in ast.walk(ast.parse((PACKAGE / rel).read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("flash_attn_cute"):
                bad += [f"{name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert not bad, bad


def _tensor_fields(path: str, cls: str) -> list:
    """The tensor fields of a kernel argument list (``cute.Tensor`` / ``Optional[cute.Tensor]``
    annotations of the NamedTuple ``cls`` in ``path``), in order."""
    tree = ast.parse((PACKAGE / path).read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    return [s.target.id for s in node.body
            if isinstance(s, ast.AnnAssign) and "cute.Tensor" in ast.unparse(s.annotation)]


@pytest.mark.parametrize("kernel_args,path,host", [
    ("FwdArgs", "device/fwd_kernel.py", "FwdTensors"), ("MlaArgs", "device/mla_kernel.py", "MlaTensors")])
def test_host_tensor_lists_are_the_kernels_argument_lists(kernel_args, path, host):
    """``api.call_args``' tensor lists (what a launcher is called with) hold the kernels'
    tensor arguments in their order: ``mCuSeqlensQ`` is ``cu_seqlens_q``, and so on."""
    from flash_attn_cute.api import call_args

    snake = {"mQ": "q", "mK": "k", "mV": "v", "mO": "out", "mLSE": "lse", "mSeqUsedK": "seqused_k",
             "mSeqUsedQ": "seqused_q", "mQn": "q_nope", "mQp": "q_pe", "mCkv": "ckv", "mKpe": "kpe",
             "mSeqlens": "cache_seqlens", "mKvDescale": "kv_descale", "mCpTotSeqlenK": "cp_tot_seqused_k",
             "mOPartial": "o_partial", "mLSEPartial": "lse_partial"}

    def name(field):
        if field in snake:
            return snake[field]
        out = "".join("_" + c.lower() if c.isupper() else c for c in field[1:]).lstrip("_")
        return out.replace("aux_", "aux")

    assert [name(f) for f in _tensor_fields(path, kernel_args)] == list(getattr(call_args, host)._fields)
