"""The comfy_aimdo.model_vbar facade: every name and signature of the installed comfy-aimdo (0.6.0), and
each method's behaviour on the residency manager over the host backend."""

from __future__ import annotations

import inspect
import threading

import pytest

pytest.importorskip("comfy_aimdo")
torch = pytest.importorskip("torch")

import comfy_aimdo.model_vbar as aimdo_vbar  # noqa: E402
import comfy_aimdo.torch as aimdo_torch  # noqa: E402

from membackend._comfyui import runtime as adapter  # noqa: E402
from membackend._comfyui import status  # noqa: E402
from membackend._comfyui import vbar as facade  # noqa: E402
from membackend._comfyui.wiring import FACADE_NAMES  # noqa: E402

PS = 2 << 20
METHODS = ["prioritize", "deprioritize", "alloc", "fault", "unpin", "loaded_size", "set_watermark_limit",
           "set_watermark", "free_memory", "get_nr_pages", "get_watermark", "get_residency", "close", "__init__"]


def _params(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("name", METHODS)
def test_every_modelvbar_method_has_aimdos_parameters(name):
    assert hasattr(aimdo_vbar.ModelVBAR, name), f"comfy-aimdo has no ModelVBAR.{name}"
    assert _params(getattr(facade.ModelVBAR, name)) == _params(getattr(aimdo_vbar.ModelVBAR, name))


@pytest.mark.parametrize("name", [n for n in FACADE_NAMES if n != "ModelVBAR"])
def test_every_function_has_aimdos_parameters(name):
    assert _params(getattr(facade, name)) == _params(getattr(aimdo_vbar, name))


def test_no_public_name_of_aimdos_modelvbar_is_missing():
    ours = {n for n in dir(facade.ModelVBAR) if not n.startswith("_")}
    theirs = {n for n in dir(aimdo_vbar.ModelVBAR) if not n.startswith("_")}
    assert theirs <= ours
    assert _params(facade.aimdo_to_tensor) == _params(aimdo_torch.aimdo_to_tensor)


@pytest.fixture
def rt(host_adapter):
    return host_adapter


def test_without_a_runtime_construction_fails_like_an_uninitialised_aimdo():
    assert adapter.current() is None
    with pytest.raises(RuntimeError, match="not initialized"):
        facade.ModelVBAR(1 << 20, 0)
    assert facade.vbars_analyze() == 0
    facade.vbars_reset_watermark_limits()


def test_alloc_is_aimdos_aligned_bump_allocator(rt):
    v = facade.ModelVBAR(4 * PS, 0)
    a = v.alloc(100)
    b = v.alloc(10)
    assert a == (v, v.base_addr, 100) and b[1] == v.base_addr + 512
    with pytest.raises(MemoryError, match="VBAR OOM"):
        v.alloc(4 * PS)
    assert v.get_nr_pages() == 4


def test_fault_copy_compare_unpin_and_residency_bits(rt):
    v = facade.ModelVBAR(4 * PS, 0)
    w = torch.randn(1000)
    a = v.alloc(w.numel() * 4)
    sig = facade.vbar_fault(a)
    t = facade.aimdo_to_tensor(a, torch.device("cpu")).view(torch.float32)
    t.copy_(w)
    assert v.get_residency()[0] == 3  # resident and pinned
    facade.vbar_unpin(a)
    assert v.get_residency()[0] == 1 and v.loaded_size() == PS
    again = facade.vbar_fault(a)
    assert facade.vbar_signature_compare(again, sig)  # same pages: no copy needed
    assert torch.equal(facade.aimdo_to_tensor(a, "cpu").view(torch.float32), w)
    facade.vbar_unpin(a)
    assert facade.vbars_analyze(0) == PS  # unpinned and resident: what eviction could give back
    assert v.free_memory(1e32) == PS and v.loaded_size() == 0
    # never a tensor over freed pages, and never an exception into ComfyUI's cast path (G6): a scratch tensor of
    # the same size that ComfyUI fills from its own copy; the adapter stays running (a race, not a failure)
    scratch = facade.aimdo_to_tensor(a, "cpu")
    assert scratch.numel() == a[2] and scratch.data_ptr() != v.base_addr and rt.aborted is None
    refaulted = facade.vbar_fault(a)
    assert not facade.vbar_signature_compare(refaulted, sig)  # new pages: the caller copies again
    assert facade.vbar_signature_compare(None, sig) is False
    with pytest.raises(ValueError, match="mismatched length"):
        facade.vbar_signature_compare(sig, sig[:1])


def _counting_faults(rt, monkeypatch) -> list:
    """Every session fault from now on, as (offset, size) within its reservation."""
    calls, real = [], rt.session.fault

    def fault(reservation, offset, size):
        calls.append((offset, size))
        return real(reservation, offset, size)
    monkeypatch.setattr(rt.session, "fault", fault)  # the session's hot verb is an attribute of its own
    return calls


def test_a_range_that_stayed_resident_is_pinned_again_with_no_session_call(rt, monkeypatch):
    v = facade.ModelVBAR(4 * PS, 0)
    a, b = v.alloc(PS), v.alloc(PS)
    sig = facade.vbar_fault(a)
    facade.vbar_unpin(a)
    calls = _counting_faults(rt, monkeypatch)
    for _ in range(3):  # the sampler's steps
        again = facade.vbar_fault(a)
        assert facade.vbar_signature_compare(again, sig) and v.get_residency()[0] == 3  # same pages, pinned
        facade.vbar_unpin(a)
        assert v.get_residency()[0] == 1
    assert calls == []
    facade.vbar_fault(b)  # another range newly backed: a's pages and generations are untouched
    facade.vbar_unpin(b)
    assert facade.vbar_signature_compare(facade.vbar_fault(a), sig) and len(calls) == 1
    facade.vbar_unpin(a)


def test_a_range_freed_since_its_last_fault_is_faulted_anew_never_answered_from_before(rt, monkeypatch):
    v = facade.ModelVBAR(4 * PS, 0)
    a = v.alloc(PS)
    sig = facade.vbar_fault(a)
    facade.vbar_unpin(a)
    assert v.free_memory(1e32) == PS
    calls = _counting_faults(rt, monkeypatch)
    refaulted = facade.vbar_fault(a)
    assert calls and not facade.vbar_signature_compare(refaulted, sig)  # new pages: ComfyUI copies again
    facade.vbar_unpin(a)
    v.close()
    assert facade.vbar_fault(a) is None or not facade.vbar_signature_compare(facade.vbar_fault(a), refaulted)


def test_watermark_limit_keeps_the_bottom_and_reset_lifts_it(rt):
    v = facade.ModelVBAR(4 * PS, 0)
    a = v.alloc(4 * PS)
    facade.vbar_fault(a)
    facade.vbar_unpin(a)
    v.set_watermark_limit(2 * PS)
    assert v.free_memory(1e32) == 2 * PS and v.loaded_size() == 2 * PS
    facade.vbars_reset_watermark_limits()
    assert v.free_memory(1e32) == 2 * PS and v.loaded_size() == 0


def test_set_watermark_fails_faults_above_it_until_prioritized(rt):
    v = facade.ModelVBAR(4 * PS, 0)
    a = v.alloc(4 * PS)
    v.set_watermark(PS)
    assert v.get_watermark() == PS
    assert facade.vbar_fault(a) is None  # above the watermark: out of memory, as aimdo answers
    v.prioritize()
    assert facade.vbar_fault(a) is not None and v.get_watermark() == 4 * PS


def test_out_of_memory_evicts_the_deprioritized_model_first(rt):
    old, new = facade.ModelVBAR(10 * PS, 0), facade.ModelVBAR(10 * PS, 0)
    a = old.alloc(10 * PS)
    facade.vbar_fault(a)
    facade.vbar_unpin(a)
    old.deprioritize()
    b = new.alloc(10 * PS)
    assert facade.vbar_fault(b) is not None  # 16 pages of capacity: old, outside the run, goes whole
    assert old.loaded_size() == 0 and new.loaded_size() == 10 * PS
    assert facade.vbar_fault(a) is None  # evicted: fails fast until the model is used again
    facade.vbar_unpin(b)
    old.prioritize()
    assert facade.vbar_fault(a) is not None and old.loaded_size() == 10 * PS and new.loaded_size() == 0


def test_close_returns_the_reservation_and_is_idempotent(rt):
    v = facade.ModelVBAR(4 * PS, 0)
    facade.vbar_fault(v.alloc(PS))
    assert len(rt.session.reservations()) == 1
    v.close()
    v.close()
    assert rt.session.reservations() == []


def test_a_full_unload_is_put_off_while_pages_are_pinned(rt):
    v = facade.ModelVBAR(4 * PS, 0)
    a = v.alloc(PS)
    facade.vbar_fault(a)
    rt.unload_vbar(v, "test")
    assert len(rt.session.reservations()) == 1 and v in rt.pending  # pinned: never destroyed under a copy
    facade.vbar_unpin(a)
    facade.vbars_reset_watermark_limits()  # ComfyUI's between-nodes call: the quiescent point
    assert rt.session.reservations() == [] and rt.journal.unloads[-1]["reservations"] == 1
    sig = facade.vbar_fault(a)  # used again: reserved again, transparently
    assert sig is not None and len(rt.session.reservations()) == 1


class _Stream:
    """A stream whose events complete only when the test says so."""

    def __init__(self):
        self.events = []

    def record_event(self):
        import threading

        ev = threading.Event()
        ev.query, ev.synchronize = ev.is_set, ev.wait  # torch.cuda.Event's two methods
        self.events.append(ev)
        return ev


def test_each_unpin_fences_the_range_by_the_work_queued_on_comfyuis_current_stream(rt, monkeypatch):
    from membackend._comfyui.streams import CopyFences, StreamToken

    stream = _Stream()
    monkeypatch.setattr(CopyFences, "stream_for", staticmethod(lambda where: stream))
    rt.fences = CopyFences(rt.residency)
    v = facade.ModelVBAR(4 * PS, 0)
    a = v.alloc(PS)
    for _ in range(3):
        facade.vbar_fault(a)
        facade.vbar_unpin(a)
    # one token, and no event yet: an unpin records none (it runs per weight per step)
    assert rt.fences.recorded == 1 and stream.events == []
    token = next(iter(rt.fences._tokens.values()))[1]
    assert isinstance(token, StreamToken) and not token.done()
    assert len(stream.events) == 1  # the fence's question recorded one, after everything queued so far
    assert not token.done() and len(stream.events) == 1  # nothing queued since: the same event answers
    stream.events[-1].set()
    assert token.done()
    facade.vbar_fault(a)
    facade.vbar_unpin(a)  # more work queued: the next question records a newer event, not yet finished
    assert not token.done() and len(stream.events) == 2
    stream.events[-1].set()
    v.free_memory(1e32)  # the free waits on the token (done): the token is taken
    assert token.touch() is False  # taken: the next unpin records a new one
    facade.vbar_fault(a)
    facade.vbar_unpin(a)
    assert rt.fences.recorded == 2
    threading.Timer(0.05, lambda: [ev.set() for ev in stream.events]).start()
    v.free_memory(1e32)  # the free waits for an event recorded after the last unpin's work
    assert len(stream.events) == 3 and all(ev.is_set() for ev in stream.events)


def test_no_stream_means_nothing_is_recorded(rt):
    from membackend._comfyui.streams import CopyFences

    rt.fences = CopyFences(rt.residency)  # no comfy.model_management here, a cpu device: copies are synchronous
    v = facade.ModelVBAR(4 * PS, 0)
    a = v.alloc(PS)
    facade.vbar_fault(a)
    facade.vbar_unpin(a)
    assert rt.fences.recorded == 0 and rt.aborted is None


@pytest.mark.parametrize("module,name", [("comfy_aimdo.vram_buffer", "VRAMBuffer"),
                                         ("comfy_aimdo.host_buffer", "HostBuffer"),
                                         ("comfy_aimdo.model_mmap", "ModelMMAP")])
def test_every_buffer_class_has_aimdos_methods_and_parameters(module, name):
    import importlib

    from membackend._comfyui import buffers

    theirs, ours = getattr(importlib.import_module(module), name), getattr(buffers, name)
    for attr in [n for n in vars(theirs) if not n.startswith("_") or n == "__init__"]:
        assert _params(getattr(ours, attr)) == _params(getattr(theirs, attr)), attr


def test_the_cast_buffer_refuses_a_range_past_its_size_as_aimdo_does(rt):
    from membackend._comfyui.buffers import VRAMBuffer

    buf = VRAMBuffer(1 << 20, 0)
    t = facade.aimdo_to_tensor(buf.get(1000, 512), "cpu")
    assert t.numel() == 1000 and buf.size() == 1512
    with pytest.raises(RuntimeError, match="VRAM grow failed"):
        buf.get(1 << 20, 1)


def _loaded(rt, pages=2):
    v = facade.ModelVBAR(pages * PS, 0)
    a = v.alloc(pages * PS)
    assert facade.vbar_fault(a) is not None
    facade.vbar_unpin(a)
    return v, a


def test_what_the_status_keeps_of_unloads_is_bounded(rt):
    import json

    from membackend._comfyui.journal import UNLOADS_KEPT
    v, a = _loaded(rt)
    for _ in range(2000):
        assert facade.vbar_fault(a) is not None
        facade.vbar_unpin(a)
        rt.unload_vbar(v, "test")
    st = status.runtime_status(rt)
    assert st["unload_count"] == 2000 and len(st["unloads"]) == UNLOADS_KEPT
    assert len(json.dumps(st)) < 40_000


def test_a_failed_copy_never_keeps_its_model_from_a_full_unload(rt):
    from concurrent.futures import Future

    from membackend._fences import FutureToken
    v, a = _loaded(rt)
    failed = Future()
    failed.set_exception(OSError("copy failed"))
    rt.residency.record(v._model, FutureToken(failed), v._dev)
    rt.unload_vbar(v, "test")  # the failure is reported (one line); the unload is retried at the next node
    assert v in rt.pending
    facade.vbars_reset_watermark_limits()
    assert rt.session.reservations() == [] and v not in rt.pending and rt.aborted is None
    assert facade.vbar_fault(a) is not None  # and the model is usable again
    facade.vbar_unpin(a)


def test_a_full_unload_waits_for_a_pin_and_runs_at_the_next_quiescent_point(rt):
    v = facade.ModelVBAR(2 * PS, 0)
    a = v.alloc(PS)
    assert facade.vbar_fault(a) is not None  # pinned
    rt.unload_vbar(v, "test")
    assert v in rt.pending and len(rt.session.reservations()) == 1
    facade.vbar_unpin(a)
    facade.vbars_reset_watermark_limits()
    assert rt.session.reservations() == [] and rt.journal.unloads[-1]["reason"] == "put off until no page was pinned"


def test_a_tensor_that_cannot_be_made_never_reaches_comfyui_and_the_pages_are_unpinned(rt, monkeypatch, caplog):
    """G6 on the cast path: aimdo_to_tensor over faulted pages fails (as it did over a simulated GPU before
    those held bytes: "Found no NVIDIA driver"). ComfyUI gets a scratch tensor of the same size to copy its own
    weights into, the pages the fault pinned are unpinned at once, the adapter switches itself off with one
    line, later faults answer "out of memory" (ComfyUI casts its own copy), ComfyUI's own unpin of the range
    changes nothing, and the next full unload returns the reservation (G1)."""
    rt.started = True
    v = facade.ModelVBAR(4 * PS, 0)
    a, b = v.alloc(PS), v.alloc(1000)
    assert facade.vbar_fault(b) is not None  # another layer in flight, pinned: its pin must survive
    sig = facade.vbar_fault(a)
    assert sig is not None and v.get_residency()[0] & 2

    def no_driver(*args, **kwargs):
        raise RuntimeError("Found no NVIDIA driver on your system")

    monkeypatch.setattr(facade, "tensor_at", no_driver)
    with caplog.at_level("WARNING", logger="membackend"):
        t = facade.aimdo_to_tensor(a, "cpu")
        t2 = facade.aimdo_to_tensor(a, "cpu")
    assert t.numel() == PS and t.dtype == torch.uint8 and t2.numel() == PS
    assert rt.aborted and "aimdo_to_tensor" in rt.aborted and not rt.running
    assert sum("switched off" in r.getMessage() for r in caplog.records) == 1
    assert v.get_residency()[0] == 1  # a's page: resident, no longer pinned
    assert facade.vbar_fault(a) is None  # switched off: out of memory, as aimdo answers it
    facade.vbar_unpin(a)  # ComfyUI's own unpin after the cast: nothing left to unpin, nothing changes
    assert v.get_residency()[1] & 2  # b's page kept its pin
    facade.vbar_unpin(b)
    rt.unload_vbar(v, "test")
    assert rt.session.reservations() == []


def test_a_range_that_is_not_resident_is_answered_without_switching_off(rt, caplog):
    v = facade.ModelVBAR(4 * PS, 0)
    a = v.alloc(PS)
    with caplog.at_level("WARNING", logger="membackend"):
        t = facade.aimdo_to_tensor(a, "cpu")  # never faulted: not resident
        facade.aimdo_to_tensor(a, "cpu")
    assert t.numel() == PS and rt.aborted is None
    assert sum("not resident" in r.getMessage() for r in caplog.records) == 1  # reported once


def test_a_failed_copy_fenced_while_making_room_does_not_switch_the_adapter_off(rt, caplog):
    """A fault that must evict another model's pages fences the copies recorded on them; one of those copies
    failed. The fault says so once and tries again (a failed token then counts as finished), and the adapter
    keeps running (seen as a rare switch-off in the race test of tests/test_comfyui_races.py)."""
    from concurrent.futures import Future

    from membackend._fences import FutureToken

    a = facade.ModelVBAR(16 * PS, 0)
    whole = a.alloc(16 * PS)  # the whole budget (host_capacity 16 pages)
    assert facade.vbar_fault(whole) is not None
    facade.vbar_unpin(whole)
    failed = Future()
    failed.set_exception(OSError("copy failed"))
    rt.residency.record(a._model, FutureToken(failed), a._dev)
    b = facade.ModelVBAR(4 * PS, 0)
    layer = b.alloc(PS)
    with caplog.at_level("WARNING", logger="membackend"):
        assert facade.vbar_fault(layer) is not None  # room made by evicting a, after the failed copy
    assert rt.aborted is None
    assert sum("making room for a fault failed" in r.getMessage() for r in caplog.records) == 1
    facade.vbar_unpin(layer)


@pytest.mark.parametrize("how", ["unload_vbar", "unload_all", "stop"])
def test_a_tensor_over_a_pinned_layer_holds_its_range_until_the_unpin(rt, how):
    import threading

    from membackend.types import PartialFailure, TensorAlive

    v = facade.ModelVBAR(4 * PS, 0)
    w = torch.arange(1000, dtype=torch.float32)
    a = v.alloc(w.numel() * 4)
    facade.vbar_fault(a)
    t = facade.aimdo_to_tensor(a, "cpu").view(torch.float32)
    t.copy_(w)
    r = v._model.reservation(v._dev)
    refused = []

    def unload():  # another thread: ComfyUI's unload, its /free, a host stopping the adapter
        try:
            {"unload_vbar": lambda: rt.unload_vbar(v, "test"), "unload_all": rt.residency.unload_all,
             "stop": rt.stop}[how]()
        except PartialFailure as exc:
            refused.extend(e for _, e in exc.failures)

    worker = threading.Thread(target=unload)
    worker.start()
    worker.join(60)
    assert not worker.is_alive()  # deferred or refused, never blocked
    assert not r.released  # the range stays under the tensor (released, the read below would be a segfault)
    assert torch.equal(t, w)
    assert all(isinstance(e, TensorAlive) for e in refused), refused
    with pytest.raises(TensorAlive):  # nothing below the policy releases it either
        rt.session.release_reservation(r)
    facade.vbar_unpin(a)  # the layer is done: its hold ends
    if how == "unload_vbar":
        facade.vbars_reset_watermark_limits()  # the put-off unload runs at the quiescent point
    elif how == "unload_all":
        rt.residency.unload_all()  # unloading again, as ComfyUI's next /free would
    assert r.released and rt.session.ledger.account(v._dev).reserved == 0 and rt.aborted is None
    if how == "stop":
        assert not rt.stopping and rt.session.reservations() == []
    else:  # used again: reserved anew, new pages, the caller copies again
        assert facade.vbar_fault(a) is not None and v._model.reservation(v._dev) is not r
        facade.vbar_unpin(a)


def test_closing_a_vbar_ends_its_tensors_holds(rt):
    v = facade.ModelVBAR(4 * PS, 0)
    a = v.alloc(4000)
    facade.vbar_fault(a)
    facade.aimdo_to_tensor(a, "cpu")
    v.close()  # ComfyUI is done with the model: no unpin will come
    assert rt.session.reservations() == [] and rt.aborted is None


@pytest.mark.parametrize("failure", ["an OSError", "a DriverError of its own", "KeyboardInterrupt"])
def test_another_models_failed_copy_never_switches_the_adapter_off(host_adapters, failure):
    """A fault that must evict another model fences that model's copies; one of them failed. The fault is told
    once and tries again (the failed copy then counts as finished), as free_memory does: never an abort."""
    from concurrent.futures import Future

    from membackend._fences import FutureToken
    from membackend.types import DriverError

    runtime = host_adapters(4)
    try:
        victims = [facade.ModelVBAR(PS, 0) for _ in range(4)]
        user = facade.ModelVBAR(4 * PS, 0)
        for v in victims:  # the victims fill the capacity, unpinned: evictable; each with a copy that failed
            a = v.alloc(PS)
            facade.vbar_fault(a)
            facade.vbar_unpin(a)
            copy = Future()
            copy.set_exception({"an OSError": OSError("copy failed"),
                                "a DriverError of its own": DriverError(700, "cuMemcpyAsync", "illegal address"),
                                "KeyboardInterrupt": KeyboardInterrupt()}[failure])
            runtime.residency.record(v._model, FutureToken(copy), v._dev)
        a = user.alloc(PS)
        first = facade.vbar_fault(a)  # out of memory at worst (ComfyUI casts from its own copy), never an abort
        assert runtime.aborted is None
        if first is not None:
            facade.vbar_unpin(a)
        assert facade.vbar_fault(a) is not None and runtime.aborted is None  # the failed copies are settled
        facade.vbar_unpin(a)
    finally:
        runtime.stop()
        adapter.decided("stock", "test over", "", None)


def test_each_unpin_ends_one_tensors_hold(rt):
    from membackend.types import TensorAlive

    v = facade.ModelVBAR(4 * PS, 0)
    a = v.alloc(4000)
    for _ in range(2):  # two users of the same layer: faulted and made a tensor twice
        facade.vbar_fault(a)
        facade.aimdo_to_tensor(a, "cpu")
    r = v._model.reservation(v._dev)
    facade.vbar_unpin(a)
    with pytest.raises(TensorAlive):  # the second user still reads it
        rt.session.release_reservation(r)
    facade.vbar_unpin(a)
    assert rt.session.release_reservation(r) == PS
