"""Fence tokens for asynchronous work that is not a GPU event.

A token is any object with ``done()`` and ``wait()``; the session keeps the
ones recorded on each reservation and waits for them before a free or a
release (G2). GPU events are wrapped by :class:`membackend._drivers.gpu.EventToken`.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

__all__ = ["FutureToken", "work_died"]


class FutureToken:
    """The future of a copy running on a thread pool, as a fence token.

    ``wait`` re-raises the copy's exception, so a failed copy is not mistaken
    for a finished one. That includes a ``KeyboardInterrupt`` or ``SystemExit``
    the copy's own thread stopped with (CPython's thread pool sets any
    ``BaseException`` on the future and carries on): :func:`work_died` tells
    it from an interruption of the thread that waits.
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


def work_died(token: Any, exc: BaseException) -> bool:
    """Whether ``exc``, raised by ``token.wait()``, is the outcome of the token's own work rather than
    something that happened to the waiting thread.

    Only a token over a :class:`~concurrent.futures.Future` (its ``future`` attribute: a
    :class:`FutureToken`, or any token carrying one) can say so for sure: the exception is the very
    object the finished future holds. A ``KeyboardInterrupt`` delivered to the waiting thread (Ctrl-C
    during a blocking wait) is another object, so it answers False even when the copy died as well.
    Never raises.
    """
    try:
        future = getattr(token, "future", None)
        return isinstance(future, Future) and future.done() and not future.cancelled() \
            and future.exception(timeout=0) is exc
    except Exception:  # a question about a token must not fail the fence
        return False
