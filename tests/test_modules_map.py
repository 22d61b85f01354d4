"""docs/modules.md against the package and tests/: every module is on it once, marked public exactly when no
part of its path starts with ``_``, with test files that exist, its conventional test file (where there is
one) listed first, and every test file of tests/ named somewhere on the page."""

from __future__ import annotations

import re
from pathlib import Path

import membackend

PACKAGE = Path(membackend.__file__).resolve().parent
ROOT = PACKAGE.parent
MAP = ROOT / "docs" / "modules.md"
ROW = re.compile(r"^\|\s*`(membackend/[^`]+\.py)`\s*\|([^|]*)\|(.*)\|\s*$")
TEST_PATH = re.compile(r"`(tests/[^`]+)`")


def modules(package: Path = PACKAGE) -> list[str]:
    """Every module file of the package, as ``membackend/...py``."""
    return sorted(str(p.relative_to(package.parent)) for p in package.rglob("*.py") if "__pycache__" not in p.parts)


def rows(text: str) -> dict[str, tuple[str, list[str]]]:
    """The map's rows: module -> (its import column, the test paths in its test column); a module listed
    twice raises, naming it."""
    found: dict[str, tuple[str, list[str]]] = {}
    for line in text.splitlines():
        m = ROW.match(line)
        if m:
            module, access, tests = m.group(1), m.group(2).strip(), TEST_PATH.findall(m.group(3))
            assert module not in found, f"{module} is listed twice in {MAP.name}"
            found[module] = (access, tests)
    return found


def is_public(module: str) -> bool:
    """Public exactly when no part of the path below ``membackend/`` starts with ``_`` (``__init__`` aside)."""
    parts = module.split("/")[1:]
    return not any(part.startswith("_") and part != "__init__.py" for part in parts)


def conventional_test(module: str) -> str:
    """``membackend/_P/M.py`` -> ``tests/test_P_M.py``; a package's ``__init__.py`` -> ``tests/test_P.py``;
    ``membackend/__init__.py`` -> ``tests/test_membackend.py``."""
    parts = [p.removesuffix(".py") for p in module.split("/")[1:]]
    if parts[-1] == "__init__":
        parts.pop()
    return f"tests/test_{'_'.join(p.lstrip('_') for p in parts) or 'membackend'}.py"


def problems(text: str, package_modules: list[str], root: Path = ROOT) -> list[str]:
    """Everything wrong with map ``text`` for these modules and the files under ``root``."""
    found = rows(text)
    wrong = [f"{m} is not in {MAP.name}" for m in package_modules if m not in found]
    wrong += [f"{m} is in {MAP.name} but is no module of the package" for m in found if m not in package_modules]
    for module, (access, tests) in found.items():
        kind = access.split(":")[0].split(" ")[0].lower()
        if kind not in ("public", "internal"):
            wrong.append(f"{module}: import column {access!r} says neither public nor internal")
        elif (kind == "public") != is_public(module):
            wrong.append(f"{module} is marked {kind} but its path {'has no' if is_public(module) else 'has a'} "
                         f"part starting with '_'")
        if not tests:
            wrong.append(f"{module}: no test file listed")
        wrong += [f"{module}: listed test {t} does not exist" for t in tests if not (root / t).exists()]
        expected = conventional_test(module)
        if (root / expected).exists() and tests[:1] != [expected]:
            wrong.append(f"{module}: its conventional test {expected} exists but is not listed first")
    named = set(TEST_PATH.findall(text))
    suites = sorted(str(p.relative_to(root)) for p in (root / "tests").glob("test_*.py"))
    suites += [f"{p.relative_to(root)}/" for p in (root / "tests").iterdir()
               if p.is_dir() and any(p.glob("test_*.py"))]
    wrong += [f"{t} is named nowhere in {MAP.name} (list it under a module or the cross-cutting suites)"
              for t in suites if t not in named]
    return wrong


def test_the_map_lists_every_module_with_its_access_and_existing_tests():
    assert problems(MAP.read_text(), modules()) == []


def test_the_conventional_names():
    assert conventional_test("membackend/_backends/host.py") == "tests/test_backends_host.py"
    assert conventional_test("membackend/_drivers/sim/profiles.py") == "tests/test_drivers_sim_profiles.py"
    assert conventional_test("membackend/_session.py") == "tests/test_session.py"
    assert conventional_test("membackend/platform.py") == "tests/test_platform.py"
    assert conventional_test("membackend/lab/_replay/__init__.py") == "tests/test_lab_replay.py"
    assert conventional_test("membackend/testing/fixtures.py") == "tests/test_testing_fixtures.py"
    assert conventional_test("membackend/__init__.py") == "tests/test_membackend.py"
    assert [is_public(m) for m in ("membackend/__init__.py", "membackend/testing/harness.py",
                                   "membackend/_drivers/sim/__init__.py", "membackend/_version.py")] \
        == [True, True, False, False]


def test_each_rule_can_fail(tmp_path):
    """A map with each kind of mistake, over a made-up package and tests folder: every one is reported."""
    (tmp_path / "tests" / "deep").mkdir(parents=True)
    for name in ("test_a.py", "test_b.py", "test_orphan.py", "deep/test_x.py"):
        (tmp_path / "tests" / name).write_text("")
    package = ["membackend/_a.py", "membackend/_b.py", "membackend/pub.py", "membackend/_missing.py"]
    text = "\n".join([
        "| module | import | test |",
        "|---|---|---|",
        "| `membackend/_a.py` | public | `tests/test_a.py` |",  # internal module marked public
        "| `membackend/_b.py` | internal | `tests/test_gone.py`, `tests/test_b.py` |",  # missing file, not first
        "| `membackend/pub.py` | internal | `tests/test_a.py` |",  # public module marked internal
        "| `membackend/_stale.py` | internal | `tests/test_a.py` |",  # no such module
        "| `tests/deep/` | x |",
    ])
    found = problems(text, package, tmp_path)
    expected = [
        "membackend/_missing.py is not in modules.md",
        "membackend/_stale.py is in modules.md but is no module of the package",
        "membackend/_a.py is marked public but its path has a part starting with '_'",
        "membackend/_b.py: listed test tests/test_gone.py does not exist",
        "membackend/_b.py: its conventional test tests/test_b.py exists but is not listed first",
        "membackend/pub.py is marked internal but its path has no part starting with '_'",
        "tests/test_orphan.py is named nowhere in modules.md (list it under a module or the cross-cutting suites)",
    ]
    assert sorted(found) == sorted(expected), found
