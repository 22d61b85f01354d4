"""ROCm 7.14 holds one file descriptor per live hipMemCreate handle (ROCm/rocm-systems #10604; ROCm 7.1.1 kept 3
in all, ROCm/legacy-rocm-build #6661): under ``ulimit -n 1024`` a process stops at about 1,015 handles, 31.7 GiB of
32 MiB pages, and the runtime answers hipErrorOutOfMemory. The plugin raises the soft limit at start-up as far as
its handles can need, and a create refused for want of a descriptor is ``DescriptorLimit``, never out of memory.

Each test runs the Strix Halo profile (96 GiB device) with a ROCm 7.14 runtime, under a fake ``RLIMIT_NOFILE``
(``resource.getrlimit``/``setrlimit`` replaced), so nothing depends on this machine's limits; the descriptors the
test process really has open count, as they do for the runtime."""

from __future__ import annotations

import dataclasses
import errno
import resource
import sys

import pytest
from rocm_linux_sessions import PAGE, GiB, MiB, session, sim

from membackend import ResidencyManager
from membackend._backends.vmm.descriptors import raise_soft_limit
from membackend._cli import _print_budgets, budgets_report
from membackend._drivers.gpu import process_descriptors
from membackend._drivers.sim.profiles import ROCM_7_14, get_profile
from membackend.lab.simulated import simulated_driver, simulated_session
from membackend.types import DescriptorLimit, DriverError

DEV = "hip:0"
PROFILE = "strix-halo-128gb"  # gfx1151, a 96 GiB device: 3,072 pages of 32 MiB
NOFILE = resource.RLIMIT_NOFILE
_get, _set = resource.getrlimit, resource.setrlimit


class FakeLimits:
    """``RLIMIT_NOFILE`` of a process started under ``ulimit -n soft`` with hard limit ``hard``; an unprivileged
    process may move its soft limit up to the hard one, never the hard one up (setrlimit(2))."""

    def __init__(self, soft: int, hard: int):
        self.soft, self.hard, self.calls = soft, hard, 0

    def getrlimit(self, which):
        return (self.soft, self.hard) if which == NOFILE else _get(which)

    def setrlimit(self, which, limits):
        if which != NOFILE:
            return _set(which, limits)
        soft, hard = limits
        if hard > self.hard or soft > hard:
            raise ValueError("not allowed to raise maximum limit")
        self.soft, self.hard, self.calls = soft, hard, self.calls + 1


@pytest.fixture
def limits(monkeypatch):
    def under(soft: int, hard: int) -> FakeLimits:
        fake = FakeLimits(soft, hard)
        monkeypatch.setattr(resource, "getrlimit", fake.getrlimit)
        monkeypatch.setattr(resource, "setrlimit", fake.setrlimit)
        return fake
    return under


def rocm714(**kwargs):
    """The plugin's session on the Strix Halo profile with a ROCm 7.14 runtime (books only: 96 GiB of pages)."""
    return session(PROFILE, driver=simulated_driver(PROFILE, hold_bytes=False, driver_version=ROCM_7_14), **kwargs)


def fault_until_refused(s, r, step=1 * GiB):
    """Fault ``r`` a GiB at a time until a fault is refused (out of memory) or raises; the bytes mapped, and the
    refused fault's answer or error."""
    mapped = 0
    for offset in range(0, r.size, step):
        try:
            f = s.fault(r, offset, step)
        except DriverError as exc:
            return mapped, exc
        if not f.ok:
            return mapped, f
        mapped += f.mapped
    return mapped, None


def test_only_rocm_714_on_linux_holds_a_descriptor_per_handle():
    assert not get_profile(PROFILE).descriptor_per_handle  # ROCm 7.2
    assert dataclasses.replace(get_profile(PROFILE), driver_version=ROCM_7_14).descriptor_per_handle
    assert not dataclasses.replace(get_profile("rocm-win-2gpu"), driver_version=ROCM_7_14).descriptor_per_handle


def test_without_the_part_rocm_714_answers_out_of_memory_a_third_into_the_device(limits):
    """The report, reproduced: the generic mechanism (no descriptor budget) stops near 1,015 handles with an
    out-of-memory answer while two thirds of the device are free. The "before" figure."""
    # the room a fresh process has under ulimit -n 1024 (about 5 descriptors open), whatever this one holds open
    fake = limits(process_descriptors() + 1019, 1 << 20)
    soft = fake.soft
    caps = dataclasses.replace(get_profile(PROFILE).capabilities(), handle_descriptors=False)
    driver = simulated_driver(PROFILE, hold_bytes=False, driver_version=ROCM_7_14)
    s = simulated_session(PROFILE, driver=driver, capabilities=caps, page_size=PAGE)
    r = s.reserve(DEV, 48 * GiB)
    mapped, answer = fault_until_refused(s, r)
    assert not answer.ok, "an ordinary out of memory: the policy would evict models for it"
    assert 28 * GiB < mapped < 32 * GiB and sim(s).descriptor_refusals == 1  # ~1,000 handles x 32 MiB
    assert fake.soft == soft and fake.calls == 0
    s.close()


def test_the_plugin_raises_the_limit_at_start_up_and_faults_past_40_gib(limits, capsys):
    fake = limits(1024, 1 << 20)
    s = rocm714()
    s.budget_query(DEV)  # the device's first use: the start
    pages = 96 * GiB // PAGE
    assert pages + 256 < fake.soft < pages + 256 + 512 and fake.hard == 1 << 20  # as far as needed, no further
    r = s.reserve(DEV, 48 * GiB)
    mapped, answer = fault_until_refused(s, r)
    assert answer is None and mapped == 48 * GiB > 40 * GiB and sim(s).descriptor_refusals == 0
    assert sim(s).state(0)["handles"] == 48 * GiB // PAGE  # one handle per page: bounded by the memory
    rows = budgets_report(s)
    assert rows[0]["descriptors"]["line"] is None  # nothing to say: the limit serves the whole budget
    _print_budgets(rows)
    out = capsys.readouterr().out
    assert f"descriptor limit: soft limit raised from 1,024 to {fake.soft:,}" in out and "mappable" not in out
    s.close()


def test_a_higher_limit_is_never_lowered(limits):
    fake = limits(65536, 1 << 20)
    s = rocm714()
    s.budget_query(DEV)
    assert fake.soft == 65536 and fake.calls == 0
    s.close()


def test_when_the_limit_cannot_be_raised_the_fault_is_a_typed_error_not_out_of_memory(limits, capsys):
    fake = limits(1024, 1024)
    s = rocm714()
    rm = ResidencyManager(s)
    a, b = rm.register("a", 8 * GiB, [DEV]), rm.register("b", 40 * GiB, [DEV])
    rm.use([a])
    assert rm.fault(a, 0, 8 * GiB).ok
    rm.unpin(a, 0, 8 * GiB)
    rm.use([b])
    with pytest.raises(DescriptorLimit) as caught:
        rm.fault(b, 0, 40 * GiB)
    exc = caught.value
    assert isinstance(exc, DriverError) and not isinstance(exc, MemoryError) and exc.errno == errno.EMFILE
    assert exc.call == "hipMemCreate" and exc.limit == 1024 and 1024 - exc.reached < 2
    assert exc.wanted > 96 * GiB // PAGE and f"ulimit -n {exc.wanted}" in str(exc)
    assert "1,024" in str(exc) and "RLIMIT_NOFILE" in str(exc) and "hard limit, 1,024" in str(exc)
    assert sum(p & 1 for p in rm.residency(a, DEV)) * PAGE == 8 * GiB, "nothing evicted for it"
    assert fake.soft == 1024 and sim(s).descriptor_refusals == 1
    rows = budgets_report(s)
    room = rows[0]["descriptors"]
    assert room["mappable"] < 32 * GiB and "could not be raised: the hard limit is 1,024" in room["started"]
    _print_budgets(rows)
    out = capsys.readouterr().out
    assert "mappable under the descriptor limit:" in out and "of soft limit 1,024" in out and "ulimit -n" in out
    rm.unload_all()
    s.close()


def test_a_real_out_of_memory_stays_out_of_memory(limits):
    """Descriptors to spare: the runtime's out of memory is the policy's, as before."""
    limits(1 << 16, 1 << 20)
    s = rocm714()
    sim(s).faults.add("hipMemCreate", 2, nth=3)  # hipErrorOutOfMemory
    r = s.reserve(DEV, 256 * MiB)
    assert not s.fault(r, 0, 256 * MiB).ok
    s.close()


def test_raising_says_what_it_did_and_never_fails(limits, monkeypatch):
    fake = limits(1024, 2048)
    said = raise_soft_limit(4000, "x")
    assert "raised from 1,024 to 2,048" in said and "short of the 4,000" in said and fake.soft == 2048
    assert "could not be raised: the hard limit is 2,048" in raise_soft_limit(4000, "x")
    monkeypatch.setitem(sys.modules, "resource", None)  # Windows: no resource module
    assert raise_soft_limit(4000, "x") == "no RLIMIT_NOFILE on this OS: nothing to raise"
