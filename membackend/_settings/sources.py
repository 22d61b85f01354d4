"""Where settings come from, in which order, and the value of each one with the source that gave it.

Precedence, highest first:

1. keyword arguments (``load_settings(headroom="1GiB")``): source ``kwargs``;
2. environment variables ``MEMBACKEND_<KEY>`` (``MEMBACKEND_MACHINE__<KEY>``
   for one machine fact): source ``env <NAME>``. Names match in any case (two
   spellings of one name set to different values are refused, naming both);
   a variable that is empty or only blanks counts as not set;
3. the config file: ``$MEMBACKEND_CONFIG`` when set (it must name a file),
   else ``./membackend.toml``: source its path;
4. ``[tool.membackend]`` in ``./pyproject.toml``: source
   ``pyproject.toml [tool.membackend]``;
5. the default: source ``default``.

Each source is read once, into :class:`Sources`; :func:`resolve` applies the
rules of :mod:`.rules` to the winning value of every field and names its
source, and :func:`resolve_platform` does the same for the settings a platform
declares, under the platform's name: ``MEMBACKEND_<PLATFORM>_<NAME>``, a
``[<platform>]`` table in the config file, ``[tool.membackend.<platform>]`` in
``pyproject.toml``, a ``<platform>={...}`` keyword argument. In a file or the
keyword arguments a key that is no setting is refused (``unknown key``),
unless it holds a table: that is a platform's table, checked when the platform
is loaded. Any other ``MEMBACKEND_*`` variable is left alone (``membackend
doctor`` lists those nothing reads).
"""

from __future__ import annotations

import os
import stat
import tomllib
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

from ..types import ConfigError
from .rules import (
    _NAME,
    BY_NAME,
    FIELD_NAMES,
    FIELDS,
    FILES_ACCEPTED,
    MACHINE_FIELDS,
    RuleError,
    _json,
    os_reason,
    out_of_files,
    quoted,
    shown,
)

__all__ = ["Sources", "Resolved", "PlatformValues", "resolve", "resolve_platform", "platform_env_name",
           "config_file", "ENV_PREFIX", "CONFIG_ENV", "CONFIG_NAME", "PYPROJECT_LABEL"]

ENV_PREFIX = "MEMBACKEND_"
CONFIG_ENV = "MEMBACKEND_CONFIG"
CONFIG_NAME = "membackend.toml"
PYPROJECT = "pyproject.toml"
PYPROJECT_TABLE = ("tool", "membackend")
PYPROJECT_LABEL = "pyproject.toml [tool.membackend]"
MACHINE_ENV = ENV_PREFIX + "MACHINE"
CONFIG_ACCEPTED = "the path of an existing UTF-8 TOML file"
DEFAULT = "default"
TOP_ACCEPTED = ("one of: " + ", ".join(FIELD_NAMES) + "; or a table named after a platform, holding the settings "
                "it declares")


SPELLINGS_ACCEPTED = ("one spelling of each variable (names match in any case), or the same value in every "
                      "spelling")


def _environment() -> dict[str, tuple[str, str]]:
    """Every ``MEMBACKEND_*`` variable that is set to something: upper-cased name -> (name as set, value).

    Names match in any case, so two spellings of one name (``membackend_backend`` and
    ``Membackend_Backend``, or either beside ``MEMBACKEND_BACKEND``) are one variable set twice: with
    different values that is a ``ConfigError`` naming every spelling and its value, since which one would
    win depends on the order of the environment, which the user does not see. With one value, the
    upper-case spelling (else the first) names it."""
    found: dict[str, tuple[str, str]] = {}
    twice: dict[str, list[tuple[str, str]]] = {}
    for key, value in os.environ.items():
        upper = key.upper()
        if not upper.startswith(ENV_PREFIX) or not value.strip():
            continue
        if upper in found:
            twice.setdefault(upper, [found[upper]]).append((key, value))
        if upper not in found or key == upper:
            found[upper] = (key, value)
    for upper, spellings in sorted(twice.items()):
        if len({value for _, value in spellings}) > 1:
            spellings.sort()
            raise ConfigError(upper, " and ".join(f"env {key}" for key, _ in spellings),
                              "one variable set in several spellings, with different values: "
                              + ", ".join(f"{key}={quoted(value)}" for key, value in spellings),
                              SPELLINGS_ACCEPTED)
    return found


def config_file() -> Path:
    """The ``membackend.toml`` in force: ``$MEMBACKEND_CONFIG`` or ``./membackend.toml``."""
    named = _environment().get(CONFIG_ENV)
    return Path(named[1] if named else CONFIG_NAME)


def _is_file(path: Path, source: str) -> bool:
    """Whether ``path`` is a file (following links); False for nothing there. A path that cannot even be
    looked up -- a part of it longer than the file system allows, a folder on the way this user may not
    search, a NUL byte -- is a ``ConfigError`` (key ``config``) naming ``source``, not an ``OSError``."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as exc:
        raise ConfigError("config", source, f"{shown(path)} cannot be looked up: {os_reason(exc)}",
                          FILES_ACCEPTED if out_of_files(exc) else CONFIG_ACCEPTED) from None
    except ValueError:  # an embedded NUL byte
        raise ConfigError("config", source, f"{quoted(str(path))} is not a path (it holds a NUL byte)",
                          CONFIG_ACCEPTED) from None


def read_toml(path: Path, table: tuple[str, ...] = ()) -> dict[str, Any]:
    """The TOML table at ``table`` in ``path``; ``{}`` when the file does not exist.

    Raises ``ConfigError`` (key ``config``, the file as source) for a file
    that cannot be looked up or read, is not UTF-8 or is not TOML.
    """
    if not _is_file(path, shown(path)):
        return {}
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        held = out_of_files(exc)
        raise ConfigError("config", shown(path), f"cannot be read: {os_reason(exc)}",
                          FILES_ACCEPTED if held else CONFIG_ACCEPTED) from None
    except UnicodeDecodeError as exc:  # tomllib decodes as UTF-8 and lets this through
        raise ConfigError("config", shown(path), f"not UTF-8 text ({exc.reason} at byte {exc.start})",
                          CONFIG_ACCEPTED) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("config", shown(path), f"not valid TOML: {exc}", CONFIG_ACCEPTED) from None
    for key in table:
        data = data.get(key, {}) if isinstance(data, dict) else {}
    return data if isinstance(data, dict) else {}


def platform_env_name(platform: str, key: str) -> str:
    """The variable of a platform's setting: ``MEMBACKEND_<PLATFORM>_<KEY>`` (a ``-`` in the name is ``_``)."""
    return f"{ENV_PREFIX}{platform.upper().replace('-', '_')}_{key.upper()}"


class Sources:
    """Everything settings are read from, read once: the keyword arguments, the ``MEMBACKEND_*`` variables
    (see :func:`_environment`), the config file's top table and its label, and ``[tool.membackend]``.
    Equal when every part is; read-only by convention.

    :meth:`read` refuses a ``MEMBACKEND_CONFIG`` that names no file, and files
    that cannot be read or are not UTF-8 TOML, with a ``ConfigError`` naming
    the file.
    """

    __hash__ = None  # type: ignore[assignment]  # holds dicts

    def __init__(self, kwargs: dict[str, Any] | None = None, env: dict[str, tuple[str, str]] | None = None,
                 config_label: str = CONFIG_NAME, config: dict[str, Any] | None = None,
                 pyproject: dict[str, Any] | None = None):
        self.kwargs = kwargs if kwargs is not None else {}
        self.env = env if env is not None else {}
        self.config_label = config_label
        self.config = config if config is not None else {}
        self.pyproject = pyproject if pyproject is not None else {}

    def _parts(self) -> tuple[Any, ...]:
        return self.kwargs, self.env, self.config_label, self.config, self.pyproject

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sources) and self._parts() == other._parts()

    def __repr__(self) -> str:
        return (f"Sources(kwargs={self.kwargs!r}, env={sorted(self.env)!r}, config={self.config_label!r}, "
                f"pyproject keys={sorted(self.pyproject)!r})")

    @classmethod
    def read(cls, kwargs: Mapping[str, Any] | None = None) -> "Sources":
        env = _environment()
        named = env.get(CONFIG_ENV)
        if named is not None:
            path = Path(named[1])
            if not _is_file(path, f"env {named[0]}"):
                what = "is a directory" if path.is_dir() else "does not exist"
                raise ConfigError("config", f"env {named[0]}", f"{quoted(named[1])} {what}", CONFIG_ACCEPTED)
        else:
            path = Path(CONFIG_NAME)
        config = read_toml(path)
        pyproject = read_toml(Path(PYPROJECT), PYPROJECT_TABLE)
        # the file's label names it in every error and in the doctor: one line, whatever its name holds
        return cls(dict(kwargs or {}), env, shown(path), config, pyproject)

    # ------------------------------------------------------------------ lookups, highest precedence first

    def layers(self) -> Iterator[tuple[str, Mapping[str, Any]]]:
        """The sources that are tables of keys, highest first: (label, table)."""
        yield "kwargs", self.kwargs
        yield self.config_label, self.config
        yield PYPROJECT_LABEL, self.pyproject

    def find(self, key: str) -> tuple[Any, str] | None:
        """The winning raw value of one of membackend's own settings and its source; None: the default."""
        if key in self.kwargs:
            return self.kwargs[key], "kwargs"
        var = self.env.get(ENV_PREFIX + key.upper())
        if var is not None:
            return var[1], f"env {var[0]}"
        if key in self.config:
            return self.config[key], self.config_label
        if key in self.pyproject:
            return self.pyproject[key], PYPROJECT_LABEL
        return None

    def platform_layers(self, platform: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
        """A platform's tables, highest first: (label, table)."""
        for label, table in (("kwargs", self.kwargs.get(platform)),
                             (f"{self.config_label} [{platform}]", self.config.get(platform)),
                             (f"pyproject.toml [tool.membackend.{platform}]", self.pyproject.get(platform))):
            if isinstance(table, Mapping):
                yield label, table

    def find_platform(self, platform: str, key: str) -> tuple[Any, str] | None:
        """The winning raw value of a platform's setting and its source; None: the platform's default."""
        layers = list(self.platform_layers(platform))
        if layers and layers[0][0] == "kwargs" and key in layers[0][1]:
            return layers[0][1][key], "kwargs"
        var = self.env.get(platform_env_name(platform, key))
        if var is not None:
            return var[1], f"env {var[0]}"
        for label, table in layers:
            if label != "kwargs" and key in table:
                return table[key], label
        return None

    def platform_tables(self) -> set[str]:
        """The names of every platform table in the files and keyword arguments."""
        return {key for _, table in self.layers() for key, value in table.items()
                if key not in BY_NAME and isinstance(value, Mapping)}

    def unread_env(self, also_read: Iterable[str] = ()) -> list[str]:
        """The ``MEMBACKEND_*`` variables that are set but are none of membackend's settings, nor
        ``MEMBACKEND_CONFIG``, nor one of ``also_read`` (the installed platforms' variables)."""
        known = {ENV_PREFIX + f.upper() for f in FIELD_NAMES} | {CONFIG_ENV} | {n.upper() for n in also_read}
        return sorted(name for upper, (name, _) in self.env.items()
                      if upper not in known and not upper.startswith(MACHINE_ENV + "__"))


class Resolved:
    """The outcome of :func:`resolve`: every field's value (``machine``: the given facts, checked), the
    source of each given value (``"headroom"``, ``"machine.os"``), the fields some source gave, and the
    sources themselves (for the platforms' settings, resolved later from the same reading)."""

    __slots__ = ("values", "origins", "given", "sources")

    def __init__(self, values: dict[str, Any], origins: dict[str, str], given: frozenset[str],
                 sources: Sources | None):
        self.values, self.origins, self.given, self.sources = values, origins, given, sources

    def source_of(self, key: str) -> str:
        return self.origins.get(key, DEFAULT)


def _key(*path: Any) -> str:
    return ".".join(str(p) for p in path)


def _refused(exc: RuleError, source: str, *prefix: Any, accepted: str) -> ConfigError:
    return ConfigError(_key(*prefix, *exc.path), source, exc.message,
                       exc.accepted if exc.accepted is not None else accepted)


def _machine_layers(sources: Sources) -> list[tuple[str, dict[str, Any]]]:
    """The machine tables, highest first, each a (source, {fact: raw value}); the per-fact variables are one
    layer each, so every fact names its own variable."""
    layers: list[tuple[str, dict[str, Any]]] = []
    accepted = BY_NAME["machine"].accepted

    def table(value: Any, source: str) -> dict[str, Any]:
        if hasattr(value, "model_dump"):  # a MachineOverrides given as it is
            value = value.model_dump(exclude_unset=True)
        if isinstance(value, str):
            try:
                value = _json(value)
            except RuleError as exc:
                raise ConfigError("machine", source, exc.message, accepted) from None
        if not isinstance(value, Mapping):
            raise ConfigError("machine", source, f"{value!r} is not a table", accepted)
        return dict(value)

    if "machine" in sources.kwargs:
        layers.append(("kwargs", table(sources.kwargs["machine"], "kwargs")))
    for upper, (var, value) in sorted(sources.env.items()):
        if upper.startswith(MACHINE_ENV + "__"):
            layers.append((f"env {var}", {upper[len(MACHINE_ENV) + 2:].lower(): value}))
    whole = sources.env.get(MACHINE_ENV)
    if whole is not None:
        layers.append((f"env {whole[0]}", table(whole[1], f"env {whole[0]}")))
    for label, top in ((sources.config_label, sources.config), (PYPROJECT_LABEL, sources.pyproject)):
        if "machine" in top:
            layers.append((label, table(top["machine"], label)))
    return layers


def _resolve_machine(sources: Sources, origins: dict[str, str]) -> dict[str, Any]:
    layers = _machine_layers(sources)
    facts = {f.name: f for f in MACHINE_FIELDS}
    one_of = "one of: " + ", ".join(facts)
    for source, table in layers:
        for key in table:
            if key not in facts:
                raise ConfigError(_key("machine", key), source, "unknown key", one_of)
    given: dict[str, Any] = {}
    for fact in MACHINE_FIELDS:
        found = next(((table[fact.name], source) for source, table in layers if fact.name in table), None)
        if found is None:
            continue
        raw, source = found
        try:
            given[fact.name] = fact.rule(raw)
        except RuleError as exc:
            raise _refused(exc, source, "machine", fact.name, accepted=fact.accepted) from None
        origins["machine." + fact.name] = source
    return given


def resolve(sources: Sources) -> Resolved:
    """Every field of :data:`~.rules.FIELDS`: the winning value through its rule, or its default.

    Raises :class:`~membackend.types.ConfigError` naming the key (a dotted
    path inside a table: ``machine.devices.0.kind``), its source and what is
    accepted, for the first bad value in the order of the fields, after any
    unknown key in a file or the keyword arguments.
    """
    for label, table in sources.layers():
        for key, value in table.items():
            if key not in BY_NAME and not (isinstance(value, Mapping) and isinstance(key, str)
                                           and _NAME.fullmatch(key)):
                raise ConfigError(str(key), label, "unknown key", TOP_ACCEPTED)
    values: dict[str, Any] = {}
    origins: dict[str, str] = {}
    given: set[str] = set()
    for f in FIELDS:
        if f.table is not None:
            values[f.name] = _resolve_machine(sources, origins)
            if values[f.name]:
                given.add(f.name)
                origins[f.name] = next(origins[k] for k in origins if k.startswith(f.name + "."))
            continue
        found = sources.find(f.name)
        if found is None:
            values[f.name] = f.default_value()
            continue
        raw, source = found
        try:
            values[f.name] = f.rule(raw)
        except RuleError as exc:
            raise _refused(exc, source, f.name, accepted=f.accepted) from None
        origins[f.name] = source
        given.add(f.name)
    return Resolved(values, origins, frozenset(given), sources)


# --------------------------------------------------------------------------- the platforms' settings


class PlatformValues(Mapping[str, Any]):
    """The values of the settings one platform declares (``values["headroom"]``), with where each came
    from (:meth:`source`: ``env MEMBACKEND_CUDA_WDDM_HEADROOM``, a file's table, ``kwargs``, ``default``)
    and the variable that sets it (:meth:`env_name`). Read-only; equal to a dict of the same values."""

    __slots__ = ("platform", "_values", "_origins", "_kinds")

    def __init__(self, platform: str, values: Mapping[str, Any], origins: Mapping[str, str] | None = None,
                 kinds: Mapping[str, str] | None = None):
        self.platform = platform
        self._values = dict(values)
        self._origins = dict(origins or {})
        self._kinds = dict(kinds or {})

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def source(self, key: str) -> str:
        """Where the value of ``key`` came from (``default`` when no source gave it)."""
        if key not in self._values:
            raise KeyError(key)
        return self._origins.get(key, DEFAULT)

    def env_name(self, key: str) -> str:
        """The environment variable that sets ``key``."""
        return platform_env_name(self.platform, key)

    def kind(self, key: str) -> str:
        """The kind of the rule that read ``key`` (``size``, ``flag``, ...; ``value`` for a plugin's own)."""
        return self._kinds.get(key, "value")

    def __repr__(self) -> str:
        return f"PlatformValues({self.platform!r}, {self._values!r})"


def resolve_platform(platform: str, declared: Sequence[Any], sources: Sources) -> PlatformValues:
    """The values of the settings ``platform`` declares (``PlatformSetting`` records: ``name``, ``parse``,
    ``default``, ``accepted``), each from the first source that gives it, through its own ``parse``.

    A value of None (a keyword argument) is the default. Raises
    :class:`~membackend.types.ConfigError` with the key ``<platform>.<name>``
    for a value its ``parse`` refuses (its ``ValueError`` is the message) and
    for a key in the platform's tables that it does not declare.
    """
    names = [d.name for d in declared]
    for label, table in sources.platform_layers(platform):
        for key in table:
            if key not in names:
                raise ConfigError(_key(platform, key), label, "unknown key",
                                  "one of: " + ", ".join(names) if names else
                                  f"nothing: platform {platform!r} declares no settings")
    values: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for d in declared:
        found = sources.find_platform(platform, d.name)
        if found is None or found[0] is None:
            values[d.name] = d.default
            continue
        raw, source = found
        try:
            values[d.name] = d.parse(raw)
        except RuleError as exc:
            raise _refused(exc, source, platform, d.name, accepted=d.accepted) from None
        except ValueError as exc:
            raise ConfigError(_key(platform, d.name), source, str(exc), d.accepted) from None
        origins[d.name] = source
    kinds = {d.name: getattr(d.parse, "kind", "value") for d in declared}
    return PlatformValues(platform, values, origins, kinds)
