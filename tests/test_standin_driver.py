"""The real bindings against a stand-in driver library (``tests/fixtures/standin_driver``).

The stand-in is C, compiled here with the system compiler: ``libcuda.so.1`` answers the CUDA driver
API and ``libamdhip64.so`` the HIP runtime API, both from a profile (``MEMBACKEND_STANDIN_PROFILE``),
with device memory backed by real host memory. The real cuda-python (the installed 13.x and a 12.x
installed here on first use), hip-python, membackend's ctypes binding of the HIP runtime and plain
ctypes load it in child processes (a process loads its driver once), and these tests check what
they see: discovery per profile, the VMM calls, events and copies, the documented error codes,
selection (``membackend backends``) and the conformance kit.

Skipped, with the reason, where there is no C compiler or not Linux; the 12.x tests skip when
cuda-bindings 12.x cannot be installed (no network).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "standin_driver"
PROBE = FIXTURE / "probe.py"


def _load_build_helper():
    """The fixture's ``build.py``, under a name of its own (``build`` is also PyPA's package)."""
    spec = importlib.util.spec_from_file_location("membackend_standin_build", FIXTURE / "build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


standin_build = _load_build_helper()

#: the stand-in driver is Linux-only; the suite builds it and runs the real bindings in subprocesses: the long part
pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the stand-in driver is Linux-only"),
              pytest.mark.long]

GiB = 1 << 30
MiB = 1 << 20

# What each preset plays (tests/fixtures/standin_driver/standin_core.c, PRESETS)
CUDA_PROFILES = {
    "h200": dict(name="NVIDIA H200", total=143771 * MiB, integrated=0, vmm=1, cc=(9, 0), arch="sm_90"),
    "gb10": dict(name="NVIDIA GB10", total=128 * 10**9, integrated=1, vmm=1, cc=(12, 1), arch="sm_121"),
    "novmm": dict(name="NVIDIA GPU without VMM (stand-in)", total=4 * GiB, integrated=0, vmm=0, cc=(5, 2),
                  arch="sm_52"),
}
HIP_PROFILES = {
    "rx9070xt": dict(name="AMD Radeon RX 9070 XT", arch_name="gfx1201", arch="gfx1201", total=16 * GiB,
                     integrated=0, cc=(12, 0)),
    "mi300x": dict(name="AMD Instinct MI300X", arch_name="gfx942:sramecc+:xnack-", arch="gfx942", total=192 * GiB,
                   integrated=0, cc=(9, 4)),
    "strixhalo": dict(name="AMD Radeon 8060S Graphics", arch_name="gfx1151", arch="gfx1151", total=64 * GiB,
                      integrated=1, cc=(11, 5)),
    # AMD on Linux under ROCm 7.2 (membackend issue 27): free (hipMemGetInfo), sysfs pools, PCI bus
    "strix-halo-128gb": dict(name="AMD Radeon 8060S Graphics", arch_name="gfx1151", arch="gfx1151", total=96 * GiB,
                             integrated=1, cc=(11, 5), free=127 * GiB + 512 * MiB, vram=512 * MiB, gtt=96 * GiB,
                             pci=198),
    "rx7900xtx-linux": dict(name="AMD Radeon RX 7900 XTX", arch_name="gfx1100", arch="gfx1100", total=24 * GiB,
                            integrated=0, cc=(11, 0), vram=24 * GiB, gtt=16 * GiB, pci=8),
    "rx9070xt-linux": dict(name="AMD Radeon RX 9070 XT", arch_name="gfx1201", arch="gfx1201", total=16 * GiB,
                           integrated=0, cc=(12, 0), vram=16 * GiB, gtt=16 * GiB, pci=5),
    "gfx1150-apu": dict(name="AMD Radeon 890M Graphics", arch_name="gfx1150", arch="gfx1150", total=2 * GiB,
                        integrated=1, cc=(11, 5), vmm=0, free=30 * GiB, vram=2 * GiB, gtt=16 * GiB, pci=193),
}
AMD_LINUX = ["strix-halo-128gb", "rx7900xtx-linux", "rx9070xt-linux", "gfx1150-apu"]
CUDA_SUCCESS, INVALID_VALUE, OUT_OF_MEMORY = 0, 1, 2
NO_DEVICE, INVALID_DEVICE, INVALID_CONTEXT, INVALID_HANDLE = 100, 101, 201, 400
NOT_READY, ILLEGAL_ADDRESS, CONTEXT_IS_DESTROYED, NOT_SUPPORTED = 600, 700, 709, 801


# --------------------------------------------------------------------------- fixtures


def _cache_dir(config: pytest.Config, tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    cache = getattr(config, "cache", None)
    return cache.mkdir(name) if cache is not None else tmp_path_factory.mktemp(name)


@pytest.fixture(scope="session")
def standin(pytestconfig, tmp_path_factory) -> Path:
    """The built stand-in (``<dir>/lib/libcuda.so.1``, ``<dir>/lib/libamdhip64.so``), reused across runs."""
    try:
        return standin_build.build(_cache_dir(pytestconfig, tmp_path_factory, "membackend-standin-driver"))
    except standin_build.BuildUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def cuda12(pytestconfig, tmp_path_factory) -> Path:
    """A folder holding cuda-bindings 12.x (``pip install --no-deps --target``), cached across runs."""
    target = _cache_dir(pytestconfig, tmp_path_factory, "membackend-cuda-bindings-12") / "site"
    if (target / "cuda" / "bindings" / "__init__.py").is_file():
        return target
    staging = target.with_name(f"site.{os.getpid()}")
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", "--no-input",
           "--retries", "1", "--timeout", "20", "--target", str(staging), "cuda-bindings==12.9.*"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cuda-bindings 12.x could not be installed ({exc})")
    if proc.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        pytest.skip("cuda-bindings 12.x could not be installed: " + " | ".join(tail))
    if target.exists():  # another run won the race
        shutil.rmtree(staging, ignore_errors=True)
    else:
        staging.rename(target)
    return target


def _no_core_dump() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a child expected to abort leaves no core file


def run_probe(standin: Path, scenario: str, profile: str, *, pythonpath: Path | None = None, expect_rc: int = 0,
              timeout: float = 60, **env: str) -> dict:
    """Run ``probe.py scenario`` in a child process whose bindings load the stand-in playing ``profile``."""
    paths = [str(p) for p in (pythonpath, ROOT) if p is not None]
    child = standin_build.child_env(standin, profile, PYTHONPATH=os.pathsep.join(paths), **env)
    proc = subprocess.run([sys.executable, str(PROBE), scenario], env=child, capture_output=True, text=True,
                          timeout=timeout, preexec_fn=_no_core_dump if expect_rc else None)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PROBE-RESULT ")]
    assert proc.returncode == expect_rc, \
        f"{scenario} on {profile!r}: rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert lines, f"{scenario} on {profile!r} printed no result\n{proc.stdout}\n{proc.stderr}"
    result = json.loads(lines[-1][len("PROBE-RESULT "):])
    result["_stderr"] = proc.stderr
    assert "fatal" not in result, f"{scenario} on {profile!r}: {result['fatal']}\n{result.get('fatal_traceback')}"
    return result


def no_errors(value, where=""):
    """Fail on any ``{"error": ...}`` a probe step recorded."""
    if isinstance(value, dict):
        assert "error" not in value, f"{where}: {value}"
        for k, v in value.items():
            no_errors(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            no_errors(v, f"{where}[{i}]")


CUDA_BINDINGS = ["cuda-python-13", "cuda-python-12"]


@pytest.fixture(params=CUDA_BINDINGS)
def cuda_binding(request, standin):
    """How a child gets its cuda-python: the installed 13.x, or 12.x from the cached folder (against a
    CUDA 12.9 driver, as on the Windows laptops that still run one)."""
    if request.param == "cuda-python-12":
        return {"pythonpath": request.getfixturevalue("cuda12"), "MEMBACKEND_STANDIN_DRIVER_VERSION": "12090",
                "major": "12"}
    pytest.importorskip("cuda.bindings.driver")
    return {"pythonpath": None, "MEMBACKEND_STANDIN_DRIVER_VERSION": "13000", "major": "13"}


def probe_cuda(standin, binding, scenario, profile, **env):
    extra = {k: v for k, v in binding.items() if k not in ("pythonpath", "major")}
    r = run_probe(standin, scenario, profile, pythonpath=binding["pythonpath"], **extra, **env)
    assert r["binding"]["version"].startswith(binding["major"] + "."), r["binding"]
    return r


# --------------------------------------------------------------------------- the build


def test_build_is_reused_and_exports_what_the_bindings_resolve(standin):
    assert standin_build.build(standin) == standin  # up to date: nothing rebuilt
    lib = standin / "lib"
    stamp = (standin / "build.stamp").stat().st_mtime
    time.sleep(0.01)
    standin_build.build(standin)
    assert (standin / "build.stamp").stat().st_mtime == stamp
    nm = subprocess.run(["nm", "-D", "--defined-only", str(lib / "libcuda.so.1")], capture_output=True, text=True)
    if nm.returncode == 0:
        exported = {line.split()[-1] for line in nm.stdout.splitlines() if line.strip()}
        assert {"cuGetProcAddress_v2", "cuDriverGetVersion", "cuInit", "cuMemGetInfo_v2", "cuMemCreate"} <= exported
        assert not any(name.startswith("sc_") for name in exported)  # the model stays private


def test_a_missing_compiler_is_a_reason_to_skip(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(standin_build.BuildUnavailable, match="no C compiler"):
        standin_build.build(tmp_path / "out")


# --------------------------------------------------------------------------- CUDA: discovery


@pytest.mark.parametrize("profile", sorted(CUDA_PROFILES))
def test_cuda_discovery_per_profile(standin, cuda_binding, profile):
    want = CUDA_PROFILES[profile]
    r = probe_cuda(standin, cuda_binding, "cuda_discovery", profile)
    assert r["driver_version"] == [0, int(cuda_binding["MEMBACKEND_STANDIN_DRIVER_VERSION"])]
    assert r["cuInit"] == CUDA_SUCCESS and r["count"] == [0, 1]
    raw = r["raw"][0]
    no_errors(raw, "raw")
    assert raw["name"] == want["name"] and raw["total"] == want["total"]
    attrs = {k: v[1] for k, v in raw["attrs"].items()}
    assert all(v[0] == CUDA_SUCCESS for v in raw["attrs"].values())
    assert (attrs["integrated"], attrs["vmm"], attrs["tcc"]) == (want["integrated"], want["vmm"], 0)
    assert (attrs["cc_major"], attrs["cc_minor"]) == want["cc"]

    no_errors(r["wrapper"], "wrapper")
    dev = r["wrapper"]["devices"][0]
    assert r["wrapper"]["device_count"] == 1
    assert (dev["name"], dev["total_mem"], dev["integrated"], dev["arch"]) == \
        (want["name"], want["total"], bool(want["integrated"]), want["arch"])
    assert dev["vmm"] == want["vmm"] and dev.get("vmm_supported", bool(want["vmm"])) == bool(want["vmm"])
    assert (dev["driver_model_windows"], dev["driver_model_linux"]) == ("wddm", None)  # TCC_DRIVER 0
    assert dev["granularity"] == 2 * MiB
    assert dev["thread_context_after"] == 0  # the wrapper left no context current on the thread
    free, total = dev["mem_get_info"]
    assert total == want["total"] and free <= total
    if want["integrated"]:
        # one pool with the host: cudaMemGetInfo's free is the kernel's MemFree on GB10 (unsloth PR #10704)
        assert free <= r["meminfo_MemFree"] * 1.05
    else:
        assert free == total
    # cuMemCreate on a device without VMM: CUDA_ERROR_NOT_SUPPORTED; otherwise it works
    assert dev["create_code"] == (CUDA_SUCCESS if want["vmm"] else NOT_SUPPORTED)
    if "close" in r:  # the wrapper releases the primary contexts it retained
        assert r["close"] == [0], r["close"]


def test_cuda_luid_with_zero_bytes_has_eight_bytes_through_the_wrapper(standin):
    """cuda-python (12.9, 13.4) reads cuDeviceGetLuid's char[8] as a NUL-terminated string, so a LUID with a
    zero byte (the high part is usually 0) comes back short from the binding; the wrapper asks through
    ctypes and gets all eight bytes, as DXGI needs them."""
    pytest.importorskip("cuda.bindings.driver")
    r = run_probe(standin, "cuda_discovery", "h200;luid=5900010000000000")
    assert r["luid_wrapper"] == [0x00010059, 0], r["luid_wrapper"]


def test_cuda_luid_without_zero_bytes_is_exact(standin):
    pytest.importorskip("cuda.bindings.driver")
    r = run_probe(standin, "cuda_discovery", "h200;luid=0102030405060708")
    # read as a C string, the raw value runs on past the eighth byte into whatever follows it
    assert r["raw"][0]["luid"].startswith("0102030405060708") and r["raw"][0]["luid_mask"] == 1
    assert r["luid_wrapper"] == [0x04030201, 0x08070605]


def test_cuda_no_gpu_is_no_device_from_cuinit(standin, cuda_binding):
    r = probe_cuda(standin, cuda_binding, "cuda_none", "none")
    assert r["cuInit"] == NO_DEVICE  # "no CUDA-capable device is detected"
    assert r["count_after_failed_init"][0] == 3  # CUDA_ERROR_NOT_INITIALIZED: every later call
    assert r["wrapper_init"] == NO_DEVICE


def test_cuda_visible_devices_selects_and_orders(standin):
    pytest.importorskip("cuda.bindings.driver")
    three = "h200,gb10,novmm"
    r = run_probe(standin, "cuda_discovery", three, CUDA_VISIBLE_DEVICES="2,0")
    assert [d["name"] for d in r["raw"]] == [CUDA_PROFILES["novmm"]["name"], CUDA_PROFILES["h200"]["name"]]
    # the list ends at the first invalid entry
    r = run_probe(standin, "cuda_discovery", three, CUDA_VISIBLE_DEVICES="1,7,0")
    assert [d["name"] for d in r["raw"]] == [CUDA_PROFILES["gb10"]["name"]]
    uuid = r["raw"][0]["uuid"]
    # by UUID, as nvidia-smi prints it (GPU-xxxxxxxx-xxxx-...), a prefix is enough
    r = run_probe(standin, "cuda_discovery", three, CUDA_VISIBLE_DEVICES=f"GPU-{uuid[:8]}-{uuid[8:12]}")
    assert [d["name"] for d in r["raw"]] == [CUDA_PROFILES["gb10"]["name"]]
    # an empty value hides every device
    r = run_probe(standin, "cuda_none", three, CUDA_VISIBLE_DEVICES="")
    assert r["cuInit"] == NO_DEVICE


# --------------------------------------------------------------------------- CUDA: memory, events, copies


def test_cuda_vmm_round_trip_through_the_wrapper(standin, cuda_binding):
    r = probe_cuda(standin, cuda_binding, "cuda_vmm", "h200")
    g = r["granularity"]
    assert g == 2 * MiB and r["granularity_recommended"] == 2 * MiB and r["aligned"]
    assert r["free0"] == r["total"] == CUDA_PROFILES["h200"]["total"]
    # reserve: address space only, no access; create: memory counted; map: still no access until set_access
    assert r["after_reserve"]["reserved"] == 4 * g and r["after_reserve"]["physical"] == 0
    assert r["reserved_perms"] == ["---p"]
    assert r["free_after_create"] == r["free0"] - 4 * g
    assert r["perms_mapped_no_access"] == ["---s"]
    assert r["copy_before_access"] == INVALID_VALUE
    assert r["perms_accessible"] == ["rw-s"]
    assert r["after_map"]["mapped"] == 4 * g and r["after_map"]["handles"] == 2
    # events: NOT_READY while the stream is busy, done after the wait; the token destroys its event once
    assert r["pending_query"] is False and r["token_done_while_pending"] is False
    assert r["stream_query_pending"] == NOT_READY
    assert r["token_done_after_wait"] is True and r["event_destroyed_once"] == 0
    assert r["never_recorded_query"] is True and r["after_sync_query"] is True
    assert r["double_destroy"] == INVALID_HANDLE
    # a pageable source is read when the copy is queued, a pinned one when it runs
    assert r["pageable_copy_reads"] == "AAAA"
    assert r["pinned_copy_reads"] == "DDDD"
    assert r["dtoh"] == [CUDA_SUCCESS, "DDDD"]
    assert r["dtoh_without_context"] == INVALID_CONTEXT
    # the documented refusals
    assert r["unmap_subrange"] == INVALID_VALUE  # cuMemUnmap cannot unmap a sub-range
    assert r["address_free_mapped"] == INVALID_VALUE
    assert r["create_unaligned"] == INVALID_VALUE
    assert r["create_too_big"] == OUT_OF_MEMORY and r["create_too_big_is_oom"] is True
    assert r["map_twice"] == INVALID_VALUE
    # release of a mapped handle is deferred until it is unmapped
    assert r["after_release_mapped"]["handles"] == 2 and r["after_release_mapped"]["physical"] == 4 * g
    assert r["perms_unmapped"] == ["---p"]  # the range is reserved again: reading it would fault
    assert r["after_unmap"]["mapped"] == 0 and r["after_unmap"]["physical"] == 2 * g
    assert r["release_twice"] == INVALID_VALUE
    assert r["after_release"]["physical"] == 0 and r["free_after_release"] == r["free0"]
    assert r["after_address_free"]["reserved"] == 0 and r["address_free_twice"] == INVALID_VALUE
    # plain allocations
    assert r["mem_alloc_free_drop"] == 2 * MiB and r["mem_alloc_reads"] == "zzzzzzzz"
    assert r["mem_free_twice"] == INVALID_VALUE
    end = r["end"]
    assert (end["reserved"], end["mapped"], end["physical"], end["handles"], end["linear"], end["events"]) == \
        (0, 0, 0, 0, 0, 0)
    assert r["free_end"] == r["free0"]


def test_cuda_copy_into_unmapped_pages_is_a_sticky_illegal_address(standin, cuda_binding):
    r = probe_cuda(standin, cuda_binding, "cuda_fault", "h200")
    # CUDA_ERROR_ILLEGAL_ADDRESS: "any further CUDA work will return the same error"
    assert r["sync"] == ILLEGAL_ADDRESS
    assert r["event_query"] == ILLEGAL_ADDRESS and r["mem_get_info"] == ILLEGAL_ADDRESS
    assert r["stats"]["sticky"] == ILLEGAL_ADDRESS and r["perms"] == ["---p"]


def test_cuda_contexts_on_two_devices(standin):
    pytest.importorskip("cuda.bindings.driver")
    r = run_probe(standin, "cuda_contexts", "2*h200")
    assert r["count"] == 2 and r["current_before"] == 0
    assert r["get_device_without_context"] == INVALID_CONTEXT and r["meminfo_without_context"] == INVALID_CONTEXT
    assert r["retain"] == [0, 0] and r["current_device_after_set"] == 1
    assert r["after_push"] == 0 and r["popped_is_c0"] and r["after_pop"] == 1
    assert r["state_active"] == 1 and r["release0"] == 0 and r["state_after_release"] == 0
    assert r["release0_again"] == INVALID_CONTEXT
    assert r["meminfo_destroyed_context"] == CONTEXT_IS_DESTROYED and r["meminfo_dev1"] == 0
    assert r["set_null"] == 0 and r["current_after_null"] == 0


def test_plain_ctypes_loads_libcuda(standin):
    r = run_probe(standin, "ctypes_cuda", "rtx3050", MEMBACKEND_STANDIN_DRIVER_VERSION="12090")
    assert r["version"] == [0, 12090] and r["before_init"] == 3 and r["init"] == 0
    assert r["count"] == [0, 1] and r["name"] == [0, "NVIDIA GeForce RTX 3050 6GB Laptop GPU"]
    assert r["total"] == [0, 6143 * MiB]
    assert r["luid"][0] == 0 and len(bytes.fromhex(r["luid"][1])) == 8 and r["luid"][2] == 1
    assert r["proc_meminfo"] == [0, 0, True]  # the _v2 ABI for cudaVersion 3020
    assert r["proc_meminfo_v1"] == [500, 2, None]  # only the 64-bit ABI: VERSION_NOT_SUFFICIENT
    assert r["proc_unknown"] == [500, 1, None]  # CUDA_ERROR_NOT_FOUND, SYMBOL_NOT_FOUND
    assert r["meminfo"] == [0, 6143 * MiB, 6143 * MiB]
    assert r["error_name_801"] == "CUDA_ERROR_NOT_SUPPORTED"


def test_a_bad_profile_is_cuda_error_unknown_with_the_reason(standin):
    pytest.importorskip("cuda.bindings.driver")
    r = run_probe(standin, "cuda_none", "h200;colour=blue")
    assert r["cuInit"] == 999
    assert "unknown key 'colour'" in r["_stderr"]


# --------------------------------------------------------------------------- HIP

HIP_BINDINGS = ["hip-python", "ctypes"]


@pytest.fixture(params=HIP_BINDINGS)
def hip_binding(request, standin):
    if request.param == "hip-python":
        pytest.importorskip("hip")
    else:
        pytest.importorskip("membackend._drivers.hip_ctypes")
    return {"PROBE_HIP": request.param}


@pytest.mark.parametrize("profile", ["strixhalo,rx9070xt", "mi300x", "strix-halo-128gb,rx7900xtx-linux",
                                     "rx9070xt-linux,gfx1150-apu"])
def test_hip_discovery_per_profile(standin, hip_binding, profile):
    names = profile.split(",")
    r = run_probe(standin, "hip_discovery", profile, **hip_binding)
    assert r["hipInit"] == 0 and r["count"] == [0, len(names)]
    for props, dev, key in zip(r["props"], r["wrapper"]["devices"], names):
        want = HIP_PROFILES[key]
        no_errors(props, "props")
        assert props["rc"] == 0 and props["name"] == want["name"]
        assert props["gcnArchName"] == want["arch_name"]  # a str, features included
        assert (props["integrated"], props["totalGlobalMem"], props["major"], props["minor"]) == \
            (want["integrated"], want["total"], *want["cc"])
        assert (dev["name"], dev["total_mem"], dev["integrated"], dev["arch"], dev["driver_model"]) == \
            (want["name"], want["total"], bool(want["integrated"]), want["arch"], None)
        assert dev["mem_get_info"] == [want.get("free", want["total"]), want["total"]]
        assert dev["granularity"] == 4096
        assert dev["create_code"] == (0 if want.get("vmm", 1) else NOT_SUPPORTED)
        assert dev["thread_device_after"] == 0  # the wrapper put the caller's device back
    assert r["vmm_attr"] == [HIP_PROFILES[k].get("vmm", 1) for k in names] and r["get_device_default"] == 0
    assert r["device_out_of_range"] == INVALID_DEVICE


def test_hip_without_vmm_support_refuses_create(standin, hip_binding):
    r = run_probe(standin, "hip_discovery", "rx9070xt;vmm=0", **hip_binding)
    assert r["vmm_attr"] == [0]
    assert r["wrapper"]["devices"][0]["create_code"] == NOT_SUPPORTED  # hipErrorNotSupported


def test_hip_visible_devices(standin):
    pytest.importorskip("hip")
    r = run_probe(standin, "hip_discovery", "strixhalo,rx9070xt,mi300x", PROBE_HIP="hip-python",
                  ROCR_VISIBLE_DEVICES="2,1", HIP_VISIBLE_DEVICES="1")
    assert [p["name"] for p in r["props"]] == [HIP_PROFILES["rx9070xt"]["name"]]
    r = run_probe(standin, "hip_discovery", "strixhalo,rx9070xt,mi300x", PROBE_HIP="hip-python",
                  CUDA_VISIBLE_DEVICES="2")  # honoured by HIP where HIP_VISIBLE_DEVICES is not set
    assert [p["name"] for p in r["props"]] == [HIP_PROFILES["mi300x"]["name"]]


def test_hip_no_gpu(standin, hip_binding):
    r = run_probe(standin, "hip_none", "none", **hip_binding)
    assert r["hipInit"] == NO_DEVICE and r["count"] == [NO_DEVICE, 0] and r["wrapper_init"] == NO_DEVICE


def test_hip_vmm_round_trip_through_the_wrapper(standin, hip_binding):
    r = run_probe(standin, "hip_vmm", "rx9070xt", **hip_binding)
    assert r["granularity"] == 4096
    assert r["perms_no_access"] == ["---s"] and r["perms_access"] == ["rw-s"] and r["perms_unmapped"] == ["---p"]
    assert r["free_after_create"] == r["free0"] - 4 * MiB
    assert r["pending_query"] is False and r["raw_query_pending"] == NOT_READY and r["token_done"] is True
    assert r["reads"] == "hip!" * 4
    assert r["unmap_subrange"] == INVALID_VALUE and r["create_unaligned"] == INVALID_VALUE
    end = r["end"]
    assert (end["reserved"], end["mapped"], end["physical"], end["handles"], end["events"]) == (0, 0, 0, 0, 0)
    assert r["free_end"] == r["free0"]


def test_hip_page_fault_ends_the_process(standin):
    pytest.importorskip("hip")
    r = run_probe(standin, "hip_fault", "rx9070xt", PROBE_HIP="hip-python", expect_rc=-6)  # SIGABRT
    assert r == {"queued": True, "_stderr": r["_stderr"]}
    assert "Memory access fault by GPU node-1" in r["_stderr"]


def test_plain_ctypes_loads_libamdhip64(standin):
    r = run_probe(standin, "ctypes_hip", "rx9070xt,mi300x")
    assert r["count"] == [0, 2]
    for dev, key in zip(r["devices"], ("rx9070xt", "mi300x")):
        want = HIP_PROFILES[key]
        assert dev == {"rc": 0, "name": want["name"], "totalGlobalMem": want["total"], "major": want["cc"][0],
                       "minor": want["cc"][1], "integrated": want["integrated"], "gcnArchName": want["arch_name"]}
    assert r["set_get"] == [0, 0, 1]
    assert r["meminfo"] == [0, 16 * GiB, 16 * GiB]
    assert r["granularity"] == [0, 4096]
    assert r["vmm_sequence"] == [0] * 9 and r["readback"] == "ctypes-hip"
    assert r["error_name_801"] == "hipErrorNotSupported"


# --------------------------------------------------------------------------- HIP: AMD on Linux (issue 27)


def test_child_env_points_the_stand_in_and_membackend_at_one_fresh_sysfs(standin, tmp_path):
    a, b = standin_build.child_env(standin, "rx9070xt"), standin_build.child_env(standin, "rx9070xt")
    assert a["MEMBACKEND_STANDIN_SYSFS"] == a["MEMBACKEND_SYSFS_ROOT"]
    assert Path(a["MEMBACKEND_STANDIN_SYSFS"]).is_dir() and not any(Path(a["MEMBACKEND_SYSFS_ROOT"]).iterdir())
    assert Path(a["MEMBACKEND_STANDIN_SYSFS"]).parent == standin / "sysfs"
    assert b["MEMBACKEND_STANDIN_SYSFS"] != a["MEMBACKEND_STANDIN_SYSFS"]  # one per call
    mine = str(tmp_path / "sys")
    c = standin_build.child_env(standin, "rx9070xt", MEMBACKEND_STANDIN_SYSFS=mine)
    assert c["MEMBACKEND_STANDIN_SYSFS"] == c["MEMBACKEND_SYSFS_ROOT"] == mine
    d = standin_build.child_env(standin, "rx9070xt", base={"MEMBACKEND_SYSFS_ROOT": mine})
    assert d["MEMBACKEND_STANDIN_SYSFS"] == d["MEMBACKEND_SYSFS_ROOT"] == mine


def _used(sysfs: dict, integrated: int) -> int:
    """What the device holds as amdgpu shows it: GTT on an APU, VRAM on a discrete card."""
    assert sysfs[("vram_used", "gtt_used")[not integrated]] == 0
    return sysfs["gtt_used" if integrated else "vram_used"]


@pytest.mark.parametrize("profile", AMD_LINUX)
def test_hip_amd_linux_memory_and_sysfs(standin, hip_binding, profile):
    want = HIP_PROFILES[profile]
    total, free, integrated = want["total"], want.get("free", want["total"]), want["integrated"]
    r = run_probe(standin, "hip_memory", profile, **hip_binding)
    address = f"0000:{want['pci']:02x}:00.0"
    assert r["listing"] == [address]
    fs = r["sysfs_all"][0]
    assert fs["address"] == address and fs["exists"] and fs["format_ok"]  # decimal bytes and "\n", as amdgpu
    assert (fs["vram_total"], fs["gtt_total"], fs["vram_used"], fs["gtt_used"]) == (want["vram"], want["gtt"], 0, 0)
    assert r["total_mem"] == r["props_total"] == total
    assert r["meminfo0"] == [free, total]
    if profile == "strix-halo-128gb":  # free is the host's RAM, the total the GTT: free above total
        assert r["meminfo0"] == [127 * GiB + 512 * MiB, 96 * GiB] and r["meminfo0"][0] > r["meminfo0"][1]
    if want.get("vmm", 1):
        assert r["vmm_supported"] is True and r["create_code"] == 0
        after = r["after_create"]
        assert after["meminfo"] == [free - GiB, total] and after["physical"] == GiB
        assert _used(after["sysfs"], integrated) == GiB
        assert (after["sysfs"]["vram_total"], after["sysfs"]["gtt_total"]) == (want["vram"], want["gtt"])
    else:
        assert r["vmm_supported"] is False and r["create_code"] == NOT_SUPPORTED
    back = r["after_release"]
    assert back["meminfo"] == [free, total] and back["physical"] == 0 and _used(back["sysfs"], integrated) == 0
    # plain allocations are counted the same way, and are limited to the total (the carve-out on gfx1150)
    assert r["malloc"] == 0 and r["after_malloc"]["meminfo"] == [free - 64 * MiB, total]
    assert _used(r["after_malloc"]["sysfs"], integrated) == 64 * MiB
    assert r["free"] == 0 and _used(r["after_free"]["sysfs"], integrated) == 0
    assert r["after_free"]["meminfo"] == [free, total]
    assert r["malloc_over_total"] == OUT_OF_MEMORY


def test_gfx1150_apu_has_no_vmm(standin, hip_binding):
    r = run_probe(standin, "hip_discovery", "gfx1150-apu", **hip_binding)
    assert r["vmm_attr"] == [0]  # hipDeviceAttributeVirtualMemoryManagementSupported
    dev = r["wrapper"]["devices"][0]
    assert dev["create_code"] == NOT_SUPPORTED and dev.get("vmm_supported", False) is False
    assert dev["total_mem"] == r["props"][0]["totalGlobalMem"] == 2 * GiB and dev["integrated"] is True
    assert dev["mem_get_info"] == [30 * GiB, 2 * GiB]


def test_sysfs_is_written_for_the_visible_hip_devices_only(standin, tmp_path):
    pytest.importorskip("membackend._drivers.hip_ctypes")

    def listing(name, profile, **env):
        root = tmp_path / name
        run_probe(standin, "hip_none", profile, PROBE_HIP="ctypes", MEMBACKEND_STANDIN_SYSFS=str(root), **env)
        devices = root / "bus" / "pci" / "devices"
        return sorted(p.name for p in devices.iterdir()) if devices.is_dir() else []

    both = "strix-halo-128gb,rx7900xtx-linux"
    assert listing("both", both) == ["0000:08:00.0", "0000:c6:00.0"]
    assert listing("one", both, HIP_VISIBLE_DEVICES="1") == ["0000:08:00.0"]
    assert listing("copies", "2*rx7900xtx-linux") == ["0000:08:00.0", "0000:09:00.0"]  # boards on their own buses
    assert listing("cuda", "h200") == []  # amdgpu files are for AMD devices
    files = sorted(p.name for p in (tmp_path / "one" / "bus" / "pci" / "devices" / "0000:08:00.0").iterdir())
    assert files == ["mem_info_gtt_total", "mem_info_gtt_used", "mem_info_vram_total", "mem_info_vram_used"]


@pytest.mark.parametrize("profile", ["strix-halo-128gb", "rx7900xtx-linux"])
def test_hip_rel72_release_holds_until_the_range_is_freed(standin, hip_binding, profile):
    r = run_probe(standin, "hip_rel72", profile, **hip_binding)
    page = 2 * MiB

    def held(key, n):
        # stats' physical bytes, hipMemGetInfo's free, sysfs *_used and the memfd's pages agree
        h = r[key]
        assert (h["physical"], h["free_drop"], h["sysfs_used"]) == (n, n, n), (key, h)
        return h

    assert held("mapped", 2 * page)["memfd"] == 2 * page
    # ROCm 7.2: unmap + release succeed, but the memory comes back only with hipMemAddressFree
    assert held("after_release", 2 * page)["handles"] == 1
    assert r["after_release"]["memfd"] == 2 * page  # not punched yet
    assert r["release_twice"] == INVALID_VALUE
    assert held("after_address_free", 0)["handles"] == 0 and r["after_address_free"]["memfd"] == 0
    held("never_mapped_created", page)
    held("never_mapped_released", 0)  # never mapped: returned at release
    held("range_freed_first", page)
    held("range_freed_first_released", 0)  # its ranges were freed already: returned at release
    held("released_mapped_then_unmapped", page)
    held("released_mapped_range_freed", 0)
    held("two_ranges_one_freed", page)  # every range it was mapped into must be freed
    held("two_ranges_both_freed", 0)
    assert r["malloc"] == 0 and held("after_malloc", page) and r["free"] == 0
    held("end", 0)
    end = r["end_stats"]
    assert (end["reserved"], end["mapped"], end["physical"], end["handles"], end["linear"]) == (0, 0, 0, 0, 0)


def test_hip_without_rel72_release_after_unmap_returns_at_once(standin, hip_binding):
    r = run_probe(standin, "hip_rel72", "strix-halo-128gb;rel72=0", **hip_binding)
    assert r["mapped"]["physical"] == 4 * MiB
    for key in ("after_release", "never_mapped_released", "released_mapped_then_unmapped", "two_ranges_one_freed",
                "end"):
        assert (r[key]["physical"], r[key]["free_drop"], r[key]["sysfs_used"], r[key]["memfd"]) == (0, 0, 0, 0), key


@pytest.mark.parametrize("case", ["offset", "size"])
def test_hip_map2m_a_mapping_not_aligned_to_2mib_faults_on_first_copy(standin, hip_binding, case):
    r = run_probe(standin, "hip_map2m", "rx9070xt-linux", MEMBACKEND_STANDIN_FAULT="sticky", PROBE_MAP2M=case,
                  **hip_binding)
    assert r["granularity"] == 4096 and r["base_aligned"]  # the runtime still reports 4 KiB
    # 2 MiB-aligned address and size: copies work
    assert (r["aligned_queue"], r["aligned_sync"], r["aligned_reads"]) == (0, 0, "rdna4-2m" * 2)
    # 4 KiB-aligned only: the map (and the copy's queueing) succeed, the copy itself is a GPU page fault
    assert (r["map"], r["set_access"], r["queue"]) == (0, 0, 0)
    assert r["sync"] == ILLEGAL_ADDRESS and r["stats"]["sticky"] == ILLEGAL_ADDRESS
    assert r["mem_get_info_after"] == ILLEGAL_ADDRESS and r["reads"] == "\0" * 16


@pytest.mark.parametrize("profile", ["rx9070xt", "rx9070xt-linux;map2m=0"])
def test_hip_without_map2m_a_4kib_aligned_mapping_copies(standin, hip_binding, profile):
    r = run_probe(standin, "hip_map2m", profile, MEMBACKEND_STANDIN_FAULT="sticky", **hip_binding)
    assert (r["map"], r["queue"], r["sync"], r["reads"]) == (0, 0, 0, "rdna4-2m" * 2)
    assert r["stats"]["sticky"] == 0


def test_hip_map2m_fault_ends_the_process(standin):
    pytest.importorskip("hip")
    r = run_probe(standin, "hip_map2m", "rx9070xt-linux", PROBE_HIP="hip-python", expect_rc=-6)  # SIGABRT
    assert r["aligned_sync"] == 0 and r["map"] == 0 and r["queue"] == 0 and "sync" not in r
    assert "Memory access fault by GPU node-1" in r["_stderr"]


# --------------------------------------------------------------------------- selection and the kit


def _membackend(standin: Path, profile: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    child = standin_build.child_env(standin, profile, PYTHONPATH=str(ROOT), **env)
    return subprocess.run([sys.executable, "-m", "membackend._cli", *args], env=child, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("profile,selected", [("h200", "vmm"), ("gb10", "unified_gb10"), ("novmm", "host"),
                                              ("none", "host")])
def test_selection_through_the_real_bindings(standin, profile, selected):
    """The issue's "done when": no simulation, no overrides, the stand-in plays the machine."""
    pytest.importorskip("cuda.bindings.driver")
    proc = _membackend(standin, profile, "backends")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next((x for x in proc.stdout.splitlines() if x.startswith("selected:")), "")
    assert line.startswith(f"selected: {selected} "), proc.stdout


# the generic vmm takes its vendor from the torch build (CPU torch here: cuda), so the HIP machine says rocm
@pytest.mark.parametrize("profile", ["h200", "gb10"])
def test_doctor_shows_the_stand_in_facts_and_self_tests_through_it(standin, profile):
    pytest.importorskip("cuda.bindings.driver")
    proc = _membackend(standin, profile, "doctor")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert CUDA_PROFILES[profile]["name"] in proc.stdout
    assert "cuDeviceGetAttribute(INTEGRATED)" in proc.stdout  # each fact with its source
    assert "self-test: passed" in proc.stdout, proc.stdout


# AMD on Linux (issue 27): what is selected on each machine through hip-python and the stand-in HIP runtime. The
# torch here is a CPU build, which uses no AMD GPU: the machine fact a ROCm build would give is set as a user sets it
ROCM = {"MEMBACKEND_MACHINE__TORCH_VENDOR": "rocm"}
AMD_LINUX = [("strix-halo-128gb", "rocm_linux"), ("rx7900xtx-linux", "rocm_linux"), ("rx9070xt-linux", "rocm_linux"),
             ("gfx1150-apu", "host")]


@pytest.mark.parametrize("profile,selected", AMD_LINUX)
def test_amd_linux_selection_through_hip_python(standin, profile, selected):
    pytest.importorskip("hip")
    proc = _membackend(standin, profile, "backends", **ROCM)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    line = next((x for x in out.splitlines() if x.startswith("selected:")), "")
    assert line.startswith(f"selected: {selected} "), out
    windows = next(x for x in out.splitlines() if x.lstrip(" *").startswith("rocm_windows "))
    assert "score 0" in windows and "not Windows" in windows, windows
    assert "[simulated driver]" not in out  # the real bindings over the stand-in, no simulation
    if selected == "host":
        ours = next(x for x in out.splitlines() if x.lstrip(" *").startswith("rocm_linux "))
        assert "score 0" in ours and "APU without virtual memory management" in ours, ours


def test_amd_apu_doctor_shows_the_three_budget_figures_through_the_stand_in(standin):
    pytest.importorskip("hip")
    proc = _membackend(standin, "strix-halo-128gb", "doctor", **ROCM)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.strip().startswith("hip:0: total"))
    assert "APU pool, bound by " in line and "reported 127.5 GiB above its own total 96.0 GiB" in line, line
    assert "sysfs 96.5 GiB (carve-out 512.0 MiB + GTT 96.0 GiB" in line and "MemAvailable" in line, line
    assert "self-test: passed" in proc.stdout, proc.stdout


KIT = [("h200", "vmm", {}), ("gb10", "unified_gb10", {}), ("rx9070xt", "vmm", ROCM),
       *[(p, "rocm_linux", ROCM) for p, selected in AMD_LINUX if selected == "rocm_linux"]]


@pytest.mark.kit_long  # the whole kit in a subprocess per profile: 15-30 s each
@pytest.mark.parametrize("profile,backend,env", KIT, ids=[f"{b}:{p}" for p, b, _ in KIT])
def test_conformance_kit_through_the_stand_in(standin, tmp_path, profile, backend, env):
    pytest.importorskip("hypothesis")
    vendor = "hip" if env else "cuda.bindings.driver"
    pytest.importorskip(vendor)
    child = standin_build.child_env(standin, profile, PYTHONPATH=str(ROOT), **env)
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "membackend.testing.conformance", "-p", "no:cacheprovider",
           "--membackend-backend", backend, "--membackend-examples", "3", "-q", "-rfE", "--no-header",
           "-o", "addopts="]
    proc = subprocess.run(cmd, env=child, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr
    # CUDA_ERROR_INVALID_VALUE / hipErrorInvalidValue, as each binding's enum prints
    null_source = re.search(r"MemcpyHtoDAsync failed with (<CUresult.CUDA_ERROR_INVALID_VALUE: 1>|"
                            r"<hipError_t.hipErrorInvalidValue: 1>|1)$", proc.stdout, re.M)
    assert not null_source, f"the kit copied from host address 0, which a real driver refuses: {summary}"
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
