"""What rocm_windows keeps after a full unload (issue 24, item 9) on ``rocm-win-2gpu``.

The simulated runtime charges reserved address space to private commit (ComfyUI #15993: 41.58 GB of
private bytes after a full unload, 7.33 GB once released) and fails every large address reserve once the
process has freed 14 windows of at least 1 GiB (rocm-systems #6191); the plugin keeps released large
windows for reuse so as not to spend those frees. Before this item a device kept as many windows as it
had large reservations alive at once (at least 4): after 20 load/unload cycles of six 1.5 GiB models,
every model unregistered, idle and a trim, 6 windows (9.0 GiB) stayed committed. Now:

* at most ``kept_windows`` windows stay per device (default 1; the platform's setting,
  ``MEMBACKEND_ROCM_WINDOWS_KEPT_WINDOWS`` or ``kept_windows`` in a ``[rocm_windows]`` table);
* the idle give-back (``ResidencyManager.on_idle``, a trim) returns the rest whenever the churn allowance
  permits (12 of the 14 frees, and never one that would leave too few to bring every device back within
  its bound) and never otherwise;
* ``VmmBackend.kept_windows`` reports the count, bytes, bound and why they stay.

No timing: idle is the event ComfyUI's adapter signals (the prompt queue emptied), called here directly.
"""

from __future__ import annotations

import json
import random

import pytest

import membackend_rocm_windows as rw
from membackend._backends.vmm import AddressWindowsExhausted
from membackend._manager import BackendManager
from membackend._residency import ResidencyManager
from membackend._settings import load_settings
from membackend.types import ConfigError, DriverError

from rocm_windows_sessions import ALLOWED, PROFILE, GiB, MiB, session, sim, window
from workload_rocm_windows import HIP0, HIP1, KREA2, run_cycles


def values(**platform):
    return rw.PLATFORM.setting_values(load_settings(rocm_windows=platform) if platform else None)


def load(policy, models) -> None:
    """Each model in turn, as ComfyUI loads them: used, faulted whole, unpinned."""
    for m in models:
        policy.use([m])
        assert policy.fault(m, 0, m.size).ok, m.id
        policy.unpin(m, 0, m.size)


def kept_bytes(s) -> dict:
    return {d: s.backend.kept_windows(d).bytes for d in (HIP0, HIP1)}


# --------------------------------------------------------------------------- the bound and its setting


def test_the_default_keeps_one_window_per_device_the_largest():
    """Two large windows released on hip:0: the smaller goes back at once (one large free), the larger stays
    for reuse; hip:1 is untouched. The report says so."""
    assert rw.PLATFORM.capabilities_for(values()).reserve_churn_keep == 1
    s = session()
    small, big = s.reserve(HIP0, 2 * GiB), s.reserve(HIP0, 4 * GiB)
    s.release_reservation(small)
    s.release_reservation(big)
    kept = s.backend.kept_windows(HIP0)
    assert (kept.windows, kept.bytes, kept.largest, kept.bound) == (1, 4 * GiB, 4 * GiB, 1)
    assert kept.bound_rule == "the platform's bound: 1 per device"
    assert sim(s).churn_frees == 1 and sim(s).state(0)["reserved"] == 4 * GiB == sim(s).private_commit
    assert kept.can_give_back and kept.give_back == 1 and "gives them back" in kept.reason
    assert s.backend.kept_windows(HIP1).windows == 0 and sim(s).state(1)["reserved"] == 0
    s.close()
    assert sim(s).private_commit == 0


@pytest.mark.parametrize("source", ["env", "file", "kwargs"])
def test_the_kept_windows_setting_changes_the_bound(source, monkeypatch, tmp_path):
    if source == "env":
        monkeypatch.setenv(rw.KEPT_ENV, "3")
        got, s = values(), session()
        where = f"env {rw.KEPT_ENV}"
    elif source == "file":
        (tmp_path / "membackend.toml").write_text("[rocm_windows]\nkept_windows = 3\n")
        got, s = values(), session()
        where = "membackend.toml [rocm_windows]"
    else:
        got, s = values(kept_windows=3), session(kept_windows=3)
        where = "kwargs"
    assert (got["kept_windows"], got.source("kept_windows")) == (3, where)
    assert rw.kept_windows(got) == (3, f"rocm_windows.kept_windows from {where}")
    assert f"at most 3 per device (rocm_windows.kept_windows from {where})" in rw.policy(got)
    assert s.capabilities.reserve_churn_keep == 3
    rs = [s.reserve(HIP1, (i + 1) * GiB) for i in range(4)]
    for r in rs:
        s.release_reservation(r)
    kept = s.backend.kept_windows(HIP1)
    assert (kept.windows, kept.bytes, kept.bound) == (3, (2 + 3 + 4) * GiB, 3), "the smallest went back"
    assert sim(s).churn_frees == 1
    s.close()


@pytest.mark.parametrize("value, says", [("0", "keeps no window"), ("-1", "not a whole number"),
                                         ("two", "not a whole number"), ("1.5", "not a whole number")])
def test_a_bad_kept_windows_setting_is_a_config_error_naming_the_setting_and_what_is_accepted(monkeypatch, value,
                                                                                              says):
    monkeypatch.setenv(rw.KEPT_ENV, value)
    with pytest.raises(ConfigError) as info:
        values()
    err = info.value
    assert (err.key, err.source) == ("rocm_windows.kept_windows", f"env {rw.KEPT_ENV}")
    assert says in str(err) and err.accepted == "a whole number of address windows per device, at least 1"
    with pytest.raises(ConfigError, match=rw.KEPT_ENV):  # membackend refuses it as a settings error
        BackendManager(load_settings(sim_profile=PROFILE))


@pytest.mark.parametrize("value, says", [(0, "keeps no window"), (True, "not a whole number"),
                                         (2.0, "not a whole number")])
def test_a_bad_kept_windows_value_in_a_table_is_refused_too(tmp_path, value, says):
    (tmp_path / "membackend.toml").write_text(f"[rocm_windows]\nkept_windows = {json.dumps(value)}\n")
    with pytest.raises(ConfigError, match=says) as info:
        values()
    assert (info.value.key, info.value.source) == ("rocm_windows.kept_windows", "membackend.toml [rocm_windows]")


# --------------------------------------------------------------------------- the run


def test_the_20_cycle_run_then_idle_and_a_trim_leaves_at_most_one_window_per_device():
    """The issue's figure: six 1.5 GiB models on hip:0, 20 cycles each ending in unload_all and idle, then
    every model unregistered, idle and a trim. Before: 6 windows (9.0 GiB) stayed committed. Now the first
    two cycles give everything back (the 12 frees allowed), and what stays is one window on hip:0 (none on
    hip:1), which is exactly the commit above the baseline and what the report says."""
    s = session()
    baseline = sim(s).private_commit
    policy = ResidencyManager(s)
    models = [policy.register(f"m{i}", int(1.5 * GiB), HIP0) for i in range(6)]
    for _ in range(20):
        load(policy, models)
        policy.unload_all()
        policy.on_idle()
    for m in models:
        policy.unregister(m)
    policy.on_idle()
    s.trim()
    assert sim(s).churn_frees == ALLOWED and sim(s).crashes == 0
    assert sim(s).private_commit - baseline == window(int(1.5 * GiB)) == sum(kept_bytes(s).values())
    k0, k1 = s.backend.kept_windows(HIP0), s.backend.kept_windows(HIP1)
    assert (k0.windows, k0.bytes, k0.bound, k1.windows, k1.bound) == (1, window(int(1.5 * GiB)), 1, 0, 1)
    assert not k0.can_give_back and "no more large frees (12 of 12 spent)" in k0.reason and k1.reason == "none kept"
    state = s.inspect(HIP0)
    assert state.held == state.committed == k0.bytes and state.reserved == 0
    s.close()


@pytest.mark.parametrize("unload_everything", [True, False], ids=["unload_all", "full_unload"])
def test_the_krea2_cycles_on_both_devices_end_within_one_window_per_device(unload_everything):
    """The benchmark's cycles (text encoder and UNet alternating hip:0 and hip:1), 20 of them, then every model
    unregistered, idle and a trim: at most one window per device stays, no cycle fails, and never more than
    the 12 frees allowed are spent."""
    s = session()
    policy = ResidencyManager(s)
    r = run_cycles(s, policy, 20, unload_everything=unload_everything)
    assert r.error is None and r.done == 20
    for ms in r.models.values():
        for m in ms:
            policy.unregister(m)
    policy.on_idle()
    s.trim()
    assert sim(s).churn_frees <= ALLOWED and sim(s).crashes == 0
    for d in (HIP0, HIP1):
        kept = s.backend.kept_windows(d)
        assert kept.windows <= 1 == kept.bound and kept.bytes <= window(KREA2["unet"])
    assert sim(s).private_commit == sum(kept_bytes(s).values())
    s.close()


def test_the_idle_give_back_returns_commit_to_the_baseline_when_the_allowance_permits():
    """Four cycles with a full unload of each model: between them each device keeps one window (the UNet's;
    before this item both the text encoder's and the UNet's); idle then gives them all back, the frees
    permitting, and commit is at the baseline."""
    s = session()
    baseline = sim(s).private_commit
    policy = ResidencyManager(s)
    r = run_cycles(s, policy, 4)
    assert r.error is None and r.done == 4
    assert r.commits[-1] - baseline == 2 * window(KREA2["unet"]), "one window per device between the runs"
    for ms in r.models.values():
        for m in ms:
            policy.unregister(m)
    given = policy.on_idle()
    assert given == 2 * window(KREA2["unet"]) and sim(s).private_commit == baseline
    assert [s.backend.kept_windows(d).reason for d in (HIP0, HIP1)] == ["none kept", "none kept"]
    assert sim(s).churn_frees <= ALLOWED
    s.close()


# --------------------------------------------------------------------------- the churn allowance


def test_the_idle_give_back_never_spends_a_free_the_allowance_does_not_permit():
    """hip:1 spends 11 of the 12 frees (twelve 1 GiB windows released: eleven past its bound of one), then
    hip:0 holds two large reservations, one past its bound: the last free is owed to it. Idle does not give
    hip:1's window back (that free would leave hip:0 above its bound for good), and says why; releasing
    hip:0's models spends the last free on its bound; idle then frees nothing, and large reserves still
    work (the platform's 14 are never reached)."""
    s = session()
    policy = ResidencyManager(s)
    b = s.backend
    many = [s.reserve(HIP1, GiB) for _ in range(12)]
    for r in many:
        s.release_reservation(r)
    assert sim(s).churn_frees == 11 and b.kept_windows(HIP1).windows == 1
    a, c = s.reserve(HIP0, 2 * GiB), s.reserve(HIP0, 3 * GiB)
    with pytest.raises(AddressWindowsExhausted, match="could never be given back"):
        s.reserve(HIP0, 4 * GiB)  # a third would need a second free that is not there
    assert policy.on_idle() == 0 and sim(s).churn_frees == 11, "the last free is owed to hip:0's bound"
    k1 = b.kept_windows(HIP1)
    assert (k1.windows, k1.give_back, k1.can_give_back) == (1, 0, False)
    assert "the 1 large free(s) left are held" in k1.reason and "held" in k1.describe()
    s.release_reservation(a)
    s.release_reservation(c)  # two kept on hip:0: the smaller goes, the last free
    assert sim(s).churn_frees == ALLOWED and b.kept_windows(HIP0).bytes == 3 * GiB
    assert policy.on_idle() == 0 and s.trim() == 0 and sim(s).churn_frees == ALLOWED
    for d in (HIP0, HIP1):
        kept = b.kept_windows(d)
        assert kept.windows == 1 == kept.bound and "no more large frees" in kept.reason
    assert s.reserve(HIP0, 3 * GiB).size == 3 * GiB and s.reserve(HIP1, GiB).size == GiB, "kept windows serve"
    assert sim(s).crashes == 0


@pytest.mark.parametrize("bound", [1, 3])
@pytest.mark.parametrize("seed", range(6))
def test_any_sequence_spends_only_the_allowance_and_ends_within_the_bound(seed, bound):
    """Seeded sequences of reserves, releases and idle give-backs over both devices (sizes of the #15993 set
    and of the #6191 reproducer's windows): never more than the 12 frees allowed are spent, a reserve either
    gets a window or is refused as out of memory (never a DriverError), a device's trim gives back what its
    report said it would (``kept_windows().give_back``, the smallest), and once everything is released and
    idle has passed, each device keeps at most its ``bound`` (the ``kept_windows`` setting) windows."""
    rng = random.Random(seed)
    sizes = [GiB, int(1.5 * GiB), 2 * GiB, 6 * GiB, 5 * 10**9, 12 * 10**9, 256 * MiB]
    s = session(kept_windows=bound)
    policy = ResidencyManager(s)
    alive = []
    for _ in range(120):
        op = rng.random()
        if op < 0.5 and len(alive) < 6:
            try:
                alive.append(s.reserve(rng.choice((HIP0, HIP1)), rng.choice(sizes)))
            except AddressWindowsExhausted:
                pass  # out of memory, typed: nothing changed
        elif op < 0.9 and alive:
            s.release_reservation(alive.pop(rng.randrange(len(alive))))
        elif op < 0.95:
            policy.on_idle()
        else:  # one device trimmed: it gives back what its report said, the smallest first
            d = rng.choice((HIP0, HIP1))
            said = s.backend.kept_windows(d)
            state = s.backend._window_books.devices.get(d.index)  # the backend's kept windows (None: none yet)
            smallest = sorted(size for _, size in (state.windows if state else []))[:said.give_back]
            assert s.trim(d) == sum(smallest), said.describe()
            assert s.backend.kept_windows(d).windows == said.windows - said.give_back, said.describe()
        assert sim(s).churn_frees <= ALLOWED
    for r in alive:
        s.release_reservation(r)
    policy.on_idle()
    assert sim(s).churn_frees <= ALLOWED and sim(s).crashes == 0
    for d in (HIP0, HIP1):
        kept = s.backend.kept_windows(d)
        assert kept.windows <= bound and (kept.windows == 0 or not kept.can_give_back), kept.describe()
    assert sim(s).private_commit == sum(kept_bytes(s).values())
    s.close()


def test_the_window_a_device_gets_last_holds_the_largest_model_it_served():
    """Once no free is left to spare, a fresh large window is reserved as large as the largest the device
    served: the text encoder, loaded first, gets a UNet-sized window, so the UNet still loads afterwards (the
    idle text encoder is unloaded for it) instead of being out of memory for the rest of the process."""
    s = session()
    policy = ResidencyManager(s)
    te, unet = policy.register("te", KREA2["text_encoder"], HIP0), policy.register("unet", KREA2["unet"], HIP0)
    load(policy, [te, unet])
    policy.unload_all()  # both windows back: 2 frees
    rs = [s.reserve(HIP1, GiB) for _ in range(11)]
    for r in rs:
        s.release_reservation(r)  # 10 more past hip:1's bound: the 12 are spent
    assert sim(s).churn_frees == ALLOWED and sim(s).state(0)["reserved"] == 0
    load(policy, [te])
    assert sim(s).state(0)["reserved"] == window(KREA2["unet"]), "sized to hold the UNet"
    load(policy, [unet])  # no free for a second window: the idle text encoder gives its own
    assert te.reservation(HIP0) is None and unet.reservation(HIP0) is not None
    assert sim(s).state(0)["reservations"] == 1 and sim(s).churn_frees == ALLOWED and sim(s).crashes == 0
    load(policy, [te])  # and back
    assert unet.reservation(HIP0) is None and te.reservation(HIP0) is not None
    s.close()


# --------------------------------------------------------------------------- what the doctor shows


def test_the_doctor_shows_the_windows_kept_their_bytes_the_bound_and_why(monkeypatch, capsys):
    """``membackend doctor --json`` carries ``VmmBackend.kept_windows`` per device (count, bytes, bound, its
    rule, what a trim would give back, the reason), and the probe's reason names the setting in force."""
    from membackend._cli import main

    monkeypatch.setenv("MEMBACKEND_SIM_PROFILE", PROFILE)
    monkeypatch.setenv(rw.KEPT_ENV, "2")
    assert main(["doctor", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["device"]: r for r in out["kept_windows"]}
    assert set(rows) == {"hip:0", "hip:1"}
    for d, row in rows.items():
        assert (row["windows"], row["bytes"], row["bound"], row["give_back"]) == (0, 0, 2, 0)
        assert row["bound_rule"] == "the platform's bound: 2 per device" and row["reason"] == "none kept"
        assert row["line"].startswith(f"{d}: no address window kept; at most 2 stay")
    assert f"at most 2 per device (rocm_windows.kept_windows from env {rw.KEPT_ENV})" in out["reason"]


def test_no_driver_error_reaches_the_caller_when_the_frees_are_spent_elsewhere():
    """Frees this backend did not see spent the platform's limit: with one window kept (the default), the
    model it holds still loads; a model it does not hold is out of memory — a typed refusal or a fault
    result, never a DriverError."""
    s = session()
    policy = ResidencyManager(s)
    unet = policy.register("unet", KREA2["unet"], HIP0)
    load(policy, [unet])
    policy.full_unload(unet)  # its window kept
    sim(s).churn_frees = 14  # spent by someone else in the process
    load(policy, [unet])  # reuses the kept window: no reserve reaches the runtime
    with pytest.raises(AddressWindowsExhausted) as refused:
        policy.register("video", 14 * GiB, HIP0)
    assert not isinstance(refused.value, DriverError) and isinstance(refused.value, MemoryError)
    s.close()
