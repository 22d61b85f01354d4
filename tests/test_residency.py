"""The residency policy and the stock policy, on the host backend and on the VMM backend over every profile."""

from __future__ import annotations

import gc
import json

import pytest

from membackend._backends.host import HostBackend
from membackend._backends.vmm import VmmBackend
from membackend.platform import GENERIC
from membackend._drivers.sim import get_profile, sim_driver
from membackend._ledger import Ledger
from membackend._machine import gather_machine
from membackend._residency import ModelKind, ResidencyManager
from membackend._replay.stock import StockPolicy
from membackend._session import Session
from membackend._trace import TraceObserver
from membackend.types import Device

MiB = 1 << 20
TARGETS = ["host", "wddm-6gb", "rocm-win-2gpu", "gb10-128gb", "h200"]


class Env:
    """One backend to run a policy on: a fresh session each time, the device, its usable capacity."""

    def __init__(self, target: str):
        self.target = target

    def session(self, observers=()) -> Session:
        if self.target == "host":
            backend = HostBackend(page_size=2 * MiB, capacity=256 * MiB, headroom=16 * MiB)
        else:
            p = get_profile(self.target)
            backend = VmmBackend(GENERIC, sim_driver(p), page_size=64 * MiB, capabilities=p.capabilities())
        s = Session(backend, machine=gather_machine(), ledger=Ledger(sanitize=True), observers=observers)
        self.device = s.devices()[0] if self.target == "host" else Device(backend.device_kinds[0], 0)
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
    stock = StockPolicy(s)
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


def test_stock_full_unload_keeps_the_reservation_until_the_model_is_collected(env):
    s = env.session()
    stock = StockPolicy(s)
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
    for cls in (StockPolicy, ResidencyManager):
        s = env.session()
        policy = cls(s)
        image, video = policy.register("image", env.size(0.35), env.device), policy.register("video", env.size(0.35),
                                                                                           env.device)
        copied = 0
        for m in (image, video, image):
            policy.use([m])
            copied += load(policy, m).mapped
        policy.unload_all()
        figures[cls.policy] = (copied, s.ledger.account(env.device).reservations_alive)
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
    d.memcpy_htod_async(m.reservation().base, 0, env.page, stream)
    policy.record(m, s.backend.fence_token(m.reservation(), stream))
    policy.full_unload(m)  # waits for the copy: no bugcheck
    assert d.sim.bugchecks == 0
    done = Future()
    done.set_result(None)
    with pytest.raises(MembackendError, match="fully unloaded"):
        policy.record(m, FutureToken(done))
