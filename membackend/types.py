"""Value types shared by every layer of membackend.

Nothing here imports anything else from membackend: these records are the
vocabulary of the contract (see ``hookspec.py``) and of the error hierarchy.
All sizes and offsets are in bytes; offsets are relative to a reservation's
base address.

**Who raises which error.** The session checks every argument before a
backend is called and raises the :class:`ReservationError` family itself
(``InvalidSize``, ``OutOfRange``, ``Misaligned``, ``WrongDevice``,
``ReservationReleased``, ``ForeignReservation``, ``TensorAlive``) and
``InvalidToken``, with the ledger unchanged. From its verbs a backend raises
only :class:`DriverError` when a driver call fails (after rolling back, see
``membackend.hookspec``; :class:`DescriptorLimit`, a ``DriverError``, where a
create ran out of file descriptors rather than memory) and
:class:`WrongDevice` from ``membackend_reserve`` or
``membackend_budget_query`` for a device the machine facts do not list and
the backend cannot serve; from ``from_settings`` or its probe,
:class:`ConfigError` for a setting of its own it cannot use (the plugin is then
listed as broken with that message). Out of memory in a fault is a result,
``Fault(ok=False)``, never an error. Anything else a backend raises reaches
the caller as :class:`PluginError`. The errors without a constructor of their
own take one argument, the message (``WrongDevice("...")``): say what was
given and what is accepted.
"""

from __future__ import annotations

import errno
import itertools
import os
from dataclasses import dataclass, field
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    ClassVar,
    Mapping,
    NamedTuple,
    Protocol,
    Sequence,
    TypeVar,
    runtime_checkable,
)

__all__ = [
    "Device",
    "DeviceInfo",
    "Machine",
    "Reservation",
    "Fault",
    "Budget",
    "Candidate",
    "Score",
    "Capabilities",
    "FenceToken",
    "DriverState",
    "FailureInjection",
    "MembackendError",
    "ReservationError",
    "ReservationReleased",
    "ForeignReservation",
    "TensorAlive",
    "InvalidToken",
    "PartialFailure",
    "OutOfRange",
    "InvalidSize",
    "Misaligned",
    "WrongDevice",
    "BackendNotFound",
    "BackendDisabled",
    "PluginError",
    "ConfigError",
    "ConfigChanged",
    "DriverError",
    "DescriptorLimit",
    "SanitizerError",
    "RuleError",
    "AddressSpaceExhausted",
    "AddressWindowsExhausted",
    "ModelError",
    "TorchMissing",
    "NotResident",
    "MissingName",
    "format_size",
]

DEVICE_KINDS = ("cpu", "cuda", "hip")

#: the binary units :func:`format_size` writes, smallest first
SIZE_UNITS = (("KiB", 1 << 10), ("MiB", 1 << 20), ("GiB", 1 << 30), ("TiB", 1 << 40), ("PiB", 1 << 50))


def format_size(n: int | float) -> str:
    """A byte count as membackend writes it for a person, everywhere (the doctor, the logs, the status, the memory
    panel, the docs): binary units with one decimal, the largest unit that is at least 1 (``6.0 GiB``,
    ``512.0 MiB``, ``1.5 KiB``), thousands separated past 1,024 PiB; below 1 KiB the bytes themselves (``0 bytes``,
    ``1 byte``, ``640 bytes``). Negative counts keep their sign. A setting's value is written as a setting takes
    it instead (``membackend._settings.format_bytes``: ``512MiB``, exact)."""
    size = abs(n)
    for unit, scale in reversed(SIZE_UNITS):
        if size >= scale:
            return f"{n / scale:,.1f} {unit}"
    whole = int(n)
    return f"{whole} byte" if abs(whole) == 1 else f"{whole} bytes"


# --------------------------------------------------------------------------- errors


class MembackendError(Exception):
    """Root of every error membackend raises on purpose; ``MembackendError(message)``."""


class ReservationError(MembackendError, ValueError):
    """A verb was called with arguments that do not fit the reservation; nothing was changed.

    Raised by the session before the backend is called (a backend raises only
    the :class:`WrongDevice` subclass itself); ``ReservationError(message)``.
    """


class ReservationReleased(ReservationError):
    """The reservation was released; it cannot be used or released again (raised by the session)."""


class ForeignReservation(ReservationError):
    """A reservation that another session (or another backend) handed out; nothing was changed."""


class TensorAlive(ReservationError):
    """A free or release of a range that a live tensor from ``membackend._tensors`` still views.

    Nothing was changed. ``reservation`` is the reservation, ``offset``/``size``
    the byte range asked for, ``views`` how many live tensors overlap it and
    ``held`` the byte ranges ``(offset, end)`` they view.
    """

    def __init__(self, verb: str, reservation: Any, offset: int, size: int, held: list[tuple[int, int]]):
        self.verb = verb
        self.reservation = reservation
        self.offset = offset
        self.size = size
        self.held = sorted(held)
        self.views = len(held)
        spans = ", ".join(f"[{a}, {b})" for a, b in self.held[:4]) + (", ..." if len(held) > 4 else "")
        super().__init__(
            f"{verb}: range [{offset}, {offset + size}) of reservation #{reservation.id} ({reservation.device}) is "
            f"viewed by {self.views} live tensor(s) from membackend._tensors (bytes {spans}); nothing was changed. "
            f"Accepted: drop those tensors and every view of them (del t; gc.collect() for ones in a reference "
            f"cycle) first, then free or release")


class InvalidToken(MembackendError, TypeError):
    """``Session.record`` got neither a fence token (callable ``done()`` and ``wait()``) nor a
    ``concurrent.futures.Future``; nothing was recorded."""


class OutOfRange(ReservationError):
    """An offset or byte range falls outside the reservation (raised by the session)."""


class InvalidSize(ReservationError):
    """A size (or offset) is not a positive integer, or too large (raised by the session)."""


class Misaligned(ReservationError):
    """A free range does not start on a page boundary, or ends inside a page before the end of
    what was requested (raised by the session)."""


class WrongDevice(ReservationError):
    """A device the backend does not serve, or one that does not match the reservation.

    The session raises it for a device kind outside the backend's
    ``device_kinds`` and for an index the machine facts do not list; a backend
    raises ``WrongDevice(message)`` from ``membackend_reserve`` or
    ``membackend_budget_query`` for any other device it cannot serve.
    """


CLOSE_ENOUGH = 0.65
"""How alike (difflib's ratio) a name must be to be offered as "did you mean": one wrong letter of three
(vmn for vmm) is close, three of six (nope, noverb) is not."""


def closest_name(name: str, choices: Sequence[str] | Mapping[str, Any]) -> str | None:
    """The one of ``choices`` closest to ``name``, compared in any case and at least :data:`CLOSE_ENOUGH`
    alike, else None: the one rule behind every "did you mean" of membackend (backends, profiles, scenarios)."""
    import difflib  # only a refusal needs it

    lower = {c.lower(): c for c in choices}
    close = difflib.get_close_matches(name.lower(), list(lower), n=1, cutoff=CLOSE_ENOUGH)
    return lower[close[0]] if close else None


class BackendNotFound(MembackendError, LookupError):
    """A backend was asked for by name (forced) and cannot be used: said in one line.

    ``available`` lists the installed names that could be forced on this machine; ``unavailable`` maps
    every other known name to the reason it cannot be used (broken, blocked, serving no device here).
    The line says, for ``name``: not installed, with the closest installed name ("did you mean
    cuda_wddm?"); or installed, with the reason from ``unavailable`` (for one that serves no device of this
    machine, its probe's reason).
    """

    def __init__(self, name: str, available: list[str], unavailable: dict[str, str]):
        self.name = name
        self.available = list(available)
        self.unavailable = dict(unavailable)
        if name in self.unavailable:
            line = f"backend {name!r} cannot be used here: {self.unavailable[name]}"
            if self.available:
                line += f"; choices here: {', '.join(self.available)}"
        else:
            installed = sorted({*self.available, *self.unavailable})
            close = closest_name(name, installed)
            line = f"backend {name!r} is not installed" + (f"; did you mean {close}?" if close else "") + \
                f" (installed: {', '.join(installed) or 'none'})"
        super().__init__(line)


class BackendDisabled(MembackendError):
    """membackend was switched off (``MEMBACKEND_DISABLE``); callers use their legacy path."""


class PluginError(MembackendError):
    """A plugin is broken: it failed to load, to validate or to probe, broke a verb's contract
    (``reserve`` returned something that is not a fitting ``Reservation``), or raised an error
    that is not a ``MembackendError`` (the original is its ``__cause__``). A backend never raises it."""


class ConfigError(MembackendError, ValueError):
    """A setting has a value that cannot be used.

    ``key`` is the setting's name, ``source`` where the value came from
    (kwargs, env, a file path), ``accepted`` what would have been accepted.
    """

    def __init__(self, key: str, source: str, message: str, accepted: str = ""):
        self.key = key
        self.source = source
        self.accepted = accepted
        text = f"{key} (from {source}): {message}"
        if accepted:
            text += f"; accepted: {accepted}"
        super().__init__(text)


class ConfigChanged(ConfigError):
    """A config file changed while membackend was saving a setting into it (edited or replaced since the
    save read it): nothing was written, so the change made meanwhile is kept. Saving again reads it anew."""


class DriverError(MembackendError, OSError):
    """A driver call returned a failure code: what a backend raises when the platform fails.

    ``DriverError(code, call, detail="")``: ``code`` is the driver's own code (an
    errno, a ``CUresult``, a ``hipError_t``), ``call`` the name of the failing
    function, ``detail`` words for the user; the message reads ``"{call} failed
    with {code}: {detail}"``. A verb that fails after changing something says how
    much, so the session's ledger keeps matching the driver: set ``mapped`` (a
    fault whose rollback could not unmap: bytes still backed) or ``dropped`` (a
    free or release that stopped part-way: bytes already dropped) on the error
    before raising it; both default to 0.
    """

    #: bytes a failed fault left mapped, and bytes a failed free or release already dropped (see above)
    mapped: int = 0
    dropped: int = 0

    def __init__(self, code: Any, call: str, detail: str = ""):
        self.code = code
        self.call = call
        text = f"{call} failed with {code!s}"
        if detail:
            text += f": {detail}"
        MembackendError.__init__(self, text)
        self.args = (text,)

    def __str__(self) -> str:  # OSError's __str__ would print errno/strerror
        return self.args[0]


class DescriptorLimit(DriverError):
    """A physical handle could not be created because the process has no file descriptor left, although the
    driver answered out of memory: where each live handle holds one of the process's descriptors (ROCm 7.14 on
    Linux holds one dmabuf descriptor per ``hipMemCreate``, ROCm/rocm-systems #10604), the descriptor limit
    (``RLIMIT_NOFILE``, ``ulimit -n``) runs out long before the memory does. Never an out-of-memory answer:
    evicting models frees no descriptor.

    ``DescriptorLimit(code, call, detail, limit=..., reached=..., handles=..., wanted=...)``: ``code`` and
    ``call`` are the driver's (``hipErrorOutOfMemory``, ``hipMemCreate``); ``limit`` the soft limit in force,
    ``reached`` the descriptors open when the call failed, ``handles`` the live handles this backend held,
    ``wanted`` the soft limit that would serve every page of the devices (the fix: ``ulimit -n <wanted>``);
    ``errno`` is ``EMFILE``. The message names all of them."""

    def __init__(self, code: Any, call: str, detail: str = "", *, limit: int = 0, reached: int = 0,
                 handles: int = 0, wanted: int = 0):
        super().__init__(code, call, detail)
        self.errno = errno.EMFILE
        self.limit, self.reached, self.handles, self.wanted = limit, reached, handles, wanted


class PartialFailure(MembackendError):
    """An operation over many items (unload everything, close) carried on past failures.

    Everything that could be done was done; ``failures`` lists ``(what, error)``
    for each item that failed, and the message names them all.
    """

    def __init__(self, operation: str, failures: Sequence[tuple[str, BaseException]]):
        self.operation = operation
        self.failures = list(failures)
        lines = [f"{operation}: {len(self.failures)} failure(s)"]
        lines += [f"  {what}: {type(err).__name__}: {err}" for what, err in self.failures]
        super().__init__("\n".join(lines))


class SanitizerError(MembackendError):
    """Sanitize mode caught a use of memory that would be unsafe (G1/G2)."""


# -------------------------------------------------------------- errors of the policy and the ComfyUI adapter
# Every error class is here, under MembackendError, one class per meaning; the module that raises one imports
# it from here (the lab's and the installer's too: see "errors promised elsewhere" below).


class RuleError(MembackendError, ValueError):
    """A value a setting's rule refuses (``membackend.platform``'s ``size``, ``flag``, ``seconds``, a
    platform's own parser). ``path`` names the part of a table that is wrong (``("devices", 0, "kind")``;
    empty for the value itself) and ``accepted``, when given, says what that part accepts. The settings turn
    it into a :class:`ConfigError` naming the key and where the value came from."""

    def __init__(self, message: str, path: tuple[Any, ...] = (), accepted: str | None = None):
        super().__init__(message)
        self.message = message
        self.path = tuple(path)
        self.accepted = accepted


class AddressSpaceExhausted(MembackendError, MemoryError):
    """A reservation would pass the platform's per-process GPU address quota."""


class AddressWindowsExhausted(AddressSpaceExhausted):
    """A large reservation under a reserve-churn limit that no kept window holds and no new window may serve:
    the platform allows no more large frees, so a new window could never be given back within the bound,
    or the driver refused the new window (its error is the cause). Out of memory, nothing changed:
    unloading a model puts its window back for reuse."""


class ModelError(MembackendError, ValueError):
    """A model argument the residency manager cannot accept (an id, a kind, an owner, a model it does not know)."""


class TorchMissing(MembackendError, ImportError):
    """torch is not installed in the Python that needs it (a tensor view of a reservation, or the start-up
    cost measured against torch's); the message names that Python and says to install membackend's
    ``torch`` extra."""


class NotResident(MembackendError, ValueError):
    """A tensor was asked for over pages that are not resident; fault them first."""


class MissingName(MembackendError, LookupError):
    """A name the ComfyUI adapter patches does not exist in this ComfyUI / comfy-aimdo."""


# ------------------------------------------------ errors promised elsewhere: the lab's and the installer's
# The lab's errors (its replays, traces, timelines, pictures and start-up cost) and those of the ComfyUI
# installer are no part of the promise this module makes (issue 44): each is public at its home
# (``membackend.lab``; ``membackend._comfyui.install``, internal) under its name without the leading ``_``.
# They are defined here all the same, where every error class is (one class per meaning, tests/test_types.py),
# for the layers' sake (tests/test_layers.py): the replays that raise most of them sit in the lab's lowest row
# and may import nothing of the lab above it, and this module, the bottom layer, could not give the old name
# for its last release without importing upwards were the class defined at its home. So the home imports the
# class from here, and the old ``membackend.types.X`` / ``membackend.X`` still give that same class for one
# release, with a DeprecationWarning naming the home (this module's ``__getattr__``, and the facade's).

_LAB = "membackend.lab"
_INSTALLER = "membackend._comfyui.install"
_Error = TypeVar("_Error", bound=type)

#: every error promised elsewhere, by its public name (the home is its ``__module__``)
_MOVED: dict[str, type[MembackendError]] = {}


def _promised_at(home: str) -> Callable[[_Error], _Error]:
    """Class decorator: the error ``_X`` defined here is ``X`` of module ``home`` (its name, ``__module__`` and
    pickle say so), and ``membackend.types.X`` gives it only with a DeprecationWarning."""

    def mark(cls: _Error) -> _Error:
        cls.__name__ = cls.__qualname__ = cls.__name__.lstrip("_")
        cls.__module__ = home
        _MOVED[cls.__name__] = cls
        return cls

    return mark


@_promised_at(_LAB)
class _UnknownScenario(MembackendError, ValueError):
    """A scenario name that is not built in (the message lists the built-in ones)."""


@_promised_at(_LAB)
class _ReplayError(MembackendError, ValueError):
    """A replay that cannot run as asked (the message says why and what is accepted)."""


@_promised_at(_LAB)
class _PluginMissing(_ReplayError):
    """The plugin a scenario compares with is not installed; the message says how to install it."""


@_promised_at(_LAB)
class _TraceError(MembackendError, ValueError):
    """A trace that cannot be replayed: the message names the file, the line and what was wrong,
    and says what is accepted."""


@_promised_at(_LAB)
class _TraceWriteError(MembackendError, OSError):
    """A trace file that cannot be written (a full disk, no permission, a read-only file system).

    ``TraceWriteError(path, cause, shown=None)``: ``errno`` and ``filename`` are the failed write's
    (``cause``); the message names the file as ``shown`` (default: ``path`` itself). Nothing of the run
    that was recording is left alive."""

    def __init__(self, path: str | os.PathLike[str], cause: OSError, shown: str | None = None):
        reason = cause.strerror or str(cause) or type(cause).__name__
        super().__init__(cause.errno, reason, os.fspath(path))
        self.message = (f"cannot write the trace {shown or os.fspath(path)!r}: {reason}; accepted: a file in a "
                        "folder this process may write to, on a disk with room for it")

    def __str__(self) -> str:
        return self.message


@_promised_at(_LAB)
class _TimelineError(MembackendError, ValueError):
    """A tally the timeline cannot take (an unknown name, a value that is not a count, a total that fell)."""


@_promised_at(_LAB)
class _PlotUnavailable(MembackendError, RuntimeError):
    """A matplotlib format was asked for and matplotlib is not installed."""


@_promised_at(_LAB)
class _PlotFormatError(MembackendError, ValueError):
    """The output path's suffix names no format the replay's pictures can write."""


@_promised_at(_LAB)
class _StartupCostError(MembackendError, RuntimeError):
    """The adapter's start-up cost cannot be measured here; the message says why."""


@_promised_at(_INSTALLER)
class _NotComfyUI(MembackendError, ValueError):
    """The folder given to ``membackend comfyui install`` is not a ComfyUI checkout; nothing was written or
    removed."""


@_promised_at(_INSTALLER)
class _ForeignFolder(MembackendError, ValueError):
    """``custom_nodes/membackend`` holds a file of ours by name that ``membackend comfyui install`` did not
    write; nothing was written or removed."""


@_promised_at(_INSTALLER)
class _UnsafeLayout(MembackendError, ValueError):
    """A symbolic link, or a file where a folder belongs (or the reverse), where install/uninstall would
    write or delete; nothing was written or removed."""


@_promised_at(_INSTALLER)
class _CannotWrite(MembackendError, OSError):
    """A path under ``custom_nodes`` could not be read, written or removed; the message names it and says
    what, if anything, was changed."""


def _moved_error(module: str, name: str) -> type[MembackendError]:
    """The error ``name`` that left ``module``'s promise, for that module's ``__getattr__`` (this one, the
    facade's): the class itself (``isinstance`` and ``except`` keep working) and a DeprecationWarning, pointing at
    the caller's line, that names the home to import it from."""
    import warnings

    cls = _MOVED[name]
    warnings.warn(f"{module}.{name} is deprecated: import {name} from {cls.__module__} (the same class); "
                  f"{module}.{name} goes in the next release", DeprecationWarning, stacklevel=3)
    return cls


if TYPE_CHECKING:  # a type checker still reads the old names for their last release (the same classes)
    UnknownScenario = _UnknownScenario
    ReplayError = _ReplayError
    PluginMissing = _PluginMissing
    TraceError = _TraceError
    TraceWriteError = _TraceWriteError
    TimelineError = _TimelineError
    PlotUnavailable = _PlotUnavailable
    PlotFormatError = _PlotFormatError
    StartupCostError = _StartupCostError
    NotComfyUI = _NotComfyUI
    ForeignFolder = _ForeignFolder
    UnsafeLayout = _UnsafeLayout
    CannotWrite = _CannotWrite
else:  # hidden from type checkers, so that a misspelt name is an error there and not Any
    from ._lazy import old_names

    __getattr__ = old_names(__name__, _MOVED, _moved_error)


# --------------------------------------------------------------------------- values


@dataclass(frozen=True, order=True)
class Device:
    """One memory pool: ``cpu:0`` for host RAM, ``cuda:N`` / ``hip:N`` for a GPU."""

    kind: str
    index: int = 0

    def __post_init__(self) -> None:
        if self.kind not in DEVICE_KINDS:
            raise WrongDevice(f"device kind {self.kind!r} is unknown; accepted: {', '.join(DEVICE_KINDS)}")
        if not isinstance(self.index, int) or isinstance(self.index, bool) or self.index < 0:
            raise WrongDevice(f"device index {self.index!r} must be an int >= 0")

    @classmethod
    def parse(cls, text: "str | Device") -> "Device":
        """``"cuda:1"`` → ``Device("cuda", 1)``; ``"cpu"`` → ``Device("cpu", 0)``."""
        if isinstance(text, Device):
            return text
        kind, _, index = str(text).partition(":")
        try:
            return cls(kind.strip().lower(), int(index) if index else 0)
        except ValueError:
            raise WrongDevice(f"device {text!r} is not of the form KIND[:INDEX]; kinds: "
                              f"{', '.join(DEVICE_KINDS)}") from None

    def __str__(self) -> str:
        return f"{self.kind}:{self.index}"


#: the ``source`` of a device a simulated driver listed: ``sim:<profile>`` (:attr:`DeviceInfo.simulated`)
SIM_SOURCE = "sim:"


@dataclass(frozen=True)
class DeviceInfo:
    """What is known about one device without creating a context on it.

    ``source`` names what listed the device (a binding, ``override``; ``sim:<profile>`` for a simulated
    driver, see :attr:`simulated`);
    ``sources`` says, per field, where that field's value came from (e.g.
    ``("integrated", "cuda: cuDeviceGetAttribute(INTEGRATED)")``); a field
    with no entry kept its default because nothing answered.
    ``vmm_supported`` is None when nothing was asked (or nothing answered).
    """

    device: Device
    name: str = ""
    total_memory: int = 0
    integrated: bool = False
    unified: bool = False
    driver_model: str | None = None  # "wddm" / "tcc" / "mcdm" on Windows, None elsewhere
    arch: str | None = None  # "sm_90", "gfx1201", ...
    source: str = ""
    vmm_supported: bool | None = None  # the driver's virtual memory management (cuMemCreate / hipMemCreate)
    luid: str | None = None  # the adapter LUID as 16 hex digits (high part first), Windows only
    sources: tuple[tuple[str, str], ...] = ()

    def source_of(self, name: str) -> str | None:
        """Where field ``name`` came from, or None when nothing answered for it."""
        return dict(self.sources).get(name)

    @property
    def simulated(self) -> bool:
        """Listed by a simulated driver (its ``source`` is ``sim:<profile>``), not by a real one."""
        return self.source.startswith(SIM_SOURCE)


@dataclass(frozen=True)
class Machine:
    """Hardware facts, gathered once; every field can be overridden from settings."""

    os: str
    cpus: int
    ram_total: int
    ram_available: int
    cgroup_limit: int | None
    torch_version: str | None
    torch_vendor: str | None  # "cuda" / "rocm" / "cpu" / None when torch is absent
    devices: tuple[DeviceInfo, ...] = ()
    overridden: tuple[str, ...] = ()
    #: per machine-level field, where its value came from (``("os", "platform.system()")``)
    sources: tuple[tuple[str, str], ...] = ()
    #: one line per driver binding asked: what it answered, or why it could not (for the doctor)
    discovery: tuple[str, ...] = ()

    def source_of(self, name: str) -> str | None:
        """Where machine-level field ``name`` came from, or None when unknown."""
        return dict(self.sources).get(name)

    def gpus(self, kind: str | None = None) -> tuple[DeviceInfo, ...]:
        return tuple(d for d in self.devices if d.device.kind != "cpu" and (kind is None or d.device.kind == kind))


_reservation_ids = itertools.count(1)


@dataclass(eq=False)
class Reservation:
    """A range of address space handed out by ``membackend_reserve``.

    ``size`` is the usable size (a whole number of pages, at least what was
    asked for). ``handle`` is private to the backend that made it. A
    reservation is compared by identity; ``released`` turns true once it has
    been given back, after which every verb on it raises ``ReservationReleased``.

    A backend builds one in ``membackend_reserve`` as
    ``Reservation(device, base, size, page_size, backend, handle=..., requested=size_asked)``:

    * ``device``: the :class:`Device` it was asked for;
    * ``base``: the range's first address (a process address for ``cpu``
      devices, which the conformance kit checks against the kernel; a device
      virtual address for GPUs);
    * ``size``: the size asked for rounded up to whole pages (``size % page_size == 0``);
    * ``page_size``: the backend's page in bytes, > 0; fault and free work in these pages;
    * ``backend``: the backend's own ``name`` (the session refuses any other);
    * ``handle``: anything the backend needs later (a file, a page table); membackend never reads it;
    * ``requested``: the size asked for, so a free may end at the last requested byte inside the tail page.

    ``id``, ``released`` and ``_seat`` are membackend's: leave them at their defaults.
    The session checks the result (a ``Reservation``, at least the size asked,
    the same device, whole pages, this backend's name, not released) and
    gives a wrong one back, raising ``PluginError``.
    """

    device: Device
    base: int
    size: int
    page_size: int
    backend: str
    handle: Any = field(default=None, repr=False)
    requested: int = 0
    id: int = field(default_factory=lambda: next(_reservation_ids))
    released: bool = False
    #: the permit that serialises its verbs in the session that holds it alive (None otherwise), holding that
    #: session's token while free: the hot verbs take it in one attribute load, where a dict lookup was their
    #: largest single cost (docs/performance.md). Not an argument, not compared, not shown, and a copy or a
    #: pickle leaves it behind (:meth:`__getstate__`).
    _seat: Any = field(default=None, init=False, repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        """A copy or a pickle is a new object, alive in no session: everything but the seat."""
        state = dict(self.__dict__)
        state.pop("_seat", None)
        return state

    @property
    def pages(self) -> int:
        return self.size // self.page_size

    def page_range(self, offset: int, size: int) -> range:
        """Indices of every page the byte range touches (validated by the session)."""
        ps = self.page_size
        return range(offset // ps, (offset + size - 1) // ps + 1)


class Fault(NamedTuple):
    """Result of ``membackend_fault``.

    ``ok`` is false when the pages could not be backed (out of memory); the
    range is then left exactly as it was. ``generations`` has one entry per
    page of the range, starting at ``first_page``; an entry changes whenever
    that page gets new physical memory, so the caller knows to copy again.
    ``mapped`` is the number of bytes newly backed by this call.

    A backend returns ``Fault(True, generations, first_page, mapped)``, where
    ``first_page`` is ``offset // page_size`` and ``generations`` has one int
    per page from ``first_page`` through the page holding the range's last
    byte (a page already resident keeps its generation and adds nothing to
    ``mapped``), or ``Fault(False, (), first_page, 0)`` for out of memory after
    unmapping what this call mapped. The session adds ``mapped`` to its ledger.

    A named tuple, not a dataclass: it is built once per weight per step, and
    a frozen dataclass cost more than twice as much to construct.
    """

    ok: bool
    generations: tuple[int, ...] = ()
    first_page: int = 0
    mapped: int = 0


@dataclass(frozen=True)
class Budget:
    """How much memory a device has, from the platform's real source.

    ``usable`` is ``free - headroom`` clamped at zero; ``unified`` is true when
    the device shares one pool with the host (so host copies count too).

    Build it with :meth:`of`, which computes ``usable`` and clamps ``free`` to
    ``[0, total]``: ``Budget.of(total, free, headroom, source, unified=False)``.
    ``source`` names where the figures came from in words the doctor prints
    (``"cuMemGetInfo"``, ``"psutil MemAvailable"``). The conformance kit checks
    ``total > 0``, ``0 <= usable <= free <= total``, ``usable == max(0, free -
    headroom)`` and a non-empty source. The direct constructor takes
    ``usable`` as given and checks nothing.
    """

    total: int
    free: int
    headroom: int
    usable: int
    source: str
    unified: bool = False

    @classmethod
    def of(cls, total: int, free: int, headroom: int, source: str, unified: bool = False) -> "Budget":
        """The budget of a device of ``total`` bytes with ``free`` bytes free, keeping ``headroom`` free."""
        free = max(0, min(free, total))
        return cls(total, free, headroom, max(0, free - headroom), source, unified)


class Score:
    """The one scale every probe scores on (higher wins; see ``docs/architecture.md``).

    * ``NONE`` (0): does not fit this machine; the reason says why.
    * ``FALLBACK`` (1): the built-in ``host`` backend, always available.
    * ``GENERIC`` band (10-49): backends that work on any device of a vendor
      (the generic ``vmm``, ``aimdo``).
    * ``PLATFORM`` band (50-99): platform plugins; a more specific fit scores
      higher inside the band.

    A candidate with ``opt_in=True`` fits but is selected only when forced by
    name. Ties at the top are broken by name (alphabetical), with one warning.

    The built-in scores: ``host`` 1, ``aimdo`` 10, ``vmm`` 20; the platform
    plugins in this repository 60-90. **Suggested for a third-party backend**:
    30 when it serves any device of a vendor with its own mechanism (above the
    built-in generic backends, below every platform plugin, so a plugin made
    for the machine still wins); 60 for a platform plugin, higher only as the
    fit gets more specific (one device model, one driver version); ``FALLBACK``
    with ``opt_in=True`` for an alternative that should never be chosen on its
    own. Scores are plain ints: the bands are ``range`` objects to test
    against (``score in Score.GENERIC``), not values to return.
    """

    NONE = 0
    FALLBACK = 1
    GENERIC = range(10, 50)
    PLATFORM = range(50, 100)


@dataclass(frozen=True)
class Candidate:
    """A plugin's answer to ``membackend_probe``: score 0 means "does not fit", reason says why.

    ``Candidate(name, score, reason, opt_in=False)``: ``name`` is the backend's
    own (another is replaced by it), ``score`` an int >= 0 on the
    :class:`Score` scale (anything else marks the plugin broken), ``reason``
    one line the doctor prints, naming what was found. ``opt_in`` true: the
    backend fits but wants to be chosen only when forced
    (``MEMBACKEND_BACKEND=name``); automatic selection passes it over.
    """

    name: str
    score: int
    reason: str
    opt_in: bool = False


#: the accepted values of :attr:`Capabilities.page_in_sync`
PAGE_IN_SYNC = ("always", "wddm", "never")


@dataclass(frozen=True)
class Capabilities:
    """What a platform tells the mechanism and the policy; the defaults suit a discrete GPU.

    ``Capabilities(**fields)``: keyword arguments for the fields below, each
    optional; an unknown ``fence_granularity`` or ``page_in_sync``, or a
    ``reserve_churn_limit`` that is not None or an int >= 1, raises
    ``ValueError`` naming what is accepted. A backend exposes it as its
    ``capabilities`` attribute (a platform in its ``Platform`` record); a
    backend with its own mechanism needs only ``release_on_full_unload``,
    which the residency manager reads of every backend (say one pool in the
    budget instead: ``Budget.unified``); the other fields tune
    :mod:`membackend._backends.vmm`.

    The fields fall in groups, :attr:`GROUPS`: ``policy`` is the residency
    manager's; each other group chooses or tunes one part of the VMM
    mechanism (``membackend._backends.vmm.parts`` has the table): ``handles``
    the handle keeper and recycler, ``address_windows`` the window source
    (the quota, the churn-window keeper), ``one_pool`` the one-pool guard,
    ``self_test`` the VMM self-test, ``descriptors`` the descriptor budget
    of handles that hold file descriptors, ``fencing`` and ``pages`` the core's
    frees and page size. A new platform quirk is one part and one flag in its
    group (``docs/backends.md``).

    * ``release_on_full_unload``: a full unload returns the reservation (G1);
      false keeps it, as stock comfy-aimdo does (read by the residency manager).
    * ``recycle_handles``: freed physical memory is kept and mapped again by
      the next fault instead of released and created again; at most
      ``recycle_limit`` handles per device (None: bounded by the budget alone —
      kept handles are released first whenever the device's free memory falls
      below the headroom).
    * ``fence_granularity``: ``reservation`` fences recorded work per
      reservation; ``device`` also synchronizes the whole device before every
      unmap (for drivers that page memory in behind the process's back).
    * ``unified_pool``: the device shares one pool with the host (budgets say so).
    * ``address_quota``: bytes of GPU address space (reservations and mappings)
      the process may hold; a reserve past it is refused up front.
    * ``page_in_sync``: whether a free (a release, a reservation's fence, a
      failed fault's rollback) synchronizes the whole device when pages were
      mapped since its last synchronize, because the driver may still be
      paging a fresh mapping in behind the process's back, work no fence token
      covers (Windows' video memory manager, VidMm in ``dxgmms2``, serves every
      WDDM driver; releasing during that page-in is ComfyUI #16246's bugcheck).
      ``always``: on every device; ``never``: the recorded fence tokens cover
      everything, so a free stalls no other stream; ``wddm`` (the default):
      only on devices that run under WDDM, i.e. on Windows unless the driver
      model is TCC. The platforms' choices: generic ``vmm`` ``wddm``;
      ``cuda_wddm`` ``always``; ``rocm_windows`` ``always``; ``unified_gb10``
      ``never``.
    * ``reserve_churn_limit``: the platform fails large reserves after this many
      large address frees (process-wide); released windows of at least
      ``reserve_churn_window`` bytes are kept and reused instead of freed, and
      given back while the frees the limit allows last (see
      :mod:`membackend._backends.vmm.churn` for the bound on what stays).
    * ``reserve_churn_keep``: under a reserve-churn limit, the most released
      windows a device keeps (None: ``KEPT_WINDOWS_PER_DEVICE``, or as many
      large reservations as the device had alive at once). An int bounds the
      device strictly: a fresh large window is refused when the frees left
      could not bring every device back within it, so a device runs at most
      this many large reservations at once once the frees are spent.
    * ``memory_returns_on_unmap``: false where the driver gives a released
      handle's physical memory back only when the address range it was mapped
      in is freed, not on unmap and release alone (ROCm 7.2; vLLM frees and
      re-reserves the range to release it). The mechanism then keeps a page's
      handle with its own reservation for that reservation's next fault (a
      release would return nothing while the range lives) and gives it back
      with the range; the policy evicts a whole model by releasing its
      reservation, the one free that really returns memory.
    * ``map_granularity``: the smallest mapping, and its alignment, the
      platform's kernels work with when it is larger than the granularity the
      driver reports (RDNA4 reports 4 KiB, and kernels fault on mappings
      aligned to less than 2 MiB); pages are never smaller. None: the driver's.
    * ``vmm_self_test``: on each device's first use the mechanism reserves,
      creates, maps, sets access to, unmaps, releases and frees one page, and
      refuses the device (a ``DriverError`` naming the failed step) when any
      step fails: for drivers whose virtual-memory attribute alone was seen to
      be wrong (VMM on Strix Halo under WSL failed until a ROCm fix).
    * ``handle_descriptors``: each live physical handle holds one of the
      process's file descriptors (ROCm 7.14 on Linux: a dmabuf descriptor per
      ``hipMemCreate``, ROCm/rocm-systems #10604), so the descriptor limit
      bounds what can be mapped. On its first use of a device the mechanism
      raises the soft ``RLIMIT_NOFILE`` toward the hard limit as far as one
      descriptor per page of every device's memory needs (never lowering it),
      and a create the driver answers with out of memory while no descriptor
      is left raises :class:`DescriptorLimit` instead of answering out of
      memory.
    """

    #: the fields by the part of the mechanism they choose or tune (see above); every field is in one group
    GROUPS: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "policy": ("release_on_full_unload",),
        "handles": ("recycle_handles", "recycle_limit", "memory_returns_on_unmap"),
        "address_windows": ("address_quota", "reserve_churn_limit", "reserve_churn_window", "reserve_churn_keep"),
        "one_pool": ("unified_pool",),
        "self_test": ("vmm_self_test",),
        "fencing": ("fence_granularity", "page_in_sync"),
        "pages": ("map_granularity",),
        "descriptors": ("handle_descriptors",),
    }

    release_on_full_unload: bool = True
    recycle_handles: bool = False
    recycle_limit: int | None = 16
    fence_granularity: str = "reservation"
    page_in_sync: str = "wddm"
    unified_pool: bool = False
    address_quota: int | None = None
    reserve_churn_limit: int | None = None
    reserve_churn_window: int = 1 << 30
    reserve_churn_keep: int | None = None
    memory_returns_on_unmap: bool = True
    map_granularity: int | None = None
    vmm_self_test: bool = False
    handle_descriptors: bool = False

    def __post_init__(self) -> None:
        if self.fence_granularity not in ("reservation", "device"):
            raise ValueError(f"fence_granularity {self.fence_granularity!r}; accepted: reservation, device")
        if self.page_in_sync not in PAGE_IN_SYNC:
            raise ValueError(f"page_in_sync {self.page_in_sync!r}; accepted: {', '.join(PAGE_IN_SYNC)}")
        if self.reserve_churn_limit is not None and (not isinstance(self.reserve_churn_limit, int)
                                                     or self.reserve_churn_limit < 1):
            raise ValueError(f"reserve_churn_limit {self.reserve_churn_limit!r}; accepted: None or an int >= 1")
        keep = self.reserve_churn_keep
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(f"reserve_churn_keep {keep!r}; accepted: None or an int >= 1")
        grain = self.map_granularity
        if grain is not None and (isinstance(grain, bool) or not isinstance(grain, int) or grain < 1
                                  or grain & (grain - 1)):
            raise ValueError(f"map_granularity {grain!r}; accepted: None or a power of two >= 1 (bytes)")


@dataclass(frozen=True)
class DriverState:
    """The driver's (or kernel's) own view of one device, from ``membackend_inspect``.

    ``reserved`` and ``resident`` are the bytes of the reservations handed out
    and still alive, and of their resident pages, as the platform itself counts
    them (not the backend's bookkeeping): the conformance kit compares them
    with the session's ledger. ``held`` is memory the backend keeps for reuse
    (recycled physical handles, pooled address windows) that no live
    reservation uses; ``membackend_trim`` must bring it to zero. ``source``
    names where the figures came from.
    """

    reserved: int
    resident: int
    held: int = 0
    source: str = ""
    committed: int | None = None  # process memory the platform charges for it (Windows private commit), if known
    hazards: int = 0  # unsafe operations the driver saw: unmaps or releases while async work used the memory
    calls: Mapping[str, int] | None = None  # the driver's own count of each API call, where it keeps one


@runtime_checkable
class FailureInjection(Protocol):
    """Random driver failures started by ``membackend_inject_failures``.

    ``injected`` counts the failures so far; ``stop()`` ends the injection and
    leaves the driver working normally.
    """

    injected: int

    def stop(self) -> None: ...


@runtime_checkable
class FenceToken(Protocol):
    """Asynchronous work on a range: a CUDA/HIP event wrapper, a copy thread's future.

    ``done()`` says whether the work finished; ``wait()`` blocks until it has and raises if it
    failed. ``Session.record`` also takes a bare ``concurrent.futures.Future`` and wraps it.
    """

    def done(self) -> bool: ...

    def wait(self) -> None: ...
