"""Fake third-party backends for the selection tests (loaded through faked entry points)."""

from membackend import hookimpl
from membackend._backends.host import HostBackend
from membackend.types import Candidate


class _Scored(HostBackend):
    score = 10
    reason = "fake"

    @hookimpl
    def membackend_probe(self, machine):
        return Candidate(self.name, self.score, self.reason)


class Alpha(_Scored):
    name, score, reason, version = "alpha", 50, "alpha fits", "1.2.3"


class Beta(_Scored):
    name, score, reason = "beta", 50, "beta fits too"


class Gamma(_Scored):
    name, score, reason = "gamma", 80, "gamma fits best"


class Unfit(_Scored):
    name, score, reason = "unfit", 0, "needs a GB10 (no unified device found)"


class GpuOnly(_Scored):
    """Serves CUDA devices only (the host's mechanism stands in for a GPU's) and does not fit without one."""

    name, score, reason, device_kinds = "gpuonly", 0, "no CUDA device", ("cuda",)


class RaisingProbe(_Scored):
    name = "raiser"

    @hookimpl
    def membackend_probe(self, machine):
        raise RuntimeError("driver exploded while probing")


class BadProbeResult(_Scored):
    name = "badresult"

    @hookimpl
    def membackend_probe(self, machine):
        return 42


class MissingVerb:
    name = "noverb"

    @hookimpl
    def membackend_probe(self, machine):
        return Candidate("noverb", 99, "would win if it were whole")

    @hookimpl
    def membackend_reserve(self, device, size): ...

    @hookimpl
    def membackend_fault(self, reservation, offset, size): ...

    @hookimpl
    def membackend_free(self, reservation, offset, size): ...

    @hookimpl
    def membackend_release_reservation(self, reservation): ...

    @hookimpl
    def membackend_budget_query(self, device): ...


class WrongSignature(_Scored):
    name, score = "wrongsig", 99

    @hookimpl
    def membackend_fault(self, res, off, size): ...


class Unmarked(_Scored):
    name, score = "unmarked", 99

    def membackend_free(self, reservation, offset, size): ...


class Configured(_Scored):
    """Built through from_settings, as a plugin that reads settings would be."""

    name, score = "configured", 5
    seen_settings = None

    @classmethod
    def from_settings(cls, settings):
        obj = cls()
        obj.seen_settings = settings
        return obj


class ExitingProbe(_Scored):
    name = "exiter"

    @hookimpl
    def membackend_probe(self, machine):
        raise SystemExit(3)  # a plugin calling sys.exit() must not stop the caller


HANG = __import__("threading").Event()


class HangingProbe(_Scored):
    name = "hanger"

    @hookimpl
    def membackend_probe(self, machine):
        HANG.wait(30)  # released by the test; bounded by probe_timeout meanwhile
        return Candidate(self.name, 99, "answered far too late")


class OptIn(_Scored):
    name = "optin"

    @hookimpl
    def membackend_probe(self, machine):
        return Candidate(self.name, 60, "fits, but only when asked for", opt_in=True)


PROBES = {"count": 0}


class Counted(_Scored):
    name, score, reason = "counted", 40, "counts its probes"

    @hookimpl
    def membackend_probe(self, machine):
        PROBES["count"] += 1
        return Candidate(self.name, self.score, self.reason)
