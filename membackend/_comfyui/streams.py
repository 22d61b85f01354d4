"""Fence tokens for the copies ComfyUI's cast path starts on its streams (G2).

ComfyUI's ops cast path faults a module's range (pinning it), copies the
weights into it on an offload stream, makes the compute stream wait for that
copy, queues the layer's compute, and unpins -- all without waiting: on the
host side the unpin returns while the copy and the compute reading the range
may still be queued. A free, an eviction or a full unload of that range after
the unpin must wait for them.

So at every unpin (:meth:`CopyFences.after_unpin`) the adapter records an
event on ComfyUI's current stream for the device -- the compute stream, which
already waits for the offload stream's copy -- as a fence token on the model's
reservation (``ResidencyManager.record``). The session waits for the token
before any free or release of that reservation.

**Which stream.** ``comfy.model_management.current_stream(device)`` when this
ComfyUI has it and it answers a stream; else, for a ``cuda``/``hip`` device,
``torch.cuda.current_stream(index)``; else none (copies on a CPU device are
synchronous in ComfyUI, nothing to fence). A stream is anything with
``record_event()`` returning an event with ``query()`` and ``synchronize()``
(torch's CUDA streams and events, and the stand-in's).

**Bounded.** Events on one stream complete in order, so one token per model
and stream is kept and moved to the newest event (:class:`StreamToken`); a new
one is recorded only after a fence took the previous one. A token never
outlives the fence that waited for it.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from ..types import ReservationReleased

__all__ = ["StreamToken", "CopyFences"]


class StreamToken:
    """A fence token (``done()``/``wait()``) over the newest event recorded on one stream.

    :meth:`advance` moves it to a newer event of the same stream (which completes
    after every older one); it answers False once a fence has taken the token
    (:meth:`wait` called), so the caller records a new token instead.
    """

    __slots__ = ("_event", "_taken", "_lock")

    def __init__(self, event: Any):
        self._event = event
        self._taken = False
        self._lock = threading.Lock()

    def advance(self, event: Any) -> bool:
        with self._lock:
            if self._taken:
                return False
            self._event = event
            return True

    def done(self) -> bool:
        with self._lock:
            event = self._event
        return bool(event.query())

    def wait(self) -> None:
        with self._lock:
            event = self._event
            self._taken = True
        event.synchronize()

    def __repr__(self) -> str:
        return f"StreamToken(taken={self._taken})"


class CopyFences:
    """Records, per model and stream, the token the cast path's copies are fenced by.

    ``enabled`` False records nothing (what the race test switches off to show it
    would catch a free that does not wait).
    """

    def __init__(self, residency: Any):
        self.residency = residency
        self.enabled = True
        self.recorded = 0  # tokens handed to the session (not advances)
        self._tokens: dict[tuple[str, int], tuple[Any, StreamToken]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def stream_for(where: str) -> Any:
        """ComfyUI's current stream for the torch device ``where`` that reads a model's pages
        (``Session.tensor_device``); None when copies there are synchronous (the CPU)."""
        import torch

        tdev = torch.device(where)
        mm = sys.modules.get("comfy.model_management")
        fn = getattr(mm, "current_stream", None)
        stream = fn(tdev) if callable(fn) else None
        if stream is None and tdev.type == "cuda":
            stream = torch.cuda.current_stream(tdev.index)
        return stream if callable(getattr(stream, "record_event", None)) else None

    def after_unpin(self, model: Any, dev: Any, where: str) -> None:
        """Fence the reservation of ``model`` on ``dev`` by everything queued so far on the current stream of
        ``where``, the torch device ComfyUI reads the pages on."""
        if not self.enabled:
            return
        stream = self.stream_for(where)
        if stream is None:
            return
        event = stream.record_event()
        key = (model.id, id(stream))
        with self._lock:
            held = self._tokens.get(key)
            if held is not None and held[0] is stream and held[1].advance(event):
                return
            token = StreamToken(event)
            try:
                self.residency.record(model, token, dev)
            except ReservationReleased:
                self._tokens.pop(key, None)  # fully unloaded meanwhile: the unload fenced; nothing to keep
                return
            self._tokens[key] = (stream, token)
            self.recorded += 1

    def forget(self, model: Any) -> None:
        with self._lock:
            for key in [k for k in self._tokens if k[0] == model.id]:
                del self._tokens[key]
