"""Machine facts: detection helpers and overrides."""

from __future__ import annotations

import sys

from membackend._hostmem import cgroup_memory, host_memory
from membackend._machine import gather_machine, torch_build
from membackend._settings import load_settings
from membackend.types import Device


def test_detects_this_machine_without_importing_torch():
    m = gather_machine()
    assert m.os in ("linux", "windows", "darwin")
    assert m.cpus >= 1 and m.ram_total > m.ram_available > 0
    assert m.overridden == ()
    # in a fresh process: other tests of this run may have imported torch already
    import subprocess

    code = "import sys; from membackend._machine import gather_machine; gather_machine(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_every_fact_can_be_overridden():
    s = load_settings(machine={
        "os": "windows", "cpus": 32, "ram_total": "64GiB", "ram_available": "40GiB", "cgroup_limit": "48GiB",
        "torch_vendor": "rocm", "torch_version": "2.9.1+rocm6.4",
        "devices": [{"kind": "hip", "index": 0, "name": "RX 9070 XT", "total_memory": "16GiB", "arch": "gfx1201"},
                    {"kind": "hip", "index": 1, "name": "RX 9070 XT", "total_memory": "16GiB", "arch": "gfx1201"}],
    })
    m = gather_machine(s.machine)
    assert (m.os, m.cpus, m.ram_total, m.cgroup_limit, m.torch_vendor) == ("windows", 32, 64 << 30, 48 << 30, "rocm")
    assert [d.device for d in m.gpus("hip")] == [Device("hip", 0), Device("hip", 1)]
    assert m.devices[0].arch == "gfx1201" and m.devices[0].source == "override"
    assert "devices" in m.overridden and "os" in m.overridden


def test_integrated_device_is_unified():
    s = load_settings(machine={"devices": [{"kind": "cuda", "name": "NVIDIA GB10", "total_memory": "128GB",
                                            "integrated": True}]})
    d = gather_machine(s.machine).devices[0]
    assert d.integrated and d.unified


def test_cgroup_v2(tmp_path):
    (tmp_path / "memory.max").write_text("8589934592\n")
    (tmp_path / "memory.current").write_text("1073741824\n")
    assert cgroup_memory(tmp_path) == (8 << 30, 1 << 30)
    (tmp_path / "memory.max").write_text("max\n")
    assert cgroup_memory(tmp_path) == (None, 1 << 30)


def test_cgroup_v1_unlimited_is_none(tmp_path):
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (tmp_path / "memory" / "memory.usage_in_bytes").write_text("100\n")
    assert cgroup_memory(tmp_path) == (None, 100)
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("4294967296\n")
    assert cgroup_memory(tmp_path) == (4 << 30, 100)


def test_no_cgroup(tmp_path):
    assert cgroup_memory(tmp_path) == (None, None)


def test_host_memory_is_capped_by_the_cgroup(tmp_path):
    free = host_memory(tmp_path)
    assert (free.source, free.cgroup_limit) == ("psutil MemAvailable", None)
    assert free.total == free.ram_total >= free.available > 0
    (tmp_path / "memory.max").write_text(f"{64 << 20}\n")
    (tmp_path / "memory.current").write_text(f"{48 << 20}\n")
    capped = host_memory(tmp_path)
    assert (capped.total, capped.available, capped.source) == (64 << 20, 16 << 20, "cgroup memory limit")
    (tmp_path / "memory.current").write_text(f"{80 << 20}\n")  # over the limit (page cache): nothing left, not negative
    assert host_memory(tmp_path).available == 0


def test_no_backend_imports_machine():
    """Backends read host memory from membackend._hostmem; machine facts stay above them."""
    import ast
    import pathlib

    import membackend._backends

    for path in pathlib.Path(membackend._backends.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        imported |= {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
        assert not {m for m in imported if m.endswith("machine")}, f"{path.name} imports machine"


def test_torch_build_from_metadata(monkeypatch):
    import importlib.metadata

    for version, vendor in (("2.13.0+cpu", "cpu"), ("2.9.1+rocm6.4", "rocm"), ("2.8.0+cu128", "cuda")):
        monkeypatch.setattr(importlib.metadata, "version", lambda name, v=version: v)
        assert torch_build() == (version, vendor)

    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", absent)
    assert torch_build() == (None, None)


def test_every_fact_says_where_it_came_from():
    m = gather_machine()
    for name in ("os", "cpus", "ram_total", "ram_available", "cgroup_limit", "torch_version", "torch_vendor"):
        assert m.source_of(name), name
    assert m.source_of("torch_version") == "torch's installed metadata (not imported)"
    assert any(line.startswith(("cuda", "hip")) for line in m.discovery)  # what each driver binding answered
    for d in m.devices:
        assert d.source and d.source_of("name")


def test_overridden_facts_are_sourced_as_the_users():
    s = load_settings(machine={"os": "windows", "devices": [{"kind": "cuda", "name": "RTX 3050", "total_memory": "6GiB",
                                                             "driver_model": "wddm"}]})
    m = gather_machine(s.machine)
    assert m.source_of("os").startswith("user override MEMBACKEND_MACHINE__OS")
    d = m.devices[0]
    assert d.source_of("driver_model").startswith("user override MEMBACKEND_MACHINE__DEVICES")
    assert d.vmm_supported is True  # a device the user describes supports VMM unless told otherwise


def test_ram_is_read_at_every_call_while_discovery_runs_once(monkeypatch):
    import membackend._drivers.open as opener
    from membackend._hostmem import HostMemory

    gather_machine()
    calls = []
    monkeypatch.setattr(opener, "discover", lambda b: calls.append(b))  # a second discovery would be recorded
    monkeypatch.setattr("membackend._drivers.discovery.host_memory",
                        lambda: HostMemory(8 << 30, 3 << 30, "test", 8 << 30, 3 << 30, None))
    assert gather_machine().ram_available == 3 << 30 and calls == []
