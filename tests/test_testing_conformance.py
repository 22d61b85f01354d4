"""The conformance kit (``membackend.testing.conformance``, with its plugin and harness).

Mutation proof: a memfd-backed host backend written from the docs alone
(docs/examples/memfd_backend) passes the kit, and each of its mutants
(tests/fixtures/memfd_mutants.py) fails it, for the reason its bug deserves. The kit runs exactly
as a third party runs it: pytest in a subprocess, the backend named by import path (not installed;
tests/test_examples.py checks it installed). Then the random sequences' seed: the same seed draws
the same sequences, a failure prints the seed and the one command that fails it again, and a bad
``--membackend-seed`` is a usage error."""

from __future__ import annotations

import os
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import membackend.testing.conformance as conformance
from membackend.lab import simulated_profiles
from membackend.testing import Target

FIXTURE = Path(__file__).parent.parent / "docs" / "examples" / "memfd_backend"
TESTS = Path(__file__).parent

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="memfd and /proc/self/maps are Linux's")

#: mutant (module:attr) -> what the kit must say about it
MUTANTS = {
    "memfd_mutants:ReleaseKeepsMapping": "but the range is still mapped (/proc/self/maps",
    "memfd_mutants:FreeKeepsPages": "are still resident (mincore; expected 0)",
    "memfd_mutants:FaultBacksNothing": "returned ok but page(s) [0, 1] are not resident (mincore",
}
CORRECT = "membackend_memfd:MemfdBackend"


def _kit(target: str, cwd: Path, *extra: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMBACKEND_")}
    paths = [str(FIXTURE), str(TESTS / "fixtures"), str(TESTS / "fixtures" / "example_backend"),
             env.get("PYTHONPATH", "")]
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


@pytest.mark.kit_long  # the whole kit, four times over, in subprocesses
def test_the_backend_written_from_the_readme_passes_the_kit_fully(kit_runs):
    rc, out = kit_runs[CORRECT]
    assert rc == 0, out[-4000:]
    assert "not checked" not in out, out[-2000:]
    checked = next(line for line in out.splitlines() if line.startswith(f"membackend kit: {CORRECT}: checked:"))
    for check in ("ledger vs kernel", "out-of-memory rollback (capacity)", "out-of-memory rollback (injected)",
                  "rollback under injected driver failures"):
        assert check in checked, checked


@pytest.mark.kit_long
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


def test_a_target_that_does_not_load_ends_the_kit_with_one_line_naming_the_reason(tmp_path):
    p = _kit("membackend_memfd:NoSuchBackend", tmp_path, "-x")
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 4 and "the backend did not load" in out and "NoSuchBackend" in out, out[-3000:]
    assert [x for x in out.splitlines() if x.strip()] == [
        "ERROR: membackend kit: --membackend-plugin 'membackend_memfd:NoSuchBackend': the backend did not load: "
        "failed to load (entry point nosuchbackend = membackend_memfd:NoSuchBackend): AttributeError: module "
        "'membackend_memfd' has no attribute 'NoSuchBackend'"], out


@pytest.mark.parametrize("options, said", [
    (["--membackend-backend", "nonexistent"], "--membackend-backend 'nonexistent': no installed backend is named "
                                              "'nonexistent'; installed: "),
    (["--membackend-backend", "vmm:bogus"], "--membackend-backend 'vmm:bogus': 'bogus' is not a simulated profile; "
                                            "accepted: wddm-6gb, "),
    (["--membackend-profile", "nope"], "--membackend-profile 'nope' is not a simulated profile; accepted: "),
    (["--membackend-plugin", "nomodule:X"], "--membackend-plugin 'nomodule:X': the backend did not load: failed to "
                                            "load (entry point x = nomodule:X): ModuleNotFoundError: No module named "
                                            "'nomodule'"),
    (["--membackend-plugin", "nocolon"], "--membackend-plugin 'nocolon' is not an import path; accepted: "
                                         "package.module:Attr"),
])
def test_a_wrong_option_is_one_line_naming_what_is_accepted(tmp_path, options, said):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMBACKEND_")}
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs",
                        "membackend.testing.conformance", *options], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    lines = [x for x in (p.stdout + p.stderr).splitlines() if x.strip()]
    assert p.returncode == 4 and len(lines) == 1 and lines[0].startswith("ERROR: membackend kit: " + said), lines


@pytest.mark.kit_long  # the whole kit in a subprocess
def test_a_gpu_target_whose_driver_does_not_start_is_skipped_with_one_line_never_a_traceback(tmp_path):
    """The machine facts name a CUDA device, but no driver library is here: cuInit fails. Every rule skips with
    the driver's own words, the summary counts them, and no rule errors at teardown."""
    pytest.importorskip("cuda.bindings.driver")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMBACKEND_")}
    env["MEMBACKEND_MACHINE__DEVICES"] = '[{"kind": "cuda", "total_memory": "8GiB"}]'
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs",
                        "membackend.testing.conformance", "--membackend-backend=vmm", "-m", "not kit_long"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    last = p.stdout.splitlines()[-1]
    assert p.returncode == 5 and " skipped" in last and "passed" not in last and "error" not in last, \
        p.stdout[-3000:]  # nothing checked: never a green run
    assert "Traceback" not in p.stdout and "membackend kit: vmm: not checked: " in p.stdout, p.stdout[-3000:]
    assert "(backend 'vmm' cannot start its driver here (cuInit failed with " in p.stdout, p.stdout[-3000:]


@pytest.mark.kit_long  # the whole kit in a subprocess
def test_the_profile_variable_runs_a_gpu_target_on_its_simulated_machine(tmp_path):
    """MEMBACKEND_SIM_PROFILE is honoured as --membackend-profile is: every rule runs on the simulated machine."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMBACKEND_")}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "--pyargs",
           "membackend.testing.conformance", "--membackend-backend", "unified_gb10", "-m", "not kit_long"]
    simulated = subprocess.run(cmd, cwd=tmp_path, env={**env, "MEMBACKEND_SIM_PROFILE": "jetson-orin-16gb"},
                               capture_output=True, text=True, timeout=300)
    assert simulated.returncode == 0 and "unified_gb10-jetson-orin-16gb" not in simulated.stdout, simulated.stdout
    assert "membackend kit: unified_gb10:jetson-orin-16gb: checked: " in simulated.stdout, simulated.stdout[-3000:]
    assert "serves no device" not in simulated.stdout, simulated.stdout[-3000:]


@pytest.mark.kit_long  # the whole kit in a subprocess
def test_the_summary_names_the_checks_a_backend_gives_no_way_to_run(tmp_path):
    """The example fixture has no membackend_inject_failures and ignores host_capacity: never a silent pass. Both
    out-of-memory rules skip, so a run of those alone checked no rule on it and fails (exit status 5)."""
    p = _kit("membackend_example:ExampleBackend", tmp_path, "-k", "out_of_memory")
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 5, out[-3000:]
    assert "membackend kit: membackend_example:ExampleBackend: checked no rule (all 2 skipped)" in out, out[-3000:]
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


# --------------------------------------------------------------------------- the random sequences' seed


class Journal(conformance.VerbSequences):
    """The kit's sequences, each one's steps and outcomes kept (reservations named by their order)."""

    journal: list[tuple[str, ...]] = []


def sequences_drawn(target: Target, seed: int) -> list[tuple[str, ...]]:
    Journal.journal = []
    conformance.run_verb_sequences(target, 4, seed, Journal, steps=12)
    return Journal.journal


@pytest.mark.parametrize("target", [Target("host"), Target("vmm", "wddm-6gb")], ids=str)
def test_the_same_seed_draws_the_same_sequences_and_another_seed_others(target):
    first = sequences_drawn(target, 1234)
    assert len(first) >= 4 and any(len(steps) > 3 for steps in first), first
    assert sequences_drawn(target, 1234) == first, "the same seed drew other sequences"
    assert sequences_drawn(target, 4321) != first, "another seed drew the same sequences: the seed is not used"


def _rerun_line(out: str) -> str:
    return next(line for line in out.splitlines() if "membackend kit: seed " in line and "run this sequence again" in line)


def _falsifying_steps(out: str) -> list[str]:
    """The rule calls of the minimal failing program hypothesis prints (``state.reserve(pages=1)``, ...)."""
    steps = [line.lstrip("E").strip() for line in out.splitlines()]
    return [line for line in steps if line.startswith("state")]


@pytest.mark.kit_long  # two kit runs that shrink a failure: a minute on a busy machine
def test_a_failed_sequence_prints_its_seed_and_the_command_that_fails_it_again(tmp_path):
    """A mutant that fails only inside random sequences: the failure names the seed and one command; that
    command, run as printed, fails with the same minimal sequence."""
    target = "memfd_mutants:FaultBacksNothing"
    first = _kit(target, tmp_path, "-k", "random_verb_sequences", "--membackend-seed", "77")
    out, _ = first.communicate(timeout=300)
    assert first.returncode == 1, out[-4000:]
    line = _rerun_line(out)
    assert "membackend kit: seed 77; run this sequence again: (from " in line, line
    command = line.split(") ", 1)[1]
    assert command.startswith("python -m pytest ") and command.endswith("--membackend-seed=77"), command
    assert f"--membackend-plugin={target}" in command and "--membackend-examples=5" in command, command
    summary = [x for x in out.splitlines() if x.startswith("membackend kit: a property-based sequence failed")]
    assert summary and summary[0].endswith(command), summary

    # the command as printed (python: this interpreter), from the folder it names
    where = line.split("(from ", 1)[1].split(") ", 1)[0]
    argv = [sys.executable, *shlex.split(command)[1:], "-p", "no:cacheprovider"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMBACKEND_")}
    env["PYTHONPATH"] = os.pathsep.join([str(FIXTURE), str(TESTS / "fixtures")])
    again = subprocess.run(argv, cwd=where, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 1, again.stdout[-4000:]
    assert _falsifying_steps(again.stdout) == _falsifying_steps(out)
    assert _rerun_line(again.stdout) == line


@pytest.mark.kit_long  # the kit in subprocesses, twice
def test_without_a_seed_each_run_draws_one_and_the_summary_prints_it(tmp_path):
    p = _kit(CORRECT, tmp_path, "-k", "random_verb_sequences", "--membackend-examples", "1")
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out[-3000:]
    figures = next(x for x in out.splitlines() if x.startswith("membackend kit: ") and "property-based sequences" in x)
    drawn = int(figures.split("; seed ")[1].split()[0])
    assert f"(--membackend-seed={drawn} repeats them)" in figures, figures


@pytest.mark.parametrize("value", ["-1", "x", str(2**32), "1.5"])
def test_a_seed_that_is_no_whole_number_in_range_is_a_usage_error_naming_what_is_accepted(tmp_path, value):
    p = _kit(CORRECT, tmp_path, "--membackend-seed", value)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 4, out[-2000:]  # pytest's usage error
    assert f"{value!r} is not a seed; accepted: a whole number from 0 to {2**32 - 1}" in out, out[-2000:]


def _bare_kit(tmp_path: Path, *options: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The kit as a plugin's CI runs it: ``pytest --pyargs membackend.testing.conformance`` from an empty folder
    with no ``MEMBACKEND_*`` variable, the quick part only."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MEMBACKEND_")}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs",
                           "membackend.testing.conformance", "-m", "not kit_long", *options], cwd=tmp_path,
                          env={**clean, **(env or {})}, capture_output=True, text=True, timeout=300)


@pytest.mark.kit_long  # the whole kit in a subprocess
def test_a_gpu_backend_without_its_device_is_never_a_silent_green(tmp_path):
    """Forced on a machine without its GPU, the kit's rules skip (nothing to run them on): the summary says how
    many did not run and why, claims no check against anything, and the run fails with exit status 5 (as a run
    that collected nothing), saying so."""
    p = _bare_kit(tmp_path, "--membackend-backend=cuda_wddm")
    lines = [x for x in p.stdout.splitlines() if x.startswith("membackend kit: cuda_wddm:")]
    last = p.stdout.splitlines()[-1]
    assert p.returncode == 5 and " passed" not in last and " skipped" in last, last  # not one rule "passed"
    skipped = int(last.split(" skipped", 1)[0].rsplit(" ", 1)[-1])
    assert lines == [f"membackend kit: cuda_wddm: not checked: {skipped} rules (backend 'cuda_wddm' serves no "
                     f"device on this machine: {skipped}); --membackend-profile=PROFILE runs them on a simulated "
                     "machine",
                     f"membackend kit: cuda_wddm: checked no rule (all {skipped} skipped), so the run fails with exit "
                     "status 5 (--membackend-allow-unchecked lets a run that checks nothing pass)"], p.stdout[-2000:]


@pytest.mark.kit_long  # the whole kit in a subprocess, twice
def test_a_platform_tried_on_the_other_vendors_machine_is_told_what_runs_it_and_that_advice_works(tmp_path):
    """Issue 42: the hint said "--membackend-profile=PROFILE runs them on a simulated machine" to a run that gave
    one. It names the simulated machine that has no device of the backend's, and the advice it gives passes."""
    p = _bare_kit(tmp_path, "--membackend-backend=cuda_wddm", "--membackend-profile=rocm-win-2gpu")
    line = next(x for x in p.stdout.splitlines() if x.startswith("membackend kit: cuda_wddm:rocm-win-2gpu: not "))
    assert p.returncode == 5 and "serves no device on the simulated rocm-win-2gpu" in line, p.stdout[-2000:]
    hint = line.rsplit("); ", 1)[1]
    assert hint == "--membackend-backend=cuda_wddm:all runs them on every simulated machine its probe fits", line
    followed = _bare_kit(tmp_path, hint.split(" ")[0])
    assert followed.returncode == 0 and "membackend kit: cuda_wddm:wddm-6gb: checked: " in followed.stdout, \
        followed.stdout[-2000:]


@pytest.mark.kit_long  # the whole kit in a subprocess
def test_a_run_that_checks_nothing_passes_only_when_asked_to_and_says_so(tmp_path):
    allowed = _bare_kit(tmp_path, "--membackend-backend=cuda_wddm", "--membackend-allow-unchecked")
    assert allowed.returncode == 0, allowed.stdout[-2000:]
    assert "membackend kit: cuda_wddm: checked no rule (all " in allowed.stdout
    assert "skipped), allowed by --membackend-allow-unchecked" in allowed.stdout, allowed.stdout[-2000:]
    listed = _bare_kit(tmp_path, "--membackend-backend=cuda_wddm", "--collect-only")  # lists, checks nothing
    assert listed.returncode == 0 and "checked no rule" not in listed.stdout, listed.stdout[-2000:]


@pytest.mark.kit_long  # the whole kit in a subprocess
def test_one_target_checked_and_one_not_still_fails_naming_the_one(tmp_path):
    """A target whose rules all skipped is named even when another target's rules ran."""
    p = _bare_kit(tmp_path, "--membackend-backend=host", "--membackend-backend=cuda_wddm", "-k", "budget_names")
    assert p.returncode == 5, p.stdout[-2000:]
    assert "1 passed" in p.stdout.splitlines()[-1] and "membackend kit: host: checked no rule" not in p.stdout
    assert "membackend kit: cuda_wddm: checked no rule (all 1 skipped)" in p.stdout, p.stdout[-2000:]


@pytest.mark.kit_long  # the whole kit in a subprocess
def test_profile_all_runs_a_platform_on_the_machines_its_probe_accepts_and_names_the_others(tmp_path):
    """unified_gb10 serves integrated CUDA devices: 'all' runs it on the simulated GB10 and Jetson only, and
    lists every other simulated machine as not its own with its probe's reason; nothing fails."""
    p = _bare_kit(tmp_path, "--membackend-backend=unified_gb10", "--membackend-profile=all", "-rs")
    assert p.returncode == 0 and " failed" not in p.stdout and " error" not in p.stdout, p.stdout[-3000:]
    ran = {line.split(":")[2] for line in p.stdout.splitlines() if line.startswith("membackend kit: unified_gb10:")
           and ": checked: " in line}
    assert ran == {"gb10-128gb", "jetson-orin-16gb"}, p.stdout[-3000:]
    refused = next(x for x in p.stdout.splitlines() if x.startswith("membackend kit: unified_gb10: not its machines"))
    others = set(simulated_profiles(vmm_only=True)) - ran
    assert all(f"{profile} (" in refused for profile in others), refused
    assert "h200 (cuda:0 NVIDIA H200 is not integrated" in refused, refused
    assert "rocm-win-2gpu (no CUDA device" in refused, refused


@pytest.mark.kit_long  # the whole kit in a subprocess
def test_profile_all_for_a_platform_no_simulated_machine_fits_runs_it_here(tmp_path):
    """A platform of hardware no profile simulates: every simulated machine is named not its own, and it is run on
    this machine, where (with no such device here) it checks nothing, which fails the run."""
    (tmp_path / "acme_platform.py").write_text(
        "import dataclasses\n"
        "from membackend.platform import GENERIC\n"
        "from membackend.types import Candidate\n"
        "def _probe(machine):\n"
        "    return Candidate('acme', 0, 'only on acme boards')\n"
        "PLATFORM = dataclasses.replace(GENERIC, name='acme', vendor='cuda', probe=_probe)\n")
    p = _bare_kit(tmp_path, "--membackend-plugin=acme_platform:PLATFORM", "--membackend-profile=all",
                  env={"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))})
    assert p.returncode == 5, p.stdout[-3000:]
    refused = next(x for x in p.stdout.splitlines() if x.startswith("membackend kit: acme_platform:PLATFORM: not its"))
    assert all(f"{profile} (only on acme boards)" in refused for profile in simulated_profiles(vmm_only=True))
    assert "membackend kit: acme_platform:PLATFORM: checked no rule" in p.stdout, p.stdout[-3000:]
