"""The VMM backend's parts: each chosen from one group of the platform's capabilities, each small.

A platform quirk is one part and one flag (docs/backends.md): these tests hold the groups to the fields, the
choice to the flags, the parts' table to the groups, and every module of the package to 300 lines.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from membackend._backends import vmm
from membackend._backends.vmm import VmmBackend, parts
from membackend._backends.vmm.churn import ChurnWindowKeeper
from membackend._backends.vmm.descriptors import HandleDescriptors
from membackend._backends.vmm.handles import HandleKeeper, RangeHeldHandles
from membackend._backends.vmm.selftest import VmmSelfTest
from membackend._backends.vmm.windows import FreshWindows
from membackend._drivers.sim import get_profile, sim_driver
from membackend.platform import GENERIC
from membackend.types import Capabilities, Device, DriverError

GiB = 1 << 30
PACKAGE = Path(vmm.__file__).parent


def backend(profile: str = "h200", budget_source: str = "auto", **caps) -> VmmBackend:
    platform = dataclasses.replace(GENERIC, budget_source=budget_source, page_size=2 << 20)
    return VmmBackend(platform, sim_driver(get_profile(profile)), capabilities=Capabilities(**caps))


def test_every_capability_is_in_exactly_one_group():
    grouped = [name for group in Capabilities.GROUPS.values() for name in group]
    assert sorted(grouped) == sorted(f.name for f in dataclasses.fields(Capabilities)), "each field once"


def test_the_parts_table_names_every_group():
    table = parts.__doc__ or ""
    assert all(f"``{group}``" in table for group in Capabilities.GROUPS), table


@pytest.mark.parametrize("caps, budget_source, chosen", [
    ({}, "device", (HandleKeeper, FreshWindows, None, None)),
    ({"memory_returns_on_unmap": False}, "device", (RangeHeldHandles, FreshWindows, None, None)),
    ({"reserve_churn_limit": 40}, "device", (HandleKeeper, ChurnWindowKeeper, None, None)),
    ({"vmm_self_test": True}, "device", (HandleKeeper, FreshWindows, None, VmmSelfTest)),
    ({"unified_pool": True}, "device", (HandleKeeper, FreshWindows, True, None)),
    ({}, "unified", (HandleKeeper, FreshWindows, True, None)),
    ({}, "auto", (HandleKeeper, FreshWindows, False, None)),
])
def test_each_flag_chooses_its_part(caps, budget_source, chosen):
    handles, windows, every_device, self_test = chosen
    p = backend(budget_source=budget_source, **caps)._parts
    assert type(p.handles) is handles and type(p.windows) is windows
    assert (p.one_pool.every_device if p.one_pool is not None else None) == every_device, "auto: per device"
    assert (type(p.self_test) if p.self_test is not None else None) is self_test


def test_handle_descriptors_chooses_the_descriptor_budget():
    assert backend()._parts.descriptors is None
    p = backend(handle_descriptors=True)._parts
    assert type(p.descriptors) is HandleDescriptors and p.pages.descriptors is p.descriptors


def test_assigning_capabilities_chooses_the_parts_again_and_keeps_the_kept_windows():
    b = backend("rocm-win-2gpu", reserve_churn_limit=40)
    hip0 = Device("hip", 0)
    r = b.membackend_reserve(hip0, 2 * GiB)
    b.membackend_release_reservation(r)
    assert b.kept_windows(hip0).windows == 1
    b.capabilities = Capabilities(reserve_churn_limit=40, recycle_handles=True)
    assert b._parts.handles.recycles and b.kept_windows(hip0).windows == 1, "the books outlive the parts"
    b.capabilities = Capabilities()
    assert b.kept_windows(hip0) is None, "no keeper: no report"
    assert b.membackend_inspect(hip0).held == 2 * GiB and b.membackend_trim(hip0) == 0, "still held, never freed"


def test_a_failed_self_test_refuses_the_device_once_and_for_all():
    b = backend(vmm_self_test=True)
    failed = DriverError(1, "cuMemCreate", "refused")
    calls = []

    def create(size, index):
        calls.append(index)
        raise failed

    b.driver.create = create
    for _ in range(2):
        with pytest.raises(DriverError, match="self-test of virtual memory management on cuda:0 failed"):
            b.membackend_reserve(Device("cuda", 0), GiB)
    assert calls == [0], "tested once per device: the answer stands"


def test_no_module_of_the_package_passes_300_lines():
    sizes = {p.name: len(p.read_text().splitlines()) for p in PACKAGE.glob("*.py")}
    assert max(sizes.values()) <= 300, sizes
