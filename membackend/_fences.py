"""Fence tokens for asynchronous work that is not a GPU event.

A token is any object with ``done()`` and ``wait()``; the session keeps the
ones recorded on each reservation and waits for them before a free or a
release (G2). GPU events are wrapped by :class:`membackend._drivers.gpu.EventToken`.
"""

from __future__ import annotations

from concurrent.futures import Future

__all__ = ["FutureToken"]


class FutureToken:
    """The future of a copy running on a thread pool, as a fence token.

    ``wait`` re-raises the copy's exception, so a failed copy is not mistaken
    for a finished one.
    """

    __slots__ = ("future",)

    def __init__(self, future: Future):
        self.future = future

    def done(self) -> bool:
        return self.future.done()

    def wait(self) -> None:
        self.future.result()

    def __repr__(self) -> str:
        return f"FutureToken(done={self.future.done()})"
