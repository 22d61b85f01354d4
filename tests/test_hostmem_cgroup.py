"""Issue 43 item 3: inside a container the host budget is what the memory cgroup can still give.

ComfyUI (Comfy-Org/ComfyUI #15927) budgets a container as its limit minus its non-reclaimable use,
``memory.current - inactive_file``: the page cache of the checkpoints it just read is given back before the
cgroup runs out, so it is not used memory. Every test builds a fake cgroup tree under ``tmp_path`` (v2 at the
root, v1 under ``memory/``) and fakes psutil's ``MemAvailable``, so nothing here depends on where it runs.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from membackend import _cli as cli
from membackend import _hostmem as hostmem
from membackend._hostmem import cgroup_memory, host_memory, read_cgroup
from membackend._machine import gather_machine
from membackend.testing import measure

GiB = 1 << 30
HOST_RAM, HOST_AVAILABLE = 58 * GiB, 50 * GiB  # the 58 GiB host, most of it free


@pytest.fixture(autouse=True)
def host_ram(monkeypatch):
    """psutil says the host has 58 GiB of RAM, 50 GiB of it available."""
    monkeypatch.setattr(hostmem.psutil, "virtual_memory",
                        lambda: SimpleNamespace(total=HOST_RAM, available=HOST_AVAILABLE))


def v2(root: Path, limit: str | int, current: int | None, stat: str | None) -> Path:
    """A cgroup v2 tree: ``memory.max``, ``memory.current`` and ``memory.stat`` (each left out when None)."""
    (root / "memory.max").write_text(f"{limit}\n")
    if current is not None:
        (root / "memory.current").write_text(f"{current}\n")
    if stat is not None:
        (root / "memory.stat").write_text(stat)
    return root


def v1(root: Path, limit: int, usage: int, stat: str | None) -> Path:
    """A cgroup v1 tree under ``memory/``: ``memory.limit_in_bytes``, ``memory.usage_in_bytes``, ``memory.stat``."""
    (root / "memory").mkdir()
    (root / "memory" / "memory.limit_in_bytes").write_text(f"{limit}\n")
    (root / "memory" / "memory.usage_in_bytes").write_text(f"{usage}\n")
    if stat is not None:
        (root / "memory" / "memory.stat").write_text(stat)
    return root


def v2_stat(inactive_file: int) -> str:
    """A v2 ``memory.stat`` as the kernel writes it (abridged): ``inactive_file`` among its neighbours."""
    return (f"anon {10 * GiB}\nfile {8 * GiB}\nkernel 52428800\nshmem 0\nactive_anon {9 * GiB}\n"
            f"inactive_anon {GiB}\nactive_file {2 * GiB}\ninactive_file {inactive_file}\nunevictable 0\n")


def deny_reads(monkeypatch, *names: str) -> None:
    """Reading a file named in ``names`` raises PermissionError (chmod would not stop root)."""
    real = Path.read_text

    def read_text(self: Path, *args, **kwargs) -> str:
        if self.name in names:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)


# --------------------------------------------------------------------------- the case


def test_a_32_gib_container_holding_a_6_gib_page_cache_can_still_give_18_gib(tmp_path):
    # 20 GiB charged to the cgroup, 6 GiB of it the inactive page cache of the checkpoint just read.
    # Before (the whole memory.current subtracted): 32 - 20 = 12 GiB available.
    # After (ComfyUI's rule, memory.current - inactive_file): 32 - (20 - 6) = 18 GiB available.
    mem = host_memory(v2(tmp_path, 32 * GiB, 20 * GiB, v2_stat(6 * GiB)))
    before, after = 32 * GiB - 20 * GiB, 32 * GiB - (20 * GiB - 6 * GiB)
    assert (mem.total, mem.cgroup_limit, mem.source) == (32 * GiB, 32 * GiB, "cgroup memory limit")
    assert mem.available == after == 18 * GiB, (
        f"budget inside a 32 GiB container with a 6 GiB page cache: {mem.available / GiB:.2f} GiB available; "
        f"want {after / GiB:.0f} GiB (limit - (usage - inactive_file)), not {before / GiB:.0f} GiB (limit - usage)")
    assert (mem.ram_total, mem.ram_available) == (HOST_RAM, HOST_AVAILABLE)  # the machine's own figures stay


def test_the_conformance_measure_agrees_with_the_new_figure(tmp_path, monkeypatch):
    """The kit's independent measure bounds a budget's free by the same rule, or the self-test fails."""
    root = v2(tmp_path, 32 * GiB, 20 * GiB, v2_stat(6 * GiB))
    monkeypatch.setattr(measure, "_meminfo", lambda: {"MemTotal": HOST_RAM, "MemAvailable": HOST_AVAILABLE})
    monkeypatch.setattr(measure, "read_cgroup", lambda: read_cgroup(root))
    truth = measure.host_truth()
    assert truth is not None and (truth.total, truth.free_high) == (32 * GiB, host_memory(root).available)
    assert "memory.current - inactive_file of memory.stat" in truth.source


# --------------------------------------------------------------------------- v1, v2, no limit


def test_v2_subtracts_memory_current_less_inactive_file(tmp_path):
    cg = read_cgroup(v2(tmp_path, 16 * GiB, 12 * GiB, v2_stat(4 * GiB)))
    assert cg is not None
    assert (cg.version, cg.limit, cg.usage, cg.inactive_file) == ("v2", 16 * GiB, 12 * GiB, 4 * GiB)
    assert (cg.non_reclaimable, cg.room) == (8 * GiB, 8 * GiB)
    assert cg.describe() == "cgroup v2 memory.max - (memory.current - inactive_file of memory.stat)"
    assert cgroup_memory(tmp_path) == (16 * GiB, 12 * GiB)  # the old (limit, usage) answer is unchanged


def test_v1_prefers_the_hierarchical_total_inactive_file(tmp_path):
    stat = (f"cache {5 * GiB}\nrss {6 * GiB}\ninactive_file {GiB}\nactive_file {GiB}\n"
            f"total_cache {5 * GiB}\ntotal_rss {6 * GiB}\ntotal_inactive_file {3 * GiB}\n")
    mem = host_memory(v1(tmp_path, 16 * GiB, 11 * GiB, stat))
    assert mem.cgroup is not None and mem.cgroup.inactive_file == 3 * GiB
    assert (mem.total, mem.available) == (16 * GiB, 16 * GiB - (11 * GiB - 3 * GiB))
    assert mem.cgroup.describe() == ("cgroup v1 memory.limit_in_bytes - "
                                     "(memory.usage_in_bytes - total_inactive_file of memory.stat)")


def test_v1_without_total_inactive_file_uses_this_cgroup_s_inactive_file(tmp_path):
    mem = host_memory(v1(tmp_path, 16 * GiB, 11 * GiB, f"cache {5 * GiB}\ninactive_file {2 * GiB}\n"))
    assert mem.available == 16 * GiB - 9 * GiB
    assert mem.cgroup is not None and mem.cgroup.describe().endswith("- inactive_file of memory.stat)")


@pytest.mark.parametrize("layout", ["v2 max", "v1 huge number"])
def test_no_limit_leaves_memavailable(tmp_path, layout):
    if layout == "v2 max":
        v2(tmp_path, "max", 20 * GiB, v2_stat(6 * GiB))
    else:
        v1(tmp_path, 9223372036854771712, 20 * GiB, f"total_inactive_file {6 * GiB}\n")  # 2**63 - 4096
    mem = host_memory(tmp_path)
    assert (mem.total, mem.available, mem.cgroup_limit, mem.source) == \
        (HOST_RAM, HOST_AVAILABLE, None, "psutil MemAvailable")
    assert mem.cgroup is not None and mem.cgroup.room is None and mem.cgroup.describe().endswith(": no limit")


def test_no_cgroup_at_all(tmp_path):
    assert read_cgroup(tmp_path) is None and cgroup_memory(tmp_path) == (None, None)
    mem = host_memory(tmp_path)
    assert (mem.total, mem.available, mem.cgroup, mem.source) == (HOST_RAM, HOST_AVAILABLE, None, "psutil MemAvailable")


def test_a_limit_at_or_above_the_ram_caps_nothing(tmp_path):
    mem = host_memory(v2(tmp_path, 64 * GiB, 60 * GiB, v2_stat(0)))
    assert (mem.total, mem.available, mem.cgroup_limit) == (HOST_RAM, HOST_AVAILABLE, 64 * GiB)


def test_memavailable_below_the_cgroup_s_room_wins(tmp_path, monkeypatch):
    monkeypatch.setattr(hostmem.psutil, "virtual_memory", lambda: SimpleNamespace(total=HOST_RAM, available=5 * GiB))
    assert host_memory(v2(tmp_path, 32 * GiB, 20 * GiB, v2_stat(6 * GiB))).available == 5 * GiB


def test_usage_over_the_limit_leaves_nothing_not_a_negative(tmp_path):
    assert host_memory(v2(tmp_path, 32 * GiB, 40 * GiB, v2_stat(2 * GiB))).available == 0


def test_an_inactive_file_above_the_usage_counts_nothing_as_used(tmp_path):
    cg = read_cgroup(v2(tmp_path, 32 * GiB, 4 * GiB, v2_stat(6 * GiB)))  # a racy read: stat after a drop
    assert cg is not None and (cg.non_reclaimable, cg.room) == (0, 32 * GiB)
    assert host_memory(tmp_path).available == 32 * GiB


# --------------------------------------------------------------------------- what cannot be read


def test_an_unreadable_memory_stat_subtracts_the_whole_usage_and_says_why(tmp_path, monkeypatch):
    root = v2(tmp_path, 32 * GiB, 20 * GiB, v2_stat(6 * GiB))
    deny_reads(monkeypatch, "memory.stat")
    mem = host_memory(root)
    assert mem.available == 12 * GiB and mem.cgroup is not None and mem.cgroup.inactive_file is None
    assert mem.cgroup.describe() == ("cgroup v2 memory.max - the whole memory.current (memory.stat could not be "
                                     "read (PermissionError): its file cache counted as used)")


def test_a_missing_memory_stat_subtracts_the_whole_usage(tmp_path):
    mem = host_memory(v2(tmp_path, 32 * GiB, 20 * GiB, None))
    assert mem.available == 12 * GiB and mem.cgroup is not None
    assert "memory.stat could not be read (FileNotFoundError)" in mem.cgroup.describe()


def test_a_memory_stat_without_the_key_subtracts_the_whole_usage(tmp_path):
    mem = host_memory(v2(tmp_path, 32 * GiB, 20 * GiB, f"anon {14 * GiB}\nfile {6 * GiB}\nactive_file {GiB}\n"))
    assert mem.available == 12 * GiB and mem.cgroup is not None
    assert "memory.stat has no inactive_file line" in mem.cgroup.describe()
    v1_root = tmp_path / "v1"
    v1_root.mkdir()
    v1_mem = host_memory(v1(v1_root, 32 * GiB, 20 * GiB, f"cache {6 * GiB}\n"))
    assert v1_mem.available == 12 * GiB and v1_mem.cgroup is not None
    assert "memory.stat has no total_inactive_file or inactive_file line" in v1_mem.cgroup.describe()


@pytest.mark.parametrize("stat", [
    "inactive_file lots\n",                     # not a number
    "inactive_file -4096\n",                    # not a byte count
    "inactive_file\n",                          # no value
    b"\xff\xfe\x00inactive_file \x80\x81\n",  # not text at all
    "",                                         # empty
])
def test_garbage_in_memory_stat_subtracts_the_whole_usage(tmp_path, stat):
    root = v2(tmp_path, 32 * GiB, 20 * GiB, None)
    if isinstance(stat, bytes):
        (root / "memory.stat").write_bytes(stat)
    else:
        (root / "memory.stat").write_text(stat)
    mem = host_memory(root)
    assert mem.available == 12 * GiB and mem.cgroup is not None and mem.cgroup.inactive_file is None
    assert "the whole memory.current" in mem.cgroup.describe()


def test_an_unreadable_usage_subtracts_nothing_and_says_so(tmp_path, monkeypatch):
    root = v2(tmp_path, 32 * GiB, 20 * GiB, v2_stat(6 * GiB))
    deny_reads(monkeypatch, "memory.current")
    mem = host_memory(root)
    assert (mem.total, mem.available) == (32 * GiB, 32 * GiB)
    assert mem.cgroup is not None and "nothing subtracted (memory.current could not be read)" in mem.cgroup.describe()


def test_an_unreadable_v2_limit_falls_back_to_v1_and_then_to_no_cgroup(tmp_path, monkeypatch):
    v2(tmp_path, 32 * GiB, 20 * GiB, v2_stat(6 * GiB))
    v1(tmp_path, 16 * GiB, 10 * GiB, f"total_inactive_file {4 * GiB}\n")
    deny_reads(monkeypatch, "memory.max")
    cg = read_cgroup(tmp_path)
    assert cg is not None and (cg.version, cg.room) == ("v1", 10 * GiB)
    deny_reads(monkeypatch, "memory.max", "memory.limit_in_bytes")
    assert read_cgroup(tmp_path) is None and host_memory(tmp_path).available == HOST_AVAILABLE


def test_a_limit_file_that_is_not_text_is_no_limit_not_a_crash(tmp_path):
    (tmp_path / "memory.max").write_bytes(b"\xff\xfe\x80")
    assert read_cgroup(tmp_path) is None and host_memory(tmp_path).total == HOST_RAM


# --------------------------------------------------------------------------- the doctor


def _doctor_machine_section(monkeypatch, capsys, root: Path) -> str:
    monkeypatch.setattr("membackend._drivers.discovery.host_memory", lambda: host_memory(root))
    cli._print_machine(gather_machine())
    return capsys.readouterr().out


def test_the_doctor_names_the_cgroup_figure_s_source(tmp_path, monkeypatch, capsys):
    out = _doctor_machine_section(monkeypatch, capsys, v2(tmp_path, 32 * GiB, 20 * GiB, v2_stat(6 * GiB)))
    assert ("  cgroup limit: 32.0 GiB  [hostmem: cgroup v2 memory.max - "
            "(memory.current - inactive_file of memory.stat)]") in out, out


def test_the_doctor_says_when_the_whole_usage_was_subtracted(tmp_path, monkeypatch, capsys):
    out = _doctor_machine_section(monkeypatch, capsys, v2(tmp_path, 32 * GiB, 20 * GiB, "anon 1\n"))
    assert ("cgroup limit: 32.0 GiB  [hostmem: cgroup v2 memory.max - the whole memory.current "
            "(memory.stat has no inactive_file line: its file cache counted as used)]") in out, out


def test_the_doctor_without_a_limit(tmp_path, monkeypatch, capsys):
    out = _doctor_machine_section(monkeypatch, capsys, v2(tmp_path, "max", 20 * GiB, v2_stat(6 * GiB)))
    assert "  cgroup limit: none  [hostmem: no cgroup limit]" in out, out
