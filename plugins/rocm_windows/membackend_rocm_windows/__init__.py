"""membackend platform for ROCm on Windows (one or more AMD GPUs): the ``rocm_windows`` backend.

One :class:`membackend.platform.Platform` record, published as the entry point
``rocm_windows = "membackend_rocm_windows:PLATFORM"``. membackend builds the
virtual-memory backend from it; this module only says when it fits and how
the mechanism and the policy must treat the platform:

* **Release on full unload** (G1). Windows ROCm charges reserved GPU address
  space to the process's private commit: a reservation kept after a full
  unload kept 41.58 GB of private bytes committed, 7.33 GB once released
  (ComfyUI #15993). ``release_on_full_unload`` is on.
* **Address quota.** The runtime caps a process's GPU virtual addresses
  (reservations and physical mappings draw from one budget) and crashes with
  an access violation when the cap is passed: the 16th 16 GiB window (at
  240 GiB) crashed (rocm-systems #9823). Reserves are refused up front with
  ``AddressSpaceExhausted`` (a ``MemoryError``) at the quota minus a margin of
  1/16. The quota is, first found: the platform's ``address_quota`` setting
  (a size, e.g. ``512GiB``: ``MEMBACKEND_ROCM_WINDOWS_ADDRESS_QUOTA``, or
  ``address_quota`` in a ``[rocm_windows]`` table); ``OCL_SET_SVM_SIZE`` (the
  runtime's own variable, in MiB: ComfyUI sets ``4194304`` for 4 TB, PR
  #16199, earlier ``262144`` for 256 GB); else 256 GiB, the Windows default
  #9823 measured.
* **Reserve/free churn.** The HIP VMM on Windows fails large address reserves
  after repeated reserve/free rounds (the standalone reproducer fails at
  iteration 14, rocm-systems #6191): ``reserve_churn_limit=14`` makes the
  mechanism keep released windows of at least 1 GiB per device and reuse
  them for equal or smaller reservations. They count as committed while
  kept (the #15993 plateau, in small, if nothing bounded them), so:

  - at most ``kept_windows`` of them stay per device (default 1, the
    ``kept_windows`` setting; ``reserve_churn_keep``): a release past it
    frees the smallest;
  - the rest go back on a trim (idle: the prompt queue emptied, unload of
    everything, close) whenever the churn allowance permits: at most 12
    large frees (14 minus a margin of 2) are spent in the process, and never
    one that would leave too few to bring every device back within its bound.

  The bound is strict: large reservations alive count against the frees
  they will need, so once the frees are spent a device runs at most
  ``kept_windows`` large models at once (the residency manager unloads an
  idle one to make room), and the window it gets last is sized to hold the
  largest model it served. A large reserve that no kept window holds and no
  new window may serve is refused as out of memory
  (``AddressWindowsExhausted``, a ``MemoryError``), as is one the runtime
  itself fails — never a ``DriverError``. ``membackend doctor`` shows the
  windows kept, their bytes, the bound, the frees spent and why they stay
  (``VmmBackend.kept_windows``).
* **Device synchronize after fresh mappings** (``page_in_sync="always"``).
  AMD's Windows driver is a WDDM driver too: Windows' video memory manager
  (``dxgmms2``, where ComfyUI #16246's bugcheck was) pages its allocations
  in, and no report says HIP VMM mappings escape that. So a free after a
  fault synchronizes the device first, as stock comfy-aimdo does on this
  platform (its VBAR free paths call ``hipDeviceSynchronize``).
* **Per device.** Budgets come from each device's own mem-get-info minus the
  headroom (``budget_source="device"``); the HIP driver wrapper makes the
  device current for every call that touches it (HIP calls on another
  device's memory fail with a second device visible, TheRock #6224) and the
  caller's device current again afterwards, so torch's current device is
  never moved.
* **When it fits** (:func:`probe`): Windows, torch a ROCm build or absent,
  and HIP devices listed by machine discovery before torch — through
  hip-python where it installs, otherwise through a ctypes binding of the HIP
  runtime library torch's ROCm build ships in ``torch/lib`` (hip-python's
  dependencies have no Windows wheel) — every one an AMD ``gfx`` device that
  reports ``hipDeviceAttributeVirtualMemoryManagementSupported``.
* **Pages** of 32 MiB, comfy-aimdo's VBAR page: fewer mappings per model
  (#9823: 3072 mappings of 32 MiB in one reservation are healthy).

**Settings.** ``PLATFORM`` declares two settings (:data:`SETTINGS`):
``address_quota`` and ``kept_windows`` (``MEMBACKEND_ROCM_WINDOWS_KEPT_WINDOWS``,
or ``kept_windows`` in a ``[rocm_windows]`` table: the address windows kept
per device, a whole number of at least 1, default 1).
membackend reads them with its own settings when it builds the backend (a
``BackendManager``), and hands them to :func:`capabilities` and
:func:`probe`. A bad value is a ``ConfigError`` naming
``rocm_windows.<name>``, its source and what is accepted, so membackend lists
the plugin as broken with that message. ``OCL_SET_SVM_SIZE`` is the HIP runtime's own
variable, not a membackend setting: it is read from the process environment
as the runtime reads it, when the capabilities are made (the backend's build)
and by the probe; a value the runtime could not use is logged and the ROCm
default used. Nothing reads the environment at a budget query, and importing
this module never fails.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any, Mapping

from membackend.platform import (
    CHURN_MARGIN,
    SIZE_ACCEPTED,
    Platform,
    PlatformSetting,
    PlatformValues,
    Rule,
    RuleError,
    amd_unfit,
    size,
    vmm_unsupported,
)
from membackend.types import Candidate, Capabilities, Machine, Score

__all__ = ["PLATFORM", "SETTINGS", "address_quota", "kept_windows", "capabilities", "policy", "probe", "NAME",
           "QUOTA_ENV", "KEPT_ENV", "SVM_ENV"]
__version__ = "0.1.0"

log = logging.getLogger(__name__)

MiB, GiB = 1 << 20, 1 << 30
NAME = "rocm_windows"
QUOTA_ENV = "MEMBACKEND_ROCM_WINDOWS_ADDRESS_QUOTA"  # the variable of the address_quota setting
KEPT_ENV = "MEMBACKEND_ROCM_WINDOWS_KEPT_WINDOWS"  # the variable of the kept_windows setting
SVM_ENV = "OCL_SET_SVM_SIZE"
SVM_UNIT = MiB  # OCL_SET_SVM_SIZE counts MiB: 4194304 is ComfyUI's "4TB" (PR #16199), 262144 its 256 GB
SVM_MAX = 2**32 - 1  # the runtime reads it as a 32-bit uint (ROCm CLR flags: "OCL_SET_SVM_SIZE uint")
ROCM_DEFAULT_QUOTA = 256 * GiB  # Windows, no OCL_SET_SVM_SIZE: ~256 GiB per process (rocm-systems #9823)
MIN_QUOTA = 1 * GiB  # below this no model fits: "256" is a unit slip (bytes), not a quota
QUOTA_MARGIN = 16  # 1/16 kept below the crash point: #9823 crashed on the window that reached 256 GiB
CHURN_LIMIT = 14  # rocm-systems #6191: the reproducer's reserve fails at iteration 14
CHURN_WINDOW = 1 * GiB  # #6191 churns VBARs of 64 and 192 x 32 MiB pages (2 and 6 GiB); smaller ones are freed
KEPT_DEFAULT = 1  # released windows kept per device: every kept window is commit a fully unloaded model leaves
#   behind (#15993: 41.58 GB of private bytes, 7.33 GB once released); one still spares the next load of the
#   device's largest model a fresh reserve. More: the kept_windows setting
PAGE_SIZE = 32 * MiB  # comfy-aimdo's VBAR_PAGE_SIZE
SCORE_TORCH = 70  # Windows, a ROCm build of torch, AMD devices listed
SCORE_LISTED = 60  # Windows, AMD devices listed by discovery (hip-python or the HIP runtime's ctypes binding), no torch


def _parse_svm(raw: str) -> int | None:
    """``OCL_SET_SVM_SIZE`` in bytes, or None (logged) when the runtime could not use it either."""
    text = raw.strip()
    # converted only when short: Python refuses int() of over 4300 digits (ValueError), leading zeros included
    digits = text.lstrip("0") if re.fullmatch(r"[0-9]+", text) else None
    mib = int(digits or "0") if digits is not None and len(digits) <= len(str(SVM_MAX)) else 0
    if not 0 < mib <= SVM_MAX:
        log.warning("membackend rocm_windows: %s=%r is not a whole number of MiB from 1 to %d; "
                    "assuming the ROCm default quota of %d GiB", SVM_ENV, raw, SVM_MAX, ROCM_DEFAULT_QUOTA // GiB)
        return None
    return mib * SVM_UNIT


def _quota(raw: Any) -> int:
    quota = size(raw)
    if quota < MIN_QUOTA:
        raise ValueError(f"{raw!r} is {quota} bytes, below 1 GiB (a unit missing?)")
    return quota


def _kept(raw: Any) -> int:
    """The ``kept_windows`` setting: a whole number of windows, at least 1 (text from the environment, an int
    from a table or a keyword argument)."""
    value = raw
    if isinstance(raw, str) and re.fullmatch(r"\s*[0-9]+\s*", raw):
        value = int(raw)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RuleError(f"{raw!r} is not a whole number of windows")
    if value < 1:
        raise RuleError(f"{raw!r} keeps no window: every release of a large model would spend one of the "
                        f"{CHURN_LIMIT - CHURN_MARGIN} large frees the platform allows, and large models are "
                        "refused once they are spent")
    return value


#: the ``address_quota`` setting's rule: a size (membackend's rule), at least 1 GiB (:data:`MIN_QUOTA`)
quota_rule = Rule("size", _quota, f"{SIZE_ACCEPTED}; at least 1 GiB")
#: the ``kept_windows`` setting's rule: a whole number, at least 1
kept_rule = Rule("count", _kept, "a whole number of address windows per device, at least 1")
#: the settings this platform declares (membackend reads them under its name; see the module docstring)
SETTINGS = (PlatformSetting("address_quota", parse=quota_rule, default=None,
                            doc="the runtime's per-process GPU address quota (default: OCL_SET_SVM_SIZE, else "
                                "256 GiB); reserves are refused at the quota minus 1/16"),
            PlatformSetting("kept_windows", parse=kept_rule, default=KEPT_DEFAULT,
                            doc="released address windows (>= 1 GiB) kept per device against the reserve/free "
                                "churn defect; each is commit-charged until given back, and once the platform's "
                                "large frees are spent a device runs at most this many large models at once"))


def address_quota(settings: PlatformValues | None = None, environ: Mapping[str, str] | None = None) -> tuple[int, str]:
    """The runtime's per-process GPU address quota in bytes, and where it came from.

    First found: the ``address_quota`` setting (``settings``, the values
    membackend read; None: not set), ``OCL_SET_SVM_SIZE`` in ``environ``
    (default: the process environment; MiB; a value the runtime could not use
    is logged and skipped), the ROCm default (256 GiB). The limit membackend
    enforces is this minus 1/16 (see :data:`QUOTA_MARGIN`).
    """
    configured = None if settings is None else settings["address_quota"]
    if configured is not None:
        return configured, f"{NAME}.address_quota from {settings.source('address_quota')}"
    env = os.environ if environ is None else environ
    svm = env.get(SVM_ENV)
    if svm is not None:
        quota = _parse_svm(svm)
        if quota is not None:
            return quota, f"{SVM_ENV}={svm.strip()} MiB"
    return ROCM_DEFAULT_QUOTA, "the ROCm default"


def kept_windows(settings: PlatformValues | None = None) -> tuple[int, str]:
    """The address windows kept per device (the ``kept_windows`` setting, default :data:`KEPT_DEFAULT`), and
    where the value came from."""
    if settings is None or "kept_windows" not in settings:
        return KEPT_DEFAULT, f"{NAME}.kept_windows from default"
    return settings["kept_windows"], f"{NAME}.kept_windows from {settings.source('kept_windows')}"


def enforced(quota: int) -> int:
    """The limit checked before every reserve: the quota minus the crash margin."""
    return quota - quota // QUOTA_MARGIN


def _size(n: int) -> str:
    return f"{n / GiB:,.0f} GiB" if n % GiB == 0 or n >= 10 * GiB else f"{n / MiB:,.0f} MiB"


def policy(settings: PlatformValues | None = None, environ: Mapping[str, str] | None = None) -> str:
    """What the platform changes, in words, with the quota in force (see :func:`address_quota`)."""
    quota, source = address_quota(settings, environ)
    kept, kept_source = kept_windows(settings)
    return (f"reservations released on full unload; address quota {_size(enforced(quota))} "
            f"({_size(quota)} from {source}, 1/{QUOTA_MARGIN} kept as margin); released windows of "
            f">= {_size(CHURN_WINDOW)} kept against the reserve/free churn defect, at most {kept} per device "
            f"({kept_source}), given back at idle while {CHURN_LIMIT - CHURN_MARGIN} of its {CHURN_LIMIT} large "
            f"frees last")


def capabilities(settings: PlatformValues | None = None) -> Capabilities:
    """The mechanism and policy knobs, with the address quota and the windows kept per device in force (see
    :func:`address_quota`, :func:`kept_windows`)."""
    quota, _source = address_quota(settings)
    return Capabilities(
        release_on_full_unload=True,
        address_quota=enforced(quota),
        reserve_churn_limit=CHURN_LIMIT,
        reserve_churn_window=CHURN_WINDOW,
        reserve_churn_keep=kept_windows(settings)[0],
        fence_granularity="reservation",
        page_in_sync="always",  # a WDDM driver: VidMm pages fresh mappings in (see the module docstring)
    )


def probe(machine: Machine, settings: PlatformValues | None = None) -> Candidate:
    """Windows, a ROCm (or no) torch build, and AMD (``gfx``) HIP devices listed, each supporting
    virtual memory management; 0 with the reason elsewhere.

    Pure: reads the machine facts only (no GPU context). When it fits, the
    reason ends with :func:`policy` (``settings``: the platform's values), so
    the doctor says what the platform changes.
    """
    if machine.os != "windows":
        return Candidate(NAME, Score.NONE, f"not Windows (this machine runs {machine.os}); "
                                           "ROCm on Linux is served by rocm_linux (or the generic vmm backend)")
    unfit = amd_unfit(machine, NAME, "the driver and HIP_VISIBLE_DEVICES")
    if unfit is not None:
        return unfit
    gpus = machine.gpus("hip")
    lacking = vmm_unsupported(gpus)
    if lacking:
        return Candidate(NAME, Score.NONE, lacking)
    listed = ", ".join(f"{d.device} {d.name or 'unnamed'} ({d.arch or 'architecture unknown'})" for d in gpus)
    if machine.torch_vendor == "rocm":
        score, via = SCORE_TORCH, "a ROCm build of torch"
    else:
        score, via = SCORE_LISTED, f"no torch; HIP devices listed by {gpus[0].source or 'the machine facts'}"
    return Candidate(NAME, score, f"Windows ROCm on {len(gpus)} device(s): {listed}; {via}; {policy(settings)}")


#: the platform record (entry point ``rocm_windows = "membackend_rocm_windows:PLATFORM"``)
PLATFORM = Platform(
    name=NAME,
    vendor="hip",
    probe=probe,
    budget_source="device",
    capabilities=capabilities,
    page_size=PAGE_SIZE,
    settings=SETTINGS,
    description="ROCm on Windows: reservations released on full unload, the per-process address quota checked "
                "before every reserve, large released windows kept against the reserve/free churn defect",
    version=__version__,
)
