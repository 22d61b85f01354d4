"""Issue 42, item 5: pin counts never overflow into an untyped error, and a pin of a range is all or nothing.

Pin counts were 16 bits per page: the 65,536th pin of one page raised a plain ``OverflowError`` (which
switches the ComfyUI adapter off), and a two-page range whose second page overflowed kept the pin it had
already counted on the first for good. Now a page's counts widen to 64 bits when one reaches the most 16
bits hold, and a pin that cannot be counted even then raises a typed error with every count as it was."""

from __future__ import annotations

from array import array

import pytest

from membackend._backends.host import HostBackend
from membackend._ledger import Ledger
from membackend._machine import gather_machine
from membackend._residency import ResidencyManager
from membackend._session import Session
from membackend.types import Device, ModelError

PAGE = 2 << 20
NARROW = (1 << 16) - 1  # the most a 16-bit count holds
CPU = Device("cpu", 0)


@pytest.fixture
def manager():
    s = Session(HostBackend(page_size=PAGE), machine=gather_machine(), ledger=Ledger(sanitize=True))
    m = ResidencyManager(s)
    yield m
    s.close()


def pins(m: ResidencyManager, model) -> list[int]:
    return list(model.slots[CPU].pins)


def test_one_page_pinned_past_65535_times_counts_every_pin_and_unpins_back_to_zero(manager):
    m = manager
    a = m.register("a", 2 * PAGE, "cpu")
    times = NARROW + 2  # past the most 16 bits hold
    for _ in range(times):
        assert m.fault(a, 0, 1, CPU).ok
    assert pins(m, a) == [times, 0]
    assert m.pinned_and_evictable(a) == (PAGE, 0)
    for _ in range(times - 1):
        m.unpin(a, 0, 1, CPU)
    assert pins(m, a) == [1, 0] and m.residency(a)[0] == 3  # one pin left: still pinned
    m.unpin(a, 0, 1, CPU)
    assert pins(m, a) == [0, 0] and m.pinned_and_evictable(a) == (0, PAGE)
    assert m.free_memory(PAGE, "cpu") == PAGE  # evictable again


def test_a_warm_range_pins_past_65535_times_too(manager):
    m = manager
    a = m.register("a", 2 * PAGE, "cpu")
    f = m.fault(a, 0, PAGE, CPU)
    warm = m.warm_range(a, 0, PAGE, CPU, f)
    assert warm is not None
    for _ in range(NARROW + 1):
        assert warm.pin() == f
    assert pins(m, a) == [NARROW + 2, 0]
    for _ in range(NARROW + 2):
        assert warm.unpin()
    assert pins(m, a) == [0, 0]


def test_a_two_page_range_with_one_page_at_the_limit_pins_both_or_neither(manager):
    m = manager
    b = m.register("b", 2 * PAGE, "cpu")
    for _ in range(NARROW):
        assert m.fault(b, PAGE, 1, CPU).ok
    assert pins(m, b) == [0, NARROW]
    assert m.fault(b, 0, 2 * PAGE, CPU).ok  # the second page's count passes 16 bits: both pages counted
    assert pins(m, b) == [1, NARROW + 1]
    m.unpin(b, 0, 2 * PAGE, CPU)
    for _ in range(NARROW):
        m.unpin(b, PAGE, 1, CPU)
    assert pins(m, b) == [0, 0], "an unpin per pin must bring every count back to 0"
    assert m.pinned_and_evictable(b) == (0, 2 * PAGE)


def test_a_pin_past_the_widest_count_is_typed_and_changes_no_count(manager):
    m = manager
    c = m.register("c", 2 * PAGE, "cpu")
    f = m.fault(c, 0, 2 * PAGE, CPU)
    m.unpin(c, 0, 2 * PAGE, CPU)
    warm = m.warm_range(c, 0, 2 * PAGE, CPU, f)
    assert warm is not None
    slot = c.slots[CPU]
    most = (1 << 64) - 1
    slot.pins = array("Q", [0, most])  # as if the second page had been pinned that often (it never is)
    with pytest.raises(ModelError, match="pinned .* times, the most a pin count holds; nothing was pinned"):
        m.fault(c, 0, 2 * PAGE, CPU)
    assert list(slot.pins) == [0, most], "the first page kept a pin of a range that was refused"
    with pytest.raises(ModelError):
        warm.pin()
    assert list(slot.pins) == [0, most]
    assert m.fault(c, 0, PAGE, CPU).ok and list(slot.pins) == [1, most]  # the other page pins as before


def test_the_comfyui_adapter_stays_on_past_65535_pins_of_one_page(host_adapter):
    pytest.importorskip("torch")
    from membackend._comfyui import vbar as facade

    rt = host_adapter  # its page is PAGE
    v = facade.ModelVBAR(4 * PAGE, 0)
    small = v.alloc(64)  # small weights share a page: each fault pins it once more
    first = facade.vbar_fault(small)
    assert first is not None
    for _ in range(NARROW + 1):
        assert facade.vbar_signature_compare(facade.vbar_fault(small), first)
    assert rt.aborted is None, rt.aborted
    for _ in range(NARROW + 2):
        facade.vbar_unpin(small)
    assert rt.aborted is None, rt.aborted
    assert v.get_residency()[0] == 1  # resident, no pin left
