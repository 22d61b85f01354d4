"""The import arrows point down the layers (docs/architecture.md), checked on the source itself.

Every ``import`` in every module of the package is resolved, lazy imports
inside functions included (only ``if TYPE_CHECKING:`` blocks are exempt), and
compared with the layer table below: a module may import its own layer or
lower ones. Only the driver opener and the simulation itself may import the
simulation. The top floor is ordered too: the ComfyUI adapter, then the lab
(its replays, their pictures, then the rest of it), then the conformance kit,
then the command line; and, whatever the order, the adapter, which runs inside
users' ComfyUI, imports neither the lab nor the kit.

The platform plugins under ``plugins/`` sit above the core, as a third party's
would, and their wheels ship their platform only: every module of a plugin's
package is the module its entry point names or one that module imports, and
imports membackend's public face only (``membackend``, ``hookspec``, ``types``,
``platform``). The scripts in ``benchmarks/`` (and the platforms' workloads
beside them) import the public face and the lab (``membackend.lab``); the
documentation's examples under ``docs/examples/`` the public face, the kit
(``membackend.testing``) and the lab; none imports anything internal (no
module with a part starting with ``_``), and the core never imports a plugin.
Tests, the plugins' (``plugins/*/tests/``) and membackend's (``tests/``), may
use the internals.

The graph is counted twice: as it runs (``TYPE_CHECKING`` blocks exempt) and
with the imports made only for type checking, which a type checker and a
reader follow as arrows too. Both ways no arrow points up and there is no
circle; and inside a package of parts no part imports its front
(:data:`FRONTS`), even for a type.

``python tests/test_layers.py`` prints the import graph's figures both ways:
modules, arrows between them, arrows pointing up, circles.
"""

from __future__ import annotations

import ast
import functools
import sys
import tomllib
from pathlib import Path

import pytest

import membackend

ROOT = Path(membackend.__file__).parent

#: bottom up; a module's layer is the longest prefix listed here
LAYERS = [
    ["membackend.types", "membackend._version", "membackend._lazy"],
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
    ["membackend._comfyui"],  # the ComfyUI adapter, inside users' ComfyUI (it imports neither the lab nor the kit)
    ["membackend.lab._replay"],  # the lab: replays, then their pictures, then its builders, suite and timers
    ["membackend.lab._pictures"],
    ["membackend.lab"],
    ["membackend.testing"],  # the conformance kit (its fixtures build on the lab's sessions)
    ["membackend._cli"],
    ["membackend"],  # the package facade: nothing inside may import it
]
#: what the adapter may never import, whatever the order of the rows: it runs inside users' ComfyUI, where
#: neither tooling nor the kit (and its pytest) belongs
NEVER_FROM_THE_ADAPTER = ("membackend.lab", "membackend.testing")
ADAPTER = "membackend._comfyui"
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


def imports_of(path: Path, package: str | None = None, type_only: bool = False) -> list[str]:
    """Every ``membackend`` module ``path`` imports (lazy ones included; ``TYPE_CHECKING`` exempt unless
    ``type_only``). ``package``: the package relative imports start from (default: the file's own, inside
    membackend)."""
    if package is None:
        name = module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    return imports_in(ast.parse(path.read_text()), package, type_only)


def imports_in(tree: ast.AST, package: str, type_only: bool = False) -> list[str]:
    """:func:`imports_of` for a parsed module."""
    skip = set() if type_only else _type_checking_nodes(tree)
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


def all_imports(type_only: bool = False) -> dict[str, list[str]]:
    """Every module of the package and the ``membackend`` modules it imports (a fresh copy the caller may change);
    with ``type_only``, the imports made only for type checking count too."""
    return {module: list(found) for module, found in _parsed_package(type_only)}


#: the two ways the graph is counted: as it runs, and with the imports made for type checking only
WAYS = {"run time": False, "type-only included": True}


@functools.cache
def _parsed_package(type_only: bool = False) -> tuple[tuple[str, tuple[str, ...]], ...]:
    # parsed once per test run: the package's files do not change while its tests run (planted imports are
    # added to a copy of what this returns)
    return tuple((module_name(p), tuple(imports_of(p, type_only=type_only))) for p in sorted(ROOT.rglob("*.py")))


def upward(imports: dict[str, list[str]]) -> list[str]:
    """``mod (layer i) imports imp (layer j)`` for every import of a module above its own layer."""
    return [f"{mod} (layer {layer_of(mod)}) imports {imp} (layer {layer_of(imp)})"
            for mod, imps in imports.items() for imp in imps
            if mod != "membackend" and layer_of(imp) > layer_of(mod)]


def adapter_leaks(imports: dict[str, list[str]]) -> list[str]:
    """``mod imports imp`` for every import of the lab or the kit by a module of the ComfyUI adapter."""
    return [f"{mod} imports {imp}" for mod, imps in imports.items() if _is_under(mod, (ADAPTER,))
            for imp in imps if _is_under(imp, NEVER_FROM_THE_ADAPTER)]


@pytest.mark.parametrize("type_only", WAYS.values(), ids=WAYS.keys())
def test_no_module_imports_one_above_it(type_only):
    assert upward(all_imports(type_only)) == []


def test_a_type_only_import_counts_when_asked():
    """The second way can fail: an import under ``if TYPE_CHECKING:`` is an arrow only when type-only imports
    count."""
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .._manager import X\n")
    assert imports_in(tree, "membackend._backends") == []
    assert imports_in(tree, "membackend._backends", type_only=True) == ["membackend._manager"]


def test_the_adapter_imports_neither_the_lab_nor_the_kit():
    imports = all_imports()
    assert any(_is_under(m, (ADAPTER,)) for m in imports) and adapter_leaks(imports) == []


#: one planted violation per rule of the top floor: (the module planted, its source, the module it reaches)
PLANTED = [
    ("membackend._comfyui._probe", "def f():\n    from ..lab.bench import run_bench\n", "membackend.lab.bench"),
    ("membackend._comfyui._probe", "def f():\n    from ..testing.harness import build_session\n",
     "membackend.testing.harness"),
    ("membackend.lab._replay._probe", "def f():\n    from .._pictures import write_plot\n", "membackend.lab._pictures"),
    ("membackend.lab._pictures._probe", "def f():\n    from ..simulated import simulated_session\n",
     "membackend.lab.simulated"),
    ("membackend.lab._probe", "def f():\n    from ..testing.fixtures import clean_environment\n",
     "membackend.testing.fixtures"),
    ("membackend.testing._probe", "def f():\n    from .._cli import main\n", "membackend._cli"),
]


@pytest.mark.parametrize("module, source, reached", PLANTED, ids=[f"{m.rsplit('.', 1)[0]}->{r}" for m, _, r in PLANTED])
def test_a_planted_import_up_the_top_floor_is_caught(module, source, reached):
    """Each rule of the ordered top floor can fail: a lazy import planted in a module of a lower row (parsed as
    the checker parses the package's files) is an upward import; one from the adapter is also an adapter leak."""
    found = imports_in(ast.parse(source), module.rpartition(".")[0])
    assert found == [reached]
    imports = {**all_imports(), module: found}
    assert [line for line in upward(imports) if line.startswith(module + " ")] == \
        [f"{module} (layer {layer_of(module)}) imports {reached} (layer {layer_of(reached)})"]
    leaks = adapter_leaks(imports)
    assert leaks == ([f"{module} imports {reached}"] if module.startswith(ADAPTER + ".") else [])


def test_the_adapter_rule_holds_whatever_the_order_of_the_rows(monkeypatch):
    """Were the lab put below the adapter, the layer check would let the adapter import it; the adapter rule
    still does not."""
    monkeypatch.setattr(sys.modules[__name__], "LAYERS", [["membackend.lab"], *[r for r in LAYERS
                                                                             if r != ["membackend.lab"]]])
    imports = {**all_imports(), "membackend._comfyui._probe": ["membackend.lab.bench"]}
    assert not [line for line in upward(imports) if line.startswith("membackend._comfyui._probe ")]
    assert adapter_leaks(imports) == ["membackend._comfyui._probe imports membackend.lab.bench"]


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


def module_graph(imports: dict[str, list[str]]) -> dict[str, list[str]]:
    """The arrows between the package's modules: each import resolved to the module it names (``from pkg import
    name`` of a name that is no module is an arrow to ``pkg``), a module's arrows to itself left out."""
    def owner(name: str) -> str:
        while name not in imports and "." in name:
            name = name.rpartition(".")[0]
        return name
    return {mod: sorted({owner(i) for i in imps} - {mod}) for mod, imps in imports.items()}


def figures(imports: dict[str, list[str]]) -> dict[str, int]:
    """The import graph's figures: modules, arrows between them, arrows pointing up a layer, circles."""
    graph = module_graph(imports)
    return {"modules": len(graph), "arrows": sum(len(v) for v in graph.values()),
            "upward": len(upward(graph)), "circles": len(_cycles(graph))}


@pytest.mark.parametrize("type_only", WAYS.values(), ids=WAYS.keys())
def test_the_package_has_no_import_circle(type_only):
    """Lazy imports count; the whole package, its top floor included; type-only imports too, the second way."""
    imports = all_imports(type_only)
    found = figures(imports)
    circles = [" -> ".join(c) for c in _cycles(module_graph(imports))]
    assert found["arrows"] > found["modules"] and found["upward"] == 0 and found["circles"] == 0, (found, circles)


#: each package of parts -> its front, the module that composes the parts; no other module of the package
#: imports it, type-only imports included (the parts receive what they use, they never hold their whole)
FRONTS = {
    "membackend._backends.vmm": "membackend._backends.vmm.backend",
    "membackend._session": "membackend._session.session",
    "membackend._residency": "membackend._residency.manager",
    "membackend._drivers.sim.platform": "membackend._drivers.sim.platform",
}


def front_imports(imports: dict[str, list[str]], fronts: dict[str, str] = FRONTS) -> list[str]:
    """``part imports front`` for every module of a package of :data:`FRONTS` (its ``__init__`` aside, which
    re-exports the front) that imports the package's front."""
    return [f"{mod} imports {imp}" for pkg, front in fronts.items() for mod, imps in imports.items()
            if mod.startswith(pkg + ".") and mod != front for imp in imps
            if imp == front or (front == pkg and imp.startswith(front + ".") and imp.rpartition(".")[2][0].isupper())]


def test_no_part_imports_its_front():
    imports = all_imports(type_only=True)
    assert all(front in imports for front in FRONTS.values()), "a front of FRONTS is no module: out of date"
    assert front_imports(imports) == []


def test_a_part_importing_its_front_is_caught():
    imports = {**all_imports(type_only=True), "membackend._backends.vmm._probe": ["membackend._backends.vmm.backend"]}
    assert front_imports(imports) == ["membackend._backends.vmm._probe imports membackend._backends.vmm.backend"]


def test_no_import_circle_inside_the_comfyui_adapter():
    """Lazy imports count: one module importing another inside a function is still an arrow."""
    pkg = "membackend._comfyui"
    graph = {mod: sorted({i for i in imps if i.startswith(pkg + ".") and i != mod})
             for mod, imps in all_imports().items() if mod.startswith(pkg + ".")}
    assert _cycles(graph) == []
    assert _cycles({"a": ["b"], "b": ["c"], "c": ["a"]}) == [["a", "b", "c"]]  # the check can fail


# --------------------------------------------------------------------------- the plugins

REPO = Path(__file__).resolve().parents[1]
PLUGINS = REPO / "plugins"
#: what a plugin's modules may import: membackend's public face (a plugin's wheel ships its platform only, and a
#: platform needs neither the lab, which may change in any version, nor the kit)
PUBLIC = ("membackend", "membackend.hookspec", "membackend.types", "membackend.platform")
#: what each kind of tool file may import besides the public face: a benchmark (and a workload beside it) the lab,
#: an example the kit and the lab; a name ``membackend`` re-exports counts as public (``from membackend import
#: Session`` is ``membackend.Session``), one starting with ``_`` never does (:func:`is_internal`)
MAY_IMPORT = {"plugins": PUBLIC, "benchmarks": (*PUBLIC, "membackend.lab"),
              "docs": (*PUBLIC, "membackend.testing", "membackend.lab")}
NEVER_FROM_A_PLUGIN = (SIM, "membackend._comfyui", "membackend._cli")


def plugin_imports(path: Path) -> list[str]:
    """Every ``membackend`` import of a plugin module (a plugin's relative imports stay inside it)."""
    return imports_of(path, package="plugin")


def entry_point_modules() -> dict[Path, str]:
    """Each plugin's source file that an entry point in the ``membackend.backends`` group names."""
    return entry_point_modules_under(PLUGINS)


def entry_point_modules_under(plugins: Path) -> dict[Path, str]:
    """:func:`entry_point_modules` of the plugins in the folder ``plugins``."""
    found = {}
    for pyproject in sorted(plugins.glob("*/pyproject.toml")):
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


def _own_imports(path: Path, package: Path) -> set[Path]:
    """The files of the plugin package ``package`` (a folder) that the module at ``path`` imports: relative
    imports, and absolute ones of the package's own name (lazy ones included, ``TYPE_CHECKING`` exempt)."""
    here = path.parent.relative_to(package.parent).parts
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    names: list[tuple[str, ...]] = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names += [tuple(a.name.split(".")) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else ()
            module = (*base, *(node.module.split(".") if node.module else ()))
            names += [module, *((*module, a.name) for a in node.names)]  # an imported name may be a submodule
    found = set()
    for parts in names:
        if parts and parts[0] == package.name:
            found |= {c for c in (package.parent.joinpath(*parts).with_suffix(".py"),
                                  package.parent.joinpath(*parts, "__init__.py")) if c.is_file()}
    return found


def shipped_but_unused(plugins: Path = PLUGINS) -> list[str]:
    """Every module of a plugin's package that its entry point's module does not import (transitively): code the
    wheel ships that the platform does not run (a benchmark's workload belongs beside its benchmark)."""
    unused = []
    for entry in entry_point_modules_under(plugins):
        package = entry.parent
        reached, todo = {entry, package / "__init__.py"}, [entry, package / "__init__.py"]
        while todo:
            for found in _own_imports(todo.pop(), package):
                if found not in reached:
                    reached.add(found)
                    todo.append(found)
        unused += [p.relative_to(plugins).as_posix() for p in sorted(package.rglob("*.py"))
                   if "__pycache__" not in p.parts and p not in reached]
    return unused


def test_a_plugin_wheel_ships_its_platform_only():
    assert shipped_but_unused() == []


def test_the_platform_only_check_can_fail(tmp_path):
    """A workload shipped in a plugin's package and imported by nothing the entry point reaches is caught; a
    helper the entry point imports (relatively or by the package's name, lazily too) is not."""
    package = tmp_path / "acme" / "membackend_acme"
    package.mkdir(parents=True)
    (tmp_path / "acme" / "pyproject.toml").write_text(
        '[project.entry-points."membackend.backends"]\nacme = "membackend_acme:PLATFORM"\n')
    (package / "__init__.py").write_text("from . import probe\ndef budget():\n    import membackend_acme.rules\n")
    for name in ("probe", "rules", "workload"):
        (package / f"{name}.py").write_text("")
    assert shipped_but_unused(tmp_path) == ["acme/membackend_acme/workload.py"]


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


# --------------------------------------------------------------------------- plugins' code, benchmarks, examples


def is_internal(name: str) -> bool:
    """A module (or a name imported from ``membackend``) is internal when a part of its dotted path starts
    with ``_`` (docs/modules.md)."""
    return any(part.startswith("_") for part in name.split("."))


def tool_files(root: Path = REPO) -> list[Path]:
    """Every Python file of a plugin's package (not its tests), of ``benchmarks/`` and of ``docs/examples/``."""
    found = [*root.glob("plugins/*/membackend_*/**/*.py"), *root.glob("benchmarks/**/*.py"),
             *root.glob("docs/examples/**/*.py")]
    return sorted(p for p in found if "__pycache__" not in p.parts)


def tool_imports(path: Path) -> list[str]:
    """:func:`plugin_imports`, and the imports of the Python code ``path`` holds in its strings (the script a
    benchmark runs in a child process with ``python -c CODE``)."""
    found = plugin_imports(path)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "import" in node.value:
            try:
                code = ast.parse(node.value)
            except SyntaxError:  # prose, a shell line: no code
                continue
            found += imports_in(code, "plugin")
    return found


def may_import(name: str, allowed: tuple[str, ...]) -> bool:
    """Whether a tool file that may import the modules ``allowed`` (and their submodules) may import ``name``: a
    module or a name imported from one (``from membackend import Session`` is ``membackend.Session``, a name the
    facade re-exports, allowed where ``membackend`` is; ``from membackend import lab`` is the lab); never one
    with a part starting with ``_``."""
    if is_internal(name):
        return False
    if name in allowed or _is_under(name, tuple(a for a in allowed if a != "membackend")):
        return True
    head, _, last = name.rpartition(".")
    is_module = (ROOT / last).is_dir() or (ROOT / f"{last}.py").is_file()
    return head == "membackend" and "membackend" in allowed and not is_module


def internal_imports(root: Path = REPO) -> list[str]:
    """``path imports module`` for every import, in :func:`tool_files`, of a membackend module or name that is
    internal, or that is not what that kind of file may import (:data:`MAY_IMPORT`, by the file's first
    folder; :func:`may_import`), lazy ones and code in strings included, ``TYPE_CHECKING`` exempt."""
    return [f"{path.relative_to(root).as_posix()} imports {imp}" for path in tool_files(root)
            for imp in tool_imports(path) if not may_import(imp, MAY_IMPORT[path.relative_to(root).parts[0]])]


def test_plugins_benchmarks_and_examples_import_public_names_only():
    """Nothing under ``plugins/*/membackend_*/``, ``benchmarks/`` or ``docs/examples/`` imports an internal
    module; a plugin imports the public face only, a benchmark (or the workload beside it) the lab besides."""
    files = tool_files()
    assert any(p.parts[len(REPO.parts)] == "benchmarks" and p.name.startswith("workload_") for p in files)
    assert any(p.parts[len(REPO.parts)] == "plugins" for p in files)
    assert any(p.parts[len(REPO.parts)] == "docs" for p in files)
    offenders = internal_imports()
    assert offenders == [], "imports a tool may not make (a benchmark: membackend.lab and the public face; a " \
        "plugin: the public face):\n" + "\n".join(offenders)


def test_the_public_names_check_can_fail(tmp_path):
    """An internal import in a plugin module (lazy), the lab or the kit imported by a plugin, the kit by a
    benchmark, an internal import in a benchmark (also in the code of a child process it holds in a string) are
    caught, with their files; one under ``TYPE_CHECKING``, the public ones, the lab in a benchmark and a
    plugin's own tests are not."""
    module = tmp_path / "plugins" / "acme" / "membackend_acme" / "compare.py"
    bench = tmp_path / "benchmarks" / "bench_acme.py"
    example = tmp_path / "docs" / "examples" / "acme" / "membackend_acme.py"
    test = tmp_path / "plugins" / "acme" / "tests" / "test_acme.py"
    for path in (module, bench, example, test):
        path.parent.mkdir(parents=True, exist_ok=True)
    module.write_text("from typing import TYPE_CHECKING\n"
                      "from membackend.lab.simulated import simulated_session\n"
                      "import membackend.testing\n"
                      "from membackend import ResidencyManager, Session, lab\n"
                      "if TYPE_CHECKING:\n    from membackend._ledger import Ledger\n"
                      "def f():\n    from membackend._residency import ResidencyManager\n")
    bench.write_text("import membackend.lab.bench\nfrom membackend.lab import simulated_session\n"
                     "from membackend import _session\nimport membackend.lab._replay.stock\n"
                     "from membackend.testing import build_session\n"
                     'CHILD = """\nimport sys\nfrom membackend._comfyui import vbar\n"""\n'
                     "USAGE = 'python bench_acme.py [--json]: it imports nothing'\n")
    example.write_text("from membackend import hookimpl\nfrom membackend.types import Budget\n"
                       "from membackend.testing import build_session\nfrom membackend.lab import host_session\n")
    test.write_text("from membackend._drivers.sim import sim_driver\n")
    assert internal_imports(tmp_path) == [
        "benchmarks/bench_acme.py imports membackend._session",
        "benchmarks/bench_acme.py imports membackend.lab._replay.stock",
        "benchmarks/bench_acme.py imports membackend.testing",
        "benchmarks/bench_acme.py imports membackend._comfyui",
        "plugins/acme/membackend_acme/compare.py imports membackend.lab.simulated",
        "plugins/acme/membackend_acme/compare.py imports membackend.testing",
        "plugins/acme/membackend_acme/compare.py imports membackend.lab",
        "plugins/acme/membackend_acme/compare.py imports membackend._residency",
    ]
    assert tool_files(tmp_path) == sorted([module, bench, example])


if __name__ == "__main__":
    for way, type_only in WAYS.items():
        print(f"{way}: " + ", ".join(f"{k} {v}" for k, v in figures(all_imports(type_only)).items()))
