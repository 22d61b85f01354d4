"""Mutation proof of the conformance kit: a memfd-backed host backend written from the README
alone (tests/fixtures/memfd_backend) passes the kit, and each of its mutants fails it, for the
reason its bug deserves. The kit runs exactly as a third party runs it: pytest in a subprocess,
the backend named by import path (not installed)."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

import membackend.testing.conformance as conformance

FIXTURE = Path(__file__).parent / "fixtures" / "memfd_backend"
TESTS = Path(__file__).parent

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="memfd and /proc/self/maps are Linux's")

#: mutant (module:attr) -> what the kit must say about it
MUTANTS = {
    "membackend_memfd_mutants:ReleaseKeepsMapping": "but the range is still mapped (/proc/self/maps",
    "membackend_memfd_mutants:FreeKeepsPages": "are still resident (mincore; expected 0)",
    "membackend_memfd_mutants:FaultBacksNothing": "returned ok but page(s) [0, 1] are not resident (mincore",
}
CORRECT = "membackend_memfd:MemfdBackend"


def _kit(target: str, cwd: Path, *extra: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMBACKEND_")}
    paths = [str(FIXTURE), str(TESTS / "fixtures" / "example_backend"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", "membackend.testing.conformance",
           "--membackend-plugin", target, "--membackend-examples", "5", *extra]
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def kit_runs(tmp_path_factory) -> dict[str, tuple[int, str]]:
    """The kit against the correct backend and every mutant, two at a time."""
    targets = [CORRECT, *MUTANTS]
    results = {}
    for i in range(0, len(targets), 2):
        procs = {t: _kit(t, tmp_path_factory.mktemp("kit"), *(["-x"] if t in MUTANTS else [])) for t in targets[i:i + 2]}
        for t, p in procs.items():
            out, _ = p.communicate(timeout=300)
            results[t] = (p.returncode, out)
    return results


def test_the_backend_written_from_the_readme_passes_the_kit_fully(kit_runs):
    rc, out = kit_runs[CORRECT]
    assert rc == 0, out[-4000:]
    assert "not checked" not in out, out[-2000:]
    checked = next(line for line in out.splitlines() if line.startswith(f"membackend kit: {CORRECT}: checked:"))
    for check in ("ledger vs kernel", "out-of-memory rollback (capacity)", "out-of-memory rollback (injected)",
                  "rollback under injected driver failures"):
        assert check in checked, checked


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_each_mutant_fails_the_kit_for_its_bug(kit_runs, mutant):
    rc, out = kit_runs[mutant]
    assert rc == 1, f"the kit passed the mutant {mutant} (rc {rc}):\n{out[-4000:]}"
    assert MUTANTS[mutant] in out, f"the kit failed {mutant} for another reason:\n{out[-4000:]}"


def test_every_rule_of_the_kit_is_collected_by_the_repositorys_suite():
    """tests/test_conformance.py star-imports the kit: every test_* rule, including one added later."""
    rules = {name for name in vars(conformance) if name.startswith("test_")}
    collected = set(runpy.run_path(str(TESTS / "test_conformance.py")))
    assert rules and rules <= collected, f"not collected: {sorted(rules - collected)}"
    assert set(conformance.__all__) == rules


def test_a_target_that_does_not_load_fails_the_kit_with_the_reason(tmp_path):
    p = _kit("membackend_memfd:NoSuchBackend", tmp_path, "-x")
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 1 and "the backend did not load" in out and "NoSuchBackend" in out, out[-3000:]


def test_the_summary_names_the_checks_a_backend_gives_no_way_to_run(tmp_path):
    """The example fixture has no membackend_inject_failures and ignores host_capacity: never a silent pass."""
    p = _kit("membackend_example:ExampleBackend", tmp_path, "-k", "out_of_memory")
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out[-3000:]
    line = next(x for x in out.splitlines() if x.startswith("membackend kit: membackend_example:ExampleBackend: not checked:"))
    assert "rollback under injected driver failures (no membackend_inject_failures)" in line, line
    assert "out-of-memory rollback (capacity) (does not honour host_capacity" in line, line
    assert "out-of-memory rollback (injected) (no membackend_inject_failures)" in line, line


def test_the_kit_extra_brings_exactly_what_the_kit_imports_and_test_includes_it():
    import tomllib

    extras = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {e: {req.split(">")[0].split("=")[0].split("[")[0].strip() for req in reqs} for e, reqs in extras.items()}
    assert names["kit"] == {"pytest", "hypothesis"}, names["kit"]
    assert names["kit"] <= names["test"], names["test"]


def test_the_pytest_plugin_works_in_an_install_without_hypothesis(tmp_path):
    (tmp_path / "test_plain.py").write_text("def test_plain():\n    assert True\n")
    code = ("import sys\n"
            "class NoHypothesis:\n"  # as if not installed: importing it raises ModuleNotFoundError
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] == 'hypothesis': raise ModuleNotFoundError(name)\n"
            "sys.meta_path.insert(0, NoHypothesis())\n"
            "import pytest; rc = pytest.main(['-q', '-p', 'no:cacheprovider', '-p', 'no:hypothesispytest', "
            "'test_plain.py'])\n"
            "assert 'membackend.testing.plugin' in sys.modules and 'membackend.testing.conformance' not in sys.modules\n"
            "sys.exit(rc)")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "1 passed" in p.stdout, p.stdout + p.stderr
