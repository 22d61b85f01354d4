"""What this process holds of the kernel's, as the conformance kit sees it from outside a backend.

A backend that releases a reservation, or a session that closes, must leave
nothing behind. The kit does not ask the backend what it holds; it reads the
kernel's own tables of this process (Linux, ``proc(5)``):

* ``/proc/self/fd``: every open descriptor, what it names (a file, a
  ``/memfd:`` file, a socket) and its device and inode;
* ``/proc/self/maps``: every shared mapping of a file, ``(deleted)`` ones
  included (a file unlinked while still mapped keeps its memory);
* the files those name, on disk (a file a backend created and left behind);
* ``/proc/self/status``: the resident memory of the process (``RssAnon``,
  ``RssShmem``), for memory that did not go back.

Private file mappings are left out: they are the libraries the interpreter
loads (a backend's memory is a shared mapping, or anonymous). So is what
belongs to a device rather than to a backend (:attr:`Held.device`): a
descriptor or mapping of a character device (``/dev/nvidia0``, ``/dev/kfd``:
a GPU driver keeps those for the process's life, as it keeps its context), and
the memory file of membackend's own simulated GPUs (``membackend-sim-*``, the
stand-in driver's ``membackend-standin-*``), which is the simulated device's
memory, not the backend's.
"""

from __future__ import annotations

import os
import stat
import tempfile
from dataclasses import dataclass, field

__all__ = ["Holdings", "Held", "TempWatch", "process_resident", "device_number", "FDS", "MAPS", "STATUS"]

FDS = "/proc/self/fd"
MAPS = "/proc/self/maps"
STATUS = "/proc/self/status"
DELETED = " (deleted)"
#: how membackend's simulated GPUs name the memfd that holds their memory (the simulated driver, the stand-in)
SIMULATED_DEVICE_MEMORY = ("/memfd:membackend-sim-", "/memfd:membackend-standin-")


@dataclass(frozen=True)
class Held:
    """One thing the process holds: a descriptor, a shared mapping of a file, or a file on disk.

    ``key`` identifies it across snapshots (a descriptor by number, device and
    inode, so a number reused for another file is another thing); ``text``
    names it in a message; ``inode`` is ``(device, inode)`` of the file behind
    it (None for a file on disk that is gone), so a descriptor and a mapping
    of the same file can be told to belong together."""

    kind: str  # "descriptor", "mapping" or "file"
    key: tuple
    text: str
    inode: tuple[int, int] | None = None
    #: a device's (a character device, a simulated GPU's memory), never a backend's leak
    device: bool = False


def _descriptors() -> list[Held]:
    found: list[Held] = []
    try:
        names = os.listdir(FDS)
    except OSError:
        return found
    for name in names:
        path = f"{FDS}/{name}"
        try:
            target = os.readlink(path)
            st = os.stat(path)
        except OSError:  # the descriptor listdir itself used, closed since
            continue
        if target.startswith("/proc/"):  # the kit's own reading of /proc (another thread's, this moment)
            continue
        inode = (st.st_dev, st.st_ino)
        device = stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) or target.startswith(SIMULATED_DEVICE_MEMORY)
        found.append(Held("descriptor", ("fd", int(name), *inode), f"descriptor {name} -> {target}", inode, device))
    return found


def device_number(text: str) -> int:
    """The device number of a ``/proc/self/maps`` device field (``"fd:01"``: major and minor in hex)."""
    major, _, minor = text.partition(":")
    return os.makedev(int(major, 16), int(minor, 16))


def _mappings() -> list[Held]:
    spans: dict[tuple, list[str]] = {}
    inodes: dict[tuple, tuple[int, int]] = {}
    try:
        with open(MAPS) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) < 6 or parts[4] == "0":
            continue  # anonymous memory, the heap, the stack
        span, perms, _, dev, ino, path = parts
        if not perms.endswith("s") and not path.endswith(DELETED):
            continue  # a private mapping of a file: a library the interpreter loaded
        inode = (device_number(dev), int(ino))
        key = ("map", *inode, path)
        spans.setdefault(key, []).append(span)
        inodes[key] = inode
    return [Held("mapping", key, f"mapping of {key[3]} at {', '.join(s)}", inodes[key], _of_device(key[3]))
            for key, s in spans.items()]


def _of_device(path: str) -> bool:
    """Whether a mapped path is a device's: a character or block device (a GPU driver's ``/dev/nvidia0``;
    ``/dev/shm`` holds regular files, memory like any other), or a simulated GPU's memory file."""
    if path.startswith(SIMULATED_DEVICE_MEMORY):
        return True
    try:
        mode = os.stat(path.removesuffix(DELETED)).st_mode
    except OSError:
        return False
    return stat.S_ISCHR(mode) or stat.S_ISBLK(mode)


def _file_of(held: Held) -> str | None:
    """The path on disk a descriptor or mapping names, when it is a regular file that still has one."""
    text = held.text.split(" -> ", 1)[1] if held.kind == "descriptor" else held.key[3]
    if not text.startswith("/") or text.endswith(DELETED) or text.startswith(("/proc/", "/memfd:")):
        return None
    try:
        return text if stat.S_ISREG(os.stat(text).st_mode) else None
    except OSError:
        return None


@dataclass(frozen=True)
class Holdings:
    """A snapshot of the descriptors and shared file mappings of this process (:meth:`take`)."""

    held: dict[tuple, Held] = field(default_factory=dict)

    @classmethod
    def take(cls) -> "Holdings":
        return cls({h.key: h for h in (*_descriptors(), *_mappings())})

    def since(self, before: "Holdings") -> list[Held]:
        """What this snapshot holds that ``before`` did not, less what belongs to a device."""
        return [h for k, h in self.held.items() if k not in before.held and not h.device]

    def holds(self, held: Held) -> bool:
        return held.key in self.held

    def files(self) -> dict[str, Held]:
        """Regular files on disk that a descriptor or mapping of this snapshot names."""
        found: dict[str, Held] = {}
        for h in self.held.values():
            path = _file_of(h)
            if path is not None:
                found.setdefault(path, h)
        return found


class TempWatch:
    """The entries of the temporary directory when a session started, to tell what a backend made there."""

    def __init__(self) -> None:
        self.root = tempfile.gettempdir()
        try:
            self.before = set(os.listdir(self.root))
        except OSError:
            self.before = set()

    def made_since(self, path: str) -> str | None:
        """The entry of the temporary directory that holds ``path`` when it was made during the session
        (``path`` itself, or the folder a backend made for it); None otherwise."""
        rel = os.path.relpath(path, self.root)
        if rel.startswith(os.pardir):
            return None
        top = rel.split(os.sep, 1)[0]
        return os.path.join(self.root, top) if top not in self.before else None


def process_resident() -> int | None:
    """Resident memory of this process (``RssAnon + RssShmem`` of ``/proc/self/status``), or None. File
    pages (``RssFile``) are left out: a library loaded on first use is no memory a backend kept; a backend's
    shared memory and files mapped from tmpfs count as ``RssShmem``, its files on disk as descriptors and
    mappings."""
    total = 0
    try:
        with open(STATUS) as f:
            for line in f:
                if line.startswith(("RssAnon:", "RssShmem:")):
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return total
