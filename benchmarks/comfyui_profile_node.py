"""A custom node the ComfyUI benchmark installs beside membackend's (never part of membackend): a prompt's
Python time, and the share of it spent in membackend's own code, from ``cProfile``.

``POST /membackend_bench/profile`` with ``{"on": true}`` profiles every prompt from then on (on the prompt
worker's thread, the one that runs the model) until ``{"on": false}``; ``GET /membackend_bench/profile``
answers the last profiled prompt's figures: ``total_s`` (the profile's own time of the whole prompt, slowed by
the profiling), ``membackend_s`` (time inside functions of files under a ``membackend`` folder, their callees
outside membackend left out), ``calls`` (the calls of those functions) and ``top`` (the ten costliest of them).
Copied into ``custom_nodes/membackend_bench_profile/__init__.py`` of the served tree by
``benchmarks/bench_comfyui_gpu.py``.
"""

import cProfile
import os
import pstats
import threading

NODE_CLASS_MAPPINGS = {}

_state = {"on": False, "last": None}
_lock = threading.Lock()


def _ours(filename):
    parts = filename.replace("\\", "/").split("/")
    return "membackend" in parts[:-1] and "membackend_bench_profile" not in parts


def _figures(profile):
    stats = pstats.Stats(profile)
    total = stats.total_tt
    mine = [(key, v) for key, v in stats.stats.items() if _ours(key[0])]
    own = sum(v[2] for _, v in mine)  # tottime: the function's own time, not its callees'
    calls = sum(v[1] for _, v in mine)
    top = sorted(mine, key=lambda kv: -kv[1][2])[:10]
    return {"total_s": round(total, 4), "membackend_s": round(own, 4), "calls": calls,
            "top": [{"function": f"{os.path.basename(k[0])}:{k[1]}:{k[2]}", "seconds": round(v[2], 5),
                     "calls": v[1]} for k, v in top]}


def _install():
    import execution
    import server

    original = execution.PromptExecutor.execute

    def execute(self, *args, **kwargs):
        if not _state["on"]:
            return original(self, *args, **kwargs)
        profile = cProfile.Profile()
        profile.enable()
        try:
            return original(self, *args, **kwargs)
        finally:
            profile.disable()
            with _lock:
                _state["last"] = _figures(profile)

    execution.PromptExecutor.execute = execute
    routes = server.PromptServer.instance.routes
    web = server.web

    @routes.post("/membackend_bench/profile")
    async def switch(request):
        body = await request.json()
        _state["on"] = bool(body.get("on"))
        return web.json_response({"on": _state["on"]})

    @routes.get("/membackend_bench/profile")
    async def last(request):
        with _lock:
            return web.json_response(_state["last"] or {})


_install()
