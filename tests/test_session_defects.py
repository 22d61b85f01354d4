"""Session and ledger defects found under stress (issue 7, section 4): each test failed before its fix."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from membackend import hookimpl
from membackend._backends.host import HostBackend
from membackend._drivers.host import host_driver, is_mapped, resident_bytes
from membackend._fences import FutureToken
from membackend._ledger import Ledger
from membackend._machine import gather_machine
from membackend._session import MAX_RESERVATION, Session
from membackend._settings import load_settings
from membackend.types import (
    Device,
    DriverError,
    ForeignReservation,
    InvalidSize,
    InvalidToken,
    OutOfRange,
    PluginError,
    Reservation,
    ReservationReleased,
    SanitizerError,
    WrongDevice,
)

MiB = 1 << 20
PAGE = 2 * MiB
CPU = Device("cpu", 0)


def host_session(backend: HostBackend | None = None, sanitize: bool = False) -> Session:
    return Session(backend or HostBackend(page_size=PAGE), machine=gather_machine(), ledger=Ledger(sanitize=sanitize))


class CountingDriver:
    """The real host driver, counting reserves and releases, to prove nothing stays reserved."""

    def __init__(self):
        self.inner = host_driver()
        self.populate_method = self.inner.populate_method
        self.reserved: set[int] = set()

    def reserve(self, size, align):
        base = self.inner.reserve(size, align)
        self.reserved.add(base)
        return base

    def release(self, addr, size):
        self.inner.release(addr, size)
        self.reserved.discard(addr)

    def __getattr__(self, name):
        return getattr(self.inner, name)


# --------------------------------------------------------------------------- 4.2: atomic ledger updates


class _PopHook(dict):
    """A dict that runs ``hook`` when popped: the exact point where the old release path was preempted."""

    def __init__(self, data, hook):
        super().__init__(data)
        self.hook = hook

    def pop(self, *args):
        self.hook()
        return super().pop(*args)


def test_a_release_does_not_lose_a_concurrent_update_of_another_reservation():
    ledger = Ledger()
    a = Reservation(CPU, 0x10000, 4 * MiB, PAGE, "host")
    b = Reservation(CPU, 0x90000, 4 * MiB, PAGE, "host")
    for r in (a, b):
        ledger.on_reserve(r)
    ledger.on_fault(a, 2 * MiB)
    other_done = threading.Event()

    def fault_b():
        ledger.on_fault(b, 4 * MiB)
        other_done.set()

    threads = []

    def preempted():  # another thread updates the same device while the release is half-way
        t = threading.Thread(target=fault_b)
        threads.append(t)
        t.start()
        other_done.wait(timeout=1)  # with the fix the other thread waits for the ledger instead

    ledger._resident = _PopHook(ledger._resident, preempted)
    ledger.on_release(a)
    for t in threads:
        t.join()
    acct = ledger.account(CPU)
    assert (acct.resident, acct.reserved, acct.reservations_alive) == (4 * MiB, 4 * MiB, 1), acct


# --------------------------------------------------------------------------- 4.3: record racing release


class RacingToken:
    """Looking up ``done`` lets another thread release the reservation first: the record/release
    race of a copy thread and a server thread, made deterministic."""

    def __init__(self, session: Session, r: Reservation):
        self.session, self.r, self.raced, self.waited = session, r, False, 0
        self.released = threading.Event()
        self.thread: threading.Thread | None = None

    @property
    def done(self):
        if not self.raced:
            self.raced = True
            self.thread = threading.Thread(target=self._release)
            self.thread.start()
            self.released.wait(timeout=1)
        return lambda: True

    def _release(self):
        self.session.release_reservation(self.r)
        self.released.set()

    def wait(self):
        self.waited += 1


def test_record_racing_release_leaves_no_stale_token():
    s = host_session()
    r = s.reserve(CPU, 4 * MiB)
    s.fault(r, 0, 4 * MiB)
    token = RacingToken(s, r)
    try:
        s.record(r, token)
    except ReservationReleased:
        recorded = False
    else:
        recorded = True
    token.thread.join()
    assert r.released
    acct = s.ledger.account(CPU)
    assert (acct.pending_fences, acct.reservations_alive, acct.reserved) == (0, 0, 0), acct
    assert s.ledger.pending(r) == [] and r.id not in s.ledger.pending_ids
    if recorded:  # it won the race: then the release fenced it
        assert token.waited == 1


def test_the_ledger_refuses_a_token_for_a_released_reservation():
    ledger = Ledger()
    r = Reservation(CPU, 0x10000, PAGE, PAGE, "host")
    ledger.on_reserve(r)
    ledger.on_release(r)
    with pytest.raises(ReservationReleased, match="not alive"):
        ledger.record(r, FutureToken(Future()))
    assert ledger.account(CPU).pending_fences == 0 and ledger.pending(r) == []


# --------------------------------------------------------------------------- 4.4: foreign reservations


@pytest.mark.parametrize("verb", ["fault", "free", "release_reservation", "record", "fence"])
def test_a_reservation_of_another_session_of_the_same_backend_is_refused(verb):
    backend = HostBackend(page_size=PAGE)
    mine, theirs = host_session(backend), host_session(backend)
    r = theirs.reserve(CPU, 8 * MiB)
    theirs.fault(r, 0, 4 * MiB)
    before = mine.ledger.account(CPU), theirs.ledger.account(CPU), resident_bytes(r.base, r.size)
    args = {"fault": (r, 4 * MiB, 4 * MiB), "free": (r,), "release_reservation": (r,),
            "record": (r, FutureToken(Future())), "fence": (None, r)}[verb]
    with pytest.raises(ForeignReservation, match=f"#{r.id} .*another session of backend 'host'"):
        getattr(mine, verb)(*args)
    assert (mine.ledger.account(CPU), theirs.ledger.account(CPU), resident_bytes(r.base, r.size)) == before
    assert not r.released and is_mapped(r.base)
    assert theirs.free(r) == 4 * MiB  # the owner still uses it normally
    theirs.close()
    mine.close()


# --------------------------------------------------------------------------- 4.5: reserve is exception-safe


@pytest.mark.parametrize("size", [MAX_RESERVATION + 1, 2**63, 2**64, 2**64 + PAGE])
def test_a_size_no_address_space_holds_is_refused_before_the_backend_sees_it(size):
    driver = CountingDriver()
    s = host_session(HostBackend(page_size=PAGE, driver=driver))
    with pytest.raises(InvalidSize, match=f"size {size} is more than any address space holds; accepted: 1 to "
                                          f"{MAX_RESERVATION} bytes"):
        s.reserve(CPU, size)
    assert driver.reserved == set() and s.ledger.alive() == 0 and s.reservations() == []


def test_a_huge_size_on_a_simulated_gpu_reserves_nothing():
    from membackend._manager import BackendManager

    s = BackendManager(load_settings(backend="vmm", sim_profile="h200")).session()
    with pytest.raises(InvalidSize):
        s.reserve("cuda:0", 2**64 + PAGE)
    assert s.ledger.alive() == 0
    assert s.backend.driver.sim.state()["reservations"] == 0


def test_a_reservation_that_breaks_the_contract_is_given_back():
    class Liar(HostBackend):
        @hookimpl
        def membackend_reserve(self, device, size):
            r = super().membackend_reserve(device, size)
            r.size //= 2  # smaller than asked for
            return r

        @hookimpl
        def membackend_release_reservation(self, reservation):
            reservation.size *= 2  # what the driver really holds
            return super().membackend_release_reservation(reservation)

    driver = CountingDriver()
    s = host_session(Liar(page_size=PAGE, driver=driver))
    with pytest.raises(PluginError, match="broke the contract"):
        s.reserve(CPU, 8 * MiB)
    assert driver.reserved == set() and s.ledger.alive() == 0 and s.reservations() == []


def test_a_failure_after_the_backend_reserved_gives_the_range_back(monkeypatch):
    driver = CountingDriver()
    s = host_session(HostBackend(page_size=PAGE, driver=driver))

    def broken(r):
        raise MemoryError("ledger cannot grow")

    monkeypatch.setattr(s.ledger, "on_reserve", broken)
    with pytest.raises(MemoryError):
        s.reserve(CPU, 8 * MiB)
    assert driver.reserved == set() and s.reservations() == []
    assert s.ledger.account(CPU).reserved == 0


# --------------------------------------------------------------------------- 4.6: G2 with a failing token


class Token:
    """A token whose done()/wait() can be told to fail or to stay unfinished."""

    def __init__(self, name, wait_raises=False, done_raises=False, finishes=True):
        self.name, self.wait_raises, self.done_raises, self.finishes = name, wait_raises, done_raises, finishes
        self.finished, self.waits = False, 0

    def done(self):
        if self.done_raises:
            raise RuntimeError(f"{self.name}: query failed")
        return self.finished

    def wait(self):
        self.waits += 1
        if self.wait_raises:
            raise RuntimeError(f"{self.name}: wait failed")
        self.finished = self.finishes

    def __repr__(self):
        return self.name


@pytest.mark.parametrize("sanitize", [False, True])
def test_a_failing_token_keeps_every_unfinished_token_and_the_next_free_fences_again(sanitize):
    s = host_session(sanitize=sanitize)
    r = s.reserve(CPU, 4 * MiB)
    s.fault(r, 0, 4 * MiB)
    failing = Token("failing", wait_raises=True, done_raises=True)  # failed for good: reported once
    stuck = Token("stuck", wait_raises=True)  # its copy is still running
    fine = Token("fine")
    for t in (failing, stuck, fine):
        s.record(r, t)
    with pytest.raises(DriverError, match="2 of 3 token"):
        s.free(r)
    assert s.ledger.pending(r) == [stuck] and s.ledger.account(CPU).pending_fences == 1
    assert s.ledger.resident(r) == 4 * MiB and resident_bytes(r.base, r.size) == 4 * MiB
    with pytest.raises(DriverError, match="1 of 1 token"):
        s.free(r)  # fences the running one again, still refuses to free
    assert (failing.waits, stuck.waits, fine.waits) == (1, 2, 1)
    assert resident_bytes(r.base, r.size) == 4 * MiB
    stuck.wait_raises = False
    assert s.free(r) == 4 * MiB
    assert s.ledger.account(CPU).pending_fences == 0
    s.close()


def test_a_failed_copy_is_reported_once_and_then_counts_as_finished():
    s = host_session()
    r = s.reserve(CPU, 2 * MiB)
    s.fault(r, 0, 2 * MiB)
    future: Future = Future()
    future.set_exception(OSError("copy failed"))
    s.record(r, FutureToken(future))
    with pytest.raises(DriverError, match="copy failed"):
        s.free(r)
    assert s.ledger.pending(r) == []  # done: nothing runs on the range any more
    assert s.free(r) == 2 * MiB
    s.close()


def test_a_device_fence_keeps_failed_tokens_of_every_reservation():
    s = host_session()
    a, b = s.reserve(CPU, 2 * MiB), s.reserve(CPU, 2 * MiB)
    ta, tb = Token("a", wait_raises=True), Token("b", wait_raises=True)
    s.record(a, ta)
    s.record(b, tb)
    with pytest.raises(DriverError):
        s.fence(CPU)
    assert (ta.waits, tb.waits) == (1, 1)  # the second was waited for although the first failed
    assert s.ledger.pending(a) == [ta] and s.ledger.pending(b) == [tb]
    ta.wait_raises = tb.wait_raises = False
    s.fence(CPU)
    assert s.ledger.account(CPU).pending_fences == 0
    s.close()


def test_sanitize_counts_a_token_whose_done_raises_as_unfinished():
    ledger = Ledger(sanitize=True)
    r = Reservation(CPU, 0x10000, PAGE, PAGE, "host")
    ledger.on_reserve(r)
    ledger.record(r, Token("broken", done_raises=True))
    with pytest.raises(SanitizerError, match="1 recorded asynchronous operation"):
        ledger.check_quiet(r, "free")


# --------------------------------------------------------------------------- 4.13: typed, precise input errors


@pytest.fixture
def session_and_reservation():
    s = host_session()
    r = s.reserve(CPU, 8 * MiB)
    s.fault(r, 0, 2 * MiB)
    yield s, r
    s.close()


@pytest.mark.parametrize("call,error,match", [
    (lambda s, r: s.free(r, None), InvalidSize, r"offset must be an integer number of bytes, got None \(NoneType\); "
                                                r"accepted: an int from 0 to 8388607"),
    (lambda s, r: s.free(r, "0"), InvalidSize, r"offset .* got '0' \(str\); accepted"),
    (lambda s, r: s.free(r, 0, "2097152"), InvalidSize, r"size .* got '2097152' \(str\); accepted: an int from 1"),
    (lambda s, r: s.free(r, True), InvalidSize, r"offset .* got True \(bool\)"),
    (lambda s, r: s.free(r, 0, True), InvalidSize, r"size .* got True \(bool\)"),
    (lambda s, r: s.fault(r, True, 1), InvalidSize, r"offset .* got True \(bool\)"),
    (lambda s, r: s.fault(r, 0, True), InvalidSize, r"size .* got True \(bool\)"),
    (lambda s, r: s.fault(r, None, 1), InvalidSize, r"offset .* got None"),
    (lambda s, r: s.reserve(CPU, True), InvalidSize, r"size .* got True \(bool\); accepted: 1 to"),
    (lambda s, r: s.record(r, None), InvalidToken, r"needs done\(\) and wait\(\); got NoneType None; accepted"),
    (lambda s, r: s.fence("cpu:7"), WrongDevice, r"cpu:7 is not a device of this machine; accepted: cpu:0"),
    (lambda s, r: s.budget_query("cpu:1"), WrongDevice, r"cpu:1 is not a device of this machine"),
    (lambda s, r: s.free(r, 2**64), OutOfRange, r"offset 18446744073709551616 is outside reservation .* "
                                                r"accepted: 0 <= offset < 8388608"),
    (lambda s, r: s.free(r, 8 * MiB), OutOfRange, r"offset 8388608 is outside"),
    (lambda s, r: s.free(r, -PAGE), OutOfRange, r"offset -2097152 is outside"),
])
def test_bad_inputs_are_typed_and_say_what_is_accepted(session_and_reservation, call, error, match):
    s, r = session_and_reservation
    before = s.ledger.account(CPU), s.ledger.resident(r), resident_bytes(r.base, r.size)
    with pytest.raises(error, match=match):
        call(s, r)
    assert (s.ledger.account(CPU), s.ledger.resident(r), resident_bytes(r.base, r.size)) == before
