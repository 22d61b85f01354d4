"""The stand-ins for comfy-aimdo's file readers (``membackend._comfyui.buffers``), issue 42's defects 1-3: a
``HostBuffer`` closed while another thread copies from it waits for the copy (it crashed the process), the
reader pool works in a child of ``fork`` (it hung), and every bad input is aimdo's ``RuntimeError`` (overflows,
``ENOMEM`` and a closed buffer escaped it). The races run in a child Python, so that a crash fails the test
instead of ending the run."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from membackend._comfyui import buffers

RACES = 200


def _child(code: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout)


def test_closing_a_host_buffer_during_a_copy_never_unmaps_under_it(tmp_path):
    """Defect 1: 200 close-while-copying races; every copy either completes with the file's bytes (the close
    waited for it) or is refused with RuntimeError (the close came first); the process never dies."""
    data = tmp_path / "weights.bin"
    data.write_bytes(bytes(range(256)) * (16 << 12))  # 16 MiB
    p = _child(f"""
        import ctypes, threading
        from membackend._comfyui import buffers
        size = {16 << 20}
        expected = open({str(data)!r}, "rb").read()
        device = (ctypes.c_uint8 * size)()  # the device stands in as host memory: no runtime, a plain copy
        done = refused = 0
        for i in range({RACES}):
            buf = buffers.HostBuffer(0, 0, size)
            f = open({str(data)!r}, "rb")
            outcome = []
            def copy():
                try:
                    buf.read_file_slice(f, 0, size, offset=0, device_ptr=ctypes.addressof(device), device=0)
                    outcome.append(bytes(device) == expected)
                except RuntimeError as exc:
                    outcome.append("closed" in str(exc))
            t = threading.Thread(target=copy)
            t.start()
            buf.close()
            t.join()
            f.close()
            assert outcome == [True], (i, outcome)
        print("races", {RACES})
    """)
    assert p.returncode == 0, (p.returncode, p.stdout[-2000:], p.stderr[-3000:])
    assert f"races {RACES}" in p.stdout


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="no fork on this OS")
def test_the_reader_pool_works_in_a_child_of_fork(tmp_path):
    """Defect 2: the pool runs only from 4 cores (forced here); a child forked after it started reads a file to
    the device and returns, with the file's bytes."""
    data = tmp_path / "weights.bin"
    data.write_bytes(bytes(range(251)) * (1 << 17))  # about 31 MiB: read in chunks by the pool
    p = _child(f"""
        import ctypes, os, signal, sys
        from membackend._comfyui import buffers
        buffers.READ_THREADS_FROM = 1  # the pool, whatever the cores
        size = os.path.getsize({str(data)!r})
        expected = open({str(data)!r}, "rb").read()
        device = (ctypes.c_uint8 * size)()
        with open({str(data)!r}, "rb") as f:
            buffers.read_file_to_device(f, 0, size, 0, ctypes.addressof(device), 0)  # the pool starts
        assert bytes(device) == expected and buffers._readers is not None
        pid = os.fork()
        if pid == 0:
            signal.alarm(60)  # a hang ends the child instead of the test
            ctypes.memset(device, 0, size)
            with open({str(data)!r}, "rb") as f:
                buffers.read_file_to_device(f, 0, size, 0, ctypes.addressof(device), 0)
            os._exit(0 if bytes(device) == expected else 3)
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status))
    """, timeout=120)
    assert p.returncode == 0 and "child 0" in p.stdout, (p.stdout[-2000:], p.stderr[-3000:])


@pytest.mark.parametrize("case", ["huge buffer", "huge offset", "huge size", "negative offset", "not a number",
                                  "closed buffer", "huge read to the device"])
def test_every_bad_input_is_aimdos_runtime_error(tmp_path, case):
    """Defect 3: what escaped as OverflowError, OSError (ENOMEM) or TypeError is RuntimeError, as comfy-aimdo's."""
    path = tmp_path / "w.bin"
    path.write_bytes(b"x" * 4096)
    with open(path, "rb") as f, pytest.raises(RuntimeError):
        if case == "huge buffer":
            buffers.HostBuffer(2 ** 63)
        elif case == "huge read to the device":
            buffers.read_file_to_device(f, 0, 2 ** 62, 0, 1 << 20, 0)
        else:
            buf = buffers.HostBuffer(0, 0, 8192)
            if case == "huge offset":
                buf.read_file_slice(f, 2 ** 70, 16)
            elif case == "huge size":
                buf.read_file_slice(f, 0, 2 ** 64)
            elif case == "negative offset":
                buf.read_file_slice(f, -5, 16)
            elif case == "not a number":
                buf.read_file_slice(f, "zero", 16)
            else:
                buf.close()
                buf.read_file_slice(f, 0, 16)
