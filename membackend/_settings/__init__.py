"""Settings, from (highest precedence first): explicit kwargs, ``MEMBACKEND_*`` environment variables, a
``membackend.toml`` (path from ``MEMBACKEND_CONFIG``, else the current directory), ``[tool.membackend]``
in ``pyproject.toml`` in the current directory, then defaults (``docs/settings.md`` has every setting).

One set of rules for every path:

* :mod:`.rules` -- one parser per setting and the one table of fields
  (:data:`~.rules.FIELDS`), no pydantic;
* :mod:`.sources` -- the sources, read once, their precedence, the source of
  every value, and the settings a platform declares under its own name;
* :mod:`.model` -- the pydantic :class:`Settings` (and the machine override
  models), built on first use from the same table, and :func:`load_settings`;
* :mod:`.quick` -- :func:`quick_settings`, the same resolution without
  pydantic, for the ComfyUI adapter's prestartup script;
* :mod:`.typed` -- the models' fields as a type checker sees them (imported
  for type checking only).

Every bad value becomes a :class:`~membackend.types.ConfigError` that names
the key, where the value came from and what is accepted. Importing this
package does not import pydantic: the models are built on first access
(``membackend._settings.Settings``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .model import load_settings
from .quick import QuickSettings, quick_settings
from .rules import DEVICE_FIELDS as _DEVICE_TABLE
from .rules import FIELDS as _TABLE
from .rules import (
    FLAG_ACCEPTED,
    HOST_PAGE_SIZE,
    NAME_PATTERN,
    PROBE_TIMEOUT_ABOVE,
    PROBE_TIMEOUT_MAX,
    QUOTE_LIMIT,
    SIZE_ACCEPTED,
    SIZE_MAX,
    TRACE_ACCEPTED,
    UNITS,
    Rule,
    RuleError,
    format_bytes,
    parse_bytes,
    quoted,
)
from .rules import MACHINE_FIELDS as _MACHINE_TABLE
from .save import save_setting
from .sources import (
    CONFIG_ACCEPTED,
    CONFIG_ENV,
    CONFIG_NAME,
    ENV_PREFIX,
    PYPROJECT_TABLE,
    PlatformValues,
    Sources,
    config_file,
    platform_env_name,
    resolve_platform,
)

if TYPE_CHECKING:  # built by model.models() on first use; the names resolve through __getattr__ below
    from .typed import DeviceOverride, MachineOverrides, Settings

__all__ = ["Settings", "MachineOverrides", "DeviceOverride", "load_settings", "parse_bytes", "format_bytes",
           "config_file", "save_setting", "quick_settings", "QuickSettings", "SIZE_ACCEPTED", "SIZE_MAX",
           "QUOTE_LIMIT", "quoted", "NAME_PATTERN", "PlatformValues",
           "Rule", "RuleError", "FLAG_ACCEPTED", "HOST_PAGE_SIZE", "PROBE_TIMEOUT_ABOVE", "PROBE_TIMEOUT_MAX",
           "TRACE_ACCEPTED", "UNITS", "CONFIG_ACCEPTED", "CONFIG_ENV", "CONFIG_NAME", "ENV_PREFIX", "PYPROJECT_TABLE",
           "Sources", "platform_env_name", "resolve_platform"]

#: the names of the fields of :class:`Settings`, :class:`MachineOverrides` and :class:`DeviceOverride`, in order
#: (the tables themselves, with each field's rule, are :data:`.rules.FIELDS` and its neighbours)
FIELDS: tuple[str, ...] = tuple(f.name for f in _TABLE)
MACHINE_FIELDS: tuple[str, ...] = tuple(f.name for f in _MACHINE_TABLE)
DEVICE_FIELDS: tuple[str, ...] = tuple(f.name for f in _DEVICE_TABLE)
#: the default of every field of :class:`Settings` but ``block`` (an empty list) and ``machine`` (no fact
#: overridden)
DEFAULTS: dict[str, Any] = {f.name: f.default for f in _TABLE if f.factory is None and f.table is None}

_MODEL_NAMES = ("DeviceOverride", "MachineOverrides", "Settings")


def __getattr__(name: str) -> Any:
    """The models are built on first access (PEP 562), so importing this package costs no pydantic."""
    if name in _MODEL_NAMES:
        from .model import models

        return models()[_MODEL_NAMES.index(name)]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
