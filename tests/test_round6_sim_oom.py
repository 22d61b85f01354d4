"""Issue 42, item 9 (b): out of address space is out of memory, so idle models are unloaded to make room.

``cuMemAddressReserve`` answers CUDA_ERROR_OUT_OF_MEMORY when no range of the size is left (CUDA driver API
reference; cuda.h lists it among its returns), ``hipMemAddressReserve`` hipErrorOutOfMemory (ROCm clr,
hip_vm.cpp). The VMM backend passed that on as a ``DriverError``, so the residency manager, which unloads
idle models for a reservation refused for want of memory or address space, never did, and a model that did
not fit stopped ComfyUI's load with a driver error. The simulated drivers now also hold every reservation
to the process's address space when they keep books only (a replay), as they did where the bytes are real.
"""

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
from membackend.types import AddressSpaceExhausted, Device, DriverError

MiB, GiB, TiB = 1 << 20, 1 << 30, 1 << 40
PAGE = 2 * MiB
CUDA0 = Device("cuda", 0)


def h200(va_space: int | None = None, hold_bytes: bool = True) -> Session:
    """A session of the generic VMM backend over the simulated H200; ``va_space`` makes its process's address
    space that small, so a few models fill it."""
    p = get_profile("h200")
    driver = sim_driver(p, hold_bytes=hold_bytes)
    if va_space is not None:
        driver.sim.va_space = va_space
    backend = VmmBackend(dataclasses.replace(GENERIC, page_size=PAGE), driver, capabilities=p.capabilities())
    machine = gather_machine(load_settings(sim_profile="h200").machine.model_copy(update={"devices": None}))
    return Session(backend, machine=machine, ledger=Ledger(sanitize=True))


def code_name(exc: DriverError) -> str:
    return getattr(exc.code, "name", str(exc.code))


@pytest.mark.parametrize("profile,oom", [("h200", "CUDA_ERROR_OUT_OF_MEMORY"),
                                         ("rx7900xtx-linux", "hipErrorOutOfMemory")])
def test_a_full_address_space_is_the_drivers_out_of_memory_in_books_only_mode_too(profile, oom):
    d = sim_driver(profile, hold_bytes=False)  # books only: no address space of this process behind it
    d.set_device(0)
    windows = [d.address_reserve(4 * TiB, 0) for _ in range(d.sim.VA_SPACE // (4 * TiB))]
    with pytest.raises(DriverError) as refused:
        d.address_reserve(4 * TiB, 0)
    assert code_name(refused.value) == oom
    d.address_free(windows.pop(), 4 * TiB)
    assert d.address_reserve(4 * TiB, 0)  # room again once a range goes back


def test_a_reserve_past_the_address_space_is_a_typed_out_of_memory_and_changes_nothing():
    s = h200(va_space=8 * GiB)
    try:
        kept = s.reserve(CUDA0, 6 * GiB)
        before = (s.ledger.account(CUDA0), s.backend.driver.sim.state()["reservations"])
        with pytest.raises(AddressSpaceExhausted, match="no address range of that size left") as refused:
            s.reserve(CUDA0, 4 * GiB)
        assert not isinstance(refused.value, DriverError)
        cause = refused.value.__cause__
        assert isinstance(cause, DriverError) and code_name(cause) == "CUDA_ERROR_OUT_OF_MEMORY"
        assert (s.ledger.account(CUDA0), s.backend.driver.sim.state()["reservations"]) == before
        s.release_reservation(kept)
        s.release_reservation(s.reserve(CUDA0, 4 * GiB))  # fits once the first went back
    finally:
        s.close()


@pytest.fixture
def full():
    """The simulated H200 with 8 GiB of address space, filled by four idle 2 GiB models (one of them with
    resident pages, unpinned); the least recently used is ``m0``."""
    s = h200(va_space=8 * GiB)
    m = ResidencyManager(s)
    models = [m.register(f"m{i}", 2 * GiB, CUDA0) for i in range(4)]
    assert m.fault(models[3], 0, 4 * PAGE, CUDA0).ok
    m.unpin(models[3], 0, 4 * PAGE, CUDA0)
    yield s, m, models
    s.close()


def test_idle_models_are_unloaded_to_reserve_one_more(full):
    s, m, models = full
    x = m.register("x", 2 * GiB, CUDA0)  # no address space left: the least recently used idle model goes
    assert x.reservation(CUDA0) is not None
    stats = m.stats(CUDA0)
    assert not stats["m0"]["reserved"] and all(stats[f"m{i}"]["reserved"] for i in (1, 2, 3))
    assert s.ledger.account(CUDA0).reservations_alive == 4
    f = m.fault(models[0], 0, PAGE, CUDA0)  # the unloaded model is used again: the next idle one makes room
    assert f.ok and not m.stats(CUDA0)["m1"]["reserved"] and m.stats(CUDA0)["m0"]["reserved"]
    m.unpin(models[0], 0, PAGE, CUDA0)


def test_a_model_bigger_than_what_unloading_frees_is_refused_typed_after_trying(full):
    s, m, models = full
    with pytest.raises(AddressSpaceExhausted):
        m.register("huge", 10 * GiB, CUDA0)  # more than the whole space: nothing can make room
    assert "huge" not in m.stats()
    assert s.ledger.account(CUDA0).reservations_alive == s.backend.driver.sim.state()["reservations"]


def test_with_nothing_evictable_the_answer_is_a_typed_out_of_memory(full):
    s, m, models = full
    m.use(models[:2])  # in the current run: never unloaded for room
    assert m.fault(models[2], 0, PAGE, CUDA0).ok  # pinned: never unloaded either
    assert m.fault(models[3], 0, PAGE, CUDA0).ok
    alive = s.ledger.account(CUDA0).reservations_alive
    with pytest.raises(AddressSpaceExhausted) as refused:
        m.register("y", 2 * GiB, CUDA0)
    assert not isinstance(refused.value, DriverError)
    assert "y" not in m.stats() and s.ledger.account(CUDA0).reservations_alive == alive
    assert all(st["reserved"] for st in m.stats(CUDA0).values())  # every model kept its range
    m.unpin(models[2], 0, PAGE, CUDA0)
    m.unpin(models[3], 0, PAGE, CUDA0)
    m.register("y", 2 * GiB, CUDA0)  # unpinned and outside the run: one of them makes room now
    assert m.stats(CUDA0)["m0"]["reserved"] and m.stats(CUDA0)["m1"]["reserved"]


def test_a_fault_that_must_reserve_again_answers_out_of_memory_when_no_room_can_be_made(full):
    s, m, models = full
    m.full_unload(models[0])
    m.register("z", 2 * GiB, CUDA0)  # takes the range m0 gave back
    m.use(models[1:] + [m.models()[-1]])  # every other model is in the run now
    f = m.fault(models[0], 0, PAGE, CUDA0)  # m0 must reserve again: no address space, nothing to unload
    assert not f.ok  # out of memory, as for a fault: ComfyUI casts from its own copy
    assert not m.stats(CUDA0)["m0"]["reserved"]
