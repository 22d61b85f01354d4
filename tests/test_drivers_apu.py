"""The three figures of an AMD APU's one pool (``membackend._drivers.apu``): the amdgpu sysfs files read, and the
smallest figure binding; the budget they make on the simulated Strix Halo is tested with the plugin that uses it
(``plugins/rocm_linux/tests/test_rocm_linux_budget.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from membackend._drivers.apu import AmdgpuMemory, apu_pool, read_amdgpu_memory, system_reserve

MiB, GiB = 1 << 20, 1 << 30


def _sysfs(tmp_path: Path, bus: int, **files: int) -> Path:
    folder = tmp_path / "bus" / "pci" / "devices" / f"0000:{bus:02x}:00.0"
    folder.mkdir(parents=True)
    for name, value in files.items():
        (folder / f"mem_info_{name}").write_text(f"{value}\n")
    return folder


def test_sysfs_files_are_read_and_a_missing_one_means_none(tmp_path):
    _sysfs(tmp_path, 0xC5, vram_total=512 * MiB, vram_used=8 * MiB, gtt_total=96 * GiB, gtt_used=GiB)
    m = read_amdgpu_memory(0, 0xC5, 0, root=tmp_path)
    assert m == AmdgpuMemory(512 * MiB, 8 * MiB, 96 * GiB, GiB, path=str(tmp_path / "bus/pci/devices/0000:c5:00.0"))
    assert m.left == 504 * MiB + 95 * GiB and m.total == 96 * GiB + 512 * MiB
    _sysfs(tmp_path, 3, vram_total=GiB, vram_used=0, gtt_total=GiB)  # no gtt_used
    assert read_amdgpu_memory(0, 3, 0, root=tmp_path) is None
    assert read_amdgpu_memory(0, 9, 0, root=tmp_path) is None


def test_the_sysfs_root_follows_the_variable(tmp_path, monkeypatch):
    _sysfs(tmp_path, 1, vram_total=GiB, vram_used=0, gtt_total=2 * GiB, gtt_used=0)
    monkeypatch.setenv("MEMBACKEND_SYSFS_ROOT", str(tmp_path))
    assert read_amdgpu_memory(0, 1, 0).total == 3 * GiB


@pytest.mark.parametrize("hip_free,hip_total,sysfs_left,available,bound,free", [
    # free above its total: the total less what sysfs says is in use (96 - 90 = 6 GiB used)
    (120 * GiB, 62 * GiB, 90 * GiB, 110 * GiB, "hipMemGetInfo", 56 * GiB),
    (50 * GiB, 62 * GiB, 40 * GiB, 110 * GiB, "sysfs", 40 * GiB + 512 * MiB),  # the carve-out counts
    (50 * GiB, 62 * GiB, 40 * GiB, 20 * GiB, "MemAvailable", 16 * GiB),  # 20 GiB less the 4 GiB reserve
    # a HIP that answers the carve-out alone (512 MiB of it) describes the carve-out: left out
    (512 * MiB, 512 * MiB, 90 * GiB, 110 * GiB, "sysfs", 90 * GiB + 512 * MiB),
])
def test_the_smallest_figure_binds(hip_free, hip_total, sysfs_left, available, bound, free):
    sysfs = AmdgpuMemory(512 * MiB, 0, 96 * GiB, 96 * GiB - sysfs_left, path="/sys/x")
    pool = apu_pool(hip_free, hip_total, "hipMemGetInfo", sysfs, 128 * GiB, available)
    assert (pool.bound, pool.free) == (bound, free)
    assert pool.free <= pool.total
    assert [f.name for f in pool.figures] == ["hipMemGetInfo", "sysfs", "MemAvailable"]
    assert ("is the carve-out alone, not the pool: not counted" in pool.label) == (hip_total == 512 * MiB)


def test_without_sysfs_two_figures_and_the_line_says_so():
    pool = apu_pool(8 * GiB, 16 * GiB, "hipMemGetInfo", None, 32 * GiB, 20 * GiB)
    assert pool.bound == "hipMemGetInfo" and pool.free == 8 * GiB
    assert "sysfs amdgpu memory files not readable" in pool.label


def test_the_system_reserve():
    assert system_reserve(128 * GiB) == 4 * GiB and system_reserve(16 * GiB) == 1 * GiB
    assert system_reserve(64 * GiB) == 2 * GiB
