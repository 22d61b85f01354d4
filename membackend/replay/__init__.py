"""Replays and benchmarks: the seed reports' workloads, stock and plugin side by side.

``membackend replay SCENARIO|TRACE_FILE`` (:func:`membackend.replay.compare.replay`) runs a
built-in scenario (:mod:`~membackend.replay.scenarios`) or a trace file recorded with
``MEMBACKEND_TRACE`` (:mod:`~membackend.replay.traceformat`) through the residency policy and a
backend on a simulated profile, once as stock ComfyUI + comfy-aimdo
(:mod:`~membackend.replay.stock`) and once with membackend (:mod:`~membackend.replay.engine`),
and prints one table; ``--plot`` draws the timeline (:mod:`~membackend.replay.plot`).
"""
