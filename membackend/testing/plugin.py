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
  backends given without one that serve GPU devices;
* ``--membackend-examples N``: property-based sequences per target (default 25);
* ``--membackend-seed N``: the seed of the property-based sequences. Without
  it each run draws one; the summary prints it, and a failed sequence prints
  the one command that runs it again (the same seed gives the same sequences).

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

import pytest

from ..types import MembackendError
from .fixtures import membackend_clean_env, membackend_simulated  # noqa: F401 (registered by this plugin)
from .harness import CHECKED, NOT_CHECKED, UNRUN, Target, build_session, checker_for, resolve_targets

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
                                        + "); --membackend-profile=PROFILE runs them on a simulated machine")
        if skipped:
            terminalreporter.write_line(f"membackend kit: {target}: not checked: "
                                        + ", ".join(f"{k} ({v})" for k, v in sorted(skipped.items())))
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
