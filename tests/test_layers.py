"""The import arrows point down the layers (docs/architecture.md), checked on the source itself.

Every ``import`` in every module of the package is resolved, lazy imports
inside functions included (only ``if TYPE_CHECKING:`` blocks are exempt), and
compared with the layer table below: a module may import its own layer or
lower ones. Only the driver opener and the simulation itself may import the
simulation.

The platform plugins under ``plugins/`` sit above the core, as a third party's
would: the module an entry point names imports membackend's public face only
(``membackend``, ``hookspec``, ``types``, ``platform``); their other modules
(workloads and comparisons for the benchmarks), the scripts in ``benchmarks/``
and the documentation's examples under ``docs/examples/`` may import the kit
(``membackend.testing``, whose ``simulated`` and ``real`` modules build their
sessions) and ``membackend.bench`` besides, but nothing internal (no module
with a part starting with ``_``); the core never imports a plugin. Tests, the
plugins' (``plugins/*/tests/``) and membackend's (``tests/``), may use the
internals.
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
    ["membackend._comfyui", "membackend._replay", "membackend._pictures", "membackend.testing", "membackend.bench",
     "membackend._cli"],
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
    return imports_in(ast.parse(path.read_text()), package)


def imports_in(tree: ast.AST, package: str) -> list[str]:
    """:func:`imports_of` for a parsed module."""
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

REPO = Path(__file__).resolve().parents[1]
PLUGINS = REPO / "plugins"
#: what the module an entry point names may import: membackend's public face for a backend at run time
PUBLIC = ("membackend", "membackend.hookspec", "membackend.types", "membackend.platform")
#: what a plugin's other modules, a benchmark and an example may import besides: the kit (with its submodules)
#: and the benchmark suite; a name ``membackend`` re-exports counts as public (``from membackend import Session``
#: is ``membackend.Session``), one starting with ``_`` never does (:func:`is_internal`)
PUBLIC_FOR_TOOLS = (*PUBLIC, "membackend.testing", "membackend.bench")
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


def internal_imports(root: Path = REPO) -> list[str]:
    """``path imports module`` for every import of a membackend module or name that is not public, or that is
    not under :data:`PUBLIC_FOR_TOOLS`, in :func:`tool_files` (lazy ones and code in strings included,
    ``TYPE_CHECKING`` exempt)."""
    return [f"{path.relative_to(root).as_posix()} imports {imp}" for path in tool_files(root)
            for imp in tool_imports(path) if is_internal(imp) or not _is_under(imp, PUBLIC_FOR_TOOLS)]


def test_plugins_benchmarks_and_examples_import_public_names_only():
    """Nothing under ``plugins/*/membackend_*/``, ``benchmarks/`` or ``docs/examples/`` imports an internal
    module; what a plugin's comparison or a benchmark needs comes from ``membackend.testing`` (``simulated``,
    ``real``) or ``membackend.bench``."""
    files = tool_files()
    assert any(p.parts[len(REPO.parts)] == "benchmarks" for p in files)
    assert any(p.parts[len(REPO.parts)] == "plugins" and p.name != "__init__.py" for p in files)
    assert any(p.parts[len(REPO.parts)] == "docs" for p in files)
    offenders = internal_imports()
    assert offenders == [], "internal imports (use membackend.testing.simulated / .real or membackend.bench):\n" \
        + "\n".join(offenders)


def test_the_public_names_check_can_fail(tmp_path):
    """An internal import in a plugin module (lazy) and in a benchmark (also in the code of a child process it
    holds in a string) is caught, with its file; one under ``TYPE_CHECKING``, the public ones and a plugin's
    own tests are not."""
    module = tmp_path / "plugins" / "acme" / "membackend_acme" / "compare.py"
    bench = tmp_path / "benchmarks" / "bench_acme.py"
    example = tmp_path / "docs" / "examples" / "acme" / "membackend_acme.py"
    test = tmp_path / "plugins" / "acme" / "tests" / "test_acme.py"
    for path in (module, bench, example, test):
        path.parent.mkdir(parents=True, exist_ok=True)
    module.write_text("from typing import TYPE_CHECKING\n"
                      "from membackend.testing.simulated import simulated_session\n"
                      "from membackend import ResidencyManager, Session\n"
                      "if TYPE_CHECKING:\n    from membackend._ledger import Ledger\n"
                      "def f():\n    from membackend._residency import ResidencyManager\n")
    bench.write_text("import membackend.bench\nfrom membackend import _session\nimport membackend._replay.stock\n"
                     'CHILD = """\nimport sys\nfrom membackend._replay.compare import replay\n"""\n'
                     "USAGE = 'python bench_acme.py [--json]: it imports nothing'\n")
    example.write_text("from membackend import hookimpl\nfrom membackend.types import Budget\n")
    test.write_text("from membackend._drivers.sim import sim_driver\n")
    assert internal_imports(tmp_path) == [
        "benchmarks/bench_acme.py imports membackend._session",
        "benchmarks/bench_acme.py imports membackend._replay.stock",
        "benchmarks/bench_acme.py imports membackend._replay.compare",
        "plugins/acme/membackend_acme/compare.py imports membackend._residency",
    ]
    assert tool_files(tmp_path) == sorted([module, bench, example])
