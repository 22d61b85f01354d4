"""A wholly resident model on ComfyUI's classic path, and back (issue 41, item 1), in the real ComfyUI on the
simulated H200 (:data:`weights.CLASSIC`, with the CPU shim carrying every weight through membackend):

* the warm prompt runs every model it loads on the classic path: no ``vbar_fault`` or ``vbar_unpin`` at all;
* after a prompt that uses the UNet last, a cap that leaves room for the UNet alone puts the other models back
  on the dynamic path and evicts them; the next prompt's sampler runs the UNet promoted, and the UNet goes
  back to the dynamic path in the middle of the prompt, when the VAE decode needs its pages;
* ``POST /free`` puts every model back and leaves no reservation;
* every image is bitwise equal to stock ComfyUI's (``--cpu``) for the same prompt.
"""

from __future__ import annotations

import pytest

from . import weights

PROFILE = {"MEMBACKEND_SIM_PROFILE": "h200"}


@pytest.fixture(scope="module")
def classic(trees, comfy_python, report, weight_models):
    return weights.clean_run("classic", PROFILE, weights.CLASSIC, trees=trees, python=comfy_python, report=report)


def _figures(got) -> str:
    return "; ".join(f"{s.label}: faults {s.faults}, promoted {s.promoted}, demoted {s.demoted}, paths "
                     f"{sorted((m['name'], m['path'], m['state']) for m in s.by_id.values())}" for s in got.steps)


def test_the_warm_prompt_runs_every_model_it_loads_on_the_classic_path(classic):
    cold, warm = classic.step("cold"), classic.step("warm")
    assert cold.faults > 0 and cold.loaded > 0, _figures(classic)
    assert (warm.faults, warm.unpins, warm.loaded) == (0, 0, 0), _figures(classic)
    assert warm.promoted >= 2, _figures(classic)  # the UNet for the sampler, the VAE for the decode
    paths = {m["name"]: m["path"] for m in warm.by_id.values()}
    assert paths["BaseModel"] == "classic" and paths["AutoencoderKL"] == "classic", _figures(classic)


def test_under_a_cap_the_unet_goes_back_in_the_middle_of_the_prompt(classic):
    cap, under = classic.step("cap"), classic.step("under the cap")
    assert cap.demoted >= 1, f"the cap put the models it evicts back first: {_figures(classic)}"
    kept = {m["name"]: m["path"] for m in cap.by_id.values() if m["state"] == "warm"}
    assert kept == {"BaseModel": "classic"}, f"the cap kept the UNet alone, promoted: {_figures(classic)}"
    # the sampler ran the UNet promoted (it alone fitted), then the decode's VAE needed its pages
    # the sampler ran the UNet with no fault at all: the prompt's few faults are the decode's (the UNet's
    # sampling makes about 195 a step on the dynamic path)
    assert under.promoted >= 1 and under.demoted >= 1 and 0 < under.faults < 100, _figures(classic)
    unet = next(m for m in under.by_id.values() if m["name"] == "BaseModel")
    assert unet["path"] == "dynamic" and unet["state"] in ("not resident", "partly resident"), _figures(classic)
    assert under.evictions > 0, _figures(classic)
    # the next prompt's sampler finds the UNet evicted: it streams on the dynamic path
    assert classic.step("again under the cap").faults > 100, _figures(classic)


def test_free_puts_every_model_back_and_returns_every_reservation(classic):
    free = classic.step("free")
    assert free.reservations == 0 and not free.by_id, _figures(classic)


def test_every_image_matches_stock(classic, trees, comfy_python, report):
    stock = weights.stock_images([wf for kind, _, wf in weights.CLASSIC if kind == "prompt"], trees=trees,
                                 python=comfy_python, logs=report.folder / "logs", label="classic")
    assert [s.image for s in classic.steps if s.kind == "prompt"] == stock
