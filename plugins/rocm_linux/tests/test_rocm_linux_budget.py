"""An APU's budget from one pool: the smallest of hipMemGetInfo (never above its own total), what sysfs's
carve-out and GTT leave, and MemAvailable less a reserve for the system; each of the three binds in turn on the
simulated Strix Halo, and the source line names all three and the one that bound. A discrete card's budget is
its hipMemGetInfo. The one-pool rules (headroom, refusal up front) are unified_gb10's."""

from __future__ import annotations

from rocm_linux_sessions import GiB, MiB, session, sim

from membackend._drivers.apu import system_reserve
from membackend.platform import one_pool_headroom
from membackend.types import format_size
from membackend_rocm_linux import DISCRETE_HEADROOM, headroom

DEV = "hip:0"


def _budget(s):
    return s.budget_query(DEV)


def test_at_start_hip_binds_clamped_to_its_own_total():
    s = session("strix-halo-128gb")
    b = _budget(s)
    info = sim(s).meminfo()
    assert info["MemFree"] > 96 * GiB  # what the runtime answers as free: above its own total
    assert b.unified and b.total == 96 * GiB and b.free == 96 * GiB
    assert b.source.startswith("APU pool, bound by hipMemGetInfo: ")
    assert f"reported {format_size(info['MemFree'])} above its own total 96.0 GiB" in b.source
    assert "sysfs 96.5 GiB (carve-out 512.0 MiB + GTT 96.0 GiB less 0 bytes used" in b.source
    assert "MemAvailable" in b.source and "kept for the system" in b.source
    s.close()


def test_device_memory_makes_sysfs_bind():
    s = session("strix-halo-128gb")
    r = s.reserve(DEV, 30 * GiB)
    assert s.fault(r, 0, 30 * GiB).ok  # the runtime's free (MemFree) now below its total: taken as it is
    b = _budget(s)
    assert sim(s).meminfo()["MemFree"] < 96 * GiB
    assert b.source.startswith("APU pool, bound by sysfs: "), b.source
    assert b.free == 96 * GiB + 512 * MiB - 30 * GiB  # what the carve-out and the GTT leave
    s.release_reservation(r)
    assert _budget(s).free == 96 * GiB  # really released: back to the start
    s.close()


def test_host_memory_makes_memavailable_bind():
    s = session("strix-halo-128gb")
    sim(s).page_cache = 0  # nothing to reclaim: the runtime's free (MemFree) is MemAvailable, less no reserve
    sim(s).host_alloc(60 * GiB)  # the host's own use of the same memory: sysfs does not see it
    b = _budget(s)
    info = sim(s).meminfo()
    assert b.source.startswith("APU pool, bound by MemAvailable: "), b.source
    assert b.free == info["MemAvailable"] - system_reserve(info["MemTotal"])
    s.close()


def test_the_doctor_line_names_all_three(capsys):
    import os

    from membackend._cli import main
    os.environ["MEMBACKEND_SIM_PROFILE"] = "strix-halo-128gb"
    try:
        main(["doctor"])
    except SystemExit:
        pass
    finally:
        del os.environ["MEMBACKEND_SIM_PROFILE"]
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.strip().startswith("hip:0: total"))
    for part in ("bound by hipMemGetInfo", "hipMemGetInfo 96.0 GiB", "sysfs 96.5 GiB", "MemAvailable"):
        assert part in line, line
    assert "self-test: passed" in out


def test_a_discrete_card_budget_is_its_hipmemgetinfo():
    s = session("rx7900xtx-linux")
    b = _budget(s)
    assert not b.unified and b.total == 24 * GiB and b.source.startswith("hipMemGetInfo")
    assert b.headroom == DISCRETE_HEADROOM
    s.close()


def test_headroom_is_the_one_pool_rule_on_an_apu():
    s = session("strix-halo-128gb")
    assert _budget(s).headroom == one_pool_headroom(96 * GiB) == 12 * GiB
    s.close()
    assert headroom(128 * GiB, integrated=True) == 16 * GiB and headroom(8 * GiB) == 512 * MiB
    assert headroom(512 * MiB) == 256 * MiB  # never more than half a device


def test_a_fault_past_the_pool_is_refused_before_the_driver_is_asked():
    s = session("strix-halo-128gb")
    r = s.reserve(DEV, 100 * GiB)
    before = dict(sim(s).faults.calls)
    f = s.fault(r, 0, 90 * GiB)  # past the 84 GiB usable (96 GiB less the 12 GiB headroom)
    assert not f.ok
    assert sim(s).faults.calls.get("hipMemCreate", 0) == before.get("hipMemCreate", 0)
    s.release_reservation(r)
    s.close()
