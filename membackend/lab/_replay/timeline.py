"""What a replay records over time, per side, for the timeline picture.

A :class:`Timeline` is a list of :class:`Sample` (one per device after every replayed event
that can change memory), a list of :class:`Marker` (full unloads, unload-everything, workflow
switches, and the simulated device's failures) and the running totals of those failures
(:attr:`Timeline.tallies`). Time is the replay's modelled clock in seconds: copies advance it by
their duration, compute steps by theirs; everything else is instantaneous, so many events share
one instant. The replay *step* orders what time cannot: step 0 is the state before the first
event, step ``k`` the state after the ``k``-th; both sides of a replay run the same events, so a
step is the same moment of the workload on both. The replay calls :meth:`Timeline.next_step`
once before each step's samples, and gives each :class:`Sample` and :class:`Marker` its step.

A timeline is filled by the one thread that replays its side and read once the run is over; it
takes no lock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...types import _TimelineError as TimelineError

__all__ = ["Sample", "Marker", "Timeline", "TimelineError", "TALLY_MARKERS"]

#: each running total :meth:`Timeline.tally` accepts, and the kind of marker an increase of it makes
TALLY_MARKERS = {
    "bugchecks": "bugcheck",  # the simulated machine bugchecked (a free raced a page-in or a copy)
    "raced_frees": "raced_free",  # an unmap or release the simulated driver saw race pending work
    "oom": "oom",  # faults that found no memory (the layer was streamed)
}


@dataclass(frozen=True)
class Sample:
    """One device's memory at modelled time ``t``: the address space reserved, the bytes backed
    (resident), and the process's committed memory where the platform charges it (private
    commit on Windows; ``None`` where nothing is committed beyond what is resident). A replay may
    leave out a sample that repeats its device's previous ones: a value holds until the next."""

    t: float
    device: str
    reserved: int
    resident: int
    committed: int | None = None
    #: the replay step this is the state after (see the module's docstring); ``None``: the sample's
    #: place in its device's series is its step (every step sampled)
    step: int | None = None


@dataclass(frozen=True)
class Marker:
    """An event worth drawing: ``kind`` is ``"unload"`` (one model's full unload),
    ``"unload_all"``, ``"workflow"`` (a switch to the workflow named by ``label``) or one of the
    tallied failures of :data:`TALLY_MARKERS` (``label``: how many the event added).

    ``step`` is the replay step whose state the event produced (see the module's docstring);
    ``None`` places the marker by ``t`` alone, at the first sample at or after ``t``."""

    t: float
    kind: str
    label: str
    device: str | None = None
    step: int | None = None


@dataclass
class Timeline:
    """One side's run (``side`` is ``"stock"`` or ``"plugin"``)."""

    side: str
    samples: list[Sample] = field(default_factory=list)
    markers: list[Marker] = field(default_factory=list)
    #: the running totals :meth:`next_step` was given, by name; a name never tallied is absent (not counted)
    tallies: dict[str, int] = field(default_factory=dict)
    #: how many steps :meth:`next_step` has begun: the step of a marker made now, before its samples
    steps: int = 0

    def devices(self) -> list[str]:
        """The devices sampled, in the order first seen."""
        return list(dict.fromkeys(s.device for s in self.samples))

    def next_step(self, t: float, **totals: int) -> int:
        """Begin the next replay step at modelled time ``t`` and return its number (0 for the first
        call): the step the samples taken next belong to, and the step of a marker made before
        them (:attr:`steps` until then).

        ``totals`` are running totals (names from :data:`TALLY_MARKERS`) as the simulated device
        counts them after the step's event: each that grew since the last call adds a marker of its
        kind for this step, labelled with the increase, and :attr:`tallies` keeps the latest.

        Raises :class:`TimelineError` for an unknown name, a value that is not a whole number
        ``>= 0``, or a total below the last one given (a running total never falls); the timeline
        is then left as it was, the step not begun."""
        checked: dict[str, int] = {}
        for name, total in totals.items():
            if name not in TALLY_MARKERS:
                raise TimelineError(f"cannot tally {name!r}; accepted: {', '.join(TALLY_MARKERS)}")
            if not isinstance(total, int) or isinstance(total, bool) or total < 0:
                raise TimelineError(f"tally {name}={total!r}: a running total is a whole number >= 0")
            before = self.tallies.get(name, 0)
            if total < before:
                raise TimelineError(f"tally {name}={total} is below the last total {before}: "
                                    "a running total never falls")
            checked[name] = total
        step = self.steps
        for name, total in checked.items():
            grew = total - self.tallies.get(name, 0)
            if grew:
                self.markers.append(Marker(t, TALLY_MARKERS[name], str(grew), step=step))
            self.tallies[name] = total
        self.steps = step + 1
        return step
