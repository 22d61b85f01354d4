"""One session shared by threads (issue 7, section 3): the threading contract and a stress test.

The stress test runs ``THREADS`` threads of ``VERBS_PER_THREAD`` random verbs each on one
session, valid and invalid (bad sizes and ranges, released and foreign reservations, shared
and private reservations, copies recorded as fence tokens), on ``host`` and on every
simulated profile. Only typed membackend errors may escape a verb; afterwards the ledger
equals what the driver (or the kernel) holds, nothing crashed, and ``close()`` leaves nothing.
Run with ``-s`` to see the figures.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from concurrent.futures import Future

import pytest

from membackend import hookimpl
from membackend._backends.host import HostBackend
from membackend._drivers.host import is_mapped, resident_bytes
from membackend._fences import FutureToken
from membackend._machine import gather_machine
from membackend._manager import BackendManager
from membackend._session import Session
from membackend._settings import load_settings
from membackend.types import Device, DriverError, MembackendError, ReservationReleased

MiB = 1 << 20
PAGE = 2 * MiB
SOURCE = bytearray(PAGE)  # host bytes the tests copy from (a real driver refuses a NULL source)
CPU = Device("cpu", 0)

THREADS = 8
VERBS_PER_THREAD = 10_000
TARGETS = ["host", "wddm-6gb", "rocm-win-2gpu", "gb10-128gb", "h200"]
HOST_CAPACITY = 512 * MiB  # the most the host run keeps resident
SHARED = 4  # reservations every thread uses
PRIVATE = 3  # reservations each thread keeps to itself, at most


# --------------------------------------------------------------------------- the contract, one rule at a time


class Gate(HostBackend):
    """A host backend whose fault on reservation ``held`` waits until the test opens the gate."""

    def __init__(self):
        super().__init__(page_size=PAGE)
        self.held: int | None = None
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.inside: Counter = Counter()
        self.most_inside = 0
        self.lock = threading.Lock()

    @hookimpl
    def membackend_fault(self, reservation, offset, size):
        with self.lock:
            self.inside[reservation.id] += 1
            self.most_inside = max(self.most_inside, self.inside[reservation.id])
        try:
            if reservation.id == self.held:
                self.entered.set()
                assert self.gate.wait(timeout=30), "the gate was never opened"
            return super().membackend_fault(reservation, offset, size)
        finally:
            with self.lock:
                self.inside[reservation.id] -= 1


def test_different_reservations_proceed_while_one_is_busy():
    backend = Gate()
    s = Session(backend, machine=gather_machine())
    a, b = s.reserve(CPU, PAGE), s.reserve(CPU, PAGE)
    backend.held = a.id
    t = threading.Thread(target=s.fault, args=(a, 0, PAGE))
    t.start()
    assert backend.entered.wait(timeout=30)
    assert s.fault(b, 0, PAGE).ok  # not blocked by the fault on `a` in progress
    s.record(b, FutureToken(_done_future()))
    assert s.free(b) == PAGE
    backend.gate.set()
    t.join()
    assert s.ledger.resident(a) == PAGE
    s.close()


def test_verbs_on_one_reservation_are_serialised():
    backend = Gate()
    s = Session(backend, machine=gather_machine())
    r = s.reserve(CPU, 8 * PAGE)
    barrier = threading.Barrier(4)

    def churn(seed):
        rng = random.Random(seed)
        barrier.wait()
        for _ in range(300):
            page = rng.randrange(8) * PAGE
            s.fault(r, page, PAGE) if rng.random() < 0.6 else s.free(r, page, PAGE)

    threads = [threading.Thread(target=churn, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert backend.most_inside == 1
    assert s.ledger.resident(r) == resident_bytes(r.base, r.size)
    s.close()


def test_record_after_a_concurrent_release_is_refused_and_keeps_nothing():
    s = Session(HostBackend(page_size=PAGE), machine=gather_machine())
    r = s.reserve(CPU, PAGE)
    started, finish = threading.Event(), threading.Event()
    copy: Future = Future()

    class SlowToken(FutureToken):
        def wait(self):
            started.set()
            finish.wait(timeout=30)
            super().wait()

    s.record(r, SlowToken(copy))
    releaser = threading.Thread(target=s.release_reservation, args=(r,))
    releaser.start()
    assert started.wait(timeout=30)  # the release is fencing the first copy now
    outcome: list = []
    recorder = threading.Thread(target=lambda: _try(outcome, s.record, r, FutureToken(Future())))
    recorder.start()
    copy.set_result(None)
    finish.set()
    releaser.join()
    recorder.join()
    assert isinstance(outcome[0], ReservationReleased)
    assert s.ledger.account(CPU).pending_fences == 0 and s.ledger.pending(r) == []


def _try(out: list, fn, *args):
    try:
        out.append(fn(*args))
    except Exception as exc:
        out.append(exc)


def _done_future() -> Future:
    f: Future = Future()
    f.set_result(None)
    return f


# --------------------------------------------------------------------------- the stress test


class Target:
    """One session under test, a second session of the same backend (its reservations are foreign),
    and the driver's or the kernel's view to compare the ledger with."""

    def __init__(self, name: str):
        self.name = name
        if name == "host":
            settings = load_settings(backend="host", host_capacity=HOST_CAPACITY, page_size=PAGE)
        else:
            settings = load_settings(backend="vmm", sim_profile=name)
        manager = BackendManager(settings)
        self.session = manager.session()
        self.other = manager.session()
        assert self.session.backend is self.other.backend
        self.devices = self.session.devices() if name == "host" else [
            Device(self.session.device_kinds[0], i) for i in range(len(self._sim().devices))]
        self.max_size = 24 * MiB if name == "host" else 256 * MiB

    # -- the simulated driver, when there is one
    def _driver(self):
        return getattr(self.session.backend, "driver", None) or getattr(self.session.backend, "_driver", None)

    def _sim(self):
        return getattr(self._driver(), "sim", None)

    def driver_view(self, device: Device) -> tuple[int, int]:
        """(reserved, resident) bytes as the driver or the kernel counts them, both sessions together."""
        state = self.session.inspect(device)
        if state is not None:
            return state.reserved, state.resident
        if self.name == "host":
            live = self.session.reservations() + self.other.reservations()
            assert all(is_mapped(r.base) for r in live)
            return sum(r.size for r in live), sum(resident_bytes(r.base, r.size) for r in live)
        st = self._sim().state(device.index)
        return st["reserved"], st["mapped"]

    def copy_token(self, r, streams: dict):
        """Start a copy into ``r``'s first page and return its fence token (None on host)."""
        if self.name == "host":
            return None
        driver, index = self._driver(), r.device.index
        stream = streams.get(index)
        if stream is None:
            driver.set_device(index)
            stream = streams[index] = driver.stream_create()
        driver.set_device(index)
        driver.memcpy_htod_async(r.base, SOURCE, PAGE, stream)
        return self.session.backend.fence_token(r, stream)


def _worker(t: Target, seed: int, shared: list, shared_lock: threading.Lock, foreign: list, errors: Counter,
            untyped: list, counts: Counter, executor_futures: list) -> None:
    rng = random.Random(seed)
    s = t.session
    private: list = []
    released: list = []
    streams: dict = {}
    bad_sizes = [0, -1, -PAGE, 2**64, 2**63 + 1, "1", None, True, 1.5]

    def pick_shared():
        return shared[rng.randrange(len(shared))]

    def any_reservation():
        roll = rng.random()
        if roll < 0.45 or not private:
            return pick_shared()
        if roll < 0.85:
            return rng.choice(private)
        if roll < 0.93 and released:
            return rng.choice(released)
        return rng.choice(foreign)

    def a_range(r):
        roll = rng.random()
        if roll < 0.85:
            first = rng.randrange(r.pages)
            last = rng.randrange(first, min(r.pages, first + 4)) + 1
            return first * r.page_size, (last - first) * r.page_size
        if roll < 0.95:
            return rng.choice([(-1, PAGE), (0, r.size + 1), (r.size, 1), (0, 0), (1, PAGE), (2**64, PAGE)])
        return rng.choice(bad_sizes), rng.choice(bad_sizes)

    def device():
        if rng.random() < 0.95:
            return rng.choice(t.devices)
        return rng.choice(["cpu:7", "cuda:9", "hip:5", "tpu:0", None, 3])

    for _ in range(VERBS_PER_THREAD):
        verb = rng.choices(["reserve", "fault", "free", "release", "record", "copy", "fence", "budget"],
                           [8, 35, 25, 6, 8, 6, 7, 5])[0]
        counts[verb] += 1
        try:
            if verb == "reserve":
                size = rng.randrange(1, t.max_size) if rng.random() < 0.9 else rng.choice(bad_sizes)
                r = s.reserve(device(), size)
                if rng.random() < 0.3:  # replace a shared one, releasing the old one
                    with shared_lock:
                        i = rng.randrange(len(shared))
                        old, shared[i] = shared[i], r
                    s.release_reservation(old)
                elif len(private) < PRIVATE:
                    private.append(r)
                else:
                    s.release_reservation(r)
                    released.append(r)
            elif verb == "fault":
                r = any_reservation()
                s.fault(r, *a_range(r))
            elif verb == "free":
                r = any_reservation()
                if rng.random() < 0.2:
                    s.free(r)
                else:
                    s.free(r, *a_range(r))
            elif verb == "release":
                roll = rng.random()
                if private and roll < 0.6:
                    r = private.pop(rng.randrange(len(private)))
                    released.append(r)
                elif roll < 0.9:  # unload a shared one: its slot gets a new reservation first
                    fresh = s.reserve(rng.choice(t.devices), rng.randrange(1, t.max_size))
                    with shared_lock:
                        i = rng.randrange(len(shared))
                        r, shared[i] = shared[i], fresh
                else:
                    r = any_reservation()
                s.release_reservation(r)
            elif verb == "record":
                r = any_reservation()
                future: Future = Future()
                executor_futures.append(future)  # a copy thread finishes it later
                token = FutureToken(future) if rng.random() < 0.95 else rng.choice([None, object(), "token"])
                s.record(r, token)
            elif verb == "copy":  # a copy into a private reservation, recorded as an event token (G2)
                if not private:
                    continue
                r = rng.choice(private)
                if not s.fault(r, 0, PAGE).ok:
                    continue
                token = t.copy_token(r, streams)
                if token is not None:
                    s.record(r, token)
            elif verb == "fence":
                if rng.random() < 0.5:
                    s.fence(device())
                else:
                    r = any_reservation()
                    s.fence(None, r)
            else:
                s.budget_query(device())
        except MembackendError as exc:
            errors[type(exc).__name__] += 1
        except Exception as exc:  # anything untyped fails the test
            untyped.append((verb, repr(exc)))
    for r in private:
        try:
            s.release_reservation(r)
        except MembackendError as exc:
            errors[type(exc).__name__] += 1


def _copy_thread(futures: list, stop: threading.Event) -> None:
    """Completes recorded host 'copies' in the background, as a copy thread's pool would."""
    rng = random.Random(7)
    while not stop.is_set() or futures:
        try:
            f = futures.pop(0)
        except IndexError:
            stop.wait(0.001)
            continue
        if rng.random() < 0.02:
            f.set_exception(OSError("copy failed"))  # a failed copy: reported once by the next fence
        else:
            f.set_result(None)


@pytest.mark.long  # thousands of verbs from many threads for seconds on every target (CI runs it)
@pytest.mark.parametrize("target", TARGETS)
def test_one_session_shared_by_threads_stays_consistent(target):
    t = Target(target)
    s = t.session
    shared = [s.reserve(t.devices[i % len(t.devices)], (i + 1) * 4 * MiB) for i in range(SHARED)]
    foreign = [t.other.reserve(t.devices[0], 4 * MiB) for _ in range(2)]
    t.other.fault(foreign[0], 0, PAGE)
    errors: Counter = Counter()
    counts: Counter = Counter()
    untyped: list = []
    futures: list = []
    stop = threading.Event()
    copier = threading.Thread(target=_copy_thread, args=(futures, stop))
    copier.start()
    started = time.perf_counter()
    shared_lock = threading.Lock()  # guards the list of shared slots, not the session
    workers = [threading.Thread(target=_worker, args=(t, 1000 * i + 17, shared, shared_lock, foreign, errors,
                                                      untyped, counts, futures)) for i in range(THREADS)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    stop.set()
    copier.join()
    seconds = time.perf_counter() - started
    print(f"\n{target}: {sum(counts.values())} verbs by {THREADS} threads in {seconds:.1f} s; "
          f"typed errors: {dict(sorted(errors.items()))}; verbs: {dict(sorted(counts.items()))}")

    assert untyped == [], untyped[:5]
    assert sum(counts.values()) == THREADS * VERBS_PER_THREAD
    for dev in t.devices:  # the ledgers of both sessions together equal the driver's (kernel's) view
        mine, theirs = s.ledger.account(dev), t.other.ledger.account(dev)
        assert t.driver_view(dev) == (mine.reserved + theirs.reserved, mine.resident + theirs.resident), dev
    for r in s.reservations():
        assert s.ledger.resident(r) <= r.size
    sim = t._sim()
    if sim is not None:
        assert (sim.bugchecks, sim.crashes, sim.use_after_free) == (0, 0, 0)

    late_failures = 0
    for r in s.reservations():  # a copy that failed after the last fence on its range: reported once, here
        try:
            s.fence(None, r)
        except DriverError as exc:
            assert "copy failed" in str(exc), exc
            late_failures += 1
    s.close()
    t.other.close()
    print(f"copies that failed after the last fence on their range: {late_failures}")
    for ledger in (s.ledger, t.other.ledger):
        for dev in ledger.devices():
            a = ledger.account(dev)
            assert (a.reserved, a.resident, a.reservations_alive, a.pending_fences) == (0, 0, 0, 0), (dev, a)
    assert s.reservations() == [] and t.other.reservations() == []
    if sim is not None:
        st = sim.state()
        assert (st["reservations"], st["mapped"], st["handles"]) == (0, 0, 0), st
