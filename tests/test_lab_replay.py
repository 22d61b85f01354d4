"""membackend replay: the four seed reports, stock against plugin, and traces that travel."""

from __future__ import annotations

import dataclasses
import json

import pytest

from membackend import _cli as cli
from membackend._manager import BackendManager
from membackend._residency import ResidencyManager
from membackend._settings import load_settings
from membackend.lab._replay import scenarios
from membackend.lab._replay.compare import replay
from membackend.lab._replay.traceformat import TraceError, parse_lines, read_trace

#: replays the seed reports' workloads, many seeds: the long part
pytestmark = pytest.mark.long

GiB = 1 << 30


@pytest.fixture(scope="module")
def replays():
    """Each built-in scenario once, both sides (churn-wddm on 2 seeds)."""
    return {name: replay(name, seeds=2 if name == "churn-wddm" else 1) for name in scenarios.SCENARIOS}


@pytest.mark.parametrize("name", list(scenarios.SCENARIOS))
def test_each_scenario_stock_reproduces_the_report_and_the_plugin_holds(replays, name):
    c = replays[name]
    assert c.stock_reproduces, c.table()
    assert c.violations == [], c.table()
    assert set(c.results) == {"stock", "plugin"} and not c.missing
    assert c.results["stock"][0].backend == "aimdo_stock"
    expected = scenarios.SCENARIOS[name].plugin or "vmm"
    assert c.results["plugin"][0].backend == expected


def test_full_unload_rocm_figures(replays):
    c = replays["full-unload-rocm"]
    stock, plugin = c.results["stock"][0], c.results["plugin"][0]
    # one reservation per model and device stays charged to private commit (the report's 34.25 GB)
    assert stock.alive_after_unload == 6 and plugin.alive_after_unload == 0
    assert stock.committed_end - stock.committed_start >= 34 * 10**9
    assert plugin.committed_end == plugin.committed_start


def test_hook_unload_figures(replays):
    c = replays["hook-unload"]
    stock, plugin = c.results["stock"][0], c.results["plugin"][0]
    assert stock.unloads[0]["resident"] >= scenarios.HOOK_HELD and stock.oom_by_model["vae"] >= 1
    assert plugin.unloads[0]["resident"] == 0 and plugin.oom_by_model.get("vae", 0) == 0


def test_churn_wddm_figures(replays):
    c = replays["churn-wddm"]
    assert c.value("stock", "bugchecks") > 0 and c.value("plugin", "bugchecks") == 0
    assert c.value("plugin", "creates") < c.value("stock", "creates")  # handles recycled
    assert len(c.results["plugin"]) == 2  # one per seed


def test_mixed_warmup_gb10_figures(replays):
    c = replays["mixed-warmup-gb10"]
    assert c.value("stock", "second_image_run_loaded") > 19  # GB: the image set loaded again
    assert c.value("plugin", "second_image_run_loaded") == 0
    assert c.value("plugin", "second_image_run_seconds") < c.value("stock", "second_image_run_seconds")


def test_the_table_shows_each_figure_next_to_the_report(replays):
    table = replays["full-unload-rocm"].table()
    assert "34.25 GB stock" in table and "stock (comfy-aimdo)" in table and "plugin (rocm_windows)" in table
    assert "plugin holds G1: yes" in table


def test_json_has_the_same_figures(replays):
    c = replays["mixed-warmup-gb10"]
    data = json.loads(json.dumps(c.to_json()))
    for key, label, stock, plugin, reported in c.rows():
        assert data["figures"][key] == {"label": label, "stock": stock, "plugin": plugin, "reported": reported or None}
    assert data["violations"] == [] and data["stock_reproduces"] is True


@pytest.mark.parametrize("name", ["churn-wddm", "hook-unload"])
def test_a_trace_written_by_a_replay_replays_to_the_same_table(tmp_path, name):
    path = tmp_path / f"{name}.jsonl"
    first = replay(name, seeds=1, record=str(path))
    header = json.loads(path.read_text().splitlines()[0])
    assert header["event"] == "trace" and header["scenario"] == name and header["version"] == 1
    again = replay(str(path))
    assert again.table() == first.table()
    assert again.to_json()["figures"] == first.to_json()["figures"]


def test_a_trace_recorded_with_membackend_trace_replays(tmp_path):
    """What a user records in their own process (MEMBACKEND_TRACE) replays elsewhere."""
    path = tmp_path / "user.jsonl"
    settings = load_settings(sim_profile="h200", backend="vmm", trace=str(path))
    session = BackendManager(settings).session()
    policy = ResidencyManager(session)
    m = policy.register("unet", 8 * GiB, "cuda:0", "diffusion")
    policy.use([m], workflow="t2i")
    for _ in range(2):  # two sampling steps
        for off in range(0, m.size, GiB):
            f = policy.fault(m, off, GiB)
            policy.copied(m, off, GiB, 0.05)
            assert f.ok
            policy.unpin(m, off, GiB)
    policy.unload_all()
    session.close()
    trace = read_trace(path)
    assert trace.header["sim_profile"] == "h200" and trace.header["backend"] == "vmm"
    assert [e["event"] for e in trace.events][:3] == ["register", "use", "fault"]
    here = replay(str(path))  # the recorded machine: everything fits, the second step copies nothing
    assert here.results["plugin"][0].loaded == 8 * GiB and here.results["plugin"][0].refaulted == 0
    assert abs(here.results["plugin"][0].load_seconds - 0.4) < 1e-9  # the 8 copies that ran, as recorded
    c = replay(str(path), profile="wddm-6gb")  # another machine: a 6 GB card
    plugin = c.results["plugin"][0]
    assert plugin.backend == "cuda_wddm"  # what membackend selects there
    # 8 GiB through a 6 GB card: what fits is copied once and stays; the layers past it are answered out of
    # memory on both steps (ComfyUI streams them through its cast buffer), none is mapped and unmapped again
    assert plugin.refaulted == 0 and 0 < plugin.loaded < 8 * GiB
    assert plugin.oom == 2 * ((8 * GiB - plugin.loaded) // GiB)
    assert c.violations == []


def test_devices_the_profile_lacks_are_mapped_and_said(tmp_path):
    events = [{"event": "register", "model": "m", "bytes": GiB, "devices": ["cuda:3"]},
              {"event": "fault", "model": "m", "device": "cuda:3", "offset": 0, "bytes": GiB},
              {"event": "unload_all"}]
    from membackend.lab._replay.traceformat import write_trace

    path = write_trace(tmp_path / "t.jsonl", events)
    c = replay(str(path), profile="h200")
    assert "cuda:3 replayed on cuda:0" in c.table()


def test_a_missing_plugin_leaves_its_column_not_run(monkeypatch):
    sc = dataclasses.replace(scenarios.SCENARIOS["hook-unload"], plugin="not_installed_plugin")
    monkeypatch.setitem(scenarios.SCENARIOS, "hook-unload", sc)
    c = replay("hook-unload")
    assert "plugin" in c.missing and "pip install membackend-not-installed-plugin" in c.missing["plugin"]
    assert "not run" in c.table() and c.results["stock"]


@pytest.mark.parametrize("text, message", [
    ("{not json", "not JSON"),
    ('{"event": "trace", "format": "membackend-trace", "version": 99}', "version 99 is not supported"),
    ('{"event": "trace", "format": "other", "version": 1}', "is not 'membackend-trace'"),
    ('{"event": "register", "policy": "x", "model": "m", "devices": ["cuda:0"]}', "needs bytes"),
    ('{"event": "register", "policy": "x", "model": "m", "bytes": -1, "devices": ["cuda:0"]}', "whole number"),
    ('{"event": "reserve", "device": "cuda:0", "bytes": 1}', "no 'register' event"),
])
def test_bad_traces_are_typed_errors_naming_the_line(text, message):
    with pytest.raises(TraceError, match=message):
        parse_lines([text], "t.jsonl")


def test_decisions_verbs_and_consequences_are_not_replayed():
    lines = [json.dumps(e) for e in (
        {"event": "register", "policy": "membackend", "model": "a", "bytes": 1, "devices": ["cuda:0"]},
        {"event": "fault", "reservation": 1, "device": "cuda:0", "offset": 0, "bytes": 1},  # a verb call
        {"event": "evict_model", "policy": "membackend", "model": "a", "bytes": 1},  # a decision
        {"event": "full_unload", "policy": "membackend", "model": "a", "via": "unload_all"},  # a consequence
        {"event": "unload_all", "policy": "membackend"},
    )]
    assert [e["event"] for e in parse_lines(lines).events] == ["register", "unload_all"]


def test_cli_replay_json_plot_and_exit_codes(tmp_path, capsys, monkeypatch):
    plot = tmp_path / "t.html"
    assert cli.main(["replay", "full-unload-rocm", "--json", "--plot", str(plot)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["scenario"] == "full-unload-rocm" and data["figures"]["alive_after_unload"]["plugin"] == 0
    assert plot.read_text().lstrip().lower().startswith("<!doctype html")
    assert cli.main(["replay", "no-such-scenario"]) == 2
    assert "built in: full-unload-rocm" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    assert cli.main(["replay", str(bad)]) == 2
    assert "line 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["replay", "hook-unload", "--seeds", "0"])
    broken = dataclasses.replace(scenarios.SCENARIOS["hook-unload"], plugin_holds=lambda side: ["G5: made up"])
    monkeypatch.setitem(scenarios.SCENARIOS, "hook-unload", broken)
    assert cli.main(["replay", "hook-unload", "--policy", "plugin"]) == 1
    assert "plugin breaks: G5: made up" in capsys.readouterr().out


def test_cli_plot_png_is_a_valid_image(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    path = tmp_path / "timeline.png"
    assert cli.main(["replay", "mixed-warmup-gb10", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width = imread(str(path)).shape[:2]
    assert height > 200 and width > 200


def test_cli_plot_without_matplotlib_says_how_to_install(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert cli.main(["replay", "hook-unload", "--policy", "stock", "--plot", str(tmp_path / "t.png")]) == 2
    assert 'pip install "membackend[plot]"' in capsys.readouterr().err


def _trace_file(tmp_path, events, name="t.jsonl", **header):
    from membackend.lab._replay.traceformat import write_trace

    return str(write_trace(tmp_path / name, events, **header))


def _layer(model, offset, size, seconds, event="fault"):
    span = {"model": model, "device": "cuda:0", "offset": offset, "bytes": size}
    return {"event": event, **span, **({"seconds": seconds} if event == "copy" else {})}


def test_a_copy_is_matched_to_the_fault_of_its_own_range(tmp_path):
    """Prefetch faults a layer ahead: fault A (new pages), fault B (new), copy A, copy B, then both
    again (resident: no copy). Each copy counts once, for its own range."""
    L = 64 << 20
    events = [{"event": "register", "model": "m", "bytes": 2 * L, "devices": ["cuda:0"]},
              _layer("m", 0, L, 0), _layer("m", L, L, 0),
              _layer("m", 0, L, 1.0, "copy"), _layer("m", L, L, 2.0, "copy"),
              _layer("m", L, L, 0), _layer("m", 0, L, 0),
              _layer("m", 0, L, 4.0, "copy"), _layer("m", L, L, 8.0, "copy"),
              {"event": "unload_all"}]
    c = replay(_trace_file(tmp_path, events, sim_profile="h200"))
    for side in ("stock", "plugin"):
        assert c.results[side][0].load_seconds == 3.0, side  # the second pass found its pages resident


def test_trace_mistakes_name_their_line(tmp_path):
    events = [{"event": "register", "model": "m", "bytes": 1 << 30, "devices": ["cuda:0"]},
              {"event": "fault", "model": "m", "device": "cuda:0", "offset": 1 << 30, "bytes": 1 << 20}]
    with pytest.raises(TraceError, match=r"line 3 \(event 2, 'fault'\): OutOfRange"):
        replay(_trace_file(tmp_path, events, sim_profile="h200"))
    orphan = [{"event": "register", "model": "hook", "bytes": 1 << 20, "devices": ["cuda:0"], "owner": "unet"}]
    with pytest.raises(TraceError, match="owner 'unet' of model 'hook' is not registered before it"):
        replay(_trace_file(tmp_path, orphan, "o.jsonl", sim_profile="h200"))
    with pytest.raises(TraceError, match="'models' must be a non-empty list"):
        parse_lines(['{"event": "use", "policy": "x", "models": "m"}'])
    with pytest.raises(TraceError, match="finite number"):
        parse_lines(['{"event": "compute", "policy": "x", "seconds": NaN}'])


def test_a_file_several_processes_appended_to_replays_run_by_run(tmp_path):
    for size in (1 << 30, 2 << 30):  # two processes, one after the other, same file
        s = BackendManager(load_settings(sim_profile="h200", backend="vmm", trace=str(tmp_path / "a.jsonl"))).session()
        p = ResidencyManager(s)
        m = p.register("unet", size, "cuda:0")
        assert p.fault(m, 0, size).ok
        p.unload_all()
        s.close()
    last, first = read_trace(tmp_path / "a.jsonl"), read_trace(tmp_path / "a.jsonl", run=1)
    assert last.runs == first.runs == 2
    assert next(iter(last.events))["bytes"] == 2 << 30 and next(iter(first.events))["bytes"] == 1 << 30
    with pytest.raises(TraceError, match="run 3 does not exist; the file holds 2 run"):
        read_trace(tmp_path / "a.jsonl", run=3)
    assert replay(str(tmp_path / "a.jsonl"), run=1).results["plugin"][0].loaded == 1 << 30


def test_a_side_that_cannot_go_on_is_shown_and_breaks_the_guarantee(tmp_path, capsys):
    """Past the ROCm address quota, with every model the current run's (none idle to give its range back),
    the plugin refuses (typed); the stock runtime crashes."""
    events = [{"event": "register", "model": f"m{i}", "bytes": 100 << 30, "devices": ["hip:0"]} for i in range(2)]
    events.append({"event": "use", "models": ["m0", "m1"]})
    events += [{"event": "register", "model": f"m{i}", "bytes": 100 << 30, "devices": ["hip:0"]} for i in (2, 3)]
    events.append({"event": "unload_all"})
    path = _trace_file(tmp_path, events, sim_profile="rocm-win-2gpu")
    c = replay(path)
    plugin, stock = c.results["plugin"][0], c.results["stock"][0]
    assert plugin.stopped and "AddressSpaceExhausted" in plugin.stopped and "line 5 (event 4" in plugin.stopped
    assert stock.lost and "SimulatedCrash" in stock.lost
    assert any("the run stopped" in v for v in c.violations)
    assert cli.main(["replay", path]) == 1


def test_bad_replay_arguments_are_refused_before_anything_runs(tmp_path, capsys, monkeypatch):
    ran = []
    import membackend.lab._replay.compare as compare

    monkeypatch.setattr(compare, "run_side", lambda *a, **k: ran.append(a))
    assert cli.main(["replay", "hook-unload", "--plot", str(tmp_path / "t.txt")]) == 2
    assert ".png, .svg, .pdf, .html" in capsys.readouterr().err
    assert cli.main(["replay", "hook-unload", "--record", str(tmp_path)]) == 2
    assert "a folder" in capsys.readouterr().err
    assert cli.main(["replay", "hook-unload", "--profile", "nope"]) == 2
    assert "accepted: wddm-6gb" in capsys.readouterr().err
    events = [{"event": "register", "model": "m", "bytes": 1 << 20, "devices": ["cuda:0"]}]
    path = _trace_file(tmp_path, events, sim_profile="h200")
    assert cli.main(["replay", path, "--seeds", "3"]) == 2
    assert "replays as recorded" in capsys.readouterr().err
    assert ran == []


def test_a_backend_asked_for_by_name_that_is_not_installed_is_a_configuration_error(capsys):
    assert cli.main(["replay", "hook-unload", "--backend", "nosuch"]) == 2
    err = capsys.readouterr().err  # no plugin of that name is known: no install hint for a package that is not
    assert "backend 'nosuch' is not installed (installed: " in err and "pip install" not in err


def test_unregistering_an_owner_replays_once(tmp_path):
    path = tmp_path / "u.jsonl"
    s = BackendManager(load_settings(sim_profile="h200", backend="vmm", trace=str(path))).session()
    p = ResidencyManager(s)
    unet = p.register("unet", 1 << 30, "cuda:0")
    p.register("unet/hook", 1 << 30, "cuda:0", "hook_delegate", owner=unet)
    p.unregister(unet)  # the delegate goes with it: a consequence, not a request of its own
    s.close()
    assert [e["event"] for e in read_trace(path).events] == ["register", "register", "unregister"]
    assert replay(str(path)).violations == []


# --------------------------------------------------------------------------- the profile asked for, progress


def _watch_profiles(monkeypatch):
    """The profile of every simulated machine the replay opens."""
    import membackend.lab._replay.engine as engine

    opened = []
    real_open = engine.open_sim_variant

    def open_sim_variant(*a, **k):
        driver = real_open(*a, **k)
        opened.append(driver.sim.profile)
        return driver
    monkeypatch.setattr(engine, "open_sim_variant", open_sim_variant)
    return opened


def test_a_trace_replayed_on_another_profile_keeps_that_profile(tmp_path, capsys, monkeypatch):
    """hook-unload is recorded on a 24 GiB h200; --profile wddm-6gb replays it on a 6 GB card, and says so."""
    path = tmp_path / "hook.jsonl"
    replay("hook-unload", policy="plugin", record=str(path))
    assert json.loads(path.read_text().splitlines()[0])["machine"] == {"device_memory": scenarios.HOOK_CARD}
    opened = _watch_profiles(monkeypatch)
    assert cli.main(["replay", str(path), "--profile", "wddm-6gb", "--policy", "plugin"]) in (0, 1)
    out = capsys.readouterr().out
    assert opened and all(p.name == "wddm-6gb" and p.devices[0].vram == 6 * GiB for p in opened)
    assert "recorded on h200 with device_memory=25.77 GB: not applied on wddm-6gb (--keep-machine applies them)" in out
    assert "profile wddm-6gb," in out and "(device_memory=" not in out
    opened.clear()
    c = replay(str(path), profile="wddm-6gb", policy="plugin", keep_machine=True)  # told otherwise
    assert c.changes == {"device_memory": scenarios.HOOK_CARD} and not c.not_applied
    assert opened and all(p.devices[0].vram == scenarios.HOOK_CARD for p in opened)
    opened.clear()
    same = replay(str(path), profile="h200", policy="plugin")  # the profile it was recorded on: as recorded
    assert same.changes == {"device_memory": scenarios.HOOK_CARD} and not same.not_applied
    assert opened and all(p.devices[0].vram == scenarios.HOOK_CARD for p in opened)


def test_a_scenario_on_another_profile_runs_that_profile_as_it_is(monkeypatch, capsys):
    opened = _watch_profiles(monkeypatch)
    c = replay("hook-unload", profile="wddm-6gb", policy="stock")
    assert c.not_applied == {"device_memory": scenarios.HOOK_CARD} and c.changes == {}
    assert opened and all(p.devices[0].vram == 6 * GiB for p in opened)
    assert c.to_json()["profile_changes_not_applied"] == {"device_memory": scenarios.HOOK_CARD}


def test_a_long_trace_reports_its_progress_on_stderr(tmp_path, capsys, monkeypatch):
    import membackend.lab._replay.compare as compare
    import membackend.lab._replay.engine as engine

    monkeypatch.setattr(compare, "LONG_TRACE_EVENTS", 20)  # "long", so that a test need not replay a million
    monkeypatch.setattr(engine, "PROGRESS_EVERY", 10)
    events = [{"event": "register", "model": "m", "bytes": GiB, "devices": ["cuda:0"]}]
    events += [{"event": "fault", "model": "m", "device": "cuda:0", "offset": 0, "bytes": GiB}] * 24
    events.append({"event": "unload_all"})
    path = _trace_file(tmp_path, events, sim_profile="h200")
    assert cli.main(["replay", path]) == 0
    err = capsys.readouterr().err
    for text in ("stock: 10/26 events (side run 1/2)", "stock: 26/26 events (side run 1/2)",
                 "plugin: 20/26 events (side run 2/2)", "2/2 side runs"):
        assert text in err, err
    short = _trace_file(tmp_path, events[:5] + events[-1:], "short.jsonl", sim_profile="h200")
    assert cli.main(["replay", short]) == 0
    assert "events" not in capsys.readouterr().err  # a short trace replays quietly


def test_a_side_keeps_a_bounded_timeline(tmp_path, monkeypatch):
    """Samples that repeat only move a plateau's end; past the bound the series is thinned, keeping the
    lowest and highest of each run of four."""
    import membackend.lab._replay.engine as engine

    monkeypatch.setattr(engine, "MAX_SAMPLES_PER_DEVICE", 8)
    L = 64 << 20
    events = [{"event": "register", "model": "m", "bytes": 64 * L, "devices": ["cuda:0"]}]
    for off in range(0, 64 * L, L):  # every fault backs new pages: the resident figure rises each event
        events.append({"event": "fault", "model": "m", "device": "cuda:0", "offset": off, "bytes": L})
    events += [{"event": "fault", "model": "m", "device": "cuda:0", "offset": 0, "bytes": L}] * 40  # all resident
    events.append({"event": "unload_all"})
    c = replay(_trace_file(tmp_path, events, sim_profile="h200"), policy="plugin")
    samples = c.results["plugin"][0].timeline.samples
    assert len(samples) <= 2 * 8 + 3
    resident = [s.resident for s in samples]
    assert resident[0] == 0 and max(resident) == 64 * L and resident[-1] == 0  # start, peak and the unload kept
    assert [s.t for s in samples] == sorted(s.t for s in samples)


def test_record_refuses_the_trace_being_replayed(tmp_path, capsys):
    events = [{"event": "register", "model": "m", "bytes": GiB, "devices": ["cuda:0"]}, {"event": "unload_all"}]
    path = _trace_file(tmp_path, events, sim_profile="h200")
    before = open(path).read()
    assert cli.main(["replay", path, "--record", path]) == 2
    assert "is the trace being replayed; accepted: another file" in capsys.readouterr().err
    assert open(path).read() == before
