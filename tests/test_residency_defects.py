"""Residency manager defects found under stress (issue 7, section 4): each test failed before its fix.

Run on the host backend with a small capacity and on the VMM backend over the
simulated profiles, like ``test_residency.py``. Driver failures are injected
through the simulated platform's fault plan (one helper, :func:`fail_call`).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import threading
import types

import pytest
from test_residency import TARGETS, Env, load, sim_of

from membackend import _residency as residency
from membackend._backends.vmm import AddressWindowsExhausted, VmmBackend
from membackend.platform import GENERIC
from membackend._drivers.sim import get_profile, sim_driver
from membackend._ledger import Ledger
from membackend._machine import gather_machine
from membackend._residency import ModelKind, ResidencyManager
from membackend._replay.stock import StockPolicy
from membackend._session import Session
from membackend.types import (
    Device,
    DriverError,
    InvalidSize,
    MembackendError,
    OutOfRange,
    PartialFailure,
    WrongDevice,
)

MiB = 1 << 20
SIM_TARGETS = [t for t in TARGETS if t != "host"]
INVALID_VALUE = 1  # CUDA_ERROR_INVALID_VALUE and hipErrorInvalidValue are both 1
HIP_OUT_OF_MEMORY = 2  # hipError_t.hipErrorOutOfMemory


def fail_call(s: Session, call: str, code: int = INVALID_VALUE, nth: int = 1, times: int | None = 1):
    """Fail the simulated driver's ``call`` (its vendor name) the ``nth`` time from now on."""
    faults = sim_of(s).faults
    return faults.add(call, code, nth=faults.calls.get(call, 0) + nth, times=times)


def api(s: Session, name: str) -> str:
    """The vendor's name of a driver call: ``api(s, "MemUnmap")`` is cuMemUnmap or hipMemUnmap."""
    return ("hip" if sim_of(s).profile.vendor == "hip" else "cu") + name


def ledger_matches_policy(s: Session, policy: ResidencyManager) -> None:
    for m in policy.models():
        for d, slot in m.slots.items():
            r = m.reservation(d)
            expected = s.ledger.resident(r) if r is not None else 0
            assert slot.resident_bytes() == expected, (m.id, str(d), slot.resident_bytes(), expected)
        assert policy.stats()[m.id]["resident"] == sum(
            s.ledger.resident(m.reservation(d)) for d in m.slots if m.reservation(d) is not None)


def recycling_session(target: str) -> tuple[Session, Device]:
    p = get_profile(target)
    caps = dataclasses.replace(p.capabilities(), recycle_handles=True)
    backend = VmmBackend(GENERIC, sim_driver(p), page_size=64 * MiB, capabilities=caps)
    s = Session(backend, machine=gather_machine(), ledger=Ledger(sanitize=True))
    return s, Device(p.vendor, 0)


# --------------------------------------------------------------------------- no arrow up: the tracer


def test_residency_imports_the_tracer_for_annotations_only():
    tree = ast.parse(inspect.getsource(residency))
    runtime = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    names = [(n.module or "") if isinstance(n, ast.ImportFrom) else ",".join(a.name for a in n.names)
             for n in runtime]
    assert not [n for n in names if n.endswith("trace")], names


def test_the_policy_traces_to_the_sessions_tracer():
    class Recorder:
        def __init__(self):
            self.events = []

        def event(self, event, **fields):
            self.events.append(event)

    named, observer = Recorder(), Recorder()
    stand_in = types.SimpleNamespace(tracer=named, observers=[observer])  # only what the policy reads
    policy = ResidencyManager(stand_in)  # type: ignore[arg-type]
    assert policy.tracer is named
    explicit = Recorder()
    assert ResidencyManager(stand_in, tracer=explicit).tracer is explicit  # type: ignore[arg-type]


# --------------------------------------------------------------------------- 4.8: register rolls back


@pytest.mark.parametrize("target", TARGETS)
def test_register_on_a_missing_second_device_leaves_nothing_reserved(target):
    env = Env(target)
    s = env.session()
    policy = ResidencyManager(s)
    baseline = s.ledger.account(env.device), env.driver_state(s)  # the raw driver: nothing kept either
    with pytest.raises(WrongDevice):
        policy.register("m", env.size(0.2), [env.device, Device(env.device.kind, 7)])
    assert (s.ledger.account(env.device), env.driver_state(s)) == baseline
    assert policy.models() == [] and s.reservations() == []
    assert policy.register("m", env.size(0.2), env.device).reservation() is not None  # the id is free again


def test_register_failing_on_the_second_gpu_returns_the_first_reservation():
    env = Env("rocm-win-2gpu")
    s = env.session()
    policy = ResidencyManager(s)
    sim = sim_of(s)
    commit = sim.private_commit
    fail_call(s, "hipMemAddressReserve", HIP_OUT_OF_MEMORY, nth=2)
    # a large window the runtime refuses under the reserve-churn limit is out of memory, typed (issue 17)
    with pytest.raises(AddressWindowsExhausted) as raised:
        policy.register("unet", 2 << 30, ["hip:0", "hip:1"])
    assert isinstance(raised.value.__cause__, DriverError) and raised.value.__cause__.code == HIP_OUT_OF_MEMORY
    assert sim.private_commit == commit, "the first device's reservation stayed charged to private commit"
    assert sim.state()["reservations"] == 0 and s.ledger.account(Device("hip", 0)).reservations_alive == 0
    assert policy.models() == []


@pytest.mark.parametrize("target", TARGETS)
def test_register_refuses_bad_arguments_before_reserving(target):
    env = Env(target)
    s = env.session()
    policy = ResidencyManager(s)
    owner = policy.register("owner", env.page, env.device)
    baseline = s.ledger.account(env.device), env.driver_state(s)
    with pytest.raises(WrongDevice, match="twice"):
        policy.register("m", env.page, [env.device, str(env.device)])
    with pytest.raises(WrongDevice, match="at least one"):
        policy.register("m", env.page, [])
    with pytest.raises(MembackendError, match="accepted: diffusion"):
        policy.register("m", env.page, env.device, kind="lora")
    with pytest.raises(MembackendError, match="not registered"):
        policy.register("m", env.page, env.device, owner=ResidencyManager(s).register("x", env.page, env.device))
    with pytest.raises(MembackendError, match="model id"):
        policy.register(7, env.page, env.device)  # type: ignore[arg-type]
    with pytest.raises(InvalidSize):
        policy.register("m", 0, env.device)
    assert [m.id for m in policy.models()] == ["owner"] and owner.owned == []
    acct = s.ledger.account(env.device)
    assert acct.reservations_alive == baseline[0].reservations_alive + 1  # only the stray manager's "x"


@pytest.mark.parametrize("target", TARGETS)
def test_fault_and_unpin_refuse_bad_ranges_before_evicting_anything(target):
    env = Env(target)
    s = env.session()
    policy = ResidencyManager(s)
    a, b = policy.register("a", env.size(0.6), env.device), policy.register("b", env.size(0.6), env.device)
    load(policy, a)
    for offset, size, error in (("0", env.page, InvalidSize), (0, None, InvalidSize), (0, 0, InvalidSize),
                                (-env.page, env.page, OutOfRange), (0, b.size + 1, OutOfRange),
                                (True, env.page, InvalidSize)):
        with pytest.raises(error):
            policy.fault(b, offset, size)
        with pytest.raises(error):
            policy.unpin(b, offset, size)
    assert policy.stats()["a"]["resident"] == a.size, "a refused fault evicted nothing"


# --------------------------------------------------------------------------- 4.9 and 4.7: unload carries on, then trims


@pytest.mark.parametrize("target", TARGETS)
def test_unload_all_carries_on_past_a_failing_model_and_names_it(target, monkeypatch):
    env = Env(target)
    s = env.session()
    policy = ResidencyManager(s)
    baseline = s.ledger.account(env.device), env.driver_state(s)
    a, b, c = (policy.register(n, env.size(0.2), env.device) for n in "abc")
    for m in (a, b, c):
        load(policy, m)
    broken = {a.reservation().id, b.reservation().id}
    release = s.release_reservation

    def failing_release(r):
        if r.id in broken:
            raise DriverError(INVALID_VALUE, "release", "injected by the test")
        return release(r)

    monkeypatch.setattr(s, "release_reservation", failing_release)
    with pytest.raises(PartialFailure) as raised:
        policy.unload_all()
    assert [what for what, _ in raised.value.failures] == [f"model 'a' on {env.device}", f"model 'b' on {env.device}"]
    assert all(isinstance(err, DriverError) for _, err in raised.value.failures)
    assert "model 'a'" in str(raised.value) and "model 'b'" in str(raised.value)
    stats = policy.stats()
    assert not stats["c"]["reserved"], "the model after the failures was unloaded too"
    ledger_matches_policy(s, policy)
    monkeypatch.undo()
    assert policy.unload_all() >= 0  # the failed ones are retried
    assert (s.ledger.account(env.device), env.driver_state(s)) == baseline


def test_full_unload_of_a_two_gpu_model_carries_on_to_the_second_device():
    env = Env("rocm-win-2gpu")
    s = env.session()
    policy = ResidencyManager(s)
    sim = sim_of(s)
    commit = sim.private_commit
    unet = policy.register("unet", 2 << 30, ["hip:0", "hip:1"])
    hook = policy.register("unet/hook", 1 << 30, "hip:0", ModelKind.HOOK_DELEGATE, owner=unet)
    for d in unet.devices:
        policy.fault(unet, 0, unet.size, d)
    load(policy, hook)
    fail_call(s, "hipMemUnmap")  # the hook, unloaded first, cannot drop its first page
    with pytest.raises(PartialFailure) as raised:
        policy.full_unload(unet)
    assert [what for what, _ in raised.value.failures] == ["model 'unet/hook' on hip:0"]
    assert not policy.stats()["unet"]["reserved"] and policy.stats()["unet/hook"]["reserved"]
    assert (s.inspect("hip:1").reserved, s.inspect("hip:1").resident) == (0, 0)
    ledger_matches_policy(s, policy)
    policy.full_unload(unet)
    assert sim.state()["mapped"] == 0 and s.inspect("hip:0").reserved == 0
    policy.unload_all()
    assert sim.private_commit == commit and sim.state()["reservations"] == 0


def test_unregister_that_fails_keeps_the_model_registered(monkeypatch):
    env = Env("h200")
    s = env.session()
    policy = ResidencyManager(s)
    m = policy.register("m", env.size(0.1), env.device)
    load(policy, m)
    fail_call(s, "cuMemAddressFree")
    with pytest.raises(PartialFailure):
        policy.unregister(m)
    assert [x.id for x in policy.models()] == ["m"], "still registered: it can be unregistered again"
    policy.unregister(m)
    assert policy.models() == [] and s.reservations() == []


def test_unload_all_gives_recycled_handles_back():
    s, device = recycling_session("wddm-6gb")
    policy = ResidencyManager(s)
    sim = sim_of(s)
    size = 512 * MiB
    a, b = policy.register("a", size, device), policy.register("b", size, device)
    for m in (a, b):
        load(policy, m)
    policy.free_memory(size, device)  # pages dropped by eviction keep their handles for reuse
    assert sim.state(0)["handles"] > 0
    policy.unload_all()
    assert sim.state(0)["handles"] == 0 and sim.state(0)["physical"] == 0, "spare handles outlived unload_all"
    assert sim.state(0)["reserved"] == 0


def test_stock_unload_all_gives_recycled_handles_back_too():
    s, device = recycling_session("wddm-6gb")
    stock = StockPolicy(s)
    sim = sim_of(s)
    m = stock.register("m", 512 * MiB, device)
    load(stock, m)
    stock.unload_all()
    assert sim.state(0)["handles"] == 0 and sim.state(0)["mapped"] == 0
    assert stock.stats()["m"]["reserved"], "the stock policy still keeps its reservation (ComfyUI #15993)"


# --------------------------------------------------------------------------- 4.10: failed fault or free


@pytest.mark.parametrize("target", SIM_TARGETS)
def test_pages_a_failed_fault_left_mapped_are_counted_and_evictable(target):
    env = Env(target)
    s = env.session()
    policy = ResidencyManager(s)
    sim = sim_of(s)
    m = policy.register("m", 4 * env.page, env.device)
    fail_call(s, api(s, "MemSetAccess"), nth=3)  # the third page fails ...
    fail_call(s, api(s, "MemUnmap"), nth=1)  # ... and its rollback cannot unmap the first two
    with pytest.raises(DriverError) as raised:
        policy.fault(m, 0, m.size)
    assert getattr(raised.value, "mapped", 0) > 0
    r = m.reservation()
    assert s.ledger.resident(r) > 0
    assert policy.stats()["m"]["resident"] == s.ledger.resident(r), "the policy's map disagrees with the ledger"
    left = s.ledger.resident(r)
    assert policy.free_memory(m.size, env.device) == left
    assert sim.state(env.device.index)["mapped"] == 0, "pages left mapped by the rollback could not be evicted"
    assert policy.stats()["m"]["resident"] == s.ledger.resident(r) == 0
    policy.use([m])  # lifts the watermark the eviction left
    assert policy.fault(m, 0, m.size).ok and policy.stats()["m"]["resident"] == s.ledger.resident(r) == m.size


@pytest.mark.parametrize("target", SIM_TARGETS)
def test_a_fault_finishes_pages_a_failed_fault_left_behind(target):
    env = Env(target)
    s = env.session()
    policy = ResidencyManager(s)
    m = policy.register("m", 4 * env.page, env.device)
    fail_call(s, api(s, "MemSetAccess"), nth=2)
    fail_call(s, api(s, "MemUnmap"), nth=1)
    with pytest.raises(DriverError):
        policy.fault(m, 0, m.size)
    f = policy.fault(m, 0, 2 * env.page)
    assert f.ok
    ledger_matches_policy(s, policy)
    policy.unpin(m, 0, 2 * env.page)
    policy.full_unload(m)
    assert sim_of(s).state(env.device.index)["mapped"] == 0


@pytest.mark.parametrize("target", SIM_TARGETS)
def test_a_free_that_fails_half_way_keeps_the_map_and_the_ledger_together(target):
    env = Env(target)
    s = env.session()
    policy = ResidencyManager(s)
    sim = sim_of(s)
    m = policy.register("m", 4 * env.page, env.device)
    load(policy, m)
    fail_call(s, api(s, "MemUnmap"), nth=2)  # the second page of the eviction cannot be unmapped
    with pytest.raises(DriverError):
        policy.free_memory(m.size, env.device)
    r = m.reservation()
    assert 0 < s.ledger.resident(r) < m.size
    ledger_matches_policy(s, policy)
    policy.full_unload(m)
    assert sim.state(env.device.index)["mapped"] == 0 and sim.state(env.device.index)["reservations"] == 0
    ledger_matches_policy(s, policy)


def test_a_failed_free_of_a_model_with_pins_leaves_the_pins_alone():
    env = Env("h200")
    s = env.session()
    policy = ResidencyManager(s)
    a, b = policy.register("a", 4 * env.page, env.device), policy.register("b", 4 * env.page, env.device)
    load(policy, a)
    policy.fault(b, 0, 4 * env.page)  # b stays pinned
    fail_call(s, "cuMemUnmap", nth=1)
    with pytest.raises(DriverError):
        policy.free_memory(8 * env.page, env.device)
    ledger_matches_policy(s, policy)
    assert policy.free_memory(8 * env.page, env.device) == a.size
    assert s.ledger.resident(a.reservation()) == 0 and sim_of(s).state(0)["mapped"] == b.size
    assert policy.stats()["b"]["resident"] == b.size, "pinned pages survive"


# --------------------------------------------------------------------------- threads


@pytest.fixture
def busy_switching():
    """Switch threads as often as the interpreter can, so races show up in a short run."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


@pytest.mark.parametrize("target", ["host", "wddm-6gb"])
def test_a_server_thread_frees_and_unloads_while_the_worker_faults(target, busy_switching):
    env = Env(target)
    s = env.session()
    policy = ResidencyManager(s)
    models = [policy.register(n, env.size(0.3), env.device) for n in ("image", "video", "vae")]
    errors: list[BaseException] = []
    done = threading.Event()

    def worker():
        try:
            for i in range(150):
                m = models[i % len(models)]
                policy.use([m])
                half = m.size // 2 // env.page * env.page
                for offset, size in ((0, half), (half, m.size - half)):
                    if policy.fault(m, offset, size).ok:
                        policy.unpin(m, offset, size)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
        finally:
            done.set()

    def server():
        try:
            while not done.is_set():
                policy.free_memory(env.size(0.2), env.device)
                policy.stats()
                policy.unload_all()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker), threading.Thread(target=server)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    ledger_matches_policy(s, policy)
    policy.unload_all()
    acct = s.ledger.account(env.device)
    assert (acct.reservations_alive, acct.reserved, acct.resident) == (0, 0, 0)
    state = env.driver_state(s)
    assert not state or (state["reserved"], state["mapped"], state["handles"]) == (0, 0, 0)


def test_each_full_unload_traces_the_commit_before_and_after(tmp_path):
    """rocm-win-2gpu charges reservations to private commit: the trace shows it go back on unload."""
    import json

    from membackend._manager import BackendManager
    from membackend._residency import ResidencyManager
    from membackend._settings import load_settings

    trace = tmp_path / "t.jsonl"
    s = BackendManager(load_settings(backend="vmm", sim_profile="rocm-win-2gpu", trace=trace)).session()
    policy = ResidencyManager(s)
    m = policy.register("unet", 1 << 30, "hip:0")
    policy.fault(m, 0, 64 << 20)
    policy.full_unload(m)
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    commit = [e for e in events if e["event"] == "commit"]
    assert commit and commit[0]["committed_before"] == 1 << 30 and commit[0]["committed_after"] == 0
    s.close()


def test_on_idle_gives_back_kept_windows_and_handles_but_keeps_models_resident():
    from membackend._manager import BackendManager
    from membackend._residency import ResidencyManager
    from membackend._settings import load_settings
    from membackend.types import Device

    s = BackendManager(load_settings(backend="vmm", sim_profile="h200")).session()
    s.backend.capabilities = type(s.backend.capabilities)(recycle_handles=True, recycle_limit=None)  # keep all
    policy = ResidencyManager(s)
    warm = policy.register("warm", 64 << 20, "cuda:0")
    gone = policy.register("gone", 64 << 20, "cuda:0")
    for m in (warm, gone):
        policy.use([m])
        assert policy.fault(m, 0, m.size).ok
        policy.unpin(m, 0, m.size)
    policy.full_unload(gone)
    assert s.inspect(Device("cuda", 0)).held == 64 << 20, "the unloaded model's handles are kept for reuse"
    assert policy.on_idle() == 64 << 20
    state = s.inspect(Device("cuda", 0))
    assert state.held == 0 and state.resident == 64 << 20 and policy.stats()["warm"]["resident"] == 64 << 20
    s.close()
