"""The kit's fixtures (``membackend.testing.fixtures``): the clean environment, and the fixtures as a third party's
tests get them (a pytest run in a subprocess): ``membackend_clean_env`` keeps the developer's settings out and
``membackend_simulated`` closes every session it made. The builders under them are the lab's:
tests/test_lab.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from membackend.testing import clean_environment


def test_the_kit_package_imports_no_pytest_until_a_fixture_is_used():
    """``membackend doctor`` runs the kit's harness in a plain install: the kit package itself pulls in no pytest,
    hypothesis or torch, and not the lab."""
    code = ("import sys, membackend.testing\n"
            "print([m for m in ('pytest', 'hypothesis', 'torch', 'membackend.lab') if m in sys.modules])\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.split() == ["[]"], p.stdout + p.stderr


# --------------------------------------------------------------------------- the clean environment


def test_clean_environment_removes_every_membackend_variable_and_the_names_given(monkeypatch, tmp_path):
    monkeypatch.setenv("MEMBACKEND_BACKEND", "vmm")
    monkeypatch.setenv("MEMBACKEND_CONFIG", str(tmp_path / "elsewhere.toml"))
    monkeypatch.setenv("MEMBACKEND_CUDA_WDDM_HEADROOM", "1GiB")
    monkeypatch.setenv("OCL_SET_SVM_SIZE", "4096")
    monkeypatch.setenv("MEMBACKENDISH", "kept")  # not the prefix: not membackend's
    empty = tmp_path / "empty"
    empty.mkdir()
    clean_environment(monkeypatch, empty, also=("OCL_SET_SVM_SIZE",))
    assert [k for k in os.environ if k.startswith("MEMBACKEND_")] == []
    assert "OCL_SET_SVM_SIZE" not in os.environ and os.environ["MEMBACKENDISH"] == "kept"
    assert Path.cwd() == empty


def test_the_clean_env_fixture_keeps_the_developers_settings_out(tmp_path):
    """From outside (a pytest run with a MEMBACKEND_* variable and a membackend.toml where it starts), a
    test asking for ``membackend_clean_env`` sees neither; the variable is back after the test."""
    (tmp_path / "membackend.toml").write_text('backend = "vmm"\n')
    (tmp_path / "test_clean.py").write_text(
        "import os\n"
        "from pathlib import Path\n"
        "from membackend._settings import load_settings\n"
        "def test_clean(membackend_clean_env):\n"
        "    assert not [k for k in os.environ if k.startswith('MEMBACKEND_')]\n"
        "    assert Path.cwd() == membackend_clean_env and list(membackend_clean_env.iterdir()) == []\n"
        "    assert load_settings().backend is None and load_settings().headroom is None\n"
        "def test_after():\n"
        "    assert os.environ['MEMBACKEND_HEADROOM'] == '1GiB'\n")
    env = {**os.environ, "MEMBACKEND_HEADROOM": "1GiB", "MEMBACKEND_BACKEND": "host"}
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_clean.py"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "2 passed" in p.stdout, p.stdout[-3000:] + p.stderr[-2000:]


# --------------------------------------------------------------------------- the fixtures


def test_the_fixture_closes_every_session_it_made(tmp_path):
    (tmp_path / "test_made.py").write_text(
        "made = []\n"
        "def test_make(membackend_simulated):\n"
        "    for profile in ('h200', 'rocm-win-2gpu'):\n"
        "        s = membackend_simulated(profile)\n"
        "        r = s.reserve(s.devices()[0], 1 << 21)\n"
        "        assert s.fault(r, 0, r.size).ok\n"
        "        made.append(s)\n"
        "def test_closed_afterwards():\n"
        "    assert len(made) == 2\n"
        "    for s in made:\n"
        "        assert s.reservations() == [] and s.backend.driver.sim.state()['reservations'] == 0\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMBACKEND_")}
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_made.py"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "2 passed" in p.stdout, p.stdout[-3000:] + p.stderr[-2000:]


def test_a_checks_message_gives_sizes_in_a_persons_units_with_the_exact_bytes_beside():
    """Issue 42: the kit's and the doctor's self-test failures printed raw byte counts (``free=34359738368``)."""
    from membackend.testing.measure import Truth, budget_problems, sized
    from membackend.types import Budget

    GiB = 1 << 30
    truth = Truth(total=24 * GiB, free_low=20 * GiB, free_high=22 * GiB, source="the machine")
    problems = budget_problems(truth, Budget.of(32 * GiB, 32 * GiB, 0, "test"))
    assert problems[0] == "total=32.0 GiB (34,359,738,368 bytes) but the machine says 24.0 GiB (25,769,803,776 bytes)"
    assert problems[1].startswith("free=32.0 GiB (34,359,738,368 bytes) but the machine says at most 22.0 GiB ")
    assert (sized(640), sized(None)) == ("640 bytes", "unknown")
