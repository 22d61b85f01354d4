"""Weights already in VRAM are never read again (``membackend._comfyui.reuse``, issue 41, item 2), at the adapter's
level on the simulated H200: a model ComfyUI dropped keeps its weights as cache; the same file's bytes read into a
new model are copied on the device, 0 bytes from the file, and the cached pages they filled go; and every case
where the bytes are not provably the same is read anew: the file rewritten (new mtime), replaced (new inode),
another dtype, a weight patched by a LoRA, a range written by a cast. The cache goes first, and /free, the
setting and the status see it. The real ComfyUI tree runs it end to end in ``tests/real_comfyui/test_dropped.py``."""

from __future__ import annotations

import gc
import os
import shutil
import time

import pytest
import torch

from membackend._comfyui import buffers
from membackend._comfyui import vbar as facade
from membackend._comfyui.status import runtime_status

WIDTH, LAYERS = 1024, 6  # 4 MiB of fp32 weights per layer


class Op(torch.nn.Linear):
    comfy_cast_weights = False
    weight_function: list = []
    bias_function: list = []


@pytest.fixture
def checkpoint(tmp_path):
    """A file of seeded weights: layer i's weight then its bias, fp32."""
    gen = torch.Generator().manual_seed(5)
    path = tmp_path / "model.bin"
    with open(path, "wb") as f:
        for _ in range(LAYERS):
            f.write(torch.randn(WIDTH, WIDTH, generator=gen).numpy().tobytes())
            f.write(torch.randn(WIDTH, generator=gen).numpy().tobytes())
    return path


class Loaded:
    """A model ComfyUI's loader made from ``path`` and its dynamic path ran once (``ModelPatcherDynamic.load``,
    then each layer faulted, viewed with ``aimdo_to_tensor`` and read from the file into its range, as
    ``comfy/memory_management.py``'s ``read_tensor_file_slice_into`` does)."""

    def __init__(self, rt, path, dtype=torch.float32, patched: int | None = None):
        self.rt = rt
        self.file = open(path, "rb")
        self.layers = [Op(WIDTH, WIDTH) for _ in range(LAYERS)]
        self.model = torch.nn.ModuleList(self.layers)
        nbytes = WIDTH * WIDTH * 4 + WIDTH * 4
        self.vbar = facade.ModelVBAR(nbytes * LAYERS * 2, 0)
        for i, m in enumerate(self.layers):
            m.weight.data = m.weight.data.to(dtype)
            m.bias.data = m.bias.data.to(dtype)
            m._v = self.vbar.alloc(m.weight.nbytes + m.bias.nbytes)
            if i == patched:
                m.weight_lowvram_function = object()  # a LoRA's patch: written over the range after the read
        rt.reuse.layout(self, self.vbar)
        self.offsets = [i * nbytes for i in range(LAYERS)]

    def read(self, through_host: bool = False):
        """Every layer faulted and read from the file into its range; returns the bytes each range holds."""
        got = []
        for m, off in zip(self.layers, self.offsets):
            assert facade.vbar_fault(m._v) is not None
            dest = facade.aimdo_to_tensor(m._v, "cpu")
            w = m.weight.nbytes
            for part, (start, size) in enumerate(((off, w), (off + w, m.bias.nbytes))):
                ptr = m._v[1] + (0 if part == 0 else w)
                if through_host:
                    host = buffers.HostBuffer(0, 0, size)
                    host.read_file_slice(self.file, start, size, offset=0, device_ptr=ptr, device=0)
                    got.append(bytes(memoryview(host._map)[:size]))
                    host.close()
                else:
                    buffers.read_file_to_device(self.file, start, size, 0, ptr, 0)
            got.append(bytes(dest.numpy()))
            facade.vbar_unpin(m._v)
        return got

    def drop(self):
        """ComfyUI drops the model: its VBAR is collected (here: closed) and retired by the adapter."""
        self.vbar.close()
        self.file.close()


def _file_bytes(path):
    return path.read_bytes()


def _expected(path):
    data = _file_bytes(path)
    return [data[i * (WIDTH * WIDTH * 4 + WIDTH * 4):(i + 1) * (WIDTH * WIDTH * 4 + WIDTH * 4)]
            for i in range(LAYERS)]


@pytest.fixture
def rt(h200_adapter):
    return h200_adapter


def _ranges(got):
    return [g for g in got if len(g) == WIDTH * WIDTH * 4 + WIDTH * 4]  # each layer's range (weight and bias)


def _host_parts(got):
    return b"".join(g for g in got if len(g) != WIDTH * WIDTH * 4 + WIDTH * 4)


def test_a_dropped_models_weights_are_copied_on_the_device_not_read_again(rt, checkpoint):
    first = Loaded(rt, checkpoint)
    assert _ranges(first.read()) == _expected(checkpoint)
    assert rt.reuse.from_file == checkpoint.stat().st_size and rt.reuse.from_vram == 0
    first.drop()
    cached = rt.residency.cached(rt.devices[0])
    assert cached > 0, "the dropped model's weights are kept as cache"
    st = runtime_status(rt)
    assert st["cache"][str(rt.devices[0])]["bytes"] == cached
    assert [m["state"] for m in st["models"].values()] == ["cached"]
    again = Loaded(rt, checkpoint)
    got = again.read(through_host=True)
    assert _ranges(got) == _expected(checkpoint)
    assert _host_parts(got) == _file_bytes(checkpoint), "the pinned host copy holds the file's bytes too"
    assert rt.reuse.from_file == checkpoint.stat().st_size, "0 bytes read from the file the second time"
    assert rt.reuse.from_vram == checkpoint.stat().st_size
    assert rt.residency.cached(rt.devices[0]) == 0, "the bytes moved: the cached pages went"
    assert [m.id for m in rt.residency.models()] == [again.vbar._model.id]
    dropped = first.vbar._model.id
    rt.quiescent()  # between nodes: the name of the cache that went goes too
    assert dropped not in rt.journal.names


def _read_anew(rt, checkpoint, change=None, **second):
    first = Loaded(rt, checkpoint)
    first.read()
    first.drop()
    assert rt.residency.cached(rt.devices[0]) > 0
    if change is not None:
        change()
    before = rt.reuse.from_vram
    again = Loaded(rt, checkpoint, **second)
    got = _ranges(again.read())
    return got, rt.reuse.from_vram - before


def test_a_file_rewritten_with_the_same_size_and_a_new_mtime_is_read_anew(rt, checkpoint):
    def rewrite():
        data = _file_bytes(checkpoint)
        time.sleep(0.01)
        with open(checkpoint, "r+b") as f:  # the same inode, the same size, new bytes at the front
            f.write(bytes(64))
        os.utime(checkpoint, ns=(time.time_ns(), time.time_ns()))
        assert len(_file_bytes(checkpoint)) == len(data)

    got, served = _read_anew(rt, checkpoint, rewrite)
    assert served == 0 and got == _expected(checkpoint)


def test_a_file_replaced_by_another_of_the_same_size_and_mtime_is_read_anew(rt, checkpoint):
    def replace():
        other = checkpoint.with_suffix(".new")
        shutil.copy2(checkpoint, other)  # the same bytes and mtime, another inode
        with open(other, "r+b") as f:
            f.write(b"\x7f" * 64)
        st = checkpoint.stat()
        os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
        os.replace(other, checkpoint)

    got, served = _read_anew(rt, checkpoint, replace)
    assert served == 0 and got == _expected(checkpoint)


def test_another_dtype_is_read_anew(rt, checkpoint):
    # the same bytes read for modules that hold them as another dtype of the same size
    got, served = _read_anew(rt, checkpoint, dtype=torch.float32)
    assert served > 0  # the control: the same dtype is served
    rt.residency.drop_cache()
    first = Loaded(rt, checkpoint)
    first.read()
    first.drop()
    before = rt.reuse.from_vram
    other = Loaded(rt, checkpoint)
    for m in other.layers:  # the modules' weights are int32 now: the bytes are not the weights they were
        m.weight = torch.nn.Parameter(m.weight.data.view(torch.int32), requires_grad=False)
        m.bias = torch.nn.Parameter(m.bias.data.view(torch.int32), requires_grad=False)
    rt.reuse.layout(other, other.vbar)
    assert _ranges(other.read()) == _expected(checkpoint) and rt.reuse.from_vram == before


def test_a_weight_patched_by_a_lora_is_never_reused(rt, checkpoint):
    first = Loaded(rt, checkpoint, patched=2)
    first.read()
    m = first.layers[2]
    facade.aimdo_to_tensor(m._v, "cpu")[:16].fill_(7)  # the LoRA's patch written over the range
    first.drop()
    before_file = rt.reuse.from_file
    again = Loaded(rt, checkpoint)
    assert _ranges(again.read()) == _expected(checkpoint)
    layer = WIDTH * WIDTH * 4 + WIDTH * 4
    assert rt.reuse.from_file - before_file == layer, "only the patched layer is read from the file"


def test_a_range_written_by_a_cast_is_never_reused(rt, checkpoint):
    first = Loaded(rt, checkpoint)
    first.read()
    m = first.layers[0]
    assert facade.vbar_fault(m._v) is not None
    facade.aimdo_to_tensor(m._v, "cpu")[:16].fill_(3)  # a cast into the range (ComfyUI asks for the tensor first)
    facade.vbar_unpin(m._v)
    first.drop()
    before_file = rt.reuse.from_file
    again = Loaded(rt, checkpoint)
    assert _ranges(again.read()) == _expected(checkpoint)
    assert rt.reuse.from_file - before_file == WIDTH * WIDTH * 4 + WIDTH * 4


def test_the_cache_goes_before_a_live_models_pages_and_free_and_the_setting_take_it(rt, checkpoint):
    dev = rt.devices[0]
    first = Loaded(rt, checkpoint)
    first.read()
    live = Loaded(rt, checkpoint)  # a live model beside the cache (its reads served by the first's pages)
    live.read()
    first.drop()
    cached = rt.residency.cached(dev)
    assert cached > 0
    resident = rt.residency.stats()[live.vbar._model.id]["resident"]
    rt.residency.on_idle()  # no run: the live model could go too, yet the cache goes first
    b = rt.session.budget_query(dev)
    rt.headroom.set_live(None, b.free + cached // 2)  # a cap the cache alone makes room for
    assert rt.residency.cached(dev) == 0
    assert rt.residency.stats()[live.vbar._model.id]["resident"] == resident, "the live model kept every page"
    rt.headroom.set_live(None, None)
    live.drop()
    assert rt.residency.cached(dev) > 0
    rt.residency.unload_all()  # POST /free
    assert rt.residency.cached(dev) == 0 and not rt.residency.models()
    rt.residency.cache_limit = 0  # keep_dropped = "off"
    again = Loaded(rt, checkpoint)
    again.read()
    again.drop()
    gc.collect()
    assert rt.residency.cached(dev) == 0 and not rt.residency.models()
