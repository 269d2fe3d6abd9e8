"""Typed settings for every kvroute service, read from defaults < a YAML file < env < CLI flags.

Every service (router, sidecar, simulated pod, replay client) declares one ``BaseSettings``
subclass. ``load_settings`` turns it into an argparse parser whose flags are the settings' fields
(``block_size`` -> ``--block-size``, the field description as help), so ``--help`` documents every
knob and a new setting is one typed line. The YAML file comes from ``--config FILE`` or the
``<PREFIX>CONFIG`` environment variable. Environment variables use the class's ``env_prefix``
(``KVROUTE_`` for the router, ``KVROUTE_SIM_`` for the simulated pod, ...), with ``__`` between
nested fields. Lists and mappings given as flags or env vars are JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

S = TypeVar("S", bound=BaseSettings)


class ConfigError(ValueError):
    """A settings file or flag that cannot be used; the message says which and why."""


class _MappingSource(PydanticBaseSettingsSource):
    """A settings source over an already-parsed mapping (the YAML file)."""

    def __init__(self, settings_cls: type[BaseSettings], data: dict[str, Any]):
        super().__init__(settings_cls)
        self._data = data

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self._data.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self._data)


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse a YAML settings file into a mapping, with a clear error for anything else."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text()) if p.stat().st_size else {}
    except FileNotFoundError as exc:
        raise ConfigError(f"config file not found: {p}") from exc
    except yaml.YAMLError as exc:
        # where and what, never the lines themselves: the file may hold API keys and other secrets
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise ConfigError(f"config file {p} is not valid YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a mapping at the top level, not {type(data).__name__}")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def build_settings(cls: type[S], overrides: dict[str, Any] | None = None, file_data: dict[str, Any] | None = None) -> S:
    """Instantiate ``cls`` with precedence overrides (CLI) > env > ``file_data`` (YAML) > defaults."""
    file_data = dict(file_data or {})

    def sources(_cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings):
        return (init_settings, env_settings, _MappingSource(settings_cls, file_data))

    layered = types.new_class(cls.__name__, (cls,), {}, lambda ns: ns.update(
        {"settings_customise_sources": classmethod(sources), "__module__": cls.__module__}))
    return layered(**(overrides or {}))


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _is_scalar(annotation: Any) -> tuple[bool, type | None]:
    """(True, python type) for str/int/float/bool (optionally Optional or a Literal), else (False, None)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return _is_scalar(args[0])
        return False, None
    if origin is typing.Literal:
        values = typing.get_args(annotation)
        return True, type(values[0]) if values else str
    if annotation in (str, int, float, bool):
        return True, annotation
    return False, None


def add_settings_arguments(parser: argparse.ArgumentParser, cls: type[BaseSettings]) -> None:
    """Add one flag per field of ``cls`` (plus ``--config``) to ``parser``."""
    prefix = cls.model_config.get("env_prefix", "")
    parser.add_argument("--config", metavar="FILE", default=None,
                        help=f"YAML settings file (env {prefix}CONFIG); flags and env override it")
    for name, field in cls.model_fields.items():
        scalar, typ = _is_scalar(field.annotation)
        default = field.get_default(call_default_factory=True)
        desc = (field.description or "").rstrip(".")
        if isinstance(default, BaseModel):
            default = default.model_dump()
        shown = json.dumps(default) if not isinstance(default, str) else default
        help_text = f"{desc} (default: {shown}; env {prefix}{name.upper()})"
        choices = None
        if typing.get_origin(field.annotation) is typing.Literal:
            choices = list(typing.get_args(field.annotation))
        if scalar and typ is bool:
            parser.add_argument(_flag(name), dest=name, default=argparse.SUPPRESS,
                                action=argparse.BooleanOptionalAction, help=help_text)
        elif scalar and typ is not None:  # a scalar always has its type
            parser.add_argument(_flag(name), dest=name, default=argparse.SUPPRESS, type=typ,
                                choices=choices, help=help_text)
        else:
            parser.add_argument(_flag(name), dest=name, default=argparse.SUPPRESS, type=_json_arg,
                                metavar="JSON", help=help_text)


def _json_arg(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        # not the text itself: it may be a list of API keys
        raise argparse.ArgumentTypeError(f"expected JSON ({exc.msg} at character {exc.pos})") from None


def settings_from_args(cls: type[S], args: argparse.Namespace) -> S:
    """Build ``cls`` from a namespace produced by a parser given ``add_settings_arguments``."""
    prefix = cls.model_config.get("env_prefix", "")
    config_path = getattr(args, "config", None) or os.environ.get(f"{prefix}CONFIG")
    file_data = read_yaml(config_path) if config_path else {}
    overrides = {k: v for k, v in vars(args).items() if k in cls.model_fields}
    return build_settings(cls, overrides, file_data)


def load_settings(cls: type[S], argv: list[str] | None, prog: str, description: str) -> S:
    """Parse ``argv`` for a service whose whole command line is its settings."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_settings_arguments(parser, cls)
    args = parser.parse_args(argv)
    try:
        return settings_from_args(cls, args)
    except (ConfigError, ValueError) as exc:
        parser.error(settings_error(exc))
        raise  # unreachable: parser.error exits


def settings_error(exc: Exception) -> str:
    """What was wrong with the settings, without the values given (a key or a token may be one)."""
    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}"
                         for e in exc.errors(include_url=False, include_input=False, include_context=False))
    return str(exc)
