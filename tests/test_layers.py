"""The import arrows point down the layers (docs/architecture.md), checked on the source itself.

Every ``import`` in every module of the package is resolved, lazy imports
inside functions included (only ``if TYPE_CHECKING:`` blocks are exempt), and
compared with the layer table below: a module may import its own layer or
lower ones. Only the driver opener and the simulation itself may import the
simulation.

The platform plugins under ``plugins/`` sit above the core, as a third party's
would: the module an entry point names imports membackend's public face only
(``membackend``, ``hookspec``, ``types``, ``platform``); their other modules
(workloads and comparisons for the benchmarks) may use the core's internals but
never the simulation, the ComfyUI adapter or the CLI; the core never imports a
plugin.
"""

from __future__ import annotations

import ast
import tomllib
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


def imports_of(path: Path, package: str | None = None) -> list[str]:
    """Every ``membackend`` module ``path`` imports (lazy ones included; ``TYPE_CHECKING`` exempt).
    ``package``: the package relative imports start from (default: the file's own, inside membackend)."""
    if package is None:
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
            if node.module is None or target == "membackend":  # "from . import x": x may be a submodule
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
    fake = ROOT / "_backends" / "_layers_probe.py"
    fake.write_text("def f():\n    from .._manager import BackendManager\n")
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


# --------------------------------------------------------------------------- the plugins

PLUGINS = Path(__file__).resolve().parents[1] / "plugins"
PUBLIC = ("membackend", "membackend.hookspec", "membackend.types", "membackend.platform")
NEVER_FROM_A_PLUGIN = (SIM, "membackend._comfyui", "membackend._cli")


def plugin_imports(path: Path) -> list[str]:
    """Every ``membackend`` import of a plugin module (a plugin's relative imports stay inside it)."""
    return imports_of(path, package="plugin")


def entry_point_modules() -> dict[Path, str]:
    """Each plugin's source file that an entry point in the ``membackend.backends`` group names."""
    found = {}
    for pyproject in sorted(PLUGINS.glob("*/pyproject.toml")):
        eps = tomllib.loads(pyproject.read_text())["project"]["entry-points"]["membackend.backends"]
        for value in eps.values():
            module = value.partition(":")[0]
            path = pyproject.parent.joinpath(*module.split("."))
            found[path / "__init__.py" if path.is_dir() else path.with_suffix(".py")] = module
    return found


def _is_under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_every_plugin_has_an_entry_point_module():
    modules = entry_point_modules()
    assert {p.parts[len(PLUGINS.parts)] for p in modules} == {d.name for d in PLUGINS.iterdir()
                                                                if (d / "pyproject.toml").exists()}
    assert all(p.exists() for p in modules), modules


def test_a_plugin_entry_point_imports_the_public_face_only():
    leaks = [f"{path.relative_to(PLUGINS)} imports {imp}" for path in entry_point_modules()
             for imp in plugin_imports(path) if imp not in PUBLIC and not imp.startswith("membackend.types.")]
    assert leaks == []


def test_no_plugin_module_imports_the_simulation_the_adapter_or_the_cli():
    leaks = [f"{path.relative_to(PLUGINS)} imports {imp}"
             for path in sorted(PLUGINS.glob("*/membackend_*/**/*.py"))
             for imp in plugin_imports(path) if _is_under(imp, NEVER_FROM_A_PLUGIN)]
    assert leaks == []


def test_the_core_imports_no_plugin():
    names = {p.parent.name for p in PLUGINS.glob("*/membackend_*/__init__.py")}
    leaks = []
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            leaks += [f"{module_name(path)} imports {m}" for m in mods if m.split(".")[0] in names]
    assert names and leaks == []


def test_the_plugin_checks_can_fail(tmp_path):
    """A plugin module importing the simulation and an entry point importing an internal are caught."""
    fake = tmp_path / "mod.py"
    fake.write_text("def f():\n    from membackend._drivers.sim import sim_driver\n"
                    "from membackend._settings import parse_bytes\nfrom membackend import types\n")
    found = plugin_imports(fake)
    assert "membackend._drivers.sim" in found and _is_under("membackend._drivers.sim", NEVER_FROM_A_PLUGIN)
    assert "membackend._settings" in found and "membackend._settings" not in PUBLIC
    assert "membackend.types" in found
