"""The simulated platform's parts: ``SimPlatform`` is a front over small parts built in one place.

These tests hold the shape: every module of ``membackend/_drivers/sim/platform/`` to 300 lines, no part
importing the front or holding it, the parts built only by ``parts.build_parts``, each call of the front bound
once to its part (no layer between a driver call and the part that answers it), and the front's surface (the
calls and the values the drivers, tests and benchmarks use) with its values read and written on the parts.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

from membackend._drivers.sim import platform as front
from membackend._drivers.sim.platform import SimError, SimPlatform, SimulatedCrash, parts

PACKAGE = Path(front.__file__).parent
FRONT = "membackend._drivers.sim.platform"
#: modules that import the front: a part importing any of them would hold the front's module
IMPORT_THE_FRONT = {FRONT, "membackend._drivers.sim", "membackend._drivers.sim.api", "membackend._drivers.sim.cuda",
                    "membackend._drivers.sim.hip"}
PART_MODULES = sorted(p for p in PACKAGE.glob("*.py") if p.name != "__init__.py")

#: what callers reach on a SimPlatform (cuda.py, hip.py, the simulated driver, the lab, tests, benchmarks)
CALLS = ["address_free", "address_reserve", "advance", "amdgpu_sysfs", "copy_async", "copy_sync", "create",
         "descriptors_held", "device_synchronize", "event_create", "event_destroy", "event_query", "event_record",
         "event_synchronize", "host_alloc", "host_free", "host_register", "host_unregister", "init", "inject",
         "launch", "luid", "map", "mem_get_info", "meminfo", "pci_location", "pinned_alloc", "pinned_free",
         "primary_release", "primary_retain", "process_alloc", "process_bytes", "process_free", "quota_used", "read",
         "release", "require_context", "set_access", "set_current", "set_current_context", "shed_memory", "state",
         "stream_create", "stream_synchronize", "unmap", "wddm_budget", "_device"]
VALUES = ["bugchecks", "churn_frees", "clock", "crashes", "current", "current_context", "descriptor_refusals",
          "devices", "events", "faults", "handles", "held_released", "host_registered", "host_used",
          "illegal_addresses", "initialized", "lock", "mappings", "memory", "ops", "page_cache", "private_commit",
          "process_allocs", "profile", "reservations", "spilled_bytes", "streams", "use_after_free", "va_space"]


def imported(path: Path) -> set[str]:
    """The absolute names of the modules ``path`` (a module of the platform package) imports."""
    here = f"{FRONT}.{path.stem}".split(".")
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = here[:-node.level] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)  # `from . import x` imports .x
    return names


def test_no_module_of_the_platform_passes_300_lines():
    sizes = {p.name: len(p.read_text().splitlines()) for p in PACKAGE.glob("*.py")}
    assert "__init__.py" in sizes and len(sizes) > 5, sizes
    assert max(sizes.values()) <= 300, sizes


@pytest.mark.parametrize("path", PART_MODULES, ids=lambda p: p.name)
def test_no_part_imports_the_front(path):
    assert not imported(path) & IMPORT_THE_FRONT, f"{path.name} imports the front's module"


def test_the_parts_are_built_in_one_place():
    part_types = {f.type for f in dataclasses.fields(parts.Parts)} | {"SimState", "Parts"}
    builders = {}
    for path in PACKAGE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in part_types:
                builders.setdefault(node.func.id, set()).add(path.name)
    assert builders.keys() == part_types and all(where == {"parts.py"} for where in builders.values()), builders
    assert "build_parts(" in inspect.getsource(SimPlatform.__init__), "the front builds its parts there only"


def test_no_part_holds_the_front():
    sim = SimPlatform("h200", hold_bytes=False)
    for field in dataclasses.fields(parts.Parts):
        part = getattr(sim._parts, field.name)
        for name, value in vars(part).items():
            assert value is not sim and getattr(value, "__self__", None) is not sim, f"{field.name}.{name}"
            assert not isinstance(value, SimPlatform), f"{field.name}.{name}"


def test_the_front_keeps_its_surface():
    sim = SimPlatform("rocm-win-2gpu", hold_bytes=False)
    assert all(callable(getattr(sim, name)) for name in CALLS)
    for name in VALUES:
        getattr(sim, name)


def test_each_call_is_bound_once_to_its_part():
    """A driver call reaches the part's own method: the front adds no layer per call."""
    sim = SimPlatform("h200", hold_bytes=False)
    owners = {id(getattr(sim._parts, f.name)) for f in dataclasses.fields(parts.Parts)}
    for name in CALLS:
        call = vars(sim)[name]
        assert id(call.__self__) in owners, name
    assert sim.map.__self__ is sim._parts.handles and sim.address_reserve.__self__ is sim._parts.address


def test_the_values_of_the_front_are_the_parts():
    sim = SimPlatform("rocm-win-2gpu", hold_bytes=False)
    g = sim.profile.granularity
    sim.va_space = 4 * g  # what tests/test_round6_sim_oom.py does: the address part refuses past it
    with pytest.raises(SimError, match="address space"):
        sim.address_reserve(8 * g, 0)
    assert sim._parts.address.va_space == 4 * g
    sim.va_space = sim.VA_SPACE
    sim.address_reserve(1 << 30, 0)
    with pytest.raises(SimulatedCrash):
        sim.address_reserve(sim.profile.address_quota, 0)
    assert sim.crashes == 1 == sim._parts.state.crashes, "a counter the parts keep, read through the front"
    sim.advance(0.5)
    assert sim.clock == 0.5 and sim.reservations is sim._parts.address.reservations
    assert sim.private_commit == 1 << 30, "ROCm/Windows: the reservation is commit-charged"


def test_the_front_docstring_names_every_part():
    doc = front.__doc__ or ""
    assert all(f":mod:`.{p.stem}`" in doc for p in PART_MODULES), doc
