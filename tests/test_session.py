"""Session binding: direct calls without observers, pluggy wrappers with them; the tracer."""

from __future__ import annotations

import json

import pytest

from membackend import hookimpl
from membackend._backends.host import HostBackend
from membackend._machine import gather_machine
from membackend._manager import BackendManager
from membackend._session import Session
from membackend._settings import load_settings
from membackend._trace import TraceObserver
from membackend.types import Device, DriverError, DriverState, Fault, PartialFailure, PluginError, Reservation

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
    assert s._fault == backend.membackend_fault and s._free == backend.membackend_free


def test_observers_wrap_only_the_verbs_they_implement():
    backend = HostBackend()
    counter = Counter()
    s = Session(backend, machine=gather_machine(), observers=[counter])
    assert s._fault != backend.membackend_fault and s._free == backend.membackend_free
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


def test_headroom_setting_replaces_the_backends_own():
    session = BackendManager(load_settings(headroom="1GiB")).session()
    b = session.budget_query("cpu")
    assert b.headroom == 1 << 30 and b.usable == max(0, b.free - (1 << 30))


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
    assert s.observers == [] and s._fault == backend.membackend_fault
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
    s = Session(HostBackend(), machine=gather_machine())
    s.reserve("cpu", 2 * MiB)
    assert s.trim() == 0 and s.inspect("cpu") is None
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


def test_the_tracer_is_exposed_and_wraps_the_verbs(tmp_path):
    tracer = TraceObserver(tmp_path / "t.jsonl")
    s = Session(HostBackend(), machine=gather_machine(), tracer=tracer)
    assert s.tracer is tracer and s.observers == [tracer]
    r = s.reserve("cpu", 2 * MiB)
    s.close()
    events = [json.loads(x)["event"] for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert events[:2] == ["trace", "reserve"] and "release_reservation" in events
