"""The conformance kit: every rule of the contract as a test, plus property-based sequences.

Run it against any backend::

    pytest --pyargs membackend.testing.conformance --membackend-backend NAME
    pytest --pyargs membackend.testing.conformance --membackend-plugin package.module:MyBackend

Each test gets a fresh session forced onto the target backend
(``membackend_session``). The ledger is checked against the platform, not
against the backend: for ``cpu`` backends against the kernel (``/proc/self/maps``
and ``mincore`` after every verb), for GPU backends against the optional hook
``membackend_inspect``. Driver failures are injected through the optional hook
``membackend_inject_failures``. After each test the kit releases what is left
and checks that nothing leaked. Checks that could not run are named in the
terminal summary.

The property-based sequences are the kit's long part (marker ``kit_long``).
They run from one seed per pytest run (``--membackend-seed N``, else drawn and
printed in the summary); the same seed gives the same sequences, and a failed
one prints the command that runs it again.

Every ``test_*`` function of this module is collected wherever the module is
star-imported (``__all__`` is computed from the names), so a new rule cannot
be left out of a hand-kept list.
"""

from __future__ import annotations

import ctypes
import errno
import gc
import re
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from .._drivers.open import machine_for, profile_names
from .._session import Session
from .._settings import load_settings
from ..types import (
    AddressSpaceExhausted,
    Budget,
    Candidate,
    Device,
    DriverError,
    Fault,
    InvalidSize,
    Misaligned,
    OutOfRange,
    Reservation,
    ReservationReleased,
    SanitizerError,
    WrongDevice,
)
from .harness import (
    Checker,
    Target,
    async_work,
    build_session,
    checker_for,
    inject_failures,
    kit_device,
    mappings,
    note,
    resident_pages,
)
from .holdings import process_resident
from .measure import budget_problems, simulated_truth, sized, tolerance_for
from .plugin import RERUNS_KEY, rerun_command

MiB = 1 << 20


def _verify(session: Session, device: Device, step: str) -> None:
    checker_for(session).verify(device, step)


def _pages(session: Session, n: int) -> tuple[Reservation, int]:
    r = session.reserve(kit_device(session), 1)
    ps = r.page_size
    session.release_reservation(r)
    return session.reserve(kit_device(session), n * ps), ps


def _account(session: Session, device: Device) -> tuple[int, int, int]:
    a = session.ledger.account(device)
    return a.reserved, a.resident, a.reservations_alive


# --------------------------------------------------------------------------- rules


def test_reserve_gives_whole_pages_and_no_memory(membackend_session):
    s = membackend_session
    dev = kit_device(s)
    want = 3 * MiB + 1
    r = s.reserve(dev, want)
    assert isinstance(r, Reservation) and r.device == dev and not r.released, f"reserve({dev}, {want}) returned {r!r}"
    assert r.size >= want and r.size % r.page_size == 0 and r.size - r.page_size < want, \
        f"reserve({dev}, {want}): size {r.size} with page size {r.page_size}; expected {want} rounded up to whole pages"
    assert _account(s, dev) == (r.size, 0, 1), \
        f"after reserve: ledger (reserved, resident, alive) = {_account(s, dev)}; expected ({r.size}, 0, 1)"
    _verify(s, dev, f"reserve({dev}, {want})")


@pytest.mark.parametrize("size", [0, -1])
def test_reserve_rejects_a_size_that_is_not_positive(membackend_session, size):
    with pytest.raises(InvalidSize):
        membackend_session.reserve(kit_device(membackend_session), size)
    assert membackend_session.ledger.alive() == 0


def test_reserve_rejects_a_device_not_served(membackend_session):
    s = membackend_session
    other = next(k for k in ("cpu", "cuda", "hip") if k not in s.device_kinds)
    with pytest.raises(WrongDevice):
        s.reserve(Device(other, 0), MiB)
    with pytest.raises(WrongDevice):
        s.reserve(Device(kit_device(s).kind, 63), MiB)
    assert s.ledger.alive() == 0


def test_fault_backs_every_touched_page_with_generations(membackend_session):
    s = membackend_session
    r, ps = _pages(s, 4)
    f = s.fault(r, ps // 2, ps)  # touches pages 0 and 1
    assert isinstance(f, Fault) and f.ok and f.first_page == 0 and len(f.generations) == 2 and f.mapped == 2 * ps, \
        f"fault(#{r.id}, {ps // 2}, {ps}) returned {f!r}; expected ok, first_page 0, 2 generations, mapped {2 * ps}"
    _verify(s, r.device, f"fault(#{r.id}, {ps // 2}, {ps})")
    again = s.fault(r, 0, 2 * ps)
    assert again.ok and again.generations == f.generations and again.mapped == 0, \
        f"second fault(#{r.id}, 0, {2 * ps}) returned {again!r}; expected ok, generations {f.generations}, mapped 0"
    assert s.ledger.resident(r) == 2 * ps, f"ledger resident {sized(s.ledger.resident(r))}; expected {sized(2 * ps)}"
    _verify(s, r.device, f"second fault(#{r.id}, 0, {2 * ps})")


def test_a_page_gets_a_new_generation_when_it_gets_new_memory(membackend_session):
    s = membackend_session
    r, ps = _pages(s, 2)
    g1 = s.fault(r, 0, 2 * ps).generations
    dropped = s.free(r, ps, ps)
    assert dropped == ps, f"free(#{r.id}, {ps}, {ps}) of a resident page returned {sized(dropped)}; expected {sized(ps)}"
    _verify(s, r.device, f"free(#{r.id}, {ps}, {ps})")
    g2 = s.fault(r, 0, 2 * ps).generations
    assert g2[0] == g1[0] and g2[1] != g1[1], \
        f"generations {g1} before and {g2} after page 1 was freed and faulted; expected page 0 kept, page 1 new"


def test_faults_and_frees_over_holes_back_exactly_the_missing_pages(membackend_session):
    """A fault over resident pages and holes backs the holes only, keeps the resident pages' generations, and
    a fault that ends one byte into a page backs that page too; checked page by page against the kernel
    (or the driver) after every verb."""
    s = membackend_session
    r, ps = _pages(s, 5)
    first = {}
    for p in (1, 3):
        one = s.fault(r, p * ps, ps)
        assert one.ok, f"fault(#{r.id}, {p * ps}, {ps}) returned {one!r}"
        first[p] = one.generations[0]
    f = s.fault(r, 0, r.size)
    assert f.ok and f.mapped == 3 * ps and (f.generations[1], f.generations[3]) == (first[1], first[3]), \
        f"fault(#{r.id}, 0, {r.size}) over pages 1 and 3 resident returned {f!r}; expected mapped {3 * ps} " \
        f"(pages 0, 2, 4) and pages 1, 3 keeping generations {first[1]}, {first[3]}"
    _verify(s, r.device, f"fault(#{r.id}, 0, {r.size}) over holes")
    assert s.free(r, 2 * ps, ps) == ps
    again = s.fault(r, 0, r.size)
    assert again.ok and again.mapped == ps and [i for i in range(5) if again.generations[i] != f.generations[i]] \
        == [2], f"fault(#{r.id}, 0, {r.size}) after page 2 was freed returned {again!r}; expected mapped {ps}, " \
                f"only page 2 new (generations before {f.generations})"
    _verify(s, r.device, f"fault(#{r.id}, 0, {r.size}) after free(#{r.id}, {2 * ps}, {ps})")
    edge = s.reserve(r.device, 2 * ps)
    f = s.fault(edge, ps - 1, 2)
    assert f.ok and f.first_page == 0 and len(f.generations) == 2 and f.mapped == 2 * ps, \
        f"fault(#{edge.id}, {ps - 1}, 2) across a page boundary returned {f!r}; expected both pages backed"
    _verify(s, r.device, f"fault(#{edge.id}, {ps - 1}, 2)")


def test_free_drops_pages_and_keeps_the_range(membackend_session):
    s = membackend_session
    r, ps = _pages(s, 4)
    s.fault(r, 0, 4 * ps)
    for expected in (2 * ps, 0):
        dropped = s.free(r, 0, 2 * ps)
        assert dropped == expected, f"free(#{r.id}, 0, {2 * ps}) returned {sized(dropped)}; expected {sized(expected)}"
        _verify(s, r.device, f"free(#{r.id}, 0, {2 * ps})")
    dropped = s.free(r)
    assert dropped == 2 * ps, f"free(#{r.id}) of the rest returned {sized(dropped)}; expected {sized(2 * ps)}"
    assert s.ledger.account(r.device).reserved == r.size
    _verify(s, r.device, f"free(#{r.id})")
    f = s.fault(r, 0, r.size)
    assert f.ok, f"fault(#{r.id}, 0, {r.size}) after free returned {f!r}; the range must stay usable"
    _verify(s, r.device, f"fault(#{r.id}, 0, {r.size}) after free")


def test_release_returns_everything(membackend_session):
    s = membackend_session
    r, ps = _pages(s, 3)
    s.fault(r, 0, 2 * ps)
    dropped = s.release_reservation(r)
    assert dropped == 2 * ps and r.released, \
        f"release_reservation(#{r.id}) returned {dropped}, released={r.released}; expected {2 * ps}, True"
    assert _account(s, r.device) == (0, 0, 0), \
        f"after release: ledger (reserved, resident, alive) = {_account(s, r.device)}; expected (0, 0, 0)"
    _verify(s, r.device, f"release_reservation(#{r.id})")


@pytest.mark.parametrize("verb", ["fault", "free", "release_reservation", "fence"])
def test_a_released_reservation_cannot_be_used(membackend_session, verb):
    s = membackend_session
    r, ps = _pages(s, 1)
    s.release_reservation(r)
    with pytest.raises(ReservationReleased):
        if verb == "fence":
            s.fence(reservation=r)
        elif verb == "release_reservation":
            s.release_reservation(r)
        else:
            getattr(s, verb)(r, 0, ps)


@pytest.mark.parametrize("where", ["past_end", "negative", "zero_size"])
def test_ranges_outside_the_reservation_are_refused(membackend_session, where):
    s = membackend_session
    r, ps = _pages(s, 2)
    offset, size, error = {"past_end": (ps, 2 * ps, OutOfRange), "negative": (-1, ps, OutOfRange),
                           "zero_size": (0, 0, InvalidSize)}[where]
    for verb in (s.fault, s.free):
        with pytest.raises(error):
            verb(r, offset, size)
    assert s.ledger.resident(r) == 0
    _verify(s, r.device, f"refused calls on #{r.id}")


def test_free_needs_whole_pages(membackend_session):
    s = membackend_session
    r, ps = _pages(s, 2)
    s.fault(r, 0, 2 * ps)
    with pytest.raises(Misaligned):
        s.free(r, 1, ps)
    with pytest.raises(Misaligned):
        s.free(r, 0, ps // 2)
    assert s.ledger.resident(r) == 2 * ps
    _verify(s, r.device, f"refused frees on #{r.id}")


OOM_CAPACITY = 4 * MiB


@pytest.mark.parametrize("how", ["injected", "capacity"])
def test_out_of_memory_is_a_result_and_changes_nothing(membackend_target, how):
    """Drive the backend out of memory (by injected driver failures, or past ``host_capacity``
    where the backend honours it): the fault returns ok=False (or raises a typed ``DriverError``),
    and the ledger, the kernel and the driver are exactly as before."""
    check = f"out-of-memory rollback ({how})"
    extra: dict[str, Any] = {"host_capacity": OOM_CAPACITY} if how == "capacity" else {}
    s = build_session(membackend_target, **extra)
    try:
        dev = kit_device(s)
        if how == "capacity" and dev.kind != "cpu":  # host_capacity caps host memory: nothing to honour here
            pytest.skip(f"{membackend_target} serves {dev.kind} devices: host_capacity does not apply (its out of "
                        "memory is driven by injected failures)")
        if how == "capacity":
            total = s.budget_query(dev).total
            if total != OOM_CAPACITY:
                if not checker_for(s).has["membackend_inject_failures"]:  # else injection drives it there
                    note(membackend_target, check, f"does not honour host_capacity (budget total {total})")
                pytest.skip(f"{membackend_target} does not honour host_capacity={OOM_CAPACITY}: budget total {total}")
            probe = s.reserve(dev, 1)
            ps = probe.page_size
            s.release_reservation(probe)
            r = s.reserve(dev, (OOM_CAPACITY // ps + 2) * ps)
        else:
            r, ps = _pages(s, 4)
        assert s.fault(r, 0, ps).ok, f"fault(#{r.id}, 0, {ps}) of one page failed before any pressure"
        before = _account(s, dev)
        _verify(s, dev, f"fault(#{r.id}, 0, {ps})")
        step = f"fault(#{r.id}, {ps}, {r.size - ps}) under {how} out of memory"
        if how == "capacity":
            _capacity_left(s, dev, OOM_CAPACITY, "after one page was faulted")
            f = s.fault(r, ps, r.size - ps)
            assert not f.ok, f"{step}: returned {f!r}; expected ok=False past host_capacity={OOM_CAPACITY}"
        else:
            with inject_failures(s, probability=1.0) as injected:
                if injected is None:
                    note(membackend_target, check, "no membackend_inject_failures")
                    pytest.skip(f"{membackend_target} cannot inject driver failures (no membackend_inject_failures)")
                try:
                    f = s.fault(r, ps, r.size - ps)
                except DriverError as exc:  # a failure other than out of memory is a typed error: also allowed
                    assert not out_of_memory(exc), \
                        f"{step}: raised {exc!r}, an out-of-memory code; out of memory is Fault(ok=False), never an " \
                        "error (docs/backends.md)"
                    f = None
                assert f is None or not f.ok, f"{step}: returned {f!r} while every driver call failed"
                assert injected.injected > 0, f"{step}: the backend's injection reported 0 failures"
        assert _account(s, dev) == before, \
            f"{step}: ledger (reserved, resident, alive) {_account(s, dev)}; expected unchanged {before}"
        _verify(s, dev, step)
        note(membackend_target, check, None, "host_capacity" if how == "capacity" else "membackend_inject_failures")
        again = s.fault(r, ps, ps)
        assert again.ok, f"fault(#{r.id}, {ps}, {ps}) after the pressure ended returned {again!r}; expected ok"
        _verify(s, dev, f"fault(#{r.id}, {ps}, {ps}) after out of memory")
        if how == "capacity":
            s.fault(r, 0, ps)
            s.free(r, ps, ps)  # not the first page: what a free counts must not depend on where it starts
            _capacity_left(s, dev, OOM_CAPACITY, "after a page was freed")
        else:
            _injection_stops(s, r, ps)
    finally:
        s.close()
    checker_for(s).verify_nothing_left(dev)


#: the platforms' own out-of-memory codes: errno's (a host or memfd backend), the CUDA driver's and HIP's names
OUT_OF_MEMORY = ("OUT_OF_MEMORY", "OutOfMemory", "MemoryAllocation")


def out_of_memory(exc: DriverError) -> bool:
    """Whether a driver error's code says out of memory (ENOMEM, ENOSPC, CUDA_ERROR_OUT_OF_MEMORY,
    hipErrorOutOfMemory, cudaErrorMemoryAllocation)."""
    code = exc.code
    if isinstance(code, int) and not isinstance(code, bool) and type(code) is int:
        return code in (errno.ENOMEM, errno.ENOSPC)
    return any(word in str(code) for word in OUT_OF_MEMORY)


def _capacity_left(s: Session, dev: Device, capacity: int, when: str) -> None:
    """Under ``host_capacity`` the budget's free is the capacity less what the backend holds (docs/kit.md)."""
    held = s.ledger.account(dev).resident
    b = s.budget_query(dev)
    assert b.free == capacity - held, \
        f"budget_query({dev}) with host_capacity={capacity} and {held} bytes resident ({when}) returned free=" \
        f"{b.free}; expected {capacity - held}: the capacity less what the backend holds"


def _injection_stops(s: Session, r: Reservation, ps: int) -> None:
    """An injection at probability 0 fails nothing, and one stopped fails nothing more."""
    with inject_failures(s, probability=0.0, seed=1) as none:
        for _ in range(3):
            s.free(r, ps, ps)
            f = s.fault(r, ps, ps)
            assert f.ok, f"fault(#{r.id}, {ps}, {ps}) under an injection of probability 0 returned {f!r}"
        assert none.injected == 0, f"an injection of probability 0 reported {none.injected} failures"
    with inject_failures(s, probability=1.0, seed=1) as every:
        pass
    count = every.injected
    s.free(r, ps, ps)
    f = s.fault(r, ps, ps)
    assert f.ok and every.injected == count, \
        f"after stop() of an injection, fault(#{r.id}, {ps}, {ps}) returned {f!r} and the count went from " \
        f"{count} to {every.injected}: a stopped injection must fail nothing"


def test_free_and_release_wait_for_recorded_work(membackend_session):
    s = membackend_session
    r, ps = _pages(s, 2)
    s.fault(r, 0, 2 * ps)
    token = async_work(s, r, 0, ps)
    s.record(r, token)
    pending = s.ledger.account(r.device).pending_fences
    assert pending == 1, f"after record on #{r.id}: {pending} pending fences; expected 1"
    s.free(r)
    assert token.done(), f"free(#{r.id}) returned while recorded work was unfinished (G2)"
    assert s.ledger.account(r.device).pending_fences == 0
    _verify(s, r.device, f"free(#{r.id}) after recorded work")
    s.fault(r, 0, ps)
    token = async_work(s, r, 0, ps)
    s.record(r, token)
    s.release_reservation(r)
    assert token.done(), f"release_reservation(#{r.id}) returned while recorded work was unfinished (G2)"


def test_device_fence_waits_for_everything_recorded(membackend_session):
    s = membackend_session
    a, ps = _pages(s, 1)
    b = s.reserve(a.device, ps)
    tokens = []
    for r in (a, b):
        s.fault(r, 0, ps)
        tokens.append(async_work(s, r, 0, ps))
        s.record(r, tokens[-1])
    s.fence(a.device)
    unfinished = [i for i, t in enumerate(tokens) if not t.done()]
    assert not unfinished, f"fence({a.device}) returned with work on #{a.id}/#{b.id} unfinished: tokens {unfinished}"
    assert s.ledger.account(a.device).pending_fences == 0


def test_budget_names_its_source(membackend_session):
    s = membackend_session
    kit_device(s)  # a backend serving no device here is not checked (never a green run over nothing)
    for dev in s.devices():
        b = s.budget_query(dev)
        assert isinstance(b, Budget) and b.total > 0 and 0 <= b.usable <= b.free <= b.total, \
            f"budget_query({dev}) returned {b!r}; expected total > 0 and 0 <= usable <= free <= total"
        assert b.usable == max(0, b.free - b.headroom) and b.source, \
            f"budget_query({dev}) returned {b!r}; expected usable = free - headroom and a source"


#: bytes a budget rule faults to see the budget follow the backend's own memory (fewer where the budget is small)
BUDGET_PROBE = 64 * MiB


def _probe_size(s: Session, dev: Device, ps: int) -> int:
    """Whole pages of about :data:`BUDGET_PROBE` bytes, at most a quarter of what the budget calls usable."""
    usable = s.budget_query(dev).usable
    return max(ps, min(-(-BUDGET_PROBE // ps), usable // 4 // ps) * ps)


def test_budget_tells_the_truth(membackend_session):
    """The budget against an independent measure of the machine (the host's memory and its cgroup; a
    simulated driver's own figures, one pool on an integrated device), then the budget must fall by about
    what the backend's own fault made resident."""
    s = membackend_session
    dev = kit_device(s)
    checker = checker_for(s)
    check = "budget vs the machine"
    b, problems, source = checker.budget_problems(dev)
    if source is None:
        note(checker.target, check, "no independent measure of this backend's devices (a GPU backend not over "
                                    "membackend's simulated driver)")
    else:
        assert not problems, f"budget_query({dev}) returned {b!r}: " + "; ".join(problems)
        note(checker.target, check, None, source)
    one_pool = dev.kind == "cpu" or bool(getattr(checker.truth(dev), "free_low", 0))
    assert b.unified or not one_pool, \
        f"budget_query({dev}) returned {b!r}: unified=False for memory that is one pool with the host (a cpu " \
        "device, or an integrated one); expected unified=True, so the policy knows host copies count"
    follows = "budget follows the backend's memory"
    if dev.kind == "cpu":  # a host's free memory moves with every process: first with a capacity, exactly
        capped = build_session(checker.target, host_capacity=FOLLOW_CAPACITY)
        try:
            if capped.budget_query(dev).total == FOLLOW_CAPACITY:
                _budget_falls(capped, dev, FOLLOW_CAPACITY // 4, machine=False)
                note(checker.target, follows, None, f"host_capacity={FOLLOW_CAPACITY}")
                return
        finally:
            capped.close()
    if _budget_falls(s, dev, None, machine=True):
        note(checker.target, follows, None, "a fault of its own")
    else:
        note(checker.target, follows, "the machine's free memory moved as much as the fault, three times (and the "
                                      "backend does not honour host_capacity)")


#: the host_capacity a budget rule gives a ``cpu`` backend to see its budget follow its own memory exactly
FOLLOW_CAPACITY = 256 * MiB


def _budget_falls(s: Session, dev: Device, size: int | None, machine: bool) -> bool:
    """Fault ``size`` bytes (None: about :data:`BUDGET_PROBE`) and assert the budget's free falls by at least
    half of it; with ``machine``, a fall the machine's own free memory did not make either is inconclusive
    (tried three times, then False). Leaves nothing resident."""
    checker = checker_for(s)
    r, ps = _pages(s, 1)
    s.release_reservation(r)
    size = -(-size // ps) * ps if size else _probe_size(s, dev, ps)
    r = s.reserve(dev, size)
    try:
        for _ in range(3):
            before, machine_before = s.budget_query(dev), checker.truth(dev)
            f = s.fault(r, 0, size)
            assert f.ok, f"fault(#{r.id}, 0, {size}) within the budget's usable {sized(before.usable)} returned {f!r}"
            now, machine_now = s.budget_query(dev), checker.truth(dev)
            s.free(r)
            fell = before.free - now.free
            if fell >= size // 2:
                return True
            # with the machine's word: a fall it did not make either is noise; without it (no independent
            # measure), nothing can be concluded
            moved = machine_before.free_high - machine_now.free_high if machine_before and machine_now else None
            assert machine and (moved is None or moved < size // 2), \
                f"budget_query({dev}) free went from {before.free} to {now.free} after fault(#{r.id}, 0, {size}) " \
                f"made {size} bytes resident" \
                + (f", while {machine_now.source} fell by {moved}" if machine_now else "") \
                + "; expected the budget to fall by about what the backend holds"
        return False
    finally:
        s.release_reservation(r)


def _injecting(s: Session, check: str) -> tuple[Device, Checker]:
    """The kit's device and checker of ``s``, or a skip noting ``check`` when the backend cannot inject."""
    dev, checker = kit_device(s), checker_for(s)
    if not checker.has["membackend_inject_failures"]:
        note(checker.target, check, "no membackend_inject_failures")
        pytest.skip(f"{checker.target} cannot inject driver failures (no membackend_inject_failures)")
    return dev, checker


def test_a_free_that_fails_part_way_reports_exactly_what_it_dropped(membackend_target):
    """Frees under injected failures: when one stops part-way, ``DriverError.dropped`` is exactly the bytes
    of the pages the kernel (mincore) or the driver no longer has, every page not dropped keeps its contents
    and its generation, and every dropped one gets a new generation when faulted again (docs/backends.md)."""
    check = "partial frees (dropped page by page)"
    s = build_session(membackend_target)
    try:
        dev, checker = _injecting(s, check)
        r, ps = _pages(s, PARTIAL_PAGES)
        cpu = checker.watch is not None
        partial = 0
        for seed in range(PARTIAL_TRIES):
            f = s.fault(r, 0, r.size)
            assert f.ok, f"fault(#{r.id}, 0, {r.size}) without injected failures returned {f!r}"
            marks = [(seed * PARTIAL_PAGES + p) % 251 + 1 for p in range(r.pages)]
            if cpu:
                unwritable = [p for p in range(r.pages) if not writable(r.base + p * ps)]
                assert not unwritable, f"fault(#{r.id}, 0, {r.size}) returned ok but page(s) {unwritable} are " \
                                       f"not mapped read-write (/proc/self/maps): a resident page must be writable"
                for p, m in enumerate(marks):
                    ctypes.memset(r.base + p * ps, m, 1)
            held_before = checker.resident(dev)
            step = f"free(#{r.id}) under injected failures (seed {seed})"
            with inject_failures(s, 0.25, seed):
                try:
                    s.free(r)
                    continue
                except DriverError as exc:
                    error = exc
            dropped = getattr(error, "dropped", 0)
            if cpu:
                now = resident_pages(r, range(r.pages))
                assert now is not None, f"{step} raised {error!r}: part of #{r.id}'s range is no longer mapped; " \
                                        "a failed free keeps the whole address range"
                gone = [p for p in range(r.pages) if not now[p]]
                assert dropped == len(gone) * ps, \
                    f"{step} raised {error!r} with dropped={dropped}; the kernel (mincore) shows page(s) " \
                    f"{gone} dropped: expected dropped={len(gone) * ps}"
                changed = [p for p in range(r.pages) if now[p] and ctypes.c_ubyte.from_address(r.base + p * ps).value
                           != marks[p]]
                assert not changed, f"{step}: page(s) {changed} not dropped lost their contents (expected kept)"
            else:
                gone = None
                found = checker.resident(dev)
                if held_before is not None and found is not None:
                    assert dropped == held_before - found, \
                        f"{step} raised {error!r} with dropped={dropped}; the driver's resident bytes went from " \
                        f"{held_before} to {found}: expected dropped={held_before - found}"
            _verify(s, dev, step)
            partial += 0 < dropped < r.size
            again = s.fault(r, 0, r.size)
            assert again.ok, f"fault(#{r.id}, 0, {r.size}) after {step} returned {again!r}"
            if gone is not None:
                wrong = [p for p in range(r.pages) if (again.generations[p] != f.generations[p]) != (p in gone)]
                assert not wrong, f"after {step}: generation of page(s) {wrong} wrong (dropped {gone}: those get " \
                                  f"new generations, the rest keep theirs); before {f.generations}, after " \
                                  f"{again.generations}"
            s.free(r)
        if partial:
            note(membackend_target, check, None, f"{partial} frees stopped part-way by injected failures")
        else:
            note(membackend_target, check, f"no injected failure stopped a free part-way in {PARTIAL_TRIES} tries "
                                           "(does membackend_inject_failures fail page drops?)")
    finally:
        s.close()
    checker_for(s).verify_nothing_left(dev)


PARTIAL_PAGES, PARTIAL_TRIES = 6, 24


def test_release_and_close_give_the_memory_back(membackend_target):
    """Make memory resident, release and close: the process holds no more than before the session (resident
    memory, descriptors, mappings, files), checked after the release and after the close. One session runs
    first, unmeasured, so what a backend or its driver loads once per process (a library, a runtime) is not
    counted."""
    _one_cycle(membackend_target)
    gc.collect()
    before = process_resident()
    s = build_session(membackend_target)
    try:
        dev = kit_device(s)
        r, ps = _pages(s, 1)
        s.release_reservation(r)
        size = _probe_size(s, dev, ps)
        r = s.reserve(dev, size)
        f = s.fault(r, 0, size)
        assert f.ok, f"fault(#{r.id}, 0, {size}) returned {f!r}"
        s.free(r, 0, ps)
        s.release_reservation(r)
        _verify(s, dev, f"release_reservation(#{r.id}) of {size} bytes")
    finally:
        s.close()
    checker_for(s).verify_nothing_left(dev)
    gc.collect()
    after = process_resident()
    if before is None or after is None:
        note(membackend_target, "resident memory after close", "/proc/self/status is not available")
        return
    assert after - before < size // 2, \
        f"{membackend_target}: after fault of {size} bytes, release and close, the process holds {after - before} " \
        f"bytes more resident memory than before the session (/proc/self/status RssAnon+RssShmem; " \
        "expected the memory given back)"
    note(membackend_target, "resident memory after close", None, "/proc/self/status")


def test_a_fault_that_fails_part_way_rolls_back_what_it_backed(membackend_target):
    """Faults of six pages under injected failures, every other try over holes (pages 1 and 3 already
    resident, so the call backs several runs): one that fails part-way is ``Fault(ok=False)`` with every page
    this call backed dropped again and the resident ones kept, or a typed ``DriverError`` whose ``mapped`` is
    exactly what the rollback could not drop (docs/backends.md), as the kernel (mincore) or the driver counts."""
    check = "faults that fail part-way (rolled back)"
    s = build_session(membackend_target)
    try:
        dev, checker = _injecting(s, check)
        r, ps = _pages(s, PARTIAL_PAGES)
        failed = 0
        for seed in range(PARTIAL_TRIES):
            kept = (1, 3) if seed % 2 else ()
            for p in kept:
                assert s.fault(r, p * ps, ps).ok, f"fault(#{r.id}, {p * ps}, {ps}) without injected failures"
            before = checker.resident(dev)
            step = f"fault(#{r.id}, 0, {r.size}) under injected failures (seed {seed}, pages {kept} resident)"
            with inject_failures(s, 0.25, seed):
                try:
                    f, mapped = s.fault(r, 0, r.size), 0
                except DriverError as exc:
                    f, mapped = None, getattr(exc, "mapped", 0)
            if f is not None and f.ok:
                s.free(r)
                continue
            failed += 1
            if checker.watch is not None:
                now = resident_pages(r, range(r.pages)) or []
                lost = [p for p in kept if not now[p]]
                assert not lost, f"{step} returned {f!r}: page(s) {lost}, resident before the call, are gone"
                left = resident_bytes_of(r) - len(kept) * ps
                assert left == mapped, f"{step} returned {f!r} (mapped={mapped}) but the kernel (mincore) finds " \
                                       f"{left} bytes more resident: expected {mapped} (what the rollback says it kept)"
            elif before is not None and (after := checker.resident(dev)) is not None:
                left = after - before
                assert left == mapped, f"{step} returned {f!r} (mapped={mapped}) but the driver holds {left} more " \
                                       f"bytes: expected {mapped}"
            _verify(s, dev, step)
            s.free(r)
        note(membackend_target, check, None if failed else f"no injected failure stopped a fault in "
                                                           f"{PARTIAL_TRIES} tries",
             f"{failed} faults stopped by injected failures")
    finally:
        s.close()
    checker_for(s).verify_nothing_left(dev)


def writable(address: int) -> bool:
    """Whether ``address`` lies in a read-write mapping of this process (a write there cannot kill it)."""
    return any(perms.startswith("rw") for _, _, perms, _ in mappings(address, address + 1))


def resident_bytes_of(r: Reservation) -> int:
    """Bytes of ``r`` the kernel holds resident (mincore), page by page."""
    return sum(r.page_size for ok in resident_pages(r, range(r.pages)) or () if ok)


#: faults at once in :func:`test_faults_at_once_stay_within_host_capacity`, and rounds of them: a race between
#: the capacity check and the count shows in a round only when the threads interleave inside it, so many short
#: rounds, with the interpreter switching threads often (:data:`AT_ONCE_SWITCH_INTERVAL`), make a missed race
#: unlikely on a busy machine too (10 rounds at the default interval missed one planted race in three runs)
AT_ONCE = 4
AT_ONCE_ROUNDS = 50
AT_ONCE_SWITCH_INTERVAL = 1e-5  # seconds (CPython's default is 5 ms: sys.getswitchinterval)


def test_faults_at_once_stay_within_host_capacity(membackend_target):
    """Faults on different reservations at once (the session runs them in parallel, docs/backends.md
    "Threads") under ``host_capacity``: together they never make more resident than the capacity, and
    each is ok or out of memory, never an error."""
    check = "faults at once within host_capacity"
    capacity = 16 * MiB
    s = build_session(membackend_target, host_capacity=capacity)
    try:
        dev = kit_device(s)
        if dev.kind != "cpu":  # host_capacity caps host memory: nothing to stay within here
            pytest.skip(f"{membackend_target} serves {dev.kind} devices: host_capacity does not apply")
        if s.budget_query(dev).total != capacity:
            note(membackend_target, check, "does not honour host_capacity")
            pytest.skip(f"{membackend_target} does not honour host_capacity={capacity}")
        probe = s.reserve(dev, 1)
        ps = probe.page_size
        s.release_reservation(probe)
        pages = capacity // ps // 2 + 1  # any two of them cross the capacity
        if pages < 2:
            note(membackend_target, check, f"pages of {ps} bytes: fewer than 4 fit in {capacity} bytes")
            pytest.skip(f"{membackend_target}: pages too large for the capacity")
        rs = [s.reserve(dev, pages * ps) for _ in range(AT_ONCE)]
        switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(switch_interval, AT_ONCE_SWITCH_INTERVAL))
        try:
            with ThreadPoolExecutor(AT_ONCE) as pool:
                for round_ in range(AT_ONCE_ROUNDS):
                    start = threading.Barrier(AT_ONCE)

                    def fault(r: Reservation) -> Fault:
                        start.wait()
                        return s.fault(r, 0, r.size)

                    results = list(pool.map(fault, rs))
                    held = sum(resident_bytes_of(r) for r in rs) if checker_for(s).watch is not None else \
                        s.ledger.account(dev).resident
                    assert held <= capacity, \
                        f"round {round_}: {AT_ONCE} faults of {pages * ps} bytes at once returned " \
                        f"{[f.ok for f in results]} and left {held} bytes resident past host_capacity={capacity}: " \
                        "the capacity must be claimed atomically with the check"
                    _verify(s, dev, f"round {round_} of faults at once")
                    for r in rs:
                        s.free(r)
        finally:
            sys.setswitchinterval(switch_interval)
        note(membackend_target, check, None, f"{AT_ONCE} threads, {AT_ONCE_ROUNDS} rounds")
    finally:
        s.close()
    checker_for(s).verify_nothing_left(dev)


def test_a_full_unload_returns_the_reservation(membackend_session):
    """Through membackend's residency policy, as ComfyUI's unload drives it: after a full unload the model
    holds no reservation and no memory (G1; ``Capabilities.release_on_full_unload=False`` keeps them: the
    41.58 GB plateau of ComfyUI #15993)."""
    from .._residency import ResidencyManager

    s = membackend_session
    dev = kit_device(s)
    r, ps = _pages(s, 1)
    s.release_reservation(r)
    policy = ResidencyManager(s)
    model = policy.register("kit-model", 2 * ps, dev)
    f = policy.fault(model, 0, 2 * ps)
    assert f.ok, f"the policy's fault of 2 pages returned {f!r}"
    policy.unpin(model, 0, 2 * ps)
    policy.full_unload(model)
    assert _account(s, dev) == (0, 0, 0), \
        f"after a full unload: ledger (reserved, resident, alive) = {_account(s, dev)}; expected (0, 0, 0) (G1: the " \
        f"reservation goes back; capabilities {s.backend.capabilities if hasattr(s.backend, 'capabilities') else ''})"
    _verify(s, dev, "full unload")


#: device lists of machines no simulated profile is: an integrated device beside a discrete one, two of each
ODD_MACHINES: tuple[list[dict[str, Any]], ...] = (
    [{"name": "integrated", "total_memory": "16GiB", "integrated": True},
     {"name": "discrete", "total_memory": "80GiB"}],
    [{"name": "a", "total_memory": "80GiB"}, {"name": "b", "total_memory": "80GiB", "unified": True}],
    [{"name": "c", "total_memory": "16GiB", "integrated": True},
     {"name": "d", "total_memory": "16GiB", "integrated": True}],
)


def test_a_platform_fits_only_machines_it_serves_truthfully(membackend_session):
    """A platform record (a backend built on membackend's virtual-memory mechanism) scores above 0 only on a
    machine that has a device of its vendor, and on every simulated machine it fits, its budget tells the
    truth there (a platform reading one pool on a discrete GPU, or the device view on an integrated one,
    fails). On a unified pool its own headroom keeps at least one page for the host."""
    s = membackend_session
    dev = kit_device(s)
    checker = checker_for(s)
    platform = getattr(s.backend, "platform", None)
    target = checker.target
    if platform is None:  # a backend of its own: no probe over other machines' facts to judge
        pytest.skip(f"{target} is not a platform record")
    truth = simulated_truth(s, dev)
    if truth is None:
        note(target, "where the platform fits", "not on a simulated machine (no figures to check its budget by)")
        pytest.skip(f"{target} is not on a simulated machine")
    here = machine_for(load_settings())
    score = s.backend.membackend_probe(machine=here).score
    for facts in ODD_MACHINES:  # machines no profile is: the probe answers them too, with a reason
        odd = machine_for(load_settings(machine={"devices": [{**d, "kind": dev.kind} for d in facts]}))
        c = s.backend.membackend_probe(machine=odd)
        assert isinstance(c, Candidate) and c.reason, \
            f"{target}'s probe on a machine with {facts} returned {c!r}; expected a Candidate with a reason"
    assert score == 0 or here.gpus(dev.kind), \
        f"{target}'s probe scores {score} on this machine, which has no {dev.kind} device: selected, it would " \
        "serve nothing (expected 0 with the reason)"
    fits = []
    for profile in profile_names(vmm_only=True):
        machine = machine_for(load_settings(sim_profile=profile))
        if s.backend.membackend_probe(machine=machine).score <= 0 or not machine.gpus(dev.kind):
            continue
        fits.append(profile)
        other = build_session(Target(target.backend, profile, target.import_path), report=False)
        try:
            d = other.devices()[0]
            other_truth, b = simulated_truth(other, d), other.budget_query(d)
            assert other_truth is not None  # a simulated profile: the simulation's figures are there
            problems = budget_problems(other_truth, b, checker_for(other).held(d), tolerance_for(other_truth, d))
            assert not problems, f"{target}'s probe fits {profile}, where budget_query({d}) returns {b!r}: " \
                                 + "; ".join(problems)
        finally:
            other.close()
    if not fits:  # hardware no profile simulates (a device model of its own): nothing more to judge it by
        note(target, "where the platform fits", f"its probe fits none of the simulated machines "
                                                f"({', '.join(profile_names(vmm_only=True))})")
    if truth.free_low:  # one pool with the host
        own = s.members.own_headroom
        room = own(dev, truth.total)[0] if own is not None else s.budget_query(dev).headroom
        probe = s.reserve(dev, 1)
        s.release_reservation(probe)
        assert room >= probe.page_size, \
            f"{target} keeps {room} bytes of one pool with the host as headroom, less than one page " \
            f"({probe.page_size} bytes): the host keeps nothing (a headroom in MiB given as bytes?)"
    if fits:
        note(target, "where the platform fits", None, f"its probe on this machine and {len(fits)} simulated ones")


def _one_cycle(target: Target) -> None:
    """Reserve, fault, release and close one page's worth on ``target``, checking nothing (a warm-up)."""
    s = build_session(target, report=False)
    try:
        r, ps = _pages(s, 1)
        s.fault(r, 0, ps)
        s.release_reservation(r)
    finally:
        s.close()


def test_sanitize_mode_catches_use_after_release(membackend_target):
    s = build_session(membackend_target, sanitize=True)
    try:
        r = s.reserve(kit_device(s), 1)
        s.release_reservation(r)
        with pytest.raises(SanitizerError, match="double release"):
            s.release_reservation(r)
    finally:
        s.close()


# --------------------------------------------------------------------------- property-based sequences

SEQUENCES = {"runs": 0, "steps": 0, "injected": 0, "typed_errors": 0, "oom": 0}


class VerbSequences(RuleBasedStateMachine):
    """Random verbs under random driver failures; the ledger must equal the platform after every step.

    Subclassed per target (``target``) and run by hypothesis's own runner.
    Which pages are resident is modelled from the verbs' results alone (a page
    is known resident after an ok fault, until a free of it is attempted), so
    no backend internals are read.
    """

    target: Target | None = None
    #: when a list, every sequence's :attr:`trail` is appended to it at teardown (the kit's own tests read it)
    journal: list[tuple[str, ...]] | None = None

    def __init__(self) -> None:
        super().__init__()
        assert self.target is not None, "VerbSequences is subclassed per target"
        self.session = build_session(self.target, sanitize=True)
        self.checker = checker_for(self.session)
        self.device = kit_device(self.session)
        probe = self.session.reserve(self.device, 1)
        self.ps = probe.page_size
        self.session.release_reservation(probe)
        self.live: list[Reservation] = []
        self.known: dict[int, set[int]] = {}  # reservation id -> pages known to be resident
        self.injector = None
        self.step = "start"
        self.steps = 0
        self.trail: list[str] = []  # every step with its outcome, for :attr:`journal`
        self.order: dict[int, int] = {}  # reservation id -> its place among this sequence's reservations
        SEQUENCES["runs"] += 1

    @initialize(p=st.sampled_from([0.0, 0.05, 0.2]), seed=st.integers(0, 2**16))
    def start_injecting(self, p, seed):
        self.trail.append(f"inject(probability={p}, seed={seed})")
        if p:
            self.injector = self.checker.start_injection(p, seed)

    def _note(self, what: str, outcome: str) -> None:
        """Add a step to :attr:`trail`, reservations named by their order in this sequence (ids are global)."""
        self.trail.append(re.sub(r"#(\d+)", lambda m: f"#{self.order.get(int(m.group(1)), '?')}", what)
                          + f" -> {outcome}")

    def _call(self, what: str, fn, *args):
        self.steps += 1
        self.step = f"step {self.steps}: {what}"
        SEQUENCES["steps"] += 1
        try:
            result = fn(*args)
        except (DriverError, AddressSpaceExhausted) as exc:  # an injected failure surfaces as a typed error (a
            # reserve's out of memory as AddressSpaceExhausted); state must stay consistent
            SEQUENCES["typed_errors"] += 1
            self._note(what, f"{type(exc).__name__}")
            return None
        if isinstance(result, Reservation):
            self.order[result.id] = len(self.order)
        # what the verb decided, never what the machine happens to have free (budgets differ run to run)
        self._note(what, f"ok={result.ok}" if isinstance(result, Fault) else
                   str(result) if isinstance(result, int) else "done")
        return result

    @rule(pages=st.integers(1, 6))
    def reserve(self, pages):
        if len(self.live) < 4:
            r = self._call(f"reserve({self.device}, {pages * self.ps})", self.session.reserve, self.device,
                           pages * self.ps)
            if r is not None:
                self.live.append(r)
                self.known[r.id] = set()

    def _draw_range(self, data) -> tuple[Reservation, int, int]:
        """A live reservation and a whole-page range inside it."""
        r = data.draw(st.sampled_from(self.live))
        first = data.draw(st.integers(0, r.pages - 1))
        count = data.draw(st.integers(1, r.pages - first))
        return r, first * self.ps, count * self.ps

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fault(self, data):
        r, offset, size = self._draw_range(data)
        f = self._call(f"fault(#{r.id}, {offset}, {size})", self.session.fault, r, offset, size)
        if f is not None and f.ok:
            self.known[r.id].update(r.page_range(offset, size))
        elif f is not None:
            SEQUENCES["oom"] += 1

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        r, offset, size = self._draw_range(data)
        self.known[r.id].difference_update(r.page_range(offset, size))
        self._call(f"free(#{r.id}, {offset}, {size})", self.session.free, r, offset, size)

    @precondition(lambda self: any(self.known[r.id] for r in self.live))
    @rule(data=st.data())
    def copy_then_maybe_free(self, data):
        r = data.draw(st.sampled_from([r for r in self.live if self.known[r.id]]))
        p = data.draw(st.sampled_from(sorted(self.known[r.id])))
        self.step = f"step {self.steps}: record(#{r.id}, copy into page {p})"
        try:
            token = async_work(self.session, r, p * self.ps, self.ps, seconds=0.0005)
        except DriverError as exc:  # the kit's own copy call can meet an injected failure too: no work started
            SEQUENCES["typed_errors"] += 1
            self._note(f"record(#{r.id}, copy into page {p})", type(exc).__name__)
            return
        self._note(f"record(#{r.id}, copy into page {p})", "started")
        self.session.record(r, token)
        if data.draw(st.booleans()):
            self.known[r.id].discard(p)
            self._call(f"free(#{r.id}, {p * self.ps}, {self.ps}) during a copy", self.session.free, r,
                       p * self.ps, self.ps)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release(self, data):
        r = data.draw(st.sampled_from(self.live))
        self._call(f"release_reservation(#{r.id})", self.session.release_reservation, r)
        if r.released:
            self.live.remove(r)
            self.known.pop(r.id)

    @rule()
    def fence_device(self):
        self._call(f"fence({self.device})", self.session.fence, self.device)

    @rule()
    def budget(self):
        self._call(f"budget_query({self.device})", self.session.budget_query, self.device)

    @invariant()
    def ledger_equals_driver(self):
        self.checker.verify(self.device, self.step)

    def teardown(self):
        if self.journal is not None:
            self.journal.append(tuple(self.trail))
        if self.injector is not None:
            self.injector.stop()
            SEQUENCES["injected"] += self.injector.injected
        try:
            self.session.close()
            self.checker.verify_nothing_left(self.device, f"close() after {self.step}")
        finally:
            for r in self.session.reservations():  # only reached when close() failed
                r.released = True


def run_verb_sequences(target: Target, examples: int, seed_value: int, machine: type[VerbSequences] = VerbSequences,
                       steps: int = 25) -> None:
    """Run ``examples`` sequences of up to ``steps`` verbs of ``machine`` on ``target``, drawn from ``seed_value``:
    the same arguments draw the same sequences (no example database is read or written)."""
    bound = type(f"{machine.__name__}[{target}]", (machine,), {"target": target})
    run_state_machine_as_test(hypothesis_seed(seed_value)(bound), settings=settings(
        max_examples=examples, stateful_step_count=steps, deadline=None, database=None,
        # no "explain" phase: it reruns a failure hundreds of times to annotate lines, each on a fresh session
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
        suppress_health_check=list(HealthCheck)))


@pytest.mark.kit_long
def test_random_verb_sequences_keep_the_ledger_equal_to_the_driver(membackend_target, membackend_examples,
                                                                   membackend_seed, request):
    try:
        run_verb_sequences(membackend_target, membackend_examples, membackend_seed)
    except Exception as failure:
        command = rerun_command(request.node, membackend_seed)
        request.config.stash[RERUNS_KEY].append(command)
        failure.add_note(f"membackend kit: seed {membackend_seed}; run this sequence again: {command}")
        raise


#: every rule above: ``from membackend.testing.conformance import *`` collects them all
__all__ = sorted(name for name in list(globals()) if name.startswith("test_"))
