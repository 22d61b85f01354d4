"""The kit against bugs planted by someone other than its author (tests/fixtures/third_party).

Two clean third-party backends written from the docs alone, a file-backed host backend and a Jetson Orin
platform record, pass the kit; each of 33 planted bugs in them and in the memfd example fails it, except
the one whose bug has no effect membackend lets a user see (:data:`EQUIVALENT`, with the reason). A review
of the kit added a pooled design it must pass and a /dev/shm leak it must fail. The kit runs as a third
party runs it: pytest in a subprocess, the backend named by import path.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
FIXTURES = TESTS / "fixtures"
MEMFD = TESTS.parent / "docs" / "examples" / "memfd_backend"
sys.path[:0] = [str(FIXTURES), str(MEMFD)]

from third_party.planted import BUGS, PLANTED, PROFILE  # noqa: E402
from third_party.reviewed import SHM_PREFIX  # noqa: E402

pytestmark = [pytest.mark.kit_long,  # 35 kit runs in subprocesses: about two minutes
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fixtures are Linux backends")]

JETSON = "jetson-orin-16gb"
CLEAN = {"third_party.filebacked:FileBackedBackend": None, "third_party.jetson:PLATFORM": JETSON,
         "third_party.reviewed:PooledBackend": None}
#: bugs found by a review of the kit (tests/fixtures/third_party/reviewed.py), with the bug
REVIEWED = {"third_party.reviewed:ShmLeakBackend": "reservations as /dev/shm files never unlinked"}
#: planted bugs membackend gives no effect a user could see, with why (the kit rightly passes them)
EQUIVALENT = {
    "PlantedJetsonNoUnifiedPool": "a platform whose budget_source is 'unified' is one pool to membackend whatever "
                                  "its capabilities say: faults are refused up front and budgets say unified alike",
}


def _kit(target: str, profile: str | None, cwd: Path, *extra: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMBACKEND_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(FIXTURES), str(MEMFD), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", "membackend.testing.conformance",
           "--membackend-plugin", target, "--membackend-examples", "5", "--membackend-seed", "1",
           *(["--membackend-profile", profile] if profile else []), *extra]
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[int, str]]:
    """Every clean backend and planted bug through the kit, two at a time."""
    targets = [*CLEAN.items(), *((PLANTED[n], PROFILE[n]) for n in PLANTED), *((t, None) for t in REVIEWED)]
    results = {}
    for i in range(0, len(targets), 2):
        procs = {t: _kit(t, profile, tmp_path_factory.mktemp("kit"), *([] if t in CLEAN else ["-x"]))
                 for t, profile in targets[i:i + 2]}
        for t, p in procs.items():
            out, _ = p.communicate(timeout=600)
            results[t] = (p.returncode, out)
    for leaked in Path("/dev/shm").glob(Path(SHM_PREFIX).name + "*"):  # what ShmLeakBackend's bug leaves
        leaked.unlink()
    return results


@pytest.mark.parametrize("target", list(CLEAN))
def test_a_clean_third_party_backend_passes_the_kit_with_every_check_run(runs, target):
    rc, out = runs[target]
    assert rc == 0, out[-4000:]
    name = f"{target}:{CLEAN[target]}" if CLEAN[target] else target
    assert f"membackend kit: {name}: checked: " in out, out[-3000:]
    assert f"membackend kit: {name}: not checked" not in out, out[-3000:]


@pytest.mark.parametrize("bug", [n for n in PLANTED if n not in EQUIVALENT])
def test_each_planted_bug_fails_the_kit(runs, bug):
    rc, out = runs[PLANTED[bug]]
    assert rc == 1, f"the kit did not fail {bug} ({BUGS[bug]}): rc {rc}\n{out[-4000:]}"
    assert "Fatal Python error" not in out, f"the kit crashed on {bug} instead of failing it:\n{out[-4000:]}"


@pytest.mark.parametrize("target", list(REVIEWED))
def test_a_bug_a_review_of_the_kit_found_fails_it(runs, target):
    rc, out = runs[target]
    assert rc == 1 and "left behind" in out, f"the kit did not fail {target} ({REVIEWED[target]}):\n{out[-4000:]}"


@pytest.mark.parametrize("bug", list(EQUIVALENT))
def test_a_planted_bug_without_an_effect_passes_and_says_why(runs, bug):
    rc, out = runs[PLANTED[bug]]
    assert rc == 0, f"{bug} ({BUGS[bug]}) failed the kit; EQUIVALENT says it has no effect: {EQUIVALENT[bug]}\n" \
                    f"{out[-4000:]}"
