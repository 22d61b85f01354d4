"""The ledger (``membackend._ledger``): its sanitize mode (the checks behind G1 and G2), and the defects
found under stress (issue 7, section 4; each test failed before its fix): atomic updates under threads,
tokens refused for released reservations."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from membackend._fences import FutureToken
from membackend._ledger import Ledger
from membackend.types import Device, Reservation, ReservationReleased, SanitizerError

MiB = 1 << 20
PAGE = 2 * MiB
CPU = Device("cpu", 0)


class LyingToken:
    """A token whose wait() returns while the work is still running: the bug G2 guards against."""

    def __init__(self):
        self.finished = False

    def done(self):
        return self.finished

    def wait(self):
        pass


def test_free_with_unfinished_work_is_caught(sanitized_session):
    r = sanitized_session.reserve(CPU, 4 * MiB)
    sanitized_session.fault(r, 0, 4 * MiB)
    token = LyingToken()
    sanitized_session.record(r, token)
    # while the session fences, a copy thread records new work on the range (the race G2 forbids)
    token.wait = lambda: sanitized_session.ledger.record(r, LyingToken())
    with pytest.raises(SanitizerError, match="free on reservation .* unfinished"):
        sanitized_session.free(r)
    assert sanitized_session.ledger.resident(r) == 4 * MiB
    for t in sanitized_session.ledger.pending(r):
        t.finished = True
    assert sanitized_session.free(r) == 4 * MiB


def test_release_with_unfinished_work_is_caught_and_nothing_is_released():
    ledger = Ledger(sanitize=True)
    r = Reservation(CPU, 0x10000, 2 * MiB, 2 * MiB, "host")
    ledger.on_reserve(r)
    token = LyingToken()
    ledger.record(r, token)
    with pytest.raises(SanitizerError, match="release_reservation .* 1 recorded asynchronous operation"):
        ledger.check_quiet(r, "release_reservation")
    assert ledger.account(CPU).reservations_alive == 1


def test_session_release_with_a_lying_token_is_caught(sanitized_session, monkeypatch):
    r = sanitized_session.reserve(CPU, 2 * MiB)
    token = LyingToken()
    sanitized_session.record(r, token)
    # a token that lies in wait() stays pending after the session's fence: simulate the race by
    # putting it back during the wait, as a concurrent recorder would
    real_wait = token.wait
    token.wait = lambda: (real_wait(), sanitized_session.ledger.record(r, token))
    with pytest.raises(SanitizerError, match="unfinished"):
        sanitized_session.release_reservation(r)
    assert not r.released and sanitized_session.ledger.account(CPU).reservations_alive == 1
    token.finished = True
    sanitized_session.release_reservation(r)


def test_use_after_release_says_where_it_was_released(sanitized_session):
    r = sanitized_session.reserve(CPU, 2 * MiB)
    sanitized_session.release_reservation(r)
    with pytest.raises(SanitizerError, match="(?s)use after release: fault .*released at:.*test_ledger.py"):
        sanitized_session.fault(r, 0, 1)


def test_double_release_is_caught(sanitized_session):
    r = sanitized_session.reserve(CPU, 2 * MiB)
    sanitized_session.release_reservation(r)
    before = sanitized_session.ledger.account(CPU)
    with pytest.raises(SanitizerError, match="double release"):
        sanitized_session.release_reservation(r)
    assert sanitized_session.ledger.account(CPU) == before


def test_without_sanitize_the_same_misuse_is_a_typed_error(host_session):
    from membackend.types import ReservationReleased

    r = host_session.reserve(CPU, 2 * MiB)
    host_session.release_reservation(r)
    with pytest.raises(ReservationReleased):
        host_session.release_reservation(r)


def test_sanitize_off_does_not_check_quiet():
    ledger = Ledger(sanitize=False)
    r = Reservation(CPU, 0x10000, 2 * MiB, 2 * MiB, "host")
    ledger.on_reserve(r)
    ledger.record(r, LyingToken())
    ledger.check_quiet(r, "free")  # no error: the check is sanitize-only


def test_ledger_accounts_per_device():
    ledger = Ledger()
    a = Reservation(CPU, 0x10000, 4 * MiB, 2 * MiB, "x")
    b = Reservation(Device("cuda", 1), 0x90000, 8 * MiB, 2 * MiB, "x")
    for r in (a, b):
        ledger.on_reserve(r)
    ledger.on_fault(a, 2 * MiB)
    ledger.on_fault(b, 8 * MiB)
    ledger.on_free(b, 2 * MiB)
    ledger.record(b, LyingToken())
    assert ledger.account(CPU).resident == 2 * MiB
    gpu = ledger.account(Device("cuda", 1))
    assert (gpu.reserved, gpu.resident, gpu.reservations_alive, gpu.pending_fences) == (8 * MiB, 6 * MiB, 1, 1)
    ledger.on_release(b)
    gpu = ledger.account(Device("cuda", 1))
    assert (gpu.reserved, gpu.resident, gpu.reservations_alive, gpu.pending_fences) == (0, 0, 0, 0)
    assert ledger.devices() == [CPU, Device("cuda", 1)]


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


# --------------------------------------------------------------------------- 4.3 and 4.6: tokens


def test_the_ledger_refuses_a_token_for_a_released_reservation():
    ledger = Ledger()
    r = Reservation(CPU, 0x10000, PAGE, PAGE, "host")
    ledger.on_reserve(r)
    ledger.on_release(r)
    with pytest.raises(ReservationReleased, match="not alive"):
        ledger.record(r, FutureToken(Future()))
    assert ledger.account(CPU).pending_fences == 0 and ledger.pending(r) == []

class DoneRaises:
    """A token whose done() raises (a driver query that failed): its work must count as unfinished."""

    def done(self):
        raise RuntimeError("query failed")

    def wait(self):
        pass


def test_sanitize_counts_a_token_whose_done_raises_as_unfinished():
    ledger = Ledger(sanitize=True)
    r = Reservation(CPU, 0x10000, PAGE, PAGE, "host")
    ledger.on_reserve(r)
    ledger.record(r, DoneRaises())
    with pytest.raises(SanitizerError, match="1 recorded asynchronous operation"):
        ledger.check_quiet(r, "free")
