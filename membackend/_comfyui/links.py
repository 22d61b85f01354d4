"""What an adapter part reads of the runtime as it is now, handed to it when the runtime builds it.

The runtime (:mod:`.runtime`) composes the adapter's parts. A part never holds the runtime: it gets a
:class:`RuntimeLinks`, zero-argument callables answering what the runtime has *now* (the residency manager and
the copy fences exist only once ComfyUI's ``init_devices`` started membackend; ``aborted`` is set when the
adapter switches itself off), and the set of live VBARs, which lives as long as the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["RuntimeLinks"]


@dataclass(frozen=True)
class RuntimeLinks:
    """``residency()``: the residency manager, None before the start; ``fences()``: the copy fences
    (``CopyFences``), None before the start; ``aborted()``: why the adapter switched itself off, None while it
    serves; ``vbars``: the facade's live VBARs (a ``WeakSet``, iterate a copy)."""

    residency: Callable[[], Any]
    fences: Callable[[], Any]
    aborted: Callable[[], str | None]
    vbars: Any
