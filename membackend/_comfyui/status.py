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

The answer is built here (:func:`runtime_status`), from the runtime's parts and the residency manager's public
figures (``stats``, ``pinned_and_evictable``, ``losses``, ``Model``); nothing here reads the policy's pages.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._version import __version__
from ..types import ConfigChanged, ConfigError, Device, MembackendError, WrongDevice
from . import runtime
from .headroom import LIVE_SOURCE
from .history import committed_bytes
from .lines import log

if TYPE_CHECKING:
    from .runtime import Runtime

__all__ = ["status", "runtime_status", "register_routes", "change_headroom", "web_directory", "ROUTE",
           "HEADROOM_ROUTE"]

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
    """What ``GET /membackend/status`` answers: the runtime's status while one exists, else the start-up
    decision's state and words."""
    rt = runtime.current()
    if rt is not None:
        out = runtime_status(rt)
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


def runtime_state(rt: "Runtime") -> tuple[str, str]:
    """``(state, reason)`` of a runtime: ``running``, ``switched-off`` or ``armed``."""
    if rt.aborted is not None:
        return "switched-off", rt.aborted
    if rt.started:
        return "running", rt.selection.reason
    if rt.started is False:
        return "switched-off", "could not start"
    return "armed", "waiting for ComfyUI to initialise dynamic VRAM; if ComfyUI's start-up is over, it did " \
                    "not (torch or the device lacks dynamic VRAM support), and ComfyUI runs stock"


def runtime_status(rt: "Runtime") -> dict[str, Any]:
    """What ``GET /membackend/status`` answers while a runtime exists: the selection, the patches, the loads,
    unloads and idle give-backs so far; once it started, per device its budget, headroom, kept memory and
    history, and per model its figures (:func:`_models`). Never raises for a figure a backend cannot give."""
    state, reason = runtime_state(rt)
    journal = rt.journal
    unloads, unload_count = journal.unloads_so_far()
    loads, load_count, loaded_bytes = journal.loads_so_far()
    decided = runtime.outcome()
    out: dict[str, Any] = {"version": __version__, "running": rt.running, "state": state, "reason": reason,
                           "backend": rt.name, "how": rt.selection.how, "selection_reason": rt.selection.reason,
                           "started": bool(rt.started), "aborted": rt.aborted, "patched": rt.patches.applied,
                           "not_present": list(rt.patches.skipped), "unloads": unloads, "unload_count": unload_count,
                           "idle": {"times": journal.idles, "bytes": journal.idle_bytes},
                           "how_to": runtime.HOW_TO, "line": decided.line if decided is not None else None,
                           "loads": loads, "load_count": load_count, "loaded_bytes": loaded_bytes,
                           "keep_warm": rt.keep.enabled, "delegates": rt.delegates.held(),
                           "delegates_alive": rt.delegates.alive()}
    session, residency = rt.session, rt.residency
    if session is None or residency is None or rt.started is False:
        return out  # not started, part-way through start, or a start that failed (its session closed)
    rt.sample()
    budgets, held, headroom, windows = {}, {}, {}, {}
    for d in rt.devices:
        budgets[str(d)] = _budget(session, d)
        value, source = rt.headroom.in_force(d)
        lo, hi = rt.headroom.bounds(d)
        headroom[str(d)] = {"bytes": value, "source": source, "live": source == LIVE_SOURCE, "min": lo, "max": hi}
        kept = _kept(session, d)
        if kept is not None:
            held[str(d)] = kept
        kept_windows = _kept_windows(session, d)
        if kept_windows is not None:
            windows[str(d)] = kept_windows
    out["budgets"] = budgets
    out["kept"] = held
    #: per device, the released address windows a backend under a reserve-churn limit keeps (rocm_windows)
    out["kept_windows"] = windows
    out["reservations"] = [{"id": r.id, "device": str(r.device), "size": r.size, "page_size": r.page_size}
                           for r in session.reservations()]
    out["headroom"] = headroom
    out["models"] = _models(rt)
    #: issue 41: the models on ComfyUI's classic path now, the promotions and demotions so far, why the last
    #: models that stayed dynamic did, and the facade's fault and unpin calls (per weight per step) so far
    out["classic"] = {"models": rt.classic.held(), "promoted": rt.classic.promoted, "demoted": rt.classic.demoted,
                      "why_not": dict(rt.classic.why_not)}
    from .vbar import CALLS

    out["calls"] = {"vbar_fault": CALLS[0], "vbar_unpin": CALLS[1]}
    #: issue 41, item 2: per device the bytes of dropped models' weights kept as cache (reclaimable: they go
    #: first), the setting, and the weights' bytes read from files into the device and copied from VRAM instead
    keep = getattr(rt.manager.settings, "keep_dropped", "auto")
    out["cache"] = {str(d): {"bytes": residency.cached(d), "keep_dropped": keep} for d in rt.devices}
    out["reads"] = {"from_file": rt.reuse.from_file, "from_vram": rt.reuse.from_vram}
    out["host_locked"] = _host_locked(rt, budgets)
    #: per model id, what it lost since its last load (``ResidencyManager.losses``): recent evictions
    out["evictions"] = {k: dict(v) for k, v in list(residency.losses.items())}
    out["history"] = rt.history.as_lists()
    return out


def _host_locked(rt: "Runtime", budgets: dict[str, Any]) -> dict[str, Any]:
    """Per device, the host memory page-locked for copies to it: ComfyUI's pins (``TOTAL_PINNED_MEMORY``, what
    its ``cudaHostRegister`` calls locked, ``comfy/pinned_memory.py``) count for ComfyUI's device, none for the
    others (membackend itself locks no host memory). ``one_pool``: the device shares its memory with the host
    (GB10, an APU), where every locked byte is a byte its budget loses, so the adapter turns ComfyUI's pinning
    off there (``MAX_PINNED_MEMORY`` 0, as ComfyUI 0.39 does on integrated GPUs) and the figure stays 0."""
    mm = sys.modules.get("comfy.model_management")
    pinned = getattr(mm, "TOTAL_PINNED_MEMORY", 0) if mm is not None else 0
    comfy_device = str(rt.device_for(None))
    out = {}
    for name, budget in budgets.items():
        locked = int(pinned or 0) if name == comfy_device else 0
        out[name] = {"bytes": max(0, locked), "one_pool": bool(budget.get("unified")),
                     "source": "ComfyUI's pinned host copies (TOTAL_PINNED_MEMORY)" if name == comfy_device
                     else "none: ComfyUI pins for its own device only"}
    return out


def _budget(session: Any, device: Device) -> dict[str, Any]:
    """The budget of ``device``, with the split under the headroom in force where the backend gives one: the
    process's other use, the weights' room and what is resident."""
    b = session.budget_query(device)
    out: dict[str, Any] = {"total": b.total, "free": b.free, "headroom": b.headroom, "usable": b.usable,
                           "source": b.source, "unified": b.unified}
    try:
        split = session.room_split(device)
    except Exception as exc:  # noqa: BLE001 - the status never fails on it
        log.debug("membackend: the room split of %s for the status: %s: %s", device, type(exc).__name__, exc)
        split = None
    if split is not None:
        out["split"] = {"room": split.room, "other": split.other, "weights_room": split.weights_room,
                        "weights_resident": split.resident, "kept": split.held - split.resident}
    return out


def _kept(session: Any, device: Device) -> dict[str, Any] | None:
    """What the backend keeps for reuse on ``device`` (kept address windows included) and what the driver holds
    for the process; None where it cannot say."""
    try:
        inspected = session.inspect(device)
    except Exception as exc:  # noqa: BLE001 - the status never fails on it
        log.debug("membackend: inspecting %s for the status failed: %s: %s", device, type(exc).__name__, exc)
        return None
    if inspected is None:
        return None
    return {"held": inspected.held, "committed": committed_bytes(inspected), "source": inspected.source,
            "hazards": inspected.hazards, "calls": dict(inspected.calls or {})}


def _kept_windows(session: Any, device: Device) -> dict[str, Any] | None:
    """What the backend says it keeps of released address windows on ``device`` (``kept_windows``: the vmm
    backend under a reserve-churn limit), with its line; None where it keeps none or cannot say."""
    report = session.members.kept_windows  # read once with the session (hookspec.OptionalMembers)
    if report is None:
        return None
    try:
        r = report(device)
    except Exception as exc:  # noqa: BLE001 - the status never fails on it
        log.debug("membackend: kept windows of %s for the status: %s: %s", device, type(exc).__name__, exc)
        return None
    if r is None:
        return None
    return {"windows": r.windows, "bytes": r.bytes, "largest": r.largest, "bound": r.bound,
            "bound_rule": r.bound_rule, "reason": r.reason, "give_back": r.give_back,
            "large_frees_spent": r.large_frees_spent, "large_frees_allowed": r.large_frees_allowed,
            "line": r.describe()}


def _models(rt: "Runtime") -> dict[str, Any]:
    """Per model (by id): ``resident`` and ``reserved`` (``ResidencyManager.stats``), and ``name``,
    ``size`` (its weights' bytes, as ComfyUI staged them), ``address_range`` (the bytes of address space
    ComfyUI reserved for it, about ten times its size), ``device``, ``pinned`` and ``evictable`` bytes
    (``ResidencyManager.pinned_and_evictable``), ``state`` (``cached``: ComfyUI dropped it, what is resident
    of it is cache, reclaimable; ``pinned``: a layer is in use now; ``warm``: every
    page of its weights resident; ``partly resident``; ``not resident``), ``held`` (kept warm by the adapter),
    ``path`` (``classic``: ComfyUI runs it as a fully loaded model, no fault per weight; ``dynamic``) and
    ``last_used`` (epoch seconds, None: not loaded by ComfyUI yet)."""
    held = {id(v._model) for p in list(rt.keep.held.values())
            for v in (getattr(getattr(p, "model", None), "dynamic_vbars", None) or {}).values()
            if hasattr(v, "_model")}
    residency, journal = rt.residency_manager(), rt.journal
    stats = residency.stats()
    out: dict[str, Any] = {}
    for m in residency.models():
        row = dict(stats.get(m.id, {"resident": 0, "reserved": False}))
        path = "classic" if row.pop("held", False) else "dynamic"  # the residency's hold: the classic path
        pinned = evictable = page = 0
        for dev in m.devices:
            r = m.reservation(dev)
            if r is None:
                continue
            page = r.page_size
            on_dev = residency.pinned_and_evictable(m, dev)
            pinned, evictable = pinned + on_dev[0], evictable + on_dev[1]
        resident = row["resident"]
        weights = journal.weights.get(m.id, 0)
        whole = -(-weights // page) * page if weights and page else m.size  # the pages the weights span
        state = ("cached" if row.pop("cached", False) else "pinned" if pinned else "warm" if resident >= whole
                 else "partly resident" if resident else "not resident")
        row.update(name=journal.display_name(m.id), size=weights, address_range=m.size,
                   device=", ".join(map(str, m.devices)), kind=m.kind.value, pinned=pinned, evictable=evictable,
                   state=state, held=id(m) in held, last_used=journal.last_used.get(m.id),
                   path=path)
        out[m.id] = row
    return out


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
        where = "; ".join(f"from {lo} to {hi} bytes on {d}" for d in devices for lo, hi in [rt.headroom.bounds(d)])
    except Exception:
        where = ""
    where = where or "from 0 to the device's total"
    served = ", ".join(map(str, getattr(rt, "devices", []))) or "none"
    return (f'{{"device": one of {served} (default: the first), "headroom": {SIZE_ACCEPTED}, {where}; '
            f'or null: back to the start-up value}}')


def change_headroom(body: Any) -> tuple[int, dict[str, Any]]:
    """``POST /membackend/headroom``'s answer: ``(HTTP status, JSON)``.

    ``body`` is ``{"device": "cuda:0", "headroom": "2GiB" | bytes | null, "save": false}`` (``device``
    optional: the first served). 200: ``Headroom.set_live``'s answer (the value in force, its source,
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
        rt.headroom.parse(rt.device_named(device), body["headroom"])
    except (ValueError, TypeError) as exc:  # InvalidSize, WrongDevice
        return BAD_INPUT, _error(exc, _accepted(rt, device))
    try:
        return 200, rt.headroom.set_live(device, body["headroom"], then=_save if save else None)
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
