"""Every error a caller can meet is defined in ``membackend.types``, under ``MembackendError``, one name per
meaning (issue 26): the modules that raise them import them from there, and no error class of the same name is
defined twice anywhere in the package. The lab's and the installer's are defined there too but promised at their
homes (issue 44: tests/test_promise_moves.py)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import membackend
from membackend import types

ROOT = Path(membackend.__file__).parent

#: exceptions that never leave membackend: the CLI's and the adapter's control flow, and the simulation's
#: models of a crash (a kernel bugcheck, a killed process), which stand for the machine dying, not an error, and
#: signals caught where they are raised, never reaching a caller (the APU budget's _BadFile: a sysfs file left out)
INTERNAL = {"_Said", "_ComfyRaised", "MemoryCallFailed", "SimulatedBugcheck", "SimulatedCrash", "SimError", "_BadFile"}


def _exception_classes() -> dict[str, list[str]]:
    """Every class in the package that derives (by the name of a base) from an exception, by name."""
    found: dict[str, list[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    isinstance(b, ast.Name) and (b.id.endswith(("Error", "Exception", "Exhausted"))
                                                 or b.id in ("BaseException", "MemoryError", "LookupError"))
                    or isinstance(b, ast.Name) and b.id in found for b in node.bases):
                found.setdefault(node.name, []).append(str(path.relative_to(ROOT)))
    return found


def test_every_error_class_lives_in_types_under_membackend_error():
    outside = {name: where for name, where in _exception_classes().items()
               if name not in INTERNAL and where != ["types.py"]}
    assert outside == {}
    for name in types.__all__:
        value = getattr(types, name)
        if inspect.isclass(value) and issubclass(value, BaseException):
            assert issubclass(value, types.MembackendError), name
            assert getattr(membackend, name) is value  # re-exported by the package facade


def test_one_name_per_meaning():
    twice = {name: where for name, where in _exception_classes().items() if len(where) > 1}
    assert twice == {}


def test_the_check_sees_an_error_class_outside_types(tmp_path):
    probe = ROOT / "_errors_probe.py"
    probe.write_text("from .types import MembackendError\n\n\nclass ProbeError(MembackendError):\n    pass\n")
    try:
        assert _exception_classes()["ProbeError"] == ["_errors_probe.py"]
    finally:
        probe.unlink()


def test_a_device_listed_by_a_simulated_driver_says_so_and_a_real_one_does_not():
    from membackend.lab.simulated import simulated_machine

    machine = simulated_machine("h200")
    assert [(str(d.device), d.source, d.simulated) for d in machine.gpus()] == [("cuda:0", "sim:h200", True)]
    real = types.DeviceInfo(types.Device("cuda"), source="cuda: cuDeviceGetCount")
    assert not real.simulated and not types.DeviceInfo(types.Device("cuda")).simulated
