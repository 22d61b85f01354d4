"""A platform plugin as a third party writes it: one Platform record behind one entry point."""

from membackend.platform import Platform
from membackend.types import Candidate, Capabilities, Score


def _probe(machine):
    gpus = machine.gpus("cuda")
    if not gpus:
        return Candidate("smallcard", Score.NONE, "no CUDA device found")
    return Candidate("smallcard", 70, f"{len(gpus)} small CUDA card(s)")


PLATFORM = Platform(name="smallcard", vendor="cuda", probe=_probe,
                    capabilities=Capabilities(recycle_handles=True), headroom=64 << 20)
