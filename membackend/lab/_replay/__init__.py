"""The replay engine: the seed reports' workloads and recorded traces, stock and plugin side by side.

``membackend replay SCENARIO|TRACE_FILE`` (:func:`membackend.lab._replay.compare.replay`) runs a
built-in scenario (:mod:`~membackend.lab._replay.scenarios`) or a trace file recorded with
``MEMBACKEND_TRACE`` (:mod:`~membackend.lab._replay.traceformat`) through the residency policy and a
backend on a simulated profile, once as stock ComfyUI + comfy-aimdo
(:mod:`~membackend.lab._replay.stock`) and once with membackend (:mod:`~membackend.lab._replay.engine`),
and prints one table. Each side records its timeline (:mod:`~membackend.lab._replay.timeline`).

Not here: the pictures ``--plot`` draws from those timelines (:mod:`membackend.lab._pictures`) and the
benchmark suite ``membackend bench`` runs (:mod:`membackend.lab.bench`, public), which replays every
built-in scenario among its benchmarks.
"""
