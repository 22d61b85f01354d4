"""The import arrows point down the layers (docs/architecture.md), checked on the source itself.

Every ``import`` in every module of the package is resolved, lazy imports
inside functions included (only ``if TYPE_CHECKING:`` blocks are exempt), and
compared with the layer table below: a module may import its own layer or
lower ones. Only the driver opener and the simulation itself may import the
simulation.
"""

from __future__ import annotations

import ast
from pathlib import Path

import membackend

ROOT = Path(membackend.__file__).parent

#: bottom up; a module's layer is the longest prefix listed here
LAYERS = [
    ["membackend.types", "membackend._version"],
    ["membackend.hookspec"],
    ["membackend._settings"],
    ["membackend._hostmem"],
    ["membackend._drivers"],
    ["membackend._machine"],  # facts come from the drivers' discovery (docs/discovery.md)
    ["membackend.platform"],
    ["membackend._backends"],
    ["membackend._ledger", "membackend._fences", "membackend._trace"],
    ["membackend._session"],
    ["membackend._manager"],
    ["membackend._residency"],
    ["membackend._tensors"],
    ["membackend._comfyui", "membackend._replay", "membackend.testing", "membackend._cli"],
    ["membackend"],  # the package facade: nothing inside may import it
]
SIM = "membackend._drivers.sim"
SIM_IMPORTERS = ("membackend._drivers.open", SIM)


def layer_of(module: str) -> int:
    best, rank = -1, None
    for i, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, rank = len(name), i
    assert rank is not None, f"{module} is in no layer; add it to LAYERS"
    return rank


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def imports_of(path: Path) -> list[str]:
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if node.module is None:  # "from . import x": x may be a submodule
                found += [f"{target}.{a.name}" for a in node.names]
            else:
                found.append(target)
    return [m for m in found if m == "membackend" or m.startswith("membackend.")]


def all_imports() -> dict[str, list[str]]:
    return {module_name(p): imports_of(p) for p in sorted(ROOT.rglob("*.py"))}


def test_no_module_imports_one_above_it():
    upward = [f"{mod} (layer {layer_of(mod)}) imports {imp} (layer {layer_of(imp)})"
              for mod, imps in all_imports().items() for imp in imps
              if mod != "membackend" and layer_of(imp) > layer_of(mod)]
    assert upward == []


def test_only_the_opener_imports_the_simulation():
    leaks = [f"{mod} imports {imp}" for mod, imps in all_imports().items() for imp in imps
             if (imp == SIM or imp.startswith(SIM + ".")) and not mod.startswith(SIM_IMPORTERS)]
    assert leaks == []


def test_the_checker_sees_an_upward_import(tmp_path):
    """The rule can fail: a lazy import of the manager from a backend is caught."""
    fake = ROOT / "backends" / "_layers_probe.py"
    fake.write_text("def f():\n    from ..manager import BackendManager\n")
    try:
        assert "membackend._manager" in imports_of(fake)
        assert layer_of("membackend._manager") > layer_of(module_name(fake))
    finally:
        fake.unlink()


def _cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """Every import circle among ``graph``'s modules (each found once, from its smallest name)."""
    found = []

    def walk(path: list[str]) -> None:
        for nxt in graph.get(path[-1], ()):
            if nxt == path[0]:
                found.append(path[:])
            elif nxt not in path and nxt > path[0]:
                walk(path + [nxt])
    for start in sorted(graph):
        walk([start])
    return found


def test_no_import_circle_inside_the_comfyui_adapter():
    """Lazy imports count: one module importing another inside a function is still an arrow."""
    pkg = "membackend._comfyui"
    graph = {mod: sorted({i for i in imps if i.startswith(pkg + ".") and i != mod})
             for mod, imps in all_imports().items() if mod.startswith(pkg + ".")}
    assert _cycles(graph) == []
    assert _cycles({"a": ["b"], "b": ["c"], "c": ["a"]}) == [["a", "b", "c"]]  # the check can fail
