"""Served workflows: ComfyUI's API with and without membackend gives the same images.

Each configuration starts ComfyUI's server once (``--listen 127.0.0.1``, a free port), runs an
``EmptyImage -> SaveImage`` workflow and a ``VAELoader -> VAEEncode -> VAEDecode -> SaveImage`` one
(a TAESD with seeded random weights, built by the harness) and hashes the saved PNGs. The adapter's
configurations must give stock's bytes, and their server logs no traceback that stock's lacks:
membackend off, the host fallback (both against stock ``--cpu``), and membackend taking over on the
simulated H200 under ``--cpu --enable-dynamic-vram`` (against stock with the same flags; where that
stock server cannot start -- comfy-aimdo refuses a CPU device -- against stock ``--cpu``, and the
report says so). In the take-over case the status route says membackend runs ``vmm`` with patches in
place, and ``POST /free`` unloading every model leaves no reservation.
"""

from __future__ import annotations

from collections import Counter

import pytest

from . import harness

STATES = {"disabled", "stock", "armed", "running", "switched-off", "not-started"}


def _ok(got: harness.Served) -> harness.Served:
    if got.error:
        pytest.fail(f"{got.name} ({' '.join(got.flags)}, {got.env}): {got.error}", pytrace=False)
    return got


def _reference(served, name: str) -> harness.Served:
    """The stock run ``name``'s outputs are compared with (recorded in the report)."""
    if name == "takeover-h200":
        dynamic = served["stock-dynamic"]
        if not dynamic.error:
            ref = dynamic
        else:
            ref = served["stock"]
    else:
        ref = served["stock"]
    served.report.put("served_references", {**served.report.data.get("served_references", {}), name: ref.name})
    return _ok(ref)


@pytest.mark.parametrize("name", ["disabled", "host-fallback", "takeover-h200"])
def test_served_outputs_match_stock(served, name: str) -> None:
    got = _ok(served[name])
    ref = _reference(served, name)
    assert got.hashes == ref.hashes, f"{name} saved other images than {ref.name}: {got.hashes} vs {ref.hashes}"
    new = sorted((Counter(got.exceptions) - Counter(ref.exceptions)).elements())
    assert not new, f"{name}: tracebacks in the server's log that {ref.name} does not have: {new}"


@pytest.mark.parametrize("name,state", [("disabled", "disabled"), ("host-fallback", "stock")])
def test_status_route_when_stock(served, name: str, state: str) -> None:
    got = _ok(served[name])
    assert got.status_code == 200, f"GET /membackend/status answered {got.status_code}: {got.status}"
    st = got.status
    assert isinstance(st, dict) and st.get("running") is False, st
    assert st.get("state") == state, f"state {st.get('state')!r}, expected {state!r}: {st}"
    assert isinstance(st.get("reason"), str) and st["reason"], st


def test_takeover_status_and_free(served) -> None:
    got = _ok(served["takeover-h200"])
    assert got.status_code == 200, f"GET /membackend/status answered {got.status_code}: {got.status}"
    st = got.status
    assert isinstance(st, dict), st
    assert st.get("running") is True, st
    assert st.get("state") == "running" and st["state"] in STATES, st
    assert st.get("backend") == "vmm", st
    assert isinstance(st.get("reason"), str), st
    assert isinstance(st.get("patched"), list) and st["patched"], st
    assert isinstance(st.get("reservations"), list), st
    after = got.after_free
    assert isinstance(after, dict) and after.get("reservations") == [], (
        f"reservations left {got.free_seconds} s after POST /free with unload_models: "
        f"{after.get('reservations') if isinstance(after, dict) else after}")


def test_stock_dynamic_baseline_recorded(served) -> None:
    """Whether stock ComfyUI serves under ``--cpu --enable-dynamic-vram`` here (recorded, not judged:
    comfy-aimdo's ``init_devices`` refuses a CPU device, so on a machine without a GPU it does not)."""
    got = served["stock-dynamic"]
    served.report.put("stock_dynamic_serves", got.error is None)
    if got.error:
        pytest.skip("stock ComfyUI does not serve with --cpu --enable-dynamic-vram here: "
                    + got.error.splitlines()[0][:300] + " (the take-over case is compared with stock --cpu)")


def test_the_harnesss_own_interrupt_is_not_counted_as_the_configurations_traceback() -> None:
    """The harness stops each server with SIGINT; a KeyboardInterrupt that lands in aiohttp after ComfyUI's
    "Stopped server" (timing: stock's log can have it too) is the harness's, any other traceback still counts."""
    def traceback(last: str) -> str:
        return f"Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n{last}\n"

    log = (traceback("KeyboardInterrupt") + "Prompt executed\n" + harness.SERVER_STOPPED + "\n"
           + traceback("KeyboardInterrupt") + traceback("RuntimeError: closing failed"))
    assert harness.exceptions(log) == {"KeyboardInterrupt": 2, "RuntimeError: closing failed": 1}
    assert harness.exceptions(log, stopped_by_us=True) == {"KeyboardInterrupt": 1, "RuntimeError: closing failed": 1}
