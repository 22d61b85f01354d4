"""Dropped models give their memory back (issue 34, item 4), in the real ComfyUI on simulated h200.

Under ComfyUI's default node cache (RAM pressure, no ``--cache-lru``), a workflow with another model drops the
results of the earlier prompt after its first node: the checkpoint's models (UNet, CLIP, VAE) lose their last
reference in ComfyUI, and a later prompt with the checkpoint loads the file again as new models. Stock ComfyUI's
VRAM falls with the drop. Here, txt2img -> the SD1 VAE's workflow -> txt2img again, with the CPU shim
(:mod:`.cpu_shim`) carrying every weight through membackend's simulated H200:

* after the VAE workflow, the first txt2img's models are gone: their reservations are returned and nothing of
  them is resident or held; only the VAE workflow's model is left;
* after the second txt2img, only that run's models are left (no reservation of a dropped model survives);
* the reload's loaded bytes are reported (the figure item 4's takeover of resident pages would bring to 0);
* every image is bitwise equal to stock ComfyUI's.
"""

from __future__ import annotations

import pytest

from . import weights

PROFILE = {"MEMBACKEND_SIM_PROFILE": "h200"}


@pytest.fixture(scope="module")
def dropped(trees, comfy_python, report, weight_models):
    got = weights.run_script("dropped-default-cache", PROFILE, weights.DROPPED, trees=trees, python=comfy_python,
                             logs=report.folder / "logs", flags=weights.DEFAULT_CACHE_FLAGS)
    report.put("dropped", got.row())
    if got.error:
        pytest.fail(f"dropped: {got.error}", pytrace=False)
    assert not got.exceptions, f"tracebacks in the server's log: {got.exceptions}"
    assert not any("switched off" in line for line in got.membackend_lines), got.membackend_lines
    return got


def _figures(got) -> str:
    return "; ".join(f"{s.label}: {s.reservations} reservation(s), resident {s.resident}, committed "
                     f"{sum(s.committed.values())}, loaded {s.loaded}, models "
                     f"{sorted((m['name'], m['state'], m['held']) for m in s.by_id.values())}" for s in got.steps)


def test_the_dropped_models_reservations_are_gone_after_the_other_workflow(dropped):
    first, vae = dropped.step("txt2img"), dropped.step("vae")
    assert len(first.by_id) >= 3, _figures(dropped)  # the checkpoint's UNet, CLIP and VAE
    survivors = set(first.by_id) & set(vae.by_id)
    assert not survivors, f"dropped models still registered: {survivors}; {_figures(dropped)}"
    # the VAE workflow's own model only (ComfyUI still holds it: its cache has the loader's result)
    assert vae.reservations == len(vae.by_id) == 1, _figures(dropped)
    assert [m["name"] for m in vae.by_id.values()] == ["AutoencoderKL"], _figures(dropped)
    # nothing of the dropped models is resident: the device holds the VAE's pages only
    assert vae.resident == sum(int(m["resident"] or 0) for m in vae.by_id.values()) <= \
        max(int(m["size"] or 0) for m in vae.models.values()) + 64 * 2**20, _figures(dropped)
    start = sum(dropped.start.committed.values())
    assert sum(vae.committed.values()) - start <= vae.resident, _figures(dropped)


def test_after_the_reload_only_the_reloaded_models_are_left(dropped):
    first, vae, again = dropped.step("txt2img"), dropped.step("vae"), dropped.step("txt2img again")
    assert not set(again.by_id) & (set(first.by_id) | set(vae.by_id)), _figures(dropped)
    assert again.reservations == len(again.by_id) == len(first.by_id), _figures(dropped)
    start = sum(dropped.start.committed.values())
    assert sum(again.committed.values()) - start <= again.resident, _figures(dropped)
    print(f"\ndropped models, default cache, h200: {_figures(dropped)}")


def test_the_reload_is_reported_and_every_image_matches_stock(dropped, trees, comfy_python, report):
    again = dropped.step("txt2img again")
    # without a takeover of resident pages the reload copies the checkpoint's weights again (see the report)
    assert again.loaded > 0, again.loads
    assert again.loads, "the reload's per-load lines are missing"
    stock = weights.stock_images([wf for kind, _, wf in weights.DROPPED if kind == "prompt"], trees=trees,
                                 python=comfy_python, logs=report.folder / "logs", label="dropped")
    assert [s.image for s in dropped.steps if s.kind == "prompt"] == stock
