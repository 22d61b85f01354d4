"""``scripts/test`` and ``.ci/run``: what they hand to pytest and how pytest's exit status comes back.

Each script runs for real (bash) inside a copy of the repository's skeleton where ``scripts/setup``, the
virtual environment's python and ``chromium`` are stand-ins that record their arguments: the quick run leaves
the long part (marker ``kit_long``) out, ``MEMBACKEND_FULL=1`` and ``.ci/run`` keep it, a caller's ``-m`` wins,
and every non-zero status of pytest, 5 ("no tests collected") included, fails the script.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(sys.platform == "win32" or shutil.which("bash") is None, reason="bash scripts")

RECORDER = """#!/usr/bin/env bash
# stand-in: records its arguments (and MEMBACKEND_FULL); as `python -m pytest` it exits with $STANDIN_RC
name=$(basename "$0")
{ printf '%s\\n' "$@"; env | grep '^MEMBACKEND_FULL=' || true; } > "$STANDIN_LOG/$name.$$"
if [ "$name" = python ] && [ "${1:-}" = -m ] && [ "${2:-}" = pytest ]; then
    exit "${STANDIN_RC:-0}"
fi
if [ "$name" = python ] && [ "${1:-}" = -m ] && [ "${2:-}" = ruff ]; then
    exit "${STANDIN_RUFF_RC:-0}"
fi
if [ "$name" = python ] && [ "${1:-}" = -m ] && [ "${2:-}" = mypy ]; then
    exit "${STANDIN_MYPY_RC:-0}"
fi
exit 0
"""


@pytest.fixture
def skeleton(tmp_path):
    """A copy of the scripts in a bare tree whose setup, python and chromium only record their calls."""
    tree = tmp_path / "repo"
    (tree / "scripts").mkdir(parents=True)
    (tree / ".ci").mkdir()
    shutil.copy2(ROOT / "scripts" / "test", tree / "scripts" / "test")
    shutil.copy2(ROOT / "scripts" / "check", tree / "scripts" / "check")
    shutil.copy2(ROOT / ".ci" / "run", tree / ".ci" / "run")
    bin_dir = tree / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    tools = tmp_path / "tools"
    tools.mkdir()
    for stand_in in (tree / "scripts" / "setup", bin_dir / "python", tools / "chromium"):
        stand_in.write_text(RECORDER)
        stand_in.chmod(0o755)
    log = tmp_path / "log"
    log.mkdir()
    return tree, tools, log


def run(skeleton, script: str, *args: str, rc: int = 0, **env: str) -> tuple[int, list[list[str]]]:
    """Run ``script`` of the skeleton; returns its exit status and python's calls (argv, and MEMBACKEND_FULL)."""
    tree, tools, log = skeleton
    for old in log.iterdir():
        old.unlink()
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MEMBACKEND_")}
    environ.update(PATH=f"{tools}{os.pathsep}{environ.get('PATH', '')}", STANDIN_LOG=str(log), STANDIN_RC=str(rc),
                   **env)
    p = subprocess.run(["bash", str(tree / script), *args], cwd=tree, env=environ, capture_output=True, text=True,
                       timeout=60)
    calls = [f.read_text().splitlines() for f in sorted(log.iterdir()) if f.name.startswith("python.")]
    return p.returncode, calls


def test_the_quick_run_leaves_the_long_part_out_and_passes_the_callers_arguments_after(skeleton):
    rc, calls = run(skeleton, "scripts/test", "tests/test_x.py", "-q")
    assert rc == 0
    pytest_calls = [c for c in calls if c[:2] == ["-m", "pytest"]]
    assert pytest_calls == [["-m", "pytest", "-m", "not kit_long and not long", "tests/test_x.py", "-q"]], calls


def test_membackend_full_runs_everything(skeleton):
    rc, calls = run(skeleton, "scripts/test", "-q", MEMBACKEND_FULL="1")
    assert rc == 0
    assert [c for c in calls if c[:2] == ["-m", "pytest"]] == [["-m", "pytest", "-q", "MEMBACKEND_FULL=1"]], calls


def test_a_callers_marker_expression_comes_last_so_pytest_keeps_it(skeleton):
    _, calls = run(skeleton, "scripts/test", "-m", "gpu")
    argv = next(c for c in calls if c[:2] == ["-m", "pytest"])
    assert argv[-2:] == ["-m", "gpu"] and argv.index("not kit_long and not long") < argv.index("gpu"), argv


@pytest.mark.parametrize("status", [1, 2, 5])
def test_every_failing_pytest_status_fails_the_script_no_tests_collected_included(skeleton, status):
    rc, _ = run(skeleton, "scripts/test", rc=status)
    assert rc == status


def test_ci_runs_scripts_test_with_the_long_part(skeleton):
    rc, calls = run(skeleton, ".ci/run", "-x")
    assert rc == 0
    assert [c for c in calls if c[:2] == ["-m", "pytest"]] == [["-m", "pytest", "-x", "MEMBACKEND_FULL=1"]], calls


@pytest.mark.parametrize("status", [1, 5])
def test_ci_fails_when_pytest_fails(skeleton, status):
    rc, _ = run(skeleton, ".ci/run", rc=status)
    assert rc == status


def test_ci_runs_ruff_and_mypy_before_the_tests(skeleton):
    rc, calls = run(skeleton, ".ci/run")
    assert rc == 0
    tools = [c[1] for c in calls if c[:1] == ["-m"]]
    assert tools.index("ruff") < tools.index("pytest") and tools.index("mypy") < tools.index("pytest"), calls
    assert ["-m", "ruff", "check", "--no-cache", "."] in calls and ["-m", "mypy"] in calls


@pytest.mark.parametrize("which", ["STANDIN_RUFF_RC", "STANDIN_MYPY_RC"])
def test_a_static_check_finding_fails_ci_and_no_test_runs(skeleton, which):
    rc, calls = run(skeleton, ".ci/run", **{which: "1"})
    assert rc != 0
    tools = [c[1] for c in calls if c[:1] == ["-m"]]
    assert "pytest" not in tools and {"ruff", "mypy"} <= set(tools), calls  # both ran: one run shows everything


def test_the_marker_is_registered_for_the_repository_and_by_the_kit():
    import tomllib

    markers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    assert any(m.startswith("kit_long:") for m in markers), markers
    from membackend.testing import conformance

    marked = [m.name for m in getattr(conformance.test_random_verb_sequences_keep_the_ledger_equal_to_the_driver,
                                      "pytestmark", [])]
    assert "kit_long" in marked, json.dumps(marked)
