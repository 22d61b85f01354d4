"""docs/architecture.md against the code, as tests/test_modules_map.py holds docs/modules.md.

Its table "Layers, bottom up" is ``LAYERS`` of tests/test_layers.py (the layers that test enforces on
every import): one row per layer, in the same order, naming exactly that layer's modules and packages
by their real paths under ``membackend/``; every module of the package is in a row; and each row's
imports column names exactly what the row's modules import from the rows above it. Every other
module path the page names (backticked ``membackend/...``, ``_x/y.py``, ``x.py``, or a path of the
repository such as ``tests/...``) exists.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import membackend

PACKAGE = Path(membackend.__file__).resolve().parent
ROOT = PACKAGE.parent
DOC = ROOT / "docs" / "architecture.md"
SECTION = "## Layers, bottom up"
#: folders of the repository whose paths the page may name (checked from the repository's root)
REPO_FOLDERS = ("membackend/", "tests/", "docs/", "plugins/", "scripts/", "benchmarks/")
_CELL = re.compile(r"(?<!\\)\|")
_TICKED = re.compile(r"`([^`\s]+)`")
_PATH = re.compile(r"^[\w.*-]+(/[\w.*-]+)*/?$")


def _load_layer_test():
    """tests/test_layers.py, loaded by its path (tests/ is no package), for its ``LAYERS`` and ``all_imports``."""
    path = Path(__file__).resolve().with_name("test_layers.py")
    spec = importlib.util.spec_from_file_location("_layer_test_for_the_architecture_doc", path)
    assert spec and spec.loader, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_LAYER_TEST = _load_layer_test()


def layer_table(text: str) -> list[tuple[str, list[str], list[str]]]:
    """The rows of the section's table: (its layer column, the paths of its modules column, the names of its
    imports column); an empty list when the page has no such section or table."""
    if SECTION not in text:
        return []
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    lines = [ln.strip() for ln in section.splitlines() if ln.strip().startswith("|")]
    rows = []
    for line in lines[2:]:  # the header and the separator
        cells = [c.strip() for c in _CELL.split(line.strip("|"))]
        if len(cells) < 4:
            rows.append((cells[0] if cells else "", [], []))
            continue
        rows.append((cells[0], _TICKED.findall(cells[1]), _TICKED.findall(cells[-1])))
    return rows


def dotted(path: str) -> str:
    """``membackend/_settings/`` -> ``membackend._settings``; ``membackend/__init__.py`` -> ``membackend``."""
    parts = path.rstrip("/").removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _longest(name: str, entries: dict[str, int]) -> str | None:
    """The entry of ``entries`` that is the longest dotted prefix of ``name``."""
    found = [e for e in entries if name == e or name.startswith(e + ".")]
    return max(found, key=len) if found else None


def package_modules(root: Path = ROOT) -> list[str]:
    """Every module file of the package under ``root``, as ``membackend/...py``."""
    return sorted(p.relative_to(root).as_posix() for p in (root / "membackend").rglob("*.py")
                  if "__pycache__" not in p.parts)


def problems(text: str, layers: list[list[str]], imports: dict[str, list[str]], root: Path = ROOT) -> list[str]:
    """Everything the layer table of ``text`` gets wrong about ``layers`` (bottom up), the package under
    ``root`` and what its modules ``imports`` (dotted module -> the dotted modules it imports)."""
    rows = layer_table(text)
    if not rows:
        return [f"no table under {SECTION!r}"]
    wrong = []
    if len(rows) != len(layers):
        wrong.append(f"the table has {len(rows)} rows, LAYERS has {len(layers)} layers")
    rank = {name: i for i, names in enumerate(layers) for name in names}
    for i, ((number, paths, _), names) in enumerate(zip(rows, layers)):
        if number != str(i + 1):
            wrong.append(f"row {i + 1}: its layer column says {number!r}")
        named = {dotted(p): p for p in paths if p.startswith("membackend/")}
        wrong += [f"row {i + 1}: {p} is not a path under membackend/" for p in paths if not p.startswith("membackend/")]
        wrong += [f"row {i + 1}: LAYERS puts {n} in layer {i + 1}, the row does not name it"
                  for n in names if n not in named]
        for name, path in named.items():
            if name in names:
                continue
            owner = _longest(name, rank)
            if owner is None:
                wrong.append(f"row {i + 1}: {path} is in no layer of LAYERS")
            elif rank[owner] != i:
                wrong.append(f"row {i + 1}: {path} is in layer {rank[owner] + 1} of LAYERS (as {owner})")
    for i, (_, paths, _) in enumerate(rows):
        for p in paths:
            target = root / p
            if p.startswith("membackend/") and not (target.is_dir() if p.endswith("/") else target.is_file()):
                wrong.append(f"row {i + 1}: {p} does not exist")
    # each module's row: the row of the most specific path naming it (a file itself, or a folder holding it)
    entries: dict[str, int] = {}
    for i, (_, paths, _) in enumerate(rows):
        for p in paths:
            if p.startswith("membackend/") and dotted(p) in entries and entries[dotted(p)] != i:
                wrong.append(f"{p} is named in rows {entries[dotted(p)] + 1} and {i + 1}")
            elif p.startswith("membackend/"):
                entries[dotted(p)] = i
    modules = package_modules(root)
    named_paths = [p for _, paths, _ in rows for p in paths]
    covered = {m for m in modules for p in named_paths if m == p or (p.endswith("/") and m.startswith(p))}
    wrong += [f"{m} is in no row of the layer table" for m in modules if m not in covered]
    # the imports column: exactly what the row's modules import from the rows above
    for i, (_, _, column) in enumerate(rows):
        said = set() if column in ([], ["nothing"]) else set(column)
        does: dict[str, str] = {}
        for module in (dotted(m) for m in modules):
            home = _longest(module, entries)
            if home is None or entries[home] != i:
                continue
            for imp in imports.get(module, []):
                owner = _longest(imp, entries)
                if owner is not None and entries[owner] < i:
                    does.setdefault(owner.removeprefix("membackend."), f"{module} imports {imp}")
        for name in sorted(said - set(does)):
            owner = f"membackend.{name}"
            if owner not in entries:
                wrong.append(f"row {i + 1}: its imports column names {name}, which no row names")
            elif entries[owner] >= i:
                wrong.append(f"row {i + 1}: its imports column names {name}, which is not in a row above")
            else:
                wrong.append(f"row {i + 1}: its imports column names {name}, which no module of the row imports")
        wrong += [f"row {i + 1}: its imports column leaves out {name} ({why})"
                  for name, why in sorted(does.items()) if name not in said]
    return wrong


def _exists(path: str, root: Path) -> bool:
    """A path of the repository (``tests/x.py``, ``plugins/*/``), or one under membackend/ given from any of its
    folders (``_replay/stock.py``, ``sim/memory.py``, ``vbar.py``)."""
    if path.startswith(REPO_FOLDERS):
        return any(root.glob(path.rstrip("/"))) if "*" in path else (root / path).exists()
    tail = tuple(path.rstrip("/").split("/"))
    return any(p.relative_to(root).parts[-len(tail):] == tail for p in (root / "membackend").rglob("*")
               if "__pycache__" not in p.parts)


def missing_paths(text: str, root: Path = ROOT) -> list[str]:
    """Every module path ``text`` names in backticks that does not exist: ``membackend/...``, a path in one of
    the repository's folders, ``_x/...`` and any ``....py``."""
    named = sorted({t for t in _TICKED.findall(text) if _PATH.match(t) and (
        t.startswith(REPO_FOLDERS) or t.endswith(".py") or (t.startswith("_") and "/" in t))})
    return [f"{t} is named in {DOC.name} but does not exist" for t in named if not _exists(t, root)]


def test_the_layer_table_is_the_layers_the_layer_test_enforces():
    assert problems(DOC.read_text(), _LAYER_TEST.LAYERS, _LAYER_TEST.all_imports()) == []


def test_every_module_path_the_page_names_exists():
    assert missing_paths(DOC.read_text()) == []


def test_each_rule_can_fail(tmp_path):
    """A doctored table over a made-up package: every kind of mistake is reported."""
    for name in ("__init__.py", "types.py", "_a.py", "_b/__init__.py", "_b/x.py", "_orphan.py"):
        (tmp_path / "membackend" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "membackend" / name).write_text("")
    layers = [["membackend.types"], ["membackend._a", "membackend._b"], ["membackend._c"], ["membackend"]]
    imports = {"membackend._a": ["membackend.types"], "membackend._b.x": ["membackend._a", "membackend.types"],
               "membackend": ["membackend._b.x"]}
    text = f"""# x

{SECTION}

| layer | modules | role | imports |
|---|---|---|---|
| 1 | `membackend/types.py` | the types | nothing |
| 2 | `membackend/_a.py` | a row missing _b, naming its own row | `types`, `_a` |
| 4 | `membackend/_b/`, `membackend/_gone.py`, `x/y.py` | the wrong row | `types`, `_c` |
| 4 | `membackend/__init__.py` | the facade | `_b` |
| 5 | `membackend/types.py` | one row too many, naming a path twice | nothing |

## next
"""
    found = problems(text, layers, imports, tmp_path)
    expected = [
        "the table has 5 rows, LAYERS has 4 layers",
        "row 2: LAYERS puts membackend._b in layer 2, the row does not name it",
        "row 2: its imports column names _a, which is not in a row above",
        "row 3: its layer column says '4'",
        "row 3: x/y.py is not a path under membackend/",
        "row 3: LAYERS puts membackend._c in layer 3, the row does not name it",
        "row 3: membackend/_b/ is in layer 2 of LAYERS (as membackend._b)",
        "row 3: membackend/_gone.py is in layer 4 of LAYERS (as membackend)",
        "row 3: membackend/_gone.py does not exist",
        "row 3: its imports column names _c, which no row names",
        "row 3: its imports column leaves out _a (membackend._b.x imports membackend._a)",
        "membackend/types.py is named in rows 1 and 5",
        "membackend/_orphan.py is in no row of the layer table",
    ]
    assert sorted(found) == sorted(expected), found
    assert problems("no table here", layers, imports, tmp_path) == [f"no table under {SECTION!r}"]


def test_the_real_page_doctored_fails():
    """The page itself with two rows swapped and a module renamed back to its old name is caught."""
    text = DOC.read_text()
    before = set(problems(text, _LAYER_TEST.LAYERS, _LAYER_TEST.all_imports()))
    first = "| 1 | `membackend/types.py`, `membackend/_version.py`, `membackend/_lazy.py` |"
    second = "| 2 | `membackend/hookspec.py` |"
    doctored = text.replace(first, "| 1 | `membackend/hookspec.py` |")
    doctored = doctored.replace(second, "| 2 | `membackend/types.py`, `membackend/_version.py`, `membackend/_lazy.py` |")
    doctored = doctored.replace("`membackend/_settings/`", "`membackend/settings.py`")
    assert doctored != text
    after = set(problems(doctored, _LAYER_TEST.LAYERS, _LAYER_TEST.all_imports())) - before
    assert "row 1: LAYERS puts membackend.types in layer 1, the row does not name it" in after, after
    assert "row 3: membackend/settings.py does not exist" in after, after
    assert "membackend/_settings/rules.py is in no row of the layer table" in after, after
    assert "settings.py is named in architecture.md but does not exist" not in missing_paths(text)
    assert "membackend/settings.py is named in architecture.md but does not exist" in missing_paths(doctored)


def test_the_path_check_can_fail(tmp_path):
    (tmp_path / "membackend" / "_replay").mkdir(parents=True)
    (tmp_path / "membackend" / "_replay" / "stock.py").write_text("")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("")
    text = ("`_replay/stock.py`, `stock.py`, `membackend/_replay/`, `tests/test_x.py`, `tests/*.py` exist; "
            "`residency.py`, `membackend/_gone/`, `_replay/plot.py`, `tests/test_y.py` do not; "
            "`custom_nodes/membackend/`, `membackend.toml`, `a b.py` are no module paths")
    gone = ("_replay/plot.py", "membackend/_gone/", "residency.py", "tests/test_y.py")
    assert missing_paths(text, tmp_path) == [f"{t} is named in architecture.md but does not exist" for t in gone]
