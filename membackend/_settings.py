"""Settings, from (highest precedence first): explicit kwargs, ``MEMBACKEND_*``
environment variables, a ``membackend.toml`` (path from ``MEMBACKEND_CONFIG``,
else the current directory), ``[tool.membackend]`` in ``pyproject.toml`` in the
current directory, then defaults.

Every bad value becomes a :class:`~membackend.types.ConfigError` that names the
key, where the value came from and what is accepted.

Importing this module does not import pydantic (about 0.3 s): the models
(:class:`Settings`, :class:`MachineOverrides`, :class:`DeviceOverride`) are
built on first use, and :func:`parse_bytes` loads pydantic's ``ByteSize`` on
its first call. Start-up code that only needs the values (the ComfyUI adapter's
prestartup script) calls :func:`quick_settings`, which reads the same sources
with the same rules and hands everything it does not take in plain form to
:func:`load_settings`.
"""

from __future__ import annotations

import functools
import os
import re
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .types import DEVICE_KINDS, ConfigError

if TYPE_CHECKING:  # built by _models() on first use; the names resolve through __getattr__ below
    from pydantic import BaseModel as _BaseModel
    from pydantic_settings import BaseSettings as _BaseSettings

    Settings = _BaseSettings
    MachineOverrides = DeviceOverride = _BaseModel

__all__ = ["Settings", "MachineOverrides", "DeviceOverride", "load_settings", "parse_bytes", "config_file",
           "quick_settings", "QuickSettings"]

ENV_PREFIX = "MEMBACKEND_"
CONFIG_ENV = "MEMBACKEND_CONFIG"
CONFIG_NAME = "membackend.toml"
PYPROJECT_TABLE = ("tool", "membackend")
NAME_PATTERN = r"^[a-z][a-z0-9_\-]*$"
TRACE_ACCEPTED = "a path to a file that can be opened for appending (missing parent directories are created)"
CONFIG_ACCEPTED = "the path of an existing UTF-8 TOML file"
SIZE_ACCEPTED = (
    "a byte count >= 0: an int, or a number and a unit like '512MiB', '1.5GB', '2 GiB'; units in any case: "
    "b, k/kb, m/mb, g/gb, t/tb, p/pb, e/eb (powers of 1000), kib, mib, gib, tib, pib, eib (powers of 1024)"
)
PROBE_TIMEOUT_ABOVE, PROBE_TIMEOUT_MAX = 0, 600  # probe_timeout: seconds, > 0 and <= 600

#: the default of every field of :class:`Settings` but ``block`` (an empty list) and ``machine``
#: (no fact overridden); one table for the model and the quick path
DEFAULTS: dict[str, Any] = {"backend": None, "disable": False, "headroom": None, "page_size": None,
                            "host_capacity": None, "sim_profile": None, "probe_timeout": 10.0, "sanitize": False,
                            "trace": None}
FIELDS = ("backend", "disable", "block", "headroom", "page_size", "host_capacity", "sim_profile", "probe_timeout",
          "sanitize", "trace", "machine")
MACHINE_FIELDS = ("os", "cpus", "ram_total", "ram_available", "cgroup_limit", "torch_version", "torch_vendor",
                  "devices")


# --------------------------------------------------------------------------- rules (shared by both paths)


@functools.cache
def _byte_size() -> Any:
    from pydantic import ByteSize, TypeAdapter

    return TypeAdapter(ByteSize)


def _one_of(value: str | None, accepted: tuple[str, ...], what: str) -> str | None:
    """``value`` lower-cased when it is one of ``accepted`` (case ignored); None stays None."""
    if value is not None and value.lower() not in accepted:
        raise ValueError(f"unknown {what} {value!r}")
    return value.lower() if value else value


def parse_bytes(value: Any) -> int:
    """``'512MiB'`` → 536870912; ints pass through. Raises ``ValueError`` on anything else.

    Parsing is pydantic's ``ByteSize`` (units as in :data:`SIZE_ACCEPTED`; a
    fraction of a byte is dropped). Booleans are refused although ``ByteSize``
    reads ``True`` as 1: ``headroom = true`` is a mistake, not one byte.
    """
    if isinstance(value, bool):
        raise ValueError("a boolean is not a size")
    if not isinstance(value, (int, float, str)):
        raise ValueError(f"{value!r} is not a size")
    from pydantic import ValidationError

    try:
        n = int(_byte_size().validate_python(value))
    except ValidationError as exc:
        raise ValueError(f"{value!r} is not a size ({exc.errors()[0]['msg']})") from None
    if n < 0:  # ByteSize refuses "-1" and -1 already; kept so the contract does not hang on that
        raise ValueError(f"{value!r} is negative")
    return n


def split_block(value: Any) -> Any:
    """``block`` given as text: a comma-separated list (blanks dropped); anything else unchanged."""
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    return value


def check_block(names: list[str]) -> list[str]:
    """Every blocked name is a backend name, and ``host`` (the fallback) is not one of them."""
    for name in names:
        if not re.match(NAME_PATTERN, name):
            raise ValueError(f"{name!r} is not a backend name")
        if name == "host":
            raise ValueError("'host' is the fallback and cannot be blocked")
    return names


def check_page_size(n: int, given: Any) -> int:
    """A host page size is a power of two and a multiple of the OS page."""
    os_page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
    if n < os_page or n & (n - 1) or n % os_page:
        raise ValueError(f"{given!r} is not a power of two multiple of the OS page ({os_page})")
    return n


def config_file() -> Path:
    """The ``membackend.toml`` in force: ``$MEMBACKEND_CONFIG`` or ``./membackend.toml``."""
    return Path(os.environ.get(CONFIG_ENV) or CONFIG_NAME)


def _read_toml(path: Path, table: tuple[str, ...] = ()) -> dict[str, Any]:
    """The TOML table at ``table`` in ``path``; ``{}`` when the file does not exist.

    Raises ``ConfigError`` (key ``config``, the file as source) for a file
    that cannot be read, is not UTF-8 or is not TOML.
    """
    if not path.is_file():
        return {}
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError("config", str(path), f"cannot be read: {exc.strerror or exc}", CONFIG_ACCEPTED) from None
    except UnicodeDecodeError as exc:  # tomllib decodes as UTF-8 and lets this through
        raise ConfigError("config", str(path), f"not UTF-8 text ({exc.reason} at byte {exc.start})",
                          CONFIG_ACCEPTED) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("config", str(path), f"not valid TOML: {exc}", CONFIG_ACCEPTED) from None
    for key in table:
        data = data.get(key, {}) if isinstance(data, dict) else {}
    return data if isinstance(data, dict) else {}


def _check_config_files() -> None:
    """Refuse a ``MEMBACKEND_CONFIG`` naming no file, and unreadable or broken TOML files, before loading."""
    named = os.environ.get(CONFIG_ENV)
    if named:
        path = Path(named)
        if not path.is_file():
            what = "is a directory" if path.is_dir() else "does not exist"
            raise ConfigError("config", f"env {CONFIG_ENV}", f"{named!r} {what}", CONFIG_ACCEPTED)
    _read_toml(config_file())
    _read_toml(Path("pyproject.toml"))


def _check_appendable(path: Path) -> None:
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
        with path.open("a"):
            pass
    except OSError:
        for directory in reversed(created):
            try:
                directory.rmdir()
            except OSError:
                pass  # something else appeared in it meanwhile: not ours to remove
        raise


# --------------------------------------------------------------------------- the models (pydantic, on first use)


@functools.cache
def _models() -> Any:
    """Build the pydantic models once; they become this module's ``DeviceOverride``, ``MachineOverrides``
    and ``Settings``."""
    from typing import Annotated

    from pydantic import BaseModel, ConfigDict, Field, field_validator
    from pydantic_settings import (
        BaseSettings,
        NoDecode,
        PydanticBaseSettingsSource,
        PyprojectTomlConfigSettingsSource,
        SettingsConfigDict,
        TomlConfigSettingsSource,
    )

    class DeviceOverride(BaseModel):
        """One device of a simulated machine (see ``MachineOverrides.devices``)."""

        model_config = ConfigDict(extra="forbid")

        kind: str = Field("cuda", json_schema_extra={"accepted": ", ".join(DEVICE_KINDS)})
        index: int = Field(0, ge=0)
        name: str = ""
        total_memory: int = Field(0, json_schema_extra={"accepted": SIZE_ACCEPTED})
        integrated: bool = False
        unified: bool = False
        driver_model: str | None = Field(None, json_schema_extra={"accepted": "wddm, tcc, mcdm or unset"})
        arch: str | None = None
        #: a device the user describes is taken to support virtual memory management unless told otherwise
        vmm_supported: bool = True
        luid: str | None = Field(None, json_schema_extra={"accepted": "16 hex digits (the adapter LUID)"})

        @field_validator("kind")
        @classmethod
        def _kind(cls, v: str) -> str:
            if v not in DEVICE_KINDS:
                raise ValueError(f"unknown device kind {v!r}")
            return v

        @field_validator("total_memory", mode="before")
        @classmethod
        def _size(cls, v: Any) -> int:
            return parse_bytes(v)

        @field_validator("driver_model")
        @classmethod
        def _driver_model(cls, v: str | None) -> str | None:
            return _one_of(v, ("wddm", "tcc", "mcdm"), "driver model")

    class MachineOverrides(BaseModel):
        """Facts that replace what ``machine.py`` would detect, so tests can be any machine.

        Env form: ``MEMBACKEND_MACHINE__OS=windows``,
        ``MEMBACKEND_MACHINE__DEVICES='[{"kind": "cuda", "total_memory": "6GiB", "driver_model": "wddm"}]'``.
        """

        model_config = ConfigDict(extra="forbid")

        os: str | None = Field(None, json_schema_extra={"accepted": "linux, windows, darwin"})
        cpus: int | None = Field(None, ge=1)
        ram_total: int | None = Field(None, json_schema_extra={"accepted": SIZE_ACCEPTED})
        ram_available: int | None = Field(None, json_schema_extra={"accepted": SIZE_ACCEPTED})
        cgroup_limit: int | None = Field(None, json_schema_extra={"accepted": SIZE_ACCEPTED})
        torch_version: str | None = None
        torch_vendor: str | None = Field(None, json_schema_extra={"accepted": "cuda, rocm, cpu"})
        devices: list[DeviceOverride] | None = None

        @field_validator("ram_total", "ram_available", "cgroup_limit", mode="before")
        @classmethod
        def _size(cls, v: Any) -> int | None:
            return None if v is None else parse_bytes(v)

        @field_validator("os")
        @classmethod
        def _os(cls, v: str | None) -> str | None:
            return _one_of(v, ("linux", "windows", "darwin"), "OS")

        @field_validator("torch_vendor")
        @classmethod
        def _vendor(cls, v: str | None) -> str | None:
            return _one_of(v, ("cuda", "rocm", "cpu"), "torch vendor")

    class Settings(BaseSettings):
        """Every setting of membackend; build it with :func:`load_settings`."""

        model_config = SettingsConfigDict(
            env_prefix=ENV_PREFIX,
            env_nested_delimiter="__",
            extra="forbid",
            pyproject_toml_table_header=PYPROJECT_TABLE,
            validate_default=True,
        )

        backend: str | None = Field(
            DEFAULTS["backend"], pattern=NAME_PATTERN,
            description="force this backend by name",
            json_schema_extra={"accepted": "the name of an installed backend (see `membackend backends`)"},
        )
        disable: bool = Field(
            DEFAULTS["disable"], description="switch membackend off: callers use their legacy path",
            json_schema_extra={"accepted": "true/false, 1/0, yes/no"},
        )
        block: Annotated[list[str], NoDecode] = Field(
            default_factory=list, description="backend names never to select",
            json_schema_extra={"accepted": "a comma-separated list of backend names other than 'host'"},
        )
        headroom: int | None = Field(
            DEFAULTS["headroom"], description="bytes kept free on every device (default: the backend's own)",
            json_schema_extra={"accepted": SIZE_ACCEPTED},
        )
        page_size: int | None = Field(
            DEFAULTS["page_size"], description="host backend page size in bytes (default 2 MiB)",
            json_schema_extra={"accepted": "a power of two, a multiple of the OS page size, e.g. '2MiB'"},
        )
        host_capacity: int | None = Field(
            DEFAULTS["host_capacity"], description="cap on what the host backend may keep resident (default: no cap)",
            json_schema_extra={"accepted": SIZE_ACCEPTED},
        )
        sim_profile: str | None = Field(
            DEFAULTS["sim_profile"], pattern=NAME_PATTERN,
            description="run GPU backends on a simulated machine; the names are checked where the simulation "
                        "lives, when backends are loaded",
            json_schema_extra={"accepted": "wddm-6gb, rocm-win-2gpu, gb10-128gb, h200"},
        )
        probe_timeout: float = Field(
            DEFAULTS["probe_timeout"], gt=PROBE_TIMEOUT_ABOVE, le=PROBE_TIMEOUT_MAX,
            description="seconds each backend's probe may take before it is skipped as broken",
            json_schema_extra={"accepted": f"a number of seconds, > {PROBE_TIMEOUT_ABOVE} and "
                                           f"<= {PROBE_TIMEOUT_MAX}"},
        )
        sanitize: bool = Field(
            DEFAULTS["sanitize"], description="check every free/release for pending work and use after release",
            json_schema_extra={"accepted": "true/false, 1/0, yes/no"},
        )
        trace: Path | None = Field(
            DEFAULTS["trace"], description="append one JSON line per verb call and policy decision to this file",
            json_schema_extra={"accepted": TRACE_ACCEPTED},
        )
        machine: MachineOverrides = Field(
            default_factory=MachineOverrides,
            json_schema_extra={"accepted": "a table (in the environment: a JSON object) with keys os, cpus, "
                                          "ram_total, ram_available, cgroup_limit, torch_version, torch_vendor, "
                                          "devices; or one variable per key, e.g. MEMBACKEND_MACHINE__OS=linux"},
        )

        @field_validator("block", mode="before")
        @classmethod
        def _split_block(cls, v: Any) -> Any:
            return split_block(v)

        @field_validator("block")
        @classmethod
        def _check_block(cls, v: list[str]) -> list[str]:
            return check_block(v)

        @field_validator("headroom", "host_capacity", mode="before")
        @classmethod
        def _size(cls, v: Any) -> int | None:
            return None if v is None else parse_bytes(v)

        @field_validator("page_size", mode="before")
        @classmethod
        def _page_size(cls, v: Any) -> int | None:
            return None if v is None else check_page_size(parse_bytes(v), v)

        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            return (
                init_settings,
                env_settings,
                TomlConfigSettingsSource(settings_cls, toml_file=config_file()),
                PyprojectTomlConfigSettingsSource(settings_cls, toml_file=Path("pyproject.toml")),
            )

    models = (DeviceOverride, MachineOverrides, Settings)
    for cls in models:
        cls.__module__ = __name__
        cls.__qualname__ = cls.__name__  # importable (and picklable) as membackend._settings.<name>
        globals()[cls.__name__] = cls
    return models


_MODEL_NAMES = ("DeviceOverride", "MachineOverrides", "Settings")


def __getattr__(name: str) -> Any:
    """The models are built on first access (PEP 562), so importing this module costs no pydantic."""
    if name in _MODEL_NAMES:
        return _models()[_MODEL_NAMES.index(name)]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------- the full path


def _lookup(data: dict[str, Any], path: tuple[Any, ...]) -> bool:
    for part in path:
        if not isinstance(data, dict) or part not in data:
            return False
        data = data[part]
    return True


def _source_of(path: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """Which source supplied the value at ``path`` (first in precedence order)."""
    if _lookup(kwargs, path):
        return "kwargs"
    names = [str(p).upper() for p in path if not isinstance(p, int)]
    for n in range(len(names), 0, -1):  # MEMBACKEND_MACHINE__OS, then MEMBACKEND_MACHINE
        env = ENV_PREFIX + "__".join(names[:n])
        if any(k.upper() == env for k in os.environ):
            return f"env {env}"
    cfg = config_file()
    if _lookup(_read_toml(cfg), path[:1]):
        return str(cfg)
    if _lookup(_read_toml(Path("pyproject.toml"), PYPROJECT_TABLE), path[:1]):
        return "pyproject.toml [tool.membackend]"
    return "default"


def _accepted(path: tuple[Any, ...]) -> str:
    from pydantic import BaseModel

    model: Any = _models()[2]
    info = None
    for part in path:
        if isinstance(part, int) or model is None:
            continue
        fields = getattr(model, "model_fields", {})
        if part not in fields:
            return "one of: " + ", ".join(fields)
        info = fields[part]
        ann = info.annotation
        args = getattr(ann, "__args__", ()) or ()
        model = next((a for a in (ann, *args) if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if model is None:  # list[DeviceOverride]
            for a in args:
                inner = getattr(a, "__args__", ()) or ()
                model = next((i for i in inner if isinstance(i, type) and issubclass(i, BaseModel)), None) or model
    extra = (info.json_schema_extra or {}) if info is not None else {}
    return str(extra.get("accepted", "")) if isinstance(extra, dict) else ""


def load_settings(**kwargs: Any) -> "Settings":
    """Build :class:`Settings`; any bad value raises ``ConfigError`` (key, source, accepted).

    Besides the values themselves this checks that ``MEMBACKEND_CONFIG``, when
    set, names an existing file, that the TOML files are UTF-8 TOML, and that
    ``trace`` can be opened for appending.
    """
    _check_config_files()
    settings_cls = _models()[2]
    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    try:
        settings = settings_cls(**kwargs)
    except ValidationError as exc:
        err = exc.errors()[0]
        path = tuple(err["loc"])
        key = ".".join(str(p) for p in path) or "settings"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
            parent = (_accepted(path[:-1] + ("__none__",)) if len(path) > 1
                      else "one of: " + ", ".join(settings_cls.model_fields))
            raise ConfigError(key, _source_of(path, kwargs), msg, parent) from None
        raise ConfigError(key, _source_of(path, kwargs), f"{msg} (got {err.get('input')!r})", _accepted(path)) from None
    except SettingsError as exc:
        # pydantic-settings could not decode a value before validation (e.g. MEMBACKEND_MACHINE=x is not JSON)
        m = re.search(r'field "([^"]+)"', str(exc))
        field = m.group(1) if m else "settings"
        cause = f": {exc.__cause__}" if exc.__cause__ is not None else ""
        raise ConfigError(field, _source_of((field,), kwargs), f"cannot be decoded{cause}",
                          _accepted((field,)) if field in settings_cls.model_fields else "") from None
    if settings.trace is not None:
        try:
            _check_appendable(settings.trace)
        except OSError as exc:
            raise ConfigError("trace", _source_of(("trace",), kwargs),
                              f"cannot open {str(settings.trace)!r} for appending: {exc.strerror or exc}",
                              TRACE_ACCEPTED) from None
    return settings


# --------------------------------------------------------------------------- the quick path (no pydantic)


class _Plain(Exception):
    """A value the quick path does not take in plain form: :func:`load_settings` answers instead."""


_TRUE, _FALSE = frozenset({"1", "true", "yes"}), frozenset({"0", "false", "no"})
_DIGITS = re.compile(r"0|[1-9][0-9]*", re.ASCII)
_DECIMAL = re.compile(r"[0-9]+(\.[0-9]+)?", re.ASCII)


def _flag(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v in _TRUE | _FALSE:
        return v in _TRUE
    raise _Plain


def _name(v: Any) -> str:
    if isinstance(v, str) and re.fullmatch(NAME_PATTERN, v):
        return v
    raise _Plain


def _names(v: Any) -> list[str]:
    v = split_block(v)
    if not isinstance(v, list) or not all(isinstance(n, str) for n in v):
        raise _Plain
    try:
        return check_block(list(v))
    except ValueError:
        raise _Plain from None


def _size(v: Any) -> int:
    if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
        return v
    if isinstance(v, str) and _DIGITS.fullmatch(v):
        return int(v)
    raise _Plain  # units, fractions, other spellings: pydantic's ByteSize reads them


def _page(v: Any) -> int:
    try:
        return check_page_size(_size(v), v)
    except ValueError:
        raise _Plain from None


def _seconds(v: Any) -> float:
    if isinstance(v, bool) or not (isinstance(v, (int, float)) or (isinstance(v, str) and _DECIMAL.fullmatch(v))):
        raise _Plain
    try:
        x = float(v)
    except OverflowError:
        raise _Plain from None
    if not PROBE_TIMEOUT_ABOVE < x <= PROBE_TIMEOUT_MAX:
        raise _Plain
    return x


def _path(v: Any) -> Path:
    if isinstance(v, str) and v and "\x00" not in v:
        return Path(v)
    raise _Plain


#: how the quick path takes each field it reads; ``machine`` is not among them (overrides go the full path)
_PLAIN = {"backend": _name, "disable": _flag, "block": _names, "headroom": _size, "page_size": _page,
          "host_capacity": _size, "sim_profile": _name, "probe_timeout": _seconds, "sanitize": _flag,
          "trace": _path}


class _NoMachineOverrides:
    """``MachineOverrides()`` — no fact overridden — without pydantic: what :class:`QuickSettings` has as
    ``machine``. Its fields are None and ``model_dump(exclude=..., exclude_none=...)`` answers as the model's
    does; anything else is answered by a real ``MachineOverrides()``."""

    def __getattr__(self, name: str) -> Any:
        if name in MACHINE_FIELDS:
            return None
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(_models()[1](), name)

    def model_dump(self, *, exclude: Any = None, exclude_none: bool = False, **other: Any) -> dict[str, Any]:
        if other:
            return _models()[1]().model_dump(exclude=exclude, exclude_none=exclude_none, **other)
        if exclude_none:
            return {}
        return {k: None for k in MACHINE_FIELDS if not (exclude and k in exclude)}

    def __repr__(self) -> str:
        return "MachineOverrides(" + ", ".join(f"{k}=None" for k in MACHINE_FIELDS) + ")"


class QuickSettings:
    """The values :func:`load_settings` gives, read without pydantic (see :func:`quick_settings`).

    Every field of :class:`Settings` is an attribute with the same value (``machine`` overrides nothing).
    Anything else a caller asks for (``model_dump``, ``model_fields``, ...) is answered by the equal
    :class:`Settings` that :meth:`full` builds on first such use."""

    def __init__(self, values: dict[str, Any], given: frozenset[str] = frozenset()):
        self.__dict__.update(values)
        self.machine = _NoMachineOverrides()
        self._given = given  # the fields a source set (the model's ``model_fields_set``)
        self._full: Any = None

    def full(self) -> "Settings":
        """The equal :class:`Settings`, made from these values alone: they passed the rules already, and
        the environment or the files may have changed since (``Settings(...)`` would read them again)."""
        if self._full is None:
            models = _models()
            values = {k: getattr(self, k) for k in FIELDS if k != "machine"}
            self._full = models[2].model_construct(set(self._given), **values, machine=models[1]())
        return self._full

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_full", "_given"):
            raise AttributeError(name)
        return getattr(self.full(), name)

    def __repr__(self) -> str:
        return " ".join(f"{k}={getattr(self, k)!r}" for k in FIELDS)


def quick_settings() -> "QuickSettings | Settings":
    """What ``load_settings()`` gives, without importing pydantic when every value is in plain form.

    It reads the same sources in the same order (``MEMBACKEND_*`` variables, the
    ``membackend.toml`` in force, ``[tool.membackend]`` in ``pyproject.toml``,
    the defaults), first refusing broken config files exactly as
    :func:`load_settings` does, and applies the same rules (:data:`NAME_PATTERN`,
    :func:`split_block` / :func:`check_block`, :func:`check_page_size`, the
    probe timeout's range, the trace file's check). It takes a value only in a
    plain form whose meaning is certain: a backend or profile name, a boolean
    as ``1/0/true/false/yes/no`` (or a TOML boolean), a size as a whole number
    of bytes, a timeout as a decimal number, a path. Everything else — units in
    a size, other spellings, machine overrides, variable names in lower case or
    with ``__``, unknown keys in a file, and every value that breaks a rule —
    is handed to :func:`load_settings`, which answers (or raises the
    :class:`~membackend.types.ConfigError`) as it always does. So both give the
    same values and the same errors. Returns a :class:`QuickSettings`, or the
    :class:`Settings` that :func:`load_settings` built.
    """
    _check_config_files()
    raw: dict[str, Any] = {}
    sources = (_read_toml(Path("pyproject.toml"), PYPROJECT_TABLE), _read_toml(config_file()))
    for data in sources:  # lowest precedence first: each later source overrides
        for key, value in data.items():
            if key not in _PLAIN:
                return load_settings()  # machine overrides, unknown keys
            raw[key] = value
    for key, value in os.environ.items():
        if not key.upper().startswith(ENV_PREFIX):
            continue
        name = key[len(ENV_PREFIX):]
        if key != key.upper() or "__" in name:
            return load_settings()  # matched case-insensitively, or nested: the full path's rules
        name = name.lower()
        if name == "machine":
            return load_settings()
        if name in _PLAIN:
            raw[name] = value
        # any other MEMBACKEND_* variable (MEMBACKEND_CONFIG, a plugin's own) is no setting: ignored, as there
    values: dict[str, Any] = dict(DEFAULTS, block=[])
    try:
        for key, value in raw.items():
            values[key] = _PLAIN[key](value)
    except _Plain:
        return load_settings()
    if values["trace"] is not None:
        try:
            _check_appendable(values["trace"])
        except OSError:
            return load_settings()  # raises the ConfigError naming the cause and the source
    return QuickSettings(values, frozenset(raw))
