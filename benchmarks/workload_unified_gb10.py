"""The workload of ComfyUI #14519 on the simulated GB10, shared by this plugin's tests and
``benchmarks/bench_unified_gb10.py``: sessions (the plugin, and the generic VMM as stock), the
three workflow categories, and a runner that counts bytes loaded, out-of-memory results, evictions
and the driver's own refusals."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from membackend import ResidencyManager, Session, create_session
from membackend.lab.simulated import simulated_session
from membackend.platform import GENERIC
from membackend.types import Device
from membackend_unified_gb10 import PAGE_SIZE

GB = 10**9
GIB = 1 << 30
CUDA0 = Device("cuda", 0)
LAYER = 1 * GIB  # a run faults each model in steps of this size and unpins each step after its compute

#: the seed of ComfyUI #14519: three workflow categories warmed on one GB10 (≈20, ≈45, ≈8 GB of models)
WORKFLOWS: dict[str, tuple[tuple[str, int], ...]] = {
    "image": (("image_unet", 12 * GB), ("image_text_encoder", 7_500_000_000), ("image_vae", 500_000_000)),
    "video": (("video_unet", 32 * GB), ("video_text_encoder", 12 * GB), ("video_vae", 1 * GB)),
    "audio": (("audio_model", 6 * GB), ("audio_text_encoder", 2 * GB)),
}


def gb10_session(backend: str | None = None) -> Session:
    """A session on the simulated GB10, auto-selected (``backend=None``) or forced."""
    return create_session(sim_profile="gb10-128gb", backend=backend)


def stock_session() -> Session:
    """Today's GB10 without this plugin: the generic VMM with the budget stock ComfyUI and comfy-aimdo read
    (the driver's mem-get-info, i.e. MemFree; membackend's own generic platform reads the pool on an
    integrated device since) over the same simulated machine, with this plugin's page size so bytes compare
    page for page."""
    return simulated_session("gb10-128gb", replace(GENERIC, budget_source="device"), page_size=PAGE_SIZE)


class Refusals:
    """Counts the simulated driver's out-of-memory refusals of cuMemCreate (what aborts a real GB10 load)."""

    def __init__(self, sim):
        self.count = 0
        create = sim.create

        def counted(size, device):
            try:
                return create(size, device)
            except Exception as exc:
                if getattr(exc, "kind", None) == "oom":
                    self.count += 1
                raise
        sim.create = counted  # instance attribute: only this simulated machine


@dataclass
class Run:
    """One workflow run: bytes newly backed (to be loaded again), out-of-memory results, whole models evicted."""

    workflow: str
    loaded: int = 0
    oom: int = 0
    evicted: list[str] = field(default_factory=list)


class Workload:
    """The workflows of :data:`WORKFLOWS` registered under one policy on one session."""

    def __init__(self, session, policy_cls=ResidencyManager):
        self.session = session
        self.policy = policy_cls(session)
        self.models = {name: self.policy.register(name, size, CUDA0)
                       for models in WORKFLOWS.values() for name, size in models}
        self.sim = session.backend.driver.sim
        self.refusals = Refusals(self.sim)
        self.lowest_available = self.available()

    def available(self) -> int:
        return self.sim.meminfo()["MemAvailable"]

    def resident(self) -> dict[str, int]:
        return {m: s["resident"] for m, s in self.policy.stats(CUDA0).items()}

    def run(self, workflow: str) -> Run:
        before = self.resident()
        models = [self.models[n] for n, _ in WORKFLOWS[workflow]]
        run = Run(workflow)
        self.policy.use(models)
        for m in models:
            for off in range(0, m.size, LAYER):
                n = min(LAYER, m.size - off)
                f = self.policy.fault(m, off, n)
                if not f.ok:
                    run.oom += 1
                    continue
                run.loaded += f.mapped
                self.lowest_available = min(self.lowest_available, self.available())
                self.policy.unpin(m, off, n)
        after = self.resident()
        run.evicted = [m for m in before if before[m] and not after[m]]
        return run

    def sequence(self, *workflows: str) -> list[Run]:
        return [self.run(w) for w in workflows]

    def size_of(self, workflow: str) -> int:
        """Bytes the workflow's models occupy when resident (whole pages)."""
        return sum(self.models[n].reservation(CUDA0).size for n, _ in WORKFLOWS[workflow])
