"""The rules: one parser per setting, the one table of fields, used by every path that reads settings.

A :class:`Rule` takes a value as any source gives it -- a string from the
environment, a TOML value, a keyword argument -- and returns the value, or
raises :class:`RuleError` (a ``ValueError``) saying what is wrong with it. The
same rule serves the pydantic model (:mod:`.model`), the pydantic-free start-up
path (:mod:`.quick`) and the settings a platform declares
(:class:`membackend.platform.PlatformSetting`), so every path accepts and
refuses the same values with the same words.

:data:`FIELDS` is the table of membackend's own settings (name, rule, default,
what it means); :data:`MACHINE_FIELDS` and :data:`DEVICE_FIELDS` are the
tables of the ``machine`` overrides. Nothing here imports pydantic.
"""

from __future__ import annotations

import errno
import math
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterable

from ..types import DEVICE_KINDS, RuleError, closest_name

__all__ = ["Rule", "RuleError", "Field", "parse_bytes", "quoted", "shown", "did_you_mean", "os_reason", "SIZE_MAX",
           "QUOTE_LIMIT", "NAME_MAX", "format_bytes", "size", "flag", "name", "seconds",
           "FIELDS", "MACHINE_FIELDS", "DEVICE_FIELDS", "FIELD_NAMES", "SIZE_ACCEPTED", "NAME_PATTERN",
           "HOST_PAGE_SIZE", "UNITS", "check_appendable", "out_of_files", "FILES_ACCEPTED"]

NAME_PATTERN = r"^[a-z][a-z0-9_\-]*$"
_NAME = re.compile(r"[a-z][a-z0-9_\-]*", re.ASCII)

#: every unit a size may carry (any case), and its multiplier
UNITS: dict[str, int] = {
    "b": 1,
    **{u: 1000 ** (i + 1) for i, u in enumerate(("k", "m", "g", "t", "p", "e"))},
    **{u + "b": 1000 ** (i + 1) for i, u in enumerate(("k", "m", "g", "t", "p", "e"))},
    **{u + "ib": 1024 ** (i + 1) for i, u in enumerate(("k", "m", "g", "t", "p", "e"))},
}
#: the largest size any setting, variable, route or command takes: 8 EiB, what 64-bit drivers' sizes hold with
#: room to spare and far above any machine's memory; larger is a typo, refused as such
SIZE_MAX = 1 << 63
SIZE_ACCEPTED = (
    "a byte count from 0 to 8EiB: an int, or a number and a unit like '512MiB', '1.5GB', '2 GiB'; units in any "
    "case: b, k/kb, m/mb, g/gb, t/tb, p/pb, e/eb (powers of 1000), kib, mib, gib, tib, pib, eib (powers of 1024)"
)
#: the most characters of a value an error message quotes (a 10 MB body is not sent back whole)
QUOTE_LIMIT = 200
#: the longest name (a backend's, in the ``backend`` and ``block`` settings) a setting takes: a longer one is a
#: paste, not a name, so a refusal that echoes a name it took never echoes more than this
NAME_MAX = 100
FLAG_ACCEPTED = "true/false, 1/0, yes/no, on/off (any case)"
TRACE_ACCEPTED = "a path to a file that can be opened for appending (missing parent directories are created)"
PROBE_TIMEOUT_ABOVE, PROBE_TIMEOUT_MAX = 0, 600  # probe_timeout: seconds, > 0 and <= 600
PAGE_MAX = 1 << 30  # the largest page: Linux's largest huge page; a larger one backs a whole model at once
#: the host backend's page size when the ``page_size`` setting is not given
HOST_PAGE_SIZE = 2 << 20
OS_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def quoted(value: Any, limit: int = QUOTE_LIMIT) -> str:
    """``value`` as an error message quotes it: its ``repr``, cut to about ``limit`` characters (saying how
    long it was), and an int too long to print named by its size. Never raises."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 4 * limit:
        return f"<an integer of {value.bit_length()} bits>"
    if isinstance(value, (str, bytes)) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value):,} characters in all)"
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a repr that fails is named by its type
        return f"<a {type(value).__name__}>"
    return text if len(text) <= limit + 20 else f"{text[:limit]}... ({len(text):,} characters in all)"


def shown(text: Any, limit: int = QUOTE_LIMIT) -> str:
    """A path or a name as a message names it: as it is where that reads unambiguously (text, not empty,
    printable, no blank at either end), cut in the middle when longer than ``limit`` (its end, a file's
    name, stays) saying how long it was; anything else as :func:`quoted` gives it (an empty name shows as
    two quotes, a newline as a backslash and an n), so a message stays one line. Never raises."""
    if isinstance(text, os.PathLike):
        try:
            text = os.fspath(text)
        except Exception:  # noqa: BLE001 - a path that cannot say what it is is quoted as it is
            return quoted(text, limit)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if not (isinstance(text, str) and text and text.isprintable() and text == text.strip()):
        return quoted(text, limit)
    if len(text) <= limit:
        return text
    head = limit * 2 // 5
    return f"{text[:head]}...{text[len(text) - (limit - head - 3):]} ({len(text):,} characters in all)"


def did_you_mean(name: Any, choices: Iterable[str]) -> str:
    """``"; did you mean X?"`` naming the one of ``choices`` closest to ``name``
    (:func:`membackend.types.closest_name`), else ``""``: what a refusal of an unknown name appends (simulated
    profiles, the replay's backends). A name that is no text or longer than :data:`NAME_MAX` is like none."""
    if not isinstance(name, str) or len(name) > NAME_MAX:
        return ""
    close = closest_name(name, list(choices))
    return f"; did you mean {close}?" if close else ""


def os_reason(exc: OSError) -> str:
    """Words for why a path could not be used, from its ``OSError``: the system's own (``strerror``), and
    what it means where that is not plain -- a part of the path too long for the file system, a folder on
    the way this user may not search, no file descriptor left (:func:`out_of_files`)."""
    held = out_of_files(exc)
    if held:
        return held
    why = exc.strerror or str(exc) or type(exc).__name__
    if exc.errno == errno.ENAMETOOLONG:
        return f"{why} (a part of the path is longer than the file system allows: 255 bytes on most)"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"{why} (this user may not search or read a folder on the way)"
    return why


class Rule:
    """One parser: ``rule(value)`` is the value in its parsed form, or :class:`RuleError`.

    ``accepted`` says what the rule takes (it ends up in every
    :class:`~membackend.types.ConfigError`); ``kind`` names it (``size``,
    ``flag``, ...) for the doctor's display. A ``nullable`` rule passes None
    through (None: not set, the default's meaning); any other rule refuses it.
    Applying a rule to its own result gives the same result.
    """

    __slots__ = ("kind", "accepted", "nullable", "_parse")

    def __init__(self, kind: str, parse: Callable[[Any], Any], accepted: str, *, nullable: bool = False):
        self.kind, self._parse, self.accepted, self.nullable = kind, parse, accepted, nullable

    def __call__(self, value: Any) -> Any:
        if value is None:
            if self.nullable:
                return None
            raise RuleError("None is not accepted here")
        return self._parse(value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Rule) and (self.kind, self._parse, self.accepted, self.nullable) == (
            other.kind, other._parse, other.accepted, other.nullable)

    def __hash__(self) -> int:
        return hash((self.kind, self.accepted, self.nullable))

    def or_none(self) -> "Rule":
        """The same rule, passing None through."""
        return Rule(self.kind, self._parse, self.accepted, nullable=True)

    def __repr__(self) -> str:
        return f"<rule {self.kind}{' or None' if self.nullable else ''}>"


# --------------------------------------------------------------------------- sizes

_SIZE = re.compile(r"\s*(?P<sign>-?)(?P<whole>[0-9]*)(?:\.(?P<frac>[0-9]+))?\s*(?P<unit>[A-Za-z]*)\s*", re.ASCII)
# digits a size may have before and after its point: 8 EiB in bytes has 19 digits, and one byte written exactly
# in EiB (format_bytes) has 60 decimals
_WHOLE_DIGITS, _FRACTION_DIGITS = 40, 100


def parse_bytes(value: Any) -> int:
    """``'512MiB'`` → 536870912; ints from 0 to :data:`SIZE_MAX` pass through. Raises :class:`RuleError` (a
    ``ValueError``) on anything else, saying why and quoting at most :data:`QUOTE_LIMIT` characters of it.

    The grammar (:data:`SIZE_ACCEPTED`): a decimal number (``12``, ``1.5``,
    ``.5``), optional spaces, an optional unit from :data:`UNITS` in any case,
    surrounding spaces ignored. The arithmetic is exact (no float): a fraction
    of a byte is dropped. A whole float (``2.0``, as TOML may write it) is its
    int; booleans are refused (``headroom = true`` is a mistake, not one
    byte), and so are negative numbers (``-0`` is zero), exponents, digit
    separators and anything above :data:`SIZE_MAX`.
    """
    if isinstance(value, bool):
        raise RuleError(f"{quoted(value)} is not a size (a boolean)")
    if isinstance(value, int):
        if value < 0:
            raise RuleError(f"{quoted(value)} is not a size (negative)")
        return _bounded(value, value)
    if isinstance(value, float):
        if not math.isfinite(value) or value < 0 or not value.is_integer():
            raise RuleError(f"{quoted(value)} is not a size (not a whole number of bytes >= 0)")
        return _bounded(int(value), value)
    if not isinstance(value, str):
        raise RuleError(f"{quoted(value)} is not a size ({type(value).__name__})")
    m = _SIZE.fullmatch(value)
    if m is None or not (m["whole"] or m["frac"]):
        why = "negative" if value.strip().startswith("-") else "not a number and a unit"
        raise RuleError(f"{quoted(value)} is not a size ({why})")
    whole, frac = m["whole"].lstrip("0"), (m["frac"] or "").rstrip("0")
    if len(whole) > _WHOLE_DIGITS or len(frac) > _FRACTION_DIGITS:
        raise RuleError(f"{quoted(value)} is not a size (too many digits: at most 8EiB = {SIZE_MAX} bytes)")
    if m["sign"] and (whole or frac):
        raise RuleError(f"{quoted(value)} is not a size (negative)")
    multiplier = UNITS.get(m["unit"].lower() or "b")
    if multiplier is None:
        raise RuleError(f"{quoted(value)} is not a size (unknown unit {quoted(m['unit'])})")
    scale = 10 ** len(frac)
    return _bounded((int(whole or "0") * scale + int(frac or "0")) * multiplier // scale, value)


def _bounded(n: int, value: Any) -> int:
    if n > SIZE_MAX:
        raise RuleError(f"{quoted(value)} is not a size (larger than 8EiB = {SIZE_MAX} bytes)")
    return n


def format_bytes(n: int, unit: str | None = None) -> str:
    """``n`` bytes written so that :func:`parse_bytes` reads back exactly ``n``.

    With ``unit`` (any key of :data:`UNITS`, any case: ``'MiB'``, ``'gb'``) the
    number is exact in that unit, with as many decimals as it needs
    (``format_bytes(1536, 'KiB') == '1.5KiB'``); without, the largest binary
    unit that divides ``n`` (``'512MiB'``), else plain bytes.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{n!r} is not a byte count >= 0")
    if unit is None:
        for candidate in ("EiB", "PiB", "TiB", "GiB", "MiB", "KiB"):
            if n and n % UNITS[candidate.lower()] == 0:
                return f"{n // UNITS[candidate.lower()]}{candidate}"
        return str(n)
    multiplier = UNITS.get(unit.lower())
    if multiplier is None:
        raise ValueError(f"unknown unit {unit!r}; accepted: {', '.join(UNITS)}")
    whole, rest = divmod(n, multiplier)
    if not rest:
        return f"{whole}{unit}"
    digits = 1  # every multiplier is 2^a * 5^b, so some power of ten makes the rest whole
    while rest * 10 ** digits % multiplier:
        digits += 1
    return f"{whole}.{rest * 10 ** digits // multiplier:0{digits}d}{unit}"


def _page_size(value: Any) -> int:
    n = parse_bytes(value)
    if n < OS_PAGE or n & (n - 1) or n % OS_PAGE or n > PAGE_MAX:
        raise RuleError(f"{quoted(value)} is not a power of two multiple of the OS page ({OS_PAGE}) up to 1GiB")
    return n


# --------------------------------------------------------------------------- other kinds

_TRUE, _FALSE = frozenset({"1", "true", "yes", "on"}), frozenset({"0", "false", "no", "off"})


def _flag(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise RuleError(f"{quoted(value)} is not a boolean")


NAME_ACCEPTED = (f"letters, digits, '_' and '-', starting with a letter, at most {NAME_MAX} characters, in any "
                 "case (CUDA_WDDM is cuda_wddm)")


def _name(value: Any) -> str:
    """A backend's name in any case, blanks around it ignored. Every backend's name is lower-case
    (``NAME_PATTERN``), so ``CUDA_WDDM`` can only mean ``cuda_wddm``: it is taken, not refused."""
    if isinstance(value, str) and len(value) <= 2 * NAME_MAX:  # no copy of a 10 MB value is made
        lowered = value.strip().lower()
        if len(lowered) <= NAME_MAX and _NAME.fullmatch(lowered):
            return lowered
    raise RuleError(f"{quoted(value)} is not a name")


def _names(value: Any) -> list[str]:
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    if not isinstance(value, (list, tuple)):
        raise RuleError(f"{quoted(value)} is not a list of backend names")
    names = []
    for item in value:
        try:
            names.append(_name(item))
        except RuleError:
            raise RuleError(f"{quoted(item)} is not a backend name ({NAME_ACCEPTED})") from None
        if names[-1] == "host":
            raise RuleError("'host' is the fallback and cannot be blocked")
    return names


PROFILE_ACCEPTED = ("the name of a simulated profile, in any case (an unknown one is refused when the backends "
                    "load, with every profile's name)")


def _profile(value: Any) -> str:
    """``sim_profile``: text, lower-cased (every profile's name is), blanks around it ignored. The profiles
    live with the simulation, above the settings: a name none has is refused where they are known, when the
    backends load, with every profile's name and the closest one -- never from a list written here."""
    if not isinstance(value, str):
        raise RuleError(f"{quoted(value)} is not a profile name (text)")
    return value.strip().lower() if len(value) <= 2 * NAME_MAX else value  # a 10 MB value is refused unchanged


_NUMBER = re.compile(r"\s*[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?\s*", re.ASCII)


def _seconds(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)) or \
            (isinstance(value, str) and not _NUMBER.fullmatch(value)):
        raise RuleError(f"{quoted(value)} is not a number of seconds")
    try:
        x = float(value)
    except (OverflowError, ValueError):
        raise RuleError(f"{quoted(value)} is not a number of seconds") from None
    if not PROBE_TIMEOUT_ABOVE < x <= PROBE_TIMEOUT_MAX:  # NaN fails too
        raise RuleError(f"{quoted(value)} is not > {PROBE_TIMEOUT_ABOVE} and <= {PROBE_TIMEOUT_MAX} seconds")
    return x


def check_appendable(path: Path) -> None:
    """Open ``path`` for appending, creating missing parent directories; raise ``OSError`` if it cannot be.

    The file (created empty if absent) and its new directories stay when the
    check succeeds: the user asked for them. On failure the directories this
    check created are removed again.
    """
    missing = []
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        missing.append(parent)
        parent = parent.parent
    created: list[Path] = []
    try:
        for directory in reversed(missing):
            directory.mkdir()
            created.append(directory)
        # O_NONBLOCK: a FIFO nobody reads is refused (ENXIO) instead of waiting for a reader forever
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NONBLOCK", 0), 0o666)
        os.close(fd)
    except OSError:
        for directory in reversed(created):
            try:
                directory.rmdir()
            except OSError:
                pass  # something else appeared in it meanwhile: not ours to remove
        raise


#: what a process out of file descriptors (:func:`out_of_files`) would need
FILES_ACCEPTED = ("fewer files open at once (a closed session gives back every descriptor it opened) or a higher "
                  "limit (ulimit -n, resource.setrlimit)")


def out_of_files(exc: BaseException) -> str | None:
    """Words for an ``OSError`` saying no file descriptor is left, naming the limit (``EMFILE``: this process's
    ``RLIMIT_NOFILE``; ``ENFILE``: the system's ``fs.file-max``); None for any other error. Every path that
    opens a file can put them in its own typed error, with :data:`FILES_ACCEPTED`."""
    if not isinstance(exc, OSError) or exc.errno not in (errno.EMFILE, errno.ENFILE):
        return None
    if exc.errno == errno.ENFILE:
        held = "the system has no file descriptor left (its limit: fs.file-max)"
    else:
        try:
            import resource

            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            limit = "no limit" if soft == resource.RLIM_INFINITY else f"{soft} open files"
        except (ImportError, OSError, ValueError):  # Windows: no resource module
            limit = "unknown here"
        held = f"this process has every file descriptor open that its limit allows ({limit}: RLIMIT_NOFILE, ulimit -n)"
    return held


def _trace(value: Any) -> Path:
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value or "\x00" in value:
        raise RuleError(f"{quoted(value)} is not a path")
    path = Path(value)
    try:
        check_appendable(path)
    except OSError as exc:
        why = "a FIFO (named pipe) nobody reads" if exc.errno == errno.ENXIO else os_reason(exc)
        raise RuleError(f"cannot open {quoted(value)} for appending: {why}") from None
    return path


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    raise RuleError(f"{quoted(value)} is not text")


def _count(minimum: int) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if isinstance(value, str) and re.fullmatch(r"[0-9]+", value.strip(), re.ASCII):
            if len(value.strip().lstrip("0")) > _WHOLE_DIGITS:
                raise RuleError(f"{quoted(value)} is not a whole number >= {minimum} (too many digits)")
            value = int(value.strip())
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum or value > SIZE_MAX:
            raise RuleError(f"{quoted(value)} is not a whole number from {minimum} to {SIZE_MAX}")
        return value
    return parse


def _one_of(what: str, choices: tuple[str, ...]) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        if isinstance(value, str) and value.lower() in choices:
            return value.lower()
        raise RuleError(f"unknown {what} {quoted(value)}")
    return parse


def _luid(value: Any) -> str:
    if isinstance(value, str) and re.fullmatch(r"[0-9a-fA-F]{16}", value):
        return value.lower()
    raise RuleError(f"{quoted(value)} is not an adapter LUID")


#: the rules a platform may use for the settings it declares (:mod:`membackend.platform` exports them)
size = Rule("size", parse_bytes, SIZE_ACCEPTED)

KEEP_DROPPED_ACCEPTED = f"auto, off, or a size ({SIZE_ACCEPTED}): at most that much per device"


def _keep_dropped(value: Any) -> str | int:
    """``keep_dropped``: ``"auto"``, ``"off"`` (any case, surrounding spaces ignored) or a size in bytes."""
    if isinstance(value, str) and value.strip().lower() in ("auto", "off"):
        return value.strip().lower()
    try:
        return parse_bytes(value)
    except RuleError:
        raise RuleError(f"{quoted(value)} is neither auto, off nor a size") from None
flag = Rule("flag", _flag, FLAG_ACCEPTED)
name = Rule("name", _name, NAME_ACCEPTED)
seconds = Rule("seconds", _seconds, f"a number of seconds, > {PROBE_TIMEOUT_ABOVE} and <= {PROBE_TIMEOUT_MAX}")


# --------------------------------------------------------------------------- the tables


class Field:
    """One setting: its name (also its key in a file and, upper-cased after ``MEMBACKEND_``, its variable),
    its rule, its default (``factory`` makes a fresh one each time), what it means (``doc``), the type the
    model gives it (``annotation``), and, for a table of settings, the fields of the table (``table``) or of
    each of its items (``items``). Read-only by convention. (A plain class: a dataclass costs about 2 ms to
    define, on the ComfyUI adapter's start-up path.)"""

    __slots__ = ("name", "rule", "default", "doc", "annotation", "factory", "table", "items", "accepted_text")

    def __init__(self, name: str, rule: Rule, default: Any = None, doc: str = "", annotation: Any = None,
                 factory: Callable[[], Any] | None = None, table: tuple["Field", ...] | None = None,
                 items: tuple["Field", ...] | None = None, accepted_text: str = ""):
        self.name, self.rule, self.default, self.doc, self.annotation = name, rule, default, doc, annotation
        self.factory, self.table, self.items, self.accepted_text = factory, table, items, accepted_text

    def __repr__(self) -> str:
        return f"Field({self.name!r}, {self.rule!r}, default={self.default!r})"

    @property
    def accepted(self) -> str:
        return self.accepted_text or (self.rule.accepted if self.rule is not None else "")

    def default_value(self) -> Any:
        return self.factory() if self.factory is not None else self.default


def _table_keys(fields: tuple[Field, ...]) -> str:
    return "one of: " + ", ".join(f.name for f in fields)


def _parse_table(fields: tuple[Field, ...], value: Any, what: str) -> dict[str, Any]:
    """A table's given keys, each through its field's rule (a JSON object in text is decoded first)."""
    if isinstance(value, str):
        value = _json(value)
    if hasattr(value, "model_dump"):  # one of the models themselves
        value = value.model_dump(exclude_unset=True)
    if not isinstance(value, dict):
        raise RuleError(f"{quoted(value)} is not a table of {what}")
    by_name = {f.name: f for f in fields}
    out: dict[str, Any] = {}
    for key, raw in value.items():
        field = by_name.get(key)
        if field is None:
            raise RuleError("unknown key", (key,), _table_keys(fields))
        try:
            out[key] = field.rule(raw) if field.rule is not None else raw
        except RuleError as exc:
            # what the innermost part accepts: the error's own text, else this field's (for its own value)
            accepted = exc.accepted if exc.accepted is not None else None if exc.path else field.accepted
            raise RuleError(exc.message, (key, *exc.path), accepted) from None
    return out


DEVICE_FIELDS: tuple[Field, ...] = (
    Field("kind", Rule("device kind", _one_of("device kind", DEVICE_KINDS), ", ".join(DEVICE_KINDS)), "cuda",
          annotation=str),
    Field("index", Rule("index", _count(0), "a whole number >= 0"), 0, annotation=int),
    Field("name", Rule("text", _text, "text"), "", annotation=str),
    Field("total_memory", size, 0, annotation=int),
    Field("integrated", flag, False, annotation=bool),
    Field("unified", flag, False, annotation=bool),
    Field("driver_model", Rule("driver model", _one_of("driver model", ("wddm", "tcc", "mcdm")),
                               "wddm, tcc, mcdm or unset", nullable=True), None, annotation=str | None),
    Field("arch", Rule("text", _text, "text", nullable=True), None, annotation=str | None),
    #: a device the user describes is taken to support virtual memory management unless told otherwise
    Field("vmm_supported", flag, True, annotation=bool),
    Field("luid", Rule("LUID", _luid, "16 hex digits (the adapter LUID)", nullable=True), None,
          annotation=str | None),
)


def _json(text: str) -> Any:
    import json  # only a JSON value in the environment needs it (about 3 ms on the start-up path)

    try:
        return json.loads(text)
    except ValueError as exc:
        raise RuleError(f"cannot be decoded: {exc}") from None


def _devices(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        value = _json(value)
    if not isinstance(value, (list, tuple)):
        raise RuleError(f"{quoted(value)} is not a list of devices")
    out = []
    for i, item in enumerate(value):
        try:
            out.append(_parse_table(DEVICE_FIELDS, item, "device facts"))
        except RuleError as exc:
            raise RuleError(exc.message, (i, *exc.path), exc.accepted) from None
    return out


_DEVICES_ACCEPTED = ("a list of tables (in the environment: a JSON list) with keys "
                     + ", ".join(f.name for f in DEVICE_FIELDS))

MACHINE_FIELDS: tuple[Field, ...] = (
    Field("os", Rule("OS", _one_of("OS", ("linux", "windows", "darwin")), "linux, windows, darwin", nullable=True),
          annotation=str | None),
    Field("cpus", Rule("count", _count(1), "a whole number >= 1", nullable=True), annotation=int | None),
    Field("ram_total", size.or_none(), annotation=int | None),
    Field("ram_available", size.or_none(), annotation=int | None),
    Field("cgroup_limit", size.or_none(), annotation=int | None),
    Field("torch_version", Rule("text", _text, "text", nullable=True), annotation=str | None),
    Field("torch_vendor", Rule("torch vendor", _one_of("torch vendor", ("cuda", "rocm", "cpu")), "cuda, rocm, cpu",
                               nullable=True), annotation=str | None),
    Field("devices", Rule("device list", _devices, _DEVICES_ACCEPTED, nullable=True), annotation="devices",
          items=DEVICE_FIELDS),
)

_MACHINE_ACCEPTED = ("a table (in the environment: a JSON object) with keys " + ", ".join(
    f.name for f in MACHINE_FIELDS) + "; or one variable per key, e.g. MEMBACKEND_MACHINE__OS=linux")

FIELDS: tuple[Field, ...] = (
    Field("backend", name.or_none(), None, "force this backend by name", str | None,
          accepted_text="the name of an installed backend (see `membackend backends`): " + NAME_ACCEPTED),
    Field("disable", flag, False, "switch membackend off: callers use their legacy path", bool),
    Field("block", Rule("backend names", _names, "a comma-separated list of backend names other than 'host', in "
                                                 "any case"),
          doc="backend names never to select", annotation=list[str], factory=list),
    Field("headroom", size.or_none(), None,
          "bytes kept free on every device; replaces the platform's or backend's own (a live change and "
          "ComfyUI's --reserve-vram/--vram-headroom win over it)", int | None),
    Field("page_size", Rule("page size", _page_size,
                            "a power of two, a multiple of the OS page size, at most 1GiB, e.g. '2MiB'"),
          HOST_PAGE_SIZE, "the host backend's page size in bytes (default 2 MiB); GPU platforms use their own "
                          "(Platform.page_size)", int),
    Field("host_capacity", size.or_none(), None, "cap on what the host backend may keep resident (default: no cap)",
          int | None),
    Field("keep_dropped", Rule("cache size", _keep_dropped, KEEP_DROPPED_ACCEPTED), "auto",
          "the weights of models ComfyUI dropped, kept in VRAM as reclaimable cache so that loading the same file "
          "again reads nothing (auto: as the room allows; off: none; a size: at most that per device)",
          str | int),
    Field("sim_profile", Rule("profile name", _profile, PROFILE_ACCEPTED, nullable=True), None,
          "run GPU backends on a simulated machine; the names are checked where the simulation lives, when "
          "backends are loaded", str | None),
    Field("probe_timeout", seconds, 10.0, "seconds each backend's probe may take before it is skipped as broken",
          float),
    Field("override_probe", flag, False,
          "accept a forced backend even where its own probe says it does not fit this machine (you know better "
          "than the probe); without it such a forcing is refused with the probe's reason", bool),
    Field("sanitize", flag, False, "check every free/release for pending work and use after release", bool),
    Field("trace", Rule("path", _trace, TRACE_ACCEPTED, nullable=True), None,
          "append one JSON line per verb call and policy decision to this file", Path | None),
    Field("machine", Rule("table", lambda v: _parse_table(MACHINE_FIELDS, v, "machine facts"), _MACHINE_ACCEPTED),
          doc="facts that replace what discovery finds, so tests can be any machine", annotation="machine",
          table=MACHINE_FIELDS),
)
FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in FIELDS)
BY_NAME: dict[str, Field] = {f.name: f for f in FIELDS}
