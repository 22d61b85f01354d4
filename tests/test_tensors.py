"""membackend.tensors on CPU: tensors over host-backend reservations, with numerical checks, and
never a read of stale or unbacked memory (freed ranges are re-faulted with new generations, released
ones refused, ranges the policy does not know resident refused)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from membackend.backends.host import HostBackend  # noqa: E402
from membackend.ledger import Ledger  # noqa: E402
from membackend.machine import gather_machine  # noqa: E402
from membackend.residency import ResidencyManager  # noqa: E402
from membackend.session import Session  # noqa: E402
from membackend.tensors import (  # noqa: E402
    NotResident,
    check_resident,
    model_tensor,
    reservation_tensor,
    tensor_at,
    torch_device,
)
from membackend.types import InvalidSize, Misaligned, ReservationReleased  # noqa: E402

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
