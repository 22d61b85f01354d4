"""The session (``membackend._session``). Binding: direct calls without observers, pluggy wrappers with them;
the tracer. Then the defects found under stress (issue 7, section 4), each test of which failed before its
fix: records racing releases, foreign reservations, exception-safe reserve, G2 with failing tokens, typed and
precise input errors."""

from __future__ import annotations

import copy
import json
import pickle
import threading
from concurrent.futures import Future

import pytest

from membackend import hookimpl
from membackend._backends.host import HostBackend
from membackend._drivers.host import host_driver, is_mapped, resident_bytes
from membackend._fences import FutureToken
from membackend._ledger import Ledger
from membackend._machine import gather_machine
from membackend._manager import BackendManager
from membackend._session import MAX_RESERVATION, Session
from membackend._session.permits import RELEASED as _RELEASED
from membackend._settings import load_settings
from membackend._trace import TraceObserver
from membackend.types import (
    ConfigError,
    Device,
    DriverError,
    DriverState,
    Fault,
    ForeignReservation,
    InvalidSize,
    InvalidToken,
    OutOfRange,
    PartialFailure,
    PluginError,
    Reservation,
    ReservationReleased,
    WrongDevice,
)

MiB = 1 << 20


class Counter:
    """A third-party observer: counts fault calls and their results."""

    def __init__(self):
        self.seen = []

    @hookimpl(wrapper=True)
    def membackend_fault(self, reservation, offset, size):
        result = yield
        self.seen.append((offset, size, result.ok))
        return result


def test_without_observers_hot_verbs_are_the_backends_own_methods():
    backend = HostBackend()
    s = Session(backend, machine=gather_machine())
    assert s._parts.bound.fault == backend.membackend_fault and s._parts.bound.free == backend.membackend_free


def test_observers_wrap_only_the_verbs_they_implement():
    backend = HostBackend()
    counter = Counter()
    s = Session(backend, machine=gather_machine(), observers=[counter])
    assert s._parts.bound.fault != backend.membackend_fault and s._parts.bound.free == backend.membackend_free
    r = s.reserve("cpu", 4 * MiB)
    s.fault(r, 0, 3 * MiB)
    assert counter.seen == [(0, 3 * MiB, True)]
    assert s.ledger.resident(r) == 4 * MiB
    s.close()


def test_trace_file_gets_one_json_line_per_verb(tmp_path):
    path = tmp_path / "run.trace.jsonl"
    session = BackendManager(load_settings(trace=str(path))).session()
    r = session.reserve("cpu", 4 * MiB)
    session.fault(r, 0, 2 * MiB)
    session.free(r)
    session.budget_query("cpu")
    session.release_reservation(r)
    with pytest.raises(Exception):
        session.fault(r, 0, 1)  # rejected by the session before any verb runs: not traced
    header, *lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert header == {**header, "event": "trace", "format": "membackend-trace", "version": 1}
    assert [x["event"] for x in lines] == ["reserve", "fault", "free", "budget_query", "release_reservation"]
    assert lines[1] == {**lines[1], "reservation": r.id, "device": "cpu:0", "offset": 0, "bytes": 2 * MiB,
                        "result": "ok"}
    assert lines[2]["result"] == 2 * MiB
    assert all({"time", "seconds"} <= set(x) for x in lines)


def test_trace_records_errors_by_type(tmp_path):
    tracer = TraceObserver(tmp_path / "t.jsonl")
    backend = HostBackend(capacity=2 * MiB)
    s = Session(backend, machine=gather_machine(), observers=[tracer])
    r = s.reserve("cpu", 8 * MiB)
    assert not s.fault(r, 0, 4 * MiB).ok
    s.close()
    events = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert events[2]["event"] == "fault" and events[2]["result"] == "oom"


def test_a_backend_breaking_the_reserve_contract_is_a_plugin_error():
    class Liar(HostBackend):
        @hookimpl
        def membackend_reserve(self, device, size):
            return Reservation(device, 0x1000, size // 2, 4096, self.name)

    s = Session(Liar(), machine=gather_machine())
    with pytest.raises(PluginError, match="broke the contract"):
        s.reserve(Device("cpu"), 1 << 20)
    assert s.ledger.alive() == 0 and s.reservations() == []


def test_a_backend_raising_an_untyped_error_surfaces_as_a_plugin_error():
    class Buggy(HostBackend):
        @hookimpl
        def membackend_fault(self, reservation, offset, size):
            raise KeyError("page table corrupted")

        @hookimpl
        def membackend_budget_query(self, device):
            raise RuntimeError("no meminfo")

    s = Session(Buggy(), machine=gather_machine())
    r = s.reserve("cpu", 2 * MiB)
    with pytest.raises(PluginError, match="raised KeyError in fault: 'page table corrupted'"):
        s.fault(r, 0, MiB)
    with pytest.raises(PluginError, match="raised RuntimeError in budget_query"):
        s.budget_query("cpu")
    assert s.ledger.resident(r) == 0
    s.close()


# --------------------------------------------------------------------------- the headroom: one owner, one precedence

CPU = Device("cpu", 0)
GiB = 1 << 30
FLAGS = "comfyui --reserve-vram/--vram-headroom"


def test_headroom_setting_replaces_the_backends_own():
    session = BackendManager(load_settings(headroom="1GiB")).session()
    b = session.budget_query("cpu")
    assert b.headroom == 1 << 30 and b.usable == max(0, b.free - (1 << 30))
    assert session.headroom_in_force("cpu") == (1 << 30, "start-up setting headroom (from kwargs)")
    session.close()


def test_each_source_of_the_headroom_wins_over_the_next_and_is_named():
    s = Session(HostBackend(), machine=gather_machine(), headroom=256 * MiB, headroom_source="env MEMBACKEND_HEADROOM")
    s.set_headroom(CPU, 64 * MiB, source="live")  # set before the flags: the order of the calls does not matter
    s.set_headroom(CPU, 128 * MiB, source=FLAGS)
    in_order = [(64 * MiB, "live"), (128 * MiB, FLAGS),
                (256 * MiB, "start-up setting headroom (from env MEMBACKEND_HEADROOM)")]
    for room, source in in_order:
        assert s.headroom_in_force(CPU) == (room, source)
        b = s.budget_query(CPU)
        assert b.headroom == room and b.usable == max(0, b.free - room)
        s.set_headroom(CPU, None, source=source)  # that source gives its value up: the next one applies
    own = Session(HostBackend(), machine=gather_machine())
    assert own.headroom_in_force(CPU) == (512 * MiB, "backend host's own rule (512.0 MiB)")
    assert own.budget_query(CPU).headroom == 512 * MiB

    class Plain(HostBackend):  # a backend with no own_headroom: what its budget says is the last word
        own_headroom = None

    assert Session(Plain(headroom=32 * MiB), machine=gather_machine()).headroom_in_force(CPU) == (
        32 * MiB, "backend host's own rule (the headroom its budget reports)")


def test_a_platform_s_rule_is_the_level_below_the_setting():
    s = BackendManager(load_settings(sim_profile="h200", backend="vmm")).session()
    try:
        assert s.headroom_in_force("cuda:0") == (256 * MiB, "platform vmm's own rule (256.0 MiB)")
        s.set_headroom("cuda:0", GiB, source=FLAGS)
        assert s.budget_query("cuda:0").headroom == GiB == s.backend.membackend_budget_query(Device("cuda", 0)).headroom
    finally:
        s.close()


def test_a_backend_that_decides_on_the_headroom_uses_the_session_s():
    """The VMM backend refuses a fault past a unified pool before the driver is asked: with the headroom in
    force, whichever source set it, not a headroom of its own."""
    from membackend._backends.vmm import VmmBackend
    from membackend._drivers.sim import sim_driver
    from membackend.platform import Platform
    from membackend.types import Candidate, Capabilities

    pool = Platform(name="pool", vendor="cuda", probe=lambda m: Candidate("pool", 60, "-"), budget_source="unified",
                    capabilities=Capabilities(unified_pool=True), page_size=32 * MiB, headroom=GiB)
    s = Session(VmmBackend(pool, sim_driver("gb10-128gb")), machine=gather_machine())
    try:
        cuda0 = Device("cuda", 0)
        total = s.budget_query(cuda0).total
        r = s.reserve(cuda0, 40 * GiB)
        s.set_headroom(cuda0, total - 20 * GiB, source="live")
        assert not s.fault(r, 0, 40 * GiB).ok  # 20 GiB left above the headroom: refused up front
        assert s.backend.membackend_budget_query(cuda0).headroom == total - 20 * GiB
        s.set_headroom(cuda0, None, source="live")
        assert s.fault(r, 0, 40 * GiB).ok
    finally:
        s.close()


def test_a_session_that_fails_to_build_leaves_the_backend_following_the_last_one():
    from membackend._backends.vmm import VmmBackend
    from membackend._drivers.sim import sim_driver

    backend = VmmBackend(driver=sim_driver("h200"))
    first = Session(backend, machine=gather_machine(), headroom=GiB)

    class Answers:  # a plain hookimpl could answer in the backend's place: the session refuses it
        @hookimpl
        def membackend_fault(self, reservation, offset, size):
            return None

    with pytest.raises(PluginError):
        Session(backend, machine=gather_machine(), headroom=2 * GiB, observers=[Answers()])
    assert backend.membackend_budget_query(Device("cuda", 0)).headroom == GiB == first.budget_query("cuda:0").headroom


def test_two_sessions_on_one_backend_each_report_their_own_headroom():
    from membackend._backends.vmm import VmmBackend
    from membackend._drivers.sim import sim_driver

    backend = VmmBackend(driver=sim_driver("h200"))
    first = Session(backend, machine=gather_machine(), headroom=GiB)
    second = Session(backend, machine=gather_machine())  # the backend follows the latest session built on it
    assert first.budget_query("cuda:0").headroom == GiB and second.budget_query("cuda:0").headroom == 256 * MiB
    second.set_headroom("cuda:0", 2 * GiB, source="live")
    assert first.budget_query("cuda:0").headroom == GiB and second.budget_query("cuda:0").headroom == 2 * GiB


@pytest.mark.parametrize("bad, match", [(-1, "outside 0 to"), ("total+1", "outside 0 to"), (1.5, "integer number"),
                                        (True, "integer number"), ("1GiB", "integer number")])
def test_set_headroom_refuses_what_is_not_a_byte_count_within_the_device(bad, match):
    s = Session(HostBackend(), machine=gather_machine())
    total = s.budget_query(CPU).total
    before = s.headroom_in_force(CPU)
    with pytest.raises(InvalidSize, match=match) as info:
        s.set_headroom(CPU, total + 1 if bad == "total+1" else bad, source="live")
    assert f"accepted: an int from 0 to {total}" in str(info.value)
    assert s.headroom_in_force(CPU) == before  # nothing changed
    s.set_headroom(CPU, total, source="live")  # the device's total itself is accepted: nothing usable
    assert s.budget_query(CPU).usable == 0


@pytest.mark.parametrize("source", ["", "  ", 3, None])
def test_set_headroom_refuses_a_source_that_names_nothing(source):
    s = Session(HostBackend(), machine=gather_machine())
    with pytest.raises(ConfigError, match="names no source") as info:
        s.set_headroom(CPU, MiB, source=source)
    assert "'live'" in info.value.accepted


def test_the_headroom_setting_itself_must_be_a_byte_count():
    with pytest.raises(InvalidSize, match="the headroom setting"):
        Session(HostBackend(), machine=gather_machine(), headroom=-1)


def test_concurrent_set_headroom_keeps_one_value_per_source_and_budgets_see_only_values_set():
    s = Session(HostBackend(), machine=gather_machine(), headroom=8 * MiB, headroom_source="kwargs")
    live = {(k + 1) * MiB for k in range(0, 400, 2)}
    flags = {(k + 1) * MiB for k in range(1, 400, 2)}
    barrier = threading.Barrier(6)
    seen: list[tuple[int, str]] = []
    errors: list[BaseException] = []

    def setter(values, source):
        barrier.wait()
        try:
            for v in sorted(values):
                s.set_headroom(CPU, v, source=source)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def reader():
        barrier.wait()
        try:
            for _ in range(300):
                seen.append(s.headroom_in_force(CPU))
                seen.append((s.budget_query(CPU).headroom, "budget"))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=setter, args=(set(sorted(live)[i::2]), "live")) for i in range(2)]
    threads += [threading.Thread(target=setter, args=(set(sorted(flags)[i::2]), FLAGS)) for i in range(2)]
    threads += [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for room, source in seen:  # every answer is a value some caller set, under that caller's source
        assert room in {"live": live, FLAGS: flags, "budget": live | flags | {8 * MiB}}.get(
            source, {8 * MiB}), (room, source)
        assert source in ("live", FLAGS, "budget", "start-up setting headroom (from kwargs)")
    room, source = s.headroom_in_force(CPU)
    assert source == "live" and room in {max(sorted(live)[0::2]), max(sorted(live)[1::2])}
    s.set_headroom(CPU, None, source="live")
    room, source = s.headroom_in_force(CPU)
    assert source == FLAGS and room in {max(sorted(flags)[0::2]), max(sorted(flags)[1::2])}
    s.set_headroom(CPU, None, source=FLAGS)
    assert s.headroom_in_force(CPU) == (8 * MiB, "start-up setting headroom (from kwargs)")


# --------------------------------------------------------------------------- observers only wrap


class Hijacker:
    """A plain observer hookimpl: pluggy would let its result replace the backend's fault."""

    @hookimpl
    def membackend_fault(self, reservation, offset, size):
        return Fault(True, (0,), 0, 0)


def test_an_observer_with_a_plain_hookimpl_is_refused():
    with pytest.raises(PluginError, match="observer Hijacker .* membackend_fault as a plain hookimpl"):
        Session(HostBackend(), machine=gather_machine(), observers=[Hijacker()])


def test_add_observer_refuses_a_plain_hookimpl_and_changes_nothing():
    backend = HostBackend()
    s = Session(backend, machine=gather_machine())
    with pytest.raises(PluginError, match="Hijacker"):
        s.add_observer(Hijacker())
    assert s.observers == [] and s._parts.bound.fault == backend.membackend_fault
    r = s.reserve("cpu", 2 * MiB)
    assert s.fault(r, 0, MiB).mapped == 2 * MiB  # the backend answered
    s.close()


def test_old_style_hookwrappers_are_accepted():
    class Old:
        @hookimpl(hookwrapper=True)
        def membackend_fault(self, reservation, offset, size):
            yield

    s = Session(HostBackend(), machine=gather_machine(), observers=[Old()])
    r = s.reserve("cpu", 2 * MiB)
    assert s.fault(r, 0, MiB).ok
    s.close()


# --------------------------------------------------------------------------- trim, inspect, close, tracer


class Keeper(HostBackend):
    """A host backend with the optional hooks: it 'keeps' bytes per device until trimmed."""

    def __init__(self, fail_release_of: set | None = None):
        super().__init__(page_size=2 * MiB)
        self.kept = 3 * MiB
        self.trims = 0
        self.fail_release_of = fail_release_of or set()

    @hookimpl
    def membackend_trim(self, device):
        self.trims += 1
        given, self.kept = self.kept, 0
        return given

    @hookimpl
    def membackend_inspect(self, device):
        return DriverState(reserved=0, resident=self.resident, held=self.kept, source="test")

    @hookimpl
    def membackend_release_reservation(self, reservation):
        if reservation.id in self.fail_release_of:
            raise DriverError(5, "munmap", "injected")
        return super().membackend_release_reservation(reservation)


def test_trim_calls_the_optional_hook_for_each_device_served():
    backend = Keeper()
    s = Session(backend, machine=gather_machine())
    assert s.trim() == 0 and backend.trims == 0  # nothing served yet
    s.reserve("cpu", 2 * MiB)
    assert s.trim() == 3 * MiB and s.trim("cpu") == 0 and backend.trims == 2
    assert s.inspect("cpu") == DriverState(0, 0, 0, "test")
    s.close()


def test_without_the_optional_hooks_trim_is_zero_and_inspect_none():
    from membackend_example import ExampleBackend  # the documented third-party example: the six verbs only

    s = Session(ExampleBackend(), machine=gather_machine())
    s.reserve("cpu", 2 * MiB)
    assert s.trim() == 0 and s.inspect("cpu") is None
    s.close()


def test_the_host_backend_inspects_the_kernel():
    s = Session(HostBackend(), machine=gather_machine())
    r = s.reserve("cpu", 4 * MiB)
    assert s.inspect("cpu").resident == 0 and s.inspect("cpu").reserved == 4 * MiB
    assert s.fault(r, 0, 2 * MiB).ok
    state = s.inspect("cpu")
    assert (state.reserved, state.resident) == (4 * MiB, 2 * MiB) and "mincore" in state.source
    s.release_reservation(r)
    assert s.inspect("cpu").reserved == 0
    s.close()


def test_close_carries_on_past_failures_then_trims_and_names_each():
    backend = Keeper()
    s = Session(backend, machine=gather_machine())
    rs = [s.reserve("cpu", 2 * MiB) for _ in range(4)]
    backend.fail_release_of = {rs[0].id, rs[2].id}
    with pytest.raises(PartialFailure, match=f"(?s)close: 2 failure.*#{rs[0].id}.*#{rs[2].id}") as info:
        s.close()
    assert len(info.value.failures) == 2 and all(isinstance(e, DriverError) for _, e in info.value.failures)
    assert rs[1].released and rs[3].released and not rs[0].released
    assert backend.trims == 1 and backend.kept == 0  # trimmed although releases failed
    backend.fail_release_of = set()
    assert s.close() == 2 and s.ledger.account(Device("cpu")).reserved == 0


def test_close_reports_a_failed_copy_never_fenced_and_still_releases_its_reservation():
    """A copy that failed after the last fence is reported by close, and does not keep the range alive (G1)."""
    s = Session(HostBackend(), machine=gather_machine())
    failed, fine = s.reserve("cpu", 2 * MiB), s.reserve("cpu", 2 * MiB)
    broken: Future = Future()
    broken.set_exception(OSError("copy failed"))
    s.record(failed, broken)
    with pytest.raises(PartialFailure, match=rf"(?s)close: 1 failure.*fence\(#{failed.id} on cpu:0\).*copy failed"):
        s.close()
    assert failed.released and fine.released and s.reservations() == []
    account = s.ledger.account(Device("cpu"))
    assert (account.reserved, account.reservations_alive, account.pending_fences) == (0, 0, 0)
    assert s.close() == 0  # reported once


def test_the_tracer_is_exposed_and_wraps_the_verbs(tmp_path):
    tracer = TraceObserver(tmp_path / "t.jsonl")
    s = Session(HostBackend(), machine=gather_machine(), tracer=tracer)
    assert s.tracer is tracer and s.observers == [tracer]
    s.reserve("cpu", 2 * MiB)
    s.close()
    events = [json.loads(x)["event"] for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert events[:2] == ["trace", "reserve"] and "release_reservation" in events


def test_record_takes_a_concurrent_futures_future_and_the_free_waits_for_it():
    """A copy thread's ``executor.submit(...)`` is recorded as it is: the free after it waits for the copy
    (G2), and a copy that raised makes that fence raise once, then counts as finished (G1)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    s = Session(HostBackend(), machine=gather_machine())
    r = s.reserve("cpu", 2 * MiB)
    assert s.fault(r, 0, 2 * MiB).ok
    order, go = [], threading.Event()
    timer = threading.Timer(0.05, go.set)  # the copy finishes on its own, later than a free that did not wait
    with ThreadPoolExecutor(1) as copies:
        def copy():
            go.wait(30)
            order.append("copy finished")
        future = copies.submit(copy)
        timer.start()
        s.record(r, future)
        assert s.free(r) == 2 * MiB
        order.append("free returned")
        assert order == ["copy finished", "free returned"] and future.done()

        assert s.fault(r, 0, 2 * MiB).ok
        s.record(r, copies.submit(lambda: 1 // 0))
        with pytest.raises(DriverError, match=r"fence token wait.*ZeroDivisionError|ZeroDivisionError.*fence token"):
            s.free(r)
        assert s.ledger.account(Device("cpu")).resident == 2 * MiB  # nothing was freed past the failed copy
        assert s.free(r) == 2 * MiB  # reported once; the failed copy no longer holds the range
    timer.join()
    s.close()


# =========================================================================== defects found under stress
# (issue 7, section 4): each test below failed before its fix (the ledger's own are in test_ledger.py)

PAGE = 2 * MiB
CPU = Device("cpu", 0)


def plain_host_session(backend: HostBackend | None = None, sanitize: bool = False) -> Session:
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
    s = plain_host_session()
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


# --------------------------------------------------------------------------- 4.4: foreign reservations


@pytest.mark.parametrize("verb", ["fault", "free", "release_reservation", "record", "fence"])
def test_a_reservation_of_another_session_of_the_same_backend_is_refused(verb):
    backend = HostBackend(page_size=PAGE)
    mine, theirs = plain_host_session(backend), plain_host_session(backend)
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


@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
@pytest.mark.parametrize("verb", ["fault", "free"])
def test_a_copy_of_a_live_reservation_is_alive_in_no_session(how, verb):
    # the hot verbs find a reservation's session on the object itself (Reservation._seat): a copy must not
    s = plain_host_session(HostBackend(page_size=PAGE))
    r = s.reserve(CPU, 8 * MiB)
    s.fault(r, 0, 4 * MiB)
    twin = {"copy": copy.copy, "deepcopy": copy.deepcopy,
            "pickle": lambda x: pickle.loads(pickle.dumps(x))}[how](r)
    assert twin is not r and twin.id == r.id and twin._seat is None and r._seat is not None
    args = (twin, 0, 4 * MiB) if verb == "fault" else (twin,)
    with pytest.raises(ForeignReservation, match=f"#{r.id} .*another session"):
        getattr(s, verb)(*args)
    assert s.ledger.account(CPU).resident == 4 * MiB and s.free(r) == 4 * MiB  # the original is untouched
    s.close()
    assert r._seat is None  # released: alive in no session
    with pytest.raises(ReservationReleased):
        s.fault(r, 0, PAGE)


def test_a_backend_handing_out_a_live_reservation_again_is_a_plugin_error_and_the_live_one_stays():
    class Repeater(HostBackend):
        first = None

        @hookimpl
        def membackend_reserve(self, device, size):
            if self.first is None:
                self.first = super().membackend_reserve(device, size)
            return self.first

    s = plain_host_session(Repeater(page_size=PAGE))
    r = s.reserve(CPU, 8 * MiB)
    s.fault(r, 0, 4 * MiB)
    with pytest.raises(PluginError, match=f"returned reservation #{r.id}, which is alive already"):
        s.reserve(CPU, 8 * MiB)
    assert s.reservations() == [r] and not r.released and s.free(r) == 4 * MiB  # not given back
    s.close()


# --------------------------------------------------------------------------- 4.5: reserve is exception-safe


@pytest.mark.parametrize("size", [MAX_RESERVATION + 1, 2**63, 2**64, 2**64 + PAGE])
def test_a_size_no_address_space_holds_is_refused_before_the_backend_sees_it(size):
    driver = CountingDriver()
    s = plain_host_session(HostBackend(page_size=PAGE, driver=driver))
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
    s = plain_host_session(Liar(page_size=PAGE, driver=driver))
    with pytest.raises(PluginError, match="broke the contract"):
        s.reserve(CPU, 8 * MiB)
    assert driver.reserved == set() and s.ledger.alive() == 0 and s.reservations() == []


def test_a_failure_after_the_backend_reserved_gives_the_range_back(monkeypatch):
    driver = CountingDriver()
    s = plain_host_session(HostBackend(page_size=PAGE, driver=driver))

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
    s = plain_host_session(sanitize=sanitize)
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
    s = plain_host_session()
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
    s = plain_host_session()
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


# --------------------------------------------------------------------------- 4.13: typed, precise input errors


@pytest.fixture
def session_and_reservation():
    s = plain_host_session()
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


# --------------------------------------------------------------------------- the permits (the reservations' mutexes)


def test_a_permit_excludes_every_other_holder_under_contention():
    """Eight threads each add to a total 3,000 times through a read, a switch of threads and a write: only
    mutual exclusion keeps every addition. Half take the permit inlined (as the hot verbs do), half through
    ``held``, and the switch interval is as short as it goes, so waits and wake-ups happen thousands of times."""
    import sys

    from membackend._session import _Permits

    permits, permit, total = _Permits(), [True], [0]

    def inlined() -> None:
        for _ in range(3000):
            try:
                permit.pop()
            except IndexError:
                permits.wait(permit)
            try:
                seen = total[0]
                threading.Event().wait(0) if seen % 7 == 0 else None  # let another thread in, holding it
                total[0] = seen + 1
            finally:
                permit.append(True)
                if permits.waiting:
                    permits.wake()

    def with_block() -> None:
        for _ in range(3000):
            with permits.held(permit):
                seen = total[0]
                threading.Event().wait(0) if seen % 5 == 0 else None
                total[0] = seen + 1

    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=inlined if i % 2 else with_block) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        sys.setswitchinterval(before)
    assert not any(t.is_alive() for t in threads)
    assert total[0] == 8 * 3000
    assert permit == [True] and permits.waiting == {}  # given back, nobody left counted as waiting


def test_a_thread_waiting_for_a_permit_is_woken_by_its_release():
    from membackend._session import _Permits

    permits, permit = _Permits(), [True]
    permit.pop()  # held by this thread
    got = threading.Event()

    def waiter() -> None:
        permits.wait(permit)
        got.set()

    t = threading.Thread(target=waiter)
    t.start()
    while not permits.waiting:  # the waiter counted itself and sleeps on the condition
        threading.Event().wait(0.001)
    assert not got.wait(0.05)
    permit.append(True)
    if permits.waiting:
        permits.wake()
    assert got.wait(10)
    t.join(10)
    assert permit == [] and permits.waiting == {}  # the waiter holds it now


class Overlap(HostBackend):
    """A backend that notes when two verbs run on one reservation at the same time (the session must never
    let that happen: a backend is only safe for concurrent calls on different reservations)."""

    def __init__(self):
        super().__init__(page_size=64 * 1024)
        self.inside: dict[int, int] = {}
        self.overlaps = 0

    def _enter(self, r):
        self.inside[r.id] = self.inside.get(r.id, 0) + 1
        if self.inside[r.id] > 1:
            self.overlaps += 1
        threading.Event().wait(0)  # give another thread the chance to come in

    @hookimpl
    def membackend_fault(self, reservation, offset, size):
        self._enter(reservation)
        try:
            return super().membackend_fault(reservation, offset, size)
        finally:
            self.inside[reservation.id] -= 1

    @hookimpl
    def membackend_free(self, reservation, offset, size):
        self._enter(reservation)
        try:
            return super().membackend_free(reservation, offset, size)
        finally:
            self.inside[reservation.id] -= 1


def test_verbs_on_one_reservation_never_overlap_in_the_backend_under_contention():
    import sys

    backend = Overlap()
    s = Session(backend, machine=gather_machine())
    r = s.reserve("cpu", 1 * MiB)
    page = 64 * 1024
    errors: list[BaseException] = []

    def churn(i: int) -> None:
        try:
            for n in range(400):
                off = ((i + n) % 16) * page
                assert s.fault(r, off, page).ok
                s.free(r, off, page)
                with s._books.permits.held(s._books.live[r]):  # a third way in: what fence and release take
                    pass
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=churn, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        sys.setswitchinterval(before)
    assert errors == [] and not any(t.is_alive() for t in threads)
    assert backend.overlaps == 0
    assert s.ledger.resident(r) == backend.resident  # the ledger kept matching the backend
    s.close()


class Gate(HostBackend):
    """A host backend whose fault or release of a reservation blocks, holding its permit, until the test opens
    the gate."""

    def __init__(self):
        super().__init__(page_size=64 * 1024)
        self.inside, self.gate = threading.Event(), threading.Event()

    def _hold(self):
        self.inside.set()
        assert self.gate.wait(30)

    @hookimpl
    def membackend_fault(self, reservation, offset, size):
        self._hold()
        return super().membackend_fault(reservation, offset, size)

    @hookimpl
    def membackend_release_reservation(self, reservation):
        self._hold()
        return super().membackend_release_reservation(reservation)


@pytest.mark.parametrize("verb", ["fault", "free", "release_reservation"])
def test_a_verb_waiting_on_a_reservation_that_is_released_meanwhile_is_told_it_was_released(verb):
    # the release leaves RELEASED in the permit (Permits): whoever waited for the seat learns it there
    backend = Gate()
    s = Session(backend, machine=gather_machine())
    r = s.reserve("cpu", 1 * MiB)
    seat = r._seat
    releaser = threading.Thread(target=s.release_reservation, args=(r,))
    releaser.start()
    assert backend.inside.wait(30)  # the release is in the backend, the permit taken
    outcome: list[BaseException | object] = []

    def waiter() -> None:
        try:
            outcome.append(getattr(s, verb)(r, 0, 64 * 1024) if verb != "release_reservation" else
                           s.release_reservation(r))
        except BaseException as exc:  # noqa: BLE001 - checked below
            outcome.append(exc)

    w = threading.Thread(target=waiter)
    w.start()
    while not s._books.permits.waiting:  # the waiter took the seat and sleeps on the permit
        threading.Event().wait(0.001)
    backend.gate.set()
    releaser.join(30)
    w.join(30)
    assert r.released and r._seat is None and s.reservations() == []
    assert len(outcome) == 1 and isinstance(outcome[0], ReservationReleased), outcome
    assert seat == [_RELEASED] and s._books.permits.waiting == {}  # put back for the next; nobody left waiting
    s.close()


def test_another_sessions_reservation_held_by_its_owner_is_refused_once_free_and_left_as_it_was():
    backend = Gate()
    mine, theirs = Session(HostBackend(page_size=64 * 1024), machine=gather_machine()), \
        Session(backend, machine=gather_machine())
    r = theirs.reserve("cpu", 1 * MiB)
    holder = threading.Thread(target=theirs.fault, args=(r, 0, 64 * 1024))
    holder.start()
    assert backend.inside.wait(30)
    refused: list[BaseException] = []

    def stranger() -> None:
        try:
            mine.fault(r, 0, 64 * 1024)
        except BaseException as exc:  # noqa: BLE001 - checked below
            refused.append(exc)

    t = threading.Thread(target=stranger)
    t.start()
    while not mine._books.permits.waiting:
        threading.Event().wait(0.001)
    backend.gate.set()
    holder.join(30)
    t.join(30)
    assert not t.is_alive() and len(refused) == 1 and isinstance(refused[0], ForeignReservation), refused
    assert theirs.free(r) == 64 * 1024 and r._seat == [theirs._books.owner]  # the owner's, free again
    mine.close()
    theirs.close()


def test_a_free_of_a_reservation_with_nothing_resident_skips_the_backend_but_not_the_fence():
    calls = []

    class Counting(HostBackend):
        @hookimpl
        def membackend_free(self, reservation, offset, size):
            calls.append((offset, size))
            return super().membackend_free(reservation, offset, size)

    s = Session(Counting(page_size=2 * MiB), machine=gather_machine())
    r = s.reserve("cpu", 8 * MiB)
    waited = []

    class Token:
        def done(self):
            return bool(waited)

        def wait(self):
            waited.append(True)

    s.record(r, Token())
    assert s.free(r, 2 * MiB, 2 * MiB) == 0
    assert waited == [True] and calls == []  # fenced first (G2); nothing resident: the backend was not asked
    with pytest.raises(OutOfRange):
        s.free(r, 0, 9 * MiB)  # the checks are the same
    s.fault(r, 0, 2 * MiB)
    assert s.free(r, 0, 4 * MiB) == 2 * MiB and calls == [(0, 4 * MiB)]  # something resident: the backend frees
    assert s.free(r) == 0 and calls == [(0, 4 * MiB)]
    s.close()
