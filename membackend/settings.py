"""Settings, from (highest precedence first): explicit kwargs, ``MEMBACKEND_*``
environment variables, a ``membackend.toml`` (path from ``MEMBACKEND_CONFIG``,
else the current directory), ``[tool.membackend]`` in ``pyproject.toml`` in the
current directory, then defaults.

Every bad value becomes a :class:`~membackend.types.ConfigError` that names the
key, where the value came from and what is accepted.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ByteSize, ConfigDict, Field, TypeAdapter, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    SettingsError,
    NoDecode,
    PydanticBaseSettingsSource,
    PyprojectTomlConfigSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from .types import DEVICE_KINDS, ConfigError

__all__ = ["Settings", "MachineOverrides", "DeviceOverride", "load_settings", "parse_bytes", "config_file"]

ENV_PREFIX = "MEMBACKEND_"
CONFIG_ENV = "MEMBACKEND_CONFIG"
CONFIG_NAME = "membackend.toml"
NAME_PATTERN = r"^[a-z][a-z0-9_\-]*$"
TRACE_ACCEPTED = "a path to a file that can be opened for appending (missing parent directories are created)"
CONFIG_ACCEPTED = "the path of an existing UTF-8 TOML file"

_BYTE_SIZE = TypeAdapter(ByteSize)
SIZE_ACCEPTED = (
    "a byte count >= 0: an int, or a number and a unit like '512MiB', '1.5GB', '2 GiB'; units in any case: "
    "b, k/kb, m/mb, g/gb, t/tb, p/pb, e/eb (powers of 1000), kib, mib, gib, tib, pib, eib (powers of 1024)"
)


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
    try:
        n = int(_BYTE_SIZE.validate_python(value))
    except ValidationError as exc:
        raise ValueError(f"{value!r} is not a size ({exc.errors()[0]['msg']})") from None
    if n < 0:  # ByteSize refuses "-1" and -1 already; kept so the contract does not hang on that
        raise ValueError(f"{value!r} is negative")
    return n


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
        if v is not None and v.lower() not in ("wddm", "tcc", "mcdm"):
            raise ValueError(f"unknown driver model {v!r}")
        return v.lower() if v else v


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
        if v is not None and v.lower() not in ("linux", "windows", "darwin"):
            raise ValueError(f"unknown OS {v!r}")
        return v.lower() if v else v

    @field_validator("torch_vendor")
    @classmethod
    def _vendor(cls, v: str | None) -> str | None:
        if v is not None and v.lower() not in ("cuda", "rocm", "cpu"):
            raise ValueError(f"unknown torch vendor {v!r}")
        return v.lower() if v else v


def config_file() -> Path:
    """The ``membackend.toml`` in force: ``$MEMBACKEND_CONFIG`` or ``./membackend.toml``."""
    return Path(os.environ.get(CONFIG_ENV) or CONFIG_NAME)


class Settings(BaseSettings):
    """Every setting of membackend; build it with :func:`load_settings`."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
        pyproject_toml_table_header=("tool", "membackend"),
        validate_default=True,
    )

    backend: str | None = Field(
        None, pattern=NAME_PATTERN,
        description="force this backend by name",
        json_schema_extra={"accepted": "the name of an installed backend (see `membackend backends`)"},
    )
    disable: bool = Field(
        False, description="switch membackend off: callers use their legacy path",
        json_schema_extra={"accepted": "true/false, 1/0, yes/no"},
    )
    block: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="backend names never to select",
        json_schema_extra={"accepted": "a comma-separated list of backend names other than 'host'"},
    )
    headroom: int | None = Field(
        None, description="bytes kept free on every device (default: the backend's own)",
        json_schema_extra={"accepted": SIZE_ACCEPTED},
    )
    page_size: int | None = Field(
        None, description="host backend page size in bytes (default 2 MiB)",
        json_schema_extra={"accepted": "a power of two, a multiple of the OS page size, e.g. '2MiB'"},
    )
    host_capacity: int | None = Field(
        None, description="cap on what the host backend may keep resident (default: no cap)",
        json_schema_extra={"accepted": SIZE_ACCEPTED},
    )
    sim_profile: str | None = Field(
        None, pattern=NAME_PATTERN,
        description="run GPU backends on a simulated machine; the names are checked where the simulation "
                    "lives, when backends are loaded",
        json_schema_extra={"accepted": "wddm-6gb, rocm-win-2gpu, gb10-128gb, h200"},
    )
    probe_timeout: float = Field(
        10.0, gt=0, le=600,
        description="seconds each backend's probe may take before it is skipped as broken",
        json_schema_extra={"accepted": "a number of seconds, > 0 and <= 600"},
    )
    sanitize: bool = Field(
        False, description="check every free/release for pending work and use after release",
        json_schema_extra={"accepted": "true/false, 1/0, yes/no"},
    )
    trace: Path | None = Field(
        None, description="append one JSON line per verb call and policy decision to this file",
        json_schema_extra={"accepted": TRACE_ACCEPTED},
    )
    machine: MachineOverrides = Field(
        default_factory=MachineOverrides,
        json_schema_extra={"accepted": "a table (in the environment: a JSON object) with keys os, cpus, ram_total, "
                                      "ram_available, cgroup_limit, torch_version, torch_vendor, devices; or one "
                                      "variable per key, e.g. MEMBACKEND_MACHINE__OS=linux"},
    )

    @field_validator("block", mode="before")
    @classmethod
    def _split_block(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = [part.strip() for part in v.split(",") if part.strip()]
        return v

    @field_validator("block")
    @classmethod
    def _check_block(cls, v: list[str]) -> list[str]:
        for name in v:
            if not re.match(NAME_PATTERN, name):
                raise ValueError(f"{name!r} is not a backend name")
            if name == "host":
                raise ValueError("'host' is the fallback and cannot be blocked")
        return v

    @field_validator("headroom", "host_capacity", mode="before")
    @classmethod
    def _size(cls, v: Any) -> int | None:
        return None if v is None else parse_bytes(v)

    @field_validator("page_size", mode="before")
    @classmethod
    def _page_size(cls, v: Any) -> int | None:
        if v is None:
            return None
        n = parse_bytes(v)
        os_page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        if n < os_page or n & (n - 1) or n % os_page:
            raise ValueError(f"{v!r} is not a power of two multiple of the OS page ({os_page})")
        return n

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


# --------------------------------------------------------------------------- errors


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
    if _lookup(_read_toml(Path("pyproject.toml"), ("tool", "membackend")), path[:1]):
        return "pyproject.toml [tool.membackend]"
    return "default"


def _accepted(path: tuple[Any, ...]) -> str:
    model: Any = Settings
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


def load_settings(**kwargs: Any) -> Settings:
    """Build :class:`Settings`; any bad value raises ``ConfigError`` (key, source, accepted).

    Besides the values themselves this checks that ``MEMBACKEND_CONFIG``, when
    set, names an existing file, that the TOML files are UTF-8 TOML, and that
    ``trace`` can be opened for appending.
    """
    _check_config_files()
    try:
        settings = Settings(**kwargs)
    except ValidationError as exc:
        err = exc.errors()[0]
        path = tuple(err["loc"])
        key = ".".join(str(p) for p in path) or "settings"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
            parent = _accepted(path[:-1] + ("__none__",)) if len(path) > 1 else "one of: " + ", ".join(Settings.model_fields)
            raise ConfigError(key, _source_of(path, kwargs), msg, parent) from None
        raise ConfigError(key, _source_of(path, kwargs), f"{msg} (got {err.get('input')!r})", _accepted(path)) from None
    except SettingsError as exc:
        # pydantic-settings could not decode a value before validation (e.g. MEMBACKEND_MACHINE=x is not JSON)
        m = re.search(r'field "([^"]+)"', str(exc))
        field = m.group(1) if m else "settings"
        cause = f": {exc.__cause__}" if exc.__cause__ is not None else ""
        raise ConfigError(field, _source_of((field,), kwargs), f"cannot be decoded{cause}",
                          _accepted((field,)) if field in Settings.model_fields else "") from None
    if settings.trace is not None:
        try:
            _check_appendable(settings.trace)
        except OSError as exc:
            raise ConfigError("trace", _source_of(("trace",), kwargs),
                              f"cannot open {str(settings.trace)!r} for appending: {exc.strerror or exc}",
                              TRACE_ACCEPTED) from None
    return settings
