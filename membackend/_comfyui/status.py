"""membackend's routes on ComfyUI's server, and the memory panel's files.

* ``GET /membackend/status`` -- the backend, budgets, live reservations and residency per model, as JSON;
* ``POST /membackend/headroom`` -- change the headroom (the VRAM kept free) of a served device for the rest
  of this ComfyUI session, and with ``"save": true`` for the next starts too (:func:`change_headroom`);
* :func:`web_directory` -- the folder the custom node gives ComfyUI as its ``WEB_DIRECTORY``: the memory
  panel (plain JavaScript, served under ``/extensions/membackend/``).

Registered by the custom node's ``__init__.py`` on ComfyUI's running server
(``server.PromptServer.instance.routes``); responses are built with the server module's own ``web``
(aiohttp's). Every status answer has ``running`` (bool), ``state`` and ``reason``; ``state`` is one of:

* ``disabled`` -- ``MEMBACKEND_DISABLE`` is set;
* ``stock`` -- the start-up decision left ComfyUI stock (its dynamic VRAM is off,
  ``aimdo`` is selected, no GPU backend fits, the backend serves no GPU, the device
  is the CPU), or ComfyUI never initialised dynamic VRAM after membackend armed;
* ``armed`` -- waiting for ComfyUI to initialise dynamic VRAM;
* ``running`` -- membackend serves ComfyUI's dynamic VRAM;
* ``switched-off`` -- it started (or tried to) and switched itself off (G6);
* ``not-started`` -- the prestartup script failed, or never ran (the node not installed
  as a prestartup script, or ComfyUI's ``--disable-all-custom-nodes``).

``reason`` is the start-up line's words, or the cause; ``line`` the start-up line itself.
While a runtime exists the answer also has ``budgets``, ``headroom`` (per device: ``bytes``, ``source`` in
words, ``live``, ``min``/``max``), ``models`` (per model id: name, size, resident, pinned, evictable, state,
last_used), ``loads`` (the most recent loads, each with its line's ``text``), ``unloads`` and ``history``
(per device ``[time, reserved, resident, committed]`` samples over the last minutes).
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
from pathlib import Path
from typing import Any

from .._version import __version__
from ..types import ConfigChanged, ConfigError, MembackendError, WrongDevice
from . import runtime

__all__ = ["status", "register_routes", "change_headroom", "web_directory", "ROUTE", "HEADROOM_ROUTE"]

ROUTE = "/membackend/status"
HEADROOM_ROUTE = "/membackend/headroom"
#: HTTP status per refusal: bad input 400; membackend not serving (nothing to change) 409; anything else 500
BAD_INPUT = 400
NOT_SERVING = 409
CONFLICT = 409  # a save found the file changed since it read it
FAILED = 500


def web_directory() -> str:
    """The memory panel's folder (absolute): ComfyUI serves it under ``/extensions/<node folder>/``."""
    return str(Path(__file__).resolve().parent / "web")


def status() -> dict[str, Any]:
    rt = runtime.current()
    if rt is not None:
        out = rt.status()
        if out["state"] == "armed" and _startup_over():
            out["state"] = "stock"
            out["reason"] = ("ComfyUI did not initialise dynamic VRAM (its torch or device lacks support), so "
                             "membackend never started and ComfyUI runs stock")
        return out
    decided = runtime.outcome()
    if decided is None:
        return {"running": False, "version": __version__, "state": "not-started",
                "reason": "membackend's prestartup script did not run in this ComfyUI", "line": None,
                "how_to": runtime.HOW_TO}
    return {"running": False, "version": __version__, "state": decided.state, "reason": decided.reason,
            "line": decided.line, "how_to": runtime.HOW_TO}


def _startup_over() -> bool:
    """ComfyUI serves requests only after ``init_devices`` would have been called."""
    return getattr(getattr(sys.modules.get("server"), "PromptServer", None), "instance", None) is not None


def dumps(answer: Any) -> str:
    """A route's answer as strict JSON, always: a float that is not finite becomes null, an int beyond 64 bits
    and anything JSON has no type for become text (``json.dumps`` would write ``NaN`` or fail)."""
    try:
        return json.dumps(answer, allow_nan=False)
    except (TypeError, ValueError):
        return json.dumps(_json_safe(answer), allow_nan=False)


def _json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"<an integer of {value.bit_length()} bits>"
    if value is None or isinstance(value, (str, int)):
        return value
    return str(value)[:200]


def _error(exc: BaseException, accepted: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"error": type(exc).__name__, "message": str(exc)}
    if accepted is not None:
        out["accepted"] = accepted
    return out


def _accepted(rt: Any, device: Any) -> str:
    """The accepted input of the headroom route, with the range of ``device`` where it is known."""
    from .._settings import SIZE_ACCEPTED

    try:
        devices = [rt.device_named(device)]
    except Exception:  # a device not served: the range of each served one
        devices = list(getattr(rt, "devices", []))
    try:
        where = "; ".join(f"from {lo} to {hi} bytes on {d}" for d in devices for lo, hi in [rt.headroom_range(d)])
    except Exception:
        where = ""
    where = where or "from 0 to the device's total"
    served = ", ".join(map(str, getattr(rt, "devices", []))) or "none"
    return (f'{{"device": one of {served} (default: the first), "headroom": {SIZE_ACCEPTED}, {where}; '
            f'or null: back to the start-up value}}')


def change_headroom(body: Any) -> tuple[int, dict[str, Any]]:
    """``POST /membackend/headroom``'s answer: ``(HTTP status, JSON)``.

    ``body`` is ``{"device": "cuda:0", "headroom": "2GiB" | bytes | null, "save": false}`` (``device``
    optional: the first served). 200: ``Runtime.set_headroom_live``'s answer (the value in force, its source,
    the bytes freed, the new budget). ``"save": true`` also writes the value as the ``headroom`` setting of
    the ``membackend.toml`` in force (``MEMBACKEND_CONFIG``, else the one in ComfyUI's working folder), for
    every device from the next start on; the answer adds ``saved`` (the file) and ``note`` where
    ``MEMBACKEND_HEADROOM``, read before the file, will win over it (ComfyUI's ``--reserve-vram`` and
    ``--vram-headroom`` are combined with the saved value at start-up, as with any headroom setting). A save
    that fails puts the previous headroom back and answers the ``ConfigError`` naming the file (500), or
    ``ConfigChanged`` (409) when the file changed while it was being saved (the user's edit is kept; saving
    again reads it anew). A refusal changes nothing and answers ``{"error": <type in membackend.types>,
    "message": ..., "accepted": ...}``: 400 for bad input (``ConfigError`` a body that is not such an
    object, ``InvalidSize`` a value that is not a size in range, ``WrongDevice`` a device not served), 409
    while membackend serves no device (``WrongDevice``), 500 when freeing what no longer fits failed (the
    previous headroom is back in force)."""
    from .._settings import quoted

    rt = runtime.current()
    if rt is None or not rt.running:
        st = status()
        exc = WrongDevice(f"membackend serves no device in this ComfyUI ({st['state']}: {st['reason']}); "
                          f"accepted: a live change while membackend runs")
        return NOT_SERVING, _error(exc, "a live change while membackend runs")
    save = body.get("save", False) if isinstance(body, dict) else False
    if not isinstance(body, dict) or "headroom" not in body or not set(body) <= {"device", "headroom", "save"} \
            or not isinstance(save, bool) or (save and body["headroom"] is None):
        accepted = _accepted(rt, None)
        bad = ConfigError("headroom", f"POST {HEADROOM_ROUTE}", f"the request body must be a JSON object with "
                          f"\"headroom\" (and optionally \"device\", and \"save\": true or false; a saved "
                          f"headroom is a size, not null), got {quoted(body)}", accepted)
        return BAD_INPUT, _error(bad, accepted)
    device = body.get("device")
    try:  # bad input is refused before anything changes
        rt.parse_headroom(rt.device_named(device), body["headroom"])
    except (ValueError, TypeError) as exc:  # InvalidSize, WrongDevice
        return BAD_INPUT, _error(exc, _accepted(rt, device))
    try:
        return 200, rt.set_headroom_live(device, body["headroom"], then=_save if save else None)
    except ConfigChanged as exc:  # the user edited the file during the save: kept, and the change undone
        return CONFLICT, _error(exc)
    except MembackendError as exc:  # freeing or saving failed: the previous headroom is back
        return FAILED, _error(exc)


def _save(headroom: int) -> dict[str, Any]:
    """Write ``headroom`` bytes as the ``headroom`` setting of the ``membackend.toml`` in force; what the
    answer adds: ``saved`` (the file) and, where a source read before the file wins over it, ``note``."""
    import os

    from .._settings import format_bytes, save_setting

    path = save_setting("headroom", format_bytes(headroom))
    answer: dict[str, Any] = {"saved": str(path.resolve())}
    if os.environ.get("MEMBACKEND_HEADROOM", "").strip():
        answer["note"] = "MEMBACKEND_HEADROOM is set: it wins over the file at the next start"
    return answer


def register_routes() -> bool:
    """Add the routes when ComfyUI's server exists; False (nothing done) when it does not."""
    server = sys.modules.get("server")
    instance = getattr(getattr(server, "PromptServer", None), "instance", None)
    web = getattr(server, "web", None)
    if instance is None or web is None:
        return False

    @instance.routes.get(ROUTE)
    async def membackend_status(request: Any) -> Any:
        # the status takes the policy's lock, which a fault may hold while it waits for copies: off the loop
        return web.json_response(await asyncio.get_running_loop().run_in_executor(None, status), dumps=dumps)

    @instance.routes.post(HEADROOM_ROUTE)
    async def membackend_headroom(request: Any) -> Any:
        try:
            body = await request.json()
        except Exception as exc:  # not JSON at all
            rt = runtime.current()
            accepted = _accepted(rt, None) if rt is not None else ""
            err = ConfigError("headroom", f"POST {HEADROOM_ROUTE}",
                              f"the request body is not JSON ({type(exc).__name__}: {exc})", accepted)
            return web.json_response(_error(err, accepted or None), status=BAD_INPUT, dumps=dumps)
        # freeing what no longer fits may wait for copies on the device: off the server's event loop
        code, answer = await asyncio.get_running_loop().run_in_executor(None, change_headroom, body)
        return web.json_response(answer, status=code, dumps=dumps)

    return True
