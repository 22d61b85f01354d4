"""The residency policy (``membackend._residency``) and the stock policy, on the host backend and on the
VMM backend over every simulated profile; then the defects found under stress (issue 7, section 4), each
test of which failed before its fix, with driver failures injected through the simulated platform's fault
plan (one helper, :func:`fail_call`); and the property that shedding never frees a pinned page."""

from __future__ import annotations

import ast
import ctypes
import dataclasses
import gc
import inspect
import json
import sys
import threading
import types

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from membackend import _residency as residency
from membackend._backends.host import HostBackend
from membackend._backends.vmm import AddressWindowsExhausted
from membackend._drivers.host import resident_bytes
from membackend._drivers.sim import get_profile
from membackend._ledger import Ledger
from membackend._machine import gather_machine
from membackend._residency import ModelKind, ResidencyManager, ResidencyPolicy
from membackend._session import Session
from membackend._trace import TraceObserver
from membackend.lab import simulated_session
from membackend.lab._replay.stock import StockManager
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
TARGETS = ["host", "wddm-6gb", "rocm-win-2gpu", "gb10-128gb", "h200"]


class Env:
    """One backend to run a policy on: a fresh session each time, the device, its usable capacity."""

    def __init__(self, target: str):
        self.target = target

    def session(self, observers=()) -> Session:
        if self.target == "host":
            backend = HostBackend(page_size=2 * MiB, capacity=256 * MiB, headroom=16 * MiB)
            s = Session(backend, machine=gather_machine(), ledger=Ledger(sanitize=True), observers=observers)
        else:
            s = simulated_session(self.target, page_size=64 * MiB, sanitize=True, observers=observers)
        self.device = s.devices()[0] if self.target == "host" else Device(s.backend.device_kinds[0], 0)
        self.page = 2 * MiB if self.target == "host" else 64 * MiB
        self.capacity = s.budget_query(self.device).usable
        return s

    def size(self, fraction: float) -> int:
        return int(self.capacity * fraction) // self.page * self.page

    def live_state(self, s: Session) -> dict:
        """The driver's own view of live reservations (what the backend keeps for reuse left out)."""
        st = s.inspect(self.device)
        return {} if st is None else {"reserved": st.reserved, "resident": st.resident}

    def driver_state(self, s: Session) -> dict:
        """Everything the simulated driver holds, kept windows and spare handles included."""
        sim = sim_of(s)
        if sim is None:
            return {}
        st = sim.state(self.device.index)
        return {"reserved": st["reserved"], "mapped": st["mapped"], "handles": st["handles"],
                "commit": sim.private_commit}


def sim_of(s: Session):
    """The simulated platform under a VMM session, or None (host). The one place that knows where it lives."""
    backend = s.backend
    if isinstance(backend, HostBackend):
        return None
    driver = getattr(backend, "_driver", None) or backend.driver
    return getattr(driver, "sim", None)


@pytest.fixture(params=TARGETS)
def env(request):
    return Env(request.param)


def load(policy, model):
    """What ComfyUI does per model in a run: fault every weight, copy, unpin."""
    f = policy.fault(model, 0, model.size)
    policy.unpin(model, 0, model.size)
    return f


def loaded(env: Env, fraction: float = 0.3, name: str = "a"):
    """A fresh session and policy with one model of ``fraction`` of the room, used by a run and loaded whole:
    ``(session, policy, model)``."""
    s = env.session()
    policy = ResidencyManager(s)
    model = policy.register(name, env.size(fraction), env.device)
    policy.use([model])
    load(policy, model)
    return s, policy, model


# --------------------------------------------------------------------------- keep warm (G4)


def test_keep_warm_keeps_the_image_model_through_video_and_audio(env):
    s = env.session()
    policy = ResidencyManager(s)
    image, video, audio = (policy.register(n, env.size(0.28), env.device) for n in ("image", "video", "audio"))
    policy.use([image])
    first = load(policy, image)
    for m in (video, audio):
        policy.use([m])
        assert load(policy, m).ok
    policy.use([image])
    again = load(policy, image)
    assert again.ok and again.mapped == 0 and again.generations == first.generations  # nothing to copy again
    assert all(v["resident"] > 0 for v in policy.stats().values())


def test_stock_loses_residency_on_every_workflow_change(env):
    s = env.session()
    stock = StockManager(s)
    image, video, audio = (stock.register(n, env.size(0.28), env.device) for n in ("image", "video", "audio"))
    stock.use([image])
    first = load(stock, image)
    for m in (video, audio):
        stock.use([m])
        load(stock, m)
    stock.use([image])
    again = load(stock, image)
    assert again.ok and again.mapped == image.size and again.generations != first.generations
    assert stock.stats()["video"]["resident"] == 0 and stock.stats()["video"]["reserved"]


def test_when_the_pool_does_not_fit_the_least_recently_used_model_goes(env):
    s = env.session()
    policy = ResidencyManager(s)
    image, video, audio = (policy.register(n, env.size(0.45), env.device) for n in ("image", "video", "audio"))
    for m in (image, video, audio):
        policy.use([m])
        assert load(policy, m).ok
    stats = policy.stats()
    assert stats["image"]["resident"] == 0, "the least recently used model is evicted"
    assert stats["video"]["resident"] == video.size and stats["audio"]["resident"] == audio.size
    policy.use([image])
    assert load(policy, image).ok
    stats = policy.stats()
    assert stats["video"]["resident"] == 0 and stats["audio"]["resident"] == audio.size


def test_keep_warm_never_evicts_a_model_of_the_current_run(env):
    s = env.session()
    policy = ResidencyManager(s)
    a, b, c = (policy.register(n, env.size(0.45), env.device) for n in ("a", "b", "c"))
    policy.use([a, b, c])
    fa, fb = policy.fault(a, 0, a.size), policy.fault(b, 0, b.size)  # pinned: the ops still run
    assert fa.ok and fb.ok
    fc = policy.fault(c, 0, c.size)
    assert not fc.ok, "everything else is pinned by the run: out of memory reaches the caller"
    assert policy.stats()["a"]["resident"] == a.size and policy.stats()["b"]["resident"] == b.size
    policy.unpin(a, 0, a.size)
    assert policy.fault(c, 0, c.size).ok, "retried after evicting the unpinned pages"
    assert policy.stats()["b"]["resident"] == b.size


# --------------------------------------------------------------------------- pages, pins, watermarks


def test_eviction_takes_top_pages_first_and_leaves_a_watermark(env):
    s = env.session()
    policy = ResidencyManager(s)
    a, b = policy.register("a", env.size(0.6), env.device), policy.register("b", env.size(0.6), env.device)
    policy.use([a, b])
    load(policy, a)
    pinned_top = a.size - env.page
    policy.fault(a, pinned_top, env.page)  # the last page stays pinned
    assert load(policy, b).ok
    slot = a.slots[env.device]
    assert slot.resident[0] == 1, "lower offsets survive longest"
    assert slot.resident[-1] == 1, "a pinned page is never evicted"
    freed_pages = [i for i, v in enumerate(slot.resident) if not v]
    assert freed_pages and freed_pages == list(range(freed_pages[0], freed_pages[-1] + 1))
    watermark = slot.watermark
    assert watermark == freed_pages[0] * env.page
    above = policy.fault(a, watermark, env.page)
    assert not above.ok, "faults above the watermark fail fast"
    assert policy.stats()["b"]["resident"] == b.size, "and evict nothing"
    policy.prioritize(a)
    assert policy.fault(a, watermark, env.page).ok, "until the model is prioritized again"


def test_headroom_is_kept_free_for_activations(env):
    s = env.session()
    policy = ResidencyManager(s)
    a, b = policy.register("a", env.size(0.7), env.device), policy.register("b", env.size(0.7), env.device)
    policy.use([a, b])
    load(policy, a)
    assert load(policy, b).ok
    budget = s.budget_query(env.device)
    assert budget.free >= budget.headroom


# --------------------------------------------------------------------------- full unload (G1, G5)


def test_full_unload_returns_everything_including_what_the_model_owns(env):
    s = env.session()
    policy = ResidencyManager(s)
    baseline, raw = (s.ledger.account(env.device), env.live_state(s)), env.driver_state(s)
    unet = policy.register("unet", env.size(0.3), env.device, ModelKind.DIFFUSION)
    hook = policy.register("unet/hook", env.size(0.1), env.device, ModelKind.HOOK_DELEGATE, owner=unet)
    cast = policy.register("unet/cast", env.page, env.device, ModelKind.CAST_BUFFER, owner=unet)
    policy.use([unet])
    first = policy.fault(unet, 0, unet.size)  # still pinned: unload takes its pins too
    load(policy, hook)
    load(policy, cast)
    policy.full_unload(unet)
    assert all(not v["reserved"] and v["resident"] == 0 for v in policy.stats().values())
    assert (s.ledger.account(env.device), env.live_state(s)) == baseline
    # the model object stays usable: it reserves again and its pages are new
    again = policy.fault(unet, 0, unet.size)
    assert again.ok and again.mapped == unet.size and set(again.generations).isdisjoint(first.generations)
    policy.unload_all()  # everything: what the backend kept for reuse (a churn-limited window) goes back too
    assert (s.ledger.account(env.device), env.driver_state(s)) == (baseline[0], raw)


def test_unload_all_leaves_no_reservation(env):
    s = env.session()
    policy = ResidencyManager(s)
    for n in ("a", "b"):
        load(policy, policy.register(n, env.size(0.2), env.device))
    policy.unload_all()
    acct = s.ledger.account(env.device)
    assert (acct.reservations_alive, acct.reserved, acct.resident) == (0, 0, 0)


def test_every_unload_goes_through_the_policys_full_unload_hook():
    """The caller's full_unload, unload_all, unregister and full_unload_unless_pinned each run the policy's
    full_unload_of, told why (``via``), so what a policy puts there (a count, an injected failure: the stand-in's
    scenario) is what every unload runs; a stand-in run caught a split that bypassed the seam (e5379ae)."""
    env = Env("h200")
    unloaded = []
    failing = []

    class Counting(ResidencyPolicy):
        def full_unload_of(self, model, via, unload):
            unloaded.append((model.id, via))
            if failing:
                raise RuntimeError("injected")
            return super().full_unload_of(model, via, unload)

    policy = ResidencyManager(env.session(), policy=Counting())
    a, b = (policy.register(n, env.size(0.1), env.device) for n in "ab")
    load(policy, a)
    policy.unload_all()
    assert sorted(unloaded) == [("a", "unload_all"), ("b", "unload_all")]
    unloaded.clear()
    policy.full_unload(a)
    assert policy.full_unload_unless_pinned(a) is not None
    policy.unregister(b)
    assert unloaded == [("a", None), ("a", None), ("b", "unregister")]

    failing.append(True)  # as the stand-in's scenario injects a failure into every unload
    with pytest.raises(PartialFailure, match="injected"):
        policy.unload_all()


def test_stock_full_unload_keeps_the_reservation_until_the_model_is_collected(env):
    s = env.session()
    stock = StockManager(s)
    baseline, raw = (s.ledger.account(env.device), env.live_state(s)), env.driver_state(s)
    unet = stock.register("unet", env.size(0.3), env.device)
    hook = stock.register("unet/hook", env.size(0.1), env.device, ModelKind.HOOK_DELEGATE, owner=unet)
    load(stock, unet)
    load(stock, hook)
    stock.full_unload(unet)
    acct = s.ledger.account(env.device)
    assert acct.reservations_alive == 2, "the reservations stay (ComfyUI #15993)"
    assert stock.stats()["unet/hook"]["resident"] == hook.size, "the Hook delegate survives (ComfyUI #15533)"
    if env.target == "rocm-win-2gpu":
        assert env.driver_state(s)["commit"] > raw["commit"], "private commit stays charged"
    del unet, hook
    gc.collect()
    assert (s.ledger.account(env.device), env.live_state(s)) == baseline
    stock.unload_all()
    assert env.driver_state(s) == raw


def test_both_policies_on_the_same_run(env):
    """image → video → image, then unload: what each policy costs, side by side."""
    figures = {}
    for cls in (StockManager, ResidencyManager):
        s = env.session()
        policy = cls(s)
        image, video = policy.register("image", env.size(0.35), env.device), policy.register("video", env.size(0.35),
                                                                                           env.device)
        copied = 0
        for m in (image, video, image):
            policy.use([m])
            copied += load(policy, m).mapped
        policy.unload_all()
        figures[policy.policy_name] = (copied, s.ledger.account(env.device).reservations_alive)
    assert figures["membackend"] == (image.size + video.size, 0)
    assert figures["stock"] == (2 * image.size + video.size, 2)


# --------------------------------------------------------------------------- trace


def test_policy_decisions_and_verbs_go_to_the_trace(tmp_path, env):
    tracer = TraceObserver(tmp_path / "run.jsonl")
    s = env.session(observers=[tracer])
    policy = ResidencyManager(s, tracer=tracer)
    a, b = policy.register("a", env.size(0.6), env.device), policy.register("b", env.size(0.6), env.device)
    policy.use([a])
    load(policy, a)
    policy.use([b])
    load(policy, b)
    policy.full_unload(b)
    events = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    kinds = [e["event"] for e in events]
    for expected in ("register", "reserve", "use", "fault", "evict_model", "full_unload", "free",
                     "release_reservation"):
        assert expected in kinds, expected
    evict = next(e for e in events if e["event"] == "evict_model")
    assert evict["model"] == "a" and evict["policy"] == "membackend" and evict["bytes"] > 0
    assert all({"time", "event"} <= set(e) for e in events)


def test_recorded_copies_are_fenced_by_full_unload_and_refused_after_it():
    from concurrent.futures import Future

    from membackend._fences import FutureToken
    from membackend.types import MembackendError

    env = Env("wddm-6gb")
    s = env.session()
    policy = ResidencyManager(s)
    m = policy.register("m", env.size(0.1), env.device)
    load(policy, m)
    d = s.backend.driver
    stream = d.stream_create()
    source = bytearray(env.page)  # the copy's host bytes, alive until it ran
    d.memcpy_htod_async(m.reservation().base, source, env.page, stream)
    policy.record(m, s.backend.fence_token(m.reservation(), stream))
    policy.full_unload(m)  # waits for the copy: no bugcheck
    assert d.sim.bugchecks == 0
    done = Future()
    done.set_result(None)
    with pytest.raises(MembackendError, match="fully unloaded"):
        policy.record(m, FutureToken(done))

# =========================================================================== defects found under stress
# (issue 7, section 4): each test below failed before its fix


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
    return simulated_session(target, capabilities=caps, page_size=64 * MiB, sanitize=True), Device(p.vendor, 0)


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
    # only what the policy reads when it is made: the session's tracer and its count of frees
    stand_in = types.SimpleNamespace(tracer=named, observers=[observer], frees_by_id={})
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
    stock = StockManager(s)
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


# =========================================================================== property: shedding never frees a pin

#: marks written into a pinned host page (first, middle and last byte) and checked after every step
MARK_AT = (0, 0.5, 1.0)


class PinsSurviveShedding(RuleBasedStateMachine):
    """Random register / use / fault (pins) / unpin / shed / free_memory / full_unload on one policy.

    After every step: every page the test holds a pin on is resident in the policy's map and for the
    platform (host: ``mincore``, with the marks written into it at pin time unchanged; simulated: the same
    physical handle still mapped at its address), and the ledger equals the platform's view. The pins are
    counted here from the calls alone, never read back from the policy.
    """

    target = "host"

    def __init__(self) -> None:
        super().__init__()
        self.env = Env(self.target)
        self.s = self.env.session()
        self.policy = ResidencyManager(self.s)
        self.models: list = []
        self.pins: dict[str, dict[int, int]] = {}  # model id -> page -> pins the test holds
        self.proof: dict[tuple[str, int], object] = {}  # (model, page) -> marks (host) or handle (sim)
        self.step = "start"

    # ------------------------------------------------------------------ what the platform shows

    def _page_address(self, m, p: int) -> int:
        return m.reservation(self.env.device).base + p * self.env.page

    def _handle_at(self, address: int):
        """The simulated physical handle mapped (with access) over ``address``, or None."""
        for mapping in sim_of(self.s).mappings.values():
            if mapping.va <= address < mapping.va + mapping.size and mapping.access:
                return mapping.handle
        return None

    def _marks(self, address: int) -> list[tuple[int, int]]:
        ps = self.env.page
        return [(address + min(int(ps * at), ps - 1), (address >> 21) & 0xFF ^ i) for i, at in enumerate(MARK_AT)]

    def _prove(self, m, p: int) -> None:
        """Record what shows that page ``p`` of ``m`` is the same memory later (a pin just began)."""
        address = self._page_address(m, p)
        if self.target == "host":
            marks = self._marks(address)
            for where, value in marks:
                ctypes.c_ubyte.from_address(where).value = value
            self.proof[(m.id, p)] = marks
        else:
            self.proof[(m.id, p)] = self._handle_at(address)

    # ------------------------------------------------------------------ rules

    @precondition(lambda self: len(self.models) < 3)
    @rule(fraction=st.sampled_from([0.15, 0.3, 0.45]))
    def register(self, fraction):
        self.step = f"register(m{len(self.models)}, {fraction} of the capacity)"
        m = self.policy.register(f"m{len(self.models)}", self.env.size(fraction), self.env.device)
        self.models.append(m)
        self.pins[m.id] = {}

    @precondition(lambda self: self.models)
    @rule(data=st.data())
    def use(self, data):
        chosen = data.draw(st.lists(st.sampled_from(self.models), min_size=1, max_size=2, unique_by=id))
        self.step = f"use({[m.id for m in chosen]})"
        self.policy.use(chosen)

    def _range(self, data):
        m = data.draw(st.sampled_from(self.models))
        pages = m.size // self.env.page
        first = data.draw(st.integers(0, pages - 1))
        count = data.draw(st.integers(1, min(pages - first, 24)))
        return m, first, count

    @precondition(lambda self: self.models)
    @rule(data=st.data())
    def fault(self, data):
        m, first, count = self._range(data)
        self.step = f"fault({m.id}, pages {first}..{first + count - 1})"
        f = self.policy.fault(m, first * self.env.page, count * self.env.page)
        if f.ok:
            held = self.pins[m.id]
            for p in range(first, first + count):
                held[p] = held.get(p, 0) + 1
                if held[p] == 1:
                    self._prove(m, p)

    @precondition(lambda self: any(self.pins[m.id] for m in self.models))
    @rule(data=st.data())
    def unpin(self, data):
        m = data.draw(st.sampled_from([m for m in self.models if self.pins[m.id]]))
        held = self.pins[m.id]
        first = data.draw(st.sampled_from(sorted(held)))
        count = data.draw(st.integers(1, m.size // self.env.page - first))
        self.step = f"unpin({m.id}, pages {first}..{first + count - 1})"
        self.policy.unpin(m, first * self.env.page, count * self.env.page)
        for p in range(first, first + count):
            if p in held:
                held[p] -= 1
                if not held[p]:
                    del held[p]
                    self.proof.pop((m.id, p), None)

    @precondition(lambda self: self.models)
    @rule(data=st.data(), fraction=st.sampled_from([0.1, 0.5, 1.0]))
    def shed(self, data, fraction):
        m = data.draw(st.sampled_from(self.models))
        floor = data.draw(st.sampled_from([0, m.size // 2]))
        self.step = f"shed({m.id}, {fraction} of its size, floor={floor})"
        self.policy.shed(m, int(m.size * fraction), floor=floor)

    @precondition(lambda self: self.models)
    @rule(fraction=st.sampled_from([0.1, 0.5, 2.0]))
    def free_memory(self, fraction):
        self.step = f"free_memory({fraction} of the capacity)"
        self.policy.free_memory(int(self.env.capacity * fraction), self.env.device)

    @precondition(lambda self: self.models)
    @rule(data=st.data())
    def full_unload(self, data):
        m = data.draw(st.sampled_from(self.models))
        self.step = f"full_unload({m.id})"
        self.policy.full_unload(m)  # takes the model's own pins with it; nobody else's
        self.pins[m.id] = {}
        self.proof = {k: v for k, v in self.proof.items() if k[0] != m.id}

    # ------------------------------------------------------------------ the property

    @invariant()
    def pinned_pages_stay_and_the_ledger_equals_the_platform(self):
        for m in self.models:
            held = self.pins[m.id]
            if not held:
                continue
            pages = self.policy.residency(m, self.env.device)
            lost = [p for p in held if not pages or not pages[p] & 1 or not pages[p] & 2]
            assert not lost, f"after {self.step}: pinned pages {lost} of {m.id} are not resident and pinned"
            for p in held:
                address = self._page_address(m, p)
                if self.target == "host":
                    assert resident_bytes(address, self.env.page) == self.env.page, \
                        f"after {self.step}: pinned page {p} of {m.id} is not resident (mincore)"
                    changed = [(hex(a), v, ctypes.c_ubyte.from_address(a).value)
                               for a, v in self.proof[(m.id, p)] if ctypes.c_ubyte.from_address(a).value != v]
                    assert not changed, f"after {self.step}: pinned page {p} of {m.id} lost its bytes {changed}"
                else:
                    handle = self._handle_at(address)
                    assert handle is not None and handle == self.proof[(m.id, p)], \
                        f"after {self.step}: pinned page {p} of {m.id} maps handle {handle}, " \
                        f"pinned on {self.proof[(m.id, p)]}"
        acct = self.s.ledger.account(self.env.device)
        if self.target == "host":
            found = sum(resident_bytes(r.base, r.size) for r in self.s.reservations())
            assert found == acct.resident, f"after {self.step}: ledger resident {acct.resident}, mincore {found}"
        else:
            st_ = self.s.inspect(self.env.device)
            assert (st_.reserved, st_.resident) == (acct.reserved, acct.resident), \
                f"after {self.step}: ledger {acct.reserved}/{acct.resident}, driver {st_.reserved}/{st_.resident}"

    def teardown(self):
        self.policy.unload_all()
        self.s.close()


@pytest.mark.parametrize("target", ["host", pytest.param("wddm-6gb", marks=pytest.mark.long),
                                    pytest.param("gb10-128gb", marks=pytest.mark.long)])
def test_shedding_never_frees_a_pinned_page(target):
    machine = type(f"PinsSurviveShedding[{target}]", (PinsSurviveShedding,), {"target": target})
    run_state_machine_as_test(machine, settings=settings(max_examples=10, stateful_step_count=20, deadline=None,
                                                         database=None, suppress_health_check=list(HealthCheck)))


# --------------------------------------------------------------------------- a model larger than its room


def test_a_model_larger_than_its_room_keeps_a_prefix_and_streams_the_rest(env):
    """Layer by layer, step after step, as ComfyUI's sampler faults a model: what fits is mapped once and
    stays; the layers past it are answered out of memory (ComfyUI streams them through its cast buffer).
    Giving up the pages used a moment ago instead would map and unmap every page past the prefix on every
    step (issue 34, item 3: no per-step churn of handles or mappings)."""
    s = env.session()
    policy = ResidencyManager(s)
    layers = env.capacity // env.page + 3  # three layers more than the room holds
    m = policy.register("unet", layers * env.page, env.device)
    policy.use([m])
    mapped, answered = [], []
    for _step in range(3):
        step_mapped, ok = 0, []
        for i in range(layers):
            f = policy.fault(m, i * env.page, env.page)
            ok.append(f.ok)
            if f.ok:
                step_mapped += f.mapped
                policy.unpin(m, i * env.page, env.page)
        mapped.append(step_mapped)
        answered.append(ok)
    assert mapped[0] > 0 and mapped[1:] == [0, 0]  # nothing mapped again after the first step
    assert answered[1] == answered[2] == answered[0]  # the same layers stream on every step
    fitted = answered[0].count(True)
    assert answered[0] == [True] * fitted + [False] * (layers - fitted)  # a prefix stays, the rest streams
    s.close()


# --------------------------------------------------------------------------- the policy seam


def test_the_stock_model_is_a_policy_object_and_overrides_no_private_name_of_the_manager():
    """issue 35, item 3: the stock comfy-aimdo model is a ResidencyPolicy; its manager classes only choose it."""
    from membackend import ResidencyPolicy
    from membackend.lab._replay import stock

    assert issubclass(stock.AimdoStock, ResidencyPolicy) and issubclass(stock.AimdoLoad, stock.AimdoStock)
    for cls in (stock.StockManager, stock.AimdoLoadManager):
        own = {n for n in vars(cls) if n.startswith("_") and not (n.startswith("__") and n.endswith("__"))}
        assert own == set(), f"{cls.__name__} overrides private names of the manager: {sorted(own)}"
    private = {n for n in vars(ResidencyPolicy) if n.startswith("_") and not n.startswith("__")}
    assert private == set()  # the seam is public: nothing a policy must reach behind


def test_a_policy_of_ones_own_changes_the_managers_decisions_through_the_seam(env):
    """A third party's policy: whole models are never evicted, and a workflow switch drops the others' pages,
    through the manager's public methods only."""
    from membackend import ResidencyPolicy

    switched = []

    class DropOthers(ResidencyPolicy):
        name = "drop-others"
        evicts_whole_models = False

        def on_workflow_switch(self, manager, models):
            keep = {m.id for m in models}
            for m in manager.models():
                if m.id not in keep:
                    switched.append((m.id, manager.drop_pages(m)))

    s = env.session()
    rules = DropOthers()
    policy = ResidencyManager(s, policy=rules)
    assert policy.policy is rules and policy.policy_name == "drop-others"
    a, b = (policy.register(n, env.size(0.3), env.device) for n in ("a", "b"))
    policy.use([a])
    assert load(policy, a).ok
    policy.use([b])
    # b had nothing resident at the first switch; a lost every page at the second
    assert switched == [("b", None), ("a", env.size(0.3))] and policy.stats()["a"]["resident"] == 0
    assert policy.stats()["a"]["reserved"]  # the pages went, the reservation stayed
    assert policy.keep_warm(env.device) == 0  # never whole models
    s.close()
