"""The virtual-memory backend, built from a :class:`~membackend.platform.Platform` and a driver.

``VmmBackend(platform, driver)`` serves every platform with one mechanism and
names itself after the platform: the built-in generic platform gives the
``vmm`` backend; a platform plugin contributes only its ``Platform`` record.
Mechanism only, per device:

* reserve: an address range rounded up to whole pages (a page is a multiple of
  the allocation granularity), from the window source (:mod:`.windows`):
  refused with ``AddressSpaceExhausted`` before a known per-process address
  quota is reached, instead of letting the driver crash (rocm-systems #9823);
* fault: for each missing page, create physical memory (or take a kept
  handle), map it, set access; if a step fails, the pages this call mapped are
  rolled back; each page gets a new generation whenever it gets new physical
  memory (:mod:`.pages`);
* free: the session has already waited for the fence tokens recorded on the
  range; the device is synchronized only where the platform's
  ``page_in_sync`` says the driver pages fresh mappings in behind the
  process's back (WDDM: ComfyUI #16246), and then only if pages were mapped
  since the last synchronize, or before every unmap when the platform's
  fence granularity is ``device``; then unmap each page and hand its handle to
  the handle keeper (:mod:`.handles`: released, or kept for the next fault);
* release: free every page, then give the address range back to the window
  source (under a reserve-churn limit a large window is kept for the next
  reserve that fits instead: :mod:`.churn`);
* trim: give back kept handles and windows (the session calls it on close,
  the residency manager after a full unload of everything and at idle:
  ``ResidencyManager.on_idle``, which the ComfyUI adapter calls when the
  prompt queue empties);
* fence: recorded work arrives as :class:`~membackend._drivers.gpu.EventToken`
  from :meth:`VmmBackend.fence_token` (the session waits for those); a
  device-wide fence synchronizes the device;
* budget: the platform's budget source (``device``, ``wddm``, ``unified``,
  ``apu``, ``auto``: :mod:`.pool`) minus the headroom in force: the session's
  :class:`~membackend.platform.Headroom` of the device once a session handed them
  down (:meth:`VmmBackend.use_headroom`), else the platform's own rule
  (:meth:`VmmBackend.own_headroom`); the up-front refusal on a unified pool
  uses the same value;
* inspect: the driver's own tables where it has them (the simulated drivers);
  on a real driver, this backend's own handle ledger checked against the
  driver's free figure (:class:`~.ledger.HandleLedger`);
* inject_failures: random driver failures, where the driver offers them
  (the simulated drivers do).

**Platform quirks are parts.** ``VmmBackend`` (:mod:`.backend`) is the verbs
and the per-device books (:mod:`.state`); what differs between platforms is a
part chosen from a group of the platform's ``Capabilities``
(``Capabilities.GROUPS``) by :func:`.parts.choose_parts`, where the table of
groups and parts is:

* the handle keeper and recycler (:mod:`.handles`): kept handles, and ROCm
  7.2's memory that returns only when its address range is freed;
* the window source and the churn-window keeper (:mod:`.windows`,
  :mod:`.churn`): the address quota, and Windows ROCm's reserve-churn limit
  (rocm-systems #6191: released large windows kept, bounded, reused);
* the one-pool guard (:mod:`.pool`): one pool shared with the host (GB10, AMD
  APUs), where a fault that would cross it is out of memory before the driver
  is asked;
* the VMM self-test (:mod:`.selftest`): one page through every VMM call on a
  device's first use, where the driver's attribute alone was seen to be wrong;
* the descriptor budget (:mod:`.descriptors`): where each handle holds one of
  the process's file descriptors (ROCm 7.14 on Linux), the soft
  ``RLIMIT_NOFILE`` raised at start-up and a create refused for want of one
  raised as ``DescriptorLimit``, never answered as out of memory.

**The headroom has one owner, the session.** The backend never reads the
``headroom`` setting: its own rule (:meth:`VmmBackend.own_headroom`: the
``headroom`` override, else the platform's) is the lowest level of the
session's precedence, and the session that owns the backend hands it its
:class:`~membackend.platform.Headroom` objects, one per device
(:meth:`VmmBackend.use_headroom`), which every budget and the up-front refusal
of a unified pool then read: nothing calls back up to the session.

The right device is made current before every call that touches one. Calls
on different reservations may arrive from several threads (the session
serialises calls on one reservation): one lock guards the per-device state,
the parts' books and the churn accounting.
"""

from __future__ import annotations

from ...platform import CHURN_MARGIN, KEPT_WINDOWS_PER_DEVICE
from ...types import AddressSpaceExhausted, AddressWindowsExhausted
from .backend import VmmBackend
from .descriptors import DescriptorRoom
from .pool import RoomSplit
from .windows import KeptWindows

__all__ = ["VmmBackend", "AddressSpaceExhausted", "AddressWindowsExhausted", "KeptWindows", "RoomSplit",
           "DescriptorRoom", "KEPT_WINDOWS_PER_DEVICE", "CHURN_MARGIN"]
