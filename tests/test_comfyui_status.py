"""The adapter's routes and the live VRAM cap: ``GET /membackend/status``, ``POST /membackend/headroom``
(validated like the settings, typed errors with the accepted range), the headroom changed under load
(threads faulting and unpinning) with nothing pinned freed and the ledger equal to the simulated driver
afterwards, and one line per load that says why (kept / reloaded after an eviction / cold)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import threading
import time
import types

import pytest

from membackend._comfyui import history
from membackend._comfyui import runtime as adapter
from membackend._comfyui import status as routes
from membackend._comfyui.headroom import LIVE_SOURCE
from membackend._comfyui.runtime import Runtime, describe_load
from membackend._drivers.open import machine_for
from membackend._manager import BackendManager
from membackend._settings import SIZE_ACCEPTED, load_settings
from membackend.types import format_size

MiB = 1 << 20
GiB = 1 << 30
PS = 2 * MiB  # the vmm backend's page on the simulated H200


@contextlib.contextmanager
def _running(**settings):
    """A running adapter on a simulated machine (``settings``: load_settings's), no ComfyUI patches."""
    settings = load_settings(**settings)
    mgr = BackendManager(settings)
    machine = machine_for(settings)
    runtime = Runtime(mgr, machine, mgr.select(machine), wire=lambda rt: None)
    runtime.start([(0, 0)])
    runtime.started = True
    adapter.decided("armed", "test", f"membackend test: using {runtime.selection.record.name}", runtime)
    try:
        yield runtime
    finally:
        runtime.stop()
        adapter.decided("stock", "test over", "", None)


@pytest.fixture
def rt():
    """A running adapter on the simulated H200 (vmm backend); 0 bytes of headroom set at start-up (as
    ``MEMBACKEND_HEADROOM=0``)."""
    with _running(sim_profile="h200", headroom=0) as runtime:
        yield runtime


def _paged(n, page):
    """``n`` bytes rounded up to whole pages: what faulting them loads."""
    return -(-n // page) * page


def _mb(n):
    return format_size(n)  # as the per-load lines write a size


def _model(rt, name, size):
    return rt.residency.register(name, size, rt.devices[0], "diffusion")


def _ledger_matches_driver(rt):
    d = rt.devices[0]
    acct, state = rt.session.ledger.account(d), rt.session.inspect(d)
    assert (acct.reserved, acct.resident) == (state.reserved, state.resident), (acct, state)
    stats = rt.residency.stats(d)
    assert sum(v["resident"] for v in stats.values()) == acct.resident, (stats, acct)


def _failing_start(monkeypatch, where):
    """A runtime on the simulated H200 whose start fails at ``where`` (a method of the runtime, or of one of its
    parts: ``headroom.apply_comfy_flags``)."""
    settings = load_settings(sim_profile="h200", headroom=0)
    mgr = BackendManager(settings)
    machine = machine_for(settings)
    runtime = Runtime(mgr, machine, mgr.select(machine), wire=lambda rt: None)

    def fail(*args, **kwargs):
        raise RuntimeError(f"{where} failed")
    part, _, name = where.rpartition(".")
    monkeypatch.setattr(getattr(runtime, part) if part else runtime, name, fail)
    return runtime


@pytest.mark.parametrize("where", ["headroom.apply_comfy_flags", "_wire"])
def test_the_status_of_a_start_that_failed_part_way_says_why_and_never_raises(monkeypatch, where):
    runtime = _failing_start(monkeypatch, where)
    assert runtime.init_devices([(0, 0)]) is False  # ComfyUI runs stock
    out = routes.runtime_status(runtime)
    assert out["state"] == "switched-off" and f"{where} failed" in out["reason"], out
    assert "budgets" not in out and "models" not in out  # the session of a failed start is closed: no figures
    runtime.stop()


def test_the_status_while_start_is_under_way_answers_without_figures(monkeypatch):
    runtime = _failing_start(monkeypatch, "headroom.apply_comfy_flags")
    with pytest.raises(RuntimeError):  # start itself, as init_devices calls it: the session is open, no policy yet
        runtime.start([(0, 0)])
    out = routes.runtime_status(runtime)
    assert out["state"] == "armed" and "budgets" not in out, out
    runtime._close_quietly()
    runtime.stop()


# ---------------------------------------------------------------------------------------------- the route


def test_headroom_route_changes_the_budget_and_says_where_it_came_from(rt):
    d = str(rt.devices[0])
    st = routes.status()
    assert st["headroom"][d]["bytes"] == 0 and "start-up setting" in st["headroom"][d]["source"]
    assert st["headroom"][d]["max"] == st["budgets"][d]["total"]
    code, answer = routes.change_headroom({"device": d, "headroom": "2GiB"})
    assert code == 200, answer
    assert answer["headroom"] == 2 << 30 and answer["source"] == LIVE_SOURCE and answer["previous"] == 0
    assert rt.session.budget_query(rt.devices[0]).headroom == 2 << 30  # the next budget query sees it
    st = routes.status()
    assert st["budgets"][d]["headroom"] == 2 << 30
    assert st["headroom"][d] == {**st["headroom"][d], "bytes": 2 << 30, "source": LIVE_SOURCE, "live": True}
    code, answer = routes.change_headroom({"headroom": 5 * 10**8})  # no device: the first served; bytes as int
    assert code == 200 and answer["headroom"] == 5 * 10**8
    code, answer = routes.change_headroom({"device": d, "headroom": None})  # back to the start-up value
    assert code == 200 and answer["headroom"] == 0 and "start-up setting" in answer["source"]
    assert rt.session.budget_query(rt.devices[0]).headroom == 0


@pytest.mark.parametrize("body,kind,says", [
    ({"headroom": -1}, "InvalidSize", "negative"),
    ({"headroom": "-1GiB"}, "InvalidSize", "-1GiB"),
    ({"headroom": "lots"}, "InvalidSize", "lots"),
    ({"headroom": True}, "InvalidSize", "boolean"),
    ({"headroom": float("nan")}, "InvalidSize", "not a number"),
    ({"headroom": [1]}, "InvalidSize", "[1]"),
    ({"headroom": "200TB"}, "InvalidSize", "above the total"),
    ({"device": "cuda:7", "headroom": "1GiB"}, "WrongDevice", "cuda:7"),
    ({"device": "gpu please", "headroom": "1GiB"}, "WrongDevice", "gpu please"),
    ({"device": "cuda:0"}, "ConfigError", "headroom"),
    ({"headroom": "1GiB", "extra": 1}, "ConfigError", "extra"),
    ("1GiB", "ConfigError", "JSON object"),
])
def test_bad_values_are_refused_with_the_accepted_range_and_change_nothing(rt, body, kind, says):
    d = rt.devices[0]
    before = rt.session.budget_query(d)
    code, answer = routes.change_headroom(body)
    assert code == 400, answer
    assert answer["error"] == kind and says in answer["message"], answer
    total = before.total
    assert f"from 0 to {total} bytes" in answer["accepted"] and SIZE_ACCEPTED in answer["accepted"], answer
    assert rt.session.budget_query(d).headroom == before.headroom
    assert "start-up setting" in rt.headroom.in_force(d)[1]


def test_a_saved_headroom_is_written_to_membackend_toml_and_read_at_the_next_start(rt, tmp_path, monkeypatch):
    config = tmp_path / "membackend.toml"
    config.write_text('# my settings\nsanitize = false\n\n[cuda_wddm]\nheadroom = "1GiB"\n')
    monkeypatch.setenv("MEMBACKEND_CONFIG", str(config))
    monkeypatch.delenv("MEMBACKEND_HEADROOM", raising=False)
    d = str(rt.devices[0])
    code, answer = routes.change_headroom({"device": d, "headroom": "1.5GiB", "save": True})
    assert code == 200, answer
    assert answer["headroom"] == 3 << 29 and answer["source"] == LIVE_SOURCE
    assert answer["saved"] == str(config.resolve()) and "note" not in answer
    text = config.read_text()
    assert text.startswith("# my settings\nsanitize = false\n") and '[cuda_wddm]\nheadroom = "1GiB"' in text
    assert load_settings().headroom == 3 << 29  # what the next start reads
    code, answer = routes.change_headroom({"device": d, "headroom": "2GiB", "save": True})  # replaced, not added
    assert code == 200 and config.read_text().count("\nheadroom =") == 2 and load_settings().headroom == 2 << 30
    monkeypatch.setenv("MEMBACKEND_HEADROOM", "0")
    code, answer = routes.change_headroom({"device": d, "headroom": "2GiB", "save": True})
    assert code == 200 and "MEMBACKEND_HEADROOM" in answer["note"]


def test_a_save_that_fails_puts_the_previous_headroom_back(rt, tmp_path, monkeypatch):
    monkeypatch.setenv("MEMBACKEND_CONFIG", str(tmp_path / "broken.toml"))
    (tmp_path / "broken.toml").write_text("this is = = not toml\n")
    d = rt.devices[0]
    before = rt.headroom.in_force(d)
    code, answer = routes.change_headroom({"device": str(d), "headroom": "1GiB", "save": True})
    assert code == 500 and answer["error"] == "ConfigError" and "broken.toml" in answer["message"], answer
    assert rt.headroom.in_force(d) == before and rt.session.budget_query(d).headroom == before[0]
    assert (tmp_path / "broken.toml").read_text() == "this is = = not toml\n"
    code, answer = routes.change_headroom({"device": str(d), "headroom": None, "save": True})
    assert code == 400 and answer["error"] == "ConfigError"  # nothing to save: refused before any change


def test_headroom_route_when_membackend_does_not_run():
    adapter.decided("stock", "ComfyUI's dynamic VRAM is off (--cpu)", "membackend x: ComfyUI runs stock", None)
    code, answer = routes.change_headroom({"headroom": "1GiB"})
    assert code == 409 and answer["error"] == "WrongDevice" and "--cpu" in answer["message"], answer
    st = routes.status()
    assert st["state"] == "stock" and st["line"] == "membackend x: ComfyUI runs stock" and st["how_to"]


def test_routes_register_on_the_server_and_answer_json(rt, monkeypatch):
    handlers = {}

    class Routes:
        def get(self, path):
            return lambda fn: handlers.setdefault(("GET", path), fn)

        def post(self, path):
            return lambda fn: handlers.setdefault(("POST", path), fn)

    def json_response(data, status=200, dumps=json.dumps):  # aiohttp.web.json_response's parameters used
        return types.SimpleNamespace(status=status, body=dumps(data))

    server = types.SimpleNamespace(PromptServer=types.SimpleNamespace(instance=types.SimpleNamespace(routes=Routes())),
                                   web=types.SimpleNamespace(json_response=json_response))
    monkeypatch.setitem(sys.modules, "server", server)
    assert routes.register_routes()

    class Request:
        def __init__(self, body):
            self.body = body

        async def json(self):
            if isinstance(self.body, Exception):
                raise self.body
            return self.body

    got = asyncio.run(handlers[("GET", routes.ROUTE)](Request(None)))
    assert got.status == 200 and json.loads(got.body)["state"] == "running"
    got = asyncio.run(handlers[("POST", routes.HEADROOM_ROUTE)](Request({"headroom": "1GB"})))
    assert got.status == 200 and json.loads(got.body)["headroom"] == 10**9
    got = asyncio.run(handlers[("POST", routes.HEADROOM_ROUTE)](Request(ValueError("Expecting value"))))
    assert got.status == 400 and json.loads(got.body)["error"] == "ConfigError"


def test_web_directory_holds_the_panel():
    from pathlib import Path

    js = Path(routes.web_directory()) / "membackend_panel.js"
    text = js.read_text(encoding="utf-8")
    assert Path(routes.web_directory()).is_absolute()
    assert "registerExtension" in text and "/membackend/status" in text and "/membackend/headroom" in text
    assert "http://" not in text.replace("http://www.w3.org/2000/svg", "")  # no network but this server


# ---------------------------------------------------------------------------------------------- the live cap


def test_lowering_the_free_room_evicts_idle_models_whole_never_a_pinned_page(rt):
    d = rt.devices[0]
    idle, busy = _model(rt, "idle", 32 * MiB), _model(rt, "busy", 32 * MiB)
    rt.residency.use([idle])
    assert rt.residency.fault(idle, 0, 32 * MiB, d).ok
    rt.residency.unpin(idle, 0, 32 * MiB, d)
    rt.residency.use([busy])
    assert rt.residency.fault(busy, 0, 32 * MiB, d).ok  # stays pinned: a layer in use now
    b = rt.session.budget_query(d)
    answer = rt.headroom.set_live(d, b.free + 40 * MiB)  # 40 MiB must go: all of idle, then busy's unpinned
    assert answer["freed"] == 32 * MiB, answer
    assert rt.residency.stats(d)["idle"]["resident"] == 0
    assert rt.residency.stats(d)["busy"]["resident"] == 32 * MiB  # pinned: never freed
    assert all(bit == 3 for bit in rt.residency.residency(busy, d))
    lost = routes.runtime_status(rt)["evictions"]["idle"]
    assert lost["bytes"] == 32 * MiB and "headroom raised" in lost["reason"] and lost["for"] == ["busy"]
    rt.residency.unpin(busy, 0, 32 * MiB, d)
    _ledger_matches_driver(rt)


def test_raising_and_lowering_the_cap_under_load_keeps_pins_and_the_ledger(rt):
    """Four threads fault and unpin layers of their own model while the main thread moves the headroom
    between "everything fits" and "almost nothing fits"; a pinned layer is never freed under its thread."""
    d = rt.devices[0]
    layer, layers = 4 * MiB, 6
    models = [_model(rt, f"m{i}", layer * layers) for i in range(4)]
    rt.residency.use(models)
    stop = threading.Event()
    problems: list[str] = []
    faults = [0] * len(models)
    attempts = [0] * len(models)  # faults asked, out of memory included

    def work(i, m):
        n = 0
        while not stop.is_set() and len(problems) < 5:
            off = (n % layers) * layer
            n += 1
            try:
                f = rt.residency.fault(m, off, layer, d)
                attempts[i] += 1
                if not f.ok:
                    continue  # out of memory under a tight cap: ComfyUI streams the layer
                faults[i] += 1
                # pinned now: every page of the layer stays resident and pinned until the unpin
                for _ in range(3):
                    bits = rt.residency.residency(m, d)[off // PS:(off + layer) // PS]
                    if any(b != 3 for b in bits):
                        problems.append(f"{m.id}: a pinned layer lost its pages: {bits}")
                rt.residency.unpin(m, off, layer, d)
            except Exception as exc:  # noqa: BLE001
                problems.append(f"{m.id}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=work, args=(i, m)) for i, m in enumerate(models)]
    for t in threads:
        t.start()
    total = rt.session.budget_query(d).total
    try:
        for step in range(40):
            # every thread faults between two changes, so each change meets layers being faulted and pinned
            # (a deadline only against a hang: how long it takes is not what is checked)
            seen, deadline = list(attempts), time.monotonic() + 120
            while any(a <= b for a, b in zip(attempts, seen)) and not problems:
                assert time.monotonic() < deadline, f"a faulting thread made no progress: {attempts}"
                time.sleep(0.001)
            tight = step % 2 == 0
            value = total - 3 * layer if tight else 0  # room for ~3 layers of 4 threads: eviction under pins
            answer = rt.headroom.set_live(d, value)
            assert answer["headroom"] == value
            assert rt.session.budget_query(d).headroom == value
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert not problems, problems
    assert all(faults), faults  # every thread got layers in
    assert not any(any(b & 2 for b in rt.residency.residency(m, d)) for m in models)  # every pin went
    _ledger_matches_driver(rt)
    rt.headroom.set_live(d, None)
    assert rt.session.budget_query(d).headroom == 0


def test_a_failed_shed_puts_the_previous_headroom_back(rt, monkeypatch):
    from membackend.types import PartialFailure

    d = rt.devices[0]
    m = _model(rt, "m", 8 * MiB)
    rt.residency.use([m])
    assert rt.residency.fault(m, 0, 8 * MiB, d).ok
    rt.residency.unpin(m, 0, 8 * MiB, d)

    def broken(*a, **k):
        raise PartialFailure("keep_warm", [("model 'm'", OSError("driver said no"))])

    monkeypatch.setattr(rt.residency, "keep_warm", broken)
    total = rt.session.budget_query(d).total
    code, answer = routes.change_headroom({"headroom": total})
    assert code == 500 and answer["error"] == "PartialFailure", answer
    assert rt.session.budget_query(d).headroom == 0 and "start-up setting" in rt.headroom.in_force(d)[1]


# ---------------------------------------------------------------------------------------------- per-load lines


def test_one_line_per_load_says_kept_reloaded_or_cold(rt, caplog):
    d = rt.devices[0]
    unet, vae = _model(rt, "unet", 16 * MiB), _model(rt, "vae", 16 * MiB)
    rt.names.update(unet="SDXL", vae="AutoencoderKL")

    def run(model):
        rt.residency.use([model])
        for off in range(0, model.size, 4 * MiB):
            assert rt.residency.fault(model, off, 4 * MiB, d).ok
            rt.residency.unpin(model, off, 4 * MiB, d)
        rt.quiescent()  # the node is done: its loads are closed

    with caplog.at_level(logging.INFO, logger="membackend"):
        run(unet)
        run(unet)
        # the VAE needs the room: the headroom leaves space for it alone, so the UNet is evicted for it
        rt.headroom.set_live(d, rt.session.budget_query(d).free - 8 * MiB)
        run(vae)
        rt.headroom.set_live(d, None)
        run(unet)
    loads = routes.runtime_status(rt)["loads"]
    texts = [(x["name"], x["kind"], x["text"]) for x in loads]
    page = rt.session.reservations()[0].page_size
    assert texts[0] == ("SDXL", "cold", f"loaded {_mb(_paged(16 * MiB, page))} (cold)"), texts
    assert texts[1][:2] == ("SDXL", "kept") and texts[1][2].startswith("kept: 0 bytes loaded"), texts
    assert texts[2][:2] == ("AutoencoderKL", "cold"), texts
    name, kind, text = texts[3]
    assert (name, kind) == ("SDXL", "reloaded") and text.startswith(f"reloaded {_mb(_paged(16 * MiB, page))}: ") \
        and " at " in text, texts
    assert "evicted at " in text and text.endswith("for AutoencoderKL (to keep the headroom free)"), text
    lines = [r.getMessage() for r in caplog.records if "load of " in r.getMessage()]
    assert len(lines) == 4 and f"load of SDXL (16.0 MiB): reloaded {_mb(_paged(16 * MiB, page))}" in lines[3], lines
    assert routes.runtime_status(rt)["load_count"] == 4


def test_load_records_reach_the_trace(tmp_path):
    from membackend._residency import ResidencyManager
    from membackend._session import Session
    from membackend._trace import TraceObserver

    settings = load_settings(sim_profile="h200", headroom=0)
    mgr = BackendManager(settings)
    machine = machine_for(settings)
    base = mgr.session(machine, selection=mgr.select(machine))
    tracer = TraceObserver(tmp_path / "t.jsonl")
    session = Session(base.backend, machine=base.machine, ledger=base.ledger, tracer=tracer)
    policy = ResidencyManager(session)
    d = session.devices()[0]
    m = policy.register("m", 8 * MiB, d, "vae")
    for _ in range(2):
        policy.use([m])
        assert policy.fault(m, 0, 8 * MiB, d).ok
        policy.unpin(m, 0, 8 * MiB, d)
    policy.on_idle()
    session.close()
    tracer.close()
    loads = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    loads = [e for e in loads if e["event"] == "load"]
    page = session.reservations()[0].page_size if session.reservations() else 32 * MiB
    assert [(e["model"], e["kind"], e["loaded"]) for e in loads] == [("m", "cold", _paged(8 * MiB, page)),
                                                                        ("m", "kept", 0)]


def test_describe_load_words():
    lost = {"time": 0.0, "bytes": 3_200_000_000, "reason": "out of memory", "for": ["vae"]}
    assert describe_load({"kind": "kept", "loaded": 0, "resident_before": GiB}) == "kept: 0 bytes loaded " \
                                                                                   "(1.0 GiB resident)"
    said = describe_load({"kind": "reloaded", "loaded": 3 * GiB + GiB // 5, "lost": lost}, {"vae": "the VAE"}.get)
    assert said.startswith("reloaded 3.2 GiB: evicted at ") and said.endswith(" for the VAE (the device was out "
                                                                               "of memory)"), said
    assert describe_load({"kind": "cold", "loaded": 5 * GiB}) == "loaded 5.0 GiB (cold)"


def test_describe_load_says_nothing_loaded_and_streamed():
    assert describe_load({"kind": "kept", "loaded": 0, "resident_before": 0}) == \
        "nothing loaded: none of its layers ran"  # never loaded: not "kept"
    shed = describe_load({"kind": "cold", "loaded": 4 * GiB, "shed_during": GiB})
    assert shed.startswith("streamed: loaded 4.0 GiB (cold)") and "1.0 GiB of it shed again" in shed, shed
    more = describe_load({"kind": "cold", "loaded": 4 * GiB}, pages=2 * GiB)
    assert more.startswith("streamed: loaded 4.0 GiB (cold)") and "2.0 GiB of weights" in more, more
    assert describe_load({"kind": "cold", "loaded": 2 * GiB}, pages=2 * GiB) == "loaded 2.0 GiB (cold)"


@pytest.mark.parametrize("settings", [{"sim_profile": "h200"}, {"backend": "host", "page_size": 4 * MiB}])
def test_the_runtimes_page_size_is_the_page_the_backend_maps_on_the_device(settings):
    """The facade sizes a VBAR without a live reservation by it: the vmm backend's page on the device (its
    platform's page rounded up to the device's granularity: 32 MiB on the H200), not a 2 MiB default; the host
    backend's ``page_size`` setting."""
    with _running(headroom=0, **settings) as rt:
        d = rt.devices[0]
        r = rt.session.reserve(d, 1)
        try:
            assert rt.page_size(d) == rt.session.page_size(d) == r.page_size
            assert r.page_size == settings.get("page_size", 32 * MiB)
        finally:
            rt.session.release_reservation(r)


def test_a_models_size_is_its_weights_not_its_address_range(rt, caplog):
    """ComfyUI reserves ten times a model's size of address space; the status, the panel and the per-load line
    show the weights' bytes (what ComfyUI staged in the VBAR), and "warm" means those pages are resident."""
    from membackend._comfyui import vbar as facade

    d = rt.devices[0]
    v = facade.ModelVBAR(10 * 6 * MiB, 0)  # ComfyUI's model_size() * 10
    allocs = [v.alloc(3 * MiB), v.alloc(3 * MiB)]
    rt.names[v._model.id] = "UNet"
    rt.residency.use([v._model])
    for a in allocs:
        assert facade.vbar_fault(a) is not None
        facade.vbar_unpin(a)
    with caplog.at_level(logging.INFO, logger="membackend"):
        rt.quiescent()
    row = routes.runtime_status(rt)["models"][v._model.id]
    assert row["size"] == 6 * MiB and row["address_range"] == 60 * MiB, row
    assert row["state"] == "warm", row  # every page of the weights resident: not "partly resident"
    line = next(r.getMessage() for r in caplog.records if "load of UNet" in r.getMessage())
    assert f"load of UNet (6.0 MiB): loaded {_mb(_paged(6 * MiB, v._model.reservation(d).page_size))} (cold)" in line, line
    v.close()
    assert d in rt.devices


def test_a_models_pinned_and_evictable_bytes_are_its_pages_in_use_and_the_rest_resident(rt):
    from membackend._comfyui import vbar as facade

    v = facade.ModelVBAR(10 * 2 * 32 * MiB, 0)
    page = rt.page_size(rt.devices[0])
    first, second = v.alloc(page), v.alloc(page)  # one page each
    assert facade.vbar_fault(first) is not None and facade.vbar_fault(second) is not None
    facade.vbar_unpin(second)
    row = routes.runtime_status(rt)["models"][v._model.id]
    assert (row["pinned"], row["evictable"], row["resident"], row["state"]) == (page, page, 2 * page, "pinned"), row
    facade.vbar_unpin(first)
    row = routes.runtime_status(rt)["models"][v._model.id]
    assert (row["pinned"], row["evictable"], row["state"]) == (0, 2 * page, "warm"), row
    v.close()
    row = routes.runtime_status(rt)["models"].get(v._model.id)
    assert row is None, row  # a closed VBAR's model is retired: the status has no row for it


def test_unloading_everything_gives_back_what_the_backend_keeps(rt):
    from membackend._comfyui import vbar as facade

    v = facade.ModelVBAR(10 * 4 * MiB, 0)
    a = v.alloc(4 * MiB)
    assert facade.vbar_fault(a) is not None
    facade.vbar_unpin(a)
    rt.unload_vbar(v, "test")
    rt.give_back()
    st = routes.runtime_status(rt)
    assert st["reservations"] == [] and all(k["committed"] == 0 for k in st["kept"].values()), st["kept"]


def test_keep_warm_lets_go_of_models_comfyui_dropped():
    from membackend._comfyui.keepwarm import KeepWarm

    class Patcher:
        pass

    keep, a, b = KeepWarm(), Patcher(), Patcher()
    keep.ram_floor = 0  # no RAM pressure: nothing is given back on its own
    keep.hold([a, b])
    keep.release([a])  # ComfyUI unloaded it (POST /free, or its own choice of victim)
    assert list(keep.held.values()) == [b] and id(a) not in keep.run_ids


def test_a_hook_delegate_unloaded_in_place_of_its_owner_lets_the_owner_drop_it(rt):
    """G5: ComfyUI loads a Hook delegate in place of its dynamic owner, so the owner itself may never be
    unloaded; when the delegate is, the owner's cached legacy copy goes and nothing keeps its model alive."""
    import gc

    import torch

    class Patcher:
        def __init__(self, model):
            self.model = model
            self.non_dynamic_delegate_model = None

        def model_size(self):
            return 4 * MiB

    owner = Patcher(torch.nn.Linear(4, 4))
    delegate = Patcher(torch.nn.Linear(4, 4))
    owner.non_dynamic_delegate_model = (delegate.model, ({}, {}, {}, {}))
    rt.delegates.track(owner, delegate)
    assert routes.runtime_status(rt)["delegates"] == [{"owner": "Linear", "bytes": 4 * MiB}]
    assert routes.runtime_status(rt)["delegates_alive"] == 1
    assert rt.delegates.drop(delegate)  # ComfyUI's free_memory removed the delegate's LoadedModel
    assert owner.non_dynamic_delegate_model is None and routes.runtime_status(rt)["delegates"] == []
    del delegate
    gc.collect()
    assert routes.runtime_status(rt)["delegates_alive"] == 0
    assert not rt.delegates.drop(owner)  # dropped once: nothing more to do


def test_the_status_answers_when_inspecting_a_device_fails(rt, monkeypatch):
    """The status route is for people: a driver that cannot be inspected now leaves its figures out."""
    from membackend.types import DriverError

    def broken(device):
        raise DriverError(12, "mincore", "a range went away")

    monkeypatch.setattr(rt.session, "inspect", broken)
    st = routes.runtime_status(rt)
    assert st["running"] and st["kept"] == {} and st["budgets"]


# ------------------------------------------------------------------------------- bounded input, bounded answers


@pytest.mark.parametrize("headroom", ["9" * 5000, 10**5000, -(10**5000), "x" * 10_000_000, 1e300, "8.5EiB",
                                      float("inf"), [1] * 100_000, {"a": "b" * 1_000_000}],
                         ids=["5000 digits", "10**5000", "-10**5000", "10 MB text", "1e300", "8.5EiB", "inf",
                              "a long list", "a 1 MB table"])
def test_a_huge_headroom_is_a_typed_refusal_with_a_short_answer(rt, headroom):
    before = rt.headroom.in_force(rt.devices[0])
    code, answer = routes.change_headroom({"headroom": headroom})
    assert code == 400 and answer["error"] in ("InvalidSize", "ConfigError"), str(answer)[:500]
    assert len(json.dumps(answer)) < 3000, len(json.dumps(answer))
    assert rt.headroom.in_force(rt.devices[0]) == before
    code, answer = routes.change_headroom({"headroom": headroom, "extra": 1})  # the whole body refused, quoted short
    assert code == 400 and len(json.dumps(answer)) < 3000
    json.dumps(routes.status(), allow_nan=False)


def test_a_long_device_name_is_quoted_short(rt):
    code, answer = routes.change_headroom({"device": "cuda:" + "9" * 1_000_000, "headroom": "1GiB"})
    assert code == 400 and answer["error"] == "WrongDevice" and len(answer["message"]) < 1000, answer["message"][:300]


def test_minus_zero_is_a_headroom_of_zero(rt):
    code, answer = routes.change_headroom({"headroom": "-0"})
    assert code == 200 and answer["headroom"] == 0, answer


def test_a_save_that_meets_an_edit_answers_409_and_keeps_both(rt, tmp_path, monkeypatch):
    from membackend._settings import save as saving

    config = tmp_path / "membackend.toml"
    config.write_text('log_level = "info"\n')
    monkeypatch.setenv("MEMBACKEND_CONFIG", str(config))
    monkeypatch.delenv("MEMBACKEND_HEADROOM", raising=False)
    real_edited = saving._edited

    def edited_meanwhile(*args):  # the user's editor writes the file while the save runs
        out = real_edited(*args)
        config.write_text('log_level = "debug"\n')
        return out

    monkeypatch.setattr(saving, "_edited", edited_meanwhile)
    # no lease on the file: the edit above comes from the save's own thread, which would wait out the kernel's
    # lease-break-time (45 s) for a lease it holds itself; the content check catches the edit all the same
    # (the lease's own path: tests/test_settings_save.py)
    monkeypatch.setattr(saving._Lease, "take", lambda self: None)
    d = rt.devices[0]
    before = rt.headroom.in_force(d)
    code, answer = routes.change_headroom({"headroom": "1GiB", "save": True})
    assert code == 409 and answer["error"] == "ConfigChanged" and "your edit is kept" in answer["message"], answer
    assert config.read_text() == 'log_level = "debug"\n' and rt.headroom.in_force(d) == before



def test_a_save_while_an_editor_rewrites_the_file_in_place_answers_409_and_keeps_its_text(rt, tmp_path, monkeypatch):
    config = tmp_path / "membackend.toml"
    text = 'log_level = "info"\n\n[cuda_wddm]\nheadroom = "1GiB"\n'
    config.write_text(text)
    monkeypatch.setenv("MEMBACKEND_CONFIG", str(config))
    monkeypatch.delenv("MEMBACKEND_HEADROOM", raising=False)
    d = rt.devices[0]
    before = rt.headroom.in_force(d)
    with open(config, "w") as editor:  # nano's save: truncated, not yet written
        code, answer = routes.change_headroom({"headroom": "3GiB", "save": True})
        editor.write(text)
    assert config.read_text() == text, answer  # on main: the file was 'headroom = "3GiB"' alone
    assert code == 409 and answer["error"] == "ConfigChanged" and "is open for writing" in answer["message"], answer
    assert rt.headroom.in_force(d) == before

@pytest.mark.long  # 20,000 changes: a many-cycle run
def test_the_status_stays_small_under_20000_headroom_changes(rt, monkeypatch):
    before = len(json.dumps(routes.status()))
    clock = [1_000_000.0]
    monkeypatch.setattr(history.time, "time", lambda: clock[0])
    for i in range(20_000):
        clock[0] += 0.01  # 100 changes a second for 200 s
        assert routes.change_headroom({"headroom": f"{i % 7}MiB"})[0] == 200
    st = routes.status()
    samples = st["history"][str(rt.devices[0])]
    assert len(samples) <= 202 and len(json.dumps(st)) < before + 20_000, (before, len(json.dumps(st)))
    for i in range(2 * history.HISTORY_KEPT):  # forced samples a second apart: the count bound holds too
        clock[0] += 0.001
        rt.sample(force=True)
    assert len(routes.status()["history"][str(rt.devices[0])]) == history.HISTORY_KEPT


def test_the_routes_answer_strict_json_whatever_the_status_holds():
    answer = {"ok": 1, "nan": float("nan"), "inf": float("-inf"), "huge": 10**5000, "obj": object(), "t": (1, 2)}
    out = json.loads(routes.dumps(answer))
    assert out["ok"] == 1 and out["nan"] is None and out["inf"] is None and out["t"] == [1, 2]
    assert "bits" in out["huge"] and isinstance(out["obj"], str)
    assert routes.dumps({"a": 1}) == json.dumps({"a": 1})


def test_the_status_shows_the_address_windows_rocm_windows_keeps():
    with _running(sim_profile="rocm-win-2gpu", headroom=0, backend="rocm_windows") as runtime:
        d = runtime.devices[0]
        m = runtime.residency.register("unet", 3 << 30, d, "diffusion")
        runtime.residency.fault(m, 0, 64 << 20, d)
        runtime.residency.unpin(m, 0, 64 << 20, d)
        runtime.residency.full_unload(m)  # the released 3 GiB window is kept against the churn defect
        kept = routes.status()["kept_windows"][str(d)]
        report = runtime.session.backend.kept_windows(d)
        assert (kept["windows"], kept["bytes"], kept["bound"]) == (report.windows, report.bytes, report.bound)
        assert kept["windows"] == 1 and kept["bytes"] >= 3 << 30 and kept["line"] == report.describe()
        assert kept["reason"] and json.loads(routes.dumps(routes.status()))["kept_windows"][str(d)]["windows"] == 1
