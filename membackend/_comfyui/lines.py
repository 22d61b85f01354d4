"""The adapter's log lines: :func:`say` writes one, :func:`gb` writes a size in it.

Every part of the adapter logs through these two, so that each line reads ``membackend <version>: ...`` and
each size is written as membackend writes sizes everywhere. They live apart from :mod:`.runtime` so that the
runtime's parts (:mod:`.headroom`, :mod:`.unloads`, :mod:`.delegates`, :mod:`.journal`) can log without
importing the runtime that holds them.
"""

from __future__ import annotations

import logging

from .._version import __version__
from ..types import format_size

__all__ = ["say", "gb", "log"]

log = logging.getLogger("membackend")


def say(text: str, level: int = logging.INFO) -> str:
    """Log one membackend line (``membackend <version>: text``); returns it."""
    line = f"membackend {__version__}: {text}"
    log.log(level, "%s", line)
    return line


def gb(n: int | float) -> str:
    """Bytes for a person, as membackend writes them everywhere (``types.format_size``): ``3.0 GiB``,
    ``512.0 MiB``, ``0 bytes``."""
    return format_size(n)
