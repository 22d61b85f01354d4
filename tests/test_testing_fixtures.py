"""The kit's fixtures and builders (``membackend.testing.fixtures``): the clean environment, sessions on
simulated profiles (the generic platform with the profile's knobs, or a plugin's record), their typed errors,
and the fixtures as a third party's tests get them (a pytest run in a subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from membackend._drivers.sim import get_profile
from membackend._drivers.open import profile_names
from membackend.platform import GENERIC
from membackend.testing import clean_environment, simulated_session
from membackend.types import Capabilities, ConfigError, Device

MiB = 1 << 20


# --------------------------------------------------------------------------- the clean environment


def test_clean_environment_removes_every_membackend_variable_and_the_names_given(monkeypatch, tmp_path):
    monkeypatch.setenv("MEMBACKEND_BACKEND", "vmm")
    monkeypatch.setenv("MEMBACKEND_CONFIG", str(tmp_path / "elsewhere.toml"))
    monkeypatch.setenv("MEMBACKEND_CUDA_WDDM_HEADROOM", "1GiB")
    monkeypatch.setenv("OCL_SET_SVM_SIZE", "4096")
    monkeypatch.setenv("MEMBACKENDISH", "kept")  # not the prefix: not membackend's
    empty = tmp_path / "empty"
    empty.mkdir()
    clean_environment(monkeypatch, empty, also=("OCL_SET_SVM_SIZE",))
    assert [k for k in os.environ if k.startswith("MEMBACKEND_")] == []
    assert "OCL_SET_SVM_SIZE" not in os.environ and os.environ["MEMBACKENDISH"] == "kept"
    assert Path.cwd() == empty


def test_the_clean_env_fixture_keeps_the_developers_settings_out(tmp_path):
    """From outside (a pytest run with a MEMBACKEND_* variable and a membackend.toml where it starts), a
    test asking for ``membackend_clean_env`` sees neither; the variable is back after the test."""
    (tmp_path / "membackend.toml").write_text('backend = "vmm"\n')
    (tmp_path / "test_clean.py").write_text(
        "import os\n"
        "from pathlib import Path\n"
        "from membackend._settings import load_settings\n"
        "def test_clean(membackend_clean_env):\n"
        "    assert not [k for k in os.environ if k.startswith('MEMBACKEND_')]\n"
        "    assert Path.cwd() == membackend_clean_env and list(membackend_clean_env.iterdir()) == []\n"
        "    assert load_settings().backend is None and load_settings().headroom is None\n"
        "def test_after():\n"
        "    assert os.environ['MEMBACKEND_HEADROOM'] == '1GiB'\n")
    env = {**os.environ, "MEMBACKEND_HEADROOM": "1GiB", "MEMBACKEND_BACKEND": "host"}
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_clean.py"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "2 passed" in p.stdout, p.stdout[-3000:] + p.stderr[-2000:]


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


def test_the_fixture_closes_every_session_it_made(tmp_path):
    (tmp_path / "test_made.py").write_text(
        "made = []\n"
        "def test_make(membackend_simulated):\n"
        "    for profile in ('h200', 'rocm-win-2gpu'):\n"
        "        s = membackend_simulated(profile)\n"
        "        r = s.reserve(s.devices()[0], 1 << 21)\n"
        "        assert s.fault(r, 0, r.size).ok\n"
        "        made.append(s)\n"
        "def test_closed_afterwards():\n"
        "    assert len(made) == 2\n"
        "    for s in made:\n"
        "        assert s.reservations() == [] and s.backend.driver.sim.state()['reservations'] == 0\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMBACKEND_")}
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_made.py"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "2 passed" in p.stdout, p.stdout[-3000:] + p.stderr[-2000:]


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
