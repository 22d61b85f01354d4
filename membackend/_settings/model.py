"""The pydantic models, built on first use from the tables of :mod:`.rules`, and :func:`load_settings`.

:class:`Settings`, :class:`MachineOverrides` and :class:`DeviceOverride` have
one field per entry of :data:`~.rules.FIELDS`, :data:`~.rules.MACHINE_FIELDS`
and :data:`~.rules.DEVICE_FIELDS` (its default, its meaning as the
description, what it accepts as ``json_schema_extra["accepted"]``), and one
validator that puts every given value through the field's rule: built
directly (``Settings(headroom="1GiB")``) they accept what the settings accept.
The models read no source themselves: :func:`load_settings` reads the sources
(:mod:`.sources`) and builds the model from the values it resolved.

Importing this module does not import pydantic (about 0.3 s); :func:`models`
does, once.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from .rules import DEVICE_FIELDS, FIELDS, MACHINE_FIELDS, Field
from .sources import Resolved, Sources, resolve

if TYPE_CHECKING:
    from pydantic.json_schema import JsonDict

    from .typed import Settings

__all__ = ["models", "construct", "load_settings"]

MODULE = "membackend._settings"  # where the models are importable (and picklable) from


@functools.cache
def models() -> tuple[Any, Any, Any]:
    """``(DeviceOverride, MachineOverrides, Settings)``, built once."""
    from pydantic import BaseModel, ConfigDict, PrivateAttr, create_model, model_validator
    from pydantic import Field as ModelField

    def ruled(name: str, fields: tuple[Field, ...], doc: str, base: type[BaseModel] = BaseModel,
              annotations: dict[str, Any] | None = None) -> Any:
        rules = {f.name: f.rule for f in fields}

        def apply_rules(cls: Any, data: Any) -> Any:
            if isinstance(data, dict):  # the rules raise ValueError: pydantic reports it as the field's error
                return {k: rules[k](v) if rules.get(k) is not None else v for k, v in data.items()}
            return data

        spec: dict[str, Any] = {}  # field name: (annotation, FieldInfo)
        for f in fields:
            kind = (annotations or {}).get(f.name, f.annotation)
            extra: JsonDict = {"accepted": f.accepted}
            if f.factory is not None:
                spec[f.name] = (kind, ModelField(default_factory=f.factory, description=f.doc or None,
                                                 json_schema_extra=extra))
            else:
                spec[f.name] = (kind, ModelField(f.default, description=f.doc or None, json_schema_extra=extra))
        # model_validator makes apply_rules (first parameter: cls) a classmethod; __validators__ takes what
        # pydantic's decorators return, though its annotation says callables
        validators: dict[str, Any] = {"_apply_rules": model_validator(mode="before")(apply_rules)}
        model = create_model(name, __base__=base, __module__=MODULE, __doc__=doc, __validators__=validators, **spec)
        model.__qualname__ = name
        return model

    class _Strict(BaseModel):
        model_config = ConfigDict(extra="forbid")

    device = ruled("DeviceOverride", DEVICE_FIELDS, "One device of a simulated machine (see "
                                                     "``MachineOverrides.devices``).", _Strict)
    machine = ruled("MachineOverrides", MACHINE_FIELDS,
                    "Facts that replace what discovery would find, so tests can be any machine.\n\n"
                    "Env form: ``MEMBACKEND_MACHINE__OS=windows``, ``MEMBACKEND_MACHINE__DEVICES="
                    "'[{\"kind\": \"cuda\", \"total_memory\": \"6GiB\", \"driver_model\": \"wddm\"}]'``.",
                    _Strict, {"devices": list[device] | None})  # type: ignore[valid-type]

    class _SettingsBase(_Strict):
        _origins: dict[str, str] = PrivateAttr(default_factory=dict)
        _sources: Any = PrivateAttr(default=None)

        def source_of(self, key: str) -> str:
            """Where the value of ``key`` (``"headroom"``, ``"machine.os"``) came from: ``kwargs``,
            ``env MEMBACKEND_...``, a file, or ``default``."""
            return self._origins.get(key, "default")

        def snapshot(self) -> Sources | None:
            """The sources these values were read from (None: the model was built directly); the settings a
            platform declares are resolved from the same reading."""
            return self._sources

    settings = ruled("Settings", FIELDS, "Every setting of membackend; build it with :func:`load_settings`.",
                     _SettingsBase, {"machine": machine})
    return device, machine, settings


def construct(resolved: Resolved) -> Settings:
    """The :class:`Settings` of values that passed the rules (no validation again), with their sources."""
    device, machine, settings = models()
    values = dict(resolved.values)
    facts = dict(values.pop("machine"))
    if facts.get("devices") is not None:
        facts["devices"] = [device.model_construct(set(d), **d) for d in facts["devices"]]
    built = settings.model_construct(set(resolved.given), **values, machine=machine.model_construct(set(facts),
                                                                                                    **facts))
    built._origins = dict(resolved.origins)
    built._sources = resolved.sources
    return built


def load_settings(**kwargs: Any) -> Settings:
    """Read every source once (kwargs win; see :mod:`membackend._settings.sources`) and build
    :class:`Settings`; any bad value raises ``ConfigError`` (key, source, what is accepted).

    Besides the values themselves this checks that ``MEMBACKEND_CONFIG``, when
    set, names an existing file, that the TOML files are UTF-8 TOML, and that
    ``trace`` can be opened for appending. A keyword argument holding a table
    under a platform's name (``cuda_wddm={"headroom": "1GiB"}``) sets that
    platform's declared settings.
    """
    return construct(resolve(Sources.read(kwargs)))
