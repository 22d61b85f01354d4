"""What a type checker sees of the settings' models: the pydantic models themselves are built by
:func:`.model.models` on first use (importing pydantic costs about 0.3 s at ComfyUI's start), so their fields are
written here once more, one annotation per field of the tables of :mod:`.rules` (``FIELDS``, ``MACHINE_FIELDS``,
``DEVICE_FIELDS``), held to them by ``tests/test_front_door.py``.

Nothing imports this module at run time: the package (``membackend._settings``) and :mod:`.model` import it
only for type checking, which keeps them out of an import circle with each other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

    from pydantic import BaseModel as _BaseModel

    from .sources import Sources

    class DeviceOverride(_BaseModel):
        kind: str
        index: int
        name: str
        total_memory: int
        integrated: bool
        unified: bool
        driver_model: str | None
        arch: str | None
        vmm_supported: bool
        luid: str | None

    class MachineOverrides(_BaseModel):
        os: str | None
        cpus: int | None
        ram_total: int | None
        ram_available: int | None
        cgroup_limit: int | None
        torch_version: str | None
        torch_vendor: str | None
        devices: list[DeviceOverride] | None

    class Settings(_BaseModel):
        backend: str | None
        disable: bool
        block: list[str]
        headroom: int | None
        page_size: int
        host_capacity: int | None
        keep_dropped: str | int
        sim_profile: str | None
        probe_timeout: float
        override_probe: bool
        sanitize: bool
        trace: Path | None
        machine: MachineOverrides

        def source_of(self, key: str) -> str: ...

        def snapshot(self) -> Sources | None: ...
