"""What the rocm_windows tests share: the plugin's session on the simulated machine and its figures."""

from __future__ import annotations

from membackend._manager import BackendManager
from membackend._settings import load_settings

MiB, GiB = 1 << 20, 1 << 30
PAGE = 32 * MiB  # the plugin's page
PROFILE = "rocm-win-2gpu"
ALLOWED = 12  # the platform's 14 large frees minus the margin of 2


def session(**platform):
    """The plugin on the simulated machine; ``platform``: its settings as keyword arguments
    (``kept_windows=2``; none: the defaults)."""
    s = BackendManager(load_settings(sim_profile=PROFILE, **({"rocm_windows": platform} if platform else {})))\
        .session()
    assert s.backend.name == "rocm_windows"
    return s


def sim(s):
    """The simulated driver under a session."""
    return s.backend.driver.sim


def window(n: int) -> int:
    """``n`` bytes rounded up to the plugin's page."""
    return -(-n // PAGE) * PAGE
