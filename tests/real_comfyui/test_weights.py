"""Every backend carries a model's weights through real ComfyUI code (issue: weights in the real tree).

ComfyUI runs with ``--cpu --enable-dynamic-vram`` and the test shim that lifts only its explicit CPU checks on
the dynamic path (:mod:`.cpu_shim`), so its own ``ModelPatcherDynamic`` reserves each model's range through
membackend, faults each layer's pages, copies the weights in, casts from them and unpins. Under the host
backend the pages are host memory; under each simulated GPU they are the simulated device's bytes (process
memory at the device's addresses), read by ComfyUI as CPU tensors. For each backend
(:data:`weights.BACKENDS`):

* every image is bitwise equal to stock ComfyUI's under ``--cpu`` (no membackend), seed for seed;
* the first run's loaded bytes are the weights' bytes (the pages the staged weights span);
* a second run with another seed loads 0 bytes, and runs every model on ComfyUI's classic path (issue 41): no
  fault or unpin per weight per step;
* under a live headroom that leaves room for three quarters of the weights, the models stream and are evicted, and the
  images still match;
* ``POST /free`` leaves no reservation, and the memory the driver holds is back at its start-up value.
"""

from __future__ import annotations

from collections import Counter

import pytest

from . import weights

NAMES = list(weights.BACKENDS)


def _run(weight_runs, name):
    got = weight_runs[name]
    if got.error:
        pytest.fail(f"{name}: {got.error}", pytrace=False)
    return got


def _stock(weight_runs):
    ref = weight_runs.stock()
    if ref.error:
        pytest.fail(f"stock ComfyUI --cpu: {ref.error}", pytrace=False)
    return ref


@pytest.mark.parametrize("name", NAMES)
def test_the_backend_runs_and_serves_every_model(weight_runs, name):
    got = _run(weight_runs, name)
    assert got.state == "running" and got.backend == weights.BACKENDS[name][1], (got.state, got.backend)
    assert got.weights > 0, f"{name}: membackend served no weights: {got.phases['first'].loads}"
    ref = _stock(weight_runs)
    new = sorted((Counter(got.exceptions) - Counter(ref.exceptions)).elements())
    assert not new, f"{name}: tracebacks stock does not print: {new}"
    assert not any("switched off" in line for line in got.membackend_lines), got.membackend_lines


@pytest.mark.parametrize("name", NAMES)
def test_every_image_equals_stock(weight_runs, name):
    got, ref = _run(weight_runs, name), _stock(weight_runs)
    assert got.phases["first"].hashes == ref.hashes[weights.FIRST_SEED]
    assert got.phases["second"].hashes == ref.hashes[weights.SECOND_SEED]
    assert got.phases["streamed"].hashes == ref.hashes[weights.STREAMED_SEED]


@pytest.mark.parametrize("name", NAMES)
def test_the_first_run_loads_the_weights_and_the_second_nothing(weight_runs, name):
    got = _run(weight_runs, name)
    first, second = got.phases["first"], got.phases["second"]
    # every layer of every model runs once in the first phase: each model's weights are loaded, page by page
    assert first.loaded == got.weights_pages, (
        f"{name}: loaded {first.loaded} bytes; the weights span {got.weights_pages} bytes of pages "
        f"({got.weights} bytes staged): {first.loads}")
    rounded = {n: -(-m["size"] // got.page_size) * got.page_size for n, m in got.models.items()}
    assert {n: m["resident"] for n, m in got.models.items()} == rounded
    assert second.loaded == 0, f"{name}: the second run loaded {second.loaded} bytes: {second.loads}"


@pytest.mark.parametrize("name", NAMES)
def test_the_second_run_is_on_the_classic_path_with_no_fault_or_unpin(weight_runs, name):
    """Issue 41, item 1: every model the second phase loads is wholly resident, so ComfyUI runs it as a fully
    loaded model: no vbar_fault, signature compare or vbar_unpin per weight per step (the first phase made
    them all), and its images still equal stock's (test_every_image_equals_stock)."""
    got = _run(weight_runs, name)
    first, second = got.phases["first"], got.phases["second"]
    assert first.faults > 0 and first.unpins > 0, (first.faults, first.unpins)
    assert (second.faults, second.unpins) == (0, 0), (
        f"{name}: the second phase made {second.faults} faults and {second.unpins} unpins; on the classic path: "
        f"{second.classic}")
    assert {"BaseModel", "AutoencoderKL"} <= set(second.classic), second.classic


@pytest.mark.parametrize("name", NAMES)
def test_a_lower_headroom_streams_and_evicts(weight_runs, name):
    got = _run(weight_runs, name)
    streamed = got.phases["streamed"]
    assert streamed.loaded > 0 and streamed.evictions > 0, (streamed.loaded, streamed.evictions, streamed.loads)
    assert any(line.split(": ", 1)[1].startswith(("streamed", "reloaded")) for line in streamed.loads), \
        streamed.loads


@pytest.mark.parametrize("name", NAMES)
def test_free_returns_every_reservation_and_the_memory(weight_runs, name):
    got = _run(weight_runs, name)
    assert got.reservations_before_free, f"{name}: no reservation before /free"
    assert got.reservations_after_free == [], (
        f"{name}: {got.free_seconds} s after POST /free: {got.reservations_after_free}")
    assert got.committed_start, f"{name}: the status gives no committed figure (no membackend_inspect)"
    assert got.committed_after_free == got.committed_start, (got.committed_start, got.committed_after_free)
