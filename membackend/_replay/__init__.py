"""The replay engine: the seed reports' workloads and recorded traces, stock and plugin side by side.

``membackend replay SCENARIO|TRACE_FILE`` (:func:`membackend._replay.compare.replay`) runs a
built-in scenario (:mod:`~membackend._replay.scenarios`) or a trace file recorded with
``MEMBACKEND_TRACE`` (:mod:`~membackend._replay.traceformat`) through the residency policy and a
backend on a simulated profile, once as stock ComfyUI + comfy-aimdo
(:mod:`~membackend._replay.stock`) and once with membackend (:mod:`~membackend._replay.engine`),
and prints one table. Each side records its timeline (:mod:`~membackend._replay.timeline`).

Not here: the pictures ``--plot`` draws from those timelines (:mod:`membackend._pictures`) and the
benchmark suite ``membackend bench`` runs (:mod:`membackend.bench`, public), which replays every
built-in scenario among its benchmarks.
"""
