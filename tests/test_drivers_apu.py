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


# Each bad file in place of one of the four, read twice and asked for a budget through a session on the simulated
# Strix Halo whose driver reads these files (as a real one does), in a child with a 4 GiB address-space limit (on
# main a link to /dev/zero was read until MemoryError) and a thread per read (on main a FIFO blocked the read).
BAD_FILES = r"""
import functools, json, logging, os, resource, sys, threading
from pathlib import Path
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, resource.RLIM_INFINITY))
from membackend._drivers.apu import read_amdgpu_memory
import membackend
from membackend._drivers.gpu import GpuDriver
root = Path(sys.argv[1])
os.environ["MEMBACKEND_SYSFS_ROOT"] = str(root)
logged = []
logging.getLogger("membackend").addHandler(type("H", (logging.Handler,), {"emit": lambda h, r: logged.append(r)})())
def answer(fn):  # what fn returns or raises, or "blocked" while it does neither
    out = []
    def run():
        try:
            out.append(repr(fn()))
        except BaseException as exc:
            out.append(f"{type(exc).__name__}: {str(exc)[:200]}")
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(60)  # a guard against a read that never ends, not a measure of speed
    return out[0] if out else "blocked"
s = membackend.create_session(sim_profile="strix-halo-128gb")
d = s.backend.driver
d.amdgpu_memory = functools.partial(GpuDriver.amdgpu_memory, d)  # the files, not the simulation's books
dom, bus, dev = d.sim.pci_location(0)
good = {"vram_total": 512 << 20, "vram_used": 0, "gtt_total": 96 << 30, "gtt_used": 0}
results = {}
for i, (name, make) in enumerate(json.loads(sys.argv[2]).items()):
    folder = root / "bus/pci/devices" / f"{dom:04x}:{bus:02x}:{dev:02x}.0"
    if folder.exists():
        for f in folder.iterdir():
            f.rmdir() if f.is_dir() and not f.is_symlink() else f.unlink()
    folder.mkdir(parents=True, exist_ok=True)
    for k, v in good.items():
        (folder / f"mem_info_{k}").write_text(f"{v}\n")
    bad = folder / f"mem_info_{make['file']}"
    bad.unlink()
    if make["kind"] == "text":
        bad.write_text(make["text"])
    elif make["kind"] == "fifo":
        os.mkfifo(bad)
    elif make["kind"] == "link":
        bad.symlink_to(make["to"])
    else:
        bad.mkdir()
    logged.clear()
    reads = [answer(lambda: read_amdgpu_memory(dom, bus, dev)) for _ in range(2)]
    budget = answer(lambda: s.budget_query("hip:0"))
    results[name] = {"reads": reads, "budget": budget, "logged": [r.getMessage() for r in logged]}
print(json.dumps(results))
"""


def test_a_bad_sysfs_file_is_left_out_logged_once_and_never_blocks_the_budget(tmp_path):
    import json
    import os
    import subprocess
    import sys

    cases = {
        "negative": {"file": "gtt_total", "kind": "text", "text": "-5\n"},
        "negative carve-out": {"file": "vram_total", "kind": "text", "text": "-1073741824\n"},
        "4,000 digits": {"file": "gtt_total", "kind": "text", "text": "9" * 4000 + "\n"},
        "21 digits": {"file": "vram_used", "kind": "text", "text": "1" + "0" * 20 + "\n"},
        "not a number": {"file": "gtt_used", "kind": "text", "text": "12 GiB\n"},
        "a total of 0": {"file": "gtt_total", "kind": "text", "text": "0\n"},
        "a FIFO": {"file": "gtt_total", "kind": "fifo"},
        "a link to /dev/zero": {"file": "vram_total", "kind": "link", "to": "/dev/zero"},
        "a folder": {"file": "gtt_used", "kind": "folder"},
    }
    if not os.path.exists("/dev/zero") or not hasattr(os, "mkfifo"):
        pytest.skip("needs /dev/zero and FIFOs")
    run = subprocess.run([sys.executable, "-c", BAD_FILES, str(tmp_path), json.dumps(cases)], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout)
    for name, got in results.items():
        assert got["reads"] == ["None", "None"], (name, got)  # left out, as a missing file is
        assert got["budget"].startswith("Budget(") and "bound by hipMemGetInfo" in got["budget"], (name, got)
        assert len(got["logged"]) == 1 and f"mem_info_{cases[name]['file']}" in got["logged"][0], (name, got)
        assert "accepted" in got["logged"][0] and "leaves the sysfs figure out" in got["logged"][0], (name, got)


def test_a_sysfs_figure_beyond_the_machine_is_left_out_once(caplog):
    ram = 32 * GiB
    for vram_total, vram_used, gtt_total in ((512 * MiB, 0, 4 * ram + 1), (512 * MiB, GiB, 16 * GiB)):
        sysfs = AmdgpuMemory(vram_total, vram_used, gtt_total, 0, path=f"/sys/x{gtt_total}")
        caplog.clear()
        for _ in range(2):
            pool = apu_pool(8 * GiB, 16 * GiB, "hipMemGetInfo", sysfs, ram, 20 * GiB)
            assert [f.name for f in pool.figures] == ["hipMemGetInfo", "MemAvailable"], pool.label
            assert pool.bound == "hipMemGetInfo" and pool.free == 8 * GiB
        assert len([r for r in caplog.records if "machine's memory" in r.getMessage()]) == 1, caplog.text
    # a 96 GB carve-out of a 128 GB machine (the kernel counts 31 GiB) is within it
    big = AmdgpuMemory(96 * GiB, 0, 15 * GiB, 0, path="/sys/y")
    assert "sysfs" in [f.name for f in apu_pool(8 * GiB, 96 * GiB, "hipMemGetInfo", big, 31 * GiB, 20 * GiB).figures]
