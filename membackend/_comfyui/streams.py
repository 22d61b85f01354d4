"""Fence tokens for the copies ComfyUI's cast path starts on its streams (G2).

ComfyUI's ops cast path faults a module's range (pinning it), copies the
weights into it on an offload stream, makes the compute stream wait for that
copy, queues the layer's compute, and unpins -- all without waiting: on the
host side the unpin returns while the copy and the compute reading the range
may still be queued. A free, an eviction or a full unload of that range after
the unpin must wait for them.

So at every unpin (:meth:`CopyFences.after_unpin`) the adapter marks a fence token
on the model's reservation (``ResidencyManager.record``) for ComfyUI's current
stream for the device -- the compute stream, which already waits for the
offload stream's copy. The session waits for the token before any free or
release of that reservation.

**Lazy events.** An unpin records no event: it runs per weight per step, and an
event per unpin cost more than comfy-aimdo's whole unpin. Work on one stream
completes in order, so an event recorded on that stream when a fence asks
(:meth:`StreamToken.done` / :meth:`StreamToken.wait`) completes after every copy
and kernel queued on it before -- those of the unpins it stands for included.
A fence may thus wait a little longer than the unpinned work (for what was
queued after it), never shorter.

**Which stream.** ``comfy.model_management.current_stream(device)`` when this
ComfyUI has it and it answers a stream; else, for a ``cuda``/``hip`` device,
``torch.cuda.current_stream(index)``; else none (copies on a CPU device are
synchronous in ComfyUI, nothing to fence). A stream is anything with
``record_event()`` returning an event with ``query()`` and ``synchronize()``
(torch's CUDA streams and events, and the stand-in's).

**Bounded.** One token per model and stream is kept; an unpin marks it again
(:meth:`StreamToken.touch`); a new one is recorded only after a fence took the
previous one. A token never outlives the fence that waited for it.
"""

from __future__ import annotations

import functools
import sys
import threading
from typing import Any

from ..types import ReservationReleased

__all__ = ["StreamToken", "CopyFences"]


@functools.lru_cache(maxsize=64)
def _torch_device(where: str) -> Any:
    """``torch.device(where)``, made once per name (asked per weight per step)."""
    import torch

    return torch.device(where)


class StreamToken:
    """A fence token (``done()``/``wait()``) over the work queued on one stream up to the fence.

    Created marked: work was queued. :meth:`touch` marks it again (more work queued); the first
    ``done()`` or ``wait()`` after a mark records an event on the stream then, which completes after
    all of that work. It answers False once a fence has taken the token (:meth:`wait` called), so the
    caller records a new token instead.
    """

    __slots__ = ("_stream", "_event", "_marked", "_taken", "_lock")

    def __init__(self, stream: Any):
        self._stream = stream
        self._event: Any = None
        self._marked = True
        self._taken = False
        self._lock = threading.Lock()

    def touch(self) -> bool:
        """More work was queued on the stream for this token's range; False once a fence took it."""
        with self._lock:
            if self._taken:
                return False
            self._marked = True
            return True

    def _event_now(self) -> Any:
        # under self._lock: an event after everything queued on the stream up to now, when marked since the last
        if self._marked:
            self._event = self._stream.record_event()
            self._marked = False
        return self._event

    def done(self) -> bool:
        with self._lock:
            event = self._event_now()
        return event is None or bool(event.query())

    def wait(self) -> None:
        with self._lock:
            event = self._event_now()
            self._taken = True
        if event is not None:
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
        self.recorded = 0  # tokens handed to the session (not touches)
        self._tokens: dict[tuple[str, int], tuple[Any, StreamToken]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def stream_for(where: str) -> Any:
        """ComfyUI's current stream for the torch device ``where`` that reads a model's pages
        (``Session.tensor_device``); None when copies there are synchronous (the CPU)."""
        tdev = _torch_device(where)
        mm = sys.modules.get("comfy.model_management")
        fn = getattr(mm, "current_stream", None)
        stream = fn(tdev) if callable(fn) else None
        if stream is None and tdev.type == "cuda":
            import torch

            stream = torch.cuda.current_stream(tdev.index)
        return stream if callable(getattr(stream, "record_event", None)) else None

    def after_unpin(self, model: Any, dev: Any, where: str) -> None:
        """Fence the reservation of ``model`` on ``dev`` by everything queued so far on the current stream of
        ``where``, the torch device ComfyUI reads the pages on (lazily: see the module docstring)."""
        if not self.enabled:
            return
        stream = self.stream_for(where)
        if stream is None:
            return
        key = (model.id, id(stream))
        held = self._tokens.get(key)  # a dict read is atomic; a stale answer only costs a new token below
        if held is not None and held[0] is stream and held[1].touch():
            return
        with self._lock:
            held = self._tokens.get(key)
            if held is not None and held[0] is stream and held[1].touch():
                return
            token = StreamToken(stream)
            try:
                self.residency.record(model, token, dev)
            except ReservationReleased:
                self._tokens.pop(key, None)  # fully unloaded meanwhile: the unload fenced; nothing to keep
                return
            self._tokens[key] = (stream, token)
            self.recorded += 1

    def fence_range(self, reservation: Any, where: str) -> None:
        """Fence ``reservation`` by everything queued so far on the current stream of ``where`` (a copy read
        from its pages): a free or release of it waits for that work."""
        if not self.enabled:
            return
        stream = self.stream_for(where)
        if stream is None:
            return
        try:
            self.residency.session.record(reservation, StreamToken(stream))
            self.recorded += 1
        except ReservationReleased:
            return  # released meanwhile: its release fenced

    def forget(self, model: Any) -> None:
        with self._lock:
            for key in [k for k in self._tokens if k[0] == model.id]:
                del self._tokens[key]
