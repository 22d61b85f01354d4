"""Dropped models give their memory back (issue 34, item 4), at the adapter's level, on the simulated H200.

* membackend keeps no patcher alive: :class:`~membackend._comfyui.keepwarm.KeepWarm` watches the run's patchers
  by weak reference only, and counts the ones ComfyUI dropped;
* a ``ModelVBAR`` collected with its model (ComfyUI dropped it) has its reservation returned at once by the
  reaper thread, fenced: never while a recorded copy on it is unfinished (G1, G2);
* the finalizer itself does no work that takes a lock: collected while its thread holds one of the adapter's
  locks, or while a recorded copy is still running, it neither deadlocks nor waits;
* an explicit ``close()`` still returns the reservation before it returns.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from concurrent.futures import Future

import pytest

from membackend._comfyui import vbar as facade
from membackend._comfyui.keepwarm import KeepWarm
from membackend._fences import FutureToken

MiB = 1 << 20
PS = 2 * MiB  # bytes per weight page asked for (the backend's page may be larger)
WAIT = 10.0  # seconds: the reaper retires a dropped model well within this on a loaded machine


@pytest.fixture
def rt(h200_adapter):
    """A started adapter on the simulated H200 (its reaper thread running), no ComfyUI patches."""
    return h200_adapter


def _until(cond, timeout: float = WAIT) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def _loaded(pages: int = 4) -> facade.ModelVBAR:
    """A VBAR with ``pages`` resident, unpinned; nothing else references it (its alloc tuples went)."""
    v = facade.ModelVBAR(pages * PS, 0)
    a = v.alloc(pages * PS)
    assert facade.vbar_fault(a) is not None
    facade.vbar_unpin(a)
    return v


class _Patcher:
    """Stands for a ComfyUI ModelPatcher: only its identity and weak-referenceability matter here."""


def test_keep_warm_holds_no_patcher_alive_and_counts_the_dropped():
    keep = KeepWarm()
    a, b = _Patcher(), _Patcher()
    ref = weakref.ref(a)
    keep.hold([a, b])
    assert list(keep.held.values()) == [a, b] and keep.run_ids == {id(a), id(b)}
    del a
    gc.collect()
    assert ref() is None, "KeepWarm kept a patcher ComfyUI dropped alive"
    assert list(keep.held.values()) == [b]
    c = _Patcher()
    keep.hold([c])  # the next run: the dropped one is forgotten and counted
    assert keep.dropped == 1 and list(keep.held.values()) == [b, c] and keep.run_ids == {id(c)}
    keep.release([b])  # ComfyUI unloaded it
    assert list(keep.held.values()) == [c]


def test_keep_warm_switched_off_watches_nothing():
    keep = KeepWarm()
    keep.enabled = False  # ComfyUI's --disable-smart-memory
    p = _Patcher()
    keep.hold([p])
    assert keep.held == {} and keep.run_ids == set()


def test_a_collected_vbar_returns_its_reservation_at_once(rt):
    v = _loaded()
    dev = v._dev
    resident = rt.session.ledger.account(dev).resident
    assert len(rt.session.reservations()) == 1 and resident >= 4 * PS
    del v
    gc.collect()  # ComfyUI dropped the model: its nn.Module and the VBAR go
    assert _until(lambda: rt.session.reservations() == []), rt.session.reservations()
    assert rt.session.ledger.account(dev).resident == 0 and rt.residency.models() == []
    assert rt.journal.dropped_count == 1 and rt.journal.dropped_bytes == resident
    entry = rt.journal.unloads[-1]
    assert entry["reason"] == "dropped by ComfyUI" and entry["bytes"] == resident and entry["reservations"] == 1


def test_a_dropped_models_release_waits_for_its_recorded_copy_and_the_finalizer_does_not(rt):
    """G2: the copy recorded on the range is unfinished when the model is collected. The finalizer returns at
    once (it only queues); the reaper's release waits for the copy, then returns the reservation."""
    v = _loaded()
    copy: Future = Future()
    rt.residency.record(v._model, FutureToken(copy), v._dev)
    r = v._model.reservation(v._dev)
    collected = threading.Event()

    def drop():
        nonlocal v
        del v
        gc.collect()
        collected.set()

    t = threading.Thread(target=drop, daemon=True)
    t.start()
    assert collected.wait(WAIT), "the finalizer waited for the copy (or deadlocked)"
    time.sleep(0.2)
    assert not r.released and len(rt.session.reservations()) == 1, "released under an unfinished copy (G2)"
    copy.set_result(None)  # the copy lands
    assert _until(lambda: r.released and rt.session.reservations() == [])


def test_a_vbar_collected_while_its_thread_holds_the_adapters_lock_does_not_deadlock(rt):
    """The garbage collector runs a finalizer inside whatever code it interrupted: here, code that holds the
    adapter's (non-reentrant) lock of put-off unloads. The finalizer must not take it."""
    v = _loaded()
    waiting = facade.ModelVBAR(PS, 0)  # another model's full unload is put off (a page still pinned)
    pinned = waiting.alloc(PS)
    assert facade.vbar_fault(pinned) is not None
    rt.unload_vbar(waiting, "test")
    assert waiting in rt.pending
    done = threading.Event()

    def drop_under_the_lock():
        nonlocal v
        with rt.unloader.pending_lock:
            del v
            gc.collect()
        done.set()

    t = threading.Thread(target=drop_under_the_lock, daemon=True)
    t.start()
    assert done.wait(WAIT), "the finalizer deadlocked on a lock its own thread held"
    assert _until(lambda: len(rt.session.reservations()) == 1)  # the dropped one went; the pinned one waits
    facade.vbar_unpin(pinned)
    facade.vbars_reset_watermark_limits()
    assert rt.session.reservations() == []


def test_an_explicit_close_returns_the_reservation_before_it_returns(rt):
    v = _loaded()
    v.close()
    assert rt.session.reservations() == [] and rt.residency.models() == []
    assert v._model.id not in rt.names and v._model.id not in rt.weights


def test_without_a_reaper_the_next_quiescent_point_retires_a_dropped_model(rt):
    rt.unloader.stop_reaper()
    v = _loaded()
    del v
    gc.collect()
    assert len(rt.session.reservations()) == 1  # queued: no reaper
    facade.vbars_reset_watermark_limits()  # ComfyUI's between-nodes call
    assert rt.session.reservations() == []


def test_a_failed_retirement_is_told_and_retried_between_nodes(rt, monkeypatch, caplog):
    v = _loaded()
    model = v._model
    real = rt.residency.unregister
    calls = []

    def failing(m):
        calls.append(m)
        if len(calls) == 1:
            raise RuntimeError("injected")
        return real(m)

    monkeypatch.setattr(rt.residency, "unregister", failing)
    rt.journal.names[model.id] = "BaseModel"  # ComfyUI loaded it as its UNet
    rt.unloader.stop_reaper()
    del v
    gc.collect()
    with caplog.at_level("WARNING", logger="membackend"):
        facade.vbars_reset_watermark_limits()
    assert any("retried at the next node" in r.getMessage() for r in caplog.records)
    assert model in rt.residency.models() and rt.aborted is None
    # still registered, still named: the status never lists it by its bare id (it did, between the two)
    assert rt.journal.display_name(model.id) == "BaseModel"
    facade.vbars_reset_watermark_limits()
    assert model not in rt.residency.models() and rt.session.reservations() == []
    assert model.id not in rt.journal.names, "the name goes with the model"
