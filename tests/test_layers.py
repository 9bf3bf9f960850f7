"""The package's layering, read from the source (docs/ARCHITECTURE.md): arrows point down only.

Every import counts — top-level, inside functions (lazy) and under
``TYPE_CHECKING`` — because each is a dependency a reader must follow. The
test builds the graph of zerolab's modules from their ASTs and fails on an
import that points up a layer, a torch import in the pure layers, an import
circle between modules, or a file over 350 lines. ``test_*_catches_*`` plant
each fault in a copy of the package and check that the graph catches it.
"""
from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "zerolab"

# layer -> the layers it may import (besides itself)
ALLOWED = {
    "theory": set(),
    "config": {"theory"},
    "runtime": {"theory"},
    "engine": {"theory", "config", "runtime", "parallel"},   # zl.initialize cuts pipeline stages
    "parallel": {"theory", "runtime"},
    "book": {"theory", "config", "runtime", "engine", "parallel"},   # chapter 10 draws and runs the 3-D code
    "grading": {"theory", "config", "runtime", "engine", "parallel", "book"},   # exercise 9 runs a pipeline
    "bench": {"theory", "config", "runtime", "engine", "parallel", "book"},   # parallel: the 3D bench (mesh3d)
    "deepspeed": {"theory", "config", "runtime", "parallel", "engine"},   # parallel: deepspeed.pipe's stages
    "top": {"theory", "config", "runtime", "engine", "parallel", "book", "grading", "bench", "deepspeed", "top"},
}
NO_TORCH = {"theory", "config"}
TOP_FILES = {"__init__.py", "__main__.py", "cli.py"}
MAX_LINES = 300

# the engine's stage stack: the files at engine/ itself (docs/ARCHITECTURE.md, "The engine inside")
ENGINE_STACK = {"__init__", "accumulate", "api", "base", "buckets", "collectives", "events", "flat", "frozen", "gathered", "groups",
                "mesh_norm", "optim", "precision", "prefetch", "reduce_order", "stage0", "stage1", "stage2", "stage3", "unit_hooks",
                "unit_order", "unused", "whole_buckets", "trace"}
# engine part -> the parts it may import ("stack": the files above; engine/__init__ may import anything)
ENGINE_PARTS = {
    "stack": {"bigmodel", "checkpoint"},   # only api.py and base.py (see STACK_DOORS)
    "bigmodel": {"stack"},
    "checkpoint": {"stack", "bigmodel"},
    "offload": {"stack"},
    "zeropp": {"stack"},
}
STACK_DOORS = {"zerolab.engine.api", "zerolab.engine.base"}   # the stack's only imports of engine folders
STAGE_FILES = {f"zerolab.engine.stage{k}" for k in range(4)}


def layer_of(module: str) -> str:
    """``zerolab.engine.stage3`` -> "engine"; ``zerolab`` and its top files -> "top"."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("cli", "__main__"):
        return "top"
    return parts[1]


def engine_part(module: str) -> str | None:
    """``zerolab.engine.offload.nvme`` -> "offload"; ``zerolab.engine.stage2`` -> "stack"; outside the engine None."""
    parts = module.split(".")
    if parts[:2] != ["zerolab", "engine"]:
        return None
    if len(parts) == 2:
        return "init"
    return parts[2] if parts[2] in ENGINE_PARTS else "stack"


def engine_violations(name: str, rel, edges: dict, modules: dict) -> list[str]:
    """The engine's inner rules for module ``name`` (see the module docstring)."""
    part, out = engine_part(name), []
    parts = name.split(".")
    if part == "stack" and len(parts) == 3 and parts[2] not in ENGINE_STACK:
        out.append(f"{rel}: loose in engine/ (not in the stage stack {sorted(ENGINE_STACK)}): put it in one of "
                   f"the engine's folders {sorted(k for k in ENGINE_PARTS if k != 'stack')} or add it to the stack")
    if part in (None, "init"):
        return out
    for target, line in edges[name].items():
        dst = engine_part(target)
        if dst is None or dst == part:
            continue
        if dst == "init":
            out.append(f"{rel}:{line}: imports zerolab.engine itself; import the module it needs")
        elif dst not in ENGINE_PARTS[part]:
            out.append(f"{rel}:{line}: engine/{part} imports {target} (engine/{dst}); it may import only "
                       f"{sorted(ENGINE_PARTS[part])}")
        elif part == "stack" and dst != "stack" and name not in STACK_DOORS:
            out.append(f"{rel}:{line}: {name} imports {target}; in the stack only {sorted(STACK_DOORS)} may")
        if name in STAGE_FILES and dst != "stack":
            out.append(f"{rel}:{line}: stage file imports {target}: a stage file builds on the stack only")
    return out


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, root: Path) -> list[tuple[str, tuple, int]]:
    """Every import of ``path`` as (module, names imported from it, line); relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    me = module_name(path, root)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, (), node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((mod, tuple(a.name for a in node.names), node.lineno))
    return out


def graph(root: Path = PKG):
    """(modules, edges {module: {imported zerolab module: line}}, torch importers {module: line})."""
    files = sorted(root.rglob("*.py"))
    modules = {module_name(f, root): f for f in files}
    edges, torch_users = {}, {}
    for name, f in modules.items():
        edges[name] = {}
        for mod, names, line in imports_of(f, root):
            if mod == "torch" or mod.startswith("torch."):
                torch_users.setdefault(name, line)
            if not (mod == "zerolab" or mod.startswith("zerolab.")):
                continue
            # `from zerolab.x import y`: y is a submodule (an edge to it) or a name of zerolab.x
            subs = [f"{mod}.{n}" for n in names if f"{mod}.{n}" in modules]
            targets = subs + ([mod] if len(subs) < len(names) or not names else [])
            for target in targets:
                while target not in modules and "." in target:   # `import zerolab.x.y` of a package path
                    target = target.rpartition(".")[0]
                if target in modules and target != name:
                    edges[name].setdefault(target, line)
    return modules, edges, torch_users


def violations(root: Path = PKG) -> list[str]:
    modules, edges, torch_users = graph(root)
    out = []
    for name, f in modules.items():
        src, rel = layer_of(name), f.relative_to(root.parent)
        if src not in ALLOWED:
            out.append(f"{rel}: not in a layer (allowed at the top: {sorted(TOP_FILES)})")
            continue
        for target, line in edges[name].items():
            dst = layer_of(target)
            if dst != src and dst not in ALLOWED[src] and not (target == "zerolab" and src == "top"):
                out.append(f"{rel}:{line}: {src} imports {target} ({dst}); {src} may import only "
                           f"{sorted(ALLOWED[src]) or 'nothing of zerolab outside itself'}")
        if src in NO_TORCH and name in torch_users:
            out.append(f"{rel}:{torch_users[name]}: {src} imports torch (the {src} layer is pure arithmetic)")
        out += engine_violations(name, rel, edges, modules)
        n = len(f.read_text().splitlines())
        if n > MAX_LINES:
            out.append(f"{rel}: {n} lines (limit {MAX_LINES}): split it")
    out += [f"import circle: {' -> '.join(c)}" for c in cycles(edges)]
    return out


def cycles(edges) -> list[list[str]]:
    """One representative cycle per strongly connected component (Tarjan), package __init__
    edges to its own submodules aside (a package re-exporting its files is not a circle)."""
    def real(a, b):
        return not b.startswith(a + ".")
    index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in (w for w in edges.get(v, {}) if real(v, w)):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp) + [sorted(comp)[0]])
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return comps


def test_layers_point_down_and_files_stay_small():
    assert violations() == []


def test_top_level_holds_only_the_public_api():
    assert {p.name for p in PKG.glob("*.py")} == TOP_FILES
    assert sorted(p.name for p in PKG.iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(
        l for l in ALLOWED if l != "top")


def test_every_file_says_what_it_is():
    missing = [str(f.relative_to(PKG.parent)) for f in PKG.rglob("*.py")
               if f.name != "__main__.py" and not ast.get_docstring(ast.parse(f.read_text()))]
    assert missing == []


@pytest.fixture
def copy(tmp_path):
    dst = tmp_path / "zerolab"
    shutil.copytree(PKG, dst, ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def _append(path: Path, text: str):
    path.write_text(path.read_text() + text)


def test_planted_upward_import_is_caught(copy):
    # a lazy import inside a function counts as much as a top-level one
    _append(copy / "runtime" / "comm.py", "\n\ndef _planted():\n    from zerolab.engine import initialize\n")
    assert any("runtime imports zerolab.engine" in v for v in violations(copy))


def test_planted_type_checking_import_is_caught(copy):
    _append(copy / "theory" / "memory.py",
            "\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from zerolab.config import Config\n")
    assert any("theory imports zerolab.config" in v for v in violations(copy))


def test_planted_torch_in_theory_is_caught(copy):
    _append(copy / "config" / "zero.py", "\nimport torch\n")
    assert any("config imports torch" in v for v in violations(copy))


def test_planted_circle_is_caught(copy):
    _append(copy / "theory" / "checks.py", "\nfrom zerolab.theory import comm\n")
    assert any(v.startswith("import circle") and "zerolab.theory.checks" in v for v in violations(copy))


def test_planted_long_file_is_caught(copy):
    _append(copy / "engine" / "stage0.py", "\n" * (MAX_LINES + 1))
    assert any("stage0.py" in v and "lines" in v for v in violations(copy))


def test_planted_loose_module_is_caught(copy):
    (copy / "helpers.py").write_text('"""A loose module."""\n')
    assert any("helpers.py: not in a layer" in v for v in violations(copy))


def test_planted_loose_engine_module_is_caught(copy):
    (copy / "engine" / "checkpoint_extra.py").write_text('"""A loose engine module."""\n')
    assert any("checkpoint_extra.py: loose in engine/" in v for v in violations(copy))


def test_planted_stack_importing_an_engine_folder_is_caught(copy):
    _append(copy / "engine" / "stage2.py", "\n\ndef _planted():\n    from zerolab.engine.offload import nvme\n")
    assert any("stage2.py" in v and "engine/stack imports zerolab.engine.offload.nvme" in v for v in violations(copy))


def test_planted_folder_importing_another_folder_is_caught(copy):
    _append(copy / "engine" / "zeropp" / "quantize.py", "\nfrom zerolab.engine.offload import nvme\n")
    assert any("engine/zeropp imports zerolab.engine.offload.nvme" in v for v in violations(copy))
