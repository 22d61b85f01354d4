"""The conformance kit: every rule of the contract as a test, plus property-based sequences.

Run it against any installed backend::

    pytest --pyargs membackend.testing.conformance --membackend-backend NAME

Each test gets a fresh session forced onto the target backend
(``membackend_session``). After each test the kit releases what is left and
checks that nothing leaked. The property test drives random verb sequences
under random injected driver failures and checks after every step that the
ledger equals the driver's own view, that no reservation leaked and that the
sanitizer saw nothing.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ..session import Session
from ..types import (
    Budget,
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
from .harness import async_work, build_session, driver_view, inject_failures, kit_device

__all__ = []  # collected by pytest; nothing to import

MiB = 1 << 20


def _ledger_matches_driver(session: Session, device: Device) -> None:
    view = driver_view(session, device)
    acct = session.ledger.account(device)
    if view is not None:
        assert (acct.reserved, acct.resident) == (view.reserved, view.resident), \
            f"ledger {acct} != driver {view}"
    mine = sum(session.ledger.resident(r) for r in session.reservations() if r.device == device)
    assert acct.resident == mine and acct.reservations_alive == len(
        [r for r in session.reservations() if r.device == device])


def _sim(session: Session):
    driver = getattr(session.backend, "_driver", None)
    return getattr(driver, "sim", None)


def _pages(session: Session, n: int) -> tuple[Reservation, int]:
    r = session.reserve(kit_device(session), 1)
    ps = r.page_size
    session.release_reservation(r)
    return session.reserve(kit_device(session), n * ps), ps


# --------------------------------------------------------------------------- rules


def test_reserve_gives_whole_pages_and_no_memory(membackend_session):
    s = membackend_session
    dev = kit_device(s)
    r = s.reserve(dev, 3 * MiB + 1)
    assert isinstance(r, Reservation) and r.device == dev and not r.released
    assert r.size >= 3 * MiB + 1 and r.size % r.page_size == 0 and r.size - r.page_size < 3 * MiB + 1
    acct = s.ledger.account(dev)
    assert (acct.reserved, acct.resident, acct.reservations_alive) == (r.size, 0, 1)
    _ledger_matches_driver(s, dev)


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
    assert isinstance(f, Fault) and f.ok and f.first_page == 0 and len(f.generations) == 2 and f.mapped == 2 * ps
    again = s.fault(r, 0, 2 * ps)
    assert again.ok and again.generations == f.generations and again.mapped == 0
    assert s.ledger.resident(r) == 2 * ps
    _ledger_matches_driver(s, r.device)


def test_a_page_gets_a_new_generation_when_it_gets_new_memory(membackend_session):
    s = membackend_session
    r, ps = _pages(s, 2)
    g1 = s.fault(r, 0, 2 * ps).generations
    assert s.free(r, ps, ps) == ps
    g2 = s.fault(r, 0, 2 * ps).generations
    assert g2[0] == g1[0] and g2[1] != g1[1]


def test_free_drops_pages_and_keeps_the_range(membackend_session):
    s = membackend_session
    r, ps = _pages(s, 4)
    s.fault(r, 0, 4 * ps)
    assert s.free(r, 0, 2 * ps) == 2 * ps
    assert s.free(r, 0, 2 * ps) == 0
    _ledger_matches_driver(s, r.device)
    assert s.free(r) == 2 * ps
    assert s.ledger.account(r.device).reserved == r.size and s.fault(r, 0, r.size).ok
    _ledger_matches_driver(s, r.device)


def test_release_returns_everything(membackend_session):
    s = membackend_session
    r, ps = _pages(s, 3)
    s.fault(r, 0, 2 * ps)
    assert s.release_reservation(r) == 2 * ps and r.released
    acct = s.ledger.account(r.device)
    assert (acct.reserved, acct.resident, acct.reservations_alive) == (0, 0, 0)
    _ledger_matches_driver(s, r.device)


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
    _ledger_matches_driver(s, r.device)


def test_free_needs_whole_pages(membackend_session):
    s = membackend_session
    r, ps = _pages(s, 2)
    s.fault(r, 0, 2 * ps)
    with pytest.raises(Misaligned):
        s.free(r, 1, ps)
    with pytest.raises(Misaligned):
        s.free(r, 0, ps // 2)
    assert s.ledger.resident(r) == 2 * ps


def test_out_of_memory_is_a_result_and_changes_nothing(membackend_session):
    s = membackend_session
    r, ps = _pages(s, 4)
    s.fault(r, 0, ps)
    before = s.ledger.account(r.device)
    with inject_failures(s, probability=1.0) as injected:
        if injected is None:
            pytest.skip("this backend's driver cannot be reached for fault injection")
        try:
            f = s.fault(r, ps, 3 * ps)
        except DriverError:
            f = None  # a failure other than out of memory is a typed error: also allowed
    assert f is None or not f.ok
    assert s.ledger.account(r.device) == before
    _ledger_matches_driver(s, r.device)


def test_free_and_release_wait_for_recorded_work(membackend_session):
    s = membackend_session
    r, ps = _pages(s, 2)
    s.fault(r, 0, 2 * ps)
    token = async_work(s, r, 0, ps)
    s.record(r, token)
    assert s.ledger.account(r.device).pending_fences == 1
    s.free(r)
    assert token.done() and s.ledger.account(r.device).pending_fences == 0
    s.fault(r, 0, ps)
    token = async_work(s, r, 0, ps)
    s.record(r, token)
    s.release_reservation(r)
    assert token.done()
    sim = _sim(s)
    assert sim is None or (sim.use_after_free, sim.bugchecks) == (0, 0)


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
    assert all(t.done() for t in tokens) and s.ledger.account(a.device).pending_fences == 0


def test_budget_names_its_source(membackend_session):
    s = membackend_session
    for dev in s.devices():
        b = s.budget_query(dev)
        assert isinstance(b, Budget) and b.total > 0 and 0 <= b.usable <= b.free <= b.total
        assert b.usable == max(0, b.free - b.headroom) and b.source


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
    """Random verbs under random driver failures; the ledger must equal the driver after every step."""

    target = None  # set by the kit's fixture

    def __init__(self) -> None:
        super().__init__()
        self.session = build_session(self.target, sanitize=True)
        self.device = kit_device(self.session)
        probe = self.session.reserve(self.device, 1)
        self.ps = probe.page_size
        self.session.release_reservation(probe)
        self.live: list[Reservation] = []
        self.injector = None
        SEQUENCES["runs"] += 1

    @initialize(p=st.sampled_from([0.0, 0.05, 0.2]), seed=st.integers(0, 2**16))
    def start_injecting(self, p, seed):
        self._ctx = inject_failures(self.session, p, seed)
        self.injector = self._ctx.__enter__()

    def _call(self, fn, *args):
        SEQUENCES["steps"] += 1
        try:
            return fn(*args)
        except DriverError:  # an injected failure surfaces as a typed error; state must stay consistent
            SEQUENCES["typed_errors"] += 1
            return None

    @rule(pages=st.integers(1, 6))
    def reserve(self, pages):
        if len(self.live) < 4:
            r = self._call(self.session.reserve, self.device, pages * self.ps)
            if r is not None:
                self.live.append(r)

    def _draw_range(self, data) -> tuple[Reservation, int, int]:
        """A live reservation and a whole-page range inside it."""
        r = data.draw(st.sampled_from(self.live))
        first = data.draw(st.integers(0, r.pages - 1))
        count = data.draw(st.integers(1, r.pages - first))
        return r, first * self.ps, count * self.ps

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fault(self, data):
        f = self._call(self.session.fault, *self._draw_range(data))
        if f is not None and not f.ok:
            SEQUENCES["oom"] += 1

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        self._call(self.session.free, *self._draw_range(data))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def copy_then_maybe_free(self, data):
        r = data.draw(st.sampled_from(self.live))
        resident = [p for p in range(r.pages) if self._resident(r, p)]
        if resident:
            p = data.draw(st.sampled_from(resident))
            self.session.record(r, async_work(self.session, r, p * self.ps, self.ps, seconds=0.0005))
            if data.draw(st.booleans()):
                self._call(self.session.free, r, p * self.ps, self.ps)

    def _resident(self, r: Reservation, page: int) -> bool:
        flags = getattr(r.handle, "ready", None)  # vmm: mapped and accessible
        if flags is None:
            flags = getattr(r.handle, "resident", None)  # host
        return flags is not None and bool(flags[page])

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release(self, data):
        r = data.draw(st.sampled_from(self.live))
        self._call(self.session.release_reservation, r)
        if r.released:
            self.live.remove(r)

    @rule()
    def fence_device(self):
        self._call(self.session.fence, self.device)

    @rule()
    def budget(self):
        self._call(self.session.budget_query, self.device)

    @invariant()
    def ledger_equals_driver(self):
        _ledger_matches_driver(self.session, self.device)
        sim = _sim(self.session)
        if sim is not None:
            assert (sim.use_after_free, sim.bugchecks, sim.crashes) == (0, 0, 0)

    def teardown(self):
        if self.injector is not None:
            self._ctx.__exit__(None, None, None)
            SEQUENCES["injected"] += getattr(self.injector, "injected", 0) or 0
        try:
            self.session.close()
            _check_nothing_left(self.session, self.device)
        finally:
            for r in self.session.reservations():  # only reached when close() failed
                r.released = True


def _check_nothing_left(session: Session, device: Device) -> None:
    acct = session.ledger.account(device)
    assert (acct.reserved, acct.resident, acct.reservations_alive, acct.pending_fences) == (0, 0, 0, 0)
    view = driver_view(session, device)
    if view is not None:
        assert (view.reserved, view.resident) == (0, 0)
    trim = getattr(session.backend, "trim", None)
    if trim is not None:
        trim(device)
    sim = _sim(session)
    if sim is not None:
        left = sim.state(device.index)
        assert (left["reservations"], left["handles"]) == (0, 0), f"leaked in the driver: {left}"


def test_random_verb_sequences_keep_the_ledger_equal_to_the_driver(membackend_target, membackend_examples):
    VerbSequences.target = membackend_target
    case = VerbSequences.TestCase
    case.settings = settings(max_examples=membackend_examples, stateful_step_count=25, deadline=None,
                             suppress_health_check=list(HealthCheck))
    case("runTest").runTest()
