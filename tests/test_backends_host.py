"""The host backend (``membackend._backends.host``): the contract, including every bad input (typed error,
ledger unchanged); the resident count under threads; trim; injected failures."""

from __future__ import annotations

import random
import sys
import threading

import pluggy
import pytest

from membackend import hookspec
from membackend._backends.host import HostBackend
from membackend._drivers.host import resident_bytes
from membackend.types import (
    ConfigError,
    Device,
    Fault,
    InvalidSize,
    Misaligned,
    OutOfRange,
    Reservation,
    ReservationError,
    ReservationReleased,
    WrongDevice,
)

MiB = 1 << 20
PS = 2 * MiB
CPU = Device("cpu", 0)

posix_only = pytest.mark.skipif(sys.platform == "win32", reason="POSIX host driver")


def snapshot(session):
    return session.ledger.account(CPU), session.ledger.alive()


def test_reserve_rounds_up_to_whole_pages_and_commits_nothing(host_session):
    r = host_session.reserve("cpu", 5 * MiB + 1)
    assert r.size == 6 * MiB and r.requested == 5 * MiB + 1 and r.page_size == 2 * MiB
    assert r.base % (2 * MiB) == 0
    acct = host_session.ledger.account(CPU)
    assert (acct.reserved, acct.resident, acct.reservations_alive) == (6 * MiB, 0, 1)


def test_fault_backs_every_touched_page_and_reports_generations(host_session):
    r = host_session.reserve(CPU, 8 * MiB)
    f = host_session.fault(r, 1 * MiB, 2 * MiB)  # touches pages 0 and 1
    assert f.ok and f.first_page == 0 and len(f.generations) == 2 and f.mapped == 4 * MiB
    again = host_session.fault(r, 0, 4 * MiB)
    assert again.generations == f.generations and again.mapped == 0
    assert host_session.ledger.resident(r) == 4 * MiB


def test_generation_changes_when_a_page_gets_new_memory(host_session):
    r = host_session.reserve(CPU, 4 * MiB)
    g1 = host_session.fault(r, 0, 4 * MiB).generations
    assert host_session.free(r, 2 * MiB, 2 * MiB) == 2 * MiB
    g2 = host_session.fault(r, 0, 4 * MiB).generations
    assert g2[0] == g1[0] and g2[1] != g1[1]


def test_memory_is_really_usable_after_fault(host_session):
    import ctypes

    r = host_session.reserve(CPU, 2 * MiB)
    host_session.fault(r, 0, 2 * MiB)
    buf = (ctypes.c_char * (2 * MiB)).from_address(r.base)
    buf[0], buf[2 * MiB - 1] = b"a", b"z"
    assert buf[0] == b"a" and buf[2 * MiB - 1] == b"z"
    host_session.free(r)
    host_session.fault(r, 0, 2 * MiB)
    assert buf[0] == b"\0"  # dropped pages come back zeroed: the caller must re-copy


def test_free_returns_bytes_dropped_and_keeps_the_range(host_session):
    r = host_session.reserve(CPU, 8 * MiB)
    host_session.fault(r, 0, 8 * MiB)
    assert host_session.free(r, 0, 4 * MiB) == 4 * MiB
    assert host_session.free(r, 0, 4 * MiB) == 0
    assert host_session.free(r) == 4 * MiB
    assert host_session.ledger.account(CPU).reserved == 8 * MiB
    assert host_session.fault(r, 0, 8 * MiB).ok


def test_free_may_end_at_the_requested_end_of_the_reservation(host_session):
    r = host_session.reserve(CPU, 3 * MiB)  # 2 pages, the second half used
    host_session.fault(r, 0, 3 * MiB)
    assert host_session.free(r, 2 * MiB, 1 * MiB) == 2 * MiB


def test_release_returns_everything_and_kills_the_reservation(host_session):
    r = host_session.reserve(CPU, 8 * MiB)
    host_session.fault(r, 0, 6 * MiB)
    assert host_session.release_reservation(r) == 6 * MiB
    assert r.released
    acct = host_session.ledger.account(CPU)
    assert (acct.reserved, acct.resident, acct.reservations_alive) == (0, 0, 0)


def test_budget_query_names_its_source(host_session):
    b = host_session.budget_query("cpu:0")
    assert b.total > 0 and 0 <= b.usable <= b.free <= b.total and b.unified
    assert b.source


def test_capacity_makes_a_fault_out_of_memory_and_leaves_nothing(host_session):
    host_session.backend.capacity = 4 * MiB
    r = host_session.reserve(CPU, 16 * MiB)
    assert host_session.fault(r, 0, 4 * MiB).ok
    before = snapshot(host_session)
    f = host_session.fault(r, 4 * MiB, 4 * MiB)
    assert f == Fault(False, (), 2, 0)
    assert snapshot(host_session) == before
    assert host_session.backend.resident == 4 * MiB


def test_fence_waits_for_recorded_tokens(host_session):
    r = host_session.reserve(CPU, 2 * MiB)
    host_session.fault(r, 0, 2 * MiB)
    event = threading.Event()
    finished = []

    class Copy:
        def done(self):
            return event.is_set()

        def wait(self):
            event.wait(5)
            finished.append(True)

    host_session.record(r, Copy())
    assert host_session.ledger.account(CPU).pending_fences == 1
    threading.Timer(0.05, event.set).start()
    host_session.free(r)  # fences first
    assert finished == [True]
    assert host_session.ledger.account(CPU).pending_fences == 0


def test_device_wide_fence_waits_every_reservation_on_the_device(host_session):
    a, b = host_session.reserve(CPU, 2 * MiB), host_session.reserve(CPU, 2 * MiB)
    waited = []

    class Token:
        def __init__(self, n):
            self.n = n

        def done(self):
            return self.n in waited

        def wait(self):
            waited.append(self.n)

    host_session.record(a, Token(1))
    host_session.record(b, Token(2))
    host_session.fence("cpu")
    assert sorted(waited) == [1, 2]
    assert host_session.ledger.account(CPU).pending_fences == 0


def test_a_failing_token_keeps_its_work_pending(host_session):
    from membackend.types import DriverError

    r = host_session.reserve(CPU, 2 * MiB)

    class Broken:
        healed = False

        def done(self):
            return self.healed

        def wait(self):
            if not self.healed:
                raise RuntimeError("stream lost")

    host_session.record(r, Broken())
    with pytest.raises(DriverError, match="stream lost"):
        host_session.fence(reservation=r)
    assert host_session.ledger.account(CPU).pending_fences == 1
    with pytest.raises(DriverError):
        host_session.release_reservation(r)
    assert not r.released and host_session.ledger.alive() == 1
    Broken.healed = True
    host_session.release_reservation(r)


# --------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize("size", [0, -1, -(2 * MiB)])
def test_reserve_rejects_non_positive_size(host_session, size):
    before = snapshot(host_session)
    with pytest.raises(InvalidSize, match="size must be > 0"):
        host_session.reserve(CPU, size)
    assert snapshot(host_session) == before


@pytest.mark.parametrize("size", [1.5, "1MiB", None])
def test_reserve_rejects_non_integer_size(host_session, size):
    before = snapshot(host_session)
    with pytest.raises(InvalidSize, match="integer"):
        host_session.reserve(CPU, size)
    assert snapshot(host_session) == before


@pytest.mark.parametrize("device", ["cuda:0", "hip:1", "cpu:1", "tpu:0", "cpu:x"])
def test_reserve_rejects_a_device_the_backend_does_not_serve(host_session, device):
    before = snapshot(host_session)
    with pytest.raises(WrongDevice):
        host_session.reserve(device, MiB)
    assert snapshot(host_session) == before


@pytest.mark.parametrize("verb", ["fault", "free"])
@pytest.mark.parametrize("offset,size,error", [
    (0, 0, InvalidSize), (0, -5, InvalidSize), (-1, 10, OutOfRange),
    (0, 8 * MiB + 1, OutOfRange), (8 * MiB, 1, OutOfRange), (7 * MiB, 2 * MiB, OutOfRange),
    (0.0, 10, InvalidSize),
])
def test_range_errors(host_session, verb, offset, size, error):
    r = host_session.reserve(CPU, 8 * MiB)
    host_session.fault(r, 0, 2 * MiB)
    before = snapshot(host_session), host_session.backend.resident
    with pytest.raises(error):
        getattr(host_session, verb)(r, offset, size)
    assert (snapshot(host_session), host_session.backend.resident) == before


@pytest.mark.parametrize("offset,size", [(1, 2 * MiB), (2 * MiB, MiB), (MiB, MiB)])
def test_free_rejects_a_misaligned_range(host_session, offset, size):
    r = host_session.reserve(CPU, 8 * MiB)
    host_session.fault(r, 0, 8 * MiB)
    before = snapshot(host_session)
    with pytest.raises(Misaligned, match="page boundary"):
        host_session.free(r, offset, size)
    assert snapshot(host_session) == before and host_session.ledger.resident(r) == 8 * MiB


@pytest.mark.parametrize("verb,args", [
    ("fault", (0, MiB)), ("free", (0, 2 * MiB)), ("release_reservation", ()), ("fence", ()),
])
def test_use_after_release(host_session, verb, args):
    r = host_session.reserve(CPU, 4 * MiB)
    host_session.release_reservation(r)
    before = snapshot(host_session)
    with pytest.raises(ReservationReleased, match="after it was released"):
        if verb == "fence":
            host_session.fence(reservation=r)
        else:
            getattr(host_session, verb)(r, *args)
    assert snapshot(host_session) == before


def test_a_foreign_reservation_is_refused(host_session):
    fake = Reservation(CPU, 0x1000, 2 * MiB, 2 * MiB, "other")
    with pytest.raises(WrongDevice, match="belongs to backend 'other'"):
        host_session.fault(fake, 0, 10)
    with pytest.raises(WrongDevice, match="needs a Reservation"):
        host_session.free("not a reservation", 0, 10)


def test_fence_with_a_mismatched_device(host_session):
    r = host_session.reserve(CPU, 2 * MiB)
    with pytest.raises(WrongDevice, match="is on cpu:0, not cuda:0"):
        host_session.fence("cuda:0", r)
    with pytest.raises(WrongDevice, match="needs a device"):
        host_session.fence()


def test_budget_query_on_a_device_not_served(host_session):
    with pytest.raises(WrongDevice):
        host_session.budget_query("cuda:0")


def test_record_rejects_an_object_that_is_no_token(host_session):
    r = host_session.reserve(CPU, 2 * MiB)
    with pytest.raises(TypeError, match="done\\(\\) and wait\\(\\)"):
        host_session.record(r, object())
    assert host_session.ledger.account(CPU).pending_fences == 0


def test_every_bad_input_error_is_a_reservation_error():
    for cls in (ReservationReleased, OutOfRange, Misaligned, WrongDevice, InvalidSize):
        assert issubclass(cls, ReservationError) and issubclass(cls, ValueError)


def test_close_releases_everything_alive(host_session):
    for _ in range(3):
        host_session.fault(host_session.reserve(CPU, 4 * MiB), 0, MiB)
    assert host_session.close() == 3
    assert host_session.ledger.account(CPU).reserved == 0


# --------------------------------------------------------------------------- trim


def test_trim_is_a_hook_and_names_the_device_it_serves():
    backend = HostBackend(page_size=PS)
    pm = pluggy.PluginManager(hookspec.PROJECT)
    pm.add_hookspecs(hookspec)
    pm.register(backend)
    assert pm.hook.membackend_trim(device=CPU) == 0
    with pytest.raises(WrongDevice, match="serves only cpu:0, not cuda:0"):
        backend.membackend_trim(Device("cuda", 0))


# --------------------------------------------------------------------------- threads on distinct reservations


def kernel_resident(reservations) -> int:
    return sum(resident_bytes(r.base, r.size) for r in reservations)


@posix_only
def test_concurrent_faults_never_take_more_than_the_capacity():
    """Eight threads fault at once into a capacity that fits two: the check and the charge are one step."""
    for _ in range(5):
        backend = HostBackend(page_size=PS, capacity=4 * PS)
        rs = [backend.membackend_reserve(CPU, 2 * PS) for _ in range(8)]
        barrier = threading.Barrier(len(rs))
        faults = [None] * len(rs)

        def fault(k):
            barrier.wait()
            faults[k] = backend.membackend_fault(rs[k], 0, 2 * PS)

        threads = [threading.Thread(target=fault, args=(k,)) for k in range(len(rs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        granted = sum(f.mapped for f in faults if f.ok)
        assert granted == 4 * PS, f"capacity {4 * PS}, granted {granted} ({[f.ok for f in faults]})"
        assert backend.resident == granted == sum(r.handle.resident.count(1) * PS for r in rs)
        assert kernel_resident(rs) == granted
        for r in rs:
            backend.membackend_release_reservation(r)
        assert backend.resident == 0
        backend.driver.shutdown_pool()


@posix_only
def test_random_verbs_from_threads_keep_the_resident_count_exact():
    backend = HostBackend(page_size=PS, capacity=24 * PS)
    rs = [backend.membackend_reserve(CPU, 6 * PS) for _ in range(8)]

    def work(k):
        rng = random.Random(k)
        r = rs[k]
        for _ in range(200):
            first = rng.randrange(6)
            pages = rng.randint(1, 6 - first)
            if rng.random() < 0.6:
                backend.membackend_fault(r, first * PS, pages * PS)
            else:
                backend.membackend_free(r, first * PS, pages * PS)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(rs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    counted = sum(r.handle.resident.count(1) * PS for r in rs)
    assert backend.resident == counted == kernel_resident(rs)
    assert counted <= 24 * PS
    generations = [g for r in rs for p, g in enumerate(r.handle.generations) if r.handle.resident[p]]
    assert len(set(generations)) == len(generations), "every backed page has its own generation"
    for r in rs:
        backend.membackend_release_reservation(r)
    assert backend.resident == 0
    backend.driver.shutdown_pool()


# --------------------------------------------------------------------------- failure injection


def run_faults(backend, count=40, seed=3):
    rng = random.Random(seed)
    r = backend.membackend_reserve(CPU, 8 * PS)
    outcomes = []
    try:
        for _ in range(count):
            first = rng.randrange(8)
            f = backend.membackend_fault(r, first * PS, rng.randint(1, 8 - first) * PS)
            outcomes.append(f.ok)
            assert backend.resident == r.handle.resident.count(1) * PS
            if sys.platform != "win32":
                assert resident_bytes(r.base, r.size) == backend.resident, "a failed fault must roll back"
            if rng.random() < 0.5:
                backend.membackend_free(r, 0, r.size)
    finally:
        backend.membackend_release_reservation(r)
    return outcomes


@posix_only
def test_injected_failures_are_out_of_memory_and_stop_restores_the_driver():
    backend = HostBackend(page_size=PS)
    real = backend.driver
    injection = backend.membackend_inject_failures(0.3, 11)
    outcomes = run_faults(backend)
    assert injection.injected == outcomes.count(False) > 0 and any(outcomes)
    injection.stop()
    injection.stop()
    assert backend.driver is real
    assert all(run_faults(backend))
    assert injection.injected == outcomes.count(False)


@posix_only
def test_a_seed_gives_the_same_failures():
    a, b = HostBackend(page_size=PS), HostBackend(page_size=PS)
    a.membackend_inject_failures(0.3, 5)
    b.membackend_inject_failures(0.3, 5)
    assert run_faults(a) == run_faults(b)


@posix_only
def test_injected_failures_from_threads_are_counted_and_rolled_back():
    backend = HostBackend(page_size=PS)
    injection = backend.membackend_inject_failures(0.2, 1)
    rs = [backend.membackend_reserve(CPU, 4 * PS) for _ in range(8)]
    failed = [0] * len(rs)

    def work(k):
        for _ in range(50):
            if not backend.membackend_fault(rs[k], 0, 4 * PS).ok:
                failed[k] += 1
            backend.membackend_free(rs[k], 0, 4 * PS)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(rs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    injection.stop()
    assert injection.injected == sum(failed) > 0
    assert backend.resident == 0 == kernel_resident(rs)
    for r in rs:
        backend.membackend_release_reservation(r)


@posix_only
def test_injections_nest_and_stop_in_any_order():
    backend = HostBackend(page_size=PS)
    real = backend.driver
    outer = backend.membackend_inject_failures(1.0, 0)
    inner = backend.membackend_inject_failures(0.0, 0)
    outer.stop()  # the outer one stops injecting at once, though the inner one still wraps it
    assert all(run_faults(backend, count=5))
    inner.stop()
    assert backend.driver is real

    outer = backend.membackend_inject_failures(0.0, 0)
    inner = backend.membackend_inject_failures(1.0, 0)
    inner.stop()
    assert backend.driver is outer._driver
    outer.stop()
    assert backend.driver is real


@pytest.mark.parametrize("probability,seed,key", [(1.5, 0, "probability"), (True, 0, "probability"),
                                                  ("0.1", 0, "probability"), (0.1, 1.5, "seed")])
def test_bad_injection_arguments_are_typed(probability, seed, key):
    backend = HostBackend(page_size=PS)
    real = backend.driver
    with pytest.raises(ConfigError) as info:
        backend.membackend_inject_failures(probability, seed)
    assert info.value.key == key and info.value.accepted
    assert backend.driver is real


def test_inspect_never_asks_the_kernel_about_a_range_a_release_gives_back():
    """The status polls inspect while ComfyUI's worker releases reservations: mincore of a range unmapped
    between the snapshot and the call would fail (ENOMEM). 4 threads reserve, fault and release while one
    inspects; no error, and the kernel's figures end at zero."""
    import threading

    from membackend._machine import gather_machine
    from membackend._session import Session

    s = Session(HostBackend(), machine=gather_machine())
    stop, errors = threading.Event(), []

    def churn():
        try:
            while not stop.is_set():
                r = s.reserve("cpu", 8 * MiB)
                s.fault(r, 0, 2 * MiB)
                s.release_reservation(r)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def look():
        try:
            for _ in range(400):
                s.inspect("cpu")
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            stop.set()

    threads = [threading.Thread(target=churn) for _ in range(4)] + [threading.Thread(target=look)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [], errors
    state = s.inspect("cpu")
    assert (state.reserved, state.resident) == (0, 0)
    s.close()
