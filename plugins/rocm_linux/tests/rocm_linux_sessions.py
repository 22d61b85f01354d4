"""What the rocm_linux tests share: the plugin's session on a simulated machine, and its driver's state."""

from __future__ import annotations

from typing import Any

from membackend.lab.simulated import simulated_session
from membackend_rocm_linux import PLATFORM

MiB, GiB = 1 << 20, 1 << 30
PAGE = 32 * MiB  # the plugin's page
SELECTED = ("strix-halo-128gb", "rx7900xtx-linux", "rx9070xt-linux")  # the profiles rocm_linux serves


def session(profile: str, **kwargs: Any):
    """The plugin's record on a fresh simulation of ``profile`` (the way membackend builds its backend)."""
    s = simulated_session(profile, PLATFORM, **kwargs)
    assert s.backend.name == "rocm_linux"
    return s


def sim(s):
    """The simulated platform under a session's driver."""
    return s.backend.driver.sim


def used(s, index: int = 0) -> int:
    """Physical bytes the simulated device holds for the process (released ones ROCm 7.2 still holds too)."""
    return sim(s).devices[index].used
