"""A ComfyUI adapter armed on the host backend, for tests and the child processes they start.

``arm(pages, label)`` builds a :class:`~membackend._comfyui.runtime.Runtime` over the host backend with room for
``pages`` pages of 2 MiB, no headroom, no reaper and no ComfyUI patches, and makes it the adapter's (the facade's
calls then land on real host memory). ``conftest.host_adapters`` stops each after its test; a child process
(``tests/test_comfyui_races.py``'s) imports this module with the tests folder on ``PYTHONPATH``.
"""

from __future__ import annotations

from typing import Any

PAGE = 2 << 20


def arm(pages: int = 16, label: str = "test", started: bool = False) -> Any:
    """The armed runtime; ``started``: as if ComfyUI's ``init_devices`` had run (the facade then serves it)."""
    from membackend._comfyui import runtime as adapter
    from membackend._comfyui.runtime import Runtime
    from membackend._drivers.open import machine_for
    from membackend._manager import BackendManager
    from membackend._residency import ResidencyManager
    from membackend._settings import load_settings

    settings = load_settings(backend="host", headroom=0, host_capacity=pages * PAGE, page_size=PAGE)
    mgr = BackendManager(settings)
    machine = machine_for(settings)
    runtime = Runtime(mgr, machine, mgr.select(machine), wire=lambda rt: None)
    runtime.session = mgr.session(machine, selection=runtime.selection)
    runtime.residency = ResidencyManager(runtime.session)
    runtime.devices = [runtime.device_for(0)]
    if started:
        runtime.started = True
    adapter.decided("armed", label, "", runtime)
    return runtime


def disarm() -> None:
    """The adapter back to stock (no runtime)."""
    from membackend._comfyui import runtime as adapter

    adapter.decided("stock", "test over", "", None)
