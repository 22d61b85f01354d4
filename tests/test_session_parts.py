"""The session as a package of parts (issue 44): small parts composed in one place, none holding the front, one
body per hot verb, one place that computes the headroom, the backend's optional members read once.

These tests hold the shape: every module of ``membackend/_session/`` under 300 lines; no part imports the front
module (``if TYPE_CHECKING:`` imports included); ``fault`` and ``free`` each with one body; one budget query
computing the headroom's precedence once, downward, and the VMM backend's one-pool guard never calling back up.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import membackend._session as pkg
from membackend import hookspec
from membackend._backends.host import HostBackend
from membackend._backends.vmm import VmmBackend
from membackend._drivers.sim import get_profile, sim_driver
from membackend._machine import gather_machine
from membackend._session import Session
from membackend._session.headroom import SessionHeadroom
from membackend._session.members import Members
from membackend.platform import GENERIC, Headroom
from membackend.types import Capabilities, Device

MiB, GiB = 1 << 20, 1 << 30
PACKAGE = Path(pkg.__file__).parent
FRONT = "membackend._session.session"
CUDA0 = Device("cuda", 0)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, relative imports resolved, ``TYPE_CHECKING`` blocks and lazy imports
    included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = "membackend._session".split(".")[: 2 - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.add(module)
            found.update(f"{module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_no_module_of_the_package_passes_300_lines():
    sizes = {p.name: len(p.read_text().splitlines()) for p in PACKAGE.glob("*.py")}
    assert len(sizes) >= 8 and max(sizes.values()) <= 300, sizes


def test_no_part_imports_the_front_not_even_for_a_type():
    parts = [p for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "session.py")]
    assert parts
    offenders = {p.name: sorted(m for m in _imports(p) if m == FRONT or m.startswith(FRONT + "."))
                 for p in parts}
    assert {k: v for k, v in offenders.items() if v} == {}
    assert any(FRONT in m for m in _imports(PACKAGE / "__init__.py")), "the scan resolves relative imports"


def test_the_front_module_is_the_only_one_that_names_the_session_class():
    for p in PACKAGE.glob("*.py"):
        classes = {n.name for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.ClassDef)}
        assert ("Session" in classes) == (p.name == "session.py"), p.name


def _functions_named(name: str) -> list[str]:
    return [f"{p.name}:{n.lineno}" for p in PACKAGE.glob("*.py") for n in ast.walk(ast.parse(p.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name]


@pytest.mark.parametrize("verb", ["fault", "free"])
def test_each_hot_verb_has_one_body(verb):
    assert len(_functions_named(verb)) == 1 and _functions_named(verb)[0].startswith("hot.py:"), \
        _functions_named(verb)
    assert verb not in Session.__dict__, "the class declares the attribute only (no shell method)"
    assert verb in Session.__annotations__, "readers and type checkers find it declared on the class"
    s = Session(HostBackend(), machine=gather_machine())
    assert s.__dict__[verb] is getattr(s._parts, verb), "the instance holds the one closure"
    s.close()


def test_the_hot_verbs_checks_stand_once():
    text = {p.name: p.read_text() for p in PACKAGE.glob("*.py")}
    for needle in ("take the permit, inlined", "must start on a page boundary"):
        assert [n for n, t in text.items() if needle in t] == ["hot.py"], needle


def test_an_observer_rebinds_the_one_body():
    s = Session(HostBackend(), machine=gather_machine())
    before = s.fault
    s.add_observer(type("Nothing", (), {})())
    assert s.fault is not before and s.fault is s._parts.fault
    r = s.reserve("cpu", 4 * MiB)
    assert s.fault(r, 0, MiB).ok and s.free(r) == s.page_size("cpu")
    s.close()


# --------------------------------------------------------------------------- one headroom, handed down


def _vmm(profile: str = "h200", budget_source: str = "device", **caps) -> VmmBackend:
    platform = dataclasses.replace(GENERIC, budget_source=budget_source, page_size=2 * MiB)
    return VmmBackend(platform, sim_driver(get_profile(profile)), capabilities=Capabilities(**caps))


@pytest.fixture
def computed(monkeypatch):
    """Counts each computation of the headroom's precedence (``Headroom.in_force``)."""
    calls = []
    real = Headroom.in_force

    def spy(self, total, reported=0, *, flags=True):
        calls.append((self.device, flags))
        return real(self, total, reported, flags=flags)

    monkeypatch.setattr(Headroom, "in_force", spy)
    return calls


@pytest.mark.parametrize("make", [_vmm, HostBackend], ids=["vmm", "host"])
def test_one_budget_query_computes_the_headroom_once(make, computed):
    backend = make()
    s = Session(backend, machine=gather_machine())
    device = CUDA0 if isinstance(backend, VmmBackend) else Device("cpu", 0)
    s.budget_query(device)
    assert computed == [(device, True)]
    s.set_headroom(device, 256 * MiB)
    computed.clear()
    assert s.budget_query(device).headroom == 256 * MiB and len(computed) == 1
    s.close()


def test_the_vmm_backend_reads_the_handed_down_headroom_and_never_calls_back_up(computed, monkeypatch):
    assert not hasattr(VmmBackend, "follow_headroom") and hasattr(VmmBackend, "use_headroom")
    backend = _vmm("gb10-128gb", "unified", unified_pool=True)
    s = Session(backend, machine=gather_machine())
    assert backend._headrooms is s.headrooms and s.headrooms.followed
    for name in ("budget_query", "free_for_host", "in_force", "set"):  # the session's side is not asked
        monkeypatch.setattr(SessionHeadroom, name, lambda *a, **k: pytest.fail("called back up"))
    r = s.reserve(CUDA0, 8 * MiB)
    computed.clear()
    assert s.fault(r, 0, 8 * MiB).ok  # a cold fault: the one-pool guard reads the device's Headroom
    assert computed and set(computed) == {(CUDA0, True)}
    monkeypatch.undo()
    s.close()
    assert backend._headrooms is None and not s.headrooms.followed, "a closed session hands nothing down"


def test_a_later_session_on_the_backend_is_followed_and_the_earlier_computes_its_own():
    backend = _vmm()
    first = Session(backend, machine=gather_machine())
    second = Session(backend, machine=gather_machine())
    assert backend._headrooms is second.headrooms and not first.headrooms.followed
    first.set_headroom(CUDA0, 300 * MiB)
    assert first.budget_query(CUDA0).headroom == 300 * MiB != second.budget_query(CUDA0).headroom
    first.close()
    assert backend._headrooms is second.headrooms, "closing the earlier one leaves the later one followed"
    second.close()


def test_a_backend_with_follow_headroom_still_gets_a_decision_for_one_release():
    class Older(HostBackend):
        def __init__(self):
            super().__init__()
            self.decide = None

        def follow_headroom(self, decide, instead_of=None):
            if instead_of is None or self.decide is instead_of:
                self.decide = decide

    backend = Older()
    s = Session(backend, machine=gather_machine(), headroom=64 * MiB)
    assert backend.decide(Device("cpu", 0), GiB) == 64 * MiB
    s.close()
    assert backend.decide is None


# --------------------------------------------------------------------------- the optional members, read once


def test_the_members_table_reads_each_optional_member_once_with_its_default():
    names = {f.name for f in dataclasses.fields(Members)}
    assert names <= set(hookspec.OPTIONAL_MEMBERS) | {"device_kinds"}
    host = Members.read(HostBackend())
    assert host.room_split is None and host.own_headroom is not None and host.page_size > 0
    vmm = Members.read(_vmm())
    assert vmm.use_headroom is not None and vmm.kept_windows is not None and vmm.page_size == 2 * MiB


def test_a_member_that_breaks_its_contract_reads_as_its_default(caplog):
    class Odd(HostBackend):
        room_split = "not callable"

    odd = Odd()
    odd.page_size = -1
    m = Members.read(odd)
    assert m.room_split is None and m.page_size == 2 * MiB
    assert "room_split" in caplog.text and "page_size" in caplog.text


def test_the_cli_and_the_status_read_the_table_not_the_backend():
    root = PACKAGE.parent
    for path in (root / "_cli.py", root / "_comfyui" / "status.py"):
        assert "getattr(session.backend" not in path.read_text(), path
