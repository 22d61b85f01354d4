"""Dropped models' weights kept as cache, and never read again (issue 41, item 2; issue 34, item 4), in the real
ComfyUI on the simulated H200.

Under ComfyUI's default node cache (RAM pressure, no ``--cache-lru``) a workflow with another model drops the
results of the earlier prompt after its first node: the checkpoint's models lose their last reference in ComfyUI,
and the checkpoint's next prompt makes new models from the file. Stock ComfyUI reads the whole checkpoint again.
Here (:func:`weights.dropped_script`, with the CPU shim carrying every weight through membackend):

* the dropped models' weights stay as cache (``state: cached``), apart in the status from what live models hold,
  and the live models' bytes are the same as without a cache;
* the checkpoint again reads **0 bytes** of its weights from the file: every byte it read the first time is
  copied on the device from the cache, and the cached pages go as they are taken over;
* rewritten in place (a new ``mtime_ns``) or replaced (a new inode), the file is read anew;
* after a LoRA patched the UNet's weights in their ranges, the plain checkpoint reads those weights anew and
  the rest from the cache;
* a cap the cache alone can make room for takes the cache and no live model's page; ``POST /free`` leaves
  nothing cached or reserved;
* every image is bitwise equal to the same run's with ``keep_dropped = "off"`` (every weight read from its
  file).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from . import weights

PROFILE = {"MEMBACKEND_SIM_PROFILE": "h200"}


@pytest.fixture(scope="module")
def models_folder(weight_models):
    return Path(weight_models["folder"])


@pytest.fixture(scope="module")
def dropped(trees, comfy_python, report, models_folder):
    return weights.clean_run("dropped", PROFILE, weights.dropped_script(models_folder), trees=trees,
                             python=comfy_python, report=report, flags=weights.DEFAULT_CACHE_FLAGS)


def _figures(got) -> str:
    return "; ".join(f"{s.label}: read from the file {s.from_file}, from VRAM {s.from_vram}, cached {s.cached}, "
                     f"resident {s.resident}, models {sorted((m['name'], m['state']) for m in s.by_id.values())}"
                     for s in got.steps)


def _live(step) -> int:
    return sum(int(m["resident"] or 0) for m in step.by_id.values() if m["state"] != "cached")


def test_the_dropped_models_weights_are_cache_apart_from_what_live_models_hold(dropped):
    first, vae = dropped.step("txt2img"), dropped.step("vae")
    assert len(first.by_id) >= 3 and first.cached == 0, _figures(dropped)
    cached = {k: m for k, m in vae.by_id.items() if m["state"] == "cached"}
    assert cached and set(cached) <= set(first.by_id), _figures(dropped)
    assert vae.cached == sum(int(m["resident"] or 0) for m in cached.values()) > 0, _figures(dropped)
    # the live model is the VAE workflow's own, holding its pages only: the cache is the rest
    live = [m for m in vae.by_id.values() if m["state"] != "cached"]
    assert [m["name"] for m in live] == ["AutoencoderKL"] and _live(vae) == vae.resident - vae.cached
    assert vae.cached <= int(vae.budget["total"]) - int(vae.budget["headroom"]), "the cache stays in the room"


def test_the_checkpoint_again_reads_nothing_from_its_file(dropped):
    first, again = dropped.step("txt2img"), dropped.step("txt2img again")
    assert first.from_file > 2 << 30 and first.from_vram == 0, _figures(dropped)
    assert again.from_file == 0, f"the checkpoint again read {again.from_file} bytes from the file; {_figures(dropped)}"
    assert again.from_vram == first.from_file, _figures(dropped)
    # what was taken over left the cache: nothing of the checkpoint is held twice
    assert not [m for k, m in again.by_id.items() if m["state"] == "cached" and k in first.by_id], _figures(dropped)
    assert _live(again) == _live(first), _figures(dropped)


@pytest.mark.parametrize("label", ["txt2img rewritten", "txt2img replaced"])
def test_a_rewritten_or_replaced_file_is_read_anew(dropped, label):
    first, step = dropped.step("txt2img"), dropped.step(label)
    assert step.from_vram == 0 and step.from_file == first.from_file, _figures(dropped)


def test_weights_a_lora_patched_are_read_anew_and_the_rest_from_the_cache(dropped):
    first, after = dropped.step("txt2img"), dropped.step("txt2img after the lora")
    assert 0 < after.from_file < first.from_file, _figures(dropped)
    assert after.from_file + after.from_vram == first.from_file, _figures(dropped)


def test_a_cap_takes_the_cache_first_and_free_leaves_nothing(dropped):
    before, cap, free = dropped.step("vae 5"), dropped.step("cap"), dropped.step("free")
    assert before.cached > 0, _figures(dropped)
    assert cap.cached == 0, _figures(dropped)
    live = {k: m["resident"] for k, m in before.by_id.items() if m["state"] != "cached"}
    assert {k: m["resident"] for k, m in cap.by_id.items() if k in live} == live, "a live model lost pages"
    assert free.cached == 0 and free.reservations == 0 and not free.by_id, _figures(dropped)


def test_every_image_equals_the_one_read_from_the_file(dropped, trees, comfy_python, report, models_folder):
    """The cache changes no bit: the same script with ``keep_dropped = "off"`` (every weight read from its file)
    saves the same images. (Stock's images of the fp32 checkpoint differ from any dynamic run's in the last bit
    of a few values on a CPU: stock computes from the memory-mapped file in place, whose alignment changes the
    CPU's matrix kernels; see test_seeds.py. The fp16 checkpoint of test_weights.py matches stock bit for bit.)"""
    off = weights.clean_run("dropped_off", {**PROFILE, "MEMBACKEND_KEEP_DROPPED": "off"},
                            weights.dropped_script(models_folder), trees=trees, python=comfy_python, report=report,
                            flags=weights.DEFAULT_CACHE_FLAGS)
    assert all(s.from_vram == 0 and s.cached == 0 for s in off.steps), _figures(off)
    assert [s.image for s in dropped.steps if s.kind == "prompt"] == \
        [s.image for s in off.steps if s.kind == "prompt"]
