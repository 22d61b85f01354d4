"""The conformance kit's pytest plugin (entry point ``pytest11``).

Options:

* ``--membackend-backend NAME`` (repeatable): installed backends to check;
  ``NAME:PROFILE`` runs a GPU backend over one simulated profile;
* ``--membackend-plugin MODULE:ATTR`` (repeatable): a backend that need not be
  installed, named by its import path exactly as its entry point would name it
  (a class is built with ``from_settings(settings)`` if it has one, else with no
  arguments; an object is used as it is). The module must be importable
  (installed, on ``PYTHONPATH``, or run ``python -m pytest`` from its directory);
* ``--membackend-profile NAME`` (repeatable, or ``all``): simulated profiles for
  backends given without one that serve GPU devices; ``all`` is every simulated
  machine the backend's own probe accepts (the summary lists the others as not
  its machines, with the probe's reason);
* ``--membackend-examples N``: property-based sequences per target (default 25);
* ``--membackend-seed N``: the seed of the property-based sequences. Without
  it each run draws one; the summary prints it, and a failed sequence prints
  the one command that runs it again (the same seed gives the same sequences);
* ``--membackend-allow-unchecked``: let a run pass that checked no rule on a
  target (see below).

A run that checks no rule on a target (every rule of it skipped: a GPU
backend on a machine without its GPU, say) fails with exit status 5, as a run
that collected nothing does, and the summary says which target and why:
a plugin's CI never goes green having checked nothing. A rule counts as
checked when it ran to a pass or a failure. ``--membackend-allow-unchecked``
keeps the exit status (0 when nothing failed) and the summary says so.

The marker ``kit_long`` (registered here) marks the property-based sequences,
the kit's long part: ``-m "not kit_long"`` leaves them out of a quick run.

Fixtures (:mod:`membackend.testing.fixtures`): ``membackend_clean_env`` (no
``MEMBACKEND_*`` variable, an empty working directory) and
``membackend_simulated`` (sessions on simulated profiles, closed afterwards).

Without targets, the ini value ``membackend_targets`` (a line list) is used,
else ``host``. The plugin only adds options, fixtures and a summary: loaded in
any pytest run, it changes nothing until a test asks for ``membackend_target``,
and it never imports hypothesis (a plain install has none).

The terminal summary prints, per target, what the ledger was checked against
and every check that could not run, with the reason; then the property-based
figures (sequences, verb calls, injected failures, typed errors, out-of-memory
results) with the seed.
"""

from __future__ import annotations

import argparse
import random
import shlex
import sys
from typing import Any

import pytest

from ..types import MembackendError
from .fixtures import membackend_clean_env, membackend_simulated  # noqa: F401 (registered by this plugin)
from .harness import (
    CHECKED,
    NOT_CHECKED,
    NOT_ITS_MACHINES,
    RERUN,
    UNRUN,
    Target,
    build_session,
    checker_for,
    rerun_hint,
    resolve_targets,
)

#: the seed of this run's property-based sequences (``--membackend-seed``, else drawn at start-up)
SEED_KEY = pytest.StashKey[int]()
#: per failed property-based test of this run: the command that runs it again with the same seed
RERUNS_KEY = pytest.StashKey[list[str]]()
SEED_LIMIT = 2**32


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("membackend", "membackend conformance kit")
    group.addoption("--membackend-backend", action="append", default=[], metavar="NAME[:PROFILE]",
                    help="installed backend to run the conformance kit against (repeatable)")
    group.addoption("--membackend-plugin", action="append", default=[], metavar="MODULE:ATTR",
                    help="backend class or object to run the kit against, by import path (repeatable)")
    group.addoption("--membackend-profile", action="append", default=[], metavar="PROFILE",
                    help="simulated profile for GPU backends given without one (repeatable; 'all')")
    group.addoption("--membackend-examples", type=int, default=None, metavar="N",
                    help="property-based sequences per target (default 25)")
    group.addoption("--membackend-allow-unchecked", action="store_true", default=False,
                    help="pass a run that checked no rule on a target (every rule skipped), instead of exit status 5")
    group.addoption("--membackend-seed", type=_seed, default=None, metavar="N",
                    help=f"seed of the property-based sequences, 0 <= N < {SEED_LIMIT} (default: drawn per run, "
                         "printed in the summary)")
    parser.addini("membackend_targets", "default targets of the conformance kit", type="linelist", default=[])
    parser.addini("membackend_examples", "property-based sequences per target", default="25")


def _seed(text: str) -> int:
    """``--membackend-seed``'s value: a whole number in [0, 2**32), else a usage error naming what is accepted."""
    try:
        value = int(text, 10)
    except ValueError:
        value = -1
    if not 0 <= value < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"{text!r} is not a seed; accepted: a whole number from 0 to {SEED_LIMIT - 1}")
    return value


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "kit_long: the conformance kit's property-based sequences (its long part)")
    chosen = config.getoption("membackend_seed", None)
    config.stash[SEED_KEY] = random.SystemRandom().randrange(SEED_LIMIT) if chosen is None else chosen
    config.stash[RERUNS_KEY] = []
    if any(config.getoption(o, None) for o in ("membackend_backend", "membackend_plugin", "membackend_profile")) \
            or config.getini("membackend_targets"):
        _targets(config)  # a wrong option is one line now, not an error in every rule


def rerun_command(item: pytest.Item, seed: int) -> str:
    """The one command that runs test ``item`` again on the same targets with the same ``seed``, from the
    folder the run started in (so the same ini options, such as ``membackend_targets``, apply)."""
    config = item.config
    start = config.invocation_params.dir
    module = getattr(getattr(item, "module", None), "__name__", "")
    try:
        selected = [f"{item.path.relative_to(start)}::{item.name}"]
    except ValueError:
        # outside the folder: the kit's installed module is named as the run named it (--pyargs)
        selected = ["--pyargs", f"{module}::{item.name}"] if module.startswith("membackend.") \
            else [f"{item.path}::{item.name}"]
    parts = ["python", "-m", "pytest", *selected]
    for option, dest in (("--membackend-backend", "membackend_backend"), ("--membackend-plugin", "membackend_plugin"),
                         ("--membackend-profile", "membackend_profile")):
        parts += [f"{option}={value}" for value in config.getoption(dest)]
    examples = config.getoption("membackend_examples")
    if examples is not None:
        parts.append(f"--membackend-examples={examples}")
    parts.append(f"--membackend-seed={seed}")
    return f"(from {start}) " + shlex.join(parts)


TARGETS_KEY = pytest.StashKey[list[Target]]()
#: this run's rules per target: the node ids selected (after -k, -m and deselection), and those that ran to a
#: pass or a failure (a rule that skipped checked nothing)
RULES_KEY = pytest.StashKey[dict[str, str]]()
RAN_KEY = pytest.StashKey[dict[str, int]]()


def _targets(config: pytest.Config) -> list[Target]:
    """The targets, resolved and checked once per run; a wrong option or a backend that cannot load ends
    the run with one line naming what is wrong and what is accepted (pytest's usage error, exit status 4)."""
    if TARGETS_KEY not in config.stash:
        paths = config.getoption("membackend_plugin")
        names = config.getoption("membackend_backend") or ([] if paths else config.getini("membackend_targets")) \
            or ([] if paths else ["host"])
        option = "--membackend-backend" if config.getoption("membackend_backend") else "membackend_targets"
        try:
            config.stash[TARGETS_KEY] = resolve_targets(names, paths, config.getoption("membackend_profile"),
                                                        option)
        except MembackendError as exc:
            raise pytest.UsageError(f"membackend kit: {exc}") from None
    return config.stash[TARGETS_KEY]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "membackend_target" in metafunc.fixturenames:
        targets = _targets(metafunc.config)
        metafunc.parametrize("membackend_target", targets, ids=[str(t) for t in targets])


@pytest.fixture
def membackend_examples(request: pytest.FixtureRequest) -> int:
    return request.config.getoption("membackend_examples") or int(request.config.getini("membackend_examples"))


@pytest.fixture
def membackend_seed(request: pytest.FixtureRequest) -> int:
    """The seed of this run's property-based sequences (``--membackend-seed``, else drawn once per run)."""
    return request.config.stash[SEED_KEY]


@pytest.fixture
def membackend_session(membackend_target):
    """A fresh session forced onto the target; afterwards everything is released and checked for leaks."""
    session = build_session(membackend_target)
    yield session
    checker = checker_for(session)
    if checker.unrun is not None:  # the rule skipped: close what the backend built, check nothing
        try:
            session.close()
        except MembackendError:
            pass  # no driver to give anything back to
        return
    session.close()
    for device in session.devices()[:1]:
        checker.verify_nothing_left(device)


def _target_of(item: pytest.Item) -> Target | None:
    """The kit target a rule of this run is parametrised with (None: the item is no rule of the kit)."""
    callspec = getattr(item, "callspec", None)  # a parametrised test function's
    target = callspec.params.get("membackend_target") if callspec is not None else None
    return target if isinstance(target, Target) else None


def pytest_collection_finish(session: pytest.Session) -> None:
    session.config.stash[RULES_KEY] = {i.nodeid: str(t) for i in session.items if (t := _target_of(i)) is not None}
    session.config.stash[RAN_KEY] = {}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    report = yield
    target = _target_of(item)
    if target is not None and call.when == "call" and not report.skipped and RAN_KEY in item.config.stash:
        ran = item.config.stash[RAN_KEY]
        ran[str(target)] = ran.get(str(target), 0) + 1
    return report


def unchecked(config: pytest.Config) -> dict[str, int]:
    """The targets on which this run checked no rule: target -> the rules of it selected, every one skipped.
    Empty when the kit ran no rule at all (another suite's run) or only collected (``--collect-only``)."""
    if config.option.collectonly or RULES_KEY not in config.stash:
        return {}
    selected: dict[str, int] = {}
    for target in config.stash[RULES_KEY].values():
        selected[target] = selected.get(target, 0) + 1
    ran = config.stash[RAN_KEY]
    return {t: n for t, n in sorted(selected.items()) if not ran.get(t)}


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if unchecked(session.config) and not session.config.getoption("membackend_allow_unchecked") \
            and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.NO_TESTS_COLLECTED


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    for target in sorted(set(CHECKED) | set(NOT_CHECKED) | set(UNRUN)):
        skipped = NOT_CHECKED.get(target, {})
        unrun = UNRUN.get(target, {})
        ran = {k: v for k, v in CHECKED.get(target, {}).items() if k not in skipped}
        if ran and not unrun:  # a target whose rules did not run was checked against nothing
            terminalreporter.write_line(f"membackend kit: {target}: checked: "
                                        + ", ".join(f"{k} ({v})" for k, v in sorted(ran.items())))
        if unrun:
            terminalreporter.write_line(f"membackend kit: {target}: not checked: {sum(unrun.values())} rules ("
                                        + "; ".join(f"{why}: {n}" for why, n in sorted(unrun.items()))
                                        + "); " + RERUN.get(target, rerun_hint(Target(target))))
        if skipped:
            terminalreporter.write_line(f"membackend kit: {target}: not checked: "
                                        + ", ".join(f"{k} ({v})" for k, v in sorted(skipped.items())))
    for backend, refused in sorted(NOT_ITS_MACHINES.items()):
        terminalreporter.write_line(f"membackend kit: {backend}: not its machines (its probe refuses them, so the "
                                    "profile 'all' leaves them out): "
                                    + "; ".join(f"{p} ({why})" for p, why in sorted(refused.items())))
    for target, count in unchecked(config).items():  # why each skipped: the line above, or pytest's -rs
        verdict = "allowed by --membackend-allow-unchecked" if config.getoption("membackend_allow_unchecked") else \
            "so the run fails with exit status 5 (--membackend-allow-unchecked lets a run that checks nothing pass)"
        terminalreporter.write_line(f"membackend kit: {target}: checked no rule (all {count} skipped), {verdict}")
    # only when the kit ran: importing it needs hypothesis, which a plain install lacks
    kit = sys.modules.get("membackend.testing.conformance")
    sequences = getattr(kit, "SEQUENCES", None)
    if sequences and sequences["runs"]:
        terminalreporter.write_line(
            "membackend kit: {runs} property-based sequences, {steps} verb calls, {injected} injected driver "
            "failures, {typed_errors} typed errors, {oom} out-of-memory results".format(**sequences)
            + f"; seed {config.stash[SEED_KEY]} (--membackend-seed={config.stash[SEED_KEY]} repeats them)")
    for command in config.stash.get(RERUNS_KEY, []):
        terminalreporter.write_line(f"membackend kit: a property-based sequence failed; run it again: {command}")
