"""``GET /membackend/status``: the backend, budgets, live reservations and residency per model, as JSON.

Registered by the custom node's ``__init__.py`` on ComfyUI's running server
(``server.PromptServer.instance.routes``); the response is built with the
server module's own ``web`` (aiohttp's). Every answer has ``running`` (bool),
``state`` and ``reason``; ``state`` is one of:

* ``disabled`` -- ``MEMBACKEND_DISABLE`` is set;
* ``stock`` -- the start-up decision left ComfyUI stock (its dynamic VRAM is off,
  ``aimdo`` is selected, no GPU backend fits, the backend serves no GPU, the device
  is the CPU), or ComfyUI never initialised dynamic VRAM after membackend armed;
* ``armed`` -- waiting for ComfyUI to initialise dynamic VRAM;
* ``running`` -- membackend serves ComfyUI's dynamic VRAM;
* ``switched-off`` -- it started (or tried to) and switched itself off (G6);
* ``not-started`` -- the prestartup script failed, or never ran (the node not installed
  as a prestartup script, or ComfyUI's ``--disable-all-custom-nodes``).

``reason`` is the start-up line's words, or the cause.
"""

from __future__ import annotations

import sys
from typing import Any

from .._version import __version__
from . import runtime

__all__ = ["status", "register_routes", "ROUTE"]

ROUTE = "/membackend/status"


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
                "reason": "membackend's prestartup script did not run in this ComfyUI"}
    return {"running": False, "version": __version__, "state": decided.state, "reason": decided.reason,
            "line": decided.line}


def _startup_over() -> bool:
    """ComfyUI serves requests only after ``init_devices`` would have been called."""
    return getattr(getattr(sys.modules.get("server"), "PromptServer", None), "instance", None) is not None


def register_routes() -> bool:
    """Add the route when ComfyUI's server exists; False (nothing done) when it does not."""
    server = sys.modules.get("server")
    instance = getattr(getattr(server, "PromptServer", None), "instance", None)
    web = getattr(server, "web", None)
    if instance is None or web is None:
        return False

    @instance.routes.get(ROUTE)
    async def membackend_status(request: Any) -> Any:
        return web.json_response(status())

    return True
