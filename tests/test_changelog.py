"""CHANGELOG.md's promise names the public names it covers, and they are the code's: the package facade's own
names, the modules whose ``__all__`` it covers, the kit's names exactly; every public module of the package is
either under the promise or named as not covered (the lab, tooling)."""

from __future__ import annotations

import re
from pathlib import Path

import membackend
import membackend.testing
from membackend import types

ROOT = Path(membackend.__file__).resolve().parent.parent
START, END = "**The promise.**", "\n## "
_TICKED = re.compile(r"`([^`]+)`")


def promise(text: str) -> tuple[dict[str, list[str]], list[str]]:
    """The promise's bullets (the module ticked first -> the names ticked after its ``:``, up to ``, its pytest
    options`` or ``, and the names``), and the modules the "Not covered" paragraph names."""
    block = text.split(START, 1)[1].split(END, 1)[0]
    covered_part, _, rest = block.partition("Not covered")
    bullets = {}
    for item in re.split(r"\n- ", covered_part)[1:]:
        item = " ".join(item.split())
        head, _, names = item.partition(":")
        bullets[_TICKED.findall(head)[0]] = _TICKED.findall(names.split(", its pytest options")[0].split(", and the names")[0])
    return bullets, [t for t in _TICKED.findall(rest) if t.startswith("membackend")]


def public_modules() -> set[str]:
    """The package's public modules one level down (``membackend.X`` with no ``_``), and the facade."""
    pkg = Path(membackend.__file__).parent
    found = {"membackend"}
    for p in pkg.iterdir():
        name = p.name.removesuffix(".py")
        if not name.startswith("_") and (p.suffix == ".py" or (p / "__init__.py").exists()):
            found.add(f"membackend.{name}")
    return found


def test_the_promise_names_every_public_module_as_covered_or_not():
    bullets, not_covered = promise((ROOT / "CHANGELOG.md").read_text())
    assert set(bullets) | set(not_covered) == public_modules()
    assert not set(bullets) & set(not_covered)
    assert "membackend.lab" in not_covered


def test_the_names_it_lists_are_the_codes():
    bullets, _ = promise((ROOT / "CHANGELOG.md").read_text())
    own = [n for n in membackend.__all__ if n not in types.__all__]
    assert sorted(bullets["membackend"][: len(own)]) == sorted(own), bullets["membackend"]
    assert bullets["membackend.testing"] == membackend.testing.__all__
    for module in ("membackend.types", "membackend.hookspec", "membackend.platform"):
        mod = __import__(module, fromlist=["__all__"])
        said = [n for n in bullets[module] if n != "__all__"]  # "every name in its `__all__`", then examples
        assert bullets[module][:1] == ["__all__"] and said and all(n in mod.__all__ for n in said), bullets[module]


def test_the_check_can_fail():
    """A promise that lists a name the kit lost, or leaves a public module unsaid, is caught."""
    text = (f"{START} x\n\n- `membackend.testing`: `Target`, `simulated_session`, its pytest options\n"
            "- `membackend`: `create_session`\n\nNot covered: nothing.\n")
    bullets, not_covered = promise(text)
    assert bullets["membackend.testing"] != membackend.testing.__all__
    assert set(bullets) | set(not_covered) != public_modules()
