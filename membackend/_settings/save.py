"""Saving one setting into the user's ``membackend.toml`` without disturbing anything else in it.

What :func:`save_setting` promises:

* one value changes and nothing else: the file is edited with ``tomlkit``, which keeps comments, blank
  lines, quoting and the order of everything (a line's trailing comment stays with the value it
  describes, and a file written with CRLF line ends keeps them); the result is parsed again and must read
  as the old file with that one value changed, or nothing is written;
* the file saved is the real one: a symlink is followed to its target, which keeps its mode and owner;
  a file with other hard links is written in place, so every name sees the new value (see below);
* a file without write permission, or one the saving user could not give back to its owner, is refused
  with a :class:`~membackend.types.ConfigError` before anything is written;
* the write is atomic: a temporary file created exclusively (``O_EXCL``, an unpredictable name) beside the
  target, flushed to disk, then renamed over the target (the folder flushed after); a failure at any step
  removes the temporary file and leaves the target as it was;
* a file written in place (other hard links) is never left cut: it first grows to the new text's length
  with newlines at its end (still the user's TOML, with the same values) and is flushed to disk, so a full
  disk or a file-size limit (``RLIMIT_FSIZE``) stops the save before a byte of the text changes, and the
  file is put back to its length; only then is the text overwritten, and a write that still fails puts
  the old text back. Where it cannot grow, the save says so and the file is as it was;
* one save at a time: a lock in this process, and on POSIX an advisory lock on the target's folder that
  other membackend processes take too;
* nothing the user wrote is lost: a file that changed between the save's read and its rename is not
  overwritten (:class:`~membackend.types.ConfigChanged`, which the headroom route answers as 409). An
  editor that saves by renaming its own temporary file is seen (the target's inode changes). An editor
  that rewrites the file in place (truncate, then write, as nano does) is seen on Linux through a lease
  on the file (``fcntl(F_SETLEASE)``, man 2 fcntl): a file some program holds open for writing is not
  read at all, since what it holds may be half written (``ConfigChanged``); one opened for writing while
  the save runs breaks the lease, and that program waits until the save is done. If that happened by
  the rename, the file read is renamed back under its name (a second hard link made beforehand), so that
  program writes the file that has the name. A file written in place holds a write lease, so no other
  program opens it until it is whole.

Leases need the saving user to own the file (or ``CAP_LEASE``) and a filesystem that grants them; where
they cannot be had, and on other systems, the checks of the file's inode and text remain, and an in-place
rewrite started before the save read the file or made in the last instant before the rename can be lost.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import stat
import threading
import tomllib
from pathlib import Path
from typing import Iterator

from ..types import ConfigChanged, ConfigError
from .rules import BY_NAME, FIELDS, RuleError
from .sources import CONFIG_ACCEPTED, config_file

__all__ = ["save_setting"]

try:  # POSIX only: Windows has no advisory file locks of this kind (the in-process lock still holds there)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_SAVING = threading.Lock()  # one save at a time in this process (two at once left invalid TOML)
WRITABLE = "a membackend.toml this process may write, in a folder it may create files in"


def save_setting(key: str, value: str, path: Path | None = None) -> Path:
    """Set ``key = "value"`` among the top-level settings of ``path`` (default :func:`config_file`), so that
    the next start reads it; returns the path saved to (a symlink's own path, as given).

    ``key`` must be one of membackend's own settings and ``value`` must pass its rule; both are checked
    before the file is touched. An existing top-level value of ``key`` is replaced in place (its comment
    kept); a new one goes among the top-level settings, above the first table. A file that does not exist
    is created (mode from the umask). Raises ``ConfigError`` naming the file for a key or value not
    accepted, a file that is not UTF-8 TOML or holds ``key`` as a table, one that may not be written (read-
    only, a folder without write permission, an owner it cannot be given back to), and ``ConfigChanged``
    when the file changed while it was being saved. On any error the file is as it was.
    """
    target = config_file() if path is None else Path(path)
    field = BY_NAME.get(key)
    if field is None or field.rule is None or not isinstance(value, str):
        shown = value if isinstance(value, str) else type(value).__name__
        raise ConfigError(key, str(target), f"not a setting membackend saves as text: {key} = {shown!r:.200}",
                          "one of " + ", ".join(f.name for f in FIELDS if f.rule is not None) + ", as text")
    try:
        field.rule(value)
    except RuleError as exc:
        raise ConfigError(key, str(target), str(exc), field.accepted) from None
    real = Path(os.path.realpath(target))  # a symlink (or a chain of them) is followed to the file it names
    with _SAVING, _folder_locked(real.parent, target):
        _save_once(real, target, key, value)
    return target


@contextlib.contextmanager
def _folder_locked(folder: Path, shown: Path) -> Iterator[None]:
    """Hold an advisory lock on ``folder`` (created when missing) that every membackend save into it takes:
    the folder, not the file, since a save renames a new file over the old one. No lock on Windows."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _unwritable(shown, f"its folder cannot be created: {exc.strerror or exc}") from None
    if fcntl is None:  # pragma: no cover - Windows
        yield
        return
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError as exc:
        raise _unwritable(shown, f"its folder cannot be opened: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released when the fd closes
        yield
    finally:
        os.close(fd)


def _save_once(real: Path, shown: Path, key: str, value: str) -> None:
    """Read, edit and write ``real`` (the folder's lock held)."""
    try:
        fd = os.open(real, os.O_RDONLY | _NONBLOCK)  # a FIFO, or a lease held elsewhere, must not block the save
    except FileNotFoundError:
        _create(real, shown, key, value)
        return
    except BlockingIOError:  # a lease another program holds
        raise _busy(shown, "read") from None
    except OSError as exc:
        raise _unwritable(shown, f"cannot be read: {exc.strerror or exc}") from None
    lease = _Lease(fd, "read", shown)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError("config", str(shown), "is not a regular file", CONFIG_ACCEPTED)
        if not st.st_mode & 0o222 or not os.access(real, os.W_OK):  # root may write anything: the mode decides
            raise _unwritable(shown, f"is read-only (mode {stat.filemode(st.st_mode)}); nothing was written")
        if st.st_nlink == 1:
            lease.take()  # before the read: a file open for writing elsewhere may be half written
        try:
            old = _read_all(fd)
        except OSError as exc:
            raise _unwritable(shown, f"cannot be read: {exc.strerror or exc}") from None
        new = _edited(old, shown, key, value)
        if st.st_nlink > 1 or fcntl is None:
            # a write lease wants no other descriptor of the file open, and Windows refuses to replace a file
            # this process holds open
            lease.release()
            os.close(fd)
            fd = -1
        if st.st_nlink > 1:
            _write_in_place(real, shown, st, old, new)
        else:
            _replace(real, shown, st, old, new, fd, lease)
    finally:
        lease.release()
        if fd >= 0:
            os.close(fd)


def _create(real: Path, shown: Path, key: str, value: str) -> None:
    """A new file holding only ``key``: written beside it and linked into place, so that a file someone
    created meanwhile is never overwritten."""
    folder = real.parent
    new = _edited(b"", shown, key, value)
    tmp = _temporary(folder, real, shown, new, mode=0o666 & ~_umask(), owner=None)
    try:
        os.link(tmp, real)
    except FileExistsError:
        raise ConfigChanged("config", str(shown), "was created by someone else while this save ran; nothing "
                            "was written", "the file as it is now: read it, then save again") from None
    except OSError as exc:
        raise _unwritable(shown, f"cannot be written: {exc.strerror or exc}") from None
    finally:
        os.unlink(tmp)
    _sync_folder(folder)


def _replace(real: Path, shown: Path, st: os.stat_result, old: bytes, new: bytes, fd: int, lease: _Lease) -> None:
    """Write ``new`` to a temporary file beside ``real`` with its mode and owner, then rename it over
    ``real`` unless ``real`` no longer holds ``old``, or a program opened it for writing (``lease``
    broken). ``fd`` is the file read (-1: closed); if it changed or its lease broke by the rename, the file
    read is renamed back under its name and ``ConfigChanged`` raised."""
    tmp = _temporary(real.parent, real, shown, new, mode=stat.S_IMODE(st.st_mode), owner=(st.st_uid, st.st_gid))
    backup = None
    try:
        backup = _second_name(real, shown, st, tmp) if fd >= 0 else None
        _unchanged(real, shown, st, old)
        if lease.broken():
            raise _changed(shown)
        os.replace(tmp, real)
        if backup is not None and _moved_on(fd, old, lease):
            os.replace(backup, real)  # the file read, with what was written to it meanwhile, has its name back
            backup = None
            raise _changed(shown)
    except OSError as exc:
        raise _unwritable(shown, f"cannot be written: {exc.strerror or exc}") from None
    finally:
        for left in (tmp, backup):
            if left is not None and os.path.lexists(left):
                os.unlink(left)
    _sync_folder(real.parent)


def _moved_on(fd: int, old: bytes, lease: _Lease) -> bool:
    """Whether the file read (``fd``) was opened for writing or no longer holds ``old`` (or cannot be read)."""
    try:
        return lease.broken() or _read_all(fd) != old
    except OSError:
        return True


def _second_name(real: Path, shown: Path, st: os.stat_result, tmp: str) -> str | None:
    """A second hard link to the file read (``st``), beside the temporary file ``tmp`` (an unpredictable
    name of its own), so that it can be renamed back after the rename; None where the filesystem makes no
    hard links. ``ConfigChanged`` when ``real`` is no longer the file read."""
    name = tmp[: -len(".tmp")] + ".old"
    try:
        os.link(real, name)
    except OSError:
        return None
    if os.lstat(name).st_ino != st.st_ino:
        os.unlink(name)
        raise _changed(shown)
    return name


def _write_in_place(real: Path, shown: Path, st: os.stat_result, old: bytes, new: bytes) -> None:
    """A file with other hard links: renaming would leave them on the old text, so it is rewritten
    through its own inode, under a write lease where one can be had, unless it is no longer the file read
    (``st``) holding what was read (``old``). Never left cut: it first grows to ``new``'s length (see the
    module docstring), then is overwritten, truncated and flushed; a failure puts ``old`` back."""
    try:
        out = os.open(real, os.O_RDWR | _NONBLOCK)
    except BlockingIOError:  # a lease another program holds
        raise _busy(shown, "write") from None
    except OSError as exc:
        raise _unwritable(shown, f"cannot be written: {exc.strerror or exc}") from None
    lease = _Lease(out, "write", shown)
    try:
        lease.take()
        try:
            now = os.fstat(out)
            same = (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino) and _read_all(out) == old
        except OSError as exc:
            raise _unwritable(shown, f"cannot be read: {exc.strerror or exc}") from None
        if not same:
            raise _changed(shown)  # replaced or edited since it was read
        _grow(out, shown, len(old), len(new))
        if lease.broken():  # a program opened it for writing meanwhile: it waits, and writes it after
            with contextlib.suppress(OSError):
                os.ftruncate(out, len(old))
            raise _changed(shown)
        _overwrite(out, shown, old, new)
        if lease.broken():
            raise ConfigChanged("config", str(shown), "was opened for writing by another program while this save "
                                "wrote it; what that program writes replaces this save's value", "the file as it "
                                "is once that program is done: save again")
    finally:
        lease.release()
        os.close(out)


def _grow(out: int, shown: Path, have: int, want: int) -> None:
    """Make the file ``out`` (``have`` bytes) ``want`` bytes long with newlines at its end, flushed to disk,
    before its text changes; where it cannot grow (a full disk, a file-size limit), cut it back to ``have``
    bytes and raise ``ConfigError``."""
    if want <= have:
        return
    try:
        os.lseek(out, have, os.SEEK_SET)
        _write_all(out, b"\n" * (want - have))  # trailing newlines: still the user's TOML, the same values
        os.fsync(out)
    except OSError as exc:
        with contextlib.suppress(OSError):  # never fails for room: it only gives some back
            os.ftruncate(out, have)
        raise ConfigError("config", str(shown), f"has other hard links, so it is saved in place, and it cannot grow "
                          f"by {want - have} bytes here ({exc.strerror or exc}); nothing was changed",
                          f"room for {want - have} more bytes on its disk and under the file-size limit (ulimit -f), "
                          f"or a file without other hard links (saved by renaming a new file over it)") from None


def _overwrite(out: int, shown: Path, old: bytes, new: bytes) -> None:
    """Write ``new`` over the file ``out`` (already as long as ``new``), truncated and flushed; if that fails,
    write ``old`` back. ``ConfigError`` on a failure, saying whether ``old`` is back."""
    try:
        _write_whole(out, new)
    except OSError as exc:
        why = exc.strerror or str(exc)
        try:
            _write_whole(out, old)
        except OSError as again:
            raise _unwritable(shown, f"could not be written whole ({why}), nor its old text put back "
                              f"({again.strerror or again})") from None
        raise _unwritable(shown, f"could not be written whole ({why}); its old text was put back") from None


def _write_whole(fd: int, data: bytes) -> None:
    """Make the file ``fd`` hold exactly ``data``: written from its start, truncated to it, flushed to disk."""
    os.lseek(fd, 0, os.SEEK_SET)
    _write_all(fd, data)
    os.ftruncate(fd, len(data))
    os.fsync(fd)


def _write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` at ``fd``'s offset (a short write is continued; its error raised)."""
    view = memoryview(data)
    at = 0
    while at < len(view):
        at += os.write(fd, view[at:])


class _Lease:
    """A lease on the file ``fd`` is open on (Linux, ``fcntl(F_SETLEASE)``, man 2 fcntl) that tells whether
    another program opens it for writing: a ``read`` lease is refused while any program holds the file open
    for writing, a ``write`` lease while any program holds it open at all, and either is broken by a
    program opening it for writing, which then waits until the lease is let go (at most
    ``/proc/sys/fs/lease-break-time`` seconds). Where no lease can be had (another owner without
    ``CAP_LEASE``, a filesystem without leases, not Linux) it holds nothing and ``broken`` is False.

    The kernel signals the holder when its lease breaks, ``SIGIO`` by default, which ends a process; the
    signal is set to one whose disposition here is to ignore it (``SIGURG``), or no lease is taken."""

    def __init__(self, fd: int, kind: str, shown: Path):
        self.fd, self.kind, self.shown = fd, kind, shown
        self.held = False

    def take(self) -> None:
        """Take the lease; ``ConfigChanged`` when another program holds the file open in a way it refuses."""
        quiet = getattr(signal, "SIGURG", None)
        if fcntl is None or not hasattr(fcntl, "F_SETLEASE") or not hasattr(fcntl, "F_SETSIG") or quiet is None or \
                signal.getsignal(quiet) not in (signal.SIG_DFL, signal.SIG_IGN):
            return
        try:
            fcntl.fcntl(self.fd, fcntl.F_SETSIG, quiet)
            fcntl.fcntl(self.fd, fcntl.F_SETLEASE, fcntl.F_RDLCK if self.kind == "read" else fcntl.F_WRLCK)
        except OSError as exc:
            if exc.errno == errno.EAGAIN:
                raise _busy(self.shown, self.kind) from None
            return  # not the owner, or a filesystem without leases: the content checks remain
        self.held = True

    def broken(self) -> bool:
        """Whether a program opened the file for writing since the lease was taken (and now waits)."""
        if not self.held:
            return False
        try:
            return fcntl.fcntl(self.fd, fcntl.F_GETLEASE) == fcntl.F_UNLCK
        except OSError:
            return True  # the lease is gone: nothing vouches for the file any more

    def release(self) -> None:
        if self.held:
            self.held = False
            with contextlib.suppress(OSError):
                fcntl.fcntl(self.fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)


def _temporary(folder: Path, real: Path, shown: Path, data: bytes, mode: int,
               owner: tuple[int, int] | None) -> str:
    """A file created exclusively in ``folder`` under an unpredictable name, holding ``data`` with
    ``mode`` (and ``owner``), flushed to disk; its path. A failure removes it and raises ``ConfigError``."""
    import tempfile  # here, not at import: ComfyUI's start reads the settings, only a save writes them

    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{real.name}.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise _unwritable(shown, f"no file can be created beside it in {str(folder)!r:.200}: "
                          f"{exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if hasattr(os, "fchmod"):
                os.fchmod(f.fileno(), mode)
            if owner is not None and hasattr(os, "fchown"):
                st = os.fstat(f.fileno())
                if (st.st_uid, st.st_gid) != owner:
                    try:
                        os.fchown(f.fileno(), *owner)
                    except PermissionError:
                        raise _unwritable(shown, f"belongs to uid {owner[0]} gid {owner[1]}, and a file saved by "
                                          f"this user (uid {st.st_uid}) could not be given back to it; nothing "
                                          f"was written") from None
            os.fsync(f.fileno())
    except BaseException as exc:
        os.unlink(tmp)
        if isinstance(exc, OSError):
            raise _unwritable(shown, f"cannot be written: {exc.strerror or exc}") from None
        raise
    return tmp


def _edited(old: bytes, shown: Path, key: str, value: str) -> bytes:
    """``old`` with the top-level ``key`` set to ``value``, formatting kept; checked to read back as ``old``
    with that one value changed."""
    import tomlkit
    from tomlkit.exceptions import TOMLKitError

    try:
        text = old.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError("config", str(shown), f"not UTF-8 text ({exc.reason} at byte {exc.start})",
                          CONFIG_ACCEPTED) from None
    try:
        before = tomllib.loads(text)
        doc = tomlkit.parse(text)
    except (tomllib.TOMLDecodeError, TOMLKitError) as exc:
        raise ConfigError("config", str(shown), f"not valid TOML: {exc}", CONFIG_ACCEPTED) from None
    if isinstance(before.get(key), dict):
        raise ConfigError(key, str(shown), f"the file holds {key!r} as a table, which saving would replace; "
                          "nothing was written", f"a membackend.toml whose {key} is a value, not a table")
    doc[key] = value
    out = doc.as_string()
    if "\r\n" in text and "\n" not in text.replace("\r\n", ""):  # a CRLF file stays CRLF (tomlkit adds "\n")
        out = out.replace("\r\n", "\n").replace("\n", "\r\n")
    after = tomllib.loads(out)
    if after.get(key) != value or {k: v for k, v in after.items() if k != key} != \
            {k: v for k, v in before.items() if k != key}:
        raise ConfigError(key, str(shown), "the edited file would not read as the old one with this one value "
                          "changed; nothing was written", "a membackend.toml whose top-level settings are plain "
                          "values")
    return out.encode("utf-8")


def _read_all(fd: int) -> bytes:
    """Everything in the file ``fd`` from its start (lseek and read: Windows has no ``pread``)."""
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


def _unchanged(real: Path, shown: Path, st: os.stat_result, old: bytes) -> None:
    """Raise ``ConfigChanged`` unless ``real`` is still the file read, holding what was read."""
    try:
        with open(real, "rb") as f:
            now = os.fstat(f.fileno())
            same = (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino) and f.read() == old
    except FileNotFoundError:
        same = False
    if not same:
        raise _changed(shown)


def _busy(shown: Path, kind: str) -> ConfigChanged:
    """The file is open in another program in a way a ``kind`` (read, write) lease refuses."""
    held = "open for writing in another program (an editor saving it in place?), so what it holds may be half " \
        "written" if kind == "read" else "open in another program, and a file with other hard links is written in " \
        "place only while no other program has it open"
    return ConfigChanged("config", str(shown), f"is {held}; it was not touched and that program's text is kept",
                         "the file once that program has closed it: save again")


def _changed(shown: Path) -> ConfigChanged:
    return ConfigChanged("config", str(shown), "changed while this save ran (edited or replaced since it was "
                         "read); it was not overwritten and your edit is kept", "the file as it is now: save again")


def _unwritable(shown: Path, why: str) -> ConfigError:
    return ConfigError("config", str(shown), why, WRITABLE)


def _umask() -> int:
    """This process's umask, read without changing it (``os.umask`` sets it, a race with other threads)."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def _sync_folder(folder: Path) -> None:
    """Flush a rename in ``folder`` to disk where the platform allows it (not on Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
