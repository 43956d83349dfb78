"""Settings <-> flags: one `--field-name` per field of a service's config dataclass
(specd.serving.config), defaulting to SPECD_FIELD_NAME from the environment or the field's default."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Sequence
from typing import Any, TypeVar, get_type_hints

from specd.core.errors import InvalidArgument
from specd.serving.config import ServiceBase


def _parse_bool(raw: str) -> bool:
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(raw)


def _env_default(name: str, kind: Any, default: Any, choices: Sequence[str] | None = None) -> Any:
    raw = os.environ.get(f"SPECD_{name.upper()}")
    if raw is None:
        return default
    try:
        value = kind(raw)
    except ValueError as exc:
        raise InvalidArgument(
            f"SPECD_{name.upper()}={raw!r} is not a valid {getattr(kind, '__name__', 'value')}"
        ) from exc
    if choices is not None and value not in choices:
        raise InvalidArgument(f"SPECD_{name.upper()}={raw!r} must be one of {', '.join(choices)}")
    return value


def add_arguments(parser: argparse.ArgumentParser, cls: type, *, skip: tuple[str, ...] = ()) -> None:
    """One flag per dataclass field, defaulting to SPECD_<FIELD> or the field default."""
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        kind = hints[f.name]
        if kind is bool:
            parser.add_argument(
                f"--{f.name.replace('_', '-')}",
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=_env_default(f.name, _parse_bool, f.default),
                help=f"{f.metadata.get('help', '')} (default: %(default)s)",
            )
            continue
        parser.add_argument(
            f"--{f.name.replace('_', '-')}",
            dest=f.name,
            type=kind,
            default=_env_default(f.name, kind, f.default, f.metadata.get("choices")),
            choices=f.metadata.get("choices"),
            help=f"{f.metadata.get('help', '')} (default: %(default)s)",
        )


C = TypeVar("C", bound=ServiceBase)  # a service's config class


def from_args(cls: type[C], args: argparse.Namespace, **overrides: Any) -> C:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    values.update(overrides)
    config = cls(**values)
    config.validate()
    return config
