"""membackend._tensors on CPU: tensors over host-backend reservations, with numerical checks, and
never a read of stale or unbacked memory (freed ranges are re-faulted with new generations, released
ones refused, ranges the policy does not know resident refused)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from membackend._backends.host import HostBackend  # noqa: E402
from membackend._ledger import Ledger  # noqa: E402
from membackend._machine import gather_machine  # noqa: E402
from membackend._residency import ResidencyManager  # noqa: E402
from membackend._session import Session  # noqa: E402
from membackend._tensors import (  # noqa: E402
    NotResident,
    check_resident,
    model_tensor,
    reservation_tensor,
    tensor_at,
    torch_device,
)
from membackend.types import (  # noqa: E402
    InvalidSize,
    Misaligned,
    PartialFailure,
    ReservationError,
    ReservationReleased,
    TensorAlive,
)

PS = 2 << 20


@pytest.fixture
def session():
    s = Session(HostBackend(page_size=PS, capacity=8 * PS, headroom=0), machine=gather_machine(), ledger=Ledger())
    yield s
    s.close()


def test_weights_in_a_reservation_compute_the_same_as_ordinary_tensors(session):
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(256, 512, generator=g), torch.randn(8, 512, generator=g)
    r = session.reserve("cpu", 4 * PS)
    view, f = reservation_tensor(session, r, PS + 4096, w.numel() * 4, torch.float32, w.shape)
    assert f.ok and view.data_ptr() == r.base + PS + 4096
    view.copy_(w)
    assert torch.equal(x @ view.T, x @ w.T)
    # a second view of the same bytes sees the same numbers: no copy was made
    again, f2 = reservation_tensor(session, r, PS + 4096, w.numel() * 4, torch.float32, w.shape)
    assert torch.equal(again, w) and f2.generations == f.generations and f2.mapped == 0


def test_freed_pages_are_refaulted_with_new_generations_never_read_stale(session):
    r = session.reserve("cpu", 2 * PS)
    view, f = reservation_tensor(session, r, 0, 2 * PS, torch.int32)
    view.fill_(7)
    del view
    session.free(r, 0, 2 * PS)
    again, f2 = reservation_tensor(session, r, 0, 2 * PS, torch.int32)
    assert set(f2.generations).isdisjoint(f.generations)  # new pages: the caller must copy again
    assert int(again.abs().sum()) == 0  # the old sevens are gone, not read back


def test_a_released_reservation_is_refused(session):
    r = session.reserve("cpu", PS)
    session.release_reservation(r)
    with pytest.raises(ReservationReleased):
        reservation_tensor(session, r, 0, 16)


def test_out_of_memory_gives_no_tensor_and_changes_nothing(session):
    r = session.reserve("cpu", 16 * PS)
    view, f = reservation_tensor(session, r, 0, 16 * PS)  # capacity is 8 pages
    assert view is None and not f.ok
    assert session.ledger.resident(r) == 0


@pytest.mark.parametrize("args, error", [
    ((0, 0), InvalidSize), ((-1, 8), InvalidSize), ((0, 2 * PS + 1), InvalidSize), ((0, 6, "float32"), InvalidSize),
])
def test_bad_ranges_and_dtypes_are_typed_errors(session, args, error):
    r = session.reserve("cpu", 2 * PS)
    offset, size, *dt = args
    dtype = getattr(torch, dt[0]) if dt else None
    with pytest.raises(error):
        reservation_tensor(session, r, offset, size, dtype)


def test_shape_and_alignment_are_checked(session):
    r = session.reserve("cpu", PS)
    with pytest.raises(InvalidSize, match="accepted: a shape whose product is 4"):
        reservation_tensor(session, r, 0, 16, torch.float32, (3,))
    with pytest.raises(Misaligned):
        tensor_at(r.base + 2, 8, "cpu", torch.float32)
    with pytest.raises(InvalidSize):
        tensor_at(r.base, 8, "cpu", "float32")


def test_model_tensor_pins_so_eviction_cannot_take_the_pages(session):
    mgr = ResidencyManager(session)
    a = mgr.register("a", 4 * PS, "cpu")
    b = mgr.register("b", 6 * PS, "cpu")
    ta, fa = model_tensor(mgr, a, 0, 4 * PS, dtype=torch.float32)
    assert fa.ok
    ta.fill_(1.5)
    # b needs 6 of the 8 pages: a's pinned pages must not be evicted, so b cannot fit
    tb, fb = model_tensor(mgr, b, 0, 6 * PS)
    assert tb is None and not fb.ok
    assert float(ta.sum()) == 1.5 * PS  # 4 pages of float32 = PS elements
    mgr.unpin(a, 0, 4 * PS)
    del ta
    tb, fb = model_tensor(mgr, b, 0, 6 * PS)  # now a's pages are evicted for b
    assert tb is not None and fb.ok
    with pytest.raises(NotResident, match="not resident"):
        check_resident(mgr, a, 0, 4 * PS)
    # a lost pages: its faults fail fast (watermark) until it is used again
    assert model_tensor(mgr, a, 0, 4 * PS)[0] is None
    mgr.unpin(b, 0, 6 * PS)
    del tb  # a live tensor keeps its pages from eviction even when unpinned
    mgr.use([a])  # the next run: a faults again with new generations, zeroed memory, never the old 1.5s
    ta2, fa2 = model_tensor(mgr, a, 0, 4 * PS, dtype=torch.float32)
    assert ta2 is not None and set(fa2.generations).isdisjoint(fa.generations) and float(ta2.sum()) == 0.0


def test_check_resident_after_full_unload_refuses(session):
    mgr = ResidencyManager(session)
    m = mgr.register("m", 2 * PS, "cpu")
    t, _ = model_tensor(mgr, m, 0, 2 * PS)
    assert check_resident(mgr, m, 0, 2 * PS) is m.reservation()
    del t
    mgr.full_unload(m)
    with pytest.raises(NotResident, match="fully unloaded"):
        check_resident(mgr, m, 0, 16)


def test_torch_device_names():
    assert torch_device("cpu") == "cpu" and torch_device("cuda:1") == "cuda:1" and torch_device("hip:0") == "cuda:0"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_memory_through_cuda_array_interface():
    src = torch.arange(1024, dtype=torch.float32, device="cuda")
    view = tensor_at(src.data_ptr(), src.numel() * 4, "cuda:0", torch.float32)
    assert view.device.type == "cuda" and torch.equal(view, src)


# --------------------------------------------------------------------------- a tensor never outlives its pages


def test_free_and_release_under_a_live_tensor_are_refused_naming_it(session):
    r = session.reserve("cpu", 4 * PS)
    t, _ = reservation_tensor(session, r, PS, PS, torch.int32)
    t.fill_(3)
    resident = session.ledger.resident(r)
    for verb, call in (("free", lambda: session.free(r, 0, 2 * PS)), ("free", lambda: session.free(r)),
                       ("release_reservation", lambda: session.release_reservation(r))):
        with pytest.raises(TensorAlive, match=rf"{verb}: .*reservation #{r.id} .*1 live tensor.*del t") as e:
            call()
        assert e.value.reservation is r and e.value.views == 1 and e.value.held == [(PS, 2 * PS)]
        assert isinstance(e.value, ReservationError)
    assert session.ledger.resident(r) == resident and not r.released  # nothing was changed
    assert int(t.sum()) == 3 * (PS // 4)  # and the tensor still reads its own bytes
    # ranges no tensor views are freed as before
    assert session.free(r, 0, PS) == 0 and session.free(r, 2 * PS, 2 * PS) == 0
    del t
    assert session.free(r) == PS and session.views(r) == []
    session.release_reservation(r)


def test_every_tensor_sharing_the_memory_holds_the_range(session):
    r = session.reserve("cpu", 2 * PS)
    t, _ = reservation_tensor(session, r, 0, 2 * PS, torch.float32)
    part, arr = t[100:200], t[10:20].numpy()
    reshaped = t.view(torch.int32).view(2, -1)
    computed = t * 2  # a new tensor with its own memory: it holds nothing
    del t
    for keep in ("part", "arr", "reshaped"):
        with pytest.raises(TensorAlive):
            session.release_reservation(r)
        if keep == "part":
            del part
        elif keep == "arr":
            del arr
        else:
            del reshaped
    session.release_reservation(r)
    assert computed.shape == (PS // 2,)


def test_a_tensor_in_a_reference_cycle_holds_until_collected(session):
    import gc

    r = session.reserve("cpu", PS)
    gc.disable()  # an automatic collection between the del and the free would end the view: the test is the cycle's
    try:
        t, _ = reservation_tensor(session, r, 0, PS)
        cycle = [t]
        cycle.append(cycle)
        del t, cycle
        with pytest.raises(TensorAlive, match="gc.collect"):
            session.free(r)
    finally:
        gc.enable()
    gc.collect()
    session.free(r)


def test_tensor_at_is_the_unchecked_layer_and_holds_nothing(session):
    """The ComfyUI facade's layer: ComfyUI's pins govern those pages, not a view."""
    r = session.reserve("cpu", PS)
    session.fault(r, 0, PS)
    t = tensor_at(r.base, PS, "cpu")
    assert session.views(r) == []
    del t
    session.release_reservation(r)


def test_a_failed_tensor_leaves_no_view(session):
    r = session.reserve("cpu", 16 * PS)
    assert reservation_tensor(session, r, 0, 16 * PS)[0] is None  # out of memory
    with pytest.raises(InvalidSize):
        reservation_tensor(session, r, 0, 16, torch.float32, (3,))
    with pytest.raises(Misaligned):
        reservation_tensor(session, r, 2, 8, torch.float32)
    assert session.views(r) == [] and session.free(r) >= 0
    session.release_reservation(r)


def test_eviction_skips_pages_a_live_tensor_views_and_the_address_is_never_reused_under_it(session):
    """The residency policy under pressure: an unpinned but viewed model keeps its pages and its
    address range; another model never gets them while the tensor lives, so the tensor shows its own
    bytes; once dropped, eviction and a full unload proceed, and the pages come back zeroed."""
    mgr = ResidencyManager(session)
    a = mgr.register("a", 4 * PS, "cpu")
    ta, fa = model_tensor(mgr, a, 0, 4 * PS, dtype=torch.int32)
    ta.fill_(0x0A0A0A0A)
    mgr.unpin(a, 0, 4 * PS)
    base_a = a.reservation().base
    assert mgr.evictable("cpu") == 0
    with pytest.raises(PartialFailure) as e:
        mgr.full_unload(a)
    assert [type(err) for _, err in e.value.failures] == [TensorAlive]
    assert a.reservation() is not None and mgr.residency(a) == [1] * 4  # nothing changed
    b = mgr.register("b", 6 * PS, "cpu")  # 8 pages in all: b needs 2 of a's
    mgr.use([b])
    tb, fb = model_tensor(mgr, b, 0, 6 * PS, dtype=torch.int32)
    assert tb is None and not fb.ok  # out of memory rather than a's pages
    rb = b.reservation()
    assert rb.base + rb.size <= base_a or base_a + 4 * PS <= rb.base  # no overlap with a live tensor's range
    assert bool((ta == 0x0A0A0A0A).all())
    del ta
    mgr.use([b])
    tb, fb = model_tensor(mgr, b, 0, 6 * PS, dtype=torch.int32)
    assert tb is not None and fb.ok
    tb.fill_(0x0B0B0B0B)
    mgr.unpin(b, 0, 6 * PS)
    mgr.full_unload(a)
    del tb
    mgr.full_unload(b)
    mgr.use([a])
    ta2, fa2 = model_tensor(mgr, a, 0, 4 * PS, dtype=torch.int32)
    assert ta2 is not None and int(ta2.abs().sum()) == 0  # never b's (or the old a's) bytes
    del ta2
    mgr.unload_all()


def test_released_addresses_are_reused_only_once_no_tensor_views_them(session):
    """Reserve, view and release many models, keeping some tensors: every live tensor keeps showing
    its own model's bytes, and no reservation made meanwhile overlaps a live tensor's range."""
    import random

    rng = random.Random(7)
    live: dict[int, tuple] = {}  # the only references to the tensors kept
    for i in range(60):
        r = session.reserve("cpu", PS)
        t, f = reservation_tensor(session, r, 0, PS, torch.int32)
        if t is None:  # capacity: drop the oldest tensor and release its model, then try again
            oldest = live.pop(min(live))[0]
            session.release_reservation(oldest)
            t, f = reservation_tensor(session, r, 0, PS, torch.int32)
        t.fill_(i)
        assert not any(r.base < o.base + o.size and o.base < r.base + r.size for o, _t in live.values())
        live[i] = (r, t)
        del t
        for j in [j for j in live if rng.random() < 0.4]:
            with pytest.raises(TensorAlive):
                session.release_reservation(live[j][0])
            if rng.random() < 0.5:
                session.release_reservation(live.pop(j)[0])
        assert all(int(v[1][0]) == j and int(v[1][-1]) == j for j, v in live.items())
    live.clear()


THREADED = r'''
import json, sys, threading, random
import torch
from membackend._backends.host import HostBackend
from membackend._machine import gather_machine
from membackend._residency import ResidencyManager
from membackend._session import Session
from membackend._tensors import model_tensor, reservation_tensor
from membackend.types import MembackendError, PartialFailure, ReservationReleased, TensorAlive

PS = 2 << 20
SECONDS = float(sys.argv[1])
s = Session(HostBackend(page_size=PS, capacity=10 * PS, headroom=0), machine=gather_machine())
shared = s.reserve("cpu", 4 * PS)
mgr = ResidencyManager(s)
models = [mgr.register(f"m{i}", 2 * PS, "cpu") for i in range(4)]
stop = threading.Event()
errors, counts, lock = [], {"reads": 0, "refused": 0, "freed": 0, "unloads": 0, "oom": 0}, threading.Lock()

def count(k, n=1):
    with lock:
        counts[k] += n

def reader(k):  # page k of the shared reservation: its own value, re-faulted whenever a free got through
    try:
        while not stop.is_set():
            t, f = reservation_tensor(s, shared, k * PS, PS, torch.int32)
            if t is None:
                count("oom"); continue
            t.fill_(k + 1)
            for _ in range(3):
                if not bool((t == k + 1).all()):
                    errors.append(f"reader {k} saw foreign bytes")
            count("reads")
            del t
    except Exception as exc:
        errors.append(f"reader {k}: {type(exc).__name__}: {exc}")

def freer():
    rng = random.Random(1)
    try:
        while not stop.is_set():
            k = rng.randrange(4)
            try:
                count("freed", s.free(shared, k * PS, PS) and 1)
            except TensorAlive:
                count("refused")
    except Exception as exc:
        errors.append(f"freer: {type(exc).__name__}: {exc}")

def model_user(i):  # a model's tensor under pressure from the others and an unloader
    m, rng = models[i], random.Random(i)
    try:
        while not stop.is_set():
            mgr.use([m])
            t, f = model_tensor(mgr, m, 0, 2 * PS, dtype=torch.int32)
            if t is None:
                count("oom"); continue
            mgr.unpin(m, 0, 2 * PS)  # the tensor alone must now keep the pages
            t.fill_(100 + i)
            for _ in range(3):
                if not bool((t == 100 + i).all()):
                    errors.append(f"model {i} saw foreign bytes")
            count("reads")
            del t
    except Exception as exc:
        errors.append(f"model {i}: {type(exc).__name__}: {exc}")

def unloader():
    rng = random.Random(9)
    try:
        while not stop.is_set():
            try:
                mgr.full_unload(rng.choice(models)); count("unloads")
            except PartialFailure as exc:
                if not all(isinstance(e, TensorAlive) for _, e in exc.failures):
                    raise
                count("refused")
            mgr.free_memory(PS, "cpu")
    except Exception as exc:
        errors.append(f"unloader: {type(exc).__name__}: {exc}")

threads = [threading.Thread(target=reader, args=(k,)) for k in range(4)]
threads += [threading.Thread(target=model_user, args=(i,)) for i in range(4)]
threads += [threading.Thread(target=freer), threading.Thread(target=unloader)]
for t in threads:
    t.start()
stop.wait(SECONDS)
stop.set()
for t in threads:
    t.join(60)
mgr.unload_all()
s.release_reservation(shared)
print(json.dumps({"errors": errors[:10], "counts": counts, "alive": len(s.reservations())}))
'''


@pytest.mark.long  # many threads over real torch tensors for seconds (CI runs it)
def test_threads_never_read_freed_or_reused_memory(tmp_path):
    """Readers of a shared reservation, model users under memory pressure, a freer and an unloader,
    for a few seconds in a child process (a read of freed host memory would kill it with SIGSEGV)."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMBACKEND_")}
    p = subprocess.run([sys.executable, "-X", "faulthandler", "-c", THREADED, "3"], capture_output=True, text=True,
                       timeout=240, env=env, cwd=tmp_path)
    assert p.returncode == 0, f"the threaded run died (rc {p.returncode}): {p.stderr[-3000:]}"
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["errors"] == [], out
    c = out["counts"]
    assert c["reads"] > 50 and c["refused"] > 10 and c["unloads"] > 5, c  # the race really ran
    assert out["alive"] == 0, out
