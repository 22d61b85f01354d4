"""Issue 43, item 2: a call on a range is the owner GPU's, whichever GPU is current on the calling thread.

comfy-aimdo #99 (Windows, 2x RX 9070 XT): freeing a GPU-0 allocation while GPU 1 was current logged
"account_free: could not account free": the free used the current device's table. ComfyUI calls membackend
from several threads, and each thread has its own current device (HIP: ``hipSetDevice``; CUDA: the context
current on the thread). The simulated two-GPU machines refuse a call on a device that is not current where
the real runtime does (``rocm-win-2gpu``: TheRock #6224), and keep their books per device, so a call booked
to the wrong device fails or shows in the wrong device's figures.

Two threads each work on one device's range with the *other* device made current before every call: fault,
free, unpin, fence, full unload and release, through sessions and through the adapter's ``ModelVBAR``, and
the status figures read with the other device current. Every figure must be the owning device's. The two
threads step together (a barrier between calls), so the interleaving is the same in every run.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import pytest

from membackend import _cli as cli
from membackend._cli import hidden_gpus
from membackend._comfyui import status
from membackend._comfyui import vbar as facade
from membackend._drivers.sim.profiles import PROFILES
from membackend._manager import BackendManager
from membackend._settings import load_settings
from membackend.types import Device, DeviceInfo, Machine

MiB = 1 << 20
TWO_GPU_PROFILES = sorted(n for n, p in PROFILES.items() if len(p.devices) >= 2 and all(d.vmm for d in p.devices))


def test_there_is_a_two_gpu_profile_of_each_vendor():
    assert {PROFILES[n].vendor for n in TWO_GPU_PROFILES} == {"cuda", "hip"}, TWO_GPU_PROFILES


def make_current(driver: Any, index: int) -> None:
    """What ``torch.cuda.set_device(index)`` does on the calling thread: HIP's ``hipSetDevice``; CUDA's primary
    context of ``index`` made current (``cudaSetDevice`` retains and sets it)."""
    m = driver.m
    if hasattr(m, "hipSetDevice"):
        assert m.hipSetDevice(index)[0] == driver.SUCCESS
        return
    status_, ctx = m.cuDevicePrimaryCtxRetain(index)[:2]
    assert status_ == driver.SUCCESS and m.cuCtxSetCurrent(ctx)[0] == driver.SUCCESS


def current(driver: Any) -> int:
    return driver.m.platform.current


def in_step(work: dict[int, Callable[[Any], Any]], driver: Any, steps: list[str]) -> dict[int, list[Any]]:
    """Run ``work[device](step)`` for both devices on two threads, one per device, each making the *other*
    device current before each step; the threads meet at a barrier after every step. Each thread's answers,
    or the first error raised in it."""
    barrier = threading.Barrier(2, timeout=30)
    answers: dict[int, list[Any]] = {0: [], 1: []}
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            for step in steps:
                make_current(driver, 1 - index)
                answers[index].append(work[index](step))
                assert current(driver) == 1 - index, f"{step} left device {current(driver)} current"
                barrier.wait()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[0]
    return answers


@pytest.mark.parametrize("profile", TWO_GPU_PROFILES)
def test_session_calls_book_to_the_owner_device_with_the_other_one_current(profile):
    mgr = BackendManager(load_settings(sim_profile=profile, headroom=0))
    session = mgr.session()
    driver = session.backend.driver
    page = max(session.page_size(Device(PROFILES[profile].vendor, 0)), 2 * MiB)
    devices = {i: Device(PROFILES[profile].vendor, i) for i in (0, 1)}
    ranges: dict[int, Any] = {}
    before = {i: session.budget_query(devices[i]).free for i in (0, 1)}

    def work(index: int) -> Callable[[str], Any]:
        dev = devices[index]

        def step(name: str) -> Any:
            if name == "reserve":
                ranges[index] = session.reserve(dev, 8 * page)
                return ranges[index].device
            r = ranges[index]
            if name == "fault":
                return session.fault(r, 0, (3 + index) * page).ok
            if name == "budget":
                return before[index] - session.budget_query(dev).free
            if name == "ledger":
                return session.ledger.account(dev).resident
            if name == "fence":
                return session.fence(dev, r)
            if name == "free":
                return session.free(r, 0, page)
            if name == "release":
                return session.release_reservation(r)
            if name == "after":
                return (before[index] - session.budget_query(dev).free, session.ledger.account(dev).resident)
            raise AssertionError(name)
        return step

    steps = ["reserve", "fault", "budget", "ledger", "fence", "free", "ledger", "release", "after"]
    answers = in_step({0: work(0), 1: work(1)}, driver, steps)
    for index in (0, 1):
        got = dict(zip(steps, answers[index]))  # the second ledger answer wins the key: after the free
        assert got["reserve"] == devices[index] and got["fault"] is True
        assert got["budget"] == (3 + index) * page, (index, got)  # its own pages on its own device, no other's
        assert got["free"] == page and got["ledger"] == (2 + index) * page, (index, got)
        assert got["after"] == (0, 0), (index, got)
    session.close()


@pytest.mark.parametrize("profile", TWO_GPU_PROFILES)
def test_the_adapters_model_vbar_books_to_its_device_with_the_other_one_current(sim_adapter, profile):
    rt = sim_adapter(profile, devices=2)
    driver = rt.session.backend.driver
    page = rt.session.page_size(rt.devices[0])
    vbars: dict[int, Any] = {}
    allocs: dict[int, Any] = {}
    before = {i: rt.session.budget_query(rt.devices[i]).free for i in (0, 1)}

    def work(index: int) -> Callable[[str], Any]:
        dev = rt.devices[index]

        def step(name: str) -> Any:
            if name == "construct":
                vbars[index] = facade.ModelVBAR(8 * page, index)
                allocs[index] = vbars[index].alloc((2 + index) * page)
                return vbars[index]._dev
            v, a = vbars[index], allocs[index]
            if name == "fault":
                return facade.vbar_fault(a)
            if name == "unpin":
                return facade.vbar_unpin(a)
            if name == "status":
                figures = status.runtime_status(rt)
                return (before[index] - figures["budgets"][str(dev)]["free"],
                        rt.session.ledger.account(dev).resident)
            if name == "fence":
                return rt.session.fence(dev)
            if name == "free":
                return v.free_memory(1 << 62)
            if name == "unload":
                return rt.residency.full_unload(v._model)
            if name == "close":
                return v.close()
            if name == "after":
                return (before[index] - rt.session.budget_query(dev).free, rt.session.ledger.account(dev).resident,
                        [r for r in rt.session.reservations() if r.device == dev])
            raise AssertionError(name)
        return step

    steps = ["construct", "fault", "unpin", "status", "fence", "fault", "unpin", "free", "unload", "close", "after"]
    answers = in_step({0: work(0), 1: work(1)}, driver, steps)
    for index in (0, 1):
        got = answers[index]
        assert got[0] == rt.devices[index]
        assert got[3] == ((2 + index) * page, (2 + index) * page), (index, got[3])  # its pages, on its device
        assert got[-1][:2] == (0, 0) and got[-1][2] == [], (index, got[-1])


def _machine(os_name: str, gpus: int, source: str = "cuda-python") -> Machine:
    return Machine(os=os_name, cpus=2, ram_total=16 << 30, ram_available=8 << 30, cgroup_limit=None,
                   torch_version=None, torch_vendor=None,
                   devices=tuple(DeviceInfo(Device("cuda", i), "GPU", 8 << 30, source=source) for i in range(gpus)))


def test_the_doctor_says_when_comfyui_would_hide_a_second_gpu():
    two_on_windows = hidden_gpus(_machine("windows", 2), {})
    assert two_on_windows == ["2 GPUs: ComfyUI 0.38 and later set CUDA_VISIBLE_DEVICES=0 on Windows unless started "
                              "with --cuda-device all, which hides cuda:1 from ComfyUI (and from membackend inside "
                              "it)"]
    assert hidden_gpus(_machine("linux", 2), {}) == [] and hidden_gpus(_machine("windows", 1), {}) == []
    assert hidden_gpus(_machine("linux", 1), {"HIP_VISIBLE_DEVICES": "1"}) == [
        "HIP_VISIBLE_DEVICES='1' is set: only the GPUs it names are visible to this process (the list above is what "
        "it lets through)"]
    assert "the simulated driver ignores it" in hidden_gpus(_machine("linux", 2, "sim:rtx4090-2gpu"),
                                                            {"CUDA_VISIBLE_DEVICES": "0"})[0]


def test_the_doctor_on_the_windows_two_gpu_profile_names_the_hidden_gpu(monkeypatch, capsys):
    monkeypatch.setenv("MEMBACKEND_SIM_PROFILE", "rocm-win-2gpu")
    assert cli.main(["doctor"]) == 0
    assert "which hides hip:1 from ComfyUI" in capsys.readouterr().out
