"""What a replay records over time, per side, for the timeline picture.

A :class:`Timeline` is a list of :class:`Sample` (one per device after every replayed event
that can change memory) and a list of :class:`Marker` (full unloads, unload-everything,
workflow switches). Time is the replay's modelled clock in seconds: copies advance it by
their duration, compute steps by theirs; everything else is instantaneous.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Sample", "Marker", "Timeline"]


@dataclass(frozen=True)
class Sample:
    """One device's memory at modelled time ``t``: the address space reserved, the bytes backed
    (resident), and the process's committed memory where the platform charges it (private
    commit on Windows; ``None`` where nothing is committed beyond what is resident)."""

    t: float
    device: str
    reserved: int
    resident: int
    committed: int | None = None


@dataclass(frozen=True)
class Marker:
    """An event worth drawing: ``kind`` is ``"unload"`` (one model's full unload),
    ``"unload_all"`` or ``"workflow"`` (a switch to the workflow named by ``label``)."""

    t: float
    kind: str
    label: str
    device: str | None = None


@dataclass
class Timeline:
    """One side's run (``side`` is ``"stock"`` or ``"plugin"``)."""

    side: str
    samples: list[Sample] = field(default_factory=list)
    markers: list[Marker] = field(default_factory=list)

    def devices(self) -> list[str]:
        """The devices sampled, in the order first seen."""
        return list(dict.fromkeys(s.device for s in self.samples))
