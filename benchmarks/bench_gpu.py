"""The real-GPU check (run by ``scripts/gpu-check``): membackend's VMM backend on a CUDA device, as JSON.

Without a CUDA device it prints one line, ``{"skipped": "no CUDA device (...)"}``, and exits 0.
It is detected before anything else is imported, through the driver library itself
(``libcuda.so.1`` / ``nvcuda.dll``: ``cuInit``, ``cuDeviceGetCount``), so the line is the same
whether cuda-python, torch or membackend's own dependencies are installed or not.

With a device, one JSON object with these parts (each either its figures, ``{"skipped": why}``
or ``{"error": what}``; a part that fails does not stop the others):

* ``fault_copy``: per page size (``2MiB``, ``32MiB``), a reservation of ``--total`` bytes
  faulted page by page, each page copied from pinned host memory as it is faulted
  (``cuMemcpyHtoDAsync`` on one stream), against the same copies into already-backed
  memory (``cuMemAlloc``, or one pre-faulted page where that is missing): GB/s of both, their
  ratio, and map (create + map + set access) and unmap (unmap + release) time per page;
* ``free_latency``: the free of a freshly faulted reservation while copies into another
  are still running (an unfinished fence token on the other), with the whole-device
  synchronize (``page_in_sync="always"``) and without it (``"never"``: the fences alone):
  the first waits for the unrelated copies, the second should not;
* ``g1_release``: free device memory (``cuMemGetInfo``) before a reservation is faulted,
  after, and after its release; whether the same range is reserved again and backed;
* ``g2_fence``: work recorded on a range (copies, and with torch a long kernel that reads
  the range), then the range freed at once: the free waits for the work, and no
  illegal-address error follows;
* ``torch_device``: torch's current device (set to the last GPU) and the calling thread's
  current context, before and after everything membackend did on ``--device``;
* ``budget``: the session's budget against ``cuMemGetInfo`` and ``torch.cuda.mem_get_info``;
* ``aimdo``: ``fault_copy`` (32 MiB pages, aimdo's) and ``free_latency`` through the
  ``aimdo`` backend (comfy-aimdo, the stock engine), in a child process;
* ``seconds`` (the measured wall time) and ``expected_seconds``.

Nothing is installed or downloaded: torch without CUDA (a CPU build), or no torch, skips
the torch parts with the reason; no comfy-aimdo skips ``aimdo``; no cuda-python ends the
check with an ``error`` (exit 1), since the backend needs the bindings.

Time: about a minute on an H200 (importing torch and creating the CUDA context take most
of it; each measurement is a few hundred milliseconds, ``aimdo`` another process start);
``scripts/gpu-check`` stops it after five minutes whatever happens.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import subprocess
import sys
import time
from typing import Any, Callable

MiB, GiB = 1 << 20, 1 << 30
EXPECTED_SECONDS = 60
PAGE_SIZES = {"2MiB": 2 * MiB, "32MiB": 32 * MiB}
IN_FLIGHT_COPIES = 96  # 32 MiB copies queued before a free (about 60 ms over PCIe 5)
CHILD_TIMEOUT = 180  # seconds for the aimdo child process

_CU_ERRORS = {100: "CUDA_ERROR_NO_DEVICE", 35: "CUDA_ERROR_INSUFFICIENT_DRIVER", 3: "CUDA_ERROR_NOT_INITIALIZED",
              999: "CUDA_ERROR_UNKNOWN", 101: "CUDA_ERROR_INVALID_DEVICE",
              804: "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE"}


# --------------------------------------------------------------------------- is there a device (stdlib only)


def detect(library: str | None = None) -> tuple[int, str | None]:
    """``(devices, None)``, or ``(0, why there is no CUDA device)``, straight from the driver library."""
    names = [library] if library else (["nvcuda.dll"] if sys.platform == "win32" else ["libcuda.so.1", "libcuda.so"])
    lib, why = None, ""
    for name in names:
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError as exc:
            why = why or str(exc)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    note = f"; CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
    if lib is None:
        return 0, f"no CUDA driver library: {names[0]} cannot be loaded ({why}){note}"
    rc = lib.cuInit(0)
    if rc:
        return 0, f"cuInit returned {rc} ({_CU_ERRORS.get(rc, 'see cudaError codes')}){note}"
    count = ctypes.c_int(0)
    rc = lib.cuDeviceGetCount(ctypes.byref(count))
    if rc:
        return 0, f"cuDeviceGetCount returned {rc} ({_CU_ERRORS.get(rc, 'see cudaError codes')}){note}"
    if count.value <= 0:
        return 0, f"the CUDA driver lists no device{note}"
    return count.value, None


# --------------------------------------------------------------------------- parts


def _part(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return fn()
    except Exception as exc:  # a part that fails is reported; the others still run
        return {"error": f"{type(exc).__name__}: {exc}"}


class Check:
    """Every part, over one driver wrapper (real cuda-python, or a simulated one in the unit test)."""

    def __init__(self, driver: Any, index: int, total: int, reps: int, torch: Any = None):
        from membackend.lab.real import this_machine

        self.d, self.index, self.total, self.reps, self.torch = driver, index, total, reps, torch
        self.device = f"cuda:{index}"
        self.machine = this_machine()
        driver.init()
        driver.set_device(index)
        self.stream = driver.stream_create()
        self.pinned = driver.host_alloc_pinned(32 * MiB)

    def close(self) -> None:
        try:
            self.d.host_free_pinned(self.pinned)
        except Exception:
            pass

    def session(self, page: int = 32 * MiB, **caps: Any) -> Any:
        from membackend import Session
        from membackend.lab.real import vmm_backend
        from membackend.platform import GENERIC

        capabilities = _capabilities(GENERIC.capabilities, caps)
        return Session(vmm_backend(self.d, page_size=page, capabilities=capabilities), machine=self.machine)

    # ------------------------------------------------------------------ fault + copy

    def fault_copy(self, session: Any, page: int) -> dict[str, Any]:
        d, total = self.d, self.total - self.total % page
        pages = total // page
        r = session.reserve(self.device, total)
        page = r.page_size
        pages = min(pages, r.size // page)
        plain, plain_free = self._plain_buffer(session, page)
        try:
            def plain_copies() -> float:
                start = time.perf_counter()
                for _ in range(pages):
                    d.memcpy_htod_async(plain, self.pinned, page, self.stream)
                d.stream_synchronize(self.stream)
                return time.perf_counter() - start

            def fault_and_copy() -> tuple[float, float, float]:
                t_map, start = 0.0, time.perf_counter()
                for p in range(pages):
                    t0 = time.perf_counter()
                    if not session.fault(r, p * page, page).ok:
                        raise MemoryError(f"out of memory at page {p} of {pages}")
                    t_map += time.perf_counter() - t0
                    d.memcpy_htod_async(r.base + p * page, self.pinned, page, self.stream)
                d.stream_synchronize(self.stream)
                total_s = time.perf_counter() - start
                t0 = time.perf_counter()
                session.free(r)
                return total_s, t_map, time.perf_counter() - t0

            plain_copies(), fault_and_copy()  # warm both paths up
            best = [float("inf")] * 4
            for _ in range(self.reps):
                p_s = plain_copies()
                v_s, m_s, u_s = fault_and_copy()
                best = [min(a, b) for a, b in zip(best, (p_s, v_s, m_s, u_s))]
        finally:
            session.release_reservation(r)
            plain_free()
        nbytes = pages * page
        return {"page_bytes": page, "pages": pages, "bytes": nbytes,
                "plain_copy_GBps": nbytes / best[0] / 1e9, "fault_copy_GBps": nbytes / best[1] / 1e9,
                "fault_copy_ratio": best[0] / best[1], "map_us_per_page": best[2] / pages * 1e6,
                "unmap_us_per_page": best[3] / pages * 1e6}

    def _plain_buffer(self, session: Any, page: int) -> tuple[int, Callable[[], None]]:
        """A ``page``-byte destination that is already backed: cuMemAlloc, else one pre-faulted page."""
        try:
            ptr = self.d.mem_alloc(page)
            return ptr, lambda: self.d.mem_free(ptr)
        except Exception:
            r = session.reserve(self.device, page)
            session.fault(r, 0, page)
            return r.base, lambda: session.release_reservation(r)

    # ------------------------------------------------------------------ free latency with and without the sync

    def free_latency(self, session: Any, token_for: Callable[[Any], Any] | None = None) -> dict[str, Any]:
        d, page = self.d, 32 * MiB
        a = session.reserve(self.device, 2 * page)
        b = session.reserve(self.device, page)
        try:
            for r in (a, b):
                if not session.fault(r, 0, r.size).ok:
                    raise MemoryError("out of memory backing two small reservations")
            d.stream_synchronize(self.stream)
            start = time.perf_counter()
            for _ in range(IN_FLIGHT_COPIES):
                d.memcpy_htod_async(b.base, self.pinned, page, self.stream)
            token = token_for(b) if token_for is not None else session.backend.fence_token(b, self.stream)
            session.record(b, token)
            queued = time.perf_counter() - start
            t0 = time.perf_counter()
            session.free(a)
            free_s = time.perf_counter() - t0
            session.fence(reservation=b)
            in_flight = time.perf_counter() - start
        finally:
            for r in (a, b):
                if not r.released:
                    session.release_reservation(r)
        return {"free_ms": free_s * 1e3, "in_flight_ms": in_flight * 1e3, "queue_ms": queued * 1e3,
                "in_flight_bytes": IN_FLIGHT_COPIES * page}

    def free_latencies(self) -> dict[str, Any]:
        from membackend.platform import GENERIC

        out: dict[str, Any] = {}
        # with: the device-wide synchronize a free after fresh mappings did before issue 17 (page_in_sync
        # "always"; fence_granularity "device" where this membackend predates that setting); without: fences only
        has_setting = "page_in_sync" in {f.name for f in dataclasses.fields(GENERIC.capabilities)}
        with_sync = {"page_in_sync": "always"} if has_setting else {"fence_granularity": "device"}
        for label, caps in (("with_sync", with_sync),
                            ("without_sync", {"fence_granularity": "reservation", "page_in_sync": "never"})):
            s = self.session(**caps)
            try:
                out[label] = self.free_latency(s)
            finally:
                s.close()
        out["note"] = ("the free of one reservation while copies into another run: with the device-wide sync "
                       "it waits for those copies, without it only for its own (none)")
        return out

    # ------------------------------------------------------------------ G1 and G2 on hardware

    def g1_release(self) -> dict[str, Any]:
        d, s = self.d, self.session()
        size = min(4 * GiB, max(self.total, 64 * MiB))
        try:
            free0 = d.mem_get_info()[0]
            r = s.reserve(self.device, size)
            if not s.fault(r, 0, r.size).ok:
                raise MemoryError(f"out of memory backing {size} bytes")
            free1 = d.mem_get_info()[0]
            base = r.base
            s.release_reservation(r)
            free2 = d.mem_get_info()[0]
            r2 = s.reserve(self.device, size)
            backed = s.fault(r2, 0, r2.size).ok
            same_base = r2.base == base
            s.release_reservation(r2)
            free3 = d.mem_get_info()[0]
        finally:
            s.close()
        slack = 64 * MiB  # other allocations of the process (a context's own) may move by a little
        return {"bytes": size, "free_before": free0, "free_after_fault": free1, "free_after_release": free2,
                "free_at_end": free3, "taken_by_fault": free0 - free1, "returned_by_release": free2 - free1,
                "reserved_again_same_base": same_base, "reserved_again_backed": backed,
                "ok": free0 - free1 >= size - slack and free2 >= free0 - slack and backed}

    def g2_fence(self) -> dict[str, Any]:
        d, s, page = self.d, self.session(), 32 * MiB
        out: dict[str, Any] = {}
        try:
            r = s.reserve(self.device, page)
            s.fault(r, 0, page)
            start = time.perf_counter()
            for _ in range(IN_FLIGHT_COPIES):
                d.memcpy_htod_async(r.base, self.pinned, page, self.stream)  # writes into the range
            s.record(r, s.backend.fence_token(r, self.stream))
            t0 = time.perf_counter()
            s.free(r)
            waited = time.perf_counter() - t0
            error = None
            try:
                d.stream_synchronize(self.stream)
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
            out["copies"] = {"work_ms": (time.perf_counter() - start) * 1e3, "free_waited_ms": waited * 1e3,
                             "error_after": error, "ok": error is None}
            s.release_reservation(r)
            out["kernel"] = _part(lambda: self._g2_kernel(s)) if self.torch is not None else \
                {"skipped": "torch with CUDA is not available here"}
        finally:
            s.close()
        out["ok"] = out["copies"]["ok"] and out["kernel"].get("ok", True)
        return out

    def _g2_kernel(self, s: Any) -> dict[str, Any]:
        torch = self.torch
        from membackend.lab.real import tensor_at

        size = 64 * MiB
        r = s.reserve(self.device, size)
        s.fault(r, 0, size)
        view = tensor_at(r.base, size, self.device, torch.float32)
        view.fill_(1.0)
        torch.cuda.synchronize()
        cycles = _cycles_for(torch, 0.2)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        total = view.sum()  # reads every byte of the range, after the sleep
        end.record()
        s.record(r, _TorchToken(end))
        t0 = time.perf_counter()
        s.free(r)
        waited = time.perf_counter() - t0
        del view
        error = None
        try:
            torch.cuda.synchronize()
            value = float(total.item())
        except Exception as exc:  # an illegal address ends the context: say so
            error, value = f"{type(exc).__name__}: {exc}", None
        s.release_reservation(r)
        kernel_ms = start.elapsed_time(end) if error is None else None
        return {"kernel_ms": kernel_ms, "free_waited_ms": waited * 1e3, "error_after": error,
                "sum_ok": value == size / 4, "ok": error is None and value == size / 4}

    # ------------------------------------------------------------------ budget, torch's device

    def budget(self) -> dict[str, Any]:
        s = self.session()
        try:
            b = s.budget_query(self.device)
        finally:
            s.close()
        free, total = self.d.mem_get_info()
        out = {"session": {"total": b.total, "free": b.free, "headroom": b.headroom, "usable": b.usable,
                           "source": b.source, "unified": b.unified},
               "cuMemGetInfo": {"free": free, "total": total}}
        if self.torch is not None:
            tf, tt = self.torch.cuda.mem_get_info(self.index)
            out["torch_mem_get_info"] = {"free": tf, "total": tt}
            out["torch_free_minus_session_free"] = tf - b.free
        else:
            out["torch_mem_get_info"] = {"skipped": "torch with CUDA is not available here"}
        out["cuMemGetInfo_free_minus_session_free"] = free - b.free
        out["totals_agree"] = b.total == total and (self.torch is None or out["torch_mem_get_info"]["total"] == total)
        return out


class _TorchToken:
    """A fence token over a torch CUDA event."""

    def __init__(self, event: Any):
        self.event = event

    def done(self) -> bool:
        return bool(self.event.query())

    def wait(self) -> None:
        self.event.synchronize()


def _cycles_for(torch: Any, seconds: float) -> int:
    """GPU clock cycles that ``torch.cuda._sleep`` spends in about ``seconds`` (measured, not assumed)."""
    probe = 10_000_000
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(probe)
    b.record()
    b.synchronize()
    ms = max(a.elapsed_time(b), 1e-3)
    return int(probe * seconds * 1e3 / ms)


def _capabilities(base: Any, changes: dict[str, Any]) -> Any:
    """``base`` with ``changes``; a field this membackend does not have yet is left out."""
    names = {f.name for f in dataclasses.fields(base)}
    return dataclasses.replace(base, **{k: v for k, v in changes.items() if k in names})


def _torch_or_reason() -> tuple[Any, str | None]:
    try:
        import torch
    except ImportError as exc:
        return None, f"torch is not installed ({exc}); nothing is installed by this check"
    if not torch.cuda.is_available():
        build = "a CPU build" if torch.version.cuda is None and getattr(torch.version, "hip", None) is None \
            else "torch.cuda.is_available() is false"
        return None, f"torch {torch.__version__} has no CUDA here ({build}); the torch parts are skipped"
    return torch, None


def run(driver: Any, *, index: int = 0, total: int = 2 * GiB, reps: int = 3, use_torch: bool = True,
        aimdo: bool = True, aimdo_command: list[str] | None = None) -> dict[str, Any]:
    """Every part over ``driver``; the JSON object ``scripts/gpu-check`` prints."""
    started = time.perf_counter()
    torch, why_not_torch = _torch_or_reason() if use_torch else (None, "not asked (--no-torch)")
    report: dict[str, Any] = {"expected_seconds": EXPECTED_SECONDS}
    torch_device: dict[str, Any] = {"skipped": why_not_torch} if torch is None else {}
    if torch is not None:  # torch's current device: the last GPU, so a switch to --device would show
        torch_index = torch.cuda.device_count() - 1
        torch.cuda.set_device(torch_index)
        torch.cuda.init()
        torch_device = {"torch_device_before": torch.cuda.current_device(), "membackend_device": index,
                        "gpus": torch.cuda.device_count()}
    driver.init()
    context = getattr(driver, "current_context", None)  # the thread's context, before membackend does anything
    ctx_before = _part(lambda: {"value": context()}) if context is not None else None
    check = Check(driver, index, total, reps, torch)
    try:
        report["device"] = {"index": index, "name": driver.name(index), "total_bytes": driver.total_mem(index),
                            "driver": getattr(driver, "label", type(driver).__name__),
                            "driver_version": _part(lambda: {"value": driver.driver_version()}).get("value"),
                            "torch": getattr(torch, "__version__", None)}
        fault_copy = {}
        for label, page in PAGE_SIZES.items():
            def one(page: int = page) -> dict[str, Any]:
                s = check.session(page=page)
                try:
                    return check.fault_copy(s, page)
                finally:
                    s.close()
            fault_copy[label] = _part(one)
        report["fault_copy"] = fault_copy
        report["free_latency"] = _part(check.free_latencies)
        report["g1_release"] = _part(check.g1_release)
        report["budget"] = _part(check.budget)
        report["g2_fence"] = _part(check.g2_fence)  # last: if a free did not wait, the context is gone
        if torch is not None:
            torch_device["torch_device_after"] = torch.cuda.current_device()
            torch_device["unchanged"] = torch_device["torch_device_after"] == torch_device["torch_device_before"]
            torch_device["meaningful"] = torch_device["gpus"] > 1 and torch_device["torch_device_before"] != index
        if ctx_before is not None and "value" in ctx_before:
            after = context()
            torch_device["thread_context_unchanged"] = after == ctx_before["value"]
        report["torch_device"] = torch_device
    finally:
        check.close()
    report["aimdo"] = _aimdo(index, total, reps, aimdo_command) if aimdo else {"skipped": "not asked (--no-aimdo)"}
    report["seconds"] = round(time.perf_counter() - started, 1)
    return report


# --------------------------------------------------------------------------- aimdo, in a child process


def _aimdo(index: int, total: int, reps: int, command: list[str] | None) -> dict[str, Any]:
    try:
        import comfy_aimdo  # noqa: F401
    except ImportError as exc:
        return {"skipped": f"comfy-aimdo is not installed ({exc}); nothing is installed by this check"}
    cmd = command or [sys.executable, os.path.abspath(__file__), "--aimdo-child", "--device", str(index),
                      "--total", str(total), "--reps", str(reps)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT)
    except subprocess.TimeoutExpired:
        return {"error": f"the aimdo run took more than {CHILD_TIMEOUT} s"}
    try:
        return json.loads(p.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"error": f"the aimdo run exited {p.returncode} without figures: {p.stderr.strip()[-1500:]}"}


def aimdo_child(driver: Any, index: int, total: int, reps: int) -> dict[str, Any]:
    """The aimdo backend (comfy-aimdo's VBARs, 32 MiB pages) through the same measurements."""
    from membackend import Session
    from membackend.lab.real import aimdo_backend, event_token

    check = Check(driver, index, total, reps)
    out: dict[str, Any] = {}
    try:
        s = Session(aimdo_backend(), machine=check.machine)
        try:
            out["fault_copy"] = {"32MiB": _part(lambda: check.fault_copy(s, 32 * MiB))}

            def token(r: Any) -> Any:  # aimdo has no event tokens of its own: an event on the copy stream
                event = driver.event_create()
                driver.event_record(event, check.stream)
                return event_token(driver, event, index)
            out["free_latency"] = _part(lambda: check.free_latency(s, token))
            out["note"] = "aimdo synchronizes the whole device before its frees (fence_granularity device)"
        finally:
            s.close()
    finally:
        check.close()
    return out


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", type=int, default=0, help="the CUDA device membackend runs on (default 0)")
    ap.add_argument("--total", type=int, default=2 * GiB, help="bytes faulted per fault+copy pass (2 GiB)")
    ap.add_argument("--reps", type=int, default=3, help="measured passes per figure, best kept (3)")
    ap.add_argument("--no-torch", action="store_true", help="skip the parts that need torch")
    ap.add_argument("--no-aimdo", action="store_true", help="skip the aimdo baseline")
    ap.add_argument("--libcuda", help="the CUDA driver library to detect the device with")
    ap.add_argument("--pretty", action="store_true", help="indented JSON")
    ap.add_argument("--aimdo-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    indent = 2 if args.pretty else None

    count, why = detect(args.libcuda)
    if not count:
        print(json.dumps({"skipped": f"no CUDA device ({why})"}))
        return 0
    if not 0 <= args.device < count:
        print(json.dumps({"error": f"--device {args.device}: the driver lists {count} device(s)"}))
        return 2
    try:
        from membackend.lab.real import cuda_driver

        driver = cuda_driver()
    except Exception as exc:  # cuda-python or membackend's own dependencies missing
        print(json.dumps({"error": f"membackend cannot drive the GPU here ({type(exc).__name__}: {exc}); this "
                                   f"check installs nothing: run scripts/setup with the cuda extra first",
                          "devices": count}))
        return 1
    if args.aimdo_child:
        print(json.dumps(aimdo_child(driver, args.device, args.total, args.reps)))
        return 0
    report = run(driver, index=args.device, total=args.total, reps=args.reps, use_torch=not args.no_torch,
                 aimdo=not args.no_aimdo)
    print(json.dumps(report, indent=indent))
    return 0


if __name__ == "__main__":
    sys.exit(main())
