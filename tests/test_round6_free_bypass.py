"""Issue 42, item 9 (a): a free made straight through the session, past the residency manager, is never
answered from what the manager knew before it.

A caller that holds both the :class:`~membackend._session.Session` and the residency manager (a third-party
backend author may) can free a model's pages with ``Session.free``. The manager's warm ranges then answered
the next fault of such a range with the generations of the memory that went (no copy, and the simulated GPU
refused the copy into the unmapped range, or the CPU faulted on it), its figures disagreed with the ledger,
and tags, holds and borrows trusted pages that were gone. The session now counts the frees of each
reservation that reach its backend (``Session.backing_changes``) and the manager takes that count in before
it trusts a page map."""

from __future__ import annotations

import dataclasses

import pytest

from membackend._backends.vmm import VmmBackend
from membackend._drivers.sim import get_profile, sim_driver
from membackend._ledger import Ledger
from membackend._machine import gather_machine
from membackend._residency import ResidencyManager
from membackend._session import Session
from membackend._settings import load_settings
from membackend.platform import GENERIC
from membackend.types import Device, DriverError

PAGE = 2 << 20
SOURCE = bytearray(b"\x5a" * PAGE)  # host bytes copied into device pages


def h200() -> Session:
    """A session of the generic VMM backend over the simulated H200, in pages of 2 MiB."""
    p = get_profile("h200")
    backend = VmmBackend(dataclasses.replace(GENERIC, page_size=PAGE), sim_driver(p), capabilities=p.capabilities())
    machine = gather_machine(load_settings(sim_profile="h200").machine.model_copy(update={"devices": None}))
    return Session(backend, machine=machine, ledger=Ledger(sanitize=True))


@pytest.fixture
def gpu():
    s = h200()
    yield s, ResidencyManager(s), Device("cuda", 0)
    s.close()


def copy_into(s: Session, address: int) -> None:
    """Copy a page's bytes to ``address`` on the simulated GPU and wait for them (as ComfyUI's cast does)."""
    d = s.backend.driver
    d.memcpy_htod_async(address, SOURCE, PAGE, d.stream_create())
    s.fence("cuda:0")


def test_a_warm_range_is_not_answered_after_a_free_straight_through_the_session(gpu):
    s, m, dev = gpu
    a = m.register("a", 4 * PAGE, dev)
    f = m.fault(a, 0, PAGE, dev)
    warm = m.warm_range(a, 0, PAGE, dev, f)
    assert warm is not None and warm.unpin()
    r = a.reservation(dev)
    assert s.free(r, 0, PAGE) == PAGE  # past the manager
    assert warm.pin() is None, "the warm range answered the generations of memory that was freed"
    assert s.backing_changes(r) == 1
    again = m.fault(a, 0, PAGE, dev)  # what the caller does then
    assert again.ok and again.mapped == PAGE and again.generations != f.generations  # new memory: copy again
    copy_into(s, r.base)  # the answered range is mapped: the copy lands (before: CUDA_ERROR_ILLEGAL_ADDRESS)
    assert s.backend.driver.sim.illegal_addresses == 0
    m.unpin(a, 0, PAGE, dev)
    assert m.stats()["a"]["resident"] == s.ledger.resident(r) == PAGE


def test_the_managers_figures_follow_a_free_it_did_not_make(gpu):
    s, m, dev = gpu
    a = m.register("a", 4 * PAGE, dev)
    assert m.fault(a, 0, 4 * PAGE, dev).ok
    m.unpin(a, 0, 4 * PAGE, dev)
    r = a.reservation(dev)
    assert s.free(r, PAGE, 2 * PAGE) == 2 * PAGE
    assert m.stats()["a"]["resident"] == s.ledger.resident(r) == 2 * PAGE
    f = m.fault(a, 0, 4 * PAGE, dev)  # the freed pages are backed again, the others kept
    assert f.ok and f.mapped == 2 * PAGE
    assert m.stats()["a"]["resident"] == s.ledger.resident(r) == 4 * PAGE
    assert m.residency(a, dev) == [3, 3, 3, 3]
    m.unpin(a, 0, 4 * PAGE, dev)
    assert m.free_memory(4 * PAGE, dev) == 4 * PAGE and s.ledger.resident(r) == 0


def test_tags_holds_and_borrows_do_not_trust_pages_freed_past_the_manager(gpu):
    s, m, dev = gpu
    a = m.register("a", 2 * PAGE, dev)
    assert m.fault(a, 0, 2 * PAGE, dev).ok
    m.unpin(a, 0, 2 * PAGE, dev)
    assert m.tag(a, 0, PAGE, dev, "weights.safetensors@0")
    r = a.reservation(dev)
    s.free(r, 0, PAGE)
    assert m.borrow(dev, "weights.safetensors@0") is None, "a borrow would copy from freed memory"
    assert m.hold(a, 0, PAGE, dev, lambda reason: None) is None, "a hold of pages that are gone"
    assert not m.tag(a, 0, PAGE, dev, "weights.safetensors@0")  # not resident now: nothing to tag


def test_a_hold_ends_once_the_manager_sees_its_pages_were_freed_past_it(gpu):
    s, m, dev = gpu
    a = m.register("a", 2 * PAGE, dev)
    assert m.fault(a, 0, 2 * PAGE, dev).ok
    m.unpin(a, 0, 2 * PAGE, dev)
    ended = []
    held = m.hold(a, 0, 2 * PAGE, dev, ended.append)
    assert held is not None
    s.free(a.reservation(dev), PAGE, PAGE)  # past the manager, and past the hold
    assert not m.stats()["a"]["held"]  # the next look at the map ends it: its holder stops reading
    assert held.ended and ended == ["pages freed past the residency manager"]


def test_a_free_that_finds_nothing_resident_counts_no_change_and_a_release_ends_the_count(gpu):
    s, m, dev = gpu
    r = s.reserve(dev, 2 * PAGE)
    assert s.free(r) == 0 and s.backing_changes(r) == 0  # nothing resident: the backend was not asked
    s.fault(r, 0, 2 * PAGE)
    assert s.free(r, 0, PAGE) == PAGE
    assert s.free(r, 0, PAGE) == 0  # the other page is resident: it reaches the backend, counted all the same
    assert s.backing_changes(r) == 2
    s.release_reservation(r)
    assert s.backing_changes(r) == 0 and r.id not in s.frees_by_id


def test_a_failed_free_straight_through_the_session_is_noticed_too(gpu):
    s, m, dev = gpu
    a = m.register("a", 2 * PAGE, dev)
    f = m.fault(a, 0, 2 * PAGE, dev)
    warm = m.warm_range(a, 0, 2 * PAGE, dev, f)
    assert warm is not None and warm.unpin()
    sim = s.backend.driver.sim
    sim.faults.add("cuMemUnmap", 1, nth=sim.faults.calls.get("cuMemUnmap", 0) + 2)  # the second page's unmap
    r = a.reservation(dev)
    with pytest.raises(DriverError):
        s.free(r)
    assert warm.pin() is None
    assert m.stats()["a"]["resident"] == s.ledger.resident(r)


def test_the_manager_own_frees_keep_its_warm_ranges_of_other_reservations(gpu):
    s, m, dev = gpu
    a, b = m.register("a", 2 * PAGE, dev), m.register("b", 2 * PAGE, dev)
    fa = m.fault(a, 0, PAGE, dev)
    warm = m.warm_range(a, 0, PAGE, dev, fa)
    assert warm is not None and warm.unpin()
    assert m.fault(b, 0, 2 * PAGE, dev).ok
    m.unpin(b, 0, 2 * PAGE, dev)
    assert m.shed(b, PAGE, dev) == PAGE  # the manager's own free, of another reservation
    assert warm.pin() == fa  # still warm: nothing of a's reservation went
    warm.unpin()
    assert m.shed(a, PAGE, dev, floor=PAGE) == 0  # nothing above the floor resident: no free of a
    assert warm.pin() == fa


def test_the_comfyui_adapter_copies_again_after_a_free_past_the_manager(host_adapter):
    torch = pytest.importorskip("torch")
    from membackend._comfyui import vbar as facade

    rt = host_adapter  # its page is PAGE
    v = facade.ModelVBAR(4 * PAGE, 0)
    w = torch.arange(1000, dtype=torch.float32)
    alloc = v.alloc(w.numel() * 4)
    sig = facade.vbar_fault(alloc)
    facade.aimdo_to_tensor(alloc, "cpu").view(torch.float32).copy_(w)
    facade.vbar_unpin(alloc)
    r = v._model.reservation(v._dev)
    assert rt.session.free(r, 0, PAGE) == PAGE  # a plugin holding the session frees the page
    again = facade.vbar_fault(alloc)
    assert again is not None and not facade.vbar_signature_compare(again, sig), \
        "the fault answered the old signature: ComfyUI would skip the copy and read what was freed"
    facade.aimdo_to_tensor(alloc, "cpu").view(torch.float32).copy_(w)  # what ComfyUI then does
    facade.vbar_unpin(alloc)
    assert facade.vbar_signature_compare(facade.vbar_fault(alloc), again)  # warm again from here
    assert torch.equal(facade.aimdo_to_tensor(alloc, "cpu").view(torch.float32), w)
    facade.vbar_unpin(alloc)
    assert rt.aborted is None, rt.aborted
    assert v.loaded_size() == rt.session.ledger.resident(r) == PAGE
