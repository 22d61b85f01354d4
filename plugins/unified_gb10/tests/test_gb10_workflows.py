"""ComfyUI #14519 on the simulated GB10, side by side: workflow switches keep models warm on one pool (G4).

Each run declares its workflow's models (``ResidencyManager.use``) and faults
them layer by layer; ``Run.loaded`` is what the run had to back anew, i.e. to
load again. The stock side is today's GB10: the stock policy (residency lost
on every workflow change) on the generic VMM.
"""

from __future__ import annotations

from workload_unified_gb10 import CUDA0, GB, WORKFLOWS


def test_the_plugin_is_what_runs_the_plugin_side(workload):
    w = workload("plugin")
    assert w.session.name == "unified_gb10" and w.session.how == "auto"


def test_image_video_image_second_image_run_loads_nothing_with_the_plugin_and_everything_with_stock(workload):
    plugin, stock = workload("plugin"), workload("stock")
    image = plugin.size_of("image")
    assert 19 * GB < image < 21 * GB and 44 * GB < plugin.size_of("video") < 46 * GB

    p = plugin.sequence("image", "video", "audio", "image", "video", "audio", "video")
    s = stock.sequence("image", "video", "audio", "image", "video", "audio", "video")
    # the warm-up loads each workflow once on both sides
    assert [r.loaded for r in p[:3]] == [plugin.size_of(n) for n in ("image", "video", "audio")]
    assert [r.loaded for r in s[:3]] == [stock.size_of(n) for n in ("image", "video", "audio")]
    # image -> video -> image: all three fit, so the second image run faults nothing with the plugin ...
    assert p[3].workflow == "image" and p[3].loaded == 0 and p[3].evicted == []
    # ... and reloads every image model with stock, which dropped them when the workflow changed
    assert s[3].workflow == "image" and s[3].loaded == stock.size_of("image")
    assert sorted(s[3].evicted) == sorted(n for n, _ in WORKFLOWS["audio"])
    # video -> audio -> video: the same
    assert [r.loaded for r in p[4:]] == [0, 0, 0]
    assert [r.loaded for r in s[4:]] == [stock.size_of(n) for n in ("video", "audio", "video")]
    assert all(r.oom == 0 for r in p + s) and plugin.refusals.count == stock.refusals.count == 0
    # every model stays resident with the plugin; the pool never went below the headroom
    assert all(plugin.resident().values())
    headroom = plugin.session.budget_query(CUDA0).headroom
    assert plugin.lowest_available >= headroom


def test_modelled_second_image_run_cold_with_stock_warm_with_the_plugin(workload):
    """Modelled time = bytes loaded at the profile's copy bandwidth + a fixed compute time."""
    compute = 9.0  # seconds: the warm run of #14519, which loads nothing
    plugin, stock = workload("plugin"), workload("stock")
    bandwidth = plugin.sim.profile.copy_bandwidth
    second = {side: w.sequence("image", "video", "image")[2] for side, w in (("plugin", plugin), ("stock", stock))}
    warm = compute + second["plugin"].loaded / bandwidth
    cold = compute + second["stock"].loaded / bandwidth
    assert warm == compute
    assert cold == compute + stock.size_of("image") / bandwidth > warm


def test_a_pool_that_fits_two_workflows_evicts_least_recently_used_models_and_never_crosses_it(workload):
    plugin = workload("plugin")
    budget = plugin.session.budget_query(CUDA0)
    image, video, audio = (plugin.size_of(n) for n in ("image", "video", "audio"))
    # pinned host buffers take the pool down to image + video + 4 GB: any two workflows fit, not all three
    pinned = budget.usable - (image + video + 4 * GB)
    plugin.session.backend.driver.host_alloc_pinned(pinned)
    usable = plugin.session.budget_query(CUDA0).usable
    assert image + video <= usable < image + video + audio

    runs = plugin.sequence("image", "video", "audio", "image", "video")
    assert all(r.oom == 0 for r in runs), [(r.workflow, r.oom) for r in runs]
    assert plugin.refusals.count == 0  # the driver never refused: nothing was asked past the pool
    assert plugin.lowest_available >= budget.headroom  # nothing crossed the pool's headroom
    assert [r.evicted for r in runs[:2]] == [[], []]
    # each switch evicts whole models, least recently used first: the oldest workflow's first-used model
    assert runs[2].evicted == ["image_unet"]  # image is older than video
    assert runs[3].evicted == ["video_unet"]  # video is now older than audio and image's rest
    assert runs[4].evicted == ["audio_model"]
    # what was evicted is what was loaded again; models that stayed are not reloaded
    assert runs[3].loaded == plugin.models["image_unet"].reservation(CUDA0).size
    assert runs[4].loaded == plugin.models["video_unet"].reservation(CUDA0).size
    # the current run's models are all resident at its end
    assert all(plugin.resident()[n] for n, _ in WORKFLOWS["video"])


def test_a_fault_past_the_pool_is_refused_before_the_driver_is_asked():
    from workload_unified_gb10 import gb10_session

    session = gb10_session()
    try:
        sim = session.backend.driver.sim
        b = session.budget_query(CUDA0)
        r = session.reserve(CUDA0, b.usable + 2 * session.backend.requested_page_size)
        creates = sim.faults.calls.get("cuMemCreate", 0)
        f = session.fault(r, 0, r.size)  # one fault of more than the pool minus headroom
        assert not f.ok and f.mapped == 0
        assert sim.faults.calls.get("cuMemCreate", 0) == creates  # the driver was never asked
        assert sim.state(0)["mapped"] == 0 and session.inspect(CUDA0).resident == 0
        fits = b.usable // r.page_size * r.page_size
        assert session.fault(r, 0, fits).ok  # what fits still does, up to the headroom
        assert sim.meminfo()["MemAvailable"] >= b.headroom
        session.release_reservation(r)
    finally:
        session.close()
