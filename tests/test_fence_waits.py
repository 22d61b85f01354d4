"""Fences that wait (G2) and copies that die (G6).

* A fence returns only after everything recorded before it started has finished, including the
  tokens another thread's ``free`` (or ``release_reservation``) is waiting for at that moment: a
  waiter keeps its tokens visible to fences until their wait has completed.
* A copy whose own thread stopped with ``KeyboardInterrupt`` or ``SystemExit`` (a
  ``concurrent.futures.Future`` holding one) reaches the caller of ``free``, ``fence`` and
  ``release_reservation`` as a typed ``DriverError``, reported once; a ``KeyboardInterrupt`` of the
  caller's own thread while it waits still propagates, and the tokens stay recorded.

No test here depends on timing: threads meet on events, and every bounded wait is a safety net
(30 s) that a correct run never reaches. The one short ``join(timeout=...)`` only lets a fence that
does not wait return; the assertions hold whatever the scheduling.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from membackend._backends.host import HostBackend
from membackend._fences import FutureToken
from membackend._ledger import Ledger
from membackend._machine import gather_machine
from membackend._session import FENCE_WAIT, Session
from membackend.types import Device, DriverError

MiB = 1 << 20
PAGE = 2 * MiB
CPU = Device("cpu", 0)
SAFETY = 30  # seconds; only a hung run waits this long


def make_session(sanitize: bool = False) -> Session:
    return Session(HostBackend(page_size=PAGE), machine=gather_machine(), ledger=Ledger(sanitize=sanitize))


def outcome(fn, *args):
    """What ``fn(*args)`` raised (any BaseException, so a leaked KeyboardInterrupt fails the test instead
    of stopping the run), or None."""
    try:
        fn(*args)
    except BaseException as exc:  # noqa: BLE001 -- the point is to see exactly what escapes
        return exc
    return None


class SlowCopy:
    """A fence token over a copy the test finishes: ``entered`` is set once a thread waits for it."""

    def __init__(self):
        self.entered = threading.Event()
        self.finish = threading.Event()

    def done(self) -> bool:
        return self.finish.is_set()

    def wait(self) -> None:
        self.entered.set()
        assert self.finish.wait(SAFETY), "the copy was never finished"

    def __repr__(self) -> str:
        return f"SlowCopy(done={self.done()})"


class Fencer(threading.Thread):
    """Runs one fence and notes whether the copy had finished when the fence returned."""

    def __init__(self, session: Session, copy: SlowCopy, *args):
        super().__init__(daemon=True)
        self.session, self.copy, self.args = session, copy, args
        self.copy_done_at_return: bool | None = None
        self.error: BaseException | None = None

    def run(self):
        self.error = outcome(self.session.fence, *self.args)
        self.copy_done_at_return = self.copy.done()


# --------------------------------------------------------------------------- fences that wait (G2)


@pytest.mark.parametrize("waiter", ["free", "release_reservation", "fence"])
def test_a_fence_waits_for_a_copy_another_thread_is_waiting_for(waiter):
    """The other thread took the copy's token and waits for it; fences started meanwhile return only
    after the copy finished (before the fix the device-wide fence saw nothing pending and returned)."""
    s = make_session()
    r = s.reserve(CPU, 2 * PAGE)
    other = s.reserve(CPU, PAGE)  # another reservation on the device, nothing recorded
    assert s.fault(r, 0, 2 * PAGE).ok
    copy = SlowCopy()
    s.record(r, copy)
    call = {"free": (s.free, r), "release_reservation": (s.release_reservation, r), "fence": (s.fence, None, r)}
    fn, *args = call[waiter]
    first = threading.Thread(target=fn, args=args, daemon=True)
    first.start()
    assert copy.entered.wait(SAFETY)  # the first thread is inside the token's wait()
    fencers = [Fencer(s, copy, CPU), Fencer(s, copy, CPU, r), Fencer(s, copy, None, r)]
    for f in fencers:
        f.start()
    for f in fencers:
        f.join(timeout=0.2)  # a fence that does not wait returns here; one that waits is still blocked
    blocked = [f.is_alive() for f in fencers]
    copy.finish.set()
    first.join(SAFETY)
    for f in fencers:
        f.join(SAFETY)
    assert not first.is_alive() and not any(f.is_alive() for f in fencers)
    # what each fence saw when it returned: the copy must have finished by then (G2)
    assert [f.copy_done_at_return for f in fencers] == [True, True, True], blocked
    assert blocked == [True, True, True]
    for f in fencers:  # a fence on a reservation the release took away may be refused, typed
        assert f.error is None or (waiter == "release_reservation" and f.args[-1] is r), f.error
    assert s.ledger.account(CPU).pending_fences == 0
    assert s.fault(other, 0, PAGE).ok  # the session carries on
    s.close()


def test_a_device_fence_does_not_return_while_a_free_waits_on_another_reservation():
    """Two reservations on the device, each with a copy a free waits for: the device fence waits for both."""
    s = make_session()
    a, b = s.reserve(CPU, PAGE), s.reserve(CPU, PAGE)
    copies = {a: SlowCopy(), b: SlowCopy()}
    frees = []
    for r, copy in copies.items():
        assert s.fault(r, 0, PAGE).ok
        s.record(r, copy)
        t = threading.Thread(target=s.free, args=(r,), daemon=True)
        t.start()
        assert copy.entered.wait(SAFETY)
        frees.append(t)
    fencer = Fencer(s, copies[b], CPU)
    fencer.start()
    copies[a].finish.set()
    frees[0].join(SAFETY)
    fencer.join(timeout=0.2)
    assert fencer.is_alive()  # still waiting for b's copy
    copies[b].finish.set()
    fencer.join(SAFETY)
    frees[1].join(SAFETY)
    assert fencer.error is None and fencer.copy_done_at_return is True
    assert s.ledger.resident(a) == s.ledger.resident(b) == 0
    s.close()


class FlakyCopy(SlowCopy):
    """A copy whose first wait fails while it still runs (a transient error): the fence keeps it. While
    ``hold`` is set, ``done()`` -- which that fence asks while it puts the token back -- blocks until the
    test lets it go, so the test can run a device fence right then."""

    def __init__(self):
        super().__init__()
        self.waits = 0
        self.hold = True
        self.asked = threading.Event()
        self.answer = threading.Event()

    def done(self) -> bool:
        if self.hold:
            self.asked.set()
            assert self.answer.wait(SAFETY), "done() was never let go"
        return super().done()

    def wait(self) -> None:
        self.waits += 1
        if self.waits == 1:
            raise RuntimeError("transient: the copy is still running")
        super().wait()


def test_a_device_fence_waits_for_a_copy_a_failed_fence_is_putting_back():
    """The failed free takes its tokens off and puts the running one back; a device fence in between
    waits for that one too instead of finding nothing recorded."""
    s = make_session()
    r = s.reserve(CPU, PAGE)
    assert s.fault(r, 0, PAGE).ok
    copy = FlakyCopy()
    s.record(r, copy)
    freed: list = []
    first = threading.Thread(target=lambda: freed.append(outcome(s.free, r)), daemon=True)
    first.start()
    assert copy.asked.wait(SAFETY)  # the free failed and is deciding what to keep
    fencer = Fencer(s, copy, CPU)
    fencer.start()
    fencer.join(timeout=0.2)
    blocked_while_moving = fencer.is_alive()
    copy.hold = False
    copy.answer.set()
    first.join(SAFETY)
    assert type(freed[0]) is DriverError and "1 still running kept" in str(freed[0]), freed
    fencer.join(timeout=0.2)
    blocked_while_running = fencer.is_alive()
    copy.finish.set()
    fencer.join(SAFETY)
    assert not fencer.is_alive() and fencer.error is None, fencer.error
    assert fencer.copy_done_at_return is True
    assert (blocked_while_moving, blocked_while_running) == (True, True)
    assert copy.waits == 2 and s.free(r) == PAGE
    s.close()


# --------------------------------------------------------------------------- copies that die (G6)


def died(kind: type[BaseException]) -> Future:
    future: Future = Future()
    future.set_exception(kind("the copy thread was stopped"))
    return future


@pytest.mark.parametrize("verb", ["free", "fence_device", "fence_reservation", "release_reservation"])
@pytest.mark.parametrize("kind", [KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize("wrap", ["future", "FutureToken"])
def test_a_copy_that_died_is_a_driver_error_reported_once(kind, verb, wrap):
    s = make_session()
    r = s.reserve(CPU, PAGE)
    assert s.fault(r, 0, PAGE).ok
    future = died(kind)
    s.record(r, future if wrap == "future" else FutureToken(future))
    call = {"free": lambda: s.free(r), "fence_device": lambda: s.fence(CPU),
            "fence_reservation": lambda: s.fence(CPU, r), "release_reservation": lambda: s.release_reservation(r)}
    exc = outcome(call[verb])
    assert type(exc) is DriverError, exc  # not the KeyboardInterrupt / SystemExit itself
    assert exc.call == FENCE_WAIT and exc.code == kind.__name__
    text = str(exc)
    assert f"fence token wait failed with {kind.__name__}" in text
    assert "the copy thread was stopped" in text and f"stopped with {kind.__name__} before it finished" in text
    assert "accepted:" in text
    assert isinstance(exc.__cause__, kind)  # the original stays reachable for a debugger
    # reported once: the failed copy now counts as finished and the session carries on
    assert s.ledger.pending(r) == [] and s.ledger.account(CPU).pending_fences == 0
    assert not r.released and s.ledger.resident(r) == PAGE  # nothing was freed past the failed copy
    s.fence(CPU)
    assert s.free(r) == PAGE
    assert s.fault(r, 0, PAGE).ok
    assert s.release_reservation(r) == PAGE
    s.close()


@pytest.mark.parametrize("kind", [KeyboardInterrupt, SystemExit])
def test_a_copy_thread_of_a_pool_that_raised_base_exception_is_a_driver_error(kind):
    """The real thing: a ``ThreadPoolExecutor`` worker whose copy raised KeyboardInterrupt/SystemExit
    (CPython sets it on the future and the pool carries on)."""
    s = make_session(sanitize=True)
    r = s.reserve(CPU, PAGE)
    assert s.fault(r, 0, PAGE).ok

    def copy():
        raise kind("copy interrupted")

    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(copy)
        s.record(r, future)
        exc = outcome(s.free, r)
        assert type(exc) is DriverError and kind.__name__ in str(exc), exc
        assert pool.submit(lambda: 7).result(SAFETY) == 7  # the pool survived its worker's copy
    assert s.free(r) == PAGE
    s.close()


def test_a_died_copy_among_finished_ones_is_counted_in_the_message():
    s = make_session()
    r = s.reserve(CPU, PAGE)
    assert s.fault(r, 0, PAGE).ok
    finished: Future = Future()
    finished.set_result(None)
    slow = SlowCopy()
    slow.finish.set()
    s.record(r, finished)
    s.record(r, died(KeyboardInterrupt))
    s.record(r, slow)
    exc = outcome(s.free, r)
    assert type(exc) is DriverError and "1 of 3 token(s)" in str(exc), exc
    assert s.free(r) == PAGE
    s.close()


class InterruptedWait:
    """A token whose wait is interrupted in the caller's own thread (Ctrl-C while blocking): the copy
    itself is still running."""

    def __init__(self, future: Future):
        self.future = future  # looks like a FutureToken's, but the future does not hold this exception
        self.waits = 0

    def done(self) -> bool:
        return self.future.done()

    def wait(self) -> None:
        self.waits += 1
        if self.waits == 1:
            raise KeyboardInterrupt  # delivered to the waiting thread, not the copy's outcome
        self.future.result()


@pytest.mark.parametrize("copy_state", ["running", "died_too"])
def test_a_keyboard_interrupt_of_the_callers_own_wait_propagates_and_keeps_the_tokens(copy_state):
    """Distinguished by identity: only the exception the future itself holds is the copy's death."""
    s = make_session()
    r = s.reserve(CPU, PAGE)
    assert s.fault(r, 0, PAGE).ok
    future: Future = Future()
    if copy_state == "died_too":  # the copy died too, but the caller's Ctrl-C is another exception
        future.set_exception(KeyboardInterrupt("copy"))
    token = InterruptedWait(future)
    s.record(r, token)
    exc = outcome(s.free, r)
    assert type(exc) is KeyboardInterrupt and exc.args == ()  # the caller's own, not the copy's
    assert s.ledger.pending(r) == [token] and s.ledger.resident(r) == PAGE  # nothing freed, nothing lost
    if copy_state == "running":
        future.set_result(None)
        assert s.free(r) == PAGE
    else:
        assert type(outcome(s.free, r)) is DriverError  # now the copy's own death is reported, once
        assert s.free(r) == PAGE
    s.close()


# --------------------------------------------------------------------------- contention


class Copy:
    """A copy a completer thread finishes; ``seq`` is when its record returned (None: not yet)."""

    __slots__ = ("event", "seq", "reservation")

    def __init__(self, reservation):
        self.event = threading.Event()
        self.seq: int | None = None
        self.reservation = reservation

    def done(self) -> bool:
        return self.event.is_set()

    def wait(self) -> None:
        assert self.event.wait(SAFETY), "a copy was never finished"


def test_no_fence_returns_while_a_copy_recorded_before_it_is_unfinished():
    """Threads record, fault, free and fence on three reservations while a completer finishes copies
    in random order; every fence checks, as it returns, each copy whose record returned before the fence
    began. Deterministic: the invariant holds in every interleaving."""
    s = make_session()
    device_reservations = [s.reserve(CPU, 2 * PAGE) for _ in range(3)]
    clock = itertools.count()
    clock_lock = threading.Lock()

    def tick() -> int:
        with clock_lock:
            return next(clock)

    copies: list[Copy] = []
    unfinished: list[Copy] = []
    copies_lock = threading.Lock()
    stop = threading.Event()
    violations: list[str] = []
    errors: list[BaseException] = []
    ITERATIONS = 300

    def check(kind: str, started: int, reservation=None) -> None:
        with copies_lock:
            seen = [c for c in copies if c.seq is not None and c.seq < started
                    and (reservation is None or c.reservation is reservation)]
        late = [c for c in seen if not c.done()]
        if late:
            violations.append(f"{kind} returned while {len(late)} copy(ies) recorded before it ran")

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(ITERATIONS):
                r = rng.choice(device_reservations)
                roll = rng.random()
                if roll < 0.35:
                    s.fault(r, 0, 2 * PAGE)
                    c = Copy(r)
                    s.record(r, c)
                    seq = tick()
                    with copies_lock:
                        c.seq = seq
                        copies.append(c)
                        unfinished.append(c)
                elif roll < 0.6:
                    s.free(r, rng.choice([0, PAGE]), PAGE)
                elif roll < 0.8:
                    started = tick()
                    s.fence(CPU)
                    check("fence(device)", started)
                else:
                    started = tick()
                    s.fence(CPU, r)
                    check(f"fence(device, #{r.id})", started, r)
        except BaseException as exc:  # noqa: BLE001 -- reported below
            errors.append(exc)

    def completer() -> None:
        rng = random.Random(99)
        while not stop.is_set() or unfinished:
            with copies_lock:
                c = unfinished.pop(rng.randrange(len(unfinished))) if unfinished else None
            if c is not None:
                c.event.set()
            time.sleep(0.0002)  # the copies are slower than the verbs: frees and fences really wait

    done = threading.Thread(target=completer, daemon=True)
    done.start()
    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(SAFETY * 4)
    stop.set()
    done.join(SAFETY)
    assert not any(t.is_alive() for t in threads) and not done.is_alive()
    assert not errors, errors
    assert not violations, violations[:5]
    s.fence(CPU)
    assert s.ledger.account(CPU).pending_fences == 0
    s.close()
