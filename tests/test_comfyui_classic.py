"""A wholly resident model on ComfyUI's classic path (``membackend._comfyui.classic``, issue 41, item 1), at the
adapter's level on the simulated H200: what a promotion changes and what it never does, when a model stays
dynamic, and every way it goes back before its pages can go -- with the modules restored exactly and the
queued work fenced (G2). The real ComfyUI tree runs it end to end in ``tests/real_comfyui/test_weights.py``."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from membackend._comfyui import vbar as facade

MiB = 1 << 20


class Op(torch.nn.Linear):
    """A ComfyUI op (``comfy.ops.disable_weight_init.Linear``): the cast path only when switched on."""

    comfy_cast_weights = False
    weight_function: list = []
    bias_function: list = []


class Model(torch.nn.Module):
    def __init__(self, layers: int = 4, width: int = 512):
        super().__init__()
        gen = torch.Generator().manual_seed(1)
        self.layers = torch.nn.ModuleList(Op(width, width) for _ in range(layers))
        for m in self.layers:
            with torch.no_grad():
                m.weight.copy_(torch.randn(m.weight.shape, generator=gen) / width ** 0.5)
                m.bias.copy_(torch.randn(m.bias.shape, generator=gen) * 0.01)

    def forward(self, x):
        for m in self.layers:
            x = m(x)
        return x


class Patcher:
    """What ``ModelPatcherDynamic`` leaves after ``load()`` and a first run (see the real tree's ``comfy/ops.py``):
    each module has its VBAR slot ``_v``, ``comfy_cast_weights`` on, and the weights it copied into its pages
    viewed as ``_v_weight`` / ``_v_bias`` with the fault's signature as ``_v_signature``."""

    def __init__(self, model: Model):
        self.model = model
        self.patches: dict = {}
        self.weight_wrapper_patches: dict = {}
        self.backup: dict = {}
        self.force_cast_weights = False
        size = sum(m.weight.nbytes + m.bias.nbytes for m in model.layers)
        self.vbar = facade.ModelVBAR(size * 10, 0)
        model.dynamic_vbars = {"cuda:0": self.vbar}
        for m in model.layers:
            m._v = self.vbar.alloc(m.weight.nbytes + m.bias.nbytes)
            m.comfy_cast_weights = True
            m._v_signature = None

    def model_dtype(self):
        return torch.float32

    def run_dynamic(self, x):
        """One forward on the dynamic path: fault, copy on a miss, compute from the pages, unpin."""
        for m in self.model.layers:
            sig = facade.vbar_fault(m._v)
            if sig is None:  # out of memory: ComfyUI casts the layer from its own copy (a cast buffer)
                x = torch.nn.functional.linear(x, m.weight, m.bias)
                continue
            if not facade.vbar_signature_compare(sig, m._v_signature):
                dest = facade.aimdo_to_tensor(m._v, "cpu")
                w, b = dest[:m.weight.nbytes].view(torch.float32), dest[m.weight.nbytes:].view(torch.float32)
                w.copy_(m.weight.detach().reshape(-1))
                b.copy_(m.bias.detach())
                m._v_weight, m._v_bias = w.view(m.weight.shape), b
                m._v_signature = sig
            x = torch.nn.functional.linear(x, m._v_weight, m._v_bias)
            facade.vbar_unpin(m._v)
        return x


@pytest.fixture
def rt(h200_adapter):
    return h200_adapter


def _loaded(rt):
    p = Patcher(Model())
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(2))
    expected = p.run_dynamic(x)
    return p, x, expected


def _state(m):
    return (m.weight, m.bias, m.__dict__.get("_v"), m.__dict__.get("comfy_cast_weights"))


def test_a_resident_model_runs_classic_over_its_own_pages_with_no_fault(rt):
    p, x, expected = _loaded(rt)
    before = [_state(m) for m in p.model.layers]
    resident = rt.residency.stats()[p.vbar._model.id]["resident"]
    assert rt.classic.promote(p, p.vbar)
    for m in p.model.layers:
        assert m.weight.data_ptr() == m._v_weight.data_ptr(), "no copy: the weight is the module's own pages"
        assert "_v" not in m.__dict__ and m.comfy_cast_weights is False  # the op class's classic value
    calls = list(facade.CALLS)
    assert torch.equal(p.model(x), expected), "the classic path computes the same bits"
    assert facade.CALLS == calls, "no fault, compare or unpin per weight"
    assert rt.residency.stats()[p.vbar._model.id] == {"resident": resident, "reserved": True, "held": True,
                                                      "cached": False}
    assert rt.classic.held() == [p.vbar._model.id]
    assert rt.classic.demote(p.vbar, "test")
    assert [_state(m) for m in p.model.layers] == before, "every module exactly as it was"
    assert torch.equal(p.run_dynamic(x), expected)


@pytest.mark.parametrize("why", ["lora", "weight function", "patches", "not copied", "evicted", "quantized"])
def test_a_model_that_is_patched_or_not_wholly_resident_stays_dynamic(rt, why):
    p, x, expected = _loaded(rt)
    m = p.model.layers[1]
    if why == "lora":
        m.weight_lowvram_function = object()
    elif why == "weight function":
        m.weight_function = [lambda w: w]
    elif why == "patches":
        p.patches = {"layers.1.weight": ["a patch"]}
    elif why == "not copied":
        m._v_signature = None
    elif why == "evicted":
        rt.residency.shed(p.vbar._model, 1, p.vbar._dev)  # the top page goes
    else:
        m._v_weight = m._v_weight.as_subclass(type("Quantized", (torch.Tensor,), {}))  # not a plain tensor
    loaded = rt.residency.stats()[p.vbar._model.id]["resident"]
    assert not rt.classic.promote(p, p.vbar)
    assert rt.classic.why_not[p.vbar._model.id]
    assert "_v" in m.__dict__ and m.comfy_cast_weights is True and not rt.classic.held()
    assert rt.residency.stats()[p.vbar._model.id]["resident"] == loaded, "checking faulted nothing in"


def _other(rt, fraction_of_room: float = 1.0) -> facade.ModelVBAR:
    b = rt.session.budget_query(rt.devices[0])
    size = int(b.usable * fraction_of_room) // (2 * MiB) * (2 * MiB)
    v = facade.ModelVBAR(size, 0)
    return v


def test_another_models_room_demotes_it_only_outside_the_run(rt):
    p, x, expected = _loaded(rt)
    assert rt.classic.promote(p, p.vbar)
    rt.residency.use([p.vbar._model])
    other = _other(rt)
    a = other.alloc(other.max_size)
    rt.residency.use([p.vbar._model, other._model])  # both in the run: the promoted one keeps its pages
    assert facade.vbar_fault(a) is None and rt.classic.held()
    rt.residency.use([other._model])  # a switch: the promoted model is outside the run now
    assert facade.vbar_fault(a) is not None
    facade.vbar_unpin(a)
    assert not rt.classic.held() and all("_v" in m.__dict__ for m in p.model.layers)
    assert rt.residency.stats()[p.vbar._model.id]["resident"] < p.vbar.offset


@pytest.mark.parametrize("how", ["free_memory", "unload", "lowered cap", "switched off"])
def test_each_way_its_pages_can_go_puts_it_back_first(rt, how):
    p, x, expected = _loaded(rt)
    assert rt.classic.promote(p, p.vbar)
    before = rt.classic.demoted
    if how == "free_memory":  # ComfyUI's partial unload of this model
        assert p.vbar.free_memory(1e32) > 0
    elif how == "unload":  # ComfyUI unloads it (free_memory removed it, /free)
        rt.unload_vbar(p.vbar, "test")
    elif how == "lowered cap":
        rt.residency.on_idle()  # no run: the cap takes what no longer fits
        rt.headroom.set_live(None, rt.session.budget_query(rt.devices[0]).total)
    else:
        rt.abort(RuntimeError("test"), "a test")
    assert rt.classic.demoted == before + 1 and not rt.classic.held()
    assert all("_v" in m.__dict__ and m.comfy_cast_weights is True for m in p.model.layers)


class _Event:
    """A stream event that completes when the test says so (a kernel still queued over the pages)."""

    def __init__(self, done: threading.Event):
        self._done = done

    def query(self):
        return self._done.is_set()

    def synchronize(self):
        self._done.wait(30)


class _Stream:
    def __init__(self):
        self.done = threading.Event()

    def record_event(self):
        return _Event(self.done)


def test_no_page_goes_before_the_work_queued_on_the_classic_path_is_done(rt, monkeypatch):
    """G2: what the classic path queued over the pages (a kernel, on ComfyUI's current stream) is fenced at
    the demotion, so the free that follows waits for it."""
    p, x, expected = _loaded(rt)
    assert rt.classic.promote(p, p.vbar)
    stream = _Stream()
    monkeypatch.setattr(type(rt.fences), "stream_for", staticmethod(lambda where: stream))
    freed: list[int] = []
    t = threading.Thread(target=lambda: freed.append(p.vbar.free_memory(1e32)))
    t.start()
    time.sleep(0.3)
    assert t.is_alive() and not freed, "the free did not wait for the queued work"
    stream.done.set()
    t.join(30)
    assert freed and freed[0] > 0


def test_promotion_and_demotion_under_contention_never_free_a_promoted_page(rt):
    """The prompt worker loads (demote, promote) over and over while a server thread lowers and raises the cap
    and another model's thread faults for room: every free of the model's pages comes after its demotion, and
    every module is always in one consistent state (weight over its pages with no slot, or its own weight with
    its slot)."""
    p, x, expected = _loaded(rt)
    model = p.vbar._model
    violations: list[str] = []
    free = rt.session.free

    def checked(r, offset, size):
        slot = model.slots[p.vbar._dev]
        if slot.reservation is r and slot.hold is not None and not slot.hold.ended:
            violations.append("a free under a live hold")
        return free(r, offset, size)

    rt.session.free = checked
    stop = threading.Event()
    errors: list[BaseException] = []
    taken: list[int] = []

    def worker():
        try:
            for _ in range(150):
                rt.residency.use([model])
                out = p.run_dynamic(x)
                assert torch.equal(out, expected)
                if rt.classic.promote(p, p.vbar):
                    rt.residency.on_idle()  # the run is over: a cap may take the model back meanwhile
                    time.sleep(0.001)
                    for m in p.model.layers:
                        on_pages = "_v" not in m.__dict__
                        if on_pages != (m.weight.data_ptr() == m._v_weight.data_ptr()):
                            violations.append("a module half promoted")
                    if not rt.classic.demote(p.vbar, "loaded again"):
                        taken.append(1)  # the cap took it back meanwhile
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            stop.set()

    def server():
        try:
            total = rt.session.budget_query(rt.devices[0]).total
            while not stop.is_set():
                rt.headroom.set_live(None, total)  # no room at all: what is not in the run goes
                time.sleep(0.002)
                rt.headroom.set_live(None, None)
                time.sleep(0.004)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=f) for f in (worker, server)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "stuck (a deadlock?)"
    assert not errors, errors
    assert violations == []
