"""A simulated GPU holds real bytes (membackend._drivers.sim.memory): the VMM calls it models move them.

Each test drives the simulated driver through the same wrapper the VMM backend uses (``CudaDriver`` /
``HipDriver`` over the simulated module) and reads the device's bytes back through the driver's own copies
(``cuMemcpyDtoH``) or the simulation's ``read``.
"""

from __future__ import annotations

import ctypes
import os
import sys

import pytest

from membackend._drivers.sim import get_profile, sim_driver
from membackend._drivers.sim import memory as sim_memory
from membackend.types import DriverError

MiB = 1 << 20
PAGE = 2 * MiB
ILLEGAL_ADDRESS, INVALID_VALUE = 700, 1


def _page(d, index: int = 0):
    """Reserve two pages of address space and create one page of memory on device ``index``."""
    d.set_device(index)
    va = d.address_reserve(2 * PAGE, 0)
    h = d.create(PAGE, index)
    return va, h


def _mapped(d, va, h):
    d.map(va, PAGE, h)
    d.set_access(va, PAGE, 0)


def _read(d, va, size):
    out = bytearray(size)
    d.memcpy_dtoh(out, va, size)
    return bytes(out)


def _code(exc: DriverError) -> int:
    return int(exc.code)


@pytest.mark.parametrize("profile", ["h200", "rocm-win-2gpu"])
def test_mapping_shows_the_handles_bytes_and_unmapping_takes_them_away(profile):
    d = sim_driver(profile)
    assert d.cpu_addressable and d.sim.memory.backed
    va, h = _page(d)
    _mapped(d, va, h)
    d.memcpy_htod(va, b"weights!" * 8, 64)
    assert _read(d, va, 64) == b"weights!" * 8
    assert ctypes.string_at(va, 8) == b"weights!"  # the same bytes at the same address for the CPU
    d.unmap(va, PAGE)
    with pytest.raises(DriverError) as exc:
        _read(d, va, 64)
    assert _code(exc.value) == ILLEGAL_ADDRESS
    _mapped(d, va, h)  # the handle kept its bytes: mapped again, they are back
    assert _read(d, va, 8) == b"weights!"
    d.unmap(va, PAGE)
    d.release(h)
    d.address_free(va, 2 * PAGE)


def test_one_handle_at_two_addresses_shows_the_same_bytes():
    d = sim_driver("h200")
    va, h = _page(d)
    d.map(va, PAGE, h)
    d.map(va + PAGE, PAGE, h)
    d.set_access(va, 2 * PAGE, 0)
    d.memcpy_htod(va + 100, b"alias", 5)
    assert _read(d, va + PAGE + 100, 5) == b"alias"
    d.memcpy_htod(va + PAGE, b"back", 4)
    assert _read(d, va, 4) == b"back"


def test_a_reservation_is_address_space_without_access():
    d = sim_driver("h200")
    va, h = _page(d)
    with pytest.raises(DriverError) as exc:
        d.memcpy_htod(va, b"x", 1)  # reserved, nothing mapped
    assert _code(exc.value) == ILLEGAL_ADDRESS
    d.map(va, PAGE, h)
    with pytest.raises(DriverError) as exc:
        _read(d, va, 1)  # mapped, no access set yet (cuMemSetAccess)
    assert _code(exc.value) == ILLEGAL_ADDRESS
    with open("/proc/self/maps") as f:  # the operating system agrees: no access to the range
        rows = [line.split() for line in f
                if int(line.split("-")[0], 16) <= va < int(line.split()[0].split("-")[1], 16)]
    assert rows and rows[0][1].startswith("---")


def test_releasing_frees_the_memory_once_no_address_maps_it():
    d = sim_driver("h200")
    mem = d.sim.memory
    va, h = _page(d)
    _mapped(d, va, h)
    ctypes.memset(va, 7, PAGE)  # the CPU writes the device's page: its memory exists now
    assert os.fstat(mem.fd).st_blocks * 512 >= PAGE
    d.release(h)  # still mapped: the memory stays until the unmap (cuMemRelease)
    assert os.fstat(mem.fd).st_blocks * 512 >= PAGE
    d.unmap(va, PAGE)
    assert os.fstat(mem.fd).st_blocks == 0


def test_an_async_copy_moves_its_bytes_when_the_stream_runs_it():
    d = sim_driver("h200")
    va, h = _page(d)
    _mapped(d, va, h)
    source = bytearray(b"fresh weights" * 1000)
    stream = d.stream_create()
    d.memcpy_htod_async(va, source, len(source), stream)
    assert d.sim.read(va, 13) == bytes(13)  # not run yet: a read before the fence sees the old bytes
    d.stream_synchronize(stream)
    assert d.sim.read(va, len(source)) == bytes(source)


def test_a_synchronous_copy_waits_for_the_work_queued_before_it():
    d = sim_driver("h200")
    va, h = _page(d)
    _mapped(d, va, h)
    source = bytearray(b"a" * 16)  # alive until the copy ran: the caller's promise to a real driver too
    d.memcpy_htod_async(va, source, 16, d.stream_create())
    assert _read(d, va, 16) == b"a" * 16  # cuMemcpyDtoH runs after the queued copy


def test_a_copy_whose_pages_were_unmapped_under_it_lands_nowhere_and_is_counted():
    d = sim_driver("rocm-win-2gpu")  # unmapping does not wait for queued work there (counted as a hazard)
    va, h = _page(d)
    _mapped(d, va, h)
    source = bytearray(b"late" * 4)
    d.memcpy_htod_async(va, source, 16, d.stream_create())
    d.unmap(va, PAGE)
    assert d.sim.use_after_free == 1
    d.device_synchronize()
    assert d.sim.illegal_addresses == 1 and d.inspect(0)["hazards"] == 2
    _mapped(d, va, h)
    assert _read(d, va, 16) == bytes(16)  # never written through the stale mapping


def test_a_copy_from_a_null_host_pointer_is_invalid():
    d = sim_driver("h200")
    va, h = _page(d)
    _mapped(d, va, h)
    with pytest.raises(DriverError) as exc:
        d.memcpy_htod_async(va, 0, 16, d.stream_create())
    assert _code(exc.value) == INVALID_VALUE


def test_pinned_host_memory_is_real_memory_and_counts_on_a_unified_pool():
    d = sim_driver("gb10-128gb")
    before = d.sim.meminfo()["MemAvailable"]
    p = d.host_alloc_pinned(PAGE)
    ctypes.memset(p, 1, PAGE)
    assert d.sim.meminfo()["MemAvailable"] == before - PAGE
    d.host_free_pinned(p)
    assert d.sim.meminfo()["MemAvailable"] == before
    with pytest.raises(DriverError):
        d.host_free_pinned(p)  # freed already


def test_books_only_when_asked_or_when_the_os_cannot_back_it(monkeypatch):
    d = sim_driver("h200", hold_bytes=False)
    assert not d.cpu_addressable and "books only" in d.sim.memory.reason
    va, h = _page(d)
    _mapped(d, va, h)
    d.memcpy_htod_async(va, 0, 16, d.stream_create())  # a modelled copy: sizes and times, no bytes
    monkeypatch.setattr(sys, "platform", "darwin")
    books = sim_memory.open_memory("h200")
    assert not books.backed and "memfd_create" in books.reason


def test_the_memory_goes_back_with_the_simulated_process():
    d = sim_driver("h200")
    mem = d.sim.memory
    va, h = _page(d)
    _mapped(d, va, h)
    fd = mem.fd
    del d, h
    import gc

    gc.collect()
    assert mem.fd == -1
    with pytest.raises(OSError):
        os.fstat(fd)
    with open("/proc/self/maps") as f:
        assert not any(int(line.split("-")[0], 16) == va for line in f)


def test_every_profile_holds_bytes_and_says_so():
    for name in ("h200", "wddm-6gb", "gb10-128gb", "rocm-win-2gpu", "mi100-novmm"):
        d = sim_driver(get_profile(name))
        assert d.sim.memory.backed, (name, d.sim.memory.reason)


# A process at the kernel's mapping limit (vm.max_map_count): every other page of one region of its own given
# another protection (each page a mapping of its own) until a few hundred mappings are left, then faults on a
# simulated H200 until the limit refuses one, then the last mappings taken by other code (past the limit, where mmap
# refuses any new one), then a page freed and every reservation released. The session is create_session's.
AT_THE_LIMIT = r"""
import ctypes, json, mmap, os
import membackend
from membackend.types import MembackendError
def mappings():
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)
limit = int(open("/proc/sys/vm/max_map_count").read())
s = membackend.create_session(sim_profile="h200", backend="vmm")
dev = s.devices()[0]
probe = s.reserve(dev, 1)
page = probe.page_size
s.release_reservation(probe)
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                          ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
filler = limit - mappings() - 600
small = mmap.PAGESIZE
region = libc.mmap(None, (filler + 2) * small, mmap.PROT_READ, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x4000, -1, 0)
for i in range(1, filler, 2):
    assert libc.mprotect(region + i * small, small, 0) == 0, os.strerror(ctypes.get_errno())
out = {"limit": limit}
reservations, refused = [], None
while refused is None:
    try:
        r = s.reserve(dev, 16 * page)
    except MembackendError as exc:
        refused = f"reserve: {type(exc).__name__}"
        break
    reservations.append(r)
    for i in range(0, 16, 2):
        if not s.fault(r, i * page, page).ok:
            refused = "fault: ok=False"
            break
# another part of the process takes what is left (mmap refuses a new mapping only past the limit): now every mmap
# fails. Each page another protection than the one before, so that no two merge into one mapping
for k in range(1000):
    if libc.mmap(None, small, mmap.PROT_READ * (k % 2), mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0) in \
            (None, ctypes.c_void_p(-1).value):
        break
else:
    raise AssertionError("the kernel took 1000 more mappings past the limit")
out["refused"], out["at"], out["reservations"], out["page"] = refused, mappings(), len(reservations), page
out["freed"] = s.free(reservations[0], 0, page)  # one page dropped at the limit: unmapped, memory back
errors = []
for r in reservations:
    try:
        s.release_reservation(r)
    except Exception as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
s.trim()
out["errors"], out["state"], out["after"] = errors[:3], s.backend.driver.sim.state(0), mappings()
r = s.reserve(dev, 16 * page)  # room again
out["fault_after"] = s.fault(r, 0, 16 * page).ok
print(json.dumps(out))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="vm.max_map_count is Linux's")
def test_at_the_kernels_mapping_limit_releases_succeed_and_the_memory_comes_back():
    import json
    import subprocess

    limit = int(open("/proc/sys/vm/max_map_count").read())
    if limit > 1_000_000:
        pytest.skip(f"vm.max_map_count is {limit}: too many mappings to fill in a test")
    run = subprocess.run([sys.executable, "-c", AT_THE_LIMIT], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    assert out["refused"] is not None and out["at"] >= limit, out  # the kernel's limit, not the device's memory
    assert out["reservations"] > 1 and out["freed"] == out["page"], out
    assert out["errors"] == [], out  # on main: 'cuMemUnmap failed ... mmap: Cannot allocate memory'
    assert out["state"]["physical"] == 0 and out["state"]["reserved"] == 0 and out["state"]["mapped"] == 0, out
    assert out["after"] < limit - 500 and out["fault_after"], out


def test_a_closed_session_lets_go_of_its_memory_file_and_mappings_at_once():
    import membackend

    s = membackend.create_session(sim_profile="h200")
    r = s.reserve(s.devices()[0], 4 * PAGE)
    assert s.fault(r, 0, PAGE).ok
    mem = s.backend.driver.sim.memory
    fd = mem.fd
    assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:membackend-sim-")
    inode = str(os.fstat(fd).st_ino)  # this session's file: other tests' sessions may still await the collector
    s.close()  # the session stays referenced: nothing waits for the garbage collector
    assert mem.fd == -1
    assert not os.path.exists(f"/proc/self/fd/{fd}") or \
        not os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:membackend-sim-h200")
    with open("/proc/self/maps") as f:
        assert not [line for line in f if "membackend-sim-h200" in line and line.split()[4] == inode]
    d = s.backend.driver  # the driver may be used again: it opens a new file
    va = d.address_reserve(2 * PAGE, 0)
    assert mem.fd >= 0
    d.address_free(va, 2 * PAGE)


# Under an open-file limit of 128: sessions on a simulated GPU opened, used, closed and kept (on main the 124th
# create_session raised a plain OSError, EMFILE); then every descriptor taken: create_session and a closed session's
# driver used again answer typed errors naming the limit, and once descriptors are back both work again.
OUT_OF_FILES = r"""
import json, os, resource
resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
import membackend
out, kept = {}, []
try:
    for _ in range(200):
        s = membackend.create_session(sim_profile="h200")
        r = s.reserve(s.devices()[0], 2 << 20)
        assert s.fault(r, 0, 2 << 20).ok
        s.close()
        kept.append(s)
    out["closed"] = len(kept)
except Exception as exc:
    out["closed"] = f"after {len(kept)}: {type(exc).__module__}.{type(exc).__name__}: {exc}"
held = []
try:
    while True:
        held.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
for name, call in (("create_session", lambda: membackend.create_session(sim_profile="h200")),
                   ("reserve", lambda: kept[0].reserve(kept[0].devices()[0], 2 << 20))):
    try:
        call()
        out[name] = "no error"
    except Exception as exc:
        out[name] = [f"{type(exc).__module__}.{type(exc).__name__}", str(exc)]
for fd in held[:16]:
    os.close(fd)
s = membackend.create_session(sim_profile="h200")
out["again"] = s.fault(s.reserve(s.devices()[0], 2 << 20), 0, 2 << 20).ok
print(json.dumps(out))
"""


@pytest.mark.long  # opens sessions up to the process's descriptor limit
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_NOFILE and /proc/self/fd")
def test_closed_sessions_hold_no_descriptors_and_running_out_of_them_is_typed(tmp_path):
    import json
    import subprocess

    run = subprocess.run([sys.executable, "-c", OUT_OF_FILES], capture_output=True, text=True, timeout=600,
                         cwd=tmp_path)  # no membackend.toml or pyproject.toml to read there
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    assert out["closed"] == 200, out
    for name in ("create_session", "reserve"):
        kind, message = out[name]
        assert kind == "membackend.types.DriverError", out
        assert "128 open files" in message and "RLIMIT_NOFILE" in message and "accepted" in message, out
    assert out["again"] is True, out
