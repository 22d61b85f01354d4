"""``GET /membackend/status``: the backend, budgets, live reservations and residency per model, as JSON.

Registered by the custom node's ``__init__.py`` on ComfyUI's running server
(``server.PromptServer.instance.routes``); the response is built with the
server module's own ``web`` (aiohttp's). When membackend is not running the
route answers ``{"running": false, ...}`` with the reason.
"""

from __future__ import annotations

import sys
from typing import Any

from .._version import __version__
from . import startup

__all__ = ["status", "register_routes", "ROUTE"]

ROUTE = "/membackend/status"


def status() -> dict[str, Any]:
    rt = startup.current()
    if rt is None:
        return {"running": False, "version": __version__,
                "reason": "membackend is off, selected aimdo, found no accelerator backend, or switched itself off "
                          "(see the 'membackend' line of ComfyUI's start-up log)"}
    return {"running": rt.aborted is None and bool(rt.started), **rt.status()}


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
