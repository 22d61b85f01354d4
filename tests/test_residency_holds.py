"""Holds (``membackend._residency.holds``, issue 41): pages a caller reads without faulting, kept until it lets
go -- never freed behind the holder's back, let go at once for the model's own requests and for another model's
room only while the model is outside the current run -- on the host backend and on simulated GPUs."""

from __future__ import annotations

import gc
import logging
import threading
import time

import pytest
from test_residency import Env, load, loaded

from membackend._residency import ResidencyManager

TARGETS = ["host", "h200", "rocm-win-2gpu", "strix-halo-128gb"]


@pytest.fixture(params=TARGETS)
def env(request):
    return Env(request.param)


class Holder:
    """A caller that reads a model's pages without faulting (ComfyUI's classic path): counts its ends."""

    def __init__(self, policy: ResidencyManager, model, device):
        self.policy, self.model, self.device = policy, model, device
        self.ended: list[str] = []
        self.hold = None

    def take(self):
        self.hold = self.policy.hold(self.model, 0, self.model.size, self.device, self.on_end)
        return self.hold

    def on_end(self, reason: str) -> None:
        # the pages are still resident when the holder is told: it stops using them before any goes
        assert self.policy.stats(self.device)[self.model.id]["resident"] == \
            -(-self.model.size // self.page()) * self.page()
        self.ended.append(reason)

    def page(self) -> int:
        return self.model.reservation(self.device).page_size


def _resident(policy, model, device):
    return policy.stats(device)[model.id]["resident"]


def test_a_hold_needs_every_page_resident_and_one_per_slot(env):
    s = env.session()
    policy = ResidencyManager(s)
    a = policy.register("a", env.size(0.3), env.device)
    policy.use([a])
    holder = Holder(policy, a, env.device)
    assert holder.take() is None, "nothing resident yet: nothing held"
    f = policy.fault(a, 0, env.page)
    assert f.ok
    policy.unpin(a, 0, env.page)
    assert holder.take() is None, "one page of many resident: still nothing held"
    load(policy, a)
    assert holder.take() is not None
    assert policy.stats()["a"]["held"]
    assert policy.hold(a, 0, a.size, env.device, holder.on_end) is None, "a slot is held once"
    assert holder.hold.end("done") and not holder.hold.end("again")
    assert holder.ended == ["done"] and not policy.stats()["a"]["held"]


def test_another_models_fault_takes_a_held_model_only_outside_the_run(env):
    s = env.session()
    policy = ResidencyManager(s)
    a, b = policy.register("a", env.size(0.6), env.device), policy.register("b", env.size(0.6), env.device)
    policy.use([a])
    load(policy, a)
    holder = Holder(policy, a, env.device)
    assert holder.take() is not None
    policy.use([a, b])  # b runs beside a: a's pages stay held, b streams what does not fit
    f = policy.fault(b, 0, b.size)
    assert not f.ok and holder.ended == [] and _resident(policy, a, env.device) > 0
    policy.use([b])  # a is outside the run now: its hold ends, then its pages go
    assert policy.fault(b, 0, b.size).ok
    assert holder.ended and holder.hold.ended and not policy.stats()["a"]["held"]
    assert _resident(policy, a, env.device) < a.size


def test_the_models_own_requests_end_its_hold_at_once_even_in_the_run(env):
    s = env.session()
    policy = ResidencyManager(s)
    a = policy.register("a", env.size(0.3), env.device)
    for request in ("shed", "drop_pages", "full_unload", "full_unload_unless_pinned", "unregister"):
        policy.use([a])  # prioritized again: a shed or drop left a watermark
        load(policy, a)
        holder = Holder(policy, a, env.device)
        assert holder.take() is not None, request
        if request == "shed":
            assert policy.shed(a, a.size, env.device) > 0
        elif request == "drop_pages":
            assert policy.drop_pages(a, env.device)
        elif request == "unregister":
            policy.unregister(a)
        else:
            assert getattr(policy, request)(a)
        assert holder.ended, f"{request} freed held pages without ending the hold"
        assert _resident(policy, a, env.device) == 0 if request != "unregister" else a not in policy.models()


def test_keep_warm_a_lowered_cap_and_free_memory_respect_the_run(env):
    s, policy, a = loaded(env, 0.5)
    holder = Holder(policy, a, env.device)
    holder.take()
    assert policy.free_memory(a.size, env.device) == 0 and not holder.ended, "a model of the run keeps its pages"
    s.set_headroom(env.device, s.budget_query(env.device).total)  # a cap that leaves no room at all
    assert policy.keep_warm(env.device) == 0 and not holder.ended
    policy.on_idle()  # the run is over: what the cap asks for goes
    assert policy.keep_warm(env.device) > 0 and holder.ended == ["budget"]
    assert _resident(policy, a, env.device) == 0


def test_held_pages_count_as_evictable_and_are_never_shed_while_held(env):
    s, policy, a = loaded(env, 0.3)
    before = policy.evictable(env.device)
    Holder(policy, a, env.device).take()
    assert policy.evictable(env.device) == before == _resident(policy, a, env.device)
    assert policy.pinned_and_evictable(a, env.device) == (0, _resident(policy, a, env.device))


def test_a_hold_never_keeps_its_holder_alive_and_a_failing_holder_is_let_go(env, caplog):
    s, policy, a = loaded(env, 0.3)
    holder = Holder(policy, a, env.device)
    hold = holder.take()
    del holder
    gc.collect()
    assert policy.full_unload(a) > 0 and hold.ended  # the holder went: the hold ends without a call
    load(policy, a)

    def fails(reason):
        raise RuntimeError("the holder broke")

    assert policy.hold(a, 0, a.size, env.device, fails) is not None
    with caplog.at_level(logging.WARNING):
        assert policy.full_unload(a) > 0
    assert "the holder broke" in caplog.text and not policy.stats()["a"]["held"]


def test_no_held_page_is_freed_under_contention():
    """A worker holds and lets go of one model in turn while a second thread's model faults for room and a
    third lowers and raises a cap: every free of the held model's pages comes after its hold ended."""
    env = Env("h200")
    s = env.session()
    policy = ResidencyManager(s)
    a, b = policy.register("a", env.size(0.55), env.device), policy.register("b", env.size(0.55), env.device)
    violations: list[str] = []
    free = s.free

    def checked_free(r, offset, size):
        slot = a.slots[env.device]
        if slot.reservation is r and slot.hold is not None and not slot.hold.ended:
            violations.append(f"free of [{offset}, {offset + size}) under a live hold")
        return free(r, offset, size)

    s.free = checked_free
    stop = threading.Event()
    errors: list[BaseException] = []

    def worker():
        try:
            for _ in range(60):
                policy.use([a])
                if policy.fault(a, 0, a.size).ok:
                    policy.unpin(a, 0, a.size)
                    hold = policy.hold(a, 0, a.size, env.device, lambda reason: None)
                    if hold is not None:
                        time.sleep(0.002)  # reading the pages, no fault: the other threads want the room
                        hold.end("worker done")
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            stop.set()

    def other():
        try:
            while not stop.is_set():
                policy.use([b])
                if policy.fault(b, 0, b.size).ok:
                    policy.unpin(b, 0, b.size)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    def cap():
        try:
            total = s.budget_query(env.device).total
            while not stop.is_set():
                s.set_headroom(env.device, total // 2)
                policy.keep_warm(env.device)
                s.set_headroom(env.device, None)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=f) for f in (worker, other, cap)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a thread is stuck (deadlock?)"
    assert not errors, errors
    assert violations == []
