"""The lab's builders (``membackend.lab``, its ``simulated`` and ``real`` modules): sessions on simulated profiles
(the generic platform with the profile's knobs, a plugin's record, a variant driver, a backend built by the caller,
given machine facts), host sessions, the helpers beside them (drivers, machines, profile names, the simulated
failures, the stock models, the real-GPU pieces over a simulated driver), their typed errors, and what importing
them pulls in. The kit's fixtures over them: tests/test_testing_fixtures.py."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

import membackend.lab as lab
from membackend import ResidencyManager, Session
from membackend._drivers.open import profile_names
from membackend._drivers.sim import SimulatedBugcheck, SimulatedCrash, get_profile
from membackend.lab import real, simulated, simulated_session
from membackend.lab._replay import stock
from membackend.lab.simulated import (
    AimdoStockVmm,
    StockManager,
    simulated_driver,
    simulated_failures,
    simulated_machine,
    simulated_profiles,
)
from membackend.platform import GENERIC
from membackend.types import Capabilities, ConfigError, Device, Machine

MiB = 1 << 20
#: the lab's errors, public at membackend.lab (issue 44; tests/test_promise_moves.py checks their old names)
LAB_ERRORS = ["ReplayError", "PluginMissing", "UnknownScenario", "TraceError", "TraceWriteError", "TimelineError",
              "PlotUnavailable", "PlotFormatError", "StartupCostError"]


# --------------------------------------------------------------------------- sessions on simulated profiles


@pytest.mark.parametrize("profile", profile_names(vmm_only=True))
def test_a_simulated_session_runs_the_generic_platform_with_the_profiles_knobs(profile):
    p = get_profile(profile)
    s = simulated_session(profile)
    try:
        device = Device(p.vendor, 0)
        assert s.name == GENERIC.name and s.backend.platform is GENERIC
        assert s.backend.capabilities == p.capabilities()
        assert [d.device for d in s.machine.devices] == [Device(p.vendor, i) for i in range(len(p.devices))]
        assert s.backend.driver.sim.profile.name == profile and s.ledger.sanitize is False
        r = s.reserve(device, 3 * MiB)
        assert s.fault(r, 0, r.size).ok
        state = s.inspect(device)
        assert (state.reserved, state.resident) == (r.size, r.size) == (s.ledger.account(device).reserved,
                                                                        s.ledger.account(device).resident)
    finally:
        s.close()
    assert s.reservations() == [] and s.backend.driver.sim.state()["reservations"] == 0


def test_every_session_gets_its_own_simulation():
    a, b = simulated_session("h200"), simulated_session("h200")
    try:
        r = a.reserve("cuda:0", 2 * MiB)
        a.fault(r, 0, r.size)
        assert a.backend.driver.sim is not b.backend.driver.sim
        assert b.inspect("cuda:0").reserved == 0 and b.backend.driver.sim.state()["mapped"] == 0
    finally:
        a.close()
        b.close()


def test_settings_and_capabilities_reach_the_backend_the_ledger_and_the_trace(tmp_path):
    caps = Capabilities(recycle_handles=True, fence_granularity="device")
    trace = tmp_path / "t.jsonl"
    s = simulated_session("wddm-6gb", capabilities=caps, page_size=64 * MiB, headroom=128 * MiB, sanitize=True,
                          trace=trace)
    try:
        assert s.backend.capabilities is caps and s.backend.requested_page_size == 64 * MiB
        assert s.ledger.sanitize is True and s.budget_query("cuda:0").headroom == 128 * MiB
        r = s.reserve("cuda:0", 1)
        assert r.page_size == 64 * MiB
    finally:
        s.close()
    text = trace.read_text()
    assert '"event": "trace"' in text and '"sim_profile": "wddm-6gb"' in text and '"event": "reserve"' in text


def test_a_plugins_platform_is_used_as_the_plugin_uses_it():
    pytest.importorskip("membackend_cuda_wddm")
    from membackend_cuda_wddm import PLATFORM

    s = simulated_session("wddm-6gb", PLATFORM)
    try:
        assert s.name == PLATFORM.name and s.backend.capabilities == PLATFORM.capabilities
        assert s.budget_query("cuda:0").source.startswith("DXGI")  # the platform's budget source
    finally:
        s.close()


def test_a_platform_for_another_vendor_is_a_config_error_naming_the_profiles_that_fit():
    pytest.importorskip("membackend_cuda_wddm")
    from membackend_cuda_wddm import PLATFORM

    with pytest.raises(ConfigError, match="profile 'rocm-win-2gpu' simulates hip, not cuda; accepted: .*h200"):
        simulated_session("rocm-win-2gpu", PLATFORM)


@pytest.mark.parametrize("kwargs, key, match", [
    ({"profile": "no-such-gpu"}, "sim_profile", "unknown simulation profile 'no-such-gpu'; accepted: wddm-6gb"),
    ({"profile": "h200", "platform": "generic"}, "platform", "'generic' is not a Platform; accepted: a membackend"),
    ({"profile": "h200", "capabilities": {"recycle_handles": True}}, "capabilities", "is not a Capabilities"),
    ({"profile": "h200", "page_size": "lots"}, "page_size", "accepted"),
])
def test_bad_arguments_are_typed_and_say_what_is_accepted(kwargs, key, match):
    with pytest.raises(ConfigError, match=match) as raised:
        simulated_session(**kwargs)
    assert raised.value.key == key


def test_a_plugin_platform_runs_with_its_own_page_size_and_declared_settings(monkeypatch):
    """As the plugin runs in membackend: the platform's page size, and its settings read from the sources."""
    wddm = pytest.importorskip("membackend_cuda_wddm")
    monkeypatch.setenv("MEMBACKEND_CUDA_WDDM_HEADROOM", "1GiB")
    s = simulated_session("wddm-6gb", wddm.PLATFORM)
    try:
        assert s.reserve("cuda:0", 1).page_size == wddm.PLATFORM.page_size != 2 * MiB
        room, source = s.headroom_in_force("cuda:0")
        assert room == 1 << 30 and "MEMBACKEND_CUDA_WDDM_HEADROOM" in source, source
    finally:
        s.close()


# --------------------------------------------------------------------------- no pytest, names, the stock models


@pytest.mark.parametrize("module", ["membackend.lab", "membackend.lab.simulated", "membackend.lab.real"])
def test_the_builders_import_neither_pytest_nor_the_kit(module):
    """Benchmarks and a plugin's comparison code run without the kit extra: importing the builders pulls in
    no pytest, hypothesis, torch or GPU binding, nor the kit; the package and ``real`` not even the session
    (lazy)."""
    code = (f"import sys, {module}\n"
            "heavy = [m for m in ('pytest', 'hypothesis', 'torch', 'cuda', 'hip', 'comfy_aimdo', 'membackend.testing')"
            " if m in sys.modules]\n"
            "print(heavy, 'membackend._session' in sys.modules)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["[]", str(module == "membackend.lab.simulated")], p.stdout


def test_every_builder_is_exported_lazily_from_the_lab_package_and_none_from_the_kit():
    import membackend.testing as kit

    names = ["simulated_session", "host_session", "simulated_driver", "simulated_machine", "simulated_profiles",
             "simulated_failures", "StockManager", "AimdoStockVmm", "AimdoLoadManager"]
    assert set(simulated.__all__) == set(names)
    assert set(lab.__all__) == set(names) | set(real.__all__) | set(LAB_ERRORS)
    for name in names:
        assert getattr(lab, name) is getattr(simulated, name)
    for name in real.__all__:
        assert getattr(lab, name) is getattr(real, name)
    assert (lab.StockManager, lab.AimdoStockVmm, lab.AimdoLoadManager) == \
        (stock.StockManager, stock.AimdoStockVmm, stock.AimdoLoadManager)
    assert not set(kit.__all__) & set(lab.__all__)  # the kit is the kit again
    with pytest.raises(AttributeError, match="simulated_session"):
        kit.simulated_session  # noqa: B018


def test_the_profiles_and_the_failures():
    assert simulated_profiles() == profile_names() and simulated_profiles(vmm_only=True) == profile_names(True)
    assert set(simulated_profiles(vmm_only=True)) < set(simulated_profiles())
    assert simulated_failures() == (SimulatedBugcheck, SimulatedCrash)
    assert all(issubclass(e, BaseException) and not issubclass(e, Exception) for e in simulated_failures())


# --------------------------------------------------------------------------- drivers and machines


def test_a_simulated_driver_is_a_fresh_simulation_or_a_variant():
    a, b = simulated_driver("h200"), simulated_driver("h200", "cuda")
    assert a.sim is not b.sim and a.vendor == "cuda" and a.sim.profile == get_profile("h200")
    v = simulated_driver("wddm-6gb", hold_bytes=False, pagein_seconds=0.02, copy_bandwidth=5e9,
                         device_memory=8 << 30)
    assert (v.sim.profile.name, v.sim.profile.pagein_seconds, v.sim.profile.copy_bandwidth) == ("wddm-6gb", 0.02, 5e9)
    assert [d.vram for d in v.sim.profile.devices] == [8 << 30]


@pytest.mark.parametrize("args, kwargs, key, match", [
    (("no-such-gpu",), {}, "sim_profile", "unknown simulation profile 'no-such-gpu'"),
    (("h200", "rocm"), {}, "vendor", "unknown vendor 'rocm'; accepted: cuda, hip"),
    (("rocm-win-2gpu", "cuda"), {}, "vendor", "simulates hip, not cuda; accepted: hip, or None"),
    (("h200",), {"pagein_secs": 1.0}, "profile variant",
     "unknown profile field.*pagein_secs; accepted: .*pagein_seconds"),
])
def test_a_bad_driver_request_is_a_config_error(args, kwargs, key, match):
    with pytest.raises(ConfigError, match=match) as raised:
        simulated_driver(*args, **kwargs)
    assert raised.value.key == key


def test_a_simulated_machine_is_the_profiles_as_a_session_gets_it():
    m = simulated_machine("rocm-win-2gpu")
    assert isinstance(m, Machine) and m.os == "windows"
    assert [d.device for d in m.devices] == [Device("hip", 0), Device("hip", 1)]
    s = simulated_session("rocm-win-2gpu")
    try:
        assert s.machine.devices == m.devices and s.machine.os == m.os
    finally:
        s.close()
    with pytest.raises(ConfigError, match="unknown simulation profile"):
        simulated_machine("no-such-gpu")


# --------------------------------------------------------------------------- the builder's options


def test_a_backend_built_by_the_caller_runs_as_it_is_on_the_profiles_machine():
    """The stock comfy-aimdo model over a variant driver, with the stock policy on it."""
    driver = simulated_driver("wddm-6gb", hold_bytes=False, pagein_seconds=0.001)
    backend = AimdoStockVmm(driver, budget_source="wddm")
    s = simulated_session("wddm-6gb", backend=backend, sanitize=True)
    try:
        assert isinstance(s, Session) and s.backend is backend and s.name == "aimdo_stock"
        assert s.backend.driver is driver and s.machine.os == "windows" and s.ledger.sanitize is True
        assert s.budget_query("cuda:0").source.startswith("DXGI")  # the backend's own budget source
        policy = StockManager(s)
        m = policy.register("m", 64 << 20, Device("cuda", 0))
        policy.use([m])
        assert policy.fault(m, 0, m.size).ok and s.inspect("cuda:0").resident == m.size
        policy.unload_all()
        del m
    finally:
        s.close()


@pytest.mark.parametrize("option", ["platform", "driver", "capabilities", "page_size"])
def test_a_built_backend_refuses_the_options_it_brings_itself(option):
    values = {"platform": GENERIC, "driver": simulated_driver("h200"), "capabilities": Capabilities(),
              "page_size": 64 << 20}
    backend = AimdoStockVmm(simulated_driver("h200"))
    with pytest.raises(ConfigError, match=f"{option} given together with backend=.*brings its own") as raised:
        simulated_session("h200", backend=backend, **{option: values[option]})
    assert raised.value.key == option


def test_a_backend_without_a_name_is_a_config_error():
    with pytest.raises(ConfigError, match="is no backend .*accepted: a backend object") as raised:
        simulated_session("h200", backend=object())
    assert raised.value.key == "backend"


def test_a_variant_driver_runs_under_the_platform_and_a_wrong_one_is_refused():
    driver = simulated_driver("h200", hold_bytes=False, copy_bandwidth=1e9)
    s = simulated_session("h200", driver=driver, page_size="64MiB")
    try:
        assert s.backend.driver is driver and s.backend.capabilities == get_profile("h200").capabilities()
        assert s.reserve("cuda:0", 1).page_size == 64 << 20
    finally:
        s.close()
    with pytest.raises(ConfigError, match="simulated driver of profile 'gb10-128gb', not of 'h200'") as raised:
        simulated_session("h200", driver=simulated_driver("gb10-128gb"))
    assert raised.value.key == "driver"
    with pytest.raises(ConfigError, match="not a simulated driver") as raised:
        simulated_session("h200", driver=object())
    assert raised.value.key == "driver"
    with pytest.raises(ConfigError, match="hip driver; the platform needs cuda") as raised:
        simulated_session("rocm-win-2gpu", dataclasses.replace(GENERIC, vendor="cuda"),
                          driver=simulated_driver("rocm-win-2gpu"))
    assert raised.value.key == "driver"


def test_machine_facts_given_as_they_are_or_as_overrides():
    facts = simulated_machine("h200")
    mine = Machine(os="windows", cpus=2, ram_total=1 << 34, ram_available=1 << 33, cgroup_limit=None,
                   torch_version=None, torch_vendor=None, devices=facts.devices)
    s = simulated_session("h200", machine=mine)
    try:
        assert s.machine is mine
    finally:
        s.close()
    s = simulated_session("h200", machine={"os": "windows"})
    try:
        assert s.machine.os == "windows" and "os" in s.machine.overridden
    finally:
        s.close()
    with pytest.raises(ConfigError, match="neither machine facts nor overrides") as raised:
        simulated_session("h200", machine="windows")
    assert raised.value.key == "machine"
    with pytest.raises(ConfigError, match="unknown key") as raised:
        simulated_session("h200", machine={"nope": 1})
    assert raised.value.key == "machine.nope"


def test_the_residency_policy_goes_on_a_simulated_session_by_public_names():
    s = simulated_session("gb10-128gb", page_size=32 << 20)
    try:
        policy = ResidencyManager(s)
        m = policy.register("m", 1 << 30, Device("cuda", 0))
        policy.use([m])
        assert policy.fault(m, 0, m.size).ok
        policy.unpin(m, 0, m.size)
        policy.full_unload(m)
        assert s.ledger.account(Device("cuda", 0)).reservations_alive == 0
    finally:
        s.close()


# --------------------------------------------------------------------------- host sessions


def test_a_host_session_is_capped_and_keeps_its_headroom(tmp_path):
    trace = tmp_path / "host.jsonl"
    s = simulated.host_session(capacity="256MiB", headroom=16 << 20, sanitize=True, trace=trace)
    try:
        here = real.this_machine()  # this machine's facts, never a profile's
        assert s.name == "host" and s.ledger.sanitize is True and (s.machine.os, s.machine.devices) == \
            (here.os, here.devices)
        b = s.budget_query("cpu")
        assert (b.total, b.headroom, b.usable) == (256 << 20, 16 << 20, b.free - (16 << 20))
        r = s.reserve("cpu", 4 << 20)
        assert s.fault(r, 0, r.size).ok and r.page_size == 2 << 20
    finally:
        s.close()
    assert s.reservations() == []
    text = trace.read_text()
    assert '"backend": "host"' in text and '"sim_profile": null' in text and '"event": "fault"' in text


def test_a_host_session_without_a_cap_uses_the_backends_own_headroom():
    s = simulated.host_session(page_size=4 << 20)
    try:
        assert s.budget_query("cpu").headroom == 512 << 20 and s.reserve("cpu", 1).page_size == 4 << 20
    finally:
        s.close()


@pytest.mark.parametrize("kwargs, key", [
    ({"capacity": "lots"}, "host_capacity"),
    ({"headroom": -1}, "headroom"),
    ({"page_size": 3 << 20}, "page_size"),
    ({"sim_profile": "h200"}, "sim_profile"),
    ({"backend": "vmm"}, "backend"),
])
def test_a_bad_host_session_argument_is_a_config_error(kwargs, key):
    with pytest.raises(ConfigError) as raised:
        simulated.host_session(**kwargs)
    assert raised.value.key == key


# --------------------------------------------------------------------------- what a real-GPU check needs


def test_the_real_gpu_pieces_work_over_a_simulated_driver():
    """``membackend.Session(vmm_backend(driver), machine=this_machine())`` with an event token, as
    ``benchmarks/bench_gpu.py`` builds it over ``cuda_driver()``."""
    pytest.importorskip("cuda.bindings.driver")  # the simulated CUDA driver's types
    driver = simulated_driver("h200")
    assert isinstance(real.this_machine(), Machine)
    s = Session(real.vmm_backend(driver, page_size=32 << 20), machine=real.this_machine())
    try:
        assert s.name == "vmm" and s.backend.driver is driver
        r = s.reserve("cuda:0", 64 << 20)
        assert r.page_size == 32 << 20 and s.fault(r, 0, r.size).ok
        stream, pinned = driver.stream_create(), driver.host_alloc_pinned(1 << 20)
        driver.memcpy_htod_async(r.base, pinned, 1 << 20, stream)
        event = driver.event_create()
        driver.event_record(event, stream)
        token = real.event_token(driver, event, 0)
        s.record(r, token)
        s.free(r)
        assert token.done()
        driver.host_free_pinned(pinned)
    finally:
        s.close()


@pytest.mark.parametrize("call, key", [
    (lambda d: real.vmm_backend(object()), "driver"),
    (lambda d: real.vmm_backend(d, "generic"), "platform"),
    (lambda d: real.vmm_backend(d, capabilities={"recycle_handles": True}), "capabilities"),
    (lambda d: real.vmm_backend(d, page_size=0), "page_size"),
    (lambda d: real.vmm_backend(d, page_size=True), "page_size"),
    (lambda d: real.event_token(d, None, -1), "device"),
])
def test_a_bad_real_gpu_argument_is_a_config_error(call, key):
    with pytest.raises(ConfigError) as raised:
        call(simulated_driver("h200"))
    assert raised.value.key == key


def test_a_platform_of_another_vendor_is_refused_by_vmm_backend():
    hip_platform = dataclasses.replace(GENERIC, name="hip_only", vendor="hip")
    with pytest.raises(ConfigError, match="is for hip, the driver is cuda") as raised:
        real.vmm_backend(simulated_driver("h200"), hip_platform)
    assert raised.value.key == "platform"
